"""Plot predicted step speedup over FP32 against inter-node bandwidth.

Example:
    >>> from aps_perfmodel import ComputeTime, get_cluster, get_model
    >>> path = plot_speedup_vs_bandwidth(get_model("resnet50"), get_cluster("100gbe", world_size=8),
    ...     ["e4m3"], ComputeTime.from_step_time(0.1), "/tmp/speedup.png")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .api import BASELINE_FORMATS, breakeven_bandwidth, formats_with_baselines, predict
from .choices import DEFAULT_BLOCK_SIZE, BlockExponents, Scaling
from .cluster import Cluster
from .compute import ComputeTime
from .models import ModelSpec
from .units import format_bandwidth

__all__ = ["plot_speedup_vs_bandwidth"]


def plot_speedup_vs_bandwidth(
    model: ModelSpec,
    cluster: Cluster,
    formats: Sequence[str],
    compute: ComputeTime,
    path: str | Path,
    *,
    bandwidths: Sequence[float] | None = None,
    strategy: str | None = None,
    scaling: Scaling | str = Scaling.LAYER,
    block_size: int = DEFAULT_BLOCK_SIZE,
    block_exponents: BlockExponents | str = BlockExponents.RANK,
) -> Path:
    """Write a PNG of speedup vs bandwidth, marking where each low-precision format stops paying.

    Args:
        model: the model.
        cluster: the cluster at its world size; its inter-node bandwidth is swept.
        formats: formats beside fp32/fp16.
        compute: compute times per step.
        path: output PNG.
        bandwidths: bytes/s to evaluate (default: 100 Mbit/s to 3.2 Tbit/s).
        strategy: strategy for the requested formats.
        scaling: APS scaling of the requested formats ("layer" or "block").
        block_size: elements per exponent byte with block scaling.
        block_exponents: with block scaling, two_phase's block exponents
            ("rank" or "agreed", as in :func:`~aps_perfmodel.api.predict`).

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bws = np.asarray(
        bandwidths if bandwidths is not None else np.logspace(np.log10(12.5e6), np.log10(400e9), 60)
    )
    names = [f for f in formats_with_baselines(formats) if f != "fp32"]
    curves = {f: [] for f in names}
    for bw in bws:
        pred = predict(
            model,
            cluster.with_links(bandwidth=float(bw)),
            formats,
            compute,
            strategy=strategy,
            scaling=scaling,
            block_size=block_size,
            block_exponents=block_exponents,
        )
        for f in names:
            curves[f].append(pred.formats[f].speedup_vs_fp32)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.axhline(1.0, color="grey", lw=0.8)
    for f in names:
        (line,) = ax.plot(bws * 8, curves[f], label=f)
        bw_even = breakeven_bandwidth(
            model,
            cluster,
            f,
            compute,
            low=float(bws[0]),
            high=float(bws[-1]),
            strategy=strategy if f not in BASELINE_FORMATS else None,
            scaling=scaling,
            block_size=block_size,
            block_exponents=block_exponents,
        )
        if bw_even is not None:
            ax.axvline(bw_even * 8, color=line.get_color(), ls="--", lw=1)
            ax.annotate(
                f"{f} stops paying\nabove {format_bandwidth(bw_even)}",
                (bw_even * 8, 1.0),
                xytext=(5, 20),
                textcoords="offset points",
                fontsize=8,
                color=line.get_color(),
            )
    ax.set_xscale("log")
    ax.set_xlabel("inter-node bandwidth (bit/s)")
    ax.set_ylabel("step speedup over FP32")
    ax.set_title(f"{model.name} on {cluster.name}, {cluster.world_size} ranks")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    out = Path(path)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
