"""docs/configuration.md is generated from the config dataclasses (moe_fold.config.reference_markdown):
the committed file must be what the code generates now, and every field must carry the
comment the reference shows, so the reference cannot drift from the code."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from moe_fold.config import SECTIONS, field_comments, reference_markdown

from tests.helpers.paths import REPO


def test_committed_reference_is_the_generated_one():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == reference_markdown(), (
        "docs/configuration.md is stale: run python -m moe_fold.config --reference > docs/configuration.md")


def test_every_field_has_a_comment():
    missing = []
    for name, cls in SECTIONS.items():
        comments = field_comments(cls)
        missing += [f"{name}.{f.name}" for f in dataclasses.fields(cls) if not comments.get(f.name)]
    assert not missing, f"add a comment above each of these fields in moe_fold/config/schema.py: {missing}"


def test_reference_rows_show_type_choices_default_and_comment():
    rows = {line.split(" | ")[0]: line for line in reference_markdown().splitlines() if line.startswith("| `")}
    assert rows["| `moe.dispatcher`"] == (
        "| `moe.dispatcher` | `alltoall` \\| `allgather` | `alltoall` | Token dispatcher: alltoall (tokens sent to "
        "the ep ranks of their experts) \\| allgather (every rank gathers every token of the etp x ep group and "
        "keeps those of its experts). |")
    assert rows["| `data.dtype`"].startswith("| `data.dtype` | `uint8` \\| `uint16` \\| `int16` \\| `uint32` \\| "
                                              "`int32` \\| `int64` or null | `null` |")
    assert rows["| `parallel.grad_bucket_numel`"].startswith("| `parallel.grad_bucket_numel` | int | `16777216` |")
    assert len(rows) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())


def test_the_command_prints_the_reference():
    out = subprocess.run([sys.executable, "-m", "moe_fold.config", "--reference"], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert out == reference_markdown()
