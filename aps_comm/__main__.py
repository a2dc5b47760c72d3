"""``python -m aps_comm``: the table of built-in number formats, or calibrate the model.

``python -m aps_comm`` (or ``python -m aps_comm formats``) prints the table;
``python -m aps_comm calibrate`` (under ``aps-launch`` or ``torchrun``) times
this package's collectives, codec and hooks on every rank and writes the
profile JSON that ``aps-perfmodel --profile`` reads. Measuring lives here,
beside the code it times, because the model imports nothing of ``aps_comm``.

For each format in :data:`aps_comm.formats.FORMATS`: bits, specials, range,
bytes per element on the wire, and the round-trip error of
:func:`~aps_comm.formats.encode` / :func:`~aps_comm.formats.decode` on 1M
N(0, 1) values scaled to half the format's maximum (as APS scales them).

This lives in the package's ``__main__`` rather than in
:mod:`aps_comm.formats` because ``aps_comm`` imports ``formats`` itself, so
``python -m aps_comm.formats`` would run a second copy of that module (runpy
warns about it).

Example (the calibration, on 2 ranks)::

    aps-launch --nproc-per-node 2 -m aps_comm calibrate --out profile.json

Example:
    >>> rows = format_table(numel=1024)
    >>> rows[0]["format"], rows[0]["bytes/elem"]
    ('e4m3', 1.0)
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable, Sequence

import torch

from aps_comm.calibrate import calibrate_command
from aps_comm.formats import FORMATS, decode, encode, payload_nbytes
from aps_perfmodel.calibrate import geometric_sizes
from aps_perfmodel.units import parse_bytes

__all__ = ["Command", "build_parser", "format_table", "main"]


class Command(enum.Enum):
    """The subcommands of ``python -m aps_comm``; FORMATS when none is given.

    Example:
        >>> Command("calibrate")
        <Command.CALIBRATE: 'calibrate'>
    """

    FORMATS = "formats"
    CALIBRATE = "calibrate"


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


def _checked(parse: Callable[[str], float], what: str) -> Callable[[str], float]:
    """An argparse ``type``: ``parse``'s value, which must be positive; the error names it."""

    def convert(text: str) -> float:
        try:
            value = parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {text!r}")
        return value

    convert.__name__ = what  # argparse names the type in some of its errors
    return convert


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


_SIZE = _checked(parse_bytes, "size")
_SECONDS = _checked(float, "timeout")


def _sizes(text: str) -> list[float]:
    return [_SIZE(item) for item in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m aps_comm`` (exposed for documentation and tests).

    Example:
        >>> build_parser().parse_args(["calibrate", "--steps", "3"]).steps
        3
    """
    ap = argparse.ArgumentParser(
        prog="python -m aps_comm",
        description="Print the table of built-in number formats (the default), or time "
        "this machine group for the performance model (calibrate).",
    )
    sub = ap.add_subparsers(dest="command")
    sub.add_parser(Command.FORMATS.value, help="print the table of built-in number formats")
    c = sub.add_parser(
        Command.CALIBRATE.value,
        help="time collectives, codec and hooks on every rank (under aps-launch or torchrun) "
        "and write the profile aps-perfmodel --profile reads",
    )
    c.add_argument("--out", default="perfmodel_profile.json", help="profile JSON path")
    c.add_argument(
        "--sizes", type=_sizes, help="comma-separated FP32 message sizes, e.g. 1MiB,16MiB"
    )
    c.add_argument("--min-size", type=_SIZE, default="64KiB", help="smallest message (FP32 bytes)")
    c.add_argument("--max-size", type=_SIZE, default="64MiB", help="largest message (FP32 bytes)")
    c.add_argument("--steps", type=_positive_int, default=8, help="sizes between min and max")
    c.add_argument("--repeats", type=_positive_int, default=5, help="timed repeats per point")
    c.add_argument(
        "--codec", type=str.lower, default="aps", choices=["aps", "torch"], help="codec to time"
    )
    c.add_argument("--backend", default="gloo", help="torch.distributed backend")
    c.add_argument("--timeout", type=_SECONDS, default=300.0, help="collective timeout (s)")
    c.add_argument("--verbose", action="store_true", help="print every measurement")
    return ap


def _calibrate(args: argparse.Namespace) -> int:
    sizes = (
        [int(size) for size in args.sizes]
        if args.sizes
        else geometric_sizes(args.min_size, args.max_size, args.steps)
    )
    return calibrate_command(
        args.out, sizes, args.repeats, args.codec, args.backend, args.timeout, args.verbose
    )


def _print_formats() -> int:
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand (the format table when none is given); returns the exit code.

    Example:
        >>> main([])  # doctest: +SKIP
        Round-trip error of encode/decode on 1M N(0,1) values scaled to max/2:
        ...
    """
    args = build_parser().parse_args(argv)
    if Command(args.command or Command.FORMATS.value) == Command.CALIBRATE:
        return _calibrate(args)
    return _print_formats()


if __name__ == "__main__":
    raise SystemExit(main())
