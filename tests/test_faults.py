"""A failing peer makes every other rank fail fast; a finished job exits cleanly.

Ranks are started independently (one ``python`` per rank, joined through
``init_distributed`` and rank 0's store, as on separate nodes: no launcher
kills the survivors), with a 5 s process-group timeout. One rank fails on
purpose (tests/launch_scripts/fault_train.py); every other rank must exit
non-zero within the timeout plus slack, with the hook's collective named, and
nothing of the job's may be left behind: no process, no /dev/shm entry.
Only what the test itself started is checked, never the whole machine's
state: other jobs on a shared machine come and go meanwhile.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aps_comm.testing import run_distributed
from benchmarks import resume_train

SCRIPTS = Path(__file__).parent / "launch_scripts"
PG_TIMEOUT = 5.0
# Python and torch start in ~5 s per process on 2 busy cores; the survivors'
# deadline counts from the fault, so slack covers only error handling and exit.
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


def _pids_with(token: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline:
            found.append(int(pid))
    return found


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
    tmp_path: Path, world: int, fault: str, at_step: int
) -> None:
    shm = _shm()
    port, mark, fault_rank = _free_port(), tmp_path / "fault_time", world - 1
    cmd = [
        sys.executable,
        str(SCRIPTS / "fault_train.py"),
        f"--fault={fault}",
        f"--fault-rank={fault_rank}",
        f"--at-step={at_step}",
        f"--timeout={PG_TIMEOUT}",
        f"--mark={mark}",
    ]
    procs = []
    for rank in range(world):
        out = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        procs.append(
            (
                subprocess.Popen(
                    cmd, env=_env(rank, world, port), stdout=out, stderr=subprocess.STDOUT
                ),
                out,
            )
        )
    survivors = [p for r, (p, _) in enumerate(procs) if r != fault_rank]
    exited: dict[int, float] = {}
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and len(exited) < len(survivors):
            for p in survivors:
                if p.pid not in exited and p.poll() is not None:
                    exited[p.pid] = time.time()
            time.sleep(0.05)
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(30)
            out.close()
    logs = {r: (tmp_path / f"rank{r}.log").read_text() for r in range(world)}
    assert len(exited) == len(survivors), f"survivors still running after 120 s: {logs}"
    assert mark.exists(), f"the faulty rank never reached its fault: {logs}"
    fault_time = float(mark.read_text())
    for r, (p, _) in enumerate(procs):
        if r == fault_rank:
            continue
        log = logs[r]
        assert p.returncode not in (0, None), f"rank {r} exited {p.returncode}:\n{log}"
        assert "FAULT-DONE" not in log, log
        took = exited[p.pid] - fault_time
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
    assert _pids_with(str(mark)) == [], "a rank's process outlived the test"
    # Only entries named after one of this job's processes are its own (other
    # programs on the machine may come and go meanwhile).
    pids = [str(p.pid) for p, _ in procs]
    left = {e for e in _shm() - shm if any(pid in e for pid in pids)}
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
