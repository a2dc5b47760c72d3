"""Which reduction a format uses: native all-reduce or two-phase (the choice, not the wire).

- native: one all-reduce in the wire dtype (FP16/BF16 on every backend; FP8
  only where the backend sums it, NCCL >= 2.24 on sm_90+). The sum is rounded
  to the wire format at every hop, so the exponent leaves log2(N) headroom.
- two_phase: ``all_to_all_single`` of the encoded shards (uint8), each rank
  decodes and sums its shard in FP32 in rank order, divides by N, re-encodes,
  then ``all_gather`` of the reduced shards. Works on every backend and every
  format, 4-bit included; moves the same bytes as a ring all-reduce.
- hierarchical: for nodes of several ranks: an FP32 reduce-scatter inside
  the node, two_phase of the node sums across nodes (only the wire format
  crosses nodes: one byte per element for FP8), an all-gather inside the
  node (:func:`aps_comm.transports.two_phase_bound` with its ``groups``).
- grid: the same two levels on a virtual g x N/g grid of ranks
  (:func:`aps_comm.topology.grid_rows`), the first level in the wire format
  too: 2(g-1) + 2(N/g-1) messages per chunk instead of 2(N-1), for many
  ranks with one per host, where latency, not bytes, sets the time.

Example:
    >>> from aps_comm.formats import E4M3, FP16
    >>> pick_reduction("auto", E4M3, backend="gloo", device=torch.device("cpu"))
    <Route.TWO_PHASE: 'two_phase'>
    >>> pick_reduction("auto", FP16, backend="gloo", device=torch.device("cpu"))
    <Route.ALLREDUCE: 'allreduce'>
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.torch_version import TorchVersion

from aps_comm.config import REDUCTIONS, Reduction, Route
from aps_comm.formats import FP32, FloatFormat

__all__ = ["REDUCTIONS", "Reduction", "native_sum_supported", "pick_reduction", "resolve_routes"]

FP8_ALLREDUCE_TORCH = (2, 8)
"""The first torch whose ``ProcessGroupNCCL::allreduce`` accepts float8 (pytorch#152706)."""


def _nccl_sums_fp8(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if TorchVersion(torch.__version__) < FP8_ALLREDUCE_TORCH:
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
    reduction: Reduction | str, fmt: FloatFormat, backend: str, device: torch.device
) -> Route:
    """Resolve "auto" and check that "allreduce" is possible.

    "auto" picks the native all-reduce where the backend sums the wire dtype
    (FP16/BF16 everywhere, FP8 on NCCL >= 2.24 with sm_90+ and torch >= 2.8), else two_phase.

    Raises:
        ValueError: "allreduce" was asked for a format the backend cannot sum.
    """
    reduction = Reduction.parse(reduction, "reduction")
    native = native_sum_supported(fmt, backend, device)
    if reduction == Reduction.AUTO:
        return Route.ALLREDUCE if native else Route.TWO_PHASE
    if reduction == Reduction.ALLREDUCE and not native:
        raise ValueError(
            f"reduction='allreduce' needs a backend that sums {fmt.name} natively; "
            f"backend {backend!r} on {device.type} cannot (FP8 sums need NCCL >= 2.24 on "
            "sm_90+ and torch >= 2.8, custom formats have no native sum). Use "
            "reduction='two_phase', which works on every backend, or 'auto'."
        )
    return Route(reduction.value)


def resolve_routes(
    reduction: Reduction | str,
    formats: Iterable[FloatFormat],
    backend: str,
    device: torch.device,
) -> dict[FloatFormat, Route]:
    """Every format's route for ``reduction`` on ``backend`` and ``device`` (FP32: a plain
    all-reduce), in a stable order: what a state binds with and what its ranks compare.

    Raises:
        ValueError: a format cannot take ``reduction`` there (see :func:`pick_reduction`).

    Example:
        >>> from aps_comm.formats import E4M3, FP16
        >>> routes = resolve_routes("auto", [FP16, E4M3], "gloo", torch.device("cpu"))
        >>> {f.name: str(r) for f, r in routes.items()}
        {'e4m3': 'two_phase', 'fp16': 'allreduce'}
    """
    return {
        fmt: Route.ALLREDUCE if fmt == FP32 else pick_reduction(reduction, fmt, backend, device)
        for fmt in sorted(set(formats), key=str)
    }
