"""Device presets with measured constants (the h200 preset): the codec passes and the hook's
host cost per bucket come from the device where no calibrated profile gives them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from aps_perfmodel import Cluster, bucket_comm, get_cluster, get_device, get_format
from aps_perfmodel import cluster as cluster_module
from aps_perfmodel.calibrate import CALL_ELEMENTS
from aps_perfmodel.cli import main as cli_main
from aps_perfmodel.cluster import OpCost, codec_bytes_per_elem
from aps_perfmodel.strategies import bucket_breakdown

N = 2**26  # the codec step's buffer: 256 MiB of float32
BUCKET = 25 * 2**18  # DDP's default 25 MB bucket


def _h200(world_size: int = 16) -> Cluster:
    return replace(get_cluster("dgx-h100", world_size=world_size), device=get_device("h200"))


def _ideal(cluster: Cluster) -> Cluster:
    """The same device priced from its datasheet alone."""
    return replace(cluster, device=replace(cluster.device, measured={}))


def test_h200_preset_is_the_datasheet_plus_the_measured_run() -> None:
    h100, h200 = get_device("h100"), get_device("h200")
    assert h200.mem_bw == 4.8e12 and h200.fp8_sum
    assert h200.peak_flops == h100.peak_flops
    assert {"encode.e4m3", "decode.e4m3", "hook_call.e4m3", "hook_call.fp16"} <= set(h200.measured)
    assert {"encode.e4m3.block32", "decode.e4m3.block32"} <= set(h200.measured)
    assert "35adf17" in h200.measured_source and "--preset h200" in h200.measured_source
    # No H100 run exists: its preset is the datasheet, and says so.
    assert not h100.measured and "has not run on an H100" in h100.source


def test_codec_time_uses_the_devices_measured_passes() -> None:
    c = _h200()
    costs = c.device.measured
    for op in ("encode", "decode"):
        measured = c.codec_time(op, "e4m3", 1.0, N)
        assert measured == pytest.approx(costs[f"{op}.e4m3"].time(N))
        # The measured kernels are slower than the memory-bound ideal of the datasheet.
        assert measured > _ideal(c).codec_time(op, "e4m3", 1.0, N)
        block = c.codec_time(op, "e4m3", 1.0, N, block_size=32)
        assert block == pytest.approx(costs[f"{op}.e4m3.block32"].time(N)) and block > measured
        # A block size the run did not time: the per-layer pass plus the exponents' traffic.
        ratio = codec_bytes_per_elem(op, 1.0, 1 / 16) / codec_bytes_per_elem(op, 1.0)
        assert c.codec_time(op, "e4m3", 1.0, N, block_size=16) == pytest.approx(measured * ratio)
    # Formats the run did not time keep the datasheet's price.
    assert c.codec_time("encode", "e5m2", 1.0, N) == _ideal(c).codec_time("encode", "e5m2", 1.0, N)


def test_a_calibrated_profile_overrides_the_devices_constants() -> None:
    fits = {"encode.e4m3": OpCost(1e-5, 1e-9), "hook_call.fp16": OpCost(2e-3, 0.0)}
    c = replace(_h200(), codec_fits=fits)
    assert c.pass_costs == fits
    assert c.codec_time("encode", "e4m3", 1.0, N) == pytest.approx(fits["encode.e4m3"].time(N))
    # Not a mix of two machines: the device's decode and e4m3 hook call are not used.
    assert c.codec_time("decode", "e4m3", 1.0, N) == _ideal(c).codec_time("decode", "e4m3", 1.0, N)
    e4m3 = get_format("e4m3")
    assert bucket_comm(BUCKET, 20, e4m3, c).overhead_s == 0.0
    assert bucket_comm(BUCKET, 20, get_format("fp16"), c).overhead_s > 0.0


@pytest.mark.parametrize("fmt", ["e4m3", "fp16"])
def test_the_host_cost_per_bucket_enters_the_bucket_time(fmt: str) -> None:
    c, spec = _h200(), get_format(fmt)
    call = c.device.measured[f"hook_call.{fmt}"].launch_s
    measured, ideal = bucket_comm(BUCKET, 20, spec, c), bucket_comm(BUCKET, 20, spec, _ideal(c))
    assert measured.strategy == ideal.strategy
    # The measured call replaces the parts' fixed costs (those of a tiny bucket).
    tiny = bucket_breakdown(CALL_ELEMENTS, 20, spec, c, measured.strategy)
    assert measured.overhead_s == pytest.approx(call - tiny.total_s)
    parts = bucket_breakdown(BUCKET, 20, spec, c, measured.strategy)
    assert measured.total_s == pytest.approx(parts.total_s + call - tiny.total_s)
    # Measured kernels and host cost: slower than the datasheet's ideal.
    assert measured.total_s > ideal.total_s


def test_fp32_pays_no_hook_cost() -> None:
    # DDP's own all-reduce runs no hook: the run measured no host cost for it.
    c = _h200()
    fp32 = get_format("fp32")
    assert bucket_comm(BUCKET, 20, fp32, c) == bucket_comm(BUCKET, 20, fp32, _ideal(c))


def _predict(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert cli_main(["predict", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_device_h200_predicts_the_measured_costs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ("--model", "gpt2-xl", "--cluster", "dgx-h100", "--world-size", "16")
    argv += ("--device", "h200", "--fmt", "e4m3", "--strategy", "two_phase")
    measured = _predict(capsys, *argv)
    assert measured["assumptions"]["device"] == "h200"
    assert "35adf17" in measured["assumptions"]["measured"]
    ideal_h200 = replace(get_device("h200"), measured={})
    monkeypatch.setitem(cluster_module.DEVICES, "h200", ideal_h200)
    ideal = _predict(capsys, *argv)
    assert "measured" not in ideal["assumptions"]
    for fmt in ("e4m3", "fp16"):
        assert measured["formats"][fmt]["comm_s"] > ideal["formats"][fmt]["comm_s"]
    assert measured["formats"]["fp32"]["comm_s"] == ideal["formats"]["fp32"]["comm_s"]
    monkeypatch.undo()
    assert cli_main(["predict", *argv]) == 0
    text = capsys.readouterr().out
    assert "measured codec and hook costs per bucket of the h200 preset" in text
