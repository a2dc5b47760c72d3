"""Train with the APS hook while one rank fails on purpose.

Run by tests/test_faults.py, one process per rank started independently (as
on separate nodes: no launcher watches them), joined through
``init_distributed`` with a short process-group timeout. The faulty rank
writes the time of its fault to ``--mark`` just before it:

    exit-before-backward  exits after the forward pass of ``--at-step``
    exit-in-backward      exits while backward runs (some buckets already handed to the hook)
    exit-in-hook          exits right after issuing the hook's first all_to_all
    kill-in-hook          SIGKILLs itself there (like ``kill -9``)
    stall                 sleeps for ``--stall`` seconds before backward

Every other rank must raise within the timeout and exit non-zero.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import register
from aps_launch import init_distributed

FAULTS = ("exit-before-backward", "exit-in-backward", "exit-in-hook", "kill-in-hook", "stall")

parser = argparse.ArgumentParser()
parser.add_argument("--fault", choices=FAULTS, required=True)
parser.add_argument("--fault-rank", type=int, default=1)
parser.add_argument("--at-step", type=int, default=1)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--timeout", type=float, default=5.0)
parser.add_argument("--stall", type=float, default=120.0)
parser.add_argument("--mark", type=Path, required=True)
args = parser.parse_args()

info = init_distributed(timeout=datetime.timedelta(seconds=args.timeout))
faulty = info.rank == args.fault_rank
step = 0


def fault() -> None:
    args.mark.write_text(f"{time.time()}\n")
    if args.fault == "kill-in-hook":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.fault == "stall":
        time.sleep(args.stall)
    os._exit(3)


if faulty and args.fault in ("exit-in-hook", "kill-in-hook"):
    real_all_to_all = dist.all_to_all_single

    def all_to_all_then_fault(*a, **kw):
        work = real_all_to_all(*a, **kw)
        if step == args.at_step:
            fault()
        return work

    dist.all_to_all_single = all_to_all_then_fault

torch.manual_seed(0)
layers = [nn.Linear(256, 256) for _ in range(4)]
model = nn.Sequential(*layers)
if faulty and args.fault == "exit-in-backward":
    # Runs when backward reaches the second layer: the last layers' buckets
    # are already with the hook.
    layers[1].register_full_backward_pre_hook(
        lambda m, g: fault() if step == args.at_step else None
    )
ddp = DDP(model, bucket_cap_mb=0.25)
register(ddp, fmt="e4m3")
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
for step in range(args.steps):
    opt.zero_grad()
    loss = ddp(torch.randn(32, 256)).square().mean()
    if faulty and step == args.at_step and args.fault in ("exit-before-backward", "stall"):
        fault()
    loss.backward()
    opt.step()
print(f"FAULT-DONE rank={info.rank}", flush=True)
