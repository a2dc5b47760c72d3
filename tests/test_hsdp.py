"""HSDP: each unit sharded inside a node, its shard reduced across replicas by APS (issue 44).

Every test runs 4 Gloo ranks: 2 replicas x 2 shards, or 4 replicas of one
shard. The references are computed from every rank's gradients: native HSDP
on the 2-D mesh for FP32 (bit for bit), and :func:`aps_comm.simulate.allreduce`
over the replicas' reduce-scattered shards for the APS formats.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from aps_comm import simulate
from aps_comm.fsdp import register, tiling_problem
from aps_comm.testing import run_distributed

# Rows of dim 0 do not all divide by 2 (FSDP pads them).
_SHAPES = [(5, 3), (7,), (4, 6), (3, 2, 2)]
_MAGS = [1e-5, 3.0, 1e3, 0.25]


class _Leaf(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)

    def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.ps, gs, strict=True))


class _Net(nn.Module):
    """Two units: ``a`` (two parameters) and the root (``b``'s two)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = _Leaf(_SHAPES[:2])
        self.b = _Leaf(_SHAPES[2:])

    def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:
        return self.a(gs[:2]) + self.b(gs[2:])


def _grads(rank: int, step: int, nan: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    gs = [
        torch.randn(s, generator=gen) * m * (1 + rank) for s, m in zip(_SHAPES, _MAGS, strict=True)
    ]
    if nan and rank == 1:
        gs[2].view(-1)[3] = float("nan")
    return gs


def _sharded(mesh: object, mp: MixedPrecisionPolicy | None = None) -> _Net:
    net = _Net()
    kwargs = {"mesh": mesh, "mp_policy": mp or MixedPrecisionPolicy()}
    fully_shard(net.a, **kwargs)
    fully_shard(net, **kwargs)
    return net


def _local(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in net.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) for x, y in zip(a, b, strict=True))


def _native_fp32(rank: int, n: int) -> dict[str, bool]:
    """fmt="fp32": native HSDP's bits, whatever FSDP divides by and wherever the sum runs."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    cases = {
        "default": ({}, torch.float32, None),
        "aps reduce-scatter": ({"reduce_scatter": True}, torch.float32, None),
        "bf16 reduce_dtype": ({}, torch.bfloat16, None),
        "divide factor": ({}, torch.float32, 2.0),  # Gloo: no PREMUL_SUM
    }
    out = {}
    for name, (options, dtype, factor) in cases.items():
        mp = MixedPrecisionPolicy(reduce_dtype=dtype)
        native, aps = _sharded(mesh, mp), _sharded(mesh["shard"], mp)
        register(aps, "fp32", replicate=mesh["replicate"], **options)
        if factor is not None:
            for net in (native, aps):
                for unit in (net.a, net):
                    unit.set_gradient_divide_factor(factor)
        same = True
        for step in range(2):  # the second step runs the settled path
            gs = _grads(rank, step)
            for net in (native, aps):
                net.zero_grad()
                net(gs).backward()
            same = same and _same(_local(native), _local(aps))
        out[name] = same
    return out


def test_fp32_is_native_hsdp_bit_for_bit() -> None:
    out = run_distributed(_native_fp32, 4, timeout=240)
    expected = {"default", "aps reduce-scatter", "bf16 reduce_dtype", "divide factor"}
    for rank_out in out:
        assert set(rank_out) == expected and all(rank_out.values()), rank_out


def _overlapped(rank: int, n: int) -> dict[str, object]:
    """Where the reduction runs, and its bits against native HSDP's, per way of stepping."""
    import threading

    import aps_comm.fsdp as apsfsdp

    on_main: list[bool] = []
    reduce_shard = apsfsdp.reduce_shard

    def spy(*args: object, **kwargs: object) -> None:
        on_main.append(threading.current_thread() is threading.main_thread())
        reduce_shard(*args, **kwargs)  # type: ignore[arg-type]

    apsfsdp.reduce_shard = spy  # type: ignore[assignment]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    native, aps = _sharded(mesh), _sharded(mesh["shard"])
    register(aps, "fp32", replicate=mesh["replicate"])
    out: dict[str, object] = {}
    # Steps 0-1: fresh gradients (FSDP's output is the gradient: the worker
    # fills it beside backward); step 2 adds into step 1's (the hook must
    # finish first, on backward's thread).
    for step in range(3):
        on_main.clear()
        for net in (native, aps):
            if step < 2:
                net.zero_grad()
            net(_grads(rank, step)).backward()
        out[f"step {step} same"] = _same(_local(native), _local(aps))
        out[f"step {step} on main"] = list(on_main)

    # A failure on the worker is raised by backward() itself, naming the unit.
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    apsfsdp.reduce_shard = boom  # type: ignore[assignment]
    aps.zero_grad()
    try:
        aps(_grads(rank, 3)).backward()
        out["error"] = ""
    except RuntimeError as exc:
        out["error"] = str(exc)
    return out


def test_replica_reduction_runs_beside_backward_on_cpu() -> None:
    for out in run_distributed(_overlapped, 4, timeout=240):
        assert out["step 0 same"] and out["step 1 same"] and out["step 2 same"], out
        assert out["step 0 on main"] == out["step 1 on main"] == [False, False], out
        assert out["step 2 on main"] == [True, True], out
        assert out["error"] == "aps_comm.fsdp, unit 0 (<root>), all-reduce across replicas: boom", (
            out
        )


def _simulated(rank: int, n: int, replicas: int, cases: list[dict]) -> list[list[bool]]:
    """Each case's replica all-reduce bits are simulate's, from every replica's shard."""
    mesh = init_device_mesh("cpu", (replicas, n // replicas), mesh_dim_names=("replicate", "shard"))
    reps = dist.get_process_group_ranks(mesh["replicate"].get_group())
    out = []
    for options in cases:
        plain, aps = _sharded(mesh["shard"]), _sharded(mesh["shard"])
        state = register(aps, replicate=mesh["replicate"], **options)
        fmt = options.get("fmt", "e4m3")
        block = options.get("scaling") == "block"
        native = options.get("reduction") == "allreduce"
        ok = []
        for step in range(3):  # the plan, the settled path, a NaN through it
            gs = _grads(rank, step, nan=step == 2)
            for net in (plain, aps):
                net.zero_grad()
                net(gs).backward()
            # FSDP's own reduce-scatter (plain) gives each rank's shard before the replicas.
            shards: list = [None] * n
            dist.all_gather_object(shards, _local(plain))
            want = [
                simulate.allreduce(
                    [torch.stack([shards[r][i].reshape(-1) for r in reps])],
                    fmt,
                    reduction="ring" if native else "two_phase",
                    scaling=options.get("scaling", "layer"),
                    block_size=options.get("block_size"),
                    rank_exponents=block,
                )[0].reshape(g.shape)
                for i, g in enumerate(shards[rank])
            ]
            got = _local(aps)
            if step < 2:
                ok.append(_same(got, want))
            else:
                # One rank's NaN in b.ps.0 makes all of b.ps.0 NaN on every rank, as DDP
                # makes a layer NaN everywhere; the other parameters keep their bits.
                ok.append(_same(got[:2] + got[3:], want[:2] + want[3:]))
                ok.append(bool(torch.isnan(got[2]).all()))
                ok.append(all(bool(torch.isfinite(g).all()) for i, g in enumerate(got) if i != 2))
        ok.append(state.step == 3 and state.replica_bytes > 0)
        out.append(ok)
    return out


_CASES = {
    2: [
        {},
        {"fmt": "e2m1", "scaling": "block", "block_size": 8},
        {"fmt": "e5m2", "stats": True},
        {"fmt": "fp16", "reduction": "allreduce"},
    ],
    4: [{}],
}


@pytest.mark.parametrize("replicas", [2, 4], ids=["2x2", "4x1"])
def test_replica_reduction_is_simulate_bit_for_bit(replicas: int) -> None:
    """e4m3 (and at 2 x 2: e2m1 block, e5m2 with stats, FP16 summed by Gloo)."""
    out = run_distributed(_simulated, 4, args=(replicas, _CASES[replicas]), timeout=240)
    for rank_out in out:
        for options, ok in zip(_CASES[replicas], rank_out, strict=True):
            assert all(ok), (options, ok)


def _errors(rank: int, n: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}

    def attempt(key: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            fn()
            out[key] = "no error"
        except (ValueError, RuntimeError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    attempt("2-D mesh", lambda: register(_sharded(mesh)))
    attempt("2-D replicate", lambda: register(_sharded(mesh["shard"]), replicate=mesh))
    # Ranks 0 and 1 hold different shards of one shard group: not replicas.
    attempt("not replicas", lambda: register(_sharded(mesh["shard"]), replicate=mesh["shard"]))
    attempt(
        "one rank without",
        lambda: register(
            _sharded(mesh["shard"]), replicate=None if rank == 3 else mesh["replicate"]
        ),
    )
    attempt("flat shard mesh", lambda: register(_sharded(None), replicate=mesh["replicate"]))
    attempt(
        "reduction without replicate",
        lambda: register(_sharded(None), reduction="allreduce"),
    )
    return out


def test_unsupported_meshes_are_an_error_on_every_rank() -> None:
    out = run_distributed(_errors, 4, timeout=180)
    for rank_out in out:
        msg = rank_out["2-D mesh"]
        assert msg.startswith("ValueError: ") and "2-D mesh (native HSDP)" in msg, msg
        assert 'replicate=mesh["replicate"]' in msg and 'mesh=mesh["shard"]' in msg, msg
        assert "replicate= takes a 1-D DeviceMesh" in rank_out["2-D replicate"]
        assert "(2, 2)" in rank_out["2-D replicate"]
        msg = rank_out["not replicas"]
        assert "do not tile the world" in msg and "share ranks" in msg, msg
        msg = rank_out["one rank without"]
        assert "rank 3: the shard mesh is not all 4 ranks" in msg and "replicate=" in msg, msg
        assert "do not tile the world" in rank_out["flat shard mesh"]
        assert (
            "reduction='allreduce' chooses the all-reduce across replicas"
            in (rank_out["reduction without replicate"])
        )
    assert len({str(r) for r in out}) == 1  # every rank the same errors


class _L:
    def __init__(self, shard: tuple[int, ...], replicas: tuple[int, ...] | None) -> None:
        self.shard, self.replicas = shard, replicas


_GRID = [_L((0, 1), (0, 2)), _L((0, 1), (1, 3)), _L((2, 3), (0, 2)), _L((2, 3), (1, 3))]


@pytest.mark.parametrize(
    ("layouts", "problem"),
    [
        (_GRID, ""),
        (
            [_L((0, 1), (0, 3)), _L((0, 1), (1, 2)), _L((2, 3), (1, 2)), _L((2, 3), (0, 3))],
            "ranks 0 and 3 are replicas but hold different shards",
        ),
        (
            [*_GRID[:2], _L((2, 3), (0, 2, 3)), _GRID[3]],
            "the replica groups differ across ranks: rank 0 has [0, 2], rank 2 has [0, 2, 3]",
        ),
        (
            [_L((1, 0), (0, 2)), _L((1, 0), (1, 3)), *_GRID[2:]],
            "rank 0's shard group [1, 0] is not in ascending rank order",
        ),
        (
            [_GRID[0], _L((0, 1), None), _GRID[2], _L((2, 3), None)],
            "replicate= must be given on every rank (ranks 1, 3: not given)",
        ),
        (
            [_L((0, 1, 2, 3), (r,)) for r in range(3)] + [_L((0, 1, 2, 3), (3, 3))],
            "2 replicas of shard groups of 4 ranks do not make the world of 4 ranks",
        ),
    ],
    ids=["grid", "swapped", "differ", "unsorted", "missing", "size"],
)
def test_tiling_names_what_is_wrong(layouts: list[_L], problem: str) -> None:
    got = tiling_problem(layouts)
    if not problem:
        assert got == ""
    else:
        assert problem in got, got
        assert 'replicate=mesh["replicate"]' in got  # and the recipe
