"""Exponent rules of Auto Precision Scaling: one power of two per layer (or per block).

Every rank computes each layer's largest magnitude, one MAX all-reduce agrees
on it, and :func:`exponents` turns the agreed maxima into exponents ``e`` so
that ``x * 2**e`` fits the wire format:

- native low-precision all-reduce (the sum happens in the wire format):
  ``e = floor(log2(FMAX / (N * amax)))``, lowered by one where the encoded
  maximum rounds up past ``FMAX / N`` (N * that rounded value must stay
  finite), so the N-way sum cannot overflow;
- two-phase (FP32 accumulation on the shard owner):
  ``e = floor(log2(FMAX / amax))``, log2(N) more bits for small values (and
  never so large that the owner's FP32 sum of N values could overflow).

Powers of two make scaling and unscaling exact. A zero layer gets ``e = 0``;
a layer whose maximum is not finite gets ``e = 0`` and is reported through
the ``finite`` mask so the caller can make it NaN on every rank.

Block scaling (``scaling="block"``) applies the same rules to every block of
``block_size`` elements of a layer (:meth:`aps_comm.layout.Layout.grid`):
:func:`block_amax` gives each block's maximum, one MAX all-reduce agrees on
them, and :func:`factors` turns them into per-block factors; a block whose
maximum is not finite makes its whole layer NaN. Exponents fit one signed
byte (+-126). Every rule is non-increasing in ``amax``, so the exponent of
the agreed maximum is also the minimum over ranks of each rank's own
exponent of a non-zero finite maximum: the agreement may travel as bytes
(:func:`exponent_keys`, :func:`factors_from_keys`).

Example:
    >>> amax = torch.tensor([1e-6, 3.0, 0.0, float("inf")])
    >>> exponents(amax, "e4m3", world_size=4, reduction="allreduce", scaling="layer")
    tensor([26,  5,  0,  0], dtype=torch.int32)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from aps_comm import cpu_kernels
from aps_comm.config import SCALINGS, Scaling
from aps_comm.formats import FloatFormat, get_format, pow2

if TYPE_CHECKING:
    from aps_comm.layout import Blocks, Layout

__all__ = [
    "EXPONENT_LIMIT",
    "KEY_BAD",
    "KEY_ZERO",
    "Factors",
    "Scaling",
    "bad_layers",
    "block_amax",
    "block_keys_into",
    "blocks_amax",
    "exponent_keys",
    "exponents",
    "factors",
    "factors_from_keys",
    "key_exponents",
    "key_factors",
    "layer_amax",
    "mean_exponents",
    "pow2",
]


EXPONENT_LIMIT = 126
"""Exponents are clamped to +-126 so that 2**e and 2**-e are normal float32."""


def layer_amax(layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """max |x| of each tensor as a float32 vector; NaN becomes +inf, empty gives 0.

    NaN is mapped to inf because MAX reductions may drop NaN (max(NaN, 1) can
    be 1 depending on the backend); inf survives every MAX.

    Example:
        >>> layer_amax([torch.tensor([1.0, -3.0]), torch.tensor([float("nan")])])
        tensor([3., inf])
    """
    out = torch.zeros(2, len(layers), dtype=torch.float32, device=_device(layers))
    for i, t in enumerate(layers):
        if t.numel():
            # One read pass for both extremes; aminmax beats abs().max() and
            # the foreach norms on CPU.
            torch.aminmax(t, out=(out[0, i], out[1, i]))
    amax = torch.maximum(out[1], out[0].neg_())
    # Not nan_to_num: it would also turn +inf into float32's max.
    return amax.masked_fill_(torch.isnan(amax), float("inf"))


def block_amax(x: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """max |x| of every block as a float32 vector on x's device: NaN becomes +inf.

    One pass, no host read (the blocks were laid out at plan time): a numba
    kernel on the CPU, ``torch.segment_reduce`` elsewhere.

    Args:
        x: 1-D floating-point tensor of ``blocks.layout.numel`` elements.
        blocks: its blocks (:meth:`aps_comm.layout.Layout.grid`, or a window).

    Example:
        >>> from aps_comm.layout import Layout
        >>> x = torch.tensor([1.0, -3.0, 0.5, float("nan"), 2.0])
        >>> block_amax(x, Layout.from_numels([5], x.device).grid(8))
        tensor([inf])
    """
    return blocks_amax(x, blocks.layout)


def blocks_amax(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """:func:`block_amax` of a layout whose segments are blocks (many, small).

    :func:`aps_comm.codec.segment_amax` suits a few large segments (layers);
    this one a segment per block.

    Example:
        >>> from aps_comm.layout import Layout
        >>> blocks_amax(torch.tensor([1.0, -3.0, 2.0]), Layout.from_numels([2, 1], "cpu"))
        tensor([3., 2.])
    """
    if x.dim() != 1 or x.numel() != layout.numel:
        raise ValueError(f"blocks cover {layout.numel} elements, x has shape {tuple(x.shape)}")
    out = torch.zeros(layout.n_segments, dtype=torch.float32, device=x.device)
    if not layout.n_segments:
        return out
    v = x.detach().float().contiguous()
    if v.device.type == "cpu" and cpu_kernels.AVAILABLE:
        cpu_kernels.block_amax(v, layout.offsets.numpy(), out)
        return out
    a = torch.segment_reduce(v.abs(), "max", lengths=layout.lengths, unsafe=True, initial=0.0)
    # Not nan_to_num: it would also turn +inf into float32's max.
    return a.masked_fill_(torch.isnan(a), float("inf"))


def _device(layers: Sequence[torch.Tensor]) -> torch.device:
    return layers[0].device if layers else torch.device("cpu")


def exponents(
    amax: torch.Tensor,
    fmt: FloatFormat | str,
    *,
    world_size: int,
    reduction: Literal["allreduce", "two_phase"],
    scaling: Scaling | str = "layer",
    headroom: int = 1,
) -> torch.Tensor:
    """Per-layer exponents ``e`` (int32) from the all-reduced maxima.

    Args:
        amax: float32 vector of every layer's max |g| over all ranks.
        fmt: the wire format.
        world_size: number of ranks N that sum.
        reduction: "allreduce" (sum in the wire format: headroom for N) or
            "two_phase" (sum in FP32: no headroom needed).
        scaling: "layer" (one exponent per layer), "block" (``amax`` holds
            blocks: one exponent each, the same rule), "bucket" (one for
            all layers, from the largest finite maximum), "none" (all zero).
        headroom: how many gradients each encoded value sums (hierarchical
            two_phase encodes the sums of a node's L ranks: L), computed in
            float64 so the product is exact.

    Returns:
        int32 tensor like ``amax``: the largest ``e`` with
        ``headroom * amax * 2**e <= fmt.max``, clamped to +-126; 0 for zero
        or non-finite maxima.
    """
    fmt = get_format(fmt)
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if reduction not in ("allreduce", "two_phase"):
        raise ValueError(f"reduction must be 'allreduce' or 'two_phase', got {reduction!r}")
    if headroom < 1:
        raise ValueError(f"headroom must be >= 1, got {headroom}")
    if scaling == "none":
        return torch.zeros(amax.shape, dtype=torch.int32, device=amax.device)
    a = amax.double() * headroom
    usable = torch.isfinite(a) & (a > 0)
    if scaling == "bucket":
        finite_max = torch.where(usable, a, 0.0).max() if a.numel() else a.new_zeros(())
        a = torch.where(usable, finite_max, a)
    if reduction == "allreduce":
        safe = torch.where(usable, a, 1.0)
        e = _largest_exponent(safe * world_size, fmt.max)
        # amax * 2**e <= FMAX / N, but it is encoded rounded: where the rounded
        # value times N passes FMAX (fp16, N = 13, amax 5038.5: 13 * 5040 is
        # inf), one less. Then it fits: a binade's next value is at most twice
        # the last, so the rounded half is at most FMAX / N.
        over = _round_up_to(safe * torch.exp2(e), fmt) * world_size > fmt.max
        e = torch.where(over, e - 1, e)
    else:
        # The owner's FP32 sum of N scaled values must not overflow either:
        # it matters for formats whose max is near float32's (BF16).
        e = torch.minimum(
            _largest_exponent(torch.where(usable, a, 1.0), fmt.max),
            _largest_exponent(torch.where(usable, a * world_size, 1.0), _FLOAT32_MAX),
        )
    e = torch.where(usable, e, 0.0).clamp_(-EXPONENT_LIMIT, EXPONENT_LIMIT)
    return e.to(torch.int32)


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _round_up_to(y: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Positive float64 ``y`` rounded to ``fmt`` as the encoder rounds it (nearest,
    ties to even, saturating at ``fmt.max``); exact in float64."""
    _, ex = torch.frexp(y)
    lead = (ex - 1).clamp_(min=fmt._emin).double()  # the leading bit's exponent
    quantum = torch.exp2(lead - fmt.man_bits)
    m = y / quantum  # exact: a power of two
    if fmt.man_bits == 0:
        # No mantissa bit: ties go to the even code, whose last bit is the exponent's.
        down = (m == 1.5) & (torch.remainder(lead + fmt.bias, 2) == 0)  # type: ignore[operator]
        r = torch.where(down, torch.ones_like(m), torch.round(m))
    else:
        r = torch.round(m)  # half to even
    return (r * quantum).clamp_(max=fmt.max)


def _largest_exponent(need: torch.Tensor, limit: float) -> torch.Tensor:
    """Largest integer e with need * 2**e <= limit (float64, exact)."""
    # float64 is exact here: need has at most 24 + 29 significant bits.
    e = torch.floor(torch.log2(limit / need))
    # log2 of a rounded quotient can be off by one at powers of two: fix exactly.
    e = torch.where(need * torch.exp2(e) > limit, e - 1, e)
    return torch.where(need * torch.exp2(e + 1) <= limit, e + 1, e)


@dataclasses.dataclass(frozen=True)
class Factors:
    """Per-layer factors of one format group for one route (float32, on the maxima's device).

    Attributes:
        exponents: the exponents the values were encoded with (the node sums'
            for staged routes), for telemetry.
        scale: applied before the first encoding that sums (the node sums'
            for hierarchical, from ``first``'s scale for the grid).
        unscale: applied after the last decoding; NaN for layers whose
            maximum is not finite (so they come back NaN on every rank).
            Native sums include the division by N.
        shift: staged routes: from the node sums' scale to the mean's.
        first: the grid: each rank's own values' scale (headroom 1).
    """

    exponents: torch.Tensor
    scale: torch.Tensor
    unscale: torch.Tensor
    shift: torch.Tensor | None = None
    first: torch.Tensor | None = None


def factors(
    amax: torch.Tensor,
    fmt: FloatFormat,
    route: str,
    *,
    world_size: int,
    scaling: Scaling | str = "layer",
    ranks_per_node: int = 1,
    divide: bool = True,
    counts: torch.Tensor | None = None,
) -> Factors:
    """The scale factors of one format group: the one rule of the hook, FSDP and the simulator.

    Args:
        amax: the all-reduced maxima of the group's layers.
        fmt: the wire format.
        route: "allreduce" (the sum happens in the wire format), "two_phase",
            "hierarchical" or "grid" (:class:`aps_comm.config.Route`).
        world_size: N.
        scaling: "layer", "bucket", "block" or "none".
        ranks_per_node: staged routes: ranks per node (or the grid's rows) L.
        divide: native sums: fold 1/N into ``unscale`` (the mean); two_phase
            owners divide before re-encoding, so they never need it.
        counts: block scaling only: how many of ``amax``'s blocks each layer
            has (int64 on ``amax``'s device, :attr:`aps_comm.layout.Blocks.device_counts`);
            every factor is then per block, and a block whose maximum is not
            finite makes ``unscale`` NaN for every block of its layer.

    Example:
        >>> f = factors(torch.tensor([3.0, float("nan")]), get_format("e4m3"), "allreduce",
        ...             world_size=4)
        >>> f.scale, f.unscale
        (tensor([32.,  1.]), tensor([0.0078,    nan]))
    """
    if scaling == "block":
        if counts is None:
            raise ValueError(
                "scaling='block' needs the blocks' maxima and each layer's block count (counts)"
            )
        finite = _layer_finite(amax, counts)
    elif counts is not None:
        raise ValueError(f"counts is for scaling='block', got scaling={scaling!r}")
    else:
        finite = torch.isfinite(amax)
    exps = _route_exponents(amax, fmt, route, world_size, scaling, ranks_per_node)
    return _assemble(exps, finite, route, world_size, divide)


def _route_exponents(
    amax: torch.Tensor,
    fmt: FloatFormat,
    route: str,
    world_size: int,
    scaling: Scaling | str,
    ranks_per_node: int,
) -> torch.Tensor:
    """The route's exponents as rows of an int32 tensor: staged (inner, outer), else one."""
    if route in ("hierarchical", "grid"):
        n_nodes = world_size // ranks_per_node
        # The node sums add L gradients: headroom L. The mean sent back needs none.
        inner = exponents(
            amax,
            fmt,
            world_size=n_nodes,
            reduction="two_phase",
            scaling=scaling,
            headroom=ranks_per_node,
        )
        outer = exponents(amax, fmt, world_size=world_size, reduction="two_phase", scaling=scaling)
        return torch.stack([inner, outer])
    reduction = "two_phase" if route == "two_phase" else "allreduce"
    return exponents(amax, fmt, world_size=world_size, reduction=reduction, scaling=scaling)[None]


def _assemble(
    exps: torch.Tensor, finite: torch.Tensor, route: str, world_size: int, divide: bool
) -> Factors:
    """The factors of :func:`_route_exponents`' rows; NaN unscale where not ``finite``."""
    if route in ("hierarchical", "grid"):
        inner, outer = exps.unbind()
        unscale = torch.where(finite, pow2(-outer), float("nan"))
        if route == "grid":
            # The grid's first level sends each rank's gradient (headroom 1);
            # its sums of L of them move from that scale to the inner one.
            return Factors(inner, pow2(inner - outer), unscale, pow2(outer - inner), pow2(outer))
        return Factors(inner, pow2(inner), unscale, pow2(outer - inner))
    e = exps[0]
    unscale = pow2(-e)
    if route != "two_phase" and divide:
        unscale = unscale / world_size
    return Factors(e, pow2(e), torch.where(finite, unscale, float("nan")))


KEY_ZERO, KEY_BAD = 0, 255
"""Exponent keys of a zero maximum (no constraint) and of a non-finite one (wins every MAX)."""


def exponent_keys(
    amax: torch.Tensor,
    fmt: FloatFormat,
    route: str,
    *,
    world_size: int,
    ranks_per_node: int = 1,
    scaling: Scaling | str = "block",
) -> torch.Tensor:
    """One byte per exponent of this rank's own maxima, to agree on with a MAX all-reduce.

    Every exponent rule is non-increasing in ``amax``, so the exponent of
    the ranks' largest maximum is the smallest of their own exponents. The
    key is ``127 - e`` (1 to 253) for a finite non-zero maximum, 0 for a zero
    one (no constraint) and 255 for a non-finite one (it wins, and marks the
    layer for NaN): the MAX over ranks of the keys gives, through
    :func:`factors_from_keys`, exactly :func:`factors` of the MAX of the
    maxima, at one byte per block (two for staged routes) instead of four.

    Args:
        amax: this rank's maxima (per block, or per layer).
        fmt: the wire format.
        route: as in :func:`factors`.
        world_size: N.
        ranks_per_node: staged routes' L.
        scaling: "block" or "layer" (per-entry rules; "bucket" is not one).

    Returns:
        uint8 tensor of shape (rows, len(amax)): rows = 2 for hierarchical
        and grid (the inner and outer exponents), else 1.

    Example:
        >>> exponent_keys(torch.tensor([3.0, 0.0, float("nan")]), get_format("e4m3"),
        ...               "two_phase", world_size=4)
        tensor([[120,   0, 255]], dtype=torch.uint8)
    """
    if scaling not in ("block", "layer"):
        raise ValueError(f"exponent keys need scaling 'block' or 'layer', got {scaling!r}")
    fmt = get_format(fmt)
    if (
        route == "two_phase"
        and amax.device.type == "cpu"
        and cpu_kernels.AVAILABLE
        and amax.dtype == torch.float32
        and amax.dim() == 1
        and fmt.max * world_size <= _FLOAT32_MAX
    ):
        # Integer work on the bits (thousands of blocks per bucket, every step);
        # the FP32 sum's bound cannot bind here.
        out = torch.empty((1, amax.numel()), dtype=torch.uint8)
        v = amax.contiguous().abs()
        cpu_kernels.two_phase_keys(
            v.masked_fill_(torch.isnan(v), float("inf")), fmt, EXPONENT_LIMIT, out[0]
        )
        return out
    exps = _route_exponents(amax, fmt, route, world_size, scaling, ranks_per_node)
    keys = torch.where(amax == 0, KEY_ZERO, 127 - exps)
    return torch.where(torch.isfinite(amax), keys, KEY_BAD).to(torch.uint8)


def block_keys_into(
    x: torch.Tensor,
    layout: Layout,
    fmt: FloatFormat,
    route: str,
    world_size: int,
    out: tuple[torch.Tensor, torch.Tensor],
    ranks_per_node: int = 1,
) -> None:
    """This rank's max |x| of every block and its key under ``route``'s rule, written into
    ``out`` (float32 maxima, uint8 keys; the staged routes' two rows, inner then outer,
    one after the other): :func:`blocks_amax` and :func:`exponent_keys` by tensor ops, no
    host read (a settled bucket's keys on the codec backends without fused kernels)."""
    maxima, keys = out
    maxima.copy_(blocks_amax(x, layout))
    rows = exponent_keys(maxima, fmt, route, world_size=world_size, ranks_per_node=ranks_per_node)
    keys.view(rows.shape).copy_(rows)


def factors_from_keys(
    keys: torch.Tensor,
    fmt: FloatFormat,
    route: str,
    *,
    world_size: int,
    divide: bool = True,
    counts: torch.Tensor | None = None,
) -> Factors:
    """:func:`factors` from the MAX over ranks of :func:`exponent_keys` (no host read).

    Args:
        keys: the all-reduced keys (uint8, shape (rows, n)).
        fmt: the wire format (unused by the arithmetic, kept for symmetry
            with :func:`factors` and checked).
        route: as in :func:`factors`.
        world_size: N.
        divide: native sums: fold 1/N into ``unscale``.
        counts: block scaling: blocks per layer (a key of 255 makes its
            whole layer NaN).

    Example:
        >>> keys = torch.tensor([[120, 0, 255]], dtype=torch.uint8)
        >>> factors_from_keys(keys, get_format("e4m3"), "two_phase", world_size=4).unscale
        tensor([0.0078, 1.0000,    nan])
    """
    get_format(fmt)
    bad = (keys == KEY_BAD).any(0)
    finite = ~bad if counts is None else _spread_finite(~bad, counts)
    return _assemble(key_exponents(keys), finite, route, world_size, divide)


def key_exponents(keys: torch.Tensor) -> torch.Tensor:
    """The exponents (int32) that :func:`exponent_keys` encoded: 0 for a zero or bad key.

    Example:
        >>> key_exponents(torch.tensor([120, 0, 255], dtype=torch.uint8))
        tensor([7, 0, 0], dtype=torch.int32)
    """
    table = _exponent_table(str(keys.device))
    return torch.index_select(table, 0, keys.reshape(-1).long()).view(keys.shape)


@functools.lru_cache(maxsize=16)
def _exponent_table(device: str) -> torch.Tensor:
    k = torch.arange(256, dtype=torch.int32, device=device)
    return torch.where((k == KEY_ZERO) | (k == KEY_BAD), 0, 127 - k)


def key_factors(keys: torch.Tensor, *, unscale: bool) -> torch.Tensor:
    """``2**e`` (or with ``unscale`` ``2**-e``) of each key's exponent, float32, by lookup.

    The same values as ``pow2(+-key_exponents(keys))`` (1 for zero and bad
    keys) in one gather from a 256-entry table built on the keys' device
    (no host copy): every chunk's factors, every step.

    Example:
        >>> key_factors(torch.tensor([120, 0], dtype=torch.uint8), unscale=True)
        tensor([0.0078, 1.0000])
    """
    # index_select with int64 indices: 4x faster than advanced indexing on CPU.
    table = _factor_table(str(keys.device), unscale)
    return torch.index_select(table, 0, keys.reshape(-1).long()).view(keys.shape)


@functools.lru_cache(maxsize=16)
def _factor_table(device: str, unscale: bool) -> torch.Tensor:
    e = key_exponents(torch.arange(256, dtype=torch.int32, device=device))
    return pow2(-e if unscale else e)


def bad_layers(keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per layer, 1 (uint8) where any of its blocks' keys is ``KEY_BAD``, else 0.

    Args:
        keys: one key per block (uint8), the layers' blocks in order.
        counts: blocks per layer (int64, on the keys' device).

    Example:
        >>> bad_layers(torch.tensor([3, 255, 0], dtype=torch.uint8), torch.tensor([2, 1]))
        tensor([1, 0], dtype=torch.uint8)
    """
    return _layers_any(keys, counts, KEY_BAD)


def _layers_any(values: torch.Tensor, counts: torch.Tensor, value: int) -> torch.Tensor:
    """Per layer, 1 (uint8) where any of its ``counts`` uint8 ``values`` equals ``value``."""
    out = torch.empty(counts.numel(), dtype=torch.uint8, device=values.device)
    if values.device.type == "cpu" and cpu_kernels.AVAILABLE:
        # segment_reduce takes 1.5 ms for 512k blocks on one CPU thread, every step.
        cpu_kernels.layer_any(values.contiguous(), counts, value, out)
        return out
    hits = (values == value).float()
    return torch.segment_reduce(hits, "max", lengths=counts, unsafe=True, initial=0.0).to(out)


def _layer_finite(amax: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per block: whether every block of its layer has a finite maximum (no host read)."""
    return _spread_finite(torch.isfinite(amax), counts)


def _spread_finite(finite: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per block: whether every block of its layer is ``finite`` (no host read)."""
    layer_bad = _layers_any(finite.contiguous().view(torch.uint8), counts, 0)
    return torch.repeat_interleave(layer_bad == 0, counts, output_size=finite.numel())


def mean_exponents(amax: torch.Tensor, exps: torch.Tensor, fmt: FloatFormat | str) -> torch.Tensor:
    """Extra exponents ``d`` (int32) for a two_phase owner's mean, per block.

    The owner's mean of N scaled values (scaled by ``2**exps``) is often far
    below the block's maximum (by up to N), so re-encoding it with ``exps``
    flushes it in narrow formats. The owner scales it by ``2**d`` more:
    the largest ``d`` with ``amax * 2**d <= fmt.max`` (no headroom: nothing
    sums it afterwards), capped so that ``exps + d <= 126`` (the receivers
    unscale by ``2**-(exps + d)``, a normal float32); 0 for zero blocks.

    Args:
        amax: max |mean| of every block of the owner's shard, in the scaled
            domain (:func:`block_amax` of :meth:`aps_comm.codec.Codec.shard_mean`).
        exps: the blocks' agreed exponents (what the shards were encoded with).
        fmt: the wire format.

    Example:
        >>> mean_exponents(torch.tensor([0.5, 0.0]), torch.tensor([120, 3]), "e4m3")
        tensor([6, 0], dtype=torch.int32)
    """
    d = exponents(amax, fmt, world_size=1, reduction="two_phase", scaling="layer")
    return torch.minimum(d, EXPONENT_LIMIT - exps.to(torch.int32))
