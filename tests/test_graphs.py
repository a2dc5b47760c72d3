"""BucketGraphs' bookkeeping, on the CPU with a stand-in graph.

The capture itself needs a GPU (``tests/test_cuda.py`` checks its bits on
NCCL); here: when a bucket may be captured, that its bytes are counted once
per replay and not at capture, that a graph belongs to one buffer, and that a
failed capture turns graphs off without losing the step's bytes.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from aps_comm.engine import Traffic
from aps_comm.formats import E4M3
from aps_comm.graphs import BucketGraphs
from aps_comm.telemetry import StepStats
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
