"""benchmarks.gpu on a machine without a GPU: it runs, skips every step with the reason,
exits 0; its helpers and checks, with hand values and on a real 2-rank Gloo run."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

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
    zero = {k.value: 0 for k in EventKind}
    assert got["buckets"] == [
        {"bucket": 0, **zero, "kernels": 1, "nccl_kernels": 1, "host_syncs": 1},
        {"bucket": 1, **zero, "host_syncs": 1, "d2h_copies": 1},
    ]
    assert got["outside"] == {**zero, "kernels": 1, "host_syncs": 1}
    assert got["step"] == {
        **zero,
        "kernels": 2,
        "nccl_kernels": 1,
        "host_syncs": 3,
        "d2h_copies": 1,
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
def harness() -> list[tuple[dict, dict, dict]]:
    return run_distributed(_harness, 2, timeout=180)


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
    assert prof0["step"] == {k.value: 0 for k in EventKind}
