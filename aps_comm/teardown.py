"""Release aps-comm's threads and process groups at exit, while Python is still whole.

Why a finished job on Gloo can abort at exit (torch 2.13, CPython 3.11): a
Gloo worker thread (``ProcessGroupGloo::runLoop``) completes a collective's
future, so the training loop moves on, and only then frees its own reference
to the ``Work``. Freeing it takes the GIL when the Work holds Python-owned
state: a tensor that also has a Python object (when its C++ refcount falls
from 2 to 1, c10 drops its reference to that object,
``TensorImpl::decref_pyobject``) or, for a Work
created inside ``backward()``, the ``contextvars.Context`` that autograd
stashes in thread-local state and every Work captures. If the main thread has
begun ``Py_FinalizeEx`` by then, CPython ends the waiting thread with
``pthread_exit``; its forced unwinding meets the Work's ``noexcept``
destructor and C++ calls ``std::terminate``: "terminate called without an
active exception", SIGABRT, after the job printed its results. A core dump
shows the worker in ``~AsyncAllreduceWork`` (DDP's own all-reduce) or
``~AsyncAlltoallWork`` / ``~AsyncAllgatherWork`` (the hook's) ->
``ConcretePyInterpreterVTable::decref`` -> ``take_gil`` ->
``PyThread_exit_thread``, and the main thread in ``Py_FinalizeEx``.

``dist.destroy_process_group`` does not help: Gloo's ``shutdown()`` is a
no-op, and the worker threads are joined only by the backend's destructor,
which runs when the last reference to the group goes (torch releases the GIL
there, so a worker that still has a Work to free can take it). The default
group never gets there: DDP, and functions in ``torch.distributed.nn`` that
take it as a default argument when imported after it exists, keep it alive.
Neither do the groups aps-comm creates, even once their owner is gone: a
training function returns, its DDP model and the hook's state are freed, and
``torch.distributed``'s registry still holds the groups, and their threads,
until the interpreter's shutdown (the abort the first exit handler missed:
it only knew the owners still alive at exit).

So :func:`join_at_exit` records (weakly) every group aps-comm creates, and
:func:`release_at_exit` registers an owner (an ``APSState``) and one
``atexit`` handler per process that, before finalisation:

1. closes the :class:`~aps_comm.executor.FifoWorker` threads of every owner
   still alive (``exit_workers``): the queued buckets finish, no new
   collective starts (a collected owner's worker stopped with it);
2. takes their process groups (``exit_groups``), and every recorded group
   still alive, whoever owned it (never the default group), away from them
   and from ``torch.distributed``, then drops the last
   reference on a helper thread: the Gloo backend's destructor waits for its
   queue and joins its threads. After that no thread of those groups can need
   the GIL. The helper is given :data:`JOIN_TIMEOUT_S`; a group still busy
   then (a collective stuck on a peer that never joins it: the job failed
   anyway) is left to the interpreter's shutdown as before. So are the groups
   of a job whose hook failed or whose worker did not stop in time: their
   peers may be gone, and waiting on their queues would only delay the exit.

The helper must hold the last reference itself. A future's callbacks run on
the Gloo worker that completed it, after the waiters wake, and are freed
there: a callback that refers to a group (a hook's closure over its state)
and outlives every other reference would run the backend's destructor on that
worker, which then joins its own thread ("Resource deadlock avoided",
SIGABRT). So the helper waits, up to :data:`CALLBACK_WAIT_S`, for every
other reference to go before it drops its own.

The owner is unusable afterwards. The handler never raises and never changes
the exit code: a job that failed keeps its own.

A ``register`` that raises must leave nothing for that handler: the
traceback of an uncaught exception stays referenced until exit
(``sys.last_traceback``), and its frames hold the groups ``register`` had
made, which the handler would then report as still referenced by the
program. :class:`released_if_raises` undoes such a call at once: the
groups made inside it are destroyed and joined before the error
propagates, and its owner is forgotten.

Example:
    >>> from aps_comm.teardown import release_at_exit
    >>> release_at_exit(state)  # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
import threading
import time
import traceback
import types
import weakref
from typing import Protocol

import torch.distributed as dist

from aps_comm.executor import FifoWorker

__all__ = [
    "CALLBACK_WAIT_S",
    "JOIN_TIMEOUT_S",
    "ExitResources",
    "join_at_exit",
    "release_at_exit",
    "released_if_raises",
]

JOIN_TIMEOUT_S = 10.0
"""Seconds the exit handler waits for a worker to finish, and for the groups to be joined."""

CALLBACK_WAIT_S = 2.0
"""Seconds the join waits for other references to a group to go (a future's callback
still running on a Gloo worker) before it drops its own."""


class ExitResources(Protocol):
    """What an owner (the DDP hook's or FSDP's state) holds that must go before Python does."""

    def exit_workers(self) -> list[FifoWorker]:
        """The threads that issue its collectives."""
        ...

    def exit_groups(self) -> list[dist.ProcessGroup]:
        """Its process groups, which it forgets (it is unusable afterwards)."""
        ...


# Weak: an owner collected before exit has stopped its worker, and its groups
# are in _groups.
_owners: weakref.WeakSet = weakref.WeakSet()
# Weak: a group destroyed and freed before exit has joined its threads then.
_groups: weakref.WeakSet = weakref.WeakSet()
# The groups made inside each open released_if_raises block (strong: undone if it raises).
_scopes: list[list[dist.ProcessGroup]] = []


def join_at_exit(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """Record a group aps-comm created: the exit handler destroys and joins it if still alive.

    Held weakly: a group the program destroys and drops earlier is gone
    already. Returns ``group`` (for ``return join_at_exit(dist.new_group())``).

    Example:
        >>> group = join_at_exit(dist.new_group())  # doctest: +SKIP
    """
    if isinstance(group, dist.ProcessGroup):  # not NON_GROUP_MEMBER
        _groups.add(group)
        for made in _scopes:
            made.append(group)
        atexit.unregister(_release_all)
        atexit.register(_release_all)
    return group


def release_at_exit(owner: ExitResources) -> None:
    """At interpreter exit, close ``owner``'s workers and destroy its process groups.

    The owner says what it holds (:class:`ExitResources`); the default group
    is left alone, a group the user handed to the owner is destroyed too (and
    joined only if nothing else still refers to it). Call it
    once the owner exists; calling it again is harmless. Each call moves the
    exit handler to the front of the ``atexit`` queue (last in, first out),
    so it runs before the handlers registered earlier: ``init_distributed``'s
    release of the default group and of the store comes after it.

    Args:
        owner: e.g. an :class:`~aps_comm.APSState`. Held weakly.

    Example:
        >>> release_at_exit(state)  # doctest: +SKIP
    """
    _owners.add(owner)
    atexit.unregister(_release_all)
    atexit.register(_release_all)


class released_if_raises:  # lower case: used as a context manager, as contextlib.suppress is
    """Undo a collective call that raises: destroy and join the groups it made, forget its owner.

    Every group :func:`join_at_exit` records inside the block is destroyed
    and its last reference dropped (its Gloo threads joined, bounded by
    :data:`JOIN_TIMEOUT_S`) before the exception propagates, unchanged; the
    owner forgets its groups (:meth:`ExitResources.exit_groups`: a group the
    user handed it is forgotten, never destroyed) and the exit handler
    forgets the owner. A block that does not raise changes nothing.

    The frames the exception's traceback holds below the block's own lose
    their local variables (``traceback.clear_frames``): they held the groups
    too, and an uncaught exception keeps them until exit. File names and
    line numbers remain.

    Args:
        owner: what the block builds (e.g. an :class:`~aps_comm.APSState`).

    Example:
        >>> with released_if_raises(state):  # doctest: +SKIP
        ...     state.bind_process_group()
    """

    def __init__(self, owner: ExitResources) -> None:
        self.owner = owner
        self._made: list[dist.ProcessGroup] = []

    def __enter__(self) -> released_if_raises:
        _scopes.append(self._made)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        _scopes.remove(self._made)
        made, self._made = self._made, []
        if exc is None:
            return
        try:
            _undo(self.owner, made, exc)
        except Exception as failed:  # the caller's error is the one to see
            print(f"aps_comm: releasing a failed call's groups failed: {failed!r}", file=sys.stderr)


def _undo(owner: ExitResources, made: list[dist.ProcessGroup], exc: BaseException) -> None:
    """Forget ``owner``, destroy and join ``made`` (whose only references are here)."""
    _owners.discard(owner)
    for worker in owner.exit_workers():
        worker.close(JOIN_TIMEOUT_S)
    owner.exit_groups()
    if not made:
        return  # nothing of ours for the frames to hold: leave them to debuggers
    seen: set[int] = set()
    chained: BaseException | None = exc
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        # Skips the frames still running (the caller's): their locals are theirs.
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__
    groups: dict[int, dist.ProcessGroup] = {}
    for group in made:
        _groups.discard(group)
        groups[id(group)] = group
        with contextlib.suppress(ValueError):  # gone with the default group already
            dist.destroy_process_group(group)
    # Only `groups` may refer to them now: the join waits for the last reference.
    del group
    made.clear()
    _join(groups, warn=False)


def _release_all() -> None:
    """The exit handler: every owner's workers first, then every owner's groups."""
    try:
        if not _workers_stopped():
            # A collective failed or is stuck: its peers may be gone, and the
            # groups' queues would keep the process waiting for nothing.
            return
        # Only this dict may refer to the groups from here on: a loop variable
        # left in this frame would keep the last one alive through the join.
        _join(_take_groups())
    except Exception as exc:  # an exit handler must not mask the job's own outcome
        print(f"aps_comm: releasing process groups at exit failed: {exc!r}", file=sys.stderr)


def _workers_stopped() -> bool:
    """Close every live owner's workers; whether all of them stopped cleanly."""
    healthy = True
    for owner in list(_owners):
        for worker in owner.exit_workers():
            worker.close(JOIN_TIMEOUT_S)
            healthy = healthy and worker.error is None and not worker.alive
    return healthy


def _take_groups() -> dict[int, dist.ProcessGroup]:
    """Every owner's groups and every recorded group, destroyed; the default group left alone."""
    default = dist.group.WORLD if dist.is_initialized() else None
    groups: dict[int, dist.ProcessGroup] = {}
    for owner in list(_owners):
        for group in owner.exit_groups():
            groups[id(group)] = group
    for group in list(_groups):
        groups[id(group)] = group
    _groups.clear()
    groups.pop(id(default), None)
    for group in groups.values():
        with contextlib.suppress(ValueError):  # gone with the default group already
            dist.destroy_process_group(group)
    return groups


def _join(groups: dict[int, dist.ProcessGroup], warn: bool = True) -> None:
    """Drop the last references to ``groups`` on a helper thread; wait for it, bounded.

    ``groups`` must hold the only references left: the backend's destructor,
    which joins Gloo's threads, runs when the helper clears it. ``warn``:
    say so when something else still holds one (at exit: the program).
    """
    helper = threading.Thread(
        target=_drop, args=(groups, warn), name="aps-comm-teardown", daemon=True
    )
    del groups
    helper.start()
    helper.join(JOIN_TIMEOUT_S)


def _drop(groups: dict[int, dist.ProcessGroup], warn: bool) -> None:
    held = list(groups.values())
    groups.clear()
    # Be the last to let go (module docstring): a callback still running on a
    # Gloo worker must not free its group there.
    if _others(held):
        # Garbage not yet collected (a cycle through a finished bucket's
        # closures) can hold one too.
        gc.collect()
    deadline = time.monotonic() + CALLBACK_WAIT_S
    while _others(held) and time.monotonic() < deadline:
        time.sleep(0.005)
    survivors = _others(held)
    if survivors and warn:
        # Something of the program's (a global, a module attribute) still holds
        # a group, so its threads outlive this handler: say what to change.
        print(
            f"aps_comm: {survivors} process group(s) that aps-comm created are still referenced "
            "by the program at exit, so their threads cannot be joined before Python shuts "
            "down (a rank may then abort at exit). Delete the references you keep to them "
            "(e.g. a global holding state.process_group) before the script ends.",
            file=sys.stderr,
        )
    held.clear()


def _others(held: list[dist.ProcessGroup]) -> int:
    """How many of ``held`` something else still refers to (the list and the call hold two)."""
    return sum(sys.getrefcount(held[i]) > 2 for i in range(len(held)))
