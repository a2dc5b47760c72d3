"""One state's scratch memory: every bucket's wire buffers are views of it.

A bucket's send, receive and shard buffers (and the settled paths' float32
scratch) are needed only while the bucket is on the wire. Kept per bucket,
they grow with the model (0.78x its FP32 gradients for e4m3 two_phase); cut
from one :class:`Workspace` per state, they are bounded by the largest
bucket, whatever the number of buckets.

Buckets overlap on the wire in one way only: the hook's worker starts bucket
k + 1 before it finishes bucket k's deferred tail (its last all-gather and
decode), and DDP hands buckets over in index order. So buffers a tail uses
come from one of two :class:`Slot`\\ s, alternating with the bucket index;
what no tail reads comes from regions every bucket shares: the plans' (what
the exchange brings, read by the owner's step; the staged routes' node sums
and shards; every buffer of a bucket of several groups, which defers nothing:
:attr:`Slot.EXCHANGE`) and the settled paths' scratch (:attr:`Slot.STEP`:
error feedback's float32 scratch and factors, the block keys).

The workspace grows (to the largest request) until every bucket has been
seen; a growth frees nothing that is bound, it only moves the region on:
every plan and binding made of the old storage is stale
(:meth:`Workspace.epoch` moved) and is built again on its next use, so no
CUDA graph replays on freed memory.

Example:
    >>> ws = Workspace(torch.device("cpu"))
    >>> arena = ws.arena(Slot.EVEN)
    >>> send, values = arena.take(10), arena.take(3, torch.float32)
    >>> arena.close()  # the first request grows the slot: take again
    False
    >>> arena = ws.arena(Slot.EVEN)
    >>> send, values = arena.take(10), arena.take(3, torch.float32)
    >>> arena.close(), ws.nbytes()
    (True, 76)
"""

from __future__ import annotations

import enum

import torch

__all__ = ["Arena", "Slot", "Workspace"]

_ALIGN = 64
"""Bytes every view starts on: whole cache lines, and any dtype's alignment."""


class Slot(enum.Enum):
    """Which region of the workspace a buffer comes from."""

    EVEN = "even"
    """Buckets of even index: buffers a deferred tail may still use."""
    ODD = "odd"
    """Buckets of odd index: the same, for the bucket on the wire beside an even one."""
    EXCHANGE = "exchange"
    """Plans' buffers no tail reads: receive buffers (read by the owner's step), the staged
    routes' node sums and shards, and a bucket of several groups' every buffer (nothing
    deferred; its groups run one at a time, each from the region's start)."""
    STEP = "step"
    """Settled paths' scratch used only while the bucket's hook runs, never by its tail."""
    INPUT_EVEN = "input_even"
    """The float32 copy of an even bucket whose gradients are not float32 (bf16, fp16
    models): the same storage every step, so the bucket stays bound to it. Written
    back by the bucket's tail, hence two, as :attr:`EVEN` and :attr:`ODD`."""
    INPUT_ODD = "input_odd"
    """The same, for odd buckets."""

    @classmethod
    def of(cls, index: int) -> Slot:
        """The slot of bucket ``index`` (consecutive buckets alternate).

        Example:
            >>> Slot.of(3)
            <Slot.ODD: 'odd'>
        """
        return cls.ODD if index % 2 else cls.EVEN

    @classmethod
    def input_of(cls, index: int) -> Slot:
        """The slot of bucket ``index``'s float32 copy (consecutive buckets alternate).

        Example:
            >>> Slot.input_of(3)
            <Slot.INPUT_ODD: 'input_odd'>
        """
        return cls.INPUT_ODD if index % 2 else cls.INPUT_EVEN


class Workspace:
    """One state's scratch regions, one per :class:`Slot`, each as large as its largest user.

    Args:
        device: where the regions live (the gradients' device).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.regions: dict[Slot, torch.Tensor] = {}
        self._epochs: dict[Slot, int] = dict.fromkeys(Slot, 0)

    def arena(self, slot: Slot) -> Arena:
        """A bump allocator over ``slot``'s region, from its start (one per plan or binding)."""
        return Arena(self, slot)

    def epoch(self, *slots: Slot) -> tuple[int, ...]:
        """Moves whenever one of ``slots``' regions is reallocated: whatever holds views
        of them made before is stale."""
        return tuple(self._epochs[s] for s in slots)

    def nbytes(self) -> int:
        """The bytes the regions hold."""
        return sum(r.numel() for r in self.regions.values())

    def grow(self, slot: Slot, nbytes: int) -> None:
        """Reallocate ``slot``'s region to hold ``nbytes`` (never smaller than it is)."""
        current = self.regions.get(slot)
        if current is not None and current.numel() >= nbytes:
            return
        # Dropped first: the old storage goes as soon as its last view does.
        self.regions.pop(slot, None)
        self.regions[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._epochs[slot] += 1


class Arena:
    """Consecutive, aligned views of one workspace region, handed out in order.

    Where the region is too small the views are private allocations and
    :meth:`close` grows the region and says so: the caller takes its views
    again (plans are built twice only while the workspace grows).
    """

    def __init__(self, workspace: Workspace, slot: Slot) -> None:
        self.workspace = workspace
        self.slot = slot
        self.region = workspace.regions.get(slot)
        self.end = 0
        self.fits = True

    def take(self, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """``n`` elements of ``dtype``, disjoint from every other view of this arena."""
        if n < 0:
            raise ValueError(f"a buffer of {n} elements")
        start = -(-self.end // _ALIGN) * _ALIGN
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        self.end = start + nbytes
        if self.region is None or self.end > self.region.numel():
            self.fits = False
            return torch.empty(n, dtype=dtype, device=self.workspace.device)
        return self.region[start : self.end].view(dtype)

    def close(self) -> bool:
        """Whether every view came from the region; if not, the region now fits them all."""
        if not self.fits:
            self.workspace.grow(self.slot, self.end)
        return self.fits
