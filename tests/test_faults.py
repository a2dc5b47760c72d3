"""A failing peer makes every other rank fail fast; a finished job exits cleanly.

Ranks are started independently, as on separate nodes: no launcher kills the
survivors. Each is its own process in its own session, forked from a starter
that has imported torch once (tests/launch_scripts/preloaded.py: the ranks
run the script as ``python script`` would, the starter only reaps them), and
they join through ``init_distributed`` and rank 0's store with a 5 s
process-group timeout. One rank fails on purpose
(tests/launch_scripts/fault_train.py); every other rank must exit non-zero
within the timeout plus slack, with the hook's collective named, and nothing
of the job's may be left behind: no process, no /dev/shm entry. Only what the
test itself started is checked, never the whole machine's state: other jobs
on a shared machine come and go meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Starter

from aps_comm.testing import run_distributed
from benchmarks import resume_train

SCRIPTS = Path(__file__).parent / "launch_scripts"
PG_TIMEOUT = 5.0
# The survivors' deadline counts from the fault, so slack covers only error
# handling and exit.
SLACK = 15.0
_JOB_VARS = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*)$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _JOB_VARS.match(k)}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _env(rank: int, world: int, port: int) -> dict[str, str]:
    env = _clean_env()
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return env


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _in_sessions(sids: list[int]) -> list[int]:
    """Processes in any of these sessions: what a rank (a session leader) left running."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses.
        if int(stat.rsplit(")", 1)[1].split()[3]) in sids:
            found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def starter() -> Iterator[Starter]:
    started = Starter(SCRIPTS / "preloaded.py", _clean_env())
    try:
        yield started
    finally:
        started.close()


# Every fault with one survivor, but the two that leave no Python exit path (a
# rank killed, a rank that stalls) with three: in the hook's all-to-all each of
# them waits on the faulty rank directly, as a lone survivor would, so the
# one-survivor runs of these two would test nothing more.
CASES = [
    (2, "exit-before-backward", 0),
    (2, "exit-in-backward", 1),
    (2, "exit-in-hook", 1),
    (4, "kill-in-hook", 1),
    (4, "stall", 1),
]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "fault", "at_step"), CASES)
def test_peer_failure_fails_survivors_within_timeout(
    tmp_path: Path, starter: Starter, world: int, fault: str, at_step: int
) -> None:
    shm = _shm()
    port, mark, fault_rank = _free_port(), tmp_path / "fault_time", world - 1
    args = [
        f"--fault={fault}",
        f"--fault-rank={fault_rank}",
        f"--at-step={at_step}",
        f"--timeout={PG_TIMEOUT}",
        f"--mark={mark}",
    ]
    pids = starter.start(
        [
            {
                "script": str(SCRIPTS / "fault_train.py"),
                "args": args,
                "env": _env(rank, world, port),
                "log": str(tmp_path / f"rank{rank}.log"),
            }
            for rank in range(world)
        ]
    )
    survivors = [pid for r, pid in enumerate(pids) if r != fault_rank]
    exited: dict[int, tuple[int, float]] = {}
    try:
        for pid, code, when in starter.exits(120):
            exited[pid] = (code, when)
            if all(p in exited for p in survivors):
                break
    finally:
        # Not reaped yet, so still ours: a pid reaped meanwhile was reported (and is skipped).
        for pid, code, when in starter.exits(0):
            exited[pid] = (code, when)
        for pid in set(pids) - exited.keys():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid, code, when in starter.exits(30):
            exited[pid] = (code, when)
    logs = {r: (tmp_path / f"rank{r}.log").read_text() for r in range(world)}
    assert set(pids) <= exited.keys(), f"ranks still running after 30 s more: {logs}"
    assert mark.exists(), f"the faulty rank never reached its fault: {logs}"
    fault_time = float(mark.read_text())
    for r, pid in enumerate(pids):
        if r == fault_rank:
            continue
        log = logs[r]
        code, when = exited[pid]
        assert code != 0, f"rank {r} exited {code}:\n{log}"
        assert "FAULT-DONE" not in log, log
        took = when - fault_time
        assert took < PG_TIMEOUT + SLACK, f"rank {r} took {took:.1f} s after the fault:\n{log}"
        # The error is the hook's own (not DDP's "Unable to cast ... to Tensor")
        # and says which of its collectives was waiting (torch prefixes the
        # lines of an uncaught exception with the rank).
        assert re.search(
            r"^(\[rank\d+\]: )?RuntimeError: aps_hook, bucket \d+: aps_comm: the (MAX all-reduce|all_to_all|"
            r"all_gather) .*did not complete",
            log,
            re.M,
        ), log
        assert "terminate called" not in log, log
    assert _in_sessions(pids) == [], "a rank's process outlived the test"
    # Only entries named after one of this job's processes are its own (other
    # programs on the machine may come and go meanwhile).
    left = {e for e in _shm() - shm if any(str(pid) in e for pid in pids)}
    assert not left, f"left in /dev/shm: {left}"


def _uninterrupted(rank: int, world_size: int, ckpt: str) -> str:
    return resume_train.train(["--fixed-buckets", "--steps=6", f"--ckpt={ckpt}"])


@pytest.mark.slow
def test_crash_and_resume_is_bitwise_the_uninterrupted_run(tmp_path: Path) -> None:
    """aps-launch --max-restarts recovers from a kill -9 and the resumed run is exact.

    benchmarks/resume_train.py is the README's recipe (per-rank checkpoints of
    model, optimizer and APS state, error feedback on); with DDP's bucket
    layout fixed the resumed weights equal the uninterrupted run's bit for bit.
    The uninterrupted run is the same training on ranks forked from the test's
    fork server (torch imported once, not by a launcher and two ranks): only
    the crashing run needs the launcher.
    """
    ref = run_distributed(_uninterrupted, 2, args=(str(tmp_path / "ref"),), timeout=180)
    assert ref[0] == ref[1], ref
    root = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        "-m",
        "aps_launch.cli",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "benchmarks.resume_train",
        "--fixed-buckets",
        "--steps=6",
        f"--ckpt={tmp_path / 'crash'}",
        "--crash-at=3",
        "--crash-kill",
    ]
    out = subprocess.run(
        cmd, cwd=root, env=_clean_env(), capture_output=True, text=True, timeout=180
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "rank 1: crashing at step 3" in log and "resumed at step 3" in log, log
    found = re.search(r"RESUME-DIGEST ([0-9a-f]{64})", log)
    assert found, log
    assert found.group(1) == ref[0]
