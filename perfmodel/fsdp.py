"""FSDP2 step time: parameter all-gathers and the gradient reduce-scatter per unit.

An FSDP2 model is a sequence of units (each ``fully_shard``-ed module's
parameters). Per unit and step, FSDP all-gathers the parameters for forward
(and again for backward when it reshards after forward) and reduce-scatters
the gradients after backward. Three ways to reduce-scatter are modelled:

- FSDP's own, in ``reduce_dtype`` (``"fp32"``, ``"bf16"``, ``"fp16"``): a ring
  reduce-scatter of ``n * w`` bytes on NCCL; on Gloo, which has no native
  reduce-scatter, PyTorch runs an all-reduce of the whole input and keeps a
  shard, so twice the traffic (``backend="gloo"``).
- APS (:mod:`aps_comm.fsdp`, any format with ``aps=True``, e.g. ``"e4m3"``):
  an amax pass over the unit's gradients, a MAX all-reduce of one float per
  parameter (plus one), encode, one ``all_to_all`` of ``n * w`` bytes (the
  padded input, ``w`` bytes per element), then the owner decodes the N rows it
  received (``n`` elements in all), sums them in FP32 and writes ``n / N``.
  No all-gather and no chunk pipelining. With block scaling every row's
  chunk of every parameter is cut into blocks, and the MAX all-reduce
  carries one exponent byte per block (plus one) instead.

Across nodes the two differ in kind, not only in bytes per element. FSDP's
reduce-scatter is priced node-aware (:func:`hierarchical_reduce_scatter`):
the node sums first, and each of its ``g`` devices sends a ``1/g`` shard
across. Gloo is not node-aware: its all-reduce and all-gather are one ring
over the node-major ranks, the node's last rank sending each step's chunk
across, so flat FSDP on Gloo sends ``2 (N - 1) / N / g`` of the
reduce-scatter's input and ``(N - 1) / N / g`` of each all-gather's output
across per rank (2 nodes x 2 ranks: 3/8 and 3/16, where node-aware sends
1/4 and 1/8), at the node link's rate, one flow on it. APS's all-to-all sends every rank's unreduced rows for the other
nodes' ranks, ``g`` times as many elements. Where ``g`` devices share one
node link, APS sends ``g * w / w_native`` times FSDP's bytes across it:
with e4m3 against FP32, fewer only below 4 devices per node link (8 A100s
behind one 100 Gbit/s NIC: twice FP32's bytes, and slower); with one device
per node link, a quarter.

On CPU FSDP calls the reduce-scatter synchronously in the post-backward hook,
so nothing overlaps: the step is compute plus every all-gather and every
reduce-scatter (``overlap=False``, the default). With ``overlap=True`` (CUDA
streams) the reduce-scatters run beside the rest of backward as DDP buckets
do, and only what outlasts backward is exposed. ``aps_comm.fsdp``'s HSDP
all-reduce across replicas runs on a worker thread on CPU tensors: with
``replicas_beside_backward=True`` the reduce-scatters block and each unit's
replica all-reduce runs beside the rest of backward
(:func:`replicas_exposed_s`).

HSDP (``replicate=R``, :func:`fsdp_step`): the world is R replicas of S =
world / R shard ranks, a shard group being S consecutive ranks of one node
(S divides the ranks per node). The all-gathers and the reduce-scatter run
among the S ranks on the intra-node link; then the S ranks of a shard group
each all-reduce their shard of the unit (``numel / S`` elements) with the
R - 1 ranks holding the same shard, through the node's link, which the
node's ranks share. That all-reduce is priced as a DDP bucket of the shard
(:mod:`aps_perfmodel.strategies`): FP32 or BF16 as native HSDP's all-reduce
in ``reduce_dtype`` (the collective alone: the reduce-scatter's output is
already in that dtype and no hook runs), an APS format as the hook's
two_phase (:func:`~aps_perfmodel.comm.bucket_comm`: a MAX all-reduce of the
maxima, an all-to-all and an all-gather of encoded shards, block exponents
as DDP's block route sends them). The reduce-scatter of an APS row stays
FSDP's own in FP32 unless ``reduce_scatter=True``, as
``aps_comm.fsdp.register``'s ``reduce_scatter=``. Each of HSDP's groups is
priced from the topology's links, not from a calibrated profile's
per-collective fits (measured on the whole world's groups).

Example:
    >>> from aps_perfmodel.cluster import custom_cluster
    >>> c = custom_cluster(125e6, 50e-6, nodes=4, device="cpu")
    >>> units = [FSDPUnit(2**22, 2)] * 4
    >>> fp32 = fsdp_step(units, "fp32", c, backend="gloo")
    >>> e4m3 = fsdp_step(units, "e4m3", c, backend="gloo")
    >>> 6.0 < fp32.reduce_scatter_s / e4m3.reduce_scatter_s < 8.0
    True
    >>> hsdp = custom_cluster(125e6, 50e-6, nodes=2, gpus_per_node=2, device="cpu")
    >>> fp32 = fsdp_step(units, "fp32", hsdp, backend="gloo", replicate=2)
    >>> e4m3 = fsdp_step(units, "e4m3", hsdp, backend="gloo", replicate=2)
    >>> e4m3.cross_node_bytes / fp32.cross_node_bytes
    0.25
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .choices import BlockExponents
from .cluster import Cluster
from .collectives import (
    LinkParams,
    Topology,
    all_gather,
    all_to_all,
    allreduce,
    hierarchical_all_gather,
    hierarchical_all_to_all,
    hierarchical_allreduce,
    hierarchical_reduce_scatter,
    reduce_scatter,
)
from .comm import bucket_comm
from .formats import FormatSpec, get_format
from .strategies import CommBreakdown, bucket_breakdown

__all__ = [
    "BACKENDS",
    "FSDPStepPrediction",
    "FSDPUnit",
    "UnitTiming",
    "fsdp_step",
    "padded_numel",
    "reduce_scatter_time",
    "replicas_exposed_s",
    "shard_group_size",
]

BACKENDS = ("nccl", "gloo")
# register(..., reduction=)'s ways across replicas, as the model names them
# ("native" is "allreduce"; "auto" the hook's per-bucket choice).
_REPLICA_STRATEGIES = ("two_phase", "native", "auto")
_FP32_BYTES = 4.0
_TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class FSDPUnit:
    """One ``fully_shard``-ed module's trainable parameters.

    Attributes:
        numel: elements of the reduce-scatter input: every parameter with
            dim 0 padded to a multiple of the world size (:func:`padded_numel`).
        n_params: parameter tensors (APS sends one maximum each).
        param_numels: each parameter's padded elements, where known: block
            scaling then counts its blocks exactly (:meth:`blocks`).

    Example:
        >>> FSDPUnit(1024, 2).numel
        1024
    """

    numel: int
    n_params: int
    param_numels: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.numel < 0 or self.n_params < 0:
            raise ValueError(f"numel and n_params must be >= 0: {self}")
        if self.param_numels and (
            len(self.param_numels) != self.n_params or sum(self.param_numels) != self.numel
        ):
            raise ValueError(f"param_numels must be n_params sizes summing to numel: {self}")

    def blocks(self, fmt: FormatSpec, world_size: int) -> int:
        """Block exponents of this unit: blocks of every rank's row chunk of every parameter.

        Each parameter's padded input is N rows (one per rank) of
        ``numel / N`` elements, each cut into blocks (the last may be short);
        without :attr:`param_numels`, the most blocks the unit can make. 0
        without block scaling.

        Example:
            >>> e4m3 = get_format("e4m3", scaling="block")
            >>> FSDPUnit(256, 2, (192, 64)).blocks(e4m3, 4), FSDPUnit(256, 2).blocks(e4m3, 4)
            (12, 15)
        """
        if not fmt.block_scaled:
            return 0
        if self.param_numels:
            rows = [n // world_size for n in self.param_numels]
            return world_size * fmt.block_count(rows)
        return fmt.block_bound(self.numel, self.n_params * world_size)


def padded_numel(shapes: Sequence[Sequence[int]], world_size: int) -> int:
    """Elements of FSDP's reduce-scatter input for parameters of these shapes.

    FSDP pads every parameter's dim 0 to a multiple of the world size.

    Example:
        >>> padded_numel([(5, 3), (7,)], 4)
        32
    """
    total = 0
    for shape in shapes:
        if not shape:
            total += world_size
            continue
        rest = 1
        for d in shape[1:]:
            rest *= d
        total += -(-shape[0] // world_size) * world_size * rest
    return total


@dataclass(frozen=True)
class UnitTiming:
    """Where one unit's reduce-scatter time goes, on one rank.

    Attributes:
        collective_s: the data collective (reduce-scatter, all-reduce or all-to-all).
        maxima_s: APS's MAX all-reduce of the maxima (0 otherwise).
        codec_s: APS's local passes: amax, encode, decode, FP32 sum (0 otherwise).
        wire_bytes: bytes this rank sends over the network for the data
            (with block scaling, the exponents' MAX all-reduce too).
        exponent_bytes: the part of ``wire_bytes`` that is block exponents.
        inter_node_bytes: the part of ``wire_bytes`` that leaves the node
            (the data only: the maxima are a few bytes).

    Example:
        >>> UnitTiming(1.0, 0.1, 0.2, 8.0).total_s
        1.3
    """

    collective_s: float
    maxima_s: float
    codec_s: float
    wire_bytes: float
    exponent_bytes: float = 0.0
    inter_node_bytes: float = 0.0

    @property
    def total_s(self) -> float:
        return self.collective_s + self.maxima_s + self.codec_s


@dataclass(frozen=True)
class FSDPStepPrediction:
    """One FSDP2 step's prediction.

    Attributes:
        format: the reduce-scatter's format ("fp32", "bf16", "e4m3", ...).
        aps: whether APS is modelled: the reduce-scatter, or HSDP's replica all-reduce.
        compute_s: forward + backward + optimizer, as given.
        all_gather_s: every parameter all-gather of the step.
        reduce_scatter_s: every unit's reduce-scatter.
        exposed_s: the part of the reduce-scatters on the step's critical path.
        step_s: ``compute_s + all_gather_s + exposed_s``.
        units: per unit, its reduce-scatter's :class:`UnitTiming`.
        wire_bytes: bytes one rank sends for the gradients: the
            reduce-scatters and, with HSDP, the replica all-reduces.
        exponent_bytes: the part of ``wire_bytes`` that is block exponents.
        inter_node_bytes: the part of ``wire_bytes`` that leaves the node.
        replicate: HSDP's replicas R (1: flat FSDP over the whole world).
        all_reduce_s: every unit's replica all-reduce (HSDP; 0 otherwise),
            included in ``exposed_s`` as the reduce-scatters are.
        replicas: per unit, its replica all-reduce as a DDP bucket's
            :class:`~aps_perfmodel.strategies.CommBreakdown` (HSDP; empty otherwise).
        cross_node_bytes: bytes one rank sends across nodes per step: the
            gradients' ``inter_node_bytes`` and the parameter all-gathers'
            (as the model prices them: node-aware, or on Gloo one ring over
            all ranks); 0 on one node.
        reduce_scatter_format: the reduce-scatter's format: ``format`` where
            APS reduce-scatters, else FSDP's own ``reduce_dtype`` (an APS
            HSDP row's is "fp32" unless ``reduce_scatter=True``).

    Example:
        >>> p = FSDPStepPrediction("e4m3", True, 0.0, 0.0, 1.0, 1.0, 1.0, (), 8.0)
        >>> p.step_s, p.gradient_s
        (1.0, 1.0)
    """

    format: str
    aps: bool
    compute_s: float
    all_gather_s: float
    reduce_scatter_s: float
    exposed_s: float
    step_s: float
    units: tuple[UnitTiming, ...]
    wire_bytes: float
    exponent_bytes: float = 0.0
    inter_node_bytes: float = 0.0
    replicate: int = 1
    all_reduce_s: float = 0.0
    replicas: tuple[CommBreakdown, ...] = ()
    cross_node_bytes: float = 0.0
    reduce_scatter_format: str = ""

    @property
    def gradient_s(self) -> float:
        """Every reduce-scatter and replica all-reduce of the step, overlapped or not."""
        return self.reduce_scatter_s + self.all_reduce_s


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _flat(cluster: Cluster, key: str) -> LinkParams | None:
    """A calibrated flat fit for ``key`` where the cluster has one."""
    return cluster.collective_fits.get(key)


def _gloo_ring(cluster: Cluster, backend: str) -> LinkParams | None:
    """The link a Gloo ring over the cluster's ranks runs at, where it spans nodes of several ranks.

    Gloo is not node-aware: its all-reduce (FSDP's reduce-scatter there) and
    all-gather are one ring over the node-major ranks, each step every rank
    passing a chunk to the next; one rank per node sends over the node's
    link (one flow, not shared), the others in the node, and a step waits for
    the slower. None where the node-aware price holds (NCCL, one node, one
    rank per node) or a calibrated fit prices the collective.
    """
    topo = cluster.topology
    if backend != "gloo" or cluster.collective_fits or topo.nodes == 1 or topo.gpus_per_node == 1:
        return None
    intra, inter = topo.intra, topo.inter
    return replace(
        inter if inter.beta >= intra.beta else intra,
        alpha=max(intra.alpha, inter.alpha),
        gamma=intra.gamma,
    )


def _ring_share(cluster: Cluster, backend: str) -> float:
    """The part of a ring collective's bytes per rank that leaves the node.

    Gloo's one ring over node-major ranks: one rank in L sends to the next
    node. Node-aware (NCCL): each of a node's L ranks sends its ``1 / L``
    part to the other nodes, ``(M - 1) / M`` of it across.
    """
    g, m = cluster.topology.gpus_per_node, cluster.topology.nodes
    if m == 1:
        return 0.0
    if _gloo_ring(cluster, backend) is not None:
        return 1.0 / g
    return (m - 1) / m / g * cluster.world_size / (cluster.world_size - 1)


def _allreduce(
    cluster: Cluster, nbytes: float, key: str, algorithm: str, backend: str = "nccl"
) -> float:
    fit = _flat(cluster, key)
    if fit is not None:
        return allreduce(nbytes, cluster.world_size, fit, algorithm)
    ring = _gloo_ring(cluster, backend)
    if ring is not None:
        return allreduce(nbytes, cluster.world_size, ring, algorithm)
    return hierarchical_allreduce(nbytes, cluster.topology, algorithm)


def _all_to_all(cluster: Cluster, nbytes: float) -> float:
    fit = _flat(cluster, "all_to_all")
    if fit is not None:
        return all_to_all(nbytes, cluster.world_size, fit)
    return hierarchical_all_to_all(nbytes, cluster.topology)


def _all_gather(cluster: Cluster, nbytes: float, backend: str = "nccl") -> float:
    fit = _flat(cluster, "all_gather")
    if fit is not None:
        return all_gather(nbytes, cluster.world_size, fit)
    ring = _gloo_ring(cluster, backend)
    if ring is not None:
        return all_gather(nbytes, cluster.world_size, ring)
    return hierarchical_all_gather(nbytes, cluster.topology)


def _native(fmt: FormatSpec) -> bool:
    """FSDP's own reduce-scatter in a reduce dtype, not the APS one."""
    return not fmt.aps and fmt.name in _TORCH_DTYPE


def _check_format(fmt: FormatSpec) -> None:
    if not _native(fmt) and not fmt.aps:
        raise ValueError(
            f"format {fmt.name!r} without APS has no FSDP reduce-scatter here; use "
            "fp32/bf16/fp16 (FSDP's own) or an APS format"
        )


def reduce_scatter_time(
    unit: FSDPUnit, fmt: FormatSpec | str, cluster: Cluster, backend: str = "nccl"
) -> UnitTiming:
    """Time of one unit's gradient reduce-scatter on one rank.

    Args:
        unit: the unit's padded element count and parameter count.
        fmt: "fp32"/"bf16"/"fp16" (FSDP's own reduce-scatter in that
            ``reduce_dtype``) or an APS format ("e4m3", "e5m2", ...; or any
            :class:`~aps_perfmodel.formats.FormatSpec` with ``aps=True``).
        cluster: links, device and calibrated fits.
        backend: "nccl" (native reduce-scatter) or "gloo" (FSDP's own
            reduce-scatter is an all-reduce of the whole input there).

    Returns:
        The :class:`UnitTiming`; all zero on one rank (FSDP copies, nothing is sent).

    Example:
        >>> from aps_perfmodel.cluster import custom_cluster
        >>> c = custom_cluster(125e6, 0.0, nodes=2, device="cpu")
        >>> round(reduce_scatter_time(FSDPUnit(2**20, 1), "fp32", c).wire_bytes)
        2097152
    """
    _check_backend(backend)
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    p, n = cluster.world_size, float(unit.numel)
    if p == 1 or n == 0:
        return UnitTiming(0.0, 0.0, 0.0, 0.0)
    w = fmt.wire_bytes
    frac = (p - 1) / p
    g, m = cluster.topology.gpus_per_node, cluster.topology.nodes
    # The share of a rank's peers on other nodes: what leaves the node of a
    # node-aware collective's shard, and of an all-to-all's rows.
    away = (m - 1) / m
    if _native(fmt):
        key = f"all_reduce.{_TORCH_DTYPE[fmt.name]}"
        # Node-aware (hierarchical_*): the node reduces first, and each of its
        # g ranks sends its n/g shard across; Gloo: one flat ring (_gloo_ring).
        if backend == "gloo":
            collective = _allreduce(cluster, n * w, key, cluster.algorithm, backend)
            sent = 2 * n * w * frac
            return UnitTiming(collective, 0.0, 0.0, sent, 0.0, sent * _ring_share(cluster, backend))
        fit = _flat(cluster, "reduce_scatter")
        collective = (
            reduce_scatter(n * w, p, fit)
            if fit is not None
            else hierarchical_reduce_scatter(n * w, cluster.topology)
        )
        return UnitTiming(collective, 0.0, 0.0, n * w * frac, 0.0, n * w / g * away)
    _check_format(fmt)

    block = fmt.block_size if fmt.block_scaled else None

    def codec(op: str, elems: float) -> float:
        return cluster.codec_time(op, fmt.name, w, elems, block)

    exponents = 0.0
    if fmt.block_scaled:
        # One byte per block, and one for the unit's flag, in one MAX all-reduce.
        blocks = unit.blocks(fmt, p)
        maxima = _allreduce(cluster, blocks + 1.0, "all_reduce_max", "auto")
        exponents = 2.0 * blocks * frac
    else:
        maxima = _allreduce(cluster, (unit.n_params + 1) * _FP32_BYTES, "all_reduce_max", "auto")
    # amax and encode read the whole input; the owner decodes the N rows it
    # received (n elements in all), sums them and writes its n / N shard.
    codec_s = codec("amax", n) + codec("encode", n) + codec("decode", n)
    if "accumulate" in cluster.pass_costs:
        codec_s += cluster.pass_costs["accumulate"].time(n)
    else:
        link = (
            cluster.topology.intra if cluster.topology.gpus_per_node > 1 else cluster.topology.inter
        )
        codec_s += n * _FP32_BYTES * frac * link.gamma
    collective = _all_to_all(cluster, n * w)
    # One flat all-to-all of unreduced rows: every row for a rank on another
    # node leaves this one, g times what a node-aware reduce-scatter sends.
    return UnitTiming(
        collective, maxima, codec_s, n * w * frac + exponents, exponents, n * w * away
    )


def shard_group_size(cluster: Cluster, replicate: int) -> int:
    """HSDP's shard group S = world / ``replicate``, checked to tile the cluster's nodes.

    ``replicate=1`` is flat FSDP: one group of the whole world, across nodes.

    A shard group is S consecutive ranks (``init_device_mesh(dev, (R, S))`` on
    node-major ranks), so it lies within one node when S divides the ranks
    per node; the replicas of a shard are then R ranks, world / (S x nodes)
    of them on each node.

    Raises:
        ValueError: ``replicate`` is below 1 or does not divide the world, or
            its shard groups do not fit the nodes (the message names the values).

    Example:
        >>> from aps_perfmodel.cluster import get_cluster
        >>> shard_group_size(get_cluster("dgx-h100", world_size=32), 4)
        8
    """
    world, per_node = cluster.world_size, cluster.topology.gpus_per_node
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
        raise ValueError(f"replicate must be an int >= 1, got {replicate!r}")
    if world % replicate:
        raise ValueError(f"replicate={replicate} does not divide the world of {world} ranks")
    shard = world // replicate
    if replicate > 1 and per_node % shard:
        raise ValueError(
            f"replicate={replicate} makes shard groups of {shard} ranks (world {world} / "
            f"{replicate}), which must lie within a node: {shard} does not divide the "
            f"{per_node} ranks per node"
        )
    return shard


def _shard_cluster(cluster: Cluster, shard: int) -> Cluster:
    """The S ranks of one shard group: one node of S ranks on the intra-node link.

    Calibrated per-collective fits were measured on the whole world's groups,
    so the groups' collectives are priced from the topology's links.
    """
    topo = cluster.topology
    return replace(
        cluster,
        topology=Topology(1, shard, topo.intra, topo.inter),
        collective_fits={},
    )


def _replica_cluster(cluster: Cluster, shard: int, backend: str) -> Cluster:
    """The R ranks holding one shard: world / (S x nodes) per node, on every node.

    The node's S shard groups all-reduce at once, so each group's flows see
    the node's link shared S ways (and within the group, by its ranks on the node).
    """
    topo = cluster.topology
    return replace(
        cluster,
        topology=Topology(
            topo.nodes, topo.gpus_per_node // shard, topo.intra, topo.inter.shared_by(shard)
        ),
        collective_fits={},
        backend=backend,
    )


def _replica_reduction(
    unit: FSDPUnit, fmt: FormatSpec, shard: int, replicas: Cluster
) -> tuple[CommBreakdown, float]:
    """One unit's replica all-reduce of its shard, and its seconds.

    APS formats: a DDP bucket of the shard's parameters in ``fmt.strategy``
    (two_phase by default), hook costs included
    (:func:`~aps_perfmodel.comm.bucket_comm`), with each rank's own block
    exponents as ``aps_comm.fsdp`` sends them across replicas. FSDP's own
    (fp32/bf16/fp16): the all-reduce alone, in ``reduce_dtype``: the
    reduce-scatter's output is already in it and no hook runs.
    """
    numel = -(-unit.numel // shard)
    if _native(fmt):
        strategy = "fp32" if fmt.name == "fp32" else "native"
        b = bucket_breakdown(numel, unit.n_params, fmt, replicas, strategy)
        return b, b.collective_s
    blocks = None
    if fmt.block_scaled and unit.param_numels:
        blocks = fmt.block_count([-(-n // shard) for n in unit.param_numels])
    spec = replace(fmt, block_exponents=BlockExponents.RANK)
    b = bucket_comm(numel, unit.n_params, spec, replicas, n_blocks=blocks)
    return b, b.total_s


def _gather_across(cluster: Cluster, nbytes: float, backend: str) -> float:
    """Bytes per rank one all-gather of ``nbytes`` sends across nodes.

    Node-aware: each of a node's g ranks all-gathers its ``1 / g`` part among
    the M nodes (:func:`~aps_perfmodel.collectives.hierarchical_all_gather`).
    Gloo: one ring over all ranks, ``(N - 1) / N`` of ``nbytes`` per rank, of
    which the node's last rank's leaves it (:func:`_ring_share`).
    """
    p = cluster.world_size
    return nbytes * (p - 1) / p * _ring_share(cluster, backend)


def replicas_exposed_s(
    backward_s: Sequence[float], reduce_scatter_s: Sequence[float], all_reduce_s: Sequence[float]
) -> float:
    """The replica all-reduces' time past the end of backward, when they run beside it.

    Backward reaches the units last to first; each unit's backward compute
    and then its reduce-scatter block the backward thread, and its
    all-reduce across replicas starts once that reduce-scatter is done and
    the previous unit's all-reduce has finished (one worker, in order). What
    the last all-reduce runs past the last reduce-scatter is exposed: at
    least the first unit's own all-reduce, nothing of the others' where
    backward is long enough.

    Args:
        backward_s: per unit, in model order, its backward compute.
        reduce_scatter_s: per unit, its reduce-scatter.
        all_reduce_s: per unit, its all-reduce across replicas.

    Returns:
        Seconds the step waits for the all-reduces after backward.

    Example:
        >>> round(replicas_exposed_s([0.2, 0.2], [0.0, 0.0], [0.1, 0.1]), 6)  # the first unit's only
        0.1
        >>> round(replicas_exposed_s([0.0, 0.0], [0.0, 0.0], [0.1, 0.1]), 6)  # nothing to hide behind
        0.2
    """
    thread = worker = 0.0
    for b, rs, ar in zip(
        reversed(backward_s), reversed(reduce_scatter_s), reversed(all_reduce_s), strict=True
    ):
        thread += b + rs
        worker = max(worker, thread) + ar
    return max(0.0, worker - thread)


def fsdp_step(
    units: Sequence[FSDPUnit],
    fmt: FormatSpec | str,
    cluster: Cluster,
    *,
    backend: str = "nccl",
    compute_s: float = 0.0,
    param_bytes: float = 4.0,
    reshard_after_forward: bool = True,
    overlap: bool = False,
    backward_s: float = 0.0,
    replicate: int = 1,
    reduce_scatter: bool | None = None,
    replicas_beside_backward: bool = False,
) -> FSDPStepPrediction:
    """One FSDP2 (or HSDP) training step: all-gathers, compute and gradient reductions.

    Args:
        units: the model's FSDP units (with ``replicate``, each parameter
            padded to a multiple of the shard group's S ranks, not the world's).
        fmt: the gradients' format (see :func:`reduce_scatter_time`): with
            ``replicate``, the replica all-reduce's too: "fp32"/"bf16"/"fp16"
            native HSDP in that ``reduce_dtype``; an APS format by its
            ``strategy`` ("two_phase", the default; "native", register's
            ``reduction="allreduce"``; or "auto"), block exponents each rank's
            own as ``aps_comm.fsdp`` sends them.
        cluster: links, device and fits.
        backend: "nccl" or "gloo".
        compute_s: forward + backward + optimizer time of one rank.
        param_bytes: bytes per element of the parameter all-gather
            (``param_dtype``: 4 for FP32, 2 for BF16).
        reshard_after_forward: the parameters are all-gathered again for
            backward (FSDP's default for every unit but the root; here for all).
        overlap: the reduce-scatters (and replica all-reduces) run beside
            backward (CUDA streams); False on CPU, where FSDP runs them synchronously.
        backward_s: with ``overlap`` or ``replicas_beside_backward``, the
            backward time they can hide behind.
        replicate: HSDP's replicas R: each unit is sharded over S = world / R
            ranks of a node (S must divide the ranks per node,
            :func:`shard_group_size`), whose all-gathers and reduce-scatter use
            the intra-node link, and each shard is all-reduced among its R
            replicas across nodes. 1: flat FSDP over the whole world.
            Calibrated per-collective fits are not used for HSDP's groups.
        reduce_scatter: APS reduce-scatters an APS format: None (default) where
            not replicated, FSDP's own in FP32 where replicated; True/False
            force it (as ``aps_comm.fsdp.register``'s ``reduce_scatter=``).
            fp32/bf16/fp16 are always FSDP's own.
        replicas_beside_backward: with ``replicate``, the reduce-scatters
            block backward but the replica all-reduces run beside it, one
            after another (``aps_comm.fsdp`` on CPU tensors, whose worker
            thread reduces each unit across replicas while backward goes
            on): see :func:`replicas_exposed_s`.

    Returns:
        The :class:`FSDPStepPrediction`.

    Raises:
        ValueError: an unknown backend, a bad ``replicate`` (named), a
            format FSDP cannot reduce-scatter, or (with ``replicate``) a
            strategy the all-reduce across replicas does not run.

    Example:
        >>> from aps_perfmodel.cluster import get_cluster
        >>> c = get_cluster("1gbe", world_size=4)
        >>> p = fsdp_step([FSDPUnit(2**24, 4)], "e4m3", c, compute_s=0.1)
        >>> round(p.step_s, 3) > 0.1
        True
        >>> h = get_cluster("dgx-h100", world_size=32)  # 4 nodes of 8
        >>> flat = fsdp_step([FSDPUnit(2**24, 4)], "e4m3", h)
        >>> hsdp = fsdp_step([FSDPUnit(2**24, 4)], "e4m3", h, replicate=4)
        >>> hsdp.reduce_scatter_format, hsdp.all_gather_s < flat.all_gather_s
        ('fp32', True)
    """
    _check_backend(backend)
    spec = get_format(fmt) if isinstance(fmt, str) else fmt
    _check_format(spec)
    shard = shard_group_size(cluster, replicate)
    if replicate > 1 and not _native(spec) and spec.strategy not in _REPLICA_STRATEGIES:
        raise ValueError(
            f"the all-reduce across replicas runs {', '.join(_REPLICA_STRATEGIES)} "
            f"(register's reduction=), not {spec.strategy!r}"
        )
    aps_rs = not _native(spec) and (replicate == 1 if reduce_scatter is None else reduce_scatter)
    rs_spec = spec if aps_rs or _native(spec) else get_format("fp32")
    gathers = 2 if reshard_after_forward else 1
    priced: list[tuple[CommBreakdown, float]] = []
    if replicate == 1:
        group = cluster
    else:
        group = _shard_cluster(cluster, shard)
        across = _replica_cluster(cluster, shard, backend)
        priced = [_replica_reduction(u, spec, shard, across) for u in units]
    replicas = tuple(b for b, _ in priced)
    all_reduce_s = sum(t for _, t in priced)
    timings = tuple(reduce_scatter_time(u, rs_spec, group, backend) for u in units)
    all_gather_s = gathers * sum(_all_gather(group, u.numel * param_bytes, backend) for u in units)
    if group.world_size == 1:
        all_gather_s = 0.0
    rs = sum(t.total_s for t in timings)
    if overlap:
        exposed = max(0.0, rs + all_reduce_s - backward_s)
    elif replicas_beside_backward and priced:
        share = [backward_s * u.numel / max(1, sum(v.numel for v in units)) for u in units]
        rs_each = [t.total_s for t in timings]
        exposed = rs + replicas_exposed_s(share, rs_each, [t for _, t in priced])
    else:
        exposed = rs + all_reduce_s
    inter_node = sum(t.inter_node_bytes for t in timings) + sum(
        b.inter_node_bytes for b in replicas
    )
    gathered = 0.0
    if group.world_size > 1:
        gathered = gathers * sum(
            _gather_across(group, u.numel * param_bytes, backend) for u in units
        )
    return FSDPStepPrediction(
        format=spec.name,
        aps=not _native(spec) and (aps_rs or replicate > 1),
        compute_s=compute_s,
        all_gather_s=all_gather_s,
        reduce_scatter_s=rs,
        exposed_s=exposed,
        step_s=compute_s + all_gather_s + exposed,
        units=timings,
        wire_bytes=sum(t.wire_bytes for t in timings) + sum(b.wire_bytes for b in replicas),
        exponent_bytes=sum(t.exponent_bytes for t in timings)
        + sum(b.exponent_bytes for b in replicas),
        inter_node_bytes=inter_node,
        replicate=replicate,
        all_reduce_s=all_reduce_s,
        replicas=replicas,
        cross_node_bytes=inter_node + gathered,
        reduce_scatter_format=rs_spec.name,
    )
