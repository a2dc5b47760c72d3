"""The codec's device backends ("cast", "bits") forced on CPU tensors, bit for bit
against the numba kernels: every format, scales per segment, odd offsets and sizes,
specials; the owner's reduction, the shard mean and the per-segment maxima."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from numba.core import event as nbevent
from torch.utils._python_dispatch import TorchDispatchMode

from aps_comm import codec, cpu_kernels
from aps_comm import formats as F
from aps_comm.formats import FloatFormat, code_table, get_format, payload_nbytes
from aps_comm.hostcopy import to_device

# Every built-in format, the 9-16-bit customs, fn/none specials, packed 4-bit ones.
FORMATS = [
    *F.FORMATS.values(),
    get_format("e5m3"),
    get_format("e4m4"),
    get_format("e6m9"),
    FloatFormat(5, 3, specials="fn", name="e5m3fn"),
    FloatFormat(6, 9, specials="fn", name="e6m9fn"),
    FloatFormat(4, 4, specials="none", name="e4m4none"),
    FloatFormat(3, 3, specials="fn", bias=5, name="e3m3fn-b5"),
    FloatFormat(2, 2, specials="none", name="e2m2none"),
    FloatFormat(1, 2, specials="none", name="e1m2none"),  # 4 bits, packed
    FloatFormat(2, 0, specials="none", name="e2m0none"),  # 3 bits, packed
]
CASES = [
    (fmt, backend)
    for fmt in FORMATS
    for backend in ("cast", "bits")
    if backend == "bits" or fmt.torch_dtype is not None
]
IDS = [f"{fmt.name}-{backend}" for fmt, backend in CASES]
# Segments: empty ones, a single element, odd sizes; the rest takes what is left.
SIZES = [0, 1, 7, 0, 300, 2]
# Powers of two (APS), a subnormal float32 factor, one that overflows, one no power of two.
SCALES = [8.0, 2.0**-140, 0.5, 2.0**100, 3.0, 2.0**-20, 1.0]


def _reference(fmt: FloatFormat) -> str:
    """The backend the others are compared with: the kernels, or the cast for fp32."""
    return "kernels" if cpu_kernels.supports(fmt) else "cast"


def _values(fmt: FloatFormat) -> torch.Tensor:
    """The format's values, the ties between them and their neighbours, random
    magnitudes over its range and beyond, subnormals, zeros, inf and NaN."""
    if fmt.wire_bits == 32:  # fp32: no table; its extremes and subnormals
        vals = np.array([1.0, 1.5, 2.0**-149, 2.0**-126, 3.0 * 2.0**-130, fmt.max], np.float32)
        vals = np.unique(np.concatenate([-vals, vals]))
    else:
        table = code_table(fmt)
        vals = np.unique(table[np.isfinite(table)])
    if vals.size > 6000:  # 16-bit formats: a spread of their values
        vals = np.unique(np.concatenate([vals[::37], vals[:200], vals[-200:]]))
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
    near = [np.nextafter(mids, np.float32(v)) for v in (np.inf, -np.inf)]
    rng = np.random.default_rng(fmt.bits)
    rand = rng.standard_normal(2000) * 2.0 ** rng.integers(-60, 60, 2000) * min(fmt.max, 1e30)
    edges = [fmt.max, -fmt.max, 2 * min(fmt.max, 1e38), fmt.min_subnormal / 2, 3e38, -3.4e38]
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan]
    with np.errstate(over="ignore"):  # beyond float32 is inf: wanted
        x = np.concatenate([vals, mids, *near, rand, edges, specials]).astype(np.float32)
    return torch.from_numpy(rng.permutation(x))


def _layout(numel: int) -> tuple[codec.Layout, torch.Tensor]:
    assert numel >= sum(SIZES)
    sizes = [*SIZES, numel - sum(SIZES)]
    return codec.Layout.from_numels(sizes, torch.device("cpu")), torch.tensor(SCALES)


def _canonical(x: torch.Tensor) -> torch.Tensor:
    """int32 bits with every NaN the same NaN (backends may differ in a NaN's sign)."""
    return torch.where(x.isnan(), float("nan"), x).view(torch.int32)


def _same_codes(a: torch.Tensor, b: torch.Tensor, fmt: FloatFormat, numel: int) -> bool:
    """Equal codes up to the sign of NaN codes: every other value has exactly one code."""
    return torch.equal(_canonical(F.decode(a, fmt, numel)), _canonical(F.decode(b, fmt, numel)))


@pytest.mark.parametrize(("fmt", "backend"), CASES, ids=IDS)
def test_encode_matches_kernels(fmt: FloatFormat, backend: str) -> None:
    x = _values(fmt)
    layout, scale = _layout(x.numel())
    ref = codec.encode(x, fmt, scale=scale, layout=layout, backend=_reference(fmt))
    got = codec.encode(x, fmt, scale=scale, layout=layout, backend=backend)
    assert _same_codes(got, ref, fmt, x.numel())
    # Finite values in range give exactly the same bytes, NaN codes included.
    finite = x[x.abs() <= fmt.max]
    finite = finite[: finite.numel() - 1 + finite.numel() % 2]  # odd: a half-filled 4-bit byte
    assert finite.numel() % 2 == 1
    ref = codec.encode(finite, fmt, backend=_reference(fmt))
    assert torch.equal(codec.encode(finite, fmt, backend=backend), ref)
    if fmt.torch_dtype is not None:
        assert torch.equal(ref.view(fmt.torch_dtype).float(), F.quantize(finite, fmt))


def _every_code(fmt: FloatFormat) -> torch.Tensor:
    """A payload holding every bit pattern of a wire element (bits above the format's too)."""
    if fmt.wire_bits == 16:
        return torch.arange(2**16, dtype=torch.int32).view(torch.uint8)[torch.arange(2**18) % 4 < 2]
    if fmt.wire_bits == 32:
        return _values(fmt).view(torch.uint8)
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3)


@pytest.mark.parametrize(("fmt", "backend"), CASES, ids=IDS)
def test_decode_matches_kernels(fmt: FloatFormat, backend: str) -> None:
    payload = _every_code(fmt)
    numel = payload.numel() * 8 // fmt.wire_bits - (fmt.wire_bits == 4)  # odd 4-bit count
    layout, scale = _layout(numel)
    ref = codec.decode(payload, fmt, numel, scale=scale, layout=layout, backend=_reference(fmt))
    got = codec.decode(payload, fmt, numel, scale=scale, layout=layout, backend=backend)
    assert torch.equal(_canonical(got), _canonical(ref))
    plain = codec.decode(payload, fmt, numel, backend=backend)
    assert torch.equal(_canonical(plain), _canonical(F.decode(payload, fmt, numel)))


OFFSET_CASES = [
    (fmt, backend)
    for fmt in (F.FP16, F.BF16, F.FP32, F.E4M3, F.E2M1, get_format("e5m3"))
    for backend in ("kernels", "cast", "bits")
    if (backend != "cast" or fmt.torch_dtype is not None)
    and (backend != "kernels" or cpu_kernels.supports(fmt))
]


@pytest.mark.parametrize(
    ("fmt", "backend"), OFFSET_CASES, ids=[f"{f.name}-{b}" for f, b in OFFSET_CASES]
)
def test_any_byte_offset(fmt: FloatFormat, backend: str) -> None:
    # A bucket mixing formats packs a 2- or 4-byte format at any byte
    # (fp16 after 7 bytes of e4m3); views to the dtype need alignment there.
    x = _values(fmt)[:401]
    layout, scale = _layout(x.numel())
    need = payload_nbytes(x.numel(), fmt)
    aligned = codec.encode(x, fmt, scale=scale, layout=layout, backend=backend)
    values = codec.decode(aligned, fmt, x.numel(), scale=scale, layout=layout, backend=backend)
    for offset in (1, 2, 3):
        buf = torch.full((need + offset + 5,), 0xA5, dtype=torch.uint8)
        out = buf[offset : offset + need]
        codec.encode(x, fmt, out=out, scale=scale, layout=layout, backend=backend)
        assert torch.equal(out, aligned), offset
        assert torch.all(buf[:offset] == 0xA5) and torch.all(buf[offset + need :] == 0xA5)
        back = codec.decode(
            buf[offset:], fmt, x.numel(), scale=scale, layout=layout, backend=backend
        )
        assert torch.equal(_canonical(back), _canonical(values)), offset
        # The owner's reduction of shards that start at an odd byte.
        recv = buf[offset : offset + need]
        if fmt.wire_bits == 4 or x.numel() % 2 == 0:
            reduced = codec.owner_reduce(recv, fmt, 1, backend=backend)
            assert _same_codes(reduced, aligned, fmt, x.numel())


def _shards(fmt: FloatFormat, n_ranks: int, shard: int) -> torch.Tensor:
    """N encoded shards of ``shard`` elements: values near the top (sums overflow), tiny
    ones, and the specials the format holds."""
    gen = torch.Generator().manual_seed(n_ranks * 97 + fmt.bits)
    parts = []
    for _ in range(n_ranks):
        x = torch.randn(shard, generator=gen) * min(fmt.max, 1e30) / 3
        x[:: max(shard // 5, 1)] *= 2.0**-40
        if fmt.has_nan:
            x[3], x[5] = float("inf"), float("nan")
        parts.append(F.encode(x.clamp(-fmt.max, fmt.max) if not fmt.has_nan else x, fmt))
    return torch.cat(parts)


@pytest.mark.parametrize(("fmt", "backend"), CASES, ids=IDS)
@pytest.mark.parametrize("n_ranks", [1, 3, 6])
def test_owner_reduce_and_shard_mean_match_kernels(
    fmt: FloatFormat, backend: str, n_ranks: int
) -> None:
    shard = 101  # odd: the 4-bit shards end in a half byte
    recv = _shards(fmt, n_ranks, shard)
    ref = _reference(fmt)
    got = codec.owner_reduce(recv, fmt, n_ranks, backend=backend)
    expected = codec.owner_reduce(recv, fmt, n_ranks, backend=ref)
    numel = payload_nbytes(shard, fmt) * 8 // fmt.wire_bits
    assert _same_codes(got, expected, fmt, numel)
    # The float32 mean: decoded, summed rank after rank, divided by N.
    mean = codec.shard_mean(recv, fmt, n_ranks, backend=backend)
    assert torch.equal(
        _canonical(mean), _canonical(codec.shard_mean(recv, fmt, n_ranks, backend=ref))
    )
    nbytes = recv.numel() // n_ranks
    acc = F.decode(recv[:nbytes], fmt, numel)
    for r in range(1, n_ranks):
        acc = acc + F.decode(recv[r * nbytes : (r + 1) * nbytes], fmt, numel)
    assert torch.equal(_canonical(mean), _canonical(acc / n_ranks))
    summed = codec.shard_mean(recv, fmt, n_ranks, divisor=1, backend=backend)
    assert torch.equal(_canonical(summed), _canonical(acc))


class _CountOps(TorchDispatchMode):
    """Counts the operators that compute (views are free)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("fmt", "backend"), [(F.E4M3, "cast"), (get_format("e5m3"), "bits")])
def test_shard_mean_decodes_all_ranks_at_once(fmt: FloatFormat, backend: str) -> None:
    # Each extra rank costs one add, not another decode.
    counts = {}
    for n_ranks in (2, 6):
        recv = _shards(fmt, n_ranks, 64)
        with _CountOps() as mode:
            codec.shard_mean(recv, fmt, n_ranks, backend=backend)
        counts[n_ranks] = mode.ops
    assert counts[6] - counts[2] == 4, counts


def test_segment_amax_blocked_matches_per_layer() -> None:
    gen = torch.Generator().manual_seed(3)
    block = codec.AMAX_BLOCK
    sizes = [0, 1, block, block + 1, 3 * block + 17, 0, 5, 2 * block]
    x = torch.randn(sum(sizes), generator=gen) * 10
    offsets = np.cumsum([0, *sizes])
    x[offsets[3] + block] = -1e30  # the last element of a segment, alone in its block
    x[offsets[4] + 2 * block + 3] = float("nan")  # NaN in a middle block: inf
    x[offsets[7]] = float("-inf")
    x[offsets[6] : offsets[7]] = -0.0
    layout = codec.Layout.from_numels(sizes, x.device)
    blocked = codec.segment_amax(x, layout, blocked=True)
    per_layer = codec.segment_amax(x, layout, blocked=False)
    assert torch.equal(blocked, per_layer)
    inf = float("inf")
    expected = [
        0.0 if not n else x[a : a + n].abs().nan_to_num(inf, inf).max().item()
        for a, n in zip(offsets[:-1], sizes, strict=True)
    ]
    assert blocked.tolist() == expected
    assert blocked[4] == inf and blocked[7] == inf and blocked[3] == 1e30 and blocked[6] == 0
    # Every block but each segment's last holds AMAX_BLOCK elements.
    lengths, segment = layout.blocks
    assert lengths.sum() == x.numel() and lengths.max() == block
    assert torch.equal(
        torch.bincount(segment, minlength=len(sizes)), torch.tensor([-(-n // block) for n in sizes])
    )
    with pytest.raises(ValueError, match="-3"):
        codec.Layout.from_numels([2, -3], x.device)
    empty = codec.Layout.from_numels([0, 0], x.device)
    assert torch.equal(codec.segment_amax(x[:0], empty, blocked=True), torch.zeros(2))


def test_layout_on_a_device_holds_its_blocks() -> None:
    layout = codec.Layout.from_numels([5000, 3], torch.device("meta"))
    assert "blocks" in vars(layout)  # built with the layout, not at the first step
    assert layout.blocks[0].device.type == "meta" and layout.blocks[0].shape == (3,)
    assert to_device(torch.arange(3), "cpu").device.type == "cpu"


def test_codec_resolves_once() -> None:
    cpu = torch.device("cpu")
    c = codec.Codec("e5m3", cpu)
    assert c.fmt == get_format("e5m3") and c.backend == "kernels"
    assert codec.Codec("e5m3", cpu, backend="bits").backend == "bits"
    assert codec.codec_for("e4m3", cpu) is codec.codec_for("e4m3", cpu)
    assert codec.Codec("e4m3", torch.device("meta")).backend == "cast"
    assert codec.Codec("e5m3", torch.device("meta")).backend == "bits"
    with pytest.raises(ValueError, match="torch dtype, got e5m3"):
        codec.Codec("e5m3", cpu, backend="cast")
    with pytest.raises(ValueError, match="e8m10 has 19 bits"):
        codec.Codec("e8m10", cpu)
    with pytest.raises(ValueError, match="backend must be one of"):
        codec.Codec("e4m3", cpu, backend="numba")
    x = torch.tensor([1.0, -2.5, 3e-3, 100.0])
    bits = codec.Codec("e5m3", cpu, backend="bits")
    payload = bits.encode(x)
    assert torch.equal(payload, c.encode(x))
    assert bits.decode(payload, 4).tolist() == [1.0, -2.5, 0.0029296875, 96.0]


def test_kernels_are_cached_on_disk() -> None:
    kernels = [
        v for v in vars(cpu_kernels).values() if isinstance(v, numba.core.dispatcher.Dispatcher)
    ]
    assert len(kernels) > 20
    for k in kernels:
        assert isinstance(k._cache, numba.core.caching.FunctionCache), k.py_func.__name__


# One process of several started at once on a cold cache: meet, then call one kernel.
_COMPILE_ONE = """
import os, sys, time
import numpy as np
from aps_comm import cpu_kernels
ready = os.path.join(os.environ["NUMBA_CACHE_DIR"], "ready-" + sys.argv[1])
open(ready, "w").close()
while len([n for n in os.listdir(os.environ["NUMBA_CACHE_DIR"]) if n.startswith("ready-")]) < 2:
    time.sleep(0.01)
out = np.empty(3, np.float32)
cpu_kernels.mean_rows(np.arange(6, dtype=np.float32).reshape(2, 3), out)
print(sum(cpu_kernels._mean_rows._cache_misses.values()), *out.tolist())
"""


def test_processes_on_a_cold_cache_compile_a_kernel_once(tmp_path: Path) -> None:
    # Both ask for the kernel at the same moment; without the lock both compile it.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _COMPILE_ONE, str(i)], env=env, stdout=subprocess.PIPE, text=True
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=240)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(int(o[0]) for o in outs) == [0, 1], outs  # one compiled, one loaded
    assert all(o[1:] == ["1.5", "2.5", "3.5"] for o in outs), outs


def test_a_failed_compile_lets_the_others_compile() -> None:
    kernel = cpu_kernels._mean_rows
    with pytest.raises(numba.core.errors.TypingError):
        kernel("not an array", 3)
    assert kernel._cache._held is None  # its lock is free again


def test_compile_notice_said_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_kernels.COMPILE_NOTICE, "said", False)
    ours = next(
        v for v in vars(cpu_kernels).values() if isinstance(v, numba.core.dispatcher.Dispatcher)
    )
    theirs = numba.njit(lambda a: a)
    caplog.set_level(logging.INFO, logger="aps_comm.cpu_kernels")
    for dispatcher in (theirs, ours, ours):
        with nbevent.trigger_event("numba:compile", data={"dispatcher": dispatcher}):
            pass
    records = [r for r in caplog.records if r.name == "aps_comm.cpu_kernels"]
    assert len(records) == 1 and "compiling the CPU codec kernels" in records[0].getMessage()
    assert cpu_kernels.COMPILE_NOTICE.said


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"LOCAL_RANK": "0", "RANK": "2"}, True),  # the second machine's first rank
        ({"LOCAL_RANK": "1", "RANK": "1"}, False),
        ({"RANK": "3"}, False),  # launched without LOCAL_RANK
        ({}, True),  # not a job's rank: a script of its own
    ],
)
def test_compile_notice_once_per_machine_of_a_job(
    env: dict[str, str],
    says: bool,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_kernels.COMPILE_NOTICE, "said", False)
    for key in ("LOCAL_RANK", "RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ours = next(
        v for v in vars(cpu_kernels).values() if isinstance(v, numba.core.dispatcher.Dispatcher)
    )
    caplog.set_level(logging.INFO, logger="aps_comm.cpu_kernels")
    for _ in range(2):
        with nbevent.trigger_event("numba:compile", data={"dispatcher": ours}):
            pass
    records = [r for r in caplog.records if r.name == "aps_comm.cpu_kernels"]
    assert len(records) == int(says), [r.getMessage() for r in records]
    # The other ranks compiled too: they only keep quiet about it.
    assert cpu_kernels.COMPILE_NOTICE.said
