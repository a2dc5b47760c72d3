"""Clean exits: do 2-rank DDP jobs on Gloo end with exit code 0, and nothing to worry about?

Runs ``--runs`` jobs (2 ranks, Gloo on CPU) of each launch style and records
every job's exit code and whether it printed a warning at exit:

- ``readme+torchrun``: the README's DDP script (its "Train with torchrun"
  block, read from README.md, ending with ``dist.destroy_process_group()``),
  saved as ``train_ddp.py`` in a scratch folder and run as the README says,
  ``torchrun --standalone --nproc-per-node 2 train_ddp.py``;
- ``readme+aps-launch``: the same script under ``aps-launch --nproc-per-node 2``;

and tiny jobs (a small MLP, three DDP steps, no teardown in the script):

- ``aps-launch``: ``aps-launch --nproc-per-node 2`` with ``init_distributed`` + ``register``;
- ``torchrun+init_distributed``: ``torchrun`` with ``aps_launch.init_distributed`` + ``register``;
- ``torchrun+init_process_group``: ``torchrun`` with ``dist.init_process_group`` + ``register``;
- ``torchrun+init_process_group, teardown off`` (the control): the same job with
  ``aps_comm.teardown.release_at_exit`` replaced by a no-op before ``register``;
- ``torchrun+plain-ddp`` (the baseline): ``torchrun`` with ``dist.init_process_group``
  and DDP's own all-reduce, no aps-comm imported.

A run is *ok* when the launcher exits 0 and nothing was printed at exit (an
``aps_comm:`` message about the exit, or ``terminate called``); a *warning at
exit* when it exits 0 with such a message; an *abort at exit* when every rank
printed its result and a rank then died of SIGABRT ("terminate called without
an active exception"); anything else is a *failure*. Writes JSON (one record
per run) and a markdown table of the counts.

    python -m benchmarks.exits --runs 200 --out benchmarks/results/exits.json
    python -m benchmarks.exits --styles readme+torchrun readme+aps-launch \\
        --runs 200 --max-seconds 600 --out benchmarks/results/exits_readme.json

The jobs run in rounds, ``--per-round`` jobs of each style at a time side by
side, so every style sees the same load. ``--lock PATH`` takes an exclusive ``flock``
on PATH around each round, so timing runs of other programs that use the same
lock interleave with this long loop instead of waiting for all of it. The
results are rewritten after every round; ``--max-seconds`` starts no round
after that many seconds (the results say how many runs fitted). Run as
``python -m benchmarks.exits --job STYLE`` under a launcher, it is the job.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["STYLES", "main", "run", "scrub"]

ROOT = Path(__file__).resolve().parents[1]
# Style -> (launcher, the job's way of joining and whether it registers the hook).
STYLES: dict[str, tuple[str, str]] = {
    "readme+torchrun": ("torchrun", "readme"),
    "readme+aps-launch": ("aps-launch", "readme"),
    "aps-launch": ("aps-launch", "init_distributed"),
    "torchrun+init_distributed": ("torchrun", "init_distributed"),
    "torchrun+init_process_group": ("torchrun", "init_process_group"),
    "torchrun+init_process_group, teardown off": ("torchrun", "no_teardown"),
    "torchrun+plain-ddp": ("torchrun", "plain"),
}
_JOBS = ("init_distributed", "init_process_group", "no_teardown", "plain")
_BASELINES = ("no_teardown", "plain")
# What a finished rank prints: the tiny job's line, or the README script's.
_DONE = re.compile(r"EXIT-OK rank=(\d+)|^rank (\d+): \d+ steps", re.M)
_ABORT = re.compile(r"terminate called|SIGABRT|exitcode\s*:\s*-6")
# What a job that finished must not print on its way out.
_AT_EXIT = re.compile(r"aps_comm: .*at exit|terminate called")
# Lines worth keeping from a failed job's output, wherever they are in it.
_NOTE = re.compile(r"terminate called|aps_comm:|Error|exitcode")
# The script that the README's "Train with torchrun" section saves as train_ddp.py.
_README_SCRIPT = "train_ddp.py"
_JOB_VARS = re.compile(
    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|APS_BACKEND"
    r"|TORCHELASTIC_.*|GROUP_.*|ROLE_.*)$"
)
_WORLD = 2


def _job(kind: str) -> None:
    """One rank of a tiny job: join, three DDP steps, print, fall off the end."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    if kind == "init_distributed":
        from aps_launch import init_distributed

        rank = init_distributed().rank
    else:
        dist.init_process_group()  # as most scripts write it: Gloo for CPU tensors
        rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    if kind != "plain":
        from aps_comm import register, teardown

        skipped: list = []
        if kind == "no_teardown":
            # The control: the same job with the exit teardown left out.
            teardown.release_at_exit = skipped.append
        register(ddp, fmt="e4m3")
        assert skipped or kind != "no_teardown", "register no longer calls the teardown"
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(8, 16)).square().mean().backward()
        opt.step()
    print(f"EXIT-OK rank={rank}", flush=True)
    # No teardown: the script ends as most training scripts do.


def readme_script(readme: Path = ROOT / "README.md") -> str:
    """The README's complete DDP script: the Python block the README saves as train_ddp.py.

    Example:
        >>> "dist.destroy_process_group()" in readme_script()
        True
    """
    text = readme.read_text()
    marker = text.index(f"Saved as `{_README_SCRIPT}`")
    blocks = re.findall(r"```python\n(.*?)```", text[:marker], re.S)
    if not blocks:
        raise ValueError(f"no python block before 'Saved as `{_README_SCRIPT}`' in {readme}")
    return blocks[-1]


def _command(style: str) -> list[str]:
    launcher, kind = STYLES[style]
    job = ["-m", "benchmarks.exits", "--job", kind]
    if kind == "readme":
        job = [_README_SCRIPT]
    if launcher == "aps-launch":
        return [sys.executable, "-m", "aps_launch.cli", f"--nproc-per-node={_WORLD}", *job]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={_WORLD}", *job]  # fmt: skip


@contextlib.contextmanager
def _locked(path: str | None) -> Iterator[None]:
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _classify(rc: int, log: str) -> str:
    """``ok``, ``warning_at_exit``, ``abort_at_exit`` or ``failure`` (see the module's docstring).

    Example:
        >>> _classify(0, "rank 0: 50 steps\\nrank 1: 50 steps\\n")
        'ok'
        >>> _classify(0, "aps_comm: 1 process group(s) still referenced at exit; ...")
        'warning_at_exit'
    """
    if rc == 0:
        return "warning_at_exit" if _AT_EXIT.search(log) else "ok"
    finished = {int(a or b) for a, b in _DONE.findall(log)} == set(range(_WORLD))
    return "abort_at_exit" if finished and _ABORT.search(log) else "failure"


def _env(style: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _JOB_VARS.match(k)}
    if STYLES[style][1] != "readme":
        # The tiny jobs are this module; the README's script imports what is
        # installed, as a user's does.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _round(styles: list[str], timeout: float) -> list[tuple[str, int, str, float]]:
    """One job of each style, all at once: (style, exit code, output, seconds).

    The README's script runs in a scratch folder of its own, as a user's
    would; the tiny jobs in the repository (they are this module).
    """
    start = time.perf_counter()
    with contextlib.ExitStack() as scratch:
        procs = []
        for style in styles:
            cwd = ROOT
            if STYLES[style][1] == "readme":
                cwd = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="aps-exits-")))
                (cwd / _README_SCRIPT).write_text(readme_script())
            procs.append((style, subprocess.Popen(
                _command(style), cwd=cwd, env=_env(style), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True,
            )))  # fmt: skip
        done = []
        for style, proc in procs:
            try:
                left = timeout - (time.perf_counter() - start)
                log, _ = proc.communicate(timeout=max(1.0, left))
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                proc.kill()
                log, rc = proc.communicate()[0], 124
            done.append((style, rc, log, time.perf_counter() - start))
    return done


def run(
    runs: dict[str, int],
    timeout: float = 300,
    lock: str | None = None,
    on_round: Callable[[dict], None] | None = None,
    per_round: int = 1,
    one_at_a_time: bool = False,
    max_seconds: float | None = None,
) -> dict:
    """``runs[style]`` jobs of each style, in rounds of ``per_round`` concurrent jobs per style.

    Running the styles side by side gives every style the same machine load.
    Returns ``{style: summary}``, each with one record per job; ``on_round``
    gets that after every round. No round starts after ``max_seconds``.

    Example:
        >>> run({"torchrun+plain-ddp": 1})["torchrun+plain-ddp"]["runs"]  # doctest: +SKIP
        1
    """
    if per_round < 1:
        raise ValueError(f"per_round must be >= 1, got {per_round}")
    for style, n in runs.items():
        if style not in STYLES:
            raise ValueError(f"unknown style {style!r}; choose from {sorted(STYLES)}")
        if n < 0:
            raise ValueError(f"runs for {style!r} must be >= 0, got {n}")
    records: dict[str, list[dict]] = {s: [] for s in runs}
    summary: dict = {}
    began = time.monotonic()
    while True:
        pending = [
            s for s in runs for _ in range(min(per_round, runs[s] - len(records[s])))
        ]  # fmt: skip
        if not pending or (max_seconds is not None and time.monotonic() - began > max_seconds):
            return summary
        with _locked(lock):
            if one_at_a_time:
                finished = [job for s in pending for job in _round([s], timeout)]
            else:
                finished = _round(pending, timeout)
        for style, rc, log, seconds in finished:
            outcome = _classify(rc, log)
            record = {"run": len(records[style]), "rc": rc, "outcome": outcome,
                      "seconds": round(seconds, 2)}  # fmt: skip
            if outcome != "ok":
                record["log_tail"] = scrub(log[-1500:])
                record["notes"] = [scrub(line) for line in log.splitlines() if _NOTE.search(line)][
                    :20
                ]
            records[style].append(record)
            print(f"{style} run {record['run']}: rc {rc} {outcome} {seconds:.1f} s", flush=True)
        summary = {s: _summary(s, records[s]) for s in runs if records[s]}
        if on_round is not None:
            on_round(summary)


def _summary(style: str, records: list[dict]) -> dict:
    counts = Counter(r["outcome"] for r in records)
    return {
        "style": style,
        "command": " ".join(_command(style)[1:]),
        "runs": len(records),
        "ok": counts["ok"],
        "warning_at_exit": counts["warning_at_exit"],
        "abort_at_exit": counts["abort_at_exit"],
        "failure": counts["failure"],
        "exit_codes": dict(sorted(Counter(str(r["rc"]) for r in records).items())),
        "records": records,
    }


def scrub(text: str) -> str:
    """``text`` without this machine's paths and host name (they stay out of the results).

    Example:
        >>> scrub(f"{ROOT}/benchmarks/exits.py") == "<repo>/benchmarks/exits.py"
        True
    """
    for path, name in (
        (sys.prefix, "<venv>"),
        (str(ROOT), "<repo>"),
        (sys.base_prefix, "<python>"),
        (tempfile.gettempdir(), "<tmp>"),
    ):
        text = text.replace(path, name)
    return re.sub(rf"\b{re.escape(socket.gethostname())}\b", "<host>", text)


def _shown(argv: list[str]) -> str:
    """The command line as run, without ``--lock`` (a path on the machine that ran it)."""
    shown, skip = ["python -m benchmarks.exits"], False
    for arg in argv:
        if skip or arg.startswith("--lock"):
            skip = arg == "--lock"
            continue
        shown.append(arg)
    return " ".join(shown)


def markdown(result: dict) -> str:
    """The counts as a markdown table; results recorded before warnings were counted say so."""
    config, styles = result["config"], result["styles"]
    readme = [s for s in styles if STYLES[s][1] == "readme"]
    tiny = [s for s in styles if STYLES[s][1] != "readme"]
    jobs = []
    if readme:
        jobs.append(
            "the README's DDP script (a 16-64-1 MLP, 50 steps, ending with "
            "`dist.destroy_process_group()`) in a scratch folder"
        )
    if tiny:
        jobs.append("a tiny job (a 16-32-4 MLP, 3 DDP steps, no teardown in the script)")
    stopped = config.get("max_seconds")
    lines = [
        "# Clean exits: 2-rank DDP jobs on Gloo (CPU)",
        "",
        f"torch {config['torch']}, Python {config['python']}, {config['cpus']} CPUs; "
        f"each job: 2 ranks, {' or '.join(jobs)}; rounds of "
        f"{config['jobs_per_style_per_round']} job(s) of each style, "
        + ("run one after another" if config.get("one_at_a_time") else "side by side")
        + ", on a machine shared with other work"
        + (f", no round started after {stopped:g} s" if stopped else "")
        + f". Command: `{config['command']}`."
        + (f" {config['note']}" if config.get("note") else ""),
        "",
        "| style | runs | exit 0 | exit 0 with a warning at exit | aborts at exit (SIGABRT) "
        "| other failures |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in styles.values():
        # Recorded before warnings were counted: "ok" meant exit 0, whatever it printed.
        warned = s.get("warning_at_exit")
        exit0 = s["ok"] + (warned or 0)
        shown = "not counted" if warned is None else str(warned)
        lines.append(
            f"| {s['style']} | {s['runs']} | {exit0} | {shown} | {s['abort_at_exit']} "
            f"| {s['failure']} |"
        )
    lines += [
        "",
        "A warning at exit: the job exited 0 but printed an `aps_comm:` message about",
        "its exit (or `terminate called`) on its way out. An abort at exit: every rank",
        "printed its result, then a rank died of SIGABRT (`terminate called without an",
        "active exception`) during interpreter shutdown; the launcher reports the job",
        "FAILED. The control is the hook without its exit teardown; the baseline is",
        "torch's own DDP all-reduce without aps-comm (see `aps_comm/teardown.py` for",
        "the cause).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", choices=_JOBS, help="run as one rank of a job (internal)")
    parser.add_argument("--runs", type=int, default=200, help="jobs per aps-comm style")
    parser.add_argument(
        "--baseline-runs", type=int, default=None, help="jobs per baseline style (default: --runs)"
    )
    parser.add_argument("--styles", nargs="+", choices=sorted(STYLES), default=list(STYLES))
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job")
    parser.add_argument("--lock", default=None, help="flock this file around each round")
    parser.add_argument("--per-round", type=int, default=1, help="jobs of each style per round")
    parser.add_argument(
        "--one-at-a-time", action="store_true", help="run a round's jobs one after another"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/exits.json")
    parser.add_argument(
        "--keep", action="store_true", help="keep the styles already in --out that are not run"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=None, help="start no round after this many seconds"
    )
    args = parser.parse_args(argv)
    if args.job:
        _job(args.job)
        return 0
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    baseline_runs = args.runs if args.baseline_runs is None else args.baseline_runs
    import torch

    kept: dict = {}
    if args.keep and args.out.exists():
        kept = json.loads(args.out.read_text())["styles"]
        kept = {k: v for k, v in kept.items() if k not in args.styles}
    config = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "world": _WORLD,
        "jobs_per_style_per_round": args.per_round,
        "one_at_a_time": args.one_at_a_time,
        "max_seconds": args.max_seconds,
        "command": _shown(sys.argv[1:] if argv is None else argv),
    }

    def write(summary: dict) -> None:
        styles = {**kept, **summary}
        result = {"config": config, "styles": {s: styles[s] for s in STYLES if s in styles}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result))

    runs = {s: baseline_runs if STYLES[s][1] in _BASELINES else args.runs for s in args.styles}
    summary = run(
        runs, args.timeout, args.lock, on_round=write, per_round=args.per_round,
        one_at_a_time=args.one_at_a_time, max_seconds=args.max_seconds,
    )  # fmt: skip
    for s in summary.values():
        print(
            f"{s['style']}: {s['ok']}/{s['runs']} exit 0 with nothing at exit, "
            f"{s['warning_at_exit']} warnings at exit, {s['abort_at_exit']} aborts at exit"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
