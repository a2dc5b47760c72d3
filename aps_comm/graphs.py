"""Settled buckets as CUDA graphs: each bucket's device work captured once, replayed every step.

On a GPU a settled bucket (:class:`aps_comm.engine.Steady`) enqueues only
device work, but enqueuing it still costs the host hundreds of microseconds
a step: a handful of Triton launches and two or three NCCL calls through
Python, measured at 660-790 us per bucket on an H200 host. A CUDA graph of
the same work is one launch. The rules:

- A bucket is captured once its settled path has run eagerly on the same
  buffer: every kernel is compiled and loaded and the communicator is up,
  so nothing in the capture is a first call.
- Capture records the work without running it; the graph is replayed at
  once for that step, so the capture step's bits are the graph's bits.
- The step's last bucket is never captured. NCCL work inside a graph is not
  watched by the process group's watchdog; the last bucket's collectives
  are, and they queue behind the graphs' on the same communicator, so a dead
  peer still fails the job within the group's timeout.
- The bytes a bucket hands each collective are counted at capture and added
  per replay (``bytes_detail`` stays true).
- So are its statistics (``stats=True``): the rows the capture queued are the
  graph's own memory, which every replay rewrites; each replay queues them
  lent, and the step's end copies every lent row in one concatenation on the
  same stream, before any graph replays again (one launch a step, not one a
  bucket).
- A Promote bucket takes its step on the host before its graph, from the
  rates its last step agreed (its graph's last collective) and copied to the
  host: the host waits for that copy alone, done long before, which the last
  step's eager last bucket follows on the same stream. Its whole step is its
  graph, replayed where no format moved; where one did, the bucket is bound
  again, run eagerly and its graph dropped.
- A capture that fails is logged once; from then on the state's buckets run
  eagerly, as without graphs.

Example:
    >>> graphs = BucketGraphs()
    >>> graphs.lookup(0, torch.zeros(4)) is None
    True
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from aps_comm.engine import Traffic
from aps_comm.telemetry import StepStats

__all__ = ["BucketGraph", "BucketGraphs"]

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class BucketGraph:
    """One bucket's captured work.

    Attributes:
        graph: the captured graph (``torch.cuda.CUDAGraph``).
        ptr: the address of the bucket buffer it reads and writes.
        numel: the buffer's elements.
        traffic: bytes per collective that one run hands the wire.
        records: the statistics rows one run writes (``stats=True``), with
            what labels them (:meth:`aps_comm.telemetry.StepStats.take_since`).
        bound: the settled path captured (None: not given).
    """

    graph: Any
    ptr: int
    numel: int
    traffic: dict[str, int]
    records: list[tuple[tuple, torch.Tensor]] = dataclasses.field(default_factory=list)
    bound: object = None


class BucketGraphs:
    """A state's bucket graphs, by DDP bucket index.

    Args:
        factory: makes an empty graph (``torch.cuda.CUDAGraph``; tests pass
            a stand-in with ``capture_begin``, ``capture_end`` and ``replay``).

    Attributes:
        graphs: each captured bucket's graph.
        failed: why a capture failed (graphs are then off), or None.
    """

    def __init__(self, factory: Callable[[], Any] | None = None) -> None:
        self.factory = factory if factory is not None else torch.cuda.CUDAGraph
        self.graphs: dict[int, BucketGraph] = {}
        self.failed: str | None = None
        # Per bucket: the buffer address whose settled path ran eagerly once.
        self._eager: dict[int, int] = {}

    def lookup(self, index: int, buffer: torch.Tensor, bound: object = None) -> BucketGraph | None:
        """The bucket's graph, if it was captured for this very buffer (and where ``bound``
        is given, for that settled path: one bound again on the same buffer, as error
        feedback's is after restored residuals, holds other scratch and is captured again)."""
        entry = self.graphs.get(index)
        if (
            entry is not None
            and entry.ptr == buffer.data_ptr()
            and entry.numel == buffer.numel()
            and (bound is None or entry.bound is bound)
        ):
            return entry
        return None

    def drop(self, index: int) -> None:
        """Forget the bucket's graph: its settled path is bound again, and captured again
        after it has run eagerly once more."""
        self.graphs.pop(index, None)
        self._eager.pop(index, None)

    def ready(self, index: int, buffer: torch.Tensor) -> bool:
        """Whether a settled bucket may be captured now.

        False the first time a settled bucket is seen on a buffer (it runs
        eagerly once more), True from the second.
        """
        if self.failed is not None:
            return False
        ptr = buffer.data_ptr()
        if self._eager.get(index) == ptr:
            return True
        self._eager[index] = ptr
        return False

    def capture(
        self,
        index: int,
        buffer: torch.Tensor,
        work: Callable[[], None],
        traffic: Traffic,
        stats: StepStats | None = None,
        bound: object = None,
    ) -> BucketGraph | None:
        """Capture ``work`` (the settled path ``bound``) on the current stream; None (graphs
        off, logged) if it fails.

        ``work`` is recorded, not run: :meth:`replay` runs it. The bytes it
        counts into ``traffic`` and the records it queues in ``stats`` are
        taken out and kept for the replays.
        """
        before = dict(traffic.bytes)
        mark = stats.queued if stats is not None else 0
        graph = self.factory()
        try:
            # thread_local: the autograd engine's other threads keep running.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                work()
            finally:
                graph.capture_end()
        except Exception as exc:  # any failure: the buckets run eagerly
            traffic.bytes = before
            if stats is not None:
                stats.take_since(mark)  # never written: the eager run records its own
            self.failed = f"{type(exc).__name__}: {exc}"
            self.graphs.clear()
            _log.warning(
                "aps_comm: capturing bucket %d as a CUDA graph failed (%s); buckets run "
                "without graphs from now on",
                index,
                self.failed,
            )
            return None
        delta = {k: v - before.get(k, 0) for k, v in traffic.bytes.items()}
        traffic.bytes = before
        records = stats.take_since(mark) if stats is not None else []
        entry = BucketGraph(graph, buffer.data_ptr(), buffer.numel(), delta, records, bound)
        self.graphs[index] = entry
        return entry

    @staticmethod
    def replay(entry: BucketGraph, traffic: Traffic, stats: StepStats | None = None) -> None:
        """Run the bucket's graph on the current stream, count its bytes and queue its
        records into ``stats``, lent (:meth:`aps_comm.telemetry.StepStats.keep` copies
        them at the step's end: the next replay rewrites the graph's own)."""
        entry.graph.replay()
        for collective, nbytes in entry.traffic.items():
            if nbytes:
                traffic(collective, nbytes)
        if stats is not None:
            for part, rows in entry.records:
                stats.add_rows(*part, rows, lent=True)
