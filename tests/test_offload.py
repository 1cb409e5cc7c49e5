"""offload.py's host-side pieces (the GPU paths that use them are in tests/test_cuda.py)."""
import torch

from offload import RamTier, gather_pairs, read_with_reuse


def test_reading_with_reuse_gives_the_gather_and_reads_only_what_was_not_held():
    g = torch.Generator().manual_seed(0)
    slow = RamTier((2, 3, 50, 8), torch.float16)
    slow.k.copy_(torch.randn(slow.k.shape, generator=g))
    slow.v.copy_(torch.randn(slow.v.shape, generator=g))
    held_positions = torch.stack([torch.randperm(50, generator=g)[:6] for _ in range(6)]).view(2, 3, 6)
    held_valid = torch.rand(2, 3, 6, generator=g) < 0.7
    held_k, held_v = gather_pairs(slow.k, held_positions), gather_pairs(slow.v, held_positions)
    # the next positions: half of them taken from what is held, in another order
    positions = torch.cat([held_positions.flip(-1)[..., :3],
                           torch.stack([torch.randperm(50, generator=g)[:3] for _ in range(6)]).view(2, 3, 3)], -1)
    valid = torch.rand(2, 3, 6, generator=g) < 0.9
    expected_reads = int((valid & ~((positions.unsqueeze(-1) == held_positions.unsqueeze(-2))
                                    & held_valid.unsqueeze(-2)).any(-1)).sum())
    reads = read_with_reuse(slow.k, slow.v, positions, valid, held_positions, held_valid, held_k, held_v)
    assert reads == expected_reads and 0 < reads < int(valid.sum())
    assert torch.equal(held_k[valid], gather_pairs(slow.k, positions)[valid])
    assert torch.equal(held_v[valid], gather_pairs(slow.v, positions)[valid])
