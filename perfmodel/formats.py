"""Wire formats: how many bytes an element costs and how it is reduced.

Three ways to reduce a gradient bucket, matching what the hooks do:

- ``native``: plain FP32 all-reduce (DDP's default hook).
- ``allreduce``: cast to the wire dtype, all-reduce in that dtype, cast back
  (``fp16_compress_hook``; for 8-bit formats, NCCL >= 2.24's native FP8 sum).
- ``two_phase``: APS encode, all-to-all of shards, FP32 accumulation on the
  shard owner, re-encode, all-gather, decode.

``aps`` adds the per-layer MAX all-reduce of maxima and the scaling passes.

Example:
    >>> get_format("e4m3").wire_bytes
    1.0
    >>> get_format("fp16").strategy
    'allreduce'
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["FORMATS", "STRATEGIES", "FormatSpec", "get_format"]

STRATEGIES = ("native", "allreduce", "two_phase")


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
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.wire_bytes <= 0:
            raise ValueError("wire_bytes must be positive")


FORMATS: dict[str, FormatSpec] = {
    "fp32": FormatSpec("fp32", 4.0, "native", False, "float32"),
    # fp16/bf16 default to what users compare against: fp16_compress_hook.
    "fp16": FormatSpec("fp16", 2.0, "allreduce", False, "float16"),
    "bf16": FormatSpec("bf16", 2.0, "allreduce", False, "bfloat16"),
    "e4m3": FormatSpec("e4m3", 1.0, "two_phase", True, "uint8"),
    "e5m2": FormatSpec("e5m2", 1.0, "two_phase", True, "uint8"),
    # 4-bit formats travel packed, two elements per byte.
    "e2m1": FormatSpec("e2m1", 0.5, "two_phase", True, "uint8"),
}
_ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "fp8": "e4m3", "fp4": "e2m1"}


def get_format(name: str, strategy: str | None = None, aps: bool | None = None) -> FormatSpec:
    """Look up a format by name, optionally overriding its strategy or APS flag.

    Example:
        >>> get_format("e4m3", strategy="allreduce").strategy
        'allreduce'
    """
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in FORMATS:
        raise ValueError(f"unknown format {name!r}; choose from {sorted(FORMATS)}")
    spec = FORMATS[key]
    if strategy is not None:
        if key == "fp32" and strategy != "native":
            raise ValueError("fp32 is only reduced natively")
        spec = replace(spec, strategy=strategy)
    if aps is not None:
        spec = replace(spec, aps=aps)
    return spec
