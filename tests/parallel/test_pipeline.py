"""Pipeline parallelism against the single-process model with the same weights and data (the
schedules' plans on their own: tests/parallel/test_pipeline_schedules.py).

The toy model: an embedding, a few residual layers, a head and a cross-entropy
loss. Every layer has a tiny router whose softmax probs carry a load-balance-like aux
loss attached through autograd (an identity op whose backward adds the aux loss's
gradient, as the MoE layers do), so the tests check that such terms reach the grads in
every schedule. Layer ``i`` is initialised from seed ``1000 + i`` wherever it lives.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_fold.comm import count_bytes
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.parallel.pipeline import (all_reduce_embedding_grads, copy_embedding_from_first, create_embedding_group,
                               run_schedule, stage_layers)
from moe_fold.parallel.pipeline_schedules import Exchange, make_plan

HIDDEN, VOCAB, EXPERTS, BATCH, SEQ = 8, 11, 4, 2, 3
AUX_COEF = 0.3


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny single-process references run many small ops: on a busy machine, threads
    that wait for each other cost far more than they save (x40 measured here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _AttachAux(torch.autograd.Function):
    """Identity on ``x``; its backward also sends gradient ``scale`` into ``aux``."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class ToyLayer(nn.Module):
    def __init__(self, index, aux_scale):
        super().__init__()
        gen = torch.Generator().manual_seed(1000 + index)
        self.fc = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN ** 0.5)
        self.router = nn.Parameter(torch.randn(HIDDEN, EXPERTS, generator=gen))
        self.gate = nn.Parameter(torch.randn(EXPERTS, generator=gen))
        self.aux_scale = aux_scale

    def forward(self, x):  # [b, s, h] -> [b, s, h]
        probs = torch.softmax(x @ self.router, dim=-1)  # [b, s, E]
        aux = EXPERTS * (probs.mean(dim=(0, 1)) ** 2).sum()
        probs = _AttachAux.apply(probs, aux, self.aux_scale)
        return x + torch.tanh(x @ self.fc) * (probs @ self.gate).unsqueeze(-1)


def _embedding():
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))


class ToyChunk(nn.Module):
    """Layers ``layer_ids``, with the embedding when ``first`` and the head when ``last``."""

    def __init__(self, layer_ids, first, last, aux_scale, tied=False):
        super().__init__()
        self.layer_ids = list(layer_ids)
        self.layers = nn.ModuleList([ToyLayer(i, aux_scale) for i in layer_ids])
        self.embed = nn.Parameter(_embedding()) if first else None
        self.head = None
        if last:
            if tied and first:
                self.head = self.embed
            elif tied:  # a wrong start on purpose: copy_embedding_from_first must fix it
                self.head = nn.Parameter(torch.zeros(VOCAB, HIDDEN))
            else:
                self.head = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(2)))

    def forward(self, x, gain=None):
        if self.embed is not None:
            x = self.embed[x["ids"]]  # [b, s] -> [b, s, h]
        for layer in self.layers:
            x = layer(x)
            if gain is not None:  # a per-micro-batch side input every stage needs
                x = x * gain
        if self.head is not None:
            x = x @ self.head.t()  # [b, s, h] -> [b, s, vocab]
        return x

    def named_grads(self):
        out = {}
        for i, layer in zip(self.layer_ids, self.layers):
            for name, p in layer.named_parameters():
                out[f"layer{i}.{name}"] = p.grad.clone()
        if self.embed is not None:
            out["embed"] = self.embed.grad.clone()
        if self.head is not None and self.head is not self.embed:
            out["head"] = self.head.grad.clone()
        return out


def _microbatches(m, seed):
    gen = torch.Generator().manual_seed(seed)
    return [{"ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
             "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
             "gain": 0.5 + torch.rand((), generator=gen)} for _ in range(m)]


def _gain(mb):
    return {"gain": mb["gain"]}


def _loss_fn(m):
    return lambda logits, mb: F.cross_entropy(logits.reshape(-1, VOCAB), mb["labels"].reshape(-1)) / m


def _reference(m, seed, tied, num_layers, side=False):
    """The single-process model: micro-batches one after another, losses and grads."""
    model = ToyChunk(range(num_layers), True, True, AUX_COEF / m, tied)
    loss_fn = _loss_fn(m)
    losses = []
    for mb in _microbatches(m, seed):
        loss = loss_fn(model(mb, **(_gain(mb) if side else {})), mb)
        loss.backward()
        losses.append(loss.detach().double())
    grads = model.named_grads()
    if tied:
        grads["head"] = grads["embed"]
    return torch.stack(losses), grads


def _run_case(groups, emb_group, case):
    schedule, vpp, m = case["schedule"], case["vpp"], case["m"]
    num_layers = case["num_layers"]
    tied, pp_layers = case.get("tied", False), case.get("pp_layers")
    pp, r = groups.size("pp"), groups.rank_in("pp")
    layers = stage_layers(num_layers, pp, vpp, pp_layers)
    stages = pp * vpp
    chunks = [ToyChunk(layers[c * pp + r], c * pp + r == 0, c * pp + r == stages - 1, AUX_COEF / m, tied)
              for c in range(vpp)]
    if tied:
        tied_weight = chunks[0].embed if r == 0 else chunks[-1].head if r == pp - 1 else None
        if tied_weight is not None:
            copy_embedding_from_first(tied_weight, groups, emb_group)
    seed = case.get("seed", 0) + 100 * groups.rank_in("dp")
    forward_only = case.get("forward_only", False)
    with count_bytes() as sent:
        losses = run_schedule(chunks, _microbatches(m, seed), groups, tensor_shape=(BATCH, SEQ, HIDDEN),
                              schedule=schedule, loss_fn=_loss_fn(m), forward_only=forward_only,
                              side_inputs=_gain if case.get("side", False) else None)
    if pp > 1:
        # The pp traffic is the plan's messages from this rank plus the loss all-reduce.
        plan = make_plan(schedule, pp, vpp, m, forward_only)
        messages = sum(msg.src == r for item in plan.programs[r] if isinstance(item, Exchange)
                       for msg in item.messages)
        assert sent == {"pp": messages * BATCH * SEQ * HIDDEN * 4 + 2 * (pp - 1) * m * 8 // pp}, sent
    if forward_only:
        assert all(p.grad is None for c in chunks for p in c.parameters())
        return {"losses": losses, "grads": {}, "seed": seed}
    if tied and tied_weight is not None:
        all_reduce_embedding_grads(tied_weight, emb_group)
    grads = {}
    for chunk in chunks:
        grads.update(chunk.named_grads())
    if tied and r == pp - 1:
        grads["head_weight"] = chunks[-1].head.detach().clone()
    return {"losses": losses, "grads": grads, "seed": seed}


def _portable(result):
    """Tensors as nested lists (float32 values survive exactly): tensors in the result
    queue are shared by file descriptor, which can vanish with the rank that sent them."""
    return {"seed": result["seed"], "losses": result["losses"].tolist(),
            "grads": {name: g.tolist() for name, g in result["grads"].items()}}


def _from_portable(result):
    return {"seed": result["seed"], "losses": torch.tensor(result["losses"], dtype=torch.float64),
            "grads": {name: torch.tensor(g) for name, g in result["grads"].items()}}


def _pipeline_worker(rank, world_size, runs):
    """``runs``: (pp, cases) pairs, each on the layout with that pp (dp = world / pp)."""
    out = []
    for pp, cases in runs:
        groups = create_process_groups(ParallelLayout(world_size, pp=pp))
        emb_group = create_embedding_group(groups)
        out.append({"pp_ranks": groups.ranks("pp"),
                    "results": [_portable(_run_case(groups, emb_group, c)) for c in cases]})
    return out


def _check(outputs, cases):
    """Per pp group: every rank's losses and the union of its grads equal the reference."""
    pp_groups = {tuple(o["pp_ranks"]) for o in outputs}
    for ranks in pp_groups:
        for k, case in enumerate(cases):
            results = [_from_portable(outputs[r]["results"][k]) for r in ranks]
            ref_losses, ref_grads = _reference(case["m"], results[0]["seed"], case.get("tied", False),
                                               case["num_layers"], case.get("side", False))
            for res in results:
                torch.testing.assert_close(res["losses"], ref_losses, msg=lambda s: f"{case}: losses {s}")
            if case.get("forward_only", False):
                continue
            grads = {}
            for res in results:
                for name, g in res["grads"].items():
                    assert name not in grads, f"{case}: {name} on two ranks"
                    grads[name] = g
            if case.get("tied", False):
                torch.testing.assert_close(grads.pop("head_weight"), _embedding(), rtol=0, atol=0)
            assert sorted(grads) == sorted(ref_grads), case
            for name, g in ref_grads.items():
                torch.testing.assert_close(grads[name], g, msg=lambda s: f"{case}: grad of {name} {s}")


def _cases(pp):
    """Both schedules over several micro-batch counts, tied embeddings, forward only, side
    inputs and uneven layer splits; ``2 * pp`` layers unless a case says otherwise."""
    cases = [{"schedule": "1f1b", "vpp": 1, "m": m} for m in (1, 3, 4, 8)]
    cases += [{"schedule": "interleaved", "vpp": 2, "m": m} for m in (pp, 2 * pp if pp > 2 else 3 * pp)]
    cases += [
        {"schedule": "1f1b", "vpp": 1, "m": 3, "tied": True},
        {"schedule": "interleaved", "vpp": 2, "m": pp, "tied": True},
        {"schedule": "1f1b", "vpp": 1, "m": 3, "forward_only": True},
        {"schedule": "1f1b", "vpp": 1, "m": 3, "side": True},
        {"schedule": "interleaved", "vpp": 2, "m": 2 * pp, "side": True},
        {"schedule": "interleaved", "vpp": 2, "m": pp, "forward_only": True},
        {"schedule": "1f1b", "vpp": 1, "m": 4, "pp_layers": [1, 3] if pp == 2 else [3, 1, 2, 2]},
        {"schedule": "interleaved", "vpp": 2, "m": pp, "num_layers": 2 * pp + 1,
         "pp_layers": [2] + [1] * (2 * pp - 1)},
    ]
    return [{"num_layers": 2 * pp, **case, "seed": k} for k, case in enumerate(cases)]


def _pp2_dp2_cases():
    return [{"schedule": "1f1b", "vpp": 1, "m": 3, "tied": True, "num_layers": 4, "seed": 31},
            {"schedule": "interleaved", "vpp": 2, "m": 4, "num_layers": 4, "seed": 32}]


@pytest.fixture(scope="module")
def world4():
    """One 4-rank launch for both 4-rank layouts: pp 4, then pp 2 x dp 2."""
    return run_ranks(_pipeline_worker, 4, [(4, _cases(4)), (2, _pp2_dp2_cases())], timeout=240)


def test_pp2_schedules_match_single_process():
    cases = _cases(2)
    _check([out[0] for out in run_ranks(_pipeline_worker, 2, [(2, cases)], timeout=240)], cases)


def test_pp4_schedules_match_single_process(world4):
    _check([out[0] for out in world4], _cases(4))


def test_pp2_dp2_groups_from_layout(world4):
    outputs = [out[1] for out in world4]
    # Default order tp-cp-ep-dp-pp: pp varies slowest, so the pp groups are {0, 2}, {1, 3}.
    assert [tuple(o["pp_ranks"]) for o in outputs] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    _check(outputs, _pp2_dp2_cases())


@pytest.mark.parametrize("schedule,vpp,m", [("1f1b", 1, 3), ("interleaved", 2, 3), ("interleaved", 3, 4)])
def test_single_rank_pipeline(schedule, vpp, m):
    """pp = 1: chunks hand over to each other on one rank, no process group needed."""
    groups = ProcessGroups.single_process()
    case = {"schedule": schedule, "vpp": vpp, "m": m, "seed": 40 + m, "num_layers": 2 * vpp}
    result = _run_case(groups, None, case)
    ref_losses, ref_grads = _reference(m, case["seed"], False, 2 * vpp)
    torch.testing.assert_close(result["losses"], ref_losses)
    assert sorted(result["grads"]) == sorted(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(result["grads"][name], g)


def test_aux_loss_reaches_the_grads():
    """The toy aux term is not a no-op: without it the router grads differ."""
    m = 2
    with_aux = ToyChunk(range(2), True, True, AUX_COEF / m)
    without = ToyChunk(range(2), True, True, 0.0)
    for model in (with_aux, without):
        for mb in _microbatches(m, 5):
            _loss_fn(m)(model(mb), mb).backward()
    diff = (with_aux.layers[0].router.grad - without.layers[0].router.grad).abs().max()
    assert diff > 1e-3


def test_wrong_tensor_shape_names_the_stage():
    groups = ProcessGroups.single_process()
    chunks = [ToyChunk([0], True, False, 0.5), ToyChunk([1], False, True, 0.5)]
    with pytest.raises(ValueError, match=r"stage 0 returned \(2, 3, 8\).*tensor_shape=\(2, 3, 9\)"):
        run_schedule(chunks, _microbatches(2, 0), groups, tensor_shape=(BATCH, SEQ, 9),
                     schedule="interleaved", loss_fn=_loss_fn(2))


def test_chunk_count_must_fit_the_schedule():
    groups = ProcessGroups.single_process()
    with pytest.raises(ValueError, match="chunks is empty"):
        run_schedule([], _microbatches(1, 0), groups, tensor_shape=(BATCH, SEQ, HIDDEN))
    two = [ToyChunk([0], True, False, 0.5), ToyChunk([1], False, True, 0.5)]
    with pytest.raises(ValueError, match=r"parallel.vpp=2 requires parallel.pp_schedule=interleaved \(or auto\), got 1f1b"):
        run_schedule(two, _microbatches(1, 0), groups, tensor_shape=(BATCH, SEQ, HIDDEN), loss_fn=_loss_fn(1))


def test_last_stage_must_give_a_scalar():
    groups = ProcessGroups.single_process()
    chunks = [ToyChunk([0, 1], True, True, 0.5)]
    with pytest.raises(ValueError, match=r"scalar loss per micro-batch, got \(2, 3, 11\)"):
        run_schedule(chunks, _microbatches(1, 0), groups, tensor_shape=(BATCH, SEQ, HIDDEN))


# ----------------------------------------------------------------- layer split

def test_stage_layers_even_and_explicit():
    assert stage_layers(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert stage_layers(8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layers(6, 2, 1, [1, 5]) == [[0], [1, 2, 3, 4, 5]]
    assert stage_layers(5, 2, 2, [2, 1, 1, 1]) == [[0, 1], [2], [3], [4]]


@pytest.mark.parametrize("args,message", [
    ((7, 2, 1, None), r"model.num_layers=7 is not divisible by parallel.pp\*vpp=2 \(set parallel.pp_layers to "
                      r"split the layers unevenly\)"),
    ((8, 2, 2, [4, 4]), r"parallel.pp_layers has 2 entries, expected one per model chunk \(parallel.pp\*vpp=4\)"),
    ((8, 2, 1, [3, 4]), r"parallel.pp_layers=\[3, 4\] sums to 7, expected model.num_layers=8"),
    ((8, 2, 1, [0, 8]), r"parallel.pp_layers\[0\]=0 must be >= 1"),
    ((8, 0, 1, None), r"pp=0 must be a positive integer"),
])
def test_stage_layers_errors(args, message):
    with pytest.raises(ValueError, match=message):
        stage_layers(*args)
