"""The collectives' cost formulas against hand-computed values."""

from __future__ import annotations

import pytest

from aps_perfmodel import (
    LinkParams,
    Topology,
    bucket_comm,
    custom_cluster,
    get_format,
)
from aps_perfmodel import collectives as C

LINK = LinkParams(alpha=1e-5, beta=1e-9, gamma=1e-10)


# --- collectives: hand-computed values -------------------------------------------------


def test_ring_allreduce_hand_value() -> None:
    # 2*3*1e-5 + 2*1e6*(3/4)*1e-9 + 1e6*(3/4)*1e-10
    assert C.ring_allreduce(1e6, 4, LINK) == pytest.approx(6e-5 + 1.5e-3 + 7.5e-5)


def test_tree_allreduces_hand_values() -> None:
    # Halving-doubling, p=8: 2*3 latency steps, same bandwidth/reduction as ring.
    assert C.halving_doubling_allreduce(1e6, 8, LINK) == pytest.approx(
        6e-5 + 2 * 1e6 * 7 / 8 * 1e-9 + 1e6 * 7 / 8 * 1e-10
    )
    # Recursive doubling, p=8: 3 steps of the full vector.
    assert C.recursive_doubling_allreduce(1e6, 8, LINK) == pytest.approx(3 * (1e-5 + 1e-3 + 1e-4))
    # p not a power of two pays the fold-in step: ceil(log2 6) = 3.
    assert C.halving_doubling_allreduce(0.0, 6, LINK) == pytest.approx(6e-5)
    assert C.allreduce(8.0, 8, LINK, "auto") == min(
        fn(8.0, 8, LINK) for fn in C.ALLREDUCE_ALGORITHMS.values()
    )
    with pytest.raises(ValueError, match="unknown all-reduce"):
        C.allreduce(1.0, 2, LINK, "butterfly")


def test_reduce_scatter_all_gather_all_to_all_hand_values() -> None:
    assert C.reduce_scatter(1e6, 4, LINK) == pytest.approx(3e-5 + 0.75e6 * 1.1e-9)
    assert C.all_gather(1e6, 4, LINK) == pytest.approx(3e-5 + 0.75e-3)
    assert C.all_to_all(1e6, 4, LINK) == pytest.approx(3e-5 + 0.75e-3)
    # Ring all-reduce = reduce-scatter + all-gather.
    assert C.ring_allreduce(1e6, 4, LINK) == pytest.approx(
        C.reduce_scatter(1e6, 4, LINK) + C.all_gather(1e6, 4, LINK)
    )
    # Two-phase: 1 MB of FP8 on the wire, 4 MB of FP32 accumulated.
    assert C.two_phase_reduction(1e6, 4e6, 4, LINK) == pytest.approx(
        2 * (3e-5 + 0.75e-3) + 4e6 * 0.75 * 1e-10
    )


def test_single_rank_costs_nothing() -> None:
    for fn in (C.ring_allreduce, C.reduce_scatter, C.all_gather, C.all_to_all):
        assert fn(1e9, 1, LINK) == 0.0
    c = custom_cluster(1e9, 1e-5, nodes=1)
    assert bucket_comm(10**6, 5, get_format("e4m3"), c).total_s == 0.0


def test_hierarchical_reduces_to_flat_and_hand_value() -> None:
    intra, inter = LinkParams(1e-6, 1e-11, 1e-12), LinkParams(1e-5, 1e-9, 1e-12)
    flat_nodes = Topology(4, 1, intra, inter)
    one_node = Topology(1, 4, intra, inter)
    assert C.hierarchical_allreduce(1e6, flat_nodes) == C.ring_allreduce(1e6, 4, inter)
    assert C.hierarchical_allreduce(1e6, one_node) == C.ring_allreduce(1e6, 4, intra)
    assert C.hierarchical_all_to_all(1e6, flat_nodes) == pytest.approx(C.all_to_all(1e6, 4, inter))
    # 2 nodes x 4: intra reduce-scatter and all-gather of 1 MB; 4 flows of 250 kB share the NIC.
    two = Topology(2, 4, intra, inter)
    expect = (
        (3 * 1e-6 + 1e6 * 0.75 * (1e-11 + 1e-12))
        + (2 * 1e-5 + 2 * 2.5e5 * 0.5 * 4e-9 + 2.5e5 * 0.5 * 1e-12)
        + (3 * 1e-6 + 1e6 * 0.75 * 1e-11)
    )
    assert C.hierarchical_allreduce(1e6, two) == pytest.approx(expect)
    # All-to-all: 3 intra peers, 4 off-node peers whose traffic shares the node link.
    a2a = 3 * (1e-6 + 1.25e5 * 1e-11) + 4 * (1e-5 + 1.25e5 * 4e-9)
    assert C.hierarchical_all_to_all(1e6, two) == pytest.approx(a2a)
