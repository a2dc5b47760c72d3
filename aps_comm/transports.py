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
- :func:`hierarchical_bound`: per chunk, an FP32 ``all_to_all_single`` inside
  the node and an ordered sum (a reduce-scatter whose order is fixed), two_phase
  of the encoded node sums among the ranks with the same local rank, and an
  ``all_gather`` of the encoded slices inside the node: only the wire format
  crosses nodes. The grid reduction runs the same stages on a virtual grid
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
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from aps_comm.codec import (
    AgreedBlockChunk,
    AgreedMaxima,
    NodeBlockChunk,
    RankBlockCalls,
    RankBlockChunk,
)
from aps_comm.formats import payload_nbytes, pow2
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
    "NodeChunkCalls",
    "agreed_block_calls",
    "all_gather_single",
    "all_reduce_max",
    "bind_agreed_blocks",
    "bind_hierarchical",
    "bind_node_blocks",
    "bind_rank_blocks",
    "fp32_mean",
    "fp32_mean_async",
    "hierarchical_bound",
    "native",
    "node_block_ops",
    "node_spare",
    "rank_block_ops",
    "rows_exchange",
    "two_phase_blocks_bound",
    "two_phase_bound",
    "two_phase_rank_blocks_bound",
]


@dataclasses.dataclass(frozen=True)
class ChunkCalls:
    """One chunk's codec work, bound once (:meth:`aps_comm.codec.Codec.bind_encode` and
    friends): a settled bucket repeats the same calls on the same buffers every step.

    Attributes:
        encode: encodes the chunk into its send region (two_phase: with its padding).
        owner: two_phase: the owner's step into the chunk's shard (None for native sums).
        decode: decodes the chunk's result into the bucket.
        send: the chunk's send region (views made once: slicing costs host time).
        recv: two_phase: the chunk's receive region.
        shard: two_phase: this rank's shard of the chunk.
        gathered: two_phase with block exponents: where the chunk's N shards are
            gathered (else into ``send``).
    """

    encode: Callable[[], object]
    owner: Callable[[], object] | None
    decode: Callable[[], object]
    send: torch.Tensor
    recv: torch.Tensor | None = None
    shard: torch.Tensor | None = None
    gathered: torch.Tensor | None = None


Counter = Callable[[str, int], None]
"""``count(collective, nbytes)``: called for every payload handed to a collective."""


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


def fp32_mean(x: torch.Tensor, group: dist.ProcessGroup, world_size: int, count: Counter) -> None:
    """Average float32 ``x`` over the ranks in place (``allreduce_hook``'s arithmetic)."""
    x.div_(world_size)
    count("all_reduce", x.numel() * x.element_size())
    _wait(dist.all_reduce(x, group=group, async_op=True), "the FP32 all-reduce")


def fp32_mean_async(
    x: torch.Tensor, group: dist.ProcessGroup, world_size: int, count: Counter
) -> torch.futures.Future:
    """:func:`fp32_mean` without waiting: ``allreduce_hook``'s arithmetic, its future.

    The future holds ``x`` (averaged in place) once the all-reduce is done.
    """
    x.div_(world_size)
    count("all_reduce", x.numel() * x.element_size())
    work = dist.all_reduce(x, group=group, async_op=True)
    return work.get_future().then(_first)


def _first(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()[0]


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
    g: GroupPlan,
    x: torch.Tensor,
    scale: torch.Tensor | AgreedMaxima,
    unscale: torch.Tensor | AgreedMaxima,
    group: dist.ProcessGroup,
    count: Counter,
    after_encode: Callable[[int, torch.Tensor], None] | None = None,
    defer: bool = False,
    calls: Sequence[ChunkCalls] | None = None,
) -> Callable[[], None] | None:
    """Average ``x`` with one native all-reduce per chunk in the wire dtype.

    Args:
        g: the group's plan (``reduction == "allreduce"``).
        x: the group's float32 values; the result is written back into it.
        scale: per-layer factors applied before encoding (or the agreed maxima they come from).
        unscale: per-layer factors applied after decoding, including 1/N (or
            the agreed maxima they come from).
        group: the process group.
        count: byte counter.
        after_encode: called with (chunk, payload) after each chunk is encoded.
        defer: leave the last chunk in flight and return a function that waits
            for it and decodes it: the caller can start the next bucket first.
        calls: the chunks' codec work bound once (a settled bucket), in place
            of the codec calls with ``scale`` and ``unscale``.

    Returns:
        With ``defer``, the function that finishes the bucket; else None.
    """
    dtype = g.fmt.torch_dtype
    pending: list[tuple[int, dist.Work]] = []
    for c, ((lo, hi), (r0, r1)) in enumerate(zip(g.chunks, g.regions, strict=True)):
        if calls is not None:
            payload = calls[c].send
            calls[c].encode()
        else:
            payload = g.send[r0:r1]
            g.codec.encode(x[lo:hi], out=payload, scale=scale, layout=g.windows[c])
        if after_encode is not None:
            after_encode(c, payload)
        count("all_reduce", payload.numel())
        pending.append((c, dist.all_reduce(payload.view(dtype), group=group, async_op=True)))
        if len(pending) > 1:
            _decode(g, x, unscale, *pending.pop(0), calls)
    return _finish(pending, functools.partial(_decode, g, x, unscale, calls=calls), defer)


def _finish(
    tail: list[tuple[int, dist.Work]], finish_one: Callable[..., None], defer: bool
) -> Callable[[], None] | None:
    """Wait for and decode the chunks still in flight, now or in the returned function."""

    def finish() -> None:
        for chunk, work in tail:
            finish_one(chunk, work)

    if defer:
        return finish
    finish()
    return None


def _decode(
    g: GroupPlan,
    x: torch.Tensor,
    unscale: torch.Tensor | AgreedMaxima,
    c: int,
    work: dist.Work,
    calls: Sequence[ChunkCalls] | None = None,
) -> None:
    """Wait for chunk ``c``'s last collective, then decode it into ``x`` (two_phase: the
    gathered shards, native: the summed payload; both sit in the send region)."""
    last = "all_gather" if g.reduction == "two_phase" else f"{g.fmt.name} all-reduce"
    _wait(work, f"the {last} of chunk {c + 1} of {len(g.chunks)}")
    if calls is not None:
        calls[c].decode()
        return
    lo, hi = g.chunks[c]
    r0, r1 = g.regions[c]
    g.codec.decode(g.send[r0:r1], hi - lo, out=x[lo:hi], scale=unscale, layout=g.windows[c])


def two_phase_bound(
    calls: Sequence[ChunkCalls],
    group: dist.ProcessGroup,
    count: Counter,
    defer: bool = False,
) -> Callable[[], None] | None:
    """two_phase over a bound bucket: every chunk's codec work and buffers bound.

    The same collectives, in the same order, and the same bytes; per chunk
    three bound calls and no slicing, lookups or checks on the host.

    Args:
        calls: each chunk's bound work, with its ``send``, ``recv`` and
            ``shard`` views (:meth:`aps_comm.engine.Steady.bind`).
        group: the process group.
        count: byte counter.
        defer: leave the last chunks in flight and return the function that finishes them.

    Returns:
        With ``defer``, the function that finishes the bucket; else None.
    """

    def send(c: int) -> tuple[torch.Tensor, torch.Tensor]:
        cc = calls[c]
        cc.encode()
        return cc.send, cc.recv  # type: ignore[return-value]  # two_phase: bound with recv

    def owner(p: int) -> tuple[torch.Tensor, torch.Tensor]:
        cc = calls[p]
        cc.owner()  # type: ignore[misc]
        # The chunk's send region is free once its all-to-all is done.
        return cc.shard, cc.send  # type: ignore[return-value]

    def decode(c: int) -> None:
        calls[c].decode()

    return _bound_pipeline(len(calls), send, owner, decode, group, count, defer)


def _bound_pipeline(
    k: int,
    send: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    owner: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    decode: Callable[[int], None],
    group: dist.ProcessGroup,
    count: Counter,
    defer: bool,
) -> Callable[[], None] | None:
    """two_phase's chunk order over bound steps: ``send(c)`` fills chunk c's
    exchange and gives (send, recv); ``owner(p)`` makes this rank's shard and gives
    (shard, gathered); ``decode(c)`` decodes chunk c's gathered shards."""
    exchanges: list[dist.Work | None] = [None] * k
    gathers: list[dist.Work | None] = [None] * k
    tail: list[tuple[int, dist.Work]] = []

    def finish(c: int, work: dist.Work) -> None:
        _wait(work, f"the all_gather of chunk {c + 1} of {k}")
        decode(c)

    for c in range(k + 2):
        if c < k:
            out, into = send(c)
            count("all_to_all", out.numel())
            exchanges[c] = dist.all_to_all_single(into, out, group=group, async_op=True)
        if 1 <= c <= k:
            p = c - 1
            _wait(exchanges[p], f"the all_to_all of chunk {c} of {k}")  # type: ignore[arg-type]
            shard, gathered = owner(p)
            count("all_gather", shard.numel())
            gathers[p] = all_gather_single(gathered, shard, group=group, async_op=True)
        if c >= 2:
            tail.append((c - 2, gathers[c - 2]))  # type: ignore[arg-type]
            if c < k or not defer:
                finish(*tail.pop())
    return _finish(tail, finish, defer)


def agreed_block_calls(
    g: GroupPlan,
    x: torch.Tensor,
    factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rank: int,
    world_size: int,
) -> list[ChunkCalls]:
    """Every chunk's steps of two_phase with agreed block exponents by the codec's calls, shard by shard
    (every backend): what :func:`two_phase_blocks_bound` runs, for one step or bound to a
    settled bucket (the backends without fused kernels: ``factors`` refilled in place).

    Args:
        g: the group's plan (``g.block_shards`` with agreed exponents).
        x: the group's float32 values; the result is written back into it.
        factors: the agreed factor, exponent (int32) of every block of the group and
            whether its layer is finite everywhere, read when the calls run.
        rank: this rank: the shard it owns.
        world_size: ranks N.

    Returns:
        One :class:`ChunkCalls` per chunk, with its ``send``, ``recv``, ``shard`` and
        ``gathered`` views.
    """
    sh = g.block_shards
    assert sh is not None and not sh.rank_exponents
    fmt, n, (scale, exponents, finite) = g.fmt, world_size, factors

    def send(c: int, s: int, a: int, b: int, piece: torch.Tensor) -> None:
        used = payload_nbytes(b - a, fmt)
        g.codec.encode(x[a:b], out=piece[:used], scale=scale, layout=sh.windows[c][s])
        piece[used:].zero_()  # padding: code 0 is +0 in every format

    def owner(p: int, rows: torch.Tensor, a: int, b: int, out: torch.Tensor) -> None:
        mine, sb = sh.layouts[p][rank], sh.shard_bytes[p]
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

    send_chunk, decode = _shard_by_shard(g, send), _decode_by_shard(g, x, unscale, n)
    calls = []
    for c in range(len(g.chunks)):
        (r0, r1), (s0, s1), (q0, q1) = g.regions[c], g.shard_regions[c], sh.gather_regions[c]
        out, (a, b) = g.shards[s0:s1], sh.bounds[c][rank : rank + 2]
        pieces = (g.send[r0:r1].view(n, sh.pieces[c]), g.recv[r0:r1].view(n, sh.pieces[c]))
        calls.append(
            ChunkCalls(
                functools.partial(send_chunk, c, pieces[0]),
                functools.partial(owner, c, pieces[1], a, b, out),
                functools.partial(decode, c),
                g.send[r0:r1],
                g.recv[r0:r1],
                out,
                sh.gathered[q0:q1],
            )
        )
    return calls


def two_phase_blocks_bound(
    calls: Sequence[ChunkCalls],
    group: dist.ProcessGroup,
    count: Counter,
    defer: bool = False,
) -> Callable[[], None] | None:
    """two_phase with agreed block exponents through calls bound once (:func:`bind_agreed_blocks`).

    The same collectives, in the same order, and the same bytes; each chunk
    is three kernel calls (send, owner, decode), whatever the number of
    ranks, layers or blocks. The agreed keys and the layers' non-finite
    flags the calls read are written before.

    Args:
        calls: each chunk's bound calls, with its ``send``, ``recv``, ``shard``
            and ``gathered`` views.
        group: the process group.
        count: byte counter.
        defer: leave the last chunks in flight and return the function that finishes them.

    Returns:
        With ``defer``, the function that finishes the bucket; else None.
    """

    def send(c: int) -> tuple[torch.Tensor, torch.Tensor]:
        cc = calls[c]
        cc.encode()
        return cc.send, cc.recv  # type: ignore[return-value]  # bound with recv

    def owner(p: int) -> tuple[torch.Tensor, torch.Tensor]:
        cc = calls[p]
        cc.owner()  # type: ignore[misc]
        return cc.shard, cc.gathered  # type: ignore[return-value]  # bound with both

    def decode(c: int) -> None:
        calls[c].decode()

    return _bound_pipeline(len(calls), send, owner, decode, group, count, defer)


def bind_agreed_blocks(
    g: GroupPlan, x: torch.Tensor, keys: torch.Tensor, union: torch.Tensor, rank: int
) -> list[ChunkCalls] | None:
    """Every chunk's fused calls of two_phase with agreed block exponents, bound to ``x`` and scratch.

    Args:
        g: the group's plan (``g.block_shards`` with agreed exponents).
        x: the group's float32 values.
        keys: the agreed key of every block of the group (uint8), written each step.
        union: per layer, scratch: whether any of its agreed keys is non-finite
            (written by the first chunk's owner step, read by every decode).
        rank: this rank.

    Returns:
        One :class:`ChunkCalls` per chunk, or None where the codec has no fused
        kernels for them.
    """
    sh = g.block_shards
    assert sh is not None and not sh.rank_exponents and g.blocks is not None
    counts = g.blocks.counts.numpy()  # the host copy the plan keeps
    # The CPU kernels take the plan's grids (nothing kept per block) and index in int32.
    host = g.codec.backend == "kernels" and x.device.type == "cpu"
    wide = np.int32 if host and g.layout.numel < 2**31 else np.int64
    offsets = _grid_of(g.layout) if host else g.layout.offsets.numpy().astype(np.int64)
    layer_of = np.repeat(np.arange(counts.size, dtype=wide), counts)
    calls = []
    for c in range(len(g.chunks)):
        firsts, mine = _block_firsts(g.layout, sh.bounds[c]), sh.layouts[c][rank]
        (r0, r1), (s0, s1), (q0, q1) = g.regions[c], g.shard_regions[c], sh.gather_regions[c]
        send, recv, out, gathered = (
            g.send[r0:r1],
            g.recv[r0:r1],
            g.shards[s0:s1],
            sh.gathered[q0:q1],
        )
        chunk = AgreedBlockChunk(
            offsets,
            firsts,
            layer_of,
            _grid_of(mine) if host else mine.offsets.numpy().astype(np.int64),
            int(firsts[rank]),
            send,
            recv,
            out,
            gathered,
            sh.shard_bytes[c],
            counts.astype(np.int64) if c == 0 else None,
        )
        bound = g.codec.bind_agreed_blocks(x, keys, union, chunk)
        if bound is None:
            return None
        calls.append(ChunkCalls(*bound, send, recv, out, gathered))
    return calls


@dataclasses.dataclass
class _RankBlockOps:
    """Two_phase with every rank's own block exponents as the codec's own calls, shard by
    shard (:func:`rank_block_ops`). The first chunk's send makes the factors of this
    rank's keys, its owner step the blocks of the layers any rank flagged: later chunks
    read both, in the same step."""

    g: GroupPlan
    x: torch.Tensor
    keys: torch.Tensor
    flags: torch.Tensor
    union: torch.Tensor
    rank: int
    scale: torch.Tensor | None = None
    bad: torch.Tensor | None = None  # per block: its layer is non-finite on some rank

    @property
    def sh(self) -> BlockShards:
        assert self.g.block_shards is not None
        return self.g.block_shards

    def send(self, c: int, pieces: torch.Tensor, log2: int) -> None:
        g, sh, keys, flags = self.g, self.sh, self.keys, self.flags
        if c == 0:
            self.scale = key_factors(keys, unscale=False)
        sb = sh.shard_bytes[c]
        for s, (a, b) in enumerate(itertools.pairwise(sh.bounds[c])):
            piece, used = pieces[s], payload_nbytes(b - a, g.fmt)
            first, blocks = sh.windows[c][s].first, sh.windows[c][s].n_segments
            g.codec.encode(self.x[a:b], out=piece[:used], scale=self.scale, layout=sh.windows[c][s])
            piece[used:].zero_()  # padding: code 0 is +0 in every format
            piece[sb : sb + blocks] = keys[first : first + blocks]
            if c == 0:
                at = sb + sh.slots[0]
                piece[at : at + flags.numel()] = flags
                # fill_ takes the value as a kernel argument; an assignment of a host
                # value would copy it to the device and wait for the stream.
                piece[at + flags.numel() : at + flags.numel() + 1].fill_(log2)

    def owner(self, p: int, rows: torch.Tensor, out: torch.Tensor) -> int:
        g, sh, nl = self.g, self.sh, self.flags.numel()
        a, b = sh.bounds[p][self.rank : self.rank + 2]
        sb, mine, n = sh.shard_bytes[p], sh.layouts[p][self.rank], rows.shape[0]
        log2 = 0
        if p == 0:
            at = sb + sh.slots[0]
            torch.amax(rows[:, at : at + nl], 0, out=self.union)
            assert g.blocks is not None
            self.bad = torch.repeat_interleave(
                self.union != 0, g.blocks.device_counts, output_size=g.layout.n_segments
            )
            if rows.device.type == "cpu":  # CPU buckets agree chunks from timing
                log2 = int(rows[:, at + nl].max())
        used, blocks = payload_nbytes(b - a, g.fmt), mine.n_segments
        unscale = key_factors(rows[:, sb : sb + blocks], unscale=True)
        _, d = g.codec.owner_reduce_rank_blocks(rows.reshape(-1), n, mine, unscale, out=out[:used])
        out[used:sb].zero_()
        out[sb : sb + blocks] = 127 - d  # a key (zero and non-finite blocks: d = 0)
        out[sb + blocks :].zero_()
        return log2

    def unscale(self, b0: int, b1: int, k: torch.Tensor) -> torch.Tensor:
        assert self.bad is not None  # the first chunk's owner step made it
        return torch.where(self.bad[b0:b1], float("nan"), key_factors(k, unscale=True))


def rank_block_ops(
    g: GroupPlan,
    x: torch.Tensor,
    keys: torch.Tensor,
    flags: torch.Tensor,
    union: torch.Tensor,
    rank: int,
) -> list[RankBlockCalls]:
    """Every chunk's calls of two_phase with rank block exponents as the codec's own calls, shard
    by shard (encode, :meth:`aps_comm.codec.Codec.owner_reduce_rank_blocks`, decode and a
    few torch ops per shard), bound to ``x`` and scratch: the bytes of the fused calls
    (:func:`bind_rank_blocks`) on any backend, with no host read off the CPU.

    Args:
        g: the group's plan (``g.block_shards`` with ``rank_exponents``).
        x: the group's float32 values.
        keys: this rank's key of every block of the group (uint8), read when the calls run.
        flags: this rank's non-finite flag of every layer (uint8), read when the calls run.
        union: per layer, scratch for every rank's flags OR-ed.
        rank: this rank.

    Example:
        >>> calls = transports.rank_block_ops(g, x, keys, flags, union, 0)  # doctest: +SKIP
        >>> transports.two_phase_rank_blocks_bound(calls, group, count)  # doctest: +SKIP
    """
    sh = g.block_shards
    assert sh is not None and sh.rank_exponents
    ops = _RankBlockOps(g, x, keys, flags, union, rank)
    n = len(sh.bounds[0]) - 1
    decode = _decode_by_shard(g, x, ops.unscale, n)
    calls = []
    for c in range(len(g.chunks)):
        (r0, r1), (s0, s1), (q0, q1) = g.regions[c], g.shard_regions[c], sh.gather_regions[c]
        send, recv, out = g.send[r0:r1], g.recv[r0:r1], g.shards[s0:s1]
        calls.append(
            RankBlockCalls(
                functools.partial(ops.send, c, send.view(n, sh.pieces[c])),
                functools.partial(ops.owner, c, recv.view(n, sh.pieces[c]), out),
                functools.partial(decode, c),
                (send, recv, out, sh.gathered[q0:q1]),
            )
        )
    return calls


def two_phase_rank_blocks_bound(
    calls: Sequence[RankBlockCalls],
    group: dist.ProcessGroup,
    count: Counter,
    defer: bool = False,
    chunk_log2: int = 0,
    on_chunk: Callable[[int], None] | None = None,
) -> Callable[[], None] | None:
    """two_phase with rank block exponents through calls bound once (:func:`bind_rank_blocks`).

    The same collectives, in the same order, and the same bytes; each chunk
    is three kernel calls (send, owner, decode), whatever the number of
    ranks, layers or blocks. The keys and layer flags the calls read are
    written before (:meth:`aps_comm.codec.Codec.bind_block_keys`). The
    calls' ``exchange`` views (:func:`bind_rank_blocks`) spare the host
    any slicing.

    Args:
        calls: each chunk's bound calls.
        group: the process group.
        count: byte counter.
        defer: leave the last chunks in flight and return the function that finishes them.
        chunk_log2: this rank's preferred chunk, sent with the first chunk.
        on_chunk: called with the ranks' largest preferred chunk (log2).
    """

    def send(c: int) -> tuple[torch.Tensor, torch.Tensor]:
        cc = calls[c]
        cc.send(chunk_log2 if c == 0 else 0)
        return cc.exchange[0], cc.exchange[1]

    def owner(p: int) -> tuple[torch.Tensor, torch.Tensor]:
        cc = calls[p]
        log2 = cc.owner()
        if p == 0 and on_chunk is not None:
            on_chunk(log2)
        return cc.exchange[2], cc.exchange[3]

    def decode(c: int) -> None:
        calls[c].decode()

    return _bound_pipeline(len(calls), send, owner, decode, group, count, defer)


def bind_rank_blocks(
    g: GroupPlan,
    x: torch.Tensor,
    keys: torch.Tensor,
    flags: torch.Tensor,
    union: torch.Tensor,
    rank: int,
) -> list[RankBlockCalls]:
    """Every chunk's calls of two_phase with rank block exponents, bound to ``x`` and scratch: the
    codec's fused ones ("kernels", "triton"), else its own calls (:func:`rank_block_ops`:
    "cast", "bits", a Triton variant that cannot compile here), with the same bytes.

    Args:
        g: the group's plan (``g.block_shards`` with ``rank_exponents``).
        x: the group's float32 values.
        keys: this rank's key of every block of the group (uint8), written each step.
        flags: this rank's non-finite flag of every layer (uint8), written each step.
        union: per layer, scratch for every rank's flags.
        rank: this rank.

    Returns:
        One :class:`aps_comm.codec.RankBlockCalls` per chunk.
    """
    sh = g.block_shards
    assert sh is not None and sh.rank_exponents and g.blocks is not None
    # A CPU plan's blocks go as their grid (per layer: the kernels derive the offsets).
    offsets = _grid_of(g.layout)
    dtype = offsets.dtype if isinstance(offsets, np.ndarray) else offsets.np_dtype
    # Each layer's end in the blocks (per layer, not per block), in the offsets' dtype.
    layer_ends = np.cumsum(g.blocks.counts.numpy()).astype(dtype)
    calls = []
    for c in range(len(g.chunks)):
        firsts = _block_firsts(g.layout, sh.bounds[c])
        (r0, r1), (s0, s1), (q0, q1) = g.regions[c], g.shard_regions[c], sh.gather_regions[c]
        chunk = RankBlockChunk(
            offsets=offsets,
            firsts=firsts,
            layer_ends=layer_ends,
            shard=_grid_of(sh.layouts[c][rank]),
            send=g.send[r0:r1],
            recv=g.recv[r0:r1],
            out=g.shards[s0:s1],
            gathered=sh.gathered[q0:q1],
            shard_bytes=sh.shard_bytes[c],
            at=sh.shard_bytes[0] + sh.slots[0] if c == 0 else -1,
        )
        call = g.codec.bind_rank_blocks(x, keys, flags, union, chunk)
        if call is None:  # no fused calls here: the codec's own, with the same bytes
            return rank_block_ops(g, x, keys, flags, union, rank)
        calls.append(call)
    return calls


def _shard_by_shard(
    g: GroupPlan, send: Callable[[int, int, int, int, torch.Tensor], None]
) -> Callable[[int, torch.Tensor], None]:
    """A chunk's exchange filled by ``send(c, s, a, b, piece)`` once per shard s (elements ``[a, b)``)."""
    sh = g.block_shards
    assert sh is not None

    def send_chunk(c: int, pieces: torch.Tensor) -> None:
        for s, (a, b) in enumerate(itertools.pairwise(sh.bounds[c])):
            send(c, s, a, b, pieces[s])

    return send_chunk


def _decode_by_shard(
    g: GroupPlan,
    x: torch.Tensor,
    unscale: Callable[[int, int, torch.Tensor], torch.Tensor],
    n: int,
) -> Callable[[int], None]:
    """A chunk's gathered shards decoded one by one; ``unscale(b0, b1, sent)`` gives the
    factors of the chunk's blocks ``[b0, b1)`` from the bytes their owners sent (uint8)."""
    sh = g.block_shards
    assert sh is not None
    fmt = g.fmt

    def decode(c: int) -> None:
        q0, q1 = sh.gather_regions[c]
        sb = sh.shard_bytes[c]
        gathered = sh.gathered[q0:q1]
        rows = gathered.view(n, sb + sh.slots[c])
        for s, (a, b) in enumerate(itertools.pairwise(sh.bounds[c])):
            if a == b:
                continue
            # The shard's blocks, unscaled by what its owner sent after its payload
            # (read in place: no index of the exponents is kept per bucket).
            first, blocks = sh.windows[c][s].first, sh.layouts[c][s].n_segments
            g.codec.decode(
                rows[s, : payload_nbytes(b - a, fmt)],
                b - a,
                out=x[a:b],
                scale=unscale(first, first + blocks, rows[s, sb : sb + blocks]),
                layout=sh.layouts[c][s],
            )

    return decode


@dataclasses.dataclass(frozen=True)
class NodeChunkCalls:
    """One chunk of a staged route (hierarchical or grid), bound: its codec work around the
    route's four collectives and the buffers they move (views made once).

    Attributes:
        first: grid: the chunk encoded with the first level's factors into
            ``first_in``; None for hierarchical (the first level is FP32).
        across: the node's sum of this rank's slice (from ``first_out``) encoded into ``send``.
        owner: the mean of the M received node sums (``recv``) encoded into ``shard``.
        decode: the gathered chunk (``gathered``) decoded into the values.
        first_in: what the first exchange sends (the values' chunk, or grid's encoded chunk).
        first_out: what it receives: the node's L slices of this rank's.
        send: this rank's encoded slice, exchanged across nodes into ``recv``.
        recv: the M encoded node sums of this rank's shard.
        shard: this rank's encoded shard of the mean, gathered across nodes into
            ``across_out``.
        across_out: the encoded slice of the mean, gathered in the node into ``gathered``.
        gathered: the chunk's encoded mean.
        splits: hierarchical: the first exchange's input and output split sizes.
    """

    first: Callable[[], object] | None
    across: Callable[[], object]
    owner: Callable[[], object]
    decode: Callable[[], object]
    first_in: torch.Tensor
    first_out: torch.Tensor
    send: torch.Tensor
    recv: torch.Tensor
    shard: torch.Tensor
    across_out: torch.Tensor
    gathered: torch.Tensor
    splits: tuple[list[int], list[int]] | None = None


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
) -> list[NodeChunkCalls]:
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
        >>> transports.hierarchical_bound(calls, groups, count)  # doctest: +SKIP
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
        decode = codec.bind_decode(g.send[r0:], x[lo:hi], unscale, g.windows[c])
        calls.append(
            NodeChunkCalls(
                send_first,
                across,
                owner,
                decode,
                first_in,
                sums,
                send,
                recv,
                shard,
                node.encoded[e0:e1],
                gathered,
                splits,
            )
        )
    return calls


def hierarchical_bound(
    calls: Sequence[NodeChunkCalls],
    groups: NodeGroups,
    count: Counter,
    defer: bool = False,
) -> Callable[[], None] | None:
    """The staged route over every chunk's bound calls (:func:`bind_hierarchical`).

    Stage s of chunk c runs at step c + s, later stages first (:func:`_staged`):
    the same collectives, in the same order, and the same bytes, whatever
    bound the calls.

    Args:
        calls: each chunk's calls and buffers.
        groups: this rank's intra- and inter-node groups.
        count: byte counter.
        defer: leave the last chunks in flight and return the function that finishes them.

    Returns:
        With ``defer``, the function that finishes the bucket; else None.
    """
    k = len(calls)
    works: dict[tuple[int, int], dist.Work] = {}

    def wait(c: int, stage: int, what: str) -> None:
        _wait(works.pop((c, stage)), f"the {what} of chunk {c + 1} of {k}")

    def exchange_in_node(c: int) -> None:
        cc = calls[c]
        source = cc.first_in
        count("node_all_to_all", source.numel() * source.element_size())
        if cc.first is not None:
            cc.first()
        sizes = cc.splits or (None, None)
        works[c, 0] = dist.all_to_all_single(
            cc.first_out,
            source,
            output_split_sizes=sizes[1],
            input_split_sizes=sizes[0],
            group=groups.intra,
            async_op=True,
        )

    def exchange_across_nodes(c: int) -> None:
        cc = calls[c]
        wait(c, 0, "first-level all_to_all" if cc.first else "in-node FP32 all_to_all")
        cc.across()
        count("all_to_all", cc.send.numel())
        works[c, 1] = dist.all_to_all_single(cc.recv, cc.send, group=groups.inter, async_op=True)

    def reduce_shard(c: int) -> None:
        cc = calls[c]
        wait(c, 1, "across-node all_to_all")
        cc.owner()
        count("all_gather", cc.shard.numel())
        # The slice's bytes are free once its all-to-all is done.
        works[c, 2] = all_gather_single(cc.across_out, cc.shard, group=groups.inter, async_op=True)

    def gather_in_node(c: int) -> None:
        cc = calls[c]
        wait(c, 2, "across-node all_gather")
        count("node_all_gather", cc.across_out.numel())
        works[c, 3] = all_gather_single(
            cc.gathered, cc.across_out, group=groups.intra, async_op=True
        )

    def decode(c: int) -> None:
        wait(c, 3, "in-node all_gather")
        calls[c].decode()

    stages = (exchange_in_node, exchange_across_nodes, reduce_shard, gather_in_node, decode)
    return _staged(k, stages, defer)


@dataclasses.dataclass
class _NodeBlockOps:
    """the staged route's, with rank block exponents, codec work as the codec's own calls, slice by slice
    and shard by shard (:func:`node_block_ops`). Grid's first encode of the first chunk
    makes the factors of this rank's keys, the first chunk's decode the blocks of the
    layers any rank flagged: later chunks read both, in the same step."""

    g: GroupPlan
    x: torch.Tensor
    keys: torch.Tensor
    flags: torch.Tensor
    union: torch.Tensor
    scale: torch.Tensor | None = None
    bad: torch.Tensor | None = None  # per block: its layer is non-finite on some rank
    means: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # per chunk
    # Per chunk, made once (a window's layout costs host copies): grid's slices of the
    # group, the pieces of this rank's slice, each shard's first block in the group.
    slices: list[list[Layout]] = dataclasses.field(default_factory=list)
    pieces: list[list[Layout]] = dataclasses.field(default_factory=list)
    firsts: list[list[int]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        nb, layout = self.nb, self.g.layout
        nodes, local = nb.nodes, nb.local_rank
        for c in range(len(self.g.chunks)):
            bounds, s0 = nb.bounds[c], nb.slice_bounds(c, local)[0]
            slices = [nb.slice_bounds(c, q) for q in range(nb.ranks_per_node)]
            self.slices.append([layout.window(a, b) for a, b in slices] if nb.wire_first else [])
            mine = bounds[local * nodes : (local + 1) * nodes + 1]
            self.pieces.append(
                [nb.slice_layout[c].window(a - s0, b - s0) for a, b in itertools.pairwise(mine)]
            )
            self.firsts.append(
                [layout.window(a, b).first if b > a else 0 for a, b in itertools.pairwise(bounds)]
            )

    @property
    def nb(self) -> NodeBlocks:
        assert self.g.node_blocks is not None
        return self.g.node_blocks

    def first(self, c: int) -> None:
        """Grid: this rank's L slices of chunk c encoded with its own keys, each followed by
        its blocks' keys."""
        g, nb, fmt, keys = self.g, self.nb, self.g.fmt, self.keys
        if c == 0:
            self.scale = key_factors(keys, unscale=False)
        pieces = nb.first_send[c].view(nb.ranks_per_node, nb.slice_pieces[c])
        sb = nb.slice_bytes[c]
        for q, win in enumerate(self.slices[c]):
            a, b = nb.slice_bounds(c, q)
            used = payload_nbytes(b - a, fmt)
            piece = pieces[q]
            if b > a:
                g.codec.encode(self.x[a:b], out=piece[:used], scale=self.scale, layout=win)
                piece[sb : sb + win.n_segments] = keys[win.first : win.first + win.n_segments]
            piece[used:sb].zero_()  # padding: code 0 is +0 in every format
            piece[sb + win.n_segments :].zero_()

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
        nb, fmt, codec = self.nb, self.g.fmt, self.g.codec
        nodes, local = nb.nodes, nb.local_rank
        mean = self.means[c] = self.node_mean(c)
        mine = nb.slice_layout[c]
        own = exponent_keys(blocks_amax(mean, mine), fmt, "two_phase", world_size=nodes)[0]
        own_scale = key_factors(own, unscale=False)
        s0, _ = nb.slice_bounds(c, local)
        bounds, sb, slot = nb.bounds[c], nb.shard_bytes[c], nb.slots[c]
        pieces = nb.send[c].view(nodes, nb.pieces[c])
        for j, win in enumerate(self.pieces[c]):
            a, b = bounds[local * nodes + j] - s0, bounds[local * nodes + j + 1] - s0
            used = payload_nbytes(b - a, fmt)
            piece = pieces[j]
            if b > a:
                codec.encode(mean[a:b], out=piece[:used], scale=own_scale, layout=win)
                piece[sb : sb + win.n_segments] = own[win.first : win.first + win.n_segments]
            piece[used:sb].zero_()
            piece[sb + win.n_segments :].zero_()
            if c == 0:
                piece[sb + slot : sb + slot + self.flags.numel()] = self.flags

    def owner(self, c: int) -> None:
        """This rank's shard of the mean over the M nodes, with its blocks' own keys (the
        first chunk's flags OR-ed after them)."""
        nb, fmt = self.nb, self.g.fmt
        nodes, local = nb.nodes, nb.local_rank
        s = local * nodes + nb.node
        mine = nb.shard_layouts[c][s]
        a, b = nb.bounds[c][s], nb.bounds[c][s + 1]
        sb, slot, blocks = nb.shard_bytes[c], nb.slots[c], mine.n_segments
        rows = nb.recv[c].view(nodes, nb.pieces[c])
        out = nb.shard[c]
        used = payload_nbytes(b - a, fmt)
        unscale = key_factors(rows[:, sb : sb + blocks], unscale=True)
        s0, _ = nb.slice_bounds(c, local)
        _, d = self.g.codec.owner_reduce_rank_blocks(
            nb.recv[c],
            nodes,
            mine,
            unscale.contiguous(),
            out=out[:used],
            own=self.means.pop(c)[a - s0 : b - s0],  # its node's mean of the shard, not rounded
            own_row=nb.node,
        )
        out[used:sb].zero_()
        out[sb : sb + blocks] = 127 - d  # a key (zero and non-finite blocks: d = 0)
        out[sb + blocks :].zero_()
        if c == 0:  # the flags of the ranks of this local rank, OR-ed
            out[sb + slot :] = rows[:, sb + slot : sb + slot + nb.flags].amax(0)

    def decode(self, c: int) -> None:
        """The N gathered shards of chunk c decoded with their owners' keys (the first
        chunk's gathered flags OR-ed first)."""
        g, nb, fmt, layout = self.g, self.nb, self.g.fmt, self.g.layout
        sb, slot, n = nb.shard_bytes[c], nb.slots[c], len(nb.bounds[c]) - 1
        rows = nb.gathered[c].view(n, nb.rows[c])
        if c == 0:
            torch.amax(rows[:, sb + slot : sb + slot + nb.flags], 0, out=self.union)
            # Per block, from the layers' block counts: no per-block index is kept.
            assert g.blocks is not None  # node_blocks has blocks
            self.bad = torch.repeat_interleave(
                self.union != 0, g.blocks.device_counts, output_size=layout.n_segments
            )
        assert self.bad is not None
        bounds = nb.bounds[c]
        for s in range(n):
            a, b = bounds[s], bounds[s + 1]
            if a == b:
                continue
            mine, b0 = nb.shard_layouts[c][s], self.firsts[c][s]
            factors = key_factors(rows[s, sb : sb + mine.n_segments], unscale=True)
            factors = torch.where(self.bad[b0 : b0 + mine.n_segments], float("nan"), factors)
            g.codec.decode(
                rows[s, : payload_nbytes(b - a, fmt)],
                b - a,
                out=self.x[a:b],
                scale=factors,
                layout=mine,
            )


def node_block_ops(
    g: GroupPlan, x: torch.Tensor, keys: torch.Tensor, flags: torch.Tensor, union: torch.Tensor
) -> list[NodeChunkCalls]:
    """Every chunk's calls of the staged route with rank block exponents as the codec's own calls, slice
    by slice and shard by shard, bound to ``x`` and scratch: the bytes of the fused calls
    (:func:`bind_node_blocks`) on any backend, with no host read off the CPU.

    Args:
        g: the group's plan (``g.node_blocks`` set).
        x: the group's float32 values.
        keys: this rank's key of every block of the group (uint8), read when the calls run.
        flags: this rank's non-finite flag of every layer (uint8), read when the calls run.
        union: per layer, scratch for every rank's flags OR-ed.

    Example:
        >>> calls = transports.node_block_ops(g, x, keys, flags, union)  # doctest: +SKIP
        >>> transports.hierarchical_bound(calls, groups, count)  # doctest: +SKIP
    """
    ops = _NodeBlockOps(g, x, keys, flags, union)
    wire_first = ops.nb.wire_first
    return [
        _node_chunk_calls(
            g,
            x,
            c,
            (
                functools.partial(ops.first, c) if wire_first else None,
                functools.partial(ops.across, c),
                functools.partial(ops.owner, c),
                functools.partial(ops.decode, c),
            ),
        )
        for c in range(len(g.chunks))
    ]


def _node_chunk_calls(
    g: GroupPlan,
    x: torch.Tensor,
    c: int,
    calls: tuple[
        Callable[[], object] | None,
        Callable[[], object],
        Callable[[], object],
        Callable[[], object],
    ],
) -> NodeChunkCalls:
    """Chunk c's ``calls`` (first, across, owner, decode) with the plan's buffers they
    work on, as :func:`hierarchical_bound` runs them."""
    nb = g.node_blocks
    assert nb is not None
    per_node, nodes, local = nb.ranks_per_node, nb.nodes, nb.local_rank
    splits = None
    first_in = nb.first_send[c]
    if not nb.wire_first:
        bounds, (lo, hi) = nb.bounds[c], g.chunks[c]
        sizes = [bounds[(q + 1) * nodes] - bounds[q * nodes] for q in range(per_node)]
        splits, first_in = (sizes, [sizes[local]] * per_node), x[lo:hi]
    return NodeChunkCalls(
        *calls,
        first_in,
        nb.first_recv[c],
        nb.send[c],
        nb.recv[c],
        nb.shard[c],
        nb.across[c],
        nb.gathered[c],
        splits,
    )


def _staged(
    k: int, stages: Sequence[Callable[[int], None]], defer: bool
) -> Callable[[], None] | None:
    """Run stage s of chunk c at step c + s, later stages first (the same collective
    order on every rank); with ``defer`` the last chunk's last stage is returned."""
    last = len(stages) - 1
    for step in range(k + last):
        for s in range(last, -1, -1):
            c = step - s
            if 0 <= c < k and not (defer and s == last and c == k - 1):
                stages[s](c)
    return functools.partial(stages[last], k - 1) if defer else None


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
) -> list[NodeChunkCalls]:
    """Every chunk's calls of the staged route with rank block exponents, bound to ``x`` and scratch: the
    codec's fused ones ("kernels", "triton"), else its own calls (:func:`node_block_ops`:
    "cast", "bits", a Triton variant that cannot compile here), with the same bytes.

    Across nodes each chunk is :func:`bind_rank_blocks`' two_phase applied to
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
        runs (:func:`hierarchical_bound`).

    Example:
        >>> calls = transports.bind_node_blocks(g, x, keys, flags, union)  # doctest: +SKIP
        >>> transports.hierarchical_bound(calls, groups, count)  # doctest: +SKIP
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
        call = g.codec.bind_node_blocks(x, keys, flags, union, chunk)
        if call is None:  # no fused calls here: the codec's own, with the same bytes
            return node_block_ops(g, x, keys, flags, union)
        calls.append(_node_chunk_calls(g, x, c, (call.first, call.across, call.owner, call.decode)))
    return calls
