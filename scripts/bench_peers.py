"""The peers scripts/bench.py times beside our caches, on the same prompts: HF transformers'
generate (its DynamicCache, or its quantized cache through optimum-quanto) and llama.cpp through
llama-cpp-python; and the read bandwidth every row is measured against.
"""

import importlib.util
import statistics
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
    c = llm.metadata
    layers, kv_heads = int(c["llama.block_count"]), int(c["llama.attention.head_count_kv"])
    head_dim = int(c["llama.embedding_length"]) // int(c["llama.attention.head_count"])
    kv_bytes = (
        2
        * layers
        * kv_heads
        * head_dim
        * (len(prompt) + new_tokens // 2)
        * (18 / 32 if quantized_kv else 2)
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


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def quanto_available() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return False
    return True
