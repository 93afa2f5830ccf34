"""Grouped GEMM as one matmul per expert: the reference every other backend is tested against.

Plain torch ops, so autograd, every dtype and every device come for free."""

import torch


def gmm_loop(x: torch.Tensor, w: torch.Tensor, counts: list[int], trans_b: bool,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x[N, K]`` grouped expert-major by ``counts`` times ``w[E, K, M]`` (``w[E, M, K]``
    with ``trans_b``) -> ``[N, M]``, plus ``bias[e]`` (``bias [E, M]``) on group ``e``'s rows."""
    # unbind, not w[e]: the backward of one unbind stacks the E gradients once, where E
    # selects would each scatter into a zero tensor the size of w.
    # Empty groups still multiply a [0, K] block, so w.grad has zeros there rather than None.
    outs = []
    biases = bias.unbind(0) if bias is not None else [None] * w.shape[0]
    for rows, we, be in zip(torch.split(x, counts), w.unbind(0), biases):
        out = rows @ (we.t() if trans_b else we)  # [n_e, K] -> [n_e, M]
        outs.append(out if be is None else out + be)
    return torch.cat(outs)


def gmm_loop_wgrad(x: torch.Tensor, dy: torch.Tensor, counts: list[int], trans_b: bool) -> torch.Tensor:
    """The weight gradient of :func:`gmm_loop`, one matmul per group: ``[E, K, M]``
    (``[E, M, K]`` with ``trans_b``); an empty group gets zeros."""
    pairs = zip(torch.split(x, counts), torch.split(dy, counts))
    return torch.stack([(d.t() @ rows) if trans_b else (rows.t() @ d) for rows, d in pairs])
