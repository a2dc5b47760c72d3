"""What happened to each layer in the last step: exponent, maximum, underflow, saturation.

Collected only with ``APSState(stats=True)``; it costs local passes over the
gradients, never an extra collective.

Example:
    >>> state = register(ddp_model, fmt="e4m3", stats=True)
    >>> loss.backward()
    >>> print(format_stats(state.stats))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from aps_comm.formats import FloatFormat

__all__ = ["LayerStats", "format_stats", "layer_stats"]


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """One parameter tensor's record for one step.

    ``exponent`` and ``amax`` are the values all ranks agreed on; the
    underflow rate and saturated count are measured on this rank's gradient.

    Attributes:
        name: parameter name when known (``register`` knows it), else None.
        bucket: DDP bucket index.
        numel: number of elements.
        format: wire format name.
        exponent: the power of two the layer was multiplied by before encoding.
        amax: the all-reduced max |g| (inf if some rank had inf or NaN).
        underflow_rate: fraction of this rank's nonzero elements that became zero.
        saturated: elements of this rank whose scaled magnitude exceeded the format's max.
    """

    name: str | None
    bucket: int
    numel: int
    format: str
    exponent: int
    amax: float
    underflow_rate: float
    saturated: int


def layer_stats(
    layers: Sequence[torch.Tensor],
    names: Sequence[str | None],
    bucket: int,
    fmt: FloatFormat,
    exps: torch.Tensor,
    amax: torch.Tensor,
) -> list[LayerStats]:
    """Records for one bucket; ``layers`` are this rank's unscaled gradients."""
    # A scaled magnitude at or below half the smallest subnormal rounds to zero
    # (the tie goes to the even code, zero).
    tiny = fmt.min_subnormal / 2
    records = []
    for layer, name, e, a in zip(layers, names, exps.tolist(), amax.tolist(), strict=True):
        if layer.numel():
            mag = layer.detach().float().abs().mul_(2.0**e)
            nonzero = int(torch.count_nonzero(mag))
            under = int(torch.count_nonzero((mag > 0) & (mag <= tiny)))
            saturated = int(torch.count_nonzero(mag > fmt.max))
        else:
            nonzero = under = saturated = 0
        records.append(
            LayerStats(
                name=name,
                bucket=bucket,
                numel=layer.numel(),
                format=str(fmt.name),
                exponent=int(e),
                amax=float(a),
                underflow_rate=under / nonzero if nonzero else 0.0,
                saturated=saturated,
            )
        )
    return records


def format_stats(stats: Sequence[LayerStats]) -> str:
    """A plain-text table of the records."""
    lines = [
        f"{'layer':<40} {'numel':>10} {'fmt':>5} {'exp':>5} {'amax':>10} {'underflow':>9} {'sat':>6}"
    ]
    for s in stats:
        lines.append(
            f"{(s.name or f'bucket{s.bucket}'):<40.40} {s.numel:>10} {s.format:>5} "
            f"{s.exponent:>5} {s.amax:>10.3e} {s.underflow_rate:>9.2%} {s.saturated:>6}"
        )
    return "\n".join(lines)
