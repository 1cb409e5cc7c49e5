"""The server's engine (serving/batching.py) on a tiny random model, without HTTP: sequences that
join a running batch and leave it decode what generation.generate decodes alone, and a kept
conversation continues as chat.py continues one."""

import threading
import time

import pytest
import torch

import caches.full
from caches.by_name import make_cache
from caches.full import FullCache, KernelKVCache
from serving.batching import Engine, Sequence, Slot
from model import KVCache
import specache.rows
from specache import RamTier, SpeCacheLayer
from generation import GenerateOptions, generate
from tests.conftest import tiny_model

CAPACITY = 256
CHUNK = 32  # prompts of 40-120 tokens take 2-4 passes
SMALL = dict(topk=8, group=16, residual=16)
METHODS = {
    "full": ("full", {}),
    "specache": ("specache-1bit", SMALL),
    "specache-disk": ("specache-1bit", dict(SMALL, slow_tier="disk")),
    # the sparse pass's mean values are per row too (kept and restored with the copy)
    "specache-sparse": ("specache-1bit:sparse=4", SMALL),
    "kivi": ("kivi-1bit", dict(group=16, residual=16)),
}
# sliding-window layers (a ring of 16) beside full ones: a prompt chunk's rows in a pass must reach
# its ring with their own mask, not the other sequences'
HYBRID = dict(
    n_layer=3,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)


class Collect:
    """A job as the engine sees it (serving.serve.Job's fields), that records its tokens."""

    def __init__(self, prompt, max_tokens, sampling=(0.0, None, None), keep=False):
        self.prompt_ids, self.max_tokens, self.sampling, self.keep = (
            prompt,
            max_tokens,
            sampling,
            keep,
        )
        self.tokens, self.finished, self.error = [], False, None
        self.done = threading.Event()
        self.stats_source = dict

    def feed(self, token: int) -> None:
        self.tokens.append(token)
        if len(self.tokens) >= self.max_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.finished = True
        self.stats = self.stats_source()
        self.done.set()

    def fail(self, message: str) -> None:
        self.finished, self.error = True, message
        self.done.set()

    def result(self) -> list[int]:
        assert self.done.wait(120), "the engine did not answer"
        assert self.error is None, self.error
        return self.tokens


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(40, 120, (n,), generator=g).tolist()
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in lengths]


def settled(engine: Engine) -> dict:
    """/health's figures once the engine has put every finished sequence's cache away."""
    for _ in range(1000):
        if not engine.running() and not engine.pending:
            return engine.health()
        time.sleep(0.01)
    raise AssertionError("the engine is still running sequences")


def new_engine(model, method="full", options=None, **kwargs) -> Engine:
    """An engine (not started) whose sequences each get a `method` cache of CAPACITY."""
    options = options or {}
    return Engine(
        model, lambda n: make_cache(method, model, n, CAPACITY, **options), CAPACITY, **kwargs
    )


def engine_for(model, method, options, **kwargs) -> Engine:
    engine = new_engine(model, method, options, prefill_chunk=CHUNK, **kwargs)
    engine.start()
    return engine


def alone(model, method, options, prompt, max_tokens, held=0, cache=None, **sampling):
    cache = cache or make_cache(method, model, 1, CAPACITY, **options)
    run = GenerateOptions(prefill_chunk=CHUNK, held=held, keep=True)
    result = generate(model, cache, [prompt], max_tokens, options=run, **sampling)
    return result.tokens[0], cache


@pytest.mark.parametrize("layout", ["llama", "hybrid"])
@pytest.mark.parametrize("name", list(METHODS))
def test_sequences_that_join_and_leave_decode_what_they_decode_alone(name, layout):
    """Six requests of different lengths and answer lengths through a batch of 3: later ones join
    while earlier ones decode (their prompt chunks in the same passes as the others' steps), and
    each leaves when done. Every answer equals generate's for that prompt alone (greedy)."""
    method, options = METHODS[name]
    model = tiny_model(**(HYBRID if layout == "hybrid" else {}))
    jobs = [Collect(p, 6 + 5 * i) for i, p in enumerate(prompts(6))]
    engine = engine_for(model, method, options, max_batch_size=3)
    for job in jobs:
        engine.submit(job)
    answers = [job.result() for job in jobs]
    references = [alone(model, method, options, job.prompt_ids, job.max_tokens)[0] for job in jobs]
    assert answers == references
    assert settled(engine)["finished"] == 6


def test_the_shared_full_cache_in_bfloat16_decodes_what_each_prompt_decodes_alone():
    """bf16 (this CPU's faster dtype, bench_serve.py --dtype bfloat16): the packed decode rows
    of a shared cache's sequences give each the tokens generate gives it alone."""
    model = tiny_model().to(torch.bfloat16)
    jobs = [Collect(p, 6 + 5 * i) for i, p in enumerate(prompts(6))]
    engine = engine_for(model, "full", {}, max_batch_size=3)
    for job in jobs:
        engine.submit(job)
    answers = [job.result() for job in jobs]
    settled(engine)
    assert answers == [alone(model, "full", {}, job.prompt_ids, job.max_tokens)[0] for job in jobs]


def test_a_seeded_request_samples_the_same_answer_alone_or_beside_others():
    model = tiny_model()
    method, options = METHODS["specache"]
    seeded = (0.9, 20, 1234)
    first, *others = prompts(4, seed=3)
    engine = engine_for(model, method, options, max_batch_size=4)
    lone = Collect(first, 20, seeded)
    engine.submit(lone)
    lone_answer = lone.result()
    beside = [Collect(p, 20, (0.7, None, None)) for p in others]
    again = Collect(first, 20, seeded)
    for job in [beside[0], again, *beside[1:]]:
        engine.submit(job)
    assert again.result() == lone_answer
    other = Collect(first, 20, (0.9, 20, 99))
    engine.submit(other)
    assert other.result() != lone_answer


def test_health_says_how_full_the_batch_ran():
    """Three prompts that fit one turn's chunk budget are prefilled in one pass and then decode
    side by side: 5 steps of 3 sequences for 6 tokens each (the first comes from the prompt's
    pass). A fourth, queued behind them, decodes alone: 3 more steps of 1 sequence."""
    model = tiny_model()
    engine = new_engine(model, max_batch_size=3, prefill_chunk=64)
    jobs = [Collect(p[:20], 6) for p in prompts(3, seed=4)]
    for job in jobs:
        engine.submit(job)
    engine.start()  # all three join the first turn
    for job in jobs:
        job.result()
    last = Collect(prompts(1, seed=6)[0][:20], 4)
    engine.submit(last)
    last.result()
    health = settled(engine)
    assert health["decode_steps"] == 5 + 3
    assert health["sequences_per_step_mean"] == pytest.approx((5 * 3 + 3 * 1) / 8)
    assert 0 < health["prompt_pass_s"] < health["busy_s"]


@pytest.mark.parametrize("name", ["full", "specache", "specache-disk", "specache-sparse"])
def test_a_request_that_extends_a_kept_conversation_prefills_only_its_new_tokens(name):
    """Turn 2 extends turn 1's prompt and answer: the engine continues turn 1's cache (it
    reports the tokens reused) and answers what generate answers continuing a kept cache, as
    chat.py does; a request that extends nothing kept starts afresh."""
    method, options = METHODS[name]
    model = tiny_model()
    engine = engine_for(model, method, options, max_batch_size=2, keep_bytes=10**9)
    turn1 = Collect(prompts(1)[0], 12, keep=True)
    engine.submit(turn1)
    answer1 = turn1.result()
    held = len(turn1.prompt_ids) + len(answer1) - 1  # the answer's last token is not in the cache
    new = [answer1[-1], 5, 6, 7, 8, 9]
    turn2 = Collect(turn1.prompt_ids + answer1[:-1] + new, 10, keep=True)
    engine.submit(turn2)
    answer2 = turn2.result()
    assert turn2.reused == held
    reference1, cache = alone(model, method, options, turn1.prompt_ids, 12)
    assert reference1 == answer1
    reference2, cache = alone(model, method, options, new, 10, held=held, cache=cache)
    cache.finish()
    assert answer2 == reference2
    stranger = Collect([3, 1, 4] + turn1.prompt_ids, 4, keep=True)
    engine.submit(stranger)
    stranger.result()
    assert stranger.reused == 0
    assert settled(engine)["kept_conversations"] == 2  # turn 2's cache and the stranger's


@pytest.mark.parametrize("kind", [KVCache, KernelKVCache])
def test_decode_steps_on_rows_of_a_shared_cache_equal_each_row_alone(kind):
    """decode_on_rows (SDPA's path, as on a GPU, and the CPU kernel's) against each sequence's
    step on its own row: the same outputs and writes, and the rows no one decodes untouched."""
    g = torch.Generator().manual_seed(0)
    shared = kind(4, 32, 2, 16, torch.float32)
    shared.k_cache.copy_(torch.randn(shared.k_cache.shape, generator=g))
    shared.v_cache.copy_(torch.randn(shared.v_cache.shape, generator=g))
    apart = kind(4, 32, 2, 16, torch.float32)
    apart.k_cache.copy_(shared.k_cache)
    apart.v_cache.copy_(shared.v_cache)
    at, pos = torch.tensor([2, 0]), torch.tensor([[9, 20]])
    q, k, v = (torch.randn(1, n, 2, 16, generator=g) for n in (4, 2, 2))
    out = caches.full.decode_on_rows(shared, at, q, k, v, pos)
    for i, row in enumerate(at.tolist()):
        one = apart.row(row)
        alone = one(
            q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], pos[:, i : i + 1], None
        )
        torch.testing.assert_close(out[:, :, i : i + 1], alone)
    torch.testing.assert_close(shared.k_cache, apart.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(shared.v_cache, apart.v_cache, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["full", "specache"])
def test_a_cache_in_ram_is_one_cache_shared_a_row_each(name, monkeypatch):
    """The full cache's and SpeCache's sequences share one cache, a row each: the decode steps of
    all running sequences take one attention call per layer. A kept conversation is copied out of
    its row, which then serves other sequences (they overwrite it), and goes back into a row when
    it continues: its answer is the one generate gives continuing a kept cache, and it costs what
    it holds."""
    method, options = METHODS[name]
    model = tiny_model()
    calls = []
    if name == "full":
        real = caches.full.decode_on_rows

        def counted(shared, at, *args):
            calls.append(len(at))
            return real(shared, at, *args)

        monkeypatch.setattr(caches.full, "decode_on_rows", counted)
    else:
        real = specache.rows.step_on_rows

        def counted(layer, *args):
            calls.append(len(layer.state.rows))
            return real(layer, *args)

        monkeypatch.setattr(specache.rows, "step_on_rows", counted)
    engine = engine_for(model, method, options, max_batch_size=2, keep_bytes=10**9)
    assert engine.shared is not None and len(engine.free) == 2
    turn1 = Collect(prompts(1)[0], 8, keep=True)
    engine.submit(turn1)
    answer1 = turn1.result()
    held = len(turn1.prompt_ids) + len(answer1) - 1
    others = [Collect(p + p, 6) for p in prompts(2, seed=9)]  # 80-240 tokens: past turn 1's
    for job in others:
        engine.submit(job)
    answers = [job.result() for job in others]
    settled(engine)  # the engine has the model to itself until then
    references = [alone(model, method, options, job.prompt_ids, 6)[0] for job in others]
    assert answers == references
    assert max(calls) == 2  # both decoding sequences' steps in one call
    new = [answer1[-1], 5, 6, 7]
    turn2 = Collect(turn1.prompt_ids + answer1[:-1] + new, 8, keep=True)
    engine.submit(turn2)
    answer2 = turn2.result()
    assert turn2.reused == held
    _, cache = alone(model, method, options, turn1.prompt_ids, 8)
    assert answer2 == alone(model, method, options, new, 8, held=held, cache=cache)[0]
    c = model.config
    held2 = held + len(new) + len(answer2) - 1
    kept = settled(engine)["kept_conversations_bytes"]
    if name == "full":
        assert kept == held2 * c.n_layer * 2 * c.n_local_heads * c.head_dim * 4  # float32 K, V
    else:  # the slow tier's float16 pairs, and the low-bit copy, window and sinks beside them
        slow = held2 * c.n_layer * 2 * c.n_local_heads * c.head_dim * 2
        assert held2 < CAPACITY / 3 and slow < kept < 2 * slow  # not a row's capacity
    assert new_engine(model, *METHODS["specache-disk"]).shared is None  # a folder per cache
    assert new_engine(tiny_model(**HYBRID)).shared is None  # sliding-window rings


class OpByOpTier(RamTier):
    """The slow tier in RAM, moving its pairs as a separate tier does: a layer's step then goes op
    by op (`SpeCacheLayer.step_in_parts`), as beside a GPU, and the tier places the prefetch."""

    gathered_in_step = False


def op_by_op(cache):
    for layer in cache.layers:
        layer.tier.__class__ = OpByOpTier
    return cache


def test_shared_specache_rows_step_op_by_op_as_beside_a_gpu(monkeypatch):
    """Beside a GPU SpeCache's rows are shared too, but its step goes op by op, with picks read
    within the step and the prefetch placed by the tier for every row. On a CPU, with that path
    forced: while some rows join, bootstrap or sit free, the decoding rows' steps leave them as
    they were, and every answer equals generate's for that prompt alone (on the same path)."""
    method, options = METHODS["specache"]
    model = tiny_model()
    moved = []
    real = SpeCacheLayer.step_in_parts

    def watched(layer, *args):
        moved.append(len(layer.state.rows or []))
        return real(layer, *args)

    monkeypatch.setattr(SpeCacheLayer, "step_in_parts", watched)
    jobs = [Collect(p, 6 + 5 * i) for i, p in enumerate(prompts(6))]
    engine = Engine(
        model,
        lambda n: op_by_op(make_cache(method, model, n, CAPACITY, **options)),
        CAPACITY,
        max_batch_size=3,
        prefill_chunk=CHUNK,
    )
    assert engine.shared is not None
    engine.start()
    for job in jobs:
        engine.submit(job)
    answers = [job.result() for job in jobs]
    settled(engine)
    assert {1, 2} <= set(moved)  # passes that stepped some of the rows, not all three
    references = []
    for job in jobs:
        cache = op_by_op(make_cache(method, model, 1, CAPACITY, **options))
        references.append(
            alone(model, method, options, job.prompt_ids, job.max_tokens, cache=cache)[0]
        )
    assert answers == references


def test_each_request_on_a_shared_specache_reports_its_own_rows_statistics():
    """SpeCache's rows shared: a request's cache statistics (generate.py's --json fields: pairs
    fetched per token, speculation's match rate, its share of the tiers) are those of its own
    row, the figures generate reports for that prompt alone, not the whole cache's."""
    method, options = METHODS["specache"]
    model = tiny_model()
    jobs = [Collect(p, 6 + 4 * i) for i, p in enumerate(prompts(3, seed=4))]
    engine = engine_for(model, method, options, max_batch_size=3)
    for job in jobs:
        engine.submit(job)
    for job in jobs:
        job.result()
    settled(engine)
    run = GenerateOptions(prefill_chunk=CHUNK)
    for job in jobs:
        cache = make_cache(method, model, 1, CAPACITY, **options)
        alone = generate(model, cache, [job.prompt_ids], job.max_tokens, options=run)
        assert job.stats == alone.stats and job.stats["bytes_fetched_per_token"] > 0


def test_kept_conversations_stay_within_their_budget_and_their_files_go(tmp_path):
    """The LRU keeps what fits in its bytes, oldest out first; a disk tier's folder goes with
    the cache that leaves."""
    model = tiny_model()
    options = dict(SMALL, slow_tier="disk", slow_tier_dir=str(tmp_path))
    cache = make_cache("specache-1bit", model, 1, CAPACITY, **options)
    one = Slot(cache, [layer.attention.kv_cache for layer in model.layers]).nbytes()
    engine = engine_for(model, "specache-1bit", options, max_batch_size=1, keep_bytes=2 * one)
    for prompt in prompts(4, seed=5):
        job = Collect(prompt, 4, keep=True)
        engine.submit(job)
        job.result()
    health = settled(engine)
    assert health["kept_conversations"] == 2 and health["kept_conversations_bytes"] <= 2 * one
    # two kept caches' folders, none for the pooled cache or the two that left
    assert len(list(tmp_path.iterdir())) == 2


def test_the_shortest_prompt_joins_first_but_the_oldest_is_not_starved():
    model = tiny_model()
    engine = new_engine(model, max_batch_size=3)  # no prefill_chunk: a turn takes a whole prompt

    def joining(length: int) -> Sequence:
        return Sequence(Collect([1] * length, 4), engine.free[0], 0, None, torch.ones(1, length))

    long = joining(200)
    engine.joining.extend([long, joining(50)])
    chosen = []
    for _ in range(5):
        (seq,) = engine._to_prefill()
        chosen.append(seq.tokens.shape[1])
        if seq is not long:  # a short one joins; another short one arrives
            engine.joining.remove(seq)
            engine.joining.append(joining(50))
    assert chosen == [50, 50, 50, 200, 200]  # passed over 3 times (max_batch_size), then first


def test_a_turn_takes_the_shortest_whole_chunks_that_fit_its_budget():
    model = tiny_model()
    engine = new_engine(model, prefill_chunk=CHUNK)

    def joining(length: int, prefilled: int = 0) -> Sequence:
        tokens = torch.ones(1, length)
        return Sequence(Collect([1] * length, 4), engine.free[0], 0, None, tokens, prefilled)

    engine.joining.extend([joining(100), joining(10), joining(70, prefilled=60), joining(20)])
    # 10 + 10 left + 20 = 40 > 32: the third waits; a long prompt's chunk is never cut to fit
    assert [seq.tokens.shape[1] for seq in engine._to_prefill()] == [10, 70]
    engine.joining.clear()
    engine.joining.extend([joining(100), joining(80)])
    assert [seq.tokens.shape[1] for seq in engine._to_prefill()] == [80]


def test_a_request_whose_cache_fails_to_start_fails_alone(monkeypatch):
    """An error in one joining request's own part (here its cache's start) fails that request; the
    one decoding beside it answers as it would alone, and the engine serves the next."""
    model = tiny_model()
    real_begin = FullCache.begin

    def begin(self, tokens, lengths, held=0):
        if int(tokens[0, 0]) == 96:
            raise OSError("no room for this one")
        return real_begin(self, tokens, lengths, held)

    monkeypatch.setattr(FullCache, "begin", begin)
    engine = engine_for(model, "full", {}, max_batch_size=2)
    running, doomed = Collect(prompts(1)[0], 30), Collect([96] + prompts(1, seed=2)[0], 5)
    engine.submit(running)
    engine.submit(doomed)
    assert doomed.done.wait(60) and "OSError: no room for this one" in doomed.error
    assert running.result() == alone(model, "full", {}, running.prompt_ids, 30)[0]
    after = Collect(prompts(1, seed=3)[0], 4)
    engine.submit(after)
    assert after.result() == alone(model, "full", {}, after.prompt_ids, 4)[0]


def test_an_error_in_a_pass_fails_the_requests_in_it_and_the_engine_goes_on(monkeypatch):
    model = tiny_model()
    engine = new_engine(model, max_batch_size=2, prefill_chunk=CHUNK)
    real_forward, calls = type(model).forward, []

    def forward(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the first request's second step, beside the second's prompt
            raise RuntimeError("a bad pass")
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", forward)
    jobs = [Collect(p, 10) for p in prompts(2, seed=4)]  # 50 and 54 tokens: 2 chunks each
    for job in jobs:
        engine.submit(job)
    engine.start()  # both join at once: the third pass is a step of one and a chunk of the other
    for job in jobs:
        assert job.done.wait(60) and "RuntimeError: a bad pass" in job.error
    monkeypatch.setattr(type(model), "forward", real_forward)
    after = Collect(prompts(1, seed=5)[0], 4)
    engine.submit(after)
    assert after.result() == alone(model, "full", {}, after.prompt_ids, 4)[0]
    assert settled(engine)["running"] == 0


def test_a_conversation_that_cannot_be_kept_or_restored_fails_no_more_than_its_request():
    """Copying a finished conversation out of its row, or back into one, can fail (beside a GPU,
    a move in the background that failed surfaces there): the answer already given stands, the
    request whose conversation does not come back fails alone, and the engine goes on."""
    model = tiny_model()
    engine = engine_for(model, "full", {}, max_batch_size=2, keep_bytes=10**9)
    shared = engine.shared

    def broken(*args):
        raise RuntimeError("a copy failed")

    shared.save_row = broken
    turn1 = Collect(prompts(1)[0], 6, keep=True)
    engine.submit(turn1)
    answer1 = turn1.result()  # answered; the conversation is not kept
    assert settled(engine)["kept_conversations"] == 0
    del shared.save_row
    engine.submit(turn1 := Collect(prompts(1)[0], 6, keep=True))
    assert turn1.result() == answer1 and settled(engine)["kept_conversations"] == 1
    shared.restore_row = broken
    turn2 = Collect(turn1.prompt_ids + answer1[:-1] + [answer1[-1], 5], 4, keep=True)
    engine.submit(turn2)
    assert turn2.done.wait(60) and "a copy failed" in turn2.error
    del shared.restore_row
    after = Collect(prompts(1, seed=5)[0], 4)
    engine.submit(after)
    assert after.result() == alone(model, "full", {}, after.prompt_ids, 4)[0]
    health = settled(engine)
    assert health["running"] == 0 and len(engine.free) == 2
