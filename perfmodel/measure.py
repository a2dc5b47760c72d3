"""Timed building blocks of the gradient reduction paths, on a live process group.

Calibration times each block over a sweep of sizes to fit the model; the
validation times the whole paths. Both use these functions so the thing
fitted is the thing measured:

- ``fp32``: ``all_reduce`` of the FP32 buffer (DDP's default hook).
- ``fp16``: cast to FP16 and divide by N, ``all_reduce``, copy back
  (``fp16_compress_hook``).
- ``aps-two-phase``: per-layer amax, MAX ``all_reduce`` of the L maxima, scale
  by powers of two and encode, ``all_to_all_single`` of the bytes, decode and
  FP32-sum the N shards and divide, re-encode, ``all_gather_single``, decode and
  unscale. This mirrors ``aps_comm.hook``'s two-phase path step by step.

Example:
    >>> codec = load_codec("torch")
    >>> import torch
    >>> codec.decode(codec.encode(torch.tensor([1.5]), "e4m3"), "e4m3", 1)
    tensor([1.5000])
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "FMAX",
    "Codec",
    "all_gather_single",
    "aps_two_phase",
    "fp16_allreduce",
    "fp32_allreduce",
    "load_codec",
    "pipelined_exchange",
    "repeats_for",
    "shared_clock",
    "time_op",
]

# Largest finite magnitude of each 8-bit format (OCP FP8: e4m3fn and e5m2).
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
# Default time budget per timed operation and its cap on repeats (the cap
# bounds the cost of near-free operations, each repeat also idles settle_s).
BUDGET_S = 0.25
MAX_REPEATS = 40


class Codec(Protocol):
    """Encode FP32 to wire bytes and back (``aps_comm.formats``' API), plus the hook's
    other local passes: per-layer maxima and the shard owner's reduction."""

    def encode(
        self, x: torch.Tensor, fmt: str, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def decode(
        self, payload: torch.Tensor, fmt: str, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def amax(self, layers: Sequence[torch.Tensor]) -> torch.Tensor: ...

    def reduce(self, shards: torch.Tensor, world_size: int, fmt: str) -> torch.Tensor: ...


class _TorchCastCodec:
    """Stand-in codec: torch's native float8 casts (round to nearest even)."""

    name = "torch-cast"
    _DTYPES: ClassVar[dict[str, torch.dtype]] = {
        "e4m3": torch.float8_e4m3fn,
        "e5m2": torch.float8_e5m2,
    }

    def encode(self, x: torch.Tensor, fmt: str, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return x.to(self._DTYPES[fmt]).view(torch.uint8)
        out.view(self._DTYPES[fmt]).copy_(x)
        return out

    def decode(
        self, payload: torch.Tensor, fmt: str, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if out is None:
            return payload[:numel].view(self._DTYPES[fmt]).to(torch.float32)
        return out.copy_(payload[:numel].view(self._DTYPES[fmt]))

    def amax(self, layers: Sequence[torch.Tensor]) -> torch.Tensor:
        return layer_amax(layers)

    def reduce(self, shards: torch.Tensor, world_size: int, fmt: str) -> torch.Tensor:
        return owner_reduce(shards, world_size, self, fmt)


class _ApsCodec:
    """``aps_comm``'s own passes, exactly as its hook calls them."""

    name = "aps_comm.formats"

    def __init__(self, formats: object, scaling: object, reduction: object) -> None:
        self._f, self._s, self._r = formats, scaling, reduction

    def encode(self, x: torch.Tensor, fmt: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._f.encode(x, fmt, out=out)

    def decode(
        self, payload: torch.Tensor, fmt: str, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._f.decode(payload, fmt, numel, out=out)

    def amax(self, layers: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._s.layer_amax(list(layers))

    def reduce(self, shards: torch.Tensor, world_size: int, fmt: str) -> torch.Tensor:
        return self._r.reduce_shards(shards, world_size, self._f.get_format(fmt))


def load_codec(kind: str = "aps") -> Codec | None:
    """The codec to measure: ``"aps"`` (``aps_comm.formats``) or ``"torch"`` (native casts).

    Returns:
        The codec, or None when ``kind == "aps"`` and ``aps_comm.formats`` (with
        ``encode``/``decode``) cannot be imported yet.
    """
    if kind == "torch":
        return _TorchCastCodec()
    if kind != "aps":
        raise ValueError(f"codec must be 'aps' or 'torch', got {kind!r}")
    try:
        from aps_comm import formats, reduction, scaling
    except ImportError:
        return None
    return _ApsCodec(formats, scaling, reduction)


def codec_name(codec: Codec) -> str:
    """Label of a codec for reports."""
    return getattr(codec, "name", type(codec).__name__)


def all_gather_single(
    output: torch.Tensor, inp: torch.Tensor, async_op: bool = False
) -> dist.Work | None:
    """All-gather into one tensor under the name this torch version prefers.

    torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` and
    warns on the old name.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, inp, async_op=async_op)


def pipelined_exchange(
    send: torch.Tensor, recv: torch.Tensor, gathered: torch.Tensor, chunk_bytes: int
) -> None:
    """The wire part of ``aps_comm.hook``'s two_phase, without the codec.

    ``send`` is cut in chunks of ``chunk_bytes``: every chunk's
    ``all_to_all_single`` is issued first, then each chunk in turn is waited
    for and its owner shard all-gathered, so the two collectives overlap on
    the link as they do in the hook.
    """
    p = dist.get_world_size()
    bounds = [
        (lo, min(lo + chunk_bytes, send.numel())) for lo in range(0, send.numel(), chunk_bytes)
    ]
    works = [dist.all_to_all_single(recv[lo:hi], send[lo:hi], async_op=True) for lo, hi in bounds]
    gathers = []
    for (lo, hi), work in zip(bounds, works, strict=True):
        work.wait()
        shard = recv[lo : lo + (hi - lo) // p]
        gathers.append(all_gather_single(gathered[lo : lo + (hi - lo) // p * p], shard, True))
    for g in gathers:
        g.wait()


def repeats_for(
    seconds: float, repeats: int, budget_s: float = BUDGET_S, max_repeats: int = MAX_REPEATS
) -> int:
    """At least ``repeats``; more for quick operations, until about ``budget_s`` in all.

    Short timings are the noisy ones (scheduling, wake-ups), and cheap to repeat.
    The standard error of a median falls as 1/sqrt(repeats): a 4x larger
    budget halves it where ``max_repeats`` allows.

    Example:
        >>> repeats_for(0.001, 5), repeats_for(1.0, 5), repeats_for(0.01, 5, 2.0, 400)
        (40, 5, 200)
    """
    if budget_s < 0 or max_repeats < 1:
        raise ValueError(
            f"budget_s must be >= 0 and max_repeats >= 1, got {budget_s!r} and {max_repeats!r}"
        )
    return max(repeats, min(max_repeats, math.ceil(budget_s / max(seconds, 1e-9))))


def shared_clock() -> bool:
    """Whether every rank reads the same monotonic clock (one kernel: same boot id).

    Must be called on every rank. Ranks in separate network namespaces of one
    machine (the emulated cluster) share it; separate machines or VMs do not.
    """
    try:
        ident = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        # Unknown: make every rank distinct, so no clock is assumed shared.
        ident = f"{socket.gethostname()}:{os.getpid()}"
    ids: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(ids, ident)
    return len(set(ids)) == 1


def time_op(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 1,
    settle_s: float = 0.0,
    from_last_start: bool = False,
    budget_s: float = BUDGET_S,
    max_repeats: int = MAX_REPEATS,
) -> float:
    """Median over repeats of what ``fn`` costs the group (all ranks call it).

    Each repeat starts after a barrier (and ``settle_s`` of idling). By
    default a repeat costs the slowest rank's time. With ``from_last_start``
    (for collectives, on ranks sharing a clock: :func:`shared_clock`) it runs
    from the last rank's start to the last rank's end, as the validation times
    DDP's hooks: a collective cannot progress before its last rank joins, and
    the early ranks' wait for it (barrier exit skew, scheduling) is not part of
    its cost. Quick operations get more repeats, up to ``max_repeats`` within
    about ``budget_s`` of timed work (:func:`repeats_for`, decided on the
    slowest rank's warm-up time so every rank runs the same number).

    Example:
        >>> import torch.distributed as dist
        >>> time_op(lambda: dist.all_reduce(torch.ones(4)), 5) > 0  # doctest: +SKIP
        True
    """
    for _ in range(max(warmup, 1)):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        first = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    stamps = []
    for _ in range(repeats_for(float(first), repeats, budget_s, max_repeats)):
        dist.barrier()
        if settle_s:
            time.sleep(settle_s)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        stamps.append((t0, t1, t1 - t0))
    t = torch.tensor(stamps, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    per_repeat = t[:, 1] - t[:, 0] if from_last_start else t[:, 2]
    return statistics.median(per_repeat.tolist())


def fp32_allreduce(x: torch.Tensor) -> None:
    """DDP's default: all-reduce the FP32 buffer."""
    dist.all_reduce(x)


def fp16_cast_down(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """``fp16_compress_hook``'s compression: cast and divide by N."""
    return x.to(torch.float16).div_(world_size)


def fp16_allreduce(x: torch.Tensor) -> None:
    """``fp16_compress_hook``: cast/divide, all-reduce in FP16, copy back."""
    h = fp16_cast_down(x, dist.get_world_size())
    dist.all_reduce(h)
    x.copy_(h)


def layer_amax(layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-layer max |g| (NaN mapped to +inf so a MAX reduction cannot drop it)."""
    amax = torch.stack([seg.abs().amax() for seg in layers])
    return torch.nan_to_num(amax, nan=float("inf"))


def scale_exponents(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """Two-phase APS exponents: ``floor(log2(FMAX / amax))`` (0 for all-zero layers)."""
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    return torch.floor(torch.log2(FMAX[fmt] / safe))


def scaled_encode(
    x: torch.Tensor, layers: Sequence[torch.Tensor], exps: torch.Tensor, codec: Codec, fmt: str
) -> torch.Tensor:
    """Multiply each layer by 2^e (exact) and encode the whole buffer."""
    scaled = torch.empty_like(x)
    for seg, out, e in zip(
        layers, torch.split(scaled, [s.numel() for s in layers]), exps.tolist(), strict=True
    ):
        torch.mul(seg, 2.0**e, out=out)
    return codec.encode(scaled, fmt)


def decode_unscale(
    payload: torch.Tensor,
    out: torch.Tensor,
    sizes: Sequence[int],
    exps: torch.Tensor,
    codec: Codec,
    fmt: str,
) -> None:
    """Decode the gathered bytes and multiply each layer by 2^-e into ``out``."""
    dec = codec.decode(payload, fmt, out.numel())
    for seg, dst, e in zip(
        torch.split(dec, list(sizes)), torch.split(out, list(sizes)), exps.tolist(), strict=True
    ):
        torch.mul(seg, 2.0 ** (-e), out=dst)


def owner_reduce(shards: torch.Tensor, world_size: int, codec: Codec, fmt: str) -> torch.Tensor:
    """Decode the N received shards, sum in FP32, divide by N, re-encode."""
    dec = codec.decode(shards, fmt, shards.numel()).view(world_size, -1)
    return codec.encode(dec.sum(0).div_(world_size), fmt)


def aps_two_phase(
    x: torch.Tensor, layer_sizes: Sequence[int], codec: Codec, fmt: str = "e4m3"
) -> None:
    """APS two-phase reduction of ``x`` in place (its numel must divide by the world size)."""
    p = dist.get_world_size()
    layers = torch.split(x, list(layer_sizes))
    amax = codec.amax(layers)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    exps = scale_exponents(amax, fmt)
    payload = scaled_encode(x, layers, exps, codec, fmt)
    shards = torch.empty_like(payload)
    dist.all_to_all_single(shards, payload)
    mine = codec.reduce(shards, p, fmt)
    gathered = torch.empty_like(payload)
    all_gather_single(gathered, mine)
    decode_unscale(gathered, x, layer_sizes, exps, codec, fmt)
