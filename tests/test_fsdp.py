"""The APS reduce-scatter on real FSDP2 (fully_shard), multi-rank on Gloo.

The model's gradients are chosen by the test: each parameter ``p`` enters the
loss as ``(p * g).sum()``, so rank r's unsharded gradient is exactly its own
``g`` (in the compute dtype). The reference is computed from every rank's
``g`` with the codec (encode with the agreed per-parameter power of two,
decode, FP32 sum in rank order), then cast and divided as FSDP does after a
reduce-scatter; the sharded gradients FSDP ends with must equal it bit for bit.
"""

import sys

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from aps_comm import codec
from aps_comm.formats import get_format
from aps_comm.fsdp import register
from aps_comm.policy import KeepLast, Promote
from aps_comm.scaling import block_amax, exponents, factors, pow2
from aps_comm.testing import run_distributed

# Parameter shapes per unit; dim 0 of several does not divide by 2 or 4 (padding).
_SHAPES = {"a": [(5, 3), (7,), (1,)], "b": [(33, 4), (2, 2, 3), (4,)], "root": [(3, 5)]}
# Gradient magnitudes per parameter: from far below e4m3's subnormals to 1e3.
_MAGS = [1e-6, 3.0, 1e3, 1e-4, 0.5, 0.0, 2e-2]


class _Leaf(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)

    def forward(self, gs: list[torch.Tensor | None]) -> torch.Tensor:
        # A None gradient leaves its parameter out of the loss: unused on this rank.
        return sum((p * g).sum() for p, g in zip(self.ps, gs, strict=True) if g is not None)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = _Leaf(_SHAPES["a"])
        self.b = _Leaf(_SHAPES["b"])
        self.c = nn.Parameter(torch.zeros(_SHAPES["root"][0]))

    def forward(self, ga: list, gb: list, gc: torch.Tensor) -> torch.Tensor:
        return self.a(ga) + self.b(gb) + (self.c * gc).sum()


def _shard(net: nn.Module, mp: MixedPrecisionPolicy, reshard: bool) -> nn.Module:
    fully_shard(net.a, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(net.b, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(net, mp_policy=mp, reshard_after_forward=reshard)
    return net


# The order of _grads: a's parameters, b's, then the root's.
_ORDER = [f"a.ps.{i}" for i in range(3)] + [f"b.ps.{i}" for i in range(3)] + ["c"]
_UNITS = [[0, 1, 2], [3, 4, 5], [6]]


def _grads(rank: int, step: int, nan: bool = False) -> list[torch.Tensor]:
    """Rank ``rank``'s chosen gradients, one per parameter in named_parameters order."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    shapes = _SHAPES["a"] + _SHAPES["b"] + _SHAPES["root"]
    out = []
    for i, s in enumerate(shapes):
        # Magnitudes differ per rank too, so the agreed maximum is not every rank's.
        g = torch.randn(s, generator=gen) * _MAGS[i % len(_MAGS)] * (1 + rank)
        out.append(g)
    if nan and rank == 1:
        out[3].view(-1)[5] = float("nan")  # b.ps.0 on rank 1 only
    return out


def _backward(net: nn.Module, gs: list[torch.Tensor]) -> None:
    net(gs[:3], gs[3:6], gs[6]).backward()


def _reference(
    all_gs: list[list[torch.Tensor]],
    fmt: str,
    scaling: str,
    compute: torch.dtype,
    reduce: torch.dtype,
    fp32_params: set[int] = frozenset(),  # type: ignore[assignment]
) -> list[torch.Tensor]:
    """What FSDP + APS must produce: per parameter, from every rank's gradient."""
    n = len(all_gs)
    xs = [[g.to(compute).to(reduce).float().reshape(-1) for g in gs] for gs in all_gs]
    amax = torch.stack([torch.stack([x.abs().max() for x in r]) for r in xs]).amax(0)
    amax = torch.where(torch.isnan(amax), float("inf"), amax)
    exps = torch.zeros(len(amax), dtype=torch.int32)
    f = get_format(fmt)
    # One exponent per parameter, or per FSDP unit ("bucket"); FP32 parameters are not scaled.
    for unit in _UNITS:
        idx = [i for i in unit if i not in fp32_params]
        if idx:
            exps[idx] = exponents(
                amax[idx], f, world_size=n, reduction="two_phase", scaling=scaling
            )
    out = []
    for i in range(len(amax)):
        fi = get_format("fp32") if i in fp32_params else f
        e = exps[i : i + 1]
        unscale = pow2(-e) if torch.isfinite(amax[i]) else torch.tensor([float("nan")])
        acc = None
        for r in range(n):
            x = xs[r][i]
            dec = codec.decode(codec.encode(x, fi, scale=pow2(e)), fi, x.numel(), scale=unscale)
            acc = dec if acc is None else acc + dec
        # FSDP: the sum lands in the reduce dtype, is divided there, then cast back.
        red = acc.to(reduce).div_(float(n)).to(torch.float32)
        out.append(red.reshape(all_gs[0][i].shape))
    return out


def _block_reference(
    all_gs: list[list[torch.Tensor]], fmt: str, compute: torch.dtype, reduce: torch.dtype
) -> list[torch.Tensor]:
    """Block scaling: blocks of 32 from the start of every rank's chunk (row) of a parameter.

    Each block's exponent comes from its maximum over the ranks (two_phase's
    rule); a non-finite block makes its whole parameter NaN.
    """
    n, f = len(all_gs), get_format(fmt)
    out = []
    for i, g0 in enumerate(all_gs[0]):
        rows = -(-g0.shape[0] // n) if g0.dim() else 1
        chunk = rows * (g0.numel() // max(g0.shape[0], 1) if g0.dim() else 1)
        padded = []
        for gs in all_gs:
            x = torch.zeros(n * chunk)
            x[: g0.numel()] = gs[i].to(compute).to(reduce).float().reshape(-1)
            padded.append(x)
        blocks = codec.Layout.from_numels([chunk] * n, torch.device("cpu")).grid(32)
        amax = torch.stack([block_amax(x, blocks) for x in padded]).amax(0)
        fs = factors(
            amax,
            f,
            "two_phase",
            world_size=n,
            scaling="block",
            counts=torch.tensor([blocks.n_blocks]),
        )
        acc = None
        for x in padded:
            enc = codec.encode(x, f, scale=fs.scale, layout=blocks.layout)
            dec = codec.decode(enc, f, x.numel(), scale=fs.unscale, layout=blocks.layout)
            acc = dec if acc is None else acc + dec
        red = acc.to(reduce).div_(float(n)).to(torch.float32)
        out.append(red[: g0.numel()].reshape(g0.shape))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _exact_case(
    rank: int,
    n: int,
    fmt: str,
    scaling: str,
    compute: torch.dtype | None,
    reduce: torch.dtype | None,
    reshard: bool,
    nan: bool,
    keep_last: bool,
) -> dict:
    torch.manual_seed(0)
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
    net = _shard(_Net(), mp, reshard)
    policy = [KeepLast("fp32")] if keep_last else None
    state = register(net, fmt, scaling=scaling, policy=policy)
    names = _ORDER
    # KeepLast: the parameters of the module that owns the last named parameter.
    last = list(net.named_parameters())[-1][0].rpartition(".")[0]
    fp32_params = {i for i, name in enumerate(names) if keep_last and name.startswith(last + ".")}
    assert not keep_last or len(fp32_params) == 3
    params = dict(net.named_parameters())
    results = {}
    for step in range(2):
        net.zero_grad()
        _backward(net, _grads(rank, step, nan))
        got = [params[name].grad.full_tensor() for name in names]
        everyone = [_grads(r, step, nan) for r in range(n)]
        c = compute or torch.float32
        if scaling == "block":
            want = _block_reference(everyone, fmt, c, reduce or c)
        else:
            want = _reference(everyone, fmt, scaling, c, reduce or c, fp32_params)
        for name, g, w in zip(names, got, want, strict=True):
            assert _same(g, w), (fmt, scaling, compute, reduce, step, name, (g - w).abs().max())
        results[step] = dict(state.bytes_detail)
    padded = sum(
        -(-s[0] // n) * n * (torch.Size(s).numel() // s[0]) for u in _SHAPES.values() for s in u
    )
    return {"bytes": results, "padded": padded, "step": state.step, "units": state.units}


def _exact(rank: int, n: int) -> list[dict]:
    bf16, fp32 = torch.bfloat16, torch.float32
    cases = [
        ("e4m3", "layer", None, None, True, False, False),
        ("e4m3", "layer", bf16, fp32, False, False, False),
        ("e4m3", "layer", bf16, bf16, True, False, False),
        ("e5m2", "bucket", None, bf16, False, False, False),
        ("e4m3", "none", None, None, True, False, False),
        ("e4m3", "layer", None, None, True, True, False),
        ("e3m2", "layer", None, None, False, False, True),
        ("e2m1", "block", None, None, True, True, False),
        ("e4m3", "block", bf16, fp32, False, False, False),
    ]
    return [_exact_case(rank, n, *case) for case in cases]


@pytest.mark.parametrize("world_size", [2, 4])
def test_equals_exact_reference(world_size: int) -> None:
    """Bit for bit the reference: formats, scalings, mixed precision, reshard either
    way, a NaN on one rank, a policy keeping the last layer in FP32; bytes counted."""
    out = run_distributed(_exact, world_size, timeout=240)
    for case in out[0]:
        assert case["step"] == 2
        assert case["units"] == ["", "a", "b"]
    e4m3 = out[0][0]
    n_params = sum(len(u) for u in _SHAPES.values())
    for step in (0, 1):
        # FP8: one byte per (padded) gradient element; 4 bytes per parameter and unit flag.
        assert e4m3["bytes"][step]["all_to_all"] == e4m3["padded"]
        assert e4m3["bytes"][step]["all_reduce_max"] == 4 * (n_params + 3)
    # Block scaling: one exponent byte per block of 32 of every row's chunk
    # (and the unit's flag byte), agreed in one MAX all-reduce per unit.
    n = world_size
    chunks = [-(-s[0] // n) * (torch.Size(s).numel() // s[0]) for u in _SHAPES.values() for s in u]
    blocks = sum(n * -(-c // 32) for c in chunks)
    assert out[0][7]["bytes"][0]["all_reduce_max"] == blocks + 3


def _avg_asked(rank: int, n: int) -> list[bool]:
    torch.manual_seed(0)
    net = _shard(_Net(), MixedPrecisionPolicy(), True)
    register(net, "e4m3")
    # A user who turns FSDP's plain sums back off: FSDP then asks the
    # reduce-scatter for ReduceOp.AVG and divides nothing itself.
    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(False)
    params = dict(net.named_parameters())
    _backward(net, _grads(rank, 0))
    got = [params[name].grad.full_tensor() for name in _ORDER]
    f32 = torch.float32
    want = _reference([_grads(r, 0) for r in range(n)], "e4m3", "layer", f32, f32)
    return [_same(g, w) for g, w in zip(got, want, strict=True)]


def test_reduce_op_avg_is_the_mean() -> None:
    """FSDP's ReduceOp.AVG (asked when sums are not forced) averages, bit for bit."""
    assert run_distributed(_avg_asked, 2, timeout=120) == [[True] * len(_ORDER)] * 2


def _accumulate(rank: int, n: int) -> bool:
    torch.manual_seed(0)
    net = _shard(_Net(), MixedPrecisionPolicy(), True)
    state = register(net, "e4m3")
    net.set_requires_gradient_sync(False)
    g0 = _grads(rank, 0)
    _backward(net, g0)
    assert state.step == 0 and state.bytes_sent == 0  # nothing reduced yet
    net.set_requires_gradient_sync(True)
    g1 = _grads(rank, 1)
    _backward(net, g1)
    assert state.step == 1
    # Autograd accumulates the two micro-batches in FP32 before the reduction.
    everyone = [[a + b for a, b in zip(_grads(r, 0), _grads(r, 1), strict=True)] for r in range(n)]
    want = _reference(everyone, "e4m3", "layer", torch.float32, torch.float32)
    params = dict(net.named_parameters())
    got = [params[name].grad.full_tensor() for name in _ORDER]
    return all(_same(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_accumulation(world_size: int) -> None:
    assert all(run_distributed(_accumulate, world_size, timeout=120))


def _train(rank: int, n: int, setup: str) -> tuple[float, float]:
    """A small MLP at large-network gradient magnitudes (loss x 2**-12): first and last loss."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=gen)
    y = x @ torch.randn(16, 1, generator=gen)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    fully_shard(net[0])
    fully_shard(net)
    if setup != "fp32":
        register(net, "e4m3", scaling="none" if setup == "naive" else "layer")
    scale = 2.0**-12
    opt = torch.optim.SGD(net.parameters(), lr=0.05 / scale)
    xs, ys = x[rank::n], y[rank::n]
    with torch.no_grad():
        first = float(nn.functional.mse_loss(net(x), y))
    for _ in range(30):
        opt.zero_grad()
        (nn.functional.mse_loss(net(xs), ys) * scale).backward()
        opt.step()
    with torch.no_grad():
        return first, float(nn.functional.mse_loss(net(x), y))


def _train_all(rank: int, n: int) -> dict:
    return {s: _train(rank, n, s) for s in ("fp32", "aps", "naive")}


def test_training_follows_fp32() -> None:
    """APS e4m3 trains like FP32 FSDP; the unscaled cast flushes these gradients to zero."""
    out = run_distributed(_train_all, 2, timeout=180)[0]
    first = out["fp32"][0]
    assert out["fp32"][1] < 0.2 * first, out
    assert abs(out["aps"][1] - out["fp32"][1]) < 0.05 * out["fp32"][1], out
    assert out["naive"][1] > 0.9 * first, out


def _errors(rank: int, n: int) -> dict:
    out = {}

    def attempt(key: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            fn()
            out[key] = "no error"
        except (ValueError, RuntimeError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    attempt(
        "promote",
        lambda: register(_shard(_Net(), MixedPrecisionPolicy(), True), policy=[Promote()]),
    )
    attempt("plain", lambda: register(_Net()))
    # A configuration that differs on one rank is an error on every rank.
    fmt = "e5m2" if rank == n - 1 else "e4m3"
    attempt("differs", lambda: register(_shard(_Net(), MixedPrecisionPolicy(), True), fmt))
    net = _shard(_Net(), MixedPrecisionPolicy(), True)
    register(net)
    attempt("twice", lambda: register(net))
    if n == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        hsdp = _Net()
        fully_shard(hsdp.a, mesh=mesh)
        fully_shard(hsdp, mesh=mesh)
        attempt("hsdp", lambda: register(hsdp))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_unsupported_is_an_error_on_every_rank(world_size: int) -> None:
    """Each error says its problem once, in the user's words, then briefly where (issue 45).

    The HSDP error was one clause per unit per rank, naming FSDP's internal
    mesh class: 3,519 characters for 7 units on 4 ranks.
    """
    out = run_distributed(_errors, world_size, timeout=120)
    for rank_out in out:
        assert "Promote" in rank_out["promote"]
        assert "no fully_shard-ed module" in rank_out["plain"]
        differs = rank_out["differs"]
        assert "differs across ranks: configuration: " in differs, differs
        # Only what differs: the units, the same on every rank, are not listed.
        assert "a.ps.0" not in differs and "unit 0" not in differs, differs
        assert differs.count("fmt=e5m2") == 1 and f"rank {world_size - 1}: " in differs, differs
        if world_size == 4:
            assert "ranks 0-2: fmt=e4m3" in differs, differs
        assert "already has a custom reduce-scatter" in rank_out["twice"]
        assert "aps_comm.fsdp.register was called on this model before" in rank_out["twice"]
        if world_size == 4:
            hsdp = rank_out["hsdp"]
            assert len(hsdp) < 600, hsdp
            assert "MeshInfo" not in hsdp and "rank " not in hsdp, hsdp
            assert hsdp.count("HSDP") == 1 and hsdp.count("cannot replace") == 1, hsdp
            # The recipe (issue 44): the 1-D shard mesh and replicate=.
            assert 'fully_shard(unit, mesh=mesh["shard"])' in hsdp, hsdp
            assert 'replicate=mesh["replicate"]' in hsdp, hsdp
            assert hsdp.endswith("(units: <root>, a)"), hsdp


def _old_torch(rank: int, n: int) -> str:
    from aps_comm import fsdp

    # As on a torch without FSDP2's custom reduce-scatter: its module cannot be imported.
    sys.modules["torch.distributed.fsdp._fully_shard._fsdp_api"] = None  # type: ignore[assignment]
    fsdp._fsdp_api.cache_clear()
    try:
        register(nn.Linear(2, 2))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_missing_private_api_is_a_clear_error() -> None:
    msg = run_distributed(_old_torch, 1)[0]
    assert "custom reduce-scatter API" in msg and torch.__version__ in msg


def test_register_needs_distributed() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.distributed initialised"):
        register(nn.Linear(2, 2))


def _peer_stalls(rank: int, n: int) -> str:
    import time

    # No resharding: backward all-gathers nothing, so its first collective is ours.
    net = _shard(_Net(), MixedPrecisionPolicy(), False)
    register(net)
    gs = _grads(rank, 0)
    loss = net(gs[:3], gs[3:6], gs[6])
    if rank == 1:
        time.sleep(5)  # past the group's 3 s timeout: rank 0 waits in the maxima all-reduce
        return "stalled"
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_stalled_peer_is_an_error_naming_the_collective() -> None:
    msg = run_distributed(_peer_stalls, 2, timeout=60, pg_timeout=3)[0]
    assert "aps_comm.fsdp, unit" in msg and "MAX all-reduce" in msg, msg


def test_perfmodel_fsdp_reduce_scatter() -> None:
    """The FSDP mode of the perf model: bytes and the relations between the setups."""
    from aps_perfmodel.cluster import custom_cluster
    from aps_perfmodel.fsdp import FSDPUnit, fsdp_step, padded_numel, reduce_scatter_time

    assert padded_numel([(5, 3), (7,), (1,)], 4) == 8 * 3 + 8 + 4
    c = custom_cluster(125e6, 50e-6, nodes=4, device="cpu")
    unit = FSDPUnit(2**22, 3)
    n, frac = 2**22, 3 / 4
    rs = {f: reduce_scatter_time(unit, f, c, "nccl") for f in ("fp32", "bf16", "e4m3")}
    assert rs["fp32"].wire_bytes == 4 * n * frac and rs["bf16"].wire_bytes == 2 * n * frac
    assert rs["e4m3"].wire_bytes == n * frac  # one byte per element, no all-gather
    assert rs["e4m3"].maxima_s > 0 and rs["fp32"].maxima_s == 0
    # Gloo emulates the reduce-scatter with an all-reduce: twice the traffic.
    gloo = reduce_scatter_time(unit, "fp32", c, "gloo")
    assert gloo.wire_bytes == 2 * rs["fp32"].wire_bytes and gloo.total_s > rs["fp32"].total_s
    assert reduce_scatter_time(unit, "e4m3", c, "gloo") == rs["e4m3"]
    steps = {f: fsdp_step([unit] * 2, f, c, backend="gloo") for f in ("fp32", "bf16", "e4m3")}
    assert steps["fp32"].all_gather_s == steps["e4m3"].all_gather_s > 0
    assert steps["fp32"].step_s > steps["bf16"].step_s > steps["e4m3"].step_s
    one = custom_cluster(125e6, 50e-6, nodes=1, device="cpu")
    assert fsdp_step([unit], "e4m3", one).step_s == 0.0
    with pytest.raises(ValueError, match="backend"):
        fsdp_step([unit], "e4m3", c, backend="mpi")


def test_demo_fsdp_hook_names() -> None:
    from aps_launch.demo import DEFAULT_FSDP_HOOKS, build_parser, resolve_hooks

    assert build_parser().parse_args(["--fsdp"]).fsdp
    assert resolve_hooks(None, fsdp=True) == list(DEFAULT_FSDP_HOOKS)
    assert resolve_hooks("bf16,aps-e3m2", fsdp=True) == ["bf16", "aps-e3m2"]
    with pytest.raises(ValueError, match="bf16"):
        resolve_hooks("bf16")  # DDP has no bf16 hook on CPU in the demo


def _unused(rank: int, n: int, fallback: bool) -> list[bool]:
    """b.ps.1 unused on rank 1 only, a.ps.2 on every rank: both reduce as zeros there."""
    import dataclasses

    from aps_comm import fsdp

    if fallback:
        # As on a torch without FSDPModule.set_reduce_scatter_unused_params (2.11).
        api = dataclasses.replace(fsdp._fsdp_api(), unused_params=False)
        fsdp._fsdp_api = lambda: api
    torch.manual_seed(0)
    net = _shard(_Net(), MixedPrecisionPolicy(), True)
    register(net, "e4m3")
    unused = {4: {1}, 2: set(range(n))}  # parameter index -> ranks that do not use it
    params = dict(net.named_parameters())
    ok = []
    for step in range(2):
        net.zero_grad()
        gs = _grads(rank, step)
        net(
            *[
                [None if rank in unused.get(i, ()) else gs[i] for i in unit]
                for unit in (_UNITS[0], _UNITS[1])
            ],
            gs[6],
        ).backward()
        everyone = [
            [
                torch.zeros_like(g) if r in unused.get(i, ()) else g
                for i, g in enumerate(_grads(r, step))
            ]
            for r in range(n)
        ]
        want = _reference(everyone, "e4m3", "layer", torch.float32, torch.float32)
        got = [params[name].grad for name in _ORDER]
        ok.append(
            all(g is not None and _same(g.full_tensor(), w) for g, w in zip(got, want, strict=True))
        )
    return ok


@pytest.mark.parametrize("fallback", [False, True], ids=["torch-flag", "zero-grad-fallback"])
def test_a_parameter_unused_on_some_ranks_reduces_as_zeros(fallback: bool) -> None:
    """Conditional control flow: a parameter without a gradient on a rank still takes its
    place in the unit's layout, as zeros, through torch's flag where it exists and through
    aps_comm.fsdp's own zero gradient where it does not (torch 2.11)."""
    assert run_distributed(_unused, 2, args=(fallback,), timeout=120) == [[True, True]] * 2


def _mismatch(rank: int, n: int) -> dict:
    """Rank 1 hands unit a's reduce-scatter an input that does not fit; rank 0 a good one."""
    import torch.distributed as dist

    from aps_comm import fsdp

    net = _shard(_Net(), MixedPrecisionPolicy(), True)
    register(net)
    comm = fsdp._param_groups(net.a)[0]._reduce_scatter_comm
    row = sum(-(-s[0] // n) * (torch.Size(s).numel() // s[0]) for s in _SHAPES["a"])
    out: dict = {}
    for step in range(2):
        good = torch.ones(n * row)
        given = good[:-1] if rank == 1 and step == 0 else good
        output = torch.empty(row)
        try:
            comm(output, given, None, dist.ReduceOp.SUM)
            out[step] = output.clone()
        except ValueError as exc:
            out[step] = str(exc)
            break  # a training loop stops at its error
    return out


def test_a_layout_mismatch_on_one_rank_is_an_error_on_every_rank() -> None:
    """No host read per unit: the rank whose input does not fit raises at once (after
    taking part in the unit's collectives); the others' unit comes back NaN and they
    raise when the next step starts."""
    good, bad = run_distributed(_mismatch, 2)
    assert "does not match the unit's parameters on this rank" in bad[0]
    assert torch.isnan(good[0]).all()
    assert "another rank's reduce-scatter input did not match" in good[1]
