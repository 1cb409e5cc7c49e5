"""specache's slow tier on a host: the RAM tier's moves, and reading with reuse (the GPU paths
that use it are in tests/test_cuda.py, the disk tier in tests/test_disk_tier.py)."""

import torch

from specache import Kappa, PrefetchSlots, RamTier, TierSpec
from specache.pinned import read_with_reuse
from specache.tiers import gather_pairs, held_match


def held_positions(generator, shape=(2, 3, 6), t=50):
    positions = torch.stack(
        [torch.randperm(t, generator=generator)[: shape[-1]] for _ in range(shape[0] * shape[1])]
    ).view(shape)
    return positions, torch.rand(shape, generator=generator) < 0.7


def test_held_match_finds_each_valid_position_a_valid_held_slot_holds():
    g = torch.Generator().manual_seed(1)
    held_pos, held_valid = held_positions(g)
    positions = torch.cat([held_pos.flip(-1)[..., :3], held_positions(g, (2, 3, 3))[0]], -1)
    valid = torch.rand(2, 3, 6, generator=g) < 0.9
    held, source = held_match(positions, valid, held_pos, held_valid)
    for b, h, i in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(6)).tolist():
        slots = [
            j for j in range(6) if held_valid[b, h, j] and held_pos[b, h, j] == positions[b, h, i]
        ]
        assert bool(held[b, h, i]) == (bool(valid[b, h, i]) and bool(slots))
        if held[b, h, i]:
            assert int(source[b, h, i]) in slots
    assert held.any() and not held.all()


def test_reading_with_reuse_gives_the_gather_and_reads_only_what_was_not_held():
    g = torch.Generator().manual_seed(0)
    store_k, store_v = torch.randn(2, 3, 50, 8, generator=g), torch.randn(2, 3, 50, 8, generator=g)
    held_pos, held_valid = held_positions(g)
    held_k, held_v = gather_pairs(store_k, held_pos), gather_pairs(store_v, held_pos)
    # the next positions: half of them taken from what is held, in another order
    positions = torch.cat([held_pos.flip(-1)[..., :3], held_positions(g, (2, 3, 3))[0]], -1)
    valid = torch.rand(2, 3, 6, generator=g) < 0.9
    expected_reads = int((valid & ~held_match(positions, valid, held_pos, held_valid)[0]).sum())
    reads = read_with_reuse(
        store_k, store_v, positions, valid, held_pos, held_valid, held_k, held_v
    )
    assert reads == expected_reads and 0 < reads < int(valid.sum())
    assert torch.equal(held_k[valid], gather_pairs(store_k, positions)[valid])
    assert torch.equal(held_v[valid], gather_pairs(store_v, positions)[valid])


class Lengths:
    """What a tier reads from SpeCache's state: where each sequence's next real row goes, and the
    rows a step moves (all)."""

    def __init__(self, positions):
        self.positions = positions

    def next_position(self):
        return self.positions

    def at_moved(self, *per_row):
        return (torch.arange(len(self.positions)), *per_row)


def test_the_ram_tier_stores_reads_and_prefetches_into_the_slots():
    g = torch.Generator().manual_seed(2)
    b, n_kv, t, d = 2, 3, 40, 8
    slots = [
        torch.zeros(b, n_kv, 7, d),
        torch.zeros(b, n_kv, 7, d),
        torch.zeros(b, n_kv, 7, dtype=torch.long),
        torch.zeros(b, n_kv, 7, dtype=torch.bool),
    ]
    spec = TierSpec(
        (b, n_kv, t, d),
        torch.float32,
        torch.device("cpu"),
        PrefetchSlots(*slots, slice(2, 5)),
        reuse=True,
        overlap=True,
        state=Lengths(torch.tensor([10, 33])),
    )
    tier = RamTier(spec)
    k, v = torch.randn(b, n_kv, t, d, generator=g), torch.randn(b, n_kv, t, d, generator=g)
    for seq in range(b):
        tier.write(seq, 0, k[seq, :, :20], v[seq, :, :20])
        tier.write(seq, 20, k[seq, :, 20:], v[seq, :, 20:])
    assert torch.equal(tier.read_range(5, 30)[0], k[:, :, 5:30]) and torch.equal(tier.keys(), k)
    assert torch.equal(tier.read_range(5, 30, [1])[1], v[1:, :, 5:30])  # one sequence's
    new_k, new_v = torch.randn(b, n_kv, d, generator=g), torch.randn(b, n_kv, d, generator=g)
    kappa = Kappa(
        torch.randint(0, t, (b, n_kv, 3), generator=g), torch.rand(b, n_kv, 3, generator=g) < 0.5
    )
    tier.after_step(new_k, new_v, kappa)
    k[0, :, 10], k[1, :, 33], v[0, :, 10], v[1, :, 33] = new_k[0], new_k[1], new_v[0], new_v[1]
    assert torch.equal(tier.k, k) and torch.equal(tier.v, v)
    assert torch.equal(slots[0][:, :, 2:5], gather_pairs(k, kappa.pos))
    assert torch.equal(slots[2][:, :, 2:5], kappa.pos) and torch.equal(
        slots[3][:, :, 2:5], kappa.valid
    )
    # the other slots untouched
    assert not slots[0][:, :, :2].any() and not slots[0][:, :, 5:].any()
    picked = torch.randint(0, t, (b, n_kv, 4), generator=g)
    assert torch.equal(
        tier.read(picked, torch.ones_like(picked, dtype=torch.bool))[1], gather_pairs(v, picked)
    )
