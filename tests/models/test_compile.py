"""Compiled blocks (``train.compile=blocks``, docs/gpu.md "Compiled blocks"): the kernels
are custom ops with fake kernels and autograd formulas (``torch.library.opcheck``), a MoE
layer and every kind of block trace as one graph with no break in float32 and bfloat16
(``torch._dynamo.explain``), and the compiled forward + backward equals eager on the output
and every gradient (1e-5 relative in float32, 2e-2 in bfloat16).

Compiling is slow on a small CPU: the tracing checks use ``explain`` (no code generation),
the equality checks the ``aot_eager`` backend (Dynamo's graph and the ops' fake kernels and
autograd formulas, without Inductor's code generation), and one Inductor run per dtype
is marked slow."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from moe_fold.config import load_config
from moe_fold.kernels.gmm import gmm_op, gmm_wgrad
from moe_fold.kernels.permute import gather_op, unpermute_backward_op, unpermute_op
from moe_fold.kernels.swiglu import swiglu_backward_op, swiglu_op
from moe_fold.kernels.topk import topk_scores, topk_scores_backward
from moe_fold.models.model import Block, build_model, compile_blocks
from moe_fold.models.moe_layer import MoELayer

from tests.meta.test_forward_decides_nothing import ROUTING, _groups
from tests.models.test_moe_layer import _config, _inputs

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
FAST = ("dropless", "pad")


def _routing_params():
    return [pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in ROUTING]


# --------------------------------------------------------------------------- the ops

def _op_cases(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, generator=g).to(dtype)
    w = torch.randn(3, 6, 4, generator=g).to(dtype)
    counts = torch.tensor([4, 0, 6])
    dy = torch.randn(10, 4, generator=g).to(dtype)
    h = torch.randn(10, 8, generator=g).to(dtype)
    probs = torch.rand(10, generator=g)
    logits = torch.randn(10, 5, generator=g)
    idx = torch.tensor([3, 0, 0, 2, 5, 5, 1, 4, 6, 6])  # 6 = the sentinel of 6 tokens
    tokens = torch.randn(6, 6, generator=g).to(dtype)
    routed = topk_scores(logits, 2, "softmax", False, "torch")
    return [
        (gmm_op, (x, w, counts, None, False, "torch")),
        (gmm_op, (x, w.transpose(1, 2).contiguous(), counts, [4, 0, 6], True, "auto")),
        (gmm_op, (x, w, counts, None, False, "loop")),
        (gmm_wgrad, (x, dy, counts, None, False, "torch")),
        (swiglu_op, (h, probs.to(dtype), "torch")),
        (swiglu_op, (h, None, "torch")),
        (swiglu_backward_op, (h[:, :4].contiguous(), h, probs.to(dtype), True, "torch")),
        (gather_op, (tokens, idx, True, "torch")),
        (unpermute_op, (x, idx, 6, probs.to(dtype), "torch")),
        (unpermute_backward_op, (tokens, idx, x, probs.to(dtype), True, "torch")),
        (topk_scores, (logits, 2, "softmax", False, "torch")),
        (topk_scores, (logits, 3, "sigmoid", False, "auto")),
        (topk_scores_backward, (torch.randn(10, 5, generator=g), logits, *routed, 2, "softmax", False, "torch")),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_every_op_has_a_fake_kernel_and_an_autograd_formula(dtype):
    """opcheck: the schema, the fake kernel against the real one (shapes, dtypes, strides
    of every output), the autograd registration, and the forward ops under AOT autograd
    (the backward ops have no formula of their own: there is no double backward)."""
    forward_ops = (gmm_op, swiglu_op, gather_op, unpermute_op, topk_scores)
    for op, args in _op_cases(dtype):
        if op in forward_ops:
            args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in args)
            torch.library.opcheck(op, args)
        else:
            torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration",
                                                        "test_faketensor"))


def test_the_gemm_op_traces_in_float32_where_grouped_mm_takes_bfloat16_only():
    """torch._grouped_mm's meta kernel takes bfloat16 only; ours takes every dtype."""
    x, w = torch.randn(8, 4), torch.randn(2, 4, 3)
    counts = torch.tensor([3, 5])
    fn = torch.compile(lambda a, b: gmm_op(a, b, counts, None, False, "torch"), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(x, w), torch.cat([x[:3] @ w[0], x[3:] @ w[1]]))


# --------------------------------------------------------------------------- one graph

def _explain(module, *args, **kwargs):
    dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        return dynamo.explain(module)(*args, **kwargs)


def _layer_inputs(dtype):
    x = _inputs().to(dtype)
    return x, dict(seq_ids=torch.arange(x.shape[0]) % 2, num_seqs=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("routing", _routing_params())
def test_moe_layer_traces_as_one_graph(routing, dtype):
    layer = MoELayer(_config(**ROUTING[routing]), _groups(), 0).to(dtype)
    x, kwargs = _layer_inputs(dtype)
    found = _explain(layer, x, **kwargs)
    assert (found.graph_count, found.graph_break_count) == (1, 0), [b.reason for b in found.break_reasons]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_every_block_kind_traces_as_one_graph(dtype):
    """deepseek-v3-tiny: MLA attention, a dense block, MoE blocks with a shared expert and
    sigmoid group-limited routing with an expert bias, and the MTP depth's block."""
    config = load_config("deepseek-v3-tiny", ["model.seq_length=16"])
    model = build_model(config, _groups()).to(dtype)
    cos, sin = model._rotary(torch.arange(16))
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    kinds = {(type(b.mlp).__name__, b in list(model.mtp.modules())) for b in blocks}
    assert kinds == {("MLP", False), ("MoELayer", False), ("MoELayer", True)}
    seen = set()
    for block in blocks:
        kind = (type(block.mlp).__name__, block in list(model.mtp.modules()))
        if kind in seen:
            continue
        seen.add(kind)
        x = torch.randn(16, 2, config.model.hidden_size).to(dtype)
        found = _explain(block, x, cos, sin)
        assert (found.graph_count, found.graph_break_count) == (1, 0), (kind, [b.reason for b in found.break_reasons])


# --------------------------------------------------------------------------- same numbers

def _forward_backward(layer, x, kwargs):
    x = x.detach().clone().requires_grad_()
    out = layer(x, **kwargs)
    out.float().square().sum().backward()
    grads = {name.removeprefix("_orig_mod."): p.grad.clone() for name, p in layer.named_parameters()
             if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def _assert_equal_within(got, want, dtype):
    tol = TOL[dtype]
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(scale, 1e-6))


def _compiled_equals_eager(routing, dtype, backend):
    layer = MoELayer(_config(**{"aux_loss_coeff": 0.01, "z_loss_coeff": 0.001, **ROUTING[routing]}), _groups(), 0).to(dtype)
    x, kwargs = _layer_inputs(dtype)
    want = _forward_backward(layer, x, kwargs)
    dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(layer, fullgraph=True, backend=backend)
        got = _forward_backward(compiled, x, kwargs)
    _assert_equal_within(got[0], want[0], dtype)
    _assert_equal_within(got[1], want[1], dtype)
    assert got[2].keys() == want[2].keys() and len(want[2]) >= 3
    for name in want[2]:
        _assert_equal_within(got[2][name], want[2][name], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("routing", _routing_params())
def test_compiled_moe_layer_equals_eager(routing, dtype):
    _compiled_equals_eager(routing, dtype, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("dtype, routing", [(torch.float32, "dropless"), (torch.bfloat16, "pad")],
                         ids=["fp32-dropless", "bf16-pad"])
def test_inductor_moe_layer_equals_eager(routing, dtype):
    _compiled_equals_eager(routing, dtype, "inductor")


# --------------------------------------------------------------------------- training

@pytest.mark.slow
def test_twenty_steps_with_compiled_blocks_equal_eager(tmp_path, cache_dir):
    """``train.compile=blocks`` (Inductor, every block fullgraph): 20 steps of the small
    mixtral-tiny run give eager's losses and gradient norms within 1e-5 relative."""
    from moe_fold.training.train import read_metrics, train

    from tests.training.test_train import small_config

    steps = ["train.steps=20"]
    train(small_config(tmp_path / "eager", cache_dir, *steps), progress=False)
    train(small_config(tmp_path / "compiled", cache_dir, *steps, "train.compile=blocks"), progress=False)
    want, got = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "compiled")
    assert [r["step"] for r in got] == list(range(1, 21))
    for a, b in zip(want, got):
        for key in ("loss", "grad_norm", "aux_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)


# --------------------------------------------------------------------------- ep 2 on gloo ranks
# Under compile the collectives are torch's functional collectives (moe_fold/comm.py), the
# dropless splits unbacked sizes read from the one count exchange. Starting two ranks costs
# more than a case, so one start runs them all.

EP_ROUTING = {
    **{name: ROUTING[name] for name in ("dropless", "capacity", "pad", "overlap", "allgather")},
    "dedup": {"dedup": True},
    "allgather-capacity-overlap": {"dispatcher": "allgather", "capacity_factor": 1.0,
                                   "shared_expert_ffn_hidden_size": 20, "shared_expert_overlap": True,
                                   "overlap_chunks": 2},
}


def _ep_groups(world_size):
    from moe_fold.layout import ParallelLayout, create_process_groups

    return create_process_groups(ParallelLayout(world_size, ep=2))


def _ep_layer(routing, dtype, groups):
    config = _config(**{"aux_loss_coeff": 0.01, "z_loss_coeff": 0.001, **EP_ROUTING[routing]})
    return MoELayer(config, groups, 0).to(dtype)


def _ep_explain_rank(rank, world_size, cases, blocks):
    """``{(routing, dtype): (graphs, breaks, reasons)}`` of the MoE layer at ep 2; with
    ``blocks``, also of each block kind of deepseek-v3-tiny (dense MLA, MoE, the MTP depth's)."""
    groups, found = _ep_groups(world_size), {}
    for routing, dtype in cases:
        layer = _ep_layer(routing, dtype, groups)
        x, kwargs = _layer_inputs(dtype)
        e = _explain(layer, x + rank, **kwargs)
        found[(routing, str(dtype))] = (e.graph_count, e.graph_break_count, [str(b.reason) for b in e.break_reasons])
    config = load_config("deepseek-v3-tiny", ["model.seq_length=16", "parallel.ep=2"])
    for dtype in DTYPES if blocks else ():
        model = build_model(config, groups).to(dtype)
        cos, sin = model._rotary(torch.arange(16))
        mtp = list(model.mtp.modules())
        for block in (m for m in model.modules() if isinstance(m, Block)):
            kind = (type(block.mlp).__name__, block in mtp, str(dtype))
            if kind not in found:
                e = _explain(block, torch.randn(16, 2, config.model.hidden_size).to(dtype) + rank, cos, sin)
                found[kind] = (e.graph_count, e.graph_break_count, [str(b.reason) for b in e.break_reasons])
    return found


EP_FAST = ("dropless", "pad", "allgather")


@pytest.mark.parametrize("part", ["dropless-pad-allgather",
                                  pytest.param("the-others-and-blocks", marks=pytest.mark.slow)])
def test_ep2_moe_layer_and_every_block_kind_trace_as_one_graph(part):
    """At ep 2 on gloo ranks, float32 and bfloat16: the MoE layer with dropless, capacity and
    padded routing, the all-to-all (plain, dedup) and all-gather dispatchers, both overlap
    switches; and deepseek-v3-tiny's dense, MoE and MTP blocks."""
    from moe_fold.launch import run_ranks

    fast = part == "dropless-pad-allgather"
    cases = [(routing, dtype) for routing in EP_ROUTING for dtype in DTYPES if (routing in EP_FAST) == fast]
    results = run_ranks(_ep_explain_rank, 2, cases, not fast, timeout=600)
    for rank, found in enumerate(results):
        assert len(found) == len(cases) + (0 if fast else 6)
        for case, (graphs, breaks, reasons) in found.items():
            assert (graphs, breaks) == (1, 0), (rank, case, reasons)


def _ep_equal_rank(rank, world_size, cases):
    """For each case the eager and the compiled (``aot_eager``) forward + backward of this
    rank's tokens: output, input grad and every parameter grad."""
    groups, out = _ep_groups(world_size), []
    for routing, dtype in cases:
        layer = _ep_layer(routing, dtype, groups)
        x, kwargs = _layer_inputs(dtype)
        x = (x + 0.5 * rank).to(dtype)
        want = _forward_backward(layer, x, kwargs)
        dynamo.reset()
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            got = _forward_backward(torch.compile(layer, fullgraph=True, backend="aot_eager"), x, kwargs)
        out.append((want, got))
    return out


EP_EQUAL = [("dropless", torch.float32), ("capacity", torch.bfloat16), ("pad", torch.float32),
            ("overlap", torch.float32), ("dedup", torch.bfloat16), ("allgather-capacity-overlap", torch.float32),
            ("allgather", torch.bfloat16)]


@pytest.mark.slow
@pytest.mark.parametrize("half", [0, 1])
def test_ep2_compiled_moe_layer_equals_eager(half):
    """The compiled forward + backward at ep 2 equals eager on every rank (1e-5 relative in
    float32, 2e-2 in bfloat16), output, input grad and every parameter grad."""
    from moe_fold.launch import run_ranks

    cases = EP_EQUAL[half::2]
    results = run_ranks(_ep_equal_rank, 2, cases, timeout=600)
    for rank, per_case in enumerate(results):
        for (routing, dtype), (want, got) in zip(cases, per_case):
            _assert_equal_within(got[0], want[0], dtype)
            _assert_equal_within(got[1], want[1], dtype)
            assert got[2].keys() == want[2].keys() and len(want[2]) >= 3, (rank, routing)
            for name in want[2]:
                _assert_equal_within(got[2][name], want[2][name], dtype)


# --------------------------------------------------------------------------- DSA

def _dsa_model(stage):
    """tests/models/test_dsa.py's 4-layer DSA model (a dense block, then MoE blocks; GLM-5's
    shared layers in the sparse stage), its KL weighted 0.5."""
    from moe_fold.layout import ProcessGroups
    from tests.models.test_dsa import RECOMPUTE_DSA, RECOMPUTE_STAGES
    from tests.parallel.test_varlen import _config

    config = _config({**RECOMPUTE_DSA, **RECOMPUTE_STAGES[stage]})
    config.moe.first_k_dense = 1
    return build_model(config, ProcessGroups.single_process())


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse-glm5"])
def test_every_dsa_block_traces_as_one_graph(stage):
    """A DSA layer's block (indexer, top-k selection, sparse MLA, the KL attached), a full
    layer writing its selection and a shared layer reading it, as one graph."""
    model = _dsa_model(stage)
    cos, sin = model._rotary(torch.arange(16))
    x, selections = torch.randn(16, 2, model.config.model.hidden_size), {}
    for i, block in enumerate(model.layers):
        found = _explain(block, x, cos, sin, selections=selections, loss_scale=0.5)
        assert (found.graph_count, found.graph_break_count) == (1, 0), (i, [b.reason for b in found.break_reasons])
        x = block(x, cos, sin, selections=selections, loss_scale=0.5)
    assert sorted(selections) == ([0, 2] if stage == "sparse-glm5" else [0, 1, 2, 3])


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse-glm5"])
def test_compiled_dsa_blocks_equal_eager(stage):
    """``train.compile=blocks`` on the DSA model (``aot_eager``), packed documents, two
    micro-batches: eager's loss and every gradient, the KL-trained indexers' included."""
    from moe_fold.layout import ProcessGroups
    from moe_fold.training.step import forward_backward
    from tests.parallel.test_varlen import _packed_batch

    batches = [_packed_batch(), _packed_batch(row_docs=[[16], [2, 14]])]
    runs = []
    for compiled in (False, True):
        model = _dsa_model(stage)
        dynamo.reset()
        if compiled:
            compile_blocks(model, backend="aot_eager")
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            loss = forward_backward(model, batches, ProcessGroups.single_process(), model.config).sum()
        runs.append((loss, {n.replace("._orig_mod", ""): p.grad for n, p in model.named_parameters()
                            if p.grad is not None}))
    (want, want_grads), (got, grads) = runs
    _assert_equal_within(got, want, torch.float32)
    assert grads.keys() == want_grads.keys() and any(".indexer." in n for n in grads)
    for name, g in want_grads.items():
        _assert_equal_within(grads[name], g, torch.float32)
