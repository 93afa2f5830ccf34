"""The exact tests under every CPU code path this machine offers: a table, branch x test.

A comparison at ``atol=0`` (or ``==``, ``torch.equal``) holds on a user's machine only if
it does not depend on which kernel the math libraries picked: MKL chooses its sgemm code
path by CPU (its conditional-reproducibility branches, ``MKL_CBWR``) and ATen its vector
width (``ATEN_CPU_CAPABILITY``). This script runs the tests that docs/claims.md lists with
a bit-for-bit tolerance once per setting and prints whether each passed::

    .venv/bin/python -m tests.portability                 # every variant, every exact test
    .venv/bin/python -m tests.portability --list          # the variants and the tests
    .venv/bin/python -m tests.portability -k dispatch -k replace   # ids containing either
    .venv/bin/python -m tests.portability --variant MKL_CBWR=COMPATIBLE --variant default

Not part of the default suite (pytest collects ``test_*.py`` only; this file has no test),
and slow: each variant is one pytest run of every exact test.

The MKL branches are the ones MKL honours here: MKL falls back to ``AUTO`` for a branch
the CPU does not support, or (on non-Intel CPUs) for every instruction-set branch. Each
variant is checked first with ``MKL_VERBOSE`` (the ``CNR:`` field of an sgemm call) and
``torch.backends.cpu.get_cpu_capability()``; a variant the machine does not honour is a
line under the table with the reason, not a silent rerun of the default path.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = ROOT / "docs" / "claims.md"
MKL_BRANCHES = ["AUTO", "COMPATIBLE", "SSE4_2", "AVX", "AVX2", "AVX512", "AVX512_E1"]
ATEN_CAPABILITIES = ["default", "avx2"]
# A tolerance cell naming one of these is a bit-for-bit comparison.
EXACT = re.compile(r"==|torch\.equal|array_equal|rtol=0, atol=0|`atol=0`")
TEST_ID = re.compile(r"`(tests/[\w/]+\.py)?::(\w+)(?:\[[^\]]*\])?`( \[(?:slow|gpu)[^\]]*\])?")

PROBE = """
import json, os, torch
a = torch.randn(64, 64)
a @ a
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability()}))
"""


def exact_tests(claims: Path = CLAIMS) -> list[str]:
    """The node ids of docs/claims.md's rows whose tolerance is bit for bit, in order,
    without the [slow] and [gpu] ones (CI runs those; a variant run would take hours)."""
    found: list[str] = []
    for line in claims.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not line.startswith("|") or not EXACT.search(cells[3]):
            continue
        current = None
        for m in TEST_ID.finditer(cells[2]):
            current = m.group(1) or current
            if current is None or m.group(3):
                continue
            node = f"{current}::{m.group(2)}"
            if node not in found:
                found.append(node)
    return found


def variants() -> list[tuple[str, dict[str, str]]]:
    """(name, environment) of every setting tried: the machine's default, each MKL
    branch, each ATen capability."""
    out = [("default", {})]
    out += [(f"MKL_CBWR={b}", {"MKL_CBWR": b}) for b in MKL_BRANCHES]
    out += [(f"ATEN_CPU_CAPABILITY={c}", {"ATEN_CPU_CAPABILITY": c}) for c in ATEN_CAPABILITIES]
    return out


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "MKL_VERBOSE")}
    return {**env, **extra}


def honoured(extra: dict[str, str]) -> str | None:
    """None if this machine runs the setting as asked, else why not."""
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                           env={**_env(extra), "MKL_VERBOSE": "1"})
    if probe.returncode != 0:
        return f"probe failed: {probe.stderr.strip()[-200:]}"
    cnr = re.search(r"CNR:(\S+)", probe.stdout + probe.stderr)
    aten = re.search(r'"aten": "(\w+)"', probe.stdout)
    if "MKL_CBWR" in extra:
        want = extra["MKL_CBWR"]
        got = cnr.group(1) if cnr else "unknown"
        if got.split(",")[0] != want:
            return f"MKL runs CNR:{got}"
    if "ATEN_CPU_CAPABILITY" in extra:
        want = extra["ATEN_CPU_CAPABILITY"].upper()
        got = aten.group(1) if aten else "unknown"
        if got.upper() != want:
            return f"ATen runs {got}"
    return None


def run_variant(tests: list[str], extra: dict[str, str], timeout: float) -> dict[str, str]:
    """pytest on ``tests`` under ``extra``: node id -> "pass" / "FAIL" / "skip" /
    "error", a parametrised test's cases folded into one (FAIL if any failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu",
               f"--junitxml={report}", *tests]
        try:
            subprocess.run(cmd, cwd=ROOT, env=_env(extra), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {t: "timeout" for t in tests}
        if not report.exists():
            return {t: "error" for t in tests}
        outcome: dict[str, str] = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            name = case.get("name", "").split("[")[0]
            node = next((t for t in tests if t.endswith(f"::{name}") and file.endswith(t.split("::")[0].split("/")[-1])),
                        None)
            if node is None:
                continue
            status = "pass"
            if case.find("failure") is not None or case.find("error") is not None:
                status = "FAIL"
            elif case.find("skipped") is not None:
                status = "skip"
            order = {"FAIL": 3, "pass": 1, "skip": 0}
            if order[status] >= order.get(outcome.get(node, "skip"), 0):
                outcome[node] = status
        return {t: outcome.get(t, "missing") for t in tests}


def table(tests: list[str], columns: list[tuple[str, dict[str, str]]]) -> str:
    names = [name for name, _ in columns]
    width = max(len(t) for t in tests)
    lines = [" | ".join(["test".ljust(width)] + names)]
    lines.append("-|-".join(["-" * width] + ["-" * len(n) for n in names]))
    for t in tests:
        lines.append(" | ".join([t.ljust(width)] + [cells[t].ljust(len(n)) for n, cells in columns]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.portability", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the variants and the tests, run nothing")
    parser.add_argument("-k", dest="keywords", action="append", default=[],
                        help="only the tests whose node id contains this text; repeatable (any of them)")
    parser.add_argument("--variant", action="append", default=[],
                        help="a variant by name (default, MKL_CBWR=AVX2, ATEN_CPU_CAPABILITY=avx2, ...); repeatable")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per variant's pytest run")
    args = parser.parse_args(argv)

    tests = [t for t in exact_tests() if not args.keywords or any(k in t for k in args.keywords)]
    chosen = variants()
    if args.variant:
        unknown = sorted(set(args.variant) - {name for name, _ in chosen})
        if unknown:
            parser.error(f"--variant {unknown[0]} is not one of {', '.join(name for name, _ in chosen)}")
        chosen = [(name, env) for name, env in chosen if name in args.variant]
    if not tests:
        parser.error(f"-k {' / '.join(args.keywords)} matches no exact test of docs/claims.md")
    if args.list:
        print("\n".join(name for name, _ in chosen))
        print("\n".join(tests))
        return 0

    columns, skipped = [], []
    for name, env in chosen:
        why = honoured(env)
        if why is not None:
            skipped.append(f"{name}: not honoured here ({why})")
            continue
        print(f"{name}: running {len(tests)} tests ...", file=sys.stderr, flush=True)
        columns.append((name, run_variant(tests, env, args.timeout)))
        bad = [f"{t}: {s}" for t, s in columns[-1][1].items() if s not in ("pass", "skip")]
        print(f"{name}: " + ("every test passed" if not bad else "; ".join(bad)), file=sys.stderr, flush=True)
    print(table(tests, columns))
    for line in skipped:
        print(line)
    failed = [(n, t) for n, cells in columns for t, s in cells.items() if s not in ("pass", "skip")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
