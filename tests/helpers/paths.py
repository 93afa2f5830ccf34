"""Where the checkout's files are, for tests that read docs, run bench scripts or start
child processes from the checkout's root."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
