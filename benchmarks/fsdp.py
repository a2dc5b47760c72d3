"""FSDP2 step time on the emulated cluster: FSDP's FP32 and BF16 reduce-scatter against APS e4m3.

Every setup trains the same model in the same job: a stack of
``Linear(2048, 2048)`` layers (16 MiB of FP32 parameters each), each layer
``fully_shard``-ed, then the root; FP32 parameters (the all-gathers are
FP32 in every setup). Setups:

- ``fp32``: FSDP2's own reduce-scatter, ``reduce_dtype`` FP32 (on Gloo an
  all-reduce of the whole input: twice a reduce-scatter's traffic);
- ``bf16``: the same with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``;
- ``aps-e4m3``: :func:`aps_comm.fsdp.register` (one byte per element, one
  ``all_to_all``).

Per setup: the median step time (forward with its all-gathers, backward with
its all-gathers and reduce-scatters; batch 1; the slowest rank's time each
step) over repeats, rounds interleaving the setups, the speedup over ``fp32``
and the reduce-scatter bytes per step; beside it, the perfmodel's
prediction (:mod:`aps_perfmodel.fsdp`, Gloo, for the measured link, compute
taken as zero, as the batch-1 compute is small).

    python -m benchmarks.fsdp --ranks 2 --bandwidth 1gbit --json benchmarks/results/fsdp_2ranks.json
    python -m benchmarks.fsdp --loopback --ranks 2 --layers 1 --repeats 2   # no root, no shaping

Example:
    >>> main(["--loopback", "--ranks", "2", "--layers", "1", "--repeats", "2"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["SETUPS", "main", "markdown"]

SETUPS = ("fp32", "bf16", "aps-e4m3")
_WIDTH = 2048  # Linear(2048, 2048): 16 MiB of FP32 parameters per layer
_PREDICTED = {"fp32": "fp32", "bf16": "bf16", "aps-e4m3": "e4m3"}


def _model(layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        *[torch.nn.Linear(_WIDTH, _WIDTH, bias=False) for _ in range(layers)]
    )


def _build(setup: str, layers: int) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from aps_comm import fsdp

    torch.manual_seed(0)
    model = _model(layers)
    reduce_dtype = torch.bfloat16 if setup == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in model:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    state = fsdp.register(model, "e4m3") if setup == "aps-e4m3" else None
    return model, state


def _time_steps(model: torch.nn.Module, x: torch.Tensor, warmup: int, repeats: int) -> list[float]:
    """Step times (forward + backward), the slowest rank's each step."""
    import torch.distributed as dist

    times = []
    for step in range(warmup + repeats):
        model.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        model(x).sum().backward()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(float(elapsed))
    return times


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)
    x = torch.randn(1, _WIDTH)
    results = []
    for rnd in range(args.rounds):
        for setup in args.setups:
            model, state = _build(setup, args.layers)
            times = _time_steps(model, x, args.warmup, args.repeats)
            results.append(
                {
                    "setup": setup,
                    "round": rnd,
                    "step_s": times,
                    "aps_bytes_per_step": state.bytes_sent if state is not None else None,
                }
            )
            if rank == 0:
                print(
                    f"round {rnd} {setup:>9}: median {statistics.median(times):.3f} s", flush=True
                )
            del model, state
    if rank == 0:
        Path(args.worker_out).write_text(
            json.dumps({"world": dist.get_world_size(), "results": results})
        )
    dist.destroy_process_group()


def _predict(layers: int, world: int, link: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    """perfmodel's FSDP step (communication only) per setup, for the measured link."""
    if not link or not link.get("bandwidth_bits_per_s"):
        return {}
    from aps_perfmodel.fsdp import FSDPUnit, fsdp_step, padded_numel
    from benchmarks.comm import flat_link_cluster

    cluster = flat_link_cluster(link, world)
    units = [FSDPUnit(padded_numel([(_WIDTH, _WIDTH)], world), 1)] * layers
    out = {}
    for setup, fmt in _PREDICTED.items():
        p = fsdp_step(units, fmt, cluster, backend="gloo")
        out[setup] = {
            "step_s": p.step_s,
            "all_gather_s": p.all_gather_s,
            "reduce_scatter_s": p.reduce_scatter_s,
        }
    return out


def _reduce_scatter_bytes(setup: str, layers: int, world: int) -> int:
    """Bytes FSDP hands its reduce-scatter per step: the padded input in the reduce dtype."""
    per_elem = {"fp32": 4, "bf16": 2}[setup]
    return layers * -(-_WIDTH // world) * world * _WIDTH * per_elem


def _summarise(raw: dict[str, Any], link: dict[str, Any] | None, args: argparse.Namespace) -> dict:
    world = raw["world"]
    by_setup: dict[str, list[dict[str, Any]]] = {}
    for r in raw["results"]:
        by_setup.setdefault(r["setup"], []).append(r)
    medians = {
        s: statistics.median(statistics.median(r["step_s"]) for r in rs)
        for s, rs in by_setup.items()
    }
    predicted = _predict(args.layers, world, link)
    runs = []
    for setup, rs in by_setup.items():
        t = medians[setup]
        aps_bytes = rs[-1]["aps_bytes_per_step"]
        pred = predicted.get(setup, {})
        runs.append(
            {
                "setup": setup,
                "median_step_s": t,
                "round_median_step_s": [statistics.median(r["step_s"]) for r in rs],
                "step_s": [s for r in rs for s in r["step_s"]],
                "speedup_vs_fp32": medians["fp32"] / t if "fp32" in medians else None,
                "reduce_scatter_bytes_per_step": aps_bytes
                if aps_bytes is not None
                else _reduce_scatter_bytes(setup, args.layers, world),
                "predicted_step_s": pred.get("step_s"),
                "predicted_all_gather_s": pred.get("all_gather_s"),
                "predicted_reduce_scatter_s": pred.get("reduce_scatter_s"),
                "prediction_error": (pred["step_s"] - t) / t if pred else None,
            }
        )
    return {
        "command": "python -m benchmarks.fsdp " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "kernel": platform.release(),
        },
        "link": link,
        "ranks": world,
        "layers": args.layers,
        "parameter_mb": args.layers * _WIDTH * _WIDTH * 4 / 2**20,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "runs": runs,
    }


def markdown(result: dict[str, Any]) -> str:
    """One results file as a markdown table (also for :mod:`benchmarks.report`).

    Example:
        >>> text = markdown(json.loads(Path("benchmarks/results/fsdp_2ranks.json").read_text()))  # doctest: +SKIP
    """
    link = result.get("link") or {}
    cond = (
        f"{link['bandwidth_bits_per_s'] / 1e6:.0f} Mbit/s measured goodput "
        f"(tbf {link.get('configured_rate')}), rtt {link['rtt_s'] * 1e6:.0f} us"
        if link.get("bandwidth_bits_per_s")
        else "loopback, unshaped"
    )
    lines = [
        f"{result['ranks']} ranks, {cond}; {result['layers']} x Linear(2048, 2048) "
        f"({result['parameter_mb']:.0f} MiB of FP32 parameters), each layer fully_shard-ed; "
        f"medians of {result['repeats']} steps per round, median over {result['rounds']} "
        f"rounds (setups interleaved); command `{result['command']}`.",
        "",
        "| setup | step s | vs fp32 | reduce-scatter bytes/step | predicted step s | "
        "predicted all-gathers s | predicted reduce-scatters s | prediction error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        pred = r.get("predicted_step_s")
        lines.append(
            f"| {r['setup']} | {r['median_step_s']:.3f} | {r['speedup_vs_fp32']:.2f} | "
            f"{r['reduce_scatter_bytes_per_step']:,} | "
            + (
                f"{pred:.3f} | {r['predicted_all_gather_s']:.3f} | "
                f"{r['predicted_reduce_scatter_s']:.3f} | {r['prediction_error']:+.0%} |"
                if pred
                else "- | - | - | - |"
            )
        )
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--bandwidth", default="1gbit", help="per-rank link rate (tc syntax)")
    p.add_argument("--loopback", action="store_true", help="no namespaces, no shaping")
    p.add_argument("--layers", type=int, default=2, help="Linear(2048, 2048) layers (16 MiB each)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--setups", default=",".join(SETUPS), help=f"comma-separated, from {', '.join(SETUPS)}"
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown:
        raise SystemExit(f"unknown setups {unknown}; choose from {', '.join(SETUPS)}")
    if args.worker:
        _worker(args)
        return 0
    from benchmarks.cluster import EmulatedCluster

    with tempfile.TemporaryDirectory(prefix="aps-fsdp-") as tmp:
        out = Path(tmp) / "rank0.json"
        worker = [
            sys.executable, "-m", "benchmarks.fsdp", "--worker", "--worker-out", str(out),
            "--layers", str(args.layers), "--repeats", str(args.repeats),
            "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--setups", ",".join(args.setups),
        ]  # fmt: skip
        with EmulatedCluster(
            ranks=args.ranks, bandwidth=args.bandwidth, loopback=args.loopback
        ) as cluster:
            link = None
            if not args.loopback:
                stats = cluster.link_stats()
                print(stats.summary(), flush=True)
                link = stats.to_dict()
            ranks = cluster.run(
                worker, timeout=args.timeout, env={"PYTHONPATH": os.getcwd()}, echo=True
            )
        failed = [r for r in ranks if not r.ok]
        if failed:
            for r in failed:
                print(r.output[-3000:], file=sys.stderr)
            return 1
        raw = json.loads(out.read_text())
    result = _summarise(raw, link, args)
    print(markdown(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
