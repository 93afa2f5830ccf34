"""Restart cost: what a restart of `moe-fold train --nproc N --resume` spends before its
first step is done, phase by phase.

    python bench/restart_cost.py [--nproc 2 --rounds 5 --preset mixtral-tiny --set KEY=VALUE ...]
                                 [--tree OTHER_CHECKOUT ...]

A run folder with a checkpoint of step 2 is made once (``moe-fold train``); each round then
copies it and times a real ``python -m moe_fold.cli train --nproc N --resume`` on it, with
``train.steps=3``, from the launch of the process to the end of its first step. The
process is not changed, only observed: a ``sitecustomize`` (on PYTHONPATH) notes the time
at which the interpreter reaches Python code, and wraps a few functions (by name, in the
launcher and in rank 0) to note when they start or end. The phases (seconds, medians over
the rounds):

- ``interpreter``: from the launch (``subprocess.Popen``) to the first Python code of ours;
- ``launcher``: from then to the ranks' start (``run_ranks``): the CLI's imports, the config,
  its validation and the dataset check;
- ``spawn+pg``: from ``run_ranks`` to rank 0's code: the processes (a forkserver that
  imports torch), the store and the default process group;
- ``rank imports``: rank 0 importing the training stack (``moe_fold.cli.train._rank_main``
  until ``train``);
- ``groups``: from ``train`` to the end of ``build_groups`` (the layout's process groups);
- ``data``: to ``build_model`` (the dataset, memory-mapped from the cache);
- ``model``: the model, the optimizer, the routing collectors: to ``load_checkpoint``;
- ``load``: ``load_checkpoint``;
- ``first step``: from the loaded checkpoint to the first step's record (``MetricsLogger.log``);
- ``total``: launch to that record.

``--tree DIR`` (repeatable) times the same restart with the code of another checkout
(``git archive REV | tar -x -C DIR``), rounds interleaved with this one's; the table has
one row per tree and the ratios of their medians (the machine may be loaded: interleaving
spreads the noise over both). Prints the table and one JSON line per tree,
``{"bench": "restart_cost", "tree": ..., "<phase>_s": median, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["interpreter", "launcher", "spawn+pg", "rank imports", "groups", "data", "model", "load", "first step",
          "total"]
# (phase, the mark that ends it); each phase starts where the one before ended.
_MARKS = [("interpreter", "python"), ("launcher", "run_ranks"), ("spawn+pg", "rank"),
          ("rank imports", "train"), ("groups", "build_groups_end"), ("data", "build_model"),
          ("model", "load_checkpoint"), ("load", "load_checkpoint_end"), ("first step", "first_log")]

# Installed as sitecustomize: imported by every interpreter of the run (the launcher, the
# forkserver and through it the ranks) before any of our code. It maps the moe_fold
# packages to the tree under test and notes marks into MOE_FOLD_RESTART_MARKS.
_SITECUSTOMIZE = textwrap.dedent('''
    import os, sys, time
    _marks = os.environ.get("MOE_FOLD_RESTART_MARKS")
    if _marks:
        _python = time.time()
        import functools, importlib.abc, importlib.util, json

        _tree = os.environ["MOE_FOLD_RESTART_TREE"]
        # pyproject.toml's package-dir: the folders of the tree under test.
        _map = {"moe_fold": "moe_fold", "moe_fold.dispatch": "dispatch", "moe_fold.kernels": "kernels",
                "moe_fold.models": "models"}

        class _Tree(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name not in _map:
                    return None
                where = os.path.join(_tree, _map[name])
                return importlib.util.spec_from_file_location(name, os.path.join(where, "__init__.py"),
                                                              submodule_search_locations=[where])

        sys.meta_path.insert(0, _Tree())

        def _note(name, when=None):
            with open(_marks, "a") as f:
                f.write(json.dumps({"mark": name, "t": when or time.time(), "pid": os.getpid()}) + "\\n")

        def _wrap(module, owner, attr, start=None, end=None, once=True):
            """Notes ``start`` when owner.attr is called and ``end`` when it returns."""
            target = getattr(owner, attr)
            done = []

            @functools.wraps(target)  # its name: the launcher pickles _rank_main by name
            def run(*args, **kwargs):
                first = not done
                done.append(1)
                if start and (first or not once):
                    _note(start)
                out = target(*args, **kwargs)
                if end and (first or not once):
                    _note(end)
                return out
            setattr(owner, attr, run)

        def _fail_once(module):
            """--warm: the first rank to train raises, once per run (an exclusive file)."""
            flag = os.environ.get("MOE_FOLD_RESTART_FAIL_ONCE")
            if not flag:
                return
            target = module.train

            @functools.wraps(target)
            def train(*args, **kwargs):
                try:
                    open(flag, "x").close()
                except FileExistsError:
                    return target(*args, **kwargs)
                _note("failed")
                raise RuntimeError("restart_cost: the planted failure of the first attempt")
            module.train = train

        class _Hooks(importlib.abc.MetaPathFinder):
            """Wraps functions of our modules as they are imported."""
            hooks = {
                "moe_fold.launch": lambda m: _wrap(m, m, "run_ranks", start="run_ranks"),
                "moe_fold.cli.train": lambda m: _wrap(m, m, "_rank_main", start="rank"),
                "moe_fold.training.train": lambda m: (_fail_once(m), _wrap(m, m, "train", start="train"),
                                                      _wrap(m, m, "build_groups", end="build_groups_end")),
                "moe_fold.models.model": lambda m: _wrap(m, m, "build_model", start="build_model"),
                "moe_fold.training.checkpoint": lambda m: _wrap(m, m, "load_checkpoint", start="load_checkpoint",
                                                                end="load_checkpoint_end"),
                "moe_fold.training.metrics": lambda m: _wrap(m, m.MetricsLogger, "log", end="first_log"),
            }

            def find_spec(self, name, path=None, target=None):
                if name not in self.hooks:
                    return None
                for finder in sys.meta_path:
                    if finder is self:
                        continue
                    spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
                    if spec is not None:
                        break
                else:
                    return None
                loader, hook = spec.loader, self.hooks[name]

                class Loader(importlib.abc.Loader):
                    def create_module(self, spec):
                        return loader.create_module(spec)

                    def exec_module(self, module):
                        loader.exec_module(module)
                        hook(module)
                spec.loader = Loader()
                return spec

        sys.meta_path.insert(0, _Hooks())
        _note("python", _python)  # every interpreter; the launcher's is told by its pid
''')


def _run(cmd, env, what):
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{what} failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return out


def _cli(preset, nproc, run_dir, cache_dir, sets, *extra):
    sets = [f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", "wandb.mode=disabled", *sets]
    return [sys.executable, "-m", "moe_fold.cli", "train", "--config", preset, "--nproc", str(nproc), "--no-progress",
            *[a for s in sets for a in ("--set", s)], *extra]


def one_restart(tree: Path, site: Path, prepared: Path, work: Path, args) -> dict[str, float]:
    """Times one restart with ``tree``'s code; the phases in seconds. ``args.warm``: the
    restart that ``--max-restarts 1`` makes in the same launcher after a rank failed, timed
    from the failure (``interpreter`` and ``launcher`` are then 0: nothing is started again)."""
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(prepared, run_dir)
    marks = work / "marks.jsonl"
    marks.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{tree}", "MOE_FOLD_RESTART_MARKS": str(marks),
           "MOE_FOLD_RESTART_TREE": str(tree), "OMP_WAIT_POLICY": "PASSIVE"}
    extra = ["--resume"]
    if args.warm:
        (work / "failed").unlink(missing_ok=True)
        env["MOE_FOLD_RESTART_FAIL_ONCE"] = str(work / "failed")
        extra.append("--max-restarts=1")
    cmd = _cli(args.preset, args.nproc, run_dir, work.parent / "cache", args.set + ["train.steps=3"], *extra)
    launched = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the restart failed (exit {proc.returncode}):\n{out[-2000:]}\n{err[-4000:]}")
    rows = [json.loads(line) for line in marks.read_text().splitlines()]
    launcher = [r for r in rows if r["mark"] == "run_ranks"][0]["pid"]
    ranks = {r["pid"] for r in rows if r["mark"] == "rank"}
    # Rank 0: the one that logged a step (only rank 0 writes metrics).
    rank0 = [r for r in rows if r["mark"] == "first_log"][0]["pid"]
    assert rank0 in ranks, (rank0, ranks)
    first = {}
    if args.warm:  # the second attempt, from the failure
        failed = [r["t"] for r in rows if r["mark"] == "failed"][0]
        rows = [r for r in rows if r["t"] > failed]
        first = {"python": failed, "run_ranks": failed}
        launched = failed
    for r in rows:
        if r["pid"] in (launcher, rank0):
            first.setdefault(r["mark"], r["t"])
    times, begin = {}, launched
    for phase, mark in _MARKS:
        times[phase] = first[mark] - begin
        begin = first[mark]
    if args.warm:  # from the failure to the new ranks' start: noticed, reported, relaunched
        times["spawn+pg"] = first["rank"] - failed
    times["total"] = first["first_log"] - launched
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="mixtral-tiny")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warm", action="store_true",
                        help="time the restart that --max-restarts makes in the same launcher after a rank failed")
    parser.add_argument("--tree", action="append", default=[], type=Path,
                        help="another checkout to time, interleaved with this one (repeatable)")
    args = parser.parse_args()
    args.set = (["parallel.ep=2", "train.micro_batch_size=2", "train.global_batch_size=4", "train.save_every=2",
                "optimizer.warmup_steps=0"]
                + args.set)
    trees = [ROOT, *[t.resolve() for t in args.tree]]
    with tempfile.TemporaryDirectory(prefix="restart_cost_") as tmp:
        tmp = Path(tmp)
        site = tmp / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        prepared = tmp / "prepared"
        _run(_cli(args.preset, args.nproc, prepared, tmp / "cache", args.set + ["train.steps=2"]),
             {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, "the first run")
        results: dict[Path, list[dict]] = {t: [] for t in trees}
        for round_ in range(args.rounds):
            for tree in trees if round_ % 2 == 0 else trees[::-1]:
                work = tmp / f"work_{trees.index(tree)}"
                work.mkdir(exist_ok=True)
                results[tree].append(one_restart(tree, site, prepared, work, args))
        what = "--max-restarts=1 after a rank failed, from the failure" if args.warm else "--resume"
        print(f"restart cost, seconds (median of {args.rounds} interleaved rounds; `moe-fold train --nproc "
              f"{args.nproc} {what}`, {args.preset})")
        width = max(len(str(t)) for t in trees)
        print(f"{'tree':<{width}} " + " ".join(f"{p:>12}" for p in PHASES))
        medians = {}
        for tree in trees:
            medians[tree] = {p: statistics.median(r[p] for r in results[tree]) for p in PHASES}
            print(f"{str(tree):<{width}} " + " ".join(f"{medians[tree][p]:>12.3f}" for p in PHASES))
        for tree in trees[1:]:
            print(f"{'ratio ' + tree.name + '/this':<{width}} "
                  + " ".join(f"{medians[tree][p] / medians[ROOT][p]:>12.2f}" if medians[ROOT][p] else f"{'-':>12}"
                             for p in PHASES))
        for tree in trees:
            print(json.dumps({"bench": "restart_cost", "tree": str(tree), "warm": args.warm, "nproc": args.nproc, "preset": args.preset,
                              "rounds": args.rounds, **{f"{p.replace(' ', '_').replace('+', '_')}_s":
                                                        round(medians[tree][p], 4) for p in PHASES},
                              "all": results[tree]}))


if __name__ == "__main__":
    main()
