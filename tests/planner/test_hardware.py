"""The GPUs the planner knows (moe_fold/planner/hardware.py): found by name in any case, an
unknown name refused with the known ones, and each GPU's figures in the order the planner's
arithmetic relies on."""

import pytest

from moe_fold.planner.hardware import GPUS, get_gpu


def test_get_gpu_ignores_case_and_refuses_an_unknown_name():
    assert get_gpu("H100") is get_gpu("h100") is GPUS["h100"]
    assert get_gpu("B200").name.startswith("B200")
    with pytest.raises(ValueError, match=r"gpu='tpu' is unknown; known GPUs: v100, a100, h100, h200, b200"):
        get_gpu("tpu")


@pytest.mark.parametrize("key", list(GPUS))
def test_each_gpu_figures_are_consistent(key):
    gpu = GPUS[key]
    # A node's links are faster than the network between nodes; FP8, where present, is
    # faster than BF16 (the MFU denominator stays BF16's); a flash kernel reaches a share
    # of the peak, its backward no more than its forward.
    assert gpu.peak_flops > 0 and gpu.memory > 0 and gpu.hbm_bw > 0
    assert gpu.nvlink_bw > gpu.inter_node_bw > 0 and gpu.gpus_per_node >= 8
    assert gpu.fp8_flops == 0 or gpu.fp8_flops > gpu.peak_flops
    assert 0 <= gpu.flash_backward <= gpu.flash_forward < 1
