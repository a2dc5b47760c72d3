"""Codec speed: encode + decode of a 64 MiB float32 buffer against a plain copy.

One CPU thread, preallocated buffers (as the hook uses them), medians of
repeats, every ratio measured in the same run as the copy it is divided by.

    python -m benchmarks.codec [--mib 64] [--repeats 9] [--json PATH]
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

import numpy as np
import torch

from aps_comm import _kernels
from aps_comm.formats import FORMATS, _decode_into, _encode_into, payload_nbytes

__all__ = ["main", "run"]


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: compilation, page faults
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(mib: int = 64, repeats: int = 9, formats: tuple[str, ...] = ()) -> dict:
    """Measure every format's codec against ``copy_``; return a JSON-able dict."""
    torch.set_num_threads(1)
    n = mib * 2**20 // 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen)
    y = torch.empty_like(x)
    copy_s = _median_seconds(lambda: y.copy_(x), repeats)
    # APS scales each layer by its own power of two: 100 layers of equal size.
    offsets = np.linspace(0, n, 101).astype(np.int64)
    segments = _kernels.Segments(offsets, np.full(100, 4.0, np.float32))
    rows = []
    for name in formats or ("e4m3", "e5m2", "fp16", "bf16", "e3m2", "e2m1"):
        fmt = FORMATS[name]
        payload = torch.empty(payload_nbytes(n, fmt), dtype=torch.uint8)
        enc = _median_seconds(lambda f=fmt, p=payload: _encode_into(x, f, p), repeats)
        dec = _median_seconds(lambda f=fmt, p=payload: _decode_into(p, f, y), repeats)
        enc_s = _median_seconds(lambda f=fmt, p=payload: _encode_into(x, f, p, segments), repeats)
        dec_s = _median_seconds(lambda f=fmt, p=payload: _decode_into(p, f, y, segments), repeats)
        rows.append(
            {
                "format": name,
                "encode_s": enc,
                "decode_s": dec,
                "encode_decode_over_copy": (enc + dec) / copy_s,
                "scaled_encode_decode_over_copy": (enc_s + dec_s) / copy_s,
            }
        )
    return {
        "command": "python -m benchmarks.codec " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {platform.platform()}",
        "torch": torch.__version__,
        "threads": 1,
        "buffer_mib": mib,
        "repeats": repeats,
        "copy_s": copy_s,
        "formats": rows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    result = run(args.mib, args.repeats)
    print(f"copy_ of {args.mib} MiB float32, 1 thread: {result['copy_s'] * 1e3:.1f} ms (median)")
    print(f"{'format':<7} {'enc ms':>8} {'dec ms':>8} {'(enc+dec)/copy':>15} {'scaled':>8}")
    for r in result["formats"]:
        print(
            f"{r['format']:<7} {r['encode_s'] * 1e3:>8.1f} {r['decode_s'] * 1e3:>8.1f} "
            f"{r['encode_decode_over_copy']:>15.2f} {r['scaled_encode_decode_over_copy']:>8.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
