"""Timed building blocks of the gradient reduction paths, on a live process group.

Calibration (:mod:`aps_comm.calibrate`) times each block over a sweep of
sizes, and the whole of each real DDP hook on a tiny bucket
(:func:`time_hook_steps`); the validation times the whole hooks on real
buckets with the same function, so the thing fitted is the thing measured.
The timing lives here, beside the code it times; :mod:`aps_perfmodel` only
fits the plain numbers it produces and never imports this module. The blocks:

- ``fp32``: ``all_reduce`` of the FP32 buffer (DDP's default hook).
- ``fp16``: cast to FP16 and divide by N, ``all_reduce``, copy back
  (``fp16_compress_hook``).
- ``aps-two-phase``: per-layer amax, MAX ``all_reduce`` of the L maxima, scaled
  encode, the chunk-pipelined ``all_to_all_single`` and ``all_gather_single``
  (:func:`pipelined_exchange`), the shard owner's decode-sum-encode
  (:meth:`Codec.reduce`), decode and unscale, as ``aps_comm.hook`` runs them.

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
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from aps_comm import codec as aps_codec
from aps_comm.hook import APSState, aps_hook

__all__ = [
    "Codec",
    "HookBench",
    "all_gather_single",
    "ddp_hook",
    "load_codec",
    "pipelined_exchange",
    "repeats_for",
    "shared_clock",
    "time_hook_steps",
    "time_op",
    "trimmed_mean",
]

# Default time budget per timed operation and its cap on repeats (the cap
# bounds the cost of near-free operations, each repeat also idles settle_s).
BUDGET_S = 0.25
MAX_REPEATS = 40
# Share of repeats dropped at each end before averaging (trimmed_mean).
TRIM = 0.1


class Codec(Protocol):
    """The hook's local passes: encode FP32 to wire bytes and back, per-layer maxima,
    and the shard owner's reduction (``aps_comm.codec``'s API)."""

    def encode(
        self, x: torch.Tensor, fmt: str, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def decode(
        self, payload: torch.Tensor, fmt: str, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def amax(self, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor: ...

    def reduce(
        self, shards: torch.Tensor, world_size: int, fmt: str, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class _TorchCastCodec:
    """Stand-in codec: torch's native float8 casts (round to nearest even), eager ops."""

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

    def amax(self, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        return torch.stack([seg.abs().amax() for seg in torch.split(x, list(sizes))])

    def reduce(
        self, shards: torch.Tensor, world_size: int, fmt: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        dec = self.decode(shards, fmt, shards.numel()).view(world_size, -1)
        return self.encode(dec.sum(0).div_(world_size), fmt, out=out)


class _ApsCodec:
    """``aps_comm.codec``, exactly as the hook's transports call it."""

    name = "aps_comm.codec"

    def __init__(self, codec: Any) -> None:
        self._c = codec

    def encode(self, x: torch.Tensor, fmt: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._c.encode(x, fmt, out=out)

    def decode(
        self, payload: torch.Tensor, fmt: str, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._c.decode(payload, fmt, numel, out=out)

    def amax(self, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        return self._c.segment_amax(x, self._c.Layout.from_numels(list(sizes), x.device))

    def reduce(
        self, shards: torch.Tensor, world_size: int, fmt: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._c.owner_reduce(shards, fmt, world_size, out=out)


def load_codec(kind: str = "aps") -> Codec:
    """The codec to measure: ``"aps"`` (``aps_comm.codec``) or ``"torch"`` (native casts).

    Example:
        >>> load_codec("torch").name
        'torch-cast'
    """
    if kind == "torch":
        return _TorchCastCodec()
    if kind != "aps":
        raise ValueError(f"codec must be 'aps' or 'torch', got {kind!r}")
    return _ApsCodec(aps_codec)


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
    """The wire part of ``aps_comm.transports.two_phase_bound``, without the codec.

    ``send`` is cut in chunks of ``chunk_bytes``, issued in the transport's
    order: all_to_all(c + 1) before all_gather(c), and all_gather(c - 1)
    waited for after all_gather(c) is issued, so the two collectives overlap
    on the link as they do in the hook.
    """
    p = dist.get_world_size()
    bounds = [
        (lo, min(lo + chunk_bytes, send.numel())) for lo in range(0, send.numel(), chunk_bytes)
    ]
    k = len(bounds)
    exchanges: dict[int, dist.Work] = {}
    gathers: dict[int, dist.Work] = {}
    for c in range(k + 2):
        if c < k:
            lo, hi = bounds[c]
            exchanges[c] = dist.all_to_all_single(recv[lo:hi], send[lo:hi], async_op=True)
        if 1 <= c <= k:
            lo, hi = bounds[c - 1]
            exchanges.pop(c - 1).wait()
            shard = recv[lo : lo + (hi - lo) // p]
            out = gathered[lo : lo + (hi - lo) // p * p]
            gathers[c - 1] = all_gather_single(out, shard, True)  # type: ignore[assignment]
        if c >= 2:
            gathers.pop(c - 2).wait()


def repeats_for(
    seconds: float, repeats: int, budget_s: float = BUDGET_S, max_repeats: int = MAX_REPEATS
) -> int:
    """At least ``repeats``; more for quick operations, until about ``budget_s`` in all.

    Short timings are the noisy ones (scheduling, wake-ups), and cheap to repeat.
    The standard error of a mean falls as 1/sqrt(repeats): a 4x larger
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


def trimmed_mean(values: Sequence[float], trim: float = TRIM) -> float:
    """Mean of ``values`` without the lowest and highest ``trim`` share of them.

    The statistic every timing here reports. What a training job pays is the
    expected time of a bucket; on a shared VM the repeats of a small message
    are bimodal (measured on the emulated cluster and on loopback alike: a
    4 KiB FP32 hook call 0.8 ms or 3-5 ms, each about half the time), so their
    median jumps between the modes from run to run while the mean moves with
    the modes' shares. Trimming keeps a rare stall (a TCP retransmit) out.

    Example:
        >>> trimmed_mean([1.0, 1.0, 5.0, 5.0, 100.0], 0.2)
        3.6666666666666665
    """
    if not values:
        raise ValueError("trimmed_mean needs at least one value")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")
    v = sorted(values)
    k = int(len(v) * trim)
    kept = v[k : len(v) - k]
    return sum(kept) / len(kept)


def time_op(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 1,
    settle_s: float = 0.0,
    from_last_start: bool = False,
    budget_s: float = BUDGET_S,
    max_repeats: int = MAX_REPEATS,
) -> float:
    """What ``fn`` costs the group (all ranks call it): :func:`trimmed_mean` of repeats.

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
    return trimmed_mean(per_repeat.tolist())


def fp16_cast_down(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """``fp16_compress_hook``'s compression: cast and divide by N."""
    return x.to(torch.float16).div_(world_size)


def ddp_hook(fmt: str, reduction: str = "two_phase") -> tuple[Any, Callable[..., Any]]:
    """The DDP comm hook (and its state) that reduces in ``fmt``.

    ``"fp32"``: torch's ``allreduce_hook``; ``"fp16"``: torch's
    ``fp16_compress_hook``; any other format: ``aps_comm``'s hook with
    ``reduction`` (two_phase unless told).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if fmt == "fp32":
        return None, default_hooks.allreduce_hook
    if fmt == "fp16":
        return None, default_hooks.fp16_compress_hook
    return APSState(fmt, reduction=reduction), aps_hook


def _stamped(hook: Callable[..., Any], marks: list[tuple[float, float]]) -> Callable[..., Any]:
    """Wrap a DDP comm hook: append (call, completion) ``perf_counter`` stamps."""

    # Unannotated on purpose: DDP rejects string annotations.
    def wrapped(state, bucket):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        fut = hook(state, bucket)

        def done(f):  # type: ignore[no-untyped-def]
            marks.append((t0, time.perf_counter()))
            return f.value()

        return fut.then(done)

    return wrapped


class HookBench:
    """A DDP model of ``n`` parameters in one bucket, reduced by :func:`ddp_hook` (``fmt``).

    The model is ``layers`` square ``Linear`` layers (``n`` is rounded to
    ``layers * width**2``), all in one bucket. Built once, it can be timed in
    several shares (:meth:`steps`) without a new model, or for the APS hook a
    new process group, each time. Must be built on every rank.

    Example:
        >>> bench = HookBench(1024, "fp16")  # doctest: +SKIP
        >>> bench.steps(1, 0.0, lambda first: 5)  # doctest: +SKIP
        [0.0011, 0.0009, 0.0010, 0.0009, 0.0010]
    """

    def __init__(self, n: int, fmt: str, layers: int = 16, reduction: str = "two_phase") -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.fmt = fmt
        width = max(1, round((n / layers) ** 0.5))
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]
        )
        self._x = torch.randn(1, width)
        # One bucket holding the whole message (an explicit cap also sets the first bucket's).
        self._ddp = DDP(model, bucket_cap_mb=layers * width * width * 4 / 2**20 + 1)
        self._marks: list[tuple[float, float]] = []
        state, hook = ddp_hook(fmt, reduction)
        self._ddp.register_comm_hook(state, _stamped(hook, self._marks))

    def steps(
        self,
        warmup: int,
        settle_s: float,
        count: Callable[[float], int],
        from_last_start: bool = True,
    ) -> list[float]:
        """The bucket's time in each timed step.

        Every step starts ``settle_s`` after a barrier, so a shaped link's
        token bucket refills as it does during forward and backward, then runs
        forward and backward: the hook is called by DDP on a busy rank, as in
        training, not on one waking from idle. A step's time runs from the
        hook's call to its future's completion; with ``from_last_start`` (ranks
        sharing a clock: :func:`shared_clock`) from the last rank's call to the
        last rank's completion (the collectives cannot start before the last
        rank joins, and backward-compute skew between ranks is excluded), else
        the slowest rank's own time. ``count`` turns the last warm-up step's
        time (the group's maximum, so every rank runs the same number) into the
        number of timed steps. Must be called on every rank.
        """
        per_step: list[float] = []
        warmup = max(warmup, 1)  # the last warm-up step decides the count
        step, total = 0, warmup + 1
        while step < total:
            self._ddp.zero_grad()
            dist.barrier()
            if settle_s:
                time.sleep(settle_s)
            del self._marks[:]
            self._ddp(self._x).sum().backward()
            if len(self._marks) != 1:
                raise RuntimeError(f"expected one bucket, got {len(self._marks)}")
            t0, t1 = self._marks[0]
            t = torch.tensor([t0, t1, t1 - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seconds = float(t[1] - t[0]) if from_last_start else float(t[2])
            if step >= warmup:
                per_step.append(seconds)
            elif step == warmup - 1:
                total = warmup + count(seconds)
            step += 1
        return per_step


def time_hook_steps(
    n: int,
    fmt: str,
    warmup: int,
    settle_s: float,
    count: Callable[[float], int],
    layers: int = 16,
    from_last_start: bool = True,
    reduction: str = "two_phase",
) -> list[float]:
    """:meth:`HookBench.steps` of a new :class:`HookBench` (``n``, ``fmt``, ``layers``, ``reduction``).

    Example:
        >>> time_hook_steps(1024, "fp16", 1, 0.0, lambda first: 5)  # doctest: +SKIP
        [0.0011, 0.0009, 0.0010, 0.0009, 0.0010]
    """
    return HookBench(n, fmt, layers, reduction).steps(warmup, settle_s, count, from_last_start)
