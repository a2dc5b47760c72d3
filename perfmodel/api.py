"""Python API: predict a step, sweep bandwidths and world sizes, find the break-even.

Example:
    >>> from aps_perfmodel import ComputeTime, get_cluster, get_model, predict
    >>> p = predict(get_model("resnet50"), get_cluster("10gbe", world_size=64),
    ...             ["e4m3"], ComputeTime.from_step_time(0.1))
    >>> sorted(p.formats)
    ['e4m3', 'fp16', 'fp32']
    >>> p.formats["e4m3"].speedup_vs_fp32 > 1
    True
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from .choices import (
    BlockExponents,
    Scaling,
    check_block_size,
    default_block_size,
    format_bits,
    format_name,
)
from .cluster import Cluster
from .compute import ComputeTime
from .ddp import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_BYTES,
    StepPrediction,
    simulate_step,
)
from .formats import check_scaling, get_format
from .models import ModelSpec

__all__ = [
    "BASELINE_FORMATS",
    "FormatResult",
    "Prediction",
    "SweepRow",
    "breakeven_bandwidth",
    "format_block_size",
    "formats_with_baselines",
    "predict",
    "sweep",
    "write_csv",
]

BASELINE_FORMATS = ("fp32", "fp16")


@dataclass(frozen=True)
class FormatResult:
    """Headline numbers for one format.

    Attributes:
        format: format name.
        strategy: how it is reduced ("auto": chosen per bucket, see ``chosen``).
        comm_s: total communication time per step (overlapped or not).
        exposed_comm_s: communication not hidden behind backward.
        step_s: predicted step time.
        speedup_vs_fp32: FP32 step time over this format's.
        wire_bytes: bytes each rank sends per step, inside its node and across
            nodes (hierarchical's in-node stages are FP32, so an 8-bit format
            can send more than FP16 here and still less across nodes).
        chosen: buckets per strategy actually used (what "auto" chose).
        inter_node_bytes: the part of ``wire_bytes`` that leaves the node (per
            rank, averaged over a node's ranks; 0 on one node).
        scaling: APS's exponent granularity for this format ("layer" or
            "block"); "none" for FP32 and torch's cast hook (the baselines).
        exponent_bytes: the part of ``wire_bytes`` that is block exponents
            (0 unless ``scaling`` is "block").
    """

    format: str
    strategy: str
    comm_s: float
    exposed_comm_s: float
    step_s: float
    speedup_vs_fp32: float
    wire_bytes: float
    chosen: dict[str, int] = field(default_factory=dict)
    inter_node_bytes: float = 0.0
    scaling: Scaling = Scaling.LAYER
    exponent_bytes: float = 0.0

    @property
    def strategy_label(self) -> str:
        """``strategy``, with what "auto" chose: ``auto:two_phase`` or ``auto:mixed``.

        Example:
            >>> FormatResult("e4m3", "auto", 1, 1, 1, 1, 1, {"hierarchical": 3}).strategy_label
            'auto:hierarchical'
        """
        if self.strategy != "auto" or not self.chosen:
            return self.strategy
        return f"auto:{next(iter(self.chosen))}" if len(self.chosen) == 1 else "auto:mixed"


@dataclass(frozen=True)
class Prediction:
    """A prediction for one model on one cluster.

    Attributes:
        model: model name.
        cluster: cluster name.
        world_size: ranks.
        compute: compute times per step.
        formats: results by format name (always fp32 and fp16, plus the requested).
        steps: the full timelines by format name.
        scaling: the requested formats' scaling ("layer" or "block").
        block_size: elements per exponent byte with block scaling (the first
            requested format's where each took its default), else None.
        block_exponents: with block scaling, where the block exponents come
            from (each rank's own, or agreed), else None.
    """

    model: str
    cluster: str
    world_size: int
    compute: ComputeTime
    formats: dict[str, FormatResult]
    steps: dict[str, StepPrediction]
    scaling: Scaling = Scaling.LAYER
    block_size: int | None = None
    block_exponents: BlockExponents | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (without the per-bucket timelines)."""
        return {
            "model": self.model,
            "cluster": self.cluster,
            "world_size": self.world_size,
            "scaling": self.scaling.value,
            "block_size": self.block_size,
            "block_exponents": self.block_exponents.value if self.block_exponents else None,
            "compute": asdict(self.compute),
            "formats": {k: _result_dict(v) for k, v in self.formats.items()},
        }


def _result_dict(r: FormatResult) -> dict[str, Any]:
    """``r`` as JSON-ready values (the scaling as its name)."""
    return {**asdict(r), "scaling": r.scaling.value}


def formats_with_baselines(formats: Iterable[str]) -> list[str]:
    """Canonical format names: fp32 and fp16 first, then the requested ones.

    Example:
        >>> formats_with_baselines(["fp8", "fp16"])
        ['fp32', 'fp16', 'e4m3']
    """
    names = list(BASELINE_FORMATS)
    for f in formats:
        name = get_format(f).name
        if name not in names:
            names.append(name)
    return names


def predict(
    model: ModelSpec,
    cluster: Cluster,
    formats: Sequence[str] = ("e4m3",),
    compute: ComputeTime | None = None,
    *,
    strategy: str | None = None,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
    scaling: Scaling | str = Scaling.LAYER,
    block_size: int | None = None,
    block_exponents: BlockExponents | str = BlockExponents.RANK,
) -> Prediction:
    """Predict communication and step time for FP32, FP16 and the requested formats.

    Args:
        model: the model's parameter tensors.
        cluster: links and device, already sized to the world size.
        formats: extra formats to predict besides fp32 and fp16.
        compute: compute times; default: estimated from FLOPs on the cluster's
            device for a per-rank batch of 32 at 40% MFU in bf16 with Adam.
        strategy: reduction strategy for the requested (non-baseline) formats;
            default "auto", the hook's default: per bucket, the fastest that
            the cluster allows (:func:`~aps_perfmodel.strategies.choose_strategy`).
        bucket_cap_mb: DDP ``bucket_cap_mb``.
        first_bucket_bytes: DDP's cap for the first bucket.
        scaling: APS's scaling of the requested formats, "layer" (one
            maximum per tensor) or "block" (one exponent byte per
            ``block_size`` elements of a tensor); the baselines scale nothing.
        block_size: elements per block with ``scaling="block"`` (8 to 256);
            None: each format's default, as the hook's
            (:func:`~aps_perfmodel.choices.default_block_size`: 128 for 8-bit
            formats, 32 below).
        block_exponents: with ``scaling="block"``, where the block
            exponents come from: "rank" (the hook's default: two_phase,
            hierarchical and grid send each rank's own with its values and
            each owner's with its mean, no collective first) or "agreed" (one
            MAX all-reduce of one-byte exponents first; the owners still send
            their means' own); native sums always agree them.

    Raises:
        ValueError: an unknown format or strategy, a scaling the model does not
            price, a block size not in :data:`~aps_perfmodel.choices.BLOCK_SIZES`,
            a ``block_exponents`` not in :class:`~aps_perfmodel.choices.BlockExponents`,
            or block scaling of a format predicted as an unscaled hook.

    Example:
        >>> from aps_perfmodel import get_cluster, get_model
        >>> c, m = get_cluster("1gbe", world_size=4), get_model("resnet50")
        >>> p = predict(m, c, ["e2m1"], ComputeTime.from_step_time(0.1), scaling="block")
        >>> r = p.formats["e2m1"]
        >>> str(r.scaling), p.block_size, 0 < r.exponent_bytes < r.wire_bytes
        ('block', 32, True)
    """
    scaling = check_scaling(scaling)
    if block_size is not None:
        check_block_size(block_size)
    block_exponents = BlockExponents.parse(block_exponents, "block_exponents")
    if scaling == Scaling.BLOCK:
        for name in formats:
            if not get_format(name).aps:
                raise ValueError(
                    f"{name} is predicted as torch's cast hook (or FP32), which scales "
                    "nothing: scaling='block' needs an APS format (e4m3, e5m2, e2m1 or any "
                    "e<E>m<M>)"
                )
    if compute is None:
        compute = ComputeTime.estimate(model, cluster.device, 32)
    steps: dict[str, StepPrediction] = {}
    specs = {}
    for name in formats_with_baselines(formats):
        if name in BASELINE_FORMATS:
            spec = get_format(name)
        else:
            spec = get_format(
                name,
                strategy or "auto",
                scaling=scaling,
                block_size=format_block_size(name, block_size),
                block_exponents=block_exponents,
            )
        specs[name] = spec
        steps[name] = simulate_step(
            model,
            cluster,
            spec,
            compute,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_bytes=first_bucket_bytes,
        )
    base = steps["fp32"].step_s
    results = {
        name: FormatResult(
            format=name,
            strategy=specs[name].strategy,
            comm_s=s.comm_s,
            exposed_comm_s=s.exposed_comm_s,
            step_s=s.step_s,
            speedup_vs_fp32=base / s.step_s if s.step_s > 0 else 1.0,
            wire_bytes=s.wire_bytes,
            chosen=_chosen(s),
            inter_node_bytes=s.inter_node_bytes,
            scaling=specs[name].scaling if specs[name].aps else Scaling.NONE,
            exponent_bytes=s.exponent_bytes,
        )
        for name, s in steps.items()
    }
    return Prediction(
        model.name,
        cluster.name,
        cluster.world_size,
        compute,
        results,
        steps,
        scaling,
        format_block_size(formats[0], block_size) if scaling == Scaling.BLOCK and formats else None,
        block_exponents if scaling == Scaling.BLOCK else None,
    )


def format_block_size(name: str, block_size: int | None = None) -> int:
    """``block_size``, or where None the hook's default for format ``name``.

    Example:
        >>> format_block_size("e2m1"), format_block_size("fp8"), format_block_size("e4m3", 16)
        (32, 128, 16)
    """
    if block_size is not None:
        return block_size
    return default_block_size(1 + sum(format_bits(format_name(name))))


def _chosen(step: StepPrediction) -> dict[str, int]:
    counts: dict[str, int] = {}
    for b in step.buckets:
        counts[b.comm.strategy] = counts.get(b.comm.strategy, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


@dataclass(frozen=True)
class SweepRow:
    """One line of a sweep (one format at one bandwidth and world size)."""

    model: str
    cluster: str
    world_size: int
    bandwidth_Bps: float
    latency_s: float
    format: str
    comm_s: float
    exposed_comm_s: float
    step_s: float
    speedup_vs_fp32: float


def sweep(
    model: ModelSpec,
    cluster: Cluster,
    *,
    bandwidths: Sequence[float],
    world_sizes: Sequence[int],
    formats: Sequence[str] = ("e4m3",),
    compute: ComputeTime | None = None,
    strategy: str | None = None,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    scaling: Scaling | str = Scaling.LAYER,
    block_size: int | None = None,
    block_exponents: BlockExponents | str = BlockExponents.RANK,
) -> list[SweepRow]:
    """Predict over every (world size, inter-node bandwidth) pair.

    ``scaling``, ``block_size`` and ``block_exponents`` are the requested
    formats', as in :func:`predict`.

    Example:
        >>> from aps_perfmodel import get_cluster, get_model
        >>> rows = sweep(get_model("resnet50"), get_cluster("10gbe"), bandwidths=[1e9, 1e10],
        ...              world_sizes=[8], compute=ComputeTime.from_step_time(0.1))
        >>> len(rows)
        6
    """
    rows: list[SweepRow] = []
    for p in world_sizes:
        sized = cluster.with_world_size(p)
        for bw in bandwidths:
            c = sized.with_links(bandwidth=bw)
            pred = predict(
                model,
                c,
                formats,
                compute,
                strategy=strategy,
                bucket_cap_mb=bucket_cap_mb,
                scaling=scaling,
                block_size=block_size,
                block_exponents=block_exponents,
            )
            for r in pred.formats.values():
                rows.append(
                    SweepRow(
                        model.name,
                        cluster.name,
                        p,
                        bw,
                        c.topology.inter.alpha,
                        r.format,
                        r.comm_s,
                        r.exposed_comm_s,
                        r.step_s,
                        r.speedup_vs_fp32,
                    )
                )
    return rows


def write_csv(rows: Sequence[SweepRow], out: str | Path | IO[str]) -> None:
    """Write sweep rows as CSV with a header, to a path or an open text stream."""
    fields = list(SweepRow.__dataclass_fields__)

    def _write(fh: IO[str]) -> None:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))

    if isinstance(out, str | Path):
        with open(out, "w", newline="") as fh:
            _write(fh)
    else:
        _write(out)


def breakeven_bandwidth(
    model: ModelSpec,
    cluster: Cluster,
    fmt: str,
    compute: ComputeTime,
    *,
    low: float = 1e7,
    high: float = 1e13,
    tolerance: float = 0.01,
    strategy: str | None = None,
    scaling: Scaling | str = Scaling.LAYER,
    block_size: int | None = None,
    block_exponents: BlockExponents | str = BlockExponents.RANK,
) -> float | None:
    """The inter-node bandwidth (bytes/s) above which ``fmt`` stops paying.

    "Stops paying" means the step speedup over FP32 falls to ``1 + tolerance``
    or below. Found by bisection in log-bandwidth, assuming the speedup falls
    as bandwidth grows (communication shrinks while compute stays).
    ``scaling``, ``block_size`` and ``block_exponents`` are ``fmt``'s, as in
    :func:`predict`.

    Returns:
        The bandwidth, or None if ``fmt`` pays over the whole ``[low, high]``
        range or never pays in it.
    """

    def speedup(bw: float) -> float:
        c = cluster.with_links(bandwidth=bw)
        return (
            predict(
                model,
                c,
                [fmt],
                compute,
                strategy=strategy,
                scaling=scaling,
                block_size=block_size,
                block_exponents=block_exponents,
            )
            .formats[get_format(fmt).name]
            .speedup_vs_fp32
        )

    if speedup(high) > 1 + tolerance or speedup(low) <= 1 + tolerance:
        return None
    lo, hi = math.log(low), math.log(high)
    for _ in range(40):
        mid = (lo + hi) / 2
        if speedup(math.exp(mid)) > 1 + tolerance:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)
