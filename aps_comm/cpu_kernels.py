"""Compiled CPU kernels of the codec (numba), with per-segment scaling.

Eager torch decodes FP8 at 5-7x the cost of a plain copy on CPU; these
kernels make one vectorised pass over the data, the per-layer scale of APS
fused in. The encoder rounds with one float add per element (every binade
where the format allows it, else subnormals only, else 32-bit integer bit
tricks); the decoder moves the code's bit fields into a float32 that is the
code's value. They cover every format of at most 16 bits (two 4-bit codes
per byte, one byte, or two bytes per element) whose normals are float32
normals.
Only :mod:`aps_comm.codec` calls them; it falls back to plain torch when
numba is missing. A segmentation is ``offsets`` (int64, L + 1 entries, from 0
to the buffer's length) and ``factors`` (float32, L entries): element i of
segment s is multiplied by ``factors[s]``.

Block scaling makes a segment of every 8 to 256 elements. Such segments go
through explicit 16- and 8-lane LLVM vectors (numba intrinsics repeating the
scalar arithmetic) instead of the loop vectoriser, whose short-loop path
costs more than the work; runs of whole blocks (``block_size`` and ``runs``,
from :attr:`aps_comm.layout.Layout.block_runs`) are walked block by block
without reading their offsets. Measured on one thread, 64 MiB: e4m3
encode + decode with blocks of 32 within 10% of per-layer scaling.

Compiling them takes seconds, so they are cached on disk (numba's
``cache=True``): in ``NUMBA_CACHE_DIR`` when set, else in the user's cache
directory (``aps_comm/numba`` under ``XDG_CACHE_HOME`` or ``~/.cache``),
never inside the package: a cache left in an installed package's
``__pycache__`` outlives ``pip uninstall`` and, as a namespace package,
hides a later editable install of the checkout. The first compile in a process logs one line
(logger ``aps_comm.cpu_kernels``); later processes load the cache silently.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable
from typing import IO, Any

import numpy as np
import torch

from aps_comm.config import BLOCK_SIZES
from aps_comm.formats import FloatFormat, special_codes
from aps_comm.layout import BlockGrid

try:
    import numba
    from llvmlite import ir
    from numba import types as nbtypes
    from numba.core import event as nbevent
    from numba.core.caching import FunctionCache
    from numba.extending import intrinsic

    AVAILABLE = True
except ImportError:  # pragma: no cover - numba is an install requirement
    AVAILABLE = False

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: each process compiles its own
    fcntl = None  # type: ignore[assignment]

_log = logging.getLogger(__name__)

__all__ = [
    "AVAILABLE",
    "COMPILE_NOTICE",
    "CompileNotice",
    "block_amax",
    "block_factors_into",
    "block_keys",
    "block_records",
    "call",
    "copy_spans",
    "decode",
    "decode_agreed_blocks",
    "decode_rank_blocks",
    "decoder_params",
    "encode",
    "encode_keep",
    "encoder_params",
    "gather_add",
    "keep_lost",
    "key_factors",
    "layer_any",
    "layer_records",
    "maxima_factors",
    "maxima_factors_into",
    "mean_limit",
    "mean_rank_blocks",
    "mean_rows",
    "node_send",
    "or_rows",
    "owner_agreed_blocks",
    "owner_feedback",
    "owner_lost",
    "owner_rank_blocks",
    "prepare",
    "record_limits",
    "reduce_blocks",
    "reduce_rank_blocks",
    "reduce_shards",
    "send_agreed_blocks",
    "send_rank_blocks",
    "spread_maximum",
    "staged_key_factors",
    "staged_keys",
    "sum_rows",
    "sum_runs",
    "supports",
    "two_phase_keys",
    "underflow_rates",
    "unit_agreed",
    "unit_block_factors",
    "unit_keys",
    "unit_maxima",
    "unit_records",
]

_BLOCK = 2048  # elements per block of the owner reduction's float32 sum: fits L1
_TILE = 4096  # elements per tile of the 4-bit encoder's codes: fits L1
_SHORT = 256  # segments of at most this many elements go through explicit vectors
_NO_RUNS = np.zeros((0, 2), np.int64)
_NO_OWN = np.zeros(0, np.float32)  # no row of the owner step is its own values


def supports(fmt: FloatFormat) -> bool:
    """Whether the kernels handle ``fmt``: at most 16 bits on the wire, and normals
    that are float32 normals (the encoder's bit tricks need bias <= 127)."""
    return AVAILABLE and fmt.wire_bits <= 16 and fmt._emin >= -126


def _subnormal_magic(fmt: FloatFormat) -> int:
    """float32 bits of ``min_subnormal * 2**23``, or 0 where that is no normal float32.

    The ulp of this power of two is the target's smallest subnormal, so for
    ``|v| < min_normal`` the FPU's round-to-nearest-even of ``|v| + magic``
    leaves ``bits(|v| + magic) - bits(magic)`` equal to the subnormal code,
    rounding up to min_normal (code ``2**man_bits``) included: the sum stays
    below ``2 * magic`` because ``man_bits <= 23``. One float add replaces the
    variable-shift integer rounding, the most expensive part of the encoder.
    Formats with a strongly negative bias put magic beyond float32's range
    (FloatFormat's own check keeps it above the normal minimum); they keep
    the integer path.
    """
    exp = fmt._emin - fmt.man_bits + 23
    if not -126 <= exp <= 127:
        return 0
    return int(np.float32(2.0**exp).view(np.uint32))


def _binade_step(fmt: FloatFormat) -> int:
    """float32 bits of ``2**(23 - man_bits)`` for :func:`_code_binade`, or 0 where it
    does not apply.

    It needs ``man_bits >= 1`` (ties to an even count of ulps are ties to an
    even code only then) and ``2**(E + 23 - man_bits)`` finite for the top
    binade ``E`` (bf16 and very negative biases are out).
    """
    top = math.floor(math.log2(fmt.max))
    if fmt.man_bits < 1 or top + 23 - fmt.man_bits > 127:
        return 0
    return (23 - fmt.man_bits) << 23


@functools.lru_cache(maxsize=64)
def encoder_params(fmt: FloatFormat, add_subnormals: bool = True) -> tuple[np.uint32, ...]:
    """uint32 constants of the branchless encoder for one format.

    A tuple, not an array: numba then treats them as loop-invariant scalars
    (an array might alias the output, forcing a reload every element).

    Args:
        fmt: the target format.
        add_subnormals: round with float adds (:func:`_code_binade` where the
            format allows it, else subnormals only, see
            :func:`_subnormal_magic`); False forces the integer path
            everywhere (the tests compare the paths).
    """
    nan_code, inf_code = special_codes(fmt)
    max_exp = int(np.floor(np.log2(fmt.max)))
    max_frac = round((fmt.max / 2.0**max_exp - 1.0) * 2**fmt.man_bits)
    max_code = ((max_exp + fmt.bias) << fmt.man_bits) | max_frac
    shift = 23 - fmt.man_bits
    # Formats without NaN never see one here (encode() checks first, the hook
    # overwrites non-finite layers); without inf, inf maps as quantize() maps it.
    if inf_code < 0:
        inf_code = nan_code if fmt.has_nan else max_code
    nan_code = max(nan_code, 0)
    return tuple(
        np.uint32(v)
        for v in (
            shift,
            (1 << (shift - 1)) - 1 if shift > 0 else 0,
            (127 - fmt.bias) << fmt.man_bits,
            int(np.float32(fmt.max).view(np.uint32)),
            int(np.float32(fmt.min_normal).view(np.uint32)),
            150 + fmt._emin - fmt.man_bits,  # 150 + log2(min_subnormal)
            max_code,
            nan_code,
            inf_code,
            fmt.bits - 1,
            _subnormal_magic(fmt) if add_subnormals else 0,  # 0: integer subnormal path
            _binade_step(fmt) if add_subnormals else 0,  # 0: no binade path
            (fmt._emin + 127) << 23,  # float32 exponent field of min_normal
        )
    )


@functools.lru_cache(maxsize=64)
def decoder_params(fmt: FloatFormat) -> tuple[tuple[np.uint32, ...], np.float32]:
    """Constants of the bit-field decoder of a format the kernels support.

    A code's magnitude bits shifted so its mantissa tops float32's mantissa,
    plus ``127 - bias`` in the exponent field, read as a float32 are a
    normal code's value. A subnormal code (exponent field 0) gets one more in
    the exponent field, which adds the implicit bit ``2**(1 - bias)``; the
    decoder subtracts it again in float32 (exact). So no intermediate is a
    float32 subnormal unless the value itself is one: the CPU multiplies
    subnormal operands far slower. (An earlier decoder produced the value
    divided by ``2**(127 - bias)``, which made e4m3's and e2m1's subnormal
    codes float32 subnormals: block-scaled decodes of random data took 1.4x
    (e4m3) and 2.6x (e2m1) as long as now.)

    Returns:
        ``(q, m)``: q is (mantissa shift, magnitude mask, sign position, inf
        magnitude, first NaN magnitude, exponent bits of a normal code, of a
        subnormal code, ``1 << man_bits``: the smallest normal magnitude, or 0
        where no code needs the subnormal step: bias 127), m is
        ``2**(1 - bias)`` as float32.

    Raises:
        ValueError: ``fmt`` is not one :func:`supports` (the shifted exponent
            must stay a float32 exponent).
    """
    if fmt.wire_bits > 16 or fmt._emin < -126:
        raise ValueError(f"the CPU kernels do not decode {fmt.describe()}")
    magmask = (1 << (fmt.bits - 1)) - 1
    never = magmask + 1
    if fmt.specials == "ieee":
        inf_mag = (2**fmt.exp_bits - 1) << fmt.man_bits
        nan_from = inf_mag + 1
    elif fmt.specials == "fn":
        inf_mag, nan_from = never, magmask
    else:
        inf_mag = nan_from = never
    # emin >= -126 is bias <= 127; FloatFormat keeps emax <= 127, so a finite
    # code's exponent field plus the offset stays at most 254.
    offset = 127 - fmt.bias  # type: ignore[operator]
    q = tuple(
        np.uint32(v)
        for v in (
            23 - fmt.man_bits,
            magmask,
            fmt.bits - 1,
            inf_mag,
            nan_from,
            offset << 23,
            (offset + 1) << 23,
            # Bias 127 (bf16): the moved bits are the value, subnormals too.
            0 if fmt.bias == 127 else 1 << fmt.man_bits,
        )
    )
    return q, np.float32(2.0 ** (1 - fmt.bias))  # type: ignore[operator]


def _njit(fn: Callable[..., Any]) -> Any:
    """numba.njit(nogil=True, cache=True), without the cache where no directory is writable.

    numba refuses ``cache=True`` at decoration time when neither the source's
    ``__pycache__`` nor a user cache directory can be written; importing the
    package must not fail there, the kernels are then compiled per process. With a
    cache, the processes of a machine compile each signature once (:class:`_CompileOnce`).
    """
    saved = numba.config.CACHE_DIR
    # numba picks a function's cache location when it is decorated: ours, not the
    # process's setting for everyone else's functions.
    numba.config.CACHE_DIR = cache_dir()
    try:
        kernel = numba.njit(nogil=True, cache=True)(fn)
        if fcntl is not None:
            kernel._cache = _CompileOnce(fn)
    except RuntimeError as exc:
        if "cannot cache" not in str(exc):
            raise
        _log.warning("aps_comm: numba cannot cache the CPU kernels (%s); set NUMBA_CACHE_DIR", exc)
        return numba.njit(nogil=True)(fn)
    finally:
        numba.config.CACHE_DIR = saved
    return kernel


def prepare() -> None:
    """Set numba's CPU target up now rather than in the first kernel call.

    numba builds its typing and lowering registries lazily, in the first call
    that compiles or loads a kernel from its cache: about 0.8 s of CPU on a
    small machine, in every process. A process that forks workers after this
    call (:func:`aps_comm.testing.run_distributed`'s fork server) pays it once
    for all of them. A no-op without numba.

    Example:
        >>> prepare()  # idempotent: later calls find the registries in place
    """
    if AVAILABLE:
        from numba.core.registry import cpu_target

        cpu_target.target_context.refresh()


def cache_dir() -> str:
    """Where the CPU kernels' numba cache lives (see the module's docstring).

    Example:
        >>> cache_dir().endswith(os.path.join("aps_comm", "numba")) or "NUMBA_CACHE_DIR" in os.environ
        True
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("NUMBA_CACHE_DIR") or os.path.join(base, "aps_comm", "numba")


def _first_rank_here() -> bool:
    """Whether this process is a job's first rank on its machine (or no job's rank at all).

    Launchers (torchrun, aps-launch, Lightning) set ``LOCAL_RANK``; without
    it, ``RANK``. Read when the kernels compile, which is after launch.

    Example:
        >>> _first_rank_here() == (os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0")
        True
    """
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")).strip() in ("0", "")


if AVAILABLE:

    class CompileNotice(nbevent.Listener):
        """Logs one line the first time this process compiles one of these kernels.

        Only on a job's first rank of each machine (:func:`_first_rank_here`):
        the others compile the same kernels at the same time, and N copies
        of the line told nothing more. A numba ``"numba:compile"`` listener: numba fires the event only for a
        real compile, never for a function loaded from its disk cache, so a
        machine whose cache is warm hears nothing. Registered once, at import.

        Example:
            >>> notice = CompileNotice()
            >>> notice.said
            False
        """

        def __init__(self) -> None:
            self.said = False

        def on_start(self, event: Any) -> None:
            if self.said:
                return
            dispatcher = (event.data or {}).get("dispatcher")
            if getattr(getattr(dispatcher, "py_func", None), "__module__", None) != __name__:
                return
            self.said = True
            if not _first_rank_here():
                return  # every rank compiles, but one line per machine tells the user
            where = getattr(getattr(dispatcher, "_cache", None), "_cache_path", None)
            _log.warning(
                "aps_comm: compiling the CPU codec kernels with numba (a few seconds, once: "
                "cached in %s for later runs)",
                where or "numba's cache directory",
            )

        def on_end(self, event: Any) -> None:
            pass

    class _CompileOnce(FunctionCache):
        """numba's disk cache of a kernel, through which the processes of a machine
        compile each signature once.

        numba looks a signature up in its cache and, on a miss, compiles and writes
        it: N ranks started on a cold cache compiled every kernel N times side by
        side (a 4-rank test on 2 cores spent a minute so). Here a miss takes the
        kernel's lock file in the cache directory and looks again: a process that
        finds the lock held waits for that compile, then loads its result. The lock
        is kept until the signature is written, or the compile fails
        (:class:`_CompileFailed`). numba compiles one kernel at a time per process
        and a kernel's callees never call it back, so the locks cannot deadlock.
        """

        def __init__(self, py_func: Callable[..., Any]) -> None:
            super().__init__(py_func)
            self._lock_path = os.path.join(self.cache_path, f"{py_func.__qualname__}.lock")
            self._held: IO[str] | None = None

        def load_overload(self, sig: Any, target_context: Any) -> Any:
            found = super().load_overload(sig, target_context)
            if found is not None or self._held is not None:
                return found
            try:
                lock = open(self._lock_path, "a")  # noqa: SIM115 - held past this call
            except OSError:
                return None  # compile alone, as numba does
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = super().load_overload(sig, target_context)  # written while we waited?
            if found is None:
                self._held = lock
            else:
                lock.close()
            return found

        def save_overload(self, sig: Any, data: Any) -> None:
            try:
                super().save_overload(sig, data)
            finally:
                self.release()

        def release(self) -> None:
            """Let the next process waiting for this kernel look for it (closing unlocks)."""
            if self._held is not None:
                self._held.close()
                self._held = None

    class _CompileFailed(nbevent.Listener):
        """Releases a kernel's compile lock (:class:`_CompileOnce`) when its compile
        raises: nothing will be written for the others to wait for."""

        def on_start(self, event: Any) -> None:
            pass

        def on_end(self, event: Any) -> None:
            data = event.data or {}
            cache = getattr(data.get("dispatcher"), "_cache", None)
            if not isinstance(cache, _CompileOnce) or "args" not in data:
                return
            # A compile that succeeded has added its overload by now. (Not
            # event.is_failed: numba 0.68's is True exactly when nothing failed.)
            if tuple(data["args"]) not in data["dispatcher"].overloads:
                cache.release()

    nbevent.register("numba:compile", _CompileFailed())

    COMPILE_NOTICE = CompileNotice()
    """The process's notice; ``said`` turns True at the first compile."""
    nbevent.register("numba:compile", COMPILE_NOTICE)

    def _u32_op(name: str) -> Any:
        """A numba intrinsic: ``name`` (an llvmlite IRBuilder method) on two uint32.

        numba widens uint32 arithmetic to 64 bits, so the encoder would run in
        half as many vector lanes; these keep it 32-bit. The callers guarantee
        that nothing overflows where the result is used, and shift counts stay
        below 32 (LLVM makes larger ones poison).
        """

        @intrinsic
        def op(typingctx, a, b):
            def codegen(context, builder, signature, args):
                return getattr(builder, name)(*args)

            return nbtypes.uint32(nbtypes.uint32, nbtypes.uint32), codegen

        return op

    _add32 = _u32_op("add")
    _sub32 = _u32_op("sub")
    _and32 = _u32_op("and_")
    _or32 = _u32_op("or_")
    _shl32 = _u32_op("shl")
    _shr32 = _u32_op("lshr")

    def _bitcast(src: Any, dst: Any) -> Any:
        """A numba intrinsic reinterpreting a ``src`` scalar's bits as ``dst``.

        An LLVM bitcast: free, and unlike a view through a scratch array it
        keeps a loop that mixes float and bit arithmetic in one vectorised pass.
        """

        @intrinsic
        def cast(typingctx, a):
            def codegen(context, builder, signature, args):
                return builder.bitcast(args[0], context.get_value_type(dst))

            return dst(src), codegen

        return cast

    _f2u = _bitcast(nbtypes.float32, nbtypes.uint32)
    _u2f = _bitcast(nbtypes.uint32, nbtypes.float32)
    _u64 = np.uint64

    def _splat(builder: Any, value: Any, width: int) -> Any:
        """LLVM IR: a vector of ``width`` copies of a scalar."""
        vec = ir.VectorType(value.type, width)
        one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.IntType(32)(0))
        zeros = ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width)
        return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), zeros)

    def _vector_values(builder: Any, codes: Any, q: Any, m: Any, width: int) -> Any:
        """LLVM IR of :func:`_code_value` on a vector of ``width`` uint32 codes."""
        i32 = ir.VectorType(ir.IntType(32), width)
        f32 = ir.VectorType(ir.FloatType(), width)
        qs = [_splat(builder, builder.extract_value(q, i), width) for i in range(8)]
        mag = builder.and_(codes, qs[1])
        sign = builder.shl(builder.lshr(codes, qs[2]), i32([31] * width))
        sub = builder.icmp_unsigned("<", mag, qs[7])
        u = builder.add(builder.shl(mag, qs[0]), builder.select(sub, qs[6], qs[5]))
        implicit = builder.select(sub, _splat(builder, m, width), f32([0.0] * width))
        b = builder.or_(builder.bitcast(builder.fsub(builder.bitcast(u, f32), implicit), i32), sign)
        inf = builder.or_(sign, i32([0x7F800000] * width))
        b = builder.select(builder.icmp_unsigned("==", mag, qs[3]), inf, b)
        nan = builder.or_(sign, i32([0x7FC00000] * width))
        return builder.bitcast(builder.select(builder.icmp_unsigned(">=", mag, qs[4]), nan, b), f32)

    def _decode_lanes(width: int, packed: bool) -> Any:
        """A numba intrinsic decoding ``width`` codes at once in explicit LLVM vectors.

        ``(payload, i, out, j, q, m, f)``: ``out[j : j + width]`` gets the
        values of the codes from ``payload[i]`` on (the 8- or 16-bit
        elements ``payload[i : i + width]``, or where ``packed`` the 4-bit
        codes of bytes ``payload[i : i + width // 2]``, low nibble first),
        times ``f``: :func:`_decode_segments`'s arithmetic. A block of 32
        elements is then two vector steps; the loop vectoriser would run it in
        its short-loop epilogue after alias checks.
        """

        @intrinsic
        def lanes(typingctx, payload, i, out, j, q, m, f):
            def codegen(context, builder, signature, args):
                pay = context.make_array(signature.args[0])(context, builder, args[0])
                dst = context.make_array(signature.args[2])(context, builder, args[2])
                i32 = ir.VectorType(ir.IntType(32), width)
                src = builder.gep(pay.data, [args[1]])
                if packed:
                    half = ir.VectorType(ir.IntType(8), width // 2)
                    raw = builder.load(builder.bitcast(src, half.as_pointer()), align=1)
                    wide = builder.zext(raw, ir.VectorType(ir.IntType(32), width // 2))
                    low = builder.and_(wide, wide.type([15] * (width // 2)))
                    high = builder.lshr(wide, wide.type([4] * (width // 2)))
                    order = [k for n in range(width // 2) for k in (n, n + width // 2)]
                    codes = builder.shuffle_vector(low, high, i32(order))
                else:
                    elem = src.type.pointee
                    vec = ir.VectorType(elem, width)
                    raw = builder.load(builder.bitcast(src, vec.as_pointer()), align=1)
                    codes = builder.zext(raw, i32)
                vals = _vector_values(builder, codes, args[4], args[5], width)
                vals = builder.fmul(vals, _splat(builder, args[6], width))
                target = builder.gep(dst.data, [args[3]])
                builder.store(vals, builder.bitcast(target, vals.type.as_pointer()), align=4)
                return context.get_dummy_value()

            return nbtypes.void(payload, i, out, j, q, m, f), codegen

        return lanes

    _decode16 = _decode_lanes(16, packed=False)
    _decode8 = _decode_lanes(8, packed=False)
    _decode16x4 = _decode_lanes(16, packed=True)
    _decode8x4 = _decode_lanes(8, packed=True)

    def _encode_lanes(width: int, packed: bool = False) -> Any:
        """A numba intrinsic: :func:`_code_binade` on ``width`` elements in explicit vectors.

        ``(x, i, f, codes, p)``: ``codes[i : i + width]`` (uint8 or uint16)
        get the codes of ``x[i : i + width] * f``; where ``packed``, bytes
        ``codes[i // 2 : (i + width) // 2]`` get them two a byte, low nibble
        first (``i`` even). See :func:`_decode_lanes` for why blocks want this.
        """

        @intrinsic
        def lanes(typingctx, x, i, f, codes, p):
            def codegen(context, builder, signature, args):
                xs = context.make_array(signature.args[0])(context, builder, args[0])
                cs = context.make_array(signature.args[3])(context, builder, args[3])
                i32 = ir.VectorType(ir.IntType(32), width)
                f32 = ir.VectorType(ir.FloatType(), width)
                ps = [_splat(builder, builder.extract_value(args[4], k), width) for k in range(13)]
                src = builder.bitcast(builder.gep(xs.data, [args[1]]), f32.as_pointer())
                scaled = builder.fmul(builder.load(src, align=4), _splat(builder, args[2], width))
                u = builder.bitcast(scaled, i32)
                inf = i32([0x7F800000] * width)
                a = builder.and_(u, i32([0x7FFFFFFF] * width))
                am = builder.select(builder.icmp_unsigned("<", a, ps[3]), a, ps[3])
                e = builder.and_(am, inf)
                e = builder.select(builder.icmp_unsigned(">", e, ps[12]), e, ps[12])
                cb = builder.add(e, ps[11])
                total = builder.fadd(builder.bitcast(am, f32), builder.bitcast(cb, f32))
                m = builder.sub(builder.bitcast(total, i32), cb)
                c = builder.add(m, builder.lshr(builder.sub(e, ps[12]), ps[0]))
                c = builder.select(builder.icmp_unsigned("==", a, inf), ps[8], c)
                c = builder.or_(c, builder.shl(builder.lshr(u, i32([31] * width)), ps[9]))
                c = builder.select(builder.icmp_unsigned(">", a, inf), ps[7], c)
                if packed:
                    half = ir.VectorType(ir.IntType(32), width // 2)
                    evens = half([2 * k for k in range(width // 2)])
                    odds = half([2 * k + 1 for k in range(width // 2)])
                    low = builder.shuffle_vector(c, c, evens)
                    high = builder.shuffle_vector(c, c, odds)
                    c = builder.or_(low, builder.shl(high, half([4] * (width // 2))))
                    index = builder.lshr(args[1], args[1].type(1))
                else:
                    index = args[1]
                dst = builder.gep(cs.data, [index])
                narrow = builder.trunc(c, ir.VectorType(dst.type.pointee, c.type.count))
                builder.store(narrow, builder.bitcast(dst, narrow.type.as_pointer()), align=1)
                return context.get_dummy_value()

            return nbtypes.void(x, i, f, codes, p), codegen

        return lanes

    _encode16 = _encode_lanes(16)
    _encode8 = _encode_lanes(8)
    _encode16x4 = _encode_lanes(16, packed=True)
    _encode8x4 = _encode_lanes(8, packed=True)

    @_njit
    def _finish(u, sub, p):
        """Code of the float32 with bits ``u``, given its code ``sub`` as a subnormal.

        Rounds normals to nearest even, saturates, maps inf/NaN and adds the
        sign. Branchless (selects only) so that LLVM vectorises the loops
        calling it; every lane computes both the normal and subnormal code.
        """
        one = np.uint32(1)
        inf_bits = np.uint32(0x7F800000)
        a = _and32(u, np.uint32(0x7FFFFFFF))
        shift = p[0]
        # a + p[1] + 1 < 2**32: no wrap-around; below min_normal `normal` may
        # wrap, but then the select discards it.
        odd = _and32(_shr32(a, shift), one)
        normal = _sub32(_shr32(_add32(_add32(a, p[1]), odd), shift), p[2])
        c = normal if a >= p[4] else sub
        c = p[6] if a >= p[3] else c
        c = p[8] if a == inf_bits else c
        c = p[7] if a > inf_bits else c
        sign = _shl32(_shr32(u, np.uint32(31)), p[9])
        sign = sign if a <= inf_bits else np.uint32(0)
        return _or32(c, sign)

    @_njit
    def _code(u, p):
        """Code of the float32 with bits ``u``, subnormals rounded with integers.

        The path for formats without a usable magic (p[10] == 0); this
        variable-shift rounding, in numba's 64-bit arithmetic, costs about as
        much as the rest of the encoder.
        """
        one = np.uint32(1)
        a = u & np.uint32(0x7FFFFFFF)
        # Subnormal in the target format: round(value / min_subnormal), ties to even.
        ef = a >> np.uint32(23)
        sig = (a & np.uint32(0x7FFFFF)) | (np.uint32(0x800000) if ef > 0 else np.uint32(0))
        s = p[5] - (ef if ef > 0 else one)
        s = s if s < np.uint32(31) else np.uint32(31)  # also catches the wrap-around
        s = s if s > 0 else one
        sub = (sig + ((one << (s - one)) - one) + ((sig >> s) & one)) >> s
        return _finish(u, np.uint32(sub), p)

    @_njit
    def _code_magic(u, p):
        """Code of the float32 with bits ``u``, subnormals rounded by one float add.

        See :func:`_subnormal_magic`; the path where p[10] != 0 but the
        format's binades do not all fit :func:`_code_binade`.
        """
        a = _u2f(_and32(u, np.uint32(0x7FFFFFFF)))
        return _finish(u, _sub32(_f2u(a + _u2f(p[10])), p[10]), p)

    @_njit
    def _code_binade(u, p):
        """Code of the float32 with bits ``u``: every binade rounded by one float add.

        With ``|v|`` first clamped to ``fmt.max`` (saturation) and ``E`` its
        exponent raised to at least ``emin``, ``c = 2**(E + 23 - man_bits)``
        has the format's ulp in ``E``'s binade as its own ulp, so the FPU's
        round-to-nearest-even of ``|v| + c`` rounds ``|v|`` to the format:
        ``bits(|v| + c) - bits(c)`` is its mantissa count ``m`` in ulps (8 to
        16 for e4m3's normals; 16 is the next binade's first value, and below
        ``min_normal`` it is the subnormal code). The code is then
        ``((E - emin) << man_bits) + m``: no variable shift, no separate
        subnormal path, and ties go to an even ``m``, i.e. an even code (this
        needs ``man_bits >= 1``). ``c`` must stay a finite float32 (p[11] != 0
        only where it does).
        """
        inf_bits = np.uint32(0x7F800000)
        a = _and32(u, np.uint32(0x7FFFFFFF))
        am = a if a < p[3] else p[3]
        e = _and32(am, inf_bits)
        e = e if e > p[12] else p[12]
        cb = _add32(e, p[11])
        m = _sub32(_f2u(_u2f(am) + _u2f(cb)), cb)
        c = _add32(m, _shr32(_sub32(e, p[12]), p[0]))
        c = p[8] if a == inf_bits else c
        c = _or32(c, _shl32(_shr32(u, np.uint32(31)), p[9]))
        return p[7] if a > inf_bits else c

    @_njit
    def _encode_binade(x, f, codes, p):
        for i in range(len(x)):
            codes[i] = _code_binade(_f2u(x[i] * f), p)

    @_njit
    def _encode_magic(x, f, codes, p):
        for i in range(len(x)):
            codes[i] = _code_magic(_f2u(x[i] * f), p)

    @_njit
    def _encode_int(x, f, codes, p):
        for i in range(len(x)):
            codes[i] = _code(_f2u(x[i] * f), p)

    @_njit
    def _encode_block(x, f, codes, p):
        """codes[i] = code(x[i] * f) through the format's fastest exact path.

        One fused pass: ``x * f`` is rounded once in float32 (exact for the
        powers of two of APS, and ``x * 1`` is ``x``) and never stored.
        """
        if p[11] != 0:
            _encode_binade(x, f, codes, p)
        elif p[10] != 0:
            _encode_magic(x, f, codes, p)
        else:
            _encode_int(x, f, codes, p)

    # The segment loops below keep the element loop inline (no call per
    # segment): block scaling has a segment every 8 to 256 elements, where a
    # call per segment costs 8x the encoding. They index with unsigned
    # integers (no slices): numba then drops the wrap-around select of a
    # negative index, so LLVM vectorises the loop, and no array view is made
    # per segment.

    # Runs of whole blocks (see :func:`encode`: ``size`` elements each, the
    # segments ``runs[r, 0]`` on, ``runs[r, 1]`` of them) are walked without
    # reading their offsets, each block in ``size / 16`` vector steps (one
    # 8-lane step for blocks of 8); every other segment on its own.

    @_njit
    def _segments_binade(x, offsets, factors, codes, p, size, runs):
        seg = 0
        for r in range(len(runs) + 1):
            stop = runs[r, 0] if r < len(runs) else len(offsets) - 1
            while seg < stop:
                f = factors[seg]
                lo, hi = offsets[seg], offsets[seg + 1]
                if hi - lo <= _SHORT:  # blocks: explicit vectors, see _encode_lanes
                    while lo + 16 <= hi:
                        _encode16(x, lo, f, codes, p)
                        lo += 16
                    if lo + 8 <= hi:
                        _encode8(x, lo, f, codes, p)
                        lo += 8
                for i in range(_u64(lo), _u64(hi)):
                    codes[i] = _code_binade(_f2u(x[i] * f), p)
                seg += 1
            if r == len(runs):
                break
            lo = offsets[seg]
            for b in range(seg, seg + runs[r, 1]):
                f = factors[b]
                if size == 8:
                    _encode8(x, lo, f, codes, p)
                else:
                    for j in range(lo, lo + size, 16):
                        _encode16(x, j, f, codes, p)
                lo += size
            seg += runs[r, 1]

    @_njit
    def _segments_magic(x, offsets, factors, codes, p):
        for seg in range(len(offsets) - 1):
            f = factors[seg]
            for i in range(_u64(offsets[seg]), _u64(offsets[seg + 1])):
                codes[i] = _code_magic(_f2u(x[i] * f), p)

    @_njit
    def _segments_int(x, offsets, factors, codes, p):
        for seg in range(len(offsets) - 1):
            f = factors[seg]
            for i in range(_u64(offsets[seg]), _u64(offsets[seg + 1])):
                codes[i] = _code(_f2u(x[i] * f), p)

    @_njit
    def _encode_codes(x, offsets, factors, codes, p, size, runs):
        """codes[i] = code(x[i] * factor of i's segment), through the fastest exact path."""
        if p[11] != 0:
            _segments_binade(x, offsets, factors, codes, p, size, runs)
        elif p[10] != 0:
            _segments_magic(x, offsets, factors, codes, p)
        else:
            _segments_int(x, offsets, factors, codes, p)

    @_njit
    def _pack(codes, out):
        n = len(codes)
        for i in range(n // 2):
            out[i] = codes[2 * i] | (codes[2 * i + 1] << 4)
        if n % 2:
            out[n // 2] = codes[n - 1]

    @_njit
    def _encode4(x, offsets, factors, out, p, size, runs):
        """Packed 4-bit codes of x (times per-segment factors).

        Runs of whole blocks that start at a byte (with the binade encoder)
        go block by block in explicit vectors, straight into ``out``; the
        stretches between them (which start at a byte too) through
        :func:`_encode4_tiles`.
        """
        fast = p[11] != 0
        seg = 0
        for r in range(len(runs) + 1):
            stop = runs[r, 0] if r < len(runs) else len(offsets) - 1
            whole = fast and r < len(runs) and offsets[stop] & 1 == 0
            if r < len(runs) and not whole:
                continue  # its blocks join the stretch up to the next run
            if seg < stop:
                a, b = offsets[seg], offsets[stop]
                cut = offsets[seg : stop + 1] - a
                _encode4_tiles(x[a:b], cut, factors[seg:stop], out[a // 2 :], p)
                seg = stop
            if not whole:
                break
            lo = offsets[seg]
            for blk in range(seg, seg + runs[r, 1]):
                f = factors[blk]
                if size == 8:
                    _encode8x4(x, lo, f, out, p)
                else:
                    for j in range(lo, lo + size, 16):
                        _encode16x4(x, j, f, out, p)
                lo += size
            seg += runs[r, 1]

    @_njit
    def _encode4_tiles(x, offsets, factors, out, p):
        """Packed 4-bit codes of x (times per-segment factors), a tile at a time.

        Each tile of :data:`_TILE` elements is encoded into an L1-resident
        scratch (its segments cut to the tile) and packed two codes a byte:
        no buffer of one byte per element, whose fresh pages cost as much as
        the encoding.
        """
        n = len(x)
        codes = np.empty(_TILE, np.uint8)
        # A tile's segments cut to it; empty segments make any count possible,
        # but only the pages of the first few entries are ever touched.
        cut = np.empty(len(offsets), np.int64)
        no_runs = np.zeros((0, 2), np.int64)
        seg = 0
        for t0 in range(0, n, _TILE):
            t1 = min(t0 + _TILE, n)
            while offsets[seg + 1] <= t0:  # segments ending before the tile
                seg += 1
            first = seg
            k = 0
            cut[0] = 0
            while True:
                end = offsets[seg + 1]
                k += 1
                cut[k] = min(end, t1) - t0
                if end >= t1:
                    break
                seg += 1
            _encode_codes(x[t0:t1], cut[: k + 1], factors[first : first + k], codes, p, 0, no_runs)
            _pack(codes[: t1 - t0], out[t0 // 2 :])

    @_njit
    def _code_value(code, q, m):
        """float32 value of a code (see :func:`decoder_params`): fields moved into
        place, the implicit bit of subnormals taken off, inf and NaN selected."""
        c = np.uint32(code)
        mag = _and32(c, q[1])
        sign = _shl32(_shr32(c, q[2]), np.uint32(31))
        sub = mag < q[7]
        u = _add32(_shl32(mag, q[0]), q[6] if sub else q[5])
        v = _u2f(u) - (m if sub else np.float32(0.0))
        b = _or32(_f2u(v), sign)
        b = _or32(sign, np.uint32(0x7F800000)) if mag == q[3] else b
        return _u2f(_or32(sign, np.uint32(0x7FC00000)) if mag >= q[4] else b)

    @_njit
    def _decode_segments(payload, out, q, m, offsets, factors, size, runs):
        """out[i] = value(payload[i]) * factor of i's segment (one rounding).

        Segments of a block's size in explicit vectors (:func:`_decode_lanes`);
        longer ones in the loop LLVM vectorises, unrolled four times. Runs of
        whole blocks as in :func:`_segments_binade`.
        """
        seg = 0
        for r in range(len(runs) + 1):
            stop = runs[r, 0] if r < len(runs) else len(offsets) - 1
            while seg < stop:
                f = factors[seg]
                lo, hi = offsets[seg], offsets[seg + 1]
                if hi - lo <= _SHORT:
                    while lo + 16 <= hi:
                        _decode16(payload, lo, out, lo, q, m, f)
                        lo += 16
                    if lo + 8 <= hi:
                        _decode8(payload, lo, out, lo, q, m, f)
                        lo += 8
                for i in range(_u64(lo), _u64(hi)):
                    out[i] = _code_value(payload[i], q, m) * f
                seg += 1
            if r == len(runs):
                break
            lo = offsets[seg]
            for b in range(seg, seg + runs[r, 1]):
                f = factors[b]
                if size == 8:
                    _decode8(payload, lo, out, lo, q, m, f)
                else:
                    for j in range(lo, lo + size, 16):
                        _decode16(payload, j, out, j, q, m, f)
                lo += size
            seg += runs[r, 1]

    @_njit
    def _nibble(payload, i, q, m):
        """Value of element i of a packed 4-bit payload."""
        byte = np.uint32(payload[i >> 1])
        return _code_value(_and32(_shr32(byte, np.uint32((i & 1) * 4)), np.uint32(15)), q, m)

    @_njit
    def _decode4(payload, out, q, m, offsets, factors, size, runs):
        """:func:`_decode_segments` for packed 4-bit codes: two per byte, low nibble first.

        A run of whole blocks starting mid-byte (after a layer of odd size)
        goes segment by segment.
        """
        four = np.uint32(4)
        low = np.uint32(15)
        seg = 0
        for r in range(len(runs) + 1):
            stop = runs[r, 0] if r < len(runs) else len(offsets) - 1
            whole = r < len(runs) and offsets[stop] & 1 == 0
            if r < len(runs) and not whole:
                stop += runs[r, 1]
            while seg < stop:
                f = factors[seg]
                lo, hi = offsets[seg], offsets[seg + 1]
                if lo < hi and lo & 1:
                    out[lo] = _nibble(payload, lo, q, m) * f
                    lo += 1
                if hi - lo <= _SHORT:
                    while lo + 16 <= hi:
                        _decode16x4(payload, lo >> 1, out, lo, q, m, f)
                        lo += 16
                    if lo + 8 <= hi:
                        _decode8x4(payload, lo >> 1, out, lo, q, m, f)
                        lo += 8
                # Whole bytes: a loop of two strided stores that vectorises.
                start = _u64(lo)
                for j in range(_u64((hi - lo) >> 1)):
                    byte = np.uint32(payload[(start >> _u64(1)) + j])
                    out[start + _u64(2) * j] = _code_value(_and32(byte, low), q, m) * f
                    out[start + _u64(2) * j + _u64(1)] = _code_value(_shr32(byte, four), q, m) * f
                if (hi - lo) & 1:
                    out[hi - 1] = _nibble(payload, hi - 1, q, m) * f
                seg += 1
            if not whole:
                continue
            lo = offsets[seg]
            for b in range(seg, seg + runs[r, 1]):
                f = factors[b]
                if size == 8:
                    _decode8x4(payload, lo >> 1, out, lo, q, m, f)
                else:
                    for j in range(lo, lo + size, 16):
                        _decode16x4(payload, j >> 1, out, j, q, m, f)
                lo += size
            seg += runs[r, 1]

    @_njit
    def _moved_value(code, q):
        """:func:`_code_value` where no code needs the subnormal step (``q[7] == 0``)."""
        c = np.uint32(code)
        mag = _and32(c, q[1])
        sign = _shl32(_shr32(c, q[2]), np.uint32(31))
        b = _or32(_add32(_shl32(mag, q[0]), q[5]), sign)
        b = _or32(sign, np.uint32(0x7F800000)) if mag == q[3] else b
        return _u2f(_or32(sign, np.uint32(0x7FC00000)) if mag >= q[4] else b)

    @_njit
    def _accumulate(payload, acc, q, m, first):
        # The owner adds N decoded shards: bf16's plain bit move saves a tenth.
        if q[7] == 0:
            if first:
                for j in range(len(acc)):
                    acc[j] = _moved_value(payload[j], q)
            else:
                for j in range(len(acc)):
                    acc[j] += _moved_value(payload[j], q)
        elif first:
            for j in range(len(acc)):
                acc[j] = _code_value(payload[j], q, m)
        else:
            for j in range(len(acc)):
                acc[j] += _code_value(payload[j], q, m)

    @_njit
    def _reduce(recv, n_ranks, shard, out_codes, q, m, p):
        """Sum n_ranks decoded shards in rank order, divide by n_ranks, re-encode.

        Over L1-sized blocks: each rank's codes are decoded and added into one
        float32 block, which is divided and encoded before the next block.
        """
        acc = np.empty(_BLOCK, np.float32)
        div = np.float32(n_ranks)
        one = np.float32(1.0)
        for start in range(0, shard, _BLOCK):
            n = min(_BLOCK, shard - start)
            block = acc[:n]
            for r in range(n_ranks):
                codes = recv[r * shard + start : r * shard + start + n]
                _accumulate(codes, block, q, m, r == 0)
            for j in range(n):
                block[j] = block[j] / div
            _encode_block(block, one, out_codes[start : start + n], p)

    @_njit
    def _reduce4(recv, n_ranks, shard_bytes, out, q, m, p):
        """:func:`_reduce` for packed 4-bit codes."""
        acc = np.empty(_BLOCK, np.float32)
        part = np.empty(_BLOCK, np.float32)
        codes = np.empty(_BLOCK, np.uint8)
        whole = np.zeros(2, np.int64)
        ones = np.ones(1, np.float32)
        no_runs = np.zeros((0, 2), np.int64)
        div = np.float32(n_ranks)
        one = np.float32(1.0)
        for start in range(0, shard_bytes, _BLOCK // 2):
            nb = min(_BLOCK // 2, shard_bytes - start)
            n = 2 * nb
            whole[1] = n
            block = acc[:n]
            _decode4(recv[start : start + nb], block, q, m, whole, ones, 0, no_runs)
            for r in range(1, n_ranks):
                base = r * shard_bytes + start
                _decode4(recv[base : base + nb], part, q, m, whole, ones, 0, no_runs)
                for j in range(n):
                    block[j] += part[j]
            for j in range(n):
                block[j] = block[j] / div
            _encode_block(block, one, codes[:n], p)
            _pack(codes[:n], out[start : start + nb])


if AVAILABLE:

    @_njit
    def _amax_bits(xb):
        """Largest ``bits & 0x7FFFFFFF`` of float32 bits ``xb``: NaN above inf above the
        finite magnitudes, so an integer max (which vectorises) is a NaN-aware max |x|."""
        m = np.uint32(0)
        for i in range(len(xb)):
            a = _and32(xb[i], np.uint32(0x7FFFFFFF))
            m = a if a > m else m
        return m

    @_njit
    def _block_amax(xb, offsets, out):
        inf_bits = np.uint32(0x7F800000)
        for b in range(len(offsets) - 1):
            m = _amax_bits(xb[offsets[b] : offsets[b + 1]])
            out[b] = m if m < inf_bits else inf_bits  # NaN becomes inf


if AVAILABLE:

    @_njit
    def _pow2_bits(d):
        """float32 bits of 2**d for an integer d in [-149, 127] (:func:`aps_comm.formats.pow2`)."""
        if d >= -126:
            return np.uint32((d + 127) << 23)
        return np.uint32(np.uint32(1) << np.uint32(min(max(d + 149, 0), 22)))

    @_njit
    def _mean_exponent(m, e, lim):
        """:func:`aps_comm.scaling.mean_exponents` of one block from its max |mean| bits.

        ``m``: the largest ``bits & 0x7FFFFFFF`` of the block (NaN clamped to
        inf), ``e``: the block's agreed exponent, ``lim``: :func:`mean_limit`.
        The largest d with ``amax * 2**d <= limit`` is ``E(limit) - E(amax)``,
        one less where amax's mantissa is the larger: exact integer work on
        the bit fields (a subnormal amax normalised first), where scaling
        computes the same d in float64.
        """
        lim_e, lim_m, limit = lim
        a = np.int64(m)
        if a == 0 or a >= 0x7F800000:
            d = np.int64(0)
        else:
            if a >= 0x800000:
                ea = (a >> 23) - 127
                ma = a & 0x7FFFFF
            else:  # float32 subnormal: its leading bit from an exact int -> float conversion
                top = np.int64(_f2u(np.float32(a)) >> np.uint32(23)) - 127
                ea = top - 149
                ma = (a << (23 - top)) & 0x7FFFFF
            d = lim_e - ea - (1 if ma > lim_m else 0)
            d = min(max(d, -limit), limit)
        return min(d, limit - np.int64(e))

    @_njit
    def _encode_mean_blocks(acc, base, g0, offsets, s, t, exps, d_out, codes, cbase, p, lim):
        """Blocks s..t-1 of the group whose float32 mean starts at ``acc[base]`` (element
        ``g0``): each block's max, its extra exponent d into ``d_out``, its codes of
        ``mean * 2**d`` into ``codes`` from index ``cbase`` (element ``g0``)."""
        accb = acc.view(np.uint32)
        for seg in range(s, t):
            lo, hi = base + offsets[seg] - g0, base + offsets[seg + 1] - g0
            m = _amax_bits(accb[lo:hi])
            d = _mean_exponent(
                m if m < np.uint32(0x7F800000) else np.uint32(0x7F800000), exps[seg], lim
            )
            d_out[seg] = d
            f = _u2f(_pow2_bits(d))
            xs = acc[lo:hi]
            cs = codes[cbase + lo - base : cbase + hi - base]
            # The encoder's path, branched per block (the element loops stay inline).
            if p[11] != 0:
                for i in range(len(xs)):
                    cs[i] = _code_binade(_f2u(xs[i] * f), p)
            elif p[10] != 0:
                for i in range(len(xs)):
                    cs[i] = _code_magic(_f2u(xs[i] * f), p)
            else:
                for i in range(len(xs)):
                    cs[i] = _code(_f2u(xs[i] * f), p)

    @_njit
    def _group_end(offsets, s, cap):
        """The end t of the group of whole blocks from s: as many as fit ``cap``, one at least."""
        n_seg = len(offsets) - 1
        t = s + 1
        while t < n_seg and offsets[t + 1] - offsets[s] <= cap:
            t += 1
        return t

    @_njit
    def _reduce_blocks(recv, n_ranks, shard, out_codes, offsets, exps, d_out, cap, q, m, p, lim):
        """The owner's step with block exponents, 8- and 16-bit codes, one pass.

        Per group of whole blocks (about L1's size): N ranks' codes decoded
        and added in rank order, divided by N, then per block its max, d and
        codes (:func:`_encode_mean_blocks`): the mean is never stored.
        """
        acc = np.empty(cap, np.float32)
        div = np.float32(n_ranks)
        s = 0
        while s < len(offsets) - 1:
            t = _group_end(offsets, s, cap)
            g0, g1 = offsets[s], offsets[t]
            block = acc[: g1 - g0]
            for r in range(n_ranks):
                codes = recv[r * shard + g0 : r * shard + g1]
                _accumulate(codes, block, q, m, r == 0)
            if n_ranks > 1:  # the chain divides only then
                for j in range(len(block)):
                    block[j] = block[j] / div
            _encode_mean_blocks(acc, 0, g0, offsets, s, t, exps, d_out, out_codes, g0, p, lim)
            s = t

    @_njit
    def _decode4_range(payload, out, lo, hi, q, m, f):
        """out[i] = value(4-bit code i of payload) * f for i in [lo, hi)."""
        i = lo
        if i < hi and i & 1:
            out[i] = _nibble(payload, i, q, m) * f
            i += 1
        while i + 16 <= hi:
            _decode16x4(payload, i >> 1, out, i, q, m, f)
            i += 16
        for j in range(i, hi):
            out[j] = _nibble(payload, j, q, m) * f

    @_njit
    def _reduce_blocks4(recv, n_ranks, shard_bytes, out, offsets, exps, d_out, cap, q, m, p, lim):
        """:func:`_reduce_blocks` for packed 4-bit codes.

        A group starting at an odd element shares its first byte with the
        previous group's last element: the buffers hold the group from the
        even element before it, that element's code carried over, so every
        byte is written whole (a later group rewrites a half-written last byte).
        """
        acc = np.empty(cap + 1, np.float32)
        part = np.empty(cap + 1, np.float32)
        codes = np.empty(cap + 1, np.uint8)
        div = np.float32(n_ranks)
        one = np.float32(1.0)
        carry = np.uint8(0)
        s = 0
        while s < len(offsets) - 1:
            t = _group_end(offsets, s, cap)
            g0, g1 = offsets[s], offsets[t]
            lo = g0 & 1
            hi = lo + g1 - g0
            b0, b1 = g0 >> 1, (g1 + 1) >> 1
            for r in range(n_ranks):
                dst = acc if r == 0 else part
                payload = recv[r * shard_bytes + b0 : r * shard_bytes + b1]
                _decode4_range(payload, dst, lo, hi, q, m, one)
                if r > 0:  # unsigned bounds: LLVM vectorises the loop (4x)
                    for j in range(_u64(lo), _u64(hi)):
                        acc[j] += part[j]
            if n_ranks > 1:
                for j in range(_u64(lo), _u64(hi)):
                    acc[j] = acc[j] / div
            _encode_mean_blocks(acc, lo, g0, offsets, s, t, exps, d_out, codes, lo, p, lim)
            codes[0] = carry if lo else codes[0]
            _pack(codes[:hi], out[b0:b1])
            carry = codes[hi - 1]
            s = t


if AVAILABLE:

    @_njit
    def _decode_blocks(payload, out, q, m, offsets, s, t, base, fr):
        """out[k] = value(payload[k]) * its block's factor, for the blocks s..t-1.

        Element ``e`` of the blocks is ``k = e - base`` in ``payload`` and
        ``out``; block ``b``'s factor is ``fr[b]``. One rounding per element,
        as :func:`_decode_segments`, in explicit vectors.
        """
        for seg in range(s, t):
            f = fr[seg]
            lo, hi = offsets[seg] - base, offsets[seg + 1] - base
            while lo + 16 <= hi:
                _decode16(payload, lo, out, lo, q, m, f)
                lo += 16
            if lo + 8 <= hi:
                _decode8(payload, lo, out, lo, q, m, f)
                lo += 8
            for k in range(lo, hi):
                out[k] = _code_value(payload[k], q, m) * f

    @_njit
    def _decode_blocks4(payload, out, q, m, offsets, s, t, base, fr):
        """:func:`_decode_blocks` for packed 4-bit codes; ``base`` is even (element
        ``k`` is nibble ``k & 1`` of ``payload[k >> 1]``)."""
        for seg in range(s, t):
            f = fr[seg]
            lo, hi = offsets[seg] - base, offsets[seg + 1] - base
            if lo < hi and lo & 1:
                out[lo] = _nibble(payload, lo, q, m) * f
                lo += 1
            while lo + 16 <= hi:
                _decode16x4(payload, lo >> 1, out, lo, q, m, f)
                lo += 16
            if lo + 8 <= hi:
                _decode8x4(payload, lo >> 1, out, lo, q, m, f)
                lo += 8
            for k in range(lo, hi):
                out[k] = _nibble(payload, k, q, m) * f

    @_njit
    def _reduce_rank_blocks(
        recv, n_ranks, row, out_codes, offsets, factors, d_out, cap, params, mine
    ):
        """:func:`_reduce_blocks` where rank r's codes of block b are decoded times
        ``factors[r, b]`` (every rank's own block exponents); ``row``: codes
        from one rank's shard to the next's. 8- and 16-bit codes; ``params``:
        ``(q, m, p, lim)``, the format's decoder, encoder and mean limit.

        A code's value (exact) times its factor rounds once, as
        :func:`decode` with factors; rank 0's products are the sum's start,
        the others' are added in rank order. ``mine``: ``(own, own_row)``;
        row ``own_row`` (if not -1) is the float32 ``own`` instead: the
        owner's own values, not rounded.
        """
        q, m, p, lim = params
        own, own_row = mine
        acc = np.empty(cap, np.float32)
        part = np.empty(cap, np.float32)
        zero = np.zeros(len(offsets) - 1, np.int32)
        div = np.float32(n_ranks)
        s = 0
        while s < len(offsets) - 1:
            t = _group_end(offsets, s, cap)
            g0, g1 = offsets[s], offsets[t]
            n = g1 - g0
            for r in range(n_ranks):
                dst = acc if r == 0 else part
                if r == own_row:
                    mine_values = own[g0:g1]  # a view from 0: the copy vectorises
                    for j in range(n):
                        dst[j] = mine_values[j]
                else:
                    codes = recv[r * row + g0 : r * row + g1]
                    _decode_blocks(codes, dst, q, m, offsets, s, t, g0, factors[r])
                # Inline: as a call of its own this loop ran 3x slower (not vectorised).
                if r > 0:
                    for j in range(n):
                        acc[j] += part[j]
            if n_ranks > 1:
                for j in range(n):
                    acc[j] = acc[j] / div
            _encode_mean_blocks(acc, 0, g0, offsets, s, t, zero, d_out, out_codes, g0, p, lim)
            s = t

    @_njit
    def _reduce_rank_blocks4(recv, n_ranks, row, out, offsets, factors, d_out, cap, params, mine):
        """:func:`_reduce_rank_blocks` for packed 4-bit codes (the carry of
        :func:`_reduce_blocks4`); ``row`` in bytes."""
        q, m, p, lim = params
        own, own_row = mine
        acc = np.empty(cap + 1, np.float32)
        part = np.empty(cap + 1, np.float32)
        codes = np.empty(cap + 1, np.uint8)
        zero = np.zeros(len(offsets) - 1, np.int32)
        div = np.float32(n_ranks)
        carry = np.uint8(0)
        s = 0
        while s < len(offsets) - 1:
            t = _group_end(offsets, s, cap)
            g0, g1 = offsets[s], offsets[t]
            lo = g0 & 1
            hi = lo + g1 - g0
            b0, b1 = g0 >> 1, (g1 + 1) >> 1
            for r in range(n_ranks):
                dst = acc if r == 0 else part
                if r == own_row:
                    to, of = dst[lo : lo + g1 - g0], own[g0:g1]  # views from 0: vectorised
                    for j in range(g1 - g0):
                        to[j] = of[j]
                else:
                    payload = recv[r * row + b0 : r * row + b1]
                    _decode_blocks4(payload, dst, q, m, offsets, s, t, g0 - lo, factors[r])
                if r > 0:  # unsigned bounds: LLVM vectorises the loop (4x)
                    for j in range(_u64(lo), _u64(hi)):
                        acc[j] += part[j]
            if n_ranks > 1:
                for j in range(_u64(lo), _u64(hi)):
                    acc[j] = acc[j] / div
            _encode_mean_blocks(acc, lo, g0, offsets, s, t, zero, d_out, codes, lo, p, lim)
            codes[0] = carry if lo else codes[0]
            _pack(codes[:hi], out[b0:b1])
            carry = codes[hi - 1]
            s = t


if AVAILABLE:

    @_njit
    def _fill_grid(layers, block_size, lo, hi, first, out):
        # Blocks [first, first + n) of the layers' grid: block k of a layer from o
        # starts at o + k * block_size; from lo, clipped to [0, hi - lo].
        n = len(out) - 1
        out[n] = hi - lo if n else 0
        end, e0 = first + n, 0
        for layer in range(len(layers) - 1):
            if e0 >= end:
                break
            c = (layers[layer + 1] - layers[layer] + block_size - 1) // block_size
            b0, b1 = max(first, e0), min(end, e0 + c)
            start = layers[layer] + (b0 - e0) * block_size - lo
            starts = out[b0 - first : max(b0, b1) - first]  # a view from 0: vectorised (3x)
            for j in range(len(starts)):
                starts[j] = min(max(start + j * block_size, 0), hi - lo)
            e0 += c


def _block_offsets(offsets: np.ndarray | BlockGrid) -> np.ndarray:
    """A block kernel's offsets: an array as it is, or a grid's derived for this call
    (a plan keeps its blocks per layer, :class:`aps_comm.layout.BlockGrid`)."""
    if isinstance(offsets, np.ndarray):
        return offsets
    out = np.empty(offsets.n_blocks + 1, offsets.np_dtype)
    _fill_grid(offsets.layers, offsets.block_size, offsets.lo, offsets.hi, offsets.first, out)
    return out


def _mine(own: np.ndarray | None, own_row: int) -> tuple[np.ndarray, int]:
    """The owner kernels' ``mine``: ``(own, own_row)``, or no row where ``own`` is None."""
    return (_NO_OWN, -1) if own is None else (own, own_row)


def reduce_rank_blocks(
    recv: torch.Tensor,
    n_ranks: int,
    fmt: FloatFormat,
    offsets: np.ndarray,
    factors: np.ndarray,
    out: torch.Tensor,
    d: np.ndarray,
    limit: int,
    longest: int | None = None,
    own: np.ndarray | None = None,
    own_row: int = -1,
) -> None:
    """:func:`reduce_blocks` with every rank's own block factors, exponents from none.

    Row r of ``recv`` (``n_ranks`` equal rows, each rank's shard at its
    start, anything after it) is decoded times ``factors[r]`` (float32, one
    per block), the N values summed in float32 in rank order and divided by
    ``n_ranks``; each block of the mean gets the exponent of
    :func:`aps_comm.scaling.mean_exponents` with agreed exponents 0 (into
    ``d``) and is encoded times ``2**d`` into ``out``. Where ``own_row`` is
    a row, the float32 ``own`` (the shard's elements) is added in its place.
    """
    row = recv.numel() // n_ranks
    q, m = decoder_params(fmt)
    if longest is None:
        longest = int(np.diff(offsets).max()) if offsets.size > 1 else 0
    cap = max(_BLOCK, longest)
    args = (
        factors,
        d,
        cap,
        (q, m, encoder_params(fmt), mean_limit(fmt, limit)),
        _mine(own, own_row),
    )
    ra, oa = _np(recv), _np(out)
    if fmt.wire_bits == 4:
        _reduce_rank_blocks4(ra, n_ranks, row, oa, offsets, *args)
        return
    if fmt.wire_bits == 16:
        ra, oa = ra.view(np.uint16), oa.view(np.uint16)
    _reduce_rank_blocks(ra, n_ranks, ra.size // n_ranks, oa, offsets, *args)


if AVAILABLE:
    # two_phase with every rank's own block exponents, a chunk at a time: one
    # call sends all N shards, one makes this rank's owner step, one decodes
    # all N gathered shards. Each shard's blocks are segments of the group's
    # block ``offsets`` (``firsts[s]`` to ``firsts[s + 1]``), the factors come
    # from the one-byte keys through a 256-entry ``table``: no per-shard or
    # per-block work on the host (see aps_comm.transports.bind_blocks).

    @_njit
    def _most_blocks(firsts):
        most = 0
        for s in range(len(firsts) - 1):
            most = max(most, firsts[s + 1] - firsts[s])
        return most

    @_njit
    def _send_shards(x, keys, table, offsets, firsts, send, piece, p, bits, no_runs):
        """Every shard of a chunk encoded with its blocks' keys, each in its piece of ``send``."""
        most = _most_blocks(firsts)
        cut = np.empty(most + 1, np.int64)
        fac = np.empty(most, np.float32)
        for s in range(len(firsts) - 1):
            b0, b1 = firsts[s], firsts[s + 1]
            a, b = offsets[b0], offsets[b1]
            k = b1 - b0
            for j in range(k):
                fac[j] = table[keys[b0 + j]]
                cut[j] = offsets[b0 + j] - a
            cut[k] = b - a
            base = s * piece
            used = ((b - a) * bits + 7) // 8
            if b > a:
                if bits == 4:
                    _encode4(x[a:b], cut[: k + 1], fac[:k], send[base : base + used], p, 0, no_runs)
                elif bits == 16:
                    codes16 = send[base : base + used].view(np.uint16)
                    _encode_codes(x[a:b], cut[: k + 1], fac[:k], codes16, p, 0, no_runs)
                else:
                    codes = send[base : base + used]
                    _encode_codes(x[a:b], cut[: k + 1], fac[:k], codes, p, 0, no_runs)
            for i in range(base + used, base + piece):  # padding: code 0 is +0
                send[i] = 0

    @_njit
    def _send_rank_blocks(
        x, keys, table, offsets, firsts, send, piece, shard_bytes, head, p, bits, no_runs
    ):
        # The codes as with agreed keys; then each piece carries its blocks' keys.
        # ``head``: (flags, at, log2), the first chunk's layer flags and preference.
        flags, at, log2 = head
        _send_shards(x, keys, table, offsets, firsts, send, piece, p, bits, no_runs)
        for s in range(len(firsts) - 1):
            b0, b1 = firsts[s], firsts[s + 1]
            base = s * piece
            to, of = send[base + shard_bytes : base + shard_bytes + b1 - b0], keys[b0:b1]
            for j in range(b1 - b0):  # views from 0: vectorised (20x)
                to[j] = of[j]
            if at >= 0:
                for i in range(len(flags)):
                    send[base + at + i] = flags[i]
                if log2 >= 0:  # hierarchical's pieces carry no chunk byte
                    send[base + at + len(flags)] = log2

    @_njit
    def _owner_rank_blocks(
        recv, n_ranks, offsets, table, out, shard_bytes, head, d, cap, params, bits, mine
    ):
        # ``head``: (union, at), where the pieces' layer flags are OR-ed and where they lie.
        union, at = head
        piece = len(recv) // n_ranks
        k = len(offsets) - 1
        fac = np.empty((n_ranks, k), np.float32)
        for r in range(n_ranks):
            for j in range(k):
                fac[r, j] = table[recv[r * piece + shard_bytes + j]]
        log2 = 0
        if at >= 0:
            for i in range(len(union)):
                u = np.uint8(0)
                for r in range(n_ranks):
                    u |= recv[r * piece + at + i]
                union[i] = u
            for r in range(n_ranks):
                log2 = max(log2, np.int64(recv[r * piece + at + len(union)]))
        used = (offsets[k] * bits + 7) // 8
        if k:
            args = (recv, n_ranks, piece, out[:used], offsets, fac, d, cap, params)
            if bits == 4:
                _reduce_rank_blocks4(*args, mine)
            elif bits == 16:  # pieces of 4-byte multiples: rows of whole codes
                codes16, out16 = recv.view(np.uint16), out[:used].view(np.uint16)
                _reduce_rank_blocks(
                    codes16, n_ranks, piece // 2, out16, offsets, fac, d, cap, params, mine
                )
            else:
                _reduce_rank_blocks(*args, mine)
        for i in range(used, shard_bytes):
            out[i] = 0
        mean_keys = out[shard_bytes : shard_bytes + k]  # a view from 0: vectorised (8x)
        for j in range(k):  # the mean's keys (zero and non-finite blocks: d = 0)
            mean_keys[j] = 127 - d[j]
        for i in range(shard_bytes + k, len(out)):
            out[i] = 0
        return log2

    @_njit
    def _decode_rank_blocks(
        gathered, row, offsets, firsts, table, ends, union, x, shard_bytes, dec, bits, no_runs
    ):
        q, m = dec
        most = _most_blocks(firsts)
        cut, fac = np.empty(most + 1, np.int64), np.empty(most, np.float32)
        nan, layer = np.float32(np.nan), 0  # blocks in order: walk the layers' ends
        for s in range(len(firsts) - 1):
            b0, b1 = firsts[s], firsts[s + 1]
            a, b, k = offsets[b0], offsets[b1], b1 - b0
            if a == b:
                continue
            for j in range(k):
                while ends[layer] <= b0 + j:
                    layer += 1
                f = table[gathered[s * row + shard_bytes + j]]
                fac[j] = nan if union[layer] != 0 else f
                cut[j] = offsets[b0 + j] - a
            cut[k] = b - a
            payload = gathered[s * row : s * row + ((b - a) * bits + 7) // 8]
            if bits == 4:
                _decode4(payload, x[a:b], q, m, cut[: k + 1], fac[:k], 0, no_runs)
            elif bits == 16:
                codes16 = payload.view(np.uint16)
                _decode_segments(codes16, x[a:b], q, m, cut[: k + 1], fac[:k], 0, no_runs)
            else:
                _decode_segments(payload, x[a:b], q, m, cut[: k + 1], fac[:k], 0, no_runs)


def send_rank_blocks(
    fmt: FloatFormat,
    x: np.ndarray,
    keys: np.ndarray,
    table: np.ndarray,
    offsets: np.ndarray | BlockGrid,
    firsts: np.ndarray,
    send: np.ndarray,
    piece: int,
    shard_bytes: int,
    flags: np.ndarray,
    at: int,
    log2: int,
) -> None:
    """Encode every shard of a chunk into ``send`` with this rank's own block keys.

    Shard s (blocks ``firsts[s]`` to ``firsts[s + 1]`` of ``offsets``) goes
    to ``send[s * piece:]``: its codes times ``table[key]`` per block, zero
    padding to ``shard_bytes``, the blocks' ``keys``, and where ``at >= 0``
    (the first chunk) the layers' non-finite ``flags`` then ``log2`` (this
    rank's preferred chunk; none where negative) at ``at``. 4-, 8- and 16-bit formats.
    """
    offsets = _block_offsets(offsets)
    _send_rank_blocks(
        x,
        keys,
        table,
        offsets,
        firsts,
        send,
        piece,
        shard_bytes,
        (flags, at, log2),
        encoder_params(fmt),
        fmt.wire_bits,
        _NO_RUNS,
    )


def owner_rank_blocks(
    fmt: FloatFormat,
    limit: int,
    recv: np.ndarray,
    offsets: np.ndarray | BlockGrid,
    table: np.ndarray,
    out: np.ndarray,
    shard_bytes: int,
    at: int,
    union: np.ndarray,
    d: np.ndarray | None,
    longest: int,
    own: tuple[np.ndarray, int] | None = None,
) -> int:
    """This rank's owner step of a chunk sent by :func:`send_rank_blocks`; returns the
    ranks' largest preferred chunk (log2) where ``at >= 0``, else 0.

    ``recv`` holds N equal pieces, one per row; ``offsets`` are this rank's
    shard's blocks (from 0). Each piece's codes are decoded times ``table[key]`` of its
    sender's keys, summed in rank order and divided by N, and each block of
    the mean encoded with its own exponent ``d`` into ``out``: codes, zero
    padding to ``shard_bytes``, then ``127 - d`` per block (a key), zeros.
    Where ``at >= 0`` every rank's layer flags are OR-ed into ``union``.
    Where ``own`` is given (float32 values, a row), those values (this rank's
    own values of the shard) are added in that row's place, not rounded.
    ``d``: int32 scratch of a block each, or None for one made per call.
    """
    offsets = _block_offsets(offsets)
    if d is None:
        d = np.empty(max(offsets.size - 1, 0), np.int32)
    q, m = decoder_params(fmt)
    return _owner_rank_blocks(
        recv.reshape(-1),
        recv.shape[0],
        offsets,
        table,
        out,
        shard_bytes,
        (union, at),
        d,
        max(_BLOCK, longest),
        (q, m, encoder_params(fmt), mean_limit(fmt, limit)),
        fmt.wire_bits,
        (_NO_OWN, -1) if own is None else own,
    )


def decode_rank_blocks(
    fmt: FloatFormat,
    gathered: np.ndarray,
    n_ranks: int,
    offsets: np.ndarray | BlockGrid,
    firsts: np.ndarray,
    table: np.ndarray,
    layer_ends: np.ndarray,
    union: np.ndarray,
    x: np.ndarray,
    shard_bytes: int,
    flag_rows: np.ndarray | None = None,
) -> None:
    """Decode every owner's gathered shard of a chunk into ``x`` with the keys it sent.

    Row s of ``gathered`` (N equal rows) is shard s's codes, then at
    ``shard_bytes`` its blocks' keys; a block whose layer is flagged in
    ``union`` decodes to NaN. ``layer_ends`` (one per layer: the cumulative
    blocks per layer) finds each block's layer as the blocks are walked, so
    no per-block index of layers is kept. Where ``flag_rows`` (2-D uint8: every rank's
    layer flags) is given, their OR is written into ``union`` first, in the same call.
    """
    offsets = _block_offsets(offsets)
    q, m = decoder_params(fmt)
    args = (gathered, gathered.size // n_ranks, offsets, firsts, table, layer_ends)
    rest = (x, shard_bytes, (q, m), fmt.wire_bits, _NO_RUNS)
    if flag_rows is None:
        _decode_rank_blocks(*args, union, *rest)
    else:
        _or_decode_rank_blocks((flag_rows, union), *args, *rest)


if AVAILABLE:

    @_njit
    def _or_decode_rank_blocks(
        ors, gathered, row, offsets, firsts, table, ends, x, shard_bytes, dec, bits, no_runs
    ):
        rows, union = ors
        _or_rows(rows, union)
        _decode_rank_blocks(
            gathered, row, offsets, firsts, table, ends, union, x, shard_bytes, dec, bits, no_runs
        )


if AVAILABLE:
    # The first level of hierarchical and grid with every owner's own block
    # exponents: the node's mean of this rank's slice, from its L copies (see
    # aps_comm.transports.bind_node_blocks' torch-op fallback).

    @_njit
    def _mean_rank_blocks(
        recv, n_ranks, piece, offsets, table, out, shard_bytes, cap, dec, bits, mine
    ):
        q, m = dec
        own, own_row = mine
        k = len(offsets) - 1
        fac = np.empty((n_ranks, k), np.float32)
        for r in range(n_ranks):
            for j in range(k):
                fac[r, j] = table[recv[r * piece + shard_bytes + j]]
        acc = np.empty(cap + 1, np.float32)
        part = np.empty(cap + 1, np.float32)
        div = np.float32(n_ranks)
        s = 0
        while s < k:
            t = _group_end(offsets, s, cap)
            g0, g1 = offsets[s], offsets[t]
            lo = g0 & 1 if bits == 4 else 0  # 4-bit: a group may start at an odd nibble
            hi = lo + g1 - g0
            for r in range(n_ranks):
                dst = acc if r == 0 else part
                if r == own_row:
                    to, of = dst[lo : lo + g1 - g0], own[g0:g1]  # views from 0: vectorised
                    for j in range(g1 - g0):
                        to[j] = of[j]
                elif bits == 4:
                    payload = recv[r * piece + (g0 >> 1) : r * piece + ((g1 + 1) >> 1)]
                    _decode_blocks4(payload, dst, q, m, offsets, s, t, g0 - lo, fac[r])
                elif bits == 16:
                    codes16 = recv[r * piece + 2 * g0 : r * piece + 2 * g1].view(np.uint16)
                    _decode_blocks(codes16, dst, q, m, offsets, s, t, g0, fac[r])
                else:
                    codes = recv[r * piece + g0 : r * piece + g1]
                    _decode_blocks(codes, dst, q, m, offsets, s, t, g0, fac[r])
                if r > 0:  # rank order, as aps_comm.simulate sums
                    for j in range(_u64(lo), _u64(hi)):  # unsigned: vectorised
                        acc[j] += part[j]
            mean = out[g0 - lo : g0 - lo + hi]
            for j in range(_u64(lo), _u64(hi)):
                mean[j] = acc[j] / div
            s = t

    @_njit
    def _sum_rows(rows, out):
        n = rows.shape[0]
        for j in range(rows.shape[1]):
            out[j] = rows[0, j]
        for r in range(1, n):
            for j in range(rows.shape[1]):
                out[j] += rows[r, j]

    @_njit
    def _mean_rows(rows, out):
        _sum_rows(rows, out)  # rows in order, as simulate sums
        div = np.float32(rows.shape[0])
        for j in range(rows.shape[1]):
            out[j] = out[j] / div

    @_njit
    def _or_rows(rows, out):
        for i in range(rows.shape[1]):
            u = np.uint8(0)
            for r in range(rows.shape[0]):
                u |= rows[r, i]
            out[i] = u


def mean_rank_blocks(
    fmt: FloatFormat,
    recv: np.ndarray,
    n_ranks: int,
    offsets: np.ndarray,
    table: np.ndarray,
    out: np.ndarray,
    shard_bytes: int,
    longest: int,
    own: np.ndarray | None = None,
    own_row: int = -1,
) -> None:
    """The float32 mean of ``n_ranks`` pieces sent by :func:`send_rank_blocks`, into ``out``.

    ``recv`` holds N equal pieces of the same elements (blocks at ``offsets``,
    from 0): each piece's codes are decoded times ``table[key]`` of its
    sender's keys (at ``shard_bytes``), summed in float32 in rank order and
    divided by N: :func:`owner_rank_blocks`' mean, kept instead of encoded.
    4-, 8- and 16-bit formats; ``longest``: the longest block's elements. Where
    ``own_row`` is a piece, the float32 ``own`` is added in its place.

    Example:
        >>> mean_rank_blocks(E4M3, recv, 2, offsets, table, out, 64, 16)  # doctest: +SKIP
    """
    q, m = decoder_params(fmt)
    _mean_rank_blocks(
        recv,
        n_ranks,
        recv.size // n_ranks,
        offsets,
        table,
        out,
        shard_bytes,
        max(_BLOCK, longest),
        (q, m),
        fmt.wire_bits,
        _mine(own, own_row),
    )


def mean_rows(rows: np.ndarray, out: np.ndarray) -> None:
    """The mean of the rows of a 2-D float32 array into ``out``: summed in float32 in row
    order, then divided by their number (the same bits as ``+=`` row by row, then ``/``).

    Example:
        >>> out = np.empty(2, np.float32)
        >>> mean_rows(np.array([[1, 2], [2, 3]], np.float32), out)
        >>> out
        array([1.5, 2.5], dtype=float32)
    """
    _mean_rows(rows, out)


def sum_rows(rows: np.ndarray, out: np.ndarray) -> None:
    """The sum of the rows of a 2-D float32 array into ``out``, in float32 in row order
    (the same bits as ``+=`` row by row): an FSDP unit's reduce-scatter result.

    Example:
        >>> out = np.empty(2, np.float32)
        >>> sum_rows(np.array([[1, 2], [2, 3]], np.float32), out)
        >>> out
        array([3., 5.], dtype=float32)
    """
    _sum_rows(rows, out)


def reduce_encode(
    source: torch.Tensor,
    n_rows: int,
    acc: torch.Tensor,
    divisor: int,
    numel: int,
    out: torch.Tensor,
    fmt: FloatFormat,
    offsets: np.ndarray | BlockGrid,
    factors: np.ndarray,
    block_size: int | None = None,
    runs: np.ndarray | None = None,
    scratch: np.ndarray | None = None,
) -> None:
    """The staged routes' sum then encode, in one call: :func:`sum_rows` of float32
    ``source`` (``n_rows`` rows) into ``acc``, or of uint8 ``source`` decoded into float32
    ``scratch`` (``n_rows`` payloads of ``acc``'s elements, unscaled) and divided by
    ``divisor``, then ``acc[:numel]`` times ``factors`` encoded into
    ``out`` (:func:`encode`), its bytes after the codes zeroed (code 0 is +0): the bits of
    those calls in turn.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> out, acc = torch.empty(2, dtype=torch.uint8), torch.empty(2)
        >>> reduce_encode(torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, acc, 0, 2, out,
        ...               E4M3, np.array([0, 2]), np.full(1, 0.5, np.float32))
        >>> acc.tolist(), out.tolist()
        ([4.0, 6.0], [64, 68])
    """
    a, oa, width = _np(acc), _np(out), acc.numel()
    head = (numel * fmt.wire_bits + 7) // 8
    enc = (_block_offsets(offsets), factors, encoder_params(fmt), *_runs(block_size, runs))
    if source.dtype == torch.float32:
        payload, values, div = oa[:0], _np(source), np.float32(0.0)
    else:
        assert scratch is not None and scratch.size >= n_rows * width
        payload, values, div = _np(source), scratch[: n_rows * width], np.float32(divisor)
    dec = (*decoder_params(fmt), *_whole(n_rows * width), 0, _NO_RUNS)
    rows = values.reshape(n_rows, width)
    if fmt.wire_bits == 4:
        _reduce_encode4(payload, dec, values, rows, a, div, a[:numel], oa, head, enc)
    else:
        codes = oa[:head] if fmt.wire_bits == 8 else oa[:head].view(np.uint16)
        if fmt.wire_bits == 16:
            payload = payload.view(np.uint16)
        _reduce_encode_codes(payload, dec, values, rows, a, div, a[:numel], oa, head, enc, codes)


if AVAILABLE:

    @_njit
    def _reduce_rows(payload, dec, values, rows, acc, div, four):
        """``rows`` (a view of ``values``) summed into ``acc`` in row order, decoded from
        ``payload`` first and divided by ``div`` where ``div`` is not 0."""
        q, m, offsets, factors, size, runs = dec
        if len(payload):
            if four:
                _decode4(payload, values, q, m, offsets, factors, size, runs)
            else:
                _decode_segments(payload, values, q, m, offsets, factors, size, runs)
        _sum_rows(rows, acc)
        if div != 0:
            for j in range(rows.shape[1]):
                acc[j] = acc[j] / div

    @_njit
    def _reduce_encode4(payload, dec, values, rows, acc, div, x, out, head, enc):
        _reduce_rows(payload, dec, values, rows, acc, div, True)
        out[head:] = 0
        offsets, factors, p, size, runs = enc
        _encode4(x, offsets, factors, out[:head], p, size, runs)

    @_njit
    def _reduce_encode_codes(payload, dec, values, rows, acc, div, x, out, head, enc, codes):
        _reduce_rows(payload, dec, values, rows, acc, div, False)
        out[head:] = 0
        offsets, factors, p, size, runs = enc
        _encode_codes(x, offsets, factors, codes, p, size, runs)


if AVAILABLE:

    @_njit
    def _node_send(rows, mean, offsets, maxima, keys, rule, send_args):
        if rows.shape[0]:
            _mean_rows(rows, mean)
        _block_amax(mean.view(np.uint32), offsets, maxima.view(np.uint32))
        _two_phase_keys(maxima.view(np.uint32), keys, rule[0], rule[1])
        table, firsts, send, piece, shard_bytes, head, p, bits, no_runs = send_args
        _send_rank_blocks(
            mean, keys, table, offsets, firsts, send, piece, shard_bytes, head, p, bits, no_runs
        )


def node_send(
    fmt: FloatFormat,
    rows: np.ndarray,
    mean: np.ndarray,
    blocks: tuple[np.ndarray, np.ndarray],
    maxima: np.ndarray,
    keys: np.ndarray,
    rule: tuple[int, int],
    table: np.ndarray,
    send: np.ndarray,
    shard_bytes: int,
    head: tuple[np.ndarray, int],
) -> None:
    """A staged chunk's step across nodes with every rank's own block exponents, in one
    call: the node's :func:`mean_rows` of float32 ``rows`` into ``mean`` (none where
    ``rows`` has no row: grid's mean is :func:`mean_rank_blocks`'), its blocks'
    (``blocks``: offsets, then each piece's first block) maxima and keys under two_phase's
    rule (``rule``: the exponent limit and the ranks' bound, :func:`two_phase_keys`'), then
    :func:`send_rank_blocks` of it (``head``: the layer flags and where they go, no chunk
    byte): the bits of those calls in turn."""
    offsets, firsts = blocks
    flags, at = head
    piece = send.size // (firsts.size - 1)
    send_args = (table, firsts, send, piece, shard_bytes, (flags, at, -1))
    send_args += (encoder_params(fmt), fmt.wire_bits, _NO_RUNS)
    limit, ranks = rule
    bound = ranks if fmt.max * ranks > np.finfo(np.float32).max else 0
    keys_rule = (mean_limit(fmt, limit), bound)
    _node_send(rows, mean, offsets, maxima, keys, keys_rule, send_args)


def or_rows(rows: np.ndarray, out: np.ndarray) -> None:
    """The bitwise OR of the rows of a 2-D uint8 array (a view of the rows' flag bytes)
    into ``out``.

    Example:
        >>> out = np.empty(2, np.uint8)
        >>> or_rows(np.array([[1, 0], [0, 2]], np.uint8), out)
        >>> out
        array([1, 2], dtype=uint8)
    """
    _or_rows(rows, out)


if AVAILABLE:

    @_njit
    def _sum_exponent(a, n_ranks, limit):
        """The largest e in [-limit, limit] with ``n_ranks * a * 2**e`` at most float32's
        max (``a``: finite non-zero float32 bits): the owner's FP32 sum's bound, exact
        in float64 as :func:`aps_comm.scaling.exponents` finds it."""
        mv, ev = math.frexp(np.float64(_u2f(a)) * n_ranks)
        e = 128 - ev if mv <= 1.0 - 2.0**-24 else 127 - ev  # float32's max: (1 - 2**-24) * 2**128
        return min(max(e, -limit), limit)

    @_njit
    def _two_phase_keys(ab, out, lim, n_ranks):
        """One-byte exponent keys of float32 maxima bits ``ab`` (non-negative, NaN as inf);
        ``n_ranks`` > 0: the FP32 sum of that many binds the exponent too."""
        inf_bits = np.uint32(0x7F800000)
        for i in range(len(ab)):
            a = ab[i]
            if a == 0:
                out[i] = 0
            elif a >= inf_bits:
                out[i] = 255
            elif n_ranks > 0:
                out[i] = 127 - min(_mean_exponent(a, 0, lim), _sum_exponent(a, n_ranks, lim[2]))
            else:
                out[i] = 127 - _mean_exponent(a, 0, lim)


def two_phase_keys(
    amax: torch.Tensor, fmt: FloatFormat, limit: int, out: torch.Tensor, world_size: int = 1
) -> None:
    """:func:`aps_comm.scaling.exponent_keys` of two_phase maxima over ``world_size`` ranks.

    ``amax``: contiguous float32 maxima (>= 0, NaN given as inf); ``out``: uint8,
    as many: 0 for a zero maximum, 255 for inf, else ``127 - e`` with ``e``
    the largest exponent in [-``limit``, ``limit``] with ``amax * 2**e <= fmt.max``
    and, where ``fmt.max`` times the ranks passes float32's max (bf16), the ranks'
    FP32 sum of such values within it.
    """
    bound = world_size if fmt.max * world_size > np.finfo(np.float32).max else 0
    _two_phase_keys(_np(amax).view(np.uint32), _np(out), mean_limit(fmt, limit), bound)


if AVAILABLE:

    @_njit
    def _layer_any(keys, counts, value, out):
        """out[l] = 1 where any of layer l's ``counts[l]`` keys (in order) is ``value``."""
        start = 0
        for layer in range(len(counts)):
            stop = start + counts[layer]
            hit = np.uint8(0)
            # No early exit and unsigned bounds: the loop vectorises (7x).
            for i in range(_u64(start), _u64(stop)):
                hit |= keys[i] == value
            out[layer] = hit
            start = stop


def layer_any(keys: torch.Tensor, counts: torch.Tensor, value: int, out: torch.Tensor) -> None:
    """Per layer, 1 (into uint8 ``out``) where any of its blocks' uint8 ``keys`` is ``value``.

    ``keys``: contiguous, the layers' blocks in order; ``counts``: int64
    blocks per layer (summing to ``keys.numel()``).
    """
    _layer_any(_np(keys), _np(counts), np.uint8(value), _np(out))


if AVAILABLE:

    @_njit
    def _block_keys(xb, offsets, counts, maxima, keys, flags, lim, n_ranks):
        _block_amax(xb, offsets, maxima)
        _two_phase_keys(maxima, keys, lim, n_ranks)
        _layer_any(keys, counts, np.uint8(255), flags)


def block_keys(
    fmt: FloatFormat,
    x: torch.Tensor,
    offsets: np.ndarray | BlockGrid,
    counts: torch.Tensor,
    maxima: torch.Tensor,
    keys: torch.Tensor,
    flags: torch.Tensor,
    limit: int,
    world_size: int,
    records: torch.Tensor | None = None,
    gather: tuple[torch.Tensor, np.ndarray, torch.Tensor, int] | None = None,
) -> None:
    """:func:`block_amax`, :func:`two_phase_keys` and :func:`layer_any` (value 255) in one
    call: every block's max |x| into float32 ``maxima``, its two_phase key over
    ``world_size`` ranks into uint8 ``keys``, each layer's non-finite flag (``counts``:
    blocks per layer) into uint8 ``flags``: a settled bucket's keys, one call per step.
    With float64 ``records`` (layers, 5), :func:`block_records` of those keys and maxima
    too, in the same call (``stats=True``: one call per group, not two). With
    ``gather`` (float32 source, int64 spans, float32 values, divisor: :func:`gather_add`'s,
    with no residuals and no maxima), that gather first, in the same call: where a
    bucket's format groups interleave, the layers copied into their groups' order (``x``
    one group's part of the values) with its first group's keys.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> m, k, f = torch.empty(2), torch.empty(2, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
        >>> block_keys(E4M3, torch.tensor([3.0, float("nan")]), np.array([0, 1, 2]),
        ...            torch.tensor([2]), m, k, f, 126, 1)
        >>> k.tolist(), f.tolist()
        ([120, 255], [1])
    """
    offsets = _block_offsets(offsets)
    bound = world_size if fmt.max * world_size > float(np.finfo(np.float32).max) else 0
    args = (_np(x).view(np.uint32), offsets, _np(counts), _np(maxima).view(np.uint32))
    args += (_np(keys), _np(flags), mean_limit(fmt, limit), bound)
    if records is None and gather is None:
        _block_keys(*args)
        return
    tiny = np.float32(fmt.min_subnormal / 2)
    rows = _np(records) if records is not None else np.empty((0, 5))
    source = to = np.empty(0, np.float32)
    spans, divisor = np.empty((0, 5), np.int64), 1
    if gather is not None:
        bucket, spans, values, divisor = gather
        source, to = _np(bucket), _np(values)
    bits = to.view(np.uint32)
    gathered = (source, spans, source[:0], to, bits, bits[:0], np.float32(divisor))
    _block_keys_records(gathered, args, (_np(x), _np(maxima), tiny, np.float32(fmt.max), rows))


if AVAILABLE:

    @_njit
    def _largest_exponent(p, lim):
        """Largest integer e with float64 ``p * 2**e <= lim`` (both positive, finite): exact,
        from their frexp fields."""
        mp, ep = math.frexp(p)
        ml, el = math.frexp(lim)
        return el - ep - (1 if mp > ml else 0)

    @_njit
    def _maxima_keys(ab, out, n_ranks, native, fmax, limit, p, q, m):
        """int32 exponent keys of float32 maxima bits ``ab`` (non-negative, NaN as inf)."""
        inf_bits = np.uint32(0x7F800000)
        f32max = 3.4028234663852886e38
        n = np.float64(n_ranks)
        for s in range(len(ab)):
            a_bits = ab[s]
            if a_bits == 0:
                out[s] = 0
                continue
            if a_bits >= inf_bits:
                out[s] = 255
                continue
            a = np.float64(_u2f(np.uint32(a_bits)))
            if native:
                e = _largest_exponent(a * n, fmax)
                v = np.float32(math.ldexp(a, e))
                r = np.float64(_code_value(_code(_f2u(v), p), q, m))
                if r * n > fmax:
                    e -= 1
            else:
                e = min(_largest_exponent(a, fmax), _largest_exponent(a * n, f32max))
            e = min(max(e, -limit), limit)
            out[s] = 127 - e


def maxima_factors(
    maxima: np.ndarray,
    fmt: FloatFormat,
    world_size: int,
    native: bool,
    limit: int,
    unscale: bool,
) -> np.ndarray:
    """The factors of agreed float32 maxima: :func:`aps_comm.scaling.factors`' ``scale``
    (or with ``unscale`` its ``unscale``) for route "allreduce" where ``native``, else
    "two_phase", in two calls, for the CPU kernels.

    Exponents come from float64 products that are exact and from frexp
    fields instead of logarithms; a non-finite maximum unscales to NaN.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> maxima_factors(np.array([3.0, 0.0, np.inf], np.float32), E4M3, 4, False, 126, True)
        array([0.0078125, 1.       ,       nan], dtype=float32)
    """
    q, m = decoder_params(fmt)
    keys = np.empty(len(maxima), np.int32)
    bits = np.ascontiguousarray(maxima, np.float32).view(np.uint32)
    _maxima_keys(bits, keys, world_size, native, float(fmt.max), limit, encoder_params(fmt), q, m)
    return key_factors(keys, unscale, world_size if native and unscale else 1)


def underflow_rates(
    x: torch.Tensor,
    offsets: np.ndarray,
    factors: np.ndarray,
    half: float,
    out: np.ndarray,
    at: np.ndarray | None = None,
) -> None:
    """Each segment's underflowing over nonzero elements of float32 ``x`` times its
    ``factors``, as float32 into ``out``: :func:`aps_comm.telemetry.layer_counts`' rate
    (scaled magnitude nonzero and at most ``half``, half the smallest subnormal).
    With int64 ``at``, segment s's rate goes to ``out[at[s]]`` (a bucket's order, where
    its format groups interleave), else to ``out[s]``.

    Example:
        >>> out = np.empty(2, np.float32)
        >>> underflow_rates(torch.tensor([1.0, 1e-9, 0.0, 4.0]), np.array([0, 3, 4]),
        ...                 np.ones(2, np.float32), 2.0**-10, out)
        >>> out
        array([0.5, 0. ], dtype=float32)
    """
    _underflow_rates(_np(x), offsets, factors, np.float32(half), out, _at(at))


def _at(at: np.ndarray | None) -> np.ndarray:
    """Where a kernel writes each segment's rate: empty for its own slot."""
    return np.empty(0, np.int64) if at is None else at


if AVAILABLE:

    @_njit
    def _underflow_rates(x, offsets, factors, half, out, at):
        for s in range(len(offsets) - 1):
            f = factors[s]
            nonzero = 0
            under = 0
            # Unsigned bounds and no branch: LLVM vectorises the count (6x faster).
            for i in range(_u64(offsets[s]), _u64(offsets[s + 1])):
                mag = abs(x[i]) * f  # float32, as torch multiplies
                nonzero += mag > 0
                under += (mag > 0) & (mag <= half)
            out[at[s] if len(at) else s] = np.float32(under) / np.float32(max(nonzero, 1))


def spread_maximum(maxima: np.ndarray) -> None:
    """Every finite, nonzero float32 maximum (all non-negative) replaced by the largest
    of them, in place: ``scaling="bucket"``'s maxima, for the layer rule.

    Example:
        >>> m = np.array([3.0, 0.0, 5.0, np.inf], np.float32)
        >>> spread_maximum(m)
        >>> m
        array([ 5.,  0.,  5., inf], dtype=float32)
    """
    _spread_maximum(maxima.view(np.uint32))


if AVAILABLE:

    @_njit
    def _pick_maxima(source, index, out, work, spread):
        """out = source[index], copied into ``work`` too and there spread where ``spread``."""
        for j in range(len(index)):
            out[j] = source[index[j]]
            work[j] = out[j]
        if spread:
            _spread_maximum(work)

    @_njit
    def _spread_maximum(ab):
        """:func:`spread_maximum` on the maxima's bits (non-negative: bits order as values)."""
        inf_bits = np.uint32(0x7F800000)
        top = np.uint32(0)
        for s in range(len(ab)):
            if top < ab[s] < inf_bits:
                top = ab[s]
        for s in range(len(ab)):
            if 0 < ab[s] < inf_bits:
                ab[s] = top


def maxima_factors_into(
    maxima: np.ndarray,
    fmt: FloatFormat,
    world_size: int,
    native: bool,
    limit: int,
    scale: np.ndarray,
    unscale: np.ndarray,
    keys: np.ndarray,
    pick: tuple[np.ndarray, np.ndarray, bool] | None = None,
) -> None:
    """:func:`maxima_factors`' scale and unscale both, written into float32 ``scale`` and
    ``unscale`` through int32 scratch ``keys`` (all as long as ``maxima``): a settled
    bucket refills the arrays its bound kernels read, with no allocation.

    ``pick``: (``source``, int64 ``index``, ``spread``): ``maxima`` is first written
    with ``source[index]`` (a format group's layers of a bucket's agreed maxima), and
    the factors are those of their :func:`spread_maximum` where ``spread``
    (``maxima`` keeps the maxima as picked: the records').

    Example:
        >>> from aps_comm.formats import E4M3
        >>> s, u, k = np.empty(2, np.float32), np.empty(2, np.float32), np.empty(2, np.int32)
        >>> maxima_factors_into(np.array([3.0, 0.0], np.float32), E4M3, 4, False, 126, s, u, k)
        >>> s, u
        (array([128.,   1.], dtype=float32), array([0.0078125, 1.       ], dtype=float32))
    """
    q, m = decoder_params(fmt)
    bits = maxima.view(np.uint32)
    if pick is not None:  # the spread goes into ``scale``, free until the factors
        bits = scale.view(np.uint32)
        _pick_maxima(pick[0].view(np.uint32), pick[1], maxima.view(np.uint32), bits, pick[2])
    _maxima_keys(
        bits,
        keys,
        world_size,
        native,
        float(fmt.max),
        limit,
        encoder_params(fmt),
        q,
        m,
    )
    _key_factors(keys, scale, False, 1)
    _key_factors(keys, unscale, True, world_size if native else 1)


def staged_factors_into(
    maxima: np.ndarray,
    fmt: FloatFormat,
    world_size: int,
    ranks_per_node: int,
    grid: bool,
    limit: int,
    out: np.ndarray,
    pick: tuple[np.ndarray, np.ndarray, bool] | None = None,
) -> None:
    """The staged routes' factors of agreed float32 maxima, written into the rows of
    float32 ``out`` (4 x segments): :func:`aps_comm.scaling.factors`' ``scale``,
    ``shift``, ``unscale`` and ``first`` (1 for hierarchical) for route "grid" where
    ``grid``, else "hierarchical", with ``ranks_per_node`` L of ``world_size`` N.

    Exponents as :func:`maxima_factors_into`'s: exact float64 products and frexp
    fields; a non-finite maximum unscales to NaN. ``pick`` as
    :func:`maxima_factors_into`'s (the spread made in ``out``'s unscale row, which each
    column reads before it is written).

    Example:
        >>> from aps_comm.formats import E4M3
        >>> out = np.empty((4, 2), np.float32)
        >>> staged_factors_into(np.array([3.0, np.inf], np.float32), E4M3, 4, 2, False, 126, out)
        >>> out
        array([[6.4000e+01, 1.0000e+00],
               [2.0000e+00, 1.0000e+00],
               [7.8125e-03,        nan],
               [1.0000e+00, 1.0000e+00]], dtype=float32)
    """
    bits = maxima.view(np.uint32)
    if pick is not None:
        bits = out[2].view(np.uint32)
        _pick_maxima(pick[0].view(np.uint32), pick[1], maxima.view(np.uint32), bits, pick[2])
    _staged_factors(bits, world_size, ranks_per_node, grid, float(fmt.max), limit, out)


if AVAILABLE:

    @_njit
    def _pow2_f32(d):
        """float32 2**d for an integer d, clamped to [-149, 127] as :func:`aps_comm.formats.pow2`."""
        return _u2f(_pow2_bits(min(max(d, -149), 127)))

    @_njit
    def _staged_exponents(a_bits, n_ranks, per_node, fmax, limit):
        """(inner, outer) exponents of a finite non-zero maximum's float32 bits."""
        f32max = 3.4028234663852886e38
        a = np.float64(_u2f(np.uint32(a_bits)))
        # The node sums add L gradients (headroom L, M of them summed in FP32);
        # the mean sent back needs none (N summed).
        h = a * np.float64(per_node)
        nodes = np.float64(n_ranks // per_node)
        inner = min(_largest_exponent(h, fmax), _largest_exponent(h * nodes, f32max))
        outer = min(_largest_exponent(a, fmax), _largest_exponent(a * n_ranks, f32max))
        return min(max(inner, -limit), limit), min(max(outer, -limit), limit)

    @_njit
    def _staged_row(inner, outer, grid, bad, out, s):
        """Column ``s`` of the staged factors' rows (scale, shift, unscale, first)."""
        if grid:
            out[0, s] = _pow2_f32(inner - outer)
            out[3, s] = _pow2_f32(outer)
        else:
            out[0, s] = _pow2_f32(inner)
            out[3, s] = np.float32(1.0)
        out[1, s] = _pow2_f32(outer - inner)
        out[2, s] = np.float32(np.nan) if bad else _pow2_f32(-outer)

    @_njit
    def _staged_factors(ab, n_ranks, per_node, grid, fmax, limit, out):
        inf_bits = np.uint32(0x7F800000)
        for s in range(len(ab)):
            a_bits = ab[s]
            inner = 0
            outer = 0
            if 0 < a_bits < inf_bits:
                inner, outer = _staged_exponents(a_bits, n_ranks, per_node, fmax, limit)
            _staged_row(inner, outer, grid, a_bits >= inf_bits, out, s)

    @_njit
    def _staged_keys(xb, offsets, maxima, keys, n_ranks, per_node, fmax, limit):
        _block_amax(xb, offsets, maxima)
        inf_bits = np.uint32(0x7F800000)
        n = len(maxima)
        for s in range(n):
            a_bits = maxima[s]
            if a_bits == 0:
                keys[s] = keys[n + s] = 0
            elif a_bits >= inf_bits:
                keys[s] = keys[n + s] = 255
            else:
                inner, outer = _staged_exponents(a_bits, n_ranks, per_node, fmax, limit)
                keys[s], keys[n + s] = 127 - inner, 127 - outer

    @_njit
    def _staged_key_factors(keys, counts, grid, out):
        n, start = out.shape[1], 0
        for layer in range(len(counts)):
            stop = start + counts[layer]
            bad = False
            # Views from 0 and no branch (``|``, not ``or``): vectorised (20x).
            inner_keys, outer_keys = keys[start:stop], keys[n + start : n + stop]
            for s in range(stop - start):
                bad |= (inner_keys[s] == 255) | (outer_keys[s] == 255)
            for s in range(start, stop):
                k0, k1 = np.int64(keys[s]), np.int64(keys[n + s])
                inner = 0 if k0 == 0 or k0 == 255 else 127 - k0
                outer = 0 if k1 == 0 or k1 == 255 else 127 - k1
                _staged_row(inner, outer, grid, bad, out, s)
            start = stop


def staged_keys(
    fmt: FloatFormat,
    x: torch.Tensor,
    offsets: np.ndarray | BlockGrid,
    maxima: torch.Tensor,
    keys: torch.Tensor,
    world_size: int,
    ranks_per_node: int,
    limit: int,
) -> None:
    """Every block's max |x| into float32 ``maxima`` and its staged routes' exponent keys
    (:func:`aps_comm.scaling.exponent_keys` for "hierarchical" or "grid": the inner row,
    then the outer) into uint8 ``keys`` (2 x blocks, flat): a settled staged bucket's
    agreed block keys, one call per step.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> m, k = torch.empty(2), torch.empty(4, dtype=torch.uint8)
        >>> staged_keys(E4M3, torch.tensor([3.0, 0.0]), np.array([0, 1, 2]), m, k, 4, 2, 126)
        >>> k.tolist()
        [121, 0, 120, 0]
    """
    _staged_keys(
        _np(x).view(np.uint32),
        _block_offsets(offsets),
        _np(maxima).view(np.uint32),
        _np(keys),
        world_size,
        ranks_per_node,
        float(fmt.max),
        limit,
    )


def staged_key_factors(
    keys: torch.Tensor, counts: torch.Tensor, grid: bool, out: torch.Tensor
) -> None:
    """The staged routes' factors of agreed block keys (:func:`staged_keys`' layout), into
    the rows of float32 ``out`` (4 x blocks: scale, shift, unscale, first), as
    :func:`aps_comm.scaling.factors_from_keys` makes them: a key of 255 in either row
    unscales every block of its layer (``counts``: blocks per layer) to NaN.

    Example:
        >>> out = torch.empty(4, 2)
        >>> keys = torch.tensor([121, 255, 120, 255], dtype=torch.uint8)
        >>> staged_key_factors(keys, torch.tensor([1, 1]), False, out)
        >>> out[:, 0].tolist(), out[2, 1].item()
        ([64.0, 2.0, 0.0078125, 1.0], nan)
    """
    _staged_key_factors(_np(keys), _np(counts), grid, _np(out))


if AVAILABLE:

    @_njit
    def _key_factors(keys, out, unscale, divisor):
        """float32 factors of int32 exponent keys (see :func:`key_factors`)."""
        for i in range(len(keys)):
            k = keys[i]
            e = 0 if k == 0 or k == 255 else 127 - k
            if unscale:  # 2**-e from its bits (exact, subnormals too), as ldexp's
                f = _u2f(_pow2_bits(-e))
                if divisor != 1:
                    f = f / np.float32(divisor)  # float32 operands: one IEEE division
                out[i] = np.float32(np.nan) if k == 255 else f
            else:
                out[i] = _u2f(_pow2_bits(e))


def key_factors(keys: np.ndarray, unscale: bool, divisor: int = 1) -> np.ndarray:
    """float32 ``2**e`` (or with ``unscale`` ``2**-e / divisor``, NaN for key 255) of int32
    exponent keys (:func:`maxima_factors`' last step), for the CPU kernels.

    Example:
        >>> key_factors(np.array([120, 0, 255], np.int32), True, 4)
        array([0.00195312, 0.25      ,        nan], dtype=float32)
    """
    out = np.empty(len(keys), np.float32)
    _key_factors(keys, out, unscale, divisor)
    return out


def layer_records(
    x: torch.Tensor,
    offsets: np.ndarray,
    maxima: torch.Tensor,
    keys: np.ndarray,
    fmt: FloatFormat,
    out: torch.Tensor,
    rates: torch.Tensor | None = None,
    at: np.ndarray | None = None,
) -> None:
    """Every segment's record row into float64 ``out`` (L, 5), in one pass over ``x``.

    Row s: the exponent of int32 key ``keys[s]`` (:func:`maxima_factors_into`'s
    scratch: 0 for a zero or non-finite maximum), ``maxima[s]``, and of the
    float32 ``x``'s elements of segment s scaled by ``2**e``, how many are
    nonzero, how many of those are at most half ``fmt``'s smallest subnormal
    (they flush to zero), how many pass ``fmt.max``: the counts of
    :func:`aps_comm.telemetry.layer_counts`, the same float32 products. With float32
    ``rates``, each segment's underflowing over nonzero count into it too:
    :func:`underflow_rates` under ``2**e`` (Promote's rates, from the same pass), at
    ``at`` as there.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> out = torch.empty(1, 5, dtype=torch.float64)
        >>> x = torch.tensor([1.0, 1e-9, 0.0, 500.0])
        >>> layer_records(x, np.array([0, 4]), torch.tensor([500.0]), np.array([127], np.int32),
        ...               E4M3, out)
        >>> out.tolist()
        [[0.0, 500.0, 3.0, 1.0, 1.0]]
    """
    tiny = np.float32(fmt.min_subnormal / 2)
    rated = _np(rates) if rates is not None else np.empty(0, np.float32)
    records = (tiny, np.float32(fmt.max), _np(out), rated, _at(at))
    _layer_records(_np(x), offsets, _np(maxima), keys, *records)


def block_records(
    x: torch.Tensor,
    offsets: np.ndarray,
    counts: np.ndarray,
    keys: torch.Tensor,
    maxima: torch.Tensor,
    fmt: FloatFormat,
    out: torch.Tensor,
) -> None:
    """:func:`layer_records` of block scaling: every block scaled by its own key's
    exponent, the rows folded per layer as :func:`aps_comm.telemetry.per_layer` does.

    Row l: the smallest exponent of layer l's blocks (uint8 ``keys``, one per
    block: 0 for a zero or non-finite block), the largest of their ``maxima``
    (float32, one per block), and the summed counts of their elements; 0
    for a layer without blocks.

    Args:
        x: contiguous float32 values.
        offsets: int64, the blocks' bounds in ``x`` (blocks + 1 entries).
        counts: int64, blocks per layer.
        keys: uint8, one exponent key per block.
        maxima: float32, one maximum per block.
        fmt: the wire format.
        out: float64 (layers, 5).

    Example:
        >>> from aps_comm.formats import E4M3
        >>> out = torch.empty(2, 5, dtype=torch.float64)
        >>> x = torch.tensor([1.0, 1e-9, 0.0, 500.0])
        >>> block_records(x, np.array([0, 2, 4]), np.array([2, 0]),
        ...               torch.tensor([120, 127], dtype=torch.uint8), torch.tensor([1.0, 500.0]),
        ...               E4M3, out)
        >>> out.tolist()
        [[0.0, 500.0, 3.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]]
    """
    tiny = np.float32(fmt.min_subnormal / 2)
    _block_records(
        _np(x), offsets, counts, _np(keys), _np(maxima), tiny, np.float32(fmt.max), _np(out)
    )


if AVAILABLE:

    @_njit
    def _key_exponent(k):
        return 0 if k == 0 or k == 255 else 127 - np.int64(k)

    @_njit
    def _scaled_counts(x, lo, hi, e, tiny, fmax):
        """Of ``x[lo:hi]`` times ``2**e``: nonzero, underflowing and saturating elements."""
        f = _u2f(_pow2_bits(e))  # exact, as ldexp's, without a call per block
        nonzero = under = saturated = 0
        for i in range(_u64(lo), _u64(hi)):  # unsigned: LLVM vectorises the counts
            m = np.float32(abs(x[i]) * f)  # float32 products, as the torch counts'
            nonzero += m > 0
            under += (m > 0) & (m <= tiny)
            saturated += m > fmax
        return nonzero, under, saturated

    @_njit
    def _layer_records(x, offsets, maxima, keys, tiny, fmax, out, rates, at):
        for s in range(len(offsets) - 1):
            e = _key_exponent(keys[s])
            nonzero, under, saturated = _scaled_counts(x, offsets[s], offsets[s + 1], e, tiny, fmax)
            out[s, 0] = e
            out[s, 1] = maxima[s]
            out[s, 2] = nonzero
            out[s, 3] = under
            out[s, 4] = saturated
            if len(rates):  # :func:`underflow_rates`' float32 quotient
                rates[at[s] if len(at) else s] = np.float32(under) / np.float32(max(nonzero, 1))

    @_njit
    def _block_records(x, offsets, counts, keys, maxima, tiny, fmax, out):
        b = 0
        for layer in range(len(counts)):
            smallest = 0
            largest = np.float32(0.0)
            nonzero = under = saturated = 0
            for j in range(counts[layer]):
                e = _key_exponent(keys[b])
                smallest = e if j == 0 else min(smallest, e)
                largest = max(largest, maxima[b])
                n, u, s = _scaled_counts(x, offsets[b], offsets[b + 1], e, tiny, fmax)
                nonzero += n
                under += u
                saturated += s
                b += 1
            out[layer, 0] = smallest
            out[layer, 1] = largest
            out[layer, 2] = nonzero
            out[layer, 3] = under
            out[layer, 4] = saturated

    @_njit
    def _block_keys_records(gathered, keyed, record):
        """:func:`_gather_add` (no spans: nothing), :func:`_block_keys`, then (rows to
        write) :func:`_block_records`: one call."""
        source, spans, residual, values, vbits, out, divisor = gathered
        _gather_add(source, spans, residual, values, vbits, out, divisor)
        xb, offsets, counts, maxima_bits, keys, flags, lim, n_ranks = keyed
        _block_keys(xb, offsets, counts, maxima_bits, keys, flags, lim, n_ranks)
        x, maxima, tiny, fmax, rows = record
        if len(rows):
            _block_records(x, offsets, counts, keys, maxima, tiny, fmax, rows)


if AVAILABLE:

    @_njit
    def _block_factors(keys, counts, scale, unscale):
        """Per block, ``2**e`` and ``2**-e`` of its agreed key; NaN unscale for every block of
        a layer with a non-finite (255) key."""
        start = 0
        for layer in range(len(counts)):
            stop = start + counts[layer]
            bad = False
            layer_keys = keys[start:stop]  # a view from 0: vectorised (7x)
            for i in range(stop - start):
                bad |= layer_keys[i] == 255
            # 2**e from its bits (exact, subnormals too), not ldexp's call: vectorised (25x).
            up, down = scale[start:stop], unscale[start:stop]
            for i in range(stop - start):
                k = np.int32(layer_keys[i])
                e = 0 if k == 0 or k == 255 else 127 - k
                up[i] = _u2f(_pow2_bits(e))
                down[i] = np.float32(np.nan) if bad else _u2f(_pow2_bits(-e))
            start = stop

    @_njit
    def _keep_lost(x, sent, out):
        for i in range(len(x)):
            s = sent[i]
            out[i] = x[i] - s if np.isfinite(s) else np.float32(0.0)

    @_njit
    def _owner_lost(acc, part, offsets, scale, unscale, lo, hi, n_ranks, out):
        n = np.float32(n_ranks)
        zero = np.float32(0.0)
        for seg in range(len(offsets) - 1):
            a, b = max(offsets[seg], lo), min(offsets[seg + 1], hi)
            if a >= b:
                continue
            m = scale[seg] if np.isfinite(unscale[seg]) else zero
            if m > 0:
                accs, parts, outs = acc[a - lo : b - lo], part[a - lo : b - lo], out[a:b]
                for j in range(_u64(b - a)):  # unsigned: LLVM vectorises it
                    outs[j] = outs[j] + ((accs[j] - parts[j]) / m) * n
            else:  # unsigned bounds: vectorised (4-6x; a view per block was slower)
                for j in range(_u64(a), _u64(b)):
                    # Added even so: -0 + 0 is +0, as the tensor ops give.
                    out[j] = out[j] + zero * n


def block_factors_into(
    keys: torch.Tensor, counts: np.ndarray, scale: np.ndarray, unscale: np.ndarray
) -> None:
    """:func:`aps_comm.scaling.factors_from_keys`' scale and unscale (route two_phase) of
    agreed uint8 block ``keys``, written into float32 ``scale`` and ``unscale``: ``2**e``
    and ``2**-e`` per block, NaN unscale for every block of a layer with a key of 255.

    ``counts``: int64 blocks per layer (summing to ``keys.numel()``).

    Example:
        >>> s, u = np.empty(3, np.float32), np.empty(3, np.float32)
        >>> block_factors_into(torch.tensor([120, 0, 255], dtype=torch.uint8),
        ...                    np.array([1, 2]), s, u)
        >>> s, u
        (array([128.,   1.,   1.], dtype=float32), array([0.0078125,       nan,       nan], dtype=float32))
    """
    _block_factors(_np(keys), counts, scale, unscale)


if AVAILABLE:

    @_njit
    def _native_block_keys(xb, offsets, maxima, keys, n_ranks, fmax, limit, p, q, m):
        _block_amax(xb, offsets, maxima)
        _maxima_keys(maxima, keys, n_ranks, True, fmax, limit, p, q, m)

    @_njit
    def _native_block_factors(keys, counts, scale, inverse, unscale, n_ranks):
        _block_factors(keys, counts, scale, inverse)
        n = np.float32(n_ranks)
        for i in range(len(unscale)):
            unscale[i] = inverse[i] / n  # float32 operands: one IEEE division, as torch's


def native_block_keys(
    fmt: FloatFormat,
    x: torch.Tensor,
    offsets: np.ndarray | BlockGrid,
    maxima: torch.Tensor,
    keys: torch.Tensor,
    limit: int,
    world_size: int,
) -> None:
    """Every block's max |x| into float32 ``maxima`` and its key under the native sum's
    rule (:func:`aps_comm.scaling.exponent_keys`, route "allreduce": headroom for the
    ``world_size`` ranks' sum in ``fmt``) into uint8 ``keys``: a settled native bucket's
    keys, one call per step.

    Example:
        >>> from aps_comm.formats import FP16
        >>> m, k = torch.empty(2), torch.empty(2, dtype=torch.uint8)
        >>> native_block_keys(FP16, torch.tensor([3.0, float("nan")]), np.array([0, 1, 2]),
        ...                   m, k, 126, 2)
        >>> k.tolist()
        [114, 255]
    """
    q, m = decoder_params(fmt)
    _native_block_keys(
        _np(x).view(np.uint32),
        _block_offsets(offsets),
        _np(maxima).view(np.uint32),
        _np(keys),
        world_size,
        float(fmt.max),
        limit,
        encoder_params(fmt),
        q,
        m,
    )


def native_block_factors(
    keys: torch.Tensor,
    counts: torch.Tensor,
    scale: torch.Tensor,
    unscale: torch.Tensor,
    n: int,
    inverse: torch.Tensor | None = None,
) -> None:
    """:func:`aps_comm.scaling.factors_from_keys`' scale and unscale (route "allreduce") of
    agreed uint8 block ``keys`` into float32 ``scale`` and ``unscale``: ``2**e`` and
    ``2**-e / n`` per block, NaN unscale for every block of a layer with a key of 255
    (``counts``: int64 blocks per layer). ``inverse``: float32, where ``2**-e`` goes too
    (NaN likewise): error feedback keeps its residuals under it.

    Example:
        >>> s, u = torch.empty(3), torch.empty(3)
        >>> native_block_factors(torch.tensor([120, 0, 255], dtype=torch.uint8),
        ...                      torch.tensor([1, 2]), s, u, 2)
        >>> s.tolist(), u.tolist()[0]
        ([128.0, 1.0, 1.0], 0.00390625)
    """
    out = _np(unscale)
    kept = out if inverse is None else _np(inverse)  # the same array: divided in place
    _native_block_factors(_np(keys), _np(counts), _np(scale), kept, out, n)


if AVAILABLE:

    @_njit
    def _native_factors(ab, keys, scale, inverse, unscale, n, spread, fmax, lim, p, q, m):
        work = inverse.view(np.uint32)  # the spread's scratch, free until its factors
        for i in range(len(ab)):
            work[i] = ab[i]
        if spread:
            _spread_maximum(work)
        _maxima_keys(work, keys, n, True, fmax, lim, p, q, m)
        _key_factors(keys, scale, False, 1)
        _key_factors(keys, inverse, True, 1)
        _key_factors(keys, unscale, True, n)


def native_factors_into(
    maxima: np.ndarray,
    fmt: FloatFormat,
    world_size: int,
    limit: int,
    spread: bool,
    factors: tuple[np.ndarray, np.ndarray, np.ndarray],
    keys: np.ndarray,
    pick: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """:func:`maxima_factors_into` for route "allreduce", with the inverse ``2**-e`` beside
    the decode's ``2**-e / N``: error feedback's residuals are kept under the inverse.
    ``pick``: (``source``, int64 ``index``): ``maxima`` is first written with
    ``source[index]`` (a format group's layers of a bucket's agreed maxima).

    ``factors``: float32 (scale, inverse, unscale), as long as the agreed float32
    ``maxima``; NaN inverse and unscale for a non-finite maximum. ``spread``:
    ``scaling="bucket"`` (the factors of :func:`spread_maximum`'s, ``maxima`` left as
    they are: the records'); ``limit`` 0: ``scaling="none"``. ``keys``: int32 scratch
    the exponent keys are left in (the records').

    Example:
        >>> from aps_comm.formats import FP16
        >>> f = tuple(np.empty(1, np.float32) for _ in range(3))
        >>> native_factors_into(np.array([3.0], np.float32), FP16, 2, 126, False, f,
        ...                     np.empty(1, np.int32))
        >>> [float(a[0]) for a in f]
        [8192.0, 0.0001220703125, 6.103515625e-05]
    """
    scale, inverse, unscale = factors
    q, m = decoder_params(fmt)
    if pick is not None:
        np.take(pick[0], pick[1], out=maxima)
    _native_factors(
        maxima.view(np.uint32),
        keys,
        scale,
        inverse,
        unscale,
        world_size,
        spread,
        float(fmt.max),
        limit,
        encoder_params(fmt),
        q,
        m,
    )


def keep_lost(x: torch.Tensor, sent: torch.Tensor, out: torch.Tensor) -> None:
    """What this rank's encoding lost: ``x - sent`` where ``sent`` is finite, else 0, into
    ``out`` (contiguous float32, all as long): error feedback's residual.

    Example:
        >>> out = torch.empty(2)
        >>> keep_lost(torch.tensor([1.0, 2.0]), torch.tensor([0.75, float("nan")]), out)
        >>> out
        tensor([0.2500, 0.0000])
    """
    _keep_lost(_np(x), _np(sent), _np(out))


def owner_lost(
    acc: torch.Tensor,
    part: torch.Tensor,
    offsets: np.ndarray | BlockGrid,
    scale: np.ndarray,
    unscale: np.ndarray,
    lo: int,
    hi: int,
    n_ranks: int,
    out: torch.Tensor,
) -> None:
    """What a two_phase owner's re-encoding of its mean lost, unscaled and times N, added
    to elements ``lo`` to ``hi`` of the float32 residuals ``out``.

    ``acc``: the owner's float32 mean of its shard (element ``lo`` first); ``part``: that
    mean encoded and decoded again; ``offsets``: the segments of ``out`` (layers or
    blocks) with their ``scale`` and ``unscale`` (NaN: a non-finite segment, which loses
    nothing). Per element ``out += where(m > 0, (acc - part) / m, 0) * N`` with ``m``
    the segment's scale, in float32, as the tensor ops do it.

    Example:
        >>> out = torch.zeros(2)
        >>> one = np.ones(1, np.float32)
        >>> owner_lost(torch.tensor([1.5]), torch.tensor([1.0]), np.array([0, 2]), 2 * one,
        ...            one, 1, 2, 2, out)
        >>> out
        tensor([0.0000, 0.5000])
    """
    segments = _block_offsets(offsets)
    _owner_lost(_np(acc), _np(part), segments, scale, unscale, lo, hi, n_ranks, _np(out))


if AVAILABLE:

    @_njit
    def _unit_keys(xb, offsets, fmt_of, lims, bounds, maxima, keys):
        _block_amax(xb, offsets, maxima)
        inf_bits = np.uint32(0x7F800000)
        for i in range(len(maxima)):
            f, a = fmt_of[i], maxima[i]
            if a == 0:
                keys[i] = 0
            elif a >= inf_bits:
                keys[i] = 255
            elif f < 0:  # FP32: sent exactly, its key only marks a non-finite block
                keys[i] = 0
            else:
                lim = (lims[f, 0], lims[f, 1], lims[f, 2])
                e = _mean_exponent(a, 0, lim)
                if bounds[f] > 0:
                    e = min(e, _sum_exponent(a, bounds[f], lim[2]))
                keys[i] = 127 - e

    @_njit
    def _key_exponent(k):
        return 0 if k == 0 or k == 255 else 127 - np.int32(k)

    @_njit
    def _unit_block_factors(keys, param_of, flag, pos, src, scale, decode, maxima, bad):
        bad[:] = 0
        for b in range(len(keys)):
            if keys[b] == 255:
                bad[param_of[b]] = 1
        flagged = flag[0] > 0
        for j in range(len(pos)):
            scale[j] = _u2f(_pow2_bits(_key_exponent(keys[pos[j]])))  # exact, as ldexp's
            if flagged or bad[param_of[pos[j]]]:
                decode[j] = np.float32(np.nan)
            else:
                decode[j] = _u2f(_pow2_bits(-_key_exponent(keys[src[j]])))
        for i in range(len(maxima)):
            maxima[i] = np.float32(np.inf) if flagged or bad[i] else np.float32(0.0)


if AVAILABLE:

    @_njit
    def _unit_maxima(xb, offsets, local, shared, flag, n_rows):
        _block_amax(xb, offsets, local)
        k = len(shared) - 1
        for i in range(k):
            m = local[i]
            for r in range(1, n_rows):
                m = max(m, local[r * k + i])  # bits of non-negative floats order as they do
            shared[i] = m
        shared[k] = flag[0]

    @_njit
    def _unit_agreed(shared, flag, perm, maxima, agreed):
        k = len(shared) - 1
        flag[0] = shared[k]
        flagged = shared[k] > 0
        for i in range(k):
            maxima[i] = np.float32(np.inf) if flagged else shared[i]
        for j in range(len(perm)):
            agreed[j] = maxima[perm[j]]


def unit_maxima(
    x: torch.Tensor,
    offsets: np.ndarray,
    n_rows: int,
    local: torch.Tensor,
    shared: torch.Tensor,
    flag: torch.Tensor,
) -> None:
    """An FSDP unit's maxima for its MAX all-reduce, in one call: every segment's max |x|
    (NaN as inf) of the N rows into float32 ``local`` (N x P), each parameter's over
    the rows into ``shared[:P]``, and the 0-d float32 ``flag`` into ``shared[P]``.

    Example:
        >>> local, shared = torch.empty(2), torch.empty(2)
        >>> unit_maxima(torch.tensor([3.0, -4.0]), np.array([0, 1, 2]), 2, local, shared,
        ...             torch.tensor(1.0))
        >>> shared.tolist()
        [4.0, 1.0]
    """
    _unit_maxima(
        _np(x).view(np.uint32),
        offsets,
        _np(local).view(np.uint32),
        _np(shared).view(np.uint32),
        _np(flag.reshape(1)).view(np.uint32),
        n_rows,
    )


def unit_agreed(
    shared: torch.Tensor,
    flag: torch.Tensor,
    perm: np.ndarray,
    maxima: torch.Tensor,
    agreed: torch.Tensor,
) -> None:
    """An FSDP unit's agreed maxima after its MAX all-reduce, in one call: the flag
    (``shared``'s last) into the 0-d ``flag``, the P maxima into ``maxima`` (all inf
    when flagged) and ``maxima[perm]`` into ``agreed``.

    Example:
        >>> flag, maxima, agreed = torch.zeros(()), torch.empty(2), torch.empty(3)
        >>> unit_agreed(torch.tensor([3.0, 4.0, 0.0]), flag, np.array([1, 0, 1]), maxima, agreed)
        >>> agreed.tolist()
        [4.0, 3.0, 4.0]
    """
    _unit_agreed(_np(shared), _np(flag.reshape(1)), perm, _np(maxima), _np(agreed))


def unit_keys(
    x: torch.Tensor,
    offsets: np.ndarray,
    fmt_of: np.ndarray,
    formats: list[FloatFormat],
    limit: int,
    world_size: int,
    maxima: torch.Tensor,
    keys: torch.Tensor,
) -> None:
    """:func:`block_keys` of an FSDP unit of several formats, in one call: every block's
    max |x| into float32 ``maxima`` and its two_phase key over ``world_size`` ranks
    under its own format (``fmt_of``: an index into ``formats`` per block, -1 for FP32,
    whose key is 0, or 255 for a non-finite block) into uint8 ``keys``.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> m, k = torch.empty(3), torch.empty(3, dtype=torch.uint8)
        >>> unit_keys(torch.tensor([3.0, 5.0, float("nan")]), np.array([0, 1, 2, 3]),
        ...           np.array([0, -1, -1], np.int8), [E4M3], 126, 1, m, k)
        >>> k.tolist()
        [120, 0, 255]
    """
    f32max = float(np.finfo(np.float32).max)
    lims = np.array([mean_limit(f, limit) for f in formats], np.int64).reshape(-1, 3)
    bounds = np.array([world_size if f.max * world_size > f32max else 0 for f in formats])
    _unit_keys(
        _np(x).view(np.uint32),
        offsets,
        fmt_of,
        lims,
        bounds.astype(np.int64),
        _np(maxima).view(np.uint32),
        _np(keys),
    )


def unit_block_factors(
    keys: torch.Tensor,
    param_of: np.ndarray,
    flag: torch.Tensor,
    pick: tuple[np.ndarray, np.ndarray],
    scale: np.ndarray,
    decode: np.ndarray,
    maxima: np.ndarray,
    bad: np.ndarray,
) -> None:
    """An FSDP unit of several formats' block factors from its agreed uint8 ``keys`` (the
    N rows' blocks, ``param_of``: each one's parameter) and uint8 ``flag``, in one call.

    ``pick``: per encoded block, its block in ``keys``, and the same block of this
    rank's row (every rank sends this one its row: each received block is decoded with
    this row's factor). Writes ``scale`` (``2**e``) and ``decode`` (``2**-e``; NaN for
    every block of a parameter with a non-finite block in any row, or all of them when
    flagged), and per parameter ``maxima``: inf where it is NaN so, else 0 (what makes
    an FP32 parameter NaN in the sum); ``bad`` is uint8 scratch, one per parameter.

    Example:
        >>> s, d, m = (np.empty(2, np.float32) for _ in range(3))
        >>> unit_block_factors(torch.tensor([120, 255], dtype=torch.uint8),
        ...                    np.array([0, 1]), torch.zeros(1, dtype=torch.uint8),
        ...                    (np.array([0, 1]), np.array([0, 1])), s, d, m,
        ...                    np.empty(2, np.uint8))
        >>> s.tolist(), d.tolist(), m.tolist()
        ([128.0, 1.0], [0.0078125, nan], [0.0, inf])
    """
    _unit_block_factors(
        _np(keys), param_of, _np(flag), pick[0], pick[1], scale, decode, maxima, bad
    )


@functools.lru_cache(maxsize=64)
def mean_limit(fmt: FloatFormat, limit: int) -> tuple[int, int, int]:
    """The constants of the owner's extra exponents: (exponent, mantissa field) of the
    largest value a block may reach (``fmt.max``, at most float32's) as a float32,
    and the exponent limit (:data:`aps_comm.scaling.EXPONENT_LIMIT`).

    Example:
        >>> from aps_comm.formats import E4M3
        >>> mean_limit(E4M3, 126)  # 448 = 1.75 * 2**8
        (8, 6291456, 126)
    """
    bits = int(np.float32(min(fmt.max, float(np.finfo(np.float32).max))).view(np.uint32))
    return (bits >> 23) - 127, bits & 0x7FFFFF, limit


def reduce_blocks(
    recv: torch.Tensor,
    n_ranks: int,
    fmt: FloatFormat,
    offsets: np.ndarray,
    exponents: np.ndarray,
    out: torch.Tensor,
    d: np.ndarray,
    limit: int,
    longest: int | None = None,
) -> None:
    """The owner's step of two_phase with block exponents, in one pass over the data.

    The mean of ``n_ranks`` equal shards laid end to end in ``recv`` (decoded,
    summed in float32 in rank order, divided by ``n_ranks``) is cut into
    blocks (the segments at ``offsets``, from 0 to the elements wanted); each
    block gets the extra exponent of :func:`aps_comm.scaling.mean_exponents`
    (into int32 ``d``, from the blocks' agreed int32 ``exponents``) and is
    encoded times ``2**d`` into ``out``. Bytes and exponents equal those of
    :meth:`aps_comm.codec.Codec.shard_mean`, ``blocks_amax``,
    ``mean_exponents`` and a scaled encode one after another. ``longest``:
    the longest block's elements, where the caller knows it (else found here).
    """
    shard_bytes = recv.numel() // n_ranks
    q, m = decoder_params(fmt)
    if longest is None:
        longest = int(np.diff(offsets).max()) if offsets.size > 1 else 0
    cap = max(_BLOCK, longest)
    args = (
        exponents,
        d,
        cap,
        q,
        m,
        encoder_params(fmt),
        mean_limit(fmt, limit),
    )
    ra, oa = _np(recv), _np(out)
    if fmt.wire_bits == 4:
        _reduce_blocks4(ra, n_ranks, shard_bytes, oa, offsets, *args)
        return
    if fmt.wire_bits == 16:
        ra, oa = ra.view(np.uint16), oa.view(np.uint16)
    _reduce_blocks(ra, n_ranks, ra.size // n_ranks, oa, offsets, *args)


def block_amax(x: torch.Tensor, offsets: np.ndarray | BlockGrid, out: torch.Tensor) -> None:
    """max |x| of each segment of contiguous float32 ``x`` into float32 ``out``; NaN gives inf."""
    _block_amax(_np(x).view(np.uint32), _block_offsets(offsets), _np(out).view(np.uint32))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def _whole(n: int) -> tuple[np.ndarray, np.ndarray]:
    """One segment of ``n`` elements with factor 1 (``x * 1`` is ``x``, NaN included)."""
    return np.array([0, n], np.int64), np.ones(1, np.float32)


def _runs(block_size: int | None, runs: np.ndarray | None) -> tuple[int, np.ndarray]:
    """The kernels' run arguments: none unless the blocks are of a size they walk."""
    if runs is None or block_size not in BLOCK_SIZES:
        return 0, _NO_RUNS
    return block_size, runs  # type: ignore[return-value]


def encode(
    x: torch.Tensor,
    out: torch.Tensor,
    fmt: FloatFormat,
    offsets: np.ndarray | BlockGrid | None = None,
    factors: np.ndarray | None = None,
    block_size: int | None = None,
    runs: np.ndarray | None = None,
) -> None:
    """Encode contiguous float32 ``x`` (times per-segment ``factors``) into uint8 ``out``.

    ``runs`` (int64, shape (R, 2): first segment, count) marks runs of
    segments of exactly ``block_size`` elements (:attr:`aps_comm.layout.Layout.block_runs`),
    which the binade encoder walks block by block without their offsets.
    """
    xa = _np(x.contiguous().float())
    params = encoder_params(fmt)
    oa = _np(out)
    if factors is None:
        offsets, factors = _whole(xa.size)
    offsets = _block_offsets(offsets)
    if fmt.wire_bits == 4:
        _encode4(xa, offsets, factors, oa, params, *_runs(block_size, runs))
    else:
        codes = oa if fmt.wire_bits == 8 else oa.view(np.uint16)
        _encode_codes(xa, offsets, factors, codes, params, *_runs(block_size, runs))


def decode(
    payload: torch.Tensor,
    out: torch.Tensor,
    fmt: FloatFormat,
    offsets: np.ndarray | BlockGrid | None = None,
    factors: np.ndarray | None = None,
    block_size: int | None = None,
    runs: np.ndarray | None = None,
) -> None:
    """Decode uint8 ``payload`` into contiguous float32 ``out`` (times per-segment ``factors``).

    ``block_size`` and ``runs`` as for :func:`encode`.
    """
    pa, oa = _np(payload), _np(out)
    if factors is None:
        offsets, factors = _whole(oa.size)
    offsets = _block_offsets(offsets)
    q, m = decoder_params(fmt)
    size, walk = _runs(block_size, runs)
    if fmt.wire_bits == 4:
        _decode4(pa, oa, q, m, offsets, factors, size, walk)
    else:
        pa = pa if fmt.wire_bits == 8 else pa.view(np.uint16)
        _decode_segments(pa, oa, q, m, offsets, factors, size, walk)


def reduce_shards(recv: torch.Tensor, n_ranks: int, fmt: FloatFormat, out: torch.Tensor) -> None:
    """Mean of ``n_ranks`` equal shards laid end to end in ``recv``, re-encoded into ``out``.

    The sum runs in float32 in rank order, then divides by ``n_ranks``: the
    same arithmetic on every shard owner, so results are reproducible.
    """
    shard_bytes = recv.numel() // n_ranks
    q, m = decoder_params(fmt)
    ra, oa = _np(recv), _np(out)
    if fmt.wire_bits == 4:
        _reduce4(ra, n_ranks, shard_bytes, oa, q, m, encoder_params(fmt))
        return
    if fmt.wire_bits == 16:
        ra, oa = ra.view(np.uint16), oa.view(np.uint16)
    _reduce(ra, n_ranks, ra.size // n_ranks, oa, q, m, encoder_params(fmt))


if AVAILABLE:
    # two_phase with agreed block exponents (BlockExponents.AGREED, no error
    # feedback), a chunk at a time: one call sends all N shards with the agreed
    # keys, one makes this rank's owner step (the mean's extra exponent d per
    # block, sent after the shard's codes), one decodes all N gathered shards
    # with 2**-(e + d). The factors come from the one-byte keys: no per-shard
    # or per-block work on the host (see aps_comm.transports.bind_blocks).

    @_njit
    def _key_exponent_of(k):
        """The exponent of a key (:func:`aps_comm.scaling.key_exponents`)."""
        return 0 if k == 0 or k == 255 else 127 - np.int64(k)

    @_njit
    def _owner_agreed_blocks(
        recv, n_ranks, out, shard_bytes, offsets, keys, first, scratch, flags, cap, params, bits
    ):
        exps, d = scratch
        counts, union = flags
        q, m, p, lim = params
        if len(counts):  # the first chunk: every layer's flag, before any decode
            b = 0
            for i in range(len(counts)):
                u = np.uint8(0)
                layer_keys = keys[b : b + counts[i]]  # a view from 0, no branch: vectorised
                for j in range(counts[i]):
                    u |= layer_keys[j] == 255
                union[i] = u
                b += counts[i]
        piece = len(recv) // n_ranks
        k = len(offsets) - 1
        shard_keys = keys[first : first + k]  # a view from 0: vectorised (7x)
        for j in range(k):
            exps[j] = _key_exponent_of(shard_keys[j])
        used = (offsets[k] * bits + 7) // 8
        if k:
            args = (recv, n_ranks, piece, out[:used], offsets, exps[:k], d[:k], cap, q, m, p, lim)
            if bits == 4:
                _reduce_blocks4(*args)
            elif bits == 16:  # pieces of whole codes: the shard's payload, no key bytes
                codes16, out16 = recv.view(np.uint16), out[:used].view(np.uint16)
                rest = (exps[:k], d[:k], cap, q, m, p, lim)
                _reduce_blocks(codes16, n_ranks, piece // 2, out16, offsets, *rest)
            else:
                _reduce_blocks(*args)
        for i in range(used, shard_bytes):
            out[i] = 0
        extra = out[shard_bytes : shard_bytes + k]  # a view from 0: vectorised (8x)
        for j in range(k):  # the mean's extra exponents, one byte each
            extra[j] = min(max(d[j], 0), 255)
        for i in range(shard_bytes + k, len(out)):
            out[i] = 0

    @_njit
    def _decode_agreed_blocks(
        gathered, row, offsets, firsts, keys, layer_of, union, x, shard_bytes, dec, bits, no_runs
    ):
        q, m = dec
        most = _most_blocks(firsts)
        cut = np.empty(most + 1, np.int64)
        fac = np.empty(most, np.float32)
        nan = np.float32(np.nan)
        for s in range(len(firsts) - 1):
            b0, b1 = firsts[s], firsts[s + 1]
            a, b = offsets[b0], offsets[b1]
            k = b1 - b0
            if a == b:
                continue
            # Over views from 0: signed offsets in the index cost 1.7x.
            ks, ds = keys[b0:b1], gathered[s * row + shard_bytes : s * row + shard_bytes + k]
            layers, starts = layer_of[b0:b1], offsets[b0:b1]
            for j in range(k):
                e = _key_exponent_of(ks[j]) + np.int64(ds[j])
                f = _u2f(_pow2_bits(-e))
                fac[j] = nan if union[layers[j]] != 0 else f
                cut[j] = starts[j] - a
            cut[k] = b - a
            payload = gathered[s * row : s * row + ((b - a) * bits + 7) // 8]
            if bits == 4:
                _decode4(payload, x[a:b], q, m, cut[: k + 1], fac[:k], 0, no_runs)
            elif bits == 16:
                codes16 = payload.view(np.uint16)
                _decode_segments(codes16, x[a:b], q, m, cut[: k + 1], fac[:k], 0, no_runs)
            else:
                _decode_segments(payload, x[a:b], q, m, cut[: k + 1], fac[:k], 0, no_runs)


def send_agreed_blocks(
    fmt: FloatFormat,
    x: np.ndarray,
    keys: np.ndarray,
    table: np.ndarray,
    offsets: np.ndarray | BlockGrid,
    firsts: np.ndarray,
    send: np.ndarray,
    piece: int,
) -> None:
    """Encode every shard of a chunk into ``send`` with the blocks' agreed keys.

    Shard s (blocks ``firsts[s]`` to ``firsts[s + 1]`` of ``offsets``) goes
    to ``send[s * piece:]``: its codes times ``table[key]`` per block, then
    zero padding to ``piece``: the bytes of
    the send of :func:`aps_comm.transports.bind_blocks` with agreed factors. 4-, 8- and 16-bit formats.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> send = np.empty(4, np.uint8)
        >>> table = np.ones(256, np.float32)
        >>> send_agreed_blocks(E4M3, np.array([1.0, 2.0], np.float32), np.zeros(2, np.uint8),
        ...                    table, np.array([0, 1, 2]), np.array([0, 1, 2]), send, 2)
        >>> send
        array([56,  0, 64,  0], dtype=uint8)
    """
    offsets = _block_offsets(offsets)
    _send_shards(
        x, keys, table, offsets, firsts, send, piece, encoder_params(fmt), fmt.wire_bits, _NO_RUNS
    )


def owner_agreed_blocks(
    fmt: FloatFormat,
    limit: int,
    recv: np.ndarray,
    n_ranks: int,
    offsets: np.ndarray | BlockGrid,
    keys: np.ndarray,
    first: int,
    out: np.ndarray,
    shard_bytes: int,
    scratch: tuple[np.ndarray, np.ndarray] | None,
    flags: tuple[np.ndarray, np.ndarray],
    longest: int,
) -> None:
    """This rank's owner step of a chunk sent by :func:`send_agreed_blocks`.

    ``recv`` holds N equal pieces; ``offsets`` are this rank's shard's blocks
    (from 0), whose agreed keys are ``keys[first:]``. The N copies are
    decoded, summed in rank order and divided by N (:func:`reduce_blocks`,
    with the keys' exponents written into the int32 ``scratch``'s first
    array); each block of the mean is encoded with its extra exponent ``d``
    (the second) into ``out``: codes, zero padding to ``shard_bytes``, ``d``
    clamped to a byte per block, zeros: the bytes of
    the owner step of :func:`aps_comm.transports.bind_blocks` with agreed factors. ``flags``: (blocks per
    layer of the whole group, uint8 per layer): where the first is not empty
    (the first chunk's owner step, before any decode), each layer's flag is
    written into the second, 1 where any of its agreed keys is non-finite (255).
    ``longest``: the longest block's elements. ``scratch`` None: made for the call.
    """
    offsets = _block_offsets(offsets)
    if scratch is None:
        k = max(offsets.size - 1, 1)
        scratch = np.empty(k, np.int32), np.empty(k, np.int32)
    q, m = decoder_params(fmt)
    _owner_agreed_blocks(
        recv,
        n_ranks,
        out,
        shard_bytes,
        offsets,
        keys,
        first,
        scratch,
        flags,
        max(_BLOCK, longest),
        (q, m, encoder_params(fmt), mean_limit(fmt, limit)),
        fmt.wire_bits,
    )


def decode_agreed_blocks(
    fmt: FloatFormat,
    gathered: np.ndarray,
    n_ranks: int,
    offsets: np.ndarray | BlockGrid,
    firsts: np.ndarray,
    keys: np.ndarray,
    layer_of: np.ndarray,
    union: np.ndarray,
    x: np.ndarray,
    shard_bytes: int,
) -> None:
    """Decode every owner's gathered shard of a chunk into ``x``: block b of shard s
    times ``2**-(e_b + d_b)``, ``e_b`` its agreed key's exponent and ``d_b`` the byte
    its owner sent after the shard's codes (row s of ``gathered``, N equal rows, at
    ``shard_bytes``); a block whose layer (``layer_of``) is flagged in ``union``
    decodes to NaN."""
    offsets = _block_offsets(offsets)
    q, m = decoder_params(fmt)
    _decode_agreed_blocks(
        gathered,
        gathered.size // n_ranks,
        offsets,
        firsts,
        keys,
        layer_of,
        union,
        x,
        shard_bytes,
        (q, m),
        fmt.wire_bits,
        _NO_RUNS,
    )


def record_limits(formats: list[FloatFormat]) -> tuple[np.ndarray, np.ndarray]:
    """Per format, the records' underflow bound (half its smallest subnormal) and its
    largest finite value, as float32 arrays (:func:`unit_records`).

    Example:
        >>> from aps_comm.formats import E4M3
        >>> record_limits([E4M3])[1].tolist()
        [448.0]
    """
    tiny = np.array([f.min_subnormal / 2 for f in formats], np.float32)
    return tiny, np.array([f.max for f in formats], np.float32)


def unit_records(
    x: torch.Tensor,
    offsets: np.ndarray,
    counts: np.ndarray,
    keys: torch.Tensor | np.ndarray,
    maxima: torch.Tensor,
    n_rows: int,
    fmt: FloatFormat | tuple[np.ndarray, np.ndarray],
    out: torch.Tensor,
) -> None:
    """:func:`block_records` of an FSDP unit's N rows, folded per parameter over the rows.

    ``fmt`` is the wire format, or each parameter's underflow and saturation
    bounds (a unit of several formats: :func:`record_limits`).

    ``x`` holds N rows, row r every parameter's r-th chunk in order, each
    chunk cut into ``counts[p]`` segments (one with layer scaling, its blocks
    with block scaling); segment b's bounds are ``offsets[b:b + 2]``. Row p of
    ``out``: the smallest exponent of parameter p's segments in every row (the
    exponent keys ``keys``: int32 of :func:`maxima_factors_into`, or uint8
    block keys), the largest of their ``maxima`` and their summed counts: what
    the unit's general path records, with no per-parameter work on the host.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> out = torch.empty(1, 5, dtype=torch.float64)
        >>> x = torch.tensor([1.0, 1e-9, 0.0, 500.0])  # 2 rows of one 2-element chunk
        >>> unit_records(x, np.array([0, 2, 4]), np.array([1]), np.array([127, 127], np.int32),
        ...              torch.tensor([500.0, 500.0]), 2, E4M3, out)
        >>> out.tolist()
        [[0.0, 500.0, 3.0, 1.0, 1.0]]
    """
    tiny, fmax = record_limits([fmt] * len(counts)) if isinstance(fmt, FloatFormat) else fmt
    ka = keys if isinstance(keys, np.ndarray) else _np(keys)
    _unit_records(_np(x), offsets, counts, ka, _np(maxima), n_rows, tiny, fmax, _np(out))


if AVAILABLE:

    @_njit
    def _unit_records(x, offsets, counts, keys, maxima, n_rows, tiny, fmax, out):
        per_row = 0
        for p in range(len(counts)):
            per_row += counts[p]
        first = 0
        for p in range(len(counts)):
            smallest = 0
            largest = np.float32(0.0)
            nonzero = under = saturated = 0
            j = 0
            for r in range(n_rows):
                for i in range(counts[p]):
                    b = r * per_row + first + i
                    e = _key_exponent(keys[b])
                    smallest = e if j == 0 else min(smallest, e)
                    largest = max(largest, maxima[b])
                    n, u, s = _scaled_counts(x, offsets[b], offsets[b + 1], e, tiny[p], fmax[p])
                    nonzero += n
                    under += u
                    saturated += s
                    j += 1
            out[p, 0] = smallest
            out[p, 1] = largest
            out[p, 2] = nonzero
            out[p, 3] = under
            out[p, 4] = saturated
            first += counts[p]


def copy_spans(src: torch.Tensor, dst: torch.Tensor, spans: np.ndarray) -> None:
    """Copy byte spans of contiguous ``src`` into contiguous ``dst``, in one call.

    ``spans`` is int64 (K, 3): each row's source offset, destination offset
    and length, in bytes of the two tensors (any dtypes). An FSDP unit of
    several formats gathers every run's rows with it, and scatters them back.

    Example:
        >>> dst = torch.zeros(4, dtype=torch.uint8)
        >>> copy_spans(torch.arange(4, dtype=torch.uint8), dst, np.array([[0, 2, 2], [3, 0, 1]]))
        >>> dst.tolist()
        [3, 0, 0, 1]
    """
    _copy_spans(_np(src.view(-1)).view(np.uint8), _np(dst.view(-1)).view(np.uint8), spans)


def sum_runs(
    values: torch.Tensor,
    out: torch.Tensor,
    runs: np.ndarray,
    n_rows: int,
    offsets: np.ndarray,
    maxima: torch.Tensor,
) -> None:
    """Every run's N decoded rows summed into ``out``, in float32 in row order (the bits
    of :func:`sum_rows`), and the runs sent exactly made NaN where their maxima are not finite.

    Args:
        values: float32, each run's N rows of ``hi - lo`` elements from ``start``, one
            row every ``stride`` elements.
        out: float32, one row (the unit's reduce-scatter result).
        runs: int64 (R, 7): start in ``values``, the run's ``lo`` and ``hi`` in the row,
            its first and last parameter (exclusive), 1 where it travels in FP32, and its
            rows' ``stride`` in ``values`` (``hi - lo``, or one more where a 4-bit row
            of an odd length was padded to whole bytes).
        n_rows: N.
        offsets: int64, the parameters' chunk bounds in the row (P + 1).
        maxima: float32, every parameter's agreed maximum (inf: non-finite on some rank).

    Example:
        >>> out = torch.empty(3)
        >>> sum_runs(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), out,
        ...          np.array([[0, 0, 2, 0, 1, 0, 2], [4, 2, 3, 1, 2, 1, 1]]), 2,
        ...          np.array([0, 2, 3]), torch.tensor([1.0, float("inf")]))
        >>> out.tolist()
        [4.0, 6.0, nan]
    """
    _sum_runs(_np(values), _np(out), runs, n_rows, offsets, _np(maxima))


if AVAILABLE:

    @_njit
    def _copy_spans(src, dst, spans):
        for k in range(spans.shape[0]):
            a, b, m = spans[k, 0], spans[k, 1], spans[k, 2]
            # Over views from 0: ``dst[b + i]`` (signed offsets) did not vectorise (30x).
            to, of = dst[b : b + m], src[a : a + m]
            for i in range(m):
                to[i] = of[i]

    @_njit
    def _sum_runs(values, out, runs, n_rows, offsets, maxima):
        for k in range(runs.shape[0]):
            start, lo, hi, stride = runs[k, 0], runs[k, 1], runs[k, 2], runs[k, 6]
            # Row by row over contiguous views, in rank order: a strided 2-D view of the
            # rows did not vectorise (2-3x slower).
            sums, width = out[lo:hi], hi - lo
            first = values[start : start + width]
            for j in range(width):
                sums[j] = first[j]
            for r in range(1, n_rows):
                row = values[start + r * stride : start + r * stride + width]
                for j in range(width):
                    sums[j] += row[j]
            if runs[k, 5]:
                for p in range(runs[k, 3], runs[k, 4]):
                    if not np.isfinite(maxima[p]):  # unsigned bounds: vectorised (9x)
                        for i in range(_u64(offsets[p]), _u64(offsets[p + 1])):
                            out[i] = np.float32(np.nan)


if AVAILABLE:

    @_njit
    def _gather_add(x, spans, residual, values, vbits, out, divisor):
        """Each span's layer of ``x`` into ``values`` (its residuals added where it has any,
        divided by float32 ``divisor`` where it is -3), then, where ``out`` has room, its
        max |x| bits (:func:`_block_amax`'s) at its slot."""
        inf_bits = np.uint32(0x7F800000)
        for s in range(spans.shape[0]):
            src, dst, n, r = spans[s, 0], spans[s, 1], spans[s, 2], spans[s, 3]
            # Over views from 0: signed offsets in the index did not vectorise.
            to, of = values[dst : dst + n], x[src : src + n]
            if r == -1:
                for i in range(n):
                    to[i] = of[i]
            elif r == -3:
                for i in range(n):
                    to[i] = of[i] / divisor  # float32, as torch's div_
            elif r >= 0:
                kept = residual[r : r + n]
                for i in range(n):
                    to[i] = of[i] + kept[i]
            if len(out):
                m = _amax_bits(vbits[dst : dst + n])
                out[spans[s, 4]] = m if m < inf_bits else inf_bits  # NaN becomes inf

    @_njit
    def _encode_keep4(x, out, pad, offsets, factors, params, size, runs, sent, residual):
        scale, unscale = factors
        p, q, m = params
        for i in range(len(pad)):
            pad[i] = 0  # code 0 is +0: the shards' padding
        _encode4(x, offsets, scale, out, p, size, runs)
        _decode4(out, sent, q, m, offsets, unscale, size, runs)
        _keep_lost(x, sent, residual)

    @_njit
    def _encode_keep_codes(x, out, pad, offsets, factors, params, size, runs, sent, residual):
        scale, unscale = factors
        p, q, m = params
        for i in range(len(pad)):
            pad[i] = 0  # code 0 is +0: the shards' padding
        _encode_codes(x, offsets, scale, out, p, size, runs)
        _decode_segments(out, sent, q, m, offsets, unscale, size, runs)
        _keep_lost(x, sent, residual)

    @_njit
    def _whole_of(n):
        """:func:`_whole`'s offsets: one segment of ``n`` elements."""
        whole = np.zeros(2, np.int64)
        whole[1] = n
        return whole

    @_njit
    def _owner_feedback4(recv, values, acc, out, offsets, factors, params, span, residual):
        scale, unscale = factors
        p, q, m, no_runs = params
        lo, hi, n_ranks = span
        one, per = np.ones(1, np.float32), len(acc)
        part = values[:per]  # the shards are summed by then
        _decode4(recv, values, q, m, _whole_of(len(values)), one, 0, no_runs)
        _mean_rows(values.reshape((n_ranks, per)), acc)
        _encode4(acc, _whole_of(per), one, out, p, 0, no_runs)
        _decode4(out, part, q, m, _whole_of(per), one, 0, no_runs)
        if hi > lo:
            _owner_lost(acc, part, offsets, scale, unscale, lo, hi, n_ranks, residual)

    @_njit
    def _owner_feedback_codes(recv, values, acc, out, offsets, factors, params, span, residual):
        scale, unscale = factors
        p, q, m, no_runs = params
        lo, hi, n_ranks = span
        one, per = np.ones(1, np.float32), len(acc)
        part = values[:per]  # the shards are summed by then
        _decode_segments(recv, values, q, m, _whole_of(len(values)), one, 0, no_runs)
        _mean_rows(values.reshape((n_ranks, per)), acc)
        _encode_codes(acc, _whole_of(per), one, out, p, 0, no_runs)
        _decode_segments(out, part, q, m, _whole_of(per), one, 0, no_runs)
        if hi > lo:
            _owner_lost(acc, part, offsets, scale, unscale, lo, hi, n_ranks, residual)


def gather_add(
    x: np.ndarray,
    spans: np.ndarray,
    residual: np.ndarray,
    values: np.ndarray,
    out: np.ndarray,
    divisor: int = 1,
) -> None:
    """Layers of float32 ``x`` copied into ``values`` in another order, residuals added to
    those that have them, and each one's max |x| (NaN gives inf) written in ``x``'s
    order: one pass where a bucket of interleaved formats gathered, added and took its
    maxima in several calls.

    ``spans``: int64 rows (from in ``x``, to in ``values``, elements, from in
    ``residual`` or -1 for none, the layer's slot in ``out``); float32 ``out`` (the
    maxima) may be empty: then only the copies and the adds, ``x + residual`` in
    float32 as ``torch.add`` does it. ``values`` may be ``x`` itself, each layer where
    it is (the residuals added in place): -2 for none then leaves the layer as it is.
    -3: the layer divided by ``divisor`` (an FP32 group's mean: its all-reduce's sum
    follows), in float32 as ``Tensor.div_`` does it.

    Example:
        >>> values, out = np.empty(3, np.float32), np.empty(2, np.float32)
        >>> spans = np.array([[1, 0, 2, 0, 1], [0, 2, 1, -1, 0]])
        >>> gather_add(np.array([1, -2, 3], np.float32), spans, np.ones(2, np.float32), values, out)
        >>> values, out
        (array([-1.,  4.,  1.], dtype=float32), array([1., 4.], dtype=float32))
    """
    vbits, maxima = values.view(np.uint32), out.view(np.uint32)
    _gather_add(x, spans, residual, values, vbits, maxima, np.float32(divisor))


def encode_keep(
    fmt: FloatFormat,
    x: np.ndarray,
    send: np.ndarray,
    numel_bytes: int,
    layout: tuple[np.ndarray | BlockGrid, int | None, np.ndarray | None],
    factors: tuple[np.ndarray, np.ndarray],
    sent: np.ndarray,
    residual: np.ndarray,
) -> None:
    """Error feedback's encode and what it lost, in one call: float32 ``x`` times ``scale``
    encoded into the first ``numel_bytes`` of uint8 ``send`` (the rest, the shards'
    padding, zeroed), decoded again times ``unscale`` into float32 ``sent``, and
    ``residual = x - sent`` where ``sent`` is finite, else 0: :func:`encode`,
    :func:`decode` and :func:`keep_lost` one after another, the same bits.

    ``layout``: the segments' int64 offsets, block size and runs (:func:`encode`'s);
    ``factors``: (scale, unscale), float32 per segment.

    Example:
        >>> from aps_comm.formats import E4M3
        >>> send, sent, res = np.empty(2, np.uint8), np.empty(1, np.float32), np.empty(1, np.float32)
        >>> one = np.ones(1, np.float32)
        >>> encode_keep(E4M3, np.array([1.1], np.float32), send, 1, (np.array([0, 1]), None, None),
        ...             (one, one), sent, res)
        >>> sent.tolist(), send.tolist()[1]
        ([1.125], 0)
    """
    grid, block_size, runs = layout
    offsets = _block_offsets(grid)
    size, walk = _runs(block_size, runs)
    q, m = decoder_params(fmt)
    head, pad = send[:numel_bytes], send[numel_bytes:]
    args = (offsets, factors, (encoder_params(fmt), q, m), size, walk, sent, residual)
    if fmt.wire_bits == 4:
        _encode_keep4(x, head, pad, *args)
    else:
        codes = head if fmt.wire_bits == 8 else head.view(np.uint16)
        _encode_keep_codes(x, codes, pad, *args)


def owner_feedback(
    fmt: FloatFormat,
    recv: np.ndarray,
    scratch: tuple[np.ndarray, np.ndarray],
    out: np.ndarray,
    layout: tuple[np.ndarray | BlockGrid, np.ndarray, np.ndarray],
    span: tuple[int, int, int],
    residual: np.ndarray,
) -> None:
    """A two_phase owner's step with error feedback in one call: the N shards of uint8
    ``recv`` decoded into float32 ``values``, averaged in rank order into ``acc``, the
    mean encoded into ``out``, decoded again into ``values``' first shard, and what that
    lost, divided by its segment's scale and times N, added to elements ``lo`` to ``hi``
    of ``residual``: :func:`decode`, :func:`mean_rows`, :func:`encode`, :func:`decode`
    and :func:`owner_lost` one after another, the same bits.

    ``scratch``: (``values``, N shards' float32; ``acc``, one shard's);
    ``layout``: (the segments' int64 offsets, their float32 scale and unscale);
    ``span``: (``lo``, ``hi``, N).

    Example:
        >>> owner_feedback(E4M3, recv, (values, acc), out, (offsets, s, u), (0, 4, 2), res)  # doctest: +SKIP
    """
    values, acc = scratch
    q, m = decoder_params(fmt)
    offsets = _block_offsets(layout[0])
    args = (offsets, layout[1:], (encoder_params(fmt), q, m, _NO_RUNS), span, residual)
    if fmt.wire_bits == 4:
        _owner_feedback4(recv, values, acc, out, *args)
    elif fmt.wire_bits == 8:
        _owner_feedback_codes(recv, values, acc, out, *args)
    else:
        _owner_feedback_codes(recv.view(np.uint16), values, acc, out.view(np.uint16), *args)


def call(name: str, *args: object, **kwargs: object) -> object:
    """The kernel ``name`` of this module, looked up when called.

    A call bound to a kernel function itself escapes whoever wraps the module's
    kernels to count them (``benchmarks.hostcost``); bound through this, it does not.

    Example:
        >>> out = torch.zeros(1)
        >>> call("mean_rows", torch.ones(2, 1), out)  # doctest: +SKIP
    """
    return globals()[name](*args, **kwargs)
