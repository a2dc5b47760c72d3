"""Every FSDP2 unit a user can ask binds: the matrix (issue 46, items 1-2).

The FSDP counterpart of tests/test_settles.py: for every combination of the
scaling (block sizes too), ``stats``, the policy (one
format, FP32 beside it, two wire formats and FP32, every parameter in FP32,
``Schedule``) and the unit's shape (an even row, an odd one, a parameter with
no elements), the format families rotating (e2m1 for every odd row),
one unit is reduce-scattered as FSDP2 calls it in a world of one
(:func:`benchmarks.hostcost.fsdp_unit`; FSDP itself skips the collective
there). From its first call on it must be bound (``Reducer.steady_units``),
and a step must stay within the budget of tests/test_hostcost.py (15
kernel-launching ops, no host read) and keep its binding. Combinations that
do not bind yet are listed by :func:`_gap` and checked to stay unbound, so the
list is the true to-do list (a gap closed fails here until it is taken off).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from aps_comm.policy import ByName, Rule, Schedule
from benchmarks.hostcost import count_calls, forced_codec, fsdp_unit, world_of_one

CPU = torch.device("cpu")
BUDGET = 15  # tests/test_hostcost.py's

FAMILIES = ("e4m3", "fp16", "e2m1", "bf16")
SCALINGS: tuple[tuple[str, int | None], ...] = (
    ("layer", None),
    ("bucket", None),
    ("none", None),
    ("block", None),
    ("block", 16),
)
POLICIES: dict[str, Callable[[], list[Rule] | None]] = {
    "one": lambda: None,
    "fp32": lambda: [ByName({"ps.1": "fp32"})],
    # e5m2 is none of the families: always a second wire format.
    "two": lambda: [ByName({"ps.1": "e5m2", "ps.2": "fp32"})],
    "all_fp32": lambda: [ByName({"*": "fp32"})],
    # Step 0 every parameter in FP32, then the state's format: bound again.
    "schedule": lambda: [Schedule(steps=1)],
}
SHAPES: dict[str, list[int]] = {
    "even": [20, 6, 40, 12],
    # A row of 79 elements: a 4-bit row (or ps.0's run beside FP32) is odd.
    "odd": [21, 6, 40, 12],
    # A parameter with no elements (FSDP2 gives it a chunk of 0).
    "zero": [20, 0, 40, 12],
}


def _combinations() -> list[tuple[str, str, int | None, str, bool, str]]:
    product = itertools.product(SCALINGS, POLICIES, (False, True), SHAPES)
    return [
        # An odd row matters at 4 bits (its last byte half padding): e2m1 meets every
        # option there; elsewhere the families rotate, so the matrix stays cheap.
        ("e2m1" if shape == "odd" else FAMILIES[i % 4], scaling, size, policy, stats, shape)
        for i, ((scaling, size), policy, stats, shape) in enumerate(product)
    ]


def _ids(combo: tuple) -> str:
    fmt, scaling, size, policy, stats, shape = combo
    block = f"{scaling}{size}" if size else scaling
    return "-".join([fmt, block, policy, shape] + ["stats"] * stats)


def _gap(fmt: str, scaling: str, size: int | None, policy: str, stats: bool, shape: str) -> str:
    """Why this combination does not bind yet ("" where it does): the to-do list."""
    return ""


@pytest.fixture(scope="module")
def world() -> Any:
    with world_of_one(CPU):
        yield


@pytest.mark.filterwarnings("ignore::UserWarning")  # aps_comm.caveats' advice, not an error
@pytest.mark.parametrize("combo", _combinations(), ids=_ids)
def test_every_fsdp_unit_binds_within_the_budget(world: None, combo: tuple) -> None:
    fmt, scaling, size, policy, stats, shape = combo
    options: dict[str, Any] = {"fmt": fmt, "scaling": scaling, "stats": stats}
    if size is not None:
        options["block_size"] = size
    if POLICIES[policy]() is not None:
        options["policy"] = POLICIES[policy]()
    numels = SHAPES[shape]
    state, _, _ = fsdp_unit(numels, CPU, options, False)
    reducer, names = state.reducer, [f"ps.{i}" for i in range(len(numels))]
    gen = torch.Generator().manual_seed(len(_ids(combo)))
    x = torch.randn(1, sum(numels), generator=gen)
    flag = torch.zeros(())

    def reduce_scatter(step: int) -> torch.Tensor:
        # A new tensor every call, as FSDP hands one.
        return reducer.unit(0, x.clone(), numels, numels, names, step=step, problem=flag)

    bound = []
    for step in range(3):  # Schedule's step 0 in FP32, then its format: bound again at 1
        reduce_scatter(step)
        reducer.end_step()
        bound.append(reducer.steady_units.get(0))
    gap = _gap(*combo)
    if gap:
        assert bound == [None] * 3, f"a gap closed, take it off _gap: {gap}"
        return
    assert None not in bound, f"not bound: {bound}"
    assert bound[1] is bound[2], "bound again without a change of layout or epoch"
    aten, kernels = count_calls(lambda: reduce_scatter(2), CPU)
    assert reducer.steady_units.get(0) is bound[2], "bound again"
    assert not any("_local_scalar_dense" in op for op in aten), aten  # no host read
    # The clone is the test's, standing in for FSDP's new tensor every step.
    assert len(aten) - 1 + len(kernels) <= BUDGET, (aten, kernels)
    records = reducer.end_step()[1].records()
    assert len(records) == (len(numels) if stats else 0), records


def _torch_combinations() -> list[tuple[str, str, int | None, str, bool, str, str]]:
    """Every scaling and policy on the torch codec backends, the format, shape, records
    and backend rotating (the kernels' matrix above covers their product)."""
    product = itertools.product(SCALINGS, POLICIES)
    return [
        (FAMILIES[i % 4], scaling, size, policy, i % 3 != 0, list(SHAPES)[i % 3], kind)
        for i, ((scaling, size), policy) in enumerate(product)
        for kind in [("cast", "bits")[i % 2]]
    ]


@pytest.mark.filterwarnings("ignore::UserWarning")  # aps_comm.caveats' advice, not an error
@pytest.mark.parametrize("combo", _torch_combinations(), ids=lambda c: "-".join(map(str, c)))
def test_every_fsdp_unit_binds_on_the_torch_codec_backends(world: None, combo: tuple) -> None:
    """Issue 46: the same units on "cast"/"bits" (CUDA without Triton, custom formats)
    bind from their first call and stay bound, with no host read, and give the CPU
    kernels' bound unit's output and records bit for bit, a NaN included (op counts
    are not the kernels' budget there: a kernel call becomes a few torch ops)."""
    fmt, scaling, size, policy, stats, shape, kind = combo
    options: dict[str, Any] = {"fmt": fmt, "scaling": scaling, "stats": stats}
    if size is not None:
        options["block_size"] = size
    numels, names = SHAPES[shape], [f"ps.{i}" for i in range(len(SHAPES[shape]))]
    gen = torch.Generator().manual_seed(sum(map(ord, str(combo))))
    xs = [torch.randn(1, sum(numels), generator=gen) for _ in range(3)]
    xs[2][0, 3] = float("nan")  # a NaN in ps.0 at step 2
    got: list[list[Any]] = []
    for forced in (kind, None):
        policy_rules = POLICIES[policy]()
        with forced_codec(forced):
            state, _, _ = fsdp_unit(numels, CPU, {**options, "policy": policy_rules}, False)
            reducer, flag, steps = state.reducer, torch.zeros(()), []
            for step, x in enumerate(xs):
                out = reducer.unit(0, x.clone(), numels, numels, names, step=step, problem=flag)
                steps.append((out, reducer.end_step()[1].records(), reducer.steady_units.get(0)))
            if forced is not None:
                again = functools.partial(reducer.unit, 0, xs[0], numels, numels, names)
                aten, _ = count_calls(functools.partial(again, step=2, problem=flag), CPU)
                assert not any("_local_scalar_dense" in op for op in aten), aten  # no host read
                assert reducer.steady_units.get(0) is steps[2][2], "bound again"
        got.append(steps)
    for step, ((out, records, bound), (want, want_records, _)) in enumerate(zip(*got, strict=True)):
        assert bound is not None, f"step {step}: not bound"
        nan = out.isnan()
        assert torch.equal(nan, want.isnan()), step
        assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32)), step
        assert records == want_records, step
    assert got[0][1][2] is got[0][2][2], "bound again without a change of layout or epoch"


@pytest.mark.parametrize("bad", ["float64", "strided"])
def test_a_unit_refuses_rows_it_could_not_bind(world: None, bad: str) -> None:
    """aps_comm.fsdp hands contiguous float32 rows; anything else is an error naming it, not
    a silent fall back to a per-step path."""
    numels = SHAPES["even"]
    state, _, _ = fsdp_unit(numels, CPU, {"fmt": "e4m3"}, False)
    rows = torch.zeros(1, 2 * sum(numels))
    rows = rows.double()[:, : sum(numels)] if bad == "float64" else rows[:, ::2]
    names = [f"ps.{i}" for i in range(len(numels))]
    with pytest.raises(ValueError, match=r"contiguous float32, got torch\.float"):
        state.reducer.unit(0, rows, numels, numels, names, step=0, problem=torch.zeros(()))
