"""The library reads no environment variable of its own: the config (and ``--set``) is the
one way to choose what a run does. The variables it does read configure a third-party
library or come from the launcher; each is listed here with the reason, and each read in
the source carries a comment saying why.

Read statically (``ast``) from the installed namespace's files (moe_fold/, models/,
dispatch/, kernels/), so a read inside a function counts as much as one at import."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import REPO
ROOTS = [REPO / "moe_fold", REPO / "models", REPO / "dispatch", REPO / "kernels"]

# Every variable the library reads or sets, and why it may.
ALLOWED = {
    "WANDB_SILENT": "wandb's own switch for its start-up banner",
    "CUBLAS_WORKSPACE_CONFIG": "cuBLAS reads it to make its reductions deterministic",
    "OMP_WAIT_POLICY": "libgomp reads it when it loads, in the rank processes",
    "RAYON_NUM_THREADS": "the tokenizers library's thread pool",
    "TRITON_INTERPRET": "Triton's own switch to its CPU interpreter",
    "CC": "the C toolchain's convention for the compiler",
    "XDG_CACHE_HOME": "the user's cache folder (the convention pip, torch and Triton follow)",
    "RANK": "torchrun's, for each worker",
    "WORLD_SIZE": "torchrun's, for each worker",
    "LOCAL_RANK": "torchrun's: the worker's GPU",
    "TORCHELASTIC_RESTART_COUNT": "torchrun's: a restarted group resumes",
    "TORCHELASTIC_USE_AGENT_STORE": "torchrun's: the shared store elastic rejoins cannot use",
}
# Whole-environment uses: the launcher hands its ranks the environment its caller asked for.
WHOLE = {"moe_fold/launch.py"}


def environment_uses() -> tuple[dict[str, list[str]], list[str]]:
    """Variable name -> the places that read or set it; and the places that use the
    environment in a way this test cannot name (a computed name, the whole mapping)."""
    named: dict[str, list[str]] = {}
    other: list[str] = []
    trees = {str(path.relative_to(REPO)): ast.parse(path.read_text(), str(path))
             for root in ROOTS for path in sorted(root.rglob("*.py"))}
    # Module-level string constants (ENV_VAR = "..."), which a read may name instead of the text.
    constants = {target.id: node.value.value for tree in trees.values() for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 and isinstance(node.value.value, str) for target in node.targets if isinstance(target, ast.Name)}

    def text(key):
        if isinstance(key, (ast.Name, ast.Attribute)):  # NAME, or module.NAME
            return constants.get(key.id if isinstance(key, ast.Name) else key.attr)
        return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None

    # Aliases of those constants (ENV_VAR = backends.GEMM_ENV_VAR).
    constants.update({target.id: text(node.value) for tree in trees.values() for node in tree.body
                      if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Name, ast.Attribute))
                      and text(node.value) is not None for target in node.targets if isinstance(target, ast.Name)})

    for rel, tree in trees.items():
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getenv":
                name = text(node.args[0]) if node.args else None
                if name is not None:
                    named.setdefault(name, []).append(where)
                else:
                    other.append(where)
            if not (isinstance(node, ast.Attribute) and node.attr == "environ"):
                continue
            parent = parents.get(node)
            key = None
            if isinstance(parent, ast.Subscript):
                key = parent.slice
            elif isinstance(parent, ast.Attribute) and parent.attr in ("get", "setdefault", "pop"):
                call = parents.get(parent)
                key = call.args[0] if isinstance(call, ast.Call) and call.args else None
            elif isinstance(parent, ast.Compare) and isinstance(parent.left, ast.Constant):
                key = parent.left
            if key is not None and text(key) is not None:
                named.setdefault(text(key), []).append(where)
            elif rel not in WHOLE:
                other.append(where)
    return named, other


def unexplained(named: dict[str, list[str]], other: list[str]) -> list[str]:
    return [f"{name} at {', '.join(places)}" for name, places in sorted(named.items()) if name not in ALLOWED] + \
        [f"an environment use this test cannot name at {place}" for place in other]


def test_the_library_reads_only_third_party_and_launcher_variables():
    named, other = environment_uses()
    assert unexplained(named, other) == []
    # The list stays true: a variable no longer read leaves it.
    assert sorted(set(ALLOWED) - set(named)) == []


def test_the_check_catches_a_variable_of_our_own(tmp_path, monkeypatch):
    """A planted read of an own switch (the fault plan once came from MOE_FOLD_FAULTS) and
    one of a computed name are both reported."""
    package = tmp_path / "moe_fold"
    package.mkdir()
    (package / "planted.py").write_text("import os\nPLAN = os.environ.get('MOE_FOLD_FAULTS', '')\n"
                                        "NAME = 'X'\nVALUE = os.environ['MOE_FOLD_' + NAME]\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    monkeypatch.setitem(globals(), "ROOTS", [package])
    named, other = environment_uses()
    assert unexplained(named, other) == ["MOE_FOLD_FAULTS at moe_fold/planted.py:2",
                                         "an environment use this test cannot name at moe_fold/planted.py:4"]
