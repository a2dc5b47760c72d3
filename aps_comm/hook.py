"""The APS communication hook for DistributedDataParallel.

Per bucket: every rank finds each layer's largest |gradient|, one MAX
all-reduce of those L floats agrees on them, each layer is multiplied by a
power of two chosen so nothing can overflow (:mod:`aps_comm.scaling`), the
bucket is encoded to the wire format in one fused pass, reduced
(:mod:`aps_comm.reduction`), then decoded and unscaled in FP32 in one pass,
in place in the bucket.

Collectives are issued only from the thread DDP calls the hook on, in bucket
order, on the state's own process group: the future's callback only decodes.

Example:
    >>> from aps_comm import APSState, aps_hook, register
    >>> state = APSState(fmt="e4m3")            # may precede init_process_group
    >>> ddp.register_comm_hook(state, aps_hook)  # doctest: +SKIP
    >>> state = register(ddp, fmt="e5m2")        # the same, in one call
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations
# and requires the real dist.GradBucket / torch.futures.Future objects.

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from aps_comm import _kernels
from aps_comm.formats import (
    FP32,
    FloatFormat,
    _decode_into,
    _encode_into,
    get_format,
    payload_nbytes,
)
from aps_comm.reduction import (
    REDUCTIONS,
    Reduction,
    all_gather_single,
    pick_reduction,
    reduce_shards,
    shard_layout,
)
from aps_comm.scaling import SCALINGS, Scaling, exponents, layer_amax, pow2
from aps_comm.telemetry import LayerStats, layer_stats

__all__ = ["APSConfig", "APSState", "aps_hook", "register"]

_BACKENDS = ("gloo", "nccl", "mpi")


@dataclasses.dataclass(frozen=True)
class APSConfig:
    """What every rank must agree on.

    Attributes:
        fmt: the wire format.
        reduction: "auto", "allreduce" or "two_phase" as requested.
        scaling: "layer", "bucket" or "none".
    """

    fmt: FloatFormat
    reduction: Reduction = "auto"
    scaling: Scaling = "layer"

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", get_format(self.fmt))
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {self.scaling!r}")

    def describe(self) -> str:
        f = self.fmt
        return (
            f"fmt={f.name}(e{f.exp_bits}m{f.man_bits}, bias={f.bias}, {f.specials}), "
            f"reduction={self.reduction}, scaling={self.scaling}"
        )


class APSState:
    """State of the APS hook: configuration, process group, scratch buffers, stats.

    Can be built before ``torch.distributed`` is initialised; it binds to a
    process group on the first hook call. Unless ``process_group`` is given it
    creates its own group over all ranks then (in the same order on every
    rank, since DDP calls the hook for bucket 0 first everywhere), so its
    collectives never interleave with DDP's.

    Args:
        fmt: wire format: a name accepted by :func:`aps_comm.formats.get_format`
            ("e4m3", "e5m2", "fp16", "bf16", "fp32", "e3m2", ...) or a FloatFormat.
            "fp32" is a plain averaging all-reduce, bit for bit PyTorch's
            ``allreduce_hook``.
        reduction: "allreduce" (native sum in the wire dtype), "two_phase"
            (all-to-all, FP32 sum, all-gather) or "auto" (native where the
            backend sums the wire dtype: FP16/BF16 always, FP8 on NCCL >= 2.24
            with sm_90+; else two_phase).
        scaling: "layer" (APS, one exponent per parameter tensor), "bucket"
            (one per bucket) or "none" (plain saturating cast).
        process_group: group to communicate on; default: a new group over all ranks.
        stats: record per-layer :class:`~aps_comm.telemetry.LayerStats` of the
            last step in ``state.stats``.

    Attributes:
        stats: the last step's per-layer records (with ``stats=True``).
        bytes_sent: payload bytes this rank handed to collectives in the last
            step: the maxima plus the encoded buckets (see ``bytes_detail``).
        bytes_detail: the same per collective: "all_reduce_max", "all_to_all",
            "all_gather", "all_reduce".

    Example:
        >>> state = APSState(fmt="e4m3", reduction="two_phase", stats=True)
        >>> ddp.register_comm_hook(state, aps_hook)  # doctest: +SKIP
    """

    def __init__(
        self,
        fmt: FloatFormat | str = "e4m3",
        reduction: Reduction = "auto",
        scaling: Scaling = "layer",
        process_group: dist.ProcessGroup | None = None,
        stats: bool = False,
    ) -> None:
        self.config = APSConfig(get_format(fmt), reduction, scaling)
        self.process_group = process_group
        self.collect_stats = bool(stats)
        self.stats: list[LayerStats] = []
        self.bytes_sent = 0
        self.bytes_detail: dict[str, int] = {}
        self.param_names: dict[int, str] = {}
        self._bound = False
        self._world_size = 0
        self._reduction: str = ""
        self._scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._step_stats: list[LayerStats] = []
        self._step_bytes: dict[str, int] = {}

    @property
    def fmt(self) -> FloatFormat:
        return self.config.fmt

    @property
    def reduction(self) -> str:
        """The reduction in use: as requested until bound, then "auto" resolved."""
        return self._reduction or self.config.reduction

    @property
    def world_size(self) -> int:
        return self._world_size

    def _bind(self, buffer: torch.Tensor) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("aps_hook called before torch.distributed was initialised")
        if self.process_group is None:
            self.process_group = dist.new_group()
        backend = str(dist.get_backend(self.process_group)).lower()
        if backend not in _BACKENDS:
            raise ValueError(
                f"aps_hook does not support the {backend!r} backend; supported: {_BACKENDS}"
            )
        if backend == "nccl" and buffer.device.type != "cuda":
            raise ValueError(f"the nccl backend needs CUDA gradients, got {buffer.device}")
        self._world_size = self.process_group.size()
        # Agree on the configuration before anything can raise on one rank only:
        # a rank that raised alone would leave the others blocked in a collective.
        mine = self.config.describe()
        everyone: list[str | None] = [None] * self._world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        if any(c != mine for c in everyone):
            listing = "; ".join(f"rank {r}: {c}" for r, c in enumerate(everyone))
            raise ValueError(f"APSState configuration differs across ranks: {listing}")
        if self.fmt == FP32:
            self._reduction = "allreduce"
        else:
            self._reduction = pick_reduction(
                self.config.reduction, self.fmt, backend, buffer.device
            )
        self._bound = True

    def _buffers(
        self, bucket_index: int, nbytes: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two byte buffers per bucket, kept across steps: fresh large
        allocations pay page faults on every step."""
        pair = self._scratch.get(bucket_index)
        if pair is None or pair[0].numel() != nbytes or pair[0].device != device:
            pair = tuple(torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
            self._scratch[bucket_index] = pair  # type: ignore[assignment]
        return pair  # type: ignore[return-value]

    def _count(self, collective: str, nbytes: int) -> None:
        self._step_bytes[collective] = self._step_bytes.get(collective, 0) + nbytes

    def _end_step(self) -> None:
        self.bytes_detail = self._step_bytes
        self.bytes_sent = sum(v for k, v in self._step_bytes.items() if k != "all_gather")
        self.stats = self._step_stats
        self._step_bytes = {}
        self._step_stats = []


def _check_bucket(buffer: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    if buffer.layout != torch.strided or any(
        p.grad is not None and p.grad.layout != torch.strided for p in params
    ):
        raise ValueError(
            "aps_hook does not support sparse gradients (layout "
            f"{buffer.layout}); keep sparse parameters (e.g. nn.Embedding(sparse=True)) "
            "out of DDP or use dense gradients"
        )
    if not buffer.is_floating_point():
        raise ValueError(f"aps_hook needs floating-point gradients, got {buffer.dtype}")


def _fp32_allreduce(state: APSState, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Exactly ``default_hooks.allreduce_hook`` on the state's group."""
    buffer.div_(state.world_size)
    state._count("all_reduce", buffer.numel() * buffer.element_size())
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def aps_hook(state: APSState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average gradients in a low-precision wire format.

    Args:
        state: an :class:`APSState`.
        bucket: the DDP gradient bucket.

    Returns:
        A future holding the bucket's averaged gradients (the bucket buffer,
        updated in place).

    Example:
        >>> ddp.register_comm_hook(APSState(fmt="e4m3"), aps_hook)  # doctest: +SKIP
    """
    buffer = bucket.buffer()
    params = bucket.parameters()
    _check_bucket(buffer, params)
    if not state._bound:
        state._bind(buffer)
    if state.fmt == FP32:
        fut = _fp32_allreduce(state, buffer)
        if bucket.is_last():
            state._end_step()
        return fut

    fmt, group, n_ranks = state.fmt, state.process_group, state.world_size
    numels = [p.numel() for p in params]
    offsets = np.zeros(len(numels) + 1, dtype=np.int64)
    np.cumsum(numels, out=offsets[1:])
    x = buffer if buffer.dtype == torch.float32 else buffer.float()
    layers = list(torch.split(x, numels))

    amax = layer_amax(layers)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    state._count("all_reduce_max", amax.numel() * 4)
    two_phase = state.reduction == "two_phase"
    exps = exponents(
        amax,
        fmt,
        world_size=n_ranks,
        reduction="two_phase" if two_phase else "allreduce",
        scaling=state.config.scaling,
    )
    finite = torch.isfinite(amax)
    scale = pow2(exps)
    # Native sums still need the division by N; two-phase owners divided already.
    unscale = pow2(-exps) if two_phase else pow2(-exps) / n_ranks
    unscale = torch.where(finite, unscale, float("nan"))
    if state.collect_stats:
        names = [state.param_names.get(id(p)) for p in params]
        state._step_stats += layer_stats(layers, names, bucket.index(), fmt, exps, amax)
    encode_with = _kernels.Segments(offsets, scale.cpu().numpy())
    decode_with = _kernels.Segments(offsets, unscale.cpu().numpy())

    numel = x.numel()
    if two_phase:
        _, shard_bytes = shard_layout(numel, fmt, n_ranks)
        send, recv = state._buffers(bucket.index(), shard_bytes * n_ranks, x.device)
        payload = send[: payload_nbytes(numel, fmt)]
        _encode_into(x, fmt, payload, encode_with)
        send[payload.numel() :].zero_()  # padding: code 0 is +0 in every format
        dist.all_to_all_single(recv, send, group=group)
        state._count("all_to_all", send.numel())
        reduced = reduce_shards(recv, n_ranks, fmt)
        work = all_gather_single(send, reduced, group=group, async_op=True)
        state._count("all_gather", reduced.numel())
    else:
        nbytes = numel * fmt.torch_dtype.itemsize  # type: ignore[union-attr]
        send, _ = state._buffers(bucket.index(), nbytes, x.device)
        payload = send
        _encode_into(x, fmt, payload, encode_with)
        work = dist.all_reduce(payload.view(fmt.torch_dtype), group=group, async_op=True)
        state._count("all_reduce", nbytes)
    if bucket.is_last():
        state._end_step()

    def finish(_: torch.futures.Future) -> torch.Tensor:
        # Only local work here: callbacks may run on a backend thread.
        _decode_into(payload, fmt, x, decode_with)
        if x is not buffer:
            buffer.copy_(x)
        return buffer

    return work.get_future().then(finish)


def register(
    ddp: DistributedDataParallel,
    fmt: FloatFormat | str = "e4m3",
    *,
    reduction: Reduction = "auto",
    scaling: Scaling = "layer",
    process_group: dist.ProcessGroup | None = None,
    stats: bool = False,
) -> APSState:
    """Build an :class:`APSState`, register :func:`aps_hook` on ``ddp``, return the state.

    Parameter names from ``ddp.module`` label the per-layer stats.

    Example:
        >>> state = register(ddp, fmt="e5m2", stats=True)  # doctest: +SKIP
    """
    if process_group is None and ddp.process_group is not _world():
        raise ValueError(
            "this DDP model uses a process group other than the default one; pass "
            "process_group= (a group over the same ranks, separate from DDP's) so the "
            "hook's collectives stay among those ranks"
        )
    state = APSState(fmt, reduction, scaling, process_group, stats)
    state.param_names = {id(p): name for name, p in ddp.module.named_parameters()}
    ddp.register_comm_hook(state, aps_hook)
    return state


def _world() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_initialized() else None
