"""MoE parallel folding: the attention and expert layouts of one world, and their process groups.

A rank has coordinates in two layouts built from one order string (leftmost name varies
fastest, as in Megatron-Core's ``RankGenerator``):

- attention layout ``tp x cp x dp x pp = world`` (the order's ``ep`` has size 1 here);
- expert layout ``etp x ep x edp x pp = world`` (the order's ``tp`` is etp, ``dp`` is
  edp and ``cp`` has size 1), with the same pp groups.

:class:`ParallelLayout` is pure arithmetic and needs no torch.distributed;
:func:`create_process_groups` turns it into torch process groups for one rank, held by
:class:`ProcessGroups`, which the rest of the code receives explicitly.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from moe_fold.config import require, world_fits_layouts

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["GROUP_NAMES", "ORDER_NAMES", "ParallelLayout", "ProcessGroups", "create_process_groups"]

ORDER_NAMES = ("tp", "cp", "ep", "dp", "pp")

# group kind -> (layout it lives in, the order names that vary inside one group)
_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tp": ("attention", ("tp",)),
    "cp": ("attention", ("cp",)),
    "dp": ("attention", ("dp",)),
    "pp": ("attention", ("pp",)),
    "dp_cp": ("attention", ("dp", "cp")),
    "tp_cp": ("attention", ("tp", "cp")),
    "tp_dp_cp": ("attention", ("tp", "dp", "cp")),
    "ep": ("expert", ("ep",)),
    "etp": ("expert", ("tp",)),
    "etp_ep": ("expert", ("tp", "ep")),
    "edp": ("expert", ("dp",)),
}
GROUP_NAMES = tuple(_KINDS)


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _check_name(name: str) -> None:
    if name not in _KINDS:
        raise ValueError(f"group name {name!r} is unknown; names are {' '.join(GROUP_NAMES)}")


def _digits(index: int, sizes: list[int]) -> list[int]:
    """Mixed-radix digits of ``index``, first size varying fastest."""
    out = []
    for s in sizes:
        out.append(index % s)
        index //= s
    return out


def _number(digits: list[int], sizes: list[int]) -> int:
    """Inverse of :func:`_digits`."""
    index, stride = 0, 1
    for d, s in zip(digits, sizes):
        index += d * stride
        stride *= s
    return index


def _rank_groups(world_size: int, order: list[str], sizes: dict[str, int], inside: tuple[str, ...]) -> list[list[int]]:
    """All groups whose members differ only in the ``inside`` coordinates.

    Groups are listed by the index of their fixed (outside) coordinates, leftmost
    fastest, and each group's ranks ascend: the same lists Megatron-Core's
    ``generate_masked_orthogonal_rank_groups`` gives.
    """
    all_sizes = [sizes[n] for n in order]
    outside = [i for i, n in enumerate(order) if n not in inside]
    outside_sizes = [all_sizes[i] for i in outside]
    groups: dict[int, list[int]] = {}
    for rank in range(world_size):
        digits = _digits(rank, all_sizes)
        key = _number([digits[i] for i in outside], outside_sizes)
        groups.setdefault(key, []).append(rank)
    return [groups[k] for k in sorted(groups)]


@dataclass(frozen=True)
class ParallelLayout:
    """Attention layout ``tp x cp x dp x pp`` and expert layout ``etp x ep x edp x pp`` of one world.

    ``etp=None`` means etp = tp. ``order`` names ``tp cp ep dp pp``, leftmost varying
    fastest; a name whose size is 1 in both layouts may be left out (it then goes last).
    Raises ValueError naming the value and the rule for a layout that cannot exist.
    """

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    order: str = "tp-cp-ep-dp-pp"
    dp: int = field(init=False)
    edp: int = field(init=False)
    _groups: dict[str, list[list[int]]] = field(init=False, repr=False, compare=False)
    _group_index: dict[str, list[int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: derived fields are set once, here
        for name in ("world_size", "tp", "cp", "pp", "ep"):
            _positive_int(name, getattr(self, name))
        if self.etp is not None:
            _positive_int("etp", self.etp)
        require(world_fits_layouts, self.world_size, self.tp, self.cp, self.pp, self.ep, self.etp)
        if self.etp is None:
            set_(self, "etp", self.tp)
        set_(self, "dp", self.world_size // (self.tp * self.cp * self.pp))
        set_(self, "edp", self.world_size // (self.etp * self.ep * self.pp))

        attention = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        expert = {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}
        order = self._order_names()
        layouts = {"attention": attention, "expert": expert}
        groups = {kind: _rank_groups(self.world_size, order, layouts[where], inside)
                  for kind, (where, inside) in _KINDS.items()}
        expert_pp = _rank_groups(self.world_size, order, expert, ("pp",))
        if expert_pp != groups["pp"]:
            raise ValueError(
                f"order={self.order!r} gives different pp groups in the attention layout "
                f"(first {groups['pp'][0]}) and the expert layout (first {expert_pp[0]}); "
                f"they must be the same: put pp last in the order")
        # kind -> rank -> index of the rank's group, so group_of is a lookup, not a search
        index = {kind: [0] * self.world_size for kind in groups}
        for kind, gs in groups.items():
            for i, g in enumerate(gs):
                for r in g:
                    index[kind][r] = i
        set_(self, "_groups", groups)
        set_(self, "_group_index", index)

    def _order_names(self) -> list[str]:
        """The order's names, with names of size 1 it leaves out appended (slowest)."""
        if not isinstance(self.order, str):
            raise ValueError(f"order={self.order!r} must be a string like 'tp-cp-ep-dp-pp'")
        names = self.order.split("-")
        for n in names:
            if n not in ORDER_NAMES:
                raise ValueError(f"order={self.order!r} has unknown name {n!r}; "
                                 f"names are {' '.join(ORDER_NAMES)}")
            if names.count(n) > 1:
                raise ValueError(f"order={self.order!r} names {n!r} more than once")
        # each order name stands for these sizes (attention layout, then expert layout)
        stands_for = {"tp": ("tp", "etp"), "cp": ("cp",), "ep": ("ep",), "dp": ("dp", "edp"), "pp": ("pp",)}
        missing = [n for n in ORDER_NAMES if n not in names]
        for n in missing:
            for size_name in stands_for[n]:
                if getattr(self, size_name) > 1:
                    raise ValueError(f"order={self.order!r} leaves out {n!r} but "
                                     f"{size_name}={getattr(self, size_name)}; only a name whose "
                                     f"sizes are 1 may be left out")
        return names + missing

    @property
    def sizes(self) -> dict[str, int]:
        """Every parallel size by name: tp cp dp pp ep etp edp."""
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp,
                "ep": self.ep, "etp": self.etp, "edp": self.edp}

    def groups(self, name: str) -> list[list[int]]:
        """Every group of kind ``name`` (one of :data:`GROUP_NAMES`), each a list of global ranks."""
        _check_name(name)
        return [list(g) for g in self._groups[name]]

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} must be an integer in [0, world_size={self.world_size})")

    def group_of(self, name: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group of kind ``name``."""
        self._check_rank(rank)
        _check_name(name)
        return list(self._groups[name][self._group_index[name][rank]])

    def cp_subgroups(self, size: int) -> list[list[int]]:
        """Every sub-group of ``size`` consecutive cp ranks of every cp group (dynamic cp,
        :mod:`moe_fold.training.dynamic_cp`): cp group ``g`` gives ``g[0:size], g[size:2*size], ...``.
        ``size`` must divide cp."""
        _positive_int("size", size)
        if self.cp % size:
            raise ValueError(f"cp sub-group size={size} must divide cp={self.cp}")
        return [g[i:i + size] for g in self._groups["cp"] for i in range(0, self.cp, size)]

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinates: tp cp dp pp in the attention layout, etp ep edp in the expert layout."""
        self._check_rank(rank)
        return {name: self.group_of(name, rank).index(rank)
                for name in ("tp", "cp", "dp", "pp", "etp", "ep", "edp")}


class ProcessGroups:
    """One rank's torch process groups of every kind in :data:`GROUP_NAMES`.

    ``group(name)`` is None in :meth:`single_process`, which collectives treat as
    "no communication". ``timeout`` is the one the groups were created with; groups made
    later from these (pipeline embedding group, dynamic-cp sub-groups) take it too, so a
    hung peer fails them as fast as the rest.
    """

    def __init__(self, layout: ParallelLayout, rank: int, groups: dict[str, Optional["ProcessGroup"]],
                 timeout: Optional[datetime.timedelta] = None):
        layout._check_rank(rank)
        if set(groups) != set(GROUP_NAMES):
            raise ValueError(f"groups must have exactly the kinds {' '.join(GROUP_NAMES)}, "
                             f"got {' '.join(sorted(groups))}")
        self.layout = layout
        self.rank = rank
        self._groups = dict(groups)
        self.timeout = timeout

    @classmethod
    def single_process(cls) -> "ProcessGroups":
        """A world of one rank without torch.distributed: every size 1, every group None."""
        return cls(ParallelLayout(1), 0, {name: None for name in GROUP_NAMES})

    def group(self, name: str) -> Optional["ProcessGroup"]:
        _check_name(name)
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group of kind ``name``."""
        return self.layout.group_of(name, self.rank)

    def size(self, name: str) -> int:
        return len(self.ranks(name))

    def rank_in(self, name: str) -> int:
        """This rank's index in its group of kind ``name``."""
        return self.ranks(name).index(self.rank)

    tp = property(lambda self: self.group("tp"))
    cp = property(lambda self: self.group("cp"))
    dp = property(lambda self: self.group("dp"))
    pp = property(lambda self: self.group("pp"))
    dp_cp = property(lambda self: self.group("dp_cp"))
    tp_cp = property(lambda self: self.group("tp_cp"))
    tp_dp_cp = property(lambda self: self.group("tp_dp_cp"))
    ep = property(lambda self: self.group("ep"))
    etp = property(lambda self: self.group("etp"))
    etp_ep = property(lambda self: self.group("etp_ep"))
    edp = property(lambda self: self.group("edp"))

    def __repr__(self) -> str:
        return f"ProcessGroups(rank={self.rank}, {self.layout!r})"


def create_process_groups(layout: ParallelLayout, rank: Optional[int] = None,
                          timeout: Optional[datetime.timedelta] = None) -> ProcessGroups:
    """Create the torch process groups of ``layout`` and return this rank's.

    Every rank must call this with the same layout: torch requires every rank to take
    part in creating every group, in the same order. Each group gets
    ``group_desc=<kind>`` (so ``pg.group_desc`` says "tp", "ep", ...) and the default
    group's backend. ``timeout=None`` keeps torch's default for that backend.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("create_process_groups needs torch.distributed initialised "
                           "(dist.init_process_group) first")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"layout.world_size={layout.world_size} does not match the "
                         f"torch.distributed world size {world}")
    actual = dist.get_rank()
    if rank is None:
        rank = actual
    elif rank != actual:
        raise ValueError(f"rank={rank} is not this process's torch.distributed rank {actual}")
    mine: dict[str, Optional["ProcessGroup"]] = {}
    for name in GROUP_NAMES:
        for ranks in layout.groups(name):
            pg = dist.new_group(ranks, timeout=timeout, group_desc=name)
            if rank in ranks:
                mine[name] = pg
    return ProcessGroups(layout, rank, mine, timeout)
