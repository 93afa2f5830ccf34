"""Count, on any device, the calls that would make the host wait for a GPU: a test
helper, outside the installed package, since it patches torch's autograd engine while it
counts (the installed package never imports tests/: tests/meta/test_architecture.py).

On a GPU the host queues kernels and runs ahead; a call that needs a value the device
computes (``.item()``, ``.tolist()``, an output whose size depends on the data, a copy to
the host, a copy from pageable host memory) stalls it until the queue drains. Those stalls
are invisible on a CPU, where everything is already on the host, so this module counts
them by *what is called*, which is the same on both devices::

    with count_host_syncs() as syncs:
        y = layer(x)
    assert syncs.count <= 1, syncs.calls      # [(op, "file:line in function"), ...]

What counts (one per call):

- reads into Python: ``Tensor.item tolist numpy cpu __bool__ __int__ __float__ __index__
  __format__ __contains__``, ``.to("cpu")``, ``torch.equal``, ``allclose``, ``is_nonzero``;
- outputs whose size depends on the data: ``nonzero`` (``argwhere``, one-argument ``where``),
  ``unique``, ``unique_consecutive``, ``masked_select``, ``bincount``, indexing or assigning
  with a boolean mask, ``repeat_interleave`` of tensor repeats without ``output_size``;
- copies from the host to the device: ``torch.tensor`` / ``as_tensor`` / ``asarray`` /
  ``Tensor.new_tensor`` of Python data onto a device (any ``device=`` other than the host),
  and a blocking ``.to(device)`` of a host tensor (a ``non_blocking=True`` one is queued);
- ``torch.cuda.synchronize``, ``torch.distributed.barrier`` and the object collectives
  (``all_gather_object``, ``broadcast_object_list`` ...), which pickle through the device.

Host tensors and device tensors. On a CPU every tensor is in host memory, so the counter
tracks where each tensor made inside the block *would* live on a GPU, and counts a read
only of a tensor the device computed:

- host: what a factory makes without a device (torch's default device, the host:
  ``torch.arange(n)``, and from Python or numpy data ``torch.tensor(list)``,
  ``torch.from_numpy``, ``torch.frombuffer``: the loader's ``cu_seqlens``, tokens and
  masks), or with a host device (``"cpu"``, or the ``.device`` of
  a host tensor: ``torch.arange(n, device=cu_seqlens.device)``); ``.cpu()`` and
  ``.to(host)`` results; and whatever an op makes from host tensors only. Their reads,
  and the data-sized ops on them (``nonzero``, ``repeat_interleave``, a bool mask), are
  free and not counted;
- device: everything else, among them every tensor made before the block (parameters,
  inputs, buffers): the counter cannot trace their origin, so it takes them for device
  tensors and counts their reads. Make host data inside the block to have it seen as such;
- a ``.to(device)`` of a host tensor makes a device tensor (on a CPU the copy is elided
  and torch returns the tensor itself; the counter hands back an alias, which it tracks
  as a device tensor).

A collective whose split sizes are a Python list costs nothing more by itself: the read
that produced the list is counted.

Limits: it sees Python-level torch calls (TorchFunctionMode; ``from_numpy`` and
``frombuffer``, which take no tensor, are patched), forward and backward (the autograd
engine is run with the mode active, see ``_engine_run_backward`` below), not what C++
kernels do inside, nor calls on other threads; a host tensor used as an operand of a
device op (an implicit copy) is not counted; a ``torch.device("cpu")`` made from scratch
is not told apart from the compute device's (write ``"cpu"``, ``.cpu()`` or a host
tensor's ``.device`` for the host).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.autograd
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["HostSyncs", "count_host_syncs", "uncounted"]

_T = torch.Tensor
_READS = {
    _T.item, _T.tolist, _T.numpy, _T.cpu, _T.__bool__, _T.__int__, _T.__float__, _T.__index__,
    _T.__format__, _T.__contains__, _T.__array__, _T.equal, _T.allclose, _T.is_nonzero,
    torch.equal, torch.allclose, torch.is_nonzero,
}
_DATA_SIZED = {
    torch.nonzero, _T.nonzero, torch.argwhere, _T.argwhere, torch.unique, _T.unique,
    torch.unique_consecutive, _T.unique_consecutive, torch.masked_select, _T.masked_select,
    torch.bincount, _T.bincount,
}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, _T.new_tensor}
# Made from host memory without a torch call the mode sees (no tensor argument): patched.
_FROM_HOST_MEMORY = ("from_numpy", "frombuffer")
_DEVICE_OF = _T.device.__get__
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                       "send_object_list", "recv_object_list", "barrier")
_THIS = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass
class HostSyncs:
    """What :func:`count_host_syncs` saw: ``calls`` lists ``(op, call site)``."""

    calls: list[tuple[str, str]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.calls)

    def record(self, op: str) -> None:
        self.calls.append((op, _call_site()))


def _call_site() -> str:
    """The innermost frame outside torch and this file: where the project made the call."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        # contextlib: the frames of a `with` block around the call are not where it was made.
        if not path.startswith(_TORCH) and path != _THIS and os.path.basename(path) != "contextlib.py":
            return f"{os.path.relpath(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _tensors(args: Any, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


def _has_bool_mask(index: Any) -> bool:
    items = index if isinstance(index, (list, tuple)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _is_str_cpu(device: Any) -> bool:
    return isinstance(device, str) and device.split(":")[0] == "cpu"


class _Counter(TorchFunctionMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs
        # Tensors that live on the host on a GPU too (see the module doc).
        self.host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.host_devices: dict[int, torch.device] = {}  # id -> device read from a host tensor

    def mark_host(self, t: torch.Tensor) -> torch.Tensor:
        self.host[t] = True
        return t

    def _is_host(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.host

    def _all_host(self, args: Any, kwargs: dict) -> bool:
        inputs = _tensors(args, kwargs)
        return bool(inputs) and all(self._is_host(t) for t in inputs)

    def _is_host_device(self, device: Any) -> bool:
        """``device`` names the host: the string ``"cpu"``, or a device object read from a
        host tensor (``cu.device``), which on a GPU is the CPU whatever the compute device."""
        return _is_str_cpu(device) or (isinstance(device, torch.device) and id(device) in self.host_devices)

    def _op(self, func, args, kwargs) -> str | None:
        """The name to count for this call, or None when it does not block the host."""
        if func in _READS:
            return None if self._is_host(args[0]) else _name(func)
        # Below, a call on host tensors only runs on the host: nothing to wait for.
        if func in _DATA_SIZED:
            return None if self._all_host(args, kwargs) else _name(func)
        if func is torch.where and len(args) + len(kwargs) == 1:
            return None if self._all_host(args, kwargs) else "torch.where(condition)"
        if func in (_T.__getitem__, _T.__setitem__, _T.index_put, _T.index_put_, torch.index_put):
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            if not _has_bool_mask(index) or self._all_host(args, kwargs):
                return None
            return _name(func) + "[bool mask]"
        if func in (torch.repeat_interleave, _T.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if len(args) == 1 else None)
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None \
                    and not self._all_host(args, kwargs):
                return "repeat_interleave without output_size"
            return None
        if func in _FROM_DATA:
            data = args[1] if func is _T.new_tensor else (args[0] if args else kwargs.get("data"))
            device = kwargs.get("device", args[0].device if func is _T.new_tensor else None)
            if func is _T.new_tensor and "device" not in kwargs and self._is_host(args[0]):
                return None
            if isinstance(data, torch.Tensor) or device is None or self._is_host_device(device):
                return None
            return _name(func) + "(python data, device=...)"
        if func is _T.to:
            target = _to_device(args, kwargs)
            if target is None:
                return None
            if self._is_host_device(target):
                return None if self._is_host(args[0]) else "Tensor.to(host)"
            if not self._is_host(args[0]) or kwargs.get("non_blocking", False):
                # A non-blocking copy to the device is queued: from pinned memory it is
                # asynchronous, and from pageable memory CUDA stages it without waiting for
                # the device's queue.
                return None
            return "Tensor.to(device) of a host tensor"
        return None

    def _lands_on_host(self, func, args, kwargs) -> bool:
        """Whether the call's outputs live on the host on a GPU too."""
        device = kwargs.get("device")
        if device is not None and not isinstance(device, torch.Tensor):
            return self._is_host_device(device)  # a factory, or a copy, told where to go
        if func in _FROM_DATA and func is not _T.new_tensor:
            data = args[0] if args else kwargs.get("data")
            return not isinstance(data, torch.Tensor)
        if func is _T.cpu:
            return True
        if func is _T.to:
            target = _to_device(args, kwargs)
            return self._is_host_device(target) or (target is None and self._is_host(args[0]))
        if not _tensors(args, kwargs):
            return device is None  # a factory without a device: torch's default, the host
        return self._all_host(args, kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_OF:
            device = func(*args, **kwargs)
            if self._is_host(args[0]):
                # Held, so that its id stays its own while the block runs.
                self.host_devices[id(device)] = device
            return device
        op = self._op(func, args, kwargs)
        if op is not None:
            self.syncs.record(op)
        out = func(*args, **kwargs)
        if func is _T.to and out is args[0] and self._is_host(out) and not self._lands_on_host(func, args, kwargs):
            # On a CPU the copy of a host tensor to the compute device is elided and returns
            # the tensor itself; on a GPU it is a new device tensor. An alias stands for it.
            return out.view_as(out)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        if outs and self._lands_on_host(func, args, kwargs):
            for t in outs:
                self.host[t] = True
        return out


def _to_device(args: Any, kwargs: dict) -> Any:
    """The device a ``Tensor.to`` call moves to (a string, a device), None for a dtype change."""
    targets = (a for a in args[1:] if isinstance(a, (str, torch.device, torch.Tensor)))
    target = kwargs.get("device", next(targets, None))
    return target.device if isinstance(target, torch.Tensor) else target


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count the calls inside the block that would block the host on a GPU (module doc).
    Nests: an inner block's calls are counted by the outer one too."""
    syncs = HostSyncs()
    counter = _Counter(syncs)
    run_backward = torch.autograd._engine_run_backward

    def counted_backward(*args, **kwargs):
        # The engine runs the graph with the torch-function modes active when it starts;
        # torch.autograd.backward calls it from inside our handler, where the mode is
        # popped, so push it back for the backward's own calls.
        with counter:
            return run_backward(*args, **kwargs)

    patched = [(torch.autograd, "_engine_run_backward", counted_backward)]
    if torch.cuda.is_available():
        patched.append((torch.cuda, "synchronize", _recording(torch.cuda.synchronize, syncs, "torch.cuda.synchronize")))
    for name in _OBJECT_COLLECTIVES:
        patched.append((dist, name, _recording(getattr(dist, name), syncs, f"torch.distributed.{name}")))
    for name in _FROM_HOST_MEMORY:
        patched.append((torch, name, _marking(getattr(torch, name), counter)))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    try:
        for owner, name, value in patched:
            setattr(owner, name, value)
        with counter:
            yield syncs
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _recording(fn, syncs: HostSyncs, op: str):
    def wrapped(*args, **kwargs):
        syncs.record(op)
        return fn(*args, **kwargs)
    return wrapped


def _marking(fn, counter: _Counter):
    def wrapped(*args, **kwargs):
        return counter.mark_host(fn(*args, **kwargs))
    return wrapped


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Inside a counting block: calls that are not counted, nor their tensors tracked (a
    library's stand-in checking what it was given, which the library itself never reads)."""
    with torch._C.DisableTorchFunction():
        yield
