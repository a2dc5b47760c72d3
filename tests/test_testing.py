"""The multi-rank harness itself: results, failures with tracebacks, timeouts."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from aps_comm.testing import DistributedTestError, run_distributed


def _sum_ranks(rank: int, world_size: int, scale: float) -> list[float]:
    t = torch.full((3,), float(rank + 1) * scale)
    dist.all_reduce(t)
    return t.tolist()


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is unhappy")


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(60)


def test_results_from_every_rank() -> None:
    out = run_distributed(_sum_ranks, world_size=3, args=(2.0,))
    assert out == [[12.0, 12.0, 12.0]] * 3


def test_failure_carries_child_traceback() -> None:
    with pytest.raises(
        DistributedTestError, match=r"rank 1 failed: ValueError: rank one is unhappy"
    ):
        run_distributed(_fail_on_rank_one, world_size=2)


def test_timeout_kills_ranks() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="did not finish within 3 s"):
        run_distributed(_sleep_forever, world_size=2, timeout=3)
    assert time.monotonic() - start < 30
