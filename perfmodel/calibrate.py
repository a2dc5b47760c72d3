"""Fit the model to timings of collectives and codec passes on the real machines.

The timing itself is :mod:`aps_comm.calibrate`'s (it runs the real hook and
codec, beside the code it times); this module takes its plain numbers, a list
of ``{"op", "n", "seconds"}`` samples, and never imports ``aps_comm``.
Every rank runs the same sweep (the collectives need all of them; the codec
passes run on all ranks at once, so they share the machine's cores and memory
bandwidth the way the hook does). The fits:

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

Example (the measuring is the plugin's command; 2 ranks on this machine)::

    aps-launch --nproc-per-node 2 -m aps_comm calibrate --out profile.json \\
        --min-size 64KiB --max-size 64MiB
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .cluster import OpCost
from .collectives import LinkParams
from .profile import Profile

__all__ = ["CALL_ELEMENTS", "COLLECTIVE_COEFFS", "fit_profile", "geometric_sizes"]

# (latency steps, bandwidth bytes factor, reduction bytes factor) as functions of p.
COLLECTIVE_COEFFS = {
    "all_reduce": lambda p: (2.0 * (p - 1), 2.0 * (p - 1) / p, (p - 1) / p),
    "all_to_all": lambda p: (p - 1.0, (p - 1) / p, 0.0),
    "all_gather": lambda p: (p - 1.0, (p - 1) / p, 0.0),
    # aps_comm's pipelined all-to-all + all-gather, timed whole: one latency per
    # call and one burst (the chunks follow back to back). A per-chunk latency
    # cannot be told apart from beta (chunk count and bytes grow together), so
    # it stays inside beta, for the hook's chunk size (aps_comm.calibrate's
    # EXCHANGE_CHUNK_BYTES).
    "exchange": lambda p: (1.0, 2.0 * (p - 1) / p, 0.0),
}
# Elements of the tiny bucket whose whole reduction is timed through each real
# DDP hook ("hook_call.<fmt>" samples): what a bucket costs beyond its bytes.
# The model prices a bucket's fixed cost from it; aps_comm.calibrate times it.
CALL_ELEMENTS = 1024


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
