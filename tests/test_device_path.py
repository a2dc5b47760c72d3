"""The device path, proven without a device: buckets and FSDP units on ``device="meta"``.

A GPU run must never read a device value on the host (each read stalls the
host behind every kernel queued before it) nor copy host memory to the
device on the steady-state path. Meta tensors have shapes and no data, so
driving the engine's bucket path (:meth:`aps_comm.engine.Reducer.bucket`)
and FSDP's reduce-scatter (:meth:`aps_comm.engine.Reducer.unit`) on them,
with the collectives stubbed out, under :class:`HostTraffic` (a dispatch
mode that sees every ATen op) shows every host read and host-to-device copy
the code would make on a GPU. Plans are built in the first two steps (DDP
re-buckets once); from the third step on there must be none, except the
reads the design allows: Promote's one read per bucket, and the stats read
once per step when asked for.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import aps_comm.reduction as reduction_mod
from aps_comm.agreement import Layouts
from aps_comm.config import BlockExponents, Reduction, Route, Scaling
from aps_comm.engine import (
    Comm,
    Reducer,
    Settings,
    SteadyBlocks,
    SteadyFeedback,
    SteadyFP32Unit,
    SteadyGroups,
    SteadyMixedUnit,
    SteadyNodeBlocks,
    SteadyStaged,
)
from aps_comm.feedback import ErrorFeedback
from aps_comm.formats import FORMATS, FloatFormat, get_format
from aps_comm.fsdp import reduce_shard, spread_nonfinite
from aps_comm.layout import Layout
from aps_comm.plan import Planner
from aps_comm.policy import Assignment, ByName, KeepLast, LayerInfo, Promote, Rule, Schedule
from aps_comm.telemetry import StepStats
from aps_comm.topology import NodeGroups, Topology, grid_rows
from aps_perfmodel.strategies import hook_cluster

META = torch.device("meta")
aten = torch.ops.aten

# Every built-in format and custom ones of 5 to 16 bits (9-16-bit customs
# travel in two bytes through the bit path on a GPU).
ALL_FORMATS = [*FORMATS, "e5m3", "e4m4", "e6m9", "e2m2", "e3m3"]
# Block scaling: FP8, FP16, 4- and 6-bit, a custom format in two bytes on the wire.
BLOCK_FORMATS = ["e4m3", "e2m1", "e3m2", "fp16", "e6m9"]
# On 3 ranks (odd shards), one format per codec path: FP8 with a torch dtype,
# 4- and 6-bit, FP16, BF16, a custom format in two bytes; 6 ranks run them all.
ODD_WORLD_FORMATS = ["e4m3", "e2m1", "e3m2", "fp16", "bf16", "e6m9"]
# Sizes that are odd, empty, larger than a chunk, and not multiples of N.
NUMELS = [7, 0, 1000, 33, 1, 517]


class HostTraffic(TorchDispatchMode):
    """Records every device-to-host read and host-to-device copy of meta tensors.

    Reads are answered with zeros (meta tensors hold no data), so the code
    goes on and every read of a step is seen, not just the first.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.copies: list[str] = []
        # ``t[i] = value``: on a GPU the value becomes a host tensor copied into ``t``
        # (a wait for the stream); on meta it is made on meta, so it is tracked here.
        self._host_values: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        on_device = any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args)
        if func is aten._local_scalar_dense.default and on_device:
            self.reads.append(f"{func} (.item(), bool(), int())")
            return 0
        if func in (aten.nonzero.default, aten.masked_select.default) and on_device:
            self.reads.append(f"{func} (its output size needs a host read)")
        if (
            func is aten.repeat_interleave.Tensor
            and on_device
            and kwargs.get("output_size") is None
        ):
            self.reads.append(f"{func} without output_size")
        if func is aten._to_copy.default:
            src, dst = args[0].device, kwargs.get("device") or args[0].device
            if src.type == "meta" and torch.device(dst).type == "cpu":
                self.reads.append(f"{func} to the host (.cpu(), .tolist(), .numpy())")
                dtype = kwargs.get("dtype") or args[0].dtype
                return torch.zeros(args[0].shape, dtype=dtype)
            if src.type == "cpu" and torch.device(dst).type == "meta":
                self.copies.append(f"{func} of {tuple(args[0].shape)} to the device")
        if func is aten.scalar_tensor.default:
            out = func(*args, **kwargs)
            self._host_values.add(out)
            return out
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.device.type == "meta" and src in self._host_values:
                self.copies.append(f"{func} of a host value into the device (t[i] = value)")
            # A 0-d source too: ``t[i] = value`` copies a host scalar and waits for
            # the stream on a GPU (``t[i:i + 1].fill_(value)`` does not).
            if dst.device.type == "meta" and src.device.type == "cpu":
                self.copies.append(f"{func} of {tuple(src.shape)} to the device")
            if dst.device.type == "cpu" and src.device.type == "meta":
                self.reads.append(f"{func} to the host")
                return dst
        return func(*args, **kwargs)


class _Done:
    """A finished collective (the stub answers every collective with one)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([self.tensor])
        return fut


class _Group:
    """A process group of ``size`` ranks that only answers its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@contextmanager
def stubbed_collectives(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every tensor collective the transports issue, answered at once; yields their names."""
    issued: list[str] = []

    def stub(name: str) -> Callable[..., _Done]:
        def collective(out: torch.Tensor, *args: Any, **kwargs: Any) -> _Done:
            issued.append(name)
            return _Done(out)

        return collective

    for name in ("all_reduce", "all_to_all_single", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, stub(name))
    if hasattr(dist, "all_gather_single"):
        monkeypatch.setattr(dist, "all_gather_single", stub("all_gather_into_tensor"))
    yield issued


def _layouts(world: int, per_node: int) -> Layouts:
    topology = Topology(world, per_node)
    rows = grid_rows(world)
    nodes = NodeGroups(topology, _Group(per_node), _Group(world // per_node), 0, 0)  # type: ignore[arg-type]
    grid = None
    if rows >= 2:
        grid_top = Topology(world, rows)
        grid = NodeGroups(grid_top, _Group(rows), _Group(world // rows), 0, 0)  # type: ignore[arg-type]
    return Layouts(topology, nodes if 1 < per_node < world else None, grid)


def _reducer(
    fmt: FloatFormat,
    reduction: str,
    scaling: str,
    world: int,
    rank: int,
    rules: list[Rule],
    *,
    stats: bool = False,
    feedback: bool = False,
    block_exponents: str = "agreed",
) -> tuple[Reducer, list[str]]:
    per_node = 2 if world % 2 == 0 else 1
    layouts = _layouts(world, per_node)
    comm = Comm(_Group(world), world, rank, "nccl", layouts)  # type: ignore[arg-type]
    planner = Planner(
        hook_cluster("nccl", "cuda", world, per_node),
        hierarchical=layouts.nodes is not None and not feedback,
        fp32=False,  # "auto" must not send a small test bucket as plain FP32
        grid=layouts.grid is not None and not feedback,
    )
    names = [f"layer{i}.weight" for i in range(len(NUMELS))]
    assignment = Assignment(rules, fmt)
    assignment.bind(
        {
            n: LayerInfo(i, n, k, n.rpartition(".")[0])
            for i, (n, k) in enumerate(zip(names, NUMELS, strict=True))
        }
    )
    settings = Settings(
        fmt,
        Reduction(reduction),
        Scaling(scaling),
        stats,
        feedback,
        block_exponents=BlockExponents(block_exponents),
    )
    fb = ErrorFeedback(rank, world) if feedback else None
    reducer = Reducer(settings, comm, planner, assignment, fb)
    reducer.resolve(META)
    return reducer, names


def _bucket_steps(
    reducer: Reducer, names: list[str], steps: int, chunk: int | None
) -> tuple[list[HostTraffic], StepStats]:
    """Run ``steps`` steps of two buckets: the host traffic of each step after
    warm-up, and the last step's records."""
    seen = []
    stats = StepStats()
    buckets = [NUMELS[:3], NUMELS[3:]]
    keys = [names[:3], names[3:]]
    # DDP's bucket buffers live across steps: a settled bucket runs its bound path.
    xs = [torch.empty(sum(numels), device=META) for numels in buckets]
    for step in range(steps):
        mode = HostTraffic()
        with mode:  # in warm-up too: it answers Promote's read, which meta cannot
            for b, numels in enumerate(buckets):
                x = xs[b]
                settled = reducer.steady_for(b, x)
                if settled is not None:
                    tail = reducer.run_steady(b, settled, x, defer=b == 0)
                else:
                    tail = reducer.bucket(
                        b, x, keys[b], numels, keys[b], step=step, chunk=chunk, defer=b == 0
                    )
                if tail is not None:
                    tail()
            _, stats = reducer.end_step()
        if step >= 2:
            seen.append(mode)
    return seen, stats


def _cases() -> Iterator[tuple[str, str, str, int]]:
    for name in ALL_FORMATS:
        fmt = get_format(name)
        for world in (3, 6) if name in ODD_WORLD_FORMATS else (6,):
            routes = ["two_phase", "auto"]
            if fmt.torch_dtype is not None:
                routes.append("allreduce")  # FP8 with the native gate opened below
            if world == 6:
                routes += ["hierarchical", "grid"]
            for reduction in routes:
                yield name, reduction, "layer", world
                if name in BLOCK_FORMATS:
                    yield name, reduction, "block", world
        yield name, "two_phase", "bucket", 6


@pytest.fixture
def fp8_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on an H100 with NCCL >= 2.24 and torch >= 2.8: FP8 sums natively."""
    monkeypatch.setattr(reduction_mod, "_nccl_sums_fp8", lambda device: True)


@pytest.mark.parametrize(("name", "reduction", "scaling", "world"), list(_cases()))
def test_bucket_path_makes_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch,
    fp8_sums: None,
    name: str,
    reduction: str,
    scaling: str,
    world: int,
) -> None:
    fmt = get_format(name)
    with stubbed_collectives(monkeypatch) as issued:
        reducer, names = _reducer(fmt, reduction, scaling, world, world - 1, [])
        steady, _ = _bucket_steps(reducer, names, 3, chunk=512)
    if scaling == "block":
        # Agreed block exponents bind on the torch codec backends, the native sum's and
        # the staged routes' (two keys per block) too.
        assert set(reducer.steady) == {0, 1}, reducer.steady
    for mode in steady:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)
    builds = reducer.plan_builds + sum(p.group_builds for p in reducer.plans.values())
    # Two buckets, a plan each (and a group plan each, unless sent as plain
    # FP32), all built at step 0.
    assert builds == (2 if fmt.name == "fp32" else 4), builds
    if fmt.name != "fp32":
        assert set(reducer.bucket_routes.values()) <= set(Route) - {Route.FP32}
        assert "all_reduce" in issued  # the maxima
        assert len(issued) > 2 * 3, issued  # the codec's payloads went to collectives


@pytest.mark.parametrize("name", BLOCK_FORMATS)
@pytest.mark.parametrize(
    ("reduction", "world", "stats"),
    [
        ("two_phase", 3, False),
        ("two_phase", 6, True),
        ("hierarchical", 6, True),
        ("grid", 6, False),
    ],
)
def test_rank_block_exponents_make_no_host_traffic_and_no_agreement(
    monkeypatch: pytest.MonkeyPatch, name: str, reduction: str, world: int, stats: bool
) -> None:
    """Each rank's own block exponents settle on the torch codecs too ("cast", "bits": a
    GPU without Triton, custom formats): the codec's own calls bound once (two_phase:
    SteadyBlocks; hierarchical and grid: SteadyNodeBlocks), with no host read."""
    with stubbed_collectives(monkeypatch) as issued:
        reducer, names = _reducer(
            get_format(name), reduction, "block", world, 1, [], stats=stats, block_exponents="rank"
        )
        steady, records = _bucket_steps(reducer, names, 3, chunk=512)
        kind = SteadyBlocks if reduction == "two_phase" else SteadyNodeBlocks
        assert {type(st) for st in reducer.steady.values()} == {kind}
        assert set(reducer.steady) == {0, 1}  # both buckets took their bound path
    for mode in steady:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)
    # The exponents travel with the shards: nothing is agreed before them.
    assert "all_reduce" not in issued, issued
    assert {"all_to_all_single", "all_gather_into_tensor"} <= set(issued), issued
    if stats:
        mode = HostTraffic()
        with mode:
            got = records.records()
        assert len(mode.reads) == 1 and [r.name for r in got] == names


POLICIES: dict[str, list[Rule]] = {
    "keep_last": [KeepLast("fp16")],  # mixed formats: groups at odd byte offsets
    "keep_last_fp32": [KeepLast("fp32")],
    "promote": [Promote(ladder=("e4m3", "e5m2", "fp16"))],
    "schedule": [Schedule(1, "bf16")],  # switches formats at step 1
}


@pytest.mark.parametrize(
    ("policy", "reduction", "world"),
    list(itertools.product(POLICIES, ["two_phase", "allreduce", "auto", "grid"], [3, 6])),
)
def test_policies_make_no_host_traffic_but_promotes_read(
    monkeypatch: pytest.MonkeyPatch, fp8_sums: None, policy: str, reduction: str, world: int
) -> None:
    if reduction == "grid" and grid_rows(world) < 2:
        pytest.skip(f"{world} ranks have no grid")
    with stubbed_collectives(monkeypatch):
        reducer, names = _reducer(
            get_format("e4m3"), reduction, "layer", world, 1, POLICIES[policy], stats=True
        )
        steady, _ = _bucket_steps(reducer, names, 3, chunk=None)
    for mode in steady:
        # Promote decides on the host: one read per bucket, documented.
        assert len(mode.reads) == (2 if policy == "promote" else 0), mode.reads
        assert mode.copies == [], mode.copies


@pytest.mark.parametrize(
    ("name", "reduction"),
    [(n, "two_phase") for n in ("e4m3", "e2m1", "fp16", "e5m3")]
    + [("e4m3", "allreduce"), ("fp16", "allreduce")],
)
@pytest.mark.parametrize("world", [3, 6])
@pytest.mark.parametrize("scaling", ["layer", "block"])
def test_error_feedback_and_stats_make_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch,
    fp8_sums: None,
    name: str,
    reduction: str,
    world: int,
    scaling: str,
) -> None:
    with stubbed_collectives(monkeypatch):
        reducer, names = _reducer(
            get_format(name), reduction, scaling, world, 0, [], stats=True, feedback=True
        )
        steady, stats = _bucket_steps(reducer, names, 3, chunk=None)
        # Both buckets took their bound path (issue 46), on the torch codec backends too.
        assert all(isinstance(reducer.steady.get(b), SteadyFeedback) for b in (0, 1))
        for mode in steady:
            assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)
        # The stats stay on the device until asked for, then are read once.
        mode = HostTraffic()
        with mode:
            records = stats.records()
            assert stats.records() is records
        assert len(mode.reads) == 1 and [r.name for r in records] == names


@pytest.mark.parametrize("name", ["e4m3", "e2m1", "fp16", "e5m3"])
@pytest.mark.parametrize("reduction", ["two_phase", "allreduce"])
def test_settled_buckets_with_stats_make_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch, fp8_sums: None, name: str, reduction: str
) -> None:
    """Issue 46: with ``stats=True`` a bucket settles, and its records (the device
    ops a GPU runs instead of the CPU kernel) read nothing on the host."""
    fmt = get_format(name)
    if reduction == "allreduce" and fmt.torch_dtype is None:
        pytest.skip(f"{name} has no native sum")
    with stubbed_collectives(monkeypatch):
        reducer, names = _reducer(fmt, reduction, "layer", 6, 1, [], stats=True)
        steady, stats = _bucket_steps(reducer, names, 3, chunk=512)
        assert set(reducer.steady) == {0, 1}  # both buckets took their bound path
    for mode in steady:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)
    mode = HostTraffic()
    with mode:
        records = stats.records()
    assert len(mode.reads) == 1 and [r.name for r in records] == names


@pytest.mark.parametrize(
    ("name", "reduction", "scaling"),
    [
        ("e4m3", "two_phase", "bucket"),
        ("fp16", "allreduce", "bucket"),
        ("e4m3", "two_phase", "none"),
        ("e4m3", "hierarchical", "layer"),
        ("e2m1", "grid", "bucket"),
        ("fp16", "hierarchical", "none"),
    ],
)
def test_settled_buckets_with_stats_and_any_scaling_make_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch, name: str, reduction: str, scaling: str
) -> None:
    """Issue 46: with ``stats=True`` buckets of bucket scaling or none settle, and so do
    hierarchical and grid ones; their records (the agreed maxima kept from the spread, the
    first level's exponents) read nothing on the host and copy nothing to the device."""
    with stubbed_collectives(monkeypatch):
        reducer, names = _reducer(get_format(name), reduction, scaling, 6, 1, [], stats=True)
        steady, stats = _bucket_steps(reducer, names, 3, chunk=512)
        assert set(reducer.steady) == {0, 1}  # both buckets took their bound path
    for mode in steady:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)
    mode = HostTraffic()
    with mode:
        records = stats.records()
    assert len(mode.reads) == 1 and [r.name for r in records] == names


MIXED: dict[str, list[Rule]] = {
    "keep_last": [KeepLast("fp16")],  # two groups, consecutive: views of the bucket
    "interleaved": [ByName({"layer[35].weight": "fp16"})],  # gathered into scratch
}


@pytest.mark.parametrize("policy", MIXED)
@pytest.mark.parametrize("reduction", ["two_phase", "allreduce"])
@pytest.mark.parametrize("scaling", ["layer", "block"])
def test_settled_mixed_format_buckets_make_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch, fp8_sums: None, policy: str, reduction: str, scaling: str
) -> None:
    """Issue 46: a bucket of several formats settles (with blocks: agreed block exponents,
    or the native sum's), and its bound path (what a CUDA graph captures) reads nothing on
    the host and copies nothing to the device."""
    with stubbed_collectives(monkeypatch):
        reducer, names = _reducer(get_format("e4m3"), reduction, scaling, 6, 1, MIXED[policy])
        steady, _ = _bucket_steps(reducer, names, 3, chunk=512)
        assert isinstance(reducer.steady.get(1), SteadyGroups)
    for mode in steady:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)


@pytest.mark.parametrize("world", [1, 6])
def test_settled_error_feedback_beside_fp32_makes_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    """Issue 46: error feedback with ``KeepLast("fp32")`` settles (one bucket of e4m3, one
    of e4m3 beside FP32), and its bound path reads nothing on the host and copies nothing
    to the device. Meta tensors take the "cast" codec, whose residual updates are the
    general path's tensor ops."""
    ran: list[str] = []
    monkeypatch.setattr(Reducer, "run_steady", _logged(Reducer.run_steady, ran))
    with stubbed_collectives(monkeypatch):
        reducer, names = _reducer(
            get_format("e4m3"), "two_phase", "layer", world, 0, [KeepLast("fp32")], feedback=True
        )
        steady, _ = _bucket_steps(reducer, names, 4, chunk=None)
        assert isinstance(reducer.steady.get(0), SteadyFeedback)
        assert isinstance(reducer.steady.get(1), SteadyGroups) and reducer.steady[1].feedback
    # Both buckets ran bound from their first step on (bound, then run), once per step.
    assert ran == ["SteadyFeedback", "SteadyGroups"] * 4, ran
    for mode in steady:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)


@pytest.mark.parametrize("world", [1, 6])
def test_settled_error_feedback_with_stats_makes_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch, world: int
) -> None:
    """Issue 46: error feedback with ``stats=True`` settles (one format, and beside FP32),
    its records (the device ops a GPU runs instead of the CPU kernel) read nothing on the
    host until the step's records are asked for, then once."""
    ran: list[str] = []
    monkeypatch.setattr(Reducer, "run_steady", _logged(Reducer.run_steady, ran))
    with stubbed_collectives(monkeypatch):
        reducer, names = _reducer(
            get_format("e4m3"),
            "two_phase",
            "layer",
            world,
            0,
            [KeepLast("fp32")],
            stats=True,
            feedback=True,
        )
        steady, stats = _bucket_steps(reducer, names, 4, chunk=None)
    assert ran == ["SteadyFeedback", "SteadyGroups"] * 4, ran  # bound from the first step
    for mode in steady:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)
    mode = HostTraffic()
    with mode:
        records = stats.records()
    assert len(mode.reads) == 1 and [r.name for r in records] == names[:-1]  # FP32: none


def test_settled_error_feedback_under_promote_reads_only_its_rates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 46: error feedback under ``Promote`` settles (one format, and beside FP32);
    Promote reads its agreed rates once per bucket, and nothing else is read on the host
    or copied to the device."""
    ran: list[str] = []
    monkeypatch.setattr(Reducer, "run_steady", _logged(Reducer.run_steady, ran))
    rules = [*POLICIES["promote"], KeepLast("fp32")]
    with stubbed_collectives(monkeypatch):
        reducer, names = _reducer(
            get_format("e4m3"), "two_phase", "layer", 6, 0, rules, stats=True, feedback=True
        )
        steady, _ = _bucket_steps(reducer, names, 4, chunk=None)
    assert ran == ["SteadyFeedback", "SteadyGroups"] * 4, ran  # bound from the first step
    for mode in steady:
        assert len(mode.reads) == 2, mode.reads  # Promote's agreed rates, once per bucket
        assert mode.copies == [], mode.copies


@pytest.mark.parametrize("stats", [False, True])
def test_settled_error_feedback_on_interleaved_groups_makes_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch, stats: bool
) -> None:
    """Issue 46: error feedback with groups that interleave (fp16 between e4m3 layers)
    settles; its gather, maxima put and picked back, and scatter read nothing on the host
    and copy nothing to the device."""
    with stubbed_collectives(monkeypatch):
        reducer, names = _reducer(
            get_format("e4m3"),
            "two_phase",
            "layer",
            6,
            1,
            MIXED["interleaved"],
            stats=stats,
            feedback=True,
        )
        steady, _ = _bucket_steps(reducer, names, 4, chunk=None)
        st = reducer.steady.get(1)
        assert isinstance(st, SteadyGroups) and st.feedback and st.gather is not None
    for mode in steady:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)


def _logged(run_steady: Callable[..., Any], log: list[str]) -> Callable[..., Any]:
    """:meth:`Reducer.run_steady`, logging the kind of settled path each call runs."""

    def logged(reducer: Reducer, index: int, st: Any, *args: Any, **kwargs: Any) -> Any:
        log.append(type(st).__name__)
        return run_steady(reducer, index, st, *args, **kwargs)

    return logged


def _unit_steps(reducer: Reducer, names: list[str], world: int, steps: int) -> list[HostTraffic]:
    chunks = [-(-n // world) for n in NUMELS]
    seen = []
    for step in range(steps):
        mode = HostTraffic()
        with mode:  # in warm-up too: it answers Promote's read, which meta cannot
            rows = torch.empty(world, sum(chunks), device=META)
            problem = torch.zeros((), device=META)
            out = reducer.unit(0, rows, chunks, NUMELS, names, step=step, problem=problem)
            assert out.shape == (sum(chunks),)
            reducer.end_step()
        if step >= 2:
            seen.append(mode)
    return seen


def _fsdp_cases() -> Iterator[tuple[str, int, str, str]]:
    for name, world, policy in itertools.product(
        ALL_FORMATS, [3, 6], ["none", "keep_last", "schedule"]
    ):
        if world == 3 and name not in ODD_WORLD_FORMATS:
            continue
        yield name, world, policy, "layer"
        if name in BLOCK_FORMATS:
            yield name, world, policy, "block"


@pytest.mark.parametrize(("name", "world", "policy", "scaling"), list(_fsdp_cases()))
def test_fsdp_reduce_scatter_makes_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch, name: str, world: int, policy: str, scaling: str
) -> None:
    rules = [] if policy == "none" else POLICIES[policy]
    with stubbed_collectives(monkeypatch) as issued:
        reducer, names = _reducer(
            get_format(name), "two_phase", scaling, world, 2, rules, stats=True
        )
        steady = _unit_steps(reducer, names, world, 3)
    # Bound on the torch codec backends too (blocks, formats beside FP32, all in FP32),
    # for the last step's policy epoch: its steps ran bound, not the general path.
    bound = reducer.steady_units.get(0)
    assert isinstance(bound, SteadyMixedUnit | SteadyFP32Unit), bound
    assert bound.epoch == reducer.assignment.epoch(2)
    for mode in steady:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)
    # Per step: the maxima and one all-to-all; no all-gather (FSDP keeps shards).
    assert issued == ["all_reduce", "all_to_all_single"] * 3


@pytest.mark.parametrize(
    ("name", "reduction", "scaling", "dtype"),
    [
        ("e4m3", "two_phase", "layer", torch.float32),
        ("e4m3", "two_phase", "layer", torch.bfloat16),
        ("e2m1", "two_phase", "block", torch.float32),
        ("fp16", "allreduce", "layer", torch.bfloat16),
        ("e4m3", "auto", "layer", torch.float32),
    ],
)
def test_hsdp_replica_all_reduce_makes_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch, name: str, reduction: str, scaling: str, dtype: torch.dtype
) -> None:
    """Issue 44: a unit's shard, new every step as FSDP hands it, reduced across 3 replicas.

    Three ranks: one per node, no staged routes, as the replica group binds the engine.
    """
    exponents = "rank" if scaling == "block" else "agreed"  # as aps_comm.fsdp binds it
    with stubbed_collectives(monkeypatch) as issued:
        reducer, names = _reducer(
            get_format(name), reduction, scaling, 3, 1, [], block_exponents=exponents
        )
        buffer = torch.empty(sum(NUMELS), device=META)
        layout = Layout.from_numels(NUMELS, META)
        seen = []
        for step in range(4):
            mode = HostTraffic()
            with mode:
                shard = torch.empty(sum(NUMELS), dtype=dtype, device=META)  # FSDP's, new
                reduce_shard(reducer, 0, buffer, shard, names, NUMELS, step, summed=step == 3)
                # FSDP's own reduce-scatter inside the node: a NaN spreads over the shards.
                spread_nonfinite(layout, buffer, shard, _Group(2), lambda *_: None)  # type: ignore[arg-type]
                reducer.end_step()
            if step >= 2:
                seen.append(mode)
        # Settled, not the per-step path (block scaling: the codec's own calls, bound).
        assert reducer.steady_for(0, buffer) is not None
    for mode in seen:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)
    assert issued  # the collectives ran (stubbed)


@pytest.mark.parametrize("policy", ["promote", "schedule"])
@pytest.mark.parametrize("reduction", ["two_phase", "allreduce"])
def test_settled_policies_make_no_host_traffic_but_promotes_read(
    monkeypatch: pytest.MonkeyPatch, fp8_sums: None, policy: str, reduction: str
) -> None:
    """Issue 46: without stats the policies' buckets settle (torch ops for Promote's rates
    off the CPU kernels); Promote still reads its agreed rates, once per bucket."""
    with stubbed_collectives(monkeypatch):
        reducer, names = _reducer(get_format("e4m3"), reduction, "layer", 3, 1, POLICIES[policy])
        steady, _ = _bucket_steps(reducer, names, 4, chunk=None)
        assert len(reducer.steady) == 2
        for st in reducer.steady.values():
            assert st.epoch == reducer.assignment.epoch(reducer.step)
            assert st.fmts == [get_format("e4m3")] * len(st.fmts)
    for mode in steady:
        assert len(mode.reads) == (2 if policy == "promote" else 0), mode.reads
        assert mode.copies == [], mode.copies


@pytest.mark.parametrize(
    ("reduction", "world"), [("two_phase", 3), ("allreduce", 3), ("hierarchical", 6), ("grid", 6)]
)
def test_promote_buckets_read_the_last_steps_rates_before_their_own_collectives(
    monkeypatch: pytest.MonkeyPatch, fp8_sums: None, reduction: str, world: int
) -> None:
    """On a GPU, reading rates that a bucket's own MAX all-reduce agreed waits for every
    kernel of the backward queued before it, once per bucket. A bucket reads those its
    last step agreed instead, before any collective of its step: only a binding's first
    step reads after its all-reduce."""
    reads: list[int] = []  # per Promote step: the collectives issued before it
    starts: list[int] = []  # per bucket run: the collectives issued before it
    with stubbed_collectives(monkeypatch) as issued:
        reducer, names = _reducer(
            get_format("e4m3"), reduction, "layer", world, 1, POLICIES["promote"]
        )
        promote_step, run_steady = reducer.assignment.promote_step, Reducer.run_steady

        def read(*args: Any) -> bool:
            reads.append(len(issued))
            return promote_step(*args)

        def run(self: Reducer, *args: Any, **kwargs: Any) -> Callable[[], None] | None:
            starts.append(len(issued))
            return run_steady(self, *args, **kwargs)

        monkeypatch.setattr(reducer.assignment, "promote_step", read)
        monkeypatch.setattr(Reducer, "run_steady", run)
        _bucket_steps(reducer, names, 4, chunk=None)
    assert len(reads) == len(starts) == 8  # two buckets, four steps
    # Step 0 binds both buckets: each reads after its MAX all-reduce, then none does.
    assert [r - s for r, s in zip(reads, starts, strict=True)] == [1, 1] + [0] * 6


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("reduction", ["hierarchical", "grid"])
def test_settled_staged_buckets_under_promote_read_only_its_rates(
    monkeypatch: pytest.MonkeyPatch, reduction: str, stats: bool
) -> None:
    """Issue 46: hierarchical and grid buckets under Promote settle (with ``stats=True``
    too) and write this rank's rates, on the device, where the next step's maxima
    all-reduce sends them; Promote reads its agreed rates once per bucket, and nothing
    else is read on the host or copied to the device."""
    fmt = get_format("e4m3")
    with stubbed_collectives(monkeypatch):
        reducer, names = _reducer(fmt, reduction, "layer", 6, 1, POLICIES["promote"], stats=stats)
        steady, _ = _bucket_steps(reducer, names, 4, chunk=512)
        assert {type(st) for st in reducer.steady.values()} == {SteadyStaged}
        assert set(reducer.steady) == {0, 1}  # both buckets took their bound path
        for st in reducer.steady.values():
            assert st.promote is not None
            # The reducer's rates (checkpoints read them) are the slots it sends and writes.
            assert all(reducer.rates[n]._base is st.maxima for n in st.promote[2])  # type: ignore[index]
    for mode in steady:
        assert len(mode.reads) == 2, mode.reads  # Promote's agreed rates, once per bucket
        assert mode.copies == [], mode.copies


# A unit with no empty parameter and an even row at 6 ranks: 4-bit rows pack too.
UNIT_NUMELS = [7, 1000, 33, 1, 517, 6]


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("name", ["e4m3", "e2m1", "bf16"])
@pytest.mark.parametrize("scaling", ["layer", "bucket", "none"])
def test_a_settled_fsdp_unit_makes_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch, name: str, scaling: str, stats: bool
) -> None:
    """Issue 46: a flat FSDP unit settles on the device path too (its torch-op factors,
    records and sum), and its bound steps, each on a new input, read nothing."""
    world = 6
    chunks = [-(-n // world) for n in UNIT_NUMELS]
    with stubbed_collectives(monkeypatch) as issued:
        reducer, names = _reducer(get_format(name), "two_phase", scaling, world, 2, [], stats=stats)
        seen, bound = [], []
        for step in range(4):
            mode = HostTraffic()
            with mode:
                rows = torch.empty(world, sum(chunks), device=META)
                problem = torch.zeros((), device=META)
                out = reducer.unit(0, rows, chunks, UNIT_NUMELS, names, step=step, problem=problem)
                assert out.shape == (sum(chunks),)
                assert reducer.stats.queued == int(stats)  # one unit's records, queued
                reducer.end_step()
            bound.append(reducer.steady_units.get(0))
            if step >= 1:
                seen.append(mode)
    assert bound[0] is not None and all(b is bound[0] for b in bound)
    for mode in seen:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)
    assert issued == ["all_reduce", "all_to_all_single"] * 4


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("scaling", ["layer", "bucket", "none"])
def test_a_settled_4bit_fsdp_unit_of_an_odd_row_makes_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch, scaling: str, stats: bool
) -> None:
    """Issue 46: a 4-bit unit whose row is odd (265 elements at 6 ranks) settles on the
    device path too, its rows copied beside a zero each step, and reads nothing."""
    world, numels = 6, [*UNIT_NUMELS[:-1], 7]
    chunks = [-(-n // world) for n in numels]
    with stubbed_collectives(monkeypatch):
        fmt = get_format("e2m1")
        reducer, names = _reducer(fmt, "two_phase", scaling, world, 2, [], stats=stats)
        seen, bound = [], []
        for step in range(4):
            mode = HostTraffic()
            with mode:
                rows = torch.empty(world, sum(chunks), device=META)
                problem = torch.zeros((), device=META)
                out = reducer.unit(0, rows, chunks, numels, names, step=step, problem=problem)
                assert out.shape == (sum(chunks),)
                reducer.end_step()
            bound.append(reducer.steady_units.get(0))
            if step >= 1:
                seen.append(mode)
    assert bound[0] is not None and all(b is bound[0] for b in bound)
    for mode in seen:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)


@pytest.mark.parametrize("name", ["e4m3", "e2m1", "fp16", "e5m3"])
@pytest.mark.parametrize("reduction", ["hierarchical", "grid"])
@pytest.mark.parametrize("scaling", ["layer", "bucket"])
def test_settled_staged_buckets_make_no_host_traffic(
    monkeypatch: pytest.MonkeyPatch, name: str, reduction: str, scaling: str
) -> None:
    """Issue 46: hierarchical and grid with one exponent per layer (or bucket) settle, and
    their bound path (the factors written in place from the agreed maxima) reads nothing
    on the host and copies nothing to the device."""
    with stubbed_collectives(monkeypatch) as issued:
        reducer, names = _reducer(get_format(name), reduction, scaling, 6, 3, [])
        steady, _ = _bucket_steps(reducer, names, 4, chunk=512)
        assert {type(st) for st in reducer.steady.values()} == {SteadyStaged}
        assert set(reducer.steady) == {0, 1}  # both buckets took their bound path
    for mode in steady:
        assert mode.reads == [] and mode.copies == [], (mode.reads, mode.copies)
    assert {"all_reduce", "all_to_all_single", "all_gather_into_tensor"} <= set(issued)
