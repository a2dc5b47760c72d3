"""Block scaling: block grid, block maxima and factors, codec backends and the simulator.

Every backend is checked bit for bit against an ml_dtypes reference that
scales each element by its block's power of two; the simulator against a
hand-written reduction in numpy.
"""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from aps_comm import codec, cpu_kernels, simulate
from aps_comm import formats as F
from aps_comm import scaling as S
from aps_comm.config import BLOCK_SIZES, Scaling, check_block_size
from aps_comm.formats import FloatFormat, get_format, payload_nbytes, pow2

ORACLES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "fp16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "e3m4": ml_dtypes.float8_e3m4,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
}
CPU = torch.device("cpu")
NUMELS = [37, 0, 64, 5, 300]  # odd sizes, an empty layer, short last blocks


def _grads(numels: list[int], seed: int = 0, rows: int | None = None) -> torch.Tensor:
    """Values spanning 2**-30 .. 2**4, so blocks get very different exponents."""
    g = torch.Generator().manual_seed(seed)
    shape = (sum(numels),) if rows is None else (rows, sum(numels))
    mag = torch.exp2(torch.empty(shape).uniform_(-30, 4, generator=g))
    return mag * torch.randn(shape, generator=g).sign()


def test_block_size_validation() -> None:
    assert Scaling("block") is Scaling.BLOCK
    assert [check_block_size(b) for b in BLOCK_SIZES] == [8, 16, 32, 64, 128, 256]
    for bad in (4, 33, 512, 0, 32.0, "32", True):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            check_block_size(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got 48"):
        simulate.SimConfig(scaling="block", block_size=48)
    with pytest.raises(ValueError, match="got 512"):
        codec.Layout.from_numels([10], CPU).grid(512)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_grid_and_windows(block_size: int) -> None:
    numels = [3 * block_size + 5, 0, block_size, 7]
    blocks = codec.Layout.from_numels(numels, CPU).grid(block_size)
    # ceil(n / block_size) blocks per layer, each inside its layer.
    assert blocks.counts.tolist() == [math.ceil(n / block_size) for n in numels]
    assert blocks.layout.sizes == (*[block_size] * 3, 5, block_size, 7)
    total = sum(numels)
    for lo, hi in [(0, total), (1, block_size + 3), (block_size * 3 + 2, total), (9, 9)]:
        w = blocks.window(lo, hi)
        starts = blocks.layout.offsets[:-1].tolist()
        ends = blocks.layout.offsets[1:].tolist()
        inside = [b for b in range(blocks.n_blocks) if lo < hi and starts[b] < hi and ends[b] > lo]
        assert w.first == (inside[0] if inside else w.first)
        assert w.n_blocks == len(inside) == int(w.counts.sum())
        cut = [min(ends[b], hi) - max(starts[b], lo) for b in inside]
        assert list(w.layout.sizes) == cut and w.layout.numel == hi - lo
        # Windows of either kind keep the block size, and their runs of whole
        # blocks (which the CPU kernels walk) are exactly their full-size blocks.
        for layout in (w.layout, blocks.layout.window(lo, hi)):
            assert layout.block_size == block_size
            runs = [(int(s), int(n)) for s, n in layout.block_runs]
            walked = [b for s, n in runs for b in range(s, s + n)]
            assert walked == [b for b, n in enumerate(layout.sizes) if n == block_size]
            assert all(s + n not in {t for t, _ in runs} for s, n in runs)  # maximal
    assert codec.Layout.from_numels(numels, CPU).block_runs.shape == (0, 2)


def test_block_amax_kernel_and_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _grads(NUMELS)
    x[40] = float("nan")  # layer 2's first block
    x[-1] = float("-inf")
    blocks = codec.Layout.from_numels(NUMELS, CPU).grid(16)
    ref = torch.stack([t.abs().max() for t in torch.split(x, blocks.layout.sizes)])
    ref = ref.masked_fill(torch.isnan(ref), float("inf"))
    got = S.block_amax(x, blocks)
    assert torch.equal(got, ref)
    monkeypatch.setattr(cpu_kernels, "AVAILABLE", False)  # the device path, on the CPU
    assert torch.equal(S.block_amax(x, blocks), ref)
    with pytest.raises(ValueError, match="cover"):
        S.block_amax(x[1:], blocks)


@pytest.mark.parametrize("route", ["allreduce", "two_phase", "hierarchical", "grid"])
def test_block_factors_follow_the_layer_rule_and_poison_layers(route: str) -> None:
    fmt = get_format("e4m3")
    amax = torch.tensor([3.0, 1e-5, 0.0, float("inf"), 2.0, 7e3])
    counts = torch.tensor([3, 0, 2, 1])  # the inf block poisons layer 2 (blocks 3 and 4)
    f = S.factors(amax, fmt, route, world_size=8, scaling="block", counts=counts, ranks_per_node=2)
    layer = S.factors(amax, fmt, route, world_size=8, scaling="layer", ranks_per_node=2)
    assert torch.equal(f.exponents, layer.exponents) and torch.equal(f.scale, layer.scale)
    assert f.unscale[3:5].isnan().all() and not f.unscale[[0, 1, 2, 5]].isnan().any()
    assert f.exponents.abs().max() <= S.EXPONENT_LIMIT  # one signed byte
    with pytest.raises(ValueError, match="counts"):
        S.factors(amax, fmt, route, world_size=8, scaling="block")


def _block_reference(x: np.ndarray, sizes: list[int], exps: np.ndarray, name: str) -> np.ndarray:
    """Element i times 2**e of its block, rounded by ml_dtypes, times 2**-e."""
    e = np.repeat(exps.astype(np.float64), sizes)
    scaled = (x.astype(np.float64) * np.exp2(e)).astype(np.float32)
    return (scaled.astype(ORACLES[name]).astype(np.float64) * np.exp2(-e)).astype(np.float32)


def _backends(name: str) -> list[str]:
    fmt = get_format(name)
    return ["kernels", "bits"] + (["cast"] if fmt.torch_dtype is not None else [])


@pytest.mark.parametrize("name", list(ORACLES))
@pytest.mark.parametrize("block_size", [8, 32, 256])
def test_block_codec_backends_match_reference(name: str, block_size: int) -> None:
    fmt = get_format(name)
    x = _grads(NUMELS, seed=block_size)
    blocks = codec.Layout.from_numels(NUMELS, CPU).grid(block_size)
    f = S.factors(
        S.block_amax(x, blocks),
        fmt,
        "two_phase",
        world_size=1,
        scaling="block",
        counts=blocks.device_counts,
    )
    ref = _block_reference(x.numpy(), list(blocks.layout.sizes), f.exponents.numpy(), name)
    payloads = {}
    for backend in _backends(name):
        c = codec.Codec(fmt, CPU, backend)
        payloads[backend] = p = c.encode(x, scale=f.scale, layout=blocks.layout)
        out = c.decode(p, x.numel(), scale=f.unscale, layout=blocks.layout)
        assert np.array_equal(out.numpy().view(np.uint32), ref.view(np.uint32)), backend
    first = payloads["kernels"]
    assert all(torch.equal(first, p) for p in payloads.values())


@pytest.mark.parametrize("name", ["e4m3", "e3m2", "e2m1", "fp16"])
def test_windows_encode_as_the_whole_buffer(name: str) -> None:
    """Chunks cut anywhere (through blocks) give the whole buffer's codes and values."""
    fmt = get_format(name)
    x = _grads(NUMELS, seed=3)
    blocks = codec.Layout.from_numels(NUMELS, CPU).grid(16)
    f = S.factors(
        S.block_amax(x, blocks),
        fmt,
        "two_phase",
        world_size=1,
        scaling="block",
        counts=blocks.device_counts,
    )
    whole = codec.decode(
        codec.encode(x, fmt, scale=f.scale, layout=blocks.layout),
        fmt,
        x.numel(),
        scale=f.unscale,
        layout=blocks.layout,
    )
    cuts = [0, 10, 50, 52, 200, x.numel()]  # even cuts keep 4-bit payloads byte-aligned
    for backend in _backends(name):
        for lo, hi in itertools.pairwise(cuts):
            w = blocks.window(lo, hi)
            sl = slice(w.first, w.first + w.n_blocks)
            p = codec.encode(x[lo:hi], fmt, scale=f.scale[sl], layout=w.layout, backend=backend)
            got = codec.decode(
                p, fmt, hi - lo, scale=f.unscale[sl], layout=w.layout, backend=backend
            )
            assert torch.equal(got, whole[lo:hi]), (backend, lo, hi)


@pytest.mark.parametrize("name", ["e4m3", "e2m1", "bf16"])
def test_non_finite_block_poisons_its_layer(name: str) -> None:
    fmt = get_format(name)
    x = _grads(NUMELS, seed=5)
    x[37 + 64 + 2] = float("nan")  # layer 3 (5 elements)
    x[10] = float("inf")  # layer 0
    blocks = codec.Layout.from_numels(NUMELS, CPU).grid(8)
    f = S.factors(
        S.block_amax(x, blocks),
        fmt,
        "two_phase",
        world_size=1,
        scaling="block",
        counts=blocks.device_counts,
    )
    for backend in _backends(name):
        c = codec.Codec(fmt, CPU, backend)
        p = c.encode(x, scale=f.scale, layout=blocks.layout)
        out = c.decode(p, x.numel(), scale=f.unscale, layout=blocks.layout)
        parts = torch.split(out, NUMELS)
        assert parts[0].isnan().all() and parts[3].isnan().all(), backend
        assert not any(parts[i].isnan().any() for i in (1, 2, 4)), backend


@pytest.mark.parametrize("name", ["e4m3", "e2m1", "e3m2"])
def test_owner_reduce_with_agreed_block_exponents(name: str) -> None:
    """With exponents agreed across ranks the owner's step needs none: every backend
    gives the reference's bytes (sum in rank order, / N, rounded)."""
    fmt = get_format(name)
    n, numels = 3, [40, 24]
    g = _grads(numels, seed=7, rows=n)
    blocks = codec.Layout.from_numels(numels, CPU).grid(8)
    amax = torch.stack([S.block_amax(r, blocks) for r in g]).amax(0)  # the MAX all-reduce
    f = S.factors(
        amax, fmt, "two_phase", world_size=n, scaling="block", counts=blocks.device_counts
    )
    sizes = list(blocks.layout.sizes)
    e = np.repeat(f.exponents.numpy().astype(np.float64), sizes)
    q = [
        (r.numpy() * np.exp2(e)).astype(np.float32).astype(ORACLES[name]).astype(np.float32)
        for r in g
    ]
    acc = q[0].copy()
    for r in q[1:]:
        acc += r
    ref = (acc / np.float32(n)).astype(ORACLES[name]).astype(np.float64) * np.exp2(-e)
    for backend in _backends(name):
        c = codec.Codec(fmt, CPU, backend)
        recv = torch.cat([c.encode(r, scale=f.scale, layout=blocks.layout) for r in g])
        shard = c.owner_reduce(recv, n)
        out = c.decode(shard, sum(numels), scale=f.unscale, layout=blocks.layout)
        assert np.array_equal(out.numpy(), ref.astype(np.float32)), backend


@pytest.mark.parametrize(
    ("name", "block_size", "per_element"),
    [
        ("e4m3", 32, 1.03125),
        ("e2m1", 32, 0.53125),
        ("e3m2", 16, 1.0625),
        ("e4m3", 256, 1 + 1 / 256),
    ],
)
def test_bytes_per_element(name: str, block_size: int, per_element: float) -> None:
    numels = [block_size * 3, block_size * 5]
    blocks = codec.Layout.from_numels(numels, CPU).grid(block_size)
    assert blocks.wire_nbytes(name) / sum(numels) == per_element
    # A short last block still costs its byte.
    short = codec.Layout.from_numels([block_size + 2], CPU).grid(block_size)
    assert short.wire_nbytes(name) == payload_nbytes(block_size + 2, get_format(name)) + 2


# ---------------------------------------------------------------------------
# the simulator


def _round(v: np.ndarray, name: str) -> np.ndarray:
    return v.astype(np.float32).astype(ORACLES[name]).astype(np.float32)


def _hand_exponent(a: float, name: str, n: int, native: bool) -> int:
    """Largest e with the scaled maximum (rounded, times N for native sums) within range."""
    fmax = float(ml_dtypes.finfo(ORACLES[name]).max)
    if not a:
        return 0
    for e in range(126, -127, -1):
        if a * (n if native else 1) * 2.0**e > fmax:
            continue
        rounded = float(_round(np.array([a * 2.0**e], np.float32), name)[0])
        if not native or rounded * n <= fmax:
            return e
    raise AssertionError


def _hand_simulate(g: np.ndarray, name: str, block_size: int, order: str) -> np.ndarray:
    """One layer (N, m) averaged with block scaling, in numpy: the reference.

    Order "owner": two_phase whose owner picks each block's exponent for the mean;
    "rank": each worker's own block exponents too.
    """
    n, m = g.shape
    native = order not in ("two_phase", "owner", "rank")
    out = np.empty(m, np.float32)
    for lo in range(0, m, block_size):
        blk = g[:, lo : lo + block_size]
        if order == "rank":
            own = [_hand_exponent(float(np.abs(b).max()), name, n, False) for b in blk]
            true = [
                _round(b * np.float32(2.0**e), name) * np.float32(2.0**-e)
                for b, e in zip(blk, own, strict=True)
            ]
            mean = true[0].copy()
            for t in true[1:]:
                mean += t
            mean /= np.float32(n)
            e = _hand_exponent(float(np.abs(mean).max()), name, 1, False)
            out[lo : lo + block_size] = _round(mean * np.float32(2.0**e), name) * np.float32(
                2.0**-e
            )
            continue
        e = _hand_exponent(float(np.abs(blk).max()), name, n, native)
        q = _round(blk * np.float32(2.0**e), name)
        if not native:
            s = q[0].copy()
            for r in range(1, n):
                s += q[r]
            mean = s / np.float32(n)
            d = 0
            if order == "owner":  # the mean's own exponent, capped so e + d <= 126
                d = min(_hand_exponent(float(np.abs(mean).max()), name, 1, False), 126 - e)
            scaled = mean * np.float32(2.0**d)
            out[lo : lo + block_size] = _round(scaled, name) * np.float32(2.0 ** -(e + d))
        else:
            if order == "tree":  # n == 4: (q0 + q1) + (q2 + q3)
                s = _round(_round(q[0] + q[1], name) + _round(q[2] + q[3], name), name)
            else:
                s = q[0]
                for r in range(1, n):
                    s = _round(s + q[r], name)
            out[lo : lo + block_size] = s * np.float32(2.0**-e / n)
    return out


@pytest.mark.parametrize("order", ["two_phase", "sequential", "tree", "owner", "rank"])
@pytest.mark.parametrize("name", ["e4m3", "e3m2", "e2m1"])
def test_simulate_block_matches_hand_reference(order: str, name: str) -> None:
    g = _grads([45, 16], seed=11, rows=4)
    layers = [g[:, :45], g[:, 45:].reshape(4, 4, 4)]
    got = simulate.allreduce(
        layers,
        name,
        reduction="two_phase" if order in ("owner", "rank") else order,
        scaling="block",
        block_size=8,
        owner_exponents=order == "owner",
        rank_exponents=order == "rank",
    )
    for t, want in zip(got, layers, strict=True):
        ref = _hand_simulate(want.reshape(4, -1).numpy(), name, 8, order)
        assert np.array_equal(t.reshape(-1).numpy(), ref)


def test_simulate_block_ring_and_stages_match_the_codec() -> None:
    """Ring, hierarchical and grid: each worker's contribution is the codec's block
    encoding (so the hook's bytes), and a one-block-per-layer run equals layer scaling."""
    fmt = get_format("e4m3")
    g = _grads([70], seed=2, rows=4)
    small = g[:, :8]  # one block of 8: block scaling is layer scaling
    for red in ("ring", "hierarchical", "grid", "two_phase"):
        kw = {"ranks_per_node": 2} if red == "hierarchical" else {}
        [b] = simulate.allreduce([small], fmt, reduction=red, scaling="block", block_size=8, **kw)
        [la] = simulate.allreduce([small], fmt, reduction=red, scaling="layer", **kw)
        assert torch.equal(b, la), red
    # Blocks of different magnitude: the block result is as accurate everywhere as
    # each block alone under layer scaling.
    g[:, 8:16] *= 2.0**-20
    for red in ("ring", "hierarchical", "grid"):
        kw = {"ranks_per_node": 2} if red == "hierarchical" else {}
        [b] = simulate.allreduce(
            [g[:, :16]], fmt, reduction=red, scaling="block", block_size=8, **kw
        )
        for lo in (0, 8):
            [alone] = simulate.allreduce([g[:, lo : lo + 8]], fmt, reduction=red, **kw)
            assert torch.equal(b[lo : lo + 8], alone), (red, lo)


def test_simulate_block_poisons_layers() -> None:
    g = _grads([20, 9], seed=4, rows=3)
    g[1, 3] = float("nan")
    a, b = simulate.allreduce([g[:, :20], g[:, 20:]], "e2m1", scaling="block", block_size=8)
    assert a.isnan().all() and not b.isnan().any()


def test_owner_exponents_lift_small_means() -> None:
    """Cancelling gradients: the mean is far below the block maximum, and e2m1 with the
    agreed exponent flushes it; the owner's exponent keeps it."""
    g = torch.tensor([[1.0, 0.25, 0.375, -0.5] * 2, [-1.0, -0.125, -0.25, 0.5] * 2])
    exact = g.mean(0)
    [plain] = simulate.allreduce([g], "e2m1", scaling="block", block_size=8)
    [owner] = simulate.allreduce([g], "e2m1", scaling="block", block_size=8, owner_exponents=True)
    assert torch.equal(plain, torch.zeros(8))
    assert torch.equal(owner, exact)
    assert S.mean_exponents(torch.tensor([0.0625, 0.0]), torch.tensor([2, 5]), "e2m1").tolist() == [
        6,
        0,
    ]
    assert S.mean_exponents(torch.tensor([1e-30]), torch.tensor([120]), "e4m3").tolist() == [6]
    with pytest.raises(ValueError, match="owner_exponents"):
        simulate.SimConfig(scaling="layer", owner_exponents=True)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(torch.nan_to_num(a, nan=-1.0), torch.nan_to_num(b, nan=-1.0))


@pytest.mark.parametrize("route", ["allreduce", "two_phase", "hierarchical", "grid"])
@pytest.mark.parametrize("name", ["e4m3", "e2m1", "fp16", "bf16"])
def test_one_byte_keys_agree_like_the_maxima(route: str, name: str) -> None:
    """MAX over ranks of each rank's keys gives the factors of the MAX of the maxima."""
    fmt = get_format(name)
    g = torch.Generator().manual_seed(len(name) + len(route))
    ranks, n = 5, 400
    amax = torch.exp2(torch.empty(ranks, n).uniform_(-140, 140, generator=g))
    # Mantissas near the round-up boundaries of the native rule, zeros, non-finite.
    amax[:, :50] = fmt.max / torch.arange(1, 51).float() * (1 + 2.0**-fmt.man_bits / 3)
    amax[torch.rand(ranks, n, generator=g) < 0.2] = 0.0
    amax[:, 60:70] = 0.0
    amax[2, 100] = float("inf")
    amax[4, 101] = float("nan")
    amax = amax.clamp(max=float(torch.finfo(torch.float32).max))
    amax[2, 100] = float("inf")
    counts = torch.tensor([100, 0, 150, 150])
    kw = {"world_size": 8}
    per = {"ranks_per_node": 2} if route in ("hierarchical", "grid") else {}
    keys = torch.stack([S.exponent_keys(a, fmt, route, **kw, **per) for a in amax]).amax(0)
    assert keys.dtype == torch.uint8 and keys.shape[0] == (2 if per else 1)
    top = torch.where(amax.isnan(), float("inf"), amax).amax(0)  # the MAX all-reduce
    want = S.factors(top, fmt, route, scaling="block", counts=counts, **kw, **per)
    got = S.factors_from_keys(keys, fmt, route, counts=counts, **kw)
    for field in ("exponents", "scale", "unscale", "shift", "first"):
        assert _same(getattr(got, field), getattr(want, field)), field
    assert got.unscale[100:250].isnan().all()  # the non-finite blocks' layer
    assert not got.unscale[:100].isnan().any() and not got.unscale[250:].isnan().any()


@pytest.mark.parametrize("name", ["e4m3", "e2m1", "fp16"])
def test_shard_mean_with_each_ranks_block_exponents(name: str) -> None:
    """Shards encoded with each rank's own block exponents: the owner's mean (decoded
    with each sender's, summed in rank order) is the reference's on every backend."""
    fmt = get_format(name)
    n, numels = 3, [20, 12]  # one shard per rank: 32 elements, blocks of 8 (the last short)
    g = _grads(numels, seed=9, rows=n)
    g[1] *= 2.0**-12  # rank 1's gradients are far smaller: its own exponents are larger
    blocks = codec.Layout.from_numels(numels, CPU).grid(8)
    own = [
        S.factors(
            S.block_amax(r, blocks),
            fmt,
            "two_phase",
            world_size=n,
            scaling="block",
            counts=blocks.device_counts,
        )
        for r in g
    ]
    sizes = list(blocks.layout.sizes)
    acc = None
    for r, f in zip(g, own, strict=True):
        e = np.repeat(f.exponents.numpy().astype(np.float64), sizes)
        t = _round(r.numpy() * np.exp2(e), name) * np.exp2(-e).astype(np.float32)
        acc = t if acc is None else acc + t
    ref = acc / np.float32(n)
    every = codec.Layout.from_numels(sizes * n, CPU)  # the N shards' blocks end to end
    unscale = torch.cat([f.unscale for f in own])
    for backend in _backends(name):
        c = codec.Codec(fmt, CPU, backend)
        recv = torch.cat(
            [c.encode(r, scale=f.scale, layout=blocks.layout) for r, f in zip(g, own, strict=True)]
        )
        mean = c.shard_mean(recv, n, scale=unscale, layout=every)
        assert np.array_equal(mean.numpy(), ref), backend


# The owner's step with block exponents: built-ins of every wire width, a 9-16-bit
# custom, a 4-bit one the kernels decode through a table (negative bias), and one
# whose largest value is below 1 with float32-subnormal means (the exponent rule's
# subnormal path: d well below the cap).
OWNER_FORMATS = [
    *(get_format(n) for n in ("e4m3", "e5m2", "e3m2", "e2m1", "fp16", "bf16")),
    get_format("e5m3"),
    FloatFormat(2, 1, specials="none", bias=-1, name="e2m1-b-1"),
    FloatFormat(3, 4, specials="ieee", bias=127, name="e3m4-b127"),
    FloatFormat(3, 1, specials="fn", bias=127, name="e3m1fn-b127"),  # max 2**-120: mantissa 0
]


def _owner_chain(
    c: codec.Codec, recv: torch.Tensor, n: int, layout: codec.Layout, exps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner's step as two_phase_blocks ran it before the fused kernels."""
    mean = c.shard_mean(recv, n)[: layout.numel]
    d = S.mean_exponents(S.blocks_amax(mean, layout), exps, c.fmt)
    return c.encode(mean, scale=pow2(d), layout=layout), d


def _owner_inputs(
    fmt: FloatFormat, n: int, block_size: int, seed: int
) -> list[tuple[torch.Tensor, codec.Layout, torch.Tensor]]:
    """(recv, blocks, agreed exponents) of a shard owner, twice: gradients encoded with
    their agreed block exponents (a zero block, NaN and inf blocks; shards padded as
    two_phase pads them), then random codes with random exponents, the first half's
    blocks holding the format's subnormals only."""
    # Odd sizes: blocks at odd offsets, in the 4-bit case bytes shared by two blocks,
    # also where the kernels' groups of ~2048 elements meet (inside the 2500).
    numels = [37, 0, 64, 5, 300, 1, 2500, 3 * block_size + 3]
    blocks = codec.Layout.from_numels(numels, CPU).grid(block_size)
    layout, numel = blocks.layout, blocks.layout.numel
    need = payload_nbytes(numel, fmt)
    shard = need + (2 if fmt.wire_bits == 16 else 3)  # whole elements, padded
    g = _grads(numels, seed=seed, rows=n) * min(fmt.max, 2.0**100)
    g[:, 40:48] = 0.0  # a zero block (two for block 8)
    g[0, 120], g[n - 1, 200] = float("nan"), float("inf")
    amax = torch.stack([S.block_amax(r, blocks) for r in g]).amax(0)
    f = S.factors(
        amax, fmt, "two_phase", world_size=n, scaling="block", counts=blocks.device_counts
    )
    recv = torch.zeros(n * shard, dtype=torch.uint8)
    for r in range(n):
        codec.encode(
            g[r], fmt, out=recv[r * shard : r * shard + need], scale=f.scale, layout=layout
        )
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * shard,), dtype=torch.uint8, generator=gen)
    tiny = torch.randint(-(2**fmt.man_bits), 2**fmt.man_bits, (n, numel), generator=gen)
    for r in range(n):
        part = raw[r * shard : r * shard + need]
        x = F.decode(part, fmt, numel)
        x[: numel // 2] = tiny[r, : numel // 2] * fmt.min_subnormal
        F.encode(x, fmt, out=part)
    exps = torch.randint(-126, 127, (layout.n_segments,), dtype=torch.int32, generator=gen)
    return [(recv, layout, f.exponents), (raw, layout, exps)]


@pytest.mark.parametrize("fmt", OWNER_FORMATS, ids=lambda f: f.name)
def test_owner_reduce_blocks_matches_the_chain(fmt: FloatFormat) -> None:
    """The one-pass owner step gives the chain's bytes and exponents exactly: the
    kernels bit for bit, the torch backends up to the sign of NaN codes."""
    kernels = codec.Codec(fmt, CPU, "kernels")
    torch_backends = ["bits"] + (["cast"] if fmt.torch_dtype is not None else [])
    for block_size, n in itertools.product((8, 32, 256), (1, 2, 3, 4)):
        for recv, layout, exps in _owner_inputs(fmt, n, block_size, seed=n * block_size):
            ref, ref_d = _owner_chain(kernels, recv, n, layout, exps)
            out = torch.full((ref.numel() + 6,), 0xA5, dtype=torch.uint8)
            got, d = kernels.owner_reduce_blocks(recv, n, layout, exps, out=out[3:-3])
            assert torch.equal(got, ref) and torch.equal(d, ref_d), (block_size, n)
            assert (out[:3] == 0xA5).all() and (out[-3:] == 0xA5).all()
            for backend in torch_backends:
                c = codec.Codec(fmt, CPU, backend)
                got, d = c.owner_reduce_blocks(recv, n, layout, exps)
                assert torch.equal(d, ref_d), backend
                assert _same_codes(got, ref, fmt, layout.numel), backend
    # The subnormal means' exponents are not all at the cap (the rule's subnormal path).
    if fmt.name == "e3m4-b127":
        recv, layout, exps = _owner_inputs(fmt, 3, 8, seed=0)[1]
        _, d = kernels.owner_reduce_blocks(recv, 3, layout, exps.clamp(max=0))
        assert 0 < d[0] < 120 and 0 < d[1] < 120


def _same_codes(a: torch.Tensor, b: torch.Tensor, fmt: FloatFormat, numel: int) -> bool:
    """Equal codes up to the sign of NaN codes (the torch backends' NaN may differ)."""
    x, y = F.decode(a, fmt, numel), F.decode(b, fmt, numel)
    return torch.equal(
        x.nan_to_num(nan=7.0).view(torch.int32), y.nan_to_num(nan=7.0).view(torch.int32)
    )


def test_owner_reduce_blocks_rejects_bad_inputs() -> None:
    blocks = codec.Layout.from_numels([20], CPU).grid(8).layout
    exps = torch.zeros(3, dtype=torch.int32)
    recv = torch.zeros(2 * 10, dtype=torch.uint8)
    c = codec.Codec("e4m3", CPU)
    with pytest.raises(ValueError, match="at least the layout's 20: got 10 bytes"):
        c.owner_reduce_blocks(recv, 2, blocks, exps)
    recv = torch.zeros(2 * 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"int32 vector of the layout's 3 blocks .* torch.int64"):
        c.owner_reduce_blocks(recv, 2, blocks, exps.long())
    with pytest.raises(ValueError, match="a whole layout"):
        c.owner_reduce_blocks(recv, 2, codec.Layout.from_numels([20], CPU).window(2, 9), exps)
    with pytest.raises(ValueError, match="out must hold 20 uint8 bytes"):
        c.owner_reduce_blocks(recv, 2, blocks, exps, out=torch.empty(19, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole elements"):  # 9 bytes of fp16
        codec.owner_reduce_blocks(torch.zeros(18, dtype=torch.uint8), "fp16", 2, blocks, exps)
    payload, d = c.owner_reduce_blocks(recv[:0], 2, codec.Layout.from_numels([], CPU), exps[:0])
    assert payload.numel() == 0 and d.numel() == 0


def _rank_owner_chain(
    c: codec.Codec,
    recv: torch.Tensor,
    n: int,
    layout: codec.Layout,
    scales: torch.Tensor,
    own: torch.Tensor | None = None,
    own_row: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner's step with every rank's own block exponents, one call at a time (row
    ``own_row``: the float32 ``own`` instead)."""
    rows, used = recv.view(n, -1), payload_nbytes(layout.numel, c.fmt)

    def row(r: int) -> torch.Tensor:
        if r == own_row:
            assert own is not None
            return own
        return c.decode(rows[r, :used], layout.numel, scale=scales[r], layout=layout)

    mean = row(0)
    for r in range(1, n):
        mean = mean + row(r)
    mean = mean / n
    zero = torch.zeros(layout.n_segments, dtype=torch.int32)
    d = S.mean_exponents(S.blocks_amax(mean, layout), zero, c.fmt)
    return c.encode(mean, scale=pow2(d), layout=layout), d


@pytest.mark.parametrize("fmt", OWNER_FORMATS, ids=lambda f: f.name)
def test_owner_reduce_rank_blocks_matches_the_chain(fmt: FloatFormat) -> None:
    """Each rank's shard decoded with its own block scales, then the owner's step: the
    kernels' one pass bit for bit as the chain, the torch backends up to NaN signs."""
    kernels = codec.Codec(fmt, CPU, "kernels")
    torch_backends = ["bits"] + (["cast"] if fmt.torch_dtype is not None else [])
    for block_size, n in itertools.product((8, 256), (1, 3)):
        for recv, layout, exps in _owner_inputs(fmt, n, block_size, seed=n * block_size):
            # Every rank its own exponents, as far apart as the senders' maxima.
            gen = torch.Generator().manual_seed(n)
            shift = torch.randint(-6, 7, (n, layout.n_segments), generator=gen)
            scales = pow2(-(exps + shift).clamp(-126, 126))
            ref, ref_d = _rank_owner_chain(kernels, recv, n, layout, scales)
            out = torch.full((ref.numel() + 6,), 0xA5, dtype=torch.uint8)
            got, d = kernels.owner_reduce_rank_blocks(recv, n, layout, scales, out=out[3:-3])
            assert torch.equal(got, ref) and torch.equal(d, ref_d), (block_size, n)
            assert (out[:3] == 0xA5).all() and (out[-3:] == 0xA5).all()
            for backend in torch_backends:
                c = codec.Codec(fmt, CPU, backend)
                got, d = c.owner_reduce_rank_blocks(recv, n, layout, scales)
                assert torch.equal(d, ref_d), backend
                assert _same_codes(got, ref, fmt, layout.numel), backend
            # The owner's own row: its float32 values, never decoded.
            own = torch.randn(layout.numel, generator=gen) * scales[-1].max().reciprocal()
            ref, ref_d = _rank_owner_chain(kernels, recv, n, layout, scales, own, n - 1)
            for backend in ["kernels", *torch_backends]:
                c = codec.Codec(fmt, CPU, backend)
                got, d = c.owner_reduce_rank_blocks(recv, n, layout, scales, own=own, own_row=n - 1)
                assert torch.equal(d, ref_d), backend
                assert _same_codes(got, ref, fmt, layout.numel), backend
    with pytest.raises(ValueError, match=r"rank_scales must be float32 of shape \(3, "):
        kernels.owner_reduce_rank_blocks(recv, 3, layout, scales[:1])
    with pytest.raises(
        ValueError, match=r"a row of 3, got torch\.float32 of 5 on cpu and own_row=3"
    ):
        kernels.owner_reduce_rank_blocks(recv, 3, layout, scales, own=own[:5], own_row=3)


@pytest.mark.parametrize("fmt", OWNER_FORMATS, ids=lambda f: f.name)
def test_two_phase_keys_on_the_cpu_match_the_exponent_rule(fmt: FloatFormat) -> None:
    """The CPU kernel's two_phase keys (integer work on the bits) equal the float64
    rule's: zero, non-finite, float32 subnormals, both sides of every power of two."""
    gen = torch.Generator().manual_seed(0)
    pow2s = torch.exp2(torch.arange(-149, 128, dtype=torch.float64)).float()
    edges = torch.cat([pow2s, pow2s.nextafter(torch.tensor(0.0))])
    limit = torch.tensor(min(fmt.max, 3.4e38), dtype=torch.float32)
    at_max = limit * pow2s[100:180]  # fmt.max times powers of two, exactly
    amax = torch.cat(
        [
            torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 3.4e38]),
            edges,
            at_max,
            at_max.nextafter(torch.tensor(float("inf"))),
            torch.rand(2000, generator=gen)
            * torch.exp2(torch.randint(-140, 120, (2000,), generator=gen)),
        ]
    )
    for world in (1, 2, 1000):
        if fmt.max * world > torch.finfo(torch.float32).max:
            continue  # the FP32 sum's bound: the float64 rule runs
        got = S.exponent_keys(amax, fmt, "two_phase", world_size=world)
        e = S.exponents(amax, fmt, world_size=world, reduction="two_phase", scaling="block")
        want = torch.where(amax == 0, S.KEY_ZERO, 127 - e)
        want = torch.where(torch.isfinite(amax), want, S.KEY_BAD).to(torch.uint8)
        assert torch.equal(got[0], want), (world, (got[0] != want).nonzero()[:5])


@pytest.mark.parametrize("fmt", [F.BF16, F.FP16, F.E4M3], ids=lambda f: f.name)
def test_block_keys_kernel_matches_the_exponent_rule_at_any_world_size(fmt: FloatFormat) -> None:
    """The settled bucket's one keys call equals the float64 rule, bf16's FP32-sum bound
    included (its max times N passes float32's: the rule's second bound binds)."""
    gen = torch.Generator().manual_seed(1)
    pow2s = torch.exp2(torch.arange(-149, 128, dtype=torch.float64)).float()
    x = torch.cat(
        [
            torch.tensor([0.0, -3.4e38, 1e-45, float("inf"), float("nan")]),
            pow2s,
            -pow2s.nextafter(torch.tensor(0.0)),
            torch.randn(2000, generator=gen)
            * torch.exp2(torch.randint(-140, 120, (2000,), generator=gen)),
        ]
    )
    offsets = np.arange(x.numel() + 1, dtype=np.int64)  # one element per block
    counts = torch.tensor([3, 2, x.numel() - 5])  # three layers; the second one's not finite
    for world in (1, 2, 3, 1000):
        maxima, keys = torch.empty(x.numel()), torch.empty(x.numel(), dtype=torch.uint8)
        flags = torch.empty(3, dtype=torch.uint8)
        cpu_kernels.block_keys(
            fmt, x, offsets, counts, maxima, keys, flags, S.EXPONENT_LIMIT, world
        )
        amax = x.abs()
        e = S.exponents(amax, fmt, world_size=world, reduction="two_phase", scaling="block")
        want = torch.where(amax == 0, S.KEY_ZERO, 127 - e)
        want = torch.where(torch.isfinite(amax), want, S.KEY_BAD).to(torch.uint8)
        assert torch.equal(keys, want), (world, (keys != want).nonzero()[:5])
        assert flags.tolist() == [0, 1, 0]


def test_key_factors_are_the_keys_powers_of_two() -> None:
    keys = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    e = S.key_exponents(keys)
    assert torch.equal(S.key_factors(keys, unscale=True), pow2(-e))
    assert torch.equal(S.key_factors(keys, unscale=False), pow2(e))
    assert S.key_factors(keys, unscale=True)[0, 0] == 1.0 and pow2(-e).shape == (16, 16)


def test_key_factors_of_a_strided_view_keep_its_shape() -> None:
    # The owner looks up the keys of its received rows: a (N, blocks) slice.
    rows = torch.arange(60, dtype=torch.int32).to(torch.uint8).view(3, 20) + 100
    view = rows[:, 5:12]
    want = pow2(-S.key_exponents(view))
    assert torch.equal(S.key_factors(view, unscale=True), want) and want.shape == (3, 7)


def test_bad_layers_kernel_matches_the_torch_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    if not cpu_kernels.AVAILABLE:
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([3, 0, 1, 40, 7, 1000, 2], dtype=torch.int64)
    keys = torch.randint(0, 255, (int(counts.sum()),), generator=gen, dtype=torch.uint8)
    # Bad keys in the first block, a one-block layer, a last block and the last layer.
    for at in (0, 3, 50, int(counts.sum()) - 1):
        keys[at] = S.KEY_BAD
    fast = S.bad_layers(keys, counts)
    monkeypatch.setattr(cpu_kernels, "AVAILABLE", False)
    slow = S.bad_layers(keys, counts)
    assert fast.dtype == slow.dtype == torch.uint8
    assert fast.tolist() == slow.tolist() == [1, 0, 1, 0, 1, 0, 1]


@pytest.mark.parametrize("route", ["two_phase", "allreduce", "hierarchical"])
def test_factors_from_keys_by_lookup_equal_the_powers_of_two(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(11)
    counts = torch.tensor([5, 1, 30, 2], dtype=torch.int64)
    rows = 2 if route == "hierarchical" else 1
    keys = torch.randint(0, 254, (rows, int(counts.sum())), generator=gen, dtype=torch.uint8)
    keys[0, 7] = S.KEY_BAD  # layer 2 is non-finite on some rank
    keys[-1, 0] = S.KEY_ZERO
    fmt = get_format("e4m3")
    got = S.factors_from_keys(keys, fmt, route, world_size=4, counts=counts)
    finite = torch.repeat_interleave(torch.tensor([True, True, False, True]), counts)
    e = torch.where((keys == 0) | (keys == 255), 0, 127 - keys.to(torch.int32))
    if route == "hierarchical":
        want_unscale = pow2(-e[1])
    else:
        want_unscale = pow2(-e[0]) / (4 if route == "allreduce" else 1)
        assert torch.equal(got.scale, pow2(e[0]))
    assert torch.equal(got.exponents, e[0])
    assert torch.equal(got.unscale.isnan(), ~finite)
    assert torch.equal(got.unscale[finite], want_unscale[finite])
    # The CPU kernel's layer rule and torch's give the same blocks.
    monkeypatch.setattr(cpu_kernels, "AVAILABLE", False)
    slow = S.factors_from_keys(keys, fmt, route, world_size=4, counts=counts)
    assert torch.equal(slow.unscale.isnan(), got.unscale.isnan())
    assert torch.equal(slow.scale, got.scale)
