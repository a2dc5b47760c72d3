"""benchmarks.accuracy --hsdp: its layout and setups, its rows, FP32's spread beside them."""

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("sklearn.datasets")
pytest.importorskip("matplotlib")

from benchmarks import accuracy, report
from benchmarks._models import TinyLM


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


def _padded_shard_bytes(shards: int) -> int:
    """FP32 bytes of one rank's shard of TinyLM(8, 16, 32, 2): dim 0 padded to ``shards``."""
    total = 0
    for p in TinyLM(8, 16, 32, 2).parameters():
        rows = p.shape[0] if p.dim() else 1
        total += math.ceil(rows / shards) * (p.numel() // rows)
    return 4 * total


@pytest.mark.slow
def test_hsdp_mode_trains_every_setup_on_a_2x2_mesh_and_reports_it(tmp_path: Path) -> None:
    argv = ["--hsdp", "--world-size", "4", "--seeds", "1", "--tasks", "markov"]
    argv += ["--lm-steps", "2", "--lm-evals", "1", "--lm-train", "256", "--lm-test", "64"]
    result = accuracy.main([*argv, "--out", str(tmp_path)])
    assert result["settings"]["replicas"] == 2
    rows = {r["hook"]: r for r in result["summary"]}
    assert list(rows) == list(accuracy.HSDP_HOOKS)
    # Native HSDP all-reduces each rank's padded shard of every unit in FP32.
    assert rows["hsdp-fp32"]["bytes_per_step"] == _padded_shard_bytes(2)
    for hook in ("hsdp-aps-e4m3", "hsdp-aps-e2m1-block"):
        assert rows[hook]["test_loss"]["per_seed"][0] < 2.5  # it trained, not diverged
    # One byte per element plus 4 bytes per parameter for the maxima, as in the DDP tables.
    assert 0.25 <= rows["hsdp-aps-e4m3"]["bytes_vs_fp32"] < 0.27
    assert rows["hsdp-aps-e2m1-block"]["bytes_vs_fp32"] < rows["hsdp-aps-e4m3"]["bytes_vs_fp32"]
    saved = json.loads((tmp_path / "accuracy_hsdp_2x2.json").read_text())
    assert saved["command"].startswith("python -m benchmarks.accuracy --hsdp")
    text = report.build(tmp_path, tmp_path / "RESULTS.md")
    hsdp = text.split("## HSDP: APS replica all-reduce, accuracy")[1]
    assert "vs FP32's [min, max]" in hsdp and "| hsdp-aps-e2m1-block |" in hsdp
    assert "](./accuracy_hsdp_2x2_markov.png)" in hsdp


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
    assert "| hsdp-fp32 | 0.9800 ± 0.0141 |" in text
    assert "| 400 | 1.000 | [0.9700, 0.9900] |" in text  # FP32's row shows its spread
    assert text.count("| within |") == 1 and "| 0.02 below |" in text
    assert (
        "FP32's spread, test accuracy over 2 seeds: [0.9700, 0.9900]. Within it: "
        "`hsdp-aps-e4m3`. Outside it: `hsdp-aps-e2m1-block` (0.02 below)." in text
    )
    with pytest.raises(ValueError, match="task 'mnist'"):
        accuracy.fp32_spread(result["summary"], "mnist")

    (tmp_path / "accuracy_hsdp_2x2.json").write_text(json.dumps(result))
    head = report.build(tmp_path, tmp_path / "RESULTS.md").split("## Accuracy")[0]
    assert (
        "hsdp-aps-e4m3 0.9800 within, hsdp-aps-e2m1-block 0.9500 outside by 0.02 (worse than every FP32 seed)"
        in head
    )
    assert "Miss: HSDP 2 x 2" not in head
    (tmp_path / "accuracy_hsdp_2x2.json").write_text(json.dumps(_hsdp_result(0.995, 0.98)))
    head = report.build(tmp_path, tmp_path / "RESULTS.md").split("## Accuracy")[0]
    assert (
        "- Miss: HSDP 2 x 2, digits: hsdp-aps-e4m3's mean test accuracy 0.9950 is not within "
        "FP32's [0.9700, 0.9900]: outside by 0.005 (better than every FP32 seed); the target "
        "is within it." in head
    )
