"""Smoke tests of the numerics and accuracy benchmarks and the results report, tiny settings."""

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn.datasets")
pytest.importorskip("matplotlib")

from benchmarks import accuracy, numerics, report
from benchmarks._models import TinyLM, lm_loss, markov_data


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

    out = tmp_path / "RESULTS.md"
    text = report.main(["--results", str(tmp_path), "--out", str(out)])
    assert out.read_text() == text
    assert "## Accuracy" in text and "aps-e4m3" in text
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
