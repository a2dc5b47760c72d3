"""Where a bucket's work runs, so that the hook returns at once and backward never stalls.

- :class:`FifoWorker` (Gloo, CPU tensors): one thread per hook state runs the
  buckets in the order DDP hands them over, so every rank issues the same
  collectives in the same order, and completes the future the hook returned.
  The codec's kernels release the GIL, so they run beside backward.
- :func:`run_on_side_stream` (NCCL, CUDA tensors): the hook's thread enqueues
  the bucket's work on a side stream that waits for the gradients' producer,
  and returns a CUDA-aware future; nothing waits on the host.

Example:
    >>> worker = FifoWorker("demo")
    >>> worker.submit(lambda: 6 * 7).wait()
    42
    >>> worker.close()
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "FifoWorker",
    "WorkerFailed",
    "first_failure",
    "raised_by_backward",
    "run_on_side_stream",
]


class WorkerFailed(RuntimeError):
    """An earlier job of the worker failed; later jobs are not run.

    Its ``__cause__`` is that earlier job's exception.
    """


class FifoWorker:
    """A daemon thread that runs submitted jobs one at a time, in submission order.

    After a job raises, every later job fails at once with :class:`WorkerFailed`
    naming the first error: a rank that stopped half-way through a sequence of
    collectives must not start the next one out of step with its peers.

    Args:
        name: thread name, for debuggers and stack dumps.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # The first error, shared with the thread, which must not hold the
        # worker itself: the worker's finalizer stops the thread.
        self._failed: list[BaseException] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def submit(self, job: Callable[[], Any]) -> torch.futures.Future:
        """Queue ``job``; the returned future holds its result or its exception."""
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._start()
        self._queue.put((job, fut))
        return fut

    def _start(self) -> None:
        self._thread = threading.Thread(
            target=_loop, args=(self._queue, self._failed), name=self.name, daemon=True
        )
        self._thread.start()
        # Stop the thread at interpreter exit before torch tears down its
        # backends: a thread still alive in a collective then aborts the process.
        # A finalizer's atexit hook was registered with the first finalizer
        # of the process, before any process group, so it would run after
        # their teardown (atexit is last in, first out); this one runs first.
        self._finalizer = weakref.finalize(self, _stop, self._queue, self._thread)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued jobs, then stop the thread (waits up to ``timeout`` s)."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(timeout)
        if self._finalizer is not None:
            self._finalizer.detach()
            atexit.unregister(self._finalizer)

    @property
    def error(self) -> BaseException | None:
        """The first job's exception, if one raised (later jobs were not run)."""
        return self._failed[0] if self._failed else None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def _stop(q: queue.SimpleQueue, thread: threading.Thread) -> None:
    if thread.is_alive():
        q.put(None)
        # The owner's last reference may go on the worker's own thread.
        if thread is not threading.current_thread():
            thread.join(10.0)


def _loop(q: queue.SimpleQueue, failed: list[BaseException]) -> None:
    # Only the queue and the error slot are touched: no reference cycle keeps
    # the worker object alive, so its finalizer can run.
    while True:
        item = q.get()
        if item is None:
            return
        job, fut = item
        del item
        result, error = _run_one(job, failed)
        # The job's closure holds its owner (a hook state, its buffers). It goes
        # before the future completes: the caller may drop the owner as soon as
        # it has the result, and a reference still held here would keep the
        # owner, and so this thread, alive (for good, while it waits for a job).
        del job
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
        del fut, result, error


def _run_one(
    job: Callable[[], Any], failed: list[BaseException]
) -> tuple[Any, BaseException | None]:
    """``job()``'s result and None, or None and the error to complete its future with."""
    if failed:
        refused = WorkerFailed(f"not run: an earlier bucket failed with {failed[0]!r}")
        refused.__cause__ = failed[0]
        return None, refused
    try:
        with torch.no_grad():
            return job(), None
    except BaseException as exc:  # every error must reach the training loop
        failed.append(exc)
        return None, exc


def first_failure(exc: BaseException) -> BaseException:
    """The error to raise for ``exc``: a job refused after an earlier failure
    (:class:`WorkerFailed`) stands for that earlier failure.

    Example:
        >>> first = ValueError("bucket 3")
        >>> refused = WorkerFailed("not run")
        >>> refused.__cause__ = first
        >>> first_failure(refused) is first, first_failure(first) is first
        (True, True)
    """
    return exc.__cause__ if isinstance(exc, WorkerFailed) and exc.__cause__ else exc


def raised_by_backward(fut: torch.futures.Future, fallback: torch.Tensor) -> torch.futures.Future:
    """The future to hand DDP for ``fut``: its failure is raised by ``backward()`` itself.

    DDP's reducer reads a Python future's value in C++, where an exception
    set with ``set_exception`` is just a value: ``backward()`` would raise
    ``Unable to cast <the message> to Tensor``, and a callback that re-raises
    it comes out as ``Got the following error when running the callback:
    ...``. So the returned future always holds a tensor (``fallback``, the
    bucket's unreduced buffer, where ``fut`` failed), and a final callback of
    the backward pass, queued to run after DDP's own (which waits for the
    buckets and unflattens them), raises the exception itself: the caller of
    ``backward()`` gets its type and text. A bucket refused because an
    earlier one failed (:class:`WorkerFailed`) raises that earlier failure.

    Outside a backward pass (no final callbacks to queue) ``fut`` is
    returned as it is.

    Args:
        fut: a bucket's future from the worker (not a CUDA-aware one: the
            returned future does not carry stream dependencies).
        fallback: the tensor DDP gets where ``fut`` failed.

    Returns:
        A future that completes when ``fut`` does, always with a tensor.

    Example:
        >>> fut = torch.futures.Future()
        >>> raised_by_backward(fut, torch.zeros(1)) is fut  # outside backward(): as it is
        True
    """
    engine = torch.autograd.Variable._execution_engine
    failed: list[BaseException] = []
    out: torch.futures.Future = torch.futures.Future()

    def after_ddp() -> None:
        out.wait()
        if failed:
            raise first_failure(failed[0])

    try:
        # Queued now, this would run before DDP's callback (queued once every
        # bucket is handed over); queued from its own callback, it runs after.
        engine.queue_callback(lambda: engine.queue_callback(after_ddp))
    except RuntimeError:  # not inside backward(): whoever waits on fut sees its error
        return fut

    def done(f: torch.futures.Future) -> None:
        try:
            out.set_result(f.value())
        except BaseException as exc:  # raised by backward() once DDP is done
            failed.append(exc)
            out.set_result(fallback)

    fut.add_done_callback(done)
    return out


def run_on_side_stream(
    job: Callable[[], torch.Tensor], stream: torch.cuda.Stream
) -> torch.futures.Future:
    """Enqueue ``job`` on ``stream`` after the current stream's work; return a CUDA-aware future.

    The job must only enqueue device work (no host reads); its result tensor
    is ready for any stream that waits on the returned future.
    """
    device = stream.device
    producer = torch.cuda.current_stream(device)
    stream.wait_stream(producer)
    with torch.cuda.stream(stream), torch.no_grad():
        result = job()
        fut: torch.futures.Future = torch.futures.Future(devices=[device])
        # Records an event on `stream`: consumers wait for it, not for the host.
        fut.set_result(result)
    return fut
