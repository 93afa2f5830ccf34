"""Gradient buckets, worked out by hand: the order they follow (model chunks last to first,
parameters in reverse, a pipeline's tied embedding last), what goes together (one
reduction group and dtype, at most ``bucket_numel`` elements), and the distributed
optimizer's cuts (:func:`shard_sizes`: at about ``r * total / n``, moved up to a multiple
of ALIGN from a parameter's start). The reductions themselves against one process:
tests/training/test_grads.py and tests/parallel/test_parallel_matrix.py."""

import pytest
import torch
from torch import nn

from moe_fold.layout import ProcessGroups
from moe_fold.training.buckets import ALIGN, SYNC_GROUP, make_buckets, param_kind, shard_sizes

ONE = ProcessGroups.single_process()


def _param(numel, kind="tp", dtype=torch.float32):
    p = nn.Parameter(torch.zeros(numel, dtype=dtype))
    p.parallel = kind
    return p


@pytest.mark.parametrize("numels, n, expected", [
    ([400], 4, [128, 128, 64, 80]),  # cuts 100, 200, 300 inside one parameter: up to 128, 256, 320
    ([100, 300], 2, [100 + 128, 300 - 128]),  # the cut at 200 lies 100 into the second: up to 128
    ([64, 64, 64, 64], 4, [64, 64, 64, 64]),  # cuts between parameters stay where they are
    ([10], 3, [10, 0, 0]),  # a cut moved past a parameter's end stops at its end
    ([7, 5], 1, [12]),
])
def test_shard_sizes_by_hand(numels, n, expected):
    assert shard_sizes(numels, n) == expected
    assert sum(expected) == sum(numels)


def test_every_cut_inside_a_parameter_is_aligned_from_its_start():
    for numels in ([1000, 37, 2048, 5], [3, 3, 3], [129] * 7):
        for n in (2, 3, 4, 8):
            sizes = shard_sizes(numels, n)
            assert len(sizes) == n and sum(sizes) == sum(numels) and min(sizes) >= 0
            starts = [sum(numels[:i]) for i in range(len(numels))]
            for cut in (sum(sizes[:r]) for r in range(1, n)):
                inside = [(s, k) for s, k in zip(starts, numels) if s < cut < s + k]
                assert all((cut - s) % ALIGN == 0 for s, k in inside), (numels, n, sizes)


def test_buckets_follow_the_backward_order_by_group_dtype_and_size():
    # Two model chunks; the backward finishes chunk 1 first, each chunk's parameters last first.
    a, b, c = _param(8), _param(8, "expert"), _param(8)
    d, e, f = _param(17), _param(4, dtype=torch.bfloat16), _param(4)
    buckets = make_buckets([[a, b, c], [d, e, f]], ONE, bucket_numel=16)
    got = [(x.chunk, x.group_name, x.dtype, [id(p) for p in x.params], x.offsets, x.numel) for x in buckets]
    assert got == [
        # chunk 1: f; d would take f's bucket past 16 elements: f closes, d (larger) opens; e alone (bf16)
        (1, "dp_cp", torch.float32, [id(f)], [0], 4),
        (1, "dp_cp", torch.float32, [id(d)], [0], 17),
        (1, "dp_cp", torch.bfloat16, [id(e)], [0], 4),
        # chunk 0: c and a together (16 elements: exactly full), b on its own group
        (0, "dp_cp", torch.float32, [id(c), id(a)], [0, 8], 16),
        (0, "edp", torch.float32, [id(b)], [0], 8),
    ]
    assert all(x.sizes is None and x.slices == [] for x in buckets)


def test_a_tied_embedding_comes_last_in_a_bucket_of_its_own():
    embed, layer, head = _param(8), _param(8), _param(8)
    buckets = make_buckets([[embed, layer], [head]], ONE, deferred=[embed])
    assert [(x.chunk, [id(p) for p in x.params]) for x in buckets] == [
        (1, [id(head)]), (0, [id(layer)]), (None, [id(embed)])]


def test_one_rank_owns_every_element_of_a_sharded_bucket():
    p, q = _param(100), _param(30, "tp_sum")
    buckets = make_buckets([[p, q]], ONE, shard=True)
    assert [(x.group_name, x.sizes, [(s.offset, s.start, s.stop) for s in x.slices]) for x in buckets] == [
        ("tp_dp_cp", [30], [(0, 0, 30)]), ("dp_cp", [100], [(0, 0, 100)])]


def test_sync_groups_and_unmarked_parameters():
    assert {kind: SYNC_GROUP[param_kind(_param(1, kind))] for kind in SYNC_GROUP} == {
        "tp": "dp_cp", "replicated": "dp_cp", "tp_sum": "tp_dp_cp", "expert": "edp"}
    with pytest.raises(ValueError, match=r"parameter of shape \(3,\) has parallel=None; every parameter must be "
                                         r"marked with one of"):
        make_buckets([[nn.Parameter(torch.zeros(3))]], ONE)
    with pytest.raises(ValueError, match=r"parameter of shape \(2, 4\) must be contiguous"):
        t = nn.Parameter(torch.zeros(4, 2).t())
        t.parallel = "tp"
        make_buckets([[t]], ONE, shard=True)
