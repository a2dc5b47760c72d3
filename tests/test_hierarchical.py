"""Hierarchical two_phase: topology, exactness against aps_comm.simulate, bytes, errors.

Four Gloo ranks play two nodes of two ranks. Every bucket the hook returns is
compared bit for bit with :func:`aps_comm.simulate.allreduce` (``reduction=
"hierarchical"``) computed from every rank's raw bucket, and must be
identical on every rank.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import Net, capture, gather
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import APSState, register, simulate
from aps_comm.formats import get_format, payload_nbytes
from aps_comm.policy import Promote
from aps_comm.testing import DistributedTestError, run_distributed
from aps_comm.topology import Topology, check_topology, env_ranks_per_node
from benchmarks import numerics
from benchmarks.hostcost import count_ops

# ---------------------------------------------------------------------------
# topology


def test_topology_layout_and_errors() -> None:
    t = Topology(world_size=6, ranks_per_node=3)
    assert (t.nodes, t.node_ranks(1), t.peer_ranks(2)) == (2, [3, 4, 5], [2, 5])
    with pytest.raises(
        ValueError, match="ranks_per_node=4 must be >= 1 and divide the world size 6"
    ):
        Topology(6, 4)
    assert env_ranks_per_node({}) is None
    assert env_ranks_per_node({"LOCAL_WORLD_SIZE": "8"}) == 8
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be a positive integer, got 'x'"):
        env_ranks_per_node({"LOCAL_WORLD_SIZE": "x"})


def test_check_topology_names_what_every_rank_saw() -> None:
    assert check_topology([(2, 0), (2, 1), (2, 0), (2, 1)], 4) == Topology(4, 2)
    assert check_topology([(2, None)] * 4, 4).nodes == 2
    with pytest.raises(ValueError, match=r"disagree.*rank 3: ranks_per_node=4"):
        check_topology([(2, 0), (2, 1), (2, 0), (4, 3)], 4)
    with pytest.raises(ValueError, match=r"ranks_per_node=3 must .* divide the world size 4"):
        check_topology([(3, None)] * 4, 4)
    with pytest.raises(ValueError, match=r"rank modulo 2 on ranks 1-2 \(rank 1: LOCAL_RANK=0; "):
        check_topology([(2, 0), (2, 0), (2, 1), (2, 1)], 4)


# ---------------------------------------------------------------------------
# the simulator's hierarchical order


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "bf16"])
def test_simulated_hierarchy_of_one_rank_per_node_is_two_phase(fmt: str) -> None:
    torch.manual_seed(0)
    layers = [torch.randn(4, 30) * 1e-3, torch.randn(4, 7) * 50.0]
    flat = simulate.allreduce(layers, fmt, reduction="two_phase")
    one = simulate.allreduce(layers, fmt, reduction="hierarchical", ranks_per_node=1)
    for a, b in zip(flat, one, strict=True):
        assert torch.equal(a, b)


def test_simulated_hierarchy_sums_nodes_in_fp32_before_rounding() -> None:
    # Node 0 holds +x and -x: their FP32 sum is exactly zero, so only node 1's
    # value survives; flat two_phase rounds +x and -x first (same zero here),
    # but a value below the format's resolution survives only in the node sum.
    g = torch.tensor([[1.0], [1.0 / 64], [0.0], [0.0]])
    [flat] = simulate.allreduce([g], "e4m3", reduction="two_phase")
    [hier] = simulate.allreduce([g], "e4m3", reduction="hierarchical", ranks_per_node=2)
    exact = g.mean(0)
    assert abs(float(hier - exact)) <= abs(float(flat - exact))
    with pytest.raises(ValueError, match="ranks_per_node=3 must divide the number of workers 4"):
        simulate.allreduce([g], "e4m3", reduction="hierarchical", ranks_per_node=3)


# ---------------------------------------------------------------------------
# the hook on 4 ranks as 2 nodes x 2


CASES = [
    ("e4m3", "layer"),
    ("e2m1", "layer"),
    ("e5m2", "bucket"),
    ("bf16", "layer"),
    ("e2m1", "block"),
    ("e4m3", "block"),
    ("fp16", "block"),  # 16 bits: the CPU kernels' fused calls too (two bytes a code)
]


def _hier_case(rank: int, world_size: int, chunk: int | None, via_env: bool, reduction: str) -> int:
    if via_env:
        os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))
    checked = 0
    for fmt_spec, scaling in CASES:
        fmt = get_format(fmt_spec)
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.004)
        state = APSState(
            fmt,
            reduction=reduction,
            scaling=scaling,
            ranks_per_node=None if via_env else 2,
        )
        state.bind_process_group()
        state.chunk_elements = chunk
        groups = state.grid if reduction == "grid" else state.nodes
        assert groups is not None and groups.topology == Topology(4, 2)
        log: list = []
        ddp.register_comm_hook(state, capture(state, log))
        for step in range(2):
            torch.manual_seed(1000 * step + rank)
            poison = step == 1 and fmt_spec == "e4m3"
            if poison and rank == 1:  # a NaN gradient in one layer of one rank
                handle = model.c.bias.register_hook(lambda g: torch.full_like(g, float("nan")))
            ddp.zero_grad()
            ddp(torch.randn(8, 16) * (rank + 1)).pow(2).sum().backward()
            if poison and rank == 1:
                handle.remove()
            for index, raw, numels, out in sorted(log, key=lambda item: item[0]):
                raws = gather(raw)
                layers = list(torch.split(raws, numels, dim=1))
                expected = torch.cat(
                    simulate.allreduce(
                        layers,
                        fmt,
                        reduction=reduction,
                        scaling=scaling,
                        ranks_per_node=2,
                        # Block scaling: every level's owner uses its own exponents
                        # and keeps its own values, on the hook's shards.
                        rank_exponents=scaling == "block",
                        chunk_elements=state.bucket_chunks[index] if scaling == "block" else None,
                    )
                )
                assert torch.equal(out.nan_to_num(nan=7.0), expected.nan_to_num(nan=7.0)), (
                    f"{fmt_spec} bucket mismatch, max diff {(out - expected).abs().nan_to_num().max()}"
                )
                outs = gather(out)
                assert torch.equal(outs.nan_to_num(7.0), outs[:1].expand_as(outs).nan_to_num(7.0))
                checked += 1
            if poison:  # NaN in that layer on every rank, nothing else touched
                assert torch.isnan(model.c.bias.grad).all()
                assert torch.isfinite(model.a.weight.grad).all()
            log.clear()
        assert state.reduction == reduction
    return checked


@pytest.mark.slow
@pytest.mark.parametrize(
    ("chunk", "via_env", "reduction"),
    [
        (None, False, "hierarchical"),
        (37, True, "hierarchical"),
        (None, False, "grid"),
        (37, False, "grid"),
    ],
)
def test_hierarchical_and_grid_match_simulate_bit_for_bit(
    chunk: int | None, via_env: bool, reduction: str
) -> None:
    # Buckets of ~1000 elements; chunks of 37 give ragged slices and shards.
    checked = run_distributed(_hier_case, 4, args=(chunk, via_env, reduction), timeout=240)
    assert all(c >= 2 * len(CASES) for c in checked)


def _bytes_case(rank: int, world_size: int, reduction: str) -> dict[str, int]:
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)  # one bucket of 4096 elements
    ddp = DDP(model, bucket_cap_mb=100)
    state = register(ddp, "e4m3", reduction=reduction, ranks_per_node=2)
    torch.manual_seed(rank)
    ddp(torch.randn(4, 64)).sum().backward()
    ddp(torch.randn(4, 64)).sum().backward()
    return state.bytes_detail


@pytest.mark.parametrize("reduction", ["hierarchical", "grid"])
def test_only_the_wire_format_crosses_nodes(reduction: str) -> None:
    for detail in run_distributed(_bytes_case, 4, args=(reduction,), timeout=120):
        # Each rank owns half the bucket in its node and sends it across nodes
        # in FP8: one byte per element per node, split over the node's 2 ranks.
        assert detail["all_to_all"] == payload_nbytes(4096 // 2, get_format("e4m3"))
        assert detail["all_gather"] == 4096 // 2 // 2
        # The first level: FP32 inside a node, FP8 between the grid's rows.
        assert detail["node_all_to_all"] == 4096 * (1 if reduction == "grid" else 4)
        assert detail["node_all_gather"] == 4096 // 2


def _single_node(rank: int, world_size: int, per_node: int) -> bool:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = APSState("e4m3", reduction="hierarchical", ranks_per_node=per_node)
    log: list = []
    ddp.register_comm_hook(state, capture(state, log))
    torch.manual_seed(rank)
    ddp(torch.randn(8, 16)).pow(2).sum().backward()
    for _, raw, numels, out in log:
        layers = list(torch.split(gather(raw), numels, dim=1))
        expected = torch.cat(
            simulate.allreduce(layers, "e4m3", reduction="hierarchical", ranks_per_node=per_node)
        )
        assert torch.equal(out, expected)
    return True


@pytest.mark.parametrize("per_node", [1, 2])
def test_one_node_and_one_rank_per_node_are_exact(per_node: int) -> None:
    assert all(run_distributed(_single_node, 2, args=(per_node,), timeout=120))


def _mismatched(rank: int, world_size: int) -> str:
    os.environ.update(LOCAL_WORLD_SIZE="4" if rank == 3 else "2", LOCAL_RANK=str(rank % 2))
    try:
        APSState("e4m3", reduction="hierarchical").bind_process_group()
    except ValueError as exc:
        return str(exc)
    return ""


def test_mismatched_topology_is_an_error_on_every_rank() -> None:
    errors = run_distributed(_mismatched, 4, timeout=120)
    for msg in errors:
        assert "disagree on the ranks per node" in msg and "rank 3: ranks_per_node=4" in msg
        # Ranks that saw the same are named once together, not one clause per rank (issue 45).
        assert "ranks 0-2: ranks_per_node=2" in msg and msg.count("ranks_per_node=") == 2, msg


def test_grid_rows_and_simulated_grid_errors() -> None:
    from aps_comm.topology import grid_rows

    assert [grid_rows(n) for n in (1, 2, 3, 4, 6, 7, 8, 12, 64, 1024)] == [
        1,
        1,
        1,
        2,
        2,
        1,
        2,
        3,
        8,
        32,
    ]
    with pytest.raises(ValueError, match="7 workers have no grid"):
        simulate.allreduce([torch.ones(7, 3)], "e4m3", reduction="grid")
    with pytest.raises(DistributedTestError, match="the world size 2 has no such divisor"):
        run_distributed(_grid_of_two, 2, timeout=60)


def _grid_of_two(rank: int, world_size: int) -> None:
    APSState("e4m3", reduction="grid").bind_process_group()


def test_bad_arguments_are_errors() -> None:
    for reduction in ("hierarchical", "grid"):
        with pytest.raises(ValueError, match=f"not supported with reduction='{reduction}'"):
            APSState("e4m3", reduction=reduction, error_feedback=True)
    with pytest.raises(ValueError, match="ranks_per_node must be a positive integer, got 0"):
        APSState("e4m3", ranks_per_node=0)
    with pytest.raises(DistributedTestError, match=r"must .* divide the world size 2"):
        run_distributed(_bad_per_node, 2, timeout=60)


def _bad_per_node(rank: int, world_size: int) -> None:
    APSState("e4m3", reduction="hierarchical", ranks_per_node=3).bind_process_group()
    dist.barrier()


# ---------------------------------------------------------------------------
# block scaling: every level's owner keeps its own exponents


def _blocks_8(rank: int, world_size: int) -> int:
    from aps_comm.engine import Reducer, SteadyNodeBlocks

    checked = 0
    settled: list[int] = []
    run_steady = Reducer.run_steady

    def counted(self: Reducer, index: int, st: object, *args: object, **kw: object) -> object:
        settled.append(isinstance(st, SteadyNodeBlocks))
        return run_steady(self, index, st, *args, **kw)  # type: ignore[arg-type]

    Reducer.run_steady = counted  # type: ignore[method-assign]
    for reduction, fmt in [("hierarchical", "e2m1"), ("grid", "e4m3")]:
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.004)
        state = APSState(fmt, reduction=reduction, scaling="block", block_size=16, ranks_per_node=4)
        state.bind_process_group()
        log: list = []
        ddp.register_comm_hook(state, capture(state, log))
        # A third step takes the settled path (SteadyNodeBlocks) of the buckets DDP
        # rebuilt after step 0; the NaN comes in it.
        for step in range(3):
            torch.manual_seed(1000 * step + rank)
            handle = None
            if step == 2 and rank == 5:  # a NaN gradient in one layer of one rank
                handle = model.c.bias.register_hook(lambda g: torch.full_like(g, float("nan")))
            settled.clear()
            ddp.zero_grad()
            ddp(torch.randn(8, 16) * (rank + 1)).pow(2).sum().backward()
            if handle is not None:
                handle.remove()
            for index, raw, numels, out in log:
                layers = list(torch.split(gather(raw), numels, dim=1))
                expected = torch.cat(
                    simulate.allreduce(
                        layers,
                        fmt,
                        reduction=reduction,
                        scaling="block",
                        block_size=16,
                        ranks_per_node=4,
                        rank_exponents=True,
                        chunk_elements=state.bucket_chunks[index],
                    )
                )
                assert torch.equal(out.nan_to_num(7.0), expected.nan_to_num(7.0)), reduction
                checked += 1
            log.clear()
        assert settled and all(settled), (reduction, settled)  # the last step: every bucket
        assert torch.isnan(model.c.bias.grad).all()
        assert torch.isfinite(model.a.weight.grad).all()
    Reducer.run_steady = run_steady  # type: ignore[method-assign]
    return checked


def test_block_owner_exponents_on_8_ranks_match_simulate() -> None:
    # Two nodes of 4 (hierarchical) and grid_rows(8) = 2 rows of 4 (grid), 3 steps each.
    assert all(c >= 6 for c in run_distributed(_blocks_8, 8, timeout=300))


@pytest.mark.parametrize("reduction", ["hierarchical", "grid"])
def test_owner_exponents_beat_agreed_ones_at_every_level(reduction: str) -> None:
    # Workers whose gradients differ in scale by 2**10: the agreed exponent
    # follows the largest, so the node sums and means of the others flush.
    gen = torch.Generator().manual_seed(0)
    n = 32
    g = torch.randn(n, 2048, generator=gen) * 2.0 ** -torch.randint(0, 10, (n, 1), generator=gen)
    exact = g.double().mean(0)

    def error(fmt: str, rank_exponents: bool) -> float:
        [avg] = simulate.allreduce(
            [g],
            fmt,
            reduction=reduction,
            scaling="block",
            block_size=32,
            ranks_per_node=8,
            rank_exponents=rank_exponents,
        )
        return float((avg.double() - exact).norm() / exact.norm())

    [flat] = simulate.allreduce([g], "e2m1", scaling="block", block_size=32, rank_exponents=True)
    two_phase = float((flat.double() - exact).norm() / exact.norm())
    assert error("e2m1", True) < 0.5 * error("e2m1", False)
    # Hierarchical rounds twice, as two_phase does; grid's first level once more.
    assert error("e2m1", True) < (1.1 if reduction == "hierarchical" else 1.4) * two_phase
    # e4m3's range holds the agreed variant's means too: no worse with the owners'.
    assert error("e4m3", True) <= 1.01 * error("e4m3", False)


# Per chunk: grid's first encode (send_rank_blocks) and its node's mean
# (mean_rank_blocks); the node's mean (hierarchical's), its keys and its pieces in one
# call (node_send; 4 calls before); the owner's step and the decode; no ATen op.
PER_CHUNK = {"hierarchical": 3, "grid": 5}


def _ops_case(rank: int, world_size: int) -> dict[tuple[str, int, int | None], list[str]]:
    ops = {}
    for reduction, fmt in [("hierarchical", "e2m1"), ("grid", "e4m3")]:
        for numels in ([1000, 1000], [40] * 50):  # 2000 elements: 2 layers or 50
            for chunk in (None, 512):  # one chunk or four
                state = APSState(
                    fmt, reduction=reduction, scaling="block", block_size=16, ranks_per_node=2
                )
                state.bind_process_group()
                state.chunk_elements = chunk
                x = torch.randn(sum(numels), generator=torch.Generator().manual_seed(rank))
                params = [nn.Parameter(torch.empty(n)) for n in numels]
                for _ in range(2):  # the plan, then its kernels bound
                    state.run_bucket(0, x.clone(), params)
                buffer = x.clone()
                state.run_bucket(0, buffer, params)  # a new buffer: bound once more
                aten, kernels = count_ops(state, buffer, params)
                ops[reduction, len(numels), chunk] = aten + kernels
    return ops


def test_block_levels_cost_a_few_kernel_calls_per_chunk() -> None:
    # Every owner's own block exponents at both levels, on the CPU kernels: per
    # chunk a fixed handful of kernel calls (before: ~100 ATen ops and codec
    # calls per slice and shard), the same for 2 layers or 50, and per bucket
    # the keys' one call.
    for ops in run_distributed(_ops_case, 4, timeout=240):
        for reduction, per_chunk in PER_CHUNK.items():
            one, four = ops[reduction, 2, None], ops[reduction, 2, 512]
            assert ops[reduction, 50, None] == one and ops[reduction, 50, 512] == four
            assert four.count("kernel::decode_rank_blocks") == 4
            assert not any("_local_scalar_dense" in op for op in four), four  # no host read
            extra = collections.Counter(four) - collections.Counter(one)
            assert all(op.startswith("kernel::") for op in extra), extra
            assert extra.total() == 3 * per_chunk, extra
            # Settled (SteadyNodeBlocks): the keys and flags are bound calls too, so a
            # bucket runs no ATen op at all (7 per bucket before it settled): the keys'
            # one call (three before block_keys), the chunk's, and the first chunk's OR
            # of the flags after the owner step (the one before the decode is the
            # decode's call).
            assert all(op.startswith("kernel::") for op in one), one
            assert len(one) == 1 + per_chunk + 1, one


def _node0_owned(chunk: int | None) -> torch.Tensor:
    """Elements of a 64-element layer (blocks of 8) whose shard lies on node 0 of 2, N = 4,
    by hand: each chunk's four shards of whole blocks are owned by (local 0, node 0),
    (local 0, node 1), (local 1, node 0), (local 1, node 1)."""
    mask = torch.zeros(64, dtype=torch.bool)
    for lo, hi in [(0, 16), (32, 48)] if chunk is None else [(0, 8), (16, 24), (32, 40), (48, 56)]:
        mask[lo:hi] = True
    return mask


@pytest.mark.parametrize("chunk", [None, 32])
def test_owners_add_their_own_node_mean_unrounded(chunk: int | None) -> None:
    # Two nodes of two. Where node 0 owns the shard, node 1's mean is rounded with
    # its own block exponents and node 0's added as it is; then the mean is rounded
    # once more. By hand: the float32 node means and block_floor's rounding.
    g = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    [got] = simulate.allreduce(
        [g],
        "e2m1",
        reduction="hierarchical",
        ranks_per_node=2,
        scaling="block",
        block_size=8,
        rank_exponents=True,
        chunk_elements=chunk,
    )

    def rnd(v: torch.Tensor) -> torch.Tensor:
        return numerics.block_floor([v], "e2m1", 8)[0]

    m0, m1 = (g[0] + g[1]) / 2, (g[2] + g[3]) / 2
    expected = torch.where(_node0_owned(chunk), rnd((m0 + rnd(m1)) / 2), rnd((rnd(m0) + m1) / 2))
    assert torch.equal(got, expected)
    assert not torch.equal(got, rnd((rnd(m0) + rnd(m1)) / 2))  # both rounded: before


def test_grid_slice_owners_keep_their_own_values() -> None:
    # A 2 x 2 grid where only local rank 0 of each node sends non-zeros: it owns
    # the first half's first level, so there its node's mean is exact, as
    # hierarchical's FP32 first level gives it.
    g = torch.zeros(4, 64)
    g[[0, 2]] = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    opts = dict(scaling="block", block_size=8, rank_exponents=True)
    [grid] = simulate.allreduce([g], "e2m1", reduction="grid", **opts)
    [nodes] = simulate.allreduce([g], "e2m1", reduction="hierarchical", ranks_per_node=2, **opts)
    assert torch.equal(grid[:32], nodes[:32])
    assert not torch.equal(grid[32:], nodes[32:])  # local rank 1's slice: rounded first


def test_chunk_elements_needs_a_staged_route_with_rank_exponents() -> None:
    g = torch.randn(4, 16)
    with pytest.raises(ValueError, match="chunk_elements needs rank_exponents"):
        simulate.allreduce([g], "e2m1", scaling="block", rank_exponents=True, chunk_elements=8)
    with pytest.raises(ValueError, match="rank_exponents=False, reduction='hierarchical'"):
        simulate.allreduce(
            [g],
            "e2m1",
            reduction="hierarchical",
            ranks_per_node=2,
            scaling="block",
            chunk_elements=8,
        )
    with pytest.raises(ValueError, match="chunk_elements must be >= 1, got 0"):
        simulate.allreduce(
            [g], "e2m1", reduction="grid", scaling="block", rank_exponents=True, chunk_elements=0
        )


# ---------------------------------------------------------------------------
# layer and bucket scaling: the settled path (SteadyStaged)

# (reduction, scaling, format, chunk_elements, stats): None sizes chunks by each rank's
# timing, agreed on the maxima; 4-bit codes split bytes between layers of odd sizes.
STAGED = [
    ("hierarchical", "layer", "e4m3", None, False),
    ("hierarchical", "bucket", "e2m1", 96, False),
    ("grid", "layer", "e2m1", None, False),
    ("grid", "bucket", "e4m3", 96, False),
    ("hierarchical", "none", "e4m3", 96, False),  # every exponent 0, not the layer rule's
    ("hierarchical", "layer", "e4m3", None, True),
    ("grid", "bucket", "e2m1", 96, True),
    ("grid", "none", "fp16", None, True),
]


def _staged_state(
    fmt: str,
    reduction: str,
    scaling: str,
    chunk: int | None,
    stats: bool = False,
    promote: bool = False,
) -> APSState:
    policy = [Promote()] if promote else None
    state = APSState(
        fmt, reduction=reduction, scaling=scaling, ranks_per_node=2, stats=stats, policy=policy
    )
    state.bind_process_group()
    state.chunk_elements = chunk
    return state


def _staged_steps(rank: int, world_size: int) -> list[str]:
    """Hierarchical and grid with one exponent per layer (or bucket, or none), settled,
    against :mod:`aps_comm.simulate` of every rank's gradients (gathered) over several
    steps: the gradients bit for bit and the records (``stats=True``), a NaN in one layer
    of one rank included; the bytes per collective the same at every step."""
    from aps_comm.engine import SteadyStaged

    numels = [5, 0, 1, 700, 33, 2, 64]
    params = [nn.Parameter(torch.empty(n)) for n in numels]
    problems = []
    for c, (reduction, scaling, fmt, chunk, stats) in enumerate(STAGED):
        settled = _staged_state(fmt, reduction, scaling, chunk, stats)
        sim = simulate.hook_options(
            {"reduction": reduction, "scaling": scaling, "ranks_per_node": 2}
        )
        buffer = torch.empty(sum(numels))
        wire = None
        for step in range(5):
            gen = torch.Generator().manual_seed(100 * step + 10 * c + rank)
            x = (
                torch.randn(sum(numels), generator=gen)
                * 2.0
                ** torch.randint(-9, 9, (7,))[
                    torch.arange(7).repeat_interleave(torch.tensor(numels))
                ]
            )
            if step == 3 and rank == 1:
                x[7] = float("nan")  # layer 3 on one rank: NaN in it on every rank, this step
            layers = gather(x).split(numels, dim=1)
            want = torch.cat(simulate.allreduce(layers, fmt, **sim))
            records = simulate.records(layers, fmt, rank, **sim) if stats else []
            buffer.copy_(x)
            ahead = settled.reducer.steady_for(0, buffer) if settled.reducer else None
            if step >= 2 and not isinstance(ahead, SteadyStaged):
                problems.append(f"{c} step {step}: not settled")
            out = settled.run_bucket(0, buffer, params)
            bits = torch.where(out.isnan(), 0.0, out).view(torch.int32)
            if not torch.equal(out.isnan(), want.isnan()) or not torch.equal(
                bits, torch.where(want.isnan(), 0.0, want).view(torch.int32)
            ):
                problems.append(f"{c} step {step}: gradients differ")
            if out[6:706].isnan().all() != (step == 3) or out[706:].isnan().any():
                problems.append(f"{c} step {step}: NaN where it should not be, or not")
            # Measured chunks may move between steps; fixed ones do not.
            if chunk is not None and wire is not None and settled.bytes_detail != wire:
                problems.append(f"{c} step {step}: {settled.bytes_detail} on the wire")
            wire = settled.bytes_detail
            if repr(settled.stats) != repr(records):  # NaN-aware through repr
                problems.append(f"{c} step {step}: records differ")
            outs = gather(out.nan_to_num(7.0))
            if not torch.equal(outs, outs[:1].expand_as(outs)):
                problems.append(f"{c} step {step}: ranks differ")
    return problems


@pytest.mark.parametrize("world_size", [4])
def test_settled_layer_and_bucket_scaling_give_the_simulated_bits(world_size: int) -> None:
    # Four ranks as two nodes of two (hierarchical) and a 2 x 2 grid.
    for problems in run_distributed(_staged_steps, world_size, timeout=240):
        assert problems == []


def _differing_chunks(rank: int, world_size: int) -> list[int]:
    """Each rank prefers its own chunk (as ranks whose measured exchanges differ do): the
    settled path must send with the ranks' largest, as the general path does."""
    chunks = []
    for reduction in ("hierarchical", "grid"):
        state = _staged_state("e4m3", reduction, "layer", None)
        state.bind(torch.device("cpu"))
        assert state.reducer is not None
        prefer = lambda *args, **kw: 128 if rank == 0 else 256  # noqa: E731
        object.__setattr__(state.reducer.planner, "chunk", prefer)  # a frozen dataclass
        params = [nn.Parameter(torch.empty(n)) for n in (300, 700)]
        buffer = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):  # the general path, then twice settled
            state.run_bucket(0, buffer, params)
        assert type(state.reducer.steady_for(0, buffer)).__name__ == "SteadyStaged"
        chunks.append(state.reducer.bucket_chunks[0])
    return chunks


def test_settled_staged_buckets_send_the_agreed_chunk() -> None:
    assert run_distributed(_differing_chunks, 4, timeout=120) == [[256, 256]] * 4


# Per chunk on the CPU kernels: grid's first encode; the node's sum (grid: decode and
# sum) and its encode, one call; the owner's decode, mean and encode, one call; the
# decode. No ATen op.
STAGED_PER_CHUNK = {"hierarchical": 3, "grid": 4}
STAGED_OPTIONS = [("layer", False), ("bucket", False), ("layer", True), ("bucket", True)]
# "promote": layer scaling under Promote (no layer moves), its rates riding on the maxima.
STAGED_OPTIONS += [("none", True), ("promote", False), ("promote", True)]


def _staged_ops_case(rank: int, world_size: int) -> dict[tuple, list[str]]:
    ops = {}
    for reduction in STAGED_PER_CHUNK:
        for scaling, stats in STAGED_OPTIONS:
            for numels in ([1000, 1000], [10] * 200):  # 2000 elements: 2 layers or 200
                for chunk in (4096, 512):  # one chunk or four
                    promote = scaling == "promote"
                    scale = "layer" if promote else scaling
                    state = _staged_state("e4m3", reduction, scale, chunk, stats, promote)
                    x = torch.randn(sum(numels), generator=torch.Generator().manual_seed(rank))
                    params = [nn.Parameter(torch.empty(n)) for n in numels]
                    state.bind_model(nn.ParameterList(params))  # Promote keys layers by name
                    buffer = x.clone()
                    for _ in range(2):  # the plan, then the settled path bound
                        state.run_bucket(0, buffer, params)
                    aten, kernels = count_ops(state, buffer, params)
                    ops[reduction, scaling, stats, len(numels), chunk] = aten + kernels
    return ops


def test_settled_layer_scaling_levels_cost_a_fixed_handful_of_kernel_calls() -> None:
    # Issue 46: hierarchical and grid with one exponent per layer (or bucket) settle.
    # Before, every chunk ran its codec calls and a Python loop of FP32 adds per rank
    # of the node, and every bucket the factors' ~40 ATen ops per route.
    # With stats=True one kernel call more: every layer's records (bucket scaling: and a
    # copy of the agreed maxima); before, the general path: hierarchical e4m3 154 ops at 2
    # layers and 352 at 200, grid 161 and 359. Promote: the layer rule's calls and one for
    # this rank's rates (they ride on the maxima, Promote's step reads them on the host);
    # was 153/351 and 160/358.
    for ops in run_distributed(_staged_ops_case, 4, timeout=240):
        for (reduction, scaling, stats, layers, chunk), calls in ops.items():
            assert calls == ops[reduction, scaling, stats, 2, chunk], (reduction, scaling, layers)
            kept = ["aten::copy_.default"] if stats and scaling == "bucket" else []
            assert [op for op in calls if not op.startswith("kernel::")] == kept, calls
            if stats:
                assert calls.count("kernel::layer_records") == 1, calls
            # The maxima, the factors (and bucket scaling's spread, the records), then the
            # chunks'.
            # Promote: this rank's rates under the first level's factors.
            per_bucket = 2 + (scaling in ("bucket", "promote")) + stats + len(kept)
            k = 1 if chunk == 4096 else 4
            assert len(calls) == per_bucket + k * STAGED_PER_CHUNK[reduction], calls
            if k == 1:
                assert len(calls) <= 15, calls


def _staged_promote_steps(rank: int, world_size: int) -> list[str]:
    """Promote over hierarchical and grid buckets: restored one step up its ladder (e5m2),
    a settled bucket comes back down to e4m3 once calm, sending that step by the general
    path on the maxima it agreed, and binds again; every step the gradients of
    :mod:`aps_comm.simulate` (gathered, in the formats Promote chose) bit for bit, the same
    bytes at every step of a fixed chunk."""
    from aps_comm.engine import SteadyStaged

    numels = [5, 0, 1, 700, 33, 2, 64]
    problems = []
    for c, (reduction, chunk) in enumerate((("hierarchical", None), ("grid", 96))):
        params = [nn.Parameter(torch.empty(n)) for n in numels]
        model = nn.ParameterList(params)
        states = []
        for _ in range(1):
            policy = [Promote(gamma=0.05, patience=2)]
            state = APSState("e4m3", reduction=reduction, ranks_per_node=2, policy=policy)
            state.bind_model(model)
            state.chunk_elements = chunk
            states.append(state)
        [settled] = states
        sim = simulate.hook_options({"reduction": reduction, "ranks_per_node": 2})
        buffer = torch.empty(sum(numels))
        wire = None
        kinds, formats = [], []
        for step in range(6):
            if step == 2:  # every layer restored at e5m2 (its rates 0: calm from then)
                for state in states:
                    saved = state.state_dict()
                    saved["promote"] = {name: (1, 0) for name in saved["promote"]}
                    state.load_state_dict(saved)
            gen = torch.Generator().manual_seed(100 * step + 10 * c + rank)
            x = torch.randn(sum(numels), generator=gen)
            if step == 3 and rank == 1:
                x[7] = float("nan")  # layer 3 on one rank: NaN in it on every rank, this step
            buffer.copy_(x)
            ahead = settled.reducer.steady_for(0, buffer) if settled.reducer else None
            kinds.append(type(ahead).__name__)
            out = settled.run_bucket(0, buffer, params)
            fmts = settled.assignment.formats([id(p) for p in params], step)  # Promote's
            layers = gather(x).split(numels, dim=1)
            want = torch.cat(simulate.allreduce(layers, "e4m3", **sim, formats=fmts))
            bits = torch.where(out.isnan(), 0.0, out).view(torch.int32)
            if not torch.equal(out.isnan(), want.isnan()) or not torch.equal(
                bits, torch.where(want.isnan(), 0.0, want).view(torch.int32)
            ):
                problems.append(f"{c} step {step}: gradients differ")
            if chunk is not None and wire is not None and settled.bytes_detail != wire:
                problems.append(f"{c} step {step}: {settled.bytes_detail} on the wire")
            wire = settled.bytes_detail
            formats.append(",".join(sorted({f.name for f in fmts})))
        # Step 2 binds again after the restore (e5m2); step 3 runs bound and moves down,
        # binding again; from step 4 on the e4m3 bucket runs bound.
        if formats != ["e4m3"] * 2 + ["e5m2"] + ["e4m3"] * 3:
            problems.append(f"{c}: formats {formats}")
        steady = ["SteadyStaged"] * 3
        if kinds != ["NoneType", "SteadyStaged", "NoneType", *steady]:
            problems.append(f"{c}: bound paths {kinds}")
        if not isinstance(settled.reducer.steady.get(0), SteadyStaged):  # type: ignore[union-attr]
            problems.append(f"{c}: not settled at the end")
    return problems


def test_promote_settles_staged_buckets_with_the_simulated_bits() -> None:
    # Issue 46: Promote moves settled staged buckets as the formats show, their bits simulate's.
    for problems in run_distributed(_staged_promote_steps, 4, timeout=240):
        assert problems == []


def _staged_promote_moves(rank: int, world_size: int) -> list[str]:
    """A layer that starts underflowing e4m3 under the route's first-level factors while its
    bucket is settled moves up Promote's ladder on the next step, as on two_phase: the
    settled path writes the rate it measured. Every step the gradients of
    :mod:`aps_comm.simulate` (gathered, in the formats Promote chose) bit for bit and the
    rates of its records (a NaN in another layer of one rank included); the same bytes at
    every step of a fixed chunk."""
    numels = [5, 0, 1, 700, 33, 2, 64]
    problems = []
    cases = (("hierarchical", None), ("grid", 96), ("two_phase", None))
    under = torch.tensor(699.0).div(700.0).item()  # float32's, as the rates are
    for c, (reduction, chunk) in enumerate(cases):
        params = [nn.Parameter(torch.empty(n)) for n in numels]
        model = nn.ParameterList(params)
        states = []
        for _ in range(1):
            policy = [Promote(gamma=0.05, patience=50)]
            state = APSState("e4m3", reduction=reduction, ranks_per_node=2, policy=policy)
            state.bind_model(model)
            state.chunk_elements = chunk
            states.append(state)
        [settled] = states
        sim = simulate.hook_options({"reduction": reduction, "ranks_per_node": 2})
        names = [str(i) for i in range(len(numels))]
        buffer = torch.empty(sum(numels))
        wire = None
        kinds, formats = [], []
        for step in range(5):
            gen = torch.Generator().manual_seed(100 * step + 10 * c + rank)
            x = torch.randn(sum(numels), generator=gen)
            if step >= 2:  # layer 3 (elements 6 to 705): 1 and far below e4m3's subnormals
                x[6:706] *= 1e-7
                x[6] = 1.0
            if step == 2 and rank == 1:
                x[2] = float("nan")  # layer 0 on one rank: NaN in it on every rank, this step
            buffer.copy_(x)
            ahead = settled.reducer.steady_for(0, buffer) if settled.reducer else None
            kinds.append(type(ahead).__name__)
            out = settled.run_bucket(0, buffer, params)
            fmts = settled.assignment.formats([id(p) for p in params], step)  # Promote's
            layers = gather(x).split(numels, dim=1)
            want = torch.cat(simulate.allreduce(layers, "e4m3", **sim, formats=fmts))
            records = simulate.records(layers, "e4m3", rank, names=names, **sim, formats=fmts)
            bits = torch.where(out.isnan(), 0.0, out).view(torch.int32)
            if not torch.equal(out.isnan(), want.isnan()) or not torch.equal(
                bits, torch.where(want.isnan(), 0.0, want).view(torch.int32)
            ):
                problems.append(f"{c} step {step}: gradients differ")
            if chunk is not None and wire is not None and settled.bytes_detail != wire:
                problems.append(f"{c} step {step}: {settled.bytes_detail} on the wire")
            wire = settled.bytes_detail
            # Promote's rates: this rank's underflow rates, in float32.
            rates = {k: float(v) for k, v in settled.reducer.rates.items()}  # type: ignore[union-attr]
            mine = {r.name: torch.tensor(r.underflow_rate).item() for r in records}
            if rates != mine or (step == 2 and rates.get("3") != under):
                problems.append(f"{c} step {step}: rates {rates}, not {mine}")
            formats.append(fmts[3].name)
        # Step 2 runs bound and measures layer 3's underflow; step 3's maxima carry it and
        # Promote moves the layer to e5m2 (that bucket then mixes formats: general path).
        if formats != ["e4m3"] * 3 + ["e5m2"] * 2:
            problems.append(f"{c}: layer 3's formats {formats}")
        bound = "SteadyStaged" if reduction != "two_phase" else "Steady"
        if kinds[1:4] != [bound] * 3:
            problems.append(f"{c}: bound paths {kinds}")
    return problems


def test_promote_moves_a_settled_staged_buckets_underflowing_layer() -> None:
    # Issue 46: the general and the settled staged paths wrote no underflow rates, so
    # Promote never moved a layer on hierarchical or grid (it read zeros).
    for problems in run_distributed(_staged_promote_moves, 4, timeout=240):
        assert problems == []
