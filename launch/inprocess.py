"""Run a training script inside the launcher's own process (MPI and SLURM modes).

Under ``mpirun`` or ``srun`` the job manager already started one process per
rank, so there is nothing to spawn: the launcher sets the torchrun-style
variables for ``env://``, then executes the script with :mod:`runpy` in this
interpreter. Staying in-process keeps the MPI (PMI) connection and the
environment MPI set up, which a child process would not inherit reliably.

Example:
    >>> from aps_launch.mpi import mpi_rendezvous
    >>> env, store = mpi_rendezvous()  # every rank, under mpirun  # doctest: +SKIP
    >>> run_in_process(env, store, "train.py", ["--lr", "0.1"], backend="gloo")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

import torch.distributed as dist

from .distributed import BACKEND_ENV
from .env import DistEnv, is_loopback
from .store import pin_loopback, wait_for_ranks

__all__ = ["run_in_process", "run_script"]


def run_script(target: str, args: Sequence[str], *, module: bool = False) -> None:
    """Execute ``target`` as ``__main__`` the way ``python [-m] target args`` would.

    Example:
        >>> run_script("json.tool", ["--help"], module=True)  # doctest: +SKIP
    """
    if module:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    path = os.path.abspath(target)
    sys.argv = [path, *args]
    # `python script.py` puts the script's directory first on sys.path so its
    # sibling modules import; runpy.run_path does not.
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


def run_in_process(
    env: DistEnv,
    store: dist.Store,
    target: str,
    args: Sequence[str],
    *,
    module: bool = False,
    backend: str | None = None,
) -> None:
    """Describe this rank to ``env://`` and run the script here.

    Rank 0's process hosts ``store``'s server, so after the script returns
    every rank checks in and rank 0 waits for all of them before exiting.

    Args:
        env: this rank, from :func:`aps_launch.mpi.mpi_rendezvous` or SLURM.
        store: the rendezvous store (the server on rank 0).
        target: script path, or module name with ``module=True``.
        args: the script's arguments.
        module: run ``target`` as a module.
        backend: exported as ``APS_BACKEND`` for :func:`aps_launch.init_distributed`.

    Example:
        >>> run_in_process(env, store, "train.py", [])  # doctest: +SKIP
    """
    os.environ.update(env.to_environ())
    # Tells env:// (and init_distributed) that the store server already runs,
    # so rank 0 connects to it instead of starting a second one.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    if backend:
        os.environ[BACKEND_ENV] = backend
    if is_loopback(env.master_addr):
        pin_loopback()
    run_script(target, args, module=module)
    wait_for_ranks(store, env.rank, env.world_size)
