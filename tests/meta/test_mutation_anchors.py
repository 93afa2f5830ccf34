"""The mutation list cannot rot silently: every mutant of ``tests/mutation/mutants.py``
still finds its snippet exactly once, makes a file that still compiles (a mutant that
breaks the import would be "killed" by any test), and names tests that exist. Running the
mutants themselves is on demand: ``tests/mutation/run.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.mutation import run
from tests.mutation.mutants import MUTANTS, Mutant

from tests.helpers.paths import REPO


def _problems(mutant: Mutant) -> list[str]:
    path = REPO / mutant.file
    if not path.is_file():
        return [f"{mutant.file} does not exist"]
    text = path.read_text()
    count = text.count(mutant.original)
    if count != 1:
        return [f"its original snippet occurs {count} times in {mutant.file}; move it to the code as it "
                "is now (tests/mutation/run.py says how)"]
    out = []
    if mutant.replacement == mutant.original or not mutant.bug or not mutant.tests:
        out.append("needs a replacement that differs, a bug and tests")
    try:
        compile(text.replace(mutant.original, mutant.replacement), str(path), "exec")
    except SyntaxError as err:
        out.append(f"the mutated {mutant.file} does not compile: {err}")
    for node_id in mutant.tests:
        file, _, rest = node_id.partition("::")
        test_file = REPO / file
        if not (test_file.is_file() and test_file.name.startswith("test_")):
            out.append(f"no test file {file}")
        elif rest:
            name = rest.split("::")[-1].split("[")[0]
            defined = {n.name for n in ast.walk(ast.parse(test_file.read_text()))
                       if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            if name not in defined:
                out.append(f"{file} defines no {name}")
    return out


def test_every_mutant_finds_its_snippet_once_and_names_existing_tests():
    ids = [m.id for m in MUTANTS]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert len(MUTANTS) >= 30
    problems = [f"{m.id}: {p}" for m in MUTANTS for p in _problems(m)]
    assert not problems, "\n".join(problems)


def test_the_runner_restores_the_file_whatever_ends_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "ROOT", tmp_path)
    target = tmp_path / "code.py"
    original = b"x = 1\ny = x + 1\n"
    target.write_bytes(original)
    mutant = Mutant("m", "code.py", "x + 1", "x - 1", "off by two", ("tests/test_x.py",))
    for stop in (RuntimeError("a test harness error"), KeyboardInterrupt(), run._Stopped(15)):
        with pytest.raises(type(stop)):
            with run.planted(mutant, original):
                assert target.read_bytes() == b"x = 1\ny = x - 1\n"
                raise stop
        assert target.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code.py"]  # no temporary file left
