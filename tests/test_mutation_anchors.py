"""The mutation list cannot rot silently: every mutant of ``tests/mutation/mutants.py``
still finds its snippet exactly once, makes a file that still compiles (a mutant that
breaks the import would be "killed" by any test), and names tests that exist. Running the
mutants themselves is on demand: ``tests/mutation/run.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mutation.mutants import MUTANTS

REPO = Path(__file__).resolve().parents[1]


def test_ids_are_unique_and_there_are_enough():
    ids = [m.id for m in MUTANTS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert len(MUTANTS) >= 30


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_mutant_anchor_occurs_once_and_its_tests_exist(mutant):
    path = REPO / mutant.file
    assert path.is_file(), f"{mutant.id}: {mutant.file} does not exist"
    text = path.read_text()
    count = text.count(mutant.original)
    assert count == 1, (f"{mutant.id}: its original snippet occurs {count} times in {mutant.file}; "
                        "move it to the code as it is now (tests/mutation/run.py says how)")
    assert mutant.replacement != mutant.original and mutant.bug and mutant.tests
    compile(text.replace(mutant.original, mutant.replacement), str(path), "exec")
    for node_id in mutant.tests:
        file, _, rest = node_id.partition("::")
        test_file = REPO / file
        assert test_file.is_file() and test_file.name.startswith("test_"), f"{mutant.id}: no test file {file}"
        if rest:
            name = rest.split("::")[-1].split("[")[0]
            defined = {n.name for n in ast.walk(ast.parse(test_file.read_text()))
                       if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            assert name in defined, f"{mutant.id}: {file} defines no {name}"
