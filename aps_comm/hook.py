"""The APS communication hook for DistributedDataParallel: DDP glue and state.

Per bucket: every rank finds each layer's largest |gradient| in one fused
pass, one MAX all-reduce of those L floats agrees on them, each layer is
multiplied by a power of two chosen so nothing can overflow
(:mod:`aps_comm.scaling`), and the bucket is encoded, reduced and decoded in
place in pipelined chunks (:mod:`aps_comm.transports` over
:mod:`aps_comm.codec`), following the bucket's cached :mod:`aps_comm.plan`.

The hook returns at once (:mod:`aps_comm.executor`): on Gloo one FIFO worker
per state runs the buckets in DDP's order, so every rank issues the same
collectives in the same order; on NCCL the work is enqueued on a side stream
and the future is CUDA-aware. Collectives run on the state's own process
group, never DDP's.

Example:
    >>> from aps_comm import APSState, aps_hook, register
    >>> state = APSState(fmt="e4m3")            # may precede init_process_group
    >>> ddp.register_comm_hook(state, aps_hook)  # doctest: +SKIP
    >>> state = register(ddp, fmt="e5m2")        # the same, in one call
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations
# and requires the real dist.GradBucket / torch.futures.Future objects.

import dataclasses
import datetime
import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from aps_comm import codec, teardown, transports
from aps_comm.executor import FifoWorker, run_on_side_stream
from aps_comm.formats import FP32, FloatFormat, get_format
from aps_comm.plan import BucketPlan, GroupPlan, Planner
from aps_comm.policy import LayerInfo, Promote, Rule, Schedule, static_formats
from aps_comm.policy import describe as describe_policy
from aps_comm.reduction import REDUCTIONS, Reduction, native_sum_supported, pick_reduction
from aps_comm.scaling import SCALINGS, Scaling, exponents, pow2
from aps_comm.telemetry import LayerStats, layer_stats
from aps_comm.topology import (
    NodeGroups,
    Topology,
    check_topology,
    env_ranks_per_node,
    grid_rows,
    node_groups,
)
from aps_perfmodel.profile import Profile
from aps_perfmodel.strategies import hook_cluster

__all__ = ["APSConfig", "APSState", "aps_hook", "register"]

_BACKENDS = ("gloo", "nccl", "mpi")
# Error feedback keeps a group in one chunk: its owner step needs the whole shard.
_ONE_CHUNK = 2**62


@dataclasses.dataclass(frozen=True)
class APSConfig:
    """What every rank must agree on.

    Attributes:
        fmt: the wire format.
        reduction: "auto", "allreduce" or "two_phase" as requested.
        scaling: "layer", "bucket" or "none".
    """

    fmt: FloatFormat
    reduction: Reduction = "auto"
    scaling: Scaling = "layer"

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", get_format(self.fmt))
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {self.scaling!r}")

    def describe(self) -> str:
        return f"fmt={self.fmt.describe()}, reduction={self.reduction}, scaling={self.scaling}"


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """What the hook hands the engine: the bucket as DDP gave it."""

    index: int
    buffer: torch.Tensor
    params: list[torch.Tensor]
    is_last: bool


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
            (one per bucket and format) or "none" (plain saturating cast).
        process_group: group to communicate on; default: a new group over all ranks.
        stats: record per-layer :class:`~aps_comm.telemetry.LayerStats` of the
            last step in ``state.stats``.
        policy: rules of :mod:`aps_comm.policy` choosing a format per layer
            (needs the model: use :func:`register` or :meth:`bind_model`).
        error_feedback: keep what rounding lost (this rank's encoding, and
            for two_phase its re-encoding as shard owner) and add it back next
            step. Memory: one float32 copy of the gradients per rank. The
            rounding of native low-precision sums inside the backend is not
            compensated. Not with ``reduction="hierarchical"``.
        ranks_per_node: ranks on each node, for hierarchical reductions; None
            reads ``LOCAL_WORLD_SIZE`` (set by torchrun, aps-launch and the
            SLURM and MPI launchers), else 1. Ranks must be numbered node by
            node; every rank checks what the others see when it binds.
        profile: a calibrated :class:`aps_perfmodel.profile.Profile` (or the
            path of its JSON, from ``aps-perfmodel calibrate``): the links and
            codec the hook plans chunks and strategies with; default: the
            backend's defaults (:func:`aps_perfmodel.strategies.hook_cluster`).

    Attributes:
        stats: the last step's per-layer records (with ``stats=True``).
        bytes_sent: payload bytes this rank handed to collectives in the last
            step: the maxima plus the encoded buckets (see ``bytes_detail``).
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
        reduction: Reduction = "auto",
        scaling: Scaling = "layer",
        process_group: dist.ProcessGroup | None = None,
        stats: bool = False,
        policy: Sequence[Rule] | None = None,
        error_feedback: bool = False,
        ranks_per_node: int | None = None,
        profile: Profile | str | os.PathLike | None = None,
    ) -> None:
        self.config = APSConfig(get_format(fmt), reduction, scaling)
        self.profile = Profile.load(profile) if isinstance(profile, (str, os.PathLike)) else profile
        if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool)
            or not isinstance(ranks_per_node, int)
            or ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if error_feedback and reduction in ("hierarchical", "grid"):
            raise ValueError(
                f"error_feedback is not supported with reduction={reduction!r} (partial "
                "sums are rounded for several ranks at once); use reduction='two_phase'"
            )
        self.ranks_per_node = ranks_per_node
        self.nodes: NodeGroups | None = None
        self.grid: NodeGroups | None = None
        self.topology: Topology | None = None
        self.bucket_reductions: dict[int, str] = {}
        self.bucket_chunks: dict[int, int] = {}
        self._planner: Planner | None = None
        # Per reduction that needs one, its (ranks per node or rows, this rank).
        self._node_layouts: dict[str, tuple[int, int]] = {}
        self.process_group = process_group
        self.collect_stats = bool(stats)
        self.policy: list[Rule] = list(policy or [])
        for rule in self.policy:
            if not isinstance(rule, Rule):
                raise TypeError(f"policy entries must be aps_comm.policy rules, got {rule!r}")
        self.error_feedback = bool(error_feedback)
        self.stats: list[LayerStats] = []
        self.bytes_sent = 0
        self.bytes_detail: dict[str, int] = {}
        self.step = 0
        self.param_names: dict[int, str] = {}
        self._layers: dict[int, tuple[LayerInfo, FloatFormat]] = {}
        self._bound = False
        self._world_size = 0
        self._backend = ""
        self._reductions: dict[FloatFormat, str] = {}
        self._plans: dict[tuple, BucketPlan] = {}
        self._worker: FifoWorker | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # The last bucket's finishing job and DDP's future for it, until the
        # next bucket has started.
        self._deferred: tuple[Callable[[], torch.Tensor], torch.futures.Future] | None = None
        self._step_stats: list[LayerStats] = []
        self._step_bytes: dict[str, int] = {}
        # Per parameter name: Promote's (level, calm steps) and last local underflow rate.
        self._promote: dict[str, tuple[int, int]] = {}
        self._rates: dict[str, float] = {}
        # Error feedback: what rounding lost, per parameter name (unscaled).
        self._residuals: dict[str, torch.Tensor] = {}
        self.chunk_elements: int | None = None
        self.chunk_bytes: int | None = None
        self._schedule = [r for r in self.policy if isinstance(r, Schedule)]
        self._promoter = next((r for r in self.policy if isinstance(r, Promote)), None)

    @property
    def fmt(self) -> FloatFormat:
        return self.config.fmt

    @property
    def reduction(self) -> str:
        """The reduction used: as requested until bound, then resolved; after a step
        with "auto", what the buckets chose (joined by "+" where they differ)."""
        chosen = sorted(set(self.bucket_reductions.values()))
        if chosen:
            return "+".join(chosen)
        return self._reductions.get(self.fmt) or self.config.reduction

    @property
    def world_size(self) -> int:
        return self._world_size

    def bind_model(self, module: torch.nn.Module) -> None:
        """Learn parameter names and apply the static policy rules.

        :func:`register` calls it; call it yourself when registering the hook
        with ``ddp.register_comm_hook`` and using a policy or ``state_dict``.
        """
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_names = {id(p): n for n, p in named}
        infos = [
            LayerInfo(i, n, p.numel(), n.rpartition(".")[0], p) for i, (n, p) in enumerate(named)
        ]
        formats = static_formats([r for r in self.policy], infos, self.fmt)
        self._layers = {
            id(p): (info, f) for (_, p), info, f in zip(named, infos, formats, strict=True)
        }
        if self._promoter is not None:
            ladder = list(self._promoter.ladder)
            for info, f in zip(infos, formats, strict=True):
                if f in ladder:
                    self._promote.setdefault(info.name, (ladder.index(f), 0))

    def describe(self) -> str:
        """Everything every rank must agree on, as text."""
        return (
            f"{self.config.describe()}, policy={describe_policy(self.policy)}, "
            f"error_feedback={self.error_feedback}"
        )

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
            self.process_group = transports.new_group(timeout)
        world_size = self.process_group.size()
        # Agree on the configuration before anything can raise on one rank only:
        # a rank that raised alone would leave the others blocked in a collective.
        mine = (self.describe(), self._seen_topology())
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        if any(c[0] != mine[0] for c in everyone):
            listing = "; ".join(f"rank {r}: {c[0]}" for r, c in enumerate(everyone))
            raise ValueError(f"APSState configuration differs across ranks: {listing}")
        self._bind_nodes([c[1] for c in everyone], world_size, timeout)
        self._world_size = world_size

    def _seen_topology(self) -> tuple[int, int | None]:
        """(ranks per node, LOCAL_RANK) as this rank sees them; errors wait for the others."""
        try:
            per = self.ranks_per_node or env_ranks_per_node() or 1
        except ValueError:
            per = 0  # reported by check_topology on every rank
        local = os.environ.get("LOCAL_RANK")
        explicit = self.ranks_per_node is not None
        return per, int(local) if local and local.isdigit() and not explicit else None

    def _bind_nodes(
        self,
        seen: list[tuple[int, int | None]],
        world_size: int,
        timeout: datetime.timedelta | None,
    ) -> None:
        """Check the topology on every rank and create the groups hierarchical reductions use."""
        wanted = self.config.reduction == "hierarchical"
        group = self.process_group
        assert group is not None
        timeout = timeout or transports.group_timeout(group)
        rows = grid_rows(world_size)
        if self.config.reduction == "grid" and rows < 2:
            raise ValueError(
                f"reduction='grid' lays the ranks on a g x N/g grid with 2 <= g <= sqrt(N); "
                f"the world size {world_size} has no such divisor"
            )
        grid_wanted = self.config.reduction == "grid" or (
            self.config.reduction == "auto" and rows >= 2 and not self.error_feedback
        )
        if grid_wanted:
            self.grid = node_groups(Topology(world_size, rows), group, timeout)
        try:
            topology = check_topology(seen, world_size)
        except ValueError as exc:
            if wanted or self.ranks_per_node is not None:
                raise
            warnings.warn(
                f"aps_comm: no hierarchical reduction: {exc}", RuntimeWarning, stacklevel=3
            )
            self.topology = Topology(world_size, 1)
            return
        self.topology = topology
        if wanted or (self.config.reduction == "auto" and 1 < topology.ranks_per_node < world_size):
            if self.grid is not None and self.grid.topology == topology:
                self.nodes = self.grid  # the same groups
            else:
                self.nodes = node_groups(topology, group, timeout)

    def _bind(self, buffer: torch.Tensor) -> None:
        self.bind_process_group()
        backend = str(dist.get_backend(self.process_group)).lower()
        if backend not in _BACKENDS:
            raise ValueError(
                f"aps_hook does not support the {backend!r} backend; supported: {_BACKENDS}"
            )
        if backend == "nccl" and buffer.device.type != "cuda":
            raise ValueError(f"the nccl backend needs CUDA gradients, got {buffer.device}")
        self._backend = backend
        if (self.policy or self.error_feedback) and not self._layers:
            raise ValueError(
                "policies and error feedback need the model's parameter names: use "
                "aps_comm.register(ddp, ...) or call state.bind_model(ddp.module) first"
            )
        for fmt in self._possible_formats():
            self._reductions[fmt] = self._resolve(fmt, buffer.device)
        topology = self.topology or Topology(self._world_size, 1)
        cluster = hook_cluster(
            backend, buffer.device.type, self._world_size, topology.ranks_per_node, self.profile
        )
        self._planner = Planner(
            cluster,
            hierarchical=self.nodes is not None
            and topology.nodes > 1
            and topology.ranks_per_node > 1
            and not self.error_feedback,
            fp32=backend == "nccl" or self.profile is not None,
            grid=self.grid is not None,
        )
        rank = dist.get_rank(self.process_group)
        for name, groups in (("hierarchical", self.nodes), ("grid", self.grid)):
            if groups is not None:
                self._node_layouts[name] = (groups.topology.ranks_per_node, rank)
        self._bound = True

    def _possible_formats(self) -> set[FloatFormat]:
        formats = {self.fmt} | {f for _, f in self._layers.values()}
        formats |= {get_format(r.fmt) for r in self._schedule}
        if self._promoter is not None:
            formats |= set(self._promoter.ladder)  # type: ignore[arg-type]
        return formats

    def _resolve(self, fmt: FloatFormat, device: torch.device) -> str:
        if fmt == FP32:
            return "allreduce"
        return pick_reduction(self.config.reduction, fmt, self._backend, device)

    def _plan(self, index: int, numels: list[int], device: torch.device) -> BucketPlan:
        key = (index, tuple(numels), str(device))
        plan = self._plans.get(key)
        if plan is None:
            # DDP re-buckets once: drop the old layout's plan (and its scratch).
            self._plans = {k: v for k, v in self._plans.items() if k[0] != index}
            plan = self._plans[key] = BucketPlan.build(index, numels, device)
        return plan

    def _count(self, collective: str, nbytes: int) -> None:
        self._step_bytes[collective] = self._step_bytes.get(collective, 0) + nbytes

    def _end_step(self) -> None:
        self.bytes_detail = self._step_bytes
        self.bytes_sent = sum(
            v for k, v in self._step_bytes.items() if not k.endswith("all_gather")
        )
        self.stats = self._step_stats
        self._step_bytes = {}
        self._step_stats = []
        self.step += 1

    def _submit(self, bucket: _Bucket) -> torch.futures.Future:
        """Run the bucket off DDP's thread; the future completes with the averaged buffer."""
        device = bucket.buffer.device
        if device.type == "cuda" and self._backend == "nccl":
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            job = functools.partial(_run_now, self._run_bucket, bucket)
            return run_on_side_stream(job, stream)
        if self._worker is None:
            self._worker = FifoWorker(f"aps-comm-{id(self):x}")
        if device.type == "cuda":
            # Gloo with CUDA tensors: the worker waits for the gradients'
            # producer, and its own stream is drained before the future completes.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            job = functools.partial(_run_now, self._run_bucket, bucket)
            return self._worker.submit(functools.partial(_on_worker_stream, job, ready, device))
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

    def _run_bucket(self, b: _Bucket, defer: bool = False) -> Callable[[], torch.Tensor]:
        try:
            return self._reduce_bucket(b, defer)
        except RuntimeError as exc:
            raise RuntimeError(f"aps_hook, bucket {b.index}: {exc}") from exc

    def _reduce_bucket(self, b: _Bucket, defer: bool) -> Callable[[], torch.Tensor]:
        """One bucket's reduction: maxima, exponents, every format group.

        Returns the function that finishes it (waits for what is still on the
        wire, decodes, completes the step): with ``defer`` the last chunks of a
        bucket of one format are left in flight for it, else it has nothing
        left to wait for.
        """
        buffer, params = b.buffer, b.params
        numels = [p.numel() for p in params]
        names = [self.param_names.get(id(p)) for p in params]
        plan = self._plan(b.index, numels, buffer.device)
        x = buffer if buffer.dtype == torch.float32 else buffer.float()
        if self.error_feedback:
            self._add_residuals(x, numels, names)
        fmts = None
        if self._promoter is None and not self.error_feedback:
            # Formats known before the maxima: a bucket that goes entirely in
            # FP32 (auto's choice, or a schedule) needs neither maxima nor scales.
            fmts = self._formats(params)
            reductions = self._bucket_choice(plan, fmts)
            if all(f == FP32 or reductions[f] == "fp32" for f in fmts):
                transports.fp32_mean(x, self.process_group, self._world_size, self._count)
                if any(f != FP32 for f in fmts):
                    self.bucket_reductions[b.index] = "fp32"
                return functools.partial(self._finish_bucket, b, x, None)

        amax = codec.segment_amax(x, plan.layout)
        n_layers = len(numels)
        planner = self._planner
        assert planner is not None
        # The chunk is sized for the state's format; policies may mix in others.
        main = self._bucket_choice(plan, [self.fmt] * n_layers)[self.fmt]
        extra = []
        if self._promoter is not None:
            extra += [self._rates.get(n or "", 0.0) for n in names]
        auto_chunk = (
            self.chunk_elements is None and self.chunk_bytes is None and not self.error_feedback
        )
        measured = auto_chunk and x.device.type == "cpu"
        if measured:
            # Each rank's preferred chunk, from its own timing, rides on the
            # maxima; the largest wins.
            mine = planner.chunk(self.fmt, x.numel(), main, plan.exchange_s or None)
            extra.append(math.log2(mine))
        shared = amax
        if extra:
            shared = torch.cat([amax, torch.tensor(extra, dtype=torch.float32, device=x.device)])
        transports.all_reduce_max(shared, self.process_group, self._count)
        amax = shared[:n_layers]
        if self._promoter is not None:
            # Promote picks formats on the host: one device read per bucket, only
            # with this policy (documented in the README).
            self._promote_step(params, shared[n_layers : 2 * n_layers].tolist())
        if self.error_feedback:
            chunk = _ONE_CHUNK
        elif measured:
            chunk = 2 ** int(shared[-1])  # a CPU tensor: no device round trip
        elif auto_chunk:
            if not plan.model_chunk:  # the same on every rank, and every step
                plan.model_chunk = planner.chunk(self.fmt, x.numel(), main)
            chunk = plan.model_chunk
        elif self.chunk_elements is not None:
            chunk = self.chunk_elements
        else:
            chunk = max(1, int(self.chunk_bytes) * 8 // self.fmt.wire_bits)  # type: ignore[arg-type]
        self.bucket_chunks[b.index] = chunk

        if fmts is None:  # Promote has just updated them
            fmts = self._formats(params)
        reductions = self._bucket_choice(plan, fmts)
        groups = plan.group(fmts, reductions, self._world_size, chunk, self._node_layouts)
        sent = [g for g in groups if g.fmt != FP32]
        if sent:
            self.bucket_reductions[b.index] = max(sent, key=lambda g: g.numel).reduction
        start = time.perf_counter()
        layers = torch.split(x, numels) if len(groups) > 1 else [x]
        tail = None
        for g in groups:
            if g.contiguous:
                tail = self._reduce_group(g, x, amax, names, b.index, defer)
                continue
            # Mixing formats costs a gather copy and one set of collectives per format.
            gx = torch.cat([layers[i] for i in g.index]) if g.index else x.new_empty(0)
            self._reduce_group(g, gx, amax[g.index_tensor], names, b.index)
            for i, t in zip(g.index, torch.split(gx, g.numels), strict=True):
                layers[i].copy_(t)
        if measured and len(groups) == 1:
            plan.timed(time.perf_counter() - start)
        return functools.partial(self._finish_bucket, b, x, tail)

    def _bucket_choice(
        self, plan: BucketPlan, fmts: Sequence[FloatFormat]
    ) -> dict[FloatFormat, str]:
        """Each format's reduction in this bucket: as configured, or the model's choice."""
        if self.config.reduction != "auto":
            return self._reductions
        key = tuple(fmts)
        chosen = plan.reductions.get(key)
        if chosen is None:
            planner = self._planner
            assert planner is not None
            chosen = {}
            for fmt in dict.fromkeys(fmts):
                sizes = [n for n, f in zip(plan.numels, fmts, strict=True) if f == fmt]
                native = native_sum_supported(fmt, self._backend, plan.device)
                chosen[fmt] = (
                    "fp32"
                    if fmt == FP32
                    else planner.reduction(fmt, sum(sizes), len(sizes), native)
                )
            plan.reductions[key] = chosen
        return chosen

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
            self._end_step()
        return b.buffer

    def _reduce_group(
        self,
        g: GroupPlan,
        x: torch.Tensor,
        amax: torch.Tensor,
        names: list[str | None],
        bucket_index: int,
        defer: bool = False,
    ) -> Callable[[], None] | None:
        """Average one format group's values ``x`` in place (the tail deferred if asked)."""
        group, n_ranks, fmt = self.process_group, self._world_size, g.fmt
        gnames = [names[i] for i in g.index]
        if g.reduction == "fp32":
            transports.fp32_mean(x, group, n_ranks, self._count)
            if self.error_feedback:
                for name in gnames:
                    self._residuals.pop(name or "", None)
            return None
        if g.reduction in ("hierarchical", "grid"):
            return self._reduce_across_nodes(g, x, amax, gnames, bucket_index, defer)
        two_phase = g.reduction == "two_phase"
        exps = exponents(
            amax,
            fmt,
            world_size=n_ranks,
            reduction="two_phase" if two_phase else "allreduce",
            scaling=self.config.scaling,
        )
        finite = torch.isfinite(amax)
        scale = pow2(exps)
        # Native sums still need the division by N; two-phase owners divided already.
        unscale = pow2(-exps) if two_phase else pow2(-exps) / n_ranks
        unscale = torch.where(finite, unscale, float("nan"))
        if self.collect_stats or self._promoter is not None:
            records = layer_stats(torch.split(x, g.numels), gnames, bucket_index, fmt, exps, amax)
            if self.collect_stats:
                self._step_stats += records
            if self._promoter is not None:
                for r in records:
                    self._rates[r.name or ""] = r.underflow_rate
        after_encode = owner = None
        if self.error_feedback:
            after_encode = functools.partial(self._keep_residuals, g, x, gnames, exps, finite)
            owner = functools.partial(self._reduce_with_feedback, g, gnames, scale, finite)
        if two_phase:
            return transports.two_phase(
                g, x, scale, unscale, group, n_ranks, self._count, after_encode, owner, defer
            )
        return transports.native(g, x, scale, unscale, group, self._count, after_encode, defer)

    def _reduce_across_nodes(
        self,
        g: GroupPlan,
        x: torch.Tensor,
        amax: torch.Tensor,
        gnames: list[str | None],
        bucket_index: int,
        defer: bool,
    ) -> Callable[[], None] | None:
        """Hierarchical or grid two_phase of one format group: each stage's exponents, the wire."""
        grid = g.reduction == "grid"
        nodes, fmt, scaling = self.grid if grid else self.nodes, g.fmt, self.config.scaling
        assert nodes is not None
        per_node, n_nodes = nodes.topology.ranks_per_node, nodes.topology.nodes
        # The node sums add L gradients: headroom L. The mean sent back needs none.
        inner = exponents(
            amax, fmt, world_size=n_nodes, reduction="two_phase", scaling=scaling, headroom=per_node
        )
        outer = exponents(
            amax, fmt, world_size=self._world_size, reduction="two_phase", scaling=scaling
        )
        unscale = torch.where(torch.isfinite(amax), pow2(-outer), float("nan"))
        # The grid's first level sends each rank's gradient (headroom 1), and its
        # sums of g of them move from that scale to the inner one.
        first = pow2(outer) if grid else None
        scale = pow2(inner - outer) if grid else pow2(inner)
        if self.collect_stats:
            self._step_stats += layer_stats(
                torch.split(x, g.numels), gnames, bucket_index, fmt, inner, amax
            )
        return transports.hierarchical(
            g,
            x,
            scale,
            pow2(outer - inner),
            unscale,
            nodes,
            self._world_size,
            self._count,
            defer,
            first,
        )

    def _add_residuals(self, x: torch.Tensor, numels: list[int], names: list[str | None]) -> None:
        have = [
            (t, self._residuals[n])
            for t, n in zip(torch.split(x, numels), names, strict=True)
            if n in self._residuals
        ]
        if have:
            torch._foreach_add_([t for t, _ in have], [r for _, r in have])

    def _keep_residuals(
        self,
        g: GroupPlan,
        x: torch.Tensor,
        gnames: list[str | None],
        exps: torch.Tensor,
        finite: torch.Tensor,
        chunk: int,
        payload: torch.Tensor,
    ) -> None:
        """Residual = what this rank meant to send minus what its payload says (unscaled)."""
        inverse = torch.where(finite, pow2(-exps), 0.0)
        sent = codec.decode(payload, g.fmt, x.numel(), scale=inverse, layout=g.layout)
        # A non-finite layer keeps no residual: its inverse scale zeroed ``sent``.
        keep = torch.repeat_interleave(finite, g.layout.lengths, output_size=g.numel)
        lost = torch.where(keep & torch.isfinite(sent), x - sent, 0.0)
        for name, part in zip(gnames, torch.split(lost, g.numels), strict=True):
            if name is not None:
                self._residuals[name] = part.clone()

    def _reduce_with_feedback(
        self,
        g: GroupPlan,
        gnames: list[str | None],
        scale: torch.Tensor,
        finite: torch.Tensor,
        chunk: int,
        recv: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The owner's step of two_phase, folding its re-quantization loss into its residuals.

        The loss goes into this rank's per-parameter residuals times N: next step
        it is sent again and averaged, so the mean gets it back. Keeping it per
        parameter, not per shard, makes it independent of DDP's bucketing, which
        changes after the first iteration (and so after a resume).
        """
        n_ranks, fmt = self._world_size, g.fmt
        rank = dist.get_rank(self.process_group)
        per = out.numel() * 8 // fmt.wire_bits
        acc = codec.shard_mean(recv, fmt, n_ranks)
        codec.encode(acc, fmt, out=out)
        lo, hi = rank * per, min((rank + 1) * per, g.numel)
        if hi <= lo:
            return
        part = codec.decode(out, fmt, acc.numel())
        mine = torch.repeat_interleave(
            torch.where(finite, scale, 0.0), g.layout.lengths, output_size=g.numel
        )[lo:hi]
        lost = torch.where(mine > 0, (acc[: hi - lo] - part[: hi - lo]) / mine, 0.0)
        flat = torch.cat([self._residuals[n] for n in gnames])  # type: ignore[index]
        flat[lo:hi] += lost * n_ranks
        for name, piece in zip(gnames, torch.split(flat, g.numels), strict=True):
            self._residuals[name] = piece  # type: ignore[index]

    def _formats(self, params: Sequence[torch.Tensor]) -> list[FloatFormat]:
        """This step's format of every layer of a bucket (Promote already updated)."""
        for rule in self._schedule:
            fmt = rule.override(self.step)
            if fmt is not None:
                return [fmt] * len(params)
        out = []
        ladder = self._promoter.ladder if self._promoter is not None else ()
        for p in params:
            info, fmt = self._layers.get(id(p), (None, self.fmt))
            if info is not None and info.name in self._promote:
                fmt = ladder[self._promote[info.name][0]]  # type: ignore[index]
            out.append(fmt)
        return out

    def _promote_step(self, params: Sequence[torch.Tensor], rates: list[float]) -> None:
        assert self._promoter is not None
        ladder = list(self._promoter.ladder)
        for p, rate in zip(params, rates, strict=True):
            info, static = self._layers[id(p)]
            if info.name in self._promote and static in ladder:
                level, calm = self._promote[info.name]
                self._promote[info.name] = self._promoter.step(
                    level, calm, rate, ladder.index(static)
                )

    def state_dict(self) -> dict:
        """Residuals, policy decisions and the step counter, for checkpoints.

        Keys are parameter names, so the model must be bound (:func:`register`).
        A resumed run continues bit for bit when DDP's bucket layout matches
        the uninterrupted run's (two_phase shard owners follow the buckets, and
        DDP re-buckets once after its first iteration unless
        ``find_unused_parameters=True``); otherwise another rank carries the
        owners' share of the residuals: still compensated, not bitwise equal.
        """
        return {
            "step": self.step,
            "promote": dict(self._promote),
            "rates": dict(self._rates),
            "residuals": {k: v.clone() for k, v in self._residuals.items()},
            "config": self.describe(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (same configuration and world)."""
        if state.get("config") != self.describe():
            raise ValueError(
                f"checkpoint was saved with {state.get('config')!r}, this state is "
                f"{self.describe()!r}"
            )
        self.step = int(state["step"])
        self._promote = {k: tuple(v) for k, v in state["promote"].items()}  # type: ignore[misc]
        self._rates = dict(state["rates"])
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}


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

    Example:
        >>> ddp.register_comm_hook(APSState(fmt="e4m3"), aps_hook)  # doctest: +SKIP
    """
    buffer = bucket.buffer()
    params = bucket.parameters()
    _check_bucket(buffer, params)
    if not state._bound:
        state._bind(buffer)
    if state.fmt == FP32 and not state.policy and not state.error_feedback:
        # Exactly default_hooks.allreduce_hook, on the state's group.
        buffer.div_(state.world_size)
        state._count("all_reduce", buffer.numel() * buffer.element_size())
        work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
        if bucket.is_last():
            state._end_step()
        return work.get_future().then(lambda fut: fut.value()[0])
    return state._submit(_Bucket(bucket.index(), buffer, list(params), bucket.is_last()))


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
    job: functools.partial, ready: torch.cuda.Event, device: torch.device
) -> torch.Tensor:
    stream = torch.cuda.Stream(device)
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        out = job()
    stream.synchronize()
    return out


def register(
    ddp: DistributedDataParallel,
    fmt: FloatFormat | str = "e4m3",
    *,
    reduction: Reduction = "auto",
    scaling: Scaling = "layer",
    process_group: dist.ProcessGroup | None = None,
    stats: bool = False,
    policy: Sequence[Rule] | None = None,
    error_feedback: bool = False,
    ranks_per_node: int | None = None,
    profile: Profile | str | os.PathLike | None = None,
) -> APSState:
    """Build an :class:`APSState`, register :func:`aps_hook` on ``ddp``, return the state.

    Parameter names from ``ddp.module`` label the per-layer stats and drive
    the policy. When ``torch.distributed`` is initialised, the state's own
    process group is created here, where every rank is known to be alive,
    with the default group's timeout (see :meth:`APSState.bind_process_group`).

    Example:
        >>> state = register(ddp, fmt="e5m2", stats=True)  # doctest: +SKIP
    """
    if process_group is None and ddp.process_group is not _world():
        raise ValueError(
            "this DDP model uses a process group other than the default one; pass "
            "process_group= (a group over the same ranks, separate from DDP's) so the "
            "hook's collectives stay among those ranks"
        )
    state = APSState(
        fmt,
        reduction,
        scaling,
        process_group,
        stats,
        policy,
        error_feedback,
        ranks_per_node,
        profile,
    )
    state.bind_model(ddp.module)
    if dist.is_available() and dist.is_initialized():
        state.bind_process_group()
    ddp.register_comm_hook(state, aps_hook)
    teardown.release_at_exit(state)
    return state


def _world() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_initialized() else None
