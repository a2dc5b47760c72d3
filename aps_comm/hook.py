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
from aps_comm.policy import LayerInfo, Promote, Rule, Schedule, static_formats
from aps_comm.policy import describe as describe_policy
from aps_comm.reduction import (
    REDUCTIONS,
    Reduction,
    all_gather_single,
    pick_reduction,
    reduce_shards,
    shard_layout,
    shard_mean,
)
from aps_comm.scaling import SCALINGS, Scaling, exponents, layer_amax, pow2
from aps_comm.telemetry import LayerStats, layer_stats

__all__ = ["APSConfig", "APSState", "aps_hook", "register"]

_BACKENDS = ("gloo", "nccl", "mpi")
# Elements per pipelined chunk of a bucket (4 MiB of FP32): small enough to
# overlap the codec with the wire, large enough to keep per-message costs low.
_CHUNK_ELEMENTS = 2**20


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


@dataclasses.dataclass
class _Group:
    """Layers of one bucket that travel in the same format this step."""

    fmt: FloatFormat
    index: list[int]  # positions of the layers in the bucket
    x: torch.Tensor  # contiguous fp32 values (a view of the bucket if it is the only group)
    offsets: np.ndarray
    amax: torch.Tensor
    key: tuple


class APSState:
    """State of the APS hook: configuration, process group, policy, scratch buffers, stats.

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
            with sm_90+; else two_phase). Resolved per format.
        scaling: "layer" (APS, one exponent per parameter tensor), "bucket"
            (one per bucket and format) or "none" (plain saturating cast).
        process_group: group to communicate on; default: a new group over all ranks.
        stats: record per-layer :class:`~aps_comm.telemetry.LayerStats` of the
            last step in ``state.stats``.
        policy: rules of :mod:`aps_comm.policy` choosing a format per layer
            (needs the model: use :func:`register` or :meth:`bind_model`).
        error_feedback: keep what rounding lost (this rank's encoding, and
            for two_phase its re-encoding as shard owner) and add it back next
            step. Memory: one float32 copy of the gradients per rank. The
            rounding of native low-precision sums inside the backend is not
            compensated.

    Attributes:
        stats: the last step's per-layer records (with ``stats=True``).
        bytes_sent: payload bytes this rank handed to collectives in the last
            step: the maxima plus the encoded buckets (see ``bytes_detail``).
        bytes_detail: the same per collective: "all_reduce_max", "all_to_all",
            "all_gather", "all_reduce".
        step: steps communicated so far.

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
        policy: Sequence[Rule] | None = None,
        error_feedback: bool = False,
    ) -> None:
        self.config = APSConfig(get_format(fmt), reduction, scaling)
        self.process_group = process_group
        self.collect_stats = bool(stats)
        self.policy: list[Rule] = list(policy or [])
        for rule in self.policy:
            if not isinstance(rule, Rule):
                raise TypeError(f"policy entries must be aps_comm.policy rules, got {rule!r}")
        self.error_feedback = bool(error_feedback)
        self.stats: list[LayerStats] = []
        self.bytes_sent = 0
        self.bytes_detail: dict[str, int] = {}
        self.step = 0
        self.param_names: dict[int, str] = {}
        self._layers: dict[int, tuple[LayerInfo, FloatFormat]] = {}
        self._bound = False
        self._world_size = 0
        self._backend = ""
        self._reductions: dict[FloatFormat, str] = {}
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._step_stats: list[LayerStats] = []
        self._step_bytes: dict[str, int] = {}
        # Per parameter name: Promote's (level, calm steps) and last local underflow rate.
        self._promote: dict[str, tuple[int, int]] = {}
        self._rates: dict[str, float] = {}
        # Error feedback: what rounding lost, per parameter name (unscaled).
        self._residuals: dict[str, torch.Tensor] = {}
        self.chunk_elements = _CHUNK_ELEMENTS
        self._schedule = [r for r in self.policy if isinstance(r, Schedule)]
        self._promoter = next((r for r in self.policy if isinstance(r, Promote)), None)

    @property
    def fmt(self) -> FloatFormat:
        return self.config.fmt

    @property
    def reduction(self) -> str:
        """The reduction of the state's format: as requested until bound, then resolved."""
        return self._reductions.get(self.fmt) or self.config.reduction

    @property
    def world_size(self) -> int:
        return self._world_size

    def bind_model(self, module: torch.nn.Module) -> None:
        """Learn parameter names and apply the static policy rules.

        :func:`register` calls it; call it yourself when registering the hook
        with ``ddp.register_comm_hook`` and using a policy or ``state_dict``.
        """
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_names = {id(p): n for n, p in named}
        infos = [
            LayerInfo(i, n, p.numel(), n.rpartition(".")[0], p) for i, (n, p) in enumerate(named)
        ]
        formats = static_formats([r for r in self.policy], infos, self.fmt)
        self._layers = {
            id(p): (info, f) for (_, p), info, f in zip(named, infos, formats, strict=True)
        }
        if self._promoter is not None:
            ladder = list(self._promoter.ladder)
            for info, f in zip(infos, formats, strict=True):
                if f in ladder:
                    self._promote.setdefault(info.name, (ladder.index(f), 0))

    def describe(self) -> str:
        """Everything every rank must agree on, as text."""
        return (
            f"{self.config.describe()}, policy={describe_policy(self.policy)}, "
            f"error_feedback={self.error_feedback}"
        )

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
        self._backend = backend
        self._world_size = self.process_group.size()
        # Agree on the configuration before anything can raise on one rank only:
        # a rank that raised alone would leave the others blocked in a collective.
        mine = self.describe()
        everyone: list[str | None] = [None] * self._world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        if any(c != mine for c in everyone):
            listing = "; ".join(f"rank {r}: {c}" for r, c in enumerate(everyone))
            raise ValueError(f"APSState configuration differs across ranks: {listing}")
        if (self.policy or self.error_feedback) and not self._layers:
            raise ValueError(
                "policies and error feedback need the model's parameter names: use "
                "aps_comm.register(ddp, ...) or call state.bind_model(ddp.module) first"
            )
        for fmt in self._possible_formats():
            self._reductions[fmt] = self._resolve(fmt, buffer.device)
        self._bound = True

    def _possible_formats(self) -> set[FloatFormat]:
        formats = {self.fmt} | {f for _, f in self._layers.values()}
        formats |= {get_format(r.fmt) for r in self._schedule}
        if self._promoter is not None:
            formats |= set(self._promoter.ladder)  # type: ignore[arg-type]
        return formats

    def _resolve(self, fmt: FloatFormat, device: torch.device) -> str:
        if fmt == FP32:
            return "allreduce"
        return pick_reduction(self.config.reduction, fmt, self._backend, device)

    def _buffers(self, key: tuple, nbytes: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Two byte buffers per bucket and format, kept across steps: fresh large
        allocations pay page faults on every step."""
        pair = self._scratch.get(key)
        if pair is None or pair[0].numel() != nbytes or pair[0].device != device:
            pair = (
                torch.empty(nbytes, dtype=torch.uint8, device=device),
                torch.empty(nbytes, dtype=torch.uint8, device=device),
            )
            self._scratch[key] = pair
        return pair

    def _count(self, collective: str, nbytes: int) -> None:
        self._step_bytes[collective] = self._step_bytes.get(collective, 0) + nbytes

    def _end_step(self) -> None:
        self.bytes_detail = self._step_bytes
        self.bytes_sent = sum(v for k, v in self._step_bytes.items() if k != "all_gather")
        self.stats = self._step_stats
        self._step_bytes = {}
        self._step_stats = []
        self.step += 1

    def _formats(self, params: Sequence[torch.Tensor]) -> list[FloatFormat]:
        """This step's format of every layer of a bucket (Promote already updated)."""
        for rule in self._schedule:
            fmt = rule.override(self.step)
            if fmt is not None:
                return [fmt] * len(params)
        out = []
        ladder = self._promoter.ladder if self._promoter is not None else ()
        for p in params:
            info, fmt = self._layers.get(id(p), (None, self.fmt))
            if info is not None and info.name in self._promote:
                fmt = ladder[self._promote[info.name][0]]  # type: ignore[index]
            out.append(fmt)
        return out

    def _promote_step(self, params: Sequence[torch.Tensor], rates: list[float]) -> None:
        assert self._promoter is not None
        ladder = list(self._promoter.ladder)
        for p, rate in zip(params, rates, strict=True):
            info, static = self._layers[id(p)]
            if info.name in self._promote and static in ladder:
                level, calm = self._promote[info.name]
                self._promote[info.name] = self._promoter.step(
                    level, calm, rate, ladder.index(static)
                )

    def state_dict(self) -> dict:
        """Residuals, policy decisions and the step counter, for checkpoints.

        Keys are parameter names, so the model must be bound (:func:`register`).
        A resumed run continues bit for bit when DDP's bucket layout matches
        the uninterrupted run's (two_phase shard owners follow the buckets, and
        DDP re-buckets once after its first iteration unless
        ``find_unused_parameters=True``); otherwise another rank carries the
        owners' share of the residuals: still compensated, not bitwise equal.
        """
        return {
            "step": self.step,
            "promote": dict(self._promote),
            "rates": dict(self._rates),
            "residuals": {k: v.clone() for k, v in self._residuals.items()},
            "config": self.describe(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (same configuration and world)."""
        if state.get("config") != self.describe():
            raise ValueError(
                f"checkpoint was saved with {state.get('config')!r}, this state is "
                f"{self.describe()!r}"
            )
        self.step = int(state["step"])
        self._promote = {k: tuple(v) for k, v in state["promote"].items()}  # type: ignore[misc]
        self._rates = dict(state["rates"])
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}


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


def _offsets(numels: Sequence[int]) -> np.ndarray:
    offsets = np.zeros(len(numels) + 1, dtype=np.int64)
    np.cumsum(numels, out=offsets[1:])
    return offsets


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
    if state.fmt == FP32 and not state.policy and not state.error_feedback:
        # Exactly default_hooks.allreduce_hook, on the state's group.
        buffer.div_(state.world_size)
        state._count("all_reduce", buffer.numel() * buffer.element_size())
        work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
        if bucket.is_last():
            state._end_step()
        return work.get_future().then(lambda fut: fut.value()[0])

    group = state.process_group
    numels = [p.numel() for p in params]
    names = [state.param_names.get(id(p)) for p in params]
    x = buffer if buffer.dtype == torch.float32 else buffer.float()
    layers = list(torch.split(x, numels))
    if state.error_feedback:
        _add_residuals(state, layers, names)

    amax = layer_amax(layers)
    promote = state._promoter is not None
    if promote:
        prev = [state._rates.get(n or "", 0.0) for n in names]
        shared = torch.cat([amax, torch.tensor(prev, dtype=torch.float32, device=amax.device)])
    else:
        shared = amax
    dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=group)
    state._count("all_reduce_max", shared.numel() * 4)
    amax = shared[: len(numels)]
    if promote:
        state._promote_step(params, shared[len(numels) :].tolist())

    fmts = state._formats(params)
    groups = _groups(bucket.index(), fmts, layers, x, numels, amax, names)
    futures = []
    for g in groups:
        futures += _reduce_group(state, g, layers, names)
    if bucket.is_last():
        state._end_step()

    def finish_all(_: torch.futures.Future) -> torch.Tensor:
        # Only local work here: callbacks may run on a backend thread.
        for fut in futures:
            fut.value()  # re-raises a chunk's failure
        for g in groups:
            if g.x is not x:
                for i, t in zip(
                    g.index, torch.split(g.x, [numels[i] for i in g.index]), strict=True
                ):
                    layers[i].copy_(t)
        if x is not buffer:
            buffer.copy_(x)
        return buffer

    return torch.futures.collect_all(futures).then(finish_all)


def _groups(
    bucket_index: int,
    fmts: list[FloatFormat],
    layers: list[torch.Tensor],
    x: torch.Tensor,
    numels: list[int],
    amax: torch.Tensor,
    names: list[str | None],
) -> list[_Group]:
    """Layers grouped by format, in order of first appearance (the same on every rank)."""
    order: dict[FloatFormat, list[int]] = {}
    for i, f in enumerate(fmts):
        order.setdefault(f, []).append(i)
    if len(order) == 1:
        ((fmt, idx),) = order.items()
        key = (bucket_index, fmt.name, tuple(names))
        return [_Group(fmt, idx, x, _offsets(numels), amax, key)]
    groups = []
    for fmt, idx in order.items():
        # Mixing formats costs a gather copy here and one set of collectives per format.
        gx = torch.cat([layers[i] for i in idx]) if idx else x.new_empty(0)
        key = (bucket_index, fmt.name, tuple(names[i] for i in idx))
        groups.append(_Group(fmt, idx, gx, _offsets([numels[i] for i in idx]), amax[idx], key))
    return groups


def _reduce_group(
    state: APSState,
    g: _Group,
    layers: list[torch.Tensor],
    names: list[str | None],
) -> list[torch.futures.Future]:
    """Issue one group's collectives; the futures complete once decoded into ``g.x``."""
    group, n_ranks, fmt = state.process_group, state.world_size, g.fmt
    if fmt == FP32:
        g.x.div_(n_ranks)
        state._count("all_reduce", g.x.numel() * 4)
        if state.error_feedback:
            for i in g.index:
                state._residuals.pop(names[i] or "", None)
        return [dist.all_reduce(g.x, group=group, async_op=True).get_future()]

    two_phase = state._reductions[fmt] == "two_phase"
    exps = exponents(
        g.amax,
        fmt,
        world_size=n_ranks,
        reduction="two_phase" if two_phase else "allreduce",
        scaling=state.config.scaling,
    )
    finite = torch.isfinite(g.amax)
    scale = pow2(exps)
    # Native sums still need the division by N; two-phase owners divided already.
    unscale = pow2(-exps) if two_phase else pow2(-exps) / n_ranks
    unscale = torch.where(finite, unscale, float("nan"))
    glayers = list(torch.split(g.x, np.diff(g.offsets).tolist()))
    gnames = [names[i] for i in g.index]
    if state.collect_stats or state._promoter is not None:
        records = layer_stats(glayers, gnames, g.key[0], fmt, exps, g.amax)
        if state.collect_stats:
            state._step_stats += records
        if state._promoter is not None:
            for r in records:
                state._rates[r.name or ""] = r.underflow_rate
    encode_with = _kernels.Segments(g.offsets, scale.cpu().numpy())
    decode_with = _kernels.Segments(g.offsets, unscale.cpu().numpy())

    numel = g.x.numel()
    # Chunks pipeline the codec with the wire: chunk c+1 encodes while chunk c
    # is in flight, and each chunk decodes in its own callback. Error feedback
    # keeps one chunk: its owner step needs the whole shard at once.
    size = numel if state.error_feedback else state.chunk_elements
    bounds = [(lo, min(lo + size, numel)) for lo in range(0, numel, max(size, 1))] or [(0, 0)]
    if two_phase:
        regions = _regions(bounds, fmt, n_ranks)
        send, recv = state._buffers(g.key, regions[-1][1], g.x.device)
        pending = []
        for (lo, hi), (r0, r1) in zip(bounds, regions, strict=True):
            chunk_send = send[r0:r1]
            payload = chunk_send[: payload_nbytes(hi - lo, fmt)]
            _encode_into(g.x[lo:hi], fmt, payload, _clip(encode_with, lo, hi))
            chunk_send[payload.numel() :].zero_()  # padding: code 0 is +0 in every format
            if state.error_feedback:
                _keep_residuals(state, g, glayers, gnames, payload, exps, finite)
            work = dist.all_to_all_single(recv[r0:r1], chunk_send, group=group, async_op=True)
            pending.append(work)
            state._count("all_to_all", chunk_send.numel())
        futures = []
        for (lo, hi), (r0, r1), work in zip(bounds, regions, pending, strict=True):
            work.wait()
            if state.error_feedback:
                reduced = _reduce_with_feedback(state, g, gnames, recv[r0:r1], scale, finite)
            else:
                reduced = reduce_shards(recv[r0:r1], n_ranks, fmt)
            # The chunk's send region is free once its all-to-all is done.
            gathered = all_gather_single(send[r0:r1], reduced, group=group, async_op=True)
            state._count("all_gather", reduced.numel())
            futures.append(_then_decode(gathered, send[r0:r1], fmt, g.x, lo, hi, decode_with))
        return futures
    itemsize = fmt.torch_dtype.itemsize  # type: ignore[union-attr]
    send, _ = state._buffers(g.key, numel * itemsize, g.x.device)
    futures = []
    for lo, hi in bounds:
        payload = send[lo * itemsize : hi * itemsize]
        _encode_into(g.x[lo:hi], fmt, payload, _clip(encode_with, lo, hi))
        if state.error_feedback:
            _keep_residuals(state, g, glayers, gnames, payload, exps, finite)
        work = dist.all_reduce(payload.view(fmt.torch_dtype), group=group, async_op=True)
        state._count("all_reduce", payload.numel())
        futures.append(_then_decode(work, payload, fmt, g.x, lo, hi, decode_with))
    return futures


def _regions(
    bounds: list[tuple[int, int]], fmt: FloatFormat, n_ranks: int
) -> list[tuple[int, int]]:
    """Byte range of each chunk's padded two_phase buffer (N shards) in the scratch buffer."""
    regions, start = [], 0
    for lo, hi in bounds:
        _, shard_bytes = shard_layout(hi - lo, fmt, n_ranks)
        regions.append((start, start + shard_bytes * n_ranks))
        start += shard_bytes * n_ranks
    return regions


def _clip(segments: _kernels.Segments, lo: int, hi: int) -> _kernels.Segments:
    """The segments seen by the slice [lo, hi) of the buffer, with local offsets."""
    return _kernels.Segments(np.clip(segments.offsets - lo, 0, hi - lo), segments.factors)


def _then_decode(
    work: dist.Work,
    payload: torch.Tensor,
    fmt: FloatFormat,
    x: torch.Tensor,
    lo: int,
    hi: int,
    segments: _kernels.Segments,
) -> torch.futures.Future:
    def decode(_: torch.futures.Future) -> None:
        # Only local work here: callbacks may run on a backend thread.
        _decode_into(
            payload[: payload_nbytes(hi - lo, fmt)], fmt, x[lo:hi], _clip(segments, lo, hi)
        )

    return work.get_future().then(decode)


def _add_residuals(state: APSState, layers: list[torch.Tensor], names: list[str | None]) -> None:
    have = [
        (t, state._residuals[n])
        for t, n in zip(layers, names, strict=True)
        if n in state._residuals
    ]
    if have:
        torch._foreach_add_([t for t, _ in have], [r for _, r in have])


def _keep_residuals(
    state: APSState,
    g: _Group,
    glayers: list[torch.Tensor],
    gnames: list[str | None],
    payload: torch.Tensor,
    exps: torch.Tensor,
    finite: torch.Tensor,
) -> None:
    """Residual = what this rank meant to send minus what its payload says (unscaled)."""
    sent = torch.empty_like(g.x)
    inverse = torch.where(finite, pow2(-exps), 0.0)
    _decode_into(payload, g.fmt, sent, _kernels.Segments(g.offsets, inverse.cpu().numpy()))
    lost = torch.where(torch.isfinite(sent), g.x - sent, 0.0)
    for name, part, ok in zip(
        gnames, torch.split(lost, [t.numel() for t in glayers]), finite.tolist(), strict=True
    ):
        if name is not None:
            state._residuals[name] = part.clone() if ok else torch.zeros_like(part)


def _reduce_with_feedback(
    state: APSState,
    g: _Group,
    gnames: list[str | None],
    recv: torch.Tensor,
    scale: torch.Tensor,
    finite: torch.Tensor,
) -> torch.Tensor:
    """The owner's step of two_phase, folding its re-quantization loss into its residuals.

    The loss goes into this rank's per-parameter residuals times N: next step
    it is sent again and averaged, so the mean gets it back. Keeping it per
    parameter, not per shard, makes it independent of DDP's bucketing, which
    changes after the first iteration (and so after a resume).
    """
    n_ranks, fmt = state.world_size, g.fmt
    rank = dist.get_rank(state.process_group)
    shard_bytes = recv.numel() // n_ranks
    per = shard_bytes * 8 // fmt.wire_bits
    acc = shard_mean(recv, n_ranks, fmt)
    part = torch.empty_like(acc)
    out = torch.empty(shard_bytes, dtype=torch.uint8, device=recv.device)
    _encode_into(acc, fmt, out)
    lo, hi = rank * per, min((rank + 1) * per, g.x.numel())
    if hi <= lo:
        return out
    _decode_into(out, fmt, part)
    lengths = torch.from_numpy(np.diff(g.offsets)).to(scale.device)
    mine = torch.repeat_interleave(torch.where(finite, scale, 0.0), lengths)[lo:hi]
    lost = torch.where(mine > 0, (acc[: hi - lo] - part[: hi - lo]) / mine, 0.0)
    sizes = np.diff(g.offsets).tolist()
    flat = torch.cat([state._residuals[n] for n in gnames])  # type: ignore[index]
    flat[lo:hi] += lost * n_ranks
    for name, piece in zip(gnames, torch.split(flat, sizes), strict=True):
        state._residuals[name] = piece  # type: ignore[index]
    return out


def register(
    ddp: DistributedDataParallel,
    fmt: FloatFormat | str = "e4m3",
    *,
    reduction: Reduction = "auto",
    scaling: Scaling = "layer",
    process_group: dist.ProcessGroup | None = None,
    stats: bool = False,
    policy: Sequence[Rule] | None = None,
    error_feedback: bool = False,
) -> APSState:
    """Build an :class:`APSState`, register :func:`aps_hook` on ``ddp``, return the state.

    Parameter names from ``ddp.module`` label the per-layer stats and drive
    the policy.

    Example:
        >>> state = register(ddp, fmt="e5m2", stats=True)  # doctest: +SKIP
    """
    if process_group is None and ddp.process_group is not _world():
        raise ValueError(
            "this DDP model uses a process group other than the default one; pass "
            "process_group= (a group over the same ranks, separate from DDP's) so the "
            "hook's collectives stay among those ranks"
        )
    state = APSState(fmt, reduction, scaling, process_group, stats, policy, error_feedback)
    state.bind_model(ddp.module)
    ddp.register_comm_hook(state, aps_hook)
    return state


def _world() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_initialized() else None
