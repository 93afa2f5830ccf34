"""The ``cpu`` backend of ``swiglu.py``: the C loops of ``swiglu_cpu.c``, one pass over
memory each way, compiled on first use and called through ctypes.

Why C: on a CPU the torch backend is seven elementwise ops in the backward (three in the
forward), each a pass over ``[N, F]`` and an OpenMP region. One fused loop reads each
input once. bench/moe_layer.py's fc1 output ``[8192, 2048]``, float32, 2 threads:
forward 4 ms and backward 9 ms against 6 and 19-25 ms.

Build: ``cc -O3 -march=native`` (the machine that runs is the machine that compiles) into
``$XDG_CACHE_HOME/moe_fold`` (default ``~/.cache/moe_fold``), named by a hash of the source, the
compiler, the flags and the CPU, written to a temporary name and renamed, so concurrent ranks
never load a half-written library. The compiler is ``$CC`` or ``cc``. Whether it builds
and runs here is :func:`moe_fold.kernels.backends.problem` (``cpu``), which raises with
the compiler's message wherever ``cpu`` is named or chosen by ``auto``.

Threads: ctypes releases the GIL during a call, so the rows are split into
``torch.get_num_threads()`` contiguous ranges run at once on a small thread pool (the
calling thread takes the first). Its own threads rather than OpenMP: a second OpenMP
runtime beside torch's would keep its own pool of threads.

Dtypes: float32 and float64 (the tests' gradcheck) natively; bfloat16 and float16 are
computed in float32 and rounded once, like the torch backend.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

_SOURCE = Path(__file__).with_name("swiglu_cpu.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
_NATIVE = {torch.float32: "f32", torch.float64: "f64"}
# Below this many elements a call runs on the calling thread alone: handing rows to the
# pool costs more than it saves.
_MIN_PARALLEL_ELEMENTS = 1 << 16


class BuildError(RuntimeError):
    """The C kernels could not be compiled or loaded here."""


def _cache_dir() -> Path:
    # Environment: the user's cache folder (the XDG convention pip, torch and Triton follow).
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moe_fold"


def _cpu_identity() -> str:
    """The lines of /proc/cpuinfo that name the CPU and its instruction sets (Linux), else
    what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = {line.strip() for line in f if line.startswith(("model name", "flags", "vendor_id"))}
        return "\n".join(sorted(lines))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    # Environment: the C toolchain's convention for the compiler to use.
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise BuildError(f"swiglu backend 'cpu' needs a C compiler: {compiler!r} (the CC environment "
                         f"variable, default cc) is not on PATH")
    source = _SOURCE.read_bytes()
    # -march=native: a cache shared by machines with other CPUs (a home on NFS) must not
    # hand one's library to the other, so the CPU's model and flags are in the name too.
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, _cpu_identity()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"swiglu_cpu-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise BuildError(f"swiglu backend 'cpu': {compiler} failed on {_SOURCE.name}:\n{done.stderr}")
            os.replace(tmp, path)  # atomic: another rank sees no library or a whole one
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise BuildError(f"swiglu backend 'cpu': cannot load {path}: {err}") from err
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for suffix in _NATIVE.values():
        fwd = getattr(lib, f"swiglu_forward_{suffix}")
        fwd.argtypes, fwd.restype = [ptr, i64, ptr, ptr, i64, i64, i64, i64], None
        bwd = getattr(lib, f"swiglu_backward_{suffix}")
        bwd.argtypes, bwd.restype = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64], None
    return lib


_pool: Optional[ThreadPoolExecutor] = None
_pool_workers = 0
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    # A forked child has none of its parent's threads: it starts a pool of its own.
    global _pool, _pool_workers
    _pool, _pool_workers = None, 0


os.register_at_fork(after_in_child=_forget_pool)


def _run_rows(kernel, rows: int, elements: int) -> None:
    """``kernel(row0, row1)`` over ``[0, rows)``, split over torch's thread count."""
    global _pool, _pool_workers
    parts = min(torch.get_num_threads(), rows, max(1, elements // _MIN_PARALLEL_ELEMENTS))
    if parts <= 1:
        kernel(0, rows)
        return
    with _pool_lock:
        if _pool_workers < parts - 1:
            _pool, _pool_workers = ThreadPoolExecutor(max_workers=parts - 1, thread_name_prefix="moe_fold_swiglu"), \
                parts - 1
        pool = _pool
    bounds = [rows * k // parts for k in range(parts + 1)]
    futures = [pool.submit(kernel, bounds[k], bounds[k + 1]) for k in range(1, parts)]
    kernel(bounds[0], bounds[1])
    for future in futures:
        future.result()


def _native(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` as ``dtype`` with unit stride in its last dim (rows may have any stride)."""
    if t is None:
        return None
    t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(x: torch.Tensor) -> torch.dtype:
    if x.device.type != "cpu":
        raise ValueError(f"swiglu backend 'cpu' runs on CPU tensors, got one on {x.device}")
    if x.dtype in _NATIVE:
        return x.dtype
    if x.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    raise TypeError(f"swiglu backend 'cpu' takes float32, float64, bfloat16 or float16, got {x.dtype}")


def swiglu_forward_cpu(x: torch.Tensor, probs: Optional[torch.Tensor]) -> torch.Tensor:
    """``x[N, 2F]``, ``probs[N]`` or None -> ``[N, F]``."""
    cd = _check(x)
    n, f = x.shape[0], x.shape[1] // 2
    xs, ps = _native(x, cd), None if probs is None else _native(probs, cd).contiguous()
    # device= always: the C loop writes through data_ptr(), which must be host memory
    # whatever torch's default device is.
    out = torch.empty(n, f, dtype=cd, device="cpu")
    kernel = getattr(_library(), f"swiglu_forward_{_NATIVE[cd]}")
    p_ptr = None if ps is None else ps.data_ptr()
    _run_rows(lambda r0, r1: kernel(xs.data_ptr(), xs.stride(0), p_ptr, out.data_ptr(), out.stride(0), f, r0, r1),
              n, n * f)
    return out.to(x.dtype)


def swiglu_backward_cpu(grad: torch.Tensor, x: torch.Tensor, probs: Optional[torch.Tensor], want_probs: bool
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Grads of ``x[N, 2F]`` and (if ``want_probs``) ``probs[N]`` from ``grad[N, F]``."""
    cd = _check(x)
    n, f = x.shape[0], x.shape[1] // 2
    xs, gs = _native(x, cd), _native(grad, cd)  # rows of any stride, 0 included (a .sum()'s grad)
    ps = None if probs is None else _native(probs, cd).contiguous()
    grad_x = torch.empty(n, 2 * f, dtype=cd, device="cpu")
    grad_probs = torch.empty(n, dtype=cd, device="cpu") if want_probs and ps is not None else None
    kernel = getattr(_library(), f"swiglu_backward_{_NATIVE[cd]}")
    p_ptr = None if ps is None else ps.data_ptr()
    dp_ptr = None if grad_probs is None else grad_probs.data_ptr()
    _run_rows(lambda r0, r1: kernel(gs.data_ptr(), gs.stride(0), xs.data_ptr(), xs.stride(0), p_ptr,
                                    grad_x.data_ptr(), grad_x.stride(0), dp_ptr, f, r0, r1),
              n, n * f)
    return grad_x.to(x.dtype), None if grad_probs is None else grad_probs.to(probs.dtype)
