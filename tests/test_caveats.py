"""Configurations that run but lose more than expected warn, once (aps_comm.caveats).

A format below 8 bits without block scaling (DDP, a DDP policy, FSDP2), and
float64 gradients that the hook reduces in float32.
"""

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import Net
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import ByName, fsdp, register
from aps_comm.testing import run_distributed


def _warned(make: object) -> list[str]:
    """The aps_comm warnings ``make()`` gives (every one, not Python's once per place)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()  # type: ignore[operator]
    return [str(w.message) for w in caught if str(w.message).startswith("aps_comm:")]


def _narrow(rank: int, world_size: int) -> dict[str, list[str]]:
    def ddp(fmt: str, **options: object) -> None:
        torch.manual_seed(0)
        net = DDP(Net())
        register(net, fmt, **options)  # type: ignore[arg-type]
        net(torch.randn(4, 16)).sum().backward()

    def sharded(fmt: str, scaling: str) -> None:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        fully_shard(net[0])
        fully_shard(net)
        fsdp.register(net, fmt, scaling=scaling)  # type: ignore[arg-type]
        net(torch.randn(4, 8)).sum().backward()

    # In this order: a format warned about once is not warned about again.
    cases = {
        "e4m3 layer": lambda: ddp("e4m3"),
        "e2m1 block": lambda: ddp("e2m1", scaling="block"),
        "e2m1 layer": lambda: ddp("e2m1"),
        "e2m1 bucket, again": lambda: ddp("e2m1", scaling="bucket"),
        "e4m3, policy e3m2": lambda: ddp("e4m3", policy=[ByName({"c.*": "e3m2"})]),
        "fsdp e2m3 block": lambda: sharded("e2m3", "block"),
        "fsdp e2m3 layer": lambda: sharded("e2m3", "layer"),
    }
    return {name: _warned(make) for name, make in cases.items()}


def test_a_narrow_format_without_block_scaling_warns_once() -> None:
    for seen in run_distributed(_narrow, 2):  # every rank warns
        assert seen["e4m3 layer"] == seen["e2m1 block"] == [], seen
        (e2m1,) = seen["e2m1 layer"]
        assert "e2m1 (4 bits) with scaling='layer'" in e2m1 and "scaling='block'" in e2m1
        assert seen["e2m1 bucket, again"] == [], seen
        (policy,) = seen["e4m3, policy e3m2"]  # the format the policy picks for c.*
        assert "e3m2 (6 bits) with scaling='layer'" in policy, policy
        assert seen["fsdp e2m3 block"] == [], seen
        (sharded,) = seen["fsdp e2m3 layer"]
        assert "e2m3 (6 bits) with scaling='layer'" in sharded, sharded


def _float64(rank: int, world_size: int, fmt: str) -> dict:
    torch.manual_seed(0)
    model = Net().double()
    local = Net().double()
    local.load_state_dict(model.state_dict())
    net = DDP(model)
    register(net, fmt, reduction="two_phase" if fmt != "fp32" else "auto")
    torch.manual_seed(1 + rank)
    xs = [torch.randn(4, 16, dtype=torch.float64) for _ in range(2)]

    def steps() -> None:
        for x in xs:
            net.zero_grad()
            net(x).sum().backward()

    messages = _warned(steps)
    local(xs[-1]).sum().backward()
    mine = torch.cat([p.grad.flatten() for p in local.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    exact = torch.stack(everyone).mean(0)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {
        "messages": messages,
        "dtype": got.dtype,
        "float32_values": torch.equal(got, got.float().double()),
        "error": float((got - exact).norm() / exact.norm()),
    }


def test_float64_gradients_are_reduced_in_float32_with_a_warning() -> None:
    for out in run_distributed(_float64, 2, args=("e4m3",)):
        (message,) = out["messages"]  # two steps, one warning
        assert "float64 gradients are reduced in float32" in message, message
        # Float64 tensors that hold float32 values, the average within e4m3's rounding.
        assert out["dtype"] == torch.float64 and out["float32_values"], out
        assert out["error"] < 0.1, out
    # fp32 is a plain all-reduce of the bucket as it is: float64, exact, no warning.
    for out in run_distributed(_float64, 2, args=("fp32",)):
        assert out["messages"] == [] and out["dtype"] == torch.float64, out
        assert not out["float32_values"] and out["error"] < 1e-15, out


def _fsdp_float64(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).double()
    fully_shard(net)
    fsdp.register(net, "e4m3")
    torch.manual_seed(1 + rank)
    messages = _warned(lambda: net(torch.randn(4, 8, dtype=torch.float64)).sum().backward())
    grads = [p.grad.to_local() for p in net.parameters()]
    return {
        "messages": messages,
        "dtypes": {g.dtype for g in grads},
        "float32_values": all(torch.equal(g, g.float().double()) for g in grads),
    }


def test_fsdp_float64_gradients_are_reduced_in_float32_with_a_warning() -> None:
    for out in run_distributed(_fsdp_float64, 2):
        (message,) = out["messages"]
        assert "float64 gradients are reduced in float32" in message, message
        assert out["dtypes"] == {torch.float64} and out["float32_values"], out
