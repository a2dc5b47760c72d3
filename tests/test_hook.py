"""The APS hook on real DDP, multi-rank on Gloo, against exact references.

Every reference is computed from all ranks' raw bucket contents with the
formats and scaling modules (themselves checked against ml_dtypes), never
from the hook's own code path.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import Net, capture, check_log, gather
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import APSState, aps_hook, register
from aps_comm.formats import FloatFormat, get_format
from aps_comm.testing import DistributedTestError, run_distributed

# (format, reduction, scaling): every combination the hook offers on Gloo.
CASES = [
    ("e4m3", "two_phase", "layer"),
    ("e4m3", "two_phase", "bucket"),
    ("e4m3", "two_phase", "none"),
    ("e5m2", "two_phase", "layer"),
    ("fp16", "allreduce", "layer"),
    ("fp16", "allreduce", "bucket"),
    ("fp16", "allreduce", "none"),
    ("bf16", "allreduce", "layer"),
    ("fp16", "two_phase", "layer"),
    ("bf16", "two_phase", "bucket"),
    ("e2m1", "two_phase", "layer"),
    ("e3m2", "two_phase", "layer"),
    (FloatFormat(5, 1, bias=12, specials="fn"), "two_phase", "layer"),
]


def _run_case(rank: int, world_size: int, cases: list, steps: int = 3) -> int:
    checked = 0
    for fmt_spec, reduction, scaling in cases:
        fmt = get_format(fmt_spec)
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.004)  # several buckets
        state = APSState(fmt, reduction=reduction, scaling=scaling)
        log: list = []
        ddp.register_comm_hook(state, capture(state, log))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(steps):
            torch.manual_seed(1000 * step + rank)
            x = torch.randn(8, 16) * (rank + 1)
            opt.zero_grad()
            ddp(x).pow(2).sum().backward()
            checked += check_log(log, fmt, reduction, scaling)
            # What DDP wrote into .grad is the hook's output.
            for p in model.parameters():
                assert torch.isfinite(p.grad).all()
            log.clear()
            opt.step()
        assert state.reduction == reduction
    return checked


@pytest.mark.parametrize("world_size", [2, 4])
def test_matches_exact_reference(world_size: int) -> None:
    checked = run_distributed(_run_case, world_size, args=(CASES,), timeout=240)
    assert all(c >= 3 * len(CASES) for c in checked)  # the third step runs settled buckets


def _fp32_vs_allreduce_hook(rank: int, world_size: int) -> bool:
    grads = []
    for use_aps in (False, True):
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.004)
        if use_aps:
            register(ddp, fmt="fp32")
        else:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        torch.manual_seed(rank)
        ddp(torch.randn(8, 16)).pow(2).sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return torch.equal(grads[0].view(torch.int32), grads[1].view(torch.int32))


def test_fp32_is_allreduce_hook_bit_for_bit() -> None:
    assert all(run_distributed(_fp32_vs_allreduce_hook, 4))


def _big_gradients(rank: int, world_size: int) -> dict:
    out = {}
    for name in ("torch_fp16", "aps_fp16"):
        lin = nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            lin.weight.zero_()
        ddp = DDP(lin)
        if name == "torch_fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            register(ddp, fmt="fp16", reduction="allreduce")
        x = torch.full((1, 4), 1e5)  # d(sum(w x))/dw = 1e5, beyond FP16's range
        ddp(x).sum().backward()
        out[name] = lin.weight.grad.clone()
    return out


def test_fp16_does_not_overflow_where_fp16_compress_hook_does() -> None:
    results = run_distributed(_big_gradients, 4)
    for r in results:
        assert torch.isinf(r["torch_fp16"]).all()
        got = r["aps_fp16"]
        assert torch.isfinite(got).all()
        # Within FP16 rounding (relative 2**-11) of the true mean, 1e5.
        assert torch.allclose(got, torch.full_like(got, 1e5), rtol=2**-10, atol=0)


def _nonfinite(rank: int, world_size: int, fmt: str, reduction: str) -> dict:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    state = APSState(fmt, reduction=reduction)
    log: list = []
    ddp.register_comm_hook(state, capture(state, log))
    torch.manual_seed(rank)
    out = ddp(torch.randn(8, 16))
    loss = out.pow(2).sum()
    if rank == 1:
        # A NaN (or inf) reaching only layer b's weight gradient on rank 1.
        bad = float("nan") if fmt == "e4m3" else float("inf")
        model.b.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), bad))
    loss.backward()
    fmt_obj = get_format(fmt)
    check_log(log, fmt_obj, reduction, "layer")
    return {
        "b_weight_all_nan": bool(torch.isnan(model.b.weight.grad).all()),
        "others_finite": all(
            bool(torch.isfinite(p.grad).all())
            for n, p in model.named_parameters()
            if n != "b.weight"
        ),
    }


@pytest.mark.parametrize(("fmt", "reduction"), [("e4m3", "two_phase"), ("fp16", "allreduce")])
def test_nonfinite_layer_is_nan_everywhere_and_others_exact(fmt: str, reduction: str) -> None:
    for r in run_distributed(_nonfinite, 4, args=(fmt, reduction)):
        assert r == {"b_weight_all_nan": True, "others_finite": True}


def _grad_scaler(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    register(ddp, fmt="e4m3")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    history = []
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        opt.zero_grad()
        loss = ddp(torch.randn(8, 16)).pow(2).mean()
        handle = None
        if step == 1 and rank == 0:
            handle = model.a.bias.register_hook(lambda g: g * float("inf"))
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        changed = any(
            not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)
        )
        history.append((changed, scaler.get_scale()))
        if handle is not None:
            handle.remove()
    return history


def test_grad_scaler_skips_the_step_with_a_nonfinite_gradient() -> None:
    results = run_distributed(_grad_scaler, 2)
    for hist in results:
        assert hist[0][0] is True  # normal step
        assert hist[1][0] is False  # skipped on every rank, not only rank 0
        assert hist[1][1] == hist[0][1] / 2  # scale backed off
        assert hist[2][0] is True
    assert results[0] == results[1]


def _edge_cases(rank: int, world_size: int, variant: str) -> int:
    torch.manual_seed(0)
    kwargs = {"find_unused_parameters": False, "gradient_as_bucket_view": False}
    net_kwargs = {}
    dtype = torch.float32
    if variant == "unused":
        net_kwargs, kwargs["find_unused_parameters"] = {"unused": True}, True
    elif variant == "empty_zero":
        net_kwargs = {"empty": True, "zero": True}
    elif variant == "bucket_view":
        kwargs["gradient_as_bucket_view"] = True
    elif variant in ("bf16", "fp16_model"):
        dtype = torch.bfloat16 if variant == "bf16" else torch.float16
    model = Net(**net_kwargs).to(dtype)
    ddp = DDP(model, bucket_cap_mb=0.004, **kwargs)
    state = APSState("e4m3", reduction="two_phase")
    log: list = []
    ddp.register_comm_hook(state, capture(state, log))
    checked = 0
    steps = 3 if variant == "no_sync" else 2
    for step in range(steps):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(8, 16, dtype=dtype)
        if variant == "no_sync" and step == 0:
            with ddp.no_sync():
                ddp(x).float().pow(2).sum().backward()
            assert not log  # no communication while accumulating
            continue
        ddp(x).float().pow(2).sum().backward()
        checked += check_log(log, get_format("e4m3"), "two_phase", "layer", dtype=dtype)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        if variant == "empty_zero":
            assert grads["z"].abs().sum() == 0
            assert grads["empty"].numel() == 0
        if variant == "unused":
            assert model.unused.weight.grad is None or model.unused.weight.grad.abs().sum() == 0
        log.clear()
        if variant != "no_sync":
            ddp.zero_grad()
    return checked


@pytest.mark.parametrize(
    "variant", ["unused", "empty_zero", "bucket_view", "bf16", "fp16_model", "no_sync"]
)
def test_edge_cases_match_reference(variant: str) -> None:
    assert all(c > 0 for c in run_distributed(_edge_cases, 2, args=(variant,)))


def test_world_size_one() -> None:
    assert run_distributed(_run_case, 1, args=(CASES[:5],))[0] >= 10


def _many_buckets(rank: int, world_size: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(40)])
    ddp = DDP(model, bucket_cap_mb=0.0005)
    state = APSState("e4m3", reduction="two_phase")
    log: list = []
    ddp.register_comm_hook(state, capture(state, log))
    n_buckets = 0
    for step in range(10):
        torch.manual_seed(step * 10 + rank)
        ddp.zero_grad()
        ddp(torch.randn(4, 16)).pow(2).sum().backward()
        n_buckets = max(n_buckets, len(log))
        check_log(log, get_format("e4m3"), "two_phase", "layer")
        log.clear()
    return n_buckets, step + 1


@pytest.mark.slow
def test_many_buckets_in_order() -> None:
    for n_buckets, steps in run_distributed(_many_buckets, 4, timeout=180):
        assert n_buckets >= 30 and steps == 10


def _bytes(rank: int, world_size: int) -> list:
    out = []
    for fmt, reduction in (("e4m3", "two_phase"), ("fp16", "allreduce"), ("e2m1", "two_phase")):
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.004)
        sizes: list[tuple[int, int]] = []

        def hook(st, bucket, sizes=sizes):
            sizes.append((bucket.buffer().numel(), len(bucket.parameters())))
            return aps_hook(st, bucket)

        state = APSState(fmt, reduction=reduction, stats=True)
        ddp.register_comm_hook(state, hook)
        ddp(torch.randn(8, 16)).sum().backward()
        out.append((fmt, sizes, state.bytes_sent, dict(state.bytes_detail), state.stats))
    return out


def test_bytes_on_the_wire() -> None:
    world_size = 4
    for fmt, sizes, sent, detail, stats in run_distributed(_bytes, world_size)[0]:
        n_layers = sum(n for _, n in sizes)
        # One float32 maximum per layer, and each bucket's chunk-size hint.
        assert detail["all_reduce_max"] == 4 * (n_layers + len(sizes))
        padded = [-(-numel // world_size) * world_size for numel, _ in sizes]
        if fmt == "e4m3":
            assert detail["all_to_all"] == sum(padded)  # one byte per element
            assert detail["all_gather"] == sum(padded) // world_size
        elif fmt == "fp16":
            assert detail["all_reduce"] == 2 * sum(numel for numel, _ in sizes)
        else:  # 4-bit: half a byte per element, shards padded to whole bytes
            per = [-(-numel // world_size) for numel, _ in sizes]
            assert detail["all_to_all"] == sum(world_size * ((p + p % 2) // 2) for p in per)
        assert sent == sum(v for k, v in detail.items() if k != "all_gather")
        assert len(stats) == n_layers
        assert {s.format for s in stats} == {fmt}
        assert sum(s.numel for s in stats) == sum(numel for numel, _ in sizes)


def _totals(rank: int, world_size: int) -> tuple:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    buckets: list[int] = []

    def hook(st, bucket):
        buckets.append(bucket.buffer().numel())
        return aps_hook(st, bucket)

    state = APSState("e4m3", reduction="two_phase")
    ddp.register_comm_hook(state, hook)
    ddp(torch.randn(8, 16)).sum().backward()
    layers = len(list(model.parameters()))
    return buckets, layers, state.bytes_sent, state.bytes_total


def test_bytes_total_counts_every_byte_handed_to_a_collective() -> None:
    for buckets, layers, sent, total in run_distributed(_totals, 2):
        assert len(buckets) == 1  # Net is one DDP bucket
        padded = -(-buckets[0] // 2) * 2  # two_phase's 2 shards
        maxima = 4 * (layers + 1)  # a float32 maximum per layer, and the chunk-size hint
        # e4m3: one byte per element into the all-to-all, this rank's shard into the all-gather.
        assert sent == maxima + padded
        assert total == maxima + padded + padded // 2


def _stats(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    state = register(ddp, fmt="e4m3", reduction="two_phase", stats=True)
    torch.manual_seed(rank)
    # Features spanning 12 decades: a.weight's gradient columns do too, more
    # than e4m3's range, so some elements underflow even after scaling.
    x = torch.randn(8, 16) * torch.logspace(0, -12, 16)
    ddp(x).pow(2).sum().backward()
    params = dict(model.named_parameters())
    checked = []
    for s in state.stats:
        raw_amax = gather(params[s.name].grad.abs().max().reshape(1)).max()
        # The hook's output is the average; the local input is gone, so
        # recompute the exponent rule from the records themselves.
        assert s.amax * 2.0**s.exponent <= 448 < s.amax * 2.0 ** (s.exponent + 1)
        checked.append((s.name, s.numel, s.format, s.saturated, s.underflow_rate, float(raw_amax)))
    return checked


def test_stats_records() -> None:
    records = run_distributed(_stats, 2)[0]
    names = {r[0] for r in records}
    assert names == {"a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"}
    assert sum(r[1] for r in records) == sum(p.numel() for p in Net().parameters())
    for _, _, fmt, saturated, underflow, _ in records:
        assert fmt == "e4m3" and saturated == 0
        assert 0.0 <= underflow <= 1.0
    # b's gradients span many binades: something underflows there.
    assert max(r[4] for r in records) > 0


def _mismatch(rank: int, world_size: int) -> None:
    model = Net()
    ddp = DDP(model)
    register(ddp, fmt="e4m3" if rank == 0 else "e5m2")
    ddp(torch.randn(2, 16)).sum().backward()


def test_configuration_mismatch_is_an_error_not_a_hang() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_mismatch, 2, timeout=60)
    msg = str(info.value)
    assert "configuration differs across ranks" in msg
    assert "rank 0 failed" in msg and "rank 1 failed" in msg
    assert "e4m3" in msg and "e5m2" in msg


def _fp8_native_on_gloo(rank: int, world_size: int) -> None:
    ddp = DDP(Net())
    register(ddp, fmt="e4m3", reduction="allreduce")
    ddp(torch.randn(2, 16)).sum().backward()


def test_fp8_native_allreduce_on_gloo_is_refused() -> None:
    with pytest.raises(DistributedTestError, match=r"(?s)cannot.*two_phase"):
        run_distributed(_fp8_native_on_gloo, 2, timeout=60)


def _sparse(rank: int, world_size: int) -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    ddp = DDP(emb)
    register(ddp, fmt="e4m3")
    ddp(torch.tensor([1, 2])).sum().backward()


def test_sparse_gradients_are_refused() -> None:
    with pytest.raises(DistributedTestError, match="sparse gradients"):
        run_distributed(_sparse, 2, timeout=60)


def test_bad_configuration_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="unknown number format 'e9m9x'"):
        APSState("e9m9x")
    with pytest.raises(ValueError, match="reduction must be one of"):
        APSState("e4m3", reduction="ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scaling must be one of"):
        APSState("e4m3", scaling="tensor")  # type: ignore[arg-type]


def test_state_before_init_process_group() -> None:
    assert not dist.is_initialized()
    state = APSState("e5m2", reduction="two_phase")
    assert state.process_group is None and state.reduction == "two_phase"


def _stats_on_one_rank(rank: int, world_size: int, route: str) -> list[list[int]]:
    grads = []
    for stats_rank in (None, 0):  # stats nowhere, then on rank 0 only
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.004)
        fmt = {"allreduce": "fp16", "two_phase": "e4m3", "block": "e2m1"}[route]
        scaling = "block" if route == "block" else "layer"
        reduction = "two_phase" if route == "block" else route
        register(ddp, fmt=fmt, reduction=reduction, scaling=scaling, stats=rank == stats_rank)
        run = []
        for step in range(4):  # from the third step on, settled buckets take their bound path
            torch.manual_seed(100 * step + rank)
            ddp.zero_grad()
            ddp(torch.randn(8, 16) * (rank + 1)).pow(2).sum().backward()
            run.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        grads.append(torch.cat(run).view(torch.int32).tolist())
    return grads


@pytest.mark.parametrize("route", ["two_phase", "allreduce", "block"])
def test_ranks_that_record_stats_and_ranks_that_do_not_agree(route: str) -> None:
    # Stats are a rank's own choice (a benchmark records on rank 0 only): a rank that
    # records and the others must issue the same collectives, on the full path and
    # settled, or the MAX all-reduce mixes maxima with something else.
    out = run_distributed(_stats_on_one_rank, 2, args=(route,), timeout=180)
    for grads in out:
        assert grads[0] == grads[1]  # stats on one rank change nothing
    assert out[0][1] == out[1][1]  # every rank holds the same gradients


def _checks_per_step(rank: int, world_size: int, dtype: torch.dtype) -> list[int]:
    import aps_comm.hook as hook_module

    calls: list[int] = []
    check = hook_module._check_bucket

    def counted(*args: object) -> None:
        calls.append(1)
        check(*args)  # type: ignore[arg-type]

    hook_module._check_bucket = counted  # type: ignore[assignment]
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]).to(dtype)
    ddp = DDP(model, bucket_cap_mb=0.001)
    register(ddp, "e4m3", reduction="two_phase")
    per_step = []
    for _ in range(5):
        before = len(calls)
        ddp(torch.ones(2, 8, dtype=dtype)).float().sum().backward()
        per_step.append(len(calls) - before)
    return per_step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_settled_bucket_checks_no_parameter_per_step(dtype: torch.dtype) -> None:
    """A settled bucket was checked when it was bound: its hook call does no work per
    parameter, whatever the gradients' dtype (a bfloat16 bucket is found settled through
    its float32 copy)."""
    per_step = run_distributed(_checks_per_step, 1, args=(dtype,), timeout=60)[0]
    assert per_step[0] > 0  # binding checks every bucket
    assert per_step[3:] == [0, 0], per_step
