"""The routing collector's numbers against the routers' own outputs, counted here."""

import pytest
import torch

from moe_fold.config import Config, ModelConfig
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import build_model
from moe_fold.training.metrics import RoutingCollector
from moe_fold.training.step_losses import StepLossValues

from tests.helpers.router_outputs import router_outputs

E, Z, K = 6, 3, 3


def test_zero_expert_assignments_are_neither_loads_nor_drops():
    """moe.zero_experts: ``expert_load`` counts the held experts' assignments (what
    re-placement reads), ``dropped_fraction`` stays 0 (dropless), and each layer's
    ``zero_expert_fraction`` is its share of slots on zero experts."""
    config = Config()
    config.model = ModelConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2,
                               ffn_hidden_size=24, seq_length=8, init_std=0.5)
    m = config.moe
    m.num_experts, m.zero_experts, m.topk, m.ffn_hidden_size, m.pre_softmax = E, Z, K, 8, True
    groups = ProcessGroups.single_process()
    model = build_model(config, groups)
    collector = RoutingCollector(model, config)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with router_outputs(model) as seen, collector.recording(), torch.no_grad():
        model(tokens, tokens.roll(-1, 1))
    record = collector.read(collector.reduce(groups).cpu(), StepLossValues({}, None, 0.0))
    slots = tokens.numel() * K
    assert len(seen) == 2
    for layer, (_, out) in enumerate(seen):
        held, zero = out.routed_map[:, :E].sum(0), out.routed_map[:, E:].sum()
        assert 0 < int(zero) < slots
        assert record["expert_load"][layer] == held.tolist()
        assert collector.layer_metrics[f"moe/layer{layer}/zero_expert_fraction"] == pytest.approx(int(zero) / slots)
        assert collector.layer_metrics[f"moe/layer{layer}/dropped_fraction"] == 0.0
    assert record["dropped_fraction"] == 0.0
