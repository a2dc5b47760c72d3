"""Train three steps with the APS hook and exit without any teardown.

Run by tests/test_faults.py as a world of one (``python exit_check.py``) and
under ``aps-launch``: the process must end with rc 0 every time, as a user's
script that never calls ``destroy_process_group`` does.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import register
from aps_launch import init_distributed

info = init_distributed()
torch.manual_seed(0)
ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
register(ddp, fmt="e4m3")
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    ddp(torch.randn(8, 16)).square().mean().backward()
    opt.step()
print(f"EXIT-OK rank={info.rank}", flush=True)
