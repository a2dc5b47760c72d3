"""Smoke tests of the numerics and accuracy benchmarks and the results report, tiny settings."""

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn.datasets")
pytest.importorskip("matplotlib")

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
    assert "comm.json` does not exist" in text and "Numerics" in text

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
    assert "| aps-e4m3 | 0.5 | 0.9 | 2 | 1.2 | 3.000e-02 | 0.45 | 0.200 + 0.050 | 0.5 |" in text
    assert "python -m benchmarks.comm --ranks 4" in text


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

    repeat = tmp_path / "repeat.json"
    repeat.write_text(json.dumps(_validation_report([0.05, -0.30, 0.02])))
    summary = pv._run_summary(repeat, "python -m x")
    assert summary["max_abs_err"] == 0.30 and summary["worst"]["fp32_mib"] == 2.0
    with pytest.raises(SystemExit, match="not a repeat of this run"):
        pv._run_summary(repeat, "python -m y")

    # This run meets the target; its repeat does not: the report must say so.
    val = _validation_report([0.05, -0.20, 0.02])
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
