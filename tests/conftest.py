"""Helpers shared by the multi-rank hook tests (test_hook, test_engine, test_hierarchical).

They run inside the ranks that :func:`aps_comm.testing.run_distributed` starts,
so they are plain importable functions rather than fixtures: a rank unpickles
its test function by module name and imports ``conftest`` from ``tests/``.

Example:
    >>> from conftest import Net, capture, check_log
    >>> log = []
    >>> ddp.register_comm_hook(state, capture(state, log))  # inside a rank
    >>> check_log(log, get_format("e4m3"), "two_phase", "layer")
"""

# No `from __future__ import annotations`: DDP's register_comm_hook checks
# the hook's `bucket` annotation is dist.GradBucket itself, not a string.
import fcntl
import itertools
import json
import math
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from aps_comm import APSState, aps_hook
from aps_comm.formats import FloatFormat, quantize
from aps_comm.plan import chunk_bounds
from aps_comm.scaling import exponents, layer_amax, pow2
from aps_comm.simulate import ring_chunks

__all__ = ["Net", "Starter", "capture", "check_log", "gather", "made_once", "reference"]


def made_once(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str, make: Callable[[], Any]
) -> Any:
    """``make()``, made by the first xdist worker of this run that asks, read by the rest.

    A module-scoped fixture is made once per worker that runs one of its tests,
    and the suite is CPU-bound: a job of several ranks made three times costs
    twice its CPU for nothing. The result (picklable) waits in the run's
    shared temporary folder; the others block on a lock meanwhile, idle.
    """
    if worker_id == "master":  # not under xdist
        return make()
    path = tmp_path_factory.getbasetemp().parent / f"{name}.pickle"
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return pickle.loads(path.read_bytes())
        out = make()
        path.write_bytes(pickle.dumps(out))
        return out


# Drives every route and option of the hook (benchmarks.hostcost's configurations, DDP
# and FSDP2) once through a world of one rank: one bucket each, so every numba kernel
# the suite's ranks call is compiled and written to the on-disk cache. Two of these run
# side by side, one through the configurations (DDP's, then FSDP2's) in order and one
# through each list backwards (argument "-1"): a kernel that one of them is compiling
# or has compiled, the other waits for and loads (cpu_kernels' compile lock), so they
# meet in the middle.
_WARM_KERNELS = """
import sys
import torch
from benchmarks import hostcost
step = int(sys.argv[1])
cpu = torch.device("cpu")
with hostcost.world_of_one(cpu):
    hostcost.measure(cpu, 1, routes=dict(list(hostcost.CONFIGS.items())[::step]))
    hostcost.measure_fsdp(cpu, 1, routes=dict(list(hostcost.FSDP_ROUTES.items())[::step]))
"""
_warming: list[subprocess.Popen] = []


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, compile the CPU kernels once in one process while the workers start.

    The kernels are cached on disk (numba ``cache=True``), but a fresh checkout
    starts cold, and a cold kernel is compiled by every process that meets it
    before the first one has written it: the 4-rank jobs and launched scripts of
    the first minutes compiled the same kernels side by side (all of them take
    ~63 s of CPU in one process, loading them ~1 s; one 4-rank HSDP test spent
    ~115 s of its ~130 s compiling). The workers' start (torch import,
    collection) overlaps the compile; tests are handed out once it is done
    (:func:`pytest_xdist_node_collection_finished`). ``-n 0`` compiles in its
    one process as it goes, as before.

    Two processes, one through the configurations forwards and one backwards,
    so that the second core, idle while the workers wait, compiles too: cold,
    the longer of the two took 124 s of CPU where one alone took 148 s, while
    the first configurations of each direction compiled the same kernels side
    by side; each signature is now compiled once, by whichever asks first
    (:class:`aps_comm.cpu_kernels._CompileOnce`), and so are those the
    warm-up does not reach, which every rank of a test's job compiled.
    """
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    root = Path(__file__).resolve().parents[1]
    for step in ("1", "-1"):
        _warming.append(
            subprocess.Popen(
                [sys.executable, "-c", _WARM_KERNELS, step],
                cwd=root,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )


def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Hold the first tests back until :func:`pytest_configure`'s compile has finished.

    A warm-up that fails or hangs only costs its time: the kernels then compile
    lazily, as without it.
    """
    # One deadline for both processes: a hang costs at most 300 s, as with one.
    deadline = time.monotonic() + 300
    while _warming:
        proc = _warming.pop()
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with slow tests first: xdist hands tests out in this order, so the
    long ones start while short ones can still fill the other workers, and the
    run does not end on one worker finishing a 40 s test alone. Whole modules
    move, in their own order: a module-scoped fixture is torn down when its
    worker goes on to another module's test, and made again when it comes back.
    """
    slow = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow)


class Net(nn.Module):
    """Parameter sizes are multiples of 4 so buckets split evenly over 4 ranks."""

    def __init__(self, *, unused: bool = False, empty: bool = False, zero: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 8)
        self.unused = nn.Linear(4, 4) if unused else None
        self.empty = nn.Parameter(torch.empty(0)) if empty else None
        # A layer whose gradient is exactly zero on every rank.
        self.z = nn.Parameter(torch.ones(4)) if zero else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        # Different gradient magnitudes per layer, so exponents differ.
        h = torch.relu(self.b(h)) * 1e-3
        out = self.c(h)
        if self.z is not None:
            out = out + 0.0 * self.z.sum()
        if self.empty is not None:
            out = out + self.empty.sum()
        return out


def capture(state: APSState, log: list):
    """A hook that records each bucket's raw input and output around aps_hook."""

    def hook(st: APSState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        raw = bucket.buffer().detach().clone()
        numels = [p.numel() for p in bucket.parameters()]
        fut = aps_hook(st, bucket)

        def save(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()
            log.append((bucket.index(), raw, numels, out.detach().clone()))
            return out

        return fut.then(save)

    return hook


def _gloo_ring_sum(
    q: torch.Tensor, dtype: torch.dtype, chunk_elements: int | None = None
) -> torch.Tensor:
    """Sum rows of ``q`` (N, n) in the order Gloo's ring all-reduce uses.

    Chunk c of the ring (:func:`aps_comm.simulate.ring_chunks`) accumulates
    ranks c-1, c-2, ..., c+1, then c, each addition in float32 rounded back to
    ``dtype`` (measured on Gloo). With ``chunk_elements`` every chunk of the
    bucket is its own all-reduce, as the hook pipelines it.
    """
    n_ranks, n = q.shape
    wire = q.to(dtype)
    if n_ranks == 1:
        return wire[0].float()
    out = torch.empty(n, dtype=dtype)
    for lo, hi in chunk_bounds(n, chunk_elements or max(n, 1)):
        starts = ring_chunks(hi - lo, n_ranks, wire.element_size())
        for c in range(n_ranks):
            sl = slice(lo + starts[c], lo + starts[c + 1])
            order = [(c - k) % n_ranks for k in range(1, n_ranks)] + [c]
            acc = wire[order[0], sl]
            for r in order[1:]:
                acc = (acc.float() + wire[r, sl].float()).to(dtype)
            out[sl] = acc
    return out.float()


def reference(
    raws: torch.Tensor,
    numels: list[int],
    fmt: FloatFormat,
    reduction: str,
    scaling: str,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """The exact averaged bucket from all ranks' raw buckets (N, n)."""
    n_ranks = raws.shape[0]
    raws = raws.float()
    bounds = [0, *torch.cumsum(torch.tensor(numels), 0).tolist()]
    layers = [raws[:, lo:hi] for lo, hi in itertools.pairwise(bounds)]
    amax = layer_amax([layer.reshape(-1) for layer in layers])
    exps = exponents(amax, fmt, world_size=n_ranks, reduction=reduction, scaling=scaling)
    q = torch.cat(
        [quantize(layer * pow2(e), fmt) for layer, e in zip(layers, exps, strict=True)], dim=1
    )
    if reduction == "two_phase":
        acc = q[0].clone()
        for r in range(1, n_ranks):
            acc = acc + q[r]
        reduced = quantize(acc / n_ranks, fmt)
        factors = pow2(-exps)
    else:
        reduced = _gloo_ring_sum(q, fmt.torch_dtype, chunk_elements)
        factors = pow2(-exps) / n_ranks
    out = torch.empty(raws.shape[1])
    for (lo, hi), f, a in zip(itertools.pairwise(bounds), factors, amax, strict=True):
        out[lo:hi] = reduced[lo:hi] * f if math.isfinite(a) else float("nan")
    return out


def gather(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.stack(parts)


def check_log(
    log: list,
    fmt: FloatFormat,
    reduction: str,
    scaling: str,
    dtype=None,
    chunk_elements: int | None = None,
) -> int:
    """Compare every captured bucket with the reference; returns buckets checked."""
    assert log, "the hook never ran"
    for _, raw, numels, out in sorted(log, key=lambda item: item[0]):
        raws = gather(raw)
        expected = reference(raws, numels, fmt, reduction, scaling, chunk_elements)
        if dtype is not None and dtype != torch.float32:
            expected = expected.to(dtype)
        got = out.float() if dtype is None else out
        ok = torch.equal(got.nan_to_num(nan=7.0), expected.to(got.dtype).nan_to_num(nan=7.0))
        assert ok, f"bucket mismatch: max diff {(got.float() - expected.float()).abs().max()}"
        # Bitwise identical on every rank.
        outs = gather(out.float())
        assert torch.equal(outs.nan_to_num(nan=7.0), outs[:1].expand_as(outs).nan_to_num(nan=7.0))
    return len(log)


class Starter:
    """The client of tests/launch_scripts/preloaded.py: start processes, hear them exit.

    Example:
        >>> scripts = Path("tests/launch_scripts")
        >>> starter = Starter(scripts / "preloaded.py", dict(os.environ))
        >>> script, env = str(scripts / "exit_codes.py"), dict(os.environ)
        >>> (pid,) = starter.start([{"script": script, "args": ["exit3"], "env": env, "log": "x.log"}])
        >>> [code for _, code, _ in starter.exits(60)]
        [3]
        >>> starter.close()
    """

    def __init__(self, script: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        # Importing torch takes long on a busy machine: the tests' own timeout bounds it.
        words = self._next(300)
        if words != ["READY"]:
            self.proc.kill()
            raise AssertionError(f"the starter did not start: {words}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout: float) -> list[str] | None:
        """The starter's next line, split; None if it has said nothing for ``timeout`` s."""
        try:
            line = self._lines.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        assert line is not None, f"the starter exited with {self.proc.wait()}"
        return line.split()

    def start(self, specs: list[dict], timeout: float = 60) -> list[int]:
        """Start one process per spec (script, args, env, log); their pids, in order.

        ``timeout`` bounds the starter's answer, which waits for a spec's ``preload``.
        """
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(specs) + "\n")
        self.proc.stdin.flush()
        words = self._next(timeout)
        assert words is not None and words[0] == "STARTED", words
        return [int(w) for w in words[1:]]

    def exits(self, timeout: float) -> Iterator[tuple[int, int, float]]:
        """(pid, exit code, time.time() of the exit) as processes end, until ``timeout``."""
        deadline = time.monotonic() + timeout
        while (words := self._next(deadline - time.monotonic())) is not None:
            if words[0] == "DONE":
                return
            assert words[0] == "EXITED", words
            yield int(words[1]), int(words[2]), float(words[3])

    def close(self) -> None:
        # Every request ended with DONE, its processes reaped: nothing is left to wait
        # for, and an interpreter holding torch can take long to exit on a busy machine.
        self.proc.kill()
        self.proc.wait(30)
