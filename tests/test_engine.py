"""The reduction engine: bucket plans, pipelined chunks, the FIFO worker, failures.

Multi-chunk buckets are checked against the exact reference of
``test_hook`` (computed from every rank's raw bucket), and the worker's
behaviour is checked on real Gloo ranks: the hook returns before its peers
have even started, a failure in the worker reaches every rank as an exception.
"""

from __future__ import annotations

import gc
import os
import re
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import Net, capture, check_log
from torch.nn.parallel import DistributedDataParallel as DDP

import aps_comm.codec
from aps_comm import APSState, aps_hook, register
from aps_comm.executor import FifoWorker, WorkerFailed
from aps_comm.formats import get_format
from aps_comm.plan import BucketPlan, Planner, chunk_bounds, shard_layout
from aps_comm.testing import DistributedTestError, run_distributed

# ---------------------------------------------------------------------------
# plans


def test_chunk_bounds_and_regions_by_hand() -> None:
    assert chunk_bounds(0, 4) == [(0, 0)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    assert chunk_bounds(9, 4) == [(0, 4), (4, 8), (8, 9)]
    with pytest.raises(ValueError, match="chunk_elements must be >= 1, got 0"):
        chunk_bounds(3, 0)
    plan = BucketPlan.build(3, [5, 0, 6], torch.device("cpu"))
    e4m3, e2m1, fp16 = get_format("e4m3"), get_format("e2m1"), get_format("fp16")
    reductions = {e4m3: "two_phase", e2m1: "two_phase", fp16: "allreduce"}
    (g,) = plan.group([e4m3] * 3, reductions, 4, chunk_elements=8)
    assert g.contiguous and g.chunks == [(0, 8), (8, 11)]
    # Chunk 0: 8 elements -> 4 shards of 2 bytes; chunk 1: 3 -> 4 shards of 1.
    assert g.regions == [(0, 8), (8, 12)] and g.shard_regions == [(0, 2), (2, 3)]
    assert g.windows[0].offsets.tolist() == [0, 5, 5, 8]
    # A window keeps the segments it overlaps; the codec picks their scales by `first`.
    assert g.windows[1].offsets.tolist() == [0, 3] and g.windows[1].first == 2
    assert g.send.numel() == g.recv.numel() == 12 and g.shards.numel() == 3
    # The same formats give the same (cached) group plans, scratch included.
    assert plan.group([e4m3] * 3, reductions, 4, chunk_elements=8)[0] is g
    # Mixed formats: one group per format in order of first appearance.
    a, b = plan.group([fp16, e2m1, fp16], reductions, 4, chunk_elements=8)
    assert (a.fmt, a.index, a.reduction, b.fmt, b.index) == (fp16, [0, 2], "allreduce", e2m1, [1])
    assert not a.contiguous and a.regions == [(0, 16), (16, 22)]
    assert shard_layout(3, e2m1, 4) == (2, 1)


def test_planner_chunks_by_bytes_per_peer() -> None:
    from aps_perfmodel.collectives import LinkParams
    from aps_perfmodel.strategies import bucket_breakdown, chunk_elements, hook_cluster

    e4m3 = get_format("e4m3")
    gloo = Planner(hook_cluster("gloo", "cpu", 2, 1), hierarchical=False, fp32=False)
    # Timed exchanges: k = sqrt(W / 0.8 ms) chunks, as fitted on the emulated cluster.
    assert gloo.chunk(e4m3, 2**23, "two_phase", exchange_s=0.07) == 2**20
    assert gloo.chunk(e4m3, 2**23, "two_phase", exchange_s=0.45) == 2**18
    # Not timed yet: the model's one-chunk exchange stands in for it, codec
    # passes included (as the hook times it), the maxima pass not.
    untimed = gloo.chunk(e4m3, 2**23, "two_phase")
    c, link = gloo.cluster, gloo.cluster.topology.inter
    one = bucket_breakdown(2**23, 1, "e4m3", c, "two_phase", chunk=None)
    exchange = one.collective_s + one.codec_s - c.codec_time("amax", "e4m3", 1.0, 2**23)
    assert untimed == chunk_elements(2**23, 1.0, 2, link, 8e-4, exchange_s=exchange)
    # The codec's time asks for more chunks than the wire alone.
    assert untimed < chunk_elements(2**23, 1.0, 2, link, 8e-4)
    # Small buckets travel in one chunk; the chunk is a power of two at least that large.
    assert gloo.chunk(e4m3, 1000, "two_phase") == 1024
    assert gloo.chunk(e4m3, 1000, "fp32") == 1024
    # 64 ranks on 100 Gbit/s: a message to one peer must be >= 4 alphas on the wire
    # (4 * 10 us * 12.5 GB/s = 500 kB), so 2**23 FP8 elements stay one chunk.
    fast = LinkParams(alpha=1e-5, beta=8e-11)
    assert chunk_elements(2**23, 1.0, 64, fast, 8e-4) == 2**23
    plan = BucketPlan.build(0, [10], torch.device("cpu"))
    plan.timed(5.0)  # the first exchange pays page faults: not kept
    plan.timed(0.3)
    plan.timed(0.4)
    assert plan.exchange_s == 0.3 and plan.exchanges == 3


def test_auto_chooses_per_bucket_by_the_model() -> None:
    from aps_perfmodel.strategies import hook_cluster

    e4m3 = get_format("e4m3")
    nccl = Planner(hook_cluster("nccl", "cuda", 64, 8), hierarchical=True, fp32=True)
    assert nccl.reduction(e4m3, 25 * 2**18, 20, native=False) == "hierarchical"
    assert nccl.reduction(e4m3, 1000, 2, native=False) == "fp32"  # latency-bound: FP32 wins
    # Without the FP32 fallback (Gloo without a profile) the format is always sent.
    gloo = Planner(hook_cluster("gloo", "cpu", 2, 1), hierarchical=False, fp32=False)
    assert gloo.reduction(e4m3, 1000, 2, native=False) == "two_phase"
    assert gloo.reduction(get_format("fp16"), 1000, 2, native=True) == "allreduce"


# ---------------------------------------------------------------------------
# multi-chunk buckets against the exact reference

CHUNKED = [
    ("e4m3", "two_phase", "layer"),
    ("e2m1", "two_phase", "layer"),
    ("fp16", "allreduce", "layer"),
    ("bf16", "two_phase", "bucket"),
]


def _chunked(rank: int, world_size: int, chunk_elements: int) -> int:
    checked = 0
    for fmt_spec, reduction, scaling in CHUNKED:
        fmt = get_format(fmt_spec)
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.004)
        state = APSState(fmt, reduction=reduction, scaling=scaling)
        state.chunk_elements = chunk_elements
        log: list = []
        ddp.register_comm_hook(state, capture(state, log))
        for step in range(2):
            torch.manual_seed(1000 * step + rank)
            ddp.zero_grad()
            ddp(torch.randn(8, 16) * (rank + 1)).pow(2).sum().backward()
            checked += check_log(log, fmt, reduction, scaling, None, chunk_elements)
            log.clear()
    return checked


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "chunk"), [(2, 100), (4, 37)])
def test_multi_chunk_buckets_match_reference(world_size: int, chunk: int) -> None:
    # Buckets of ~1000 elements in chunks of 100 or 37: many chunks, ragged ends.
    assert all(c > 0 for c in run_distributed(_chunked, world_size, args=(chunk,), timeout=240))


def _big_bucket(rank: int, world_size: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = nn.Linear(1100, 1000)  # 1.1M weights: one bucket above 2**20 elements
    ddp = DDP(model, bucket_cap_mb=100)
    state = APSState("e4m3", reduction="two_phase")
    log: list = []
    ddp.register_comm_hook(state, capture(state, log))
    torch.manual_seed(rank)
    ddp(torch.randn(4, 1100) * (rank + 1)).pow(2).sum().backward()
    check_log(log, get_format("e4m3"), "two_phase", "layer")
    return len(log), max(raw.numel() for _, raw, _, _ in log)


def test_bucket_above_2_20_elements_matches_reference() -> None:
    for n_buckets, numel in run_distributed(_big_bucket, 2, timeout=240):
        assert n_buckets == 1 and numel > 2**20


# ---------------------------------------------------------------------------
# the hook returns at once


def _returns_at_once(rank: int, world_size: int, flag: str) -> list[int | bool]:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = APSState("e4m3")
    state.bind_process_group()  # creates the group and agrees on the configuration
    calls: list[int | bool] = []
    step_flag = ""

    def hook(st, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        fut = aps_hook(st, bucket)
        if rank == 0:
            calls.append(bucket.index())
        if bucket.is_last():
            # DDP calls the hooks one after another: every one of them has returned.
            Path(step_flag).touch()
        return fut

    ddp.register_comm_hook(state, hook)
    for step in range(2):  # DDP re-buckets after step 0: several buckets in step 1
        step_flag = f"{flag}.{step}"
        dist.barrier()
        loss = ddp(torch.randn(8, 16)).pow(2).sum()  # DDP's forward may synchronise
        if rank == 1:
            # Rank 1 starts its backward only once every hook of rank 0 has
            # returned: a hook that waited for any of its collectives never
            # would (no timing involved: the wait ends on the flag, or fails).
            deadline = time.monotonic() + 60
            while not os.path.exists(step_flag) and time.monotonic() < deadline:
                time.sleep(0.01)
            calls.append(os.path.exists(step_flag))
        loss.backward()
    return calls


def test_hook_returns_before_any_peer_has_started(tmp_path: Path) -> None:
    calls = run_distributed(_returns_at_once, 2, args=(str(tmp_path / "started"),))
    assert calls[1] == [True, True], calls[1]  # both steps
    assert len(calls[0]) >= 3, calls[0]  # several buckets


# ---------------------------------------------------------------------------
# failures in the worker


def _fail_everywhere(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=0.004)
    register(ddp, fmt="e4m3")

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError(f"injected codec failure on rank {rank}")

    aps_comm.codec.Codec.bind_encode = broken  # type: ignore[assignment,method-assign]
    errors = []
    for _ in range(2):
        try:
            ddp(torch.randn(8, 16)).pow(2).sum().backward()
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors


def test_worker_exception_surfaces_on_every_rank() -> None:
    for rank, errors in enumerate(run_distributed(_fail_everywhere, 2, timeout=120)):
        assert len(errors) == 2
        # backward() raises the hook's own error, not DDP's "Unable to cast ... to Tensor".
        assert re.fullmatch(
            rf"aps_hook, bucket \d+: injected codec failure on rank {rank}", errors[0]
        ), errors
        # The failed state refuses further buckets instead of running them out of
        # step, and says what stopped it.
        assert errors[1] == errors[0]


def _fail_on_one_rank(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=0.004)
    register(ddp, fmt="e4m3")
    if rank == 1:

        def broken() -> None:
            raise RuntimeError("injected codec failure on rank 1")

        # The encode fails when it runs, after the maxima's all-reduce: rank 0 then
        # waits for rank 1's shards.
        aps_comm.codec.Codec.bind_encode = lambda *a, **k: broken  # type: ignore[assignment,method-assign]
    ddp(torch.randn(8, 16)).pow(2).sum().backward()


def test_one_rank_failing_makes_the_others_raise_within_the_timeout() -> None:
    # The hook's group inherits the default group's 5 s timeout: rank 0,
    # waiting for rank 1's shards, raises instead of hanging.
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_one_rank, 2, timeout=90, pg_timeout=5.0)
    msg = str(info.value)
    assert "injected codec failure on rank 1" in msg
    # Rank 0 says which of the hook's collectives was left waiting.
    rank0 = msg.split("rank 1 failed")[0]
    assert "rank 0 failed" in rank0
    assert re.search(
        r"^RuntimeError: aps_hook, bucket \d+: aps_comm: the all_to_all of chunk 1 of 1 did not "
        "complete",
        rank0,
        re.M,
    ), rank0


def _leaves_after_register(rank: int, world_size: int) -> str:
    ddp = DDP(Net(), bucket_cap_mb=0.004)
    register(ddp, fmt="e4m3")  # the hook's group is made here, with every rank alive
    if rank == 1:
        return "left"
    ddp(torch.randn(8, 16)).pow(2).sum().backward()
    return "finished"


def test_a_rank_leaving_before_the_first_backward_is_an_error_not_a_hang() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_leaves_after_register, 2, timeout=90, pg_timeout=5.0)
    msg = str(info.value)
    assert "rank 0 failed" in msg and "rank 1 failed" not in msg
    assert "MAX all-reduce of" in msg and "did not complete" in msg


def test_fifo_worker_order_and_failure() -> None:
    worker = FifoWorker("test")
    order: list[int] = []
    futures = [worker.submit(lambda i=i: order.append(i) or i) for i in range(50)]
    assert [f.wait() for f in futures] == list(range(50)) and order == list(range(50))

    def boom() -> None:
        raise ValueError("boom")

    failed = worker.submit(boom)
    later = worker.submit(lambda: 1)
    with pytest.raises(ValueError, match="boom"):
        failed.wait()
    with pytest.raises(WorkerFailed, match="boom"):
        later.wait()
    worker.close()
    assert not worker.alive


def test_fifo_worker_lets_its_owner_go_and_then_stops() -> None:
    # A hook state owns a worker whose jobs are the state's bound methods: once
    # the jobs are done, neither the thread's frame nor its arguments may keep
    # the state (its buffers, its plans) or the worker alive.
    class Owner:
        def __init__(self) -> None:
            self.worker = FifoWorker("owner")
            self.payload = torch.zeros(1000)

        def job(self) -> int:
            return int(self.payload.numel())

    owner = Owner()
    assert owner.worker.submit(owner.job).wait() == 1000
    thread = owner.worker._thread
    assert thread is not None and thread.is_alive()
    owner_ref, worker_ref = weakref.ref(owner), weakref.ref(owner.worker)
    del owner
    gc.collect()
    assert owner_ref() is None and worker_ref() is None
    thread.join(10.0)
    assert not thread.is_alive()


def test_fifo_worker_lets_a_job_go_before_its_future_completes() -> None:
    # DDP's backward returns once the bucket's future completes, and a training
    # loop may drop its model right then: the worker must hold no reference to
    # the job by that point. A then-callback runs on the thread that completes
    # the future, inside set_result, so it sees exactly what the worker still holds.
    class Owner:
        def job(self) -> int:
            return 1

    worker = FifoWorker("release")
    gate = threading.Event()
    worker.submit(gate.wait)  # holds the queue until the callback is in place
    owner = Owner()
    ref = weakref.ref(owner)
    fut = worker.submit(owner.job)
    del owner
    released = fut.then(lambda _: ref() is None)
    gate.set()
    assert released.wait() is True
    worker.close()


def _state_collected(rank: int, world_size: int) -> bool:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), bucket_cap_mb=0.01)
    state = register(ddp, fmt="e4m3")
    for _ in range(2):
        ddp(torch.randn(2, 64)).sum().backward()
    ref = weakref.ref(state)
    del ddp, state
    gc.collect()
    return ref() is None


def test_a_dropped_model_frees_its_hook_state() -> None:
    # Was kept alive by the worker thread's last job: every model a process
    # built kept its buckets' scratch (a benchmark sweep reached 6 GB per rank).
    assert run_distributed(_state_collected, 2, timeout=90) == [True, True]


# ---------------------------------------------------------------------------
# auto's per-bucket choice with a calibrated profile


def _auto_with_profile(rank: int, world_size: int) -> tuple[dict[int, str], dict[str, int]]:
    from conftest import reference

    from aps_perfmodel.collectives import LinkParams
    from aps_perfmodel.profile import Profile

    # 1 ms per message, 1 Gbit/s: FP32 wins below ~10^5 elements, two_phase above.
    profile = Profile(world_size=2, backend="gloo", link=LinkParams(alpha=1e-3, beta=8e-9))
    torch.manual_seed(0)
    # Rebuilt buckets follow the gradients' order: the big layer fills bucket 0
    # (above DDP's 1 MB first bucket), the small one is bucket 1.
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 65536))
    ddp = DDP(model, bucket_cap_mb=0.25)
    state = APSState("e4m3", profile=profile)
    log: list = []
    from conftest import capture, gather

    ddp.register_comm_hook(state, capture(state, log))
    torch.manual_seed(rank)
    for _ in range(2):  # DDP re-buckets after the first step
        log.clear()
        ddp(torch.randn(4, 16)).pow(2).sum().backward()
    e4m3 = get_format("e4m3")
    for index, raw, numels, out in log:
        raws = gather(raw)
        if state.bucket_reductions[index] == "fp32":
            expected = raws[0] / 2 + raws[1] / 2  # allreduce_hook: divide, then sum
        else:
            expected = reference(raws, numels, e4m3, "two_phase", "layer")
        assert torch.equal(out, expected), (state.bucket_reductions, numels)
    return dict(state.bucket_reductions), dict(state.bytes_detail)


def test_auto_sends_small_buckets_in_fp32_with_a_profile() -> None:
    for chosen, detail in run_distributed(_auto_with_profile, 2, timeout=120):
        assert sorted(set(chosen.values())) == ["fp32", "two_phase"], (chosen, detail)
        # Only the two_phase bucket's layers travel as maxima.
        assert detail["all_reduce_max"] > 0 and detail["all_reduce"] > 0
