"""A slow, obviously-correct SpeCache decoder: the test oracle for specache/.

Written from the algorithm's specification alone; it shares no code with specache/, kernels/ or
their quantizer. Per sequence, per layer, per pass it fake-quantizes the whole
quantized span [0, Lq) from the stored 16-bit pairs, overlays the exact positions (sinks,
prefetched, real picks, window, the new rows) and takes one float32 softmax over everything.
Only models whose layers all attend over the whole context are supported.
"""

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F


def fake_quant(x, bits, levels, scale_dtype):
    """Quantize, then dequantize, float32 `x` in groups along its last dimension."""
    m, M = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    if bits == 2:
        zero, scale = m, (M - m) / 3
    elif levels == "minmax":
        zero, scale = (3 * m + M) / 4, (M - m) / 2
    else:  # 1-bit Lloyd: the two levels are the means of the halves split at the midpoint
        upper = x >= (m + M) / 2
        n_up = upper.sum(-1, keepdim=True)
        n_low = x.shape[-1] - n_up
        low_mean = torch.where(~upper, x, 0).sum(-1, keepdim=True) / n_low.clamp(min=1)
        up_mean = torch.where(upper, x, 0).sum(-1, keepdim=True) / n_up.clamp(min=1)
        low_level = torch.where(n_low > 0, low_mean, m)
        up_level = torch.where(n_up > 0, up_mean, M)
        if levels == "midway":  # each level halfway to the paper's (m + range/4, m + 3 range/4)
            low_level = (low_level + m + (M - m) / 4) / 2
            up_level = (up_level + m + 3 * (M - m) / 4) / 2
        zero, scale = low_level, up_level - low_level
    zero, scale = zero.to(scale_dtype).float(), scale.to(scale_dtype).float()
    code = torch.floor((x - zero) / scale + 0.5).clamp(0, 2**bits - 1)
    code = torch.where(scale > 0, code, torch.zeros_like(code))
    return code * scale + zero


class RefLayerCache(nn.Module):
    """One layer's state: every real token's K, V in the pair dtype, the dequantized copy of the
    groups quantized so far (float32), the next pass's prefetch P and the last row's query; its
    forward is the layer's attention for the decoder's current pass."""

    def __init__(self, dec, batch, n_kv, head_dim):
        super().__init__()
        self.dec = dec
        shape = (batch, n_kv, dec.capacity, head_dim)
        self.K = torch.zeros(shape, dtype=dec.pair_dtype)
        self.V = torch.zeros(shape, dtype=dec.pair_dtype)
        self.Kd = torch.zeros(shape)
        self.Vd = torch.zeros(shape)
        self.n = [0] * batch
        self.n_quantized = [0] * batch
        self.P = torch.zeros(batch, n_kv, dec.capacity, dtype=torch.bool)
        self.last_q = [None] * batch

    def forward(self, q, k, v, input_pos, mask):
        if self.dec.mode == "prefill":
            return self.prefill(q, k, v)
        ys = [self.one_pass(b, q[b].float(), k[b].float(), v[b].float()) for b in range(q.shape[0])]
        return torch.stack(ys).to(q.dtype)

    def prefill(self, q, k, v):
        """Ordinary causal attention over the right-padded prompts (padding comes after every real
        position, so no real row sees it); then storage holds each prompt's K, V. On top of a held
        history (one sequence), the rows see it too: exactly, or with nothing fetched (KIVI) as a
        decode step would, dequantized below Lq but the sinks."""
        G = q.shape[1] // k.shape[1]
        if self.n[0] == 0:
            y = F.scaled_dot_product_attention(
                q.float(),
                k.float().repeat_interleave(G, 1),
                v.float().repeat_interleave(G, 1),
                is_causal=True,
            )
        else:
            n, S = self.n[0], q.shape[2]
            K, V = self.K[0, :, :n].float(), self.V[0, :, :n].float()
            if self.dec.k == 0:
                Lq = max(0, n - self.dec.cfg.residual) // self.dec.cfg.group * self.dec.cfg.group
                self.quantize_up_to(0, Lq)
                low = (torch.arange(n) < Lq) & (torch.arange(n) >= min(self.dec.n_sinks, Lq))
                K = torch.where(low[:, None], self.Kd[0, :, :n], K)
                V = torch.where(low[:, None], self.Vd[0, :, :n], V)
            keys = torch.cat([K, k[0].float()], 1).repeat_interleave(G, 0)[None]
            values = torch.cat([V, v[0].float()], 1).repeat_interleave(G, 0)[None]
            visible = torch.ones(S, n + S, dtype=torch.bool)
            visible[:, n:] = torch.ones(S, S, dtype=torch.bool).tril()
            y = F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=visible)
        for b, length in enumerate(self.dec.lengths):
            self.K[b, :, self.n[b] : self.n[b] + length] = k[b, :, :length].to(self.dec.pair_dtype)
            self.V[b, :, self.n[b] : self.n[b] + length] = v[b, :, :length].to(self.dec.pair_dtype)
            self.n[b] += length
        return y.to(q.dtype)

    def quantize_up_to(self, b, Lq):
        """Groups that enter [0, Lq) are quantized once, from the pairs."""
        cfg, g = self.dec.cfg, self.dec.cfg.group
        while self.n_quantized[b] < Lq:
            j = self.n_quantized[b]
            Kg, Vg = self.K[b, :, j : j + g].float(), self.V[b, :, j : j + g].float()  # (Hkv, g, D)
            n_kv, D = Kg.shape[0], Kg.shape[2]
            # keys per channel over the group's g positions; values per token over gv channels
            self.Kd[b, :, j : j + g] = fake_quant(
                Kg.transpose(1, 2), cfg.bits, cfg.levels, self.dec.scale_dtype
            ).transpose(1, 2)
            gv = min(g, D)
            self.Vd[b, :, j : j + g] = fake_quant(
                Vg.reshape(n_kv, g, D // gv, gv),
                cfg.bits,
                "lloyd" if cfg.levels == "midway" else cfg.levels,  # midway is for keys only
                self.dec.scale_dtype,
            ).reshape(n_kv, g, D)
            self.n_quantized[b] = j + g

    def attend(self, q, k_new, v_new, keys, values, exact):
        """Rows q (H, S, D) over the n stored positions (exact ones from `keys[0]`, others from the
        dequantized `keys[1]`) and the new rows causally: outputs (H, S, D), probabilities (H, S,
        n+S)."""
        H, S, D = q.shape
        n_kv, n = exact.shape
        K = torch.cat([torch.where(exact[..., None], keys[0], keys[1]), k_new], 1)  # (Hkv, n+S, D)
        V = torch.cat([torch.where(exact[..., None], values[0], values[1]), v_new], 1)
        visible = torch.ones(S, n + S, dtype=torch.bool)
        visible[:, n:] = torch.ones(S, S, dtype=torch.bool).tril()
        qg = q.reshape(n_kv, H // n_kv, S, D)  # query head j reads KV head j // G
        scores = (qg @ K[:, None].transpose(-1, -2)) * D**-0.5
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        return (probs @ V[:, None]).reshape(H, S, D), probs.reshape(H, S, n + S)

    def heads(self, probs, how):
        """Aggregate per-query-head probabilities (H, n) over each KV head's G query heads."""
        p = probs.reshape(self.K.shape[1], -1, probs.shape[-1])
        return p.amax(1) if how == "max" else p.mean(1)

    def one_pass(self, b, q, k, v):
        dec, cfg = self.dec, self.dec.cfg
        g, R, n = cfg.group, cfg.residual, self.n[b]
        Lq = max(0, n - R) // g * g
        self.quantize_up_to(b, Lq)
        Kx, Vx = self.K[b, :, :n].float(), self.V[b, :, :n].float()
        # the dequantized copy below Lq; the window's positions are exact whatever E says
        keys = (Kx, torch.cat([self.Kd[b, :, :Lq], Kx[:, Lq:]], 1))
        values = (Vx, torch.cat([self.Vd[b, :, :Lq], Vx[:, Lq:]], 1))
        pos = torch.arange(n)
        quantized = pos < Lq
        window = ~quantized
        sinks = pos < min(dec.n_sinks, Lq)
        P = self.P[b, :, :n] & quantized
        n_kv = Kx.shape[0]

        discard = torch.zeros(n_kv, dtype=torch.bool)
        if dec.decoding and cfg.correct_below is not None and dec.k_spec > 0:
            cos = F.cosine_similarity(q[:, 0], self.last_q[b], dim=-1)
            discard = cos.reshape(n_kv, -1).mean(1) < cfg.correct_below
        E0 = sinks[None] | (P & ~discard[:, None])
        n_pick = [dec.k if d else dec.k_real for d in discard.tolist()]
        picks = torch.zeros(n_kv, n, dtype=torch.bool)
        if max(n_pick) > 0:
            probs0 = self.attend(q[:, :1], k[:, :1], v[:, :1], keys, values, E0 | window)[1][
                :, 0, :n
            ]
            # with row 0's fully exact attention: its weights ("mass"), or how far off ours are
            if cfg.oracle:
                everything = torch.ones(n_kv, n, dtype=torch.bool)
                exact = self.attend(q[:, :1], k[:, :1], v[:, :1], keys, values, everything)[1][
                    :, 0, :n
                ]
                score = self.heads(
                    exact if cfg.oracle == "mass" else (exact - probs0).abs(), "mean"
                )
            else:
                score = self.heads(probs0, cfg.gqa)
            candidates = quantized[None] & ~E0
            if cfg.shortlist:  # the copy lists n per pick; the listed positions' exact keys decide
                listed = torch.zeros(n_kv, n, dtype=torch.bool)
                for h in range(n_kv):
                    listed[h, dec.top(score[h], candidates[h], cfg.shortlist * n_pick[h])] = True
                q0 = q[:, 0].reshape(n_kv, -1, q.shape[-1])  # (Hkv, G, D)
                exact_score, copy_score = (
                    (q0 @ x.transpose(-1, -2)) * q.shape[-1] ** -0.5 for x in keys
                )
                # a listed position's probability had its key been exact, in probs0's normalizer
                probs = probs0.reshape(n_kv, -1, n) * torch.exp(exact_score - copy_score)
                score, candidates = self.heads(probs.reshape(-1, n), cfg.gqa), listed
            for h in range(n_kv):
                picks[h, dec.top(score[h], candidates[h], n_pick[h])] = True
        E = E0 | picks
        y, probs = self.attend(q, k, v, keys, values, E | window)

        if cfg.speculative and dec.k_spec > 0:
            self.P[b] = False
            selectable = Lq + g if (n - Lq) + 1 == R + g else Lq
            candidates = (pos >= dec.n_sinks) & (pos < selectable)
            score = self.heads(probs[:, -1, :n], cfg.gqa)
            for h in range(n_kv):
                self.P[b, h, dec.top(score[h], candidates, dec.k_spec)] = True
        self.last_q[b] = q[:, -1].clone()
        if dec.decoding:
            self.K[b, :, n] = k[:, 0].to(dec.pair_dtype)
            self.V[b, :, n] = v[:, 0].to(dec.pair_dtype)
            self.n[b] = n + 1
        return y


def lookup_guess(history, logits_row):
    """Prompt lookup: the token after the latest earlier occurrence of the last 3, 2 or 1 tokens."""
    for size in (3, 2, 1):
        if len(history) <= size:
            continue
        tail = history[-size:]
        for i in range(len(history) - size - 1, -1, -1):
            if history[i : i + size] == tail:
                return history[i + size]
    return int(logits_row.argmax())


class ReferenceDecoder:
    def __init__(self, model, config, max_seq_length, oracle=None):
        """`config`: a specache.SpeCacheConfig, read field by field; `oracle`: "error" or "mass"
        (the real row chooses all k pairs from its exact scores), or None."""
        cfg = SimpleNamespace(
            **vars(config.method),
            **vars(config.selection),
            pair_dtype=config.placement.pair_dtype,
            oracle=oracle,
        )
        self.model, self.cfg = model, cfg
        g = cfg.group
        self.capacity = (max_seq_length + g - 1) // g * g
        self.k = min(cfg.topk, self.capacity)
        self.k_real = (
            self.k if (not cfg.speculative or cfg.oracle) else int(self.k * cfg.real_share + 0.5)
        )
        self.k_spec = self.k - self.k_real
        self.n_sinks = min(cfg.sinks, self.capacity)
        model_dtype = model.tok_embeddings.weight.dtype
        half = (torch.float16, torch.bfloat16)
        self.pair_dtype = cfg.pair_dtype or (model_dtype if model_dtype in half else torch.float16)
        self.scale_dtype = self.pair_dtype if self.pair_dtype in half else torch.float16
        self.mode, self.decoding, self.lengths = "prefill", False, []
        self.min_gap = float("inf")

    def top(self, score, candidates, m):
        """The (at most) m candidate positions of highest score. Records in min_gap how close the
        last one picked came to the best one left out (relative): ties there make any order
        right."""
        order = score.masked_fill(~candidates, float("-inf")).sort(descending=True)
        m = min(m, int(candidates.sum()))
        if 0 < m < int(candidates.sum()):
            kth, next_best = order.values[m - 1], order.values[m]
            self.min_gap = min(self.min_gap, float((kth - next_best) / kth) if kth > 0 else 0.0)
        return order.indices[:m]

    def run(self, tokens, input_pos, output_index=None):
        m = self.model
        x = m.embed(tokens)
        for layer, freqs_cis in zip(m.layers, m.rope(input_pos)):
            x = layer(x, input_pos, freqs_cis, None)
        return m.head(x, output_index)

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, held=0):
        """Greedy: (tokens, N per sequence with T1; every pass's logits after prefill, in order).
        `held` > 0: one prompt that continues the last generation, whose cache holds `held` tokens
        (all it had but its last token, which this prompt starts with)."""
        m, cfg, B = self.model, self.cfg, len(prompts)
        c = m.config
        assert all(c.window(i) is None for i in range(c.n_layer)), (
            "sliding-window layers are not supported"
        )
        saved = ([layer.attention.kv_cache for layer in m.layers], m.freqs_cis, m.freqs_cis_local)
        try:
            m.setup_rope(self.capacity + 2)
            if not held:
                self.caches = [
                    RefLayerCache(self, B, c.n_local_heads, c.head_dim) for _ in m.layers
                ]
                self.history = [[] for _ in prompts]
            assert not held or (B == 1 and all(cache.n == [held] for cache in self.caches))
            for layer, cache in zip(m.layers, self.caches):
                layer.attention.kv_cache = cache
                cache.P.zero_()  # a generation's first prefetch comes from its bootstrap
            self.lengths = [len(p) for p in prompts]
            padded = torch.zeros(B, max(self.lengths), dtype=torch.long)
            for b, p in enumerate(prompts):
                padded[b, : len(p)] = torch.tensor(p)
            self.mode, self.decoding = "prefill", False
            pos = held + torch.arange(padded.shape[1]).expand(B, -1)
            last = torch.tensor(self.lengths)[:, None] - 1
            first = self.run(padded, pos, last)[:, -1].float().argmax(-1).tolist()
            history = [h[:held] + list(p) + [t] for h, p, t in zip(self.history, prompts, first)]
            self.history = history
            out = [[t] for t in first]
            all_logits = []
            self.mode = "pass"
            speculative = cfg.speculative and self.k > 0
            guess_of = (
                (lambda b, row: lookup_guess(history[b], row))
                if cfg.guess == "lookup"
                else (lambda b, row: int(row.argmax()))
            )
            if speculative:  # bootstrap: [T1] at n, appends nothing, yields the first guess
                self.decoding = False
                logits = self.run(
                    torch.tensor(first)[:, None], held + torch.tensor(self.lengths)[:, None]
                )
                all_logits.append(logits)
                guesses = [guess_of(b, logits[b, -1].float()) for b in range(B)]
            self.decoding = True
            for step in range(max_new_tokens - 1):
                n = torch.tensor([held + L + step for L in self.lengths])
                current = torch.tensor([o[-1] for o in out])
                if speculative:
                    tokens = torch.stack([current, torch.tensor(guesses)], 1)
                    input_pos = torch.stack([n, n + 1], 1)
                else:
                    tokens, input_pos = current[:, None], n[:, None]
                logits = self.run(tokens, input_pos)
                all_logits.append(logits)
                for b in range(B):
                    t = int(logits[b, 0].float().argmax())
                    out[b].append(t)
                    history[b].append(t)
                if speculative:
                    guesses = [guess_of(b, logits[b, 1].float()) for b in range(B)]
            return out, all_logits
        finally:
            for layer, cache in zip(m.layers, saved[0]):
                layer.attention.kv_cache = cache
            m.freqs_cis, m.freqs_cis_local = saved[1], saved[2]
