"""Multi-token prediction (models/mtp.py) on one process: the shifted targets, and the
objective against DeepSeek-V3's formula written out here with plain torch ops.

Layout invariance (tp+SP, ring and a2a cp with packed documents, pp with vpp, ep, etp)
is in tests/parallel/test_parallel_matrix.py (the ``mtp-*`` cases).
"""

import pytest
import torch
import torch.nn.functional as F

from moe_fold.config import Config, ModelConfig
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import build_model
from moe_fold.models.mtp import shift_for_depths
from moe_fold.parallel.varlen import doc_ids_from_cu_seqlens


def test_shift_stays_in_the_row_and_the_document():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    labels = torch.tensor([[11, 12, 13, 14, 15, 16]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 1.0]])  # the label after document 0's end is out
    docs = doc_ids_from_cu_seqlens(torch.tensor([0, 3, 6]), 1, 6)  # documents [0, 3) and [3, 6)
    t, lab, m = shift_for_depths(tokens, labels, mask, docs, depths=2)
    assert t.tolist() == [[[11, 12, 13, 14, 15, 0]], [[12, 13, 14, 15, 0, 0]]]
    assert lab.tolist() == [[[12, 13, 14, 15, 16, 0]], [[13, 14, 15, 16, 0, 0]]]
    # Depth 1 at t=1 predicts label[2] (another document: masked), t=2 reads token 3 of document 1.
    assert m.tolist() == [[[1.0, 0.0, 0.0, 1.0, 1.0, 0.0]], [[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]]
    _, _, m_plain = shift_for_depths(tokens, labels, torch.ones(1, 6), None, depths=2)
    assert m_plain.tolist() == [[[1.0] * 5 + [0.0]], [[1.0] * 4 + [0.0] * 2]]


def _config(moe: bool, tie: bool, weight: float = 0.3):
    config = Config()
    config.model = ModelConfig(vocab_size=37, hidden_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
                               ffn_hidden_size=40, seq_length=12, init_std=0.2, tie_embeddings=tie,
                               mtp_num_layers=2, mtp_loss_weight=weight)
    config.moe.num_experts, config.moe.topk, config.moe.ffn_hidden_size = 4, 2, 16
    config.moe.aux_loss_coeff = 0.0
    config.moe.moe_layer_freq = 1 if moe else 0
    return config


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("moe, tie", [(False, False), (True, True)])
def test_objective_is_deepseek_v3_formula(moe, tie):
    """The returned value is the LM loss; its gradient is that of LM + weight/D * sum_k CE_k,
    with depth k reading emb(token[t+k]) and the depth k-1 hidden state, and CE_k the mean
    over the targets t+1+k that exist."""
    config = _config(moe, tie)
    model = build_model(config, ProcessGroups.single_process()).double()
    gen = torch.Generator().manual_seed(3)
    B, S, V, eps = 2, 12, 37, config.model.norm_eps
    tokens = torch.randint(0, V, (B, S + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss = model(inputs, labels)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    positions = torch.arange(S)
    cos, sin = model._rotary(positions)
    x = model.embed(inputs.t())  # [S, B, H]
    for block in model.layers:
        x = block(x, cos, sin)
    head = model.lm_head.weight
    lm = F.cross_entropy((_rms(x, model.norm.weight, eps) @ head.t()).reshape(-1, V), labels.t().reshape(-1))
    mtp, h = [], x
    for k in range(1, 3):
        depth = model.mtp[k - 1]
        emb = model.embed.weight[inputs[:, k:]].transpose(0, 1)  # [S-k, B, H]: tokens t+k
        h = h[: S - k]
        cat = torch.cat([_rms(emb, depth.enorm.weight, eps), _rms(h, depth.hnorm.weight, eps)], -1)
        h = depth.block(cat @ depth.eh_proj.weight.t(), cos[: S - k], sin[: S - k])
        logits = _rms(h, depth.norm.weight, eps) @ head.t()  # [S-k, B, V]
        mtp.append(F.cross_entropy(logits.reshape(-1, V), labels[:, k:].t().reshape(-1)))
    total = lm + 0.3 / 2 * (mtp[0] + mtp[1])
    total.backward()
    # The model's cross-entropy runs in float32 (vocab_parallel_cross_entropy), the rest in float64.
    torch.testing.assert_close(loss.double(), lm, rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert any(n.startswith("mtp.1.block.mlp." + ("experts" if moe else "fc1")) for n in got)


def test_mtp_loss_weight_zero_leaves_the_lm_gradient():
    with_mtp = build_model(_config(False, False, weight=0.0), ProcessGroups.single_process()).double()
    plain_config = _config(False, False)
    plain_config.model.mtp_num_layers = 0
    plain = build_model(plain_config, ProcessGroups.single_process()).double()
    tokens = torch.randint(0, 37, (2, 13), generator=torch.Generator().manual_seed(5))
    for model in (with_mtp, plain):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    mtp_params = dict(with_mtp.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(mtp_params[name].grad, p.grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")
    assert all(p.grad.abs().max() == 0 for n, p in mtp_params.items() if n.startswith("mtp."))
