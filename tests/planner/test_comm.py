"""The planner's communication bytes (moe_fold/planner/comm.py): equal to the counters of a
real training step on gloo ranks (measured routing, and padded uniform rows), and by hand
(tp, ep, etp, and context parallel ring and all-to-all)."""

import pytest

from moe_fold.layout import ParallelLayout
from moe_fold.planner.comm import Routing, step_bytes, uniform_routing

from tests.helpers.planner_cases import hand_config, layout_config, measured_routing


def test_step_bytes_equal_counters_with_measured_routing(gloo_step):
    config = layout_config("etp2")
    layout = ParallelLayout(4, tp=2, ep=2)
    counts = [r["etp2"]["counts"] for r in gloo_step]
    for rank in range(4):
        shard_ranks = {g: layout.group_of(g, rank).index(rank) for g in ("dp_cp", "tp_dp_cp", "edp")}
        planned = step_bytes(config, 4, routing=measured_routing(layout, counts, rank, 4), shard_ranks=shard_ranks)
        measured = gloo_step[rank]["etp2"]["sent"]
        assert set(planned) == set(measured), rank
        for kind, nbytes in measured.items():
            assert planned[kind] == nbytes, (rank, kind)
    # Every kind of the folded MoE step is there.
    assert set(gloo_step[0]["etp2"]["sent"]) == {"tp", "tp_cp", "tp_dp_cp", "dp_cp", "ep", "etp", "etp_ep"}


@pytest.mark.parametrize("name", ["etp1", "mla"])
def test_step_bytes_equal_counters_padded_uniform(gloo_step, name):
    config = layout_config(name)
    # 2 x 16 tokens split over tp 2: 16 per rank. Padding makes every split
    # C = ceil(16 * 2 / 4 * 1.5) = 12 rows per expert and source rank whatever the router
    # picks, so the planner's default rows are the real ones: 4 experts x 12 = 48 rows,
    # half of them (the other ep rank's 2 experts) sent, as many received, 2 x 2 x 12 held.
    assert uniform_routing(config) == Routing(sent=24.0, received=24.0, held=48, held_etp=48, meta=4)
    for rank in range(4):
        planned = step_bytes(config, 4)
        measured = gloo_step[rank][name]["sent"]
        assert set(planned) == set(measured), rank
        for kind, nbytes in measured.items():
            assert planned[kind] == nbytes, (rank, kind)
    assert {"ep", "edp", "tp", "dp_cp"} <= set(gloo_step[0][name]["sent"])


def test_comm_by_hand():
    # world 4: tp 2 with SP, ep 2, etp 1 -> dp 2, edp 2; one micro-batch per rank.
    config = hand_config(tp=2, ep=2, etp=1, sequence_parallel=True)
    got = step_bytes(config, 4)
    # One [s 4, b 1, H 8] bf16 activation X = 64 bytes; each gather or scatter over tp 2
    # moves X/2 = 32. Per column/row pair 4 * 32 = 128: attention and MLP of layer 0,
    # attention and shared expert of layer 1 -> 512; embedding 2*32, head 2*32; cross
    # entropy 3 all-reduces of 4*4 bytes over 2 ranks, 16 each -> 48; the grad norm's
    # float32 all-reduce 2*1*4//2 = 4.
    assert got["tp"] == 512 + 64 + 64 + 48 + 4
    # 2 tokens per rank route 4 rows, 2 of them to the other ep rank and 2 back in:
    # 2 (sent + received) * H*a = 2*4*16 = 128, probs 4 bytes each way: 16
    assert got["ep"] == 144
    # count exchange: 4 int64 counts to 1 peer; grad norm: its scalar and the squares of
    # fc1 and fc2 per global expert, (1 + 2 * 4) float32 over 2 ranks
    assert got["etp_ep"] == 8 * 4 + 4 * (1 + 2 * 4)
    # aux-loss statistics: 2*4 + 1 float64 over tp x cp = 2 ranks
    assert got["tp_cp"] == 72
    # grads (float32) over dp_cp = 2 ranks: the tp shards, 64 + 240 + 144 + 64 = 512 elements
    assert got["dp_cp"] == 4 * 512
    # tp_sum (norms, router, gate): 16 + 16 + 8 + 32 + 8 = 80 elements over tp*dp = 4 ranks
    assert got["tp_dp_cp"] == 2 * 3 * 4 * 80 // 4
    # experts: 288 elements over edp = 2 ranks
    assert got["edp"] == 4 * 288
    assert set(got) == {"tp", "ep", "etp_ep", "tp_cp", "dp_cp", "tp_dp_cp", "edp"}


def test_cp_bytes_by_hand():
    from moe_fold.planner.comm import microbatch_bytes

    # seq 8 over cp 2 (4 tokens per rank), tp 1: local K and V 4 tokens x 1 kv head x 4
    # dims, 2 bytes each = 2*32 = 64 bytes. Ring: forward 1 hop (64), backward 1 hop (64)
    # plus 2 hops of float32 dK/dV (2 * 128); two layers.
    config = hand_config(cp=2)
    config.model.seq_length = 8
    assert microbatch_bytes(config, 2, 0, "none")["cp"] == 2 * (64 + 64 + 256)
    # a2a: q (2 heads) 64 bytes, k and v repeated to lcm(1, 2) = 2 heads 64 each, output 64:
    # half of 256 leaves forward, as much backward
    config.parallel.cp_kind = "a2a"
    assert microbatch_bytes(config, 2, 0, "none")["cp"] == 2 * (128 + 128)
    # One MTP depth: its block's attention (a third layer), and the all-gather of the shifted
    # targets: ids, labels and mask as float64 for 1 x 8 tokens, half of them from the peer.
    config.model.mtp_num_layers = 1
    assert microbatch_bytes(config, 2, 0, "none")["cp"] == 3 * (128 + 128) + 3 * 8 * 8 // 2
