"""A forward does tensor work only: every choice (backends, routing options, rules) is
made when a module is built, so a forward and its backward never call into
``moe_fold.config`` (docs/architecture.md, "One MoE layer"; the compiler would otherwise
meet the rules' Python, and a GPU would wait on it every step).

The check traces every Python call made during forward + backward (``sys.setprofile``)
and names the ones whose code belongs to ``moe_fold.config`` (a module or a package), and
every attribute read on a config object (an instance of one of ``moe_fold.config.schema``'s
dataclasses), which a forward that kept its config would make."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest
import torch

from moe_fold.config import load_config
from moe_fold.layout import ParallelLayout, ProcessGroups, GROUP_NAMES
from moe_fold.models.model import build_model
from moe_fold.models.moe_layer import MoELayer

from tests.models.test_moe_layer import _config, _inputs


def _is_config(frame) -> bool:
    name = frame.f_globals.get("__name__", "")
    return name == "moe_fold.config" or name.startswith("moe_fold.config.")


def _config_classes() -> list[type]:
    from moe_fold.config import schema

    return [c for c in vars(schema).values()
            if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == schema.__name__]


def config_calls(fn) -> list[str]:
    """Run ``fn()``; return ``"function (file:line)"`` of every call into moe_fold.config,
    and ``"Class.field (file:line)"`` of every attribute read on a config object."""
    calls: list[str] = []

    def reading(self, name):
        if not name.startswith("__"):
            caller = sys._getframe(1)
            calls.append(f"{type(self).__name__}.{name} (read at {caller.f_code.co_filename}:{caller.f_lineno})")
        return object.__getattribute__(self, name)

    def profile(frame, event, arg):
        if event == "call" and _is_config(frame):
            caller = frame.f_back
            where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "?"
            calls.append(f"{frame.f_code.co_name} (called from {where})")

    classes = _config_classes()
    assert all("__getattribute__" not in vars(c) for c in classes)
    for c in classes:
        c.__getattribute__ = reading
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        for c in classes:
            del c.__getattribute__
    return calls


def _groups():
    return ProcessGroups(ParallelLayout(world_size=1), 0, {name: None for name in GROUP_NAMES})


ROUTING = {
    "dropless": {},
    "capacity": {"capacity_factor": 1.0},
    "pad": {"capacity_factor": 1.0, "pad_to_capacity": True},
    "sigmoid-groups-bias": {"score_function": "sigmoid", "num_groups": 4, "group_topk": 2, "expert_bias": True,
                            "scaling_factor": 2.0},
    "pre-softmax-norm-min": {"pre_softmax": True, "topk_norm_min": 1e-3},
    "losses-shared-gate": {"aux_loss_coeff": 0.01, "seq_aux_loss_coeff": 0.01, "z_loss_coeff": 0.001,
                           "shared_expert_ffn_hidden_size": 20, "shared_expert_gate": True},
    "overlap": {"shared_expert_ffn_hidden_size": 20, "shared_expert_overlap": True, "overlap_chunks": 2},
    "allgather": {"dispatcher": "allgather"},
}


@pytest.mark.parametrize("moe", list(ROUTING.values()), ids=list(ROUTING))
def test_moe_layer_forward_and_backward_call_nothing_in_config(moe):
    layer = MoELayer(_config(**moe), _groups(), 0)
    x = _inputs().requires_grad_()
    seq_ids = torch.arange(x.shape[0]) % 2

    def step():
        layer(x, seq_ids=seq_ids, num_seqs=2).square().sum().backward()

    assert config_calls(step) == []
    assert x.grad is not None and layer.experts.fc1.grad is not None


@pytest.mark.parametrize("preset", ["mixtral-tiny", "deepseek-v3-tiny"])
def test_model_forward_and_backward_call_nothing_in_config(preset):
    """Whole models: mixtral-tiny, and deepseek-v3-tiny (MLA, a dense layer first, shared
    experts, sigmoid group-limited routing with an expert bias, MTP)."""
    config = load_config(preset, ["model.seq_length=16"])
    model = build_model(config, _groups())
    ids = torch.randint(0, config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        model(ids, ids.roll(-1, 1)).backward()

    assert config_calls(step) == []


def test_the_check_sees_a_config_call_in_a_forward(monkeypatch):
    """The tracer itself: a rule checked inside a forward is named."""
    from moe_fold import config as config_module

    layer = MoELayer(_config(), _groups(), 0)
    forward = layer.forward

    def checking_forward(hidden, **kwargs):
        config_module.require(config_module.choice, "moe.dispatcher", "alltoall")
        return forward(hidden, **kwargs)

    monkeypatch.setattr(layer, "forward", checking_forward)
    calls = config_calls(lambda: layer(_inputs()).sum().backward())
    assert any(call.startswith("require") for call in calls), calls


def test_the_check_sees_a_config_read_in_a_forward(monkeypatch):
    """The tracer itself: a forward that reads a field of a config object it kept is named."""
    config = _config()
    layer = MoELayer(config, _groups(), 0)
    forward = layer.forward

    def reading_forward(hidden, **kwargs):
        return forward(hidden, **kwargs) * config.moe.topk

    monkeypatch.setattr(layer, "forward", reading_forward)
    calls = config_calls(lambda: layer(_inputs()).sum().backward())
    assert any(call.startswith("Config.moe ") for call in calls) and any(call.startswith("MoEConfig.topk ")
                                                                      for call in calls), calls
