"""Choices that ``aps_comm`` and the model share, spelled once here (no torch, no ``aps_comm``).

``aps_comm`` imports :mod:`aps_perfmodel` (the hook plans with its
strategies), so what both need lives on this side: the scalings, the block
sizes of block scaling and their check. :mod:`aps_comm.config` re-exports
them beside its reductions and routes.

Example:
    >>> Scaling.parse("BLOCK", "scaling")
    <Scaling.BLOCK: 'block'>
    >>> check_block_size(DEFAULT_BLOCK_SIZE)
    32
"""

from __future__ import annotations

import enum
import operator

__all__ = [
    "BLOCK_SIZES",
    "DEFAULT_BLOCK_SIZE",
    "SCALINGS",
    "BlockExponents",
    "Choice",
    "Scaling",
    "check_block_size",
]


class Choice(str, enum.Enum):
    """A ``str`` enum that prints and formats as its value (on every Python version)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls, value: str | Choice, what: str) -> Choice:
        """``value`` as a member, or a ValueError naming ``what`` and the valid values."""
        try:
            return cls(value.lower() if isinstance(value, str) else value)
        except ValueError:
            valid = tuple(m.value for m in cls)
            raise ValueError(f"{what} must be one of {valid}, got {value!r}") from None


class Scaling(Choice):
    """Exponent granularity: one per layer (APS), per bucket and format, per block, or none.

    ``BLOCK`` gives every ``block_size`` consecutive elements of a layer its
    own exponent (blocks never cross layers; a layer's last block may be
    short), one byte each on the wire beside the format's bytes.
    """

    LAYER = "layer"
    BUCKET = "bucket"
    BLOCK = "block"
    NONE = "none"


SCALINGS: tuple[str, ...] = tuple(m.value for m in Scaling)


class BlockExponents(Choice):
    """Where two_phase's block exponents come from, with ``Scaling.BLOCK``.

    - ``RANK``: no collective before the first chunk: every rank encodes
      with its own block exponents and sends them with its shards (one byte
      per block); the owner decodes each copy with its sender's, sums in
      FP32 and gives every block of the mean its own exponent (sent with the
      all-gather). Error feedback, and the other routes, agree instead.
    - ``AGREED``: one MAX all-reduce of one-byte exponents agrees every
      block's exponent before the first chunk; every rank encodes with it,
      and each shard's owner gives every block of the mean its own extra
      exponent (sent with the all-gather).
    """

    RANK = "rank"
    AGREED = "agreed"


BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
"""The block sizes of :attr:`Scaling.BLOCK`: powers of two, so a block's index is a shift."""

DEFAULT_BLOCK_SIZE = 32
"""Elements per block by default: the OCP MX formats' block, 1/32 byte of exponent per element."""


def check_block_size(block_size: int) -> int:
    """``block_size`` if it is one of :data:`BLOCK_SIZES`, else a ValueError naming it.

    Example:
        >>> check_block_size(64)
        64
    """
    try:
        size = operator.index(block_size) if not isinstance(block_size, bool) else None
    except TypeError:
        size = None
    if size not in BLOCK_SIZES:
        raise ValueError(
            f"block_size must be a power of two from 8 to 256 {BLOCK_SIZES}, got {block_size!r}"
        )
    return size
