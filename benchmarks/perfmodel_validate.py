"""Validate the performance model against measurement on an emulated cluster.

For each world size, on an :class:`benchmarks.cluster.EmulatedCluster` (each
rank in its own network namespace behind a tbf-shaped link; ``--loopback``
runs the same ranks on 127.0.0.1 unshaped): measure the link, then on every
rank

1. calibrate: time the collectives and codec passes over a sweep of sizes
   (``aps_comm.calibrate.run_calibration``) and fit a profile;
2. measure, separately, the three complete reduction paths as DDP runs them:
   a 16-layer ``Linear`` stack whose gradients are exactly the message, in one
   DDP bucket, with torch's ``allreduce_hook`` (FP32), ``fp16_compress_hook``
   (FP16) and ``aps_comm``'s hook (e4m3, two_phase, chunk-pipelined). The time
   of a path runs from the last rank's hook call to the last rank's future
   completing (ranks share one monotonic clock), so backward compute and
   its skew between ranks are excluded.

The profile's prediction (``aps_perfmodel.bucket_comm``) is compared with each
measurement.

With ``--nodes M --ranks-per-node L`` the cluster has nodes (ranks of a node
talk over its unshaped loopback, the node's shaped link is shared by its L
ranks) and a fourth path is measured, APS e4m3 hierarchical. The model then
runs on M nodes of L ranks: the calibrated fits (collectives timed on all N
ranks, the codec passes) and, for the hierarchical stages, the node's link
and its loopback as the emulated cluster's probe measured them. Writes ``perfmodel_validation.{json,md,png}`` to ``--out`` (default: the
working directory; the committed ones are in ``benchmarks/results``).

Example (needs root for the namespaces)::

    python -m benchmarks.perfmodel_validate --world-sizes 2,4 --bandwidth 1gbit
    python -m benchmarks.perfmodel_validate --loopback --world-sizes 2
    python -m benchmarks.perfmodel_validate --nodes 2 --ranks-per-node 2 --bandwidth 1gbit
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aps_comm.measure import (
    BUDGET_S,
    MAX_REPEATS,
    TRIM,
    repeats_for,
    time_hook_steps,
    trimmed_mean,
)
from aps_perfmodel.calibrate import fit_profile, geometric_sizes
from aps_perfmodel.comm import bucket_comm
from aps_perfmodel.formats import get_format
from benchmarks.cluster import PIN_CHOICES, add_pin_argument

LAYERS = 16  # parameter tensors per message: APS sends one maximum each
PATHS = {"fp32": "fp32", "fp16": "fp16", "aps-e4m3": "e4m3"}
NODE_PATHS = {**PATHS, "aps-e4m3-hierarchical": "e4m3"}
"""The paths measured with several ranks per node: path -> wire format."""
# The APS paths' reductions (the hook's and the model's strategy name).
_REDUCTION = {"aps-e4m3": "two_phase", "aps-e4m3-hierarchical": "hierarchical"}


def _measure_paths(
    sizes: list[int],
    repeats: int,
    warmup: int,
    settle_s: float,
    budget_s: float,
    max_repeats: int,
    rounds: int = 1,
    paths: dict[str, str] = PATHS,
) -> list[dict[str, Any]]:
    """Time each path's bucket communication inside DDP; median over all repeats.

    Every step starts ``settle_s`` after a barrier, so a shaped link's token
    bucket is full again, as the model assumes of a link that idled during
    forward and backward. With ``rounds`` > 1 the sweep over sizes and paths
    runs that many times, each round taking its share of a point's repeats:
    a shared machine has slow spells lasting seconds, and one point's repeats
    back to back can all land in one.
    """
    import torch.distributed as dist

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    # n rounded so that the layers are square: the message the model predicts.
    points = [
        (LAYERS * max(1, round((size / 4 / LAYERS) ** 0.5)) ** 2, path)
        for size in sizes
        for path in paths
    ]
    samples: dict[tuple[int, str], list[float]] = {pt: [] for pt in points}
    share: dict[tuple[int, str], int] = {}

    def count(pt: tuple[int, str], first: float) -> int:
        # Quick paths are the noisy ones: repeat them more (decided in the first
        # round), split over the rounds.
        if pt not in share:
            total = repeats_for(first, repeats, budget_s, max_repeats)
            share[pt] = max(1, math.ceil(total / rounds))
        return share[pt]

    for r in range(rounds):
        for pt in points:
            n, path = pt
            samples[pt] += time_hook_steps(
                n,
                paths[path],
                warmup,
                settle_s,
                functools.partial(count, pt),
                LAYERS,
                reduction=_REDUCTION.get(path, "two_phase"),
            )
            if r == rounds - 1 and dist.get_rank() == 0:
                print(f"  {path:9s} {n * 4 / 2**20:6.0f} MiB  {trimmed_mean(samples[pt]):.4f} s")
    return [
        {
            "path": path,
            "n": n,
            "seconds": trimmed_mean(samples[(n, path)]),
            "median_s": statistics.median(samples[(n, path)]),
            "repeats": len(samples[(n, path)]),
        }
        for n, path in points
    ]


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from aps_comm.calibrate import run_calibration

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    calib = [int(s) for s in args.calib_sizes.split(",")]
    val = [int(s) for s in args.val_sizes.split(",")]
    t0 = time.time()
    settle_s = args.settle_ms / 1e3
    samples, codec_label = run_calibration(
        calib,
        args.repeats,
        "aps",
        layers=LAYERS,
        settle_s=settle_s,
        budget_s=args.calib_budget_s,
        max_repeats=args.calib_max_repeats,
    )
    t1 = time.time()
    paths = NODE_PATHS if args.ranks_per_node > 1 else PATHS
    measured = _measure_paths(
        val,
        args.repeats,
        args.warmup,
        settle_s,
        args.budget_s,
        args.max_repeats,
        args.rounds,
        paths,
    )
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(
            json.dumps(
                {
                    "samples": samples,
                    "codec": codec_label,
                    "measured": measured,
                    "calibration_s": t1 - t0,
                    "measurement_s": time.time() - t1,
                }
            )
        )
    dist.destroy_process_group()


def _run_world(ws: int, args: argparse.Namespace, calib: list[int], val: list[int]) -> dict:
    from benchmarks.cluster import EmulatedCluster

    with tempfile.TemporaryDirectory(prefix="aps-pmv-") as tmp:
        out = Path(tmp) / "rank0.json"
        worker = [
            sys.executable, "-m", "benchmarks.perfmodel_validate", "--worker",
            "--worker-out", str(out), "--repeats", str(args.repeats),
            "--warmup", str(args.warmup), "--settle-ms", str(args.settle_ms),
            "--budget-s", str(args.budget_s), "--max-repeats", str(args.max_repeats),
            "--rounds", str(args.rounds),
            "--calib-budget-s", str(args.calib_budget_s),
            "--calib-max-repeats", str(args.calib_max_repeats),
            "--calib-sizes", ",".join(map(str, calib)), "--val-sizes", ",".join(map(str, val)),
            "--ranks-per-node", str(args.ranks_per_node),
        ]  # fmt: skip
        with EmulatedCluster(
            ranks=ws,
            bandwidth=args.bandwidth,
            loopback=args.loopback,
            pin_cpus=PIN_CHOICES[args.pin],
            ranks_per_node=args.ranks_per_node,
        ) as c:
            stats = c.link_stats()
            print(stats.summary(), flush=True)
            intra = None
            if c.ranks_per_node > 1 and not c.loopback:
                intra = c.link_stats(dst=1)
                print(intra.summary(), flush=True)
            ranks = c.run(worker, timeout=args.timeout, echo=True)
        failed = [r for r in ranks if not r.ok]
        if failed:
            for r in failed:
                print(r.output[-3000:], file=sys.stderr)
            raise SystemExit(f"{len(failed)} rank(s) failed at world size {ws}")
        res = json.loads(out.read_text())
    res["link"] = stats.to_dict()
    if intra is not None:
        res["link_intra_node"] = intra.to_dict()
    return res


def _link_burst(link: dict[str, Any]) -> float:
    """The tbf bucket the emulated cluster configured (0 on loopback: no shaper).

    tbf passes its bucket unshaped at the start of every transfer after an idle
    gap, so the model's links carry it as ``burst_bytes`` (taken from the
    shaper's configuration, not fitted to the validation data).
    """
    from benchmarks.cluster import tbf_parameters

    if link.get("loopback") or not link.get("configured_bits_per_s"):
        return 0.0
    return float(tbf_parameters(int(link["configured_bits_per_s"]))[0])


def _with_nodes(cluster: Any, res: dict[str, Any]) -> Any:
    """The calibrated cluster on the measured nodes: M nodes of L ranks.

    The inter-node link is the node's (its measured TCP goodput, half its
    round trip, the tbf bucket), shared by the node's L ranks; the intra-node
    link its loopback as measured. The calibrated collective fits (timed on
    all N ranks of this topology) still price the flat paths.
    """
    import dataclasses

    from aps_perfmodel.collectives import LinkParams, Topology

    intra = res.get("link_intra_node")
    if not intra:
        return cluster
    link = res["link"]
    nodes = link["nodes"]
    per_node = link["ranks_per_node"]

    def params(stats: dict[str, Any], burst: float) -> LinkParams:
        lp = LinkParams.from_bandwidth(stats["bandwidth_bits_per_s"] / 8, stats["rtt_s"] / 2)
        return dataclasses.replace(lp, burst_bytes=burst)

    topology = Topology(nodes, per_node, params(intra, 0.0), params(link, _link_burst(link)))
    return dataclasses.replace(cluster, topology=topology)


def _predict_rows(ws: int, res: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    profile = fit_profile(
        res["samples"],
        ws,
        burst_bytes=_link_burst(res.get("link", {})),
        codec_source=res["codec"],
        host=platform.node(),
        # All ranks of the emulated cluster share this machine's cores.
        cores_per_rank=(os.cpu_count() or 1) / ws,
    )
    cluster = _with_nodes(profile.to_cluster(), res)
    rows = []
    for m in res["measured"]:
        fmt = get_format(NODE_PATHS[m["path"]], strategy=_REDUCTION.get(m["path"]))
        pred = bucket_comm(m["n"], LAYERS, fmt, cluster).total_s
        rows.append(
            {
                "world_size": ws,
                "path": m["path"],
                "fp32_mib": m["n"] * 4 / 2**20,
                "measured_s": m["seconds"],
                # Runs saved before the trimmed mean was the statistic hold the median.
                "measured_median_s": m.get("median_s", m["seconds"]),
                "predicted_s": pred,
                "rel_err": (pred - m["seconds"]) / m["seconds"],
            }
        )
    return profile, rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    groups: dict[str, list[dict[str, Any]]] = {"all": rows}
    for path in NODE_PATHS:
        groups[path] = [r for r in rows if r["path"] == path]
        if not groups[path]:
            del groups[path]
            continue
        for ws in sorted({r["world_size"] for r in rows}):
            groups[f"{path} @{ws}"] = [r for r in groups[path] if r["world_size"] == ws]
    for name, sel in groups.items():
        errs = [abs(r["rel_err"]) for r in sel]
        if errs:
            summary[name] = {
                "median_abs_err": statistics.median(errs),
                "max_abs_err": max(errs),
                "n": len(errs),
            }
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="2,4", help="ranks per run (with --nodes: ignored)")
    ap.add_argument("--nodes", type=int, default=None, help="nodes: one run of nodes x L ranks")
    ap.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="ranks per node (they share its link; L > 1 adds the hierarchical path)",
    )
    ap.add_argument("--bandwidth", default="1gbit", help="per-rank link rate (tc syntax)")
    ap.add_argument("--loopback", action="store_true", help="127.0.0.1, no namespaces or shaping")
    add_pin_argument(ap)
    ap.add_argument("--sizes-mib", default="1,4,16,64,256", help="validation sizes, FP32 MiB")
    ap.add_argument("--calib-min", type=float, default=0.25, help="calibration min size, MiB")
    ap.add_argument("--calib-max", type=float, default=64.0, help="calibration max size, MiB")
    ap.add_argument("--calib-steps", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--settle-ms",
        type=float,
        default=20.0,
        help="idle time before each measured step, so the tbf bucket refills "
        "(4 ms at 1gbit; make it longer at lower rates)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help="seconds of timed work per point: quick points get more repeats, up to --max-repeats",
    )
    ap.add_argument("--max-repeats", type=int, default=MAX_REPEATS)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="sweep the measured points this many times, each with its share of the repeats",
    )
    ap.add_argument(
        "--calib-budget-s",
        type=float,
        default=BUDGET_S,
        help="the same for each calibration point (about 100 of them per world size)",
    )
    ap.add_argument("--calib-max-repeats", type=int, default=MAX_REPEATS)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument(
        "--out",
        default=".",
        help="directory for the results (default: the working directory; the committed ones are in benchmarks/results)",
    )
    ap.add_argument(
        "--name",
        default="perfmodel_validation",
        help="file name stem of the results (default perfmodel_validation)",
    )
    ap.add_argument("--raw", default="", help="re-fit and re-predict from a saved JSON (no runs)")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    ap.add_argument(
        "--repeat-run",
        action="append",
        default=[],
        help="JSON of another run of the same command: its summary is recorded beside this one's, "
        "so the report judges the target on every run",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--calib-sizes", default="", help=argparse.SUPPRESS)
    ap.add_argument("--val-sizes", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for flag in ("rounds", "max_repeats", "calib_max_repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("budget_s", "calib_budget_s"):
        if getattr(args, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.worker:
        _worker(args)
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    calib_sizes = geometric_sizes(args.calib_min * 2**20, args.calib_max * 2**20, args.calib_steps)
    val_sizes = [int(float(s) * 2**20) for s in args.sizes_mib.split(",")]
    t_start = time.time()
    # The machine may be shared: record its load so the errors can be read in context.
    load_before = os.getloadavg()
    if args.raw:
        old = json.loads(Path(args.raw).read_text())
        raw = {int(k): v for k, v in old["raw"].items()}
        setup_old = old["setup"]
    else:
        raw = {}
        world_sizes = [int(w) for w in args.world_sizes.split(",")]
        if args.nodes is not None:
            world_sizes = [args.nodes * args.ranks_per_node]
        for ws in world_sizes:
            t0 = time.time()
            raw[ws] = _run_world(ws, args, calib_sizes, val_sizes)
            print(f"world size {ws}: {time.time() - t0:.0f} s", flush=True)
        setup_old = None
    rows: list[dict[str, Any]] = []
    profiles = {}
    for ws, res in raw.items():
        profiles[ws], r = _predict_rows(ws, res)
        rows += r
    summary = _summary(rows)
    mode = (
        "loopback 127.0.0.1 (unshaped)"
        if args.loopback
        else f"emulated cluster, tbf {args.bandwidth}"
    )
    if args.ranks_per_node > 1:
        mode += f" per node, {args.ranks_per_node} ranks per node (unshaped loopback inside)"
    setup = setup_old or {
        "command": "python -m benchmarks.perfmodel_validate " + " ".join(sys.argv[1:]),
        "backend": "gloo",
        "transport": mode + ", one process per rank, 1 intra-op thread each",
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "codec": next(iter(raw.values()))["codec"],
        "layers_per_message": LAYERS,
        "calibration_sizes_bytes": calib_sizes,
        "validation_sizes_bytes": val_sizes,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "settle_ms": args.settle_ms,
        "budget_s": args.budget_s,
        "max_repeats": args.max_repeats,
        "rounds": args.rounds,
        "calib_budget_s": args.calib_budget_s,
        "calib_max_repeats": args.calib_max_repeats,
        "runtime_s": time.time() - t_start,
        "loadavg_1_5_15_before": load_before,
        "loadavg_1_5_15_after": os.getloadavg(),
        "links": {ws: res["link"] for ws, res in raw.items()},
    }
    if args.note:
        setup["notes"] = args.note
    if args.repeat_run:
        setup["repeat_runs"] = [_run_summary(Path(f), setup["command"]) for f in args.repeat_run]
    report = {
        "setup": setup,
        "summary": summary,
        "rows": rows,
        "profiles": {ws: p.to_dict() | {"samples": len(p.samples)} for ws, p in profiles.items()},
        "raw": raw,
    }
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    _write_md(out / f"{args.name}.md", report)
    _plot(out / f"{args.name}.png", rows, setup["transport"])
    print(json.dumps(summary, indent=2))
    return 0


def _overall(report: dict[str, Any]) -> dict[str, Any]:
    """A run's overall errors and its worst point."""
    worst = max(report["rows"], key=lambda r: abs(r["rel_err"]))
    return {
        **{k: report["summary"]["all"][k] for k in ("median_abs_err", "max_abs_err", "n")},
        "worst": {k: worst[k] for k in ("world_size", "path", "fp32_mib", "rel_err")},
    }


def all_runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """This run's overall errors and worst point, then those of its recorded repeats."""
    return [_overall(report), *report["setup"].get("repeat_runs", [])]


def _run_summary(path: Path, command: str) -> dict[str, Any]:
    """Overall errors and worst point of another saved run of ``command``."""
    other = json.loads(path.read_text())
    if other["setup"]["command"] != command:
        raise SystemExit(
            f"{path} ran `{other['setup']['command']}`, not `{command}`: not a repeat of this run"
        )
    return _overall(other)


def _write_md(path: Path, report: dict[str, Any]) -> None:
    s = report["setup"]
    lines = [
        "# perfmodel: predicted vs measured reduction time",
        "",
        f"Generated by `{s['command']}` (run under `flock /tmp/aps-bench.lock`); "
        "numbers are from one run.",
        "",
        f"- Setup: Gloo, {s['transport']}; host `{s['host']}` with {s['cpu_count']} cores "
        "shared by all ranks.",
    ]
    for ws, link in s.get("links", {}).items():
        eff = link.get("efficiency")
        lines.append(
            f"- Link ({ws} ranks): {link['bandwidth_bits_per_s'] / 1e6:.0f} Mbit/s TCP goodput"
            + (f" ({eff:.0%} of configured)" if eff else "")
            + f", rtt {link['rtt_s'] * 1e6:.0f} us, mtu {link['mtu']}"
            + (
                f", TCP congestion control {link['congestion_control']}"
                if link.get("congestion_control")
                else ""
            )
            + (", each rank pinned to one CPU." if link.get("pinned_cpus") else ", ranks unpinned.")
        )
    lines += [
        f"- Codec: `{s['codec']}`; {s['layers_per_message']} layers per message (one APS maximum each).",
        "- Model: a profile fitted per world size by `perfmodel.calibrate` on a separate sweep of "
        f"{len(s['calibration_sizes_bytes'])} sizes from "
        f"{s['calibration_sizes_bytes'][0] / 2**20:.2g} to {s['calibration_sizes_bytes'][-1] / 2**20:.0f} MiB "
        "(collectives and codec passes timed separately, codec on all ranks at once; "
        "collectives from the last rank's start; each hook's whole call on a tiny bucket "
        "inside DDP as the bucket's fixed cost, `hook_call.<fmt>`), then "
        "`perfmodel.bucket_comm` predicts each complete path (APS: chunk-pipelined, 2**20 "
        "elements per chunk, as `aps_comm.hook`).",
        "- Measured: real DDP hooks (`allreduce_hook`, `fp16_compress_hook`, `aps_comm` e4m3 "
        "two_phase) on a 16-layer Linear stack in one bucket; time from the last rank's hook "
        f"call to the last rank's future completing (one monotonic clock); every timing, "
        f"measured and calibrated, is the mean of its repeats less the {TRIM:.0%} lowest and "
        f"highest (repeats of small messages are bimodal here, so their median jumps run to run; "
        f"the median is in the table too), at least {s['repeats']} repeats "
        f"(quick ones more: up to {s.get('max_repeats', MAX_REPEATS)} within about "
        f"{s.get('budget_s', BUDGET_S):g} s of timed work; calibration points up to "
        f"{s.get('calib_max_repeats', MAX_REPEATS)} within "
        f"{s.get('calib_budget_s', BUDGET_S):g} s) "
        f"after {s.get('warmup', 1)} warm-up"
        + (
            f", taken in {s['rounds']} rounds over all points (each its share of the repeats)."
            if s.get("rounds", 1) > 1
            else "."
        ),
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
    lines += ["", "Target (issue 5): median <= 10%, worst <= 25%."]
    repeats = report["setup"].get("repeat_runs", [])
    if repeats:
        lines += [
            "",
            "Every run of this command with the same code (this one first):",
            "",
            "| run | median | worst | worst point |",
            "|---|---:|---:|---|",
        ]
        for i, run in enumerate(all_runs(report)):
            w = run["worst"]
            lines.append(
                f"| {i + 1} | {run['median_abs_err']:.1%} | {run['max_abs_err']:.2%} "
                f"| {w['path']} {w['fp32_mib']:g} MiB @{w['world_size']}: {w['rel_err']:+.2%} |"
            )
    lines += [
        "",
        "## All points",
        "",
        "| ranks | path | FP32 MiB | measured | predicted | error | measured median |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['world_size']} | {r['path']} | {r['fp32_mib']:.0f} | {r['measured_s'] * 1e3:.2f} ms "
            f"| {r['predicted_s'] * 1e3:.2f} ms | {r['rel_err']:+.1%} "
            f"| {r.get('measured_median_s', r['measured_s']) * 1e3:.2f} ms |"
        )
    notes = report["setup"].get("notes")
    if notes:
        lines += ["", "## Notes", "", *notes]
    path.write_text("\n".join(lines) + "\n")


def _plot(path: Path, rows: list[dict[str, Any]], transport: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.5))
    markers = {2: "o", 3: "^", 4: "s"}
    colors = {"fp32": "C0", "fp16": "C1", "aps-e4m3": "C2", "aps-e4m3-hierarchical": "C3"}
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
    ax.set_title(f"perfmodel vs measured: Gloo, {transport.split(',')[0]}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
