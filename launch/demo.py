"""``aps-demo``: train a small CNN with DDP once per gradient hook and compare.

One command, no arguments needed, CPU only: it launches ``--nproc`` local
ranks through the project's elastic launcher (:mod:`aps_launch.elastic`, the
engine of torchrun) running this module; every rank joins the job with
:func:`aps_launch.init_distributed` and trains the same small CNN on
scikit-learn's digits (8x8 images, shipped with scikit-learn, no download)
once per hook:

* ``fp32`` — PyTorch's ``default_hooks.allreduce_hook`` (what DDP does by default);
* ``fp16`` — PyTorch's ``default_hooks.fp16_compress_hook``;
* ``naive-e4m3`` — a plain cast to FP8 e4m3, no scaling
  (``register(ddp, fmt="e4m3", scaling="none")``);
* ``aps-e4m3`` / ``aps-e5m2`` — Auto Precision Scaling (``register(ddp, fmt=...)``).

With ``--fsdp`` the model is sharded with FSDP2 (``fully_shard`` on its
feature extractor and classifier, then the root) instead of DDP; ``fp32``,
``bf16`` and ``fp16`` are then FSDP's own reduce-scatter in that
``reduce_dtype``, and ``aps-<fmt>`` / ``naive-<fmt>`` install
:func:`aps_comm.fsdp.register` (default list: ``fp32,bf16,naive-e4m3,aps-e4m3,aps-e5m2``).

``aps-<fmt>`` and ``naive-<fmt>`` work for any format
:func:`aps_comm.get_format` knows (``--fmt e3m2`` adds ``aps-e3m2``). Every run
starts from the same weights and sees the same batches in the same order.
Rank 0 shows a progress bar; the launching process then prints a table
(final test accuracy, final training loss, bytes each rank hands to
collectives per step, wall time) and optionally writes JSON and a PNG of the
loss curves.

Example:
    ``aps-demo``
    ``aps-demo --epochs 5 --hooks fp32,aps-e4m3 --fmt e3m2 --json out.json --plot out.png``
    ``aps-demo --fsdp``

    >>> build_parser().parse_args(["--hooks", "fp32,aps-e4m3"]).hooks
    'fp32,aps-e4m3'
"""

# No `from __future__ import annotations`: DDP inspects a hook's annotations
# and wants the real dist.GradBucket / torch.futures.Future objects.

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from aps_comm import fsdp as aps_fsdp
from aps_comm import get_format, register

from .distributed import BACKEND_ENV, init_distributed
from .elastic import launch_elastic, torchrun_argv
from .store import pin_loopback

__all__ = [
    "DEFAULT_FSDP_HOOKS",
    "DEFAULT_HOOKS",
    "build_parser",
    "format_table",
    "main",
    "progress_bar",
    "resolve_hooks",
]

DEFAULT_HOOKS = ("fp32", "fp16", "naive-e4m3", "aps-e4m3", "aps-e5m2")
DEFAULT_FSDP_HOOKS = ("fp32", "bf16", "naive-e4m3", "aps-e4m3", "aps-e5m2")
# --fsdp: FSDP2's own reduce-scatter in these reduce dtypes.
_FSDP_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PYTORCH_HOOKS: dict[str, Callable[..., torch.futures.Future[torch.Tensor]]] = {
    "fp32": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
}
_INSTALL_HINT = "pip install '.[demo]' in the aps-comm checkout"
# The train/test split is fixed, independent of --seed: --seed varies the
# initial weights and the batch order, not which images are held out.
_SPLIT_SEED = 0
_TEST_FRACTION = 0.25


def build_parser() -> argparse.ArgumentParser:
    """The ``aps-demo`` argument parser.

    Example:
        >>> build_parser().parse_args([]).nproc
        2
    """
    parser = argparse.ArgumentParser(
        prog="aps-demo",
        description="Train a small CNN on scikit-learn's digits with DDP on local CPU ranks, "
        "once per gradient-communication hook, and compare accuracy, loss and bytes sent.",
    )
    parser.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument(
        "--epochs", type=int, default=20, help="epochs per run (default %(default)s)"
    )
    parser.add_argument(
        "--hooks",
        default=None,
        help=f"comma-separated hooks to run, in order (default: {','.join(DEFAULT_HOOKS)}; "
        f"with --fsdp {','.join(DEFAULT_FSDP_HOOKS)}); "
        "also aps-<fmt> / naive-<fmt> for any aps_comm format",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model with FSDP2 (fully_shard) instead of DDP; fp32/bf16/fp16 are "
        "FSDP's own reduce-scatter in that reduce_dtype, aps-/naive- use aps_comm.fsdp",
    )
    parser.add_argument(
        "--fmt", default=None, help="extra APS wire format to add as aps-<fmt> (e.g. e3m2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and batch order seed")
    parser.add_argument(
        "--grad-scale",
        type=float,
        default=2.0**-10,
        help="multiply the loss by this and divide the learning rate by it: identical "
        "FP32 training, gradients the size of a large network's (default %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=0.1,
        help="peak SGD learning rate, cosine-annealed to 0 (default %(default)s)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="batch size per rank (default %(default)s)"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write results")
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="PATH", help="write a PNG of the loss curves"
    )
    # Set by the launching process for the ranks it starts; not for users.
    parser.add_argument("--worker-output", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def resolve_hooks(hooks: str | None, fmt: str | None = None, fsdp: bool = False) -> list[str]:
    """Validate a comma-separated hook list and append ``aps-<fmt>``.

    ``hooks=None`` is the default list (:data:`DEFAULT_HOOKS`, or
    :data:`DEFAULT_FSDP_HOOKS` with ``fsdp``).

    Raises:
        ValueError: a name is neither a built-in hook nor ``aps-``/``naive-``
            followed by a known format; the message lists the valid names.

    Example:
        >>> resolve_hooks("fp32,aps-e4m3", fmt="e3m2")
        ['fp32', 'aps-e4m3', 'aps-e3m2']
    """
    defaults = DEFAULT_FSDP_HOOKS if fsdp else DEFAULT_HOOKS
    if hooks is None:
        hooks = ",".join(defaults)
    names = [h.strip() for h in hooks.split(",") if h.strip()]
    if fmt is not None:
        try:
            get_format(fmt)
        except ValueError as exc:
            raise ValueError(f"--fmt: {exc}") from None
        names.append(f"aps-{fmt}")
    if not names:
        raise ValueError(f"no hooks given; valid: {', '.join(defaults)}")
    unknown = [n for n in names if not _known_hook(n, fsdp)]
    if unknown:
        native = [*_FSDP_REDUCE_DTYPES] if fsdp else [*_PYTORCH_HOOKS]
        valid = dict.fromkeys([*defaults, *native])
        raise ValueError(
            f"unknown hook name(s): {', '.join(unknown)}; valid: {', '.join(valid)}, "
            "or aps-<fmt> / naive-<fmt> for any aps_comm format (e.g. aps-e3m2, naive-e5m2)"
        )
    return list(dict.fromkeys(names))


def _known_hook(name: str, fsdp: bool = False) -> bool:
    if name in (_FSDP_REDUCE_DTYPES if fsdp else _PYTORCH_HOOKS):
        return True
    kind, _, fmt = name.partition("-")
    if kind not in ("aps", "naive") or not fmt:
        return False
    try:
        get_format(fmt)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------
# What every rank runs


class _DigitsCNN(nn.Module):
    """Three 3x3 convolutions, global average pooling, one linear layer (~15k parameters).

    The global-average-pooled head (as in ResNets) starts on a plateau where
    most gradients are far below e4m3's smallest subnormal: the regime where
    scaling matters.
    """

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _load_digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test); images as (N, 1, 8, 8) floats in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    train, test = train_test_split(
        torch.arange(len(y)).numpy(),
        test_size=_TEST_FRACTION,
        random_state=_SPLIT_SEED,
        stratify=y.numpy(),
    )
    return x[train], y[train], x[test], y[test]


@contextlib.contextmanager
def _counting_all_reduce(counter: list[int]) -> Iterator[None]:
    """Add the nbytes of every tensor handed to ``dist.all_reduce`` to ``counter[0]``.

    PyTorch's hooks do not report what they send; intercepting the call they
    make measures the tensor they actually hand to the collective, the same
    quantity as ``APSState.bytes_sent``. Scoped to one hook call on the
    thread DDP runs hooks on, where nothing else issues collectives.
    """
    original = dist.all_reduce

    @functools.wraps(original)
    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original


def _counting_hook(
    hook: Callable[..., torch.futures.Future[torch.Tensor]], counter: list[int]
) -> Callable[..., torch.futures.Future[torch.Tensor]]:
    """Wrap a PyTorch DDP hook so the bytes it all-reduces add up in ``counter[0]``."""

    def counted_hook(
        state: dist.ProcessGroup | None, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        with _counting_all_reduce(counter):
            return hook(state, bucket)

    return counted_hook


def _attach_hook(name: str, ddp: DistributedDataParallel) -> Callable[[], int]:
    """Register hook ``name`` on ``ddp``; return a function giving the last step's bytes."""
    if name in _PYTORCH_HOOKS:
        counter = [0]
        ddp.register_comm_hook(None, _counting_hook(_PYTORCH_HOOKS[name], counter))

        def take() -> int:
            sent, counter[0] = counter[0], 0
            return sent

        return take
    kind, _, fmt = name.partition("-")
    state = register(ddp, fmt=fmt, scaling="layer" if kind == "aps" else "none")
    return lambda: state.bytes_sent


def _shard(name: str, model: nn.Module) -> Callable[[], int]:
    """``--fsdp``: fully_shard ``model`` for setup ``name``; return the last step's bytes.

    FSDP's own reduce-scatter reports nothing; its bytes are its input (every
    gradient, dim 0 padded to the world size, in the reduce dtype), what it
    hands to the collective.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    dtype = _FSDP_REDUCE_DTYPES.get(name, torch.float32)
    padded = sum(
        -(-p.shape[0] // world) * world * (p.numel() // p.shape[0]) for p in model.parameters()
    )
    mp = MixedPrecisionPolicy(reduce_dtype=dtype)
    for unit in model.children():
        fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if name in _FSDP_REDUCE_DTYPES:
        native = padded * dtype.itemsize
        return lambda: native
    kind, _, fmt = name.partition("-")
    state = aps_fsdp.register(model, fmt, scaling="layer" if kind == "aps" else "none")
    return lambda: state.bytes_sent


def _batches(n_train: int, batch_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n_train), shuffle=True, seed=seed, drop_last=False)
    sampler.set_epoch(epoch)
    order = torch.tensor(list(sampler))
    # Whole batches only: a 2-sample tail batch would give one noisy step.
    full = len(order) // batch_size * batch_size
    if full == 0:
        raise ValueError(
            f"batch size {batch_size} exceeds this rank's {len(order)} training samples"
        )
    return list(order[:full].split(batch_size))


def _train_one(name: str, data: Sequence[torch.Tensor], opts: argparse.Namespace) -> dict:
    """Train a fresh model with hook ``name``; rank 0's record of the run."""
    x_train, y_train, x_test, y_test = data
    rank = dist.get_rank()
    torch.manual_seed(opts.seed)
    if opts.fsdp:
        ddp = net = _DigitsCNN()
        take_bytes = _shard(name, net)
    else:
        ddp = DistributedDataParallel(_DigitsCNN())
        take_bytes = _attach_hook(name, ddp)
        net = ddp.module
    # The loss times grad_scale and the learning rate over it: the same training
    # in FP32 (powers of two are exact, SGD is linear in the gradient), with
    # gradients as small as a large network's, the regime APS is built for.
    optimizer = torch.optim.SGD(ddp.parameters(), lr=opts.lr / opts.grad_scale, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    steps_per_epoch = len(_batches(len(y_train), opts.batch_size, opts.seed, 0))
    # Annealing to zero makes the last epoch's accuracy a settled number
    # rather than a snapshot of SGD bouncing at a high learning rate.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=opts.epochs * steps_per_epoch
    )

    # Per epoch: summed loss and batch count on this rank, reduced once at the end.
    epoch_loss = torch.zeros(opts.epochs, 2, dtype=torch.float64)
    accuracy_curve: list[float] = []
    bytes_total = steps = 0
    dist.barrier()
    start = time.perf_counter()
    with progress_bar(opts.epochs * steps_per_epoch, f"{name:>12}", disable=rank != 0) as bar:
        for epoch in range(opts.epochs):
            ddp.train()
            for idx in _batches(len(y_train), opts.batch_size, opts.seed, epoch):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(ddp(x_train[idx]), y_train[idx])
                (loss * opts.grad_scale).backward()
                optimizer.step()
                schedule.step()
                bytes_total += take_bytes()
                steps += 1
                epoch_loss[epoch, 0] += loss.item()
                epoch_loss[epoch, 1] += 1
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            accuracy_curve.append(_evaluate(net, x_test, y_test)[0])
        dist.barrier()
        seconds = time.perf_counter() - start

    dist.all_reduce(epoch_loss)
    loss_curve = (epoch_loss[:, 0] / epoch_loss[:, 1]).tolist()
    accuracy, test_loss = _evaluate(net, x_test, y_test)
    return {
        "name": name,
        "test_accuracy": accuracy,
        "loss": loss_curve[-1],
        "bytes_per_step": bytes_total / steps,
        "seconds": seconds,
        "test_loss": test_loss,
        "loss_curve": loss_curve,
        "test_accuracy_curve": accuracy_curve,
        "steps": steps,
    }


@contextlib.contextmanager
def progress_bar(
    total: int, desc: str, *, disable: bool = False, file: Any = None
) -> Iterator[Any]:
    """A tqdm bar on stderr (or ``file``), with log records printed above it, not into it.

    The first quantised step compiles the CPU codec, and
    :mod:`aps_comm.cpu_kernels` logs a line saying so; logged while the bar
    is drawn, it would land in the middle of the bar's line. Inside this
    context the root logger's console output goes through ``tqdm.write``,
    which clears the bar, prints the line and draws the bar again below it.

    Example:
        >>> with progress_bar(10, "aps-e4m3", disable=True) as bar:
        ...     bar.update()
    """
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    out = sys.stderr if file is None else file
    with (
        logging_redirect_tqdm(),
        tqdm(total=total, desc=desc, unit="step", disable=disable, leave=True, file=out) as bar,
    ):
        yield bar


@torch.no_grad()
def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean loss) on the whole set; every rank holds the same weights."""
    model.eval()
    logits = model(x)
    accuracy = (logits.argmax(1) == y).float().mean().item()
    return accuracy, nn.functional.cross_entropy(logits, y).item()


def _worker(opts: argparse.Namespace) -> int:
    init_distributed(backend="gloo")
    # Ranks share the machine's cores: one rank per core, not one per thread.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    try:
        data = _load_digits()
        hooks = resolve_hooks(opts.hooks, fsdp=opts.fsdp)
        runs = [_train_one(name, data, opts) for name in hooks]
        if dist.get_rank() == 0:
            record = {"runs": runs, "config": _config(opts)}
            opts.worker_output.write_text(json.dumps(record, indent=2))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _config(opts: argparse.Namespace) -> dict[str, Any]:
    return {
        "world_size": dist.get_world_size(),
        "epochs": opts.epochs,
        "seed": opts.seed,
        "lr": opts.lr,
        "grad_scale": opts.grad_scale,
        "batch_size_per_rank": opts.batch_size,
        "optimizer": "SGD(momentum=0.9), cosine learning rate",
        "dataset": "sklearn digits, 75/25 stratified split",
        "wrapper": "FSDP2 (fully_shard)" if opts.fsdp else "DDP",
    }


# --------------------------------------------------------------------------
# The launching process


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    """The results as a plain-text table; bytes relative to the ``fp32`` run if present.

    Example:
        >>> print(format_table([{"name": "fp32", "test_accuracy": 0.98, "loss": 0.05,
        ...                      "bytes_per_step": 154152.0, "seconds": 9.1}]))
        hook          test acc   final loss   bytes/step   vs fp32   time (s)
        fp32            98.00%       0.0500      154,152     1.000        9.1
    """
    base = next((r["bytes_per_step"] for r in runs if r["name"] == "fp32"), None)
    lines = [
        f"{'hook':<12} {'test acc':>9} {'final loss':>12} {'bytes/step':>12} "
        f"{'vs fp32':>9} {'time (s)':>10}"
    ]
    for r in runs:
        ratio = f"{r['bytes_per_step'] / base:.3f}" if base else "-"
        lines.append(
            f"{r['name']:<12} {r['test_accuracy']:>9.2%} {r['loss']:>12.4f} "
            f"{r['bytes_per_step']:>12,.0f} {ratio:>9} {r['seconds']:>10.1f}"
        )
    return "\n".join(lines)


def _plot(runs: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for r in runs:
        epochs = range(1, len(r["loss_curve"]) + 1)
        ax_loss.plot(epochs, r["loss_curve"], marker="o", label=r["name"])
        ax_acc.plot(epochs, r["test_accuracy_curve"], marker="o", label=r["name"])
    ax_loss.set(xlabel="epoch", ylabel="mean training loss", yscale="log", title="Training loss")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="Test accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _missing_packages(opts: argparse.Namespace) -> list[str]:
    needed = ["sklearn"] + (["matplotlib"] if opts.plot else [])
    missing = []
    for module in needed:
        try:
            __import__(module)
        except ImportError:
            missing.append("scikit-learn" if module == "sklearn" else module)
    return missing


def _worker_argv(opts: argparse.Namespace, hooks: Sequence[str], output: Path) -> list[str]:
    return [
        "--epochs",
        str(opts.epochs),
        "--hooks",
        ",".join(hooks),
        "--seed",
        str(opts.seed),
        "--lr",
        repr(opts.lr),
        "--grad-scale",
        repr(opts.grad_scale),
        "--batch-size",
        str(opts.batch_size),
        "--worker-output",
        str(output),
        *(["--fsdp"] if opts.fsdp else []),
    ]


@contextlib.contextmanager
def _working_directory(path: str) -> Iterator[None]:
    """Run the block in ``path`` (``contextlib.chdir`` is Python >= 3.11)."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def _launch(opts: argparse.Namespace, hooks: Sequence[str]) -> dict[str, Any] | int:
    """Run the ranks; their results, or the job's non-zero exit code."""
    os.environ[BACKEND_ENV] = "gloo"
    # torchrun would set 1 and print a warning about it; the ranks set their
    # own thread count anyway.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    pin_loopback()
    with tempfile.TemporaryDirectory(prefix="aps-demo-") as tmp:
        output = Path(tmp) / "results.json"
        argv = torchrun_argv(
            # The installed name (aps_launch), not the checkout's directory name.
            f"{__package__}.demo",
            _worker_argv(opts, hooks, output),
            nproc_per_node=opts.nproc,
            module=True,
            rdzv_id="aps-demo",
        )
        # `python -m` puts the ranks' working folder first on sys.path: started
        # from a checkout, they would import its aps_comm, not the installed one.
        with _working_directory(tmp):
            code = launch_elastic(argv)
        if code != 0:
            return code
        if not output.exists():
            print("aps-demo: error: the ranks exited without writing results", file=sys.stderr)
            return 1
        return json.loads(output.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aps-demo``; returns the process exit code.

    Example:
        >>> main(["--epochs", "1", "--hooks", "fp32,aps-e4m3"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.worker_output is not None:
        return _worker(opts)
    try:
        hooks = resolve_hooks(opts.hooks, opts.fmt, fsdp=opts.fsdp)
    except ValueError as exc:
        parser.error(str(exc))
    if opts.nproc < 1 or opts.epochs < 1 or opts.batch_size < 1 or not math.isfinite(opts.lr):
        parser.error("--nproc, --epochs and --batch-size must be >= 1 and --lr finite")
    if not (math.isfinite(opts.grad_scale) and opts.grad_scale > 0):
        parser.error(f"--grad-scale must be positive and finite, got {opts.grad_scale}")
    missing = _missing_packages(opts)
    if missing:
        what = " and ".join(missing)
        parser.error(f"the demo needs {what}: {_INSTALL_HINT}")
    per_rank = math.ceil(len(_load_digits()[1]) / opts.nproc)
    if opts.batch_size > per_rank:
        parser.error(
            f"--batch-size {opts.batch_size} exceeds the {per_rank} training samples per rank"
        )

    started = time.perf_counter()
    result = _launch(opts, hooks)
    if isinstance(result, int):
        print(f"aps-demo: a rank failed (exit code {result})", file=sys.stderr)
        return result
    runs = result["runs"]
    print()
    print(
        f"{result['config']['world_size']} ranks"
        + (" (FSDP2)" if opts.fsdp else "")
        + f", {opts.epochs} epochs, "
        f"batch {opts.batch_size}/rank, lr {opts.lr}, seed {opts.seed}, "
        f"gradients x {opts.grad_scale:g} (lr / {opts.grad_scale:g})"
    )
    print(format_table(runs))
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results: {opts.json}")
    if opts.plot:
        _plot(runs, opts.plot)
        print(f"loss curves: {opts.plot}")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
