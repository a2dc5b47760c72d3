"""Clean exits: the ordered teardown that ``register`` installs (aps_comm/teardown.py).

What decides an exit is an order of events, checked here directly, never by
looping jobs and hoping: the hook's worker stops, then its process groups are
destroyed and their Gloo threads joined, then ``init_distributed``'s default
group goes, and a job that failed keeps its exit code. How often tiny jobs
abort at exit with and without it is measured by ``benchmarks/exits.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import re
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Starter
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import register
from aps_comm.testing import run_distributed

SCRIPT = Path(__file__).parent / "launch_scripts" / "exit_codes.py"
_JOB_VARS = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*)$")


def _gloo_threads() -> int:
    """Gloo's native threads in this process, by the names torch gives them.

    Counted by name, not in total: a Python thread that has returned from
    ``join()`` (the exit handler's helper) can still be listed for a moment.
    """
    names = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text())
    return sum("gloo" in name for name in names)


def _gloo_threads_down_to(floor: int, wait_s: float = 10.0) -> int:
    """:func:`_gloo_threads` once it is at most ``floor``, or after ``wait_s`` seconds.

    A joined thread can stay listed in /proc for a moment after its join returned
    (the kernel wakes the joiner before it releases the task), the longer the more
    loaded the machine: a thread really left running stays past the wait.
    """
    deadline = time.monotonic() + wait_s
    while (count := _gloo_threads()) > floor and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


def _released_at_exit(rank: int, world_size: int, drop: bool = False, keep: bool = False) -> dict:
    """Register, train two steps, run the exit handler ``register`` installed; report.

    With ``drop`` the model and the state are freed first, as when training
    runs in a function that returned before the interpreter exits. With
    ``keep`` the program still holds the hook's group (a global would) when
    the handler runs. What the handler writes to stderr is reported.
    """
    handlers = []
    real_register = atexit.register

    def capture(fn, *args, **kwargs):
        handlers.append(fn)
        return real_register(fn, *args, **kwargs)

    atexit.register = capture
    try:
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
        state = register(ddp, fmt="e4m3")
    finally:
        atexit.register = real_register
    # One handler, however often it was moved to the front of the atexit queue.
    installed = list(
        dict.fromkeys(h for h in handlers if getattr(h, "__module__", "") == "aps_comm.teardown")
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(rank)
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.randn(8, 16)).square().mean().backward()
        opt.step()
    workers = [t for t in threading.enumerate() if t.name.startswith("aps-comm-")]
    group = weakref.ref(state.process_group)
    kept = [state.process_group] if keep else []
    owner = weakref.ref(state)
    if drop:
        del ddp, opt, state
        gc.collect()
        assert owner() is None, "the state outlived its model"
    # Garbage that still refers to the group (as a finished bucket's closures
    # can) must not keep it, and its Gloo threads, alive past the handler.
    gc.disable()
    cycle: list = [group()]
    cycle.append(cycle)
    del cycle
    before = _gloo_threads()
    destroyed: list[tuple[bool, bool]] = []
    real_destroy = dist.destroy_process_group

    def logged(g: dist.ProcessGroup | None = None) -> None:
        destroyed.append((g is None, any(w.is_alive() for w in workers)))
        real_destroy(g)

    dist.destroy_process_group = logged
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        for handler in installed:
            handler()
    finally:
        said, sys.stderr = sys.stderr.getvalue(), stderr
        dist.destroy_process_group = real_destroy
        gc.enable()
    del kept
    after = _gloo_threads_down_to(before - 3)
    total = torch.ones(1)
    dist.all_reduce(total)  # the default group is not the hook's to release
    return {
        "installed": len(installed),
        "workers": len(workers),
        "workers_alive": any(w.is_alive() for w in workers),
        "destroyed": destroyed,
        "group_freed": group() is None,
        "stderr": said,
        "state_group_cleared": owner() is None or owner().process_group is None,
        "threads_joined": before - after,
        "default_sum": total.item(),
    }


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_register_installs_an_exit_handler_that_stops_then_joins() -> None:
    for rank, r in enumerate(run_distributed(_released_at_exit, 2)):
        assert r["installed"] == 1, (rank, r)
        assert r["workers"] == 1 and not r["workers_alive"], (rank, r)
        # Only the hook's own group, and only once its worker had stopped.
        assert r["destroyed"] == [(False, False)], (rank, r)
        assert r["group_freed"] and r["state_group_cleared"], (rank, r)
        # Joined by the handler's helper, so nothing to warn about: the last
        # reference was not the handler's own (a loop variable held it once).
        assert r["stderr"] == "", (rank, r)
        # The group's Gloo threads (two run loops, one TCP loop) are gone.
        assert r["threads_joined"] >= 3, (rank, r)
        assert r["default_sum"] == 2.0, (rank, r)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_groups_of_a_state_freed_before_exit_are_joined_too() -> None:
    """Training in a function: its model and state are gone at exit, their group is not.

    torch's registry keeps the hook's group, and its Gloo threads, alive
    after the state is freed; the handler must still destroy and join it.
    """
    for rank, r in enumerate(run_distributed(_released_at_exit, 2, args=(True,))):
        assert r["installed"] == 1, (rank, r)
        assert not r["workers_alive"], (rank, r)
        assert r["destroyed"] == [(False, False)], (rank, r)
        assert r["group_freed"], (rank, r)
        # The group's Gloo threads are gone (its worker stopped with the state).
        assert r["threads_joined"] >= 3, (rank, r)
        assert r["default_sum"] == 2.0, (rank, r)
        assert r["stderr"] == "", (rank, r)


def test_a_group_the_program_still_holds_is_named_with_what_to_do() -> None:
    """The one exit warning left: the program keeps a group, so its threads outlive the handler."""
    for rank, r in enumerate(run_distributed(_released_at_exit, 2, args=(False, True))):
        assert r["destroyed"] == [(False, False)], (rank, r)
        assert "1 process group(s) that aps-comm created are still referenced" in r["stderr"]
        assert "Delete the references you keep to them" in r["stderr"], (rank, r)


def _callback_holds_the_group(rank: int, world_size: int) -> dict:
    """A future's callback that refers to a group is still running when the handler joins it.

    Callbacks run on the Gloo worker that completed the collective, after the
    waiters wake, and are freed there. Were that the group's last reference,
    its destructor would join the worker from the worker itself: "Resource
    deadlock avoided", SIGABRT (the flaky abort of a benchmark whose capture
    hook's callback held its state). The callback here waits until the
    handler is inside its join (its garbage collection is the signal), so the
    order is forced, not hoped for.
    """
    from aps_comm import teardown

    handlers = []
    real_register = atexit.register
    atexit.register = lambda fn, *a, **k: handlers.append(fn) or real_register(fn, *a, **k)
    try:
        group = teardown.join_at_exit(dist.new_group())
    finally:
        atexit.register = real_register
    teardown.CALLBACK_WAIT_S = 60.0  # the callback's end, not a clock, decides
    started, release = threading.Event(), threading.Event()

    ran_on: list[int] = []

    def hold(fut: torch.futures.Future, group: dist.ProcessGroup = group) -> list:
        ran_on.append(threading.get_ident())
        started.set()
        release.wait(60)
        return fut.value()

    if rank == 0:
        # Rank 1 starts its half of the all-reduce only after the barrier (the default
        # group's, not this one's): the callback is attached before the all-reduce can
        # complete, so the completing worker runs it. (Both ranks starting it before the
        # barrier let it complete first, now and then: the callback then ran at once, on
        # this thread, and the test waited out its 60 s and failed.)
        work = dist.all_reduce(torch.ones(1), group=group, async_op=True)
        work.get_future().then(hold)
        dist.barrier()
        assert started.wait(60)
    else:
        dist.barrier()
        work = dist.all_reduce(torch.ones(1), group=group, async_op=True)
        work.wait()
        release.set()
    del work
    freed = weakref.ref(group)
    del group, hold
    gc.disable()
    gc.callbacks.append(lambda phase, info: release.set())
    before = _gloo_threads()
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        for handler in dict.fromkeys(handlers):
            handler()
    finally:
        said, sys.stderr = sys.stderr.getvalue(), stderr
        gc.callbacks.clear()
        gc.enable()
    return {
        "on_a_worker": ran_on != [threading.get_ident()],
        "released": release.is_set(),
        "group_freed": freed() is None,
        "threads_joined": before - _gloo_threads_down_to(before - 3),
        "stderr": said,
    }


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_callback_holding_the_group_does_not_free_it_on_a_gloo_thread() -> None:
    for rank, r in enumerate(run_distributed(_callback_holds_the_group, 2)):
        assert r["released"] and r["on_a_worker"], (rank, r)
        # Freed by the handler's helper, after the callback let go: not on the
        # worker (which aborts the process before this returns), not left behind.
        assert r["group_freed"] and r["stderr"] == "", (rank, r)
        assert r["threads_joined"] >= 3, (rank, r)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _JOB_VARS.match(k)}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def starter() -> Iterator[Starter]:
    started = Starter(SCRIPT.parent / "preloaded.py", _clean_env())
    try:
        yield started
    finally:
        started.close()


@pytest.mark.slow
def test_exit_order_and_failing_jobs_keep_their_exit_code(tmp_path: Path, starter: Starter) -> None:
    """A job that raises exits 1, one that calls sys.exit(3) exits 3; the teardown runs in order.

    World of one under ``init_distributed`` (tests/launch_scripts/exit_codes.py), each its
    own process forked from a starter that has imported torch
    (tests/launch_scripts/preloaded.py), exiting through the interpreter's own shutdown.
    """
    modes = ("raise", "exit3")
    pids = starter.start(
        [
            {
                "script": str(SCRIPT),
                "args": [mode],
                "env": _clean_env(),
                "log": str(tmp_path / f"{mode}.log"),
            }
            for mode in modes
        ]
    )
    codes = {pid: code for pid, code, _ in starter.exits(120)}
    assert set(codes) == set(pids), f"still running after 120 s: {set(pids) - set(codes)}"
    expected = {"raise": 1, "exit3": 3}
    for mode, pid in zip(modes, pids, strict=True):
        out = (tmp_path / f"{mode}.log").read_text()
        assert codes[pid] == expected[mode], out
        assert f"TRAINED mode={mode}" in out, out
        order = re.findall(r"^DESTROY .*$", out, re.M)
        assert order == ["DESTROY group worker_alive=False", "DESTROY default"], out
        assert "terminate called" not in out, out
        if mode == "raise":
            assert "RuntimeError: the job failed after training" in out, out


def _failed_register(rank: int, world_size: int, api: str) -> dict:
    """Ranks ask for different formats, so ``register`` raises; then what is left, and at exit?

    The ValueError is kept, as Python keeps an uncaught one (``sys.last_traceback``)
    until the exit handler runs: its frames must not hold a group.
    """
    from torch.distributed.fsdp import fully_shard

    from aps_comm import fsdp

    handlers = []
    real_register, real_new_group = atexit.register, dist.new_group
    made: list[weakref.ref] = []

    def capture(fn, *args, **kwargs):
        handlers.append(fn)
        return real_register(fn, *args, **kwargs)

    def recorded(*args, **kwargs):
        group = real_new_group(*args, **kwargs)
        made.append(weakref.ref(group))
        return group

    torch.manual_seed(0)
    fmt = "e4m3" if rank == 0 else "e5m2"
    if api == "ddp":
        model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    else:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        fully_shard(model)
    before = _gloo_threads()
    atexit.register, dist.new_group = capture, recorded
    kept: BaseException | None = None
    try:
        register(model, fmt=fmt) if api == "ddp" else fsdp.register(model, fmt)
    except ValueError as exc:
        kept = exc
    finally:
        atexit.register, dist.new_group = real_register, real_new_group
    left = _gloo_threads_down_to(before) - before
    installed = list(
        dict.fromkeys(h for h in handlers if getattr(h, "__module__", "") == "aps_comm.teardown")
    )
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        for handler in installed:
            handler()
    finally:
        said, sys.stderr = sys.stderr.getvalue(), stderr
    return {
        "error": f"{type(kept).__name__}: {kept}",
        "frames": [f.name for f in traceback.extract_tb(kept.__traceback__)] if kept else [],
        "made": len(made),
        "alive": sum(ref() is not None for ref in made),
        "gloo_threads_left": left,
        "installed": len(installed),
        "stderr": said,
    }


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("api", ["ddp", "fsdp"])
def test_a_failed_register_leaves_nothing_for_the_exit_handler(api: str) -> None:
    """The group register made is destroyed and joined before its error propagates (issue 45).

    Before, every rank printed at exit that the program still referenced a
    group aps-comm created: the kept error's frames held it.
    """
    for rank, r in enumerate(run_distributed(_failed_register, 2, args=(api,))):
        # The user's error, unchanged, with its traceback down to where it was raised.
        assert r["error"].startswith("ValueError: ") and "differs across ranks" in r["error"], r
        assert "e4m3" in r["error"] and "e5m2" in r["error"], (rank, r)
        assert r["frames"][0] == "_failed_register" and len(r["frames"]) >= 3, (rank, r)
        assert r["made"] == 1 and r["alive"] == 0, (rank, r)
        assert r["gloo_threads_left"] == 0, (rank, r)
        assert r["installed"] >= 1, (rank, r)  # the handler that would have printed it
        assert r["stderr"] == "", (rank, r)
