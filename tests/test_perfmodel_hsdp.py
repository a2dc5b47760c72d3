"""The performance model prices HSDP: ``fsdp_step(..., replicate=R)`` and ``fsdp --replicate``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from aps_perfmodel.cli import fsdp_units
from aps_perfmodel.cli import main as cli_main
from aps_perfmodel.cluster import Cluster, custom_cluster, get_cluster
from aps_perfmodel.collectives import hierarchical_all_gather, ring_allreduce
from aps_perfmodel.comm import bucket_comm
from aps_perfmodel.formats import get_format
from aps_perfmodel.fsdp import (
    FSDPUnit,
    fsdp_step,
    reduce_scatter_time,
    replicas_exposed_s,
    shard_group_size,
)
from aps_perfmodel.models import get_model

# Two units whose parameters pad evenly to 8 and to 4 ranks.
UNITS = (FSDPUnit(2**22, 2, (2**21, 2**21)), FSDPUnit(3 * 2**20, 3))


def _dgx(nodes: int = 4, bandwidth: float = 12.5e9) -> Cluster:
    """``nodes`` nodes of 8 H100s, ``bandwidth`` bytes/s per node between them."""
    return get_cluster("dgx-h100", world_size=8 * nodes).with_links(bandwidth=bandwidth)


def _emulated() -> Cluster:
    """Two nodes of two CPU ranks, 1 Gbit/s between them (the benchmark's shape)."""
    return custom_cluster(125e6, 50e-6, nodes=2, gpus_per_node=2, device="cpu")


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "e4m3", "e2m1-block"])
def test_replicate_1_is_flat_fsdp(fmt: str, backend: str) -> None:
    spec = get_format("e2m1", scaling="block") if fmt == "e2m1-block" else get_format(fmt)
    for cluster in (_dgx(), _emulated(), get_cluster("1gbe", world_size=4)):
        flat = fsdp_step(UNITS, spec, cluster, backend=backend, param_bytes=2.0)
        assert (
            fsdp_step(UNITS, spec, cluster, backend=backend, param_bytes=2.0, replicate=1) == flat
        )
        # Flat FSDP's reduce-scatters are reduce_scatter_time's, over the whole world.
        assert flat.units == tuple(reduce_scatter_time(u, spec, cluster, backend) for u in UNITS)
        assert flat.replicate == 1 and flat.all_reduce_s == 0.0 and flat.replicas == ()
        assert flat.reduce_scatter_format == spec.name
        # Across nodes: the gradients' bytes and the all-gathers' (forward and backward):
        # node-aware, each of a node's g ranks sends its 1/g part to the other nodes;
        # Gloo's one ring over nodes of several ranks, the node's last rank sends
        # (N - 1) / N of the output to the next node.
        topo, p = cluster.topology, cluster.world_size
        gathers = 2 * sum(u.numel * 2.0 for u in UNITS) / topo.gpus_per_node
        if backend == "gloo" and topo.nodes > 1 and topo.gpus_per_node > 1:
            gathers *= (p - 1) / p
        else:
            gathers *= (topo.nodes - 1) / topo.nodes
        assert flat.cross_node_bytes == pytest.approx(flat.inter_node_bytes + gathers)


def test_flat_fsdp_on_gloo_crosses_nodes_as_its_ring() -> None:
    # benchmarks.fsdp's model: 2 x Linear(2048, 2048), 32 MiB of FP32, on 2 nodes x 2 ranks.
    units = [FSDPUnit(2048 * 2048, 1)] * 2
    cluster, mib = _emulated(), 2**20
    fp32 = fsdp_step(units, "fp32", cluster, backend="gloo")
    # Gloo's ring over ranks 0-1-2-3: ranks 1 and 3 send to the other node. The
    # reduce-scatter is an all-reduce (2 x 3/4 x 32 MiB per rank, half of it across)
    # and 4 all-gathers of 16 MiB (3/4 each, half across): 24 + 24 MiB, as the
    # benchmark's link counters measure (the node-aware price: 16 + 16).
    assert fp32.cross_node_bytes == pytest.approx(48 * mib)
    e4m3 = fsdp_step(units, "e4m3", cluster, backend="gloo")
    assert e4m3.cross_node_bytes == pytest.approx((4 + 24) * mib)
    # One flow of the ring on each node link: 2 x 3 steps of 8 MiB at its rate.
    link = cluster.topology.inter
    assert fp32.reduce_scatter_s == pytest.approx(
        2 * ring_allreduce(32 * mib / 2, 4, replace(link, gamma=cluster.topology.intra.gamma))
    )
    assert fp32.all_gather_s == pytest.approx(4 * (3 * link.alpha + 0.75 * 16 * mib * link.beta))
    # NCCL keeps the node-aware price.
    nccl = fsdp_step(units, "fp32", cluster, backend="nccl")
    assert nccl.cross_node_bytes == pytest.approx((8 + 16) * mib)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_hsdp_fp32_sends_a_ring_of_each_units_shard_across_nodes(backend: str) -> None:
    for cluster, r in ((_dgx(), 4), (_emulated(), 2)):
        s = cluster.world_size // r
        p = fsdp_step(UNITS, "fp32", cluster, backend=backend, replicate=r)
        ring = sum(2 * (r - 1) / r * u.numel / s * 4 for u in UNITS)
        assert p.cross_node_bytes == pytest.approx(ring)
        assert p.inter_node_bytes == pytest.approx(ring)
        # The reduce-scatter and the all-gathers stay in the node.
        assert all(t.inter_node_bytes == 0 for t in p.units)
        assert p.reduce_scatter_format == "fp32" and not p.aps
        # Flat FSDP sends its all-gathers across as well: more than HSDP in all.
        assert fsdp_step(UNITS, "fp32", cluster, backend=backend).cross_node_bytes > ring


def test_hsdp_aps_sends_a_quarter_of_fp32s_bytes_across_and_blocks_add_their_exponents() -> None:
    cluster = _dgx()
    fp32, bf16, e4m3 = (fsdp_step(UNITS, f, cluster, replicate=4) for f in ("fp32", "bf16", "e4m3"))
    assert bf16.cross_node_bytes / fp32.cross_node_bytes == pytest.approx(0.5)
    assert e4m3.cross_node_bytes / fp32.cross_node_bytes == pytest.approx(0.25)
    assert e4m3.aps and e4m3.reduce_scatter_format == "fp32"
    assert e4m3.all_reduce_s < bf16.all_reduce_s < fp32.all_reduce_s
    assert {b.strategy for b in e4m3.replicas} == {"two_phase"}
    e2m1 = get_format("e2m1", scaling="block", block_size=32)
    block = fsdp_step(UNITS, e2m1, cluster, replicate=4)
    # Each rank's own exponents go with its shards and with the owners' gathered ones.
    assert block.cross_node_bytes / fp32.cross_node_bytes == pytest.approx((0.5 + 1 / 32) / 4)
    assert block.exponent_bytes > 0 and e4m3.exponent_bytes == 0
    # Across replicas aps_comm.fsdp sends each rank's own exponents, whatever was asked.
    agreed = replace(e2m1, block_exponents="agreed")
    assert fsdp_step(UNITS, agreed, cluster, replicate=4) == block
    # reduction="allreduce" (native): one MAX all-reduce agrees a byte per block of
    # every parameter's shard first.
    native = fsdp_step(UNITS[:1], replace(e2m1, strategy="native"), cluster, replicate=4)
    assert native.replicas[0].strategy == "native"
    assert native.exponent_bytes == pytest.approx(2 * (2 * (2**21 // 8 // 32)) * 3 / 4)
    with pytest.raises(ValueError, match=r"two_phase, native, auto .* not 'grid'"):
        fsdp_step(UNITS, replace(e2m1, strategy="grid"), cluster, replicate=4)


def test_hsdp_all_gathers_and_reduce_scatter_use_the_intra_node_link() -> None:
    for fmt in ("fp32", "bf16", "e4m3"):
        slow, fast = (fsdp_step(UNITS, fmt, _dgx(bandwidth=bw), replicate=4) for bw in (1e9, 5e10))
        assert slow.all_gather_s == fast.all_gather_s > 0
        assert slow.reduce_scatter_s == fast.reduce_scatter_s > 0
        assert slow.all_reduce_s > 2 * fast.all_reduce_s
        # The replica all-reduce runs on the inter-node link alone.
        nvlink = fsdp_step(UNITS, fmt, _dgx().with_links(intra_bandwidth=50e9), replicate=4)
        base = fsdp_step(UNITS, fmt, _dgx(), replicate=4)
        assert nvlink.all_reduce_s == base.all_reduce_s
        assert nvlink.all_gather_s > base.all_gather_s
        # Flat FSDP's all-gathers cross the nodes.
        flat = [fsdp_step(UNITS, fmt, _dgx(bandwidth=bw)) for bw in (1e9, 5e10)]
        assert flat[0].all_gather_s > 2 * flat[1].all_gather_s
    # An HSDP step's all-gathers are those of one node of 8.
    one_node = get_cluster("dgx-h100", world_size=8)
    want = 2 * sum(hierarchical_all_gather(u.numel * 4.0, one_node.topology) for u in UNITS)
    assert fsdp_step(UNITS, "fp32", _dgx(), replicate=4).all_gather_s == pytest.approx(want)


def test_a_nodes_shard_groups_share_its_link_for_their_all_reduces() -> None:
    # All 8 ranks of a node all-reduce their shards at once, through the node's one link:
    # the across-node step of NCCL's two-level all-reduce of the whole unit.
    cluster = _dgx()
    shared = cluster.topology.inter.shared_by(8)
    p = fsdp_step(UNITS, "fp32", cluster, replicate=4)
    want = [ring_allreduce(u.numel / 8 * 4, 4, shared) for u in UNITS]
    assert [b.collective_s for b in p.replicas] == pytest.approx(want)
    assert p.all_reduce_s == pytest.approx(sum(want))


def test_hsdp_with_shard_groups_of_one_is_ddp_with_a_bucket_per_unit() -> None:
    # replicate = world: nothing sharded, each unit's gradients all-reduced as a DDP bucket.
    cluster = get_cluster("100gbe", world_size=4)
    for fmt in ("fp32", "e4m3"):
        p = fsdp_step(UNITS, fmt, cluster, replicate=4)
        assert p.all_gather_s == 0 and p.reduce_scatter_s == 0
        want = [bucket_comm(u.numel, u.n_params, get_format(fmt), cluster).total_s for u in UNITS]
        assert [b.total_s for b in p.replicas] == pytest.approx(want)
        assert p.all_reduce_s == pytest.approx(sum(want))


def test_hsdp_reduce_scatter_is_fsdps_own_unless_asked() -> None:
    cluster = _emulated()
    default = fsdp_step(UNITS, "e4m3", cluster, backend="gloo", replicate=2)
    forced = fsdp_step(UNITS, "e4m3", cluster, backend="gloo", replicate=2, reduce_scatter=True)
    node = custom_cluster(125e6, 50e-6, nodes=1, gpus_per_node=2, device="cpu")
    assert default.reduce_scatter_format == "fp32" and forced.reduce_scatter_format == "e4m3"
    for p, fmt in ((default, "fp32"), (forced, "e4m3")):
        want = [reduce_scatter_time(u, fmt, node, "gloo") for u in UNITS]
        assert p.units == tuple(want)
    assert forced.all_reduce_s == default.all_reduce_s
    # Flat FSDP with FSDP's own reduce-scatter: nothing is APS.
    off = fsdp_step(UNITS, "e4m3", cluster, backend="gloo", reduce_scatter=False)
    assert not off.aps and off.step_s == fsdp_step(UNITS, "fp32", cluster, backend="gloo").step_s


@pytest.mark.parametrize(
    ("replicate", "match"),
    [
        (3, "replicate=3 does not divide the world of 32 ranks"),
        (2, "shard groups of 16 ranks .* 16 does not divide the 8 ranks per node"),
        (0, "replicate must be an int >= 1, got 0"),
        (True, "got True"),
    ],
)
def test_a_bad_replicate_is_named(replicate: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fsdp_step(UNITS, "e4m3", _dgx(), replicate=replicate)
    assert shard_group_size(_dgx(), 8) == 4  # shard groups of 4 in nodes of 8 are fine


def _hsdp_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    base = ["fsdp", "--model", "llama-7b", "--units", "4", "--cluster", "dgx-h100"]
    assert cli_main([*base, "--nodes", "4", "--bandwidth", "100Gbit", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_fsdp_replicate_prints_hsdp_rows_and_says_which_link_each_collective_uses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = _hsdp_json(capsys, "--replicate", "4")
    assert (out["replicate"], out["shard_group"]) == (4, 8)
    hsdp = " ".join(out["assumptions"]["hsdp"].split())
    assert "all-gathers and reduce-scatter among them on the intra-node link" in hsdp
    assert "all-reduced among the 4 replicas on the inter-node link (100 Gbit/s" in hsdp
    cluster = _dgx()
    units = fsdp_units(get_model("llama-7b"), 4, 8)
    rows = {r["format"]: r for r in out["rows"]}
    for fmt, row in rows.items():
        want = fsdp_step(units, fmt, cluster, replicate=4)
        assert row["all_reduce_s"] == pytest.approx(want.all_reduce_s) and want.all_reduce_s > 0
        assert row["cross_node_bytes"] == pytest.approx(want.cross_node_bytes)
        assert row["step_comm_s"] == pytest.approx(want.step_s)
    assert rows["e4m3"]["reduce_scatter_format"] == "fp32"
    assert rows["e4m3"]["cross_node_bytes"] / rows["fp32"]["cross_node_bytes"] == pytest.approx(
        0.25
    )
    # The text says the same.
    argv = ["fsdp", "--model", "llama-7b", "--units", "4", "--cluster", "dgx-h100", "--nodes", "4"]
    assert cli_main([*argv, "--bandwidth", "100Gbit", "--replicate", "4"]) == 0
    text = capsys.readouterr().out
    assert "32 ranks, 4 replicas x 8 (--replicate)" in text
    table = {line.split()[0]: line.split() for line in text.splitlines() if "+" in line[:17]}
    assert table["e4m3"][1] == "fp32+APS" and table["bf16"][1] == "bf16+bf16", text
    assert "hsdp     each unit sharded over 8 ranks of a node" in text


def test_fsdp_without_replicate_keeps_its_flat_rows(capsys: pytest.CaptureFixture[str]) -> None:
    out = _hsdp_json(capsys)
    assert out["replicate"] == 1 and "hsdp" not in out["assumptions"]
    units = fsdp_units(get_model("llama-7b"), 4, 32)
    for row in out["rows"]:
        want = fsdp_step(units, row["format"], _dgx())
        assert row["all_reduce_s"] == 0 and row["step_comm_s"] == pytest.approx(want.step_s)
        assert row["cross_node_bytes"] > row["inter_node_bytes"]  # the all-gathers cross too


@pytest.mark.parametrize(
    ("replicate", "says"),
    [
        ("3", "--replicate 3 does not divide the world of 32 ranks"),
        (
            "2",
            "--replicate 2 makes shard groups of 16 ranks (32 / 2), which must lie within a "
            "node: 16 does not divide the 8 ranks per node",
        ),
    ],
)
def test_a_bad_replicate_flag_is_one_line_naming_it(
    replicate: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["fsdp", "--model", "llama-7b", "--cluster", "dgx-h100", "--nodes", "4"]
    assert cli_main([*argv, "--replicate", replicate]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"aps-perfmodel: error: {says}"]


def test_replicate_on_one_node_prices_hsdp_inside_it(capsys: pytest.CaptureFixture[str]) -> None:
    # Documented: no error; the replicas share the node, nothing crosses nodes.
    argv = ["fsdp", "--model", "llama-7b", "--cluster", "dgx-h100", "--nodes", "1"]
    assert cli_main([*argv, "--replicate", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "nothing crosses nodes" in out["assumptions"]["hsdp"]
    assert all(r["cross_node_bytes"] == 0 and r["all_reduce_s"] > 0 for r in out["rows"])
    inside = fsdp_step(UNITS, "e4m3", _dgx(1), replicate=2)
    assert inside.cross_node_bytes == 0 and inside.all_reduce_s > 0


def test_replica_all_reduces_beside_backward_run_one_after_another() -> None:
    # Model order; backward reaches unit 1 first: its all-reduce runs from
    # 0.31 to 0.41, unit 0's from 0.41 (its reduce-scatter ended at 0.37) to
    # 0.61, 0.24 s after backward's end.
    got = replicas_exposed_s([0.05, 0.3], [0.01, 0.01], [0.2, 0.1])
    assert got == pytest.approx(0.24)
    # Backward long enough: only the unit reduced last waits; none: all of them.
    assert replicas_exposed_s([1.0, 1.0], [0.0, 0.0], [0.2, 0.1]) == pytest.approx(0.2)
    assert replicas_exposed_s([0.0, 0.0], [0.0, 0.0], [0.2, 0.1]) == pytest.approx(0.3)


def test_hsdp_step_with_replicas_beside_backward_hides_all_but_the_unit_reduced_last() -> None:
    cluster = custom_cluster(31.25e6, 50e-6, nodes=2, gpus_per_node=2, device="cpu")
    units = [FSDPUnit(2**22, 1)] * 4
    kw = {"backend": "gloo", "replicate": 2}
    serial = fsdp_step(units, "e4m3", cluster, **kw)
    hidden = fsdp_step(
        units, "e4m3", cluster, replicas_beside_backward=True, backward_s=100.0, **kw
    )
    bare = fsdp_step(units, "e4m3", cluster, replicas_beside_backward=True, **kw)
    each = serial.all_reduce_s / 4
    assert serial.exposed_s == pytest.approx(serial.reduce_scatter_s + serial.all_reduce_s)
    assert hidden.exposed_s == pytest.approx(serial.reduce_scatter_s + each)
    # Without backward to hide behind, each all-reduce still runs beside the
    # later units' reduce-scatters: the worker starts after the first one and
    # is busy from then on (its all-reduce outlasts a reduce-scatter).
    rs_each = serial.reduce_scatter_s / 4
    assert each > rs_each
    assert bare.exposed_s == pytest.approx(rs_each + serial.all_reduce_s)
    assert hidden.all_reduce_s == serial.all_reduce_s and hidden.wire_bytes == serial.wire_bytes
