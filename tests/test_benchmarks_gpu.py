"""benchmarks.gpu on a machine without a GPU: it runs, skips every step with the reason,
exits 0; its helpers and checks, with hand values and on a real 2-rank Gloo run."""

from __future__ import annotations

import copy
import cProfile
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import made_once

from aps_comm.testing import run_distributed
from benchmarks import gpu
from benchmarks.gpu import EventKind, HookCase, ProfileEvent

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a CUDA device")
def test_without_cuda_every_step_is_skipped_with_its_reason(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "gpu.json").read_text())
    assert report["command"] == "python -m benchmarks.gpu --out results"
    assert [s["name"] for s in report["steps"]] == list(gpu.STEPS)
    for step in report["steps"]:
        assert step["status"] == "skipped"
        assert step["reason"] == "no CUDA device (torch.cuda.is_available() is False)"
    md = (out / "gpu.md").read_text()
    for name in gpu.STEPS:
        assert f"| {name} | skipped | no CUDA device" in md


def test_steps_run_most_valuable_first_within_8_minutes() -> None:
    assert list(gpu.STEPS) == [
        "step",
        "codec",
        "profile",
        "hook_nccl",
        "hook_gloo_cuda",
        "fsdp",
        "cuda_tests",
    ]
    assert set(gpu.MIN_SECONDS) == set(gpu.STEPS)
    # The budget plus Python's and torch's start and the report: within 8 minutes.
    assert gpu.DEFAULT_BUDGET_S + 45 <= 8 * 60
    # The step's own allowance leaves room for the others.
    assert gpu._STEP_SECONDS <= gpu.DEFAULT_BUDGET_S / 1.5


def test_a_step_that_does_not_fit_the_budget_is_skipped_with_the_reason(tmp_path: Path) -> None:
    assert gpu.budget_skip_reason("step", 60.0) is None
    assert gpu.budget_skip_reason("step", 59.4) == (
        "the time budget: 59 s left, step needs at least 60 s"
    )
    assert gpu.budget_skip_reason("codec", -3.0) == (
        "the time budget: 0 s left, codec needs at least 30 s"
    )
    env = gpu.Environment(True, "H100", (9, 0), "2.13.0", (2, 27, 3), True, True)
    ctx = gpu.StepContext(env, tmp_path, time.monotonic() + 40)  # 40 s left: codec only
    assert gpu._run_step("step", ctx) == gpu.StepResult(
        "step", gpu.Status.SKIPPED, "the time budget: 40 s left, step needs at least 60 s"
    )
    assert gpu._run_step("cuda_tests", ctx).reason.startswith("the time budget: 40 s left")


def test_step_model_is_the_issue_34_model_of_216_7m_parameters() -> None:
    spec = gpu.LMSpec()
    assert (spec.vocab, spec.d_model, spec.heads, spec.ff, spec.layers) == (
        32000,
        1024,
        16,
        4096,
        12,
    )
    assert (spec.batch, spec.seq) == (8, 512)
    with torch.device("meta"):
        model = gpu.StepLM(spec)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 216.7e6) <= 0.1e6, n
    layers = model.encoder.layers
    assert len(layers) == 12
    assert all(layer.norm_first for layer in layers)
    assert all(layer.dropout.p == 0.0 and layer.self_attn.num_heads == 16 for layer in layers)
    assert layers[0].linear1.out_features == 4096
    assert model.embed.weight is not model.head.weight


def test_step_configs_are_the_issue_34_table() -> None:
    got = [(c.name, c.code, c.target) for c in gpu.STEP_CONFIGS]
    assert got == [
        ("DDP default", "DDP(model)", None),
        ("fp16_compress_hook", "ddp.register_comm_hook(None, fp16_compress_hook)", None),
        ("allreduce_hook", "ddp.register_comm_hook(None, allreduce_hook)", None),
        (
            "APS e4m3 two_phase",
            'aps_comm.register(ddp, fmt="e4m3", reduction="two_phase")',
            1.10,
        ),
        (
            "APS e4m3 allreduce (native FP8)",
            'aps_comm.register(ddp, fmt="e4m3", reduction="allreduce")',
            1.10,
        ),
        (
            "APS e2m1 block two_phase",
            'aps_comm.register(ddp, fmt="e2m1", reduction="two_phase", scaling="block")',
            1.15,
        ),
        (
            "APS e4m3 block two_phase",
            'aps_comm.register(ddp, fmt="e4m3", reduction="two_phase", scaling="block")',
            1.15,
        ),
        ("APS auto", 'aps_comm.register(ddp, fmt="e4m3")', 1.02),
        (
            "APS e4m3 two_phase + stats",
            'aps_comm.register(ddp, fmt="e4m3", reduction="two_phase", stats=True)',
            None,
        ),
        (
            "APS e2m1 block two_phase + error feedback",
            'aps_comm.register(ddp, fmt="e2m1", reduction="two_phase", scaling="block", '
            "error_feedback=True)",
            None,
        ),
        (
            "APS e4m3 two_phase + Promote",
            'aps_comm.register(ddp, fmt="e4m3", reduction="two_phase", policy=[Promote()])',
            None,
        ),
        (
            "APS e4m3 two_phase, no graphs",
            'aps_comm.register(ddp, fmt="e4m3", reduction="two_phase", cuda_graphs=False)',
            None,
        ),
        (
            "APS e2m1 block two_phase, no graphs",
            'aps_comm.register(ddp, fmt="e2m1", reduction="two_phase", scaling="block", '
            "cuda_graphs=False)",
            None,
        ),
        ("DDP default (again)", "DDP(model)", None),
    ]
    assert (gpu.STEP_WARMUP, gpu.STEP_TIMED) == (6, 40)


def test_launch_counts_leave_out_nccl_annotations_and_other_threads() -> None:
    events = [
        ProfileEvent("aps_bucket_0", 7, 0.0, 10.0),
        ProfileEvent("aps_bucket_1", 7, 20.0, 30.0),
        ProfileEvent("aps_bucket_0", 0, 1.0, 9.0, on_device=True, annotation=True),
        ProfileEvent("cudaLaunchKernel", 7, 1.0, 2.0, corr=11),
        ProfileEvent("cuLaunchKernelEx", 7, 3.0, 4.0, corr=12),  # Triton's, driver API
        ProfileEvent("cudaLaunchKernelExC_v11060", 7, 21.0, 22.0, corr=13),
        ProfileEvent("cudaLaunchKernel", 7, 24.0, 25.0, corr=14),  # NCCL's
        ProfileEvent("cudaLaunchKernel", 8, 5.0, 6.0, corr=15),  # another thread
        ProfileEvent("cudaLaunchKernel", 7, 15.0, 16.0, corr=16),  # between buckets
        ProfileEvent("cudaMemcpyAsync", 7, 26.0, 27.0, corr=17),  # not a launch
        ProfileEvent("vectorized_elementwise_kernel", 0, 2.0, 3.0, on_device=True, corr=11),
        ProfileEvent("triton_encode", 0, 4.0, 5.0, on_device=True, corr=12),
        ProfileEvent("reduce_kernel", 0, 22.0, 23.0, on_device=True, corr=13),
        ProfileEvent("ncclDevKernel_AllReduce", 0, 25.0, 26.0, on_device=True, corr=14),
        ProfileEvent("gemm", 0, 6.0, 7.0, on_device=True, corr=15),
        ProfileEvent("gemm", 0, 16.0, 17.0, on_device=True, corr=16),
        ProfileEvent("Memcpy DtoD (Device -> Device)", 0, 27.0, 28.0, on_device=True, corr=17),
    ]
    # Device: 5 kernels (not NCCL's, the copy or the mirrored range); host: 3 launches
    # in the two buckets.
    assert gpu.launch_counts(events) == (5, 1.5, 2)
    assert gpu.launch_counts(events[2:]) == (5, None, 0)


def _row(hook: str, step_ms: float | None, target: float | None = None, **kw: Any) -> dict:
    return {
        "config": kw.pop("config", hook),
        "hook": hook,
        "step_ms": step_ms,
        "target": target,
        **kw,
    }


def test_judge_step_rows_against_the_mean_of_first_and_last_ddp_default() -> None:
    rows, base = gpu.judge_step_rows(
        [
            _row("ddp", 40.0),
            _row("fp16_compress", 41.0),
            _row("aps", 46.0, 1.10),  # 46 / 42 = 1.095: pass
            _row("aps", 46.5, 1.10),  # 1.107: fail
            _row("aps", 48.3, 1.15),  # exactly 1.15: pass
            _row("aps", None, 1.10, skipped="native FP8 unsupported"),
            _row("aps", None, 1.02, error="out of CUDA memory"),
            _row("ddp", 44.0),
        ]
    )
    assert base == {"baseline_ms": 42.0, "baseline_runs_ms": [40.0, 44.0], "drift": 0.1}
    assert [(r["ratio"], r["result"]) for r in rows] == [
        (0.9524, "baseline"),
        (0.9762, "reported"),
        (1.0952, "pass"),
        (1.1071, "fail"),
        (1.15, "pass"),
        (None, "skipped"),
        (None, "error"),
        (1.0476, "baseline"),
    ]
    # One DDP-default run: it alone is the baseline; none: nothing is judged.
    rows, base = gpu.judge_step_rows([_row("ddp", 50.0), _row("aps", 51.0, 1.02)])
    assert base["drift"] is None and rows[1]["result"] == "pass"
    rows, base = gpu.judge_step_rows([_row("ddp", None, error="boom"), _row("aps", 51.0, 1.02)])
    assert base["baseline_ms"] is None
    assert [r["result"] for r in rows] == ["error", "no baseline"]


def test_an_option_is_judged_against_its_plain_row() -> None:
    """Issue 46: e4m3 + stats and e2m1 block + error feedback within 0.05x of their plain rows."""
    plain = _row("aps", 46.2, 1.10, config="plain")  # 1.10
    rows, _ = gpu.judge_step_rows(
        [
            _row("ddp", 42.0),
            plain,
            _row("aps", 48.3, config="ok", beside="plain"),  # 1.15 <= 1.10 + 0.05
            _row("aps", 48.4, config="slow", beside="plain"),  # 1.1524
            _row("aps", 60.0, config="orphan", beside="missing"),
        ]
    )
    assert [(r["target"], r["result"]) for r in rows[2:]] == [
        (1.15, "pass"),
        (1.15, "fail"),
        (None, "reported"),
    ]
    names = {c.name: c for c in gpu.STEP_CONFIGS}
    for cfg in names.values():
        assert cfg.beside is None or names[cfg.beside].target is not None
    assert names["APS e4m3 two_phase + stats"].code.endswith("stats=True)")
    assert "error_feedback=True" in names["APS e2m1 block two_phase + error feedback"].code


def _fake_rows(step_ms: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for cfg in gpu.STEP_CONFIGS:
        row = gpu._step_row(cfg)
        if cfg.reduction == "allreduce":
            row["skipped"] = "aps_comm.register raised ValueError: no native FP8"
        else:
            row["step_ms"] = step_ms.get(cfg.name, 40.0)
        rows.append(row)
    return rows


def test_step_step_judges_the_rows_and_keeps_the_finished_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = gpu.Environment(True, "H100", (9, 0), "2.13.0", (2, 27, 3), True, True)
    ctx = gpu.StepContext(env, tmp_path, time.monotonic() + 400)
    calls: list[dict[str, Any]] = []

    def passing(fn: Any, world: int, **kw: Any) -> list:
        calls.append({"fn": fn, "world": world, **kw})
        return [_fake_rows({"APS auto": 40.4})]

    monkeypatch.setattr(gpu, "run_distributed", passing)
    result = gpu._step_step(ctx)
    assert result.status == gpu.Status.PASSED, result.reason
    (call,) = calls
    assert call["fn"] is gpu.real_model_steps and call["world"] == 1
    assert call["backend"] == "nccl" and call["timeout"] <= gpu._STEP_SECONDS
    assert call["args"][:2] == ("cuda", gpu.STEP_CONFIGS)
    assert result.details["parameters"] == pytest.approx(216.7e6, abs=0.1e6)
    assert [r["result"] for r in result.details["configs"]] == [
        "baseline",
        "reported",
        "reported",
        "pass",
        "skipped",
        "pass",
        "pass",
        "pass",
        "pass",
        "pass",
        "pass",
        "reported",
        "reported",
        "baseline",
    ]

    monkeypatch.setattr(gpu, "run_distributed", lambda *a, **k: [_fake_rows({"APS auto": 41.0})])
    result = gpu._step_step(ctx)
    assert result.status == gpu.Status.FAILED
    assert result.reason == "APS auto: 1.025x > 1.02x"

    def killed(fn: Any, world: int, **kw: Any) -> list:
        partial = Path(kw["args"][-1])
        rows = _fake_rows({})
        partial.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
        raise gpu.DistributedTestError("the job timed out after 240 s")

    monkeypatch.setattr(gpu, "run_distributed", killed)
    result = gpu._step_step(ctx)
    assert result.status == gpu.Status.FAILED
    assert result.reason.startswith("the run stopped: the job timed out after 240 s")
    configs = result.details["configs"]
    assert [r["result"] for r in configs[:2]] == ["baseline", "reported"]
    assert all(r["error"].startswith("the run stopped") for r in configs[2:])
    assert not (tmp_path / "step_rows.jsonl").exists()
    md = gpu.render_markdown({"command": "c", "machine": {}, "steps": [result.to_json()]})
    assert "| DDP default | 40.00 | 1.000x |  |  | baseline |" in md  # no times: no pairs
    assert "| APS auto |  |  |  | <= 1.02x | error |" in md


def _tiny_steps(rank: int, world_size: int) -> list[dict[str, Any]]:
    spec = gpu.LMSpec(vocab=64, d_model=32, heads=2, ff=64, layers=2, batch=2, seq=8)
    configs = [c for c in gpu.STEP_CONFIGS if c.scaling == "layer"]  # block: no faster to check
    return gpu.real_model_steps(rank, world_size, "cpu", configs, spec, warm=1, timed=2)


def test_real_model_steps_run_every_config_on_gloo_cpu() -> None:
    rows = run_distributed(_tiny_steps, 1, timeout=180)[0]
    by = {r["config"]: r for r in rows}
    assert list(by) == [c.name for c in gpu.STEP_CONFIGS if c.scaling == "layer"]
    for name in (
        "DDP default",
        "fp16_compress_hook",
        "allreduce_hook",
        "APS e4m3 two_phase",
        "APS auto",
        "APS e4m3 two_phase + Promote",
    ):
        r = by[name]
        assert r["error"] is None and r["skipped"] is None, r
        assert len(r["times_ms"]) == 2 and r["step_ms"] > 0
        assert r["launches_per_step"] == 0  # no device: no kernels
    for name in ("fp16_compress_hook", "allreduce_hook", "APS e4m3 two_phase", "APS auto"):
        assert by[name]["buckets"] >= 1 and by[name]["host_us_per_bucket"] > 0
        assert by[name]["launches_per_bucket"] == 0
    assert by["DDP default"]["buckets"] is None
    assert by["APS e4m3 two_phase"]["bucket_reductions"] == ["two_phase"]
    # APS rows say where a hook call's host time goes (on Gloo the call hands the bucket
    # to its worker: on NCCL the graphs' replays and Promote's step show); PyTorch's
    # hooks have no such row.
    for name in ("APS e4m3 two_phase", "APS e4m3 two_phase + Promote"):
        spent = by[name]["host_breakdown_us"]
        assert spent["hook.aps_hook"] == max(spent.values()) > 0, spent
    assert by["allreduce_hook"]["host_breakdown_us"] is None
    # Gloo cannot sum float8: register's ValueError is the skip reason.
    native = by["APS e4m3 allreduce (native FP8)"]
    assert native["skipped"].startswith("aps_comm.register raised ValueError: ")
    assert native["error"] is None and native["step_ms"] is None


def _calls_twice(state: object, bucket: object) -> torch.futures.Future[torch.Tensor]:
    _inner()
    _inner()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(torch.zeros(1))
    return fut


def _inner() -> None:
    time.sleep(0.002)


def test_host_breakdown_times_the_hooks_calls_on_the_thread_that_makes_them() -> None:
    # DDP calls a comm hook on its autograd thread: the profiler is enabled inside each call.
    timed = gpu.TimedHook(_calls_twice, None)
    timed.profiler = cProfile.Profile()
    worker = threading.Thread(target=lambda: [gpu.timed_hook(timed, None) for _ in range(3)])
    worker.start()
    worker.join()
    spent = gpu.host_breakdown(timed.profiler, 3, within="test_benchmarks_gpu", top=2)
    assert list(spent) == ["test_benchmarks_gpu._calls_twice", "test_benchmarks_gpu._inner"]
    assert spent["test_benchmarks_gpu._calls_twice"] >= 4000  # two 2 ms sleeps a call
    assert gpu.host_breakdown(timed.profiler, 0) == {}


def _one_config_fails(rank: int, world_size: int) -> list[dict[str, Any]]:
    spec = gpu.LMSpec(vocab=64, d_model=32, heads=2, ff=64, layers=2, batch=2, seq=8)
    names = ("DDP default", "APS e4m3 two_phase", "DDP default (again)")
    configs = [c for c in gpu.STEP_CONFIGS if c.name in names]
    one_step = gpu._ConfigRun.one_step

    def failing(run: Any) -> None:
        if run.cfg.name == "APS e4m3 two_phase" and run.row["times_ms"]:
            raise RuntimeError("Triton Error [CUDA]: invalid argument")
        one_step(run)

    gpu._ConfigRun.one_step = failing  # this rank's process only
    return gpu.real_model_steps(rank, world_size, "cpu", configs, spec, warm=1, timed=3)


def test_a_configuration_that_fails_reports_its_own_error() -> None:
    # On an H200 a block row's launch failed in a timed step; its row must say so and
    # the others keep their times (the row's hook was released with the failure, and
    # reading it back raised AttributeError, which stopped the whole run).
    rows = run_distributed(_one_config_fails, 1, timeout=180)[0]
    by = {r["config"]: r for r in rows}
    failed = by["APS e4m3 two_phase"]
    assert "RuntimeError: Triton Error [CUDA]: invalid argument" in failed["error"]
    assert failed["step_ms"] is None
    for name in ("DDP default", "DDP default (again)"):
        assert by[name]["error"] is None and by[name]["step_ms"] > 0, by[name]


def test_unknown_step_is_an_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu.main(["--out", "unused", "--steps", "codec,warp"])
    assert exc.value.code == 2
    assert "unknown steps ['warp']" in capsys.readouterr().err


def test_median_ratio_is_the_median_of_per_repeat_ratios() -> None:
    # Ratios per repeat: (1+1)/1 = 2, (2+1)/2 = 1.5, (9+1)/4 = 2.5 -> median 2.
    assert gpu.median_ratio([[1.0, 2.0, 9.0], [1.0, 1.0, 1.0]], [1.0, 2.0, 4.0]) == 2.0
    # The ratio of medians would be (2 + 1) / 2 = 1.5: not what is reported.
    with pytest.raises(ValueError, match=r"one time per repeat of the base \(3\), got \[3, 2\]"):
        gpu.median_ratio([[1.0, 2.0, 3.0], [1.0, 1.0]], [1.0, 2.0, 4.0])
    with pytest.raises(ValueError, match="positive"):
        gpu.median_ratio([[1.0]], [0.0])


@pytest.mark.parametrize(
    ("name", "on_device", "kind"),
    [
        ("cudaStreamSynchronize", False, EventKind.HOST_SYNC),
        ("cudaDeviceSynchronize", False, EventKind.HOST_SYNC),
        ("cudaEventSynchronize", False, EventKind.HOST_SYNC),
        ("cudaMemcpy", False, EventKind.HOST_SYNC),
        ("cudaMemcpy_v3020", False, EventKind.HOST_SYNC),
        ("cudaStreamSynchronize_ptsz", False, EventKind.HOST_SYNC),
        ("cudaMemcpyAsync", False, None),
        ("cudaLaunchKernel", False, None),
        ("aten::item", False, None),
        ("Memcpy DtoH (Device -> Pageable)", True, EventKind.D2H_COPY),
        ("Memcpy HtoD (Pinned -> Device)", True, EventKind.H2D_COPY),
        ("Memcpy DtoD (Device -> Device)", True, None),
        ("Memset (Device)", True, None),
        (
            "ncclDevKernel_AllReduce_Sum_f16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            True,
            EventKind.NCCL_KERNEL,
        ),
        ("void at::native::vectorized_elementwise_kernel<4>", True, EventKind.KERNEL),
    ],
)
def test_classify_event(name: str, on_device: bool, kind: EventKind | None) -> None:
    assert gpu.classify_event(name, on_device) == kind


def test_bucket_profile_counts_per_bucket_on_the_hook_thread() -> None:
    events = [
        ProfileEvent("aps_bucket_1", 7, 20.0, 30.0),
        ProfileEvent("aps_bucket_0", 7, 0.0, 10.0),
        ProfileEvent("aten::mul", 7, 1.0, 2.0, kernels=("elementwise", "ncclDevKernel_Sum")),
        ProfileEvent("cudaStreamSynchronize", 7, 5.0, 6.0),
        ProfileEvent("cudaStreamSynchronize", 8, 5.0, 6.0),  # another thread: outside
        ProfileEvent("aten::copy_", 7, 22.0, 23.0, kernels=("Memcpy DtoH (Device -> Pageable)",)),
        ProfileEvent("cudaMemcpy_v3020", 7, 25.0, 26.0),
        ProfileEvent("aten::add", 7, 15.0, 16.0, kernels=("add_kernel",)),  # between buckets
        ProfileEvent("elementwise", 0, 3.0, 4.0, on_device=True),  # counted through its op
        ProfileEvent("aps_bucket_0", 0, 1.0, 9.0, on_device=True),  # the GPU-side range
    ]
    got = gpu.bucket_profile(events)
    zero = {**{k.value: 0 for k in EventKind}, "sync_us": 0.0}
    assert got["buckets"] == [
        {"bucket": 0, **zero, "kernels": 1, "nccl_kernels": 1, "host_syncs": 1, "sync_us": 1.0},
        {"bucket": 1, **zero, "host_syncs": 1, "d2h_copies": 1, "sync_us": 1.0},
    ]
    assert got["outside"] == {**zero, "kernels": 1, "host_syncs": 1, "sync_us": 1.0}
    assert got["step"] == {
        **zero,
        "kernels": 2,
        "nccl_kernels": 1,
        "host_syncs": 3,
        "d2h_copies": 1,
        "sync_us": 3.0,
    }
    with pytest.raises(ValueError, match="'aps_bucket_x' does not end in a bucket index"):
        gpu.bucket_profile([ProfileEvent("aps_bucket_x", 7, 0.0, 1.0)])


def test_native_fp8_needs_torch_2_8_nccl_2_24_and_sm_90() -> None:
    assert gpu.native_fp8_skip_reason("2.8.0+cu128", (2, 24, 3), (9, 0)) is None
    assert gpu.native_fp8_skip_reason("2.13.0", (2, 27, 5, "x"), (10, 0)) is None
    assert gpu.native_fp8_skip_reason("2.7.1+cu126", (2, 26, 2), (9, 0)) == (
        "native FP8 all-reduce needs torch >= 2.8 (has 2.7.1+cu126)"
    )
    assert gpu.native_fp8_skip_reason("2.9.0", (2, 23, 4), (8, 9)) == (
        "native FP8 all-reduce needs NCCL >= 2.24 (has 2.23.4), compute capability >= 9.0 (has 8.9)"
    )
    assert gpu.native_fp8_skip_reason("2.13.0+cpu", None, None) == (
        "native FP8 all-reduce needs NCCL >= 2.24 (has none), "
        "compute capability >= 9.0 (has no GPU)"
    )


def test_hook_skip_reasons() -> None:
    def reason(case: HookCase, backend: str, world: int, fp8: str | None = None) -> str | None:
        return gpu.hook_skip_reason(case, backend, world, fp8)

    assert reason(HookCase("fp16", "allreduce"), "nccl", 1) is None
    assert reason(HookCase("e4m3", "allreduce"), "nccl", 1) is None
    assert reason(HookCase("e4m3", "allreduce"), "nccl", 1, "no fp8 here") == "no fp8 here"
    assert (
        reason(HookCase("e5m2", "allreduce"), "gloo", 2) == "gloo cannot sum float8; only NCCL can"
    )
    assert "custom format" in reason(HookCase("e3m2", "allreduce"), "nccl", 1)  # type: ignore[operator]
    assert reason(HookCase("e3m2", "two_phase"), "nccl", 1) is None
    hier = HookCase("e4m3", "hierarchical", ranks_per_node=2)
    assert reason(hier, "gloo", 4) is None
    assert reason(hier, "gloo", 2) == (
        "hierarchical needs at least 2 nodes of at least 2 ranks (ranks_per_node=2, world size 2)"
    )
    assert reason(hier, "nccl", 1).endswith("NCCL puts one rank on each GPU")  # type: ignore[union-attr]
    assert reason(HookCase("e4m3", "hierarchical"), "gloo", 4) is not None  # no ranks_per_node
    grid = HookCase("e4m3", "grid")
    assert [reason(grid, "gloo", n) is None for n in (1, 2, 3, 4, 5, 6, 9)] == [
        False,
        False,
        False,
        True,
        False,
        True,
        True,
    ]


def test_reference_case_replaces_only_native_fp8() -> None:
    assert gpu.reference_case(HookCase("e4m3", "allreduce")) == HookCase("e4m3", "two_phase")
    assert gpu.reference_case(HookCase("fp16", "allreduce")) == HookCase("fp16", "allreduce")
    assert gpu.reference_case(HookCase("e5m2", "grid")) == HookCase("e5m2", "grid")


def test_count_mismatches_compares_bits() -> None:
    nan = torch.tensor([float("nan")])
    a = [[torch.tensor([1.0, 0.0, 2.0]), nan]]
    b = [[torch.tensor([1.0, -0.0, 2.5]), nan.clone()]]
    assert gpu.count_mismatches(a, b) == (2, 4)  # -0.0 and 2.5; the NaNs share their bits
    assert gpu.count_mismatches(a, a) == (0, 4)
    assert gpu.count_mismatches([[torch.zeros(3)]], [[torch.zeros(2)]]) == (3, 3)
    with pytest.raises(ValueError, match="1 steps against 2"):
        gpu.count_mismatches(a, a + a)


def test_junit_counts_sums_every_suite() -> None:
    xml = (
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2"/>'
        '<testsuite tests="3" failures="0" errors="1" skipped="0"/></testsuites>'
    )
    assert gpu.junit_counts(xml) == {
        "tests": 8,
        "failures": 1,
        "errors": 1,
        "skipped": 2,
        "passed": 4,
    }
    with pytest.raises(ValueError, match="no <testsuite>"):
        gpu.junit_counts("<testsuites/>")


def test_padded_numel_pads_dim_0_to_the_world_size() -> None:
    # (5, 3) -> 6 x 3 = 18; (7,) -> 8; (1,) -> 2 (two ranks); (4, 2, 2) stays 16.
    assert gpu.padded_numel([(5, 3), (7,), (1,), (4, 2, 2)], 2) == 18 + 8 + 2 + 16
    assert gpu.padded_numel([(5, 3)], 1) == 15


def test_rank_grads_differ_per_rank_and_step_and_keep_a_zero_layer() -> None:
    g00, g01, g10 = gpu.rank_grads(0, 0), gpu.rank_grads(0, 1), gpu.rank_grads(1, 0)
    assert [tuple(g.shape) for g in g00] == list(gpu.SHAPES)
    assert not torch.equal(g00[0], g01[0]) and not torch.equal(g00[0], g10[0])
    assert torch.equal(g00[4], torch.zeros(9))  # magnitude 0: a layer with amax 0
    assert all(torch.equal(a, b) for a, b in zip(g00, gpu.rank_grads(0, 0), strict=True))


def test_render_markdown_shows_each_steps_numbers() -> None:
    report = {
        "command": "python -m benchmarks.gpu --out r",
        "machine": {"device": "NVIDIA H100", "torch": "2.11.0"},
        "steps": [
            {
                "name": "codec",
                "status": "failed",
                "reason": "per-layer scaled (encode + decode) / copy = 1.61x > 1.5x",
                "seconds": 2.5,
                "details": {
                    "buffer_mib": 256,
                    "repeats": 50,
                    "backend": "cast",
                    "copy_gb_per_s": 2900.0,
                    "target": 1.5,
                    "ideal": 1.25,
                    "unscaled": {
                        "copy_ms": 0.18,
                        "encode_ms": 0.12,
                        "decode_ms": 0.11,
                        "ratio": 1.28,
                    },
                    "scaled": {
                        "copy_ms": 0.18,
                        "encode_ms": 0.16,
                        "decode_ms": 0.13,
                        "ratio": 1.61,
                    },
                    "backends": {
                        "cast": {},  # auto's: its rows are the two above
                        "triton": {
                            "block32": {
                                "copy_ms": 0.18,
                                "encode_ms": 0.125,
                                "decode_ms": 0.12,
                                "ratio": 1.36,
                            },
                        },
                    },
                },
            },
            {
                "name": "hook_nccl",
                "status": "passed",
                "reason": "",
                "seconds": 30.0,
                "details": {
                    "cases": [
                        {
                            "case": "e4m3 grid",
                            "run": "nccl, 1 rank",
                            "status": "skipped",
                            "reason": "N = 1 | none",
                        },
                        {
                            "case": "e4m3 two_phase",
                            "run": "nccl, 1 rank",
                            "status": "passed",
                            "reason": "",
                            "bytes_detail": {"all_to_all": 10},
                        },
                    ]
                },
            },
            {
                "name": "profile",
                "status": "passed",
                "reason": "",
                "seconds": 9.0,
                "details": {
                    "cases": [
                        {
                            "case": "fp16 allreduce",
                            "error": None,
                            "buckets": [
                                {
                                    "bucket": 0,
                                    "kernels": 9,
                                    "nccl_kernels": 1,
                                    "host_syncs": 0,
                                    "d2h_copies": 0,
                                    "h2d_copies": 0,
                                }
                            ],
                            "outside": {
                                "kernels": 40,
                                "nccl_kernels": 0,
                                "host_syncs": 2,
                                "d2h_copies": 0,
                                "h2d_copies": 0,
                            },
                        }
                    ]
                },
            },
        ],
    }
    md = gpu.render_markdown(report)
    assert "Generated by `python -m benchmarks.gpu --out r`." in md
    assert "Machine: device NVIDIA H100, torch 2.11.0" in md
    assert (
        "| codec | failed | per-layer scaled (encode + decode) / copy = 1.61x > 1.5x | 2.5 |" in md
    )
    assert "| scaled | 0.180 | 0.160 | 0.130 | 1.61x |" in md
    assert "| block32 (triton) | 0.180 | 0.125 | 0.120 | 1.36x |" in md
    assert "| e4m3 grid | nccl, 1 rank | skipped | N = 1 \\| none |  |" in md
    assert "| fp16 allreduce | 0 | 9 | 1 | 0 | 0 | 0 |" in md
    assert "| fp16 allreduce | outside | 40 | 0 | 2 | 0 | 0 |" in md


# A real 2-rank run on Gloo/CPU of what the GPU steps run, so their checks are
# proven against the hook's and FSDP's own accounting, not only hand values.
_CASE = HookCase("e4m3", "two_phase")


def _harness(rank: int, world_size: int) -> tuple[dict, dict, dict]:
    return (
        gpu.ddp_grads(rank, world_size, "cpu", [_CASE], steps=2)[0],
        gpu.fsdp_grads(rank, world_size, "cpu", "e4m3", steps=2),
        gpu.profile_step(rank, world_size, "cpu", [_CASE], warm_steps=1)[0],
    )


@pytest.fixture(scope="module")
def harness(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str
) -> list[tuple[dict, dict, dict]]:
    # Three tests read it, and xdist hands a module's tests to different workers.
    return made_once(
        tmp_path_factory,
        worker_id,
        "test_benchmarks_gpu.harness",
        lambda: run_distributed(_harness, 2, timeout=180),
    )


def test_hook_check_passes_a_real_run_and_names_each_fault(harness: list) -> None:
    (ddp0, _, _), (ddp1, _, _) = harness
    assert ddp0["error"] is None, ddp0["error"]
    # Every rank ends with the same gradients, and the check accepts the hook's
    # real reduction names and byte counts.
    assert gpu.check_hook_case(_CASE, ddp0, ddp1) == []
    flipped: dict[str, Any] = copy.deepcopy(ddp1)
    flipped["grads"][1][0].view(-1)[3] *= -1
    assert gpu.check_hook_case(_CASE, ddp0, flipped) == [
        f"1 of {2 * ddp0['numel']} gradient elements differ bitwise from the reference"
    ]
    fp32 = {
        **ddp0,
        "bucket_reductions": ["fp32"],
        "bytes_detail": {"all_reduce": 4 * ddp0["numel"]},
    }
    problems = gpu.check_hook_case(_CASE, fp32, ddp1)
    assert len(problems) == 2
    assert "the buckets used ['fp32'], not only 'two_phase'" in problems[0]
    assert (
        f"bytes_detail['all_to_all']: 0 bytes where the wire format makes {ddp0['numel']}"
        in problems[1]
    )
    assert gpu.check_hook_case(_CASE, {**ddp0, "error": "boom"}, ddp1) == ["raised: boom"]
    assert gpu.check_hook_case(HookCase("fp16", "two_phase"), ddp0, ddp1)[0].startswith(
        f"bytes_detail['all_to_all']: {ddp0['bytes_detail']['all_to_all']} bytes where the wire "
        f"format makes {2 * ddp0['numel']}"
    )


def test_fsdp_check_passes_a_real_run_and_names_each_fault(harness: list) -> None:
    (_, fsdp0, _), (_, fsdp1, _) = harness
    assert gpu.check_fsdp(fsdp0, fsdp0, 2, "e4m3") == []
    # Rank 1 holds other shards than rank 0: every element of a non-zero layer differs.
    assert gpu.check_fsdp(fsdp0, fsdp1, 2, "e4m3")[0].endswith("differ bitwise from the reference")
    assert gpu.check_fsdp(fsdp0, fsdp0, 2, "fp16")[0].startswith("all_to_all: ")
    assert gpu.check_fsdp({**fsdp0, "error": "x"}, fsdp0, 2, "e4m3") == ["raised: x"]


def test_profile_finds_every_bucket_of_the_step(harness: list) -> None:
    (_, _, prof0), _ = harness
    assert prof0["error"] is None, prof0["error"]
    assert prof0["bucket_reductions"] == ["two_phase"]
    buckets = [b["bucket"] for b in prof0["buckets"]]
    assert len(buckets) >= 2 and buckets == list(range(len(buckets)))
    # On Gloo/CPU the hook hands its buckets to a worker thread: no device work at all.
    assert prof0["step"] == {**{k.value: 0 for k in EventKind}, "sync_us": 0.0}


# --- The performance model's constants ------------------------------------------------

H200_RUN = ROOT / "benchmarks" / "results" / "gpu_h200_35adf17.json"


def test_the_h200_preset_is_what_device_constants_derives_from_the_h200_run() -> None:
    from aps_perfmodel.cluster import device_data_path, get_device, measured_costs

    shipped = json.loads(device_data_path("h200").read_text())
    derived = gpu.device_constants(json.loads(H200_RUN.read_text()), "h200", shipped["note"])
    assert shipped == derived
    costs, source = measured_costs(derived)
    assert dict(get_device("h200").measured) == costs
    assert get_device("h200").measured_source == source
    assert "NVIDIA H200" in source and "commit 35adf17" in source and "triton codec" in source


def test_device_constants_per_element_and_per_bucket() -> None:
    report = json.loads(H200_RUN.read_text())
    codec = next(s for s in report["steps"] if s["name"] == "codec")["details"]
    rows = {r["config"]: r for r in report["steps"][0]["details"]["configs"]}
    costs = gpu.device_constants(report, "h200")["costs"]
    timings = codec["backends"][codec["backend"]]
    n = codec["elements"]
    # The settled hook's calls ("keyed") price per-layer scaling, not "scaled".
    assert costs["encode.e4m3"]["s_per_elem"] * n * 1e3 == pytest.approx(
        timings["keyed"]["encode_ms"]
    )
    assert costs["decode.e4m3.block32"]["s_per_elem"] * n * 1e3 == pytest.approx(
        timings["block32"]["decode_ms"]
    )
    assert costs["hook_call.e4m3"]["launch_s"] * 1e6 == pytest.approx(
        rows["APS e4m3 two_phase"]["host_us_per_bucket"]
    )
    assert costs["hook_call.fp16"]["launch_s"] * 1e6 == pytest.approx(
        rows["fp16_compress_hook"]["host_us_per_bucket"]
    )
    # Native, block and "auto" calls have no key of their own in the model.
    assert set(costs) == {
        "encode.e4m3",
        "decode.e4m3",
        "encode.e4m3.block32",
        "decode.e4m3.block32",
        "hook_call.e4m3",
        "hook_call.fp16",
    }
    # An older run without "keyed" timings prices it from "scaled".
    older = copy.deepcopy(report)
    o_codec = next(s for s in older["steps"] if s["name"] == "codec")["details"]
    del o_codec["backends"]["triton"]["keyed"]
    o_costs = gpu.device_constants(older, "h200")["costs"]
    assert o_costs["encode.e4m3"]["s_per_elem"] * n * 1e3 == pytest.approx(
        timings["scaled"]["encode_ms"]
    )
    # Neither the no-graphs comparison row nor the stats row beside the plain one
    # stands for the hook's call.
    for other in ("APS e4m3 two_phase, no graphs", "APS e4m3 two_phase + stats"):
        host_us = rows[other]["host_us_per_bucket"]
        assert costs["hook_call.e4m3"]["launch_s"] * 1e6 != pytest.approx(host_us), other


def test_device_constants_need_results() -> None:
    skipped = {"command": "python -m benchmarks.gpu --out gpu", "machine": {}, "steps": []}
    skipped["steps"] = [{"name": n, "status": "skipped", "details": {}} for n in ("step", "codec")]
    with pytest.raises(ValueError, match="no codec or step results"):
        gpu.device_constants(skipped, "h200")


def test_preset_from_writes_where_the_device_preset_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu, "device_data_path", lambda name: tmp_path / "devices" / f"{name}.json")
    argv = ["--preset", "h200x", "--from", str(H200_RUN), "--note", "a note"]
    assert gpu.main(argv) == 0
    written = json.loads((tmp_path / "devices" / "h200x.json").read_text())
    assert written == gpu.device_constants(json.loads(H200_RUN.read_text()), "h200x", "a note")
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gpu.main(["--from", str(H200_RUN)])
    assert "--from needs --preset" in capsys.readouterr().err


class _FakeMemory:
    """A device allocator's counters, driven by the test: each configuration's build keeps
    ``resident`` bytes and each of its steps allocates ``transient`` more for a while."""

    level = 0
    top = 0

    def __init__(self, device: torch.device) -> None:
        self.counts = True

    def allocated(self) -> int:
        return _FakeMemory.level

    def reset_peak(self) -> None:
        _FakeMemory.top = _FakeMemory.level

    def peak(self) -> int:
        return _FakeMemory.top


def _steps_with_memory(rank: int, world_size: int) -> list[dict[str, Any]]:
    spec = gpu.LMSpec(vocab=64, d_model=32, heads=2, ff=64, layers=2, batch=2, seq=8)
    configs = [c for c in gpu.STEP_CONFIGS if c.name in ("DDP default", "APS e4m3 two_phase")]
    sizes = {c.name: (i + 1) * 2**30 for i, c in enumerate(configs)}  # 1 GiB, 2 GiB kept
    build, step = gpu._ConfigRun._build, gpu._ConfigRun.one_step

    def kept(self: Any) -> None:
        build(self)
        _FakeMemory.level += sizes[self.cfg.name]

    def transient(self: Any) -> None:
        step(self)
        extra = sizes[self.cfg.name] // 4
        _FakeMemory.top = max(_FakeMemory.top, _FakeMemory.level + extra)

    gpu.device_memory = _FakeMemory  # type: ignore[assignment]
    gpu._ConfigRun._build = kept  # type: ignore[method-assign]
    gpu._ConfigRun.one_step = transient  # type: ignore[method-assign]
    return gpu.real_model_steps(rank, world_size, "cpu", configs, spec, warm=1, timed=2)


def test_each_configuration_reports_its_own_memory() -> None:
    """Issue 46, item 5: all configurations live side by side, so the device's peak is
    not one configuration's; each row gets what it keeps and what its steps add."""
    rows = run_distributed(_steps_with_memory, 1, timeout=180)[0]
    by = {r["config"]: r for r in rows}
    assert by["DDP default"]["resident_gib"] == 1.0
    assert by["DDP default"]["step_extra_gib"] == 0.25
    assert by["DDP default"]["peak_gib"] == 1.25
    assert by["APS e4m3 two_phase"]["resident_gib"] == 2.0
    assert by["APS e4m3 two_phase"]["step_extra_gib"] == 0.5
    assert by["APS e4m3 two_phase"]["peak_gib"] == 2.5


def test_each_step_row_is_set_beside_allreduce_hook_round_by_round() -> None:
    # The step is host-bound: every Python hook pays its host time. Each row's steps over
    # allreduce_hook's in the same round (the rounds interleave the configurations),
    # median of those ratios: a slow round slows both sides of its ratio.
    rows = [
        {
            **gpu._step_row(c),
            "times_ms": times,
            "step_ms": sorted(times)[1],
            "ratio": 1.0,
            "result": "reported",
        }
        for c, times in (
            (gpu.STEP_CONFIGS[2], [10.0, 20.0, 11.0]),  # allreduce_hook
            (gpu.STEP_CONFIGS[3], [11.0, 22.0, 11.0]),  # APS e4m3 two_phase
        )
    ]
    assert rows[0]["hook"] == gpu.Hook.ALLREDUCE.value
    assert gpu.versus_row(rows[1], rows[0]) == 1.1  # ratio of medians: 11 / 11 = 1.0
    details = {"model": "m", "batch": "b", "ddp": "d", "steps": "s", "configs": rows}
    md = "\n".join(gpu._step_markdown(details))
    assert "| APS e4m3 two_phase | 11.00 | 1.000x | 1.100x |" in md
    assert "| allreduce_hook | 11.00 | 1.000x | 1.000x |" in md


def test_cuda_tests_cut_by_the_budget_say_which_ran() -> None:
    lines = [
        "tests/test_cuda.py::test_codec_on_cuda[e4m3] PASSED [  4%]",
        "tests/test_cuda.py::test_hook_on_nccl[e4m3 two_phase] PASSED [  8%]",
        "tests/test_cuda.py::test_hook_on_nccl[e5m2 two_phase] FAILED [ 12%]",
        "tests/test_cuda.py::test_promote_on_nccl ",
    ]
    cut = subprocess.TimeoutExpired(gpu.CUDA_TESTS_COMMAND, 181.4, "\n".join(lines).encode())
    got = gpu.cut_tests_result(cut)
    assert (got.name, got.status) == ("cuda_tests", gpu.Status.FAILED)
    assert got.reason == (
        "pytest ran past 181 s: 2 passed and 1 failed before the cut, then test_promote_on_nccl"
    )
    assert got.details["passed"] == [
        "test_codec_on_cuda[e4m3]",
        "test_hook_on_nccl[e4m3 two_phase]",
    ]
    assert got.details["failed"] == ["test_hook_on_nccl[e5m2 two_phase]"]


def test_a_promote_bucket_may_wait_once_for_its_last_steps_rates_and_copy_once() -> None:
    zero = {k.value: 0 for k in EventKind}
    plain, promote = HookCase("e4m3", "two_phase"), HookCase("e4m3", "two_phase", promote=True)
    once = {**zero, "host_syncs": 1, "d2h_copies": 1}
    out = [
        {"case": plain.name, "error": None, "buckets": [{"bucket": 0, **once}]},
        {
            "case": promote.name,
            "error": None,
            "buckets": [
                {"bucket": 0, **once},
                {"bucket": 1, **once, "host_syncs": 2},  # a second wait: this step's own
                {"bucket": 2, **zero, "h2d_copies": 1},
            ],
        },
    ]
    assert gpu.profile_stalls([plain, promote], out) == [
        "e4m3 two_phase bucket 0: 1 host_syncs, 1 d2h_copies",
        "e4m3 two_phase promote bucket 1: 2 host_syncs, 1 d2h_copies",
        "e4m3 two_phase promote bucket 2: 1 h2d_copies",
    ]
