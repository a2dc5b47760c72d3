"""Run exit_check.py ``--runs`` times as a world of ``--world``; report every exit status.

Each run forks one process per rank from this one, which has already
imported torch, DDP's compiler stack and aps_comm (5 s per fresh process on
2 cores, 20 runs would not fit a test suite; a forked run takes 0.6 s). The child then runs the script
and leaves through the interpreter's normal shutdown (atexit handlers,
module teardown, C++ static destructors), as ``python exit_check.py`` does.
Prints ``EXIT-LOOP ok=N runs=R`` and one line per failed rank.
"""

from __future__ import annotations

import argparse
import gc
import os
import runpy
import signal
import socket
import sys
from pathlib import Path

import torch  # imported once, before forking
import torch._dynamo  # DDP imports it: the most expensive import

from aps_comm import codec

# Load the codec's compiled kernels once, before forking, as DDP's import is.
_warm = torch.randn(4096)
_layout = codec.Layout.from_numels([1024] * 4, _warm.device)
_scale = torch.ones(4)
_payload = codec.encode(_warm, "e4m3", scale=_scale, layout=_layout)
codec.decode(_payload, "e4m3", _warm.numel(), scale=_scale, layout=_layout)
codec.owner_reduce(_payload, "e4m3", 2)
# What was imported before the fork is left out of the children's garbage
# collections (their shutdown included): a second less per run. Everything the
# script creates (process groups, DDP, the hook's worker, the store) is not.
gc.freeze()

SCRIPT = str(Path(__file__).with_name("exit_check.py"))
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int) -> None:
    for var in _JOB_VARS:
        os.environ.pop(var, None)
    if world > 1:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    sys.argv = [SCRIPT]
    runpy.run_path(SCRIPT, run_name="__main__")
    # Falling off the end of the program: normal interpreter exit.


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--world", type=int, default=1)
    args = parser.parse_args()
    ok = 0
    for run in range(args.runs):
        port = _free_port()
        pids = []
        for rank in range(args.world):
            pid = os.fork()
            if pid == 0:
                _child(rank, args.world, port)
                return 0
            pids.append(pid)
        good = True
        for rank, pid in enumerate(pids):
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                sig = signal.Signals(os.WTERMSIG(status)).name
                print(f"run {run} rank {rank}: killed by {sig}", flush=True)
                good = False
            elif os.WEXITSTATUS(status) != 0:
                print(f"run {run} rank {rank}: rc {os.WEXITSTATUS(status)}", flush=True)
                good = False
        ok += good
    print(f"EXIT-LOOP ok={ok} runs={args.runs}", flush=True)
    return 0 if ok == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
