"""Communication time of one gradient bucket for each wire format.

Mirrors the data path of the hooks: FP32 all-reduce; cast, low-precision
all-reduce and cast back; or APS two-phase (amax, MAX all-reduce of the L
per-layer maxima, encode, all-to-all, decode + FP32 accumulate on the shard
owner, re-encode, all-gather, decode + unscale).

Example:
    >>> from perfmodel.cluster import get_cluster
    >>> from perfmodel.formats import get_format
    >>> c = get_cluster("1gbe", world_size=4)
    >>> fp32 = bucket_comm(25 * 2**18, 10, get_format("fp32"), c)
    >>> fp8 = bucket_comm(25 * 2**18, 10, get_format("e4m3"), c)
    >>> 3.0 < fp32.total_s / fp8.total_s < 4.0
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from perfmodel.cluster import Cluster
from perfmodel.collectives import (
    LinkParams,
    all_gather,
    all_to_all,
    allreduce,
    hierarchical_all_gather,
    hierarchical_all_to_all,
    hierarchical_allreduce,
)
from perfmodel.formats import FormatSpec

__all__ = ["CommBreakdown", "bucket_comm"]

_FP32_BYTES = 4.0


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

    @property
    def total_s(self) -> float:
        """Seconds from the bucket's start to its reduced gradients being usable."""
        return self.collective_s + self.maxima_s + self.codec_s


def _allreduce(cluster: Cluster, nbytes: float, key: str, algorithm: str) -> float:
    fit = cluster.collective_fits.get(key)
    if fit is not None:
        return allreduce(nbytes, cluster.world_size, fit, algorithm)
    return hierarchical_allreduce(nbytes, cluster.topology, algorithm)


def _all_to_all(cluster: Cluster, nbytes: float) -> float:
    fit = cluster.collective_fits.get("all_to_all")
    if fit is not None:
        return all_to_all(nbytes, cluster.world_size, fit)
    return hierarchical_all_to_all(nbytes, cluster.topology)


def _all_gather(cluster: Cluster, nbytes: float) -> float:
    fit = cluster.collective_fits.get("all_gather")
    if fit is not None:
        return all_gather(nbytes, cluster.world_size, fit)
    return hierarchical_all_gather(nbytes, cluster.topology)


def _reduce_link(cluster: Cluster) -> LinkParams:
    topo = cluster.topology
    return topo.intra if topo.gpus_per_node > 1 else topo.inter


def _accumulate(cluster: Cluster, n_elem: float) -> float:
    """FP32 sum of the p decoded shards on their owner (n elements in, n/p out)."""
    p = cluster.world_size
    if "accumulate" in cluster.codec_fits:
        return cluster.codec_fits["accumulate"].time(n_elem)
    return n_elem * _FP32_BYTES * (p - 1) / p * _reduce_link(cluster).gamma


def bucket_comm(n_elem: int, n_layers: int, fmt: FormatSpec, cluster: Cluster) -> CommBreakdown:
    """Time to reduce one bucket of ``n_elem`` FP32 gradients made of ``n_layers`` tensors.

    Args:
        n_elem: gradient elements in the bucket.
        n_layers: parameter tensors in the bucket (APS sends one maximum each).
        fmt: wire format and strategy.
        cluster: links, device and any calibrated fits.

    Returns:
        The breakdown; all zero on a single rank, where nothing is communicated.
    """
    p = cluster.world_size
    if p == 1 or n_elem == 0:
        return CommBreakdown(fmt.name, fmt.strategy, 0.0, 0.0, 0.0, 0.0)
    w = fmt.wire_bytes
    wire = n_elem * w

    def codec(op: str, n: float) -> float:
        return cluster.codec_time(op, fmt.name, w, n)

    maxima = 0.0
    codec_s = 0.0
    if fmt.aps:
        # amax pass, then a latency-bound all-reduce of L float32 maxima; the
        # scale/unscale passes are free on devices that fuse them into the codec.
        codec_s += codec("amax", n_elem) + codec("scale", n_elem) + codec("unscale", n_elem)
        maxima = _allreduce(cluster, n_layers * _FP32_BYTES, "all_reduce_max", "auto")

    if fmt.strategy == "native":
        collective = _allreduce(cluster, wire, f"all_reduce.{fmt.torch_dtype}", cluster.algorithm)
        sent = 2 * wire * (p - 1) / p
    elif fmt.strategy == "allreduce":
        codec_s += codec("encode", n_elem) + codec("decode", n_elem)
        collective = _allreduce(cluster, wire, f"all_reduce.{fmt.torch_dtype}", cluster.algorithm)
        sent = 2 * wire * (p - 1) / p
    else:
        # Owner decodes p shards (n elements), sums them in FP32, re-encodes n/p;
        # everyone decodes the gathered n elements (and unscales, counted above).
        codec_s += codec("encode", n_elem) + codec("decode", n_elem) + _accumulate(cluster, n_elem)
        codec_s += codec("encode", n_elem / p) + codec("decode", n_elem)
        collective = _all_to_all(cluster, wire) + _all_gather(cluster, wire)
        sent = 2 * wire * (p - 1) / p
    return CommBreakdown(fmt.name, fmt.strategy, collective, maxima, codec_s, sent)
