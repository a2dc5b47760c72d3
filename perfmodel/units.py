"""Parse and format the human units the CLI accepts: sizes, rates, times, counts.

Every quantity must be positive (a duration may be zero) and, for rates and
durations, carry its unit: a bare ``10`` is not silently 10 bytes/s or 10 s.
Errors are one line that names the value.

Example:
    >>> parse_bandwidth("100Gbit")
    12500000000.0
    >>> parse_time("10us")
    1e-05
    >>> parse_count("25.6M")
    25600000
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = [
    "format_bandwidth",
    "format_bytes",
    "format_time",
    "parse_bandwidth",
    "parse_bytes",
    "parse_count",
    "parse_time",
]

# A sign is matched so that "-10Gbit" is reported as negative, not as unreadable.
_NUMBER = re.compile(
    r"^\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$"
)

_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}


def _split(text: str, what: str) -> tuple[float, str]:
    """``text``'s number and unit; a ValueError naming ``what`` and ``text`` if unreadable."""
    match = _NUMBER.match(text)
    if not match:
        raise ValueError(
            f"cannot read {what} {text!r}: expected a number and a unit, e.g. {_EXAMPLES[what]}"
        )
    return float(match.group(1)), match.group(2)


_EXAMPLES = {
    "bandwidth": "100Gbit or 12.5GB/s",
    "time": "10us, 1.5ms or 2s",
    "size": "64KiB, 25MB or 4096 (bytes)",
    "count": "25.6M, 7B or 1500000",
}


def _checked(value: float, text: str | float, what: str, zero_ok: bool = False) -> float:
    """``value`` if it is finite and positive (or zero, with ``zero_ok``), else a ValueError."""
    if not math.isfinite(value):
        raise ValueError(f"{what} {text!r} is not a finite number")
    if value < 0 or (value == 0 and not zero_ok):
        least = "zero or more" if zero_ok else "positive"
        raise ValueError(f"{what} must be {least}, got {text!r}")
    return value


def _prefix(unit: str, allowed_units: tuple[str, ...]) -> tuple[float, str]:
    """Split ``unit`` into an SI/IEC prefix multiplier and the base unit."""
    lowered = unit.lower()
    for base in sorted(allowed_units, key=len, reverse=True):
        if lowered.endswith(base):
            prefix = lowered[: len(lowered) - len(base)]
            if prefix in _BINARY:
                return _BINARY[prefix], base
            if prefix in _DECIMAL:
                return _DECIMAL[prefix], base
    raise ValueError(f"unknown unit {unit!r}")


def parse_bytes(text: str | float | int) -> float:
    """Parse a positive size such as ``"25MB"``, ``"1MiB"`` or ``"4096"`` into bytes.

    Decimal prefixes (kB, MB, GB) are powers of 1000 and binary prefixes
    (KiB, MiB, GiB) powers of 1024, as in the SI/IEC standards. A bare
    number is bytes.

    Raises:
        ValueError: ``text`` is not a size, or not positive (the error names it).

    Example:
        >>> parse_bytes("1MiB")
        1048576.0
    """
    if isinstance(text, int | float):
        return _checked(float(text), text, "size")
    value, unit = _split(text, "size")
    if unit != "":
        try:
            value *= _prefix(unit, ("b", "byte", "bytes"))[0]
        except ValueError:
            raise ValueError(
                f"unknown size unit {unit!r} in {text!r} (e.g. {_EXAMPLES['size']})"
            ) from None
    return _checked(value, text, "size")


def parse_bandwidth(text: str | float | int) -> float:
    """Parse a positive link rate into bytes per second.

    ``bit``/``bps``/``b`` suffixes after a prefix letter mean bits when spelled
    ``bit``, ``bps`` or ``b`` in lower case after ``G``/``M`` (``100Gbit``,
    ``100Gbps``, ``100Gb``); ``B/s`` and ``GB/s`` mean bytes. Text needs a
    unit (a bare ``"10"`` could mean bits or bytes, per second or per
    nanosecond); a Python number is bytes per second.

    Raises:
        ValueError: ``text`` is not a rate, has no unit, or is not positive
            (the error names it).

    Example:
        >>> parse_bandwidth("400Gbps")
        50000000000.0
        >>> parse_bandwidth("25GB/s")
        25000000000.0
    """
    if isinstance(text, int | float):
        return _checked(float(text), text, "bandwidth")
    value, unit = _split(text, "bandwidth")
    if unit == "":
        raise ValueError(
            f"bandwidth {text!r} has no unit: say bits or bytes per second, e.g. "
            f"{text.strip()}Gbit or {text.strip()}GB/s"
        )
    # Bits vs bytes is the one case-sensitive distinction: "Gb" bits, "GB" bytes.
    for suffixes, per_byte in (
        (("bit/s", "bits/s", "bit", "bits", "bps", "b/s", "b"), 1 / 8),
        (("B/s", "Bps", "B"), 1.0),
    ):
        for suffix in suffixes:
            if unit.endswith(suffix):
                try:
                    mult = _prefix(unit[: len(unit) - len(suffix)] + "x", ("x",))[0]
                except ValueError:
                    break  # an unknown prefix, as "10Qbit": the error below names the unit
                return _checked(value * mult * per_byte, text, "bandwidth")
    raise ValueError(f"unknown bandwidth unit {unit!r} in {text!r} (e.g. {_EXAMPLES['bandwidth']})")


def parse_time(text: str | float | int) -> float:
    """Parse a duration such as ``"10us"``, ``"1.5ms"`` or ``"2s"`` into seconds.

    Zero is a duration (an optimizer step that is not modelled, an ideal
    link's latency); a negative one is not. Text needs a unit, except ``"0"``;
    a Python number is seconds.

    Raises:
        ValueError: ``text`` is not a duration, has no unit, or is negative
            (the error names it).

    Example:
        >>> parse_time("1.5ms")
        0.0015
    """
    if isinstance(text, int | float):
        return _checked(float(text), text, "time", zero_ok=True)
    value, unit = _split(text, "time")
    if unit == "" and value != 0:
        raise ValueError(
            f"time {text!r} has no unit: e.g. {text.strip()}us, {text.strip()}ms or {text.strip()}s"
        )
    # Divide rather than multiply by 1e-6: 10 / 1e6 is exactly 1e-05 in floats.
    divisor = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
    if unit.lower() not in divisor:
        raise ValueError(f"unknown time unit {unit!r} in {text!r} (e.g. {_EXAMPLES['time']})")
    return _checked(value / divisor[unit.lower()], text, "time", zero_ok=True)


def parse_count(text: str | float | int) -> int:
    """Parse a positive parameter count such as ``"25.6M"``, ``"7B"`` or ``"1.5e9"``.

    Raises:
        ValueError: ``text`` is not a count, or not positive (the error names it).

    Example:
        >>> parse_count("7B")
        7000000000
    """
    if isinstance(text, int | float):
        return round(_checked(float(text), text, "count"))
    value, unit = _split(text, "count")
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    if unit.lower() not in scale:
        raise ValueError(f"unknown count suffix {unit!r} in {text!r} (e.g. {_EXAMPLES['count']})")
    count = round(_checked(value * scale[unit.lower()], text, "count"))
    if count < 1:
        raise ValueError(f"count must be positive, got {text!r} (rounds to {count})")
    return count


def _three_digits(value: float, units: Sequence[tuple[str, float]]) -> str:
    """``value`` in the largest unit it reaches once rounded to 3 significant digits.

    ``units`` run from the largest to the smallest, which also takes anything
    below it. Rounding before choosing keeps 999.99e6 bit/s from printing as
    ``1e+03 Mbit/s``: 0.99999 Gbit/s rounds to 1 and prints as ``1 Gbit/s``.
    """
    unit, scale = units[-1]
    for unit, scale in units:  # noqa: B007 (the last pair is the fallback)
        if abs(float(f"{value / scale:.3g}")) >= 1.0:
            break
    return f"{value / scale:.3g} {unit}"


def format_time(seconds: float) -> str:
    """Format seconds with a unit that keeps three significant digits.

    Example:
        >>> format_time(0.0123), format_time(0.99999), format_time(9.489999999999998)
        ('12.3 ms', '1 s', '9.49 s')
    """
    if seconds == 0.0:
        return "0 s"
    return _three_digits(seconds, (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)))


def format_bytes(nbytes: float) -> str:
    """Format a byte count with a binary prefix.

    Example:
        >>> format_bytes(3 * 2**20), format_bytes(1023.9)
        ('3 MiB', '1 KiB')
    """
    return _three_digits(nbytes, (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10), ("B", 1.0)))


def format_bandwidth(bytes_per_s: float) -> str:
    """Format a link rate in bits per second, the way networks are sold.

    Example:
        >>> format_bandwidth(12.5e9), format_bandwidth(0.99999e9 / 8)
        ('100 Gbit/s', '1 Gbit/s')
    """
    units = (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3), ("bit/s", 1.0))
    return _three_digits(bytes_per_s * 8.0, units)
