"""Communication benchmark: real DDP backward + communication, hook against hook.

Every hook runs in the same job, on the same model and data: PyTorch's FP32
``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook`` and
PowerSGD (ranks 1 and 4, buckets in order: see :func:`_ordered_powersgd`), APS e4m3/e5m2 (two_phase) and FP16/BF16 (native
all-reduce), and the naive e4m3 cast. Per hook: the median step time
(backward plus communication; the slowest rank's time each step) over
repeats, the effective bus bandwidth, the speedup over FP32 and over
``fp16_compress_hook``, the relative L2 error of the averaged gradient
against the exact FP32 mean, and the perfmodel's prediction beside it.

By default the ranks run on an emulated bandwidth-bound cluster
(:mod:`benchmarks.cluster`: network namespaces, tbf-shaped veths; needs root)::

    python -m benchmarks.comm --ranks 4 --bandwidth 1gbit --mb 64 --json benchmarks/results/comm.json
    python -m benchmarks.comm --loopback --ranks 2 --mb 16      # no root; loopback hides the network

With ``--nodes M --ranks-per-node L`` the cluster has nodes (ranks of a node
unshaped among themselves, the node's link shared by its L ranks) and the
default hooks are those that matter there: the FP32 hook,
``fp16_compress_hook``, APS e4m3 flat two_phase (``aps-e4m3``), hierarchical
(``aps-e4m3-hierarchical``) and ``reduction="auto"`` (``aps-e4m3-auto``)::

    python -m benchmarks.comm --nodes 2 --ranks-per-node 2 --bandwidth 1gbit --rounds 3

A hook name may end in ``:chunk=N`` to fix the APS chunk at N elements
(``state.chunk_elements``) or in ``:profile=P`` to plan with a profile
(``APSState(profile=...)``): ``P`` is the JSON of ``python -m aps_comm calibrate``,
or ``link`` for one built from this run's measured inter-node link (its TCP
goodput, half its round trip). ``--mb`` may list several sizes: the
latency-bound sweep compares fixed and sized chunks over small gradients, with
the performance model's prediction per hook beside each (where the model
knows the strategy; for the chunk each bucket was cut into)::

    python -m benchmarks.comm --nodes 8 --bandwidth 1gbit --delay 1ms --mb 1,2,4,8 \
        --bucket-mb 2 --hooks fp32,aps-e4m3,aps-e4m3:chunk=1048576,aps-e4m3:profile=link

With ``--batch B`` backward also computes (a batch of B rows through the
model), and per hook the report holds communication alone (batch 1), the
step with compute, and the exposed communication: the step minus backward
alone (a hook that communicates nothing, stepped just before each of the
hook's steps; the median of the differences), and the communication's CPU
per step (the same difference in rank 0's CPU time), its floor where backward
fills the cores.

Example:
    >>> main(["--loopback", "--ranks", "2", "--mb", "4", "--repeats", "2"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["DEFAULT_HOOKS", "HOOKS", "main"]

HOOKS = (
    "fp32",
    "fp16",
    "bf16",
    "aps-e4m3",
    "aps-e5m2",
    "aps-fp16",
    "aps-bf16",
    "naive-e4m3",
    "powersgd-r1",
    "powersgd-r4",
    "aps-e4m3-hierarchical",
    "aps-e4m3-auto",
    "aps-e4m3-grid",
    "aps-e4m3-block",
    "aps-e2m1-block",
    "aps-e2m1-block-agreed",
)
# PowerSGD (ask for it with --hooks) is not in the default list, which stays
# what the earlier runs measured.
DEFAULT_HOOKS = HOOKS[:8]
POWERSGD_RANKS = {"powersgd-r1": 1, "powersgd-r4": 4}
"""PowerSGD hook name -> ``matrix_approximation_rank``."""
POWERSGD_START = 2
"""``start_powerSGD_iter`` here: compressed from the third step on, before the timed steps."""
NODE_HOOKS = ("fp32", "fp16", "aps-e4m3", "aps-e4m3-hierarchical", "aps-e4m3-auto")
"""The default with several ranks per node: baselines, flat and hierarchical APS, auto."""
_CHUNK_OPT = ":chunk="
_PROFILE_OPT = ":profile="
LINK_PROFILE = "link"
"""``:profile=link``: a profile built from this run's measured inter-node link."""
_WIDTH = 2048  # Linear(2048, 2048): 16 MiB of FP32 gradient per layer
_SMALL_LAYERS = 4
_PREDICTED = {
    "fp32": "fp32",
    "fp16": "fp16",
    "aps-fp16": "fp16",
    "bf16": "bf16",
    "aps-bf16": "bf16",
    "aps-e4m3": "e4m3",
    "aps-e5m2": "e5m2",
}
# The hook's reduction names that aps_perfmodel.strategies names otherwise.
_MODEL_STRATEGY = {"allreduce": "native"}
# The strategy each hook runs, as aps_perfmodel.strategies names it (format, strategy).
_STRATEGY = {
    "fp32": ("fp32", "fp32"),
    "fp16": ("fp16", "native"),
    "aps-e4m3": ("e4m3", "two_phase"),
    "aps-e4m3-hierarchical": ("e4m3", "hierarchical"),
    "aps-e4m3-auto": ("e4m3", "auto"),
    "aps-e4m3-block": ("e4m3:block", "two_phase"),
    "aps-e2m1-block": ("e2m1:block", "two_phase"),
    "aps-e2m1-block-agreed": ("e2m1:block:agreed", "two_phase"),
}
_BLOCK_SUFFIX = ":block"  # priced with block scaling's exponent bytes and codec (":agreed": agreed)


def _shape(mb: float) -> tuple[int, int]:
    """(width, layers) of the Linear stack holding ``mb`` MiB of FP32 gradients.

    16 MiB layers of width 2048 from 16 MiB up; below, 4 square layers (the
    latency-bound sweep's 1-8 MiB).
    """
    numel = mb * 2**20 / 4
    if numel >= _WIDTH**2:
        return _WIDTH, max(1, round(numel / _WIDTH**2))
    return max(1, round((numel / _SMALL_LAYERS) ** 0.5)), _SMALL_LAYERS


def _model(mb: float) -> torch.nn.Module:
    width, layers = _shape(mb)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def split_hook(spec: str) -> tuple[str, int | None]:
    """``"aps-e4m3:chunk=1048576"`` -> ``("aps-e4m3", 1048576)``; no chunk -> ``(name, None)``.

    Raises:
        ValueError: as :func:`hook_profile`.

    Example:
        >>> split_hook("aps-e4m3:chunk=1048576"), split_hook("fp32")
        (('aps-e4m3', 1048576), ('fp32', None))
    """
    name, chunk, _ = _parse_hook(spec)
    return name, chunk


def hook_profile(spec: str) -> str | None:
    """The profile a hook spec plans with: ``"link"``, a JSON path, or None.

    Raises:
        ValueError: an unknown hook, a chunk or profile on a hook that has
            none, a chunk that is not a positive integer, an empty profile,
            or both a chunk and a profile (a fixed chunk ignores the profile).

    Example:
        >>> hook_profile("aps-e4m3:profile=link"), hook_profile("aps-e4m3:chunk=65536")
        ('link', None)
    """
    return _parse_hook(spec)[2]


def _parse_hook(spec: str) -> tuple[str, int | None, str | None]:
    name, chunk, profile = spec, "", None
    if _PROFILE_OPT in name:
        name, _, profile = name.partition(_PROFILE_OPT)
    if _CHUNK_OPT in name:
        name, _, chunk = name.partition(_CHUNK_OPT)
    if name not in HOOKS:
        raise ValueError(f"unknown hook {name!r} in {spec!r}; choose from {', '.join(HOOKS)}")
    if (chunk or profile is not None) and not name.startswith(("aps-", "naive-")):
        raise ValueError(f"{spec!r}: only APS hooks are chunked (or take a profile)")
    if profile is not None and not profile:
        raise ValueError(f"{spec!r}: give a profile, e.g. {name}{_PROFILE_OPT}{LINK_PROFILE}")
    if profile is not None and _CHUNK_OPT in spec:
        raise ValueError(f"{spec!r}: a fixed chunk ignores the profile; give one of them")
    if not chunk:
        if _CHUNK_OPT in spec:
            raise ValueError(f"{spec!r}: give the chunk in elements, e.g. {name}{_CHUNK_OPT}65536")
        if profile is None and spec != name:
            raise ValueError(f"{spec!r}: unknown option; use {_CHUNK_OPT}N or {_PROFILE_OPT}P")
        return name, None, profile
    if not chunk.isdigit() or int(chunk) < 1:
        raise ValueError(f"{spec!r}: the chunk must be a positive number of elements")
    return name, int(chunk), profile


def link_profile(link: dict[str, Any], ranks: int) -> Any:
    """A :class:`aps_perfmodel.profile.Profile` of a measured link (``LinkStats.to_dict()``).

    Alpha is half the measured round trip, beta the inverse of the TCP
    goodput: what the hook needs to size chunks by bytes per peer. Nothing
    else is fitted (the codec is priced by the ``cpu-numba`` device).

    Example:
        >>> p = link_profile({"bandwidth_bits_per_s": 1e9, "rtt_s": 2e-3}, 8)
        >>> p.link.alpha, round(p.link.bandwidth)
        (0.001, 125000000)
    """
    from aps_perfmodel.collectives import LinkParams
    from aps_perfmodel.profile import Profile

    return Profile(
        world_size=ranks,
        backend="gloo",
        link=LinkParams.from_bandwidth(link["bandwidth_bits_per_s"] / 8, link["rtt_s"] / 2),
        codec_source="none",
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        cores_per_rank=(os.cpu_count() or 1) / ranks,
    )


def _attach(
    name: str, ddp: torch.nn.parallel.DistributedDataParallel, profile: str | None = None
) -> tuple[Any, Callable]:
    """Hook ``name`` for ``ddp`` (APS: planning with ``profile``); return (state, hook function)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from aps_comm import APSState, aps_hook

    if name == "fp32":
        return None, default_hooks.allreduce_hook
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    if name in POWERSGD_RANKS:
        state = _OrderedPowerSGD(
            powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=POWERSGD_RANKS[name],
                start_powerSGD_iter=POWERSGD_START,
            )
        )
        return state, _ordered_powersgd
    kind, fmt = name.split("-", 1)
    if kind == "aps":
        # "aps-e2m1-block": one exponent per block of 32, two_phase, each rank's
        # own sent with its shards; "-block-agreed": agreed by a MAX all-reduce.
        exps = "agreed" if fmt.endswith("-block-agreed") else "rank"
        fmt = fmt.removesuffix("-agreed")
        scaling = "block" if fmt.endswith("-block") else "layer"
        fmt, _, reduction = fmt.removesuffix("-block").partition("-")
        if not reduction:
            reduction = "allreduce" if fmt in ("fp16", "bf16") else "two_phase"
        # ranks_per_node: the hook reads LOCAL_WORLD_SIZE, which the cluster sets.
        state = APSState(
            fmt, reduction=reduction, scaling=scaling, profile=profile, block_exponents=exps
        )
    elif kind == "naive":
        state = APSState(fmt, reduction="two_phase", scaling="none", profile=profile)
    else:
        raise ValueError(f"unknown hook {name!r}; choose from {', '.join(HOOKS)}")
    # Binding now (collective: every rank attaches the same hooks in the same
    # order) raises a configuration this world cannot run, such as grid on 2
    # ranks, here, where the caller skips the hook, not in backward.
    state.bind_process_group()
    return state, aps_hook


class _OrderedPowerSGD:
    """State of :func:`_ordered_powersgd`: PowerSGD's own, and the last bucket's future."""

    def __init__(self, powersgd: Any) -> None:
        self.powersgd = powersgd
        self.pending: torch.futures.Future | None = None


def _ordered_powersgd(state: _OrderedPowerSGD, bucket):  # type: ignore[no-untyped-def]
    """PowerSGD's hook, each bucket started once the one before it has finished.

    ``powerSGD_hook`` issues a bucket's P and Q all-reduces from then-callbacks.
    On Gloo a callback runs on the thread that completes the future before it:
    the calling thread if that all-reduce had already finished, else one of
    Gloo's threads, while the main thread may already be issuing the next
    bucket's first all-reduce on the same group. The ranks then issue the
    collectives in different orders, Gloo pairs them by their sequence number,
    and a rank's 0-element all-reduce meets its peer's P all-reduce: both wait
    forever (measured: 2 ranks, 4 buckets, within 10 steps). Waiting for the
    previous bucket here keeps one order on every rank; it costs the overlap
    of one bucket's communication with the next bucket's, which a step
    without compute in backward barely has. Measured on Gloo (CPU), not on NCCL.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    if state.pending is not None:
        state.pending.wait()
    state.pending = powerSGD_hook.powerSGD_hook(state.powersgd, bucket)
    return state.pending


def _no_comm(state: object, bucket):  # type: ignore[no-untyped-def]
    """A hook that communicates nothing: backward alone, for the compute baseline."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _time_steps(
    ddp: torch.nn.Module, x: torch.Tensor, warmup: int, repeats: int
) -> tuple[list[float], list[tuple[float, float]]]:
    """Step times (slowest rank) and this rank's CPU (user, system) per step."""
    import torch.distributed as dist

    times, cpu = [], []
    for step in range(warmup + repeats):
        ddp.zero_grad()
        dist.barrier()
        start, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        ddp(x).sum().backward()
        elapsed = torch.tensor([time.perf_counter() - start])
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        # A step takes as long as its slowest rank.
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(float(elapsed))
            # This process's CPU time, all threads: user (ours, torch, Gloo) and
            # system (mostly the network stack). All ranks share the machine.
            cpu.append((cpu1.ru_utime - cpu0.ru_utime, cpu1.ru_stime - cpu0.ru_stime))
    return times, cpu


def _time_paired(
    ddp: torch.nn.Module, alone: torch.nn.Module, x: torch.Tensor, warmup: int, repeats: int
) -> dict[str, list[float]]:
    """Steps of ``ddp`` each right after a step of ``alone`` (backward alone, no communication).

    Backward's time on a shared VM drifts by tens of percent over a minute;
    the exposed communication is the difference of two such times, so each
    hook step is compared with the baseline step just before it.
    """
    out: dict[str, list[float]] = {
        "compute_step_s": [],
        "compute_rank0_cpu_s": [],
        "alone_step_s": [],
        "alone_rank0_cpu_s": [],
    }
    for step in range(warmup + repeats):
        base, base_cpu = _time_steps(alone, x, 0, 1)
        hooked, cpu = _time_steps(ddp, x, 0, 1)
        if step >= warmup:
            out["alone_step_s"] += base
            out["alone_rank0_cpu_s"] += [u + s for u, s in base_cpu]
            out["compute_step_s"] += hooked
            out["compute_rank0_cpu_s"] += [u + s for u, s in cpu]
    return out


def _rel_error(ddp: torch.nn.Module, state: Any, hook: Callable, x: torch.Tensor) -> float:
    """One more step with a capturing wrapper: error of the result vs the FP32 mean."""
    import torch.distributed as dist

    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    # Unannotated on purpose: DDP rejects string annotations (this module
    # uses postponed evaluation).
    def capture(st, bucket):  # type: ignore[no-untyped-def]
        raw = bucket.buffer().detach().clone()
        fut = hook(st, bucket)

        def keep(f: torch.futures.Future) -> torch.Tensor:
            pairs.append((raw, f.value()[0] if isinstance(f.value(), list) else f.value()))
            return f.value()

        return fut.then(keep)

    ddp.register_comm_hook(state, capture)  # type: ignore[attr-defined]
    ddp.zero_grad()
    ddp(x).sum().backward()
    err2 = ref2 = 0.0
    for raw, out in pairs:
        mean = raw.double()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        err2 += float((out.double() - mean).pow(2).sum())
        ref2 += float(mean.pow(2).sum())
    return (err2 / ref2) ** 0.5 if ref2 else 0.0


def _bucket_numels(mb: float, x: torch.Tensor, args: argparse.Namespace, DDP: Any) -> list[int]:
    """Elements in each bucket DDP hands its hook, once it has rebuilt them (its second step).

    Counted from the hook's calls: DDP's logging data keeps the sizes of the
    buckets it built first.
    """
    sizes: list[int] = []

    def count(state, bucket):  # type: ignore[no-untyped-def]
        sizes.append(bucket.buffer().numel())
        return _no_comm(state, bucket)

    torch.manual_seed(0)
    ddp = DDP(_model(mb), bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.bucket_view)
    ddp.register_comm_hook(None, count)
    for _ in range(2):
        sizes.clear()
        ddp.zero_grad()
        ddp(x).sum().backward()
    return sizes


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = []
    for mb in args.mb:
        sizes.append(_worker_size(args, mb, rank, DDP))
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps({"world": world, "sizes": sizes}))
    dist.destroy_process_group()


def _worker_size(args: argparse.Namespace, mb: float, rank: int, DDP: Any) -> dict[str, Any]:
    """Every hook (and round) on ``mb`` MiB of gradients; rank 0's record of them."""
    width, _ = _shape(mb)
    torch.manual_seed(1234 + rank)
    x = torch.randn(1, width)
    x_batch = torch.randn(args.batch, width) if args.batch else None
    results: list[dict[str, Any]] = []
    buckets = _bucket_numels(mb, x, args, DDP)
    alone = None
    if x_batch is not None:
        # Backward alone: a hook that communicates nothing, stepped beside every hook.
        torch.manual_seed(0)
        alone = DDP(_model(mb), bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
        alone.register_comm_hook(None, _no_comm)
    for rnd, spec in [(r, h) for r in range(args.rounds) for h in args.hooks]:
        name, chunk, profile = _parse_hook(spec)
        if profile == LINK_PROFILE:
            profile = args.link_profile or None
            if profile is None:
                raise ValueError(f"{spec!r}: no measured link to build a profile from (loopback)")
        if any(r.get("hook") == spec and "skipped" in r for r in results):
            continue
        torch.manual_seed(0)
        model = _model(mb)
        ddp = DDP(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.bucket_view)
        try:
            state, hook = _attach(name, ddp, profile)
            chunk = chunk or args.chunk_elements or None
            if chunk and hasattr(state, "chunk_elements"):
                state.chunk_elements = chunk
            ddp.register_comm_hook(state, hook)
        except (TypeError, RuntimeError, ValueError) as exc:
            # bf16_compress_hook: DDP allows it only with CUDA/NCCL or XPU; a
            # reduction this aps_comm does not have ("unknown reduction").
            results.append({"hook": spec, "skipped": f"{type(exc).__name__}: {exc}"})
            if rank == 0:
                print(f"{spec:>11}: skipped ({exc})", flush=True)
            continue
        times, cpu = _time_steps(ddp, x, args.warmup, args.repeats)
        extra: dict[str, Any] = {}
        if name.startswith("aps-"):
            # What the hook ran (auto resolves per bucket; state.reduction
            # holds its choice once bound) and the chunk it was told to use.
            extra["reduction"] = str(getattr(state, "reduction", None))
            extra["chunk_elements"] = getattr(state, "chunk_elements", None)
            # Per bucket (in DDP's order), what the hook ran in the last step
            # (no chunk: the bucket went as a plain FP32 all-reduce).
            ran, chunks = state.bucket_reductions, state.bucket_chunks
            extra["bucket_reductions"] = [ran[i] for i in sorted(ran)]
            extra["bucket_chunks"] = [chunks.get(i) for i in sorted(ran)]
        with_compute: dict[str, list[float]] = {}
        if x_batch is not None and alone is not None:
            with_compute = _time_paired(ddp, alone, x_batch, args.warmup, args.repeats)
        record = {
            "hook": spec,
            "round": rnd,
            "step_s": times,
            "rank0_cpu_user_s": [u for u, _ in cpu],
            "rank0_cpu_system_s": [s for _, s in cpu],
            **extra,
            **with_compute,
        }
        if rnd < args.rounds - 1:  # the error is measured once, in the last round
            results.append(record)
            del ddp, model
            continue
        # A fresh model for the error step: DDP allows one hook registration.
        torch.manual_seed(0)
        ddp_err = DDP(
            _model(mb), bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.bucket_view
        )
        state_err, hook_err = _attach(name, ddp_err, profile)
        if chunk and hasattr(state_err, "chunk_elements"):
            state_err.chunk_elements = chunk
        if name in POWERSGD_RANKS:
            state_err.powersgd.iter = POWERSGD_START  # past warm-up: the compressed result
        error = _rel_error(ddp_err, state_err, hook_err, x)
        results.append({**record, "rel_l2_error": error})
        if rank == 0:
            more = ""
            if with_compute:
                more = (
                    f", with compute {statistics.median(with_compute['compute_step_s']):.3f} s "
                    f"(backward alone {statistics.median(with_compute['alone_step_s']):.3f} s)"
                )
            if "reduction" in extra:
                more += f", reduction {extra['reduction']}"
            print(
                f"{spec:>11} ({mb:g} MiB): median {statistics.median(times):.3f} s{more}, "
                f"error {error:.2e}",
                flush=True,
            )
        del ddp, ddp_err, model
    n_params = sum(p.numel() for p in _model(mb).parameters())
    width, layers = _shape(mb)
    return {
        "mb": mb,
        "numel": n_params,
        "layers": layers,
        "width": width,
        "bucket_numels": buckets,
        "results": results,
    }


def flat_link_cluster(link: dict[str, Any], world: int) -> Any:
    """The perfmodel cluster of a measured link: ``world`` nodes of one CPU rank each.

    Bandwidth: the link's TCP goodput; latency: half its round trip.
    """
    from aps_perfmodel import custom_cluster

    return custom_cluster(
        link["bandwidth_bits_per_s"] / 8,
        max(link.get("rtt_s") or 0.0, 1e-6) / 2,
        nodes=world,
        device="cpu",
    )


def _predict(numel: int, world: int, link: dict[str, Any] | None) -> dict[str, float]:
    """perfmodel's step time (communication only) per format, for the measured link."""
    if not link or not link.get("bandwidth_bits_per_s"):
        return {}
    from aps_perfmodel import ComputeTime, ModelSpec, predict

    cluster = flat_link_cluster(link, world)
    model = ModelSpec.from_module(_model(numel * 4 / 2**20))
    pred = predict(model, cluster, ["e4m3", "e5m2", "bf16"], ComputeTime.from_step_time(0.0))
    return {name: r.step_s for name, r in pred.formats.items()}


def _model_cluster(topology: dict[str, Any]) -> Any:
    """The perfmodel cluster of the measured links: M nodes of L ranks on this machine's CPUs.

    Inter-node: the measured TCP goodput of one node's link and half its
    round trip; intra-node: the same of the node's loopback (a guess of
    5 GB/s and 10 us where it was not measured). Raises ImportError while
    ``aps_perfmodel.strategies`` (the model of the hook as built) is missing.
    """
    import dataclasses

    import aps_perfmodel
    from aps_perfmodel import custom_cluster, strategies

    # An editable install resolves a submodule missing from the imported
    # package out of the checkout it was installed from: not this code's model.
    if Path(strategies.__file__).parent != Path(aps_perfmodel.__file__).parent:
        raise ImportError("aps_perfmodel.strategies is not part of the imported aps_perfmodel")

    link, intra = topology["link"], topology.get("link_intra_node") or {}
    nodes, per_node = topology["nodes"], topology["ranks_per_node"]
    cluster = custom_cluster(
        link["bandwidth_bits_per_s"] / 8,
        max(link.get("rtt_s") or 0.0, 1e-6) / 2,
        nodes=nodes,
        gpus_per_node=per_node,
        intra_bandwidth=intra.get("bandwidth_bits_per_s", 40e9) / 8,
        intra_latency=max(intra.get("rtt_s") or 2e-5, 1e-6) / 2,
        device="cpu-numba",
    )
    return dataclasses.replace(
        cluster,
        chunk_overhead_s=strategies.GLOO_CHUNK_OVERHEAD_S,
        backend="gloo",  # the ring Gloo runs for the FP32/FP16 hooks, not a node-aware one
        # Every rank of every node shares this machine's cores.
        cores_per_rank=(os.cpu_count() or 1) / (nodes * per_node),
    )


def predict_strategies(
    size: dict[str, Any],
    hooks: Sequence[str],
    topology: dict[str, Any],
    ran: dict[str, dict[str, list]] | None = None,
) -> tuple[dict[str, float], str]:
    """The model's communication time per hook: the sum over DDP's buckets.

    Each bucket as ``aps_perfmodel.strategies.bucket_breakdown`` models the
    hook's strategy for it (``auto``: the strategy ``choose_strategy`` picks
    per bucket; a ``:chunk=N`` hook: chunks of N elements, else the model's
    chunk rule). Where ``ran[hook]`` holds what the hook ran per bucket
    (``bucket_reductions``, ``bucket_chunks``, as many as DDP's buckets),
    those are modelled instead: the model then prices the chunks the hook
    chose, not the ones the model would choose. Hooks the model has no
    strategy for are left out.

    Returns:
        ``({hook: seconds}, note)``; empty with the reason in the note while
        the model of the hook as built is not installed, or without a
        measured link.
    """
    if not topology.get("link") or not topology["link"].get("bandwidth_bits_per_s"):
        return {}, "no measured link (loopback)"
    try:
        from aps_perfmodel.formats import get_format as model_format
        from aps_perfmodel.strategies import STRATEGIES, bucket_breakdown, choose_strategy

        cluster = _model_cluster(topology)
    except ImportError as exc:
        return {}, f"model pending: {exc}"
    width = size["width"]
    buckets = size["bucket_numels"] or [size["numel"]]
    out: dict[str, float] = {}
    for spec in hooks:
        name, chunk = split_hook(spec)
        if name not in _STRATEGY:
            continue
        fmt, strategy = _STRATEGY[name]
        name_, _, exps = fmt.partition(_BLOCK_SUFFIX)
        if _BLOCK_SUFFIX in fmt:
            fmt = model_format(
                name_,
                aps=True,
                scaling="block",
                block_exponents=exps.removeprefix(":") or "rank",
            )
        done = (ran or {}).get(spec) or {}
        chunks = done.get("bucket_chunks") or []
        # The hook's reduction names as the model's strategies.
        strategies = [_MODEL_STRATEGY.get(r, r) for r in done.get("bucket_reductions") or []]
        if len(chunks) != len(buckets) or len(strategies) != len(buckets):
            chunks, strategies = [], []
        if any(s not in STRATEGIES for s in strategies):
            continue  # a reduction the model does not know (grid)
        total = 0.0
        for i, numel in enumerate(buckets):
            layers = max(1, round(numel / width**2))
            chosen = strategies[i] if strategies else strategy
            if chosen == "auto":
                chosen = choose_strategy(
                    numel, layers, fmt, cluster, native_ok=False, hierarchical_ok=True
                )
            plan: int | str | None = chunks[i] if chunks else chunk if chunk else "auto"
            total += bucket_breakdown(numel, layers, fmt, cluster, chosen, chunk=plan).total_s
        out[spec] = total
    return out, "aps_perfmodel.strategies: sum over DDP's buckets of bucket_breakdown"


def _summarise(
    raw: dict[str, Any],
    topology: dict[str, Any],
    args: argparse.Namespace,
) -> dict:
    world, numel = raw["world"], raw["numel"]
    link = topology.get("link")
    rounds = _by_round(raw["results"])
    done = [r for r in raw["results"] if "rel_l2_error" in r]
    # Backward alone, from the baseline steps taken beside every hook's.
    alone = [s for r in raw["results"] for s in r.get("alone_step_s", [])]
    compute_s = statistics.median(alone) if alone else None
    # Per hook: the median over rounds of each round's median step.
    medians = {
        h: statistics.median(statistics.median(r["step_s"]) for r in rs) for h, rs in rounds.items()
    }
    model_note = "aps_perfmodel.predict (flat, one rank per link)"
    predicted: dict[str, float] = {}
    if topology["ranks_per_node"] == 1:
        flat = _predict(numel, world, link)
        predicted = {h: flat[_PREDICTED[h]] for h in rounds if _PREDICTED.get(h) in flat}
    ran = {
        r["hook"]: {k: r[k] for k in ("bucket_reductions", "bucket_chunks") if k in r} for r in done
    }
    strategies, note = predict_strategies(raw, list(rounds), topology, ran)
    if strategies or topology["ranks_per_node"] > 1:
        predicted, model_note = strategies, note
    fp32_bytes = 4 * numel
    runs = []
    for r in done:
        t = medians[r["hook"]]
        per_round = rounds[r["hook"]]
        runs.append(
            {
                "hook": r["hook"],
                "median_step_s": t,
                "step_s": [s for rr in per_round for s in rr["step_s"]],
                "round_median_step_s": [statistics.median(rr["step_s"]) for rr in per_round],
                # NCCL-tests convention, on the FP32 gradient size: what an FP32
                # all-reduce would need to reach to take this long.
                "bus_bandwidth_gbit": fp32_bytes * 8 * 2 * (world - 1) / world / t / 1e9,
                "speedup_vs_fp32": medians["fp32"] / t if "fp32" in medians else None,
                "speedup_vs_fp16": medians["fp16"] / t if "fp16" in medians else None,
                "rel_l2_error": r["rel_l2_error"],
                "rank0_cpu_user_s": statistics.median(r.get("rank0_cpu_user_s") or [0.0]),
                "rank0_cpu_system_s": statistics.median(r.get("rank0_cpu_system_s") or [0.0]),
                "predicted_step_s": predicted.get(r["hook"]),
                **{
                    k: r[k]
                    for k in ("reduction", "chunk_elements", "bucket_reductions", "bucket_chunks")
                    if k in r
                },
                **_with_compute(per_round, t),
            }
        )
    return {
        "command": "python -m benchmarks.comm " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "kernel": platform.release(),
        },
        "link": link,
        "link_intra_node": topology.get("link_intra_node"),
        # What ":profile=link" hooks planned with (alpha, beta of the link above).
        "link_profile": (topology.get("link_profile") or {}).get("link"),
        "ranks": world,
        "nodes": topology["nodes"],
        "ranks_per_node": topology["ranks_per_node"],
        "delay_s": topology.get("delay_s", 0.0),
        "gradient_mb": fp32_bytes / 2**20,
        "layers": raw.get("layers"),
        "bucket_numels": raw.get("bucket_numels"),
        "prediction": model_note,
        "bucket_cap_mb": args.bucket_mb,
        "gradient_as_bucket_view": args.bucket_view,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "batch": args.batch,
        "rounds": args.rounds,
        "compute_alone_s": compute_s,
        "compute_alone_step_s": alone or None,
        "runs": runs,
        "skipped": {r["hook"]: r["skipped"] for r in raw["results"] if "skipped" in r},
    }


def _by_round(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each measured hook's results, one per round."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if "skipped" not in r:
            out.setdefault(r["hook"], []).append(r)
    return out


def _with_compute(rounds: list[dict[str, Any]], comm_s: float) -> dict[str, Any]:
    """The step with backward compute, and how much communication it leaves exposed.

    Exposed = the hook's step minus the backward-alone step just before it,
    median over the pairs. The communication's CPU per step is the same
    difference in rank 0's CPU time: on a machine whose cores backward
    already fills (one core per rank here), the step must find that time
    too, so it is the floor of the exposed communication.
    """
    if any("alone_step_s" not in r for r in rounds):
        return {}
    steps = [s for r in rounds for s in r["compute_step_s"]]
    alone = [s for r in rounds for s in r["alone_step_s"]]
    cpu = [c for r in rounds for c in r["compute_rank0_cpu_s"]]
    alone_cpu = [c for r in rounds for c in r["alone_rank0_cpu_s"]]
    exposed = max(statistics.median(s - a for s, a in zip(steps, alone, strict=True)), 0.0)
    comm_cpu = max(statistics.median(c - a for c, a in zip(cpu, alone_cpu, strict=True)), 0.0)
    return {
        "compute_step_s": steps,
        "round_median_compute_step_s": [statistics.median(r["compute_step_s"]) for r in rounds],
        "median_compute_step_s": statistics.median(steps),
        "alone_step_s": alone,
        "median_alone_step_s": statistics.median(alone),
        "exposed_comm_s": exposed,
        "exposed_fraction": exposed / comm_s if comm_s else None,
        "compute_rank0_cpu_s": statistics.median(cpu),
        "alone_rank0_cpu_s": statistics.median(alone_cpu),
        "comm_cpu_in_step_s": comm_cpu,
        "comm_cpu_fraction": comm_cpu / comm_s if comm_s else None,
    }


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"{'hook':>22} {'step s':>8} {'busbw Gb/s':>10} {'vs fp32':>8} {'vs fp16':>8} "
        f"{'rel err':>9} {'predicted':>9} {'cpu usr+sys':>11} reduction"
    ]
    for r in result["runs"]:
        pred = r["predicted_step_s"]
        lines.append(
            f"{r['hook']:>22} {r['median_step_s']:>8.3f} {r['bus_bandwidth_gbit']:>10.2f} "
            f"{r['speedup_vs_fp32'] or 0:>8.2f} {r['speedup_vs_fp16'] or 0:>8.2f} "
            f"{r['rel_l2_error']:>9.2e} {f'{pred:.3f}' if pred else '-':>9} "
            f"{r['rank0_cpu_user_s']:>5.3f}+{r['rank0_cpu_system_s']:.3f} "
            f"{r.get('reduction') or ''}"
        )
    for hook, why in result.get("skipped", {}).items():
        lines.append(f"{hook:>22} skipped: {why}")
    if result.get("compute_alone_s") is not None:
        lines.append(
            f"with compute (batch {result['batch']}; backward alone "
            f"{result['compute_alone_s']:.3f} s):"
        )
        lines.append(
            f"{'hook':>11} {'comm s':>8} {'alone s':>8} {'step s':>8} {'exposed s':>9} "
            f"{'exposed %':>9} {'comm cpu %':>10} {'vs fp32':>8} {'vs fp16':>8}"
        )
        steps = {r["hook"]: r.get("median_compute_step_s") for r in result["runs"]}
        for r in result["runs"]:
            if "median_compute_step_s" not in r:
                continue
            t = r["median_compute_step_s"]
            vs32 = steps["fp32"] / t if steps.get("fp32") else 0.0
            vs16 = steps["fp16"] / t if steps.get("fp16") else 0.0
            lines.append(
                f"{r['hook']:>11} {r['median_step_s']:>8.3f} {r['median_alone_step_s']:>8.3f} "
                f"{t:>8.3f} {r['exposed_comm_s']:>9.3f} {100 * r['exposed_fraction']:>8.0f}% "
                f"{100 * r['comm_cpu_fraction']:>9.0f}% {vs32:>8.2f} {vs16:>8.2f}"
            )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from benchmarks.cluster import add_topology_arguments

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_topology_arguments(p, ranks_default=4)
    p.add_argument("--bandwidth", default="1gbit", help="per-node link rate (tc syntax)")
    p.add_argument("--loopback", action="store_true", help="no namespaces, no shaping")
    p.add_argument(
        "--mb",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[64.0],
        help="MiB of FP32 gradients; a comma-separated list sweeps them (default 64)",
    )
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument(
        "--bucket-view",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="DDP gradient_as_bucket_view (default on: saves a copy per step, for every hook)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--batch",
        type=int,
        default=0,
        help="also time steps whose backward computes a batch of this many rows",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every hook this many times, hooks interleaved; report medians over rounds",
    )
    p.add_argument(
        "--chunk-elements",
        type=int,
        default=0,
        help="APS hooks: elements per pipelined chunk (default: the hook's own)",
    )
    p.add_argument(
        "--hooks",
        default=None,
        help=f"comma-separated hooks, from: {', '.join(HOOKS)}, each optionally with "
        f"{_CHUNK_OPT}N (default: all but powersgd and the node ones; with --ranks-per-node "
        f"> 1: {','.join(NODE_HOOKS)})",
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    p.add_argument("--link-profile", default="", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status.

    Example:
        >>> main(["--loopback", "--ranks", "2", "--mb", "4", "--repeats", "2"])  # doctest: +SKIP
        0
    """
    from benchmarks.cluster import EmulatedCluster, cluster_topology

    args = _parser().parse_args(argv)
    topology_args = cluster_topology(args, ranks_default=4)
    args.ranks_per_node = topology_args["ranks_per_node"]
    if args.hooks is None:
        args.hooks = ",".join(NODE_HOOKS if args.ranks_per_node > 1 else DEFAULT_HOOKS)
    args.hooks = [h.strip() for h in args.hooks.split(",") if h.strip()]
    try:
        for spec in args.hooks:
            if hook_profile(spec) == LINK_PROFILE and args.loopback:
                raise ValueError(f"{spec!r}: loopback measures no link to build a profile from")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.worker:
        _worker(args)
        return 0

    with tempfile.TemporaryDirectory(prefix="aps-comm-") as tmp:
        out = Path(tmp) / "rank0.json"
        worker = [
            sys.executable, "-m", "benchmarks.comm", "--worker", "--worker-out", str(out),
            "--mb", ",".join(map(str, args.mb)), "--bucket-mb", str(args.bucket_mb),
            "--repeats", str(args.repeats), "--warmup", str(args.warmup),
            "--batch", str(args.batch), "--chunk-elements", str(args.chunk_elements),
            "--rounds", str(args.rounds),
            "--bucket-view" if args.bucket_view else "--no-bucket-view",
            "--hooks", ",".join(args.hooks),
        ]  # fmt: skip
        wants_link = any(hook_profile(h) == LINK_PROFILE for h in args.hooks)
        with EmulatedCluster(
            bandwidth=args.bandwidth,
            loopback=args.loopback,
            **topology_args,
        ) as cluster:
            topology: dict[str, Any] = {
                "nodes": cluster.nodes,
                "ranks_per_node": cluster.ranks_per_node,
                "delay_s": cluster.delay_s,
                "link": None,
            }
            if not args.loopback:
                stats = cluster.link_stats()
                print(stats.summary(), flush=True)
                topology["link"] = stats.to_dict()
                if cluster.ranks_per_node > 1:
                    intra = cluster.link_stats(dst=1)
                    print(intra.summary(), flush=True)
                    topology["link_intra_node"] = intra.to_dict()
            if wants_link:
                profile = link_profile(topology["link"], cluster.nodes * cluster.ranks_per_node)
                topology["link_profile"] = profile.to_dict()
                profile.save(Path(tmp) / "link_profile.json")
                worker += ["--link-profile", str(Path(tmp) / "link_profile.json")]
            ranks = cluster.run(
                worker, timeout=args.timeout, env={"PYTHONPATH": os.getcwd()}, echo=True
            )
        failed = [r for r in ranks if not r.ok]
        if failed:
            for r in failed:
                print(r.output[-3000:], file=sys.stderr)
            return 1
        raw = json.loads(out.read_text())
    sizes = [_summarise(size | {"world": raw["world"]}, topology, args) for size in raw["sizes"]]
    for result in sizes:
        print(
            f"-- {result['gradient_mb']:g} MiB of FP32 gradients, prediction: {result['prediction']}"
        )
        print(_table(result))
    # One size: the result itself (as the report reads it); several: the sweep.
    if len(sizes) == 1:
        record: dict[str, Any] = sizes[0]
    else:
        common = {k: v for k, v in sizes[0].items() if k not in _PER_SIZE}
        record = common | {"sweep": [{k: r[k] for k in _PER_SIZE if k in r} for r in sizes]}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


# Keys that differ between the sizes of a sweep (the rest is the run's setup).
_PER_SIZE = (
    "gradient_mb",
    "layers",
    "bucket_numels",
    "compute_alone_s",
    "compute_alone_step_s",
    "runs",
    "skipped",
)


if __name__ == "__main__":
    sys.exit(main())
