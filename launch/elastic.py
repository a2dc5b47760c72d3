"""Run local ranks through PyTorch's elastic launcher (the engine of torchrun).

:func:`launch_elastic` builds a torchrun command line, parses it with
``torch.distributed.run.get_args_parser()`` and hands it to
``torch.distributed.run.run`` — the same agent, restarts, signal forwarding
and failure reports as ``torchrun``. The one addition is the ``aps-loopback``
rendezvous backend for single-node jobs: torchrun's own choices (``static``,
``c10d``) start a store listening on every interface, ``aps-loopback`` starts
it on ``127.0.0.1`` only (see :mod:`aps_launch.store`).

Example:
    >>> argv = torchrun_argv("train.py", ["--lr", "0.1"], nproc_per_node=2)
    >>> argv[:6]
    ['--nnodes', '1', '--nproc-per-node', '2', '--max-restarts', '0']
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from .env import LOOPBACK
from .store import serve_store

__all__ = ["LOOPBACK_RDZV", "launch_elastic", "register_loopback_rendezvous", "torchrun_argv"]

LOOPBACK_RDZV = "aps-loopback"
_RDZV_TIMEOUT = datetime.timedelta(minutes=10)
_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class _LoopbackRendezvous(RendezvousHandler):
    """A one-node rendezvous whose store listens on 127.0.0.1 only."""

    def __init__(self, run_id: str, timeout: datetime.timedelta) -> None:
        self._run_id = run_id
        self._timeout = timeout
        self._server: dist.TCPStore | None = None

    @property
    def use_agent_store(self) -> bool:
        # Workers connect to the agent's server instead of rank 0 starting a
        # second one, which would listen on every interface.
        return True

    def get_backend(self) -> str:
        return LOOPBACK_RDZV

    def next_rendezvous(self) -> RendezvousInfo:
        # A fresh server (and port) every round: workers connect to it without
        # a per-attempt prefix (torch's env:// trusts the handler for that), so
        # a restarted group reusing the last round's store would read the dead
        # workers' Gloo addresses and fail with "Connection refused"
        # (pytorch/pytorch#135712).
        self._server = serve_store(LOOPBACK, 0, 1, self._timeout)
        store = dist.PrefixStore(self._run_id, self._server)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(LOOPBACK, self._server.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True


def _create_loopback_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    if params.max_nodes != 1:
        raise ValueError(f"the {LOOPBACK_RDZV} rendezvous serves one node, not {params.max_nodes}")
    return _LoopbackRendezvous(params.run_id, _RDZV_TIMEOUT)


def register_loopback_rendezvous() -> None:
    """Make ``--rdzv-backend aps-loopback`` known to the elastic agent.

    Idempotent: the registry accepts the same creator twice.

    Example:
        >>> register_loopback_rendezvous(); register_loopback_rendezvous()
    """
    rendezvous_handler_registry.register(LOOPBACK_RDZV, _create_loopback_rendezvous)


def _max_nodes(nnodes: str) -> int:
    return int(nnodes.split(":")[-1])


def torchrun_argv(
    script: str,
    script_args: Sequence[str],
    *,
    nproc_per_node: int,
    module: bool = False,
    nnodes: str = "1",
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str | None = None,
    rdzv_id: str = "aps-launch",
    max_restarts: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> list[str]:
    """The ``torchrun`` command line (without ``torchrun``) for these options.

    One node without an endpoint uses the loopback rendezvous. Several nodes
    use torchrun's ``c10d`` rendezvous at ``rdzv_endpoint``, or ``static``
    (fixed node ranks) when ``node_rank`` is given.

    Args:
        script: the training script, or a module name with ``module=True``.
        script_args: arguments for the script.
        nproc_per_node: ranks on this node.
        module: run ``script`` as ``python -m script``.
        nnodes: number of nodes, or ``MIN:MAX`` for an elastic job.
        node_rank: this node's rank (static rendezvous).
        rdzv_endpoint: ``host:port`` of the rendezvous on one node.
        rdzv_backend: ``c10d`` or ``static``; chosen as above when None.
        rdzv_id: job id shared by all nodes of one job.
        max_restarts: restarts of the whole worker group before failing.
        master_addr: static rendezvous host when no ``rdzv_endpoint``.
        master_port: static rendezvous port when no ``rdzv_endpoint``.

    Raises:
        ValueError: a multi-node job without a rendezvous address.

    Example:
        >>> torchrun_argv("m", [], nproc_per_node=4, module=True, nnodes="2",
        ...               rdzv_endpoint="n1:29400")[6:10]
        ['--rdzv-backend', 'c10d', '--rdzv-endpoint', 'n1:29400']
    """
    argv = ["--nnodes", nnodes, "--nproc-per-node", str(nproc_per_node)]
    argv += ["--max-restarts", str(max_restarts)]
    if _max_nodes(nnodes) == 1 and rdzv_endpoint is None and rdzv_backend is None:
        argv += ["--rdzv-backend", LOOPBACK_RDZV, "--rdzv-endpoint", f"{LOOPBACK}:0"]
        argv += ["--rdzv-id", rdzv_id]
    else:
        backend = rdzv_backend or ("static" if node_rank is not None else "c10d")
        if rdzv_endpoint is None and master_addr is not None:
            rdzv_endpoint = f"{master_addr}:{master_port or 29500}"
        if rdzv_endpoint is None:
            raise ValueError(
                f"--nnodes {nnodes} spans machines: pass --rdzv-endpoint HOST:PORT "
                "(a host every node can reach; the same on all nodes)"
            )
        argv += ["--rdzv-backend", backend, "--rdzv-endpoint", rdzv_endpoint]
        argv += ["--rdzv-id", rdzv_id]
        if node_rank is not None:
            argv += ["--node-rank", str(node_rank)]
    if module:
        argv.append("--module")
    return [*argv, script, *script_args]


def launch_elastic(argv: Sequence[str]) -> int:
    """Run ``torchrun`` with ``argv`` in this process; return the job's exit code.

    Args:
        argv: torchrun arguments, e.g. from :func:`torchrun_argv`.

    Returns:
        0 when every rank succeeded, else the first failed rank's exit code
        (1 if it died from a signal); the failure report goes to stderr.

    Example:
        >>> launch_elastic(torchrun_argv("train.py", [], nproc_per_node=2))  # doctest: +SKIP
        0
    """
    from torch.distributed import run as torchrun

    register_loopback_rendezvous()
    args = torchrun.get_args_parser().parse_args(list(argv))
    if args.rdzv_backend == "c10d":
        # torchrun's c10d rendezvous shares its store with the workers, with no
        # per-restart prefix that all nodes agree on, so a restarted group can
        # read the dead group's addresses (pytorch/pytorch#135712). Opting out
        # makes rank 0 serve a fresh store on a new port every round.
        os.environ.setdefault(_SHARE_STORE_ENV, "1")
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        _, failure = exc.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
