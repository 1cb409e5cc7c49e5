"""Property-based checks (hypothesis) over small random models, cache settings and ragged batches:
SpeCache that fetches every position reproduces the full cache, and every invalid setting is
refused with its documented ValueError. Examples are derandomized, so CI sees the same ones."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from caches.full import FullCache
from generation import generate
from caches.plugged import PluggedSpeCache
from conftest import specache_config

FUZZ = settings(max_examples=25, deadline=None, derandomize=True)


@st.composite
def model_and_cache(draw):
    n_kv = draw(st.sampled_from([1, 2]))
    n_head = n_kv * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([16, 32]))
    group = draw(st.sampled_from([8, 16]))
    model_config = dict(
        n_layer=draw(st.integers(1, 2)), n_head=n_head, n_local_heads=n_kv, dim=n_head * head_dim
    )
    cache = dict(
        bits=draw(st.sampled_from([1, 2])),
        group=group,
        residual=group * draw(st.integers(1, 2)),
        speculative=draw(st.booleans()),
    )
    lengths = draw(st.lists(st.integers(1, 90), min_size=1, max_size=3))
    return model_config, cache, lengths, draw(st.integers(2, 12)), draw(st.integers(0, 2**16))


@FUZZ
@given(model_and_cache())
def test_fetching_every_position_reproduces_the_full_cache(case):
    model_config, cache, lengths, new_tokens, seed = case
    model = tiny_model(seed=seed % 7, **model_config)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]
    context = max(lengths) + new_tokens
    full = generate(
        model, FullCache(model, len(prompts), context), prompts, new_tokens, temperature=0
    )
    # twice the context and more: room for a slot at every position (see
    # specache/config.py: fast_tier_plan)
    capacity = 2 * context + 128
    config = specache_config(topk=capacity, pair_dtype=torch.float32, **cache)
    specache = PluggedSpeCache(model, len(prompts), capacity, config)
    assert specache.layers[0].k_spec + specache.layers[0].k_real >= context
    assert generate(model, specache, prompts, new_tokens, temperature=0).tokens == full.tokens


INVALID = st.one_of(
    st.builds(dict, bits=st.integers(-3, 8).filter(lambda b: b not in (1, 2))).map(
        lambda c: (c, "bits must be 1 or 2")
    ),
    st.builds(dict, group=st.integers(-4, 0)).map(lambda c: (c, "must be positive")),
    st.builds(dict, residual=st.integers(-4, 0)).map(lambda c: (c, "must be positive")),
    st.builds(dict, group=st.sampled_from([16, 32]), residual=st.sampled_from([8, 24, 40])).map(
        lambda c: (c, "multiple of the group size")
    ),
    st.builds(dict, topk=st.integers(-100, -1)).map(lambda c: (c, "top-k must be >= 0")),
)


@FUZZ
@given(INVALID, st.sampled_from([16, 32]))
def test_invalid_settings_are_refused_with_their_documented_error(invalid, head_dim):
    overrides, message = invalid
    model = tiny_model(n_layer=1, n_head=2, n_local_heads=1, dim=2 * head_dim)
    config = specache_config(**dict(dict(group=16, residual=16), **overrides))
    with pytest.raises(ValueError, match=message):
        PluggedSpeCache(model, 1, 64, config)


@FUZZ
@given(st.sampled_from([4, 12, 20, 36]), st.sampled_from([1, 2]))
def test_head_dims_that_do_not_fill_bytes_are_refused(head_dim, bits):
    model = tiny_model(n_layer=1, n_head=1, n_local_heads=1, dim=head_dim)
    config = specache_config(bits=bits, group=4, residual=4)
    if head_dim * bits % 8 == 0:
        PluggedSpeCache(model, 1, 16, config)
    else:
        with pytest.raises(ValueError, match="whole bytes"):
            PluggedSpeCache(model, 1, 16, config)
