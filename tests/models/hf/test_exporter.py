"""The exporter refuses, by name, zero-computation experts for every family but LongCat-Flash's,
and the latent MoE for every family but Nemotron-H's."""

import pytest

from moe_fold.config import load_config
from moe_fold.layout import ProcessGroups
from moe_fold.models import to_hf
from moe_fold.models.hf import HFConfigError
from moe_fold.models.hf.families import REGISTRY
from moe_fold.models.model import build_model


# (feature, the one family that holds it, the override that uses it, the refusal of every other family)
HELD_BY_ONE = [("zero_experts", "longcat_flash", "moe.zero_experts=2",
                "moe.zero_experts=2: {family} has no zero-computation experts"),
               ("moe_latent", "nemotron_h", "moe.latent_size=24",
                "moe.latent_size=24: {family}'s experts work in the hidden width")]


@pytest.mark.parametrize("feature,holder", [(f, h) for f, h, _, _ in HELD_BY_ONE])
def test_only_one_family_holds_the_feature(feature, holder):
    assert [name for name, family in REGISTRY.items() if feature in family.features] == [holder]


@pytest.mark.parametrize("feature,override,refusal,family",
                         [(f, o, r, name) for f, _, o, r in HELD_BY_ONE
                          for name, fam in sorted(REGISTRY.items()) if f not in fam.features])
def test_every_family_without_the_feature_refuses_it(tmp_path, feature, override, refusal, family):
    config = load_config("mixtral-tiny", ["parallel.ep=1", override])
    model = build_model(config, ProcessGroups.single_process())
    with pytest.raises(HFConfigError) as err:
        to_hf(model, tmp_path / "out", family=family)
    assert refusal.format(family=family) in str(err.value)
    assert not (tmp_path / "out").exists()
