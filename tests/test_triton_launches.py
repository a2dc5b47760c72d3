"""``python -m benchmarks.triton_launches``: the Triton launches of settled buckets, counted
without a GPU (a fresh process: the interpreter must be on before Triton is imported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def test_the_launch_benchmark_counts_settled_buckets_within_the_target(tmp_path: Path) -> None:
    out = tmp_path / "launches.json"
    configs = "two_phase,block+error_feedback,promote"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.triton_launches", "--configs", configs,
         "--layers", "2,5", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {(r["config"], r["layers"]): r for r in doc["rows"]}
    assert set(rows) == {(c, n) for c in configs.split(",") for n in (2, 5)}
    for (config, _), row in rows.items():
        assert row["settled"], config
        assert row["total"] == len(row["aten"]) + len(row["triton"]) <= doc["target"], row
        assert row["triton"], config  # the codec ran on Triton
        assert row["total"] == rows[config, 2]["total"], config  # flat in the layer count
    assert "| promote | yes |" in proc.stdout
    assert "_block_factors_kernel" in rows["block+error_feedback", 2]["triton"]


def test_an_unknown_configuration_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.triton_launches", "--configs", "nope"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "nope" in proc.stderr
