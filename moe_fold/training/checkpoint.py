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
  position, ...) and the layout it was saved under.

Loading under any layout (tp, ep, etp, dp, cp, with or without the distributed optimizer)
reads, for each piece of each local tensor, only the stored pieces that overlap it
(safetensors ``get_slice``). Parameters are named by ``model.named_parameters()``, so the
names must be global (pipeline stages must name layers by their global index); a stage
reads its layers only, and pp may differ between save and load (vpp too).

Tied embeddings under pp: the last stage's copy of the embedding (``param.tied_copy``,
equal to the first stage's) and its moments are not written, only loaded from the one
stored ``model/embed.weight``.

Atomicity: every rank writes into ``step_000100.tmp-<nonce>``; after all ranks have
written, rank 0 writes ``index.json`` and renames the directory to ``step_000100``. A
crash before the rename leaves the previous checkpoints untouched; a directory without
the final name is ignored by :func:`latest_checkpoint` (with a message) and removed by the
next :func:`save_checkpoint`. Only the newest ``keep_last`` checkpoints are kept. Every
rank must see the same ``run_dir`` (a shared file system across nodes).

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
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from moe_fold.config import Config, dump_config
from moe_fold.layout import ProcessGroups
from moe_fold.training.optim import AdamW, LRScheduler
from moe_fold.parallel.sharding import ShardInfo, box, buffer_info, flat_boxes, intersect, shard_info

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path"]

log = logging.getLogger(__name__)

FORMAT = "moe-fold-checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"step_(\d+)")
_LEFTOVER = re.compile(r"step_\d+\.(tmp|old)-")
_MOMENTS = ("exp_avg", "exp_avg_sq")
_CHUNK = 1 << 20
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file or tensor."""


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

    def pieces(self) -> Iterator[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        """``(view of data, global offsets, sizes)`` covering ``data`` once."""
        flat = self.data.view(-1)  # [stop - start]
        for offset, offsets, sizes in flat_boxes(self.shape, self.start, self.stop):
            n = _numel(sizes)
            block = flat[offset - self.start: offset - self.start + n].view(sizes)
            for piece in self.info.pieces:
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

@torch.no_grad()
def save_checkpoint(run_dir: Union[str, os.PathLike], step: int, model: nn.Module, optimizer: Optional[AdamW],
                    scheduler: Optional[LRScheduler], extra: dict, groups: ProcessGroups, keep_last: int,
                    config: Optional[Config] = None) -> Path:
    """Write the checkpoint of ``step`` on every rank (a collective: all ranks call it)
    and return its path. ``extra`` (JSON: the data position, ...) comes back from
    :func:`load_checkpoint`. ``config`` defaults to ``model.config``. Keeps the newest
    ``keep_last`` checkpoints."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an integer >= 0")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r} must be an integer >= 1 (train.keep_last)")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as err:
        raise ValueError(f"extra must be JSON-serialisable (numbers, strings, lists, dicts): {err}") from err
    if config is None:
        config = getattr(model, "config", None)
    world, rank = _world(groups), groups.rank
    entries = _entries(model, optimizer, groups)
    final = checkpoint_path(run_dir, step)
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
        for k, (view, offsets, sizes) in enumerate(entry.pieces()):
            key = f"{entry.name}#{k}"
            pieces.append((key, view))
            records.append({"name": entry.name, "key": key, "file": shard_name, "offsets": list(offsets),
                            "sizes": list(sizes)})
    files = {shard_name: _write_safetensors(tmp / shard_name, pieces)}
    rng_name = f"rng_{rank:05d}.json"
    (tmp / rng_name).write_text(json.dumps(_rng_state()))
    files[rng_name] = _file_record(tmp / rng_name)
    meta = {e.name: {"shape": list(e.info.global_shape), "dtype": str(e.data.dtype).removeprefix("torch.")}
            for e in entries}
    gathered = _gather((records, files, meta), world, rank)

    if rank == 0:
        index = _index(gathered, step, optimizer, scheduler, extra, groups)
        if config is not None:
            dump_config(config, tmp / "config.yaml")
            index["files"]["config.yaml"] = _file_record(tmp / "config.yaml")
        with open(tmp / "index.json", "w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = None
        if final.exists():  # saving a step again (a resumed run): replace it
            old = ckpt_dir / f"{final.name}.old-{nonce}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(ckpt_dir)
        if old is not None:
            shutil.rmtree(old)
        done = _complete_steps(ckpt_dir)
        for s, path in done[:-keep_last]:
            if path != final:
                shutil.rmtree(path)
    _barrier(world)
    return final


def _index(gathered: list, step: int, optimizer: Optional[AdamW], scheduler: Optional[LRScheduler],
           extra: dict, groups: ProcessGroups) -> dict:
    tensors: dict[str, dict] = {}
    files: dict[str, dict] = {}
    for records, rank_files, meta in gathered:
        files.update(rank_files)
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
             "tensors": tensors, "files": files, "extra": extra,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "optimizer": None}
    if optimizer is not None:
        index["optimizer"] = {"step_count": optimizer.step_count, "distributed": optimizer.distributed,
                              "param_groups": [{k: v for k, v in g.items() if k not in ("params",)}
                                               for g in optimizer.param_groups]}
    return index


# --------------------------------------------------------------------------- load

class _Reader:
    """Opens checkpoint files on first use, after checking their size and sha256."""

    def __init__(self, path: Path, files: dict, stack: contextlib.ExitStack):
        self.path, self.files, self.stack = path, files, stack
        self.handles: dict[str, Any] = {}

    def verify(self, name: str) -> Path:
        path = self.path / name
        record = self.files.get(name)
        if record is None:
            raise CheckpointError(f"checkpoint file {path} is not listed in {self.path / 'index.json'}")
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != record["bytes"]:
            raise CheckpointError(f"checkpoint file {path} has {size} bytes, index.json says {record['bytes']} "
                                  f"(truncated or replaced)")
        digest = _sha256(path)
        if digest != record["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is corrupt: sha256 {digest} differs from "
                                  f"{record['sha256']} in index.json")
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
            raise CheckpointError(f"{name}: the checkpoint holds {filled} of the {_numel(sizes)} elements at "
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
    index_path = path / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {index_path}: {err}") from err
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{index_path} is not a {FORMAT} version {VERSION} index "
                              f"(format={index.get('format')!r}, version={index.get('version')!r})")
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
