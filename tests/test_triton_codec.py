"""The Triton codec under Triton's interpreter, bit for bit against the numba kernels.

The kernels round with integer operations only, so the interpreter
(``TRITON_INTERPRET=1``) writes on CPU tensors the bytes a GPU writes. Every
format the kernels take (the built-ins, 9-16-bit customs, fn/none specials,
packed 4-bit ones, unusual biases): encode with per-layer scales (ties,
subnormals, saturation, inf and NaN, empty and odd segments, an odd 4-bit
count, several programs per call), decode of every bit pattern, the owner's
reduction and the shard mean, payloads at odd byte offsets, block scaling
(a factor per block of each layer, windows cutting blocks), the owner's step
with block exponents (agreed, or each rank's own with its shard); the PTX the
kernels compile to for a GPU; how the codec picks the backend, with and
without Triton. Every interpreted launch here, on every rank of the multi-rank
jobs too, touches only its own tensors (:func:`_bounds_checked`): a read past
a tensor's end, or from an empty one's address 0, faults on a GPU where the
interpreter seldom notices.

``triton.jit`` reads ``TRITON_INTERPRET`` when it builds a kernel, i.e. when
:mod:`aps_comm.triton_codec` is imported: the fixture imports (or reloads) it
with the variable set, and reloads it as it was afterwards, so the rest of a
session (a CUDA test) sees compiled kernels.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import itertools
import os
import re
import sys
import types
import unittest.mock
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from aps_comm import codec, cpu_kernels, scaling
from aps_comm import formats as F
from aps_comm.formats import FloatFormat, code_table, get_format, payload_nbytes, pow2

try:
    import triton

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

needs_triton = pytest.mark.skipif(
    not HAVE_TRITON, reason="triton is not installed (pip install triton; in the test extra)"
)

FORMATS = [
    *(f for f in F.FORMATS.values() if f.wire_bits <= 16),
    get_format("e5m3"),
    get_format("e4m4"),
    get_format("e6m9"),
    FloatFormat(5, 3, specials="fn", name="e5m3fn"),
    FloatFormat(6, 9, specials="fn", name="e6m9fn"),
    FloatFormat(4, 4, specials="none", name="e4m4none"),
    FloatFormat(4, 3, specials="none", name="e4m3none"),
    FloatFormat(3, 3, specials="fn", bias=5, name="e3m3fn-b5"),
    FloatFormat(3, 2, specials="ieee", bias=-3, name="e3m2-b-3"),  # negative bias
    FloatFormat(5, 2, specials="ieee", bias=40, name="e5m2-b40"),  # float32-subnormal codes
    FloatFormat(2, 2, specials="none", name="e2m2none"),
    FloatFormat(2, 1, specials="ieee", name="e2m1ieee"),  # 4 bits, packed, inf and NaN
    FloatFormat(2, 1, specials="fn", name="e2m1fn"),
    FloatFormat(3, 0, specials="fn", name="e3m0fn"),
    FloatFormat(1, 2, specials="none", name="e1m2none"),
    FloatFormat(2, 0, specials="none", name="e2m0none"),  # 3 bits, packed
]
IDS = [f.name for f in FORMATS]
# Segments: empty ones, a single element, odd sizes, one across the kernels'
# program boundary (1010 to 1050); the rest takes what is left.
SIZES = [0, 1, 7, 0, 1000, 2, 40]
# Powers of two (APS), a subnormal float32 factor, one that overflows, one no power of two.
SCALES = [8.0, 2.0**-140, 0.5, 2.0**100, 3.0, 2.0**-20, 0.25, 1.0]


@pytest.fixture(scope="module")
def tc() -> Iterator[types.ModuleType]:
    """:mod:`aps_comm.triton_codec` built for the interpreter (restored afterwards)."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton; in the test extra)")
    with _loaded(interpret=True) as module:
        assert module.INTERPRETED
        yield module


@contextlib.contextmanager
def _loaded(*, interpret: bool, hide_triton: bool = False) -> Iterator[types.ModuleType]:
    """aps_comm.triton_codec built as asked, then rebuilt as it was (or as the
    environment says, where it was not imported yet)."""
    import aps_comm.triton_codec as module

    was = module.INTERPRETED if module.AVAILABLE else None
    try:
        yield _load(interpret=interpret, hide_triton=hide_triton)
    finally:
        _load(interpret=was)


def _load(*, interpret: bool | None = None, hide_triton: bool = False) -> types.ModuleType:
    """(Re)import aps_comm.triton_codec with TRITON_INTERPRET set (True), unset (False)
    or as the environment has it (None); with triton hidden (``hide_triton``)."""
    old = os.environ.get("TRITON_INTERPRET")
    saved = {k: v for k, v in sys.modules.items() if k == "triton" or k.startswith("triton.")}
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    elif interpret is not None:
        os.environ.pop("TRITON_INTERPRET", None)
    if hide_triton:
        for k in saved:
            del sys.modules[k]
        sys.modules["triton"] = None  # type: ignore[assignment] - import fails
    try:
        import aps_comm.triton_codec as module

        return importlib.reload(module)
    finally:
        if hide_triton:
            del sys.modules["triton"]
            sys.modules.update(saved)
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _values(fmt: FloatFormat) -> torch.Tensor:
    """The format's values, the ties between them and their neighbours, random
    magnitudes over its range and beyond, subnormals, zeros, inf and NaN."""
    table = code_table(fmt)
    vals = np.unique(table[np.isfinite(table)])
    if vals.size > 600:  # 16-bit formats: a spread of their values
        vals = np.unique(np.concatenate([vals[::211], vals[:100], vals[-100:]]))
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
    near = [np.nextafter(mids, np.float32(v)) for v in (np.inf, -np.inf)]
    rng = np.random.default_rng(fmt.bits)
    rand = rng.standard_normal(1200) * 2.0 ** rng.integers(-60, 60, 1200) * min(fmt.max, 1e30)
    edges = [fmt.max, -fmt.max, 2 * min(fmt.max, 1e38), fmt.min_subnormal / 2, 3e38, -3.4e38]
    edges += [1e-40, -3e-39, 2.0**-149]  # float32 subnormals
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan]
    with np.errstate(over="ignore"):  # beyond float32 is inf: wanted
        x = np.concatenate([vals, mids, *near, rand, edges, specials]).astype(np.float32)
    x = rng.permutation(x)
    return torch.from_numpy(x[: x.size - 1 + x.size % 2])  # odd: a half-filled 4-bit byte


def _layout(numel: int) -> tuple[codec.Layout, torch.Tensor]:
    assert numel >= sum(SIZES)
    sizes = [*SIZES, numel - sum(SIZES)]
    return codec.Layout.from_numels(sizes, torch.device("cpu")), torch.tensor(SCALES)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """int32 bits with every NaN the same NaN (a NaN's payload is not the codec's)."""
    return torch.where(x.isnan(), float("nan"), x).view(torch.int32)


def _quiet(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    # The interpreter computes with numpy, which warns where a float op gives inf.
    with np.errstate(all="ignore"):
        return fn(*args, **kwargs)


def _extent(t: torch.Tensor) -> int:
    """The bytes from ``t``'s first element to the end of its last (0 when empty)."""
    if not t.numel():
        return 0
    return t.element_size() * (
        1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    )


@contextlib.contextmanager
def _bounds_checked() -> Iterator[list[str]]:
    """Every load, store and atomic of an interpreted kernel checked against the tensors
    of its launch: the faults (kernel, access, addresses outside them) are listed in
    the yielded list, and those lanes are not accessed.

    The interpreter reads raw memory: a read past a small tensor's end seldom crashes
    it, and an empty tensor's address 0 segfaults it, where a GPU faults ("illegal
    memory access") or reads another allocation. Each launch's tensors span
    ``[data_ptr, data_ptr + extent)``; an active lane's element must lie in one of them.
    """
    from triton.runtime import interpreter

    faults: list[str] = []
    launch: list = [np.zeros(0, np.uint64), np.zeros(0, np.uint64), ""]
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    init, load, store, rmw = (
        executor._init_args_hst,
        builder.create_masked_load,
        builder.create_masked_store,
        builder.create_atomic_rmw,
    )

    def init_args(self: Any, args: Any, kwargs: Any) -> Any:
        hst = init(self, args, kwargs)
        tensors = [t for t in [*hst[0], *hst[1].values()] if isinstance(t, torch.Tensor)]
        starts = np.array([t.data_ptr() for t in tensors], np.uint64)
        launch[:] = [starts, starts + np.array([_extent(t) for t in tensors], np.uint64)]
        launch.append(self.fn.__name__)
        return hst

    def checked(what: str, ptrs: Any, mask: Any) -> Any:
        size = interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize
        addr = ptrs.data.astype(np.uint64)
        active = np.broadcast_to(mask.data, addr.shape)
        inside = (addr[..., None] >= launch[0]) & (addr[..., None] + size <= launch[1])
        bad = active & ~inside.any(-1)
        if bad.any():
            faults.append(f"{launch[2]}: {what} of {int(bad.sum())} lanes outside its tensors")
            mask = interpreter.TensorHandle(active & ~bad, mask.dtype)
        return mask

    def masked_load(self: Any, ptrs: Any, mask: Any, *args: Any) -> Any:
        return load(self, ptrs, checked("load", ptrs, mask), *args)

    def masked_store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any) -> Any:
        return store(self, ptrs, value, checked("store", ptrs, mask), *args)

    def atomic_rmw(self: Any, op: Any, ptr: Any, val: Any, mask: Any, *args: Any) -> Any:
        return rmw(self, op, ptr, val, checked("atomic", ptr, mask), *args)

    executor._init_args_hst = init_args
    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    builder.create_atomic_rmw = atomic_rmw
    try:
        yield faults
    finally:
        executor._init_args_hst = init
        builder.create_masked_load, builder.create_masked_store = load, store
        builder.create_atomic_rmw = rmw


@pytest.fixture(autouse=True)
def _in_bounds() -> Iterator[None]:
    """Every interpreted launch of every test here accesses only its own tensors."""
    if not HAVE_TRITON:
        yield
        return
    with _bounds_checked() as faults:
        yield
    assert faults == [], sorted(set(faults))


def _checked_ranks(fn: Callable[..., list]) -> Callable[..., list]:
    """A multi-rank test's per-rank function, its interpreted launches checked as every
    test's here are (:func:`_bounds_checked`) on each rank."""

    @functools.wraps(fn)
    def run(rank: int, world_size: int, *args: Any) -> list:
        with _bounds_checked() as faults:
            results = fn(rank, world_size, *args)
        assert faults == [], (rank, sorted(set(faults)))
        return results

    return run


@needs_triton
@pytest.mark.filterwarnings("error::UserWarning")  # Triton's: a shift past 32 bits
@pytest.mark.parametrize("fmt", [F.E4M3, F.E2M1, get_format("e5m3")], ids=lambda f: f.name)
def test_kernels_compile_for_a_gpu(fmt: FloatFormat) -> None:
    # What the interpreter ran is what a GPU runs: Triton compiles the kernels for
    # sm_90 without one, and their float operations round once, to nearest, keeping
    # subnormals (no .ftz, no fused multiply-add, no approximate division). First in
    # the file: Triton 3.4's interpreter leaves patches behind that break compiling.
    with _loaded(interpret=False) as module:
        kernels = module.ptx(fmt)
        block = module.ptx(fmt, block_size=32)
        kernels |= {f"block {k}": block[k] for k in ("encode", "decode")}
        for name, ptx in kernels.items():
            ops = set(re.findall(r"\b(?:add|sub|mul|div|fma|mad)\.[a-z0-9.]*f(?:32|64)\b", ptx))
            # Exponents from agreed maxima: float64 products of 24-bit operands, exact.
            allowed = {"mul.rn.f64"} if "maxima" in name else set()
            assert ops <= {"mul.rn.f32", "add.rn.f32", "div.rn.f64", *allowed}, (name, ops)
            assert ".ftz" not in ptx and ".approx" not in ptx, name
            if name != "maxima":  # the maxima kernel stores int32 bits
                assert ".global.b8" in ptx or ".global.u8" in ptx, name  # byte stores, any offset


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_encode_matches_kernels(tc: types.ModuleType, fmt: FloatFormat) -> None:
    x = _values(fmt)
    assert x.numel() % 2 == 1 and x.numel() > tc.BLOCK  # two programs or more
    layout, scale = _layout(x.numel())
    ref = codec.encode(x, fmt, scale=scale, layout=layout, backend="kernels")
    got = _quiet(codec.encode, x, fmt, scale=scale, layout=layout, backend="triton")
    assert torch.equal(got, ref)
    assert torch.equal(_quiet(codec.encode, x, fmt, backend="triton"), codec.encode(x, fmt))
    one = torch.tensor([0.25])
    assert torch.equal(
        _quiet(codec.encode, x, fmt, scale=one, backend="triton"),
        codec.encode(x, fmt, scale=one, backend="kernels"),
    )
    if fmt.wire_bits == 4:  # the odd element's byte: the low nibble, a zero high one
        assert got[-1] >> 4 == 0
    # Other float inputs are read as they are and rounded to float32 as the kernels do.
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        y = x.to(dtype)
        assert torch.equal(_quiet(codec.encode, y, fmt, backend="triton"), codec.encode(y, fmt))


@pytest.mark.parametrize("block_size", [0, 32])
def test_bound_calls_read_each_programs_segments_from_a_table(
    tc: types.ModuleType, block_size: int
) -> None:
    # A bound encode or decode (a settled bucket's, run every step) finds each program's
    # first and last segment once, at binding, rather than by two binary searches per
    # program per run: the table holds what the search finds (empty segments, a window
    # of block offsets before 0 and past the end, the encode's padding programs), and
    # the calls write the unbound calls' bits.
    fmt = F.E4M3
    numel, pad = 5 * tc.BLOCK + 77, 3 * tc.BLOCK + 5
    sizes = [0, 3, tc.BLOCK - 1, 0, 2 * tc.BLOCK + 7, 1, numel - 3 * tc.BLOCK - 10]
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64)
    x = torch.randn(numel) * 100
    kw: dict[str, Any] = {}
    if block_size:
        offsets = offsets - 40  # a window: the first segment began before it
        offsets[-1] = numel + 9  # and the last one ends after it
        first = torch.tensor([0, 1, 3, 40, 42, 200, 260], dtype=torch.int64)
        factors = torch.exp2(torch.randint(-3, 4, (400,)).float())
        kw = {"block_size": block_size, "first_block": first}
    else:
        factors = torch.exp2(torch.randint(-3, 4, (len(sizes),)).float())
    out = torch.empty(payload_nbytes(numel + pad, fmt), dtype=torch.uint8)
    call = tc.bind_encode(x, out, fmt, offsets, factors, pad=pad, table=True, **kw)
    assert call.keywords["TABLE"]
    programs = -(-(numel + pad) // tc.BLOCK)
    first_el = np.minimum(np.arange(programs) * tc.BLOCK, numel - 1)
    last_el = np.minimum(first_el + tc.BLOCK, numel) - 1
    off = offsets.numpy()
    want = np.stack([np.searchsorted(off[:-1], e, side="right") - 1 for e in (first_el, last_el)])
    assert np.array_equal(call.args[5].view(-1, 2).numpy(), want.T.clip(0))
    _quiet(call)
    searched = torch.empty_like(out)
    _quiet(tc.bind_encode(x, searched, fmt, offsets, factors, pad=pad, **kw))
    assert torch.equal(out, searched)
    back, back_searched = torch.empty(numel), torch.empty(numel)
    decode = tc.bind_decode(out, back, fmt, offsets, 1 / factors, table=True, **kw)
    assert decode.keywords["TABLE"]
    _quiet(decode)
    _quiet(tc.bind_decode(out, back_searched, fmt, offsets, 1 / factors, **kw))
    assert torch.equal(_bits(back), _bits(back_searched))
    if not block_size:  # the layers' maxima: the other pass a settled bucket runs per step
        maxima = torch.zeros(len(sizes))
        call = tc.bind_layer_maxima(x, maxima, offsets, table=True)
        assert call.keywords["TABLE"]
        call()
        assert torch.equal(maxima, codec.segment_amax(x, codec.Layout.from_numels(sizes, x.device)))


def _every_code(fmt: FloatFormat) -> torch.Tensor:
    """A payload holding every bit pattern of a wire element (bits above the format's too);
    for 16 bits every high byte with 58 low ones (the extremes among them)."""
    if fmt.wire_bits == 16:
        low = torch.cat([torch.arange(0, 256, 5), torch.tensor([1, 2, 3, 4, 254, 253, 252])])
        codes = (torch.arange(256)[:, None] * 256 + low[None, :]).reshape(-1).to(torch.int32)
        return codes.view(torch.uint8)[torch.arange(4 * codes.numel()) % 4 < 2]
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(5)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_decode_matches_kernels(tc: types.ModuleType, fmt: FloatFormat) -> None:
    payload = _every_code(fmt)
    numel = payload.numel() * 8 // fmt.wire_bits - (fmt.wire_bits == 4)  # odd 4-bit count
    layout, scale = _layout(numel)
    ref = codec.decode(payload, fmt, numel, scale=scale, layout=layout, backend="kernels")
    got = _quiet(codec.decode, payload, fmt, numel, scale=scale, layout=layout, backend="triton")
    assert torch.equal(_bits(got), _bits(ref))
    if fmt.wire_bits == 16:  # unscaled: 2048 random codes of the 65536 (time)
        payload = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator())
    numel = payload.numel() * 8 // fmt.wire_bits
    plain = _quiet(codec.decode, payload, fmt, numel, backend="triton")
    assert torch.equal(_bits(plain), _bits(codec.decode(payload, fmt, numel)))
    # Zeros keep their sign; no NaN appears where the format has none.
    assert torch.equal(plain.view(torch.int32) == 0, _bits(F.decode(payload, fmt, numel)) == 0)
    assert fmt.has_nan or not plain.isnan().any()


def _shards(fmt: FloatFormat, n_ranks: int, shard: int) -> torch.Tensor:
    """N encoded shards of ``shard`` elements: values near the top (sums overflow), tiny
    ones, -0, and the specials the format holds."""
    gen = torch.Generator().manual_seed(n_ranks * 97 + fmt.bits)
    parts = []
    for _ in range(n_ranks):
        x = torch.randn(shard, generator=gen) * min(fmt.max, 1e30) / 3
        x[:: max(shard // 5, 1)] *= 2.0**-40
        x[7] = -0.0
        if fmt.has_nan:
            x[3], x[5] = float("inf"), float("nan")
        parts.append(F.encode(x.clamp(-fmt.max, fmt.max) if not fmt.has_nan else x, fmt))
    return torch.cat(parts)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_owner_reduce_and_shard_mean_match_kernels(tc: types.ModuleType, fmt: FloatFormat) -> None:
    # 1100 elements: two programs per call. Divisor 1: the sum, not divided.
    for n_ranks, shard, divisors in ((1, 101, (1,)), (5, 1100, (None, 3))):
        recv = _shards(fmt, n_ranks, shard)
        got = _quiet(codec.owner_reduce, recv, fmt, n_ranks, backend="triton")
        assert torch.equal(got, codec.owner_reduce(recv, fmt, n_ranks, backend="kernels"))
        for divisor in divisors:
            mean = _quiet(codec.shard_mean, recv, fmt, n_ranks, divisor=divisor, backend="triton")
            ref = codec.shard_mean(recv, fmt, n_ranks, divisor=divisor, backend="kernels")
            assert torch.equal(_bits(mean), _bits(ref)), divisor
    # Random bytes: every code, NaN and inf among them, in every rank's slot; N a
    # power of two (the division is a multiply by 1/N there).
    recv = torch.randint(0, 256, (4 * 302,), dtype=torch.uint8, generator=torch.Generator())
    got = _quiet(codec.owner_reduce, recv, fmt, 4, backend="triton")
    assert torch.equal(got, codec.owner_reduce(recv, fmt, 4, backend="kernels"))
    mean = _quiet(codec.shard_mean, recv, fmt, 4, backend="triton")
    assert torch.equal(_bits(mean), _bits(codec.shard_mean(recv, fmt, 4, backend="kernels")))


@pytest.mark.parametrize(
    "fmt", [F.FP16, F.BF16, F.E4M3, F.E2M1, get_format("e5m3")], ids=lambda f: f.name
)
def test_any_byte_offset(tc: types.ModuleType, fmt: FloatFormat) -> None:
    # A bucket mixing formats packs a 2-byte format at any byte.
    x = _values(fmt)[:1101]
    layout, scale = _layout(x.numel())
    need = payload_nbytes(x.numel(), fmt)
    aligned = codec.encode(x, fmt, scale=scale, layout=layout, backend="kernels")
    values = codec.decode(aligned, fmt, x.numel(), scale=scale, layout=layout, backend="kernels")
    for offset in (1, 3):
        buf = torch.full((need + offset + 5,), 0xA5, dtype=torch.uint8)
        out = buf[offset : offset + need]
        _quiet(codec.encode, x, fmt, out=out, scale=scale, layout=layout, backend="triton")
        assert torch.equal(out, aligned), offset
        assert torch.all(buf[:offset] == 0xA5) and torch.all(buf[offset + need :] == 0xA5)
        back = _quiet(
            codec.decode, buf[offset:], fmt, x.numel(), scale=scale, layout=layout, backend="triton"
        )
        assert torch.equal(_bits(back), _bits(values)), offset
        if fmt.wire_bits == 4 or x.numel() % 2 == 0:
            reduced = _quiet(codec.owner_reduce, out, fmt, 1, backend="triton")
            assert torch.equal(reduced, codec.owner_reduce(out, fmt, 1, backend="kernels"))


BLOCK_FORMATS = [F.E4M3, F.E2M1, get_format("e5m3"), F.E3M2]


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=lambda f: f.name)
def test_block_scaling_matches_kernels(
    tc: types.ModuleType, fmt: FloatFormat, block_size: int
) -> None:
    # Block scaling: every layer cut into blocks from its start (the last one short),
    # a factor per block. The kernels' reference: each block its own segment.
    sizes = [0, 37, 64, 5, 0, 1000, 301]
    layers = torch.tensor([0, *np.cumsum(sizes)], dtype=torch.int64)
    counts = [-(-n // block_size) for n in sizes]
    starts = [int(layers[i]) + k * block_size for i, c in enumerate(counts) for k in range(c)]
    blocks = torch.tensor([*starts, int(layers[-1])], dtype=torch.int64)
    per_block = codec.Layout.from_numels(blocks.diff().tolist(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(block_size)
    n_blocks = sum(counts)
    scale = torch.exp2(torch.randint(-20, 21, (n_blocks,), generator=gen).float())
    scale[3], scale[-2] = 3.0, 2.0**-140  # no power of two; a subnormal float32
    unscale = 1 / scale
    unscale[5] = float("nan")  # a layer made NaN
    x = _values(fmt).repeat(2)[: int(layers[-1])]
    x = x * torch.exp2(torch.randint(-20, 21, x.shape, generator=gen).float())
    ref = codec.encode(x, fmt, scale=scale, layout=per_block, backend="kernels")
    # The whole buffer, then windows (chunks of the bucket) from inside a block, from
    # a layer's start, to inside a block: the layers' offsets relative to the window
    # (negative before it), the factors from the block holding its first element.
    for lo, hi in ((0, x.numel()), (50, 1201), (106, 1307)):
        b0 = int(torch.searchsorted(blocks, lo, right=True)) - 1
        window = per_block.window(lo, hi)
        offsets, first = tc.block_segments(layers, block_size, lo)
        kw = {"block_size": block_size, "first_block": first}
        ref = codec.encode(x[lo:hi], fmt, scale=scale, layout=window, backend="kernels")
        got = torch.empty_like(ref)
        _quiet(tc.encode, x[lo:hi], got, fmt, offsets, scale[b0:], **kw)
        assert torch.equal(got, ref), lo
        if not lo:  # a shard's padding: its lanes read no factor past the last block's
            padded = torch.full((payload_nbytes(hi + 3000, fmt),), 0xA5, dtype=torch.uint8)
            _quiet(tc.encode, x, padded, fmt, offsets, scale, pad=3000, **kw)
            assert torch.equal(padded[: ref.numel()], ref) and not padded[ref.numel() :].any()
        back = codec.decode(ref, fmt, hi - lo, scale=unscale, layout=window, backend="kernels")
        mine = torch.empty(hi - lo)
        _quiet(tc.decode, ref, mine, fmt, offsets, unscale[b0:], **kw)
        assert torch.equal(_bits(mine), _bits(back)), lo


def test_empty_and_bad_inputs(tc: types.ModuleType) -> None:
    empty = torch.empty(0)
    layout = codec.Layout.from_numels([0, 0], empty.device)
    scale = torch.ones(2)
    assert codec.encode(empty, "e4m3", scale=scale, layout=layout, backend="triton").numel() == 0
    assert codec.decode(torch.empty(0, dtype=torch.uint8), "e2m1", 0, backend="triton").numel() == 0
    nothing = torch.empty(0, dtype=torch.uint8)
    assert codec.owner_reduce(nothing, "e4m3", 3, backend="triton").numel() == 0
    assert codec.shard_mean(nothing, "e4m3", 3, backend="triton").numel() == 0
    out = torch.empty(2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 factors need"):
        tc.encode(torch.ones(2), out, F.E4M3, None, torch.ones(2))
    with pytest.raises(ValueError, match="offsets must hold 3"):
        tc.encode(torch.ones(2), out, F.E4M3, torch.tensor([0, 2]), torch.ones(2))
    with pytest.raises(ValueError, match="fp32"):
        tc.format_constants(F.FP32)
    offsets, first = torch.tensor([0, 2]), torch.tensor([0])
    with pytest.raises(ValueError, match=r"power of two >= 2 .* got 24"):
        tc.encode(
            torch.ones(2), out, F.E4M3, offsets, torch.ones(1), block_size=24, first_block=first
        )
    with pytest.raises(ValueError, match="first blocks"):
        tc.encode(torch.ones(2), out, F.E4M3, offsets, torch.ones(1), block_size=8)
    with pytest.raises(ValueError, match=r"divisor must be an int from 1 .* got 0"):
        tc.shard_mean(torch.zeros(4, dtype=torch.uint8), 2, F.E4M3, torch.empty(2), 0)
    with pytest.raises(ValueError, match="need factors"):
        tc.decode(out, torch.empty(2), F.E4M3, offsets)


def test_backend_choice(tc: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert codec.Codec("e4m3", cpu, "triton").backend == "triton"
    assert codec.backend_for("e4m3", cpu) == "kernels"  # auto keeps the numba kernels
    with pytest.raises(ValueError, match=r"backend='triton' needs .* got fp32 on cpu"):
        codec.Codec("fp32", cpu, "triton")
    with pytest.raises(ValueError, match="got e4m3 on meta"):
        codec.Codec("e4m3", torch.device("meta"), "triton")
    # On CUDA "auto" picks the kernels for every format they take (as if compiled there).
    monkeypatch.setattr(tc, "runs_on", lambda device: torch.device(device).type == "cuda")
    cuda = torch.device("cuda")
    assert [codec.backend_for(f, cuda) for f in ("e4m3", "e3m2", "e5m3", "fp16", "fp32")] == [
        "triton",
        "triton",
        "triton",
        "triton",
        "cast",
    ]
    monkeypatch.setattr(tc, "AVAILABLE", False)
    assert [codec.backend_for(f, cuda) for f in ("e4m3", "e3m2")] == ["cast", "bits"]


def test_a_failing_first_launch_keeps_the_torch_ops(
    tc: types.ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # E.g. no C compiler for Triton's launcher: "auto" must not pick a backend that
    # would fail in the first backward; an explicit "triton" says why.
    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(tc, "_PROBED", {})
    monkeypatch.setattr(tc, "bind_encode", fail)
    cpu = torch.device("cpu")
    assert not tc.runs_on(cpu) and not tc.runs_on(cpu)
    assert [r.getMessage().count("C compiler") for r in caplog.records] == [1]  # once
    with pytest.raises(ValueError, match=r"on cpu .*RuntimeError: Failed to find C compiler"):
        codec.Codec("e2m1", cpu, "triton")
    assert tc.launch_problem(torch.device("meta")).endswith("not meta ones")


def test_without_triton() -> None:
    # Triton is optional: the module imports, says no, and the codec keeps torch ops.
    with _loaded(interpret=False, hide_triton=True) as hidden:
        assert not hidden.AVAILABLE and not hidden.INTERPRETED
        assert not hidden.supports(F.E4M3) and not hidden.runs_on(torch.device("cuda"))
        assert codec.backend_for("e4m3", torch.device("cuda")) == "cast"
        with pytest.raises(ValueError, match="backend='triton' needs triton installed"):
            codec.Codec("e4m3", torch.device("cpu"), "triton")
        with pytest.raises(RuntimeError, match="needs triton"):
            hidden.encode(torch.ones(1), torch.empty(1, dtype=torch.uint8), F.E4M3)


OWNER_FORMATS = [
    *(get_format(n) for n in ("e4m3", "e5m2", "e3m2", "e2m1", "fp16", "bf16", "e5m3")),
    FloatFormat(2, 1, specials="ieee", name="e2m1ieee"),  # 4 bits with inf and NaN
    FloatFormat(3, 2, specials="ieee", bias=-3, name="e3m2-b-3"),  # the kernels' table decode
    FloatFormat(3, 4, specials="ieee", bias=127, name="e3m4-b127"),  # float32-subnormal means
    FloatFormat(3, 1, specials="fn", bias=127, name="e3m1fn-b127"),  # max 2**-120: mantissa 0
]


@contextlib.contextmanager
def _atomic_lanes() -> Iterator[collections.Counter]:
    """The active lanes of every atomic the interpreter runs, counted per program (its
    first grid index): on a GPU, atomics on one address serialise."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    rmw = builder.create_atomic_rmw
    lanes: collections.Counter = collections.Counter()

    def counted(self: Any, op: Any, ptr: Any, val: Any, mask: Any, *args: Any) -> Any:
        lanes[self.grid_idx[0]] += int(np.broadcast_to(mask.data, ptr.data.shape).sum())
        return rmw(self, op, ptr, val, mask, *args)

    builder.create_atomic_rmw = counted
    try:
        yield lanes
    finally:
        builder.create_atomic_rmw = rmw


@contextlib.contextmanager
def _program_order(monkeypatch: pytest.MonkeyPatch, backwards: bool) -> Iterator[None]:
    """Run the interpreter's programs in reverse order along the grid's first axis."""
    if not backwards:
        yield
        return
    from triton.runtime.interpreter import interpreter_builder as builder

    dims = []
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx

    def dim(x: int, y: int, z: int) -> None:
        dims.append(x)
        set_dim(x, y, z)

    def idx(x: int, y: int, z: int) -> None:
        set_idx(dims[-1] - 1 - x, y, z)

    with monkeypatch.context() as m:
        m.setattr(builder, "set_grid_dim", dim)
        m.setattr(builder, "set_grid_idx", idx)
        yield
    assert dims, "the interpreter no longer sets its grid through set_grid_dim"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", OWNER_FORMATS, ids=lambda f: f.name)
def test_owner_reduce_blocks_matches_kernels(
    tc: types.ModuleType, fmt: FloatFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The owner's step with block exponents: random codes of N ranks (every code, NaN
    # and inf among them), a third of the shard the format's subnormals only, a zero
    # block; random agreed exponents. Small tiles: many programs, 4-bit blocks at odd
    # offsets sharing a byte with another program's block.
    numels = [37, 0, 64, 5, 300, 1, 98]  # odd in all: the last byte half filled
    # Tiles of 8 rows of 8, 64 rows of 32 (the default), 2 rows of 256 (1 block and its lead).
    for block_size, n_ranks, tile in ((8, 3, 64), (32, 4, tc.TILE), (256, 1, 256)):
        monkeypatch.setattr(tc, "TILE", tile)
        layout = codec.Layout.from_numels(numels, torch.device("cpu")).grid(block_size).layout
        numel, need = layout.numel, payload_nbytes(layout.numel, fmt)
        shard = need + (2 if fmt.wire_bits == 16 else 1)
        gen = torch.Generator().manual_seed(block_size)
        recv = torch.randint(0, 256, (n_ranks * shard,), dtype=torch.uint8, generator=gen)
        tiny = torch.randint(-(2**fmt.man_bits), 2**fmt.man_bits, (numel,), generator=gen)
        for r in range(n_ranks):
            part = recv[r * shard : r * shard + need]
            x = F.decode(part, fmt, numel)
            x[: numel // 3] = tiny[: numel // 3] * fmt.min_subnormal
            x[200:208] = 0.0
            F.encode(x, fmt, out=part)
        exps = torch.randint(-126, 127, (layout.n_segments,), dtype=torch.int32, generator=gen)
        ref, ref_d = codec.owner_reduce_blocks(recv, fmt, n_ranks, layout, exps, backend="kernels")
        # 4 bits: programs run first to last, then last to first. A byte two programs
        # wrote (a GPU race) would come out wrong in one order or the other.
        for backwards in (False, True) if fmt.wire_bits == 4 else (False,):
            buf = torch.full((need + 4,), 0xA5, dtype=torch.uint8)
            with _program_order(monkeypatch, backwards):
                got, d = _quiet(
                    codec.owner_reduce_blocks,
                    recv,
                    fmt,
                    n_ranks,
                    layout,
                    exps,
                    out=buf[1 : need + 1],
                    backend="triton",
                )
            assert torch.equal(got, ref) and torch.equal(d, ref_d), (block_size, n_ranks, backwards)
            assert buf[0] == 0xA5 and torch.all(buf[need + 1 :] == 0xA5)
    with pytest.raises(ValueError, match="blocks of at most 4096 elements, got one of 5000"):
        tc.reduce_blocks(recv, 1, fmt, layout.device_offsets, exps, got, d, 126, 5000)


def _rank_rows(
    fmt: FloatFormat, n_ranks: int, layout: codec.Layout, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(recv, factors) of an owner whose ranks encoded with their own block exponents.

    Rows of random codes (a third the format's subnormals) and then bytes the
    owner must skip (the senders' exponents, in two_phase); each block's
    exponent random, some at +-126, every rank's up to 6 binades from it. A
    zero block; NaN and inf blocks where the format has them.
    """
    numel, n_blocks = layout.numel, layout.n_segments
    need = payload_nbytes(numel, fmt)
    row = need + n_blocks + 3
    row += row % 2 if fmt.wire_bits == 16 else 0  # whole elements
    recv = torch.randint(0, 256, (n_ranks * row,), dtype=torch.uint8, generator=gen)
    at = layout.offsets.tolist()
    zero, nan, inf, opposite = (layout.offsets.diff() >= 4).nonzero()[[1, 2, 3, -1], 0].tolist()
    for r in range(n_ranks):
        part = recv[r * row : r * row + need]
        x = F.decode(part, fmt, numel)
        x[~x.isfinite()] = 0.0  # non-finite values only where placed below
        tiny = torch.randint(-(2**fmt.man_bits), 2**fmt.man_bits, (numel // 3,), generator=gen)
        x[: numel // 3] = tiny * fmt.min_subnormal
        x[at[zero] : at[zero + 1]] = 0.0
        if fmt.has_nan:
            x[at[nan] + r] = float("nan")
        if fmt.has_inf:  # +inf on every rank; +inf on one, -inf on the others: NaN
            x[at[inf] + 1] = float("inf")
            x[at[opposite]] = float("inf") if r == 0 else float("-inf")
        F.encode(x, fmt, out=part)
    base = torch.randint(-126, 127, (n_blocks,), generator=gen)
    base[::5], base[1::7] = 126, -126  # products below float32's normals; overflowing
    shift = torch.randint(-6, 7, (n_ranks, n_blocks), generator=gen)
    return recv, pow2(-(base + shift).clamp(-126, 126))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", OWNER_FORMATS, ids=lambda f: f.name)
def test_owner_reduce_rank_blocks_matches_kernels(
    tc: types.ModuleType, fmt: FloatFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The owner's step with every rank's own block exponents: rank r's values times its
    # factors (each product rounded once), summed in rank order, divided by N; each
    # block's d from its max alone. Tiles as in the agreed test's.
    numels = [37, 0, 64, 5, 300, 1, 98]
    cpu = torch.device("cpu")
    kernels, triton_ = codec.Codec(fmt, cpu, "kernels"), codec.Codec(fmt, cpu, "triton")
    default_tile = tc.TILE
    for block_size, n_ranks, tile in ((8, 3, 64), (32, 4, default_tile), (256, 1, 256), (8, 2, 64)):
        monkeypatch.setattr(tc, "TILE", tile)
        layout = codec.Layout.from_numels(numels, cpu).grid(block_size).layout
        gen = torch.Generator().manual_seed(block_size * n_ranks)
        recv, factors = _rank_rows(fmt, n_ranks, layout, gen)
        ref, ref_d = kernels.owner_reduce_rank_blocks(recv, n_ranks, layout, factors)
        need = ref.numel()
        for backwards in (False, True) if fmt.wire_bits == 4 else (False,):
            buf = torch.full((need + 4,), 0xA5, dtype=torch.uint8)
            with _program_order(monkeypatch, backwards):
                got, d = _quiet(
                    triton_.owner_reduce_rank_blocks,
                    recv,
                    n_ranks,
                    layout,
                    factors,
                    out=buf[1 : need + 1],
                )
            assert torch.equal(got, ref) and torch.equal(d, ref_d), (block_size, n_ranks, backwards)
            assert buf[0] == 0xA5 and torch.all(buf[need + 1 :] == 0xA5)
    # The owner's own row: its float32 values in place of its decoded piece.
    own = torch.randn(layout.numel, generator=gen)
    mine, mine_d = kernels.owner_reduce_rank_blocks(
        recv, n_ranks, layout, factors, own=own, own_row=n_ranks - 1
    )
    assert not torch.equal(mine, ref)
    got, d = _quiet(
        triton_.owner_reduce_rank_blocks, recv, n_ranks, layout, factors, own=own, own_row=1
    )
    assert torch.equal(got, mine) and torch.equal(d, mine_d)
    # Factors in a column (a transposed tensor) are read as their values: the codec's
    # copy on the host, so one program (the default tile) shows it, not ten.
    monkeypatch.setattr(tc, "TILE", default_tile)
    cols = factors.t().contiguous().t()
    assert torch.equal(
        _quiet(triton_.owner_reduce_rank_blocks, recv, n_ranks, layout, cols)[0], ref
    )
    d = torch.empty(layout.n_segments, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"factors must be contiguous float32 of shape \(2, "):
        tc.reduce_rank_blocks(recv, 2, fmt, layout.device_offsets, cols, got, d, 126, 8)


_VECTOR = re.compile(r"\b(?:ld|st)\.global\.v[24]\.b32\b")

_KERNELS = (
    "_encode_kernel",
    "_decode_kernel",
    "_reduce_kernel",
    "_reduce_blocks_kernel",
    "_maxima_kernel",
    "_block_keys_kernel",
    "_send_rank_blocks_kernel",
    "_decode_rank_blocks_kernel",
    "_block_records_kernel",
    "_records_rows_kernel",
    "_staged_keys_kernel",
    "_staged_key_factors_kernel",
    "_maxima_factors_kernel",
    "_keep_lost_kernel",
    "_owner_lost_kernel",
    "_block_factors_kernel",
    "_native_block_keys_kernel",
    "_staged_factors_kernel",
    "_row_cell_keys_kernel",
    "_segments_kernel",
)


class _Recorder:
    """Stands in for a kernel under the interpreter: records each launch's arguments."""

    def __init__(self, name: str, kernel: object, log: list) -> None:
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid: object):  # type: ignore[no-untyped-def]
        launch = self.kernel[grid]  # type: ignore[index]

        def run(*args: object, **kwargs: object) -> object:
            self.log.append((self.name, args, kwargs))
            return launch(*args, **kwargs)

        return run


def _launch_everything(tc: types.ModuleType) -> None:
    """Every launcher of the codec, every variant it launches, for three wire widths."""
    cpu = torch.device("cpu")
    for fmt in (F.E4M3, F.E2M1, F.FP16):
        c = codec.Codec(fmt, cpu, "triton")
        numels = [5, 0, 700, 33, 2]
        layout = codec.Layout.from_numels(numels, cpu)
        x = torch.randn(layout.numel)
        scale = torch.full((len(numels),), 4.0)
        maxima = c.layer_maxima(x, layout, torch.empty(len(numels)))
        blocks = layout.grid(32)
        block_scale = torch.full((blocks.n_blocks,), 2.0)
        n = layout.numel
        variants = [
            {},
            {"scale": scale, "layout": layout},
            {"scale": block_scale, "layout": blocks.layout},
            {"scale": codec.AgreedMaxima(maxima, 3), "layout": layout},
            {"scale": codec.AgreedMaxima(maxima, 3, native=True), "layout": layout},
            {"scale": codec.AgreedMaxima(maxima, 4, native=True), "layout": layout},
        ]
        for kw in variants:
            payload = c.encode(x, **kw)
            c.decode(payload, n, out=torch.empty(n), **kw)
        padded = torch.empty(payload_nbytes(n + 6, fmt), dtype=torch.uint8)
        c.encode(x, out=padded, scale=codec.AgreedMaxima(maxima, 3), layout=layout, pad=6)
        shards = torch.cat([c.encode(x[:64]), c.encode(x[64:128])])
        c.owner_reduce(shards, 2)
        c.shard_mean(shards, 2)
        _bind_feedback_calls(c, x, layout, maxima)
        rows = blocks.layout.window(0, 64)
        shard = payload_nbytes(64, fmt)
        recv = torch.cat([c.encode(x[:64]), c.encode(x[:64])])
        d = torch.empty(rows.n_segments, dtype=torch.int32)
        out = torch.empty(shard, dtype=torch.uint8)
        exps = torch.zeros(rows.n_segments, dtype=torch.int32)
        tc.reduce_blocks(recv, 2, fmt, rows.device_offsets, exps, out, d, 126, 32)
        factors = torch.ones(2, rows.n_segments)
        tc.reduce_rank_blocks(recv, 2, fmt, rows.device_offsets, factors, out, d, 126, 32)
        _bind_rank_blocks(c, x, blocks)  # every rank's own block exponents, through the codec
        _bind_agreed_blocks(c, x, blocks)


def _bind_feedback_calls(
    c: codec.Codec, x: torch.Tensor, layout: codec.Layout, maxima: torch.Tensor
) -> None:
    """Error feedback's launches, bound by the codec and run: the factors of agreed maxima
    (two_phase; the native sum's with their inverse, 3 ranks and 4), what the encode lost,
    and the owner's loss of rank 1 of 2."""
    from aps_comm.plan import shard_layout

    n, k = x.numel(), maxima.numel()
    scale, inverse, unscale = (torch.empty(k) for _ in range(3))
    c.bind_feedback_factors(maxima, 2, scale, unscale)()
    for ranks in (3, 4):
        agreed = codec.AgreedMaxima(maxima, ranks, native=True)
        c.bind_agreed_factors(agreed, (scale, inverse, unscale), lambda: None)()
    payload = c.encode(x, scale=scale, layout=layout)
    residual = torch.zeros(n)
    c.bind_keep_lost(payload, x, torch.empty(n), unscale, layout, residual)()
    per, shard_bytes = shard_layout(n, c.fmt, 2)
    recv = c.encode(torch.cat([x, x])[: 2 * per])
    out = torch.empty(shard_bytes, dtype=torch.uint8)
    c.bind_owner_feedback(recv, 2, out, layout, (scale, unscale), 1, residual)()
    # Block keys: the native sum's, then their factors (two_phase's; the native sum's
    # with a power-of-two N and another, with the inverse).
    blocks = layout.grid(32)
    nb = blocks.n_blocks
    agreed = (torch.empty(nb), torch.empty(nb, dtype=torch.uint8))
    c.bind_native_block_keys(x, blocks.layout, agreed, 3, lambda: None)()
    block_scale, block_inverse, block_unscale = (torch.empty(nb) for _ in range(3))
    for ranks, inverse in ((1, None), (4, block_inverse), (3, block_inverse), (3, None)):
        out3 = (block_scale, inverse, block_unscale)
        c.bind_key_factors(agreed[1], blocks.counts, out3, ranks, lambda: None)()
    rows = torch.empty(4, k)
    for grid, none in ((False, False), (True, False), (True, True)):
        c.bind_staged_factors(maxima, 4, 2, grid, rows, none)()
    staged = c.bind_staged_records(x, layout, rows, maxima)
    assert staged is not None
    staged(torch.empty(k, 5, dtype=torch.float64))


def _bind_rank_blocks(c: codec.Codec, x: torch.Tensor, blocks: codec.Blocks) -> None:
    """The fused calls of two_phase with rank block exponents, bound by the codec (which
    probes each variant) and run: one chunk of 3 shards, the first one's flags."""
    offsets = blocks.layout.offsets.numpy().astype(np.int64)
    nb, n_layers = offsets.size - 1, blocks.counts.numel()
    layer_ends = np.cumsum(blocks.counts.numpy())
    keys, flags = torch.empty(nb, dtype=torch.uint8), torch.empty(n_layers, dtype=torch.uint8)
    union = torch.empty(n_layers, dtype=torch.uint8)
    call = c.bind_block_keys(x, blocks.layout, blocks.counts, torch.empty(nb), keys, flags, 3)
    assert call is not None
    call()
    firsts = np.array([0, nb // 3, nb // 3, nb], np.int64)
    sb = max(payload_nbytes(int(n), c.fmt) for n in np.diff(offsets[firsts]))
    piece = sb + nb + n_layers + 1
    shard = offsets[firsts[2] : firsts[3] + 1] - offsets[firsts[2]]
    chunk = codec.BlockChunk(
        x=x,
        keys=keys,
        flags=flags,
        union=union,
        offsets=offsets,
        firsts=firsts,
        layer_ends=layer_ends,
        shard=shard,
        send=torch.empty(3 * piece, dtype=torch.uint8),
        recv=torch.zeros(3 * piece, dtype=torch.uint8),
        out=torch.empty(piece, dtype=torch.uint8),
        gathered=torch.zeros(3 * piece, dtype=torch.uint8),
        shard_bytes=sb,
        at=sb + nb,
    )
    calls = c.bind_blocks(chunk)
    assert calls is not None
    send, owner, decode = calls
    send(3)
    owner()
    decode()


def _bind_agreed_blocks(c: codec.Codec, x: torch.Tensor, blocks: codec.Blocks) -> None:
    """The fused calls of two_phase with agreed block exponents, bound by the codec and
    run: the keys of 3 ranks, one chunk of 3 shards, the first one (the layers' flags);
    the records under the keys (stats=True)."""
    offsets = blocks.layout.offsets.numpy().astype(np.int64)
    nb, counts = offsets.size - 1, blocks.counts.numpy().astype(np.int64)
    keys, union = torch.empty(nb, dtype=torch.uint8), torch.empty(counts.size, dtype=torch.uint8)
    maxima = torch.empty(nb)
    # The union zeroed by the keys' kernel (agreed), for the first chunk's owner to set.
    call = c.bind_block_keys(x, blocks.layout, blocks.counts, maxima, keys, union, 3, True)
    assert call is not None
    call()
    records = c.bind_block_records(x, blocks, keys, maxima)
    assert records is not None
    records(torch.empty(counts.size, 5, dtype=torch.float64))
    for grid in (False, True):  # hierarchical's and grid's agreed block keys and factors
        staged = torch.empty(2 * nb, dtype=torch.uint8)
        rows = torch.empty(4, nb)
        calls = c.bind_staged_blocks(x, blocks, maxima, staged, (4, 2), grid, rows)
        assert calls is not None
        for call in calls:
            call()
    firsts = np.array([0, nb // 3, nb // 3, nb], np.int64)
    sb = max(payload_nbytes(int(n), c.fmt) for n in np.diff(offsets[firsts]))
    sb += -sb % 4  # 16-bit pieces of whole codes (the plan's)
    chunk = codec.BlockChunk(
        x=x,
        keys=keys,
        flags=union,
        union=union,
        offsets=offsets,
        firsts=firsts,
        layer_ends=np.cumsum(counts),
        shard=offsets[firsts[2] : firsts[3] + 1] - offsets[firsts[2]],
        first_block=int(firsts[2]),
        send=torch.empty(3 * sb, dtype=torch.uint8),
        recv=torch.zeros(3 * sb, dtype=torch.uint8),
        out=torch.empty(sb + nb, dtype=torch.uint8),
        gathered=torch.zeros(3 * (sb + nb), dtype=torch.uint8),
        shard_bytes=sb,
        at=0,  # the first chunk
    )
    calls = c.bind_blocks(chunk)
    assert calls is not None
    for call in calls:
        call()


@pytest.mark.slow
@needs_triton
def test_every_launched_variant_compiles_for_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the launchers pass, not hand-written signatures: the launches are recorded
    # under the interpreter, then bound by Triton's own binder for sm_90 and compiled.
    # A float32 placeholder for an int64 pointer once made every scaled encode fail
    # to compile on GPUs while hand-written signatures compiled.
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    log: list = []
    with _loaded(interpret=True) as tc:
        for name in _KERNELS:
            monkeypatch.setattr(tc, name, _Recorder(name, getattr(tc, name), log))
        _quiet(_launch_everything, tc)
        monkeypatch.undo()
    assert {name for name, _, _ in log} == set(_KERNELS), {name for name, _, _ in log}
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    compiled = set()
    vectors: dict[tuple[str, int], set[str]] = {}
    natives: set[str] = set()
    with _loaded(interpret=False) as module:
        # On a GPU of compute capability 8.9 or later e4m3 and e5m2 encode with the
        # hardware's conversion: every e4m3 variant is compiled that way too.
        plain, native = module.format_constants(F.E4M3), module.format_constants(F.E4M3, 1)
        for name, args, recorded in log + [
            (name, args, {**recorded, "E": native.encode})
            for name, args, recorded in log
            if recorded.get("E") == plain.encode
        ]:
            # Launched on a GPU with the compile options the interpreter took none of.
            kwargs = {**recorded, **module.compile_options()}
            fn = getattr(module, name)
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, spec, opts = binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(
                backend, kwargs, bound, spec, opts
            )
            key = (name, repr(sorted(signature.items())), repr(sorted(constexprs.items())))
            if key in compiled:
                continue
            src = ASTSource(fn, signature, constexprs, attrs)
            ptx = triton.compile(src, target=target, options=options.__dict__).asm["ptx"]
            compiled.add(key)
            if kwargs.get("E") == native.encode and "cvt.rn.satfinite.e4m3x2.f32" in ptx:
                natives.add(name)
            if name == "_maxima_kernel":
                assert "ld.global.v4.b32" in ptx
            if name in ("_encode_kernel", "_decode_kernel"):
                wire = constexprs[(fn.arg_names.index("WIRE"),)]
                vectors.setdefault((name, wire), set()).update(_VECTOR.findall(ptx))
            if name in ("_send_rank_blocks_kernel", "_decode_rank_blocks_kernel"):
                vectors.setdefault((name, 0), set()).update(_VECTOR.findall(ptx))
    assert len(compiled) >= 20, len(compiled)
    assert {"_encode_kernel", "_reduce_kernel"} <= natives, natives
    # A full program moves whole vectors: float32 in four lanes, the codes' bytes in
    # one or more 32-bit words (scalar loads and byte stores once made the encode and
    # decode 2.5x a device copy on an H200).
    # The rank-block send and decode: a full program stores whole vectors (their
    # values start at block offsets, so their float loads stay scalar).
    assert vectors.pop(("_send_rank_blocks_kernel", 0)) & {"st.global.v2.b32", "st.global.v4.b32"}
    assert "st.global.v4.b32" in vectors.pop(("_decode_rank_blocks_kernel", 0))
    for (name, wire), found in sorted(vectors.items()):
        floats = "ld.global.v4.b32" if name == "_encode_kernel" else "st.global.v4.b32"
        assert floats in found, (name, wire, found)
    assert {wire for _, wire in vectors} == {4, 8, 16}


def test_a_failing_kernel_variant_falls_back_to_torch_ops(
    tc: types.ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A variant the first-use probe never launches (the maxima kernel) fails to compile:
    # it is logged once and runs on torch ops from then on, with the same maxima.
    calls = []

    def fail(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RuntimeError("CompilationError: invalid operands")

    monkeypatch.setattr(codec, "_TRITON_FAILED", {})
    monkeypatch.setattr(codec, "_TRITON_RAN", set())  # never launched in this process
    monkeypatch.setattr(tc, "layer_maxima", fail)
    cpu = torch.device("cpu")
    layout = codec.Layout.from_numels([3, 4], cpu)
    x = torch.tensor([1.0, -3.0, 0.5, 200.0, float("nan"), 2.0, 0.0])
    c = codec.Codec(F.E4M3, cpu, "triton")
    for _ in range(2):
        got = c.layer_maxima(x, layout, torch.empty(2))
        assert torch.equal(got, torch.tensor([3.0, float("inf")]))
    assert calls == [1]  # tried once, then straight to the torch ops
    assert [r.getMessage().count("invalid operands") for r in caplog.records] == [1]


@pytest.mark.parametrize("fmt", [F.E4M3, F.E2M1, F.FP16], ids=lambda f: f.name)
def test_bound_calls_repeat_the_codec_calls(tc: types.ModuleType, fmt: FloatFormat) -> None:
    # A settled bucket binds its launches once and repeats them every step: the bound
    # calls write what the checked calls write, and follow new values in the buffers.
    cpu = torch.device("cpu")
    c, kernels = codec.Codec(fmt, cpu, "triton"), codec.Codec(fmt, cpu)
    layout = codec.Layout.from_numels([5, 0, 1500, 33, 2], cpu)
    n = layout.numel
    window = layout.window(3, n - 1)
    maxima = torch.zeros(layout.n_segments)
    x = torch.empty(n)
    bound_maxima = c.bind_layer_maxima(x, layout, maxima)
    pad = 5
    agreed = codec.AgreedMaxima(maxima, 3, native=fmt.torch_dtype is not None)
    sent = torch.empty(payload_nbytes(n - 4 + pad, fmt), dtype=torch.uint8)
    bound_encode = c.bind_encode(x[3 : n - 1], sent, agreed, window, pad)
    back = torch.empty(n - 4)
    bound_decode = c.bind_decode(sent, back, agreed, window)
    shards = torch.empty(2 * payload_nbytes(64, fmt), dtype=torch.uint8)
    mean = torch.empty(payload_nbytes(64, fmt), dtype=torch.uint8)
    bound_owner = c.bind_owner_reduce(shards, 2, mean)
    for seed in range(2):
        x.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 100)
        x[1 + seed] = float("nan") if seed else x[1]  # the first layer non-finite
        shards.copy_(torch.randint(0, 256, shards.shape, dtype=torch.uint8))
        _quiet(bound_maxima)
        assert torch.equal(maxima, codec.segment_amax(x, layout))
        _quiet(bound_encode)
        # The CPU kernels derive the same factors from the same maxima.
        want = kernels.encode(x[3 : n - 1], scale=agreed, layout=window, pad=pad)
        assert torch.equal(sent, want)
        _quiet(bound_decode)
        got = kernels.decode(sent, n - 4, scale=agreed, layout=window)
        assert torch.equal(_bits(back), _bits(got))
        _quiet(bound_owner)
        assert torch.equal(mean, _quiet(c.owner_reduce, shards, 2))


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("fmt", [F.E4M3, F.E2M1, F.BF16], ids=lambda f: f.name)
def test_the_none_rule_gives_the_naive_casts_factors(
    tc: types.ModuleType, fmt: FloatFormat, native: bool
) -> None:
    """Issue 46: ``scaling="none"``'s agreed maxima (:class:`aps_comm.codec.AgreedMaxima`
    ``none``) give :func:`aps_comm.scaling.factors`' "none" factors (exponent 0, NaN for
    a non-finite layer, 1/N for a native sum) on Triton, the CPU kernels and in torch."""
    cpu = torch.device("cpu")
    layout = codec.Layout.from_numels([5, 0, 300, 33, 2], cpu)
    n = layout.numel
    x = torch.randn(n, generator=torch.Generator().manual_seed(4)) * 1e5  # saturates e4m3
    x[40] = float("nan")  # the third layer non-finite
    maxima = codec.segment_amax(x, layout)
    agreed = codec.AgreedMaxima(maxima, 3, native=native, none=True)
    route = "allreduce" if native else "two_phase"
    want = scaling.factors(maxima, fmt, route, world_size=3, scaling="none")
    assert torch.equal(want.scale, torch.ones(len(maxima)))
    kernels = codec.Codec(fmt, cpu)
    payload = kernels.encode(x, scale=want.scale, layout=layout)
    back = kernels.decode(payload, n, scale=want.unscale, layout=layout)
    assert back[5:305].isnan().all() and not back[305:].isnan().any()
    # Triton and the kernels write the same bytes; "bits" (torch) its own, from the factors.
    for c in (codec.Codec(fmt, cpu, "triton"), kernels, codec.Codec(fmt, cpu, "bits")):
        sent = payload if c.backend != "bits" else c.encode(x, scale=want.scale, layout=layout)
        got = _quiet(c.encode, x, scale=agreed, layout=layout)
        assert torch.equal(got, sent), c.backend
        out = _quiet(c.decode, payload, n, out=torch.empty(n), scale=agreed, layout=layout)
        assert torch.equal(_bits(out), _bits(back)), c.backend


def _rank_block_case(fmt: FloatFormat, block_size: int, n: int) -> dict:
    """A group of odd layers in blocks, one chunk of it (from its third block) cut into
    ``n`` uneven shards, one of them empty where ``n`` > 1, and each rank's values
    (the fourth layer non-finite on the last rank, far apart magnitudes)."""
    cpu = torch.device("cpu")
    # The last: several programs per kernel, some wholly inside it (runs of full blocks).
    numels = [5, 0, 37, 11, 70, 1, 13, 2100]
    blocks = codec.Layout.from_numels(numels, cpu).grid(block_size)
    offsets = blocks.layout.offsets.numpy().astype(np.int64)
    counts = blocks.counts.numpy()
    nb = offsets.size - 1
    mid = (2 + nb) // 2
    firsts = np.array({1: [2, nb], 2: [2, 2, nb], 3: [2, mid, mid, nb]}[n], np.int64)
    sizes = np.diff(offsets[firsts])
    # Padded (16 bits: to whole codes, as the numba kernels read them).
    shard_bytes = max(payload_nbytes(int(s), fmt) for s in sizes) + 1 + (fmt.wire_bits == 16)
    slots = int(np.diff(firsts).max()) + 2
    xs = []
    gen = torch.Generator().manual_seed(n * 100 + block_size)
    for r in range(n):
        x = torch.randn(offsets[-1], generator=gen)
        x *= 2.0 ** torch.randint(-30, 30, (x.numel(),), generator=gen).float()
        x[offsets[4] : offsets[6]] = 0.0  # a zero block or two: key 0
        if fmt.max * n > torch.finfo(torch.float32).max:  # bf16: the FP32 sum bounds a key
            x[100] = 3.0e38
        if r == n - 1:
            x[44] = float("nan") if r % 2 else float("inf")  # the fourth layer: [42, 53)
        xs.append(x)
    return {
        "offsets": offsets,
        "layer_of": np.repeat(np.arange(counts.size, dtype=np.int64), counts),
        "layer_ends": np.cumsum(counts),
        "counts": blocks.counts,
        "firsts": firsts,
        "shard_bytes": shard_bytes,
        "slots": slots,
        "xs": xs,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "block_size"),
    [(F.E2M1, 8), (F.E2M1, 32), (F.E4M3, 8), (F.E4M3, 32), (F.BF16, 8)],
    ids=lambda v: getattr(v, "name", v),
)
def test_rank_block_kernels_match_kernels(
    tc: types.ModuleType, fmt: FloatFormat, block_size: int
) -> None:
    # two_phase with every rank's own block exponents, the whole chain: the keys and
    # flags, every rank's send (pieces of N ranks built by the send kernel on each
    # rank's values), each owner's step and the decode of the gathered shards, byte
    # for byte against the numba kernels; every byte of every buffer written.
    from aps_comm import cpu_kernels
    from aps_comm.scaling import EXPONENT_LIMIT

    table, untable = codec._key_table(False), codec._key_table(True)
    for n in (1, 2, 3):
        case = _rank_block_case(fmt, block_size, n)
        offsets, firsts, layer_of = case["offsets"], case["firsts"], case["layer_of"]
        sb, slots, nb = case["shard_bytes"], case["slots"], offsets.size - 1
        n_layers = case["counts"].numel()
        for at in (sb + slots, -1) if n == 3 else (sb + slots,):  # -1: a later chunk
            piece = sb + slots + (n_layers + 4 if at >= 0 else 1)
            piece += piece % 2 * (fmt.wire_bits == 16)  # rows of whole 16-bit codes
            keys, flags = [], []
            sends = []
            for r, x in enumerate(case["xs"]):
                k, f = (
                    torch.empty(nb, dtype=torch.uint8),
                    torch.full((n_layers,), 7, dtype=torch.uint8),
                )
                m = torch.empty(nb)
                # bf16 over N ranks: the owner's FP32 sum bounds the keys too.
                _quiet(tc.bind_block_keys(fmt, x, offsets, layer_of, m, k, f, n))
                want_m, want_k, want_f = torch.empty(nb), torch.empty_like(k), torch.empty_like(f)
                cpu_kernels.block_keys(
                    fmt, x, offsets, case["counts"], want_m, want_k, want_f, EXPONENT_LIMIT, n
                )
                assert torch.equal(m.view(torch.int32), want_m.view(torch.int32))
                assert torch.equal(k, want_k) and torch.equal(f, want_f), (r, k, want_k)
                assert bool(f[3]) == (r == n - 1) and f.sum() == (r == n - 1)
                keys.append(k)
                flags.append(f)
                send = torch.full((n * piece,), 0xA5, dtype=torch.uint8)
                call = tc.bind_send_rank_blocks(fmt, x, k, offsets, firsts, f, send, sb, at)
                _quiet(call, 5 + r)
                want = np.full(n * piece, 0x5A, np.uint8)
                cpu_kernels.send_rank_blocks(
                    fmt, x.numpy(), k.numpy(), table, offsets, firsts, want, piece, sb,
                    f.numpy(), at, 5 + r,
                )  # fmt: skip
                assert np.array_equal(send.numpy(), want), (n, at, r)
                sends.append(send.view(n, piece))
            outs, union = [], torch.full((n_layers,), 9, dtype=torch.uint8)
            for o in range(n):
                recv = torch.cat([s[o] for s in sends])
                shard = offsets[firsts[o] : firsts[o + 1] + 1] - offsets[firsts[o]]
                longest = int(np.diff(shard).max()) if shard.size > 1 else 0
                out = torch.full((sb + slots + 3,), 0xA5, dtype=torch.uint8)
                d = torch.empty(max(shard.size - 1, 1), dtype=torch.int32)
                call = tc.bind_owner_rank_blocks(
                    fmt, recv, n, shard, out, union, d, sb, at, block_size
                )
                _quiet(call)
                want_out = np.full(out.numel(), 0x5A, np.uint8)
                want_union = np.full(n_layers, 9, np.uint8)
                want_d = np.empty(shard.size - 1, np.int32)
                log2 = cpu_kernels.owner_rank_blocks(
                    fmt, EXPONENT_LIMIT, recv.numpy().reshape(n, -1), shard, untable, want_out, sb,
                    at, want_union, want_d, longest,
                )  # fmt: skip
                assert np.array_equal(out.numpy(), want_out), (n, at, o)
                assert np.array_equal(union.numpy(), want_union), (n, at, o)
                assert np.array_equal(d.numpy()[: want_d.size], want_d)
                assert log2 == (4 + n if at >= 0 else 0)
                outs.append(out)
            gathered = torch.cat(outs)
            for r, x in enumerate(case["xs"]):
                got, want = x.clone(), x.clone()
                _quiet(
                    tc.bind_decode_rank_blocks(
                        fmt, gathered, n, offsets, firsts, layer_of, union, got, sb
                    )
                )
                cpu_kernels.decode_rank_blocks(
                    fmt, gathered.numpy(), n, offsets, firsts, untable, case["layer_ends"],
                    union.numpy(), want.numpy(), sb,
                )  # fmt: skip
                assert torch.equal(_bits(got), _bits(want)), (n, at, r)
                a = offsets[firsts[0]]
                assert torch.equal(got[:a], x[:a])  # outside the chunk: untouched
                if at >= 0:  # the fourth layer NaN on every rank, nothing else
                    assert got[42:53].isnan().all() and not got[53:].isnan().any()


_RANK_BLOCK_KERNELS = (
    "_block_keys_kernel",
    "_send_rank_blocks_kernel",
    "_reduce_blocks_kernel",
    "_decode_rank_blocks_kernel",
)


@contextlib.contextmanager
def _triton_plans() -> Iterator[None]:
    """Buckets planned on the Triton backend (CPU tensors, the interpreter) for the formats
    it takes, inside a default process group of one rank (Gloo)."""
    from aps_comm import plan
    from benchmarks.hostcost import world_of_one

    def triton_codec_for(fmt, device, backend="auto"):  # type: ignore[no-untyped-def]
        fmt = get_format(fmt)
        return codec.codec_for(fmt, device, "triton" if fmt.wire_bits <= 16 else backend)

    with world_of_one(torch.device("cpu")):
        saved, plan.codec_for = plan.codec_for, triton_codec_for
        try:
            yield
        finally:
            plan.codec_for = saved


def _reference(
    options: dict, x: torch.Tensor, params: list[torch.Tensor], records: list[str] | None = None
) -> torch.Tensor:
    """The bucket through the numba kernels' full path (a state that never settled), its
    records (``stats=True``) appended to ``records`` where given."""
    import aps_comm
    from benchmarks.hostcost import world_of_one

    with world_of_one(torch.device("cpu")):
        state = aps_comm.APSState(**options)
        out = state.run_bucket(0, x.clone(), params).clone()
        if records is not None:
            records.append(repr(state.stats))
        del state
    return out


def _block_bucket(numels: list[int], seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(numels), generator=gen) * 2.0 ** torch.randint(-20, 20, (1,), generator=gen)
    x[:: max(1, x.numel() // 7)] *= 1000.0  # layers of very different maxima
    x[3] = float("nan")  # the first layer is non-finite: NaN everywhere in it
    return x, [torch.nn.Parameter(torch.empty(n)) for n in numels]


@pytest.mark.parametrize(("fmt", "block_size"), [("e2m1", 8), ("e4m3", 32)])
def test_settled_block_bucket_on_triton_gives_the_kernels_bits(
    tc: types.ModuleType, monkeypatch: pytest.MonkeyPatch, fmt: str, block_size: int
) -> None:
    # The default block scaling (two_phase, every rank's own block exponents) settles on
    # the Triton backend too: a settled bucket is the keys' one kernel (and the flags'
    # zeroing) and three launches per chunk, the same for 2 layers as for 40, and its
    # bits are those of the numba kernels' full path.
    import aps_comm
    from aps_comm.engine import SteadyBlocks

    options = {"fmt": fmt, "reduction": "two_phase", "scaling": "block", "block_size": block_size}
    launches = {}
    for numels in ([5, 0, 1, 300, 33, 2, 64], [5, 0, 1, 300, *[7] * 33, 64]):
        x, params = _block_bucket(numels, 11)
        log: list = []
        with _triton_plans():
            # Recorded from the start: the settled path binds its launches once.
            for name in _RANK_BLOCK_KERNELS:
                monkeypatch.setattr(tc, name, _Recorder(name, getattr(tc, name), log))
            settled = aps_comm.APSState(**options)
            buffer = x.clone()
            for _ in range(2):  # the plan, then the settled path bound
                buffer.copy_(x)
                _quiet(settled.run_bucket, 0, buffer, params)
            reducer = settled.reducer
            assert reducer is not None
            st = reducer.steady_for(0, buffer)
            assert isinstance(st, SteadyBlocks) and st.group.codec.backend == "triton"
            assert st.keys.device == buffer.device
            log.clear()
            buffer.copy_(x)
            out = _quiet(settled.run_bucket, 0, buffer, params)
            del settled, reducer
        chunks = len(st.calls or [])
        names = [name for name, _, _ in log]
        assert (
            names
            == ["_block_keys_kernel"]
            + [
                "_send_rank_blocks_kernel",
                "_reduce_blocks_kernel",
                "_decode_rank_blocks_kernel",
            ]
            * chunks
        ), names
        launches[len(numels)] = names
        want = _reference(options, x, params)
        assert out[:5].isnan().all() and not out[5:].isnan().any()
        same = torch.where(out.isnan(), 0.0, out).view(torch.int32)
        assert torch.equal(same, torch.where(want.isnan(), 0.0, want).view(torch.int32))
    assert len(set(map(tuple, launches.values()))) == 1, launches


def test_a_fused_block_variant_that_fails_binds_the_codecs_own_calls(
    tc: types.ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The owner's fused variant cannot compile (injected): bind's probe logs it once and
    # the bucket binds the codec's own calls instead (SteadyBlocks, not the general path;
    # the keys' kernel still fused): the fused send, owner and decode never run after the
    # probe, and the bits are the numba kernels' full path's.
    import aps_comm
    from aps_comm.engine import SteadyBlocks

    monkeypatch.setattr(codec, "_TRITON_FAILED", {})
    monkeypatch.setattr(codec, "_TRITON_RAN", set())
    real = tc._reduce_blocks_kernel

    class Broken:
        def __getitem__(self, grid: object):  # type: ignore[no-untyped-def]
            def launch(*args: object, **kwargs: object) -> None:
                if kwargs.get("FACTORS") == 2:
                    raise RuntimeError("CompilationError: injected")
                real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(tc, "_reduce_blocks_kernel", Broken())
    options = {"fmt": "e2m1", "reduction": "two_phase", "scaling": "block", "block_size": 8}
    x, params = _block_bucket([5, 0, 1, 300, 33, 2, 64], 5)
    log: list = []
    with _triton_plans():
        state = aps_comm.APSState(**options)
        buffer = x.clone()
        for step in range(3):
            if step == 2:  # settled: recorded from here
                for name in _RANK_BLOCK_KERNELS[1:]:  # the fused chunk kernels
                    monkeypatch.setattr(tc, name, _Recorder(name, getattr(tc, name), log))
            buffer.copy_(x)
            out = _quiet(state.run_bucket, 0, buffer, params)
        reducer = state.reducer
        assert reducer is not None
        st = reducer.steady_for(0, buffer)
        assert isinstance(st, SteadyBlocks) and st.group.codec.backend == "triton"
        del state, reducer, st
    monkeypatch.setattr(tc, "_reduce_blocks_kernel", real)
    assert [name for name, _, _ in log if "rank_blocks" in name] == []  # the codec's own calls
    assert [r.getMessage().count("injected") for r in caplog.records] == [1]
    assert any(v[0] == "owner_rank_blocks" for v in codec._TRITON_FAILED)
    want = _reference(options, x, params)
    same = torch.where(out.isnan(), 0.0, out).view(torch.int32)
    assert torch.equal(same, torch.where(want.isnan(), 0.0, want).view(torch.int32))


@_checked_ranks
def _node_blocks_on_triton(
    rank: int, world_size: int, cases: list[tuple[str, str, int, int | None]]
) -> list:
    """Per case, a hierarchical or grid block bucket (2 nodes of 2) through the numba
    kernels and through the Triton kernels under the interpreter: (whether the Triton
    state settled into SteadyNodeBlocks, the Triton bits, the numba bits)."""
    import aps_comm
    from aps_comm import plan
    from aps_comm.engine import SteadyNodeBlocks

    def triton_codec_for(fmt, device, backend="auto"):  # type: ignore[no-untyped-def]
        fmt = get_format(fmt)
        return codec.codec_for(fmt, device, "triton" if fmt.wire_bits <= 16 else backend)

    results = []
    for reduction, fmt, block_size, chunk in cases:
        options = {
            "fmt": fmt,
            "reduction": reduction,
            "scaling": "block",
            "block_size": block_size,
            "ranks_per_node": 2,
        }
        x, params = _block_bucket([5, 0, 1, 300, 33, 2, 64], 20 + rank)
        reference = aps_comm.APSState(**options)
        reference.chunk_elements = chunk
        reference.bind_process_group()
        want = reference.run_bucket(0, x.clone(), params).clone()
        with _loaded(interpret=True):
            saved, plan.codec_for = plan.codec_for, triton_codec_for
            try:
                state = aps_comm.APSState(**options)
                state.chunk_elements = chunk
                state.bind_process_group()
                buffer = x.clone()
                outs = []
                for _ in range(3):  # the full path (fused calls), then the settled path
                    buffer.copy_(x)
                    outs.append(_quiet(state.run_bucket, 0, buffer, params).clone())
                full, out = outs[0], outs[-1]
                assert state.reducer is not None
                st = state.reducer.steady_for(0, buffer)
                settled = isinstance(st, SteadyNodeBlocks) and st.group.codec.backend == "triton"
            finally:
                plan.codec_for = saved
        results.append((settled, full, out, want))
    return results


@pytest.mark.slow
def test_hierarchical_and_grid_blocks_on_triton_give_the_kernels_bits() -> None:
    # Every owner's own block exponents at both levels, through the Triton kernels
    # (the rank-block send, owner and decode; the node's mean in rank order): the
    # bucket settles (SteadyNodeBlocks) and its bits, full path and settled, are
    # the numba kernels'.
    from aps_comm.testing import run_distributed

    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton; in the test extra)")
    # (reduction, format, block size, chunk_elements). 396 and 372: the last chunk is
    # the last block alone (chunks end on block boundaries), three of the 4 shards empty.
    cases = [
        ("hierarchical", "e2m1", 8, 396),
        ("grid", "e4m3", 32, 372),
        ("hierarchical", "bf16", 8, None),
    ]
    for rank, results in enumerate(
        run_distributed(_node_blocks_on_triton, 4, args=(cases,), timeout=600)
    ):
        for case, (settled, full, out, want) in zip(cases, results, strict=True):
            assert settled, (rank, case)
            assert want[:5].isnan().all() and not want[5:].isnan().any()
            expected = torch.where(want.isnan(), 0.0, want).view(torch.int32)
            for got in (full, out):
                assert torch.equal(torch.where(got.isnan(), 0.0, got).view(torch.int32), expected)


@_checked_ranks
def _staged_on_backends(
    rank: int, world_size: int, cases: list[tuple[str, str, str, int | None]]
) -> list:
    """Per case, a hierarchical or grid bucket with layer or bucket scaling (2 nodes of 2)
    through the numba kernels' general path, and through the Triton kernels under the
    interpreter and the torch bit path, each settled: (the backends the settled buckets
    ran on, their first (general) and third (settled) steps' bits, the numba bits), with
    stats=True, the records compared too. With "block" scaling: agreed block exponents,
    on Triton only."""
    import aps_comm
    from aps_comm import plan
    from aps_comm.engine import SteadyStaged

    results = []
    for reduction, fmt, scale_by, chunk in cases:
        options = {"fmt": fmt, "reduction": reduction, "scaling": scale_by, "ranks_per_node": 2}
        options["stats"] = True
        blocks = scale_by == "block"
        if blocks:
            options.update(block_size=8, block_exponents="agreed")
        x, params = _block_bucket([5, 0, 1, 300, 33, 2, 64], 20 + rank)
        reference = aps_comm.APSState(**options)
        reference.chunk_elements = chunk
        reference.bind_process_group()
        want = reference.run_bucket(0, x.clone(), params).clone()
        records = [repr(reference.stats)]
        ran, got = [], []
        for backend in ("triton",) if blocks else ("triton", "bits"):

            def codec_for(fmt, device, b="auto", backend=backend):  # type: ignore[no-untyped-def]
                return codec.codec_for(fmt, device, backend)

            with _loaded(interpret=True):
                saved, plan.codec_for = plan.codec_for, codec_for
                try:
                    state = aps_comm.APSState(**options)
                    state.chunk_elements = chunk
                    state.bind_process_group()
                    buffer = x.clone()
                    outs = []
                    for _ in range(3):  # the general path, then the settled path
                        buffer.copy_(x)
                        outs.append(_quiet(state.run_bucket, 0, buffer, params).clone())
                    assert state.reducer is not None
                    st = state.reducer.steady_for(0, buffer)
                    if isinstance(st, SteadyStaged) and (st.local is not None) == blocks:
                        ran.append(st.group.codec.backend)
                    records.append(repr(state.stats))
                finally:
                    plan.codec_for = saved
            got += [outs[0], outs[-1]]
        results.append((ran, got, want, records))
    return results


@pytest.mark.slow
def test_settled_staged_buckets_on_triton_and_bits_give_the_kernels_bits() -> None:
    # Hierarchical and grid with one exponent per layer (or bucket) settle on every
    # backend (SteadyStaged): on Triton the maxima, the factor rows, the records and the
    # shards' means are bound launches, the encodes and decodes read the factors written
    # in place. Their bits, general path and settled, and their records are the numba
    # kernels'. With agreed block exponents on Triton too: the staged keys, their
    # factors and the records are bound launches.
    from aps_comm.testing import run_distributed

    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton; in the test extra)")
    # (reduction, format, scaling, chunk_elements). 101: the last chunk of the 405
    # elements is 1, so a rank's shard of it is padding alone (on an H200 its encode
    # read factors at address 0 and faulted; the interpreter segfaults).
    cases = [
        ("hierarchical", "e2m1", "layer", None),
        ("hierarchical", "e4m3", "layer", 101),
        ("grid", "e4m3", "bucket", 101),
        ("grid", "e2m1", "block", None),
    ]
    for rank, results in enumerate(
        run_distributed(_staged_on_backends, 4, args=(cases,), timeout=600)
    ):
        for case, (ran, got, want, records) in zip(cases, results, strict=True):
            blocks = case[2] == "block"  # agreed block exponents, stats: Triton's kernels
            assert ran == (["triton"] if blocks else ["triton", "bits"]), (rank, case)
            assert len(set(records)) == 1 and case[1] in records[0], records
            assert want[:5].isnan().all() and not want[5:].isnan().any()
            expected = torch.where(want.isnan(), 0.0, want).view(torch.int32)
            for out in got:
                assert torch.equal(torch.where(out.isnan(), 0.0, out).view(torch.int32), expected)


def _mixed_state(reduction: str, rules: Callable[[], list], params: list[torch.Tensor]) -> Any:
    """An e4m3 state on ``reduction`` (2 ranks per node) with ``rules()``, one module per
    parameter (a policy keys layers by module)."""
    import aps_comm
    from benchmarks.hostcost import ParamLayer

    state = aps_comm.APSState("e4m3", reduction=reduction, ranks_per_node=2, policy=rules())
    state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
    return state


@_checked_ranks
def _mixed_staged_on_triton(rank: int, world_size: int, cases: list[tuple[str, str]]) -> list:
    """Per case, a hierarchical or grid bucket (2 nodes of 2) in several formats
    (``KeepLast("fp16")``, or formats interleaved layer by layer), settled through the
    Triton kernels under the interpreter: (the bound path's type, the backends its sent
    groups ran on, the third step's bits, the numba kernels' bits)."""
    from aps_comm import plan
    from aps_comm.policy import ByName, KeepLast

    rules = {
        "keep_last": lambda: [KeepLast("fp16")],
        "interleaved": lambda: [ByName({"*[13579].weight": "fp16"}), KeepLast("fp32")],
    }
    results = []
    for reduction, policy in cases:
        x, params = _block_bucket([5, 0, 1, 300, 33, 2, 64], 30 + rank)

        case = (reduction, rules[policy], params)
        want = _mixed_state(*case).run_bucket(0, x.clone(), params).clone()

        def codec_for(fmt, device, b="auto"):  # type: ignore[no-untyped-def]
            # FP32 groups keep their own (no codec of more than 16 bits runs on Triton).
            return codec.codec_for(fmt, device, b if get_format(fmt).wire_bits > 16 else "triton")

        log: list = []
        with _loaded(interpret=True) as tc:
            saved, plan.codec_for = plan.codec_for, codec_for
            kernels = {name: getattr(tc, name) for name in _KERNELS}
            try:
                for name, kernel in kernels.items():
                    setattr(tc, name, _Recorder(name, kernel, log))
                state, buffer = _mixed_state(*case), x.clone()
                for _ in range(3):  # bound, then settled (its launches recorded)
                    log.clear()
                    buffer.copy_(x)
                    out = _quiet(state.run_bucket, 0, buffer, params).clone()
                assert state.reducer is not None
                st = state.reducer.steady_for(0, buffer)
                groups = [
                    g for p in state.reducer.plans.values() for gs in p.groups.values() for g in gs
                ]
                ran = sorted({g.codec.backend for g in groups if g.fmt.name != "fp32"})
            finally:
                plan.codec_for = saved
                for name, kernel in kernels.items():
                    setattr(tc, name, kernel)
        ran.append(len(log))  # the settled step's Triton launches
        results.append((type(st).__name__, ran, out, want))
    return results


@pytest.mark.slow
def test_settled_mixed_format_staged_buckets_on_triton_give_the_kernels_bits() -> None:
    # Several formats on the staged routes across ranks (2 nodes of 2), on Triton: the
    # bucket binds (SteadyGroups), every sent group on the Triton codec, and its bits are
    # the numba kernels' on every rank, a NaN layer included.
    from aps_comm.testing import run_distributed

    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton; in the test extra)")
    cases = [("hierarchical", "keep_last"), ("hierarchical", "interleaved"), ("grid", "keep_last")]
    for rank, results in enumerate(
        run_distributed(_mixed_staged_on_triton, 4, args=(cases,), timeout=600)
    ):
        for case, (kind, ran, out, want) in zip(cases, results, strict=True):
            backends, launched = ran[:-1], ran[-1]
            assert kind == "SteadyGroups" and backends == ["triton"], (rank, case, ran)
            assert launched > 0, (rank, case)  # the settled step ran Triton's kernels
            assert want[:5].isnan().all() and not want[5:].isnan().any(), (rank, case)
            expected = torch.where(want.isnan(), 0.0, want).view(torch.int32)
            got = torch.where(out.isnan(), 0.0, out).view(torch.int32)
            assert torch.equal(got, expected), (rank, case)


def _fsdp_unit_steps(options: dict, numels: list[int], triton: bool) -> tuple[list, str, int]:
    """Three steps of one FSDP2 unit's reduce-scatter in a world of one (a NaN at step 1),
    on the numba kernels or on Triton under the interpreter: each step's result, the bound
    unit's type and the settled step's launches of the codec's kernels."""
    from benchmarks.hostcost import fsdp_unit

    names = [f"ps.{i}" for i in range(len(numels))]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, sum(numels), generator=gen) * 2.0 ** (7 * i - 7) for i in range(3)]
    xs[1][0, 3] = float("nan")
    log: list = []

    def steps() -> tuple[list, str, int]:
        state, _, _ = fsdp_unit(numels, torch.device("cpu"), options, False)
        reducer, flag, outs = state.reducer, torch.zeros(()), []
        for step, x in enumerate(xs):
            log.clear()
            args = (0, x.clone(), numels, numels, names)
            outs.append(_quiet(reducer.unit, *args, step=step, problem=flag).clone())
            reducer.end_step()
        return outs, type(reducer.steady_units.get(0)).__name__, len(log)

    if not triton:
        return steps()

    auto = codec.backend_for

    def backend_for(fmt, device):  # type: ignore[no-untyped-def]
        # Every codec the engine builds (the plan's and a unit's own) on Triton, but FP32's.
        return auto(fmt, device) if get_format(fmt).wire_bits > 16 else "triton"

    with _loaded(interpret=True) as tc:
        kernels = {name: getattr(tc, name) for name in _KERNELS}
        codec.codec_for.cache_clear()
        try:
            codec.backend_for = backend_for  # type: ignore[assignment]
            for name, kernel in kernels.items():
                setattr(tc, name, _Recorder(name, kernel, log))
            return steps()
        finally:
            codec.backend_for = auto  # type: ignore[assignment]
            codec.codec_for.cache_clear()
            for name, kernel in kernels.items():
                setattr(tc, name, kernel)


@pytest.mark.parametrize(
    "options",
    [
        {"fmt": "e4m3"},
        {"fmt": "e2m1", "scaling": "block", "block_size": 8},
        {"fmt": "e4m3", "stats": True, "policy": "every other fp32"},
    ],
    ids=["e4m3", "e2m1-block", "e4m3-stats-mixed"],
)
def test_settled_fsdp_units_on_triton_give_the_kernels_bits(options: dict) -> None:
    # FSDP2 units bind on Triton too (one format or several: SteadyMixedUnit),
    # with the numba kernels' bits, a NaN parameter included.
    from aps_comm.policy import ByName
    from benchmarks.hostcost import world_of_one

    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton; in the test extra)")
    options = dict(options)
    if options.get("policy"):
        options["policy"] = [ByName({"*1": "fp32", "*3": "fp32"})]
    numels = [5, 300, 33, 64]
    with world_of_one(torch.device("cpu")):
        want, kind, _ = _fsdp_unit_steps(options, numels, triton=False)
        got, on_triton, launched = _fsdp_unit_steps(options, numels, triton=True)
    assert kind == on_triton == "SteadyMixedUnit"
    assert launched > 0  # the settled step ran Triton's kernels
    for out, ref in zip(got, want, strict=True):
        bits = torch.where(out.isnan(), 0.0, out).view(torch.int32)
        assert torch.equal(bits, torch.where(ref.isnan(), 0.0, ref).view(torch.int32))
        assert torch.equal(out.isnan(), ref.isnan())


def _feedback_run(
    options: dict, xs: list[torch.Tensor], params: list[torch.Tensor], backend: str
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor], str]]:
    """Each step's result, residuals and records (``stats=True``) of error feedback, bound
    on the codec ``backend`` (one buffer)."""
    import aps_comm
    from benchmarks.hostcost import ParamLayer

    state = aps_comm.APSState(**options)
    # A policy keys layers by module: one each (KeepLast's last one).
    if "policy" in options:
        state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
    else:
        state.bind_model(torch.nn.ParameterList(params))
    buffer = torch.empty_like(xs[0])
    steps = []
    for x in xs:
        buffer.copy_(x)
        out = _quiet(state.run_bucket, 0, buffer, params).clone()
        steps.append((out, state.state_dict()["residuals"], repr(state.stats)))
    assert state.reducer is not None
    kind = "SteadyGroups" if "policy" in options else "SteadyFeedback"
    assert type(state.reducer.steady_for(0, buffer)).__name__ == kind
    groups = [g for p in state.reducer.plans.values() for gs in p.groups.values() for g in gs]
    assert {g.codec.backend for g in groups if g.fmt.name != "fp32"} == {backend}
    del state
    return steps


@pytest.mark.parametrize(
    "options",
    [
        {"fmt": "e4m3", "reduction": "two_phase"},
        {"fmt": "e2m1", "reduction": "two_phase", "scaling": "block", "block_size": 8},
        {"fmt": "e4m3", "reduction": "two_phase", "policy": "keep_last"},
        {
            "fmt": "e2m1",
            "reduction": "two_phase",
            "scaling": "block",
            "block_size": 8,
            "policy": "keep_last",
        },
        {"fmt": "e4m3", "reduction": "two_phase", "stats": True},
        {
            "fmt": "e2m1",
            "reduction": "two_phase",
            "scaling": "block",
            "block_size": 8,
            "stats": True,
        },
        {"fmt": "e4m3", "reduction": "two_phase", "scaling": "bucket", "stats": True},
        {"fmt": "e4m3", "reduction": "two_phase", "scaling": "none"},
        {"fmt": "e4m3", "reduction": "two_phase", "scaling": "bucket", "policy": "keep_last"},
        {"fmt": "e4m3", "reduction": "two_phase", "scaling": "none", "policy": "keep_last"},
        # The native sum (Gloo sums fp16): its factors and keys the general path's tensor
        # ops, its encode with the residual update and its decode Triton's.
        {"fmt": "fp16", "reduction": "allreduce", "stats": True},
        {"fmt": "fp16", "reduction": "allreduce", "scaling": "block", "block_size": 8},
        {"fmt": "fp16", "reduction": "allreduce", "scaling": "bucket", "policy": "keep_last"},
    ],
    ids=[
        "e4m3",
        "e2m1-block",
        "e4m3-keep_last",
        "e2m1-block-keep_last",
        "e4m3-stats",
        "e2m1-stats",
        "e4m3-bucket-stats",
        "e4m3-none",
        "e4m3-bucket-keep_last",
        "e4m3-none-keep_last",
        "fp16-allreduce-stats",
        "fp16-allreduce-block",
        "fp16-allreduce-bucket-keep_last",
    ],
)
def test_settled_error_feedback_on_triton_gives_the_kernels_bits(
    tc: types.ModuleType, options: dict
) -> None:
    # Error feedback settles on the Triton backend too (its factors, residual updates and
    # owner loss whole-bucket launches there): each step's gradients, residuals and records (stats: the torch
    # ops of the records there) are the numba kernels' bound path's, a non-finite layer
    # in one step included.
    from aps_comm.policy import KeepLast
    from benchmarks.hostcost import world_of_one

    options = {**options, "error_feedback": True}
    if "policy" in options:  # beside FP32: each scaled group's own bound path (SteadyGroups)
        options["policy"] = [KeepLast("fp32")]
    numels = [5, 0, 1, 300, 33, 2, 64]
    xs = [_block_bucket(numels, 20 + step)[0] for step in range(4)]
    for x in xs[:2] + xs[3:]:
        x[3] = 0.5  # the NaN only in step 2
    params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
    with world_of_one(torch.device("cpu")):
        want = _feedback_run(options, xs, params, "kernels")
    with _triton_plans():
        got = _feedback_run(options, xs, params, "triton")
    for (out, res, records), (ref, ref_res, ref_records) in zip(got, want, strict=True):
        assert records == ref_records
        assert torch.equal(out.isnan(), ref.isnan())
        same = torch.where(out.isnan(), 0.0, out).view(torch.int32)
        assert torch.equal(same, torch.where(ref.isnan(), 0.0, ref).view(torch.int32))
        assert res.keys() == ref_res.keys()
        assert all(torch.equal(res[k].view(torch.int32), ref_res[k].view(torch.int32)) for k in res)
    assert got[2][0][:5].isnan().all()


def _feedback_calls(c: codec.Codec, fmt: FloatFormat, rank: int) -> list[torch.Tensor]:
    """Error feedback's bound residual updates on codec ``c``, two ranks: this rank's
    residual after its encode, then after its owner step, and the owner's encoded mean."""
    from aps_comm.layout import Layout
    from aps_comm.plan import shard_layout

    numels = [5, 0, 1, 300, 33, 2, 64]
    layout = Layout.from_numels(numels, torch.device("cpu"))
    n = layout.numel
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-30, 30, (n,), generator=gen)
    e = torch.randint(-20, 20, (len(numels),), generator=gen, dtype=torch.int32)
    scale = pow2(e)
    unscale = torch.where(torch.arange(len(numels)) == 3, float("nan"), pow2(-e))
    ref = codec.codec_for(fmt, torch.device("cpu"))
    payload = ref.encode(x, scale=scale, layout=layout)
    per, shard_bytes = shard_layout(n, fmt, 2)
    rows = torch.randn(2 * per, generator=gen) * 100  # finite shards: NaN bits may differ
    recv = ref.encode(rows)
    residual = torch.randn(n, generator=gen)
    c.bind_keep_lost(payload, x, torch.empty(n), unscale, layout, residual)()
    kept = residual.clone()
    out = torch.empty(shard_bytes, dtype=torch.uint8)
    c.bind_owner_feedback(recv, 2, out, layout, (scale, unscale), rank, residual)()
    return [kept, residual, out]


@pytest.mark.parametrize("fmt", [F.E4M3, F.E2M1, F.BF16], ids=lambda f: f.name)
@pytest.mark.parametrize(("ranks", "per_node"), [(4, 2), (6, 3), (8, 4)])
def test_staged_factors_of_agreed_maxima_match_kernels(
    tc: types.ModuleType, fmt: FloatFormat, ranks: int, per_node: int
) -> None:
    # Hierarchical's and grid's factor rows of agreed layer maxima, one launch on Triton
    # (they were ~120 tensor ops per bucket): the numba kernels' rows bit for bit, for
    # zero, subnormal, huge and non-finite maxima, and under scaling="none".
    gen = torch.Generator().manual_seed(ranks)
    maxima = torch.rand(3000, generator=gen) * 2.0 ** torch.randint(
        -149, 128, (3000,), generator=gen
    )
    maxima[:6] = torch.tensor([0.0, float("inf"), float("nan"), 3e38, 1e-45, 1.0])
    c = codec.Codec(fmt, torch.device("cpu"), "triton")
    never = unittest.mock.Mock(side_effect=AssertionError("the torch ops ran"))
    for grid, none in ((False, False), (True, False), (False, True), (True, True)):
        got, want = torch.empty(4, maxima.numel()), torch.empty(4, maxima.numel())
        with unittest.mock.patch.object(codec, "_stack_factors", never):
            c.bind_staged_factors(maxima, ranks, per_node, grid, got, none)()
        limit = 0 if none else scaling.EXPONENT_LIMIT
        args = (maxima.numpy(), fmt, ranks, per_node, grid, limit, want.numpy())
        cpu_kernels.staged_factors_into(*args)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (grid, none)


@pytest.mark.parametrize("fmt", [F.E4M3, F.E2M1, F.FP16, F.BF16], ids=lambda f: f.name)
@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_native_block_keys_and_block_factors_match_kernels(
    tc: types.ModuleType, fmt: FloatFormat, ranks: int
) -> None:
    # The native sum's block keys and every route's block factors, one launch each on
    # Triton: the numba kernels' maxima, keys, scale, inverse and unscale bit for bit, with
    # zero, subnormal, huge and non-finite blocks (a NaN makes its whole layer's unscale
    # NaN) and a divisor that is not a power of two.
    from aps_comm.layout import Layout

    numels = [5, 0, 1, 300, 33, 2, 64, 40]
    layout = Layout.from_numels(numels, torch.device("cpu"))
    gen = torch.Generator().manual_seed(ranks)
    x = torch.randn(layout.numel, generator=gen) * 2.0 ** torch.randint(
        -140, 120, (layout.numel,), generator=gen
    )
    x[6:38] = 0.0  # a zero block
    x[310] = float("nan")
    x[340] = float("inf")
    x[-3] = 3e38
    blocks = layout.grid(8)
    nb, counts = blocks.n_blocks, blocks.counts
    got = (torch.empty(nb), torch.empty(nb, dtype=torch.uint8))
    want = (torch.empty(nb), torch.empty(nb, dtype=torch.uint8))
    c = codec.Codec(fmt, torch.device("cpu"), "triton")
    never = unittest.mock.Mock(side_effect=AssertionError("the torch ops ran"))
    c.bind_native_block_keys(x, blocks.layout, got, ranks, never)()
    offsets = blocks.layout.offsets.numpy()
    cpu_kernels.native_block_keys(fmt, x, offsets, *want, scaling.EXPONENT_LIMIT, ranks)
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
    assert torch.equal(got[1], want[1]) and (want[1] == 255).any() and (want[1] == 0).any()
    keys = want[1]
    for inverse in (False, True):
        mine = [torch.empty(nb) for _ in range(3)]
        ref = [torch.empty(nb) for _ in range(3)]
        out = (mine[0], mine[1] if inverse else None, mine[2])
        c.bind_key_factors(keys, counts, out, ranks, never)()
        if ranks == 1 and not inverse:
            cpu_kernels.block_factors_into(keys, counts.numpy(), ref[0].numpy(), ref[2].numpy())
        else:
            kept = ref[1] if inverse else None
            cpu_kernels.native_block_factors(keys, counts, ref[0], ref[2], ranks, kept)
        for a, b in zip(mine if inverse else mine[::2], ref if inverse else ref[::2], strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert mine[2].isnan().any() and not mine[2].isnan().all()


@pytest.mark.parametrize("fmt", [F.E4M3, F.E2M1], ids=lambda f: f.name)
@pytest.mark.parametrize("rank", [0, 1])
def test_error_feedback_calls_match_kernels(
    tc: types.ModuleType, fmt: FloatFormat, rank: int
) -> None:
    # The whole-bucket residual updates of a settled error-feedback bucket: the numba
    # kernels, the Triton backend's tensor ops and the reference bit path agree bit for
    # bit, a non-finite layer (NaN unscale) included.
    want = _feedback_calls(codec.Codec(fmt, torch.device("cpu"), "kernels"), fmt, rank)
    for backend in ("triton", "bits"):
        got = _feedback_calls(codec.Codec(fmt, torch.device("cpu"), backend), fmt, rank)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), backend


@pytest.mark.parametrize(
    ("policy", "agreed", "route"),
    [
        ("keep_last", False, "two_phase"),
        ("interleaved", False, "two_phase"),
        ("keep_last", True, "two_phase"),
        ("interleaved", True, "two_phase"),
        ("keep_last", True, "hierarchical"),
        ("interleaved", True, "hierarchical"),
    ],
)
def test_settled_mixed_format_bucket_on_triton_gives_the_kernels_bits(
    tc: types.ModuleType, monkeypatch: pytest.MonkeyPatch, policy: str, agreed: bool, route: str
) -> None:
    # A bucket of several formats settles on the Triton backend too (SteadyGroups): its
    # groups' bound launches read views of the bucket at odd offsets (KeepLast) or one
    # gathered scratch (interleaved formats), and give the numba kernels' full path's bits.
    # With agreed block exponents and stats=True too: each sent group a
    # SteadyAgreedBlocks (hierarchical: a SteadyStaged of agreed block keys), their keys
    # one MAX all-reduce, the records the numba kernels'; a step within the ops budget
    # (every launch counted as one op, no zero_: the keys' kernel zeroes the union the
    # owner sets), the same for 7 layers as for 19.
    import aps_comm
    from aps_comm.engine import SteadyAgreedBlocks, SteadyGroups, SteadyStaged
    from aps_comm.policy import ByName, KeepLast
    from benchmarks.hostcost import ParamLayer, count_calls, world_of_one

    rules = {
        "keep_last": [KeepLast("fp16")],
        "interleaved": [ByName({"*[13579].weight": "fp16"}), KeepLast("fp32")],
    }
    options = {"fmt": "e4m3", "reduction": route, "policy": rules[policy]}
    if route == "hierarchical":
        options["ranks_per_node"] = 1
    if agreed:
        options.update(fmt="e2m1", scaling="block", block_size=8, block_exponents="agreed")
        options["stats"] = True
    x, params = _block_bucket([5, 0, 1, 300, 33, 2, 64], 11)
    log: list = []  # every launch, counted as one op each (on a GPU one kernel)
    if agreed:
        for name in (n for n in dir(tc) if n.endswith("_kernel")):
            monkeypatch.setattr(tc, name, _Launches(name, getattr(tc, name), log))

    def bound(layers: list[torch.Tensor]) -> aps_comm.APSState:
        state = aps_comm.APSState(**options)
        state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in layers))
        return state

    def step_ops(state: aps_comm.APSState, y: torch.Tensor, layers: list[torch.Tensor]) -> list:
        log.clear()
        run = functools.partial(state.run_bucket, 0, y, layers)
        aten, kernels = _quiet(count_calls, run, y.device)
        return sorted(aten + kernels + [name for name, _, _ in log])

    with _triton_plans():
        settled = bound(params)
        buffer = x.clone()
        for _ in range(3):  # the plan, the settled path bound, then run
            buffer.copy_(x)
            out = _quiet(settled.run_bucket, 0, buffer, params).clone()
        assert settled.reducer is not None
        st = settled.reducer.steady_for(0, buffer)
        assert isinstance(st, SteadyGroups) and st.parts is not None
        assert {s.group.codec.backend for _, s in st.parts if s is not None} == {"triton"}
        sent = [type(s) for _, s in st.parts if s is not None]
        kind = SteadyStaged if route == "hierarchical" else SteadyAgreedBlocks
        assert st.agreed_blocks == agreed and (set(sent) == {kind}) == agreed, sent
        records = repr(settled.stats)
        if agreed:  # a fourth step's ops, then those of a bucket of 19 layers
            buffer.copy_(x)
            few = step_ops(settled, buffer, params)
            y, layers = _block_bucket([5, 0, 1, 300, *[7] * 12, 33, 2, 64], 11)
            more, values = bound(layers), y.clone()
            for _ in range(4):  # the fourth step counted
                values.copy_(y)
                many = step_ops(more, values, layers)
            assert few == many, (few, many)
            # Hierarchical: per format group its keys, factors and records (three launches)
            # and the two levels' encodes, the node's sum and the decode.
            assert len(few) <= (15 if route == "two_phase" else 21), few
            del more
        del settled, st
    with world_of_one(torch.device("cpu")):
        reference = bound(params)
        want = reference.run_bucket(0, x.clone(), params)  # the numba kernels' full path
        assert repr(reference.stats) == records and ("e2m1" in records) == agreed, records
    assert out[:5].isnan().all() and not out[5:].isnan().any()
    same = torch.where(out.isnan(), 0.0, out).view(torch.int32)
    assert torch.equal(same, torch.where(want.isnan(), 0.0, want).view(torch.int32))


class _Launches(_Recorder):
    """A :class:`_Recorder` whose launches' own ATen ops (the interpreter's copies of the
    arguments) go uncounted: on a GPU each launch is one kernel, counted as one op."""

    def __getitem__(self, grid: object):  # type: ignore[no-untyped-def]
        from torch.utils._python_dispatch import _disable_current_modes

        run = super().__getitem__(grid)

        def launch(*args: object, **kwargs: object) -> object:
            with _disable_current_modes():
                return run(*args, **kwargs)

        return launch


@pytest.mark.parametrize(
    ("fmt", "exps", "block_size", "stats"),
    [
        ("fp16", "rank", 8, False),
        ("bf16", "agreed", 32, False),
        ("e2m1", "agreed", 8, False),
        ("e2m1", "agreed", 8, True),
    ],
)
def test_settled_16bit_and_agreed_block_buckets_on_triton_give_the_kernels_bits(
    tc: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
    exps: str,
    block_size: int,
    stats: bool,
) -> None:
    # 16-bit blocks and agreed block exponents bind on the Triton backend too: after the
    # first step the bucket is bound (SteadyBlocks, SteadyAgreedBlocks), a step is the
    # keys' kernel and three launches per chunk (the agreed ones: the keys' MAX
    # all-reduce between), within the ops budget, and its bits are the numba kernels'.
    # With stats=True too: the records (two launches on Triton) are the numba kernels'.
    import aps_comm
    from aps_comm.engine import SteadyAgreedBlocks, SteadyBlocks
    from benchmarks.hostcost import count_calls

    options = {
        "fmt": fmt,
        "reduction": "two_phase",
        "scaling": "block",
        "block_size": block_size,
        "block_exponents": exps,
        "stats": stats,
    }
    x, params = _block_bucket([5, 0, 1, 300, 33, 2, 64], 13)
    log: list = []
    recording = ("_block_records_kernel", "_records_rows_kernel") if stats else ()
    with _triton_plans():
        for name in (*_RANK_BLOCK_KERNELS, *recording):
            monkeypatch.setattr(tc, name, _Launches(name, getattr(tc, name), log))
        state = aps_comm.APSState(**options)
        buffer = x.clone()
        _quiet(state.run_bucket, 0, buffer, params)
        reducer = state.reducer
        assert reducer is not None
        st = reducer.steady_for(0, buffer)
        kind = SteadyBlocks if exps == "rank" else SteadyAgreedBlocks
        assert type(st) is kind and st.group.codec.backend == "triton", type(st)
        log.clear()
        buffer.copy_(x)
        run = functools.partial(state.run_bucket, 0, buffer, params)
        aten, kernels = _quiet(count_calls, run, x.device)
        out = buffer.clone()
        records = repr(state.stats)
        del state, reducer
    chunks = len(st.calls or [])
    names = [name for name, _, _ in log]
    keys = [_RANK_BLOCK_KERNELS[0], *recording]  # the records: once the keys are agreed
    assert names == [*keys, *_RANK_BLOCK_KERNELS[1:] * chunks], names
    assert not kernels and len(aten) + len(names) <= 15, (aten, names)
    want_records: list[str] = []
    want = _reference(options, x, params, want_records)
    assert records == want_records[0] and ("e2m1" in records) == stats, records
    assert out[:5].isnan().all() and not out[5:].isnan().any()
    same = torch.where(out.isnan(), 0.0, out).view(torch.int32)
    assert torch.equal(same, torch.where(want.isnan(), 0.0, want).view(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "block_size"), [(F.E2M1, 8), (F.BF16, 32)], ids=str)
def test_agreed_block_kernels_match_kernels(
    tc: types.ModuleType, fmt: FloatFormat, block_size: int
) -> None:
    # two_phase with agreed block exponents on Triton, the whole chain: every rank's send
    # with the agreed keys, each owner's step (the first chunk's: the layers' flags from
    # the agreed keys) and the decode of the gathered shards, byte for byte against the
    # numba kernels; every byte of every buffer written.
    from aps_comm import cpu_kernels
    from aps_comm.scaling import EXPONENT_LIMIT

    table = codec._key_table(False)
    for n in (1, 3):
        case = _rank_block_case(fmt, block_size, n)
        offsets, firsts, layer_of = case["offsets"], case["firsts"], case["layer_of"]
        sb, nb, counts = case["shard_bytes"], offsets.size - 1, case["counts"].numpy()
        piece = sb + 4  # zeros past the codes' padding
        keys = torch.zeros(nb, dtype=torch.uint8)  # the MAX all-reduce of every rank's keys
        for x in case["xs"]:
            k = torch.empty(nb, dtype=torch.uint8)
            flags = torch.empty(counts.size, dtype=torch.uint8)
            m = torch.empty(nb)
            cpu_kernels.block_keys(fmt, x, offsets, case["counts"], m, k, flags, EXPONENT_LIMIT, n)
            torch.maximum(keys, k, out=keys)
        sends = []
        for x in case["xs"]:
            send = torch.full((n * piece,), 0xA5, dtype=torch.uint8)
            call = tc.bind_send_rank_blocks(fmt, x, keys, offsets, firsts, flags, send, piece, -1)
            _quiet(call, -1)
            want = np.full(n * piece, 0x5A, np.uint8)
            cpu_kernels.send_agreed_blocks(
                fmt, x.numpy(), keys.numpy(), table, offsets, firsts, want, piece
            )
            assert np.array_equal(send.numpy(), want), n
            sends.append(send.view(n, piece))
        for first_chunk in (True, False) if n == 3 else (True,):
            outs, union = [], torch.full((counts.size,), 9, dtype=torch.uint8)
            want_union = np.full(counts.size, 9, np.uint8)
            for o in range(n):
                recv = torch.cat([s[o] for s in sends])
                shard = offsets[firsts[o] : firsts[o + 1] + 1] - offsets[firsts[o]]
                k = shard.size - 1
                out = torch.full((sb + case["slots"] + 3,), 0xA5, dtype=torch.uint8)
                d = torch.empty(max(k, 1), dtype=torch.int32)
                call = tc.bind_owner_agreed_blocks(
                    fmt, recv, n, shard, keys, int(firsts[o]), out, union, d, sb, block_size,
                    layer_of if first_chunk and o == 0 else None,
                )  # fmt: skip
                _quiet(call)
                want_out = np.full(out.numel(), 0x5A, np.uint8)
                scratch = (np.empty(max(k, 1), np.int32), np.empty(max(k, 1), np.int32))
                flags_of = counts if first_chunk and o == 0 else np.zeros(0, np.int64)
                cpu_kernels.owner_agreed_blocks(
                    fmt, EXPONENT_LIMIT, recv.numpy(), n, shard, keys.numpy(), int(firsts[o]),
                    want_out, sb, scratch, (flags_of, want_union), block_size,
                )  # fmt: skip
                assert np.array_equal(out.numpy(), want_out), (n, o)
                assert np.array_equal(union.numpy(), want_union), (n, o)
                assert np.array_equal(d.numpy()[:k], scratch[1][:k])
                outs.append(out)
            gathered = torch.cat(outs)
            for x in case["xs"]:
                got, want = x.clone(), x.clone()
                _quiet(
                    tc.bind_decode_rank_blocks(
                        fmt, gathered, n, offsets, firsts, layer_of, union, got, sb, keys
                    )
                )
                cpu_kernels.decode_agreed_blocks(
                    fmt, gathered.numpy(), n, offsets, firsts, keys.numpy(), layer_of,
                    union.numpy(), want.numpy(), sb,
                )  # fmt: skip
                assert torch.equal(_bits(got), _bits(want)), n
            if first_chunk:  # the fourth layer NaN on every rank, nothing else
                assert union.tolist() == [int(i == 3) for i in range(counts.size)]
                assert got[42:53].isnan().all() and not got[53:].isnan().any()


def test_block_keys_bound_bf16_by_the_fp32_sum(tc: types.ModuleType) -> None:
    # bf16's max times N passes float32's: the Triton keys' kernel bounds every key by the
    # owner's FP32 sum of N values too, as the CPU kernel does, at the edges of the range
    # (powers of two from the smallest subnormal to 2**127, and just below them).
    from aps_comm import cpu_kernels
    from aps_comm.scaling import EXPONENT_LIMIT

    pow2s = torch.exp2(torch.arange(-149, 128, dtype=torch.float64)).float()
    below = -pow2s.nextafter(torch.tensor(0.0))
    x = torch.cat([torch.tensor([0.0, -3.4e38, float("nan")]), pow2s, below])
    offsets = np.arange(x.numel() + 1, dtype=np.int64)  # one element per block
    counts = torch.tensor([2, 1, x.numel() - 3])
    layer_of = np.repeat(np.arange(3, dtype=np.int64), counts.numpy())
    for world in (1, 3, 1000):
        got = (torch.empty(x.numel()), torch.empty(x.numel(), dtype=torch.uint8))
        want = (torch.empty(x.numel()), torch.empty(x.numel(), dtype=torch.uint8))
        flags = [torch.empty(3, dtype=torch.uint8) for _ in range(2)]
        _quiet(tc.bind_block_keys(F.BF16, x, offsets, layer_of, *got, flags[0], world))
        cpu_kernels.block_keys(F.BF16, x, offsets, counts, *want, flags[1], EXPONENT_LIMIT, world)
        assert torch.equal(got[1], want[1]), (world, (got[1] != want[1]).nonzero()[:5])
        assert flags[0].tolist() == flags[1].tolist() == [0, 1, 0]


def test_block_records_and_maxima_meet_per_layer_not_per_block(
    tc: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Atomics on one address serialise on a GPU (per-element flags index_add_-ed into a
    # few layers' rows made e4m3 with stats 8.7x DDP's step on an H200). The records'
    # fold meets the other programs in 5 atomics per layer its blocks touch (once 5 per
    # block: 34M a step for a 216M-parameter model in 32-element blocks), with the
    # numba kernels' records; the maxima kernel, one per segment its elements touch.
    from aps_comm import cpu_kernels
    from aps_comm.layout import Layout

    monkeypatch.setattr(tc, "TILE", 64)  # 8 blocks of 8 per program: several per layer
    numels = [5, 0, 1, 300, 33, 2, 64, 1500, 0]
    blocks = Layout.from_numels(numels, torch.device("cpu")).grid(8)
    offsets, counts = blocks.layout.offsets.numpy(), blocks.counts.numpy()
    n = blocks.layout.n_segments
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(blocks.layout.numel, generator=gen)
    x *= 2.0 ** torch.randint(-140, 130, x.shape, generator=gen)
    keys = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    maxima = torch.rand(n, generator=gen) * 100
    layer_of = np.repeat(np.arange(counts.size), counts)
    call = tc.bind_block_records(F.E4M3, x, offsets, layer_of, keys, maxima, len(numels))
    records = torch.empty(len(numels), 5, dtype=torch.float64)
    with _atomic_lanes() as lanes:
        _quiet(call, records)
    want = torch.empty(len(numels), 5, dtype=torch.float64)
    cpu_kernels.block_records(x, offsets, counts, keys, maxima, F.E4M3, want)
    assert torch.equal(records, want)
    ranges = [layer_of[p : p + 8] for p in range(0, n, 8)]
    assert dict(lanes) == {p: 5 * np.unique(r).size for p, r in enumerate(ranges)}
    assert sum(lanes.values()) < 5 * n / 3  # the layers, not the blocks
    with pytest.raises(ValueError, match="ascending"):
        tc.bind_block_records(F.E4M3, x, offsets, layer_of[::-1], keys, maxima, len(numels))

    # The maxima: segments of x by layer, tc.BLOCK elements per program.
    layers = torch.from_numpy(np.concatenate([[0], np.cumsum(numels)]))
    got = torch.zeros(len(numels))
    with _atomic_lanes() as lanes:
        _quiet(tc.layer_maxima, x, got, layers)
    assert torch.equal(got, codec.segment_amax(x, Layout.from_numels(numels, x.device)))
    # Per program, the segments from its first element's to its last's.
    first = np.arange(0, x.numel(), tc.BLOCK)
    last = np.minimum(first + tc.BLOCK, x.numel()) - 1
    lo, hi = (np.searchsorted(layers.numpy(), e, "right") - 1 for e in (first, last))
    assert dict(lanes) == dict(enumerate((hi - lo + 1).tolist()))


@pytest.mark.parametrize(("fmt", "block_size"), [(F.E2M1, 8), (F.BF16, 32)], ids=str)
def test_staged_block_keys_and_records_match_kernels(
    tc: types.ModuleType, fmt: FloatFormat, block_size: int
) -> None:
    # The Triton kernels behind a settled staged bucket with agreed block exponents and
    # behind agreed blocks' records, bit for bit against the numba kernels: every
    # block's maxima and inner and outer keys (zero, non-finite and extreme blocks),
    # their factors from any keys (0 and 255 among them: a NaN unscale for the layer),
    # hierarchical and grid, and the records folded per layer, twice (the rows' scratch
    # zeroed again) with an empty layer.
    from aps_comm import cpu_kernels
    from aps_comm.layout import Layout
    from aps_comm.scaling import EXPONENT_LIMIT

    numels = [5, 0, 1, 300, 33, 2, 64]
    blocks = Layout.from_numels(numels, torch.device("cpu")).grid(block_size)
    offsets, counts = blocks.layout.offsets.numpy(), blocks.counts.numpy()
    n = blocks.layout.n_segments
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(blocks.layout.numel, generator=gen)
    x *= 2.0 ** torch.randint(-140, 130, x.shape, generator=gen)
    x[3], x[10], x[100:140] = float("nan"), float("inf"), 0.0
    for world_size, per_node in ((4, 2), (6, 3)):
        got = (torch.empty(n), torch.empty(2 * n, dtype=torch.uint8))
        want = (torch.empty(n), torch.empty(2 * n, dtype=torch.uint8))
        _quiet(tc.bind_staged_keys(fmt, x, offsets, *got, world_size, per_node))
        cpu_kernels.staged_keys(fmt, x, offsets, *want, world_size, per_node, EXPONENT_LIMIT)
        assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(got[1], want[1])
    keys = torch.randint(0, 256, (2 * n,), dtype=torch.uint8, generator=gen)
    keys[:n:3] = want[1][:n:3]
    for grid in (False, True):
        rows, want_rows = torch.empty(4, n), torch.empty(4, n)
        _quiet(tc.bind_staged_key_factors(keys, counts, grid, rows))
        cpu_kernels.staged_key_factors(keys, blocks.counts, grid, want_rows)
        assert torch.equal(_bits(rows), _bits(want_rows)), grid
        # No layer, and layers without blocks: nothing read past the layers' first blocks.
        for none in (counts[:0], np.zeros(2, np.int64)):
            _quiet(tc.bind_staged_key_factors(keys, none, grid, torch.empty(4, 0)))
    maxima = torch.rand(n, generator=gen) * 100
    maxima[2] = float("inf")
    layer_of = np.repeat(np.arange(counts.size), counts)
    call = tc.bind_block_records(fmt, x, offsets, layer_of, keys[:n], maxima, len(numels))
    want_records = torch.empty(len(numels), 5, dtype=torch.float64)
    cpu_kernels.block_records(x, offsets, counts, keys[:n], maxima, fmt, want_records)
    for _ in range(2):
        records = torch.full((len(numels), 5), 7.0, dtype=torch.float64)
        _quiet(call, records)
        assert torch.equal(records, want_records)
    # Layers without blocks: zero rows, no block read.
    empty = tc.bind_block_records(fmt, x[:0], offsets[:1], layer_of[:0], keys[:0], maxima[:0], 2)
    _quiet(empty, records[:2])
    assert records[:2].eq(0).all()


def _native_blocks_run(
    options: dict, x: torch.Tensor, params: list[torch.Tensor]
) -> tuple[torch.Tensor, str, str]:
    """A native block bucket's third step (bound at the first): its result, its records
    and the backend of its bound part, which reads nothing on the host."""
    import aps_comm
    from aps_comm.engine import SteadyAgreedBlocks, SteadyGroups
    from benchmarks.hostcost import ParamLayer, count_calls

    state = aps_comm.APSState(**options)
    state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
    buffer = x.clone()
    for _ in range(2):
        buffer.copy_(x)
        _quiet(state.run_bucket, 0, buffer, params)
    assert state.reducer is not None
    st = state.reducer.steady_for(0, buffer)
    if isinstance(st, SteadyGroups):  # beside the FP32 layer: its one scaled part
        assert st.parts is not None
        st = next(s for _, s in st.parts if s is not None)
    assert isinstance(st, SteadyAgreedBlocks) and st.native, type(st)
    buffer.copy_(x)
    aten, _ = _quiet(count_calls, functools.partial(state.run_bucket, 0, buffer, params), x.device)
    assert not any("_local_scalar_dense" in op for op in aten), aten
    backend = st.group.codec.backend
    records = repr(state.stats)
    del state, st
    return buffer, records, backend


@pytest.mark.parametrize(
    ("exps", "stats", "policy"),
    [("rank", False, False), ("agreed", True, False), ("agreed", False, True)],
)
def test_settled_native_block_bucket_on_triton_gives_the_kernels_bits(
    tc: types.ModuleType, exps: str, stats: bool, policy: bool
) -> None:
    # The native all-reduce with block scaling (Gloo sums fp16; agreed keys whatever is
    # asked) binds on the Triton backend too: a SteadyAgreedBlocks, native (beside an FP32
    # layer, a SteadyGroups' part), its keys under the native sum's rule and their factors
    # the general path's tensor ops, its encode and decode Triton's launches, nothing
    # read on the host. Its bits and records are the numba kernels'.
    from aps_comm.policy import KeepLast
    from benchmarks.hostcost import world_of_one

    options = {
        "fmt": "fp16",
        "reduction": "allreduce",
        "scaling": "block",
        "block_size": 8,
        "block_exponents": exps,
        "stats": stats,
        "policy": [KeepLast("fp32")] if policy else None,
    }
    x, params = _block_bucket([5, 0, 1, 300, 33, 2, 64], 17)
    with _triton_plans():
        out, records, backend = _native_blocks_run(options, x, params)
    with world_of_one(torch.device("cpu")):
        want, want_records, want_backend = _native_blocks_run(options, x, params)
    assert (backend, want_backend) == ("triton", "kernels")
    assert records == want_records and ("fp16" in records) == stats, records
    assert out[:5].isnan().all() and not out[5:].isnan().any()
    same = torch.where(out.isnan(), 0.0, out).view(torch.int32)
    assert torch.equal(same, torch.where(want.isnan(), 0.0, want).view(torch.int32))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")  # aps_comm.caveats' advice, not an error
def test_every_configuration_binds_on_triton(
    tc: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every cell of tests/test_settles.py's DDP matrix (formats, scalings, block exponents,
    # routes, policies, stats, error feedback) with its codecs on Triton: bound from the
    # first step (an unbound bucket would raise: there is no general path), bound at the third, and
    # no host read. On a GPU this is the backend "auto" picks; a cell unbound here would
    # have nothing to run on once the general path is gone.
    import aps_comm
    from benchmarks.hostcost import ParamLayer, count_calls
    from tests.test_settles import FAMILIES, NUMELS, POLICIES, ROUTES, SCALINGS

    product = itertools.product(SCALINGS, ROUTES, POLICIES, (False, True), (False, True))
    gen = torch.Generator().manual_seed(7)
    x = (torch.rand(sum(NUMELS), generator=gen) + 0.5) * torch.randn(
        sum(NUMELS), generator=gen
    ).sign()
    unbound, cells = [], 0
    with _triton_plans():
        for i, ((scaling, exps), route, policy, stats, fb) in enumerate(product):
            fmt = "fp16" if route == "allreduce" else FAMILIES[i % len(FAMILIES)]
            cell = (fmt, scaling, exps, route, policy, stats, fb)
            options = {
                "fmt": fmt,
                "reduction": route,
                "scaling": scaling,
                "block_exponents": exps,
                "stats": stats,
                "error_feedback": fb,
                "policy": POLICIES[policy](),
                "ranks_per_node": 1 if route == "hierarchical" else None,
            }
            params = [torch.nn.Parameter(torch.empty(n)) for n in NUMELS]
            buffer = x.clone()
            try:
                state = aps_comm.APSState(**options)
                state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
                _quiet(state.run_bucket, 0, buffer, params)
            except ValueError as exc:  # refused as in tests/test_settles.py
                refused = ("needs a backend that sums", "is not supported with", "needs one exp")
                assert any(r in str(exc) for r in refused), exc
                continue
            for _ in range(2):
                buffer.copy_(x)
                _quiet(state.run_bucket, 0, buffer, params)
            assert state.reducer is not None
            st = state.reducer.steady_for(0, buffer)
            backends = {
                g.codec.backend
                for p in state.reducer.plans.values()
                for gs in p.groups.values()
                for g in gs
                if g.fmt.name != "fp32"
            }
            assert backends == {"triton"}, (cell, backends)
            buffer.copy_(x)
            run = functools.partial(state.run_bucket, 0, buffer, params)
            aten, _ = _quiet(count_calls, run, x.device)
            if st is None or any("_local_scalar_dense" in op for op in aten):
                unbound.append(cell)
            cells += 1
            del state, st
    assert cells > 200 and unbound == [], unbound


@pytest.mark.parametrize("scaled", ["factors", "maxima"])
def test_an_empty_shard_encodes_its_padding_without_reading_factors(
    tc: types.ModuleType, scaled: str
) -> None:
    # A short last chunk leaves a rank a shard of no elements and only padding: its
    # segmentation has no factors, whose empty tensor's address is 0. A GPU faulted
    # reading it ("illegal memory access", hierarchical e4m3 on an H200); the
    # interpreter segfaults. The padding's codes are zeros.
    out = torch.full((6,), 0xA5, dtype=torch.uint8)
    empty = torch.empty(0)
    offsets = torch.zeros(1, dtype=torch.int64)
    if scaled == "factors":
        tc.encode(empty, out[:5], F.E4M3, offsets, torch.empty(0), pad=5)
    else:
        rule = tc.Rule(world_size=4)
        tc.encode(empty, out[:5], F.E4M3, offsets, maxima=torch.empty(0), rule=rule, pad=5)
    assert out[:5].eq(0).all() and out[5] == 0xA5


def test_a_send_of_more_than_65535_programs_fits_the_launch_grid(
    tc: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At world size 1 an embedding's bucket is one shard of 112k programs' bytes: on the
    # grid's y axis (at most 65535) a GPU refused the launch ("invalid argument").
    grids = []

    class Recorder:
        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(tc, "_send_rank_blocks_kernel", Recorder())
    send = torch.empty(70000 * 1024, dtype=torch.uint8)
    for n in (1, 2):
        tc.bind_send_rank_blocks(
            F.E4M3,
            torch.zeros(8),
            torch.zeros(1, dtype=torch.uint8),
            np.array([0, 8]),
            np.array([0] * n + [1]),
            torch.zeros(1, dtype=torch.uint8),
            send,
            16,
            -1,
        )(0)
    assert len(grids) == 2
    for grid in grids:
        assert all(d <= limit for d, limit in zip(grid, tc.GRID_LIMITS, strict=False)), grid
        assert np.prod(grid) >= 70000 // len(grid), grid
    with pytest.raises(ValueError, match=r"a launch grid of \(2, 70000\) programs"):
        tc.launch_grid(2, 70000)


_STATS_CONFIGS = {
    "two_phase": {"fmt": "e4m3", "reduction": "two_phase"},
    "bucket": {"fmt": "e4m3", "reduction": "two_phase", "scaling": "bucket"},
    "none": {"fmt": "e4m3", "reduction": "two_phase", "scaling": "none"},
    "native": {"fmt": "fp16", "reduction": "allreduce"},
    "block": {"fmt": "e2m1", "reduction": "two_phase", "scaling": "block", "block_size": 8},
}


def _launches(state: object, buffer: torch.Tensor, params: list[torch.Tensor]) -> list[str]:
    """One settled step's ATen ops and Triton launches (the interpreter's own argument
    copies, ``new_empty``/``set_`` then ``copy_``, left out)."""
    import triton.runtime.interpreter as ti

    from benchmarks.hostcost import count_ops

    launched: list[str] = []
    run = ti.GridExecutor.__call__

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        launched.append(getattr(self.fn, "__name__", "?"))
        return run(self, *args, **kwargs)

    with unittest.mock.patch.object(ti.GridExecutor, "__call__", counted):
        aten, _ = count_ops(state, buffer, params)  # type: ignore[arg-type]
    copying = ("aten::new_empty", "aten::set_")
    kept = [
        op
        for i, op in enumerate(aten)
        if not op.startswith(copying)
        and not (op == "aten::copy_.default" and i and aten[i - 1].startswith("aten::set_"))
    ]
    return kept + launched


@pytest.mark.parametrize("name", list(_STATS_CONFIGS))
def test_settled_records_on_triton_are_a_fixed_handful_of_launches(
    tc: types.ModuleType, name: str
) -> None:
    # stats=True on Triton: a settled bucket's records are a few launches (the layers'
    # cell keys and the block records' two; with every rank's own block exponents the
    # block records' two), not the ~60 to 90 ATen ops of the exponent rule and
    # layer_counts: at most 15 per bucket with its four plain launches, the same for 7
    # layers as for 42, and the numba kernels' records (a NaN layer, an empty one, layers
    # of several cells).
    import aps_comm

    options = {**_STATS_CONFIGS[name], "stats": True}
    counts = []
    for numels in ([5, 0, 1, 300, 33, 2, 64], [5, 0, 1, 300, 33, 2, 64] * 6):
        x, params = _block_bucket(numels, 13)
        want: list[str] = []
        _reference(options, x, params, want)
        with _triton_plans():
            state = aps_comm.APSState(**options)
            buffer = x.clone()
            for _ in range(2):  # bound, then settled
                buffer.copy_(x)
                _quiet(state.run_bucket, 0, buffer, params)
            assert state.reducer is not None
            st = state.reducer.steady_for(0, buffer)
            assert st is not None and st.group.codec.backend == "triton"
            assert repr(state.stats) == want[0]
            buffer.copy_(x)
            ops = _launches(state, buffer, params)
            assert repr(state.stats) == want[0]
            del state, st
        counts.append(ops)
    assert len(counts[0]) == len(counts[1]) <= 15, counts


_FEEDBACK_CONFIGS = {
    "two_phase": {"fmt": "e4m3", "reduction": "two_phase"},
    "none": {"fmt": "e4m3", "reduction": "two_phase", "scaling": "none"},
    "native": {"fmt": "fp16", "reduction": "allreduce"},
    "two_phase-stats": {"fmt": "e4m3", "reduction": "two_phase", "stats": True},
    # Agreed block keys' factors in one launch (bind_block_factors): 32 before; the native
    # sum's block keys in one more (bind_native_block_keys): 66 before.
    "block": {"fmt": "e2m1", "reduction": "two_phase", "scaling": "block"},
    "native-block": {"fmt": "fp16", "reduction": "allreduce", "scaling": "block", "block_size": 8},
    # The agreed keys' records in two launches (bind_block_records): 89 before.
    "block-stats": {"fmt": "e2m1", "reduction": "two_phase", "scaling": "block", "stats": True},
}


@pytest.mark.parametrize("name", list(_FEEDBACK_CONFIGS))
def test_settled_error_feedback_on_triton_is_a_fixed_handful_of_launches(
    tc: types.ModuleType, name: str
) -> None:
    # A settled SteadyFeedback bucket on Triton (layer, block and no scaling, two_phase and
    # the native sum, with records): its factors (one launch from the agreed maxima), residual
    # updates and owner step are a fixed handful of launches and ATen ops, at most 15 (they
    # were 51 to 101 tensor ops and launches), the same for 7 layers as for 42. Their bits:
    # test_settled_error_feedback_on_triton_gives_the_kernels_bits.
    import aps_comm
    from aps_comm.engine import SteadyFeedback

    options = {**_FEEDBACK_CONFIGS[name], "error_feedback": True}
    counts = []
    for numels in ([5, 0, 1, 300, 33, 2, 64], [5, 0, 1, 300, 33, 2, 64] * 6):
        x, params = _block_bucket(numels, 17)
        with _triton_plans():
            state = aps_comm.APSState(**options)
            state.bind_model(torch.nn.ParameterList(params))
            buffer = x.clone()
            for _ in range(2):  # bound, then settled
                buffer.copy_(x)
                _quiet(state.run_bucket, 0, buffer, params)
            assert state.reducer is not None
            st = state.reducer.steady_for(0, buffer)
            assert isinstance(st, SteadyFeedback) and st.group.codec.backend == "triton"
            buffer.copy_(x)
            ops = _launches(state, buffer, params)
            del state, st
        counts.append(ops)
    assert len(counts[0]) == len(counts[1]) <= 15, counts


_PROMOTE_CONFIGS = {
    "two_phase": {"fmt": "e4m3", "reduction": "two_phase"},
    "native": {"fmt": "fp16", "reduction": "allreduce"},
    "two_phase-feedback": {"fmt": "e4m3", "reduction": "two_phase", "error_feedback": True},
    "native-feedback": {"fmt": "fp16", "reduction": "allreduce", "error_feedback": True},
    # The first level's exponents, read from the staged factor rows (bind_row_cell_keys).
    "hierarchical": {"fmt": "e4m3", "reduction": "hierarchical", "ranks_per_node": 1},
    # With stats=True the rates reuse the counts of the step's own records.
    "two_phase-stats": {"fmt": "e4m3", "reduction": "two_phase", "stats": True},
    "two_phase-feedback-stats": {
        "fmt": "e4m3",
        "reduction": "two_phase",
        "error_feedback": True,
        "stats": True,
    },
    "hierarchical-stats": {
        "fmt": "e4m3",
        "reduction": "hierarchical",
        "ranks_per_node": 1,
        "stats": True,
    },
}


def _promoted(
    options: dict, numels: list[int], steps: int = 3
) -> tuple[object, torch.Tensor, list]:
    """A settled Promote bucket (gamma 0.9: no layer moves) after ``steps`` steps: the
    state, its buffer and each step's agreed rates."""
    import aps_comm
    from aps_comm.policy import Promote
    from benchmarks.hostcost import ParamLayer

    x, params = _block_bucket(numels, 23)
    half = numels[0] // 2  # the first layer's first half underflows, not enough to move it
    x[:half], x[half : numels[0]], x[0] = 2.0**-45, 0.5, 1.0
    ladder = (options["fmt"], "fp32")
    state = aps_comm.APSState(**options, policy=[Promote(gamma=0.9, ladder=ladder)])
    state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
    buffer, rates = x.clone(), []
    for _ in range(steps):
        buffer.copy_(x)
        _quiet(state.run_bucket, 0, buffer, params)
        assert state.reducer is not None
        rates.append([float(r) for r in state.reducer.rates.values()])
    return state, buffer, rates


@pytest.mark.parametrize("name", list(_PROMOTE_CONFIGS))
def test_promote_rates_on_triton_are_the_kernels_in_a_fixed_handful_of_launches(
    tc: types.ModuleType, name: str
) -> None:
    # Promote's underflow rates of a settled bucket on Triton come from the layer records'
    # counts (three launches, bound once, and three ops), not ~90 tensor ops per bucket:
    # the CPU kernels' rates every step, at most 15 launches and ATen ops (18 with error
    # feedback's own 12), the same for 7 layers as for 42.
    from benchmarks.hostcost import world_of_one

    options = _PROMOTE_CONFIGS[name]
    numels = [300, 5, 0, 1, 33, 2, 64]
    with world_of_one(torch.device("cpu")):
        _, _, want = _promoted(options, numels)
    counts = []
    for layers in (numels, numels * 6):
        with _triton_plans():
            state, buffer, got = _promoted(options, layers)
            assert state.reducer is not None
            st = state.reducer.steady_for(0, buffer)
            assert st is not None and st.group.codec.backend == "triton"
            # Bound once; with stats=True the records' own call serves instead.
            assert (st.records_call if options.get("stats") else st.rates_call) is not None
            assert options.get("stats") or st.records_call is None
            counts.append(_launches(state, buffer, []))
            if layers is numels:
                assert got == want and max(want[-1]) > 0.1
            del state, st
    budget = 18 if options.get("error_feedback") else 15
    assert len(counts[0]) == len(counts[1]) <= budget, counts


@pytest.mark.parametrize("stats", [False, True], ids=["", "stats"])
@pytest.mark.parametrize("policy", [False, True], ids=["plain", "keep_last"])
def test_settled_staged_bucket_on_triton_is_a_fixed_handful_of_launches(
    tc: types.ModuleType, policy: bool, stats: bool
) -> None:
    # A settled hierarchical bucket with one exponent per layer on Triton: its factor rows
    # are one launch from the agreed maxima (bind_staged_factors; ~120 tensor ops before)
    # and its records three (bind_staged_records; ~140 more before), at most 15 launches
    # and ATen ops in all, the same for 7 layers as for 42. Their bits and records:
    # test_settled_staged_buckets_on_triton_and_bits_give_the_kernels_bits.
    import aps_comm
    from aps_comm.engine import SteadyGroups, SteadyStaged
    from aps_comm.policy import KeepLast
    from benchmarks.hostcost import ParamLayer

    counts = []
    for numels in ([5, 0, 1, 300, 33, 2, 64], [5, 0, 1, 300, 33, 2, 64] * 6):
        x, params = _block_bucket(numels, 17)
        with _triton_plans():
            state = aps_comm.APSState(
                "e4m3",
                reduction="hierarchical",
                ranks_per_node=1,
                policy=[KeepLast("fp32")] if policy else None,
                stats=stats,
            )
            state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
            buffer = x.clone()
            for _ in range(2):  # bound, then settled
                buffer.copy_(x)
                _quiet(state.run_bucket, 0, buffer, params)
            assert state.reducer is not None
            st = state.reducer.steady_for(0, buffer)
            assert isinstance(st, SteadyGroups if policy else SteadyStaged)
            buffer.copy_(x)
            ops = _launches(state, buffer, params)
            del state, st
        counts.append(ops)
    assert "_staged_factors_kernel" in counts[0]
    assert ("_row_cell_keys_kernel" in counts[0]) == stats
    assert len(counts[0]) == len(counts[1]) <= 15, counts
