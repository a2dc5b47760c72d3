"""What happened to each layer in the last step: exponent, maximum, underflow, saturation.

Collected only with ``APSState(stats=True)``; it costs local passes over the
gradients, never an extra collective. The counts stay on the gradients'
device while the step runs (:class:`StepStats`); they are read to the host
once, when the step's records are first asked for.

Example:
    >>> state = register(ddp_model, fmt="e4m3", stats=True)  # doctest: +SKIP
    >>> loss.backward()  # doctest: +SKIP
    >>> print(format_stats(state.stats))  # doctest: +SKIP

    One layer's record, as the hook makes it from the agreed exponent and maximum:

    >>> from aps_comm.formats import E4M3
    >>> g = torch.tensor([0.5, 1e-9, 0.0, -0.25])
    >>> records = layer_stats([g], ["fc.weight"], 0, E4M3, torch.tensor([9]), torch.tensor([0.5]))
    >>> print(format_stats(records))
    layer                                         numel   fmt   exp       amax underflow    sat
    fc.weight                                         4  e4m3     9  5.000e-01    33.33%      0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from aps_comm.formats import FloatFormat, pow2
from aps_comm.layout import Blocks

__all__ = [
    "LayerStats",
    "StepStats",
    "block_rows",
    "format_stats",
    "layer_counts",
    "layer_stats",
    "per_layer",
    "segment_sums",
]


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
        exponent: the power of two the layer was multiplied by before encoding
            (block scaling: the smallest of its blocks', its largest block's).
        amax: the all-reduced max |g| (inf if some rank had inf or NaN); with
            block scaling the ranks agree on block exponents only, and this is
            this rank's own max |g|.
        underflow_rate: fraction of this rank's nonzero elements that became
            zero (flushed), each scaled by its layer's (or block's) exponent.
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


def layer_counts(
    x: torch.Tensor, lengths: torch.Tensor, exps: torch.Tensor, fmt: FloatFormat
) -> torch.Tensor:
    """(L, 3) int64 counts per layer of ``x``: nonzero, underflowing and saturating elements.

    Device-only (no host read): ``lengths`` are the L layers' sizes on ``x``'s
    device, ``exps`` their exponents. An element underflows when its scaled
    magnitude is nonzero but at most half the smallest subnormal (the tie
    rounds to the even code, zero).

    Example:
        >>> from aps_comm.formats import get_format
        >>> layer_counts(torch.tensor([1.0, 1e-9, 0.0, 1e4]), torch.tensor([3, 1]),
        ...              torch.tensor([0, 0]), get_format("e4m3"))
        tensor([[2, 1, 0],
                [1, 0, 1]])
    """
    numel = x.numel()
    factor = torch.repeat_interleave(pow2(exps), lengths, output_size=numel)
    mag = x.detach().float().abs().mul_(factor)
    flags = torch.stack([mag > 0, (mag > 0) & (mag <= fmt.min_subnormal / 2), mag > fmt.max], dim=1)
    return segment_sums(flags, lengths)


def segment_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(L, k) int64 sums of the rows of (n, k) ``values`` over L consecutive segments.

    Differences of a running sum at the segments' ends, exact and without
    atomics: an ``index_add_`` of every element into a few rows serialises a
    GPU's atomics on them (with it, e4m3 + stats stepped at 8.7x DDP's time
    on an H200, benchmarks.gpu).

    Example:
        >>> segment_sums(torch.tensor([[1, 0], [1, 1], [0, 1]]), torch.tensor([2, 0, 1]))
        tensor([[2, 1],
                [0, 0],
                [0, 1]])
    """
    n = values.shape[0]
    # int32 running sums of flags where they cannot overflow: half int64's bytes.
    dtype = torch.int32 if values.dtype == torch.bool and n < 2**31 else torch.int64
    run = torch.zeros(n + 1, values.shape[1], dtype=dtype, device=values.device)
    torch.cumsum(values, 0, dtype=dtype, out=run[1:])
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    return (run[ends] - run[starts]).long()


def per_layer(
    blocks: Blocks, counts: torch.Tensor, exps: torch.Tensor, amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block scaling's per-block records folded into one per layer (no host read).

    Args:
        blocks: the layers' blocks (:meth:`aps_comm.layout.Layout.grid`).
        counts: (blocks, 3) counts of :func:`layer_counts` over the blocks.
        exps: each block's exponent.
        amax: each block's max |g| on this rank.

    Returns:
        Per layer: the summed counts, the smallest block exponent and the
        largest block maximum (0 for layers without elements).

    Example:
        >>> from aps_comm.layout import Layout
        >>> b = Layout.from_numels([3, 2], torch.device("cpu")).grid(8)
        >>> per_layer(b, torch.tensor([[2, 1, 0], [1, 0, 0]]), torch.tensor([4, 6]),
        ...           torch.tensor([0.5, 0.1]))[1]
        tensor([4, 6])
    """
    lengths = blocks.device_counts
    summed = segment_sums(counts, lengths).to(counts.dtype)
    if amax.dtype != torch.float32:
        raise TypeError(f"amax must be float32 (the blocks' maxima), got {amax.dtype}")
    # A running min (max) of values pushed apart per layer, read at each layer's last
    # block: exact, and without the atomics of a scatter into a few rows (the stepping
    # cost of benchmarks.gpu's stats row, segment_sums). Exponents fit in 32 bits, and
    # non-negative float32 maxima order as their bits (NaN above inf, as amax takes it).
    layer = torch.arange(lengths.numel(), device=counts.device)
    if counts.shape[0] == 0:  # no block at all: every layer is empty
        return summed, layer.to(exps.dtype) * 0, layer.to(amax.dtype) * 0
    apart = layer << 32
    shift = torch.repeat_interleave(apart, lengths, output_size=counts.shape[0])
    low = torch.cummin(exps.long() - shift, 0).values
    high = torch.cummax(amax.view(torch.int32).long() + shift, 0).values
    last = (torch.cumsum(lengths, 0) - 1).clamp_(min=0)
    some = lengths > 0
    smallest = torch.where(some, low[last] + apart, 0).to(exps.dtype)
    largest = (high[last] - apart).to(torch.int32).view(torch.float32)
    return summed, smallest, torch.where(some, largest, 0.0)


def block_rows(
    x: torch.Tensor,
    blocks: Blocks,
    exps: torch.Tensor,
    amax: torch.Tensor,
    fmt: FloatFormat,
    out: torch.Tensor,
) -> None:
    """Block scaling's records of ``x`` as :meth:`StepStats.add_rows` takes them, by tensor
    ops (no host read): each block's counts under its exponent, folded per layer with the
    blocks' maxima (:func:`per_layer`), into float64 ``out`` (layers, 5) as
    :meth:`StepStats.add` stacks them.

    Example:
        >>> from aps_comm.formats import get_format
        >>> from aps_comm.layout import Layout
        >>> b = Layout.from_numels([3], torch.device("cpu")).grid(8)
        >>> out = torch.empty(1, 5, dtype=torch.float64)
        >>> block_rows(torch.tensor([1.0, 0.0, 3.0]), b, torch.tensor([4]), torch.tensor([3.0]),
        ...            get_format("e4m3"), out)
        >>> out
        tensor([[4., 3., 2., 0., 0.]], dtype=torch.float64)
    """
    counts = layer_counts(x, blocks.layout.lengths, exps, fmt)
    counts, smallest, largest = per_layer(blocks, counts, exps, amax)
    torch.cat([smallest.double()[:, None], largest.double()[:, None], counts.double()], 1, out=out)


class StepStats:
    """One step's records, kept on the device until they are read (once).

    Example:
        >>> from aps_comm.formats import E4M3
        >>> rec = StepStats()
        >>> rec.add(0, ["w"], [2], E4M3, torch.tensor([3]), torch.tensor([0.5]),
        ...         torch.tensor([[2, 0, 0]]))
        >>> rec.records()[0].exponent
        3
    """

    def __init__(self) -> None:
        self._parts: list[
            tuple[int, list[str | None], list[int], FloatFormat | Sequence[FloatFormat]]
        ] = []
        self._values: list[torch.Tensor] = []
        # Per queued group: whether its rows are lent (a CUDA graph's own, rewritten by
        # its next replay) until :meth:`keep` copies them.
        self._lent: list[bool] = []
        self._records: list[LayerStats] | None = None

    @classmethod
    def of(cls, records: Sequence[LayerStats]) -> StepStats:
        """A step whose records are already on the host."""
        out = cls()
        out._records = list(records)
        return out

    def add(
        self,
        bucket: int,
        names: Sequence[str | None],
        numels: Sequence[int],
        fmt: FloatFormat,
        exps: torch.Tensor,
        amax: torch.Tensor,
        counts: torch.Tensor,
    ) -> None:
        """Queue one format group's records (device tensors, one row per layer)."""
        self._parts.append((bucket, list(names), list(numels), fmt))
        self._values.append(
            torch.cat([exps.double()[:, None], amax.double()[:, None], counts.double()], dim=1)
        )
        self._lent.append(False)

    def add_rows(
        self,
        bucket: int,
        names: Sequence[str | None],
        numels: Sequence[int],
        fmt: FloatFormat | Sequence[FloatFormat],
        rows: torch.Tensor,
        lent: bool = False,
    ) -> None:
        """Queue one group's records made as rows already (no device op).

        Args:
            bucket: the bucket (or unit) index.
            names: each layer's name.
            numels: each layer's size.
            fmt: the group's wire format, or each layer's: an FSDP unit of several
                formats queues its records once, not once per run of one format (the
                host cost of a queued group then does not grow with the runs).
            rows: float64 (L, 5): exponent, amax, nonzero, underflowing and
                saturated counts per layer (what :meth:`add` stacks); kept
                as it is, so the caller hands a tensor no later step writes,
                unless ``lent``.
            lent: ``rows`` will be written again (a CUDA graph's own memory):
                :meth:`keep` copies every lent group's rows, in one device op,
                before that happens.

        Raises:
            ValueError: ``rows`` is not float64 with one row of 5 per layer.
        """
        if rows.dtype != torch.float64 or tuple(rows.shape) != (len(names), 5):
            raise ValueError(
                f"rows must be float64 of shape ({len(names)}, 5), got "
                f"{tuple(rows.shape)} {rows.dtype}"
            )
        fmts = fmt if isinstance(fmt, FloatFormat) else tuple(fmt)
        self._parts.append((bucket, list(names), list(numels), fmts))
        self._values.append(rows)
        self._lent.append(lent)

    def keep(self) -> None:
        """Copy the lent rows (:meth:`add_rows`) into memory of their own: one
        concatenation for the step, not one copy per bucket graph's replay."""
        lent = [i for i, flag in enumerate(self._lent) if flag]
        if not lent:
            return
        copies = torch.cat([self._values[i] for i in lent])
        for i, rows in zip(
            lent, copies.split([self._values[i].shape[0] for i in lent]), strict=True
        ):
            self._values[i] = rows
            self._lent[i] = False

    @property
    def queued(self) -> int:
        """How many groups are queued (a mark for :meth:`take_since`)."""
        return len(self._parts)

    def take_since(self, mark: int) -> list[tuple[tuple, torch.Tensor]]:
        """Take out the groups queued since :attr:`queued` was ``mark``: (their
        :meth:`add_rows` arguments but the rows, the rows). A CUDA graph's capture
        queues rows the graph writes; each replay adds a copy of them."""
        parts, values = self._parts[mark:], self._values[mark:]
        del self._parts[mark:], self._values[mark:], self._lent[mark:]
        return list(zip(parts, values, strict=True))

    def records(self) -> list[LayerStats]:
        """The records, read to the host in one copy on first use."""
        if self._records is None:
            rows = torch.cat(self._values).tolist() if self._values else []
            out: list[LayerStats] = []
            for bucket, names, numels, fmts in self._parts:
                if isinstance(fmts, FloatFormat):
                    fmts = [fmts] * len(names)
                for name, numel, fmt in zip(names, numels, fmts, strict=True):
                    e, a, nonzero, under, saturated = rows[len(out)]
                    out.append(
                        LayerStats(
                            name=name,
                            bucket=bucket,
                            numel=numel,
                            format=str(fmt.name),
                            exponent=int(e),
                            amax=float(a),
                            underflow_rate=under / nonzero if nonzero else 0.0,
                            saturated=int(saturated),
                        )
                    )
            self._records, self._values = out, []
        return self._records


def layer_stats(
    layers: Sequence[torch.Tensor],
    names: Sequence[str | None],
    bucket: int,
    fmt: FloatFormat,
    exps: torch.Tensor,
    amax: torch.Tensor,
) -> list[LayerStats]:
    """Records for one bucket, read at once; ``layers`` are this rank's unscaled gradients."""
    # A scaled magnitude at or below half the smallest subnormal rounds to zero
    # (the tie goes to the even code, zero).
    tiny = fmt.min_subnormal / 2
    records = []
    for layer, name, e, a in zip(layers, names, exps.tolist(), amax.tolist(), strict=True):
        if layer.numel():
            mag = layer.detach().float().abs().mul_(2.0**e)
            # NaN is not a nonzero magnitude: the rate's denominator is layer_counts'.
            nonzero = int(torch.count_nonzero(mag > 0))
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
