"""Which backend each kernel runs: one pure rule for ``auto``, and whether a backend runs here.

Ops and their backends (each op's interface module keeps a ``resolve_backend(backend, x)``
that delegates here):

- ``gemm`` (:mod:`moe_fold.kernels.gmm`): grouped_gemm | torch | triton | loop;
- ``permute`` (:mod:`moe_fold.kernels.permute`): torch | triton;
- ``swiglu`` (:mod:`moe_fold.kernels.swiglu`): torch | triton | cpu (the C loops);
- ``topk`` (the router, :mod:`moe_fold.dispatch.router`): torch | triton;
- ``delta_rule`` (Gated DeltaNet and KDA, :mod:`moe_fold.kernels.delta_rule`): torch | fla;
- ``ssd`` (Mamba2's scan, :mod:`moe_fold.kernels.ssd_scan`): torch | mamba_ssm;
- ``conv`` (the short causal conv of Gated DeltaNet, KDA and Mamba2,
  :mod:`moe_fold.kernels.short_conv`): torch | causal_conv1d.

:func:`choose` is the rule: device type, CUDA capability, dtype and the optional extras
that run here in, one backend out, nothing else read. The table it gives (pinned by
tests/kernels/test_backends.py)::

    device            dtype        gemm                         permute  swiglu  topk
    cpu               f32/bf16/f16 torch                        torch    cpu     torch
    cpu               f64          loop                         torch    cpu     torch
    cuda sm90, sm100  bf16         torch                        triton   triton  triton
    cuda sm80+ other  bf16         grouped_gemm if it runs, else loop
                                                                triton   triton  triton
    cuda sm80+        f32/f16/f64  loop                         triton   triton  triton
    cuda below sm80   any          loop                         torch    torch   torch
    any other device  any          loop                         torch    torch   torch

    delta_rule: fla on cuda sm80+ in float32/bf16/f16 when flash-linear-attention runs there
    (``pip install 'moe-fold[fla]'``), torch everywhere else (float64 included).
    ssd: mamba_ssm on cuda sm80+ in float32/bf16/f16 when mamba-ssm runs there
    (``pip install 'moe-fold[mamba]'``), torch everywhere else (float64 included).
    conv: causal_conv1d on cuda sm80+ in float32/bf16/f16 when causal-conv1d runs there
    (``pip install 'moe-fold[conv]'``), torch everywhere else; a layer whose conv shape
    causal-conv1d does not take (``moe_fold.config.conv_shape_problem``) runs torch.

topk is ``torch`` wherever the router groups experts or biases the selection (the kernel
fuses neither). Why these:

- gemm ``torch`` is ``torch._grouped_mm``, whose fast CUTLASS kernel exists for bfloat16 on
  sm90 and sm100 only; elsewhere on CUDA it synchronises and loops over the groups, so it
  is never chosen there. It reads the group sizes from the device (no host sync), which
  is why it wins over grouped_gemm (host counts) on sm90/sm100. On other CUDA GPUs
  bfloat16 takes grouped_gemm, the one optional extra the rule looks at (``pip install
  'moe-fold[gpu]'``), and the loop of cuBLAS calls otherwise; float32 takes the loop (with
  TF32, ``train.tf32``). On CPU grouped_mm beats the loop for every dtype it takes
  (bench/gemm.py, 2 threads, 4096 rows, 8 experts, H = F = 256; ratio_to_dense torch vs
  loop: float32 0.91 vs 0.79 balanced and 0.89 vs 0.74 skewed; 1 thread: bfloat16 0.74 vs
  0.56, float16 0.85 vs 0.77): it loops over groups in C++ and its backward needs no
  split/cat/stack (with equal groups and host counts it runs bmm, gmm_torch.py). Our Triton
  GEMM is never chosen: it has not been measured on a GPU.
- Triton (permute, SwiGLU, top-k) needs sm80 for bfloat16; it ships with torch's CUDA
  wheels. The interpreter (TRITON_INTERPRET=1) is for tests and is never chosen on CPU.
- swiglu ``cpu`` is the fastest on CPU (swiglu_cpu.py) but needs a C compiler. The rule
  does not ask whether one is there: a machine without one gets a clear error naming the
  setting and the fix (``moe.swiglu_backend=torch``), not other numerics in silence (its
  exp is a polynomial). Likewise a chosen Triton that does not run is an error.

:func:`problem` says why a backend cannot run on a device (None: it runs): the package
must import and a tiny call must run, answered once per process. A grouped-gemm built
against another torch imports with an undefined symbol, or fails its first call; either
way it is not chosen, and naming it gives that reason.

A training run resolves every ``moe.*_backend=auto`` once, for its device and
``train.precision``, before its ranks start (:func:`resolve_config`), and saves the names in
its config.yaml. The config (and ``--set moe.<op>_backend=``) is the one way to choose.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from moe_fold.config import choices, conv_shape_problem, conv_shapes

from .delta_rule_fla import FLA_INSTALL, fla_function
from .short_conv_causal_conv1d import CONV_INSTALL, causal_conv1d_function
from .ssd_mamba import MAMBA_INSTALL, mamba_function

# The config field of each op's backend.
CONFIG_FIELDS = {"gemm": "moe.gemm_backend", "permute": "moe.permute_backend", "swiglu": "moe.swiglu_backend",
                 "topk": "moe.topk_backend", "delta_rule": "model.linear_backend",
                 "ssd": "model.mamba_backend", "conv": "model.conv_backend"}
# The backends of each op: the choices of its field other than auto.
OPS: dict[str, tuple[str, ...]] = {op: choices(field)[1:] for op, field in CONFIG_FIELDS.items()}
# Optional packages the rule looks at: chosen when they run, skipped otherwise.
EXTRAS = ("grouped_gemm", "fla", "mamba_ssm", "causal_conv1d")
GPU_INSTALL = "pip install 'moe-fold[gpu]' (the grouped_gemm package, built against this torch; needs CUDA)"
# grouped_mm's fast path: bf16bf16_grouped_gemm_impl_sm90_sm100 in torch's GroupMM.cu.
_GROUPED_MM_MAJORS = (9, 10)


# The optional package of each recurrent layer op.
_RECURRENT_EXTRAS = {"delta_rule": "fla", "ssd": "mamba_ssm", "conv": "causal_conv1d"}


class BackendUnavailable(RuntimeError):
    """A backend was named (or chosen) that cannot run on this device."""


def choose(op: str, device_type: str, capability: Optional[tuple[int, int]], dtype: torch.dtype,
           extras: frozenset[str] = frozenset(), *, topk_fusable: bool = True) -> str:
    """The backend ``auto`` means for ``op`` on this device and dtype; see the module docstring.

    ``capability``: the CUDA compute capability (major, minor), None off CUDA. ``extras``:
    the names of :data:`EXTRAS` that run here. ``topk_fusable``: False when the router
    groups experts or biases the selection, which the Triton top-k does not fuse."""
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {tuple(OPS)}")
    if op in _RECURRENT_EXTRAS:
        # The recurrent layers' extras: kernels for sm80+, none in float64.
        extra = _RECURRENT_EXTRAS[op]
        on_gpu = device_type == "cuda" and capability is not None and capability[0] >= 8
        return extra if on_gpu and dtype != torch.float64 and extra in extras else "torch"
    if device_type == "cpu":
        if op == "gemm":
            return "torch" if dtype in (torch.float32, torch.bfloat16, torch.float16) else "loop"
        return "cpu" if op == "swiglu" else "torch"
    if device_type != "cuda" or capability is None or capability[0] < 8:
        return "loop" if op == "gemm" else "torch"
    if op == "gemm":
        if dtype != torch.bfloat16:
            return "loop"
        if capability[0] in _GROUPED_MM_MAJORS:
            return "torch"
        return "grouped_gemm" if "grouped_gemm" in extras else "loop"
    if op == "topk" and not topk_fusable:
        return "torch"
    return "triton"


def capability(device: torch.device) -> Optional[tuple[int, int]]:
    """The CUDA compute capability of ``device``; None off CUDA."""
    if device.type != "cuda":
        return None
    return _cuda_capability(torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index))


@functools.lru_cache(maxsize=None)
def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def extras(device: torch.device) -> frozenset[str]:
    """The optional packages of :data:`EXTRAS` that run on ``device``."""
    return frozenset(name for name in EXTRAS if problem(name, device) is None)


@functools.lru_cache(maxsize=None)
def choose_for(op: str, device: torch.device, dtype: torch.dtype, *, topk_fusable: bool = True) -> str:
    """:func:`choose` with the facts of ``device`` read here (once per process: kernels ask
    on every call)."""
    found = extras(device) if device.type == "cuda" else frozenset()
    return choose(op, device.type, capability(device), dtype, found, topk_fusable=topk_fusable)


def problem(backend: str, device: torch.device) -> Optional[str]:
    """Why ``backend`` cannot run on ``device`` (None: it imports and a tiny call runs).

    ``torch`` and ``loop`` always run. Answered once per process and device."""
    if backend == "triton":
        # Environment: Triton's own switch to its CPU interpreter.
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not interpret:
            return f"Triton runs on CUDA tensors, or on the CPU interpreter with TRITON_INTERPRET=1 (got {device})"
        return _probe("triton", _probe_device(device), interpret)
    if backend == "grouped_gemm":
        return _probe("grouped_gemm", _probe_device(device), False)
    if backend == "fla":
        if device.type != "cuda":
            return f"flash-linear-attention's Triton kernels run on CUDA tensors, got {device}"
        return _probe("fla", _probe_device(device), False)
    if backend == "mamba_ssm":
        if device.type != "cuda":
            return f"mamba-ssm's Triton kernels run on CUDA tensors, got {device}"
        return _probe("mamba_ssm", _probe_device(device), False)
    if backend == "causal_conv1d":
        if device.type != "cuda":
            return f"causal-conv1d's kernels run on CUDA tensors, got {device}"
        return _probe("causal_conv1d", _probe_device(device), False)
    if backend == "cpu":
        if device.type != "cpu":
            return f"the C kernels run on CPU tensors, got {device}"
        return _probe("cpu", device, False)
    return None


def _probe_device(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@functools.lru_cache(maxsize=None)
def _probe(backend: str, device: torch.device, interpret: bool) -> Optional[str]:
    # `interpret` is part of the key only: a test may switch TRITON_INTERPRET.
    try:
        _TINY_CALLS[backend](device)
    except Exception as err:  # any failure means "does not run here"; the message says which
        return f"{type(err).__name__}: {err}".strip()
    return None


def _tiny_triton(device: torch.device) -> None:
    import triton  # noqa: F401  (a broken install fails here, before our kernels import it)

    from .swiglu_triton import swiglu_forward_triton

    x = torch.tensor([[1.0, 2.0]], device=device)
    out = swiglu_forward_triton(x, None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not torch.allclose(out.cpu(), torch.nn.functional.silu(x[:, :1]).cpu() * 2.0):
        raise RuntimeError(f"a tiny Triton kernel returned {out.tolist()}, not silu(1) * 2")


def _tiny_grouped_gemm(device: torch.device) -> None:
    try:
        from grouped_gemm import ops
    except Exception as err:  # an ABI mismatch raises ImportError (undefined symbol) or OSError
        raise ImportError(f"import grouped_gemm failed ({type(err).__name__}: {err}); {GPU_INSTALL}") from err
    if device.type != "cuda":
        raise RuntimeError(f"grouped_gemm runs on CUDA only, got {device}")
    x = torch.ones(2, 16, dtype=torch.bfloat16, device=device)
    w = torch.ones(2, 16, 16, dtype=torch.bfloat16, device=device)
    out = ops.gmm(x, w, torch.tensor([1, 1], device="cpu"), False)
    torch.cuda.synchronize(device)
    if out.shape != (2, 16) or not bool((out == 16).all()):
        raise RuntimeError("grouped_gemm's tiny call returned a wrong product")


def _tiny_c_swiglu(device: torch.device) -> None:
    from .swiglu_cpu import swiglu_forward_cpu

    out = swiglu_forward_cpu(torch.tensor([[0.0, 3.0]], device="cpu"), None)
    if out.tolist() != [[0.0]]:
        raise RuntimeError(f"the C SwiGLU returned {out.tolist()} for silu(0) * 3, not 0")


def _tiny_fla(device: torch.device) -> None:
    chunk = fla_function("kda")
    q = torch.ones(1, 4, 1, 16, device=device)
    o, _ = chunk(q, q, q, torch.zeros(1, 4, 1, 16, device=device), torch.ones(1, 4, 1, device=device), scale=1.0)
    torch.cuda.synchronize(device)
    if not bool(torch.isfinite(o).all()):
        raise RuntimeError("flash-linear-attention's chunk_kda returned non-finite values on a tiny call")


def _tiny_mamba(device: torch.device) -> None:
    scan = mamba_function()
    x = torch.ones(1, 4, 1, 16, device=device)
    B = torch.ones(1, 4, 1, 16, device=device)
    y = scan(x, torch.ones(1, 4, 1, device=device), -torch.ones(1, device=device), B, B, 64)
    torch.cuda.synchronize(device)
    if not bool(torch.isfinite(y).all()):
        raise RuntimeError("mamba-ssm's mamba_chunk_scan_combined returned non-finite values on a tiny call")


def _tiny_causal_conv1d(device: torch.device) -> None:
    fn = causal_conv1d_function()
    x = torch.ones(1, 4, 8, device=device).transpose(1, 2)  # (batch, dim, seqlen), channels innermost
    seq_idx = torch.tensor([[0, 0, 1, 1]], dtype=torch.int32, device=device)
    out = fn(x, torch.ones(8, 2, device=device), None, seq_idx=seq_idx, activation=None)
    torch.cuda.synchronize(device)
    if out[0, 0].tolist() != [1.0, 2.0, 1.0, 2.0]:
        raise RuntimeError(f"causal-conv1d's tiny call returned {out[0, 0].tolist()}, not [1, 2, 1, 2]")


_TINY_CALLS = {"triton": _tiny_triton, "grouped_gemm": _tiny_grouped_gemm, "cpu": _tiny_c_swiglu, "fla": _tiny_fla,
               "mamba_ssm": _tiny_mamba, "causal_conv1d": _tiny_causal_conv1d}


def resolve(op: str, backend: str, x: torch.Tensor, *, topk_fusable: bool = True) -> str:
    """The backend ``op`` runs on ``x``: ``backend`` itself, or :func:`choose_for` when it is
    ``auto``. Raises :class:`BackendUnavailable` if that backend cannot run on ``x``'s device.
    ``backend`` must already be a valid name (each interface checks with its own message)."""
    name = choose_for(op, x.device, x.dtype, topk_fusable=topk_fusable) if backend == "auto" else backend
    why = problem(name, x.device)
    if why is not None:
        how = f"auto chose {name!r} for {x.device} {x.dtype}" if backend == "auto" else f"{name!r}"
        fix = _FIXES[name].format(field=CONFIG_FIELDS[op])
        raise BackendUnavailable(f"{op} backend {how} cannot run here: {why}; fix: {fix}")
    return name


# --------------------------------------------------------------------------- a run's config

# The dtype the expert kernels see under each train.precision (autocast runs them in bf16).
PRECISION_DTYPES = {"fp32": torch.float32, "bf16-autocast": torch.bfloat16, "bf16": torch.bfloat16}
_FIXES = {
    "cpu": "install a C compiler (cc on PATH, or CC=/path/to/compiler), or set moe.swiglu_backend=torch "
           "(the torch SwiGLU rounds differently: the C kernel's exp is a polynomial)",
    "triton": "install the triton release that matches this torch, or set {field}=torch",
    "grouped_gemm": GPU_INSTALL + ", or set moe.gemm_backend=loop",
    "fla": FLA_INSTALL + ", or set model.linear_backend=torch",
    "mamba_ssm": MAMBA_INSTALL + ", or set model.mamba_backend=torch",
    "causal_conv1d": CONV_INSTALL + ", or set model.conv_backend=torch",
}


def resolve_config(config, device: torch.device):
    """``config`` with every ``moe.*_backend``, ``model.linear_backend`` (with Gated DeltaNet
    or KDA layers), ``model.mamba_backend`` (with Mamba2 layers) and ``model.conv_backend``
    (with any of them) that is ``auto`` replaced by the backend the rule chooses for
    ``device`` and ``train.precision`` (the delta rule and the SSD scan run in float32
    whatever the precision), so that the run's saved and printed
    config names what ran. Raises ConfigError, one line per backend that cannot run on
    ``device`` (the field, the value, why, the fix)."""
    import dataclasses

    from moe_fold.config import ConfigError

    moe = config.moe
    device = _probe_device(torch.device(device))
    dtypes = {op: PRECISION_DTYPES[config.train.precision] for op in OPS}
    dtypes["topk"] = torch.float64 if moe.router_dtype == "float64" else torch.float32
    dtypes["delta_rule"] = dtypes["ssd"] = torch.float32
    fusable = moe.num_groups is None and not moe.expert_bias
    resolved: dict[str, dict[str, str]] = {"moe": {}, "model": {}}
    problems = []
    # A model without such layers never calls the op: its field stays as set.
    kinds = set(config.model.layer_types or ())
    absent = {"delta_rule": not kinds & {"gated_deltanet", "kda"}, "ssd": "mamba2" not in kinds,
              "conv": not kinds & {"gated_deltanet", "kda", "mamba2"}}
    # A conv shape causal-conv1d does not take runs torch (a named causal_conv1d is refused by its rule).
    conv_misfits = [f"{kind} width {width} x {channels} channels"
                    for kind, (width, channels) in conv_shapes(config.model, config.parallel.tp).items()
                    if conv_shape_problem(width, channels) is not None]
    for op, field in CONFIG_FIELDS.items():
        if absent.get(op, False):
            continue
        section, name_in_section = field.split(".")
        value = getattr(getattr(config, section), name_in_section)
        setting = f"{field}={value}"
        if value == "auto" and op == "swiglu" and moe.activation in ("clamped_swiglu", "relu2"):
            # gpt-oss's clamped SwiGLU and Nemotron-H's relu2 are torch ops only (kernels/swiglu.py).
            name = "torch"
            setting += f" ({moe.activation} runs on torch)"
        elif value == "auto" and op == "conv" and conv_misfits:
            name = "torch"
            setting += f" (causal-conv1d does not take the {', '.join(conv_misfits)} conv: torch)"
        elif value == "auto":
            name = choose_for(op, device, dtypes[op], topk_fusable=fusable)
            setting += f" (chose {name} for {device} {str(dtypes[op]).replace('torch.', '')})"
        else:
            name = value
        why = problem(name, device)
        if why is not None:
            problems.append(f"{setting} cannot run here: {why}; fix: {_FIXES[name].format(field=field)}")
        resolved[section][name_in_section] = name
    if problems:
        raise ConfigError(problems)
    return dataclasses.replace(config, moe=dataclasses.replace(moe, **resolved["moe"]),
                               model=dataclasses.replace(config.model, **resolved["model"]))
