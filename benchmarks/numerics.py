"""Error of the averaged gradient per format, scaling, reduction and world size.

The relative L2 error ``||avg - mean||_2 / ||mean||_2`` of the averaged
gradient against the exact mean (float64) of every worker's raw gradient,
on gradients captured from real training of two models (snapshots taken
part-way through FP32 training):

- the digits CNN, loss multiplied by 2**-10 (gradients of 1e-6 to 1e-4, a
  large network's magnitudes, the device of ``tests/test_training.py``);
- a small transformer LM on a second-order Markov chain, no loss scaling.

Every worker's gradient is that of its own micro-batch (``--micro-batch``
examples). World sizes 2 and 4 run real processes (Gloo, real DDP, the real
hook): a wrapper around the hook keeps each bucket as DDP hands it over and
as the hook returns it, and the reference is the mean of all ranks' raw
buckets. World sizes 16, 64 and 256 use :func:`aps_comm.simulate.allreduce`
on per-worker gradients (one bucket; two_phase equals the hook bit for bit,
"ring" equals Gloo's native FP16/BF16 all-reduce). PyTorch's
``fp16_compress_hook`` / ``bf16_compress_hook`` run on real ranks, and are
simulated at large N as what they compute: cast, divide by N in the wire
dtype, ring all-reduce in the wire dtype.

Reductions: ``two_phase`` for every format; ``allreduce`` (the backend sums
the wire dtype natively) for fp16 and bf16, the formats Gloo can sum.

Block scaling (``--block-sizes 16 32 64``) adds two_phase rows for each
block size, simulated at every N (real and simulated columns alike): with
the exponents agreed across ranks ("block32"), with the owner also picking
each block's exponent for the mean ("block32+owner", what the hook's
two_phase runs) and with each rank's own exponents ("block32+rank"); see
:func:`aps_comm.simulate.allreduce`. Hierarchical (nodes of 8) and grid rows
too, where N has that layout: agreed exponents, and "+rank" (every level's
owner encodes what it forwards with its own block exponents and adds its own
contribution unrounded, the hook's; one chunk per bucket). Beside them, the floor of each format and
block size ("exact mean", "block32 floor", :func:`block_floor`): the exact
mean of the same gradients rounded to the format once, every block with its
own exponent from the mean's block maximum and no headroom. It is what
encoding the mean itself flushes: a larger exponent would saturate the
block's largest element, so no block exponent rule flushes less of the true
mean.

    python -m benchmarks.numerics [--batches 4] [--micro-batch 4] [--sim-workers 16 64 256]
                                  [--block-sizes 16 32 64] [--block-formats e4m3 e3m2 e2m1]
"""

# No `from __future__ import annotations`: DDP inspects the capture hook's annotations.

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import APSState, aps_hook
from aps_comm.codec import Layout
from aps_comm.formats import FloatFormat, get_format, quantize
from aps_comm.scaling import blocks_amax, factors
from aps_comm.simulate import VirtualWorkers, allreduce
from aps_comm.testing import run_distributed
from aps_comm.topology import grid_rows
from benchmarks._models import DigitsCNN, TinyLM, lm_loss, load_digits_tensors, markov_data

__all__ = [
    "BLOCK_VARIANTS",
    "FLOOR",
    "FORMATS",
    "SCALINGS",
    "block_configs",
    "block_floor",
    "configs",
    "floor_config",
    "main",
]

FORMATS = ("e4m3", "e5m2", "fp16", "bf16", "e3m2", "e2m1")
SCALINGS = ("none", "bucket", "layer")
NATIVE = ("fp16", "bf16")  # formats Gloo sums natively
TORCH_HOOKS = ("fp32_allreduce", "fp16_compress", "bf16_compress")
LOSS_SCALE = 2.0**-10
MODELS = ("digits_cnn", "markov_lm")
_LM = {"vocab": 8, "seq_len": 16, "dim": 32}


def configs(
    formats: Sequence[str] = FORMATS,
    scalings: Sequence[str] = SCALINGS,
    torch_hooks: Sequence[str] = TORCH_HOOKS,
) -> list[dict[str, str]]:
    """The configurations measured: APS hook settings, then PyTorch's hooks.

    Example:
        >>> len(configs())
        27
        >>> [c["scaling"] for c in configs(["e4m3"], ["layer"], [])]
        ['layer']
    """
    out = []
    for fmt in formats:
        for reduction in ("allreduce", "two_phase") if fmt in NATIVE else ("two_phase",):
            for scaling in scalings:
                out.append(
                    {"hook": "aps", "format": fmt, "reduction": reduction, "scaling": scaling}
                )
    for hook in torch_hooks:
        fmt = {"fp32_allreduce": "fp32", "fp16_compress": "fp16", "bf16_compress": "bf16"}[hook]
        out.append({"hook": hook, "format": fmt, "reduction": "allreduce", "scaling": "none"})
    return out


BLOCK_VARIANTS = {"": {}, "+owner": {"owner_exponents": True}, "+rank": {"rank_exponents": True}}

BLOCK_REDUCTIONS = ("two_phase", "hierarchical", "grid")
"""The block rows' reductions; the staged ones have no ``+owner`` variant."""

NODE_RANKS = 8
"""Ranks per node of the hierarchical block rows (a node of 8 GPUs)."""


def block_configs(
    formats: Sequence[str],
    block_sizes: Sequence[int],
    reductions: Sequence[str] = ("two_phase",),
) -> list[dict[str, str]]:
    """The block-scaling rows: every reduction, block size and variant.

    Example:
        >>> [c["scaling"] for c in block_configs(["e2m1"], [32])]
        ['block32', 'block32+owner', 'block32+rank']
        >>> [c["scaling"] for c in block_configs(["e2m1"], [32], ["grid"])]
        ['block32', 'block32+rank']
    """
    return [
        {"hook": "aps", "format": fmt, "reduction": red, "scaling": f"block{b}{v}"}
        for fmt in formats
        for b in block_sizes
        for red in reductions
        for v in BLOCK_VARIANTS
        if red == "two_phase" or v != "+owner"
    ]


def _staged_options(reduction: str, workers: int) -> dict | None:
    """simulate.allreduce's keywords for a block row's reduction at ``workers``; None where
    it has no such layout (hierarchical: nodes of :data:`NODE_RANKS`, at least two; grid:
    a divisor between 2 and sqrt(N))."""
    if reduction == "two_phase":
        return {}
    if reduction == "hierarchical":
        ok = workers % NODE_RANKS == 0 and workers > NODE_RANKS
        return {"reduction": reduction, "ranks_per_node": NODE_RANKS} if ok else None
    return {"reduction": reduction} if grid_rows(workers) > 1 else None


FLOOR = "exact mean"
"""The reduction column of the floor rows (:func:`floor_config`)."""


def floor_config(fmt: str, block_size: int) -> dict[str, str]:
    """The floor row of a format and block size: the exact mean encoded by :func:`block_floor`.

    Example:
        >>> floor_config("e4m3", 32)["scaling"]
        'block32 floor'
    """
    return {
        "hook": "floor",
        "format": fmt,
        "reduction": FLOOR,
        "scaling": f"block{block_size} floor",
    }


def block_floor(
    means: Sequence[torch.Tensor], fmt: FloatFormat | str, block_size: int
) -> list[torch.Tensor]:
    """The exact mean rounded to ``fmt`` with its own exponent per block: the flush floor.

    Every ``block_size`` elements of a layer (from the layer's start, as the
    hook cuts them) get the exponent of two_phase's rule for one worker
    (:func:`aps_comm.scaling.factors`, no headroom) from the block's largest
    magnitude; the mean is rounded to float32 (what an owner holds) and then
    to the format with it. A larger exponent would saturate the block's
    largest element, so no block exponent flushes fewer elements of the mean.

    Args:
        means: each layer's exact mean, any shape and floating dtype.
        fmt: the wire format.
        block_size: elements per block (a power of two from 8 to 256).

    Returns:
        One float32 tensor per layer, shaped like its mean; a layer with a
        non-finite element comes back NaN.

    Example:
        >>> block_floor([torch.tensor([1.0, 2.0**-19, 2.0**-17])], "e4m3", 8)
        [tensor([1.0000e+00, 0.0000e+00, 7.6294e-06])]
    """
    flat = [m.detach().reshape(-1).float() for m in means]
    if not flat:
        return []
    blocks = Layout.from_numels([f.numel() for f in flat], flat[0].device).grid(block_size)
    x = torch.cat(flat)
    f = factors(
        blocks_amax(x, blocks.layout),
        get_format(fmt),
        "two_phase",
        world_size=1,
        scaling="block",
        counts=blocks.device_counts,
    )
    lengths = blocks.layout.lengths
    scale = torch.repeat_interleave(f.scale, lengths, output_size=x.numel())
    unscale = torch.repeat_interleave(f.unscale, lengths, output_size=x.numel())
    out = quantize(x * scale, fmt) * unscale
    return [
        o.view(m.shape) for o, m in zip(out.split([f.numel() for f in flat]), means, strict=True)
    ]


def _block_options(scaling: str) -> dict:
    """simulate.allreduce's keywords for a "block32+owner"-style scaling."""
    size, _, variant = scaling.removeprefix("block").partition("+")
    return {
        "scaling": "block",
        "block_size": int(size),
        **BLOCK_VARIANTS[f"+{variant}" if variant else ""],
    }


def _configs(settings: dict) -> list[dict[str, str]]:
    return configs(
        settings.get("formats", FORMATS),
        settings.get("scalings", SCALINGS),
        settings.get("torch_hooks", TORCH_HOOKS),
    )


def _label(cfg: dict[str, str]) -> str:
    if cfg["hook"] not in ("aps", "floor"):
        return cfg["hook"]
    return f"{cfg['format']} {cfg['reduction']} {cfg['scaling']}"


# ---------------------------------------------------------------------------
# models, snapshots and per-worker batches


def _new_model(name: str) -> nn.Module:
    if name == "digits_cnn":
        return DigitsCNN()
    return TinyLM(_LM["vocab"], _LM["seq_len"], _LM["dim"])


def _loss_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if name == "digits_cnn":
        return lambda out, y: nn.functional.cross_entropy(out, y) * LOSS_SCALE
    return lm_loss


def _train_data(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "digits_cnn":
        x, y, _, _ = load_digits_tensors()
        return x, y
    data = markov_data(_LM["vocab"], _LM["seq_len"], n_train=4096, n_test=16)
    return data.x_train, data.y_train


def _snapshot(name: str, steps: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Parameters after ``steps`` steps of FP32 training (one process), a mid-training state."""
    torch.manual_seed(seed)
    model = _new_model(name)
    x, y = _train_data(name)
    loss_fn = _loss_fn(name)
    if name == "digits_cnn":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=0.1 / LOSS_SCALE, momentum=0.9
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(y), (64,), generator=gen)
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _batch(name: str, batch: int, workers: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``workers * micro`` distinct training examples for measurement batch ``batch``."""
    x, y = _train_data(name)
    gen = torch.Generator().manual_seed(7919 * (batch + 1) + workers)
    idx = torch.randperm(len(y), generator=gen)[: workers * micro]
    return x[idx], y[idx]


# ---------------------------------------------------------------------------
# real ranks


class _Capture:
    """State of :func:`_capture_hook`: the wrapped hook and the buckets it saw."""

    def __init__(self, hook: Callable, state: Any) -> None:
        self.hook = hook
        self.state = state
        self.records: list[tuple[int, torch.Tensor, torch.Tensor]] = []


def _capture_hook(state: _Capture, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Keep the raw bucket, run the wrapped hook, keep what it returns."""
    raw = bucket.buffer().detach().clone()
    index = bucket.index()
    # The callback runs, and is freed, on a Gloo worker thread after the waiters wake:
    # holding the state (and through it the process group) there could leave that
    # thread the group's last reference at exit, whose destructor joins the thread
    # itself (std::terminate, "Resource deadlock avoided", seen twice in CI).
    records = state.records

    def keep(fut: torch.futures.Future) -> torch.Tensor:
        out = fut.value()
        records.append((index, raw, out.detach().clone()))
        return out

    return state.hook(state.state, bucket).then(keep)


def _attach(ddp: DDP, cfg: dict[str, str], group: dist.ProcessGroup) -> _Capture:
    if cfg["hook"] == "aps":
        state = APSState(cfg["format"], cfg["reduction"], cfg["scaling"], process_group=group)  # type: ignore[arg-type]
        capture = _Capture(aps_hook, state)
    else:
        hook = {
            "fp32_allreduce": default_hooks.allreduce_hook,
            "fp16_compress": default_hooks.fp16_compress_hook,
            "bf16_compress": default_hooks.bf16_compress_hook,
        }[cfg["hook"]]
        capture = _Capture(hook, group)
    ddp.register_comm_hook(capture, _capture_hook)
    return capture


def _errors(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Relative L2 error, flushed fraction and non-finite count of (output, exact mean) pairs."""
    num = den = 0.0
    flushed = nonzero = nonfinite = 0
    for out, exact in pairs:
        out64 = out.double()
        finite = torch.isfinite(out64)
        nonfinite += int((~finite).sum())
        diff = torch.where(finite, out64 - exact, torch.full_like(exact, float("inf")))
        num += float(diff.pow(2).sum())
        den += float(exact.pow(2).sum())
        nz = exact != 0
        nonzero += int(nz.sum())
        flushed += int((nz & (out64 == 0)).sum())
    return {
        "rel_err": (num / den) ** 0.5 if den else 0.0,
        "flushed": flushed / nonzero if nonzero else 0.0,
        "nonfinite": nonfinite,
    }


def _real_job(rank: int, world_size: int, snapshots: dict, settings: dict) -> list[dict]:
    """Every (model, config) on real ranks; rank 0 returns the rows."""
    torch.set_num_threads(1)
    group = dist.new_group()  # the hooks' group, separate from DDP's
    rows = []
    for name in settings["models"]:
        loss_fn = _loss_fn(name)
        batches = [
            _batch(name, b, world_size, settings["micro_batch"]) for b in range(settings["batches"])
        ]
        for cfg in _configs(settings):
            model = _new_model(name)
            model.load_state_dict(snapshots[name])
            ddp = DDP(model)
            capture = _attach(ddp, cfg, group)
            per_batch = []
            for x, y in batches:
                capture.records.clear()
                model.zero_grad()
                m = settings["micro_batch"]
                loss_fn(ddp(x[rank * m : (rank + 1) * m]), y[rank * m : (rank + 1) * m]).backward()
                pairs = []
                for _, raw, out in sorted(capture.records, key=lambda r: r[0]):
                    everyone = [torch.empty_like(raw) for _ in range(world_size)]
                    dist.all_gather(everyone, raw)
                    pairs.append((out, torch.stack(everyone).double().mean(0)))
                per_batch.append(_errors(pairs))
            rows.append(_row(name, world_size, "real", cfg, per_batch))
    return rows if rank == 0 else []


def _row(name: str, workers: int, mode: str, cfg: dict, per_batch: list[dict]) -> dict:
    return {
        "model": name,
        "workers": workers,
        "mode": mode,
        **cfg,
        "rel_err": sum(e["rel_err"] for e in per_batch) / len(per_batch),
        "flushed": sum(e["flushed"] for e in per_batch) / len(per_batch),
        "nonfinite": sum(e["nonfinite"] for e in per_batch),
        "per_batch": [e["rel_err"] for e in per_batch],
    }


# ---------------------------------------------------------------------------
# simulated workers


def _simulate_torch_hook(grads: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """What fp16/bf16_compress_hook computes on N workers: cast, divide by N in the
    wire dtype, native ring sum in the wire dtype (Gloo's order), back to FP32."""
    n = grads[0].shape[0]
    if n & (n - 1):
        raise ValueError("the simulated compress hooks need a power-of-two N (exact rescaling)")
    fmt = "fp16" if dtype == torch.float16 else "bf16"
    pre = [g.to(dtype).div_(n).float() for g in grads]
    # allreduce multiplies the wire-format sum by 1/N (scaling "none": e = 0);
    # undo it exactly (N is a power of two) to get the plain sum the hook returns.
    return [a * n for a in allreduce(pre, fmt, reduction="ring", scaling="none")]


def _simulated(name: str, snapshot: dict, settings: dict, workers: int) -> list[dict]:
    model = _new_model(name)
    model.load_state_dict(snapshot)
    loss_fn = _loss_fn(name)
    per_cfg: dict[int, list[dict]] = {}
    cfgs = _configs(settings)
    for b in range(settings["batches"]):
        x, y = _batch(name, b, workers, settings["micro_batch"])
        grads, _ = VirtualWorkers(model, workers).worker_grads(loss_fn, x, y)
        exact = [g.double().mean(0) for g in grads]
        for i, cfg in enumerate(cfgs):
            if cfg["hook"] == "fp32_allreduce":
                avg = allreduce(grads, "fp32", reduction="ring", scaling="none")
            elif cfg["hook"] in ("fp16_compress", "bf16_compress"):
                dtype = torch.float16 if cfg["hook"] == "fp16_compress" else torch.bfloat16
                avg = _simulate_torch_hook(grads, dtype)
            else:
                order = "ring" if cfg["reduction"] == "allreduce" else "two_phase"
                avg = allreduce(grads, cfg["format"], reduction=order, scaling=cfg["scaling"])  # type: ignore[arg-type]
            per_cfg.setdefault(i, []).append(_errors(list(zip(avg, exact, strict=True))))
    return [_row(name, workers, "simulated", cfgs[i], per) for i, per in per_cfg.items()]


def _simulated_blocks(name: str, snapshot: dict, settings: dict, workers: int) -> list[dict]:
    """The block-scaling rows at ``workers``, simulated at every N: the hook's two_phase is
    bit for bit ``block32+owner`` (tests/test_block_engine.py); the other two variants
    exist only in the simulator. Then each format and block size's floor
    (:func:`block_floor`) from the same gradients."""
    model = _new_model(name)
    model.load_state_dict(snapshot)
    loss_fn = _loss_fn(name)
    reductions = settings.get("block_reductions", ("two_phase",))
    cfgs = [
        cfg
        for cfg in block_configs(settings["block_formats"], settings["block_sizes"], reductions)
        if _staged_options(cfg["reduction"], workers) is not None
    ]
    floors = [(f, b) for f in settings["block_formats"] for b in settings["block_sizes"]]
    per_cfg: dict[int, list[dict]] = {}
    for b in range(settings["batches"]):
        x, y = _batch(name, b, workers, settings["micro_batch"])
        grads, _ = VirtualWorkers(model, workers).worker_grads(loss_fn, x, y)
        exact = [g.double().mean(0) for g in grads]
        for i, cfg in enumerate(cfgs):
            staged = _staged_options(cfg["reduction"], workers)
            assert staged is not None
            avg = allreduce(grads, cfg["format"], **_block_options(cfg["scaling"]), **staged)
            per_cfg.setdefault(i, []).append(_errors(list(zip(avg, exact, strict=True))))
        for i, (fmt, size) in enumerate(floors, start=len(cfgs)):
            out = block_floor(exact, fmt, size)
            per_cfg.setdefault(i, []).append(_errors(list(zip(out, exact, strict=True))))
    cfgs += [floor_config(fmt, size) for fmt, size in floors]
    return [_row(name, workers, "simulated", cfgs[i], per) for i, per in per_cfg.items()]


# ---------------------------------------------------------------------------
# CLI and output


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; write ``numerics.{json,md}`` to ``--out``.

    Example:
        >>> main(["--batches", "1", "--real-workers", "2", "--sim-workers", "16"])  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--batches", type=int, default=4, help="measurement batches, averaged")
    parser.add_argument("--micro-batch", type=int, default=4, help="examples per worker")
    parser.add_argument("--real-workers", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--sim-workers", type=int, nargs="*", default=[16, 64, 256])
    parser.add_argument(
        "--pretrain-steps", type=int, default=100, help="FP32 steps before the snapshot"
    )
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--scalings", nargs="+", choices=SCALINGS, default=list(SCALINGS))
    parser.add_argument("--torch-hooks", nargs="*", choices=TORCH_HOOKS, default=list(TORCH_HOOKS))
    parser.add_argument(
        "--block-sizes", type=int, nargs="*", default=[], help="block scaling rows (simulated)"
    )
    parser.add_argument(
        "--block-formats", nargs="+", choices=FORMATS, default=["e4m3", "e3m2", "e2m1"]
    )
    parser.add_argument(
        "--block-reductions", nargs="+", choices=BLOCK_REDUCTIONS, default=list(BLOCK_REDUCTIONS)
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("."),
        help="directory for the results (default: the working directory; the committed ones are in benchmarks/results)",
    )
    args = parser.parse_args(argv)
    command = "python -m benchmarks.numerics " + " ".join(sys.argv[1:] if argv is None else argv)
    print(command, flush=True)
    torch.set_num_threads(1)
    start = time.perf_counter()
    settings = {
        "models": args.models,
        "batches": args.batches,
        "micro_batch": args.micro_batch,
        "pretrain_steps": args.pretrain_steps,
        "real_workers": args.real_workers,
        "sim_workers": args.sim_workers,
        "formats": args.formats,
        "scalings": args.scalings,
        "torch_hooks": args.torch_hooks,
        "block_sizes": args.block_sizes,
        "block_formats": args.block_formats,
        "block_reductions": args.block_reductions,
        "loss_scale_digits": LOSS_SCALE,
        "lm": _LM,
    }
    snapshots = {m: _snapshot(m, args.pretrain_steps) for m in args.models}
    rows: list[dict] = []
    for n in args.real_workers:
        t = time.perf_counter()
        rows += run_distributed(_real_job, n, args=(snapshots, settings), timeout=args.timeout)[0]
        print(f"real ranks N={n}: {time.perf_counter() - t:.1f} s", flush=True)
    for name in args.models:
        for n in args.sim_workers:
            t = time.perf_counter()
            rows += _simulated(name, snapshots[name], settings, n)
            print(f"simulated {name} N={n}: {time.perf_counter() - t:.1f} s", flush=True)
        for n in sorted(set(args.real_workers + args.sim_workers)) if args.block_sizes else ():
            t = time.perf_counter()
            rows += _simulated_blocks(name, snapshots[name], settings, n)
            print(f"block scaling {name} N={n}: {time.perf_counter() - t:.1f} s", flush=True)
    result = {
        "command": command,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "backend": "gloo (CPU) for real ranks; aps_comm.simulate for N >= 16",
        },
        "settings": settings,
        "parameters": {m: sum(v.numel() for v in snapshots[m].values()) for m in args.models},
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "numerics.json").write_text(json.dumps(result, indent=1))
    (args.out / "numerics.md").write_text(markdown(result))
    print((args.out / "numerics.md").read_text())
    print(f"wrote {args.out}/numerics.{{json,md}} in {result['seconds']} s")
    return result


def markdown(result: dict) -> str:
    """The results as markdown tables, one per model (also used by :mod:`benchmarks.report`).

    Example:
        >>> text = markdown(json.loads(Path("benchmarks/results/numerics.json").read_text()))  # doctest: +SKIP
    """
    s = result["settings"]
    workers = [("real", n) for n in s["real_workers"]] + [
        ("simulated", n) for n in s["sim_workers"]
    ]
    lines = [
        "# Error of the averaged gradient vs the exact mean",
        "",
        f"`{result['command']}`",
        "",
        "Relative L2 error `||avg - mean|| / ||mean||` over all parameters, mean of "
        f"{s['batches']} batches; each worker's gradient is that of its own {s['micro_batch']} "
        f"examples, at a snapshot after {s['pretrain_steps']} FP32 training steps. "
        f"N = {', '.join(str(n) for n in s['real_workers'])}: real processes (Gloo, real DDP, "
        "the real hook; reference = mean of all ranks' raw buckets). "
        f"N = {', '.join(str(n) for n in s['sim_workers'])}: `aps_comm.simulate.allreduce` "
        "(two_phase = the hook bit for bit; allreduce = Gloo's ring in the wire dtype; the "
        "PyTorch compress hooks = cast, divide by N in the wire dtype, ring sum). "
        "`inf`: the result had non-finite elements. In brackets: the fraction of elements "
        "whose exact mean is non-zero but came back zero (flushed), where above 1%.",
        "",
        f"Machine: {result['machine']['platform']}, {result['machine']['cpus']} CPUs, torch "
        f"{result['machine']['torch']}. Run time {result['seconds']:.0f} s.",
        "",
    ]
    if s.get("block_sizes"):
        lines += [
            "Block scaling rows (simulated at every N; hierarchical: nodes of "
            f"{NODE_RANKS} ranks, from N = {2 * NODE_RANKS}; grid: `aps_comm.topology."
            "grid_rows(N)` rows): `blockB` agrees each "
            "block's exponent across ranks and the owner re-encodes the mean with it; "
            "`+owner`: the owner picks each block's exponent for the mean (the hook's "
            '`block_exponents="agreed"`); `+rank`: each rank encodes with its own block '
            "exponents and the owner picks the mean's (the hook's default; in hierarchical "
            "and grid every level's owner encodes what it forwards with its own exponents "
            "and adds its own contribution unrounded; one chunk per bucket, the hook's "
            "shards). "
            "`exact mean | blockB floor`: the exact mean of the same gradients rounded once "
            "to the format, each block with its own exponent from the mean's block maximum "
            "and no headroom (two_phase's rule for one worker). It is what encoding the true "
            "mean itself flushes: no block exponent flushes less of it, since a larger one "
            "would saturate the block's largest element.",
            "",
        ]
    titles = {
        "digits_cnn": "digits CNN, loss x 2**-10 (gradients of a large network's magnitude)",
        "markov_lm": "transformer LM (Markov chain task), no loss scaling",
    }
    for name in s["models"]:
        params = result["parameters"][name]
        lines += [
            f"## {titles[name]} ({params:,} parameters)",
            "",
            "| hook / format | reduction | scaling | "
            + " | ".join(f"N={n}{'' if mode == 'real' else ' (sim)'}" for mode, n in workers)
            + " |",
            "|---|---|---|" + "---:|" * len(workers),
        ]
        # Each format and block size's variants, then its floor.
        blocks = [
            cfg
            for fmt in s.get("block_formats", ())
            for size in s.get("block_sizes", ())
            for cfg in (
                *block_configs([fmt], [size], s.get("block_reductions", ("two_phase",))),
                floor_config(fmt, size),
            )
        ]
        for cfg in _configs(s) + blocks:
            cells = []
            for mode, n in workers:
                match = [
                    r
                    for r in result["rows"]
                    if r["model"] == name
                    and r["workers"] == n
                    # Block rows are simulated at every N.
                    and (r["mode"] == mode or cfg in blocks)
                    and _label(r) == _label(cfg)
                ]
                cells.append(_cell(match[0]) if match else "-")
            first = cfg["format"] if cfg["hook"] in ("aps", "floor") else f"torch {cfg['hook']}"
            lines.append(
                f"| {first} | {cfg['reduction']} | {cfg['scaling']} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    return "\n".join(lines)


def _cell(row: dict) -> str:
    if row["nonfinite"]:
        return "inf"
    text = f"{row['rel_err']:.2e}"
    if row["flushed"] > 0.01:
        text += f" ({row['flushed']:.0%})"
    return text


if __name__ == "__main__":
    main()
