"""The CUDA path: the codec, the DDP hook and FSDP2 on a GPU, bit for bit with the CPU path.

Skipped with the reason where there is no CUDA device (``python -m
benchmarks.gpu`` runs this file on a GPU, beside its measurements).

Gradients are exact on every device (:class:`benchmarks.gpu.GradModel`: each
parameter's gradient is a tensor drawn on the host), so a comparison with the
Gloo/CPU run sees only what communication did. Every reduction is forced: at
world size 1 on NCCL, "auto" sends every bucket as plain FP32 and the codec
would never run. Each hook run is checked by
:func:`benchmarks.gpu.check_hook_case`: no error, every bucket used the forced
reduction, the wire carried the format's bytes (``state.bytes_detail``), and
every gradient's bits equal the reference's. On NCCL the steps from 2 on run
under ``torch.cuda.set_sync_debug_mode("error")`` (steps 0 and 1 build plans;
DDP re-buckets after step 0, with a host copy of its own): any host read of a
device value on the hook's path fails the test.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from aps_comm import codec
from aps_comm.formats import get_format
from aps_comm.testing import run_distributed
from benchmarks.gpu import (
    Environment,
    HookCase,
    check_fsdp,
    check_hook_case,
    count_mismatches,
    ddp_grads,
    fsdp_grads,
    hook_skip_reason,
    reference_case,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FORMATS = ["e4m3", "e5m2", "fp16", "bf16", "e3m2", "e2m1"]


def _data(n: int = 300_001) -> tuple[torch.Tensor, codec.Layout, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 10, (n,), generator=gen))
    sizes = [0, 17, 100_000, 1, n - 100_018]
    scale = torch.tensor([8.0, 2.0**-3, 2.0**20, 1.0, 4.0])
    return x, codec.Layout.from_numels(sizes, x.device), scale


@pytest.mark.parametrize("name", FORMATS)
def test_codec_on_cuda_writes_the_cpu_bytes(name: str) -> None:
    fmt = get_format(name)
    x, layout, scale = _data()
    dev = torch.device("cuda")
    layout_gpu = codec.Layout.from_numels(layout.lengths.tolist(), dev)
    cpu = codec.encode(x, fmt, scale=scale, layout=layout)
    gpu = codec.encode(x.to(dev), fmt, scale=scale.to(dev), layout=layout_gpu)
    assert torch.equal(gpu.cpu(), cpu)
    back_cpu = codec.decode(cpu, fmt, x.numel(), scale=1 / scale, layout=layout)
    back_gpu = codec.decode(gpu, fmt, x.numel(), scale=1 / scale.to(dev), layout=layout_gpu)
    assert torch.equal(back_gpu.cpu(), back_cpu)
    recv = torch.cat([cpu[: cpu.numel() // 4 * 4]] * 3)
    assert torch.equal(
        codec.owner_reduce(recv.to(dev), fmt, 3).cpu(), codec.owner_reduce(recv, fmt, 3)
    )
    assert torch.equal(
        codec.segment_amax(x.to(dev), layout_gpu).cpu(), codec.segment_amax(x, layout)
    )


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_hardware_fp8_conversion_writes_the_integer_paths_bytes(name: str) -> None:
    # From compute capability 8.9 the Triton encoder converts e4m3 and e5m2 with the
    # hardware's cvt.rn.satfinite: its bytes must be the CPU kernels' for any float32,
    # every exponent and both signs, inf, NaN and the edges of saturation included.
    fmt = get_format(name)
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 2**32, (1 << 20,), generator=gen, dtype=torch.int64)
    edges = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), fmt.max, -fmt.max]
    edges += [fmt.max * 1.03, fmt.max * 1.0625, fmt.max * 1.07, fmt.min_normal, 2.0**-24]
    x = torch.cat([bits.to(torch.int32).view(torch.float32), torch.tensor(edges)])
    gpu = codec.encode(x.to("cuda"), fmt)
    assert torch.equal(gpu.cpu(), codec.encode(x, fmt))


def test_cuda_backends() -> None:
    from aps_comm import triton_codec  # here: collecting this file must not import triton

    dev = torch.device("cuda")
    fused = triton_codec.runs_on(dev)  # Triton installed: its kernels, else torch ops
    assert codec.backend_for("e4m3", dev) == ("triton" if fused else "cast")
    assert codec.backend_for("e3m2", dev) == ("triton" if fused else "bits")
    assert codec.backend_for("fp32", dev) == "cast"


# Every reduction one NCCL rank can force; native FP8 only where the machine sums it.
NCCL_CASES = [
    HookCase("e4m3", "two_phase"),
    HookCase("e5m2", "two_phase"),
    HookCase("e3m2", "two_phase"),
    HookCase("fp16", "allreduce"),
    HookCase("bf16", "allreduce"),
    HookCase("bf16", "two_phase"),
    HookCase("e4m3", "allreduce"),
    HookCase("e5m2", "allreduce"),
    HookCase("e2m1", "two_phase", scaling="block"),
    # Stats of graphed buckets: each replay's records, kept past the next replay.
    HookCase("e4m3", "two_phase", stats=True),
    # bfloat16 buckets: captured with their copies into float32 and back.
    HookCase("e4m3", "two_phase", grads="bfloat16"),
]


# "auto" at world size 1 on NCCL sends every bucket in FP32: settled, that is
# allreduce_hook's one call on DDP's thread (no graph, no side stream), compared with
# the plain FP32 state's run.
AUTO_CASE = HookCase("e4m3", "auto")
# FP32 buckets among coded ones (after DDP's re-bucketing: bucket 0 is blocks.2's last
# two layers, bucket 2 blocks.0, bucket 1 the rest): the first and the last go direct,
# before and after the middle one's graph on the side stream, each ordered against it.
MIXED_CASE = HookCase("e4m3", "two_phase", fp32=("blocks.0.*", "blocks.2.*"))
# Promote, whose formats move up and down every few steps (benchmarks.gpu.PROMOTE): each
# bucket's step on the host from the rates its last step agreed (a binding's first step
# reads them after its own MAX all-reduce, a sync: the sync-debug mode is off for it),
# then its whole step as its graph, dropped on a move and captured again.
PROMOTE_CASE = HookCase("e4m3", "two_phase", promote=True)


def _nccl_skip(case: HookCase) -> str | None:
    return hook_skip_reason(case, "nccl", 1, Environment.detect().native_fp8)


@pytest.fixture(scope="module")
def nccl_runs() -> dict[HookCase, tuple[dict[str, Any], dict[str, Any]]]:
    """Every runnable NCCL case in one job, its Gloo/CPU reference in another."""
    if not dist.is_nccl_available():
        pytest.skip("needs the NCCL backend")
    cases = [c for c in NCCL_CASES if _nccl_skip(c) is None] + [AUTO_CASE, MIXED_CASE]
    cases.append(PROMOTE_CASE)
    refs = [HookCase("fp32", "auto") if c == AUTO_CASE else reference_case(c) for c in cases]
    # Settled buckets are captured as CUDA graphs at step 3 and replayed from step 4;
    # ten steps for Promote's moves (steps 5, 6 and 8).
    gpu = run_distributed(ddp_grads, 1, args=("cuda", cases, 10, 2), backend="nccl", timeout=300)[0]
    cpu = run_distributed(ddp_grads, 1, args=("cpu", refs, 10, None), timeout=300)[0]
    return {c: (g, r) for c, g, r in zip(cases, gpu, cpu, strict=True)}


@pytest.mark.parametrize("case", NCCL_CASES, ids=str)
def test_hook_on_nccl_at_world_size_one_matches_gloo_cpu(
    nccl_runs: dict[HookCase, tuple[dict[str, Any], dict[str, Any]]], case: HookCase
) -> None:
    reason = _nccl_skip(case)
    if reason:
        pytest.skip(reason)
    got, want = nccl_runs[case]
    assert check_hook_case(case, got, want) == []


def test_settled_buckets_run_as_cuda_graphs_on_nccl(
    nccl_runs: dict[HookCase, tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    # Every bucket but the step's last is captured once settled; the bits are
    # checked against the Gloo/CPU run above, replays included.
    for case, (got, _) in nccl_runs.items():
        if case in (AUTO_CASE, MIXED_CASE, PROMOTE_CASE):
            continue
        assert got["error"] is None, case
        assert got["graph_failure"] is None, case
        assert got["graphs"] >= 1, case


def test_settled_fp32_buckets_on_nccl_are_allreduce_hooks_one_call(
    nccl_runs: dict[HookCase, tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    got, want = nccl_runs[AUTO_CASE]
    assert got["error"] is None and want["error"] is None
    assert got["bucket_reductions"] == ["fp32"]
    assert got["graphs"] == 0  # from step 2 on: never the side stream, so never captured
    assert got["bytes_detail"] == {"all_reduce": 4 * got["numel"]}
    assert count_mismatches(got["grads"], want["grads"])[0] == 0


def test_fp32_buckets_on_ddps_thread_beside_graphed_ones_on_nccl(
    nccl_runs: dict[HookCase, tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    got, want = nccl_runs[MIXED_CASE]
    assert got["error"] is None and want["error"] is None
    assert got["graph_failure"] is None
    # A bucket of FP32 layers is no reduction of the format's; its bytes are FP32's.
    assert got["bucket_reductions"] == want["bucket_reductions"] == ["two_phase"]
    assert got["bytes_detail"]["all_reduce"] == want["bytes_detail"]["all_reduce"] > 0
    assert got["graphs"] <= 1  # the middle bucket at most: the FP32 ones are never captured
    assert count_mismatches(got["grads"], want["grads"])[0] == 0


def test_promote_buckets_replay_their_whole_step_on_the_last_steps_rates_on_nccl(
    nccl_runs: dict[HookCase, tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    got, want = nccl_runs[PROMOTE_CASE]
    assert got["error"] is None and want["error"] is None, got["error"] or want["error"]
    assert got["graph_failure"] is None
    # Captured from step 3 (after step 1's moves), dropped by the moves of steps 5 and 6.
    assert max(got["graph_counts"]) >= 1, got["graph_counts"]
    assert 0 in got["graph_counts"][5:7], got["graph_counts"]
    assert count_mismatches(got["grads"], want["grads"])[0] == 0
    assert got["bytes_detail"] == want["bytes_detail"]


GLOO_CASES = [HookCase("e4m3", "two_phase"), HookCase("fp16", "allreduce")]


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs Gloo")
def test_hook_on_gloo_with_cuda_tensors_matches_cpu() -> None:
    gpu = run_distributed(ddp_grads, 2, args=("cuda", GLOO_CASES, 3), timeout=300)
    cpu = run_distributed(ddp_grads, 2, args=("cpu", GLOO_CASES, 3), timeout=300)
    for rank in range(2):
        for i, case in enumerate(GLOO_CASES):
            assert check_hook_case(case, gpu[rank][i], cpu[rank][i]) == [], (rank, case)
    for i in range(len(GLOO_CASES)):
        assert count_mismatches(gpu[1][i]["grads"], gpu[0][i]["grads"])[0] == 0


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs Gloo")
def test_fsdp_on_gloo_with_cuda_tensors_matches_cpu() -> None:
    # Two ranks: FSDP2 skips the reduce-scatter at world size 1.
    gpu = run_distributed(fsdp_grads, 2, args=("cuda", "e4m3"), timeout=300)
    cpu = run_distributed(fsdp_grads, 2, args=("cpu", "e4m3"), timeout=300)
    for rank in range(2):
        assert check_fsdp(gpu[rank], cpu[rank], 2, "e4m3") == [], rank
