"""Prefill over a history: a prompt's chunk, or a conversation's next turn, attends over what the
cache holds already."""

import torch
from torch import Tensor

# A prompt's chunk, or a conversation's next turn, attends over what the cache holds already:
# exactly, from the slow tier, in blocks (prefill is bound by compute, and one block at a time is
# in memory), merged by each block's log-sum-exp as flash attention merges its tiles.


def history_block(
    batch: int, n_heads: int, rows: int, head_dim: int, multiple: int, budget: int = 1 << 24
) -> int:
    """How many history positions to take at a time for `rows` query rows per head: about
    `budget` float32 elements (64 MB) of scores or of K and V widened to every query head,
    whichever is larger; a multiple of `multiple`."""
    per_position = batch * n_heads * max(rows, 2 * head_dim)
    return max(multiple, budget // per_position // multiple * multiple)


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """Softmax attention of q (B, H, S, D) over k, v (B, Hkv, N, D) in float32 (causal: N = S),
    and each row's log-sum-exp of scores (B, H, S). On a CPU, ATen's flash-attention kernel
    (several times faster than `attention_with_lse_reference`, which serves elsewhere)."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if q.device.type == "cpu" and flash is not None:
        group = q.shape[1] // k.shape[1]
        k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        out, lse = flash(q.float(), k, v, 0.0, causal)
        return out, lse
    return attention_with_lse_reference(q, k, v, causal)


def attention_with_lse_reference(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, budget: int = 1 << 24
) -> tuple[Tensor, Tensor]:
    """The same in plain PyTorch, the rows in tiles of about `budget` scores."""
    b, n_heads, s, d = q.shape
    n_kv, n = k.shape[1], k.shape[2]
    rows = (q.float() * d**-0.5).view(b, n_kv, n_heads // n_kv, s, d)
    keys, values = k.float().unsqueeze(2), v.float().unsqueeze(2)
    tile = max(1, budget // (b * n_heads * n))
    outs, lses = [], []
    for first in range(0, s, tile):
        # (B, Hkv, G, tile, N)
        scores = rows[:, :, :, first : first + tile] @ keys.transpose(-1, -2)
        if causal:
            own = torch.arange(first, first + scores.shape[3], device=q.device)
            future = torch.arange(n, device=q.device) > own[:, None]
            scores = scores.masked_fill(future, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        outs.append(torch.exp(scores - lse.unsqueeze(-1)) @ values)
        lses.append(lse)
    return torch.cat(outs, 3).reshape(b, n_heads, s, d), torch.cat(lses, 3).reshape(b, n_heads, s)


def attention_after_history(q: Tensor, k: Tensor, v: Tensor, history) -> Tensor:
    """Attention of rows q (B, H, S, D) over the positions before them, given as `history`: (K, V)
    blocks (B, Hkv, n, D) in order, and causally over their own k, v (B, Hkv, S, D). One softmax,
    in float32, one block of the history in memory at a time."""
    out, lse = attention_with_lse(q, k, v, causal=True)
    for block_k, block_v in history:
        block_out, block_lse = attention_with_lse(q, block_k, block_v, causal=False)
        merged = torch.logaddexp(lse, block_lse)
        out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(
            block_lse - merged
        ).unsqueeze(-1)
        lse = merged
    return out.to(q.dtype)
