"""Wire formats: how many bytes an element costs and how it is reduced.

The ways to reduce a gradient bucket, named as ``aps_comm``'s hook names them
(:data:`aps_perfmodel.strategies.STRATEGIES`, modelled there):

- ``fp32``: plain FP32 all-reduce (DDP's default hook).
- ``native``: cast to the wire dtype, all-reduce in that dtype, cast back
  (``fp16_compress_hook``; for 8-bit formats, NCCL >= 2.24's native FP8 sum).
- ``two_phase``: APS encode, all-to-all of shards, FP32 accumulation on the
  shard owner, re-encode, all-gather, decode.
- ``hierarchical``: FP32 reduce-scatter inside the node, two_phase across
  nodes, all-gather inside the node.
- ``grid``: two_phase in two levels on a virtual grid of the ranks, every
  stage in the wire format (fewer messages than flat two_phase at scale).
- ``auto``: per bucket, the fastest of those the cluster allows.

``aps`` adds the per-layer MAX all-reduce of maxima, the chunk pipelining
and the scaling passes (``aps=False`` with ``native`` is torch's hook: one
piece, unscaled). ``allreduce`` is accepted for ``native`` (the hook's name
for it in ``APSState(reduction=...)``).

An APS format's ``scaling`` is ``"layer"`` (one float32 maximum per tensor,
agreed by a MAX all-reduce of 4 bytes per layer) or ``"block"`` (one
power-of-two exponent byte per ``block_size`` elements of a layer, agreed by
a MAX all-reduce of 1 byte per block, which then scales every stage of the
reduction). Per element, a ring all-reduce of the payload beside the
exponents' costs ``wire_bytes + exponent_bytes``: 1 + 1/32 for FP8 with
blocks of 32, 0.5 + 1/32 for e2m1, as two_phase's exchange does.

Example:
    >>> get_format("e4m3").wire_bytes
    1.0
    >>> get_format("fp16").strategy
    'native'
    >>> spec = get_format("e2m1", scaling="block")
    >>> spec.wire_bytes + spec.exponent_bytes
    0.53125
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .choices import (
    DEFAULT_BLOCK_SIZE,
    BlockExponents,
    Scaling,
    check_block_size,
    format_bits,
    format_name,
)

__all__ = [
    "FORMATS",
    "MAX_PRICED_BITS",
    "PRICED_SCALINGS",
    "STRATEGIES",
    "FormatSpec",
    "check_scaling",
    "get_format",
]

STRATEGIES = ("fp32", "native", "two_phase", "hierarchical", "grid", "auto")
_STRATEGY_ALIASES = {"allreduce": "native"}

PRICED_SCALINGS: tuple[Scaling, ...] = (Scaling.LAYER, Scaling.BLOCK)
"""The scalings the model prices (``"bucket"`` and ``"none"`` are not modelled)."""


def check_scaling(scaling: Scaling | str) -> Scaling:
    """``scaling`` (any case) as a member of :data:`PRICED_SCALINGS`, else a ValueError naming it.

    Example:
        >>> check_scaling("Block")
        <Scaling.BLOCK: 'block'>
    """
    parsed = Scaling(Scaling.parse(scaling, "scaling"))
    if parsed not in PRICED_SCALINGS:
        priced = tuple(s.value for s in PRICED_SCALINGS)
        raise ValueError(f"the model prices scaling {priced}, got {scaling!r}")
    return parsed


@dataclass(frozen=True)
class FormatSpec:
    """A gradient wire format and the reduction strategy used with it.

    Attributes:
        name: format name ("fp32", "fp16", "bf16", "e4m3", "e5m2", "e2m1").
        wire_bytes: bytes per element on the wire.
        strategy: one of :data:`STRATEGIES`.
        aps: whether APS scaling (MAX all-reduce of per-layer maxima) is applied.
        torch_dtype: name of the dtype the all-reduce runs in for ``native``
            and ``allreduce`` ("float32", "float16", ...); a calibrated profile
            keys its per-dtype all-reduce fits by it.
        scaling: APS's exponent granularity, one of :data:`PRICED_SCALINGS`
            (ignored without ``aps``: FP32 and torch's cast hooks scale nothing).
        block_size: elements per exponent with ``scaling="block"``
            (:data:`~aps_perfmodel.choices.BLOCK_SIZES`).
        block_exponents: with ``scaling="block"``, two_phase's exponents:
            each rank's own, sent with its shards (no MAX all-reduce), or
            agreed (:class:`~aps_perfmodel.choices.BlockExponents`).

    Example:
        >>> FormatSpec("e4m3", 1.0, "two_phase", True, "uint8").wire_bytes
        1.0
        >>> FormatSpec("e4m3", 1.0, "two_phase", True, "uint8", "block", 64).exponent_bytes
        0.015625
    """

    name: str
    wire_bytes: float
    strategy: str
    aps: bool
    torch_dtype: str
    scaling: Scaling = Scaling.LAYER
    block_size: int = DEFAULT_BLOCK_SIZE
    block_exponents: BlockExponents = BlockExponents.RANK

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", _STRATEGY_ALIASES.get(self.strategy, self.strategy))
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.wire_bytes <= 0:
            raise ValueError("wire_bytes must be positive")
        object.__setattr__(self, "scaling", check_scaling(self.scaling))
        object.__setattr__(self, "block_size", check_block_size(self.block_size))
        object.__setattr__(
            self,
            "block_exponents",
            BlockExponents.parse(self.block_exponents, "block_exponents"),
        )

    @property
    def block_scaled(self) -> bool:
        """Whether APS sends one exponent byte per block (``aps`` and ``scaling="block"``)."""
        return self.aps and self.scaling == Scaling.BLOCK

    @property
    def rank_exponents(self) -> bool:
        """Block scaling with each rank's own exponents (two_phase sends them with its
        shards instead of agreeing them)."""
        return self.block_scaled and self.block_exponents == BlockExponents.RANK

    @property
    def exponent_bytes(self) -> float:
        """Block exponent bytes per element: ``1 / block_size`` with block scaling, else 0.

        The per-layer maxima (4 bytes per tensor) are not per element and are
        not counted here.
        """
        return 1.0 / self.block_size if self.block_scaled else 0.0

    def block_count(self, numels: Sequence[int]) -> int:
        """Blocks (exponent bytes) of layers of these sizes: each layer's last block may be short.

        0 without block scaling.

        Example:
            >>> get_format("e4m3", scaling="block", block_size=8).block_count([20, 8])
            4
        """
        if not self.block_scaled:
            return 0
        return sum(-(-int(n) // self.block_size) for n in numels)

    def block_bound(self, numel: int, n_layers: int) -> int:
        """The most blocks ``n_layers`` layers of ``numel`` elements in all can make.

        ``ceil(numel / block_size) + n_layers - 1`` (each layer but one may end
        in a short block), at most ``numel``; for a bucket whose layer sizes
        are not known. 0 without block scaling.

        Example:
            >>> get_format("e4m3", scaling="block", block_size=8).block_bound(28, 2)
            5
        """
        if not self.block_scaled or numel <= 0:
            return 0
        return min(int(numel), math.ceil(numel / self.block_size) + max(n_layers, 1) - 1)


FORMATS: dict[str, FormatSpec] = {
    "fp32": FormatSpec("fp32", 4.0, "fp32", False, "float32"),
    # fp16/bf16 default to what users compare against: fp16_compress_hook.
    "fp16": FormatSpec("fp16", 2.0, "native", False, "float16"),
    "bf16": FormatSpec("bf16", 2.0, "native", False, "bfloat16"),
    "e4m3": FormatSpec("e4m3", 1.0, "two_phase", True, "uint8"),
    "e5m2": FormatSpec("e5m2", 1.0, "two_phase", True, "uint8"),
    # 4-bit formats travel packed, two elements per byte.
    "e2m1": FormatSpec("e2m1", 0.5, "two_phase", True, "uint8"),
}
MAX_PRICED_BITS = 16
"""Widest custom format the model prices: wider ones save nothing over FP16."""


def get_format(
    name: str,
    strategy: str | None = None,
    aps: bool | None = None,
    scaling: Scaling | str | None = None,
    block_size: int | None = None,
    block_exponents: BlockExponents | str | None = None,
) -> FormatSpec:
    """Look up a format by name, optionally overriding its strategy, APS flag or scaling.

    Names and aliases are ``aps_comm``'s (:func:`aps_perfmodel.choices.format_name`:
    ``"fp8"`` is e4m3, ``"fp4"`` e2m1). Any other ``e<E>m<M>`` name of at
    most :data:`MAX_PRICED_BITS` bits is an APS format of ``1 + E + M`` bits
    (4-bit formats packed two per byte, as ``aps_comm`` sends them).

    Raises:
        ValueError: an unknown format or strategy, a format that cannot exist
            or is wider than the model prices, a scaling the model does not
            price, or a block size not in
            :data:`~aps_perfmodel.choices.BLOCK_SIZES` (the error names it).

    Example:
        >>> get_format("e4m3", strategy="allreduce").strategy
        'native'
        >>> get_format("e3m2").wire_bytes
        0.75
        >>> get_format("e4m3", scaling="BLOCK", block_size=64).scaling
        <Scaling.BLOCK: 'block'>
    """
    key = format_name(name)
    if key in FORMATS:
        spec = FORMATS[key]
    else:
        bits = 1 + sum(format_bits(key))
        if bits > MAX_PRICED_BITS:
            raise ValueError(
                f"the model prices formats of at most {MAX_PRICED_BITS} bits; {name!r} has {bits}"
            )
        spec = FormatSpec(key, 0.5 if bits == 4 else bits / 8, "two_phase", True, "uint8")
    if strategy is not None:
        if key == "fp32" and strategy != "fp32":
            raise ValueError(f"fp32 is only reduced by the plain FP32 all-reduce, not {strategy!r}")
        spec = replace(spec, strategy=strategy)
    if aps is not None:
        spec = replace(spec, aps=aps)
    if scaling is not None:
        spec = replace(spec, scaling=scaling)
    if block_size is not None:
        spec = replace(spec, block_size=block_size)
    if block_exponents is not None:
        spec = replace(spec, block_exponents=block_exponents)
    return spec
