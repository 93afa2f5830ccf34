"""Grouped GEMM: the one interface every expert layer uses, with a switch between backends.

``gmm(x, w, tokens_per_expert)`` multiplies the rows of ``x`` that belong to expert ``e``
(rows are grouped expert-major) by ``w[e]``; with ``bias[E, M]`` each row also gets its
expert's bias row (gpt-oss's experts). Backends:

- ``grouped_gemm``: the grouped-gemm package (CUDA, bfloat16; ``pip install 'moe-fold[gpu]'``);
- ``torch``: ``torch.nn.functional.grouped_mm`` (CPU and CUDA), or ``torch.bmm`` on CPU
  when every group has the same size (see gmm_torch.py);
- ``triton``: our Triton kernels (CUDA, or the CPU interpreter with TRITON_INTERPRET=1);
- ``loop``: one matmul per expert, the reference;
- ``auto``: the rule of :mod:`moe_fold.kernels.backends` by device, capability and dtype.

The bias: ``loop`` adds ``bias[e]`` inside its per-expert loop (the reference); every other
backend adds it after its GEMM as one fused op for all experts, a gather of the bias rows
by the group sizes (``repeat_interleave`` with ``output_size``, so device counts are not
read back) and one add; its backward is one index_add, the per-expert sum of the rows.

The choice: the ``backend`` argument (the config key ``moe.gemm_backend``) unless it is
``auto`` (or None), else the rule. A backend that cannot run here (a grouped_gemm that does
not import or whose first call fails, Triton on CPU without the interpreter) raises, naming
why.
"""

import contextlib
from typing import Optional, Sequence

import torch

from . import backends

BACKENDS = ("auto",) + backends.OPS["gemm"]


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backend names that run on ``device`` (default: the GPU if there is one, else the CPU):
    each imports and runs a tiny call; ``auto`` always can."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return ["auto"] + [name for name in backends.OPS["gemm"] if backends.problem(name, device) is None]


def resolve_backend(backend: str | None, x: torch.Tensor) -> str:
    """The concrete backend for ``x``: ``backend`` unless it is None or ``auto``, else the
    device rule (:func:`moe_fold.kernels.backends.choose`). Raises if that backend cannot
    run here."""
    return backends.resolve("gemm", build_backend(backend), x)


def _check_counts(counts: Sequence[int], n: int, e: int) -> None:
    if len(counts) != e:
        raise ValueError(f"gmm: tokens_per_expert has {len(counts)} entries, must be one per expert (w.shape[0]={e})")
    if any(c < 0 for c in counts):
        raise ValueError(f"gmm: tokens_per_expert={list(counts)} has a negative count")
    if sum(counts) != n:
        raise ValueError(f"gmm: tokens_per_expert sums to {sum(counts)}, must equal the rows of x (x.shape[0]={n})")


def _check_operands(x: torch.Tensor, w: torch.Tensor, trans_b: bool) -> None:
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"gmm: x must be 2-D [N, K] and w 3-D [E, K, M]; got x{tuple(x.shape)}, w{tuple(w.shape)}")
    if w.shape[0] == 0:
        raise ValueError(f"gmm: w{tuple(w.shape)} has no experts; w.shape[0] must be >= 1")
    k_w = w.shape[2] if trans_b else w.shape[1]
    if x.shape[1] != k_w:
        layout = "[E, M, K] (trans_b=True)" if trans_b else "[E, K, M]"
        raise ValueError(f"gmm: x{tuple(x.shape)} and w{tuple(w.shape)} as {layout} disagree on K: {x.shape[1]} != {k_w}")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"gmm: x ({x.dtype}, {x.device}) and w ({w.dtype}, {w.device}) must share dtype and device")


def _check_bias(bias: torch.Tensor, w: torch.Tensor, trans_b: bool) -> None:
    m = w.shape[1] if trans_b else w.shape[2]
    if tuple(bias.shape) != (w.shape[0], m):
        raise ValueError(f"gmm: bias{tuple(bias.shape)} must be [E, M] = [{w.shape[0]}, {m}] for w{tuple(w.shape)}"
                         f"{' (trans_b=True)' if trans_b else ''}")
    if bias.dtype != w.dtype or bias.device != w.device:
        raise ValueError(f"gmm: bias ({bias.dtype}, {bias.device}) must share w's dtype and device "
                         f"({w.dtype}, {w.device})")


def _add_group_bias(out: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``out[N, M] + bias[E, M]`` gathered by group: row ``r`` of group ``e`` gets ``bias[e]``.
    One gather and one add whatever E is; ``output_size`` keeps device counts on the device."""
    return out + bias.repeat_interleave(counts, dim=0, output_size=out.shape[0])  # [E, M] -> [N, M]


def _autocast_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Under ``torch.autocast`` the grouped GEMM is a matmul like ``F.linear``: both
    operands go to the autocast dtype (differentiably, so ``w``'s grad keeps ``w``'s
    dtype), and the backends run outside autocast on operands that already agree."""
    device_type = x.device.type
    # A device without autocast (the dry run's meta tensors) never autocasts.
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return x, w
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: torch.Tensor) -> torch.Tensor:
        # Autocast leaves float64 (and non-float) operands alone; so do we.
        return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
    return cast(x), cast(w)


def gmm(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor | Sequence[int],
    *,
    trans_b: bool = False,
    backend: str | None = None,
    host_counts: Sequence[int] | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped GEMM: ``x[N, K]`` times ``w[E, K, M]`` (``w[E, M, K]`` with ``trans_b``) -> ``[N, M]``,
    plus ``bias[e]`` on the rows of group ``e`` when ``bias [E, M]`` is given.

    Rows of ``x`` are grouped expert-major: the first ``tokens_per_expert[0]`` rows go to
    expert 0, and so on; any group may be empty. ``tokens_per_expert`` is a list of ints or
    an int tensor on the host or on ``x``'s device. ``host_counts`` is the same counts as
    a list when the caller already has them on the host (the dispatcher does): then no
    backend reads the tensor back. The ``loop`` and ``grouped_gemm`` backends need the
    counts on the host (a device tensor without ``host_counts`` costs one synchronisation);
    the ``torch`` and ``triton`` backends use device counts as they are and do not check
    them, so that no synchronisation happens. Gradients flow to ``x`` and ``w``.

    Under ``torch.autocast`` both operands are cast to the autocast dtype first, as
    ``F.linear`` casts its input and weight (and the bias with them).
    """
    if bias is not None:
        _, bias = _autocast_operands(x, bias)
    x, w = _autocast_operands(x, w)
    _check_operands(x, w, trans_b)
    if bias is not None:
        _check_bias(bias, w, trans_b)
    name = resolve_backend(backend, x)
    n, e = x.shape[0], w.shape[0]
    if isinstance(tokens_per_expert, torch.Tensor):
        if tokens_per_expert.dim() != 1 or tokens_per_expert.is_floating_point():
            raise ValueError(
                f"gmm: tokens_per_expert must be a 1-D int tensor, got shape {tuple(tokens_per_expert.shape)} "
                f"dtype {tokens_per_expert.dtype}"
            )
        if tokens_per_expert.numel() != e:
            raise ValueError(
                f"gmm: tokens_per_expert has {tokens_per_expert.numel()} entries, must be one per expert (w.shape[0]={e})"
            )
        counts_t = tokens_per_expert
        if host_counts is not None:
            host = [int(c) for c in host_counts]
        elif tokens_per_expert.device.type == "cpu" or name in ("loop", "grouped_gemm"):
            host = tokens_per_expert.tolist()
        else:
            host = None
    else:
        host = [int(c) for c in tokens_per_expert]
        counts_t = None
    if host is not None:
        _check_counts(host, n, e)
    if counts_t is None:
        # Backends that read the counts on the device get them there; the others on the host.
        on_device = name not in ("loop", "grouped_gemm")
        counts_t = torch.tensor(host, dtype=torch.int64, device=x.device if on_device else "cpu")
    return grouped_mm(x, w, counts_t, host, trans_b=trans_b, backend=name, bias=bias)


def build_backend(backend: str | None) -> str:
    """What an expert layer built with ``moe.gemm_backend=backend`` passes to
    :func:`grouped_mm`: the name, checked once when the module is built; ``auto`` (or None)
    is left to the op, which resolves it by the operands' device."""
    name = backend or "auto"
    if name not in BACKENDS:
        raise ValueError(f"gmm: backend={name!r} is not a grouped GEMM backend; allowed: {', '.join(BACKENDS)}")
    return name


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, host_counts: Sequence[int] | None, *,
               trans_b: bool = False, backend: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gmm` with the arguments already checked and ``counts`` an int64 tensor (on
    ``x``'s device for the torch and Triton backends): tensor work only, what a forward
    calls. The product is one op, ``moe_fold::gmm`` (:func:`gmm_op`); the bias is added
    after it in torch ops."""
    if bias is not None:
        _, bias = _autocast_operands(x, bias)
    x, w = _autocast_operands(x, w)
    host = None if host_counts is None else list(host_counts)
    out = gmm_op(x, w, counts, host, trans_b, backend)
    if bias is None:
        return out
    return _add_group_bias(out, bias, counts.to(device=x.device))


def _host(counts: torch.Tensor, host_counts: list[int] | None) -> list[int]:
    return host_counts if host_counts is not None else counts.tolist()


@torch.library.custom_op("moe_fold::gmm", mutates_args=())
def gmm_op(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, host_counts: Optional[list[int]],
           trans_b: bool, backend: str) -> torch.Tensor:
    """The grouped product as one op the compiler does not look into: ``x [N, K]`` by
    groups of ``counts`` rows times ``w [E, K, M]`` (``[E, M, K]`` with ``trans_b``) ->
    ``[N, M]``. ``backend`` may be ``auto``: the device rule, resolved from the operands'
    device like any kernel dispatch. Its fake kernel takes every dtype (the compiler never
    meets torch._grouped_mm's bfloat16-only meta check)."""
    name = backends.resolve("gemm", backend, x)
    # The operands already agree: autocast must not recast inside the backends.
    with torch.autocast(x.device.type, enabled=False) if torch.amp.is_autocast_available(x.device.type) \
            else contextlib.nullcontext():
        if name == "loop":
            from .gmm_loop import gmm_loop

            return gmm_loop(x, w, _host(counts, host_counts), trans_b)
        if name == "grouped_gemm":
            from .gmm_grouped_gemm import gmm_grouped_gemm

            # The package reads the counts on the host: a host tensor, no device copy.
            return gmm_grouped_gemm(x, w, torch.tensor(_host(counts, host_counts), dtype=torch.int64), trans_b)
        if name == "torch":
            from .gmm_torch import gmm_torch

            # grouped_mm pads rows narrower than 16 bytes; an op's output has one layout.
            return gmm_torch(x, w, counts, trans_b, host_counts).contiguous()
        from .gmm_triton import gmm_triton

        return gmm_triton(x, w, counts, trans_b)


@gmm_op.register_fake
def _(x, w, counts, host_counts, trans_b, backend):
    return x.new_empty(x.shape[0], w.shape[1] if trans_b else w.shape[2])


@torch.library.custom_op("moe_fold::gmm_wgrad", mutates_args=())
def gmm_wgrad(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor, host_counts: Optional[list[int]],
              trans_b: bool, backend: str) -> torch.Tensor:
    """The weight gradient of :func:`gmm_op`: per group ``x^T dy`` -> ``[E, K, M]``
    (``dy^T x`` -> ``[E, M, K]`` with ``trans_b``), on the same backend."""
    name = backends.resolve("gemm", backend, x)
    with torch.autocast(x.device.type, enabled=False):
        if name == "loop":
            from .gmm_loop import gmm_loop_wgrad

            return gmm_loop_wgrad(x, dy, _host(counts, host_counts), trans_b)
        if name == "grouped_gemm":
            from .gmm_grouped_gemm import gmm_grouped_gemm_wgrad

            return gmm_grouped_gemm_wgrad(x, dy, torch.tensor(_host(counts, host_counts), dtype=torch.int64),
                                          trans_b)
        if name == "torch":
            from .gmm_torch import gmm_torch_wgrad

            return gmm_torch_wgrad(x, dy, counts, trans_b, host_counts).contiguous()
        from .gmm_triton import gmm_triton_wgrad

        return gmm_triton_wgrad(x, dy, counts, trans_b)


@gmm_wgrad.register_fake
def _(x, dy, counts, host_counts, trans_b, backend):
    e = counts.shape[0]
    return x.new_empty(e, dy.shape[1], x.shape[1]) if trans_b else x.new_empty(e, x.shape[1], dy.shape[1])


def _gmm_setup(ctx, inputs, output):
    x, w, counts, host_counts, trans_b, backend = inputs
    ctx.save_for_backward(x, w, counts)
    ctx.args = (host_counts, trans_b, backend)


def _gmm_backward(ctx, dy):
    x, w, counts = ctx.saved_tensors
    host_counts, trans_b, backend = ctx.args
    dx = dw = None
    if ctx.needs_input_grad[0]:
        # dx is the grouped product of dy and w transposed: the forward op itself.
        dx = gmm_op(dy, w, counts, host_counts, not trans_b, backend)  # [N, M] -> [N, K]
    if ctx.needs_input_grad[1]:
        dw = gmm_wgrad(x, dy, counts, host_counts, trans_b, backend)
    return dx, dw, None, None, None, None


gmm_op.register_autograd(_gmm_backward, setup_context=_gmm_setup)
