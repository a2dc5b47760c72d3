"""Calibration: fitting a profile, the burst term, timing collectives on real ranks."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
import torch.distributed as dist

from aps_perfmodel import collectives as C
from aps_perfmodel.cli import main as cli_main

# --- calibration ------------------------------------------------------------------


def test_fit_profile_recovers_synthetic_parameters(tmp_path) -> None:
    from aps_perfmodel.calibrate import COLLECTIVE_COEFFS, fit_profile
    from aps_perfmodel.profile import Profile

    p, alpha, beta, gamma = 4, 2e-5, 1e-9, 3e-10
    samples = []
    for n in (1e4, 1e5, 1e6, 1e7):
        for op in ("all_reduce", "all_to_all", "all_gather"):
            a, b, c = COLLECTIVE_COEFFS[op](p)
            key = "all_reduce.float32" if op == "all_reduce" else op
            samples.append({"op": key, "n": n, "seconds": a * alpha + b * n * beta + c * n * gamma})
        samples.append({"op": "encode.e4m3", "n": n, "seconds": 1e-5 + n * 2e-9})
    prof = fit_profile(samples, p)
    assert prof.link.alpha == pytest.approx(alpha, rel=1e-6)
    assert prof.link.beta == pytest.approx(beta, rel=1e-6)
    assert prof.link.gamma == pytest.approx(gamma, rel=1e-6)
    # Per collective, gamma folds into beta: 2(p-1)/p beta' = 2(p-1)/p beta + (p-1)/p gamma.
    assert prof.collectives["all_reduce.float32"].beta == pytest.approx(beta + gamma / 2, rel=1e-6)
    assert prof.codec["encode.e4m3"].s_per_elem == pytest.approx(2e-9, rel=1e-6)
    path = tmp_path / "p.json"
    prof.save(path)
    again = Profile.load(path)
    assert again.collectives == prof.collectives and again.codec == prof.codec


def test_burst_term_hand_values_and_fit() -> None:
    from aps_perfmodel.calibrate import COLLECTIVE_COEFFS, fit_profile

    link = C.LinkParams(alpha=1.0, beta=1.0, gamma=1.0, burst_bytes=2.0)
    # Ring, n=4, p=2: 2 alpha + max(0, 2*4*1/2 - 2) beta + 4*1/2 gamma = 2 + 2 + 2.
    assert C.ring_allreduce(4.0, 2, link) == 6.0
    # All-gather, n=4, p=2: alpha + max(0, 2 - 2) beta = 1 (the burst covers it).
    assert C.all_gather(4.0, 2, link) == 1.0
    # Two flows share the bucket: 1 byte each, so all-to-all n=6, p=2 -> 1 + (3 - 1) * 2.
    assert C.all_to_all(6.0, 2, link.shared_by(2)) == 5.0
    with pytest.raises(ValueError):
        C.LinkParams(1.0, 1.0, burst_bytes=-1.0)
    # Samples from t = A alpha + beta max(0, B n - burst): the burst-aware fit
    # recovers beta exactly, given the burst or choosing it from the samples.
    p, alpha, beta, burst = 2, 1e-4, 8e-9, 5e5
    samples = []
    for n in (2.5e5, 6e5, 1.6e6, 4e6, 1e7):
        a, b, _ = COLLECTIVE_COEFFS["all_gather"](p)
        samples.append(
            {"op": "all_gather", "n": n, "seconds": a * alpha + beta * max(0.0, b * n - burst)}
        )
    fit = fit_profile(samples, p, burst_bytes=burst).collectives["all_gather"]
    assert fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.burst_bytes == burst
    fit = fit_profile(samples, p, burst_bytes="fit").collectives["all_gather"]
    assert fit.beta == pytest.approx(beta, rel=0.05)
    assert fit.burst_bytes == pytest.approx(burst, rel=0.1)
    assert fit_profile(samples, p).collectives["all_gather"].beta < 0.9 * beta


def _calibrate_rank(rank: int, world_size: int) -> dict:
    import contextlib
    import io

    from aps_comm import measure
    from aps_comm.calibrate import run_calibration

    hook_runs: list[str] = []
    timed = measure.HookBench.steps

    def counted(bench: measure.HookBench, *args: object, **kwargs: object) -> list[float]:
        hook_runs.append(bench.fmt)
        return timed(bench, *args, **kwargs)

    measure.HookBench.steps = counted
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            samples, label = run_calibration(
                [4096, 65536], repeats=1, codec_kind="torch", layers=4, settle_s=0.0, progress=True
            )
    finally:
        measure.HookBench.steps = timed
    return {
        "samples": samples,
        "label": label,
        "hook_runs": hook_runs,
        "stderr": stderr.getvalue(),
    }


@pytest.mark.slow
def test_calibration_end_to_end_two_ranks(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from aps_comm.testing import run_distributed
    from aps_perfmodel.calibrate import fit_profile

    out = run_distributed(_calibrate_rank, 2, timeout=120)
    assert out[0]["samples"] == out[1]["samples"]  # every rank reports the group's timing
    # A calibration takes minutes: rank 0 shows its progress through the sizes, once.
    assert "calibrating" in out[0]["stderr"] and "2/2" in out[0]["stderr"], out[0]["stderr"]
    # (Rank 1 may print numba's one-time compile notice where no cache exists yet.)
    assert "calibrating" not in out[1]["stderr"], out[1]["stderr"]
    # The hook calls' repeats come in one share per calibrated size, spread over the sweep.
    assert out[0]["hook_runs"] == ["fp32", "fp16", "e4m3"] * 2
    ops = {s["op"] for s in out[0]["samples"]}
    assert {
        "all_reduce.float32",
        "all_to_all",
        "all_gather",
        "all_reduce_max",
        "encode.e4m3",
        "decode.e4m3",
        "accumulate",
        "amax",
        "hook_call.fp32",
        "hook_call.fp16",
        "hook_call.e4m3",
    } <= ops
    # Collectives and hook calls from the last rank's start (one clock here),
    # local passes by the slowest rank.
    timed = {s["op"]: s["timed"] for s in out[0]["samples"]}
    assert timed["all_to_all"] == timed["all_reduce_max"] == "last_start"
    assert timed["hook_call.fp32"] == timed["hook_call.e4m3"] == "last_start"
    assert timed["encode.e4m3"] == timed["amax"] == "slowest_rank"
    prof = fit_profile(out[0]["samples"], 2, codec_source=out[0]["label"])
    assert prof.codec_source == "torch-cast"
    path = tmp_path / "prof.json"
    prof.save(path)
    rc = cli_main(
        ["predict", "--model", "resnet50", "--profile", str(path), "--step-time", "1s", "--json"]
    )
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["world_size"] == 2 and res["formats"]["e4m3"]["comm_s"] > 0


def _late_joiner_rank(rank: int, world_size: int) -> dict:
    from aps_comm import measure

    # Rank 1 idles 0.2 s longer after each barrier: rank 0 waits for it inside
    # the collective, which is skew, not the collective's cost.
    settle = 0.2 if rank == 1 else 0.0
    x = torch.ones(4)
    op = lambda: dist.all_reduce(x)  # noqa: E731
    calls = [0, 0]

    def counted(i: int) -> None:
        calls[i] += 1
        dist.all_reduce(x)

    # A quick op: the budget would allow far more than the cap / the floor.
    measure.time_op(lambda: counted(0), 2, budget_s=60.0, max_repeats=7)
    measure.time_op(lambda: counted(1), 2, budget_s=0.0, max_repeats=7)
    # 10 repeats (not the default 40): each idles 0.2 s, and the trimmed mean
    # of 10 still drops a stalled repeat at either end.
    return {
        "shared": measure.shared_clock(),
        "slowest": measure.time_op(op, 3, settle_s=settle, max_repeats=10),
        "from_last_start": measure.time_op(
            op, 3, settle_s=settle, from_last_start=True, max_repeats=10
        ),
        "calls": calls,
    }


def test_time_op_from_last_start_excludes_late_joiner_wait() -> None:
    from aps_comm.testing import run_distributed

    out = run_distributed(_late_joiner_rank, 2, timeout=120)
    assert out[0] == out[1]  # one number for the group
    assert out[0]["shared"]  # local ranks read one clock
    assert out[0]["slowest"] >= 0.2
    assert out[0]["from_last_start"] < 0.1
    # One warm-up, then repeats up to the cap within the budget (never below `repeats`).
    assert out[0]["calls"] == out[1]["calls"] == [1 + 7, 1 + 2]


def test_repeats_for_budget_and_cap() -> None:
    from aps_comm.measure import repeats_for

    assert repeats_for(0.01, 5) == 25  # 0.25 s default budget
    assert repeats_for(0.01, 5, budget_s=3.0, max_repeats=200) == 200
    assert repeats_for(0.05, 5, budget_s=3.0, max_repeats=200) == 60
    assert repeats_for(2.0, 5, budget_s=3.0, max_repeats=200) == 5
    with pytest.raises(ValueError, match=r"max_repeats >= 1, got 0.25 and 0"):
        repeats_for(0.01, 5, max_repeats=0)


def test_trimmed_mean_is_stable_where_the_median_jumps() -> None:
    from aps_comm.measure import trimmed_mean

    # Bimodal repeats, as small hook calls on a shared VM: 1 ms or 5 ms.
    fewer_slow = [1.0] * 11 + [5.0] * 9
    more_slow = [1.0] * 9 + [5.0] * 11
    assert statistics.median(fewer_slow) == 1.0 and statistics.median(more_slow) == 5.0
    assert trimmed_mean(fewer_slow) == pytest.approx(2.75)  # 9x1 + 7x5 of the middle 16
    assert trimmed_mean(more_slow) == pytest.approx(3.25)
    # A rare stall (a retransmit) is trimmed away; trim 0 is the plain mean.
    assert trimmed_mean([1.0] * 19 + [200.0]) == 1.0
    assert trimmed_mean([1.0, 2.0, 6.0], 0.0) == 3.0
    with pytest.raises(ValueError, match="trim must be in"):
        trimmed_mean([1.0], 0.5)
    with pytest.raises(ValueError, match="at least one value"):
        trimmed_mean([])


def _calibrate_command_rank(rank: int, world_size: int, out: str) -> int:
    from aps_comm import measure
    from aps_comm.__main__ import main

    # One timed repeat per point: quick operations would otherwise repeat for a
    # quarter second each (this rank's process only).
    measure.BUDGET_S, measure.MAX_REPEATS = 0.0, 1
    # The command as a launcher's rank runs it (the group is up already here).
    return main(
        ["calibrate", "--sizes", "4KiB,64KiB", "--repeats", "1", "--codec", "torch", "--out", out]
    )


@pytest.mark.slow
def test_the_plugins_calibrate_command_writes_the_profile_the_model_reads(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aps_comm.testing import run_distributed
    from aps_perfmodel.cli import main as perfmodel_main
    from aps_perfmodel.profile import Profile

    out = tmp_path / "profile.json"
    assert run_distributed(_calibrate_command_rank, 2, args=(str(out),), timeout=120) == [0, 0]
    profile = Profile.load(out)
    assert profile.world_size == 2 and profile.codec_source == "torch-cast"
    assert {"all_to_all", "hook_call.e4m3"} <= {s["op"] for s in profile.samples}
    capsys.readouterr()
    argv = ["predict", "--params", "25.6M", "--profile", str(out), "--json"]
    assert perfmodel_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 2
