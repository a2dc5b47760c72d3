"""A bucket's plan: everything about its layout that does not change between steps.

DDP hands the hook the same buckets every step (it re-buckets once, after its
first iteration), so the offsets, the format groups, the chunk bounds, the
per-chunk segment layouts and the scratch buffers are built once per layout
and reused: the per-step path does no per-layer Python work that a fused op
can do, and on CUDA it copies nothing from the host.

Example:
    >>> plan = BucketPlan.build(0, [300, 100], torch.device("cpu"))
    >>> [group] = plan.group(["e4m3", "e4m3"], {"e4m3": "two_phase"}, 4, chunk_elements=256)
    >>> group.chunks
    [(0, 256), (256, 400)]
    >>> groups = plan.group(["e4m3", "fp32"], {"e4m3": "two_phase"}, 4, chunk_elements=256)
    >>> [(g.fmt.name, g.reduction, g.chunks) for g in groups]  # one plan per format
    [('e4m3', <Route.TWO_PHASE: 'two_phase'>, [(0, 256), (256, 300)]), ('fp32', <Route.FP32: 'fp32'>, [(0, 100)])]
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence

import torch

from aps_comm.codec import Codec, codec_for
from aps_comm.config import DEFAULT_BLOCK_SIZE, BlockExponents, Route, Scaling
from aps_comm.formats import FP32, FloatFormat, get_format, payload_nbytes
from aps_comm.hostcopy import to_device
from aps_comm.layout import Blocks, Layout, index_dtype
from aps_comm.workspace import Arena, Slot, Workspace
from aps_perfmodel.cluster import Cluster
from aps_perfmodel.formats import FormatSpec
from aps_perfmodel.formats import get_format as model_spec
from aps_perfmodel.strategies import choose_strategy, strategy_chunk

__all__ = [
    "BucketPlan",
    "GroupPlan",
    "NodeBlocks",
    "NodePlan",
    "Planner",
    "block_chunks",
    "block_shard_cuts",
    "chunk_bounds",
    "model_format",
    "shard_layout",
]


def model_format(fmt: FloatFormat) -> str:
    """``fmt`` as :mod:`aps_perfmodel` names it (custom formats by their bit widths)."""
    if fmt.name in ("fp32", "fp16", "bf16"):
        return fmt.name
    return f"e{fmt.exp_bits}m{fmt.man_bits}"


@dataclasses.dataclass(frozen=True)
class Planner:
    """How the hook decides, per bucket, how to reduce it and in what chunks.

    Both decisions come from :mod:`aps_perfmodel.strategies`, the same
    functions the performance model predicts with, so the model predicts the
    hook as built. They depend only on the bucket's sizes and the cluster,
    so every rank decides the same.

    Attributes:
        cluster: what the hook plans with
            (:func:`aps_perfmodel.strategies.hook_cluster`: a calibrated
            profile, else defaults per backend).
        hierarchical: hierarchical two_phase is possible (several nodes of
            several ranks, groups created, no error feedback).
        grid: grid two_phase is possible (its groups were created).
        fp32: ``reduction="auto"`` may send a bucket as a plain FP32
            all-reduce where the model says nothing else is faster: on NCCL
            and with a calibrated profile, where the model knows the links;
            not on Gloo by default, where a 1 and a 100 Gbit/s link look alike.

    Example:
        >>> from aps_perfmodel.strategies import hook_cluster
        >>> p = Planner(hook_cluster("nccl", "cuda", 64, 8), hierarchical=True, fp32=True)
        >>> p.reduction(get_format("e4m3"), 25 * 2**18, 20, native=False)
        <Route.HIERARCHICAL: 'hierarchical'>
        >>> p.reduction(get_format("e4m3"), 1000, 2, native=False)
        <Route.FP32: 'fp32'>
    """

    cluster: Cluster
    hierarchical: bool
    fp32: bool
    grid: bool = False
    scaling: Scaling = Scaling.LAYER
    block_size: int = DEFAULT_BLOCK_SIZE
    block_exponents: BlockExponents = BlockExponents.RANK

    def spec(self, fmt: FloatFormat) -> str | FormatSpec:
        """``fmt`` as the model prices it: with block scaling, its exponent bytes and codec."""
        if self.scaling != Scaling.BLOCK or fmt == FP32:
            return model_format(fmt)
        return _block_spec(model_format(fmt), self.block_size, self.block_exponents)

    def reduction(self, fmt: FloatFormat, numel: int, n_layers: int, native: bool) -> Route:
        """The fastest way to reduce ``numel`` elements of ``fmt`` (a hook reduction name)."""
        best = choose_strategy(
            numel,
            n_layers,
            self.spec(fmt),
            self.cluster,
            native_ok=native,
            hierarchical_ok=self.hierarchical,
            grid_ok=self.grid,
            fp32_ok=self.fp32,
        )
        return Route.from_model(best)

    def chunk(
        self, fmt: FloatFormat, numel: int, reduction: str, exchange_s: float | None = None
    ) -> int:
        """Elements per chunk (:func:`aps_perfmodel.strategies.strategy_chunk`), a power of
        two at least as large: a chunk as large as the bucket is one chunk."""
        chunk = numel
        if reduction != Route.FP32 and numel > 1:
            strategy = Route(reduction).model_name
            chunk = strategy_chunk(numel, self.spec(fmt), self.cluster, strategy, exchange_s)
        return 2 ** math.ceil(math.log2(max(chunk, 1)))


@functools.lru_cache(maxsize=64)
def _block_spec(name: str, block_size: int, block_exponents: BlockExponents) -> FormatSpec:
    """The model's spec of ``name`` with block scaling (built once, not per bucket)."""
    return model_spec(
        name,
        aps=True,
        scaling=Scaling.BLOCK,
        block_size=block_size,
        block_exponents=block_exponents,
    )


def shard_layout(numel: int, fmt: FloatFormat, world_size: int) -> tuple[int, int]:
    """(elements per shard, bytes per shard) for two_phase, padding ``numel`` up.

    Shards hold whole bytes, so 4-bit formats use an even number of elements.

    Example:
        >>> shard_layout(10, get_format("e2m1"), 4)
        (4, 2)
    """
    per = -(-numel // world_size)
    if fmt.wire_bits == 4:
        per += per % 2
    return per, payload_nbytes(per, fmt)


def chunk_bounds(numel: int, chunk_elements: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` element ranges of at most ``chunk_elements`` (one empty range for 0).

    Example:
        >>> chunk_bounds(5, 2)
        [(0, 2), (2, 4), (4, 5)]
    """
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    if numel == 0:
        return [(0, 0)]
    return [(lo, min(lo + chunk_elements, numel)) for lo in range(0, numel, chunk_elements)]


@dataclasses.dataclass
class NodePlan:
    """How hierarchical two_phase cuts each chunk: slices per local rank, shards per node.

    Chunk c of n elements is cut into L slices of ``slices[c]`` elements (the
    last ones short or empty); local rank l owns slice l: it receives that
    slice from every rank of its node (FP32), sums them, encodes the sum and
    exchanges it in M shards with the ranks of local rank l on the other
    nodes. ``slices[c]`` is a multiple of M (of 2M for 4-bit formats), so
    shards and slices hold whole bytes and the gathered slices are the
    chunk's payload end to end.

    Attributes:
        ranks_per_node: L.
        nodes: M.
        local_rank: this rank's local rank.
        slices: per chunk, elements per slice (padded).
        splits: per chunk, the valid elements of each local rank's slice.
        node: this rank's node.
        shard_valid: per chunk, the valid elements of the shard this rank owns.
        slice_windows: per chunk, the segments of this rank's slice (its valid part).
        shard_windows: per chunk, the segments of its shard (its valid part).
        sum_regions: per chunk, this rank's range in ``sums`` (L x its slice).
        slice_regions: per chunk, its encoded slice's bytes in ``encoded`` (and
            the inter-node exchange's in the group plan's ``recv``).
        sums: scratch receiving the node's slices: float32, or with
            ``wire_first`` (grid) their encoded bytes, L x the padded slice.
        encoded: uint8 scratch for this rank's encoded slices.
        wire_first: the first level exchanges the wire format (grid), not FP32.
        factors: float32 (4, segments): the rows a settled bucket refills every step
            (scale, shift, unscale, first), cut with the buffers a deferred tail reads
            (its decode reads the unscale row); None where made by their user.
    """

    ranks_per_node: int
    nodes: int
    local_rank: int
    node: int
    slices: list[int]
    splits: list[list[int]]
    shard_valid: list[int]
    slice_windows: list[Layout]
    shard_windows: list[Layout]
    sum_regions: list[tuple[int, int]]
    slice_regions: list[tuple[int, int]]
    sums: torch.Tensor
    encoded: torch.Tensor
    wire_first: bool = False
    factors: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class BlockShards:
    """two_phase with block scaling: each chunk's N shards hold whole blocks.

    The owner of a shard re-encodes the mean of its N copies; the mean of a
    block is often far below the largest rank's values its agreed exponent
    was chosen for (by up to N), so the owner gives each block of the mean
    its own extra exponent ``d`` (:func:`aps_comm.scaling.mean_exponents`)
    and sends it, one byte per block, after the shard's payload in the
    all-gather. Shards are cut at block boundaries (chunks too), each padded
    to the chunk's largest shard.

    Attributes:
        bounds: per chunk, the N + 1 shard boundaries (elements of the group).
        windows: per chunk, per shard, its blocks as a window of the group's
            layout (the senders encode with the agreed scales).
        layouts: per chunk, per shard, the same blocks as a layout of their own
            (the owner's mean, and the receivers' decoding).
        shard_bytes: per chunk, the payload bytes every shard is padded to.
        slots: per chunk, exponent bytes after each shard's payload (the most
            blocks any shard of the chunk has).
        gather_regions: per chunk, its N gathered shards in ``gathered``.
        gathered: the group's send buffer, which also takes the all-gathered
            shards and exponents (shard s's j-th block's exponent is byte
            ``shard_bytes + j`` of row s: no index of them is kept), clear of
            the send regions still in use (:func:`_gather_offset`).
        pieces: per chunk, the bytes each shard takes in the all-to-all:
            ``shard_bytes``, and with each rank's own exponents
            (:attr:`aps_comm.config.BlockExponents.RANK`) its ``slots``
            exponent bytes too, and in the first chunk :attr:`flags` more,
            rounded up to 4 bytes.
        flags: with each rank's own exponents, bytes after each shard of the
            first chunk: one per layer of the group, whether the sender's
            layer is non-finite (every owner learns every rank's, so every
            rank makes the same layers NaN), then the log2 of the sender's
            preferred chunk (0: none); else 0.
        rank_exponents: each rank sends its own block exponents with its shards.
    """

    bounds: list[list[int]]
    windows: list[list[Layout]]
    layouts: list[list[Layout]]
    shard_bytes: list[int]
    slots: list[int]
    gather_regions: list[tuple[int, int]]
    gathered: torch.Tensor
    pieces: list[int]
    flags: int = 0
    rank_exponents: bool = False


@dataclasses.dataclass(frozen=True)
class NodeBlocks:
    """hierarchical and grid with block scaling and every owner's own block exponents.

    Each chunk (whole blocks) is cut into N shards of whole blocks, in element
    order; shard ``l * M + j`` is owned by local rank l of node j, and local
    rank l's slice is its M shards ``l * M ... l * M + M - 1``. Per chunk:
    the node's mean of each slice reaches its local rank (FP32, or with
    ``wire_first`` encoded with each sender's own block keys), goes across
    nodes in M pieces encoded with its holder's own keys, the shard's owner
    re-encodes the mean with its own keys (at both levels an owner adds its
    own values, not the rounded copy it sent itself, so who owns what, and
    with it the bits, follows the chunks), and the shards are gathered across
    nodes, then in the node, each with its owner's keys. The first chunk's
    pieces across nodes and gathered shards also carry every rank's layer
    flags (one byte per layer), so every rank makes the same layers NaN.

    Attributes:
        ranks_per_node: L.
        nodes: M.
        local_rank: this rank's local rank.
        node: this rank's node.
        wire_first: the first level exchanges the wire format (grid).
        bounds: per chunk, the N + 1 shard boundaries (elements of the group).
        shard_layouts: per chunk, per shard, its blocks as a layout of their own.
        slice_layout: per chunk, this rank's slice's blocks as a layout of their own.
        slice_bytes: per chunk, the payload bytes every slice is padded to (grid).
        slice_slots: per chunk, the most blocks of any slice (grid).
        slice_pieces: per chunk, bytes per slice in the first exchange (grid:
            payload, keys, 4-byte aligned; hierarchical: 0).
        shard_bytes: per chunk, the payload bytes every shard is padded to.
        slots: per chunk, the most blocks of any shard.
        pieces: per chunk, bytes per shard piece across nodes (payload, keys,
            in the first chunk the layer flags; 4-byte aligned).
        rows: per chunk, bytes of an owner's gathered shard (payload, keys,
            in the first chunk the layer flags).
        flags: layers of the group (the flag bytes of the first chunk).
        first_send: per chunk, grid's first exchange (uint8; hierarchical: empty).
        first_recv: per chunk, what the first exchange brings (float32 L x
            the slice for hierarchical, uint8 L pieces for grid).
        send: per chunk, the pieces across nodes (uint8).
        recv: per chunk, the pieces received across nodes.
        shard: per chunk, this rank's owned shard (codes, keys, flags).
        across: per chunk, the M shards gathered across nodes.
        gathered: per chunk, the N shards gathered in the node.
    """

    ranks_per_node: int
    nodes: int
    local_rank: int
    node: int
    wire_first: bool
    bounds: list[list[int]]
    shard_layouts: list[list[Layout]]
    slice_layout: list[Layout]
    slice_bytes: list[int]
    slice_slots: list[int]
    slice_pieces: list[int]
    shard_bytes: list[int]
    slots: list[int]
    pieces: list[int]
    rows: list[int]
    flags: int
    first_send: list[torch.Tensor]
    first_recv: list[torch.Tensor]
    send: list[torch.Tensor]
    recv: list[torch.Tensor]
    shard: list[torch.Tensor]
    across: list[torch.Tensor]
    gathered: list[torch.Tensor]
    bound: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def slice_bounds(self, c: int, local: int) -> tuple[int, int]:
        """Elements ``[a, b)`` of the group in local rank ``local``'s slice of chunk ``c``."""
        m = self.nodes
        return self.bounds[c][local * m], self.bounds[c][(local + 1) * m]


def _own_layout(window: Layout) -> Layout:
    """A window's segments as a layout of their own (from 0, as :meth:`Layout.from_numels`
    builds it): on the CPU the window's offsets and lengths themselves, not a copy."""
    if window.device.type != "cpu":
        return Layout.from_numels(window.sizes, window.device)
    if window.cells is not None:  # a grid's: kept per layer, as the window is
        return dataclasses.replace(window, first=0, parent=None)
    return Layout(
        window.offsets,
        window.device_lengths,
        window.sizes,
        window.numel,
        0,
        None,
        window.block_size,
    )


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to 4: the owner kernels read 16-bit codes from every row."""
    return -(-nbytes // 4) * 4


def _snap(boundaries: torch.Tensor, at: int) -> int:
    """The first block boundary at or after ``at`` (the last one if none)."""
    i = int(torch.searchsorted(boundaries, at))
    return int(boundaries[min(i, boundaries.numel() - 1)])


def block_chunks(layout: Layout, chunk_elements: int) -> list[tuple[int, int]]:
    """:func:`chunk_bounds` moved to block boundaries (``layout``'s segments are blocks).

    Example:
        >>> blocks = Layout.from_numels([10, 7], torch.device("cpu")).grid(8).layout
        >>> block_chunks(blocks, 6)
        [(0, 8), (8, 17)]
    """
    cuts = [lo for lo, _ in chunk_bounds(layout.numel, chunk_elements)][1:]
    edges = sorted({0, layout.numel, *(_snap(layout.offsets, c) for c in cuts)})
    return list(itertools.pairwise(edges)) or [(0, 0)]


def block_shard_cuts(offsets: torch.Tensor, lo: int, hi: int, world_size: int) -> list[int]:
    """The N + 1 shard boundaries of chunk ``[lo, hi)`` with block scaling: N equal cuts
    moved to the next block boundary of ``offsets`` (so shards hold whole blocks).

    Shard s is owned by rank s (two_phase) or by local rank ``s // M`` of node
    ``s % M`` (hierarchical and grid, M nodes): :class:`BlockShards`,
    :class:`NodeBlocks` and :mod:`aps_comm.simulate` cut with this one rule.

    Example:
        >>> block_shard_cuts(torch.tensor([0, 8, 16, 17]), 0, 17, 2)
        [0, 16, 17]
    """
    per = -(-(hi - lo) // world_size)
    return [lo, *(min(_snap(offsets, lo + k * per), hi) for k in range(1, world_size)), hi]


@dataclasses.dataclass
class GroupPlan:
    """Layers of one bucket that travel in one format, and how they travel.

    Attributes:
        fmt: the wire format.
        reduction: "fp32" (plain averaging all-reduce), "allreduce" (native
            sum in the wire dtype), "two_phase", "hierarchical" or "grid".
        index: positions of the group's layers in the bucket.
        index_tensor: the same on the bucket's device (to pick their maxima).
        numels: the layers' sizes.
        contiguous: the group is the whole bucket (no gather copy).
        layout: the segments the codec scales: the layers within the group's
            values, or with block scaling their blocks (:attr:`blocks`).
        chunks: element ranges pipelined one after another.
        windows: each chunk's segment layout.
        regions: each chunk's byte range in ``send``/``recv`` (two_phase: N padded
            shards; native: the chunk's payload; hierarchical: L padded slices
            in ``send``, this rank's slice's M shards in ``recv``).
        shard_regions: two_phase, hierarchical, grid: each chunk's reduced shard in ``shards``.
        send: scratch for the encoded chunks (two_phase also gathers into it; with
            :attr:`block_shards` as :attr:`BlockShards.gathered` says).
        recv: two_phase: scratch for the received shards.
        shards: two_phase: scratch for the owner's reduced shards.
        node: hierarchical and grid: the slices and their scratch.
        codec: the format's codec on the bucket's device (backend resolved once).
        blocks: block scaling: the layers' blocks (:meth:`aps_comm.layout.Layout.grid`;
            ``layout`` is their layout); None with one exponent per layer.
        block_shards: two_phase with block scaling and owner exponents: the
            shards of whole blocks (:class:`BlockShards`); ``regions`` and
            ``shard_regions`` then hold N padded shards and one shard with its
            exponent bytes.
        node_blocks: hierarchical and grid with block scaling and every
            owner's own exponents (:class:`NodeBlocks`, which holds the
            scratch; ``regions`` and ``shard_regions`` are then empty).
    """

    fmt: FloatFormat
    reduction: str
    index: list[int]
    index_tensor: torch.Tensor
    numels: list[int]
    contiguous: bool
    layout: Layout
    chunks: list[tuple[int, int]]
    windows: list[Layout]
    regions: list[tuple[int, int]]
    shard_regions: list[tuple[int, int]]
    send: torch.Tensor
    recv: torch.Tensor
    shards: torch.Tensor
    codec: Codec
    node: NodePlan | None = None
    blocks: Blocks | None = None
    block_shards: BlockShards | None = None
    node_blocks: NodeBlocks | None = None

    @property
    def numel(self) -> int:
        return self.layout.numel


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive parameters of an FSDP unit that travel in one format.

    Attributes:
        fmt: the wire format.
        index: the parameters' positions in the unit.
        index_tensor: the same on the unit's device (to pick their factors).
        lo: first element within a row.
        hi: end element within a row.
        b0: first byte within an encoded row.
        b1: end byte within an encoded row.
        layout: the segments the codec scales in ``[lo, hi)``: the
            parameters' chunks, or with block scaling their blocks.
        codec: the format's codec on the unit's device.
        rows_layout: the same segments in every one of the N rows, end to end
            (the run of all rows is coded in one call).
        rows_index: ``index_tensor`` repeated for the N rows.
        packed_rows: the N rows' encoded runs are contiguous byte ranges
            (not for a 4-bit run of an odd element count, whose last byte
            is shared by two rows when packed end to end).
        rows_blocks: block scaling: the N rows' chunks of the run cut into
            blocks (``rows_layout`` is their layout), else None.
        block_index: block scaling: the run's blocks, row by row, in the
            unit's blocks (:meth:`BucketPlan.grid` of the N rows), else None.
    """

    fmt: FloatFormat
    index: tuple[int, ...]
    index_tensor: torch.Tensor
    lo: int
    hi: int
    b0: int
    b1: int
    layout: Layout
    codec: Codec
    rows_layout: Layout
    rows_index: torch.Tensor
    packed_rows: bool
    rows_blocks: Blocks | None = None
    block_index: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class RowRuns:
    """How an FSDP unit's rows travel for one mix of formats (built once per mix).

    FSDP's reduce-scatter input is N rows, row r holding every parameter's
    padded r-th chunk: row r is the shard that rank r owns, so the unit is
    two_phase's exchange with the rows as shards, encoded run by run.

    Attributes:
        runs: the row's runs of one format, in order.
        by_format: per scaled (non-FP32) format, its parameters' positions on the device.
        row_numel: elements per row.
        row_bytes: bytes per encoded row.
    """

    runs: list[Run]
    by_format: dict[FloatFormat, torch.Tensor]
    row_numel: int
    row_bytes: int


@dataclasses.dataclass
class BucketPlan:
    """One bucket layout: its layers, its segments, and its group plans per format mix.

    Attributes:
        key: what identifies the layout (bucket index, sizes, device).
        numels: the layers' sizes in bucket order.
        layout: the layers' segments in the bucket.
        device: the bucket's device.
        groups: group plans, per (formats, reductions, world size, chunk size).
        exchange_s: the quickest exchange of this bucket so far (seconds; what
            :meth:`Planner.chunk` sizes chunks from on CPU: the minimum, since
            waiting for a late peer or a busy core only ever adds time).
        exchanges: exchanges timed so far.
        reductions: ``reduction="auto"``'s choice per format, per mix of the
            layers' formats (the model's answer depends only on the layout).
        model_chunk: the model's chunk for the state's format where nothing
            was timed (CUDA; 0 until first asked): it too depends only on
            the layout.
        agreed_chunk: with each rank's own block exponents on CPU, the chunk
            the ranks agreed through the last step's first exchange (each
            rank's preference rides on it, as it rides on the agreement
            otherwise); 0 before one.
        row_runs: FSDP units: the rows' runs per format mix.
        group_builds: group plans and row runs built so far (each allocates scratch).
        grids: block scaling: the bucket's blocks per block size (:meth:`grid`).
        block_indices: per format mix and block size, each format's blocks in
            the bucket (:meth:`block_index`).
        workspace: the state's scratch (:class:`aps_comm.workspace.Workspace`):
            the group plans' buffers are views of its region ``slot``; None:
            each group plan allocates its own.
        slot: the region of ``workspace`` this bucket's buffers come from.
        group_epochs: per group plans' key, the workspace's epoch they were
            cut from (another one builds them again).
    """

    key: tuple
    numels: list[int]
    layout: Layout
    device: torch.device
    groups: dict[tuple, list[GroupPlan]] = dataclasses.field(default_factory=dict)
    exchange_s: float = 0.0
    exchanges: int = 0
    reductions: dict[tuple, dict[FloatFormat, str]] = dataclasses.field(default_factory=dict)
    model_chunk: int = 0
    agreed_chunk: int = 0
    row_runs: dict[tuple, RowRuns] = dataclasses.field(default_factory=dict)
    group_builds: int = 0
    grids: dict[int, Blocks] = dataclasses.field(default_factory=dict)
    block_indices: dict[tuple, dict] = dataclasses.field(default_factory=dict)
    workspace: Workspace | None = None
    slot: Slot = Slot.EVEN
    group_epochs: dict[tuple, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def grid(self, block_size: int) -> Blocks:
        """The bucket's layers cut into blocks of ``block_size`` (built on first use)."""
        blocks = self.grids.get(block_size)
        if blocks is None:
            blocks = self.grids[block_size] = self.layout.grid(block_size)
        return blocks

    def block_index(self, formats: Sequence[FloatFormat], block_size: int) -> dict:
        """Per format of this mix (FP32 aside), its layers' blocks in the bucket's grid.

        In order of the format's layers, so they are the blocks of its group
        plan's :attr:`GroupPlan.blocks`; None where the format has every layer
        (no gather needed). Built once per mix.

        Example:
            >>> plan = BucketPlan.build(0, [20, 8], torch.device("cpu"))
            >>> e4m3, e5m2 = get_format("e4m3"), get_format("e5m2")
            >>> plan.block_index([e4m3, e5m2], 8)[e5m2]
            tensor([3], dtype=torch.int32)
        """
        key = (tuple(formats), block_size)
        cached = self.block_indices.get(key)
        if cached is None:
            counts = self.grid(block_size).counts
            first = (torch.cumsum(counts, 0) - counts).tolist()
            cached = {}
            for fmt in dict.fromkeys(formats):
                if fmt == FP32:
                    continue
                if all(f == fmt for f in formats):
                    cached[fmt] = None
                    continue
                picks = [
                    torch.arange(first[i], first[i] + int(counts[i]))
                    for i, f in enumerate(formats)
                    if f == fmt
                ]
                index = torch.cat(picks).to(index_dtype(int(counts.sum())))
                cached[fmt] = to_device(index, self.device)
            self.block_indices[key] = cached
        return cached

    def runs(
        self, formats: Sequence[FloatFormat], n_rows: int, block_size: int | None = None
    ) -> RowRuns:
        """An FSDP unit's runs for this step's per-parameter formats (built on first use).

        The plan's layers are the unit's N rows of its P chunks (``numels``
        is the P chunks repeated N times). With ``block_size`` the runs scale
        per block of every chunk (:attr:`Run.rows_blocks`).

        Example:
            >>> plan = BucketPlan.build(0, [3, 2] * 2, torch.device("cpu"))
            >>> runs = plan.runs([get_format("e4m3"), get_format("fp16")], 2)
            >>> [(r.fmt.name, r.lo, r.hi, r.b0, r.b1) for r in runs.runs]
            [('e4m3', 0, 3, 0, 3), ('fp16', 3, 5, 3, 7)]
        """
        formats = [get_format(f) for f in formats]
        key = (tuple(formats), n_rows, block_size)
        cached = self.row_runs.get(key)
        if cached is not None:
            return cached
        chunks = self.numels[: len(formats)]
        first = None
        if block_size is not None:
            counts = self.grid(block_size).counts
            first = [0, *torch.cumsum(counts, 0).tolist()]  # each segment's first block
        runs: list[Run] = []
        i = lo = b0 = 0
        while i < len(formats):
            j = i
            while j < len(formats) and formats[j] == formats[i]:
                j += 1
            hi = lo + sum(chunks[i:j])
            b1 = b0 + payload_nbytes(hi - lo, formats[i])
            index = torch.arange(i, j, device=self.device)
            layout = Layout.from_numels(chunks[i:j], self.device)
            rows_layout = Layout.from_numels(chunks[i:j] * n_rows, self.device)
            packed = formats[i].wire_bits != 4 or (hi - lo) % 2 == 0
            rows_blocks = block_index = None
            if block_size is not None and first is not None:
                # The codec scales per segment: with block scaling a segment is a block.
                layout = layout.grid(block_size).layout
                rows_blocks = rows_layout.grid(block_size)
                rows_layout = rows_blocks.layout
                p = len(formats)
                picks = [torch.arange(first[r * p + i], first[r * p + j]) for r in range(n_rows)]
                block_index = to_device(torch.cat(picks).to(index_dtype(first[-1])), self.device)
            runs.append(
                Run(
                    formats[i],
                    tuple(range(i, j)),
                    index,
                    lo,
                    hi,
                    b0,
                    b1,
                    layout,
                    codec_for(formats[i], self.device),
                    rows_layout,
                    index.repeat(n_rows),
                    packed,
                    rows_blocks,
                    block_index,
                )
            )
            i, lo, b0 = j, hi, b1
        by_format = {
            fmt: to_device(
                torch.tensor([k for k, f in enumerate(formats) if f == fmt], dtype=torch.long),
                self.device,
            )
            for fmt in dict.fromkeys(formats)
            if fmt != FP32  # exact in FP32: no scaling
        }
        self.group_builds += 1
        cached = RowRuns(runs, by_format, lo, runs[-1].b1 if runs else 0)
        # One format mix at a time: a Schedule switch frees the old scratch.
        self.row_runs = {key: cached}
        return cached

    def timed(self, seconds: float) -> None:
        """Record one exchange of the bucket (the first, which pays page faults, is not kept)."""
        if self.exchanges:
            self.exchange_s = min(self.exchange_s or seconds, seconds)
        self.exchanges += 1

    @classmethod
    def build(
        cls,
        bucket_index: int,
        numels: Sequence[int],
        device: torch.device,
        workspace: Workspace | None = None,
        slot: Slot = Slot.EVEN,
    ) -> BucketPlan:
        """The plan of a bucket of layers of ``numels`` elements on ``device`` (its
        buffers cut from ``workspace``'s region ``slot`` if given)."""
        numels = [int(n) for n in numels]
        key = (bucket_index, tuple(numels), str(device))
        layout = Layout.from_numels(numels, device)
        return cls(key, numels, layout, device, workspace=workspace, slot=slot)

    def group(
        self,
        fmts: Sequence[FloatFormat | str],
        reductions: dict,
        world_size: int,
        chunk_elements: int,
        node: dict[str, tuple[int, int]] | None = None,
        block_size: int | None = None,
        owner_exponents: bool = False,
        rank_exponents: bool = False,
    ) -> list[GroupPlan]:
        """The group plans for this step's per-layer formats (built on first use).

        Args:
            fmts: each layer's wire format this step.
            reductions: each format's resolved reduction ("allreduce",
                "two_phase" or "hierarchical"), keyed by format or name; FP32
                is always a plain all-reduce.
            world_size: ranks N.
            chunk_elements: largest chunk, in elements.
            node: per reduction that needs one ("hierarchical", "grid"), its
                (ranks per node, or rows, and this rank).
            block_size: block scaling: the codec scales every block of this
                many elements of a layer (:attr:`GroupPlan.blocks`).
            owner_exponents: with block scaling, two_phase shards hold whole
                blocks and their owners send exponents (:class:`BlockShards`).
            rank_exponents: the same, and every rank sends its own block
                exponents with its shards (no agreement).

        Returns:
            One plan per format, in order of first appearance (the same on every rank).
        """
        formats = [get_format(f) for f in fmts]
        chosen = tuple(
            Route(reductions.get(f, reductions.get(f.name))) if f != FP32 else Route.FP32
            for f in formats
        )
        key = (
            tuple(formats),
            world_size,
            chunk_elements,
            chosen,
            tuple(sorted((node or {}).items())),
            block_size,
            owner_exponents,
            rank_exponents,
        )
        cached = self.groups.get(key)
        epoch = (
            self.workspace.epoch(self.slot, Slot.EXCHANGE) if self.workspace is not None else None
        )
        if cached is not None and epoch is not None and self.group_epochs.get(key) != epoch:
            cached = None  # cut from a region the workspace has since outgrown
        if cached is None:
            # One chunking per format mix: a new chunk size frees the old scratch.
            self.groups = {k: v for k, v in self.groups.items() if k[0] != key[0]}
            order: dict[FloatFormat, list[int]] = {}
            for i, f in enumerate(formats):
                order.setdefault(f, []).append(i)
            # FP32 groups have no buffers: one group sent scaled cuts them as a bucket's one.
            alone = sum(f != FP32 for f in order) <= 1
            for _ in range(2):  # twice only where the workspace had to grow
                cached, opened = [], []
                for f, idx in order.items():
                    arenas = self._arenas(alone)
                    opened += arenas or ()
                    made = self._group_plan(
                        f,
                        idx,
                        len(order) == 1,
                        reductions,
                        world_size,
                        chunk_elements,
                        node,
                        block_size,
                        owner_exponents,
                        rank_exponents,
                        arenas,
                    )
                    cached.append(made)
                if all([a.close() for a in opened]):
                    break
            self.groups[key] = cached
            if self.workspace is not None:
                self.group_epochs = {k: v for k, v in self.group_epochs.items() if k in self.groups}
                self.group_epochs[key] = self.workspace.epoch(self.slot, Slot.EXCHANGE)
            self.group_builds += 1
        return cached

    def _arenas(self, alone: bool) -> tuple[Arena, Arena] | None:
        """Where a group plan's buffers come from: what a deferred tail reads, then the
        rest. A bucket of one group (``alone``) defers its tail: that from the bucket's
        slot, the rest from :attr:`Slot.EXCHANGE`, which every bucket shares. A bucket of
        several groups sent scaled defers nothing and runs one group at a time: every
        buffer of each group from the start of :attr:`Slot.EXCHANGE` (the groups share it
        too, and no copy per slot is kept). None: no workspace."""
        if self.workspace is None:
            return None
        shared = self.workspace.arena(Slot.EXCHANGE)
        return (self.workspace.arena(self.slot) if alone else shared), shared

    def _group_plan(
        self,
        fmt: FloatFormat,
        index: list[int],
        contiguous: bool,
        reductions: dict,
        world_size: int,
        chunk_elements: int,
        node: dict[str, tuple[int, int]] | None,
        block_size: int | None = None,
        owner_exponents: bool = False,
        rank_exponents: bool = False,
        arenas: tuple[Arena, Arena] | None = None,
    ) -> GroupPlan:
        numels = [self.numels[i] for i in index]
        whole = len(index) == len(self.numels)
        # The whole bucket's layout and blocks are the plan's: not a copy per group plan.
        layout = self.layout if whole else Layout.from_numels(numels, self.device)
        blocks = None
        if block_size is not None and fmt != FP32:
            # The codec scales per segment: with block scaling a segment is a block.
            blocks = self.grid(block_size) if whole else layout.grid(block_size)
            layout = blocks.layout
        chosen = Route.FP32 if fmt == FP32 else reductions.get(fmt, reductions.get(fmt.name))
        if chosen not in tuple(Route):
            raise ValueError(f"no resolved reduction for {fmt.name}: {chosen!r}")
        reduction = Route(chosen)
        by_blocks = (
            blocks is not None
            and (owner_exponents or rank_exponents)
            and reduction == Route.TWO_PHASE
        )
        staged_blocks = blocks is not None and rank_exponents and Route(reduction).staged
        if by_blocks or staged_blocks:
            chunks = block_chunks(layout, chunk_elements)
        else:
            chunks = chunk_bounds(layout.numel, chunk_elements if reduction != "fp32" else 2**62)
        windows = [layout.window(lo, hi) for lo, hi in chunks]

        def scratch(n: int, dtype: torch.dtype = torch.uint8, tail: bool = True) -> torch.Tensor:
            # Kept across steps: fresh large allocations pay page faults every step.
            if arenas is not None:  # shared with the state's other buckets
                # What no deferred tail reads is shared by both slots' buckets too.
                return arenas[0 if tail else 1].take(n, dtype)
            return torch.empty(n, dtype=dtype, device=self.device)

        node_plan = None
        block_shards = None
        node_blocks = None
        regions: list[tuple[int, int]] = []
        shard_regions: list[tuple[int, int]] = []
        start = shard_start = 0
        if staged_blocks:
            if not node or reduction not in node:
                raise ValueError(f"{reduction} needs the node layout")
            assert blocks is not None
            node_blocks = self._node_blocks(
                reduction == Route.GRID,
                fmt,
                layout,
                blocks.counts,
                chunks,
                world_size,
                node[reduction],
                scratch,
            )
        elif reduction in ("hierarchical", "grid"):
            if not node or reduction not in node:
                raise ValueError(f"{reduction} needs the node layout")
            node_plan = self._node_plan(
                reduction == "grid",
                fmt,
                layout,
                chunks,
                world_size,
                node[reduction],
                scratch,
                regions,
                shard_regions,
            )
            start = regions[-1][1]
            shard_start = shard_regions[-1][1]
        elif by_blocks:
            flags = len(numels) + 1 if rank_exponents else 0
            block_shards = self._block_shards(
                fmt, layout, chunks, world_size, scratch, regions, shard_regions, flags
            )
            start, shard_start = regions[-1][1], shard_regions[-1][1]
        else:
            start, shard_start = _chunk_regions(
                fmt, reduction, chunks, world_size, regions, shard_regions
            )
        if node_plan is not None:
            received = node_plan.encoded.numel()  # one encoded slice per chunk
        else:
            received = start if reduction == "two_phase" else 0
        return GroupPlan(
            fmt=fmt,
            reduction=reduction,
            index=index,
            index_tensor=to_device(torch.tensor(index, dtype=torch.int64), self.device),
            numels=numels,
            contiguous=contiguous,
            layout=layout,
            chunks=chunks,
            windows=windows,
            regions=regions,
            shard_regions=shard_regions,
            send=block_shards.gathered if block_shards is not None else scratch(start),
            # Read by the owner's step, done before the bucket's tail.
            recv=scratch(received, tail=False),
            # Two_phase's tail gathers the shards; the staged routes' is in-node (node.encoded).
            shards=scratch(shard_start, tail=node_plan is None),
            codec=codec_for(fmt, self.device),
            node=node_plan,
            blocks=blocks,
            block_shards=block_shards,
            node_blocks=node_blocks,
        )

    @staticmethod
    def _node_blocks(
        wire_first: bool,
        fmt: FloatFormat,
        layout: Layout,
        counts: torch.Tensor,
        chunks: list[tuple[int, int]],
        world_size: int,
        node: tuple[int, int],
        scratch: Callable[..., torch.Tensor],
    ) -> NodeBlocks:
        """Shards, slices and scratch of :class:`NodeBlocks` (``layout``'s segments are
        the blocks, ``counts`` the blocks per layer)."""
        per_node, rank = node
        local, me = rank % per_node, rank // per_node
        nodes = world_size // per_node
        device = layout.device
        n_layers = counts.numel()
        cols: dict[str, list] = {
            k: []
            for k in [
                "bounds",
                "shard_layouts",
                "slice_layout",
                "slice_bytes",
                "slice_slots",
                "slice_pieces",
                "shard_bytes",
                "slots",
                "pieces",
                "rows",
                "first_send",
                "first_recv",
                "send",
                "recv",
                "shard",
                "across",
                "gathered",
            ]
        }
        for c, (lo, hi) in enumerate(chunks):
            cut = block_shard_cuts(layout.offsets, lo, hi, world_size)
            wins = [layout.window(a, b) for a, b in itertools.pairwise(cut)]
            slices = [(cut[q * nodes], cut[(q + 1) * nodes]) for q in range(per_node)]
            slice_wins = [layout.window(a, b) for a, b in slices]
            a, b = slices[local]
            sb = max(payload_nbytes(y - x, fmt) for x, y in itertools.pairwise(cut))
            slot = max(w.n_segments for w in wins)
            flags = n_layers if c == 0 else 0
            piece = _aligned(sb + slot + flags)
            row = sb + slot + flags
            slice_sb = max(payload_nbytes(y - x, fmt) for x, y in slices)
            slice_slot = max(w.n_segments for w in slice_wins)
            slice_piece = _aligned(slice_sb + slice_slot) if wire_first else 0
            cols["bounds"].append(cut)
            cols["shard_layouts"].append([Layout.from_numels(w.sizes, device) for w in wins])
            cols["slice_layout"].append(Layout.from_numels(slice_wins[local].sizes, device))
            cols["slice_bytes"].append(slice_sb)
            cols["slice_slots"].append(slice_slot)
            cols["slice_pieces"].append(slice_piece)
            cols["shard_bytes"].append(sb)
            cols["slots"].append(slot)
            cols["pieces"].append(piece)
            cols["rows"].append(row)
            cols["first_send"].append(scratch(per_node * slice_piece))
            if wire_first:
                cols["first_recv"].append(scratch(per_node * slice_piece))
            else:
                cols["first_recv"].append(scratch(per_node * (b - a), torch.float32))
            cols["send"].append(scratch(nodes * piece))
            cols["recv"].append(scratch(nodes * piece))
            cols["shard"].append(scratch(row))
            cols["across"].append(scratch(nodes * row))
            cols["gathered"].append(scratch(world_size * row))
        return NodeBlocks(
            ranks_per_node=per_node,
            nodes=nodes,
            local_rank=local,
            node=me,
            wire_first=wire_first,
            flags=n_layers,
            **cols,
        )

    @staticmethod
    def _block_shards(
        fmt: FloatFormat,
        layout: Layout,
        chunks: list[tuple[int, int]],
        world_size: int,
        scratch: Callable[..., torch.Tensor],
        regions: list[tuple[int, int]],
        shard_regions: list[tuple[int, int]],
        flags: int = 0,
    ) -> BlockShards:
        """Shards of whole blocks per chunk (``layout``'s segments are the blocks); fills
        the group's ``regions`` (N padded shards, with each rank's own exponents
        theirs too and ``flags`` bytes in the first chunk) and ``shard_regions``
        (one shard and its exponent bytes)."""
        bounds, windows, layouts, shard_bytes, slots, gather_regions = [], [], [], [], [], []
        pieces = []
        start = shard_start = gather_start = 0
        for lo, hi in chunks:
            cut = block_shard_cuts(layout.offsets, lo, hi, world_size)
            wins = [layout.window(a, b) for a, b in itertools.pairwise(cut)]
            own = [_own_layout(w) for w in wins]
            sb = max(payload_nbytes(b - a, fmt) for a, b in itertools.pairwise(cut))
            slot = max(w.n_segments for w in wins)
            bounds.append(cut)
            windows.append(wins)
            layouts.append(own)
            shard_bytes.append(sb)
            slots.append(slot)
            piece = sb
            if flags:  # 4-byte aligned: the owner reads 16-bit codes from every row
                piece = -(-(sb + slot + (flags if not pieces else 0)) // 4) * 4
            pieces.append(piece)
            regions.append((start, start + world_size * piece))
            start = regions[-1][1]
            shard_regions.append((shard_start, shard_start + sb + slot))
            shard_start = shard_regions[-1][1]
            gather_regions.append((gather_start, gather_start + world_size * (sb + slot)))
            gather_start = gather_regions[-1][1]
        # The shards are gathered into the send buffer, not a buffer of their own.
        at = _gather_offset(regions, gather_regions)
        gather_regions = [(at + q0, at + q1) for q0, q1 in gather_regions]
        return BlockShards(
            bounds,
            windows,
            layouts,
            shard_bytes,
            slots,
            gather_regions,
            scratch(max(start, at + gather_start)),
            pieces,
            flags,
            bool(flags),
        )

    @staticmethod
    def _node_plan(
        wire_first: bool,
        fmt: FloatFormat,
        layout: Layout,
        chunks: list[tuple[int, int]],
        world_size: int,
        node: tuple[int, int],
        scratch: Callable[..., torch.Tensor],
        regions: list[tuple[int, int]],
        shard_regions: list[tuple[int, int]],
    ) -> NodePlan:
        """Slices, shards and scratch of hierarchical/grid; fills the group's
        ``regions`` (L padded slices per chunk) and ``shard_regions``."""
        per_node, rank = node
        local, me = rank % per_node, rank // per_node
        nodes = world_size // per_node
        slices, splits, shard_valid, slice_windows, shard_windows = [], [], [], [], []
        sum_regions, slice_regions = [], []
        start = shard_start = sum_start = slice_start = 0
        for lo, hi in chunks:
            n = hi - lo
            shard, shard_bytes = shard_layout(-(-n // per_node), fmt, nodes)
            per = shard * nodes
            split = [min(max(n - j * per, 0), per) for j in range(per_node)]
            slices.append(per)
            splits.append(split)
            mine = lo + local * per
            slice_windows.append(layout.window(mine, mine + split[local]))
            valid = min(max(split[local] - me * shard, 0), shard)
            shard_valid.append(valid)
            shard_windows.append(layout.window(mine + me * shard, mine + me * shard + valid))
            regions.append((start, start + shard_bytes * nodes * per_node))
            start = regions[-1][1]
            shard_regions.append((shard_start, shard_start + shard_bytes))
            shard_start += shard_bytes
            mine_size = shard_bytes * nodes if wire_first else split[local]
            sum_regions.append((sum_start, sum_start + per_node * mine_size))
            sum_start = sum_regions[-1][1]
            slice_regions.append((slice_start, slice_start + shard_bytes * nodes))
            slice_start = slice_regions[-1][1]
        return NodePlan(
            ranks_per_node=per_node,
            nodes=nodes,
            local_rank=local,
            node=me,
            slices=slices,
            splits=splits,
            shard_valid=shard_valid,
            slice_windows=slice_windows,
            shard_windows=shard_windows,
            sum_regions=sum_regions,
            slice_regions=slice_regions,
            # The first exchange's, read by the node's sum: done before the bucket's tail.
            sums=scratch(sum_start, torch.uint8 if wire_first else torch.float32, tail=False),
            encoded=scratch(slice_start),
            wire_first=wire_first,
            factors=scratch(4 * layout.n_segments, torch.float32).view(4, layout.n_segments),
        )


def _gather_offset(regions: list[tuple[int, int]], gathers: list[tuple[int, int]]) -> int:
    """The least offset in the send buffer from which every chunk's gathered shards
    (``gathers``, from 0) stay clear of the send regions (``regions``) in use beside them.

    Two_phase pipelines its chunks (:func:`aps_comm.transports.two_phase_bound`): chunk
    c's all-gather starts once its all-to-all is done, and its shards are decoded after
    chunks c + 1 and c + 2 were encoded and sent; so they may lie over any chunk's send
    region but those two. With each rank's own exponents a piece holds its shard's key
    bytes too, every chunk's shards fit below the next one's send region: 0. Agreed
    exponents send them only in the all-gather, whose shards then may start higher.

    Example:
        >>> sends = [(0, 8), (8, 16)]
        >>> _gather_offset(sends, [(0, 6), (6, 12)]), _gather_offset(sends, [(0, 10), (10, 20)])
        (0, 16)
    """

    def clear(at: int) -> bool:
        return all(
            q0 == q1 or at + q1 <= regions[j][0] or at + q0 >= regions[j][1]
            for c, (q0, q1) in enumerate(gathers)
            for j in range(c + 1, min(c + 3, len(regions)))
        )

    # Each chunk's shards just after a send region they must not overlap, or after all;
    # 4-aligned, as the send regions are (the kernels read 16-bit codes from the rows).
    starts = [r1 - q0 for c, (q0, _) in enumerate(gathers) for _, r1 in regions[c + 1 : c + 3]]
    ats = [_aligned(at) for at in [0, *starts, regions[-1][1]] if at >= 0]
    return min(at for at in ats if clear(at))


def _chunk_regions(
    fmt: FloatFormat,
    reduction: Route,
    chunks: list[tuple[int, int]],
    world_size: int,
    regions: list[tuple[int, int]],
    shard_regions: list[tuple[int, int]],
) -> tuple[int, int]:
    """Each chunk's send region (two_phase: its N shards; native: its payload; FP32:
    none) and two_phase's shard region, appended; returns the bytes of each buffer."""
    start = shard_start = 0
    for lo, hi in chunks:
        if reduction == "two_phase":
            _, shard_bytes = shard_layout(hi - lo, fmt, world_size)
            size = shard_bytes * world_size
            shard_regions.append((shard_start, shard_start + shard_bytes))
            shard_start += shard_bytes
        else:
            size = payload_nbytes(hi - lo, fmt) if reduction == "allreduce" else 0
        regions.append((start, start + size))
        start += size
    return start, shard_start
