"""Tests for ``aps-demo`` (launch/demo.py): a real two-rank run, its outputs, its errors."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from aps_launch.demo import DEFAULT_HOOKS, format_table, main, progress_bar, resolve_hooks

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


def test_a_log_line_prints_above_the_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    # What aps_comm.cpu_kernels logs at the first quantised step, while the bar is drawn.
    notice = "aps_comm: compiling the CPU codec kernels with numba"
    with progress_bar(2, "aps-e4m3") as bar:
        bar.update()
        logging.getLogger("aps_comm.cpu_kernels").warning(notice)
        bar.update()
    err = capsys.readouterr().err
    (line,) = [line for line in err.split("\n") if notice in line]
    # The bar was cleared (its last "\r") before the line: the line is the notice alone.
    assert line.split("\r")[-1] == notice, repr(err)
    # And drawn again below it, to the end.
    assert err.rstrip("\n").split("\r")[-1].startswith("aps-e4m3: 100%"), repr(err)
