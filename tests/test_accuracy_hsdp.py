"""benchmarks.accuracy --hsdp: its layout and setups, its rows, FP32's spread beside them."""

import json
from pathlib import Path

import pytest

pytest.importorskip("sklearn.datasets")
pytest.importorskip("matplotlib")

from benchmarks import accuracy, report


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hsdp", "--replicas", "3"], "--replicas 3 does not divide --world-size 4"),
        (["--hsdp", "--replicas", "1"], "--replicas 1: HSDP needs at least 2 replicas"),
        (["--replicas", "2"], "--replicas 2: only with --hsdp"),
        (["--hsdp", "--hooks", "hsdp-fp32", "fp32"], "--hooks fp32: not HSDP setups"),
        (["--hooks", "hsdp-aps-e4m3"], "--hooks hsdp-aps-e4m3: HSDP setups, only with --hsdp"),
        (["--hsdp", "--fsdp"], "not allowed with argument"),
    ],
)
def test_a_bad_hsdp_layout_or_setup_is_an_error_before_any_training(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        accuracy.main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _run(hook: str, seed: int, acc: float) -> dict:
    return {
        "task": "digits",
        "hook": hook,
        "seed": seed,
        "final": {"test_acc": acc, "test_loss": 0.1},
        "curve": [],
        "bytes_per_step": 400,
        "parameters": 10,
        "seconds": 1.0,
        "layers": None,
    }


def _hsdp_result(e4m3: float, e2m1: float) -> dict:
    hooks = list(accuracy.HSDP_HOOKS)
    runs = [_run("hsdp-fp32", 0, 0.97), _run("hsdp-fp32", 1, 0.99)]
    runs += [_run("hsdp-aps-e4m3", s, e4m3) for s in (0, 1)]
    runs += [_run("hsdp-aps-e2m1-block", s, e2m1) for s in (0, 1)]
    settings = {"world_size": 4, "replicas": 2, "hsdp": True, "seeds": 2, "tasks": ["digits"]}
    settings |= {"hooks": hooks, "digits_epochs": 1, "digits_batch": 32, "digits_lr": 0.1}
    return {
        "command": "python -m benchmarks.accuracy --hsdp",
        "machine": {"cpus": 2, "torch": "2", "backend": "gloo"},
        "settings": settings,
        "seconds": 10.0,
        "summary": accuracy._summary(runs, hooks, ["digits"]),
        "runs": runs,
    }


def test_each_hsdp_row_is_held_to_fp32s_spread(tmp_path: Path) -> None:
    result = _hsdp_result(e4m3=0.98, e2m1=0.95)
    offs = accuracy.fp32_spread(result["summary"], "digits")
    assert offs == {
        "hsdp-fp32": 0.0,
        "hsdp-aps-e4m3": 0.0,
        "hsdp-aps-e2m1-block": pytest.approx(-0.02),
    }
    text = accuracy.markdown(result)
    assert "| hsdp-aps-e4m3 | 0.9800 ± 0.0000 |" in text
    assert text.count("| within |") == 2 and "| 0.0200 below |" in text
    assert (
        "FP32's spread, test accuracy over 2 seeds: [0.9700, 0.9900]. Within it: "
        "`hsdp-aps-e4m3`. Outside it: `hsdp-aps-e2m1-block` (0.0200 below)." in text
    )
    with pytest.raises(ValueError, match="task 'mnist'"):
        accuracy.fp32_spread(result["summary"], "mnist")

    (tmp_path / "accuracy_hsdp_2x2.json").write_text(json.dumps(result))
    head = report.build(tmp_path, tmp_path / "RESULTS.md").split("## Accuracy")[0]
    assert "hsdp-aps-e4m3 0.9800 within, hsdp-aps-e2m1-block 0.9500 outside by 0.0200" in head
    assert "Miss: HSDP 2 x 2" not in head
    (tmp_path / "accuracy_hsdp_2x2.json").write_text(json.dumps(_hsdp_result(0.995, 0.98)))
    head = report.build(tmp_path, tmp_path / "RESULTS.md").split("## Accuracy")[0]
    assert "- Miss: HSDP 2 x 2, digits: hsdp-aps-e4m3's mean test accuracy" in head
