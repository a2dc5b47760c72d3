"""Block scaling at every level: each level's bytes by hand, the time from the same bytes, and the
planner's choice among two_phase, hierarchical and grid following the model.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from aps_comm.config import Route, Scaling
from aps_comm.formats import get_format as hook_format
from aps_comm.plan import Planner
from aps_perfmodel import get_cluster, get_format
from aps_perfmodel.formats import FormatSpec
from aps_perfmodel.strategies import (
    Level,
    bucket_breakdown,
    choose_strategy,
    flag_bytes,
    hook_cluster,
    level_bytes,
    level_shares,
)

# e2m1 with blocks of 16: half a byte of codes and 1/16 byte of exponent per element.
E2M1_16 = get_format("e2m1", aps=True, scaling="block", block_size=16)
KEYED = 0.5 + 1 / 16


def test_level_bytes_are_the_codes_plus_the_senders_exponents() -> None:
    assert [level_bytes(E2M1_16, lv) for lv in Level] == [4.0, KEYED, KEYED, KEYED]
    e4m3 = get_format("e4m3", aps=True, scaling="block")  # blocks of 32
    assert level_bytes(e4m3, Level.GATHER) == 1 + 1 / 32
    # Agreed exponents: a rank's own values go without them; every owner's with its own.
    agreed = replace(E2M1_16, block_exponents="agreed")
    assert [level_bytes(agreed, lv) for lv in Level] == [4.0, 0.5, KEYED, KEYED]
    # Per-layer scaling: the codes alone.
    assert [level_bytes(get_format("e2m1", aps=True), lv) for lv in Level] == [4.0, 0.5, 0.5, 0.5]
    assert flag_bytes(E2M1_16, 4) == 5 and flag_bytes(agreed, 4) == 0


# 2 nodes of 8 ranks; grid: 4 x 4. Per level, the share of a bucket one rank sends.
SHARES = {
    "two_phase": {"encoded": 2 * 15 / 16, "fp32": 0.0, "send_peers": 15},
    "hierarchical": {"encoded": 2 * 1 / 16 + 7 / 8, "fp32": 7 / 8, "send_peers": 1},
    "grid": {"encoded": 2 * 3 / 4 + 2 * 3 / 16, "fp32": 0.0, "send_peers": 3},
}


@pytest.mark.parametrize("strategy", list(SHARES))
def test_every_encoded_level_carries_one_exponent_byte_per_block(strategy: str) -> None:
    c = get_cluster("dgx-h100", world_size=16)
    n, layers = 2**20, 4
    share = SHARES[strategy]
    b = bucket_breakdown(n, layers, E2M1_16, c, strategy, None, n_blocks=n // 16)
    # Each rank's own exponents: nothing agreed first, and the first chunk's sends
    # carry the 4 layers' flags and a chunk byte.
    flags = (layers + 1) * share["send_peers"]
    assert b.wire_bytes == n * (share["encoded"] * KEYED + share["fp32"] * 4) + flags
    assert b.exponent_bytes == n * share["encoded"] / 16
    assert b.maxima_s == 0.0
    # Agreed: the sends go without exponents; one MAX all-reduce of a byte per block.
    agreed = replace(E2M1_16, block_exponents="agreed")
    a = bucket_breakdown(n, layers, agreed, c, strategy, None, n_blocks=n // 16)
    send = dict(level_shares(strategy, c))[Level.SEND]
    all_reduce = 2 * (n // 16) * 15 / 16
    assert a.wire_bytes == pytest.approx(b.wire_bytes - flags - n * send / 16 + all_reduce)
    assert a.exponent_bytes == pytest.approx(b.exponent_bytes - n * send / 16 + all_reduce)
    assert a.maxima_s > 0.0


@pytest.mark.parametrize("strategy", list(SHARES))
def test_collectives_are_timed_on_the_same_bytes(strategy: str) -> None:
    # A per-layer format of 0.5 + 1/16 bytes sends what every encoded level sends
    # with blocks of 16: the same collectives, the same bytes across nodes.
    c = get_cluster("dgx-h100", world_size=16)
    n = 2**22
    keyed = FormatSpec("e2m1", KEYED, "two_phase", True, "uint8")
    b = bucket_breakdown(n, 4, E2M1_16, c, strategy, None)
    same = bucket_breakdown(n, 4, keyed, c, strategy, None)
    assert b.collective_s == pytest.approx(same.collective_s, rel=1e-12)
    assert b.inter_node_bytes == pytest.approx(same.inter_node_bytes, rel=1e-12)
    assert (
        b.collective_s > bucket_breakdown(n, 4, get_format("e2m1"), c, strategy, None).collective_s
    )
    # Across nodes, hierarchical sends its slice's shards and gathers the means: 2 x 1/16 of
    # the bucket per rank, codes and exponents.
    if strategy == "hierarchical":
        assert b.inter_node_bytes == pytest.approx(n * 2 / 16 * KEYED)


@pytest.mark.parametrize("block_size,route", [(8, Route.HIERARCHICAL), (256, Route.GRID)])
def test_planner_choice_with_blocks_is_the_models_argmin(block_size: int, route: Route) -> None:
    # 2 nodes of 8 GPUs, a 1M-element e2m1 bucket: hierarchical's in-node FP32 level
    # carries no exponents, grid's four levels all do. With blocks of 8 (1/8 byte per
    # element, a quarter of e2m1's codes) hierarchical is faster; with blocks of 256 grid.
    c = hook_cluster("nccl", "cuda", 16, 8)
    n, layers = 2**20, 8
    planner = Planner(
        c, hierarchical=True, fp32=True, grid=True, scaling=Scaling.BLOCK, block_size=block_size
    )
    chosen = planner.reduction(hook_format("e2m1"), n, layers, native=False)
    spec = get_format("e2m1", aps=True, scaling="block", block_size=block_size)
    times = {
        s: bucket_breakdown(n, layers, spec, c, s).total_s
        for s in ("fp32", "two_phase", "hierarchical", "grid")
    }
    assert chosen == route
    assert chosen == Route.from_model(min(times, key=times.__getitem__))
    assert chosen == Route.from_model(choose_strategy(n, layers, spec, c, False, True, True))
    # The exponent bytes are what tips it: the same cluster picks grid without blocks.
    layer = choose_strategy(n, layers, get_format("e2m1"), c, False, True, True)
    assert layer == "grid"


def test_predict_takes_each_formats_default_block_size_as_the_hook_does() -> None:
    from aps_comm.config import default_block_size
    from aps_perfmodel import ComputeTime, get_model, predict

    c, m = get_cluster("1gbe", world_size=4), get_model("resnet50")
    compute = ComputeTime.from_step_time(0.1)
    for name in ("e2m1", "e3m2", "e4m3", "e5m2"):
        p = predict(m, c, [name], compute, scaling="block")
        assert p.block_size == default_block_size(hook_format(name).bits), name
        fixed = predict(m, c, [name], compute, scaling="block", block_size=p.block_size)
        assert fixed.formats[name] == p.formats[name]
    # e4m3 with blocks of 128 carries a quarter of the exponent bytes of blocks of 32.
    e128 = predict(m, c, ["e4m3"], compute, scaling="block").formats["e4m3"]
    e32 = predict(m, c, ["e4m3"], compute, scaling="block", block_size=32).formats["e4m3"]
    assert e128.exponent_bytes == pytest.approx(e32.exponent_bytes / 4, rel=0.01)
