"""The pipeline schedules (moe_fold/parallel/pipeline_schedules.py): their refusals, Megatron's
placement of virtual stages, the 1F1B and interleaved orders, and every plan complete, with
matching exchanges and the textbook bubble. Running them: tests/parallel/test_pipeline.py."""

import pytest

from moe_fold.parallel.pipeline_schedules import Exchange, Step, check_schedule, make_plan, rank_order, rank_stages


@pytest.mark.parametrize("args,message", [
    (("gpipe", 2, 1, 4), r"schedule='gpipe' must be one of 1f1b, interleaved"),
    (("1f1b", 2, 2, 4), r"parallel.vpp=2 requires parallel.pp_schedule=interleaved \(or auto\), got 1f1b"),
    (("interleaved", 2, 1, 4), r"parallel.pp_schedule=interleaved requires parallel.vpp > 1, got 1"),
    (("1f1b", 2, 1, 0), r"num_microbatches=0 must be a positive integer"),
    (("interleaved", 4, 2, 6), r"train.global_batch_size/\(micro_batch_size\*dp\)=6 micro-batches is not "
                               r"divisible by parallel.pp=4 \(the interleaved schedule sends the micro-batches "
                               r"round the pipeline in groups of pp\)"),
])
def test_check_schedule_errors(args, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(*args)


def test_rank_stages_megatron_placement():
    assert rank_stages(4, 2, 1) == [1, 5]
    assert rank_stages(2, 3, 0) == [0, 2, 4]


def test_1f1b_order_pp4_rank1():
    order = rank_order("1f1b", 4, 1, 4, 1)
    assert [(s.kind, s.microbatch) for s in order] == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]


def test_interleaved_order_pp2_vpp2_rank1():
    # warm-up 2*(pp-r-1) + (vpp-1)*pp = 2 forwards; micro-batches in groups of pp=2.
    order = rank_order("interleaved", 2, 2, 4, 1)
    assert [(s.kind, s.microbatch, s.stage) for s in order] == [
        ("F", 0, 1), ("F", 1, 1), ("F", 0, 3), ("B", 0, 3), ("F", 1, 3), ("B", 1, 3),
        ("F", 2, 1), ("B", 0, 1), ("F", 3, 1), ("B", 1, 1), ("F", 2, 3), ("B", 2, 3),
        ("F", 3, 3), ("B", 3, 3), ("B", 2, 1), ("B", 3, 1)]


_PLANS = ([("1f1b", pp, 1, m) for pp in (2, 4) for m in (1, 3, 4, 8)]
          + [("interleaved", pp, vpp, m) for pp, vpp in ((2, 2), (4, 2), (3, 3)) for m in (pp, 2 * pp, 4 * pp)])


@pytest.mark.parametrize("schedule,pp,vpp,m", _PLANS)
def test_plan_is_complete_consistent_and_has_the_textbook_bubble(schedule, pp, vpp, m):
    plan = make_plan(schedule, pp, vpp, m)
    stages = pp * vpp
    exchanges = {}
    for r, program in enumerate(plan.programs):
        steps = [x for x in program if isinstance(x, Step)]
        assert sorted((s.kind, s.microbatch, s.stage) for s in steps) == sorted(
            (k, i, s) for k in "FB" for i in range(m) for s in range(r, stages, pp))
        done = set()
        for item in program:
            if isinstance(item, Step):
                if item.kind == "B":
                    assert ("F", item.microbatch, item.stage) in done
                done.add((item.kind, item.microbatch, item.stage))
            else:
                exchanges.setdefault(item.time, {})[r] = item.messages
    # Both ends of every message post it in the exchange of the same time, and list the
    # messages between the two of them in the same order.
    for t, by_rank in exchanges.items():
        for r, msgs in by_rank.items():
            for msg in msgs:
                peer = msg.src if r == msg.dst else msg.dst
                pair = {msg.src, msg.dst}
                assert [x for x in msgs if {x.src, x.dst} == pair] == \
                    [x for x in by_rank[peer] if {x.src, x.dst} == pair], (t, msg)
    assert plan.misaligned() <= (0 if schedule == "1f1b" else 2)
    # Every stage boundary is crossed once forward and once backward per micro-batch.
    sends = [msg for by_rank in exchanges.values() for r, msgs in by_rank.items() for msg in msgs if msg.src == r]
    assert len(sends) == len(set(sends)) == 2 * m * (stages - 1)
    # Forward 1 unit, backward 2, no waits beyond the bubble: every rank is idle for
    # (pp-1)/(vpp*m + pp-1) of the makespan (Narayanan 2021's (p-1)/(v*m) of the ideal time).
    for r in range(pp):
        idle = (plan.makespan - plan.busy(r)) / plan.makespan
        assert idle == pytest.approx((pp - 1) / (vpp * m + pp - 1))


def test_1f1b_keeps_at_most_pp_minus_rank_microbatches():
    plan = make_plan("1f1b", 4, 1, 8)
    for r, program in enumerate(plan.programs):
        live = peak = 0
        for item in program:
            if isinstance(item, Step):
                live += 1 if item.kind == "F" else -1
                peak = max(peak, live)
        assert peak == 4 - r


def test_forward_only_plan_sends_activations_only():
    plan = make_plan("interleaved", 2, 2, 4, forward_only=True)
    items = [x for program in plan.programs for x in program]
    assert all(s.kind == "F" for s in items if isinstance(s, Step))
    assert all(msg.kind == "act" for e in items if isinstance(e, Exchange) for msg in e.messages)
