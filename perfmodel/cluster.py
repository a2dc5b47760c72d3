"""Devices and clusters: link parameters, memory bandwidth, presets.

A :class:`Cluster` is a two-level :class:`~aps_perfmodel.collectives.Topology`
plus the :class:`Device` its ranks run on (which prices the codec passes and
estimates compute). A calibrated profile can attach measured per-collective
link fits and codec costs, which then replace the analytic defaults.

Preset link numbers are vendor peak figures (sources in each preset); latencies
are typical per-message software+wire latencies, stated as such. A device preset
may also carry constants measured on that device (``python -m benchmarks.gpu``,
shipped in ``perfmodel/data/devices/<name>.json``): its codec passes per element
and the host cost of a hook call per bucket, which price what ``aps_comm``
achieves there rather than what the datasheet allows.

Example:
    >>> c = get_cluster("dgx-h100", world_size=64)
    >>> (c.topology.nodes, c.topology.gpus_per_node)
    (8, 8)
    >>> get_cluster("100gbe", world_size=4).topology.inter.bandwidth
    12500000000.0
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .collectives import LinkParams, Topology

__all__ = [
    "BLOCK_CODEC_RATIO",
    "BLOCK_CODEC_RATIO_PACKED",
    "CLUSTERS",
    "DEVICES",
    "DEVICE_DATA_KIND",
    "Cluster",
    "Device",
    "OpCost",
    "block_codec_ratio",
    "codec_bytes_per_elem",
    "custom_cluster",
    "device_data_path",
    "get_cluster",
    "get_device",
    "measured_costs",
]


@dataclass(frozen=True)
class OpCost:
    """Measured cost of one local pass: ``launch_s + n * s_per_elem`` (0 for n = 0).

    Example:
        >>> round(OpCost(1e-5, 1e-9).time(1000), 9)
        1.1e-05
    """

    launch_s: float
    s_per_elem: float

    def time(self, n_elem: float) -> float:
        """Seconds for a pass over ``n_elem`` elements."""
        return 0.0 if n_elem <= 0 else self.launch_s + n_elem * self.s_per_elem


DEVICE_DATA_KIND = "aps-perfmodel-device"
"""The ``kind`` of a device's measured constants file (``perfmodel/data/devices/<name>.json``)."""

_DEVICE_DATA = Path(__file__).with_name("data") / "devices"


def device_data_path(name: str) -> Path:
    """Where the device preset ``name`` reads its measured constants (package data).

    Example:
        >>> device_data_path("h200").name
        'h200.json'
    """
    return _DEVICE_DATA / f"{name}.json"


def measured_costs(data: Mapping[str, Any]) -> tuple[dict[str, OpCost], str]:
    """A measured constants file's pass costs and the source line naming its run.

    The file (written by ``python -m benchmarks.gpu --preset``) holds
    ``{"kind", "device", "source", "note", "costs": {key: {"launch_s",
    "s_per_elem"}}}``; the note (what changed since the run) joins the source.

    Raises:
        ValueError: not a device constants file.

    Example:
        >>> costs, source = measured_costs({"kind": DEVICE_DATA_KIND, "source": "a run",
        ...     "note": "", "costs": {"encode.e4m3": {"launch_s": 0.0, "s_per_elem": 4e-12}}})
        >>> costs["encode.e4m3"].time(1e9), source
        (0.004, 'a run')
    """
    if data.get("kind") != DEVICE_DATA_KIND:
        raise ValueError(f"not a device constants file (kind {data.get('kind')!r})")
    costs = {k: OpCost(**v) for k, v in data["costs"].items()}
    source = data["source"] + (f"; {data['note']}" if data.get("note") else "")
    return costs, source


def _measured(name: str) -> dict[str, Any]:
    """The ``measured`` and ``measured_source`` fields of preset ``name``, from its file."""
    costs, source = measured_costs(json.loads(device_data_path(name).read_text()))
    return {"measured": MappingProxyType(costs), "measured_source": source}


@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU socket share) as the model sees it.

    Attributes:
        name: preset name.
        mem_bw: memory bandwidth in bytes/s; prices the codec passes.
        peak_flops: dense peak FLOP/s per compute dtype ("fp32", "tf32", "fp16", "bf16").
        launch_s: fixed cost of one kernel/pass (launch and synchronisation).
        source: where the numbers come from.
        fp8_sum: whether NCCL sums FP8 (e4m3, e5m2) natively on it (NCCL >=
            2.24 on sm_90+), so that the native all-reduce strategy is open
            to 8-bit formats.
        cpu_codec: its codec is ``aps_comm``'s compiled CPU kernels, whose
            block-scaled passes cost :func:`block_codec_ratio` times the
            per-layer ones (measured); a GPU's memory-bound kernels pay only
            the exponents' bytes of extra traffic.
        measured: pass costs measured on this device, keyed as a calibrated
            profile's codec fits (``encode.<fmt>``, ``decode.<fmt>``,
            ``<op>.<fmt>.block<size>`` for block scaling, and
            ``hook_call.<fmt>``: the host time of one hook call per bucket);
            a cluster without calibrated fits of its own prices those passes
            with them (:attr:`Cluster.pass_costs`). Empty: datasheet only.
        measured_source: the run they come from (device, commit, command).
        compute_dtype: the dtype of mixed-precision training on it, which a
            FLOP estimate assumes unless told otherwise: bf16, or fp16 where
            the tensor cores have no BF16 (V100).

    Example:
        >>> get_device("v100").peak_flops["fp32"], get_device("v100").compute_dtype
        (15700000000000.0, 'fp16')
        >>> sorted(get_device("h200").measured)[:2]
        ['decode.e4m3', 'decode.e4m3.block32']
    """

    name: str
    mem_bw: float
    peak_flops: Mapping[str, float]
    launch_s: float
    source: str
    fp8_sum: bool = False
    cpu_codec: bool = False
    measured: Mapping[str, OpCost] = field(default_factory=lambda: MappingProxyType({}))
    measured_source: str = ""
    compute_dtype: str = "bf16"


DEVICES: dict[str, Device] = {
    "h100": Device(
        "h100",
        3.35e12,
        MappingProxyType({"fp32": 67e12, "tf32": 494.7e12, "fp16": 989.4e12, "bf16": 989.4e12}),
        5e-6,
        "NVIDIA H100 SXM5 datasheet (dense tensor-core peaks, HBM3 3.35 TB/s); "
        "FP8 sums: NCCL 2.24 release notes (FP8 reductions on sm_90+); no measured "
        "constants: python -m benchmarks.gpu has not run on an H100 yet",
        fp8_sum=True,
    ),
    "h200": Device(
        "h200",
        4.8e12,
        MappingProxyType({"fp32": 67e12, "tf32": 494.7e12, "fp16": 989.4e12, "bf16": 989.4e12}),
        5e-6,
        "NVIDIA H200 SXM datasheet (HBM3e 4.8 TB/s; dense peaks as the H100 SXM's); "
        "FP8 sums: NCCL 2.24 release notes (FP8 reductions on sm_90+)",
        fp8_sum=True,
        **_measured("h200"),
    ),
    "a100": Device(
        "a100",
        2.039e12,
        MappingProxyType({"fp32": 19.5e12, "tf32": 156e12, "fp16": 312e12, "bf16": 312e12}),
        5e-6,
        "NVIDIA A100 80GB SXM datasheet (dense peaks, HBM2e 2.039 TB/s)",
    ),
    "v100": Device(
        "v100",
        0.9e12,
        MappingProxyType({"fp32": 15.7e12, "tf32": 15.7e12, "fp16": 125e12, "bf16": 15.7e12}),
        5e-6,
        "NVIDIA Tesla V100 SXM2 datasheet (15.7 TFLOP/s FP32, 125 tensor, 900 GB/s HBM2); "
        "its tensor cores have no BF16 or TF32, so those run at the FP32 rate and mixed "
        "precision is FP16",
        compute_dtype="fp16",
    ),
    "cpu": Device(
        "cpu",
        10e9,
        MappingProxyType({"fp32": 50e9, "tf32": 50e9, "fp16": 50e9, "bf16": 50e9}),
        2e-6,
        "rough single-core share of a modern x86 server; calibrate for real numbers",
        cpu_codec=True,
    ),
    "cpu-numba": Device(
        "cpu-numba",
        5.9e9,
        MappingProxyType({"fp32": 50e9, "tf32": 50e9, "fp16": 50e9, "bf16": 50e9}),
        1e-5,
        "aps_comm's compiled CPU codec on one thread (benchmarks/results/codec.json: scaled "
        "e4m3 encode of 64 MiB in 14.3 ms, 5 B/element of traffic = 5.9 GB/s; decode is "
        "faster, 9.4 GB/s); 10 us per pass assumed for a compiled call from Python; "
        "FLOPs as the cpu preset",
        cpu_codec=True,
    ),
}


def get_device(name: str) -> Device:
    """Look up a device preset by name.

    Example:
        >>> get_device("h100").mem_bw
        3350000000000.0
    """
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; choose from {sorted(DEVICES)}") from None


_FORMAT_FREE_OPS = ("amax", "scale", "unscale", "accumulate")
# The passes that apply a block's scale to every element: encode, decode and
# the owner's fused decode-sum-encode. The block maxima pass reads the FP32
# gradient as the per-layer amax does, and is priced as it.
_BLOCK_SCALED_OPS = ("encode", "decode", "reduce")

BLOCK_CODEC_RATIO = 1.07
"""Block-scaled over per-layer-scaled encode + decode time on the CPU kernels, byte formats.

Measured on the 2-vCPU development machine, one thread, 64 MiB, 15 repeats,
``python -m benchmarks.codec --repeats 15`` (blocks of 32; block and
per-layer timed beside the same copy, benchmarks/results/codec.json):
e4m3 1.06 (block 1.59x a copy, per layer 1.50x), e5m2 1.06, fp16 1.07,
bf16 1.14; the median 1.07. (Before the block kernels' vector steps:
1.30, e4m3 block 2.05-2.11x a copy.)"""

BLOCK_CODEC_RATIO_PACKED = 1.22
"""The same for formats packed below a byte per element, as measured.

The same run: e2m1 1.22 (block 1.73x a copy, per layer 1.39x); e3m2, which
the kernels send in a byte, 1.07. (Before: 1.58.)"""


def block_codec_ratio(wire_bytes: float) -> float:
    """Per-element time of a block-scaled CPU codec pass over a per-layer one.

    Example:
        >>> block_codec_ratio(1.0), block_codec_ratio(0.5)
        (1.07, 1.22)
    """
    return BLOCK_CODEC_RATIO_PACKED if wire_bytes < 1.0 else BLOCK_CODEC_RATIO


def codec_bytes_per_elem(op: str, wire_bytes: float, exponent_bytes: float = 0.0) -> float:
    """Bytes of memory traffic per element for one codec pass on FP32 gradients.

    ``amax`` reads the FP32 gradient; ``encode`` (scale, clamp, cast, fused)
    reads FP32 and writes the wire format; ``decode`` (decode, unscale) does the
    reverse; ``accumulate`` reads the decoded FP32 shards and writes the sum.
    With block scaling, ``encode`` and ``decode`` also read the blocks'
    exponents, ``exponent_bytes`` per element.

    Example:
        >>> codec_bytes_per_elem("encode", 1.0)
        5.0
        >>> codec_bytes_per_elem("decode", 0.5, 1 / 32)
        4.53125
    """
    table = {
        "amax": 4.0,
        "encode": 4.0 + wire_bytes + exponent_bytes,
        "decode": wire_bytes + exponent_bytes + 4.0,
        "accumulate": 8.0,
    }
    try:
        return table[op]
    except KeyError:
        raise ValueError(f"unknown codec op {op!r}") from None


@dataclass(frozen=True)
class Cluster:
    """A cluster to predict for.

    Attributes:
        name: preset or profile name.
        topology: nodes x devices per node with their links.
        device: the device each rank runs on.
        algorithm: all-reduce algorithm ("ring", "halving_doubling",
            "recursive_doubling" or "auto").
        collective_fits: measured flat link parameters per collective, keyed
            "all_reduce.<dtype>", "all_to_all", "all_gather", "all_reduce_max";
            used instead of the topology formulas' links when present.
        codec_fits: measured pass costs keyed "<op>.<format>" (or "accumulate").
        source: where the link numbers come from.
        cores_per_rank: CPU cores per rank where measured (calibrated
            profiles); below 1, APS's codec cannot overlap the wire, since the
            network stack needs the same cores. None: one device per rank.
        chunk_overhead_s: what one more pipelined chunk costs the hook beyond
            the model's collective latencies (wake-ups, Python), which the
            chunk rule weighs against filling the pipeline; None: the model's
            own fixed cost of one chunk (its collectives' latencies and
            codec launches).
        backend: the ``torch.distributed`` backend the ranks run (calibrated
            profiles, the hook's clusters); ``"gloo"`` all-reduces in one
            flat ring over node-major ranks, not node-aware; None: unknown
            (node-aware all-reduce, as NCCL runs it across nodes).

    Example:
        >>> get_cluster("10gbe", world_size=8).world_size
        8
    """

    name: str
    topology: Topology
    device: Device
    algorithm: str = "ring"
    collective_fits: Mapping[str, LinkParams] = field(default_factory=dict)
    codec_fits: Mapping[str, OpCost] = field(default_factory=dict)
    source: str = ""
    cores_per_rank: float | None = None
    chunk_overhead_s: float | None = None
    backend: str | None = None

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.topology.world_size

    @property
    def pass_costs(self) -> Mapping[str, OpCost]:
        """Measured pass costs: the calibrated fits, else the device's measured constants.

        A calibrated profile's fits replace the device's constants whole (one
        machine's measurements, not a mix of two); with neither, empty, and
        the passes are priced from the device's memory bandwidth.

        Example:
            >>> c = get_cluster("dgx-h100", world_size=8)
            >>> len(c.pass_costs), "hook_call.e4m3" in replace(c, device=get_device("h200")).pass_costs
            (0, True)
        """
        return self.codec_fits or self.device.measured

    @property
    def pass_costs_source(self) -> str:
        """The run :attr:`pass_costs` come from; empty where there are none.

        Example:
            >>> get_cluster("dgx-h100", world_size=8).pass_costs_source
            ''
        """
        if self.codec_fits:
            return self.source
        return self.device.measured_source

    def with_world_size(self, world_size: int) -> Cluster:
        """The same cluster scaled to ``world_size`` ranks, filling nodes first.

        Raises:
            ValueError: ``world_size`` is not a multiple of the devices per node
                (and larger than one node).
        """
        g = self.topology.gpus_per_node
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        if world_size <= g:
            topo = replace(self.topology, nodes=1, gpus_per_node=world_size)
        elif world_size % g == 0:
            topo = replace(self.topology, nodes=world_size // g)
        else:
            raise ValueError(f"world_size {world_size} is not a multiple of {g} devices per node")
        return replace(self, topology=topo)

    def with_links(
        self,
        *,
        bandwidth: float | None = None,
        latency: float | None = None,
        intra_bandwidth: float | None = None,
        intra_latency: float | None = None,
    ) -> Cluster:
        """Override the inter-node (and optionally intra-node) link bandwidth/latency.

        Measured per-collective fits no longer describe a changed link, so they
        are dropped when the inter-node link changes.
        """
        inter, intra = self.topology.inter, self.topology.intra
        if bandwidth is not None:
            inter = replace(inter, beta=1.0 / bandwidth)
        if latency is not None:
            inter = replace(inter, alpha=latency)
        if intra_bandwidth is not None:
            intra = replace(intra, beta=1.0 / intra_bandwidth)
        if intra_latency is not None:
            intra = replace(intra, alpha=intra_latency)
        fits = self.collective_fits if bandwidth is None and latency is None else {}
        return replace(
            self, topology=replace(self.topology, inter=inter, intra=intra), collective_fits=fits
        )

    def codec_time(
        self,
        op: str,
        fmt_name: str,
        wire_bytes: float,
        n_elem: float,
        block_size: int | None = None,
    ) -> float:
        """Seconds for one codec pass of ``n_elem`` elements on one rank.

        With ``block_size`` (block scaling), the encode, decode and owner's
        reduce passes cost more per element: a measured block pass
        (``<op>.<fmt>.block<size>`` in :attr:`pass_costs`) as measured;
        calibrated fits and CPU devices (which time ``aps_comm``'s CPU
        kernels) by :func:`block_codec_ratio`, as measured; other devices by
        the exponents' bytes of memory traffic (:func:`codec_bytes_per_elem`).
        Launch costs do not change.

        Example:
            >>> c = custom_cluster(125e6, 50e-6, nodes=2, device="cpu-numba")
            >>> layer = c.codec_time("encode", "e4m3", 1.0, 2**20)
            >>> block = c.codec_time("encode", "e4m3", 1.0, 2**20, block_size=32)
            >>> round((block - c.device.launch_s) / (layer - c.device.launch_s), 2)
            1.07
            >>> h200 = replace(c, device=get_device("h200"))  # measured on an H200
            >>> round(h200.codec_time("encode", "e4m3", 1.0, 2**26) * 1e3, 4)
            0.1015
        """
        key = op if op in _FORMAT_FREE_OPS else f"{op}.{fmt_name}"
        costs = self.pass_costs
        if block_size is None or op not in _BLOCK_SCALED_OPS:
            ratio, exponent_bytes = 1.0, 0.0
        elif f"{key}.block{block_size}" in costs:
            return costs[f"{key}.block{block_size}"].time(n_elem)
        elif self.codec_fits or self.device.cpu_codec:
            # Calibrated fits time the CPU kernels (python -m aps_comm calibrate).
            ratio, exponent_bytes = block_codec_ratio(wire_bytes), 0.0
        else:
            # Memory-bound GPU kernels: the exponents' extra bytes of traffic.
            ratio, exponent_bytes = 1.0, 1.0 / block_size
        if key in costs:
            fit = costs[key]
            if exponent_bytes:  # a GPU's measured per-layer pass, read and written with them
                ratio = codec_bytes_per_elem(op, wire_bytes, exponent_bytes) / codec_bytes_per_elem(
                    op, wire_bytes
                )
            return OpCost(fit.launch_s, fit.s_per_elem * ratio).time(n_elem)
        if n_elem <= 0 or op in ("scale", "unscale"):
            # On a GPU the power-of-two scaling is fused into the encode/decode kernels.
            return 0.0
        per_elem = codec_bytes_per_elem(op, wire_bytes, exponent_bytes) * ratio
        return self.device.launch_s + n_elem * per_elem / self.device.mem_bw


def _link(gbytes_per_s: float, latency_s: float, device: Device) -> LinkParams:
    if not gbytes_per_s > 0:  # also NaN: a link time of 1/0 is no prediction
        raise ValueError(f"bandwidth must be positive, got {gbytes_per_s * 1e9:g} bytes/s")
    # NCCL fuses the add into the copy kernel: about one extra pass of device memory per byte.
    return LinkParams(alpha=latency_s, beta=1.0 / (gbytes_per_s * 1e9), gamma=1.0 / device.mem_bw)


def _preset(
    name: str,
    gpus_per_node: int,
    intra: tuple[float, float],
    inter: tuple[float, float],
    device: str,
    source: str,
) -> Callable[[], Cluster]:
    def build() -> Cluster:
        dev = DEVICES[device]
        topo = Topology(1, gpus_per_node, _link(*intra, dev), _link(*inter, dev))
        return Cluster(name=name, topology=topo, device=dev, source=source)

    return build


_PCIE4 = (25.0, 5e-6)

CLUSTERS: dict[str, Callable[[], Cluster]] = {
    "dgx-h100": _preset(
        "dgx-h100",
        8,
        (450.0, 3e-6),
        (400.0, 6e-6),
        "h100",
        "NVIDIA DGX H100: NVLink4 900 GB/s bidirectional per GPU (450 GB/s each way); "
        "8x ConnectX-7 400 Gbit/s per node = 400 GB/s; latencies assumed 3 us / 6 us",
    ),
    "dgx1-v100": _preset(
        "dgx1-v100",
        8,
        (150.0, 5e-6),
        (50.0, 6e-6),
        "v100",
        "NVIDIA DGX-1 (V100): 6 NVLink2 links x 25 GB/s each way = 150 GB/s per GPU; "
        "4x EDR InfiniBand 100 Gbit/s per node = 50 GB/s; latencies assumed 5 us / 6 us",
    ),
    "100gbe": _preset(
        "100gbe",
        1,
        _PCIE4,
        (12.5, 10e-6),
        "a100",
        "one GPU per host, 100 Gbit/s Ethernet (12.5 GB/s); latency assumed 10 us",
    ),
    "10gbe": _preset(
        "10gbe",
        1,
        _PCIE4,
        (1.25, 25e-6),
        "a100",
        "one GPU per host, 10 Gbit/s Ethernet (1.25 GB/s); latency assumed 25 us",
    ),
    "1gbe": _preset(
        "1gbe",
        1,
        _PCIE4,
        (0.125, 50e-6),
        "a100",
        "one GPU per host, 1 Gbit/s Ethernet (125 MB/s); latency assumed 50 us",
    ),
}


def get_cluster(
    name: str, world_size: int | None = None, gpus_per_node: int | None = None
) -> Cluster:
    """Build a preset cluster, optionally with another device count per node and world size.

    Example:
        >>> get_cluster("100gbe", world_size=16, gpus_per_node=8).topology.nodes
        2
    """
    try:
        cluster = CLUSTERS[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown cluster {name!r}; choose from {sorted(CLUSTERS)}") from None
    if gpus_per_node is not None:
        cluster = replace(cluster, topology=replace(cluster.topology, gpus_per_node=gpus_per_node))
    if world_size is not None:
        cluster = cluster.with_world_size(world_size)
    return cluster


def custom_cluster(
    bandwidth: float,
    latency: float,
    *,
    nodes: int = 1,
    gpus_per_node: int = 1,
    intra_bandwidth: float = _PCIE4[0] * 1e9,
    intra_latency: float = _PCIE4[1],
    device: str = "a100",
) -> Cluster:
    """A cluster from explicit link numbers (bytes/s and seconds).

    With ``gpus_per_node == 1`` every rank is its own node and only the
    inter-node link matters.

    Example:
        >>> custom_cluster(12.5e9, 10e-6, nodes=4).world_size
        4
    """
    dev = get_device(device)
    topo = Topology(
        nodes,
        gpus_per_node,
        _link(intra_bandwidth / 1e9, intra_latency, dev),
        _link(bandwidth / 1e9, latency, dev),
    )
    return Cluster(
        name="custom", topology=topo, device=dev, source="explicit --bandwidth/--latency"
    )
