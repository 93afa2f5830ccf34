"""Layout invariance of the router: tp/cp/dp splits of one global batch on 2, 4 and 8 gloo
ranks give the single-process loss values, router weight gradients, hidden-state
gradients and expert bias.

Data: a global batch of ``dp * M`` micro-batches of ``B`` sequences of ``S`` tokens, with
padding. dp rank d runs micro-batches ``d*M .. d*M+M-1``; inside a micro-batch, cp splits
each sequence into 2*cp chunks (rank r holds chunks r and 2cp-1-r, Megatron's load-balanced
order) and tp (sequence parallel) splits a cp rank's slice again. The ranks emulate the
training loop: main loss ``grad_scale * cp * sum(probs * G) / tokens_in_microbatch`` (a
micro-batch mean, scaled by cp because gradients are averaged over dp x cp), router
gradients summed over tp and averaged over dp x cp. The reference is one process running
the dp * M micro-batches with ``grad_scale = 1 / (dp * M)``.
"""

import pytest
import torch

from moe_fold.comm import all_reduce_
from moe_fold.config import MoEConfig
from moe_fold.dispatch.router import Router
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups

H, E, B, S = 16, 8, 2, 16
LOCAL = dict(aux_loss_coeff=0.3, seq_aux_loss_coeff=0.2, z_loss_coeff=0.1)
GLOBAL = dict(aux_loss_coeff=0.0, global_aux_loss_coeff=0.4)
BIAS = dict(aux_loss_coeff=0.0, score_function="sigmoid", expert_bias=True, bias_update_rate=0.05)
# LongCat-Flash: 4 zero experts after the E held ones, the softmax expert bias, the
# load-balancing and z losses over every column (the main loss sees the held probs).
ZERO = dict(aux_loss_coeff=0.3, z_loss_coeff=0.1, zero_experts=4, topk=3, pre_softmax=True, expert_bias=True,
            bias_update_rate=0.05)


def make_router(groups, **moe):
    torch.manual_seed(0)
    return Router(MoEConfig(num_experts=E, **{"topk": 2, **moe}), H, groups)


def global_batch(num_microbatches):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(num_microbatches, B, S, H, generator=g)
    target = torch.randn(num_microbatches, B, S, E, generator=g)
    mask = torch.rand(num_microbatches, B, S, generator=g) > 0.2
    return hidden, target, mask


def positions(S, tp, cp, tp_rank, cp_rank):
    """Token positions of one sequence that a (tp, cp) rank holds."""
    chunk = S // (2 * cp)
    mine = list(range(cp_rank * chunk, (cp_rank + 1) * chunk))
    mine += list(range((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk))
    per_tp = len(mine) // tp
    return torch.tensor(mine[tp_rank * per_tp:(tp_rank + 1) * per_tp])


def flat(x):
    # [B, s, ...] -> [B*s, ...]
    return x.reshape(-1, *x.shape[2:])


def run_microbatches(router, hidden, target, mask, mb_ids, pos, grad_scale, cp):
    """Forward + backward of the given micro-batches; returns the per-micro-batch loss values
    and the gradient of every hidden token (the [len(mb_ids), B, len(pos), H] layout)."""
    values, hidden_grads = [], []
    for m in mb_ids:
        h = flat(hidden[m][:, pos]).clone().requires_grad_(True)
        out = router(h, loss_mask=flat(mask[m][:, pos]), seq_ids=torch.arange(B).repeat_interleave(len(pos)),
                     num_seqs=B, loss_scale=grad_scale)
        main = (out.probs * flat(target[m][:, pos])).sum() / (B * S)
        (grad_scale * cp * main).backward()
        values.append({k: float(v) for k, v in out.losses.items()})
        hidden_grads.append(h.grad.view(B, len(pos), H))
    return values, torch.stack(hidden_grads)


def rank_fn(rank, world_size, layouts, M):
    # Several layouts in one set of processes: starting ranks costs more than the test.
    return [_numpy(one_layout(rank, world_size, tp, cp, M)) for tp, cp in layouts]


def one_layout(rank, world_size, tp, cp, M):
    layout = ParallelLayout(world_size, tp=tp, cp=cp)
    groups = create_process_groups(layout)
    c = layout.coords(rank)
    dp = layout.dp
    hidden, target, mask = global_batch(dp * M)
    pos = positions(S, tp, cp, c["tp"], c["cp"])
    mine = range(c["dp"] * M, (c["dp"] + 1) * M)
    out = {"pos": pos, "mbs": list(mine)}

    def reduced_grad(router):
        g = router.weight.grad.clone()
        all_reduce_(g, groups.tp)
        all_reduce_(g, groups.dp_cp)
        return g / groups.size("dp_cp")

    # "global1": one micro-batch per rank (this rank's first).
    for name, moe, ids in (("local", LOCAL, list(mine)), ("global", GLOBAL, list(mine)),
                           ("global1", GLOBAL, [mine[0]])):
        router = make_router(groups, **moe)
        values, hgrads = run_microbatches(router, hidden, target, mask, ids, pos, 1.0 / len(ids), cp)
        out[name] = dict(values=values, hgrads=hgrads, wgrad=reduced_grad(router), step=router.finish_step(),
                         ids=ids)

    router = make_router(groups, **BIAS)
    run_microbatches(router, hidden, target, mask, list(mine), pos, 1.0 / M, cp)
    router.finish_step()
    out["bias"] = router.expert_bias.clone()

    router = make_router(groups, **ZERO)
    values, _ = run_microbatches(router, hidden, target, mask, list(mine), pos, 1.0 / M, cp)
    out["zero"] = dict(values=values, wgrad=reduced_grad(router))
    router.finish_step()
    out["zero"]["bias"] = router.expert_bias.clone()
    return out


def _numpy(obj):
    # Tensors cross the process boundary as numpy arrays: a torch tensor would be sent
    # through shared memory that vanishes when the rank exits.
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy()
    if isinstance(obj, dict):
        return {k: _numpy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_numpy(v) for v in obj]
    return obj


def reference(mb_ids, moe, grad_scale):
    hidden, target, mask = global_batch(max(mb_ids) + 1)
    router = make_router(ProcessGroups.single_process(), **moe)
    values, hgrads = run_microbatches(router, hidden, target, mask, mb_ids, torch.arange(S), grad_scale, 1)
    return dict(values=values, hgrads=hgrads, wgrad=router.weight.grad, step=router.finish_step(), router=router)


def check_values(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k


# (tp, cp) per world size; dp is what is left.
LAYOUTS = {2: [(2, 1), (1, 2), (1, 1)], 4: [(2, 2), (2, 1), (1, 2)], 8: [(2, 2)]}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_router_layout_invariance(world):
    M = 2
    per_rank = run_ranks(rank_fn, world, LAYOUTS[world], M, timeout=240)
    for i, (tp, cp) in enumerate(LAYOUTS[world]):
        check_layout(world, tp, cp, M, [_torch(r[i]) for r in per_rank])


def check_layout(world, tp, cp, M, results):
    dp = world // (tp * cp)
    all_mbs = list(range(dp * M))

    # aux, seq_aux, z: the reference runs every micro-batch of the global batch.
    ref = reference(all_mbs, LOCAL, 1.0 / (dp * M))
    # global_aux with one micro-batch per rank: the reference is one micro-batch holding them all.
    one_mb = [r["global1"]["ids"][0] for r in results[::tp * cp]]
    hidden, target, mask = global_batch(dp * M)
    merged = (hidden[one_mb].reshape(1, -1, S, H), target[one_mb].reshape(1, -1, S, E),
              mask[one_mb].reshape(1, -1, S))
    ref_g1 = _reference_merged(merged)
    ref_global_step = reference(all_mbs, GLOBAL, 1.0 / (dp * M))["step"]["global_aux"]
    whole = _reference_merged((hidden.reshape(1, -1, S, H), target.reshape(1, -1, S, E), mask.reshape(1, -1, S)))
    assert float(ref_global_step) == pytest.approx(float(whole["step"]["global_aux"]), rel=1e-6)
    ref_bias = reference(all_mbs, BIAS, 1.0 / (dp * M))["router"].expert_bias
    assert ref_bias.abs().sum() > 0
    ref_zero = reference(all_mbs, ZERO, 1.0 / (dp * M))
    zero_bias = ref_zero["router"].expert_bias
    # The held experts' biases moved; the zero experts' stayed at 0 (LongCat-Flash).
    assert zero_bias[:E].abs().min() > 0 and zero_bias[E:].abs().max() == 0, zero_bias
    # With dp = 1 the ranks run the reference's micro-batches: running counts agree.
    ref_gm = reference(all_mbs, GLOBAL, 1.0 / M) if dp == 1 else None

    for r in results:
        for j, m in enumerate(r["mbs"]):
            check_values(r["local"]["values"][j], ref["values"][m])
        torch.testing.assert_close(r["local"]["wgrad"], ref["wgrad"], rtol=1e-4, atol=1e-7)
        # Each token's gradient is its share of the same objective; the rank's objective
        # carries cp (grads averaged over cp) and dp (the reference averages dp micro-batches).
        want_h = ref["hgrads"][r["mbs"]][:, :, r["pos"]] * cp * dp
        torch.testing.assert_close(r["local"]["hgrads"], want_h, rtol=1e-4, atol=1e-7)

        # global_aux, one micro-batch per rank: values and gradients are exact.
        assert r["global1"]["values"][0]["global_aux"] == pytest.approx(ref_g1["values"][0]["global_aux"], rel=1e-5)
        torch.testing.assert_close(r["global1"]["wgrad"], ref_g1["wgrad"], rtol=1e-4, atol=1e-7)
        assert float(r["global1"]["step"]["global_aux"]) == pytest.approx(
            float(ref_g1["step"]["global_aux"]), rel=1e-5)
        # global_aux over M micro-batches per rank: the step value is the global batch's,
        # whatever the split (dp ranks, micro-batches), and equals the one-micro-batch value.
        assert float(r["global"]["step"]["global_aux"]) == pytest.approx(float(ref_global_step), rel=1e-5)
        if ref_gm is not None:
            for j in range(M):
                check_values(r["global"]["values"][j], ref_gm["values"][j])
            torch.testing.assert_close(r["global"]["wgrad"], ref_gm["wgrad"], rtol=1e-4, atol=1e-7)

        # Expert bias: counts of every rank and micro-batch, one update.
        torch.testing.assert_close(r["bias"], ref_bias)

        # Zero experts: the losses over all columns, their gradients and the bias update.
        for j, m in enumerate(r["mbs"]):
            check_values(r["zero"]["values"][j], ref_zero["values"][m])
        torch.testing.assert_close(r["zero"]["wgrad"], ref_zero["wgrad"], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(r["zero"]["bias"], zero_bias)


def _torch(obj):
    if isinstance(obj, dict):
        return {k: _torch(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_torch(v) for v in obj]
    return torch.from_numpy(obj) if hasattr(obj, "__array__") and not isinstance(obj, float) else obj


def _reference_merged(batch):
    hidden, target, mask = batch
    router = make_router(ProcessGroups.single_process(), **GLOBAL)
    n = hidden.shape[1]
    h = hidden[0].reshape(-1, H).clone().requires_grad_(True)
    out = router(h, loss_mask=mask[0].reshape(-1))
    # The merged micro-batch holds n sequences: its mean is over n * S tokens.
    ((out.probs * target[0].reshape(-1, E)).sum() / (n * S)).backward()
    return dict(values=[{k: float(v) for k, v in out.losses.items()}], wgrad=router.weight.grad,
                step=router.finish_step())
