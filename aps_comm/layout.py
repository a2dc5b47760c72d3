"""Where a bucket's layers and blocks lie in its flat buffer: geometry, no arithmetic on values.

A :class:`Layout` describes the segments (one per layer) of a flat buffer,
and :meth:`Layout.grid` cuts them into the :class:`Blocks` of block
scaling. Both are built once per bucket or unit, at plan time, and cut per
chunk with their ``window`` methods; the codec, the scaling rules and the
Triton kernels all read them, so they live below all three.

Example:
    >>> layout = Layout.from_numels([20, 0, 8], torch.device("cpu"))
    >>> layout.offsets, layout.grid(8).counts
    (tensor([ 0, 20, 20, 28]), tensor([3, 0, 1]))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
import torch

from aps_comm.config import check_block_size
from aps_comm.formats import FloatFormat, get_format, payload_nbytes
from aps_comm.hostcopy import to_device

__all__ = ["AMAX_BLOCK", "BlockGrid", "Blocks", "Layout", "index_dtype"]

AMAX_BLOCK = 4096
"""Elements per block of :func:`segment_amax` off the CPU: every segment is cut
into blocks of at most this many, so a few huge layers still fill the device."""


def index_dtype(bound: int) -> torch.dtype:
    """The narrowest dtype torch and the kernels index with that holds indexes up to ``bound``.

    Example:
        >>> index_dtype(2**20), index_dtype(2**31)
        (torch.int32, torch.int64)
    """
    return torch.int32 if bound < 2**31 else torch.int64


@dataclasses.dataclass(frozen=True)
class BlockGrid:
    """The blocks of a :meth:`Layout.grid` (or of a window of one), kept per layer.

    A bucket of n elements in blocks of B has n / B blocks: an offset per block,
    kept by every bucket's plan, grows with the model (4 bytes per 32 elements
    per copy). This keeps the layers' offsets and the block size instead; the
    blocks' offsets are derived when asked (:meth:`offsets`; the CPU kernels
    derive them themselves, :func:`aps_comm.cpu_kernels.grid_offsets`): a
    layer of m elements from ``o`` has ceil(m / B) blocks, block k from
    ``o + k * B``.

    Attributes:
        layers: the whole buffer's L + 1 layer offsets (int64 numpy).
        block_size: B.
        lo: the window's first element in the buffer (0 for a whole grid).
        hi: the window's end (the buffer's elements for a whole grid).
        first: the window's first block in the whole grid.
        n_blocks: the blocks that overlap ``[lo, hi)`` (clipped to it).
        dtype: the offsets' dtype (:func:`index_dtype` of the buffer's elements).

    Example:
        >>> g = BlockGrid.of(np.array([0, 20, 20, 28]), 8)
        >>> g.offsets(), g.window(12, 24).offsets()
        (array([ 0,  8, 16, 20, 28], dtype=int32), array([ 0,  4,  8, 12], dtype=int32))
    """

    layers: np.ndarray
    block_size: int
    lo: int
    hi: int
    first: int
    n_blocks: int
    dtype: torch.dtype

    @classmethod
    def of(cls, layers: np.ndarray, block_size: int) -> BlockGrid:
        """Every layer of ``layers`` (L + 1 offsets) cut into blocks of ``block_size``."""
        layers = np.ascontiguousarray(layers, dtype=np.int64)
        numel = int(layers[-1])
        counts = (np.diff(layers) + block_size - 1) // block_size
        return cls(layers, block_size, 0, numel, 0, int(counts.sum()), index_dtype(numel))

    @property
    def np_dtype(self) -> np.dtype:
        """:attr:`dtype` as numpy's."""
        return np.dtype(np.int32 if self.dtype == torch.int32 else np.int64)

    def _starts(self, l0: int, l1: int) -> np.ndarray:
        """The starts of layers ``[l0, l1)``'s blocks, in order (int64)."""
        sizes = np.diff(self.layers[l0 : l1 + 1])
        counts = (sizes + self.block_size - 1) // self.block_size
        first = np.cumsum(counts) - counts
        index = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)
        return np.repeat(self.layers[l0:l1], counts) + index * self.block_size

    def window(self, lo: int, hi: int) -> BlockGrid:
        """The blocks that overlap ``[lo, hi)`` of a whole grid (0 <= lo, hi <= its end),
        offsets clipped to it and from ``lo``: :meth:`Layout.window`'s rule."""
        if self.lo or self.hi != int(self.layers[-1]) or lo < 0:
            raise ValueError(f"window [{lo}, {hi}) of a whole grid of {self.hi} elements")
        lo, hi = min(lo, self.hi), min(hi, self.hi)
        if hi <= lo:
            return dataclasses.replace(self, lo=lo, hi=lo, first=0, n_blocks=0)
        starts = self._starts(0, self.layers.size - 1)
        ends = np.append(starts[1:], self.layers[-1])
        b0 = int(np.searchsorted(ends, lo, side="right"))
        b1 = int(np.searchsorted(starts, hi, side="left"))
        b0 = min(b0, b1)
        return dataclasses.replace(self, lo=lo, hi=hi, first=b0, n_blocks=b1 - b0)

    def offsets(self) -> np.ndarray:
        """The blocks' N + 1 offsets, from ``lo`` and clipped to ``[0, hi - lo]``, in
        :attr:`dtype`: what a grid kept before (a new array per call)."""
        out = np.zeros(self.n_blocks + 1, self.np_dtype)
        if self.n_blocks == 0:
            return out
        layers, b0, b1 = self.layers, self.first, self.first + self.n_blocks
        counts = (np.diff(layers) + self.block_size - 1) // self.block_size
        ends = np.cumsum(counts)  # each layer's end in the blocks
        # Only the layers that hold blocks [b0, b1): their blocks, then the window's.
        l0 = int(np.searchsorted(ends, b0, side="right"))
        l1 = int(np.searchsorted(ends - counts, b1, side="left"))
        starts = self._starts(l0, l1)
        skip = b0 - int(ends[l0] - counts[l0])
        out[:-1] = np.clip(starts[skip : skip + self.n_blocks] - self.lo, 0, self.hi - self.lo)
        out[-1] = self.hi - self.lo
        return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """Segments (one per layer) of a flat buffer: where each starts and how long it is.

    Build it once per bucket (:meth:`from_numels`) and cut it per chunk
    (:meth:`window`); nothing in it changes from step to step.

    Attributes:
        stored_offsets: CPU tensor of L + 1 offsets, from 0 to ``numel``: int64,
            or off the CPU for a :meth:`grid`'s blocks the narrowest dtype that
            holds them (:func:`index_dtype`: int32 below 2**31 elements); None
            for a CPU grid's blocks, whose offsets are derived from
            :attr:`cells` when asked (:attr:`offsets`): a block plan keeps
            nothing per block, only its layers' offsets.
        device_lengths: the L segment lengths on the data's device (int64),
            or None on the CPU for a :meth:`grid`'s blocks: :attr:`lengths`
            derives them from the offsets when asked (the CPU kernels read
            the offsets only), so a block plan keeps no second index.
        stored_sizes: the same lengths as Python ints (for splitting on the
            host; :attr:`sizes`), None where :attr:`cells` derives them.
        numel: elements covered.
        first: a window's first segment in the layout it was cut from (0 for
            a whole layout); its scales are ``scale[first : first + n_segments]``
            of that layout's (the codec picks them).
        parent: a window's parent's segment count (the scales' length); None
            for a whole layout.
        block_size: set where every segment is a block of a :meth:`grid`
            (or of a window of one): at most this many elements, most of them
            exactly. The CPU kernels then walk runs of whole blocks
            (:attr:`block_runs`) without reading each block's offsets.
        cells: a CPU grid's blocks as its layers and block size (the blocks'
            offsets derived from them); None for every other layout.
    """

    stored_offsets: torch.Tensor | None
    device_lengths: torch.Tensor | None
    stored_sizes: tuple[int, ...] | None
    numel: int
    first: int = 0
    parent: int | None = None
    block_size: int | None = None
    cells: BlockGrid | None = None

    @property
    def offsets(self) -> torch.Tensor:
        """The L + 1 segment offsets (CPU; a CPU grid's are derived anew per call).

        Example:
            >>> Layout.from_numels([20], torch.device("cpu")).grid(8).layout.offsets
            tensor([ 0,  8, 16, 20], dtype=torch.int32)
        """
        if self.stored_offsets is not None:
            return self.stored_offsets
        assert self.cells is not None
        return torch.from_numpy(self.cells.offsets())

    @property
    def sizes(self) -> tuple[int, ...]:
        """The L segment lengths as Python ints (a CPU grid's derived per call)."""
        if self.stored_sizes is not None:
            return self.stored_sizes
        assert self.cells is not None
        return tuple(np.diff(self.cells.offsets()).tolist())

    @classmethod
    def from_numels(cls, numels: Sequence[int], device: torch.device) -> Layout:
        """The layout of layers of ``numels`` elements laid end to end.

        Off the CPU its :attr:`blocks` are built here too, at plan time.

        Example:
            >>> Layout.from_numels([3, 0, 2], torch.device("cpu")).offsets
            tensor([0, 3, 3, 5])
        """
        if any(n < 0 for n in numels):
            raise ValueError(f"layer sizes must be >= 0, got {list(numels)}")
        offsets = torch.zeros(len(numels) + 1, dtype=torch.int64)
        if numels:
            torch.cumsum(torch.tensor(list(numels), dtype=torch.int64), 0, out=offsets[1:])
        layout = cls._make(offsets, torch.device(device))
        if layout.device.type != "cpu":
            layout.blocks  # noqa: B018 - built now, not at the first step
        return layout

    @classmethod
    def _make(
        cls,
        offsets: torch.Tensor,
        device: torch.device,
        first: int = 0,
        parent: int | None = None,
        block_size: int | None = None,
    ) -> Layout:
        sizes = offsets.diff()
        # A CPU block grid derives its lengths when asked: no second per-block index.
        derived = device.type == "cpu" and block_size is not None
        layout = cls(
            offsets,
            None if derived else to_device(sizes.to(torch.int64), device),
            tuple(sizes.tolist()),
            int(offsets[-1]),
            first,
            parent,
            block_size,
        )
        if device.type == "cuda":
            layout.device_offsets  # noqa: B018 - the Triton codec's, copied at plan time
        return layout

    @classmethod
    def _cut(
        cls, cells: BlockGrid, device: torch.device, first: int = 0, parent: int | None = None
    ) -> Layout:
        """The layout of ``cells``' blocks: on the CPU kept as ``cells`` (nothing per
        block), elsewhere as :meth:`_make` keeps offsets (the Triton kernels read them)."""
        if device.type != "cpu":
            offsets = torch.from_numpy(cells.offsets())
            return cls._make(offsets, device, first, parent, cells.block_size)
        return cls(None, None, None, cells.hi - cells.lo, first, parent, cells.block_size, cells)

    def window(self, lo: int, hi: int) -> Layout:
        """The layout seen by the slice ``[lo, hi)``: the segments that overlap it, clipped.

        Only those segments are kept (a chunk of a bucket cut into thousands
        of blocks costs its own blocks, not the bucket's); the codec takes the
        whole layout's scales and picks the window's (:attr:`first`).

        Example:
            >>> w = Layout.from_numels([3, 2, 4], torch.device("cpu")).window(2, 4)
            >>> w.offsets, w.first
            (tensor([0, 1, 2]), 0)
        """
        if self.parent is not None or not 0 <= lo <= hi:
            raise ValueError(f"window [{lo}, {hi}) of a whole layout: 0 <= lo <= hi")
        if self.cells is not None:  # a grid's blocks are never empty
            whole = lo == 0 and hi >= self.numel and self.cells.n_blocks > 0
        else:
            sizes = self.sizes
            whole = lo == 0 and hi >= self.numel and sizes and sizes[0] and sizes[-1]
        if whole and self.device.type == "cpu":
            # Every segment, unclipped: the layout's own offsets and lengths, not a copy.
            return dataclasses.replace(self, first=0, parent=self.n_segments)
        # A window past the end (a padded slice of a chunk) is empty.
        lo, hi = min(lo, self.numel), min(hi, self.numel)
        ends = self.offsets[1:]
        b0 = int(torch.searchsorted(ends, lo, right=True)) if hi > lo else 0
        b1 = int(torch.searchsorted(self.offsets[:-1], hi)) if hi > lo else 0
        b0 = min(b0, b1)
        if self.cells is not None:
            cells = dataclasses.replace(self.cells, lo=lo, hi=hi, first=b0, n_blocks=b1 - b0)
            return self._cut(cells, self.device, b0, self.n_segments)
        cut = (self.offsets[b0 : b1 + 1] - lo).clamp_(0, hi - lo)
        return self._make(cut, self.device, b0, self.n_segments, self.block_size)

    @property
    def n_segments(self) -> int:
        if self.cells is not None:
            return self.cells.n_blocks
        return self.offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        """The data's device (where :attr:`lengths` lie)."""
        if self.device_lengths is not None:
            return self.device_lengths.device
        return torch.device("cpu") if self.cells is not None else self.offsets.device

    @property
    def lengths(self) -> torch.Tensor:
        """The L segment lengths on the data's device (derived from the offsets, in
        their dtype, where they are not kept: a CPU block grid).

        Example:
            >>> Layout.from_numels([20], torch.device("cpu")).grid(8).layout.lengths
            tensor([8, 8, 4], dtype=torch.int32)
        """
        if self.device_lengths is None:
            return self.offsets.diff()
        return self.device_lengths

    def grid(self, block_size: int) -> Blocks:
        """Every segment cut into blocks of ``block_size`` elements from its start.

        Block scaling gives each block its own exponent; blocks never cross
        segments (layers), and a segment's last block may be short. Build it
        once per bucket (it is host work proportional to the blocks) and
        cut it per chunk with :meth:`Blocks.window`.

        Example:
            >>> b = Layout.from_numels([20, 0, 8], torch.device("cpu")).grid(8)
            >>> b.layout.offsets, b.counts
            (tensor([ 0,  8, 16, 20, 28], dtype=torch.int32), tensor([3, 0, 1]))
        """
        block_size = check_block_size(block_size)
        counts = (self.offsets.diff() + block_size - 1) // block_size
        device = self.device
        layout = Layout._cut(BlockGrid.of(self.offsets.numpy(), block_size), device)
        return Blocks(layout, block_size, counts, to_device(counts, device))

    @functools.cached_property
    def block_runs(self) -> np.ndarray:
        """Runs of consecutive segments of exactly :attr:`block_size` elements.

        Returns:
            int64 array of shape (R, 2): each run's first segment and its
            number of segments, in buffer order; empty without a block size.
            Built on the host at the first use (once per layout).

        Example:
            >>> Layout.from_numels([20, 8], torch.device("cpu")).grid(8).layout.block_runs
            array([[0, 2],
                   [3, 1]])
        """
        if self.block_size is None:
            return np.zeros((0, 2), np.int64)
        whole = (self.offsets.diff() == self.block_size).numpy().astype(np.int8)
        edges = np.diff(np.concatenate([[0], whole, [0]]))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        return np.stack([starts, ends - starts], axis=1).astype(np.int64)

    @functools.cached_property
    def longest(self) -> int:
        """The longest segment's elements (0 for none); found once per layout.

        Example:
            >>> Layout.from_numels([3, 0, 5], torch.device("cpu")).longest
            5
        """
        return max(self.sizes, default=0)

    @functools.cached_property
    def device_offsets(self) -> torch.Tensor:
        """:attr:`offsets` on the layout's device (the Triton kernels search them).

        Example:
            >>> Layout.from_numels([3, 2], torch.device("cpu")).device_offsets
            tensor([0, 3, 5])
        """
        return to_device(self.offsets.to(torch.int64), self.device)

    @functools.cached_property
    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The segments cut into blocks of at most :data:`AMAX_BLOCK` elements.

        Returns:
            (lengths, segment): int64 tensors on the layout's device, one
            entry per block in buffer order; empty segments have no block.
            Built on the host once per layout (one copy to the device).

        Example:
            >>> Layout.from_numels([5000, 0, 3], torch.device("cpu")).blocks
            (tensor([4096,  904,    3]), tensor([0, 0, 2]))
        """
        sizes = self.offsets.diff()
        count = (sizes + AMAX_BLOCK - 1) // AMAX_BLOCK
        segment = torch.repeat_interleave(torch.arange(sizes.numel()), count)
        first = torch.cumsum(count, 0) - count  # each segment's first block
        index = torch.arange(segment.numel()) - first[segment]
        lengths = (sizes[segment] - index * AMAX_BLOCK).clamp_(max=AMAX_BLOCK)
        both = to_device(torch.cat([lengths, segment]).to(torch.int64), self.device)
        return both[: segment.numel()], both[segment.numel() :]


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The blocks of block scaling in a buffer (or a window of it), from :meth:`Layout.grid`.

    The codec scales per segment of a :class:`Layout`; :attr:`layout` makes
    each block one segment, so ``encode(x, fmt, scale=block_scale[b.first :
    b.first + b.n_blocks], layout=b.layout)`` encodes with block scales.

    Attributes:
        layout: the blocks as segments (offsets relative to the buffer or window).
        block_size: elements per whole block.
        counts: int64 CPU tensor, blocks in each segment of the parent layout
            (a layer's blocks, for spreading a block's NaN to its layer).
        device_counts: the same on the data's device.
        first: index of the first block in the whole buffer's blocks (a
            window's scales are ``scale[first : first + n_blocks]``).

    Example:
        >>> b = Layout.from_numels([20, 8], torch.device("cpu")).grid(8).window(12, 24)
        >>> b.layout.offsets, b.first, b.counts
        (tensor([ 0,  4,  8, 12], dtype=torch.int32), 1, tensor([2, 1]))
    """

    layout: Layout
    block_size: int
    counts: torch.Tensor
    device_counts: torch.Tensor
    first: int = 0

    @property
    def n_blocks(self) -> int:
        return self.layout.n_segments

    def wire_nbytes(self, fmt: FloatFormat | str) -> int:
        """Bytes these blocks put on the wire: the format's payload plus one exponent byte each.

        Example:
            >>> Layout.from_numels([64], torch.device("cpu")).grid(32).wire_nbytes("e2m1")
            34
        """
        return payload_nbytes(self.layout.numel, get_format(fmt)) + self.n_blocks

    def window(self, lo: int, hi: int) -> Blocks:
        """The blocks that overlap the slice ``[lo, hi)`` of the buffer, clipped to it.

        ``lo`` and ``hi`` are offsets in the whole buffer (this must be a
        whole buffer's blocks, ``first == 0``).
        """
        if self.first or not 0 <= lo <= hi <= self.layout.numel:
            raise ValueError(
                f"window [{lo}, {hi}) must lie in a whole buffer of {self.layout.numel} elements"
            )
        offsets = self.layout.offsets
        b0 = int(torch.searchsorted(offsets[1:], lo, right=True))  # first block ending after lo
        b1 = max(b0, int(torch.searchsorted(offsets[:-1], hi))) if hi > lo else b0
        device = self.layout.device
        if self.layout.cells is not None:
            cells = dataclasses.replace(self.layout.cells, lo=lo, hi=hi, first=b0, n_blocks=b1 - b0)
            layout = Layout._cut(cells, device)
        else:
            cut = (offsets[b0 : b1 + 1] - lo).clamp_(0, hi - lo) if b1 > b0 else offsets[:1] * 0
            layout = Layout._make(cut, device, block_size=self.block_size)
        # Each layer's blocks inside [b0, b1): its block range cut by the window's.
        end = torch.cumsum(self.counts, 0)
        counts = (end.clamp(max=b1) - (end - self.counts).clamp(min=b0)).clamp_(min=0)
        return Blocks(
            layout,
            self.block_size,
            counts,
            to_device(counts, device),
            b0,
        )
