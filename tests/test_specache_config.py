"""SpeCache's configuration: settings it refuses, and --specache_select's names parsed into
Selection fields and back, and the fast tier its plan sizes."""

import dataclasses

import pytest
import torch

from conftest import specache_config
from specache import PAPER, Method, Selection, SpeCacheConfig, SpeCacheLayer
from specache.state import SpeCacheState


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bits=3), "bits must be 1 or 2"),
        (dict(group=48, residual=64), "multiple of the group size"),
        (dict(topk=-1), "top-k must be >= 0"),
    ],
)
def test_invalid_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        specache_config(**kwargs).validate(64)


def test_head_dims_that_do_not_fill_bytes_are_refused():
    with pytest.raises(ValueError, match="head_dim x bits must be a multiple of 8"):
        SpeCacheConfig(Method(bits=1)).validate(36)
    SpeCacheConfig(Method(bits=2)).validate(36)


@pytest.mark.parametrize(
    "select, fields",
    [
        ("paper", PAPER),
        ("split,gqa-max", dataclasses.replace(PAPER, real_share=0.5, gqa="max")),
        (
            "split=0.25, sinks=8, correct=0.8",
            dataclasses.replace(PAPER, real_share=0.25, sinks=8, correct_below=0.8),
        ),
        ("default,correct", Selection()),
        ("lloyd,default,split=0.3", dataclasses.replace(Selection(), real_share=0.3)),
        # two names set one field: each names itself only for its own value
        ("default,midway", dataclasses.replace(Selection(), levels="midway")),
        ("midway,lloyd", dataclasses.replace(PAPER, levels="lloyd")),
        ("shortlist", dataclasses.replace(PAPER, shortlist=8)),
        ("default,shortlist=4", dataclasses.replace(Selection(), shortlist=4)),
        ("default,shortlist=0", dataclasses.replace(Selection(), shortlist=0)),
    ],
)
def test_selections_parse_into_their_fields_and_name_themselves(select, fields):
    selection = Selection.parse(select)
    assert selection == fields
    assert Selection.parse(selection.name()) == selection


@pytest.mark.parametrize(
    "select, message",
    [
        ("splt", "unknown --specache_select entry 'splt'"),
        ("gqa-max=2", "takes no value"),
        ("sinks=x", "not a valid int"),
        ("split=2", "share of k must be in"),
        ("default,shortlist=-1", "shortlist must be >= 0"),
    ],
)
def test_bad_selections_are_refused(select, message):
    with pytest.raises(ValueError, match=message):
        SpeCacheConfig(selection=Selection.parse(select)).validate(64)


@pytest.mark.parametrize("select", ["paper", "default"])
@pytest.mark.parametrize("bits, pair_dtype", [(1, torch.float16), (2, torch.float32)])
def test_the_planned_fast_tier_never_exceeds_a_16_bit_cache(select, bits, pair_dtype):
    """fast_tier_plan against what a layer then allocates (on the meta device: sizes only), per
    sequence and KV head, from a capacity too short to quantize anything to one where k, not the
    room, limits the slots: never more than the 16-bit cache of its capacity; where nothing can be
    quantized, a 16-bit window of the whole capacity and no slots."""
    head_dim, query_heads = 64, 3
    meta = torch.device("meta")
    config = SpeCacheConfig(
        Method(bits=bits, group=16, residual=32, topk=64), Selection.parse(select)
    )
    limits = set()
    for capacity in (16, 48, 64, 80, 100, 130, 200, 256, 400, 1024, 4096):
        state = SpeCacheState(config, 1, capacity, meta, head_dim, pair_dtype, query_heads)
        layer = SpeCacheLayer(
            state, 0, query_heads, 1, head_dim, pair_dtype, meta, make_tier=lambda spec: None
        )
        assert layer.fast_tier_bytes() <= 2 * capacity * head_dim * pair_dtype.itemsize, capacity
        slots = layer.fetched_pos.shape[-1]
        if state.residual == capacity:
            assert slots == 0 and layer.window_k.shape[2] == capacity
            limits.add("nothing quantized")
        else:
            limits.add("room" if slots < layer.n_sinks + 64 else "k")
    assert limits == {"nothing quantized", "room", "k"}  # every regime was met
