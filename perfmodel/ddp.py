"""DDP step timeline: bucket assignment, bucket readiness, overlapped communication.

Buckets are formed as PyTorch's reducer rebuilds them after the first
iteration: parameters in gradient-ready order (reverse definition order), a
bucket closes as soon as it reaches its cap (the tensor that crosses the cap
stays in it), the first bucket is capped at ``dist._DEFAULT_FIRST_BUCKET_BYTES``
(1 MiB) and the rest at ``bucket_cap_mb`` MiB (25 by default). A bucket is
ready when backward has produced its last gradient; buckets are reduced one
after another in order, overlapped with the rest of backward, so

    step = forward + max(backward, last bucket done) + optimizer.

Example:
    >>> assign_buckets([10, 10, 10], elem_bytes=4, bucket_cap_mb=80 / 2**20,
    ...                first_bucket_bytes=40)
    [(2,), (1, 0)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cluster import Cluster
from .comm import CommBreakdown, bucket_comm
from .compute import ComputeTime
from .formats import FormatSpec
from .models import ModelSpec

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "BucketTiming",
    "StepPrediction",
    "assign_buckets",
    "simulate_step",
]

DEFAULT_BUCKET_CAP_MB = 25.0
# Equal to torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (a test checks it);
# kept here so predicting needs no torch import.
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
_MB_TO_BYTES = 1024 * 1024  # torch's bucket_cap_mb is in MiB


def assign_buckets(
    numels: Sequence[int],
    *,
    elem_bytes: int = 4,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
) -> list[tuple[int, ...]]:
    """Group tensors (given in definition order) into DDP buckets in reduction order.

    Returns:
        Buckets in the order they are reduced, each a tuple of tensor indices
        in gradient-ready order.

    Example:
        >>> assign_buckets([2**20, 2**20], bucket_cap_mb=25)
        [(1,), (0,)]
    """
    limits = [int(first_bucket_bytes), int(bucket_cap_mb * _MB_TO_BYTES)]
    if first_bucket_bytes >= limits[1]:
        limits = limits[1:]
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    size = 0
    for idx in reversed(range(len(numels))):
        current.append(idx)
        size += numels[idx] * elem_bytes
        if size >= limits[0]:
            buckets.append(tuple(current))
            current, size = [], 0
            if len(limits) > 1:
                limits = limits[1:]
    if current:
        buckets.append(tuple(current))
    return buckets


@dataclass(frozen=True)
class BucketTiming:
    """One bucket on the step's timeline (seconds from the start of backward).

    Attributes:
        numel: gradient elements.
        n_tensors: parameter tensors (APS layers).
        ready_s: when backward has produced all of its gradients.
        start_s: when its reduction starts (after it is ready and the previous one is done).
        done_s: when its reduction completes.
        comm: cost breakdown of its reduction.
    """

    numel: int
    n_tensors: int
    ready_s: float
    start_s: float
    done_s: float
    comm: CommBreakdown


@dataclass(frozen=True)
class StepPrediction:
    """Predicted time of one DDP training step for one wire format.

    Attributes:
        format: wire format name.
        compute: forward/backward/optimizer times.
        comm_s: total communication time of all buckets (overlapped or not).
        exposed_comm_s: the part not hidden behind backward.
        step_s: forward + max(backward, last bucket done) + optimizer.
        wire_bytes: bytes each rank sends per step, inside its node and across nodes.
        buckets: the timeline.
        inter_node_bytes: the part of ``wire_bytes`` that leaves the node.
        exponent_bytes: the part of ``wire_bytes`` that is block exponents
            (0 with per-layer scaling).
    """

    format: str
    compute: ComputeTime
    comm_s: float
    exposed_comm_s: float
    step_s: float
    wire_bytes: float
    buckets: tuple[BucketTiming, ...]
    inter_node_bytes: float = 0.0
    exponent_bytes: float = 0.0


def simulate_step(
    model: ModelSpec,
    cluster: Cluster,
    fmt: FormatSpec,
    compute: ComputeTime,
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
) -> StepPrediction:
    """Play one step: buckets become ready during backward and are reduced in order.

    Example:
        >>> from aps_perfmodel import ComputeTime, get_cluster, get_format, get_model, simulate_step
        >>> s = simulate_step(get_model("resnet50"), get_cluster("dgx-h100", world_size=8),
        ...                   get_format("fp32"), ComputeTime(0.03, 0.06, 0.0))
        >>> s.exposed_comm_s < s.comm_s < 0.01
        True
    """
    numels = [t.numel for t in model.tensors]
    weights = model.backward_weights()
    total_w = sum(weights) or 1.0
    # Backward visits tensors from last to first; a tensor's gradient is ready
    # once the work of every tensor after it (and its own) is done.
    ready = [0.0] * len(numels)
    acc = 0.0
    for idx in reversed(range(len(numels))):
        acc += weights[idx]
        ready[idx] = compute.backward_s * acc / total_w

    timeline: list[BucketTiming] = []
    free_at = 0.0
    # A model's repeated blocks make many equal buckets; their cost is a pure
    # function of (elements, tensors, blocks), so each shape is priced once.
    costs: dict[tuple[int, int, int | None], CommBreakdown] = {}
    for bucket in assign_buckets(
        numels, bucket_cap_mb=bucket_cap_mb, first_bucket_bytes=first_bucket_bytes
    ):
        n = sum(numels[i] for i in bucket)
        blocks = fmt.block_count([numels[i] for i in bucket])
        shape = (n, len(bucket), blocks)
        if shape not in costs:
            costs[shape] = bucket_comm(n, len(bucket), fmt, cluster, n_blocks=blocks)
        comm = costs[shape]
        ready_s = max(ready[i] for i in bucket)
        start = max(ready_s, free_at)
        free_at = start + comm.total_s
        timeline.append(BucketTiming(n, len(bucket), ready_s, start, free_at, comm))

    last_done = timeline[-1].done_s if timeline else 0.0
    exposed = max(0.0, last_done - compute.backward_s)
    step = compute.forward_s + max(compute.backward_s, last_done) + compute.optimizer_s
    return StepPrediction(
        format=fmt.name,
        compute=compute,
        comm_s=sum(b.comm.total_s for b in timeline),
        exposed_comm_s=exposed,
        step_s=step,
        wire_bytes=sum(b.comm.wire_bytes for b in timeline),
        buckets=tuple(timeline),
        inter_node_bytes=sum(b.comm.inter_node_bytes for b in timeline),
        exponent_bytes=sum(b.comm.exponent_bytes for b in timeline),
    )
