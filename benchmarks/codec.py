"""Codec speed: encode + decode of a 64 MiB float32 buffer against a plain copy.

:mod:`aps_comm.codec` as the hook calls it: preallocated buffers, with and
without per-layer scales, on one CPU thread or on a CUDA device (where every
timing synchronises the device). Medians of repeats, every ratio measured in
the same run as the copy it is divided by.

    python -m benchmarks.codec [--mib 64] [--repeats 9] [--device cuda] [--json PATH]
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
from aps_comm.formats import FORMATS, payload_nbytes

__all__ = ["main", "run"]


def _median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up: compilation, page faults
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(
    mib: int = 64, repeats: int = 9, formats: tuple[str, ...] = (), device: str = "cpu"
) -> dict:
    """Measure every format's codec against ``copy_``; return a JSON-able dict."""
    dev = torch.device(device)
    torch.set_num_threads(1)
    n = mib * 2**20 // 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen).to(dev)
    y = torch.empty_like(x)
    copy_s = _median_seconds(lambda: y.copy_(x), repeats, dev)
    # APS scales each layer by its own power of two: 100 layers of equal size.
    sizes = [n // 100] * 99 + [n - 99 * (n // 100)]
    layout = codec.Layout.from_numels(sizes, dev)
    scale = torch.full((100,), 4.0, device=dev)
    rows = []
    for name in formats or ("e4m3", "e5m2", "fp16", "bf16", "e3m2", "e2m1"):
        fmt = FORMATS[name]
        p = torch.empty(payload_nbytes(n, fmt), dtype=torch.uint8, device=dev)

        def enc(f=fmt, p=p, scaled=False):  # type: ignore[no-untyped-def]
            kw = {"scale": scale, "layout": layout} if scaled else {}
            return codec.encode(x, f, out=p, **kw)

        def dec(f=fmt, p=p, scaled=False):  # type: ignore[no-untyped-def]
            kw = {"scale": scale, "layout": layout} if scaled else {}
            return codec.decode(p, f, n, out=y, **kw)

        enc_t = _median_seconds(enc, repeats, dev)
        dec_t = _median_seconds(dec, repeats, dev)
        enc_s = _median_seconds(lambda e=enc: e(scaled=True), repeats, dev)
        dec_s = _median_seconds(lambda d=dec: d(scaled=True), repeats, dev)
        rows.append(
            {
                "format": name,
                "backend": codec.backend_for(fmt, dev),
                "encode_s": enc_t,
                "decode_s": dec_t,
                "scaled_encode_s": enc_s,
                "scaled_decode_s": dec_s,
                "encode_decode_over_copy": (enc_t + dec_t) / copy_s,
                "scaled_encode_decode_over_copy": (enc_s + dec_s) / copy_s,
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
        "repeats": repeats,
        "copy_s": copy_s,
        "formats": rows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu", help="cpu (one thread) or cuda")
    parser.add_argument("--json", type=Path, default=None, help="write results here")
    args = parser.parse_args(argv)
    result = run(args.mib, args.repeats, device=args.device)
    where = "1 thread" if args.device == "cpu" else result["machine"]
    print(f"copy_ of {args.mib} MiB float32, {where}: {result['copy_s'] * 1e3:.2f} ms (median)")
    print(f"{'format':<7} {'enc ms':>8} {'dec ms':>8} {'(enc+dec)/copy':>15} {'scaled':>8}")
    for r in result["formats"]:
        print(
            f"{r['format']:<7} {r['encode_s'] * 1e3:>8.2f} {r['decode_s'] * 1e3:>8.2f} "
            f"{r['encode_decode_over_copy']:>15.2f} {r['scaled_encode_decode_over_copy']:>8.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
