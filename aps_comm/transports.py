"""How encoded gradients cross the wire: the only module that issues tensor collectives.

Every route runs bound: its per-chunk calls (encode, the owner's step, decode) are
bound once to the bucket's buffers by the engine (:mod:`aps_comm.engine`) and the
codec (:mod:`aps_comm.codec`), and the functions here issue the collectives between
them, step after step, with no per-step planning.

- :func:`all_reduce_max`: the cheap all-reduce of the layers' maxima.
- :func:`fp32_mean` / :func:`fp32_mean_async`: the plain FP32 average
  (``allreduce_hook``'s arithmetic).
- :func:`native`: one all-reduce per chunk in the wire dtype (FP16/BF16 on
  every backend; FP8 where the backend sums it, NCCL >= 2.24 on sm_90+).
- :func:`two_phase_bound` (and its block forms): per chunk,
  ``all_to_all_single`` of the encoded shards (uint8), the owner's FP32 sum,
  and ``all_gather`` of the reduced shards.
- :func:`two_phase_bound` with ``groups``, the staged route: per chunk, an FP32
  ``all_to_all_single`` inside the node and an ordered sum (a reduce-scatter whose
  order is fixed), two_phase of the encoded node sums among the ranks with the same
  local rank, and an ``all_gather`` of the encoded slices inside the node: only the
  wire format crosses nodes. The grid reduction runs the same stages on a virtual grid
  of ranks, its first level exchanging the wire format too.
- :func:`rows_exchange`: FSDP2's reduce-scatter, two_phase's exchange of
  encoded shards (the unit's rows; the owner's FP32 sum is the engine's), with no
  all-gather: FSDP keeps shards.

The two_phase and staged routes pipeline the chunks of a bucket: while chunk c is
on the wire, chunk c+1 encodes and chunk c-1 reduces or decodes. They return when
the bucket is decoded in place (on CUDA: when that work is enqueued on the current
stream), or leave the last chunks in flight for a deferred tail. Every rank issues
the same collectives in the same order: the order depends only on the plan.

Example:
    >>> tail = transports.two_phase_bound(calls, pg, counter, defer=False)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from aps_comm.codec import BlockChunk, NodeBlockChunk
from aps_comm.formats import FloatFormat, payload_nbytes, pow2
from aps_comm.layout import BlockGrid, Layout
from aps_comm.plan import BlockShards, GroupPlan, NodeBlocks
from aps_comm.scaling import (
    blocks_amax,
    exponent_keys,
    key_factors,
)
from aps_comm.topology import NodeGroups

__all__ = [
    "ChunkCalls",
    "Counter",
    "all_gather_single",
    "all_reduce_max",
    "bind_blocks",
    "bind_hierarchical",
    "bind_node_blocks",
    "fp32_mean",
    "fp32_mean_async",
    "native",
    "node_spare",
    "rows_exchange",
    "two_phase_bound",
]


@dataclasses.dataclass(frozen=True)
class ChunkCalls:
    """One chunk's codec work, bound once (:meth:`aps_comm.codec.Codec.bind_encode` and
    friends), and the buffers its route's collectives move (views made once: slicing
    costs host time): a settled bucket repeats the same calls on the same buffers every
    step.

    Attributes:
        encode: encodes the chunk into ``send`` (two_phase: with its padding; a staged
            route: the node's sum of this rank's slice, from ``first_out``).
        owner: the owner's step from ``recv`` into ``shard`` (None for native sums).
        decode: decodes the chunk's result into the bucket.
        send: what the chunk's exchange sends (native: summed in place).
        recv: two_phase and staged: what the exchange brings.
        shard: two_phase and staged: this rank's shard, gathered into ``gathered``.
        gathered: where the shards are gathered (by default ``send``, free by then).
        first: grid: the chunk encoded with the first level's factors into ``first_in``.
        first_in: staged: what the first exchange, in the node, sends (the values'
            chunk, or grid's encoded chunk).
        first_out: staged: what it receives: the node's L slices of this rank's.
        splits: hierarchical: the first exchange's input and output split sizes.
        node_gathered: staged: where ``gathered`` is gathered in the node (the chunk's
            encoded mean, which ``decode`` reads).
        offer: two_phase with every rank's own block exponents, the first chunk:
            [this rank's preferred chunk (log2), which ``encode`` sends; the ranks'
            largest, which ``owner`` writes] (:func:`two_phase_bound`'s ``chunk_log2``
            and ``on_chunk``).
    """

    encode: Callable[[], object]
    owner: Callable[[], object] | None
    decode: Callable[[], object]
    send: torch.Tensor
    recv: torch.Tensor | None = None
    shard: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    first: Callable[[], object] | None = None
    first_in: torch.Tensor | None = None
    first_out: torch.Tensor | None = None
    splits: tuple[list[int], list[int]] | None = None
    node_gathered: torch.Tensor | None = None
    offer: list[int] | None = None

    def __post_init__(self) -> None:
        if self.gathered is None:
            object.__setattr__(self, "gathered", self.send)


Counter = Callable[[str, int], None]
"""``count(collective, nbytes)``: called for every payload handed to a collective."""

_Stage = Callable[[int], None]
"""One stage of a chunk of a pipelined route (:func:`_pipeline`)."""


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """``all_gather_single`` where torch has it, else ``all_gather_into_tensor``.

    Recent torch renamed the collective and deprecated the old name; calling
    the right one keeps the output free of FutureWarnings on every version.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def _wait(work: dist.Work, what: str) -> None:
    """``work.wait()``, naming the collective if it fails (a dead or stalled peer)."""
    try:
        work.wait()
    except Exception as exc:
        raise RuntimeError(f"aps_comm: {what} did not complete: {exc}") from exc


def all_reduce_max(vec: torch.Tensor, group: dist.ProcessGroup, count: Counter) -> None:
    """MAX all-reduce of a float32 vector, in place."""
    count("all_reduce_max", vec.numel() * vec.element_size())
    work = dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group, async_op=True)
    _wait(work, f"the MAX all-reduce of {vec.numel()} layer maxima")


def fp32_mean(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    world_size: int,
    count: Counter,
    divided: bool = False,
) -> None:
    """Average float32 ``x`` over the ranks in place (``allreduce_hook``'s arithmetic;
    ``divided``: ``x`` is divided by ``world_size`` already, only the sum is left)."""
    _wait(_fp32_sum(x, group, world_size, count, divided), "the FP32 all-reduce")


def fp32_mean_async(
    x: torch.Tensor, group: dist.ProcessGroup, world_size: int, count: Counter
) -> torch.futures.Future:
    """:func:`fp32_mean` without waiting: ``allreduce_hook``'s arithmetic, its future.

    The future holds ``x`` (averaged in place) once the all-reduce is done.
    """
    return _fp32_sum(x, group, world_size, count, False).get_future().then(lambda f: f.value()[0])


def _fp32_sum(
    x: torch.Tensor, group: dist.ProcessGroup, world_size: int, count: Counter, divided: bool
) -> dist.Work:
    if not divided:
        x.div_(world_size)
    count("all_reduce", x.numel() * x.element_size())
    return dist.all_reduce(x, group=group, async_op=True)


def rows_exchange(
    send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, count: Counter
) -> None:
    """:func:`reduce_scatter`'s exchange alone: row r of the encoded rows ``send`` to rank
    r, every rank's row for this one into ``recv`` (a settled unit of several formats
    codes its rows around it).

    Example:
        >>> rows_exchange(send, recv, group, traffic)  # doctest: +SKIP
    """
    count("all_to_all", send.numel())
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    _wait(work, f"the all_to_all of {send.numel()} encoded bytes")


def native(
    calls: Sequence[ChunkCalls],
    fmt: FloatFormat,
    group: dist.ProcessGroup,
    count: Counter,
    defer: bool = False,
) -> Callable[[], None] | None:
    """Average a bound bucket with one native all-reduce per chunk in the wire dtype.

    Args:
        calls: each chunk's bound encode and decode, with its ``send`` region
            (summed in place).
        fmt: the wire format (FP16/BF16, or FP8 where the backend sums it).
        group: the process group.
        count: byte counter.
        defer: leave the last chunk in flight and return a function that waits
            for it and decodes it: the caller can start the next bucket first.

    Returns:
        With ``defer``, the function that finishes the bucket; else None.
    """
    works: _Works = [None] * len(calls)
    what = f"{fmt.name} all-reduce"

    def reduce(c: int) -> None:
        cc = calls[c]
        cc.encode()
        count("all_reduce", cc.send.numel())
        works[c] = dist.all_reduce(cc.send.view(fmt.torch_dtype), group=group, async_op=True), what

    return _pipeline(len(calls), (reduce, _decoding(calls, works)), defer)


_Works = list[tuple[dist.Work, str] | None]
"""Each chunk's collective in flight, and its name for errors."""


def _wait_chunk(works: _Works, c: int) -> None:
    """Wait for chunk c's collective in flight, if any (naming it if it fails)."""
    pending = works[c]
    if pending is not None:
        works[c] = None
        _wait(pending[0], f"the {pending[1]} of chunk {c + 1} of {len(works)}")


def _decoding(calls: Sequence[ChunkCalls], works: _Works) -> _Stage:
    """The last stage: chunk c's result decoded once its last collective is done."""

    def decode(c: int) -> None:
        _wait_chunk(works, c)
        calls[c].decode()

    return decode


def _pipeline(
    k: int, stages: Sequence[_Stage], defer: bool, backward: bool = False
) -> Callable[[], None] | None:
    """Run stage s of chunk c at step c + s: every rank issues the same collectives in
    the same order, whatever the route.

    Forward (two_phase, native), a step runs its stages first to last and ``defer``
    leaves the last stage of every chunk that reaches it after the last chunk's first
    stage; ``backward`` (the staged route), last to first, leaving the last chunk's.

    Returns:
        With ``defer``, the function that runs the stages left, in chunk order; else None.
    """
    last = len(stages) - 1
    order, held = (range(last, -1, -1), 1) if backward else (range(last + 1), last)
    tail: list[int] = []
    for step in range(k + last):
        for s in order:
            c = step - s
            if not 0 <= c < k:
                continue
            if defer and s == last and c >= k - held:
                tail.append(c)
            else:
                stages[s](c)
    return functools.partial(_each, stages[last], tail) if defer else None


def _each(stage: _Stage, chunks: Sequence[int]) -> None:
    for c in chunks:
        stage(c)


def _two_phase(
    calls: Sequence[ChunkCalls],
    group: dist.ProcessGroup,
    count: Counter,
    works: _Works,
    level: str = "",
) -> tuple[_Stage, _Stage]:
    """two_phase's exchange and gather of chunk c as pipeline stages, each after the
    chunk's collective in flight (a staged route's previous level): its ``encode`` fills
    ``send`` for the exchange into ``recv``, its ``owner`` step makes ``shard``, gathered
    into ``gathered``. ``level`` names the collectives in errors."""
    names = f"{level}all_to_all", f"{level}all_gather"

    def exchange(c: int) -> None:
        _wait_chunk(works, c)
        cc = calls[c]
        cc.encode()
        count("all_to_all", cc.send.numel())
        recv = cc.recv  # bound for two_phase (as shard, gathered and owner)
        works[c] = dist.all_to_all_single(recv, cc.send, group=group, async_op=True), names[0]

    def gather(c: int) -> None:
        _wait_chunk(works, c)
        cc = calls[c]
        cc.owner()  # type: ignore[misc]
        count("all_gather", cc.shard.numel())  # type: ignore[union-attr]
        work = all_gather_single(cc.gathered, cc.shard, group=group, async_op=True)
        works[c] = work, names[1]

    return exchange, gather


def _in_node(
    calls: Sequence[ChunkCalls], groups: NodeGroups, count: Counter, works: _Works
) -> tuple[_Stage, _Stage]:
    """The staged route's stages in the node around two_phase across nodes: chunk c's
    first exchange (``first``, then ``first_in`` to ``first_out``, FP32 with ``splits``
    or grid's encoded slices), and the gather of the shards gathered across nodes
    (``gathered``) into ``node_gathered``."""

    def exchange(c: int) -> None:
        cc = calls[c]
        source = cc.first_in
        assert source is not None and cc.first_out is not None  # bound for a staged route
        count("node_all_to_all", source.numel() * source.element_size())
        if cc.first is not None:
            cc.first()
        sizes = cc.splits or (None, None)
        work = dist.all_to_all_single(
            cc.first_out,
            source,
            output_split_sizes=sizes[1],
            input_split_sizes=sizes[0],
            group=groups.intra,
            async_op=True,
        )
        works[c] = work, "first-level all_to_all" if cc.first else "in-node FP32 all_to_all"

    def gather(c: int) -> None:
        _wait_chunk(works, c)
        cc = calls[c]
        assert cc.gathered is not None and cc.node_gathered is not None
        count("node_all_gather", cc.gathered.numel())
        work = all_gather_single(cc.node_gathered, cc.gathered, group=groups.intra, async_op=True)
        works[c] = work, "in-node all_gather"

    return exchange, gather


def two_phase_bound(
    calls: Sequence[ChunkCalls],
    group: dist.ProcessGroup,
    count: Counter,
    defer: bool = False,
    chunk_log2: int = 0,
    on_chunk: Callable[[int], None] | None = None,
    groups: NodeGroups | None = None,
) -> Callable[[], None] | None:
    """two_phase over a bound bucket (layer scaling; block exponents: :func:`bind_blocks`),
    or with ``groups`` the staged route (:func:`bind_hierarchical`,
    :func:`bind_node_blocks`): an exchange in the node, two_phase across nodes, a
    gather in the node.

    Stage s of chunk c runs at step c + s (:func:`_pipeline`; the staged route's later
    stages first): the same collectives, in the same order, and the same bytes,
    whatever bound the calls; per chunk a few bound calls and no slicing, lookups or
    checks on the host.

    Args:
        calls: each chunk's bound work, with its ``send``, ``recv``, ``shard``
            (and ``gathered``) views (:meth:`aps_comm.engine.Steady.bind`), and for
            the staged route its first exchange's and ``node_gathered``.
        group: the process group (with ``groups``: ``groups.inter``).
        count: byte counter.
        defer: leave the last chunks in flight and return the function that finishes them.
        chunk_log2: with rank block exponents, this rank's preferred chunk, sent with
            the first chunk (its ``offer``).
        on_chunk: with rank block exponents, called with the ranks' largest preferred
            chunk (log2), once the first chunk's owner step has read it.
        groups: the staged route: this rank's intra- and inter-node groups.

    Returns:
        With ``defer``, the function that finishes the bucket; else None.
    """
    offer = calls[0].offer if calls else None
    if offer is not None:
        offer[0] = chunk_log2
    works: _Works = [None] * len(calls)
    if groups is None:
        stages = (*_two_phase(calls, group, count, works), _decoding(calls, works))
    else:
        (exchange, gather), level = _in_node(calls, groups, count, works), "across-node "
        across = _two_phase(calls, groups.inter, count, works, level)
        stages = (exchange, *across, gather, _decoding(calls, works))
    tail = _pipeline(len(calls), stages, defer, backward=groups is not None)
    # Every chunk's owner step has run by now: only decodes are ever deferred.
    if offer is not None and on_chunk is not None:
        on_chunk(offer[1])
    return tail


_Views = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _chunk_views(g: GroupPlan, c: int) -> _Views:
    """Chunk c of two_phase with block exponents: its send and receive regions, this rank's
    gathered shard and the chunk's gathered shards (views made once: slicing costs host time)."""
    sh = g.block_shards
    assert sh is not None
    (r0, r1), (s0, s1), (q0, q1) = g.regions[c], g.shard_regions[c], sh.gather_regions[c]
    return g.send[r0:r1], g.recv[r0:r1], g.shards[s0:s1], sh.gathered[q0:q1]


def _encode_pieces(
    g: GroupPlan,
    values: torch.Tensor,
    pieces: torch.Tensor,
    spans: Iterable[tuple[int, int]],
    windows: Sequence[Layout],
    scale: torch.Tensor,
    keys: torch.Tensor | None = None,
    sb: int = 0,
) -> None:
    """Row i of ``pieces``: ``values[a:b]`` (the i-th of ``spans``) encoded with ``scale``,
    zeros to the row's end (code 0 is +0 in every format), and after ``sb`` payload
    bytes its blocks' ``keys`` (none with agreed exponents)."""
    for i, ((a, b), win) in enumerate(zip(spans, windows, strict=True)):
        piece, used = pieces[i], payload_nbytes(b - a, g.fmt)
        if b > a:
            g.codec.encode(values[a:b], out=piece[:used], scale=scale, layout=win)
        piece[used:].zero_()
        if b > a and keys is not None:
            piece[sb : sb + win.n_segments] = keys[win.first : win.first + win.n_segments]


def _owner_keys(
    g: GroupPlan,
    rows: torch.Tensor,
    mine: Layout,
    sb: int,
    used: int,
    out: torch.Tensor,
    own: torch.Tensor | None = None,
    own_row: int = -1,
) -> None:
    """The owner's step with every sender's own block keys: the mean of the received
    ``rows`` (each unscaled by the keys after its ``sb`` payload bytes) into ``out[:used]``,
    then its blocks' own keys (:meth:`aps_comm.codec.Codec.owner_reduce_rank_blocks`)."""
    blocks = mine.n_segments
    unscale = key_factors(rows[:, sb : sb + blocks], unscale=True)
    _, d = g.codec.owner_reduce_rank_blocks(
        rows.reshape(-1), rows.shape[0], mine, unscale, out=out[:used], own=own, own_row=own_row
    )
    out[used:sb].zero_()
    out[sb : sb + blocks] = 127 - d  # a key (zero and non-finite blocks: d = 0)
    out[sb + blocks :].zero_()


_Unscale = Callable[[int, int, torch.Tensor], torch.Tensor]
"""``unscale(b0, b1, sent)``: the factors of the group's blocks ``[b0, b1)`` from what
their shard's owner sent after its payload."""


def _decode_shards(
    g: GroupPlan,
    x: torch.Tensor,
    rows: torch.Tensor,
    bounds: Sequence[int],
    layouts: Sequence[Layout],
    firsts: Sequence[int],
    sb: int,
    unscale: _Unscale,
) -> None:
    """Every gathered shard (row s of ``rows``) decoded into ``x``, unscaled by what its
    owner sent after its ``sb`` payload bytes: ``unscale(b0, b1, sent)`` gives the factors
    of the group's blocks ``[b0, b1)`` (read in place: no index of the exponents is kept
    per bucket)."""
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        if a == b:
            continue
        mine, b0 = layouts[s], firsts[s]
        g.codec.decode(
            rows[s, : payload_nbytes(b - a, g.fmt)],
            b - a,
            out=x[a:b],
            scale=unscale(b0, b0 + mine.n_segments, rows[s, sb : sb + mine.n_segments]),
            layout=mine,
        )


def _shard_calls(
    g: GroupPlan,
    x: torch.Tensor,
    steps: tuple[Callable[..., object], Callable[..., object], _Unscale],
    offer: list[int] | None,
    c: int,
) -> ChunkCalls:
    """Chunk c of two_phase with block exponents by the codec's own calls, shard by shard,
    on the chunk's views (:func:`_chunk_views`), as :func:`_chunk_calls` takes the fused
    ones: of ``steps``, ``send(c, pieces)`` fills the exchange's N pieces (every rank's
    own: ``send(c, pieces, log2)``), ``owner(c, rows, out)`` makes this rank's shard from
    the N received rows, and the gathered shards are decoded one by one with ``unscale``
    (:func:`_decode_shards`)."""
    sh = g.block_shards
    assert sh is not None
    (send, owner, unscale), n = steps, len(sh.bounds[0]) - 1
    views, sb = _chunk_views(g, c), sh.shard_bytes[c]
    rows = views[3].view(n, sb + sh.slots[c])
    firsts = [w.first for w in sh.windows[c]]
    return _chunk_calls(
        c,
        functools.partial(send, c, views[0].view(n, sh.pieces[c])),
        functools.partial(owner, c, views[1].view(n, sh.pieces[c]), views[2]),
        functools.partial(
            _decode_shards, g, x, rows, sh.bounds[c], sh.layouts[c], firsts, sb, unscale
        ),
        views,
        offer,
    )


def _agreed_steps(
    g: GroupPlan,
    x: torch.Tensor,
    factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rank: int,
) -> tuple[Callable[..., object], Callable[..., object], _Unscale]:
    """two_phase's steps with agreed block exponents by the codec's calls, shard by shard
    (:func:`_shard_calls`), on ``factors``: the agreed factor, exponent (int32) of every
    block of the group and whether its layer is finite everywhere, read when the calls
    run."""
    sh = g.block_shards
    assert sh is not None and not sh.rank_exponents
    fmt, n, (scale, exponents, finite) = g.fmt, len(sh.bounds[0]) - 1, factors

    def send(c: int, pieces: torch.Tensor) -> None:
        _encode_pieces(g, x, pieces, itertools.pairwise(sh.bounds[c]), sh.windows[c], scale)

    def owner(p: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        mine, sb, (a, b) = sh.layouts[p][rank], sh.shard_bytes[p], sh.bounds[p][rank : rank + 2]
        first, used = sh.windows[p][rank].first, payload_nbytes(b - a, fmt)
        _, d = g.codec.owner_reduce_blocks(
            rows.reshape(-1), n, mine, exponents[first : first + mine.n_segments], out=out[:used]
        )
        out[used:sb].zero_()
        out[sb : sb + mine.n_segments] = d.clamp(0, 255).to(torch.uint8)
        out[sb + mine.n_segments :].zero_()

    def unscale(b0: int, b1: int, d: torch.Tensor) -> torch.Tensor:
        e = exponents[b0:b1] + d.to(torch.int32)
        return torch.where(finite[b0:b1], pow2(-e), float("nan"))

    return send, owner, unscale


def bind_blocks(
    g: GroupPlan,
    x: torch.Tensor,
    keys: torch.Tensor,
    flags: torch.Tensor,
    union: torch.Tensor,
    rank: int,
    factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> list[ChunkCalls] | None:
    """Every chunk's calls of two_phase with block exponents (every rank's own, or agreed:
    as ``g.block_shards``), bound to ``x`` and scratch: the codec's fused ones ("kernels",
    "triton"), else its own calls, shard by shard (encode,
    :meth:`aps_comm.codec.Codec.owner_reduce_rank_blocks` or ``owner_reduce_blocks``,
    decode and a few torch ops per shard: "cast", "bits", a Triton variant that cannot
    compile here), with the same bytes and no host read off the CPU.

    Args:
        g: the group's plan (``g.block_shards`` set).
        x: the group's float32 values.
        keys: the key of every block of the group (uint8), written each step: this
            rank's own, or the agreed ones.
        flags: this rank's non-finite flag of every layer (uint8), written each step
            (agreed: ``union``: nothing of this rank's own goes on the wire).
        union: per layer, scratch for every rank's flags OR-ed (agreed: whether any of
            its agreed keys is non-finite), written by the first chunk's owner step,
            read by every decode.
        rank: this rank.
        factors: agreed exponents, for the codec's own calls: the agreed factor,
            exponent (int32) of every block of the group and whether its layer is
            finite everywhere, refilled in place after the MAX all-reduce.

    Returns:
        One :class:`ChunkCalls` per chunk, what :func:`two_phase_bound` runs (every rank's
        own: the first with the chunk sizes' ``offer``); agreed: None where the codec has
        no fused kernels for them and no ``factors`` are given.

    Example:
        >>> calls = transports.bind_blocks(g, x, keys, flags, union, 0)  # doctest: +SKIP
        >>> transports.two_phase_bound(calls, group, count)  # doctest: +SKIP
    """
    sh = g.block_shards
    assert sh is not None and g.blocks is not None
    agreed = not sh.rank_exponents
    # A CPU plan's blocks go as their grid (per layer: the kernels derive the offsets).
    offsets = _grid_of(g.layout)
    dtype = offsets.dtype if isinstance(offsets, np.ndarray) else offsets.np_dtype
    # Each layer's end in the blocks (per layer, not per block), in the offsets' dtype.
    layer_ends = np.cumsum(g.blocks.counts.numpy()).astype(dtype)
    calls: list[ChunkCalls] = []
    offer = None if agreed else [0, 0]
    for c in range(len(g.chunks)):
        firsts = _block_firsts(g.layout, sh.bounds[c])
        views = send, recv, out, gathered = _chunk_views(g, c)
        chunk = BlockChunk(
            x=x,
            keys=keys,
            flags=flags,
            union=union,
            offsets=offsets,
            firsts=firsts,
            layer_ends=layer_ends,
            shard=_grid_of(sh.layouts[c][rank]),
            send=send,
            recv=recv,
            out=out,
            gathered=gathered,
            shard_bytes=sh.shard_bytes[c],
            # The first chunk's flags and log2 (agreed: nothing but codes on the wire).
            at=-1 if c else 0 if agreed else sh.shard_bytes[0] + sh.slots[0],
            first_block=int(firsts[rank]) if agreed else None,
        )
        call = g.codec.bind_blocks(chunk)
        if call is None:  # no fused calls here: the codec's own for every chunk
            break
        calls.append(_chunk_calls(c, *call, views, offer))
    else:
        return calls
    if factors is not None:
        steps = _agreed_steps(g, x, factors, rank)
    elif agreed:
        return None
    else:
        ops = _RankBlockOps(g, x, keys, flags, union, rank)
        steps = ops.send, ops.owner, ops.unscale
    return [_shard_calls(g, x, steps, offer, c) for c in range(len(g.chunks))]


@dataclasses.dataclass
class _BlockOps:
    """The torch-op fallbacks' state with every rank's own block exponents: this rank's
    keys and layer flags, read when the calls run; the first chunk makes the factors of
    the keys and the blocks of the layers any rank flagged, later chunks read both, in
    the same step."""

    g: GroupPlan
    x: torch.Tensor
    keys: torch.Tensor
    flags: torch.Tensor
    union: torch.Tensor
    scale: torch.Tensor | None = dataclasses.field(default=None, init=False)
    # Per block: its layer is non-finite on some rank.
    bad: torch.Tensor | None = dataclasses.field(default=None, init=False)

    def key_scale(self, c: int) -> torch.Tensor:
        """The factors of this rank's keys, made by the first chunk."""
        if c == 0:
            self.scale = key_factors(self.keys, unscale=False)
        assert self.scale is not None
        return self.scale

    def flag(self, sent: torch.Tensor) -> None:
        """Every rank's layer flags (a row each) OR-ed, and the blocks they flag."""
        g = self.g
        assert g.blocks is not None
        torch.amax(sent, 0, out=self.union)
        # Per block, from the layers' block counts: no per-block index is kept.
        self.bad = torch.repeat_interleave(
            self.union != 0, g.blocks.device_counts, output_size=g.layout.n_segments
        )

    def unscale(self, b0: int, b1: int, k: torch.Tensor) -> torch.Tensor:
        assert self.bad is not None  # the first chunk made it
        return torch.where(self.bad[b0:b1], float("nan"), key_factors(k, unscale=True))


@dataclasses.dataclass
class _RankBlockOps(_BlockOps):
    """Two_phase with every rank's own block exponents as the codec's own calls, shard by
    shard (:func:`bind_blocks`' steps for :func:`_shard_calls`)."""

    rank: int = 0

    @property
    def sh(self) -> BlockShards:
        assert self.g.block_shards is not None
        return self.g.block_shards

    def send(self, c: int, pieces: torch.Tensor, log2: int) -> None:
        sh, flags, sb = self.sh, self.flags, self.sh.shard_bytes[c]
        spans = itertools.pairwise(sh.bounds[c])
        _encode_pieces(
            self.g, self.x, pieces, spans, sh.windows[c], self.key_scale(c), self.keys, sb
        )
        if c == 0:
            at = sb + sh.slots[0]
            pieces[:, at : at + flags.numel()] = flags
            # fill_ takes the value as a kernel argument; an assignment of a host
            # value would copy it to the device and wait for the stream.
            pieces[:, at + flags.numel() : at + flags.numel() + 1].fill_(log2)

    def owner(self, p: int, rows: torch.Tensor, out: torch.Tensor) -> int:
        sh, nl, log2 = self.sh, self.flags.numel(), 0
        a, b = sh.bounds[p][self.rank : self.rank + 2]
        sb = sh.shard_bytes[p]
        if p == 0:
            at = sb + sh.slots[0]
            self.flag(rows[:, at : at + nl])
            if rows.device.type == "cpu":  # CPU buckets agree chunks from timing
                log2 = int(rows[:, at + nl].max())
        used = payload_nbytes(b - a, self.g.fmt)
        _owner_keys(self.g, rows, sh.layouts[p][self.rank], sb, used, out)
        return log2


def _chunk_calls(
    c: int,
    send: Callable[..., object],
    owner: Callable[[], object],
    decode: Callable[[], object],
    views: _Views,
    offer: list[int] | None,
) -> ChunkCalls:
    """Chunk c of two_phase with block exponents as :func:`two_phase_bound` runs it: with
    every rank's own (``offer`` given) the first chunk sends this rank's preferred chunk
    and keeps the ranks' largest (its ``offer``), later chunks send 0; agreed (None): the
    calls as they are."""
    if offer is None:
        return ChunkCalls(send, owner, decode, *views)
    if c:
        return ChunkCalls(functools.partial(send, 0), owner, decode, *views)

    def encode() -> None:
        send(offer[0])

    def keep() -> None:
        offer[1] = owner()  # type: ignore[assignment]  # the first chunk's owner returns the log2

    return ChunkCalls(encode, keep, decode, *views, offer=offer)


def _node_rows(g: GroupPlan, c: int) -> tuple[int, int, int]:
    """Chunk ``c`` of a staged group: the float32 elements of the node's sum (grid: its
    ``L`` decoded slices' each), of the owner's mean, and of the owner's ``M`` decoded rows."""
    node, bits = g.node, g.fmt.wire_bits
    assert node is not None
    (s0, s1), (e0, e1) = node.sum_regions[c], node.slice_regions[c]
    if node.wire_first:
        width = (s1 - s0) * 8 // bits // node.ranks_per_node
    else:
        width = node.splits[c][node.local_rank]
    per_shard = (e1 - e0) // node.nodes * 8 // bits
    return width, per_shard, node.nodes * per_shard


def node_spare(g: GroupPlan) -> int:
    """The float32 scratch :func:`bind_hierarchical` needs beyond the plan's buffers, one
    for every chunk (its calls run one at a time): grid's decoded slices (its sum the
    first), and the owner's decoded rows (its mean the first) where the chunk's node sums,
    free by then, cannot hold them. 0 for most hierarchical chunks.

    Example:
        >>> transports.node_spare(g)  # doctest: +SKIP
        0
    """
    node, need = g.node, 0
    assert node is not None
    for c in range(len(g.chunks)):
        width, _, rows = _node_rows(g, c)
        s0, s1 = node.sum_regions[c]
        if node.wire_first:
            need = max(need, node.ranks_per_node * width, rows)
        elif rows > s1 - s0:
            need = max(need, rows)
    return need


def bind_hierarchical(
    g: GroupPlan,
    x: torch.Tensor,
    factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    world_size: int,
    spare: torch.Tensor | None = None,
) -> list[ChunkCalls]:
    """Every chunk's codec work of the staged route, bound to ``x``, the plan's buffers
    and the factor tensors (scale, shift, unscale, first), which are read when the calls
    run: a settled bucket refills them in place every step.

    Per chunk, on the CPU kernels: grid's first encode; the node's sum (grid:
    its encoded slices decoded and summed) and its encode, one call; the
    owner's decode, mean and encode, one call; the decode: 3 kernel calls
    (grid 4) whatever the number of layers. Elsewhere the codec's calls,
    with the same bits.

    The float32 scratch holds nothing between calls: the node's sum is taken in
    place of its first slice (the node sums' region), the owner's decoded rows
    in the node sums' region of the chunk (free once its sum is encoded) or in
    ``spare`` (:func:`node_spare` elements, made here where None), the mean in
    place of the first row.

    Example:
        >>> calls = transports.bind_hierarchical(g, x, (s, sh, u, None), 4)  # doctest: +SKIP
        >>> transports.two_phase_bound(calls, groups.inter, count, groups=groups)  # doctest: +SKIP
    """
    node, codec, bits = g.node, g.codec, g.fmt.wire_bits
    assert node is not None
    scale, shift, unscale, first = factors
    per_node, local = node.ranks_per_node, node.local_rank
    if spare is None:
        spare = torch.empty(node_spare(g), dtype=torch.float32, device=x.device)
    calls = []
    for c, (lo, hi) in enumerate(g.chunks):
        (r0, r1), (s0, s1) = g.regions[c], node.sum_regions[c]
        (e0, e1), (h0, h1) = node.slice_regions[c], g.shard_regions[c]
        valid, kept = node.splits[c][local], node.shard_valid[c]
        sums, send, shard, gathered = (
            node.sums[s0:s1],
            node.encoded[e0:e1],
            g.shards[h0:h1],
            g.send[r0:r1],
        )
        recv = g.recv[e0:e1]
        width, per_shard, n_rows = _node_rows(g, c)
        send_first = splits = None
        if node.wire_first:
            assert first is not None
            # The chunk's send region is free until the last stage gathers into it;
            # the shards' padding is encoded as zeros (code 0 is +0 in every format).
            pad = (r1 - r0) * 8 // bits - (hi - lo)
            send_first = codec.bind_encode(x[lo:hi], gathered, first, g.windows[c], pad)
            first_in = gathered
            acc, rows = spare[:width], spare[: per_node * width]
        else:
            first_in = x[lo:hi]
            splits = node.splits[c], [valid] * per_node
            acc, rows = sums[:valid], None
        pad = (e1 - e0) * 8 // bits - valid
        # The node's sum in local-rank order, as aps_comm.simulate sums (grid: its encoded
        # slices decoded first), and its encode: one call on the CPU kernels.
        across = codec.bind_reduce_encode(
            sums, per_node, acc, 1, send, scale, node.slice_windows[c], pad, valid, rows
        )
        room = spare if node.wire_first or n_rows > sums.numel() else sums
        pad = (h1 - h0) * 8 // bits - kept
        owner = codec.bind_reduce_encode(
            *(recv, node.nodes, room[:per_shard], world_size, shard, shift),
            *(node.shard_windows[c], pad, kept, room[:n_rows]),
        )
        calls.append(
            ChunkCalls(
                across,
                owner,
                codec.bind_decode(g.send[r0:], x[lo:hi], unscale, g.windows[c]),
                send,
                recv,
                shard,
                first=send_first,
                first_in=first_in,
                first_out=sums,
                splits=splits,
                node_gathered=gathered,
            )
        )
    return calls


_Call = Callable[[], object]
"""A bound codec call."""

_Spans = tuple[list[tuple[int, int]], list[Layout]]
"""Pieces of a chunk: each one's elements ``[a, b)`` and its blocks' layout."""


@dataclasses.dataclass
class _NodeBlockOps(_BlockOps):
    """The staged route with rank block exponents as the codec's own calls, slice by slice
    and shard by shard (:func:`bind_node_blocks` where the codec has no fused calls: the
    same bytes, no host read off the CPU): grid's first encode of the first chunk makes
    the factors of this rank's keys, the first chunk's decode flags the blocks."""

    means: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict, init=False)
    # Per chunk, made once (a window's layout costs host copies): grid's slices of the
    # group, the pieces of this rank's slice, each shard's first block in the group.
    slices: list[_Spans] = dataclasses.field(default_factory=list, init=False)
    pieces: list[_Spans] = dataclasses.field(default_factory=list, init=False)
    firsts: list[list[int]] = dataclasses.field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        nb, layout = self.nb, self.g.layout
        nodes, local = nb.nodes, nb.local_rank
        for c in range(len(self.g.chunks)):
            bounds, s0 = nb.bounds[c], nb.slice_bounds(c, local)[0]
            slices = [nb.slice_bounds(c, q) for q in range(nb.ranks_per_node)]
            wins = [layout.window(a, b) for a, b in slices] if nb.wire_first else []
            self.slices.append((slices, wins))
            mine = bounds[local * nodes : (local + 1) * nodes + 1]
            spans = [(a - s0, b - s0) for a, b in itertools.pairwise(mine)]
            self.pieces.append((spans, [nb.slice_layout[c].window(a, b) for a, b in spans]))
            self.firsts.append(_block_firsts(layout, bounds).tolist())

    @property
    def nb(self) -> NodeBlocks:
        assert self.g.node_blocks is not None
        return self.g.node_blocks

    def bind(self, c: int) -> tuple[_Call | None, _Call, _Call, _Call]:
        """Chunk c's (first, across, owner, decode), as
        :meth:`aps_comm.codec.Codec.bind_node_blocks` gives them."""
        part = functools.partial
        first = part(self.first, c) if self.nb.wire_first else None
        return first, part(self.across, c), part(self.owner, c), part(self.decode, c)

    def first(self, c: int) -> None:
        """Grid: this rank's L slices of chunk c encoded with its own keys, each followed by
        its blocks' keys."""
        nb = self.nb
        pieces = nb.first_send[c].view(nb.ranks_per_node, nb.slice_pieces[c])
        scale = self.key_scale(c)
        _encode_pieces(self.g, self.x, pieces, *self.slices[c], scale, self.keys, nb.slice_bytes[c])

    def node_mean(self, c: int) -> torch.Tensor:
        """This rank's slice of chunk c averaged over its node (float32)."""
        nb, fmt = self.nb, self.g.fmt
        per_node, local = nb.ranks_per_node, nb.local_rank
        a, b = nb.slice_bounds(c, local)
        if not nb.wire_first:
            parts = nb.first_recv[c].view(per_node, b - a)
            acc = parts[0].clone()
            for r in range(1, per_node):
                acc += parts[r]  # local-rank order, as aps_comm.simulate sums
            return acc.div_(per_node)
        rows = nb.first_recv[c].view(per_node, nb.slice_pieces[c])
        mine, sb, used = nb.slice_layout[c], nb.slice_bytes[c], payload_nbytes(b - a, fmt)
        unscale = key_factors(rows[:, sb : sb + mine.n_segments], unscale=True)

        def row(r: int) -> torch.Tensor:
            if r == local:  # its own slice: the values, not their rounded copy
                return self.x[a:b].clone()
            return self.g.codec.decode(rows[r, :used], b - a, scale=unscale[r], layout=mine)

        acc = row(0)
        for r in range(1, per_node):
            acc += row(r)
        return acc.div_(per_node)

    def across(self, c: int) -> None:
        """The node's mean of this rank's slice, encoded with its blocks' own keys in M
        pieces (the first chunk's with this rank's layer flags)."""
        nb, fmt = self.nb, self.g.fmt
        mean = self.means[c] = self.node_mean(c)
        own = exponent_keys(
            blocks_amax(mean, nb.slice_layout[c]), fmt, "two_phase", world_size=nb.nodes
        )[0]
        sb, pieces = nb.shard_bytes[c], nb.send[c].view(nb.nodes, nb.pieces[c])
        own_scale = key_factors(own, unscale=False)
        _encode_pieces(self.g, mean, pieces, *self.pieces[c], own_scale, own, sb)
        if c == 0:
            at = sb + nb.slots[c]
            pieces[:, at : at + self.flags.numel()] = self.flags

    def owner(self, c: int) -> None:
        """This rank's shard of the mean over the M nodes, with its blocks' own keys (the
        first chunk's flags OR-ed after them)."""
        nb = self.nb
        s = nb.local_rank * nb.nodes + nb.node
        a, b = nb.bounds[c][s], nb.bounds[c][s + 1]
        sb, rows, out = nb.shard_bytes[c], nb.recv[c].view(nb.nodes, nb.pieces[c]), nb.shard[c]
        s0 = nb.slice_bounds(c, nb.local_rank)[0]
        _owner_keys(
            *(self.g, rows, nb.shard_layouts[c][s], sb, payload_nbytes(b - a, self.g.fmt), out),
            own=self.means.pop(c)[a - s0 : b - s0],  # its node's mean of the shard, not rounded
            own_row=nb.node,
        )
        if c == 0:  # the flags of the ranks of this local rank, OR-ed
            at = sb + nb.slots[c]
            out[at:] = rows[:, at : at + nb.flags].amax(0)

    def decode(self, c: int) -> None:
        """The N gathered shards of chunk c decoded with their owners' keys (the first
        chunk's gathered flags OR-ed first)."""
        nb, sb = self.nb, self.nb.shard_bytes[c]
        n = len(nb.bounds[c]) - 1
        rows = nb.gathered[c].view(n, nb.rows[c])
        if c == 0:
            self.flag(rows[:, sb + nb.slots[c] : sb + nb.slots[c] + nb.flags])
        layouts, firsts = nb.shard_layouts[c], self.firsts[c]
        _decode_shards(self.g, self.x, rows, nb.bounds[c], layouts, firsts, sb, self.unscale)


def _node_chunk_calls(
    g: GroupPlan,
    x: torch.Tensor,
    c: int,
    first: Callable[[], object] | None,
    across: Callable[[], object],
    owner: Callable[[], object],
    decode: Callable[[], object],
) -> ChunkCalls:
    """Chunk c's calls with the plan's buffers they work on, as :func:`two_phase_bound`
    runs them."""
    nb = g.node_blocks
    assert nb is not None
    per_node, nodes, local = nb.ranks_per_node, nb.nodes, nb.local_rank
    splits = None
    first_in = nb.first_send[c]
    if not nb.wire_first:
        bounds, (lo, hi) = nb.bounds[c], g.chunks[c]
        sizes = [bounds[(q + 1) * nodes] - bounds[q * nodes] for q in range(per_node)]
        splits, first_in = (sizes, [sizes[local]] * per_node), x[lo:hi]
    return ChunkCalls(
        *(across, owner, decode, nb.send[c], nb.recv[c], nb.shard[c], nb.across[c]),
        first=first,
        first_in=first_in,
        first_out=nb.first_recv[c],
        splits=splits,
        node_gathered=nb.gathered[c],
    )


def _grid_of(layout: Layout) -> np.ndarray | BlockGrid:
    """What a fused block kernel takes of ``layout``'s blocks: a CPU grid as the grid
    (per layer), else its offsets."""
    return layout.cells if layout.cells is not None else layout.offsets.numpy()


def _block_firsts(layout: Layout, bounds: Sequence[int]) -> np.ndarray:
    """The first block of each piece ``[bounds[i], bounds[i + 1])`` of whole blocks of
    ``layout``, and the end (int64): what the fused kernels walk."""
    wins = [layout.window(a, b) for a, b in itertools.pairwise(bounds)]
    # An empty window's ``first`` is 0: count from the first piece with blocks.
    ends = [next((w.first for w in wins if w.n_segments), 0)]
    for w in wins:
        assert not w.n_segments or w.first == ends[-1], "pieces of consecutive blocks"
        ends.append(ends[-1] + w.n_segments)
    return np.array(ends, dtype=np.int64)


def bind_node_blocks(
    g: GroupPlan,
    x: torch.Tensor,
    keys: torch.Tensor,
    flags: torch.Tensor,
    union: torch.Tensor,
) -> list[ChunkCalls]:
    """Every chunk's calls of the staged route with rank block exponents, bound to ``x`` and
    scratch: the codec's fused ones ("kernels", "triton"), else its own calls, slice by
    slice and shard by shard (:class:`_NodeBlockOps`: "cast", "bits", a Triton variant
    that cannot compile here), with the same bytes.

    Across nodes each chunk is :func:`bind_blocks`' two_phase applied to
    the node's mean of this rank's slice among the M ranks of its local rank;
    the offsets, first blocks and scratch are made here, once per plan.

    Args:
        g: the group's plan (``g.node_blocks`` set).
        x: the group's float32 values.
        keys: this rank's key of every block of the group (uint8), written each step.
        flags: this rank's non-finite flag of every layer (uint8), written each step.
        union: per layer, scratch for every rank's flags.

    Returns:
        Per chunk the calls with the plan's buffers, what the route's one pipeline
        runs (:func:`two_phase_bound`).

    Example:
        >>> calls = transports.bind_node_blocks(g, x, keys, flags, union)  # doctest: +SKIP
        >>> transports.two_phase_bound(calls, groups.inter, count, groups=groups)  # doctest: +SKIP
    """
    nb = g.node_blocks
    assert nb is not None and g.blocks is not None
    per_node, nodes, local = nb.ranks_per_node, nb.nodes, nb.local_rank
    offsets = g.layout.offsets.numpy()
    # Each layer's end in the blocks (per layer, not per block), in the offsets' dtype.
    layer_ends = np.cumsum(g.blocks.counts.numpy()).astype(offsets.dtype)
    calls = []
    for c in range(len(g.chunks)):
        bounds = nb.bounds[c]
        s0 = nb.slice_bounds(c, local)[0]
        mine = nb.slice_layout[c]
        first = None
        if nb.wire_first:
            first = nb.first_send[c], _block_firsts(g.layout, bounds[::nodes]), nb.slice_bytes[c]
        piece_bounds = [b - s0 for b in bounds[local * nodes : (local + 1) * nodes + 1]]
        chunk = NodeBlockChunk(
            x=x,
            keys=keys,
            flags=flags,
            union=union,
            offsets=offsets,
            firsts=_block_firsts(g.layout, bounds),
            layer_ends=layer_ends,
            ranks_per_node=per_node,
            first=first,
            received=nb.first_recv[c],
            slice_offsets=mine.offsets.numpy(),
            piece_firsts=_block_firsts(mine, piece_bounds),
            send=nb.send[c],
            recv=nb.recv[c],
            shard=nb.shard_layouts[c][local * nodes + nb.node].offsets.numpy(),
            out=nb.shard[c],
            gathered=nb.gathered[c],
            shard_bytes=nb.shard_bytes[c],
            at=nb.shard_bytes[c] + nb.slots[c] if c == 0 else -1,
            own_rows=(local, nb.node),
        )
        call = g.codec.bind_node_blocks(chunk)
        if call is None:  # no fused calls here: the codec's own for every chunk
            ops = _NodeBlockOps(g, x, keys, flags, union)
            return [_node_chunk_calls(g, x, c, *ops.bind(c)) for c in range(len(g.chunks))]
        calls.append(_node_chunk_calls(g, x, c, *call))
    return calls
