"""Chunk pipelining of a bucket and calibrated per-collective fits (exchange, burst, call overhead,
shared cores).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from aps_perfmodel import (
    bucket_comm,
    get_cluster,
    get_format,
)
from aps_perfmodel import collectives as C


def test_aps_chunk_pipelining_overlaps_codec_and_wire() -> None:
    c = get_cluster("1gbe", world_size=4)
    fmt = get_format("e4m3")
    n, chunk = 2**24, 2**20
    one = bucket_comm(n, 16, fmt, c, None)
    piped = bucket_comm(n, 16, fmt, c, chunk)
    assert one.chunks == 1 and one.overlap_s == 0.0 and piped.chunks == 16
    # Per chunk: its own codec launches and collective latencies.
    per = bucket_comm(chunk, 16, fmt, c, None)
    codec, wire = (
        16 * (per.codec_s - c.codec_time("amax", "e4m3", 1.0, chunk)),
        16 * per.collective_s,
    )
    assert piped.collective_s == pytest.approx(wire)
    head = c.codec_time("amax", "e4m3", 1.0, n)
    expect = head + piped.maxima_s + max(codec, wire) + min(codec, wire) / 16
    assert piped.total_s == pytest.approx(expect)
    assert piped.overlap_s == pytest.approx(min(codec, wire) * 15 / 16) and piped.overlap_s > 0
    # torch's FP16 hook is one piece: chunking does not apply.
    fp16 = get_format("fp16")
    assert bucket_comm(n, 16, fp16, c, chunk) == bucket_comm(n, 16, fp16, c, None)


def _fitted_cluster(
    world: int,
    cores_per_rank: float | None = None,
    codec: dict | None = None,
    **collectives: C.LinkParams,
) -> object:
    """A flat 1 Gbit/s cluster carrying the given collective and codec fits."""

    c = get_cluster("1gbe", world_size=world)
    return replace(
        c, collective_fits=collectives, codec_fits=codec or {}, cores_per_rank=cores_per_rank
    )


def test_exchange_fit_one_latency_and_burst_per_call() -> None:
    from aps_perfmodel.calibrate import fit_profile

    # Synthetic pipelined exchanges: one latency and one burst per call.
    p, alpha, beta, burst = 2, 3e-3, 8e-9, 5e5
    samples = []
    for n in (2**18, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20):
        wire = max(0.0, 2 * n * (p - 1) / p - burst)
        samples.append({"op": "exchange", "n": n, "seconds": alpha + beta * wire})
    fit = fit_profile(samples, p, burst_bytes=burst).collectives["exchange"]
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.beta == pytest.approx(beta, rel=1e-6)
    # The model charges the same for 16 chunks of 1 MiB (e4m3: 1 byte per element).
    c = _fitted_cluster(p, exchange=fit)
    aps = bucket_comm(16 * 2**20, 4, get_format("e4m3"), c)
    assert aps.collective_s == pytest.approx(alpha + beta * (2 * 16 * 2**20 * (p - 1) / p - burst))


def test_composed_exchange_credits_burst_once() -> None:
    # Without an exchange fit: all-to-all + all-gather per chunk, burst credited
    # once for the whole back-to-back run, not once per chunk.
    p, link = 2, C.LinkParams(alpha=1e-4, beta=1e-8, burst_bytes=4e5)
    c = _fitted_cluster(p, all_to_all=link, all_gather=link)
    aps = bucket_comm(8 * 2**20, 4, get_format("e4m3"), c, chunk_elements=2**20)
    chunk = 2**20 * (p - 1) / p
    expect = 8 * 2 * (link.alpha + link.beta * chunk) - link.beta * link.burst_bytes
    assert aps.collective_s == pytest.approx(expect)


def test_automatic_chunks_follow_the_hook_rule() -> None:
    # "auto" (the default) cuts the bucket as the hook would: chunk_elements with
    # the unchunked exchange W, N peers, the cluster's link and its per-chunk cost.
    from aps_perfmodel.strategies import chunk_elements, strategy_chunk

    p, link = 2, C.LinkParams(alpha=1e-4, beta=1e-8)
    c = replace(_fitted_cluster(p, all_to_all=link, all_gather=link), chunk_overhead_s=8e-4)
    n = 8 * 2**20
    whole = bucket_comm(n, 4, get_format("e4m3"), c, chunk_elements=None)
    auto = bucket_comm(n, 4, get_format("e4m3"), c)
    chunk = chunk_elements(n, 1.0, p, link, 8e-4, whole.collective_s)
    assert chunk == strategy_chunk(n, "e4m3", c, "two_phase")
    # W = 2 * (1e-4 + 4 MiB * 1e-8) = 84 ms: k = sqrt(84 / 0.8) = 10.3, 2**23 / 10.3 -> 2**20;
    # 4 alphas of this link are 40 kB per peer, 2 peers: 2**17 elements, the smaller.
    assert chunk == 2**20
    assert auto.chunks == n // chunk == 8
    assert auto == bucket_comm(n, 4, get_format("e4m3"), c, chunk_elements=chunk)


def test_call_overhead_and_shared_cores() -> None:
    from aps_perfmodel.calibrate import CALL_ELEMENTS
    from aps_perfmodel.cluster import OpCost

    fmt, n = get_format("e4m3"), 8 * 2**20
    link = C.LinkParams(alpha=1e-4, beta=1e-8)
    base = _fitted_cluster(2, exchange=link)
    plain = bucket_comm(n, 16, fmt, base)
    assert plain.overhead_s == 0.0 and plain.overlap_s > 0
    tiny = bucket_comm(CALL_ELEMENTS, 16, fmt, base).total_s
    # The hook's measured whole call of a tiny bucket replaces the parts' fixed
    # cost, slower (+5 ms) or faster (-0.1 ms: the parts overcount the latency).
    for delta in (5e-3, -1e-4):
        call = {"hook_call.e4m3": OpCost(launch_s=tiny + delta, s_per_elem=0.0)}
        timed = _fitted_cluster(2, codec=call, exchange=link)
        got = bucket_comm(n, 16, fmt, timed)
        assert got.overhead_s == pytest.approx(delta)
        assert got.total_s == pytest.approx(plain.total_s + delta)
        assert bucket_comm(CALL_ELEMENTS, 16, fmt, timed).total_s == pytest.approx(tiny + delta)
        # Another strategy through the same APS hook pays the same hook cost on
        # top of its own parts; torch's cast hook (aps=False) is another hook.
        other = get_format("e4m3", strategy="allreduce")
        assert bucket_comm(n, 16, other, timed).overhead_s == pytest.approx(delta)
        assert bucket_comm(n, 16, other, timed).total_s == pytest.approx(
            bucket_comm(n, 16, other, base).total_s + delta
        )
        cast = replace(other, aps=False)
        assert bucket_comm(n, 16, cast, timed) == bucket_comm(n, 16, cast, base)
    # A call timed far below its parts (a noisy calibration on a busy machine): a
    # bucket smaller than the timed one still costs at least the call, never < 0.
    call = {"hook_call.e4m3": OpCost(launch_s=1e-6, s_per_elem=0.0)}
    noisy = _fitted_cluster(2, codec=call, exchange=link)
    assert bucket_comm(64, 16, fmt, noisy).total_s == pytest.approx(1e-6)
    assert bucket_comm(n, 16, fmt, noisy).total_s > 1e-6
    # The torch hooks' calls too: FP32 all-reduce, 4 ms call against its parts.
    fp32 = get_format("fp32")
    parts = bucket_comm(CALL_ELEMENTS, 16, fp32, base).total_s
    timed = _fitted_cluster(2, codec={"hook_call.fp32": OpCost(4e-3, 0.0)}, exchange=link)
    assert bucket_comm(n, 16, fp32, timed).total_s == pytest.approx(
        bucket_comm(n, 16, fp32, base).total_s + 4e-3 - parts
    )
    # Ranks sharing cores: codec and wire no longer overlap.
    shared = bucket_comm(n, 16, fmt, _fitted_cluster(2, 0.5, exchange=link))
    assert shared.overlap_s == 0.0
    assert shared.total_s == pytest.approx(plain.total_s + plain.overlap_s)
    own = bucket_comm(n, 16, fmt, _fitted_cluster(2, 1.0, exchange=link))
    assert own.total_s == pytest.approx(plain.total_s)
