"""Rendezvous for jobs started by ``mpirun``/``srun --mpi``, through mpi4py.

MPI knows every rank and which ranks share a node, but not where a
``torch.distributed`` store should live. Rank 0 picks the address (loopback
when the whole job is on one node), starts the store on a port the kernel
chooses, and broadcasts both; the other ranks connect to it.

Example:
    Under ``mpirun -n 2 python -c ...``::

        env, store = mpi_rendezvous()
        env.rank, env.world_size, env.master_addr   # (0, 2, '127.0.0.1') on rank 0
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from .env import LOOPBACK, DistEnv, is_loopback
from .store import connect_store, serve_store

__all__ = ["mpi_available", "mpi_rendezvous", "mpi_world_size"]

_TIMEOUT = datetime.timedelta(minutes=10)
# Any address outside this host: connecting a UDP socket sends no packet, it
# only asks the kernel which interface would route there.
_PROBE = ("192.0.2.1", 9)


def mpi_available() -> bool:
    """Whether mpi4py can be imported (it initialises MPI on import of ``MPI``).

    Example:
        >>> isinstance(mpi_available(), bool)
        True
    """
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def mpi_world_size() -> int:
    """Size of ``MPI.COMM_WORLD`` if the program already initialised MPI, else 0.

    Lets :func:`aps_launch.init_distributed` notice an MPI job started without the
    usual launcher variables, without initialising MPI itself.

    Example:
        >>> mpi_world_size() >= 0
        True
    """
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return 0
    return mpi.COMM_WORLD.Get_size()


def _routable_address() -> str:
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = LOOPBACK
    if not is_loopback(addr):
        return addr
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(_PROBE)
            return probe.getsockname()[0]
        except OSError:
            raise RuntimeError(
                f"host name {host!r} resolves to loopback and no route leaves this host; "
                "pass --master-addr (or export MASTER_ADDR) with an address the other "
                "nodes can reach"
            ) from None


def mpi_rendezvous(
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout: datetime.timedelta = _TIMEOUT,
) -> tuple[DistEnv, dist.TCPStore]:
    """Agree on rank 0's store through ``MPI.COMM_WORLD`` and connect to it.

    Args:
        master_addr: address other ranks use to reach rank 0; default loopback
            for a one-node job, else rank 0's routable address.
        master_port: port for the store; default a free one chosen by the kernel.
        timeout: how long store operations wait.

    Returns:
        This rank's :class:`DistEnv` (source ``"mpi"``) and the store: the
        server on rank 0 (keep it alive while the job runs), a client elsewhere.

    Raises:
        ImportError: mpi4py is not installed.
        RuntimeError: rank 0 could not start the store (on every rank).

    Example:
        >>> env, store = mpi_rendezvous()  # doctest: +SKIP
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_world_size = node.Get_rank(), node.Get_size()
    node.Free()
    server: dist.TCPStore | None = None
    payload: tuple[str, int, str]
    if rank == 0:
        # Every rank must reach the bcast, so rank 0 reports failure through it
        # instead of raising and leaving the others blocked.
        try:
            addr = master_addr or (
                LOOPBACK if local_world_size == world_size else _routable_address()
            )
            server = serve_store(addr, master_port or 0, world_size, timeout)
            payload = (addr, server.port, "")
        except Exception as exc:
            payload = ("", 0, f"{type(exc).__name__}: {exc}")
    payload = comm.bcast(payload if rank == 0 else None, root=0)
    addr, port, error = payload
    if error:
        raise RuntimeError(f"MPI rank 0 could not start the rendezvous store: {error}")
    store = server if server is not None else connect_store(addr, port, world_size, timeout)
    env = DistEnv(rank, world_size, local_rank, local_world_size, addr, port, "mpi")
    return env, store
