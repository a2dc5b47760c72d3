"""Time the collectives, the codec and the real DDP hooks for the performance model.

The model (:mod:`aps_perfmodel.calibrate`) fits plain numbers: a list of
``{"op", "n", "seconds"}`` samples. Producing them means running this
package's codec and hook, so the timing lives here, beside the code it times,
and the model never imports ``aps_comm``. ``python -m aps_comm calibrate`` (run
under ``aps-launch`` or ``torchrun``) calls :func:`calibrate_command`; a
script can call :func:`run_calibration` and fit the samples itself.

Example (2 ranks on this machine)::

    aps-launch --nproc-per-node 2 -m aps_comm calibrate --out profile.json \\
        --min-size 64KiB --max-size 64MiB
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from aps_comm import measure
from aps_perfmodel.calibrate import CALL_ELEMENTS, COLLECTIVE_COEFFS, fit_profile
from aps_perfmodel.profile import Profile
from aps_perfmodel.units import format_bandwidth, format_bytes, format_time

__all__ = ["calibrate_command", "calibrate_here", "run_calibration"]

_MAXIMA_COUNTS = (1, 16, 64, 256)
_FMT = "e4m3"
# aps_comm.hook's chunk, in bytes of an 8-bit wire format.
EXCHANGE_CHUNK_BYTES = 2**20
# The hooks whose whole call is calibrated: torch's FP32 and FP16 hooks, and
# aps_comm's two_phase hook.
HOOK_CALL_FORMATS = ("fp32", "fp16", _FMT)
# Idle time before every timed call: a shaper's token bucket refills and the
# cores go idle, as before a gradient bucket that follows forward and backward.
SETTLE_S = 0.02


def run_calibration(
    sizes: Sequence[int],
    repeats: int = 5,
    codec_kind: str = "aps",
    layers: int = 16,
    verbose: bool = False,
    settle_s: float = SETTLE_S,
    budget_s: float | None = None,
    max_repeats: int | None = None,
    progress: bool = False,
) -> tuple[list[dict[str, Any]], str]:
    """Time every collective and codec pass on the initialised default group.

    Must be called on every rank. ``sizes`` are FP32 gradient bytes per rank
    (rounded to a multiple of the world size and of 4). Every timed call
    starts ``settle_s`` after a barrier: measured on the emulated cluster, the
    first collective after 20 ms idle took 3 ms where back-to-back ones took
    0.3 ms (idle cores wake slowly), and a tbf shaper passes its burst only
    after idling; a bucket after forward and backward meets both.
    ``budget_s``/``max_repeats`` (default: :func:`aps_comm.measure.time_op`'s)
    give quick operations more repeats, where small messages are noisiest.
    ``progress`` shows a progress bar of the sizes on rank 0's stderr (a
    calibration takes minutes).

    Returns:
        The samples (identical on every rank; trimmed means of repeats, each timed by
        the slowest rank, or for collectives on ranks sharing a clock from the
        last rank's start: ``"timed"``)
        and the codec's name.
    """
    p = dist.get_world_size()
    codec = measure.load_codec(codec_kind)
    budget = measure.BUDGET_S if budget_s is None else budget_s
    cap = measure.MAX_REPEATS if max_repeats is None else max_repeats
    # Collectives are timed from the last rank's start where the ranks share a
    # clock, as the validation times DDP's hooks; local passes by the slowest rank.
    record = _Recorder(repeats, settle_s, budget, cap, measure.shared_clock(), verbose)
    for count in _MAXIMA_COUNTS:
        m = torch.rand(count)
        record("all_reduce_max", 4 * count, lambda m=m: dist.all_reduce(m, op=dist.ReduceOp.MAX))

    # Each collective here, timed alone after an idle spell, pays a wake-up
    # (measured on the emulated cluster: ~2 ms for a 4-byte all-reduce, 0.35 ms
    # back to back) that a bucket's later collectives do not; and DDP calls its
    # hook on a busy rank. So the fixed cost of a bucket is timed whole, through
    # the real hook, as a tiny bucket inside DDP's backward.
    benches = [measure.HookBench(CALL_ELEMENTS, fmt, layers) for fmt in HOOK_CALL_FORMATS]
    hook_steps: dict[str, list[float]] = {fmt: [] for fmt in HOOK_CALL_FORMATS}
    bar = tqdm(sizes, desc="calibrating", unit="size", disable=not progress or dist.get_rank() != 0)
    for size in bar:
        for bench in benches:
            hook_steps[bench.fmt] += bench.steps(
                1,
                settle_s,
                lambda first: measure.repeats_for(first, repeats, budget, cap),
                from_last_start=record.aligned,
            )
        n = max(p, int(size) // 4 // p * p)
        x = torch.randn(n)
        _record_collectives(record, x, p)
        _record_codec(record, codec, x, p, layers)
    # The hook calls' repeats are spread over the sweep, a share after each size:
    # on a shared machine slow spells last seconds, and the fixed cost that every
    # bucket pays should not be decided by one of them.
    for fmt, steps in hook_steps.items():
        record.samples.append(
            {
                "op": f"hook_call.{fmt}",
                "n": CALL_ELEMENTS,
                "seconds": measure.trimmed_mean(steps),
                "timed": "last_start" if record.aligned else "slowest_rank",
            }
        )
        if verbose and dist.get_rank() == 0:
            sec = record.samples[-1]["seconds"]
            print(f"  hook_call.{fmt:12s} n={CALL_ELEMENTS:>11d}  {sec * 1e3:9.3f} ms")
    return record.samples, measure.codec_name(codec)


@dataclasses.dataclass
class _Recorder:
    """Times one operation and keeps its sample (see :func:`run_calibration`)."""

    repeats: int
    settle_s: float
    budget_s: float
    max_repeats: int
    aligned: bool
    verbose: bool
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __call__(self, op: str, n: float, fn: Callable[[], object]) -> None:
        collective = op.split(".")[0] in COLLECTIVE_COEFFS or op.startswith("all_reduce")
        span = collective and self.aligned
        sec = measure.time_op(
            fn,
            self.repeats,
            settle_s=self.settle_s,
            from_last_start=span,
            budget_s=self.budget_s,
            max_repeats=self.max_repeats,
        )
        self.samples.append(
            {"op": op, "n": n, "seconds": sec, "timed": "last_start" if span else "slowest_rank"}
        )
        if self.verbose and dist.get_rank() == 0:
            print(f"  {op:22s} n={int(n):>11d}  {sec * 1e3:9.3f} ms", flush=True)


def _record_collectives(record: _Recorder, x: torch.Tensor, p: int) -> None:
    """The collectives and FP16 casts on ``x``'s n elements (n/p per shard)."""
    n = x.numel()
    record("all_reduce.float32", 4 * n, lambda: dist.all_reduce(x))
    h = x.to(torch.float16)
    record("all_reduce.float16", 2 * n, lambda: dist.all_reduce(h))
    u8 = torch.randint(0, 255, (n,), dtype=torch.uint8)
    out8 = torch.empty_like(u8)
    record("all_to_all", n, lambda: dist.all_to_all_single(out8, u8))
    shard = u8[: n // p].clone()
    record("all_gather", n, lambda: measure.all_gather_single(out8, shard))
    gathered = torch.empty_like(u8)
    record(
        "exchange",
        n,
        lambda: measure.pipelined_exchange(u8, out8, gathered, EXCHANGE_CHUNK_BYTES),
    )
    record("encode.fp16", n, lambda: measure.fp16_cast_down(x, p))
    # fp16_compress_hook copies the result back into the existing bucket.
    back = torch.empty_like(x)
    record("decode.fp16", n, lambda: back.copy_(h))


def _times(
    segs: Sequence[torch.Tensor], out: torch.Tensor, sizes: list[int], factor: float
) -> None:
    """Every layer times its factor, as the per-layer codec scales (split on every call)."""
    for a, b in zip(segs, torch.split(out, sizes), strict=True):
        torch.mul(a, factor, out=b)


def _record_codec(record: _Recorder, codec: Any, x: torch.Tensor, p: int, layers: int) -> None:
    """The APS codec's passes on ``x``'s n elements, in ``layers`` layers."""
    n = x.numel()
    sizes_l = [s.numel() for s in torch.tensor_split(x, layers)]
    segs = torch.split(x, sizes_l)
    scaled = torch.empty_like(x)
    # Outputs are allocated once, as the hook's are (its scratch buffers and
    # the bucket itself): a fresh output per call would time page faults.
    payload = codec.encode(x, _FMT)
    decoded = torch.empty_like(x)
    shards = codec.encode(torch.randn(n), _FMT)
    reduced = torch.empty(n // p, dtype=torch.uint8)
    record("amax", n, lambda: codec.amax(x, sizes_l))
    record("scale", n, lambda: _times(segs, scaled, sizes_l, 2.0))
    record(f"encode.{_FMT}", n, lambda: codec.encode(x, _FMT, out=payload))
    record(f"decode.{_FMT}", n, lambda: codec.decode(payload, _FMT, n, out=decoded))
    record("unscale", n, lambda: _times(segs, scaled, sizes_l, 0.5))
    # The shard owner's whole step on n received elements: decode the p
    # shards, FP32 sum, divide, re-encode n/p.
    record(f"reduce.{_FMT}", n, lambda: codec.reduce(shards, p, _FMT, out=reduced))
    record("accumulate", n, lambda: decoded.view(p, -1).sum(0).div_(p))


def calibrate_here(
    sizes: Sequence[int],
    repeats: int = 5,
    codec_kind: str = "aps",
    verbose: bool = False,
    progress: bool = False,
) -> Profile:
    """Run :func:`run_calibration` on the current group and fit (on every rank).

    Example:
        >>> calibrate_here([65536, 1 << 20]).save("profile.json")  # doctest: +SKIP
    """
    samples, label = run_calibration(sizes, repeats, codec_kind, verbose=verbose, progress=progress)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return fit_profile(
        samples,
        dist.get_world_size(),
        backend=str(dist.get_backend()),
        codec_source=label,
        host=socket.gethostname(),
        cores_per_rank=(os.cpu_count() or 1) / max(1, local),
    )


def calibrate_command(
    out: str | Path,
    sizes: Sequence[int],
    repeats: int = 5,
    codec_kind: str = "aps",
    backend: str = "gloo",
    timeout_s: float = 300.0,
    verbose: bool = False,
) -> int:
    """``python -m aps_comm calibrate``: time this group, fit, and write the profile on rank 0.

    Initialises the default group from the launcher's environment (and
    destroys it again) unless one is already initialised.

    Args:
        out: the profile JSON to write.
        sizes: FP32 gradient bytes per rank to time.
        repeats: timed repeats per point (at least).
        codec_kind: ``"aps"`` (this package's codec) or ``"torch"`` (native casts).
        backend: the torch.distributed backend for a new group.
        timeout_s: the collectives' timeout for a new group.
        verbose: print every measurement.

    Returns:
        The exit status, 0.

    Raises:
        SystemExit: not under a launcher (no RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT).
    """
    created = False
    if not dist.is_initialized():
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
        ]
        if missing:
            raise SystemExit(
                f"error: run under aps-launch or torchrun (missing {', '.join(missing)})"
            )
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        created = True
    try:
        if dist.get_rank() == 0:
            print(
                f"calibrating on {dist.get_world_size()} ranks: {len(sizes)} sizes from "
                f"{format_bytes(min(sizes))} to {format_bytes(max(sizes))}, {repeats} "
                "repeats each (the defaults take 2-3 minutes on 2 CPU ranks)",
                file=sys.stderr,
                flush=True,
            )
        # The measurements printed one per line are progress enough with --verbose.
        profile = calibrate_here(sizes, repeats, codec_kind, verbose=verbose, progress=not verbose)
        if dist.get_rank() == 0:
            profile.save(out)
            link = profile.link
            print(
                f"fitted on {profile.world_size} ranks: alpha={format_time(link.alpha)}, "
                f"bandwidth={format_bandwidth(link.bandwidth)}, gamma={link.gamma:.3g} s/B"
            )
            for op, err in profile.fit_errors.items():
                print(
                    f"  {op:22s} median err {err['median_rel_err']:6.1%}  "
                    f"worst {err['max_rel_err']:6.1%}"
                )
            print(f"wrote {out}")
    finally:
        if created:
            dist.destroy_process_group()
    return 0
