"""A bucket's plan: everything about its layout that does not change between steps.

DDP hands the hook the same buckets every step (it re-buckets once, after its
first iteration), so the offsets, the format groups, the chunk bounds, the
per-chunk segment layouts and the scratch buffers are built once per layout
and reused: the per-step path does no per-layer Python work that a fused op
can do, and on CUDA it copies nothing from the host.

Example:
    >>> plan = BucketPlan.build(0, [300, 100], torch.device("cpu"))
    >>> group = plan.group(["e4m3", "e4m3"], {"e4m3": "two_phase"}, 4, chunk_elements=256)
    >>> group.chunks
    [(0, 256), (256, 400)]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from aps_comm.codec import Layout
from aps_comm.formats import FP32, FloatFormat, get_format, payload_nbytes

__all__ = [
    "CHUNK_ELEMENTS",
    "MESSAGE_OVERHEAD_S",
    "BucketPlan",
    "GroupPlan",
    "chunk_bounds",
    "pipelined_chunk",
    "shard_layout",
]

CHUNK_ELEMENTS = 2**20
"""Elements per pipelined chunk until a bucket's exchange has been timed (4 MiB of FP32)."""
MESSAGE_OVERHEAD_S = 8e-4
"""What one more chunk costs on Gloo over TCP: its collectives' latency and wake-ups.

Fitted to the emulated cluster's measured best chunk sizes (see
:func:`pipelined_chunk`); 5e-4 put 2 ranks at 1 Gbit/s on 2**19-element
chunks, 6-30% slower per step than 2**20."""
_MIN_CHUNK, _MAX_CHUNK = 2**14, 2**26


def pipelined_chunk(numel: int, exchange_s: float, overhead_s: float = MESSAGE_OVERHEAD_S) -> int:
    """The chunk size (a power of two) for a bucket whose exchange took ``exchange_s``.

    Cut in k chunks, an exchange of W seconds takes about W + W/k + k * overhead:
    one chunk fills the pipeline and one drains it, and every chunk pays its
    messages' fixed cost. The sum is least at k = sqrt(W / overhead), so slow
    links get small chunks (little to fill and drain) and fast ones large
    chunks (few fixed costs). Measured on the emulated cluster: 2 ranks at 1
    Gbit/s were fastest with 2**20-element chunks (APS e4m3 step 0.171-0.179 s
    against 0.185-0.227 s with 2**19 and 0.193-0.203 s with 2**21), 4 ranks at
    250 Mbit/s with 2**18; 25 MB buckets then exchange in about 50 and 300 ms.

    Example:
        >>> pipelined_chunk(8 * 2**20, exchange_s=0.45)  # 24 chunks: 2**18 elements
        262144
        >>> pipelined_chunk(8 * 2**20, exchange_s=0.07)  # 9.4 chunks: 2**20 elements
        1048576
    """
    if exchange_s <= 0 or numel <= 0:
        return CHUNK_ELEMENTS
    k = max(1.0, math.sqrt(exchange_s / overhead_s))
    chunk = 2 ** round(math.log2(max(numel / k, 1.0)))
    return int(min(max(chunk, _MIN_CHUNK), _MAX_CHUNK))


def shard_layout(numel: int, fmt: FloatFormat, world_size: int) -> tuple[int, int]:
    """(elements per shard, bytes per shard) for two_phase, padding ``numel`` up.

    Shards hold whole bytes, so 4-bit formats use an even number of elements.

    Example:
        >>> shard_layout(10, get_format("e2m1"), 4)
        (4, 2)
    """
    per = -(-numel // world_size)
    if fmt.wire_bits == 4:
        per += per % 2
    return per, payload_nbytes(per, fmt)


def chunk_bounds(numel: int, chunk_elements: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` element ranges of at most ``chunk_elements`` (one empty range for 0).

    Example:
        >>> chunk_bounds(5, 2)
        [(0, 2), (2, 4), (4, 5)]
    """
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    if numel == 0:
        return [(0, 0)]
    return [(lo, min(lo + chunk_elements, numel)) for lo in range(0, numel, chunk_elements)]


@dataclasses.dataclass
class GroupPlan:
    """Layers of one bucket that travel in one format, and how they travel.

    Attributes:
        fmt: the wire format.
        reduction: "fp32" (plain averaging all-reduce), "allreduce" (native
            sum in the wire dtype) or "two_phase".
        index: positions of the group's layers in the bucket.
        index_tensor: the same on the bucket's device (to pick their maxima).
        numels: the layers' sizes.
        contiguous: the group is the whole bucket (no gather copy).
        layout: the layers' segments within the group's values.
        chunks: element ranges pipelined one after another.
        windows: each chunk's segment layout.
        regions: each chunk's byte range in ``send``/``recv`` (two_phase: N padded
            shards; native: the chunk's payload).
        shard_regions: two_phase: each chunk's reduced shard in ``shards``.
        send: scratch for the encoded chunks (two_phase also gathers into it).
        recv: two_phase: scratch for the received shards.
        shards: two_phase: scratch for the owner's reduced shards.
    """

    fmt: FloatFormat
    reduction: str
    index: list[int]
    index_tensor: torch.Tensor
    numels: list[int]
    contiguous: bool
    layout: Layout
    chunks: list[tuple[int, int]]
    windows: list[Layout]
    regions: list[tuple[int, int]]
    shard_regions: list[tuple[int, int]]
    send: torch.Tensor
    recv: torch.Tensor
    shards: torch.Tensor

    @property
    def numel(self) -> int:
        return self.layout.numel


@dataclasses.dataclass
class BucketPlan:
    """One bucket layout: its layers, its segments, and its group plans per format mix.

    Attributes:
        key: what identifies the layout (bucket index, sizes, device).
        numels: the layers' sizes in bucket order.
        layout: the layers' segments in the bucket.
        device: the bucket's device.
        groups: group plans, per (formats, reductions, world size, chunk size).
        exchange_s: the quickest exchange of this bucket so far (seconds; what
            :func:`pipelined_chunk` sizes chunks from: the minimum, since
            waiting for a late peer or a busy core only ever adds time).
        exchanges: exchanges timed so far.
    """

    key: tuple
    numels: list[int]
    layout: Layout
    device: torch.device
    groups: dict[tuple, list[GroupPlan]] = dataclasses.field(default_factory=dict)
    exchange_s: float = 0.0
    exchanges: int = 0

    def timed(self, seconds: float) -> None:
        """Record one exchange of the bucket (the first, which pays page faults, is not kept)."""
        if self.exchanges:
            self.exchange_s = min(self.exchange_s or seconds, seconds)
        self.exchanges += 1

    @classmethod
    def build(cls, bucket_index: int, numels: Sequence[int], device: torch.device) -> BucketPlan:
        """The plan of a bucket of layers of ``numels`` elements on ``device``."""
        numels = [int(n) for n in numels]
        key = (bucket_index, tuple(numels), str(device))
        return cls(key, numels, Layout.from_numels(numels, device), device)

    def group(
        self,
        fmts: Sequence[FloatFormat | str],
        reductions: dict,
        world_size: int,
        chunk_elements: int,
    ) -> list[GroupPlan]:
        """The group plans for this step's per-layer formats (built on first use).

        Args:
            fmts: each layer's wire format this step.
            reductions: each format's resolved reduction ("allreduce" or
                "two_phase"), keyed by format or name; FP32 is always a plain
                all-reduce.
            world_size: ranks N.
            chunk_elements: largest chunk, in elements.

        Returns:
            One plan per format, in order of first appearance (the same on every rank).
        """
        formats = [get_format(f) for f in fmts]
        key = (tuple(formats), world_size, chunk_elements)
        cached = self.groups.get(key)
        if cached is None:
            # One chunking per format mix: a new chunk size frees the old scratch.
            self.groups = {k: v for k, v in self.groups.items() if k[0] != key[0]}
            order: dict[FloatFormat, list[int]] = {}
            for i, f in enumerate(formats):
                order.setdefault(f, []).append(i)
            cached = [
                self._group_plan(f, idx, len(order) == 1, reductions, world_size, chunk_elements)
                for f, idx in order.items()
            ]
            self.groups[key] = cached
        return cached

    def _group_plan(
        self,
        fmt: FloatFormat,
        index: list[int],
        contiguous: bool,
        reductions: dict,
        world_size: int,
        chunk_elements: int,
    ) -> GroupPlan:
        numels = [self.numels[i] for i in index]
        layout = Layout.from_numels(numels, self.device)
        reduction = "fp32" if fmt == FP32 else reductions.get(fmt, reductions.get(fmt.name))
        if reduction not in ("fp32", "allreduce", "two_phase"):
            raise ValueError(f"no resolved reduction for {fmt.name}: {reduction!r}")
        chunks = chunk_bounds(layout.numel, chunk_elements if reduction != "fp32" else 2**62)
        windows = [layout.window(lo, hi) for lo, hi in chunks]
        regions, shard_regions = [], []
        start = shard_start = 0
        for lo, hi in chunks:
            if reduction == "two_phase":
                _, shard_bytes = shard_layout(hi - lo, fmt, world_size)
                size = shard_bytes * world_size
                shard_regions.append((shard_start, shard_start + shard_bytes))
                shard_start += shard_bytes
            else:
                size = payload_nbytes(hi - lo, fmt) if reduction == "allreduce" else 0
            regions.append((start, start + size))
            start += size

        def scratch(n: int) -> torch.Tensor:
            # Kept across steps: fresh large allocations pay page faults every step.
            return torch.empty(n, dtype=torch.uint8, device=self.device)

        two_phase = reduction == "two_phase"
        return GroupPlan(
            fmt=fmt,
            reduction=reduction,
            index=index,
            index_tensor=torch.tensor(index, dtype=torch.int64, device=self.device),
            numels=numels,
            contiguous=contiguous,
            layout=layout,
            chunks=chunks,
            windows=windows,
            regions=regions,
            shard_regions=shard_regions,
            send=scratch(start),
            recv=scratch(start if two_phase else 0),
            shards=scratch(shard_start),
        )
