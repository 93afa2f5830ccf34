"""The step's auxiliary losses (moe_fold/training/step_losses.py): per MoE layer, the mean of
what each router's output carried over the recorded micro-batches (a forward outside
``recording`` not counted), weighted by the coefficients into the step's loss; and the row
fields the metrics print."""

import pytest
import torch

from moe_fold.config import Config, ModelConfig
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import build_model
from moe_fold.models.dsa import IndexerKL
from moe_fold.training.step_losses import StepLosses, StepLossValues

from tests.helpers.router_outputs import router_outputs


def test_step_losses_are_the_router_outputs_mean_weighted_by_their_coefficients():
    config = Config()
    config.model = ModelConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2,
                               ffn_hidden_size=24, seq_length=8)
    m = config.moe
    m.num_experts, m.topk, m.ffn_hidden_size = 4, 2, 8
    m.aux_loss_coeff, m.z_loss_coeff, m.seq_aux_loss_coeff = 0.01, 0.001, 0.0
    groups = ProcessGroups.single_process()
    model = build_model(config, groups)
    losses = StepLosses(model, config)
    gen = torch.Generator().manual_seed(0)
    seen_losses = []
    # The routers compute their losses in training with grad on, as in a step.
    for _ in range(2):
        tokens = torch.randint(0, 32, (2, 8), generator=gen)
        with router_outputs(model) as seen, losses.recording():
            model(tokens, tokens.roll(-1, 1))
        seen_losses.append([out.losses for _, out in seen])
    model(tokens, tokens.roll(-1, 1))  # not recorded: not counted
    values = losses.values(losses.reduce(groups, {}).cpu())
    assert set(values.per_layer) == {"aux", "z"} and values.mtp is None
    for kind in ("aux", "z"):
        want = [sum(float(step[layer][kind]) for step in seen_losses) / 2 for layer in range(2)]
        assert values.per_layer[kind].tolist() == pytest.approx(want, rel=1e-12)
    weighted = sum(0.01 * float(values.per_layer["aux"][l]) + 0.001 * float(values.per_layer["z"][l]) for l in range(2))
    assert values.weighted == pytest.approx(weighted, rel=1e-12)
    fields = values.fields()
    assert fields["aux_loss"] == pytest.approx(float(values.per_layer["aux"].mean()))
    assert fields["z_loss"] == pytest.approx(float(values.per_layer["z"].mean())) and fields["mtp_loss"] is None
    losses.close()


def test_fields_sum_the_balancing_losses_and_leave_the_off_ones_none():
    assert StepLossValues({}, None, 0.0).fields() == {"aux_loss": None, "z_loss": None, "mtp_loss": None,
                                                      "indexer_loss": None}
    both = StepLossValues({"aux": torch.tensor([1.0, 3.0]), "global_aux": torch.tensor([2.0, 2.0])}, [0.5], 1.0)
    # the enabled balancing losses summed per layer, then the mean over layers
    assert both.fields() == {"aux_loss": 4.0, "z_loss": None, "mtp_loss": [0.5], "indexer_loss": None}


def test_indexer_loss_is_the_dsa_layers_kl_mean_weighted():
    """DSA: ``indexer_loss`` is the mean over the indexer layers (a GLM-5 shared layer has
    none) and recorded micro-batches of each layer's KL; the weight times their sum joins
    the step's loss."""
    config = Config()
    config.model = ModelConfig(vocab_size=32, hidden_size=16, num_layers=3, num_heads=2, num_kv_heads=2,
                               ffn_hidden_size=24, seq_length=8, attention="mla", q_lora_rank=6, kv_lora_rank=5,
                               qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3, dsa=True, index_n_heads=2,
                               index_head_dim=4, index_topk=3, indexer_types=["full", "shared", "full"],
                               dsa_indexer_loss_weight=0.3)
    config.moe.moe_layer_freq = 0
    groups = ProcessGroups.single_process()
    model = build_model(config, groups)
    losses = StepLosses(model, config)
    assert losses.kl_layers == [0, 2]
    seen = []
    for name, module in model.named_modules():
        if isinstance(module, IndexerKL):
            module.register_forward_hook(lambda mod, args, out, name=name: seen.append((name, float(out.detach()))))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens = torch.randint(0, 32, (2, 8), generator=gen)
        with losses.recording():
            model(tokens, tokens.roll(-1, 1))
    model(tokens, tokens.roll(-1, 1))  # not recorded: not counted
    values = losses.values(losses.reduce(groups, {}).cpu())
    recorded = seen[:4]
    assert [n for n, _ in recorded] == ["layers.0.attn.kl", "layers.2.attn.kl"] * 2
    per_layer = [(recorded[0][1] + recorded[2][1]) / 2, (recorded[1][1] + recorded[3][1]) / 2]
    assert values.fields()["indexer_loss"] == pytest.approx(sum(per_layer) / 2, rel=1e-12)
    assert values.weighted == pytest.approx(0.3 * sum(per_layer), rel=1e-12)
    losses.close()
