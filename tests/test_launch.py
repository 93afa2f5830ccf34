"""The multi-rank harness itself: results, errors, dead ranks, timeouts, no leftovers."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from moe_fold.launch import RankError, run_ranks


def _sum_of_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item() * scale


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _die_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(7)
    dist.barrier()
    return os.getpid()


def _sleep_forever(rank, world_size):
    time.sleep(600)


def _pid(rank, world_size):
    return os.getpid()


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_results_come_back_in_rank_order(world_size):
    out = run_ranks(_sum_of_ranks, world_size, 2.0)
    expected = 2.0 * sum(range(world_size))
    assert out == [expected] * world_size


def test_exception_carries_rank_and_traceback():
    with pytest.raises(RankError) as info:
        run_ranks(_raise_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert "ValueError: boom on purpose" in str(info.value)


def test_dead_rank_is_reported_not_hung():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_die_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert "exit code 7" in str(info.value)
    assert time.monotonic() - start < 30


def test_timeout_kills_every_rank():
    with pytest.raises(RankError, match="timed out after 3s"):
        run_ranks(_sleep_forever, 2, timeout=3)


def test_no_process_left_behind():
    pids = run_ranks(_pid, 2)
    time.sleep(0.5)
    for pid in pids:
        with pytest.raises(OSError):
            os.kill(pid, 0)


def _tensor_result(rank, world_size):
    return {"rank": rank, "values": torch.arange(4.0) * rank}


def test_tensor_results_survive_the_rank_process():
    out = run_ranks(_tensor_result, 2)
    assert [o["rank"] for o in out] == [0, 1]
    torch.testing.assert_close(out[1]["values"], torch.tensor([0.0, 1.0, 2.0, 3.0]))
