"""One DDP step as the model plays it: the APS comm model's limits, DDP's buckets and timeline,
models, compute, units, and the published PyTorch DDP benchmark.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from aps_perfmodel import (
    ComputeTime,
    ModelSpec,
    OpCost,
    TensorSpec,
    assign_buckets,
    bucket_comm,
    custom_cluster,
    get_cluster,
    get_device,
    get_format,
    get_model,
    predict,
    simulate_step,
)
from aps_perfmodel import collectives as C
from aps_perfmodel.cluster import block_codec_ratio
from aps_perfmodel.ddp import DEFAULT_FIRST_BUCKET_BYTES
from aps_perfmodel.literature import reproduce_pytorch_ddp_benchmark
from aps_perfmodel.strategies import bucket_breakdown, grid_rows
from aps_perfmodel.units import parse_bandwidth, parse_bytes, parse_count, parse_time

# --- APS comm model: limits ---------------------------------------------------------


def _ratio(
    fmt: str, cluster, n: int = 25 * 2**18, layers: int = 20, chunk: int | None = 2**20, **kw
) -> float:
    fp32 = bucket_comm(n, layers, get_format("fp32"), cluster).total_s
    return fp32 / bucket_comm(n, layers, get_format(fmt, **kw), cluster, chunk).total_s


def test_fp8_speedup_tends_to_byte_ratio_when_bandwidth_bound() -> None:
    slow = custom_cluster(parse_bandwidth("1Mbit"), 0.0, nodes=8)
    assert _ratio("e4m3", slow) == pytest.approx(4.0, rel=1e-3)
    assert _ratio("fp16", slow) == pytest.approx(2.0, rel=1e-3)
    assert _ratio("e2m1", slow) == pytest.approx(8.0, rel=1e-3)


def test_fp8_speedup_tends_to_one_when_latency_bound() -> None:
    lat = custom_cluster(1e15, 1.0, nodes=8)  # one second per message, free bandwidth
    # Same collective, fewer bytes: no gain.
    assert _ratio("e4m3", lat, strategy="allreduce", aps=False) == pytest.approx(1.0, rel=1e-4)
    # APS adds the MAX all-reduce of maxima: a latency-bound loss, never a gain.
    aps = _ratio("e4m3", lat, chunk=None)
    assert aps < 1.0
    # ring all-reduce 2(p-1) steps vs all-to-all + all-gather 2(p-1) + recursive-doubling maxima 3.
    assert aps == pytest.approx(14 / (14 + 3), rel=1e-3)
    # Pipelined in k chunks, every chunk pays the collectives' latency.
    k = -(-25 * 2**18 // 2**20)
    assert _ratio("e4m3", lat) == pytest.approx(14 / (14 * k + 3), rel=1e-3)
    # And at the step level a latency-bound, compute-dominated step gains nothing.
    m = get_model("resnet50")
    pred = predict(
        m, custom_cluster(1e15, 1e-7, nodes=8), ["e4m3"], ComputeTime.from_step_time(1.0)
    )
    assert pred.formats["e4m3"].speedup_vs_fp32 == pytest.approx(1.0, abs=1e-4)


_LINKS = [
    (name, p, bw, lat)
    for name in ("1gbe", "100gbe", "dgx-h100")
    for p in (2, 8, 64)
    for bw in (1e6, 1e8, 1e10, 1e12)
    for lat in (0.0, 1e-5, 1e-3)
]


@pytest.mark.parametrize("fmt,bound", [("e4m3", 4.0), ("fp16", 2.0), ("bf16", 2.0), ("e2m1", 8.0)])
def test_speedup_never_above_byte_ratio(fmt: str, bound: float) -> None:
    for name, p, bw, lat in _LINKS:
        c = get_cluster(name).with_world_size(p).with_links(bandwidth=bw, latency=lat)
        assert _ratio(fmt, c, n=10**7) <= bound * (1 + 1e-9)


def test_step_speedup_never_above_byte_ratio() -> None:
    # Whole steps (0.1-0.4 s each, every format in one prediction): the grid's
    # corners and middle.
    model = get_model("gpt2-xl")
    formats = ["e4m3", "fp16", "bf16", "e2m1"]
    for name, p, bw, lat in _LINKS:
        if bw == 1e8 or lat == 1e-5:
            continue
        c = get_cluster(name).with_world_size(p).with_links(bandwidth=bw, latency=lat)
        pred = predict(model, c, formats, ComputeTime.from_step_time(0.5))
        assert set(formats) <= set(pred.formats)
        for res in pred.formats.values():
            bound = 4.0 / get_format(res.format).wire_bytes
            if "grid" in res.chosen:
                # Grid also cuts the messages: the FP32 ring's 2(p-1)
                # latencies against 2(g-1) + 2(p/g-1).
                g = grid_rows(p)
                bound = max(bound, (p - 1) / (g - 1 + p // g - 1))
            assert res.speedup_vs_fp32 <= bound * (1 + 1e-9)


def test_aps_breakdown_counts_codec_maxima_and_wire_bytes() -> None:
    c = get_cluster("100gbe", world_size=4)
    n = 2**20
    b = bucket_comm(n, 16, get_format("e4m3"), c)
    assert b.wire_bytes == pytest.approx(2 * n * 1.0 * 3 / 4)
    assert b.maxima_s == pytest.approx(C.allreduce(64, 4, c.topology.inter, "auto"))
    dev = c.device
    # amax (4 B/elem), encode n (5), owner decode n (5), accumulate 4n*(3/4) at gamma, re-encode n/4, final decode n.
    codec = 5 * dev.launch_s + (4 * n + 5 * n + 5 * n + 5 * n / 4 + 5 * n) / dev.mem_bw
    codec += 4 * n * 0.75 * c.topology.inter.gamma
    assert b.codec_s == pytest.approx(codec)
    assert b.collective_s == pytest.approx(
        C.all_to_all(n, 4, c.topology.inter) + C.all_gather(n, 4, c.topology.inter)
    )
    fp16 = bucket_comm(n, 16, get_format("fp16"), c)
    assert fp16.maxima_s == 0.0 and fp16.wire_bytes == pytest.approx(2 * 2 * n * 3 / 4)


# --- APS comm model: block scaling ---------------------------------------------------


@pytest.mark.parametrize("fmt,w", [("e4m3", 1.0), ("e2m1", 0.5)])
def test_block_scaling_sends_one_exponent_byte_per_block(fmt: str, w: float) -> None:
    spec = get_format(fmt, scaling="block")  # blocks of 32 by default
    assert spec.wire_bytes + spec.exponent_bytes == w + 1 / 32  # 1.03125, 0.53125 exactly
    assert get_format(fmt).exponent_bytes == 0.0
    # Blocks never cross layers; a layer's last block may be short.
    assert spec.block_count([33, 32, 1]) == 4 and spec.block_bound(66, 3) == 5
    c, p = get_cluster("1gbe", world_size=4), 4
    numels = [2**19, 2**18, 2**18]
    n, blocks = sum(numels), spec.block_count(numels)
    assert blocks == n // 32
    # Native sums: the payload's all-reduce and the exponents' MAX all-reduce, both
    # rings: w + 1/32 bytes per element.
    native = bucket_comm(n, 3, replace(spec, strategy="native"), c, n_blocks=blocks)
    assert native.wire_bytes == 2 * n * (p - 1) / p * (w + 1 / 32)
    assert native.exponent_bytes == 2 * blocks * (p - 1) / p
    # two_phase with agreed exponents: the all-to-all sends w, the all-gather
    # w + 1/32 (the owners' re-scaled exponents), beside the exponents' all-reduce.
    agreed = replace(spec, block_exponents="agreed")
    tp = bucket_comm(n, 3, agreed, c, n_blocks=blocks)
    assert tp.wire_bytes == n * (p - 1) / p * (w + (w + 1 / 32) + 2 / 32)
    assert tp.maxima_s > 0
    # With each rank's own (the default): no all-reduce, w + 1/32 both ways, and
    # the 3 layers' flags and the chunk byte to each of 3 peers in the first chunk.
    own = bucket_comm(n, 3, spec, c, n_blocks=blocks)
    assert own.wire_bytes == n * (p - 1) / p * 2 * (w + 1 / 32) + (3 + 1) * (p - 1)
    assert own.exponent_bytes == n * (p - 1) / p * 2 / 32 and own.maxima_s == 0.0
    assert own.total_s < tp.total_s
    # The payload is the per-layer model's.
    for b, flags in ((tp, 0), (own, (3 + 1) * (p - 1))):
        payload = b.wire_bytes - b.exponent_bytes - flags
        assert payload == bucket_comm(n, 3, get_format(fmt), c).wire_bytes
    # A DDP step counts every bucket's blocks exactly, short ones included.
    model = ModelSpec("m", (TensorSpec("a", 33), TensorSpec("b", 64), TensorSpec("c", 1)))
    step = simulate_step(model, c, replace(spec, strategy="native"), ComputeTime(0, 0, 0))
    assert step.exponent_bytes == 2 * (2 + 2 + 1) * (p - 1) / p


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("strategy", ["native", "two_phase"])
def test_block_scaling_costs_only_its_exponent_bytes_and_codec(fmt: str, strategy: str) -> None:
    per_elem = {"encode": 1e-9, "decode": 2e-9, "reduce": 3e-9}
    fits = {f"{op}.{fmt}": OpCost(1e-5, s) for op, s in per_elem.items()}
    fits["amax"] = OpCost(1e-5, 1e-10)
    c = replace(custom_cluster(1e9, 1e-5, nodes=4, device="cpu"), codec_fits=fits)
    p, n, layers, link = 4, 2**20, 8, c.topology.inter
    layer_spec = get_format(fmt, strategy, aps=True)
    block_spec = get_format(fmt, strategy, aps=True, scaling="block", block_exponents="agreed")
    layer = bucket_breakdown(n, layers, layer_spec, c, strategy, None)
    block = bucket_breakdown(n, layers, block_spec, c, strategy, None, n_blocks=n // 32)
    # The maxima: one MAX all-reduce of a byte per block instead of 4 bytes per layer.
    assert layer.maxima_s == pytest.approx(C.allreduce(4 * layers, p, link, "auto"))
    assert block.maxima_s == pytest.approx(C.allreduce(n // 32, p, link, "auto"))
    # The codec: the passes that apply the scales cost the measured ratio per
    # element (calibrated fits time the CPU kernels); launches and amax do not change.
    passes = per_elem["encode"] + per_elem["decode"]
    passes += per_elem["reduce"] if strategy == "two_phase" else 0.0
    extra_codec = (block_codec_ratio(layer_spec.wire_bytes) - 1) * n * passes
    assert block.codec_s - layer.codec_s == pytest.approx(extra_codec)
    # The wire: the payload's collectives are the same; two_phase's all-gather
    # also carries the owners' exponents.
    gather = link.beta * n / 32 * (p - 1) / p if strategy == "two_phase" else 0.0
    assert block.collective_s - layer.collective_s == pytest.approx(gather, abs=1e-15)
    assert block.total_s == pytest.approx(
        layer.total_s + (block.maxima_s - layer.maxima_s) + extra_codec + gather
    )
    assert block.total_s > layer.total_s
    # Uncalibrated: the CPU codec pays the same ratio, a GPU's memory-bound
    # codec only the exponents' bytes of traffic. Encode and decode n each; two_phase's
    # owner also decodes n and re-encodes n / p.
    passes_n = 2 * n if strategy == "native" else (3 + 1 / p) * n
    w = layer_spec.wire_bytes
    for device, extra in (
        ("cpu-numba", (block_codec_ratio(w) - 1) * passes_n * (4 + w)),
        ("a100", passes_n / 32),
    ):
        d = replace(c, codec_fits={}, device=get_device(device))
        lay = bucket_breakdown(n, layers, layer_spec, d, strategy, None)
        blk = bucket_breakdown(n, layers, block_spec, d, strategy, None, n_blocks=n // 32)
        assert blk.codec_s - lay.codec_s == pytest.approx(extra / d.device.mem_bw)


# --- DDP bucketing and step timeline -------------------------------------------------


def test_first_bucket_cap_matches_torch() -> None:
    assert DEFAULT_FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES


def test_bucket_assignment_matches_torch_reducer() -> None:
    sizes = [9408, 64, 64, 4096, 2**20, 2**21, 300_000, 2**22, 10, 2**23, 7_000_000, 2**18]
    ours = assign_buckets(sizes, bucket_cap_mb=25)
    order = list(reversed(range(len(sizes))))
    tensors = [torch.empty(sizes[i]) for i in order]
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20]
    theirs, _ = dist._compute_bucket_assignment_by_size(
        tensors, limits, [False] * len(sizes), order
    )
    assert [tuple(b) for b in theirs] == ours
    assert len(ours) > 2  # the case exercises the first-bucket cap and the 25 MiB cap


def test_step_timeline_hand_computed() -> None:
    # Two equal tensors of 1 MiB elements (4 MiB each): each closes its own bucket.
    model = ModelSpec("toy", (C_T("a", 2**20), C_T("b", 2**20)))
    cluster = custom_cluster(4 * 2**20 / 0.5, 0.0, nodes=2)  # ring: 2*n*(1/2)*beta = 0.5 s
    comp = ComputeTime(0.1, 0.8, 0.05)
    s = simulate_step(model, cluster, get_format("fp32"), comp)
    # b ready at 0.4 (half the weight), done 0.9; a ready at 0.8, starts 0.9, done 1.4.
    # (The preset device's reduction gamma adds ~1e-6 s per bucket.)
    assert [b.ready_s for b in s.buckets] == pytest.approx([0.4, 0.8])
    assert [b.done_s for b in s.buckets] == pytest.approx([0.9, 1.4], rel=1e-5)
    assert s.comm_s == pytest.approx(1.0, rel=1e-5)
    assert s.exposed_comm_s == pytest.approx(0.6, rel=1e-5)
    assert s.step_s == pytest.approx(0.1 + 1.4 + 0.05, rel=1e-5)


def C_T(name: str, n: int):
    from aps_perfmodel.models import TensorSpec

    return TensorSpec(name, n)


# --- models, compute, units --------------------------------------------------------


@pytest.mark.parametrize(
    "name,published,tol",
    [
        ("resnet50", 25.557032e6, 1e-9),
        ("vit-b16", 86.567656e6, 1e-9),
        ("bert-large", 3.4e8, 0.025),
        ("gpt2-xl", 1.558e9, 0.01),
        ("llama-7b", 6.74e9, 0.01),
    ],
)
def test_model_presets_match_published_totals(name: str, published: float, tol: float) -> None:
    m = get_model(name)
    assert m.total_params == pytest.approx(published, rel=tol)
    assert m.source and m.forward_flops_per_sample > 0


def test_model_from_module_and_params() -> None:
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)
    )
    spec = ModelSpec.from_module(net, torch.zeros(1, 3, 8, 8))
    assert spec.total_params == sum(p.numel() for p in net.parameters())
    assert [t.name for t in spec.tensors] == [n for n, _ in net.named_parameters()]
    assert spec.tensors[0].flops == 2 * 8 * 6 * 6 * 3 * 9
    assert spec.tensors[2].flops == 2 * 288 * 10
    p = get_model("25.6M")
    assert p.total_params == 25_600_000 and p.num_tensors == 25
    with pytest.raises(ValueError, match="unknown model"):
        get_model("resnet5000")


def test_compute_estimate_hand_value() -> None:
    from aps_perfmodel import get_device

    m, d = get_model("resnet50"), get_device("v100")
    c = ComputeTime.estimate(m, d, 32, dtype="fp32", mfu=0.5, optimizer="sgd")
    fwd = 32 * m.forward_flops_per_sample / (15.7e12 * 0.5)
    assert c.forward_s == pytest.approx(fwd)
    assert c.backward_s == pytest.approx(2 * fwd)
    assert c.optimizer_s == pytest.approx(m.total_params * 12 / 0.9e12)


def test_units() -> None:
    assert parse_bandwidth("100Gbit") == 12.5e9
    assert parse_bandwidth(["8", "400Gbps"][1]) == 50e9
    assert parse_bandwidth("25GB/s") == 25e9
    assert parse_time("10us") == 1e-5
    assert parse_count("25.6M") == 25_600_000
    assert parse_bytes("1MiB") == 2**20
    with pytest.raises(ValueError):
        parse_bandwidth("fast")
    # Strings carry a unit (numbers are bytes/s and seconds); only durations may be 0.
    assert parse_bandwidth(12.5e9) == 12.5e9 and parse_time("0") == 0.0 and parse_time(0) == 0
    assert parse_bytes("4096") == 4096.0  # sizes document bytes as the default unit
    for parse, text, message in (
        (parse_bandwidth, "10", "bandwidth '10' has no unit"),
        (parse_bandwidth, "0Gbit", "bandwidth must be positive, got '0Gbit'"),
        (parse_bandwidth, "-10Gbit", "bandwidth must be positive, got '-10Gbit'"),
        (parse_bandwidth, "10Qbit", "unknown bandwidth unit 'Qbit' in '10Qbit'"),
        (parse_bandwidth, "1e999Gbit", "bandwidth '1e999Gbit' is not a finite number"),
        (parse_time, "20", "time '20' has no unit"),
        (parse_time, "-20us", "time must be zero or more, got '-20us'"),
        (parse_count, "-25.6M", "count must be positive, got '-25.6M'"),
        (parse_count, "0.2", "count must be positive, got '0.2' (rounds to 0)"),
        (parse_bytes, "0KiB", "size must be positive, got '0KiB'"),
    ):
        with pytest.raises(ValueError) as caught:
            parse(text)
        assert message in str(caught.value), (text, str(caught.value))
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        custom_cluster(0.0, 1e-5, nodes=2)  # no ZeroDivisionError from the API either


# --- literature -------------------------------------------------------------------


def test_reproduces_pytorch_ddp_benchmark_within_15_percent() -> None:
    rows = reproduce_pytorch_ddp_benchmark()
    assert len(rows) == 10
    for r in rows:
        assert abs(r.rel_err) <= 0.15, r
    # Multi-GPU runs communicate; the single-GPU run does not.
    assert all((r.comm_s > 0) == (r.gpus > 1) for r in rows)
    assert math.isclose(rows[0].published_s, 0.100)
