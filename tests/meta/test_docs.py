"""The docs point at things that exist: every repository path named in the README and
docs/ (``models/experts.py``, a test id ``tests/test_x.py::test_y``), every Markdown link
to a file (resolved from the page, as a browser does), and every section of
docs/architecture.md that a code comment cites."""

import re
from pathlib import Path

import pytest

from tests.helpers.paths import REPO
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# Folders of the checkout: a path that starts with one of them names a file of ours.
TOP = ("moe_fold", "dispatch", "kernels", "models", "bench", "tests", "docs", ".ci")
# A repository path inside backticks; a test id may follow with ::name[params].
PATH = re.compile(r"(?:`)((?:%s)/[\w./-]*)(?:::(\w+))?" % "|".join(re.escape(t) for t in TOP))


def _named_paths(text: str):
    for match in PATH.finditer(text):
        path, test = match.group(1).rstrip("."), match.group(2)
        # Generated outputs are named by pattern, not by file (bench/results/<date>.jsonl).
        if path.endswith("/results") or "/results/" in path:
            continue
        yield path, test


# A Markdown link to a local file: [text](path) or [text](path#anchor), not a URL.
LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)\s#]+)")


def test_links_resolve_from_their_page():
    broken = [f"{doc.relative_to(REPO)}: {target}" for doc in DOCS for target in LINK.findall(doc.read_text())
              if not (doc.parent / target).exists()]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_named_paths_and_tests_exist():
    missing = []
    for doc in DOCS:
        for path, test in _named_paths(doc.read_text()):
            where = f"{doc.relative_to(REPO)}: {path}" + (f"::{test}" if test else "")
            target = REPO / path.split("#")[0]
            if not target.exists():
                missing.append(where)
            elif test and not re.search(rf"^\s*(?:async )?def {test}\(", target.read_text(), re.M):
                missing.append(where + " (no such test)")
    assert not missing, "docs name what does not exist:\n" + "\n".join(missing)


def test_every_cited_architecture_section_exists():
    headings = {m.group(1).strip() for m in re.finditer(r"^##+ (.+)$", (REPO / "docs/architecture.md").read_text(), re.M)}
    cited = []
    for folder in ("moe_fold", "dispatch", "kernels", "models", "tests", "bench"):
        for source in (REPO / folder).rglob("*.py"):
            text = source.read_text()
            cited += [(source, m.group(1)) for m in re.finditer(r'docs/architecture\.md, "([^"]+)"', text)]
    assert cited, "no comment cites docs/architecture.md"
    wrong = [f"{s.relative_to(REPO)}: {section!r}" for s, section in cited if section not in headings]
    assert not wrong, f"cited sections not in docs/architecture.md ({sorted(headings)}):\n" + "\n".join(wrong)


@pytest.mark.parametrize("text, found", [
    ("see `models/experts.py` and [gpu](docs/gpu.md)", [("models/experts.py", None)]),
    ("`tests/training/test_optim.py::test_adamw_equals_torch_adamw_bit_for_bit[fp32]`",
     [("tests/training/test_optim.py", "test_adamw_equals_torch_adamw_bit_for_bit")]),
    ("`runs/x/metrics.jsonl` and `bench/results/<date>.jsonl`", []),
])
def test_path_pattern(text, found):
    assert list(_named_paths(text)) == found
