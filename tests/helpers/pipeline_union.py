"""Test helper: unite per-stage dictionaries of global tensors over the pp group."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moe_fold.layout import ProcessGroups


def unite_over_pp(mine: dict, groups: ProcessGroups) -> dict:
    """Every pp stage's ``{name: global tensor or array}`` united on every rank. A name held
    by two stages (the two copies of a tied embedding) must carry exactly equal values."""
    if groups.size("pp") == 1:
        return mine
    parts = [None] * groups.size("pp")
    dist.all_gather_object(parts, mine, group=groups.pp)
    out = {}
    for part in parts:
        for name, value in part.items():
            if name in out:
                np.testing.assert_array_equal(np.asarray(torch.as_tensor(value)), np.asarray(torch.as_tensor(out[name])),
                                              err_msg=f"tied copies of {name} differ")
            out[name] = value
    return out
