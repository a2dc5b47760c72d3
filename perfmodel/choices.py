"""Choices that ``aps_comm`` and the model share, spelled once here (no torch, no ``aps_comm``).

``aps_comm`` imports :mod:`aps_perfmodel` (the hook plans with its
strategies), so what both need lives on this side: the scalings, the block
sizes of block scaling and their check, and the names of the number formats
with their aliases (``aps_comm.register(ddp, "fp8")`` and ``aps-perfmodel
--fmt fp8`` read them here). :mod:`aps_comm.config` re-exports them beside
its reductions and routes. ``import aps_comm.config`` would import torch
(``aps_comm/__init__.py`` does), and the model must not.

Example:
    >>> Scaling.parse("BLOCK", "scaling")
    <Scaling.BLOCK: 'block'>
    >>> check_block_size(DEFAULT_BLOCK_SIZE)
    32
    >>> format_name("FP8"), format_name("e3m3"), format_bits("fp4")
    ('e4m3', 'e3m3', (2, 1))
"""

from __future__ import annotations

import enum
import operator
import re

__all__ = [
    "BLOCK_SIZES",
    "BYTE_BLOCK_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "FORMAT_ALIASES",
    "FORMAT_NAMES",
    "MAX_EXP_BITS",
    "MAX_MAN_BITS",
    "SCALINGS",
    "BlockExponents",
    "Choice",
    "FormatName",
    "Scaling",
    "check_block_size",
    "default_block_size",
    "format_bits",
    "format_name",
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
"""Elements per block by default below 8 bits (e2m1, e3m2): the OCP MX formats' block,
1/32 byte of exponent per element (:func:`default_block_size`)."""

BYTE_BLOCK_SIZE = 128
"""Elements per block by default for formats of 8 bits and more (e4m3, e5m2)."""


def default_block_size(bits: int) -> int:
    """The block size a format of ``bits`` bits (sign, exponent and mantissa; e3m2 is 6
    though it travels in a byte) gets unless one is given.

    Measured (``benchmarks/results/numerics_block_sizes.json`` and
    ``accuracy_block.json``): an 8-bit format's averaged gradient has the
    same error with blocks of 16 to 256 elements at every N, and trains as
    well with 128 as with 32, so it takes 128 (1/128 byte of exponent per
    element). Below 8 bits the error grows with the block (e2m1, N = 16:
    0.139 at 16, 0.149 at 32, 0.170 at 128) while training is alike from 16
    to 64: 32, the OCP MX block, is the middle.

    Example:
        >>> default_block_size(4), default_block_size(8)
        (32, 128)
    """
    return BYTE_BLOCK_SIZE if bits >= 8 else DEFAULT_BLOCK_SIZE


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


class FormatName(Choice):
    """The built-in number formats (:data:`aps_comm.formats.FORMATS` defines each one).

    Any other ``e<E>m<M>`` is a format too (:func:`format_name` checks it):
    IEEE-style specials where it has room for them, the default bias.
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"
    E3M4 = "e3m4"
    E2M3 = "e2m3"
    E3M2 = "e3m2"
    E2M1 = "e2m1"
    E3M0 = "e3m0"


FORMAT_NAMES: tuple[str, ...] = tuple(m.value for m in FormatName)

FORMAT_ALIASES: dict[str, FormatName] = {
    "fp8": FormatName.E4M3,
    "fp8_e4m3": FormatName.E4M3,
    "fp8_e4m3fn": FormatName.E4M3,
    "e4m3fn": FormatName.E4M3,
    "fp8_e5m2": FormatName.E5M2,
    "fp4": FormatName.E2M1,
    "float16": FormatName.FP16,
    "half": FormatName.FP16,
    "e5m10": FormatName.FP16,
    "bfloat16": FormatName.BF16,
    "e8m7": FormatName.BF16,
    "float32": FormatName.FP32,
    "float": FormatName.FP32,
    "e8m23": FormatName.FP32,
}
"""Other names of the built-in formats, in lower case (names are case-insensitive)."""

MAX_EXP_BITS = 8
"""Exponent bits of a format at most: formats are simulated exactly inside float32."""

MAX_MAN_BITS = 23
"""Mantissa bits of a format at most (float32's)."""

# "e3m2", or with its width in front as torch and ml_dtypes spell FP8: "fp8_e4m3".
_EXMY = re.compile(r"(?:fp(\d+)_)?e(\d+)m(\d+)")
_BUILTIN_BITS = {FormatName.FP16: (5, 10), FormatName.BF16: (8, 7), FormatName.FP32: (8, 23)}


def format_name(name: str) -> str:
    """The canonical name of the number format ``name`` (any case), else a ValueError naming it.

    A built-in name (:class:`FormatName`) or an alias (:data:`FORMAT_ALIASES`)
    gives the built-in's name; ``e<E>m<M>`` (or ``fp<N>_e<E>m<M>`` with
    ``N = 1 + E + M``) gives ``"e<E>m<M>"`` when the format can exist: 1 to
    :data:`MAX_EXP_BITS` exponent bits, at most :data:`MAX_MAN_BITS` mantissa
    bits, and a largest value inside float32's range.

    Example:
        >>> format_name("Half"), format_name("fp8_e5m2"), format_name("fp6_e3m2")
        ('fp16', 'e5m2', 'e3m2')
        >>> format_name("e9m9")
        Traceback (most recent call last):
        ...
        ValueError: number format 'e9m9' has 9 exponent bits; a format has 1 to 8
    """
    if not isinstance(name, str):
        raise TypeError(f"a number format's name is a str, got {name!r}")
    key = name.strip().lower()
    if key in FORMAT_ALIASES:
        return FORMAT_ALIASES[key].value
    if key in FORMAT_NAMES:
        return key
    match = _EXMY.fullmatch(key)
    if match is None:
        aliases = ", ".join(sorted(FORMAT_ALIASES))
        raise ValueError(
            f"unknown number format {name!r}; the formats are {', '.join(FORMAT_NAMES)}, "
            f"the aliases {aliases}, and any e<E>m<M> with 1 to {MAX_EXP_BITS} exponent and "
            f"0 to {MAX_MAN_BITS} mantissa bits (e.g. e3m2)"
        )
    width, exp_bits, man_bits = (None if g is None else int(g) for g in match.groups())
    if not 1 <= exp_bits <= MAX_EXP_BITS:
        raise ValueError(
            f"number format {name!r} has {exp_bits} exponent bits; a format has 1 to {MAX_EXP_BITS}"
        )
    if man_bits > MAX_MAN_BITS:
        raise ValueError(
            f"number format {name!r} has {man_bits} mantissa bits; a format has at most "
            f"{MAX_MAN_BITS}"
        )
    if width is not None and width != 1 + exp_bits + man_bits:
        raise ValueError(
            f"number format {name!r} says {width} bits, but 1 sign + {exp_bits} exponent + "
            f"{man_bits} mantissa bits are {1 + exp_bits + man_bits}"
        )
    # The largest finite exponent with the default bias; "ieee" formats (E >= 2
    # and M >= 1) keep the top exponent for inf and NaN. Only e8m0 passes 127.
    ieee = exp_bits >= 2 and man_bits >= 1
    emax = 2**exp_bits - 1 - ieee - (2 ** (exp_bits - 1) - 1)
    if emax > 127:
        raise ValueError(
            f"number format {name!r} does not fit inside float32: its largest value would be "
            f"2**{emax}, and float32's is just under 2**128"
        )
    canonical = f"e{exp_bits}m{man_bits}"
    # e5m10, e8m7 and e8m23 are fp16, bf16 and fp32 (whose specials are IEEE's too).
    return FORMAT_ALIASES[canonical].value if canonical in FORMAT_ALIASES else canonical


def format_bits(name: str) -> tuple[int, int]:
    """Exponent and mantissa bits of the number format ``name`` (any name :func:`format_name` takes).

    Example:
        >>> format_bits("bf16"), format_bits("E3M2")
        ((8, 7), (3, 2))
    """
    key = format_name(name)
    if key in _BUILTIN_BITS:
        return _BUILTIN_BITS[FormatName(key)]
    match = _EXMY.fullmatch(key)
    assert match is not None  # every other canonical name is e<E>m<M>
    return int(match[2]), int(match[3])
