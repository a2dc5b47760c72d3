"""The choices a user makes, spelled once: reductions, routes and scalings (no torch import).

Every module that names a reduction or a scaling uses these enums; they are
``str`` enums, so ``Reduction.TWO_PHASE == "two_phase"`` and users may pass
plain strings. :mod:`aps_perfmodel` names the same strategies its own way
("native" for the wire-format all-reduce); :meth:`Route.model_name` and
:meth:`Route.from_model` are the only translation between the two. The
scalings, block sizes and block exponents, and the names of the number
formats with their aliases, are defined in :mod:`aps_perfmodel.choices`
(the model prices them, and must not import ``aps_comm``) and re-exported
here.

Example:
    >>> Reduction("two_phase") is Reduction.TWO_PHASE
    True
    >>> Route.ALLREDUCE.model_name
    'native'
    >>> Route.from_model("native")
    <Route.ALLREDUCE: 'allreduce'>
"""

from __future__ import annotations

from aps_perfmodel.choices import (
    BLOCK_SIZES,
    DEFAULT_BLOCK_SIZE,
    FORMAT_ALIASES,
    FORMAT_NAMES,
    SCALINGS,
    BlockExponents,
    Choice,
    FormatName,
    Scaling,
    check_block_size,
    default_block_size,
    format_bits,
    format_name,
)

__all__ = [
    "BLOCK_SIZES",
    "DEFAULT_BLOCK_SIZE",
    "FORMAT_ALIASES",
    "FORMAT_NAMES",
    "REDUCTIONS",
    "SCALINGS",
    "BlockExponents",
    "Choice",
    "FormatName",
    "Reduction",
    "Route",
    "Scaling",
    "check_block_size",
    "default_block_size",
    "format_bits",
    "format_name",
]


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


REDUCTIONS: tuple[str, ...] = tuple(m.value for m in Reduction)
