"""The peers scripts/bench/bench.py times beside our caches, on the same prompts: HF transformers'
generate (its DynamicCache, or its quantized cache through optimum-quanto) and llama.cpp through
llama-cpp-python; and the read bandwidth every row is measured against.
"""

import ctypes
import importlib.util
import statistics
import struct
import time
from pathlib import Path

import torch


def measure_read_bandwidth(
    device: torch.device = torch.device("cpu"), gib: float = 0.5, repeats: int = 7
) -> float:
    """Median GB/s of summing a tensor far larger than the caches, with torch's threads (CPU)."""
    x = torch.ones(int(gib * 2**30) // 4, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    x.sum()
    rates = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        x.sum()
        sync()
        rates.append(x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


class TokenClock:
    """A transformers streamer that timestamps every new token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        """Nothing to flush: only the timestamps matter."""


def bench_hf(
    hf_model, prompt: list[int], new_tokens: int, step_bytes: int, cache_implementation=None
) -> dict:
    ids = torch.tensor([prompt], device=hf_model.device)
    extra = (
        {}
        if cache_implementation is None
        else dict(
            cache_implementation=cache_implementation, cache_config=dict(backend="quanto", nbits=2)
        )
    )
    hf_model.generate(ids[:, :64], max_new_tokens=4, do_sample=False, **extra)  # warm-up
    bandwidth_before = measure_read_bandwidth(hf_model.device)
    clock = TokenClock()
    hf_model.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=clock,
        **extra,
    )
    bandwidth = (bandwidth_before + measure_read_bandwidth(hf_model.device)) / 2
    # put() is called once with the prompt, then once per new token; the first new token ends
    # prefill.
    first, last = clock.times[1], clock.times[-1]
    seconds_per_step = (last - first) / (len(clock.times) - 2)
    return dict(
        ms_per_step=1e3 * seconds_per_step,
        tok_s=1 / seconds_per_step,
        gbps=step_bytes / seconds_per_step / 1e9,
        bandwidth=bandwidth,
        fast=None,
        slow=None,
        prefill=first - clock.times[0],
    )


def bench_llama_cpp(gguf: Path, prompt: list[int], new_tokens: int, quantized_kv: bool) -> dict:
    """llama.cpp (llama-cpp-python) on the GGUF the default model comes from: the same prompt
    prefilled, then `new_tokens` greedy steps, each timed; torch's thread count. Its KV cache in
    f16 (no flash attention), or with `quantized_kv` in q4_0 (which needs flash attention)."""
    import llama_cpp
    import numpy as np

    kv_type = llama_cpp.GGML_TYPE_Q4_0 if quantized_kv else llama_cpp.GGML_TYPE_F16
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=len(prompt) + new_tokens + 8,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=quantized_kv,
        type_k=kv_type,
        type_v=kv_type,
        verbose=False,
    )
    vocab = llm.n_vocab()

    # the last token's logits (Llama.scores keeps them only with logits_all, for every token)
    def greedy() -> int:
        return int(
            np.argmax(
                np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            )
        )

    bandwidth_before = measure_read_bandwidth()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t0
    token, steps = greedy(), []
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        llm.eval([token])
        token = greedy()
        steps.append(time.perf_counter() - t0)
    bandwidth = (bandwidth_before + measure_read_bandwidth()) / 2
    seconds_per_step = statistics.median(steps)
    kv_bytes = llama_cpp_kv_bytes(
        llm, len(prompt) + new_tokens // 2, "q4_0" if quantized_kv else "f16"
    )
    step_bytes = gguf.stat().st_size + kv_bytes  # the file is the weights, bar a small header
    llm.close()
    return dict(
        ms_per_step=1e3 * seconds_per_step,
        tok_s=1 / seconds_per_step,
        gbps=step_bytes / seconds_per_step / 1e9,
        bandwidth=bandwidth,
        fast=kv_bytes,
        slow=None,
        prefill=prefill,
    )


# bytes per K or V element in llama.cpp's cache types (Q4_0, Q8_0: blocks of 32 with an fp16 scale)
KV_ELEMENT_BYTES = {"f16": 2, "q4_0": 18 / 32, "q8_0": 34 / 32}


def llama_cpp_kv_bytes(llm, positions: int, kv_type: str) -> float:
    """The K and V a llama.cpp decode step reads at `positions` positions, from the model's
    metadata (llama architecture)."""
    c = llm.metadata
    layers, kv_heads = int(c["llama.block_count"]), int(c["llama.attention.head_count_kv"])
    head_dim = int(c["llama.embedding_length"]) // int(c["llama.attention.head_count"])
    return 2 * layers * kv_heads * head_dim * positions * KV_ELEMENT_BYTES[kv_type]


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def quanto_available() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# llama.cpp on a model shape with random weights, its KV cache filled without a prefill
# ---------------------------------------------------------------------------------------------


def write_random_gguf(config, path: Path, weights: str = "q4_0", seed: int = 0) -> None:
    """A llama-architecture GGUF of `config`'s shape (config.py's ModelArgs) with random Q4_0 or
    Q8_0 matrices (the embedding and the head too) and unit norms, written tensor by tensor with
    gguf's writer. Its vocabulary is SentencePiece-shaped (specials, 256 byte tokens, then
    placeholders), enough for llama.cpp to load it; the tokens mean nothing. Each block's scale
    keeps activations at unit scale."""
    import gguf
    import numpy as np

    kind = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q8_0": gguf.GGMLQuantizationType.Q8_0}[weights]
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    code_std = 4.6 if weights == "q4_0" else 73.0  # of (q - 8) for q in 0..15, of q in -127..127
    c, rng = config, np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(c.block_size)
    writer.add_embedding_length(c.dim)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.n_head)
    writer.add_head_count_kv(c.n_local_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_base)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    file_type = gguf.LlamaFileType
    writer.add_file_type(file_type.MOSTLY_Q4_0 if weights == "q4_0" else file_type.MOSTLY_Q8_0)
    specials, byte_tokens = ["<unk>", "<s>", "</s>"], [f"<0x{i:02X}>" for i in range(256)]
    fillers = [f"<t{i}>" for i in range(len(specials) + 256, c.vocab_size)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(specials + byte_tokens + fillers)
    writer.add_token_scores([0.0] * c.vocab_size)
    token_type = gguf.TokenType
    writer.add_token_types(
        [token_type.UNKNOWN, token_type.CONTROL, token_type.CONTROL]
        + [token_type.BYTE] * 256
        + [token_type.NORMAL] * len(fillers)
    )
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    q_width, kv_width = c.n_head * c.head_dim, c.n_local_heads * c.head_dim
    shapes = {
        "token_embd.weight": (c.vocab_size, c.dim),
        "output_norm.weight": (c.dim,),
        "output.weight": (c.vocab_size, c.dim),
    }
    for i in range(c.n_layer):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (c.dim,),
            f"blk.{i}.attn_q.weight": (q_width, c.dim),
            f"blk.{i}.attn_k.weight": (kv_width, c.dim),
            f"blk.{i}.attn_v.weight": (kv_width, c.dim),
            f"blk.{i}.attn_output.weight": (c.dim, q_width),
            f"blk.{i}.ffn_norm.weight": (c.dim,),
            f"blk.{i}.ffn_gate.weight": (c.intermediate_size, c.dim),
            f"blk.{i}.ffn_up.weight": (c.intermediate_size, c.dim),
            f"blk.{i}.ffn_down.weight": (c.dim, c.intermediate_size),
        }
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            row_bytes = shape[1] // block * block_bytes
            writer.add_tensor_info(
                name, (shape[0], row_bytes), np.dtype(np.uint8), shape[0] * row_bytes, kind
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, np.float32))
            continue
        rows, width = shape
        blocks = rng.integers(0, 256, (rows, width // block, block_bytes), dtype=np.uint8)
        if weights == "q8_0":  # -128 would be outside a Q8_0 block's symmetric codes
            blocks[..., 2:][blocks[..., 2:] == 128] = 129
        scale = np.float16(1 / (code_std * width**0.5))  # each block: an fp16 scale, then codes
        blocks[..., :2] = np.frombuffer(scale.tobytes(), np.uint8)
        writer.write_tensor_data(blocks.reshape(rows, -1))
    writer.close()


def read_sequence_state(path: Path) -> dict:
    """A llama.cpp sequence state file (llama_state_seq_save_file, version 3, one stream, one
    sequence) as its parts: each layer's K rows (cells, row bytes) and V, as rows or, where
    llama.cpp keeps V transposed (f16 without flash attention), as (channel, cells, element bytes).
    """
    import numpy as np

    data = path.read_bytes()
    offset = 0

    def take(fmt: str) -> tuple:
        nonlocal offset
        values = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return values

    def array(shape: tuple[int, ...]) -> "np.ndarray":
        nonlocal offset
        size = int(np.prod(shape))
        out = np.frombuffer(data, np.uint8, size, offset).reshape(shape)
        offset += size
        return out

    magic, version, n_tokens = take("<III")
    offset += 4 * n_tokens
    streams, cells = take("<II")
    if version != 3 or streams != 1 or cells == 0:
        raise ValueError(f"{path}: not a one-stream version-3 sequence state with cells")
    for _ in range(cells):
        _, n_seq = take("<iI")
        if n_seq != 1:
            raise ValueError(f"{path}: a cell of {n_seq} sequences")
        offset += 4
    v_trans, layers = take("<II")
    keys, values = [], []
    for _ in range(layers):
        kind, row_bytes = take("<iQ")
        keys.append((kind, row_bytes, array((cells, row_bytes))))
    for _ in range(layers):
        if v_trans:
            kind, element, channels = take("<iII")
            values.append((kind, element, channels, array((channels, cells, element))))
        else:
            kind, row_bytes = take("<iQ")
            values.append((kind, row_bytes, array((cells, row_bytes))))
    if offset != len(data):
        raise ValueError(f"{path}: {len(data) - offset} bytes past the state")
    return dict(magic=magic, version=version, v_trans=v_trans, keys=keys, values=values)


def write_tiled_state(state: dict, length: int, path: Path) -> None:
    """`state`'s cells repeated to `length` cells at positions 0..length-1 of sequence 0, as a
    sequence state file that llama_state_seq_load_file takes, written layer by layer."""
    import numpy as np

    cells = state["keys"][0][2].shape[0]
    repeats = -(-length // cells)
    with path.open("wb") as f:
        f.write(struct.pack("<IIIII", state["magic"], state["version"], 0, 1, length))
        meta = np.zeros((length, 3), np.int32)  # pos, n_seq_id = 1, seq_id = 0
        meta[:, 0], meta[:, 1] = np.arange(length), 1
        f.write(meta.tobytes())
        f.write(struct.pack("<II", state["v_trans"], len(state["keys"])))
        for kind, row_bytes, rows in state["keys"]:
            f.write(struct.pack("<iQ", kind, row_bytes))
            f.write(np.tile(rows, (repeats, 1))[:length].tobytes())
        for kind, *sizes, rows in state["values"]:
            if state["v_trans"]:
                f.write(struct.pack("<iII", kind, *sizes))
                f.write(np.tile(rows, (1, repeats, 1))[:, :length].tobytes())
            else:
                f.write(struct.pack("<iQ", kind, *sizes))
                f.write(np.tile(rows, (repeats, 1))[:length].tobytes())


def bench_llama_cpp_at_length(
    gguf: Path, length: int, steps: int, kv_type: str, scratch: Path, warmup: int = 2
) -> dict:
    """llama.cpp's decode at `length` positions without a prefill: 64 tokens prefilled, their cells
    saved, tiled to `length` and loaded back (write_tiled_state), then `warmup` + `steps` greedy
    steps, each timed (median of the last `steps`). KV cache `kv_type` "f16" (no flash attention)
    or "q4_0" / "q8_0" (with it, as quantized V needs); torch's thread count."""
    import llama_cpp

    types = {
        "f16": llama_cpp.GGML_TYPE_F16,
        "q4_0": llama_cpp.GGML_TYPE_Q4_0,
        "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    }
    threads = torch.get_num_threads()
    seed_tokens = 64
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=length + warmup + steps + 8,
        n_batch=seed_tokens,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=kv_type != "f16",
        type_k=types[kv_type],
        type_v=types[kv_type],
        verbose=False,
    )
    llm.eval(list(range(300, 300 + seed_tokens)))
    seed, tiled = scratch / "seed.state", scratch / "tiled.state"
    no_tokens = (llama_cpp.llama_token * 1)()
    if not llama_cpp.llama_state_seq_save_file(llm.ctx, str(seed).encode(), 0, no_tokens, 0):
        raise RuntimeError("llama.cpp: could not save the sequence state")
    write_tiled_state(read_sequence_state(seed), length, tiled)
    loaded = ctypes.c_size_t(0)
    if not llama_cpp.llama_state_seq_load_file(
        llm.ctx, str(tiled).encode(), 0, no_tokens, 1, ctypes.byref(loaded)
    ):
        raise RuntimeError("llama.cpp: could not load the tiled sequence state")
    kv_cells = llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(llm.ctx), 0) + 1
    if kv_cells != length:
        raise RuntimeError(f"llama.cpp holds {kv_cells} positions after loading {length}")
    tiled.unlink()
    llm.n_tokens = length  # where its next token goes
    bandwidth_before = measure_read_bandwidth()
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        llm.eval([400])
        times.append(time.perf_counter() - t0)
    bandwidth = (bandwidth_before + measure_read_bandwidth()) / 2
    seconds = statistics.median(times[warmup:])
    kv_bytes = llama_cpp_kv_bytes(llm, length + warmup + steps // 2, kv_type)
    step_bytes = gguf.stat().st_size + kv_bytes  # the file is the weights, bar a small header
    llm.close()
    return dict(
        ms_per_step=1e3 * seconds,
        tok_s=1 / seconds,
        gbps=step_bytes / seconds / 1e9,
        bandwidth=bandwidth,
        fast=kv_bytes,
    )
