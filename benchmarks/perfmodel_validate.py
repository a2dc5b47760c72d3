"""Validate the performance model against measurement on loopback Gloo.

For each world size: calibrate (collectives and codec passes over a sweep of
sizes) and fit a profile; then, in a separate run of measurements, time the
three complete reduction paths (FP32 all-reduce, FP16 compress all-reduce, APS
e4m3 two-phase) on messages of 1 to 256 MiB of FP32 gradients and compare with
the profile's predictions (``perfmodel.bucket_comm``).

Writes ``benchmarks/results/perfmodel_validation.{json,md,png}``.

Example::

    python benchmarks/perfmodel_validate.py --world-sizes 2,4 --sizes-mib 1,4,16,64,256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from aps_comm.testing import run_distributed
from perfmodel.calibrate import fit_profile, geometric_sizes, run_calibration
from perfmodel.comm import bucket_comm
from perfmodel.formats import get_format

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS = 16  # parameter tensors per message: APS sends one maximum each
PATHS = {"fp32": "fp32", "fp16": "fp16", "aps-e4m3": "e4m3"}


def _worker(
    rank: int,
    world_size: int,
    calib_sizes: list[int],
    val_sizes: list[int],
    repeats: int,
    codec_kind: str,
) -> dict[str, Any]:
    import torch

    from perfmodel import measure

    samples, codec_label = run_calibration(calib_sizes, repeats, codec_kind, layers=LAYERS)
    codec = measure.load_codec(codec_kind)
    measured = []
    for size in val_sizes:
        n = size // 4 // world_size * world_size
        base = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        x = base.clone()
        layer_sizes = [t.numel() for t in torch.tensor_split(x, LAYERS)]
        runs = {
            "fp32": lambda x=x: measure.fp32_allreduce(x),
            "fp16": lambda x=x: measure.fp16_allreduce(x),
            "aps-e4m3": lambda x=x, ls=layer_sizes: measure.aps_two_phase(x, ls, codec, "e4m3"),
        }
        for path, fn in runs.items():
            if codec is None and path.startswith("aps"):
                continue
            x.copy_(base)
            sec = measure.time_op(fn, repeats)
            measured.append({"path": path, "n": n, "seconds": sec})
    return {"samples": samples, "codec": codec_label, "measured": measured}


def _codec_kind() -> str:
    from perfmodel.measure import load_codec

    return "aps" if load_codec("aps") is not None else "torch"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--sizes-mib", default="1,4,16,64,256", help="validation sizes, FP32 MiB")
    ap.add_argument("--calib-min", type=float, default=0.25, help="calibration min size, MiB")
    ap.add_argument("--calib-max", type=float, default=128.0, help="calibration max size, MiB")
    ap.add_argument("--calib-steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    codec_kind = _codec_kind()
    calib_sizes = geometric_sizes(args.calib_min * 2**20, args.calib_max * 2**20, args.calib_steps)
    val_sizes = [int(float(s) * 2**20) for s in args.sizes_mib.split(",")]
    rows: list[dict[str, Any]] = []
    profiles = {}
    t_start = time.time()
    # The machine may be shared: record its load so the errors can be read in context.
    load_before = os.getloadavg()
    for ws in (int(w) for w in args.world_sizes.split(",")):
        t0 = time.time()
        res = run_distributed(
            _worker,
            ws,
            args=(calib_sizes, val_sizes, args.repeats, codec_kind),
            timeout=1800,
        )[0]
        profile = fit_profile(res["samples"], ws, codec_source=res["codec"], host=platform.node())
        profiles[ws] = profile
        cluster = profile.to_cluster()
        for m in res["measured"]:
            fmt = get_format(PATHS[m["path"]])
            pred = bucket_comm(m["n"], LAYERS, fmt, cluster).total_s
            rows.append(
                {
                    "world_size": ws,
                    "path": m["path"],
                    "fp32_mib": m["n"] * 4 / 2**20,
                    "measured_s": m["seconds"],
                    "predicted_s": pred,
                    "rel_err": (pred - m["seconds"]) / m["seconds"],
                }
            )
        print(f"world size {ws}: {time.time() - t0:.0f} s", flush=True)

    summary = {}
    for path in PATHS:
        errs = [abs(r["rel_err"]) for r in rows if r["path"] == path]
        if errs:
            summary[path] = {
                "median_abs_err": statistics.median(errs),
                "max_abs_err": max(errs),
                "n": len(errs),
            }
    allerr = [abs(r["rel_err"]) for r in rows]
    summary["all"] = {
        "median_abs_err": statistics.median(allerr),
        "max_abs_err": max(allerr),
        "n": len(allerr),
    }

    report = {
        "setup": {
            "backend": "gloo",
            "transport": "loopback 127.0.0.1, one process per rank, 1 intra-op thread each",
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "codec": profiles[next(iter(profiles))].codec_source,
            "layers_per_message": LAYERS,
            "calibration_sizes_bytes": calib_sizes,
            "validation_sizes_bytes": val_sizes,
            "repeats": args.repeats,
            "runtime_s": time.time() - t_start,
            "loadavg_1_5_15_before": load_before,
            "loadavg_1_5_15_after": os.getloadavg(),
        },
        "summary": summary,
        "rows": rows,
        "profiles": {ws: p.to_dict() | {"samples": len(p.samples)} for ws, p in profiles.items()},
    }
    (out / "perfmodel_validation.json").write_text(json.dumps(report, indent=2) + "\n")
    _write_md(out / "perfmodel_validation.md", report)
    _plot(out / "perfmodel_validation.png", rows)
    print(json.dumps(summary, indent=2))


def _write_md(path: Path, report: dict[str, Any]) -> None:
    s = report["setup"]
    lines = [
        "# perfmodel: predicted vs measured reduction time (loopback)",
        "",
        "Generated by `python benchmarks/perfmodel_validate.py`; numbers are from one run.",
        "",
        f"- Setup: Gloo on {s['transport']}; host `{s['host']}` with {s['cpu_count']} cores.",
        f"- Codec: `{s['codec']}`; {s['layers_per_message']} layers per message (one APS maximum each).",
        "- Model: a profile fitted per world size by `perfmodel.calibrate` on a separate sweep of "
        f"{len(s['calibration_sizes_bytes'])} sizes from "
        f"{s['calibration_sizes_bytes'][0] / 2**20:.2g} to {s['calibration_sizes_bytes'][-1] / 2**20:.0f} MiB "
        "(collectives and codec passes timed separately), then `perfmodel.bucket_comm` "
        "predicts each complete path.",
        f"- Measured: median of {s['repeats']} repeats of the slowest rank, after one warm-up.",
        f"- Runtime: {s['runtime_s']:.0f} s. Load average (1/5/15 min) before "
        f"{', '.join(f'{v:.1f}' for v in s['loadavg_1_5_15_before'])}, after "
        f"{', '.join(f'{v:.1f}' for v in s['loadavg_1_5_15_after'])} "
        f"on {s['cpu_count']} cores (other jobs share the machine).",
        "",
        "## Summary (absolute relative error)",
        "",
        "| path | median | worst | points |",
        "|---|---:|---:|---:|",
    ]
    for name, v in report["summary"].items():
        lines.append(f"| {name} | {v['median_abs_err']:.1%} | {v['max_abs_err']:.1%} | {v['n']} |")
    lines += [
        "",
        "Target (issue 5): median <= 10%, worst <= 25%.",
        "",
        "## All points",
        "",
        "| ranks | path | FP32 MiB | measured | predicted | error |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['world_size']} | {r['path']} | {r['fp32_mib']:.0f} | {r['measured_s'] * 1e3:.2f} ms "
            f"| {r['predicted_s'] * 1e3:.2f} ms | {r['rel_err']:+.1%} |"
        )
    path.write_text("\n".join(lines) + "\n")


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.5))
    markers = {2: "o", 3: "^", 4: "s"}
    colors = {"fp32": "C0", "fp16": "C1", "aps-e4m3": "C2"}
    for r in rows:
        ax.scatter(
            r["measured_s"],
            r["predicted_s"],
            marker=markers.get(r["world_size"], "x"),
            color=colors[r["path"]],
        )
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) / 1.5
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1.5
    ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
    ax.fill_between(
        [lo, hi],
        [lo * 0.9, hi * 0.9],
        [lo * 1.1, hi * 1.1],
        color="grey",
        alpha=0.15,
        label="+-10%",
    )
    for name, c in colors.items():
        ax.scatter([], [], color=c, label=name)
    for ws, m in markers.items():
        if any(r["world_size"] == ws for r in rows):
            ax.scatter([], [], marker=m, color="k", label=f"{ws} ranks")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (s)")
    ax.set_ylabel("predicted (s)")
    ax.set_title("perfmodel vs Gloo loopback, 1-256 MiB FP32 messages")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
