"""Rendezvous stores that listen only where the job needs them to.

``torch.distributed.TCPStore`` binds its server to every interface. For a job
whose ranks all live on one machine that exposes a port to the network for no
reason, so the server here binds a socket itself (to the master address, which
is ``127.0.0.1`` for a local job) and hands the descriptor to ``TCPStore``
through ``master_listen_fd``. Binding before the store exists also closes the
"find a free port, then someone else takes it" race.

Example:
    >>> server = serve_store("127.0.0.1", 0, world_size=1)
    >>> client = connect_store("127.0.0.1", server.port, world_size=1)
    >>> client.set("k", "v"); server.get("k")
    b'v'
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import MutableMapping

import torch.distributed as dist

from .env import is_loopback

__all__ = ["connect_store", "loopback_ifname", "pin_loopback", "serve_store", "wait_for_ranks"]

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_DONE_KEY = "aps_launch/finished"


def loopback_ifname() -> str | None:
    """Name of the loopback network interface (``lo`` on Linux), if any.

    Example:
        >>> loopback_ifname() in ("lo", "lo0", None)
        True
    """
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


def pin_loopback(environ: MutableMapping[str, str] | None = None) -> None:
    """Make Gloo and NCCL bootstrap sockets use loopback, unless the user chose.

    Gloo otherwise binds to whatever the host name resolves to, which on a
    real machine is a routable interface, even when every rank is local.

    Example:
        >>> env = {}; pin_loopback(env); env.get("GLOO_SOCKET_IFNAME") in ("lo", "lo0", None)
        True
    """
    environ = os.environ if environ is None else environ
    name = loopback_ifname()
    if name is None:
        return
    environ.setdefault("GLOO_SOCKET_IFNAME", name)
    environ.setdefault("NCCL_SOCKET_IFNAME", name)


def _bound_socket(addr: str, port: int) -> socket.socket:
    if is_loopback(addr):
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    elif socket.has_dualstack_ipv6():
        # Ranks on other machines may reach this host by any of its names, and
        # a name can resolve to 127.0.1.1 locally (Debian's /etc/hosts), so a
        # multi-node store listens on every interface, IPv4 and IPv6.
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sockaddr = ("::", port)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sockaddr = ("0.0.0.0", port)
    # A fixed port (SLURM's job-id port) may still be in TIME_WAIT from the
    # previous step of the same job.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(
    addr: str,
    port: int,
    world_size: int,
    timeout: datetime.timedelta = _DEFAULT_TIMEOUT,
) -> dist.TCPStore:
    """Start rank 0's ``TCPStore`` server, on loopback only when ``addr`` is.

    Args:
        addr: the master address; a loopback address keeps the store off the
            network, any other address means a multi-node job and the server
            listens on every interface.
        port: the port, or 0 for one the kernel picks (read ``.port``).
        world_size: number of ranks that will connect.
        timeout: how long store operations wait.

    Returns:
        The server, usable as a store by rank 0 itself.

    Example:
        >>> serve_store("127.0.0.1", 0, world_size=1).port > 0
        True
    """
    sock = _bound_socket(addr, port)
    bound_port = sock.getsockname()[1]
    fd = sock.detach()  # TCPStore's libuv loop owns and closes the descriptor
    try:
        return dist.TCPStore(
            addr,
            bound_port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def connect_store(
    addr: str,
    port: int,
    world_size: int,
    timeout: datetime.timedelta = _DEFAULT_TIMEOUT,
) -> dist.TCPStore:
    """Connect to rank 0's store, retrying until ``timeout`` while it starts.

    Example:
        >>> server = serve_store("127.0.0.1", 0, world_size=1)
        >>> connect_store("127.0.0.1", server.port, world_size=1).port == server.port
        True
    """
    return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)


def wait_for_ranks(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta = _DEFAULT_TIMEOUT,
) -> None:
    """Check in, and on rank 0 wait until every rank has, before the server goes.

    Rank 0's process hosts the store; if it exited first, ranks still shutting
    down their process groups would lose the store under them.

    Example:
        >>> wait_for_ranks(serve_store("127.0.0.1", 0, world_size=1), 0, 1)
    """
    done = store.add(_DONE_KEY, 1)
    if rank != 0:
        return
    deadline = time.monotonic() + timeout.total_seconds()
    while done < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {done} of {world_size} ranks finished within {timeout}; "
                "rank 0 stops serving the store"
            )
        time.sleep(0.01)
        done = store.add(_DONE_KEY, 0)
