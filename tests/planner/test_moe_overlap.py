"""The planner's MoE overlap (moe_fold/planner/moe_overlap.py): the all-to-all time left
exposed by the shared expert and by overlap chunks, by hand."""

import pytest

from tests.helpers.planner_cases import hand_config


@pytest.mark.parametrize("overlap, exposed", [
    (dict(), 2e-2),
    # the shared expert (S) hides its time of the whole all-to-all (A): A - S
    (dict(shared_expert_overlap=True), 2e-2 - 4.992e-3),
    # two chunks: half of A behind half of the experts (G), the other half exposed: (A - G)/2 + A/2
    (dict(overlap_chunks=2), (2e-2 - 1.3824e-2) / 2 + 1e-2),
    # both: the shared expert under the first dispatch and the last combine: (A - G)/2 + (A/2 - S)
    (dict(shared_expert_overlap=True, overlap_chunks=2), (2e-2 - 1.3824e-2) / 2 + 1e-2 - 4.992e-3),
])
def test_moe_overlap_exposed_all_to_all_by_hand(overlap, exposed):
    from moe_fold.planner.estimate import Assumptions, estimate
    from moe_fold.planner.hardware import GPU

    # world 2: ep 2, dp 2; one micro-batch of 4 tokens per rank, 8 rows, 4 to the other ep
    # rank and 4 back: 2 * 8 * H*a 16 + 8 probs * 4 = 288 bytes at 1.44e4 B/s: A = 2e-2 s. At
    # 0.5 * 1e6 FLOP/s, forward and backward of 4 tokens: experts G = 3*4*576/5e5 = 1.3824e-2 s,
    # shared expert S = 3*4*208/5e5 = 4.992e-3 s (tests/planner/test_model.py::test_flops_by_hand).
    config = hand_config(ep=2)
    gpu = GPU("toy", peak_flops=1e6, memory=1e9, hbm_bw=1e6, nvlink_bw=1.44e4, inter_node_bw=1e2)
    assumptions = Assumptions(matmul_efficiency=0.5, memory_overhead=0)
    base = estimate(config, 2, gpu, assumptions)
    for key, value in overlap.items():
        setattr(config.moe, key, value)
    plan = estimate(config, 2, gpu, assumptions)
    assert base.comm_bytes["ep"] == 288 and base.time["ep"] == pytest.approx(2e-2)
    assert plan.time["ep"] == pytest.approx(exposed)
    assert plan.time["total"] == pytest.approx(base.time["total"] - 2e-2 + exposed)
    assert plan.moe_overlap == {"shared_expert_overlap": overlap.get("shared_expert_overlap", False),
                                "overlap_chunks": overlap.get("overlap_chunks", 1),
                                "ep_a2a_s": pytest.approx(2e-2), "ep_a2a_exposed_s": pytest.approx(exposed)}
