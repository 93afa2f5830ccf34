"""Groups made after the layout's (the pipeline embedding group, dynamic-cp sub-groups)
take the layout groups' timeout, so a hung peer fails them within parallel.timeout_s
instead of torch's 30-minute default."""

from __future__ import annotations

import datetime

import torch

from moe_fold.training.dynamic_cp import CostModel, DynamicCP
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups
from moe_fold.parallel.pipeline import create_embedding_group


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _derived_group_timeouts(rank, world_size):
    timeout = datetime.timedelta(seconds=42)
    pp_groups = create_process_groups(ParallelLayout(world_size, pp=2), timeout=timeout)
    embedding = create_embedding_group(pp_groups)
    cp_groups = create_process_groups(ParallelLayout(world_size, cp=4), timeout=timeout)
    dynamic = DynamicCP(cp_groups, CostModel(pair_flops=1.0, token_flops=1.0, kv_token_cost=1.0), capacity=64)
    subgroups = [g for g in dynamic._groups.values() if g is not None and g is not cp_groups.cp]
    return pp_groups.timeout.total_seconds(), _timeout_s(embedding), [_timeout_s(g) for g in subgroups]


def test_derived_groups_take_the_layout_timeout():
    for layout_timeout, embedding, subgroups in run_ranks(_derived_group_timeouts, 4):
        assert layout_timeout == 42.0
        assert embedding == 42.0
        assert subgroups and all(t == 42.0 for t in subgroups)
