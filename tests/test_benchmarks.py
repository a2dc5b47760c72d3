"""Smoke tests of the numerics and accuracy benchmarks and the results report, tiny settings."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn.datasets")
pytest.importorskip("matplotlib")

from aps_comm.simulate import allreduce
from benchmarks import accuracy, numerics, report
from benchmarks._models import DigitsCNN, TinyLM, lm_loss, markov_data


def test_markov_data_and_oracle() -> None:
    data = markov_data(vocab=8, seq_len=16, n_train=64, n_test=32, seed=1)
    assert data.x_train.shape == (64, 16) and data.y_test.shape == (32, 16)
    assert (data.x_train[:, 1:] == data.y_train[:, :-1]).all()
    # The true chain beats a uniform guess but cannot be perfect.
    assert 0.0 < data.oracle_loss < math.log(8)
    assert 1 / 8 < data.oracle_acc < 1.0
    assert markov_data(vocab=8, seq_len=16, n_train=64, n_test=32, seed=1).x_test.equal(data.x_test)
    with torch.no_grad():
        logits = TinyLM(8, 16, dim=16)(data.x_test)
    assert logits.shape == (32, 16, 8) and math.isfinite(float(lm_loss(logits, data.y_test)))


@pytest.mark.slow
def test_numerics_smoke(tmp_path: Path) -> None:
    argv = ["--models", "digits_cnn", "--batches", "1", "--pretrain-steps", "2"]
    argv += ["--real-workers", "2", "--sim-workers", "4", "--formats", "e4m3", "fp16"]
    argv += ["--scalings", "none", "layer", "--out", str(tmp_path)]
    result = numerics.main(argv)
    saved = json.loads((tmp_path / "numerics.json").read_text())
    assert saved["command"].startswith("python -m benchmarks.numerics")
    # e4m3 (two_phase x 2 scalings) + fp16 (2 reductions x 2) + 3 torch hooks, at 2 world sizes.
    assert len(result["rows"]) == 2 * (2 + 4 + 3)
    err = {
        (r["mode"], r["hook"], r["format"], r["reduction"], r["scaling"]): r for r in result["rows"]
    }
    for mode in ("real", "simulated"):
        assert err[(mode, "fp32_allreduce", "fp32", "allreduce", "none")]["rel_err"] < 1e-6
        aps = err[(mode, "aps", "e4m3", "two_phase", "layer")]["rel_err"]
        naive = err[(mode, "aps", "e4m3", "two_phase", "none")]["rel_err"]
        # Gradients of 1e-6..1e-4 underflow e4m3 unscaled; APS keeps a few % error.
        assert aps < 0.1 < 0.9 < naive, (mode, aps, naive)
        assert err[(mode, "aps", "fp16", "two_phase", "layer")]["rel_err"] < 1e-3
    assert "| e4m3 | two_phase | layer |" in (tmp_path / "numerics.md").read_text()


def test_numerics_block_rows(tmp_path: Path) -> None:
    argv = ["--models", "digits_cnn", "--batches", "1", "--pretrain-steps", "2"]
    argv += ["--real-workers", "--sim-workers", "4", "--formats", "e2m1", "--scalings", "layer"]
    argv += ["--torch-hooks", "--block-sizes", "32", "--block-formats", "e2m1"]
    result = numerics.main([*argv, "--out", str(tmp_path)])
    flat = [r for r in result["rows"] if r["reduction"] != "grid"]
    err = {r["scaling"]: r["rel_err"] for r in flat}
    flushed = {r["scaling"]: r["flushed"] for r in flat}
    # N = 4 is a grid of 2 x 2 (no nodes of 8): its owners' exponents keep e2m1 too.
    grid = {r["scaling"]: r["rel_err"] for r in result["rows"] if r["reduction"] == "grid"}
    assert grid["block32+rank"] < grid["block32"]
    assert set(err) == {"layer", "block32", "block32+owner", "block32+rank", "block32 floor"}
    # One exponent per layer flushes most of e2m1; blocks keep far more.
    assert err["block32+rank"] < err["block32"] < err["layer"]
    # The exact mean with its own block exponents flushes least.
    assert 0 < flushed["block32 floor"] < min(flushed[k] for k in flushed if k != "block32 floor")
    text = (tmp_path / "numerics.md").read_text()
    assert "| e2m1 | two_phase | block32+owner |" in text
    assert "| e2m1 | exact mean | block32 floor |" in text


def test_block_floor() -> None:
    """The exact mean rounded once per block, by hand: e4m3 (max 448, smallest subnormal
    2**-9) and e2m1 (max 6, values 0.5, 1, 1.5, 2, 3, 4, 6), blocks of 8 from each layer's start."""
    a = torch.tensor([1.0, -0.75, 17 / 32, 2.0**-18, 1.5 * 2.0**-18, 2.0**-19, 0.0, -3 * 2.0**-17])
    a = torch.cat([a, torch.tensor([2.0**-12, 2.0**-25])]).double()  # a second, short block
    b = torch.tensor([[2.0**-32, -(2.0**-33)], [5 * 2.0**-35, 0.0]], dtype=torch.float64)
    out = numerics.block_floor([a, b], "e4m3", 8)
    # Block 1: max 1 gets 2**8 (256 <= 448 < 512): 17/32 -> 136, a tie between 128 and 144,
    # goes to 128 (even); 2**-18 -> 2**-10, half the smallest subnormal, a tie, to 0;
    # 1.5 * 2**-18 -> 1.5 * 2**-10 rounds up to 2**-9; 2**-19 flushes; 3 * 2**-9 is a subnormal.
    # Block 2 (max 2**-12) gets 2**20: exact (with block 1's 2**8, 2**-25 would flush).
    want_a = [1.0, -0.75, 0.5, 0.0, 2.0**-17, 0.0, 0.0, -3 * 2.0**-17, 2.0**-12, 2.0**-25]
    assert out[0].dtype == torch.float32 and out[0].tolist() == want_a
    # Layer b starts its own block (max 2**-32, exponent 40): exact. In a block with
    # layer a's last two elements it would get 2**20 and flush (2**-32 to 2**-12).
    assert out[1].shape == (2, 2) and torch.equal(out[1], b.float())
    c = torch.tensor([3.0, 1.25, 0.125, 0.2, -0.1, 0.0, 6.0 * 2.0**-5, 2.0**-30])
    # Max 3 gets 2**1: 1.25 -> 2.5, a tie, to 2 (even); 0.125 -> 0.25, a tie, to 0;
    # 0.2 -> 0.4 -> 0.5; 6 * 2**-5 -> 0.375 -> 0.5.
    [got] = numerics.block_floor([c], "e2m1", 8)
    assert got.tolist() == [3.0, 1.0, 0.0, 0.25, 0.0, 0.0, 0.25, 0.0]
    # A non-finite mean poisons its layer only.
    bad, good = numerics.block_floor([torch.tensor([1.0, float("inf")]), c], "e2m1", 8)
    assert bad.isnan().all() and torch.equal(good, got)
    assert numerics.block_floor([], "e4m3", 32) == []
    # The simulator's owner step with its own exponents, on one worker, rounds the same way.
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(1, 3, 37, generator=gen) * 2.0**-k for k in (0, 10, 20)]
    for fmt in ("e4m3", "e2m1"):
        sim = allreduce(layers, fmt, scaling="block", block_size=16, rank_exponents=True)
        got = numerics.block_floor([t[0] for t in layers], fmt, 16)
        assert all(torch.equal(s, g) for s, g in zip(sim, got, strict=True)), fmt


@pytest.mark.slow
def test_accuracy_and_report_smoke(tmp_path: Path) -> None:
    argv = ["--world-size", "2", "--seeds", "1", "--hooks", "fp32", "fp16_compress", "aps-e4m3"]
    argv += ["--digits-epochs", "1", "--lm-steps", "2", "--lm-evals", "1", "--out", str(tmp_path)]
    result = accuracy.main(argv)
    rows = {(r["task"], r["hook"]): r for r in result["summary"]}
    assert set(rows) == {
        (t, h) for t in ("digits", "markov") for h in ("fp32", "fp16_compress", "aps-e4m3")
    }
    for task in ("digits", "markov"):
        assert rows[(task, "fp16_compress")]["bytes_vs_fp32"] == 0.5
        # One byte per element plus 4 bytes per layer for the maxima.
        assert 0.25 <= rows[(task, "aps-e4m3")]["bytes_vs_fp32"] < 0.27
        assert (tmp_path / f"accuracy_{task}.png").stat().st_size > 0
    assert json.loads((tmp_path / "accuracy.json").read_text())["command"].startswith(
        "python -m benchmarks.accuracy"
    )
    # Per-layer figures: recorded for the APS hook only, plotted, linked.
    layers = {(r["task"], r["hook"]): r["layers"] for r in result["runs"]}
    assert layers[("digits", "fp32")] is None and layers[("markov", "fp16_compress")] is None
    for task, model in (("digits", DigitsCNN()), ("markov", TinyLM(8, 16, 32, 2))):
        log = layers[(task, "aps-e4m3")]
        assert log["names"] == [n for n, _ in model.named_parameters()]
        n_steps = len(log["steps"])
        assert log["steps"] == list(range(1, n_steps + 1)) and n_steps >= 2
        for figure in accuracy.LAYER_FIGURES:
            assert len(log[figure]) == n_steps
            assert all(len(step) == len(log["names"]) for step in log[figure])
        assert all(isinstance(e, int) for step in log["exponent"] for e in step)
        assert all(0.0 <= u <= 1.0 for step in log["underflow_rate"] for u in step)
    # Digits' gradients (x 2**-10) sit far below e4m3's range: APS scales them up.
    assert min(min(step) for step in layers[("digits", "aps-e4m3")]["exponent"]) > 0
    assert (tmp_path / "accuracy_layers.png").stat().st_size > 0
    assert "](accuracy_layers.png)" in (tmp_path / "accuracy.md").read_text()

    out = tmp_path / "RESULTS.md"
    text = report.main(["--results", str(tmp_path), "--out", str(out)])
    assert out.read_text() == text
    assert "## Accuracy" in text and "aps-e4m3" in text
    assert "](./accuracy_layers.png)" in text  # the link follows the results folder
    assert "Not yet run (`python -m benchmarks.comm`)." in text and "Numerics" in text

    comm = {
        "command": "python -m benchmarks.comm --ranks 4",
        "machine": {"cpus": 2},
        "link": {"bandwidth": "1gbit"},
        "ranks": 4,
        "gradient_mb": 64,
        "runs": [
            {
                "hook": "aps-e4m3",
                "median_step_s": 0.5,
                "bus_bandwidth_gbit": 0.9,
                "speedup_vs_fp32": 2.0,
                "speedup_vs_fp16": 1.2,
                "rel_l2_error": 0.03,
                "predicted_step_s": 0.45,
                "rank0_cpu_user_s": 0.2,
                "rank0_cpu_system_s": 0.05,
            }
        ],
    }
    (tmp_path / "comm.json").write_text(json.dumps(comm))
    text = report.build(tmp_path, out)
    # CPU floor: 4 ranks x 0.25 s of CPU each / 2 cores.
    assert (
        "| aps-e4m3 | 0.500 | 0.900 | 2.00 | 1.20 | 3.000e-02 | 0.450 | 0.200 + 0.050 | 0.500 |"
        in text
    )
    assert "python -m benchmarks.comm --ranks 4" in text


def _comm_run(command: str, cpu_s: float, **fields: object) -> dict:
    """A communication result as benchmarks.comm writes it, one APS run of 0.1 s."""
    run = {"hook": "aps-e4m3", "median_step_s": 0.1, "speedup_vs_fp32": 3.5}
    run |= {"speedup_vs_fp16": 1.8, "rank0_cpu_user_s": cpu_s, "rank0_cpu_system_s": 0.0}
    data = {"command": command, "machine": {"cpus": 2}, "gradient_mb": 64, "runs": [run]}
    return data | {"batch": 0, "bucket_cap_mb": 25.0} | fields


def test_report_finds_results_by_what_they_record_not_their_names(tmp_path: Path) -> None:
    link = {"configured_rate": "1gbit", "bandwidth_bits_per_s": 9e8, "rtt_s": 1e-4}
    files = {
        # 2 ranks x 0.02 s of CPU / 2 cores = 0.02 s: the link bounds the 0.1 s step.
        "zz_link_bound.json": _comm_run(
            "python -m benchmarks.comm --ranks 2 --hooks fp32,aps-e4m3", 0.02, ranks=2, link=link
        ),
        # 4 x 0.04 / 2 = 0.08 s >= 3/4 of the step: CPU-bound, held to no link target.
        "aa_cpu_bound.json": _comm_run(
            "python -m benchmarks.comm --ranks 4", 0.04, ranks=4, link=link, bucket_cap_mb=16.0
        ),
        "mm_nodes.json": _comm_run(
            "python -m benchmarks.comm --nodes 2 --ranks-per-node 2", 0.01,
            ranks=4, nodes=2, ranks_per_node=2, link=link,
        ),
        "unknown.json": {"command": "python -m somewhere.else --flag"},
        "broken.json": "{not json",
    }  # fmt: skip
    for name, data in files.items():
        text = data if isinstance(data, str) else json.dumps(data)
        (tmp_path / name).write_text(text)
    found = {r.name: r.module for r in report.find_results(tmp_path)}
    assert found["zz_link_bound.json"] == found["mm_nodes.json"] == "benchmarks.comm"
    assert found["unknown.json"] == "somewhere.else" and found["broken.json"] is None

    text = report.build(tmp_path, tmp_path / "RESULTS.md")
    comm = text.split("## Communication benchmark")[1].split("\n## ")[0]
    # Titles from the recorded ranks, link, hooks, compute and buckets; link-bound first.
    bound = "### 2 ranks, 1 Gbit/s, no compute in backward ([zz_link_bound.json]"
    cpu = (
        "### 4 ranks, 1 Gbit/s, every hook, no compute in backward, DDP bucket_cap_mb=16 "
        "(CPU-bound here: see the CPU floor) ([aa_cpu_bound.json]"
    )
    assert comm.index(bound) < comm.index(cpu)
    assert comm.count("Target: APS e4m3 >= 3.4x the FP32 hook") == 1
    assert (
        "Target: APS e4m3 >= 3.4x the FP32 hook and >= 1.7x fp16_compress_hook: met"
        in (comm.split(cpu)[0])
    )
    nodes = text.split("## Nodes")[1].split("\n## ")[0]
    assert "### 2 nodes x 2 ranks, 1 Gbit/s per node ([mm_nodes.json]" in nodes
    others = text.split("## Other results")[1]
    assert "[unknown.json](unknown.json): command `python -m somewhere.else --flag`" in others
    assert "[broken.json](broken.json): not valid JSON" in others
    assert "zz_link_bound" not in others and "mm_nodes" not in others


def test_report_reads_the_command_from_top_level_or_setup(tmp_path: Path) -> None:
    md = tmp_path / "x.md"
    md.write_text("Generated by `python -m from_md`\n")
    assert report._command({"command": "python -m top"}, md) == "`python -m top`"
    assert report._command({"setup": {"command": "python -m setup"}}, md) == "`python -m setup`"
    assert "the JSON records no command" in report._command({"setup": {}}, md)


def _validation_points(rank: int, world_size: int) -> list[dict]:
    from benchmarks import perfmodel_validate as pv

    # 16 layers of 8x8: 4 KiB messages, quick enough for 7 repeats over 3 rounds.
    return pv._measure_paths(
        [4096], repeats=7, warmup=1, settle_s=0.0, budget_s=0.0, max_repeats=7, rounds=3
    )


def test_perfmodel_validation_measures_every_path_over_rounds() -> None:
    from aps_comm.testing import run_distributed
    from benchmarks import perfmodel_validate as pv

    out = run_distributed(_validation_points, 2, timeout=120)
    assert out[0] == out[1]  # one measurement for the group
    assert [p["path"] for p in out[0]] == list(pv.PATHS)
    for point in out[0]:
        assert point["n"] == pv.LAYERS * 8 * 8
        # 7 repeats in 3 rounds: ceil(7 / 3) = 3 each, never fewer than asked.
        assert point["repeats"] == 9
        assert 0 < point["seconds"] < 10 and 0 < point["median_s"] < 10
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        pv._measure_paths([4096], 1, 1, 0.0, 0.0, 1, rounds=0)


@pytest.mark.parametrize(
    ("flag", "why"),
    [
        (["--rounds", "0"], "--rounds must be >= 1, got 0"),
        (["--max-repeats", "0"], "--max-repeats must be >= 1, got 0"),
        (["--calib-budget-s", "-1"], "--calib-budget-s must be >= 0, got -1.0"),
    ],
)
def test_perfmodel_validation_rejects_bad_repeat_settings(
    flag: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import perfmodel_validate as pv

    with pytest.raises(SystemExit) as exc:
        pv.main(flag)
    assert exc.value.code == 2 and why in capsys.readouterr().err


def _validation_report(errs: list[float], command: str = "python -m x") -> dict:
    rows = [
        {"world_size": 2, "path": "fp16", "fp32_mib": 1.0 * (i + 1), "rel_err": e}
        | {"measured_s": 1.0, "predicted_s": 1.0 + e}
        for i, e in enumerate(errs)
    ]
    abs_errs = sorted(abs(e) for e in errs)
    summary = {
        "median_abs_err": abs_errs[len(abs_errs) // 2],
        "max_abs_err": abs_errs[-1],
        "n": len(errs),
    }
    setup = {"command": command, "host": "h", "cpu_count": 2, "backend": "gloo"}
    setup |= {"transport": "t", "runtime_s": 1.0}
    setup |= {"loadavg_1_5_15_before": [0, 0, 0], "loadavg_1_5_15_after": [0, 0, 0]}
    return {"setup": setup, "summary": {"all": summary}, "rows": rows}


def test_validation_target_is_judged_on_every_recorded_run(tmp_path: Path) -> None:
    from benchmarks import perfmodel_validate as pv

    # The report finds a validation by the module its command runs.
    cmd = "python -m benchmarks.perfmodel_validate --world-sizes 2"
    repeat = tmp_path / "repeat.json"
    repeat.write_text(json.dumps(_validation_report([0.05, -0.30, 0.02], cmd)))
    summary = pv._run_summary(repeat, cmd)
    assert summary["max_abs_err"] == 0.30 and summary["worst"]["fp32_mib"] == 2.0
    with pytest.raises(SystemExit, match="not a repeat of this run"):
        pv._run_summary(repeat, "python -m y")

    # This run meets the target; its repeat does not: the report must say so.
    val = _validation_report([0.05, -0.20, 0.02], cmd)
    val["setup"]["repeat_runs"] = [summary]
    assert [r["max_abs_err"] for r in pv.all_runs(val)] == [0.20, 0.30]
    results = tmp_path / "results"
    results.mkdir()
    (results / "perfmodel_validation.json").write_text(json.dumps(val))
    text = report.build(results, tmp_path / "RESULTS.md")
    assert "**Missed** in run 2 of 2" in text
    assert "missed its target (median <= 10%, worst <= 25%) in 1 of 2 runs" in text
    del val["setup"]["repeat_runs"]
    (results / "perfmodel_validation.json").write_text(json.dumps(val))
    text = report.build(results, tmp_path / "RESULTS.md")
    assert "Missed" not in text and "missed its target" not in text


def test_comm_hook_specs() -> None:
    from benchmarks import comm

    assert comm.split_hook("aps-e4m3:chunk=1048576") == ("aps-e4m3", 1048576)
    assert comm.split_hook("aps-e4m3-hierarchical") == ("aps-e4m3-hierarchical", None)
    for bad, why in [
        ("aps-e9m9", "unknown hook 'aps-e9m9'"),
        ("fp32:chunk=4", "only APS hooks are chunked"),
        ("aps-e4m3:chunk=0", "positive number of elements"),
        ("aps-e4m3:chunk=x", "positive number of elements"),
        ("aps-e4m3:chunk=", "give the chunk in elements"),
    ]:
        with pytest.raises(ValueError, match=why):
            comm.split_hook(bad)
    assert comm.hook_profile("aps-e4m3:profile=link") == "link"
    assert comm.split_hook("aps-e4m3:profile=p.json") == ("aps-e4m3", None)
    assert comm.hook_profile("aps-e4m3-grid") is None
    for bad, why in [
        ("fp32:profile=link", "only APS hooks"),
        ("aps-e4m3:profile=", "give a profile"),
        ("aps-e4m3:chunk=4:profile=link", "a fixed chunk ignores the profile"),
        ("aps-e4m3:chunks=4", "unknown hook"),
    ]:
        with pytest.raises(ValueError, match=why):
            comm.hook_profile(bad)
    # The link's profile: half the round trip, the goodput.
    link = comm.link_profile({"bandwidth_bits_per_s": 8e8, "rtt_s": 3e-3}, 8).link
    assert link.alpha == 1.5e-3 and link.bandwidth == pytest.approx(1e8)
    # 16 MiB layers from 16 MiB up; 4 square layers below.
    assert comm._shape(64) == (2048, 4) and comm._shape(4) == (512, 4)


def _topology(ranks_per_node: int = 2) -> dict:
    link = {"bandwidth_bits_per_s": 1e9, "rtt_s": 2e-4}
    intra = {"bandwidth_bits_per_s": 4e10, "rtt_s": 5e-5}
    return {"nodes": 2, "ranks_per_node": ranks_per_node, "link": link, "link_intra_node": intra}


def test_comm_prediction_is_the_model_per_bucket() -> None:
    import dataclasses

    from aps_perfmodel import custom_cluster
    from aps_perfmodel.strategies import GLOO_CHUNK_OVERHEAD_S, bucket_breakdown
    from benchmarks import comm

    size = {"width": 512, "numel": 4 * 512**2, "bucket_numels": [3 * 512**2, 512**2]}
    hooks = ["fp32", "fp16", "aps-e4m3", "aps-e4m3-hierarchical", "aps-e4m3-auto"]
    hooks += ["aps-e4m3:chunk=65536", "naive-e4m3"]
    pred, note = comm.predict_strategies(size, hooks, _topology())
    assert "bucket_breakdown" in note and set(pred) == set(hooks) - {"naive-e4m3"}
    # The reference, built here from the same measured numbers.
    cluster = dataclasses.replace(
        custom_cluster(
            1e9 / 8, 1e-4, nodes=2, gpus_per_node=2, intra_bandwidth=5e9,
            intra_latency=2.5e-5, device="cpu-numba",
        ),
        chunk_overhead_s=GLOO_CHUNK_OVERHEAD_S,
        cores_per_rank=(os.cpu_count() or 1) / 4,
        backend="gloo",
    )  # fmt: skip

    def ref(fmt: str, strategy: str, chunk: int | str = "auto") -> float:
        return sum(
            bucket_breakdown(n, n // 512**2, fmt, cluster, strategy, chunk=chunk).total_s
            for n in size["bucket_numels"]
        )

    assert pred["fp32"] == ref("fp32", "fp32") and pred["fp16"] == ref("fp16", "native")
    assert pred["aps-e4m3"] == ref("e4m3", "two_phase")
    assert pred["aps-e4m3-hierarchical"] == ref("e4m3", "hierarchical")
    assert pred["aps-e4m3:chunk=65536"] == ref("e4m3", "two_phase", 65536)
    assert pred["aps-e4m3:chunk=65536"] != pred["aps-e4m3"]
    assert pred["aps-e4m3-auto"] <= min(pred["fp32"], pred["aps-e4m3"]) + 1e-12
    # What the hook ran per bucket, where recorded, is what the model prices.
    ran = {"aps-e4m3": {"bucket_reductions": ["two_phase"] * 2, "bucket_chunks": [2**16, 2**20]}}
    ran["aps-e4m3-auto"] = {
        "bucket_reductions": ["hierarchical", "fp32"],
        "bucket_chunks": [2**18, None],
    }
    ran["aps-e4m3-grid"] = {"bucket_reductions": ["grid"] * 2, "bucket_chunks": [2**20] * 2}
    with_ran, _ = comm.predict_strategies(size, [*hooks, "aps-e4m3-grid"], _topology(), ran)
    assert with_ran["aps-e4m3"] == sum(
        bucket_breakdown(n, n // 512**2, "e4m3", cluster, "two_phase", chunk=c).total_s
        for n, c in zip(size["bucket_numels"], [2**16, 2**20], strict=True)
    )
    assert (
        with_ran["aps-e4m3-auto"]
        == bucket_breakdown(3 * 512**2, 3, "e4m3", cluster, "hierarchical", chunk=2**18).total_s
        + bucket_breakdown(512**2, 1, "e4m3", cluster, "fp32").total_s
    )
    assert "aps-e4m3-grid" not in with_ran  # the model has no grid strategy
    assert with_ran["fp32"] == pred["fp32"]
    assert comm.predict_strategies(size, hooks, _topology() | {"link": None}) == (
        {},
        "no measured link (loopback)",
    )


def _comm_worker(rank: int, world_size: int) -> dict:
    import argparse

    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks import comm

    args = argparse.Namespace(
        hooks=["fp32", "aps-e4m3:chunk=4096", "aps-e4m3-auto", "aps-e4m3-grid"],
        rounds=2, batch=3, bucket_mb=0.0625, bucket_view=True, warmup=1, repeats=2,
        chunk_elements=0,
    )  # fmt: skip
    return comm._worker_size(args, 0.25, rank, DDP)


def test_comm_worker_records_every_hook_round_and_chunk() -> None:
    from aps_comm.testing import run_distributed

    out = run_distributed(_comm_worker, 2, timeout=120)[0]
    assert (out["width"], out["layers"], out["numel"]) == (128, 4, 4 * 128**2)
    # 64 KiB buckets of 64 KiB layers: DDP's buckets hold every element once.
    assert sum(out["bucket_numels"]) == out["numel"] and len(out["bucket_numels"]) == 4
    # Grid needs 4 ranks or more: refused when attached, recorded once, not run.
    skipped = [r for r in out["results"] if "skipped" in r]
    assert [r["hook"] for r in skipped] == ["aps-e4m3-grid"]
    assert "no such divisor" in skipped[0]["skipped"]
    rows = [r for r in out["results"] if "skipped" not in r]
    assert [(r["hook"], r["round"]) for r in rows] == [
        (h, rnd) for rnd in range(2) for h in ("fp32", "aps-e4m3:chunk=4096", "aps-e4m3-auto")
    ]
    for r in rows:
        assert len(r["step_s"]) == 2 and all(t > 0 for t in r["step_s"])
        assert ("rel_l2_error" in r) == (r["round"] == 1)
        # --batch: every step with compute has its backward-alone step beside it.
        for key in ("compute_step_s", "alone_step_s", "compute_rank0_cpu_s", "alone_rank0_cpu_s"):
            assert len(r[key]) == 2 and all(t >= 0 for t in r[key]), key
    last = {r["hook"]: r for r in rows if r["round"] == 1}
    assert last["fp32"]["rel_l2_error"] < 1e-6 and "reduction" not in last["fp32"]
    assert last["aps-e4m3:chunk=4096"]["chunk_elements"] == 4096
    assert last["aps-e4m3:chunk=4096"]["reduction"] == "two_phase"
    assert last["aps-e4m3-auto"]["chunk_elements"] is None
    # What ran per bucket: the fixed chunk; auto's choice and the chunk rule's.
    assert last["aps-e4m3:chunk=4096"]["bucket_chunks"] == [4096] * 4
    assert last["aps-e4m3:chunk=4096"]["bucket_reductions"] == ["two_phase"] * 4
    auto = last["aps-e4m3-auto"]
    assert len(auto["bucket_reductions"]) == 4 and set(auto["bucket_reductions"]) <= {"two_phase"}
    assert all(c is not None and c >= 128**2 for c in auto["bucket_chunks"])
    assert 0 < last["aps-e4m3:chunk=4096"]["rel_l2_error"] < 0.1


def test_exposed_communication_is_the_median_of_paired_differences() -> None:
    from benchmarks import comm

    rounds = [
        {
            "compute_step_s": [1.0, 1.5],
            "alone_step_s": [0.9, 1.0],
            "compute_rank0_cpu_s": [1.2, 1.3],
            "alone_rank0_cpu_s": [1.0, 1.0],
        },
        {
            "compute_step_s": [2.0],
            "alone_step_s": [1.8],
            "compute_rank0_cpu_s": [2.0],
            "alone_rank0_cpu_s": [1.9],
        },
    ]
    out = comm._with_compute(rounds, comm_s=0.4)
    # Differences 0.1, 0.5, 0.2: median 0.2 (not 1.5 - 1.0 from the medians).
    assert out["exposed_comm_s"] == pytest.approx(0.2)
    assert out["exposed_fraction"] == pytest.approx(0.5)
    assert out["median_compute_step_s"] == 1.5 and out["median_alone_step_s"] == 1.0
    # CPU differences 0.2, 0.3, 0.1.
    assert out["comm_cpu_in_step_s"] == pytest.approx(0.2)
    assert out["comm_cpu_fraction"] == pytest.approx(0.5)
    assert out["round_median_compute_step_s"] == [1.25, 2.0]
    assert comm._with_compute([{"compute_step_s": [1.0]}], 0.4) == {}


def test_perfmodel_validation_puts_the_profile_on_the_measured_nodes() -> None:
    from aps_perfmodel import custom_cluster
    from benchmarks import cluster as cl
    from benchmarks import perfmodel_validate as pv

    flat = custom_cluster(1e8, 1e-4, nodes=4)
    link = {"bandwidth_bits_per_s": 8e8, "rtt_s": 4e-4, "configured_bits_per_s": 10**9}
    link |= {"nodes": 2, "ranks_per_node": 2, "loopback": False}
    res = {"link": link, "link_intra_node": {"bandwidth_bits_per_s": 8e9, "rtt_s": 1e-4}}
    topo = pv._with_nodes(flat, res).topology
    assert (topo.nodes, topo.gpus_per_node) == (2, 2)
    assert topo.inter.bandwidth == pytest.approx(1e8) and topo.inter.alpha == 2e-4
    assert topo.inter.burst_bytes == cl.tbf_parameters(10**9)[0]
    assert topo.intra.bandwidth == pytest.approx(1e9) and topo.intra.alpha == 5e-5
    assert topo.intra.burst_bytes == 0.0
    assert pv._with_nodes(flat, {"link": link}) is flat  # one rank per node: as calibrated


def _validation_points_2x2(rank: int, world_size: int) -> list[dict]:
    from benchmarks import perfmodel_validate as pv

    return pv._measure_paths(
        [4096], repeats=2, warmup=1, settle_s=0.0, budget_s=0.0, max_repeats=2,
        paths=pv.NODE_PATHS,
    )  # fmt: skip


@pytest.mark.slow
def test_perfmodel_validation_measures_the_hierarchical_path_on_2x2() -> None:
    from aps_comm.testing import run_distributed
    from benchmarks import perfmodel_validate as pv

    out = run_distributed(_validation_points_2x2, 4, timeout=120, env={"LOCAL_WORLD_SIZE": "2"})
    assert out[0] == out[3]
    assert [p["path"] for p in out[0]] == list(pv.NODE_PATHS)
    assert all(p["repeats"] == 2 and 0 < p["seconds"] < 10 for p in out[0])


def test_report_nodes_section(tmp_path: Path) -> None:
    run = {"hook": "aps-e4m3", "median_step_s": 0.05, "predicted_step_s": 0.04}
    run |= {"rank0_cpu_user_s": 0.01, "rank0_cpu_system_s": 0.005, "chunk_elements": None}
    fixed = run | {"hook": "aps-e4m3:chunk=1048576", "median_step_s": 0.1, "chunk_elements": 2**20}
    sweep = {
        "command": "python -m benchmarks.comm --nodes 8 --delay 1ms",
        "machine": {"cpus": 2},
        "ranks": 8, "nodes": 8, "ranks_per_node": 1, "delay_s": 0.001,
        "link": {"configured_rate": "1gbit", "rtt_s": 0.0021},
        "prediction": "aps_perfmodel.strategies", "bucket_cap_mb": 4, "rounds": 2, "repeats": 5,
        "sweep": [{"gradient_mb": 4.0, "bucket_numels": [2**20], "runs": [run, fixed]}],
    }  # fmt: skip
    (tmp_path / "comm_latency_8nodes.json").write_text(json.dumps(sweep))
    text = report.build(tmp_path, tmp_path / "RESULTS.md")
    assert "python -m benchmarks.comm --nodes 8 --delay 1ms" in text
    # 8 ranks x 15 ms of CPU / 2 cores = 60 ms; the fixed chunk took 2x as long.
    assert "| 4 | 1 | aps-e4m3 | default | 50.0 | 40.0 | -20.0% | 60.0 | 2.00x |" in text
    assert "| 4 | 1 | aps-e4m3 | 1048576 | 100.0 | 40.0 | -60.0% | 60.0 | 1.00x |" in text
    # A hook planning with the link's profile: its name and the chunk its rule chose.
    sized = run | {"hook": "aps-e4m3:profile=link", "bucket_chunks": [2**22]}
    sweep["sweep"][0]["runs"].append(sized)
    (tmp_path / "comm_latency_8nodes.json").write_text(json.dumps(sweep))
    text = report.build(tmp_path, tmp_path / "RESULTS.md")
    assert "| 4 | 1 | aps-e4m3:profile=link | rule 2**22 | 50.0 |" in text
    assert "## Other results" not in text  # a known file, not listed as unknown


def test_report_codec_section_shows_block_scales(tmp_path: Path) -> None:
    def row(name: str, plain: float, block: float | None) -> dict:
        r = {
            "format": name,
            "encode_s": 0.002,
            "decode_s": 0.002,
            "encode_decode_over_copy": plain,
            "scaled_encode_decode_over_copy": plain,
        }
        if block is not None:
            r["block_encode_decode_over_copy"] = block
        return r

    base = {
        "command": "python -m benchmarks.codec --repeats 3",
        "machine": "m",
        "torch": "t",
        "threads": 1,
        "buffer_mib": 64,
        "repeats": 3,
        "copy_s": 0.003,
    }
    (tmp_path / "codec.json").write_text(
        json.dumps(
            {**base, "block_size": 32, "formats": [row("e4m3", 1.5, 2.3), row("e2m1", 1.4, 1.7)]}
        )
    )
    codec = report.build(tmp_path, tmp_path / "RESULTS.md").split("## Codec speed")[1]
    assert "| e4m3 | 2.0 | 2.0 | 1.50x | 1.50x | 2.30x |" in codec
    assert "| e2m1 | 2.0 | 2.0 | 1.40x | 1.40x | 1.70x |" in codec
    assert "Block scales: one per 32 elements of every layer." in codec
    assert "Target: e4m3 encode + decode <= 2x a copy: met (1.50x)." in codec
    assert "Target: e4m3 encode + decode with block scales <= 2x a copy: missed (2.30x)." in codec
    # A result from before block scales: no block column values, no block target.
    (tmp_path / "codec.json").write_text(json.dumps({**base, "formats": [row("e4m3", 1.5, None)]}))
    codec = report.build(tmp_path, tmp_path / "RESULTS.md").split("## Codec speed")[1]
    assert (
        "| e4m3 | 2.0 | 2.0 | 1.50x | 1.50x | - |" in codec and "with block scales <=" not in codec
    )
    assert "shard owner" not in codec  # nor the owner steps it did not time
    # The owner steps, agreed (fused and chained) and with each rank's own exponents.
    owner = {"owner_block_s": 0.0031, "owner_block_chain_s": 0.0395, "owner_rank_block_s": 0.0047}
    data = {**base, "owner_ranks": 4, "formats": [{**row("e2m1", 1.4, 1.7), **owner}]}
    (tmp_path / "codec.json").write_text(json.dumps(data))
    codec = report.build(tmp_path, tmp_path / "RESULTS.md").split("## Codec speed")[1]
    assert "4 ranks' shards of a quarter of the buffer each" in codec
    assert "| e2m1 | 3.1 | 39.5 | 4.7 |" in codec


def test_results_md_is_what_the_report_builds() -> None:
    """RESULTS.md is generated: committed as `python -m benchmarks.report` writes it."""
    assert (report.HERE / "RESULTS.md").read_text() == report.build()


def test_docs_name_the_run_of_every_figure_and_quote_it_as_the_report_does() -> None:
    """Every step time, speedup, accuracy or error the README and docs quote from a
    run links that run's JSON and equals what the report derives from it."""
    problems = report.check_docs()
    assert not problems, "\n".join(problems)


def test_check_docs_catches_a_figure_of_another_run_and_an_unnamed_run(tmp_path: Path) -> None:
    # Two runs of one configuration (2 ranks at 1 Gbit/s): 0.174 s / 3.36x in
    # comm_2ranks.json, 0.162 s / 3.55x in comm_block_2ranks.json.
    doc = tmp_path / "doc.md"
    link = "[comm_2ranks.json](benchmarks/results/comm_2ranks.json)"
    doc.write_text(
        f"- Named, right: APS e4m3 0.174 s per step, 3.36x the FP32 hook ({link}).\n"
        f"- Named, another run's figure: APS e4m3 0.162 s per step, 3.55x ({link}).\n"
        "- Unnamed: APS e4m3 0.174 s per step, 3.36x the FP32 hook.\n"
        "- The model's: 3.36x the FP32 hook <!-- model -->.\n"
    )
    problems = report.check_docs([doc])
    assert len(problems) == 2, problems
    assert "quotes ['0.162 s', '3.55x'], not figures of ['comm_2ranks.json']" in problems[0]
    assert "without naming it" in problems[1] and "comm_2ranks.json" in problems[1]
    # The report's precision bounds the quote's: 0.19 (printed) does not back 0.190.
    assert report._quoted("0.19", ["0.19"]) and not report._quoted("0.190", ["0.19"])
    assert report._quoted("1.9e-3", ["1.90e-03"]) and report._quoted("3.4", ["3.36"])


def _powersgd_job(rank: int, world_size: int) -> dict:
    """PowerSGD in both benchmarks: the accuracy one's bytes and state, the comm one's order."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks import comm

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 16))
    ddp = DDP(net)
    sent, aps_state, kept = accuracy.attach_hook(ddp, "powersgd-r1")
    x = torch.randn(4, 32)
    per_step = []
    for _ in range(accuracy.POWERSGD_START + 2):
        ddp(x).sum().backward()
        per_step.append(sent())
    state_bytes = accuracy._state_bytes(kept, net)
    # Four buckets, PowerSGD's collectives in one order: it runs, and agrees everywhere.
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128, bias=False) for _ in range(4)])
    ddp4 = DDP(model, bucket_cap_mb=128 * 128 * 4 / 2**20)
    state, hook = comm._attach("powersgd-r4", ddp4)
    ddp4.register_comm_hook(state, hook)
    buckets: list[int] = []
    for _ in range(comm.POWERSGD_START + 6):
        ddp4.zero_grad()
        ddp4(torch.randn(2, 128)).sum().backward()
        buckets.append(len(state.powersgd.p_memory_dict))
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    everyone = [torch.empty_like(grads) for _ in range(world_size)]
    dist.all_gather(everyone, grads)
    return {
        "per_step": per_step,
        "aps_state": aps_state,
        "state_bytes": state_bytes,
        "buckets": buckets[-1],
        "same": all(torch.equal(g, everyone[0]) for g in everyone),
    }


def test_powersgd_bytes_state_and_ordered_buckets() -> None:
    from aps_comm.testing import run_distributed

    out = run_distributed(_powersgd_job, 2, timeout=120)
    # Linear(32, 16): FP32 for the first 10 steps (16 x 32 + 16 floats), then P (16)
    # and Q (32) of the weight, the bias as it is; P and Q go from then-callbacks.
    fp32, compressed = (16 * 32 + 16) * 4, (16 + 32 + 16) * 4
    assert out[0]["per_step"] == [fp32] * accuracy.POWERSGD_START + [compressed] * 2
    assert out[0]["aps_state"] is None
    # Its error memory (one gradient) and its P and Q.
    assert out[0]["state_bytes"] == fp32 + (16 + 32) * 4
    assert out[0]["buckets"] == 4 and all(o["same"] for o in out)


def test_state_bytes_count_each_storage_once_and_not_the_models() -> None:
    net = torch.nn.Linear(4, 2)
    net(torch.ones(1, 4)).sum().backward()
    kept = torch.zeros(8)
    state = {"a": kept, "b": [kept[:4], (net.weight, net.weight.grad)], "c": torch.zeros(2)}
    assert accuracy._state_bytes(state, net) == 8 * 4 + 2 * 4


def _fsdp_state_bytes_job(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from aps_comm import fsdp as aps_fsdp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    state = aps_fsdp.register(net, "e4m3")
    net(torch.ones(4, 8)).sum().backward()
    params = list(net.parameters())
    grads = [p.grad for p in params]
    return {
        "dtensors": all(type(t).__name__ == "DTensor" for t in params + grads),
        "aps_state": accuracy._state_bytes(state, net),
        "model_only": accuracy._state_bytes({"p": [p.to_local() for p in params]}, net),
        "kept": accuracy._state_bytes({"p": torch.zeros(3)}, net),
    }


def test_state_bytes_of_an_fsdp2_state_leave_out_the_models_dtensors() -> None:
    """FSDP2's parameters and gradients are DTensors, which have no storage of their own."""
    from aps_comm.testing import run_distributed

    for out in run_distributed(_fsdp_state_bytes_job, 2, timeout=120):
        assert out["dtensors"] and out["aps_state"] > 0
        assert out["model_only"] == 0 and out["kept"] == 12


def _accuracy_run(hook: str, acc: float, **more: object) -> dict:
    final = {"test_acc": acc, "test_loss": 0.1}
    return {
        "task": "digits",
        "hook": hook,
        "seed": 0,
        "final": final,
        "curve": [],
        "bytes_per_step": 400,
        "parameters": 10,
        "seconds": 1.0,
        "layers": None,
        **more,
    }


def _accuracy_result(hooks: list[str], runs: list[dict], command: str) -> dict:
    settings = {
        "world_size": 4,
        "seeds": 1,
        "tasks": ["digits"],
        "hooks": hooks,
        "digits_epochs": 15,
        "digits_batch": 32,
        "digits_lr": 0.1,
        "lm_steps": 300,
    }
    machine = {"cpus": 2, "torch": "2", "backend": "gloo"}
    return {
        "command": command,
        "machine": machine,
        "settings": settings,
        "seconds": 10.0,
        "summary": accuracy._summary(runs, hooks, ["digits"]),
        "runs": runs,
    }


def test_accuracy_merge(tmp_path: Path) -> None:
    base = _accuracy_result(
        ["fp32", "aps-e4m3"],
        [_accuracy_run("fp32", 0.98), _accuracy_run("aps-e4m3", 0.97)],
        "python -m benchmarks.accuracy",
    )
    new = _accuracy_result(
        ["fp32", "powersgd-r1"],
        [
            _accuracy_run("fp32", 0.98, state_bytes=0),
            _accuracy_run("powersgd-r1", 0.9, state_bytes=44),
        ],
        "python -m benchmarks.accuracy --hooks fp32 powersgd-r1",
    )
    merged = accuracy._merged(base, new)
    assert merged["settings"]["hooks"] == ["fp32", "aps-e4m3", "powersgd-r1"]
    assert merged["merges"][0]["same_as_before"] == {"digits/fp32": True}
    rows = {r["hook"]: r for r in merged["summary"]}
    assert rows["powersgd-r1"]["state_vs_gradients"] == 44 / 40 and rows["aps-e4m3"]["test_acc"]
    assert "state_vs_gradients" not in rows["aps-e4m3"]  # its run recorded none
    text = accuracy.markdown(merged)
    assert "from `python -m benchmarks.accuracy --hooks fp32 powersgd-r1` (10 s), merged in" in text
    assert "| powersgd-r1 | 0.9000 ± 0.0000 |" in text and "| 1.100 |" in text
    path = tmp_path / "accuracy.json"
    path.write_text(json.dumps(base))
    assert accuracy._mergeable(path, new["settings"]) == base
    with pytest.raises(ValueError, match="lm_steps: 300 there, 400 here"):
        accuracy._mergeable(path, {**new["settings"], "lm_steps": 400})
    with pytest.raises(ValueError, match="no such file"):
        accuracy._mergeable(tmp_path / "none.json", new["settings"])
