"""How encoded gradients cross the wire: native all-reduce or two-phase.

- native: one all-reduce in the wire dtype (FP16/BF16 on every backend; FP8
  only where the backend sums it, NCCL >= 2.24 on sm_90+). The sum is rounded
  to the wire format at every hop, so the exponent leaves log2(N) headroom.
- two_phase: ``all_to_all_single`` of the encoded shards (uint8), each rank
  decodes and sums its shard in FP32 in rank order, divides by N, re-encodes,
  then ``all_gather`` of the reduced shards. Works on every backend and every
  format, 4-bit included; moves the same bytes as a ring all-reduce.

Example:
    >>> pick_reduction("auto", E4M3, backend="gloo", device=torch.device("cpu"))
    'two_phase'
    >>> pick_reduction("auto", FP16, backend="gloo", device=torch.device("cpu"))
    'allreduce'
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from aps_comm import _kernels
from aps_comm.formats import FloatFormat, _decode_into, _encode_into, _use_kernels, payload_nbytes

__all__ = [
    "REDUCTIONS",
    "Reduction",
    "all_gather_single",
    "native_sum_supported",
    "pick_reduction",
    "reduce_shards",
    "shard_layout",
    "shard_mean",
]

Reduction = Literal["auto", "allreduce", "two_phase"]
REDUCTIONS: tuple[str, ...] = ("auto", "allreduce", "two_phase")


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """``all_gather_single`` where torch has it, else ``all_gather_into_tensor``.

    Recent torch renamed the collective and deprecated the old name; calling
    the right one keeps the output free of FutureWarnings on every version.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def _nccl_sums_fp8(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return False
    major, minor = int(version[0]), int(version[1])
    return (major, minor) >= (2, 24) and torch.cuda.get_device_capability(device)[0] >= 9


def native_sum_supported(fmt: FloatFormat, backend: str, device: torch.device) -> bool:
    """Whether ``backend`` can sum tensors of ``fmt``'s native dtype on ``device``."""
    dtype = fmt.torch_dtype
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return True
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return backend == "nccl" and _nccl_sums_fp8(device)
    return False


def pick_reduction(
    reduction: Reduction, fmt: FloatFormat, backend: str, device: torch.device
) -> Literal["allreduce", "two_phase"]:
    """Resolve "auto" and check that "allreduce" is possible.

    "auto" picks the native all-reduce where the backend sums the wire dtype
    (FP16/BF16 everywhere, FP8 on NCCL >= 2.24 with sm_90+), else two_phase.

    Raises:
        ValueError: "allreduce" was asked for a format the backend cannot sum.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    native = native_sum_supported(fmt, backend, device)
    if reduction == "auto":
        return "allreduce" if native else "two_phase"
    if reduction == "allreduce" and not native:
        raise ValueError(
            f"reduction='allreduce' needs a backend that sums {fmt.name} natively; "
            f"backend {backend!r} on {device.type} cannot (FP8 sums need NCCL >= 2.24 on "
            "sm_90+, custom formats have no native sum). Use reduction='two_phase', "
            "which works on every backend, or 'auto'."
        )
    return reduction


def shard_layout(numel: int, fmt: FloatFormat, world_size: int) -> tuple[int, int]:
    """(elements per shard, bytes per shard) for two_phase, padding ``numel`` up.

    Shards hold whole bytes, so 4-bit formats use an even number of elements.
    """
    per = -(-numel // world_size)
    if fmt.wire_bits == 4:
        per += per % 2
    return per, payload_nbytes(per, fmt)


def reduce_shards(recv: torch.Tensor, n_ranks: int, fmt: FloatFormat) -> torch.Tensor:
    """The shard owner's step of two_phase: mean of ``n_ranks`` encoded shards, re-encoded.

    ``recv`` holds the shards end to end (rank 0 first). The sum runs in
    float32 in rank order and is then divided by N, the same arithmetic on
    every owner and in :mod:`aps_comm.simulate`.
    """
    if _use_kernels(recv, fmt):
        return _kernels.reduce_shards(recv, n_ranks, fmt)
    out = torch.empty(recv.numel() // n_ranks, dtype=torch.uint8, device=recv.device)
    _encode_into(shard_mean(recv, n_ranks, fmt), fmt, out)
    return out


def shard_mean(recv: torch.Tensor, n_ranks: int, fmt: FloatFormat) -> torch.Tensor:
    """float32 mean of ``n_ranks`` encoded shards laid end to end: summed in rank
    order, then divided by N (the arithmetic of :func:`reduce_shards`)."""
    shard_bytes = recv.numel() // n_ranks
    numel = shard_bytes * 8 // fmt.wire_bits
    acc = torch.empty(numel, dtype=torch.float32, device=recv.device)
    part = torch.empty_like(acc)
    _decode_into(recv[:shard_bytes], fmt, acc)
    for r in range(1, n_ranks):
        _decode_into(recv[r * shard_bytes : (r + 1) * shard_bytes], fmt, part)
        acc += part
    return acc.div_(n_ranks)
