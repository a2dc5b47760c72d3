"""Crash-and-resume loop: does ``aps-launch --max-restarts`` recover, and resume exactly?

Runs :mod:`benchmarks.resume_train` once uninterrupted, then ``--runs`` times
with one rank crashing at a step between 1 and 8 (alternately ``exit(17)``
and ``SIGKILL``), under ``aps-launch --nproc-per-node N --max-restarts 1``
(or plain ``torchrun --standalone``, ``--launcher torchrun``). A run
recovers when the launcher exits 0 after one restart; it resumes exactly
when the final weights' SHA-256 equals the uninterrupted run's.

    python -m benchmarks.restarts [--runs 20] [--nproc 2] [--launcher aps-launch] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["main", "run"]

_DIGEST = re.compile(r"RESUME-DIGEST ([0-9a-f]{64})")
_TRAIN = ["-m", "benchmarks.resume_train"]


def _launcher(name: str, nproc: int, max_restarts: int = 0) -> list[str]:
    """The launcher's command line up to the training module's ``-m``."""
    common = [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "-m"]
    if name == "aps-launch":
        return [sys.executable, "-m", "aps_launch.cli", *common]
    if name == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *common]
    raise ValueError(f"unknown launcher {name!r}: use 'aps-launch' or 'torchrun'")


def _job(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return out.returncode, out.stdout + out.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() + (exc.stderr or b"").decode()
        return 124, text, time.perf_counter() - start


def run(runs: int = 20, nproc: int = 2, launcher: str = "aps-launch", timeout: float = 180) -> dict:
    """The loop; returns a JSON-able summary with one record per run."""
    base, restarting = _launcher(launcher, nproc), _launcher(launcher, nproc, max_restarts=1)
    train = ["benchmarks.resume_train", "--fixed-buckets", "--steps=10"]
    work = Path(tempfile.mkdtemp(prefix="aps-restarts-"))
    try:
        rc, text, _ = _job([*base, *train, f"--ckpt={work / 'ref'}"], timeout)
        found = _DIGEST.search(text)
        if rc != 0 or found is None:
            raise RuntimeError(f"the uninterrupted run failed (rc {rc}):\n{text[-3000:]}")
        reference = found.group(1)
        records = []
        for i in range(runs):
            crash_at, kill = 1 + i % 8, i % 2 == 1
            cmd = [*restarting, *train, f"--ckpt={work / str(i)}"]
            cmd += [f"--crash-at={crash_at}", *(["--crash-kill"] if kill else [])]
            rc, text, seconds = _job(cmd, timeout)
            found = _DIGEST.search(text)
            record = {
                "run": i,
                "crash_at": crash_at,
                "crash": "SIGKILL" if kill else "exit(17)",
                "returncode": rc,
                "seconds": round(seconds, 2),
                "recovered": rc == 0 and found is not None,
                "bitwise": found is not None and found.group(1) == reference,
            }
            if not record["recovered"]:
                record["tail"] = text[-2000:]
            records.append(record)
            print(
                f"run {i:2d}: crash at step {crash_at} ({record['crash']}), rc {rc}, "
                f"{seconds:.1f} s, recovered {record['recovered']}, bitwise {record['bitwise']}",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "command": "python -m benchmarks.restarts "
        f"--runs {runs} --nproc {nproc} --launcher {launcher}",
        "launcher": launcher,
        "nproc": nproc,
        "runs": runs,
        "recovered": sum(r["recovered"] for r in records),
        "bitwise": sum(r["bitwise"] for r in records),
        "median_seconds": statistics.median(r["seconds"] for r in records) if records else None,
        "reference_digest": reference,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "records": records,
    }


def summary(result: dict) -> str:
    """The one line a run prints: recovered and bit-for-bit counts, median seconds per run.

    Example:
        >>> summary({"launcher": "torchrun", "runs": 20, "recovered": 20, "bitwise": 19,
        ...          "median_seconds": 9.489999999999998})
        'torchrun: 20/20 recovered, 19/20 bitwise equal to the uninterrupted run, median 9.5 s per run'
    """
    median = result["median_seconds"]
    return (
        f"{result['launcher']}: {result['recovered']}/{result['runs']} recovered, "
        f"{result['bitwise']}/{result['runs']} bitwise equal to the uninterrupted run, "
        f"median {'-' if median is None else f'{median:.1f}'} s per run"
    )


def main(argv: list[str] | None = None) -> None:
    """CLI entry: run the loop, print the summary, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--launcher", choices=["aps-launch", "torchrun"], default="aps-launch")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = parser.parse_args(argv)
    result = run(args.runs, args.nproc, args.launcher, args.timeout)
    print(summary(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
