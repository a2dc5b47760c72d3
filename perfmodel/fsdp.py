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
across. APS's all-to-all sends every rank's unreduced rows for the other
nodes' ranks, ``g`` times as many elements. Where ``g`` devices share one
node link, APS sends ``g * w / w_native`` times FSDP's bytes across it:
with e4m3 against FP32, fewer only below 4 devices per node link (8 A100s
behind one 100 Gbit/s NIC: twice FP32's bytes, and slower); with one device
per node link, a quarter.

On CPU FSDP calls the reduce-scatter synchronously in the post-backward hook,
so nothing overlaps: the step is compute plus every all-gather and every
reduce-scatter (``overlap=False``, the default). With ``overlap=True`` (CUDA
streams) the reduce-scatters run beside the rest of backward as DDP buckets
do, and only what outlasts backward is exposed.

Example:
    >>> from aps_perfmodel.cluster import custom_cluster
    >>> c = custom_cluster(125e6, 50e-6, nodes=4, device="cpu")
    >>> units = [FSDPUnit(2**22, 2)] * 4
    >>> fp32 = fsdp_step(units, "fp32", c, backend="gloo")
    >>> e4m3 = fsdp_step(units, "e4m3", c, backend="gloo")
    >>> 6.0 < fp32.reduce_scatter_s / e4m3.reduce_scatter_s < 8.0
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cluster import Cluster
from .collectives import (
    LinkParams,
    all_gather,
    all_to_all,
    allreduce,
    hierarchical_all_gather,
    hierarchical_all_to_all,
    hierarchical_allreduce,
    hierarchical_reduce_scatter,
    reduce_scatter,
)
from .formats import FormatSpec, get_format

__all__ = [
    "BACKENDS",
    "FSDPStepPrediction",
    "FSDPUnit",
    "UnitTiming",
    "fsdp_step",
    "padded_numel",
    "reduce_scatter_time",
]

BACKENDS = ("nccl", "gloo")
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
        aps: whether the APS reduce-scatter is modelled.
        compute_s: forward + backward + optimizer, as given.
        all_gather_s: every parameter all-gather of the step.
        reduce_scatter_s: every unit's reduce-scatter.
        exposed_s: the part of the reduce-scatters on the step's critical path.
        step_s: ``compute_s + all_gather_s + exposed_s``.
        units: per unit, its reduce-scatter's :class:`UnitTiming`.
        wire_bytes: bytes one rank sends for the reduce-scatters.
        exponent_bytes: the part of ``wire_bytes`` that is block exponents.
        inter_node_bytes: the part of ``wire_bytes`` that leaves the node.

    Example:
        >>> p = FSDPStepPrediction("e4m3", True, 0.0, 0.0, 1.0, 1.0, 1.0, (), 8.0)
        >>> p.step_s
        1.0
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


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _flat(cluster: Cluster, key: str) -> LinkParams | None:
    """A calibrated flat fit for ``key`` where the cluster has one."""
    return cluster.collective_fits.get(key)


def _allreduce(cluster: Cluster, nbytes: float, key: str, algorithm: str) -> float:
    fit = _flat(cluster, key)
    if fit is not None:
        return allreduce(nbytes, cluster.world_size, fit, algorithm)
    return hierarchical_allreduce(nbytes, cluster.topology, algorithm)


def _all_to_all(cluster: Cluster, nbytes: float) -> float:
    fit = _flat(cluster, "all_to_all")
    if fit is not None:
        return all_to_all(nbytes, cluster.world_size, fit)
    return hierarchical_all_to_all(nbytes, cluster.topology)


def _all_gather(cluster: Cluster, nbytes: float) -> float:
    fit = _flat(cluster, "all_gather")
    if fit is not None:
        return all_gather(nbytes, cluster.world_size, fit)
    return hierarchical_all_gather(nbytes, cluster.topology)


def _native(fmt: FormatSpec) -> bool:
    """FSDP's own reduce-scatter in a reduce dtype, not the APS one."""
    return not fmt.aps and fmt.name in _TORCH_DTYPE


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
        # g ranks sends its n/g shard across.
        if backend == "gloo":
            collective = _allreduce(cluster, n * w, key, cluster.algorithm)
            return UnitTiming(collective, 0.0, 0.0, 2 * n * w * frac, 0.0, 2 * n * w / g * away)
        fit = _flat(cluster, "reduce_scatter")
        collective = (
            reduce_scatter(n * w, p, fit)
            if fit is not None
            else hierarchical_reduce_scatter(n * w, cluster.topology)
        )
        return UnitTiming(collective, 0.0, 0.0, n * w * frac, 0.0, n * w / g * away)
    if not fmt.aps:
        raise ValueError(
            f"format {fmt.name!r} without APS has no FSDP reduce-scatter here; use "
            "fp32/bf16/fp16 (FSDP's own) or an APS format"
        )

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
) -> FSDPStepPrediction:
    """One FSDP2 training step: all-gathers, compute and reduce-scatters.

    Args:
        units: the model's FSDP units.
        fmt: the reduce-scatter's format (see :func:`reduce_scatter_time`).
        cluster: links, device and fits.
        backend: "nccl" or "gloo".
        compute_s: forward + backward + optimizer time of one rank.
        param_bytes: bytes per element of the parameter all-gather
            (``param_dtype``: 4 for FP32, 2 for BF16).
        reshard_after_forward: the parameters are all-gathered again for
            backward (FSDP's default for every unit but the root; here for all).
        overlap: the reduce-scatters run beside backward (CUDA streams);
            False on CPU, where FSDP runs them synchronously.
        backward_s: with ``overlap``, the backward time they can hide behind.

    Returns:
        The :class:`FSDPStepPrediction`.

    Example:
        >>> from aps_perfmodel.cluster import get_cluster
        >>> c = get_cluster("1gbe", world_size=4)
        >>> p = fsdp_step([FSDPUnit(2**24, 4)], "e4m3", c, compute_s=0.1)
        >>> round(p.step_s, 3) > 0.1
        True
    """
    _check_backend(backend)
    timings = tuple(reduce_scatter_time(u, fmt, cluster, backend) for u in units)
    gathers = 2 if reshard_after_forward else 1
    all_gather_s = gathers * sum(_all_gather(cluster, u.numel * param_bytes) for u in units)
    if cluster.world_size == 1:
        all_gather_s = 0.0
    rs = sum(t.total_s for t in timings)
    exposed = max(0.0, rs - backward_s) if overlap else rs
    spec = get_format(fmt) if isinstance(fmt, str) else fmt
    return FSDPStepPrediction(
        format=spec.name,
        aps=not _native(spec),
        compute_s=compute_s,
        all_gather_s=all_gather_s,
        reduce_scatter_s=rs,
        exposed_s=exposed,
        step_s=compute_s + all_gather_s + exposed,
        units=timings,
        wire_bytes=sum(t.wire_bytes for t in timings),
        exponent_bytes=sum(t.exponent_bytes for t in timings),
        inter_node_bytes=sum(t.inter_node_bytes for t in timings),
    )
