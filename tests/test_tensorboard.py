"""log_stats writes an event file that TensorBoard reads back as the state's figures."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aps_comm import APSState
from aps_comm.formats import E4M3
from aps_comm.telemetry import layer_stats


def _step_stats(scale: float) -> list:
    """Real records of three layers: one underflows, one saturates, one has no name."""
    gen = torch.Generator().manual_seed(0)
    layers = [
        torch.randn(64, generator=gen) * 1e-4 * scale,
        torch.randn(32, generator=gen) * scale,
        torch.randn(8, generator=gen) * scale,
    ]
    exps = torch.tensor([8, 8, -2])
    amax = torch.stack([t.abs().max() for t in layers])
    amax[2] = float("inf")  # a rank had a non-finite gradient
    return layer_stats(layers, ["a.weight", "b.weight", None], 0, E4M3, exps, amax)


def test_layer_stats_count_as_the_hook_counts_a_nan_included() -> None:
    """The host records' underflow rate has the device counts' denominator
    (:func:`aps_comm.telemetry.layer_counts`): a NaN is not a nonzero element."""
    from aps_comm.telemetry import layer_counts

    layer = torch.tensor([1.0, 1e-9, 0.0, float("nan"), 2.0])
    exps = torch.tensor([0])
    [record] = layer_stats([layer], ["w"], 0, E4M3, exps, torch.tensor([float("nan")]))
    nonzero, under, _ = layer_counts(layer, torch.tensor([5]), exps, E4M3)[0].tolist()
    assert (nonzero, under) == (3, 1)
    assert record.underflow_rate == under / nonzero


def _float32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def test_event_file_holds_the_state_stats(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from aps_comm.tensorboard import log_stats

    state = APSState("e4m3", stats=True)
    written = {}
    with SummaryWriter(str(tmp_path)) as writer:
        for step, scale in ((1, 1.0), (2, 3.0)):
            state.stats, state.bytes_sent, state.step = _step_stats(scale), 1000 * step, step
            state.bytes_total = 1500 * step
            log_stats(writer, state)
            written[step] = (state.stats, state.bytes_sent)
    first = written[1][0]
    assert first[0].underflow_rate > 0 and first[1].saturated > 0  # the figures are not trivial

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    names = ["a.weight", "b.weight", "layer2"]
    expected_tags = {"aps/bytes_sent", "aps/bytes_total"} | {
        f"aps/{figure}/{n}"
        for figure in ("exponent", "amax", "underflow_rate", "saturated")
        for n in names
    }
    assert set(events.Tags()["scalars"]) == expected_tags

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert series("aps/bytes_sent") == [(1, 1000.0), (2, 2000.0)]
    assert series("aps/bytes_total") == [(1, 1500.0), (2, 3000.0)]
    for i, name in enumerate(names):
        for figure in ("exponent", "amax", "underflow_rate", "saturated"):
            want = [
                (step, _float32(getattr(stats[i], figure))) for step, (stats, _) in written.items()
            ]
            assert series(f"aps/{figure}/{name}") == want, (figure, name)
    assert series("aps/amax/layer2")[0][1] == float("inf")


def test_a_state_without_stats_is_refused() -> None:
    from aps_comm.tensorboard import log_stats

    with pytest.raises(ValueError, match="stats=True"):
        log_stats(object(), APSState("e4m3"))  # type: ignore[arg-type]


@pytest.mark.slow
def test_aps_comm_does_not_import_tensorboard() -> None:
    code = (
        "import sys\n"
        "import aps_comm, aps_comm.tensorboard\n"
        "print(sorted(m for m in sys.modules if 'tensorboard' in m and 'aps_comm' not in m))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
