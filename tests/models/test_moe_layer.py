"""The experts and the MoE layer on one process, against loops written here: per-token
expert sums, the load-balancing and z losses in closed form, capacity dropping by hand,
the shared expert and its gate; expert weights sliced for every (ep, etp) rank equal the
one-process weights; the parallel marks; bad input. The overlap switches against the
blocking layer (one process, and on two gloo ranks under expert replicas)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from moe_fold.config import Config, ModelConfig
from moe_fold.launch import run_ranks
from moe_fold.layout import GROUP_NAMES, ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.experts import Experts
from moe_fold.models.model import Block, build_model
from moe_fold.models.mlp import MLP
from moe_fold.models.moe_layer import BATCH_INVARIANT_ROWS, MoELayer
from moe_fold.parallel.tensor_parallel import unshard_tp

from tests.helpers.float64_reference import assert_close_to_float64
from tests.helpers.router_outputs import router_outputs
from tests.dispatch.test_dispatcher import U, assert_within

H, FFN, SHARED, E, K, T = 16, 12, 20, 8, 2, 24


def _config(**moe):
    config = Config()
    config.model = ModelConfig(vocab_size=64, hidden_size=H, num_layers=4, num_heads=4, num_kv_heads=2,
                               ffn_hidden_size=28, seq_length=8, init_std=0.2)
    config.moe.num_experts = E
    config.moe.topk = K
    config.moe.ffn_hidden_size = FFN
    config.moe.aux_loss_coeff = 0.0
    for key, value in moe.items():
        setattr(config.moe, key, value)
    config.train.seed = 11
    return config


def _fake_groups(rank, **sizes):
    """A rank's view of a layout without processes: sizes and ranks only (groups None)."""
    layout = ParallelLayout(**sizes)
    return ProcessGroups(layout, rank, {name: None for name in GROUP_NAMES})


def _expert_ref(layer, x, e):
    """Expert ``e``'s SwiGLU on rows ``x [n, H]``, written out."""
    w1, w2 = layer.experts.fc1[e], layer.experts.fc2[e]  # [H, 2F], [F, H]
    gate, up = x @ w1[:, :FFN], x @ w1[:, FFN:]
    return (gate * torch.sigmoid(gate) * up) @ w2


def _layer_ref(layer, x, kept=None):
    """Top-k of the router logits, softmax over the chosen k, each token's expert outputs
    summed with those weights (``kept[T, E]`` bool drops pairs), plus the gated shared expert."""
    logits = x @ layer.router.weight.t()  # [T, E]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        # Sorting is stable: ties go to the lower expert, as the router promises.
        top = sorted(range(E), key=lambda e: -logits[t, e].item())[:K]
        weights = torch.softmax(logits[t, top], dim=0)
        for w, e in zip(weights, top):
            if kept is None or kept[t, e]:
                out[t] = out[t] + w * _expert_ref(layer, x[t:t + 1], e)[0]
    if layer.shared_expert is not None:
        w1, w2 = layer.shared_expert.fc1.weight, layer.shared_expert.fc2.weight  # [2S, H], [H, S]
        shared = (F.silu(x @ w1[:SHARED].t()) * (x @ w1[SHARED:].t())) @ w2.t()
        if layer.shared_expert_gate is not None:
            shared = torch.sigmoid(x @ layer.shared_expert_gate[0]).unsqueeze(1) * shared
        out = out + shared
    return out


def _inputs(seed=0):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- experts

def test_expert_weights_are_slices_of_the_same_global_experts():
    full = Experts(E, H, FFN, ProcessGroups.single_process(), std=0.1, seed=3, name="e")
    assert full.fc1.shape == (E, H, 2 * FFN) and full.fc2.shape == (E, FFN, H)
    # world 8: etp 2 x ep 4 (edp 1); ranks 2t+... list etp fastest.
    world, etp, ep = 8, 2, 4
    shards = {}
    for rank in range(world):
        groups = _fake_groups(rank, world_size=world, tp=2, ep=ep, etp=etp)
        part = Experts(E, H, FFN, groups, std=0.1, seed=3, name="e")
        assert part.fc1.shape == (E // ep, H, 2 * FFN // etp) and part.fc2.shape == (E // ep, FFN // etp, H)
        shards[groups.rank_in("ep"), groups.rank_in("etp")] = part
    fc1 = torch.cat([unshard_tp([shards[j, t].fc1 for t in range(etp)], 2, [FFN, FFN]) for j in range(ep)])
    fc2 = torch.cat([unshard_tp([shards[j, t].fc2 for t in range(etp)], 1, [FFN]) for j in range(ep)])
    torch.testing.assert_close(fc1, full.fc1, rtol=0, atol=0)
    torch.testing.assert_close(fc2, full.fc2, rtol=0, atol=0)
    # The etp shard of fc1 holds matching gate and up columns: [gate_t | up_t].
    half = FFN // etp
    torch.testing.assert_close(shards[1, 1].fc1[0, :, :half], full.fc1[2, :, half:FFN], rtol=0, atol=0)
    torch.testing.assert_close(shards[1, 1].fc1[0, :, half:], full.fc1[2, :, FFN + half:], rtol=0, atol=0)
    # Other name or seed: other draws; every expert its own draw.
    assert not torch.equal(Experts(E, H, FFN, ProcessGroups.single_process(), std=0.1, seed=4, name="e").fc1,
                           full.fc1)
    assert not torch.equal(full.fc1[0], full.fc1[1])
    for p in (full.fc1, full.fc2):
        assert p.parallel == "expert"
    assert (full.fc1.etp_dim, full.fc1.etp_parts, full.fc2.etp_dim, full.fc2.etp_parts) == (2, [FFN, FFN], 1, [FFN])


@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_experts_forward_backward_match_per_row_loop(backend):
    experts = Experts(4, H, FFN, ProcessGroups.single_process(), std=0.3, seed=1, name="e", gemm_backend=backend)
    counts = torch.tensor([3, 0, 5, 2])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(10, H, generator=gen, requires_grad=True)
    probs = torch.rand(10, generator=gen, requires_grad=True)
    y = experts(x, counts, probs)
    grads = torch.autograd.grad((y * torch.arange(H)).sum(), [x, probs, experts.fc1, experts.fc2])

    # The reference in float64: the per-row loop and the grouped path sum in different
    # orders, and which float32 rounding wins depends on the CPU's kernels.
    owner = torch.repeat_interleave(torch.arange(4), counts)
    w1, w2 = experts.fc1.detach().double().requires_grad_(), experts.fc2.detach().double().requires_grad_()
    xr, pr = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    rows = []
    for i in range(10):
        e = owner[i]
        gate, up = xr[i] @ w1[e, :, :FFN], xr[i] @ w1[e, :, FFN:]
        rows.append((gate * torch.sigmoid(gate) * up * pr[i]) @ w2[e])
    ref = torch.stack(rows)
    ref_grads = torch.autograd.grad((ref * torch.arange(H)).sum(), [xr, pr, w1, w2])
    assert_close_to_float64(y, ref)
    for got, want in zip(grads, ref_grads):
        assert_close_to_float64(got, want)
    assert grads[2][1].abs().max() == 0  # expert 1 got no rows


def test_experts_bad_sizes_are_refused():
    groups = _fake_groups(0, world_size=4, tp=2, ep=2)
    with pytest.raises(ValueError, match=r"moe.num_experts=5 is not divisible by parallel.ep=2"):
        Experts(5, H, FFN, groups, std=0.1, seed=0, name="e")
    with pytest.raises(ValueError, match=r"moe.ffn_hidden_size=7 is not divisible by parallel.etp=2"):
        Experts(E, H, 7, groups, std=0.1, seed=0, name="e")
    with pytest.raises(ValueError, match=r"moe.gemm_backend=fast must be one of"):
        Experts(E, H, FFN, ProcessGroups.single_process(), std=0.1, seed=0, name="e", gemm_backend="fast")


# --------------------------------------------------------------------------- MoE layer

@pytest.mark.parametrize("shared", ["none", "plain", "gated"])
def test_layer_matches_loop_reference_forward_and_backward(shared):
    config = _config(shared_expert_ffn_hidden_size=0 if shared == "none" else SHARED,
                     shared_expert_gate=shared == "gated")
    layer = MoELayer(config, ProcessGroups.single_process(), 1)
    x = _inputs().requires_grad_()
    out = layer(x)
    params = [x] + list(layer.parameters())
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, H)).sum(), params)
    # The loop reference in float64 (same weights): its sums run in another order.
    ref_layer = copy.deepcopy(layer).double()
    x64 = x.detach().double().requires_grad_()
    ref_params = [x64] + list(ref_layer.parameters())
    ref = _layer_ref(ref_layer, x64)
    ref_grads = torch.autograd.grad((ref * torch.linspace(-1, 1, H, dtype=torch.float64)).sum(), ref_params)
    assert_close_to_float64(out, ref)
    for (name, _), got, want in zip([("x", x)] + list(layer.named_parameters()), grads, ref_grads):
        assert_close_to_float64(got, want, rtol=1e-4, msg=f"grad {name}")
    assert out.abs().mean() > 1e-3 and grads[0].abs().mean() > 1e-4


def test_aux_and_z_loss_gradients_reach_the_router():
    """The layer's router grad = that of the main term + coeff * closed-form losses."""
    aux, z = 0.3, 0.05
    layer = MoELayer(_config(aux_loss_coeff=aux, z_loss_coeff=z), ProcessGroups.single_process(), 0)
    x = _inputs(1)
    with router_outputs(layer) as seen:
        out = layer(x)
    (out * torch.linspace(-1, 1, H)).sum().backward()
    got = layer.router.weight.grad.clone()
    ((_, routing),) = seen

    w = layer.router.weight.detach().requires_grad_()
    layer.router.weight.grad = None
    logits = x @ w.t()
    main = (_layer_ref_with_router(layer, x, logits) * torch.linspace(-1, 1, H)).sum()
    scores = torch.softmax(logits, dim=-1)  # [T, E]
    chosen = torch.zeros(T, E).scatter_(1, logits.topk(K, dim=1).indices, 1.0)
    # Switch loss E * sum_i f_i P_i with f_i = count_i / (k T), P_i = mean score.
    balance = E * ((chosen.sum(0) / (K * T)) * scores.mean(0)).sum()
    zl = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    (main + aux * balance + z * zl).backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(routing.losses["aux"], balance.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(routing.losses["z"], zl.detach(), rtol=1e-5, atol=0)


def _layer_ref_with_router(layer, x, logits):
    """Like :func:`_layer_ref` but with the given (differentiable) logits, no shared expert."""
    out = torch.zeros_like(x)
    top = logits.detach().topk(K, dim=1).indices
    for t in range(x.shape[0]):
        weights = torch.softmax(logits[t, top[t]], dim=0)
        for w, e in zip(weights, top[t].tolist()):
            out[t] = out[t] + w * _expert_ref(layer, x[t:t + 1], e)[0]
    return out


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_drops_the_right_tokens(policy, pad):
    cf = 0.5
    layer = MoELayer(_config(capacity_factor=cf, drop_policy=policy, pad_to_capacity=pad),
                     ProcessGroups.single_process(), 0)
    x = _inputs(2)
    with router_outputs(layer) as seen:
        out = layer(x)
    ((_, routing),) = seen
    # Expert e keeps ceil(T*k/E*cf) of its tokens: the highest probs or the earliest.
    capacity = math.ceil(T * K / E * cf)
    logits = (x @ layer.router.weight.t()).detach()
    top = logits.topk(K, dim=1).indices
    probs = torch.zeros(T, E).scatter_(1, top, torch.softmax(logits.gather(1, top), dim=1))
    kept = torch.zeros(T, E, dtype=torch.bool)
    for e in range(E):
        mine = [t for t in range(T) if probs[t, e] > 0]
        if policy == "probs":
            mine = sorted(mine, key=lambda t: -probs[t, e].item())
        for t in mine[:capacity]:
            kept[t, e] = True
    routed = probs > 0
    assert kept.sum() < routed.sum()  # something was dropped
    torch.testing.assert_close(out, _layer_ref(layer, x, kept), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(routing.stats.dropped_fraction.float(),
                               1 - kept.sum().float() / routed.sum(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("moe", [dict(dispatcher="allgather"), dict(dedup=True), dict(gemm_backend="loop"),
                                 dict(permute_backend="triton")])
def test_dispatcher_and_backend_choices_give_the_same_layer(moe):
    x = _inputs(3)
    base = MoELayer(_config(), ProcessGroups.single_process(), 2)
    other = MoELayer(_config(**moe), ProcessGroups.single_process(), 2)
    torch.testing.assert_close(other(x), base(x), rtol=1e-5, atol=1e-6)


def test_parallel_marks_and_names():
    config = _config(shared_expert_ffn_hidden_size=SHARED, shared_expert_gate=True)
    kinds = {n: p.parallel for n, p in MoELayer(config, ProcessGroups.single_process(), 0).named_parameters()}
    assert kinds == {"router.weight": "replicated", "shared_expert_gate": "replicated",
                     "experts.fc1": "expert", "experts.fc2": "expert",
                     "shared_expert.fc1.weight": "tp", "shared_expert.fc2.weight": "tp"}
    config.parallel.sequence_parallel = True
    layer = MoELayer(config, _fake_groups(1, world_size=2, tp=2), 0)
    assert layer.router.weight.parallel == "tp_sum" and layer.shared_expert_gate.parallel == "tp_sum"
    # tp 2 -> etp 2: half of every expert's ffn (the shared expert's split is the dense
    # MLP's, which reads the tp group itself and is covered by the multi-rank tests).
    assert layer.experts.fc1.shape == (E, H, FFN) and layer.experts.fc2.shape == (E, FFN // 2, H)


def test_layers_with_the_same_seed_match_and_layers_differ():
    a, b = (MoELayer(_config(), ProcessGroups.single_process(), 0) for _ in range(2))
    c = MoELayer(_config(), ProcessGroups.single_process(), 1)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        assert not torch.equal(p, r), name


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match=r"parallel.tp=2 with MoE layers requires parallel.sequence_parallel"):
        MoELayer(_config(), _fake_groups(0, world_size=2, tp=2), 0)
    with pytest.raises(ValueError, match=r"moe.shared_expert_gate=true requires a shared expert"):
        MoELayer(_config(shared_expert_gate=True), ProcessGroups.single_process(), 0)
    with pytest.raises(ValueError, match=r"moe.dispatcher=ring must be"):
        MoELayer(_config(dispatcher="ring"), ProcessGroups.single_process(), 0)


def test_model_interleaves_dense_and_moe_layers():
    config = _config(moe_layer_freq=2, shared_expert_ffn_hidden_size=SHARED, shared_expert_gate=True)
    model = build_model(config, ProcessGroups.single_process())
    kinds = [type(block.mlp) for block in model.layers]
    assert kinds == [MoELayer, MLP, MoELayer, MLP]
    config.moe.first_k_dense = 1
    config.moe.moe_layer_freq = 1
    assert [type(b.mlp) for b in build_model(config, ProcessGroups.single_process()).layers] == \
        [MLP, MoELayer, MoELayer, MoELayer]
    # A block feeds the MoE layer its tokens flattened and gets them back in shape.
    block = model.layers[0]
    assert isinstance(block, Block)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model(ids, ids.roll(-1, dims=1))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert math.isfinite(loss.item())


# --------------------------------------------------------------------------- overlap

OVERLAPS = [dict(shared_expert_overlap=True), dict(overlap_chunks=2),
            dict(shared_expert_overlap=True, overlap_chunks=3)]
MODES = [dict(), dict(capacity_factor=0.75), dict(dedup=True), dict(dispatcher="allgather", capacity_factor=0.75),
         dict(capacity_factor=0.75, pad_to_capacity=True)]
# Chunks with padding are refused (test_overlap_bad_settings_are_refused).
COMBINATIONS = [(o, m) for o in OVERLAPS for m in MODES if not ("overlap_chunks" in o and "pad_to_capacity" in m)]


def _name(settings):
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "dropless"


def _layer_run(config, x, row_multiple=0, expert_calls=None):
    """Layer 1 of ``config``, its router's output, and the layer's output, input grad and
    parameter grads on ``x``. ``row_multiple``: the experts' rows padded as under
    ``train.batch_invariant``. ``expert_calls``: a list that gets each experts call's
    ``(tokens, counts, probs, output grad)``."""
    layer = MoELayer(config, ProcessGroups.single_process(), 1)
    layer.experts.row_multiple = row_multiple
    if expert_calls is not None:
        def record(module, args, out):
            call = [args[0].detach(), args[1].tolist(), args[2].detach()]
            expert_calls.append(call)
            out.register_hook(call.append)
        layer.experts.register_forward_hook(record)
    x = x.clone().requires_grad_()
    with router_outputs(layer) as seen:
        out = layer(x)
    (out * torch.linspace(-1, 1, H)).sum().backward()
    ((_, routing),) = seen
    return layer, routing, out.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


def _expert_grad_bounds(layer, calls):
    """The largest difference, element by element, between two sums of the expert weight
    grads' terms in different groupings. Each grad element of expert ``e`` sums ``n`` float32
    products over its rows (one per token routed to it), whatever the chunks: a
    float32 dot product of length n is within gamma(n) = n u / (1 - n u) times the sum
    of its terms' magnitudes of the exact one (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., (3.5)), so two groupings differ by at most twice that. The
    magnitudes are computed in float64 from the blocking layer's rows (one call)."""
    (tokens, counts, probs, grad), = calls
    w1, w2 = layer.experts.fc1.detach().double(), layer.experts.fc2.detach().double()  # [E, H, 2F], [E, F, H]
    fc1, fc2 = torch.zeros_like(w1), torch.zeros_like(w2)
    start = 0
    for e, n in enumerate(counts):
        x, p, g = (t[start:start + n].double() for t in (tokens, probs, grad))
        start += n
        h = (x @ w1[e]).requires_grad_()  # [n, 2F]
        act = F.silu(h[:, :FFN]) * h[:, FFN:] * p.unsqueeze(1)  # [n, F], prob-weighted
        (act @ w2[e]).backward(g)
        gamma = 2 * n * U / (1 - n * U)
        fc1[e] = gamma * (x.abs().t() @ h.grad.abs())
        fc2[e] = gamma * (act.detach().abs().t() @ g.abs())
    return {"experts.fc1": fc1, "experts.fc2": fc2}


@pytest.mark.parametrize("overlap, moe", COMBINATIONS, ids=[f"{_name(o)}-{_name(m)}" for o, m in COMBINATIONS])
def test_overlap_gives_the_layer_without_overlap(overlap, moe):
    """Same output and grads as the blocking layer, bit for bit: the shared-expert overlap
    alone runs the same operations on the same tensors. Chunks run the grouped GEMMs on
    fewer rows, so both layers pad each expert's rows as ``train.batch_invariant`` does
    (a row's GEMM result is then the same for any row count): output, input grad, router
    and shared-expert grads stay bit for bit; the expert weight grads sum per chunk, within
    the bound of :func:`_expert_grad_bounds`. Capacity 0.75 drops tokens, which the chunks
    must not change: routing is per layer."""
    x = _inputs(4)
    shared = dict(shared_expert_ffn_hidden_size=SHARED, shared_expert_gate=True)
    chunked = overlap.get("overlap_chunks", 1) > 1
    rows = BATCH_INVARIANT_ROWS if chunked else 0
    calls = []
    base_layer, base, out, x_grad, grads = _layer_run(_config(**shared, **moe), x, rows, calls)
    layer, routing, got, got_x_grad, got_grads = _layer_run(_config(**shared, **moe, **overlap), x, rows)
    if "capacity_factor" in moe:
        assert 0 < base.stats.dropped_fraction < 1
    torch.testing.assert_close(routing.stats.dropped_fraction, base.stats.dropped_fraction, rtol=0, atol=0)
    torch.testing.assert_close(got, out, rtol=0, atol=0)
    torch.testing.assert_close(got_x_grad, x_grad, rtol=0, atol=0)
    bounds = _expert_grad_bounds(base_layer, calls) if chunked else {}
    for name, g in grads.items():
        assert g.abs().max() > 0, name
        if name in bounds:
            assert_within(got_grads[name], g, bounds[name], f"grad {name}")
        else:
            torch.testing.assert_close(got_grads[name], g, rtol=0, atol=0, msg=lambda m: f"grad {name}: {m}")
    # And both equal the loop written out above.
    torch.testing.assert_close(got, _layer_ref(layer, x, _kept(layer, x, moe)), rtol=1e-5, atol=1e-6)


def _kept(layer, x, moe):
    """The (token, expert) pairs capacity keeps (policy ``probs``), or None for dropless."""
    if "capacity_factor" not in moe:
        return None
    capacity = math.ceil(T * K / E * moe["capacity_factor"])
    logits = (x @ layer.router.weight.t()).detach()
    top = logits.topk(K, dim=1).indices
    probs = torch.zeros(T, E).scatter_(1, top, torch.softmax(logits.gather(1, top), dim=1))
    kept = torch.zeros(T, E, dtype=torch.bool)
    for e in range(E):
        for t in sorted((t for t in range(T) if probs[t, e] > 0), key=lambda t: -probs[t, e].item())[:capacity]:
            kept[t, e] = True
    return kept


def test_overlap_bad_settings_are_refused():
    with pytest.raises(ValueError, match=r"moe.shared_expert_overlap=true needs a shared expert"):
        MoELayer(_config(shared_expert_overlap=True), ProcessGroups.single_process(), 0)
    with pytest.raises(ValueError, match=r"moe.overlap_chunks=0 must be >= 1"):
        MoELayer(_config(overlap_chunks=0), ProcessGroups.single_process(), 0)
    with pytest.raises(ValueError, match=r"moe.overlap_chunks=2 requires moe.pad_to_capacity=false"):
        MoELayer(_config(overlap_chunks=2, capacity_factor=1.0, pad_to_capacity=True),
                 ProcessGroups.single_process(), 0)


@pytest.mark.parametrize("overlap", [False, True])
def test_recompute_covers_the_overlapped_shared_expert(overlap):
    """train.recompute=moe recomputes the shared expert also when the overlap runs its
    halves apart: the same grads, and of the shared expert's ``[T, SHARED]`` tensors (gate,
    up, their SwiGLU) at most the SwiGLU output between the halves is kept."""
    from moe_fold.models.model import set_recompute

    def kept_and_grads(recompute):
        layer = MoELayer(_config(shared_expert_ffn_hidden_size=SHARED, shared_expert_overlap=overlap),
                         ProcessGroups.single_process(), 1)
        set_recompute(layer, recompute)
        shapes = []
        x = _inputs(5).requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            out = layer(x)
        (out * torch.linspace(-1, 1, H)).sum().backward()
        return shapes.count((T, SHARED)), [x.grad] + [p.grad for p in layer.parameters()]

    plain_kept, plain = kept_and_grads("none")
    kept, grads = kept_and_grads("moe")
    for got, want in zip(grads, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert plain_kept >= 3 and kept <= (1 if overlap else 0)


def _overlap_with_replicas_rank(rank, world_size):
    groups = create_process_groups(ParallelLayout(world_size, ep=2))
    out = {}
    for name, overlap in (("off", {}), ("shared", dict(shared_expert_overlap=True)),
                          ("shared+chunks2", dict(shared_expert_overlap=True, overlap_chunks=2))):
        for replicas in (0, 1):
            layer = MoELayer(_config(shared_expert_ffn_hidden_size=SHARED, replicas=replicas, **overlap), groups, 0)
            x = _inputs(rank).requires_grad_()
            y = layer(x)
            (y * torch.linspace(-1, 1, H)).sum().backward()
            out[name, replicas] = {"output": y.detach().numpy(), "input grad": x.grad.numpy(),
                                   **{f"grad {n}": p.grad.numpy() for n, p in layer.named_parameters()}}
    return out


def test_overlap_under_expert_replicas_on_two_ranks():
    """ep 2, with and without a replicated expert (moe.replicas=1: the dispatcher routes by
    slot): the shared-expert overlap gives the blocking layer's output, input grad and
    every parameter grad bit for bit; with two chunks (and between the two placements,
    whose grouped GEMMs see other row counts) within fp32 rounding. (With a copy, each
    chunk splits the copied expert's tokens between its copies anew: the copies' grads
    differ, their sum does not, so chunks are compared there on output and input grad.)"""
    for rank, res in enumerate(run_ranks(_overlap_with_replicas_rank, 2, timeout=120)):
        for replicas in (0, 1):
            off = res["off", replicas]
            assert len(off) > 2 and all(abs(v).max() > 0 for v in off.values())
            for key, tol in (("shared", dict(rtol=0, atol=0)), ("shared+chunks2", dict(rtol=1e-5, atol=1e-7)),
                             ("off", dict(rtol=1e-5, atol=1e-7))):
                got = res[key, replicas if key != "off" else 1 - replicas]
                names = off if key == "shared" or (key != "off" and replicas == 0) else ("output", "input grad")
                for name in names:
                    torch.testing.assert_close(torch.from_numpy(got[name]), torch.from_numpy(off[name]), **tol,
                                               msg=lambda m: f"rank {rank} {key} replicas={replicas} {name}: {m}")


# --------------------------------------------------------------------------- zero experts

# LongCat-Flash's router on the layer of _config: E held experts, ZERO identity experts,
# top-ZK over all of them by the softmax plus the expert bias, weights the unbiased scores
# times the scaling factor.
ZERO, ZK, ZSCALE = 5, 3, 1.5
LONGCAT_MOE = dict(zero_experts=ZERO, topk=ZK, pre_softmax=True, expert_bias=True, scaling_factor=ZSCALE)


def _zero_layer(groups, **moe):
    """A LongCat-style layer whose expert bias rises along the columns: it favours the zero
    experts, and changes which experts tokens pick (a bias ignored would show)."""
    layer = MoELayer(_config(**{**LONGCAT_MOE, **moe}), groups, 0)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.linspace(-0.02, 0.02, E + ZERO))
    return layer


def _zero_expert_ref(layer, x):
    """transformers' LongcatFlashMoE written out per token: ``scores = softmax(x W^T)`` over
    held and zero experts, the top-k of ``scores + bias``, each chosen expert's output
    times ``scores[e] * scale``, where zero expert ``e >= E`` outputs the token itself.
    Returns the output and the number of zero-expert slots."""
    router = layer.router
    scores = torch.softmax(x @ router.weight.t(), dim=-1)  # [T, E + Z]
    out, zero_slots = torch.zeros_like(x), 0
    for t in range(x.shape[0]):
        keyed = scores[t] + router.expert_bias.to(scores.dtype)
        chosen = sorted(range(E + ZERO), key=lambda e: -keyed[e].item())[:ZK]
        for e in chosen:
            row = _expert_ref(layer, x[t:t + 1], e)[0] if e < E else x[t]
            out[t] = out[t] + scores[t, e] * ZSCALE * row
            zero_slots += e >= E
    return out, zero_slots


def test_zero_experts_match_longcat_written_out_forward_and_backward():
    """moe.zero_experts on one process: the layer's output and every gradient (input,
    router, experts) equal the per-token reference of LongCat-Flash's MoE in float64."""
    layer = _zero_layer(ProcessGroups.single_process())
    x = _inputs(3).requires_grad_()
    out = layer(x)
    params = [x] + list(layer.parameters())
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, H)).sum(), params)
    ref_layer = copy.deepcopy(layer).double()
    x64 = x.detach().double().requires_grad_()
    ref, zero_slots = _zero_expert_ref(ref_layer, x64)
    ref_grads = torch.autograd.grad((ref * torch.linspace(-1, 1, H, dtype=torch.float64)).sum(),
                                    [x64] + list(ref_layer.parameters()))
    # Some slots go to zero experts and most to held ones: both paths are exercised.
    assert 0.1 * T * ZK < zero_slots < 0.9 * T * ZK, zero_slots
    assert_close_to_float64(out, ref)
    for (name, _), got, want in zip([("x", x)] + list(layer.named_parameters()), grads, ref_grads):
        assert_close_to_float64(got, want, rtol=1e-4, msg=f"grad {name}")
    assert grads[1].abs().mean() > 1e-5  # the router learns from the zero experts' weights too


def test_zero_experts_give_transformers_longcat_flash_moe():
    """The same weights in transformers' ``LongcatFlashMoE`` (its router's classifier and
    score-correction bias, its experts' gate_up and down projections, the zero experts'
    rows of gate_up unused) give the layer's output."""
    import transformers
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE

    hf_config = transformers.LongcatFlashConfig(hidden_size=H, expert_ffn_hidden_size=FFN, n_routed_experts=E,
                                                zero_expert_num=ZERO, num_experts_per_tok=ZK,
                                                routed_scaling_factor=ZSCALE, num_layers=1, num_attention_heads=2)
    layer = _zero_layer(ProcessGroups.single_process())
    hf = LongcatFlashMoE(hf_config).float()
    with torch.no_grad():
        hf.router.classifier.weight.copy_(layer.router.weight)
        hf.router.e_score_correction_bias.copy_(layer.router.expert_bias)
        hf.experts.gate_up_proj.normal_()
        hf.experts.gate_up_proj[:E].copy_(layer.experts.fc1.transpose(1, 2))  # [E, H, 2F] -> [E, 2F, H]
        hf.experts.down_proj.copy_(layer.experts.fc2.transpose(1, 2))  # [E, F, H] -> [E, H, F]
    x = _inputs(5)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), hf(x.unsqueeze(0))[0], rtol=1e-5, atol=1e-6)


def _zero_experts_rank(rank, world_size, moe):
    """ep2 over two ranks: each rank's tokens through the layer, with what its dispatcher
    sent (rows to each ep rank, bytes of token rows) and its router's choice."""
    groups = create_process_groups(ParallelLayout(world_size, ep=2))
    out, routing, handles = _run_recording_dispatches(_zero_layer(groups, **moe), 10 + rank, overlapped=bool(moe))
    return {**out, "input_splits": [h.input_splits for h in handles],
            "zero_expert_tokens": float(routing.stats.zero_expert_tokens),
            "held_load": routing.stats.tokens_per_expert.tolist()}


def _run_recording_dispatches(layer, seed: int, overlapped: bool):
    """``layer`` forward and backward on ``_inputs(seed)``, with every dispatch it started
    recorded (``dispatch_start`` when ``overlapped``): the output and input grad, the
    bytes the dispatches and combines sent, its router's routing and the handles."""
    sent = []
    name = "dispatch_start" if overlapped else "dispatch"
    dispatch = getattr(layer.dispatcher, name)

    def recorded(*args, **kwargs):
        result = dispatch(*args, **kwargs)
        sent.append(result)
        return result
    setattr(layer.dispatcher, name, recorded)
    x = _inputs(seed).requires_grad_()
    with router_outputs(layer) as seen:
        y = layer(x)
    (y * torch.linspace(-1, 1, H)).sum().backward()
    handles = [(s.wait() if overlapped else s).handle for s in sent]
    ((_, routing),) = seen
    return ({"x": x.detach(), "y": y.detach(), "x_grad": x.grad, "routed_map": routing.routed_map,
             "dispatch_bytes": sum(h.wire.dispatch for h in handles),
             "combine_bytes": sum(h.wire.combine for h in handles)}, routing, handles)


@pytest.mark.parametrize("moe", [{}, dict(shared_expert_ffn_hidden_size=SHARED, shared_expert_overlap=True,
                                          overlap_chunks=2)], ids=["blocking", "overlap-chunks2"])
def test_zero_experts_are_never_dispatched_on_two_ranks(moe):
    """ep2: a token's slots on zero experts send no row. Each rank's all-to-all sends
    exactly its (token, held expert) pairs (its input splits, and its dispatch bytes:
    the pairs whose expert the other rank holds, times a row of H float32), the load
    statistics count held experts only with the zero-expert assignments apart, and the
    output and input grad are the one-process layer's on the same tokens."""
    results = run_ranks(_zero_experts_rank, 2, moe, timeout=120)
    reference = _zero_layer(ProcessGroups.single_process(), **moe)
    for rank, res in enumerate(results):
        routed = res["routed_map"]  # [T, E + Z]
        held, zero = routed[:, :E], routed[:, E:]
        per_rank = [int(held[:, :E // 2].sum()), int(held[:, E // 2:].sum())]
        assert int(zero.sum()) > 0 and int(held.sum()) > 0
        assert [sum(col) for col in zip(*res["input_splits"])] == per_rank, (rank, res["input_splits"], per_rank)
        assert res["dispatch_bytes"] == per_rank[1 - rank] * H * 4, (rank, res["dispatch_bytes"], per_rank)
        assert res["held_load"] == held.sum(0).tolist()
        assert res["zero_expert_tokens"] == int(zero.sum())
        x = res["x"].clone().requires_grad_()
        y = reference(x)
        (y * torch.linspace(-1, 1, H)).sum().backward()
        torch.testing.assert_close(res["y"], y.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["x_grad"], x.grad, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- latent MoE

LATENT = 6
NEMOTRON_MOE = dict(latent_size=LATENT, activation="relu2", score_function="sigmoid", expert_bias=True,
                    scaling_factor=1.5, shared_expert_ffn_hidden_size=SHARED)


def _latent_layer(groups, **moe):
    """A Nemotron-H latent MoE layer (relu2 experts in LATENT columns, relu2 shared expert);
    its expert bias rises along the columns, so a bias ignored changes the picks."""
    config = _config(**{**NEMOTRON_MOE, **moe})
    config.model.mlp_activation = "relu2"
    layer = MoELayer(config, groups, 0)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))
    return layer


def test_latent_moe_gives_transformers_nemotron_h_moe_forward_and_backward():
    """moe.latent_size: the same weights in transformers' ``NemotronHMoE`` with
    ``moe_latent_size`` (router on the hidden state, fc1_latent_proj before the experts,
    experts up/down in the latent width, fc2_latent_proj after their sum, the shared expert
    on the un-projected input) give the layer's output and the gradients of the input and
    of both latent projections."""
    import transformers
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    hf_config = transformers.NemotronHConfig(hidden_size=H, moe_intermediate_size=FFN, n_routed_experts=E,
                                             num_experts_per_tok=K, moe_latent_size=LATENT, routed_scaling_factor=1.5,
                                             moe_shared_expert_intermediate_size=SHARED, num_attention_heads=2,
                                             layers_block_type=["moe"])
    layer = _latent_layer(ProcessGroups.single_process())
    assert layer.experts.fc1.shape == (E, LATENT, FFN) and layer.experts.fc2.shape == (E, FFN, LATENT)
    hf = NemotronHMoE(hf_config).float()
    with torch.no_grad():
        hf.gate.weight.copy_(layer.router.weight)
        hf.gate.e_score_correction_bias.copy_(layer.router.expert_bias)
        hf.experts.up_proj.copy_(layer.experts.fc1.transpose(1, 2))  # [E, L, F] -> [E, F, L]
        hf.experts.down_proj.copy_(layer.experts.fc2.transpose(1, 2))  # [E, F, L] -> [E, L, F]
        hf.fc1_latent_proj.weight.copy_(layer.latent_in.weight)
        hf.fc2_latent_proj.weight.copy_(layer.latent_out.weight)
        hf.shared_experts.up_proj.weight.copy_(layer.shared_expert.fc1.weight)
        hf.shared_experts.down_proj.weight.copy_(layer.shared_expert.fc2.weight)
    x = _inputs(6).requires_grad_()
    x_hf = x.detach().clone().requires_grad_()
    out, out_hf = layer(x), hf(x_hf.unsqueeze(0))[0]
    torch.testing.assert_close(out, out_hf, rtol=1e-5, atol=1e-6)
    weights = torch.linspace(-1, 1, H)
    (out * weights).sum().backward()
    (out_hf * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_hf.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.latent_in.weight.grad, hf.fc1_latent_proj.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.latent_out.weight.grad, hf.fc2_latent_proj.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.experts.fc1.grad, hf.experts.up_proj.grad.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_latent_moe_parameters_are_replicated_like_the_router():
    """The latent projections are whole on every rank and marked like the router: summed over
    tp under SP (each tp rank saw its own tokens), else replicated."""
    for sp, kind in ((True, "tp_sum"), (False, "replicated")):
        config = _config(**NEMOTRON_MOE)
        config.model.mlp_activation = "relu2"
        config.parallel.sequence_parallel = sp
        layer = MoELayer(config, _fake_groups(0, world_size=4, tp=2, ep=2) if sp
                         else ProcessGroups.single_process(), 0)
        assert layer.latent_in.weight.shape == (LATENT, H) and layer.latent_out.weight.shape == (H, LATENT)
        assert layer.latent_in.weight.parallel == layer.latent_out.weight.parallel == layer.router.weight.parallel == kind


def _latent_rank(rank, world_size, moe):
    """ep2 over two ranks: each rank's tokens through the latent layer, with the bytes its
    dispatcher sent and its router's choice."""
    groups = create_process_groups(ParallelLayout(world_size, ep=2))
    return _run_recording_dispatches(_latent_layer(groups, **moe), 20 + rank, overlapped=bool(moe))[0]


@pytest.mark.parametrize("moe", [{}, dict(shared_expert_overlap=True, overlap_chunks=2)],
                         ids=["blocking", "overlap-chunks2"])
def test_latent_moe_sends_latent_rows_on_two_ranks(moe):
    """ep2: the all-to-all carries latent rows, each rank's dispatch bytes are its (token,
    expert) pairs on the other rank times LATENT float32 (not H), and the output and input
    grad are the one-process layer's on the same tokens; the combine sends the same rows back."""
    results = run_ranks(_latent_rank, 2, moe, timeout=120)
    assert sum(r["combine_bytes"] for r in results) == sum(r["dispatch_bytes"] for r in results) > 0
    reference = _latent_layer(ProcessGroups.single_process(), **moe)
    for rank, res in enumerate(results):
        routed = res["routed_map"]  # [T, E]
        per_rank = [int(routed[:, :E // 2].sum()), int(routed[:, E // 2:].sum())]
        assert res["dispatch_bytes"] == per_rank[1 - rank] * LATENT * 4, (rank, res["dispatch_bytes"], per_rank)
        x = res["x"].clone().requires_grad_()
        y = reference(x)
        (y * torch.linspace(-1, 1, H)).sum().backward()
        torch.testing.assert_close(res["y"], y.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["x_grad"], x.grad, rtol=1e-5, atol=1e-6)
