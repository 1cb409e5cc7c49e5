"""SpeCache's mixed-precision attention: our fused path against FlexAttention, per layer step.

    python scripts/bench_kernels.py --lengths 2048 4096 16384

Shapes of SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64), batch 1, two new rows, k = 64,
a window of R + g = 128, the defaults' 1-bit copy with g = 64. Methods:
- fused: `kernels.attention.mixed_attention` (scales folded into the query and the weights, packed
  codes unpacked inside the compiled kernel), which also returns the per-position weights the top-k
  needs;
- flex: the low-bit copy dequantized into float K and V, the fetched pairs written into their
  places, the window and the new rows appended, and one compiled FlexAttention call whose mask_mod
  hides what each row may not see. FlexAttention returns no attention weights, so choosing kappa
  would take a further scoring pass that this timing leaves out, in flex's favour;
- reference: `mixed_attention_reference` (eager), for scale.
Each is checked against the reference before it is timed; the table reports ms per call (one
layer) and the speed-up of fused over flex.
"""
import argparse
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels.attention import Segments, mixed_attention, mixed_attention_reference  # noqa: E402
from kernels.quant import LowBitKV  # noqa: E402
from kernels.quant import dequantize_keys, dequantize_values, quantize_keys, quantize_values  # noqa: E402

N_HEADS, N_KV, HEAD_DIM, ROWS, TOPK, WINDOW, BITS, GROUP = 9, 3, 64, 2, 64, 128, 1, 64


def make_inputs(t: int):
    g = torch.Generator().manual_seed(t)
    k = torch.randn(1, N_KV, t, HEAD_DIM, generator=g) * torch.linspace(0.2, 4, HEAD_DIM)
    v = torch.randn(1, N_KV, t, HEAD_DIM, generator=g)
    kv = LowBitKV(*quantize_keys(k, BITS, GROUP, torch.float16), *quantize_values(v, BITS, GROUP, torch.float16),
                  BITS, GROUP)
    quantized_len = t - WINDOW
    pos = torch.stack([torch.randperm(quantized_len, generator=g)[:TOPK] for _ in range(N_KV)]).unsqueeze(0)
    pick = lambda x: x.gather(2, pos.unsqueeze(-1).expand(-1, -1, -1, HEAD_DIM)).half()
    seg = Segments(torch.tensor([quantized_len]), pick(k), pick(v), pos, torch.ones_like(pos, dtype=torch.bool),
                   torch.randn(1, N_KV, WINDOW, HEAD_DIM, generator=g).half(),
                   torch.randn(1, N_KV, WINDOW, HEAD_DIM, generator=g).half(), torch.tensor([WINDOW - 5]),
                   torch.randn(1, N_KV, ROWS, HEAD_DIM, generator=g), torch.randn(1, N_KV, ROWS, HEAD_DIM, generator=g))
    return torch.randn(1, N_HEADS, ROWS, HEAD_DIM, generator=g), kv, seg


def flex_mixed_attention(q, kv: LowBitKV, seg: Segments):
    t, r, s = kv.k_packed.shape[2], seg.window_k.shape[2], q.shape[2]
    keys = dequantize_keys(kv.k_packed, kv.k_scale, kv.k_zero, kv.bits, kv.group)
    values = dequantize_values(kv.v_packed, kv.v_scale, kv.v_zero, kv.bits, kv.group)
    index = seg.fetched_pos.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    keys = keys.scatter(2, index, seg.fetched_k.float())
    values = values.scatter(2, index, seg.fetched_v.float())
    keys = torch.cat([keys, seg.window_k.float(), seg.new_k.float()], 2)
    values = torch.cat([values, seg.window_v.float(), seg.new_v.float()], 2)
    quantized_len, window_len = seg.quantized_len, seg.window_len

    def mask_mod(b, h, q_idx, kv_idx):
        lowbit = kv_idx < quantized_len[b]
        window = (kv_idx >= t) & (kv_idx < t + window_len[b])
        new = (kv_idx >= t + r) & (kv_idx - t - r <= q_idx)
        return lowbit | window | new

    mask = create_block_mask(mask_mod, 1, 1, s, t + r + s, device=q.device, BLOCK_SIZE=128)
    return flex_attention(q.float(), keys, values, block_mask=mask, enable_gqa=True)


def time_call(fn, *args, repeats: int = 20) -> float:
    fn(*args)
    fn(*args)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 16384])
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    fused = torch.compile(mixed_attention, fullgraph=True, dynamic=False)
    flex = torch.compile(flex_mixed_attention, fullgraph=True, dynamic=False)
    print(f"\nper layer step, batch 1, {ROWS} rows, {N_HEADS}/{N_KV} heads, head_dim {HEAD_DIM}, k={TOPK}, "
          f"{BITS}-bit, g={GROUP}, {torch.get_num_threads()} threads\n")
    print("| context | reference (eager) ms | flex (compiled) ms | fused (compiled) ms | fused vs flex |")
    print("|---|---|---|---|---|")
    for t in args.lengths:
        q, kv, seg = make_inputs(t)
        expected, _ = mixed_attention_reference(q, kv, seg)
        torch.testing.assert_close(fused(q, kv, seg)[0], expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(flex(q, kv, seg), expected, rtol=1e-4, atol=1e-4)
        times = [time_call(mixed_attention_reference, q, kv, seg, repeats=3), time_call(flex, q, kv, seg),
                 time_call(fused, q, kv, seg)]
        print(f"| {t} | {1e3 * times[0]:.2f} | {1e3 * times[1]:.2f} | {1e3 * times[2]:.2f} | "
              f"{times[1] / times[2]:.2f}x |")


if __name__ == "__main__":
    main()
