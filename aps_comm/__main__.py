"""``python -m aps_comm``: print the table of built-in number formats.

For each format in :data:`aps_comm.formats.FORMATS`: bits, specials, range,
bytes per element on the wire, and the round-trip error of
:func:`~aps_comm.formats.encode` / :func:`~aps_comm.formats.decode` on 1M
N(0, 1) values scaled to half the format's maximum (as APS scales them).

This lives in the package's ``__main__`` rather than in
:mod:`aps_comm.formats` because ``aps_comm`` imports ``formats`` itself, so
``python -m aps_comm.formats`` would run a second copy of that module (runpy
warns about it).

Example:
    >>> rows = format_table(numel=1024)
    >>> rows[0]["format"], rows[0]["bytes/elem"]
    ('e4m3', 1.0)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from aps_comm.formats import FORMATS, decode, encode, payload_nbytes

__all__ = ["format_table", "main"]


def format_table(numel: int = 1 << 20, seed: int = 0) -> list[dict[str, float | str | int]]:
    """One row per built-in format: its parameters and round-trip error.

    Args:
        numel: how many N(0, 1) samples to round-trip.
        seed: seed of the samples.

    Returns:
        Dicts with keys ``format``, ``bits``, ``specials``, ``max``,
        ``min_normal``, ``min_subnormal``, ``bytes/elem``, ``rel_err_mean`` and
        ``rel_err_max``, in the order of :data:`~aps_comm.formats.FORMATS`.

    Example:
        >>> [r["max"] for r in format_table(numel=16) if r["format"] == "e4m3"]
        [448.0]
    """
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    rows = []
    for fmt in FORMATS.values():
        # Scale the data into the format's normal range, as APS does, so the
        # error reflects the mantissa and not saturation.
        scaled = x * (fmt.max / x.abs().max() / 2)
        back = decode(encode(scaled, fmt), fmt, numel)
        nz = scaled != 0
        rel = ((back - scaled).abs()[nz] / scaled.abs()[nz]).double()
        rows.append(
            {
                "format": fmt.name,
                "bits": fmt.bits,
                "specials": fmt.specials,
                "max": fmt.max,
                "min_normal": fmt.min_normal,
                "min_subnormal": fmt.min_subnormal,
                "bytes/elem": payload_nbytes(2, fmt) / 2,
                "rel_err_mean": float(rel.mean()),
                "rel_err_max": float(rel.max()),
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; returns the exit code.

    Example:
        >>> main([])  # doctest: +SKIP
        Round-trip error of encode/decode on 1M N(0,1) values scaled to max/2:
        ...
    """
    argparse.ArgumentParser(
        prog="python -m aps_comm", description="Print the table of built-in number formats."
    ).parse_args(argv)
    header = (
        f"{'format':<7} {'bits':>4} {'specials':>8} {'max':>11} {'min normal':>11} "
        f"{'min subnorm':>11} {'B/elem':>6} {'mean rel err':>12} {'max rel err':>11}"
    )
    print("Round-trip error of encode/decode on 1M N(0,1) values scaled to max/2:")
    print(header)
    print("-" * len(header))
    for r in format_table():
        print(
            f"{r['format']:<7} {r['bits']:>4} {r['specials']:>8} {r['max']:>11.4g} "
            f"{r['min_normal']:>11.4g} {r['min_subnormal']:>11.4g} {r['bytes/elem']:>6} "
            f"{r['rel_err_mean']:>12.3e} {r['rel_err_max']:>11.3e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
