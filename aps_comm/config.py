"""The choices a user makes, spelled once: reductions, routes and scalings (no torch import).

Every module that names a reduction or a scaling uses these enums; they are
``str`` enums, so ``Reduction.TWO_PHASE == "two_phase"`` and users may pass
plain strings. :mod:`aps_perfmodel` names the same strategies its own way
("native" for the wire-format all-reduce); :meth:`Route.model_name` and
:meth:`Route.from_model` are the only translation between the two.

Example:
    >>> Reduction("two_phase") is Reduction.TWO_PHASE
    True
    >>> Route.ALLREDUCE.model_name
    'native'
    >>> Route.from_model("native")
    <Route.ALLREDUCE: 'allreduce'>
"""

from __future__ import annotations

import enum
import operator

__all__ = [
    "BLOCK_SIZES",
    "DEFAULT_BLOCK_SIZE",
    "REDUCTIONS",
    "SCALINGS",
    "Choice",
    "Reduction",
    "Route",
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


class Reduction(Choice):
    """How the user asks the wire format to be reduced.

    - ``AUTO``: per bucket, the fastest the performance model predicts.
    - ``ALLREDUCE``: one native all-reduce in the wire dtype.
    - ``TWO_PHASE``: all-to-all of encoded shards, FP32 sum, all-gather.
    - ``HIERARCHICAL``: FP32 inside each node, two_phase across nodes.
    - ``GRID``: two_phase levels on a virtual g x N/g grid of ranks.
    """

    AUTO = "auto"
    ALLREDUCE = "allreduce"
    TWO_PHASE = "two_phase"
    HIERARCHICAL = "hierarchical"
    GRID = "grid"


class Route(Choice):
    """How one format group of one bucket actually travels (a resolved reduction).

    ``FP32`` is the plain averaging all-reduce (``allreduce_hook``'s
    arithmetic), for FP32 layers and buckets too small for anything else.
    """

    FP32 = "fp32"
    ALLREDUCE = "allreduce"
    TWO_PHASE = "two_phase"
    HIERARCHICAL = "hierarchical"
    GRID = "grid"

    @property
    def model_name(self) -> str:
        """The strategy's name in :mod:`aps_perfmodel.strategies`."""
        return "native" if self is Route.ALLREDUCE else self.value

    @classmethod
    def from_model(cls, name: str) -> Route:
        """The route of :mod:`aps_perfmodel.strategies`' strategy ``name``."""
        return cls.ALLREDUCE if name == "native" else cls(name)

    @property
    def staged(self) -> bool:
        """Hierarchical and grid: two levels of groups, each with its own exponents."""
        return self in (Route.HIERARCHICAL, Route.GRID)


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


REDUCTIONS: tuple[str, ...] = tuple(m.value for m in Reduction)
SCALINGS: tuple[str, ...] = tuple(m.value for m in Scaling)

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
