"""The benchmark suite's plumbing (bench/suite.py, table.py, plots.py, ``python -m bench``).

Benchmarks are not tests: no timing is asserted. What is asserted: which cases run, how a
case's output becomes records (and a failing case an error record), the results file's
start/end records, the table's rows and ratio fields, the plots' points, and finding the
command line, which is ``python -m bench`` from a checkout (no installed command reaches outside the package).
"""

import json
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
from rich.console import Console

from tests.helpers.paths import REPO

from bench import __main__ as bench_main
from bench import plots, suite, table

from moe_fold import cli

RATIO_FIELDS = {"dispatch": "bytes_sent/bytes_min", "gemm": "ratio_to_dense", "permute": "ratio_to_copy",
                "moe_layer": "ratio_vs_hf", "pipeline_bubble": "idle vs theory",
                "cp_attention": "ratio_to_single", "dynamic_cp": "time_ratio", "placement": "busiest_over_mean",
                "overlap": "exposed_fraction", "train": "ratio_vs_hf", "checkpoint": "ratio_async_to_sync"}


@pytest.mark.parametrize("size", ["smoke", "quick", "full"])
def test_every_size_runs_every_benchmark_script(size):
    cases = suite.cases(size)
    assert {c.bench for c in cases} == set(suite.BENCHES)
    for c in cases:
        assert (REPO / "bench" / f"{c.bench}.py").is_file()
        assert all(isinstance(flag, str) for flag in c.flags)
    assert len({(c.bench, c.name) for c in cases}) == len(cases)


def test_full_sweeps_ep_and_tokens_per_expert():
    full = suite.cases("full")
    eps = {c.flags[c.flags.index("--ep") + 1] for c in full if c.bench == "dispatch"}
    assert eps == {"1", "2", "4"}
    tokens = [c.flags[c.flags.index("--tokens") + 1] for c in full if c.bench == "gemm"]
    assert len(tokens) == len(set(tokens)) >= 3


def test_select_and_bad_names():
    all_cases = suite.cases("quick")
    chosen = suite.select(all_cases, "gemm,permute")
    assert chosen and {c.bench for c in chosen} == {"gemm", "permute"}
    assert suite.select(all_cases, None) == all_cases
    with pytest.raises(ValueError, match="--only 'gemmm': gemmm is not a benchmark; choose from dispatch"):
        suite.select(all_cases, "gemmm")
    with pytest.raises(ValueError, match="size='huge'"):
        suite.cases("huge")


def _fake_case(tmp_path, body: str) -> suite.Case:
    """A benchmark ``bench.fake`` in ``tmp_path / "bench"`` (what run_case takes as bench/)."""
    (tmp_path / "bench").mkdir(exist_ok=True)
    (tmp_path / "bench" / "fake.py").write_text(body)
    return suite.Case("fake", "one", ("--n", "2"))


def test_run_case_parses_json_lines_and_passes_flags(tmp_path):
    case = _fake_case(tmp_path, "import json, sys\n"
                                "n = int(sys.argv[sys.argv.index('--n') + 1])\n"
                                "print('progress on stderr', file=sys.stderr)\n"
                                "for i in range(n):\n"
                                "    print(json.dumps({'bench': 'fake', 'i': i, 'ms': 1.5}))\n"
                                "print()\n")
    records = suite.run_case(case, tmp_path / "bench", {}, timeout=60)
    assert records == [{"bench": "fake", "i": 0, "ms": 1.5}, {"bench": "fake", "i": 1, "ms": 1.5}]


@pytest.mark.parametrize("body, message", [
    ("import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n", "exit code 3: boom"),
    ("print('not json')\n", "not JSON: 'not json'"),
    ("print('[1, 2]')\n", "not a record with a 'bench' field"),
    ("pass\n", "printed no records"),
    ("import time\ntime.sleep(30)\n", "still running after --timeout 0.5 s"),
])
def test_run_case_failures_say_why(tmp_path, body, message):
    case = _fake_case(tmp_path, body)
    with pytest.raises(suite.BenchError, match=message.replace("[", r"\[").replace("(", r"\(")):
        suite.run_case(case, tmp_path / "bench", {}, timeout=0.5 if "sleep" in body else 60)


def test_timeout_stops_the_processes_the_benchmark_spawned(tmp_path):
    pid_file = tmp_path / "pid"
    case = _fake_case(tmp_path, "import subprocess, sys, time\n"
                                "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                                f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                                "time.sleep(60)\n")
    with pytest.raises(suite.BenchError, match="still running after --timeout 5 s"):
        suite.run_case(case, tmp_path / "bench", {}, timeout=5)
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    for _ in range(100):  # killed at once; its new parent may take a moment to reap it
        if not stat.exists() or stat.read_text().split(") ")[1].startswith("Z"):
            break
        time.sleep(0.05)
    assert not stat.exists() or stat.read_text().split(") ")[1].startswith("Z")


def test_missing_script_is_an_error(tmp_path):
    with pytest.raises(suite.BenchError, match="nothere.py does not exist"):
        suite.run_case(suite.Case("nothere", "x", ()), tmp_path, {}, timeout=5)


def _args(**kw):
    base = dict(only=None, size="smoke", out=None, no_plots=True, timeout=600.0, list=False)
    return Namespace(**{**base, **kw})


def test_failing_case_becomes_an_error_record_and_exit_code(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    # Every case stopped by the timeout: the suite goes on, records why, and returns 1.
    assert suite.run(_args(only="gemm,permute", out=str(out), timeout=0.01), REPO) == 1
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    start, end = lines[0], lines[-1]
    assert start["bench"] == "suite" and start["event"] == "start" and start["size"] == "smoke"
    assert start["benches"] == ["gemm", "permute"] and start["cases"] == 2
    assert len(start["load_avg"]) == 3 and start["cpus"] >= 1 and start["torch"]
    errors = lines[1:-1]
    assert [r["bench"] for r in errors] == ["gemm", "permute"]
    assert all("still running after --timeout" in r["error"] and r["suite_case"] for r in errors)
    assert end["event"] == "end" and [c["error"] is not None for c in end["cases"]] == [True, True]
    printed = capsys.readouterr().out
    assert "load average" in printed and "2 cases failed" in printed
    assert table.rows(lines)[0][:4] == ("gemm", errors[0]["suite_case"], "-", "error")


def test_list_and_bad_only_print_and_exit(capsys):
    assert suite.run(_args(list=True, only="cp_attention"), REPO) == 0
    printed = capsys.readouterr().out
    assert "python -m bench.cp_attention --seq 64" in printed and "gemm" not in printed
    assert suite.run(_args(only="nope"), REPO) == 2
    assert "nope is not a benchmark" in capsys.readouterr().out


def _dispatch_record(**kw):
    r = {"bench": "dispatch", "dispatcher": "alltoall", "mode": "dropless", "routing": "balanced", "tokens": 100,
         "hidden": 8, "experts": 8, "topk": 2, "ep": 2, "etp": 1, "world": 2, "zipf_s": None, "ms": 3.0,
         "bytes_sent": 3072, "bytes_min": 2048, "rows_per_rank_max": 200, "permute_ratio_to_copy": 4.0}
    return {**r, **kw}


def test_table_rows_name_each_ratio():
    records = [
        {"bench": "suite", "event": "start"},
        _dispatch_record(routing="zipf", zipf_s=1.2, ep=4),
        _dispatch_record(ep=1, bytes_sent=0, bytes_min=0),
        {"bench": "gemm", "backend": "auto", "resolved": "torch", "routing": "skewed", "tokens_per_expert_mean": 64.0,
         "hidden": 32, "ffn": 32, "experts": 4, "dtype": "float32", "ms": 2.0, "ratio_to_dense": 0.5},
        {"bench": "moe_layer", "tokens": 64, "hidden": 32, "ffn": 64, "experts": 4, "topk": 2, "candidate": "hf:x",
         "skipped": "ImportError: no"},
        {"bench": "moe_layer", "tokens": 64, "hidden": 32, "ffn": 64, "experts": 4, "topk": 2,
         "ms": {"ours": 4.0}, "best_hf": "grouped_mm", "ratio_vs_hf": 1.1, "overhead_vs_dense": 1.3,
         "gemm_overhead_vs_dense": 1.2, "ratio_vs_megatron": 1.05},
        {"bench": "moe_layer", "tokens": 64, "hidden": 32, "ffn": 64, "experts": 4, "topk": 2, "ep": 2,
         "ms": {"ours": 5.0, "megatron": 6.0}, "ratio_vs_megatron": 1.2},
        {"bench": "train", "preset": "p", "micro_batch": 2, "seq_length": 32, "tokens_per_step": 64,
         "tokens_per_s": 6400.0, "ratio_vs_hf": 1.25, "flops_fraction_of_matmul": 0.1,
         "flops_fraction_ceiling": 0.5},
        {"bench": "newbench", "suite_case": "c", "ms": 1.0, "ratio_to_x": 2.0, "other": 3},
        {"bench": "permute", "suite_case": "t9", "ms": 2.0, "ratio_to_copy": 3.0},
    ]
    rows = table.rows(records)
    assert [r[0] for r in rows] == ["dispatch", "dispatch", "gemm", "moe_layer", "moe_layer", "moe_layer", "train",
                                    "newbench", "permute"]
    zipf, ep1, gemm, skipped, layer, layer_ep2, train, other, changed = rows
    assert changed[1:4] == ("t9", "2.00", "ratio_to_copy 3\n")  # line i of ratio and meaning go together
    assert changed[4].splitlines() == ["", "(no permute layout for this record: it has no field 'backend')"]
    assert zipf[1] == "alltoall dropless zipf s=1.2 ep4 T100 H8 E8 k2" and zipf[2] == "3.00"
    assert zipf[3].splitlines() == ["bytes_sent/bytes_min 1.5 (3.0 KiB / 2.0 KiB)", "permute_ratio_to_copy 4"]
    assert ep1[3].splitlines()[0] == "bytes_sent/bytes_min - (0.0 KiB / 0.0 KiB)"
    assert gemm[1].startswith("auto->torch skewed 64 tok/expert") and gemm[3] == "ratio_to_dense 0.5"
    assert skipped[2:] == ("-", "skipped", "ImportError: no")
    assert layer[1:3] == ("64x32x64x4x2", "4.00")
    assert layer[3].splitlines() == ["ratio_vs_hf 1.1", "ratio_vs_megatron 1.05", "overhead_vs_dense 1.3",
                                     "gemm_overhead_vs_dense 1.2"]
    assert layer_ep2[1:4] == ("64x32x64x4x2 ep2", "5.00", "ratio_vs_megatron 1.2")
    assert train[2] == "10.00" and train[3].splitlines() == ["ratio_vs_hf 1.25", "flops_fraction_of_matmul 0.1",
                                                             "flops_fraction_ceiling 0.5"]
    assert other[1:4] == ("c", "1.00", "ratio_to_x 2")
    assert all(len(r) == len(table.COLUMNS) for r in rows)
    console = Console(width=200, record=True)
    console.print(table.render(records + [{"bench": "gemm", "suite_case": "t1", "error": "exit code 1: [/red] [b]"}]))
    assert "exit code 1: [/red] [b]" in console.export_text()  # a benchmark's text is not markup


def test_overlap_rows_put_the_planner_next_to_the_measurement():
    on = {"bench": "overlap", "kind": "dp_grads", "preset": "p", "world": 4, "ms": 5.0, "exposed_fraction": 0.25,
          "planner_exposed_fraction": 0.1, "step_ratio": 1.2}
    off_only = {"bench": "overlap", "kind": "ep_alltoall", "preset": "p", "world": 4, "ms": 6.0,
                "exposed_fraction": 1.0}
    first, second = table.rows([on, off_only])
    assert first[1:4] == ("dp_grads p world 4", "5.00",
                          "exposed_fraction 0.25\nplanner_exposed_fraction 0.1\nstep_ratio 1.2")
    assert second[3] == "exposed_fraction 1"


def test_plot_series_pick_their_points():
    records = [
        _dispatch_record(ep=4, ms=9.0, bytes_sent=40, bytes_min=30),
        _dispatch_record(ep=2, ms=5.0, bytes_sent=20, bytes_min=10),
        _dispatch_record(ep=4, routing="zipf", zipf_s=1.2, rows_per_rank_max=500, ms=12.0),
        _dispatch_record(ep=4, mode="capacity", ms=1.0),
        {"bench": "dispatch", "error": "exit code 1"},
        {"bench": "gemm", "backend": "torch", "routing": "balanced", "tokens_per_expert_mean": 256.0,
         "ratio_to_dense": 0.9},
        {"bench": "gemm", "backend": "torch", "routing": "balanced", "tokens_per_expert_mean": 16.0,
         "ratio_to_dense": 0.4},
    ]
    assert plots.dispatch_ep_series(records) == {"alltoall": [(2, 5.0, 20, 10), (4, 9.0, 40, 30)]}
    assert plots.gemm_series(records) == {"torch balanced": [(16.0, 0.4), (256.0, 0.9)]}
    # Busiest rank's rows over tokens * topk (= 200 rows per rank on average).
    assert plots.skew_series(records) == {"alltoall ep2": [(1.0, 5.0, "balanced")],
                                          "alltoall ep4": [(1.0, 9.0, "balanced"), (2.5, 12.0, "zipf s=1.2")]}


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_smoke_suite_from_the_command_line(tmp_path):
    """``python -m bench`` at the smoke size, as a user runs it, on the two one-process benchmarks."""
    out = tmp_path / "run.jsonl"
    proc = subprocess.run([sys.executable, "-m", "bench", "--size", "smoke", "--only", "gemm,permute",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert (lines[0]["event"], lines[-1]["event"]) == ("start", "end")
    records = lines[1:-1]
    gemm = [r for r in records if r["bench"] == "gemm"]
    permute = [r for r in records if r["bench"] == "permute"]
    assert len(gemm) + len(permute) == len(records)
    assert {r["backend"] for r in gemm} >= {"torch", "loop"} and {r["pass"] for r in permute} == {
        "forward", "forward_backward"}
    for r in records:
        assert r["suite_flags"] == list(next(c.flags for c in suite.cases("smoke") if c.bench == r["bench"]))
        assert r["ms"] > 0
    assert all(r["ratio_to_dense"] > 0 and r["tokens_per_expert_mean"] == 16 for r in gemm)
    assert all(r["ratio_to_copy"] > 0 for r in permute)
    assert [c["records"] for c in lines[-1]["cases"]] == [len(gemm), len(permute)]
    for column in table.COLUMNS:
        assert column in proc.stdout
    assert "ratio_to_dense" in proc.stdout and "ratio_to_copy" in proc.stdout and "load average" in proc.stdout
    png = Path(f"{out.with_suffix('')}_gemm_efficiency.png")
    if _has_matplotlib():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "no dispatch_ep plot: no dropless balanced dispatch records" in proc.stdout
    else:  # the bench extra is not installed: said, not hidden
        assert not png.exists() and "no plots: matplotlib is not installed" in proc.stdout


@pytest.mark.slow
def test_every_benchmark_at_smoke_size(tmp_path):
    """Every benchmark runs through the suite and each row carries its ratio field."""
    out = tmp_path / "all.jsonl"
    assert suite.run(_args(out=str(out), no_plots=False), REPO) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()][1:-1]
    assert {r["bench"] for r in records} == set(suite.BENCHES)
    assert not [r for r in records if "error" in r]
    rows = table.rows(records)
    for bench, field in RATIO_FIELDS.items():
        assert any(r[0] == bench and r[3].startswith(field) for r in rows), bench
    if _has_matplotlib():
        assert Path(f"{out.with_suffix('')}_dispatch_skew.png").is_file()


def test_python_m_bench_is_the_entry_point_and_the_installed_command_has_none(capsys):
    for flags, size in (([], "full"), (["--quick"], "quick"), (["--size", "smoke"], "smoke")):
        assert bench_main.main(["--list", "--only", "gemm", *flags]) == 0
        listed = [line.split(None, 2)[2] for line in capsys.readouterr().out.splitlines()]
        assert listed == [f"python -m bench.{c.bench} {' '.join(c.flags)}" for c in suite.cases(size) if c.bench == "gemm"]
    proc = subprocess.run([sys.executable, "-m", "bench", "--list", "--only", "permute"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() and all(line.startswith("permute") for line in proc.stdout.splitlines())
    # The installed moe-fold command never imports from the checkout (bench/ is not in the wheel).
    assert "bench" not in cli.COMMANDS
    with pytest.raises(SystemExit):
        cli.main(["bench", "--list"])