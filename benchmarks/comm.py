"""Communication benchmark: real DDP backward + communication, hook against hook.

Every hook runs in the same job, on the same model and data: PyTorch's FP32
``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook`` and
PowerSGD (rank 4), APS e4m3/e5m2 (two_phase) and FP16/BF16 (native
all-reduce), and the naive e4m3 cast. Per hook: the median step time
(backward plus communication; the slowest rank's time each step) over
repeats, the effective bus bandwidth, the speedup over FP32 and over
``fp16_compress_hook``, the relative L2 error of the averaged gradient
against the exact FP32 mean, and the perfmodel's prediction beside it.

By default the ranks run on an emulated bandwidth-bound cluster
(:mod:`benchmarks.cluster`: network namespaces, tbf-shaped veths; needs root)::

    python -m benchmarks.comm --ranks 4 --bandwidth 1gbit --mb 64 --json benchmarks/results/comm.json
    python -m benchmarks.comm --loopback --ranks 2 --mb 16      # no root; loopback hides the network

With ``--batch B`` backward also computes (a batch of B rows through the
model), and per hook the report holds communication alone (batch 1), the
step with compute, and the exposed communication: the step minus backward
alone (timed with a hook that communicates nothing).

Example:
    >>> main(["--loopback", "--ranks", "2", "--mb", "4", "--repeats", "2"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["DEFAULT_HOOKS", "HOOKS", "main"]

HOOKS = (
    "fp32",
    "fp16",
    "bf16",
    "aps-e4m3",
    "aps-e5m2",
    "aps-fp16",
    "aps-bf16",
    "naive-e4m3",
    "powersgd",
)
# PowerSGD's hook issues its second all-reduce from a future callback; on Gloo
# with 4 ranks in the emulated cluster that deadlocked (measured), so it is
# not in the default list. Ask for it with --hooks.
DEFAULT_HOOKS = HOOKS[:-1]
_WIDTH = 2048  # Linear(2048, 2048): 16 MiB of FP32 gradient per layer
_PREDICTED = {
    "fp32": "fp32",
    "fp16": "fp16",
    "aps-fp16": "fp16",
    "bf16": "bf16",
    "aps-bf16": "bf16",
    "aps-e4m3": "e4m3",
    "aps-e5m2": "e5m2",
}


def _model(mb: float) -> torch.nn.Module:
    layers = max(1, round(mb * 2**20 / 4 / _WIDTH**2))
    return torch.nn.Sequential(
        *[torch.nn.Linear(_WIDTH, _WIDTH, bias=False) for _ in range(layers)]
    )


def _attach(name: str, ddp: torch.nn.parallel.DistributedDataParallel) -> tuple[Any, Callable]:
    """Register hook ``name`` on ``ddp``; return (state, hook function)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from aps_comm import APSState, aps_hook

    if name == "fp32":
        return None, default_hooks.allreduce_hook
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        return state, powerSGD_hook.powerSGD_hook
    kind, fmt = name.split("-", 1)
    if kind == "aps":
        reduction = "allreduce" if fmt in ("fp16", "bf16") else "two_phase"
        return APSState(fmt, reduction=reduction), aps_hook
    if kind == "naive":
        return APSState(fmt, reduction="two_phase", scaling="none"), aps_hook
    raise ValueError(f"unknown hook {name!r}; choose from {', '.join(HOOKS)}")


def _no_comm(state: object, bucket):  # type: ignore[no-untyped-def]
    """A hook that communicates nothing: backward alone, for the compute baseline."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _time_steps(
    ddp: torch.nn.Module, x: torch.Tensor, warmup: int, repeats: int
) -> tuple[list[float], list[tuple[float, float]]]:
    """Step times (slowest rank) and this rank's CPU (user, system) per step."""
    import torch.distributed as dist

    times, cpu = [], []
    for step in range(warmup + repeats):
        ddp.zero_grad()
        dist.barrier()
        start, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        ddp(x).sum().backward()
        elapsed = torch.tensor([time.perf_counter() - start])
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        # A step takes as long as its slowest rank.
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(float(elapsed))
            # This process's CPU time, all threads: user (ours, torch, Gloo) and
            # system (mostly the network stack). All ranks share the machine.
            cpu.append((cpu1.ru_utime - cpu0.ru_utime, cpu1.ru_stime - cpu0.ru_stime))
    return times, cpu


def _rel_error(ddp: torch.nn.Module, state: Any, hook: Callable, x: torch.Tensor) -> float:
    """One more step with a capturing wrapper: error of the result vs the FP32 mean."""
    import torch.distributed as dist

    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    # Unannotated on purpose: DDP rejects string annotations (this module
    # uses postponed evaluation).
    def capture(st, bucket):  # type: ignore[no-untyped-def]
        raw = bucket.buffer().detach().clone()
        fut = hook(st, bucket)

        def keep(f: torch.futures.Future) -> torch.Tensor:
            pairs.append((raw, f.value()[0] if isinstance(f.value(), list) else f.value()))
            return f.value()

        return fut.then(keep)

    ddp.register_comm_hook(state, capture)  # type: ignore[attr-defined]
    ddp.zero_grad()
    ddp(x).sum().backward()
    err2 = ref2 = 0.0
    for raw, out in pairs:
        mean = raw.double()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        err2 += float((out.double() - mean).pow(2).sum())
        ref2 += float(mean.pow(2).sum())
    return (err2 / ref2) ** 0.5 if ref2 else 0.0


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)
    x = torch.randn(1, _WIDTH)
    x_batch = torch.randn(args.batch, _WIDTH) if args.batch else None
    results = []
    for rnd, name in [(r, h) for r in range(args.rounds) for h in args.hooks]:
        if x_batch is not None and name == args.hooks[0]:
            torch.manual_seed(0)
            ddp = DDP(_model(args.mb), bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
            ddp.register_comm_hook(None, _no_comm)
            times, cpu = _time_steps(ddp, x_batch, args.warmup, args.repeats)
            results.append(
                {
                    "hook": "compute-alone",
                    "round": rnd,
                    "step_s": times,
                    "rank0_cpu_user_s": [u for u, _ in cpu],
                    "rank0_cpu_system_s": [s for _, s in cpu],
                }
            )
            if rank == 0:
                print(f"backward alone (batch {args.batch}): {statistics.median(times):.3f} s")
            del ddp
        torch.manual_seed(0)
        model = _model(args.mb)
        ddp = DDP(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.bucket_view)
        state, hook = _attach(name, ddp)
        if args.chunk_elements and hasattr(state, "chunk_elements"):
            state.chunk_elements = args.chunk_elements
        try:
            ddp.register_comm_hook(state, hook)
        except (TypeError, RuntimeError) as exc:
            # bf16_compress_hook: DDP allows it only with CUDA/NCCL or XPU.
            results.append({"hook": name, "skipped": str(exc)})
            if rank == 0:
                print(f"{name:>11}: skipped ({exc})", flush=True)
            continue
        times, cpu = _time_steps(ddp, x, args.warmup, args.repeats)
        with_compute: dict[str, list[float]] = {}
        if x_batch is not None:
            steps, cpu_b = _time_steps(ddp, x_batch, args.warmup, args.repeats)
            with_compute = {
                "compute_step_s": steps,
                "compute_rank0_cpu_s": [u + s for u, s in cpu_b],
            }
        if rnd < args.rounds - 1:  # the error is measured once, in the last round
            results.append({"hook": name, "round": rnd, "step_s": times, **with_compute})
            del ddp, model
            continue
        # A fresh model for the error step: DDP allows one hook registration.
        torch.manual_seed(0)
        ddp_err = DDP(
            _model(args.mb), bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.bucket_view
        )
        state_err, hook_err = _attach(name, ddp_err)
        if name == "powersgd":
            state_err.start_powerSGD_iter = 2
            state_err.iter = 10  # past warm-up: measure the compressed result
        error = _rel_error(ddp_err, state_err, hook_err, x)
        results.append(
            {
                "hook": name,
                "step_s": times,
                "rank0_cpu_user_s": [u for u, _ in cpu],
                "rank0_cpu_system_s": [s for _, s in cpu],
                "rel_l2_error": error,
                "round": rnd,
                **with_compute,
            }
        )
        if rank == 0:
            extra = ""
            if with_compute:
                extra = f", with compute {statistics.median(with_compute['compute_step_s']):.3f} s"
            print(
                f"{name:>11}: median {statistics.median(times):.3f} s{extra}, error {error:.2e}",
                flush=True,
            )
        del ddp, ddp_err, model
    if rank == 0:
        n_params = sum(p.numel() for p in _model(args.mb).parameters())
        Path(args.worker_out).write_text(
            json.dumps({"world": world, "numel": n_params, "results": results})
        )
    dist.destroy_process_group()


def _predict(numel: int, world: int, link: dict[str, Any] | None) -> dict[str, float]:
    """perfmodel's step time (communication only) per format, for the measured link."""
    if not link or not link.get("bandwidth_bits_per_s"):
        return {}
    from aps_perfmodel import ComputeTime, ModelSpec, custom_cluster, predict

    cluster = custom_cluster(
        link["bandwidth_bits_per_s"] / 8,
        max(link.get("rtt_s") or 0.0, 1e-6) / 2,
        nodes=world,
        device="cpu",
    )
    model = ModelSpec.from_module(_model(numel * 4 / 2**20))
    pred = predict(model, cluster, ["e4m3", "e5m2", "bf16"], ComputeTime.from_step_time(0.0))
    return {name: r.step_s for name, r in pred.formats.items()}


def _summarise(raw: dict[str, Any], link: dict[str, Any] | None, args: argparse.Namespace) -> dict:
    world, numel = raw["world"], raw["numel"]
    rounds = _by_round(raw["results"])
    done = [r for r in raw["results"] if "rel_l2_error" in r and r["hook"] != "compute-alone"]
    alone = [r for r in raw["results"] if r["hook"] == "compute-alone"]
    compute_s = statistics.median(statistics.median(r["step_s"]) for r in alone) if alone else None
    # Per hook: the median over rounds of each round's median step.
    medians = {
        h: statistics.median(statistics.median(r["step_s"]) for r in rs) for h, rs in rounds.items()
    }
    predicted = _predict(numel, world, link)
    fp32_bytes = 4 * numel
    runs = []
    for r in done:
        t = medians[r["hook"]]
        per_round = rounds[r["hook"]]
        runs.append(
            {
                "hook": r["hook"],
                "median_step_s": t,
                "step_s": [s for rr in per_round for s in rr["step_s"]],
                "round_median_step_s": [statistics.median(rr["step_s"]) for rr in per_round],
                # NCCL-tests convention, on the FP32 gradient size: what an FP32
                # all-reduce would need to reach to take this long.
                "bus_bandwidth_gbit": fp32_bytes * 8 * 2 * (world - 1) / world / t / 1e9,
                "speedup_vs_fp32": medians["fp32"] / t if "fp32" in medians else None,
                "speedup_vs_fp16": medians["fp16"] / t if "fp16" in medians else None,
                "rel_l2_error": r["rel_l2_error"],
                "rank0_cpu_user_s": statistics.median(r.get("rank0_cpu_user_s") or [0.0]),
                "rank0_cpu_system_s": statistics.median(r.get("rank0_cpu_system_s") or [0.0]),
                "predicted_step_s": predicted.get(_PREDICTED.get(r["hook"], "")),
                **_with_compute(per_round, t, compute_s),
            }
        )
    return {
        "command": "python -m benchmarks.comm " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "kernel": platform.release(),
        },
        "link": link,
        "ranks": world,
        "gradient_mb": fp32_bytes / 2**20,
        "bucket_cap_mb": args.bucket_mb,
        "gradient_as_bucket_view": args.bucket_view,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "batch": args.batch,
        "rounds": args.rounds,
        "compute_alone_s": compute_s,
        "compute_alone_step_s": [s for r in alone for s in r["step_s"]] or None,
        "runs": runs,
        "skipped": {r["hook"]: r["skipped"] for r in raw["results"] if "skipped" in r},
    }


def _by_round(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each measured hook's results, one per round."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if "skipped" not in r and r["hook"] != "compute-alone":
            out.setdefault(r["hook"], []).append(r)
    return out


def _with_compute(
    rounds: list[dict[str, Any]], comm_s: float, compute_s: float | None
) -> dict[str, Any]:
    """The step with backward compute, and how much communication it leaves exposed."""
    if compute_s is None or any("compute_step_s" not in r for r in rounds):
        return {}
    per_round = [statistics.median(r["compute_step_s"]) for r in rounds]
    step = statistics.median(per_round)
    exposed = max(step - compute_s, 0.0)
    return {
        "compute_step_s": [s for r in rounds for s in r["compute_step_s"]],
        "round_median_compute_step_s": per_round,
        "median_compute_step_s": step,
        "exposed_comm_s": exposed,
        "exposed_fraction": exposed / comm_s if comm_s else None,
        "compute_rank0_cpu_s": statistics.median(
            c for r in rounds for c in r["compute_rank0_cpu_s"]
        ),
    }


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"{'hook':>11} {'step s':>8} {'busbw Gb/s':>10} {'vs fp32':>8} {'vs fp16':>8} "
        f"{'rel err':>9} {'predicted':>9} {'cpu usr+sys':>11}"
    ]
    for r in result["runs"]:
        pred = r["predicted_step_s"]
        lines.append(
            f"{r['hook']:>11} {r['median_step_s']:>8.3f} {r['bus_bandwidth_gbit']:>10.2f} "
            f"{r['speedup_vs_fp32'] or 0:>8.2f} {r['speedup_vs_fp16'] or 0:>8.2f} "
            f"{r['rel_l2_error']:>9.2e} {f'{pred:.3f}' if pred else '-':>9} "
            f"{r['rank0_cpu_user_s']:>5.3f}+{r['rank0_cpu_system_s']:.3f}"
        )
    if result.get("compute_alone_s") is not None:
        lines.append(
            f"with compute (batch {result['batch']}; backward alone "
            f"{result['compute_alone_s']:.3f} s):"
        )
        lines.append(
            f"{'hook':>11} {'comm s':>8} {'step s':>8} {'exposed s':>9} {'exposed %':>9} "
            f"{'cpu s':>7} {'vs fp32':>8} {'vs fp16':>8}"
        )
        steps = {r["hook"]: r.get("median_compute_step_s") for r in result["runs"]}
        for r in result["runs"]:
            if "median_compute_step_s" not in r:
                continue
            t = r["median_compute_step_s"]
            vs32 = steps["fp32"] / t if steps.get("fp32") else 0.0
            vs16 = steps["fp16"] / t if steps.get("fp16") else 0.0
            lines.append(
                f"{r['hook']:>11} {r['median_step_s']:>8.3f} {t:>8.3f} "
                f"{r['exposed_comm_s']:>9.3f} {100 * r['exposed_fraction']:>8.0f}% "
                f"{r['compute_rank0_cpu_s']:>7.3f} {vs32:>8.2f} {vs16:>8.2f}"
            )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--bandwidth", default="1gbit", help="per-rank link rate (tc syntax)")
    p.add_argument("--loopback", action="store_true", help="no namespaces, no shaping")
    p.add_argument("--mb", type=float, default=64.0, help="MiB of FP32 gradients")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument(
        "--bucket-view",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="DDP gradient_as_bucket_view (default on: saves a copy per step, for every hook)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--batch",
        type=int,
        default=0,
        help="also time steps whose backward computes a batch of this many rows",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every hook this many times, hooks interleaved; report medians over rounds",
    )
    p.add_argument(
        "--chunk-elements",
        type=int,
        default=0,
        help="APS hooks: elements per pipelined chunk (default: the hook's own)",
    )
    p.add_argument(
        "--hooks",
        default=",".join(DEFAULT_HOOKS),
        help=f"comma-separated hooks, from: {', '.join(HOOKS)} (default: all but powersgd)",
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.hooks = [h.strip() for h in args.hooks.split(",") if h.strip()]
    unknown = [h for h in args.hooks if h not in HOOKS]
    if unknown:
        raise SystemExit(f"unknown hooks {unknown}; choose from {', '.join(HOOKS)}")
    if args.worker:
        _worker(args)
        return 0
    from benchmarks.cluster import EmulatedCluster

    with tempfile.TemporaryDirectory(prefix="aps-comm-") as tmp:
        out = Path(tmp) / "rank0.json"
        worker = [
            sys.executable, "-m", "benchmarks.comm", "--worker", "--worker-out", str(out),
            "--mb", str(args.mb), "--bucket-mb", str(args.bucket_mb),
            "--repeats", str(args.repeats), "--warmup", str(args.warmup),
            "--batch", str(args.batch), "--chunk-elements", str(args.chunk_elements),
            "--rounds", str(args.rounds),
            "--bucket-view" if args.bucket_view else "--no-bucket-view",
            "--hooks", ",".join(args.hooks),
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
    print(_table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
