"""The CPU kernels' encoder paths, fused scales and owner reduction against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aps_comm import codec, cpu_kernels
from aps_comm.formats import (
    BF16,
    E2M1,
    E2M3,
    E3M0,
    E3M2,
    E3M4,
    E4M3,
    E5M2,
    FP16,
    FloatFormat,
    code_table,
    decode,
    encode,
    payload_nbytes,
)

# Built-in formats, and custom ones on either side of each path's limits.
FORMATS = [
    E4M3,
    E5M2,
    FP16,
    BF16,
    E3M4,
    E2M3,
    E3M2,
    E2M1,
    E3M0,
    FloatFormat(5, 1, bias=10),
    FloatFormat(3, 3, specials="fn", bias=5),
    FloatFormat(4, 3, specials="fn", bias=-92),  # top binade: 2**(107 + 20) = 2**127
    FloatFormat(4, 3, specials="fn", bias=-93),  # 2**128 overflows: no binade path
    FloatFormat(2, 1, specials="none", bias=-120),  # no float-add path at all
]
_IDS = [f"{f.name}-{f.specials}-b{f.bias}" for f in FORMATS]


def _paths(fmt: FloatFormat) -> dict[str, tuple[np.uint32, ...]]:
    """The encoder's parameter tuples for every path ``fmt`` can take.

    "binade": every value rounded by a float add (index 11), "magic":
    subnormals only (index 10), "int": integers only.
    """
    p = cpu_kernels.encoder_params(fmt)
    paths = {"int": cpu_kernels.encoder_params(fmt, add_subnormals=False)}
    if p[10] != 0:
        paths["magic"] = (*p[:11], np.uint32(0), *p[12:])
    if p[11] != 0:
        paths["binade"] = p
    return paths


def _encode_with(
    params: tuple[np.uint32, ...],
    x: torch.Tensor,
    fmt: FloatFormat,
    monkeypatch: pytest.MonkeyPatch,
    **kw: object,
) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "encoder_params", lambda f, add_subnormals=True: params)
        return codec.encode(x, fmt, backend="kernels", **kw)  # type: ignore[arg-type]


def _float32_sweep(fmt: FloatFormat) -> torch.Tensor:
    """A million float32 bit patterns spread over all 2**32 (every exponent, sign and
    many mantissas), the format's own values and their neighbours, and specials."""
    bits = np.arange(0, 2**32, 4093, dtype=np.uint64).astype(np.uint32)
    table = code_table(fmt)
    vals = table[np.isfinite(table)]
    near = [np.nextafter(vals, np.float32(v)) for v in (np.inf, -np.inf)]
    edges = [fmt.max, -fmt.max, min(2 * fmt.max, 3e38), np.inf, -np.inf, np.nan, 0.0, -0.0]
    x = np.concatenate([bits.view(np.float32), vals, *near, np.array(edges, np.float32)])
    x = x.astype(np.float32)
    if not fmt.has_nan:
        x = x[np.isfinite(x)]
    return torch.from_numpy(x)


def _canonical(x: torch.Tensor) -> torch.Tensor:
    """int32 bits with every NaN the same NaN (NaN codes may differ in sign)."""
    return torch.where(x.isnan(), float("nan"), x).view(torch.int32)


def test_path_choice() -> None:
    # The float-add path for every built-in format but bf16 (its top binade
    # would need 2**143) and e3m0 (no mantissa bit to round to even).
    for fmt in (E4M3, E5M2, FP16, E3M4, E2M3, E3M2, E2M1):
        assert set(_paths(fmt)) == {"int", "magic", "binade"}, fmt
    for fmt in (BF16, E3M0):
        assert set(_paths(fmt)) == {"int", "magic"}, fmt


@pytest.mark.parametrize("fmt", FORMATS, ids=_IDS)
def test_every_encoder_path_matches_reference(
    fmt: FloatFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cpu_kernels.supports(fmt)
    x = _float32_sweep(fmt)
    expected = encode(x, fmt)
    got = {name: _encode_with(p, x, fmt, monkeypatch) for name, p in _paths(fmt).items()}
    for name, out in got.items():
        # Same values, and the same bytes whatever the path (NaN codes included).
        assert torch.equal(out, got["int"]), (fmt, name)
        back = decode(out, fmt, x.numel())
        assert torch.equal(_canonical(back), _canonical(decode(expected, fmt, x.numel()))), name
    # The kernels' decoder (bit fields, or the table for 4-bit codes with a
    # negative bias) gives the reference's values for every code in the sweep.
    mine = codec.decode(got["int"], fmt, x.numel(), backend="kernels")
    assert torch.equal(_canonical(mine), _canonical(decode(got["int"], fmt, x.numel())))


@pytest.mark.parametrize("fmt", [E4M3, E5M2, FP16, BF16, E2M1, E3M0], ids=str)
def test_scaled_encode_and_decode_match_reference(
    fmt: FloatFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Factors where the decoder's single multiply is exact (powers of two,
    # 1, a subnormal) and where it is not (2**100 times the decoder's own
    # power of two overflows; 3 is no power of two): either way one rounding.
    gen = torch.Generator().manual_seed(11)
    sizes = [0, 1, 2047, 2049, 5000, 3, 777]
    x = torch.randn(sum(sizes), generator=gen) * torch.exp2(torch.randint(-30, 30, (sum(sizes),)))
    layout = codec.Layout.from_numels(sizes, x.device)
    scale = torch.tensor([8.0, 2.0**-140, 2.0**100, 3.0, 1.0, 0.5, 2.0**-20])
    per_element = torch.repeat_interleave(scale, layout.lengths)
    scaled = x * per_element
    if not fmt.has_nan:  # the reference refuses inf there; the kernels saturate it
        scaled = scaled.clamp(-fmt.max, fmt.max)
    expected = encode(scaled, fmt)
    values = _canonical(decode(expected, fmt, x.numel()))
    got = {
        name: _encode_with(p, x, fmt, monkeypatch, scale=scale, layout=layout)
        for name, p in _paths(fmt).items()
    }
    for name, out in got.items():
        # -inf in e4m3 is a NaN code with the sign bit here, without in the reference.
        assert torch.equal(out, got["int"]), (fmt, name)
        assert torch.equal(_canonical(decode(out, fmt, x.numel())), values), (fmt, name)
    dec = codec.decode(expected, fmt, x.numel(), scale=scale, layout=layout, backend="kernels")
    ref = decode(expected, fmt, x.numel()) * per_element
    assert torch.equal(_canonical(dec), _canonical(ref)), fmt


@pytest.mark.parametrize(
    "fmt",
    [
        E4M3,
        E5M2,
        FP16,
        BF16,
        E3M2,
        E2M1,
        E3M0,
        FloatFormat(4, 3, specials="fn", bias=-92),  # decoded through the table
        FloatFormat(2, 1, specials="none", bias=-120),  # 4-bit, through torch
    ],
    ids=lambda f: f"{f.name}-b{f.bias}",
)
@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4])
def test_owner_reduce_matches_reference(fmt: FloatFormat, n_ranks: int) -> None:
    # Random codes (inf and NaN included), sums that overflow, and blocks
    # that end mid-way (the shard is no multiple of the kernel's block).
    shard = 5000
    gen = torch.Generator().manual_seed(n_ranks)
    nbytes = payload_nbytes(shard, fmt)
    # Every byte is a code pair (4 bits), a code (8) or half of one (16).
    high = 2**fmt.bits if fmt.wire_bits == 8 else 256
    recv = torch.randint(0, high, (n_ranks * nbytes,), generator=gen).to(torch.uint8)
    got = codec.owner_reduce(recv, fmt, n_ranks, backend="kernels")
    acc = decode(recv[:nbytes], fmt, shard)
    for r in range(1, n_ranks):
        acc = acc + decode(recv[r * nbytes : (r + 1) * nbytes], fmt, shard)
    expected = encode(acc / n_ranks, fmt)
    assert torch.equal(
        _canonical(decode(got, fmt, shard)), _canonical(decode(expected, fmt, shard))
    )


# Layers longer than the 4-bit encoder's tile, odd sizes (the next layer's 4-bit
# codes, and its run of whole blocks, then start mid-byte), empty layers, and a
# tile holding more segments than elements.
_TILED_NUMELS = [4097, 8191, 3, 0, 0, 1, 2, 5000, *([0] * 5000), 6]


@pytest.mark.parametrize("fmt", [E2M1, E3M0, E4M3, FP16, BF16], ids=str)
@pytest.mark.parametrize("block_size", [8, 256])
def test_block_scaled_kernels_match_the_bits_backend(fmt: FloatFormat, block_size: int) -> None:
    # Every block its own factor: powers of two over a wide range (codes
    # from subnormal to saturated), some no power of two (3, 1.5: the
    # product rounds once), one subnormal float32.
    gen = torch.Generator().manual_seed(block_size)
    numel = sum(_TILED_NUMELS)
    x = torch.randn(numel, generator=gen) * torch.exp2(torch.randint(-12, 12, (numel,)))
    blocks = codec.Layout.from_numels(_TILED_NUMELS, x.device).grid(block_size)
    scale = torch.exp2(torch.randint(-16, 16, (blocks.n_blocks,), generator=gen).float())
    scale[::7], scale[3::11], scale[5] = 3.0, 1.5, 2.0**-140
    for sc, layout in ((scale, blocks.layout), (scale[:1], None)):
        kw = {"scale": sc, "layout": layout}
        mine = codec.encode(x, fmt, backend="kernels", **kw)  # type: ignore[arg-type]
        assert torch.equal(mine, codec.encode(x, fmt, backend="bits", **kw)), layout  # type: ignore[arg-type]
        got = codec.decode(mine, fmt, numel, backend="kernels", **kw)  # type: ignore[arg-type]
        ref = codec.decode(mine, fmt, numel, backend="bits", **kw)  # type: ignore[arg-type]
        assert torch.equal(_canonical(got), _canonical(ref)), layout


def _block_sizes(numel: int) -> list[int]:
    """Segment sizes of blocks (whole, short, odd, single) covering ``numel`` elements."""
    cycle = [8, 16, 32, 7, 24, 1, 256, 40, 9, 17]
    sizes = cycle * (numel // sum(cycle) + 1)
    while sum(sizes) - sizes[-1] >= numel:
        sizes.pop()
    sizes[-1] -= sum(sizes) - numel
    return sizes


@pytest.mark.parametrize(
    "fmt",
    [E4M3, E5M2, FP16, BF16, E2M3, E2M1, E3M0, FloatFormat(3, 3, specials="fn", bias=5)],
    ids=lambda f: f"{f.name}-b{f.bias}",
)
def test_short_segments_decode_every_code(fmt: FloatFormat) -> None:
    # Every code (inf and NaN included) through segments of a block's sizes,
    # odd starts among them: the decoder's explicit 16- and 8-lane vectors,
    # and the scalar rest, against the reference times each factor.
    gen = torch.Generator().manual_seed(fmt.bits)
    numel = max(2**fmt.bits, 4096)
    codes = torch.arange(numel) % 2**fmt.bits
    codes = codes[torch.randperm(numel, generator=gen)]
    if fmt.wire_bits == 16:
        payload = codes.to(torch.int16).view(torch.uint8)
    elif fmt.wire_bits == 8:
        payload = codes.to(torch.uint8)
    else:
        payload = (codes[0::2] | codes[1::2] << 4).to(torch.uint8)
    sizes = _block_sizes(numel)
    layout = codec.Layout.from_numels(sizes, payload.device)
    scale = torch.exp2(torch.randint(-20, 20, (len(sizes),), generator=gen).float())
    scale[::5] = 3.0
    got = codec.decode(payload, fmt, numel, scale=scale, layout=layout, backend="kernels")
    ref = decode(payload, fmt, numel) * torch.repeat_interleave(scale, layout.lengths)
    assert torch.equal(_canonical(got), _canonical(ref))


@pytest.mark.parametrize("fmt", [E4M3, E5M2, FP16, E3M4, E2M3, E3M2, E2M1], ids=str)
def test_short_segments_encode_like_one_segment(fmt: FloatFormat) -> None:
    # The sweep (every exponent, ties, neighbours, inf, NaN) cut into a
    # block's sizes with factor 1 goes through the encoder's explicit 16- and
    # 8-lane vectors and its scalar rest; as one segment through the loop
    # checked against the reference above.
    x = _float32_sweep(fmt)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    sizes = _block_sizes(x.numel())
    layout = codec.Layout.from_numels(sizes, x.device)
    ones = torch.ones(len(sizes))
    got = codec.encode(x, fmt, scale=ones, layout=layout, backend="kernels")
    assert torch.equal(got, codec.encode(x, fmt, backend="kernels"))


@pytest.mark.parametrize("fmt", [E2M1, E4M3, FP16, BF16])
@pytest.mark.parametrize(("n_ranks", "rank"), [(1, 0), (3, 1), (3, 2)])
def test_fused_feedback_kernels_give_the_separate_calls_bits(
    fmt: FloatFormat, n_ranks: int, rank: int
) -> None:
    """encode_keep and owner_feedback (issue 46: one call each for interleaved formats with
    error feedback) against the calls they fuse, bit for bit: odd segments (4-bit codes
    split bytes), an empty one, a non-finite one, padding to whole shards."""
    gen = torch.Generator().manual_seed(n_ranks + 7 * fmt.wire_bits)
    offsets = np.array([0, 7, 7, 40, 41, 90], np.int64)
    numel, n_seg = int(offsets[-1]), offsets.size - 1
    x = torch.randn(numel, generator=gen) * 30.0
    x[41] = float("inf")
    scale = (2.0 ** torch.randint(-3, 4, (n_seg,), generator=gen)).float()
    unscale = 1.0 / scale
    unscale[3] = float("nan")  # the segment that holds the inf
    per = -(-numel // n_ranks)
    per += per % 2  # a shard of whole bytes, the last one padded
    send_bytes = payload_nbytes(per * n_ranks, fmt)
    runs = (offsets, None, None)
    factors = (scale.numpy(), unscale.numpy())
    send = [np.full(send_bytes, 77, np.uint8) for _ in range(2)]
    sent, residual = ([np.empty(numel, np.float32) for _ in range(2)] for _ in range(2))
    head = payload_nbytes(numel, fmt)
    cpu_kernels.encode_keep(fmt, x.numpy(), send[0], head, runs, factors, sent[0], residual[0])
    send[1][head:] = 0
    cpu_kernels.encode(x, torch.from_numpy(send[1][:head]), fmt, offsets, factors[0])
    cpu_kernels.decode(
        torch.from_numpy(send[1][:head]), torch.from_numpy(sent[1]), fmt, offsets, factors[1]
    )
    cpu_kernels.keep_lost(x, torch.from_numpy(sent[1]), torch.from_numpy(residual[1]))
    assert np.array_equal(send[0], send[1])
    assert np.array_equal(sent[0].view(np.int32), sent[1].view(np.int32))
    assert np.array_equal(residual[0].view(np.int32), residual[1].view(np.int32))

    recv = torch.from_numpy(np.concatenate([send[0]] * n_ranks))
    recv[: send_bytes // 2] = torch.randint(0, 255, (send_bytes // 2,), generator=gen).byte()
    shard = payload_nbytes(per, fmt)
    lo, hi = rank * per, min(rank * per + per, numel)
    outs, residuals = (
        [np.empty(shard, np.uint8) for _ in range(2)],
        [residual[0].copy() for _ in range(2)],
    )
    values, acc = np.empty(n_ranks * per, np.float32), np.empty(per, np.float32)
    cpu_kernels.owner_feedback(
        fmt,
        recv.numpy(),
        (values, acc),
        outs[0],
        (offsets, *factors),
        (lo, hi, n_ranks),
        residuals[0],
    )
    got_acc = acc.copy()
    t_values, t_acc = torch.empty(n_ranks * per), torch.empty(per)
    cpu_kernels.decode(recv, t_values, fmt)
    cpu_kernels.mean_rows(t_values.numpy().reshape(n_ranks, -1), t_acc.numpy())
    cpu_kernels.encode(t_acc, torch.from_numpy(outs[1]), fmt)
    part = t_values[:per]
    cpu_kernels.decode(torch.from_numpy(outs[1]), part, fmt)
    cpu_kernels.owner_lost(
        t_acc, part, offsets, *factors, lo, hi, n_ranks, torch.from_numpy(residuals[1])
    )
    assert np.array_equal(outs[0], outs[1])
    assert np.array_equal(got_acc.view(np.int32), t_acc.numpy().view(np.int32))
    assert np.array_equal(residuals[0].view(np.int32), residuals[1].view(np.int32))


@pytest.mark.parametrize("fmt", [E2M1, E4M3, FP16, BF16])
@pytest.mark.parametrize("encoded", [False, True])
def test_reduce_encode_gives_the_separate_calls_bits(fmt: FloatFormat, encoded: bool) -> None:
    """reduce_encode (issue 46: the staged routes' node sum and owner mean, each one call
    with its encode) against the calls it fuses, bit for bit: float32 rows summed, or
    payloads decoded, summed and divided; odd segments, a non-finite one, fewer elements
    encoded than summed, the padding zeroed."""
    gen = torch.Generator().manual_seed(fmt.wire_bits + encoded)
    n_rows, width, numel = 3, 45, 41
    offsets = np.array([0, 7, 7, 30, 41], np.int64)
    factors = (2.0 ** torch.randint(-3, 4, (4,), generator=gen)).float().numpy()
    rows = torch.randn(n_rows * width, generator=gen) * 30.0
    rows[9] = float("inf")
    source = rows
    if encoded:
        source = torch.empty(payload_nbytes(n_rows * width, fmt), dtype=torch.uint8)
        cpu_kernels.encode(rows, source, fmt)
    out_bytes = payload_nbytes(numel + 5, fmt)
    outs = [torch.full((out_bytes,), 77, dtype=torch.uint8) for _ in range(2)]
    accs = [torch.empty(width) for _ in range(2)]
    scratch = np.empty(n_rows * width, np.float32)
    args = (fmt, offsets, factors)
    cpu_kernels.reduce_encode(source, n_rows, accs[0], 4, numel, outs[0], *args, scratch=scratch)
    if encoded:
        values = torch.empty(n_rows * width)
        cpu_kernels.decode(source, values, fmt)
        cpu_kernels.sum_rows(values.numpy().reshape(n_rows, width), accs[1].numpy())
        accs[1].div_(4)
    else:
        cpu_kernels.sum_rows(rows.numpy().reshape(n_rows, width), accs[1].numpy())
    head = payload_nbytes(numel, fmt)
    outs[1][head:] = 0
    cpu_kernels.encode(accs[1][:numel], outs[1][:head], *args)
    assert torch.equal(accs[0].view(torch.int32), accs[1].view(torch.int32))
    assert torch.equal(outs[0], outs[1])


def test_every_keys_factors_are_its_exact_powers_of_two() -> None:
    # The kernels build 2**e from its bits: every key's, subnormal 2**-127 included, must be
    # the exact power (Python's float arithmetic, not the kernels', is the reference).
    keys = np.arange(256, dtype=np.int32)
    e = np.where((keys == 0) | (keys == 255), 0, 127 - keys)
    up = np.array([2.0 ** int(v) for v in e], np.float32)
    down = np.array([2.0 ** -int(v) for v in e], np.float32)
    assert np.array_equal(cpu_kernels.key_factors(keys, False), up)
    want = np.where(keys == 255, np.float32(np.nan), down / np.float32(3))
    assert np.array_equal(cpu_kernels.key_factors(keys, True, 3), want, equal_nan=True)
    # Blocks: one layer of keys 0..254, then one whose 255 makes all its unscales NaN.
    scale, unscale = np.empty(256, np.float32), np.empty(256, np.float32)
    cpu_kernels.block_factors_into(
        torch.from_numpy(keys.astype(np.uint8)), np.array([255, 1]), scale, unscale
    )
    assert np.array_equal(scale, up) and np.array_equal(unscale[:255], down[:255])
    assert np.isnan(unscale[255]) and down[128] == 2.0**1 and up[254] == 2.0**-127
