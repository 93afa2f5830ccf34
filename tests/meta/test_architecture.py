"""The folders are the architecture: imports only go downward between packages, no module
imports in a circle, no package reaches into another through a private name, and the top
of ``moe_fold/`` stays small.

Read statically (``ast``) from the source files, so an import inside a function counts
as much as one at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
    assert top_level == ["moe_fold.comm", "moe_fold.config", "moe_fold.elastic", "moe_fold.launch",
                         "moe_fold.layout", "moe_fold.routes"], top_level


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


@pytest.mark.parametrize("check, what", [
    (upward_imports, "imports that do not go downward"),
    (import_cycles, "import cycles between modules"),
    (private_imports, "private names imported across packages"),
], ids=["imports_only_go_downward", "no_import_cycle_between_modules", "no_package_imports_a_private_name"])
def test_import_graph_rule(check, what):
    _, edges = graph()
    found = check(edges)
    assert not found, f"{what}:\n" + "\n".join(found)


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


# --------------------------------------------------------------------------- no global state below training

# Packages whose modules may keep state at module level: the loop and the commands.
STATEFUL = {"training", "cli"}

# Module-level state below training that functions write, each with why it may be:
# (module, name) -> reason. Anything else written from a function is a hidden global.
MODULE_STATE = {
    ("moe_fold.comm", "_BYTES_SENT"): "the byte counter: instrumentation for benchmarks and tests, never read "
                                      "by the installed package (test_the_package_never_reads_the_byte_counter)",
    ("moe_fold.config.rules.common", "RULES"): "the rule registry, filled by the @rule decorator at import",
    ("moe_fold.kernels.swiglu_cpu", "_pool"): "the process's worker threads, made on first use (a resource, "
                                              "like an lru_cache: no result depends on it)",
    ("moe_fold.kernels.swiglu_cpu", "_pool_workers"): "the size of that pool",
    ("moe_fold.data.preprocess", "_WORKER_TOKENIZER"): "a tokenizing worker process's tokenizer, set once by "
                                                       "multiprocessing's Pool initializer",
    ("moe_fold.data.preprocess", "os"): "that worker sets RAYON_NUM_THREADS, the tokenizers library's own "
                                        "setting, before it loads one",
    ("moe_fold.launch", "os"): "the launcher gives a rank process the environment it was started with",
}
_MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add",
             "discard", "sort", "reverse", "__setitem__", "__delitem__"}


def _root_name(node: ast.AST) -> str | None:
    """``a`` of ``a``, ``a.b.c``, ``a[i].b``; None for anything else (a call's result ...)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _module_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound at the top of a module (imports, assignments, functions, classes), and
    those of them that name imported modules or their members."""
    names, imported = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        else:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    return names | imported, imported


def _local_names(fn: ast.AST) -> set[str]:
    """Names a function binds itself (parameters, assignments, loop and ``with`` targets)."""
    args = fn.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    declared = {n for node in ast.walk(fn) if isinstance(node, ast.Global) for n in node.names}
    return names - declared


def module_state_writes(module: str, source: str) -> list[tuple[str, str, int]]:
    """``(name, how, line)`` for every write, from inside a function, to state bound at the
    top of ``module``: a ``global`` statement, an item or attribute assignment (``X[k] = v``,
    ``torch.x = f``: a monkeypatch), ``del`` of one, a mutating method (``X.append(...)``)
    or ``setattr(X, ...)`` on a module-level name the function does not bind itself. A
    method called on an imported module itself (``torch.sort``, ``np.append``) is a function
    of that module, not a mutation; one called on its attributes (``os.environ.update``) is."""
    tree = ast.parse(source)
    top, imported = _module_names(tree)
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        own = _local_names(fn) if not isinstance(fn, ast.Lambda) else {a.arg for a in fn.args.args}
        body = fn.body if isinstance(fn.body, list) else [fn.body]
        for stmt in body:
            for node in ast.walk(stmt):
                targets, how = [], ""
                if isinstance(node, ast.Global):
                    found += [(name, "global", node.lineno) for name in node.names]
                    continue
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                    targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                    targets = [t for t in targets if isinstance(t, (ast.Attribute, ast.Subscript))]
                    how = "del" if isinstance(node, ast.Delete) else "assigns into"
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in _MUTATORS \
                        and not (isinstance(node.func.value, ast.Name) and node.func.value.id in imported):
                    targets, how = [node.func.value], f".{node.func.attr}()"
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                        and node.func.id in ("setattr", "delattr") and node.args:
                    targets, how = [node.args[0]], node.func.id
                for target in targets:
                    name = _root_name(target)
                    if name is not None and name in top and name not in own:
                        found.append((name, how, node.lineno))
    return sorted(set(found), key=lambda f: (f[2], f[0]))


def module_state_violations(modules: dict[str, Path]) -> tuple[list[str], set[tuple[str, str]]]:
    """Writes to module-level state below training that :data:`MODULE_STATE` does not
    allow, and the allowed entries that were seen."""
    bad, seen = [], set()
    for module, path in sorted(modules.items()):
        if package_of(module) in STATEFUL:
            continue
        for name, how, line in module_state_writes(module, path.read_text()):
            key = (module, name)
            if key in MODULE_STATE:
                seen.add(key)
            else:
                bad.append(f"{module}:{line}: {how} module-level {name}")
    return bad, seen


def test_nothing_below_training_writes_module_level_state():
    modules, _ = graph()
    bad, seen = module_state_violations(modules)
    assert not bad, ("module-level state written at run time below training (pass it in, keep it on an "
                     "object, or list it in MODULE_STATE with why):\n" + "\n".join(bad))
    assert seen == set(MODULE_STATE), f"MODULE_STATE entries no module writes any more: {set(MODULE_STATE) - seen}"


def test_the_module_state_check_catches_what_it_forbids():
    planted = '''
import torch
_CACHE = {}
_COUNT = 0
class Holder:
    value = None
def count():
    global _COUNT
    _COUNT += 1
def remember(key, value):
    _CACHE[key] = value
    _CACHE.setdefault(key, value)
def patch():
    torch.autograd.graph._engine_run_backward = print
    setattr(torch, "x", 1)
    Holder.value = 3
    torch.__dict__.update(x=1)
def fine(_CACHE, other):
    _CACHE[1] = 2           # a parameter of the same name
    mine = {}
    mine["a"] = 1           # a local
    other.attr = 2
    torch.sort(other)       # a function of a module
'''
    assert module_state_writes("planted", planted) == [
        ("_COUNT", "global", 8), ("_CACHE", "assigns into", 11), ("_CACHE", ".setdefault()", 12),
        ("torch", "assigns into", 14), ("torch", "setattr", 15), ("Holder", "assigns into", 16),
        ("torch", ".update()", 17)]


def test_the_package_never_reads_the_byte_counter():
    # The counter is instrumentation; the package's own accounting (the dispatchers' wire
    # bytes, re-placement's bytes) comes from the byte rules, not from diffing it.
    readers = []
    for module, path in graph()[0].items():
        if module == "moe_fold.comm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Attribute, ast.Name, ast.alias)):
                name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", getattr(node, "name", ""))
                if name in ("bytes_sent", "reset_bytes", "count_bytes", "_BYTES_SENT"):
                    readers.append(f"{module}:{node.lineno}: {name}")
    assert not readers, "the installed package reads the process-wide byte counter:\n" + "\n".join(readers)


# Helpers that live outside the installed package (tests/ and bench/): never imported by it.
OUTSIDE = {p.stem for folder in ("tests", "bench") for p in (REPO / folder).rglob("*.py")} | {"tests", "bench"}


def outside_imports(modules: dict[str, Path]) -> list[str]:
    """Imports, in the installed package, of a module of tests/ or bench/."""
    found = []
    for module, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            found += [f"{module}:{node.lineno}: imports {n}" for n in names if n.split(".")[0] in OUTSIDE]
    return found


def test_the_package_never_imports_test_or_bench_helpers():
    assert "host_syncs" in OUTSIDE and "conftest" in OUTSIDE
    bad = outside_imports(graph()[0])
    assert not bad, "the installed package imports test or bench code:\n" + "\n".join(bad)
