"""Gradient buckets and their data-parallel reduction, overlapped with the backward pass.

A bucket is a run of parameters of one reduction group and dtype, their grads flattened
one after another (at most ``bucket_numel`` elements; a larger parameter alone). The
group completes each kind's gradient (:data:`SYNC_GROUP`, docs/architecture.md, "Parallel folding"): ``"tp"``
and ``"replicated"`` grads are summed over ``dp_cp``, ``"tp_sum"`` ones over ``tp_dp_cp``
(the partial sums of the tp ranks and the data-parallel sum in one collective),
``"expert"`` ones over ``edp``; every sum is then divided by the dp x cp size.

Buckets follow the order in which the backward pass finishes grads: model chunks (virtual
pipeline stages) last to first, each chunk's parameters in reverse order. A pipeline's tied
embedding (whose two copies' grads are summed over the first and last stage after the
schedule) comes last, in buckets of its own. Every rank of a group posts its buckets'
collectives in this one order, whatever order the grads become final in.

:class:`GradSync` reduces them:

- without the distributed optimizer, each bucket is all-reduced and every grad becomes
  the global-batch gradient;
- with it (``shard=True`` in :func:`make_buckets`), each bucket is reduce-scattered: rank
  ``r`` of the group receives only the summed elements it owns (``sizes[r]`` consecutive
  ones, cut as :func:`shard_sizes` says) and writes them into its grads' owned ranges
  (:attr:`Bucket.slices`); the rest of those grads is left as the local, unreduced sum and
  must not be read. The optimizer then all-gathers the updated parameters
  (:class:`moe_fold.training.optim.AdamW`): reduce-scatter plus all-gather is the
  all-reduce's volume, the least a data-parallel step can send.

Overlap (``overlap_grad_reduce``): during the backward of the last micro-batch of a model
chunk (:meth:`GradSync.backward_of`), a hook on every parameter (torch's post-accumulate-grad
hook) marks its grad final; a bucket whose grads are all final posts its collective at once
(asynchronously) and the backward goes on. When that chunk's backward is over, what no hook
marked (a parameter outside the graph) is final too. :meth:`GradSync.finish` posts what is
left and waits. Without overlap the buckets are reduced one after another after the whole
backward, in the same order, with the same collectives: the results are the same bits.

``sources`` (bf16 training): the parameters whose grads feed the buckets when they differ
from the bucket's own (the bf16 model's for the float32 masters); their grads are cast into
the float32 bucket, reduced there, and cleared.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from moe_fold.comm import Pending, all_reduce_async_, reduce_scatter_async
from moe_fold.config import bucket_size, require
from moe_fold.layout import ProcessGroups
from moe_fold.parallel.tensor_parallel import PARALLEL_KINDS
from moe_fold.training.wait_timer import WaitTimer

__all__ = ["SYNC_GROUP", "DEFAULT_BUCKET_NUMEL", "ALIGN", "Slice", "Bucket", "param_kind", "shard_sizes",
           "make_buckets", "model_chunks", "model_buckets", "GradSync"]

# parallel kind -> the group whose sum completes the gradient (and over which the
# distributed optimizer shards the parameter's state)
SYNC_GROUP = {"tp": "dp_cp", "replicated": "dp_cp", "tp_sum": "tp_dp_cp", "expert": "edp"}

DEFAULT_BUCKET_NUMEL = 1 << 24

# Elements between a parameter's start and a shard cut inside it: a multiple of the fused
# AdamW kernel's vector block (16 float32 elements with AVX-512, 64 bytes of a cache line;
# 64 covers every dtype and CPU). The kernel works in blocks from a tensor's start and
# rounds a block's tail differently, so aligned slices update every element bit for bit
# as the whole parameter does.
ALIGN = 64


def param_kind(param: nn.Parameter) -> str:
    kind = getattr(param, "parallel", None)
    if kind not in PARALLEL_KINDS:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has parallel={kind!r}; every parameter "
                         f"must be marked with one of {', '.join(PARALLEL_KINDS)} "
                         f"(moe_fold.parallel.tensor_parallel.mark)")
    return kind


@dataclass
class Slice:
    """The elements ``[start, stop)`` of a parameter flattened that this rank owns, and
    where the parameter starts in its bucket."""
    param: nn.Parameter
    offset: int
    start: int
    stop: int


@dataclass
class Bucket:
    """Parameters of one reduction group and dtype flattened in order (``offsets`` into
    ``numel`` elements). ``sizes``: elements each rank of the group owns, consecutive in
    rank order (sharded buckets; None: the bucket is all-reduced). ``slices``: this rank's
    owned part of each parameter (sharded buckets). ``chunk``: the model chunk (None for
    the deferred tied embedding)."""
    group_name: str
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    chunk: Optional[int]
    sizes: Optional[list[int]] = None
    slices: list[Slice] = field(default_factory=list)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype


def shard_sizes(numels: Sequence[int], n: int) -> list[int]:
    """Elements each of ``n`` ranks owns of a bucket of parameters of ``numels`` elements:
    cuts at about ``r * total / n``, a cut inside a parameter moved up to a multiple of
    :data:`ALIGN` elements from its start."""
    offsets, total = [], 0
    for k in numels:
        offsets.append(total)
        total += k
    chunk = -(-total // n)

    def aligned(cut: int) -> int:
        for k, offset in zip(numels, offsets):
            if offset < cut < offset + k:
                return offset + min(-(-(cut - offset) // ALIGN) * ALIGN, k)
        return cut

    cuts = [aligned(min(r * chunk, total)) for r in range(n)] + [total]
    return [cuts[r + 1] - cuts[r] for r in range(n)]


def model_chunks(model: nn.Module) -> list[list[nn.Parameter]]:
    """A model's trainable parameters per model chunk (virtual pipeline stage), in
    ``model.parameters()`` order: chunk ``c`` holds the layers of ``model.stages[c]``; the
    embedding is in the first chunk of the rank holding stage 0 (chunk ``c`` is stage
    ``c*pp + rank``, so stage 0 is chunk 0), the final norm, the head (and a tied copy of the
    embedding) in the last chunk of the rank holding the last stage. A model without
    ``stage_layer_ids`` is one chunk."""
    params = [p for p in model.parameters() if p.requires_grad]
    stage_layers = getattr(model, "stage_layer_ids", None)
    if stage_layers is None or len(stage_layers) == 1:
        return [params]
    last = len(stage_layers) - 1
    chunk_of: dict[int, int] = {}
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            chunk_of[id(p)] = next(c for c, ids in enumerate(stage_layers) if layer in ids)
        elif name.startswith("embed.") and 0 in model.stages:
            chunk_of[id(p)] = 0
        else:
            chunk_of[id(p)] = last
    chunks: list[list[nn.Parameter]] = [[] for _ in stage_layers]
    for p in params:
        chunks[chunk_of[id(p)]].append(p)
    return chunks


def make_buckets(chunks: Sequence[Sequence[nn.Parameter]], groups: ProcessGroups,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL, shard: bool = False,
                 deferred: Sequence[nn.Parameter] = ()) -> list[Bucket]:
    """The buckets of ``chunks`` (parameters per model chunk, in model order) in the order
    of the module doc; ``deferred`` parameters (a pipeline's tied embedding) come last.
    ``shard``: cut each bucket between the ranks of its group (the distributed optimizer)."""
    require(bucket_size, bucket_numel)
    later = {id(p) for p in deferred}
    order = [(c, [p for p in reversed(chunks[c]) if id(p) not in later]) for c in reversed(range(len(chunks)))]
    order.append((None, list(reversed(list(deferred)))))
    buckets: list[Bucket] = []
    for chunk, params in order:
        open_runs: dict[tuple[str, torch.dtype], list[nn.Parameter]] = {}
        closed: list[tuple[str, list[nn.Parameter]]] = []
        for p in params:
            key = (SYNC_GROUP[param_kind(p)], p.dtype)
            run = open_runs.setdefault(key, [])
            if run and sum(q.numel() for q in run) + p.numel() > bucket_numel:
                closed.append((key[0], run))
                run = open_runs[key] = []
            run.append(p)
        closed.extend((key[0], run) for key, run in open_runs.items() if run)
        for group_name, run in closed:
            buckets.append(_bucket(group_name, run, chunk, groups, shard))
    return buckets


def model_buckets(model: nn.Module, groups: ProcessGroups, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                  shard: bool = False) -> list[Bucket]:
    """:func:`make_buckets` of a :class:`moe_fold.models.model.Transformer` (or any module):
    its :func:`model_chunks`, the tied embedding of a pipeline deferred."""
    deferred = [model.embed.weight] if getattr(model, "embedding_group", None) is not None else []
    return make_buckets(model_chunks(model), groups, bucket_numel, shard, deferred)


def _bucket(group_name: str, params: list[nn.Parameter], chunk: Optional[int], groups: ProcessGroups,
            shard: bool) -> Bucket:
    offsets, numel = [], 0
    for p in params:
        if shard and not p.is_contiguous():
            raise ValueError(f"parameter of shape {tuple(p.shape)} must be contiguous: the distributed "
                             f"optimizer updates slices of its flat view")
        offsets.append(numel)
        numel += p.numel()
    bucket = Bucket(group_name, params, offsets, numel, chunk)
    if shard:
        n, me = groups.size(group_name), groups.rank_in(group_name)
        bucket.sizes = shard_sizes([p.numel() for p in params], n)
        lo = sum(bucket.sizes[:me])
        hi = lo + bucket.sizes[me]
        for p, offset in zip(params, offsets):
            start = min(max(lo - offset, 0), p.numel())
            stop = max(min(hi - offset, p.numel()), start)
            bucket.slices.append(Slice(p, offset, start, stop))
    return bucket


class GradSync:
    """The data-parallel reduction of ``buckets``' grads (see the module doc), once per
    optimizer step. ``exposed_s`` adds up the seconds this rank spent waiting for it."""

    def __init__(self, buckets: list[Bucket], groups: ProcessGroups, overlap: bool = False,
                 sources: Optional[dict[nn.Parameter, nn.Parameter]] = None):
        self.buckets, self.groups, self.overlap = buckets, groups, overlap
        self.sources = sources or {}
        self.scale = 1.0 / groups.size("dp_cp")
        self._exposed = WaitTimer()
        self._bucket_of: dict[int, int] = {}
        for i, bucket in enumerate(buckets):
            for p in bucket.params:
                self._bucket_of[id(self._source(p))] = i
        self._missing: list[int] = []  # per bucket: grads not final yet
        self._pending: dict[int, Pending] = {}
        self._posted = 0  # buckets 0.._posted-1 are posted
        self._armed: set[int] = set()
        self._reset()
        if overlap:
            for bucket in buckets:
                if bucket.chunk is None:
                    continue  # deferred: final only after the tied copies' sum
                for p in bucket.params:
                    self._source(p).register_post_accumulate_grad_hook(self._on_grad)

    @property
    def exposed_s(self) -> float:
        """Seconds the computation waited for the reductions (CUDA events on a GPU: wait_timer.py)."""
        return self._exposed.seconds

    def _source(self, p: nn.Parameter) -> nn.Parameter:
        return self.sources.get(p, p)

    def _reset(self) -> None:
        self._missing = [len(b.params) for b in self.buckets]
        self._final: set[int] = set()
        self._pending.clear()
        self._posted = 0
        self._armed.clear()

    # ---------------------------------------------------------------- the backward

    @contextlib.contextmanager
    def backward_of(self, microbatch: int, chunk: int, num_microbatches: int) -> Iterator[None]:
        """Around the backward of ``microbatch`` through model chunk ``chunk``: on the last
        micro-batch (with overlap) the chunk's buckets are posted as their grads become final."""
        last = self.overlap and microbatch == num_microbatches - 1
        if last:
            self._armed.add(chunk)
        yield
        if last:
            self._armed.discard(chunk)
            for bucket in self.buckets:
                if bucket.chunk == chunk:
                    for p in bucket.params:
                        self._mark(self._source(p))

    def _on_grad(self, param: nn.Parameter) -> None:
        if self.buckets[self._bucket_of[id(param)]].chunk in self._armed:
            self._mark(param)

    def _mark(self, param: nn.Parameter) -> None:
        if id(param) in self._final:
            return
        self._final.add(id(param))
        i = self._bucket_of[id(param)]
        self._missing[i] -= 1
        # Post in bucket order only: every rank of a group must post the same sequence.
        while self._posted < len(self.buckets) and self._missing[self._posted] == 0:
            self._post(self._posted)
            self._posted += 1

    def deferred_ready(self) -> None:
        """The deferred parameters' grads are final (the tied copies were summed)."""
        if self.overlap:
            for bucket in self.buckets:
                if bucket.chunk is None:
                    for p in bucket.params:
                        self._mark(self._source(p))

    @torch.no_grad()
    def _post(self, i: int) -> None:
        bucket = self.buckets[i]
        group = self.groups.group(bucket.group_name)
        grads = []
        for p in bucket.params:
            grad = self._source(p).grad
            grad = grad if grad is not None else p.grad  # taken already (take_grads)
            grads.append(grad.reshape(-1) if grad is not None else torch.zeros(p.numel(), dtype=p.dtype,
                                                                               device=p.device))
        flat = torch.cat([g.to(bucket.dtype) for g in grads])  # [bucket numel]
        if bucket.sizes is None:
            self._pending[i] = all_reduce_async_(flat, group)
        else:
            self._pending[i] = reduce_scatter_async(flat, group, bucket.sizes)  # [sizes[me]]

    # ---------------------------------------------------------------- the step

    @torch.no_grad()
    def wait(self, i: int) -> None:
        """Wait for bucket ``i``'s reduction and write the result into the grads."""
        pending = self._pending.pop(i, None)
        if pending is None:
            return
        bucket = self.buckets[i]
        with self._exposed.waiting(bucket.params[0].device):
            reduced = pending.wait()
        reduced.mul_(self.scale)
        for p, offset in zip(bucket.params, bucket.offsets):
            src = self._source(p)
            if src is not p:
                src.grad = None
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if bucket.sizes is None:
            for p, offset in zip(bucket.params, bucket.offsets):
                p.grad.view(-1).copy_(reduced[offset:offset + p.numel()])
        else:
            lo = sum(bucket.sizes[:self.groups.rank_in(bucket.group_name)])
            for s in bucket.slices:
                if s.stop > s.start:
                    a = s.offset + s.start - lo
                    s.param.grad.view(-1)[s.start:s.stop].copy_(reduced[a:a + s.stop - s.start])

    @torch.no_grad()
    def take_grads(self, params: Sequence[nn.Parameter]) -> None:
        """Move the grads of ``params``' sources into ``params`` (cast to their dtype), for
        work on them before the reduction (summing an expert's copies in float32)."""
        for p in params:
            src = self._source(p)
            if src is not p and src.grad is not None:
                p.grad = src.grad.to(p.dtype)
                src.grad = None

    def finish(self) -> None:
        """Post every bucket not posted yet and wait for all of them; then every grad is the
        global-batch gradient (its owned range, for sharded buckets). Resets for the next step."""
        if self.overlap:
            for i in range(self._posted, len(self.buckets)):
                self._post(i)
            for i in range(len(self.buckets)):
                self.wait(i)
        else:
            # Today's order: each bucket reduced, then the next.
            for i in range(len(self.buckets)):
                self._post(i)
                self.wait(i)
        self._reset()
