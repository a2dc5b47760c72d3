"""Host cost of the hook per bucket: kernel-launching ops and host microseconds.

On a GPU the hook is host-bound long before it is bandwidth-bound: every
ATen op that launches work and every Python step costs host time that the
bucket's bytes never pay back. This benchmark drives one bucket at a time
through the state's own path (:meth:`aps_comm.APSState.run_bucket`, what
the hook's worker runs) at world size 1 (Gloo on CPU, NCCL on CUDA) and
reports, per bucket at steady state (after the plan and the settled path
are bound):

- ``ops``: on CPU the ATen ops that launch work (views, allocations and
  collectives not counted) plus the codec's numba kernel calls; on CUDA the
  kernels the device ran (``torch.profiler``; NCCL's not counted);
- ``host_us``: the median wall time of one bucket on the host, less the
  time inside collectives (the wire's) and, on CPU, inside the codec's
  kernels (the device's work on a GPU, where launches return at once);
- ``settled``: whether the bucket runs the settled path (a few bound calls)
  or falls back to the general per-step one;
- ``state_bytes``: the bytes of every tensor reachable from the state after
  the bucket (plans, scratch, residuals, statistics; the bucket's buffer and
  the parameters excluded), the memory the hook keeps; ``residual_bytes``:
  error feedback's residuals among them; the table gives what is kept beyond
  the residuals over the bucket's FP32 bytes (the bucket is the largest: the
  state's scratch is one workspace sized by it, :mod:`aps_comm.workspace`);
- with ``--memory B``, instead, the state's bytes for a model of B buckets
  of :data:`MEMORY_BUCKET` (the issue's 8.4M parameters for B = 8): what the
  state keeps beyond residuals must stay within 3x one bucket's FP32 bytes
  whatever B (:func:`measure_memory`);
- for a model of many small layers and one of few large ones, for the
  two_phase, native and block routes and, with ``--configs all``, for every
  option a user turns on (:data:`CONFIGS`: statistics, error feedback,
  bucket scaling, no scaling (the naive cast), agreed block exponents, the
  policies, formats interleaved layer by layer, 16-bit two_phase and blocks, "auto").

Target (issue #34): at most 15 ops, the same for 2 or 200 layers, and at
most 300 us per bucket on a quiet 2-core machine (150 us on a GPU host).

Usage::

    python -m benchmarks.hostcost [--device cpu] [--repeats 50] [--configs routes|all|fsdp|NAME,...] [--out FILE]
    python -m benchmarks.hostcost --memory 8 [--configs routes|all|NAME,...]

Example:
    >>> rows = measure(torch.device("cpu"), repeats=3)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import types
import unittest.mock
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

import aps_comm
from aps_comm import codec, cpu_kernels
from aps_comm.formats import get_format
from aps_comm.policy import ByName, KeepLast, Promote, Schedule
from aps_perfmodel.collectives import LinkParams
from aps_perfmodel.profile import Profile

__all__ = [
    "CONFIGS",
    "FAST_LINK",
    "FSDP_ROUTES",
    "MEMORY_BUCKET",
    "MODELS",
    "ROUTES",
    "MemoryRow",
    "OpCounter",
    "ParamLayer",
    "Row",
    "allreduce_hook_bucket",
    "count_calls",
    "count_ops",
    "every_other_fp32",
    "fsdp_unit",
    "main",
    "measure",
    "measure_allreduce_hook",
    "measure_fsdp",
    "measure_memory",
    "memory_table",
    "residual_nbytes",
    "state_nbytes",
    "thirds_fp16_fp32",
]

MODELS: dict[str, list[int]] = {
    "many-small": [2048] * 200,
    "few-large": [131072] * 4,
}
"""Layer sizes of one bucket: 200 layers of 2k elements, or 4 of 128k."""

MEMORY_BUCKET: list[int] = [131072] * 8
"""One bucket of ``--memory``'s model: 8 layers of 128k elements (8 buckets: 8.4M parameters)."""

ROUTES: dict[str, dict[str, Any]] = {
    "two_phase": {"fmt": "e4m3", "reduction": "two_phase"},
    "native": {"fmt": "fp16", "reduction": "allreduce"},
    "block": {"fmt": "e2m1", "reduction": "two_phase", "scaling": "block"},
}
"""The routes measured: APS e4m3 two_phase, FP16 native sums, e2m1 block two_phase."""

FAST_LINK = Profile(world_size=1, backend="gloo", link=LinkParams(alpha=5e-6, beta=5e-12))
"""A calibrated profile of a link of 5 us and 200 GB/s: "auto" sends every bucket in FP32."""

CONFIGS: dict[str, dict[str, Any]] = {
    **ROUTES,
    "two_phase+stats": {**ROUTES["two_phase"], "stats": True},
    "block+stats": {**ROUTES["block"], "stats": True},
    "two_phase+error_feedback": {**ROUTES["two_phase"], "error_feedback": True},
    "block+error_feedback": {**ROUTES["block"], "error_feedback": True},
    "two_phase+error_feedback+stats": {
        **ROUTES["two_phase"],
        "error_feedback": True,
        "stats": True,
    },
    "block+error_feedback+stats": {**ROUTES["block"], "error_feedback": True, "stats": True},
    "bucket": {**ROUTES["two_phase"], "scaling": "bucket"},
    "bucket+stats": {**ROUTES["two_phase"], "scaling": "bucket", "stats": True},
    "none": {**ROUTES["two_phase"], "scaling": "none"},
    "none+stats": {**ROUTES["two_phase"], "scaling": "none", "stats": True},
    "block_agreed": {**ROUTES["block"], "block_exponents": "agreed"},
    "keep_last": {**ROUTES["two_phase"], "policy": [KeepLast("fp32")]},
    "keep_last+stats": {**ROUTES["two_phase"], "stats": True, "policy": [KeepLast("fp32")]},
    "keep_last+promote": {**ROUTES["two_phase"], "policy": [Promote(), KeepLast("fp32")]},
    "keep_last+block": {**ROUTES["block"], "policy": [KeepLast("fp32")]},
    "keep_last+error_feedback": {
        **ROUTES["two_phase"],
        "error_feedback": True,
        "policy": [KeepLast("fp32")],
    },
    "keep_last+block+error_feedback": {
        **ROUTES["block"],
        "error_feedback": True,
        "policy": [KeepLast("fp32")],
    },
    "promote": {**ROUTES["two_phase"], "policy": [Promote()]},
    "interleaved+error_feedback": {
        **ROUTES["two_phase"],
        "error_feedback": True,
        "policy": [ByName({"*[13579].weight": "fp16"}), KeepLast("fp32")],
    },
    "promote+error_feedback": {
        **ROUTES["two_phase"],
        "error_feedback": True,
        "policy": [Promote()],
    },
    "schedule": {**ROUTES["two_phase"], "policy": [Schedule(steps=1)]},
    "fp16_two_phase": {"fmt": "fp16", "reduction": "two_phase"},
    "fp16_block": {**ROUTES["block"], "fmt": "fp16"},
    "bf16_block": {**ROUTES["block"], "fmt": "bf16"},
    "fp16_block+stats": {**ROUTES["block"], "fmt": "fp16", "stats": True},
    "fp16_block_agreed": {**ROUTES["block"], "fmt": "fp16", "block_exponents": "agreed"},
    "hierarchical+keep_last+block_agreed": {
        **ROUTES["block"],
        "reduction": "hierarchical",
        "ranks_per_node": 1,  # a world of one: one node of one rank
        "block_exponents": "agreed",
        "policy": [KeepLast("fp32")],
    },
    "interleaved+promote": {
        **ROUTES["two_phase"],
        "policy": [Promote(), ByName({"*[13579].weight": "fp16"}), KeepLast("fp32")],
    },
    "interleaved+bucket+stats": {
        **ROUTES["two_phase"],
        "scaling": "bucket",
        "stats": True,
        "policy": [ByName({"*[13579].weight": "fp16"}), KeepLast("fp32")],
    },
    "interleaved+block+stats": {
        **ROUTES["block"],
        "stats": True,
        "policy": [ByName({"*[13579].weight": "e4m3"}), KeepLast("fp32")],
    },
    "native+block": {**ROUTES["native"], "scaling": "block"},
    "native+error_feedback": {**ROUTES["native"], "error_feedback": True},
    "native+block+error_feedback": {**ROUTES["native"], "scaling": "block", "error_feedback": True},
    "keep_last+native+block": {
        **ROUTES["native"],
        "scaling": "block",
        "policy": [KeepLast("fp32")],
    },
    "keep_last+native+error_feedback": {
        **ROUTES["native"],
        "error_feedback": True,
        "policy": [KeepLast("fp32")],
    },
    "interleaved+native+block+error_feedback": {
        **ROUTES["native"],
        "fmt": "bf16",
        "scaling": "block",
        "error_feedback": True,
        "policy": [ByName({"*[13579].weight": "fp16"}), KeepLast("fp32")],
    },
    "interleaved+hierarchical+stats": {
        **ROUTES["two_phase"],
        "reduction": "hierarchical",
        "ranks_per_node": 1,
        "stats": True,
        "policy": [ByName({"*[13579].weight": "fp16"}), KeepLast("fp32")],
    },
    "auto": {"fmt": "e4m3", "reduction": "auto"},
    "auto/fp32": {"fmt": "e4m3", "reduction": "auto", "profile": FAST_LINK},
    # Promote over a staged bucket in several formats, and over a bucket all in FP32
    # (the ladder's top: Promote may move it out again, so its maxima are still agreed).
    "hierarchical+keep_last+promote": {
        "fmt": "e4m3",
        "reduction": "hierarchical",
        "ranks_per_node": 1,
        "policy": [Promote(), KeepLast("fp32")],
    },
    "fp32+promote": {
        **ROUTES["two_phase"],
        "policy": [Promote(ladder=("e4m3", "fp32")), ByName({"*": "fp32"})],
    },
    "auto/fp32+keep_last+promote": {
        "fmt": "e4m3",
        "reduction": "auto",
        "profile": FAST_LINK,
        "policy": [Promote(), KeepLast("fp32")],
    },
}
"""Every option a user turns on, beside the three plain routes (``--configs all``).

"auto/fp32" is "auto" on a link fast enough that it sends every bucket as
the plain FP32 all-reduce (what it picks on NVLink), beside which ``--configs all``
measures PyTorch's ``allreduce_hook`` (:func:`measure_allreduce_hook`)."""


def every_other_fp32(name: str, param: torch.nn.Parameter) -> str | None:
    """A :class:`~aps_comm.policy.ByName` rule: every other parameter (odd index) kept in
    FP32, as a model's norms between its weights: a unit of as many runs as parameters.

    Example:
        >>> every_other_fp32("ps.3", None), every_other_fp32("ps.4", None)
        ('fp32', None)
    """
    return "fp32" if int(name.rpartition(".")[2]) % 2 else None


def thirds_fp16_fp32(name: str, param: torch.nn.Parameter) -> str | None:
    """A :class:`~aps_comm.policy.ByName` rule: parameters in turn in the unit's format,
    FP16 and FP32: a unit of two scaled formats beside FP32 runs.

    Example:
        >>> [thirds_fp16_fp32(f"ps.{i}", None) for i in range(3)]
        [None, 'fp16', 'fp32']
    """
    return (None, "fp16", "fp32")[int(name.rpartition(".")[2]) % 3]


FSDP_ROUTES: dict[str, dict[str, Any]] = {
    "fsdp/e4m3": {"fmt": "e4m3"},
    "fsdp/e2m1-block": {"fmt": "e2m1", "scaling": "block"},
    "fsdp/e4m3+stats": {"fmt": "e4m3", "stats": True},
    "fsdp/e2m1-block+stats": {"fmt": "e2m1", "scaling": "block", "stats": True},
    "fsdp/e4m3+fp32": {"fmt": "e4m3", "policy": [ByName(every_other_fp32)]},
    "fsdp/e4m3+fp32+stats": {"fmt": "e4m3", "stats": True, "policy": [ByName(every_other_fp32)]},
    "fsdp/e4m3+none+fp32+stats": {
        "fmt": "e4m3",
        "scaling": "none",
        "stats": True,
        "policy": [ByName(every_other_fp32)],
    },
    "fsdp/e5m2+fp16+fp32-bucket+stats": {
        "fmt": "e5m2",
        "scaling": "bucket",
        "stats": True,
        "policy": [ByName(thirds_fp16_fp32)],
    },
    "fsdp/e4m3+none": {"fmt": "e4m3", "scaling": "none"},
    "fsdp/e2m1-block+odd": {"fmt": "e2m1", "scaling": "block", "odd_row": True},
    "fsdp/e2m1+fp32+odd": {"fmt": "e2m1", "policy": [ByName(every_other_fp32)], "odd_row": True},
    "fsdp/e4m3+fp32-block": {
        "fmt": "e4m3",
        "scaling": "block",
        "policy": [ByName(every_other_fp32)],
    },
    "fsdp/e4m3+fp32-block+stats": {
        "fmt": "e4m3",
        "scaling": "block",
        "stats": True,
        "policy": [ByName(every_other_fp32)],
    },
    "fsdp/e5m2+fp16+fp32-block": {
        "fmt": "e5m2",
        "scaling": "block",
        "policy": [ByName(thirds_fp16_fp32)],
    },
    "fsdp/fp32": {"fmt": "fp32"},
    "hsdp/fp32": {"fmt": "fp32"},
    "hsdp/e4m3": {"fmt": "e4m3"},
    "hsdp/e2m1-block": {"fmt": "e2m1", "scaling": "block"},
    "hsdp/e4m3+stats": {"fmt": "e4m3", "stats": True},
}
"""FSDP2 (``--configs fsdp``): a unit's APS reduce-scatter ("fsdp/"), and its shard's
all-reduce across HSDP replicas ("hsdp/": :func:`aps_comm.fsdp.register` with ``replicate=``)."""

_UNCOUNTED = {"empty.memory_format", "empty_strided.default", "lift_fresh.default"}

# The codec's kernels: numba on CPU, Triton on CUDA (both called through their modules).
_CPU_KERNELS = (
    "encode",
    "decode",
    "reduce_shards",
    "reduce_blocks",
    "reduce_rank_blocks",
    "two_phase_keys",
    "spread_maximum",
    "maxima_factors",
    "maxima_factors_into",
    "key_factors",
    "block_factors_into",
    "native_block_keys",
    "native_block_factors",
    "native_factors_into",
    "underflow_rates",
    "block_amax",
    "block_keys",
    "block_records",
    "layer_any",
    "layer_records",
    "send_rank_blocks",
    "owner_rank_blocks",
    "decode_rank_blocks",
    "send_agreed_blocks",
    "owner_agreed_blocks",
    "decode_agreed_blocks",
    "mean_rank_blocks",
    "mean_rows",
    "node_send",
    "sum_rows",
    "reduce_encode",
    "or_rows",
    "staged_factors_into",
    "staged_keys",
    "staged_key_factors",
    "keep_lost",
    "owner_lost",
    "gather_add",
    "encode_keep",
    "owner_feedback",
    "unit_records",
    "unit_keys",
    "unit_block_factors",
    "unit_maxima",
    "unit_agreed",
    "copy_spans",
    "sum_runs",
)
_TRITON_KERNELS = (
    "encode",
    "decode",
    "reduce_shards",
    "shard_mean",
    "reduce_blocks",
    "reduce_rank_blocks",
    "layer_maxima",
)


class OpCounter(TorchDispatchMode):
    """Counts ATen ops that launch work (not views, allocations or collectives)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        name = func._opname + "." + func._overloadname
        if not (func.is_view or func.namespace == "c10d" or name in _UNCOUNTED):
            self.ops.append(f"{func.namespace}::{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _kernels(device: torch.device, calls: list[str], seconds: list[float]) -> Iterator[None]:
    """Count the codec's kernel calls into ``calls`` and their time into ``seconds``."""
    if device.type == "cpu":
        module, names = cpu_kernels, _CPU_KERNELS
    else:
        from aps_comm import triton_codec

        module, names = triton_codec, _TRITON_KERNELS
    saved = {n: getattr(module, n) for n in names if hasattr(module, n)}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(f"kernel::{name}")
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - start)

        return counted

    try:
        for name, fn in saved.items():
            setattr(module, name, wrap(name, fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


class _TimedWork:
    """A collective's work whose ``wait`` is timed (on Gloo it blocks for the transfer)."""

    def __init__(self, work: Any, seconds: list[float]) -> None:
        self._work, self._seconds = work, seconds

    def wait(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._work.wait(*args)
        finally:
            self._seconds.append(time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


_COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather_single")


@contextlib.contextmanager
def _collectives(seconds: list[float]) -> Iterator[None]:
    """Time every collective (its call and its wait) into ``seconds``: the wire's time, not
    the host's (NCCL returns at once; Gloo at world size 1 still hands off to its threads)."""
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                work = fn(*args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - start)
            return _TimedWork(work, seconds) if work is not None else None

        return timed

    try:
        for name, fn in saved.items():
            setattr(dist, name, wrap(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@dataclasses.dataclass(frozen=True)
class Row:
    """One model and route: what one settled bucket costs on the host."""

    model: str
    route: str
    layers: int
    elements: int
    ops: int
    aten_ops: int
    kernels: int
    host_us: float
    kernel_us: float
    wire_us: float
    total_us: float
    op_names: tuple[str, ...]
    settled: bool = True
    state_bytes: int = 0
    residual_bytes: int = 0

    @property
    def kept_ratio(self) -> float:
        """What the state keeps beyond residuals over the (largest) bucket's FP32 bytes."""
        return (self.state_bytes - self.residual_bytes) / max(4 * self.elements, 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_ops(
    state: aps_comm.APSState, buffer: torch.Tensor, params: list[torch.Tensor]
) -> tuple[list[str], list[str]]:
    """(ATen ops, codec kernel calls) of one bucket through ``state``'s path.

    On CUDA the kernels are what the device ran (``torch.profiler``, NCCL's
    left out): the ATen ops that launched some of them are listed apart, not
    added (see :func:`measure`).
    """
    if buffer.device.type == "cuda":
        counter = OpCounter()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof, counter:
            state.run_bucket(0, buffer, params)
            torch.cuda.synchronize(buffer.device)
        kernels = [
            f"cuda::{e.name}"
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.lower().startswith("nccl")
            and not getattr(e, "is_user_annotation", False)
        ]
        return counter.ops, kernels
    return count_calls(lambda: state.run_bucket(0, buffer, params), buffer.device)


def count_calls(call: Callable[[], Any], device: torch.device) -> tuple[list[str], list[str]]:
    """(ATen ops, codec kernel calls) of ``call()`` on the CPU.

    Example:
        >>> aten, kernels = count_calls(lambda: torch.ones(3).add_(1), torch.device("cpu"))
        >>> aten
        ['aten::ones.default', 'aten::add_.Tensor']
    """
    calls: list[str] = []
    counter = OpCounter()
    with _kernels(device, calls, []), counter:
        call()
    return counter.ops, calls


def _bucket(
    numels: list[int], device: torch.device, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.randn(sum(numels), generator=gen).to(device)
    params = [torch.nn.Parameter(torch.empty(n, device=device)) for n in numels]
    return buffer, params


class ParamLayer(torch.nn.Module):
    """One parameter as a module of its own: policies key layers by module name."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


# What a walk from the state must not enter: code, classes and modules hold
# no tensor of the state's own, and lead to the whole interpreter; a model,
# a process group and a thread are someone else's.
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.CodeType,
    torch.nn.Module,
    dist.ProcessGroup,
    threading.Thread,
)


def state_nbytes(state: object, exclude: list[torch.Tensor]) -> int:
    """Bytes of the distinct tensor storages and numpy arrays reachable from ``state``,
    less ``exclude``'s.

    Follows every object the garbage collector sees ``state`` refer to
    (attributes, slots, containers, closures' cells), not into modules,
    classes, code, models, process groups or threads.
    A storage shared by several views counts once; a numpy array counts where
    its memory is not a reachable tensor's (bound CPU calls keep both: arrays
    of their own, and numpy views of tensors).

    Example:
        >>> state_nbytes({"a": torch.zeros(4), "b": [torch.zeros(2), np.zeros(3, np.int32)]}, [])
        36
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    ranges = [_extent(t.untyped_storage()) for t in exclude]
    arrays: dict[int, int] = {}
    seen: set[int] = set()
    stack: list[object] = [state]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if is_traceable_wrapper_subclass(obj):
                # A tensor subclass (a DTensor: a model's parameter) holds
                # its storage in a plain tensor the walk reaches, if any.
                stack.extend(gc.get_referents(obj))
                continue
            storage = obj.untyped_storage()
            ranges.append(_extent(storage))
            if storage.data_ptr() not in skip:
                storages[storage.data_ptr()] = storage.nbytes()
            continue
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            start = base.__array_interface__["data"][0]
            arrays[start] = max(arrays.get(start, 0), base.nbytes)
            continue
        stack.extend(gc.get_referents(obj))
    own = sum(n for a, n in arrays.items() if not any(lo <= a < hi for lo, hi in ranges))
    return sum(storages.values()) + own


def _extent(storage: torch.UntypedStorage) -> tuple[int, int]:
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def residual_nbytes(state: aps_comm.APSState) -> int:
    """Bytes of error feedback's residuals in ``state`` (0 without error feedback)."""
    feedback = state.reducer.feedback if state.reducer is not None else None
    return state_nbytes(feedback.residuals, []) if feedback is not None else 0


def _timed(
    call: Callable[[], Any], device: torch.device, repeats: int
) -> tuple[float, float, float, float]:
    """Medians over ``repeats`` calls, in us: host, in the codec's kernels, in collectives, total."""
    total, host, in_kernels, on_wire = [], [], [], []
    for _ in range(repeats):
        seconds: list[float] = []
        wire: list[float] = []
        _sync(device)
        with _kernels(device, [], seconds), _collectives(wire):
            start = time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
        _sync(device)
        kernel_s = sum(seconds) if device.type == "cpu" else 0.0
        total.append(elapsed)
        in_kernels.append(kernel_s)
        on_wire.append(sum(wire))
        host.append(elapsed - kernel_s - sum(wire))
    med = [round(statistics.median(v) * 1e6, 1) for v in (host, in_kernels, on_wire, total)]
    return med[0], med[1], med[2], med[3]


def measure(
    device: torch.device,
    repeats: int = 50,
    models: dict[str, list[int]] | None = None,
    routes: dict[str, dict[str, Any]] | None = None,
) -> list[Row]:
    """Every model and route's :class:`Row`, in a world of one rank already initialised."""
    rows = []
    for model, numels in (models or MODELS).items():
        for route, options in (routes or ROUTES).items():
            state = aps_comm.APSState(**options)
            buffer, params = _bucket(numels, device, 0)
            # Policies and error feedback key layers by parameter name, one module each.
            state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
            for _ in range(3):  # the plan, then the settled path, then one more
                state.run_bucket(0, buffer, params)
            _sync(device)
            aten, kernels = count_ops(state, buffer, params)
            host, in_kernels, on_wire, total = _timed(
                functools.partial(state.run_bucket, 0, buffer, params), device, repeats
            )
            # On CUDA every launch is a kernel the device ran: the ATen ops are among them.
            ops = len(kernels) if device.type == "cuda" else len(aten) + len(kernels)
            rows.append(
                Row(
                    model,
                    route,
                    len(numels),
                    sum(numels),
                    ops,
                    len(aten),
                    len(kernels),
                    host,
                    in_kernels,
                    on_wire,
                    total,
                    tuple(aten + kernels),
                    state.reducer is not None and state.reducer.steady_for(0, buffer) is not None,
                    state_nbytes(state, [buffer, *params]),
                    residual_nbytes(state),
                )
            )
    return rows


class _TorchBucket:
    """What ``allreduce_hook`` reads of DDP's ``GradBucket`` (which Python cannot construct)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


def allreduce_hook_bucket(buffer: torch.Tensor) -> torch.Tensor:
    """PyTorch's ``allreduce_hook`` on one bucket, waited for (the default group's average).

    Example:
        >>> allreduce_hook_bucket(torch.ones(4))  # doctest: +SKIP
        tensor([1., 1., 1., 1.])
    """
    return default_hooks.allreduce_hook(None, _TorchBucket(buffer)).wait()  # type: ignore[arg-type]


def measure_allreduce_hook(
    device: torch.device, repeats: int = 50, models: dict[str, list[int]] | None = None
) -> list[Row]:
    """PyTorch's ``default_hooks.allreduce_hook`` per bucket, as :func:`measure` measures APS's.

    What the FP32 route ("auto" on fast links) must not exceed.

    Example:
        >>> measure_allreduce_hook(torch.device("cpu"), 3)[0].ops  # doctest: +SKIP
        1
    """
    rows = []
    for model, numels in (models or MODELS).items():
        buffer, _ = _bucket(numels, device, 0)
        allreduce_hook_bucket(buffer)
        _sync(device)
        if device.type == "cuda":
            counter = OpCounter()
            activities = [
                torch.profiler.ProfilerActivity.CPU,
                torch.profiler.ProfilerActivity.CUDA,
            ]
            with torch.profiler.profile(activities=activities) as prof, counter:
                allreduce_hook_bucket(buffer)
                torch.cuda.synchronize(device)
            aten = counter.ops
            kernels = [
                f"cuda::{e.name}"
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA
                and not e.name.lower().startswith("nccl")
            ]
        else:
            aten, kernels = count_calls(functools.partial(allreduce_hook_bucket, buffer), device)
        host, on_wire, total = _hook_timed(buffer, device, repeats)
        ops = len(kernels) if device.type == "cuda" else len(aten) + len(kernels)
        rows.append(
            Row(
                model,
                "allreduce_hook",
                len(numels),
                sum(numels),
                ops,
                len(aten),
                len(kernels),
                host,
                0.0,
                on_wire,
                total,
                tuple(aten + kernels),
            )
        )
    return rows


def _hook_timed(buffer: torch.Tensor, device: torch.device, repeats: int) -> tuple[float, ...]:
    """As :func:`_timed` for ``allreduce_hook``: waiting for its future is the wire's time too.

    Returns (host, collectives, total) medians in us.
    """
    host, on_wire, total = [], [], []
    for _ in range(repeats):
        wire: list[float] = []
        _sync(device)
        with _collectives(wire):
            start = time.perf_counter()
            fut = default_hooks.allreduce_hook(None, _TorchBucket(buffer))  # type: ignore[arg-type]
            waited = time.perf_counter()
            fut.wait()
            wire.append(time.perf_counter() - waited)
            elapsed = time.perf_counter() - start
        _sync(device)
        total.append(elapsed)
        on_wire.append(sum(wire))
        host.append(elapsed - sum(wire))
    return tuple(round(statistics.median(v) * 1e6, 1) for v in (host, on_wire, total))


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """What a state keeps for a model of ``buckets`` buckets of ``bucket_elements`` each."""

    route: str
    buckets: int
    bucket_elements: int
    state_bytes: int
    residual_bytes: int

    @property
    def kept_ratio(self) -> float:
        """Bytes beyond residuals over one (the largest) bucket's FP32 bytes."""
        return (self.state_bytes - self.residual_bytes) / (4 * self.bucket_elements)

    @property
    def model_ratio(self) -> float:
        """Every byte kept, residuals included, over the model's FP32 gradient bytes."""
        return self.state_bytes / (4 * self.bucket_elements * self.buckets)


def measure_memory(
    device: torch.device,
    routes: dict[str, dict[str, Any]],
    buckets: int = 8,
    layers: list[int] | None = None,
    seed: int = 0,
) -> list[MemoryRow]:
    """Per route, the bytes a state keeps after 3 steps of ``buckets`` buckets of ``layers``.

    Every bucket runs the state's own path (:meth:`aps_comm.APSState.run_bucket`)
    in DDP's order, each step ending at the last; the buckets' buffers and the
    parameters are not counted (:func:`state_nbytes`). In a process group
    already initialised (any world size).

    Example:
        >>> [row] = measure_memory(torch.device("cpu"), {"two_phase": ROUTES["two_phase"]})  # doctest: +SKIP
    """
    layers = layers or MEMORY_BUCKET
    rows = []
    for route, options in routes.items():
        state = aps_comm.APSState(**options)
        model = [_bucket(layers, device, seed + b) for b in range(buckets)]
        params = [p for _, ps in model for p in ps]
        state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
        for _ in range(3):  # the plans, then the settled paths, then one more
            for i, (buffer, ps) in enumerate(model):
                state.run_bucket(i, buffer, ps, is_last=i == buckets - 1)
        _sync(device)
        kept = state_nbytes(state, [b for b, _ in model] + params)
        rows.append(MemoryRow(route, buckets, sum(layers), kept, residual_nbytes(state)))
    return rows


def memory_table(rows: list[MemoryRow]) -> str:
    """The rows of :func:`measure_memory` as a Markdown table."""
    lines = [
        "| route | buckets | elements per bucket | state bytes | of which residuals "
        "| state / model FP32 | beyond residuals / bucket FP32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.route} | {r.buckets} | {r.bucket_elements} | {r.state_bytes} "
            f"| {r.residual_bytes} | {r.model_ratio:.2f}x | {r.kept_ratio:.2f}x |"
        )
    return "\n".join(lines)


class _Unit(torch.nn.Module):
    def __init__(self, numels: list[int], device: torch.device) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter(torch.empty(n, device=device)) for n in numels
        )


def fsdp_unit(
    numels: list[int], device: torch.device, options: dict[str, Any], replicated: bool
) -> tuple[Any, Callable[[torch.Tensor], None], list[torch.Tensor]]:
    """One ``fully_shard``-ed unit of ``numels`` parameters with APS registered (world of one).

    ``options`` are :func:`aps_comm.fsdp.register`'s, and ``odd_row``: the
    first parameter one element longer (a row of an odd number of elements).

    Returns:
        The :class:`~aps_comm.fsdp.APSFSDPState`, the call that reduces one
        step's gradients of the unit as FSDP makes it (the all-reduce hook
        across replicas; or the APS reduce-scatter, which FSDP itself skips
        on one rank), and the unit's parameters (their local shards).
    """
    from torch.distributed.fsdp import fully_shard

    from aps_comm import fsdp

    options = dict(options)
    if options.pop("odd_row", False):
        numels = [numels[0] + 1, *numels[1:]]
    unit = _Unit(numels, device)
    fully_shard(unit)
    params = [p.to_local() for p in unit.parameters()]
    if replicated:
        state = fsdp.register(unit, replicate=dist.new_group([0]), **options)
        return state, state.all_reduce_hooks[0], params
    state = fsdp.register(unit, **options)
    reducer, names = state.reducer, [f"ps.{i}" for i in range(len(numels))]
    flag = torch.zeros((), device=device)

    def reduce_scatter(rows: torch.Tensor) -> None:
        reducer.unit(0, rows.view(1, -1), numels, numels, names, step=0, problem=flag)

    return state, reduce_scatter, params


def measure_fsdp(
    device: torch.device,
    repeats: int = 50,
    models: dict[str, list[int]] | None = None,
    routes: dict[str, dict[str, Any]] | None = None,
) -> list[Row]:
    """:data:`FSDP_ROUTES`' rows: one FSDP unit per bucket, in a world of one rank."""
    rows = []
    for model, numels in (models or MODELS).items():
        for route, options in (routes or FSDP_ROUTES).items():
            state, reduce, params = fsdp_unit(numels, device, options, route.startswith("hsdp/"))
            n = sum(p.numel() for p in params)
            shard = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
            for _ in range(3):  # the plan, then the settled path, then one more
                reduce(shard)
            _sync(device)
            aten, calls = count_calls(functools.partial(reduce, shard), device)
            host, in_kernels, on_wire, total = _timed(
                functools.partial(reduce, shard), device, repeats
            )
            replicas = state.replica_reducer
            # What a real step keeps: FSDP ends each step (the reducers hand over their
            # records), so the state holds one step's statistics, not every repeat's.
            for reducer in (state.reducer, replicas):
                if reducer is not None:
                    reducer.end_step()
            reduce(shard)
            rows.append(
                Row(
                    model,
                    route,
                    len(numels),
                    n,
                    len(aten) + len(calls),
                    len(aten),
                    len(calls),
                    host,
                    in_kernels,
                    on_wire,
                    total,
                    tuple(aten + calls),
                    (replicas is not None and replicas.steady.get(0) is not None)
                    or (replicas is None and state.reducer.steady_units.get(0) is not None),
                    state_nbytes(state, [shard, *params]),
                )
            )
    return rows


@contextlib.contextmanager
def forced_codec(kind: str | None, *, kernels: bool = True) -> Iterator[None]:
    """Every codec the engine builds on ``kind``'s torch ops ("cast" where the format has
    a torch dtype, else "bits"; FP32 on "cast", as on CUDA), not the CPU kernels: what a
    GPU without Triton runs, on CPU tensors (None: as it is). The codec cache is emptied
    on the way in and out, and a codec must have been built under it. ``kernels=False``
    also turns off the CPU kernels that scaling uses outside the codec (layer maxima,
    block keys), as a GPU has none.

    Example:
        >>> with forced_codec("bits"):  # doctest: +SKIP
        ...     state = aps_comm.register(model, fmt="e4m3")
    """
    if kind is None:
        yield
        return
    built = []

    def backend_for(fmt: Any, device: torch.device) -> str:
        f = get_format(fmt)
        built.append(f.name)
        return "cast" if f.name == "fp32" or (kind == "cast" and f.torch_dtype) else "bits"

    codec.codec_for.cache_clear()
    try:
        with (
            unittest.mock.patch("aps_comm.codec.backend_for", backend_for),
            unittest.mock.patch.object(cpu_kernels, "AVAILABLE", kernels and cpu_kernels.AVAILABLE),
        ):
            yield
    finally:
        codec.codec_for.cache_clear()
    if not built:
        raise RuntimeError(f"no codec built on {kind!r}: a cached one ran instead")


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[None]:
    """A default process group of one rank: Gloo for CPU, NCCL for CUDA."""
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| model | route | layers | settled | ops per bucket (ATen + kernels) | host us | "
        "in kernels us | collectives us | total us | state / bucket bytes "
        "| beyond residuals / bucket |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.route} | {r.layers} | {'yes' if r.settled else 'no'} "
            f"| {r.ops} ({r.aten_ops} + {r.kernels}) "
            f"| {r.host_us:.0f} | {r.kernel_us:.0f} | {r.wire_us:.0f} | {r.total_us:.0f} "
            f"| {r.state_bytes / (4 * r.elements):.2f}x | {r.kept_ratio:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hostcost", description=__doc__)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (NCCL)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--configs",
        default="routes",
        help="the three plain routes, every option a user turns on (CONFIGS: 'all', or some "
        "of its names, comma-separated), or FSDP2's reduce-scatter and HSDP's all-reduce "
        "across replicas ('fsdp': FSDP_ROUTES)",
    )
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--memory",
        type=int,
        default=0,
        metavar="BUCKETS",
        help="instead, the state's bytes for a model of BUCKETS buckets of MEMORY_BUCKET",
    )
    args = parser.parse_args(argv)
    named = {"routes": ROUTES, "all": CONFIGS, "fsdp": FSDP_ROUTES}
    wanted = args.configs.split(",")
    if args.configs not in named and not all(name in CONFIGS for name in wanted):
        parser.error(f"--configs: routes, all, fsdp or names of CONFIGS, not {args.configs!r}")
    routes = named.get(args.configs) or {name: CONFIGS[name] for name in wanted}
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    if args.memory:
        if args.memory < 0 or args.out or args.configs == "fsdp":
            parser.error(f"--memory takes a bucket count > 0, routes or all, and no --out: {args}")
        with world_of_one(device):
            print(memory_table(measure_memory(device, routes, args.memory)))
        return 0
    with world_of_one(device):
        if args.configs == "fsdp":
            rows = measure_fsdp(device, args.repeats)
        else:
            rows = measure(device, args.repeats, routes=routes)
            if args.configs == "all":
                rows += measure_allreduce_hook(device, args.repeats)
    print(table(rows))
    if args.out:
        doc = {
            "command": "python -m benchmarks.hostcost " + " ".join(argv or sys.argv[1:]),
            "device": str(device),
            "torch": torch.__version__,
            "repeats": args.repeats,
            "rows": [dataclasses.asdict(r) for r in rows],
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
