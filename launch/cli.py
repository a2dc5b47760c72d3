"""``aps-launch``: start a training script on every rank of a job.

Three ways to start ranks:

* default — PyTorch's elastic launcher (torchrun's engine) spawns
  ``--nproc-per-node`` ranks on this machine; add ``--nnodes`` and
  ``--rdzv-endpoint`` (or ``--node-rank`` and ``--master-addr``) on every
  node for a multi-node job;
* ``--mpi`` — under ``mpirun -n K``: each MPI process is a rank, mpi4py
  gives rank, size and local rank, rank 0 broadcasts the store address;
* ``--slurm`` — under ``srun``: each task is a rank, read from ``SLURM_*``.

The mode is never guessed from the environment: an ``srun`` step with one
task per node running the elastic launcher (multi-node torchrun) and one
task per GPU running ``--slurm`` set the same variables.

Example:
    ``aps-launch --nproc-per-node 2 train.py --epochs 1``
    ``mpirun -n 8 -f hosts aps-launch --mpi train.py``
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .distributed import BACKEND_ENV
from .elastic import launch_elastic, torchrun_argv
from .env import LOOPBACK, DistEnvError, from_slurm, is_loopback
from .inprocess import run_in_process
from .store import connect_store, pin_loopback, serve_store

__all__ = ["build_parser", "default_nproc", "main"]

_ELASTIC_ONLY = ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_backend")


def default_nproc() -> int:
    """Ranks per node when not given: one per visible GPU, else 2.

    Example:
        >>> default_nproc() >= 1
        True
    """
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least``, else argparse's one-line error."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {text!r}")
        return value

    return convert


def _port(text: str) -> int:
    port = _count(1)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {text!r}")
    return port


def _nnodes(text: str) -> str:
    """``--nnodes``: ``N`` or ``MIN:MAX`` with 1 <= MIN <= MAX, kept as text for torchrun."""
    parts = text.split(":")
    try:
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        low = high = 0
    if len(parts) > 2 or not 1 <= low <= high:
        raise argparse.ArgumentTypeError(
            f"expected a node count N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}"
        )
    return text


def build_parser() -> argparse.ArgumentParser:
    """The ``aps-launch`` argument parser.

    Example:
        >>> build_parser().parse_args(["--mpi", "train.py", "--lr", "1"]).script_args
        ['--lr', '1']
    """
    parser = argparse.ArgumentParser(
        prog="aps-launch",
        description="Launch a PyTorch DDP script on every rank (elastic, MPI or SLURM).",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--mpi", action="store_true", help="run under mpirun/mpiexec; ranks from mpi4py"
    )
    mode.add_argument("--slurm", action="store_true", help="run under srun; ranks from SLURM_*")
    parser.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default=None,
        help="process group backend (default: nccl with CUDA, else gloo); exported as "
        f"{BACKEND_ENV}",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=_count(1),
        default=None,
        help="ranks on this node (default: number of GPUs, or 2 without CUDA)",
    )
    parser.add_argument(
        "--nnodes", type=_nnodes, default=None, help="nodes, or MIN:MAX (default 1)"
    )
    parser.add_argument(
        "--node-rank", type=_count(0), default=None, help="this node's rank (static)"
    )
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous")
    parser.add_argument("--rdzv-backend", choices=["c10d", "static"], default=None)
    parser.add_argument("--rdzv-id", default="aps-launch", help="job id, same on all nodes")
    parser.add_argument("--max-restarts", type=_count(0), default=0, help="worker group restarts")
    parser.add_argument("--master-addr", default=None, help="rank 0's host (static/MPI/SLURM)")
    parser.add_argument("--master-port", type=_port, default=None, help="rank 0's store port")
    parser.add_argument(
        "-m", "--module", action="store_true", help="run SCRIPT as a module (python -m)"
    )
    parser.add_argument("script", help="training script path, or module name with -m")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _config_error(exc: Exception) -> int:
    # Only configuration errors end here; the script's own exceptions
    # propagate with their traceback.
    print(f"aps-launch: error: {exc}", file=sys.stderr)
    return 2


def _missing_target(script: str, module: bool) -> str | None:
    """Why ``script`` (a module with ``-m``) cannot run on the ranks; None if it can.

    Checked once here rather than by every rank, each of which would fail in
    its own traceback under the launcher's failure report.

    Example:
        >>> _missing_target("no_such_script.py", module=False)
        "no script 'no_such_script.py' to run: no such file"
    """
    if not module:
        path = Path(script)
        if path.is_file():
            return None
        why = "it is a folder, not a file" if path.is_dir() else "no such file"
        return f"no script {script!r} to run: {why}"
    # The ranks run `python -m`, which puts the working folder first on the path.
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(script)
    except (ImportError, ValueError):  # a parent package that is missing; an empty name part
        spec = None
    finally:
        sys.path.remove(os.getcwd())
    if spec is None:
        return (
            f"no module {script!r} to run with -m: not importable from {os.getcwd()} or "
            "sys.path (PYTHONPATH)"
        )
    return None


def _run_elastic(opts: argparse.Namespace) -> int:
    # None only: 0 is refused by the parser, never read as "the default".
    nproc = default_nproc() if opts.nproc_per_node is None else opts.nproc_per_node
    nnodes = opts.nnodes or "1"
    try:
        argv = torchrun_argv(
            opts.script,
            opts.script_args,
            nproc_per_node=nproc,
            module=opts.module,
            nnodes=nnodes,
            node_rank=opts.node_rank,
            rdzv_endpoint=opts.rdzv_endpoint,
            rdzv_backend=opts.rdzv_backend,
            rdzv_id=opts.rdzv_id,
            max_restarts=opts.max_restarts,
            master_addr=opts.master_addr,
            master_port=opts.master_port,
        )
    except ValueError as exc:
        return _config_error(exc)
    missing = _missing_target(opts.script, opts.module)
    if missing:
        return _config_error(ValueError(missing))
    # Workers inherit this process's environment.
    if opts.backend:
        os.environ[BACKEND_ENV] = opts.backend
    else:
        os.environ.setdefault(BACKEND_ENV, "nccl" if torch.cuda.is_available() else "gloo")
    endpoint_host = (opts.rdzv_endpoint or LOOPBACK).rsplit(":", 1)[0]
    if nnodes.split(":")[-1] == "1" and is_loopback(endpoint_host):
        pin_loopback()
    return launch_elastic(argv)


def _run_mpi(opts: argparse.Namespace) -> int:
    from .mpi import mpi_rendezvous

    missing = _missing_target(opts.script, opts.module)
    if missing:
        return _config_error(ValueError(missing))
    env, store = mpi_rendezvous(master_addr=opts.master_addr, master_port=opts.master_port)
    run_in_process(
        env, store, opts.script, opts.script_args, module=opts.module, backend=opts.backend
    )
    return 0


def _run_slurm(opts: argparse.Namespace) -> int:
    environ = dict(os.environ)
    if opts.master_addr:
        environ["MASTER_ADDR"] = opts.master_addr
    if opts.master_port:
        environ["MASTER_PORT"] = str(opts.master_port)
    try:
        env = from_slurm(environ)
    except DistEnvError as exc:
        return _config_error(exc)
    missing = _missing_target(opts.script, opts.module)
    if missing:
        return _config_error(ValueError(missing))
    if env.rank == 0:
        store = serve_store(env.master_addr, env.master_port, env.world_size)
    else:
        store = connect_store(env.master_addr, env.master_port, env.world_size)
    run_in_process(
        env, store, opts.script, opts.script_args, module=opts.module, backend=opts.backend
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aps-launch``; returns the process exit code.

    Example:
        >>> main(["--nproc-per-node", "2", "train.py"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.mpi or opts.slurm:
        given = [f"--{n.replace('_', '-')}" for n in _ELASTIC_ONLY if getattr(opts, n) is not None]
        if given:
            parser.error(
                f"{', '.join(given)} apply to the elastic launcher; with --mpi/--slurm the "
                "job manager (mpirun -n, srun -n) decides the ranks"
            )
    if opts.mpi:
        return _run_mpi(opts)
    if opts.slurm:
        return _run_slurm(opts)
    return _run_elastic(opts)


if __name__ == "__main__":
    sys.exit(main())
