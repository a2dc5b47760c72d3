"""Training with 64 virtual workers in low-precision formats, with and without APS.

A small CNN on sklearn's digits (8x8 images, no download) is trained as N
data-parallel workers on one process (:class:`aps_comm.simulate.VirtualWorkers`):
each step splits the batch into N micro-batches, computes N gradients, and
averages them through the simulated all-reduce in the chosen format. Every
format runs with APS scaling (one power of two per layer) and without it
(a plain saturating cast), next to an FP32 baseline; the test accuracy of
each is written to JSON, markdown and a PNG of the curves.

    python -m benchmarks.simulate_training [--workers 64] [--epochs 15] [--seeds 2]
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

from aps_comm.simulate import SimConfig, VirtualWorkers

__all__ = ["DigitsCNN", "load_digits_tensors", "main", "train"]


class DigitsCNN(nn.Module):
    """Two 3x3 conv layers and two linear layers, 53k parameters, for 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 2 * 2, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def load_digits_tensors(
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): 1437 / 360 images in [0, 1], shape (B, 1, 8, 8)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_train = int(0.8 * len(y))
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def train(
    config: SimConfig | None,
    *,
    workers: int,
    micro_batch: int,
    epochs: int,
    lr: float,
    seed: int,
) -> dict:
    """Train from a seeded init; ``config=None`` is exact FP32 averaging. Returns curves."""
    torch.manual_seed(seed)
    x_tr, y_tr, x_te, y_te = load_digits_tensors()
    model = DigitsCNN()
    vw = VirtualWorkers(model, workers, config or SimConfig("fp32", scaling="none"))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    batch = workers * micro_batch
    gen = torch.Generator().manual_seed(seed)
    loss_fn = nn.functional.cross_entropy
    curve = []
    zero_frac = []
    for _ in range(epochs):
        perm = torch.randperm(len(y_tr), generator=gen)
        losses = []
        for i in range(0, len(perm) - batch + 1, batch):
            idx = perm[i : i + batch]
            losses.append(float(vw.backward(loss_fn, x_tr[idx], y_tr[idx])))
            grads = [p.grad for p in model.parameters()]
            zero_frac.append(
                sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads)
            )
            opt.step()
        with torch.no_grad():
            acc = float((model(x_te).argmax(1) == y_te).float().mean())
        curve.append({"train_loss": sum(losses) / len(losses), "test_acc": acc})
    return {
        "curve": curve,
        "final_test_acc": curve[-1]["test_acc"],
        "zero_grad_fraction": sum(zero_frac) / len(zero_frac),
    }


def _label(fmt: str, scaling: str | None) -> str:
    if scaling is None:
        return "fp32"
    return f"{fmt} {'APS' if scaling == 'layer' else 'no scaling'}"


def main(argv: list[str] | None = None) -> dict:
    """Run the study, write ``simulate_training.{json,md,png}`` to ``--out`` (default: the working directory)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--reduction", default="two_phase")
    parser.add_argument("--formats", nargs="+", default=["e5m2", "e4m3", "e3m2", "e2m1"])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("."),
        help="directory for the results (default: the working directory; the committed ones are in benchmarks/results)",
    )
    args = parser.parse_args(argv)
    command = "python -m benchmarks.simulate_training " + " ".join(argv or sys.argv[1:])
    print(command)
    torch.set_num_threads(1)
    start = time.perf_counter()

    runs: list[tuple[str, str | None]] = [("fp32", None)]
    runs += [(f, s) for f in args.formats for s in ("layer", "none")]
    rows = []
    for fmt, scaling in runs:
        cfg = None if scaling is None else SimConfig(fmt, args.reduction, scaling)  # type: ignore[arg-type]
        per_seed = [
            train(
                cfg,
                workers=args.workers,
                micro_batch=args.micro_batch,
                epochs=args.epochs,
                lr=args.lr,
                seed=s,
            )
            for s in range(args.seeds)
        ]
        accs = [r["final_test_acc"] for r in per_seed]
        row = {
            "label": _label(fmt, scaling),
            "format": fmt,
            "scaling": scaling or "none",
            "final_test_acc": accs,
            "mean_test_acc": sum(accs) / len(accs),
            "zero_grad_fraction": sum(r["zero_grad_fraction"] for r in per_seed) / len(per_seed),
            "curves": [r["curve"] for r in per_seed],
        }
        rows.append(row)
        print(
            f"{row['label']:<20} test acc {row['mean_test_acc']:.4f} "
            f"(seeds {', '.join(f'{a:.4f}' for a in accs)}), "
            f"zero gradients {row['zero_grad_fraction']:.1%}",
            flush=True,
        )
    result = {
        "command": command,
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}},
        "batch": args.workers * args.micro_batch,
        "model_parameters": sum(p.numel() for p in DigitsCNN().parameters()),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simulate_training.json").write_text(json.dumps(result, indent=1))
    (args.out / "simulate_training.md").write_text(_markdown(result))
    _plot(result, args.out / "simulate_training.png")
    print(f"wrote {args.out}/simulate_training.{{json,md,png}} in {result['seconds']} s")
    return result


def _markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"# Digits CNN, {s['workers']} virtual workers (simulated all-reduce)",
        "",
        f"`{result['command']}`",
        "",
        f"{result['model_parameters']} parameters, batch {result['batch']} "
        f"({s['workers']} x {s['micro_batch']}), SGD lr {s['lr']} momentum 0.9, "
        f"{s['epochs']} epochs, reduction `{s['reduction']}`, {s['seeds']} seeds, "
        "1437 train / 360 test images.",
        "",
        "| run | test accuracy (mean) | per seed | zero gradient elements |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        seeds = ", ".join(f"{a:.3f}" for a in r["final_test_acc"])
        lines.append(
            f"| {r['label']} | {r['mean_test_acc']:.3f} | {seeds} | {r['zero_grad_fraction']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    # One colour per format: solid with APS, dotted without.
    formats = list(dict.fromkeys(r["format"] for r in result["rows"] if r["label"] != "fp32"))
    palette = {f: f"C{i}" for i, f in enumerate(formats)}
    for r in result["rows"]:
        epochs = len(r["curves"][0])
        mean = [
            sum(c[e]["test_acc"] for c in r["curves"]) / len(r["curves"]) for e in range(epochs)
        ]
        style = "-" if r["scaling"] == "layer" or r["label"] == "fp32" else ":"
        color = "black" if r["label"] == "fp32" else palette[r["format"]]
        ax.plot(range(1, epochs + 1), mean, style, label=r["label"], color=color)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"digits CNN, {result['settings']['workers']} simulated workers")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
