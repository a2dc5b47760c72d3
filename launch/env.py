"""Work out rank, world size and rendezvous address from the job's environment.

Pure parsing of environment variables, no sockets and no ``torch.distributed``:
the result says who this process is and where rank 0's store lives. Sources,
in order of precedence:

1. torchrun / ``aps-launch`` / hand-made: ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
2. MPI launchers: Open MPI (``OMPI_COMM_WORLD_*``), MPICH / Intel MPI Hydra
   (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``).
   MPI does not say where rank 0 is, so ``MASTER_ADDR``/``MASTER_PORT`` must
   be exported; otherwise :func:`aps_launch.init_distributed` asks mpi4py.
3. SLURM ``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` or
   ``SLURM_NTASKS``, ``SLURM_LOCALID``, the node list for the master.
4. Nothing: a single process, world size 1, on loopback.

Example:
    >>> env = detect_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
    ...                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    >>> env.rank, env.world_size, env.source
    (1, 2, 'torchrun')
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

from . import slurm

__all__ = [
    "LOOPBACK",
    "DistEnv",
    "DistEnvError",
    "detect_env",
    "from_slurm",
    "is_loopback",
    "mpi_env_present",
]

LOOPBACK = "127.0.0.1"

_OMPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
_PMI = ("PMI_RANK", "PMI_SIZE")


class DistEnvError(ValueError):
    """The environment describes an impossible or incomplete distributed job."""


@dataclass(frozen=True)
class DistEnv:
    """Who this process is in the job, and where the rendezvous store lives.

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        world_size: number of processes in the job.
        local_rank: rank among the processes on this machine (the GPU index).
        local_world_size: number of processes on this machine.
        master_addr: host of rank 0's store; ``127.0.0.1`` for a local job.
        master_port: port of rank 0's store; 0 only for a single process.
        source: ``"torchrun"``, ``"mpi"``, ``"slurm"`` or ``"single"``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str

    def to_environ(self) -> dict[str, str]:
        """The torchrun-style variables that describe this process to ``env://``.

        Example:
            >>> DistEnv(0, 1, 0, 1, "127.0.0.1", 0, "single").to_environ()["WORLD_SIZE"]
            '1'
        """
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface.

    Example:
        >>> is_loopback("localhost"), is_loopback("10.0.0.1")
        (True, False)
    """
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def mpi_env_present(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI launcher (Open MPI, MPICH, Intel MPI) started this process.

    Example:
        >>> mpi_env_present({"PMI_RANK": "0", "PMI_SIZE": "2"})
        True
    """
    environ = os.environ if environ is None else environ
    return any(all(k in environ for k in keys) for keys in (_OMPI, _PMI))


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Describe this process from the launcher's environment variables.

    Args:
        environ: the variables to read; ``os.environ`` by default.

    Returns:
        The validated :class:`DistEnv`.

    Raises:
        DistEnvError: the variables contradict each other or miss something a
            multi-process job needs; the message names the variables.

    Example:
        >>> detect_env({}).world_size
        1
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if mpi_env_present(environ):
        return _from_mpi(environ)
    if "SLURM_PROCID" in environ:
        return from_slurm(environ)
    return DistEnv(0, 1, 0, 1, LOOPBACK, 0, "single")


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise DistEnvError(f"{name}={raw!r} is not an integer") from None


def _check(
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    names: tuple[str, str, str, str],
) -> None:
    rank_n, size_n, lrank_n, lsize_n = names
    if world_size < 1:
        raise DistEnvError(f"{size_n}={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise DistEnvError(f"{rank_n}={rank} must satisfy 0 <= {rank_n} < {size_n}={world_size}")
    if not 1 <= local_world_size <= world_size:
        raise DistEnvError(
            f"{lsize_n}={local_world_size} must satisfy 1 <= {lsize_n} <= {size_n}={world_size}"
        )
    if not 0 <= local_rank < local_world_size:
        raise DistEnvError(
            f"{lrank_n}={local_rank} must satisfy 0 <= {lrank_n} < {lsize_n}={local_world_size}"
        )


def _master(environ: Mapping[str, str], world_size: int, context: str) -> tuple[str, int]:
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(n)]
    if missing and world_size > 1:
        raise DistEnvError(
            f"{context} describes {world_size} processes but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: every rank needs the address "
            "and port of rank 0's store (aps-launch sets them)"
        )
    addr = environ.get("MASTER_ADDR") or LOOPBACK
    port = _int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else 0
    if not 0 <= port < 65536 or (port == 0 and world_size > 1):
        raise DistEnvError(f"MASTER_PORT={port} must be between 1 and 65535")
    return addr, port


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv:
    for have, need in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if have in environ and need not in environ:
            raise DistEnvError(
                f"{have}={environ[have]} is set but {need} is not; set both (torchrun and "
                "aps-launch do) or neither"
            )
    rank, world_size = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    local_rank = _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0
    # Hand-made environments often omit LOCAL_WORLD_SIZE; assuming every rank
    # is local keeps the LOCAL_RANK bound check meaningful.
    local_world_size = (
        _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world_size
    )
    _check(
        rank,
        world_size,
        local_rank,
        local_world_size,
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    )
    addr, port = _master(environ, world_size, f"RANK={rank}, WORLD_SIZE={world_size}")
    return DistEnv(rank, world_size, local_rank, local_world_size, addr, port, "torchrun")


def _from_mpi(environ: Mapping[str, str]) -> DistEnv:
    if all(k in environ for k in _OMPI):
        names = (*_OMPI, "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    else:
        names = (*_PMI, "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    missing = [n for n in names[2:] if n not in environ]
    if missing:
        raise DistEnvError(
            f"MPI job ({names[1]}={environ[names[1]]}) without {', '.join(missing)}: the local "
            "rank is unknown; run under aps-launch --mpi (mpi4py finds it) or export LOCAL_RANK"
        )
    rank, world_size, local_rank, local_world_size = (_int(environ, n) for n in names)
    _check(rank, world_size, local_rank, local_world_size, names)
    context = f"MPI job ({names[0]}={rank}, {names[1]}={world_size})"
    addr, port = _master(environ, world_size, context)
    return DistEnv(rank, world_size, local_rank, local_world_size, addr, port, "mpi")


def from_slurm(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Describe this ``srun`` task from SLURM's variables alone.

    ``MASTER_ADDR``/``MASTER_PORT``, when set, override the first node of the
    step and the port derived from ``SLURM_JOB_ID``.

    Raises:
        DistEnvError: SLURM's variables are missing or inconsistent.

    Example:
        >>> from_slurm({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
        ...             "SLURM_NNODES": "1", "SLURM_JOB_ID": "7"}).master_addr
        '127.0.0.1'
    """
    environ = os.environ if environ is None else environ
    if "SLURM_PROCID" not in environ:
        raise DistEnvError("SLURM_PROCID is not set: not inside an srun step")
    size_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    if size_name not in environ:
        raise DistEnvError(
            "SLURM_PROCID is set but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is; "
            "start the job with srun"
        )
    rank, world_size = _int(environ, "SLURM_PROCID"), _int(environ, size_name)
    local_rank = _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
    local_world_size = slurm.local_world_size(environ, default=world_size)
    _check(
        rank,
        world_size,
        local_rank,
        local_world_size,
        ("SLURM_PROCID", size_name, "SLURM_LOCALID", "SLURM_TASKS_PER_NODE"),
    )
    if world_size == 1:
        return DistEnv(0, 1, 0, 1, LOOPBACK, 0, "slurm")
    try:
        addr = environ.get("MASTER_ADDR") or slurm.master_addr(environ)
    except ValueError as exc:
        raise DistEnvError(str(exc)) from None
    if environ.get("MASTER_PORT"):
        port = _int(environ, "MASTER_PORT")
    elif "SLURM_JOB_ID" in environ:
        port = slurm.port_from_job_id(_int(environ, "SLURM_JOB_ID"))
    else:
        raise DistEnvError(
            "SLURM job without SLURM_JOB_ID or MASTER_PORT: no port for rank 0's store"
        )
    return DistEnv(rank, world_size, local_rank, local_world_size, addr, port, "slurm")
