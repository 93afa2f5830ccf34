"""Mamba2's SSD scan, one interface over two backends: ``torch`` (the chunked scan of
:mod:`moe_fold.kernels.ssd`, any device) and ``mamba_ssm`` (mamba-ssm's Triton
``mamba_chunk_scan_combined``, CUDA; ``pip install 'moe-fold[mamba]'``, imported only when
chosen; :mod:`moe_fold.kernels.ssd_mamba` converts the arguments to its layout). ``auto`` is
the device rule of :mod:`moe_fold.kernels.backends`.

Both take ``x [B, H, S, P]`` (not yet times the step), the step ``dt [B, H, S]`` (after
softplus and the floor), ``A [H]`` (negative), ``b, c [B, G, S, N]`` (a group serves ``H / G``
consecutive heads), ``resets`` bool ``[B, S]`` (a document starts at this token) and
``initial_state [B, H, N, P]``, and return ``(y [B, H, S, P], final_state [B, H, N, P])``
without the D skip.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import backends
from .ssd import chunk_ssd
from .ssd_mamba import mamba_function, mamba_ssd

__all__ = ["BACKENDS", "ssd_scan", "torch_ssd"]

BACKENDS = ("auto",) + backends.OPS["ssd"]


def torch_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              resets: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
              chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan in torch: :func:`~moe_fold.kernels.ssd.chunk_ssd` on ``x * dt`` with the
    log-decays ``dt * A`` and each group's B and C repeated over its heads."""
    per_group = x.shape[1] // b.shape[1]
    b, c = (t.repeat_interleave(per_group, dim=1) for t in (b, c))
    return chunk_ssd(x * dt.unsqueeze(-1), dt * A[:, None], b, c, resets=resets, initial_state=initial_state,
                     chunk_size=chunk_size)


def ssd_scan(backend: str) -> Callable:
    """The scan a layer built with ``model.mamba_backend=backend`` calls, chosen once when it
    is built: ``torch`` or ``mamba_ssm`` (imported here), or for ``auto`` the rule's choice for
    the operands' device, made on the first call there."""
    if backend not in BACKENDS:
        raise ValueError(f"ssd scan: backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return torch_ssd
    if backend == "mamba_ssm":
        scan = mamba_function()
        return lambda *args, **kwargs: mamba_ssd(scan, *args, **kwargs)
    return _auto


def _auto(x: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``auto``: the backend :func:`moe_fold.kernels.backends.resolve` gives for ``x``
    (cached per device and dtype there)."""
    if backends.resolve("ssd", "auto", x) == "mamba_ssm":
        return mamba_ssd(mamba_function(), x, *args, **kwargs)
    return torch_ssd(x, *args, **kwargs)
