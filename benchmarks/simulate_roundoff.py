"""Round-off of the averaged gradient vs the number of workers, by format and order.

The APS paper's round-off study, on real gradients: a digits CNN is trained
for two epochs in FP32, then for each N in 4 ... 256 the per-worker
gradients of N micro-batches of 4 images are captured and averaged by
:func:`aps_comm.simulate.allreduce` in e5m2 and e4m3, summed in a ring (the
wire format at every hop, Gloo's order), a binary tree, or two_phase (FP32
accumulation), with APS scaling and without. The error is
``||avg - mean||_2 / ||mean||_2`` over all parameters, ``mean`` the exact
(float64) mean of the unrounded worker gradients, averaged over 3 batches.
The speed of the simulator at N = 256 on a 1M-element gradient (one CPU
thread) is measured too.

    python -m benchmarks.simulate_roundoff [--batches 3] [--speed-numel 1048576]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from aps_comm.simulate import VirtualWorkers, allreduce
from benchmarks.simulate_training import DigitsCNN, load_digits_tensors

__all__ = ["main"]

WORKERS = (4, 8, 16, 32, 64, 128, 256)
FORMATS = ("e5m2", "e4m3")
ORDERS = ("ring", "tree", "two_phase")
MICRO_BATCH = 4


def _pretrained(seed: int = 0, epochs: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    x, y, _, _ = load_digits_tensors()
    model = DigitsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y) - 63, 64):
            idx = perm[i : i + 64]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model


def _rel_err(avg: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    num = sum(float((a.double() - e).pow(2).sum()) for a, e in zip(avg, exact, strict=True))
    den = sum(float(e.pow(2).sum()) for e in exact)
    return (num / den) ** 0.5


def _roundoff(model: nn.Module, batches: int) -> list[dict]:
    x, y, _, _ = load_digits_tensors()
    rows = []
    for n in WORKERS:
        errs: dict[tuple[str, str, str], list[float]] = {}
        for b in range(batches):
            gen = torch.Generator().manual_seed(1000 * n + b)
            # Distinct images for every worker (N * 4 <= 1024 of the 1437).
            idx = torch.randperm(len(y), generator=gen)[: n * MICRO_BATCH]
            grads, _ = VirtualWorkers(model, n).worker_grads(
                nn.functional.cross_entropy, x[idx], y[idx]
            )
            exact = [g.double().mean(0) for g in grads]
            for fmt in FORMATS:
                for order in ORDERS:
                    for scaling in ("layer", "none"):
                        avg = allreduce(grads, fmt, reduction=order, scaling=scaling)
                        errs.setdefault((fmt, order, scaling), []).append(_rel_err(avg, exact))
        for (fmt, order, scaling), e in errs.items():
            rows.append(
                {
                    "workers": n,
                    "format": fmt,
                    "order": order,
                    "scaling": scaling,
                    "rel_err": sum(e) / len(e),
                }
            )
        print(f"N={n:>3} done", flush=True)
    return rows


def _speed(numel: int, workers: int = 256) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(workers, numel, generator=gen) * 1e-3
    rows = []
    for fmt in ("e4m3", "e5m2", "e2m1"):
        for order in ("two_phase", "ring", "tree", "sequential"):
            start = time.perf_counter()
            allreduce([g], fmt, reduction=order)
            rows.append(
                {
                    "format": fmt,
                    "order": order,
                    "workers": workers,
                    "numel": numel,
                    "seconds": round(time.perf_counter() - start, 2),
                }
            )
            print(f"speed {fmt} {order}: {rows[-1]['seconds']} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Run the study, write ``simulate_roundoff.{json,md}`` to ``--out`` (default: the working directory)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--speed-numel", type=int, default=1 << 20)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("."),
        help="directory for the results (default: the working directory; the committed ones are in benchmarks/results)",
    )
    args = parser.parse_args(argv)
    command = "python -m benchmarks.simulate_roundoff " + " ".join(argv or sys.argv[1:])
    print(command)
    torch.set_num_threads(1)
    start = time.perf_counter()
    model = _pretrained()
    rows = _roundoff(model, args.batches)
    speed = _speed(args.speed_numel) if args.speed_numel else []
    result = {
        "command": command,
        "micro_batch": MICRO_BATCH,
        "batches": args.batches,
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": 1,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
        "speed": speed,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simulate_roundoff.json").write_text(json.dumps(result, indent=1))
    (args.out / "simulate_roundoff.md").write_text(_markdown(result))
    print((args.out / "simulate_roundoff.md").read_text())
    return result


def _markdown(result: dict) -> str:
    lines = [
        "# Round-off of the simulated all-reduce vs the number of workers",
        "",
        f"`{result['command']}`",
        "",
        f"Digits CNN ({result['model_parameters']} parameters) after 2 FP32 epochs; worker r's "
        f"gradient is that of its own {result['micro_batch']} images. Relative L2 error of the "
        "averaged gradient against the exact mean of the unrounded worker gradients, mean of "
        f"{result['batches']} batches. ring: sum in the wire format at every hop (Gloo's order); "
        "tree: binary tree in the wire format; two_phase: FP32 accumulation, mean rounded once.",
        "",
    ]
    rows = result["rows"]
    for scaling, title in (("layer", "with APS (per-layer scaling)"), ("none", "without scaling")):
        cols = [(f, o) for f in FORMATS for o in ORDERS]
        lines += [
            f"## {title}",
            "",
            "| N | " + " | ".join(f"{f} {o}" for f, o in cols) + " |",
            "|---:|" + "---:|" * len(cols),
        ]
        for n in WORKERS:
            cells = []
            for f, o in cols:
                [r] = [
                    r
                    for r in rows
                    if r["workers"] == n
                    and r["format"] == f
                    and r["order"] == o
                    and r["scaling"] == scaling
                ]
                cells.append(f"{r['rel_err']:.3g}")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    if result["speed"]:
        lines += [
            f"## Simulator speed, N = 256 workers x {result['speed'][0]['numel']:,} elements, "
            "one CPU thread",
            "",
            "| format | order | seconds |",
            "|---|---|---:|",
        ]
        lines += [f"| {r['format']} | {r['order']} | {r['seconds']} |" for r in result["speed"]]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
