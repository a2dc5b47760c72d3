"""Tests for ``aps-demo`` (launch/demo.py): a real two-rank run, its outputs, its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from aps_launch.demo import DEFAULT_HOOKS, format_table, main, resolve_hooks

TIMEOUT = 120
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "APS_BACKEND")


def _aps_demo() -> list[str]:
    script = Path(sysconfig.get_path("scripts")) / "aps-demo"
    if script.exists():
        return [str(script)]
    # Not `python -m`: that would import an aps_comm in the working folder.
    run = "import sys; del sys.path[0]; from aps_launch.demo import main; sys.exit(main())"
    return [sys.executable, "-c", run]


def _env() -> dict[str, str]:
    # A test run under some launcher must not make the demo join that job.
    return {k: v for k, v in os.environ.items() if k not in _JOB_VARS}


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_aps_demo(), *args],
        env=_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


@pytest.mark.slow
def test_two_ranks_one_epoch_writes_json_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    # Started in a checkout, the ranks (`python -m`, which puts the working
    # folder on sys.path) must still import what is installed, not this one.
    (tmp_path / "aps_comm").mkdir()
    (tmp_path / "aps_comm" / "__init__.py").write_text(
        "raise ImportError('the folder\\'s aps_comm')\n"
    )
    proc = _run(
        ["--epochs", "1", "--hooks", "fp32,aps-e4m3", "--json", str(out), "--plot", str(png)],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the folder's aps_comm" not in proc.stdout + proc.stderr

    runs = json.loads(out.read_text())["runs"]
    assert [r["name"] for r in runs] == ["fp32", "aps-e4m3"]
    for r in runs:
        assert {"name", "test_accuracy", "loss", "bytes_per_step", "seconds"} <= r.keys()
        assert 0.0 <= r["test_accuracy"] <= 1.0
        assert 0.0 < r["loss"] < 10.0
        assert r["seconds"] > 0
        assert r["bytes_per_step"] > 0
    fp32, aps = runs
    # One byte instead of four per element, plus the per-layer maxima and the
    # two-phase padding: a few dozen bytes on tens of kilobytes.
    assert 0.25 <= aps["bytes_per_step"] / fp32["bytes_per_step"] <= 0.26
    # One epoch is still on the initial plateau (the default run uses 20), so
    # accuracy is only range-checked; both runs started from the same weights.
    assert fp32["loss_curve"] and len(fp32["loss_curve"]) == len(aps["loss_curve"]) == 1
    assert png.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fp32" in proc.stdout and "aps-e4m3" in proc.stdout and "bytes/step" in proc.stdout


def test_unknown_hook_fails_before_launching(tmp_path: Path) -> None:
    proc = _run(["--hooks", "fp32,fp8-magic"], tmp_path)
    assert proc.returncode != 0
    assert "unknown hook name(s): fp8-magic" in proc.stderr
    for name in DEFAULT_HOOKS:
        assert name in proc.stderr
    assert "step" not in proc.stderr  # nothing was trained


def test_resolve_hooks() -> None:
    assert resolve_hooks("fp32, aps-e4m3,fp32") == ["fp32", "aps-e4m3"]
    assert resolve_hooks("fp32", fmt="e3m2") == ["fp32", "aps-e3m2"]
    assert resolve_hooks("naive-e5m2") == ["naive-e5m2"]
    with pytest.raises(ValueError, match="unknown hook"):
        resolve_hooks("aps-e4m3,aps-nope")
    with pytest.raises(ValueError, match="--fmt"):
        resolve_hooks("fp32", fmt="nope")
    with pytest.raises(ValueError, match="no hooks"):
        resolve_hooks(" , ")


def test_plot_without_matplotlib_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A None entry makes `import matplotlib` raise ImportError, as in a minimal install.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exc:
        main(["--plot", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install '.[demo]'" in err


def test_format_table_relative_to_fp32() -> None:
    runs = [
        {"name": "fp32", "test_accuracy": 0.9, "loss": 0.1, "bytes_per_step": 400.0, "seconds": 1},
        {
            "name": "aps-e4m3",
            "test_accuracy": 0.9,
            "loss": 0.1,
            "bytes_per_step": 104.0,
            "seconds": 1,
        },
    ]
    lines = format_table(runs).splitlines()
    assert lines[0].split()[:3] == ["hook", "test", "acc"]
    assert lines[2].split()[4] == "0.260"
