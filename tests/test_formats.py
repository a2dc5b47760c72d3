"""Number formats: bit-exact against ml_dtypes, codecs, rounding, saturation."""

from __future__ import annotations

import functools
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from aps_comm import codec, cpu_kernels
from aps_comm import formats as F
from aps_comm.__main__ import format_table
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
    FP32,
    FloatFormat,
    decode,
    encode,
    get_format,
    payload_nbytes,
    quantize,
)

ORACLES = {
    "e4m3": (E4M3, ml_dtypes.float8_e4m3fn),
    "e5m2": (E5M2, ml_dtypes.float8_e5m2),
    "fp16": (FP16, np.float16),
    "bf16": (BF16, ml_dtypes.bfloat16),
    "e3m4": (E3M4, ml_dtypes.float8_e3m4),
    "e2m3": (E2M3, ml_dtypes.float6_e2m3fn),
    "e3m2": (E3M2, ml_dtypes.float6_e3m2fn),
    "e2m1": (E2M1, ml_dtypes.float4_e2m1fn),
}


def _finite_values(dtype) -> np.ndarray:
    """Every finite value of an ml_dtypes/numpy dtype, sorted, without duplicates."""
    bits = {1: np.uint8, 2: np.uint16}[np.dtype(dtype).itemsize]
    codes = np.arange(2 ** (8 * np.dtype(dtype).itemsize), dtype=np.int64).astype(bits)
    vals = codes.view(dtype).astype(np.float32)
    return np.unique(vals[np.isfinite(vals)])


def _probe_values(fmt: FloatFormat, dtype) -> np.ndarray:
    """Random values over the whole range, every value, every midpoint, subnormals."""
    rng = np.random.default_rng(0)
    vals = _finite_values(dtype)
    mids = (vals[:-1].astype(np.float64) + vals[1:]) / 2
    # Midpoints must be exact float32 numbers to be ties; they are for these formats.
    mids = mids.astype(np.float32)
    exps = rng.uniform(np.log2(fmt.min_subnormal) - 3, np.log2(fmt.max), 200_000)
    rand = (rng.choice([-1.0, 1.0], exps.size) * 2.0**exps).astype(np.float32)
    sub = rng.uniform(-fmt.min_normal, fmt.min_normal, 50_000).astype(np.float32)
    near = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))
    x = np.concatenate([vals, mids, *near, rand, sub, [0.0, -0.0]]).astype(np.float32)
    return x[np.abs(x) <= fmt.max]


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_properties_match_ml_dtypes(name: str) -> None:
    fmt, dtype = ORACLES[name]
    info = ml_dtypes.finfo(dtype) if dtype is not np.float16 else np.finfo(np.float16)
    assert fmt.max == float(info.max)
    assert fmt.min_normal == float(info.smallest_normal)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    assert fmt.bits == info.bits


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_quantize_bit_exact_against_ml_dtypes(name: str) -> None:
    fmt, dtype = ORACLES[name]
    x = _probe_values(fmt, dtype)
    ref = x.astype(dtype).astype(np.float32)
    got = quantize(torch.from_numpy(x), fmt).numpy()
    mismatches = np.flatnonzero(got.view(np.uint32) != ref.view(np.uint32))
    assert mismatches.size == 0, f"{mismatches.size} mismatches, e.g. {x[mismatches[:5]]}"


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        (name, backend)
        for name in sorted(ORACLES)
        for backend in ("reference", "kernels", "cast", "bits")
        # "cast" exists only for formats with a torch dtype.
        if backend != "cast" or ORACLES[name][0].torch_dtype is not None
    ],
)
def test_decode_encode_equals_quantize(name: str, backend: str) -> None:
    fmt, dtype = ORACLES[name]
    x = torch.from_numpy(_probe_values(fmt, dtype))
    if backend == "reference":
        payload = encode(x, fmt)
        back = decode(payload, fmt, x.numel())
    else:
        payload = codec.encode(x, fmt, backend=backend)
        back = codec.decode(payload, fmt, x.numel(), backend=backend)
    assert payload.dtype == torch.uint8
    assert payload.numel() == payload_nbytes(x.numel(), fmt)
    assert torch.equal(back.view(torch.int32), quantize(x, fmt).view(torch.int32))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
def test_fp8_bytes_identical_to_torch_cast(fmt: FloatFormat) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300_000, generator=gen) * torch.exp2(
        torch.randint(-24, 16, (300_000,), generator=gen).float()
    )
    x = x[x.abs() <= fmt.max]
    assert torch.equal(encode(x, fmt), x.to(fmt.torch_dtype).view(torch.uint8))


def test_bytes_per_element() -> None:
    n = 1001
    expected = {E4M3: n, E5M2: n, E3M2: n, E2M3: n, E2M1: 501, E3M0: 501, FP16: 2 * n, BF16: 2 * n}
    for fmt, nbytes in expected.items():
        x = torch.rand(n)
        assert encode(x, fmt).numel() == nbytes == payload_nbytes(n, fmt), fmt
    assert payload_nbytes(n, FP32) == 4 * n


def _brute_force(x: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Nearest finite value by exhaustive search, ties to the even code, saturating."""
    table = F.code_table(fmt)[: 2 ** (fmt.bits - 1)].astype(np.float64)
    codes = np.flatnonzero(np.isfinite(table))
    vals = table[codes]
    mag = np.minimum(np.abs(x.astype(np.float64)), fmt.max)
    dist = np.abs(mag[:, None] - vals[None, :])
    best = dist.min(axis=1, keepdims=True)
    cand = dist == best
    # Among ties pick the candidate whose code is even.
    even = cand & (codes[None, :] % 2 == 0)
    pick = np.where(even.any(axis=1), even.argmax(axis=1), cand.argmax(axis=1))
    return (np.sign(x) * vals[pick]).astype(np.float32)


@pytest.mark.parametrize(
    "fmt",
    [
        E3M0,
        FloatFormat(3, 1, specials="none"),
        FloatFormat(4, 2, specials="fn"),
        FloatFormat(5, 1, bias=10),
        FloatFormat(2, 2, specials="none", bias=0),
        FloatFormat(3, 3, specials="fn", bias=5),
    ],
    ids=lambda f: f"{f.name}-{f.specials}-b{f.bias}",
)
def test_custom_formats_against_brute_force(fmt: FloatFormat) -> None:
    table = F.code_table(fmt)
    vals = np.unique(table[np.isfinite(table)])
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
    rng = np.random.default_rng(2)
    rand = rng.uniform(-1.2 * fmt.max, 1.2 * fmt.max, 20_000).astype(np.float32)
    tiny = rng.uniform(-2 * fmt.min_normal, 2 * fmt.min_normal, 5_000).astype(np.float32)
    x = np.concatenate([vals, mids, rand, tiny])
    expected = _brute_force(x, fmt)
    got = quantize(torch.from_numpy(x), fmt).numpy()
    np.testing.assert_array_equal(got, expected)
    back = decode(encode(torch.from_numpy(x), fmt), fmt, x.size).numpy()
    np.testing.assert_array_equal(back, expected)


def test_e3m0_values() -> None:
    table = F.code_table(E3M0)
    assert sorted(set(table[:8].tolist())) == [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    assert E3M0.bits == 4 and E3M0.max == 16.0


@pytest.mark.parametrize("fmt", [E4M3, E5M2, FP16, BF16, E3M2, E2M1], ids=str)
def test_saturation_and_specials(fmt: FloatFormat) -> None:
    x = torch.tensor([fmt.max * 1.5, -fmt.max * 4, float("nan"), float("inf"), -float("inf")])
    if fmt == BF16:
        x[0], x[1] = 3.4e38, -3.4e38  # beyond bf16 max, inside float32
    q = quantize(x, fmt)
    assert q[0] == fmt.max and q[1] == -fmt.max
    assert torch.isnan(q[2])
    if fmt.has_inf:
        assert q[3] == float("inf") and q[4] == -float("inf")
    else:
        assert torch.isnan(q[3]) and torch.isnan(q[4])
    if fmt.has_nan:
        back = decode(encode(x, fmt), fmt, 5)
        assert torch.equal(back, q) or torch.allclose(back, q, equal_nan=True)
    else:
        with pytest.raises(ValueError, match="no inf or NaN"):
            encode(x, fmt)
        finite = x[:2]
        assert torch.equal(decode(encode(finite, fmt), fmt, 2), q[:2])


def test_input_not_modified_and_shape_kept() -> None:
    x = torch.randn(4, 5, 6) * 1000
    before = x.clone()
    for fmt in (E4M3, E2M1, FP16):
        q = quantize(x, fmt)
        assert q.shape == x.shape and q.dtype == torch.float32
        encode(x, fmt)
        quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, before)


def test_quantize_accepts_low_precision_inputs() -> None:
    x = torch.randn(1000).to(torch.bfloat16)
    ref = x.float().numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(quantize(x, E4M3).numpy(), ref)
    assert torch.equal(quantize(x, BF16), x.float())


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=str)
def test_stochastic_rounding_is_unbiased_and_reproducible(fmt: FloatFormat) -> None:
    # Values strictly between two neighbours, normal and subnormal.
    table = F.code_table(fmt)
    vals = np.unique(table[np.isfinite(table) & (table > 0)])
    lo, hi = vals[len(vals) // 2], vals[len(vals) // 2 + 1]
    points = torch.tensor([lo + 0.3 * (hi - lo), 0.37 * fmt.min_subnormal, 0.8 * fmt.min_normal])
    n = 200_000
    x = points.repeat_interleave(n)
    q = quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(3))
    for i, p in enumerate(points.tolist()):
        chunk = q[i * n : (i + 1) * n].double()
        assert len(torch.unique(chunk)) <= 2
        # Bernoulli variance bound: spread^2 / 4 per sample; 6 sigma.
        spread = float(chunk.max() - chunk.min())
        tol = 6 * spread / 2 / n**0.5 + 1e-12
        assert abs(float(chunk.mean()) - p) <= tol, (p, float(chunk.mean()), tol)
    again = quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(3))
    assert torch.equal(q, again)


def test_get_format_names() -> None:
    assert get_format("e4m3") is E4M3
    assert get_format("fp8_e4m3") is E4M3
    assert get_format("FP8_E5M2") is E5M2
    assert get_format("fp16") is FP16 and get_format("bf16") is BF16 and get_format("fp32") is FP32
    assert get_format(E2M1) is E2M1
    custom = get_format("e6m1")
    assert (custom.exp_bits, custom.man_bits, custom.specials) == (6, 1, "ieee")
    assert get_format("e3m0").specials == "none"
    with pytest.raises(ValueError, match=r"unknown number format 'e4m3x'.*e4m3.*fp16"):
        get_format("e4m3x")
    with pytest.raises(ValueError, match="unknown number format"):
        get_format("int8")


def test_the_api_and_the_model_take_the_same_names() -> None:
    from aps_comm.config import FORMAT_ALIASES, FORMAT_NAMES
    from aps_perfmodel.formats import get_format as model_format

    # The enum names every built-in format, once.
    assert set(FORMAT_NAMES) == set(F.FORMATS)
    assert get_format("fp8") is E4M3 and get_format("FP4") is F.E2M1
    names = [*FORMAT_NAMES, *FORMAT_ALIASES, "e3m3", "E6M1", "fp6_e3m2", "e2m0"]
    for name in names:
        fmt = get_format(name)
        # The model names the format as the API does (and prices it by its bits).
        assert model_format(name).name == fmt.name, name
        if fmt.name not in ("fp32", "fp16", "bf16"):
            assert model_format(name).wire_bytes * 8 >= fmt.bits, name


@pytest.mark.parametrize(
    ("name", "limit"),
    [
        ("e9m9", "'e9m9' has 9 exponent bits; a format has 1 to 8"),
        ("e0m3", "'e0m3' has 0 exponent bits; a format has 1 to 8"),
        ("e4m24", "'e4m24' has 24 mantissa bits; a format has at most 23"),
        ("e8m0", "'e8m0' does not fit inside float32: its largest value would be 2**128"),
        ("fp16_e4m3", "'fp16_e4m3' says 16 bits, but 1 sign + 4 exponent + 3 mantissa bits are 8"),
    ],
)
def test_a_format_that_cannot_exist_names_the_limit_it_breaks(name: str, limit: str) -> None:
    from aps_perfmodel.formats import get_format as model_format

    # The same one line from the API and from the model.
    for lookup in (get_format, model_format):
        with pytest.raises(ValueError) as caught:
            lookup(name)
        assert limit in str(caught.value) and "unknown" not in str(caught.value)


def test_float_format_validation_and_hashing() -> None:
    assert FloatFormat(4, 3, specials="fn") == E4M3
    assert hash(FloatFormat(4, 3, specials="fn", name="x")) == hash(E4M3)
    assert len({E4M3, FloatFormat(4, 3, specials="fn"), E5M2}) == 2
    assert FloatFormat(4, 3).bias == 7 and FloatFormat(4, 3, bias=9).bias == 9
    with pytest.raises(ValueError, match="exp_bits"):
        FloatFormat(9, 3)
    with pytest.raises(ValueError, match="man_bits"):
        FloatFormat(4, 24)
    with pytest.raises(ValueError, match="specials"):
        FloatFormat(4, 3, specials="nan")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float32"):
        FloatFormat(8, 3, bias=-10)
    with pytest.raises(ValueError, match="ieee"):
        FloatFormat(3, 0, specials="ieee")
    with pytest.raises(AttributeError):
        E4M3.man_bits = 2  # type: ignore[misc]


def test_decode_rejects_bad_payload() -> None:
    with pytest.raises(TypeError, match="uint8"):
        decode(torch.zeros(4, dtype=torch.int32), E4M3, 4)
    with pytest.raises(ValueError, match="need 8"):
        decode(torch.zeros(4, dtype=torch.uint8), E4M3, 8)


@pytest.mark.parametrize("backend", ["kernels", "cast", "bits"])
def test_segmented_codec_matches_reference(backend: str) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(10_001, generator=gen)
    layout = codec.Layout.from_numels([0, 17, 4983, 1, 5000], x.device)
    scale = torch.tensor([8.0, 2.0**-3, 2.0**20, 1.0, 4.0])
    per_element = torch.repeat_interleave(scale, layout.lengths)
    for fmt in (E4M3, E5M2, E2M1, E3M2, FP16, BF16):
        if backend == "cast" and fmt.torch_dtype is None:
            continue
        out = codec.encode(x, fmt, scale=scale, layout=layout, backend=backend)
        assert torch.equal(out, encode(x * per_element, fmt)), (fmt, backend)
        dec = codec.decode(out, fmt, x.numel(), scale=scale, layout=layout, backend=backend)
        assert torch.equal(dec, decode(out, fmt, x.numel()) * per_element), (fmt, backend)


def _use_path(m: pytest.MonkeyPatch, path: str) -> None:
    """Route the codec through one encoder path: "add", "int" or "torch" (see below)."""
    if path == "int":
        m.setattr(
            cpu_kernels,
            "encoder_params",
            functools.partial(cpu_kernels.encoder_params, add_subnormals=False),
        )


def _kernel_bytes(
    x: torch.Tensor,
    fmt: FloatFormat,
    monkeypatch: pytest.MonkeyPatch,
    segments: tuple[codec.Layout, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Wire bytes of ``x`` (times ``segments``' layout and scale) from each encoder path.

    "add": the kernels' float-add subnormal rounding where the format allows
    it; "int": the kernels forced onto their integer path; "torch": the pure
    torch reference.
    """
    out = {}
    for path in ("add", "int", "torch"):
        with monkeypatch.context() as m:
            _use_path(m, path)
            layout, scale = segments if segments is not None else (None, None)
            backend = "bits" if path == "torch" else "kernels"
            out[path] = codec.encode(x, fmt, scale=scale, layout=layout, backend=backend)
    return out


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_kernel_subnormal_paths_match_reference(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every value, every tie (midpoints, e.g. min_subnormal / 2 and the one
    # between the largest subnormal and min_normal), their float32 neighbours.
    fmt, dtype = ORACLES[name]
    assert cpu_kernels.encoder_params(fmt)[10] != 0, "expected the float-add path"
    x = _probe_values(fmt, dtype)
    if fmt.has_nan:
        x = np.concatenate([x, [np.inf, -np.inf, np.nan, 3e38, -3.4e38]]).astype(np.float32)
    xt = torch.from_numpy(x)
    half = x.size // 2
    segments = (
        codec.Layout.from_numels([half, x.size - half], xt.device),
        torch.tensor([0.5, 2.0]),
    )
    for seg in (None, segments):
        got = _kernel_bytes(xt, fmt, monkeypatch, seg)
        assert torch.equal(got["add"], got["int"]), (name, seg)
        # torch's own fp16/bf16 cast keeps NaN payloads; the kernels write one NaN.
        values = {k: decode(v, fmt, x.size) for k, v in got.items()}
        values = {k: torch.where(v.isnan(), float("nan"), v) for k, v in values.items()}
        assert torch.equal(values["add"].view(torch.int32), values["torch"].view(torch.int32))
    # The owner's re-encode: the mean of neighbouring values is their tie.
    vals = np.concatenate([-_finite_values(dtype)[::-1], _finite_values(dtype)])
    vals = torch.from_numpy(vals[np.abs(vals) <= fmt.max])
    recv = torch.cat([encode(vals[:-1], fmt), encode(vals[1:], fmt)])
    reduced = {}
    for path in ("add", "int"):
        with monkeypatch.context() as m:
            _use_path(m, path)
            reduced[path] = codec.owner_reduce(recv, fmt, 2, backend="kernels")
    mean = (vals[:-1] + vals[1:]) / 2
    assert torch.equal(reduced["add"], reduced["int"])
    assert torch.equal(reduced["add"], _kernel_bytes(mean, fmt, monkeypatch)["torch"])


@pytest.mark.parametrize(
    "fmt",
    [
        FloatFormat(4, 3, specials="fn", bias=-110),  # min_subnormal * 2**23 overflows
        FloatFormat(2, 1, specials="none", bias=-120),  # the same, packed 4-bit
        FloatFormat(4, 3, specials="fn", bias=-106),  # magic = 2**127: still the add
    ],
    ids=lambda f: f"{f.name}-{f.specials}-b{f.bias}",
)
def test_kernel_subnormal_path_choice_for_extreme_bias(
    fmt: FloatFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    magic_exp = fmt._emin - fmt.man_bits + 23
    assert (cpu_kernels.encoder_params(fmt)[10] != 0) == (magic_exp <= 127)
    table = F.code_table(fmt)
    vals = np.unique(table[np.isfinite(table)])
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
    near = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))
    rng = np.random.default_rng(7)
    tiny = rng.uniform(-2 * fmt.min_normal, 2 * fmt.min_normal, 5_000).astype(np.float32)
    x = np.concatenate([vals, mids, *near, tiny, [1.5 * fmt.max, -1.5 * fmt.max]])
    x = x.astype(np.float32)
    got = _kernel_bytes(torch.from_numpy(x), fmt, monkeypatch)
    assert torch.equal(got["add"], got["int"])
    assert torch.equal(got["add"], got["torch"])
    back = decode(got["add"], fmt, x.size).numpy()
    np.testing.assert_array_equal(back, _brute_force(x, fmt))


def test_bias_beyond_float32_takes_the_torch_path() -> None:
    # Normals below float32's smallest normal break the kernels' bit tricks
    # (this format used to raise OverflowError in the kernel setup).
    fmt = FloatFormat(5, 2, bias=148)
    assert not cpu_kernels.supports(fmt)
    assert codec.backend_for(fmt, torch.device("cpu")) == "bits"
    table = F.code_table(fmt)
    vals = np.unique(table[np.isfinite(table)]).astype(np.float32)
    x = np.concatenate([vals, vals * np.float32(1.1), [fmt.max * 2]]).astype(np.float32)
    back = codec.decode(codec.encode(torch.from_numpy(x), fmt), fmt, x.size).numpy()
    np.testing.assert_array_equal(back, _brute_force(x, fmt))


@pytest.mark.parametrize(
    ("fmt", "backend"),
    [
        (fmt, backend)
        for fmt in (E4M3, E5M2, FP16, BF16, E2M1, E3M2)
        for backend in ("kernels", "cast", "bits")
        if backend != "cast" or fmt.torch_dtype is not None
    ],
    ids=str,
)
def test_reduce_shards_matches_reference(fmt: FloatFormat, backend: str) -> None:
    gen = torch.Generator().manual_seed(6)
    n_ranks, shard = 3, 4098
    vals = torch.randn(n_ranks, shard, generator=gen) * fmt.max / 8
    recv = torch.cat([encode(v, fmt) for v in vals])
    got = codec.owner_reduce(recv, fmt, n_ranks, backend=backend)
    nbytes = payload_nbytes(shard, fmt)
    acc = decode(recv[:nbytes], fmt, shard)
    for r in range(1, n_ranks):
        acc = acc + decode(recv[r * nbytes : (r + 1) * nbytes], fmt, shard)
    # Sums may overflow to inf and inf - inf is NaN: backends may differ in the
    # NaN code's sign, never in the values.
    expected = decode(encode(acc / n_ranks, fmt), fmt, shard)
    assert torch.equal(_canonical(decode(got, fmt, shard)), _canonical(expected))


def _canonical(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.isnan(), float("nan"), x).view(torch.int32)


def test_encode_decode_into_out() -> None:
    x = torch.randn(1000) * 10
    for fmt in (E4M3, FP16, E2M1):
        out = torch.empty(payload_nbytes(x.numel(), fmt), dtype=torch.uint8)
        assert encode(x, fmt, out=out) is out
        assert torch.equal(out, encode(x, fmt))
        dec = torch.empty(x.numel())
        assert decode(out, fmt, x.numel(), out=dec) is dec
        assert torch.equal(dec, decode(out, fmt, x.numel()))
    with pytest.raises(ValueError, match="999"):
        encode(x, E4M3, out=torch.empty(999, dtype=torch.uint8))
    with pytest.raises(ValueError, match="float32"):
        decode(encode(x, E4M3), E4M3, 1000, out=torch.empty(1000, dtype=torch.float64))


@pytest.mark.slow
def test_python_m_aps_comm_prints_every_format_without_warnings(tmp_path) -> None:
    # -W error: runpy's "found in sys.modules" RuntimeWarning (the table used
    # to live in aps_comm.formats, which the package imports) becomes a failure.
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-m", "aps_comm"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[3:]}
    assert list(rows) == list(F.FORMATS)
    assert rows["e4m3"][1:4] == ["8", "fn", "448"]
    assert rows["e2m1"][6] == "0.5"  # two elements per byte


def test_format_table_rejects_an_empty_sample() -> None:
    with pytest.raises(ValueError, match="numel must be >= 1, got 0"):
        format_table(numel=0)
    rows = format_table(numel=256)
    assert [r["format"] for r in rows] == list(F.FORMATS)
    fp32 = rows[list(F.FORMATS).index("fp32")]
    assert fp32["rel_err_max"] == 0.0 and fp32["bytes/elem"] == 4.0
