"""APS gradient reduce-scatter for FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 reduce-scatters each unit's gradients in ``reduce_dtype`` (FP32 or
BF16), without scaling. :func:`register` replaces that collective on every
``fully_shard``-ed module with an APS reduce-scatter
(``FSDPModule.set_custom_reduce_scatter``). Per unit and backward:

1. every rank finds each parameter's largest |gradient| in the unit's
   reduce-scatter input (FSDP lays it out as N rows, row r holding every
   parameter's padded r-th chunk);
2. one MAX all-reduce of those maxima (4 bytes per parameter) agrees on them,
   and each parameter gets a power-of-two exponent with which nothing can
   overflow (:func:`aps_comm.scaling.exponents`, the two-phase rule: the sum
   happens in FP32);
3. each row is encoded (:func:`aps_comm.codec.encode`, per-parameter scales)
   and ``all_to_all_single`` sends row r, as uint8 bytes, to rank r: FP8 moves
   one byte per gradient element;
4. each rank decodes the N rows it received (unscaled in the same pass), sums
   them in FP32 in rank order and writes the sum into FSDP's output shard in
   the reduce dtype. There is no all-gather: FSDP keeps only shards.

FSDP is asked for plain sums (``set_force_sum_reduction_for_comms(True)``):
it divides by the world size (or the factor of
``set_gradient_divide_factor``) afterwards, in the reduce dtype, as it does
for its own reduce-scatter. A NaN or inf anywhere in a parameter's gradient
on any rank makes that parameter's reduced gradient NaN on every rank.

All use of FSDP2's private API (the ``ReduceScatter`` interface of
``torch.distributed.fsdp._fully_shard._fsdp_api`` and the parameter groups
behind an ``FSDPModule``) is in one section at the end of this module; on a
torch without it, :func:`register` raises a clear error.

HSDP (each unit sharded over a node's ranks, replicated across nodes):
``register(..., replicate=mesh["replicate"])`` on units ``fully_shard``-ed
on ``mesh["shard"]`` sets each unit's all-reduce hook
(``FSDPModule.set_all_reduce_hook``): after FSDP's reduce-scatter inside the
node, :func:`reduce_shard` reduces the unit's shard across the replicas with
the DDP engine (agreed per-parameter exponents, two_phase FP32 sums), so
only the wire format crosses nodes; the result is native HSDP's mean.

Not supported (a ``ValueError`` on every rank at :func:`register`): a 2-D
mesh (native HSDP: use ``replicate=``), a shard group other than all ranks
in order without ``replicate=``, replica groups that do not tile the world
with the shard groups, several parameter groups per module
(``shard_placement_fn`` with per-parameter meshes), a module that already
has a custom reduce-scatter, and the :class:`~aps_comm.policy.Promote` policy.

Example:
    >>> from torch.distributed.fsdp import fully_shard
    >>> for block in model.blocks:                      # doctest: +SKIP
    ...     fully_shard(block)
    >>> fully_shard(model)                              # doctest: +SKIP
    >>> state = aps_comm.fsdp.register(model, "e4m3")   # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from aps_comm import agreement, caveats, codec, teardown, transports
from aps_comm.agreement import Layouts
from aps_comm.config import (
    BlockExponents,
    Reduction,
    Scaling,
    check_block_size,
    default_block_size,
)
from aps_comm.engine import Comm, Reducer, Settings, Traffic
from aps_comm.executor import FifoWorker, WorkerFailed, first_failure
from aps_comm.formats import FloatFormat, get_format
from aps_comm.hostcopy import HostValue
from aps_comm.layout import Layout
from aps_comm.plan import Planner
from aps_comm.policy import Assignment, LayerInfo, Rule, policy_rules
from aps_comm.policy import describe as describe_policy
from aps_comm.telemetry import LayerStats, StepStats
from aps_comm.topology import Topology, by_rank
from aps_perfmodel.strategies import hook_cluster

__all__ = [
    "APSFSDPConfig",
    "APSFSDPState",
    "reduce_shard",
    "register",
    "spread_nonfinite",
    "tiling_problem",
]


@dataclasses.dataclass(frozen=True)
class APSFSDPConfig:
    """What every rank must agree on.

    Attributes:
        fmt: the wire format.
        scaling: "layer" (one exponent per parameter), "bucket" (one per FSDP
            unit and format), "block" (one per ``block_size`` elements of each
            parameter's chunk) or "none" (plain saturating cast, the naive
            baseline).
        block_size: elements per block with ``scaling="block"``; None: the
            format's default (:func:`aps_comm.config.default_block_size`).
        replicas: HSDP's replica count R; None: plain FSDP, no all-reduce
            across replicas (a replicate group of one rank is HSDP with R = 1).
        reduction: how the all-reduce across replicas sends the format:
            "two_phase" (FP32 sums), "allreduce" (the backend sums the
            format: FP16/BF16, FP8 on NCCL) or "auto" (per unit, the
            performance model's choice). Plain FSDP has no such all-reduce:
            only "two_phase" (the default) is accepted there.
        reduce_scatter: the reduce-scatter inside the shard group is APS's
            (True) or FSDP's own in ``reduce_dtype`` (False, only with
            replicas).
    """

    fmt: FloatFormat
    scaling: Scaling = Scaling.LAYER
    block_size: int | None = None
    replicas: int | None = None
    reduction: Reduction = Reduction.TWO_PHASE
    reduce_scatter: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", get_format(self.fmt))
        object.__setattr__(self, "scaling", Scaling.parse(self.scaling, "scaling"))
        size = self.block_size
        if size is None:
            size = default_block_size(self.fmt.bits)
        object.__setattr__(self, "block_size", check_block_size(size))
        reduction = Reduction.parse(self.reduction, "reduction")
        object.__setattr__(self, "reduction", reduction)
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if reduction not in _REPLICA_REDUCTIONS:
            raise ValueError(
                f"reduction={reduction.value!r} is not one FSDP's all-reduce across replicas "
                f"can take: use one of {', '.join(repr(r.value) for r in _REPLICA_REDUCTIONS)}"
            )
        if self.replicas is None and reduction != Reduction.TWO_PHASE:
            raise ValueError(
                f"reduction={reduction.value!r} chooses the all-reduce across replicas, which "
                "plain FSDP does not have: pass replicate= (HSDP), or leave reduction out"
            )
        if self.replicas is None and not self.reduce_scatter:
            raise ValueError(
                "reduce_scatter=False without replicate= leaves nothing for APS to "
                "reduce: FSDP's own reduce-scatter is all there is"
            )

    def describe(self) -> str:
        scaling = str(self.scaling)
        if self.scaling == Scaling.BLOCK:
            scaling += f"({self.block_size})"
        text = f"fmt={self.fmt.describe()}, scaling={scaling}"
        if self.replicas is not None:
            rs = "aps" if self.reduce_scatter else "fsdp"
            text += f", replicas={self.replicas}, reduction={self.reduction}, reduce_scatter={rs}"
        return text


# What the all-reduce across HSDP's replicas can send by: the staged routes
# need nodes inside the replica group, which holds one rank per node.
_REPLICA_REDUCTIONS = (Reduction.TWO_PHASE, Reduction.ALLREDUCE, Reduction.AUTO)


@dataclasses.dataclass(frozen=True)
class _Unit:
    """One FSDP parameter group as its reduce-scatter sees it.

    ``chunks[i]`` is parameter i's padded per-rank chunk: FSDP's reduce-scatter
    input is N rows of ``sum(chunks)`` elements, row r holding every
    parameter's r-th chunk in order.
    """

    index: int
    module: str
    names: tuple[str, ...]
    numels: tuple[int, ...]
    chunks: tuple[int, ...]

    @property
    def row_numel(self) -> int:
        return sum(self.chunks)

    def describe(self) -> str:
        return f"{self.module or '<root>'}:{list(zip(self.names, self.chunks, strict=True))}"


class APSFSDPState:
    """State of the APS reduce-scatter of an FSDP2 model: config, group, stats.

    Built by :func:`register`, which also installs it; one state serves every
    ``fully_shard``-ed module of the model.

    Attributes:
        config: the :class:`APSFSDPConfig`.
        process_group: the state's own group over all ranks (made by
            :func:`aps_comm.transports.new_group`, with the default group's
            timeout), so its collectives never interleave with FSDP's.
        stats: with ``stats=True``, the last step's :class:`~aps_comm.telemetry.LayerStats`
            per parameter (``bucket`` is the FSDP unit's index).
        bytes_sent: payload bytes this rank handed to collectives in the last
            step, all-gathers left out: per unit, the maxima (4 bytes per
            parameter plus 4) and the encoded reduce-scatter input (one byte
            per element for FP8, padding included). A reduce-scatter has no
            all-gather: without HSDP this is every byte, ``bytes_total``.
        bytes_total: every payload byte this rank handed to a collective in
            the last step (the sum of ``bytes_detail``; named as
            :class:`aps_comm.APSState`'s, whose ``bytes_sent`` leaves out the
            all-gather).
        bytes_detail: the same per collective: "all_reduce_max", "all_to_all";
            with HSDP also the replicas' "all_gather" (or "all_reduce") and
            "all_reduce_max inside the node" (the non-finite flags).
        step: steps that reduced gradients (a ``set_requires_gradient_sync(False)``
            backward reduces nothing and does not count).
        units: the module names of the FSDP units with trainable parameters.
        replica_group: with HSDP (``replicate=``), the state's own group over
            the ranks that hold this rank's shard (one per node): each unit's
            reduce-scattered shard is reduced across it by the APS engine.
        all_reduce_hooks: with HSDP, the hook :func:`register` set on each
            unit (``FSDPModule.set_all_reduce_hook``), in unit order: to wrap
            one in a hook of your own, call it on the shard FSDP hands yours.
            On CPU tensors it may return before the shard is reduced (a
            worker thread reduces it beside the rest of backward, and
            ``backward()`` returns once it has): a wrapper must not read or
            change the shard after calling it.
        replica_bytes: payload bytes this rank handed to the all-reduce
            across replicas in the last step (what crosses nodes in HSDP);
            part of ``bytes_total``.

    Example:
        >>> state = register(model, "e4m3", stats=True)  # doctest: +SKIP
        >>> loss.backward(); state.bytes_sent             # doctest: +SKIP
    """

    def __init__(
        self,
        fmt: FloatFormat | str = "e4m3",
        scaling: Scaling | str = "layer",
        policy: Sequence[Rule] | None = None,
        stats: bool = False,
        block_size: int | None = None,
        *,
        replicas: int | None = None,
        reduction: Reduction | str | None = None,
        reduce_scatter: bool | None = None,
    ) -> None:
        self.config = APSFSDPConfig(
            get_format(fmt),
            scaling,  # type: ignore[arg-type]
            block_size,
            replicas,
            reduction or Reduction.TWO_PHASE,  # type: ignore[arg-type]
            replicas is None if reduce_scatter is None else bool(reduce_scatter),
        )
        self.policy: list[Rule] = policy_rules(policy)
        self.assignment = Assignment(self.policy, self.config.fmt)
        if self.assignment.promoter is not None:
            raise ValueError(
                "aps_comm.fsdp does not support the Promote policy (it needs each "
                "parameter's underflow rate carried across steps); use static rules "
                "(ByName, KeepLast, MinNumel, LowRatio) or Schedule"
            )
        self.collect_stats = bool(stats)
        self.process_group: dist.ProcessGroup | None = None
        self.replica_group: dist.ProcessGroup | None = None
        self.reducer: Reducer | None = None
        self.replica_reducer: Reducer | None = None
        self.all_reduce_hooks: list[Callable[[torch.Tensor], None]] = []
        # Intra-node collectives of the replica path (the non-finite flags).
        self._shard_traffic = Traffic()
        # Per unit, the FP32 buffer its shard is reduced across replicas in, and its layout.
        self._shards: dict[int, tuple[torch.Tensor, Layout]] = {}
        # Groups made for register's checks only, released with the others.
        self._other_groups: list[dist.ProcessGroup] = []
        self.bytes_sent = 0
        self.replica_bytes = 0
        self.bytes_total = 0
        self.bytes_detail: dict[str, int] = {}
        self.step = 0
        self._world_size = 0
        self._units: list[_Unit] = []
        self._last_stats = StepStats()
        self._done: set[int] = set()
        # Per step, the maximum of every unit's layout-check flag, on the device:
        # read on the host once, when the next step starts.
        self._flags: torch.Tensor | None = None
        self._flags_host: HostValue | None = None
        # HSDP on CPU: the worker reducing units across replicas during
        # backward, the last unit's future, whether this backward waits for it.
        self._worker: FifoWorker | None = None
        self._pending: torch.futures.Future | None = None
        self._drain_queued = False

    @property
    def fmt(self) -> FloatFormat:
        return self.config.fmt

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def units(self) -> list[str]:
        return [u.module for u in self._units]

    @property
    def stats(self) -> list[LayerStats]:
        """The last step's per-parameter records (with ``stats=True``), read once."""
        return self._last_stats.records()

    def describe(self) -> str:
        """Everything every rank must agree on, as text."""
        return f"{self.config.describe()}, policy={describe_policy(self.policy)}"

    def bind(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Make the reducers: the reduce-scatter's on ``group``, the replicas' on ``replica_group``.

        Args:
            group: the state's own group over the shard group's ranks: the
                APS reduce-scatter's (with ``config.reduce_scatter``); with
                HSDP it also spreads a non-finite parameter to every shard.
            device: where the gradients are.
            replica_group: with HSDP, the state's own group over the ranks
                holding this rank's shard.

        Raises:
            ValueError: the replica all-reduce cannot run the format as asked
                on this backend (e.g. ``reduction="allreduce"`` of FP8 on Gloo).
        """
        # Called by register (stacklevel 3: the user's call), the policy bound.
        caveats.warn_unblocked(self.assignment.possible(), self.config.scaling, stacklevel=3)
        replicated = replica_group is not None
        if group is not None and self.config.reduce_scatter:
            # With HSDP the records come from the all-reduce across replicas,
            # the collective that crosses nodes.
            stats = self.collect_stats and not replicated
            self.reducer = self._reducer(group, device, Reduction.TWO_PHASE, stats)
        if group is not None:
            self._world_size = group.size()
        self.process_group = group
        if replica_group is not None:
            self.replica_reducer = self._reducer(
                replica_group, device, self.config.reduction, self.collect_stats, True
            )
            self.replica_reducer.resolve(device)
            self.replica_group = replica_group

    def _reducer(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        reduction: Reduction,
        stats: bool,
        across_replicas: bool = False,
    ) -> Reducer:
        """The engine on ``group``: the reduce-scatter's, or the all-reduce across replicas'."""
        world, rank = group.size(), dist.get_rank(group)
        backend = agreement.backend_for(group, device)
        comm = Comm(group, world, rank, backend, Layouts(Topology(world, 1)))
        # FSDP's reduce-scatter owners keep FP32 sums, so its blocks' exponents
        # are agreed; across replicas it is DDP's two_phase: each owner's own.
        exponents = BlockExponents.RANK if across_replicas else BlockExponents.AGREED
        planner = Planner(
            hook_cluster(backend, device.type, world, 1),
            False,
            # As for DDP: on NCCL "auto" may pick the plain FP32 all-reduce.
            across_replicas and backend == "nccl",
            scaling=self.config.scaling,
            block_size=self.config.block_size,
            block_exponents=exponents,
        )
        settings = Settings(
            self.fmt,
            reduction,
            self.config.scaling,
            stats,
            False,
            self.config.block_size,
            exponents,
        )
        return Reducer(settings, comm, planner, self.assignment)

    def exit_workers(self) -> list[FifoWorker]:
        """Hand over the worker of the replicas' all-reduce (see :mod:`aps_comm.teardown`).

        The reduce-scatter runs on FSDP's thread; only HSDP on CPU tensors
        has a worker.
        """
        worker, self._worker = self._worker, None
        return [worker] if worker is not None else []

    def exit_groups(self) -> list[dist.ProcessGroup]:
        """Hand over the state's process groups and forget them (see :mod:`aps_comm.teardown`)."""
        groups = [self.process_group, self.replica_group, *self._other_groups]
        self.process_group, self.reducer = None, None
        self.replica_group, self.replica_reducer, self._other_groups = None, None, []
        return [g for g in groups if g is not None]

    # -- the reduce-scatter --------------------------------------------------

    def _reduce_scatter(
        self, unit: _Unit, output: torch.Tensor, input: torch.Tensor, op: Any
    ) -> None:
        try:
            self._reduce_unit(unit, output, input, op)
        except RuntimeError as exc:
            raise RuntimeError(
                f"aps_comm.fsdp, unit {unit.index} ({unit.module or '<root>'}): {exc}"
            ) from exc

    def _reduce_unit(self, unit: _Unit, output: torch.Tensor, input: torch.Tensor, op: Any) -> None:
        reducer = self.reducer
        assert reducer is not None
        n = self._world_size
        self._begin_unit(unit)
        problem = _check_call(unit, output, input, op, n)
        rows = input.view(n, -1) if not problem else input.new_zeros(n, unit.row_numel)
        if rows.dtype != torch.float32:
            caveats.warn_rounded_dtype(rows.dtype)
            rows = rows.float()
        flag = torch.full((), float(bool(problem)), device=rows.device)
        acc = reducer.unit(
            unit.index,
            rows,
            unit.chunks,
            unit.numels,
            unit.names,
            step=self.step,
            problem=flag,
        )
        # Every rank took part in the unit's collectives: the rank whose input
        # did not fit raises now; the others' results are NaN, and they raise
        # when the next step starts.
        if problem:
            raise ValueError(
                f"the reduce-scatter input does not match the unit's parameters on this rank: "
                f"{problem}"
            )
        self._flags = flag if self._flags is None else torch.maximum(self._flags, flag)
        if _is_avg(op):
            acc.div_(n)
        output.copy_(acc)
        if self.replica_reducer is None:
            self._end_unit(unit)

    # -- the all-reduce across replicas (HSDP) -----------------------------------

    def _all_reduce(self, unit: _Unit, module: Any, output: torch.Tensor) -> None:
        param_group = _param_groups(module)[0]
        _check_replica_call(param_group, unit, output)
        job = functools.partial(self._reduce_replicas_named, unit, param_group, output)
        if self._overlap_pending(param_group, output, job):
            return
        job()

    def _overlap_pending(self, param_group: Any, output: torch.Tensor, job: Callable) -> bool:
        """Run ``job`` on the state's worker, finished before backward returns, where it may.

        On Gloo with CPU tensors a collective blocks the thread that waits
        for it, so the replicas' all-reduce, done in place, would stall
        backward for the whole slow link. Where FSDP leaves ``output`` as the
        unit's gradients untouched after the hook (:func:`_grads_view_output`),
        the worker fills it while backward goes on, and a final callback of
        the backward pass waits for it (and raises its error). The worker
        runs the units in the order FSDP hands them over, on the state's own
        groups, so every rank issues the same collectives in the same order.
        On CUDA the engine only enqueues work on FSDP's stream: no worker.
        """
        if output.device.type != "cpu" or self.reducer is not None:
            return False
        if not _grads_view_output(param_group, output):
            return False
        if not self._drain_queued:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._drain)
            except RuntimeError:  # not inside backward(): nothing would wait
                return False
            self._drain_queued = True
        if self._worker is None:
            self._worker = FifoWorker(f"aps-comm-hsdp-{id(self):x}")
        self._pending = self._worker.submit(job)
        return True

    def _drain(self) -> None:
        """Wait for the units handed to the worker in this backward; raise the first error."""
        self._drain_queued = False
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.wait()
        except WorkerFailed as exc:
            raise first_failure(exc) from None

    def _reduce_replicas_named(self, unit: _Unit, param_group: Any, output: torch.Tensor) -> None:
        try:
            self._reduce_replicas(unit, param_group, output)
        except RuntimeError as exc:
            raise RuntimeError(
                f"aps_comm.fsdp, unit {unit.index} ({unit.module or '<root>'}), all-reduce "
                f"across replicas: {exc}"
            ) from exc

    def _reduce_replicas(self, unit: _Unit, param_group: Any, output: torch.Tensor) -> None:
        """Reduce the unit's reduce-scattered shard across the replicas, as native HSDP does.

        FSDP calls this (its all-reduce hook) after the reduce-scatter and
        before its own division: native HSDP averages across replicas, or
        sums where ``set_gradient_divide_factor`` set the whole divisor.
        """
        reducer = self.replica_reducer
        assert reducer is not None
        if self.reducer is None:
            self._begin_unit(unit)
        # FSDP hands a new tensor every step: the unit's own FP32 buffer keeps
        # the settled path bound (and the replicas' shards sum in FP32 whatever
        # the reduce dtype).
        bound = self._shards.get(unit.index)
        if bound is None or bound[0].device != output.device:
            # Once per unit: its FP32 buffer and its parameters' layout.
            x = torch.empty(unit.row_numel, dtype=torch.float32, device=output.device)
            bound = self._shards[unit.index] = (x, Layout.from_numels(unit.chunks, x.device))
        x, layout = bound
        # set_gradient_divide_factor: FSDP divides by the whole factor, so
        # native HSDP sums across replicas instead of averaging.
        summed = param_group.gradient_divide_factor is not None
        reduce_shard(reducer, unit.index, x, output, unit.names, unit.chunks, self.step, summed)
        if self.reducer is None and self._world_size > 1:
            assert self.process_group is not None
            spread_nonfinite(layout, x, output, self.process_group, self._count_inside)
        self._end_unit(unit)

    def _count_inside(self, collective: str, nbytes: int) -> None:
        # Named apart in bytes_detail: these bytes stay inside the node.
        self._shard_traffic(f"{collective} inside the node", nbytes)

    # -- steps --------------------------------------------------------------------

    def _begin_unit(self, unit: _Unit) -> None:
        if unit.index in self._done:
            # A unit reduced twice before every unit did: the previous step
            # left some unit out (it cannot, with reduce_scatter_unused_params).
            self._end_step()
        if not self._done:
            self._check_last_step()

    def _end_unit(self, unit: _Unit) -> None:
        self._done.add(unit.index)
        if len(self._done) == len(self._units):
            self._end_step()

    def _check_last_step(self) -> None:
        """Raise on every rank if a unit of the last step had a rank whose input did not fit.

        The flag was copied to the host without blocking when the last step
        ended; a whole optimizer step later that copy has long finished, so
        this read does not stall the host behind the device's queue.
        """
        flags, self._flags_host = self._flags_host, None
        if flags is not None and bool(flags.result() > 0):
            raise ValueError(
                "in the previous step, another rank's reduce-scatter input did not match its "
                "unit's parameters (that rank's error says how); the unit's gradients were NaN"
            )

    def _end_step(self) -> None:
        detail: dict[str, int] = {}
        replica: dict[str, int] = {}
        if self.reducer is not None:
            detail, self._last_stats = self.reducer.end_step()
        if self.replica_reducer is not None:
            replica, self._last_stats = self.replica_reducer.end_step()
        inside = self._shard_traffic.take()
        self.bytes_detail = {
            k: detail.get(k, 0) + replica.get(k, 0) + inside.get(k, 0)
            for k in {**detail, **replica, **inside}
        }
        self.replica_bytes = sum(replica.values())
        self.bytes_total = sum(self.bytes_detail.values())
        self.bytes_sent = sum(
            v for k, v in self.bytes_detail.items() if not k.endswith("all_gather")
        )
        self._done = set()
        self.step += 1
        if self._flags is not None:
            self._flags_host, self._flags = HostValue(self._flags), None


def reduce_shard(
    reducer: Reducer,
    index: int,
    buffer: torch.Tensor,
    shard: torch.Tensor,
    names: Sequence[str],
    chunks: Sequence[int],
    step: int,
    summed: bool = False,
) -> None:
    """Reduce one unit's reduce-scattered ``shard`` across the replicas, in place.

    The shard goes through ``buffer`` (the unit's own FP32 tensor, kept
    across steps: FSDP hands a new shard every step) so that the unit
    settles like a DDP bucket: once bound, a fixed handful of calls whatever
    the parameter count, and no host read. The replicas' shards sum in FP32
    whatever ``shard``'s dtype.

    Args:
        reducer: the engine over the replica group.
        index: the unit's index (its bucket in the engine).
        buffer: float32, one element per element of ``shard``.
        shard: FSDP's reduce-scatter output, in its reduce dtype.
        names: each parameter's name (its key in the policy).
        chunks: each parameter's padded chunk, in ``shard``'s order.
        step: the step number (Schedule).
        summed: sum across replicas instead of averaging (exact for a
            power-of-two replica count).

    Example:
        >>> reduce_shard(state.replica_reducer, 0, buf, out, names, chunks, 0)  # doctest: +SKIP
    """
    buffer.copy_(shard.reshape(-1))
    steady = reducer.steady_for(index, buffer)
    if steady is not None:
        reducer.run_steady(index, steady, buffer)
    else:
        reducer.bucket(index, buffer, names, list(chunks), names, step=step)
    if summed:
        buffer.mul_(reducer.comm.world_size)
    shard.copy_(buffer.view_as(shard))


def spread_nonfinite(
    layout: Layout,
    result: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    count: Callable[[str, int], None],
) -> None:
    """Make a parameter NaN on every shard where one shard of it came back non-finite.

    FSDP's own reduce-scatter leaves a NaN in the shard that holds it; the
    replicas then make that shard NaN on each of them. One MAX all-reduce of
    a flag per parameter over the shard group (inside the node, 4 bytes
    each) spreads it to the parameter's other shards, as DDP makes a layer
    NaN on every rank. (APS's reduce-scatter agrees on it already.)

    Args:
        layout: the shard's parameters (their padded chunks), on its device.
        result: the reduced shard, float32 (:func:`reduce_shard`'s buffer).
        shard: FSDP's tensor, the same values in its dtype: NaN is written here.
        group: the shard group.
        count: the byte counter (``count(collective, nbytes)``).

    Example:
        >>> spread_nonfinite(layout, buf, out, shard_group, traffic)  # doctest: +SKIP
    """
    on_host = result.device.type == "cpu"
    if on_host and math.isfinite(result.sum().item()):
        # On the CPU a read costs no device sync, and one sum is a fraction of
        # the per-parameter pass below (a finite sum means every value is).
        bad = torch.zeros(len(layout.lengths), dtype=torch.float32)
    else:
        # Maxima map NaN to inf: inf marks a parameter's non-finite shard.
        bad = (codec.segment_amax(result, layout, blocked=True) == math.inf).float()
    transports.all_reduce_max(bad, group, count)
    if on_host and not bad.any().item():
        return
    whole = torch.repeat_interleave(bad, layout.lengths, output_size=result.numel())
    shard.masked_fill_(whole.view_as(shard) > 0, math.nan)


def _check_replica_call(param_group: Any, unit: _Unit, output: torch.Tensor) -> None:
    """Raise on this call, on the calling thread, if FSDP's call does not fit the unit."""
    if not param_group.all_reduce_grads:
        # FSDP, seeing a 1-D mesh, would keep this unreduced part in the
        # gradient and never hand it to the hook again.
        raise ValueError(
            "set_requires_all_reduce(False) is not supported with replicate=: the "
            "skipped part would never be reduced across replicas; use "
            "set_requires_gradient_sync(False) to accumulate without communication"
        )
    if output.numel() != unit.row_numel:
        raise ValueError(
            f"FSDP handed the all-reduce {output.numel()} elements; the unit's shard has "
            f"{unit.row_numel}"
        )
    if output.dtype == torch.float64:
        caveats.warn_rounded_dtype(output.dtype)


def _check_call(unit: _Unit, output: torch.Tensor, input: torch.Tensor, op: Any, n: int) -> str:
    """Why this call does not fit the unit's layout, or "" when it does."""
    s = unit.row_numel
    if input.numel() != n * s or output.numel() != s:
        return (
            f"FSDP passed {input.numel()} input and {output.numel()} output elements; the "
            f"unit's {len(unit.chunks)} trainable parameters make {n} x {s} and {s} (did "
            "set_reduce_scatter_unused_params(False) or a requires_grad change leave "
            "parameters out?)"
        )
    if not (input.is_floating_point() and input.is_contiguous()):
        return f"the input must be a contiguous floating-point tensor, got {input.dtype}"
    if not (_is_sum(op) or _is_avg(op)):
        return f"only ReduceOp.SUM and AVG are supported, FSDP asked for {op!r}"
    return ""


def _is_sum(op: Any) -> bool:
    return op == dist.ReduceOp.SUM


def _is_avg(op: Any) -> bool:
    return op == dist.ReduceOp.AVG


def register(
    module: torch.nn.Module,
    fmt: FloatFormat | str = "e4m3",
    *,
    scaling: Scaling = "layer",
    policy: Sequence[Rule] | None = None,
    stats: bool = False,
    block_size: int | None = None,
    replicate: dist.ProcessGroup | DeviceMesh | None = None,
    reduction: Reduction | str | None = None,
    reduce_scatter: bool | None = None,
) -> APSFSDPState:
    """Install APS gradient reduction on every ``fully_shard``-ed module of ``module``.

    Collective: call it on every rank, after ``fully_shard`` and before the
    first backward. It creates the state's process groups, checks that every
    rank has the same configuration and units, and on each unit sets the
    custom reduce-scatter, ``set_force_sum_reduction_for_comms(True)`` (plain
    sums; FSDP divides afterwards) and ``set_reduce_scatter_unused_params(True)``
    (a parameter without a gradient sends zeros, so every rank's layout is the
    same).

    With ``replicate`` (HSDP) it sets each unit's all-reduce hook instead
    (:func:`reduce_shard`: the shard across the replicas, as a DDP bucket),
    and the reduce-scatter stays FSDP's own unless ``reduce_scatter=True``.

    Args:
        module: the model; it or its submodules are ``fully_shard``-ed
            (FSDP2) on one 1-D mesh: over all ranks, or with ``replicate``
            over the ranks of this rank's shard group (``mesh["shard"]``).
        fmt: the wire format ("e4m3", "e5m2", "fp16", "bf16", "fp32", any
            "eXmY", or a FloatFormat).
        scaling: "layer" (APS, one exponent per parameter), "bucket" (one per
            unit and format), "block" (one per ``block_size`` elements of each
            parameter's chunk; the reduce-scatter agrees them by one MAX
            all-reduce of one-byte exponents, the all-reduce across replicas
            uses each owner's own as DDP does) or "none" (plain saturating cast).
        policy: static rules of :mod:`aps_comm.policy` (``ByName``,
            ``KeepLast``, ``MinNumel``, ``LowRatio``) and ``Schedule``;
            ``Promote`` is not supported.
        stats: record per-parameter :class:`~aps_comm.telemetry.LayerStats`
            of the last step in ``state.stats`` (local passes, no collective);
            with ``replicate``, those of the all-reduce across replicas.
        block_size: elements per block with ``scaling="block"`` (a power of
            two from 8 to 256; default: 128 for 8-bit formats, 32 below).
        replicate: HSDP: a process group, or a 1-D ``DeviceMesh``
            (``mesh["replicate"]``), of the ranks that hold the same shard as
            this one; with the shard groups it must tile the world.
        reduction: with ``replicate``, how the all-reduce across replicas
            sends the format: "two_phase" (default; FP32 sums), "allreduce"
            (the backend sums the format: FP16/BF16, FP8 on NCCL) or "auto".
        reduce_scatter: the reduce-scatter inside the shard group is APS's
            (True) or FSDP's own in ``reduce_dtype`` (False). Default: APS's
            without ``replicate``, FSDP's own with it.

    Returns:
        The :class:`APSFSDPState`.

    Raises:
        RuntimeError: torch.distributed is not initialised, or this torch
            lacks FSDP2's custom reduce-scatter API.
        ValueError: no ``fully_shard``-ed module, an unsupported layout (see
            the module's docstring), or a configuration that differs across
            ranks; raised on every rank.

    Example:
        >>> state = register(model, "e4m3", stats=True)  # doctest: +SKIP
        >>> mesh = init_device_mesh("cuda", (nodes, 8), mesh_dim_names=("replicate", "shard"))  # doctest: +SKIP
        >>> for block in model.blocks:                   # doctest: +SKIP
        ...     fully_shard(block, mesh=mesh["shard"])
        >>> fully_shard(model, mesh=mesh["shard"])       # doctest: +SKIP
        >>> state = register(model, "e4m3", replicate=mesh["replicate"])  # doctest: +SKIP
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("aps_comm.fsdp.register needs torch.distributed initialised")
    api = _fsdp_api()
    replicas, bad_replicate = _replica_ranks(replicate)
    state = APSFSDPState(
        fmt,
        scaling,
        policy,
        stats,
        block_size,
        replicas=None if replicas is None else len(replicas),
        reduction=reduction,
        reduce_scatter=reduce_scatter,
    )
    found, problems, shards = _find_units(module, api, state.config.replicas is not None)
    problems += [bad_replicate] if bad_replicate else []
    state._units = [u for _, _, u in found]
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    state.assignment.bind(
        {
            n: LayerInfo(i, n, p.numel(), n.rpartition(".")[0], p)
            for i, (n, p) in enumerate(trainable)
        }
    )
    formats = state.assignment.static([n for n, _ in trainable])
    device = next((p.device for _, p in trainable), torch.device("cpu"))
    layout = _Layout(min(shards) if shards else (), replicas)

    # Collective from here: every rank creates the groups and compares notes
    # before any rank raises, so a problem on one rank is an error on all.
    agreement.wait_for_ranks("aps_comm.fsdp.register")
    with teardown.released_if_raises(state):
        _bind(state, device, formats, problems, layout)
        comm_class = _comm_class()
        for mod, group, unit in found:
            if state.reducer is not None:
                mod.set_custom_reduce_scatter(comm_class(state, unit))
                mod.set_force_sum_reduction_for_comms(True)
            if state.replica_reducer is not None:
                # The module, not its parameter group: the hook holds no FSDP buffers.
                hook = functools.partial(state._all_reduce, unit, mod)
                mod.set_all_reduce_hook(hook)
                state.all_reduce_hooks.append(hook)
            _reduce_scatter_unused_params(mod, group, api)
    teardown.release_at_exit(state)
    return state


def _find_units(
    module: torch.nn.Module, api: _API, replicated: bool
) -> tuple[list[tuple[Any, Any, _Unit]], list[str], set[tuple[int, ...]]]:
    """The model's units (module, parameter group, unit), what is wrong, their shard ranks."""
    names = {id(p): n for n, p in module.named_parameters()}
    # Per problem, the units that have it: a problem is said once, its units after.
    unfit: dict[str, list[str]] = {}
    found: list[tuple[Any, Any, _Unit]] = []
    world = dist.get_world_size()
    for mod_name, mod in module.named_modules():
        if not isinstance(mod, api.FSDPModule):
            continue
        try:
            group = _one_param_group(mod, api, world, replicated)
        except ValueError as exc:
            unfit.setdefault(str(exc), []).append(mod_name or "<root>")
            continue
        if group is None:
            continue
        unit = _unit_of(group, len(found), mod_name, names)
        if unit.chunks:
            found.append((mod, group, unit))
    problems = [f"{problem} {_which_units(units)}" for problem, units in unfit.items()]
    if not found and not problems:
        problems.append(
            f"{type(module).__name__} has no fully_shard-ed module with trainable parameters"
        )
    shards = {
        tuple(dist.get_process_group_ranks(g.mesh_info.shard_process_group)) for _, g, _ in found
    }
    if len(shards) > 1:
        problems.append(f"the units are sharded over different ranks: {sorted(shards)}")
    return found, problems, shards


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One rank's view of the mesh: its shard group's ranks and its replicas (or None)."""

    shard: tuple[int, ...]
    replicas: tuple[int, ...] | None


def _replica_ranks(replicate: Any) -> tuple[tuple[int, ...] | None, str]:
    """The ranks of ``replicate`` (None without HSDP), and what is wrong with it ("" if nothing)."""
    if replicate is None:
        return None, ""
    group = replicate
    if isinstance(replicate, DeviceMesh):
        if replicate.ndim != 1:
            return None, (
                f'replicate= takes a 1-D DeviceMesh (mesh["replicate"]), got a '
                f"{replicate.ndim}-D mesh of shape {tuple(replicate.shape)}"
            )
        group = replicate.get_group()
    if not isinstance(group, dist.ProcessGroup):
        return None, (
            f"replicate= takes a process group or a 1-D DeviceMesh, got {type(replicate).__name__}"
        )
    return tuple(dist.get_process_group_ranks(group)), ""


def _bind(
    state: APSFSDPState,
    device: torch.device,
    formats: Sequence[FloatFormat],
    problems: list[str],
    layout: _Layout,
) -> None:
    """Create the state's groups, bind to them, agree with every rank (collective)."""
    world = agreement.new_group()
    seen = agreement.gather(world, ("; ".join(problems), state.describe(), layout))
    replicated = any(lay.replicas is not None for _, _, lay in seen)
    ready = not any(p for p, _, _ in seen) and all(d == seen[0][1] for _, d, _ in seen)
    if replicated and ready:
        tiling = tiling_problem([lay for _, _, lay in seen])
        problems = [*problems, tiling] if tiling else problems
        ready = not tiling
    if replicated:
        state._other_groups.append(world)
    else:
        state.process_group = world
    if ready and not problems:
        try:
            if replicated:
                shard = agreement.new_subgroup(sorted({lay.shard for _, _, lay in seen}))
                replicas = agreement.new_subgroup(
                    sorted({lay.replicas for _, _, lay in seen})  # type: ignore[type-var]
                )
                state.bind(shard, device, replicas)
            else:
                state.bind(world, device)
        except ValueError as exc:
            problems = [str(exc)]
    # Named texts: a difference names the setting or the unit, not every unit.
    mine = {
        "configuration": state.describe(),
        # Parameters per format: the same names and configuration give the same list.
        "formats": str(sorted(collections.Counter(f.name for f in formats).items())),
        "units": str(len(state._units)),
    }
    mine.update({f"unit {u.index}": u.describe() for u in state._units})
    agreement.agree(
        world,
        mine,
        what="aps_comm.fsdp configuration",
        problem="; ".join(problems),
        refused="aps_comm.fsdp.register cannot install on this model",
    )


def tiling_problem(layouts: Sequence[Any]) -> str:
    """Why the ranks' shard and replica groups are not HSDP's grid ("" when they are).

    Args:
        layouts: per rank (indexed by global rank), its shard group's ranks
            (``.shard``) and its replica group's ranks (``.replicas``; None
            where ``replicate=`` was not passed).

    Returns:
        The problem, for the error every rank raises: ranks of one shard
        group hold different parts of the model, and ranks of one replica
        group must hold the same part, so the replica groups cut across the
        shard groups, one rank from each, at the same position.

    Example:
        >>> from types import SimpleNamespace as L
        >>> tiling_problem([L(shard=(0, 1), replicas=(0, 2)), L(shard=(0, 1), replicas=(1, 3)),
        ...                 L(shard=(2, 3), replicas=(0, 2)), L(shard=(2, 3), replicas=(1, 3))])
        ''
    """
    world = len(layouts)
    missing = [r for r, lay in enumerate(layouts) if lay.replicas is None]
    recipe = (
        'e.g. mesh = init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names=("replicate", '
        '"shard")); fully_shard(unit, mesh=mesh["shard"]); register(..., replicate=mesh["replicate"])'
    )
    if missing:
        given = by_rank(["not given" if r in missing else "" for r in range(world)])
        return f"replicate= must be given on every rank ({given}), {recipe}"
    for r, lay in enumerate(layouts):
        shard, reps = tuple(lay.shard), tuple(lay.replicas)
        problem = ""
        if r not in shard or r not in reps:
            problem = f"rank {r} is not in its own shard group {list(shard)} or replica group {list(reps)}"
        elif set(shard) & set(reps) != {r}:
            problem = (
                f"rank {r}'s shard group {list(shard)} and replica group {list(reps)} share "
                f"ranks {sorted((set(shard) & set(reps)) - {r})}: a replica group holds one "
                "rank of each shard group"
            )
        elif len(shard) * len(reps) != world:
            problem = (
                f"{len(reps)} replicas of shard groups of {len(shard)} ranks do not make the "
                f"world of {world} ranks (rank {r}: shard {list(shard)}, replicas {list(reps)})"
            )
        elif list(shard) != sorted(shard):
            problem = f"rank {r}'s shard group {list(shard)} is not in ascending rank order"
        else:
            for m in reps:
                other = layouts[m]
                if tuple(other.replicas) != reps:
                    problem = (
                        f"the replica groups differ across ranks: rank {r} has {list(reps)}, "
                        f"rank {m} has {list(other.replicas)}"
                    )
                elif tuple(other.shard).index(m) != shard.index(r):
                    problem = (
                        f"ranks {r} and {m} are replicas but hold different shards (positions "
                        f"{shard.index(r)} of {list(shard)} and {tuple(other.shard).index(m)} of "
                        f"{list(other.shard)})"
                    )
                if problem:
                    break
            for m in shard:
                if not problem and tuple(layouts[m].shard) != shard:
                    problem = (
                        f"the shard groups differ across ranks: rank {r} has {list(shard)}, "
                        f"rank {m} has {list(layouts[m].shard)}"
                    )
        if problem:
            return f"the replica groups do not tile the world with the shard groups: {problem}; {recipe}"
    return ""


def _which_units(units: Sequence[str]) -> str:
    """The first few unit names and the count: "(units: a, b, c and 5 more, 8 in all)"."""
    shown = ", ".join(units[:3])
    more = f" and {len(units) - 3} more, {len(units)} in all" if len(units) > 3 else ""
    return f"(units: {shown}{more})"


# ---------------------------------------------------------------------------
# FSDP2 internals. Everything that touches torch's private FSDP2 API is below:
# the ReduceScatter interface (not re-exported in torch 2.13), the parameter
# groups of an FSDPModule, their mesh and their FSDPParams' padded sizes.


# The oldest torch aps_comm.fsdp is tested on (tests/test_fsdp.py passes on
# 2.11 and 2.13); older torch lacks the FSDP2 API it builds on or is untested.
MIN_TORCH = "2.11"


@dataclasses.dataclass(frozen=True)
class _API:
    FSDPModule: type
    ReduceScatter: type
    FSDPMeshInfo: type
    DDPMeshInfo: type
    DefaultReduceScatter: type
    # FSDPModule.set_reduce_scatter_unused_params exists (torch 2.13 has it,
    # 2.11 does not); without it _reduce_scatter_unused_params sends the same zeros.
    unused_params: bool


@functools.lru_cache(maxsize=1)
def _fsdp_api() -> _API:
    """The private FSDP2 classes this module builds on, or a clear error."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
        from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo
    except ImportError as exc:
        raise RuntimeError(
            f"aps_comm.fsdp needs FSDP2's custom reduce-scatter API "
            f"(torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter and "
            f"FSDPModule.set_custom_reduce_scatter), which torch {torch.__version__} "
            f"does not have ({MIN_TORCH} or later has it): {exc}"
        ) from exc
    for method in (
        "set_custom_reduce_scatter",
        "set_force_sum_reduction_for_comms",
        "_get_fsdp_state",
    ):
        if not hasattr(FSDPModule, method):
            raise RuntimeError(
                f"aps_comm.fsdp needs FSDPModule.{method}, which torch {torch.__version__} "
                f"does not have ({MIN_TORCH} or later has it)"
            )
    return _API(
        FSDPModule,
        ReduceScatter,
        FSDPMeshInfo,
        DDPMeshInfo,
        DefaultReduceScatter,
        unused_params=hasattr(FSDPModule, "set_reduce_scatter_unused_params"),
    )


def _reduce_scatter_unused_params(mod: Any, group: Any, api: _API) -> None:
    """Make FSDP reduce-scatter zeros for a trainable parameter that got no gradient.

    The APS reduce-scatter needs every rank to send the unit's whole layout:
    a parameter used on one rank and not on another (conditional control
    flow) must still take its place, as zeros, or the ranks' inputs differ.
    Newer torch (2.13) does that with ``set_reduce_scatter_unused_params(True)``.
    Older torch (2.11) skips such a parameter in
    ``FSDPParamGroup.post_backward``; the wrapper below gives it a zero
    gradient just before, which post_backward then collects and clears exactly
    as torch 2.13's flag does (its ``unsharded_zero_grad_data`` branch):
    only when gradients are reduced, only for a parameter that was unsharded,
    requires a gradient and has neither a gradient nor one accumulated.
    """
    if api.unused_params:
        mod.set_reduce_scatter_unused_params(True, recurse=False)
        return
    post_backward = group.post_backward

    def zero_unused_then_post_backward(*args: Any) -> Any:
        if group.reduce_grads:
            for fsdp_param in group.fsdp_params:
                if not hasattr(fsdp_param, "_unsharded_param"):
                    continue
                param = fsdp_param.unsharded_param
                if (
                    param.requires_grad
                    and param.grad is None
                    and fsdp_param.unsharded_accumulated_grad is None
                ):
                    param.grad = torch.zeros_like(param)
        return post_backward(*args)

    # An attribute of this group only: FSDP looks post_backward up on the
    # instance (its autograd function and the root's final callback alike).
    group.post_backward = zero_unused_then_post_backward


def _param_groups(mod: Any) -> list[Any]:
    """The module's FSDP parameter groups.

    torch 2.13 keeps a list (``_fsdp_param_groups``: per-parameter meshes can
    make several); torch 2.11 keeps at most one (``_fsdp_param_group``).
    """
    state = mod._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _one_param_group(mod: Any, api: _API, world: int, replicated: bool) -> Any | None:
    """The module's single FSDP parameter group (None without parameters), or ValueError.

    The error's text is the same for every unit with that problem (the
    caller names the units once, after it).
    """
    groups = _param_groups(mod)
    if not groups:
        return None
    if len(groups) > 1:
        raise ValueError(
            "some modules have several parameter groups (shard_placement_fn with "
            "per-parameter meshes); aps_comm.fsdp supports one per module"
        )
    group = groups[0]
    mesh_info = group.mesh_info
    if isinstance(mesh_info, api.DDPMeshInfo) or not isinstance(mesh_info, api.FSDPMeshInfo):
        raise ValueError(
            "the model is sharded on a 2-D mesh (native HSDP) or replicated with replicate(), "
            "whose all-reduce across replicas aps_comm.fsdp cannot replace. Instead, shard "
            "each unit on the 1-D shard mesh and pass the replicate mesh to register: "
            'fully_shard(unit, mesh=mesh["shard"]), then aps_comm.fsdp.register(model, fmt, '
            'replicate=mesh["replicate"]). Without sharding, use DDP with aps_comm.register'
        )
    ranks = dist.get_process_group_ranks(mesh_info.shard_process_group)
    if not replicated and ranks != list(range(world)):
        raise ValueError(
            f"the shard mesh is not all {world} ranks in order (e.g. ranks {ranks}); "
            "aps_comm.fsdp needs a 1-D shard mesh over all ranks, or replicate= with the "
            "ranks that hold the same shard (HSDP)"
        )
    if replicated and getattr(group, "_all_reduce_hook", None) is not None:
        raise ValueError(
            "it already has an all-reduce hook (set_all_reduce_hook), which replicate= replaces"
        )
    custom = group._reduce_scatter_comm
    if not isinstance(custom, api.DefaultReduceScatter):
        if isinstance(custom, _comm_class()):
            raise ValueError(
                "aps_comm.fsdp.register was called on this model before: it already has "
                "a custom reduce-scatter (APS's)"
            )
        raise ValueError(
            "it already has a custom reduce-scatter (set_custom_reduce_scatter, "
            f"{type(custom).__name__}); aps_comm.fsdp replaces FSDP's default one only"
        )
    return group


def _grads_view_output(group: Any, output: torch.Tensor) -> bool:
    """Whether FSDP keeps ``output`` itself as the unit's new gradients, untouched after the hook.

    Only then may the all-reduce hook fill ``output`` after it returns. After
    the hook, ``foreach_reduce`` divides in place only for FP16 reduce dtypes
    or forced sums, casts to a copy where the reduce dtype is not the
    parameters', adds into gradients that exist, copies to the CPU where
    offloading, and runs post-accumulate-grad hooks on the values.
    """
    params = getattr(group, "fsdp_params", None)
    if not params or output.dtype not in (torch.float32, torch.bfloat16):
        return False
    if getattr(group, "_orig_dtype", None) != output.dtype:
        return False
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            _get_gradient_divide_factors,
        )

        _, postdivide, _, _ = _get_gradient_divide_factors(
            group._reduce_scatter_process_group,
            None,
            output.dtype,
            output.device.type,
            group.gradient_divide_factor,
            group.force_sum_reduction_for_comms,
        )
    except (ImportError, AttributeError, TypeError, ValueError):  # another torch: keep it safe
        return False
    if postdivide is not None:
        return False
    for fsdp_param in params:
        param = fsdp_param.sharded_param
        if param.requires_grad and (
            param.grad is not None
            or getattr(fsdp_param, "offload_to_cpu", True)
            or getattr(param, "_post_accumulate_grad_hooks", None)
        ):
            return False
    return True


def _unit_of(group: Any, index: int, module: str, names: dict[int, str]) -> _Unit:
    """The unit's trainable parameters, in FSDP's order, with their padded chunks."""
    params = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
    return _Unit(
        index=index,
        module=module,
        names=tuple(
            names.get(id(fp.sharded_param), f"{module}.?{i}") for i, fp in enumerate(params)
        ),
        numels=tuple(fp.sharded_param.numel() for fp in params),
        chunks=tuple(fp.padded_sharded_param_size.numel() for fp in params),
    )


@functools.lru_cache(maxsize=1)
def _comm_class() -> type:
    """The ReduceScatter subclass, made once the private base class is known to exist."""
    base = _fsdp_api().ReduceScatter

    class APSReduceScatter(base):  # type: ignore[misc, valid-type]
        """FSDP2 reduce-scatter through the APS codec (see :mod:`aps_comm.fsdp`).

        Runs synchronously and returns None: FSDP calls it without ``async_op``.
        """

        def __init__(self, state: APSFSDPState, unit: _Unit) -> None:
            self.state = state
            self.unit = unit

        def allocate(
            self,
            size: Sequence[int | torch.SymInt],
            *,
            dtype: torch.dtype,
            device: torch.device,
        ) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: Any,
            async_op: bool = False,
        ) -> dist.Work | None:
            self.state._reduce_scatter(self.unit, output_tensor, input_tensor, op)
            return None

    return APSReduceScatter
