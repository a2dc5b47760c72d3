"""Run a function on N real processes joined by a ``torch.distributed`` group.

This is the harness every multi-rank test uses: real processes (forked
from a fork server that has imported torch once, spawned where there is no
fork server), the Gloo backend on CPU tensors, a fresh rendezvous for every
call (the parent hosts a ``TCPStore`` on an OS-chosen port, so there is no
free-port race), a hard timeout so a deadlock fails instead of hanging, and
the child's traceback in the error when a rank fails.

Example:
    The ranks unpickle ``fn`` by name, so it must be importable: defined at
    the top of a test module, not in a doctest or a closure.

    >>> def work(rank, world_size, scale):
    ...     t = torch.ones(3) * (rank + 1) * scale
    ...     dist.all_reduce(t)
    ...     return t
    >>> run_distributed(work, world_size=2, args=(2.0,))  # in a test module  # doctest: +SKIP
    [tensor([6., 6., 6.]), tensor([6., 6., 6.])]

    Every rank calls ``fn(rank, world_size, *args)``; the results come back in
    rank order, and a rank's exception comes back with its traceback:

    >>> run_distributed(divmod, world_size=2)
    [(0, 0), (0, 1)]
    >>> run_distributed(divmod, world_size=2, args=(3,))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    aps_comm.testing.DistributedTestError: rank 0 failed: TypeError: divmod expected 2 arguments, got 3
    ...
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistributedTestError", "run_distributed"]


class DistributedTestError(RuntimeError):
    """A rank raised, died, or the job ran past its timeout."""


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    args: Sequence[Any],
    env: dict[str, str],
    pg_timeout: float,
    results: mp.Queue,
) -> None:
    os.environ.update(env)
    # Each rank gets one intra-op thread: N ranks share a small machine, and
    # oversubscription makes the collectives' timing erratic.
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        # Gloo's init can return on one rank while a peer is still finishing its
        # handshake; a rank whose fn makes no collective would then exit and
        # reset that peer's connection ("Connection closed by peer"). Start fn
        # only once every rank is initialised.
        store.set(f"initialised/{rank}", "1")
        store.wait([f"initialised/{r}" for r in range(world_size)])
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle, not torch's shared-memory reductions: those hand file
        # descriptors over a socket that dies when this process exits.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException as exc:  # report everything, including SystemExit
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# What every rank imports and sets up anyway, done once by the fork server
# instead of by each rank: several seconds of CPU per rank on a small machine.
_PRELOAD = ["aps_comm.rank_preload"]


def _context() -> mp.context.BaseContext:
    """A fork server with torch preloaded where the platform has one, else spawn.

    Ranks fork from a single-threaded server process, never from the caller
    (which may run threads), so they start as clean as spawned ones.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    backend: str | None = "gloo",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    ``fn`` must be importable (defined at module level). The process group is
    initialised before ``fn`` runs and destroyed after it returns.

    Args:
        fn: the per-rank function; its return value must be picklable.
        world_size: number of processes.
        args: extra positional arguments passed to every rank.
        backend: ``torch.distributed`` backend, "gloo" by default; None
            initialises as ``init_process_group()`` without a backend does
            (Gloo for CPU tensors, NCCL for CUDA ones).
        timeout: seconds for the whole job; past it every rank is killed.
        env: extra environment variables set in every child.
        pg_timeout: the process group's timeout, seconds.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message),
            died without reporting, or the job timed out.
    """
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(
                fn,
                rank,
                world_size,
                store.port,
                backend,
                tuple(args),
                dict(env or {}),
                pg_timeout,
                results,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - outputs.keys() - failures.keys())
                msg = f"ranks {missing} did not finish within {timeout:.0f} s (deadlock?)"
                if failures:
                    msg += "\n" + "\n".join(f"rank {r}: {tb}" for r, tb in sorted(failures.items()))
                raise DistributedTestError(msg)
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive()
                    and p.exitcode not in (0, None)
                    and r not in outputs
                    and r not in failures
                ]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise DistributedTestError(
                        f"ranks died without reporting (exit codes {codes})"
                    ) from None
                continue
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                # The others are likely blocked in a collective with the failed
                # rank; give them a moment to report their own errors, then stop.
                deadline = min(deadline, time.monotonic() + 10.0)
        if failures:
            raise DistributedTestError(
                "\n".join(f"rank {r} failed: {tb}" for r, tb in sorted(failures.items()))
            )
        return [outputs[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
