"""The driver of a generation: the prefill, the bootstrap and the two-row decode step over every
layer's cache, the speculative token, and how a host plugs SpeCache in (`SpeCache`'s docstring)."""

from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Optional

import torch
from torch import Tensor

from specache.config import SpeCacheConfig
from specache.guess import GUESSES
from specache.layer import Probe, SpeCacheLayer
from specache.pinned import PinnedTier
from specache.state import BOOTSTRAP, DECODE, SpeCacheState
from specache.tiers import RamTier


class SpeCache:
    """SpeCache for `n_layers` attention layers of a model with `n_heads` query and `n_kv_heads`
    KV heads of `head_dim`, in `dtype` on `device`, for `batch_size` sequences of up to
    `max_seq_length` positions (rounded up to a whole group: `capacity`).

    Plug `layers[i]` in as the i-th attention layer's KV cache: the layer hands it the new rows'
    q (B, H, S, D) and k, v (B, Hkv, S, D) after RoPE, with their positions (B, S), and uses what
    it returns as the attention output (B, H, S, D). The host's positional table must reach
    position `capacity` (the speculative row sits one past the last real one). Then, with
    `forward(tokens (B, S), positions (B, S)) -> logits (B, S, V)` the host model's pass:

        cache.begin(prompts, lengths)     # right-padded prompts (B, S) and their lengths (B,)
        logits = forward(prompts, positions)   # prefill, in one piece or in chunks
        cache.sampled(first)              # the first new token (B, 1)
        cache.bootstrap(forward, first, lengths[:, None])
        for each step:                    # positions: where `token` sits (B, 1)
            logits = cache.step(forward, token, positions)   # the real row's logits (B, 1, V)
            token = sample(logits); cache.sampled(token)
        cache.finish()
    """

    def __init__(
        self,
        config: SpeCacheConfig,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        batch_size: int,
        max_seq_length: int,
        device: torch.device,
        dtype: torch.dtype,
        probe: Optional[Probe] = None,
    ):
        config.validate(head_dim)
        group = config.method.group
        self.capacity = -(-max_seq_length // group) * group
        self.config, self.device, self.probe = config, torch.device(device), probe
        self.pair_dtype = config.placement.pair_dtype_for(dtype)  # window, slots, slow tier
        self.state = SpeCacheState(
            config,
            batch_size,
            self.capacity,
            self.device,
            head_dim,
            self.pair_dtype,
            n_heads // n_kv_heads,
        )
        make_tier = config.placement.slow_tier
        if make_tier is None and self.device.type == "cuda":
            executor = ThreadPoolExecutor(1, thread_name_prefix="specache-fetch")
            make_tier = partial(PinnedTier, executor=executor)
        self.layers = [
            SpeCacheLayer(
                self.state,
                i,
                n_heads,
                n_kv_heads,
                head_dim,
                self.pair_dtype,
                self.device,
                make_tier or RamTier,
                probe,
            )
            for i in range(n_layers)
        ]
        self.speculative = config.method.speculative and config.method.topk > 0
        self.guess_next: Callable[[Tensor, Tensor, Tensor], Tensor] = GUESSES[
            config.selection.guess
        ]
        # per sequence: its real tokens (for prompt lookup), the next guess, the guesses that held
        ids = dict(dtype=torch.long, device=self.device)
        self.token_history = torch.zeros(batch_size, self.capacity + 1, **ids)
        self.history_len = torch.zeros(batch_size, **ids)
        self.guess = torch.zeros(batch_size, 1, **ids)
        self.matches = torch.zeros(batch_size, **ids)
        self.guessed_from: Optional[Tensor] = None  # the speculative rows' logits, last step

    def begin(self, tokens: Tensor, lengths: Tensor, held: int = 0) -> None:
        """A generation of the prompts `tokens` (B, S, right-padded to `lengths`) starts: every
        per-generation buffer and count is reset, and the next passes are its prefill. `held` >
        0: each sequence holds that many tokens already (earlier turns, kept by the last
        `finish(keep=True)`), which the prompts continue."""
        if held and self.state.held() != [held] * len(self.state.held()):
            raise ValueError(
                f"the cache holds {self.state.held()} tokens per sequence, not "
                f"{held}: a continued generation starts where the last one ended"
            )
        self.state.begin((held + lengths).tolist())
        for layer in self.layers:
            layer.reset()
        if self.probe is not None:
            self.probe.reset()
        if not held:
            self.token_history.zero_()
        self.token_history[:, held : held + tokens.shape[1]] = tokens
        self.history_len = held + lengths
        self.guessed_from = None
        self.matches.zero_()

    def bootstrap(
        self, forward: Callable[[Tensor, Tensor], Tensor], first: Tensor, positions: Tensor
    ) -> None:
        """T1 alone: it chooses kappa_1 and guesses T'2; its K, V are not kept. Eager (once per
        generation)."""
        if self.speculative:
            self.state.phase = BOOTSTRAP
            with torch.compiler.set_stance("force_eager"):
                logits = forward(first, positions)
            self.guess = self.guess_next(logits[:, -1], self.token_history, self.history_len)

    def step(
        self, forward: Callable[[Tensor, Tensor], Tensor], token: Tensor, positions: Tensor
    ) -> Tensor:
        """A decode step: rows [T_t, T'_{t+1}] at [p, p + 1] (or T_t alone, not speculative); the
        real row's logits (B, 1, V)."""
        return self.stepped(forward(*self.step_rows(token, positions)))

    def step_rows(self, token: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """`step`'s first half: the rows the step's pass takes, and their positions. A caller
        that runs several caches' rows in one pass (serving/serve.py) calls the halves itself."""
        self.state.phase = DECODE
        if not self.speculative:
            return token, positions
        return torch.cat([token, self.guess], 1), torch.cat([positions, positions + 1], 1)

    def stepped(self, logits: Tensor) -> Tensor:
        """`step`'s second half, after the pass: the real row's logits (B, 1, V)."""
        if self.speculative:
            self.guessed_from, self.guess_was = logits[:, 1], self.guess
        self.advance()
        return logits[:, :1]

    def sampled(self, token: Tensor) -> None:
        """The real token (B, 1) the host sampled: kept in the history; the next guess, from the
        speculative row's logits."""
        batch = torch.arange(token.shape[0], device=token.device)
        self.token_history[batch, self.history_len] = token[:, 0]
        self.history_len.add_(1)
        if self.guessed_from is not None:
            self.matches += (self.guess_was == token)[:, 0]
            self.guess = self.guess_next(self.guessed_from, self.token_history, self.history_len)

    def finish(self, keep: bool = False) -> None:
        """The generation ended, or failed: the last prefetch has landed. With `keep`, what the
        cache holds stays for a continuation (`begin(..., held)`)."""
        for layer in self.layers:
            layer.tier.before_step()

    def advance(self) -> None:
        """After a step that kept the real rows: count them into the windows, and flush full
        windows."""
        state = self.state
        selectable = state.host_selectable_len()
        state.window_len += 1
        state.host_window_len = [r + 1 for r in state.host_window_len]
        full = [b for b in range(len(state.host_window_len)) if self.flush_if_full(b)]
        if full or state.host_selectable_len() != selectable:
            state.sync()

    def flush_if_full(self, b: int) -> bool:
        """Sequence b's window holds R + g tokens (its newest counted on the host): every layer
        flushes its oldest group into the low-bit copy. Whether it did."""
        state, g = self.state, self.config.method.group
        if state.host_window_len[b] != state.residual + g:
            return False
        for layer in self.layers:
            layer.flush_window(b)
        state.host_quantized_len[b] += g
        state.host_window_len[b] -= g
        return True
