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

Example:
    >>> get_format("e4m3").wire_bytes
    1.0
    >>> get_format("fp16").strategy
    'native'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

__all__ = ["FORMATS", "STRATEGIES", "FormatSpec", "get_format"]

STRATEGIES = ("fp32", "native", "two_phase", "hierarchical", "grid", "auto")
_STRATEGY_ALIASES = {"allreduce": "native"}


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

    Example:
        >>> FormatSpec("e4m3", 1.0, "two_phase", True, "uint8").wire_bytes
        1.0
    """

    name: str
    wire_bytes: float
    strategy: str
    aps: bool
    torch_dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", _STRATEGY_ALIASES.get(self.strategy, self.strategy))
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.wire_bytes <= 0:
            raise ValueError("wire_bytes must be positive")


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
_ALIASES = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "fp8": "e4m3",
    "fp4": "e2m1",
    "fp8_e4m3": "e4m3",
    "fp8_e5m2": "e5m2",
}
# Custom sign-exponent-mantissa formats (aps_comm.formats.FloatFormat names).
_CUSTOM = re.compile(r"e(\d)m(\d+)")


def get_format(name: str, strategy: str | None = None, aps: bool | None = None) -> FormatSpec:
    """Look up a format by name, optionally overriding its strategy or APS flag.

    Any other ``e<E>m<M>`` name is an APS format of ``1 + E + M`` bits
    (4-bit formats packed two per byte, as ``aps_comm`` sends them).

    Example:
        >>> get_format("e4m3", strategy="allreduce").strategy
        'native'
        >>> get_format("e3m2").wire_bytes
        0.75
    """
    key = _ALIASES.get(name.lower(), name.lower())
    custom = _CUSTOM.fullmatch(key)
    if key in FORMATS:
        spec = FORMATS[key]
    elif custom and 1 + int(custom[1]) + int(custom[2]) <= 16:
        bits = 1 + int(custom[1]) + int(custom[2])
        spec = FormatSpec(key, 0.5 if bits == 4 else bits / 8, "two_phase", True, "uint8")
    else:
        raise ValueError(
            f"unknown format {name!r}; choose from {sorted(FORMATS)} or an e<E>m<M> name"
        )
    if strategy is not None:
        if key == "fp32" and strategy != "fp32":
            raise ValueError(f"fp32 is only reduced by the plain FP32 all-reduce, not {strategy!r}")
        spec = replace(spec, strategy=strategy)
    if aps is not None:
        spec = replace(spec, aps=aps)
    return spec
