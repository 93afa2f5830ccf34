"""The folders are the architecture: imports only go downward between packages, no module
imports in a circle, no package reaches into another through a private name, and the top
of ``moe_fold/`` stays small.

Read statically (``ast``) from the source files, so an import inside a function counts
as much as one at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import REPO

# Where each import name's files live (pyproject.toml's package-dir).
ROOTS = {"moe_fold": REPO / "moe_fold", "moe_fold.dispatch": REPO / "dispatch",
         "moe_fold.kernels": REPO / "kernels", "moe_fold.models": REPO / "models"}

# The layers, top to bottom. A package may import its own modules and any package on a
# lower floor; never one on its own floor or above. "core" is the modules at the top of
# moe_fold/ (layout, comm, launch) and the config package: everything may use them, they
# use nothing.
FLOORS = [
    ["cli"],
    ["training", "planner"],
    ["models"],
    ["dispatch"],
    ["kernels", "data"],
    ["parallel"],
    ["core"],
]
FLOOR = {package: level for level, names in enumerate(FLOORS) for package in names}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the installed namespace."""
    modules = {}
    for prefix, root in ROOTS.items():
        for path in root.rglob("*.py"):
            if "presets" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = path
    # moe_fold's own tree holds the other roots only by name, never by folder.
    return modules


def package_of(module: str) -> str:
    """The architectural package a dotted module name belongs to."""
    parts = module.split(".")
    if len(parts) == 1:
        return "core"
    name = parts[1]
    if name in FLOOR:
        return name
    return "core"  # a top-level module of moe_fold/


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every project import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("moe_fold"):
                    found.append((alias.name, "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("moe_fold"):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:  # "from package import module"
                    found.append((sub, "", node.lineno))
                else:
                    found.append((source, alias.name, node.lineno))
    return found


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, str, int]]]]:
    modules = module_files()
    return modules, {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_every_module_belongs_to_a_known_package():
    modules, _ = graph()
    # The config package's modules (moe_fold.config.rules.moe, ...) count as moe_fold.config.
    top_level = sorted({".".join(m.split(".")[:2]) for m in modules if package_of(m) == "core" and m != "moe_fold"})
    assert top_level == ["moe_fold.comm", "moe_fold.config", "moe_fold.elastic", "moe_fold.host_syncs",
                         "moe_fold.launch", "moe_fold.layout", "moe_fold.routes"], top_level


def test_moe_fold_top_level_holds_at_most_ten_modules():
    top = [p.name for p in (REPO / "moe_fold").glob("*.py")]
    assert len(top) <= 10, sorted(top)


def upward_imports(edges: dict[str, list[tuple[str, str, int]]]) -> list[str]:
    found = []
    for module, imports in edges.items():
        source = package_of(module)
        for target_module, _, line in imports:
            target = package_of(target_module)
            if target != source and FLOOR[target] <= FLOOR[source]:
                found.append(f"{module}:{line}: {source} imports {target_module} ({target})")
    return found


def import_cycles(edges: dict[str, list[tuple[str, str, int]]]) -> list[str]:
    known = {m: [t for t, _, _ in imports if t in edges and t != m] for m, imports in edges.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in known[module]:
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(known):
        if module not in state:
            visit(module, [module])
    return cycles


def private_imports(edges: dict[str, list[tuple[str, str, int]]]) -> list[str]:
    found = []
    for module, imports in edges.items():
        for target_module, name, line in imports:
            if package_of(target_module) == package_of(module):
                continue
            last = target_module.rsplit(".", 1)[-1]
            if name.startswith("_") or last.startswith("_"):
                found.append(f"{module}:{line}: {target_module} {name}")
    return found


def test_imports_only_go_downward():
    _, edges = graph()
    upward = upward_imports(edges)
    assert not upward, "imports that do not go downward:\n" + "\n".join(upward)


def test_no_import_cycle_between_modules():
    _, edges = graph()
    cycles = import_cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_package_imports_a_private_name_of_another():
    _, edges = graph()
    private = private_imports(edges)
    assert not private, "private names imported across packages:\n" + "\n".join(private)


def test_the_checks_catch_what_they_forbid():
    # The rules above would pass vacuously if nothing were parsed or compared: they see
    # the real graph, and each flags a planted violation.
    _, edges = graph()
    assert sum(len(v) for v in edges.values()) > 100
    assert any(t.startswith("moe_fold.parallel") for t, _, _ in edges["moe_fold.models.model"])
    planted = {
        "moe_fold.kernels.gmm": [("moe_fold.models.model", "", 1)],   # upward
        "moe_fold.models.model": [("moe_fold.kernels.permute", "_private", 2)],
        "moe_fold.training.a": [("moe_fold.training.b", "", 3)],
        "moe_fold.training.b": [("moe_fold.training.a", "", 4)],
    }
    assert upward_imports(planted) == ["moe_fold.kernels.gmm:1: kernels imports moe_fold.models.model (models)"]
    assert private_imports(planted) == ["moe_fold.models.model:2: moe_fold.kernels.permute _private"]
    assert import_cycles(planted) == ["moe_fold.training.a -> moe_fold.training.b -> moe_fold.training.a"]
