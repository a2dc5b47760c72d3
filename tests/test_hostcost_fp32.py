"""A bucket on the FP32 route costs no more launches than PyTorch's ``allreduce_hook``.

"auto" sends buckets as the plain FP32 all-reduce on fast links (issue 46,
item 1): there the hook must be no dearer than the hook it replaces. Counts,
not times, at world size 1 on Gloo, as :mod:`benchmarks.hostcost` counts them.
"""

from __future__ import annotations

import pytest
import torch

import aps_comm
from benchmarks.hostcost import (
    CONFIGS,
    ParamLayer,
    allreduce_hook_bucket,
    count_calls,
    count_ops,
    world_of_one,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world() -> None:
    with world_of_one(CPU):
        yield


@pytest.mark.parametrize("layers", [2, 200])
def test_the_fp32_route_costs_no_more_ops_than_allreduce_hook(world: None, layers: int) -> None:
    numels = [64] * layers
    buffer = torch.randn(sum(numels))
    params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
    state = aps_comm.APSState(**CONFIGS["auto/fp32"])
    state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
    for _ in range(3):  # the plan, then the settled path, then one more
        state.run_bucket(0, buffer, params)
    assert state.bucket_reductions == {0: "fp32"}
    assert state.reducer is not None and state.reducer.steady_for(0, buffer) is not None
    aten, kernels = count_ops(state, buffer, params)
    aps = aten + kernels
    torch_aten, torch_kernels = count_calls(lambda: allreduce_hook_bucket(buffer), CPU)
    torch_ops = torch_aten + torch_kernels
    assert torch_ops == ["aten::div_.Tensor"]  # what allreduce_hook launches: one division
    assert len(aps) <= len(torch_ops), aps
