"""Where a test runs: on the CPU (every test but the ``gpu``-marked ones) or on the GPU
(the ``gpu``-marked ones only). conftest.py applies it; bench/gpu_smoke.py uses it too.

Two kinds of pytest process, because one process cannot hold both:

- Triton decides between its CPU interpreter and its compiler when a kernel is defined
  (``@triton.jit`` at import, reading TRITON_INTERPRET), so a process that imported the
  kernels interpreted cannot compile them;
- CUDA, once a process has looked for devices, stays visible to it.

The default process is the CPU one: TRITON_INTERPRET=1 and CUDA hidden
(CUDA_VISIBLE_DEVICES empty, inherited by every rank and subprocess a test starts), so a
GPU host gives CI's results. Its ``gpu`` tests run, the first time one is reached, all
together in one child pytest with ``MOE_FOLD_TESTS_ON_GPU=1`` (CUDA as the host has it,
Triton compiled, the other tests deselected), which writes each test's outcome to a JSON
file that the parent reports test by test. Where the host has no usable CUDA, they skip
with the reason and no child starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ON_GPU_ENV = "MOE_FOLD_TESTS_ON_GPU"
REPORT_ENV = "MOE_FOLD_GPU_TEST_REPORT"
# The host's CUDA_VISIBLE_DEVICES, kept for the child while the CPU process hides CUDA
# ("unset" when it was not set).
HOST_DEVICES_ENV = "MOE_FOLD_HOST_CUDA_VISIBLE_DEVICES"
ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 3600  # every gpu test, compiled kernels and three torchrun runs included


def on_gpu_process() -> bool:
    """True in the process that runs the gpu tests (MOE_FOLD_TESTS_ON_GPU=1)."""
    return os.environ.get(ON_GPU_ENV) == "1"


def pin_process(environ: dict) -> None:
    """Set ``environ`` (``os.environ``, before torch or triton is imported) for this
    process's kind: see the module docstring."""
    if environ.get(ON_GPU_ENV) == "1":
        environ.pop("TRITON_INTERPRET", None)
        return
    environ.setdefault("TRITON_INTERPRET", "1")
    if HOST_DEVICES_ENV not in environ:
        environ[HOST_DEVICES_ENV] = environ.get("CUDA_VISIBLE_DEVICES", "unset")
    environ["CUDA_VISIBLE_DEVICES"] = ""


def host_environ(environ: dict) -> dict:
    """The environment of the gpu child: the host's CUDA devices, Triton compiled."""
    env = {k: v for k, v in environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    devices = env.pop(HOST_DEVICES_ENV, "unset")
    if devices != "unset":
        env["CUDA_VISIBLE_DEVICES"] = devices
    env[ON_GPU_ENV] = "1"
    return env


def cuda_missing_reason(torch_version: str, cuda_build: Optional[str], device_count: int) -> Optional[str]:
    """Why the gpu tests cannot run (None: they can). ``cuda_build`` is torch.version.cuda."""
    if cuda_build is None:
        return (f"needs CUDA: torch {torch_version} is a CPU-only build (torch.version.cuda is None); "
                f"see docs/gpu.md")
    if device_count < 1:
        return (f"needs CUDA: torch.cuda.is_available() is False (torch {torch_version}, CUDA {cuda_build}, "
                f"no GPU visible); see docs/gpu.md")
    return None


_HOST_REASON: dict = {}


def host_cuda_missing_reason() -> Optional[str]:
    """:func:`cuda_missing_reason` for this host. In the GPU process it asks torch; in the
    CPU process, which hides CUDA from itself, a child process with the host's devices
    counts them (only when torch is a CUDA build: no child on a CPU-only one)."""
    if "reason" in _HOST_REASON:
        return _HOST_REASON["reason"]
    import torch

    if on_gpu_process():
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    elif torch.version.cuda is None:
        count = 0
    else:
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                               env=host_environ(dict(os.environ)), capture_output=True, text=True, timeout=120)
        count = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    _HOST_REASON["reason"] = cuda_missing_reason(torch.__version__, torch.version.cuda, count)
    return _HOST_REASON["reason"]


class GpuChild:
    """The gpu tests of a CPU process, run once in a child pytest on the GPU."""

    def __init__(self, nodeids: list[str]):
        self.nodeids = nodeids
        self._outcomes: Optional[dict] = None
        self._output = ""

    def outcome(self, nodeid: str) -> dict:
        """``{"outcome": "passed"|"failed"|"skipped", "text": ...}`` of one test."""
        if self._outcomes is None:
            self._run()
        got = self._outcomes.get(nodeid)
        if got is None:
            return {"outcome": "failed", "text": f"the gpu child process reported nothing for {nodeid}; its "
                                                 f"output ends with:\n{self._output[-6000:]}"}
        return got

    def _run(self) -> None:
        with tempfile.TemporaryDirectory(prefix="moe-fold-gpu-tests-") as tmp:
            report = Path(tmp) / "report.json"
            env = {**host_environ(dict(os.environ)), REPORT_ENV: str(report)}
            proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                                   *self.nodeids], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT_S)
            self._output = proc.stdout + proc.stderr
            self._outcomes = json.loads(report.read_text()) if report.is_file() else {}


def report(got: dict) -> None:
    """Make this test's outcome the child's: ``got`` from :meth:`GpuChild.outcome`."""
    import pytest

    if got["outcome"] == "skipped":
        pytest.skip(got["text"])
    if got["outcome"] != "passed":
        pytest.fail(f"failed on the GPU (in the gpu child process):\n{got['text']}", pytrace=False)


class OutcomeRecorder:
    """In the gpu child: each test's outcome, written as JSON at the end of the session."""

    def __init__(self, path: str):
        self.path, self.outcomes = path, {}

    def add(self, report) -> None:
        got = self.outcomes.setdefault(report.nodeid, {"outcome": "passed", "text": ""})
        if report.failed:
            got.update(outcome="failed", text=f"{got['text']}\n[{report.when}] {report.longreprtext}".strip())
        elif report.skipped and got["outcome"] != "failed":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            got.update(outcome="skipped", text=reason.removeprefix("Skipped: "))

    def write(self) -> None:
        Path(self.path).write_text(json.dumps(self.outcomes))
