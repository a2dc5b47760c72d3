"""``init_distributed()``: one call that joins whatever job this process is in.

Reads the environment the job was started in (torchrun or ``aps-launch``,
MPI, SLURM, or nothing), picks the backend, starts or joins the rendezvous
store, initialises the default process group and selects this rank's GPU.

Example:
    >>> import torch.distributed as dist
    >>> info = init_distributed()          # plain `python train.py`: a world of one
    >>> info.rank, info.world_size, info.device.type
    (0, 1, 'cpu')
    >>> init_distributed() is info         # idempotent
    True
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from .env import DistEnv, detect_env, is_loopback, mpi_env_present
from .mpi import mpi_available, mpi_rendezvous, mpi_world_size
from .store import connect_store, pin_loopback, serve_store

__all__ = ["BACKEND_ENV", "DistInfo", "init_distributed", "resolve_backend"]

BACKEND_ENV = "APS_BACKEND"
_STORE_TIMEOUT = datetime.timedelta(minutes=10)


class DistInfo(NamedTuple):
    """This process's place in the job, as returned by :func:`init_distributed`.

    Attributes:
        rank: global rank.
        world_size: number of processes.
        local_rank: rank on this machine.
        device: ``cuda:<local_rank>`` where CUDA serves this rank, else ``cpu``.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


_info: DistInfo | None = None
# Rank 0 hosts the store in its own process when no launcher agent does;
# the reference keeps the server alive for as long as the process group.
_store: dist.Store | None = None


def resolve_backend(backend: str | None = None) -> str:
    """The backend to use: the argument, else ``$APS_BACKEND``, else by hardware.

    ``aps-launch --backend`` sets ``APS_BACKEND`` for every rank. Without
    either, NCCL where CUDA is available and Gloo otherwise.

    Raises:
        ValueError: NCCL was asked for on a machine without CUDA.

    Example:
        >>> resolve_backend("gloo")
        'gloo'
    """
    chosen = backend or os.environ.get(BACKEND_ENV) or ""
    origin = "argument" if backend else BACKEND_ENV
    if not chosen:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if chosen == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            f"backend 'nccl' (from {origin}) needs CUDA but no CUDA device is visible; "
            "use 'gloo' on CPU-only machines"
        )
    return chosen


def _select_device(backend: str, local_rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        if backend == "nccl":
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                "start at most one process per GPU on each node"
            )
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _rendezvous(timeout: datetime.timedelta) -> tuple[DistEnv, dist.Store | None]:
    """This rank's environment and store; no store means use ``env://``."""
    environ = os.environ
    launcher_vars = "RANK" in environ or "WORLD_SIZE" in environ
    master_known = bool(environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"))
    mpi_job = mpi_env_present(environ) or mpi_world_size() > 1
    if not launcher_vars and mpi_job and not master_known and mpi_available():
        return mpi_rendezvous(timeout=timeout)
    env = detect_env(environ)
    if env.source == "torchrun" and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent (or aps-launch --mpi/--slurm) already serves the
        # store at MASTER_ADDR:MASTER_PORT. torchrun's static and c10d
        # rendezvous keep that store across restarts, so a restarted group
        # would find the dead group's Gloo/NCCL addresses in it and fail to
        # connect (pytorch/pytorch#135712). With one node the agent's restart
        # count is the same for every rank: a prefix per attempt isolates
        # them. Several nodes may count differently; aps-launch opts out of
        # store sharing there instead.
        if environ.get("GROUP_WORLD_SIZE", "1") != "1":
            return env, None
        client = connect_store(env.master_addr, env.master_port, env.world_size, timeout)
        attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return env, dist.PrefixStore(f"aps_launch/attempt_{attempt}", client)
    if env.rank == 0:
        return env, serve_store(env.master_addr, env.master_port, env.world_size, timeout)
    return env, connect_store(env.master_addr, env.master_port, env.world_size, timeout)


def init_distributed(
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
) -> DistInfo:
    """Initialise the default process group from the job's environment.

    Understands torchrun / ``aps-launch`` variables (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), MPI launchers
    (``OMPI_COMM_WORLD_*``, ``PMI_RANK``/``PMI_SIZE``; where ``MASTER_ADDR``
    is not exported, rank 0 broadcasts it through mpi4py), SLURM ``srun``
    (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, the node list) and
    no launcher at all (a world of one on a loopback store). A job whose
    ranks are all local keeps every socket on loopback.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ...; default :func:`resolve_backend`.
        timeout: collective and store timeout; default PyTorch's.

    Returns:
        ``DistInfo(rank, world_size, local_rank, device)``. A second call
        returns the same object without initialising again.

    Raises:
        aps_launch.DistEnvError: the environment is inconsistent or incomplete
            (the message names the variables).
        ValueError: the backend does not fit the machine, or a second call
            asks for a different backend than the first.

    Example:
        >>> info = init_distributed()  # once per process, at the start  # doctest: +SKIP
        >>> model = torch.nn.parallel.DistributedDataParallel(  # doctest: +SKIP
        ...     torch.nn.Linear(4, 4).to(info.device))
    """
    global _info, _store
    if dist.is_initialized():
        current = dist.get_backend()
        if backend is not None and backend != current:
            raise ValueError(
                f"torch.distributed is already initialised with backend {current!r}; "
                f"init_distributed(backend={backend!r}) cannot change it"
            )
        if _info is None:
            # Initialised by the user's own code: report, do not re-initialise.
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            _info = DistInfo(
                dist.get_rank(),
                dist.get_world_size(),
                local_rank,
                _select_device(current, local_rank),
            )
        return _info
    chosen = resolve_backend(backend)
    env, store = _rendezvous(timeout or _STORE_TIMEOUT)
    if is_loopback(env.master_addr):
        pin_loopback()
    device = _select_device(chosen, env.local_rank)
    if store is None:
        dist.init_process_group(chosen, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(
            chosen, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
    _store = store
    _info = DistInfo(env.rank, env.world_size, env.local_rank, device)
    # atexit is last in, first out: what aps_comm.register installs later
    # (aps_comm.teardown: the hook's worker, then its groups) runs before this.
    atexit.register(_teardown)
    return _info


def _teardown() -> None:
    """Unregister the process groups, then drop the store server, while Python still runs.

    This does not join the default group's Gloo threads: DDP and torch's own
    modules keep the group alive until the interpreter's shutdown. With the
    APS hook, the collectives whose Works a Gloo thread may still be freeing
    at exit run on the hook's own groups, which :mod:`aps_comm.teardown`
    joins before this runs; DDP's own all-reduce (no hook) runs here and can
    still abort at exit on torch 2.13.
    """
    global _store
    if dist.is_initialized():
        dist.destroy_process_group()
    _store = None
