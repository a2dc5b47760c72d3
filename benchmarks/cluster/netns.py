"""Network namespaces and link shaping: what the emulated cluster is built from.

Names of the namespaces this package creates, ``tc`` tbf parameters for a
rate, rate and delay parsing, and the ``ip``/``tc``/``sysctl`` commands that
create, list and delete namespaces. Nothing here touches the host's own
network: every command names a namespace.

Example:
    >>> parse_rate("1gbit"), tbf_parameters(10**9)
    (1000000000, (500000, 3000000))
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence

__all__ = [
    "BRIDGE_IF",
    "CC_SYSCTL",
    "DEFAULT_CONGESTION_CONTROL",
    "LO_MIN_BURST_BYTES",
    "MAX_RANKS",
    "NS_PREFIX",
    "PREFIX_LEN",
    "SUBNET",
    "ClusterError",
    "ClusterUnavailable",
    "cleanup_stale_namespaces",
    "delete_netns",
    "list_netns",
    "netns_unavailable_reason",
    "parse_delay",
    "parse_rate",
    "run_command",
    "set_congestion_control",
    "tbf_args",
    "tbf_parameters",
]

# Every namespace this package creates starts with this prefix followed by the
# creating process's pid, so parallel runs never collide and leftovers of a
# killed run (kill -9 skips all cleanup) can be recognised and removed.
NS_PREFIX = "apsc-"
# Addresses live only on veths inside our own namespaces, which have no route
# anywhere else, so any private /24 is safe; this one is unlikely to confuse
# someone reading `ip addr` output inside a namespace.
SUBNET = "10.213.77"
PREFIX_LEN = 24
MAX_RANKS = 250
BRIDGE_IF = "apsbr"
# The kernel's CONFIG_HZ is 250 on the machines we target (and at most 1000
# elsewhere); tbf refills its bucket at timer granularity, so the bucket must
# hold at least one tick's worth of bytes or the link never reaches its rate.
_ASSUMED_HZ = 250
# One maximal GSO packet; smaller buckets make tbf split every GSO packet.
_MIN_BURST_BYTES = 64 * 1024
# lo's MTU is 65536, so its packets are a little larger than one GSO packet
# on a veth; tbf drops a packet larger than its bucket.
LO_MIN_BURST_BYTES = 2 * 65536 + 1024
# Queue depth behind the bucket, in seconds of line rate: enough that TCP's
# congestion window is never starved by tail drops, small enough that idle
# round trips are not inflated by a standing queue.
_QUEUE_SECONDS = 0.02
# TCP congestion control inside the rank namespaces. A new namespace inherits
# the host's default, which on the machine these results come from is BBR:
# BBR paces every flow at its estimate of the bottleneck rate, and with the
# bursty traffic of gradient buckets (idle through compute, then one message)
# that estimate, and so the time of a 0.5-1 MB message, drifts with the
# flow's history. Measured with 4 ranks at 1 Gbit/s, three rounds of 40 DDP
# steps: fp16_compress_hook on 1 MiB took 8.8, 21.0 and 14.4 ms under BBR,
# 8.7, 7.5 and 8.5 ms under Reno. Loss-based control (Linux's default, CUBIC,
# or Reno) sends a window at once, as most clusters' hosts do; Reno is the one
# a namespace may always select (the kernel allows it without privileges).
DEFAULT_CONGESTION_CONTROL = "reno"
CC_SYSCTL = "net.ipv4.tcp_congestion_control"

_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}


class ClusterError(RuntimeError):
    """Setting up, running or tearing down the emulated cluster failed."""


class ClusterUnavailable(ClusterError):
    """This machine cannot host namespaces (not root, no ``ip``/``tc``, ...)."""


def parse_rate(rate: str | int | float) -> int:
    """Parse a rate in ``tc`` syntax into bits per second.

    ``tc`` units apply: ``bit``/``kbit``/``mbit``/``gbit`` are bits and
    ``bps``/``kbps``/``mbps`` are *bytes* per second. A bare number is bits/s.

    Args:
        rate: e.g. ``"1gbit"``, ``"100mbit"``, ``"12.5mbps"`` or ``10**9``.

    Returns:
        The rate in bits per second.

    Raises:
        ValueError: the text is not a positive rate.

    Example:
        >>> parse_rate("1gbit"), parse_rate("100mbit"), parse_rate("1mbps")
        (1000000000, 100000000, 8000000)
    """
    if isinstance(rate, (int, float)):
        value, unit = float(rate), "bit"
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", rate)
        if not m:
            raise ValueError(f"not a rate: {rate!r} (expected e.g. '1gbit' or '100mbit')")
        value, unit = float(m.group(1)), (m.group(2).lower() or "bit")
        if unit not in _RATE_UNITS:
            raise ValueError(
                f"unknown rate unit {unit!r} in {rate!r}; use one of {sorted(_RATE_UNITS)}"
            )
    bits = round(value * _RATE_UNITS[unit])
    if bits <= 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    return bits


_DELAY_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_delay(delay: str | int | float | None) -> float:
    """Parse a one-way delay (``tc netem`` syntax) into seconds.

    Args:
        delay: e.g. ``"0.5ms"``, ``"200us"``, ``"1s"``; a bare number is
            seconds; None is no delay.

    Returns:
        The delay in seconds (0.0 for none).

    Raises:
        ValueError: the text is not a delay, or it is negative or above 10 s.

    Example:
        >>> parse_delay("0.5ms"), parse_delay("2s"), parse_delay(None)
        (0.0005, 2.0, 0.0)
    """
    if delay is None:
        return 0.0
    if isinstance(delay, (int, float)):
        seconds = float(delay)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", delay)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _DELAY_UNITS:
            raise ValueError(
                f"not a delay: {delay!r} (expected e.g. '0.5ms' or '200us'; "
                f"units {sorted(_DELAY_UNITS)})"
            )
        seconds = float(m.group(1)) * _DELAY_UNITS[unit]
    if not 0.0 <= seconds <= 10.0:
        raise ValueError(f"delay must be in [0, 10] s, got {delay!r}")
    return seconds


def tbf_parameters(bits_per_s: int, min_burst: int = _MIN_BURST_BYTES) -> tuple[int, int]:
    """Bucket and queue sizes for a tbf qdisc at ``bits_per_s``.

    Args:
        bits_per_s: the shaped rate.
        min_burst: the smallest bucket, in bytes (the largest packet).

    Returns:
        ``(burst_bytes, limit_bytes)``: the bucket holds one timer tick of
        traffic (at least one GSO packet) and the queue adds ~20 ms at rate.

    Example:
        >>> tbf_parameters(10**9)
        (500000, 3000000)
    """
    rate_bytes = bits_per_s / 8
    burst = max(int(rate_bytes / _ASSUMED_HZ), min_burst)
    limit = burst + max(int(rate_bytes * _QUEUE_SECONDS), 2 * min_burst)
    return burst, limit


def tbf_args(bits_per_s: int, min_burst: int = _MIN_BURST_BYTES) -> list[str]:
    """``tc qdisc replace dev X`` arguments for a root tbf at ``bits_per_s``."""
    burst, limit = tbf_parameters(bits_per_s, min_burst)
    return ["root", "tbf", "rate", f"{bits_per_s}bit", "burst", str(burst), "limit", str(limit)]


def netns_unavailable_reason() -> str | None:
    """Why this machine cannot host namespaced clusters, or None if it can.

    Only cheap checks (root, ``ip`` and ``tc`` on PATH); the kernel may still
    refuse, which :meth:`EmulatedCluster.start` reports as
    :class:`ClusterUnavailable`.

    Example:
        >>> reason = netns_unavailable_reason()
        >>> reason is None or isinstance(reason, str)
        True
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or use loopback=True / --loopback)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH (install iproute2)"
    return None


def run_command(args: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> str:
    """Run a short setup command, returning stdout; raise ClusterError on failure."""
    try:
        proc = subprocess.run(
            list(args), capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"`{shlex.join(args)}` failed: {exc}") from exc
    if check and proc.returncode != 0:
        raise ClusterError(
            f"`{shlex.join(args)}` exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout


def set_congestion_control(ns: str, name: str) -> None:
    """Set the TCP congestion control of namespace ``ns``."""
    if shutil.which("sysctl") is None:
        raise ClusterError(
            f"setting TCP congestion control {name!r} needs `sysctl` (procps); "
            "install it or pass congestion_control=None (--congestion-control host)"
        )
    try:
        run_command(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{CC_SYSCTL}={name}"])
    except ClusterError as exc:
        # Outside the host's namespace only the allowed list may be chosen.
        allowed = run_command(
            ["sysctl", "-n", "net.ipv4.tcp_allowed_congestion_control"], check=False
        ).strip()
        raise ClusterError(
            f"cannot set TCP congestion control {name!r} in the rank namespaces "
            f"(allowed there: {allowed or 'unknown'}): {exc}"
        ) from exc


def list_netns() -> list[str]:
    """Names in ``ip netns list`` (which appends ``(id: N)`` to some)."""
    return [
        line.split()[0]
        for line in run_command(["ip", "netns", "list"]).splitlines()
        if line.strip()
    ]


def _kill_netns_processes(ns: str) -> None:
    """SIGKILL every process still inside ``ns`` so deleting it frees the kernel namespace."""
    out = run_command(["ip", "netns", "pids", ns], check=False)
    for pid in out.split():
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)


def delete_netns(names: Sequence[str]) -> list[str]:
    """Delete namespaces (their veths, addresses and qdiscs go with them); return failures."""
    failed = []
    existing = set(list_netns())
    for ns in names:
        if ns not in existing:
            continue
        _kill_netns_processes(ns)
        try:
            run_command(["ip", "netns", "delete", ns])
        except ClusterError:
            failed.append(ns)
    return failed


def cleanup_stale_namespaces() -> list[str]:
    """Delete namespaces left behind by runs whose process no longer exists.

    Only a ``kill -9`` of the parent can leave namespaces behind; those carry
    the dead parent's pid in their name. Namespaces of live processes (for
    example a parallel test run) are left alone.

    Returns:
        The names deleted.

    Example:
        >>> cleanup_stale_namespaces()  # doctest: +SKIP
        ['apsc-4242-1a2b-b', 'apsc-4242-1a2b-r0', 'apsc-4242-1a2b-r1']
    """
    stale = []
    for ns in list_netns():
        m = re.match(re.escape(NS_PREFIX) + r"(\d+)-", ns)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            stale.append(ns)
        except PermissionError:
            pass  # alive, owned by someone else
    delete_netns(sorted(stale, key=lambda n: n.endswith("-b")))
    return stale
