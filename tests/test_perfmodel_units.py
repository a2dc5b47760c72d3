"""How the model prints quantities: three significant digits in the unit a reader expects."""

from __future__ import annotations

import pytest

from aps_perfmodel.cli import main as cli_main
from aps_perfmodel.units import format_bandwidth, format_bytes, format_time


@pytest.mark.parametrize(
    ("bytes_per_s", "text"),
    [
        (0.99999e9 / 8, "1 Gbit/s"),  # rounds up into the next unit, not "1e+03 Mbit/s"
        (125e6, "1 Gbit/s"),
        (99.96e6 / 8, "100 Mbit/s"),
        (12.5e9, "100 Gbit/s"),
        (0.1, "0.8 bit/s"),
    ],
)
def test_format_bandwidth_picks_the_unit_after_rounding(bytes_per_s: float, text: str) -> None:
    assert format_bandwidth(bytes_per_s) == text


def test_format_time_and_bytes_pick_the_unit_after_rounding() -> None:
    assert format_time(0.9999996e-3) == "1 ms"
    assert format_time(9.489999999999998) == "9.49 s"
    assert format_time(5e-9) == "5 ns"
    assert format_time(0.0) == "0 s"
    assert format_bytes(1023.9) == "1 KiB"
    assert format_bytes(3 * 2**20) == "3 MiB"


def test_predict_names_a_1_gbit_link_in_gbit(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["predict", "--model", "resnet50", "--world-size", "8", "--cluster", "1gbe"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "inter 1 Gbit/s" in out and "e+0" not in out, out
