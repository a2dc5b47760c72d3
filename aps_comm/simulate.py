"""Simulated all-reduce over many virtual workers in one process (CPD, exact and fast).

The APS authors wrote CPD to study number formats that hardware lacks on
more workers than they had. This module does the same, bit for bit with the
real hook: :func:`allreduce` takes every worker's gradients stacked along a
leading dimension N and returns the averaged gradients every worker would
end with, for any :class:`~aps_comm.formats.FloatFormat`, with the hook's
scaling and exponent rules (:mod:`aps_comm.scaling`) and a choice of
accumulation order. :class:`VirtualWorkers` trains a model as N data-parallel
workers on one process (CPD's emulated nodes).

Accumulation orders (``reduction``); ``q_r`` is worker r's scaled gradient
rounded to the wire format, every addition is computed in float32 and
rounded to the accumulator format (the wire format unless ``accumulator`` is
given), which equals one correctly rounded addition in that format (double
rounding is innocuous since float32 has at least 2p + 2 bits for p <= 11):

- ``"two_phase"``: the hook's two-phase reduction. The shard owner sums in
  FP32 in rank order, ``((q_0 + q_1) + ...) + q_{N-1}``, divides by N in
  float32, rounds the mean to the wire format; result = that * 2**-e.
- ``"ring"``: a native all-reduce in the wire format (reduce-scatter, then
  all-gather), in exactly Gloo's order, so it reproduces
  ``dist.all_reduce`` of FP16/BF16 tensors on Gloo bit for bit (see below).
- ``"tree"``: a binary (binomial) tree: at step k rank r (a multiple of
  2**(k+1)) adds the partial sum of rank r + 2**k; log2(N) steps.
- ``"sequential"``: ``((q_0 + q_1) + q_2) + ...`` rounding every partial sum.
- ``"hierarchical"``: the hook's hierarchical two_phase over nodes of
  ``ranks_per_node`` (L) workers, node-major. Each node sums its workers'
  float32 gradients in order, the sum times ``2**e_in`` (exponents with
  headroom for L gradients) is rounded to the wire format, the M node sums
  are added in FP32 in node order and divided by N, that mean times
  ``2**(e - e_in)`` (``e``: the two_phase exponent) is rounded to the wire
  format; result = that * 2**-e.
- ``"grid"``: the hook's grid two_phase: the same on a virtual g x N/g
  grid (g from :func:`aps_comm.topology.grid_rows`), where each worker's
  gradient times ``2**e`` is rounded to the wire format first, the g rounded
  values of a row are summed in FP32 in order, and that sum times
  ``2**(e_in - e)`` is rounded again before the column level.

For the three wire-format orders the exponent rule leaves headroom for the
N-way sum (``reduction="allreduce"`` in :func:`~aps_comm.scaling.exponents`),
the final sum is rounded to the wire format (what the all-gather carries)
and multiplied by ``2**-e / N`` computed in float32 (one rounding), exactly
as the hook's native path does. A partial sum beyond the format's range
becomes inf in formats with inf (IEEE overflow, as Gloo's FP16 sum does)
and saturates in formats without (e4m3fn, fp6, fp4); the workers' own
contributions saturate, as the hook's encoder does. Layers whose maximum is
not finite come back NaN everywhere; zero layers come back zero.

Gloo's ring order (``gloo/allreduce.cc``, verified on torch's Gloo backend
for 3 to 5 ranks, buffers of 10 to 8M FP16 elements, sizes that do and do
not divide): the buffer of ``n`` elements of ``s`` bytes is cut into
``S = roundUp(max(ceil(n*s / 1 MiB), 2*N), N)`` segments of
``ceil(ceil(n*s / S) / s)`` elements (the last ones short or empty); rank c
owns the ``S/N`` consecutive segments ``c*S/N ... (c+1)*S/N - 1`` (its
"chunk"). Chunk c's partial sum starts at rank c-1 and travels down the
ring, so its elements are summed as
``(((x[c-1] + x[c-2]) + ...) + x[c+1]) + x[c]`` (ranks mod N), each addition
rounded to FP16. Large buffers are pipelined in more segments (at most
1 MiB each), which does not change this order but does move the chunk
boundaries: with 3 ranks and 8,000,000 FP16 elements (16 MB, 18 segments of
444,445) chunk 1 starts at element 2,666,670, not at ceil(n/3) = 2,666,667;
with 4 ranks and 1001 elements the chunks are 252, 252, 252, 245 elements,
not 251, 250, 250, 250. :func:`ring_chunks` gives the boundaries.

All layers passed to one call form one bucket: the ring's chunks run over
their concatenation, and ``scaling="bucket"`` shares one exponent among them.
``scaling="block"`` gives every ``block_size`` elements of a layer (from the
layer's start; the last block may be short) its own exponent from the
block's maximum over all workers, by the same rule as a layer's (native
orders: headroom N; two_phase: none; hierarchical and grid: per stage); the
two_phase owner re-encodes the mean with the same block exponents, and a
non-finite block makes its layer NaN.

Example:
    >>> gen = torch.Generator().manual_seed(0)
    >>> g = torch.randn(64, 1000, generator=gen) * 1e-3  # 64 workers, one layer
    >>> def error(reduction):
    ...     [avg] = allreduce([g], "e4m3", reduction=reduction)
    ...     return round(float((avg - g.mean(0)).norm() / g.mean(0).norm()), 2)
    >>> error("two_phase"), error("ring")  # FP32 sum vs 63 sums rounded to e4m3
    (0.04, 0.16)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypedDict

import torch
import torch.nn as nn
from typing_extensions import Unpack

from aps_comm import codec
from aps_comm.config import SCALINGS, Scaling, check_block_size, default_block_size
from aps_comm.formats import FP32, FloatFormat, Rounding, get_format, pow2, quantize
from aps_comm.plan import block_chunks, block_shard_cuts, shard_layout
from aps_comm.scaling import Factors, factors, layer_amax, mean_exponents
from aps_comm.telemetry import LayerStats
from aps_comm.topology import grid_rows

__all__ = [
    "GLOO_MAX_SEGMENT_BYTES",
    "ORDERS",
    "Order",
    "Scattered",
    "SimConfig",
    "SimOptions",
    "VirtualWorkers",
    "allreduce",
    "allreduce_feedback",
    "hook_options",
    "records",
    "reduce_scatter",
    "ring_chunks",
]

Order = Literal["two_phase", "ring", "tree", "sequential", "hierarchical", "grid"]
ORDERS: tuple[str, ...] = ("two_phase", "ring", "tree", "sequential", "hierarchical", "grid")

GLOO_MAX_SEGMENT_BYTES = 1 << 20
"""Gloo's ``AllreduceOptions::kMaxSegmentSize``: the largest message of its ring."""

# Elements (workers x layer slice) processed at once: bounds the temporaries
# to a few hundred MB for N = 256 while keeping every op large enough to be
# bandwidth-bound.
_BLOCK_ELEMENTS = 1 << 23


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """How the simulated workers communicate (the arguments of :func:`allreduce`).

    Attributes:
        fmt: wire format.
        reduction: accumulation order, one of :data:`ORDERS`.
        scaling: "layer" (APS), "bucket", "block" or "none".
        accumulator: format of the running sum (CPD's mid-result precision);
            None: FP32 for "two_phase", the wire format otherwise.
        kahan: Kahan-compensated accumulation (the compensation is kept in
            the accumulator format).
        rounding: "nearest" (even) or "stochastic", for every rounding to a
            format narrower than float32.
        ranks_per_node: workers per node L, for "hierarchical" (must divide N).
        block_size: elements per block for ``scaling="block"`` (8 to 256); None: the
            hook's default for ``fmt`` (:func:`aps_comm.config.default_block_size`).
        owner_exponents: two_phase with block scaling: the shard owner gives
            each block of the mean its own exponent on top of the agreed one
            (:func:`aps_comm.scaling.mean_exponents`, one more byte per block
            with the all-gather), as the hook does where shards hold whole
            blocks.
        rank_exponents: block scaling, no agreement before the exchange.
            two_phase: each worker encodes with its own block exponents
            (sent with its shard), the owner decodes every shard with its
            sender's, sums in FP32, and gives each block of the mean its own
            exponent (sent with the all-gather). hierarchical and grid: every
            level's owner does the same (see :func:`_staged_rank_blocks`).
        chunk_elements: hierarchical and grid with ``rank_exponents``: the
            hook's chunk (elements, before it moves to block boundaries:
            :attr:`aps_comm.APSState.bucket_chunks`), which decides who owns
            what (None: the whole bucket is one chunk).
        formats: each layer's wire format, as a policy (``KeepLast``,
            ``ByName``, ``Schedule``, ``Promote``) assigns them; None: ``fmt``
            for every layer. The layers of each format form a bucket of their
            own (the hook's format groups, in the order the formats first
            appear), reduced as the rest of the config says; FP32 layers are
            averaged as ``allreduce_hook`` does (each value divided by N, then
            summed in float32 in Gloo's ring order, :func:`ring_chunks`).

    Example:
        >>> cfg = SimConfig("e5m2", reduction="ring", accumulator="fp16")
        >>> cfg.accumulator.name
        'fp16'
    """

    fmt: FloatFormat | str = "e4m3"
    reduction: Order = "two_phase"
    scaling: Scaling = "layer"
    accumulator: FloatFormat | str | None = None
    kahan: bool = False
    rounding: Rounding = "nearest"
    ranks_per_node: int = 1
    block_size: int | None = None
    owner_exponents: bool = False
    rank_exponents: bool = False
    chunk_elements: int | None = None
    formats: Sequence[FloatFormat | str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", get_format(self.fmt))
        if self.formats is not None:
            object.__setattr__(self, "formats", tuple(get_format(f) for f in self.formats))
        if self.block_size is None:  # the hook's default for the format
            object.__setattr__(self, "block_size", default_block_size(self.fmt.bits))
        if self.accumulator is not None:
            object.__setattr__(self, "accumulator", get_format(self.accumulator))
        if self.reduction not in ORDERS:
            raise ValueError(f"reduction must be one of {ORDERS}, got {self.reduction!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {self.rounding!r}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        check_block_size(self.block_size)
        for name, orders in (
            ("owner_exponents", ("two_phase",)),
            ("rank_exponents", ("two_phase", "hierarchical", "grid")),
        ):
            if getattr(self, name) and (self.scaling != "block" or self.reduction not in orders):
                raise ValueError(
                    f"{name} needs scaling='block' and reduction in {orders}, got "
                    f"scaling={self.scaling!r}, reduction={self.reduction!r}"
                )
        if self.chunk_elements is not None and not (
            self.rank_exponents and self.reduction in ("hierarchical", "grid")
        ):
            raise ValueError(
                "chunk_elements needs rank_exponents and reduction 'hierarchical' or "
                f"'grid', got rank_exponents={self.rank_exponents}, "
                f"reduction={self.reduction!r}"
            )
        if self.chunk_elements is not None and self.chunk_elements < 1:
            raise ValueError(f"chunk_elements must be >= 1, got {self.chunk_elements}")
        if self.reduction in ("hierarchical", "grid") and (
            self.accumulator is not None or self.kahan
        ):
            raise ValueError(f"{self.reduction} sums in float32: no accumulator format, no Kahan")


def ring_chunks(
    numel: int,
    world_size: int,
    element_bytes: int,
    max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES,
) -> list[int]:
    """Start offsets of Gloo's ring chunks (the element ranges each rank reduces).

    Args:
        numel: elements in the all-reduced buffer.
        world_size: number of ranks N.
        element_bytes: bytes per element of the buffer's dtype (2 for FP16).
        max_segment_bytes: Gloo's largest message, 1 MiB.

    Returns:
        N + 1 offsets: rank c reduces elements ``[out[c], out[c+1])``, which
        may be empty for the last ranks.

    Example:
        >>> ring_chunks(1001, 4, 2)
        [0, 252, 504, 756, 1001]
    """
    if numel <= 0 or world_size <= 0 or element_bytes <= 0:
        raise ValueError("numel, world_size and element_bytes must be positive")
    total = numel * element_bytes
    seg_cap = element_bytes * max(1, max_segment_bytes // element_bytes)
    n_seg = _ceil_div(max(_ceil_div(total, seg_cap), 2 * world_size), world_size) * world_size
    seg_bytes = _ceil_div(_ceil_div(total, n_seg), element_bytes) * element_bytes
    chunk = (n_seg // world_size) * (seg_bytes // element_bytes)
    return [min(c * chunk, numel) for c in range(world_size)] + [numel]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _element_bytes(fmt: FloatFormat) -> int:
    # A 4-bit format has no native sum anywhere; count it as one byte.
    return max(1, fmt.wire_bits // 8)


# ---------------------------------------------------------------------------
# rounding


def _wire_round(
    fmt: FloatFormat, rounding: Rounding, generator: torch.Generator | None, *, overflow: bool
) -> Callable[..., torch.Tensor]:
    """A function ``rnd(x, scale=None)`` rounding float32 ``x * scale`` to ``fmt`` (in float32).

    ``overflow=False`` saturates (the encoder of a worker's contribution);
    ``overflow=True`` turns results beyond the range into inf where the
    format has inf (an adder's overflow).
    """
    if fmt == FP32:
        return lambda x, scale=None: x if scale is None else x * scale
    # Round to nearest even takes |x| >= max + half an ulp past max (max's
    # mantissa is odd in "ieee" formats); stochastic rounding anything past max.
    half_ulp = 2.0 ** (fmt._emax - fmt.man_bits - 1) if rounding == "nearest" else 0.0
    limit = fmt.max + half_ulp

    def rnd(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        if rounding == "nearest" and codec.backend_for(fmt, x.device) == "kernels":
            # The codec's compiled encoder (RNE, saturating, scale fused) and
            # decoder: two passes, 20x faster than the generic quantize().
            if scale is not None and scale.numel() > 1:
                # Block scales, one per element: x * scale in float32 is what
                # the fused encoder computes.
                x, scale = x * scale, None
            flat = x.contiguous().view(-1)
            factor = None if scale is None else scale.reshape(1).float()
            codes = codec.encode(flat, fmt, scale=factor)
            q = codec.decode(codes, fmt, flat.numel()).view(x.shape)
        else:
            x = x if scale is None else x * scale
            q = quantize(x, fmt, rounding=rounding, generator=generator)
        if overflow and fmt.has_inf:
            big = x.abs() if scale is None else (x * scale).abs()
            if float(big.max()) >= limit if big.numel() else False:
                over = big >= limit if rounding == "nearest" else big > limit
                inf = torch.copysign(torch.full_like(q, float("inf")), q)
                q = torch.where(over, inf, q)
        return q

    return rnd


@dataclasses.dataclass
class _Acc:
    """A partial sum with its Kahan compensation (``value - comp`` is the estimate)."""

    value: torch.Tensor
    comp: torch.Tensor | None


def _add(a: _Acc, b: _Acc, rnd: Callable[[torch.Tensor], torch.Tensor]) -> _Acc:
    """a + b, every operation rounded by ``rnd``; Kahan-compensated when a carries comp."""
    if a.comp is None:
        return _Acc(rnd(a.value + b.value), None)
    # Kahan's step generalised to two compensated operands (the tree adds
    # two partial sums); with b.comp = 0 it is the textbook recurrence.
    comp = a.comp if b.comp is None else rnd(a.comp + b.comp)
    y = rnd(b.value - comp)
    t = rnd(a.value + y)
    return _Acc(t, rnd(rnd(t - a.value) - y))


def _start(x: torch.Tensor, kahan: bool) -> _Acc:
    return _Acc(x, torch.zeros_like(x) if kahan else None)


# ---------------------------------------------------------------------------
# accumulation orders over the leading (worker) dimension


def _sum_sequential(q: torch.Tensor, rnd: Callable, kahan: bool) -> torch.Tensor:
    acc = _start(q[0], kahan)
    for r in range(1, q.shape[0]):
        acc = _add(acc, _Acc(q[r], None), rnd)
    return acc.value


def _sum_tree(q: torch.Tensor, rnd: Callable, kahan: bool) -> torch.Tensor:
    parts = _start(q, kahan)
    while parts.value.shape[0] > 1:
        n = parts.value.shape[0]
        even = n - n % 2
        left = _Acc(parts.value[0:even:2], None if parts.comp is None else parts.comp[0:even:2])
        right = _Acc(parts.value[1:even:2], None if parts.comp is None else parts.comp[1:even:2])
        merged = _add(left, right, rnd)
        if n % 2:  # the last rank has no partner at this step: it moves up unchanged
            merged = _Acc(
                torch.cat([merged.value, parts.value[-1:]]),
                None if merged.comp is None else torch.cat([merged.comp, parts.comp[-1:]]),
            )
        parts = merged
    return parts.value[0]


def _sum_ring(q: torch.Tensor, owner: torch.Tensor, rnd: Callable, kahan: bool) -> torch.Tensor:
    """Gloo's reduce-scatter: element i is summed from rank owner[i]-1 downwards."""
    n = q.shape[0]
    if n == 1:
        return q[0]

    def rank_row(k: int) -> torch.Tensor:
        # Row (owner - k) mod N of every column: one gather per hop.
        return q.gather(0, ((owner - k) % n).unsqueeze(0)).squeeze(0)

    acc = _start(rank_row(1), kahan)
    for k in [*range(2, n), 0]:
        acc = _add(acc, _Acc(rank_row(k), None), rnd)
    return acc.value


# ---------------------------------------------------------------------------
# allreduce


class SimOptions(TypedDict, total=False):
    """:class:`SimConfig`'s fields besides ``fmt``, as :func:`allreduce` takes them by keyword.

    Example:
        >>> options: SimOptions = {"reduction": "ring", "accumulator": "fp16"}
        >>> SimConfig("e5m2", **options).accumulator.name
        'fp16'
    """

    reduction: Order
    scaling: Scaling
    accumulator: FloatFormat | str | None
    kahan: bool
    rounding: Rounding
    ranks_per_node: int
    block_size: int | None
    owner_exponents: bool
    rank_exponents: bool
    chunk_elements: int | None
    formats: Sequence[FloatFormat | str] | None


def allreduce(
    layers: Sequence[torch.Tensor],
    fmt: FloatFormat | str,
    *,
    generator: torch.Generator | None = None,
    **options: Unpack[SimOptions],
) -> list[torch.Tensor]:
    """Average N virtual workers' gradients as the APS hook would, in any format and order.

    Args:
        layers: one tensor per parameter, shape ``(N, *param_shape)``: slice
            r is worker r's gradient. They form one bucket, in this order.
        fmt: wire format (a FloatFormat or a name).
        reduction: accumulation order: "two_phase", "ring", "tree" or
            "sequential" (see the module docstring).
        scaling: "layer" (APS), "bucket", "block" or "none", as in the hook.
            "block": every ``block_size`` elements of a layer (from its
            start) get their own exponent from their maximum over the N
            workers, with the reduction's headroom rule; a non-finite block
            makes its layer NaN.
        accumulator: format of the running sum; None: FP32 for "two_phase",
            the wire format for the others.
        kahan: Kahan-compensated accumulation in the accumulator format.
        rounding: "nearest" or "stochastic", for every rounding to a format
            narrower than float32 (contributions, partial sums, the result).
        generator: random generator for stochastic rounding.
        ranks_per_node: workers per node L, for "hierarchical"; must divide N.
        block_size: elements per block for ``scaling="block"`` (None: the format's default).
        owner_exponents: two_phase with block scaling: the owner re-chooses
            each block's exponent for the mean (see :class:`SimConfig`).
        rank_exponents: block scaling: every worker's own block exponents,
            and every level's owner's for what it forwards (two_phase,
            hierarchical, grid; see :class:`SimConfig`).
        chunk_elements: hierarchical and grid with ``rank_exponents``: the
            hook's chunk, which decides who owns what (None: one chunk; see
            :class:`SimConfig`).
        formats: each layer's format (FP32 layers averaged as
            ``allreduce_hook`` does); None: ``fmt`` for all (see :class:`SimConfig`).

    Returns:
        One float32 tensor per layer, shape ``param_shape``: the averaged
        gradient every worker ends with.

    Example:
        >>> g = torch.randn(4, 3, 5)
        >>> [avg] = allreduce([g], "fp32")
        >>> torch.allclose(avg, g.mean(0))
        True
    """
    cfg = SimConfig(fmt, **options)
    layers = list(layers)
    if not layers:
        return []
    n = _check_layers(layers)
    if cfg.formats is not None:
        out: list[torch.Tensor] = [layers[0]] * len(layers)
        for f, index in _format_groups(cfg, len(layers)):
            group = [layers[i] for i in index]
            if f == FP32:
                done = _fp32_mean(group, n)
            else:
                # One block size for every group: the bucket format's (the hook's setting).
                sub = {k: v for k, v in options.items() if k != "formats"}
                sub["block_size"] = cfg.block_size
                done = allreduce(group, f, generator=generator, **sub)  # type: ignore[misc]
            for i, r in zip(index, done, strict=True):
                out[i] = r
        return out
    if cfg.reduction in ("hierarchical", "grid"):
        return _hierarchical(layers, cfg.fmt, n, cfg, generator)  # type: ignore[arg-type]
    flat = [t.detach().reshape(n, -1) for t in layers]
    return [
        r.view(t.shape[1:]) for r, t in zip(_flat(flat, n, cfg, generator), layers, strict=True)
    ]


def _format_groups(cfg: SimConfig, n_layers: int) -> list[tuple[FloatFormat, list[int]]]:
    """Each format of ``cfg.formats`` (in the order it first appears) and its layers."""
    assert cfg.formats is not None
    if len(cfg.formats) != n_layers:
        raise ValueError(f"formats names {len(cfg.formats)} layers, the bucket has {n_layers}")
    groups: dict[FloatFormat, list[int]] = {}
    for i, f in enumerate(cfg.formats):
        groups.setdefault(f, []).append(i)  # type: ignore[arg-type]
    return list(groups.items())


def _fp32_mean(layers: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """``allreduce_hook``'s mean of FP32 layers: every value divided by N, the quotients
    summed in float32 in Gloo's ring order over the layers' concatenation."""
    flat = torch.cat([t.detach().reshape(n, -1).float() for t in layers], dim=1) / n
    total = flat.shape[1]
    starts = torch.tensor(ring_chunks(max(total, 1), n, 4)[1:-1], dtype=torch.int64)
    owner = torch.bucketize(torch.arange(total), starts, right=True)
    mean = _sum_ring(flat, owner.to(flat.device), _identity, False)
    return [
        m.view(t.shape[1:])
        for m, t in zip(mean.split([t[0].numel() for t in layers]), layers, strict=True)
    ]


def allreduce_feedback(
    layers: Sequence[torch.Tensor],
    fmt: FloatFormat | str,
    residuals: Sequence[torch.Tensor | None] | None = None,
    **options: Unpack[SimOptions],
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """:func:`allreduce` with the hook's error feedback (``APSState(error_feedback=True)``).

    Every worker adds its residual to its gradient first; the sums are
    :func:`allreduce`'s of those values (block exponents agreed, no owner
    exponents). A worker's new residual is what its encoding lost, unscaled
    (its value minus the decoded code times ``2**-e``); with two_phase the
    owner of each element (one chunk, shards of
    :func:`aps_comm.plan.shard_layout`) adds N times what rounding the mean
    lost, unscaled. A layer that is not finite keeps a residual of zeros;
    FP32 layers (``formats``) send what they kept once more and keep none.

    Args:
        layers: one ``(N, *param_shape)`` tensor per layer, as in :func:`allreduce`.
        fmt: the wire format.
        residuals: each layer's ``(N, *param_shape)`` residuals, or None for
            none kept; None: none for any layer.
        **options: :class:`SimOptions`; ``reduction`` "two_phase" or "ring"
            (the native sum), nearest rounding.

    Returns:
        The averaged gradients (one per layer, as :func:`allreduce`'s) and
        every worker's new residuals (``(N, *param_shape)`` per layer; None
        for FP32 layers).

    Example:
        >>> g = torch.tensor([[[1.0, 0.3]], [[0.5, 0.0]]])  # 2 workers, one layer
        >>> [avg], [res] = allreduce_feedback([g], "e2m1")
        >>> res[0, 0].tolist()  # 0.3 * 2**2 = 1.2 encodes as 1: 0.05 lost
        [0.0, 0.050000011920928955]
    """
    layers = list(layers)
    kept = list(residuals) if residuals is not None else [None] * len(layers)
    if len(kept) != len(layers):
        raise ValueError(f"{len(kept)} residuals for {len(layers)} layers")
    sent = [x if r is None else x.float() + r for x, r in zip(layers, kept, strict=True)]
    cfg = SimConfig(fmt, **options)
    if cfg.reduction not in ("two_phase", "ring") or cfg.rank_exponents or cfg.owner_exponents:
        raise ValueError("error feedback needs reduction 'two_phase' or 'ring', exponents agreed")
    if cfg.rounding != "nearest" or cfg.accumulator is not None or cfg.kahan:
        raise ValueError("error feedback is simulated with nearest rounding, FP32 owners")
    if not layers:
        return [], []
    out = allreduce(sent, fmt, **options)
    n = _check_layers(layers)
    new: list[torch.Tensor | None] = [None] * len(layers)
    groups = _format_groups(cfg, len(layers)) if cfg.formats else [(cfg.fmt, range(len(layers)))]
    for f, index in groups:
        if f == FP32:
            continue
        group = [sent[i].detach().reshape(n, -1).float() for i in index]
        sub = dataclasses.replace(cfg, fmt=f, formats=None)
        for i, r in zip(index, _residuals(group, sub), strict=True):
            new[i] = r.view(layers[i].shape)
    return out, new


def _residuals(flat: list[torch.Tensor], cfg: SimConfig) -> list[torch.Tensor]:
    """Every worker's new residuals of one format group's ``(N, m)`` values (residuals in)."""
    fmt = cfg.fmt
    assert isinstance(fmt, FloatFormat)
    n, two_phase = flat[0].shape[0], cfg.reduction == "two_phase"
    amax = layer_amax(flat)
    f = _factors(flat, amax, fmt, "two_phase" if two_phase else "allreduce", n, cfg)
    finite = torch.isfinite(amax).tolist()
    scale, exps = _per_layer(f.scale, flat, cfg), _per_layer(f.exponents, flat, cfg)
    rnd = _wire_round(fmt, "nearest", None, overflow=False)
    numel = sum(x.shape[1] for x in flat)
    per = shard_layout(numel, fmt, n)[0]
    out, start = [], 0
    for i, x in enumerate(flat):
        m = x.shape[1]
        if not finite[i] or not m:
            out.append(torch.zeros_like(x))
            start += m
            continue
        e = exps[i].expand(m) if exps[i].dim() == 0 else exps[i]
        s = scale[i].expand(m) if scale[i].dim() == 0 else scale[i]
        q = rnd(x, s)
        decoded = q * pow2(-e)
        res = torch.where(torch.isfinite(decoded), x - decoded, 0.0)
        if two_phase:  # the owner keeps N times what rounding the mean lost
            acc = _sum_sequential(q, _identity, False) / n
            lost = torch.where(s > 0, (acc - rnd(acc)) / s, 0.0)
            owner = torch.arange(start, start + m) // per
            rows = torch.arange(n)[:, None] == owner[None, :].to(x.device)
            res = torch.where(rows, res + lost * n, res)
        out.append(res)
        start += m
    return out


def hook_options(
    options: Mapping[str, Any], formats: Sequence[FloatFormat | str] | None = None
) -> SimOptions:
    """The :class:`SimOptions` that reproduce an :class:`aps_comm.APSState` configuration.

    Args:
        options: the state's keyword arguments (``reduction``, ``scaling``,
            ``block_size``, ``block_exponents``, ``ranks_per_node``,
            ``error_feedback``; the others, ``fmt`` and ``stats`` among them,
            do not change what is simulated).
        formats: this step's format of each layer where a policy assigns
            them (:meth:`aps_comm.policy.Assignment.formats`); None: one format.

    Returns:
        The options for :func:`allreduce` and :func:`records`: the native
        all-reduce is Gloo's ``"ring"``; with block scaling two_phase,
        hierarchical and grid send each rank's own block exponents
        (``block_exponents="rank"``, not with error feedback, which agrees
        them) and two_phase owners re-choose agreed ones for the mean (not
        with error feedback: :func:`allreduce_feedback`).

    Example:
        >>> hook_options({"fmt": "e2m1", "scaling": "block", "block_exponents": "agreed"})
        {'reduction': 'two_phase', 'scaling': 'block', 'ranks_per_node': 1, 'rank_exponents': False, 'owner_exponents': True}
    """
    reduction = options.get("reduction") or "two_phase"
    scaling = options.get("scaling") or "layer"
    blocked, native = scaling == "block", reduction == "allreduce"
    rank = options.get("block_exponents", "rank") == "rank" and not options.get("error_feedback")
    out: SimOptions = {
        "reduction": "ring" if native else reduction,
        "scaling": scaling,
        "ranks_per_node": options.get("ranks_per_node") or 1,
        "rank_exponents": blocked and not native and rank,
        # Error feedback keeps the owner's loss in its residuals instead.
        "owner_exponents": blocked
        and reduction == "two_phase"
        and not rank
        and not options.get("error_feedback"),
    }
    if options.get("block_size") is not None:
        out["block_size"] = options["block_size"]
    if formats is not None:
        out["formats"] = list(formats)
    return out


_ROUTES = {
    "two_phase": "two_phase",
    "ring": "allreduce",
    "tree": "allreduce",
    "sequential": "allreduce",
    "hierarchical": "hierarchical",
    "grid": "grid",
}
"""The exponent rule (:func:`aps_comm.scaling.factors`' route) of each accumulation order."""


def records(
    layers: Sequence[torch.Tensor],
    fmt: FloatFormat | str,
    rank: int,
    *,
    names: Sequence[str | None] | None = None,
    bucket: int = 0,
    **options: Unpack[SimOptions],
) -> list[LayerStats]:
    """What ``APSState(stats=True)`` records on worker ``rank`` for one bucket.

    Computed from every worker's gradients, as :func:`allreduce` takes them:
    per layer the exponent it was scaled by (staged orders: the node sums')
    and the maximum over the workers (inf where one is not finite), and the
    elements of worker ``rank``'s gradient that are nonzero, that flush to
    zero once scaled (at most half the smallest subnormal) and that exceed
    the format's max once scaled. With ``scaling="block"`` the counts are
    per block, under each block's exponent (agreed from the workers' block
    maxima by the order's rule, or with ``rank_exponents`` worker ``rank``'s
    own by the two_phase rule over N senders); the record keeps the layer's
    smallest block exponent and worker ``rank``'s own largest block maximum
    (0 for a layer without elements). With ``formats``, each format's layers
    are recorded as a bucket of their own, in the order the formats first
    appear; FP32 layers keep no record.

    Args:
        layers: one ``(N, *param_shape)`` tensor per layer, as in :func:`allreduce`.
        fmt: the wire format.
        rank: the worker whose records these are (0 to N - 1).
        names: each layer's name (None: unnamed).
        bucket: the bucket index the records carry.
        **options: :class:`SimOptions` (reduction, scaling, ranks_per_node,
            block_size, rank_exponents; the rest do not change the records).

    Returns:
        One :class:`~aps_comm.telemetry.LayerStats` per layer.

    Example:
        >>> g = torch.tensor([[[0.5, 1e-9]], [[0.25, 0.0]]])  # 2 workers, one layer
        >>> [r] = records([g], "e4m3", 0)
        >>> r.exponent, r.amax, r.underflow_rate  # 1e-9 * 2**9 flushes to zero in e4m3
        (9, 0.5, 0.5)
    """
    cfg = SimConfig(fmt, **options)
    fmt = cfg.fmt
    assert isinstance(fmt, FloatFormat) and cfg.block_size is not None
    layers = list(layers)
    names = [None] * len(layers) if names is None else list(names)
    if not layers:
        return []
    n = _check_layers(layers)
    if not 0 <= rank < n:
        raise ValueError(f"rank must be in [0, {n}), got {rank}")
    if cfg.formats is not None:
        # One block size for every group: the bucket format's (the hook's setting).
        sub = {k: v for k, v in options.items() if k != "formats"}
        sub["block_size"] = cfg.block_size
        return [
            r
            for f, index in _format_groups(cfg, len(layers))
            if f != FP32
            for r in records(
                [layers[i] for i in index],
                f,
                rank,
                names=[names[i] for i in index],
                bucket=bucket,
                **sub,  # type: ignore[misc]
            )
        ]
    per = grid_rows(n) if cfg.reduction == "grid" else cfg.ranks_per_node
    route = _ROUTES[cfg.reduction]
    flat = [t.detach().reshape(n, -1).float() for t in layers]
    mine = [x[rank] for x in flat]
    # Per layer: its exponents (one per element) and its own (or agreed) maxima.
    if cfg.scaling != "block":
        amax = layer_amax(flat)
        f = factors(amax, fmt, route, world_size=n, scaling=cfg.scaling, ranks_per_node=per)
        exps = [e.expand(x.numel()) for e, x in zip(f.exponents, mine, strict=True)]
        tops = list(amax[:, None].unbind())
        lows = [int(e) for e in f.exponents.tolist()]
    else:
        bs = cfg.block_size
        tops = [_block_maxima(x[None], bs) for x in mine]
        counts = torch.tensor([b.numel() for b in tops], dtype=torch.int64)
        if cfg.rank_exponents:  # this worker's own, by the two_phase rule over N senders
            own = torch.cat(tops)
            f = factors(own, fmt, "two_phase", world_size=n, scaling="block", counts=counts)
        else:
            f = _factors(flat, layer_amax(flat), fmt, route, n, cfg, per)
        # The record keeps the layer's smallest block exponent.
        lows = [int(e.min()) if e.numel() else 0 for e in f.exponents.split(counts.tolist())]
        exps = [
            _spread(e, x.numel(), bs)
            for e, x in zip(f.exponents.split(counts.tolist()), mine, strict=True)
        ]
    out = []
    for x, name, e, low, top in zip(mine, names, exps, lows, tops, strict=True):
        # NaN is neither nonzero (it does not flush) nor saturated.
        mag = x.abs() * pow2(e)
        nonzero = int(torch.count_nonzero(mag > 0))
        under = int(torch.count_nonzero((mag > 0) & (mag <= fmt.min_subnormal / 2)))
        out.append(
            LayerStats(
                name=name,
                bucket=bucket,
                numel=x.numel(),
                format=str(fmt.name),
                exponent=low,
                amax=float(top.max()) if top.numel() else 0.0,
                underflow_rate=under / nonzero if nonzero else 0.0,
                saturated=int(torch.count_nonzero(mag > fmt.max)),
            )
        )
    return out


def _flat(
    flat: list[torch.Tensor], n: int, cfg: SimConfig, generator: torch.Generator | None
) -> list[torch.Tensor]:
    """:func:`allreduce` of one flat ``(N, numel)`` tensor per layer, by a one-level order."""
    fmt, reduction, rounding = cfg.fmt, cfg.reduction, cfg.rounding
    assert isinstance(fmt, FloatFormat) and cfg.block_size is not None
    block_size, rank_exponents = cfg.block_size, cfg.rank_exponents
    two_phase = reduction == "two_phase"
    acc_fmt = cfg.accumulator or (FP32 if two_phase else fmt)
    assert isinstance(acc_fmt, FloatFormat)
    amax = layer_amax(flat)
    # The hook's factors (one rule for both): unscaling is exact for two_phase,
    # one float32 rounding (the division by N) for the native sums.
    f = _factors(flat, amax, fmt, "two_phase" if two_phase else "allreduce", n, cfg)
    scale, unscale = _per_layer(f.scale, flat, cfg), _per_layer(f.unscale, flat, cfg)
    finite = torch.isfinite(amax).tolist()

    encode = _wire_round(fmt, rounding, generator, overflow=False)
    hop = _wire_round(acc_fmt, rounding, generator, overflow=True)
    final = _wire_round(fmt, rounding, generator, overflow=not two_phase)
    if not two_phase and cfg.accumulator is None:
        # The partial sums already are wire-format values: rounding again is the identity.
        final = _identity
    chunks = ring_chunks(sum(f.shape[1] for f in flat) or 1, n, _element_bytes(fmt))
    chunk_starts = torch.tensor(chunks[1:-1], dtype=torch.int64)

    out: list[torch.Tensor] = []
    offset = 0
    first_block = 0
    for i, x in enumerate(flat):
        m = x.shape[1]
        res = torch.empty(m, dtype=torch.float32, device=x.device)
        if not finite[i]:
            res.fill_(float("nan"))
        step = max(1, _BLOCK_ELEMENTS // n)
        own = _own_factors(x, fmt, n, block_size) if rank_exponents and finite[i] else None
        for lo in range(0 if finite[i] else m, m, step):
            hi = min(m, lo + step)
            if own is None:
                q = encode(x[:, lo:hi].float(), _cut(scale[i], lo, hi))
            else:  # each worker's own block scale; the owner decodes with it
                q = encode(x[:, lo:hi].float(), own[0][:, lo:hi]) * own[1][:, lo:hi]
            if reduction == "sequential" or two_phase:
                s = _sum_sequential(q, hop, cfg.kahan)
            elif reduction == "tree":
                s = _sum_tree(q, hop, cfg.kahan)
            else:
                idx = torch.arange(offset + lo, offset + hi, device=x.device)
                owner = torch.bucketize(idx, chunk_starts.to(x.device), right=True)
                s = _sum_ring(q, owner, hop, cfg.kahan)
            if cfg.owner_exponents or rank_exponents:
                res[lo:hi] = s / n  # the owner's mean, rounded once all of it is known
            elif two_phase:
                res[lo:hi] = final(s / n) * _cut(unscale[i], lo, hi)
            else:
                res[lo:hi] = final(s) * _cut(unscale[i], lo, hi)
        blocks = _ceil_div(m, block_size) if cfg.scaling == "block" else 0
        if finite[i] and m and (rank_exponents or cfg.owner_exponents):
            exps = None if rank_exponents else f.exponents[first_block : first_block + blocks]
            res = _owner_round(res, exps, fmt, block_size, final)
        first_block += blocks
        out.append(res)
        offset += m
    return out


def _owner_round(
    mean: torch.Tensor,
    agreed: torch.Tensor | None,
    fmt: FloatFormat,
    block_size: int,
    final: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """The owner's float32 ``mean`` of one layer, rounded to ``fmt`` block by block: with
    its own exponents (``agreed`` None, each worker's own exponents) or with its own on top
    of the ``agreed`` ones."""
    m = mean.numel()
    spread = functools.partial(_spread, m=m, block_size=block_size)
    maxima = _block_maxima(mean.view(1, m), block_size)
    if agreed is None:
        # The mean is in the true domain: its exponents are absolute.
        e = factors(maxima, fmt, "two_phase", world_size=1)
        return final(mean, spread(e.scale)) * spread(e.unscale)
    d = mean_exponents(maxima, agreed, fmt)
    return final(mean, spread(pow2(d))) * spread(pow2(-(agreed + d)))


def _spread(v: torch.Tensor, m: int, block_size: int) -> torch.Tensor:
    """Per-block values to one per element of an ``m``-element layer (along the last dim)."""
    return v.repeat_interleave(block_size, dim=-1)[..., :m]


def _own_factors(
    x: torch.Tensor, fmt: FloatFormat, world_size: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's own block scale and unscale, one per element of its ``(rows, m)`` layer
    (the two_phase rule for a sum over ``world_size`` senders)."""
    n, m = x.shape
    blocks = _ceil_div(m, block_size)
    a = torch.zeros(n, blocks * block_size, dtype=torch.float32, device=x.device)
    a[:, :m] = x.abs()
    own = a.view(n, blocks, block_size).amax(dim=2).reshape(-1)
    f = factors(own, fmt, "two_phase", world_size=world_size)
    return _spread(f.scale.view(n, blocks), m, block_size), _spread(
        f.unscale.view(n, blocks), m, block_size
    )


def _hierarchical(
    layers: list[torch.Tensor],
    fmt: FloatFormat,
    n: int,
    cfg: SimConfig,
    generator: torch.Generator | None,
) -> list[torch.Tensor]:
    """The hook's hierarchical or grid two_phase, element by element (see the module docstring)."""
    grid = cfg.reduction == "grid"
    per = grid_rows(n) if grid else cfg.ranks_per_node
    if grid and per < 2:
        raise ValueError(f"{n} workers have no grid (no divisor between 2 and sqrt({n}))")
    if n % per:
        raise ValueError(f"ranks_per_node={per} must divide the number of workers {n}")
    nodes = n // per
    flat = [t.detach().reshape(n, -1) for t in layers]
    if cfg.rank_exponents:
        return _staged_rank_blocks(layers, flat, fmt, per, grid, cfg, generator)
    amax = layer_amax(flat)
    f = _factors(flat, amax, fmt, cfg.reduction, n, cfg, per)
    assert f.shift is not None and (f.first is not None or not grid)
    scale, shift = _per_layer(f.scale, flat, cfg), _per_layer(f.shift, flat, cfg)
    unscale = _per_layer(f.unscale, flat, cfg)
    first = _per_layer(f.first, flat, cfg) if f.first is not None else None
    finite = torch.isfinite(amax).tolist()
    rnd = _wire_round(fmt, cfg.rounding, generator, overflow=False)
    out: list[torch.Tensor] = []
    for i, x in enumerate(flat):
        m = x.shape[1]
        res = torch.full((m,), float("nan"), dtype=torch.float32, device=x.device)
        step = max(1, _BLOCK_ELEMENTS // n)
        for lo in range(0 if finite[i] else m, m, step):
            hi = min(m, lo + step)
            part = x[:, lo:hi].float().reshape(nodes, per, hi - lo)
            if grid:
                assert first is not None
                part = rnd(part, _cut(first[i], lo, hi))
            sums = part[:, 0].clone()
            for r in range(1, per):
                sums += part[:, r]  # local-rank order
            q = rnd(sums, _cut(scale[i], lo, hi))
            acc = q[0].clone()
            for node in range(1, nodes):
                acc += q[node]  # node order
            res[lo:hi] = rnd(acc / n, _cut(shift[i], lo, hi)) * _cut(unscale[i], lo, hi)
        out.append(res.view(layers[i].shape[1:]))
    return out


def _staged_rank_blocks(
    layers: list[torch.Tensor],
    flat: list[torch.Tensor],
    fmt: FloatFormat,
    per: int,
    grid: bool,
    cfg: SimConfig,
    generator: torch.Generator | None,
) -> list[torch.Tensor]:
    """Hierarchical or grid two_phase where every level's owner uses its own block exponents.

    Per block of every layer, over L workers per node and M nodes (node-major):

    1. the node's mean: its L workers' values (grid: each first rounded with
       the worker's own block exponent, no headroom, and decoded with it,
       except the slice owner's own values) summed in FP32 in local-rank
       order, divided by L;
    2. two_phase of the M node means with each node's own block exponents:
       each mean rounded with its own exponent, decoded with it (except the
       shard owner's node's: its own, not rounded), the M values summed in
       FP32 in node order and divided by M;
    3. that mean rounded with its own block exponent, decoded with it.

    Shard ``l * M + j`` of each chunk (:func:`_shard_owners`) is owned by local
    rank l of node j, whose slice is the shards ``l * M`` to ``l * M + M - 1``.
    A layer non-finite on any worker is NaN everywhere. The exponents do not
    depend on the chunks (shards hold whole blocks); which values an owner
    keeps unrounded does, so ``cfg.chunk_elements`` is the hook's chunk.

    Example:
        >>> g = torch.randn(8, 64)
        >>> cfg = SimConfig("e2m1", "grid", "block", block_size=16, rank_exponents=True)
        >>> [out] = _staged_rank_blocks([g], [g], cfg.fmt, 2, True, cfg, None)
        >>> out.shape
        torch.Size([64])
    """
    n, bs = flat[0].shape[0], cfg.block_size
    assert bs is not None
    nodes = n // per
    rnd = _wire_round(fmt, cfg.rounding, generator, overflow=False)
    finite = torch.isfinite(layer_amax(flat)).tolist()
    shards = _shard_owners(flat, n, bs, cfg.chunk_elements)
    local_of_row = (torch.arange(n, device=flat[0].device) % per)[:, None]
    node_of_row = torch.arange(nodes, device=flat[0].device)[:, None]
    # Whole blocks at a time: the exponents of a range of blocks are its own.
    step = max(bs, _BLOCK_ELEMENTS // n // bs * bs)
    out: list[torch.Tensor] = []
    start = 0
    for i, x in enumerate(flat):
        m = x.shape[1]
        res = torch.full((m,), float("nan"), dtype=torch.float32, device=x.device)
        for lo in range(0 if finite[i] else m, m, step):
            hi = min(m, lo + step)
            part = x[:, lo:hi].float()
            owner = shards[start + lo : start + hi]
            if grid:
                scale, unscale = _own_factors(part, fmt, per, bs)
                q = rnd(part, scale) * unscale
                # Shard l * M + j lies in local rank l's slice: l keeps its own values.
                part = torch.where(local_of_row == owner // nodes, part, q)
            part = part.reshape(nodes, per, hi - lo)
            sums = part[:, 0].clone()
            for r in range(1, per):
                sums += part[:, r]  # local-rank order
            means = sums / per
            scale, unscale = _own_factors(means, fmt, nodes, bs)
            q = rnd(means, scale) * unscale
            # Shard l * M + j's owner, local rank l of node j, keeps its node's mean.
            q = torch.where(node_of_row == owner % nodes, means, q)
            acc = q[0].clone()
            for node in range(1, nodes):
                acc += q[node]  # node order
            mean = acc / nodes
            e = factors(_block_maxima(mean.view(1, -1), bs), fmt, "two_phase", world_size=1)
            spread = functools.partial(_spread, m=hi - lo, block_size=bs)
            res[lo:hi] = rnd(mean, spread(e.scale)) * spread(e.unscale)
        out.append(res.view(layers[i].shape[1:]))
        start += m
    return out


def _shard_owners(
    flat: list[torch.Tensor], n: int, block_size: int, chunk_elements: int | None
) -> torch.Tensor:
    """The shard (0 to N - 1) of every element of the bucket, as the hook cuts its chunks
    (:func:`aps_comm.plan.block_chunks`) and their shards (:func:`aps_comm.plan.block_shard_cuts`)."""
    numels = [x.shape[1] for x in flat]
    blocks = codec.Layout.from_numels(numels, torch.device("cpu")).grid(block_size).layout
    sizes = [
        torch.tensor(block_shard_cuts(blocks.offsets, lo, hi, n)).diff()
        for lo, hi in block_chunks(blocks, chunk_elements or max(blocks.numel, 1))
    ]
    shard = torch.arange(n).repeat(len(sizes))
    return torch.repeat_interleave(shard, torch.cat(sizes)).to(flat[0].device)


def _factors(
    flat: list[torch.Tensor],
    amax: torch.Tensor,
    fmt: FloatFormat,
    route: str,
    n: int,
    cfg: SimConfig,
    per: int = 1,
) -> Factors:
    """The hook's factors: per layer from ``amax``, or per block of every layer."""
    if cfg.scaling != "block":
        return factors(amax, fmt, route, world_size=n, scaling=cfg.scaling, ranks_per_node=per)
    blocks = [_block_maxima(x, cfg.block_size) for x in flat]
    counts = torch.tensor([b.numel() for b in blocks], dtype=torch.int64)
    return factors(
        torch.cat(blocks),
        fmt,
        route,
        world_size=n,
        scaling="block",
        ranks_per_node=per,
        counts=counts,
    )


def _block_maxima(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """max |x| over the N workers of every block of a ``(N, m)`` layer; NaN becomes inf."""
    n, m = x.shape
    blocks = _ceil_div(m, block_size)
    a = torch.zeros(n, blocks * block_size, dtype=torch.float32, device=x.device)
    a[:, :m] = x.abs()
    top = a.view(n, blocks, block_size).amax(dim=(0, 2))  # amax keeps NaN
    return top.masked_fill_(torch.isnan(top), float("inf"))


def _per_layer(v: torch.Tensor, flat: list[torch.Tensor], cfg: SimConfig) -> list[torch.Tensor]:
    """Each layer's factor: a 0-d tensor, or with block scaling one per element."""
    if cfg.scaling != "block":
        return list(v.unbind())
    out, start = [], 0
    for x in flat:
        m = x.shape[1]
        blocks = _ceil_div(m, cfg.block_size)
        out.append(_spread(v[start : start + blocks], m, cfg.block_size))
        start += blocks
    return out


def _cut(factor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The factor of elements ``[lo, hi)``: per-element factors sliced, a 0-d one as is."""
    return factor[lo:hi] if factor.dim() else factor


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _check_layers(layers: Sequence[torch.Tensor]) -> int:
    """The common number of workers N; raises on malformed input."""
    for t in layers:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError("every layer must be a floating-point tensor")
        if t.dim() < 1:
            raise ValueError("every layer needs a leading worker dimension N")
    n = layers[0].shape[0]
    if n < 1 or any(t.shape[0] != n for t in layers):
        shapes = [tuple(t.shape) for t in layers]
        raise ValueError(f"all layers need the same leading dimension N >= 1, got {shapes}")
    return n


# ---------------------------------------------------------------------------
# virtual workers


class VirtualWorkers:
    """Train ``model`` as N data-parallel workers on one process (CPD's emulated nodes).

    Each call to :meth:`backward` splits the batch into N equal micro-batches
    (worker r gets rows ``r*B/N ... (r+1)*B/N - 1``), computes every worker's
    gradient of its mean micro-batch loss, averages them with
    :func:`allreduce` under ``config`` and stores the result in each
    parameter's ``.grad``, as DDP with the APS hook would. The per-worker
    gradients come from one vectorised pass (``torch.func.vmap``) when the
    model allows it, else from N backward passes; models with buffers that
    training updates (BatchNorm) need ``vectorize=False``.

    Args:
        model: the model; every worker holds the same replica.
        world_size: number of virtual workers N.
        config: the communication settings.
        generator: random generator for stochastic rounding.
        vectorize: compute the N gradients with ``vmap`` (fast) or a loop.

    Attributes:
        last_worker_grads: the per-worker gradients of the last step, one
            ``(N, *shape)`` tensor per trainable parameter (for studies).

    Example:
        >>> model = nn.Linear(8, 2)
        >>> vw = VirtualWorkers(model, 64, SimConfig("e2m1"))
        >>> x, y = torch.randn(128, 8), torch.randint(0, 2, (128,))
        >>> loss = vw.backward(nn.functional.cross_entropy, x, y)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1); opt.step()
    """

    def __init__(
        self,
        model: nn.Module,
        world_size: int,
        config: SimConfig | None = None,
        *,
        generator: torch.Generator | None = None,
        vectorize: bool = True,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.model = model
        self.world_size = world_size
        self.config = config or SimConfig()
        self.generator = generator
        self.vectorize = vectorize
        self.last_worker_grads: list[torch.Tensor] = []

    def worker_grads(
        self,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        inputs: torch.Tensor,
        targets: torch.Tensor,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every worker's gradients (one ``(N, *shape)`` tensor per parameter) and mean loss.

        Raises:
            ValueError: the batch does not split into N equal micro-batches.
        """
        n, b = self.world_size, inputs.shape[0]
        if b % n or b == 0:
            raise ValueError(f"batch of {b} does not split into {n} equal micro-batches")
        xs = inputs.reshape(n, b // n, *inputs.shape[1:])
        ys = targets.reshape(n, b // n, *targets.shape[1:])
        names = [k for k, p in self.model.named_parameters() if p.requires_grad]
        if self.vectorize:
            grads, losses = self._vmapped(loss_fn, xs, ys, names)
        else:
            grads, losses = self._looped(loss_fn, xs, ys, names)
        return grads, losses.mean()

    def _vmapped(
        self, loss_fn: Callable, xs: torch.Tensor, ys: torch.Tensor, names: list[str]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        from torch.func import functional_call, grad_and_value, vmap

        params = {k: p.detach() for k, p in self.model.named_parameters() if p.requires_grad}
        buffers = dict(self.model.named_buffers())

        def one(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss_fn(functional_call(self.model, (p, buffers), (x,)), y)

        g, losses = vmap(grad_and_value(one), in_dims=(None, 0, 0))(params, xs, ys)
        return [g[k] for k in names], losses

    def _looped(
        self, loss_fn: Callable, xs: torch.Tensor, ys: torch.Tensor, names: list[str]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        params = dict(self.model.named_parameters())
        per: list[list[torch.Tensor]] = [[] for _ in names]
        losses = []
        for x, y in zip(xs, ys, strict=True):
            loss = loss_fn(self.model(x), y)
            gs = torch.autograd.grad(loss, [params[k] for k in names], allow_unused=True)
            for j, (k, gk) in enumerate(zip(names, gs, strict=True)):
                per[j].append(torch.zeros_like(params[k]) if gk is None else gk)
            losses.append(loss.detach())
        return [torch.stack(p) for p in per], torch.stack(losses)

    def backward(
        self,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        inputs: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        """Compute N workers' gradients, all-reduce them (simulated), set ``.grad``.

        Args:
            loss_fn: ``loss_fn(model(x), y)``, a mean over the micro-batch.
            inputs: the global batch, ``B`` rows, B divisible by N.
            targets: the matching targets.

        Returns:
            The mean of the workers' losses (a detached scalar).
        """
        grads, loss = self.worker_grads(loss_fn, inputs, targets)
        self.last_worker_grads = grads
        cfg = self.config
        averaged = allreduce(
            grads,
            cfg.fmt,
            reduction=cfg.reduction,
            scaling=cfg.scaling,
            accumulator=cfg.accumulator,
            kahan=cfg.kahan,
            rounding=cfg.rounding,
            generator=self.generator,
            ranks_per_node=cfg.ranks_per_node,
            block_size=cfg.block_size,
            owner_exponents=cfg.owner_exponents,
            rank_exponents=cfg.rank_exponents,
        )
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        for p, g in zip(trainable, averaged, strict=True):
            p.grad = g.to(p.dtype)
        return loss.detach()


# ---------------------------------------------------------------------------
# FSDP2's reduce-scatter


class Scattered(NamedTuple):
    """:func:`reduce_scatter`'s result.

    Attributes:
        rows: ``(N, row)`` float32: row r is what rank r's reduce-scatter returns,
            the sum over ranks of their row r (FSDP divides afterwards).
        records: each rank's records of the unit (empty lists without ``stats``).
    """

    rows: torch.Tensor
    records: list[list[LayerStats]]


def reduce_scatter(
    rows: torch.Tensor,
    chunks: Sequence[int],
    fmt: FloatFormat | str,
    *,
    formats: Sequence[FloatFormat | str] | None = None,
    scaling: Scaling = "layer",
    block_size: int | None = None,
    problems: Sequence[bool] | None = None,
    stats: bool = False,
    names: Sequence[str | None] | None = None,
    numels: Sequence[int] | None = None,
    unit: int = 0,
) -> Scattered:
    """The hook's FSDP2 reduce-scatter of one unit (:mod:`aps_comm.fsdp`), bit for bit.

    Every rank hands the unit N rows; row r holds every parameter's padded
    r-th chunk (``chunks[i]`` elements each, in order) and goes to rank r.
    Each parameter is scaled by its format's two_phase rule over N senders,
    from its maximum over every rank's rows (``scaling="bucket"``: one
    exponent per format; ``"block"``: every ``block_size`` elements of each
    row's chunk, from the chunk's start, from their maximum over the ranks;
    ``"none"``: none). Every sent value is rounded to its parameter's format
    (saturating), decoded and unscaled in float32, and rank r sums the N
    values it receives in FP32 in rank order. A parameter with a value that
    is not finite in any rank's rows is NaN in every row, on every rank; a
    unit some rank flags (``problems``: its input did not fit, it sent
    zeros) is NaN everywhere. A unit whose every parameter is FP32 is a
    plain reduce-scatter: its rows summed in rank order, a NaN where it is.

    With ``stats`` each rank records every parameter, in order, FP32 ones
    included: its exponent (block scaling: the smallest of its blocks'), its
    maximum over every rank (block scaling: this rank's own largest block
    maximum; NaN counts as inf), and the elements of this rank's N rows that
    are nonzero, flush to zero once scaled and exceed the format's max.

    Args:
        rows: ``(N, N, row)``: ``rows[k]`` is rank k's N rows (float).
        chunks: each parameter's padded chunk (elements per row).
        fmt: the unit's wire format.
        formats: each parameter's format, as a policy assigns them; None: ``fmt``.
        scaling: "layer", "bucket", "block" or "none".
        block_size: elements per block (None: the hook's default for ``fmt``).
        problems: each rank's flag (None: none flagged).
        stats: also return each rank's records.
        names: each parameter's name (records; None: unnamed).
        numels: each parameter's size (records; None: its chunk times N).
        unit: the unit's index (records).

    Returns:
        Every rank's output row and, with ``stats``, its records.

    Example:
        >>> x = torch.tensor([[[1.0, 0.3], [2.0, 0.0]], [[0.5, 0.1], [1e-3, 4.0]]])
        >>> out = reduce_scatter(x, [1, 1], "e2m1", formats=["e2m1", "fp32"], stats=True)
        >>> out.rows  # rank 0: 1 + 0.5, 0.3 + 0.1; rank 1: 2 + 0 (1e-3 flushes), 0 + 4
        tensor([[1.5000, 0.4000],
                [2.0000, 4.0000]])
        >>> [(r.exponent, r.amax, r.underflow_rate) for r in out.records[1]]
        [(1, 2.0, 0.5), (0, 4.0, 0.0)]
    """
    cfg = SimConfig(fmt, scaling=scaling, block_size=block_size)
    n, p = rows.shape[0], len(chunks)
    if rows.dim() != 3 or rows.shape[1] != n or rows.shape[2] != sum(chunks):
        raise ValueError(
            f"rows must be (N, N, sum(chunks)) = ({n}, {n}, {sum(chunks)}), got {tuple(rows.shape)}"
        )
    fmts = [cfg.fmt] * p if formats is None else [get_format(f) for f in formats]
    if len(fmts) != p:
        raise ValueError(f"formats names {len(fmts)} parameters, the unit has {p}")
    x = rows.detach().float()
    cuts = [0, *itertools.accumulate(chunks)]
    params = [x[:, :, lo:hi] for lo, hi in itertools.pairwise(cuts)]
    amax = layer_amax([t.reshape(-1) for t in params])  # over every rank's rows
    flagged = problems is not None and any(problems)
    fp32 = all(f == FP32 for f in fmts)
    if fp32:
        exps = [torch.zeros((), dtype=torch.int32, device=x.device) for _ in chunks]
        tops: list[torch.Tensor] = []
    elif cfg.scaling == "block":
        exps, tops = _unit_block_exponents(params, fmts, n, cfg.block_size)
    else:
        exps = _unit_exponents(params, fmts, amax, n, cfg.scaling)
        tops = []
    out = torch.zeros(n, sum(chunks), dtype=torch.float32, device=x.device)
    for i, (t, f, e) in enumerate(zip(params, fmts, exps, strict=True)):
        if not t.numel():
            continue
        # x * 2**e in float32 (exact), rounded to the format, decoded, times 2**-e.
        q = _wire_round(f, "nearest", None, overflow=False)(t * pow2(e)) * pow2(-e)
        if not fp32 and not bool(torch.isfinite(amax[i])):
            q = torch.full_like(q, float("nan"))
        out[:, cuts[i] : cuts[i + 1]] = _sum_sequential(q, _identity, False)  # rank order
    if flagged:
        out.fill_(float("nan"))
    records = [[] for _ in range(n)]
    if stats:
        names = [None] * p if names is None else list(names)
        numels = [n * c for c in chunks] if numels is None else list(numels)
        records = [
            _unit_records(params, fmts, exps, amax, tops, k, (names, numels, unit))
            for k in range(n)
        ]
    return Scattered(out, records)


def _unit_exponents(
    params: list[torch.Tensor],
    fmts: list[FloatFormat],
    amax: torch.Tensor,
    n: int,
    scaling: str,
) -> list[torch.Tensor]:
    """Each parameter's exponent (0-d), by its format's rule over that format's
    parameters (FP32: 0)."""
    exps = [torch.zeros((), dtype=torch.int32, device=t.device) for t in params]
    for f in dict.fromkeys(fmts):
        if f == FP32:
            continue
        which = [i for i, g in enumerate(fmts) if g == f]
        made = factors(amax[which], f, "two_phase", world_size=n, scaling=scaling)
        for i, e in zip(which, made.exponents.unbind(), strict=True):
            exps[i] = e.to(torch.int32)
    return exps


def _unit_block_exponents(
    params: list[torch.Tensor], fmts: list[FloatFormat], n: int, block_size: int | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Block scaling: each parameter's exponent per element of its ``(N, chunk)`` rows
    (every row's chunk blocked from its start, each block from its maximum over the
    ranks; FP32: 0), and every rank's own block maxima ``(ranks, N, blocks)``."""
    assert block_size is not None
    exps, tops = [], []
    for t, f in zip(params, fmts, strict=True):
        k, r, c = t.shape
        blocks = _ceil_div(c, block_size)
        a = torch.zeros(k, r, blocks * block_size, dtype=torch.float32, device=t.device)
        a[..., :c] = t.abs()
        own = a.view(k, r, blocks, block_size).amax(dim=3)
        own = own.masked_fill_(torch.isnan(own), float("inf"))
        tops.append(own)
        if f == FP32 or not blocks:
            exps.append(torch.zeros(r, c, dtype=torch.int32, device=t.device))
            continue
        made = factors(own.amax(0).reshape(-1), f, "two_phase", world_size=n)
        exps.append(_spread(made.exponents.to(torch.int32).view(r, blocks), c, block_size))
    return exps, tops


def _unit_records(
    params: list[torch.Tensor],
    fmts: list[FloatFormat],
    exps: list[torch.Tensor],
    amax: torch.Tensor,
    tops: list[torch.Tensor],
    rank: int,
    info: tuple[list[str | None], list[int], int],
) -> list[LayerStats]:
    """Rank ``rank``'s records of a unit (see :func:`reduce_scatter`); ``tops``: the
    ranks' own block maxima with block scaling, else empty; ``info``: names, numels, unit."""
    names, numels, unit = info
    out = []
    for i, (t, f, e) in enumerate(zip(params, fmts, exps, strict=True)):
        # NaN is neither nonzero (it does not flush) nor saturated.
        mag = t[rank].abs() * pow2(e)
        nonzero = int(torch.count_nonzero(mag > 0))
        under = int(torch.count_nonzero((mag > 0) & (mag <= f.min_subnormal / 2)))
        if tops:  # the smallest block exponent, this rank's own largest block maximum
            low = int(e.min()) if e.numel() else 0
            top = float(tops[i][rank].max()) if tops[i].numel() else 0.0
        else:
            low, top = int(e), float(amax[i])
        out.append(
            LayerStats(
                name=names[i],
                bucket=unit,
                numel=numels[i],
                format=str(f.name),
                exponent=low,
                amax=top,
                underflow_rate=under / nonzero if nonzero else 0.0,
                saturated=int(torch.count_nonzero(mag > f.max)),
            )
        )
    return out
