"""aps_comm.simulate against slow references, its own properties, Gloo and the real hook.

The references below are written independently of the module: per-worker
Python loops over :func:`aps_comm.formats.quantize`, the binomial tree as
its textbook loop over strides, and Gloo's ring as a literal replay of the
send/receive schedule in ``gloo/allreduce.cc``.
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import APSState, aps_hook
from aps_comm.formats import FP32, FloatFormat, get_format, quantize
from aps_comm.scaling import exponents, pow2
from aps_comm.simulate import (
    SimConfig,
    VirtualWorkers,
    allreduce,
    allreduce_feedback,
    records,
    reduce_scatter,
    ring_chunks,
)
from aps_comm.testing import run_distributed

# ---------------------------------------------------------------------------
# independent references


def _round(x: torch.Tensor, fmt: FloatFormat, *, overflow: bool) -> torch.Tensor:
    """Nearest-even rounding; with ``overflow`` an IEEE adder's inf past the range."""
    if fmt == FP32:
        return x.clone()
    q = quantize(x, fmt)
    if overflow and fmt.has_inf:
        top_ulp = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.man_bits)
        q[x.abs() >= fmt.max + top_ulp / 2] = float("inf")
        q = torch.where(torch.isinf(q), q.abs() * torch.sign(x), q)
    return q


def _gloo_ring(q: torch.Tensor, add, elem_bytes: int) -> torch.Tensor:
    """Replay Gloo's ring reduce-scatter message by message; return the reduced buffer."""
    n, m = q.shape
    total = m * elem_bytes
    max_seg = elem_bytes * max(1, (1 << 20) // elem_bytes)
    n_seg = max(math.ceil(total / max_seg), 2 * n)
    n_seg = math.ceil(n_seg / n) * n
    per_rank = n_seg // n
    seg_el = math.ceil(math.ceil(total / n_seg) / elem_bytes)

    def seg(k: int) -> slice:
        return slice(min(k * seg_el, m), min((k + 1) * seg_el, m))

    buf = q.clone()
    for i in range(n_seg - per_rank):
        # Rank r sends segment (r+1)*per_rank + i to rank r-1, which adds it
        # to its own copy of that segment.
        msgs = [((r - 1) % n, ((r + 1) * per_rank + i) % n_seg) for r in range(n)]
        payloads = [buf[(dst + 1) % n, seg(k)].clone() for dst, k in msgs]
        for (dst, k), v in zip(msgs, payloads, strict=True):
            buf[dst, seg(k)] = add(buf[dst, seg(k)], v)
    out = torch.empty(m)
    for owner in range(n):
        for j in range(per_rank):
            s = seg(owner * per_rank + j)
            out[s] = buf[owner, s]
    return out


def _reference(layers, fmt, order, scaling, accumulator=None):
    fmt = get_format(fmt)
    n = layers[0].shape[0]
    flat = [t.reshape(n, -1).float() for t in layers]
    worker_max = [
        max((float(w.abs().max()) if w.numel() else 0.0) for w in f) if f.shape[1] else 0.0
        for f in flat
    ]
    amax = torch.tensor(worker_max).nan_to_num(nan=float("inf"))
    rule = "two_phase" if order == "two_phase" else "allreduce"
    e = exponents(amax, fmt, world_size=n, reduction=rule, scaling=scaling)
    acc_fmt = get_format(accumulator) if accumulator else (FP32 if order == "two_phase" else fmt)

    def add(a, b):
        return _round(a + b, acc_fmt, overflow=True)

    # The ring runs over the bucket: all layers back to back.
    q_all = torch.cat(
        [
            torch.stack([quantize(f[r] * pow2(e[i]), fmt) for r in range(n)])
            for i, f in enumerate(flat)
        ],
        dim=1,
    )
    if order in ("two_phase", "sequential"):
        total = q_all[0].clone()
        for r in range(1, n):
            total = add(total, q_all[r])
    elif order == "tree":
        vals = [q_all[r].clone() for r in range(n)]
        stride = 1
        while stride < n:
            for r in range(0, n, 2 * stride):
                if r + stride < n:
                    vals[r] = add(vals[r], vals[r + stride])
            stride *= 2
        total = vals[0]
    else:
        total = _gloo_ring(q_all, add, max(1, fmt.wire_bits // 8)) if n > 1 else q_all[0]
    out, offset = [], 0
    for i, f in enumerate(flat):
        s = total[offset : offset + f.shape[1]]
        offset += f.shape[1]
        if order == "two_phase":
            res = quantize(s / n, fmt) * pow2(-e[i])
        else:
            res = _round(s, fmt, overflow=True) * (pow2(-e[i]) / n)
        if not math.isfinite(amax[i]):
            res = torch.full_like(res, float("nan"))
        out.append(res.reshape(layers[i].shape[1:]))
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(
        a.float().contiguous().view(torch.int32), b.float().contiguous().view(torch.int32)
    )


def _layers(n: int, sizes, seed: int = 0, spread: int = 8):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, size in enumerate(sizes):
        x = torch.randn(n, *size, generator=g)
        x *= torch.exp2(torch.randint(-spread, spread + 1, x.shape, generator=g).float())
        out.append(x * 10.0 ** (-i))  # layers of different magnitudes
    return out


# ---------------------------------------------------------------------------
# ring chunks


def test_ring_chunks() -> None:
    assert ring_chunks(1001, 4, 2) == [0, 252, 504, 756, 1001]
    assert ring_chunks(10, 4, 2) == [0, 4, 8, 10, 10]  # the last rank reduces nothing
    assert ring_chunks(131072, 4, 2) == [0, 32768, 65536, 98304, 131072]
    # 16 MB: pipelined in 18 segments of 444,445 elements, not thirds.
    assert ring_chunks(8_000_000, 3, 2) == [0, 2_666_670, 5_333_340, 8_000_000]
    with pytest.raises(ValueError):
        ring_chunks(0, 2, 2)


# ---------------------------------------------------------------------------
# against the slow reference


CASES = [
    ("e4m3", "two_phase", "layer", 4),
    ("e4m3", "two_phase", "bucket", 5),
    ("e5m2", "ring", "layer", 4),
    ("e5m2", "ring", "none", 3),
    ("fp16", "ring", "layer", 7),
    ("e4m3", "tree", "layer", 8),
    ("e3m2", "tree", "layer", 6),
    ("e2m1", "sequential", "layer", 5),
    ("e2m1", "two_phase", "none", 4),
    ("e4m3", "ring", "layer", 16),
    (FloatFormat(5, 1, bias=12, specials="fn"), "ring", "layer", 3),
    ("e3m4", "sequential", "none", 4),
]


@pytest.mark.parametrize(("fmt", "order", "scaling", "n"), CASES)
def test_matches_reference(fmt, order, scaling, n) -> None:
    layers = _layers(n, [(37, 3), (64,), (5,), (0,)], seed=n)
    got = allreduce(layers, fmt, reduction=order, scaling=scaling)
    want = _reference(layers, fmt, order, scaling)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert _bits_equal(a, b)


@pytest.mark.parametrize(
    ("order", "acc"), [("ring", "fp16"), ("tree", "bf16"), ("two_phase", "e5m2")]
)
def test_accumulator_matches_reference(order, acc) -> None:
    layers = _layers(6, [(300,), (11,)], seed=3)
    got = allreduce(layers, "e4m3", reduction=order, accumulator=acc)
    want = _reference(layers, "e4m3", order, "layer", accumulator=acc)
    assert all(_bits_equal(a, b) for a, b in zip(got, want, strict=True))


def test_blocks_do_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    import aps_comm.simulate as sim

    layers = _layers(8, [(1000,), (77,)], seed=5)
    for order in ("ring", "tree", "two_phase"):
        whole = allreduce(layers, "e4m3", reduction=order)
        monkeypatch.setattr(sim, "_BLOCK_ELEMENTS", 8 * 13)
        pieces = allreduce(layers, "e4m3", reduction=order)
        monkeypatch.undo()
        assert all(_bits_equal(a, b) for a, b in zip(whole, pieces, strict=True))


# ---------------------------------------------------------------------------
# properties


def test_fp32_two_phase_is_exact_mean() -> None:
    # Small integers times a power of two: every float32 partial sum is exact.
    g = torch.randint(-1000, 1000, (16, 300), generator=torch.Generator().manual_seed(0))
    x = g.float() * 2.0**-7
    [avg] = allreduce([x], "fp32", reduction="two_phase", scaling="none")
    assert torch.equal(avg.double(), x.double().mean(0))


def test_sequential_fp32_accumulator_is_float32_sum() -> None:
    x = _layers(32, [(500,)], seed=1)[0]
    [avg] = allreduce([x], "fp32", reduction="sequential", scaling="none", accumulator="fp32")
    total = x[0].clone()
    for r in range(1, 32):
        total = total + x[r]
    assert _bits_equal(avg, total * (torch.tensor(1.0) / 32))


def test_kahan_reduces_error() -> None:
    # 256 workers summing in a bf16 accumulator: plain summation stalls once
    # the running sum dwarfs each term; Kahan's compensation recovers it.
    g = torch.Generator().manual_seed(2)
    x = torch.rand(256, 4000, generator=g) + 0.5
    exact = quantize(x, "fp16").double().mean(0)
    errs = {}
    for kahan in (False, True):
        [avg] = allreduce(
            [x], "fp16", reduction="sequential", scaling="none", accumulator="bf16", kahan=kahan
        )
        errs[kahan] = float((avg.double() - exact).norm() / exact.norm())
    assert errs[True] < errs[False] / 4, errs


def test_stochastic_rounding_reproducible_and_unbiased() -> None:
    x = _layers(8, [(2000,)], seed=4)[0]

    def run(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return allreduce([x], "e2m1", reduction="two_phase", rounding="stochastic", generator=gen)[
            0
        ]

    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))
    # Unbiased: the mean of many runs beats one nearest-rounded result.
    [nearest] = allreduce([x], "e2m1", reduction="two_phase")
    exact = x.double().mean(0)
    mean_sr = torch.stack([run(s) for s in range(40)]).double().mean(0)
    assert (mean_sr - exact).norm() < 0.5 * (nearest.double() - exact).norm()


def test_nonfinite_and_zero_layers() -> None:
    a, b, c = _layers(4, [(10,), (10,), (10,)], seed=6)
    b[2, 3] = float("nan")
    c.zero_()
    for order in ("two_phase", "ring", "tree", "sequential"):
        ra, rb, rc = allreduce([a, b, c], "e4m3", reduction=order)
        assert torch.isfinite(ra).all()
        assert torch.isnan(rb).all()
        assert torch.equal(rc, torch.zeros(10))


def test_inf_layer_is_nan() -> None:
    [a] = _layers(4, [(10,)], seed=6)
    a[0, 0] = float("inf")
    assert torch.isnan(allreduce([a], "e5m2")[0]).all()


def test_wire_sum_overflows_like_ieee() -> None:
    x = torch.full((2, 4), 40000.0)  # fp16 max is 65504: the sum overflows
    [fp16] = allreduce([x], "fp16", reduction="ring", scaling="none")
    assert torch.isinf(fp16).all()
    [e4m3] = allreduce([torch.full((2, 4), 300.0)], "e4m3", reduction="ring", scaling="none")
    assert torch.equal(e4m3, torch.full((4,), 224.0))  # no inf in e4m3fn: saturates
    # With APS headroom nothing overflows.
    [aps] = allreduce([x], "fp16", reduction="ring")
    assert torch.equal(aps, torch.full((4,), 40000.0))


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="leading dimension"):
        allreduce([torch.zeros(2, 3), torch.zeros(3, 3)], "e4m3")
    with pytest.raises(ValueError, match="reduction"):
        allreduce([torch.zeros(2, 3)], "e4m3", reduction="butterfly")
    with pytest.raises(TypeError):
        allreduce([torch.zeros(2, 3, dtype=torch.int32)], "e4m3")
    assert allreduce([], "e4m3") == []


# ---------------------------------------------------------------------------
# virtual workers


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_virtual_workers_grads() -> None:
    torch.manual_seed(0)
    model = _Tiny()
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    loss_fn = nn.functional.cross_entropy
    fast = VirtualWorkers(model, 16, SimConfig("fp32"))
    slow = VirtualWorkers(model, 16, SimConfig("fp32"), vectorize=False)
    g_fast, loss_fast = fast.worker_grads(loss_fn, x, y)
    g_slow, loss_slow = slow.worker_grads(loss_fn, x, y)
    for a, b in zip(g_fast, g_slow, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(loss_fast, loss_slow)
    # FP32 averaging of equal micro-batches is the full-batch gradient.
    fast.backward(loss_fn, x, y)
    full = torch.autograd.grad(loss_fn(model(x), y), list(model.parameters()))
    for p, g in zip(model.parameters(), full, strict=True):
        torch.testing.assert_close(p.grad, g)
    with pytest.raises(ValueError, match="micro-batches"):
        fast.backward(loss_fn, x[:60], y[:60])


def test_virtual_workers_train_with_4_bits() -> None:
    torch.manual_seed(1)
    model = _Tiny()
    x = torch.randn(256, 8)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    # two_phase: a ring sum in e2m1 would need 64x headroom, more than e2m1's
    # whole range (0.5 to 6), so every contribution would round to zero.
    vw = VirtualWorkers(model, 64, SimConfig("e2m1", reduction="two_phase"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    first = vw.backward(nn.functional.cross_entropy, x, y)
    for _ in range(30):
        opt.step()
        last = vw.backward(nn.functional.cross_entropy, x, y)
    assert float(last) < 0.7 * float(first)


# ---------------------------------------------------------------------------
# real ranks: Gloo's FP16 sum order and the hook


def _chain(x: torch.Tensor, owner: int) -> torch.Tensor:
    """(((x[c-1] + x[c-2]) + ...) + x[c+1]) + x[c] in FP16."""
    n = x.shape[0]
    acc = x[(owner - 1) % n].float()
    for k in range(2, n):
        acc = (acc + x[(owner - k) % n].float()).half().float()
    return (acc + x[owner].float()).half()


def _telling_fp16(n: int, numel: int, seed: int) -> torch.Tensor:
    """(n, numel) FP16 values whose sum differs for every choice of final rank."""
    g = torch.Generator().manual_seed(seed)
    cand = torch.randn(n, 20000, generator=g)
    cand = (cand * torch.exp2(torch.randint(-3, 12, cand.shape, generator=g).float())).half()
    sums = torch.stack([_chain(cand, c).view(torch.int16) for c in range(n)])
    distinct = torch.ones(cand.shape[1], dtype=torch.bool)
    for a in range(n):
        for b in range(a + 1, n):
            distinct &= sums[a] != sums[b]
    pool = cand[:, distinct]
    pick = torch.randint(0, pool.shape[1], (numel,), generator=g)
    return pool[:, pick].contiguous()


def _gloo_fp16_sum(rank: int, world_size: int, numels: list[int]) -> list[np.ndarray]:
    out = []
    for i, numel in enumerate(numels):
        x = _telling_fp16(world_size, numel, seed=i)[rank].clone()
        dist.all_reduce(x)
        out.append(x.view(torch.int16).numpy())
    return out


@pytest.mark.parametrize(
    ("n", "numels"),
    # 4,500,001 elements (9 MB) are pipelined in 9 segments: chunk 1 starts
    # at 1,500,003, not at ceil(n/3) = 1,500,001.
    [(3, [10, 1001, 96_001, 4_500_001]), (4, [10, 1001, 131_073])],
    ids=["3-ranks", "4-ranks"],
)
def test_ring_is_gloo_fp16_order(n: int, numels: list[int]) -> None:
    results = run_distributed(_gloo_fp16_sum, n, args=(numels,), timeout=180)
    for i, numel in enumerate(numels):
        x = _telling_fp16(n, numel, seed=i)
        gloo = torch.from_numpy(results[0][i]).view(torch.float16)
        assert all(np.array_equal(r[i], results[0][i]) for r in results)
        [sim] = allreduce([x.float()], "fp16", reduction="ring", scaling="none")
        # The simulator returns sum * (1/N); undo the float32 multiply exactly
        # by comparing against the same multiply of Gloo's sum.
        assert _bits_equal(sim, gloo.float() * (torch.tensor(1.0) / n)), numel


class _Probe(nn.Module):
    """loss = sum_i <p_i, x_i>, so each parameter's gradient is exactly x_i."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in sizes])

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * x).sum() for p, x in zip(self.ps, xs, strict=True))


_HOOK_SIZES = [600, 37, 364, 8]  # 1009 elements: Gloo's chunks are not quarters


def _hook_grads(rank: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    xs = []
    for i, s in enumerate(_HOOK_SIZES):
        x = torch.randn(s, generator=g) * torch.exp2(
            torch.randint(-8, 9, (s,), generator=g).float()
        )
        xs.append(x * 10.0 ** (-2 * i))
    xs[-1].zero_()  # a zero layer
    return xs


def _run_hook(rank: int, n: int, configs: list[tuple]) -> list[list[tuple]]:
    results = []
    for k, (fmt, reduction, scaling) in enumerate(configs):
        model = DDP(_Probe(_HOOK_SIZES))
        state = APSState(fmt=fmt, reduction=reduction, scaling=scaling)
        captured: list[tuple] = []

        def hook(
            st: APSState, bucket: dist.GradBucket, captured=captured
        ) -> torch.futures.Future[torch.Tensor]:
            raw = bucket.buffer().clone()
            numels = [p.numel() for p in bucket.parameters()]

            def done(fut: torch.futures.Future) -> torch.Tensor:
                out = fut.value()
                captured.append((raw, numels, out.clone()))
                return out

            return aps_hook(st, bucket).then(done)

        model.register_comm_hook(state, hook)
        model(_hook_grads(rank, n, seed=k)).backward()
        per_bucket = []
        for raw, numels, out in captured:
            everyone = [torch.empty_like(raw) for _ in range(n)]
            dist.all_gather(everyone, raw)
            per_bucket.append((torch.stack(everyone).numpy(), numels, out.numpy()))
        results.append(per_bucket)
    return results


HOOK_CONFIGS = [
    ("e4m3", "two_phase", "layer"),
    ("e5m2", "two_phase", "bucket"),
    ("e2m1", "two_phase", "layer"),
    ("fp16", "allreduce", "layer"),
    ("bf16", "allreduce", "none"),
]


@pytest.mark.parametrize("n", [2, 4])
def test_matches_hook_bit_for_bit(n: int) -> None:
    results = run_distributed(_run_hook, n, args=(HOOK_CONFIGS,), timeout=240)
    for k, (fmt, reduction, scaling) in enumerate(HOOK_CONFIGS):
        buckets = results[0][k]
        assert buckets
        for b, (raw, numels, out) in enumerate(buckets):
            for r in range(1, n):
                assert np.array_equal(results[r][k][b][2].view(np.int32), out.view(np.int32))
            stacked = torch.from_numpy(raw)
            layers = list(torch.split(stacked, numels, dim=1))
            order = "two_phase" if reduction == "two_phase" else "ring"
            sim = torch.cat(allreduce(layers, fmt, reduction=order, scaling=scaling))
            assert _bits_equal(sim, torch.from_numpy(out)), (fmt, reduction, scaling)


def test_records_are_each_workers_counts_under_the_agreed_exponents() -> None:
    """:func:`simulate.records`: the exponent and maximum agreed over the workers, the
    counts of the asked worker's own values; a non-finite layer on one worker is inf with
    exponent 0 on every worker; with rank block exponents each worker's own maxima."""
    g = torch.tensor([[0.5, 1e-9, 0.0], [0.25, 0.0, float("nan")]])[:, None, :]  # 2 workers
    h = torch.tensor([[4.0, 2.0**-20], [1.0, 1.0]])
    for rank in (0, 1):
        nan, layer = records([g[:, :, 2:], h], "e4m3", rank, names=["a", "b"])
        assert (nan.name, nan.amax, nan.exponent, nan.numel) == ("a", math.inf, 0, 1)
        assert layer.amax == 4.0 and layer.exponent == 6  # 4 * 2**6 = 256 <= 448 / 2
        assert layer.underflow_rate == (0.5 if rank == 0 else 0.0)  # 2**-14 flushes
    # Blocks of 8: with rank exponents each worker's own maxima, agreed ones otherwise.
    x = torch.stack([torch.full((16,), 1.0), torch.full((16,), 64.0)])
    x[0, 8:] = 0.5
    own = records([x], "e4m3", 0, scaling="block", block_size=8, rank_exponents=True)
    agreed = records([x], "e4m3", 0, scaling="block", block_size=8)
    assert own[0].amax == agreed[0].amax == 1.0  # worker 0's own largest block maximum
    assert own[0].exponent == agreed[0].exponent + 6  # 1.0 against 64.0: 2**6 apart


def test_formats_make_a_bucket_of_each_formats_layers() -> None:
    """``formats``: each format's layers are reduced as a bucket of their own (one bucket
    exponent each), FP32 layers averaged exactly on two workers (x / 2 summed)."""
    gen = torch.Generator().manual_seed(5)
    layers = [torch.randn(2, n, generator=gen) * s for n, s in ((30, 1.0), (7, 1e3), (9, 1e-2))]
    fmts = ["e4m3", "fp32", "e4m3"]
    out = allreduce(layers, "e4m3", scaling="bucket", formats=fmts)
    alone = allreduce([layers[0], layers[2]], "e4m3", scaling="bucket")
    assert _bits_equal(out[0], alone[0]) and _bits_equal(out[2], alone[1])
    assert _bits_equal(out[1], layers[1][0] / 2 + layers[1][1] / 2)
    # Its records: the e4m3 group's only, its bucket exponent.
    recs = records(layers, "e4m3", 1, names=["a", "b", "c"], scaling="bucket", formats=fmts)
    assert [r.name for r in recs] == ["a", "c"] and recs[0].exponent == recs[1].exponent
    with pytest.raises(ValueError, match="formats names 2 layers"):
        allreduce(layers, "e4m3", formats=fmts[:2])


def test_feedback_keeps_what_encoding_and_the_owners_rounding_lost() -> None:
    """:func:`aps_comm.simulate.allreduce_feedback`: each worker keeps what its encoding
    lost; two_phase's owner (worker 0 of 2 for the first shard) also N times what rounding
    the mean lost; residuals come back in on the next call; a non-finite layer keeps zeros."""
    g = torch.tensor([[1.0, 0.3, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # e2m1, exponent 2
    _, [res] = allreduce_feedback([g], "e2m1")
    assert res[0].tolist() == pytest.approx([0.0, 0.05, 0.0, 0.0])  # 1.2 encodes as 1
    # The mean 0.5 (scaled) stays 0.5: nothing more lost; native: no owner.
    [native], _ = allreduce_feedback([g], "fp16", reduction="ring")
    assert _bits_equal(native, allreduce([g], "fp16", reduction="ring")[0])
    # Fed back: the next step sends gradient plus residual.
    [again], _ = allreduce_feedback([g], "e2m1", [res])
    assert _bits_equal(again, allreduce([g + res], "e2m1")[0])
    bad = g.clone()
    bad[1, 2] = float("nan")
    [nan], [zeros] = allreduce_feedback([bad], "e2m1", [res])
    assert nan.isnan().all() and torch.equal(zeros, torch.zeros_like(zeros))
    with pytest.raises(ValueError, match="exponents agreed"):
        allreduce_feedback([g], "e2m1", scaling="block", rank_exponents=True)


# ---------------------------------------------------------------------------
# FSDP2's reduce-scatter


def _unit_reference(
    x: torch.Tensor, chunks: list[int], formats: list[str], e: list[int]
) -> torch.Tensor:
    """Rank r's row: each parameter times ``2**e`` rounded to its format's nearest even
    (:func:`aps_comm.formats.quantize`), times ``2**-e``, summed over the senders in order."""
    out = []
    for t, name, ei in zip(x.split(chunks, dim=2), formats, e, strict=True):
        f = get_format(name)
        q = quantize(t * 2.0**ei, f) * 2.0**-ei if f != FP32 else t.clone()
        acc = q[0].clone()
        for k in range(1, q.shape[0]):
            acc += q[k]
        out.append(acc)
    return torch.cat(out, dim=1)


def test_reduce_scatter_rounds_each_parameter_by_its_exponent_and_sums_in_rank_order() -> None:
    """Every rank's row r goes to rank r: each parameter's exponent from its maximum over
    every rank's rows (two_phase over N senders), the values rounded and summed in FP32
    in rank order; an FP32 parameter beside them is summed as it is."""
    gen = torch.Generator().manual_seed(3)
    n, chunks = 3, [5, 4, 7]
    x = torch.randn(n, n, sum(chunks), generator=gen) * torch.tensor(
        [1e-3] * 5 + [40.0] * 4 + [1.0] * 7
    )
    formats = ["e4m3", "fp32", "e4m3"]
    got = reduce_scatter(x, chunks, "e4m3", formats=formats)
    amax = torch.stack([t.abs().amax() for t in x.split(chunks, dim=2)])
    e = exponents(amax, "e4m3", world_size=n, reduction="two_phase").tolist()
    e[1] = 0
    want = _unit_reference(x, chunks, formats, e)
    assert torch.equal(got.rows, want)
    assert got.records == [[], [], []]
    # Bucket scaling: one exponent for the format's parameters, from their largest maximum.
    bucket = reduce_scatter(x, chunks, "e4m3", formats=formats, scaling="bucket")
    top = int(exponents(amax[[0, 2]].amax()[None], "e4m3", world_size=n, reduction="two_phase"))
    assert torch.equal(bucket.rows, _unit_reference(x, chunks, formats, [top, 0, top]))
    # No scaling: the values as they are.
    none = reduce_scatter(x, chunks, "e4m3", scaling="none")
    assert torch.equal(none.rows, _unit_reference(x, chunks, ["e4m3"] * 3, [0, 0, 0]))


def test_reduce_scatter_with_blocks_scales_every_rows_chunk_from_its_start() -> None:
    """Block scaling: each row's chunk of a parameter is blocked from its own start (a
    chunk of 10 at blocks of 8: 8 + 2 per row), each block's exponent from its maximum
    over the ranks."""
    gen = torch.Generator().manual_seed(4)
    n, bs = 2, 8
    x = torch.randn(n, n, 10, generator=gen)
    x[:, :, 8:] *= 1e-4  # the short block: an exponent of its own
    got = reduce_scatter(x, [10], "e2m1", scaling="block", block_size=bs)
    want = torch.empty(n, 10)
    for r in range(n):
        for lo, hi in ((0, 8), (8, 10)):
            part = x[:, r : r + 1, lo:hi]
            e = int(exponents(part.abs().amax()[None], "e2m1", world_size=n, reduction="two_phase"))
            want[r, lo:hi] = _unit_reference(part, [hi - lo], ["e2m1"], [e])[0]
    assert torch.equal(got.rows, want)


def test_reduce_scatter_spreads_a_nan_over_its_parameter_and_a_flag_over_the_unit() -> None:
    """A value that is not finite on one rank makes its parameter NaN in every row on
    every rank (the others are untouched); a flagged unit is NaN everywhere; a unit all in
    FP32 keeps a NaN where it is."""
    x = torch.ones(2, 2, 6)
    x[1, 0, 4] = math.nan  # rank 1's row 0, parameter 1 (elements 3 to 5)
    got = reduce_scatter(x, [3, 3], "e4m3").rows
    assert got[:, 3:].isnan().all() and torch.equal(got[:, :3], torch.full((2, 3), 2.0))
    flagged = reduce_scatter(torch.ones(2, 2, 6), [3, 3], "e4m3", problems=[False, True]).rows
    assert flagged.isnan().all()
    plain = reduce_scatter(x, [3, 3], "fp32").rows
    assert plain.isnan().sum() == 1 and plain[0, 4].isnan()
    assert reduce_scatter(x, [3, 3], "fp32", problems=[True, False]).rows.isnan().all()


@pytest.mark.parametrize("scaling", ["layer", "block"])
def test_reduce_scatter_records_are_the_simulated_records_of_each_ranks_gradient(
    scaling: str,
) -> None:
    """A rank's records of a unit are :func:`records` of its whole gradient (its N rows:
    padding zeros count for nothing), chunks of whole blocks, under the two_phase rule."""
    gen = torch.Generator().manual_seed(5)
    n, chunks = 2, [16, 32]
    x = torch.randn(n, n, 48, generator=gen) * torch.tensor([1e-6] * 16 + [3.0] * 32)
    x[0, 1, 17] = 0.0
    got = reduce_scatter(
        x,
        chunks,
        "e4m3",
        scaling=scaling,
        block_size=16,
        stats=True,
        names=["a", "b"],
        numels=[30, 64],
        unit=7,
    )
    layers = [t.reshape(n, -1) for t in x.split(chunks, dim=2)]
    for k in range(n):
        want = records(
            layers,
            "e4m3",
            k,
            names=["a", "b"],
            bucket=7,
            scaling=scaling,
            block_size=16,
            reduction="two_phase",
        )
        want = [dataclasses.replace(r, numel=m) for r, m in zip(want, [30, 64], strict=True)]
        assert got.records[k] == want


def test_reduce_scatter_checks_its_input() -> None:
    with pytest.raises(ValueError, match="rows must be"):
        reduce_scatter(torch.ones(2, 3, 4), [4], "e4m3")
    with pytest.raises(ValueError, match="formats names"):
        reduce_scatter(torch.ones(2, 2, 4), [2, 2], "e4m3", formats=["e4m3"])
    empty = reduce_scatter(torch.ones(2, 2, 3), [3, 0], "e4m3", stats=True)
    assert empty.rows.shape == (2, 3) and [r.numel for r in empty.records[0]] == [6, 0]
