"""gpt-oss's MoE side on one process: biased experts with the clamped SwiGLU against a
per-row float64 loop (every gemm backend), and the whole MoE layer (router with bias,
softmax over the top-k logits) against transformers' own GptOssMLP with the same weights.
The layouts (ep, etp with fc2's bias split over etp, tp x ep) are in
tests/parallel/test_layout_invariance.py (the ``gptoss-*`` cases)."""

import copy

import pytest
import torch

from moe_fold.config import Config, ModelConfig, validate, ConfigError
from moe_fold.layout import ProcessGroups
from moe_fold.models.experts import Experts
from moe_fold.models.moe_layer import MoELayer

from tests.helpers.float64_reference import assert_close_to_float64

H, FFN, E, K = 12, 10, 4, 2
ALPHA, LIMIT = 1.702, 0.7


def _gpt_oss_row(x, w1, b1, w2, b2, p):
    """One row through one gpt-oss expert, written out on our [gate | up] halves."""
    h = x @ w1 + b1
    gate, up = h[:FFN].clamp(max=LIMIT), h[FFN:].clamp(-LIMIT, LIMIT)
    return ((up + 1) * gate * torch.sigmoid(ALPHA * gate) @ w2 + b2) * p


@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_biased_experts_match_per_row_loop(backend):
    experts = Experts(E, H, FFN, ProcessGroups.single_process(), std=0.4, seed=1, name="e", gemm_backend=backend,
                      linear_bias=True, activation="clamped_swiglu", swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    assert experts.fc1_bias.shape == (E, 2 * FFN) and experts.fc2_bias.shape == (E, H)
    counts = torch.tensor([3, 0, 6, 2])
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, H, generator=gen, requires_grad=True)
    probs = torch.rand(11, generator=gen, requires_grad=True)
    params = [x, probs] + experts.expert_params()
    y = experts(x, counts, probs)
    grads = torch.autograd.grad((y * torch.arange(H)).sum(), params)

    owner = torch.repeat_interleave(torch.arange(E), counts)
    ref_params = [t.detach().double().requires_grad_() for t in params]
    xr, pr, w1, w2, b1, b2 = ref_params
    ref = torch.stack([_gpt_oss_row(xr[i], w1[e], b1[e], w2[e], b2[e], pr[i]) for i, e in enumerate(owner)])
    ref_grads = torch.autograd.grad((ref * torch.arange(H)).sum(), ref_params)
    assert_close_to_float64(y, ref)
    for name, got, want in zip(["x", "probs", "fc1", "fc2", "fc1_bias", "fc2_bias"], grads, ref_grads):
        assert_close_to_float64(got, want, msg=f"grad {name}")
    # The clamps bit on both sides, and expert 1 (no rows) got zero bias grads.
    h = (x @ experts.fc1[0] + experts.fc1_bias[0]).detach()
    assert (h[:, :FFN] > LIMIT).any() or (h[:, FFN:].abs() > LIMIT).any()
    assert grads[4][1].abs().max() == 0 and grads[5][1].abs().max() == 0


def _config(**moe):
    config = Config()
    config.model = ModelConfig(vocab_size=64, hidden_size=H, num_layers=2, num_heads=2, num_kv_heads=1,
                               ffn_hidden_size=16, seq_length=8, init_std=0.3)
    settings = dict(num_experts=E, topk=K, ffn_hidden_size=FFN, aux_loss_coeff=0.0, router_bias=True,
                    expert_linear_bias=True, activation="clamped_swiglu", swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    for key, value in {**settings, **moe}.items():
        setattr(config.moe, key, value)
    return config


def _interleave(halves: torch.Tensor) -> torch.Tensor:
    """Our ``[..., gate | up]`` -> gpt-oss's ``[..., g0 u0 g1 u1 ...]``."""
    gate, up = halves.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def test_moe_layer_matches_transformers_gpt_oss_mlp():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = _config(router_dtype="float64")  # float64 end to end, so the match is to rounding
    layer = MoELayer(config, ProcessGroups.single_process(), 1).double()
    hf = GptOssMLP(GptOssConfig(hidden_size=H, intermediate_size=FFN, num_local_experts=E, num_experts_per_tok=K,
                                swiglu_alpha=ALPHA, swiglu_limit=LIMIT, num_hidden_layers=1)).double()
    with torch.no_grad():
        hf.router.weight.copy_(layer.router.weight)
        hf.router.bias.copy_(layer.router.bias.normal_(0, 0.5))
        hf.experts.gate_up_proj.copy_(_interleave(layer.experts.fc1))
        hf.experts.gate_up_proj_bias.copy_(_interleave(layer.experts.fc1_bias))
        hf.experts.down_proj.copy_(layer.experts.fc2)
        hf.experts.down_proj_bias.copy_(layer.experts.fc2_bias)
    x = torch.randn(1, 17, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want, _ = hf(x)
    got = layer(x[0])
    torch.testing.assert_close(got, want[0], rtol=0, atol=1e-12)
    # The router bias changes the choice for some tokens (so the test would see it missing).
    logits = x[0] @ layer.router.weight.t()
    assert not torch.equal(logits.topk(K).indices, (logits + layer.router.bias).topk(K).indices)


def test_gpt_oss_moe_config_rules():
    for moe, message in [
        (dict(activation="geglu"), "moe.activation=geglu must be one of swiglu, clamped_swiglu"),
        (dict(swiglu_limit=0.0), "moe.swiglu_limit=0.0 must be > 0"),
        (dict(swiglu_backend="cpu"), "moe.swiglu_backend=cpu with moe.activation=clamped_swiglu"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(_config(**moe), 1)
    config = _config()
    config.parallel.tp, config.parallel.etp, config.parallel.ep = 1, 5, 1
    config.moe.ffn_hidden_size = 20
    with pytest.raises(ConfigError, match=r"model.hidden_size=12 is not divisible by parallel.etp=5 "
                                          r"\(moe.expert_linear_bias=true splits fc2's bias"):
        validate(config, 5)
    validate(_config(), 1)


@pytest.mark.parametrize("moe", [{}, dict(router_bias=False, expert_linear_bias=False, activation="swiglu",
                                          score_on_input=True, score_function="sigmoid", topk=1)],
                         ids=["gpt_oss", "score_on_input"])
def test_expert_act_recompute_gives_the_same_layer(moe):
    """train.recompute=expert_act recomputes the activation and fc2 (with its bias and the
    prob applied after it; or with the prob on the input, Llama-4) in the backward: the same
    output and grads, bit for bit."""
    from moe_fold.models.model import set_recompute

    plain = MoELayer(_config(**moe), ProcessGroups.single_process(), 1)
    if plain.router.bias is not None:
        with torch.no_grad():
            plain.router.bias.normal_(0, 0.5)
    recomputed = copy.deepcopy(plain)
    set_recompute(recomputed, "expert_act")
    x = torch.randn(19, H, generator=torch.Generator().manual_seed(4))
    results = []
    for layer in (plain, recomputed):
        out = layer(x)
        results.append([out] + list(torch.autograd.grad((out * torch.linspace(-1, 1, H)).sum(), layer.parameters())))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
