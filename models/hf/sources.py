"""Where a parameter of ours lives in a Hugging Face checkpoint, as a tree over its tensors.

Each global parameter of ours is described as a :class:`Source` tree over Hugging Face
tensors: :class:`Take` (one tensor, its dims possibly permuted), :class:`Cat` (parts
concatenated along a dim: q|k|v, gate|up), :class:`Stack` (one tensor per expert),
:class:`Copies` (one tensor stored several times), :class:`FirstRow`, :class:`Halves`,
:class:`Squeezed`, :class:`Grouped` and :class:`Unread`.
Import reads any box of our global tensor from that tree, so a rank reads only the
slices of the safetensors files its shard needs (``get_slice``); export splits a
gathered global tensor back into the Hugging Face tensors with the same tree. Which
tree a parameter has is the family's business (:mod:`.families`, :mod:`.weights`).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError, safe_open

__all__ = ["HFWeightError", "SafetensorsFolder", "Source", "Take", "Cat", "Stack", "Copies", "FirstRow", "Halves",
           "Squeezed", "Grouped", "Unread"]


class HFWeightError(ValueError):
    """A Hugging Face checkpoint whose tensors do not fit the model; names the tensor."""


class SafetensorsFolder:
    """The tensors of a Hugging Face folder: ``model.safetensors``, or the files listed by
    ``model.safetensors.index.json``. Files open on first use and are read lazily."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise HFWeightError(f"{index}: not a safetensors index (JSON with a weight_map): {err!r}") from err
            self.files = {name: self.path / file for name, file in weight_map.items()}
            missing = sorted({f.name for f in self.files.values() if not f.is_file()})
            if missing:
                raise FileNotFoundError(f"{index} lists {', '.join(missing)}, missing from {self.path}")
        elif single.is_file():
            with _open_safetensors(single) as f:
                self.files = {name: single for name in f.keys()}
        else:
            raise FileNotFoundError(f"{self.path} holds neither model.safetensors nor model.safetensors.index.json")
        self.names = frozenset(self.files)

    def __enter__(self) -> "SafetensorsFolder":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _slice(self, name: str):
        if name not in self.files:
            raise HFWeightError(f"{self.path}: the checkpoint has no tensor {name!r}")
        file = str(self.files[name])
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_open_safetensors(Path(file)))
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box ``offsets``/``sizes`` of tensor ``name``; only that box is read."""
        return self._slice(name)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


def _open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise HFWeightError(f"{path}: not a readable safetensors file (truncated or damaged?): {err}") from err


@dataclass(frozen=True)
class Take:
    """Our tensor is the Hugging Face tensor ``name`` with dims ``perm``
    (``ours = theirs.permute(perm)``; None: as stored)."""

    name: str
    perm: Optional[tuple[int, ...]] = None

    def names(self) -> list[str]:
        return [self.name]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shape = hf.shape(self.name)
        return shape if self.perm is None else tuple(shape[p] for p in self.perm)

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        if self.perm is None:
            return hf.read(self.name, offsets, sizes)
        theirs_off, theirs_size = [0] * len(offsets), [0] * len(sizes)
        for ours, theirs in enumerate(self.perm):
            theirs_off[theirs], theirs_size[theirs] = offsets[ours], sizes[ours]
        return hf.read(self.name, tuple(theirs_off), tuple(theirs_size)).permute(self.perm)

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if self.perm is not None:
            inverse = sorted(range(len(self.perm)), key=self.perm.__getitem__)
            value = value.permute(inverse)
        return [(self.name, value)]


@dataclass(frozen=True)
class Cat:
    """Our tensor is ``parts`` concatenated along ``dim``, of sizes ``sizes`` there."""

    dim: int
    parts: tuple
    sizes: tuple[int, ...]

    def names(self) -> list[str]:
        return [n for p in self.parts for n in p.names()]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shapes = [p.shape(hf) for p in self.parts]
        for part, shape, size in zip(self.parts, shapes, self.sizes):
            rest = [s for d, s in enumerate(shapes[0]) if d != self.dim]
            if shape[self.dim] != size or [s for d, s in enumerate(shape) if d != self.dim] != rest:
                raise HFWeightError(f"{', '.join(part.names())} has shape {list(shape)}; expected {size} along "
                                    f"dim {self.dim} and the other dims of {', '.join(self.parts[0].names())} "
                                    f"{list(shapes[0])}")
        out = list(shapes[0])
        out[self.dim] = sum(self.sizes)
        return tuple(out)

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        lo, hi = offsets[self.dim], offsets[self.dim] + sizes[self.dim]
        pieces, start = [], 0
        for part, size in zip(self.parts, self.sizes):
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                off, n = list(offsets), list(sizes)
                off[self.dim], n[self.dim] = a - start, b - a
                pieces.append(part.read(hf, tuple(off), tuple(n)))
            start += size
        return torch.cat(pieces, self.dim)

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [item for part, piece in zip(self.parts, value.split(list(self.sizes), self.dim))
                for item in part.split(piece)]


@dataclass(frozen=True)
class Stack:
    """Our tensor is ``parts`` stacked along a new dim 0 (one part per expert)."""

    parts: tuple

    def names(self) -> list[str]:
        return [n for p in self.parts for n in p.names()]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shapes = {p.shape(hf) for p in self.parts}
        if len(shapes) != 1:
            raise HFWeightError(f"the experts {', '.join(self.names())} have different shapes {sorted(shapes)}")
        return (len(self.parts),) + shapes.pop()

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        return torch.stack([self.parts[e].read(hf, offsets[1:], sizes[1:])
                            for e in range(offsets[0], offsets[0] + sizes[0])])

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [item for part, piece in zip(self.parts, value.unbind(0)) for item in part.split(piece)]


@dataclass(frozen=True)
class Copies:
    """Our tensor is stored several times (DeepSeek-V3's MTP layers repeat the embedding
    and the head): read from the first part, written to every part."""

    parts: tuple

    def names(self) -> list[str]:
        return [n for p in self.parts for n in p.names()]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        return self.parts[0].shape(hf)

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        return self.parts[0].read(hf, offsets, sizes)

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [item for part in self.parts for item in part.split(value)]


@dataclass(frozen=True)
class FirstRow:
    """Our tensor is the only row of the Hugging Face tensor ``name`` ``[1, ...]`` (ERNIE-4.5
    stores its expert bias as ``[1, E]``)."""

    name: str

    def names(self) -> list[str]:
        return [self.name]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shape = hf.shape(self.name)
        if not shape or shape[0] != 1:
            raise HFWeightError(f"{self.name} has shape {list(shape)}; expected a leading dim of 1")
        return shape[1:]

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        return hf.read(self.name, (0,) + tuple(offsets), (1,) + tuple(sizes))[0]

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(self.name, value.unsqueeze(0))]


@dataclass(frozen=True)
class Halves:
    """Our tensor is ``part`` with the pairs along ``dim`` split into two halves: ours =
    ``[part[even] | part[odd]]`` along ``dim`` (gpt-oss interleaves gate and up columns,
    ``g0 u0 g1 u1 ...``; ours are ``[gate | up]``). A read takes the whole of ``dim`` (a
    rank's columns of one half are every other column of theirs) and the box of the rest."""

    part: object
    dim: int

    def names(self) -> list[str]:
        return self.part.names()

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shape = self.part.shape(hf)
        if shape[self.dim] % 2:
            raise HFWeightError(f"{', '.join(self.names())} has {shape[self.dim]} interleaved gate/up entries along "
                                f"dim {self.dim}; an even number is needed")
        return shape

    def _order(self, n: int) -> torch.Tensor:
        return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])  # ours[i] = theirs[order[i]]

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        n = self.part.shape(hf)[self.dim]
        off, size = list(offsets), list(sizes)
        off[self.dim], size[self.dim] = 0, n
        whole = self.part.read(hf, tuple(off), tuple(size)).index_select(self.dim, self._order(n))
        return whole.narrow(self.dim, offsets[self.dim], sizes[self.dim])

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        n = value.shape[self.dim]
        return self.part.split(value.index_select(self.dim, torch.argsort(self._order(n))))


@dataclass(frozen=True)
class Squeezed:
    """Our tensor is the Hugging Face tensor ``name`` without its dims ``dim`` (one, or a
    tuple) of size 1 (a depthwise ``Conv1d`` weight ``[C, 1, K]``, ours ``[C, K]``; Kimi-Linear's
    ``A_log [1, 1, heads, 1]``, ours ``[heads]``)."""

    name: str
    dim: Union[int, tuple[int, ...]]

    def _dims(self) -> tuple[int, ...]:
        return (self.dim,) if isinstance(self.dim, int) else tuple(sorted(self.dim))

    def names(self) -> list[str]:
        return [self.name]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shape = hf.shape(self.name)
        if any(len(shape) <= d or shape[d] != 1 for d in self._dims()):
            raise HFWeightError(f"{self.name} has shape {list(shape)}; expected dims {list(self._dims())} of 1")
        return tuple(n for d, n in enumerate(shape) if d not in self._dims())

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        off, size = list(offsets), list(sizes)
        for d in self._dims():
            off.insert(d, 0)
            size.insert(d, 1)
        return hf.read(self.name, tuple(off), tuple(size)).squeeze(self._dims())

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        for d in self._dims():
            value = value.unsqueeze(d)
        return [(self.name, value)]


@dataclass(frozen=True)
class Grouped:
    """Our tensor is ``part`` with its entries along ``dim`` regrouped: theirs hold ``groups``
    blocks, each the parts of sizes ``sizes`` of one group (a head); ours hold each part
    for every group in turn. Qwen3-Next stores its fused Gated DeltaNet projections by key
    head (``q_h k_h v_h z_h`` for each h; ours ``q k v z``) and its gated query by head
    (``q_h gate_h``; ours ``q gate``). A read takes the whole of ``dim`` and the box of the rest."""

    part: object
    dim: int
    groups: int
    sizes: tuple[int, ...]

    def names(self) -> list[str]:
        return self.part.names()

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shape = self.part.shape(hf)
        if shape[self.dim] != self.groups * sum(self.sizes):
            raise HFWeightError(f"{', '.join(self.names())} has {shape[self.dim]} entries along dim {self.dim}; "
                                f"expected {self.groups} groups of {' + '.join(map(str, self.sizes))}")
        return shape

    def _order(self) -> torch.Tensor:
        """ours[i] = theirs[order[i]]."""
        width = sum(self.sizes)
        starts = [sum(self.sizes[:p]) for p in range(len(self.sizes))]
        return torch.cat([torch.arange(g * width + start, g * width + start + size)
                          for start, size in zip(starts, self.sizes) for g in range(self.groups)])

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        n = self.shape(hf)[self.dim]
        off, size = list(offsets), list(sizes)
        off[self.dim], size[self.dim] = 0, n
        whole = self.part.read(hf, tuple(off), tuple(size)).index_select(self.dim, self._order())
        return whole.narrow(self.dim, offsets[self.dim], sizes[self.dim])

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return self.part.split(value.index_select(self.dim, torch.argsort(self._order())))


@dataclass(frozen=True)
class Unread:
    """Our tensor is ``part``; the checkpoint also holds the tensors ``extra`` (name, shape),
    which transformers allocates and never reads (LongCat-Flash's gate and up projections
    of its zero-computation experts, rows of its fused ``gate_up_proj`` that no token
    multiplies). Import reads ``part`` only (``extra`` must be there, as transformers saves
    them); export writes ``extra`` as zeros of ``part``'s dtype."""

    part: object
    extra: tuple[tuple[str, tuple[int, ...]], ...]

    def names(self) -> list[str]:
        return self.part.names() + [name for name, _ in self.extra]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        for name, shape in self.extra:
            if hf.shape(name) != shape:
                raise HFWeightError(f"{name} has shape {list(hf.shape(name))}; expected {list(shape)}")
        return self.part.shape(hf)

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        return self.part.read(hf, offsets, sizes)

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return self.part.split(value) + [(name, value.new_zeros(shape)) for name, shape in self.extra]


Source = Union[Take, Cat, Stack, Copies, FirstRow, Halves, Squeezed, Grouped, Unread]
