"""Mutation runner: plant each curated bug of ``mutants.py`` in turn, run the tests that
must catch it, and put the code back.

A test counts once it has been seen to fail on a planted bug (docs/architecture.md, "Testing doctrine"). This
keeps that check alive after the test was written: every mutant in ``mutants.py`` is a
small plausible bug (an off-by-one in a split, a reduction over the wrong group, a
dropped scale, swapped dims) together with the tests that must fail when it is there.
It runs on demand, not in the default suite (the whole list takes minutes); the default
suite only checks that the list has not rotted (``tests/meta/test_mutation_anchors.py``).

Run it from the repository root, on a clean tree (it refuses to run while a file it
would mutate has uncommitted changes)::

    .venv/bin/python -m tests.mutation.run               # every mutant
    .venv/bin/python -m tests.mutation.run --list           # what there is
    .venv/bin/python -m tests.mutation.run --only router-group-blocks --only zigzag-mirror
    .venv/bin/python -m tests.mutation.run --clean --only ID  # the tests must pass unmutated first
    .venv/bin/python -m tests.mutation.run --timeout 300    # per mutant, in seconds

Per mutant it writes the mutated file, runs ``pytest -x`` on the mutant's test node ids in
a child process (``PYTHONDONTWRITEBYTECODE=1``, so no bytecode of a mutant is cached),
then writes the original bytes back, whatever happens: a failing test, an exception,
Ctrl-C or SIGTERM (the child's process group is killed first). Only SIGKILL can leave a
mutant behind; the next run then refuses to start, and ``git diff`` shows it
(``git checkout -- FILE`` undoes it).

Each line of the report is one mutant: ``killed`` (with the first test that failed),
``SURVIVED`` (every test passed: the tests miss this bug), ``ANCHOR-MISSING`` (the
original snippet no longer occurs in the file: the code changed under the mutant),
``ANCHOR-AMBIGUOUS`` (it occurs more than once), ``TIMEOUT`` (the tests ran past
``--timeout``) or ``ERROR`` (pytest itself failed, e.g. a test id that does not exist);
then the seconds it took. Every status but ``killed`` is a failure: the exit code is 0
only when every mutant selected was killed.

Adding a mutant: append a :class:`~mutation.mutants.Mutant` to ``MUTANTS`` with an ``id``,
the ``file`` (relative to the repository root), the exact ``original`` snippet (it must
occur exactly once in the file: take a whole line or two, with enough context), its
``replacement``, a one-line ``bug`` saying what real mistake it models, and the fewest
``tests`` (pytest node ids, fastest first: ``-x`` stops at the first failure) that must
fail. Then run ``--only ID``: a mutant that survives is a finding, so strengthen the test
(or add one) until it is killed rather than drop the mutant. When the code under a
mutant changes, ``tests/meta/test_mutation_anchors.py`` fails in the default suite; move the
snippet to the new code and run ``--only ID`` again.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from tests.mutation.mutants import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]

KILLED, SURVIVED, MISSING, AMBIGUOUS, TIMEOUT, ERROR = (
    "killed", "SURVIVED", "ANCHOR-MISSING", "ANCHOR-AMBIGUOUS", "TIMEOUT", "ERROR")
DEFAULT_TIMEOUT_S = 600
# The signals that restore the file before the runner ends (Ctrl-C raises KeyboardInterrupt).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@dataclass
class Result:
    mutant: Mutant
    status: str
    seconds: float
    detail: str = ""  # the killing test, or why it was not killed


class _Stopped(BaseException):
    """A stop signal arrived: unwind (restoring the file) and exit."""


def _raise_stopped(signum, _frame):
    raise _Stopped(signum)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold the stop signals (and Ctrl-C) while the original bytes are written back, so a
    second signal cannot cut the restore short; they are delivered afterwards."""
    held = {signal.SIGINT, *_STOP_SIGNALS}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _write_atomic(path: Path, data: bytes) -> None:
    # A crash mid-write must leave either the whole old or the whole new file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".mutation")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, path.stat().st_mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def planted(mutant: Mutant, original: bytes) -> Iterator[None]:
    """The file holds the mutant inside the block and its original bytes after it."""
    path = ROOT / mutant.file
    mutated = original.replace(mutant.original.encode(), mutant.replacement.encode(), 1)
    try:
        _write_atomic(path, mutated)
        yield
    finally:
        with _signals_held():
            _write_atomic(path, original)
        if path.read_bytes() != original:  # never go on with a mutant left in the tree
            raise RuntimeError(f"could not restore {mutant.file}; `git checkout -- {mutant.file}`")


def _pytest(tests: Sequence[str], timeout_s: float) -> tuple[Optional[int], str]:
    """Run pytest on ``tests`` in a child process group; ``(exit code or None on timeout, output)``."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", "-o", "addopts=", *tests]
    with tempfile.TemporaryFile() as out:
        child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        code = None
        try:
            code = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            # Whatever cut the wait short (a timeout, Ctrl-C, SIGTERM), no test process outlives it.
            if code is None:
                _kill_group(child)
        out.seek(0)
        return code, out.read().decode(errors="replace")


def _kill_group(child: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        try:
            child.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _first_failure(output: str) -> str:
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return found.group(1) if found else "(no test named in the output)"


def _tail(output: str, lines: int = 15) -> str:
    return "\n".join("      " + line for line in output.rstrip().splitlines()[-lines:])


def anchor_count(mutant: Mutant) -> int:
    """How often the mutant's original snippet occurs in its file (it must be once)."""
    return (ROOT / mutant.file).read_text().count(mutant.original)


def run_mutant(mutant: Mutant, timeout_s: float, clean_first: bool = False) -> Result:
    begin = time.monotonic()
    original = (ROOT / mutant.file).read_bytes()
    count = original.decode().count(mutant.original)
    if count != 1:
        status = MISSING if count == 0 else AMBIGUOUS
        return Result(mutant, status, 0.0, f"the original snippet occurs {count} times in {mutant.file}")
    if clean_first:
        code, output = _pytest(mutant.tests, timeout_s)
        if code != 0:
            return Result(mutant, ERROR, time.monotonic() - begin,
                          "the tests do not pass on the unmutated code:\n" + _tail(output))
        begin = time.monotonic()
    with planted(mutant, original):
        code, output = _pytest(mutant.tests, timeout_s)
    seconds = time.monotonic() - begin
    if code == 1:
        return Result(mutant, KILLED, seconds, _first_failure(output))
    if code == 0:
        return Result(mutant, SURVIVED, seconds, "every test passed with the bug planted")
    if code is None:
        return Result(mutant, TIMEOUT, seconds, f"the tests ran past {timeout_s:g} s")
    return Result(mutant, ERROR, seconds, f"pytest exit code {code}:\n" + _tail(output))


def dirty_files(files: Sequence[str]) -> list[str]:
    """The files among ``files`` with uncommitted changes (or unknown to git)."""
    out = subprocess.run(["git", "status", "--porcelain", "--", *files], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def _select(only: Sequence[str]) -> list[Mutant]:
    if not only:
        return list(MUTANTS)
    known = {m.id: m for m in MUTANTS}
    ids = [i for group in only for i in group.split(",") if i]
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise SystemExit(f"--only: unknown mutant id(s) {unknown}; `--list` shows them")
    return [known[i] for i in ids]


def _print_list(mutants: Sequence[Mutant]) -> None:
    for m in mutants:
        print(f"{m.id}  [{m.file}]\n    {m.bug}")
        for t in m.tests:
            print(f"    - {t}")


def _line(i: int, n: int, r: Result, width: int) -> str:
    return f"[{i:>2}/{n}] {r.mutant.id:<{width}} {r.status:<16} {r.seconds:7.1f} s  {r.detail}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="ID",
                        help="run only this mutant (repeat, or separate ids with commas)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"seconds the tests of one mutant may take (default {DEFAULT_TIMEOUT_S})")
    parser.add_argument("--clean", action="store_true",
                        help="first run each mutant's tests on the unmutated code; they must pass")
    args = parser.parse_args(argv)
    mutants = _select(args.only)
    if args.list:
        _print_list(mutants)
        return 0
    dirty = dirty_files(sorted({m.file for m in mutants}))
    if dirty:
        print("refusing to run: these files have uncommitted changes (a mutant left by a killed run? "
              f"see `git diff`): {', '.join(dirty)}", file=sys.stderr)
        return 2

    for sig in _STOP_SIGNALS:
        signal.signal(sig, _raise_stopped)
    width = max(len(m.id) for m in mutants)
    results: list[Result] = []
    begin = time.monotonic()
    try:
        for i, mutant in enumerate(mutants, 1):
            results.append(run_mutant(mutant, args.timeout, args.clean))
            print(_line(i, len(mutants), results[-1], width), flush=True)
    except (KeyboardInterrupt, _Stopped):
        print(f"stopped after {len(results)} of {len(mutants)} mutants; the code is restored", file=sys.stderr)
        return 130
    total = time.monotonic() - begin

    counts = {s: sum(r.status == s for r in results) for s in (KILLED, SURVIVED, MISSING, AMBIGUOUS, TIMEOUT, ERROR)}
    print(f"\n{len(results)} mutants in {total:.0f} s: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    failed = [r for r in results if r.status != KILLED]
    for r in failed:
        print(f"  {r.status}: {r.mutant.id} ({r.mutant.file}): {r.mutant.bug}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
