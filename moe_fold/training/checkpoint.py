"""Checkpoints that any layout can load: global tensors stored as shards with global offsets.

On disk, ``<run_dir>/checkpoints/step_000100/`` holds:

- ``rank_00003.safetensors``: the pieces rank 3 writes. Every element of every global
  tensor is written once: by the first replica of a parameter (:mod:`moe_fold.parallel.sharding`),
  and, for optimizer moments under ZeRO-1, by the rank that holds them. The file is
  streamed from the live tensors, piece by piece: saving needs no second copy of the
  model in memory (a piece that is not contiguous host memory is copied alone);
- ``rng_00003.json``: rank 3's random states (torch, CUDA, numpy, python ``random``);
- ``config.yaml``: the run's config;
- ``index.json``: for each tensor (``model/<name>`` for parameters and persistent buffers,
  ``optim/exp_avg/<name>`` and ``optim/exp_avg_sq/<name>`` for AdamW's moments) its global
  shape, dtype and pieces (file, key, global offsets, sizes); the sha256 and size of every
  other file; the step, optimizer step count, scheduler state, the caller's ``extra`` (data
  position, ...) and the layout it was saved under; and ``index_sha256``, the sha256 of all
  that (:func:`write_index`), so a changed step or data position is caught like a changed shard.

Integrity: every file is checked against the index before it is used: loading checks
``index.json``'s own sha256, each shard it reads, and every other listed file (random
states, config.yaml; each by one rank, round robin). Version 1 indexes (before the index
signed itself) still load, with a warning that their index is unchecked.

Loading under any layout (tp, ep, etp, dp, cp, with or without the distributed optimizer)
reads, for each piece of each local tensor, only the stored pieces that overlap it
(safetensors ``get_slice``). Parameters are named by ``model.named_parameters()``, so the
names must be global (pipeline stages must name layers by their global index); a stage
reads its layers only, and pp may differ between save and load (vpp too).

Tied embeddings under pp: the last stage's copy of the embedding (``param.tied_copy``,
equal to the first stage's) and its moments are not written, only loaded from the one
stored ``model/embed.weight``.

Atomicity: every rank writes into ``step_000100.tmp-<nonce>``, then a ``done_<rank>.json``
marker (its files' sha256 and sizes); once every rank's marker is there, rank 0 writes
``index.json`` (the manifest) and renames the directory to ``step_000100``. A crash or a
kill before the rename leaves the previous checkpoints untouched; a directory without
the final name is ignored by :func:`latest_checkpoint` (with a message) and removed by the
next save. Only the newest ``keep_last`` checkpoints are kept. Every rank must see the
same ``run_dir`` (a shared file system across nodes).

Asynchronous saves (:class:`CheckpointSaver`, ``train.async_save``): the step pays for a
host copy of the rank's pieces only; a background thread writes them (see the class).
:func:`save_checkpoint` is the synchronous form. Integrity checks beyond loading (every
expert present, ``moe-fold checkpoint verify``) are in :mod:`moe_fold.training.checkpoint_verify`.

Random states are restored only when the layout (world size and every parallel size) is
the one they were saved under: rank r's generators then continue exactly. Under another
layout rank r has no counterpart, so the states are left as they are and a warning says so.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import struct
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from moe_fold.config import Config, checkpoints_kept, dump_config, require
from moe_fold.layout import ProcessGroups
from moe_fold.training.host_staging import Staged, StagingArena
from moe_fold.training.optim import AdamW, LRScheduler
from moe_fold.parallel.sharding import ShardInfo, box, buffer_info, flat_boxes, intersect, shard_info

__all__ = ["CheckpointError", "CheckpointDamaged", "CheckpointSaver", "save_checkpoint", "load_checkpoint",
           "load_newest_intact", "latest_checkpoint", "checkpoint_path", "file_problem", "read_index", "write_index"]

log = logging.getLogger(__name__)

FORMAT = "moe-fold-checkpoint"
VERSION = 2  # 2: index.json carries its own sha256 (``index_sha256``); 1 (older): it does not
_SIGNATURE = "index_sha256"
_STEP_DIR = re.compile(r"step_(\d+)")
_LEFTOVER = re.compile(r"step_\d+\.(tmp|old)-")
_MOMENTS = ("exp_avg", "exp_avg_sq")
_CHUNK = 1 << 20
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file or tensor."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files no longer hold what its index says (a file missing,
    truncated or altered, an index unreadable or not matching its own sha256): the saved
    state is lost, unlike a checkpoint that is intact but does not fit the model."""


def checkpoint_path(run_dir: Union[str, os.PathLike], step: int) -> Path:
    """Where the checkpoint of ``step`` lives: ``<run_dir>/checkpoints/step_<step:06d>``."""
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


# --------------------------------------------------------------------------- local tensors

@dataclass
class _Entry:
    """One named local tensor and where its elements go: ``data`` holds the elements
    ``[start, stop)`` of the flattened local tensor of ``shape`` (all of them, shaped as
    ``shape``, except for ZeRO-1 moments, which are a 1-D slice)."""

    name: str
    data: torch.Tensor
    shape: tuple[int, ...]
    info: ShardInfo
    start: int
    stop: int
    writer: bool  # this rank stores these elements (one rank per element)

    def pieces(self, stored: bool = False) -> Iterator[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """``(view of data, global offsets, sizes)`` covering ``data`` once; ``stored``:
        leave out the expert copies that another slot writes (:mod:`moe_fold.parallel.sharding`)."""
        flat = self.data.view(-1)  # [stop - start]
        for offset, offsets, sizes in flat_boxes(self.shape, self.start, self.stop):
            n = _numel(sizes)
            block = flat[offset - self.start: offset - self.start + n].view(sizes)
            for piece in self.info.pieces:
                if stored and piece.copy:
                    continue
                hit = intersect(offsets, sizes, piece.local, piece.sizes)
                if hit is not None:
                    lo, size = hit
                    view = block[box(_sub(lo, offsets), size)]
                    yield view, tuple(g + l - p for g, l, p in zip(piece.global_, lo, piece.local)), size


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _sub(a, b) -> tuple[int, ...]:
    return tuple(x - y for x, y in zip(a, b))


def _tied_copy(param: nn.Parameter) -> bool:
    """The last pipeline stage's copy of a tied embedding (models.model.Transformer): the
    first stage writes the weight and its moments; the copy only loads them."""
    return getattr(param, "tied_copy", False)


def _entries(model: nn.Module, optimizer: Optional[AdamW], groups: ProcessGroups) -> list[_Entry]:
    if optimizer is not None and not isinstance(optimizer, AdamW):
        raise TypeError(f"optimizer must be moe_fold.training.optim.AdamW (its moments are saved per element), "
                        f"got {type(optimizer).__name__}")
    entries = []
    params = dict(model.named_parameters())
    for name, p in params.items():
        info = shard_info(p, groups, name)
        entries.append(_Entry(f"model/{name}", p.detach(), tuple(p.shape), info, 0, p.numel(),
                              info.writer and not _tied_copy(p)))
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for name, b in model.state_dict(keep_vars=True).items():
        if name not in aliases:  # a persistent buffer
            info = buffer_info(b, groups)
            entries.append(_Entry(f"model/{name}", b.detach(), tuple(b.shape), info, 0, b.numel(), info.writer))
    if optimizer is None:
        return entries
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, p in params.items():
        if id(p) not in owned:
            continue
        info = shard_info(p, groups, name)
        start, stop = optimizer.state_slice(p)
        if optimizer.distributed:
            # moments are split over their sharding group (SHARD_GROUP); only "replicated"
            # ones (sharded over dp_cp) repeat over tp
            writer = p.parallel != "replicated" or groups.rank_in("tp") == 0
        else:
            writer = info.writer
        writer = writer and not _tied_copy(p)
        for moment in _MOMENTS:
            entries.append(_Entry(f"optim/{moment}/{name}", optimizer.state[p][moment], tuple(p.shape), info,
                                  start, stop, writer))
    return entries


# --------------------------------------------------------------------------- collectives

def _world(groups: ProcessGroups) -> int:
    world = groups.layout.world_size
    if world > 1 and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world):
        raise CheckpointError(f"the layout has world_size={world} but torch.distributed is not initialised "
                              f"with that many ranks")
    return world


def _broadcast(obj: Any, world: int) -> Any:
    if world == 1:
        return obj
    box_ = [obj]
    dist.broadcast_object_list(box_, src=0)
    return box_[0]


def _gather(obj: Any, world: int, rank: int) -> Optional[list]:
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


# --------------------------------------------------------------------------- files

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
        os.fsync(f.fileno())
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_record(path: Path) -> dict:
    return {"sha256": _sha256(path), "bytes": path.stat().st_size}


def _write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """Write ``(key, tensor)`` pairs, views of the live tensors, as one safetensors file and
    return its file record (sha256, bytes).

    The file is streamed: the header from the shapes, then each tensor's bytes straight
    from its memory (a contiguous host tensor is not copied; another one is copied alone:
    at most one piece at a time), so saving costs no second copy of the model. The
    format (what ``safe_open`` reads): an 8-byte little-endian header length, the JSON
    header (dtype, shape, data offsets per key), padded with spaces to 8 bytes, the data."""
    if sys.byteorder != "little":
        raise CheckpointError(f"cannot write {path}: safetensors stores little-endian data and this host is "
                              f"{sys.byteorder}-endian")
    header, offset = {}, 0
    for key, t in tensors:
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{key}: dtype {t.dtype} cannot be stored (supported: "
                                  f"{', '.join(str(d) for d in _SAFETENSORS_DTYPES)})")
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        def write(data: memoryview) -> None:
            f.write(data)
            digest.update(data)

        write(memoryview(struct.pack("<Q", len(text)) + text))
        for _, t in tensors:
            if t.numel():
                host = t.detach().to("cpu").contiguous()  # the tensor itself when already so
                write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))  # [numel * element_size]
                del host  # a copy goes before the next one is made
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "bytes": path.stat().st_size}


def _rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss = random.getstate()
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "cuda": cuda,
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "python": [version, list(state), gauss],
    }


def _set_rng_state(state: dict) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    if state["cuda"]:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])
        else:
            warnings.warn("the checkpoint holds CUDA random states but CUDA is not available: not restored",
                          stacklevel=3)
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _layout_record(groups: ProcessGroups) -> dict:
    layout = groups.layout
    return {"world_size": layout.world_size, **layout.sizes, "order": layout.order}


# --------------------------------------------------------------------------- listing

def _complete_steps(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of each finished checkpoint, oldest first; reports leftovers."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for path in sorted(ckpt_dir.iterdir()):
        match = _STEP_DIR.fullmatch(path.name)
        if match and (path / "index.json").is_file():
            found.append((int(match.group(1)), path))
        elif match:
            log.warning("ignoring checkpoint directory %s: it has no index.json", path)
        elif _LEFTOVER.match(path.name):
            log.warning("ignoring incomplete checkpoint directory %s (a save that did not finish; the next "
                        "save removes it)", path)
    return sorted(found)


def latest_checkpoint(run_dir: Union[str, os.PathLike]) -> Optional[Path]:
    """The newest finished checkpoint of ``run_dir`` (``<run_dir>/checkpoints/step_*``
    with an ``index.json``), or None. Unfinished directories are ignored with a message."""
    found = _complete_steps(Path(run_dir) / "checkpoints")
    return found[-1][1] if found else None


# --------------------------------------------------------------------------- save

def _check_keep_last(keep_last: int) -> None:
    if isinstance(keep_last, bool) or not isinstance(keep_last, int):
        raise ValueError(f"keep_last={keep_last!r} must be an integer (train.keep_last)")
    require(checkpoints_kept, keep_last)


def _check_save_args(step: int, keep_last: int, extra: dict) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an integer >= 0")
    _check_keep_last(keep_last)
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as err:
        raise ValueError(f"extra must be JSON-serialisable (numbers, strings, lists, dicts): {err}") from err


def _write_json_atomic(path: Path, obj: Any) -> None:
    """``obj`` as ``path``, written under another name and renamed: a reader polling for
    ``path`` never sees half of it."""
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(part, path)


@dataclass
class _Pending:
    """One rank's part of a checkpoint being saved: what it writes into ``tmp`` and, on
    rank 0, the index that finishes it (every field but the file records)."""

    step: int
    final: Path
    tmp: Path
    pieces: list[tuple[str, torch.Tensor]]
    rng: str
    index: Optional[dict]  # rank 0 only
    config: Optional[Config]


class CheckpointSaver:
    """Saves the checkpoints of one run, synchronously or in the background.

    ``save`` is a collective (every rank calls it at the same step). Synchronously
    (``async_save=False``) it returns once the checkpoint is complete on every rank, the
    pieces streamed from the live tensors (no second copy of the model). Asynchronously
    it returns after a host copy of this rank's pieces (into one staging arena kept for
    the next save: one host copy of the rank's share of the model and optimizer state,
    pinned on a GPU, the copies waited for by the writer through a CUDA event:
    :mod:`moe_fold.training.host_staging`) and the
    small collectives that agree on the directory and the index; a background thread
    writes the files and, on rank 0, the index and the rename. Training changes the
    tensors meanwhile; the copy is what gets written.

    Finishing without collectives: each rank, once its files are written and fsynced,
    writes ``done_<rank>.json`` (their sha256 and sizes, or its error) into the
    temporary directory; rank 0 waits for every rank's, then writes ``index.json`` and
    renames. A rank whose files stop growing for ``timeout_s`` is taken as dead: rank 0
    gives up, the directory keeps its temporary name, and the previous checkpoints stay.

    :meth:`wait` blocks until this rank's pending save is finished and raises
    :class:`CheckpointError` if it failed; ``save`` waits for the previous one first (one
    save in flight at most). Call :meth:`wait` before the process exits: at the end of a
    run, on a graceful stop after the last ``save``, and on an error path, so no process
    believes a checkpoint saved that is not.
    """

    def __init__(self, run_dir: Union[str, os.PathLike], groups: ProcessGroups, keep_last: int,
                 async_save: bool = True, config: Optional[Config] = None, timeout_s: float = 300.0):
        _check_keep_last(keep_last)
        self.run_dir, self.groups, self.keep_last = Path(run_dir), groups, keep_last
        self.async_save, self.config, self.timeout_s = async_save, config, timeout_s
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._pending: Optional[Path] = None
        self._arena = StagingArena()  # the host copy of async saves, reused across saves

    @property
    def pending(self) -> Optional[Path]:
        """The final path of the save in flight on this rank, None when there is none."""
        return self._pending if self._thread is not None and self._thread.is_alive() else None

    @torch.no_grad()
    def save(self, step: int, model: nn.Module, optimizer: Optional[AdamW], scheduler: Optional[LRScheduler],
             extra: dict) -> Path:
        """Save the checkpoint of ``step`` (see the class docstring) and return its final
        path: complete on return when synchronous, after :meth:`wait` otherwise."""
        _check_save_args(step, self.keep_last, extra)
        self.wait()
        config = self.config if self.config is not None else getattr(model, "config", None)
        groups = self.groups
        world, rank = _world(groups), groups.rank
        entries = _entries(model, optimizer, groups)
        final = checkpoint_path(self.run_dir, step)
        ckpt_dir = final.parent

        nonce = None
        if rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            for path in ckpt_dir.iterdir():
                if _LEFTOVER.match(path.name):
                    log.warning("removing incomplete checkpoint directory %s left by an earlier save", path)
                    shutil.rmtree(path, ignore_errors=True)
            nonce = secrets.token_hex(4)
        nonce = _broadcast(nonce, world)
        tmp = ckpt_dir / f"{final.name}.tmp-{nonce}"
        tmp.mkdir(parents=True, exist_ok=True)

        pieces, records = [], []
        shard_name = f"rank_{rank:05d}.safetensors"
        for entry in entries:
            if not entry.writer:
                continue
            for k, (view, offsets, sizes) in enumerate(entry.pieces(stored=True)):
                key = f"{entry.name}#{k}"
                pieces.append((key, view))
                records.append({"name": entry.name, "key": key, "file": shard_name, "offsets": list(offsets),
                                "sizes": list(sizes)})
        if self.async_save:
            staged = self._arena.stage(pieces)
            pieces = staged.pieces
        meta = {e.name: {"shape": list(e.info.global_shape), "dtype": str(e.data.dtype).removeprefix("torch.")}
                for e in entries}
        gathered = _gather((records, meta), world, rank)
        index = _index(gathered, step, optimizer, scheduler, extra, groups) if rank == 0 else None
        job = _Pending(step, final, tmp, pieces, json.dumps(_rng_state()), index, config)
        if not self.async_save:
            self._write(job)
            _barrier(world)
            return final
        self._pending, self._error = final, None
        self._thread = threading.Thread(target=self._background, args=(job, staged), name=f"checkpoint-{step}")
        self._thread.start()
        return final

    def wait(self, collective: bool = False) -> Optional[Path]:
        """Block until this rank's pending save is written (on rank 0: complete, renamed
        and pruned); return its path (None when nothing was pending). Raises
        :class:`CheckpointError` when it failed. ``collective``: then a barrier, so on
        return the checkpoint is complete for every rank (every rank must call it)."""
        thread, path = self._thread, self._pending
        if thread is not None:
            thread.join()
            self._thread, self._pending = None, None
        if collective:
            _barrier(_world(self.groups))
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"saving checkpoint {path} failed: {error}") from error
        return path

    def _background(self, job: _Pending, staged: Staged) -> None:
        try:
            staged.wait()  # the device-to-host copies (CUDA events; nothing on CPU)
            self._write(job)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread by wait()
            self._error = err

    def _write(self, job: _Pending) -> None:
        """This rank's files, its done marker, and on rank 0 the rest (see the class docstring)."""
        rank = self.groups.rank
        shard_name, rng_name = f"rank_{rank:05d}.safetensors", f"rng_{rank:05d}.json"
        done = job.tmp / f"done_{rank:05d}.json"
        try:
            files = {shard_name: _write_safetensors(job.tmp / shard_name, job.pieces)}
            (job.tmp / rng_name).write_text(job.rng)
            files[rng_name] = _file_record(job.tmp / rng_name)
        except BaseException as err:
            with contextlib.suppress(OSError):
                _write_json_atomic(done, {"error": f"{type(err).__name__}: {err}"})
            raise
        _write_json_atomic(done, {"files": files})
        if rank == 0:
            self._finish(job)

    def _finish(self, job: _Pending) -> None:
        """Rank 0: wait for every rank's files, write the index, rename, keep the newest."""
        index, tmp, final = job.index, job.tmp, job.final
        for rank_files in self._wait_for_ranks(tmp):
            index["files"].update(rank_files)
        if job.config is not None:
            dump_config(job.config, tmp / "config.yaml")
            index["files"]["config.yaml"] = _file_record(tmp / "config.yaml")
        for path in tmp.glob("done_*.json"):
            path.unlink()
        write_index(tmp, index)
        _fsync_dir(tmp)
        ckpt_dir = final.parent
        old = None
        if final.exists():  # saving a step again (a resumed run): replace it
            old = ckpt_dir / f"{final.name}.old-{tmp.name.rsplit('-', 1)[1]}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(ckpt_dir)
        if old is not None:
            shutil.rmtree(old)
        done = _complete_steps(ckpt_dir)
        for s, path in done[:-self.keep_last]:
            if path != final:
                shutil.rmtree(path)

    def _wait_for_ranks(self, tmp: Path) -> list[dict]:
        """Every rank's file records, from its done marker, in rank order."""
        world = self.groups.layout.world_size
        found: dict[int, dict] = {}
        progress, last_change = None, time.monotonic()
        while len(found) < world:
            for r in range(world):
                marker = tmp / f"done_{r:05d}.json"
                if r not in found and marker.is_file():
                    record = json.loads(marker.read_text())
                    if "error" in record:
                        raise CheckpointError(f"rank {r} could not write its part of {tmp}: {record['error']}")
                    found[r] = record["files"]
            if len(found) == world:
                break
            sizes = sorted((p.name, p.stat().st_size) for p in tmp.glob("rank_*.safetensors"))
            if sizes != progress:
                progress, last_change = sizes, time.monotonic()
            elif time.monotonic() - last_change > self.timeout_s:
                missing = sorted(set(range(world)) - set(found))
                raise CheckpointError(f"ranks {missing} wrote nothing into {tmp} for {self.timeout_s:.0f} s "
                                      f"(parallel.timeout_s): the checkpoint is left unfinished, the previous "
                                      f"ones are kept")
            time.sleep(0.02)
        return [found[r] for r in range(world)]


def save_checkpoint(run_dir: Union[str, os.PathLike], step: int, model: nn.Module, optimizer: Optional[AdamW],
                    scheduler: Optional[LRScheduler], extra: dict, groups: ProcessGroups, keep_last: int,
                    config: Optional[Config] = None) -> Path:
    """Write the checkpoint of ``step`` on every rank (a collective: all ranks call it)
    and return its path, complete on every rank. ``extra`` (JSON: the data position, ...)
    comes back from :func:`load_checkpoint`. ``config`` defaults to ``model.config``.
    Keeps the newest ``keep_last`` checkpoints. :class:`CheckpointSaver` saves in the
    background."""
    saver = CheckpointSaver(run_dir, groups, keep_last, async_save=False, config=config)
    return saver.save(step, model, optimizer, scheduler, extra)


def _index(gathered: list, step: int, optimizer: Optional[AdamW], scheduler: Optional[LRScheduler],
           extra: dict, groups: ProcessGroups) -> dict:
    """The index of a checkpoint from every rank's ``(records, meta)``; its ``files`` are
    filled in once the ranks have written them."""
    tensors: dict[str, dict] = {}
    for records, meta in gathered:
        for name, m in meta.items():
            entry = tensors.setdefault(name, {**m, "pieces": []})
            if entry["shape"] != m["shape"] or entry["dtype"] != m["dtype"]:
                raise CheckpointError(f"ranks disagree on {name}: shape {entry['shape']} {entry['dtype']} "
                                      f"vs {m['shape']} {m['dtype']}")
        for r in records:
            tensors[r["name"]]["pieces"].append({k: r[k] for k in ("file", "key", "offsets", "sizes")})
    for name, entry in tensors.items():
        stored = sum(_numel(p["sizes"]) for p in entry["pieces"])
        if stored != _numel(entry["shape"]):
            raise CheckpointError(f"{name}: the ranks wrote {stored} elements of a tensor of shape "
                                  f"{entry['shape']}; each element must be written exactly once")
    index = {"format": FORMAT, "version": VERSION, "step": step, "layout": _layout_record(groups),
             "tensors": tensors, "files": {}, "extra": extra,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "optimizer": None}
    if optimizer is not None:
        index["optimizer"] = {"step_count": optimizer.step_count, "distributed": optimizer.distributed,
                              "param_groups": [{k: v for k, v in g.items() if k not in ("params",)}
                                               for g in optimizer.param_groups]}
    return index


def _index_digest(index: dict) -> str:
    """The sha256 of ``index`` without its signature, over one canonical JSON text (sorted
    keys, no spaces): the same before writing and after reading back."""
    body = {k: v for k, v in index.items() if k != _SIGNATURE}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_index(path: Path, index: dict) -> None:
    """Write ``index`` (a current-version manifest) as ``path/index.json``, signed with its
    own sha256 (:func:`read_index` checks it), and fsync it."""
    signed = {**index, _SIGNATURE: _index_digest(index)}
    with open(Path(path) / "index.json", "w") as f:
        json.dump(signed, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- load

def file_problem(path: Path, record: dict, checksum: bool = True) -> Optional[str]:
    """What is wrong with checkpoint file ``path`` against its index record
    (``{"sha256", "bytes"}``): ``"is missing"``, a size or (``checksum``) sha256
    mismatch; None when it matches."""
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"has {size} bytes, index.json says {record['bytes']} (truncated or replaced)"
    if checksum:
        digest = _sha256(path)
        if digest != record["sha256"]:
            return f"is corrupt: sha256 {digest} differs from {record['sha256']} in index.json"
    return None


class _Reader:
    """Opens checkpoint files on first use, after checking their size and sha256."""

    def __init__(self, path: Path, files: dict, stack: contextlib.ExitStack):
        self.path, self.files, self.stack = path, files, stack
        self.handles: dict[str, Any] = {}

    def verify(self, name: str) -> Path:
        path = self.path / name
        record = self.files.get(name)
        if record is None:
            raise CheckpointDamaged(f"checkpoint file {path} is not listed in {self.path / 'index.json'}")
        problem = file_problem(path, record)
        if problem is not None:
            raise CheckpointDamaged(f"checkpoint file {path} {problem}")
        return path

    def _open(self, name: str):
        if name not in self.handles:
            self.handles[name] = self.stack.enter_context(safe_open(str(self.verify(name)), framework="pt"))
        return self.handles[name]

    def read(self, name: str, entry: dict, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box ``offsets``/``sizes`` of the global tensor ``name``, from the pieces that overlap it."""
        out = None
        filled = 0
        for piece in entry["pieces"]:
            hit = intersect(offsets, sizes, piece["offsets"], piece["sizes"])
            if hit is None:
                continue
            lo, size = hit
            handle = self._open(piece["file"])
            if size:
                value = handle.get_slice(piece["key"])[box(_sub(lo, piece["offsets"]), size)]
            else:  # a 0-dim tensor, which get_slice cannot index
                value = handle.get_tensor(piece["key"])
            if out is None:
                out = torch.empty(sizes, dtype=value.dtype)
            out[box(_sub(lo, offsets), size)] = value
            filled += _numel(size)
        if filled != _numel(sizes):
            raise CheckpointDamaged(f"{name}: the checkpoint holds {filled} of the {_numel(sizes)} elements at "
                                  f"offsets {list(offsets)} sizes {list(sizes)}")
        return out


def _whole_model_names(names: set[str], groups: ProcessGroups) -> set[str]:
    """The tensor names of the whole model: this rank's ``names`` united over its pp group
    (a stage holds only its layers; the tp/dp/cp ranks of a stage hold the same names)."""
    pp = groups.size("pp")
    if pp == 1:
        return names
    parts: list = [None] * pp
    dist.all_gather_object(parts, sorted(names), group=groups.pp)
    return set().union(*parts)


def _resolve(path_or_run_dir: Union[str, os.PathLike]) -> Path:
    path = Path(path_or_run_dir)
    if (path / "index.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"no checkpoint in {path}: neither {path / 'index.json'} nor "
                              f"{path / 'checkpoints'}/step_*/index.json exists")
    return latest


def read_index(path: Path) -> dict:
    """The ``index.json`` of checkpoint ``path`` (its manifest: tensors, pieces, and the
    sha256 and size of every file), checked for format, version and its own sha256. A
    version 1 index (saved before indexes were signed) has none: it is read with a warning."""
    index_path = Path(path) / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointDamaged(f"cannot read {index_path}: {err}") from err
    if not isinstance(index, dict):
        raise CheckpointDamaged(f"{index_path} is not a {FORMAT} index (a JSON object)")
    version = index.get("version")
    if index.get("format") != FORMAT or version not in (1, VERSION):
        raise CheckpointError(f"{index_path} is not a {FORMAT} index of version 1 or {VERSION} "
                              f"(format={index.get('format')!r}, version={version!r})")
    signature = index.get(_SIGNATURE)
    if version == 1 and signature is None:
        warnings.warn(f"{index_path} is a version 1 index, which has no sha256 of its own: its step, data "
                      f"position and file list are not checked (the next save writes version {VERSION})",
                      stacklevel=2)
    elif signature != (digest := _index_digest(index)):
        # A version 1 index with a signature is a version 2 index whose version was altered.
        raise CheckpointDamaged(f"{index_path} is corrupt: its content's sha256 {digest} differs "
                                f"from its {_SIGNATURE} {signature}")
    return index


@torch.no_grad()
def load_checkpoint(path_or_run_dir: Union[str, os.PathLike], model: nn.Module, optimizer: Optional[AdamW],
                    scheduler: Optional[LRScheduler], groups: ProcessGroups) -> dict:
    """Load a checkpoint (a ``step_*`` directory, or the newest of a run directory) into
    this rank's ``model``, ``optimizer`` and ``scheduler`` (either may be None) in the
    layout of ``groups``, whatever layout it was saved under (pp included). Restores this
    rank's random states when the layout is the same. Returns the ``extra`` dict given to
    :func:`save_checkpoint`. Under pp it is a collective over the pp group: the checkpoint
    must hold every tensor of the whole model (the union of the stages' names) and no
    other (CheckpointError naming them); each stage then reads only its own tensors."""
    path = _resolve(path_or_run_dir)
    index = read_index(path)
    if optimizer is not None and index["optimizer"] is None:
        raise CheckpointError(f"{path} was saved without optimizer state; pass optimizer=None to load the model only")
    entries = _entries(model, optimizer, groups)
    stored = index["tensors"]
    # Judged on the whole model, so every rank of a pipeline takes the same decision.
    wanted = _whole_model_names({e.name for e in entries}, groups)
    missing = sorted(wanted - set(stored))
    unexpected = sorted(n for n in set(stored) - wanted
                        if n.startswith("model/") or (optimizer is not None and n.startswith("optim/")))
    if missing or unexpected:
        raise CheckpointError(f"{path} does not match the model: missing {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                              f"{' ...' if len(unexpected) > 8 else ''}")
    with contextlib.ExitStack() as stack:
        reader = _Reader(path, index["files"], stack)
        # The shards are checked as they are opened; every other file (random states,
        # config.yaml) by one rank each, so damage anywhere is named before a step runs.
        shards = {piece["file"] for record in stored.values() for piece in record["pieces"]}
        for name in sorted(set(index["files"]) - shards)[groups.rank::groups.layout.world_size]:
            reader.verify(name)
        for entry in entries:
            record = stored[entry.name]
            if tuple(record["shape"]) != entry.info.global_shape:
                raise CheckpointError(f"{entry.name}: the checkpoint's global shape {record['shape']} differs "
                                      f"from the model's {list(entry.info.global_shape)}")
            for view, offsets, sizes in entry.pieces():
                view.copy_(reader.read(entry.name, record, offsets, sizes))
        if optimizer is not None:
            optimizer.step_count = int(index["optimizer"]["step_count"])
        if scheduler is not None:
            if index["scheduler"] is None:
                raise CheckpointError(f"{path} was saved without scheduler state; pass scheduler=None")
            scheduler.load_state_dict(index["scheduler"])
        if index["layout"] == _layout_record(groups):
            rng_name = f"rng_{groups.rank:05d}.json"
            _set_rng_state(json.loads(reader.verify(rng_name).read_text()))
        else:
            warnings.warn(f"{path} was saved under layout {index['layout']}, loading under "
                          f"{_layout_record(groups)}: random states are not restored (a rank of one layout "
                          f"has no counterpart in another); weights, optimizer and schedule are exact",
                          stacklevel=2)
    return index["extra"]


def load_newest_intact(run_dir: Union[str, os.PathLike], load: Callable[[Path], Any],
                       groups: ProcessGroups) -> Optional[tuple[Path, Any]]:
    """Load the newest checkpoint of ``run_dir`` that is intact on every rank with
    ``load(path)`` (:func:`load_checkpoint` into the run's model, optimizer and schedule),
    and return its path and what ``load`` returned (None when the run has no checkpoint).
    A collective.

    A newer checkpoint found damaged (:class:`CheckpointDamaged`) on any rank is moved aside
    to ``step_N.damaged-<time>`` by rank 0 (kept for inspection, never read again) with a
    warning naming the file and the problem, and the one before it is tried: the ranks
    decide together, so they all resume from the same step. With no intact checkpoint left,
    the first damage found is raised, and nothing is moved. Any other error (a checkpoint
    of another model) is raised at once: falling back would not mend it."""
    world = _world(groups)
    found = _complete_steps(Path(run_dir) / "checkpoints")
    damaged: list[tuple[Path, str]] = []
    for _, path in reversed(found):
        problem = None
        try:
            extra = load(path)
        except CheckpointDamaged as err:
            problem = str(err)
        problems = [problem] if world == 1 else [None] * world
        if world > 1:
            dist.all_gather_object(problems, problem)
        first = next((p for p in problems if p is not None), None)
        if first is None:
            if damaged and groups.rank == 0:
                stamp = time.strftime("%Y%m%dT%H%M%S")
                for bad, why in damaged:
                    os.rename(bad, bad.with_name(f"{bad.name}.damaged-{stamp}"))
                    warnings.warn(f"resuming from {path}: the newer checkpoint {bad} is damaged ({why}); it is "
                                  f"moved aside to {bad.name}.damaged-{stamp}", stacklevel=2)
            _barrier(world)
            return path, extra
        damaged.append((path, first))
    if damaged:
        raise CheckpointDamaged(f"no intact checkpoint in {run_dir}: " + "; ".join(why for _, why in damaged))
    return None
