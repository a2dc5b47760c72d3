"""Train two steps with the APS hook under ``init_distributed``, then end as ``argv[1]`` says.

Run by tests/test_exits.py as a world of one. Modes: ``ok`` falls off the
end, ``raise`` leaves with an uncaught exception, ``exit3`` calls
``sys.exit(3)``. Every ``dist.destroy_process_group`` call at exit prints
``DESTROY default`` or ``DESTROY group worker_alive=<bool>``, so the test
sees the order of the teardown: the hook's worker stops, then its groups
go, then ``init_distributed``'s default group.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import register
from aps_launch import init_distributed

mode = sys.argv[1]
init_distributed()
torch.manual_seed(0)
ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
state = register(ddp, fmt="e4m3")
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad()
    ddp(torch.randn(8, 16)).square().mean().backward()
    opt.step()
workers = [t for t in threading.enumerate() if t.name.startswith("aps-comm-")]
assert workers, "the hook's worker never started"
destroy = dist.destroy_process_group


def logged(group: dist.ProcessGroup | None = None) -> None:
    if group is None:
        print("DESTROY default", flush=True)
    else:
        print(f"DESTROY group worker_alive={any(w.is_alive() for w in workers)}", flush=True)
    destroy(group)


dist.destroy_process_group = logged
print(f"TRAINED mode={mode}", flush=True)
if mode == "raise":
    raise RuntimeError("the job failed after training")
if mode == "exit3":
    sys.exit(3)
