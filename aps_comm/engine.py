"""The reduction engine: one reducer for DDP buckets and FSDP2 units.

A bucket's (or unit's) path, in order:

1. **maxima**: every layer's max |g| in one fused pass, one MAX all-reduce
   (with whatever else must be agreed riding on it: Promote's underflow
   rates, each rank's preferred chunk, FSDP's layout check); with block
   scaling, every block's one-byte exponent key instead;
2. **formats**: each layer's wire format this step (:class:`aps_comm.policy.Assignment`);
3. **plan**: the layout's cached :class:`aps_comm.plan.BucketPlan` (groups,
   chunks, scratch), and each format's route (:class:`aps_comm.config.Route`);
4. **scale**: :func:`aps_comm.scaling.factors`, the one exponent rule;
5. **transport**: :mod:`aps_comm.transports` moves the bytes (the only
   module that issues tensor collectives);
6. **finish**: the last chunks decoded, the step's bytes and stats recorded.

FSDP2's reduce-scatter is two_phase without its all-gather: the unit's N
rows are the N shards, and the owner's FP32 sum is the result.

Nothing here reads a device value on the host, except Promote's one read
per bucket (its decisions are made on the host) and the error flag of an
FSDP layout check, read once at the next step's start.

Example:
    >>> reducer = Reducer(settings, comm, planner, assignment)   # doctest: +SKIP
    >>> finish = reducer.bucket(0, x, keys, names, step=0)        # doctest: +SKIP
    >>> finish()                                                  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from aps_comm import codec, cpu_kernels, transports
from aps_comm.agreement import Layouts
from aps_comm.codec import AgreedMaxima
from aps_comm.config import DEFAULT_BLOCK_SIZE, BlockExponents, Reduction, Route, Scaling
from aps_comm.cpu_kernels import record_limits
from aps_comm.feedback import ErrorFeedback
from aps_comm.formats import FP32, FloatFormat, payload_nbytes
from aps_comm.hostcopy import HostValue, to_device
from aps_comm.layout import Blocks, Layout
from aps_comm.plan import BucketPlan, GroupPlan, Planner, RowRuns, Run
from aps_comm.policy import Assignment
from aps_comm.reduction import native_sum_supported, resolve_routes
from aps_comm.scaling import (
    EXPONENT_LIMIT,
    KEY_BAD,
    KEY_ZERO,
    bad_layers,
    block_keys_into,
    blocks_amax,
    exponent_keys,
    factors,
    factors_from_keys,
    key_exponents,
    key_factors,
)
from aps_comm.telemetry import StepStats, layer_counts, per_layer
from aps_comm.topology import NodeGroups
from aps_comm.workspace import Arena, Slot, Workspace

__all__ = [
    "ONE_CHUNK",
    "AgreedRates",
    "Comm",
    "Reducer",
    "Settings",
    "Settled",
    "Steady",
    "SteadyAgreedBlocks",
    "SteadyBlocks",
    "SteadyFP32Unit",
    "SteadyFeedback",
    "SteadyGroups",
    "SteadyMixedUnit",
    "SteadyStaged",
    "Traffic",
]

ONE_CHUNK = 2**62
"""A chunk larger than any bucket: error feedback's owner step needs the whole shard."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the reducer does, as the ranks agreed it.

    Attributes:
        fmt: the state's wire format.
        reduction: as requested.
        scaling: exponent granularity.
        stats: keep per-layer records of each step.
        error_feedback: keep and resend what rounding lost.
        block_size: elements per block with block scaling.
        block_exponents: with block scaling, two_phase's exponents.
    """

    fmt: FloatFormat
    reduction: Reduction = Reduction.AUTO
    scaling: Scaling = Scaling.LAYER
    stats: bool = False
    error_feedback: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    block_exponents: BlockExponents = BlockExponents.RANK


@dataclasses.dataclass(frozen=True)
class Comm:
    """Where the reducer's collectives go.

    Attributes:
        group: the state's own process group.
        world_size: N.
        rank: this rank in ``group``.
        backend: ``group``'s backend for the gradients' device.
        layouts: node layouts for the staged routes.
    """

    group: dist.ProcessGroup
    world_size: int
    rank: int
    backend: str
    layouts: Layouts

    def node_layouts(self) -> dict[str, tuple[int, int]]:
        return self.layouts.node_layouts(self.rank)


class Traffic:
    """Payload bytes handed to each collective in the current step (a ``Counter``)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def __call__(self, collective: str, nbytes: int) -> None:
        self.bytes[collective] = self.bytes.get(collective, 0) + nbytes

    def take(self) -> dict[str, int]:
        out, self.bytes = self.bytes, {}
        return out


@dataclasses.dataclass
class _Bucket:
    """What every settled bucket of one group binds (:class:`Steady`, :class:`SteadyBlocks`,
    :class:`SteadyAgreedBlocks`, :class:`SteadyFeedback`, and each such group of a
    :class:`SteadyGroups`): its buffer, plan and group, and its chunks' bound calls.

    Attributes:
        numel: the bucket's elements (a rebuilt bucket is planned again).
        ptr: the bucket buffer's address (DDP's rebuilt buckets are new buffers).
        plan: the bucket's plan.
        group: the one group plan (the whole bucket).
        calls: each chunk's codec work, bound to the bucket's float32 buffer
            (:class:`aps_comm.transports.ChunkCalls`; the staged routes': their handful).
        bound_ptr: the address of the buffer they are bound to (0 for none).
        offer: (the exchange time it was planned for, log2 of this rank's
            preferred chunk): the model is asked again only when the time moves.
        names: with ``stats=True``, each layer's name for its records; None records nothing.
        epoch: the policy's epoch whose formats it was bound to
            (:meth:`aps_comm.policy.Assignment.epoch`): another one binds it again.
        workspace: the state's workspace epoch its buffers were cut from
            (:meth:`aps_comm.workspace.Workspace.epoch`): another one binds it again.
        groups: hierarchical and grid (:class:`SteadyStaged`, :class:`SteadyNodeBlocks`):
            this rank's intra- and inter-node groups of the route; None: two_phase, a
            native sum or FP32.
        per_node: with ``groups``, the ranks of the first level's sum (a node's, or a grid
            row's).
        factors_call: writes this step's factors, which the bound calls read, from the
            agreed vector (None: the bound calls read the agreed vector itself).
        promote: with Promote, the layers' keys, sizes and names.
        records_call: with ``names``, where bound, writes the layers' records of the bound
            buffer into the float64 rows it takes (the kinds' own; None: made otherwise).
        rates_call: with Promote on Triton, the same rows' bound call its underflow rates
            are read from (None: tensor ops), bound to ``rates_key`` (the values' address,
            the group): a copy of this binding for other values binds its own.
    """

    numel: int
    ptr: int
    plan: BucketPlan
    group: GroupPlan
    _: dataclasses.KW_ONLY
    calls: list[transports.ChunkCalls] | None = None
    bound_ptr: int = 0
    offer: tuple[float | None, int] | None = None
    names: list[str | None] | None = None
    epoch: tuple[int, ...] = ()
    workspace: tuple[int, ...] = ()
    groups: NodeGroups | None = None
    per_node: int = 1
    factors_call: Callable[[], object] | None = None
    promote: tuple[list[Any], list[int], list[str | None]] | None = None
    records_call: Callable[[torch.Tensor], None] | None = None
    rates_call: Callable[[torch.Tensor], None] | None = None
    rates_key: tuple[int, int] | None = None

    def fill_factors(self) -> None:
        """This step's factors from the agreed vector, once per bucket (not per chunk)."""
        if self.factors_call is not None:
            self.factors_call()


@dataclasses.dataclass
class Steady(_Bucket):
    """A bucket's path once its layout and formats are settled: bound once, run every step.

    A bucket whose layers all travel in one format with one exponent per
    layer, by two_phase or a native sum, needs nothing per layer on the host:
    one kernel writes every layer's maximum, one MAX all-reduce agrees on
    them, and the codec's kernels derive each layer's factors from the agreed
    maxima (:class:`aps_comm.codec.AgreedMaxima`). No per-layer list, lookup
    or tensor op is built per step.

    Attributes:
        route: the route (FP32 buckets only average).
        fmts: each layer's format (to plan another chunk size).
        maxima: float32 scratch of the MAX all-reduce: the layers' maxima, then
            this rank's preferred chunk (log2) where chunks are timed (CPU).
        agreed: the agreed maxima as the codec's factors.
        measured: chunks sized by this rank's timing, agreed on the keys.
        chunk: elements per chunk of ``group``.
        maxima_call: the maxima kernel, bound to the bucket's float32 buffer.
        host_factors: the CPU kernels' factor arrays (scale, unscale) and their
            int32 key scratch, refilled in place once per bucket.
        bucket: ``scaling="bucket"``: the agreed maxima are spread
            (:meth:`aps_comm.codec.AgreedMaxima.spread`) before the codec reads them.
        raw: with ``bucket`` and ``names``, the agreed maxima as they were before the
            spread, which the records keep; else None.
        promote: as :class:`_Bucket`'s; ``maxima`` then holds each layer's local
            underflow rate after the maxima.
        held: the buffer it was bound to. Held, as the other routes' bound calls hold
            it, so that no new buffer (DDP's re-bucketing) is allocated at its address
            while it is bound and passes :meth:`Reducer.steady_for`'s address check.
    """

    route: Route
    fmts: list[FloatFormat]
    maxima: torch.Tensor
    agreed: AgreedMaxima
    measured: bool
    chunk: int
    maxima_call: Callable[[], object] | None = None
    host_factors: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    bucket: bool = False
    raw: torch.Tensor | None = None
    held: torch.Tensor | None = None

    def record_names(self, names: Sequence[str | None]) -> None:
        """Record the layers, labelled by ``names`` (``stats=True``); with ``bucket``,
        keep the agreed maxima from the spread for the records."""
        self.names = list(names)
        if self.bucket:
            self.raw = torch.empty_like(self.agreed.maxima)

    def spread(self) -> None:
        """``scaling="bucket"``'s spread of the agreed maxima, a copy kept where recorded."""
        if self.raw is not None:
            self.raw.copy_(self.agreed.maxima)
        self.agreed.spread()

    def bind(self, x: torch.Tensor, world_size: int) -> bool:
        """Bind the maxima kernel and every chunk's codec work to the float32 buffer ``x``
        (True: every configuration of :class:`Steady` binds).

        The CPU kernels take factor arrays: they are bound as ``host_factors``
        (scale, unscale), which :meth:`fill_factors` refills in place
        from the agreed maxima once per bucket (CPU tensors: no device read); the
        other backends' bound calls read the agreed maxima.
        """
        self.held = x  # an FP32 bucket's binding holds nothing else of it
        g = self.group
        # No group: the FP32 mean (run before any address check); with Promote: averaged as
        # they are, maxima bound apart.
        if g is None or self.route == Route.FP32:
            self.bound_ptr = x.data_ptr()
            return True
        native = self.route == Route.ALLREDUCE
        scale: torch.Tensor | AgreedMaxima = self.agreed
        unscale: torch.Tensor | AgreedMaxima = self.agreed
        if g.codec.backend == "kernels":
            n = len(self.fmts)
            scale, unscale = torch.ones(n), torch.ones(n)
            self.host_factors = scale.numpy(), unscale.numpy(), np.empty(n, np.int32)
            self.factors_call = functools.partial(
                self.agreed.host_factors_into, g.fmt, *self.host_factors
            )
        self.maxima_call = g.codec.bind_layer_maxima(x, g.layout, self.agreed.maxima)
        if self.names is not None:  # Triton's records (elsewhere None: record_steady's)
            shown = self.agreed.maxima if self.raw is None else self.raw
            self.records_call = g.codec.bind_layer_records(x, g.layout, self.agreed, shown)
        self.calls = _chunk_calls(g, x, (scale, unscale), world_size, native)
        self.bound_ptr = x.data_ptr()
        return True

    @property
    def fp32_mean(self) -> bool:
        """Whether the bucket is only averaged as it is (the FP32 route, no Promote): one
        all-reduce with nothing agreed before it, ``allreduce_hook``'s arithmetic."""
        return self.route == Route.FP32 and self.promote is None

    @property
    def vector(self) -> torch.Tensor:
        """The MAX all-reduce's vector."""
        return self.maxima

    def write_vector(self, x: torch.Tensor) -> None:
        """This rank's part of :attr:`vector`: the maxima of ``x``, the bound buffer."""
        assert self.maxima_call is not None  # made by bind
        self.maxima_call()

    def fill_factors(self) -> None:
        """This step's factors from the agreed maxima (spread first with ``bucket``)."""
        if self.bucket:
            self.spread()
        super().fill_factors()


@dataclasses.dataclass
class SteadyBlocks(_Bucket):
    """:class:`Steady` for block scaling with every rank's own block exponents (two_phase).

    Nothing is agreed before the first exchange: per step one bound call
    writes this rank's key of every block and non-finite flag of every layer
    (:meth:`aps_comm.codec.Codec.bind_block_keys`), and each chunk is three
    bound calls (:func:`aps_comm.transports.bind_blocks`) around the
    exchange and the all-gather: the same collectives and bytes as
    :meth:`Reducer.bucket`, with no per-layer, per-shard or per-block work
    on the host.

    Attributes:
        fmts, chunk: as :class:`Steady`'s.
        measured: chunks sized by this rank's timing, agreed on the first exchange.
        maxima: float32 scratch: this rank's max |x| of every block.
        keys: uint8: this rank's key of every block.
        flags: uint8: this rank's non-finite flag of every layer.
        union: uint8: every rank's flags OR-ed (the layers made NaN).
        keys_call: the keys' calls, bound to the bucket's float32 buffer.
    """

    fmts: list[FloatFormat]
    measured: bool
    chunk: int
    maxima: torch.Tensor
    keys: torch.Tensor
    flags: torch.Tensor
    union: torch.Tensor
    keys_call: Callable[[], None] | None = None

    def bind(
        self,
        x: torch.Tensor,
        rank: int,
        world_size: int,
        gather: tuple[torch.Tensor, np.ndarray, torch.Tensor, int] | None = None,
    ) -> bool:
        """Bind the keys' and every chunk's calls to the float32 buffer ``x`` (the codec's
        fused calls, else its own: :func:`aps_comm.transports.bind_blocks`, with
        ``groups`` :func:`aps_comm.transports.bind_node_blocks`); False where the keys
        have no bound call. ``gather``: the CPU kernels' gather of a bucket's layers,
        in the keys' call (:attr:`SteadyGroups.divided`)."""
        g, staged = self.group, self.groups is not None
        assert g.blocks is not None
        keys_call = g.codec.bind_block_keys(
            *(x, g.layout, g.blocks.counts, self.maxima, self.keys, self.flags),
            self.per_node if staged else world_size,  # the ranks of two_phase's rule
            device_counts=g.blocks.device_counts,  # the torch ops' (codecs without kernels)
            gather=gather,
        )
        if keys_call is None:
            return False
        if self.names is not None and g.codec.backend != "kernels":  # theirs: the keys' call
            self.records_call = g.codec.bind_block_records(x, g.blocks, self.keys, self.maxima)
        if staged:
            self.calls = transports.bind_node_blocks(g, x, self.keys, self.flags, self.union)
        else:
            self.calls = transports.bind_blocks(g, x, self.keys, self.flags, self.union, rank)
        self.keys_call, self.bound_ptr = keys_call, x.data_ptr()
        return True


@dataclasses.dataclass
class SteadyNodeBlocks(SteadyBlocks):
    """:class:`SteadyBlocks` for hierarchical and grid: every owner at every level sends
    its own block exponents (:class:`aps_comm.plan.NodeBlocks`).

    Per step the same bound call writes this rank's keys and flags, now
    under two_phase's rule for the ``per_node`` ranks its first sum covers,
    and each chunk is a fixed handful of bound calls
    (:func:`aps_comm.transports.bind_node_blocks`) around the route's four
    collectives, with no per-step block maxima, keys or flags as ATen ops (on
    the codecs without fused calls, "cast" and "bits", the codec's own calls
    bound once).
    """


@dataclasses.dataclass
class SteadyStaged(Steady):
    """:class:`Steady` for hierarchical and grid with one exponent per layer (or per bucket).

    Per step, whatever the number of layers: the maxima kernel, the one MAX
    all-reduce of :meth:`Reducer.bucket` (the same contents: the maxima,
    then this rank's preferred chunk where measured), the route's factors
    (scale, shift, unscale, grid's first) written in place from the agreed
    maxima (:meth:`aps_comm.codec.Codec.bind_staged_factors`), and per chunk
    a fixed handful of bound codec calls around the route's four collectives
    (:func:`aps_comm.transports.bind_hierarchical`).

    Attributes:
        factors: float32 (4, layers): scale, shift, unscale and first, refilled in place
            (by ``factors_call``, from the agreed maxima).
        record_keys: with ``names`` or ``promote`` on the CPU kernels, int32 and float32
            scratch of the layers' first exponents and factors (what the records and
            Promote's rates count under: :meth:`first_factors`).
        local: block scaling with agreed exponents: this rank's float32 block maxima;
            ``maxima`` is then the MAX all-reduce's uint8 vector (every block's inner key,
            every block's outer key, the chunk's byte where measured), the maxima call
            writes both and the factors come from the agreed keys, per block
            (:meth:`aps_comm.codec.Codec.bind_staged_blocks`: a kernel call or a Triton
            launch each).
        records_call: with ``local`` and ``names``, the records' bound call
            (:meth:`aps_comm.codec.Codec.bind_block_records`).
        scratch: the state's workspace, whose :attr:`Slot.STEP` slot holds ``local`` and
            the chunks' float32 scratch beyond the plan's
            (:func:`aps_comm.transports.node_spare`: grid's, rarely hierarchical's):
            nothing deferred reads them; None: allocations of their own. The factors'
            rows are the plan's (:attr:`aps_comm.plan.NodePlan.factors`).
    """

    factors: torch.Tensor | None = None
    record_keys: tuple[np.ndarray, np.ndarray] | None = None
    local: torch.Tensor | None = None
    scratch: Workspace | None = None

    def bind(self, x: torch.Tensor, world_size: int, spare: torch.Tensor | None = None) -> bool:
        """Bind the maxima kernel, the factors and every chunk's calls to the float32
        buffer ``x``; False where the codec has no fused calls for agreed block keys.
        ``spare``: the chunks' float32 scratch (else from :attr:`scratch`'s STEP slot)."""
        g, grid = self.group, self.route == Route.GRID
        n = g.layout.n_segments  # the layers, or with ``local`` the blocks
        assert g.node is not None
        n_spare = transports.node_spare(g)
        if spare is None and self.scratch is not None and (n_spare or self.local is not None):
            # Only read while the hook runs: the block maxima, their keys' MAX all-reduce
            # vector (written whole every step), then the chunks' scratch.
            blocks = 0 if self.local is None else n
            sizes = [(blocks, torch.float32), (blocks and self.maxima.numel(), torch.uint8)]
            local, keyed, spare = _step_views(self.scratch, [*sizes, (n_spare, torch.float32)])
            if self.local is not None:
                if local.data_ptr() != self.local.data_ptr():  # a chunk's change mid-step
                    local.copy_(self.local)  # binds again: what this step agreed, moved
                    keyed.copy_(self.maxima)
                self.local, self.agreed = local, dataclasses.replace(self.agreed, maxima=local)
                self.maxima = keyed
        if g.node.factors is not None:  # refilled before every use: the plan's rows
            self.factors = g.node.factors
        elif self.factors is None or self.factors.shape[1] != n or self.factors.device != x.device:
            self.factors = torch.ones(4, n, dtype=torch.float32, device=x.device)
        f = self.factors
        if self.local is not None:
            assert g.blocks is not None
            keys, ranks = self.maxima[: 2 * n], (world_size, self.per_node)
            calls = g.codec.bind_staged_blocks(x, g.blocks, self.local, keys, ranks, grid, f)
            if calls is None:
                return False
            self.maxima_call, self.factors_call = calls
            if self.names is not None:  # each block's counts under its inner key
                self.records_call = g.codec.bind_block_records(x, g.blocks, keys[:n], self.local)
                if self.records_call is None:
                    return False
        else:
            self.maxima_call = g.codec.bind_layer_maxima(x, g.layout, self.agreed.maxima)
            self.factors_call = g.codec.bind_staged_factors(
                self.agreed.maxima, world_size, self.per_node, grid, f, self.agreed.none
            )
            if self.names is not None:  # Triton's (else None: record_steady's)
                shown = self.agreed.maxima if self.raw is None else self.raw
                self.records_call = g.codec.bind_staged_records(x, g.layout, f, shown)
        counted = self.names is not None or self.promote is not None
        if counted and g.codec.backend == "kernels" and x.device.type == "cpu":
            self.record_keys = np.empty(n, np.int32), np.empty(n, np.float32)
        factors = (f[0], f[1], f[2], f[3] if grid else None)
        self.calls = transports.bind_hierarchical(g, x, factors, world_size, spare)
        self.bound_ptr = x.data_ptr()
        return True

    def first_factors(self) -> tuple[np.ndarray, np.ndarray]:
        """The first level's factors ``2**e`` and their int32 exponent keys ``127 - e``,
        into ``record_keys`` from the bound rows: scale times first is ``2**e`` exactly
        (grid's scale is ``2**(e - outer)``; e within +-126: a normal float32), whose
        exponent field is ``e + 127``."""
        assert self.factors is not None and self.record_keys is not None
        (keys, first), f = self.record_keys, self.factors.numpy()
        np.multiply(f[0], f[3], out=first)
        np.right_shift(first.view(np.int32), 23, out=keys)
        np.subtract(254, keys, out=keys)
        return first, keys


def _chunk_calls(
    g: GroupPlan,
    x: torch.Tensor,
    factors: tuple[torch.Tensor | AgreedMaxima, torch.Tensor | AgreedMaxima],
    world_size: int,
    native: bool,
) -> list[transports.ChunkCalls]:
    """Every chunk's codec calls of group ``g`` bound to its float32 values ``x`` under
    ``factors`` (scale, unscale): the native sum's encode and decode, or two_phase's encode
    padded to whole shards, the owner's reduce and the decode."""
    (scale, unscale), calls = factors, []
    for c, ((lo, hi), (r0, r1)) in enumerate(zip(g.chunks, g.regions, strict=True)):
        window, send, values = g.windows[c], g.send[r0:r1], x[lo:hi]
        owner = recv = shard = None
        if native:
            encode = g.codec.bind_encode(values, send, scale, window)
        else:
            pad = (r1 - r0) * 8 // g.fmt.wire_bits - (hi - lo)
            encode = g.codec.bind_encode(values, send, scale, window, pad)
            s0, s1 = g.shard_regions[c]
            recv, shard = g.recv[r0:r1], g.shards[s0:s1]
            owner = g.codec.bind_owner_reduce(recv, world_size, shard)
        decode = g.codec.bind_decode(send, values, unscale, window)
        calls.append(transports.ChunkCalls(encode, owner, decode, send, recv, shard))
    return calls


def _step_views(workspace: Workspace, sizes: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    """Views of ``sizes`` (elements, dtype) one after the other from the start of
    ``workspace``'s STEP slot (grown first where it is too small)."""
    probe = workspace.arena(Slot.STEP)
    for n, dtype in sizes:
        probe.take(n, dtype)
    probe.close()
    arena = workspace.arena(Slot.STEP)
    return [arena.take(n, dtype) for n, dtype in sizes]


@dataclasses.dataclass
class SteadyFeedback(_Bucket):
    """:class:`Steady` with error feedback: two_phase with agreed exponents per layer or block.

    The bucket's residuals live in one flat buffer whose views are the
    feedback's per-name residuals (:meth:`aps_comm.feedback.ErrorFeedback.share`),
    so per step, whatever the number of layers: one add of the residuals,
    the maxima (or block keys) and their MAX all-reduce, the factors written
    in place, and one chunk of bound calls around two_phase's collectives,
    each residual update whole-bucket: the encode followed by what it lost
    (:meth:`aps_comm.codec.Codec.bind_keep_lost`), the owner's step with its
    loss (:meth:`aps_comm.codec.Codec.bind_owner_feedback`), the decode. The
    same collectives, bytes and bits as :meth:`Reducer.bucket`'s error
    feedback, residuals included.

    Attributes:
        residual: float32, the bucket's residuals (the feedback's entries are views).
        token: the feedback's token for them (:meth:`aps_comm.feedback.ErrorFeedback.shared`).
        shared: the MAX all-reduce's vector: float32 layer maxima, or uint8 block keys.
        agree: writes this rank's maxima or keys of the buffer into ``shared``.
        keys: the CPU kernels' int32 exponent keys of the agreed maxima, which
            ``factors_call`` (the agreed factors into the bound calls' scale and unscale)
            leaves there (the records' exponents); else None.
        local: with blocks, this rank's float32 max |x| of every block (``agree``'s).
        scale: the bound calls' float32 scale (Promote's rates are counted under it).
        maxima: with Promote, the MAX all-reduce's vector: ``shared`` (the maxima), then
            every layer's local underflow rate (the reducer's rates are views of them).
        fmts: with Promote, each layer's format it was bound to.
    """

    residual: torch.Tensor
    token: int
    shared: torch.Tensor
    agree: Callable[[], object]
    keys: np.ndarray | None = None
    local: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    maxima: torch.Tensor | None = None
    fmts: list[FloatFormat] = dataclasses.field(default_factory=list)
    measured = False  # its one chunk (the owner's step needs the whole shard): never timed

    @property
    def vector(self) -> torch.Tensor:
        """The MAX all-reduce's vector: the maxima or keys, with Promote its rates after."""
        return self.shared if self.maxima is None else self.maxima

    def write_vector(self, x: torch.Tensor) -> None:
        """The residuals added to ``x``, the bound buffer, then this rank's maxima or keys."""
        x.add_(self.residual)
        self.agree()


@dataclasses.dataclass
class SteadyAgreedBlocks(_Bucket):
    """:class:`Steady` for block scaling with agreed block exponents (two_phase, no error
    feedback: ``block_exponents="agreed"``).

    Per step, whatever the number of layers or blocks: one bound call
    writes this rank's key of every block (:meth:`aps_comm.codec.Codec.bind_block_keys`,
    as error feedback's settled bucket does), the one MAX all-reduce agrees
    on them (this rank's preferred chunk riding on it where measured, as in
    :meth:`Reducer.bucket`), and each chunk is three bound calls
    (:func:`aps_comm.transports.bind_blocks`) around two_phase's
    exchange and all-gather: every shard encoded with the agreed keys, the
    owner's mean re-encoded with its own extra exponent ``d`` per block (the
    first chunk's owner also flags the layers with a non-finite key), the
    decode with ``2**-(e + d)``. The collectives, bytes and bits of
    :func:`aps_comm.transports.bind_blocks` with agreed factors. With ``native`` (the native sum's
    blocks, agreed whatever is asked), the keys under its rule, their factors, and per
    chunk the encode, the sum in the wire format and the decode.

    Attributes:
        fmts, chunk: as :class:`Steady`'s.
        main: the route of the state's format (what chunks are sized for).
        measured: chunks sized by this rank's timing, agreed on the keys.
        maxima: float32 scratch: this rank's max |x| of every block.
        shared: uint8, the MAX all-reduce's vector: every block's key, then where
            measured this rank's preferred chunk (log2).
        union: uint8: per layer, whether an agreed key of it is non-finite (the keys'
            call writes it too, for the first chunk's owner step to set: nothing reads
            this rank's own flags with agreed exponents).
        keys_call: the keys' calls, bound to the bucket's float32 buffer.
        records_call: with ``names``, writes the layers' records of the bound buffer under
            the agreed keys into the float64 rows it takes (:meth:`Codec.bind_block_records`).
        native: the route is the native sum.
        factors: the native sum's (scale, unscale) per block, or on the torch codecs
            two_phase's (scale, exponent, finite): refilled from the agreed keys by
            ``factors_call`` (None with fused kernels).
    """

    fmts: list[FloatFormat]
    main: Route
    measured: bool
    chunk: int
    maxima: torch.Tensor
    shared: torch.Tensor
    union: torch.Tensor
    keys_call: Callable[[], None] | None = None
    native: bool = False
    factors: tuple[torch.Tensor, ...] | None = None

    @property
    def vector(self) -> torch.Tensor:
        """The MAX all-reduce's vector."""
        return self.shared

    def write_vector(self, x: torch.Tensor) -> None:
        """This rank's part of :attr:`vector`: the keys of ``x``, the bound buffer."""
        assert self.keys_call is not None  # made by bind
        self.keys_call()

    def bind(self, x: torch.Tensor, rank: int, world_size: int) -> bool:
        """Bind the keys', the factors', the records' and every chunk's calls to the float32
        buffer ``x``; False where the codec has no calls for them (a Triton variant that
        cannot compile here, the native sum of a copy not float32)."""
        g = self.group
        assert g.blocks is not None
        n, device = g.layout.n_segments, x.device
        keys = self.shared[:n]
        if self.names is not None:  # the agreed keys (the chunk's byte after them)
            self.records_call = g.codec.bind_block_records(x, g.blocks, keys, self.maxima)
            if self.records_call is None:
                return False
        if self.native:
            if x.dtype != torch.float32:
                return False
            # Per block 2**e and 2**-e / N, refilled in place after the MAX all-reduce; per
            # chunk the codec's encode and decode with them, bound.
            scale, unscale = (torch.empty(n, dtype=torch.float32, device=device) for _ in range(2))
            self.factors, agreed = (scale, unscale), (self.maxima, keys)
            self.keys_call, self.factors_call = _native_block_calls(
                g, x, world_size, agreed, self.factors
            )
            self.calls = _chunk_calls(g, x, (scale, unscale), world_size, native=True)
            self.bound_ptr = x.data_ptr()
            return True
        # The union as the keys' flags: on Triton the keys' kernel zeroes it for the
        # first owner step (no zero_ launch); the CPU kernels' owner writes it over.
        keys_call = g.codec.bind_block_keys(
            *(x, g.layout, g.blocks.counts, self.maxima, keys, self.union, world_size, True),
            device_counts=g.blocks.device_counts,  # the torch ops' (codecs without kernels)
        )
        if keys_call is None:
            return False
        if g.codec.backend in ("cast", "bits"):
            # No fused kernels: the codec's torch-op calls, shard by shard, on the
            # agreed keys' factors (refilled in place after the MAX all-reduce).
            made = functools.partial(
                factors_from_keys,
                keys[None],
                g.fmt,
                Route.TWO_PHASE,
                world_size=world_size,
                counts=g.blocks.device_counts,
            )
            dtypes = (torch.float32, torch.int32, torch.bool)
            self.factors = tuple(torch.empty(n, dtype=d, device=device) for d in dtypes)
            fields = ("scale", "exponents", "finite")
            self.factors_call = functools.partial(codec.factors_into, made, self.factors, fields)
            calls = transports.bind_blocks(g, x, keys, self.union, self.union, rank, self.factors)  # type: ignore[arg-type]  # three
        else:
            calls = transports.bind_blocks(g, x, keys, self.union, self.union, rank)
        if calls is None:
            return False
        self.keys_call, self.calls, self.bound_ptr = keys_call, calls, x.data_ptr()
        return True


@dataclasses.dataclass
class SteadyGroups:
    """:class:`Steady` for a bucket whose layers travel in several formats (``KeepLast``,
    per-layer rules, a Schedule epoch that mixes them): every format group bound once
    per policy epoch, run every step.

    Per step: one kernel writes every layer's maximum, the one MAX all-reduce
    agrees on them, then each group in the plan's order runs its own bound
    :class:`Steady` calls (a group sent in FP32: its all-reduce) on a view of
    its values and of its agreed maxima. Where the groups are consecutive in
    the bucket (``KeepLast``'s two) the views are the bucket's own; otherwise
    the bucket's layers are gathered in group order into bound scratch, the
    maxima picked in that order and the layers scattered back: one call each,
    whatever the number of layers or groups.

    With block scaling (every rank's own block exponents), nothing is
    agreed before the exchanges: each group sent scaled runs its own bound
    :class:`SteadyBlocks` calls on its view (its blocks' keys, then
    two_phase's exchange), the FP32 group its all-reduce.

    With agreed block exponents, each group sent scaled is a
    :class:`SteadyAgreedBlocks` on its view, its keys a view of the one vector
    the bucket MAX-all-reduces (``agreed_blocks``).

    With error feedback (groups consecutive in the bucket), each group sent
    scaled is a :class:`SteadyFeedback` on its view, its residuals one flat
    buffer of its own: every group's residuals added, the agreed vector
    written (every layer's maximum, or each group's block keys) and
    MAX-all-reduced once, then each group's factors and its bound chunk
    (two_phase's, or the native sum's), the FP32 group its all-reduce, in the
    plan's order.

    Attributes:
        numel, ptr, plan, fmts, bound_ptr, offer, epoch, workspace: as :class:`Steady`'s.
        groups: the group plans (the plan's, for ``chunk``).
        main: the route of the state's format (what chunks are sized for).
        measured: chunks sized by this rank's timing, agreed on the maxima (CPU).
        chunk: elements per chunk of every group.
        maxima: float32 scratch of the MAX all-reduce: every layer's maximum in
            bucket order, with Promote every layer's local underflow rate in bucket
            order, then this rank's preferred chunk (log2) where measured (empty with
            ``blocks``: nothing is agreed).
        maxima_call: the maxima kernel, bound to the bucket's float32 buffer.
        parts: per group, in the plan's order: its values and its bound path
            (None for a group sent as the FP32 mean; :class:`SteadyBlocks` with ``blocks``).
        rates: with Promote, per group in the plan's order: where its layers' rates go
            (None for the FP32 group, whose rates stay).
        rates_at: on the CPU kernels where the groups interleave, per group: its layers'
            positions in bucket order, where its records' (or rates') call writes their
            rates (its ``rates`` entry: ``maxima``'s bucket-order rates; no ``put_rates``).
        put_rates: the rates copied from group order into ``maxima``'s bucket order, one
            call (None where the groups are consecutive in the bucket, or ``rates_at``).
        gather: the layers copied in group order into bound scratch, one call
            (None where the groups are consecutive in the bucket, but with ``fused``;
            None on the CPU kernels without blocks: ``maxima_call`` gathers them; with
            ``divided``: the first sent group's keys' call does).
        divided: every rank's own block exponents on the CPU kernels, the groups
            interleaved: the first sent group's keys' call gathers the layers
            (:func:`aps_comm.cpu_kernels.block_keys`' ``gather``), the FP32 group's
            divided by N on the way, so its all-reduce is the sum alone
            (``allreduce_hook``'s arithmetic, one op less).
        pick: the agreed maxima copied in the same order, one call (or None).
        factors: on the CPU kernels, where the groups are not consecutive or with
            ``bucket``: per group sent scaled, in the plan's order, its factors' one call,
            which picks its layers' agreed maxima (and with ``bucket`` spreads them) first
            (else None).
        scatter: the scratch copied back into the layers, one call (or None).
        order: the layers' positions in group order, on the bucket's device (made
            once: a bfloat16 bucket's float32 copy is bound again every step).
        bucket: ``scaling="bucket"``: each group spreads its own agreed maxima.
        none: ``scaling="none"``: every group's exponents 0 (:class:`AgreedMaxima`'s rule).
        names: with ``stats=True``, each layer's name in bucket order: every group's
            :class:`Steady` records its own layers (:meth:`Reducer.record_steady`), in the
            plan's order; None records nothing.
        blocks: block scaling with every rank's own block exponents (with ``feedback``:
            agreed ones, ``maxima`` then the groups' uint8 block keys in the plan's order).
        feedback: error feedback: the parts sent scaled are :class:`SteadyFeedback`.
        agreed_blocks: block scaling with agreed block exponents (no error feedback): the
            parts sent scaled are :class:`SteadyAgreedBlocks`, ``maxima`` the groups' uint8
            block keys in the plan's order, then where measured this rank's preferred chunk
            (:meth:`Reducer._settle_agreed_groups`).
        gather_numels: with ``gather``, the layers' sizes in the plan's order.
        fused: error feedback on the CPU kernels: ``gather`` adds every group's
            residuals (one flat buffer) and, per layer, writes the maxima in bucket
            order (no ``pick``: each group's factors pick theirs), gathering the layers
            too where the groups interleave (else the bucket is their values), and each
            group's encode, residual update and owner step are one call each
            (:meth:`Reducer._fuse_feedback_groups`).
        layouts: the state's node layouts: a group sent hierarchical or grid is a
            :class:`SteadyStaged` (with ``blocks``: :class:`SteadyNodeBlocks`) on its
            route's groups.
        scratch: the state's workspace, whose :attr:`Slot.STEP` slot :meth:`bind` takes the
            layers in the plan's order (groups that interleave) and the groups' block maxima
            and keys from (nothing is deferred); None: allocations of their own.
    """

    numel: int
    ptr: int
    plan: BucketPlan
    groups: list[GroupPlan]
    fmts: list[FloatFormat]
    main: Route
    measured: bool
    chunk: int
    maxima: torch.Tensor
    maxima_call: Callable[[], object] | None = None
    parts: list[tuple[torch.Tensor, _Part | None]] | None = None
    rates: list[torch.Tensor | None] | None = None
    rates_at: list[np.ndarray | None] | None = None
    put_rates: Callable[[], object] | None = None
    gather: Callable[[], object] | None = None
    pick: Callable[[], object] | None = None
    factors: list[Callable[[], object]] | None = None
    scatter: Callable[[], object] | None = None
    order: torch.Tensor | None = None
    bound_ptr: int = 0
    offer: tuple[float | None, float] | None = None
    bucket: bool = False
    names: list[str | None] | None = None
    promote: tuple[list[Any], list[int], list[str | None]] | None = None
    blocks: bool = False
    feedback: bool = False
    epoch: tuple[int, ...] = ()
    workspace: tuple[int, ...] = ()
    none: bool = False
    agreed_blocks: bool = False
    gather_numels: list[int] = dataclasses.field(default_factory=list)
    fused: bool = False
    divided: bool = False
    layouts: Layouts | None = None
    scratch: Workspace | None = None

    def bind(self, x: torch.Tensor, world_size: int, rank: int = 0) -> bool:
        """Bind the maxima kernel, the gather and every group's path to the float32
        buffer ``x``; False where the codec has no fused calls for a group's blocks."""
        n = len(self.fmts)
        agreed = self.maxima[:n]
        bucket_rates = self.maxima[n : 2 * n] if self.promote is not None else None
        rates = bucket_rates
        if not self.blocks:
            # Every group in FP32 (Promote's, on a fast link): a format's codec all the same.
            sent = next((g for g in self.groups if g.reduction != Route.FP32), None)
            sent = sent or next(g for g in self.groups if g.fmt != FP32)
            self.maxima_call = sent.codec.bind_layer_maxima(x, self.plan.layout, agreed)
        order = [i for g in self.groups for i in g.index]
        values, maxima = x, agreed
        self.gather = self.pick = self.scatter = self.put_rates = None
        # The CPU kernels pick each group's maxima (and spread them) in its factors' call.
        on_host = x.device.type == "cpu" and all(
            g.codec.backend == "kernels" for g in self.groups if g.reduction != Route.FP32
        )
        # Consecutive groups with bucket scaling too: the spread in that call, not two more.
        self.factors = [] if on_host and self.bucket and not self.blocks else None
        arena = self.scratch.arena(Slot.STEP) if self.scratch is not None else None
        if order != list(range(n)):
            values = _take(arena, x.numel(), torch.float32, x.device)
            if self.order is None or self.order.device != x.device:
                self.order = to_device(torch.tensor(order, dtype=torch.int64), x.device)
            self.interleave(x, values, order)
            if not self.blocks:
                maxima = torch.empty(n, dtype=torch.float32, device=x.device)
                if on_host:
                    self.factors = []
                    self.maxima_call, self.gather = self._gather_maxima(x, values, agreed), None
                else:
                    self.pick = functools.partial(
                        torch.index_select, agreed, 0, self.order, out=maxima
                    )
            if bucket_rates is not None and not on_host:
                # Every layer's current rate in group order: the FP32 group's are never
                # written again, and go back as they are.
                rates = torch.index_select(bucket_rates, 0, self.order)
                self.put_rates = functools.partial(bucket_rates.index_copy_, 0, self.order, rates)
        # The staged groups' chunk scratch: one for all (a group at a time), as the values
        # the workspace's, or (no workspace) every group's own.
        staged = [transports.node_spare(g) for g in self.groups if g.node is not None]
        spare = arena.take(max(staged), torch.float32) if staged and arena is not None else None
        gather = self._divided(x, values, world_size) if on_host and self.blocks else None
        if self.blocks:
            part = functools.partial(self._blocks_part, arena, gather, (rank, world_size))
        else:
            part = functools.partial(self._steady_part, (world_size, spare))
        # The CPU kernels write each group's rates in bucket order (its layers' positions).
        at = on_host and order != list(range(n))
        if not self.bind_parts(x, values, maxima, part, rates, at):
            return False
        if arena is not None and not arena.close():  # the slot grew: bound on it now
            return self.bind(x, world_size, rank)
        return True

    def _divided(
        self, x: torch.Tensor, values: torch.Tensor, world_size: int
    ) -> tuple[torch.Tensor, np.ndarray, torch.Tensor, int] | None:
        """With every rank's own block exponents on the CPU kernels, where the groups
        interleave: the gather of :func:`aps_comm.cpu_kernels.gather_add` that the first
        sent group's keys' call runs, the FP32 group's layers divided by N on the way
        (:attr:`divided`); None where the bucket is the groups' values."""
        # A group sent first: its keys' call runs before the FP32 group's all-reduce.
        self.divided = values is not x and self.groups[0].reduction != Route.FP32
        if not self.divided:
            return None
        self.gather = None
        return x, self.spans(divide=True), values, world_size

    def spans(self, divide: bool = False, residuals: bool = False) -> np.ndarray:
        """:func:`aps_comm.cpu_kernels.gather_add`'s spans of the bucket's layers into the
        plan's order, no residuals (``divide``: the FP32 group's divided by N, -3), or each
        sent layer's offset in the sent groups' flat ``residuals`` (FP32's in place, -2)."""
        starts, to, kept, spans = np.cumsum([0, *self.plan.numels]), 0, 0, []
        in_place = [i for g in self.groups for i in g.index] == list(range(len(self.fmts)))
        for g in self.groups:
            fp32 = g.reduction == Route.FP32
            how = -3 if divide and fp32 else -2 if residuals and fp32 and in_place else -1
            for i in g.index:
                size = self.plan.numels[i]
                spans.append((starts[i], to, size, kept if residuals and not fp32 else how, i))
                to, kept = to + size, kept + (0 if fp32 else size)
        return np.asarray(spans, np.int64).reshape(-1, 5)

    def interleave(self, x: torch.Tensor, values: torch.Tensor, order: list[int]) -> None:
        """Groups that interleave in the bucket ``x``: its layers copied into ``values`` in
        the plan's ``order`` (:attr:`gather`, one call) and back (:attr:`scatter`: one
        multi-tensor copy, not one per layer)."""
        layers = torch.split(x, self.plan.numels)
        mine = [layers[i] for i in order]
        self.gather_numels = [self.plan.numels[i] for i in order]
        self.gather = functools.partial(torch.cat, mine, out=values)
        pieces = list(torch.split(values, self.gather_numels))
        self.scatter = functools.partial(torch._foreach_copy_, mine, pieces)

    def bind_parts(
        self,
        x: torch.Tensor,
        values: torch.Tensor,
        vector: torch.Tensor,
        part: Callable[[GroupPlan, torch.Tensor, torch.Tensor], _Part | None],
        rates: torch.Tensor | None = None,
        at: bool = False,
    ) -> bool:
        """Every group's bound path, in the plan's order, on the float32 bucket ``x``: what
        ``part`` binds of a group sent scaled (its binder: :class:`Steady`,
        :class:`SteadyBlocks`, :class:`SteadyFeedback` or :class:`SteadyAgreedBlocks`) on
        its view of ``values`` (the bucket, or its layers in the plan's order) and of
        ``vector`` (what the MAX all-reduce agrees, in that order: every layer's maximum,
        or with ``blocks`` each sent group's keys, two per block where staged), None for
        the FP32 group; False where a group has none. ``rates``: with Promote, every
        layer's rate in the plan's order (``at``: in bucket order, each group's whole, at
        its layers' positions, :attr:`rates_at`)."""
        parts: list[tuple[torch.Tensor, _Part | None]] = []
        group_rates: list[torch.Tensor | None] = []
        ats: list[np.ndarray | None] = []
        lo = first = keys = 0
        for g in self.groups:
            gx, last, s = values[lo : lo + g.numel], first + len(g.index), None
            if g.reduction != Route.FP32:
                m = g.layout.n_segments * (2 if Route(g.reduction).staged else 1)
                s = part(g, gx, vector[keys : keys + m] if self.blocks else vector[first:last])
                if s is None:
                    return False
                keys += m if self.blocks else 0
            parts.append((gx, s))
            sent_rates = rates is not None and s is not None
            ats.append(np.asarray(g.index, np.int64) if sent_rates else None)
            group_rates.append((rates if at else rates[first:last]) if sent_rates else None)  # type: ignore[index]
            lo, first = lo + g.numel, last
        self.parts, self.bound_ptr = parts, x.data_ptr()
        self.rates = group_rates if rates is not None else None
        self.rates_at = ats if rates is not None and at else None
        return True

    def _blocks_part(
        self,
        arena: Arena | None,
        gather: tuple[torch.Tensor, np.ndarray, torch.Tensor, int] | None,
        ranks: tuple[int, int],
        g: GroupPlan,
        gx: torch.Tensor,
        _: torch.Tensor,
    ) -> SteadyBlocks | None:
        """Group ``g``'s :class:`SteadyBlocks` on its values ``gx`` (nothing agreed), its
        block maxima and keys from ``arena``; the first sent group's keys' call runs the
        bucket's ``gather`` (:meth:`_divided`)."""
        assert self.layouts is not None
        if g is not next(h for h in self.groups if h.reduction != Route.FP32):
            gather = None
        m, names = g.layout.n_segments, self.names and [self.names[i] for i in g.index]
        scratch = _take(arena, m, torch.float32, gx.device), _take(arena, m, torch.uint8, gx.device)
        fmts, where = [g.fmt] * len(g.index), (self.layouts, self.epoch)
        chunking = (False, self.chunk)
        return _rank_blocks(self.plan, g, gx, fmts, chunking, scratch, names, where, ranks, gather)

    def _steady_part(
        self,
        ranks: tuple[int, torch.Tensor | None],
        g: GroupPlan,
        gx: torch.Tensor,
        gmax: torch.Tensor,
    ) -> Steady:
        """Group ``g``'s :class:`Steady`, bound to its values ``gx`` and agreed maxima ``gmax``
        (``ranks``: N, and a staged group's chunk scratch, if any); with :attr:`factors` its
        factors' call, which writes those maxima (and spreads them for the factors only)."""
        picked, names = self.factors is not None, self.names and [self.names[i] for i in g.index]
        route, (world_size, spare) = Route(g.reduction), ranks
        staged: dict[str, Any] = {}
        if route.staged:
            assert g.node is not None and self.layouts is not None
            staged = _node_groups(self.layouts, route, g.node.ranks_per_node)
            if self.promote is not None:  # its layers' rates: under its first level's factors
                staged["promote"] = tuple([layer[i] for i in g.index] for layer in self.promote)
        steady = (SteadyStaged if staged else Steady)(
            g.numel,
            gx.data_ptr(),
            self.plan,
            g,
            route,
            [g.fmt] * len(g.index),
            gmax,
            AgreedMaxima(gmax, world_size, route == Route.ALLREDUCE, self.none),
            False,
            self.chunk,
            bucket=self.bucket and not picked,
            epoch=self.epoch,
            **staged,
        )
        if names is not None:
            steady.record_names(names)
        if isinstance(steady, SteadyStaged):
            steady.bind(gx, world_size, spare)
        else:
            steady.bind(gx, world_size)
        if self.factors is not None:
            pick = self.maxima[: len(self.fmts)].numpy(), np.asarray(g.index, np.int64), self.bucket
            self.factors.append(self._picked_factors(steady, world_size, pick))
        return steady

    def _gather_maxima(
        self,
        x: torch.Tensor,
        values: torch.Tensor,
        agreed: torch.Tensor,
        residuals: torch.Tensor | None = None,
    ) -> Callable[[], object]:
        """The gather and the maxima in one call on the CPU kernels: the layers of ``x``
        copied into ``values`` in the plan's order, each one's max |x| written into
        ``agreed`` in bucket order (:func:`aps_comm.cpu_kernels.gather_add`); with
        ``residuals`` (the sent groups' flat ones) every sent layer's added first."""
        flat = np.empty(0, np.float32) if residuals is None else residuals.numpy()
        spans = self.spans(residuals=residuals is not None)
        return functools.partial(
            cpu_kernels.call, "gather_add", x.numpy(), spans, flat, values.numpy(), agreed.numpy()
        )

    def _picked_factors(
        self, steady: Steady, world_size: int, pick: tuple[np.ndarray, np.ndarray, bool]
    ) -> Callable[[], object]:
        """A group's factors' one call on the CPU kernels, which picks its layers' agreed
        maxima from the bucket's (``pick``) and with ``bucket`` spreads them first."""
        g = steady.group
        if isinstance(steady, SteadyStaged):
            assert steady.factors is not None  # made by bind
            grid = steady.route == Route.GRID
            return g.codec.bind_staged_factors(
                steady.agreed.maxima,
                *(world_size, steady.per_node, grid, steady.factors, self.none, pick),
            )
        assert steady.host_factors is not None  # the CPU kernels'
        return functools.partial(steady.agreed.host_factors_into, g.fmt, *steady.host_factors, pick)


# A format group's bound path in a :class:`SteadyGroups`.
_Part = Steady | SteadyBlocks | SteadyFeedback | SteadyAgreedBlocks
Settled = _Part | SteadyGroups
"""A settled bucket's bound path, of whichever kind (:meth:`Reducer.steady_for`)."""


@dataclasses.dataclass
class AgreedRates:
    """Promote's rates of a settled bucket, agreed at the end of a step for the next one
    (:meth:`Reducer.agree_rates`).

    Attributes:
        bound: the settled path they are of (another binding reads none).
        rates: the agreed rates, on the bucket's device (bucket order).
        host: their copy on its way to the host (one pinned buffer, copied again each step).
        fresh: whether ``host`` holds rates not read yet.
    """

    bound: Settled
    rates: torch.Tensor
    host: HostValue | None = None
    fresh: bool = False


def _then(first: Callable[[], object], then: Callable[[], object]) -> None:
    """``first()``, then ``then()``: a deferred finish with one more call after it."""
    first()
    then()


@dataclasses.dataclass
class _Unit:
    """What every settled FSDP2 unit keeps (:class:`SteadyMixedUnit`, :class:`SteadyFP32Unit`):
    the layout and policy epoch it is bound to, and its records.

    Attributes:
        chunks: the parameters' padded chunks (the layout it is bound to).
        numel: elements of the N rows.
        device: the rows' device.
        epoch: the policy's epoch of its formats (:meth:`aps_comm.policy.Assignment.epoch`).
        record: with ``stats=True``, the step's records from the N rows: float64 (P, 5),
            one row per parameter (:meth:`aps_comm.telemetry.StepStats.add_rows`; one
            kernel call on the CPU kernels).
        labels: with ``stats=True``, the parameters' names, sizes and formats: the
            records are queued once per step, whatever the number of runs
            (:func:`_unit_records`).
        workspace: a unit of one run: the state's workspace epoch of the unit's slot, which
            its scratch is cut from (another one binds it again); () for several runs.
    """

    chunks: tuple[int, ...]
    numel: int
    device: torch.device
    epoch: tuple[int, ...]
    _: dataclasses.KW_ONLY
    record: Callable[[torch.Tensor], torch.Tensor] | None = None
    labels: tuple[list[str], list[int], tuple[FloatFormat, ...]] | None = None
    workspace: tuple[int, ...] = ()


@dataclasses.dataclass
class SteadyMixedUnit(_Unit):
    """An FSDP2 unit's reduce-scatter once its layout and formats are settled
    (:meth:`Reducer.unit`): one scaled format, or several (a policy keeping some
    parameters in FP32, or two wire formats); any scaling, on every codec backend.

    Bound to the unit's layout, not to a buffer: FSDP hands a new input every
    step, so the calls that read it take it per step and everything else
    (factors, keys, the exchange's and the sum's scratch) is the unit's for
    good. A unit of one run encodes its N rows straight into the send buffer
    and decodes the received rows where they landed: no spans. Of several
    runs, one kernel call gathers every run's N rows out of FSDP's input (the
    FP32 runs straight into the send buffer: sent exactly, their bytes are
    their codes), each scaled format is encoded and decoded once for all its
    runs, one call scatters the codes into the rows and one gathers the
    received rows back. One call sums every run's rows (an FP32 parameter NaN
    where its agreed maximum is not finite): a fixed handful of calls per unit
    for any number of parameters and runs.

    Attributes:
        codec: a scaled format's codec (the shared kernels: maxima, spans, sums).
        layout: the N rows' chunks (the maxima's segments).
        shared: float32, the MAX all-reduce's vector: the parameters' maxima, then the flag.
        local: float32, each row's maximum of every chunk (N x P); with blocks, every
            block's max |x|.
        maxima: float32, the agreed maxima (inf for every parameter of a flagged unit);
            one run on the torch ops: ``agreed``'s first row.
        perm: int64, for each scaled format's segments in turn, its parameter.
        agreed: float32, ``maxima[perm]``: each scaled format's maxima, run by run, row by row.
        poison: 0-d float32 inf (what the flag writes into ``maxima``); one format's
            blocks: NaN, what the flag or a non-finite block writes into the decode's factors.
        spreads: ``scaling="bucket"`` without records: each format's agreed maxima, spread
            in place (with records its factors' one call picks and spreads them).
        calls: per scaled format its factors, encode and decode, bound (one run's encode
            takes the step's rows, padded or not).
        spans: the gather out of the rows, the scatter of the codes into the send
            buffer, and the gather out of the received rows (:meth:`aps_comm.codec.Codec.copy_spans`);
            None for one run (its codes are the send buffer, its landing the received rows).
        buffers: the gather's arena (the scaled runs' values, then the send buffer), the
            codes, the received rows, and the landing (codes, then every run's values):
            the arena's part after the scaled values, which the send buffer no longer
            needs once sent (the state keeps one of the two, not both).
        send: the send buffer (N encoded rows), at the landing's start.
        values: float32, every run's N decoded rows end to end.
        sums: int64 (R, 7), each run's place in ``values``, row and parameters (:meth:`aps_comm.codec.Codec.sum_runs`);
            ``scaling="none"`` with several runs: every run's made NaN by the sum, as
            FP32's (its unscale 1; one run's unscale is NaN instead).
        row_numel: elements per row.
        offsets_of: the host copies of ``layout``'s offsets and of ``perm`` (the maxima's
            and agreed maxima's kernel calls read them).
        keyed: block scaling: the call that writes every block's key of the N rows (each
            under its own format; ``shared`` is then uint8, the keys and the flag), and
            the call that writes every format's block factors from the agreed keys and
            ``maxima`` (inf for a parameter NaN in the sum), one kernel call each; one
            format's: its codec's fused keys over a step's rows, and its factors with the
            decode's (this rank's row's blocks N times).
        pad: a 4-bit unit of one run of an odd row: float32 scratch of the N rows each
            followed by a zero, and the zeros (N x 1): the rows are copied in every step,
            so that every row's codes are whole bytes (each row goes to its own rank).
    """

    codec: codec.Codec
    layout: Layout
    shared: torch.Tensor
    local: torch.Tensor
    maxima: torch.Tensor
    perm: torch.Tensor
    agreed: torch.Tensor
    poison: torch.Tensor
    spreads: list[AgreedMaxima]
    calls: list[tuple[Callable[[], object], Callable[..., object], Callable[[], object]]]
    spans: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    send: torch.Tensor
    values: torch.Tensor
    sums: np.ndarray
    row_numel: int
    keyed: tuple[Callable[[torch.Tensor], object], Callable[[], object]] | None = None
    offsets_of: tuple[np.ndarray, np.ndarray] = ()  # type: ignore[assignment]
    pad: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclasses.dataclass
class SteadyFP32Unit(_Unit):
    """:class:`SteadyMixedUnit` for a unit whose every parameter goes in FP32 (a policy's, or
    "auto" on a fast link): PyTorch's own reduce-scatter, in rank order.

    No maxima and no factors: the layout flag alone rides a one-element MAX
    all-reduce, the rows go out as they are in one ``all_to_all_single``, and
    the N received rows are summed in FP32 in rank order (one kernel call on
    the CPU kernels); a flagged unit comes back NaN. A non-finite element stays
    where it is, as in PyTorch's reduce-scatter (and DDP's FP32 buckets), not
    spread over its parameter. With ``stats=True`` the parameters' maxima ride
    the all-reduce too, for the records (one kernel call).

    Attributes:
        sums: the codec whose :meth:`~aps_comm.codec.Codec.sum_rows` sums the rows.
        recv: float32 (N, row), the received rows (a view of the workspace).
        nan: 0-d float32 NaN, what the flag writes over the sum.
        layout: with ``stats=True``, the N rows' chunks (the maxima's segments).
        shared: with ``stats=True``, float32: the parameters' maxima, then the flag.
        local: with ``stats=True``, float32, each row's maximum of every chunk (N x P).
        agreed: with ``stats=True``, float32, the agreed maxima for every row (N x P).
    """

    sums: codec.Codec
    recv: torch.Tensor
    nan: torch.Tensor
    layout: Layout | None = None
    shared: torch.Tensor | None = None
    local: torch.Tensor | None = None
    agreed: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class _Binding:
    """What a bucket's binders share (:meth:`Reducer._bind_first`).

    Attributes:
        index: DDP's bucket index.
        x: the bucket's float32 values.
        plan: the bucket's plan.
        fmts: each layer's format this step.
        layers: the layers' keys, sizes and names.
        main: the route of the state's format (what chunks are sized for).
        measured: chunks sized by this rank's timing, its preference agreed on the MAX
            all-reduce.
        chunk: this rank's chunk.
    """

    index: int
    x: torch.Tensor
    plan: BucketPlan
    fmts: list[FloatFormat]
    layers: tuple[Sequence[Any], list[int], Sequence[str | None]]
    main: Route
    measured: bool
    chunk: int

    @property
    def at(self) -> tuple[int, torch.Tensor, BucketPlan, list[FloatFormat]]:
        """The index, values, plan and formats."""
        return self.index, self.x, self.plan, self.fmts


class Reducer:
    """One rank's reducer: plans, the per-step path of buckets and units, and their records.

    Args:
        settings: the agreed configuration.
        comm: groups, world and backend.
        planner: the model's choices of route and chunk.
        assignment: each layer's format, step by step.
        feedback: the residuals, with error feedback.
    """

    def __init__(
        self,
        settings: Settings,
        comm: Comm,
        planner: Planner,
        assignment: Assignment,
        feedback: ErrorFeedback | None = None,
    ) -> None:
        self.settings = settings
        self.comm = comm
        self.planner = planner
        self.assignment = assignment
        self.feedback = feedback
        self.traffic = Traffic()
        self.stats = StepStats()
        self.plans: dict[tuple, BucketPlan] = {}
        self.plan_builds = 0
        self.bucket_routes: dict[int, str] = {}
        self.bucket_chunks: dict[int, int] = {}
        # Promote: each layer's last local underflow rate, on the device.
        self.rates: dict[str, torch.Tensor] = {}
        self._routes: dict[FloatFormat, Route] = {}
        self._fixed: dict[FloatFormat, Route] = {}
        # Per bucket index: its bound path once settled (:class:`Steady`).
        self.steady: dict[int, Settled] = {}
        # Per bucket index, with Promote: the rates agreed for its next step.
        self.agreed_rates: dict[int, AgreedRates] = {}
        # Whether Promote's rates are agreed a step early (:meth:`agree_rates`); None: on
        # NCCL only, where the hook reads them on DDP's thread and a read of this step's
        # waits on the device's queue. On Gloo they are host memory as the collective
        # returns (or read on the worker's thread), and one more collective would cost
        # a latency. Tests force it to drive the GPU's path on the CPU.
        self.early_rates: bool | None = None
        # Per device: the buckets' scratch, shared (:mod:`aps_comm.workspace`).
        self.workspaces: dict[torch.device, Workspace] = {}
        # Per FSDP unit index: its bound reduce-scatter once settled (:class:`SteadyMixedUnit`).
        self.steady_units: dict[int, _Unit] = {}
        # Per bucket index: what it was when it last failed to bind (:meth:`_bind_first`).
        self._unbound: dict[int, tuple] = {}
        # Per FSDP unit index: what it was when it last failed to bind.
        self._unbound_units: dict[int, tuple] = {}
        # Promote's move: the moving binding's MAX all-reduce vector, for the new one
        # (:meth:`_vector`).
        self._moving: torch.Tensor | None = None
        # The current step's number (Schedule's): the last one :meth:`bucket` was
        # given, advanced by :meth:`end_step`, so settled buckets know it too.
        self.step = 0

    # -- binding ---------------------------------------------------------------

    def resolve(self, device: torch.device) -> dict[FloatFormat, Route]:
        """Each possible format's route on ``device`` ("auto" stays open per bucket).

        Raises:
            ValueError: a format cannot take the requested reduction here.
        """
        if not self._routes:
            self._routes = resolve_routes(
                self.settings.reduction, self.assignment.possible(), self.comm.backend, device
            )
            # What a bucket sends by, when "auto" does not choose: FP32 layers
            # always travel as the plain FP32 mean.
            self._fixed = {**self._routes, FP32: Route.FP32}
        return self._routes

    def resolve_cached(self) -> dict[FloatFormat, Route]:
        """The routes :meth:`resolve` found (empty before it ran)."""
        return self._routes

    def plan(self, index: int, numels: Sequence[int], device: torch.device) -> BucketPlan:
        """The bucket's plan, built on first use (DDP re-buckets once: the old one is dropped)."""
        key = (index, tuple(numels), str(device))
        plan = self.plans.get(key)
        if plan is None:
            self.plans = {k: v for k, v in self.plans.items() if k[0] != index}
            workspace = self.workspace(device)
            plan = BucketPlan.build(index, numels, device, workspace, self._slot(index))
            self.plans[key] = plan
            self.plan_builds += 1
        return plan

    def forget_after(self, last: int) -> None:
        """Drop the bound paths and plans of buckets past ``last``, a step's last bucket:
        DDP re-bucketed into fewer, and their bindings hold views of its old buffers."""
        for index in [i for i in self.steady if i > last]:
            del self.steady[index]
        if any(key[0] > last for key in self.plans):
            self.plans = {k: v for k, v in self.plans.items() if k[0] <= last}

    def workspace(self, device: torch.device) -> Workspace:
        """The buckets' shared scratch on ``device`` (made on first use)."""
        ws = self.workspaces.get(device)
        if ws is None:
            ws = self.workspaces[device] = Workspace(device)
        return ws

    def _slot(self, index: int) -> Slot:
        """Bucket ``index``'s region: error feedback's buckets never overlap on the wire
        (:meth:`bucket` does not defer them), the others alternate."""
        return Slot.EVEN if self.feedback is not None else Slot.of(index)

    def _epoch(self, index: int, device: torch.device) -> tuple[int, ...]:
        """The workspace epoch bucket ``index``'s buffers are cut from now."""
        return self.workspace(device).epoch(self._slot(index), Slot.EXCHANGE, Slot.STEP)

    # -- one DDP bucket -----------------------------------------------------------

    def bucket(
        self,
        index: int,
        x: torch.Tensor,
        keys: Sequence[Any],
        numels: list[int],
        names: Sequence[str | None],
        *,
        step: int,
        chunk: int | None = None,
        defer: bool = False,
    ) -> Callable[[], None] | None:
        """Average one bucket's float32 values ``x`` over the ranks, in place.

        Args:
            index: DDP's bucket index.
            x: the bucket's values (float32, contiguous).
            keys: each layer's key in the assignment.
            numels: each layer's size.
            names: each layer's parameter name (None when unknown).
            step: the step number (Schedule).
            chunk: elements per chunk; None sizes chunks by the model (and
                on CPU by the bucket's measured exchange).
            defer: leave the last chunks on the wire and return the function
                that finishes them.

        Returns:
            With ``defer`` and chunks left in flight, the function that
            finishes the bucket; else None.
        """
        self.step = step
        plan, layers = self.plan(index, numels, x.device), (keys, numels, names)
        st = self._bind_first(index, x, plan, layers, chunk)
        if st is None:
            # Every configuration the state accepts binds on every codec backend.
            raise RuntimeError(
                f"bucket {index}: no bound path for {self.settings} in formats "
                f"{[f.name for f in self.assignment.formats(keys, step)]} on {x.device}"
            )
        return self.run_steady(index, st, x, defer)

    def _bind_first(
        self,
        index: int,
        x: torch.Tensor,
        plan: BucketPlan,
        layers: tuple[Sequence[Any], list[int], Sequence[str | None]],
        chunk: int | None,
        added: bool = False,
    ) -> Settled | None:
        """Bind bucket ``index``'s settled path before it runs (no collective): this step's
        formats, and the chunk this rank offers (:meth:`run_steady` agrees it with the
        others' and binds again where the largest differs). None where the configuration
        has no bound path (:meth:`bucket` raises; a configuration that failed is not
        tried again until its formats, epoch or workspace change).

        ``layers``: the layers' keys, sizes and names; ``chunk``: as :meth:`bucket`'s;
        ``added``: error feedback's residuals are in ``x`` already (Promote's move).
        """
        comm, settings, assignment, fb = self.comm, self.settings, self.assignment, self.feedback
        keys, numels, names = layers
        fmts = assignment.formats(keys, self.step)
        tried = (x.numel(), tuple(fmts), assignment.epoch(self.step), chunk)
        if self._unbound.get(index) == (*tried, self._epoch(index, x.device)):
            return None
        routes = self._routes_for(plan, fmts)
        if all(routes[f] == Route.FP32 for f in fmts) and assignment.promoter is None:
            if any(f != FP32 for f in fmts):
                self.bucket_routes[index] = Route.FP32.value
            fp32 = _Binding(index, x, plan, fmts, layers, Route.FP32, False, 0)
            self._settle(fp32, None, Route.FP32)  # binds, always
            if fb is not None:
                # What the residuals kept is sent once more (a new epoch's FP32), then
                # none is kept; the bound mean adds nothing.
                fb.add(x, numels, names)
                fb.drop(names)
            return self.steady[index]
        main = self._routes_for(plan, [settings.fmt] * len(fmts))[settings.fmt]
        blocked = settings.scaling == Scaling.BLOCK
        rank_exps = blocked and settings.block_exponents == BlockExponents.RANK and fb is None
        measured = chunk is None and fb is None and x.device.type == "cpu"
        if fb is not None:  # the owner's step needs the whole shard
            chunk = ONE_CHUNK
        elif measured and not rank_exps:
            # This rank's preference; run_steady's maxima carry it to the others.
            chunk = self.planner.chunk(settings.fmt, x.numel(), main, plan.exchange_s or None)
        elif chunk is None:
            if not plan.model_chunk:  # the same on every rank, and every step
                plan.model_chunk = self.planner.chunk(settings.fmt, x.numel(), main)
            # Each rank's own block exponents: the chunk agreed on their first exchange.
            chunk = (plan.agreed_chunk if measured else 0) or plan.model_chunk
        groups = plan.group(
            fmts,
            routes,
            comm.world_size,
            chunk,
            comm.node_layouts(),
            settings.block_size if blocked else None,
            owner_exponents=blocked and fb is None,
            rank_exponents=rank_exps,
        )
        made: list[str] = []
        if fb is not None:
            # A layer's first step: a residual of -0.0, which adds nothing, not even to
            # a -0.0 (x + -0.0 is x bit for bit), so the bound path binds to it.
            sent = [i for g in groups if g.reduction != Route.FP32 for i in g.index]
            new = {names[i]: numels[i] for i in sent if names[i] not in fb.residuals}
            new.pop(None, None)  # a layer without a name keeps no residual
            zeros = torch.full((sum(new.values()),), -0.0, device=x.device)  # one fill
            fb.residuals.update(zip(new, torch.split(zeros, list(new.values())), strict=True))
            made = list(new)  # type: ignore[arg-type]  # None popped
        self.steady.pop(index, None)
        b = _Binding(index, x, plan, fmts, layers, main, measured, chunk)
        self._settle_bucket(b, groups, rank_exps)
        st = self.steady.get(index)
        if st is None:
            if fb is not None:
                fb.drop(made)
            self._unbound[index] = (*tried, self._epoch(index, x.device))
            return None
        if fb is not None:
            # A layer sent in FP32 now (a new epoch's format) sends what its residual
            # kept once more, then keeps none.
            exact = {i for g in groups if g.reduction == Route.FP32 for i in g.index}
            if not added:
                fb.add(x, numels, [m if i in exact else None for i, m in enumerate(names)])
            fb.drop([names[i] for i in exact])
        sent_groups = [g for g in groups if g.fmt != FP32]
        if sent_groups:
            self.bucket_routes[index] = str(max(sent_groups, key=lambda g: g.numel).reduction)
        self.bucket_chunks[index] = chunk
        return st

    def _settle_bucket(self, b: _Binding, groups: list[GroupPlan], rank_exps: bool) -> None:
        """Bind the bucket's settled path of ``groups``, where its configuration has one
        (``rank_exps``: block scaling with every rank's own exponents)."""
        if len(groups) > 1:
            self._settle_groups(b, groups)
            return
        g = groups[0]
        route = Route(g.reduction)
        if (route.staged and not rank_exps) or self.settings.scaling != Scaling.BLOCK:
            self._settle(b, g, route)
        elif g.reduction == Route.ALLREDUCE and self.feedback is None:
            # Agreed keys whatever is asked (a native sum cannot mix exponents); with
            # "rank" no chunk rides on them: the model's.
            self._settle_agreed_blocks(
                dataclasses.replace(b, measured=b.measured and not rank_exps), g
            )
        elif rank_exps:
            self._settle_blocks(b, g)
        elif self.feedback is None:
            self._settle_agreed_blocks(b, g)
        if self.feedback is not None and g.reduction != Route.FP32:
            self._settle_feedback(b, g)

    def _settle_groups(self, b: _Binding, groups: list[GroupPlan]) -> None:
        """Bind the bucket's :class:`SteadyGroups` path where nothing in it changes per step
        but the policy's epoch (the layers' names label the records with ``stats=True``,
        their keys Promote's levels)."""
        settings, assignment = self.settings, self.assignment
        (_, x, _, fmts), names = b.at, b.layers[2]
        blocks = settings.scaling == Scaling.BLOCK
        promoted = assignment.promoter is not None
        if self.feedback is not None:
            self._settle_feedback_groups(b, groups)
            return
        native = [g.reduction == Route.ALLREDUCE for g in groups if g.reduction != Route.FP32]
        if blocks and (settings.block_exponents != BlockExponents.RANK or (native and all(native))):
            # The native sum agrees on its keys whatever is asked; with "rank" no chunk
            # rides on them (the model's).
            rank = settings.block_exponents == BlockExponents.RANK
            self._settle_agreed_groups(
                dataclasses.replace(b, measured=b.measured and not rank), groups
            )
            return
        # Staged groups bind interleaved too (each part's Promote rates picked back into the
        # bucket's order by ``put_rates``).
        if (
            # Blocks: each rank's own exponents (nothing agreed, Promote takes no step).
            (blocks and (promoted or not all(_own_blocks(g) for g in groups)))
            or x.dtype != torch.float32
            # Every group in FP32: one all-reduce of the bucket, but under Promote, whose
            # rates and maxima are still agreed (it may move them out).
            or (not promoted and all(g.reduction == Route.FP32 for g in groups))
        ):
            return
        n = len(fmts)
        size = 0 if blocks else n * (1 + int(promoted)) + int(b.measured)
        maxima = self._vector(size, torch.float32, x.device)
        st = self._steady_groups(
            b,
            groups,
            maxima,
            promoted,
            bucket=settings.scaling == Scaling.BUCKET,
            names=list(names) if settings.stats else None,
            blocks=blocks,
            none=settings.scaling == Scaling.NONE,
            layouts=self.comm.layouts,
            scratch=self.workspace(x.device),
        )
        self._keep(b, st if st.bind(x, self.comm.world_size, self.comm.rank) else None)

    def _steady_groups(
        self,
        b: _Binding,
        groups: list[GroupPlan],
        vector: torch.Tensor,
        promoted: bool = False,
        **fields: Any,
    ) -> SteadyGroups:
        """The bucket's :class:`SteadyGroups` of ``groups``, unbound, on its MAX all-reduce
        ``vector`` (``promoted``: with Promote, every layer's rate after the maxima;
        ``fields``: the others)."""
        (_, x, plan, fmts), (keys, numels, names) = b.at, b.layers
        promote = (list(keys), list(numels), list(names)) if promoted else None
        if promoted:  # the FP32 group's layers keep their rates
            n, kept = len(fmts), {i for g in groups if g.reduction == Route.FP32 for i in g.index}
            self._rates_into(vector[n : 2 * n], names, kept)
        return SteadyGroups(
            *(x.numel(), x.data_ptr(), plan, groups, list(fmts), Route(b.main), b.measured),
            *(b.chunk, vector),
            promote=promote,
            epoch=self.assignment.epoch(self.step),
            **fields,
        )

    def _settle_feedback_groups(self, b: _Binding, groups: list[GroupPlan]) -> None:
        """Bind the :class:`SteadyGroups` path of a bucket of several formats with error
        feedback: each group sent scaled a :class:`SteadyFeedback` on its view, its agreed
        maxima (or block keys) a view of the one vector the bucket MAX-all-reduces (with
        Promote, every layer's rate after them)."""
        (_, x, _, fmts), sent = b.at, [g for g in groups if g.reduction != Route.FP32]
        blocks = self.settings.scaling == Scaling.BLOCK
        routes = (Route.FP32, Route.TWO_PHASE, Route.ALLREDUCE)
        if (
            x.dtype != torch.float32
            # Every group in FP32: under Promote only (its maxima and rates still agreed).
            or not (sent or self.assignment.promoter is not None)
            or any(g.reduction not in routes for g in groups)
        ):
            return
        # One MAX all-reduce: every layer's maximum, or each sent format's block keys in
        # the plan's order.
        n, promoted = len(fmts), self.assignment.promoter is not None and not blocks
        size = sum(g.layout.n_segments for g in sent) if blocks else n * (1 + int(promoted))
        dtype = torch.uint8 if blocks else torch.float32
        shared = self._vector(size, dtype, x.device)
        st = self._steady_groups(b, groups, shared, promoted, blocks=blocks, feedback=True)
        self._bind_shared(b, st, functools.partial(self._feedback_part, b, shared))

    def _bind_shared(
        self, b: _Binding, st: SteadyGroups, part: Callable[..., _Part | None]
    ) -> None:
        """Bind and keep ``st``, whose vector is written before its MAX all-reduce (error
        feedback, agreed block keys): each sent group's ``part`` (:meth:`_feedback_part`,
        :meth:`_agreed_part`), given its scratch and where its own scratch starts."""
        x, names, n, shared = b.x, b.layers[2], len(b.fmts), st.maxima
        sent = [g for g in st.groups if g.reduction != Route.FP32]
        promoted, order = st.promote is not None, [i for g in st.groups for i in g.index]
        workspace = self.workspace(x.device)
        for _ in range(2):  # twice only where the workspace had to grow
            # The STEP slot: first what lives across the groups (the layers in the plan's
            # order; every group's block maxima, all written before the MAX all-reduce,
            # each read by its records after it), then each group's scratch from one start
            # (one group at a time). The fused residuals are made anew each time.
            epoch, arena = workspace.epoch(Slot.STEP), workspace.arena(Slot.STEP)
            values, agreed = x, shared  # the groups' values and vector, in the plan's order
            flat = None  # the fused path's residuals: every sent group's, in the plan's order
            on_host = x.device.type == "cpu" and all(g.codec.backend == "kernels" for g in sent)
            if st.feedback and on_host:
                fuse = self._fuse_feedback_groups
                values, agreed, flat = fuse(st, x, order, promoted, names, arena)
            elif order != list(range(n)):
                scratch = arena.take(x.numel(), torch.float32)
                values, agreed = self._interleave(st, x, order, shared, promoted, names, scratch)
            if not st.blocks and not st.fused:
                layout = (
                    b.plan.layout if values is x else Layout.from_numels(st.gather_numels, x.device)
                )
                # Every group in FP32: a format's codec all the same (a group's is not FP32).
                maxima = (sent or [g for g in st.groups if g.fmt != FP32])[0].codec
                st.maxima_call = maxima.bind_layer_maxima(values, layout, agreed[:n])
            # Per sent group: its residuals (a view of the fused ones) and its block maxima
            # (a staged group's are its own).
            own = [
                g.layout.n_segments if st.blocks and not Route(g.reduction).staged else -1
                for g in sent
            ]
            local = [arena.take(m, torch.float32) if m >= 0 else None for m in own]
            arena.close()
            kept = np.cumsum([0, *[g.numel for g in sent]]).tolist()
            flats = [None if flat is None else flat[i:j] for i, j in itertools.pairwise(kept)]
            bind = functools.partial(part, iter(zip(flats, local, strict=True)), arena.end)
            if not st.bind_parts(x, values, agreed, bind, agreed[n:] if promoted else None):
                return
            if workspace.epoch(Slot.STEP) == epoch:
                break
        self._keep(b, st)

    def _feedback_part(
        self,
        b: _Binding,
        shared: torch.Tensor,
        scratch: Iterator[tuple[torch.Tensor | None, torch.Tensor | None]],
        end: int,
        g: GroupPlan,
        gx: torch.Tensor,
        shares: torch.Tensor,
    ) -> SteadyFeedback | None:
        """Group ``g``'s part of :meth:`_settle_feedback_groups`: its :class:`SteadyFeedback`
        on its values ``gx`` and ``shares``, its view of the vector the bucket agrees on;
        ``scratch``'s next: its residuals (a view of the fused ones, whose factors pick its
        maxima from the bucket's ``shared``; else None) and its block maxima (or None);
        its own scratch after the STEP slot's ``end`` bytes."""
        residuals, local = next(scratch)
        fused = None
        if residuals is not None:
            pick = None
            if self.settings.scaling != Scaling.BLOCK:
                n, spread = len(b.fmts), self.settings.scaling == Scaling.BUCKET
                pick = shared[:n].numpy(), np.asarray(g.index, np.int64), spread
            fused = residuals, pick
        gnames = [b.layers[2][i] for i in g.index]
        return self._bind_feedback(b, gx, g, gnames, shares, fused, (end, local))

    def _settle_agreed_groups(self, b: _Binding, groups: list[GroupPlan]) -> None:
        """Bind the :class:`SteadyGroups` path of a bucket of several formats with agreed
        block exponents (or the native sum's, agreed whatever is asked): each group sent
        scaled a :class:`SteadyAgreedBlocks` (``native`` where its route is the all-reduce)
        on its view (the bucket's, or bound scratch of the layers in the plan's order where
        the groups interleave), its keys a view of the one uint8 vector the bucket
        MAX-all-reduces (every sent format's keys in the plan's
        order, then where measured this rank's preferred chunk)."""
        x, sent = b.x, [g for g in groups if g.reduction != Route.FP32]
        staged = any(Route(g.reduction).staged for g in sent)
        if (
            # Promote refuses block scaling (it needs one exponent per layer).
            self.assignment.promoter is not None
            or x.dtype != torch.float32
            # The staged keys and their factors (SteadyStaged.local) bind on the CPU kernels
            # and on Triton (Codec.bind_staged_blocks).
            or (staged and any(g.codec.backend not in ("kernels", "triton") for g in sent))
        ):
            return
        # A staged group's two keys per block (inner, then outer).
        size = sum(g.layout.n_segments * (2 if Route(g.reduction).staged else 1) for g in sent)
        size += int(b.measured)
        shared = torch.zeros(size, dtype=torch.uint8, device=x.device)
        st = self._steady_groups(b, groups, shared, blocks=True, agreed_blocks=True)
        parts = dataclasses.replace(b, measured=False)  # the chunk rides on the bucket's vector
        self._bind_shared(b, st, functools.partial(self._agreed_part, parts))

    def _agreed_part(
        self,
        b: _Binding,
        scratch: Iterator[tuple[None, torch.Tensor | None]],
        _: int,
        g: GroupPlan,
        gx: torch.Tensor,
        keys: torch.Tensor,
    ) -> SteadyAgreedBlocks | SteadyStaged | None:
        """Group ``g``'s part of :meth:`_settle_agreed_groups` on its values ``gx`` and its
        keys ``keys``, a view of the bucket's one agreed vector (or the whole bucket's
        :class:`SteadyAgreedBlocks` of :meth:`_settle_agreed_blocks`, its chunk's byte after
        the keys where ``b.measured``): a :class:`SteadyAgreedBlocks`, its block maxima
        ``scratch``'s next, its layers recorded with ``stats=True``, or hierarchical or grid
        the :class:`SteadyStaged` of agreed block exponents (``local``), two keys per block
        (None where the group has no node layout, or the codec no calls for it)."""
        plan, names, (_, maxima) = b.plan, [b.layers[2][i] for i in g.index], next(scratch)
        route, chunk, fmts = Route(g.reduction), b.chunk, [g.fmt] * len(g.index)
        if not route.staged:
            assert maxima is not None  # taken by _bind_shared
            part = SteadyAgreedBlocks(
                *(gx.numel(), gx.data_ptr(), plan, g, fmts, Route(b.main), b.measured, chunk),
                *(maxima, keys, torch.zeros(len(g.numels), dtype=torch.uint8, device=gx.device)),
                epoch=self.assignment.epoch(self.step),
                names=names if self.settings.stats else None,
                native=route == Route.ALLREDUCE,
            )
            return part if part.bind(gx, self.comm.rank, self.comm.world_size) else None
        if g.node is None:
            return None
        local = torch.empty(g.layout.n_segments, device=gx.device)
        part = SteadyStaged(
            g.numel,
            gx.data_ptr(),
            plan,
            g,
            route,
            fmts,
            keys,
            AgreedMaxima(local, self.comm.world_size),
            False,
            chunk,
            local=local,
            **_node_groups(self.comm.layouts, route, g.node.ranks_per_node),
        )
        if self.settings.stats:
            part.record_names(names)
        return part if part.bind(gx, self.comm.world_size) else None

    def _interleave(
        self,
        st: SteadyGroups,
        x: torch.Tensor,
        order: list[int],
        shared: torch.Tensor,
        promoted: bool,
        names: Sequence[str | None],
        values: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Groups that interleave in the bucket: bound scratch of the layers in the plan's
        order (``st.gather`` and ``st.scatter``, one call each) and, per layer, a vector in
        that order that ``st.put_rates`` copies into the bucket order of ``shared`` (the
        MAX all-reduce's contents: maxima, then Promote's rates) and
        ``st.pick`` copies the agreed maxima back from. Block keys are in the plan's order
        already. Returns the scratch ``values`` (the workspace's) and that vector
        (``shared`` itself with blocks)."""
        st.interleave(x, values, order)
        if st.blocks:
            return values, shared
        n = len(order)
        rows = order + [n + i for i in order] if promoted else order
        at = to_device(torch.tensor(rows, dtype=torch.int64), x.device)
        agreed = torch.zeros_like(shared)
        if promoted:  # the rates in the plan's order: the reducer's rates are views of them
            fp32 = {i for g in st.groups if g.reduction == Route.FP32 for i in g.index}
            kept = {j for j, i in enumerate(order) if i in fp32}
            self._rates_into(agreed[n:], [names[i] for i in order], kept)
        st.put_rates = functools.partial(shared.index_copy_, 0, at, agreed)
        st.pick = functools.partial(torch.index_select, shared, 0, at[:n], out=agreed[:n])
        return values, agreed

    def _fuse_feedback_groups(
        self,
        st: SteadyGroups,
        x: torch.Tensor,
        order: list[int],
        promoted: bool,
        names: Sequence[str | None],
        arena: Arena | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The groups' values and vector on the CPU kernels, fused: ``st.gather`` adds
        every sent group's residuals (one flat buffer, the groups' in the plan's order)
        and, per layer, writes each one's maximum in bucket order into ``st.maxima``, in
        one call (:func:`aps_comm.cpu_kernels.gather_add`; unfused, an add per group and
        the maxima); where the groups interleave it also copies the layers into bound
        scratch in the plan's order (unfused, a gather and the maxima's copy into bucket
        order: :meth:`_interleave`), which ``st.scatter`` copies back (that scratch from
        ``arena`` where given), and with Promote ``st.put_rates`` copies the rates alone.
        Returns the values in the plan's order, the vector in that order (each group's
        agreed maxima, picked by its factors; Promote's rates after them) and the flat
        residuals."""
        n = len(order)
        fp32 = {i for g in st.groups if g.reduction == Route.FP32 for i in g.index}
        in_place = order == list(range(n))  # the groups consecutive: the bucket's own views
        values = x if in_place else _take(arena, x.numel(), torch.float32, x.device)
        kept = sum(g.numel for g in st.groups if g.reduction != Route.FP32)
        flat = torch.empty(kept, dtype=torch.float32)
        if not in_place:
            st.interleave(x, values, order)  # its scatter (the gather is the kernel's)
        maxima = st.maxima[:0] if st.blocks else st.maxima[:n]
        st.gather = st._gather_maxima(x, values, maxima, flat)
        st.fused = True
        if st.blocks or in_place:  # block keys: in the plan's order already
            return values, st.maxima, flat
        agreed = torch.zeros_like(st.maxima)
        if promoted:  # the rates in the plan's order: the reducer's rates are views of them
            kept_rates = {j for j, i in enumerate(order) if i in fp32}
            self._rates_into(agreed[n:], [names[i] for i in order], kept_rates)
            at = torch.tensor(order, dtype=torch.int64)
            st.put_rates = functools.partial(st.maxima[n:].index_copy_, 0, at, agreed[n:])
        return values, agreed, flat

    def _rates_into(
        self, slots: torch.Tensor, names: Sequence[str | None], kept: Container[int] = ()
    ) -> None:
        """Promote: every layer's last local rate into ``slots`` of a settled bucket's maxima
        vector, which the next step's MAX all-reduce sends; the reducer's rates of the
        layers not ``kept`` become views of them (checkpoints read those), those ``kept``
        (sent in FP32: never measured again) views of a copy."""
        zero = torch.zeros((), device=slots.device)
        local = torch.stack([self.rates.get(m or "", zero) for m in names])
        slots.copy_(local)
        # Kept: not the slots, which the all-reduce overwrites with the ranks' largest,
        # nor a vector that a move hands on (:meth:`_vector`).
        self.rates.update(
            {m or "": (local if i in kept else slots)[i] for i, m in enumerate(names)}
        )

    def _agree_groups(self, st: SteadyGroups, x: torch.Tensor) -> bool:
        """:meth:`run_head` of a bucket of several formats: the one MAX all-reduce of its
        vector; False, none, with every rank's own block exponents.

        Before that all-reduce: with error feedback (``st.feedback``) every group's
        residuals added, then every layer's maximum (or each group's block keys) and
        Promote's rates put in bucket order; with agreed block exponents
        (``st.agreed_blocks``) every sent group's keys; both after the gather, where
        the groups interleave. Else every layer's maximum (the gather after it).
        This rank's preferred chunk rides on the vector where chunks are measured."""
        comm = self.comm
        early = st.feedback or st.agreed_blocks  # float32 buckets only: bound to x for good
        if not early and st.bound_ptr != x.data_ptr():  # a bfloat16 bucket's float32 copy
            st.bind(x, comm.world_size, comm.rank)
        if st.blocks and not early:
            return False
        assert st.parts is not None  # made by bind
        sent = [(values, s) for values, s in st.parts if s is not None]
        if early and st.gather is not None:
            st.gather()
        if st.feedback and not st.fused:  # else added by the gather
            for values, s in sent:
                values.add_(s.residual)  # type: ignore[union-attr]  # SteadyFeedback's
        if st.measured:  # CPU only: the numpy view of the chunk's slot, no tensor op
            st.maxima.numpy()[-1] = self._offer(st, st.main)
        if st.maxima_call is not None:  # every layer's
            st.maxima_call()
        elif st.blocks:  # each sent group's keys (error feedback's residuals added above)
            for values, s in sent:
                if isinstance(s, SteadyFeedback):
                    s.agree()
                else:
                    s.write_vector(values)  # type: ignore[union-attr]  # no SteadyBlocks here
        if early and st.put_rates is not None:  # into bucket order
            st.put_rates()
        transports.all_reduce_max(st.maxima, comm.group, self.traffic)
        return True

    def _finish_groups(self, index: int, st: SteadyGroups, x: torch.Tensor, chunk: int) -> None:
        """:meth:`run_rest` of a bucket of several formats (after the MAX all-reduce, none
        with every rank's own block exponents), on the vector it agreed and ``chunk``, the
        ranks' chunk: every group's bound path (the
        groups bound again where the chunk moved; with agreed block exponents the keys
        and their scratch stay: only the chunks' calls move)."""
        if chunk != st.chunk:
            st.groups, st.chunk = self._regroup(st, chunk), chunk
            if st.agreed_blocks:
                assert st.parts is not None  # made by _settle_agreed_groups
                sent = [(values, s) for values, s in st.parts if s is not None]
                moved = [g for g in st.groups if g.reduction != Route.FP32]
                for (values, s), g in zip(sent, moved, strict=True):
                    s.group, s.chunk = g, chunk  # type: ignore[union-attr]
                    self._bind(s, values)  # type: ignore[arg-type]
            else:
                st.bind(x, self.comm.world_size, self.comm.rank)
            st.workspace = self._epoch(index, x.device)
            if st.gather is None and st.scatter is not None and not st.divided:
                _gather_back(st.scatter)  # new scratch: gather again
        self.bucket_chunks[index] = st.chunk
        self._run_parts(index, st, st.feedback or st.agreed_blocks)

    def _run_parts(self, index: int, st: SteadyGroups, early: bool = False) -> None:
        """Every group's bound path of a settled bucket of several formats, in the plan's
        order, between the gather and the scatter, on the vector its MAX all-reduce agreed
        (none with every rank's own block exponents). ``early``: the gather, and Promote's
        rates put in bucket order, ran before that all-reduce (error feedback: its
        residuals added; agreed block exponents: the keys)."""
        comm = self.comm
        assert st.parts is not None  # made by bind
        if st.gather is not None and not early:
            st.gather()
        if st.pick is not None:
            st.pick()
        rates = st.rates or [None] * len(st.parts)
        ats = iter(st.rates_at or ())
        factors = iter(st.factors or ())
        for (values, s), out in zip(st.parts, rates, strict=True):
            at = next(ats, None)
            if s is None:
                world_size, divided = comm.world_size, st.divided
                transports.fp32_mean(values, comm.group, world_size, self.traffic, divided)
            elif isinstance(s, SteadyBlocks):
                self.steady_block_keys(index, s, values)  # and their records
                self._exchange(s)
            else:
                # Factors and scratch of one group at a time: the groups share the STEP slot.
                made = next(factors, None) if isinstance(s, Steady) else None
                self._finish_steady(index, s, values, rates=(out, at), factors=made)
        if st.put_rates is not None and not early:
            st.put_rates()
        if st.scatter is not None:
            st.scatter()

    def _settle_feedback(self, b: _Binding, g: GroupPlan) -> None:
        """Bind the bucket's :class:`SteadyFeedback` path where nothing in it changes per step
        but the policy's epoch and Promote's levels."""
        (index, x, _, fmts), (keys, numels, names) = b.at, b.layers
        # Every scaling settles here (bucket and none too: their factors' rule is bound).
        if not g.contiguous or x.dtype != torch.float32:
            return
        n, promoted = len(fmts), self.assignment.promoter is not None
        vector = None
        if promoted and self.settings.scaling != Scaling.BLOCK:
            # The vector: the maxima, then every layer's last local rate.
            vector = self._vector(2 * n, torch.float32, x.device)
            self._rates_into(vector[n:], names)
        st = self._bind_feedback(b, x, g, names, None if vector is None else vector[:n])
        if st is not None:
            if vector is not None:
                st.maxima, st.fmts = vector, list(fmts)
                st.promote = list(keys), list(numels), list(names)
            self.steady[index] = st

    def _bind_feedback(
        self,
        b: _Binding,
        x: torch.Tensor,
        g: GroupPlan,
        names: Sequence[str | None],
        shared: torch.Tensor | None = None,
        fused: tuple[torch.Tensor, tuple[np.ndarray, np.ndarray, bool] | None] | None = None,
        after: tuple[int, torch.Tensor | None] = (0, None),
    ) -> SteadyFeedback | None:
        """Group ``g``'s :class:`SteadyFeedback` of bucket ``b``, bound to its values ``x``
        (the bucket, or a group's view of it); None where it has no bound path: not two_phase or the native
        sum in one chunk, a layer without a residual of its own (every codec backend
        binds: the torch ones with tensor ops).

        ``shared``: where its agreed maxima or block keys go, a view of the vector that a
        bucket of several formats agrees on at once (:meth:`_settle_feedback_groups`);
        None: its own. ``fused`` (:meth:`_fuse_feedback_groups`): its residuals, a view
        of the bucket's flat ones, and its layers' positions in the bucket's agreed
        maxima, which its factors pick into ``shared`` (None with blocks); its encode
        with its residual update, and its owner step, then one CPU kernel call each.
        ``after``: the STEP slot's bytes its scratch starts after, its block maxima there.
        """
        fb, comm = self.feedback, self.comm
        assert fb is not None
        if (
            g.reduction not in (Route.TWO_PHASE, Route.ALLREDUCE)
            or g.block_shards is not None
            or len(g.chunks) != 1
            or len(set(names)) != len(names)
            or not all(n in fb.residuals for n in names)
        ):
            return None
        native, blocks = g.reduction == Route.ALLREDUCE, g.blocks is not None
        n_seg, device, numel = g.layout.n_segments, x.device, x.numel()
        r0, r1 = g.regions[0]
        send, f32 = g.send[r0:r1], {"dtype": torch.float32, "device": device}
        # two_phase's padding to whole shards (the native sum sends the payload as it is)
        pad = 0 if native else (r1 - r0) * 8 // g.fmt.wire_bits - numel
        per = (numel + pad) // comm.world_size
        # One float32 scratch: this rank's payload decoded (the values as sent), later the
        # owner's N shards; with blocks, the factors and keys too (Promote refuses blocks:
        # nothing reads them after the hook). Used only while the hook runs (not
        # deferred): every bucket's. The shards' mean goes in the bucket's own values.
        mean = x[:per] if per <= numel else None
        sizes = [
            (after[0], torch.uint8),
            (numel + pad + (per if mean is None else 0), torch.float32),
        ]
        if blocks:  # scale, unscale, the native sum's inverse, the block maxima, the keys
            floats = 2 + int(native) + int(after[1] is None)
            sizes += [(n_seg, torch.float32)] * floats + [(n_seg, torch.uint8)]
        _, scratch, *views = _step_views(self.workspace(device), sizes)
        if blocks:
            scale, unscale, *views, keys = views
            inverse = views.pop(0) if native else unscale
            maxima = views[0] if after[1] is None else after[1]
            shared = keys if shared is None else shared
        else:
            scale, unscale = torch.empty(n_seg, **f32), torch.empty(n_seg, **f32)
            inverse, maxima = torch.empty(n_seg, **f32) if native else unscale, None
            shared = torch.zeros(n_seg, **f32) if shared is None else shared
        agree, factors_call, host_keys = _feedback_calls(
            g,
            x,
            comm.world_size,
            self.settings.scaling,
            (maxima, shared),
            (scale, inverse, unscale),
            None if fused is None else fused[1],
        )
        if agree is None:
            return None
        residual = fused[0] if fused is not None else torch.empty(numel, **f32)
        kept = (scratch[:numel], residual)
        whole = native or fused is not None
        encode = _feedback_encode(g, x, send, (scale, inverse), pad, kept, whole)
        owner = recv = shard = None
        if not native:  # two_phase's owner step, with its loss
            (s0, s1), recv = g.shard_regions[0], g.recv[r0:r1]
            shard = g.shards[s0:s1]
            owner = g.codec.bind_owner_feedback(
                recv,
                comm.world_size,
                shard,
                g.layout,
                (scale, unscale),
                comm.rank,
                residual,
                scratch,
                mean,
                fused is not None,
            )
        decode = g.codec.bind_decode(send, x, unscale, g.windows[0])
        stats = self.settings.stats
        records = self._feedback_records(g, x, shared, maxima, host_keys) if stats else None
        return SteadyFeedback(
            numel,
            x.data_ptr(),
            b.plan,
            g,
            residual,
            fb.share(names, g.numels, residual),  # type: ignore[arg-type]  # checked above
            shared,
            agree,
            host_keys,
            maxima,
            scale,
            calls=[transports.ChunkCalls(encode, owner, decode, send, recv, shard)],
            bound_ptr=x.data_ptr(),
            factors_call=factors_call,
            workspace=self._epoch(b.index, device),
            epoch=self.assignment.epoch(self.step),
            names=list(names) if self.settings.stats else None,
            records_call=records,
        )

    def _feedback_records(
        self,
        g: GroupPlan,
        x: torch.Tensor,
        shared: torch.Tensor,
        maxima: torch.Tensor | None,
        keys: np.ndarray | None,
    ) -> Callable[[torch.Tensor], None] | None:
        """The bound records of an error-feedback bucket (None: record_feedback's tensor
        ops): its layers' under the route's rule of the agreed maxima ``shared`` (on the
        CPU kernels their int32 exponent ``keys``), or its blocks' under the agreed keys
        ``shared`` with this rank's block ``maxima``; one kernel call on the CPU kernels,
        Triton's launches on Triton."""
        scaling, native = self.settings.scaling, g.reduction == Route.ALLREDUCE
        if g.codec.backend == "kernels" and x.device.type == "cpu":
            if g.blocks is None:
                assert keys is not None  # left by the factors' call
                return functools.partial(g.codec.layer_records, x, g.layout, shared, keys)
            assert maxima is not None
            return g.codec.bind_block_records(x, g.blocks, shared, maxima)
        if g.blocks is None and scaling != Scaling.BUCKET:
            none = scaling == Scaling.NONE
            agreed = AgreedMaxima(shared, self.comm.world_size, native, none)
            return g.codec.bind_layer_records(x, g.layout, agreed, shared)
        if g.blocks is not None and g.codec.backend == "triton":
            assert maxima is not None
            return g.codec.bind_block_records(x, g.blocks, shared, maxima)
        return None

    def _settle_agreed_blocks(self, b: _Binding, g: GroupPlan) -> None:
        """Bind the bucket's :class:`SteadyAgreedBlocks` path where nothing in it changes
        per step (with ``stats=True`` recording too, its layers labelled by their names):
        two_phase's, or the native sum's (``native``: one MAX all-reduce of the keys, this
        rank's preferred chunk on it where measured, then per chunk the encode, the sum in
        the wire format and the decode, :func:`aps_comm.transports.native`'s)."""
        x, measured = b.x, b.measured
        assignment, sh = self.assignment, g.block_shards
        native, device = g.reduction == Route.ALLREDUCE, x.device
        if (
            # Promote refuses block scaling (it needs one exponent per layer).
            assignment.promoter is not None
            or not g.contiguous
            or (native and self.settings.stats and device.type != "cpu")
            or (not native and (g.reduction != Route.TWO_PHASE or sh is None or sh.rank_exponents))
        ):
            return
        n_blocks = g.layout.n_segments
        # Written and read before the exchange, never by a deferred tail: every bucket's.
        (maxima,) = _step_views(self.workspace(device), [(n_blocks, torch.float32)])
        shared = torch.zeros(n_blocks + int(measured), dtype=torch.uint8, device=device)
        self._keep(b, self._agreed_part(b, iter([(None, maxima)]), 0, g, x, shared))

    def _settle_blocks(self, b: _Binding, g: GroupPlan) -> None:
        """Bind the bucket's :class:`SteadyBlocks` path where nothing in it changes per step
        (with ``stats=True`` recording too, its layers labelled by their names)."""
        (_, x, plan, fmts), names = b.at, b.layers[2]
        assignment = self.assignment
        sh, route = g.block_shards, Route(g.reduction)
        two_phase = route == Route.TWO_PHASE and sh is not None and sh.rank_exponents
        staged = route.staged and g.node_blocks is not None
        if assignment.promoter is not None or not g.contiguous or not (two_phase or staged):
            return
        # On the bucket's device: the Triton kernels write and read them there. two_phase
        # writes and reads them before the exchange, never in a deferred tail: every
        # bucket's, from the workspace.
        sizes = [(g.layout.n_segments, torch.float32), (g.layout.n_segments, torch.uint8)]
        if staged:
            scratch = [torch.empty(n, dtype=dtype, device=x.device) for n, dtype in sizes]
        else:
            scratch = _step_views(self.workspace(x.device), sizes)
        labels = list(names) if self.settings.stats else None
        where = (self.comm.layouts, assignment.epoch(self.step))
        ranks = (self.comm.rank, self.comm.world_size)
        chunking = (b.measured, b.chunk)
        self._keep(b, _rank_blocks(plan, g, x, list(fmts), chunking, scratch, labels, where, ranks))

    def _settle(self, b: _Binding, g: GroupPlan | None, route: Route) -> None:
        """Bind the bucket's :class:`Steady` path (two_phase, a native sum or FP32), or its
        :class:`SteadyStaged` one (hierarchical or grid, layer, bucket or no scaling, or
        agreed block exponents), where nothing in it changes per step but the policy's
        epoch and Promote's levels.

        With ``stats=True`` the bound path records too (:meth:`record_steady`), the
        layers' names labelling their records; with Promote it keeps the layers' keys,
        sizes and names.
        """
        assignment, settings, staged = self.assignment, self.settings, route.staged
        (_, x, plan, fmts), (keys, numels, names) = b.at, b.layers
        measured, promote = b.measured, None
        if assignment.promoter is not None:
            promote = list(keys), list(numels), list(names)
        if (
            # Sent in FP32, error feedback keeps nothing: :meth:`_bind_first` sends what
            # the residuals kept once more and drops them.
            (self.feedback is not None and route != Route.FP32)
            or not (route == Route.FP32 or (g is not None and g.contiguous))
            or (staged and g.node is None)  # type: ignore[union-attr]  # contiguous: a group
            # An FP32 bucket is one all-reduce, whatever the scaling; the staged routes'
            # block scaling is agreed keys, two_phase's and native's their own binders'.
            or (not staged and route != Route.FP32 and settings.scaling == Scaling.BLOCK)
        ):
            return
        n = len(fmts)
        rates = n if promote is not None else 0
        maxima = self._vector(n + rates + int(measured), torch.float32, x.device)
        local, extra = None, {}
        if staged:
            assert g is not None and g.node is not None
            if g.blocks is not None:
                # Agreed block exponents: the vector is two keys per block, then the
                # chunk's byte.
                local = torch.empty(g.layout.n_segments, device=x.device)
                size = 2 * local.numel() + int(measured)
                maxima = torch.zeros(size, dtype=torch.uint8, device=x.device)
            extra = _node_groups(self.comm.layouts, route, g.node.ranks_per_node)
            extra.update(local=local, scratch=self.workspace(x.device))
        if promote is not None:  # sent in FP32, the layers' rates stay
            kept = set(range(n)) if route == Route.FP32 else set()
            self._rates_into(maxima[n : 2 * n], promote[2], kept)
        native, none = route == Route.ALLREDUCE, settings.scaling == Scaling.NONE
        st = (SteadyStaged if staged else Steady)(
            x.numel(),
            x.data_ptr(),
            plan,
            g,  # type: ignore[arg-type]
            route,
            list(fmts),
            maxima,
            AgreedMaxima(
                maxima[:n] if local is None else local, self.comm.world_size, native, none
            ),
            measured,
            b.chunk,
            bucket=settings.scaling == Scaling.BUCKET,
            # Static rules fix each layer's format for good, Schedule for an epoch.
            epoch=assignment.epoch(self.step),
            promote=promote,
            **extra,
        )
        if settings.stats and route != Route.FP32:  # an FP32 bucket records nothing
            st.record_names(names)
        if not st.bind(x, self.comm.world_size):
            return
        self._keep(b, st)
        if promote is not None and route == Route.FP32:
            # The maxima all the same: a move out of FP32 resumes from them.
            # Any format's codec writes them; the ladder's narrowest has the fused kernel.
            narrowest = codec.codec_for(assignment.promoter.ladder[0], x.device)  # type: ignore[union-attr]
            st.maxima_call = narrowest.bind_layer_maxima(x, plan.layout, maxima[:n])

    def _keep(self, b: _Binding, st: Settled | None) -> None:
        """Keep ``st``, where it bound, as bucket ``b``'s settled path, on the workspace
        epoch after its binding (its STEP slot may have grown)."""
        if st is not None:
            st.workspace = self._epoch(b.index, b.x.device)
            self.steady[b.index] = st

    def steady_for(self, index: int, buffer: torch.Tensor) -> Settled | None:
        """The bucket's :class:`Steady` path, if its layout and the policy's epoch are the ones
        it was bound to (a new epoch's formats bind it again, through :meth:`bucket`), and
        with error feedback, its residuals are still the feedback's."""
        st = self.steady.get(index)
        if st is None or st.numel != buffer.numel() or st.ptr != buffer.data_ptr():
            return None
        if st.workspace != self._epoch(index, buffer.device):
            # Bound to a workspace region since outgrown: bound again, on the new one.
            del self.steady[index]
            return None
        fed = [st] if isinstance(st, SteadyFeedback) else []
        if isinstance(st, SteadyGroups) and st.feedback and st.parts is not None:
            fed = [s for _, s in st.parts if isinstance(s, SteadyFeedback)]
        # Error feedback: the residuals are still the views it updates.
        if fed and (self.feedback is None or not all(self.feedback.shared(s.token) for s in fed)):
            return None
        if st.epoch != self.assignment.epoch(self.step):
            return None
        return st

    def run_steady(
        self,
        index: int,
        st: Settled,
        x: torch.Tensor,
        defer: bool = False,
        moved: bool | None = None,
    ) -> Callable[[], None] | None:
        """Average one bucket along its :class:`Steady` path (the same bits as :meth:`bucket`).

        Launches per bucket sent as one chunk: the maxima (two: zeros, then the
        kernel), the encode, the owner's step (two_phase) and the decode, around
        the MAX all-reduce and the route's collectives; per further chunk three.
        Every kind that agrees a vector (:class:`Steady`, :class:`SteadyAgreedBlocks`,
        :class:`SteadyFeedback`) writes its part of it, MAX-all-reduces it, then
        finishes on it (:meth:`_finish_steady`).

        With Promote, ``moved``: whether a format moved this step, decided already
        (:meth:`promote_early`); None decides here, from the rates the last step agreed
        where it did, else from those this step's MAX all-reduce agrees (:meth:`promoted`).
        """
        if isinstance(st, Steady) and st.fp32_mean:
            transports.fp32_mean(x, self.comm.group, self.comm.world_size, self.traffic)
            return None
        if st.promote is not None and moved is None:
            moved = self.promote_early(index, st)
        if not self.run_head(st, x):  # every rank's own block exponents: nothing agreed
            if isinstance(st, SteadyGroups):
                return self.run_rest(index, st, x)
            return self._run_steady_blocks(index, st, x, defer)  # type: ignore[arg-type]
        if st.promote is None:
            return self.run_rest(index, st, x, defer)
        # No blocks here: Promote needs layers.
        if moved if moved is not None else self.promoted(st):
            # A bucket of several formats defers nothing (error feedback's values carried).
            tail = self.move(index, st, x, defer and not isinstance(st, SteadyGroups))
        else:
            tail = self.run_rest(index, st, x, defer)
        if tail is None:
            self.agree_rates(index)
            return None
        return functools.partial(_then, tail, functools.partial(self.agree_rates, index))

    def run_head(self, st: Settled, x: torch.Tensor) -> bool:
        """:meth:`run_steady` up to its MAX all-reduce, the vector agreed; False where the
        bucket agrees none (every rank's own block exponents: only bound here). Promote's
        host read (:meth:`promoted`), where the last step agreed no rates, sits between
        it and :meth:`run_rest`."""
        if isinstance(st, SteadyGroups):
            return self._agree_groups(st, x)
        if st.bound_ptr != x.data_ptr():  # a bfloat16 bucket's float32 copy: new each step
            self._bind(st, x)
        if isinstance(st, SteadyBlocks):
            return False
        if st.measured:  # CPU only: the numpy view of the chunk's slot, no tensor op
            st.vector.numpy()[-1] = self._offer(st, st.route if isinstance(st, Steady) else st.main)
        st.write_vector(x)
        transports.all_reduce_max(st.vector, self.comm.group, self.traffic)
        return True

    def run_rest(
        self, index: int, st: Settled, x: torch.Tensor, defer: bool = False
    ) -> Callable[[], None] | None:
        """:meth:`run_steady` after :meth:`run_head`, on the vector it agreed (no format
        moved): the factors, records, rates and the route's bound chunks."""
        if isinstance(st, SteadyGroups):
            chunk = st.chunk
            if st.measured and st.blocks and not (st.feedback or st.agreed_blocks):
                chunk = st.plan.agreed_chunk or st.plan.model_chunk  # agreed on the exchange
            elif st.measured:  # the ranks' largest preference, agreed on the vector
                chunk = 2 ** int(st.maxima.numpy()[-1])
            self._finish_groups(index, st, x, chunk)
            return None
        return self._finish_steady(index, st, x, defer)  # type: ignore[arg-type]  # agreed

    def _finish_steady(
        self,
        index: int,
        st: Steady | SteadyAgreedBlocks | SteadyFeedback,
        x: torch.Tensor,
        defer: bool = False,
        rates: tuple[torch.Tensor | None, np.ndarray | None] = (None, None),
        factors: Callable[[], object] | None = None,
    ) -> Callable[[], None] | None:
        """:meth:`run_steady`'s half after the MAX all-reduce, on the vector it agreed (the
        maxima or keys, Promote's rates, the chunk where measured): the chunk agreed, the
        factors, the records, this rank's rates and the route's bound chunks. Also a
        format group's of a :class:`SteadyGroups` (:meth:`_run_parts`), on its values
        ``x``: ``rates``, where Promote's rates of its layers go and where in it
        (:attr:`SteadyGroups.rates_at`); ``factors``, the call that picks its agreed maxima
        and makes its factors (:attr:`SteadyGroups.factors`)."""
        if isinstance(st, Steady) and st.route == Route.FP32:  # Promote's: the rates stay
            return self._finish_fp32(index, st, x)
        if st.measured:
            chunk = 2 ** int(st.vector.numpy()[-1])  # the ranks' largest preference
            if chunk != st.chunk:
                self._rechunk(index, st, x, chunk)
            self.bucket_chunks[index] = chunk
        (factors or st.fill_factors)()
        out, at = rates
        counted = False  # a format group's records count its Promote rates too
        counts = None  # this step's records' counts (Triton's), which Promote's rates reuse
        if st.names is not None:  # before the decode (the owner's mean) overwrites the values
            if isinstance(st, SteadyAgreedBlocks):  # each block's counts under its agreed key
                assert st.records_call is not None  # made by bind
                self._add_rows(index, st, st.records_call, x.device)
            elif isinstance(st, SteadyFeedback):
                counts = self.record_feedback(index, st, x)
            else:
                counts = self.record_steady(index, st, x, out, at)
                counted = out is not None
        if not counted and (out is not None or st.promote is not None):
            self._settled_rates(st, x, out, at, counts)
        # Error feedback's not deferred: one workspace slot serves every bucket (:meth:`bucket`).
        defer = defer and not isinstance(st, SteadyFeedback)
        return self._exchange(st, defer)

    def _exchange(
        self,
        st: _Part,
        defer: bool = False,
        offer: int = 0,
        on_chunk: Callable[[int], None] | None = None,
    ) -> Callable[[], None] | None:
        """``st``'s bound chunks around its route's collectives, whichever settled kind bound
        them: with ``st.groups`` the staged routes' four, else the native sum's or
        two_phase's (``offer``, ``on_chunk``: those of
        :func:`aps_comm.transports.two_phase_bound`; ``defer``: the last ones left on the
        wire, their finishing function returned); timed for its plan where measured."""
        g, calls, groups, traffic = st.group, st.calls, st.groups, self.traffic
        assert calls is not None  # made by the binding
        start, group = time.perf_counter(), self.comm.group
        if groups is not None:
            tail = transports.two_phase_bound(calls, groups.inter, traffic, defer, groups=groups)
        elif g.reduction == Route.ALLREDUCE:  # the bound calls read the factors, written already
            tail = transports.native(calls, g.fmt, group, traffic, defer)
        else:
            tail = transports.two_phase_bound(calls, group, traffic, defer, offer, on_chunk)
        if st.measured:
            st.plan.timed(time.perf_counter() - start)
        return tail

    def _offer(
        self, st: Steady | SteadyBlocks | SteadyAgreedBlocks | SteadyGroups, route: Route
    ) -> int:
        """Log2 of the chunk this rank prefers for ``st``'s bucket on ``route``, sized by its
        measured exchange: the model is asked again only when that time moves."""
        exchange_s = st.plan.exchange_s or None
        if st.offer is None or st.offer[0] != exchange_s:
            mine = self.planner.chunk(self.settings.fmt, st.numel, route, exchange_s)
            st.offer = exchange_s, int(math.log2(mine))  # a power of two
        return int(st.offer[1])

    def _bind(self, st: _Part, x: torch.Tensor) -> bool:
        """Bind ``st`` (again) to the float32 buffer ``x``, with its kind's arguments."""
        if isinstance(st, Steady):
            return st.bind(x, self.comm.world_size)
        return st.bind(x, self.comm.rank, self.comm.world_size)  # type: ignore[union-attr]

    def _rechunk(
        self,
        index: int,
        st: Steady | SteadyBlocks | SteadyAgreedBlocks,
        x: torch.Tensor,
        chunk: int,
    ) -> None:
        """The ranks agreed another chunk than ``st`` was bound to: its group planned for
        ``chunk`` (:meth:`_regroup`) and bound again, on the workspace's epoch after the
        binding."""
        st.group, st.chunk = self._regroup(st, chunk)[0], chunk
        self._bind(st, x)
        st.workspace = self._epoch(index, x.device)

    def _regroup(
        self, st: Steady | SteadyBlocks | SteadyAgreedBlocks | SteadyGroups, chunk: int
    ) -> list[GroupPlan]:
        """``st``'s groups planned again for the ``chunk`` its ranks agreed on, with the
        block exponents they were bound with (:meth:`BucketPlan.group`'s: each rank's own
        for :class:`SteadyBlocks`, the owners' for the other kinds with blocks)."""
        if isinstance(st, SteadyGroups):
            blocks, rank_exponents = st.blocks, st.blocks and not st.agreed_blocks
        else:
            blocks, rank_exponents = st.group.blocks is not None, isinstance(st, SteadyBlocks)
        comm, plan, size = self.comm, st.plan, self.settings.block_size if blocks else None
        routes, layouts = self._routes_for(plan, st.fmts), comm.node_layouts()
        exps = {"owner_exponents": blocks, "rank_exponents": rank_exponents}
        return plan.group(st.fmts, routes, comm.world_size, chunk, layouts, size, **exps)

    def _finish_fp32(self, index: int, st: Steady, x: torch.Tensor) -> None:
        """:meth:`_finish_steady` of a bucket sent in FP32 under Promote, after the MAX
        all-reduce that carried its maxima, rates and chunk: the chunk agreed kept, the
        values averaged."""
        if st.measured:  # the ranks' largest preference
            st.chunk = self.bucket_chunks[index] = 2 ** int(st.maxima.numpy()[-1])
        start = time.perf_counter()
        transports.fp32_mean(x, self.comm.group, self.comm.world_size, self.traffic)
        if st.measured:
            st.plan.timed(time.perf_counter() - start)

    def move(
        self, index: int, st: Settled, x: torch.Tensor, defer: bool
    ) -> Callable[[], None] | None:
        """Promote moved a layer's format of settled bucket ``index``: the new formats bound
        first (no collective, :meth:`_bind_first`) and the step finished on their bound
        path from the vector just agreed (:meth:`_resume`). With error feedback the
        residuals are in ``x`` already: the new binding does not add them again.
        """
        assert st.promote is not None and st.maxima is not None
        del self.steady[index]
        layers = st.promote
        measured = not isinstance(st, SteadyFeedback) and st.measured
        # Error feedback sends one chunk, whatever is asked.
        fixed = not isinstance(st, SteadyFeedback) and not measured
        chunk = st.chunk if fixed else None  # type: ignore[union-attr]
        plan = self.plan(index, layers[1], x.device)
        self._moving = st.maxima  # the new binding's vector, where it is of the same size
        try:
            new = self._bind_first(index, x, plan, layers, chunk, added=True)
        finally:
            self._moving = None
        carried = False
        if isinstance(st, SteadyGroups) and st.feedback and st.scatter is not None:
            # The values, their residuals added, are in the old binding's scratch: into the
            # new one's in one call where it has scratch, else into the bucket.
            carried = isinstance(new, SteadyGroups) and new.feedback and new.scatter is not None
            if carried:
                _carry(st, new)  # type: ignore[arg-type]  # a SteadyGroups
            else:
                st.scatter()
        if new is None:
            raise RuntimeError(f"bucket {index}: Promote's new formats have no bound path")
        assert not isinstance(new, SteadyBlocks | SteadyAgreedBlocks)  # Promote has no blocks
        assert new.maxima is not None  # with Promote, the maxima and rates
        if new.maxima is not st.maxima:
            # The agreed maxima into the new vector (the same order, whatever the kind);
            # its rates are the binding's.
            n = len(layers[1])
            new.maxima[:n].copy_(st.maxima[:n])
            if measured:  # the chunk agreed (CPU only: the numpy views, no tensor op)
                new.maxima.numpy()[-1] = st.maxima.numpy()[-1]
        return self._resume(index, new, x, defer, carried)

    def _vector(self, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A settled bucket's MAX all-reduce vector, zeros; on Promote's move (:meth:`move`)
        the moving binding's own where it has this size: every kind lays it out alike (the
        layers' maxima and rates in bucket order, then the chunk), so the new binding
        resumes from the maxima and chunk just agreed with no copy (its rates are bound
        from the reducer's, as on a copy). Taken once: one binding owns it."""
        old, self._moving = self._moving, None
        if old is not None and old.numel() == size and old.dtype == dtype and old.device == device:
            return old
        return torch.zeros(size, dtype=dtype, device=device)

    def _resume(
        self,
        index: int,
        st: Steady | SteadyFeedback | SteadyGroups,
        x: torch.Tensor,
        defer: bool,
        carried: bool = False,
    ) -> Callable[[], None] | None:
        """:meth:`run_steady` from after its MAX all-reduce, ``st``'s vector agreed already
        (error feedback: the residuals added; groups: gathered into the plan's order, or with
        ``carried`` in ``st``'s scratch already)."""
        if isinstance(st, SteadyGroups) and st.feedback:
            if not carried and not st.fused and st.gather is not None:
                st.gather()
            elif not carried and st.scatter is not None:  # the fused gather adds them again
                _gather_back(st.scatter)
            self._run_parts(index, st, early=True)
            return None
        if isinstance(st, SteadyGroups) and st.gather is None and st.scatter is not None:
            _gather_back(st.scatter)  # the maxima call gathers
        return self.run_rest(index, st, x, defer)

    def record_steady(
        self,
        index: int,
        st: Steady,
        x: torch.Tensor,
        rates: torch.Tensor | None = None,
        at: np.ndarray | None = None,
    ) -> torch.Tensor | None:
        """Queue a settled bucket's records (``stats=True``); their layers' nonzero and
        underflowing counts where a bound records call wrote them (Triton's: Promote's
        rates reuse them), else None.

        Once the maxima are agreed (and their factors made), every layer's
        exponent (staged routes: the first level's), agreed maximum (before
        bucket scaling's spread) and counts (:func:`aps_comm.telemetry.layer_counts`)
        over this rank's values ``x``: on the CPU kernels one kernel call from
        the factors' exponent keys; elsewhere a fixed handful of device ops
        over the whole bucket (the exponent rule, then the counts' segment
        sums), whatever the layer count. Nothing is read on the host. ``rates``:
        Promote's rates of the same values too (:meth:`_settled_rates`' ``out`` and
        ``at``), on the CPU kernels from the records' own counts, in their call.
        """
        g, agreed = st.group, st.agreed
        assert st.names is not None
        if st.records_call is not None:
            # Agreed block keys: each block's counts under its inner (first-level) key;
            # else Triton's of the layers (Promote's rates apart).
            rows = self._add_rows(index, st, st.records_call, x.device)
            if rates is not None:
                self._settled_rates(st, x, rates, at, rows[:, 2:4])
            return rows[:, 2:4]
        amax = agreed.maxima if st.raw is None else st.raw
        keys = st.host_factors[2] if st.host_factors is not None else None
        if isinstance(st, SteadyStaged) and st.record_keys is not None:
            keys = st.first_factors()[1]
        if keys is not None and x.is_contiguous():
            records = functools.partial(g.codec.layer_records, x, g.layout, amax, keys)
            self._add_rows(index, st, functools.partial(records, rates=rates, at=at), x.device)
            return None
        exps = self._steady_exponents(st)
        counts = layer_counts(x, g.layout.lengths, exps, g.fmt)
        self.stats.add(index, st.names, g.numels, g.fmt, exps, amax, counts)
        if rates is not None:
            self._settled_rates(st, x, rates, at, counts[:, :2])
        return None

    def _steady_exponents(self, st: Steady | SteadyFeedback) -> torch.Tensor:
        """A settled bucket's exponents off the CPU kernels, which its records and Promote's
        rates count under: :func:`aps_comm.scaling.factors`' of the agreed maxima (spread:
        the layer rule of them is the bucket rule; staged routes: the first level's; error
        feedback's: its route's rule, a native sum's too, sent so)."""
        if isinstance(st, SteadyFeedback):
            g, scaling = st.group, self.settings.scaling
            route, n = Route(g.reduction), self.comm.world_size
            return factors(st.shared, g.fmt, route, world_size=n, scaling=scaling).exponents
        return factors(
            st.agreed.maxima,
            st.group.fmt,
            st.route,
            world_size=self.comm.world_size,
            scaling=Scaling.NONE if st.agreed.none else Scaling.LAYER,
            ranks_per_node=st.per_node if isinstance(st, SteadyStaged) else 1,
        ).exponents

    def steady_block_keys(self, index: int, st: SteadyBlocks, x: torch.Tensor) -> None:
        """The keys' bound call with every rank's own block exponents, then (``stats=True``)
        :meth:`record_steady` of this rank's own keys, before anything is sent: each
        block's counts under its own key, folded per layer
        (:func:`aps_comm.telemetry.per_layer`); on the CPU kernels in the keys' call."""
        g = st.group
        assert st.keys_call is not None and g.blocks is not None  # made by bind
        if st.names is None:
            st.keys_call()
            return
        if g.codec.backend == "kernels" and x.is_contiguous() and x.dtype == torch.float32:
            records = st.keys_call  # cpu_kernels.block_keys' records too
            self._add_rows(index, st, records, x.device)  # type: ignore[arg-type]
            return
        st.keys_call()
        if st.records_call is not None:  # this rank's own keys and block maxima, just written
            self._add_rows(index, st, st.records_call, x.device)
            return
        exps = key_exponents(st.keys)
        counts = layer_counts(x, g.layout.lengths, exps, g.fmt)
        counts, smallest, largest = per_layer(g.blocks, counts, exps, blocks_amax(x, g.layout))
        self.stats.add(index, st.names, g.numels, g.fmt, smallest, largest, counts)

    def record_feedback(
        self, index: int, st: SteadyFeedback, x: torch.Tensor
    ) -> torch.Tensor | None:
        """:meth:`record_steady` with error feedback: the records of this rank's values
        ``x`` with its residuals added, under two_phase's factors of the agreed maxima
        (per block: the agreed keys, folded per layer with this rank's block maxima). One
        kernel call on the CPU kernels, a fixed handful of tensor ops elsewhere, whatever
        the layer count; nothing read on the host."""
        g = st.group
        assert st.names is not None and g is not None
        fmt, route, n = g.fmt, Route(g.reduction), self.comm.world_size
        if st.records_call is not None:  # bound: Triton's counts are Promote's too
            return self._add_rows(index, st, st.records_call, x.device)[:, 2:4]
        if g.blocks is None:
            exps = self._steady_exponents(st)
            counts, amax = layer_counts(x, g.layout.lengths, exps, fmt), st.shared
        else:
            assert st.local is not None
            keyed = factors_from_keys(
                st.shared[None], fmt, route, world_size=n, counts=g.blocks.device_counts
            )
            counts = layer_counts(x, g.layout.lengths, keyed.exponents, fmt)
            counts, exps, amax = per_layer(g.blocks, counts, keyed.exponents, st.local)
        self.stats.add(index, st.names, g.numels, fmt, exps, amax, counts)
        return None

    def _add_rows(
        self,
        index: int,
        st: Steady | SteadyBlocks | SteadyFeedback | SteadyAgreedBlocks,
        records: Callable[[torch.Tensor], object],
        device: torch.device,
    ) -> torch.Tensor:
        """Queue ``st``'s records as the float64 rows (one per layer: exponent, maximum,
        counts) that ``records`` writes on ``device`` (the codec's records calls); the
        rows."""
        g = st.group
        assert st.names is not None and g is not None
        rows = torch.empty(len(st.names), 5, dtype=torch.float64, device=device)
        records(rows)
        self.stats.add_rows(index, st.names, g.numels, g.fmt, rows)
        return rows

    def promoted(self, st: Settled) -> bool:
        """Promote's step from the rates just agreed on the maxima; whether a format of the
        bucket moved (only this bucket's layers move here).

        Promote picks formats on the host: one read of the agreed rates per
        bucket (none on the CPU, where they are host memory already). On a GPU
        that read waits for this step's MAX all-reduce, so for the backward's
        kernels queued before it: :meth:`promote_early` waits for none.
        """
        assert st.promote is not None and st.maxima is not None
        n = len(st.fmts)
        return self._promote_step(st, st.maxima[n : 2 * n])

    def _promote_step(self, st: Settled, agreed: torch.Tensor) -> bool:
        """Promote's step of ``st``'s layers from ``agreed`` (their rates, agreed by the
        ranks); whether a format moved."""
        assert st.promote is not None
        values = agreed.numpy() if agreed.device.type == "cpu" else agreed.cpu().numpy()
        # The formats are looked up only where a level moved (the host's step per bucket).
        moved = self.assignment.promote_step(st.promote[0], values)
        return moved and self.assignment.formats(st.promote[0], self.step) != st.fmts

    def agree_rates(self, index: int) -> None:
        """Promote: the rates that settled bucket ``index``'s next MAX all-reduce sends,
        agreed now (a copy of them MAX-all-reduced) and copied to the host
        (:meth:`keep_rates`), so that its next step decides before its own collectives
        (:meth:`promote_early`); on NCCL only, unless :attr:`early_rates` says.

        That all-reduce agrees them again, to the same values (the ranks'
        largest): nothing but the step the host reads them in changes.
        """
        st = self.steady.get(index)
        if st is None or st.promote is None or st.maxima is None:
            return
        early = self.early_rates
        if not (early if early is not None else self.comm.backend == "nccl"):
            return
        n = len(st.fmts)
        kept = self.agreed_rates.get(index)
        if kept is None or kept.rates.shape[0] != n or kept.rates.device != st.maxima.device:
            kept = self.agreed_rates[index] = AgreedRates(st, torch.empty_like(st.maxima[:n]))
        kept.bound = st  # a move's new binding: the same layers, the same buffer
        if isinstance(st, SteadyGroups) and (st.feedback or st.agreed_blocks) and st.put_rates:
            st.put_rates()  # into bucket order, as its head does (the others' finish did)
        slots = st.maxima[n : 2 * n]
        if slots.device.type == "cpu":
            kept.rates.numpy()[:] = slots.numpy()  # host memory: no tensor op
        else:
            kept.rates.copy_(slots)
        transports.all_reduce_max(kept.rates, self.comm.group, self.traffic)
        # Captured into a CUDA graph: its replay's caller copies them.
        if kept.rates.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            self.keep_rates(index)

    def keep_rates(self, index: int) -> None:
        """The rates :meth:`agree_rates` agreed, on their way to the host (on CUDA a copy
        to pinned memory and an event: no wait); the next :meth:`promote_early` reads
        them."""
        kept = self.agreed_rates.get(index)
        if kept is None:
            return
        if kept.host is None:
            kept.host = HostValue(kept.rates)
        else:
            kept.host.refresh(kept.rates)
        kept.fresh = True

    def promote_early(self, index: int, st: Settled) -> bool | None:
        """Promote's step from the rates settled bucket ``index`` agreed at the end of its
        last step (:meth:`agree_rates`); whether a format moved; None where there are
        none (a first step on ``st``: :meth:`promoted` decides after its head).

        Read once. On a GPU the host waits only for the last step's copy, long
        done: nothing of this step's backward drains, and the bucket's whole
        step replays as one graph.
        """
        kept = self.agreed_rates.get(index)
        if kept is None or kept.bound is not st or not kept.fresh:
            return None
        assert kept.host is not None
        kept.fresh = False
        return self._promote_step(st, kept.host.result())

    def _settled_rates(
        self,
        st: Steady | SteadyFeedback,
        x: torch.Tensor,
        out: torch.Tensor | None = None,
        at: np.ndarray | None = None,
        counts: torch.Tensor | None = None,
    ) -> None:
        """Promote: this rank's underflow rate of every layer under this step's factors
        (staged routes: the first level's; error feedback's: of ``x`` with its residuals
        added), into the slots the next step's maxima all-reduce sends (``out``:
        elsewhere than ``st``'s own slots, a format group's; ``at``: its layers' slots in
        ``out``, else the first). One kernel call on the CPU kernels, else a few
        whole-bucket tensor ops; ``counts``: the layers' nonzero and underflowing counts
        under those factors that this step's records already made (not counted again)."""
        g, n, scale = st.group, len(st.fmts), None
        out = st.maxima[n : 2 * n] if out is None else out  # type: ignore[index]  # Promote's
        if isinstance(st, SteadyStaged) and st.record_keys is not None:
            scale = st.first_factors()[0]
        elif g.codec.backend == "kernels" and x.dtype == torch.float32:  # this step's factors
            fed = isinstance(st, SteadyFeedback)
            scale = st.scale.numpy() if fed else st.host_factors[0]  # type: ignore[union-attr]
        if scale is not None:
            g.codec.underflow_rates(x, g.layout, scale, out, at)
            return
        if counts is None:
            counts = self._rates_counts(st, x)
        # float32 counts (the layers' nonzero and underflowing), one conversion of both
        nonzero, under = counts[:, :2].float().unbind(1)
        if at is None:
            torch.div(under, nonzero.clamp_(min=1), out=out)
        else:
            out.index_copy_(0, torch.from_numpy(at), under / nonzero.clamp_(min=1))

    def _rates_counts(self, st: Steady | SteadyFeedback, x: torch.Tensor) -> torch.Tensor:
        """The layers' nonzero and underflowing counts of ``x`` under this step's factors,
        off the CPU kernels: Triton's records call (three launches, bound once per
        binding), else the tensor ops."""
        g = st.group
        key = (x.data_ptr(), id(g))
        if st.rates_key != key:
            st.rates_call, st.rates_key = self._bind_rates(st, x), key
        if st.rates_call is not None:
            rows = torch.empty(len(st.fmts), 5, dtype=torch.float64, device=x.device)
            st.rates_call(rows)
            return rows[:, 2:4]
        return layer_counts(x, g.layout.lengths, self._steady_exponents(st), g.fmt)

    def _bind_rates(
        self, st: Steady | SteadyFeedback, x: torch.Tensor
    ) -> Callable[[torch.Tensor], None] | None:
        """Promote's counts of a settled layer bucket on Triton, bound: the records' call
        (:meth:`aps_comm.codec.Codec.bind_layer_records`) under the route's rule of the
        agreed maxima (staged routes: the first level's exponents in the factor rows);
        None (tensor ops) off Triton, and for bucket scaling off the staged routes."""
        g, scaling = st.group, self.settings.scaling
        if isinstance(st, SteadyStaged):  # the first level's exponents, from its rows
            if st.factors is None or st.local is not None:
                return None
            return g.codec.bind_staged_records(x, g.layout, st.factors, st.agreed.maxima)
        if scaling == Scaling.BUCKET:
            return None
        if isinstance(st, SteadyFeedback):  # its records' call (Promote refuses blocks)
            return self._feedback_records(g, x, st.shared, st.local, st.keys)
        return g.codec.bind_layer_records(x, g.layout, st.agreed, st.agreed.maxima)

    def _run_steady_blocks(
        self, index: int, st: SteadyBlocks, x: torch.Tensor, defer: bool
    ) -> Callable[[], None] | None:
        """:meth:`run_steady` with every rank's own block exponents: one call for the keys,
        three per chunk (two_phase; hierarchical and grid a fixed handful)."""
        plan, settings = st.plan, self.settings
        self.steady_block_keys(index, st, x)  # and their records
        offer, on_chunk = 0, None
        # Staged: the chunk is the model's (the route offers none); only the timing is kept.
        if st.measured and st.groups is None:
            route = Route.TWO_PHASE
            if not plan.model_chunk:
                plan.model_chunk = self.planner.chunk(settings.fmt, st.numel, route)
            chunk = plan.agreed_chunk or plan.model_chunk
            if chunk != st.chunk:
                self._rechunk(index, st, x, chunk)
            offer, on_chunk = self._offer(st, route), functools.partial(_agree_chunk, plan)
        self.bucket_chunks[index] = st.chunk
        return self._exchange(st, defer, offer, on_chunk)

    def _routes_for(self, plan: BucketPlan, fmts: Sequence[FloatFormat]) -> dict:
        """Each format's route in this bucket: as configured, or the model's choice."""
        if self.settings.reduction != Reduction.AUTO:
            return self._fixed
        key = tuple(fmts)
        chosen = plan.reductions.get(key)
        if chosen is None:
            chosen = {}
            for fmt in dict.fromkeys(fmts):
                sizes = [n for n, f in zip(plan.numels, fmts, strict=True) if f == fmt]
                native = native_sum_supported(fmt, self.comm.backend, plan.device)
                chosen[fmt] = (
                    Route.FP32
                    if fmt == FP32
                    else self.planner.reduction(fmt, sum(sizes), len(sizes), native)
                )
            plan.reductions[key] = chosen
        return chosen

    # -- one FSDP2 unit ----------------------------------------------------------

    def unit(
        self,
        index: int,
        rows: torch.Tensor,
        chunks: Sequence[int],
        numels: Sequence[int],
        names: Sequence[str],
        *,
        step: int,
        problem: torch.Tensor,
    ) -> torch.Tensor:
        """Reduce-scatter one FSDP unit: the sum over ranks of this rank's row (float32).

        The first call binds the unit's layout (:class:`SteadyMixedUnit`, or
        :class:`SteadyFP32Unit` where every parameter goes in FP32); later
        calls of that layout and policy epoch run bound, whatever buffer
        ``rows`` is: a fixed handful of calls, the same bits.

        Args:
            index: the unit's index.
            rows: the reduce-scatter input as N rows (float32); row r holds
                every parameter's padded r-th chunk, in order.
            chunks: each parameter's padded chunk (elements per row).
            numels: each parameter's size (for the records).
            names: each parameter's name.
            step: the step number (Schedule).
            problem: a 0-d float32 flag on the rows' device, 1 where this
                rank's input did not fit the unit (it then sends zeros);
                the maximum over ranks is written back into it, and a
                flagged unit comes back NaN on every rank.

        Returns:
            The sum over ranks of this rank's row (FSDP divides afterwards).
        """
        settings = self.settings
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            # aps_comm.fsdp hands contiguous float32 rows (it casts FSDP's reduce dtype).
            raise ValueError(
                f"a unit's rows must be contiguous float32, got {rows.dtype} with strides "
                f"{rows.stride()}"
            )
        st = self._steady_unit(index, rows, chunks, step)
        # Bound first, then run bound: the first call's bits are the same. A unit that
        # cannot bind is not tried again until its layout or epoch changes.
        tried = (rows.numel(), tuple(chunks), rows.device, self.assignment.epoch(step))
        if st is None and self._unbound_units.get(index) != tried:
            self._bind_unit(index, rows, chunks, (names, numels), step)
            st = self._steady_unit(index, rows, chunks, step)
            if st is None:
                self._unbound_units[index] = tried
        if isinstance(st, SteadyMixedUnit):
            return self._run_mixed_unit(index, st, rows, problem)
        if isinstance(st, SteadyFP32Unit):
            return self._run_fp32_unit(index, st, rows, problem)
        raise RuntimeError(
            f"unit {index}: no bound path for {settings} in formats "
            f"{[f.name for f in self.assignment.formats(names, step)]} on {rows.device}"
        )

    def _bind_unit(
        self,
        index: int,
        rows: torch.Tensor,
        chunks: Sequence[int],
        params: tuple[Sequence[str], Sequence[int]],
        step: int,
    ) -> None:
        """Bind the unit's layout and formats before its first run: every parameter in FP32
        (:meth:`_settle_fp32_unit`), else scaled formats, beside FP32 ones or not
        (:meth:`_settle_mixed_unit`); ``params``: each parameter's name and size."""
        n, settings, device = self.comm.world_size, self.settings, rows.device
        plan = self.plan(index, list(chunks) * n, device)
        fmts = self.assignment.formats(params[0], step)
        size = settings.block_size if settings.scaling == Scaling.BLOCK else None
        runs = plan.runs(fmts, n, size)
        self.steady_units.pop(index, None)
        key = (tuple(chunks), rows.numel(), device, self.assignment.epoch(step))
        bind: Callable[..., _Unit | None] = functools.partial(self._settle_mixed_unit, plan)
        if len(runs.runs) == 1 and runs.runs[0].fmt == FP32:
            bind = functools.partial(self._settle_fp32_unit, plan.layout)
        # A unit of one run cuts everything rewritten every step from the state's workspace,
        # the slot alternating with the unit's index (a unit may be on the wire beside the
        # next); one of several runs keeps its own (its padded rows' zeros are written once).
        ws, slot = self.workspace(device), Slot.of(index)
        while True:  # again where the slot grew: every view cut from its new region
            arena = ws.arena(slot)
            st = bind(arena, runs, rows, key, params)
            if st is None or arena.close():
                break
        if st is not None:
            if len(runs.runs) == 1:
                st.workspace = ws.epoch(slot)
            self.steady_units[index] = st
            plan.row_runs = {}  # the binding's scratch: the plan's row runs dropped

    def _steady_unit(
        self, index: int, rows: torch.Tensor, chunks: Sequence[int], step: int
    ) -> _Unit | None:
        """The unit's binding where this call fits the layout and formats it was bound to
        (any buffer of that layout: FSDP allocates a new one every step)."""
        st = self.steady_units.get(index)
        if (
            st is None
            or st.numel != rows.numel()
            or st.device != rows.device
            or st.chunks != tuple(chunks)
            or st.epoch != self.assignment.epoch(step)
            or (st.workspace and st.workspace != self.workspace(st.device).epoch(Slot.of(index)))
        ):
            return None
        return st

    def _settle_fp32_unit(
        self,
        layout: Layout,
        arena: Arena,
        runs: RowRuns,
        rows: torch.Tensor,
        key: _UnitKey,
        params: tuple[Sequence[str], Sequence[int]],
    ) -> SteadyFP32Unit:
        """The unit's :class:`SteadyFP32Unit` (every parameter in FP32), on any codec
        backend, its scratch cut from ``arena``: no codec codes its rows; with
        ``stats=True`` its records bound too, over ``layout`` (the N rows' chunks: one
        kernel call on the CPU kernels, a fixed handful of torch ops elsewhere)."""
        n, device, p = self.comm.world_size, rows.device, len(key[0])
        # The sum is the same whatever the format: any kernels codec's (one call), else
        # the torch ops of whichever codec (the sum reads no format).
        sums = codec.codec_for(self.settings.fmt, device)
        if sums.backend != "kernels":
            sums = codec.codec_for(_SUM_FORMAT, device)
        recv = arena.take(n * runs.row_numel, torch.float32).view(n, runs.row_numel)
        f32 = {"dtype": torch.float32, "device": device}
        st = SteadyFP32Unit(*key, sums, recv, torch.tensor(math.nan, **f32))
        if self.settings.stats:  # the parameters' chunks, whatever the scaling (not blocks)
            st.layout, st.shared = layout, torch.zeros(p + 1, **f32)
            st.local, st.agreed = arena.take(n * p, torch.float32), arena.take(n * p, torch.float32)
            keyed = (np.zeros(n * p, np.int32), [])  # every key 0 (exponent 0)
            shape = (n, self.settings.scaling)
            st.record, st.labels = _unit_records(
                sums, runs, params, layout, st.agreed, keyed, shape
            )
        return st

    def _settle_mixed_unit(
        self,
        plan: BucketPlan,
        arena: Arena,
        runs: RowRuns,
        rows: torch.Tensor,
        key: _UnitKey,
        params: tuple[Sequence[str], Sequence[int]],
    ) -> SteadyMixedUnit | None:
        """The unit's :class:`SteadyMixedUnit` (scaled formats, beside FP32 ones or not; any
        scaling; with ``stats=True`` its records bound too; every run's rows whole bytes).
        A unit of one run cuts its scratch from ``arena`` and needs no spans
        (:func:`_unit_buffers`); with block scaling its keys are its codec's fused ones
        (:meth:`_bind_one_format_blocks`). On the torch codec backends the same buffers and
        spans, each kernel call torch ops. None where its formats' codecs differ in
        backend, or one format's block keys have no fused call."""
        settings, n, (chunks, _, device, _) = self.settings, self.comm.world_size, key
        scaled = list(dict.fromkeys(r.fmt for r in runs.runs if r.fmt != FP32))
        codecs = [codec.codec_for(f, device) for f in scaled]
        single = len(runs.runs) == 1
        blocked = settings.scaling == Scaling.BLOCK and not single
        kernels = bool(codecs) and codecs[0].backend == "kernels"
        # Every format on the CPU kernels, or none (the torch ops): the calls bound below
        # follow the first codec's backend.
        if not scaled or any((c.backend == "kernels") != kernels for c in codecs):
            return None
        p, own = len(chunks), arena if single else None
        lay = _mixed_layout(runs, scaled, n)
        staged, coded, landing, values, spans, buffers, send, pad = _unit_buffers(
            runs, lay, n, own, device
        )
        f32 = {"dtype": torch.float32, "device": device}
        # With records, every row's agreed maxima follow (the N x P rows' order): the
        # records read them before any spread, from the one index_select.
        perm = lay.perm + list(range(p)) * n if settings.stats else lay.perm
        agreed = _take(own, len(perm), torch.float32, device)
        # One run's parameters' maxima are every row's (the torch ops write them once).
        maxima = agreed[:p] if single and not kernels else torch.empty(p, **f32)
        sums = np.array(lay.sums, np.int64).reshape(-1, 7)
        calls: list[tuple[Callable[[], object], Callable[..., object], Callable[[], object]]] = []
        spreads, keys, layouts = [], [], []
        factors_of: tuple[torch.Tensor, ...] = ()
        shape = (n, settings.block_size)
        blocks = _MixedBlocks(lay, chunks, scaled, shape, device) if blocked else None
        for f, (c, (e0, e1), (s0, s1), (c0, c1)) in enumerate(
            zip(codecs, lay.elements, lay.segments, lay.codes, strict=True)
        ):
            # Its runs' segments (chunks, or blocks) run by run, row by row.
            sizes = [s for run in runs.runs if run.fmt == scaled[f] for s in _row_segments(run, n)]
            whole = single and runs.runs[0].packed_rows  # one run's rows as they are: its own
            layouts.append(runs.runs[0].rows_layout if whole else Layout.from_numels(sizes, device))
            if blocks is not None:  # per block of each segment: the factors' one call writes them
                b0, b1 = blocks.bounds[f], blocks.bounds[f + 1]
                scale, unscale, made = blocks.scale[b0:b1], blocks.decode[b0:b1], _no_factors
            elif settings.scaling == Scaling.BLOCK:  # one format: written by its keyed calls
                segments = layouts[f].n_segments
                scale, unscale, dec = (_take(own, segments, torch.float32, device) for _ in "sud")
                made, factors_of = _no_factors, (scale, unscale, dec)
            else:
                # No scaling: a scale of 1 written once, so kept out of the shared region.
                none = settings.scaling == Scaling.NONE
                scale = _take(None if none else own, s1 - s0, torch.float32, device)
                unscale = _take(own, s1 - s0, torch.float32, device)
                mine = np.zeros(s1 - s0, np.int32) if settings.stats and kernels else None
                if mine is not None:  # the records' keys: this format's, at their rows' places
                    keys.append((mine, np.array(lay.rows[s0:s1]) * p + lay.perm[s0:s1]))
                # One run without scaling: its unscale NaN for a non-finite maximum.
                pick = None if single and none else (maxima, lay.perm[s0:s1])
                scaling = settings.scaling
                made = _unit_factors(c, agreed[s0:s1], n, scale, unscale, mine, scaling, pick)
                if scaling == Scaling.BUCKET and mine is None:
                    spreads.append(AgreedMaxima(agreed[s0:s1], n))
            encode: Callable[..., object] = functools.partial(
                c.encode, out=coded[c0:c1], scale=scale, layout=layouts[f]
            )  # one run: from the step's rows (FSDP hands new ones)
            if staged is not None:
                encode = c.bind_encode(staged[e0:e1], coded[c0:c1], scale, layouts[f])
            dec = factors_of[2] if factors_of else unscale
            decode = c.bind_decode(landing[c0:c1], values[e0:e1], dec, layouts[f])
            calls.append((made, encode, decode))
        if settings.scaling == Scaling.NONE and not single:  # every run NaN where its maximum
            sums[:, 5] = 1  # is not finite, in the sum (the unscale stays 1): as FP32's runs
        st = SteadyMixedUnit(
            *key,
            codecs[0],
            plan.layout,
            torch.zeros(p + 1, **f32),
            _take(own, factors_of[0].numel() if factors_of else n * p, torch.float32, device),
            maxima,
            to_device(torch.tensor(perm, dtype=torch.long), device),
            agreed,
            torch.tensor(math.inf, **f32),
            spreads,
            calls,
            spans,
            buffers,
            send,
            values,
            sums,
            runs.row_numel,
            pad=pad,
        )
        st.offsets_of = (st.layout.offsets.numpy(), np.array(perm, np.int64))
        x = rows.reshape(-1) if pad is None else pad[0].view(-1)
        bound = (plan, layouts[0], blocks, keys, factors_of, x)
        return self._bind_unit_scaling(st, runs, params, bound)

    def _bind_unit_scaling(
        self,
        st: SteadyMixedUnit,
        runs: RowRuns,
        params: tuple[Sequence[str], Sequence[int]],
        bound: tuple[Any, ...],
    ) -> SteadyMixedUnit | None:
        """Bind a :class:`SteadyMixedUnit`'s block keys and factors (block scaling) and, with
        ``stats=True``, its records. ``bound``: its plan, its first format's layout of the
        N rows (one run: its rows', padded or not), several formats' blocks
        (:class:`_MixedBlocks`), each scaled format's records' keys, one format's block
        factors (scale, unscale, decode) and the rows it binds its keys over. None where
        one format's block keys have no fused call."""
        settings, n, p = self.settings, self.comm.world_size, len(st.chunks)
        plan, layout, blocks, keys, factors_of, x = bound
        # One run's records read its rows as encoded (padded or not), several runs' the
        # N rows' chunks; every row's maxima before any spread, under the keys the factors
        # leave (each scaled format's moved to its rows' places; FP32's 0).
        on: Layout | Blocks = st.layout if st.spans is not None else layout
        seen, keyed = st.agreed[st.agreed.numel() - n * p :], (np.zeros(n * p, np.int32), keys)
        pick = None
        if blocks is not None:
            on, pick = self._bind_mixed_blocks(st, blocks, plan)
        elif settings.scaling == Scaling.BLOCK:
            one = self._bind_one_format_blocks(st, runs.runs[0], layout, factors_of, x)
            if one is None:
                return None  # no fused keys for this backend or format
            on = one
        if isinstance(on, Blocks):  # every block under its agreed key and this rank's maxima
            seen, keyed = st.local, (st.shared[:-1], [])
        if settings.stats:
            shape = (n, settings.scaling)
            st.record, st.labels = _unit_records(
                st.codec, runs, params, on, seen, keyed, shape, pick
            )
        return st

    def _bind_one_format_blocks(
        self,
        st: SteadyMixedUnit,
        run: Run,
        layout: Layout,
        factors_of: tuple[torch.Tensor, ...],
        x: torch.Tensor,
    ) -> Blocks | None:
        """One format's block keys and factors in a :class:`SteadyMixedUnit` of one run: its
        codec's fused keys (:meth:`aps_comm.codec.Codec.bind_block_keys`, bound over a
        step's rows, as FSDP hands new ones; bound first over ``x``), the factors of the
        agreed keys into ``factors_of`` (scale, unscale) and the decode's factor of every
        segment of the N received rows: this rank's row's blocks N times (its third).
        Returns the N rows' blocks (over ``layout``, the rows padded or not), None where
        the codec has no fused keys for the format."""
        n, c, device = self.comm.world_size, st.codec, st.device
        scale, unscale, decode = factors_of
        blocks = run.rows_blocks
        assert blocks is not None
        blocks = dataclasses.replace(blocks, layout=layout)  # a padded run's, where padded
        st.shared = torch.zeros(layout.n_segments + 1, dtype=torch.uint8, device=device)
        flags = torch.empty(len(blocks.counts), dtype=torch.uint8, device=device)
        block_keys = functools.partial(
            c.bind_block_keys,
            layout=blocks.layout,
            counts=blocks.counts,
            maxima=st.local,
            keys=st.shared[:-1],
            flags=flags,
            world_size=n,
            device_counts=blocks.device_counts,
        )
        if block_keys(x) is None:
            return None
        made = c.bind_feedback_factors(st.shared[:-1], n, scale, unscale, blocks.device_counts)
        made = c.bind_key_factors(st.shared[:-1], blocks.counts, (scale, None, unscale), 1, made)
        st.poison = torch.tensor(math.nan, dtype=torch.float32, device=device)
        st.keyed = (
            functools.partial(_fused_block_keys, block_keys),
            functools.partial(
                _one_format_decode, made, unscale, decode, st.shared, st.poison, (n, self.comm.rank)
            ),
        )
        return blocks

    def _bind_mixed_blocks(
        self, st: SteadyMixedUnit, blocks: _MixedBlocks, plan: BucketPlan
    ) -> tuple[Blocks, torch.Tensor | None]:
        """Bind a :class:`SteadyMixedUnit`'s block keys and factors (block scaling): one
        kernel call each on the CPU kernels, torch ops on the torch codec backends
        (:func:`_mixed_block_keys`, :func:`_mixed_block_factors`). Returns the N rows'
        blocks and, on the torch backends, each block's place among every format's counts
        (FP32's last): what its records read (:func:`_unit_records`)."""
        n, p, device = self.comm.world_size, len(st.chunks), st.device
        grid = plan.grid(self.settings.block_size)
        n_blocks = grid.layout.n_segments
        st.shared = torch.zeros(n_blocks + 1, dtype=torch.uint8, device=device)
        st.local = torch.empty(n_blocks, dtype=torch.float32, device=device)
        at, mine = blocks.picks(self.comm.rank)
        if st.codec.backend == "kernels":
            offsets, fmts = grid.layout.offsets.numpy(), blocks.fmt_of
            keys = (offsets, fmts, blocks.formats, EXPONENT_LIMIT, n, st.local, st.shared[:-1])
            factors_of = (
                st.shared[:-1],
                blocks.param_of,
                st.shared[-1:],
                (at, mine),
                blocks.scale.numpy(),
                blocks.decode.numpy(),
                st.maxima.numpy(),
                np.empty(p, np.uint8),
            )
            st.keyed = (
                functools.partial(_unit_kernel_after, "unit_keys", keys),
                functools.partial(cpu_kernels.call, "unit_block_factors", *factors_of),
            )
            return grid, None
        # Per block, its place among every format's keys (or counts), FP32's last: int64,
        # as int8 indexes times the blocks overflowed past 127 blocks.
        fmt_of = np.where(blocks.fmt_of < 0, len(blocks.formats), blocks.fmt_of).astype(np.int64)
        pick = to_device(torch.from_numpy(fmt_of * n_blocks + np.arange(n_blocks)), device)
        pos, src, param_of = (
            to_device(torch.from_numpy(a), device) for a in (at, mine, blocks.param_of[at])
        )
        keyed = (grid.layout, [*blocks.formats, FP32], pick, n, st.local, st.shared[:-1])
        factors_of = (st.shared, grid.device_counts, (pos, src, param_of), (n, p))
        st.keyed = (
            functools.partial(_mixed_block_keys, *keyed),
            functools.partial(_mixed_block_factors, *factors_of, blocks, st.maxima, st.poison),
        )
        return grid, pick

    def _run_mixed_unit(
        self, index: int, st: SteadyMixedUnit, rows: torch.Tensor, problem: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`unit` along its :class:`SteadyMixedUnit`: per step, whatever the number of
        parameters and runs, the maxima or block keys, the flag in and out of the one MAX
        all-reduce, the factors, the encode, the ``all_to_all_single``, the decode and the
        FP32 sum in rank order (spans around them where there are several runs)."""
        comm, c, x = self.comm, st.codec, rows.reshape(-1)
        n, shared, k = comm.world_size, st.shared, st.shared.numel() - 1
        arena, coded, recv, landing = st.buffers
        encoded = x
        if st.pad is not None:  # every row followed by a zero: its codes whole bytes
            torch.cat([rows, st.pad[1]], 1, out=st.pad[0])
            encoded = st.pad[0].view(-1)
        if st.keyed is not None:  # block scaling: every block's key, the flag beside them
            st.keyed[0](x if st.spans is not None else encoded)
            self._agree_unit(shared, problem)
            st.keyed[1]()
        elif c.backend == "kernels":
            # The flag rides on the maxima, so no rank needs a host read to learn it.
            cpu_kernels.call("unit_maxima", x, st.offsets_of[0], n, st.local, shared, problem)
            transports.all_reduce_max(shared, comm.group, self.traffic)
            # A flagged unit is NaN on every rank: its maxima all non-finite.
            cpu_kernels.call("unit_agreed", shared, problem, st.offsets_of[1], st.maxima, st.agreed)
        else:  # the same on the torch ops
            self._agree_unit(shared, problem, (c, x, st.layout, st.local))
            if st.spans is None:  # one run: every row's maxima are the parameters'
                agreed = st.agreed.view(-1, k)
                torch.where(problem > 0, st.poison, shared[:k].expand_as(agreed), out=agreed)
            else:
                torch.where(problem > 0, st.poison, shared[:k], out=st.maxima)
                torch.index_select(st.maxima, 0, st.perm, out=st.agreed)
        for spread in st.spreads:
            spread.spread()
        if st.spans is not None:
            c.copy_spans(rows, arena, st.spans[0])
        step_rows = (encoded,) if st.spans is None else ()  # one run: straight into the send buffer
        for made, encode, _ in st.calls:
            made()
            encode(*step_rows)
        self._add_records(index, st, encoded)
        if st.spans is not None:
            c.copy_spans(coded, arena, st.spans[1])
        transports.rows_exchange(st.send, recv, comm.group, self.traffic)
        if st.spans is not None:
            c.copy_spans(recv, landing, st.spans[2])
        for _, _, decode in st.calls:
            decode()
        out = torch.empty(st.row_numel, dtype=torch.float32, device=rows.device)
        lengths = st.layout.lengths[: len(st.chunks)]  # the torch ops' spread of the maxima
        offsets = st.offsets_of[0][: len(st.chunks) + 1]  # the chunks' bounds in a row
        return c.sum_runs(st.values, out, st.sums, n, offsets, st.maxima, lengths)

    def _run_fp32_unit(
        self, index: int, st: SteadyFP32Unit, rows: torch.Tensor, problem: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`unit` along its :class:`SteadyFP32Unit`: PyTorch's reduce-scatter of the
        rows, summed in rank order, and the flag."""
        comm, n = self.comm, self.comm.world_size
        if st.shared is not None and st.layout is not None and st.record is not None:
            p = st.shared.numel() - 1
            self._agree_unit(st.shared, problem, (st.sums, rows.reshape(-1), st.layout, st.local))
            st.agreed.view(n, p).copy_(st.shared[:p].expand(n, p))
            self._add_records(index, st, rows.reshape(-1))
        else:  # the flag alone: one float, in place
            transports.all_reduce_max(problem.view(1), comm.group, self.traffic)
        transports.rows_exchange(
            rows.view(torch.uint8), st.recv.view(torch.uint8), comm.group, self.traffic
        )
        out = torch.empty(st.recv.shape[1], dtype=torch.float32, device=rows.device)
        st.sums.sum_rows(st.recv, out)
        # A flagged unit is NaN on every rank.
        return torch.where(problem > 0, st.nan, out, out=out)

    def _add_records(self, index: int, st: _Unit, x: torch.Tensor) -> None:
        """With ``stats=True``, queue a unit's records from its N rows ``x``: one group,
        each parameter labelled with its own format."""
        if st.record is not None and st.labels is not None:
            self.stats.add_rows(index, *st.labels, st.record(x))

    def _agree_unit(
        self,
        shared: torch.Tensor,
        problem: torch.Tensor,
        maxima: tuple[codec.Codec, torch.Tensor, Layout, torch.Tensor] | None = None,
    ) -> None:
        """A unit's one MAX all-reduce of ``shared``: its maxima or block keys, then the flag
        ``problem``, which rides on them so that no rank needs a host read to learn it, and
        which gets the agreed flag. ``maxima`` (codec, the N rows, their chunks, scratch):
        each row's maximum of every chunk first, then their maximum over the rows."""
        k = shared.numel() - 1
        if maxima is not None:
            c, x, layout, local = maxima
            c.layer_maxima(x, layout, local)
            torch.amax(local.view(self.comm.world_size, k), 0, out=shared[:k])
        shared[k:].copy_(problem.reshape(1))
        transports.all_reduce_max(shared, self.comm.group, self.traffic)
        problem.copy_(shared[k])

    # -- the step ---------------------------------------------------------------------

    def end_step(self) -> tuple[dict[str, int], StepStats]:
        """The step's bytes per collective and records; the next step starts empty."""
        stats, self.stats = self.stats, StepStats()
        stats.keep()  # on the stream of the step's last bucket, after every replay
        self.step += 1
        return self.traffic.take(), stats


# The format of the codec whose kernels sum an FP32 unit's rows (the sum is format-free).
_SUM_FORMAT = "e4m3"

# What a unit's binding is bound to: its chunks, its rows' size and device, its policy epoch.
_UnitKey = tuple[tuple[int, ...], int, torch.device, tuple[int, ...]]


def _feedback_encode(
    g: GroupPlan,
    x: torch.Tensor,
    send: torch.Tensor,
    factors: tuple[torch.Tensor, torch.Tensor],
    pad: int,
    kept: tuple[torch.Tensor, torch.Tensor],
    fused: bool,
) -> Callable[[], object]:
    """Error feedback's bound encode of group ``g``'s values ``x`` (one chunk) into
    ``send``, then what that lost into the residuals (``kept``: float32 scratch of the
    values as sent, the residuals): one CPU kernel call where ``fused``
    (:meth:`aps_comm.codec.Codec.bind_encode_keep`), else the encode and
    :meth:`aps_comm.codec.Codec.bind_keep_lost`."""
    (scale, unscale), (sent, residual), c = factors, kept, g.codec
    if fused:  # the whole layout: the chunk's window's factors, element for element
        call = c.bind_encode_keep(x, send, (scale, unscale), g.layout, sent, residual)
        if call is not None:
            return call
    head = send[: payload_nbytes(x.numel(), g.fmt)]
    encode = c.bind_encode(x, send, scale, g.windows[0], pad)
    return functools.partial(
        codec.in_order, [encode, c.bind_keep_lost(head, x, sent, unscale, g.layout, residual)]
    )


def _feedback_calls(
    g: GroupPlan,
    x: torch.Tensor,
    world_size: int,
    scaling: Scaling,
    agreed: tuple[torch.Tensor | None, torch.Tensor],
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pick: tuple[np.ndarray, np.ndarray, bool] | None,
) -> tuple[Callable[[], object] | None, Callable[[], object], np.ndarray | None]:
    """Error feedback's agreement and factors of group ``g``'s values ``x``, bound: one
    kernel call each on the CPU kernels and (the layers' maxima but bucket scaling's)
    Triton, tensor ops elsewhere.

    Args:
        agreed: this rank's block maxima (None without blocks), and the vector the layer
            maxima or block keys are agreed in.
        out: the scale, the inverse ``2**-e`` the residuals are kept under and the
            decode's unscale (two_phase's inverse is its unscale, one tensor).
        pick: as :meth:`aps_comm.codec.Codec.bind_feedback_factors`' (layer maxima).

    Returns:
        The call writing this rank's maxima or block keys under the route's rule (None
        where the codec cannot bind it), the one writing ``out`` from the agreed ones,
        and the CPU kernels' int32 exponent keys of the layers, which that call leaves
        for the records (else None).
    """
    (maxima, shared), (scale, _, unscale), c = agreed, out, g.codec
    native, blocks, keys = g.reduction == Route.ALLREDUCE, g.blocks, None
    if blocks is not None and native:
        assert maxima is not None
        return *_native_block_calls(g, x, world_size, (maxima, shared), out), None
    if blocks is not None:
        assert maxima is not None
        flags = torch.empty(len(g.numels), dtype=torch.uint8, device=x.device)
        args = (x, g.layout, blocks.counts, maxima, shared, flags, world_size)
        agree = c.bind_block_keys(*args, device_counts=blocks.device_counts)
    else:
        agree = c.bind_layer_maxima(x, g.layout, shared)
        if c.backend == "kernels" and x.device.type == "cpu":
            keys = np.empty(g.layout.n_segments, np.int32)
    if native:
        return agree, _native_factors(g, shared, world_size, out, scaling, keys, pick), keys
    counts = None if blocks is None else blocks.device_counts
    made = c.bind_feedback_factors(shared, world_size, scale, unscale, counts, keys, pick, scaling)
    if blocks is not None:
        made = c.bind_key_factors(shared, blocks.counts, (scale, None, unscale), 1, made)
    return agree, made, keys


def _native_block_calls(
    g: GroupPlan,
    x: torch.Tensor,
    world_size: int,
    agreed: tuple[torch.Tensor, torch.Tensor],
    out: tuple[torch.Tensor, ...],
) -> tuple[Callable[[], object], Callable[[], object]]:
    """The native sum's block calls of group ``g``'s values ``x``, bound: the one writing
    this rank's maxima and keys of every block under the native sum's rule into
    ``agreed``, and the one writing the agreed keys' factors into ``out``
    (:func:`_native_factors`). One kernel call each on the CPU kernels and one launch
    each on Triton, tensor ops elsewhere."""
    made = _native_factors(g, agreed[1], world_size, out)
    if g.codec.backend == "kernels":
        grid = g.layout.cells if g.layout.cells is not None else g.layout.offsets.numpy()
        args = (g.fmt, x, grid, *agreed, EXPONENT_LIMIT, world_size)
        return functools.partial(cpu_kernels.call, "native_block_keys", *args), made
    args = (x, g.layout, g.fmt, Route.ALLREDUCE, world_size, agreed)
    ops = functools.partial(block_keys_into, *args)
    return g.codec.bind_native_block_keys(x, g.layout, agreed, world_size, ops), made


def _native_factors(
    g: GroupPlan,
    agreed: torch.Tensor,
    world_size: int,
    out: tuple[torch.Tensor, ...],
    scaling: Scaling = Scaling.BLOCK,
    keys: np.ndarray | None = None,
    pick: tuple[np.ndarray, np.ndarray, bool] | None = None,
) -> Callable[[], object]:
    """The native sum's factors of group ``g``'s agreed block keys (with blocks) or layer
    maxima ``agreed``, bound: written into ``out``, per segment ``2**e`` and ``2**-e / N``,
    with error feedback the inverse ``2**-e`` between them. One kernel call on the CPU
    kernels (the layers' through int32 ``keys``, picked from a bucket's maxima with
    ``pick``: as :func:`_feedback_calls`'), one launch on Triton (the layers' maxima but
    bucket scaling's: :meth:`aps_comm.codec.Codec.bind_agreed_factors`), tensor ops
    elsewhere."""
    blocks, fmt, (scale, *inverse, unscale) = g.blocks, g.fmt, out
    if blocks is not None and g.codec.backend == "kernels":
        args = (agreed, blocks.counts, scale, unscale, world_size, *inverse)
        return functools.partial(cpu_kernels.call, "native_block_factors", *args)
    if blocks is None and keys is not None:  # the CPU kernels
        return functools.partial(
            cpu_kernels.call,
            "native_factors_into",
            agreed.numpy(),
            fmt,
            world_size,
            0 if scaling == Scaling.NONE else EXPONENT_LIMIT,
            scaling == Scaling.BUCKET,
            tuple(o.numpy() for o in out),
            keys,
            None if pick is None else pick[:2],
        )
    if blocks is not None:
        made = functools.partial(
            factors_from_keys,
            agreed[None],
            fmt,
            Route.ALLREDUCE,
            world_size=world_size,
            counts=blocks.device_counts,
        )
    else:
        made = functools.partial(
            factors, agreed, fmt, Route.ALLREDUCE, world_size=world_size, scaling=scaling
        )
    fields = ("scale", "inverse", "unscale") if inverse else ("scale", "unscale")
    ops = functools.partial(codec.factors_into, made, out, fields)
    if blocks is not None:
        into = (scale, *(inverse or [None]), unscale)
        return g.codec.bind_key_factors(agreed, blocks.counts, into, world_size, ops)
    if scaling == Scaling.BUCKET:
        return ops
    agreed_maxima = AgreedMaxima(agreed, world_size, True, scaling == Scaling.NONE)
    return g.codec.bind_agreed_factors(agreed_maxima, (scale, *(inverse or [None]), unscale), ops)


def _node_groups(layouts: Layouts, route: Route | str, per_node: int) -> dict[str, Any]:
    """A staged route's fields of :class:`SteadyStaged` and :class:`SteadyNodeBlocks`: this
    rank's intra- and inter-node groups of ``route``, and ``per_node``."""
    return {"groups": layouts.grid if route == Route.GRID else layouts.nodes, "per_node": per_node}


def _rank_blocks(
    plan: BucketPlan,
    g: GroupPlan,
    x: torch.Tensor,
    fmts: list[FloatFormat],
    chunking: tuple[bool, int],
    scratch: Sequence[torch.Tensor],
    names: list[str | None] | None,
    where: tuple[Layouts, tuple[int, ...]],
    ranks: tuple[int, int],
    gather: tuple[torch.Tensor, np.ndarray, torch.Tensor, int] | None = None,
) -> SteadyBlocks | None:
    """Group ``g``'s :class:`SteadyBlocks` (with ``g.node_blocks``: a
    :class:`SteadyNodeBlocks` on its route's groups), bound to its values ``x``; None where
    the codec has no bound keys for them. ``chunking``: measured, and the chunk;
    ``scratch``: its block maxima and keys; ``where``: the state's node layouts and the
    policy's epoch; ``ranks``: this rank and N; ``gather``: the bucket's layers gathered
    into group order in its keys' call (:meth:`SteadyGroups._divided`)."""
    n_layers, device = len(g.numels), x.device
    staged: dict[str, Any] = {}
    if g.node_blocks is not None:
        staged = _node_groups(where[0], g.reduction, g.node_blocks.ranks_per_node)
    st = (SteadyNodeBlocks if staged else SteadyBlocks)(
        x.numel(),
        x.data_ptr(),
        plan,
        g,
        fmts,
        *chunking,
        *scratch,
        torch.empty(n_layers, dtype=torch.uint8, device=device),
        torch.zeros(n_layers, dtype=torch.uint8, device=device),
        names=names,
        epoch=where[1],
        **staged,
    )
    return st if st.bind(x, *ranks, gather) else None


def _own_blocks(g: GroupPlan) -> bool:
    """Whether group ``g`` goes in FP32, or by two_phase (or a staged route) with every
    rank's own block exponents (what a settled bucket of several formats binds with blocks)."""
    if g.reduction == Route.FP32 or g.node_blocks is not None:
        return True
    sh = g.block_shards
    return g.reduction == Route.TWO_PHASE and sh is not None and sh.rank_exponents


def _agree_chunk(plan: BucketPlan, log2: int) -> None:
    """The ranks' largest preferred chunk, from a first exchange: the bucket's next one."""
    if log2:
        plan.agreed_chunk = 2**log2


def _take(arena: Arena | None, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` elements of ``dtype`` from ``arena``, or an allocation of their own without one."""
    if arena is None:
        return torch.empty(n, dtype=dtype, device=device)
    return arena.take(n, dtype)


def _carry(old: SteadyGroups, new: SteadyGroups) -> None:
    """Promote's move of interleaved groups with error feedback: every layer's values (their
    residuals added) from ``old``'s scratch, in its plan's order, into ``new``'s, in its
    own: one call (what took ``old``'s scatter into the bucket and ``new``'s gather).

    Both scratches are the workspace's STEP slot (the same bytes): where every layer keeps
    its place nothing moves; where the order changed, a copy from one into the other would
    read what it has overwritten, so the values go through the bucket (the scatter and the
    plain gather: two calls).
    """
    assert isinstance(old.scatter, functools.partial) and isinstance(new.scatter, functools.partial)
    src, dst = list(old.scatter.args[1]), list(new.scatter.args[1])
    held = dict(zip([i for g in old.groups for i in g.index], src, strict=True))
    order = [i for g in new.groups for i in g.index]
    if all(d.data_ptr() == held[i].data_ptr() for d, i in zip(dst, order, strict=True)):
        return  # every layer where it was: nothing to move
    if _overlap(src, dst):
        old.scatter()
        _gather_back(new.scatter)
        return
    torch._foreach_copy_(dst, [held[i] for i in order])


def _overlap(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether any byte of the views ``a`` is a byte of the views ``b`` (contiguous views)."""

    def spans(views: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        return [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in views if t.numel()]

    theirs = spans(b)
    return any(lo < hi2 and lo2 < hi for lo, hi in spans(a) for lo2, hi2 in theirs)


def _gather_back(scatter: Callable[[], object]) -> None:
    """The layers copied into the plan's order by ``scatter`` reversed (a bound
    ``torch._foreach_copy_`` of the plan-order views into the layers): one call."""
    assert isinstance(scatter, functools.partial)
    layers, pieces = scatter.args
    torch._foreach_copy_(pieces, layers)


def _unit_factors(
    c: codec.Codec,
    agreed: torch.Tensor,
    world_size: int,
    scale: torch.Tensor,
    unscale: torch.Tensor,
    keys: np.ndarray | None,
    scaling: Scaling,
    pick: tuple[torch.Tensor, Sequence[int]] | None = None,
) -> Callable[[], object]:
    """A settled unit's factors of its agreed maxima, written into ``scale`` and ``unscale``;
    on the CPU kernels through int32 ``keys``, which its records then read.
    ``scaling="none"``: every exponent 0 (``scale`` 1 for good, ``keys`` left 0), the
    unscale 1, NaN for a non-finite maximum.

    ``pick``: a format of a :class:`SteadyMixedUnit`, the unit's maxima and, per segment,
    its parameter: with records and ``scaling="bucket"`` its maxima are picked out of them
    and spread in the factors' one kernel call, not a call of their own; with
    ``scaling="none"`` there are no factors at all: ``unscale`` 1 too, the sum making a
    parameter NaN where its maximum is not finite (what the NaN unscale did)."""
    if scaling == Scaling.NONE:
        scale.fill_(1.0)
        if pick is not None:
            unscale.fill_(1.0)
            return _no_factors
        one, nan = torch.ones_like(agreed[:1]), torch.full_like(agreed[:1], math.nan)
        return functools.partial(_finite_unscale, agreed, one, nan, unscale)
    spread = None
    if keys is not None and pick is not None and scaling == Scaling.BUCKET:
        spread = pick[0].numpy(), np.array(pick[1], np.int64), True
    return c.bind_feedback_factors(agreed, world_size, scale, unscale, keys=keys, pick=spread)


def _no_factors() -> None:
    """``scaling="none"``'s factors in a :class:`SteadyMixedUnit`: fixed when bound."""


def _finite_unscale(
    agreed: torch.Tensor, one: torch.Tensor, nan: torch.Tensor, unscale: torch.Tensor
) -> None:
    """``scaling="none"``'s unscale: 1 for a finite agreed maximum, else NaN (maxima are
    never negative, and NaN is not below inf: one comparison, not ``torch.isfinite``'s four)."""
    torch.where(agreed < math.inf, one, nan, out=unscale)


def _kernel_records(
    c: codec.Codec,
    layout: Layout,
    counts: np.ndarray,
    keys: tuple[torch.Tensor | np.ndarray, list[tuple[np.ndarray, np.ndarray]]],
    maxima: torch.Tensor,
    n: int,
    limits: tuple[np.ndarray, np.ndarray] | None,
    x: torch.Tensor,
) -> torch.Tensor:
    """A settled unit's records from its N rows ``x`` on the CPU kernels: float64 (P, 5),
    one kernel call over ``layout``'s segments (``counts`` per chunk: 1 with one exponent
    per parameter, its blocks with block scaling), the N rows folded per parameter.

    ``keys``: every segment's key (int32 exponent keys the factors write, or the agreed
    uint8 block keys), and in a unit of several formats each scaled format's exponent
    keys with their places among them, moved there first (FP32's stay 0: exponent 0).
    ``maxima``: the agreed maxima, or this rank's blocks'. ``limits``: each parameter's
    format bounds (:func:`aps_comm.cpu_kernels.record_limits`); None: the codec's."""
    every, moved = keys
    for mine, at in moved:
        every[at] = mine
    out = torch.empty(len(counts), 5, dtype=torch.float64, device=x.device)
    c.unit_records(x, layout, counts, every, maxima, n, out, limits)
    return out


def _unit_records(
    c: codec.Codec,
    runs: RowRuns,
    params: tuple[Sequence[str], Sequence[int]],
    on: Layout | Blocks,
    maxima: torch.Tensor,
    keyed: tuple[torch.Tensor | np.ndarray | None, list[tuple[np.ndarray, np.ndarray]]],
    shape: tuple[int, Scaling],
    pick: torch.Tensor | None = None,
) -> tuple[
    Callable[[torch.Tensor], torch.Tensor], tuple[list[str], list[int], tuple[FloatFormat, ...]]
]:
    """A settled unit's records, bound, and its parameters' names and sizes (``params``)
    and formats: they are queued as one group.

    The records: over the N rows' chunks (``on`` a :class:`~aps_comm.layout.Layout`: one
    exponent per parameter) or blocks (``on`` their :class:`~aps_comm.layout.Blocks`),
    each parameter under its own format; one kernel call on the CPU kernels
    (:func:`_kernel_records`), tensor ops on the torch backends
    (:func:`_torch_layer_records`, :func:`_torch_block_records`).

    Args:
        maxima: per chunk of every row (N x P) the agreed maxima, or this rank's max |x|
            of every block.
        keyed: as :func:`_kernel_records`' ``keys``: every segment's int32 exponent keys
            (the factors write them) or uint8 agreed block keys, and each scaled format's
            keys with their places among them (several formats).
        shape: N and the scaling.
        pick: several formats' blocks on the torch backends: each block's place among
            every format's counts (:func:`_torch_block_records`).
    """
    formats = [run.fmt for run in runs.runs for _ in run.index]
    parts = (list(params[0]), list(params[1]), tuple(formats))
    p, n, blocks = len(formats), shape[0], on if isinstance(on, Blocks) else None
    layout = on.layout if isinstance(on, Blocks) else on
    if c.backend == "kernels":
        counts = np.ones(p, np.int64) if blocks is None else blocks.counts[:p].numpy()
        args = (c, layout, counts, keyed, maxima, n, record_limits(formats))
        return functools.partial(_kernel_records, *args), parts
    if blocks is not None:  # several formats: under every one, FP32's last
        fmts = list(runs.by_format) + ([] if pick is None else [FP32])
        args = (blocks, fmts, pick, (keyed[0], maxima), n)
        return functools.partial(_torch_block_records, *args), parts
    if len(runs.runs) == 1 and formats[0] != FP32:  # one scaled format
        args = ([(formats[0], None)], None, layout, maxima[:p], shape)
    else:
        scaled, rows = list(runs.by_format.items()), _format_rows(runs, p, maxima.device)
        args = (scaled, rows, layout, maxima[:p], shape)
    return functools.partial(_torch_layer_records, *args), parts


def _torch_layer_records(
    formats: list[tuple[FloatFormat, torch.Tensor | None]],
    rows: torch.Tensor | None,
    layout: Layout,
    maxima: torch.Tensor,
    shape: tuple[int, Scaling],
    x: torch.Tensor,
) -> torch.Tensor:
    """:func:`_kernel_records` with one exponent per parameter on the torch backends:
    float64 (P, 5) from the N rows ``x`` and the P agreed ``maxima``.
    One format (``rows`` None): its exponents and counts. Several (``formats``: each scaled
    one's parameters): each one's exponents of its parameters' maxima (FP32's 0), the
    counts under every format (FP32 last) and each parameter's picked (``rows``:
    :func:`_format_rows`), folded over the rows."""
    (n, scaling), p = shape, maxima.numel()
    if rows is None:
        fmt = formats[0][0]
        exps = factors(maxima, fmt, Route.TWO_PHASE, world_size=n, scaling=scaling).exponents
        counts = layer_counts(x, layout.lengths, exps.repeat(n), fmt).view(n, p, 3).sum(0)
    else:
        exps = torch.zeros(p, dtype=torch.int32, device=x.device)
        for fmt, which in formats:
            f = factors(maxima[which], fmt, Route.TWO_PHASE, world_size=n, scaling=scaling)
            exps[which] = f.exponents
        every = exps.repeat(n)
        fmts = [fmt for fmt, _ in formats] + [FP32]
        counts = torch.cat(
            [layer_counts(x, layout.lengths, every, f).view(n, p, 3).sum(0) for f in fmts]
        ).index_select(0, rows)
    return torch.cat([exps.double()[:, None], maxima.double()[:, None], counts.double()], 1)


def _torch_block_records(
    grid: Blocks,
    formats: list[FloatFormat],
    pick: torch.Tensor | None,
    keyed: tuple[torch.Tensor, torch.Tensor],
    n: int,
    x: torch.Tensor,
) -> torch.Tensor:
    """:func:`_kernel_records` with block scaling on the torch backends: every block under
    its agreed key and this rank's block maximum (``keyed``), its counts under its format
    (several formats: under every one, FP32 last, each block's own picked at ``pick``),
    the N rows' chunks folded per parameter: float64 (P, 5)."""
    keys, maxima = keyed
    exps = key_exponents(keys)
    every = [layer_counts(x, grid.layout.lengths, exps, f) for f in formats]
    counts = every[0] if pick is None else torch.cat(every).index_select(0, pick)
    counts, first, largest = per_layer(grid, counts, exps, maxima)
    p = first.numel() // n
    return torch.cat(
        [
            first.view(n, p).amin(0).double()[:, None],
            largest.view(n, p).amax(0).double()[:, None],
            counts.view(n, p, 3).sum(0).double(),
        ],
        1,
    )


@dataclasses.dataclass
class _MixedLayout:
    """Where a unit of several formats puts each run's N rows (:meth:`Reducer._settle_mixed_unit`).

    Attributes:
        starts: per run, its first element in the values (each scaled format's runs in
            turn, then the FP32 runs; a run's N rows end to end).
        strides: per run, its rows' stride in the values: its width, one more for a
            4-bit run of an odd width (each row then padded by a zero, so that its codes
            are whole bytes: each row goes to its own rank).
        code_starts: per scaled run, its first byte in the codes.
        scaled_numel: elements of the scaled runs.
        coded: bytes of their codes.
        perm: for each scaled format's segments in turn (run by run, row by row), its parameter.
        rows: the same segments' rows.
        elements: per scaled format, its values' bounds.
        segments: per scaled format, its segments' bounds in ``perm``.
        codes: per scaled format, its codes' bounds.
        sums: per run: start, lo, hi, first and last parameter, 1 if FP32, stride.
        numel: elements of every run's values.
    """

    starts: dict[int, int]
    strides: dict[int, int]
    code_starts: dict[int, int]
    scaled_numel: int
    coded: int
    perm: list[int]
    rows: list[int]
    elements: list[tuple[int, int]]
    segments: list[tuple[int, int]]
    codes: list[tuple[int, int]]
    sums: list[tuple[int, ...]]
    numel: int = 0


def _mixed_layout(runs: RowRuns, scaled: list[FloatFormat], n: int) -> _MixedLayout:
    """A unit's :class:`_MixedLayout`: computed once, when it settles."""
    lay = _MixedLayout({}, {}, {}, 0, 0, [], [], [], [], [], [])
    for k, run in enumerate(runs.runs):
        lay.strides[k] = run.hi - run.lo + (not run.packed_rows)
    at = byte = 0
    for fmt in scaled:
        e0, s0, c0 = at, len(lay.perm), byte
        for k, run in enumerate(runs.runs):
            if run.fmt != fmt:
                continue
            lay.starts[k], lay.code_starts[k] = at, byte
            at += n * lay.strides[k]
            byte += n * (run.b1 - run.b0)
            for r in range(n):
                lay.perm += list(run.index)
                lay.rows += [r] * len(run.index)
        lay.elements.append((e0, at))
        lay.segments.append((s0, len(lay.perm)))
        lay.codes.append((c0, byte))
    lay.scaled_numel, lay.coded = at, byte
    for k, run in enumerate(runs.runs):
        if run.fmt == FP32:
            lay.starts[k] = at
            at += n * (run.hi - run.lo)
    lay.numel = at
    for k, run in enumerate(runs.runs):
        first, last = run.index[0], run.index[-1] + 1
        stride = lay.strides[k]
        lay.sums.append((lay.starts[k], run.lo, run.hi, first, last, int(run.fmt == FP32), stride))
    return lay


def _mixed_spans(
    runs: RowRuns, lay: _MixedLayout, n: int, staged_end: int, codes_end: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A :class:`SteadyMixedUnit`'s byte spans: the gather out of the rows into the arena
    (the scaled runs' values, then the send buffer at ``staged_end``), the scatter of
    the codes into the send buffer, and the gather out of the received rows into the
    landing (codes, then every run's values at ``codes_end``)."""
    row, row_bytes = runs.row_numel, runs.row_bytes
    gather, scatter, receive = [], [], []
    for k, run in enumerate(runs.runs):
        w, wb, start, stride = run.hi - run.lo, run.b1 - run.b0, lay.starts[k], lay.strides[k]
        for r in range(n):
            src, wire = 4 * (r * row + run.lo), r * row_bytes + run.b0
            if run.fmt == FP32:  # sent exactly: its float32 bytes are its codes
                gather.append((src, staged_end + wire, 4 * w))
                receive.append((wire, codes_end + 4 * (start + r * w), 4 * w))
            else:  # a padded row's zero is never written: the arena starts zeroed
                gather.append((src, 4 * (start + r * stride), 4 * w))
                scatter.append((lay.code_starts[k] + r * wb, staged_end + wire, wb))
                receive.append((wire, lay.code_starts[k] + r * wb, wb))
    g, s, r = (np.array(sp, np.int64).reshape(-1, 3) for sp in (gather, scatter, receive))
    return g, s, r


def _unit_buffers(
    runs: RowRuns, lay: _MixedLayout, n: int, arena: Arena | None, device: torch.device
) -> tuple[Any, ...]:
    """A :class:`SteadyMixedUnit`'s buffers: the encode's input (None: one run, encoded from
    the step's rows), the codes, the landing, every run's values, the spans (None for one
    run), its ``buffers``, the send buffer, and a 4-bit run's padded rows and zeros.

    Several runs (``arena`` None): one arena of their own, zeroed (a padded row's zero is
    never written): the scaled runs' float32 values, then the wire region, which holds
    the send buffer until it is sent and then the landing (codes, every run's values).
    One run, cut from ``arena`` (the state's workspace slot): its N rows' codes are the
    send buffer end to end (a 4-bit odd row copied beside a zero first, every row whole
    bytes: each goes to its own rank), decoded out of the received rows into values over
    the send buffer (sent before they are written): no spans."""
    send_bytes = n * runs.row_bytes
    if arena is not None:
        pad, stride = None, lay.strides[0]
        if not runs.runs[0].packed_rows:
            padded = arena.take(n * stride, torch.float32).view(n, stride)
            pad = (padded, torch.zeros(n, 1, dtype=torch.float32, device=device))
        scratch = arena.take(-(-max(send_bytes, 4 * lay.numel) // 4), torch.float32)
        send, recv = scratch.view(torch.uint8)[:send_bytes], arena.take(send_bytes)
        buffers = (scratch.view(torch.uint8), send, recv, recv)
        return None, send, recv, scratch[: lay.numel], None, buffers, send, pad
    staged_end, codes_end = 4 * lay.scaled_numel, -(-lay.coded // 4) * 4
    wire_end = max(-(-send_bytes // 4) * 4, codes_end + 4 * lay.numel)
    spans = _mixed_spans(runs, lay, n, staged_end, codes_end)
    u8 = {"dtype": torch.uint8, "device": device}
    own = torch.zeros(staged_end + wire_end, **u8)
    coded, recv = torch.empty(lay.coded, **u8), torch.empty(send_bytes, **u8)
    landing = own[staged_end:]
    staged, values = (
        own[:staged_end].view(torch.float32),
        landing[codes_end : codes_end + 4 * lay.numel].view(torch.float32),
    )
    buffers = (own, coded, recv, landing)
    return staged, coded, landing, values, spans, buffers, landing[:send_bytes], None


def _fused_block_keys(
    keys: Callable[[torch.Tensor], Callable[[], None] | None], x: torch.Tensor
) -> None:
    """One format's block keys of a step's rows ``x``: its codec's fused call, bound over
    them (:meth:`aps_comm.codec.Codec.bind_block_keys`; FSDP hands new rows every step)."""
    bound = keys(x)
    assert bound is not None  # as when it was bound
    bound()


def _one_format_decode(
    made: Callable[[], object],
    unscale: torch.Tensor,
    decode: torch.Tensor,
    shared: torch.Tensor,
    poison: torch.Tensor,
    rows: tuple[int, int],
) -> None:
    """One format's block factors from the agreed keys and flag (``shared``): ``made``
    writes every block's ``unscale`` of the N rows (``rows``: N and this rank), then
    ``decode`` this rank's row's N times, ``poison`` (NaN) for every block of a flagged
    unit."""
    (n, rank), flagged = rows, shared[-1] > 0
    made()
    # A parameter with a non-finite block in any row is NaN in every row (its blocks'
    # unscale in that row is NaN); every rank sends this rank its row.
    per_row = unscale.view(n, -1)
    bad = torch.any(per_row.isnan(), 0) | flagged
    torch.where(
        bad.expand_as(per_row),
        poison,
        per_row[rank].expand_as(per_row),
        out=decode.view_as(per_row),
    )


class _MixedBlocks:
    """Block scaling in a unit of several formats (:meth:`Reducer._settle_mixed_unit`):
    where each scaled format's encoded blocks (its runs, row by row, each chunk's
    blocks) are among the N rows' blocks (the unit's grid, row by row), and their
    factors' scratch.

    Attributes:
        formats: the scaled formats.
        fmt_of: int8 per block of the grid: its format's index, -1 for FP32.
        param_of: int64 per block of the grid: its parameter.
        bounds: per scaled format, its first encoded block; then their count.
        scale: float32, every scaled format's blocks' encode factors, format by format.
        decode: float32, the same blocks' decode factors.
    """

    def __init__(
        self,
        lay: _MixedLayout,
        chunks: Sequence[int],
        scaled: list[FloatFormat],
        shape: tuple[int, int],
        device: torch.device,
    ) -> None:
        n, size = shape
        p = len(chunks)
        counts = np.array([-(-c // size) for c in chunks] * n, np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._counts, self._lay, self._p = counts, lay, p
        fmt_index = np.full(p, -1, np.int8)
        for f, (s0, s1) in enumerate(lay.segments):
            fmt_index[lay.perm[s0:s1]] = f
        self.formats = scaled
        self.fmt_of = np.repeat(np.tile(fmt_index, n), counts)
        self.param_of = np.repeat(np.tile(np.arange(p, dtype=np.int64), n), counts)
        sizes = [int(counts[np.array(lay.perm[s0:s1], np.int64)].sum()) for s0, s1 in lay.segments]
        self.bounds = [0, *np.cumsum(sizes).tolist()]
        self.scale = torch.empty(self.bounds[-1], dtype=torch.float32, device=device)
        self.decode = torch.empty(self.bounds[-1], dtype=torch.float32, device=device)

    def picks(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Per encoded block, its block in the grid, and that of this rank's row."""
        pos, src = [], []
        first, counts, p = self._first, self._counts, self._p
        for row, param in zip(self._lay.rows, self._lay.perm, strict=True):
            at, mine = row * p + param, rank * p + param
            pos.append(np.arange(first[at], first[at] + counts[at]))
            src.append(np.arange(first[mine], first[mine] + counts[mine]))
        empty = np.zeros(0, np.int64)  # no encoded block: int64 all the same
        return np.concatenate([empty, *pos]), np.concatenate([empty, *src])


def _unit_kernel_after(name: str, args: tuple, x: torch.Tensor) -> None:
    """:func:`cpu_kernels.call` with the step's rows ``x`` first."""
    cpu_kernels.call(name, x, *args)


def _row_segments(run: Run, n: int) -> list[int]:
    """A run's segments (its chunks, or their blocks) in each of the N rows. A 4-bit run of
    an odd row (not ``packed_rows``) has each row followed by a zero, which joins the row's
    last segment: the segments stay the same (their factors), and one encode of the N
    padded rows writes every row's codes in whole bytes (each row goes to its own rank)."""
    sizes = list(run.rows_layout.sizes)
    if not run.packed_rows:
        per_row = len(sizes) // n
        for r in range(1, n + 1):
            sizes[r * per_row - 1] += 1
    return sizes


def _mixed_block_keys(
    layout: Layout,
    formats: list[FloatFormat],
    pick: torch.Tensor,
    n: int,
    maxima: torch.Tensor,
    keys: torch.Tensor,
    x: torch.Tensor,
) -> None:
    """A unit of several formats' block keys on the torch backends (the CPU kernels'
    ``unit_keys``): every block's max |x| into ``maxima``, its key under every format
    (FP32 last: 0, or 255 for a non-finite block), and
    each block's own picked into ``keys`` (``pick``: its format's index times the blocks,
    plus the block)."""
    maxima.copy_(blocks_amax(x, layout))
    every = [exponent_keys(maxima, f, Route.TWO_PHASE, world_size=n)[0] for f in formats[:-1]]
    every.append(torch.where(torch.isfinite(maxima), KEY_ZERO, KEY_BAD).to(torch.uint8))
    torch.index_select(torch.cat(every), 0, pick, out=keys)


def _mixed_block_factors(
    shared: torch.Tensor,
    counts: torch.Tensor,
    picks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    shape: tuple[int, int],
    blocks: _MixedBlocks,
    maxima: torch.Tensor,
    inf: torch.Tensor,
) -> None:
    """A unit of several formats' block factors from the agreed keys and flag (``shared``)
    on the torch backends (the CPU kernels' ``unit_block_factors``): per encoded block
    (``picks``: its block, this rank's row's, its parameter) ``2**e`` into
    ``blocks.scale`` and ``2**-e`` of this rank's row into ``blocks.decode``, NaN for
    every block of a parameter with a non-finite block in any row (or flagged), and per
    parameter ``maxima`` ``inf`` (0-d) where it is NaN so, else 0 (an FP32 run's NaN in
    the sum)."""
    (n, p), (pos, src, param_of) = shape, picks
    keys = shared[:-1]
    bad = torch.maximum(bad_layers(keys, counts).view(n, p).amax(0), shared[-1:])
    maxima.copy_(torch.where(bad > 0, inf, 0.0))
    torch.index_select(key_factors(keys, unscale=False), 0, pos, out=blocks.scale)
    unscale = key_factors(keys, unscale=True).index_select(0, src)
    blocks.decode.copy_(torch.where(bad.index_select(0, param_of) > 0, math.nan, unscale))


def _format_rows(runs: RowRuns, p: int, device: torch.device) -> torch.Tensor:
    """Per parameter, its row among :func:`_torch_layer_records`' counts: (its format's
    index, FP32 last, among ``runs.by_format``) * P + the parameter (int64, on ``device``)."""
    fp32 = len(runs.by_format)
    place = {fmt: f for f, fmt in enumerate(runs.by_format)}
    rows = list(range(p))
    for run in runs.runs:
        for i in run.index:
            rows[i] += place.get(run.fmt, fp32) * p
    return to_device(torch.tensor(rows, dtype=torch.long), device)
