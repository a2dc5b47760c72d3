"""The FSDP2 step-time benchmark's HSDP setups and its byte counting, tiny settings, no namespaces."""

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from aps_comm.testing import run_distributed
from benchmarks import fsdp
from benchmarks.cluster import add_topology_arguments, cluster_topology

_LAYERS, _WIDTH = 2, 64


def test_sent_bytes_follows_gloos_algorithms() -> None:
    assert fsdp.sent_bytes("all_reduce", 4096, 2) == 4096  # ring: half out, half back
    assert fsdp.sent_bytes("all_reduce", 4096, 4) == 6144
    assert fsdp.sent_bytes("reduce_scatter", 4096, 4) == 6144  # Gloo: an all-reduce
    assert fsdp.sent_bytes("all_gather", 512, 4) == 1536
    assert fsdp.sent_bytes("all_to_all", 4096, 4) == 3072
    with pytest.raises(ValueError, match="'broadcast'"):
        fsdp.sent_bytes("broadcast", 1, 2)
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        fsdp.sent_bytes("all_reduce", 1, 0)


def test_nodes_and_ranks_give_the_ranks_per_node() -> None:
    p = argparse.ArgumentParser()
    add_topology_arguments(p, ranks_default=2)
    topo = cluster_topology(p.parse_args(["--nodes", "2", "--ranks", "4"]), ranks_default=2)
    assert (topo["ranks"], topo["nodes"], topo["ranks_per_node"]) == (4, 2, 2)
    alone = cluster_topology(p.parse_args(["--ranks", "4"]), ranks_default=2)
    assert alone["ranks_per_node"] == 1


def _hsdp_rows(rank: int, world_size: int) -> list[dict[str, Any]]:
    return fsdp.run_setups(
        ["fp32", "hsdp-fp32", "hsdp-bf16", "hsdp-aps-e4m3"],
        layers=_LAYERS,
        width=_WIDTH,
        warmup=0,
        repeats=1,
    )


def test_hsdp_setups_run_and_their_replica_bytes_are_the_formats() -> None:
    rows = {r["setup"]: r for r in run_distributed(_hsdp_rows, 4, env={"LOCAL_WORLD_SIZE": "2"})[0]}
    got = {s: r["collective_bytes_per_step"] for s, r in rows.items()}
    shard = _LAYERS * _WIDTH * _WIDTH // 2  # elements of each rank's shards, per step
    # Native HSDP: each replica pair all-reduces the shard (a 2-rank ring sends it once).
    assert got["hsdp-fp32"]["replica"] == 4 * shard
    assert got["hsdp-bf16"]["replica"] == 2 * shard
    # APS e4m3: one byte per element out (all_to_all half, all_gather half), plus
    # the maxima's MAX all-reduce (a few bytes per unit): a quarter of FP32's.
    maxima = rows["hsdp-aps-e4m3"]["aps_bytes_detail"]["all_reduce_max"]
    assert 0 < maxima <= 16 * _LAYERS
    assert got["hsdp-aps-e4m3"]["replica"] == shard + maxima
    assert got["hsdp-aps-e4m3"]["replica"] / got["hsdp-fp32"]["replica"] == pytest.approx(
        0.25, abs=0.005
    )
    # The timing's one-float MAX all-reduce over the world ring is all that
    # crosses nodes outside the replica groups (ranks 1 and 3 send 6 bytes each).
    for s in ("hsdp-fp32", "hsdp-bf16", "hsdp-aps-e4m3"):
        assert got[s]["cross_node"] == got[s]["replica"] + 3
    # Flat FSDP's world ring crosses nodes on half its hops, and no group is a replica group.
    assert got["fp32"]["replica"] == 0 and got["fp32"]["cross_node"] == got["fp32"]["intra_node"]
    assert all(r["cross_node_bytes_per_step"] is None for r in rows.values())  # no node links
    assert rows["hsdp-aps-e4m3"]["aps_bytes_detail"]["all_to_all"] > 0
    # Phases: only APS HSDP runs the replica hook (aps_comm.fsdp.reduce_shard).
    assert all(v > 0 for v in rows["hsdp-aps-e4m3"]["replica_hook_s"])
    assert all(v == 0 for s in ("fp32", "hsdp-fp32") for v in rows[s]["replica_hook_s"])
    assert all(
        v > 0 for r in rows.values() for k in ("forward_s", "backward_s", "cpu_s") for v in r[k]
    )


def test_hsdp_setups_need_nodes_of_several_ranks() -> None:
    with pytest.raises(SystemExit, match=r"need nodes of several ranks.*got 2 node\(s\) of 1"):
        fsdp.main(["--loopback", "--ranks", "2", "--setups", "hsdp-fp32"])


def _run(setup: str, step: float, cross: float, predicted: float) -> dict[str, Any]:
    return {
        "setup": setup,
        "median_step_s": step,
        "cross_node_bytes_per_step": cross,
        "predicted_over_measured": predicted,
    }


def test_targets_say_each_hit_and_miss() -> None:
    result = {
        "link": {"configured_bits_per_s": 250_000_000},
        "runs": [
            _run("fp32", 3.0, 48.0, 0.9),
            _run("hsdp-fp32", 2.0, 16.0, 1.1),
            _run("hsdp-aps-e4m3", 1.0, 4.0, 1.2),
        ],
    }
    said = fsdp.targets(result)
    assert (
        said[0]
        == "HSDP APS e4m3 crossed nodes with 0.250x HSDP FP32's bytes (target <= 0.26x): hit."
    )
    assert said[1] == "HSDP APS e4m3 stepped 2.00x faster than HSDP FP32 (target >= 2.5x): miss."
    assert said[2].endswith(
        "1.000 s against the fastest flat-FSDP row's 3.000 s (target: faster than every flat row): hit."
    )
    assert said[3].startswith("The model's step within 15% of the measured in 2 of 3 rows")
    assert said[3].endswith("hsdp-aps-e4m3 1.20): miss.")
    # Above 250 Mbit/s there is no speed target; without the HSDP rows, no targets.
    result["link"]["configured_bits_per_s"] = 10**9
    assert not any("stepped" in line for line in fsdp.targets(result))
    assert fsdp.targets({"runs": result["runs"][:1]}) == []


def test_check_docs_matches_a_quoted_speedup_to_speedups_not_step_times(tmp_path: Path) -> None:
    from benchmarks import report

    results = tmp_path / "results"
    results.mkdir()
    run = {"setup": "hsdp-fp32", "median_step_s": 1.521, "speedup_vs_baseline": 2.23}
    data = {"command": "python -m benchmarks.fsdp --nodes 2", "runs": [run]}
    (results / "fsdp_x.json").write_text(json.dumps(data))
    doc = tmp_path / "doc.md"
    doc.write_text("- Another run: 1.52x the step.\n- Unnamed: HSDP APS e4m3 2.23x.\n")
    problems = report.check_docs([doc], results)
    assert len(problems) == 1 and "2.23x" in problems[0] and "fsdp_x.json" in problems[0]


def _topology(unshaped_bits: float | None) -> dict[str, Any]:
    def link(bits: float | None, rtt: float) -> dict[str, Any]:
        return {"bandwidth_bits_per_s": bits, "rtt_s": rtt}

    topo = {
        "nodes": 2,
        "ranks_per_node": 2,
        "link": link(2.4e8, 4e-5),
        "link_intra_node": link(1.28e10, 3.5e-5),
    }
    if unshaped_bits:
        topo["link_unshaped"] = link(unshaped_bits, 3e-5)
    return topo


def test_prediction_is_the_unshaped_step_plus_the_models_link_difference() -> None:
    from aps_perfmodel.cluster import custom_cluster
    from aps_perfmodel.fsdp import FSDPUnit, fsdp_step

    setups, unshaped = ["fp32", "hsdp-fp32", "hsdp-aps-e4m3"], {"fp32": 0.5, "hsdp-fp32": 0.3}
    unshaped["hsdp-aps-e4m3"] = 0.35
    rows, note = fsdp.predict(setups, 2, 2048, _topology(1.2e10), True, unshaped)
    assert note.startswith("predicted step = the setup's step measured with the node links")

    def model(bits: float, rtt: float, setup: str) -> float:
        c = custom_cluster(
            bits / 8, rtt / 2, nodes=2, gpus_per_node=2, intra_bandwidth=1.6e9,
            intra_latency=1.75e-5, device="cpu",
        )  # fmt: skip
        extra = {"replicate": 2} if setup.startswith("hsdp") else {}
        fmt = setup.removeprefix("hsdp-").removeprefix("aps-")
        return fsdp_step([FSDPUnit(2048 * 2048, 1)] * 2, fmt, c, backend="gloo", **extra).step_s

    for s in setups:
        shaped, fast = model(2.4e8, 4e-5, s), model(1.2e10, 3e-5, s)
        assert rows[s]["link_step_s"] == pytest.approx(shaped)
        assert rows[s]["unshaped_link_step_s"] == pytest.approx(fast)
        assert rows[s]["step_s"] == pytest.approx(unshaped[s] + shaped - fast)
    # Without the unshaped steps (or link): the model's link time alone, said so.
    alone, note = fsdp.predict(setups, 2, 2048, _topology(None), True, unshaped)
    assert note.endswith("(links only)") and alone["fp32"]["step_s"] == alone["fp32"]["link_step_s"]
    # reshard_after_forward=False: one all-gather per unit and step, not two.
    kept, _ = fsdp.predict(["fp32"], 2, 2048, _topology(None), False)
    assert kept["fp32"]["all_gather_s"] == pytest.approx(alone["fp32"]["all_gather_s"] / 2)


def test_floor_says_the_unshaped_steps_and_the_links_part() -> None:
    def run(setup: str, step: float, fast: float) -> dict[str, Any]:
        return {"setup": setup, "unshaped_median_step_s": fast, "link_part_s": step - fast}

    result = {
        "runs": [run("fp32", 3.0, 0.5), run("hsdp-fp32", 1.5, 0.3), run("hsdp-aps-e4m3", 0.9, 0.6)]
    }
    assert fsdp.floor(result) == (
        "Unshaped (node links at the veths' rate), the HSDP rows took 0.300-0.600 s a step "
        "(HSDP FP32 0.300 s, APS e4m3 0.600 s): a floor the link does not set. The shaped "
        "link added 1.200 s to HSDP FP32's step and 0.300 s to HSDP APS e4m3's: 4.00x on "
        "the link's part alone."
    )
    del result["runs"][2]["link_part_s"]
    assert fsdp.floor(result) is None


def test_misses_say_how_the_step_grew_against_the_models_link_time() -> None:
    def run(setup: str, ratio: float, part: float, model: float) -> dict[str, Any]:
        return {
            "setup": setup,
            "predicted_over_measured": ratio,
            "link_part_s": part,
            "predicted_link_part_s": model,
            "cpu_s_per_step": 0.9,
            "unshaped_cpu_s_per_step": 0.8,
            "unshaped_median_step_s": 0.45,
            "unshaped_round_median_step_s": [0.4, 0.45, 0.5],
        }

    result = {
        "ranks": 4,
        "machine": {"cores_available": 2},
        "runs": [run("hsdp-fp32", 1.04, 1.0, 1.1), run("hsdp-aps-e4m3", 1.2, 0.2, 0.3)],
    }
    result["runs"].append(run("fp32", 0.8, 3.5, 3.0))
    assert fsdp.misses(result) == [
        "hsdp-aps-e4m3 (predicted / measured 1.20): the shaped link added 0.200 s to the "
        "step, the model's link time 0.300 s; the ranks spent 0.900 s of CPU per step shaped "
        "and 0.800 s unshaped (0.400 s on 2 cores, against the unshaped step's 0.450 s). "
        "The step grew 0.100 s less than the model's link time; the unshaped rounds' medians "
        "spread over 0.400-0.500 s. With 4 ranks on 2 cores the unshaped step already waits "
        "beside its CPU work, and a rank waiting on the link leaves its core to another "
        "rank's work, which the prediction does not credit.",
        "fp32 (predicted / measured 0.80): the shaped link added 3.500 s to the step, the "
        "model's link time 3.000 s; the ranks spent 0.900 s of CPU per step shaped and "
        "0.800 s unshaped (0.400 s on 2 cores, against the unshaped step's 0.450 s). The "
        "link cost 0.500 s more than the model prices; the unshaped rounds' medians spread "
        "over 0.400-0.500 s.",
    ]
