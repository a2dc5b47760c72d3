"""Alpha-beta-gamma cost formulas for the collectives gradient reduction uses.

Every formula takes ``n``, the number of bytes each rank contributes (the full
vector for all-reduce, the whole send buffer for all-to-all, the whole output
for all-gather), the number of ranks ``p`` and a :class:`LinkParams`:

- ``alpha``: seconds of latency per message (per algorithm step),
- ``beta``: seconds per byte sent over the link (1 / bandwidth),
- ``gamma``: seconds per byte of local reduction (the add in reduce steps),
- ``burst_bytes``: bytes a rank may send at the start of a collective call
  before ``beta`` applies (a token-bucket shaper such as Linux ``tc tbf``
  passes its bucket unshaped), so the bandwidth term of a call sending ``w``
  bytes per rank is ``beta * max(0, w - burst_bytes)``. 0 for real links.

Hierarchical variants split ``p = nodes * gpus_per_node`` and use separate
links inside and between nodes; the ``gpus_per_node`` devices of a node share
the node's network bandwidth, which is how multi-rail DGX-style nodes are sold
("8 x 400 Gbit/s per node").

References: Thakur, Rabenseifner, Gropp, "Optimization of Collective
Communication Operations in MPICH" (IJHPCA 2005) for ring, recursive doubling
and halving-doubling; Sanders et al. for the two-level schemes.

Example:
    >>> link = LinkParams(alpha=10e-6, beta=1 / 12.5e9, gamma=0.0)
    >>> round(ring_allreduce(100e6, 8, link) * 1e3, 3)
    14.14
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "LinkParams",
    "Topology",
    "all_gather",
    "all_to_all",
    "allreduce",
    "halving_doubling_allreduce",
    "hierarchical_all_gather",
    "hierarchical_all_to_all",
    "hierarchical_allreduce",
    "hierarchical_reduce_scatter",
    "hierarchical_two_phase",
    "recursive_doubling_allreduce",
    "reduce_scatter",
    "ring_allreduce",
    "two_phase_reduction",
]


@dataclass(frozen=True)
class LinkParams:
    """Cost parameters of one kind of link.

    Attributes:
        alpha: latency per message in seconds.
        beta: seconds per byte on the wire (inverse bandwidth).
        gamma: seconds per byte of local reduction.
        burst_bytes: bytes per rank and collective call that cross the link
            before ``beta`` applies (a token bucket's burst; 0 if none).

    Example:
        >>> LinkParams.from_bandwidth(12.5e9, latency_s=10e-6).beta
        8e-11
        >>> round(LinkParams(0.0, 1e-9, burst_bytes=500.0).wire_time(1500.0), 15)  # 1000 bytes
        1e-06
    """

    alpha: float
    beta: float
    gamma: float = 0.0
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        if min(self.alpha, self.beta, self.gamma, self.burst_bytes) < 0:
            raise ValueError(f"link parameters must be non-negative: {self}")

    def wire_time(self, nbytes: float) -> float:
        """Seconds the link's bandwidth term charges for ``nbytes`` sent in one call.

        ``beta * max(0, nbytes - burst_bytes)``: the first ``burst_bytes`` pass
        at no bandwidth cost (the bucket of a token-bucket shaper).
        """
        return self.beta * max(0.0, nbytes - self.burst_bytes)

    @classmethod
    def from_bandwidth(
        cls, bytes_per_s: float, latency_s: float, reduce_bytes_per_s: float = math.inf
    ) -> LinkParams:
        """Build from a bandwidth in bytes/s, a latency and a local reduction rate."""
        if bytes_per_s <= 0:
            raise ValueError("bandwidth must be positive")
        gamma = 0.0 if math.isinf(reduce_bytes_per_s) else 1.0 / reduce_bytes_per_s
        return cls(alpha=latency_s, beta=1.0 / bytes_per_s, gamma=gamma)

    @property
    def bandwidth(self) -> float:
        """Link bandwidth in bytes per second (inf when beta is 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def shared_by(self, flows: int) -> LinkParams:
        """The link as seen by each of ``flows`` concurrent flows sharing its bandwidth.

        Latency and local reduction are per flow and do not change; the
        flows split the burst.
        """
        return LinkParams(self.alpha, self.beta * flows, self.gamma, self.burst_bytes / flows)


@dataclass(frozen=True)
class Topology:
    """Nodes of identical devices: one link inside a node, another between nodes.

    Attributes:
        nodes: number of nodes.
        gpus_per_node: devices (ranks) per node.
        intra: link between devices of one node (per device).
        inter: link between nodes (per node; its devices share it).

    Example:
        >>> t = Topology(2, 8, LinkParams(3e-6, 1 / 450e9), LinkParams(5e-6, 1 / 400e9))
        >>> t.world_size
        16
    """

    nodes: int
    gpus_per_node: int
    intra: LinkParams
    inter: LinkParams

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"nodes and gpus_per_node must be >= 1: {self}")

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nodes * self.gpus_per_node


def _check(n: float, p: int) -> None:
    if n < 0:
        raise ValueError(f"message size must be non-negative, got {n}")
    if p < 1:
        raise ValueError(f"number of ranks must be >= 1, got {p}")


def ring_allreduce(n: float, p: int, link: LinkParams) -> float:
    """Ring all-reduce: reduce-scatter then all-gather around a ring.

    ``2(p-1) alpha + 2 n (p-1)/p beta + n (p-1)/p gamma`` (the bandwidth term
    through :meth:`LinkParams.wire_time`, so less any burst).

    Example:
        >>> ring_allreduce(4.0, 2, LinkParams(1.0, 1.0, 1.0))
        8.0
    """
    _check(n, p)
    if p == 1:
        return 0.0
    frac = (p - 1) / p
    return 2 * (p - 1) * link.alpha + link.wire_time(2 * n * frac) + n * frac * link.gamma


def halving_doubling_allreduce(n: float, p: int, link: LinkParams) -> float:
    """Rabenseifner's recursive halving (reduce-scatter) + doubling (all-gather).

    ``2 ceil(log2 p) alpha + 2 n (p-1)/p beta + n (p-1)/p gamma``. For ``p`` not
    a power of two the ceiling stands for the extra fold-in step.

    Example:
        >>> halving_doubling_allreduce(4.0, 4, LinkParams(1.0, 1.0, 0.0))
        10.0
    """
    _check(n, p)
    if p == 1:
        return 0.0
    frac = (p - 1) / p
    steps = math.ceil(math.log2(p))
    return 2 * steps * link.alpha + link.wire_time(2 * n * frac) + n * frac * link.gamma


def recursive_doubling_allreduce(n: float, p: int, link: LinkParams) -> float:
    """Recursive doubling (butterfly) all-reduce: full vector at every step.

    ``ceil(log2 p) (alpha + n beta + n gamma)``; latency-optimal, so it is what
    tree-style algorithms cost for tiny messages such as the APS maxima.

    Example:
        >>> recursive_doubling_allreduce(4.0, 4, LinkParams(1.0, 1.0, 0.0))
        10.0
    """
    _check(n, p)
    if p == 1:
        return 0.0
    steps = math.ceil(math.log2(p))
    return steps * (link.alpha + n * link.gamma) + link.wire_time(steps * n)


ALLREDUCE_ALGORITHMS = {
    "ring": ring_allreduce,
    "halving_doubling": halving_doubling_allreduce,
    "recursive_doubling": recursive_doubling_allreduce,
}


def allreduce(n: float, p: int, link: LinkParams, algorithm: str = "ring") -> float:
    """All-reduce with a named algorithm, or ``"auto"`` for the cheapest one.

    Example:
        >>> allreduce(4.0, 4, LinkParams(1.0, 1.0, 0.0), "auto")
        10.0
    """
    if algorithm == "auto":
        return min(fn(n, p, link) for fn in ALLREDUCE_ALGORITHMS.values())
    try:
        return ALLREDUCE_ALGORITHMS[algorithm](n, p, link)
    except KeyError:
        raise ValueError(
            f"unknown all-reduce algorithm {algorithm!r}; "
            f"choose from {[*ALLREDUCE_ALGORITHMS, 'auto']}"
        ) from None


def reduce_scatter(n: float, p: int, link: LinkParams) -> float:
    """Ring reduce-scatter of an ``n``-byte vector: ``(p-1)(alpha) + n(p-1)/p (beta + gamma)``.

    Example:
        >>> reduce_scatter(4.0, 2, LinkParams(1.0, 1.0, 1.0))
        5.0
    """
    _check(n, p)
    if p == 1:
        return 0.0
    frac = (p - 1) / p
    return (p - 1) * link.alpha + link.wire_time(n * frac) + n * frac * link.gamma


def all_gather(n: float, p: int, link: LinkParams) -> float:
    """Ring all-gather producing an ``n``-byte output: ``(p-1) alpha + n (p-1)/p beta``.

    Example:
        >>> all_gather(4.0, 2, LinkParams(1.0, 1.0, 1.0))
        3.0
    """
    _check(n, p)
    if p == 1:
        return 0.0
    return (p - 1) * link.alpha + link.wire_time(n * (p - 1) / p)


def all_to_all(n: float, p: int, link: LinkParams) -> float:
    """Pairwise-exchange all-to-all of an ``n``-byte send buffer.

    Each rank keeps ``n/p`` and sends ``n/p`` to each of the ``p-1`` others in
    ``p-1`` steps: ``(p-1) alpha + n (p-1)/p beta``.

    Example:
        >>> all_to_all(4.0, 4, LinkParams(1.0, 1.0))
        6.0
    """
    _check(n, p)
    if p == 1:
        return 0.0
    return (p - 1) * link.alpha + link.wire_time(n * (p - 1) / p)


def two_phase_reduction(n_wire: float, n_accumulate: float, p: int, link: LinkParams) -> float:
    """All-to-all of shards, local reduction on the shard owner, all-gather.

    ``n_wire`` is the encoded payload in bytes (what crosses the wire) and
    ``n_accumulate`` the bytes the owner reduces (FP32 decoded values), so
    ``2(p-1) alpha + 2 n_wire (p-1)/p beta + n_accumulate (p-1)/p gamma``.

    Example:
        >>> two_phase_reduction(1.0, 4.0, 2, LinkParams(1.0, 1.0, 1.0))
        5.0
    """
    _check(n_accumulate, p)
    if p == 1:
        return 0.0
    return (
        all_to_all(n_wire, p, link)
        + all_gather(n_wire, p, link)
        + n_accumulate * (p - 1) / p * link.gamma
    )


def hierarchical_allreduce(n: float, topo: Topology, algorithm: str = "ring") -> float:
    """Two-level all-reduce: reduce-scatter in the node, all-reduce across nodes, all-gather.

    Each of the ``g`` devices of a node all-reduces its ``n/g`` shard with its
    peers on the other nodes, all ``g`` flows sharing the node's link. With one
    node or one device per node this is the flat algorithm on that link.

    Example:
        >>> t = Topology(1, 4, LinkParams(1.0, 1.0), LinkParams(9.0, 9.0))
        >>> hierarchical_allreduce(4.0, t) == ring_allreduce(4.0, 4, t.intra)
        True
    """
    g, m = topo.gpus_per_node, topo.nodes
    if m == 1:
        return allreduce(n, g, topo.intra, algorithm)
    if g == 1:
        return allreduce(n, m, topo.inter, algorithm)
    return (
        reduce_scatter(n, g, topo.intra)
        + allreduce(n / g, m, topo.inter.shared_by(g), algorithm)
        + all_gather(n, g, topo.intra)
    )


def hierarchical_reduce_scatter(n: float, topo: Topology) -> float:
    """Reduce-scatter inside the node, then across nodes on each device's shard."""
    g, m = topo.gpus_per_node, topo.nodes
    return reduce_scatter(n, g, topo.intra) + reduce_scatter(n / g, m, topo.inter.shared_by(g))


def hierarchical_all_gather(n: float, topo: Topology) -> float:
    """All-gather across nodes of each device's part, then inside the node."""
    g, m = topo.gpus_per_node, topo.nodes
    return all_gather(n / g, m, topo.inter.shared_by(g)) + all_gather(n, g, topo.intra)


def hierarchical_all_to_all(n: float, topo: Topology) -> float:
    """Pairwise all-to-all where ``g-1`` peers are in the node and ``p-g`` are not.

    The ``g`` devices of a node send their off-node traffic through the shared
    node link at the same time, so that part is charged at the node's bandwidth.

    Example:
        >>> t = Topology(4, 1, LinkParams(0.0, 0.0), LinkParams(1.0, 1.0))
        >>> hierarchical_all_to_all(4.0, t) == all_to_all(4.0, 4, t.inter)
        True
    """
    _check(n, topo.world_size)
    g, p = topo.gpus_per_node, topo.world_size
    intra = (g - 1) * topo.intra.alpha + topo.intra.wire_time((g - 1) * n / p)
    shared = topo.inter.shared_by(g)
    inter = (p - g) * shared.alpha + shared.wire_time((p - g) * n / p)
    return intra + inter


def hierarchical_two_phase(n_wire: float, n_accumulate: float, topo: Topology) -> float:
    """:func:`two_phase_reduction` on a two-level topology.

    The owner's reduction runs at the intra-node link's ``gamma`` (the device's
    own memory), whatever link the shards arrived on.
    """
    p = topo.world_size
    if p == 1:
        return 0.0
    return (
        hierarchical_all_to_all(n_wire, topo)
        + hierarchical_all_gather(n_wire, topo)
        + n_accumulate
        * (p - 1)
        / p
        * (topo.intra.gamma if topo.gpus_per_node > 1 else topo.inter.gamma)
    )
