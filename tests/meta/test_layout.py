"""Tests mirror the code: every library module with logic (a function or a class of its own)
has a test file named after it, at the same path under tests/ (``moe_fold/planner/comm.py`` ->
``tests/planner/test_comm.py``; ``dispatch/router.py`` ->
``tests/dispatch/test_router.py``; the modules at the top of ``moe_fold/`` -> ``tests/core/``).

A module without one is listed in ``NOT_MIRRORED`` with the test file that does exercise it
and why its tests live there; the test fails when a module lacks its file and is not listed,
when a listed module has gained its file (the entry must go) or no longer exists, and when
the named file does not exist. ``__init__.py`` and ``__main__.py`` are not modules of their
own here: a package's entry points are tested with the package (``moe_fold/cli/__init__.py``
in tests/cli/test_main.py, the families' registry in tests/models/hf/test_families.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import REPO

# Where each root's modules live and the folder of tests/ that mirrors it.
ROOTS = {"moe_fold": "", "dispatch": "dispatch", "kernels": "kernels", "models": "models"}

_FAMILIES = ("tests/models/hf/test_families.py", "every family of the registry is tested alike by one "
             "parametrized module (its config both ways, its refusals, its tensor names, logits against "
             "transformers); a file per family would repeat it")
_RULES = ("tests/config/test_rules.py", "the rules are checked through load_config, one case per rule, "
          "in one table of every field's errors; not yet split by concern")
_GPU = ("tests/kernels/test_gpu_kernels.py", "a Triton kernel, checked against its torch reference in the "
        "kernel's shared file on a GPU and under the Triton interpreter")

NOT_MIRRORED: dict[str, tuple[str, str]] = {
    "moe_fold/cli/sample.py": ("tests/models/test_sampling.py", "the command shares the trained runs (module "
                               "fixtures) of the sampling tests; a file of its own would train them again"),
    "moe_fold/config/schema.py": ("tests/config/test_reference.py", "the dataclasses: their fields and comments "
                                  "are the generated reference, their types checked on load"),
    "moe_fold/config/rules/common.py": _RULES,
    "moe_fold/config/rules/data.py": _RULES,
    "moe_fold/config/rules/model.py": _RULES,
    "moe_fold/config/rules/moe.py": _RULES,
    "moe_fold/config/rules/parallel.py": _RULES,
    "moe_fold/config/rules/routes.py": _RULES,
    "moe_fold/config/rules/train.py": _RULES,
    "moe_fold/data/flat_tokens.py": ("tests/data/test_sources.py", "one of the formats read in place, tested alike"),
    "moe_fold/data/hf_datasets.py": ("tests/data/test_sources.py", "one of the formats read in place, tested alike"),
    "moe_fold/data/hf_tokenizer.py": ("tests/models/test_sampling.py", "the exported tokenizer, checked by sampling "
                                      "with transformers"),
    "moe_fold/training/routes.py": ("tests/core/test_routes.py", "recording and replay, tested with the route "
                                    "files of moe_fold/routes.py"),
    "kernels/gated_delta.py": ("tests/models/test_gated_deltanet.py", "the chunked rule and the conv, against the "
                               "recurrent reference of the layer"),
    "kernels/delta_rule_fla.py": ("tests/kernels/test_delta_rule.py", "fla's layout, through a stand-in with fla's "
                                  "contract, with the delta rule's interface"),
    "kernels/short_conv_causal_conv1d.py": ("tests/kernels/test_short_conv.py", "causal-conv1d's layout, through a "
                                            "stand-in with its contract, beside the interface that chooses it"),
    "kernels/ssd_mamba.py": ("tests/kernels/test_ssd_scan.py", "mamba-ssm's layout, through a stand-in with its "
                             "contract, with the SSD scan's interface"),
    "kernels/gmm_loop.py": ("tests/kernels/test_backends.py", "one of the gmm backends, run alike"),
    "kernels/permute_triton.py": _GPU,
    "kernels/swiglu_triton.py": _GPU,
    "kernels/topk_triton.py": _GPU,
    "kernels/token_rows.py": ("tests/kernels/test_permute.py", "the row order both permute backends use"),
    "models/kv_cache.py": ("tests/models/test_sampling.py", "cached decode equals the full forward"),
    "models/mlp.py": ("tests/models/test_moe_layer.py", "the dense and shared-expert MLP, with the MoE layer"),
    "models/recompute.py": ("tests/planner/test_memory.py", "recompute's saved bytes against the planner"),
    "models/hf/config_map.py": ("tests/models/hf/test_families.py", "the family dispatch, both ways"),
    "models/hf/routes.py": ("tests/core/test_routes.py", "routes read from transformers, replayed"),
    "models/hf/sources.py": ("tests/models/hf/test_importer.py", "the safetensors folder the importer reads"),
    "models/hf/weights.py": ("tests/models/hf/test_families.py", "tensor names of every family"),
    **{f"models/hf/families/{name}.py": _FAMILIES for name in (
        "base", "standard", "deepseek_common", "deepseek_v2", "deepseek_v3", "ernie4_5_moe", "glm4_moe",
        "gpt_oss", "llama4_text", "longcat_flash", "minimax_m2", "mixtral", "olmoe", "qwen2_moe", "qwen3_5_moe",
        "qwen3_moe", "qwen3_next", "kimi_linear", "deepseek_v32", "glm_moe_dsa",
        "nemotron_h")},
}


def has_logic(path: Path) -> bool:
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               for node in ast.parse(path.read_text()).body)


def mirror(path: Path) -> Path:
    """The test file named after the library module at ``path`` (relative to the checkout)."""
    root, *inner = path.parts
    folder = ROOTS[root]
    parts = [*([folder] if folder else []), *inner[:-1]] or ["core"]
    return Path("tests", *parts, f"test_{path.stem}.py")


def library_modules(repo: Path = REPO) -> list[Path]:
    found = []
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            rel = path.relative_to(repo)
            if "presets" in rel.parts or path.name in ("__init__.py", "__main__.py") or not has_logic(path):
                continue
            found.append(rel)
    return found


def unmirrored(repo: Path = REPO) -> list[str]:
    return [str(m) for m in library_modules(repo) if not (repo / mirror(m)).exists()]


def test_the_mirror_paths():
    assert mirror(Path("moe_fold/planner/comm.py")) == Path("tests/planner/test_comm.py")
    assert mirror(Path("moe_fold/layout.py")) == Path("tests/core/test_layout.py")
    assert mirror(Path("moe_fold/config/rules/moe.py")) == Path("tests/config/rules/test_moe.py")
    assert mirror(Path("models/hf/families/mixtral.py")) == Path("tests/models/hf/families/test_mixtral.py")
    assert mirror(Path("dispatch/router.py")) == Path("tests/dispatch/test_router.py")


def test_every_module_with_logic_has_its_test_file_or_a_reason():
    missing = [m for m in unmirrored() if m not in NOT_MIRRORED]
    assert not missing, ("library modules without a test file named after them (add tests/<package>/"
                         "test_<module>.py, or list them in NOT_MIRRORED with where they are tested):\n"
                         + "\n".join(f"{m} -> {mirror(Path(m))}" for m in missing))


def test_the_list_of_exceptions_is_current():
    lacking = set(unmirrored())
    stale = [m for m in NOT_MIRRORED if m not in lacking]
    assert not stale, ("listed in NOT_MIRRORED but mirrored now, or gone (remove the entry):\n" + "\n".join(stale))
    nowhere = [f"{m}: {where}" for m, (where, _) in NOT_MIRRORED.items() if not (REPO / where).is_file()]
    assert not nowhere, "NOT_MIRRORED names test files that do not exist:\n" + "\n".join(nowhere)
