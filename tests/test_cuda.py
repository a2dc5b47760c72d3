"""The CUDA path: the codec and the hook on a GPU, bit for bit with the CPU path.

Skipped with the reason where there is no CUDA device. The hook runs with
``torch.cuda.set_sync_debug_mode("error")``: any host read of a device value
on its hot path fails the test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import codec, register
from aps_comm.formats import get_format
from aps_comm.testing import run_distributed

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


def test_cuda_backends() -> None:
    dev = torch.device("cuda")
    assert codec.backend_for("e4m3", dev) == "cast"
    assert codec.backend_for("e3m2", dev) == "bits"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.Linear(64, 8))


def _grads(rank: int, world_size: int, device: str, fmt: str, sync_error: bool) -> list:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    model = _model().to(dev)
    ddp = DDP(model, bucket_cap_mb=0.05)
    state = register(ddp, fmt=fmt)
    state.chunk_elements = 5000  # several chunks per bucket
    out = []
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(32, 64).to(dev)
        ddp.zero_grad()
        if sync_error and step > 0:  # the first step builds the plans
            torch.cuda.set_sync_debug_mode("error")
        ddp(x).pow(2).sum().backward()
        torch.cuda.set_sync_debug_mode("default") if dev.type == "cuda" else None
        out.append([p.grad.detach().cpu().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("fmt", ["e4m3", "fp16", "e3m2"])
def test_hook_on_nccl_matches_cpu_at_world_size_one(fmt: str) -> None:
    gpu = run_distributed(_grads, 1, args=("cuda", fmt, True), backend="nccl")[0]
    cpu = run_distributed(_grads, 1, args=("cpu", fmt, False))[0]
    for g_step, c_step in zip(gpu, cpu, strict=True):
        for g, c in zip(g_step, c_step, strict=True):
            assert torch.equal(g, c)


def _gloo_cuda(rank: int, world_size: int, device: str) -> list:
    return _grads(rank, world_size, device, "e4m3", False)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs Gloo")
def test_hook_on_gloo_with_cuda_tensors_matches_cpu() -> None:
    gpu = run_distributed(_gloo_cuda, 2, args=("cuda",))
    cpu = run_distributed(_gloo_cuda, 2, args=("cpu",))
    for r in range(2):
        for g_step, c_step in zip(gpu[r], cpu[r], strict=True):
            for g, c in zip(g_step, c_step, strict=True):
                assert torch.equal(g, c)
