"""Codec speed: encode + decode of a 64 MiB float32 buffer against a plain copy.

:mod:`aps_comm.codec` as the hook calls it: preallocated buffers, without
scales, with per-layer scales and with block scales (one per
``--block-size`` elements of every layer), on one CPU thread or on a CUDA
device (where every timing synchronises the device). Medians of repeats,
every ratio measured in the same run as the copy it is divided by.

Also two_phase's shard owner with block scaling: the buffer's codes as 4
ranks' shards of a quarter each, averaged and re-encoded with each block's
own exponent (:func:`aps_comm.codec.owner_reduce_blocks`), beside the chain
of calls it fuses (shard mean, block maxima, exponents, scaled encode), and
the same step where every rank encoded with its own block exponents
(:meth:`aps_comm.codec.Codec.owner_reduce_rank_blocks`, the hook's default
``block_exponents="rank"``): each shard decoded with its sender's.

    python -m benchmarks.codec [--mib 64] [--repeats 9] [--formats e4m3,e5m2]
                               [--block-size 32] [--device cuda] [--json PATH]

On CPU both sides run on one thread: ``torch.set_num_threads(1)`` for the
copy, and the numba kernels are serial.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from aps_comm import codec
from aps_comm.formats import FORMATS, FloatFormat, payload_nbytes, pow2
from aps_comm.scaling import blocks_amax, mean_exponents

__all__ = ["main", "run"]


OWNER_RANKS = 4
"""Shards the owner step averages (each a quarter of the buffer)."""


def _owner_chain(
    recv: torch.Tensor,
    fmt: FloatFormat,
    layout: codec.Layout,
    exps: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The owner's step as calls one after another (what owner_reduce_blocks fuses)."""
    mean = codec.shard_mean(recv, fmt, OWNER_RANKS)
    d = mean_exponents(blocks_amax(mean, layout), exps, fmt)
    codec.encode(mean, fmt, out=out, scale=pow2(d), layout=layout)


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def seconds(fn: Callable[[], object]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    return seconds


def run(
    mib: int = 64,
    repeats: int = 9,
    formats: tuple[str, ...] = (),
    device: str = "cpu",
    block_size: int = 32,
) -> dict:
    """Measure every format's codec against ``copy_``; return a JSON-able dict.

    Each repeat times the copy, the encode and the decode back to back, and
    the ratios are medians of the per-repeat ratios: a slow spell of the
    machine then slows both sides of a ratio, not one.
    """
    dev = torch.device(device)
    torch.set_num_threads(1)
    n = mib * 2**20 // 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen).to(dev)
    y = torch.empty_like(x)
    # APS scales each layer by its own power of two: 100 layers of equal size.
    sizes = [n // 100] * 99 + [n - 99 * (n // 100)]
    layout = codec.Layout.from_numels(sizes, dev)
    scale = torch.full((100,), 4.0, device=dev)
    blocks = layout.grid(block_size)  # plan time, as the hook builds it once per bucket
    block_scale = torch.full((blocks.n_blocks,), 4.0, device=dev)
    # The owner of one of OWNER_RANKS shards, each a quarter of the buffer, of whole blocks.
    shard = codec.Layout.from_numels([n // OWNER_RANKS], dev).grid(block_size).layout
    shard_exps = torch.full((shard.n_segments,), 2, dtype=torch.int32, device=dev)
    # Each sender's own 2**-e per block: ranks differ by powers of two.
    rank_scales = torch.stack(
        [torch.full((shard.n_segments,), 2.0**-r, device=dev) for r in range(OWNER_RANKS)]
    )
    seconds = _timer(dev)
    copies: list[float] = []
    rows = []
    for name in formats or ("e4m3", "e5m2", "fp16", "bf16", "e3m2", "e2m1"):
        fmt = FORMATS[name]
        p = torch.empty(payload_nbytes(n, fmt), dtype=torch.uint8, device=dev)
        recv = codec.encode(x, fmt, scale=block_scale, layout=blocks.layout)
        q = torch.empty(payload_nbytes(shard.numel, fmt), dtype=torch.uint8, device=dev)
        steps = {
            "copy": lambda: y.copy_(x),
            "encode": lambda f=fmt, p=p: codec.encode(x, f, out=p),
            "decode": lambda f=fmt, p=p: codec.decode(p, f, n, out=y),
            "scaled_encode": lambda f=fmt, p=p: codec.encode(
                x, f, out=p, scale=scale, layout=layout
            ),
            "scaled_decode": lambda f=fmt, p=p: codec.decode(
                p, f, n, out=y, scale=scale, layout=layout
            ),
            "block_encode": lambda f=fmt, p=p: codec.encode(
                x, f, out=p, scale=block_scale, layout=blocks.layout
            ),
            "block_decode": lambda f=fmt, p=p: codec.decode(
                p, f, n, out=y, scale=block_scale, layout=blocks.layout
            ),
            "owner_block": lambda f=fmt, r=recv, q=q: codec.owner_reduce_blocks(
                r, f, OWNER_RANKS, shard, shard_exps, out=q
            ),
            "owner_block_chain": lambda f=fmt, r=recv, q=q: _owner_chain(
                r, f, shard, shard_exps, q
            ),
            "owner_rank_block": lambda f=fmt, r=recv, q=q: codec.codec_for(
                f, dev
            ).owner_reduce_rank_blocks(r, OWNER_RANKS, shard, rank_scales, out=q),
        }
        for fn in steps.values():
            fn()  # warm-up: compilation, page faults
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(repeats):
            for k, fn in steps.items():
                times[k].append(seconds(fn))
        copies += times["copy"]
        ratio = [
            (e + d) / c
            for e, d, c in zip(times["encode"], times["decode"], times["copy"], strict=True)
        ]
        scaled = [
            (e + d) / c
            for e, d, c in zip(
                times["scaled_encode"], times["scaled_decode"], times["copy"], strict=True
            )
        ]
        block = [
            (e + d) / c
            for e, d, c in zip(
                times["block_encode"], times["block_decode"], times["copy"], strict=True
            )
        ]
        rows.append(
            {
                "format": name,
                "backend": codec.backend_for(fmt, dev),
                "encode_s": statistics.median(times["encode"]),
                "decode_s": statistics.median(times["decode"]),
                "scaled_encode_s": statistics.median(times["scaled_encode"]),
                "scaled_decode_s": statistics.median(times["scaled_decode"]),
                "encode_decode_over_copy": statistics.median(ratio),
                "scaled_encode_decode_over_copy": statistics.median(scaled),
                "block_encode_s": statistics.median(times["block_encode"]),
                "block_decode_s": statistics.median(times["block_decode"]),
                "block_encode_decode_over_copy": statistics.median(block),
                "owner_block_s": statistics.median(times["owner_block"]),
                "owner_block_chain_s": statistics.median(times["owner_block_chain"]),
                "owner_block_chain_over_fused": statistics.median(
                    c / f
                    for c, f in zip(times["owner_block_chain"], times["owner_block"], strict=True)
                ),
                "owner_rank_block_s": statistics.median(times["owner_rank_block"]),
            }
        )
    machine = f"{platform.processor() or platform.machine()}, {platform.platform()}"
    if dev.type == "cuda":
        machine = torch.cuda.get_device_name(dev)
    return {
        "command": "python -m benchmarks.codec " + " ".join(sys.argv[1:]),
        "machine": machine,
        "device": dev.type,
        "torch": torch.__version__,
        "threads": 1,
        "buffer_mib": mib,
        "block_size": block_size,
        "owner_ranks": OWNER_RANKS,
        "repeats": repeats,
        "copy_s": statistics.median(copies),
        "formats": rows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--formats", default="", help="comma-separated format names (default: six formats)"
    )
    parser.add_argument("--block-size", type=int, default=32, help="elements per block scale")
    parser.add_argument("--device", default="cpu", help="cpu (one thread) or cuda")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    formats = tuple(f for f in args.formats.split(",") if f)
    result = run(args.mib, args.repeats, formats, device=args.device, block_size=args.block_size)
    where = "1 thread" if args.device == "cpu" else result["machine"]
    print(f"copy_ of {args.mib} MiB float32, {where}: {result['copy_s'] * 1e3:.2f} ms (median)")
    print(
        f"{'format':<7} {'enc ms':>8} {'dec ms':>8} {'(enc+dec)/copy':>15} {'scaled':>8} "
        f"{'block ' + str(args.block_size):>9} {'owner ms':>9} {'chain ms':>9} {'rank ms':>8}"
    )
    for r in result["formats"]:
        print(
            f"{r['format']:<7} {r['encode_s'] * 1e3:>8.2f} {r['decode_s'] * 1e3:>8.2f} "
            f"{r['encode_decode_over_copy']:>15.2f} {r['scaled_encode_decode_over_copy']:>8.2f} "
            f"{r['block_encode_decode_over_copy']:>9.2f} {r['owner_block_s'] * 1e3:>9.2f} "
            f"{r['owner_block_chain_s'] * 1e3:>9.2f} {r['owner_rank_block_s'] * 1e3:>8.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
