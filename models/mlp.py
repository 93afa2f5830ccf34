"""The dense SwiGLU MLP (Shazeer 2020): ``fc2(silu(gate(x)) * up(x))``, or Nemotron-H's
non-gated squared ReLU, ``fc2(relu(up(x))^2)`` (``activation="relu2"``).

gate|up is one column-parallel linear whose two halves are split over tp separately, so
each rank holds matching slices of gate and up; fc2 is row-parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_fold.comm import Group, group_size
from moe_fold.config import dense_width_over_tp, require
from moe_fold.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, init_seed

from .recompute import recomputed


class MLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, tp_group: Group, sequence_parallel: bool,
                 *, std: float, seed: int, name: str, activation: str = "swiglu"):
        super().__init__()
        require(dense_width_over_tp, ffn_hidden_size, group_size(tp_group))
        self.gated = activation == "swiglu"
        parts = [ffn_hidden_size, ffn_hidden_size] if self.gated else [ffn_hidden_size]
        self.fc1 = ColumnParallelLinear(hidden_size, parts, tp_group,
                                        sequence_parallel, std=std, seed=init_seed(seed, f"{name}.fc1"))
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, tp_group, sequence_parallel,
                                     std=std, seed=init_seed(seed, f"{name}.fc2"))
        # What the backward runs again (train.recompute, models/recompute.py): "none",
        # "all" (the whole forward) or "halves" (activation() and project() each).
        self.recompute = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens ``[T_local, H]`` -> ``[T_local, H]``."""
        if self.recompute == "all":
            return recomputed(self._both_halves, x)
        return self._both_halves(x)

    def _both_halves(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.activation(x))

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """The first half, fc1 and the activation: ``[T_local, H]`` -> ``[T, ffn/tp]`` (``T`` the
        tokens gathered over tp under SP). The MoE layer runs the halves apart to overlap
        the dispatcher's collectives."""
        if self.recompute == "halves":
            return recomputed(self._swiglu, x)
        return self._swiglu(x)

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return torch.relu(self.fc1(x)).square()  # [T, ffn/tp]
        gate, up = self.fc1(x).chunk(2, dim=-1)  # [T, ffn/tp] each
        return F.silu(gate) * up

    def project(self, act: torch.Tensor) -> torch.Tensor:
        """The second half, fc2: ``[T, ffn/tp]`` -> ``[T_local, H]``."""
        if self.recompute == "halves":
            return recomputed(self.fc2, act)
        return self.fc2(act)
