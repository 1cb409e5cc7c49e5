"""A minimal gpt-fast-style Llama with SpeCache, on torch and a copy of specache/ beside it.

    python minimal_host.py job.pt    # writes job.out.pt

tests/test_host.py copies this file and specache/ alone into an empty folder and runs it in a
fresh interpreter. The job holds the weights, the shapes, SpeCache's settings, the prompts and the
device; the output, each sequence's greedy tokens and every pass's logits after the prefill.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import specache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def apply_rope(x, freqs):
    """x (B, S, H, D) rotated pairwise, (x[2i], x[2i+1]), by angles freqs (B, S, D/2, 2)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = freqs[..., 0].unsqueeze(2), freqs[..., 1].unsqueeze(2)
    rotated = [pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin]
    return torch.stack(rotated, -1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c["n_head"], c["n_local_heads"], c["head_dim"]
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.wqkv = nn.Linear(c["dim"], width, bias=False)
        self.wo = nn.Linear(self.heads * self.head_dim, c["dim"], bias=False)
        self.kv_cache = None

    def forward(self, x, freqs, input_pos):
        b, s, _ = x.shape
        sizes = [self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2
        q, k, v = self.wqkv(x).split(sizes, dim=-1)
        q = apply_rope(q.view(b, s, self.heads, self.head_dim), freqs).transpose(1, 2)
        k = apply_rope(k.view(b, s, self.kv_heads, self.head_dim), freqs).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        y = self.kv_cache(q, k, v, input_pos)  # SpeCache: attention over everything the cache holds
        return self.wo(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.w1 = nn.Linear(c["dim"], c["intermediate_size"], bias=False)
        self.w3 = nn.Linear(c["dim"], c["intermediate_size"], bias=False)
        self.w2 = nn.Linear(c["intermediate_size"], c["dim"], bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.attention, self.feed_forward = Attention(c), FeedForward(c)
        self.attention_norm = RMSNorm(c["dim"], c["norm_eps"])
        self.ffn_norm = RMSNorm(c["dim"], c["norm_eps"])

    def forward(self, x, freqs, input_pos):
        h = x + self.attention(self.attention_norm(x), freqs, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c["vocab_size"], c["dim"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["n_layer"]))
        self.norm = RMSNorm(c["dim"], c["norm_eps"])
        self.output = nn.Linear(c["dim"], c["vocab_size"], bias=False)
        self.rope_base, self.head_dim = c["rope_base"], c["head_dim"]

    def setup_rope(self, positions: int) -> None:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        frequencies = 1.0 / self.rope_base**exponents
        angles = torch.outer(torch.arange(positions, dtype=torch.float64), frequencies)
        table = torch.stack([angles.cos(), angles.sin()], -1).float()
        self.freqs_cis = table.to(self.output.weight.device)

    def forward(self, idx, input_pos):
        x, freqs = self.tok_embeddings(idx), self.freqs_cis[input_pos]
        for layer in self.layers:
            x = layer(x, freqs, input_pos)
        return self.output(self.norm(x))


@torch.no_grad()
def main(job_path: str) -> None:
    job = torch.load(job_path, weights_only=True)
    c, prompts, new_tokens = job["model"], job["prompts"], job["new_tokens"]
    device = torch.device(job["device"])
    model = Transformer(c).eval()
    model.load_state_dict(job["weights"])
    model.to(device)
    config = specache.SpeCacheConfig(
        specache.Method(**job["method"]),
        specache.Selection.parse(job["select"]),
        specache.Placement(pair_dtype=job["pair_dtype"]),
    )
    batch, longest = len(prompts), max(map(len, prompts))
    shape = (c["n_layer"], c["n_head"], c["n_local_heads"], c["head_dim"])
    cache = specache.SpeCache(config, *shape, batch, job["max_seq_length"], device, torch.float32)
    for block, layer in zip(model.layers, cache.layers):
        block.attention.kv_cache = layer
    model.setup_rope(cache.capacity + 1)  # the speculative row sits one past the last real one

    passes = []

    def forward(tokens, input_pos):
        passes.append(model(tokens, input_pos))
        return passes[-1]

    lengths = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.zeros(batch, longest, dtype=torch.long, device=device)
    for b, prompt in enumerate(prompts):
        tokens[b, : len(prompt)] = torch.tensor(prompt)
    cache.begin(tokens, lengths)
    logits = forward(tokens, torch.arange(longest, device=device).expand(batch, -1))  # prefill
    token = logits[torch.arange(batch, device=device), lengths - 1].argmax(-1, keepdim=True)
    cache.sampled(token)
    position = lengths[:, None]
    cache.bootstrap(forward, token, position)
    out = [token]
    for _ in range(new_tokens - 1):
        token = cache.step(forward, token, position)[:, -1].argmax(-1, keepdim=True)
        cache.sampled(token)
        out.append(token)
        position = position + 1
    cache.finish()
    result = {"tokens": torch.cat(out, 1).tolist(), "logits": [x.cpu() for x in passes[1:]]}
    torch.save(result, job_path.replace(".pt", ".out.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
