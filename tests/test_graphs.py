"""BucketGraphs' bookkeeping, on the CPU with a stand-in graph.

The capture itself needs a GPU (``tests/test_cuda.py`` checks its bits on
NCCL); here: when a bucket may be captured, that its bytes are counted once
per replay and not at capture, that a graph belongs to one buffer, and that a
failed capture turns graphs off without losing the step's bytes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import aps_comm
from aps_comm import transports
from aps_comm.engine import Traffic
from aps_comm.formats import E4M3
from aps_comm.graphs import BucketGraph, BucketGraphs
from aps_comm.telemetry import StepStats
from aps_comm.testing import run_distributed
from benchmarks.gpu import (
    BUCKET_CAP_MB,
    CHUNK_ELEMENTS,
    PROMOTE,
    GradModel,
    HookCase,
    count_mismatches,
    rank_grads,
)
from benchmarks.hostcost import OpCounter


class FakeGraph:
    """Records what BucketGraphs asks of a CUDA graph."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def capture_begin(self, capture_error_mode: str = "global") -> None:
        self.calls.append(f"begin:{capture_error_mode}")

    def capture_end(self) -> None:
        self.calls.append("end")
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")

    def replay(self) -> None:
        self.calls.append("replay")


def _work(traffic: Traffic, log: list[str]) -> None:
    log.append("work")
    traffic("all_to_all", 100)
    traffic("all_gather", 40)


def test_a_bucket_is_captured_on_its_second_settled_run() -> None:
    graphs = BucketGraphs(FakeGraph)
    x = torch.zeros(8)
    assert not graphs.ready(0, x)  # the first settled run is eager
    assert graphs.ready(0, x)
    assert not graphs.ready(1, x)  # per bucket
    y = torch.zeros(8)
    assert not graphs.ready(0, y)  # a new buffer (DDP rebuilt its buckets) starts over


def test_bytes_are_counted_per_replay_not_at_capture() -> None:
    graphs, traffic, log = BucketGraphs(FakeGraph), Traffic(), []
    x = torch.zeros(8)
    traffic("all_reduce_max", 4)  # an earlier bucket of the same step
    entry = graphs.capture(0, x, lambda: _work(traffic, log), traffic)
    assert entry is not None and log == ["work"]
    assert entry.graph.calls == ["begin:thread_local", "end"]
    assert traffic.bytes == {"all_reduce_max": 4}
    assert entry.traffic == {"all_reduce_max": 0, "all_to_all": 100, "all_gather": 40}
    for _ in range(3):
        graphs.replay(entry, traffic)
    assert traffic.take() == {"all_reduce_max": 4, "all_to_all": 300, "all_gather": 120}
    assert entry.graph.calls[2:] == ["replay"] * 3


def test_a_graph_belongs_to_its_buffer() -> None:
    graphs, traffic = BucketGraphs(FakeGraph), Traffic()
    x = torch.zeros(8)
    graphs.capture(2, x, lambda: None, traffic)
    assert graphs.lookup(2, x) is graphs.graphs[2]
    assert graphs.lookup(2, torch.zeros(8)) is None  # another address
    assert graphs.lookup(2, x[:4]) is None  # same address, other size
    assert graphs.lookup(1, x) is None


def test_a_graph_belongs_to_its_settled_path() -> None:
    # Error feedback binds its settled path again on the same buffer (after restored
    # residuals, with new scratch): the graph of the old binding must not replay.
    graphs, traffic = BucketGraphs(FakeGraph), Traffic()
    x = torch.zeros(8)
    first, again = object(), object()
    entry = graphs.capture(0, x, lambda: None, traffic, bound=first)
    assert graphs.lookup(0, x, first) is entry
    assert graphs.lookup(0, x, again) is None
    assert graphs.lookup(0, x) is entry  # no path given: the buffer decides


def test_a_failed_capture_turns_graphs_off(caplog: pytest.LogCaptureFixture) -> None:
    graphs, traffic, log = BucketGraphs(lambda: FakeGraph(fail=True)), Traffic(), []
    x = torch.zeros(8)
    traffic("all_reduce_max", 4)
    with caplog.at_level(logging.WARNING, logger="aps_comm.graphs"):
        assert graphs.capture(1, x, lambda: _work(traffic, log), traffic) is None
    assert "operation not permitted when stream is capturing" in (graphs.failed or "")
    assert "bucket 1" in caplog.text and "without graphs" in caplog.text
    assert traffic.bytes == {"all_reduce_max": 4}  # the eager run that follows counts its own
    assert graphs.graphs == {}
    graphs.ready(1, x)
    assert not graphs.ready(1, x)  # never again


def test_an_error_inside_the_work_ends_the_capture() -> None:
    made: list[FakeGraph] = []

    def factory() -> FakeGraph:
        made.append(FakeGraph())
        return made[-1]

    def broken() -> None:
        raise ValueError("no")

    graphs = BucketGraphs(factory)
    assert graphs.capture(0, torch.zeros(2), broken, Traffic()) is None
    assert made[0].calls == ["begin:thread_local", "end"]
    assert graphs.failed == "ValueError: no"


def test_records_are_lent_per_replay_and_kept_once_per_step() -> None:
    """Issue 46: a settled bucket with ``stats=True`` is captured too; the rows its
    capture queued are the graph's own memory, so each replay queues them lent, and
    the step's end (:meth:`StepStats.keep`) copies every lent row in one op."""
    graphs, traffic, stats = BucketGraphs(FakeGraph), Traffic(), StepStats()
    static = torch.zeros(2, 5, dtype=torch.float64)  # what the graph writes every replay
    other = torch.zeros(3, 5, dtype=torch.float64)  # a second bucket's graph
    stats.add_rows(0, ["earlier"], [3], E4M3, torch.ones(1, 5, dtype=torch.float64))
    entries = [
        graphs.capture(
            i + 1,
            torch.zeros(8),
            lambda rows=rows, i=i: stats.add_rows(
                i + 1, list("abc")[: len(rows)], [4] * len(rows), E4M3, rows
            ),
            traffic,
            stats,
        )
        for i, rows in enumerate([static, other])
    ]
    assert all(e is not None for e in entries) and stats.queued == 1  # nothing ran
    replays = []
    for step in range(2):
        static.fill_(step)  # the graphs' replays rewrite their rows
        other.fill_(10 + step)
        for entry in entries:
            graphs.replay(entry, traffic, stats)
        assert stats._values[1] is static  # lent: no copy per replay
        with OpCounter() as ops:
            stats.keep()
        assert ops.ops == ["aten::cat.default"]  # one op for the step's lent rows
        replays.append(stats.take_since(1))
    for step, [(part, rows), (part2, rows2)] in enumerate(replays):
        assert part == (1, ["a", "b"], [4, 4], E4M3)
        assert part2 == (2, ["a", "b", "c"], [4, 4, 4], E4M3)
        for kept, graph in ((rows, static), (rows2, other)):
            assert kept.untyped_storage().data_ptr() != graph.untyped_storage().data_ptr()
        assert rows.eq(step).all() and rows2.eq(10 + step).all()  # kept after later replays
    assert [r.name for r in stats.records()] == ["earlier"]


def test_a_failed_capture_drops_its_records() -> None:
    graphs, stats = BucketGraphs(lambda: FakeGraph(fail=True)), StepStats()
    rows = torch.zeros(1, 5, dtype=torch.float64)
    work = functools.partial(stats.add_rows, 0, ["a"], [2], E4M3, rows)
    assert graphs.capture(0, torch.zeros(2), work, Traffic(), stats) is None
    assert stats.records() == []  # the eager run that follows records the step


def test_a_dropped_graph_is_captured_again_after_one_more_eager_run() -> None:
    """A bucket bound again (a new epoch of its policy) drops its graph; the new binding
    runs eagerly once before it is captured (its kernels may be new)."""
    graphs, traffic = BucketGraphs(FakeGraph), Traffic()
    x = torch.zeros(8)
    assert not graphs.ready(0, x) and graphs.ready(0, x)
    graphs.capture(0, x, lambda: None, traffic)
    graphs.capture(1, x, lambda: None, traffic)
    graphs.drop(0)
    assert graphs.lookup(0, x) is None and graphs.lookup(1, x) is not None
    assert not graphs.ready(0, x) and graphs.ready(0, x)


class _Rerun:
    """A CUDA graph of ``work`` on the CPU: its replay runs the work again, as a real
    graph's replay runs the kernels the capture recorded."""

    running = False  # a replay runs (the collectives it calls were captured)

    def __init__(self, work: Callable[[], object]) -> None:
        self.work = work

    def replay(self) -> None:
        _Rerun.running = True
        try:
            self.work()
        finally:
            _Rerun.running = False


class _RerunGraphs(BucketGraphs):
    """Graphs whose capture keeps the work unrun (a real capture records it without
    running it) and whose replay runs it: :meth:`APSState._replayed`'s decisions, and
    the engine's halves around Promote's host read, checked for bits on the CPU."""

    captures = 0

    def capture(  # type: ignore[override]
        self,
        index: int,
        buffer: torch.Tensor,
        work: Callable[[], object],
        traffic: Traffic,
        stats: StepStats | None = None,
        bound: object = None,
    ) -> BucketGraph:
        self.captures += 1
        entry = BucketGraph(_Rerun(work), buffer.data_ptr(), buffer.numel(), {}, [], bound)
        self.graphs[index] = entry
        return entry


def _graphs_hook(state: aps_comm.APSState, bucket: dist.GradBucket) -> torch.futures.Future:
    """:func:`aps_comm.aps_hook`'s path on NCCL, minus the side stream: every bucket on
    DDP's thread, one that is not the step's last through :meth:`APSState._replayed`
    (with graphs), eagerly otherwise."""
    buffer, index, last = bucket.buffer(), bucket.index(), bucket.is_last()
    reducer, b = state.reducer, SimpleNamespace(index=index, buffer=buffer)
    steady = state._steady_for(index, buffer) if reducer is not None else None
    if state.graphs is None or reducer is None or last or not state._replayed(b, steady):  # type: ignore[arg-type]
        state.run_bucket(index, buffer, bucket.parameters(), last)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut


# DDP checks the hook's annotations as objects (this module's are strings).
_graphs_hook.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


def _graph_steps(
    rank: int, world_size: int, case: HookCase, graphs: bool, dtype: torch.dtype
) -> dict[str, list]:
    model = GradModel().to(dtype)
    # The same buckets whatever the dtype: three, the first and the last sharing the
    # float32 copies' region of even buckets (bfloat16).
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB * dtype.itemsize / 4)
    state = aps_comm.APSState(case.fmt, reduction=case.reduction, policy=case.policy)
    state.chunk_elements = CHUNK_ELEMENTS
    state.bind_model(model)
    state.bind(torch.device("cpu"))
    assert state.reducer is not None
    state.reducer.early_rates = True  # Promote's rates as on a GPU: agreed a step early
    state.graphs = _RerunGraphs() if graphs else None
    ddp.register_comm_hook(state, _graphs_hook)
    out: dict[str, list] = {"grads": [], "counts": [], "captures": [], "eager_maxima": []}
    eager = [0]  # MAX all-reduces outside a replay: a graph's would not run on the host
    all_reduce_max = transports.all_reduce_max

    def counted(*args: object) -> None:
        eager[0] += not _Rerun.running
        all_reduce_max(*args)  # type: ignore[arg-type]

    transports.all_reduce_max = counted  # type: ignore[assignment]  # a spawned process's
    for step in range(10):
        eager[0] = 0
        ddp.zero_grad(set_to_none=True)
        ddp([g.to(dtype) for g in rank_grads(rank, step)]).backward()
        out["grads"].append([p.grad.clone() for p in model.parameters()])
        if isinstance(state.graphs, _RerunGraphs):
            out["counts"].append(len(state.graphs.graphs))
            out["captures"].append(state.graphs.captures)
            out["eager_maxima"].append(eager[0])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("promote", [False, True], ids=["plain", "promote"])
def test_buckets_replayed_as_graphs_give_the_eager_bits(promote: bool, dtype: torch.dtype) -> None:
    """Settled buckets run as graphs (here, graphs that rerun their work on the CPU) give
    the eager run's bits, step after step (bfloat16 buckets with their copies into
    float32 and back inside the graph); a Promote bucket's step decided on the host
    from the rates its last step agreed, then its whole step as its graph, dropped where
    a format moves (steps 5 and 6 on these gradients: benchmarks.gpu.PROMOTE) and
    captured again."""
    case = HookCase("e4m3", "two_phase", promote=promote)
    got = run_distributed(_graph_steps, 2, args=(case, True, dtype), timeout=120)
    want = run_distributed(_graph_steps, 2, args=(case, False, dtype), timeout=120)
    for rank in range(2):
        assert count_mismatches(got[rank]["grads"], want[rank]["grads"])[0] == 0, rank
    # Buckets held as graphs after each step, and captures so far (of 3 buckets; the last
    # is never captured). Step 0 plans and step 1 re-buckets; a bucket is captured on its
    # second settled run, once. Under Promote every layer moves up at step 1, and the
    # first bucket binds again at step 2; the buckets move at steps 5 (their graphs
    # captured at steps 3 and 4) and 6, the second at step 8 (captured at step 7).
    want_counts, want_captures = (
        ([0, 0, 0, 1, 2, 0, 0, 2, 1, 1], [0, 0, 0, 1, 2, 2, 2, 4, 4, 4])
        if promote
        else ([0, 0, 0] + [2] * 7, [0, 0, 0] + [2] * 7)
    )
    assert (got[0]["counts"], got[0]["captures"]) == (want_counts, want_captures)
    # MAX all-reduces on the host per step: each eager bucket's one (Promote: and one of
    # its rates for the next step), none of a bucket replayed. A Promote bucket that read
    # its rates after its own all-reduce (an eager head) would add one per graph held.
    # Step 0 has one bucket; later, those not held as graphs after the step ran eagerly.
    eager = [1] + [3 - held for held in want_counts[1:]]
    want_maxima = [2 * e for e in eager] if promote else eager
    assert got[0]["eager_maxima"] == want_maxima


def _float_copies(rank: int, world_size: int) -> tuple[bool, bool, bool]:
    state = aps_comm.APSState("e4m3", reduction="two_phase")
    state.bind(torch.device("cpu"))
    small, large = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    state._float_input(SimpleNamespace(index=0, buffer=small))  # type: ignore[arg-type]
    kept = state._float_view(0, small) is not None
    other = state._float_view(0, large) is None
    state._float_input(SimpleNamespace(index=2, buffer=large))  # type: ignore[arg-type]
    return kept, other, state._float_view(0, small) is None


def test_a_float32_copy_is_not_reused_once_its_region_grew() -> None:
    """A bucket of bfloat16 gradients is found settled (and replayed as a graph) through
    its float32 copy; once a larger bucket of the same region grows it, the copy is not
    reused: the bucket takes a view of the new region and binds again, as eagerly, and
    no old region stays alive for it."""
    kept, other, dropped = run_distributed(_float_copies, 1, timeout=60)[0]
    assert kept and other and dropped


def _cpu_promote_maxima(rank: int, world_size: int) -> tuple[int, int]:
    model = GradModel()
    state = aps_comm.APSState("e4m3", reduction="two_phase", policy=[PROMOTE])
    state.bind_model(model)
    state.bind(torch.device("cpu"))
    params = list(model.parameters())
    buffer = torch.cat([g.flatten() for g in rank_grads(rank, 0)])
    calls = [0]
    all_reduce_max = transports.all_reduce_max

    def counted(*args: object) -> None:
        calls[0] += 1
        all_reduce_max(*args)  # type: ignore[arg-type]

    transports.all_reduce_max = counted  # type: ignore[assignment]  # a spawned process's
    for _ in range(4):
        state.run_bucket(0, buffer.clone(), params)
    assert state.reducer is not None
    return calls[0], len(state.reducer.agreed_rates)


def test_on_the_cpu_promote_reads_the_rates_its_own_all_reduce_agreed() -> None:
    """On the CPU the agreed rates are host memory when the bucket's MAX all-reduce
    returns: no step agrees them a step early, which would cost one more collective."""
    assert run_distributed(_cpu_promote_maxima, 2, timeout=120) == [(4, 0), (4, 0)]
