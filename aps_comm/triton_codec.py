"""Triton kernels of the codec: encode, decode and the owner's reduction in one pass.

On CUDA the torch backends of :mod:`aps_comm.codec` run a chain of ops per
call (a repeat of the scales, a multiply, a clamp, a cast, a copy), each a
pass over memory; these kernels read the input once and write the output
once, the scale fused in: one float32 per segment (layer) of a
:class:`~aps_comm.layout.Layout`, or one per block of ``block_size``
elements of each layer (block scaling; :func:`block_segments`):

- :func:`encode`: ``x * scale`` rounded to the format's codes;
- :func:`decode`: codes to float32, times the scale;
- :func:`reduce_shards`: N encoded shards decoded, summed in float32 in rank
  order, divided by N and encoded again (two_phase's shard owner);
- :func:`shard_mean`: the same sum and division, kept in float32;
- :func:`reduce_blocks`: the owner's step with block scaling: the mean of
  each block given its own extra exponent (its max, the exponent and the
  encoding in the same pass);
- :func:`reduce_rank_blocks`: the same where every rank encoded with its own
  block exponents: each rank's values times its factors before the sum.

Every rounding is done with integer operations on the float32 bit pattern,
as in the integer path of :mod:`aps_comm.cpu_kernels` (round to nearest
even, saturation to ``+-max``, subnormals, the NaN and inf codes, 4-bit
codes two per byte with the low nibble first, 9-16-bit codes two bytes per
element with the low byte first); the only float operations are the scale's
multiply, the sum and the division, each one IEEE-rounded operation. No
float8 cast is used, so Triton's interpreter (``TRITON_INTERPRET=1``, read
by ``triton.jit`` when this module is imported) runs the kernels on CPU
tensors and writes the bytes a GPU writes: the tests compare them there bit
for bit with the CPU kernels.

Triton is optional: without it (or older than :data:`MIN_TRITON`)
:data:`AVAILABLE` is False, :func:`supports` says no and the codec keeps its
torch backends.

Example:
    >>> from aps_comm.formats import E4M3
    >>> x = torch.tensor([1.0, -2.0], device="cuda")  # doctest: +SKIP
    >>> out = torch.empty(2, dtype=torch.uint8, device="cuda")  # doctest: +SKIP
    >>> encode(x, out, E4M3)  # doctest: +SKIP
    >>> out  # doctest: +SKIP
    tensor([ 56, 192], device='cuda:0', dtype=torch.uint8)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import numpy as np
import torch

from aps_comm.cpu_kernels import encoder_params, mean_limit
from aps_comm.formats import E4M3, FloatFormat
from aps_comm.hostcopy import to_device
from aps_comm.scaling import EXPONENT_LIMIT

_log = logging.getLogger(__name__)

MIN_TRITON = (3, 4)
"""The oldest Triton the kernels are written for (``triton.knobs``, tuple constexprs)."""

try:
    import triton
    import triton.language as tl
    from triton import knobs as _knobs

    AVAILABLE = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= MIN_TRITON
except ImportError:
    AVAILABLE = False

__all__ = [
    "AVAILABLE",
    "BLOCK",
    "GRID_LIMITS",
    "INTERPRETED",
    "MAX_SEGMENT",
    "MIN_TRITON",
    "NUM_WARPS",
    "TILE",
    "FormatConstants",
    "Rule",
    "bind_block_factors",
    "bind_block_keys",
    "bind_block_records",
    "bind_cell_keys",
    "bind_decode",
    "bind_decode_rank_blocks",
    "bind_encode",
    "bind_layer_maxima",
    "bind_native_block_keys",
    "bind_owner_agreed_blocks",
    "bind_owner_agreed_launch",
    "bind_owner_rank_blocks",
    "bind_reduce_shards",
    "bind_row_cell_keys",
    "bind_send_rank_blocks",
    "bind_staged_factors",
    "bind_staged_key_factors",
    "bind_staged_keys",
    "block_segments",
    "compile_options",
    "decode",
    "encode",
    "format_constants",
    "key_constants",
    "launch_grid",
    "launch_problem",
    "layer_maxima",
    "ptx",
    "reduce_blocks",
    "reduce_rank_blocks",
    "reduce_shards",
    "runs_on",
    "shard_mean",
    "supports",
    "tile_shape",
]

BLOCK = 1024
"""Elements per program: a multiple of 2, so no 4-bit byte is shared by two programs."""

TILE = 2048
"""Elements of :func:`reduce_blocks`' tile per program: rows of whole blocks."""

MAX_SEGMENT = 4096
"""The longest block :func:`reduce_blocks` takes (a tile row holds a whole block)."""

INTERPRETED: bool = AVAILABLE and bool(_knobs.runtime.interpret)
"""Whether the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1``
when this module was imported): they then run on CPU tensors, not on CUDA ones."""

_U32 = 1 << 32


@dataclasses.dataclass(frozen=True)
class FormatConstants:
    """The integer constants of one format's encoder and decoder (kernel constexprs).

    Attributes:
        wire_bits: 4, 8 or 16 bits per element on the wire.
        encode: (shift, half_ulp - 1, bias adjustment, max bits, min_normal
            bits, 150 + log2(min_subnormal), max code, NaN code, inf code,
            sign position) as in :func:`aps_comm.cpu_kernels.encoder_params`,
            non-negative and below 2**32, then the hardware conversion
            (:func:`native_cvt`, 0 for none).
        decode: (mantissa bits, sign position, magnitude mask, exponent
            adjustment ``(127 - bias) << 23`` mod 2**32, emin, inf magnitude,
            first NaN magnitude, shift of a subnormal code that is a float32
            subnormal); the special magnitudes are past the mask where the
            format has none, the shift is 31 where no such code exists.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> format_constants(E4M3).decode
        (3, 7, 127, 1006632960, -6, 128, 127, 31)
    """

    wire_bits: int
    encode: tuple[int, ...]
    decode: tuple[int, ...]


def supports(fmt: FloatFormat) -> bool:
    """Whether these kernels run ``fmt``: Triton installed, at most 16 bits on the wire,
    normals that are float32 normals (the same formats as :mod:`aps_comm.cpu_kernels`).

    Example:
        >>> from aps_comm.formats import E4M3, FP32
        >>> supports(FP32)
        False
    """
    return AVAILABLE and _fits(fmt)


def _fits(fmt: FloatFormat) -> bool:
    # bias <= 127: the format's normals are float32 normals (emin = 1 - bias >= -126).
    return fmt.wire_bits <= 16 and fmt.bias <= 127  # type: ignore[operator]


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run on tensors of ``device``: CUDA when compiled, the CPU
    when interpreted, and a first kernel compiled and launched there (once per
    device; a machine where Triton cannot build, e.g. without a C compiler for
    its launcher, keeps the torch ops rather than failing in a training step).

    Example:
        >>> runs_on(torch.device("meta"))
        False
    """
    return launch_problem(device) is None


_PROBED: dict[torch.device, str | None] = {}


def launch_problem(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device``, or None where they can.

    Triton missing or too old, the wrong device type, or the first launch's
    error: tried once per device (a two-element encode), a failure logged once.

    Example:
        >>> launch_problem(torch.device("meta"))  # doctest: +ELLIPSIS
        'the Triton codec runs on ... tensors, not meta ones'
    """
    device = torch.device(device)
    if not AVAILABLE:
        return f"triton >= {'.'.join(map(str, MIN_TRITON))} is not installed"
    kind = "cpu" if INTERPRETED else "cuda"
    if device.type != kind:
        return f"the Triton codec runs on {kind} tensors, not {device.type} ones"
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _PROBED:
        _PROBED[device] = None  # the probe's own launch checks the device too
        try:
            x = torch.zeros(2, device=device)
            bind_encode(x, torch.empty(2, dtype=torch.uint8, device=device), E4M3)()
        except Exception as exc:  # any failure: the codec keeps its torch backends
            _PROBED[device] = f"{type(exc).__name__}: {exc}"
            _log.warning(
                "aps_comm: the Triton codec cannot run on %s (%s); using torch ops there",
                device,
                _PROBED[device],
            )
    return _PROBED[device]


NATIVE_CVT: dict[tuple[int, int, int, str], int] = {(4, 3, 7, "fn"): 1, (5, 2, 15, "ieee"): 2}
"""Formats the GPU converts to in hardware (``cvt.rn.satfinite`` to e4m3 and e5m2 on
compute capability 8.9 and later), by (exponent bits, mantissa bits, bias, specials):
the encoder's ``native`` code. Its bytes are the integer path's, specials fixed up
(checked on an H200 over every float32 exponent: the CUDA tests pin it)."""


def native_cvt(fmt: FloatFormat, device: torch.device) -> int:
    """The encoder's hardware conversion of ``fmt`` on ``device``: 1 (e4m3), 2 (e5m2), or
    0 (the integer path: other formats, the interpreter, GPUs before compute capability 8.9).

    Example:
        >>> from aps_comm.formats import E4M3
        >>> native_cvt(E4M3, torch.device("cpu"))
        0
    """
    key = (fmt.exp_bits, fmt.man_bits, fmt.bias, fmt.specials)
    if INTERPRETED or key not in NATIVE_CVT or torch.device(device).type != "cuda":
        return 0
    return NATIVE_CVT[key] if _capability(torch.device(device)) >= (8, 9) else 0


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=64)
def format_constants(fmt: FloatFormat, native: int = 0) -> FormatConstants:
    """The constants of ``fmt`` for the kernels (see :class:`FormatConstants`); ``native``:
    the encoder's hardware conversion (:func:`native_cvt`), appended to ``encode``.

    Raises:
        ValueError: the kernels do not run ``fmt`` (see :func:`supports`).
    """
    if not _fits(fmt):
        raise ValueError(
            f"the Triton codec handles formats of at most 16 bits with bias <= 127, "
            f"got {fmt.describe()}"
        )
    enc = (*(int(v) % _U32 for v in encoder_params(fmt, False)[:10]), native)
    m, sign = fmt.man_bits, fmt.bits - 1
    magmask = (1 << sign) - 1
    never = magmask + 1
    if fmt.specials == "ieee":
        inf_mag = (2**fmt.exp_bits - 1) << m
        nan_from = inf_mag + 1
    elif fmt.specials == "fn":
        inf_mag, nan_from = never, magmask
    else:
        inf_mag = nan_from = never
    adjust = ((127 - fmt.bias) << 23) % _U32  # type: ignore[operator]
    # frac * 2**(emin - m) as float32 subnormal bits: frac << (emin - m + 149),
    # used only where that exponent is below float32's normals (shift < 23).
    emin = 1 - fmt.bias  # type: ignore[operator]
    subshift = min(emin - m + 149, 31)
    dec = (m, sign, magmask, adjust, emin, inf_mag, nan_from, subshift)
    return FormatConstants(fmt.wire_bits, enc, dec)


def block_segments(
    offsets: torch.Tensor, block_size: int, lo: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block arguments of :func:`encode`/:func:`decode` for the window from ``lo`` of a
    buffer whose layers start at ``offsets``: (the layers' offsets relative to
    ``lo``, each layer's first block relative to the block holding ``lo``).

    Host work, once per plan: copy both to the device there. The window's
    factors are then ``block_factors[b0:]``, ``b0`` the block holding ``lo``
    (the first block ending after it), as :meth:`aps_comm.layout.Layout.window`
    cuts the per-block layout.

    Args:
        offsets: int64 CPU tensor, the buffer's L + 1 layer offsets from 0.
        block_size: elements per block, a power of two.
        lo: where the window starts in the buffer.

    Example:
        >>> block_segments(torch.tensor([0, 20, 28]), 8, lo=12)
        (tensor([-12,   8,  16]), tensor([-1,  2]))
    """
    counts = (offsets.diff() + block_size - 1) // block_size
    first = torch.cumsum(counts, 0) - counts
    # Blocks that end at or before lo: every block of the layers before it (their
    # short last ones too), then the whole blocks of the layer it cuts.
    cut = (lo - offsets[:-1]).clamp(min=0) // block_size
    done = int(torch.where(offsets[1:] <= lo, counts, cut).sum())
    return offsets - lo, first - done


def _top(n_segments: int) -> int:
    """The largest power of two below ``n_segments`` (0 for one segment): the first
    step of the kernels' binary search over the segment offsets."""
    return 1 << (n_segments - 1).bit_length() - 1 if n_segments > 1 else 0


if AVAILABLE:

    @triton.jit
    def _search(off_ptr, idx, s, step, last):
        """Largest t in [s, last] with off[t] <= idx, by steps step, step / 2, .., 1.

        ``step`` must be at least half of ``last - s`` rounded up to a power of
        two. Scalars or vectors alike: with offsets from 0, the segment that
        holds element ``idx`` (an empty segment's offset equals the next one's,
        so the largest t skips it).
        """
        while step > 0:
            t = s + step
            ok = t <= last
            o = tl.load(off_ptr + t, mask=ok, other=0)
            s = tl.where(ok & (o <= idx), t, s)
            step = step // 2
        return s

    @triton.jit
    def _chunk_segments(off_ptr, first, last_idx, top, n_last):
        """(segment of element ``first``, segment of ``last_idx``, search step between them)."""
        zero = tl.program_id(0) * 0
        lo = _search(off_ptr, first, zero, zero + top, n_last)
        hi = _search(off_ptr, last_idx, lo, zero + top, n_last)
        return lo, hi, _width_step(hi - lo)

    @triton.jit
    def _width_step(width):
        """The first step of a search over ``width + 1`` segments: the largest power of two
        not above ``width`` (0 for one segment)."""
        step = width * 0
        nxt = step + 1
        while nxt <= width:
            step = nxt
            nxt = nxt * 2
        return step

    @triton.jit
    def _program_segments(seg_ptr, pid, off_ptr, first, last_idx, top, n_last, TABLE: tl.constexpr):
        """:func:`_chunk_segments` of program ``pid``: read from the table a bound call made
        once (``TABLE``: :func:`_segments_kernel`'s), else searched; a search is about 14
        dependent loads per program, the table one."""
        if TABLE:
            lo = tl.load(seg_ptr + 2 * pid).to(tl.int32)
            hi = tl.load(seg_ptr + 2 * pid + 1).to(tl.int32)
            step = _width_step(hi - lo)
        else:
            lo, hi, step = _chunk_segments(off_ptr, first, last_idx, top, n_last)
        return lo, hi, step

    @triton.jit(do_not_specialize=["numel", "top", "n_last", "programs"])
    def _segments_kernel(
        off_ptr, seg_ptr, numel, top, n_last, programs, BLOCK: tl.constexpr, R: tl.constexpr
    ):
        """The segments of the first and last element of each of ``programs`` programs of
        ``BLOCK`` elements (an encode's padding programs: of element ``numel - 1``), as
        :func:`_chunk_segments` finds them: int64 (lo, hi) pairs, ``R`` programs each."""
        p = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
        first = p * BLOCK
        last = tl.maximum(tl.minimum(first + BLOCK, numel) - 1, 0)
        zero = tl.full([R], 0, tl.int32)
        lo = _search(off_ptr, tl.minimum(first, last), zero, top, n_last)
        hi = _search(off_ptr, last, lo, top, n_last)
        mask = p < programs
        tl.store(seg_ptr + 2 * p, lo, mask=mask)
        tl.store(seg_ptr + 2 * p + 1, hi, mask=mask)

    @triton.jit
    def _factor(
        scale_ptr,
        off_ptr,
        first_ptr,
        idx,
        last,
        lo,
        hi,
        step,
        divisor,
        n_ranks,
        SHIFT: tl.constexpr,
        AMAX: tl.constexpr,
        DIVIDE: tl.constexpr,
        E: tl.constexpr,
        D: tl.constexpr,
        K: tl.constexpr,
    ):
        """The factor of element ``idx`` (the chunk's segments are lo..hi, its last
        element ``last``): its segment's (``SHIFT`` 0), or its block's (blocks of
        ``2**SHIFT`` elements from each segment's start, the segment's first block at
        index ``first[segment]``).

        ``AMAX`` 0: ``scale_ptr`` holds float32 factors. 1 or 2: the segments'
        agreed maxima (float32 bits), whose exponents (:func:`_exp_key`, rule
        ``K`` for ``n_ranks``) give ``2**e`` (1) or ``2**-e`` divided by
        ``divisor`` as ``DIVIDE`` says, NaN for a non-finite maximum (2): the
        factors :func:`aps_comm.scaling.factors` computes from the same maxima.
        """
        # tl.full, not tl.zeros: the interpreter runs only core builtins when triton was
        # imported before TRITON_INTERPRET was set (as in a test session).
        s = tl.full(idx.shape, 0, tl.int32) + lo
        if lo != hi:  # a program inside one segment (most of them) needs no search
            s = _search(off_ptr, idx, s, step, hi)
        # if/else, never an early return: Triton generates (and type-checks) the code
        # after a constexpr-guarded return too.
        if AMAX:
            # Per segment, not per element, where the program lies in one segment.
            if lo == hi:
                one = _key_factor(
                    _exp_key(tl.load(scale_ptr + lo), n_ranks, E, D, K), divisor, AMAX, DIVIDE
                )
                f = tl.full(idx.shape, 0, tl.float32) + one
            else:
                k = _exp_key(tl.load(scale_ptr + s), n_ranks, E, D, K)
                f = _key_factor(k, divisor, AMAX, DIVIDE)
        elif SHIFT == 0:
            f = tl.load(scale_ptr + s)
        else:
            # A lane past the chunk's last element (masked, perhaps deep in a shard's
            # padding) reads the last element's factor, never one past the factors' end.
            el = tl.minimum(idx, last)
            f = tl.load(scale_ptr + tl.load(first_ptr + s) + ((el - tl.load(off_ptr + s)) >> SHIFT))
        return f

    @triton.jit
    def _key_factor(k, divisor, AMAX: tl.constexpr, DIVIDE: tl.constexpr):
        """float32 factor of int32 exponent key ``k``: see :func:`_factor`."""
        e = tl.where((k == 0) | (k == 255), 0, 127 - k)
        if AMAX == 1:
            f = _pow2(e)
        else:
            f = _pow2(-e)
            if DIVIDE:
                f = _divide(f, divisor, DIVIDE)
            f = tl.where(k == 255, float("nan"), f)
        return f

    @triton.jit
    def _code(v, E: tl.constexpr):
        """uint32 code of float32 ``v``: :func:`aps_comm.cpu_kernels._code`'s integer path.

        Round to nearest even in the format's normals and subnormals,
        saturation to max, inf to the inf code (or NaN, or max), NaN to the
        NaN code without a sign.
        """
        u = v.to(tl.uint32, bitcast=True)
        a = u & 0x7FFFFFFF
        if E[10] != 0:
            # The hardware's round to nearest even and saturation (2.5x faster on an
            # H200 than the integer path); inf and NaN to this encoder's codes.
            if E[10] == 1:
                c = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.uint32)
            else:
                c = v.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.uint32)
            c = tl.where(a == 0x7F800000, E[8] | ((u >> 31) << E[9]), c)
            c = tl.where(a > 0x7F800000, E[7], c)
        else:
            # Subnormal in the format: round(|v| / min_subnormal), ties to even.
            ef = a >> 23
            sig = (a & 0x7FFFFF) | tl.where(ef > 0, 0x800000, 0).to(tl.uint32)
            s = (E[5] - tl.maximum(ef, 1).to(tl.int32)).to(tl.int32)
            s = tl.where(s < 0, 31, tl.minimum(s, 31))  # negative: the kernels' wrap-around
            s = tl.maximum(s, 1).to(tl.uint32)
            sub = (sig + ((1 << (s - 1)) - 1).to(tl.uint32) + ((sig >> s) & 1)) >> s
            # Normal: drop `shift` mantissa bits rounding to even, rebias the exponent.
            odd = (a >> E[0]) & 1
            normal = ((a + E[1] + odd) >> E[0]) - E[2]
            c = tl.where(a >= E[4], normal, sub)
            c = tl.where(a >= E[3], E[6], c)
            c = tl.where(a == 0x7F800000, E[8], c)
            c = tl.where(a > 0x7F800000, E[7], c)
            sign = tl.where(a <= 0x7F800000, (u >> 31) << E[9], 0)
            c = c | sign
        return c

    @triton.jit
    def _value(c, D: tl.constexpr):
        """float32 value of uint32 code ``c`` (bits above the format's ignored), built
        from integer bit fields: exact, subnormals of both formats included."""
        mag = c & D[2]
        sign = ((c >> D[1]) & 1) << 31
        normal = (mag << (23 - D[0])) + D[3]
        frac = mag & ((1 << D[0]) - 1)
        # A subnormal code: frac * 2**(emin - m), normalised with p = log2(frac).
        p = tl.maximum(
            (frac.to(tl.float32).to(tl.uint32, bitcast=True) >> 23).to(tl.int32) - 127, 0
        )
        e = D[4] - D[0] + p
        sub_n = ((e + 127).to(tl.uint32) << 23) | ((frac << (23 - p).to(tl.uint32)) & 0x7FFFFF)
        sub_s = frac << D[7]  # a float32 subnormal: frac * 2**(emin - m + 149) ulps
        sub = tl.where(e >= -126, sub_n, sub_s)
        bits = tl.where((mag >> D[0]) == 0, tl.where(frac == 0, 0, sub), normal)
        bits = tl.where(mag == D[5], 0x7F800000, bits)
        bits = tl.where(mag >= D[6], 0x7FC00000, bits)
        return (bits | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _load_code(src_ptr, idx, mask, WIRE: tl.constexpr):
        """uint32 code of element ``idx`` of a payload at byte pointer ``src_ptr``."""
        if WIRE == 4:
            byte = tl.load(src_ptr + (idx >> 1), mask=mask, other=0).to(tl.uint32)
            c = (byte >> ((idx & 1) * 4).to(tl.uint32)) & 0xF
        elif WIRE == 8:
            c = tl.load(src_ptr + idx, mask=mask, other=0).to(tl.uint32)
        else:
            lo = tl.load(src_ptr + 2 * idx, mask=mask, other=0).to(tl.uint32)
            hi = tl.load(src_ptr + 2 * idx + 1, mask=mask, other=0).to(tl.uint32)
            c = lo | (hi << 8)
        return c

    @triton.jit
    def _load_codes(src_ptr, first, WIRE: tl.constexpr, BLOCK: tl.constexpr):
        """uint32 codes of the ``BLOCK`` elements from ``first`` (a full program): the
        payload's bytes read contiguously (vectorised), the codes split in registers."""
        if WIRE == 4:
            b = tl.load(src_ptr + (first >> 1) + tl.arange(0, BLOCK // 2)).to(tl.uint32)
            c = tl.reshape(tl.join(b & 0xF, b >> 4), [BLOCK])
        elif WIRE == 8:
            c = tl.load(src_ptr + first + tl.arange(0, BLOCK)).to(tl.uint32)
        else:
            b = tl.load(src_ptr + 2 * first + tl.arange(0, 2 * BLOCK)).to(tl.uint32)
            lo, hi = tl.split(tl.reshape(b, [BLOCK, 2]))
            c = lo | (hi << 8)
        return c

    @triton.jit
    def _store_codes(
        dst_ptr,
        pid,
        c0,
        c1,
        m0,
        WIRE: tl.constexpr,
        BLOCK: tl.constexpr,
        FULL: tl.constexpr = False,
    ):
        """Store a chunk's codes: for 4 bits ``c0``/``c1`` are the even/odd elements
        (one byte each pair), else ``c0`` are all of them. ``FULL``: every element is
        stored (``m0`` ignored), the bytes contiguously (vectorised)."""
        if WIRE == 4:
            j = tl.arange(0, BLOCK // 2)
            byte = (c0 | (c1 << 4)).to(tl.uint8)
            if FULL:
                tl.store(dst_ptr + pid * (BLOCK // 2) + j, byte)
            else:
                tl.store(dst_ptr + pid * (BLOCK // 2) + j, byte, mask=m0)
        elif WIRE == 8:
            i = pid * BLOCK + tl.arange(0, BLOCK)
            if FULL:
                tl.store(dst_ptr + i, c0.to(tl.uint8))
            else:
                tl.store(dst_ptr + i, c0.to(tl.uint8), mask=m0)
        elif FULL:
            b = tl.reshape(tl.join(c0 & 0xFF, c0 >> 8), [2 * BLOCK]).to(tl.uint8)
            tl.store(dst_ptr + 2 * pid * BLOCK + tl.arange(0, 2 * BLOCK), b)
        else:
            i = pid * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst_ptr + 2 * i, (c0 & 0xFF).to(tl.uint8), mask=m0)
            tl.store(dst_ptr + 2 * i + 1, (c0 >> 8).to(tl.uint8), mask=m0)

    @triton.jit
    def _scaled_codes(
        x_ptr,
        idx,
        mask,
        scale_ptr,
        off_ptr,
        first_ptr,
        last,
        lo,
        hi,
        step,
        n_ranks,
        E,
        SCALED,
        SHIFT,
        AMAX,
        D,
        K,
    ):
        v = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            v = v * _factor(
                scale_ptr,
                off_ptr,
                first_ptr,
                idx,
                last,
                lo,
                hi,
                step,
                1,
                n_ranks,
                SHIFT,
                AMAX,
                0,
                E,
                D,
                K,
            )
        return tl.where(mask, _code(v, E), 0)

    @triton.jit(do_not_specialize=["numel", "top", "n_last", "total", "n_ranks"])
    def _encode_kernel(
        x_ptr,
        out_ptr,
        off_ptr,
        scale_ptr,
        first_ptr,
        seg_ptr,
        numel,
        top,
        n_last,
        total,
        n_ranks,
        E: tl.constexpr,
        D: tl.constexpr,
        K: tl.constexpr,
        WIRE: tl.constexpr,
        SCALED: tl.constexpr,
        SHIFT: tl.constexpr,
        AMAX: tl.constexpr,
        BLOCK: tl.constexpr,
        TABLE: tl.constexpr = False,
    ):
        """Codes of ``numel`` elements, then zero codes up to ``total`` (a shard's padding)."""
        pid = tl.program_id(0).to(tl.int64)
        first = pid * BLOCK
        last = tl.maximum(tl.minimum(first + BLOCK, numel) - 1, 0)
        lo, hi, step = _program_segments(
            seg_ptr, pid, off_ptr, tl.minimum(first, last), last, top, n_last, TABLE
        )
        if WIRE == 4:
            if first + BLOCK <= numel:
                # A full program: contiguous (vectorised) loads, the codes paired in registers.
                i = first + tl.arange(0, BLOCK)
                every = tl.full([BLOCK], 1, tl.int1)
                c = _scaled_codes(
                    x_ptr,
                    i,
                    every,
                    scale_ptr,
                    off_ptr,
                    first_ptr,
                    last,
                    lo,
                    hi,
                    step,
                    n_ranks,
                    E,
                    SCALED,
                    SHIFT,
                    AMAX,
                    D,
                    K,
                )
                c0, c1 = tl.split(tl.reshape(c, [BLOCK // 2, 2]))
                _store_codes(out_ptr, pid, c0, c1, c0, WIRE, BLOCK, True)
            else:
                i0 = first + 2 * tl.arange(0, BLOCK // 2)
                m0 = i0 < numel
                c0 = _scaled_codes(
                    x_ptr,
                    i0,
                    m0,
                    scale_ptr,
                    off_ptr,
                    first_ptr,
                    last,
                    lo,
                    hi,
                    step,
                    n_ranks,
                    E,
                    SCALED,
                    SHIFT,
                    AMAX,
                    D,
                    K,
                )
                m1 = i0 + 1 < numel
                c1 = _scaled_codes(
                    x_ptr,
                    i0 + 1,
                    m1,
                    scale_ptr,
                    off_ptr,
                    first_ptr,
                    last,
                    lo,
                    hi,
                    step,
                    n_ranks,
                    E,
                    SCALED,
                    SHIFT,
                    AMAX,
                    D,
                    K,
                )
                _store_codes(out_ptr, pid, c0, c1, i0 < total, WIRE, BLOCK)
        else:
            i0 = first + tl.arange(0, BLOCK)
            # A full program's mask is a constant: its loads and stores vectorise (a mask
            # computed from an unspecialised numel would split them into scalar ones).
            if first + BLOCK <= numel:
                every = tl.full([BLOCK], 1, tl.int1)
                c0 = _scaled_codes(
                    x_ptr,
                    i0,
                    every,
                    scale_ptr,
                    off_ptr,
                    first_ptr,
                    last,
                    lo,
                    hi,
                    step,
                    n_ranks,
                    E,
                    SCALED,
                    SHIFT,
                    AMAX,
                    D,
                    K,
                )
                _store_codes(out_ptr, pid, c0, c0, every, WIRE, BLOCK, True)
            else:
                c0 = _scaled_codes(
                    x_ptr,
                    i0,
                    i0 < numel,
                    scale_ptr,
                    off_ptr,
                    first_ptr,
                    last,
                    lo,
                    hi,
                    step,
                    n_ranks,
                    E,
                    SCALED,
                    SHIFT,
                    AMAX,
                    D,
                    K,
                )
                _store_codes(out_ptr, pid, c0, c0, i0 < total, WIRE, BLOCK)

    @triton.jit(do_not_specialize=["numel", "top", "n_last", "divisor", "n_ranks"])
    def _decode_kernel(
        src_ptr,
        out_ptr,
        off_ptr,
        scale_ptr,
        first_ptr,
        seg_ptr,
        numel,
        top,
        n_last,
        divisor,
        n_ranks,
        D: tl.constexpr,
        E: tl.constexpr,
        K: tl.constexpr,
        WIRE: tl.constexpr,
        SCALED: tl.constexpr,
        SHIFT: tl.constexpr,
        AMAX: tl.constexpr,
        DIVIDE: tl.constexpr,
        BLOCK: tl.constexpr,
        TABLE: tl.constexpr = False,
    ):
        pid = tl.program_id(0).to(tl.int64)
        first = pid * BLOCK
        i = first + tl.arange(0, BLOCK)
        # A full program's mask is a constant: its loads and stores vectorise.
        if first + BLOCK <= numel:
            _decode_program(
                src_ptr,
                out_ptr,
                off_ptr,
                scale_ptr,
                first_ptr,
                seg_ptr,
                pid,
                first,
                i,
                tl.full([BLOCK], 1, tl.int1),
                numel,
                top,
                n_last,
                divisor,
                n_ranks,
                D,
                E,
                K,
                WIRE,
                SCALED,
                SHIFT,
                AMAX,
                DIVIDE,
                BLOCK,
                TABLE,
                True,
            )
        else:
            _decode_program(
                src_ptr,
                out_ptr,
                off_ptr,
                scale_ptr,
                first_ptr,
                seg_ptr,
                pid,
                first,
                i,
                i < numel,
                numel,
                top,
                n_last,
                divisor,
                n_ranks,
                D,
                E,
                K,
                WIRE,
                SCALED,
                SHIFT,
                AMAX,
                DIVIDE,
                BLOCK,
                TABLE,
            )

    @triton.jit
    def _decode_program(
        src_ptr,
        out_ptr,
        off_ptr,
        scale_ptr,
        first_ptr,
        seg_ptr,
        pid,
        first,
        i,
        mask,
        numel,
        top,
        n_last,
        divisor,
        n_ranks,
        D: tl.constexpr,
        E: tl.constexpr,
        K: tl.constexpr,
        WIRE: tl.constexpr,
        SCALED: tl.constexpr,
        SHIFT: tl.constexpr,
        AMAX: tl.constexpr,
        DIVIDE: tl.constexpr,
        BLOCK: tl.constexpr,
        TABLE: tl.constexpr,
        FULL: tl.constexpr = False,
    ):
        """One program of :func:`_decode_kernel`: elements ``i`` where ``mask`` (``FULL``:
        all ``BLOCK`` of them, the payload read contiguously)."""
        if FULL:
            v = _value(_load_codes(src_ptr, first, WIRE, BLOCK), D)
        else:
            v = _value(_load_code(src_ptr, i, mask, WIRE), D)
        if SCALED:
            last = tl.minimum(first + BLOCK, numel) - 1
            lo, hi, step = _program_segments(seg_ptr, pid, off_ptr, first, last, top, n_last, TABLE)
            v = v * _factor(
                scale_ptr,
                off_ptr,
                first_ptr,
                i,
                last,
                lo,
                hi,
                step,
                divisor,
                n_ranks,
                SHIFT,
                AMAX,
                DIVIDE,
                E,
                D,
                K,
            )
        tl.store(out_ptr + i, v, mask=mask)

    @triton.jit
    def _divide(s, divisor, DIVIDE: tl.constexpr):
        """float32 ``s / divisor`` rounded once to nearest even, subnormals kept.

        ``DIVIDE`` 1: ``divisor`` is the exact reciprocal of a power of two, and
        one multiply rounds as the division would. 2: through float64: the
        quotient rounded to 53 bits and then to float32's 24 is the quotient
        rounded once (53 >= 2 * 24 + 2; Figueroa), and a float64 division never
        flushes. Triton's own correctly rounded float32 division (``div_rn``)
        compiles to ``div.rn.ftz.f32`` in Triton 3.4.
        """
        if DIVIDE == 1:
            return s * divisor
        return (s.to(tl.float64) / divisor).to(tl.float32)  # divisor: an exact float32

    @triton.jit
    def _rank_sum(
        src_ptr,
        shard_bytes,
        n_ranks,
        idx,
        mask,
        D: tl.constexpr,
        WIRE: tl.constexpr,
        fac_ptr=None,
        fac_at=None,
        fac_stride=None,
        FACTORS: tl.constexpr = 0,
        own_ptr=None,
        own_row=None,
        OWN: tl.constexpr = 0,
    ):
        """float32 sum over ranks (r0 + r1 + ... in order) of element ``idx`` of every shard
        (rank r's ``shard_bytes`` from rank r - 1's).

        ``FACTORS``: rank r's values times the factor at ``fac_ptr[r * fac_stride +
        fac_at]`` (``fac_at`` broadcast against ``idx``): float32 factors (1) or
        one-byte keys read as their unscale (2, :func:`_key_scale`); each product
        rounded once before its add (the kernels compile without fused multiply-adds).
        ``OWN``: rank ``own_row``'s values are the float32 ``own_ptr[idx]`` (the
        owner's own, not rounded); -1: none.
        """
        acc = _value(_load_code(src_ptr, idx, mask, WIRE), D)  # rank 0 as is: -0 stays -0
        if FACTORS:
            acc = acc * _load_factor(fac_ptr + fac_at, FACTORS)
        # Nested: OWN is a constexpr, and no runtime test is built where it is 0.
        if OWN:  # noqa: SIM102
            if own_row == 0:
                acc = tl.load(own_ptr + idx, mask=mask, other=0.0)
        shard = shard_bytes.to(tl.int64)  # N shards may pass 2**31 bytes
        # A while loop: Triton 3.4's interpreter cannot iterate a range() to a tensor.
        r = shard * 0 + 1
        while r < n_ranks:
            v = _value(_load_code(src_ptr + r * shard, idx, mask, WIRE), D)
            if FACTORS:
                v = v * _load_factor(fac_ptr + r * fac_stride + fac_at, FACTORS)
            if OWN:  # noqa: SIM102
                if r == own_row:
                    v = tl.load(own_ptr + idx, mask=mask, other=0.0)
            acc += v
            r += 1
        return acc

    @triton.jit
    def _load_factor(ptr, FACTORS: tl.constexpr):
        """The float32 factor at ``ptr``: a float32 (``FACTORS`` 1) or a key's unscale (2)."""
        if FACTORS == 2:
            f = _key_scale(tl.load(ptr).to(tl.int32), True)
        else:
            f = tl.load(ptr)
        return f

    @triton.jit
    def _key_exponent(k):
        """int32 exponent ``127 - k`` of int32 keys ``k``, 0 for the keys 0 and 255
        (:func:`aps_comm.scaling.key_exponents`)."""
        return tl.where((k == 0) | (k == 255), 0, 127 - k)

    @triton.jit
    def _key_scale(k, UNSCALE: tl.constexpr):
        """float32 factor of int32 exponent keys ``k``: ``2**e`` (``UNSCALE``: ``2**-e``) of
        ``e = 127 - k``, 1 for the keys 0 and 255: the codec's 256-entry key table
        (:func:`aps_comm.scaling.key_factors`) the CPU kernels look keys up in."""
        e = _key_exponent(k)
        if UNSCALE:
            e = -e
        return _pow2(e)

    @triton.jit(do_not_specialize=["shard_bytes", "numel", "n_ranks"])
    def _reduce_kernel(
        src_ptr,
        out_ptr,
        shard_bytes,
        numel,
        n_ranks,
        divisor,
        E: tl.constexpr,
        D: tl.constexpr,
        WIRE: tl.constexpr,
        DIVIDE: tl.constexpr,
        ENCODE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Sum N shards in rank order, divide by the divisor (IEEE-rounded: ``DIVIDE``
        0 not at all, else see :func:`_divide`), then encode (``ENCODE``) or store
        float32."""
        pid = tl.program_id(0).to(tl.int64)
        first = pid * BLOCK
        if ENCODE and WIRE == 4:
            i0 = first + 2 * tl.arange(0, BLOCK // 2)
            m0 = i0 < numel
            s0 = _rank_sum(src_ptr, shard_bytes, n_ranks, i0, m0, D, WIRE)
            s1 = _rank_sum(src_ptr, shard_bytes, n_ranks, i0 + 1, i0 + 1 < numel, D, WIRE)
            if DIVIDE:
                s0 = _divide(s0, divisor, DIVIDE)
                s1 = _divide(s1, divisor, DIVIDE)
            c0 = tl.where(m0, _code(s0, E), 0)
            c1 = tl.where(i0 + 1 < numel, _code(s1, E), 0)
            _store_codes(out_ptr, pid, c0, c1, m0, WIRE, BLOCK)
        else:
            i = first + tl.arange(0, BLOCK)
            mask = i < numel
            s = _rank_sum(src_ptr, shard_bytes, n_ranks, i, mask, D, WIRE)
            if DIVIDE:
                s = _divide(s, divisor, DIVIDE)
            if ENCODE:
                c = tl.where(mask, _code(s, E), 0)
                _store_codes(out_ptr, pid, c, c, mask, WIRE, BLOCK)
            else:
                tl.store(out_ptr + i, s, mask=mask)


if AVAILABLE:
    # The combine function of tl.max itself: compiled, the same reduction as a
    # function of our own returning tl.maximum(a, b); interpreted, numpy's max
    # over the whole axis instead of one Python call per element (the
    # interpreter recognises this function, not a copy of it).
    _larger = tl.standard._elementwise_max
    _plus = tl.standard._sum_combine  # tl.sum's, likewise
    _smaller = tl.standard._elementwise_min  # tl.min's

    @triton.jit
    def _mean_exponent(m, e, M: tl.constexpr):
        """int32 extra exponents d of blocks from their max |mean| bits ``m`` (int32, NaN
        clamped to inf) and agreed exponents ``e``: :func:`aps_comm.scaling.mean_exponents`
        in integers, as :func:`aps_comm.cpu_kernels._mean_exponent` (``M``:
        :func:`aps_comm.cpu_kernels.mean_limit`)."""
        # A float32 subnormal's leading bit: its int -> float conversion is exact.
        top = (m.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
        top = tl.minimum(tl.maximum(top, 0), 22)  # only used below 2**-126: no wild shift
        normal = m >= 0x800000
        ea = tl.where(normal, (m >> 23) - 127, top - 149)
        ma = tl.where(normal, m & 0x7FFFFF, (m << (23 - top)) & 0x7FFFFF)
        d = M[0] - ea - (ma > M[1]).to(tl.int32)
        d = tl.minimum(tl.maximum(d, -M[2]), M[2])
        d = tl.where((m == 0) | (m >= 0x7F800000), 0, d)
        return tl.minimum(d, M[2] - e)

    @triton.jit
    def _pow2(d):
        """float32 2**d for int32 d in [-149, 127], from bits (:func:`aps_comm.formats.pow2`)."""
        sub = tl.full(d.shape, 1, tl.int32) << tl.minimum(tl.maximum(d + 149, 0), 22)
        bits = tl.where(d >= -126, (tl.maximum(d, -126) + 127) << 23, sub)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _tile_index(off_ptr, el, e0, s0, s1, lead_start, ROWS: tl.constexpr, WIDTH: tl.constexpr):
        """Where element ``el`` lies in a :func:`_reduce_blocks_kernel` tile (flattened):
        row 0 (the lead block) before the program's first element ``e0``, else its own
        block's row, found by a binary search over the program's blocks."""
        seg = _search(off_ptr, el, el * 0 + s0, s0 * 0 + ROWS // 2, s1 - 1)
        own = (1 + seg - s0) * WIDTH + (el - tl.load(off_ptr + seg))
        return tl.where(el < e0, el - lead_start, own).to(tl.int32)

    @triton.jit(
        do_not_specialize=[
            "shard_bytes",
            "n_blocks",
            "n_ranks",
            "top",
            "key_at",
            "used",
            "n_out",
            "flag_at",
            "n_flags",
            "n_tiles",
            "own_ptr",
            "own_row",
        ]
    )
    def _reduce_blocks_kernel(
        src_ptr,
        out_ptr,
        d_ptr,
        off_ptr,
        exp_ptr,
        fac_ptr,
        union_ptr,
        layer_ptr,
        own_ptr,
        own_row,
        shard_bytes,
        n_blocks,
        n_ranks,
        divisor,
        top,
        key_at,
        used,
        n_out,
        flag_at,
        n_flags,
        n_tiles,
        E: tl.constexpr,
        D: tl.constexpr,
        M: tl.constexpr,
        WIRE: tl.constexpr,
        DIVIDE: tl.constexpr,
        LEAD: tl.constexpr,
        ROWS: tl.constexpr,
        WIDTH: tl.constexpr,
        FACTORS: tl.constexpr,
    ):
        """The owner's step with block exponents over a tile of whole blocks, one per row.

        Program p owns blocks ``s0 = p * (ROWS - LEAD)`` on: row ``LEAD + j`` of
        its [ROWS, WIDTH] tile is block ``s0 + j``. The rows' N ranks' codes are
        decoded and summed in rank order (rank r's ``shard_bytes`` after rank
        r - 1's), divided (:func:`_divide`), each row's max gives its d (from
        the agreed exponents at ``exp_ptr``), and the codes of ``mean * 2**d``
        are stored. ``FACTORS``: every rank encoded with its own block
        exponents: rank r's values of block b are multiplied by
        ``fac_ptr[r * n_blocks + b]`` (``FACTORS`` 1) before they are added,
        and the agreed exponents are 0 (``exp_ptr`` is not read). ``FACTORS`` 2:
        the factors are the unscales (:func:`_key_scale`) of the one-byte keys
        each rank sent in its piece (``shard_bytes`` bytes from the last's) at
        ``key_at``, and the mean's keys ``127 - d`` are stored at ``out_ptr +
        key_at``; programs from ``n_tiles`` on do the rest of the owner's
        bytes (:func:`_owner_tail`). With factors, rank ``own_row``'s values
        (if not -1) are the float32 ``own_ptr`` (the shard's elements from 0):
        the owner's own, never rounded. ``FACTORS`` 3: agreed exponents from the
        uint8 keys at ``exp_ptr`` (:func:`_key_exponent`), no factors, the mean's
        d clamped to a byte stored at ``out_ptr + key_at``; the tail programs
        set ``union[layer[b]]`` (``layer_ptr``; the union zeroed before) for
        each of the group's first ``n_flags`` agreed keys at ``fac_ptr`` that is 255.
        4-bit codes (``LEAD`` 1): a block may start at an odd element, sharing
        its first byte with the block before it, perhaps another program's.
        Each byte is written by the program owning its high nibble's element
        (the last program also writes the final half byte): a program whose
        first element is odd computes the block holding the element before it
        as well (row 0, found by a search; its d is not stored), and reads
        each byte's two codes out of the flattened tile with ``tl.gather``.
        """
        pid = tl.program_id(0).to(tl.int64)
        # FACTORS 2: the programs after the tiles write the tail bytes and the flags.
        tail = False
        if FACTORS >= 2:
            tail = pid >= n_tiles
        if tail:
            _owner_tail(
                pid - n_tiles,
                src_ptr,
                out_ptr,
                union_ptr,
                shard_bytes,
                n_ranks,
                n_blocks,
                key_at,
                used,
                n_out,
                flag_at,
                n_flags,
                ROWS * WIDTH,
                fac_ptr,
                layer_ptr,
                FACTORS == 3,
            )
        else:
            _owner_tile(
                pid,
                src_ptr,
                out_ptr,
                d_ptr,
                off_ptr,
                exp_ptr,
                fac_ptr,
                own_ptr,
                own_row,
                shard_bytes,
                n_blocks,
                n_ranks,
                divisor,
                top,
                key_at,
                E,
                D,
                M,
                WIRE,
                DIVIDE,
                LEAD,
                ROWS,
                WIDTH,
                FACTORS,
            )

    @triton.jit
    def _owner_tile(
        pid,
        src_ptr,
        out_ptr,
        d_ptr,
        off_ptr,
        exp_ptr,
        fac_ptr,
        own_ptr,
        own_row,
        shard_bytes,
        n_blocks,
        n_ranks,
        divisor,
        top,
        key_at,
        E: tl.constexpr,
        D: tl.constexpr,
        M: tl.constexpr,
        WIRE: tl.constexpr,
        DIVIDE: tl.constexpr,
        LEAD: tl.constexpr,
        ROWS: tl.constexpr,
        WIDTH: tl.constexpr,
        FACTORS: tl.constexpr,
    ):
        """Program ``pid``'s tile of :func:`_reduce_blocks_kernel`."""
        s0 = pid * (ROWS - LEAD)
        s1 = tl.minimum(s0 + ROWS - LEAD, n_blocks)
        e0 = tl.load(off_ptr + s0)
        e1 = tl.load(off_ptr + s1)
        r = tl.arange(0, ROWS)
        seg = s0 + r - LEAD
        owned = (r >= LEAD) & (seg < s1)
        start = tl.load(off_ptr + seg, mask=owned, other=0)
        end = tl.load(off_ptr + seg + 1, mask=owned, other=0)
        lead_start = e0
        if LEAD:
            zero = s0 * 0
            lead = _search(off_ptr, e0 - 1, zero, zero + top, n_blocks - 1)
            lead_start = tl.load(off_ptr + lead)
            has_lead = (e0 & 1) == 1
            seg = tl.where(r == 0, lead, seg)
            start = tl.where(r == 0, lead_start, start)
            end = tl.where((r == 0) & has_lead, tl.load(off_ptr + lead + 1), end)
        j = tl.arange(0, WIDTH)
        idx = start[:, None] + j[None, :]
        mask = j[None, :] < (end - start)[:, None]
        valid = owned | (r < LEAD)
        # A row past the last block reads block 0's factors (its elements are masked).
        fac_at = tl.where(valid, seg, 0)[:, None]
        if FACTORS == 2:  # every rank's keys lie in its piece after its codes
            fac, stride = src_ptr + key_at, shard_bytes.to(tl.int64)
        else:
            fac, stride = fac_ptr, n_blocks
        # FACTORS % 3: agreed keys (3) scale no rank's values, as agreed exponents (0).
        v = _rank_sum(
            src_ptr,
            shard_bytes,
            n_ranks,
            idx,
            mask,
            D,
            WIRE,
            fac,
            fac_at,
            stride,
            FACTORS % 3,
            own_ptr,
            own_row,
            FACTORS % 3 > 0,
        )
        if DIVIDE:
            v = _divide(v, divisor, DIVIDE)
        mag = tl.where(mask, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        # tl.reduce, not tl.max (a library @jit function: see _factor's tl.full).
        m = tl.minimum(tl.reduce(mag, 1, _larger), 0x7F800000)  # NaN above inf: to inf
        if FACTORS == 3:
            e = _key_exponent(tl.load(exp_ptr + seg, mask=valid, other=0).to(tl.int32))
            d = _mean_exponent(m, e, M)
        elif FACTORS:
            d = _mean_exponent(m, 0, M)
        else:
            d = _mean_exponent(m, tl.load(exp_ptr + seg, mask=valid, other=0), M)
        tl.store(d_ptr + seg, d, mask=owned)
        if FACTORS == 2:  # the mean's keys after its codes (zero and non-finite blocks: d = 0)
            tl.store(out_ptr + key_at + seg, (127 - d).to(tl.uint8), mask=owned)
        if FACTORS == 3:  # the mean's extra exponents after its codes, a byte each
            byte = tl.minimum(tl.maximum(d, 0), 255).to(tl.uint8)
            tl.store(out_ptr + key_at + seg, byte, mask=owned)
        c = tl.where(mask, _code(v * _pow2(d)[:, None], E), 0)
        if WIRE == 4:
            flat = tl.reshape(c, [ROWS * WIDTH])
            k = (e0 >> 1) + tl.arange(0, ROWS * WIDTH // 2)
            stop = (e1 >> 1) + ((s1 == n_blocks) & ((e1 & 1) == 1)).to(tl.int64)
            bmask = k < stop
            low = tl.where(bmask, 2 * k, e0)
            high = tl.where(bmask & (2 * k + 1 < e1), 2 * k + 1, e0)
            c0 = tl.gather(flat, _tile_index(off_ptr, low, e0, s0, s1, lead_start, ROWS, WIDTH), 0)
            c1 = tl.gather(flat, _tile_index(off_ptr, high, e0, s0, s1, lead_start, ROWS, WIDTH), 0)
            c1 = tl.where(2 * k + 1 < e1, c1, 0)
            tl.store(out_ptr + k, (c0 | (c1 << 4)).to(tl.uint8), mask=bmask)
        elif WIRE == 8:
            tl.store(out_ptr + idx, c.to(tl.uint8), mask=mask)
        else:
            tl.store(out_ptr + 2 * idx, (c & 0xFF).to(tl.uint8), mask=mask)
            tl.store(out_ptr + 2 * idx + 1, (c >> 8).to(tl.uint8), mask=mask)

    @triton.jit
    def _owner_tail(
        t,
        src_ptr,
        out_ptr,
        union_ptr,
        piece,
        n_ranks,
        n_blocks,
        key_at,
        used,
        n_out,
        flag_at,
        n_flags,
        TB: tl.constexpr,
        key_ptr,
        layer_ptr,
        AGREED: tl.constexpr,
    ):
        """Tile ``t`` of the owner's bytes outside its blocks' codes and keys: zeros from
        ``used`` to ``n_out`` around the keys at ``key_at``, and the OR over ranks of
        every rank's ``n_flags`` layer flags at ``flag_at`` of its piece into ``union``.
        ``AGREED``: instead, a 1 into ``union`` at the layer (``layer_ptr``) of each of
        the ``n_flags`` agreed keys at ``key_ptr`` that is 255 (plain stores of the
        same byte: programs meeting at a layer need no atomics)."""
        i = t * TB + tl.arange(0, TB)
        p = used + i
        keys_end = key_at.to(tl.int64) + n_blocks  # int32 operands may pass 2**31 summed
        zero = (p < n_out) & ((p < key_at) | (p >= keys_end))
        tl.store(out_ptr + p, tl.full(i.shape, 0, tl.uint8), mask=zero)
        has = i < n_flags
        if AGREED:
            bad = has & (tl.load(key_ptr + i, mask=has, other=0) == 255)
            layer = tl.load(layer_ptr + i, mask=bad, other=0)
            tl.store(union_ptr + layer, tl.full(i.shape, 1, tl.uint8), mask=bad)
        else:
            u = tl.load(src_ptr + flag_at + i, mask=has, other=0)
            stride = piece.to(tl.int64)
            r = stride * 0 + 1
            while r < n_ranks:
                u = u | tl.load(src_ptr + r * stride + flag_at + i, mask=has, other=0)
                r += 1
            tl.store(union_ptr + i, u, mask=has)


if AVAILABLE:

    @triton.jit
    def _largest(p, LE: tl.constexpr, LM: tl.constexpr):
        """Largest integer e with ``p * 2**e`` at most the limit whose float64 exponent is
        ``LE`` and mantissa field ``LM`` (``p``: positive normal float64), from the bits."""
        bits = p.to(tl.int64, bitcast=True)
        ep = (bits >> 52) - 1023
        mp = bits & 0xFFFFFFFFFFFFF
        return (LE - ep - (mp > LM).to(tl.int64)).to(tl.int32)

    @triton.jit
    def _exp_key(m, n_ranks, E: tl.constexpr, D: tl.constexpr, K: tl.constexpr):
        """int32 exponent key of a maximum's bits ``m`` (NaN given as inf):
        :func:`aps_comm.scaling.exponent_keys` for one layer (``K``: :func:`key_constants`).

        Exact integer work on float64 bit fields where scaling computes the same
        exponent with float64 logarithms: ``m`` has 24 significant bits and the
        ranks at most 24, so every product below is exact.
        """
        bad = m >= 0x7F800000
        zero = m == 0
        a = tl.where(bad | zero, 0x3F800000, m).to(tl.float32, bitcast=True).to(tl.float64)
        n = n_ranks.to(tl.float64)
        if K[0] == 1:
            # A native sum of N values: N * amax * 2**e fits, and so does N times the
            # value as the encoder rounds it (else one binade less).
            e = _largest(a * n, K[1], K[2])
            p2 = ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
            r = _value(_code((a * p2).to(tl.float32), E), D).to(tl.float64)
            fmax = (m * 0 + K[3]).to(tl.float32, bitcast=True).to(tl.float64)
            e = tl.where(r * n > fmax, e - 1, e)
        else:
            # two_phase: the value fits the format, and the owner's FP32 sum of N fits float32.
            e = tl.minimum(_largest(a, K[1], K[2]), _largest(a * n, 127, 0xFFFFFE0000000))
        e = tl.minimum(tl.maximum(e, -K[4]), K[4])
        key = tl.where(zero, 0, 127 - e)
        return tl.where(bad, 255, key)

    @triton.jit(do_not_specialize=["numel", "top", "n_last"])
    def _maxima_kernel(
        x_ptr,
        amax_ptr,
        off_ptr,
        seg_ptr,
        numel,
        top,
        n_last,
        BLOCK: tl.constexpr,
        TABLE: tl.constexpr = False,
    ):
        """Each segment's max |x| (NaN as inf), MAX-ed into ``amax_ptr`` as int32 bits
        (zero beforehand): non-negative float32 bits order as the values do.

        Every program takes the max of its pieces and meets the others in one
        atomic max per segment it touches, with no second pass.
        """
        pid = tl.program_id(0).to(tl.int64)
        first = pid * BLOCK
        i = first + tl.arange(0, BLOCK)
        mask = i < numel
        if first + BLOCK <= numel:
            x = tl.load(x_ptr + i)  # unmasked: vectorised
        else:
            x = tl.load(x_ptr + i, mask=mask, other=0.0)
        # An integer max of |x|'s bits is a max that keeps NaN (above inf): to inf.
        mag = tl.minimum(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x7F800000)
        last = tl.minimum(first + BLOCK, numel) - 1
        lo, hi, step = _program_segments(seg_ptr, pid, off_ptr, first, last, top, n_last, TABLE)
        if lo == hi:
            tl.atomic_max(amax_ptr + lo, tl.reduce(mag, 0, _larger))
        else:
            seg = _search(off_ptr, i, tl.full(i.shape, 0, tl.int32) + lo, step, hi)
            s = lo
            while s <= hi:
                tl.atomic_max(amax_ptr + s, tl.reduce(tl.where(seg == s, mag, 0), 0, _larger))
                s += 1


if AVAILABLE:
    # two_phase with every rank's own block exponents (the default block scaling):
    # the keys, and per chunk the send, the owner's step (:func:`_reduce_blocks_kernel`
    # with ``FACTORS`` 2) and the decode, each one launch whatever the number of
    # ranks, layers or blocks; the bytes of :mod:`aps_comm.cpu_kernels`'
    # ``send_rank_blocks``, ``owner_rank_blocks`` and ``decode_rank_blocks``.

    @triton.jit
    def _blocks_of(off_ptr, el, first, last, s, n_last, top, SHIFT: tl.constexpr = 0):
        """The segment in [s, n_last] (largest t with ``off[t] <= el``) of every element
        ``el`` of a program whose elements run from ``first`` to ``last``: the two ends
        searched over every segment, the elements only between the ends'.

        ``SHIFT`` > 0: no segment is longer than ``2**SHIFT`` (blocks). Where the
        end's segments but the last are all that long (a program inside one
        layer), an element's segment is arithmetic, not a search per element.
        """
        lo = _search(off_ptr, first, s, top, n_last)
        hi = _search(off_ptr, last, lo, top, n_last)
        seg = tl.full(el.shape, 0, tl.int64) + lo
        if lo != hi:  # a program inside one segment needs no search
            o_lo = tl.load(off_ptr + lo)
            regular = False
            if SHIFT > 0:
                regular = tl.load(off_ptr + hi) - o_lo == (hi - lo) << SHIFT
            if regular:
                seg = seg + ((el - o_lo) >> SHIFT)
            else:
                step = lo * 0
                nxt = step + 1
                while nxt <= hi - lo:
                    step = nxt
                    nxt = nxt * 2
                seg = _search(off_ptr, el, seg, step, hi)
        return seg

    @triton.jit
    def _tile(x_ptr, off_ptr, n_blocks, ROWS: tl.constexpr, WIDTH: tl.constexpr):
        """A program's tile of ``ROWS`` whole blocks, one per row of at most ``WIDTH``
        elements (zeros past a block's end): (its blocks, which of them exist, the values)."""
        seg = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        owned = seg < n_blocks
        start = tl.load(off_ptr + seg, mask=owned, other=0)
        end = tl.load(off_ptr + seg + 1, mask=owned, other=0)
        j = tl.arange(0, WIDTH)
        mask = j[None, :] < (end - start)[:, None]
        return seg, owned, tl.load(x_ptr + (start[:, None] + j[None, :]), mask=mask, other=0.0)

    @triton.jit
    def _tile_maxima(x_ptr, off_ptr, n_blocks, ROWS: tl.constexpr, WIDTH: tl.constexpr):
        """:func:`_tile`'s blocks, which exist, and each one's max |x| as int32 bits. An
        integer max of |x|'s bits is a max that keeps NaN (above inf): to inf."""
        seg, owned, x = _tile(x_ptr, off_ptr, n_blocks, ROWS, WIDTH)
        mag = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return seg, owned, tl.minimum(tl.reduce(mag, 1, _larger), 0x7F800000)

    @triton.jit
    def _staged_exponents(a, n_ranks, per_node, F: tl.constexpr, LIMIT: tl.constexpr):
        """(inner, outer) exponents of the staged routes for float64 maxima ``a`` (finite,
        non-zero), clamped to ``LIMIT``: :func:`aps_comm.cpu_kernels.staged_keys`' exact
        integer work on float64 fields (``F``: the format's max's exponent and mantissa
        field). The node sums add L gradients (headroom L, M of them summed in FP32); the
        mean sent back needs none (N summed). Products of a 24-bit value and rank counts:
        exact."""
        h = a * per_node.to(tl.float64)
        nodes = (n_ranks // per_node).to(tl.float64)
        f32max: tl.constexpr = 0xFFFFFE0000000
        inner = tl.minimum(_largest(h, F[0], F[1]), _largest(h * nodes, 127, f32max))
        outer = tl.minimum(
            _largest(a, F[0], F[1]), _largest(a * n_ranks.to(tl.float64), 127, f32max)
        )
        inner = tl.minimum(tl.maximum(inner, -LIMIT), LIMIT)
        return inner, tl.minimum(tl.maximum(outer, -LIMIT), LIMIT)

    @triton.jit(do_not_specialize=["n_blocks", "n_ranks"])
    def _block_keys_kernel(
        x_ptr,
        off_ptr,
        layer_ptr,
        amax_ptr,
        key_ptr,
        flag_ptr,
        n_blocks,
        n_ranks,
        M: tl.constexpr,
        ROWS: tl.constexpr,
        WIDTH: tl.constexpr,
        BOUND: tl.constexpr = False,
        ZERO: tl.constexpr = False,
    ):
        """Every block's max |x| (NaN as inf; int32 bits), its two_phase key (0 for a zero
        max, 255 for inf, else ``127 - d`` of :func:`_mean_exponent`) and a 1 in
        ``flag_ptr`` at the layer (``layer_ptr``) of each block keyed 255 (``ZERO``: a 0
        at the layer of every block instead: agreed exponents' union, which the first
        chunk's owner step sets after the keys are agreed).
        ``BOUND``: the format's max times ``n_ranks`` passes float32's (bf16): d is at
        most the largest e with ``n_ranks * max * 2**e`` within float32's max too (the
        owner's FP32 sum; :func:`aps_comm.cpu_kernels.two_phase_keys`).

        A tile of ``ROWS`` whole blocks per program, one per row (a block has
        at most ``WIDTH`` elements); the flags are plain stores of the same
        byte (zeroed before), so programs meeting at a layer need no atomics.
        """
        seg, owned, m = _tile_maxima(x_ptr, off_ptr, n_blocks, ROWS, WIDTH)
        d = _mean_exponent(m, 0, M)
        if BOUND:
            ok = tl.where((m == 0) | (m == 0x7F800000), 0x3F800000, m)
            a = ok.to(tl.float32, bitcast=True).to(tl.float64) * n_ranks.to(tl.float64)
            d = tl.minimum(
                d, tl.minimum(tl.maximum(_largest(a, 127, 0xFFFFFE0000000), -M[2]), M[2])
            )
        key = tl.where(m == 0, 0, tl.where(m == 0x7F800000, 255, 127 - d))
        tl.store(amax_ptr + seg, m, mask=owned)
        tl.store(key_ptr + seg, key.to(tl.uint8), mask=owned)
        layer = tl.load(layer_ptr + seg, mask=owned, other=0)
        if ZERO:
            tl.store(flag_ptr + layer, tl.full(seg.shape, 0, tl.uint8), mask=owned)
        else:
            tl.store(flag_ptr + layer, tl.full(seg.shape, 1, tl.uint8), mask=owned & (key == 255))

    @triton.jit(do_not_specialize=["n_blocks", "n_ranks"])
    def _native_block_keys_kernel(
        x_ptr,
        off_ptr,
        amax_ptr,
        key_ptr,
        n_blocks,
        n_ranks,
        E: tl.constexpr,
        D: tl.constexpr,
        K: tl.constexpr,
        ROWS: tl.constexpr,
        WIDTH: tl.constexpr,
    ):
        """Every block's max |x| (NaN as inf; int32 bits) and its key under the native
        sum's rule (``K``: :func:`key_constants`, native): the agreed keys' inputs of
        :func:`aps_comm.cpu_kernels.native_block_keys`. A tile of ``ROWS`` whole blocks per
        program, as :func:`_block_keys_kernel`'s."""
        seg, owned, m = _tile_maxima(x_ptr, off_ptr, n_blocks, ROWS, WIDTH)
        tl.store(amax_ptr + seg, m, mask=owned)
        tl.store(key_ptr + seg, _exp_key(m, n_ranks, E, D, K).to(tl.uint8), mask=owned)

    @triton.jit(do_not_specialize=["n_blocks"])
    def _block_records_kernel(
        x_ptr,
        off_ptr,
        layer_ptr,
        key_ptr,
        amax_ptr,
        acc_ptr,
        n_blocks,
        TINY: tl.constexpr,
        FMAX: tl.constexpr,
        ROWS: tl.constexpr,
        WIDTH: tl.constexpr,
    ):
        """Every block's records folded into its layer's int32 row of ``acc_ptr`` (5 per
        layer, zero before): ``256 - e`` of its key's exponent ``e`` (max: the smallest
        e), its maximum's bits (max) and its nonzero, underflowing and saturating
        elements times ``2**e`` (sums), the float32 products of
        :func:`aps_comm.cpu_kernels.block_records`. A tile of ``ROWS`` whole blocks per
        program, one per row, their layers (``layer_ptr``) ascending.

        Each program folds its rows per layer first and meets the others in 5
        atomics per layer it touches, not per block: atomics on the few rows of
        a model's largest layers serialise on a GPU. Integer maxima and sums
        are the same in any order."""
        seg, owned, x = _tile(x_ptr, off_ptr, n_blocks, ROWS, WIDTH)
        k = tl.load(key_ptr + seg, mask=owned, other=0).to(tl.int32)
        m = tl.abs(x) * _key_scale(k, False)[:, None]
        live = m > 0
        exps = 256 - _key_exponent(k)
        amax = tl.load(amax_ptr + seg, mask=owned, other=0)
        nonzero = tl.reduce(live.to(tl.int32), 1, _plus)
        under = tl.reduce((live & (m <= TINY)).to(tl.int32), 1, _plus)
        saturated = tl.reduce((m > FMAX).to(tl.int32), 1, _plus)
        layer = tl.load(layer_ptr + seg, mask=owned, other=0)
        past = tl.full(layer.shape, 2**31 - 1, tl.int32)  # above every layer: no block
        s = tl.reduce(tl.where(owned, layer, past), 0, _smaller)
        while s < 2**31 - 1:  # the program's layers, ascending
            at = owned & (layer == s)
            row = acc_ptr + s.to(tl.int64) * 5
            tl.atomic_max(row, tl.reduce(tl.where(at, exps, 0), 0, _larger))
            tl.atomic_max(row + 1, tl.reduce(tl.where(at, amax, 0), 0, _larger))
            tl.atomic_add(row + 2, tl.reduce(tl.where(at, nonzero, 0), 0, _plus))
            tl.atomic_add(row + 3, tl.reduce(tl.where(at, under, 0), 0, _plus))
            tl.atomic_add(row + 4, tl.reduce(tl.where(at, saturated, 0), 0, _plus))
            s = tl.reduce(tl.where(owned & (layer > s), layer, past), 0, _smaller)

    @triton.jit(do_not_specialize=["n_layers"])
    def _records_rows_kernel(acc_ptr, out_ptr, n_layers, BLOCK: tl.constexpr):
        """:func:`_block_records_kernel`'s int32 rows as float64 records (exponent, max,
        the counts; 0 for a layer without blocks) into ``out_ptr``, the rows zeroed again
        for the next step."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n_layers * 5
        a = tl.load(acc_ptr + i, mask=live, other=0)
        col = i % 5
        e = tl.where(a == 0, 0, 256 - a).to(tl.float64)
        amax = a.to(tl.float32, bitcast=True).to(tl.float64)
        v = tl.where(col == 0, e, tl.where(col == 1, amax, a.to(tl.float64)))
        tl.store(out_ptr + i, v, mask=live)
        tl.store(acc_ptr + i, tl.full(a.shape, 0, tl.int32), mask=live)

    @triton.jit(do_not_specialize=["n_blocks", "n_ranks", "per_node"])
    def _staged_keys_kernel(
        x_ptr,
        off_ptr,
        amax_ptr,
        key_ptr,
        n_blocks,
        n_ranks,
        per_node,
        F: tl.constexpr,
        LIMIT: tl.constexpr,
        ROWS: tl.constexpr,
        WIDTH: tl.constexpr,
    ):
        """Every block's max |x| (NaN as inf; int32 bits) and its staged routes' keys:
        ``127 - inner`` at ``key_ptr + b``, ``127 - outer`` at ``key_ptr + n_blocks + b``
        (0 for a zero max, 255 for inf): :func:`aps_comm.cpu_kernels.staged_keys`, exact
        integer work on float64 fields (``F``: the format's max's float64 exponent and
        mantissa field). A tile of ``ROWS`` whole blocks per program, one per row."""
        seg, owned, m = _tile_maxima(x_ptr, off_ptr, n_blocks, ROWS, WIDTH)
        ok = (m != 0) & (m != 0x7F800000)
        a = tl.where(ok, m, 0x3F800000).to(tl.float32, bitcast=True).to(tl.float64)
        inner, outer = _staged_exponents(a, n_ranks, per_node, F, LIMIT)
        special = tl.where(m == 0, 0, 255)
        tl.store(amax_ptr + seg, m, mask=owned)
        tl.store(key_ptr + seg, tl.where(ok, 127 - inner, special).to(tl.uint8), mask=owned)
        outer_key = tl.where(ok, 127 - outer, special).to(tl.uint8)
        tl.store(key_ptr + n_blocks + seg, outer_key, mask=owned)

    @triton.jit
    def _block_factors_kernel(
        key_ptr,
        first_ptr,
        scale_ptr,
        inverse_ptr,
        unscale_ptr,
        divisor,
        DIVIDE: tl.constexpr,
        INVERSE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One layer per program: its blocks' ``2**e`` and ``2**-e / divisor`` from their
        agreed keys, NaN for every block of a layer with a key of 255
        (:func:`aps_comm.cpu_kernels.block_factors_into`, with a divisor
        :func:`aps_comm.cpu_kernels.native_block_factors`); ``INVERSE``: the undivided
        ``2**-e`` into ``inverse_ptr`` too. ``first_ptr``: the layers' first blocks
        (layers + 1 entries)."""
        layer = tl.program_id(0).to(tl.int64)
        lo = tl.load(first_ptr + layer)
        hi = tl.load(first_ptr + layer + 1)
        bad = tl.full([BLOCK], 0, tl.int32)
        for b0 in range(lo, hi, BLOCK):
            b = b0 + tl.arange(0, BLOCK)
            k = tl.load(key_ptr + b, mask=b < hi, other=0)
            bad = tl.maximum(bad, (k == 255).to(tl.int32))
        nan = tl.reduce(bad, 0, _larger) > 0
        for b0 in range(lo, hi, BLOCK):
            b = b0 + tl.arange(0, BLOCK)
            live = b < hi
            e = _key_exponent(tl.load(key_ptr + b, mask=live, other=0).to(tl.int32))
            inverse = tl.where(nan, float("nan"), _pow2(-e))
            tl.store(scale_ptr + b, _pow2(e), mask=live)
            if INVERSE:
                tl.store(inverse_ptr + b, inverse, mask=live)
            if DIVIDE != 0:
                inverse = _divide(inverse, divisor, DIVIDE)
            tl.store(unscale_ptr + b, inverse, mask=live)

    @triton.jit(do_not_specialize=["n", "n_ranks", "per_node"])
    def _staged_factors_kernel(
        amax_ptr,
        out_ptr,
        n,
        n_ranks,
        per_node,
        F: tl.constexpr,
        LIMIT: tl.constexpr,
        GRID: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """The staged routes' factor rows (scale, shift, unscale, first; ``out_ptr`` 4 x
        ``n``) of ``n`` agreed maxima (int32 bits): :func:`aps_comm.cpu_kernels.staged_factors_into`,
        the exponents as :func:`_staged_keys_kernel` finds them (``LIMIT`` 0:
        ``scaling="none"``), the unscale NaN for a non-finite maximum."""
        s = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = s < n
        m = tl.load(amax_ptr + s, mask=live, other=0) & 0x7FFFFFFF
        ok = (m != 0) & (m < 0x7F800000)
        a = tl.where(ok, m, 0x3F800000).to(tl.float32, bitcast=True).to(tl.float64)
        inner, outer = _staged_exponents(a, n_ranks, per_node, F, LIMIT)
        inner, outer = tl.where(ok, inner, 0), tl.where(ok, outer, 0)
        if GRID:
            scale = _pow2(tl.minimum(tl.maximum(inner - outer, -149), 127))
            first = _pow2(outer)
        else:
            scale = _pow2(inner)
            first = tl.full([BLOCK], 1.0, tl.float32)
        shift = _pow2(tl.minimum(tl.maximum(outer - inner, -149), 127))
        unscale = tl.where(m >= 0x7F800000, float("nan"), _pow2(-outer))
        tl.store(out_ptr + s, scale, mask=live)
        tl.store(out_ptr + n + s, shift, mask=live)
        tl.store(out_ptr + 2 * n + s, unscale, mask=live)
        tl.store(out_ptr + 3 * n + s, first, mask=live)

    @triton.jit(do_not_specialize=["n_blocks"])
    def _staged_key_factors_kernel(
        key_ptr, first_ptr, out_ptr, n_blocks, GRID: tl.constexpr, BLOCK: tl.constexpr
    ):
        """One layer per program: its blocks' rows of the staged factors (scale, shift,
        unscale, first; ``out_ptr`` 4 x ``n_blocks``) from their agreed inner and outer
        keys, the unscale NaN for every block of a layer with a key of 255 in either row:
        :func:`aps_comm.cpu_kernels.staged_key_factors`. ``first_ptr``: the layers'
        first blocks (layers + 1 entries)."""
        layer = tl.program_id(0).to(tl.int64)
        n_blocks = n_blocks.to(tl.int64)  # 3 * n_blocks may pass 2**31
        lo = tl.load(first_ptr + layer)
        hi = tl.load(first_ptr + layer + 1)
        bad = tl.full([BLOCK], 0, tl.int32)
        for b0 in range(lo, hi, BLOCK):
            b = b0 + tl.arange(0, BLOCK)
            live = b < hi
            k0 = tl.load(key_ptr + b, mask=live, other=0)
            k1 = tl.load(key_ptr + n_blocks + b, mask=live, other=0)
            bad = tl.maximum(bad, ((k0 == 255) | (k1 == 255)).to(tl.int32))
        nan = tl.reduce(bad, 0, _larger) > 0
        for b0 in range(lo, hi, BLOCK):
            b = b0 + tl.arange(0, BLOCK)
            live = b < hi
            inner = _key_exponent(tl.load(key_ptr + b, mask=live, other=0).to(tl.int32))
            outer = _key_exponent(tl.load(key_ptr + n_blocks + b, mask=live, other=0).to(tl.int32))
            if GRID:
                scale = _pow2(tl.minimum(tl.maximum(inner - outer, -149), 127))
                first = _pow2(outer)
            else:
                scale = _pow2(inner)
                first = tl.full([BLOCK], 1.0, tl.float32)
            shift = _pow2(tl.minimum(tl.maximum(outer - inner, -149), 127))
            unscale = tl.where(nan, float("nan"), _pow2(-outer))
            tl.store(out_ptr + b, scale, mask=live)
            tl.store(out_ptr + n_blocks + b, shift, mask=live)
            tl.store(out_ptr + 2 * n_blocks + b, unscale, mask=live)
            tl.store(out_ptr + 3 * n_blocks + b, first, mask=live)

    @triton.jit
    def _send_code(
        x_ptr, key_ptr, off_ptr, el, mask, first, last, b0, n_last, top, E, SHIFT: tl.constexpr
    ):
        """uint32 codes of elements ``el`` times ``2**e`` of their blocks' keys (0 masked)."""
        blk = _blocks_of(off_ptr, el, first, last, b0, n_last, top, SHIFT)
        k = tl.load(key_ptr + blk, mask=mask, other=0).to(tl.int32)
        v = tl.load(x_ptr + el, mask=mask, other=0.0) * _key_scale(k, False)
        return tl.where(mask, _code(v, E), 0)

    # piece is specialised: a multiple of 16 lets a full program store whole vectors.
    @triton.jit(do_not_specialize=["shard_bytes", "at", "n_flags", "top", "log2"])
    def _send_rank_blocks_kernel(
        x_ptr,
        key_ptr,
        off_ptr,
        first_ptr,
        flag_ptr,
        send_ptr,
        piece,
        shard_bytes,
        at,
        n_flags,
        top,
        log2,
        E: tl.constexpr,
        WIRE: tl.constexpr,
        BYTES: tl.constexpr,
        SHIFT: tl.constexpr,
    ):
        """Bytes ``t * BYTES`` on of shard s's piece (program (s, t)): the codes of its
        blocks ``first[s]`` to ``first[s + 1]`` times their keys' ``2**e``, zero
        padding, the keys at ``shard_bytes``, and where ``at >= 0`` the ``n_flags``
        layer flags then ``log2`` (none where negative) at ``at``; zeros elsewhere. No block is longer
        than ``2**SHIFT`` elements (0: unknown).

        Whole bytes per program: a 4-bit byte's two codes come from one program.
        """
        # Shards on the grid's y axis (at most 65535), a shard's bytes on x: a piece can
        # hold more than 65535 programs' bytes (an embedding's bucket at world size 1).
        s = tl.program_id(1)
        t = tl.program_id(0).to(tl.int64)
        b0 = tl.load(first_ptr + s)
        b1 = tl.load(first_ptr + s + 1)
        a = tl.load(off_ptr + b0)
        n = tl.load(off_ptr + b1) - a
        i = t * BYTES + tl.arange(0, BYTES)
        per = 8 // WIRE  # elements per byte (0 for 16 bits: two bytes per element)
        el_prog = BYTES * 8 // WIRE  # elements per program
        first = a + tl.minimum(t * el_prog, tl.maximum(n - 1, 0))
        last = a + tl.maximum(tl.minimum((t + 1) * el_prog, n) - 1, 0)
        n_last = b1 - 1
        if (t + 1) * el_prog <= n:
            # Wholly inside the shard's codes: no mask, the values read contiguously
            # and a 4-bit byte's two codes (a 16-bit code's two bytes) paired in registers.
            if WIRE == 4:
                pairs = tl.full([2 * BYTES], 1, tl.int1)
                both = a + t * (2 * BYTES) + tl.arange(0, 2 * BYTES)
                c2 = _send_code(
                    x_ptr, key_ptr, off_ptr, both, pairs, first, last, b0, n_last, top, E, SHIFT
                )
                c_lo, c_hi = tl.split(tl.reshape(c2, [BYTES, 2]))
                c = c_lo | (c_hi << 4)
            elif WIRE == 8:
                every = tl.full([BYTES], 1, tl.int1)
                el = a + i
                c = _send_code(
                    x_ptr, key_ptr, off_ptr, el, every, first, last, b0, n_last, top, E, SHIFT
                )
            else:
                # Names of their own: a compiled branch's variables keep one shape.
                half = tl.full([BYTES // 2], 1, tl.int1)
                codes_el = a + t * (BYTES // 2) + tl.arange(0, BYTES // 2)
                c16 = _send_code(
                    x_ptr, key_ptr, off_ptr, codes_el, half, first, last, b0, n_last, top, E, SHIFT
                )
                c = tl.reshape(tl.join(c16 & 0xFF, c16 >> 8), [BYTES])
        elif WIRE == 16:
            # Each byte's element coded (twice per element: a partial program only).
            el = a + (i >> 1)
            c = _send_code(
                x_ptr, key_ptr, off_ptr, el, el < a + n, first, last, b0, n_last, top, E, SHIFT
            )
            c = (c >> ((i & 1) * 8).to(tl.uint32)) & 0xFF
        else:
            el = a + per * i
            c = _send_code(
                x_ptr, key_ptr, off_ptr, el, el < a + n, first, last, b0, n_last, top, E, SHIFT
            )
            if WIRE == 4:
                hi = _send_code(
                    x_ptr,
                    key_ptr,
                    off_ptr,
                    el + 1,
                    el + 1 < a + n,
                    first,
                    last,
                    b0,
                    n_last,
                    top,
                    E,
                    SHIFT,
                )
                c = c | (hi << 4)
        kb = i - shard_bytes
        in_keys = (kb >= 0) & (kb < b1 - b0)
        c = tl.where(in_keys, tl.load(key_ptr + b0 + kb, mask=in_keys, other=0).to(tl.uint32), c)
        # at is -1 for none (n_flags then 0): no byte has fi <= 0.
        fi = i - at
        in_flags = (fi >= 0) & (fi < n_flags)
        c = tl.where(in_flags, tl.load(flag_ptr + fi, mask=in_flags, other=0).to(tl.uint32), c)
        # A negative log2: no chunk byte (hierarchical's pieces carry none).
        c = tl.where((fi == n_flags) & (at >= 0) & (log2 >= 0), log2.to(tl.uint32), c)
        if (t + 1) * BYTES <= piece:
            tl.store(send_ptr + s.to(tl.int64) * piece + i, c.to(tl.uint8))
        else:
            tl.store(send_ptr + s.to(tl.int64) * piece + i, c.to(tl.uint8), mask=i < piece)

    # c0 is specialised: a multiple of 16 lets a full program store whole vectors.
    @triton.jit(
        do_not_specialize=[
            "numel",
            "row",
            "shard_bytes",
            "n_last",
            "top",
            "n_shards",
            "top_s",
        ]
    )
    def _decode_rank_blocks_kernel(
        src_ptr,
        x_ptr,
        off_ptr,
        first_ptr,
        start_ptr,
        layer_ptr,
        union_ptr,
        key_ptr,
        c0,
        numel,
        row,
        shard_bytes,
        n_last,
        top,
        n_shards,
        top_s,
        D: tl.constexpr,
        WIRE: tl.constexpr,
        BLOCK: tl.constexpr,
        SHIFT: tl.constexpr,
        AGREED: tl.constexpr = False,
    ):
        """Elements ``c0`` to ``c0 + numel`` of a chunk from its N gathered shards (row s
        of ``src_ptr``: shard s's codes, its blocks' keys at ``shard_bytes``): each
        code times its key's ``2**-e``, NaN where its block's layer is flagged in
        ``union``. Shard s starts at element ``start[s]`` and block ``first[s]``; no
        block is longer than ``2**SHIFT`` elements (0: unknown). ``AGREED``: the bytes
        at ``shard_bytes`` are the owner's extra exponents d, the blocks' agreed keys
        are at ``key_ptr``: each code times ``2**-(e + d)``.
        """
        pid = tl.program_id(0).to(tl.int64)
        first = c0 + pid * BLOCK
        last = tl.minimum(first + BLOCK, c0 + numel) - 1
        el = first + tl.arange(0, BLOCK)
        mask = el <= last
        zero = first * 0
        s = _blocks_of(start_ptr, el, first, last, zero, zero + n_shards - 1, top_s)
        blk = _blocks_of(off_ptr, el, first, last, zero, zero + n_last, top, SHIFT)
        base = src_ptr + s * row
        c = _load_code(base, el - tl.load(start_ptr + s, mask=mask, other=0), mask, WIRE)
        kb = blk - tl.load(first_ptr + s, mask=mask, other=0)
        k = tl.load(base + shard_bytes + kb, mask=mask, other=0).to(tl.int32)
        bad = tl.load(union_ptr + tl.load(layer_ptr + blk, mask=mask, other=0), mask=mask, other=0)
        if AGREED:
            agreed = tl.load(key_ptr + blk, mask=mask, other=0).to(tl.int32)
            f = _pow2(-(_key_exponent(agreed) + k))
        else:
            f = _key_scale(k, True)
        f = tl.where(bad != 0, float("nan"), f)
        # A full program stores without a mask: whole vectors.
        if (pid + 1) * BLOCK <= numel:
            tl.store(x_ptr + el, _value(c, D) * f)
        else:
            tl.store(x_ptr + el, _value(c, D) * f, mask=mask)


@functools.lru_cache(maxsize=64)
def key_constants(
    fmt: FloatFormat, native: bool, limit: int = EXPONENT_LIMIT
) -> tuple[int, int, int, int, int]:
    """The constants of the exponent rule the kernels apply to agreed maxima for ``fmt``
    (:func:`encode`'s and :func:`decode`'s ``maxima``): (1 for a native
    sum else 0, ``fmt.max``'s float64 exponent and mantissa field, its float32 bits,
    the exponent limit: ``limit``, 0 for ``scaling="none"``).

    Example:
        >>> from aps_comm.formats import E4M3
        >>> key_constants(E4M3, False)  # 448 = 1.75 * 2**8
        (0, 8, 3377699720527872, 1138753536, 126)
    """
    import struct

    b64 = struct.unpack("<q", struct.pack("<d", float(fmt.max)))[0]
    b32 = struct.unpack("<i", struct.pack("<f", float(fmt.max)))[0]
    return (int(native), (b64 >> 52) - 1023, b64 & ((1 << 52) - 1), b32, limit)


def layer_maxima(x: torch.Tensor, maxima: torch.Tensor, offsets: torch.Tensor) -> None:
    """Each segment's max |x| (NaN as inf), MAX-ed into float32 ``maxima`` (zeros first).

    Args: see :func:`bind_layer_maxima`, which this launches once.
    """
    bind_layer_maxima(x, maxima, offsets)()


def bind_layer_maxima(
    x: torch.Tensor, maxima: torch.Tensor, offsets: torch.Tensor, table: bool = False
) -> Callable[[], object]:
    """:func:`layer_maxima` checked and bound once: the returned call launches it.

    The values of :func:`aps_comm.codec.segment_amax` (NaN as inf, an empty
    segment 0) in one pass over ``x``: the maxima a MAX all-reduce agrees on.

    Args:
        x: contiguous float32 values.
        maxima: float32, one per segment, zero (or maxima to MAX with).
        offsets: int64 segment offsets on the device, from 0 to ``x.numel()``.
        table: as :func:`bind_encode`'s.
    """
    _check(E4M3, x, maxima)
    n = offsets.numel() - 1
    if x.dtype != torch.float32 or maxima.dtype != torch.float32 or maxima.numel() != n:
        raise ValueError(
            f"layer_maxima needs float32 values and {n} float32 maxima, got {x.dtype} and "
            f"{maxima.numel()} {maxima.dtype}"
        )
    _check_offsets(offsets, n, x.device)
    numel = x.numel()
    if not numel:
        return _NOTHING
    seg = _segment_table(offsets, n, numel, numel) if table else None
    return functools.partial(
        _maxima_kernel[_grid(numel)],
        x,
        maxima.view(torch.int32),
        offsets,
        offsets if seg is None else seg,
        numel,
        _top(n),
        n - 1,
        BLOCK=BLOCK,
        TABLE=seg is not None,
        **compile_options(),
    )


def _check(fmt: FloatFormat, *tensors: torch.Tensor) -> FormatConstants:
    if not AVAILABLE:
        raise RuntimeError("the Triton codec needs triton (pip install triton)")
    for t in tensors:
        problem = launch_problem(t.device)
        if problem:
            raise ValueError(problem)
    return format_constants(fmt, native_cvt(fmt, tensors[0].device) if tensors else 0)


def _nothing() -> None:
    """An empty launch: nothing to do."""


_NOTHING: Callable[[], object] = _nothing


def _grid(numel: int) -> tuple[int]:
    return launch_grid(triton.cdiv(numel, BLOCK))  # type: ignore[return-value]


GRID_LIMITS = (2**31 - 1, 65535, 65535)
"""The most programs a CUDA launch takes on each grid axis (x, y, z)."""


def launch_grid(*dims: int) -> tuple[int, ...]:
    """``dims`` as a launch grid, checked against :data:`GRID_LIMITS`.

    The interpreter takes any grid; a GPU refuses one over the limits at the
    launch ("invalid argument"), so the check is made where a kernel is bound,
    on every device.

    Example:
        >>> launch_grid(70000, 2)
        (70000, 2)
        >>> launch_grid(2, 70000)
        Traceback (most recent call last):
        ...
        ValueError: a launch grid of (2, 70000) programs: CUDA allows at most (2147483647, 65535, 65535)
    """
    if len(dims) > 3 or any(d > limit for d, limit in zip(dims, GRID_LIMITS, strict=False)):
        raise ValueError(f"a launch grid of {dims} programs: CUDA allows at most {GRID_LIMITS}")
    return dims


NUM_WARPS: int | None = None
"""Warps per program of the compiled kernels (None: Triton's default)."""


def compile_options() -> dict[str, int | bool]:
    """The options every kernel is launched and compiled with.

    No fused multiply-add, whatever Triton's default (each float operation
    rounds once, as on the CPU; set explicitly, so Triton 3.9 does not warn
    that its default will change), and :data:`NUM_WARPS`; the interpreter
    takes none.

    Example:
        >>> compile_options()  # doctest: +SKIP
        {'enable_fp_fusion': False}
    """
    if INTERPRETED:
        return {}
    return {"enable_fp_fusion": False, **({"num_warps": NUM_WARPS} if NUM_WARPS else {})}


@dataclasses.dataclass(frozen=True)
class _Scaling:
    """What the kernels read for the factors: pointers (tensors) and search constants.

    ``amax``: ``factors`` are agreed maxima (their int32 bits), the exponents
    found from them in the kernels by rule ``rule`` (:func:`key_constants`)
    for ``n_ranks``.
    """

    offsets: torch.Tensor
    factors: torch.Tensor
    first: torch.Tensor
    top: int
    last: int
    shift: int
    scaled: bool
    amax: bool = False
    rule: tuple[int, ...] = (0, 0, 0, 0, 0)
    n_ranks: int = 1

    def args(self) -> tuple[torch.Tensor | int, ...]:
        return (self.offsets, self.factors, self.first)


@functools.lru_cache(maxsize=16)
def _stand_ins(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed stand-ins (int64, float32) for pointers a kernel variant never reads.

    Each has the type the read would have, so every variant compiles whatever
    a constexpr prunes (a float32 tensor passed for an int64 pointer once made
    a variant fail to compile on GPUs). Made once per device: unbound launches
    pass them every call, and nothing writes them.
    """
    return (
        torch.zeros(1, dtype=torch.int64, device=device),
        torch.zeros(1, dtype=torch.float32, device=device),
    )


@dataclasses.dataclass(frozen=True)
class Rule:
    """How the kernels turn agreed maxima into exponents (:func:`aps_comm.scaling.factors`).

    Attributes:
        world_size: N, the ranks whose values are summed.
        native: the sum happens in the wire format (headroom for N, and the
            decoder divides by N), else two_phase's FP32 sum.
        limit: the exponents' clamp; 0 is ``scaling="none"`` (every exponent 0).
    """

    world_size: int
    native: bool = False
    limit: int = EXPONENT_LIMIT


def _scaling(
    device: torch.device,
    fmt: FloatFormat,
    offsets: torch.Tensor | None,
    factors: torch.Tensor | None,
    block_size: int,
    first_block: torch.Tensor | None,
    rule: Rule | None = None,
) -> _Scaling:
    """The kernels' view of a segmentation; typed stand-ins fill pointers never read.

    ``rule``: ``factors`` are the segments' agreed maxima (float32), one per segment.
    """
    no_int, no_float = _stand_ins(device)
    if factors is None:
        if offsets is not None or block_size or first_block is not None or rule is not None:
            raise ValueError("offsets, block_size, first_block and maxima need factors")
        return _Scaling(no_int, no_float, no_int, 0, 0, 0, False)
    if factors.dtype != torch.float32 or factors.device != device:
        raise ValueError(
            f"{'maxima' if rule else 'factors'} must be float32 on {device}, got "
            f"{factors.dtype} on {factors.device}"
        )
    extra: dict = {}
    if rule is not None:
        if block_size:
            raise ValueError("maxima are per segment, not per block")
        if not (isinstance(rule.world_size, int) and 1 <= rule.world_size <= 2**24):
            raise ValueError(f"world_size must be an int from 1 to 2**24, got {rule.world_size!r}")
        extra = {
            "amax": True,
            "rule": key_constants(fmt, rule.native, rule.limit),
            "n_ranks": rule.world_size,
        }
        factors = factors.view(torch.int32)  # the kernels read the maxima's bits
    if not block_size:
        n = factors.numel()
        if offsets is None:
            if n != 1:
                raise ValueError(f"{n} factors need their segments' offsets")
            return _Scaling(no_int, factors, no_int, 0, 0, 0, True, **extra)  # no offset read
        _check_offsets(offsets, n, device)
        return _Scaling(offsets, factors, no_int, _top(n), n - 1, 0, True, **extra)
    if block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 2 (or 0), got {block_size}")
    if offsets is None or first_block is None:
        raise ValueError("block scaling needs the segments' offsets and first blocks")
    n = first_block.numel()
    _check_offsets(offsets, n, device)
    if first_block.device != device or first_block.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"first_block must be int32 or int64 on {device}, got {first_block.dtype} "
            f"on {first_block.device}"
        )
    return _Scaling(
        offsets, factors, first_block, _top(n), n - 1, block_size.bit_length() - 1, True
    )


def _check_offsets(offsets: torch.Tensor, n: int, device: torch.device) -> None:
    if offsets.numel() != n + 1 or offsets.device != device or offsets.dtype != torch.int64:
        raise ValueError(
            f"offsets must hold {n + 1} int64 entries on {device}, got {offsets.numel()} "
            f"{offsets.dtype} on {offsets.device}"
        )


def encode(
    x: torch.Tensor,
    out: torch.Tensor,
    fmt: FloatFormat,
    offsets: torch.Tensor | None = None,
    factors: torch.Tensor | None = None,
    *,
    block_size: int = 0,
    first_block: torch.Tensor | None = None,
    maxima: torch.Tensor | None = None,
    rule: Rule | None = None,
    pad: int = 0,
) -> None:
    """Encode contiguous ``x`` (times per-segment or per-block ``factors``) into uint8 ``out``.

    Args:
        x: contiguous float32, float16 or bfloat16 elements.
        out: uint8, :func:`~aps_comm.formats.payload_nbytes` bytes (any byte
            offset) of ``x.numel() + pad`` elements.
        fmt: the format (:func:`supports`).
        offsets: int64, L + 1 segment offsets on ``x``'s device: from 0 to
            ``x.numel()``; with ``block_size`` the first may be negative and
            the last beyond ``x.numel()`` (``x`` is a window of a buffer
            whose segments start before or end after it). None with one
            factor or none.
        factors: float32, one per segment (element i of segment s is
            multiplied by ``factors[s]``), or with ``block_size`` one per
            block; None: no scaling.
        block_size: 0, or a power of two: each segment is cut into blocks of
            this many elements from its start (its last one may be short),
            and element i of segment s is multiplied by
            ``factors[first_block[s] + (i - offsets[s]) // block_size]``.
        first_block: int32 or int64, L entries: the index in ``factors`` of each
            segment's first block (negative for a segment that started
            before a window).
        maxima: instead of ``factors``: float32 agreed maxima, one per
            segment; each segment is multiplied by the ``2**e`` that
            :func:`aps_comm.scaling.factors` gives them under ``rule``.
        rule: with ``maxima``, their exponent rule.
        pad: zero codes written after the elements (a shard's padding).
    """
    bind_encode(
        x,
        out,
        fmt,
        offsets,
        factors,
        block_size=block_size,
        first_block=first_block,
        maxima=maxima,
        rule=rule,
        pad=pad,
    )()


def bind_encode(
    x: torch.Tensor,
    out: torch.Tensor,
    fmt: FloatFormat,
    offsets: torch.Tensor | None = None,
    factors: torch.Tensor | None = None,
    *,
    block_size: int = 0,
    first_block: torch.Tensor | None = None,
    maxima: torch.Tensor | None = None,
    rule: Rule | None = None,
    pad: int = 0,
    table: bool = False,
) -> Callable[[], object]:
    """:func:`encode` checked and bound once: the returned call launches it (a
    settled bucket's every step, with no per-call checks on the host).

    ``table``: find each program's segments now, in one launch (:func:`_segment_table`),
    for every launch of the call to read rather than search (for a call run many times).
    """
    factors, rule = _maxima_or_factors(factors, maxima, rule)
    consts = _check(fmt, x, out)
    x = x.reshape(-1)
    if INTERPRETED and x.dtype == torch.bfloat16:
        # The interpreter widens bfloat16 subnormals wrongly; a GPU (and .float()) exactly.
        x = x.float()
    numel = x.numel()
    total = numel + pad
    if not total:
        return _NOTHING
    sc = _scaling(x.device, fmt, offsets, factors, block_size, first_block, rule)
    if not numel:
        # Padding alone (a rank's empty shard of a short chunk): nothing is scaled, and
        # the programs must not read factors, which an empty segmentation has none of
        # (an empty tensor's address is 0: a GPU faults where the interpreter segfaults).
        sc = _scaling(x.device, fmt, None, None, 0, None)
    seg = _segment_table(sc.offsets, sc.last + 1, numel, total) if table and sc.scaled else None
    return functools.partial(
        _encode_kernel[_grid(total)],
        x,
        out,
        *sc.args(),
        sc.offsets if seg is None else seg,
        numel,
        sc.top,
        sc.last,
        total,
        sc.n_ranks,
        E=consts.encode,
        D=consts.decode,
        K=sc.rule,
        WIRE=consts.wire_bits,
        SCALED=sc.scaled,
        SHIFT=sc.shift,
        AMAX=int(sc.amax),
        BLOCK=BLOCK,
        TABLE=seg is not None,
        **compile_options(),
    )


_SEGMENT_ROWS = 128
"""Programs of the codec whose segments one program of :func:`_segment_table` finds."""


def _segment_table(
    offsets: torch.Tensor, n_segments: int, numel: int, total: int
) -> torch.Tensor | None:
    """Each program's first and last segment of ``n_segments`` (``offsets``) for a pass
    over ``numel`` elements in ``total`` (with an encode's padding), found once by the
    kernels' own search: int64 pairs, one per program of :data:`BLOCK` elements; None
    for one segment (no search)."""
    if n_segments <= 1:
        return None
    programs = triton.cdiv(total, BLOCK)
    seg = torch.empty(2 * programs, dtype=torch.int64, device=offsets.device)
    top, last = _top(n_segments), n_segments - 1
    _segments_kernel[launch_grid(triton.cdiv(programs, _SEGMENT_ROWS))](
        *(offsets, seg, numel, top, last, programs),
        BLOCK=BLOCK,
        R=_SEGMENT_ROWS,
        **compile_options(),
    )
    return seg


def _maxima_or_factors(
    factors: torch.Tensor | None, maxima: torch.Tensor | None, rule: Rule | None
) -> tuple[torch.Tensor | None, Rule | None]:
    if maxima is None:
        if rule is not None:
            raise ValueError("a rule goes with maxima")
        return factors, None
    if factors is not None:
        raise ValueError("give factors or maxima, not both")
    if rule is None:
        raise ValueError("maxima need their rule")
    return maxima, rule


def decode(
    payload: torch.Tensor,
    out: torch.Tensor,
    fmt: FloatFormat,
    offsets: torch.Tensor | None = None,
    factors: torch.Tensor | None = None,
    *,
    block_size: int = 0,
    first_block: torch.Tensor | None = None,
    maxima: torch.Tensor | None = None,
    rule: Rule | None = None,
) -> None:
    """Decode uint8 ``payload`` into contiguous float32 ``out`` (times per-segment or
    per-block ``factors``).

    Args: as :func:`encode`, ``out`` giving the element count; with ``maxima``
        each segment is multiplied by the unscale :func:`aps_comm.scaling.factors`
        gives them under ``rule`` (``2**-e``, divided by N for a native sum,
        NaN for a non-finite maximum).
    """
    bind_decode(
        payload,
        out,
        fmt,
        offsets,
        factors,
        block_size=block_size,
        first_block=first_block,
        maxima=maxima,
        rule=rule,
    )()


def bind_decode(
    payload: torch.Tensor,
    out: torch.Tensor,
    fmt: FloatFormat,
    offsets: torch.Tensor | None = None,
    factors: torch.Tensor | None = None,
    *,
    block_size: int = 0,
    first_block: torch.Tensor | None = None,
    maxima: torch.Tensor | None = None,
    rule: Rule | None = None,
    table: bool = False,
) -> Callable[[], object]:
    """:func:`decode` checked and bound once: the returned call launches it (``table``:
    as :func:`bind_encode`'s)."""
    factors, rule = _maxima_or_factors(factors, maxima, rule)
    consts = _check(fmt, payload, out)
    numel = out.numel()
    if not numel:
        return _NOTHING
    sc = _scaling(out.device, fmt, offsets, factors, block_size, first_block, rule)
    divisor = rule.world_size if rule is not None and rule.native else 1
    pow2 = divisor & (divisor - 1) == 0
    seg = _segment_table(sc.offsets, sc.last + 1, numel, numel) if table and sc.scaled else None
    return functools.partial(
        _decode_kernel[_grid(numel)],
        payload,
        out,
        *sc.args(),
        sc.offsets if seg is None else seg,
        numel,
        sc.top,
        sc.last,
        1.0 / divisor if pow2 else float(divisor),
        sc.n_ranks,
        D=consts.decode,
        E=consts.encode,
        K=sc.rule,
        WIRE=consts.wire_bits,
        SCALED=sc.scaled,
        SHIFT=sc.shift,
        AMAX=2 * int(sc.amax),
        DIVIDE=0 if divisor == 1 else 1 if pow2 else 2,
        BLOCK=BLOCK,
        TABLE=seg is not None,
        **compile_options(),
    )


def _reduce(
    recv: torch.Tensor,
    n_ranks: int,
    fmt: FloatFormat,
    out: torch.Tensor,
    divisor: int,
    encode: bool,
) -> Callable[[], object]:
    consts = _check(fmt, recv, out)
    if not (isinstance(divisor, int) and 1 <= divisor <= 2**24):
        raise ValueError(f"divisor must be an int from 1 to 2**24, got {divisor!r}")
    shard_bytes = recv.numel() // n_ranks
    numel = shard_bytes * 8 // consts.wire_bits
    if not numel:
        return _NOTHING
    pow2 = divisor & (divisor - 1) == 0
    return functools.partial(
        _reduce_kernel[_grid(numel)],
        recv,
        out,
        shard_bytes,
        numel,
        n_ranks,
        1.0 / divisor if pow2 else float(divisor),
        E=consts.encode,
        D=consts.decode,
        WIRE=consts.wire_bits,
        DIVIDE=0 if divisor == 1 and not encode else 1 if pow2 else 2,
        ENCODE=encode,
        BLOCK=BLOCK,
        **compile_options(),
    )


def reduce_shards(recv: torch.Tensor, n_ranks: int, fmt: FloatFormat, out: torch.Tensor) -> None:
    """Mean of ``n_ranks`` equal shards laid end to end in ``recv``, re-encoded into ``out``.

    As :func:`aps_comm.cpu_kernels.reduce_shards`: decoded exactly, summed in
    float32 in rank order, divided by ``n_ranks`` (rounded once), encoded.
    """
    _reduce(recv, n_ranks, fmt, out, n_ranks, True)()


def bind_reduce_shards(
    recv: torch.Tensor, n_ranks: int, fmt: FloatFormat, out: torch.Tensor
) -> Callable[[], object]:
    """:func:`reduce_shards` checked and bound once: the returned call launches it."""
    return _reduce(recv, n_ranks, fmt, out, n_ranks, True)


def shard_mean(
    recv: torch.Tensor, n_ranks: int, fmt: FloatFormat, out: torch.Tensor, divisor: int
) -> None:
    """float32 sum of ``n_ranks`` equal encoded shards in rank order, divided by ``divisor``
    (not divided where it is 1), into ``out`` (one shard's elements)."""
    _reduce(recv, n_ranks, fmt, out, divisor, False)()


def tile_shape(longest: int, wire_bits: int) -> tuple[int, int, int]:
    """(LEAD, ROWS, WIDTH) of :func:`reduce_blocks`' tile for blocks of at most ``longest``
    elements (the codec's bind-time probes compile the same tile).

    Example:
        >>> tile_shape(32, 4)
        (1, 64, 32)
    """
    width = max(2, 1 << max(longest - 1, 0).bit_length())
    lead = 1 if wire_bits == 4 else 0
    return lead, max(2, TILE // width), width


def reduce_blocks(
    recv: torch.Tensor,
    n_ranks: int,
    fmt: FloatFormat,
    offsets: torch.Tensor,
    exponents: torch.Tensor,
    out: torch.Tensor,
    d: torch.Tensor,
    limit: int,
    longest: int,
) -> None:
    """The owner's step of two_phase with block exponents, in one kernel.

    As :func:`aps_comm.cpu_kernels.reduce_blocks`: the mean of ``n_ranks``
    equal shards of ``recv`` (decoded exactly, summed in float32 in rank
    order, divided by ``n_ranks`` rounded once) cut into the blocks at
    ``offsets`` (int64 on the device, from 0); each block's extra exponent
    (:func:`aps_comm.scaling.mean_exponents` of its max and its int32
    ``exponents``, capped at ``limit``) into int32 ``d`` and its codes of
    ``mean * 2**d`` into ``out``. One program per tile of whole blocks (see
    :func:`_reduce_blocks_kernel` for the 4-bit bytes two blocks share).

    Args:
        longest: the longest block's elements (at most :data:`MAX_SEGMENT`).
    """
    _reduce_blocks(recv, n_ranks, fmt, offsets, exponents, None, out, d, limit, longest)


def reduce_rank_blocks(
    recv: torch.Tensor,
    n_ranks: int,
    fmt: FloatFormat,
    offsets: torch.Tensor,
    factors: torch.Tensor,
    out: torch.Tensor,
    d: torch.Tensor,
    limit: int,
    longest: int,
    *,
    own: torch.Tensor | None = None,
    own_row: int = -1,
) -> None:
    """:func:`reduce_blocks` where every rank encoded with its own block exponents.

    As :func:`aps_comm.cpu_kernels.reduce_rank_blocks`: row r of ``recv``
    (``n_ranks`` equal rows, each rank's shard at its start, anything after
    it) is decoded times ``factors[r]`` (contiguous float32 of shape
    (``n_ranks``, blocks): each product rounded once), the N values summed
    in float32 in rank order and divided by ``n_ranks``; each block gets
    the exponent of :func:`aps_comm.scaling.mean_exponents` with agreed
    exponents 0 (into ``d``) and is encoded times ``2**d`` into ``out``.
    With ``own`` (float32, the shard's elements), row ``own_row`` is not
    decoded: its values are ``own``'s.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> rows = torch.tensor([[56, 7], [48, 9]], dtype=torch.uint8, device="cuda")  # doctest: +SKIP
        >>> factors = torch.tensor([[1.0], [4.0]], device="cuda")  # doctest: +SKIP
        >>> out = torch.empty(1, dtype=torch.uint8, device="cuda")  # doctest: +SKIP
        >>> d = torch.empty(1, dtype=torch.int32, device="cuda")  # doctest: +SKIP
        >>> offsets = torch.tensor([0, 1], device="cuda")  # doctest: +SKIP
        >>> reduce_rank_blocks(rows, 2, E4M3, offsets, factors, out, d, 126, 1)  # doctest: +SKIP
        >>> d, out  # (1.0 * 1 + 0.5 * 4) / 2 = 1.5, times 2**8: 384  # doctest: +SKIP
        (tensor([8], device='cuda:0', dtype=torch.int32), tensor([124], device='cuda:0', dtype=torch.uint8))
    """
    n_blocks = offsets.numel() - 1
    if (
        factors.dtype != torch.float32
        or factors.shape != (n_ranks, n_blocks)
        or not factors.is_contiguous()
        or factors.device != recv.device
    ):
        raise ValueError(
            f"factors must be contiguous float32 of shape ({n_ranks}, {n_blocks}) on "
            f"{recv.device}, got {factors.dtype} of shape {tuple(factors.shape)} on "
            f"{factors.device}"
        )
    _reduce_blocks(
        recv, n_ranks, fmt, offsets, None, factors, out, d, limit, longest, _own(recv, own, own_row)
    )


def _own(recv: torch.Tensor, own: torch.Tensor | None, own_row: int) -> tuple[torch.Tensor, int]:
    """The owner kernel's ``own_ptr`` and ``own_row``: a stand-in and -1 for none."""
    if own is None:
        return _stand_ins(recv.device)[1], -1
    if own.dtype != torch.float32 or own.device != recv.device or not own.is_contiguous():
        raise ValueError(
            f"own must be contiguous float32 on {recv.device}, got {own.dtype} on {own.device}"
        )
    return own, own_row


def _reduce_blocks(
    recv: torch.Tensor,
    n_ranks: int,
    fmt: FloatFormat,
    offsets: torch.Tensor,
    exponents: torch.Tensor | None,
    factors: torch.Tensor | None,
    out: torch.Tensor,
    d: torch.Tensor,
    limit: int,
    longest: int,
    own: tuple[torch.Tensor, int] | None = None,
) -> None:
    """Launch :func:`_reduce_blocks_kernel` with agreed ``exponents`` or per-rank ``factors``
    (and the owner's own row, :func:`_own`)."""
    consts = _check(fmt, recv, out)
    n_blocks = offsets.numel() - 1
    if not 0 <= longest <= MAX_SEGMENT:
        raise ValueError(f"blocks of at most {MAX_SEGMENT} elements, got one of {longest}")
    for name, t in (("exponents", exponents), ("d", d)):
        if t is not None and (
            t.dtype != torch.int32 or t.numel() != n_blocks or t.device != recv.device
        ):
            raise ValueError(
                f"{name} must hold {n_blocks} int32 entries on {recv.device}, got "
                f"{t.numel()} {t.dtype} on {t.device}"
            )
    _check_offsets(offsets, n_blocks, recv.device)
    if not n_blocks:
        return
    lead, rows, width = tile_shape(longest, consts.wire_bits)
    pow2 = n_ranks & (n_ranks - 1) == 0
    _reduce_blocks_kernel[launch_grid(triton.cdiv(n_blocks, rows - lead))](
        recv,
        out,
        d,
        offsets,
        d if exponents is None else exponents,  # not read with factors
        d if factors is None else factors,  # not read without
        out,  # the union: not read without keys
        d,  # nor the blocks' layers
        *(own or _own(recv, None, -1)),
        recv.numel() // n_ranks,
        n_blocks,
        n_ranks,
        1.0 / n_ranks if pow2 else float(n_ranks),
        _top(n_blocks),
        0,
        0,
        0,
        0,
        0,
        0,
        E=consts.encode,
        D=consts.decode,
        M=mean_limit(fmt, limit),
        WIRE=consts.wire_bits,
        DIVIDE=0 if n_ranks == 1 else 1 if pow2 else 2,
        LEAD=lead,
        ROWS=rows,
        WIDTH=width,
        FACTORS=int(factors is not None),
        **compile_options(),
    )


_BYTES = 1024
"""Bytes of a piece per program of :func:`bind_send_rank_blocks`' kernel."""


def _longest_log2(offsets: np.ndarray) -> int:
    """``ceil(log2)`` of the longest segment of ``offsets`` (0 for none or 1 element):
    the kernels' ``SHIFT``, under which a run of full blocks needs no search."""
    if offsets.size < 2:
        return 0
    return (int(np.diff(offsets).max()) - 1).bit_length()


def _on(host: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host index array on ``device``: copied once, when a call is bound."""
    return to_device(torch.from_numpy(np.ascontiguousarray(host)).to(dtype), device)


def _rank_blocks_consts(fmt: FloatFormat, *tensors: torch.Tensor) -> FormatConstants:
    consts = _check(fmt, *tensors)
    if consts.wire_bits not in (4, 8, 16):
        raise ValueError(f"the block kernels take 4-, 8- and 16-bit formats, got {fmt.name}")
    return consts


def bind_block_keys(
    fmt: FloatFormat,
    x: torch.Tensor,
    offsets: np.ndarray,
    layer_of: np.ndarray,
    maxima: torch.Tensor,
    keys: torch.Tensor,
    flags: torch.Tensor,
    world_size: int = 1,
    zero: bool = False,
) -> Callable[[], object]:
    """This rank's two_phase key of every block and flag of every layer, bound: two launches
    (one with ``zero``).

    As :func:`aps_comm.cpu_kernels.block_amax`, :func:`~aps_comm.cpu_kernels.two_phase_keys`
    and :func:`~aps_comm.cpu_kernels.layer_any` (value 255) one after another:
    ``flags`` zeroed, then one kernel writes every block's max |x| (NaN as inf)
    into float32 ``maxima``, its key into uint8 ``keys`` and a 1 into uint8
    ``flags`` at the layer of each block keyed 255. The index arrays are
    copied to the device here, once.

    Args:
        fmt: the wire format (its largest value bounds the exponents).
        x: contiguous float32 values.
        offsets: int64 host array, the blocks' L + 1 offsets from 0 to ``x.numel()``
            (blocks of at most :data:`MAX_SEGMENT` elements).
        layer_of: host array, each block's layer (an index into ``flags``).
        maxima, keys: one per block; flags: one per layer.
        world_size: the ranks whose FP32 sum the owner makes (binds bf16's keys).
        zero: agreed block exponents, where nothing reads this rank's own flags: the
            kernel zeroes ``flags`` (the union :func:`bind_owner_agreed_blocks` sets
            from the agreed keys) at every block's layer instead, nothing zeroed before:
            one launch. A layer without blocks is never flagged: it stays as it was.

    Example:
        >>> call = bind_block_keys(E4M3, x, offsets, layer_of, maxima, keys, flags)  # doctest: +SKIP
        >>> call()  # doctest: +SKIP
    """
    _check(fmt, x, maxima, keys, flags)
    n = offsets.size - 1
    if (
        x.dtype != torch.float32
        or maxima.dtype != torch.float32
        or keys.dtype != torch.uint8
        or flags.dtype != torch.uint8
        or maxima.numel() != n
        or keys.numel() != n
        or layer_of.size != n
    ):
        raise ValueError(
            f"block keys need float32 values, and {n} float32 maxima, uint8 keys and "
            f"layers, got {x.dtype}, {maxima.numel()} {maxima.dtype}, {keys.numel()} "
            f"{keys.dtype} and {layer_of.size}"
        )
    longest = int(np.diff(offsets).max()) if n else 0
    if longest > MAX_SEGMENT:
        raise ValueError(f"blocks of at most {MAX_SEGMENT} elements, got one of {longest}")
    if not n:
        return flags.zero_
    width = max(2, 1 << max(longest - 1, 0).bit_length())
    rows = max(2, TILE // width)
    launch = functools.partial(
        _block_keys_kernel[launch_grid(triton.cdiv(n, rows))],
        x,
        _on(offsets, x.device),
        _on(layer_of, x.device, torch.int32),
        maxima.view(torch.int32),
        keys,
        flags,
        n,
        world_size,
        M=mean_limit(fmt, EXPONENT_LIMIT),
        ROWS=rows,
        WIDTH=width,
        BOUND=fmt.max * world_size > float(np.finfo(np.float32).max),
        ZERO=zero,
        **compile_options(),
    )
    return launch if zero else functools.partial(_zero_then, flags, launch)


def bind_native_block_keys(
    fmt: FloatFormat,
    x: torch.Tensor,
    offsets: np.ndarray,
    maxima: torch.Tensor,
    keys: torch.Tensor,
    world_size: int,
) -> Callable[[], object]:
    """This rank's native-sum key of every block, bound: one launch writes every block's
    max |x| (NaN as inf) into float32 ``maxima`` and its key (headroom for the
    ``world_size`` ranks' sum in ``fmt``) into uint8 ``keys``, as
    :func:`aps_comm.cpu_kernels.native_block_keys` does. ``offsets``: int64 host array,
    the blocks' offsets from 0 to ``x.numel()`` (blocks of at most :data:`MAX_SEGMENT`).

    Example:
        >>> call = bind_native_block_keys(E4M3, x, offsets, maxima, keys, 2)  # doctest: +SKIP
        >>> call()  # doctest: +SKIP
    """
    consts = _check(fmt, x, maxima, keys)
    n = offsets.size - 1
    if (
        x.dtype != torch.float32
        or maxima.dtype != torch.float32
        or keys.dtype != torch.uint8
        or maxima.numel() != n
        or keys.numel() != n
    ):
        raise ValueError(
            f"native block keys need float32 values and {n} float32 maxima and uint8 keys"
        )
    longest = int(np.diff(offsets).max()) if n else 0
    if longest > MAX_SEGMENT:
        raise ValueError(f"blocks of at most {MAX_SEGMENT} elements, got one of {longest}")
    if not n:
        return _NOTHING
    width = max(2, 1 << max(longest - 1, 0).bit_length())
    rows = max(2, TILE // width)
    return functools.partial(
        _native_block_keys_kernel[launch_grid(triton.cdiv(n, rows))],
        x,
        _on(offsets, x.device),
        maxima.view(torch.int32),
        keys,
        n,
        world_size,
        E=consts.encode,
        D=consts.decode,
        K=key_constants(fmt, True, EXPONENT_LIMIT),
        ROWS=rows,
        WIDTH=width,
        **compile_options(),
    )


def bind_block_records(
    fmt: FloatFormat,
    x: torch.Tensor,
    offsets: np.ndarray,
    layer_of: np.ndarray,
    keys: torch.Tensor,
    maxima: torch.Tensor,
    n_layers: int,
) -> Callable[[torch.Tensor], None]:
    """:func:`aps_comm.cpu_kernels.block_records` bound: two launches per call, whatever the
    number of layers or blocks.

    The returned call takes float64 ``out`` (``n_layers``, 5) and writes each layer's
    smallest exponent of its blocks' uint8 ``keys``, the largest of their float32
    ``maxima`` and the summed counts of its elements scaled by their blocks' ``2**e``
    (nonzero, underflowing, saturating): one kernel folds every block into an int32 row
    of its layer (per program, then atomics per layer it touches), one writes the rows
    as float64 and zeroes them again. The index arrays and the rows' scratch are made
    here, once.

    Args:
        fmt: the wire format (its smallest subnormal and largest value).
        x: contiguous float32 values.
        offsets: int64 host array, the blocks' offsets from 0 to ``x.numel()`` (blocks
            of at most :data:`MAX_SEGMENT` elements).
        layer_of: host array, each block's layer, ascending.
        keys: uint8, one per block; maxima: float32, one per block.
        n_layers: the layers (rows).

    Example:
        >>> call = bind_block_records(E2M1, x, offsets, layer_of, keys, maxima, 7)  # doctest: +SKIP
        >>> call(torch.empty(7, 5, dtype=torch.float64))  # doctest: +SKIP
    """
    _check(fmt, x, keys, maxima)
    n = offsets.size - 1
    if (
        x.dtype != torch.float32
        or maxima.dtype != torch.float32
        or keys.dtype != torch.uint8
        or maxima.numel() != n
        or keys.numel() != n
        or layer_of.size != n
    ):
        raise ValueError(
            f"block records need float32 values, and {n} float32 maxima, uint8 keys and "
            f"layers, got {x.dtype}, {maxima.numel()} {maxima.dtype}, {keys.numel()} "
            f"{keys.dtype} and {layer_of.size}"
        )
    if (np.diff(layer_of) < 0).any():
        raise ValueError("block records need the blocks' layers ascending")
    longest = int(np.diff(offsets).max()) if n else 0
    if longest > MAX_SEGMENT:
        raise ValueError(f"blocks of at most {MAX_SEGMENT} elements, got one of {longest}")
    acc = torch.zeros(n_layers, 5, dtype=torch.int32, device=x.device)
    width = max(2, 1 << max(longest - 1, 0).bit_length())
    rows = max(2, TILE // width)
    fold = functools.partial(
        _block_records_kernel[launch_grid(max(triton.cdiv(n, rows), 1))],
        x,
        _on(offsets, x.device),
        _on(layer_of, x.device, torch.int32),
        keys,
        maxima.view(torch.int32),
        acc,
        n,
        TINY=float(np.float32(fmt.min_subnormal / 2)),
        FMAX=float(np.float32(fmt.max)),
        ROWS=rows,
        WIDTH=width,
        **compile_options(),
    )
    finish = _records_rows_kernel[launch_grid(max(triton.cdiv(n_layers * 5, BLOCK), 1))]

    def call(out: torch.Tensor) -> None:
        fold()
        finish(acc, out, n_layers, BLOCK=BLOCK, **compile_options())

    return call


if AVAILABLE:

    @triton.jit(do_not_specialize=["n_cells", "n_ranks"])
    def _cell_keys_kernel(
        amax_ptr,
        shown_ptr,
        layer_ptr,
        key_ptr,
        top_ptr,
        n_cells,
        n_ranks,
        E: tl.constexpr,
        D: tl.constexpr,
        K: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Every cell's uint8 exponent key of its layer's agreed maximum (rule ``K`` over
        ``n_ranks``, :func:`_exp_key`: the kernels' factors of the same maxima) and its
        layer's maximum to show (float32 bits), from each cell's layer."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n_cells
        layer = tl.load(layer_ptr + i, mask=live, other=0).to(tl.int64)
        k = _exp_key(tl.load(amax_ptr + layer, mask=live, other=0), n_ranks, E, D, K)
        tl.store(key_ptr + i, k.to(tl.uint8), mask=live)
        tl.store(top_ptr + i, tl.load(shown_ptr + layer, mask=live, other=0), mask=live)


if AVAILABLE:

    @triton.jit(do_not_specialize=["n_cells", "n_layers"])
    def _row_cell_keys_kernel(
        rows_ptr, shown_ptr, layer_ptr, key_ptr, top_ptr, n_cells, n_layers, BLOCK: tl.constexpr
    ):
        """Every cell's uint8 exponent key of its layer's first-level factor in the staged
        factor rows (``rows_ptr``: 4 x ``n_layers``; scale times first is ``2**e``
        exactly, whose exponent field is ``e + 127``: the key ``254`` minus it) and its
        layer's maximum to show (float32 bits), from each cell's layer."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n_cells
        layer = tl.load(layer_ptr + i, mask=live, other=0).to(tl.int64)
        scale = tl.load(rows_ptr + layer, mask=live, other=1.0)
        first = tl.load(rows_ptr + 3 * n_layers + layer, mask=live, other=1.0)
        k = 254 - ((scale * first).to(tl.int32, bitcast=True) >> 23)
        tl.store(key_ptr + i, k.to(tl.uint8), mask=live)
        tl.store(top_ptr + i, tl.load(shown_ptr + layer, mask=live, other=0), mask=live)


def bind_row_cell_keys(
    rows: torch.Tensor,
    shown: torch.Tensor,
    layer_of: np.ndarray,
    out: tuple[torch.Tensor, torch.Tensor],
) -> Callable[[], object]:
    """:func:`bind_cell_keys` of a staged bucket: every cell's key of its layer's first-level
    exponent in the factor rows (float32, 4 x layers; :func:`bind_staged_factors`'), and
    its layer's ``shown`` maximum, one launch (the CPU kernels' record keys,
    :meth:`aps_comm.engine.SteadyStaged.first_factors`).

    Example:
        >>> keys = torch.empty(3, dtype=torch.uint8); top = torch.empty(3)  # doctest: +SKIP
        >>> bind_row_cell_keys(rows, amax, np.array([0, 0, 1]), (keys, top))()  # doctest: +SKIP
    """
    keys, top = out
    _check(E4M3, rows, shown, keys, top)
    n, layers = layer_of.size, shown.numel()
    if keys.dtype != torch.uint8 or top.dtype != torch.float32 or keys.numel() != n:
        raise ValueError(f"cell keys need {n} uint8 keys and float32 maxima")
    if rows.shape != (4, layers) or rows.dtype != torch.float32 or not rows.is_contiguous():
        raise ValueError(f"the factor rows must be contiguous float32 (4, {layers})")
    if not n:
        return _NOTHING
    return functools.partial(
        _row_cell_keys_kernel[launch_grid(triton.cdiv(n, BLOCK))],
        rows,
        shown.view(torch.int32),
        _on(layer_of, rows.device, torch.int32),
        keys,
        top.view(torch.int32),
        n,
        layers,
        BLOCK=BLOCK,
        **compile_options(),
    )


def bind_cell_keys(
    fmt: FloatFormat,
    maxima: torch.Tensor,
    shown: torch.Tensor,
    layer_of: np.ndarray,
    rule: Rule,
    out: tuple[torch.Tensor, torch.Tensor],
) -> Callable[[], object]:
    """A layer rule's exponent keys of agreed ``maxima`` spread onto cells (pieces of
    layers, ``layer_of`` each cell's), with ``shown``'s maxima: what
    :func:`bind_block_records` takes to record layers scaled by one exponent each. One
    launch per call, whatever the number of layers or cells.

    Args:
        fmt: the wire format.
        maxima: float32, the layers' agreed maxima the exponents are of (``rule``'s).
        shown: float32, the layers' maxima the records keep (before bucket scaling's
            spread: may be ``maxima``).
        layer_of: int64 host array, each cell's layer.
        rule: the exponent rule (:class:`Rule`).
        out: uint8 keys and float32 maxima, one per cell.

    Example:
        >>> keys = torch.empty(3, dtype=torch.uint8); top = torch.empty(3)  # doctest: +SKIP
        >>> bind_cell_keys(E4M3, amax, amax, np.array([0, 0, 1]), Rule(2), (keys, top))()  # doctest: +SKIP
    """
    keys, top = out
    consts = _check(fmt, maxima, shown, keys, top)
    n = layer_of.size
    if keys.dtype != torch.uint8 or top.dtype != torch.float32 or keys.numel() != n:
        raise ValueError(f"cell keys need {n} uint8 keys and float32 maxima")
    if not n:
        return _NOTHING
    return functools.partial(
        _cell_keys_kernel[launch_grid(triton.cdiv(n, BLOCK))],
        maxima.view(torch.int32),
        shown.view(torch.int32),
        _on(layer_of, maxima.device, torch.int32),
        keys,
        top.view(torch.int32),
        n,
        rule.world_size,
        E=consts.encode,
        D=consts.decode,
        K=key_constants(fmt, rule.native, rule.limit),
        BLOCK=BLOCK,
        **compile_options(),
    )


if AVAILABLE:

    @triton.jit(do_not_specialize=["n", "n_ranks"])
    def _maxima_factors_kernel(
        amax_ptr,
        scale_ptr,
        inverse_ptr,
        unscale_ptr,
        n,
        n_ranks,
        divisor,
        E: tl.constexpr,
        D: tl.constexpr,
        K: tl.constexpr,
        DIVIDE: tl.constexpr,
        INVERSE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Every segment's factors of its agreed maximum (float32 bits; rule ``K`` over
        ``n_ranks``, :func:`_exp_key`): ``2**e``, the unscale (``2**-e`` divided by
        ``divisor`` as ``DIVIDE`` says, NaN for a non-finite maximum) and with
        ``INVERSE`` ``2**-e`` undivided: the factors the encode and decode derive."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        k = _exp_key(tl.load(amax_ptr + i, mask=live, other=0), n_ranks, E, D, K)
        tl.store(scale_ptr + i, _key_factor(k, divisor, 1, DIVIDE), mask=live)
        tl.store(unscale_ptr + i, _key_factor(k, divisor, 2, DIVIDE), mask=live)
        if INVERSE:
            tl.store(inverse_ptr + i, _key_factor(k, divisor, 2, 0), mask=live)

    @triton.jit(do_not_specialize=["numel"])
    def _keep_lost_kernel(x_ptr, sent_ptr, res_ptr, numel, BLOCK: tl.constexpr):
        """``residual = x - sent`` where ``sent`` is finite, else 0."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < numel
        x = tl.load(x_ptr + i, mask=live, other=0.0)
        sent = tl.load(sent_ptr + i, mask=live, other=0.0)
        finite = (sent == sent) & (tl.abs(sent) < float("inf"))
        tl.store(res_ptr + i, tl.where(finite, x - sent, 0.0), mask=live)

    @triton.jit(do_not_specialize=["lo", "count", "top", "last", "n_ranks"])
    def _owner_lost_kernel(
        acc_ptr,
        part_ptr,
        off_ptr,
        scale_ptr,
        unscale_ptr,
        res_ptr,
        lo,
        count,
        top,
        last,
        n_ranks,
        BLOCK: tl.constexpr,
    ):
        """The owner's loss ``acc - part`` of its ``count`` elements from ``lo``, divided by
        their segment's scale (0 where its unscale is not finite) and times ``n_ranks``,
        added to ``residual[lo:]``: :func:`aps_comm.codec.owner_lost`'s tensor ops."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < count
        s = _search(off_ptr, lo + i, tl.full(i.shape, 0, tl.int64), top, last)
        u = tl.load(unscale_ptr + s, mask=live, other=0.0)
        f = tl.load(scale_ptr + s, mask=live, other=1.0)
        mine = tl.where((u == u) & (tl.abs(u) < float("inf")), f, 0.0)
        d = tl.load(acc_ptr + i, mask=live, other=0.0) - tl.load(part_ptr + i, mask=live, other=0.0)
        lost = tl.where(mine > 0, _divide(d, tl.where(mine > 0, mine, 1.0), 2), 0.0)
        r = tl.load(res_ptr + lo + i, mask=live, other=0.0)
        tl.store(res_ptr + lo + i, r + lost * n_ranks.to(tl.float32), mask=live)


def bind_maxima_factors(
    fmt: FloatFormat,
    maxima: torch.Tensor,
    rule: Rule,
    out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
) -> Callable[[], object]:
    """The factors of agreed ``maxima`` under ``rule`` written into ``out`` (float32 scale,
    the undivided ``2**-e`` or None, unscale: one of each per maximum): one launch per
    call, whatever the number of segments; the bits of :func:`aps_comm.scaling.factors`.

    Example:
        >>> s, u = torch.empty(1), torch.empty(1)  # doctest: +SKIP
        >>> bind_maxima_factors(E4M3, torch.tensor([3.0]), Rule(2), (s, None, u))()  # doctest: +SKIP
    """
    scale, inverse, unscale = out
    consts = _check(fmt, maxima, scale, unscale)
    n = maxima.numel()
    if any(t is not None and (t.numel() != n or t.dtype != torch.float32) for t in out):
        raise ValueError(f"factors need {n} float32 each")
    if not n:
        return _NOTHING
    divisor = rule.world_size if rule.native else 1
    pow2 = divisor & (divisor - 1) == 0
    return functools.partial(
        _maxima_factors_kernel[launch_grid(triton.cdiv(n, BLOCK))],
        maxima.view(torch.int32),
        scale,
        unscale if inverse is None else inverse,
        unscale,
        n,
        rule.world_size,
        1.0 / divisor if pow2 else float(divisor),
        E=consts.encode,
        D=consts.decode,
        K=key_constants(fmt, rule.native, rule.limit),
        DIVIDE=0 if divisor == 1 else 1 if pow2 else 2,
        INVERSE=inverse is not None,
        BLOCK=BLOCK,
        **compile_options(),
    )


def bind_keep_lost(
    x: torch.Tensor, sent: torch.Tensor, residual: torch.Tensor
) -> Callable[[], object]:
    """``residual = x - sent`` where ``sent`` is finite, else 0 (float32, one launch)."""
    if not all(t.dtype == torch.float32 and t.numel() == x.numel() for t in (sent, residual)):
        raise ValueError(f"keep_lost needs float32 tensors of {x.numel()} elements")
    if not x.numel():
        return _NOTHING
    return functools.partial(
        _keep_lost_kernel[_grid(x.numel())],
        *(x, sent, residual, x.numel()),
        BLOCK=BLOCK,
        **compile_options(),
    )


def bind_owner_lost(
    acc: torch.Tensor,
    part: torch.Tensor,
    offsets: torch.Tensor,
    factors: tuple[torch.Tensor, torch.Tensor],
    span: tuple[int, int],
    n_ranks: int,
    residual: torch.Tensor,
) -> Callable[[], object]:
    """The owner's loss added to ``residual[lo:hi]`` (``span``; ``acc`` and ``part`` from its
    element ``lo``), divided by each segment's scale (``offsets``: int64 segment
    boundaries; ``factors``: scale, unscale) and times ``n_ranks``: one launch."""
    (lo, hi), (scale, unscale) = span, factors
    n = scale.numel()
    _check_offsets(offsets, n, residual.device)
    if hi <= lo:
        return _NOTHING
    return functools.partial(
        _owner_lost_kernel[_grid(hi - lo)],
        *(acc, part, offsets, scale, unscale, residual),
        *(lo, hi - lo, _top(n), n - 1, n_ranks),
        BLOCK=BLOCK,
        **compile_options(),
    )


def _max_fields(fmt: FloatFormat) -> tuple[int, int]:
    """The format's largest value's float64 exponent and mantissa field (the staged
    kernels' ``F``)."""
    bits = int(np.float64(fmt.max).view(np.int64))
    return (bits >> 52) - 1023, bits & ((1 << 52) - 1)


def bind_staged_keys(
    fmt: FloatFormat,
    x: torch.Tensor,
    offsets: np.ndarray,
    maxima: torch.Tensor,
    keys: torch.Tensor,
    world_size: int,
    ranks_per_node: int,
) -> Callable[[], object]:
    """:func:`aps_comm.cpu_kernels.staged_keys` bound: one launch writes every block's max
    |x| into float32 ``maxima`` and its hierarchical (or grid) keys into uint8 ``keys``
    (2 x blocks: the inner row, then the outer), whatever the number of blocks.

    Example:
        >>> call = bind_staged_keys(E2M1, x, offsets, maxima, keys, 4, 2)  # doctest: +SKIP
        >>> call()  # doctest: +SKIP
    """
    _check(fmt, x, maxima, keys)
    n = offsets.size - 1
    if maxima.numel() != n or keys.numel() != 2 * n or keys.dtype != torch.uint8:
        raise ValueError(f"staged keys need {n} maxima and {2 * n} uint8 keys")
    longest = int(np.diff(offsets).max()) if n else 0
    if longest > MAX_SEGMENT:
        raise ValueError(f"blocks of at most {MAX_SEGMENT} elements, got one of {longest}")
    width = max(2, 1 << max(longest - 1, 0).bit_length())
    rows = max(2, TILE // width)
    return functools.partial(
        _staged_keys_kernel[launch_grid(max(triton.cdiv(n, rows), 1))],
        x,
        _on(offsets, x.device),
        maxima.view(torch.int32),
        keys,
        n,
        world_size,
        ranks_per_node,
        F=_max_fields(fmt),
        LIMIT=EXPONENT_LIMIT,
        ROWS=rows,
        WIDTH=width,
        **compile_options(),
    )


def bind_staged_factors(
    fmt: FloatFormat,
    maxima: torch.Tensor,
    world_size: int,
    ranks_per_node: int,
    grid: bool,
    out: torch.Tensor,
    limit: int = EXPONENT_LIMIT,
) -> Callable[[], object]:
    """:func:`aps_comm.cpu_kernels.staged_factors_into` bound: one launch writes the rows of
    float32 ``out`` (4 x segments: scale, shift, unscale, first) from the agreed float32
    ``maxima``, whatever the number of segments (``limit`` 0: ``scaling="none"``).

    Example:
        >>> call = bind_staged_factors(E4M3, maxima, 4, 2, False, out)  # doctest: +SKIP
        >>> call()  # doctest: +SKIP
    """
    _check(fmt, maxima, out)
    n = maxima.numel()
    if maxima.dtype != torch.float32 or out.shape != (4, n) or out.dtype != torch.float32:
        raise ValueError(f"staged factors need {n} float32 maxima and float32 (4, {n}) rows")
    if not n:
        return _NOTHING
    return functools.partial(
        _staged_factors_kernel[_grid(n)],
        maxima.view(torch.int32),
        out,
        n,
        world_size,
        ranks_per_node,
        F=_max_fields(fmt),
        LIMIT=limit,
        GRID=grid,
        BLOCK=BLOCK,
        **compile_options(),
    )


def bind_block_factors(
    keys: torch.Tensor,
    counts: np.ndarray,
    out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
    divisor: int = 1,
) -> Callable[[], object]:
    """Agreed uint8 block ``keys``' factors into ``out`` (float32 scale, the undivided
    ``2**-e`` or None, unscale ``2**-e / divisor``; NaN unscale for every block of a layer
    with a key of 255): one launch, a program per layer (``counts``: host blocks per
    layer). The bits of :func:`aps_comm.cpu_kernels.block_factors_into` (``divisor`` 1) and
    :func:`aps_comm.cpu_kernels.native_block_factors` (the native sum's N).

    Example:
        >>> call = bind_block_factors(keys, counts, (scale, None, unscale))  # doctest: +SKIP
        >>> call()  # doctest: +SKIP
    """
    scale, inverse, unscale = out
    n = int(counts.sum())
    _check(E4M3, keys, scale, unscale)
    if keys.numel() != n or any(
        t is not None and (t.numel() != n or t.dtype != torch.float32) for t in out
    ):
        raise ValueError(f"block factors need {n} keys and {n} float32 factors each")
    if not counts.size:
        return _NOTHING  # no layer: a program would read the end of ``first`` as a layer's
    pow2 = divisor & (divisor - 1) == 0
    return functools.partial(
        _block_factors_kernel[launch_grid(counts.size)],
        keys,
        _on(np.concatenate([[0], np.cumsum(counts)]), keys.device),
        scale,
        unscale if inverse is None else inverse,
        unscale,
        1.0 / divisor if pow2 else float(divisor),
        DIVIDE=0 if divisor == 1 else 1 if pow2 else 2,
        INVERSE=inverse is not None,
        BLOCK=BLOCK,
        **compile_options(),
    )


def bind_staged_key_factors(
    keys: torch.Tensor, counts: np.ndarray, grid: bool, out: torch.Tensor
) -> Callable[[], object]:
    """:func:`aps_comm.cpu_kernels.staged_key_factors` bound: one launch (a program per
    layer; ``counts``: host blocks per layer) writes the rows of float32 ``out`` (4 x
    blocks) from the agreed keys (:func:`bind_staged_keys`' layout).

    Example:
        >>> call = bind_staged_key_factors(keys, counts, False, out)  # doctest: +SKIP
        >>> call()  # doctest: +SKIP
    """
    n = int(counts.sum())
    if keys.numel() < 2 * n or out.shape != (4, n) or out.dtype != torch.float32:
        raise ValueError(f"staged key factors need {2 * n} keys and float32 (4, {n}) rows")
    if not counts.size:
        return _NOTHING  # no layer: a program would read the end of ``first`` as a layer's
    first = np.concatenate([[0], np.cumsum(counts)])
    return functools.partial(
        _staged_key_factors_kernel[launch_grid(counts.size)],
        keys,
        _on(first, keys.device),
        out,
        n,
        GRID=grid,
        BLOCK=BLOCK,
        **compile_options(),
    )


def _zero_then(t: torch.Tensor, launch: Callable[[], object]) -> None:
    t.zero_()
    launch()


def bind_send_rank_blocks(
    fmt: FloatFormat,
    x: torch.Tensor,
    keys: torch.Tensor,
    offsets: np.ndarray,
    firsts: np.ndarray,
    flags: torch.Tensor,
    send: torch.Tensor,
    shard_bytes: int,
    at: int,
) -> Callable[[int], object]:
    """Every shard of a chunk into the exchange with this rank's own block keys, bound:
    the returned ``call(log2)`` is one launch.

    As :func:`aps_comm.cpu_kernels.send_rank_blocks`: shard s (blocks
    ``firsts[s]`` to ``firsts[s + 1]`` of ``offsets``) goes to piece s of
    ``send`` (N equal pieces): its codes times ``2**e`` of its blocks' keys
    (4-bit codes low nibble first), zero padding, the keys at
    ``shard_bytes``, and where ``at >= 0`` the layers' ``flags`` then
    ``log2`` at ``at``; every other byte 0. One program per shard and
    :data:`_BYTES` bytes of its piece.

    Args:
        fmt: a 4- or 8-bit format.
        x: the group's float32 values; keys: uint8, one per block of the group.
        offsets, firsts: int64 host arrays (the group's block offsets; the
            chunk's N shards' first blocks and its end).
        flags: uint8, this rank's layer flags; send: uint8, N pieces.
        shard_bytes: the payload bytes every shard is padded to.
        at: where the flags lie in a piece (-1: none).

    Example:
        >>> send = bind_send_rank_blocks(E2M1, x, keys, offsets, firsts, flags, buf, 16, -1)  # doctest: +SKIP
        >>> send(0)  # doctest: +SKIP
    """
    consts = _rank_blocks_consts(fmt, x, keys, flags, send)
    n = firsts.size - 1
    piece = send.numel() // n
    f0, f1 = int(firsts[0]), int(firsts[-1])
    if x.dtype != torch.float32 or send.numel() != n * piece or piece < shard_bytes:
        raise ValueError(
            f"send needs float32 values and {n} equal pieces of at least {shard_bytes} "
            f"bytes, got {x.dtype} and {send.numel()} bytes"
        )
    return functools.partial(
        _send_rank_blocks_kernel[launch_grid(triton.cdiv(piece, _BYTES), n)],
        x,
        keys[f0:],
        _on(offsets[f0 : f1 + 1], x.device),
        _on(firsts - f0, x.device),
        flags,
        send,
        piece,
        shard_bytes,
        at,
        flags.numel() if at >= 0 else 0,
        _top(f1 - f0),
        E=consts.encode,
        WIRE=consts.wire_bits,
        BYTES=_BYTES,
        SHIFT=_longest_log2(offsets[f0 : f1 + 1]),
        **compile_options(),
    )


def bind_owner_rank_blocks(
    fmt: FloatFormat,
    recv: torch.Tensor,
    n_ranks: int,
    shard: np.ndarray,
    out: torch.Tensor,
    union: torch.Tensor,
    d: torch.Tensor,
    shard_bytes: int,
    at: int,
    longest: int,
    *,
    own: torch.Tensor | None = None,
    own_row: int = -1,
) -> Callable[[], object]:
    """This rank's owner step of a chunk sent by :func:`bind_send_rank_blocks`, bound:
    one launch of :func:`_reduce_blocks_kernel` (``FACTORS`` 2).

    As :func:`aps_comm.cpu_kernels.owner_rank_blocks`: every piece of ``recv``
    decoded times the unscales of its sender's keys (read in the kernel),
    summed in rank order and divided by N; each block of the mean encoded
    with its own exponent d (into int32 ``d``) into ``out``: codes, zero
    padding to ``shard_bytes``, ``127 - d`` per block, zeros; where
    ``at >= 0`` every rank's layer flags OR-ed into ``union``. The CPU
    kernel also returns the ranks' largest preferred chunk: not read here
    (that would be a device read; see :meth:`aps_comm.codec.Codec.bind_blocks`).

    Args:
        shard: int64 host array, this rank's shard's block offsets from 0.
        longest: its longest block (at most :data:`MAX_SEGMENT`).
        own, own_row: float32, the shard's elements: piece ``own_row`` is
            not decoded, these values are added in its place (-1: none).

    Example:
        >>> owner = bind_owner_rank_blocks(E2M1, recv, 2, shard, out, union, d, 16, -1, 8)  # doctest: +SKIP
        >>> owner()  # doctest: +SKIP
    """
    consts = _rank_blocks_consts(fmt, recv, out, union, d)
    k, piece, used = _owner_sizes(consts, recv, n_ranks, shard, out, d, shard_bytes, longest)
    if own is not None and own.numel() != int(shard[-1]):
        raise ValueError(f"own must hold the shard's {int(shard[-1])} elements, got {own.numel()}")
    lead, rows, width = tile_shape(longest, consts.wire_bits)
    n_tiles = triton.cdiv(k, rows - lead)
    n_flags = union.numel() if at >= 0 else 0
    n_tail = triton.cdiv(max(out.numel() - used, n_flags, 1), rows * width)
    pow2 = n_ranks & (n_ranks - 1) == 0
    return functools.partial(
        _reduce_blocks_kernel[launch_grid(n_tiles + n_tail)],
        recv,
        out,
        d,
        _on(shard, recv.device),
        d,  # the agreed exponents: not read with keys
        _stand_ins(recv.device)[1],  # nor the float32 factors
        union,
        d,  # nor the blocks' layers
        *_own(recv, own, own_row),
        piece,
        k,
        n_ranks,
        1.0 / n_ranks if pow2 else float(n_ranks),
        _top(k),
        shard_bytes,
        used,
        out.numel(),
        at,
        n_flags,
        n_tiles,
        E=consts.encode,
        D=consts.decode,
        M=mean_limit(fmt, EXPONENT_LIMIT),
        WIRE=consts.wire_bits,
        DIVIDE=0 if n_ranks == 1 else 1 if pow2 else 2,
        LEAD=lead,
        ROWS=rows,
        WIDTH=width,
        FACTORS=2,
        **compile_options(),
    )


def _owner_sizes(
    consts: FormatConstants,
    recv: torch.Tensor,
    n_ranks: int,
    shard: np.ndarray,
    out: torch.Tensor,
    d: torch.Tensor,
    shard_bytes: int,
    longest: int,
) -> tuple[int, int, int]:
    """An owner step's blocks, piece bytes and code bytes, its buffers checked."""
    k = shard.size - 1
    piece = recv.numel() // n_ranks
    used = (int(shard[-1]) * consts.wire_bits + 7) // 8
    if not 0 <= longest <= MAX_SEGMENT or (k and int(np.diff(shard).max()) > longest):
        raise ValueError(f"blocks of at most {min(longest, MAX_SEGMENT)} elements")
    if (
        recv.numel() != n_ranks * piece
        or out.numel() < shard_bytes + k
        or used > shard_bytes
        or d.dtype != torch.int32
        or d.numel() < k
    ):
        raise ValueError(
            f"the owner needs {n_ranks} equal pieces, {shard_bytes + k} bytes out and {k} "
            f"int32 exponents, got {recv.numel()}, {out.numel()} and {d.numel()} {d.dtype}"
        )
    return k, piece, used


def bind_owner_agreed_blocks(
    fmt: FloatFormat,
    recv: torch.Tensor,
    n_ranks: int,
    shard: np.ndarray,
    keys: torch.Tensor,
    first: int,
    out: torch.Tensor,
    union: torch.Tensor,
    d: torch.Tensor,
    shard_bytes: int,
    longest: int,
    layer_of: np.ndarray | None,
) -> Callable[[], object]:
    """:func:`bind_owner_agreed_launch`, ``union`` zeroed before it in the first chunk
    (``layer_of`` given): one launch, two calls in the first chunk.

    Example:
        >>> owner = bind_owner_agreed_blocks(E4M3, recv, 2, shard, keys, 0, out, union, d, 16, 8, None)  # doctest: +SKIP
        >>> owner()  # doctest: +SKIP
    """
    launch = bind_owner_agreed_launch(
        fmt, recv, n_ranks, shard, keys, first, out, union, d, shard_bytes, longest, layer_of
    )
    return launch if layer_of is None else functools.partial(_zero_then, union, launch)


def bind_owner_agreed_launch(
    fmt: FloatFormat,
    recv: torch.Tensor,
    n_ranks: int,
    shard: np.ndarray,
    keys: torch.Tensor,
    first: int,
    out: torch.Tensor,
    union: torch.Tensor,
    d: torch.Tensor,
    shard_bytes: int,
    longest: int,
    layer_of: np.ndarray | None,
) -> Callable[[], object]:
    """This rank's owner step of a chunk sent with agreed block keys, bound: one launch of
    :func:`_reduce_blocks_kernel` (``FACTORS`` 3); in the first chunk it sets ``union``,
    which something before it zeroes (:func:`bind_block_keys` with ``zero``).

    As :func:`aps_comm.cpu_kernels.owner_agreed_blocks`: the N pieces of
    ``recv`` decoded, summed in rank order and divided by N; each block of
    the mean (its agreed key ``keys[first + j]``) encoded with its extra
    exponent d (into int32 ``d``) into ``out``: codes, zero padding to
    ``shard_bytes``, d clamped to a byte per block, zeros. ``layer_of``
    (host array, each block's layer; the first chunk only, else None):
    1 into ``union`` at each layer with an agreed key 255.

    Args:
        shard: int64 host array, this rank's shard's block offsets from 0.
        keys: uint8, the agreed key of every block of the group.
        first: the shard's first block in the group.
        longest: its longest block (at most :data:`MAX_SEGMENT`).

    Example:
        >>> owner = bind_owner_agreed_launch(E4M3, recv, 2, shard, keys, 0, out, union, d, 16, 8, None)  # doctest: +SKIP
        >>> owner()  # doctest: +SKIP
    """
    consts = _rank_blocks_consts(fmt, recv, keys, out, union, d)
    k, piece, used = _owner_sizes(consts, recv, n_ranks, shard, out, d, shard_bytes, longest)
    n_flags = 0 if layer_of is None else keys.numel()
    if layer_of is not None and layer_of.size != n_flags:
        raise ValueError(f"layer_of must give the layer of {n_flags} blocks, got {layer_of.size}")
    lead, rows, width = tile_shape(longest, consts.wire_bits)
    n_tiles = triton.cdiv(k, rows - lead)
    n_tail = triton.cdiv(max(out.numel() - used, n_flags, 1), rows * width)
    pow2 = n_ranks & (n_ranks - 1) == 0
    launch = functools.partial(
        _reduce_blocks_kernel[launch_grid(n_tiles + n_tail)],
        recv,
        out,
        d,
        _on(shard, recv.device),
        keys[first:],  # the shard's agreed keys
        keys,  # the group's, for the flags
        union,
        d if layer_of is None else _on(layer_of, recv.device, torch.int32),
        *_own(recv, None, -1),
        piece,
        k,
        n_ranks,
        1.0 / n_ranks if pow2 else float(n_ranks),
        _top(k),
        shard_bytes,
        used,
        out.numel(),
        0,
        n_flags,
        n_tiles,
        E=consts.encode,
        D=consts.decode,
        M=mean_limit(fmt, EXPONENT_LIMIT),
        WIRE=consts.wire_bits,
        DIVIDE=0 if n_ranks == 1 else 1 if pow2 else 2,
        LEAD=lead,
        ROWS=rows,
        WIDTH=width,
        FACTORS=3,
        **compile_options(),
    )
    return launch


def bind_decode_rank_blocks(
    fmt: FloatFormat,
    gathered: torch.Tensor,
    n_ranks: int,
    offsets: np.ndarray,
    firsts: np.ndarray,
    layer_of: np.ndarray,
    union: torch.Tensor,
    x: torch.Tensor,
    shard_bytes: int,
    agreed: torch.Tensor | None = None,
) -> Callable[[], object]:
    """Every owner's gathered shard of a chunk decoded into ``x`` with the keys it sent,
    bound: one launch over the chunk's elements.

    As :func:`aps_comm.cpu_kernels.decode_rank_blocks`: row s of ``gathered``
    (N equal rows) is shard s's codes, then at ``shard_bytes`` its blocks'
    keys; each code times its key's ``2**-e``, NaN for a block whose layer
    (``layer_of``, host array, one per block of the group) is flagged in ``union``.
    With ``agreed`` (uint8, every block's agreed key), as
    :func:`aps_comm.cpu_kernels.decode_agreed_blocks`: the bytes at
    ``shard_bytes`` are the owner's extra exponents d, each code times
    ``2**-(e + d)``.

    Example:
        >>> decode = bind_decode_rank_blocks(E2M1, rows, 2, offsets, firsts, layer_of, union, x, 16)  # doctest: +SKIP
        >>> decode()  # doctest: +SKIP
    """
    consts = _rank_blocks_consts(fmt, gathered, union, x)
    n = n_ranks
    f0, f1 = int(firsts[0]), int(firsts[-1])
    off = offsets[f0 : f1 + 1]
    rel = firsts - f0
    c0, numel = int(off[0]), int(off[-1] - off[0])
    if x.dtype != torch.float32 or firsts.size != n + 1 or gathered.numel() % n:
        raise ValueError(
            f"decode needs float32 values, {n + 1} firsts and {n} equal rows, got "
            f"{x.dtype}, {firsts.size} and {gathered.numel()} bytes"
        )
    if not numel:
        return _NOTHING
    device = x.device
    return functools.partial(
        _decode_rank_blocks_kernel[_grid(numel)],
        gathered,
        x,
        _on(off, device),
        _on(rel, device),
        _on(off[rel], device),
        _on(layer_of[f0:f1], device, torch.int32),
        union,
        gathered if agreed is None else agreed[f0:],  # not read without
        c0,
        numel,
        gathered.numel() // n,
        shard_bytes,
        f1 - f0 - 1,
        _top(f1 - f0),
        n,
        _top(n),
        D=consts.decode,
        WIRE=consts.wire_bits,
        BLOCK=BLOCK,
        SHIFT=_longest_log2(off),
        AGREED=agreed is not None,
        **compile_options(),
    )


def ptx(fmt: FloatFormat, arch: int = 90, block_size: int = 0) -> dict[str, str]:
    """The PTX of the scaled encode and decode, the owner's reduction, the shard mean and
    the owner's step with block exponents, agreed (``"owner_blocks"``) or each rank's
    own (``"owner_rank_blocks"``), of ``fmt`` for an ``sm_<arch>`` GPU, compiled here
    without one (ptxas ships with Triton): to read what the device runs, e.g. that no
    operation flushes subnormals. ``block_size``: the encode and decode with per-block
    factors, and the owner's blocks (else 32).

    Raises:
        RuntimeError: no Triton, or the kernels were built for the interpreter.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> "div.rn.f64" in ptx(E4M3)["shard_mean"]  # doctest: +SKIP
        True
    """
    if not AVAILABLE or INTERPRETED:
        raise RuntimeError("ptx() needs triton and kernels built without TRITON_INTERPRET")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    common = {"WIRE": format_constants(fmt).wire_bits, "BLOCK": BLOCK}
    sources = {**_ptx_codec_sources(fmt, block_size), **_ptx_owner_sources(fmt, block_size)}
    out = {}
    for name, (fn, signature, constexprs) in sources.items():
        if fn not in (_reduce_blocks_kernel, _maxima_kernel):
            constexprs = {**constexprs, **common}
        signature = {**signature, **{k: "constexpr" for k in constexprs}}
        src = ASTSource(fn, signature=signature, constexprs=constexprs)
        out[name] = triton.compile(src, target=target, options=compile_options()).asm["ptx"]
    return out


# The scalar arguments the encode and decode kernels take, as their launchers pass them.
_PTX_SCALARS = {"numel": "i32", "top": "i32", "n_last": "i32"}
_PTX_ENCODE_REST = {"total": "i32", "n_ranks": "i32"}
_PTX_DECODE_REST = {"divisor": "fp32", "n_ranks": "i32"}
_PtxSources = dict[str, tuple[Callable[..., object], dict[str, str], dict[str, object]]]


def _ptx_codec_sources(fmt: FloatFormat, block_size: int) -> _PtxSources:
    """:func:`ptx`'s encode and decode kernels, with factors or with agreed maxima."""
    consts = format_constants(fmt)
    factors = {"off_ptr": "*i64", "scale_ptr": "*fp32", "first_ptr": "*i64", "seg_ptr": "*i64"}
    shift = block_size.bit_length() - 1 if block_size else 0
    scalar, rest, rest_d = _PTX_SCALARS, _PTX_ENCODE_REST, _PTX_DECODE_REST
    # The bound calls' variants: each program's segments read from their table.
    plain = {"E": consts.encode, "D": consts.decode, "K": (0, 0, 0, 0, 0), "TABLE": True}
    sources: _PtxSources = {
        "encode": (
            _encode_kernel,
            {"x_ptr": "*fp32", "out_ptr": "*u8", **factors, **scalar, **rest},
            {**plain, "SCALED": True, "SHIFT": shift, "AMAX": 0},
        ),
        "decode": (
            _decode_kernel,
            {"src_ptr": "*u8", "out_ptr": "*fp32", **factors, **scalar, **rest_d},
            {**plain, "SCALED": True, "SHIFT": shift, "AMAX": 0, "DIVIDE": 0},
        ),
    }
    agreed = {"off_ptr": "*i64", "scale_ptr": "*i32", "first_ptr": "*i64", "seg_ptr": "*i64"}
    for name, native in (("encode_maxima", False), ("encode_maxima_native", True)):
        sources[name] = (
            _encode_kernel,
            {"x_ptr": "*fp32", "out_ptr": "*u8", **agreed, **scalar, **rest},
            {
                "E": consts.encode,
                "D": consts.decode,
                "K": key_constants(fmt, native),
                "SCALED": True,
                "SHIFT": 0,
                "AMAX": 1,
                "TABLE": True,
            },
        )
    for name, native, divide in (
        ("decode_maxima", False, 0),
        ("decode_maxima_pow2", True, 1),
        ("decode_maxima_n", True, 2),
    ):
        sources[name] = (
            _decode_kernel,
            {"src_ptr": "*u8", "out_ptr": "*fp32", **agreed, **scalar, **rest_d},
            {
                "D": consts.decode,
                "E": consts.encode,
                "K": key_constants(fmt, native),
                "SCALED": True,
                "SHIFT": 0,
                "AMAX": 2,
                "DIVIDE": divide,
                "TABLE": True,
            },
        )
    sources["maxima"] = (
        _maxima_kernel,
        {"x_ptr": "*fp32", "amax_ptr": "*i32", "off_ptr": "*i64", "seg_ptr": "*i64", **scalar},
        {"BLOCK": BLOCK, "TABLE": True},
    )
    return sources


def _ptx_owner_sources(fmt: FloatFormat, block_size: int) -> _PtxSources:
    """:func:`ptx`'s owner kernels: the reduction, the shard mean and the block steps."""
    consts = format_constants(fmt)
    sources: _PtxSources = {}
    scalar_r = {"shard_bytes": "i32", "numel": "i32", "n_ranks": "i32", "divisor": "fp32"}
    for name, encode in (("owner_reduce", True), ("shard_mean", False)):
        pointers = {"src_ptr": "*u8", "out_ptr": "*u8" if encode else "*fp32"}
        sources[name] = (
            _reduce_kernel,
            {**pointers, **scalar_r},
            {"E": consts.encode, "D": consts.decode, "DIVIDE": 2, "ENCODE": encode},
        )
    lead, rows, width = tile_shape(block_size or 32, consts.wire_bits)
    for name, rank_factors in (("owner_blocks", False), ("owner_rank_blocks", True)):
        sources[name] = (
            _reduce_blocks_kernel,
            {
                "src_ptr": "*u8",
                "out_ptr": "*u8",
                "d_ptr": "*i32",
                "off_ptr": "*i64",
                "exp_ptr": "*i32",
                "fac_ptr": "*fp32",
                "union_ptr": "*u8",
                "layer_ptr": "*i32",
                "own_ptr": "*fp32",
                "own_row": "i32",
                "shard_bytes": "i32",
                "n_blocks": "i32",
                "n_ranks": "i32",
                "divisor": "fp32",
                "top": "i32",
                **dict.fromkeys(
                    ("key_at", "used", "n_out", "flag_at", "n_flags", "n_tiles"), "i32"
                ),
            },
            {
                "E": consts.encode,
                "D": consts.decode,
                "M": mean_limit(fmt, EXPONENT_LIMIT),
                "WIRE": consts.wire_bits,
                "DIVIDE": 2,
                "LEAD": lead,
                "ROWS": rows,
                "WIDTH": width,
                "FACTORS": int(rank_factors),
            },
        )
    return sources
