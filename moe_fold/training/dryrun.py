"""The dry run: any rank of a job of any size, built and stepped once with the real code,
on one CPU, without allocating its tensors.

For each traced rank, :func:`trace_rank`:

1. starts torch's fake process-group backend at the full world size as that rank
   (``torch.testing._internal.distributed.fake_pg``: collectives return at once, touch no
   data), and builds the rank's process groups as ``train`` does (every group of the world
   is formed, exactly as at world N);
2. builds the rank's model, float32 masters, optimizer (ZeRO-1 shards included) and
   gradient reduction with :func:`moe_fold.training.run_setup.build_trainable` on the
   meta device: shapes and dtypes, no storage;
3. runs one training step as :func:`moe_fold.training.train.run_step` does: every
   micro-batch of the real pipeline schedule forward and backward
   (:func:`moe_fold.training.step.forward_backward`), the loss all-reduce, then
   :func:`moe_fold.training.optim.apply_gradients`.

A dispatch mode (:class:`_Tracer`) sees every op: it follows each storage from its birth
to its death (bytes by kind: ``weights``, ``grads``, ``optimizer``, ``activations`` and the
``peak`` of all of them together) and records every collective in order (op, group name,
group size, bytes by the rules of :mod:`moe_fold.comm`, and the sizes the ranks of a group
must agree on).

Values do not exist, so the one data-dependent quantity, routing, is set by a rule
(:mod:`moe_fold.dispatch.planned_routing`: balanced, Zipf, one expert, a starved ep
rank), handed to every dispatcher as its count reader. Other host reads of a value
(the loss, the gradient norm, a finiteness check) read 1.0, or True. Unmasked attention
runs as the fused (flash) kernel a GPU runs, and a masked block (sliding window, sinks)
as flex attention (:func:`_fused_attention`). Kernel backends
are the torch ones (the GPU kernels do not run on meta tensors): their memory is what
the torch implementations allocate. The routing statistics of metrics.jsonl are not
collected (their all-reduce is not traced).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moe_fold.comm import all_reduce_
from moe_fold.config import Config, validate
from moe_fold.data.loader import Batch
from moe_fold.dispatch.planned_routing import PlannedRouting
from moe_fold.layout import ParallelLayout, create_process_groups

__all__ = ["RankTrace", "Collective", "default_ranks", "dry_run_config", "trace_rank", "dry_run",
           "order_mismatches"]

MEMORY_KINDS = ("weights", "grads", "optimizer", "activations")


@dataclass
class Collective:
    """One collective a rank issued. ``peer``: the other rank of a send or recv (global);
    ``shape``: what the ranks of the group must agree on (numel and dtype, or the split
    sizes of an all-to-all)."""
    op: str
    group: str
    size: int
    bytes: int
    ranks: tuple[int, ...] = ()
    peer: Optional[int] = None
    shape: tuple = ()

    def public(self) -> dict:
        out = {"op": self.op, "group": self.group, "size": self.size, "bytes": self.bytes}
        if self.peer is not None:
            out["peer"] = self.peer
        return out


@dataclass
class RankTrace:
    rank: int
    pp_stage: int
    coords: dict[str, int]
    params: int
    memory: dict[str, int]
    collectives: list[Collective] = field(default_factory=list)

    def public(self) -> dict:
        return {"rank": self.rank, "pp_stage": self.pp_stage, "coords": self.coords, "params": self.params,
                "memory": self.memory, "collectives": [c.public() for c in self.collectives]}


# --------------------------------------------------------------------------- the tracer

_SCALAR = torch.ops.aten._local_scalar_dense.default
_TO_COPY = torch.ops.aten._to_copy.default


_CPU = torch.device("cpu")


class _Unknown(Exception):
    """A meta tensor whose values the dry run does not have."""


_PLAIN_ARGS = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                         torch.memory_format))
_NO_KEY = object()


def _signature(args) -> tuple:
    """What an op's output shapes can depend on in ``args``: shapes, strides and dtypes of
    meta tensors, plain values; ``_NO_KEY`` inside when something else is there."""
    out = []
    for x in args:
        if isinstance(x, torch.Tensor):
            out.append((x.shape, x.stride(), x.dtype) if x.is_meta else _NO_KEY)
        elif type(x) in _PLAIN_ARGS:
            out.append(x)
        elif isinstance(x, (tuple, list)):
            out.append(_signature(x))
        elif isinstance(x, torch.Generator):
            out.append("generator")
        else:
            out.append(_NO_KEY)
    return tuple(out)


# op -> 1 (returns new tensors), 2 (in place: returns its first argument), 0 (anything else)
_KIND: dict[int, int] = {}


def _op_kind(func) -> int:
    schema = func._schema
    returns, arguments = schema.returns, schema.arguments
    if not returns:
        return 0
    if not any(a.alias_info is not None for a in arguments) and not any(r.alias_info is not None for r in returns) \
            and all(str(r.type) in ("Tensor", "Tensor?") for r in returns):
        return 1
    written = [a for a in arguments if a.alias_info is not None and a.alias_info.is_write]
    if len(returns) == 1 and len(written) == 1 and arguments[0] is written[0] and returns[0].alias_info is not None \
            and returns[0].alias_info.is_write:
        return 2
    return 0


def _cache_key(func, args, kwargs) -> Optional[tuple]:
    """What an op's outputs depend on, for an op that returns new tensors (no view, no
    out= argument) or works in place on its first argument; None for other ops."""
    kind = _KIND.get(id(func))
    if kind is None:
        kind = _KIND[id(func)] = _op_kind(func)
    if not kind:
        return None
    sig = _signature(args)
    kw = _signature(tuple(kwargs.items())) if kwargs else ()
    if _NO_KEY in sig or _NO_KEY in kw or any(_NO_KEY in p for p in sig if type(p) is tuple):
        return None
    return (id(func), kind, sig, kw)


class _Tracer(TorchDispatchMode):
    """Follows every storage an op returns (bytes, birth and death, as events) and records
    every c10d collective; answers host reads of meta values (module docstring)."""

    def __init__(self, shapes: Optional[dict] = None):
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (storage serial, +bytes at birth / -bytes at death)
        self._serials: dict[weakref.ref, tuple[int, int, int]] = {}  # storage -> (address, serial, bytes)
        self._next_serial = 0
        self._live: dict[int, int] = {}  # storage address -> serial
        # storage address -> the host copy of its values: integer tensors made from host
        # values (document ids, counts), followed through the ops that only they feed
        self._values: dict[int, torch.Tensor] = {}
        self.collectives: list[Collective] = []
        # op and input shapes -> output shapes; shared by the ranks of one dry run
        self._shapes: dict[tuple, tuple] = {} if shapes is None else shapes

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled: without this, torch wraps __torch_dispatch__ in a
        # dynamo-disabling frame, a cost paid on every op.
        return False

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        serial = self._next_serial
        self._next_serial += 1
        nbytes = st.nbytes()
        self._live[key] = serial
        self.events.append((serial, nbytes))
        self._serials[weakref.ref(st, self._died)] = (key, serial, nbytes)

    def _died(self, ref: weakref.ref) -> None:
        key, serial, nbytes = self._serials.pop(ref)
        if self._live.get(key) == serial:
            del self._live[key]
            self._values.pop(key, None)
        self.events.append((serial, -nbytes))

    def serial(self, t: torch.Tensor) -> Optional[int]:
        return self._live.get(t.untyped_storage()._cdata)

    # ------------------------------------------------------------ host values

    def _value(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The host copy of meta tensor ``t``'s values, a view of its storage's copy
        (so views and writes through them stay consistent); None when unknown."""
        base = self._values.get(t.untyped_storage()._cdata)
        if base is None or base.dtype != t.dtype:
            return None
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    def _host_args(self, args, kwargs) -> Optional[tuple]:
        """``args`` and ``kwargs`` with every meta tensor replaced by its host values and a
        meta device by the CPU, when every meta tensor's values are known and either one
        is, or the op makes a tensor on the meta device from host values (a factory, a
        copy to the device); else None."""
        for x in args:  # the common case, answered at once: an activation, a weight
            if isinstance(x, torch.Tensor):
                if x.is_meta and x.untyped_storage()._cdata not in self._values:
                    return None
                break
        seen = [False, False]  # a meta tensor with values, a meta device

        def host(x):
            if isinstance(x, torch.Tensor) and x.is_meta:
                v = self._value(x)
                if v is None:
                    raise _Unknown
                seen[0] = True
                return v
            if isinstance(x, torch.device) and x.type == "meta":
                seen[1] = True
                return _CPU
            return x

        try:
            out = torch.utils._pytree.tree_map(host, (args, kwargs))
        except _Unknown:
            return None
        return out if seen[0] or seen[1] else None

    def _remember(self, out, host_out) -> None:
        """Keep ``host_out``'s values as those of the meta tensors ``out`` (integer and
        bool ones: they are what host code reads back)."""
        for t, v in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(host_out)):
            if isinstance(t, torch.Tensor) and t.is_meta and isinstance(v, torch.Tensor) \
                    and not t.is_floating_point() and not t.is_complex():
                key = t.untyped_storage()._cdata
                if key in self._values and self._value(t) is not None:
                    continue  # a view of (or in place on) a tensor with values: the host op wrote them
                base = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device=_CPU)
                base.as_strided(t.shape, t.stride(), t.storage_offset()).copy_(v)
                self._values[key] = base

    def _forget_written(self, func, args) -> None:
        """Values written by an op the host did not run are no longer known."""
        for a, x in zip(func._schema.arguments, args):
            if a.alias_info is not None and a.alias_info.is_write and isinstance(x, torch.Tensor) and x.is_meta:
                self._values.pop(x.untyped_storage()._cdata, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SCALAR and args[0].is_meta:
            t = args[0]
            value = self._value(t)
            if value is not None:
                return value.item()
            # A host read of a value the dry run does not have: the loss, the gradient norm,
            # a finiteness check. Routing, the one value that sizes tensors, never comes here.
            if t.dtype == torch.bool:
                return True
            if t.is_floating_point():
                return 1.0
            raise RuntimeError(f"the dry run cannot read an integer from a meta tensor of shape {tuple(t.shape)}: "
                               f"a size that depends on values must come from the routing rule")
        if func.namespace == "c10d":
            self._record(func, args)
            return func(*args, **kwargs)
        host = self._host_args(args, kwargs)
        if host is not None and func is _TO_COPY and kwargs.get("device") == _CPU:
            return func(*host[0], **host[1])  # a host read of values the dry run has
        fresh = True
        try:
            out, fresh = self._meta(func, args, kwargs)
        except Exception:
            if host is None:
                raise
            # An op whose output's size depends on values (nonzero, unique) on values the
            # host has: sized by the host's answer.
            host_out = func(*host[0], **host[1])
            out = torch.utils._pytree.tree_map(
                lambda v: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                if isinstance(v, torch.Tensor) else v, host_out)
        else:
            if host is not None and any(isinstance(t, torch.Tensor) and not t.is_floating_point()
                                        for t in torch.utils._pytree.tree_leaves(out)):
                host_out = func(*host[0], **host[1])
            else:
                host_out = None
                if self._values:
                    self._forget_written(func, args)
        if fresh:
            for t in (out,) if isinstance(out, torch.Tensor) else torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "meta":
                    self.track(t)
        if host_out is not None:
            self._remember(out, host_out)
        return out

    def _meta(self, func, args, kwargs) -> tuple:
        """The op's outputs on the meta device, and False for an in-place op answered from
        the remembered shapes (nothing new to follow)."""
        key = _cache_key(func, args, kwargs)
        shapes = self._shapes.get(key) if key is not None else None
        if shapes is not None and key[1] == 2:
            return args[0], False  # in place, on shapes it has checked before
        if shapes is not None:
            # Every micro-batch repeats the ops of the first: their outputs' shapes are
            # remembered, not computed again by torch's (Python) meta functions.
            out = tuple(None if s is None else torch.empty_strided(s[0], s[1], dtype=s[2], device="meta")
                        for s in shapes[1])
            return (out[0] if shapes[0] else out), True
        out = func(*args, **kwargs)
        if key is not None and key[1] == 2:
            self._shapes[key] = ()
        elif key is not None:
            single = isinstance(out, torch.Tensor)
            outs = (out,) if single else out
            if isinstance(outs, (tuple, list)) and all(o is None or (isinstance(o, torch.Tensor) and o.is_meta)
                                                       for o in outs):
                self._shapes[key] = (single, tuple(None if o is None else (o.shape, o.stride(), o.dtype)
                                                   for o in outs))
        return out, True

    def _record(self, func, args) -> None:
        name = func._schema.name.split("::")[1].rstrip("_")
        pg_arg = {"allreduce": 1, "broadcast": 1, "send": 1, "recv": 1, "barrier": 1, "reduce": 1}.get(name, 2)
        pg = dist.ProcessGroup.unbox(args[pg_arg])
        ranks = tuple(dist.get_process_group_ranks(pg))
        n, me = len(ranks), pg.rank()
        desc = pg.group_desc
        group = "world" if desc == "default_pg" else desc

        def nbytes(t):
            return t.numel() * t.element_size()

        peer, shape = None, ()
        if name == "allreduce":
            total = sum(nbytes(t) for t in args[0])
            sent = 2 * (n - 1) * total // n
            shape = tuple((t.numel(), str(t.dtype)) for t in args[0])
        elif name == "_allgather_base":
            sent = nbytes(args[1]) * (n - 1)
            shape = (args[1].numel(), str(args[1].dtype))
        elif name == "_reduce_scatter_base":
            sent = nbytes(args[1]) - nbytes(args[0])
            shape = (args[1].numel(), str(args[1].dtype))
        elif name == "alltoall_base":
            out, x, out_splits, in_splits = args[0], args[1], list(args[3]), list(args[4])
            row = x.element_size() * math.prod(x.shape[1:])
            if not in_splits:
                in_splits = [x.shape[0] // n] * n
            if not out_splits:
                out_splits = [out.shape[0] // n] * n
            sent = (x.shape[0] - in_splits[me]) * row
            shape = (tuple(in_splits), tuple(out_splits), row)
        elif name in ("send", "recv"):
            t = args[0][0]
            peer = ranks[args[2]]
            sent = nbytes(t) if name == "send" else 0
            shape = (t.numel(), str(t.dtype))
        elif name == "broadcast":
            sent = sum(nbytes(t) for t in args[0])
            shape = tuple((t.numel(), str(t.dtype)) for t in args[0])
        else:
            sent = 0
        op = {"allreduce": "all_reduce", "_allgather_base": "all_gather", "_reduce_scatter_base": "reduce_scatter",
              "alltoall_base": "all_to_all", "allgather": "all_gather_list"}.get(name, name)
        self.collectives.append(Collective(op, group, n, int(sent), ranks, peer, shape))

    def replay(self, kinds: dict[int, str], step_start: int) -> dict[str, int]:
        """The most bytes of each kind alive at once during the step (``kinds``: serial ->
        kind; what the step makes and is none of them is activations), and the peak of the
        total. Of the build, only what outlives it counts (buffers as weights): a GPU run
        builds on the host."""
        live = dict.fromkeys(MEMORY_KINDS, 0)
        alive: dict[int, int] = {}
        for serial, delta in self.events[:step_start]:
            if delta > 0:
                alive[serial] = delta
            else:
                alive.pop(serial, None)
        for serial, nbytes in alive.items():
            live[kinds.get(serial, "weights")] += nbytes
        most = dict(live)
        total = peak = sum(live.values())
        for serial, delta in self.events[step_start:]:
            kind = kinds.get(serial, "activations" if serial not in alive else "weights")
            live[kind] += delta
            total += delta
            if delta > 0:
                most[kind] = max(most[kind], live[kind])
                peak = max(peak, total)
        return dict(most, peak=peak)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _FlexShaped(torch.autograd.Function):
    """A masked attention block (a sliding window, sinks) as flex attention, what a GPU
    runs, holds it: the forward makes ``out [B, Hq, Sq, Dv]`` and the float32 ``lse [B, Hq,
    Sq]`` and saves q, k, v, out and lse; the backward makes dq, dk and dv. Shapes only:
    the dry run's tensors have no values."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flex_shaped(q, k, v, doc_q, doc_k, causal, scale=None, **window):
    return _FlexShaped.apply(q, k, v)


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    """Attention on meta tensors as the fused kernels a GPU runs.

    - Unmasked SDPA as the flash kernel: what it saves for the backward is q, k, v, the
      output and the log-sum-exp. On meta, torch would take its math path, which keeps
      the whole ``[B, heads, S, S]`` score matrix.
    - A masked block (sliding window, sinks; :func:`masked_block_attention
      <moe_fold.parallel.document_attention.masked_block_attention>`) as flex attention
      (:class:`_FlexShaped`). On meta it would take the CPU's math path, which keeps the
      float32 scores and probabilities (gpt-oss-20b: 4.3 GB each a layer).

    The functions themselves are swapped for the step (not a torch-function mode):
    activation checkpoints recompute in the backward, where no mode of the forward is
    active."""
    from moe_fold.parallel import context_parallel, document_attention

    sdpa = F.scaled_dot_product_attention
    masked = {m: m.masked_block_attention for m in (context_parallel, document_attention)}

    def fused(*args, **kwargs):
        a = dict(zip(_SDPA_ARGS, args), **kwargs)
        if a["query"].is_meta and a.get("attn_mask") is None and not a.get("dropout_p"):
            return torch.ops.aten._scaled_dot_product_flash_attention(
                a["query"], a["key"], a["value"], 0.0, bool(a.get("is_causal")), False, scale=a.get("scale"))[0]
        return sdpa(*args, **kwargs)

    def masked_block(q, *args, **kwargs):
        return (_flex_shaped if q.is_meta else masked[document_attention])(q, *args, **kwargs)

    F.scaled_dot_product_attention = fused
    for module in masked:
        module.masked_block_attention = masked_block
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        for module, fn in masked.items():
            module.masked_block_attention = fn


# --------------------------------------------------------------------------- set-up

def dry_run_config(config: Config) -> Config:
    """``config`` with the kernel backends the meta device runs: torch's (``auto`` only;
    the grouped GEMM's torch backend needs bf16 operands, so fp32 models take the loop)."""
    moe = config.moe
    bf16 = config.train.precision == "bf16"
    pick = {"gemm_backend": "torch" if bf16 else "loop", "permute_backend": "torch", "swiglu_backend": "torch",
            "topk_backend": "torch"}
    changes = {k: v for k, v in pick.items() if getattr(moe, k) == "auto"}
    return dataclasses.replace(config, moe=dataclasses.replace(moe, **changes))


def default_ranks(layout: ParallelLayout) -> list[int]:
    """One rank of every distinct role: for each pipeline stage, the first rank of every
    other coordinate, and the last ep rank (the last expert slots) when ep > 1."""
    wanted = []
    for stage in range(layout.pp):
        first = layout.groups("pp")[0][stage]  # stage s of the first pipeline
        wanted.append(first)
        if layout.ep > 1:
            wanted.append(layout.group_of("ep", first)[-1])
    return list(dict.fromkeys(wanted))


def _batch(config: Config, layout: ParallelLayout, row_docs: Optional[Sequence[Sequence[int]]] = None,
           first_row: int = 0) -> Batch:
    """One micro-batch of this rank in shapes only: its cp share of its rows (the whole rows
    under dynamic cp, which places them itself). ``row_docs``: the document lengths of
    each row, the micro-batch's rows taking them in turn from ``first_row``; None: one
    document per row. The document boundaries are on the host, as the loader gives them."""
    b, s = config.train.micro_batch_size, config.model.seq_length
    local = s // layout.cp if not (config.parallel.dynamic_cp and layout.cp > 1) else s
    tokens = torch.zeros(b, local, dtype=torch.long, device="meta")
    if row_docs is None:
        cu_seqlens = torch.arange(b + 1, dtype=torch.int32) * s
    else:
        starts = []
        for r in range(b):
            docs = list(row_docs[(first_row + r) % len(row_docs)])
            if sum(docs) != s or min(docs) < 1:
                raise ValueError(f"row_docs {docs} must be positive document lengths adding up to "
                                 f"seq_length={s}")
            starts += [r * s + int(a) for a in np.cumsum([0] + docs[:-1])]
        cu_seqlens = torch.tensor(starts + [b * s], dtype=torch.int32)
    return Batch(tokens, torch.zeros_like(tokens), torch.ones(b, local, device="meta"),
                 torch.arange(local, device="meta").expand(b, local), cu_seqlens)


@contextlib.contextmanager
def _fake_world(world: int, rank: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the dry run starts its own fake world: torch.distributed is already initialised")
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trace_rank(config: Config, world: int, rank: int, routing: PlannedRouting,
               shapes: Optional[dict] = None, row_docs: Optional[Sequence[Sequence[int]]] = None) -> RankTrace:
    """Build rank ``rank`` of a world of ``world`` ranks and run one step (module docstring).
    ``shapes``: the output shapes ops gave before (pass one dict to the ranks of one run:
    they repeat each other's ops). ``row_docs``: packed documents, the lengths of each
    row's (rows take them in turn); None: one document per row."""
    from moe_fold.models.moe_layer import MoELayer
    from moe_fold.training.optim import apply_gradients
    from moe_fold.training.run_setup import build_trainable
    from moe_fold.training.step import forward_backward

    config = dry_run_config(config)
    p, t = config.parallel, config.train
    layout = ParallelLayout(world, tp=p.tp, cp=p.cp, pp=p.pp, ep=p.ep, etp=p.etp, order=p.order)
    tracer = _Tracer(shapes)
    with _fake_world(world, rank):
        groups = create_process_groups(layout)
        with torch.device("meta"), tracer:
            model, master, state_model, optimizer, grad_sync = build_trainable(config, torch.device("meta"), groups)
        reader = routing.with_zero_experts(config.moe.zero_experts)
        for module in model.modules():
            if isinstance(module, MoELayer):
                module.dispatcher.read_counts = reader
        kinds: dict[int, str] = {}

        def mark(tensors, kind: str) -> None:
            for x in tensors:
                serial = tracer.serial(x)
                if serial is not None:
                    kinds.setdefault(serial, kind)

        params = list(model.parameters()) + (list(master.master.parameters()) if master else [])
        mark(params, "weights")
        mark([s for state in optimizer.state.values() for s in state.values() if isinstance(s, torch.Tensor)],
             "optimizer")

        def grads() -> None:
            mark([q.grad for q in params if q.grad is not None], "grads")

        hooks = [q.register_post_accumulate_grad_hook(lambda q: mark([q.grad], "grads")) for q in params
                 if q.requires_grad]
        m = t.global_batch_size // (t.micro_batch_size * layout.dp)
        micro_batches = [_batch(config, layout, row_docs, i * t.micro_batch_size) for i in range(m)]
        dynamic_cp = None
        if p.dynamic_cp and layout.cp > 1:
            from moe_fold.training.dynamic_cp import DynamicCP, cost_model

            dynamic_cp = DynamicCP(groups, cost_model(config), capacity=t.micro_batch_size * config.model.seq_length
                                   // layout.cp)
        model.train()
        step_start = len(tracer.events)
        with tracer, _fused_attention():
            losses = forward_backward(model, micro_batches, groups, config, dynamic_cp=dynamic_cp, grad_sync=grad_sync)
            grads()
            all_reduce_(losses.sum(), groups.dp_cp)
            apply_gradients([q for q in state_model.parameters()], optimizer, groups, config.optimizer.clip_grad,
                            grad_sync=grad_sync)
            grads()
            if master is not None and not optimizer.distributed:
                master.master_to_model()
            optimizer.zero_grad(set_to_none=True)
        for h in hooks:
            h.remove()
        memory = tracer.replay(kinds, step_start)
        coords = layout.coords(rank)
        local_params = sum(q.numel() for q in model.parameters())
    return RankTrace(rank, coords["pp"], coords, local_params, memory, tracer.collectives)


def _trace_ranks(config: Config, world: int, ranks: list[int], routing: PlannedRouting) -> list[RankTrace]:
    shapes: dict = {}
    return [trace_rank(config, world, r, routing, shapes) for r in ranks]


def dry_run(config: Config, world: int, ranks: Optional[list[int]], routing: PlannedRouting,
            jobs: int = 1) -> dict:
    """Trace ``ranks`` (default :func:`default_ranks`) of ``config`` on ``world`` ranks; the
    JSON-ready result ``{"world", "layout", "routing", "ranks": [...]}``. ``jobs``: worker
    processes that trace the ranks between them (each rank is traced alone in its own fake
    world, so the result does not depend on it)."""
    validate(config, world)
    if jobs < 1:
        raise ValueError(f"--jobs={jobs} must be at least 1")
    p = config.parallel
    layout = ParallelLayout(world, tp=p.tp, cp=p.cp, pp=p.pp, ep=p.ep, etp=p.etp, order=p.order)
    chosen = default_ranks(layout) if ranks is None else ranks
    for r in chosen:
        if not 0 <= r < world:
            raise ValueError(f"--ranks names rank {r}, outside the world of {world} ranks")
    jobs = min(jobs, len(chosen))
    if jobs == 1:
        traces = _trace_ranks(config, world, chosen, routing)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # Rank i goes to worker i % jobs: neighbouring ranks (the stages' first and last
        # ep ranks) repeat each other's ops, and a worker remembers their shapes.
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(_trace_ranks, [config] * jobs, [world] * jobs,
                                  [chosen[i::jobs] for i in range(jobs)], [routing] * jobs))
        traces = [parts[i % jobs][i // jobs] for i in range(len(chosen))]
    return {"world": world, "layout": dict(layout.sizes, vpp=p.vpp or 1, order=p.order), "routing": routing.describe(),
            "ranks": [tr.public() for tr in traces]}


# --------------------------------------------------------------------------- collective order

def order_mismatches(traces: list[RankTrace]) -> list[str]:
    """Every way the traced ranks' collectives would hang or corrupt a real run, named:

    - the ranks of one group must issue that group's collectives in the same order, the
      same op each time, with the same shape where the op needs it (all-reduce,
      all-gather, reduce-scatter, broadcast); an all-to-all's splits must match: what rank
      i sends to j is what j expects from i;
    - the sends from i to j must match j's receives from i, one by one.

    Each problem names the group, the position in its sequence and the two ranks."""
    problems: list[str] = []
    by_group: dict[tuple[str, tuple[int, ...]], dict[int, list[Collective]]] = {}
    sends: dict[tuple[int, int], list[Collective]] = {}
    recvs: dict[tuple[int, int], list[Collective]] = {}
    for tr in traces:
        for c in tr.collectives:
            if c.op == "send":
                sends.setdefault((tr.rank, c.peer), []).append(c)
            elif c.op == "recv":
                recvs.setdefault((c.peer, tr.rank), []).append(c)
            else:
                by_group.setdefault((c.group, c.ranks), {}).setdefault(tr.rank, []).append(c)
    for (name, ranks), seqs in by_group.items():
        traced = [r for r in ranks if r in seqs or any(tr.rank == r for tr in traces)]
        first = traced[0]
        base = seqs.get(first, [])
        for other in traced[1:]:
            seq = seqs.get(other, [])
            for i in range(max(len(base), len(seq))):
                a = base[i] if i < len(base) else None
                b = seq[i] if i < len(seq) else None
                where = f"group {name} {list(ranks)}, collective #{i}: rank {first} "
                if a is None or b is None:
                    problems.append(where + f"issues {a.op if a else 'nothing'}, rank {other} "
                                            f"issues {b.op if b else 'nothing'}")
                    break
                if a.op != b.op:
                    problems.append(where + f"issues {a.op}, rank {other} issues {b.op}")
                    break
                if a.op == "all_to_all":
                    i_a, i_b = ranks.index(first), ranks.index(other)
                    if a.shape[0][i_b] != b.shape[1][i_a] or b.shape[0][i_a] != a.shape[1][i_b] \
                            or a.shape[2] != b.shape[2]:
                        problems.append(where + f"and rank {other} disagree on the all-to-all's splits "
                                                f"(sends {a.shape[0][i_b]} rows to it, it expects {b.shape[1][i_a]}; "
                                                f"it sends {b.shape[0][i_a]}, rank {first} expects {a.shape[1][i_b]})")
                        break
                elif a.shape != b.shape:
                    problems.append(where + f"{a.op}s {a.shape}, rank {other} {b.shape}")
                    break
    for pair in set(sends) | set(recvs):
        out, into = sends.get(pair, []), recvs.get(pair, [])
        src, dst = pair
        for i in range(max(len(out), len(into))):
            a = out[i] if i < len(out) else None
            b = into[i] if i < len(into) else None
            if a is None or b is None or a.shape != b.shape:
                problems.append(f"group {(a or b).group}, send #{i} from rank {src} to rank {dst}: rank {src} sends "
                                f"{a.shape if a else 'nothing'}, rank {dst} receives {b.shape if b else 'nothing'}")
                break
    return problems
