"""Measure collectives and codec passes on the real machines and fit the model.

Every rank runs the same sweep (the collectives need all of them; the codec
passes run on all ranks at once, so they share the machine's cores and memory
bandwidth the way the hook does). Rank 0 fits:

- per collective, ``t = A(p) alpha + B(p) n beta`` with the collective's own
  coefficients (gamma folded into beta: one world size cannot separate them);
- jointly over all collectives, one ``(alpha, beta, gamma)``: all-gather and
  all-to-all reduce nothing, which is what separates beta from gamma;
- per codec pass, ``t = launch + n s_per_elem``.

Fits minimise relative error (weights ``1/t``), so small messages count as much
as large ones, with non-negative parameters.

A token-bucket shaper (Linux ``tc tbf``, as on the emulated cluster) lets the
first ``burst`` bytes of each call through unshaped; the affine law would then
read the small samples as a faster link and under-estimate ``beta`` for every
large message. ``burst_bytes`` (known from the shaper's configuration, or
``"fit"`` to pick it from the samples) makes the bandwidth column
``max(0, B(p) n - burst)``, and the profile's links carry it
(:attr:`~aps_perfmodel.collectives.LinkParams.burst_bytes`).

Example (under ``aps-launch`` or ``torchrun``)::

    aps-perfmodel calibrate --out profile.json --min-size 64KiB --max-size 64MiB
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np

from .cluster import OpCost
from .collectives import LinkParams
from .profile import Profile

__all__ = ["COLLECTIVE_COEFFS", "fit_profile", "geometric_sizes", "run_calibration"]

# (latency steps, bandwidth bytes factor, reduction bytes factor) as functions of p.
COLLECTIVE_COEFFS = {
    "all_reduce": lambda p: (2.0 * (p - 1), 2.0 * (p - 1) / p, (p - 1) / p),
    "all_to_all": lambda p: (p - 1.0, (p - 1) / p, 0.0),
    "all_gather": lambda p: (p - 1.0, (p - 1) / p, 0.0),
    # aps_comm's pipelined all-to-all + all-gather, timed whole: one latency per
    # call and one burst (the chunks follow back to back). A per-chunk latency
    # cannot be told apart from beta (chunk count and bytes grow together), so
    # it stays inside beta, for the hook's chunk size (EXCHANGE_CHUNK_BYTES).
    "exchange": lambda p: (1.0, 2.0 * (p - 1) / p, 0.0),
}
_MAXIMA_COUNTS = (1, 16, 64, 256)
_FMT = "e4m3"
# aps_comm.hook's chunk, in bytes of an 8-bit wire format.
EXCHANGE_CHUNK_BYTES = 2**20
# Elements of the tiny bucket whose whole reduction is timed through each real
# DDP hook ("hook_call.<fmt>"): what a bucket costs beyond its bytes.
CALL_ELEMENTS = 1024
# The hooks whose whole call is calibrated: torch's FP32 and FP16 hooks, and
# aps_comm's two_phase hook.
HOOK_CALL_FORMATS = ("fp32", "fp16", _FMT)
# Idle time before every timed call: a shaper's token bucket refills and the
# cores go idle, as before a gradient bucket that follows forward and backward.
SETTLE_S = 0.02


def geometric_sizes(min_bytes: float, max_bytes: float, steps: int) -> list[int]:
    """Sizes in bytes from ``min_bytes`` to ``max_bytes``, evenly spaced in log.

    Example:
        >>> geometric_sizes(1024, 4096, 3)
        [1024, 2048, 4096]
    """
    if steps < 2:
        return [int(max_bytes)]
    return [round(float(v)) for v in np.geomspace(min_bytes, max_bytes, steps)]


def _nnls(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (exhaustive over supports; tiny problems)."""
    best, best_err = np.zeros(features.shape[1]), np.inf
    cols = range(features.shape[1])
    for k in range(1, features.shape[1] + 1):
        for support in itertools.combinations(cols, k):
            sub = features[:, support]
            coef, *_ = np.linalg.lstsq(sub, target, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - target) ** 2))
            if err < best_err:
                best_err = err
                best = np.zeros(features.shape[1])
                best[list(support)] = coef
    return best


def _fit_relative(features: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """Fit ``seconds ~ features @ coef`` minimising relative error; report the errors."""
    weights = 1.0 / seconds
    coef = _nnls(features * weights[:, None], np.ones_like(seconds))
    rel = np.abs(features @ coef - seconds) / seconds
    return coef, {"median_rel_err": float(np.median(rel)), "max_rel_err": float(np.max(rel))}


def _fit_collectives(
    by_op: dict[str, list[tuple[float, float]]], p: int, burst: float
) -> tuple[dict[str, LinkParams], LinkParams, dict[str, dict[str, float]], float]:
    """Per-collective and joint link fits with a given burst; also the summed relative error."""
    collectives: dict[str, LinkParams] = {}
    errors: dict[str, dict[str, float]] = {}
    joint_rows, joint_t = [], []
    total = 0.0
    for op, pts in sorted(by_op.items()):
        family = op.split(".")[0]
        if family not in COLLECTIVE_COEFFS and op != "all_reduce_max":
            continue
        n = np.array([x for x, _ in pts])
        t = np.array([y for _, y in pts])
        a, b, c = COLLECTIVE_COEFFS["all_reduce" if op == "all_reduce_max" else family](p)
        wire = np.maximum(0.0, b * n - burst)
        features = np.column_stack([np.full_like(n, a), wire])
        coef, err = _fit_relative(features, t)
        collectives[op] = LinkParams(float(coef[0]), float(coef[1]), 0.0, float(burst))
        errors[op] = err
        total += float(np.sum(np.abs(features @ coef - t) / t))
        if op not in ("all_reduce_max", "exchange"):
            joint_rows.append(np.column_stack([np.full_like(n, a), wire, c * n]))
            joint_t.append(t)
    if joint_rows:
        coef, err = _fit_relative(np.vstack(joint_rows), np.concatenate(joint_t))
        link = LinkParams(float(coef[0]), float(coef[1]), float(coef[2]), float(burst))
        errors["link(joint)"] = err
    else:
        link = LinkParams(0.0, 0.0, 0.0)
    return collectives, link, errors, total


def _burst_candidates(by_op: dict[str, list[tuple[float, float]]], p: int) -> list[float]:
    """0, and 128 sizes spaced evenly in log between the smallest and largest per-rank wire sizes."""
    wire = [
        COLLECTIVE_COEFFS[op.split(".")[0]](p)[1] * n
        for op, pts in by_op.items()
        if op.split(".")[0] in COLLECTIVE_COEFFS and op != "all_reduce_max"
        for n, _ in pts
    ]
    wire = [w for w in wire if w > 0]
    if not wire:
        return [0.0]
    return [0.0, *(float(v) for v in np.geomspace(min(wire), max(wire), 128))]


def fit_profile(
    samples: Sequence[dict[str, Any]],
    world_size: int,
    *,
    burst_bytes: float | str = 0.0,
    backend: str = "gloo",
    codec_source: str = "none",
    host: str = "",
    cores_per_rank: float | None = None,
) -> Profile:
    """Fit a :class:`Profile` from timing samples.

    Args:
        samples: ``{"op", "n", "seconds"}`` dicts. Collective ops are
            ``all_reduce.<dtype>``, ``all_to_all``, ``all_gather`` with ``n`` in
            bytes, and ``all_reduce_max`` (``n`` bytes of float32 maxima);
            codec ops (``amax``, ``scale``, ``unscale``, ``accumulate``,
            ``encode.<fmt>``, ``decode.<fmt>``, and ``reduce.<fmt>``: the shard
            owner's fused decode-sum-encode of ``n`` received elements) have
            ``n`` in elements.
        world_size: ranks the samples were measured on.
        burst_bytes: bytes per rank and call a token-bucket shaper passes
            unshaped (the tbf ``burst``), or ``"fit"`` to choose, among 0 and
            the sampled per-rank wire sizes, the one with the least summed
            relative error over the collective fits (a log grid over the sampled
            per-rank wire sizes). Recorded in every link.
        backend: backend name to record.
        codec_source: which codec produced the codec samples.
        host: host name to record.
        cores_per_rank: CPU cores per rank on the measured machines, if known.

    Example:
        >>> s = [{"op": "all_gather", "n": n, "seconds": 1e-4 + n * 1e-9 / 2} for n in (1e3, 1e6)]
        >>> p = fit_profile(s, 2)
        >>> round(p.collectives["all_gather"].beta * 1e9, 6)
        1.0
    """
    p = world_size
    by_op: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        by_op.setdefault(s["op"], []).append((float(s["n"]), float(s["seconds"])))

    if burst_bytes == "fit":
        fits = [_fit_collectives(by_op, p, b) for b in _burst_candidates(by_op, p)]
        collectives, link, errors, _ = min(fits, key=lambda f: f[3])
    elif isinstance(burst_bytes, str):
        raise ValueError(f"burst_bytes must be a number of bytes or 'fit', got {burst_bytes!r}")
    else:
        collectives, link, errors, _ = _fit_collectives(by_op, p, float(burst_bytes))
    codec: dict[str, OpCost] = {}
    for op, pts in sorted(by_op.items()):
        if op.split(".")[0] in COLLECTIVE_COEFFS or op == "all_reduce_max":
            continue
        n = np.array([x for x, _ in pts])
        t = np.array([y for _, y in pts])
        if op.split(".")[0].endswith("_call"):
            # One tiny size: a fixed cost per call.
            codec[op] = OpCost(launch_s=float(np.median(t)), s_per_elem=0.0)
            rel = np.abs(t / np.median(t) - 1)
            errors[op] = {"median_rel_err": float(np.median(rel)), "max_rel_err": float(rel.max())}
            continue
        coef, err = _fit_relative(np.column_stack([np.ones_like(n), n]), t)
        codec[op] = OpCost(launch_s=float(coef[0]), s_per_elem=float(coef[1]))
        errors[op] = err
    return Profile(
        world_size=p,
        backend=backend,
        link=link,
        collectives=collectives,
        codec=codec,
        codec_source=codec_source,
        fit_errors=errors,
        samples=[dict(s) for s in samples],
        host=host,
        cores_per_rank=cores_per_rank,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


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
    ``budget_s``/``max_repeats`` (default: :func:`aps_perfmodel.measure.time_op`'s)
    give quick operations more repeats, where small messages are noisiest.
    ``progress`` shows a progress bar of the sizes on rank 0's stderr (a
    calibration takes minutes).

    Returns:
        The samples (identical on every rank; trimmed means of repeats, each timed by
        the slowest rank, or for collectives on ranks sharing a clock from the
        last rank's start: ``"timed"``)
        and the codec's name ("none" if it could not be loaded).
    """
    import torch
    import torch.distributed as dist

    from . import measure

    p = dist.get_world_size()
    codec = measure.load_codec(codec_kind)
    codec_label = "none" if codec is None else measure.codec_name(codec)
    if codec is None and dist.get_rank() == 0:
        print("aps_comm.codec is not importable: skipping codec calibration")
    samples: list[dict[str, Any]] = []
    # Collectives are timed from the last rank's start where the ranks share a
    # clock, as the validation times DDP's hooks; local passes by the slowest rank.
    aligned = measure.shared_clock()
    budget = measure.BUDGET_S if budget_s is None else budget_s
    cap = measure.MAX_REPEATS if max_repeats is None else max_repeats

    def record(op: str, n: float, fn: Any) -> None:
        collective = op.split(".")[0] in COLLECTIVE_COEFFS or op.startswith("all_reduce")
        span = collective and aligned
        sec = measure.time_op(
            fn, repeats, settle_s=settle_s, from_last_start=span, budget_s=budget, max_repeats=cap
        )
        samples.append(
            {"op": op, "n": n, "seconds": sec, "timed": "last_start" if span else "slowest_rank"}
        )
        if verbose and dist.get_rank() == 0:
            print(f"  {op:22s} n={int(n):>11d}  {sec * 1e3:9.3f} ms", flush=True)

    for count in _MAXIMA_COUNTS:
        m = torch.rand(count)
        record("all_reduce_max", 4 * count, lambda m=m: dist.all_reduce(m, op=dist.ReduceOp.MAX))

    # Each collective here, timed alone after an idle spell, pays a wake-up
    # (measured on the emulated cluster: ~2 ms for a 4-byte all-reduce, 0.35 ms
    # back to back) that a bucket's later collectives do not; and DDP calls its
    # hook on a busy rank. So the fixed cost of a bucket is timed whole, through
    # the real hook, as a tiny bucket inside DDP's backward.
    hook_fmts = HOOK_CALL_FORMATS if codec is not None else HOOK_CALL_FORMATS[:2]
    benches = [measure.HookBench(CALL_ELEMENTS, fmt, layers) for fmt in hook_fmts]
    hook_steps: dict[str, list[float]] = {fmt: [] for fmt in hook_fmts}
    from tqdm import tqdm

    bar = tqdm(
        sizes,
        desc="calibrating",
        unit="size",
        disable=not progress or dist.get_rank() != 0,
    )
    for size in bar:
        for bench in benches:
            hook_steps[bench.fmt] += bench.steps(
                1,
                settle_s,
                lambda first: measure.repeats_for(first, repeats, budget, cap),
                from_last_start=aligned,
            )
        n = max(p, int(size) // 4 // p * p)
        x = torch.randn(n)
        record("all_reduce.float32", 4 * n, lambda x=x: dist.all_reduce(x))
        h = x.to(torch.float16)
        record("all_reduce.float16", 2 * n, lambda h=h: dist.all_reduce(h))
        u8 = torch.randint(0, 255, (n,), dtype=torch.uint8)
        out8 = torch.empty_like(u8)
        record("all_to_all", n, lambda u8=u8, out8=out8: dist.all_to_all_single(out8, u8))
        shard = u8[: n // p].clone()
        record("all_gather", n, lambda s=shard, o=out8: measure.all_gather_single(o, s))
        gathered = torch.empty_like(u8)
        record(
            "exchange",
            n,
            lambda u8=u8, o=out8, g=gathered: measure.pipelined_exchange(
                u8, o, g, EXCHANGE_CHUNK_BYTES
            ),
        )
        record("encode.fp16", n, lambda x=x: measure.fp16_cast_down(x, p))
        # fp16_compress_hook copies the result back into the existing bucket.
        back = torch.empty_like(x)
        record("decode.fp16", n, lambda b=back, h=h: b.copy_(h))
        if codec is None:
            continue
        sizes_l = [s.numel() for s in torch.tensor_split(x, layers)]
        segs = torch.split(x, sizes_l)
        scaled = torch.empty_like(x)
        # Outputs are allocated once, as the hook's are (its scratch buffers and
        # the bucket itself): a fresh output per call would time page faults.
        payload = codec.encode(x, _FMT)
        decoded = torch.empty_like(x)
        shards = codec.encode(torch.randn(n), _FMT)
        reduced = torch.empty(n // p, dtype=torch.uint8)
        record("amax", n, lambda x=x, sl=sizes_l: codec.amax(x, sl))
        record(
            "scale",
            n,
            lambda s=segs, o=scaled, sl=sizes_l: [
                torch.mul(a, 2.0, out=b) for a, b in zip(s, torch.split(o, sl), strict=True)
            ],
        )
        record(f"encode.{_FMT}", n, lambda x=x, o=payload: codec.encode(x, _FMT, out=o))
        record(
            f"decode.{_FMT}",
            n,
            lambda pl=payload, o=decoded: codec.decode(pl, _FMT, o.numel(), out=o),
        )
        record(
            "unscale",
            n,
            lambda s=segs, o=scaled, sl=sizes_l: [
                torch.mul(a, 0.5, out=b) for a, b in zip(s, torch.split(o, sl), strict=True)
            ],
        )
        # The shard owner's whole step on n received elements: decode the p
        # shards, FP32 sum, divide, re-encode n/p.
        record(f"reduce.{_FMT}", n, lambda sh=shards, o=reduced: codec.reduce(sh, p, _FMT, out=o))
        record("accumulate", n, lambda d=decoded: d.view(p, -1).sum(0).div_(p))
    # The hook calls' repeats are spread over the sweep, a share after each size:
    # on a shared machine slow spells last seconds, and the fixed cost that every
    # bucket pays should not be decided by one of them.
    for fmt, steps in hook_steps.items():
        samples.append(
            {
                "op": f"hook_call.{fmt}",
                "n": CALL_ELEMENTS,
                "seconds": measure.trimmed_mean(steps),
                "timed": "last_start" if aligned else "slowest_rank",
            }
        )
        if verbose and dist.get_rank() == 0:
            print(
                f"  hook_call.{fmt:12s} n={CALL_ELEMENTS:>11d}  {samples[-1]['seconds'] * 1e3:9.3f} ms"
            )
    return samples, codec_label


def calibrate_here(
    sizes: Sequence[int],
    repeats: int = 5,
    codec_kind: str = "aps",
    verbose: bool = False,
    progress: bool = False,
) -> Profile:
    """Run :func:`run_calibration` on the current group and fit (on every rank)."""
    import torch.distributed as dist

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
