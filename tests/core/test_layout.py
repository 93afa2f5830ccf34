"""Parallel layouts (attention and expert), their process groups and `moe-fold layout`."""

import datetime
import itertools

import pytest
import torch
import torch.distributed as dist

from moe_fold.config import ConfigError
from moe_fold.launch import run_ranks
from moe_fold.layout import GROUP_NAMES, ORDER_NAMES, ParallelLayout, ProcessGroups, create_process_groups

# ---------------------------------------------------------------------------
# Reference: Megatron-Core's rule written out directly. With the order's names
# n_0, n_1, ... (leftmost fastest) a rank is sum(coord[n_i] * stride[n_i]) with
# stride[n_i] = size[n_0] * ... * size[n_{i-1}]; a group of kind K holds the ranks
# that agree on every coordinate outside K. Groups are listed with the outside
# coordinates counted leftmost fastest.

# kind -> (layout, names varying inside a group)
KINDS = {
    "tp": ("attention", ["tp"]), "cp": ("attention", ["cp"]), "dp": ("attention", ["dp"]),
    "pp": ("attention", ["pp"]), "dp_cp": ("attention", ["cp", "dp"]),
    "tp_cp": ("attention", ["tp", "cp"]), "tp_dp_cp": ("attention", ["tp", "cp", "dp"]),
    "ep": ("expert", ["ep"]), "etp": ("expert", ["tp"]), "etp_ep": ("expert", ["tp", "ep"]),
    "edp": ("expert", ["dp"]),
}


def layout_sizes(world, tp, cp, pp, ep, etp):
    """Order-name sizes of both layouts."""
    return {
        "attention": {"tp": tp, "cp": cp, "ep": 1, "dp": world // (tp * cp * pp), "pp": pp},
        "expert": {"tp": etp, "cp": 1, "ep": ep, "dp": world // (etp * ep * pp), "pp": pp},
    }


def full_order(order):
    names = order.split("-")
    return names + [n for n in ORDER_NAMES if n not in names]


def reference_groups(order, sizes, inside):
    names = full_order(order)
    stride, s = {}, 1
    for n in names:
        stride[n] = s
        s *= sizes[n]
    outside = [n for n in names if n not in inside]
    groups = []
    # itertools.product counts its last argument fastest, so the outside names go reversed
    for out in itertools.product(*[range(sizes[n]) for n in reversed(outside)]):
        base = sum(c * stride[n] for c, n in zip(out, reversed(outside)))
        members = [base + sum(c * stride[n] for c, n in zip(inn, inside))
                   for inn in itertools.product(*[range(sizes[n]) for n in inside])]
        groups.append(sorted(members))
    return groups


def reference_rank(order, sizes, coords):
    stride, rank = 1, 0
    for n in full_order(order):
        rank += coords[n] * stride
        stride *= sizes[n]
    return rank


# ---------------------------------------------------------------------------
# Exact examples, worked by hand


def test_design_example_world8_tp2_ep4_etp1():
    # Attention: rank = tp + 2*dp (dp = 8/2 = 4). Expert (etp 1): rank = ep + 4*edp (edp = 8/4 = 2).
    layout = ParallelLayout(8, tp=2, ep=4, etp=1)
    assert (layout.dp, layout.edp) == (4, 2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("etp") == [[r] for r in range(8)]
    assert layout.groups("etp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("pp") == [[r] for r in range(8)]
    assert layout.groups("cp") == [[r] for r in range(8)]
    assert layout.groups("tp_dp_cp") == [list(range(8))]


def test_world8_tp2_ep4_default_etp_is_tp():
    # etp = tp = 2: expert rank = etp + 2*ep, so ep 4 x etp 2 fills the world and edp = 1.
    layout = ParallelLayout(8, tp=2, ep=4)
    assert (layout.etp, layout.edp) == (2, 1)
    assert layout.groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("ep") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("edp") == [[r] for r in range(8)]


def test_world8_tp2_cp2_ep8_etp1():
    # Attention: rank = tp + 2*cp + 4*dp (dp 2). Expert: rank = ep (ep 8, edp 1).
    layout = ParallelLayout(8, tp=2, cp=2, ep=8, etp=1)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("tp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("ep") == [list(range(8))]
    assert layout.groups("edp") == [[r] for r in range(8)]
    assert layout.coords(6) == {"tp": 0, "cp": 1, "dp": 1, "pp": 0, "etp": 0, "ep": 6, "edp": 0}


def test_world8_tp2_ep2_etp2():
    # Expert: rank = etp + 2*ep + 4*edp (edp = 8/4 = 2).
    layout = ParallelLayout(8, tp=2, ep=2, etp=2)
    assert layout.groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("etp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(5) == {"tp": 1, "cp": 0, "dp": 2, "pp": 0, "etp": 1, "ep": 0, "edp": 1}


def test_world8_tp2_pp2_ep2():
    # Attention: tp 2, dp = 8/(2*2) = 2, pp 2: rank = tp + 2*dp + 4*pp.
    # Expert: etp 2, ep 2, edp = 8/(2*2*2) = 1, pp 2: rank = etp + 2*ep + 4*pp.
    layout = ParallelLayout(8, tp=2, pp=2, ep=2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("tp_dp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("etp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("edp") == [[r] for r in range(8)]
    # rank 6 = 0 + 2*1 + 4*1
    assert layout.coords(6) == {"tp": 0, "cp": 0, "dp": 1, "pp": 1, "etp": 0, "ep": 1, "edp": 0}


def test_world16_tp2_cp2_pp2_ep4_etp1():
    # Attention: rank = tp + 2*cp + 4*dp + 8*pp (dp = 16/8 = 2).
    # Expert: rank = ep + 4*edp + 8*pp (edp = 16/(4*2) = 2).
    layout = ParallelLayout(16, tp=2, cp=2, pp=2, ep=4, etp=1)
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert layout.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert layout.groups("pp") == [[r, r + 8] for r in range(8)]
    assert layout.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    # rank 13 = 1 + 2*0 + 4*1 + 8*1 (attention) = 1 + 4*1 + 8*1 (expert)
    assert layout.coords(13) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1, "etp": 0, "ep": 1, "edp": 1}


def test_order_puts_ep_fastest():
    # Order ep-tp-cp-dp-pp. Attention (ep 1): rank = tp + 2*dp.
    # Expert: rank = ep + 2*etp + 4*edp.
    layout = ParallelLayout(8, tp=2, ep=2, order="ep-tp-cp-dp-pp")
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("etp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_order_may_leave_out_names_of_size_one():
    assert ParallelLayout(8, tp=2, order="tp-dp").groups("dp") == ParallelLayout(8, tp=2).groups("dp")


def test_group_of_and_sizes():
    layout = ParallelLayout(8, tp=2, cp=2, ep=4, etp=1)
    assert layout.sizes == {"tp": 2, "cp": 2, "dp": 2, "pp": 1, "ep": 4, "etp": 1, "edp": 2}
    assert layout.group_of("cp", 5) == [5, 7]
    assert layout.group_of("ep", 5) == [4, 5, 6, 7]
    assert layout.group_of("edp", 5) == [1, 5]
    groups = layout.groups("tp")
    groups[0].append(99)  # callers get copies: the layout cannot be changed through them
    assert layout.groups("tp")[0] == [0, 1]


# ---------------------------------------------------------------------------
# Properties over many layouts


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_layouts(world):
    for tp, cp, pp, ep, etp in itertools.product(divisors(world), repeat=5):
        if world % (tp * cp * pp) == 0 and world % (etp * ep * pp) == 0:
            yield tp, cp, pp, ep, etp


def check_against_reference(layout, order):
    w = layout.world_size
    sizes = layout_sizes(w, layout.tp, layout.cp, layout.pp, layout.ep, layout.etp)
    for kind, (where, inside) in KINDS.items():
        groups = layout.groups(kind)
        assert groups == reference_groups(order, sizes[where], inside), (layout, kind)
        assert sorted(r for g in groups for r in g) == list(range(w)), (layout, kind)  # a partition
    assert layout.tp * layout.cp * layout.dp * layout.pp == w
    assert layout.etp * layout.ep * layout.edp * layout.pp == w
    for rank in range(w):
        c = layout.coords(rank)
        attention = {"tp": c["tp"], "cp": c["cp"], "ep": 0, "dp": c["dp"], "pp": c["pp"]}
        expert = {"tp": c["etp"], "cp": 0, "ep": c["ep"], "dp": c["edp"], "pp": c["pp"]}
        assert reference_rank(order, sizes["attention"], attention) == rank
        assert reference_rank(order, sizes["expert"], expert) == rank
        for kind in GROUP_NAMES:
            group = layout.group_of(kind, rank)
            assert rank in group
            if kind in c:  # a one-dimension kind: the coordinate is the position in the group
                assert group.index(rank) == c[kind]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12, 16, 32, 64])
def test_every_valid_layout_matches_reference(world):
    combos = list(valid_layouts(world))
    if world == 64:
        combos = combos[::7]  # ~230 of the 1596, spread over all sizes, keeps this fast
    for tp, cp, pp, ep, etp in combos:
        check_against_reference(ParallelLayout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp), "tp-cp-ep-dp-pp")


def test_every_order_matches_reference_or_is_refused():
    world, tp, cp, pp, ep, etp = 16, 2, 2, 2, 2, 1
    sizes = layout_sizes(world, tp, cp, pp, ep, etp)
    accepted = 0
    for names in itertools.permutations(ORDER_NAMES):
        order = "-".join(names)
        same_pp = (reference_groups(order, sizes["attention"], ["pp"])
                   == reference_groups(order, sizes["expert"], ["pp"]))
        if same_pp:
            check_against_reference(ParallelLayout(world, tp, cp, pp, ep, etp, order=order), order)
            accepted += 1
        else:
            with pytest.raises(ValueError, match="different pp groups"):
                ParallelLayout(world, tp, cp, pp, ep, etp, order=order)
    assert 0 < accepted < 120


def test_world12_construction_succeeds_exactly_when_sizes_divide():
    world = 12
    for tp, cp, pp, ep, etp in itertools.product([1, 2, 3, 4, 5], [1, 2, 3], [1, 2, 4], [1, 3, 6, 8], [1, 2]):
        ok = world % (tp * cp * pp) == 0 and world % (etp * ep * pp) == 0
        if ok:
            ParallelLayout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
        else:
            with pytest.raises(ValueError, match="is not divisible by"):
                ParallelLayout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)


# ---------------------------------------------------------------------------
# Refused layouts: the message names the value and the rule


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=8, tp=3, etp=1), "world_size=8 is not divisible by parallel.tp*cp*pp=3 (tp=3, cp=1, pp=1)"),
    (dict(world_size=8, tp=2, cp=2, pp=4), "world_size=8 is not divisible by parallel.tp*cp*pp=16 (tp=2, cp=2, pp=4)"),
    (dict(world_size=8, tp=2, ep=8),
     "world_size=8 is not divisible by parallel.etp*ep*pp=16 (etp=null -> tp=2, ep=8, pp=1)"),
    (dict(world_size=12, ep=5), "world_size=12 is not divisible by parallel.etp*ep*pp=5 (etp=null -> tp=1, ep=5, pp=1)"),
    (dict(world_size=0), "world_size=0 must be a positive integer"),
    (dict(world_size=8, ep=0), "ep=0 must be a positive integer"),
    (dict(world_size=8, etp=-2), "etp=-2 must be a positive integer"),
    (dict(world_size=8, tp=2.0), "tp=2.0 must be a positive integer"),
    (dict(world_size=8, order="tp-cp-ep-xp-pp"), "order='tp-cp-ep-xp-pp' has unknown name 'xp'; names are tp cp ep dp pp"),
    (dict(world_size=8, order="tp-tp-dp"), "order='tp-tp-dp' names 'tp' more than once"),
    (dict(world_size=8, ep=2, order="tp-cp-dp-pp"), "order='tp-cp-dp-pp' leaves out 'ep' but ep=2; only a name whose sizes are 1 may be left out"),
    (dict(world_size=8, etp=2, order="cp-ep-dp-pp"), "order='cp-ep-dp-pp' leaves out 'tp' but etp=2; only a name whose sizes are 1 may be left out"),
    (dict(world_size=8, tp=2, pp=2, etp=1, ep=2, order="tp-pp-cp-ep-dp"),
     "order='tp-pp-cp-ep-dp' gives different pp groups in the attention layout (first [0, 2]) and the expert "
     "layout (first [0, 1]); they must be the same: put pp last in the order"),
])
def test_refused_layouts(kwargs, message):
    with pytest.raises(ValueError) as err:
        ParallelLayout(**kwargs)
    # A rule of the config registry raises a ConfigError listing its problems (one here).
    problems = err.value.problems if isinstance(err.value, ConfigError) else [str(err.value)]
    assert problems == [message]


def test_bad_names_and_ranks():
    layout = ParallelLayout(4, tp=2)
    with pytest.raises(ValueError, match=r"group name 'xx' is unknown; names are tp cp dp pp dp_cp"):
        layout.groups("xx")
    with pytest.raises(ValueError, match=r"rank=4 must be an integer in \[0, world_size=4\)"):
        layout.coords(4)
    with pytest.raises(ValueError, match=r"rank=-1 must be an integer"):
        layout.group_of("tp", -1)


# ---------------------------------------------------------------------------
# Process groups


def test_single_process_groups():
    pgs = ProcessGroups.single_process()
    assert pgs.rank == 0 and pgs.layout.world_size == 1
    for name in GROUP_NAMES:
        assert pgs.group(name) is None and getattr(pgs, name) is None
        assert (pgs.size(name), pgs.rank_in(name), pgs.ranks(name)) == (1, 0, [0])


def test_create_process_groups_needs_initialised_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        create_process_groups(ParallelLayout(1))


def _groups_on_rank(rank, world_size, layouts):
    out = {}
    for layout in layouts:
        pgs = create_process_groups(layout, timeout=datetime.timedelta(seconds=60))
        seen = {}
        for name in GROUP_NAMES:
            pg = pgs.group(name)
            assert getattr(pgs, name) is pg
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=pg)
            seen[name] = {
                "ranks": pgs.ranks(name), "size": pgs.size(name), "rank_in": pgs.rank_in(name),
                "torch_size": dist.get_world_size(pg), "torch_rank": dist.get_rank(pg),
                "desc": pg.group_desc, "backend": dist.get_backend(pg), "sum": t.item(),
            }
        out[repr(layout)] = seen
    errors = []
    for bad in (lambda: create_process_groups(ParallelLayout(2 * world_size)),
                lambda: create_process_groups(layouts[0], rank=(rank + 1) % world_size)):
        try:
            bad()
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


@pytest.mark.parametrize("world, layouts", [
    (4, [ParallelLayout(4, tp=2, pp=2, ep=2, etp=1), ParallelLayout(4, cp=2, ep=4, etp=1)]),
    (8, [ParallelLayout(8, tp=2, cp=2, ep=4, etp=1), ParallelLayout(8, tp=2, pp=2, ep=2),
         ParallelLayout(8, tp=2, ep=2, order="ep-tp-cp-dp-pp")]),
])
def test_create_process_groups_on_real_ranks(world, layouts):
    results = run_ranks(_groups_on_rank, world, layouts, timeout=120)
    for rank, out in enumerate(results):
        for layout in layouts:
            for name in GROUP_NAMES:
                got = out[repr(layout)][name]
                group = layout.group_of(name, rank)
                assert got["ranks"] == group
                assert got["size"] == got["torch_size"] == len(group)
                assert got["rank_in"] == got["torch_rank"] == group.index(rank)
                assert got["desc"] == name and got["backend"] == "gloo"
                assert got["sum"] == sum(group), (layout, name, rank)
        assert out["errors"] == [
            f"layout.world_size={2 * world} does not match the torch.distributed world size {world}",
            f"rank={(rank + 1) % world} is not this process's torch.distributed rank {rank}",
        ]


# ---------------------------------------------------------------------------
# moe-fold layout


def table_rows(text):
    """Rows of every rich table in ``text``, by the heading line printed before the table."""
    sections, heading = {}, None
    for line in text.splitlines():
        if line.startswith("│"):
            sections[heading].append([cell.strip() for cell in line.strip("│").split("│")])
        elif line and line[0] not in "┏┃┡└":
            heading = line.split(":")[0]
            sections[heading] = []
    return sections


def test_cli_prints_both_layouts(capsys, monkeypatch):
    from moe_fold.cli import main

    monkeypatch.setenv("COLUMNS", "120")  # rich wraps at the terminal width; keep each row on one line

    assert main(["layout", "--world", "8", "--tp", "2", "--ep", "4", "--etp", "1"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "attention layout: tp 2 x cp 1 x dp 4 x pp 1 = 8" in out
    assert "expert layout: etp 1 x ep 4 x edp 2 x pp 1 = 8" in out
    rows = table_rows(out)
    # rank, tp, cp, dp, pp: rank = tp + 2*dp
    assert rows["attention layout"] == [[str(r), str(r % 2), "0", str(r // 2), "0"] for r in range(8)]
    # rank, etp, ep, edp, pp: rank = ep + 4*edp
    assert rows["expert layout"] == [[str(r), "0", str(r % 4), str(r // 4), "0"] for r in range(8)]
    singles = "{0} {1} {2} {3} {4} {5} {6} {7}"
    assert rows["attention groups"] == [
        ["tp", "2", "{0,1} {2,3} {4,5} {6,7}"], ["cp", "1", singles], ["dp", "4", "{0,2,4,6} {1,3,5,7}"],
        ["pp", "1", singles], ["dp_cp", "4", "{0,2,4,6} {1,3,5,7}"], ["tp_cp", "2", "{0,1} {2,3} {4,5} {6,7}"],
        ["tp_dp_cp", "8", "{0,1,2,3,4,5,6,7}"]]
    assert rows["expert groups"] == [
        ["etp", "1", singles], ["ep", "4", "{0,1,2,3} {4,5,6,7}"], ["edp", "2", "{0,4} {1,5} {2,6} {3,7}"],
        ["pp", "1", singles], ["etp_ep", "4", "{0,1,2,3} {4,5,6,7}"]]


@pytest.mark.parametrize("argv, message", [
    (["--world", "8", "--tp", "3"], "invalid config: 2 problems\n"
                                    "  - world_size=8 is not divisible by parallel.tp*cp*pp=3 (tp=3, cp=1, pp=1)\n"
                                    "  - world_size=8 is not divisible by parallel.etp*ep*pp=3 "
                                    "(etp=null -> tp=3, ep=1, pp=1)"),
    (["--world", "8", "--tp", "2", "--ep", "8"], "invalid config: 1 problem\n  - world_size=8 is not divisible by "
                                                 "parallel.etp*ep*pp=16 (etp=null -> tp=2, ep=8, pp=1)"),
    (["--world", "8", "--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1", "--order", "tp-pp-cp-ep-dp"],
     "order='tp-pp-cp-ep-dp' gives different pp groups in the attention layout (first [0, 2]) and the "
     "expert layout (first [0, 1]); they must be the same: put pp last in the order"),
])
def test_cli_refuses_impossible_layouts(capsys, argv, message):
    from moe_fold.cli import main

    assert main(["layout", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"moe-fold layout: error: {message}\n"


def test_cli_help_has_examples(capsys):
    from moe_fold.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["layout", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "Print the attention and expert layouts of a world" in out
    assert "examples:\n  moe-fold layout --world 8 --tp 2 --ep 4" in out
