"""How a parameter's shard sits in the global tensor (moe_fold/parallel/sharding.py): flat ranges
covered by contiguous boxes, and every rank's pieces of experts and fused tp weights placed in
the global tensor with exactly one writer per element. Checkpoints built on it:
tests/training/test_checkpoint.py."""

import math

import torch

from moe_fold.layout import GROUP_NAMES, ParallelLayout, ProcessGroups
from moe_fold.models.experts import Experts
from moe_fold.parallel.sharding import box, flat_boxes, shard_info
from moe_fold.parallel.tensor_parallel import mark, shard_tp

ONE = ProcessGroups.single_process()


def test_flat_boxes_cover_a_flat_range_with_contiguous_boxes():
    for shape in [(5,), (3, 4), (2, 3, 4), (1, 5, 1, 3), ()]:
        numbers = torch.arange(math.prod(shape)).reshape(shape)
        n = numbers.numel()
        for start in range(n + 1):
            for stop in range(start, n + 1):
                seen = []
                for offset, offsets, sizes in flat_boxes(shape, start, stop):
                    values = numbers[box(offsets, sizes)].reshape(-1).tolist()
                    assert values == list(range(offset, offset + len(values)))  # contiguous, where it says
                    seen += values
                assert seen == list(range(start, stop))


def _fake_groups(layout, rank):
    """Sizes and coordinates of ``rank`` without torch.distributed (enough to build and describe)."""
    return ProcessGroups(layout, rank, {name: None for name in GROUP_NAMES})


def test_pieces_place_every_rank_shard_in_the_global_tensor():
    """Experts (ep x etp, fused gate|up) as models/experts.py builds them, and fused tp
    weights as tensor_parallel.shard_tp cuts them, on each rank of tp2 x ep2 x etp2 (world 8)."""
    layout = ParallelLayout(8, tp=2, ep=2)  # etp 2, edp 2, dp 4
    gen = torch.Generator().manual_seed(0)
    dense = {"qkv": (torch.randn(16, 6, generator=gen), 0, [8, 4, 4]),  # q|k|v rows
             "proj": (torch.randn(6, 8, generator=gen), 1, [8])}
    full = {n: p.detach() for n, p in Experts(4, 6, 8, ONE, std=1.0, seed=3, name="e").named_parameters()}
    full.update({n: value for n, (value, _, _) in dense.items()})
    written = {n: torch.zeros(v.shape, dtype=torch.int64) for n, v in full.items()}
    for rank in range(8):
        groups = _fake_groups(layout, rank)
        local = dict(Experts(4, 6, 8, groups, std=1.0, seed=3, name="e").named_parameters())
        for n, (value, dim, parts) in dense.items():
            shard = shard_tp(value, dim, parts, groups.rank_in("tp"), 2)
            local[n] = mark(torch.nn.Parameter(shard), "tp", tp_dim=dim, tp_parts=parts)
        for name, p in local.items():
            info = shard_info(p, groups, name)
            assert info.global_shape == tuple(full[name].shape), name
            assert sum(math.prod(piece.sizes) for piece in info.pieces) == p.numel()
            for piece in info.pieces:
                assert torch.equal(p.detach()[box(piece.local, piece.sizes)],
                                   full[name][box(piece.global_, piece.sizes)]), (rank, name)
                if info.writer:
                    written[name][box(piece.global_, piece.sizes)] += 1
    for name, count in written.items():
        assert (count == 1).all(), name  # each global element has exactly one writer
