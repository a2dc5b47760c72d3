"""How ``aps_comm``'s hook reduces a bucket, what each way costs, and which to pick.

The hook imports this module at run time to size its chunks and to choose a
strategy per bucket (``reduction="auto"``); the performance model uses the
same functions, so the model predicts the hook as built. It needs no torch
and no ``aps_comm``.

Strategies (:data:`STRATEGIES`), on N = M nodes x L ranks per node, w wire
bytes per element (1 for FP8):

- ``"fp32"``: the plain FP32 all-reduce in one piece (DDP's default hook).
- ``"native"``: all-reduce in the wire dtype (FP16/BF16 everywhere, FP8 on
  NCCL >= 2.24 on sm_90+), chunked, with APS scaling.
- ``"two_phase"``: per chunk an all-to-all of encoded shards over all N
  ranks, the owner's decode + FP32 sum + re-encode, an all-gather.
- ``"hierarchical"``: per chunk an intra-node all-to-all of FP32 slices and
  their FP32 sum, two_phase across the M nodes among the ranks with the same
  local rank, an intra-node all-gather of the encoded slices.
- ``"grid"``: two_phase in two levels on a virtual g x C grid of the N ranks
  (g = :func:`grid_rows`, C = N / g), every stage in the wire format: per
  chunk an all-to-all in the row group (g consecutive ranks), the slice
  owner's decode + FP32 sum + re-encode, two_phase in the column group (the
  C ranks with the same position in their row), an all-gather in the row
  group: 2(g-1) + 2(C-1) messages per chunk instead of 2(N-1).

The staged strategies (hierarchical, grid) run stage s of chunk c at step
c + s, so collectives on different process groups (the node's and the
across-node group; the row and the column group) and the codec of different
chunks run at the same time: the model pipelines them as resources
(:func:`bucket_breakdown`), sharing a node's NIC among all that cross it.

Chunks (:func:`chunk_elements`) are sized so that no message to one peer is
small enough for latency to dominate it, and so that the pipeline of chunks
neither pays too many per-chunk costs nor fills and drains too slowly.

Example:
    >>> c = hook_cluster("nccl", "cuda", world_size=64, ranks_per_node=8)
    >>> choose_strategy(25 * 2**18, 20, "e4m3", c, native_ok=False, hierarchical_ok=True)
    'hierarchical'
    >>> choose_strategy(1000, 2, "e4m3", c, native_ok=False, hierarchical_ok=True)
    'fp32'
    >>> flat = hook_cluster("nccl", "cuda", world_size=1024, ranks_per_node=1)
    >>> choose_strategy(25 * 2**18, 20, "e4m3", flat, False, False, grid_ok=True)
    'grid'
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .choices import Choice
from .cluster import Cluster, custom_cluster, get_cluster, get_device
from .collectives import (
    LinkParams,
    Topology,
    all_gather,
    all_to_all,
    allreduce,
    hierarchical_all_gather,
    hierarchical_all_to_all,
    hierarchical_allreduce,
)
from .formats import FormatSpec, get_format

if TYPE_CHECKING:
    from .profile import Profile

__all__ = [
    "GLOO_CHUNK_OVERHEAD_S",
    "LATENCY_FACTOR",
    "MAX_CHUNK",
    "MIN_CHUNK",
    "STRATEGIES",
    "CommBreakdown",
    "Level",
    "bucket_breakdown",
    "choose_strategy",
    "chunk_elements",
    "flag_bytes",
    "grid_peers",
    "grid_rows",
    "hook_cluster",
    "level_bytes",
    "level_shares",
    "native_sum",
    "strategy_chunk",
    "strategy_times",
    "wire_bound",
]

STRATEGIES = ("fp32", "native", "two_phase", "hierarchical", "grid")
"""The hook's ways to reduce a bucket, in the order ties are broken (first wins)."""

LATENCY_FACTOR = 4.0
"""A message to one peer must take at least this many link latencies on the wire.

A message of B bytes costs ``alpha + B beta``; with ``B beta >= 4 alpha`` the
latency is at most 1/5 of it, so bytes, not latency, set the time. A larger
factor buys little (8: 1/9) for chunks twice as large, which take twice as
long to fill and drain the pipeline."""

MIN_CHUNK, MAX_CHUNK = 2**14, 2**26
"""Bounds on a chunk in elements: 64 KiB and 256 MiB of FP32."""

GLOO_CHUNK_OVERHEAD_S = 8e-4
"""What one more chunk costs the hook on Gloo over TCP: its collectives' wake-ups.

Fitted to the emulated cluster's measured best chunk sizes: 2 ranks at
1 Gbit/s were fastest with 2**20-element chunks of 25 MB buckets, 4 ranks at
250 Mbit/s with 2**18 (5e-4 put the first on 2**19, 6-30% slower)."""

_FP32_BYTES = 4.0
# Links of the hook's defaults without a profile (hook_cluster).
_LOOPBACK = (5e9, 10e-6)  # TCP between processes on one host: assumed, calibrate for real
_NIC_400G = (50e9, 6e-6)  # one ConnectX-7 400 Gbit/s NIC per node; latency as dgx-h100's


def chunk_elements(
    numel: int,
    wire_bytes: float,
    peers: int,
    link: LinkParams,
    overhead_s: float,
    exchange_s: float | None = None,
) -> int:
    """Elements per pipelined chunk of a bucket: a power of two, or ``numel`` (one chunk).

    Two constraints; the larger chunk wins:

    - latency: the message to one peer, ``chunk * wire_bytes / peers`` bytes,
      takes at least :data:`LATENCY_FACTOR` latencies on the wire
      (``>= 4 alpha / beta`` bytes), rounded up to a power of two;
    - pipelining: an exchange of W seconds cut in k chunks takes about
      ``W + W/k + k overhead_s`` (one chunk fills the pipeline, one drains it,
      every chunk pays its fixed cost), least at ``k = sqrt(W / overhead_s)``;
      the chunk is ``numel / k`` rounded to a power of two.

    The result is clamped to ``[MIN_CHUNK, MAX_CHUNK]``; a bucket no larger
    than the chunk is sent in one chunk of ``numel`` elements.

    Args:
        numel: elements in the bucket.
        wire_bytes: bytes per element on the wire (1 for FP8, 4 for FP32).
        peers: pieces a chunk is cut into, one per destination: the group size
            (N for two_phase's shards and for a ring all-reduce's steps).
        link: the link the per-peer messages cross, as one flow sees it
            (``inter.shared_by(L)`` where L ranks share a node's NIC).
        overhead_s: fixed cost of one more chunk.
        exchange_s: the bucket's unchunked exchange W, measured; None: the
            link's bandwidth term for an all-to-all plus all-gather,
            ``beta * 2 numel wire_bytes (peers - 1) / peers``.

    Returns:
        The chunk size in elements (at least 1).

    Raises:
        ValueError: a negative size or cost, ``wire_bytes <= 0`` or ``peers < 1``.

    Example:
        >>> slow = LinkParams(alpha=1e-4, beta=1e-8)   # 100 MB/s, 100 us
        >>> chunk_elements(2**23, 1.0, 4, slow, 8e-4)  # k = 12.5: pipelining decides
        524288
        >>> fast = LinkParams(alpha=1e-5, beta=8e-11)  # 100 Gbit/s, 10 us
        >>> chunk_elements(2**23, 1.0, 64, fast, 8e-4)  # 500 kB per peer: one chunk
        8388608
    """
    if numel < 0 or overhead_s < 0 or (exchange_s is not None and exchange_s < 0):
        raise ValueError(
            f"numel, overhead_s and exchange_s must be non-negative, got {numel}, "
            f"{overhead_s} and {exchange_s}"
        )
    if wire_bytes <= 0 or peers < 1:
        raise ValueError(f"wire_bytes must be > 0 and peers >= 1, got {wire_bytes} and {peers}")
    if numel <= 1 or peers == 1:
        return max(int(numel), 1)
    if exchange_s is None:
        exchange_s = link.wire_time(2.0 * numel * wire_bytes * (peers - 1) / peers)
    if exchange_s == 0.0:
        pipelined = float(numel)  # nothing on the wire to overlap
    elif overhead_s == 0.0:
        pipelined = 1.0  # free chunks: as many as the latency rule allows
    else:
        k = max(1.0, math.sqrt(exchange_s / overhead_s))
        pipelined = 2.0 ** round(math.log2(max(numel / k, 1.0)))
    if link.beta == 0.0:
        latency = math.inf  # no bandwidth term: every extra message is pure latency
    else:
        per_peer = LATENCY_FACTOR * link.alpha / link.beta
        latency = 2.0 ** math.ceil(math.log2(max(per_peer * peers / wire_bytes, 1.0)))
    chunk = min(max(pipelined, latency, MIN_CHUNK), MAX_CHUNK)
    return int(numel) if chunk >= numel else int(chunk)


def grid_rows(world_size: int) -> int:
    """The rows g of the grid N ranks are laid on: the largest divisor of N that is <= sqrt(N).

    Row groups are g consecutive ranks, column groups the C = N / g ranks
    with the same position in their row (``aps_comm``'s hierarchical groups
    with ``ranks_per_node = g``). g = 1 (N prime, or below 4) means no grid.

    Example:
        >>> [grid_rows(n) for n in (2, 4, 7, 8, 64, 1024)]
        [1, 2, 1, 2, 8, 32]
    """
    best = 1
    for g in range(2, math.isqrt(max(world_size, 1)) + 1):
        if world_size % g == 0:
            best = g
    return best


def grid_peers(world_size: int) -> int:
    """The peers of a flat exchange as latency-bound as one grid chunk: what sizes its chunks.

    The chunk rule keeps a chunk's latency at most ``1 / LATENCY_FACTOR``
    of its bytes' time on the wire. A flat exchange of a chunk of m elements
    sends 2(N-1) messages and ``2 m w (N-1)/N`` bytes, so one message per peer
    must carry ``LATENCY_FACTOR alpha / beta`` bytes: peers = N. A grid chunk
    sends ``2(g-1) + 2(C-1)`` messages and ``2 m w ((g-1)/g + (C-1)/N)`` bytes;
    the flat exchange with the same ratio has

        peers = ((g-1) + (C-1)) / ((g-1)/g + (C-1)/N)

    (rounded up): about g + C, not N. Sizing by the smallest message instead
    (the column stage's ``m w / N`` bytes, peers = N) would ask for chunks
    about sqrt(N)/2 times larger than that ratio needs, i.e. one chunk per
    bucket at scale and no pipelining; sizing by the row stage alone
    (peers = g) ignores the column stage's 2(C-1) latencies (C >= g), which
    would then be about half of the chunk's wire time.

    Raises:
        ValueError: N has no grid (:func:`grid_rows` is 1).

    Example:
        >>> [grid_peers(n) for n in (4, 8, 64, 1024)]
        [3, 5, 15, 63]
    """
    g = grid_rows(world_size)
    if g < 2:
        raise ValueError(
            f"world size {world_size} has no grid: no divisor g with 2 <= g <= sqrt(N)"
        )
    cols = world_size // g
    messages = (g - 1) + (cols - 1)
    return math.ceil(messages / ((g - 1) / g + (cols - 1) / world_size) - 1e-9)


class Level(Choice):
    """A level of a two_phase-style reduction: whose values a stage sends, and so its bytes.

    - ``SLICE``: hierarchical's in-node all-to-all of FP32 slices (4 bytes,
      nothing scaled).
    - ``SEND``: each rank's own values, encoded, to their owners (two_phase's
      all-to-all, hierarchical's across-node all-to-all, grid's row all-to-all).
    - ``FORWARD``: an owner's partial mean, re-encoded, to the next level's
      owners (grid's column all-to-all).
    - ``GATHER``: an owner's mean, encoded, back to the ranks (every all-gather).

    With block scaling every owner encodes what it forwards or gathers with
    its own block exponents and sends them with the codes, one byte per
    block; a rank's own values go with its own exponents too, unless they
    were agreed first (``block_exponents="agreed"``): :func:`level_bytes`.
    """

    SLICE = "slice"
    SEND = "send"
    FORWARD = "forward"
    GATHER = "gather"


def level_bytes(fmt: FormatSpec, level: Level) -> float:
    """Bytes per element that ``level`` sends of ``fmt``: its codes plus any block exponents.

    The one place the model prices a level's bytes: :func:`bucket_breakdown`'s
    bytes and its collectives' seconds both come from it, so what the
    planner compares is what the model reports. ``SLICE`` is FP32 (4). The
    encoded levels send ``wire_bytes`` and, with block scaling, the sender's
    own exponents, ``1 / block_size``, except ``SEND`` with agreed exponents
    (every rank knows them already).

    Example:
        >>> e2m1 = get_format("e2m1", aps=True, scaling="block", block_size=16)
        >>> [level_bytes(e2m1, lv) for lv in Level]  # 0.5 + 1/16 where encoded
        [4.0, 0.5625, 0.5625, 0.5625]
        >>> level_bytes(replace(e2m1, block_exponents="agreed"), Level.SEND)
        0.5
    """
    if level == Level.SLICE:
        return _FP32_BYTES
    return fmt.wire_bytes + _level_exponents(fmt, level)


def _level_exponents(fmt: FormatSpec, level: Level) -> float:
    """The block exponent bytes per element within :func:`level_bytes`."""
    if level == Level.SLICE or (level == Level.SEND and not fmt.rank_exponents):
        return 0.0
    return fmt.exponent_bytes


def level_shares(strategy: str, cluster: Cluster) -> tuple[tuple[Level, float], ...]:
    """The levels of ``strategy`` in order, each with the share of a bucket one rank sends.

    A rank sends ``share * numel`` elements at that level, so
    ``sum(level_bytes(fmt, lv) * share) * numel`` are its bytes for the bucket.
    On N = M nodes x L ranks, grid's g x C grid (:func:`grid_rows`):

    - two_phase: SEND and GATHER, (N-1)/N each;
    - hierarchical: SLICE (L-1)/L, SEND and GATHER across nodes (M-1)/(M L),
      GATHER in the node (L-1)/L;
    - grid: SEND in the row (g-1)/g, FORWARD and GATHER in the column
      (C-1)/N, GATHER in the row (g-1)/g.

    Raises:
        ValueError: ``strategy`` is not a two_phase-style one, or grid without a grid.

    Example:
        >>> c = get_cluster("dgx-h100", world_size=16)  # 2 nodes of 8
        >>> [(str(lv), share) for lv, share in level_shares("hierarchical", c)]
        [('slice', 0.875), ('send', 0.0625), ('gather', 0.0625), ('gather', 0.875)]
    """
    p = cluster.world_size
    if strategy == "two_phase":
        return ((Level.SEND, (p - 1) / p), (Level.GATHER, (p - 1) / p))
    if strategy == "hierarchical":
        g, nodes = cluster.topology.gpus_per_node, cluster.topology.nodes
        inter = (nodes - 1) / (nodes * g)
        intra = (g - 1) / g
        return (
            (Level.SLICE, intra),
            (Level.SEND, inter),
            (Level.GATHER, inter),
            (Level.GATHER, intra),
        )
    if strategy == "grid":
        rows = grid_rows(p)
        if rows < 2:
            raise ValueError(
                f"strategy 'grid' needs a world size with a divisor g, 2 <= g <= sqrt(N); got {p}"
            )
        row, column = (rows - 1) / rows, (p // rows - 1) / p
        return (
            (Level.SEND, row),
            (Level.FORWARD, column),
            (Level.GATHER, column),
            (Level.GATHER, row),
        )
    raise ValueError(f"strategy {strategy!r} has no levels; two_phase, hierarchical and grid do")


def flag_bytes(fmt: FormatSpec, n_layers: int) -> int:
    """Bytes of layer flags in each message of a bucket's first ``SEND``, per peer.

    With each rank's own block exponents nothing is agreed before the first
    chunk, so its ``SEND`` messages also carry the layers' non-finite flags
    (one byte each) and the rank's preferred chunk (one byte); 0 otherwise.

    Example:
        >>> flag_bytes(get_format("e4m3", aps=True, scaling="block"), 20)
        21
        >>> flag_bytes(get_format("e4m3", aps=True), 20)
        0
    """
    return n_layers + 1 if fmt.rank_exponents else 0


def _send_peers(strategy: str, cluster: Cluster) -> int:
    """Peers a rank sends its ``SEND`` level to: N-1, M-1 across nodes, or g-1 in its row."""
    if strategy == "hierarchical":
        return cluster.topology.nodes - 1
    if strategy == "grid":
        return grid_rows(cluster.world_size) - 1
    return cluster.world_size - 1


@dataclass(frozen=True)
class CommBreakdown:
    """Where the time of one bucket's reduction goes, on one rank.

    Attributes:
        format: wire format name.
        strategy: the strategy (one of :data:`STRATEGIES`).
        collective_s: data collectives, summed over the chunks.
        maxima_s: APS MAX all-reduce of the per-layer maxima.
        codec_s: local passes (amax, encode, decode, FP32 accumulation).
        wire_bytes: bytes this rank sends for the data, inside its node and
            across nodes: a staged strategy's in-node stages count too
            (hierarchical's are FP32), so it can exceed a flat format's.
        overlap_s: codec and wire time hidden by chunk pipelining.
        chunks: pipelined chunks of the bucket (1: no pipelining).
        overhead_s: the bucket's fixed cost as the real hook pays it, less the
            parts' own latencies (where measured: ``hook_call.<fmt>`` of a
            calibrated profile or of the device's constants); negative where
            the parts, timed alone, overcount it.
        inter_node_bytes: the part of ``wire_bytes`` that leaves the node, per
            rank (averaged over the node's ranks); 0 on one node.
        exponent_bytes: the part of ``wire_bytes`` that is block exponents
            (block scaling: those every level carries, :func:`level_bytes`,
            and any MAX all-reduce agreeing them); 0 with per-layer scaling,
            whose 4-byte maxima are not counted.

    Example:
        >>> CommBreakdown("fp32", "fp32", 1.0, 0.0, 0.5, 8.0).total_s
        1.5
    """

    format: str
    strategy: str
    collective_s: float
    maxima_s: float
    codec_s: float
    wire_bytes: float
    overlap_s: float = 0.0
    chunks: int = 1
    overhead_s: float = 0.0
    inter_node_bytes: float = 0.0
    exponent_bytes: float = 0.0

    @property
    def total_s(self) -> float:
        """Seconds from the bucket's start to its reduced gradients being usable."""
        return self.collective_s + self.maxima_s + self.codec_s - self.overlap_s + self.overhead_s


def _spec(fmt: str | FormatSpec) -> FormatSpec:
    """The format as the APS hook sends it: every format but FP32 is APS-scaled."""
    if isinstance(fmt, FormatSpec):
        return fmt
    spec = get_format(fmt)
    return spec if spec.name == "fp32" else replace(spec, aps=True)


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")


def native_sum(fmt: str | FormatSpec, cluster: Cluster) -> bool:
    """Whether the cluster's collectives sum ``fmt``'s dtype natively (the ``native`` strategy).

    FP16 and BF16 everywhere; FP8 (e4m3, e5m2) where the device is marked
    :attr:`~aps_perfmodel.cluster.Device.fp8_sum` (NCCL >= 2.24 on sm_90+).

    Example:
        >>> native_sum("e4m3", get_cluster("dgx-h100")), native_sum("e4m3", get_cluster("100gbe"))
        (True, False)
    """
    spec = _spec(fmt)
    if spec.name in ("fp32", "fp16", "bf16"):
        return True
    return spec.name in ("e4m3", "e5m2") and cluster.device.fp8_sum


def _intra(cluster: Cluster) -> LinkParams:
    """The in-node link as one rank's transfers see it in a step.

    The topology's intra link is one flow's, its two ends on cores of their
    own (as a probe measures loopback TCP, as presets state NVLink). Where
    ranks are CPU processes (``cores_per_rank`` known), loopback moves every
    byte by two copies on the CPU, the sender's and the receiver's, and in an
    all-to-all or all-gather a rank does both for its own bytes: ``2 / cores``
    of that rate's time, never less than the flow's own.
    """
    intra, cores = cluster.topology.intra, cluster.cores_per_rank
    if cores is None or cores <= 0:
        return intra
    return replace(intra, beta=intra.beta * max(1.0, 2.0 / cores))


def _allreduce(cluster: Cluster, nbytes: float, key: str, algorithm: str) -> float:
    fit = cluster.collective_fits.get(key)
    if fit is not None:
        return allreduce(nbytes, cluster.world_size, fit, algorithm)
    topo = cluster.topology
    if cluster.backend == "gloo" and topo.nodes > 1 and topo.gpus_per_node > 1:
        # Gloo runs one flat ring over node-major ranks, not node-aware: each
        # step every rank passes n/N to the next, one flow per node over its
        # link (not shared), the rest over the in-node link; a step waits for
        # the slower, so each node link carries 2(N-1)/N n.
        intra, inter = _intra(cluster), topo.inter
        slow = replace(
            inter if inter.beta >= intra.beta else intra,
            alpha=max(intra.alpha, inter.alpha),
            gamma=intra.gamma,
        )
        return allreduce(nbytes, cluster.world_size, slow, algorithm)
    return hierarchical_allreduce(nbytes, topo, algorithm)


def _exchange(cluster: Cluster, nbytes: float, k: int, gathered: float | None = None) -> float:
    """Flat all-to-all of ``nbytes`` then all-gather of ``gathered``, ``k`` chunks back to back.

    ``gathered`` (default ``nbytes``) is larger where the owners' shards
    carry their block exponents. Uses the calibrated pipelined exchange
    where there is one (timed whole: one latency and one burst per call).
    Otherwise composes the two collectives per chunk; a token-bucket shaper
    (``burst_bytes``) still passes its burst only once, since the chunks
    leave the link no idle time to refill it.
    """
    p = cluster.world_size
    gathered = nbytes if gathered is None else gathered
    sent = k * (nbytes + gathered) * (p - 1) / p
    fit = cluster.collective_fits.get("exchange")
    if fit is not None:
        return fit.alpha + fit.wire_time(sent)
    a2a, ag = cluster.collective_fits.get("all_to_all"), cluster.collective_fits.get("all_gather")
    if a2a is None or ag is None:
        return k * (
            hierarchical_all_to_all(nbytes, cluster.topology)
            + hierarchical_all_gather(gathered, cluster.topology)
        )
    steady = all_to_all(nbytes, p, replace(a2a, burst_bytes=0.0))
    steady += all_gather(gathered, p, replace(ag, burst_bytes=0.0))
    return k * steady - a2a.beta * min(a2a.burst_bytes, sent)


def _accumulate(cluster: Cluster, n_in: float, group: int) -> float:
    """FP32 sum on the owner of ``group`` slices, ``n_in`` elements in all."""
    if n_in <= 0 or group <= 1:
        return 0.0
    if "accumulate" in cluster.pass_costs:
        return cluster.pass_costs["accumulate"].time(n_in)
    topo = cluster.topology
    gamma = topo.intra.gamma if topo.gpus_per_node > 1 else topo.inter.gamma
    return n_in * _FP32_BYTES * (group - 1) / group * gamma


@functools.lru_cache(maxsize=256)
def _group_layout(world: int, per_node: int, size: int, stride: int) -> tuple[int, int]:
    """(q, nodes) for the groups of ``size`` ranks ``stride`` apart on node-major ranks.

    Rows (stride 1) start at multiples of ``size``; columns (stride g) at
    0..g-1. ``q`` is the fewest members any member has on its own node
    (itself included: the worst rank's on-node peers are q - 1), ``nodes``
    the most nodes a group spans.
    """
    starts = range(0, world, size) if stride == 1 else range(stride)
    q, nodes = size, 1
    for start in starts:
        counts: dict[int, int] = {}
        for i in range(size):
            node = (start + i * stride) // per_node
            counts[node] = counts.get(node, 0) + 1
        q, nodes = min(q, *counts.values()), max(nodes, len(counts))
    return q, nodes


@dataclass(frozen=True)
class _Stage:
    """One collective of a chunk: its group, seconds, and bytes through the node's NIC.

    ``seconds`` is the steady state, no shaper burst (see :func:`_nic_credit`).
    """

    group: str
    seconds: float
    nic_bytes: float = 0.0


def _stage_links(cluster: Cluster, key: str) -> tuple[LinkParams, LinkParams]:
    """(in-node link, node NIC as each of its L ranks' flows sees it) for a ``key`` collective.

    Bandwidth from the topology (the NIC without its burst: chunks follow
    back to back, see :func:`_nic_credit`); latency from the profile's fit of
    that collective where calibrated: the per-step cost of a real call
    (Gloo's wake-ups, about a millisecond), not the wire's round trip.
    """
    topo = cluster.topology
    intra = _intra(cluster)
    nic = replace(topo.inter.shared_by(topo.gpus_per_node), burst_bytes=0.0)
    fit = cluster.collective_fits.get(key)
    if fit is not None:
        intra, nic = replace(intra, alpha=fit.alpha), replace(nic, alpha=fit.alpha)
    return intra, nic


def _nic_credit(cluster: Cluster, nic_bytes: float) -> float:
    """Seconds a shaper's burst saves the NIC over a bucket whose flows send ``nic_bytes`` each.

    As flat two_phase's exchange: the burst passes once per bucket, since
    the chunks' calls leave the link no idle time to refill it.
    """
    topo = cluster.topology
    shared = topo.inter.shared_by(topo.gpus_per_node)
    return shared.beta * min(shared.burst_bytes, nic_bytes)


def _group_stages(
    cluster: Cluster, group: str, nbytes: float, gathered: float, size: int, stride: int
) -> tuple[_Stage, _Stage]:
    """An all-to-all of an ``nbytes`` send buffer and an all-gather of a ``gathered`` output.

    On groups of ``size`` ranks ``stride`` apart: with q members on a node,
    q - 1 peers over the node's link and the rest through its NIC, which
    all L ranks of the node cross at the same stage (each sees it shared by
    L, as :func:`~aps_perfmodel.collectives.hierarchical_all_to_all`); the
    all-gather across nodes is two-level, as flat two_phase's is modelled.
    """
    topo = cluster.topology
    if size == 1:
        return _Stage(group, 0.0), _Stage(group, 0.0)
    q, nodes = _group_layout(cluster.world_size, topo.gpus_per_node, size, stride)
    intra, nic = _stage_links(cluster, "all_to_all")
    if nodes == 1:
        intra_ag, _ = _stage_links(cluster, "all_gather")
        return (
            _Stage(group, all_to_all(nbytes, size, intra)),
            _Stage(group, all_gather(gathered, size, intra_ag)),
        )
    off = nbytes * (size - q) / size
    a2a = (
        (q - 1) * intra.alpha
        + intra.wire_time(nbytes * (q - 1) / size)
        + (size - q) * nic.alpha
        + nic.wire_time(off)
    )
    intra, nic = _stage_links(cluster, "all_gather")
    crossing = gathered / q * (nodes - 1) / nodes
    ag = all_gather(gathered / q, nodes, nic) + all_gather(gathered, q, intra)
    return _Stage(group, a2a, off), _Stage(group, ag, crossing)


def _stages(strategy: str, cluster: Cluster, fmt: FormatSpec, m: float) -> list[_Stage]:
    """The four collectives of one hierarchical or grid chunk of ``m`` elements, in order.

    Each sends its level's bytes (:func:`level_bytes`), block exponents included.
    """
    topo = cluster.topology
    send, gather = level_bytes(fmt, Level.SEND), level_bytes(fmt, Level.GATHER)
    if strategy == "hierarchical":
        g, nodes = topo.gpus_per_node, topo.nodes
        intra, nic = _stage_links(cluster, "all_to_all")
        intra_ag, nic_ag = _stage_links(cluster, "all_gather")
        across = m / g * (nodes - 1) / nodes
        return [
            _Stage("intra", all_to_all(level_bytes(fmt, Level.SLICE) * m, g, intra)),
            _Stage("inter", all_to_all(send * m / g, nodes, nic), send * across),
            _Stage("inter", all_gather(gather * m / g, nodes, nic_ag), gather * across),
            _Stage("intra", all_gather(gather * m, g, intra_ag)),
        ]
    p = cluster.world_size
    g = grid_rows(p)
    forward = level_bytes(fmt, Level.FORWARD)
    row_a2a, row_ag = _group_stages(cluster, "row", send * m, gather * m, g, 1)
    col_a2a, col_ag = _group_stages(cluster, "column", forward * m / g, gather * m / g, p // g, g)
    return [row_a2a, col_a2a, col_ag, row_ag]


def _inter_node_bytes(strategy: str, fmt: FormatSpec, numel: float, cluster: Cluster) -> float:
    """Bytes per rank (averaged over a node's ranks) that leave the node for one bucket.

    As the collectives are modelled: NCCL's all-reduce is two-level (each of
    the L ranks all-reduces its 1/L shard across the M nodes), Gloo's (and a
    calibrated profile's) one flat ring over node-major ranks (one rank in L
    sends to the next node);
    flat two_phase's all-to-all and all-gather send (N - L)/N of each rank's
    bytes off the node; the staged strategies' stages say what crosses. The
    levels' bytes are :func:`level_bytes`'s, block exponents included.
    """
    topo = cluster.topology
    per_node, p = topo.gpus_per_node, cluster.world_size
    if topo.nodes == 1:
        return 0.0
    if strategy in ("fp32", "native"):
        w = _FP32_BYTES if strategy == "fp32" else fmt.wire_bytes
        return _ring_across(w * numel, cluster)
    if strategy == "two_phase":
        both = level_bytes(fmt, Level.SEND) + level_bytes(fmt, Level.GATHER)
        return both * numel * (p - per_node) / p
    return sum(st.nic_bytes for st in _stages(strategy, cluster, fmt, numel))


def _ring_across(nbytes: float, cluster: Cluster) -> float:
    """Bytes per rank (averaged over a node's ranks) that an all-reduce of ``nbytes`` sends
    off the node: one flat ring on Gloo and calibrated profiles, else two-level."""
    topo = cluster.topology
    nodes, per_node, p = topo.nodes, topo.gpus_per_node, cluster.world_size
    if nodes == 1:
        return 0.0
    if cluster.backend == "gloo" or cluster.collective_fits:  # one flat ring
        return 2.0 * nbytes * (p - 1) / p / per_node
    return 2.0 * nbytes * (nodes - 1) / (nodes * per_node)


def _wire(strategy: str, fmt: FormatSpec, cluster: Cluster, m: float, k: int) -> float:
    """Collective seconds of ``k`` chunks of ``m`` elements, back to back."""
    w = fmt.wire_bytes
    if strategy == "fp32":
        return k * _allreduce(cluster, _FP32_BYTES * m, "all_reduce.float32", cluster.algorithm)
    if strategy == "native":
        return k * _allreduce(cluster, w * m, f"all_reduce.{fmt.torch_dtype}", cluster.algorithm)
    if strategy == "two_phase":
        # The owners' shards of the mean go back with their block exponents
        # (and each rank's own go out with its shards).
        out, back = level_bytes(fmt, Level.SEND) * m, level_bytes(fmt, Level.GATHER) * m
        return _exchange(cluster, out, k, back)
    stages = _stages(strategy, cluster, fmt, m)
    credit = _nic_credit(cluster, k * sum(st.nic_bytes for st in stages))
    return k * sum(st.seconds for st in stages) - credit


def _busiest(strategy: str, fmt: FormatSpec, cluster: Cluster, m: float, k: int) -> float:
    """Seconds of the busiest wire resource over ``k`` chunks of ``m`` elements.

    Flat strategies run their collectives on one process group, one after
    another: all of the wire time. The staged ones run each process group's
    collectives in order, and the groups at the same time, as far as the
    node's NIC, which the groups' across-node traffic shares, lets them.
    """
    if strategy not in ("hierarchical", "grid"):
        return _wire(strategy, fmt, cluster, m, k)
    per: dict[str, float] = {}
    through: dict[str, float] = {}
    nic_bytes = 0.0
    for st in _stages(strategy, cluster, fmt, m):
        per[st.group] = per.get(st.group, 0.0) + st.seconds
        through[st.group] = through.get(st.group, 0.0) + st.nic_bytes
        nic_bytes += st.nic_bytes
    topo = cluster.topology
    nic = topo.inter.shared_by(topo.gpus_per_node).beta * k * nic_bytes
    busy = [k * s - _nic_credit(cluster, k * through[grp]) for grp, s in per.items()]
    return max(nic - _nic_credit(cluster, k * nic_bytes), *busy)


def _codec(strategy: str, fmt: FormatSpec, cluster: Cluster, m: float) -> float:
    """Local passes of one chunk of ``m`` elements (the APS amax pass is per bucket)."""
    topo = cluster.topology
    p, g, nodes = cluster.world_size, topo.gpus_per_node, topo.nodes

    block = fmt.block_size if fmt.block_scaled else None

    def codec(op: str, n: float) -> float:
        return cluster.codec_time(op, fmt.name, fmt.wire_bytes, n, block)

    def owner(n: float, group: int) -> float:
        # Decode the group's shards (n elements), sum them in FP32, re-encode n/group
        # (one fused pass where calibrated as "reduce.<fmt>").
        if group <= 1:
            return 0.0
        if f"reduce.{fmt.name}" in cluster.pass_costs:
            return codec("reduce", n)
        return codec("decode", n) + _accumulate(cluster, n, group) + codec("encode", n / group)

    if strategy == "fp32":
        return 0.0
    if strategy == "native":
        return codec("encode", m) + codec("decode", m)
    if strategy == "two_phase":
        return codec("encode", m) + owner(m, p) + codec("decode", m)
    if strategy == "grid":
        # Encode the chunk; the row owner's decode-sum-encode of g slices, the
        # column owner's of C shards; every rank decodes the gathered chunk.
        rows = grid_rows(p)
        return codec("encode", m) + owner(m, rows) + owner(m / rows, p // rows) + codec("decode", m)
    # hierarchical: FP32 sum of the L slices, encode the node sum, the inter-node
    # owner's decode-sum-encode, and every rank decodes the gathered chunk.
    return (
        _accumulate(cluster, m, g)
        + codec("encode", m / g)
        + owner(m / g, nodes)
        + codec("decode", m)
    )


def _flat_link(cluster: Cluster, key: str) -> LinkParams:
    """The link a flat collective's per-peer messages cross (as one flow sees it)."""
    fit = cluster.collective_fits.get(key)
    if fit is not None:
        return fit
    topo = cluster.topology
    if topo.nodes == 1:
        return topo.intra
    return topo.inter.shared_by(topo.gpus_per_node)


def strategy_chunk(
    numel: int,
    fmt: str | FormatSpec,
    cluster: Cluster,
    strategy: str,
    exchange_s: float | None = None,
) -> int:
    """The chunk (elements) that ``strategy`` cuts a bucket into on ``cluster``.

    :func:`chunk_elements` with the strategy's peers and links: N peers on
    the bottleneck link for ``native`` and ``two_phase``; for
    ``hierarchical`` the larger of the inter-node stages' chunk (N peers
    per chunk, the node's NIC shared by its L ranks) and the intra-node
    FP32 stage's (L peers, 4 bytes per element); for ``grid``
    :func:`grid_peers` (about g + C) on the link its column groups cross
    (the NIC, shared by the node's L ranks). The per-chunk overhead is
    :attr:`Cluster.chunk_overhead_s`, else the model's fixed cost of one
    chunk. ``"fp32"`` is never chunked.

    Args:
        numel: elements in the bucket.
        fmt: wire format name (or spec).
        cluster: the cluster (e.g. from :func:`hook_cluster`).
        strategy: one of :data:`STRATEGIES`.
        exchange_s: the bucket's measured exchange; None: the model's
            unchunked collectives and codec passes (what the hook measures
            once it has run the bucket).

    Example:
        >>> c = hook_cluster("gloo", "cpu", world_size=2, ranks_per_node=1)
        >>> strategy_chunk(25 * 2**18, "e4m3", c, "two_phase", exchange_s=0.05)
        1048576
    """
    _check_strategy(strategy)
    spec = _spec(fmt)
    if strategy == "fp32" or cluster.world_size == 1 or numel <= 1:
        return max(int(numel), 1)
    overhead = cluster.chunk_overhead_s
    if overhead is None:
        overhead = _wire(strategy, spec, cluster, 1.0, 1) + _codec(strategy, spec, cluster, 1.0)
    if exchange_s is None:
        # What the hook times on CPU once it has run the bucket: its codec and wire.
        exchange_s = _wire(strategy, spec, cluster, float(numel), 1) + _codec(
            strategy, spec, cluster, float(numel)
        )
    w, p = spec.wire_bytes, cluster.world_size
    if strategy == "hierarchical":
        topo = cluster.topology
        g = topo.gpus_per_node
        chunk = chunk_elements(numel, _FP32_BYTES, g, topo.intra, overhead, exchange_s)
        if topo.nodes > 1:
            inter = topo.inter.shared_by(g)
            chunk = max(chunk, chunk_elements(numel, w, p, inter, overhead, exchange_s))
        return chunk
    if strategy == "grid":
        topo = cluster.topology
        link = topo.intra if topo.nodes == 1 else topo.inter.shared_by(topo.gpus_per_node)
        return chunk_elements(numel, w, grid_peers(p), link, overhead, exchange_s)
    key = "all_to_all" if strategy == "two_phase" else f"all_reduce.{spec.torch_dtype}"
    return chunk_elements(numel, w, p, _flat_link(cluster, key), overhead, exchange_s)


def bucket_breakdown(
    numel: int,
    n_layers: int,
    fmt: str | FormatSpec,
    cluster: Cluster,
    strategy: str,
    chunk: int | str | None = "auto",
    n_blocks: int | None = None,
) -> CommBreakdown:
    """The reduction of one bucket of ``numel`` FP32 gradients in ``n_layers`` tensors.

    APS formats pay a pass for the layer maxima and their MAX all-reduce,
    then ``k`` chunks, each with its collectives' latencies and its codec
    passes. The chunks are a pipeline: its resources (the codec; the wire of
    each process group a strategy uses, and the node's NIC that their
    across-node traffic shares) work on different chunks at the same time.
    With ``S`` the sum of all codec and wire time over the chunks and ``R``
    the busiest resource's, it takes ``R + (S - R) / k``: one chunk through
    every stage (fill and drain), the other ``k - 1`` at the busiest
    resource's pace. Flat strategies have two resources, codec ``C`` and wire
    ``W``: ``max(C, W) + min(C, W) / k``. ``"fp32"`` and torch's cast hooks
    (``aps=False``) are one piece.

    With block scaling (``fmt.block_scaled``) every encoded level of
    two_phase, hierarchical and grid carries its sender's block exponents,
    ``exponent_bytes`` per element (:func:`level_bytes`, :func:`level_shares`).
    With each rank's own exponents (``fmt.rank_exponents``) nothing is
    agreed first and the first chunk's ``SEND`` messages carry the layer
    flags too (:func:`flag_bytes`, counted in ``wire_bytes``); agreed
    exponents, and native's sums, cost one MAX all-reduce of a byte per
    block instead of 4 bytes per layer. The passes that apply the scales
    cost more per element (:meth:`~aps_perfmodel.cluster.Cluster.codec_time`);
    the payload's bytes are the same.

    Args:
        numel: gradient elements in the bucket.
        n_layers: parameter tensors in it (APS sends one maximum each).
        fmt: wire format name (APS-scaled unless ``fp32``) or spec.
        cluster: links, device and any calibrated fits.
        strategy: one of :data:`STRATEGIES`.
        chunk: elements per chunk; "auto": :func:`strategy_chunk`; None: one chunk.
        n_blocks: block scaling: the bucket's blocks (exponent bytes),
            :meth:`~aps_perfmodel.formats.FormatSpec.block_count` of its
            layers; None: the most its layers can make
            (:meth:`~aps_perfmodel.formats.FormatSpec.block_bound`).

    Raises:
        ValueError: an unknown strategy, grid without a grid, or a negative ``n_blocks``.

    Example:
        >>> c = get_cluster("dgx-h100", world_size=64)
        >>> b = bucket_breakdown(25 * 2**18, 20, "e4m3", c, "hierarchical")
        >>> b.chunks, b.total_s < bucket_breakdown(25 * 2**18, 20, "fp32", c, "fp32").total_s
        (1, True)
        >>> e2m1 = get_format("e2m1", aps=True, scaling="block")
        >>> two = get_cluster("1gbe", world_size=2)
        >>> b = bucket_breakdown(2**20, 4, e2m1, two, "native", n_blocks=2**20 // 32)
        >>> b.wire_bytes / 2**20  # an all-reduce of 0.5 B and one of 1/32 B per element
        0.53125
    """
    _check_strategy(strategy)
    if n_blocks is not None and n_blocks < 0:
        raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
    spec = _spec(fmt)
    if strategy == "fp32":
        spec = replace(spec, aps=False)
    p = cluster.world_size
    if p == 1 or numel == 0:
        return CommBreakdown(spec.name, strategy, 0.0, 0.0, 0.0, 0.0)
    w = spec.wire_bytes
    if strategy == "fp32":
        collective = _wire("fp32", spec, cluster, float(numel), 1)
        across = _inter_node_bytes("fp32", spec, numel, cluster)
        return CommBreakdown(
            spec.name,
            strategy,
            collective,
            0.0,
            0.0,
            2 * _FP32_BYTES * numel * (p - 1) / p,
            inter_node_bytes=across,
        )
    exponents = 0.0
    if strategy == "native":
        sent = 2 * w * numel * (p - 1) / p
    else:
        shares = level_shares(strategy, cluster)
        sent = numel * sum(level_bytes(spec, lv) * share for lv, share in shares)
        exponents = numel * sum(_level_exponents(spec, lv) * share for lv, share in shares)
        # The layer flags ride in the first chunk's messages, which are sent
        # anyway: counted in the bytes, below the model's resolution in time.
        sent += flag_bytes(spec, n_layers) * _send_peers(strategy, cluster)
    across = _inter_node_bytes(strategy, spec, numel, cluster)
    if not spec.aps:
        # torch's cast hooks (fp16_compress_hook): cast, all-reduce, cast back, one piece.
        collective = _wire(strategy, spec, cluster, float(numel), 1)
        codec_s = _codec(strategy, spec, cluster, float(numel))
        return CommBreakdown(
            spec.name, strategy, collective, 0.0, codec_s, sent, inter_node_bytes=across
        )
    head = cluster.codec_time("amax", spec.name, w, numel)
    if spec.rank_exponents and strategy != "native":
        # Every level carries its sender's own exponents (level_bytes):
        # nothing is agreed first.
        maxima = 0.0
    elif spec.block_scaled:
        blocks = spec.block_bound(numel, n_layers) if n_blocks is None else n_blocks
        # One MAX all-reduce of one-byte exponents agrees every block's (a
        # native sum needs them all alike; agreed ones scale each SEND).
        maxima = _allreduce(cluster, float(blocks), "all_reduce_max", "auto")
        agreeing = 2.0 * blocks * (p - 1) / p
        sent += agreeing
        exponents += agreeing
        across += _ring_across(float(blocks), cluster)
    else:
        maxima = _allreduce(cluster, n_layers * _FP32_BYTES, "all_reduce_max", "auto")
    if chunk == "auto":
        chunk = strategy_chunk(numel, spec, cluster, strategy)
    k = 1 if not chunk else max(1, -(-numel // int(chunk)))
    m = numel / k
    codec_s = k * _codec(strategy, spec, cluster, m)
    collective = _wire(strategy, spec, cluster, m, k)
    busiest = max(codec_s, _busiest(strategy, spec, cluster, m, k))
    overlap = (codec_s + collective - busiest) * (1.0 - 1.0 / k)
    if cluster.cores_per_rank is not None and cluster.cores_per_rank < 1:
        # Measured on the emulated cluster (4 ranks, 2 cores): the step took
        # longer than codec plus wire run back to back; a rank's codec and the
        # kernel's network stack compete for the same cores.
        overlap = 0.0
    return CommBreakdown(
        spec.name,
        strategy,
        collective,
        maxima,
        head + codec_s,
        sent,
        overlap,
        k,
        inter_node_bytes=across,
        exponent_bytes=exponents,
    )


def wire_bound(numel: int, fmt: str | FormatSpec, cluster: Cluster, strategy: str) -> float:
    """``strategy``'s time for one bucket with a free codec and free maxima, best chunking.

    What :func:`bucket_breakdown` predicts when the codec passes and the
    maxima all-reduce cost nothing, at the best chunk count (1 to 2**16,
    powers of two): with ``W`` the collectives' seconds over ``k`` chunks
    and ``R`` the busiest wire resource's, ``R + (W - R) / k``. Flat
    strategies have one resource, so one chunk is best. However fast its
    codec, the hook cannot beat it on these links.

    Example:
        >>> c = get_cluster("100gbe", world_size=64)
        >>> b = bucket_breakdown(2**22, 8, "e4m3", c, "two_phase")
        >>> wire_bound(2**22, "e4m3", c, "two_phase") <= b.total_s
        True
    """
    _check_strategy(strategy)
    spec = _spec(fmt)
    if strategy == "fp32":
        spec = replace(spec, aps=False)
    if cluster.world_size == 1 or numel == 0:
        return 0.0
    best = math.inf
    for k in (2**i for i in range(17)):
        if k > numel:
            break
        m = numel / k
        wire = _wire(strategy, spec, cluster, m, k)
        busiest = _busiest(strategy, spec, cluster, m, k)
        best = min(best, busiest + (wire - busiest) / k)
    return best


def strategy_times(
    numel: int,
    n_layers: int,
    fmt: str | FormatSpec,
    cluster: Cluster,
    strategies: Sequence[str],
) -> dict[str, float]:
    """Seconds each strategy takes to reduce one bucket, as the hook builds it.

    Args:
        numel: gradient elements in the bucket.
        n_layers: parameter tensors in it.
        fmt: wire format name (any but ``fp32`` is APS-scaled, per layer) or
            spec (e.g. ``get_format(name, aps=True, scaling="block")``).
        cluster: the cluster (e.g. :func:`hook_cluster`).
        strategies: names from :data:`STRATEGIES`.

    Raises:
        ValueError: an unknown strategy or format.

    Example:
        >>> c = hook_cluster("nccl", "cuda", world_size=16, ranks_per_node=8)
        >>> t = strategy_times(2**22, 10, "e4m3", c, ["fp32", "hierarchical"])
        >>> t["hierarchical"] < t["fp32"]
        True
    """
    return {s: bucket_breakdown(numel, n_layers, fmt, cluster, s).total_s for s in strategies}


def choose_strategy(
    numel: int,
    n_layers: int,
    fmt: str | FormatSpec,
    cluster: Cluster,
    native_ok: bool,
    hierarchical_ok: bool,
    grid_ok: bool = False,
    fp32_ok: bool = True,
) -> str:
    """The fastest strategy for one bucket; ``"fp32"`` where nothing else is faster.

    Candidates: ``fp32`` where ``fp32_ok`` (always an FP32 format's),
    ``two_phase`` always, ``native`` where
    ``native_ok`` (the backend sums the wire dtype), ``hierarchical`` where
    ``hierarchical_ok`` and nodes have several ranks, ``grid`` where
    ``grid_ok`` and N has a grid (:func:`grid_rows` >= 2). Ties go to the earlier
    name in :data:`STRATEGIES`. Pure arithmetic on its arguments, so every
    rank that passes the same ones chooses the same. ``fmt`` is a format
    name (APS-scaled per layer) or a spec, whose scaling is priced.

    Example:
        >>> c = hook_cluster("gloo", "cpu", world_size=4, ranks_per_node=1)
        >>> choose_strategy(25 * 2**18, 20, "e4m3", c, native_ok=False, hierarchical_ok=False)
        'two_phase'
        >>> choose_strategy(25 * 2**18, 20, "fp32", c, native_ok=False, hierarchical_ok=False)
        'fp32'
    """
    if _spec(fmt).name == "fp32" or (cluster.world_size == 1 and fp32_ok):
        return "fp32"
    allowed = {
        "fp32": fp32_ok,
        "native": native_ok,
        "two_phase": True,
        "hierarchical": hierarchical_ok and cluster.topology.gpus_per_node > 1,
        "grid": grid_ok and grid_rows(cluster.world_size) >= 2,
    }
    candidates = [s for s in STRATEGIES if allowed[s]]
    times = strategy_times(numel, n_layers, fmt, cluster, candidates)
    return min(candidates, key=times.__getitem__)  # ties: the earlier name


def hook_cluster(
    backend: str,
    device_type: str,
    world_size: int,
    ranks_per_node: int,
    profile: Profile | None = None,
) -> Cluster:
    """The cluster the hook plans with: the calibrated profile, else defaults per backend.

    - A profile (``python -m aps_comm calibrate``): its fitted links and codec
      passes, on ``world_size / ranks_per_node`` nodes.
    - NCCL: NVLink-class links inside a node (the dgx-h100 preset: 450 GB/s,
      3 us) and one 400 Gbit/s NIC per node (50 GB/s, 6 us) between nodes;
      the GPU codec (H100 memory), so chunks are sized by the links alone.
    - Gloo (and any other backend): 10 Gbit/s-class TCP between nodes (the
      10gbe preset: 1.25 GB/s, 25 us), loopback TCP inside a node (assumed
      5 GB/s, 10 us), :data:`GLOO_CHUNK_OVERHEAD_S` per chunk; the CPU codec
      (the ``cpu-numba`` device) on CPU tensors, the GPU codec on CUDA.

    Args:
        backend: ``torch.distributed`` backend name ("nccl", "gloo", ...).
        device_type: the gradients' device type ("cpu", "cuda").
        world_size: ranks N.
        ranks_per_node: ranks L per node (node-major ranks).
        profile: a calibrated profile, if any.

    Raises:
        ValueError: ``world_size`` or ``ranks_per_node`` below 1, or N not a
            multiple of L.

    Example:
        >>> c = hook_cluster("nccl", "cuda", world_size=16, ranks_per_node=8)
        >>> (c.topology.nodes, c.topology.gpus_per_node, c.device.name)
        (2, 8, 'h100')
    """
    if world_size < 1 or ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(
            f"world_size ({world_size}) must be a positive multiple of "
            f"ranks_per_node ({ranks_per_node})"
        )
    nodes = world_size // ranks_per_node
    nccl = backend.lower() == "nccl"
    device = "cpu-numba" if device_type == "cpu" else "h100"
    overhead = None if nccl else GLOO_CHUNK_OVERHEAD_S
    if profile is not None:
        cluster = profile.to_cluster(world_size, device=device)
        link = profile.link
        return replace(
            cluster,
            topology=Topology(nodes, ranks_per_node, link, link),
            chunk_overhead_s=overhead,
            backend=backend.lower(),
        )
    if nccl:
        intra = get_cluster("dgx-h100").topology.intra
        bw, lat = _NIC_400G
        name, source = "nccl-default", "hook defaults: NVLink-class intra, 400 Gbit/s per node"
    else:
        bw, lat = (
            get_cluster("10gbe").topology.inter.bandwidth,
            get_cluster("10gbe").topology.inter.alpha,
        )
        intra = LinkParams.from_bandwidth(*_LOOPBACK)
        name, source = "gloo-default", "hook defaults: 10 Gbit/s TCP, loopback inside a node"
    cluster = custom_cluster(
        bw,
        lat,
        nodes=nodes,
        gpus_per_node=ranks_per_node,
        intra_bandwidth=intra.bandwidth,
        intra_latency=intra.alpha,
        device=device,
    )
    return replace(
        cluster,
        name=name,
        source=source,
        device=get_device(device),
        chunk_overhead_s=overhead,
        backend=backend.lower(),
    )
