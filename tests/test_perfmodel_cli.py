"""The Python API's predict and sweep, and the ``aps-perfmodel`` command line (invoked in-process
through ``main(argv)``, and as a user runs it, in a subprocess, where what reaches the terminal
is what the test reads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aps_perfmodel import (
    ComputeTime,
    ModelSpec,
    assign_buckets,
    custom_cluster,
    get_cluster,
    get_format,
    get_model,
    predict,
    sweep,
)
from aps_perfmodel.choices import BLOCK_SIZES
from aps_perfmodel.cli import main as cli_main
from aps_perfmodel.units import parse_bandwidth, parse_time

# --- API, CLI ----------------------------------------------------------------------


def test_predict_cluster_sizes_and_sweep() -> None:
    assert get_cluster("dgx-h100", world_size=64).topology.nodes == 8
    with pytest.raises(ValueError, match="multiple"):
        get_cluster("dgx-h100", world_size=12)
    rows = sweep(
        get_model("bert-large"),
        get_cluster("10gbe"),
        bandwidths=[1e8, 1e10],
        world_sizes=[4, 16],
        compute=ComputeTime.from_step_time(0.3),
    )
    assert len(rows) == 12
    slow = [r for r in rows if r.bandwidth_Bps == 1e8 and r.format == "e4m3"]
    fast = [r for r in rows if r.bandwidth_Bps == 1e10 and r.format == "e4m3"]
    assert all(s.speedup_vs_fp32 > f.speedup_vs_fp32 for s, f in zip(slow, fast, strict=True))


def test_cli_predict_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(
        [
            "predict",
            "--model",
            "resnet50",
            "--world-size",
            "64",
            "--cluster",
            "100gbe",
            "--fmt",
            "e4m3",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["formats"]) == {"fp32", "fp16", "e4m3"}
    for v in out["formats"].values():
        assert {"comm_s", "step_s", "speedup_vs_fp32"} <= set(v)
    assert out["formats"]["fp32"]["speedup_vs_fp32"] == 1.0


def test_cli_predict_params_alone_is_communication_only(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["predict", "--params", "25.6M", "--bandwidth", "10Gbit", "--latency", "20us"]
    argv += ["--nodes", "16"]
    assert cli_main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["communication_only"] is True and out["compute"] is None
    assert "'25.6M params' has no FLOP counts" in out["note"]
    # It says the comm speedup is not the step's, and how to ask for the step.
    assert "'comm speedup' is not the step speedup" in out["note"]
    for how in ("--step-time", "--forward-time/--backward-time", "--model with a preset"):
        assert how in out["note"], how
    # Nothing was estimated, so no batch or MFU is claimed.
    assert out["assumptions"]["compute"] == "none: communication only"
    assert "batch_per_rank" not in out["assumptions"] and "mfu" not in out["assumptions"]
    fmts = out["formats"]
    assert list(fmts) == ["fp32", "fp16", "e4m3"]
    for v in fmts.values():
        # No step time to report: the step fields are absent, not a copy of comm_s.
        assert set(v) == {
            "format",
            "strategy",
            "chosen",
            "scaling",
            "comm_s",
            "comm_speedup_vs_fp32",
            "wire_bytes",
            "inter_node_bytes",
            "exponent_bytes",
        }
    assert fmts["fp32"]["comm_speedup_vs_fp32"] == 1.0
    # The same communication as a prediction with compute times given.
    model = ModelSpec.from_params("25.6M")
    cluster = custom_cluster(parse_bandwidth("10Gbit"), parse_time("20us"), nodes=16)
    with_compute = predict(model, cluster, ["e4m3"], ComputeTime.from_step_time(0.1))
    for name, v in fmts.items():
        assert v["wire_bytes"] == with_compute.formats[name].wire_bytes
    e4m3 = fmts["e4m3"]["comm_speedup_vs_fp32"]
    assert e4m3 == pytest.approx(fmts["fp32"]["comm_s"] / fmts["e4m3"]["comm_s"])
    assert 1.0 < fmts["fp16"]["comm_speedup_vs_fp32"] < e4m3 < 4.0

    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "compute  none: communication only" in text and "comm speedup" in text
    flat = " ".join(text.split())  # the note is wrapped
    assert "'comm speedup' is not the step speedup; for the step speedup give --step-time" in flat
    header = next(line for line in text.splitlines() if line.startswith("format "))
    assert header.split() == ["format", "strategy", "wire/rank", "across/rank", "comm", "comm",
                              "speedup"]  # fmt: skip
    assert "exposed" not in text

    with pytest.raises(SystemExit, match=r"--plot plots step times: '25\.6M params' has no FLOP"):
        cli_main([*argv, "--plot", str(tmp_path / "p.png")])
    assert not (tmp_path / "p.png").exists()

    assert cli_main([*argv, "--step-time", "100ms"]) == 0
    assert "communication only" not in capsys.readouterr().out


def test_cli_predict_table_plot_and_sweep(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "s.png"
    rc = cli_main(
        [
            "predict",
            "--params",
            "25.6M",
            "--bandwidth",
            "10Gbit",
            "--latency",
            "20us",
            "--nodes",
            "4",
            "--step-time",
            "100ms",
            "--fmt",
            "bf16",
            "--plot",
            str(png),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "speedup" in text and "bf16" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv_path = tmp_path / "s.csv"
    rc = cli_main(
        [
            "sweep",
            "--model",
            "llama-7b",
            "--cluster",
            "dgx-h100",
            "--world-sizes",
            "8,16",
            "--bandwidths",
            "100Gbit,400Gbit",
            "--out",
            str(csv_path),
        ]
    )
    lines = csv_path.read_text().strip().splitlines()
    assert (
        rc == 0 and lines[0].startswith("model,cluster,world_size") and len(lines) == 1 + 2 * 2 * 3
    )
    # The CSV's step times rest on an estimate; what it assumed goes to stderr.
    err = capsys.readouterr().err
    assert "aps-perfmodel: assumed batch 32 per rank, a sequence of 2048 tokens each" in err
    assert "h100 at 40% MFU in bf16" in err


def test_calibrate_needs_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from aps_comm.__main__ import main as aps_comm_main

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit, match="aps-launch or torchrun"):
        aps_comm_main(["calibrate", "--out", "unused.json"])


def test_fsdp_cli_cuts_units_and_compares_reduce_scatters(capsys) -> None:
    from aps_perfmodel.cli import fsdp_units, main
    from aps_perfmodel.models import ModelSpec, TensorSpec

    model = ModelSpec("m", tuple(TensorSpec(f"t{i}", n) for i, n in enumerate([30, 25, 20, 25])))
    units = fsdp_units(model, 2, 4)
    # Shares of 50 of the 100 elements: the first unit closes once 50 are in
    # (30 + 25); each tensor padded to a multiple of 4.
    assert [(u.numel, u.n_params) for u in units] == [(32 + 28, 2), (20 + 28, 2)]
    assert len(fsdp_units(model, 9, 1)) == 4  # never more units than tensors
    assert (
        main(
            [
                "fsdp",
                "--params",
                "8M",
                "--world-size",
                "4",
                "--bandwidth",
                "1Gbit",
                "--latency",
                "50us",
                "--backend",
                "gloo",
                "--json",
            ]
        )
        == 0
    )
    rows = {r["format"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    # Gloo's FP32 reduce-scatter is an all-reduce: APS e4m3 sends 1/8 of its bytes.
    assert rows["fp32"]["wire_bytes"] == pytest.approx(8 * rows["e4m3"]["wire_bytes"], rel=0.01)
    assert rows["e4m3"]["aps"] and not rows["bf16"]["aps"]
    assert (
        rows["e4m3"]["reduce_scatter_s"]
        < rows["bf16"]["reduce_scatter_s"]
        < rows["fp32"]["reduce_scatter_s"]
    )


def _predict_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert cli_main(["predict", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_predict_says_what_it_assumed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "bert-large", "--cluster", "10gbe", "--world-size", "8"]
    out = _predict_json(capsys, *argv)
    a = out["assumptions"]
    assert a["compute"] == "estimated from the model's FLOPs"
    assert (a["batch_per_rank"], a["seq_len"], a["device"]) == (32, 512, "a100")
    assert (a["mfu"], a["compute_dtype"], a["optimizer"]) == (0.4, "bf16", "adam")
    assert a["sample"] == "a sequence of 512 tokens" and a["bucket_cap_mb"] == 25.0
    assert "inside its node and across nodes" in a["wire_bytes"]
    # The assumptions are the ones used: a quarter of the batch, a quarter of the compute.
    small = _predict_json(capsys, *argv, "--batch-size", "8", "--device", "h100", "--mfu", "0.5")
    assert (small["assumptions"]["batch_per_rank"], small["assumptions"]["device"]) == (8, "h100")
    assert small["assumptions"]["mfu"] == 0.5
    assert small["compute"]["forward_s"] < out["compute"]["forward_s"] / 4
    speedup = out["formats"]["e4m3"]["speedup_vs_fp32"]
    assert small["formats"]["e4m3"]["speedup_vs_fp32"] > speedup

    assert cli_main(["predict", *argv]) == 0
    text = capsys.readouterr().out
    flat = " ".join(text.split())
    assert "assumed batch 32 per rank, a sequence of 512 tokens each (--batch-size)" in flat
    assert "a100 at 40% MFU in bf16 (--device, --mfu, --compute-dtype); adam (--optimizer)" in flat
    assert "wire/rank: bytes one rank sends per step for the gradients, inside its node" in flat

    # Given compute: no batch or MFU claimed, the split said.
    given = _predict_json(capsys, *argv, "--step-time", "300ms")
    assert given["assumptions"]["compute"] == "given: --step-time, split forward:backward 1:2"
    assert "batch_per_rank" not in given["assumptions"]
    assert cli_main(["predict", *argv, "--step-time", "300ms"]) == 0
    text = capsys.readouterr().out
    assert "assumed  compute given: --step-time" in text and "MFU" not in text


def test_cli_choices_are_case_insensitive_as_the_api(capsys: pytest.CaptureFixture[str]) -> None:
    lower = _predict_json(
        capsys,
        *("--model", "resnet50", "--cluster", "100gbe", "--world-size", "16"),
        *("--fmt", "e4m3", "--device", "h100", "--strategy", "two_phase"),
    )
    mixed = _predict_json(
        capsys,
        *("--model", "ResNet50", "--cluster", "100GbE", "--world-size", "16"),
        *("--fmt", "E4M3", "--device", "H100", "--strategy", "Two_Phase"),
    )
    assert mixed == lower
    # Any name the API takes: an alias is its format.
    fp8 = _predict_json(
        capsys, "--model", "resnet50", "--cluster", "100gbe", "--world-size", "4", "--fmt", "FP8"
    )
    assert list(fp8["formats"]) == ["fp32", "fp16", "e4m3"]
    with pytest.raises(SystemExit):
        cli_main(["predict", "--model", "resnet50", "--cluster", "100gbe", "--fmt", "e9"])
    assert "unknown number format 'e9'" in capsys.readouterr().err
    # An e<E>m<M> name that breaks a limit says which, in one line.
    with pytest.raises(SystemExit):
        cli_main(["predict", "--model", "resnet50", "--cluster", "100gbe", "--fmt", "e9m9"])
    err = capsys.readouterr().err
    assert "argument --fmt: number format 'e9m9' has 9 exponent bits; a format has 1 to 8" in err
    assert "Traceback" not in err


def test_cli_wire_per_rank_counts_in_node_bytes_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 4 nodes of 8: hierarchical sends FP32 inside the node, e4m3 across.
    argv = ["--model", "gpt2-xl", "--cluster", "100gbe", "--world-size", "32"]
    argv += ["--gpus-per-node", "8", "--strategy", "hierarchical", "--step-time", "1s"]
    out = _predict_json(capsys, *argv)["formats"]
    n = get_model("gpt2-xl").total_params
    nodes, per_node, p = 4, 8, 32
    # Per element: FP32 to 7 of 8 node peers and e4m3 back, 2 x 1 byte of 1/8 across.
    e4m3_all = n * ((4 + 1) * (per_node - 1) / per_node + 2 * (nodes - 1) / (nodes * per_node))
    assert out["e4m3"]["wire_bytes"] == pytest.approx(e4m3_all)
    assert out["fp16"]["wire_bytes"] == pytest.approx(2 * 2 * n * (p - 1) / p)
    assert out["e4m3"]["wire_bytes"] > out["fp16"]["wire_bytes"]
    # Across nodes, each of a node's 8 ranks all-reduces its 1/8: e4m3 half of fp16's.
    across = 2 * n * (nodes - 1) / (nodes * per_node)
    assert out["e4m3"]["inter_node_bytes"] == pytest.approx(across)
    assert out["fp16"]["inter_node_bytes"] == pytest.approx(2 * across)
    assert out["fp32"]["inter_node_bytes"] == pytest.approx(4 * across)

    assert cli_main(["predict", *argv]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "across/rank" in flat
    assert (
        "e4m3 sends more than fp16 per rank but 2.0x fewer bytes than fp16 across nodes: "
        "hierarchical first reduces each chunk in FP32 inside the node"
    ) in flat


def test_cli_block_scaling_flags_round_trip_into_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "resnet50", "--cluster", "1gbe", "--world-size", "4", "--fmt", "e2m1"]
    argv += ["--strategy", "two_phase", "--step-time", "100ms"]
    out = _predict_json(capsys, *argv, "--scaling", "Block", "--block-size", "64")
    a = out["assumptions"]
    assert (out["scaling"], out["block_size"]) == ("block", 64)
    assert (a["scaling"], a["block_size"]) == ("block", 64)
    assert (
        "one exponent byte per 64 elements" in a["scaling_note"]
        and "0.5 + 1/64" in a["scaling_note"]
    )
    assert "the exponent bytes too" in a["wire_bytes"] and "block exponents" in a["exponent_bytes"]
    fmts = out["formats"]
    assert fmts["e2m1"]["scaling"] == "block"
    assert fmts["fp32"]["scaling"] == fmts["fp16"]["scaling"] == "none"
    assert fmts["fp32"]["exponent_bytes"] == fmts["fp16"]["exponent_bytes"] == 0.0
    # The API's numbers for the same question.
    api = predict(
        get_model("resnet50"),
        get_cluster("1gbe", world_size=4),
        ["e2m1"],
        ComputeTime.from_step_time(0.1),
        strategy="two_phase",
        scaling="block",
        block_size=64,
    ).formats["e2m1"]
    assert fmts["e2m1"]["exponent_bytes"] == api.exponent_bytes > 0
    assert fmts["e2m1"]["wire_bytes"] == api.wire_bytes
    assert fmts["e2m1"]["step_s"] == api.step_s
    # Per-layer scaling (the default) sends the same payload and no exponent bytes.
    layer = _predict_json(capsys, *argv)
    assert (layer["scaling"], layer["block_size"], layer["assumptions"]["scaling"]) == (
        "layer",
        None,
        "layer",
    )
    assert layer["formats"]["e2m1"]["exponent_bytes"] == 0.0
    # Beside the exponents, each bucket's first chunk carries its layers' flags
    # and a chunk byte to each of the 3 peers.
    numels = [t.numel for t in get_model("resnet50").tensors]
    flags = sum(len(b) + 1 for b in assign_buckets(numels)) * 3
    assert fmts["e2m1"]["wire_bytes"] - fmts["e2m1"]["exponent_bytes"] - flags == pytest.approx(
        layer["formats"]["e2m1"]["wire_bytes"]
    )
    assert fmts["e2m1"]["step_s"] > layer["formats"]["e2m1"]["step_s"]
    # The text says which scaling it assumed and what wire/rank holds.
    assert cli_main(["predict", *argv, "--scaling", "block"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "scaling block for e2m1: one exponent byte per 32 elements of each tensor" in flat
    assert "e2m1's wire/rank includes" in flat and "of block exponents" in flat
    assert cli_main(["predict", *argv]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "scaling layer for e2m1: one float32 maximum per tensor" in flat
    assert "block exponents" not in flat
    # The sweep says it too (its CSV has no room for it).
    sweep_argv = ["sweep", "--model", "resnet50", "--cluster", "1gbe", "--fmt", "e2m1"]
    assert cli_main([*sweep_argv, "--world-sizes", "4", "--scaling", "block"]) == 0
    assert "aps-perfmodel: scaling block for e2m1" in capsys.readouterr().err


def test_cli_block_exponents_price_rank_and_agreed_as_the_api_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--model", "resnet50", "--cluster", "1gbe", "--world-size", "8", "--fmt", "e2m1"]
    argv += ["--strategy", "two_phase", "--step-time", "100ms", "--scaling", "block"]
    default = _predict_json(capsys, *argv)
    rank = _predict_json(capsys, *argv, "--block-exponents", "RANK")
    agreed = _predict_json(capsys, *argv, "--block-exponents", "agreed")
    # The hook's default is each rank's own exponents, and so is the model's.
    assert default == rank
    assert (rank["block_exponents"], rank["assumptions"]["block_exponents"]) == ("rank", "rank")
    assert (agreed["block_exponents"], agreed["assumptions"]["block_exponents"]) == (
        "agreed",
        "agreed",
    )
    assert "each rank's own" in rank["assumptions"]["scaling_note"]
    assert "agreed across ranks" in agreed["assumptions"]["scaling_note"]
    assert "one MAX all-reduce agrees them" in agreed["assumptions"]["exponent_bytes"]
    model, cluster = get_model("resnet50"), get_cluster("1gbe", world_size=8)
    for out, exponents in ((rank, "rank"), (agreed, "agreed")):
        api = predict(
            model,
            cluster,
            ["e2m1"],
            ComputeTime.from_step_time(0.1),
            strategy="two_phase",
            scaling="block",
            block_exponents=exponents,
        )
        assert api.to_dict()["block_exponents"] == exponents
        assert out["formats"]["e2m1"]["exponent_bytes"] == api.formats["e2m1"].exponent_bytes
        assert out["formats"]["e2m1"]["step_s"] == api.formats["e2m1"].step_s
    # Own exponents ride (N-1)/N of the blocks with the shards, with the layer
    # flags and a chunk byte to the 7 peers in each bucket's first chunk; agreeing
    # them costs a ring all-reduce, 2(N-1)/N; both add the owners' with the all-gather.
    r, a = rank["formats"]["e2m1"], agreed["formats"]["e2m1"]
    flags = sum(len(b) + 1 for b in assign_buckets([t.numel for t in model.tensors])) * 7
    assert a["exponent_bytes"] == pytest.approx(r["exponent_bytes"] * 3 / 2)
    assert a["wire_bytes"] - r["wire_bytes"] == pytest.approx(
        r["exponent_bytes"] / 2 - flags, rel=1e-4
    )
    assert a["step_s"] > r["step_s"]
    # The baselines scale nothing either way.
    assert agreed["formats"]["fp32"] == rank["formats"]["fp32"]
    # Per-layer scaling has no block exponents to say anything of.
    assert _predict_json(capsys, *argv[:-2])["block_exponents"] is None
    # The sweep prices the same choice.
    sweep_argv = ["sweep", "--model", "resnet50", "--cluster", "1gbe", "--fmt", "e2m1"]
    sweep_argv += ["--strategy", "two_phase", "--world-sizes", "8", "--scaling", "block"]
    steps = {}
    for exponents in ("rank", "agreed"):
        assert cli_main([*sweep_argv, "--block-exponents", exponents]) == 0
        captured = capsys.readouterr()
        line = [row for row in captured.out.splitlines() if ",e2m1," in row]
        steps[exponents] = float(line[0].split(",")[8])
    assert steps["agreed"] > steps["rank"]


def test_bad_block_size_and_scaling_are_errors_naming_the_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["predict", "--model", "resnet50", "--cluster", "1gbe", "--world-size", "4"]
    for bad in ("48", "512", "4", "x"):
        with pytest.raises(SystemExit):
            cli_main([*argv, "--scaling", "block", "--block-size", bad])
        err = capsys.readouterr().err
        if bad.isdigit():
            assert (
                f"block_size must be a power of two from 8 to 256 {BLOCK_SIZES}, got {bad}" in err
            )
        else:
            assert f"block_size must be an integer in {BLOCK_SIZES}, got 'x'" in err
    with pytest.raises(SystemExit, match="--block-size 64 is for --scaling block, not layer"):
        cli_main([*argv, "--block-size", "64"])
    with pytest.raises(
        SystemExit, match="--block-exponents agreed is for --scaling block, not layer"
    ):
        cli_main([*argv, "--block-exponents", "agreed"])
    with pytest.raises(SystemExit):
        cli_main([*argv, "--scaling", "block", "--block-exponents", "own"])
    assert "invalid choice: 'own'" in capsys.readouterr().err
    fsdp = ["fsdp", *argv[1:], "--fmt", "e2m1", "--scaling", "block"]
    with pytest.raises(SystemExit, match="FSDP2's reduce-scatter always agrees block exponents"):
        cli_main([*fsdp, "--block-exponents", "rank"])
    assert cli_main([*fsdp, "--block-exponents", "agreed"]) == 0
    assert "agreed across ranks" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main([*argv, "--scaling", "bucket"])
    assert "invalid choice: 'bucket'" in capsys.readouterr().err
    # fp16 and bf16 are predicted as the unscaled hooks users compare against.
    with pytest.raises(SystemExit, match="--scaling block needs an APS --fmt"):
        cli_main([*argv, "--fmt", "bf16", "--scaling", "block"])
    # The API names the value too.
    model, cluster = get_model("resnet50"), get_cluster("1gbe", world_size=4)
    with pytest.raises(ValueError, match="got 48"):
        predict(model, cluster, ["e4m3"], scaling="block", block_size=48)
    with pytest.raises(ValueError, match="got 300"):
        get_format("e4m3", scaling="block", block_size=300)
    with pytest.raises(
        ValueError, match=r"the model prices scaling \('layer', 'block'\), got 'none'"
    ):
        predict(model, cluster, ["e4m3"], scaling="none")
    with pytest.raises(ValueError, match="scaling must be one of"):
        get_format("e4m3", scaling="blocks")
    with pytest.raises(ValueError, match=r"block_exponents must be one of.*got 'own'"):
        predict(model, cluster, ["e4m3"], scaling="block", block_exponents="own")
    # fp16 and bf16 are predicted as torch's cast hooks, which scale nothing.
    with pytest.raises(ValueError, match="bf16 is predicted as torch's cast hook"):
        predict(model, cluster, ["bf16"], scaling="block")


def test_fsdp_block_scaling_adds_only_the_exponents_all_reduce_and_codec(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from aps_perfmodel import collectives as C
    from aps_perfmodel.cli import fsdp_units
    from aps_perfmodel.fsdp import FSDPUnit, fsdp_step, reduce_scatter_time

    e4m3 = get_format("e4m3", scaling="block")
    # On 4 ranks, rows of 96 and 8 elements: 3 + 1 blocks per rank's row.
    unit = FSDPUnit(4 * (96 + 8), 2, (4 * 96, 4 * 8))
    assert unit.blocks(e4m3, 4) == 4 * (3 + 1)
    assert FSDPUnit(416, 2).blocks(e4m3, 4) == 13 + 2 * 4 - 1  # sizes unknown: the most
    c = custom_cluster(125e6, 50e-6, nodes=4, device="cpu")
    layer = reduce_scatter_time(unit, get_format("e4m3"), c)
    block = reduce_scatter_time(unit, e4m3, c)
    assert block.collective_s == layer.collective_s  # the same all-to-all of the payload
    # One MAX all-reduce of a byte per block and the unit's flag.
    assert block.maxima_s == pytest.approx(C.hierarchical_allreduce(16 + 1, c.topology, "auto"))
    assert block.exponent_bytes == 2 * 16 * 3 / 4
    assert block.wire_bytes == layer.wire_bytes + block.exponent_bytes
    assert block.codec_s > layer.codec_s
    # The CLI: its units know their parameters, so the blocks are exact.
    argv = ["fsdp", "--model", "resnet50", "--world-size", "4", "--cluster", "1gbe", "--json"]
    assert cli_main([*argv, "--scaling", "block", "--block-size", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["scaling"], out["block_size"]) == ("block", 16)
    rows = {r["format"]: r for r in out["rows"]}
    units = fsdp_units(get_model("resnet50"), 8, 4)
    cluster = get_cluster("1gbe", world_size=4)
    fmt = get_format("e4m3", scaling="block", block_size=16)
    want = fsdp_step(units, fmt, cluster)
    assert rows["e4m3"]["exponent_bytes"] == want.exponent_bytes
    assert want.exponent_bytes == pytest.approx(sum(2 * u.blocks(fmt, 4) * 3 / 4 for u in units))
    sizes = [-(-t.numel // 4) * 4 for t in get_model("resnet50").tensors]
    assert sum(u.blocks(fmt, 4) for u in units) == sum(4 * -(-(s // 4) // 16) for s in sizes)
    assert rows["fp32"]["exponent_bytes"] == rows["bf16"]["exponent_bytes"] == 0.0


_COMM_ONLY = ["predict", "--params", "25.6M", "--nodes", "16"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Each was a traceback (ZeroDivisionError), "cannot parse", or silently a
        # different quantity (10 bytes/s, 20 s).
        (["--bandwidth", "0Gbit"], "argument --bandwidth: bandwidth must be positive, got '0Gbit'"),
        (
            ["--bandwidth", "-10Gbit"],
            "argument --bandwidth: bandwidth must be positive, got '-10Gbit'",
        ),
        (
            ["--bandwidth=-10Gbit"],
            "argument --bandwidth: bandwidth must be positive, got '-10Gbit'",
        ),
        (["--bandwidth", "10"], "argument --bandwidth: bandwidth '10' has no unit"),
        (["--bandwidth", "10Gbit", "--latency", "20"], "argument --latency: time '20' has no unit"),
        (["--bandwidth", "10Gbit", "--latency", "-20us"], "time must be zero or more, got '-20us'"),
        (["--bandwidth", "10Gbit", "--params", "-25.6M"], "count must be positive, got '-25.6M'"),
        (
            ["--bandwidth", "10Gbit", "--step-time", "0s"],
            "argument --step-time: time must be positive",
        ),
        (
            ["--bandwidth", "10Gbit", "--world-size", "0"],
            "argument --world-size: must be a positive",
        ),
        (["--bandwidth", "10Gbit", "--mfu", "40"], "argument --mfu: must be a fraction in (0, 1]"),
        (["--bandwidth", "10Gbit", "--bucket-cap-mb", "-1"], "argument --bucket-cap-mb: must be a"),
    ],
)
def test_cli_quantities_are_positive_with_units_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main([*_COMM_ONLY, *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("aps-perfmodel")


def test_cli_lists_and_calibration_sizes_are_checked_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sweep = ["sweep", "--params", "25.6M", "--bandwidth", "1Gbit"]
    for argv, message in (
        ([*sweep, "--world-sizes", "8,-1"], "argument --world-sizes: must be a positive integer"),
        ([*sweep, "--world-sizes", "8", "--bandwidths", "1Gbit,0Gbit"], "got '0Gbit'"),
    ):
        with pytest.raises(SystemExit):
            cli_main(argv)
        assert message in capsys.readouterr().err, argv
    from aps_comm.__main__ import main as aps_comm_main

    for argv, message in (
        (["calibrate", "--sizes", "1MiB,-4KiB"], "argument --sizes: size must be positive"),
        (["calibrate", "--repeats", "0"], "argument --repeats: must be a positive integer"),
    ):
        with pytest.raises(SystemExit):
            aps_comm_main(argv)
        assert message in capsys.readouterr().err, argv


def test_cli_zero_latency_is_an_ideal_link_not_the_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*_COMM_ONLY, "--bandwidth", "10Gbit", "--json"]
    assert cli_main([*argv, "--latency", "0"]) == 0
    ideal = json.loads(capsys.readouterr().out)["formats"]["fp32"]["comm_s"]
    assert cli_main(argv) == 0  # the documented default, 10us
    default = json.loads(capsys.readouterr().out)["formats"]["fp32"]["comm_s"]
    assert ideal < default


def test_a_model_given_as_a_count_says_what_is_wrong_with_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(["predict", "--model", "-5M", "--cluster", "100gbe", "--world-size", "8"]) == 2
    assert "error: model '-5M': count must be positive, got '-5M'" in capsys.readouterr().err


# --- the command as a user runs it: subprocesses ---------------------------------------

_ROOT = Path(__file__).resolve().parents[1]


def _perfmodel(*argv: str, cwd: Path = _ROOT) -> subprocess.CompletedProcess[str]:
    """``aps-perfmodel ARGV`` in a fresh interpreter, as from the shell."""
    return subprocess.run(
        [sys.executable, "-m", "aps_perfmodel.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The error of a refused command: status 2, one line on stderr, nothing on stdout."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "", proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aps-perfmodel: error: "), proc.stderr
    return lines[0]


def test_conflicting_nodes_and_world_size_is_an_error_naming_both() -> None:
    # It predicted for 2 nodes of 8 (--world-size won) and said nothing.
    line = _one_line_error(
        _perfmodel(
            *("predict", "--model", "resnet50", "--cluster", "100gbe"),
            *("--nodes", "4", "--gpus-per-node", "8", "--world-size", "16"),
        )
    )
    assert "--world-size 16 conflicts with --nodes 4 x 8 (--gpus-per-node) = 32 ranks" in line


def test_nodes_of_a_preset_count_its_devices_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    # "--cluster dgx-h100 --nodes 2" is 2 nodes of 8, not 2 ranks.
    out = _predict_json(capsys, "--model", "resnet50", "--cluster", "dgx-h100", "--nodes", "2")
    assert out["world_size"] == 16
    assert (
        _predict_json(
            capsys,
            "--model",
            "resnet50",
            "--cluster",
            "dgx-h100",
            "--nodes",
            "2",
            "--world-size",
            "16",
        )
        == out
    )


def test_a_reader_that_stops_early_ends_the_command_quietly() -> None:
    # `aps-perfmodel sweep ... | head -2`: the reader is gone before the CSV is written
    # (here deterministically: the pipe has no reader at all).
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "aps_perfmodel.cli", "sweep", "--model", "resnet50"),
                *("--cluster", "1gbe", "--world-sizes", "8,16,32,64", "--bandwidths", "1Gbit"),
            ],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=_ROOT,
        )
    finally:
        os.close(write)
    # As SIGPIPE ends a Unix tool: status 128 + 13, and no traceback.
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--profile", "missing.json"],
            "--profile missing.json: No such file or directory",
        ),
        (
            ["--profile", "notjson.json"],
            "--profile notjson.json is not a profile JSON (JSONDecodeError: Expecting value",
        ),
        (["--plot", "no/such/dir/x.png"], "--plot no/such/dir/x.png: no folder 'no/such/dir'"),
        (
            ["sweep", "--world-sizes", "8", "--out", "no/such/dir/x.csv"],
            "--out no/such/dir/x.csv: no folder 'no/such/dir'",
        ),
    ],
    ids=["missing-profile", "profile-not-json", "plot-folder", "sweep-out-folder"],
)
def test_a_bad_file_is_one_line_naming_it(argv: list[str], message: str, tmp_path: Path) -> None:
    (tmp_path / "notjson.json").write_text("not json\n")
    command = argv[0] if argv[0] == "sweep" else "predict"
    flags = argv[1:] if command == "sweep" else argv
    base = ["--model", "resnet50", "--cluster", "1gbe"]
    if command == "predict":
        base += ["--world-size", "8"]
    line = _one_line_error(_perfmodel(command, *base, *flags, cwd=tmp_path))
    assert message in line, line
    assert not (tmp_path / "no").exists()


def test_predict_lists_the_intra_node_link_and_v100s_dtype() -> None:
    proc = _perfmodel(
        *("predict", "--model", "resnet50", "--nodes", "2", "--gpus-per-node", "4"),
        *("--bandwidth", "10Gbit", "--device", "v100"),
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # the lines are wrapped
    assert (
        "inter-node 10 Gbit/s per node, shared by its 4 devices, 10 us per message "
        "(--bandwidth, --latency); intra-node 200 Gbit/s, 5 us per message "
        "(--intra-bandwidth, --intra-latency)" in text
    ), text
    # V100 has no BF16: its mixed precision is FP16, and the estimate runs at that peak.
    assert "v100 at 40% MFU in fp16" in text and "bf16" not in text.split("format")[0]


def test_v100_estimates_compute_in_fp16(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "resnet50", "--world-size", "8", "--cluster", "1gbe", "--device", "v100"]
    default = _predict_json(capsys, *argv)
    fp16 = _predict_json(capsys, *argv, "--compute-dtype", "fp16")
    assert default["assumptions"]["compute_dtype"] == "fp16"
    assert default["compute"] == fp16["compute"]
    flops = get_model("resnet50").forward_flops_per_sample * 32
    assert default["compute"]["forward_s"] == pytest.approx(flops / (125e12 * 0.4))


def test_a_format_below_8_bits_without_blocks_says_it_does_not_train() -> None:
    proc = _perfmodel(
        "predict", "--model", "resnet50", "--world-size", "8", "--cluster", "1gbe", "--fmt", "e2m1"
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert (
        "caveat e2m1 has 4 bits: with one exponent per tensor (--scaling layer) most of its "
        "gradients fall below its smallest value and flush to zero" in text
    ), text
    assert "block scaling is what trains: --scaling block (default --block-size 32)" in text


@pytest.mark.parametrize("fmt", ["e2m1", "e3m2"])
def test_every_output_carries_the_low_bit_caveat_and_only_without_blocks(
    fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", "resnet50", "--world-size", "8", "--cluster", "1gbe", "--fmt", fmt]
    assert "flush to zero" in _predict_json(capsys, *argv)["assumptions"]["caveat"]
    assert "caveat" not in _predict_json(capsys, *argv, "--scaling", "block")["assumptions"]
    assert "caveat" not in _predict_json(capsys, *argv[:-1], "e4m3")["assumptions"]
    assert cli_main(["fsdp", *argv]) == 0
    assert "caveat   " in capsys.readouterr().out
    assert cli_main(["sweep", *argv[:2], *argv[4:], "--world-sizes", "8"]) == 0
    assert "aps-perfmodel: caveat: " in capsys.readouterr().err


def test_fsdp_states_its_assumptions_and_why_and_calls_the_total_communication() -> None:
    proc = _perfmodel(
        *("fsdp", "--model", "llama-7b", "--nodes", "2", "--gpus-per-node", "8"),
        *("--bandwidth", "100Gbit", "--fmt", "e4m3"),
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "compute none: communication per step only" in text
    assert "intra-node 200 Gbit/s, 5 us per message (--intra-bandwidth, --intra-latency)" in text
    assert "(--param-bytes), twice per step" in text and "(--units)" in text
    # The total is communication, and named so.
    header = next(line for line in proc.stdout.splitlines() if line.startswith("format"))
    assert header.split()[-1] == "comm/step" and "step" not in header.split(), header
    # Why e4m3 is slower here: the node's one link carries twice fp32's bytes.
    assert "e4m3 sends 2.00x fp32's bytes" in text and "shared by its 8 devices" in text, text


def _fsdp_rows(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, dict]:
    assert cli_main(["fsdp", "--model", "llama-7b", "--fmt", "e4m3", "--json", *argv]) == 0
    return {r["format"]: r for r in json.loads(capsys.readouterr().out)["rows"]}


def test_fsdp_two_spellings_of_one_cluster_agree_and_the_node_link_decides(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The two commands were two clusters: 16 hosts with a 100 Gbit/s NIC each
    # (--cluster 100gbe --world-size 16), and 2 nodes of 8 behind one such NIC each.
    # Each spelled both ways predicts the same.
    hosts = _fsdp_rows(capsys, "--world-size", "16", "--cluster", "100gbe")
    assert _fsdp_rows(capsys, "--nodes", "16", "--bandwidth", "100Gbit") == hosts
    shared = _fsdp_rows(capsys, "--nodes", "2", "--gpus-per-node", "8", "--bandwidth", "100Gbit")
    assert (
        _fsdp_rows(capsys, "--nodes", "2", "--gpus-per-node", "8", "--cluster", "100gbe") == shared
    )
    # One device per link: e4m3 faster than bf16 and below its byte ratio to fp32 (4x),
    # the maxima and codec passes being what it pays beyond its bytes.
    speedup = {f: r["reduce_scatter_speedup_vs_fp32"] for f, r in hosts.items()}
    assert speedup["bf16"] == pytest.approx(2.0, rel=0.01)
    assert speedup["bf16"] < speedup["e4m3"] < 4.0
    # g devices behind one link: APS's all-to-all sends its unreduced rows across, g x 1
    # byte per element against the node-aware reduce-scatter's 4 bytes of one 1/g shard.
    for g in (1, 2, 8):
        nodes = str(16 // g)
        rows = _fsdp_rows(
            capsys, "--nodes", nodes, "--gpus-per-node", str(g), "--bandwidth", "100Gbit"
        )
        fp32, bf16, e4m3 = (rows[f]["inter_node_bytes"] for f in ("fp32", "bf16", "e4m3"))
        assert bf16 / fp32 == pytest.approx(0.5)
        assert e4m3 / fp32 == pytest.approx(g / 4)
        faster = rows["e4m3"]["reduce_scatter_s"] < rows["fp32"]["reduce_scatter_s"]
        assert faster == (g < 4), (g, rows)


def test_perfmodel_calibrate_points_to_the_plugins_command() -> None:
    proc = _perfmodel("calibrate", "--out", "p.json", "--steps", "3")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].endswith(
        "aps-launch --nproc-per-node N -m aps_comm calibrate --out p.json --steps 3"
    )
