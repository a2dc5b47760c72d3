"""Join the job with init_distributed, all-reduce, check the sum, report.

Run by tests/test_launch.py under every launcher. Prints one line per rank:
``APS-OK rank=R world=W local=L backend=B source=S sum=X``.

Options:
    --fail-rank R      rank R exits with code 3 after the all-reduce.
    --check-loopback   fail if joining the job made this process (or, under the
                       elastic agent, the agent) listen on a TCP socket outside
                       loopback. MPI's own listeners (opened by MPI_Init, before
                       the baseline) are not ours to judge.
    --world W          fail unless the world size is W.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from aps_launch import init_distributed

_LISTEN = "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _is_loopback_hex(addr: str) -> bool:
    if len(addr) == 8:  # IPv4, little-endian hex: 127.x.x.x ends in 7F
        return addr[6:8] == "7F"
    return addr == "00000000000000000000000001000000"  # ::1


def _non_loopback_listeners(pids: list[int]) -> list[str]:
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                host = local.split(":")[0]
                if state == _LISTEN and inode in inodes and not _is_loopback_hex(host):
                    found.append(f"{table}:{local}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--check-loopback", action="store_true")
    parser.add_argument("--world", type=int, default=0)
    opts = parser.parse_args()

    baseline: set[str] = set()
    check = opts.check_loopback and os.path.exists("/proc/net/tcp")
    if check:
        if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
            from mpi4py import MPI  # noqa: F401  (MPI_Init opens MPI's own sockets)
        baseline = set(_non_loopback_listeners([os.getpid()]))

    info = init_distributed()
    if init_distributed() is not info:
        raise AssertionError("init_distributed is not idempotent")
    if dist.get_rank() != info.rank or dist.get_world_size() != info.world_size:
        raise AssertionError(f"{info} disagrees with torch.distributed")
    if opts.world and info.world_size != opts.world:
        raise AssertionError(f"world size {info.world_size}, expected {opts.world}")

    t = torch.full((4,), float(info.rank + 1))
    dist.all_reduce(t)
    expected = info.world_size * (info.world_size + 1) / 2
    if not torch.equal(t, torch.full((4,), expected)):
        raise AssertionError(f"rank {info.rank}: all_reduce gave {t.tolist()}, want {expected}")

    if check:
        pids = [os.getpid()]
        if "TORCHELASTIC_RUN_ID" in os.environ:
            pids.append(os.getppid())  # the elastic agent hosts the store
        # The store may predate the baseline (aps-launch --mpi/--slurm start it
        # before the script), so anything on MASTER_PORT counts as well.
        store_port = f":{int(os.environ.get('MASTER_PORT', '0')):04X}"
        leaks = sorted(
            entry
            for entry in _non_loopback_listeners(pids)
            if entry not in baseline or entry.endswith(store_port)
        )
        if leaks:
            raise AssertionError(f"rank {info.rank} listens outside loopback: {leaks}")

    # One write per line: with print() the text and its newline are two writes,
    # and two ranks sharing a pipe can interleave between them.
    sys.stdout.write(
        f"APS-OK rank={info.rank} world={info.world_size} local={info.local_rank} "
        f"backend={dist.get_backend()} aps_backend={os.environ.get('APS_BACKEND', '-')} "
        f"sum={t[0].item():g}\n"
    )
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 3 if info.rank == opts.fail_rank else 0


if __name__ == "__main__":
    sys.exit(main())
