"""Grid two_phase: hand values, when it is allowed and chosen, its chunk rule, nodes of several
ranks, pipelined groups.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from aps_perfmodel import (
    Topology,
    bucket_comm,
    get_cluster,
    get_format,
)
from aps_perfmodel import collectives as C
from aps_perfmodel.strategies import grid_rows

# --- grid two_phase ------------------------------------------------------------------


def _codec_counting_cluster(topology: Topology) -> object:
    """A cluster whose every codec pass costs 1 s and every element nothing."""
    from aps_perfmodel import Cluster, get_device
    from aps_perfmodel.cluster import OpCost

    unit = OpCost(1.0, 0.0)
    fits = {k: unit for k in ("amax", "encode.e4m3", "decode.e4m3", "accumulate")}
    return Cluster("toy", topology, get_device("h100"), codec_fits=fits)


@pytest.mark.parametrize(
    "n,g,messages,peers", [(4, 2, 4, 3), (8, 2, 8, 5), (64, 8, 28, 15), (1024, 32, 124, 63)]
)
def test_grid_hand_values(n: int, g: int, messages: int, peers: int) -> None:
    from aps_perfmodel.strategies import bucket_breakdown, grid_peers

    assert grid_rows(n) == g
    assert grid_peers(n) == peers
    cols, numel = n // g, 2**20
    # Latency only (free bandwidth): 2(g-1) + 2(C-1) messages per chunk, not 2(N-1).
    lat = Topology(n, 1, C.LinkParams(1.0, 0.0), C.LinkParams(1.0, 0.0))
    b = bucket_breakdown(numel, 4, "e4m3", _codec_counting_cluster(lat), "grid", chunk=None)
    assert b.collective_s == pytest.approx(messages) and messages == 2 * (g - 1) + 2 * (cols - 1)
    flat = bucket_breakdown(numel, 4, "e4m3", _codec_counting_cluster(lat), "two_phase", None)
    assert flat.collective_s == pytest.approx(2 * (n - 1))
    # Bytes: w (g-1)/g per element in each row stage, w (C-1)/(C g) in each column stage,
    # 2 w (N-1)/N in all (flat two_phase's bytes); bandwidth only (1 ns per byte).
    bw = Topology(n, 1, C.LinkParams(0.0, 1e-9), C.LinkParams(0.0, 1e-9))
    b = bucket_breakdown(numel, 4, "e4m3", _codec_counting_cluster(bw), "grid", chunk=None)
    row, col = (g - 1) / g, (cols - 1) / (cols * g)
    assert b.wire_bytes == pytest.approx(numel * 2 * (row + col))
    assert b.wire_bytes == pytest.approx(2 * numel * (n - 1) / n)
    assert b.collective_s == pytest.approx(1e-9 * numel * 2 * (row + col))
    # Codec: amax, then encode, the row owner's decode + sum + encode, the column
    # owner's decode + sum + encode, decode: 9 passes (flat two_phase: 6).
    assert b.codec_s == 9.0 and flat.codec_s == 6.0


def test_grid_needs_a_divisor_and_is_chosen_only_where_allowed() -> None:
    from aps_perfmodel.strategies import bucket_breakdown, choose_strategy, grid_peers, hook_cluster

    assert grid_rows(7) == 1 and grid_rows(2) == 1 and grid_rows(36) == 6 and grid_rows(96) == 8
    seven = get_cluster("100gbe", world_size=7)
    with pytest.raises(ValueError, match="'grid' needs a world size with a divisor g"):
        bucket_breakdown(2**20, 4, "e4m3", seven, "grid")
    with pytest.raises(ValueError, match="world size 7 has no grid"):
        grid_peers(7)
    # Allowed but impossible at 7 ranks: never chosen, and "auto" does not try it.
    assert choose_strategy(25 * 2**18, 20, "e4m3", seven, False, False, grid_ok=True) != "grid"
    assert bucket_comm(25 * 2**18, 20, get_format("e4m3", "auto"), seven).strategy == "two_phase"
    # choose_strategy's old signature leaves grid out.
    flat = hook_cluster("nccl", "cuda", 1024, 1)
    assert choose_strategy(25 * 2**18, 20, "e4m3", flat, False, False) != "grid"


def test_auto_chooses_grid_where_latency_bound_at_scale() -> None:
    from aps_perfmodel.strategies import (
        bucket_breakdown,
        choose_strategy,
        hook_cluster,
        strategy_times,
    )

    n = 25 * 2**18
    for world in (64, 256, 1024):
        # One rank per host: 2(N-1) latencies per flat exchange and per FP32 ring.
        for c in (hook_cluster("nccl", "cuda", world, 1), get_cluster("100gbe", world)):
            t = strategy_times(n, 20, "e4m3", c, ["fp32", "two_phase", "grid"])
            assert t["grid"] < t["two_phase"] and t["grid"] < t["fp32"], (world, t)
            assert choose_strategy(n, 20, "e4m3", c, False, False, grid_ok=True) == "grid"
            b = bucket_comm(n, 20, get_format("e4m3", "auto"), c)
            assert b.strategy == "grid"
    # The latency grid saves grows with N: at 1024 ranks flat two_phase is 8x slower.
    c = get_cluster("100gbe", 1024)
    t = strategy_times(n, 20, "e4m3", c, ["two_phase", "grid"])
    assert t["two_phase"] > 8 * t["grid"]
    # Bandwidth-bound (1 Gbit/s, 8 ranks, 100 MiB in one chunk): flat two_phase's bytes,
    # 3 more codec passes; grid is ahead by little more than its 6 saved latencies.
    slow = get_cluster("1gbe", 8)
    grid = bucket_breakdown(25 * 2**20, 20, "e4m3", slow, "grid", chunk=None)
    flat = bucket_breakdown(25 * 2**20, 20, "e4m3", slow, "two_phase", chunk=None)
    assert grid.wire_bytes == flat.wire_bytes
    saved = flat.total_s - grid.total_s
    assert 0 < saved < 6 * slow.topology.inter.alpha


def test_grid_chunk_rule_uses_effective_peers() -> None:
    from aps_perfmodel.strategies import chunk_elements, grid_peers, hook_cluster, strategy_chunk

    c = hook_cluster("gloo", "cpu", 64, 1)
    n, w = 2**24, 1.0
    chunk = strategy_chunk(n, "e4m3", c, "grid", exchange_s=0.5)
    link = c.topology.inter
    assert chunk == chunk_elements(n, w, grid_peers(64), link, c.chunk_overhead_s, 0.5)
    # 15 peers, not 64: 4 x 25 us at 1.25 GB/s = 125 kB per peer -> 2**21 elements,
    # where flat two_phase's 64 peers ask for 2**23 (pipelining: k = 25 -> 2**20).
    assert chunk == 2**21
    assert strategy_chunk(n, "e4m3", c, "two_phase", exchange_s=0.5) == 2**23


def test_grid_on_nodes_of_several_ranks() -> None:
    from aps_perfmodel.strategies import bucket_breakdown

    # 2 nodes x 8 ranks, g = 4: rows (4 consecutive ranks) inside a node; a column
    # {j, j+4, j+8, j+12} has 2 ranks on each node. Latencies only: row all-to-all and
    # all-gather 3 + 3 NVLink steps; column all-to-all 1 NVLink + 2 NIC peers; column
    # all-gather two-level: 1 NIC step (2 nodes) + 1 NVLink step (2 ranks).
    intra, inter = C.LinkParams(1.0, 0.0), C.LinkParams(10.0, 0.0)
    c = _codec_counting_cluster(Topology(2, 8, intra, inter))
    b = bucket_breakdown(2**20, 4, "e4m3", c, "grid", chunk=None)
    assert b.collective_s == pytest.approx((3 + 3 + 1 + 1) * 1.0 + (2 + 1) * 10.0)
    # 8 nodes x 8 ranks, g = 8: rows are the nodes, columns one rank per node (the
    # hierarchical groups), every stage in the wire format.
    c = _codec_counting_cluster(Topology(8, 8, intra, inter))
    b = bucket_breakdown(2**20, 4, "e4m3", c, "grid", chunk=None)
    assert b.collective_s == pytest.approx(2 * 7 * 1.0 + 2 * 7 * 10.0)
    h = bucket_breakdown(2**20, 4, "e4m3", c, "hierarchical", chunk=None)
    assert h.collective_s == pytest.approx(b.collective_s)


def test_staged_strategies_pipeline_their_groups() -> None:
    from aps_perfmodel import Cluster, get_device
    from aps_perfmodel.cluster import OpCost
    from aps_perfmodel.strategies import bucket_breakdown

    free = {k: OpCost(0.0, 0.0) for k in ("amax", "encode.e4m3", "decode.e4m3", "accumulate")}
    # Hierarchical, 4 chunks, no codec: the node's group (FP32 all-to-all, FP8
    # all-gather over NVLink) and the across-node group (FP8 over the NIC) work on
    # different chunks at once: one chunk through both, then 3 at the slower's pace.
    intra, inter = C.LinkParams(1e-6, 1e-10), C.LinkParams(1e-5, 1e-9)
    c = Cluster("toy", Topology(2, 2, intra, inter), get_device("h100"), codec_fits=free)
    m = 250_000
    node = C.all_to_all(4 * m, 2, intra) + C.all_gather(m, 2, intra)
    across = 2 * (1e-5 + m / 2 / 2 * 2e-9)  # 2 flows share the NIC (beta 2e-9)
    b = bucket_breakdown(4 * m, 4, "e4m3", c, "hierarchical", chunk=m)
    assert b.chunks == 4 and b.collective_s == pytest.approx(4 * (node + across))
    assert b.total_s == pytest.approx(b.maxima_s + 4 * max(node, across) + min(node, across))
    # Grid on 16 hosts (4 x 4), one NIC each: the row and column groups overlap, but
    # their bytes share the NIC, which is the busiest resource here.
    alpha, beta, m = 1e-5, 1e-9, 2**20
    link = C.LinkParams(alpha, beta)
    c = Cluster("toy", Topology(16, 1, link, link), get_device("h100"), codec_fits=free)
    row = 2 * (3 * alpha + m * 3 / 4 * beta)
    col = 2 * (3 * alpha + m / 4 * 3 / 4 * beta)
    nic = (2 * 3 / 4 + 2 * 3 / 16) * m * beta
    assert nic > row > col
    b = bucket_breakdown(4 * m, 4, "e4m3", c, "grid", chunk=m)
    assert b.collective_s == pytest.approx(4 * (row + col))
    assert b.total_s == pytest.approx(b.maxima_s + 4 * nic + row + col - nic)
    # Ranks sharing cores: nothing overlaps.
    shared = bucket_breakdown(4 * m, 4, "e4m3", replace(c, cores_per_rank=0.5), "grid", chunk=m)
    assert shared.total_s == pytest.approx(b.maxima_s + 4 * (row + col))
