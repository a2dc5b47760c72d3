"""``aps-perfmodel``: predict, sweep and calibrate from the command line.

Example::

    aps-perfmodel predict --model resnet50 --world-size 64 --cluster 100gbe --fmt e4m3
    aps-perfmodel predict --params 25.6M --bandwidth 10Gbit --latency 20us --nodes 16 --json
    aps-perfmodel sweep --model gpt2-xl --cluster 100gbe --world-sizes 8,64 \\
        --bandwidths 1Gbit,10Gbit,100Gbit --out sweep.csv
    aps-perfmodel predict --model resnet50 --world-size 8 --cluster 1gbe --fmt e2m1 \\
        --scaling block --block-size 32 --block-exponents agreed
    aps-launch --nproc-per-node 4 -m aps_comm calibrate --out profile.json

A bare parameter count (``--params 25.6M``) has no FLOP counts: without
``--step-time`` or ``--forward-time``/``--backward-time`` the prediction is
of the communication alone, and the output says so and how to ask for the
step. Every prediction prints what it assumed (per-rank batch, sequence
length, device, MFU; ``assumptions`` in JSON), the scaling of ``--fmt``
(``--scaling layer``: one maximum per tensor; ``block``: one exponent byte per
``--block-size`` elements; ``--block-exponents rank``, the hook's default,
or ``agreed``) and what ``wire/rank`` counts (with block scaling, the
exponent bytes too). Choices are case-insensitive (``--fmt E4M3
--cluster 100GbE --scaling BLOCK``), as in the Python API.

Measuring a machine is the plugin's job, not the model's (which imports
nothing of ``aps_comm``): ``python -m aps_comm calibrate`` writes the profile
that ``--profile`` reads; ``aps-perfmodel calibrate`` only says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from .api import FormatResult, Prediction, predict, sweep, write_csv
from .choices import (
    BLOCK_SIZES,
    BYTE_BLOCK_SIZE,
    DEFAULT_BLOCK_SIZE,
    BlockExponents,
    Scaling,
    check_block_size,
    default_block_size,
    format_bits,
)
from .cluster import CLUSTERS, DEVICES, Cluster, custom_cluster, get_cluster, get_device
from .compute import OPTIMIZER_BYTES_PER_PARAM, ComputeTime
from .formats import FORMATS, PRICED_SCALINGS, STRATEGIES, get_format
from .fsdp import FSDPStepPrediction, FSDPUnit, fsdp_step
from .models import MODEL_PRESETS, ModelSpec, get_model
from .profile import Profile
from .units import (
    format_bandwidth,
    format_bytes,
    format_time,
    parse_bandwidth,
    parse_count,
    parse_time,
)

__all__ = ["build_parser", "main"]

_NO_COMPUTE = ComputeTime(0.0, 0.0, 0.0)

T = TypeVar("T")

_WIRE_NOTE = (
    "wire/rank: bytes one rank sends per step for the gradients, inside its node and "
    "across nodes; across/rank: the part that leaves the node"
)
_EXPONENT_NOTES = {
    BlockExponents.RANK: "one byte per block: every level of two_phase, hierarchical and "
    "grid carries its sender's own, each rank's with its values and each owner's with its "
    "mean, so nothing is agreed first; native sums agree them by one MAX all-reduce "
    "(--block-exponents rank)",
    BlockExponents.AGREED: "one byte per block: one MAX all-reduce agrees them before the "
    "first chunk, and every owner sends its mean's own with it (two_phase's all-gather, "
    "every level of hierarchical and grid after the first) (--block-exponents agreed)",
}
_ALL_REDUCE_ALGORITHMS = ("ring", "halving_doubling", "recursive_doubling", "auto")
# The measuring command, which lives in the plugin (the model imports no aps_comm).
_CALIBRATE_COMMAND = "aps-launch --nproc-per-node N -m aps_comm calibrate"
# What a shell reports for a process that SIGPIPE ended: 128 + 13.
_EXIT_BROKEN_PIPE = 141


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that reads ``--bandwidth -10Gbit`` as a value, not as an option.

    argparse takes an argument that starts with "-" for an option unless it
    looks like a plain negative number, and then says only "expected one
    argument"; this parser has no option that starts with "-" and a digit,
    so a value that does is handed to the option's type, whose error names it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")


def _arg_type(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    """An argparse ``type`` from ``parse``: its ValueError becomes argparse's one-line error."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name  # argparse names the type in some of its errors
    return convert


def _positive_time(text: str) -> float:
    """A measured compute time: a duration with a unit, more than zero."""
    seconds = parse_time(text)
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {text!r}")
    return seconds


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"must be a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"must be a positive number, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise ValueError(f"must be a fraction in (0, 1], got {text!r}")
    return value


def _listed(parse: Callable[[str], T]) -> Callable[[str], list[T]]:
    """A comma-separated list of values ``parse`` reads (each error names its item)."""
    return lambda text: [parse(item) for item in text.split(",")]


_BANDWIDTH = _arg_type(parse_bandwidth, "bandwidth")
_TIME = _arg_type(parse_time, "time")
_POSITIVE_TIME = _arg_type(_positive_time, "time")
_COUNT = _arg_type(parse_count, "count")
_POSITIVE_INT = _arg_type(_positive_int, "positive integer")
_POSITIVE_FLOAT = _arg_type(_positive_float, "positive number")
_FRACTION = _arg_type(_fraction, "fraction")


def _format_name(name: str) -> str:
    """``--fmt``: any name :func:`~aps_perfmodel.formats.get_format` takes, in any case."""
    try:
        return get_format(name).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _block_size(text: str) -> int:
    """``--block-size``: one of :data:`~aps_perfmodel.choices.BLOCK_SIZES` (the error names it)."""
    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"block_size must be an integer in {BLOCK_SIZES}, got {text!r}"
        ) from None
    try:
        return check_block_size(size)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_model_cluster_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("model")
    g.add_argument("--model", help=f"preset ({', '.join(MODEL_PRESETS)}) or a count like 25.6M")
    g.add_argument("--params", type=_COUNT, help="parameter count (e.g. 25.6M), instead of --model")
    g.add_argument(
        "--bucket-cap-mb", type=_POSITIVE_FLOAT, default=25.0, help="DDP bucket_cap_mb (MiB)"
    )

    g = ap.add_argument_group("cluster")
    g.add_argument("--cluster", type=str.lower, choices=sorted(CLUSTERS), help="cluster preset")
    g.add_argument(
        "--profile", help="calibrated profile JSON (from `python -m aps_comm calibrate`)"
    )
    g.add_argument(
        "--bandwidth",
        type=_BANDWIDTH,
        help="inter-node bandwidth of one node, shared by its --gpus-per-node devices, "
        "e.g. 100Gbit, 12.5GB/s",
    )
    g.add_argument(
        "--latency",
        type=_TIME,
        help="inter-node latency per message, e.g. 10us (default 10us with --bandwidth)",
    )
    g.add_argument(
        "--intra-bandwidth",
        type=_BANDWIDTH,
        help="intra-node bandwidth per device (with --gpus-per-node > 1; default with "
        "--bandwidth and the Ethernet presets 200Gbit, PCIe 4.0 x16)",
    )
    g.add_argument("--intra-latency", type=_TIME, help="intra-node latency (default as above: 5us)")
    g.add_argument("--nodes", type=_POSITIVE_INT, help="number of nodes")
    g.add_argument("--gpus-per-node", type=_POSITIVE_INT, help="devices per node")
    g.add_argument(
        "--device",
        type=str.lower,
        choices=sorted(DEVICES),
        help="device preset (codec and compute); default: the cluster's",
    )
    g.add_argument(
        "--algorithm",
        default="ring",
        type=str.lower,
        choices=_ALL_REDUCE_ALGORITHMS,
        help="all-reduce algorithm",
    )

    g = ap.add_argument_group(
        "compute (one of: --step-time, --forward-time/--backward-time, FLOPs)"
    )
    g.add_argument(
        "--step-time",
        type=_POSITIVE_TIME,
        help="measured compute-only step time, split 1:2 fwd:bwd",
    )
    g.add_argument("--forward-time", type=_POSITIVE_TIME, help="forward time per step")
    g.add_argument("--backward-time", type=_POSITIVE_TIME, help="backward time per step")
    g.add_argument("--optimizer-time", type=_TIME, default="0", help="optimizer time per step")
    g.add_argument(
        "--batch-size",
        type=_POSITIVE_INT,
        default=32,
        help="per-rank batch of the FLOP estimate (sequences of the preset's length for "
        "language models)",
    )
    g.add_argument(
        "--compute-dtype",
        type=str.lower,
        help="dtype of the FLOP estimate (default: the device's mixed precision, bf16; "
        "fp16 on v100, which has no BF16)",
    )
    g.add_argument(
        "--mfu", type=_FRACTION, default=0.4, help="model FLOPs utilisation of the estimate"
    )
    g.add_argument(
        "--optimizer", type=str.lower, default="adam", choices=sorted(OPTIMIZER_BYTES_PER_PARAM)
    )

    g = ap.add_argument_group("format")
    g.add_argument(
        "--fmt",
        default="e4m3",
        type=_format_name,
        help=f"low-precision format: {', '.join(sorted(FORMATS))}, an alias such as fp8, "
        "or any e<E>m<M>",
    )
    g.add_argument(
        "--strategy",
        type=str.lower,
        choices=STRATEGIES,
        help="reduction strategy of --fmt (default auto: the hook's choice per bucket)",
    )
    g.add_argument(
        "--scaling",
        type=str.lower,
        default=Scaling.LAYER.value,
        choices=[s.value for s in PRICED_SCALINGS],
        help="APS scaling of --fmt: layer (one maximum per tensor) or block (one exponent "
        "byte per --block-size elements of a tensor)",
    )
    g.add_argument(
        "--block-size",
        type=_block_size,
        help=f"elements per exponent with --scaling block (default {BYTE_BLOCK_SIZE} for "
        f"8-bit formats, {DEFAULT_BLOCK_SIZE} below)",
    )
    g.add_argument(
        "--block-exponents",
        type=str.lower,
        choices=[b.value for b in BlockExponents],
        help="with --scaling block, where the block exponents come from: rank (the hook's "
        "default: each rank sends its own with its values, at every level of two_phase, "
        "hierarchical and grid) or agreed (one MAX all-reduce first)",
    )


def _scaling(args: argparse.Namespace) -> tuple[Scaling, int, BlockExponents]:
    """``--scaling``, its block size and its block exponents' source.

    ``--block-size`` and ``--block-exponents`` only go with ``--scaling
    block``. Block scaling needs an APS ``--fmt``: fp16 and bf16 are
    predicted as the unscaled hooks users compare against
    (``fp16_compress_hook``, FSDP's ``reduce_dtype``).
    """
    scaling = Scaling(args.scaling)
    for flag, value in (
        ("--block-size", args.block_size),
        ("--block-exponents", args.block_exponents),
    ):
        if value is not None and scaling != Scaling.BLOCK:
            raise SystemExit(f"error: {flag} {value} is for --scaling block, not {scaling.value}")
    if scaling == Scaling.BLOCK and not get_format(args.fmt).aps:
        raise SystemExit(
            f"error: --scaling block needs an APS --fmt (e4m3, e5m2, e2m1 or any e<E>m<M>); "
            f"{args.fmt} is predicted as an unscaled hook"
        )
    exponents = BlockExponents(args.block_exponents or BlockExponents.RANK.value)
    size = args.block_size
    if size is None:  # the hook's default for the format
        size = DEFAULT_BLOCK_SIZE
        if scaling == Scaling.BLOCK:
            size = default_block_size(1 + sum(format_bits(args.fmt)))
    return scaling, size, exponents


def _model(args: argparse.Namespace) -> ModelSpec:
    if args.params:
        return ModelSpec.from_params(args.params)
    if not args.model:
        raise SystemExit("error: give --model or --params")
    return get_model(args.model)


def _world_size(args: argparse.Namespace, profile: Profile | None) -> int:
    """Ranks from ``--world-size`` or ``--nodes`` (which must agree when both are given).

    Raises:
        ValueError: ``--world-size`` is not ``--nodes`` times the devices per node.
    """
    if args.nodes is not None:
        # A preset's devices per node unless --gpus-per-node says otherwise:
        # "--cluster dgx-h100 --nodes 2" is 16 ranks, not 2.
        per_node, source = args.gpus_per_node, "--gpus-per-node"
        if per_node is None and args.cluster and profile is None:
            per_node = get_cluster(args.cluster).topology.gpus_per_node
            source = f"--cluster {args.cluster}'s devices per node"
        if per_node is None:
            per_node, source = 1, "one device per node (no --gpus-per-node)"
        ranks = args.nodes * per_node
        if args.world_size is not None and args.world_size != ranks:
            raise ValueError(
                f"--world-size {args.world_size} conflicts with --nodes {args.nodes} x "
                f"{per_node} ({source}) = {ranks} ranks; give one, or make them agree"
            )
        return ranks
    if args.world_size is not None:
        return args.world_size
    if profile is not None:
        return profile.world_size
    raise SystemExit("error: give --world-size (or --nodes)")


def _load_profile(path: str | None) -> Profile | None:
    """The ``--profile`` JSON; None without one.

    Raises:
        ValueError: the file cannot be read or is not a profile; names the file.
    """
    if path is None:
        return None
    try:
        return Profile.load(path)
    except OSError as exc:
        raise ValueError(f"--profile {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        # json's JSONDecodeError is a ValueError; a JSON without a profile's
        # fields fails in from_dict with a KeyError or TypeError.
        raise ValueError(
            f"--profile {path} is not a profile JSON ({type(exc).__name__}: {exc}); "
            f"write one with `{_CALIBRATE_COMMAND} --out {path}`"
        ) from None


def _check_output(path: str | None, flag: str) -> None:
    """Refuse an output path whose folder does not exist, before any work is done.

    Raises:
        ValueError: the folder is missing or not a folder; names the path.
    """
    if path is None:
        return
    folder = Path(path).parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: no folder {str(folder)!r} to write it in")


def _cluster(args: argparse.Namespace, world_size: int) -> Cluster:
    profile = _load_profile(args.profile)
    if profile is not None:
        cluster = profile.to_cluster(world_size, device=args.device or "cpu")
    elif args.cluster:
        cluster = get_cluster(args.cluster, gpus_per_node=args.gpus_per_node)
        cluster = cluster.with_world_size(world_size)
    elif args.bandwidth is not None:
        g = args.gpus_per_node or 1
        if world_size % g:
            raise SystemExit(f"error: world size {world_size} is not a multiple of {g}")
        cluster = custom_cluster(
            args.bandwidth,
            # Zero is a latency (an ideal link): only a missing one takes the default.
            parse_time("10us") if args.latency is None else args.latency,
            nodes=world_size // g,
            gpus_per_node=g,
            device=args.device or "a100",
        )
    else:
        raise SystemExit("error: give --cluster, --profile or --bandwidth")
    cluster = cluster.with_links(
        # The argument types parsed and checked these already.
        bandwidth=args.bandwidth,
        latency=args.latency,
        intra_bandwidth=args.intra_bandwidth,
        intra_latency=args.intra_latency,
    )
    if args.device and profile is None:
        cluster = replace(cluster, device=get_device(args.device))
    return replace(cluster, algorithm=args.algorithm)


def _compute(args: argparse.Namespace, model: ModelSpec, cluster: Cluster) -> ComputeTime | None:
    """The compute times given or estimated; None for communication only."""
    opt = args.optimizer_time
    if args.forward_time or args.backward_time:
        if not (args.forward_time and args.backward_time):
            raise SystemExit("error: give both --forward-time and --backward-time")
        return ComputeTime(args.forward_time, args.backward_time, opt)
    if args.step_time:
        return ComputeTime.from_step_time(args.step_time, opt)
    if model.forward_flops_per_sample <= 0:
        # A bare parameter count says nothing about compute; the communication
        # can still be predicted, and is what such a question is usually about.
        return None
    try:
        return ComputeTime.estimate(
            model,
            cluster.device,
            args.batch_size,
            dtype=args.compute_dtype,
            mfu=args.mfu,
            optimizer=args.optimizer,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc} (give --step-time)") from None


def _comm_only_reason(model: ModelSpec) -> str:
    return (
        f"{model.name!r} has no FLOP counts, so the step time and the step speedup are "
        "unknown and 'comm speedup' is not the step speedup; for the step speedup give "
        "--step-time (a measured compute-only step) or --forward-time/--backward-time, "
        f"or --model with a preset ({', '.join(MODEL_PRESETS)})"
    )


def _sample(model: ModelSpec) -> str | None:
    """What one sample of the FLOP estimate is, from the preset's config."""
    cfg = model.config
    if "seq_len" in cfg:
        return f"a sequence of {cfg['seq_len']} tokens"
    if "input" in cfg:
        return f"a {'x'.join(map(str, cfg['input']))} input"
    if "image" in cfg:
        return f"a {cfg['image']}x{cfg['image']} image"
    return None


def _assumptions(
    args: argparse.Namespace, model: ModelSpec, cluster: Cluster, compute: ComputeTime | None
) -> dict[str, Any]:
    """What a prediction assumed beyond its inputs: compute, device, bucketing, byte counts."""
    out: dict[str, Any] = {"device": cluster.device.name}
    if cluster.pass_costs and not cluster.codec_fits:
        # The device's measured codec and hook costs price the passes, not its datasheet.
        out["measured"] = cluster.pass_costs_source
    if compute is None:
        out["compute"] = "none: communication only"
    elif args.forward_time or args.backward_time:
        out["compute"] = "given: --forward-time/--backward-time"
    elif args.step_time:
        out["compute"] = "given: --step-time, split forward:backward 1:2"
    else:
        out.update(
            compute="estimated from the model's FLOPs",
            batch_per_rank=args.batch_size,
            seq_len=model.config.get("seq_len"),
            sample=_sample(model),
            compute_dtype=args.compute_dtype or cluster.device.compute_dtype,
            mfu=args.mfu,
            optimizer=args.optimizer,
        )
    scaling, block_size, exponents = _scaling(args)
    blocked = scaling == Scaling.BLOCK
    note = _EXPONENT_NOTES[exponents]
    out.update(
        bucket_cap_mb=args.bucket_cap_mb,
        algorithm=cluster.algorithm,
        scaling=scaling.value,
        block_size=block_size if blocked else None,
        block_exponents=exponents.value if blocked else None,
        scaling_note=_scaling_text(args.fmt, scaling, block_size, exponents),
        wire_bytes="bytes one rank sends per step for the gradients, inside its node and "
        "across nodes (hierarchical's in-node stages are FP32)"
        + (f"; with block scaling, the exponent bytes too ({note})" if blocked else ""),
        inter_node_bytes="the part of wire_bytes that leaves the node, per rank (averaged "
        "over a node's ranks)",
    )
    if blocked:
        out["exponent_bytes"] = f"the part of wire_bytes that is block exponents ({note})"
    out["links"] = _links_text(cluster)
    caveat = _low_bit_caveat(args.fmt, scaling)
    if caveat:
        out["caveat"] = caveat
    return out


def _links_text(cluster: Cluster) -> str:
    """The links the prediction assumed, each with the flags that change it."""
    topo = cluster.topology
    inter = f"inter-node {format_bandwidth(topo.inter.bandwidth)}"
    if topo.gpus_per_node > 1:
        # Presets and --bandwidth give a node's network bandwidth (as DGX nodes are sold).
        inter += f" per node, shared by its {topo.gpus_per_node} devices"
    text = f"{inter}, {format_time(topo.inter.alpha)} per message (--bandwidth, --latency)"
    if topo.gpus_per_node > 1:
        text += (
            f"; intra-node {format_bandwidth(topo.intra.bandwidth)}, "
            f"{format_time(topo.intra.alpha)} per message (--intra-bandwidth, --intra-latency)"
        )
    return text


def _low_bit_caveat(fmt: str, scaling: Scaling) -> str | None:
    """Why a format below 8 bits with one exponent per tensor is priced but does not train."""
    bits = 1 + sum(format_bits(fmt))
    if not get_format(fmt).aps or bits >= 8 or scaling == Scaling.BLOCK:
        return None
    return (
        f"{fmt} has {bits} bits: with one exponent per tensor (--scaling layer) most of its "
        "gradients fall below its smallest value and flush to zero, so this speedup is not "
        "one that trains; block scaling is what trains: --scaling block (default "
        f"--block-size {default_block_size(bits)})"
    )


def _scaling_text(
    fmt: str, scaling: Scaling, block_size: int, exponents: BlockExponents | None = None
) -> str:
    """What the scaling of ``fmt`` sends, in words (fp32 and fp16 are unscaled baselines)."""
    if scaling == Scaling.BLOCK:
        w = get_format(fmt).wire_bytes
        source = (
            "each rank's own at every level"
            if exponents == BlockExponents.RANK
            else "agreed across ranks"
        )
        return (
            f"block for {fmt}: one exponent byte per {block_size} elements of each tensor, "
            f"{w:g} + 1/{block_size} = {w + 1 / block_size:.3g} bytes per element, {source} "
            "(--scaling, --block-size, --block-exponents)"
        )
    return f"layer for {fmt}: one float32 maximum per tensor (--scaling)"


def _assumption_text(a: dict[str, Any]) -> str:
    if "batch_per_rank" not in a:
        given = "" if a["compute"].startswith("none") else f"compute {a['compute']}; "
        return f"{given}device {a['device']} (--device), which prices the codec passes"
    sample = f", {a['sample']} each" if a["sample"] else ""
    return (
        f"batch {a['batch_per_rank']} per rank{sample} (--batch-size); {a['device']} at "
        f"{a['mfu']:.0%} MFU in {a['compute_dtype']} (--device, --mfu, --compute-dtype); "
        f"{a['optimizer']} (--optimizer); or give a measured --step-time"
    )


def _assumption_lines(a: dict[str, Any]) -> list[str]:
    first, *rest = _wrap(_assumption_text(a))
    lines = [f"assumed  {first}", *(f"         {line}" for line in rest)]
    if "measured" in a:
        first, *rest = _wrap(
            f"codec and hook costs per bucket of the {a['device']} preset, {a['measured']}"
        )
        lines += [f"measured {first}", *(f"         {line}" for line in rest)]
    labels = (
        ("gathers", "all_gathers"),
        ("links", "links"),
        ("hsdp", "hsdp"),
        ("scaling", "scaling_note"),
        ("caveat", "caveat"),
    )
    for label, key in labels:
        if key in a:
            first, *rest = _wrap(a[key])
            lines += [f"{label:8s} {first}", *(f"         {line}" for line in rest)]
    return lines


def _comm_only_dict(
    pred: Prediction, model: ModelSpec, assumptions: dict[str, Any]
) -> dict[str, Any]:
    """``pred`` as JSON without the step-time fields, which would only repeat comm_s."""
    fp32 = pred.formats["fp32"].comm_s
    return {
        "model": pred.model,
        "cluster": pred.cluster,
        "world_size": pred.world_size,
        "communication_only": True,
        "note": f"communication only: {_comm_only_reason(model)}",
        "scaling": pred.scaling.value,
        "block_size": pred.block_size,
        "compute": None,
        "assumptions": assumptions,
        "formats": {
            name: {
                "format": r.format,
                "strategy": r.strategy,
                "chosen": r.chosen,
                "scaling": r.scaling.value,
                "comm_s": r.comm_s,
                "comm_speedup_vs_fp32": fp32 / r.comm_s if r.comm_s > 0 else 1.0,
                "wire_bytes": r.wire_bytes,
                "inter_node_bytes": r.inter_node_bytes,
                "exponent_bytes": r.exponent_bytes,
            }
            for name, r in pred.formats.items()
        },
    }


def _table(
    pred: Prediction,
    cluster: Cluster,
    model: ModelSpec,
    assumptions: dict[str, Any],
    comm_only: bool = False,
) -> str:
    topo = cluster.topology
    nodes = topo.nodes > 1
    lines = [
        f"model    {model.name}: {model.total_params / 1e6:,.1f}M params in "
        f"{model.num_tensors} tensors ({format_bytes(model.total_params * 4)} of FP32 gradients)",
        f"cluster  {cluster.name}: {topo.nodes} node(s) x {topo.gpus_per_node} device(s) = "
        f"{cluster.world_size} ranks; inter {format_bandwidth(topo.inter.bandwidth)}, "
        f"{format_time(topo.inter.alpha)}"
        + (
            f"; intra {format_bandwidth(topo.intra.bandwidth)}, {format_time(topo.intra.alpha)}"
            if topo.gpus_per_node > 1
            else ""
        ),
    ]
    across_head = f" {'across/rank':>11s}" if nodes else ""

    def bytes_cells(r: FormatResult) -> str:
        across = f" {format_bytes(r.inter_node_bytes):>11s}" if nodes else ""
        return f"{format_bytes(r.wire_bytes):>11s}{across}"

    if comm_only:
        fp32 = pred.formats["fp32"].comm_s
        lines += [
            "compute  none: communication only",
            *(f"         {line}" for line in _wrap(f"({_comm_only_reason(model)})")),
            *_assumption_lines(assumptions),
            "",
            f"{'format':8s} {'strategy':17s} {'wire/rank':>11s}{across_head} {'comm':>10s} "
            f"{'comm speedup':>13s}",
        ]
        for r in pred.formats.values():
            speedup = fp32 / r.comm_s if r.comm_s > 0 else 1.0
            lines.append(
                f"{r.format:8s} {r.strategy_label:17s} {bytes_cells(r)} "
                f"{format_time(r.comm_s):>10s} {speedup:>12.3f}x"
            )
    else:
        lines += [
            f"compute  forward {format_time(pred.compute.forward_s)}, backward "
            f"{format_time(pred.compute.backward_s)}, optimizer "
            f"{format_time(pred.compute.optimizer_s)}",
            *_assumption_lines(assumptions),
            "",
            f"{'format':8s} {'strategy':17s} {'wire/rank':>11s}{across_head} {'comm':>10s} "
            f"{'exposed':>10s} {'step':>10s} {'speedup':>8s}",
        ]
        for r in pred.formats.values():
            lines.append(
                f"{r.format:8s} {r.strategy_label:17s} {bytes_cells(r)} "
                f"{format_time(r.comm_s):>10s} {format_time(r.exposed_comm_s):>10s} "
                f"{format_time(r.step_s):>10s} {r.speedup_vs_fp32:>7.3f}x"
            )
    return "\n".join(lines + _chosen_notes(pred) + _wire_notes(pred, nodes))


def _wrap(text: str, width: int = 82) -> list[str]:
    # Option names must stay whole: "--step-" / "time" reads as two options.
    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]


def _wire_notes(pred: Prediction, nodes: bool) -> list[str]:
    """What ``wire/rank`` counts, and why a format can send more than FP16 in it."""
    notes = ["", *_wrap((_WIRE_NOTE if nodes else _WIRE_NOTE.split(";")[0]) + ".")]
    for r in pred.formats.values():
        if r.exponent_bytes > 0:
            notes += _wrap(
                f"{r.format}'s wire/rank includes {format_bytes(r.exponent_bytes)} of block "
                f"exponents ({_EXPONENT_NOTES[pred.block_exponents or BlockExponents.RANK]})."
            )
    fp16 = pred.formats["fp16"]
    for r in pred.formats.values():
        if r.format in ("fp32", "fp16") or r.wire_bytes <= fp16.wire_bytes:
            continue
        if "hierarchical" not in r.chosen:
            continue
        less = (
            f"{fp16.inter_node_bytes / r.inter_node_bytes:.1f}x fewer bytes than fp16 across nodes"
            if r.inter_node_bytes > 0
            else "none across nodes"
        )
        notes += _wrap(
            f"{r.format} sends more than fp16 per rank but {less}: hierarchical first "
            "reduces each chunk in FP32 inside the node (4 bytes per element over the "
            f"in-node link), then sends {r.format} across nodes only."
        )
    return notes


def _chosen_notes(pred: Prediction) -> list[str]:
    """One line per "auto" format: the strategy chosen, and for how many buckets."""
    notes = []
    for r in pred.formats.values():
        if r.strategy == "auto" and r.chosen:
            parts = ", ".join(f"{s} for {n} bucket{'s' * (n != 1)}" for s, n in r.chosen.items())
            chunks = sorted({b.comm.chunks for b in pred.steps[r.format].buckets})
            notes.append(
                f"auto for {r.format}: {parts} (chunks per bucket: {', '.join(map(str, chunks))})"
            )
    return ["", *notes] if notes else []


def _cmd_predict(args: argparse.Namespace) -> int:
    _check_output(args.plot, "--plot")
    model = _model(args)
    profile = _load_profile(args.profile)
    cluster = _cluster(args, _world_size(args, profile))
    compute = _compute(args, model, cluster)
    if compute is None and args.plot:
        raise SystemExit(f"error: --plot plots step times: {_comm_only_reason(model)}")
    scaling, block_size, exponents = _scaling(args)
    pred = predict(
        model,
        cluster,
        [args.fmt],
        # No compute: every bucket is ready at once and nothing overlaps, so
        # each format's step is its communication time.
        compute or _NO_COMPUTE,
        strategy=args.strategy,
        bucket_cap_mb=args.bucket_cap_mb,
        scaling=scaling,
        block_size=block_size,
        block_exponents=exponents,
    )
    assumptions = _assumptions(args, model, cluster, compute)
    if args.json:
        if compute is None:
            out = _comm_only_dict(pred, model, assumptions)
        else:
            out = {**pred.to_dict(), "assumptions": assumptions}
        print(json.dumps(out, indent=2))
    else:
        print(_table(pred, cluster, model, assumptions, comm_only=compute is None))
    if args.plot:
        from .plot import plot_speedup_vs_bandwidth

        try:
            plot_speedup_vs_bandwidth(
                model,
                cluster,
                [args.fmt],
                compute,
                args.plot,
                strategy=args.strategy,
                scaling=scaling,
                block_size=block_size,
                block_exponents=exponents,
            )
        except OSError as exc:
            raise ValueError(f"--plot {args.plot}: {exc.strerror or exc}") from None
        if not args.json:
            print(f"\nwrote {args.plot}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    _check_output(args.out, "--out")
    model = _model(args)
    scaling, block_size, exponents = _scaling(args)
    world_sizes = args.world_sizes
    cluster = _cluster(args, world_sizes[0])
    compute = _compute(args, model, cluster)
    assumptions = _assumptions(args, model, cluster, compute)
    if compute is None:
        print(
            f"aps-perfmodel: communication only (step_s = comm_s): {_comm_only_reason(model)}",
            file=sys.stderr,
        )
    else:
        # The CSV has no room for them; the assumptions go to stderr, as the note above.
        print(f"aps-perfmodel: assumed {_assumption_text(assumptions)}", file=sys.stderr)
    print(f"aps-perfmodel: scaling {assumptions['scaling_note']}", file=sys.stderr)
    if "caveat" in assumptions:
        print(f"aps-perfmodel: caveat: {assumptions['caveat']}", file=sys.stderr)
    bandwidths = args.bandwidths or [cluster.topology.inter.bandwidth]
    rows = sweep(
        model,
        cluster,
        bandwidths=bandwidths,
        world_sizes=world_sizes,
        formats=[args.fmt],
        compute=compute or _NO_COMPUTE,
        strategy=args.strategy,
        bucket_cap_mb=args.bucket_cap_mb,
        scaling=scaling,
        block_size=block_size,
        block_exponents=exponents,
    )
    try:
        write_csv(rows, args.out if args.out else sys.stdout)
    except BrokenPipeError:
        raise  # stdout's reader left: main ends quietly
    except OSError as exc:
        raise ValueError(f"--out {args.out}: {exc.strerror or exc}") from None
    return 0


def fsdp_units(model: ModelSpec, n_units: int, world_size: int) -> list[FSDPUnit]:
    """The model's tensors cut into ``n_units`` consecutive units of about equal size.

    Each tensor's padding to the world size (FSDP pads dim 0) is bounded by
    ``world_size - 1`` rows; presets give only element counts, so a tensor
    counts as ``numel`` rounded up to a multiple of the world size.

    Example:
        >>> model = ModelSpec.from_params("2.5M")  # tensors of 1048576, 1048576, 402848
        >>> [u.param_numels for u in fsdp_units(model, 2, 3)]
        [(1048578, 1048578), (402849,)]
    """
    if n_units < 1:
        raise SystemExit(f"error: --units must be >= 1, got {n_units}")
    target = model.total_params / n_units
    units: list[FSDPUnit] = []
    sizes: list[int] = []
    seen = 0
    for t in model.tensors:
        sizes.append(-(-t.numel // world_size) * world_size)
        seen += t.numel
        # Close a unit where the running total passes the next equal share.
        if len(units) < n_units - 1 and seen >= target * (len(units) + 1):
            units.append(FSDPUnit(sum(sizes), len(sizes), tuple(sizes)))
            sizes = []
    if sizes:
        units.append(FSDPUnit(sum(sizes), len(sizes), tuple(sizes)))
    return units


def _shard_group(args: argparse.Namespace, cluster: Cluster) -> int:
    """``--replicate``'s shard group S = world / R, which must lie within a node.

    Raises:
        ValueError: R does not divide the world, or S does not divide the
            ranks per node; names R, the world and the node.
    """
    r, world = args.replicate, cluster.world_size
    per_node = cluster.topology.gpus_per_node
    if world % r:
        raise ValueError(f"--replicate {r} does not divide the world of {world} ranks")
    shard = world // r
    if r > 1 and per_node % shard:
        raise ValueError(
            f"--replicate {r} makes shard groups of {shard} ranks ({world} / {r}), which must "
            f"lie within a node: {shard} does not divide the {per_node} ranks per node"
        )
    return shard


def _cmd_fsdp(args: argparse.Namespace) -> int:
    model = _model(args)
    profile = _load_profile(args.profile)
    cluster = _cluster(args, _world_size(args, profile))
    shard = _shard_group(args, cluster)
    hsdp = args.replicate > 1
    # FSDP pads each parameter to a multiple of the ranks it is sharded over.
    units = fsdp_units(model, args.units, shard)
    scaling, block_size, _ = _scaling(args)
    if args.block_exponents == BlockExponents.RANK.value:
        raise SystemExit(
            "error: --block-exponents rank is DDP two_phase's; FSDP2's reduce-scatter always "
            "agrees block exponents by one MAX all-reduce (leave it out, or say agreed)"
        )
    rows = []
    for name in dict.fromkeys(["fp32", "bf16", args.fmt]):
        fmt = get_format(name, scaling=scaling, block_size=block_size)
        pred = fsdp_step(
            units,
            fmt,
            cluster,
            backend=args.backend,
            param_bytes=args.param_bytes,
            replicate=args.replicate,
        )
        rows.append(pred)
    assumptions = _fsdp_assumptions(args, cluster, scaling, block_size)
    why = _hsdp_why(rows, cluster) if hsdp else _fsdp_why(rows, cluster)
    base = rows[0].gradient_s
    if args.json:
        out = [
            {
                "format": r.format,
                "aps": r.aps,
                "reduce_scatter_format": r.reduce_scatter_format,
                "reduce_scatter_s": r.reduce_scatter_s,
                "all_reduce_s": r.all_reduce_s,
                "reduce_scatter_speedup_vs_fp32": base / r.gradient_s if r.gradient_s else 1.0,
                "all_gather_s": r.all_gather_s,
                "step_comm_s": r.step_s,
                "wire_bytes": r.wire_bytes,
                "inter_node_bytes": r.inter_node_bytes,
                "cross_node_bytes": r.cross_node_bytes,
                "exponent_bytes": r.exponent_bytes,
            }
            for r in rows
        ]
        head = {"units": len(units), "backend": args.backend, "scaling": scaling.value}
        head["replicate"] = args.replicate
        head["shard_group"] = shard
        head["block_size"] = block_size if scaling == Scaling.BLOCK else None
        head["communication_only"] = True
        head["assumptions"] = assumptions
        head["why"] = why
        print(json.dumps({**head, "rows": out}, indent=2))
        return 0
    if hsdp:
        print("\n".join(_hsdp_lines(args, model, cluster, rows, len(units), assumptions, why)))
        return 0
    topo = cluster.topology
    nodes = topo.nodes > 1
    lines = [
        f"FSDP2    {model.name}: {model.total_params / 1e6:,.1f}M params in {len(units)} units "
        f"(--units), {args.backend} (--backend)",
        f"cluster  {cluster.name}: {topo.nodes} node(s) x {topo.gpus_per_node} device(s) = "
        f"{cluster.world_size} ranks",
        "compute  none: communication per step only",
        *(
            f"         {line}"
            for line in _wrap(
                "(the reduce-scatters and the parameter all-gathers, nothing overlapped)"
            )
        ),
        *_assumption_lines(assumptions),
        "",
        f"{'format':6s} {'reduce-scatter':18s} {'wire/rank':>10s}"
        + (f" {'across/rank':>11s}" if nodes else "")
        + f" {'reduce-scatter':>14s} {'speedup':>8s} {'all-gathers':>11s} {'comm/step':>10s}",
    ]
    for r in rows:
        kind = "APS all-to-all" if r.aps else "reduce_dtype"
        across = f" {format_bytes(r.inter_node_bytes):>11s}" if nodes else ""
        speedup = base / r.reduce_scatter_s if r.reduce_scatter_s else 1.0
        lines.append(
            f"{r.format:6s} {kind:18s} {format_bytes(r.wire_bytes):>10s}{across} "
            f"{format_time(r.reduce_scatter_s):>14s} {speedup:>7.2f}x "
            f"{format_time(r.all_gather_s):>11s} {format_time(r.step_s):>10s}"
        )
    lines += [
        "",
        *_wrap(
            "wire/rank: bytes one rank sends per step for the gradients"
            + ("; across/rank: the part that leaves the node" if nodes else "")
            + "; comm/step: every reduce-scatter and parameter all-gather of one step, "
            "communication only (give the compute to a DDP `predict` for step times)."
        ),
    ]
    for text in why:
        lines += ["", *_wrap(text)]
    print("\n".join(lines))
    return 0


def _hsdp_lines(
    args: argparse.Namespace,
    model: ModelSpec,
    cluster: Cluster,
    rows: Sequence[FSDPStepPrediction],
    n_units: int,
    assumptions: dict[str, Any],
    why: Sequence[str],
) -> list[str]:
    """``fsdp --replicate``'s text: the assumptions, then a row per format."""
    topo = cluster.topology
    shard = cluster.world_size // args.replicate
    base = rows[0].gradient_s
    lines = [
        f"HSDP     {model.name}: {model.total_params / 1e6:,.1f}M params in {n_units} units "
        f"(--units), {args.backend} (--backend)",
        f"cluster  {cluster.name}: {topo.nodes} node(s) x {topo.gpus_per_node} device(s) = "
        f"{cluster.world_size} ranks, {args.replicate} replicas x {shard} (--replicate)",
        "compute  none: communication per step only",
        *(
            f"         {line}"
            for line in _wrap(
                "(the reduce-scatters, the replica all-reduces and the parameter all-gathers, "
                "nothing overlapped)"
            )
        ),
        *_assumption_lines(assumptions),
        "",
        f"{'format':6s} {'rs+ar':9s} {'wire/rank':>10s} {'across/rank':>11s} "
        f"{'reduce-scatter':>14s} {'all-reduce':>10s} {'speedup':>8s} {'all-gathers':>11s} "
        f"{'comm/step':>10s}",
    ]
    for r in rows:
        kinds = f"{r.reduce_scatter_format}+{'APS' if r.aps else r.format}"
        speedup = base / r.gradient_s if r.gradient_s else 1.0
        lines.append(
            f"{r.format:6s} {kinds:9s} {format_bytes(r.wire_bytes):>10s} "
            f"{format_bytes(r.cross_node_bytes):>11s} {format_time(r.reduce_scatter_s):>14s} "
            f"{format_time(r.all_reduce_s):>10s} {speedup:>7.2f}x "
            f"{format_time(r.all_gather_s):>11s} {format_time(r.step_s):>10s}"
        )
    lines += [
        "",
        *_wrap(
            "rs+ar: the reduce-scatter's format (FSDP's own, or APS) + the replica "
            "all-reduce's (a ring in that reduce_dtype, or APS two_phase); wire/rank: bytes "
            "one rank sends per step for the gradients; across/rank: bytes one rank sends "
            "across nodes per step, all-gathers included; speedup: of the reduce-scatters and "
            "all-reduces against fp32's; comm/step: every reduce-scatter, replica all-reduce "
            "and parameter all-gather of one step, communication only."
        ),
    ]
    for text in why:
        lines += ["", *_wrap(text)]
    return lines


def _hsdp_text(args: argparse.Namespace, cluster: Cluster) -> str:
    """Which link each of HSDP's collectives uses, in words."""
    topo = cluster.topology
    r = args.replicate
    shard = cluster.world_size // r
    intra = format_bandwidth(topo.intra.bandwidth)
    if topo.nodes == 1:
        where = (
            "inside the one node (a single node: nothing crosses nodes, and this "
            f"all-reduce too runs on the intra-node link, {intra} per device)"
        )
    else:
        per_node = topo.gpus_per_node // shard
        where = (
            f"on the inter-node link ({format_bandwidth(topo.inter.bandwidth)} per node, "
            f"shared by the node's {topo.gpus_per_node} ranks"
            + (f"; {per_node} of the {r} replicas on each node" if per_node > 1 else "")
            + ")"
        )
    return (
        f"each unit sharded over {shard} ranks of a node (world / --replicate): its "
        f"all-gathers and reduce-scatter among them on the intra-node link ({intra} per "
        f"device); each unit's 1/{shard} shard all-reduced among the {r} replicas {where}. "
        "fp32 and bf16: FSDP's own reduce-scatter and all-reduce in that reduce_dtype (ring); "
        f"{args.fmt}: FSDP's own reduce-scatter in FP32 and the replicas' all-reduce by APS "
        "(two_phase: a MAX all-reduce of the maxima, an all-to-all and an all-gather of "
        f"{args.fmt} shards, FP32 sums), as aps_comm.fsdp.register(..., replicate=) runs it"
    )


def _fsdp_assumptions(
    args: argparse.Namespace, cluster: Cluster, scaling: Scaling, block_size: int
) -> dict[str, Any]:
    """What ``fsdp`` assumed, in the keys :func:`_assumption_lines` prints."""
    out: dict[str, Any] = {
        "compute": "none: communication only",
        "device": cluster.device.name,
        "param_bytes": args.param_bytes,
        "all_gathers": f"every unit's parameters at {args.param_bytes:g} bytes each "
        "(--param-bytes), twice per step: for forward and again for backward (reshard "
        "after forward); units of consecutive tensors of about equal size (--units)",
        "links": _links_text(cluster),
        "scaling_note": _scaling_text(args.fmt, scaling, block_size),
    }
    if args.replicate > 1:
        out["hsdp"] = _hsdp_text(args, cluster)
    if cluster.pass_costs and not cluster.codec_fits:
        out["measured"] = cluster.pass_costs_source
    caveat = _low_bit_caveat(args.fmt, scaling)
    if caveat:
        out["caveat"] = caveat
    return out


def _fsdp_why(rows: Sequence[FSDPStepPrediction], cluster: Cluster) -> list[str]:
    """Why each APS row is as fast as it is against FP32: its bytes across nodes, or on the wire."""
    topo = cluster.topology
    fp32 = rows[0]
    notes = []
    for r in rows[1:]:
        if not r.aps or fp32.wire_bytes <= 0:
            continue
        if topo.nodes > 1 and topo.gpus_per_node > 1 and fp32.inter_node_bytes > 0:
            ratio = r.inter_node_bytes / fp32.inter_node_bytes
            notes.append(
                f"{r.format}'s reduce-scatter is one all-to-all of unreduced rows "
                "(aps_comm.fsdp): each rank sends its rows for every rank on another node "
                f"across, while fp32's (node-aware) sums inside the node first and sends a "
                f"1/{topo.gpus_per_node} shard. Through the node's one "
                f"{format_bandwidth(topo.inter.bandwidth)} link, shared by its "
                f"{topo.gpus_per_node} devices, {r.format} sends {ratio:.2f}x fp32's bytes "
                f"({format_bytes(r.inter_node_bytes)} vs {format_bytes(fp32.inter_node_bytes)} "
                "per rank). With one device per node link (--gpus-per-node 1, as the Ethernet "
                "presets are) it would send "
                f"{r.wire_bytes / fp32.wire_bytes:.2f}x."
            )
        else:
            notes.append(
                f"{r.format} sends {r.wire_bytes / fp32.wire_bytes:.2f}x fp32's bytes per rank; "
                "its reduce-scatter also pays a MAX all-reduce of the maxima and the codec "
                "passes (amax, encode, decode, sum), which is why its speedup is below "
                f"{fp32.wire_bytes / r.wire_bytes:.2f}x."
            )
    return notes


def _hsdp_why(rows: Sequence[FSDPStepPrediction], cluster: Cluster) -> list[str]:
    """Why each APS row of HSDP is as fast as it is: its bytes across nodes against fp32's."""
    fp32 = rows[0]
    notes = []
    for r in rows[1:]:
        if not r.aps or fp32.cross_node_bytes <= 0:
            continue
        notes.append(
            f"{r.format}'s replica all-reduce sends "
            f"{r.cross_node_bytes / fp32.cross_node_bytes:.2f}x fp32's bytes across nodes "
            f"({format_bytes(r.cross_node_bytes)} vs {format_bytes(fp32.cross_node_bytes)} "
            f"per rank): APS's two_phase sends {r.format} elements where fp32's ring sends 4 "
            "bytes each; it also pays a MAX all-reduce of the maxima and the codec passes. "
            "Its reduce-scatter and the all-gathers stay inside the node."
        )
    return notes


def _cmd_calibrate(args: argparse.Namespace) -> int:
    # Measuring runs aps_comm's codec and hooks, so it is aps_comm's command;
    # the model imports nothing of aps_comm, even here.
    command = " ".join([_CALIBRATE_COMMAND, *args.calibrate_args])
    print(
        f"aps-perfmodel calibrate moved to the plugin, with the same flags: {command}",
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    ap = _Parser(
        prog="aps-perfmodel",
        description="Predict whether low-precision gradient communication pays.",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("predict", help="predict comm and step time for one configuration")
    _add_model_cluster_args(p)
    p.add_argument("--world-size", type=_POSITIVE_INT, help="total ranks")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PATH", help="write a speedup-vs-bandwidth PNG")
    p.set_defaults(func=_cmd_predict)

    s = sub.add_parser("sweep", help="sweep bandwidths and world sizes to CSV")
    _add_model_cluster_args(s)
    s.add_argument(
        "--world-sizes",
        type=_listed(_POSITIVE_INT),
        required=True,
        help="comma-separated, e.g. 8,16,64",
    )
    s.add_argument(
        "--bandwidths",
        type=_listed(_BANDWIDTH),
        help="comma-separated inter-node bandwidths, e.g. 1Gbit,10Gbit",
    )
    s.add_argument("--out", help="CSV path (default: stdout)")
    s.set_defaults(func=_cmd_sweep, world_size=None)

    f = sub.add_parser("fsdp", help="predict FSDP2's reduce-scatter: FP32, BF16 and APS")
    _add_model_cluster_args(f)
    f.add_argument("--world-size", type=_POSITIVE_INT, help="total ranks")
    f.add_argument("--units", type=_POSITIVE_INT, default=8, help="fully_shard units (equal sizes)")
    f.add_argument("--backend", type=str.lower, default="nccl", choices=["nccl", "gloo"])
    f.add_argument(
        "--param-bytes", type=_POSITIVE_FLOAT, default=4.0, help="bytes per parameter all-gathered"
    )
    f.add_argument(
        "--replicate",
        type=_POSITIVE_INT,
        default=1,
        help="HSDP: replicas R of each shard; each unit sharded over the S = world / R ranks "
        "of a node (S must divide the devices per node), its shard all-reduced among the R "
        "replicas (default 1: flat FSDP over the world)",
    )
    f.add_argument("--json", action="store_true", help="print one JSON object")
    f.set_defaults(func=_cmd_fsdp)

    c = sub.add_parser(
        "calibrate",
        help=f"moved: measure with `{_CALIBRATE_COMMAND}` (the plugin's; same flags)",
        add_help=False,
    )
    # Its flags are the new command's: main hands them on unread.
    c.set_defaults(func=_cmd_calibrate, calibrate_args=[])
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aps-perfmodel``; returns the exit status.

    A bad value or file is one line on stderr and status 2. A reader that
    stops early (``aps-perfmodel sweep ... | head -2``) ends it quietly with
    status 141, as SIGPIPE ends a Unix tool.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.func is _cmd_calibrate:
        args.calibrate_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.func(args)
        # A closed pipe shows at this flush, not in the interpreter's own at exit.
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Python ignores SIGPIPE, so the reader's going away is an exception
        # here; stdout goes to devnull so that the flush at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return _EXIT_BROKEN_PIPE
    except ValueError as exc:
        print(f"aps-perfmodel: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
