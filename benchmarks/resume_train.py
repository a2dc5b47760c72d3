"""A small deterministic DDP + APS job that checkpoints every step and resumes.

It is the resume recipe of docs/launching-and-restarts.md as a script, and the worker that
:mod:`benchmarks.restarts` crashes and restarts: every rank trains the same
MLP on its own seeded batches with ``register(ddp, fmt, error_feedback=True)``,
writes ``{model, optimizer, APS state, step}`` to its own file after every
step (error-feedback residuals differ per rank), and on start resumes from
the newest complete checkpoint. ``--crash-at S`` makes ``--crash-rank`` exit
with code 17 (or SIGKILL itself with ``--crash-kill``) at the start of step S in the first attempt only
(``TORCHELASTIC_RESTART_COUNT == 0``), so ``aps-launch --max-restarts 1``
must recover. Rank 0 prints ``RESUME-DIGEST <sha256 of the final weights>``.

Example:
    ``aps-launch --nproc-per-node 2 --max-restarts 1 benchmarks/resume_train.py
    --ckpt /tmp/ck --crash-at 5``
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import register
from aps_launch import init_distributed

__all__ = ["main", "train"]

CRASH_CODE = 17


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _save(path: Path, payload: dict) -> None:
    # Write then rename, so a rank killed mid-save leaves the previous file.
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def digest(module: nn.Module) -> str:
    """SHA-256 of a module's parameters' bytes, in order.

    Example:
        >>> len(digest(nn.Linear(2, 2)))
        64
    """
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    """Train ``--steps`` steps, checkpointing each, resuming from ``--ckpt``."""
    final = train(argv)
    if dist.get_rank() == 0:
        print(f"RESUME-DIGEST {final}", flush=True)
    dist.destroy_process_group()


def train(argv: list[str] | None = None) -> str:
    """:func:`main`'s job without the report and the teardown: the final weights' digest.

    A process group already initialised (a test's ranks) is used as it is; the
    caller destroys it.

    Example:
        >>> train(["--ckpt", "ck", "--steps", "2"])  # on every rank of a job  # doctest: +SKIP
        '8784fe74...'
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fmt", default="e4m3")
    parser.add_argument(
        "--no-error-feedback", action="store_true", help="register without error feedback"
    )
    parser.add_argument(
        "--fixed-buckets",
        action="store_true",
        help="find_unused_parameters=True: DDP keeps its first bucket layout, so a resumed "
        "run's two_phase shard owners (and their error-feedback residuals) are the same",
    )
    parser.add_argument("--crash-at", type=int, default=None, help="step to crash at, once")
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument(
        "--crash-kill", action="store_true", help="crash with SIGKILL (like kill -9), not exit"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="process group timeout (s)")
    args = parser.parse_args(argv)

    info = init_distributed(timeout=datetime.timedelta(seconds=args.timeout))
    ddp = DDP(_model(), find_unused_parameters=args.fixed_buckets)
    state = register(ddp, fmt=args.fmt, error_feedback=not args.no_error_feedback)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    # --- the resume recipe (docs/launching-and-restarts.md) ---
    args.ckpt.mkdir(parents=True, exist_ok=True)
    mine = args.ckpt / f"rank{info.rank}.pt"
    start = 0
    if mine.exists():
        ckpt = torch.load(mine, weights_only=False)
        ddp.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state.load_state_dict(ckpt["aps"])
        start = ckpt["step"]
    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(info.world_size)]
    dist.all_gather(steps, torch.tensor([start]))
    if len({int(s) for s in steps}) != 1:
        raise RuntimeError(f"ranks resume from different steps: {[int(s) for s in steps]}")
    if start:
        print(f"rank {info.rank}: resumed at step {start}", flush=True)

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(start, args.steps):
        if step == args.crash_at and attempt == 0 and info.rank == args.crash_rank:
            print(f"rank {info.rank}: crashing at step {step}", flush=True)
            if args.crash_kill:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(CRASH_CODE)
        x, y = _batch(step, info.rank)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        payload = {
            "model": ddp.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "aps": state.state_dict(),
            "step": step + 1,
        }
        _save(mine, payload)
        # Every rank's checkpoint of this step exists before any rank moves
        # on, so a crash in the next step finds them all at the same step.
        dist.barrier()
    return digest(ddp.module)


if __name__ == "__main__":
    main()
