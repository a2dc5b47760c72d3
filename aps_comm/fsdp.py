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

Not supported (a ``ValueError`` on every rank at :func:`register`): HSDP and
other meshes with a replicate dimension, a shard group other than all ranks
in order, several parameter groups per module (``shard_placement_fn`` with
per-parameter meshes), a module that already has a custom reduce-scatter,
and the :class:`~aps_comm.policy.Promote` policy.

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
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from aps_comm import agreement, caveats, teardown
from aps_comm.agreement import Layouts
from aps_comm.config import (
    BlockExponents,
    Reduction,
    Scaling,
    check_block_size,
    default_block_size,
)
from aps_comm.engine import Comm, Reducer, Settings
from aps_comm.formats import FloatFormat, get_format
from aps_comm.hostcopy import HostValue
from aps_comm.plan import Planner
from aps_comm.policy import Assignment, LayerInfo, Rule, policy_rules
from aps_comm.policy import describe as describe_policy
from aps_comm.telemetry import LayerStats, StepStats
from aps_comm.topology import Topology
from aps_perfmodel.strategies import hook_cluster

__all__ = ["APSFSDPConfig", "APSFSDPState", "register"]


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
    """

    fmt: FloatFormat
    scaling: Scaling = Scaling.LAYER
    block_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", get_format(self.fmt))
        object.__setattr__(self, "scaling", Scaling.parse(self.scaling, "scaling"))
        size = self.block_size
        if size is None:
            size = default_block_size(self.fmt.bits)
        object.__setattr__(self, "block_size", check_block_size(size))

    def describe(self) -> str:
        scaling = str(self.scaling)
        if self.scaling == Scaling.BLOCK:
            scaling += f"({self.block_size})"
        return f"fmt={self.fmt.describe()}, scaling={scaling}"


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
            step: per unit, the maxima (4 bytes per parameter plus 4) and the
            encoded reduce-scatter input (one byte per element for FP8,
            padding included). A reduce-scatter has no all-gather, so this is
            every byte, the same as ``bytes_total``.
        bytes_total: every payload byte this rank handed to a collective in
            the last step (the sum of ``bytes_detail``; named as
            :class:`aps_comm.APSState`'s, whose ``bytes_sent`` leaves out the
            all-gather).
        bytes_detail: the same per collective: "all_reduce_max", "all_to_all".
        step: steps that reduced gradients (a ``set_requires_gradient_sync(False)``
            backward reduces nothing and does not count).
        units: the module names of the FSDP units with trainable parameters.

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
    ) -> None:
        self.config = APSFSDPConfig(get_format(fmt), scaling, block_size)  # type: ignore[arg-type]
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
        self.reducer: Reducer | None = None
        self.bytes_sent = 0
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

    def bind(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """Make the reducer: two_phase on ``group`` for gradients on ``device``."""
        # Called by register (stacklevel 3: the user's call), the policy bound.
        caveats.warn_unblocked(self.assignment.possible(), self.config.scaling, stacklevel=3)
        world, rank = group.size(), dist.get_rank(group)
        backend = agreement.backend_for(group, device)
        comm = Comm(group, world, rank, backend, Layouts(Topology(world, 1)))
        planner = Planner(
            hook_cluster(backend, device.type, world, 1),
            False,
            False,
            scaling=self.config.scaling,
            block_size=self.config.block_size,
            # FSDP's owners keep FP32 sums: the blocks' exponents are agreed.
            block_exponents=BlockExponents.AGREED,
        )
        settings = Settings(
            self.fmt,
            Reduction.TWO_PHASE,
            self.config.scaling,
            self.collect_stats,
            False,
            self.config.block_size,
            BlockExponents.AGREED,
        )
        self.process_group, self._world_size = group, world
        self.reducer = Reducer(settings, comm, planner, self.assignment)

    def exit_workers(self) -> list:
        """No threads of its own: the reduce-scatter runs on FSDP's."""
        return []

    def exit_groups(self) -> list[dist.ProcessGroup]:
        """Hand over the state's process group and forget it (see :mod:`aps_comm.teardown`)."""
        groups = [self.process_group] if self.process_group is not None else []
        self.process_group, self.reducer = None, None
        return groups

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
        if unit.index in self._done:
            # A unit reduced twice before every unit did: the previous step
            # left some unit out (it cannot, with reduce_scatter_unused_params).
            self._end_step()
        if not self._done:
            self._check_last_step()
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
        assert self.reducer is not None
        self.bytes_detail, self._last_stats = self.reducer.end_step()
        self.bytes_sent = self.bytes_total = sum(self.bytes_detail.values())
        self._done = set()
        self.step += 1
        if self._flags is not None:
            self._flags_host, self._flags = HostValue(self._flags), None


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
) -> APSFSDPState:
    """Install the APS reduce-scatter on every ``fully_shard``-ed module of ``module``.

    Collective: call it on every rank, after ``fully_shard`` and before the
    first backward. It creates the state's process group, checks that every
    rank has the same configuration and units, and on each unit sets the
    custom reduce-scatter, ``set_force_sum_reduction_for_comms(True)`` (plain
    sums; FSDP divides afterwards) and ``set_reduce_scatter_unused_params(True)``
    (a parameter without a gradient sends zeros, so every rank's layout is the
    same).

    Args:
        module: the model; it or its submodules are ``fully_shard``-ed
            (FSDP2) over one mesh dimension spanning all ranks.
        fmt: the wire format ("e4m3", "e5m2", "fp16", "bf16", "fp32", any
            "eXmY", or a FloatFormat).
        scaling: "layer" (APS, one exponent per parameter), "bucket" (one per
            unit and format), "block" (one per ``block_size`` elements of each
            parameter's chunk, agreed by one MAX all-reduce of one-byte
            exponents) or "none" (plain saturating cast).
        policy: static rules of :mod:`aps_comm.policy` (``ByName``,
            ``KeepLast``, ``MinNumel``, ``LowRatio``) and ``Schedule``;
            ``Promote`` is not supported.
        stats: record per-parameter :class:`~aps_comm.telemetry.LayerStats`
            of the last step in ``state.stats`` (local passes, no collective).
        block_size: elements per block with ``scaling="block"`` (a power of
            two from 8 to 256; default: 128 for 8-bit formats, 32 below).

    Returns:
        The :class:`APSFSDPState`.

    Raises:
        RuntimeError: torch.distributed is not initialised, or this torch
            lacks FSDP2's custom reduce-scatter API.
        ValueError: no ``fully_shard``-ed module, an unsupported layout (HSDP,
            a sub-mesh, several parameter groups, an existing custom
            reduce-scatter), or a configuration that differs across ranks;
            raised on every rank.

    Example:
        >>> state = register(model, "e4m3", stats=True)  # doctest: +SKIP
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("aps_comm.fsdp.register needs torch.distributed initialised")
    api = _fsdp_api()
    state = APSFSDPState(fmt, scaling, policy, stats, block_size)
    names = {id(p): n for n, p in module.named_parameters()}
    # Per problem, the units that have it: a problem is said once, its units after.
    unfit: dict[str, list[str]] = {}
    found: list[tuple[Any, Any, _Unit]] = []
    world = dist.get_world_size()
    for mod_name, mod in module.named_modules():
        if not isinstance(mod, api.FSDPModule):
            continue
        try:
            group = _one_param_group(mod, api, world)
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

    # Collective from here: every rank creates the group and compares notes
    # before any rank raises, so a problem on one rank is an error on all.
    agreement.wait_for_ranks("aps_comm.fsdp.register")
    with teardown.released_if_raises(state):
        _bind(state, device, formats, problems)
        comm_class = _comm_class()
        for mod, group, unit in found:
            mod.set_custom_reduce_scatter(comm_class(state, unit))
            mod.set_force_sum_reduction_for_comms(True)
            _reduce_scatter_unused_params(mod, group, api)
    teardown.release_at_exit(state)
    return state


def _bind(
    state: APSFSDPState, device: torch.device, formats: Sequence[FloatFormat], problems: list[str]
) -> None:
    """Create the state's group, bind to it, agree with every rank (collective)."""
    group = agreement.new_group()
    if not problems:
        try:
            state.bind(group, device)
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
        group,
        mine,
        what="aps_comm.fsdp configuration",
        problem="; ".join(problems),
        refused="aps_comm.fsdp.register cannot install on this model",
    )


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


def _one_param_group(mod: Any, api: _API, world: int) -> Any | None:
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
            "the model is replicated across a mesh dimension (HSDP: fully_shard on a 2-D "
            "mesh; or replicate()), which aps_comm.fsdp does not support yet (issue 44 will "
            "add replicate=). What works today: fully_shard each unit on a 1-D mesh over all "
            f"{world} ranks (fully_shard's default mesh, or "
            f"init_device_mesh(device_type, ({world},))), or DDP with aps_comm.register"
        )
    ranks = dist.get_process_group_ranks(mesh_info.shard_process_group)
    if ranks != list(range(world)):
        raise ValueError(
            f"the shard mesh is not all {world} ranks in order (e.g. ranks {ranks}); "
            "aps_comm.fsdp needs a 1-D shard mesh over all ranks"
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
