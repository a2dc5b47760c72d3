"""Communication time of one gradient bucket for each wire format.

Mirrors the data path of the hooks: FP32 all-reduce; cast, low-precision
all-reduce and cast back; or APS two-phase (amax, MAX all-reduce of the L
per-layer maxima, encode, all-to-all, decode + FP32 accumulate on the shard
owner, re-encode, all-gather, decode + unscale).

APS scales by powers of two inside its encode/decode passes (no separate
scale/unscale pass), and pipelines each bucket in chunks of
``chunk_elements`` ("auto", the hook's default, sizes them as
:func:`aps_comm.plan.pipelined_chunk` does, from the bucket's exchange time:
k = sqrt(W / 0.8 ms) chunks, a power of two): every chunk pays its own
collective latency and codec launch, and the codec of one chunk overlaps the
wire time of another. With ``C`` the codec and ``W`` the wire time summed over
the ``k`` chunks, the pipelined part takes ``max(C, W) + min(C, W) / k`` (the
bottleneck stage, plus filling and draining the pipeline with one chunk of
the other), i.e. ``overlap_s = min(C, W) (1 - 1/k)`` less than running them
back to back.

Example:
    >>> from aps_perfmodel.cluster import get_cluster
    >>> from aps_perfmodel.formats import get_format
    >>> c = get_cluster("1gbe", world_size=4)
    >>> fp32 = bucket_comm(25 * 2**18, 10, get_format("fp32"), c)
    >>> fp8 = bucket_comm(25 * 2**18, 10, get_format("e4m3"), c)
    >>> 3.0 < fp32.total_s / fp8.total_s < 4.0
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .calibrate import CALL_ELEMENTS
from .cluster import Cluster, OpCost
from .collectives import (
    LinkParams,
    all_gather,
    all_to_all,
    allreduce,
    hierarchical_all_gather,
    hierarchical_all_to_all,
    hierarchical_allreduce,
)
from .formats import FORMATS, FormatSpec

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "CommBreakdown", "bucket_comm", "pipelined_chunk"]

_FP32_BYTES = 4.0
# aps_comm.plan.CHUNK_ELEMENTS: the hook's chunk before a bucket has been timed.
DEFAULT_CHUNK_ELEMENTS = 2**20
# aps_comm.plan.MESSAGE_OVERHEAD_S and its bounds on the chunk size.
_MESSAGE_OVERHEAD_S = 8e-4
_MIN_CHUNK, _MAX_CHUNK = 2**14, 2**26


def pipelined_chunk(numel: int, exchange_s: float) -> int:
    """The hook's automatic chunk size (``aps_comm.plan.pipelined_chunk``, kept
    torch-free here; a test checks that the two agree).

    Example:
        >>> pipelined_chunk(8 * 2**20, 0.45)
        262144
    """
    if exchange_s <= 0 or numel <= 0:
        return DEFAULT_CHUNK_ELEMENTS
    k = max(1.0, math.sqrt(exchange_s / _MESSAGE_OVERHEAD_S))
    chunk = 2 ** round(math.log2(max(numel / k, 1.0)))
    return int(min(max(chunk, _MIN_CHUNK), _MAX_CHUNK))


@dataclass(frozen=True)
class CommBreakdown:
    """Where the time of one bucket's reduction goes, on one rank.

    Attributes:
        format: wire format name.
        strategy: reduction strategy.
        collective_s: data collectives (all-reduce, or all-to-all + all-gather).
        maxima_s: APS MAX all-reduce of the per-layer maxima.
        codec_s: local passes (amax, encode, decode, FP32 accumulation).
        wire_bytes: bytes this rank sends over the network for the data.

        overlap_s: codec and wire time hidden by chunk pipelining.
        chunks: pipelined chunks of the bucket (1: no pipelining).
        overhead_s: the bucket's fixed cost as the real hook pays it, less the
            parts' own latencies (calibrated profiles only: ``hook_call.<fmt>``);
            negative where the parts, timed alone, overcount it.

    Example:
        >>> CommBreakdown("fp32", "native", 1.0, 0.0, 0.5, 8.0).total_s
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

    @property
    def total_s(self) -> float:
        """Seconds from the bucket's start to its reduced gradients being usable."""
        return self.collective_s + self.maxima_s + self.codec_s - self.overlap_s + self.overhead_s


def _allreduce(cluster: Cluster, nbytes: float, key: str, algorithm: str) -> float:
    fit = cluster.collective_fits.get(key)
    if fit is not None:
        return allreduce(nbytes, cluster.world_size, fit, algorithm)
    return hierarchical_allreduce(nbytes, cluster.topology, algorithm)


def _exchange(cluster: Cluster, nbytes: float, k: int) -> float:
    """All-to-all then all-gather of an ``nbytes`` payload, ``k`` chunks back to back.

    Uses the calibrated pipelined exchange where there is one (timed whole
    at the hook's chunk size: one latency and one burst per call, the
    per-chunk costs inside its beta). Otherwise composes the two collectives
    per chunk; a token-bucket shaper (``burst_bytes``) still passes its burst
    only once, since the chunks leave the link no idle time to refill it.
    """
    p = cluster.world_size
    sent = 2 * k * nbytes * (p - 1) / p
    fit = cluster.collective_fits.get("exchange")
    if fit is not None:
        return fit.alpha + fit.wire_time(sent)
    a2a, ag = cluster.collective_fits.get("all_to_all"), cluster.collective_fits.get("all_gather")
    if a2a is None or ag is None:
        return k * (
            hierarchical_all_to_all(nbytes, cluster.topology)
            + hierarchical_all_gather(nbytes, cluster.topology)
        )
    steady = all_to_all(nbytes, p, replace(a2a, burst_bytes=0.0))
    steady += all_gather(nbytes, p, replace(ag, burst_bytes=0.0))
    return k * steady - a2a.beta * min(a2a.burst_bytes, sent)


def _reduce_link(cluster: Cluster) -> LinkParams:
    topo = cluster.topology
    return topo.intra if topo.gpus_per_node > 1 else topo.inter


def _accumulate(cluster: Cluster, n_elem: float) -> float:
    """FP32 sum of the p decoded shards on their owner (n elements in, n/p out)."""
    p = cluster.world_size
    if "accumulate" in cluster.codec_fits:
        return cluster.codec_fits["accumulate"].time(n_elem)
    return n_elem * _FP32_BYTES * (p - 1) / p * _reduce_link(cluster).gamma


def _bucket_parts(
    n_elem: int,
    n_layers: int,
    fmt: FormatSpec,
    cluster: Cluster,
    chunk_elements: int | str | None,
) -> CommBreakdown:
    """:func:`bucket_comm` from the parts alone (no whole-call calibration)."""
    p = cluster.world_size
    if p == 1 or n_elem == 0:
        return CommBreakdown(fmt.name, fmt.strategy, 0.0, 0.0, 0.0, 0.0)
    w = fmt.wire_bytes
    wire = n_elem * w
    sent = 2 * wire * (p - 1) / p

    def codec(op: str, n: float) -> float:
        return cluster.codec_time(op, fmt.name, w, n)

    if fmt.strategy == "native":
        collective = _allreduce(cluster, wire, f"all_reduce.{fmt.torch_dtype}", cluster.algorithm)
        return CommBreakdown(fmt.name, fmt.strategy, collective, 0.0, 0.0, sent)
    if not fmt.aps and fmt.strategy == "allreduce":
        # torch's cast-compress hooks: cast, all-reduce, cast back, one piece.
        codec_s = codec("encode", n_elem) + codec("decode", n_elem)
        collective = _allreduce(cluster, wire, f"all_reduce.{fmt.torch_dtype}", cluster.algorithm)
        return CommBreakdown(fmt.name, fmt.strategy, collective, 0.0, codec_s, sent)

    # aps_comm's hook. APS: amax pass and a latency-bound all-reduce of L float32
    # maxima before anything is encoded; scaling is fused into encode/decode.
    head = maxima = 0.0
    if fmt.aps:
        head = codec("amax", n_elem)
        maxima = _allreduce(cluster, n_layers * _FP32_BYTES, "all_reduce_max", "auto")
    if chunk_elements == "auto":
        whole = (
            _allreduce(cluster, n_elem * w, f"all_reduce.{fmt.torch_dtype}", cluster.algorithm)
            if fmt.strategy == "allreduce"
            else _exchange(cluster, n_elem * w, 1)
        )
        chunk_elements = pipelined_chunk(n_elem, whole)
    k = 1 if not chunk_elements else max(1, -(-n_elem // int(chunk_elements)))
    m = n_elem / k
    if fmt.strategy == "allreduce":
        per_codec = codec("encode", m) + codec("decode", m)
        key = f"all_reduce.{fmt.torch_dtype}"
        collective = k * _allreduce(cluster, m * w, key, cluster.algorithm)
    else:
        # Owner decodes p shards (m elements), sums them in FP32, re-encodes m/p
        # (one fused pass where calibrated as "reduce.<fmt>"); everyone then
        # decodes the gathered m elements (unscaling in the same pass).
        if f"reduce.{fmt.name}" in cluster.codec_fits:
            owner = cluster.codec_fits[f"reduce.{fmt.name}"].time(m)
        else:
            owner = codec("decode", m) + _accumulate(cluster, m) + codec("encode", m / p)
        per_codec = codec("encode", m) + owner + codec("decode", m)
        collective = _exchange(cluster, m * w, k)
    codec_s = k * per_codec
    overlap = min(codec_s, collective) * (1.0 - 1.0 / k)
    if cluster.cores_per_rank is not None and cluster.cores_per_rank < 1:
        # Measured on the emulated cluster (4 ranks, 2 cores): the step took
        # longer than codec plus wire run back to back; a rank's codec and the
        # kernel's network stack compete for the same cores.
        overlap = 0.0
    return CommBreakdown(
        fmt.name, fmt.strategy, collective, maxima, head + codec_s, sent, overlap, k
    )


def _hook_call(cluster: Cluster, fmt: FormatSpec) -> OpCost | None:
    """The calibrated whole call of a tiny bucket through ``fmt``'s hook, if any.

    Only for the path that was timed: the format's own strategy (``hook_call.fp16``
    is torch's ``fp16_compress_hook``, ``hook_call.e4m3`` the two_phase APS hook).
    """
    call = cluster.codec_fits.get(f"hook_call.{fmt.name}")
    default = FORMATS.get(fmt.name)
    if (
        call is None
        or default is None
        or (fmt.strategy, fmt.aps) != (default.strategy, default.aps)
    ):
        return None
    return call


def bucket_comm(
    n_elem: int,
    n_layers: int,
    fmt: FormatSpec,
    cluster: Cluster,
    chunk_elements: int | str | None = "auto",
) -> CommBreakdown:
    """Time to reduce one bucket of ``n_elem`` FP32 gradients made of ``n_layers`` tensors.

    The parts (collectives, maxima, codec passes) come from the cluster's
    links and fits. Where the cluster is a calibrated profile that timed the
    format's hook whole on a tiny bucket (``hook_call.<fmt>``), the bucket's
    fixed cost is that measured call rather than the sum of the parts'
    latencies: ``overhead_s`` = call - parts(tiny bucket), negative where the
    parts, each timed alone after idling, pay a wake-up the hook pays once.

    Args:
        n_elem: gradient elements in the bucket.
        n_layers: parameter tensors in the bucket (APS sends one maximum each).
        fmt: wire format and strategy.
        cluster: links, device and any calibrated fits.
        chunk_elements: APS pipelines the bucket in chunks of this many
            elements ("auto": as the hook sizes them, from the bucket's
            exchange time; None: one chunk, no pipelining). The FP32 and FP16
            paths (torch's hooks) never chunk.

    Returns:
        The breakdown; all zero on a single rank, where nothing is communicated.
    """
    parts = _bucket_parts(n_elem, n_layers, fmt, cluster, chunk_elements)
    call = _hook_call(cluster, fmt)
    if call is None or parts.total_s == 0.0:
        return parts
    tiny = _bucket_parts(CALL_ELEMENTS, n_layers, fmt, cluster, chunk_elements).total_s
    return replace(parts, overhead_s=call.launch_s - tiny)
