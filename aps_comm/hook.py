"""The APS communication hook for DistributedDataParallel: DDP glue and state.

Per bucket the :class:`aps_comm.engine.Reducer` finds each layer's largest
|gradient| in one fused pass, agrees on them with one MAX all-reduce,
multiplies each layer by a power of two chosen so nothing can overflow
(:mod:`aps_comm.scaling`), and encodes, reduces and decodes the bucket in
place in pipelined chunks (:mod:`aps_comm.transports` over
:mod:`aps_comm.codec`). This module is the DDP glue: the state users hold,
binding it to the job (:mod:`aps_comm.agreement`), and where a bucket's
work runs.

The hook returns at once (:mod:`aps_comm.executor`): on Gloo one FIFO worker
per state runs the buckets in DDP's order, so every rank issues the same
collectives in the same order; on NCCL the work is enqueued on a side stream
and the future is CUDA-aware. Collectives run on the state's own process
group, never DDP's.

Example:
    >>> from aps_comm import APSState, aps_hook, register
    >>> state = APSState(fmt="e4m3")            # may precede init_process_group
    >>> ddp.register_comm_hook(state, aps_hook)  # doctest: +SKIP
    >>> state = register(ddp, fmt="e5m2")        # the same, in one call  # doctest: +SKIP
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations
# and requires the real dist.GradBucket / torch.futures.Future objects.

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from typing import TypedDict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import Unpack

from aps_comm import agreement, caveats, teardown, transports
from aps_comm.config import (
    BlockExponents,
    Reduction,
    Scaling,
    check_block_size,
    default_block_size,
)
from aps_comm.engine import Comm, Reducer, Settings, Settled, Steady
from aps_comm.executor import FifoWorker, raised_by_backward, run_on_side_stream
from aps_comm.feedback import ErrorFeedback
from aps_comm.formats import FP32, FloatFormat, get_format
from aps_comm.graphs import BucketGraphs
from aps_comm.plan import Planner
from aps_comm.policy import Assignment, LayerInfo, Rule, policy_rules
from aps_comm.policy import describe as describe_policy
from aps_comm.reduction import resolve_routes
from aps_comm.telemetry import LayerStats, StepStats
from aps_comm.topology import NodeGroups, Topology, by_rank
from aps_comm.workspace import Slot
from aps_perfmodel.profile import Profile
from aps_perfmodel.strategies import hook_cluster

__all__ = ["APSConfig", "APSState", "StateOptions", "aps_hook", "register"]


@dataclasses.dataclass(frozen=True)
class APSConfig:
    """What every rank must agree on.

    Attributes:
        fmt: the wire format.
        reduction: a :class:`aps_comm.config.Reduction` (or its name).
        scaling: a :class:`aps_comm.config.Scaling` (or its name).
        block_size: elements per block with ``scaling="block"`` (a power of
            two from 8 to 256); None: the format's default
            (:func:`aps_comm.config.default_block_size`: 128 for 8-bit formats,
            32 below).
        block_exponents: with ``scaling="block"``, where two_phase's block
            exponents come from (:class:`aps_comm.config.BlockExponents`).

    Example:
        >>> APSConfig("e4m3", "two_phase").describe()
        'fmt=e4m3(e4m3, bias=7, fn), reduction=two_phase, scaling=layer'
        >>> APSConfig("e2m1", "two_phase", "block", 64).describe()
        'fmt=e2m1(e2m1, bias=1, none), reduction=two_phase, scaling=block(64)'
        >>> APSConfig("e2m1", "two_phase", "block", 32, "agreed").describe()
        'fmt=e2m1(e2m1, bias=1, none), reduction=two_phase, scaling=block(32, agreed exponents)'
        >>> APSConfig("e4m3", "two_phase", "block").block_size
        128
    """

    fmt: FloatFormat
    reduction: Reduction = Reduction.AUTO
    scaling: Scaling = Scaling.LAYER
    block_size: int | None = None
    block_exponents: BlockExponents = BlockExponents.RANK

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", get_format(self.fmt))
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block_size(self.fmt.bits))
        object.__setattr__(self, "reduction", Reduction.parse(self.reduction, "reduction"))
        object.__setattr__(self, "scaling", Scaling.parse(self.scaling, "scaling"))
        object.__setattr__(self, "block_size", check_block_size(self.block_size))
        object.__setattr__(
            self,
            "block_exponents",
            BlockExponents.parse(self.block_exponents, "block_exponents"),
        )

    def describe(self) -> str:
        scaling = str(self.scaling)
        if self.scaling == Scaling.BLOCK:
            agreed = self.block_exponents == BlockExponents.AGREED
            scaling += f"({self.block_size}{', agreed exponents' if agreed else ''})"
        return f"fmt={self.fmt.describe()}, reduction={self.reduction}, scaling={scaling}"


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """What the hook hands the engine: the bucket as DDP gave it."""

    index: int
    buffer: torch.Tensor
    params: list[torch.Tensor]
    is_last: bool
    # Where ``params`` was left empty (settled when submitted): the parameters, asked for
    # only if the bucket is no longer settled when it runs (another bucket bound since
    # may have outgrown the workspace it was bound to).
    more: Callable[[], list[torch.Tensor]] | None = None


class APSState:
    """State of the APS hook: configuration, process group, policy, scratch buffers, stats.

    Can be built before ``torch.distributed`` is initialised. Unless
    ``process_group`` is given, it uses a group of its own over all ranks, so
    its collectives never interleave with DDP's: :func:`register` (or
    :meth:`bind_process_group`) creates it at once, with the default group's
    timeout; otherwise the first hook call does.

    Args:
        fmt: wire format: a name accepted by :func:`aps_comm.formats.get_format`
            ("e4m3", "e5m2", "fp16", "bf16", "fp32", "e3m2", ...) or a FloatFormat.
            "fp32" is a plain averaging all-reduce, bit for bit PyTorch's
            ``allreduce_hook``.
        reduction: "allreduce" (native sum in the wire dtype), "two_phase"
            (all-to-all, FP32 sum, all-gather), "hierarchical" (FP32
            reduce-scatter inside each node, two_phase across nodes, all-gather
            inside the node; only the wire format crosses nodes) or "auto":
            per bucket, whichever :mod:`aps_perfmodel.strategies` predicts
            fastest among native (where the backend sums the wire dtype:
            FP16/BF16 always, FP8 on NCCL >= 2.24 with sm_90+), two_phase,
            hierarchical (several nodes of several ranks) and, on NCCL or
            with a ``profile``, the plain FP32 all-reduce for buckets too
            small for anything else to pay (``state.bucket_reductions`` and
            the stats say what was chosen).
        scaling: "layer" (APS, one exponent per parameter tensor), "bucket"
            (one per bucket and format), "block" (one per ``block_size``
            elements of each parameter, agreed by one MAX all-reduce of
            one-byte exponents; what makes 4-bit formats such as e2m1 train)
            or "none" (plain saturating cast).
        block_size: elements per block with ``scaling="block"``: a power of
            two from 8 to 256; default: 128 for 8-bit formats, 32 below
            (:func:`aps_comm.config.default_block_size`, measured).
        block_exponents: with ``scaling="block"`` and two_phase, "rank"
            (the default: no collective before the first chunk, each rank
            sends its own block exponents with its shards) or "agreed" (one
            MAX all-reduce of the blocks' exponents first); with error
            feedback and the other routes the exponents are always agreed.
            See :class:`aps_comm.config.BlockExponents`.
        process_group: group to communicate on; default: a new group over all ranks.
        stats: record per-layer :class:`~aps_comm.telemetry.LayerStats` of the
            last step in ``state.stats``.
        policy: rules of :mod:`aps_comm.policy` choosing a format per layer
            (needs the model: use :func:`register` or :meth:`bind_model`).
        error_feedback: keep what rounding lost (this rank's encoding, and
            for two_phase its re-encoding as shard owner) and add it back next
            step. Memory: one float32 copy of the gradients per rank (and a
            settled bucket's scratch). The rounding of native low-precision
            sums inside the backend is not compensated. Not with
            ``reduction="hierarchical"``. With ``scaling="block"`` the block
            exponents are agreed (``block_exponents`` is ignored): owners
            re-encode their means with the agreed exponents and keep the loss
            in their residuals, because the residual updates are not part of
            the fused kernels that send each rank's and owner's own exponents
            (docs/precision-policies.md, "Error feedback").
        ranks_per_node: ranks on each node, for hierarchical reductions; None
            reads ``LOCAL_WORLD_SIZE`` (set by torchrun, aps-launch and the
            SLURM and MPI launchers), else 1. Ranks must be numbered node by
            node; every rank checks what the others see when it binds.
        profile: a calibrated :class:`aps_perfmodel.profile.Profile` (or the
            path of its JSON, from ``python -m aps_comm calibrate``): the links and
            codec the hook plans chunks and strategies with; default: the
            backend's defaults (:func:`aps_perfmodel.strategies.hook_cluster`).
        cuda_graphs: on NCCL with CUDA tensors, capture each settled bucket's
            device work (but the step's last bucket's) as a CUDA graph and
            replay it every step: one launch instead of a few hundred
            microseconds of host work per bucket, the same bits
            (:mod:`aps_comm.graphs`). A failed capture is logged and the
            buckets run eagerly.

    Attributes:
        stats: the last step's per-layer records (with ``stats=True``).
        bytes_sent: payload bytes this rank handed to the collectives that
            match an all-reduce in the last step: every entry of
            ``bytes_detail`` but the all-gathers ("all_gather",
            "node_all_gather"), i.e. the maxima, the encoded buckets in the
            all-to-all (or native all-reduce) and the FP32 all-reduce. An
            all-reduce's input is one copy of the bucket, which the two_phase
            all-to-all's input also is; the all-gather that hands the averaged
            shards back is the rest of the exchange, and ``bytes_total``
            counts it.
        bytes_total: every payload byte this rank handed to a collective in
            the last step: the sum of ``bytes_detail``, all-gathers and the
            maxima all-reduce included.
        bytes_detail: the same per collective: "all_reduce_max", "all_to_all",
            "all_gather", "all_reduce"; hierarchical adds the in-node
            "node_all_to_all" (FP32) and "node_all_gather" ("all_to_all" and
            "all_gather" are then what crosses nodes).
        step: steps communicated so far.
        bucket_reductions: per bucket index, the reduction its (largest)
            low-precision group used in the last step.
        bucket_chunks: per bucket index, the elements per chunk it was cut
            into in the last step (absent for buckets sent as plain FP32).
        chunk_elements: elements per pipelined chunk of a bucket; None (the
            default) sizes them per bucket by bytes per peer and the
            pipelining optimum (:meth:`aps_comm.plan.Planner.chunk`), from the
            bucket's measured exchange on CPU tensors (the ranks agree
            through the maxima all-reduce), from the model before that and on
            CUDA.
        chunk_bytes: the same in wire bytes (used when ``chunk_elements`` is None).

    Example:
        >>> state = APSState(fmt="e4m3", reduction="two_phase", stats=True)
        >>> ddp.register_comm_hook(state, aps_hook)  # doctest: +SKIP
    """

    def __init__(
        self,
        fmt: FloatFormat | str = "e4m3",
        reduction: Reduction | str = "auto",
        scaling: Scaling | str = "layer",
        process_group: dist.ProcessGroup | None = None,
        stats: bool = False,
        policy: Sequence[Rule] | None = None,
        error_feedback: bool = False,
        ranks_per_node: int | None = None,
        profile: Profile | str | os.PathLike | None = None,
        block_size: int | None = None,
        block_exponents: BlockExponents | str = BlockExponents.RANK,
        cuda_graphs: bool = True,
    ) -> None:
        self.config = APSConfig(
            get_format(fmt),
            reduction,  # type: ignore[arg-type]
            scaling,  # type: ignore[arg-type]
            block_size,
            block_exponents,  # type: ignore[arg-type]
        )
        self.profile = Profile.load(profile) if isinstance(profile, (str, os.PathLike)) else profile
        if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool)
            or not isinstance(ranks_per_node, int)
            or ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if error_feedback and self.config.reduction in (Reduction.HIERARCHICAL, Reduction.GRID):
            raise ValueError(
                f"error_feedback is not supported with reduction={reduction!r} (partial "
                "sums are rounded for several ranks at once); use reduction='two_phase'"
            )
        self.ranks_per_node = ranks_per_node
        self.process_group = process_group
        self.collect_stats = bool(stats)
        self.policy: list[Rule] = policy_rules(policy)
        self.assignment = Assignment(self.policy, self.config.fmt)
        if self.assignment.promoter is not None and self.config.scaling == Scaling.BLOCK:
            raise ValueError(
                "policy Promote needs one exponent per layer (it measures each layer's "
                "underflow on the agreed maxima); use scaling='layer' with Promote, or "
                "scaling='block' without it"
            )
        self.error_feedback = bool(error_feedback)
        self.feedback = ErrorFeedback(0, 1) if self.error_feedback else None
        # FP32 with nothing on top: every bucket is exactly default_hooks.allreduce_hook.
        self.plain_fp32 = self.config.fmt == FP32 and not self.policy and not self.error_feedback
        self.bytes_sent = 0
        self.bytes_total = 0
        self.bytes_detail: dict[str, int] = {}
        self.step = 0
        self.param_names: dict[int, str] = {}
        self.chunk_elements: int | None = None
        self.chunk_bytes: int | None = None
        self.layouts: agreement.Layouts | None = None
        self.reducer: Reducer | None = None
        self._world_size = 0
        self._last_stats = StepStats()
        self._worker: FifoWorker | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # NCCL, this step: whether the side stream has work since the last settled FP32
        # bucket's all-reduce on DDP's thread (:meth:`_fp32_on_nccl`), and that
        # all-reduce's future, which the side stream's next work waits for.
        self._side_ahead = False
        self._direct: torch.futures.Future | None = None
        # Per bucket index: the non-float32 buffer of DDP's whose float32 copy it was last
        # bound on (:meth:`_float_input`), that copy, and its region's epoch. The buffer
        # itself, not its address: DDP frees a buffer when it re-buckets, and the new one
        # may be allocated at the same address.
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = {}
        # The last step's last bucket: buckets past it are forgotten once, when it changes.
        self._last_bucket = -1
        self.cuda_graphs = bool(cuda_graphs)
        # Settled buckets' CUDA graphs (NCCL with CUDA tensors only).
        self.graphs: BucketGraphs | None = None
        # The last bucket's finishing job and DDP's future for it, until the
        # next bucket has started.
        self._deferred: tuple[Callable[[], torch.Tensor], torch.futures.Future] | None = None
        # Promote's last local underflow rates, kept until a reducer exists.
        self._rates: dict[str, float] = {}
        # Per rank, per device type: (problem, backend and routes), from binding.
        self._routes_agreed: list[dict[str, tuple[str, str]]] = []

    # -- what users read ---------------------------------------------------------

    @property
    def fmt(self) -> FloatFormat:
        return self.config.fmt

    @property
    def reduction(self) -> str:
        """The reduction used: as requested until bound, then resolved; after a step
        with "auto", what the buckets chose (joined by "+" where they differ)."""
        if self.reducer is not None:
            chosen = sorted(set(self.reducer.bucket_routes.values()))
            if chosen:
                return "+".join(chosen)
            routes = self.reducer.resolve_cached()
            if self.fmt in routes:
                return str(routes[self.fmt])
        return str(self.config.reduction)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def stats(self) -> list[LayerStats]:
        """The last step's per-layer records (with ``stats=True``), read from the device once."""
        return self._last_stats.records()

    @stats.setter
    def stats(self, records: list[LayerStats]) -> None:
        self._last_stats = StepStats.of(records)

    @property
    def bucket_reductions(self) -> dict[int, str]:
        return self.reducer.bucket_routes if self.reducer is not None else {}

    @property
    def bucket_chunks(self) -> dict[int, int]:
        return self.reducer.bucket_chunks if self.reducer is not None else {}

    @property
    def topology(self) -> Topology | None:
        return self.layouts.topology if self.layouts is not None else None

    @property
    def nodes(self) -> NodeGroups | None:
        return self.layouts.nodes if self.layouts is not None else None

    @property
    def grid(self) -> NodeGroups | None:
        return self.layouts.grid if self.layouts is not None else None

    # -- binding -------------------------------------------------------------------

    def bind_model(self, module: torch.nn.Module) -> None:
        """Learn parameter names and apply the static policy rules.

        :func:`register` calls it; call it yourself when registering the hook
        with ``ddp.register_comm_hook`` and using a policy or ``state_dict``.
        """
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_names = {id(p): n for n, p in named}
        self.assignment.bind(
            {
                id(p): LayerInfo(i, n, p.numel(), n.rpartition(".")[0], p)
                for i, (n, p) in enumerate(named)
            }
        )

    def describe(self) -> str:
        """The configuration a checkpoint is saved with and loads into, as text."""
        return (
            f"{self.config.describe()}, policy={describe_policy(self.policy)}, "
            f"error_feedback={self.error_feedback}"
        )

    def agreed_settings(self) -> dict[str, str]:
        """Every setting the ranks compare when they bind, as text, named as the argument is.

        What :meth:`describe` holds, one entry per argument (a difference is
        reported by name), and the profile: ranks planning with different
        profiles would choose different routes and chunks. A checkpoint does
        not record the profile (a resumed run may recalibrate).

        Example:
            >>> APSState("e2m1", "two_phase", "block", block_size=64).agreed_settings()["block_size"]
            '64'
        """
        config = self.config
        settings = {
            "fmt": config.fmt.describe(),
            "reduction": str(config.reduction),
            "scaling": str(config.scaling),
        }
        if config.scaling == Scaling.BLOCK:  # unused otherwise
            settings["block_size"] = str(config.block_size)
            settings["block_exponents"] = str(config.block_exponents)
        settings["policy"] = describe_policy(self.policy)
        settings["error_feedback"] = str(self.error_feedback)
        settings["profile"] = _profile_text(self.profile)
        return settings

    def bind_process_group(self, timeout: datetime.timedelta | None = None) -> None:
        """Create the state's process group (unless one was given) and agree on the configuration.

        Collective: call it on every rank, where every rank is alive and in
        step (:func:`register` does; otherwise the first hook call does, and
        blocks until every rank has reached it). The group's timeout is
        ``timeout``, else the default group's, so no collective of the hook
        outlives the timeout the job chose.

        Raises:
            ValueError: the configuration differs across ranks (on every rank).
        """
        if self._world_size:
            return
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("the APS hook needs torch.distributed initialised")
        if self.process_group is None:
            self.process_group = agreement.new_group(timeout)
        # Its Gloo threads must be joined before Python shuts down.
        teardown.release_at_exit(self)
        group = self.process_group
        # Agree on the configuration before anything can raise on one rank only:
        # a rank that raised alone would leave the others blocked in a collective.
        # What each rank would run on each device type is agreed here too, so
        # that binding to the gradients' device at the first hook call needs no
        # collective (the hook must never wait for a peer).
        agreement.agree(group, self.agreed_settings(), what="APSState configuration")
        mine = (
            agreement.seen_topology(self.ranks_per_node),
            self._routes_seen(group),
            self.ranks_per_node is not None,
        )
        everyone = agreement.gather(group, mine)
        self.layouts = agreement.bind_topology(
            [c[0] for c in everyone],
            group,
            self.config.reduction,
            grid_ok=not self.error_feedback,
            # One rank's ranks_per_node= makes a layout error every rank's.
            explicit=any(c[2] for c in everyone),
            timeout=timeout,
        )
        self._routes_agreed = [c[1] for c in everyone]
        self._world_size = group.size()

    def _routes_seen(self, group: dist.ProcessGroup) -> dict[str, tuple[str, str]]:
        """Per device type this rank can hold gradients on: (problem, backend and routes)."""
        devices = [torch.device("cpu")]
        if torch.cuda.is_available():
            devices.append(torch.device("cuda", torch.cuda.current_device()))
        seen = {}
        for device in devices:
            try:
                backend = agreement.backend_for(group, device)
                agreement.check_backend(backend, device)
                resolved = resolve_routes(
                    self.config.reduction, self.assignment.possible(), backend, device
                )
                routes = {f.name: str(r) for f, r in resolved.items()}
                seen[device.type] = ("", f"backend={backend}, routes={routes}")
            except ValueError as exc:
                seen[device.type] = (str(exc), "")
        return seen

    def bind(self, device: torch.device) -> None:
        """Bind to the gradients' device: backend, routes, planner.

        :func:`register` calls it with the model's device; else the first
        hook call does. It needs no collective: what every rank would run on
        each device type was gathered by :meth:`bind_process_group`, so every
        rank raises the same error when one cannot run: an unsupported
        backend, a reduction the backend cannot run for a format (FP8
        ``"allreduce"`` on Gloo), or routes that differ across ranks (FP8
        sums on some GPUs only).
        """
        if self.reducer is not None:
            return
        # From register (stacklevel 3: the user's call) or the first hook call.
        caveats.warn_unblocked(self.assignment.possible(), self.config.scaling, stacklevel=3)
        self.bind_process_group()
        group = self.process_group
        assert group is not None and self.layouts is not None
        seen = [c.get(device.type, (f"no {device.type} device", "")) for c in self._routes_agreed]
        problems = [p for p, _ in seen]
        if any(problems):
            raise ValueError(f"aps_comm cannot run this configuration: {by_rank(problems)}")
        if any(text != seen[0][1] for _, text in seen):
            listing = by_rank([t for _, t in seen])
            raise ValueError(f"aps_comm: the resolved reductions differ across ranks: {listing}")
        if (self.policy or self.error_feedback) and not self.assignment.bound:
            raise ValueError(
                "policies and error feedback need the model's parameter names: use "
                "aps_comm.register(ddp, ...) or call state.bind_model(ddp.module) first"
            )
        backend = agreement.backend_for(group, device)
        comm = Comm(group, self._world_size, dist.get_rank(group), backend, self.layouts)
        reducer = self._reducer(comm, device)
        reducer.resolve(device)
        self.reducer = reducer
        if self.cuda_graphs and device.type == "cuda" and backend == "nccl":
            self.graphs = BucketGraphs()

    def _reducer(self, comm: Comm, device: torch.device) -> Reducer:
        assert self.layouts is not None
        topology = self.layouts.topology
        cluster = hook_cluster(
            comm.backend, device.type, comm.world_size, topology.ranks_per_node, self.profile
        )
        planner = Planner(
            cluster,
            hierarchical=self.layouts.nodes is not None
            and topology.nodes > 1
            and topology.ranks_per_node > 1
            and not self.error_feedback,
            fp32=comm.backend == "nccl" or self.profile is not None,
            grid=self.layouts.grid is not None,
            scaling=self.config.scaling,
            block_size=self.config.block_size,
            block_exponents=(
                BlockExponents.AGREED if self.error_feedback else self.config.block_exponents
            ),
        )
        settings = Settings(
            self.fmt,
            self.config.reduction,
            self.config.scaling,
            self.collect_stats,
            self.error_feedback,
            self.config.block_size,
            self.config.block_exponents,
        )
        if self.feedback is not None:
            self.feedback.rank, self.feedback.world_size = comm.rank, comm.world_size
        reducer = Reducer(settings, comm, planner, self.assignment, self.feedback)
        zero = torch.zeros((), device=device)
        reducer.rates.update({k: zero + v for k, v in self._rates.items()})
        return reducer

    # -- one step --------------------------------------------------------------------

    def _end_step(self) -> None:
        assert self.reducer is not None
        self.bytes_detail, self._last_stats = self.reducer.end_step()
        self.bytes_sent = sum(
            v for k, v in self.bytes_detail.items() if not k.endswith("all_gather")
        )
        self.bytes_total = sum(self.bytes_detail.values())
        self.step += 1
        # DDP's stream waits for every bucket's future: the next step starts ordered.
        self._side_ahead, self._direct = False, None

    def _chunk(self) -> int | None:
        """Elements per chunk as the user fixed them, or None (the engine decides)."""
        if self.chunk_elements is not None:
            return self.chunk_elements
        if self.chunk_bytes is not None:
            return max(1, int(self.chunk_bytes) * 8 // self.fmt.wire_bits)
        return None

    def _submit(self, bucket: _Bucket, steady: Settled | None = None) -> torch.futures.Future:
        """Run the bucket off DDP's thread; the future completes with the averaged buffer.

        ``steady``: the bucket's settled path as :meth:`Reducer.steady_for` found it
        for this call (None: not settled), so a graph's replay does not look it up again.
        """
        assert self.reducer is not None
        device = bucket.buffer.device
        if device.type == "cuda" and self.reducer.comm.backend == "nccl":
            stream = self._stream(device)
            if self._direct is not None:  # after the FP32 all-reduce issued before it
                with torch.cuda.stream(stream):
                    self._direct.wait()  # NCCL's future is complete: a stream wait only
                self._direct = None
            self._side_ahead = True
            if self.graphs is not None and not bucket.is_last:
                fut = self._graphed(bucket, stream, steady)
                if fut is not None:
                    return fut
            job = functools.partial(_run_now, self._run_bucket, bucket)
            return run_on_side_stream(job, stream)
        if self._worker is None:
            self._worker = FifoWorker(f"aps-comm-{id(self):x}")
        if device.type == "cuda":
            # Gloo with CUDA tensors: the worker waits for the gradients'
            # producer on the state's stream, drained before the future completes.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            job = functools.partial(_run_now, self._run_bucket, bucket)
            return self._worker.submit(
                functools.partial(_on_worker_stream, job, ready, self._stream(device))
            )
        # The bucket's last chunks stay on the wire while the next bucket's
        # maxima, exponents and first chunks are computed: the worker finishes
        # bucket k after starting bucket k + 1 (the collectives' order is the
        # same on every rank: it follows DDP's bucket order).
        previous, self._deferred = self._deferred, None
        if previous is not None and bucket.index == 0:
            previous = None  # left over from a step whose backward raised: drop it
        started: dict[str, functools.partial] = {}
        defer = not bucket.is_last
        self._worker.submit(lambda: started.setdefault("finish", self._run_bucket(bucket, defer)))
        if previous is not None:
            _forward(self._worker.submit(previous[0]), previous[1])
        finish = functools.partial(_call_stored, started, "finish")
        if not defer:
            return self._worker.submit(finish)
        fut: torch.futures.Future = torch.futures.Future()
        self._deferred = (finish, fut)
        return fut

    def _fp32_on_nccl(self, buffer: torch.Tensor) -> torch.futures.Future:
        """``allreduce_hook``'s call for a settled FP32 bucket on NCCL, on DDP's thread.

        Ordered after this step's side-stream work where there is some: a graph
        replays its NCCL kernels on the side stream, not the process group's, and
        kernels of one communicator on two unordered streams may deadlock.
        """
        assert self.reducer is not None
        comm, traffic = self.reducer.comm, self.reducer.traffic
        after: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self._side_ahead:
            stream = self._stream(buffer.device)
            stream.wait_stream(torch.cuda.current_stream(buffer.device))
            after = torch.cuda.stream(stream)
        with after:
            fut = transports.fp32_mean_async(buffer, comm.group, comm.world_size, traffic)
        self._side_ahead, self._direct = False, fut
        return fut

    def _graphed(
        self, b: _Bucket, stream: torch.cuda.Stream, steady: Settled | None
    ) -> torch.futures.Future | None:
        """The bucket's settled work as CUDA graphs on the side stream (:meth:`_replayed`);
        None where it runs eagerly instead, or where the caller's stream is itself being
        captured."""
        if torch.cuda.is_current_stream_capturing():
            return None
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            if not self._replayed(b, steady):
                return None
            fut: torch.futures.Future = torch.futures.Future(devices=[b.buffer.device])
            fut.set_result(b.buffer)
        return fut

    def _replayed(self, b: _Bucket, steady: Settled | None) -> bool:
        """Run the bucket's settled work on the current stream as its graph: replayed, or
        captured then replayed (a Promote bucket: first its step on the host, from the
        rates its last step agreed; where a format moved, bound again and run eagerly, its
        graph dropped).

        False where nothing ran, and it runs eagerly: not settled, a first settled
        run, or capture failed. A bucket of another dtype than float32 is captured
        with its copies into its float32 copy and back (:meth:`_float_input`).
        """
        graphs, reducer = self.graphs, self.reducer
        assert graphs is not None and reducer is not None
        buffer = b.buffer
        if steady is None and graphs.lookup(b.index, buffer) is not None:
            # A new epoch of the policy (Schedule, Promote): the bucket is bound
            # again to its new formats, then captured again.
            graphs.drop(b.index)
        # A graph replays the settled path it captured: none of an earlier binding
        # (error feedback binds again after restored residuals).
        entry = graphs.lookup(b.index, buffer, steady) if steady is not None else None
        if entry is None and (steady is None or not graphs.ready(b.index, buffer)):
            return False
        moved: bool | None = None
        if steady.promote is not None:
            # The host waits only for the copy of the rates its last step agreed, which
            # the last step's eager (watched) last bucket follows on this stream: a dead
            # peer fails the job within the process group's timeout, as elsewhere.
            moved = reducer.promote_early(b.index, steady)
            if moved is None:
                return False  # eagerly: it decides after its MAX all-reduce
            if moved:  # bound again, run eagerly
                graphs.drop(b.index)
                with torch.no_grad():
                    self._steady_work(b, steady, moved)
                return True
        if entry is None:
            work = functools.partial(self._steady_work, b, steady, moved)
            with torch.no_grad():
                entry = graphs.capture(
                    b.index, buffer, work, reducer.traffic, reducer.stats, steady
                )
                if entry is None and moved is not None:  # graphs are off, Promote decided
                    work()
                    return True
            if entry is None:
                return False
        graphs.replay(entry, reducer.traffic, reducer.stats)
        if moved is not None:  # the rates its replay agreed, for its next step
            reducer.keep_rates(b.index)
        return True

    def _steady_work(self, b: _Bucket, steady: Settled, moved: bool | None = None) -> None:
        """A settled bucket's device work, nothing on the host besides (``moved``: Promote's
        step, decided already); with its copies into its float32 copy and back where
        DDP's buffer is of another dtype."""
        reducer = self.reducer
        assert reducer is not None
        x = self._float_view(b.index, b.buffer) if b.buffer.dtype != torch.float32 else b.buffer
        assert x is not None  # settled: the copy was made
        if x is not b.buffer:
            x.copy_(b.buffer.view(-1))
        tail = reducer.run_steady(b.index, steady, x, moved=moved)
        if tail is not None:
            tail()
        if x is not b.buffer:
            b.buffer.copy_(x)

    def run_bucket(
        self,
        index: int,
        buffer: torch.Tensor,
        params: Sequence[torch.Tensor] = (),
        is_last: bool = True,
    ) -> torch.Tensor:
        """Average one bucket on the calling thread, as the hook's worker does.

        For tools that measure the bucket path itself (``benchmarks.hostcost``):
        no future, no worker, no side stream. ``params`` may be empty once the
        bucket has settled (its second step after DDP's re-bucketing).

        Example:
            >>> state.run_bucket(0, flat_grads, list(model.parameters()))  # doctest: +SKIP
        """
        if self.reducer is None:
            self.bind(buffer.device)
        return self._run_bucket(_Bucket(index, buffer, list(params), is_last))()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """The state's one side stream per device (created once, not per bucket)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _run_bucket(self, b: _Bucket, defer: bool = False) -> Callable[[], torch.Tensor]:
        """Start one bucket's reduction; return the function that finishes it."""
        reducer = self.reducer
        assert reducer is not None
        try:
            x = b.buffer if b.buffer.dtype == torch.float32 else self._float_input(b)
            steady = reducer.steady_for(b.index, x)
            if steady is not None:
                tail = reducer.run_steady(b.index, steady, x, defer)
                return functools.partial(self._finish_bucket, b, x, tail)
            params = b.params if b.params or b.more is None else b.more()
            numels = [p.numel() for p in params]
            names = [self.param_names.get(id(p)) for p in params]
            keys = [id(p) for p in params]
            tail = reducer.bucket(
                b.index, x, keys, numels, names, step=self.step, chunk=self._chunk(), defer=defer
            )
        except RuntimeError as exc:
            raise RuntimeError(f"aps_hook, bucket {b.index}: {exc}") from exc
        return functools.partial(self._finish_bucket, b, x, tail)

    def _float_input(self, b: _Bucket) -> torch.Tensor:
        """The float32 copy of a bucket whose gradients are not float32, in the workspace.

        The same storage every step (a fresh ``.float()`` is a new tensor each
        step, and the bucket would be bound again every step, ~3 ms of host at
        200 layers): the bucket's settled path binds to it once, and again only
        when DDP's buffer for the bucket changes.
        """
        assert self.reducer is not None
        if self._float_view(b.index, b.buffer) is None:
            # A new buffer of DDP's (its re-bucketing) may hold other layers, and the copy
            # would not tell: bound again, as a float32 bucket's new buffer is.
            self.reducer.steady.pop(b.index, None)
        slot, workspace = Slot.input_of(b.index), self.reducer.workspace(b.buffer.device)
        arena = workspace.arena(slot)
        x = arena.take(b.buffer.numel(), torch.float32)
        if not arena.close():  # the region grew: the view from its new storage
            x = workspace.arena(slot).take(b.buffer.numel(), torch.float32)
        self._inputs[b.index] = b.buffer, x, workspace.epoch(slot)
        return x.copy_(b.buffer.view(-1))

    def _float_view(self, index: int, buffer: torch.Tensor) -> torch.Tensor | None:
        """The float32 copy :meth:`_float_input` last made of ``buffer`` (not copied again),
        or None where the bucket's buffer is another or the copy's region has grown since
        (another bucket's larger copy: the old storage is not kept)."""
        held = self._inputs.get(index)
        if held is None or not _same_buffer(held[0], buffer):
            return None
        assert self.reducer is not None
        epoch = self.reducer.workspace(buffer.device).epoch(Slot.input_of(index))
        return held[1] if held[2] == epoch else None

    def _steady_for(self, index: int, buffer: torch.Tensor) -> Settled | None:
        """The bucket's settled path (:meth:`Reducer.steady_for`), bound to the float32
        copy where DDP's buffer is of another dtype; None where it has none."""
        assert self.reducer is not None
        x = buffer if buffer.dtype == torch.float32 else self._float_view(index, buffer)
        return None if x is None else self.reducer.steady_for(index, x)

    def _finish_bucket(
        self, b: _Bucket, x: torch.Tensor, tail: Callable[[], None] | None
    ) -> torch.Tensor:
        if tail is not None:
            try:
                tail()
            except RuntimeError as exc:
                raise RuntimeError(f"aps_hook, bucket {b.index}: {exc}") from exc
        if x is not b.buffer:
            b.buffer.copy_(x)
        if b.is_last:
            self._forget_after(b.index)
            self._end_step()
        return b.buffer

    def _forget_after(self, last: int) -> None:
        """Forget the buckets past ``last``, the step's last: DDP re-bucketed into fewer,
        and their old buffers would stay alive here and in their bound paths and graphs."""
        assert self.reducer is not None
        if last == self._last_bucket:  # the same buckets as last step: nothing to forget
            return
        self._last_bucket = last
        for index in [i for i in self._inputs if i > last]:
            del self._inputs[index]
        if self.graphs is not None:
            for index in [i for i in self.graphs.graphs if i > last]:
                self.graphs.drop(index)
        self.reducer.forget_after(last)

    # -- exit ------------------------------------------------------------------------

    def exit_workers(self) -> list[FifoWorker]:
        """The threads that issue the state's collectives (:mod:`aps_comm.teardown` stops them)."""
        return [self._worker] if self._worker is not None else []

    def exit_groups(self) -> list[dist.ProcessGroup]:
        """Hand over the state's own process groups and forget them: the state is done.

        :mod:`aps_comm.teardown` destroys them at exit, once the workers have
        stopped, so that their Gloo threads are joined before Python shuts down.
        """
        groups = [self.process_group]
        for nodes in (self.nodes, self.grid):
            if nodes is not None:
                groups += [nodes.intra, nodes.inter]
        self.process_group, self.layouts, self.reducer, self._deferred = None, None, None, None
        self.graphs = None  # their NCCL work refers to the groups
        return [g for g in groups if g is not None]

    # -- checkpoints ---------------------------------------------------------------

    def state_dict(self) -> dict:
        """Residuals, policy decisions and the step counter, for checkpoints.

        Keys are parameter names, so the model must be bound (:func:`register`).
        A resumed run continues bit for bit when DDP's bucket layout matches
        the uninterrupted run's (two_phase shard owners follow the buckets, and
        DDP re-buckets once after its first iteration unless
        ``find_unused_parameters=True``); otherwise another rank carries the
        owners' share of the residuals: still compensated, not bitwise equal.
        """
        rates = dict(self._rates)
        if self.reducer is not None and self.reducer.rates:
            names = list(self.reducer.rates)
            values = torch.stack([self.reducer.rates[n] for n in names]).tolist()
            rates = dict(zip(names, values, strict=True))
        residuals = self.feedback.residuals if self.feedback is not None else {}
        return {
            "step": self.step,
            "promote": dict(self.assignment.promote),
            "rates": rates,
            "residuals": {k: v.clone() for k, v in residuals.items()},
            "config": self.describe(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (same configuration and world).

        Residuals are moved to the device of the model's gradients when the
        state knows it (bound to a model), else kept where they were saved.
        """
        if state.get("config") != self.describe():
            raise ValueError(
                f"checkpoint was saved with {state.get('config')!r}, this state is "
                f"{self.describe()!r}"
            )
        self.step = int(state["step"])
        self.assignment.promote = {k: tuple(v) for k, v in state["promote"].items()}  # type: ignore[misc]
        # Settled buckets were bound to the old step's and levels' formats: bind them again.
        self.assignment.revision += 1
        self._rates = dict(state["rates"])
        if self.reducer is not None:
            self.reducer.step = self.step
            device = next(iter(self.reducer.plans.values())).device if self.reducer.plans else None
            zero = torch.zeros((), device=device)
            self.reducer.rates = {k: zero + v for k, v in self._rates.items()}
        if self.feedback is not None:
            device = self._device()
            self.feedback.residuals = {
                k: v.clone() if device is None else v.to(device, copy=True)
                for k, v in state["residuals"].items()
            }

    def _device(self) -> torch.device | None:
        """The device of the model's parameters, when the state was bound to a model."""
        for info, _ in self.assignment.layers.values():
            if info.param is not None:
                return info.param.device
        return None


def _profile_text(profile: Profile | None) -> str:
    """The profile as the ranks compare it: its backend, world size and a digest of its file."""
    if profile is None:
        return "none (the backend's defaults)"
    text = json.dumps(profile.to_dict(), sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{profile.backend}, {profile.world_size} ranks, sha256 {digest}"


def _check_bucket(buffer: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    if buffer.layout != torch.strided or any(
        p.grad is not None and p.grad.layout != torch.strided for p in params
    ):
        raise ValueError(
            "aps_hook does not support sparse gradients (layout "
            f"{buffer.layout}); keep sparse parameters (e.g. nn.Embedding(sparse=True)) "
            "out of DDP or use dense gradients"
        )
    if not buffer.is_floating_point():
        raise ValueError(f"aps_hook needs floating-point gradients, got {buffer.dtype}")


def aps_hook(state: APSState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average gradients in a low-precision wire format.

    Returns at once: the bucket's work runs on the state's worker (Gloo) or
    on a side stream (NCCL), never on DDP's thread.

    Args:
        state: an :class:`APSState`.
        bucket: the DDP gradient bucket.

    Returns:
        A future holding the bucket's averaged gradients (the bucket buffer,
        updated in place).

    Raises:
        TypeError: DDP did not hand a ``GradBucket`` (compiled autograd's
            ``optimize_ddp="python_reducer"`` calls hooks per parameter).

    Example:
        >>> ddp.register_comm_hook(APSState(fmt="e4m3"), aps_hook)  # doctest: +SKIP
    """
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(
            f"aps_hook needs a DDP GradBucket, got {type(bucket).__name__}: compiled "
            "autograd with torch._dynamo.config.optimize_ddp='python_reducer' calls comm "
            "hooks per parameter, which aps_comm does not support. torch.compile(ddp) with "
            "the default optimize_ddp ('ddp_optimizer') works, bit for bit."
        )
    buffer = bucket.buffer()
    index = bucket.index()
    if state.reducer is None:
        state.bind(buffer.device)
    reducer = state.reducer
    assert reducer is not None
    # A settled bucket was checked when it was bound: no per-parameter work per step.
    steady = state._steady_for(index, buffer)
    params = [] if steady is not None else bucket.parameters()
    if params:
        _check_bucket(buffer, params)
    if state.plain_fp32:
        # Exactly default_hooks.allreduce_hook, on the state's group.
        fut = transports.fp32_mean_async(
            buffer, reducer.comm.group, reducer.comm.world_size, reducer.traffic
        )
        if bucket.is_last():
            state._end_step()
        return fut
    nccl = buffer.device.type == "cuda" and reducer.comm.backend == "nccl"
    fp32 = buffer.dtype == torch.float32  # else summed in its float32 copy, as eagerly
    if nccl and fp32 and isinstance(steady, Steady) and steady.fp32_mean:
        # A settled FP32-route bucket ("auto" on fast links): the same call, on DDP's
        # thread. Not with Gloo's worker: a call from here could overtake its
        # collectives, and on the CPU's cores it overlaps the division and the
        # all-reduce with backward (measured faster there than on DDP's thread).
        fut = state._fp32_on_nccl(buffer)
        if bucket.is_last():
            state._forget_after(index)
            state._end_step()
        return fut
    if params:
        caveats.warn_rounded_dtype(buffer.dtype)  # the plain FP32 all-reduce above keeps it
    fut = state._submit(
        _Bucket(
            index, buffer, list(params), bucket.is_last(), None if params else bucket.parameters
        ),
        steady,
    )
    if nccl:
        return fut  # the side stream's, complete: a failure was raised in this call
    # The worker's: DDP would report its failure as "Unable to cast ... to Tensor".
    return raised_by_backward(fut, buffer)


def _same_buffer(held: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is ``held`` itself (its storage, start and size), not merely a
    buffer at the same address: ``held`` keeps its storage alive, so none other has it.

    Example:
        >>> a = torch.zeros(4)
        >>> _same_buffer(a, a.view(2, 2)), _same_buffer(a, torch.from_numpy(a.numpy()))
        (True, False)
    """
    return (
        buffer.untyped_storage() is held.untyped_storage()
        and buffer.data_ptr() == held.data_ptr()
        and buffer.numel() == held.numel()
    )


def _run_now(run: Callable[..., Callable[[], torch.Tensor]], bucket: _Bucket) -> torch.Tensor:
    return run(bucket)()


def _call_stored(store: dict, key: str) -> torch.Tensor:
    return store[key]()


def _forward(source: torch.futures.Future, target: torch.futures.Future) -> None:
    """Complete ``target`` with ``source``'s result or exception once it has one."""

    def done(f: torch.futures.Future) -> None:
        try:
            target.set_result(f.value())
        except BaseException as exc:  # the training loop must see every failure
            target.set_exception(exc)

    source.add_done_callback(done)


def _on_worker_stream(
    job: functools.partial, ready: torch.cuda.Event, stream: torch.cuda.Stream
) -> torch.Tensor:
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        out = job()
    stream.synchronize()
    return out


class StateOptions(TypedDict, total=False):
    """:class:`APSState`'s arguments besides ``fmt``, as :func:`register` takes them by keyword.

    Example:
        >>> options: StateOptions = {"reduction": "two_phase", "stats": True}
        >>> APSState("e4m3", **options).config.reduction
        <Reduction.TWO_PHASE: 'two_phase'>
    """

    reduction: Reduction | str
    scaling: Scaling | str
    process_group: dist.ProcessGroup | None
    stats: bool
    policy: Sequence[Rule] | None
    error_feedback: bool
    ranks_per_node: int | None
    profile: Profile | str | os.PathLike | None
    block_size: int | None
    block_exponents: BlockExponents | str
    cuda_graphs: bool


def register(
    ddp: DistributedDataParallel,
    fmt: FloatFormat | str = "e4m3",
    **options: Unpack[StateOptions],
) -> APSState:
    """Build an :class:`APSState`, register :func:`aps_hook` on ``ddp``, return the state.

    ``options`` are :class:`APSState`'s other arguments, by keyword
    (:class:`StateOptions`). Parameter names from ``ddp.module`` label the
    per-layer stats and drive the policy. When ``torch.distributed`` is initialised, the state's own
    process group is created here, where every rank is known to be alive,
    with the default group's timeout (see :meth:`APSState.bind_process_group`),
    and the state binds to the model's device: a configuration the backend
    cannot run (FP8 ``reduction="allreduce"`` on Gloo) is an error here, on
    every rank, not at the first backward.

    Collective: every rank of the group must call it, in the same order as
    its other ``register`` calls. A rank that has not reached it within
    :data:`aps_comm.agreement.ARRIVAL_TIMEOUT_S` (60 s, or the group's
    timeout if shorter) makes the others raise, naming it. A ``register``
    that raises leaves nothing behind: the groups it made are destroyed
    (:class:`aps_comm.teardown.released_if_raises`).

    Raises:
        TypeError: ``ddp`` is not a ``DistributedDataParallel``.
        ValueError: the configuration cannot run here or differs across ranks.
        RuntimeError: a rank did not call ``register`` in time.

    Example:
        >>> state = register(ddp, fmt="e5m2", stats=True)  # doctest: +SKIP
    """
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"register needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(ddp).__name__}: wrap it first, ddp = DistributedDataParallel(model), "
            "or use aps_comm.fsdp.register for FSDP2 (fully_shard) models"
        )
    process_group = options.get("process_group")
    if process_group is None and ddp.process_group is not _world():
        raise ValueError(
            "this DDP model uses a process group other than the default one; pass "
            "process_group= (a group over the same ranks, separate from DDP's) so the "
            "hook's collectives stay among those ranks"
        )
    state = APSState(fmt, **options)
    state.bind_model(ddp.module)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        agreement.wait_for_ranks("aps_comm.register", process_group)
    with teardown.released_if_raises(state):
        if distributed:
            device = next((p.device for p in ddp.module.parameters() if p.requires_grad), None)
            if device is None:
                state.bind_process_group()
            else:
                state.bind(device)
        ddp.register_comm_hook(state, aps_hook)
    teardown.release_at_exit(state)
    return state


def _world() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_initialized() else None
