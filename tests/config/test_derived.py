"""Derived sizes and layer patterns (moe_fold/config/derived.py): which layers are MoE, the
data-parallel and expert sizes of a layout (and a world they do not divide refused), the head
width, data.path as a list, and the layers of each pipeline chunk."""

import pytest

from moe_fold.config import (ConfigError, data_paths, dp_size, edp_size, etp_size, head_dim, load_config,
                             moe_layer_flags, pp_layer_counts, vpp_size)


def test_moe_layer_flags():
    base = ["model.num_layers=6"]
    assert moe_layer_flags(load_config(None, base)) == [True] * 6
    assert moe_layer_flags(load_config(None, base + ["moe.moe_layer_freq=0"])) == [False] * 6
    assert moe_layer_flags(load_config(None, base + ["moe.moe_layer_freq=2", "moe.first_k_dense=1"])) == \
        [False, False, True, False, True, False]
    assert moe_layer_flags(load_config(None, base + ["moe.moe_layer_freq=3"])) == \
        [True, False, False, True, False, False]
    assert moe_layer_flags(load_config(None, base + ["moe.moe_layer_freq=[1,0,1,1,0,1]", "moe.first_k_dense=3"])) == \
        [False, False, False, True, False, True]
    with pytest.raises(ConfigError, match=r"moe.moe_layer_freq=\[1, 0\] must be 6 flags"):
        moe_layer_flags(load_config(None, base + ["moe.moe_layer_freq=[1,0]"]))


def test_parallel_sizes():
    config = load_config(None, ["parallel.tp=2", "parallel.ep=4"])
    assert etp_size(config) == 2 and vpp_size(config) == 1
    assert dp_size(config, 8) == 4 and edp_size(config, 8) == 1
    config.parallel.etp = 1
    assert edp_size(config, 8) == 2
    config.parallel.pp = 2
    assert dp_size(config, 8) == 2 and edp_size(config, 8) == 1
    with pytest.raises(ConfigError, match=r"world_size=6 is not divisible by parallel.tp\*cp\*pp=4"):
        dp_size(config, 6)


def test_head_dim_and_data_paths():
    assert head_dim(load_config()) == 32
    assert head_dim(load_config(None, ["model.head_dim=48"])) == 48
    assert data_paths(load_config()) == []
    assert data_paths(load_config(None, ["data.path=corpus"])) == ["corpus"]
    assert data_paths(load_config(None, ["data.path=[a,b]"])) == ["a", "b"]


def test_pp_layer_counts():
    assert pp_layer_counts(load_config(None, ["model.num_layers=8", "parallel.pp=2", "parallel.vpp=2"])) == [2] * 4
    assert pp_layer_counts(load_config(None, ["parallel.pp=2", "parallel.pp_layers=[1,3]"])) == [1, 3]
