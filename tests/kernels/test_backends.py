"""Kernel backends: the ``auto`` rule's table, availability (imports and a tiny call runs),
and how a run resolves, records and overrides its backends (config keys, train.tf32)."""

from __future__ import annotations

import stat
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from moe_fold.config import ConfigError, load_config
from moe_fold.kernels import backends, swiglu_cpu
from moe_fold.kernels.backends import BackendUnavailable, choose
from moe_fold.kernels.gmm import gmm
from moe_fold.kernels.swiglu import swiglu

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
GG = frozenset({"grouped_gemm"})
NONE = frozenset()

# (device, capability, dtype, extras that run) -> gemm, permute, swiglu, topk. The rule
# reads neither Triton nor the C compiler: where the one it names does not run, resolving
# raises (tests below) instead of choosing something else.
TABLE = [
    ("cpu", None, F32, NONE, ("torch", "torch", "cpu", "torch")),
    ("cpu", None, BF16, NONE, ("torch", "torch", "cpu", "torch")),
    ("cpu", None, F16, NONE, ("torch", "torch", "cpu", "torch")),
    ("cpu", None, F64, NONE, ("loop", "torch", "cpu", "torch")),
    ("cpu", None, BF16, GG, ("torch", "torch", "cpu", "torch")),  # grouped_gemm is CUDA-only
    ("cuda", (8, 0), F32, NONE, ("loop", "triton", "triton", "triton")),
    ("cuda", (8, 0), F32, GG, ("loop", "triton", "triton", "triton")),
    ("cuda", (8, 0), BF16, NONE, ("loop", "triton", "triton", "triton")),
    ("cuda", (8, 0), BF16, GG, ("grouped_gemm", "triton", "triton", "triton")),
    ("cuda", (8, 9), BF16, GG, ("grouped_gemm", "triton", "triton", "triton")),
    ("cuda", (9, 0), F32, NONE, ("loop", "triton", "triton", "triton")),
    ("cuda", (9, 0), F32, GG, ("loop", "triton", "triton", "triton")),
    ("cuda", (9, 0), F16, NONE, ("loop", "triton", "triton", "triton")),
    ("cuda", (9, 0), BF16, NONE, ("torch", "triton", "triton", "triton")),
    ("cuda", (9, 0), BF16, GG, ("torch", "triton", "triton", "triton")),  # device counts beat host counts
    ("cuda", (10, 0), BF16, NONE, ("torch", "triton", "triton", "triton")),
    ("cuda", (12, 0), BF16, NONE, ("loop", "triton", "triton", "triton")),  # no grouped_mm fast path
    ("cuda", (7, 5), F32, GG, ("loop", "torch", "torch", "torch")),
    ("cuda", (7, 0), F16, NONE, ("loop", "torch", "torch", "torch")),
    ("mps", None, F32, NONE, ("loop", "torch", "torch", "torch")),
]


@pytest.mark.parametrize("device, cap, dtype, extras, want", TABLE,
                         ids=[f"{d}-{c}-{str(t)[6:]}-{'gg' if e else 'nogg'}" for d, c, t, e, _ in TABLE])
def test_auto_rule_table(device, cap, dtype, extras, want):
    got = tuple(choose(op, device, cap, dtype, extras) for op in ("gemm", "permute", "swiglu", "topk"))
    assert got == want


def test_topk_stays_torch_where_the_kernel_cannot_fuse_the_routing():
    assert choose("topk", "cuda", (9, 0), BF16, NONE, topk_fusable=False) == "torch"
    assert choose("topk", "cuda", (9, 0), BF16, NONE, topk_fusable=True) == "triton"
    with pytest.raises(ValueError, match="op='attention' is not one of"):
        choose("attention", "cpu", None, F32)


# --------------------------------------------------------------------------- availability

@pytest.fixture
def fresh_probes():
    """Probes are answered once per process; a test that breaks something asks again."""
    for cache in (backends._probe, backends.choose_for, swiglu_cpu._library):
        cache.cache_clear()
    yield
    for cache in (backends._probe, backends.choose_for, swiglu_cpu._library):
        cache.cache_clear()


def _broken_grouped_gemm(tmp_path: Path, monkeypatch) -> None:
    """A grouped_gemm built against another torch: its import fails on an undefined symbol."""
    package = tmp_path / "fake_site" / "grouped_gemm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        'raise ImportError("grouped_gemm/backend.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev")\n')
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.delitem(sys.modules, "grouped_gemm", raising=False)


def test_grouped_gemm_that_does_not_import_is_not_chosen_and_naming_it_says_why(tmp_path, monkeypatch,
                                                                               fresh_probes):
    _broken_grouped_gemm(tmp_path, monkeypatch)
    reason = backends.problem("grouped_gemm", torch.device("cpu"))
    assert "import grouped_gemm failed" in reason and "undefined symbol" in reason
    assert "pip install 'moe-fold[gpu]'" in reason
    # As on an A100 (sm80) in bf16, where a working grouped_gemm would be chosen.
    monkeypatch.setattr(backends, "_cuda_capability", lambda device: (8, 0))
    assert backends.extras(torch.device("cuda", 0)) == frozenset()
    assert backends.choose_for("gemm", torch.device("cuda", 0), BF16) == "loop"
    with pytest.raises(BackendUnavailable, match="gemm backend 'grouped_gemm' cannot run here: .*undefined symbol"):
        gmm(torch.randn(4, 16), torch.randn(2, 16, 8), [1, 3], backend="grouped_gemm")
    # The answer is kept for the process: the import is not retried on every call.
    (tmp_path / "fake_site" / "grouped_gemm" / "__init__.py").write_text("")
    assert backends.problem("grouped_gemm", torch.device("cpu")) == reason


def _fake_compiler(tmp_path: Path, forward_body: str) -> str:
    """A `CC` that ignores the real source and builds one whose forward runs ``forward_body``."""
    source = tmp_path / "fake_swiglu.c"
    args = "const void *x, long sx, const void *p, void *out, long so, long f, long r0, long r1"
    bwd = "const void *g, long sg, const void *x, long sx, const void *p, void *gx, long sgx, void *gp, " \
          "long f, long r0, long r1"
    source.write_text(textwrap.dedent(f"""\
        void swiglu_forward_f32({args}) {{ {forward_body} }}
        void swiglu_forward_f64({args}) {{ }}
        void swiglu_backward_f32({bwd}) {{ }}
        void swiglu_backward_f64({bwd}) {{ }}
        """))
    script = tmp_path / "fake-cc"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        while [ "$#" -gt 0 ]; do
          if [ "$1" = "-o" ]; then out="$2"; fi
          shift
        done
        exec cc -shared -fPIC -o "$out" {source}
        """))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_c_swiglu_whose_call_gives_a_wrong_answer_is_unavailable(tmp_path, monkeypatch, fresh_probes):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, "((float *)out)[0] = 42.0f;"))
    reason = backends.problem("cpu", torch.device("cpu"))
    assert reason == "RuntimeError: the C SwiGLU returned [[42.0]] for silu(0) * 3, not 0"
    with pytest.raises(BackendUnavailable, match=r"swiglu backend auto chose 'cpu' for cpu torch.float32 cannot run "
                                                 r"here: RuntimeError: the C SwiGLU returned \[\[42.0\]\]"):
        swiglu(torch.randn(2, 4))
    assert swiglu(torch.zeros(2, 4), backend="torch").abs().sum() == 0  # naming torch still works


def test_triton_that_does_not_import_is_unavailable(monkeypatch, fresh_probes):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    assert backends.problem("triton", torch.device("cpu")).startswith("ModuleNotFoundError: import of triton halted")
    with pytest.raises(BackendUnavailable, match="gemm backend 'triton' cannot run here: ModuleNotFoundError"):
        gmm(torch.randn(4, 16), torch.randn(2, 16, 8), [1, 3], backend="triton")
    # auto on CPU never needed Triton.
    assert gmm(torch.randn(4, 16), torch.randn(2, 16, 8), [1, 3]).shape == (4, 8)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch, fresh_probes):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "TRITON_INTERPRET=1" in backends.problem("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.problem("triton", torch.device("cpu")) is None
    assert backends.problem("cpu", torch.device("meta")) == "the C kernels run on CPU tensors, got meta"


# --------------------------------------------------------------------------- a run's config

def _cfg(*overrides):
    return load_config("mixtral-tiny", ["wandb.mode=disabled", "parallel.ep=1", *overrides])


def test_resolve_config_names_what_auto_means_on_cpu():
    config = _cfg()
    assert (config.moe.gemm_backend, config.moe.permute_backend, config.moe.swiglu_backend,
            config.moe.topk_backend) == ("auto",) * 4
    moe = backends.resolve_config(config, torch.device("cpu")).moe
    assert (moe.gemm_backend, moe.permute_backend, moe.swiglu_backend, moe.topk_backend) == \
        ("torch", "torch", "cpu", "torch")
    assert config.moe.gemm_backend == "auto"  # the caller's config is left as it was
    moe = backends.resolve_config(_cfg("train.precision=bf16", "moe.swiglu_backend=torch"), torch.device("cpu")).moe
    assert (moe.gemm_backend, moe.swiglu_backend) == ("torch", "torch")


def test_gemm_backend_comes_from_the_config_or_the_rule():
    cpu = torch.device("cpu")
    assert backends.resolve_config(_cfg("moe.gemm_backend=loop"), cpu).moe.gemm_backend == "loop"
    assert backends.resolve_config(_cfg("moe.gemm_backend=torch"), cpu).moe.gemm_backend == "torch"
    assert backends.resolve_config(_cfg(), cpu).moe.gemm_backend == "torch"


def test_no_compiler_is_an_error_naming_the_field_and_the_fix(monkeypatch, tmp_path, fresh_probes):
    monkeypatch.setenv("CC", "no-such-compiler-moe-fold")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ConfigError) as info:
        backends.resolve_config(_cfg(), torch.device("cpu"))
    (line,) = info.value.problems
    assert line.startswith("moe.swiglu_backend=auto (chose cpu for cpu float32) cannot run here: BuildError: "
                           "swiglu backend 'cpu' needs a C compiler: 'no-such-compiler-moe-fold'")
    assert line.endswith("fix: install a C compiler (cc on PATH, or CC=/path/to/compiler), or set "
                         "moe.swiglu_backend=torch (the torch SwiGLU rounds differently: the C kernel's exp is a "
                         "polynomial)")
    assert backends.resolve_config(_cfg("moe.swiglu_backend=torch"), torch.device("cpu")).moe.swiglu_backend == "torch"


def test_cli_stops_before_any_rank_without_a_compiler(monkeypatch, tmp_path, capsys, fresh_probes):
    from moe_fold.cli import main

    monkeypatch.setenv("CC", "no-such-compiler-moe-fold")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    code = main(["train", "--config", "mixtral-tiny", "--nproc", "2", "--set", f"train.run_dir={run_dir}",
                 "--set", "wandb.mode=disabled"])
    assert code == 2
    err = capsys.readouterr().err
    assert "moe.swiglu_backend=auto (chose cpu for cpu float32) cannot run here" in err
    assert "or set moe.swiglu_backend=torch" in err
    assert not run_dir.exists()


SMALL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
         "model.ffn_hidden_size=64", "model.seq_length=16", "moe.ffn_hidden_size=32", "train.micro_batch_size=2",
         "train.global_batch_size=2", "train.steps=1", "train.save_every=1000", "optimizer.warmup_steps=1",
         "wandb.mode=disabled", "parallel.ep=1", "train.async_save=false"]


def _calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("key, ran", [("auto", "torch"), ("loop", "loop"), ("torch", "torch")])
def test_training_runs_and_records_the_resolved_backends(tmp_path, cache_dir, monkeypatch, key, ran):
    """moe.gemm_backend (``--set``) chooses the backend that runs in training; the run's
    config.yaml names what ran."""
    from moe_fold.kernels import gmm_loop, gmm_torch
    from moe_fold.training.train import train

    loop_calls = _calls(monkeypatch, gmm_loop, "gmm_loop")
    torch_calls = _calls(monkeypatch, gmm_torch, "gmm_torch")
    config = load_config("mixtral-tiny", SMALL + [f"train.run_dir={tmp_path}", f"data.cache_dir={cache_dir}",
                                                  f"moe.gemm_backend={key}"])
    train(config, progress=False)
    assert bool(loop_calls) == (ran == "loop") and bool(torch_calls) == (ran == "torch")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["moe"]
    assert {k: saved[k] for k in ("gemm_backend", "permute_backend", "swiglu_backend", "topk_backend")} == \
        {"gemm_backend": ran, "permute_backend": "torch", "swiglu_backend": "cpu", "topk_backend": "torch"}


# --------------------------------------------------------------------------- TF32

@pytest.fixture
def restore_fp32_precision():
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


def test_tf32_switch_applies_on_cuda_only(restore_fp32_precision):
    from moe_fold.training.train import set_tf32

    torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "ieee"
    set_tf32(_cfg(), torch.device("cpu"))
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    set_tf32(_cfg(), torch.device("cuda", 0))
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("tf32", "tf32")
    set_tf32(_cfg("train.tf32=false"), torch.device("cuda", 0))
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("ieee", "ieee")
    assert _cfg().train.tf32 is True

