"""The exporter refuses, by name, zero-computation experts for every family but LongCat-Flash's,
and the latent MoE for every family but Nemotron-H's."""

import pytest

from moe_fold.config import load_config
from moe_fold.layout import ProcessGroups
from moe_fold.models import to_hf
from moe_fold.models.hf import HFConfigError
from moe_fold.models.hf.families import REGISTRY
from moe_fold.models.model import build_model


def test_only_longcat_flash_holds_zero_experts():
    assert [name for name, family in REGISTRY.items() if "zero_experts" in family.features] == ["longcat_flash"]


@pytest.mark.parametrize("family", sorted(name for name, f in REGISTRY.items() if "zero_experts" not in f.features))
def test_zero_experts_are_refused_by_every_family_without_them(tmp_path, family):
    config = load_config("mixtral-tiny", ["parallel.ep=1", "moe.zero_experts=2"])
    model = build_model(config, ProcessGroups.single_process())
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family=family)
    assert f"moe.zero_experts=2: {family} has no zero-computation experts" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_only_nemotron_h_holds_the_latent_moe():
    assert [name for name, family in REGISTRY.items() if "moe_latent" in family.features] == ["nemotron_h"]


@pytest.mark.parametrize("family", sorted(name for name, f in REGISTRY.items() if "moe_latent" not in f.features))
def test_latent_moe_is_refused_by_every_family_without_it(tmp_path, family):
    config = load_config("mixtral-tiny", ["parallel.ep=1", "moe.latent_size=24"])
    model = build_model(config, ProcessGroups.single_process())
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family=family)
    assert f"moe.latent_size=24: {family}'s experts work in the hidden width" in str(err.value)
    assert not (tmp_path / "out").exists()
