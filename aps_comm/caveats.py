"""Warnings about configurations that run but lose more than the user may expect.

Each is a ``UserWarning``, given once per process and on every rank (like the
other warnings of :mod:`aps_comm`: every rank's log then says why its own
gradients look as they do); the DDP hook and :mod:`aps_comm.fsdp` call them
when they bind.

- :func:`warn_unblocked`: a format narrower than 8 bits with one exponent
  per layer, per bucket or none. e2m1 has 3.6 binades; a layer's gradients
  span many more, so most of them flush to zero (``scaling="block"`` is
  what makes such formats train).
- :func:`warn_rounded_dtype`: float64 gradients, which travel and are
  summed as float32 and come back rounded to float32's precision.

Example:
    >>> from aps_comm.config import Scaling
    >>> from aps_comm.formats import get_format
    >>> warn_unblocked([get_format("e4m3")], Scaling.LAYER)  # 8 bits: no warning
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

from aps_comm.config import Scaling
from aps_comm.formats import FloatFormat

__all__ = ["warn_rounded_dtype", "warn_unblocked"]

# Formats narrower than this need an exponent per block.
_BLOCK_BITS = 8

# What each scaling but "block" gives a narrow format to cover a layer's range with.
_ONE_EXPONENT = {
    Scaling.LAYER: "one exponent per layer",
    Scaling.BUCKET: "one exponent per bucket",
    Scaling.NONE: "a plain cast, with no exponent at all,",
}

# What this process has warned about already (a warning is given once).
_warned: set[str] = set()


def _warn_once(key: str, message: str, stacklevel: int) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def warn_unblocked(formats: Iterable[FloatFormat], scaling: Scaling, stacklevel: int = 2) -> None:
    """Warn once if a format below 8 bits may travel without block scaling.

    Args:
        formats: every format a layer may travel in (the state's and its
            policy's, :meth:`aps_comm.policy.Assignment.possible`).
        scaling: the state's scaling.
        stacklevel: as for :func:`warnings.warn`, counted from the caller.

    Example:
        >>> warn_unblocked([get_format("e2m1")], Scaling.LAYER)  # doctest: +SKIP
        UserWarning: aps_comm: e2m1 (4 bits) with scaling='layer' ...
    """
    if scaling == Scaling.BLOCK:
        return
    # Once per format: a policy's narrow format is news after the state's own.
    narrow = sorted(
        {f for f in formats if f.bits < _BLOCK_BITS and f"unblocked {f.name}" not in _warned},
        key=lambda f: f.name,
    )
    if not narrow:
        return
    _warned.update(f"unblocked {f.name}" for f in narrow)
    names = ", ".join(f"{f.name} ({f.bits} bits)" for f in narrow)
    warnings.warn(
        f"aps_comm: {names} with scaling='{scaling}': {_ONE_EXPONENT[scaling]} "
        "cannot cover the range of a layer's gradients in a format this narrow, so most "
        "of them flush to zero (e2m1 with scaling='layer' flushed 72-100% of the elements "
        "of an averaged gradient in benchmarks.numerics). Use scaling='block' (one exponent "
        "per block_size elements), which trains e2m1 to FP32's accuracy; see "
        "docs/number-formats.md#choosing-a-format",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


def warn_rounded_dtype(dtype: torch.dtype, stacklevel: int = 2) -> None:
    """Warn once if gradients of ``dtype`` are rounded by going through float32.

    The hook and the FSDP reduce-scatter scale, reduce and unscale in float32:
    float16 and bfloat16 gradients convert to it exactly, float64 ones are
    rounded to float32 (24 significant bits instead of 53; magnitudes beyond
    float32's range become inf or 0) and written back as float64. Not called
    for ``fmt="fp32"`` without a policy or error feedback: that all-reduces
    the bucket as it is, in float64.

    Args:
        dtype: the gradients' dtype.
        stacklevel: as for :func:`warnings.warn`, counted from the caller.

    Example:
        >>> warn_rounded_dtype(torch.float32)  # exact: no warning
    """
    if dtype != torch.float64:
        return
    _warn_once(
        f"rounded {dtype}",
        "aps_comm: float64 gradients are reduced in float32: each is rounded to float32 "
        "(24 significant bits instead of 53) before it is scaled and encoded, the sum is "
        "float32, and the averaged gradient comes back as float64 holding float32 values "
        "(magnitudes beyond float32's range become inf or 0). For float64's precision use "
        "fmt='fp32' (a plain float64 all-reduce); else train in float32",
        stacklevel + 1,
    )
