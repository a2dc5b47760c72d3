"""Number formats: exact simulation of small floating-point formats and their wire codecs.

A :class:`FloatFormat` describes a sign-exponent-mantissa format with IEEE-style
subnormals. :func:`quantize` rounds float tensors to the nearest representable
value (round-to-nearest-even, or unbiased stochastic rounding) and returns them
in float32; :func:`encode` / :func:`decode` convert to and from the bytes that
travel on the wire (FP8 and 5-7 bit formats: one byte per element, 4-bit and
smaller: two elements per byte, FP16/BF16 and 9-16-bit formats: two bytes,
low byte first).

Every format with ``exp_bits <= 8`` and ``man_bits <= 23`` is a subset of
float32, so float32 arithmetic with power-of-two quanta simulates it exactly.

:func:`encode` and :func:`decode` here are the reference bit path in plain
torch (any device, any format); :mod:`aps_comm.codec` is the fast codec the
hook uses (compiled kernels on CPU, native casts on CUDA) and writes the same
bytes.

Run ``python -m aps_comm`` for a table of the built-in formats.

Example:
    >>> x = torch.tensor([0.1, 300.0, 1e6])
    >>> quantize(x, "e4m3")
    tensor([1.0156e-01, 2.8800e+02, 4.4800e+02])
    >>> decode(encode(x, E4M3), E4M3, 3)
    tensor([1.0156e-01, 2.8800e+02, 4.4800e+02])
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import numpy as np
import torch

from aps_comm.config import format_bits, format_name
from aps_comm.hostcopy import to_device

__all__ = [
    "BF16",
    "E2M1",
    "E2M3",
    "E3M0",
    "E3M2",
    "E3M4",
    "E4M3",
    "E5M2",
    "FORMATS",
    "FP16",
    "FP32",
    "FloatFormat",
    "cast_into",
    "code_table",
    "decode",
    "decode_into",
    "device_code_tables",
    "encode",
    "encode_into",
    "get_format",
    "payload_nbytes",
    "pow2",
    "quantize",
    "saturate",
    "special_codes",
    "uncast_into",
    "wire_code_table",
]

Specials = Literal["ieee", "fn", "none"]
Rounding = Literal["nearest", "stochastic"]
_SPECIALS = ("ieee", "fn", "none")


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, ``exp_bits``, ``man_bits``.

    Args:
        exp_bits: exponent field width, 1 to 8.
        man_bits: mantissa (fraction) field width, 0 to 23.
        bias: exponent bias; default ``2**(exp_bits - 1) - 1``.
        specials: "ieee" reserves the top exponent for inf/NaN; "fn" has no
            inf and only the all-ones pattern is NaN (like e4m3fn); "none"
            makes every code finite (like the OCP fp6/fp4 formats).
        name: display name; not part of equality.

    Example:
        >>> fmt = FloatFormat(4, 3, specials="fn")
        >>> fmt.max, fmt.min_normal, fmt.min_subnormal
        (448.0, 0.015625, 0.001953125)
    """

    exp_bits: int
    man_bits: int
    bias: int | None = dataclasses.field(default=None, kw_only=True)
    specials: Specials = dataclasses.field(default="ieee", kw_only=True)
    name: str | None = dataclasses.field(default=None, kw_only=True, compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.exp_bits, int) and 1 <= self.exp_bits <= 8):
            raise ValueError(f"exp_bits must be an int in [1, 8], got {self.exp_bits!r}")
        if not (isinstance(self.man_bits, int) and 0 <= self.man_bits <= 23):
            raise ValueError(f"man_bits must be an int in [0, 23], got {self.man_bits!r}")
        if self.specials not in _SPECIALS:
            raise ValueError(f"specials must be one of {_SPECIALS}, got {self.specials!r}")
        if self.specials == "ieee" and (self.exp_bits < 2 or self.man_bits < 1):
            raise ValueError(
                "specials='ieee' needs exp_bits >= 2 and man_bits >= 1 to hold inf and NaN; "
                f"got e{self.exp_bits}m{self.man_bits}"
            )
        if self.bias is None:
            object.__setattr__(self, "bias", 2 ** (self.exp_bits - 1) - 1)
        if self.name is None:
            object.__setattr__(self, "name", f"e{self.exp_bits}m{self.man_bits}")
        # Simulation happens in float32: the format must be a subset of it.
        if self._emax > 127 or 1 - self.bias - self.man_bits < -149:
            raise ValueError(
                f"{self.name} with bias {self.bias} does not fit inside float32 "
                "(exact simulation needs max <= 2**127 and min_subnormal >= 2**-149)"
            )

    def describe(self) -> str:
        """Every field that fixes the encoding, as text (ranks compare it).

        Example:
            >>> FloatFormat(4, 3, specials="fn", name="e4m3").describe()
            'e4m3(e4m3, bias=7, fn)'
        """
        return f"{self.name}(e{self.exp_bits}m{self.man_bits}, bias={self.bias}, {self.specials})"

    @property
    def bits(self) -> int:
        """Total width in bits, sign included."""
        return 1 + self.exp_bits + self.man_bits

    @property
    def _emax(self) -> int:
        top = 2**self.exp_bits - 1
        if self.specials == "ieee":
            top -= 1
        elif self.specials == "fn" and self.man_bits == 0:
            top -= 1  # the only code with the top exponent is the NaN pattern
        return top - self.bias  # type: ignore[operator]

    @property
    def _emin(self) -> int:
        return 1 - self.bias  # type: ignore[operator]

    @property
    def max(self) -> float:
        """Largest finite value."""
        frac = 2.0 - 2.0**-self.man_bits
        if self.specials == "fn" and self.man_bits > 0:
            frac = 2.0 - 2.0 ** (1 - self.man_bits)  # all-ones mantissa is NaN
        return math.ldexp(frac, self._emax)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value."""
        return math.ldexp(1.0, self._emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive subnormal value."""
        return math.ldexp(1.0, self._emin - self.man_bits)

    @property
    def has_inf(self) -> bool:
        return self.specials == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.specials != "none"

    @property
    def wire_bits(self) -> int:
        """Bits one element occupies on the wire: 4, 8, 16 or 32."""
        if self.bits <= 4:
            return 4
        if self.bits <= 8:
            return 8
        return 16 if self.bits <= 16 else 32

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The native torch dtype with exactly this format, if any."""
        return _NATIVE_DTYPES.get((self.exp_bits, self.man_bits, self.bias, self.specials))

    def __str__(self) -> str:
        return str(self.name)


E4M3 = FloatFormat(4, 3, specials="fn", name="e4m3")
E5M2 = FloatFormat(5, 2, specials="ieee", name="e5m2")
FP16 = FloatFormat(5, 10, specials="ieee", name="fp16")
BF16 = FloatFormat(8, 7, specials="ieee", name="bf16")
FP32 = FloatFormat(8, 23, specials="ieee", name="fp32")
E3M4 = FloatFormat(3, 4, specials="ieee", name="e3m4")
E2M3 = FloatFormat(2, 3, specials="none", name="e2m3")
E3M2 = FloatFormat(3, 2, specials="none", name="e3m2")
E2M1 = FloatFormat(2, 1, specials="none", name="e2m1")
E3M0 = FloatFormat(3, 0, specials="none", name="e3m0")

FORMATS: dict[str, FloatFormat] = {
    f.name: f for f in (E4M3, E5M2, FP16, BF16, FP32, E3M4, E2M3, E3M2, E2M1, E3M0)
}
_ALIASES = {
    "fp8_e4m3": E4M3,
    "fp8_e4m3fn": E4M3,
    "e4m3fn": E4M3,
    "fp8_e5m2": E5M2,
    "float16": FP16,
    "half": FP16,
    "bfloat16": BF16,
    "float32": FP32,
    "float": FP32,
    "e5m10": FP16,
    "e8m7": BF16,
    "e8m23": FP32,
}
_NATIVE_DTYPES: dict[tuple[int, int, int | None, str], torch.dtype] = {
    (4, 3, 7, "fn"): torch.float8_e4m3fn,
    (5, 2, 15, "ieee"): torch.float8_e5m2,
    (5, 10, 15, "ieee"): torch.float16,
    (8, 7, 127, "ieee"): torch.bfloat16,
    (8, 23, 127, "ieee"): torch.float32,
}


def get_format(fmt: FloatFormat | str) -> FloatFormat:
    """Return the :class:`FloatFormat` for a format or its name.

    Accepts the built-in names ("e4m3", "e5m2", "fp16", "bf16", "fp32", ...),
    their aliases ("fp8", "fp4", "fp8_e4m3", "half", ...: the same names
    ``aps-perfmodel --fmt`` takes, :data:`aps_comm.config.FORMAT_ALIASES`) and
    any "eXmY" string (IEEE-style specials where there is room, default bias).

    Example:
        >>> get_format("fp8_e4m3") is E4M3 and get_format("FP8") is E4M3
        True
        >>> get_format("e6m1").max
        3221225472.0

    Raises:
        ValueError: the name is not a known format, or an "eXmY" that cannot
            exist (the error names the limit it breaks, e.g. at most 8
            exponent bits).
        TypeError: ``fmt`` is neither a FloatFormat nor a str.
    """
    if isinstance(fmt, FloatFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"a number format is a FloatFormat or its name (e.g. 'e4m3'), got {fmt!r}")
    key = format_name(fmt)
    if key in FORMATS:
        return FORMATS[key]
    exp_bits, man_bits = format_bits(key)
    specials: Specials = "ieee" if exp_bits >= 2 and man_bits >= 1 else "none"
    return FloatFormat(exp_bits, man_bits, specials=specials, name=key)


# ---------------------------------------------------------------------------
# quantize


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32 for integer k in [-149, 127], built from bits (exact, subnormals too).

    Example:
        >>> pow2(torch.tensor([-1, 3]))
        tensor([0.5000, 8.0000])
    """
    # One gather from a table of the 277 powers: 12x cheaper on CPU than
    # building the bits (every layer and block, every step).
    index = (k.reshape(-1).to(torch.int32) + 149).clamp_(0, 276).long()
    return torch.index_select(_pow2_table(str(k.device)), 0, index).view(k.shape)


@functools.lru_cache(maxsize=16)
def _pow2_table(device: str) -> torch.Tensor:
    """2**k for k = -149..127, float32 from bits, on ``device``."""
    k = torch.arange(-149, 128, dtype=torch.int32, device=device)
    normal = torch.bitwise_left_shift(k + 127, 23)
    sub = torch.bitwise_left_shift(torch.ones_like(k), (k + 149).clamp(0, 22))
    return torch.where(k >= -126, normal, sub).view(torch.float32)


def quantize(
    x: torch.Tensor,
    fmt: FloatFormat | str,
    *,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Round ``x`` to the nearest value representable in ``fmt``.

    Round-to-nearest-even by default (ties to even), subnormals included.
    Finite values beyond ``fmt.max`` saturate to ``+-fmt.max``; NaN stays NaN;
    +-inf stays +-inf in "ieee" formats and becomes NaN otherwise. With
    ``rounding="stochastic"`` each value rounds up with probability equal to
    its distance from the lower neighbour, so the result is unbiased;
    ``generator`` makes it reproducible. ``x`` is never modified.

    Args:
        x: a floating-point tensor of any shape, on any device.
        fmt: a :class:`FloatFormat` or a name accepted by :func:`get_format`.
        rounding: "nearest" or "stochastic".
        generator: random generator for stochastic rounding.

    Returns:
        A new float32 tensor with the shape of ``x``.

    Example:
        >>> quantize(torch.tensor([1.0625, 1.1875]), "e4m3")  # ties to even
        tensor([1.0000, 1.2500])
    """
    fmt = get_format(fmt)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if not x.is_floating_point():
        raise TypeError(f"quantize needs a floating-point tensor, got {x.dtype}")
    xf = x.to(torch.float32)
    if fmt == FP32 or (rounding == "nearest" and x.dtype == fmt.torch_dtype):
        return xf.clone() if xf is x else xf
    a = xf.clamp(-fmt.max, fmt.max)  # NaN passes through clamp unchanged
    # frexp: a = m * 2**e with |m| in [0.5, 1), so the leading bit has weight 2**(e-1).
    _, e = torch.frexp(a)
    lead = e.sub_(1).clamp_(min=fmt._emin)
    quantum = pow2(lead - fmt.man_bits)
    # Dividing by a power of two is exact; it never overflows since |a| / quantum < 2**(m+1).
    y = a / quantum
    if rounding == "nearest" and fmt.man_bits == 0:
        # Ties to the even *code*: with no mantissa bits the code's last bit is
        # the exponent's, so 1.5 * 2**k goes down when k + bias is even (as a
        # bitwise round-to-nearest-even converter does), not always up.
        down = (y.abs() == 1.5) & ((lead + fmt.bias) % 2 == 0)
        y = torch.where(down, torch.sign(y), torch.round(y))
    elif rounding == "nearest":
        y = torch.round(y)  # half to even
    else:
        noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=torch.float32)
        y = torch.floor(y.add_(noise))
    out = y.mul_(quantum)
    inf = torch.isinf(xf)
    if fmt.has_inf:
        out = torch.where(inf, xf, out)
    else:
        out = out.masked_fill_(inf, float("nan"))
    return out


# ---------------------------------------------------------------------------
# encode / decode


@functools.lru_cache(maxsize=64)
def code_table(fmt: FloatFormat) -> np.ndarray:
    """Value of every code 0 .. 2**bits - 1, as float32 (sign bit on top).

    Example:
        >>> code_table(E4M3)[56]
        np.float32(1.0)
    """
    codes = np.arange(2**fmt.bits, dtype=np.int64)
    m = fmt.man_bits
    mag = codes & ((1 << (fmt.bits - 1)) - 1)
    exp_field = mag >> m
    frac = (mag & ((1 << m) - 1)).astype(np.float64)
    normal = np.ldexp(1.0 + frac / 2.0**m, (exp_field - fmt.bias).astype(np.int32))
    sub = np.ldexp(frac / 2.0**m, np.full_like(exp_field, fmt._emin, dtype=np.int32))
    val = np.where(exp_field == 0, sub, normal)
    top = 2**fmt.exp_bits - 1
    if fmt.specials == "ieee":
        val = np.where((exp_field == top) & (frac == 0), np.inf, val)
        val = np.where((exp_field == top) & (frac != 0), np.nan, val)
    elif fmt.specials == "fn":
        val = np.where(mag == (1 << (fmt.bits - 1)) - 1, np.nan, val)
    sign = (codes >> (fmt.bits - 1)) & 1
    val = np.where(sign == 1, -val, val)
    return val.astype(np.float32)


@functools.lru_cache(maxsize=64)
def wire_code_table(fmt: FloatFormat) -> np.ndarray:
    """Value of every bit pattern of one wire element (2**wire_bits entries, float32).

    :func:`code_table` repeated: bits above the format's own are ignored, as
    the compiled decoder ignores them, so any payload decodes without an
    out-of-range index (formats of at most 16 bits on the wire).

    Example:
        >>> t = wire_code_table(E3M2)
        >>> len(t), t[64 + 5] == t[5]
        (256, np.True_)
    """
    if fmt.wire_bits > 16:
        raise ValueError(f"{fmt.name} has {fmt.bits} bits: code tables cover at most 16")
    return np.tile(code_table(fmt), 2 ** (fmt.wire_bits - fmt.bits))


@functools.lru_cache(maxsize=64)
def device_code_tables(fmt: FloatFormat, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The bit path's tables on ``device``, built and copied there once (not blocking).

    Returns:
        (positive, values): the finite non-negative values in code order
        (increasing: the encoder's search table) and :func:`wire_code_table`
        (the decoder's lookup table), float32.

    Example:
        >>> device_code_tables(E2M1, torch.device("cpu"))[0]
        tensor([0.0000, 0.5000, 1.0000, 1.5000, 2.0000, 3.0000, 4.0000, 6.0000])
    """
    table = code_table(fmt)[: 2 ** (fmt.bits - 1)]
    positive = torch.from_numpy(table[np.isfinite(table)].copy())
    both = to_device(torch.cat([positive, torch.from_numpy(wire_code_table(fmt))]), device)
    return both[: positive.numel()], both[positive.numel() :]


def _check_bit_path(fmt: FloatFormat) -> None:
    if fmt.torch_dtype is None and fmt.wire_bits > 16:
        raise ValueError(
            f"{fmt.name} has {fmt.bits} bits and no torch dtype: the bit path encodes "
            "formats of at most 16 bits (or with a native dtype, like fp32)"
        )


def special_codes(fmt: FloatFormat) -> tuple[int, int]:
    """(NaN code, +inf code) as non-negative magnitudes; -1 where the format has none.

    Example:
        >>> special_codes(E4M3)
        (127, -1)
    """
    m, top = fmt.man_bits, 2**fmt.exp_bits - 1
    if fmt.specials == "ieee":
        return (top << m) | (1 << (m - 1)), top << m
    if fmt.specials == "fn":
        return (1 << (fmt.bits - 1)) - 1, -1
    return -1, -1


def payload_nbytes(numel: int, fmt: FloatFormat | str) -> int:
    """Bytes that ``numel`` elements of ``fmt`` occupy on the wire."""
    fmt = get_format(fmt)
    return (numel + 1) // 2 if fmt.wire_bits == 4 else numel * fmt.wire_bits // 8


def _check_encodable(x: torch.Tensor, fmt: FloatFormat) -> None:
    if not fmt.has_nan and not bool(torch.isfinite(x).all()):
        raise ValueError(
            f"{fmt.name} has no inf or NaN codes, but the input holds non-finite values"
        )


def _encode_torch(q: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Codes (int32) of already-quantized values; pure torch, any device.

    Non-finite values map as in the compiled kernels: NaN to the NaN code (0
    where the format has none), inf to the inf code, else NaN, else max.
    """
    table = device_code_tables(fmt, q.device)[0]
    mag = torch.searchsorted(table, q.abs()).to(torch.int32)
    nan_code, inf_code = special_codes(fmt)
    if inf_code < 0:
        inf_code = nan_code if fmt.has_nan else len(table) - 1
    mag = torch.where(torch.isinf(q), inf_code, mag)
    mag = torch.where(torch.isnan(q), max(nan_code, 0), mag)
    sign = (torch.signbit(q) & ~torch.isnan(q)).to(torch.int32) << (fmt.bits - 1)
    return mag | sign


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def encode(
    x: torch.Tensor, fmt: FloatFormat | str, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Encode ``x`` into the wire representation of ``fmt`` (the reference bit path).

    The values are rounded as :func:`quantize` does (nearest-even, saturating).
    Plain torch on any device; :func:`aps_comm.codec.encode` writes the same
    bytes faster and fuses per-layer scales.
    FP8 formats give exactly the bytes of ``x.to(torch.float8_e4m3fn /
    float8_e5m2).view(torch.uint8)`` for values within range.

    Args:
        x: a floating-point tensor; it is flattened.
        fmt: the format.
        out: optional contiguous 1-D uint8 tensor of exactly
            :func:`payload_nbytes` bytes on ``x``'s device to write into.

    Returns:
        A 1-D uint8 tensor of :func:`payload_nbytes` bytes on ``x``'s device
        (``out`` when given).

    Raises:
        ValueError: ``x`` holds inf or NaN and ``fmt`` has no code for them,
            or ``out`` has the wrong size, dtype, device or layout.

    Example:
        >>> encode(torch.tensor([1.0, -2.0]), "e4m3")
        tensor([ 56, 192], dtype=torch.uint8)
    """
    fmt = get_format(fmt)
    flat = x.reshape(-1)
    _check_encodable(flat, fmt)
    need = payload_nbytes(flat.numel(), fmt)
    if out is None:
        out = torch.empty(need, dtype=torch.uint8, device=x.device)
    else:
        _check_out(out, torch.uint8, need, x.device)
    encode_into(flat, fmt, out)
    return out


def decode(
    payload: torch.Tensor,
    fmt: FloatFormat | str,
    numel: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode ``numel`` elements of ``fmt`` from a uint8 payload into float32 (reference path).

    ``out``, if given, must be a contiguous 1-D float32 tensor of ``numel``
    elements on the payload's device; it is filled and returned.

    Example:
        >>> decode(torch.tensor([56, 192], dtype=torch.uint8), "e4m3", 2)
        tensor([ 1., -2.])
    """
    fmt = get_format(fmt)
    if payload.dtype != torch.uint8:
        raise TypeError(f"payload must be uint8, got {payload.dtype}")
    need = payload_nbytes(numel, fmt)
    if payload.numel() < need:
        raise ValueError(
            f"payload has {payload.numel()} bytes, {numel} elements of {fmt} need {need}"
        )
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    else:
        _check_out(out, torch.float32, numel, payload.device)
    decode_into(payload.reshape(-1)[:need], fmt, out)
    return out


def _check_out(out: torch.Tensor, dtype: torch.dtype, numel: int, device: torch.device) -> None:
    if (
        out.dtype != dtype
        or out.dim() != 1
        or out.numel() != numel
        or not out.is_contiguous()
        or out.device != device
    ):
        raise ValueError(
            f"out must be a contiguous 1-D {dtype} tensor of {numel} elements on {device}, "
            f"got {out.dtype} of shape {tuple(out.shape)} on {out.device}"
        )


def encode_into(x: torch.Tensor, fmt: FloatFormat, out: torch.Tensor) -> None:
    """Encode float ``x`` into uint8 ``out`` with plain torch ops, unchecked (any device).

    ``out`` may start at any byte offset. Formats of 9 to 16 bits write each
    code as two bytes, low byte first (the compiled kernels' uint16 on every
    little-endian host).
    """
    if fmt.torch_dtype is not None and fmt.wire_bits >= 16:
        cast_into(x, fmt, out)
        return
    _check_bit_path(fmt)
    codes = _encode_torch(quantize(x, fmt), fmt)
    if fmt.wire_bits == 4:
        out.copy_(_pack_nibbles(codes))
    elif fmt.wire_bits == 8:
        out.copy_(codes.to(torch.uint8))
    else:
        pairs = out.view(-1, 2)
        pairs[:, 0].copy_(codes & 0xFF)
        pairs[:, 1].copy_(codes >> 8)


def saturate(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``x`` in float32 with finite values clamped to +-max; inf stays inf where the
    format has inf and becomes NaN where it has only NaN; NaN stays NaN.

    What the encoder does to out-of-range values, before rounding.

    Example:
        >>> saturate(torch.tensor([1e6, float("inf")]), E4M3)
        tensor([448.,  nan])
    """
    xf = x.float()
    sat = xf.clamp(-fmt.max, fmt.max)  # NaN passes through clamp unchanged
    if fmt.has_inf:
        return torch.where(torch.isinf(xf), xf, sat)
    if fmt.has_nan:
        return sat.masked_fill_(torch.isinf(xf), float("nan"))
    return sat


def _typed_view(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """uint8 ``buf`` viewed as ``dtype``, or None where its offset forbids the view.

    A view to a wider dtype needs the storage offset to be a multiple of the
    item size (a bucket that mixes formats puts a 2-byte format at any byte).
    The offset is host-side metadata: deciding reads nothing from the device.
    """
    if buf.storage_offset() % dtype.itemsize:
        return None
    return buf.view(dtype)


def cast_into(x: torch.Tensor, fmt: FloatFormat, out: torch.Tensor) -> None:
    """Encode ``x`` into uint8 ``out`` with torch's native cast to ``fmt.torch_dtype``.

    Saturated first (torch's casts round to nearest even but do not
    saturate). ``out`` may start at any byte: where it cannot be viewed as
    the dtype, the cast goes to an aligned scratch tensor and its bytes are
    copied. Unchecked; ``fmt`` must have a torch dtype.

    Example:
        >>> out = torch.empty(5, dtype=torch.uint8)
        >>> cast_into(torch.tensor([1.0, -2.0]), FP16, out[1:])
        >>> out[1:].tolist()
        [0, 60, 0, 192]
    """
    dtype = fmt.torch_dtype
    assert dtype is not None
    typed = _typed_view(out, dtype)
    if typed is not None:
        typed.copy_(saturate(x, fmt))
    else:
        out.copy_(saturate(x, fmt).to(dtype).view(torch.uint8))


def uncast_into(payload: torch.Tensor, fmt: FloatFormat, out: torch.Tensor) -> None:
    """Decode uint8 ``payload`` of ``fmt.torch_dtype`` values into float32 ``out``.

    ``payload`` may start at any byte (see :func:`cast_into`). Unchecked.

    Example:
        >>> buf = torch.tensor([7, 0, 60, 0, 192], dtype=torch.uint8)
        >>> out = torch.empty(2)
        >>> uncast_into(buf[1:], FP16, out)
        >>> out
        tensor([ 1., -2.])
    """
    dtype = fmt.torch_dtype
    assert dtype is not None
    typed = _typed_view(payload, dtype)
    if typed is None:
        typed = torch.empty(out.numel(), dtype=dtype, device=payload.device)
        typed.view(torch.uint8).copy_(payload)
    out.copy_(typed)


def decode_into(payload: torch.Tensor, fmt: FloatFormat, out: torch.Tensor) -> None:
    """Decode uint8 ``payload`` into float32 ``out`` with plain torch ops, unchecked.

    ``payload`` may start at any byte; bits above the format's own in a code
    are ignored (as the compiled kernels ignore them).
    """
    numel = out.numel()
    if fmt.torch_dtype is not None and fmt.wire_bits >= 16:
        uncast_into(payload[: payload_nbytes(numel, fmt)], fmt, out)
        return
    _check_bit_path(fmt)
    table = device_code_tables(fmt, payload.device)[1]
    if fmt.wire_bits == 4:
        codes = torch.stack([payload & 0xF, payload >> 4], dim=1).reshape(-1)[:numel].int()
    elif fmt.wire_bits == 8:
        codes = payload[:numel].int()
    else:
        pairs = payload[: 2 * numel].view(-1, 2).int()
        codes = pairs[:, 0] | (pairs[:, 1] << 8)
    torch.index_select(table, 0, codes, out=out)
