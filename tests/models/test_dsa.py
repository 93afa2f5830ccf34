"""DeepSeek Sparse Attention: the config rules, the layer against transformers'
DeepSeek-V3.2 and GLM-MoE-DSA attention modules (float32, odd sizes, index_topk below the
sequence length), the selection's size, and the two training stages: where gradients flow
and the indexer's KL against a float64 computation written here from the DeepSeek-V3.2
report. Layouts (tp, cp ring and a2a, pp) are in tests/parallel/test_parallel_matrix.py."""

import math

import pytest
import torch
from transformers import DeepseekV32Config, GlmMoeDsaConfig
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention, DeepseekV32RotaryEmbedding
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention

from moe_fold.config import Config, ConfigError, ModelConfig, validate
from moe_fold.models.dsa import DSAttention, IndexerKL, select_topk, visible_keys
from moe_fold.models.rotary import rotary_cos_sin
from tests.models.test_mla import _problems as mla_problems

# DSA at odd test sizes: 3 heads, q/kv ranks 10/7, qk 6 + 4, v 5; indexer 8 heads of 8, top 5 of 13
# (8 heads: a key scores exactly 0, all heads negative, once in 256, so no two keys tie at a
# query's k-th score here, where transformers' topk orders ties arbitrarily).
DSA_MODEL = dict(attention="mla", num_heads=3, num_kv_heads=3, hidden_size=24, q_lora_rank=10, kv_lora_rank=7,
                 qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, rope_interleave=True, dsa=True,
                 index_n_heads=8, index_head_dim=8, index_topk=5)
S, B = 13, 2


def _problems(**model) -> list[str]:
    """The config rules' problems with DSA_MODEL's fields and ``model`` set."""
    return mla_problems(**{**DSA_MODEL, **model})


def test_dsa_config_validates():
    assert _problems() == []
    assert _problems(indexer_types=["full", "shared", "full", "shared"]) == []


@pytest.mark.parametrize("change,message", [
    (dict(q_lora_rank=None), "model.dsa=true needs model.attention=mla with model.q_lora_rank set"),
    (dict(index_topk=0), "model.index_topk=0 must be >= 1"),
    (dict(index_n_heads=0), "model.index_n_heads=0 must be >= 1"),
    (dict(index_head_dim=2), "model.index_head_dim=2 must be >= model.qk_rope_head_dim=4"),
    (dict(dsa_indexer_loss_weight=-1.0), "model.dsa_indexer_loss_weight=-1.0 must be >= 0"),
    (dict(indexer_types=["full", "shared"]), "model.indexer_types has 2 entries; it must have one per layer"),
    (dict(indexer_types=["full", "half", "full", "full"]), "model.indexer_types[1]='half' must be full or shared"),
    (dict(indexer_types=["shared", "full", "full", "full"]), "model.indexer_types[0]='shared' must be full"),
    (dict(indexer_types=["full", "shared", "full", "full"], dsa_stage="dense_warmup"),
     "model.dsa_stage=dense_warmup with shared layers in model.indexer_types"),
    (dict(dsa=False, indexer_types=["full"] * 4), "model.indexer_types=['full', 'full', 'full', 'full'] is set but "
                                                  "model.dsa=false"),
    (dict(mla_norm_eps=0.0), "model.mla_norm_eps=0.0 must be > 0"),
    (dict(block="shortcut_moe"), "model.block=shortcut_moe is not supported with model.dsa=true"),
    (dict(dsa_stage="warm"), "model.dsa_stage=warm must be one of dense_warmup, sparse"),
])
def test_dsa_config_rules(change, message):
    assert any(message in p for p in _problems(**change)), _problems(**change)


def test_dsa_config_takes_dynamic_cp():
    """Dynamic cp runs DSA over each sub-group (its equality with one process:
    tests/training/test_dynamic_cp.py::test_dynamic_cp_equals_one_process)."""
    config = Config()
    for key, value in DSA_MODEL.items():
        setattr(config.model, key, value)
    config.parallel.cp, config.parallel.dynamic_cp = 2, True
    validate(config, 2)


def test_dsa_config_takes_a_stage_beginning_with_a_shared_layer():
    """The stage boundary carries the selection (its equality with one process:
    tests/parallel/test_parallel_matrix.py::test_dsa_matches_single_process, the
    ``dsa-glm5-boundary-*`` rows)."""
    config = Config()
    for key, value in {**DSA_MODEL, "indexer_types": ["full", "full", "shared", "full"]}.items():
        setattr(config.model, key, value)
    config.parallel.pp = 2
    validate(config, 2)


# --------------------------------------------------------------------------- against transformers

def _hf_config(glm: bool, topk: int = 5):
    cls = GlmMoeDsaConfig if glm else DeepseekV32Config
    m = DSA_MODEL
    hf = cls(vocab_size=32, hidden_size=m["hidden_size"], num_attention_heads=m["num_heads"],
             num_key_value_heads=m["num_heads"], q_lora_rank=m["q_lora_rank"], kv_lora_rank=m["kv_lora_rank"],
             qk_nope_head_dim=m["qk_nope_head_dim"], qk_rope_head_dim=m["qk_rope_head_dim"],
             v_head_dim=m["v_head_dim"], index_n_heads=m["index_n_heads"], index_head_dim=m["index_head_dim"],
             index_topk=topk, num_hidden_layers=1, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf._attn_implementation = "eager"
    return hf


def _ours(glm: bool, **change) -> DSAttention:
    m = ModelConfig(**{**DSA_MODEL, "index_rope_interleave": glm, "norm_eps": 1e-6, **change})
    return DSAttention(m, None, False, seed=5, name="layers.0.attn", layer=0)


_NAMES = {"q_a_proj.weight": "q_down.weight", "q_a_layernorm.weight": "q_norm.weight",
          "q_b_proj.weight": "q_up.weight", "kv_a_proj_with_mqa.weight": "kv_down.weight",
          "kv_a_layernorm.weight": "kv_norm.weight", "kv_b_proj.weight": "kv_up.weight",
          "o_proj.weight": "proj.weight", "indexer.wq_b.weight": "indexer.wq.weight",
          "indexer.wk.weight": "indexer.wk.weight", "indexer.k_norm.weight": "indexer.k_norm.weight",
          "indexer.k_norm.bias": "indexer.k_norm.bias", "indexer.weights_proj.weight": "indexer.weights_proj.weight"}


def _pair(glm: bool, topk: int = 5, seed: int = 0, **change):
    """transformers' attention (random weights, a LayerNorm with a random affine part) and
    ours holding the same weights."""
    torch.manual_seed(seed)
    hf_config = _hf_config(glm, topk)
    hf = (GlmMoeDsaAttention if glm else DeepseekV32Attention)(hf_config, 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        hf.indexer.k_norm.bias.normal_(0, 0.3)
    ours = _ours(glm, index_topk=topk, **change)
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for theirs, name in _NAMES.items():
            params[name].copy_(hf.get_parameter(theirs))
    return hf_config, hf, ours


def _hf_forward(hf_config, hf, x):
    rotary = DeepseekV32RotaryEmbedding(hf_config)
    positions = torch.arange(S).unsqueeze(0).expand(B, -1)
    cos, sin = rotary(x, positions)
    mask = torch.full((S, S), torch.finfo(x.dtype).min).triu(1).expand(B, 1, S, S)
    out, weights = hf(x, (cos, sin), mask, position_ids=positions)[:2]
    return out, weights


def _our_forward(ours, x):
    cos, sin = rotary_cos_sin(torch.arange(S), ours.rope, 10000.0, x.dtype)
    return ours(x.transpose(0, 1), cos, sin).transpose(0, 1)


def _boundary_ties(ours, x, topk) -> int:
    """Queries whose k-th and (k+1)-th visible keys score the same (x ``[B, S, H]``)."""
    cos, sin = rotary_cos_sin(torch.arange(S), ours.rope, 10000.0, x.dtype)
    xs = x.transpose(0, 1)
    index_q, weights = ours.indexer.queries(xs, ours.q_norm(ours.q_down(xs)), cos, sin)
    scores = ours.indexer.scores(index_q, weights, ours.indexer.keys(xs, cos, sin))
    allowed = visible_keys(torch.arange(S), torch.arange(S), None, None)
    ranked = scores.masked_fill(~allowed, -math.inf).sort(dim=-1, descending=True).values
    kth, after = ranked[..., topk - 1], ranked[..., topk]
    return int(((kth == after) & torch.isfinite(after)).sum())


@pytest.mark.parametrize("glm", [False, True], ids=["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("topk", [5, 12])
def test_dsa_layer_matches_transformers(glm, topk):
    hf_config, hf, ours = _pair(glm, topk)
    x = torch.randn(B, S, DSA_MODEL["hidden_size"])
    with torch.no_grad():
        assert _boundary_ties(ours, x, topk) == 0  # where transformers' choice among ties is arbitrary
    expected, _ = _hf_forward(hf_config, hf, x)
    got = _our_forward(ours, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_dsa_differs_from_dense_mla():
    """index_topk below the sequence length changes the output (the test above is not dense MLA)."""
    hf_config, hf, ours = _pair(False, 5)
    x = torch.randn(B, S, DSA_MODEL["hidden_size"])
    dense = _ours(False, index_topk=5, dsa_stage="dense_warmup")
    dense.load_state_dict(ours.state_dict())
    assert (_our_forward(dense, x) - _our_forward(ours, x)).abs().max() > 1e-2


def test_selection_keeps_topk_visible_keys():
    """Each query keeps exactly min(topk, its visible keys) keys, all visible, the best-scored."""
    torch.manual_seed(1)
    scores = torch.randn(B, S, S)
    allowed = visible_keys(torch.arange(S), torch.arange(S), None, None)
    chosen = select_topk(scores, allowed, 5)
    counts = chosen.sum(-1)  # [B, S]
    assert counts.tolist() == [[min(5, t + 1) for t in range(S)]] * B
    assert not (chosen & ~allowed).any()
    worst_kept = scores.masked_fill(~chosen, math.inf).amin(-1)
    best_dropped = scores.masked_fill(chosen | ~allowed, -math.inf).amax(-1)
    assert (worst_kept > best_dropped).all()


# --------------------------------------------------------------------------- training stages

def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_pairs(x, pos, interleaved):
    """Rotary on ``x [..., S, r]`` at positions ``pos``: pairs (x0, x1), (x2, x3)... or halves."""
    r = x.shape[-1]
    angle = pos[:, None].double() * 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)  # [S, r/2]
    cos, sin = angle.cos(), angle.sin()
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : r // 2], x[..., r // 2:])
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _reference(hf, x, topk, sparse, glm):
    """Float64 DSA layer from the DeepSeek-V3.2 report: the main attention's probabilities
    ``[B, heads, S, S]``, the indexer scores, the mask the attention used and the KL loss."""
    w = {n: p.double() for n, p in hf.named_parameters()}
    m = DSA_MODEL
    nope, rope, vd, H = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"], m["num_heads"]
    x = x.double()
    pos = torch.arange(S)
    c = _rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"])
    q = (c @ w["q_b_proj.weight"].T).view(B, S, H, nope + rope).transpose(1, 2)
    kv = x @ w["kv_a_proj_with_mqa.weight"].T
    latent, k_rope = kv.split([m["kv_lora_rank"], rope], dim=-1)
    kvb = (_rms(latent, w["kv_a_layernorm.weight"]) @ w["kv_b_proj.weight"].T).view(B, S, H, nope + vd).transpose(1, 2)
    q = torch.cat([q[..., :nope], _rotate_pairs(q[..., nope:], pos, True)], dim=-1)
    k = torch.cat([kvb[..., :nope], _rotate_pairs(k_rope, pos, True).unsqueeze(1).expand(B, H, S, rope)], dim=-1)
    n, d = m["index_n_heads"], m["index_head_dim"]
    iq = (c @ w["indexer.wq_b.weight"].T).view(B, S, n, d)
    iq = torch.cat([_rotate_pairs(iq[..., :rope].transpose(1, 2), pos, glm).transpose(1, 2), iq[..., rope:]], -1)
    ik = torch.nn.functional.layer_norm(x @ w["indexer.wk.weight"].T, (d,), w["indexer.k_norm.weight"],
                                        w["indexer.k_norm.bias"], eps=1e-6)
    ik = torch.cat([_rotate_pairs(ik[..., :rope], pos, glm), ik[..., rope:]], dim=-1)  # [B, S, d]
    heads = torch.relu(torch.einsum("btjd,bsd->btjs", iq, ik) / math.sqrt(d))
    scores = torch.einsum("btj,btjs->bts", (x @ w["indexer.weights_proj.weight"].T) / math.sqrt(n), heads)
    causal = pos[None, :] <= pos[:, None]
    # Equal scores (relu's exact zeros) go to the earlier key.
    top = scores.masked_fill(~causal, -math.inf).sort(dim=-1, descending=True, stable=True).indices[..., :topk]
    selected = torch.zeros(B, S, S, dtype=torch.bool).scatter(-1, top, True) & causal
    mask = selected if sparse else causal.expand(B, S, S)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(nope + rope)
    probs = torch.softmax(logits.masked_fill(~mask[:, None], -math.inf), dim=-1)
    # The target: the attention summed over heads, L1-normalised, on the keys the attention used.
    kl = 0.0
    for b in range(B):
        for t in range(S):
            keys = mask[b, t].nonzero().flatten()
            target = probs[b, :, t, keys].detach().sum(0)
            target = target / target.sum()
            log_q = torch.log_softmax(scores[b, t, keys], dim=0)
            kl = kl + (target * (target.log() - log_q)).sum()
    return kl / (B * S), mask


def _indexer(module):
    return [p for n, p in module.named_parameters() if n.startswith("indexer.")]


def _main(module):
    return [p for n, p in module.named_parameters() if not n.startswith("indexer.")]


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
@pytest.mark.parametrize("glm", [False, True], ids=["deepseek_v32", "glm_moe_dsa"])
def test_indexer_kl_matches_float64(stage, glm):
    _, hf, ours = _pair(glm, 5, dsa_stage=stage)
    seen = []
    ours.kl.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    x = torch.randn(B, S, DSA_MODEL["hidden_size"])
    _our_forward(ours, x)
    expected, _ = _reference(hf, x, 5, stage == "sparse", glm)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0].double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_lm_loss_gives_the_indexer_no_gradient(stage):
    """With the KL off, a loss on the layer's output reaches the main weights only."""
    _, _, ours = _pair(False, 5, dsa_stage=stage, dsa_indexer_loss_weight=0.0)
    x = torch.randn(B, S, DSA_MODEL["hidden_size"], requires_grad=True)
    _our_forward(ours, x).square().sum().backward()
    assert all(p.grad is None for p in _indexer(ours))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in _main(ours))


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
@pytest.mark.parametrize("glm", [False, True], ids=["deepseek_v32", "glm_moe_dsa"])
def test_indexer_kl_trains_the_indexer_only(stage, glm):
    """The KL's gradient reaches the indexer (equal to the float64 KL's gradient) and
    nothing else: neither the main weights nor the layer's input."""
    _, hf, ours = _pair(glm, 5, dsa_stage=stage, dsa_indexer_loss_weight=0.5)
    x = torch.randn(B, S, DSA_MODEL["hidden_size"], requires_grad=True)
    (_our_forward(ours, x) * 0.0).sum().backward()  # the LM loss's gradient is 0: what is left is the KL's
    assert all(p.grad is None or not p.grad.any() for p in _main(ours))
    assert x.grad is None or not x.grad.any()
    expected, _ = _reference(hf, x.detach(), 5, stage == "sparse", glm)
    ref = torch.autograd.grad(expected, [p for n, p in hf.named_parameters() if n.startswith("indexer.")],
                              allow_unused=True)
    for ours_p, ref_g in zip(_indexer(ours), ref):
        torch.testing.assert_close(ours_p.grad.double(), 0.5 * ref_g.double(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_packed_documents_attend_and_select_inside_each_document(stage):
    """A row packing two documents gives each document's own output and KL: a query selects
    (and attends to) keys of its own document only, positions restarting at each."""
    from moe_fold.parallel.varlen import Documents

    _, _, ours = _pair(False, 5, dsa_stage=stage)
    kl = []
    ours.kl.register_forward_hook(lambda module, args, out: kl.append(float(out.detach())))
    lengths = [6, 7]
    x = torch.randn(1, S, DSA_MODEL["hidden_size"])
    positions = torch.cat([torch.arange(n) for n in lengths])
    cos, sin = rotary_cos_sin(positions, ours.rope, 10000.0, x.dtype)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)
    packed = ours(x.transpose(0, 1), cos.unsqueeze(0), sin.unsqueeze(0), Documents(doc_ids, None, None))
    alone = []
    for doc in x.split(lengths, dim=1):
        cos, sin = rotary_cos_sin(torch.arange(doc.shape[1]), ours.rope, 10000.0, x.dtype)
        alone.append(ours(doc.transpose(0, 1), cos, sin))
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-6)
    # The KL is a mean over queries: the packed row's is the documents' weighted by their lengths.
    assert kl[0] == pytest.approx((kl[1] * lengths[0] + kl[2] * lengths[1]) / S, rel=1e-5)


# --------------------------------------------------------------------------- activation recompute

# A 4-layer model of DSA layers on the packed tests' batch (tests/parallel/test_varlen.py):
# layer 0 a dense block (train.recompute=full recomputes it whole), layers 1-3 MoE blocks
# (their attention recomputed); GLM-5's shared layers 1 and 3 in the sparse stage.
RECOMPUTE_DSA = dict(attention="mla", num_kv_heads=4, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
                     qk_rope_head_dim=4, v_head_dim=5, rope_interleave=True, dsa=True, index_n_heads=3,
                     index_head_dim=6, index_topk=4, dsa_indexer_loss_weight=0.5, num_layers=4)
RECOMPUTE_STAGES = {"dense_warmup": dict(dsa_stage="dense_warmup"),
                    "sparse-glm5": dict(dsa_stage="sparse", index_rope_interleave=True,
                                        indexer_types=["full", "shared", "full", "shared"])}


def _recompute_run(stage, recompute):
    """Loss, every gradient and the step's indexer loss value (what the metrics report) of
    one forward and backward of the packed batch under ``train.recompute=recompute``."""
    from moe_fold.layout import ProcessGroups
    from moe_fold.models.model import build_model
    from moe_fold.training.step import forward_backward
    from moe_fold.training.step_losses import StepLosses
    from tests.parallel.test_varlen import _config, _packed_batch

    config = _config({**RECOMPUTE_DSA, **RECOMPUTE_STAGES[stage]})
    config.moe.first_k_dense = 1
    config.train.recompute = recompute
    validate(config, 1)
    groups = ProcessGroups.single_process()
    model = build_model(config, groups)
    losses = StepLosses(model, config)
    batches = [_packed_batch(), _packed_batch(row_docs=[[16], [2, 14]])]
    loss = forward_backward(model, batches, groups, config, forward_context=losses.recording).sum()
    values = losses.values(losses.reduce(groups, {}))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    recomputes = [block.recompute for block in model.layers]
    assert recomputes == (["all"] + ["attention"] * 3 if recompute == "full" else ["none"] * 4)
    return loss, grads, values.indexer, values.weighted


@pytest.mark.parametrize("stage", list(RECOMPUTE_STAGES))
def test_recompute_gives_the_same_loss_grads_and_indexer_loss(stage):
    """train.recompute=full recomputes DSA layers (a whole dense block, an MoE block's
    attention): the backward runs the indexer, its selection (a shared layer's read from the
    forward's selections) and its KL again. The loss, every gradient (the KL-trained
    indexers' included) and the indexer loss the step reports equal those without recompute
    bit for bit: the KL is neither counted twice nor lost, and keeps its micro-batch share."""
    want_loss, want_grads, want_kl, want_weighted = _recompute_run(stage, "none")
    loss, grads, kl, weighted = _recompute_run(stage, "full")
    assert want_kl > 0
    assert torch.equal(loss, want_loss)
    assert (kl, weighted) == (want_kl, want_weighted)
    assert grads.keys() == want_grads.keys()
    assert any(".indexer." in n for n in grads)
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name


def test_padding_queries_train_no_indexer():
    """The KL is a mean over real queries: a row of two documents and 3 padding tokens (its
    own segment, ``Documents.token_mask`` False) gives the documents' KLs weighted by their
    lengths, the padding's left out (dynamic cp drops the loader's padding and pads its own,
    so its KL equals one process's only so: tests/training/test_dynamic_cp.py)."""
    from moe_fold.parallel.varlen import Documents

    _, _, ours = _pair(False, 5, dsa_stage="sparse")
    kl = []
    ours.kl.register_forward_hook(lambda module, args, out: kl.append(float(out.detach())))
    lengths = [6, 4, 3]
    x = torch.randn(1, S, DSA_MODEL["hidden_size"])
    positions = torch.cat([torch.arange(n) for n in lengths])
    cos, sin = rotary_cos_sin(positions, ours.rope, 10000.0, x.dtype)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)
    real = torch.arange(S) < S - lengths[-1]  # [S_local * B], B = 1
    ours(x.transpose(0, 1), cos.unsqueeze(0), sin.unsqueeze(0), Documents(doc_ids, None, real))
    for doc in x.split(lengths, dim=1)[:2]:
        cos, sin = rotary_cos_sin(torch.arange(doc.shape[1]), ours.rope, 10000.0, x.dtype)
        ours(doc.transpose(0, 1), cos, sin)
    assert kl[0] == pytest.approx((kl[1] * lengths[0] + kl[2] * lengths[1]) / (S - lengths[-1]), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_stage_boundary_carries_the_selection_exactly(dtype):
    """Under pp a stage's output packs the selection a shared layer after it reuses, eight
    keys a value of the hidden states' dtype, in ``boundary_width``; the next stage unpacks
    the very same selection (13 keys: not a multiple of 8)."""
    from moe_fold.layout import GROUP_NAMES, ParallelLayout, ProcessGroups
    from moe_fold.models.model import build_model
    from tests.parallel.test_varlen import _config

    config = _config({**RECOMPUTE_DSA, **RECOMPUTE_STAGES["sparse-glm5"],
                      "indexer_types": ["full", "full", "shared", "shared"]}, pp=2)
    validate(config, 2)
    first, second = (build_model(config, ProcessGroups(ParallelLayout(2, pp=2), r, {k: None for k in GROUP_NAMES}))
                     for r in (0, 1))
    assert (first.selection_out, second.selection_in) == ([1], [1])
    selected = torch.rand(B, S, S) < 0.3  # [B, S_local, L]
    x = torch.randn(S, B, config.model.hidden_size, dtype=dtype)
    packed = first._pack_selection(x, selected)
    assert packed.shape == (S, B, first.boundary_width(S)) == (S, B, config.model.hidden_size + 2)
    h, got = second._unpack_selection(packed)
    assert torch.equal(h, x) and torch.equal(got, selected)


def test_stage_boundaries_carry_a_selection_only_where_a_stage_begins_shared():
    """GLM-5's shared layers 1 and 3 on stages [0, 1] [2, 3]: every stage begins with a full
    layer, so the boundary holds the hidden states alone (the dry run's and the planner's)."""
    from moe_fold.layout import GROUP_NAMES, ParallelLayout, ProcessGroups
    from moe_fold.models.model import build_model
    from tests.parallel.test_varlen import _config

    config = _config({**RECOMPUTE_DSA, **RECOMPUTE_STAGES["sparse-glm5"]}, pp=2)
    model = build_model(config, ProcessGroups(ParallelLayout(2, pp=2), 0, {k: None for k in GROUP_NAMES}))
    assert (model.selection_in, model.selection_out) == ([None], [None])
    assert model.boundary_width(S) == config.model.hidden_size
