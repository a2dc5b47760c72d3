"""Precision policies and error feedback: decisions, all-ranks agreement, mixed buckets,
checkpoints. (No ``from __future__ import annotations``: DDP checks hook annotations.)"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import APSState, aps_hook, register, simulate
from aps_comm.formats import BF16, E4M3, E5M2, FP16, FP32, get_format, quantize
from aps_comm.policy import (
    Assignment,
    ByName,
    KeepLast,
    LayerInfo,
    LowRatio,
    MinNumel,
    Promote,
    Schedule,
    static_formats,
)
from aps_comm.scaling import exponents, layer_amax, pow2
from aps_comm.testing import run_distributed


def _infos(sizes: dict[str, int]) -> list[LayerInfo]:
    return [
        LayerInfo(i, name, n, name.rpartition(".")[0]) for i, (name, n) in enumerate(sizes.items())
    ]


LAYERS = _infos(
    {
        "conv.weight": 4000,
        "conv.bias": 16,
        "norm.weight": 16,
        "fc1.weight": 10_000,
        "fc1.bias": 100,
        "head.weight": 1000,
        "head.bias": 10,
    }
)


def _names(formats) -> dict[str, str]:
    return {layer.name: f.name for layer, f in zip(LAYERS, formats, strict=True)}


def test_by_name_globs_first_match_wins() -> None:
    rule = ByName({"*.bias": "fp32", "conv.*": "e5m2", "*": "bf16"})
    got = _names(static_formats([rule], LAYERS, E4M3))
    assert got["conv.bias"] == "fp32" and got["conv.weight"] == "e5m2"
    assert got["fc1.weight"] == "bf16" and got["head.bias"] == "fp32"


def test_by_name_callable() -> None:
    rule = ByName(lambda name, p: "fp16" if name.startswith("fc1") else None)
    got = _names(static_formats([rule], LAYERS, E4M3))
    assert got == {**dict.fromkeys(got, "e4m3"), "fc1.weight": "fp16", "fc1.bias": "fp16"}


def test_keep_last_and_min_numel() -> None:
    got = _names(static_formats([KeepLast("fp32"), MinNumel(200)], LAYERS, E4M3))
    assert got == {
        "conv.weight": "e4m3",
        "conv.bias": "fp32",
        "norm.weight": "fp32",
        "fc1.weight": "e4m3",
        "fc1.bias": "fp32",
        "head.weight": "fp32",
        "head.bias": "fp32",
    }


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.6, 0.9, 0.99, 1.0])
def test_low_ratio_demotes_largest_first(ratio: float) -> None:
    formats = static_formats([LowRatio(ratio, high="fp16")], LAYERS, E4M3)
    total = sum(layer.numel for layer in LAYERS)
    low = [layer for layer, f in zip(LAYERS, formats, strict=True) if f == E4M3]
    low_elems = sum(layer.numel for layer in low)
    assert low_elems >= ratio * total
    # Minimal: dropping the smallest low layer would miss the target.
    if low:
        assert low_elems - min(layer.numel for layer in low) < ratio * total
    # Every low layer is at least as large as every high one.
    high = [layer for layer, f in zip(LAYERS, formats, strict=True) if f != E4M3]
    assert all(h.numel <= min(lo.numel for lo in low) for h in high) if low else True
    assert {f for f in formats} <= {E4M3, FP16}
    with pytest.raises(ValueError, match="ratio"):
        LowRatio(1.5)


def test_promote_step_says_whether_a_layer_moved() -> None:
    # A settled bucket looks its formats up only where a level moved.
    a = Assignment([Promote(gamma=1e-3, patience=2)], E4M3)
    a.bind({"w": LayerInfo(0, "w", 10, ""), "v": LayerInfo(1, "v", 10, "")})
    assert not a.promote_step(["w", "v"], [5e-4, 0.0])  # under gamma: stays
    assert a.promote_step(["w", "v"], [0.0, 2e-3])  # v moves up
    assert [f.name for f in a.formats(["w", "v"], step=0)] == ["e4m3", "e5m2"]
    assert not a.promote_step(["w", "v"], [0.0, 0.0])  # v calm for 1 step of 2
    assert a.promote_step(["w", "v"], [0.0, 0.0])  # and back down
    assert [f.name for f in a.formats(["w", "v"], step=0)] == ["e4m3", "e4m3"]


def test_promote_step_moves_a_bucket_as_each_layer_alone() -> None:
    # A bucket's step is one array step: the same moves as each layer's own step, with
    # float32 rates (the all-reduced slots) compared to gamma exactly, not rounded.
    rule = Promote(gamma=1e-3, patience=2, calm=0.1)
    a = Assignment([rule, MinNumel(5, fmt="fp32")], E4M3)
    names = [f"l{i}" for i in range(6)]  # l5 is under MinNumel: off the ladder
    a.bind({n: LayerInfo(i, n, 4 if n == "l5" else 10, "") for i, n in enumerate(names)})
    state = {n: (0, 0) for n in names[:5]}
    rates = np.float32([[1e-3, 2e-3, 0.0, 5e-5, 5e-4, 1.0], [0.0] * 6, [0.0] * 6, [1e-3] * 6])
    for row in rates:
        moved = a.promote_step(names, row)
        before = dict(state)
        for i, n in enumerate(names[:5]):
            state[n] = rule.step(*state[n], float(row[i]), base_level=0)
        assert a.promote == state
        assert moved == any(state[n][0] != before[n][0] for n in state)
        expected = [rule.ladder[state[n][0]].name for n in names[:5]]  # type: ignore[union-attr]
        assert [f.name for f in a.formats(names, step=0)] == [*expected, "fp32"]
    assert float(np.float32(1e-3)) > 1e-3 and state["l3"] == (1, 0)  # up by the last row
    with pytest.raises(ValueError, match="2 underflow rates for 6 layers"):
        a.promote_step(names, [0.0, 0.0])


def test_promote_step_of_a_bucket_sees_its_layers_moved_by_another_binding() -> None:
    # A bucket's keys and a format group's among them step the same layers: a bucket
    # quiet when it last stepped counts calm steps of a layer another binding moved up.
    a = Assignment([Promote(gamma=1e-3, patience=3)], E4M3)
    a.bind({"w": LayerInfo(0, "w", 10, ""), "v": LayerInfo(1, "v", 10, "")})
    assert not a.promote_step(["w", "v"], [0.0, 0.0])  # the whole bucket, quiet
    assert a.promote_step(["w"], [2e-3])  # w's group moves it up
    assert not a.promote_step(["w", "v"], [0.0, 0.0])  # the bucket again: w is calm once
    assert a.promote == {"w": (1, 1), "v": (0, 0)}


def test_promote_hysteresis() -> None:
    rule = Promote(gamma=1e-3, patience=3, calm=0.1)
    level, calm = 0, 0
    level, calm = rule.step(level, calm, 5e-3, base_level=0)
    assert (level, calm) == (1, 0)
    level, calm = rule.step(level, calm, 2e-3, base_level=0)
    assert (level, calm) == (2, 0)
    level, calm = rule.step(level, calm, 1.0, base_level=0)
    assert level == 2  # top of the ladder
    # Between calm*gamma and gamma: stays, counter resets (no flapping).
    for rate in (5e-5, 5e-5, 5e-4, 5e-5, 5e-5):
        level, calm = rule.step(level, calm, rate, base_level=0)
        assert level == 2
    level, calm = rule.step(level, calm, 0.0, base_level=0)
    assert (level, calm) == (1, 0)
    for _ in range(3):
        level, calm = rule.step(level, calm, 0.0, base_level=0)
    assert level == 0
    level, calm = rule.step(level, calm, 0.0, base_level=0)
    assert level == 0  # never below the static format
    assert rule.ladder == (E4M3, E5M2, FP16)


def test_schedule_override() -> None:
    rule = Schedule(steps=5, fmt="bf16")
    assert rule.override(0) == BF16 and rule.override(4) == BF16
    assert rule.override(5) is None


def test_policy_needs_the_model_and_valid_rules() -> None:
    with pytest.raises(TypeError, match="rules"):
        APSState("e4m3", policy=["fp32"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("policy", "named"),
    [
        # A string is iterable: it must not be read as rules "f", "p", "3", "2".
        ("fp32", "got 'fp32'"),
        (KeepLast("fp32"), "got the single rule KeepLast(fmt='fp32')"),
        (["fp32"], "got 'fp32' in policy=['fp32']"),
        (3, "got 3"),
    ],
)
def test_a_bad_policy_names_the_value_passed_and_a_correct_one(policy: object, named: str) -> None:
    with pytest.raises(TypeError) as caught:
        APSState("e4m3", policy=policy)  # type: ignore[arg-type]
    message = str(caught.value)
    assert named in message and "\n" not in message, message
    assert "policy=[KeepLast(" in message, message  # what a correct policy looks like


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.body(x)))))


def _capture(log: list):
    def hook(st: APSState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        raw = bucket.buffer().detach().clone()
        names = [st.param_names[id(p)] for p in bucket.parameters()]
        fut = aps_hook(st, bucket)

        def save(f: torch.futures.Future) -> torch.Tensor:
            log.append((raw, names, f.value().detach().clone()))
            return f.value()

        return fut.then(save)

    return hook


def _gather(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.stack(parts)


def _mixed(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    model = _Net()
    ddp = DDP(model)  # one bucket holding every format
    # "auto": e4m3 goes two_phase on Gloo, fp16 a native all-reduce.
    state = APSState(
        "e4m3",
        reduction="auto",
        stats=True,
        policy=[MinNumel(64, fmt="fp16"), KeepLast("fp32")],
    )
    state.bind_model(model)
    log: list = []
    ddp.register_comm_hook(state, _capture(log))
    torch.manual_seed(rank)
    ddp(torch.randn(8, 16)).pow(2).sum().backward()
    ((raw, names, out),) = log
    raws = _gather(raw)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    formats = {s.name: s.format for s in state.stats}
    offset, checked = 0, []
    for name in names:
        n = sizes[name]
        per_rank = raws[:, offset : offset + n]
        got = out[offset : offset + n]
        fmt = get_format(formats.get(name, "fp32"))
        if fmt == FP32:
            expected = per_rank[0] / world_size + per_rank[1] / world_size
        else:
            reduction = "two_phase" if fmt == E4M3 else "allreduce"
            amax = layer_amax([per_rank.reshape(-1)])
            e = exponents(amax, fmt, world_size=world_size, reduction=reduction)[0]
            q = quantize(per_rank * pow2(e), fmt)
            if reduction == "two_phase":
                expected = quantize((q[0] + q[1]) / world_size, fmt) * pow2(-e)
            else:
                expected = (q[0].half().float() + q[1].half().float()).half().float()
                expected = expected * (pow2(-e) / world_size)
        assert torch.equal(got, expected), name
        checked.append((name, fmt.name))
        offset += n
    return [checked, dict(state.bytes_detail)]


def test_mixed_format_bucket_is_exact_and_moves_the_promised_bytes() -> None:
    checked, detail = run_distributed(_mixed, 2)[0]
    fmts = dict(checked)
    assert fmts["head.weight"] == fmts["head.bias"] == "fp32"
    assert fmts["body.bias"] == fmts["mid.bias"] == "fp16"
    assert fmts["body.weight"] == fmts["mid.weight"] == "e4m3"
    low = 16 * 32 + 32 * 32  # e4m3 elements: one byte each, padded to 2 shards
    assert detail["all_to_all"] == low + low % 2
    # fp16 (native) and fp32 groups: 2 and 4 bytes per element.
    assert detail["all_reduce"] == 2 * (32 + 32) + 4 * (32 * 4 + 4)


def _promote(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    model = nn.Linear(64, 4)
    ddp = DDP(model)
    state = register(
        ddp,
        fmt="e4m3",
        reduction="two_phase",
        stats=True,
        policy=[Promote(gamma=1e-3, patience=2)],
    )
    seen = []
    for step in range(8):
        ddp.zero_grad()
        x = torch.ones(1, 64)
        if rank == 1 and step < 2:
            # Only rank 1 sees features spanning 40 binades: its gradient
            # underflows e4m3 after scaling; rank 0's does not.
            x = x * torch.logspace(0, -12, 64)
        ddp(x).sum().backward()
        seen.append(({s.name: s.format for s in state.stats}, dict(state.assignment.promote)))
    return seen


def test_promotion_is_decided_from_all_ranks_and_comes_back() -> None:
    ranks = run_distributed(_promote, 2)
    assert ranks[0] == ranks[1]  # same formats, same decisions everywhere
    formats = [f["weight"] for f, _ in ranks[0]]
    # Step t decides from step t-1's all-reduced rate: rank 1 underflows at
    # steps 0 and 1, so the weight climbs two rungs, then after `patience`
    # calm steps per rung it comes back down. The bias never underflows.
    assert formats == ["e4m3", "e5m2", "fp16", "fp16", "e5m2", "e5m2", "e4m3", "e4m3"]
    assert {f["bias"] for f, _ in ranks[0]} == {"e4m3"}


def _schedule(rank: int, world_size: int) -> list:
    model = nn.Linear(8, 2)
    ddp = DDP(model)
    state = register(ddp, fmt="e4m3", stats=True, policy=[Schedule(steps=2, fmt="fp32")])
    out = []
    for _ in range(4):
        ddp(torch.randn(2, 8)).sum().backward()
        out.append((state.step, sorted(state.bytes_detail)))
    return out


def test_schedule_fp32_then_fp8() -> None:
    steps = run_distributed(_schedule, 2)[0]
    # FP32 steps need no maxima: one plain all-reduce per bucket.
    assert steps[0] == (1, ["all_reduce"])
    assert steps[1] == (2, ["all_reduce"])
    assert steps[2] == (3, ["all_gather", "all_reduce_max", "all_to_all"])


def _feedback_error(rank: int, world_size: int, feedback: bool) -> float:
    """Error of the *sum over steps* of the communicated mean gradients."""
    torch.manual_seed(0)
    model = nn.Linear(32, 8, bias=False)
    ddp = DDP(model)
    register(ddp, fmt="e2m1", reduction="two_phase", error_feedback=feedback)
    total_comm = torch.zeros_like(model.weight)
    total_true = torch.zeros_like(model.weight)
    for step in range(20):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(4, 32)
        ddp.zero_grad()
        ddp(x).sum().backward()
        total_comm += model.weight.grad
        local = torch.ones(4, 8).T @ x  # d(sum(W x))/dW on this rank
        total_true += _gather(local).mean(0)
    return float((total_comm - total_true).norm() / total_true.norm())


def test_error_feedback_bounds_the_accumulated_error() -> None:
    without = run_distributed(_feedback_error, 2, args=(False,))[0]
    with_ef = run_distributed(_feedback_error, 2, args=(True,))[0]
    # 4-bit rounding errors add up without feedback; with it they telescope.
    assert with_ef < without / 3, (with_ef, without)


def _resume(rank: int, world_size: int, path: str) -> list:
    def build():
        torch.manual_seed(0)
        model = _Net()
        # DDP re-buckets after its first iteration (unless find_unused_parameters),
        # and the shard owners follow the buckets: a resume is bit-identical when
        # the layout matches the uninterrupted run's, as it does here.
        ddp = DDP(model, bucket_cap_mb=0.001, find_unused_parameters=True)
        state = register(
            ddp,
            fmt="e4m3",
            reduction="two_phase",
            error_feedback=True,
            policy=[Promote(gamma=1e-4, patience=2), MinNumel(40, fmt="e5m2")],
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        return model, ddp, state, opt

    def train(ddp, opt, steps):
        for step in steps:
            torch.manual_seed(1000 + 10 * step + rank)
            opt.zero_grad()
            ddp(torch.randn(8, 16) * torch.logspace(0, -6, 16)).pow(2).sum().backward()
            opt.step()

    model, ddp, state, opt = build()
    train(ddp, opt, range(6))
    straight = [p.detach().clone() for p in model.parameters()]

    model, ddp, state, opt = build()
    train(ddp, opt, range(3))
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "aps": state.state_dict()},
        f"{path}.{rank}",
    )
    saved = state.state_dict()
    assert saved["residuals"] and saved["step"] == 3

    model, ddp, state, opt = build()
    ckpt = torch.load(f"{path}.{rank}", weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["aps"])
    train(ddp, opt, range(3, 6))
    resumed = [p.detach().clone() for p in model.parameters()]
    return [bool(torch.equal(a, b)) for a, b in zip(straight, resumed, strict=True)]


def test_checkpoint_resume_is_bit_identical(tmp_path) -> None:
    for same in run_distributed(_resume, 2, args=(str(tmp_path / "ckpt"),)):
        assert all(same), same


def test_load_state_dict_rejects_another_configuration() -> None:
    a = APSState("e4m3", error_feedback=True)
    b = APSState("e5m2", error_feedback=True)
    with pytest.raises(ValueError, match="checkpoint was saved with"):
        b.load_state_dict(a.state_dict())


def _promote_grads(rank: int, world_size: int) -> list:
    """Each step's averaged gradients, Promote's levels, the bound paths' classes, and the
    gradients :mod:`aps_comm.simulate` gives every rank's own (gathered) in the formats
    Promote chose."""
    torch.manual_seed(0)
    model = nn.Linear(64, 4)
    ddp = DDP(model)
    policy = [Promote(gamma=1e-3, patience=2)]
    state = register(ddp, fmt="e4m3", reduction="two_phase", policy=policy)
    params = list(model.parameters())
    seen = []
    for step in range(10):
        ddp.zero_grad()
        x = torch.ones(1, 64) * (1.0 + rank)
        if rank == 1 and step in (3, 4):
            x = x * torch.logspace(0, -12, 64)  # only rank 1 underflows (see _promote)
        own = torch.autograd.grad(model(x).sum(), params)  # this rank's, before the hook
        layers = []
        for g in own:
            everyone = [torch.empty_like(g) for _ in range(world_size)]
            dist.all_gather(everyone, g)
            layers.append(torch.stack(everyone))
        ddp(x).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        fmts = state.assignment.formats([id(p) for p in params], step)  # Promote's
        sim = simulate.allreduce(layers, "e4m3", reduction="two_phase", formats=fmts)
        want = torch.cat([g.reshape(-1) for g in sim])
        reducer = state.reducer
        assert reducer is not None
        bound = [type(v).__name__ for v in reducer.steady.values()]
        seen.append(
            (
                grads.view(torch.int32).tolist(),
                dict(state.assignment.promote),
                bound,
                want.view(torch.int32).tolist(),
            )
        )
    return seen


def test_promote_settles_with_the_simulated_bits() -> None:
    """Issue 46: without stats a Promote bucket settles, is bound again as a level moves
    (only rank 1's rates move it), and gives :mod:`aps_comm.simulate`'s bits of every
    rank's gradients in the formats Promote chose."""
    settling = run_distributed(_promote_grads, 2)
    for rank in range(2):
        for step, seen in enumerate(settling[rank]):
            assert seen[0] == seen[3], (rank, step)  # the gradients, bit for bit
    bound = [seen[2] for seen in settling[0]]
    # Settled from step 1 (DDP re-buckets after step 0); step 3's rates move the weight
    # at step 4 on the settled path (the bias stays: mixed formats, bound again as
    # SteadyGroups) until the weight is back (step 8), where the bucket is bound again.
    assert bound[1:4] == [["Steady"]] * 3 and bound[4] == ["SteadyGroups"], bound
    assert bound[-1] == ["Steady"], bound
    assert max(seen[1]["weight"][0] for seen in settling[0]) == 2  # e4m3 -> e5m2 -> fp16
