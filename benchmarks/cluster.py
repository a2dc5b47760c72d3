"""An emulated bandwidth-bound cluster on one machine.

Loopback hides the network: on one machine a 64 MB all-reduce between local
processes is bound by memory copies, not by the link, so low-precision
communication looks pointless there. This module starts M nodes of L ranks
each (K = M L ranks, node-major: rank = node * L + local rank). Every node is
a network namespace holding its L ranks, joined to the others by a Linux
bridge that lives in a namespace of its own, and both ends of every node's
veth are shaped with ``tc`` tbf. Each node then has a full-duplex link of the
configured rate to a non-blocking "switch", shared by its L ranks as a real
node's NIC is, while ranks of one node talk over that namespace's loopback
(unshaped, or shaped to ``intra_node_bandwidth``), the shape of a small
data-parallel cluster. With ``delay`` a small userspace switch replaces the
bridge and holds every frame between nodes for that long (one way), for
latency-bound runs (``tc netem`` is not in every kernel; this needs only
packet sockets). The host's own network is never touched: every interface,
address and qdisc lives inside namespaces created here and deleted on every
exit path (success, a failed rank, an exception, Ctrl-C, SIGTERM).

Each rank's environment carries what ``dist.init_process_group("gloo")`` with
``env://`` needs (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``),
the topology as launchers give it (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` = L,
``GROUP_RANK`` = the node) and ``GLOO_SOCKET_IFNAME`` naming the node's veth.
Before a benchmark, :meth:`EmulatedCluster.link_stats` measures the achieved
TCP goodput and round-trip time between two ranks (by default on different
nodes), so every result can state the conditions it ran under.

Without root (or without ``ip``/``tc``), ``loopback=True`` runs the same
ranks as plain processes on 127.0.0.1 with no shaping.

Example:
    >>> with EmulatedCluster(ranks=4, bandwidth="1gbit") as cluster:  # doctest: +SKIP
    ...     print(cluster.link_stats().summary())
    ...     results = cluster.run([sys.executable, "train.py"], timeout=600)
    ...     assert all(r.ok for r in results)

Command line::

    python -m benchmarks.cluster --ranks 4 --bandwidth 1gbit -- python script.py args
    python -m benchmarks.cluster --ranks 4 --bandwidth 1gbit --allreduce-mb 64
    python -m benchmarks.cluster --nodes 2 --ranks-per-node 2 --bandwidth 1gbit --delay 0.5ms
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import secrets
import select
import selectors
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = [
    "DEFAULT_CONGESTION_CONTROL",
    "PIN_CHOICES",
    "ClusterError",
    "ClusterUnavailable",
    "EmulatedCluster",
    "LinkStats",
    "RankResult",
    "add_pin_argument",
    "add_topology_arguments",
    "allreduce_check",
    "cleanup_stale_namespaces",
    "cluster_topology",
    "main",
    "netns_unavailable_reason",
    "parse_delay",
    "parse_rate",
    "tbf_parameters",
]

# Every namespace this module creates starts with this prefix followed by the
# creating process's pid, so parallel runs never collide and leftovers of a
# killed run (kill -9 skips all cleanup) can be recognised and removed.
NS_PREFIX = "apsc-"
# Addresses live only on veths inside our own namespaces, which have no route
# anywhere else, so any private /24 is safe; this one is unlikely to confuse
# someone reading `ip addr` output inside a namespace.
_SUBNET = "10.213.77"
_PREFIX_LEN = 24
_MAX_RANKS = 250
_BRIDGE_IF = "apsbr"
_DEFAULT_MASTER_PORT = 29500
# The kernel's CONFIG_HZ is 250 on the machines we target (and at most 1000
# elsewhere); tbf refills its bucket at timer granularity, so the bucket must
# hold at least one tick's worth of bytes or the link never reaches its rate.
_ASSUMED_HZ = 250
# One maximal GSO packet; smaller buckets make tbf split every GSO packet.
_MIN_BURST_BYTES = 64 * 1024
# lo's MTU is 65536, so its packets are a little larger than one GSO packet
# on a veth; tbf drops a packet larger than its bucket.
_LO_MIN_BURST_BYTES = 2 * 65536 + 1024
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
_CC_SYSCTL = "net.ipv4.tcp_congestion_control"
# --pin on the command lines: EmulatedCluster's pin_cpus.
PIN_CHOICES: dict[str, bool | None] = {"auto": None, "always": True, "never": False}
_REPO_ROOT = Path(__file__).resolve().parents[1]
_RESULT_TAG = "APS_CLUSTER_RESULT "

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


@dataclasses.dataclass(frozen=True)
class LinkStats:
    """Measured conditions of one rank-to-rank link.

    Attributes:
        bandwidth_bits_per_s: TCP goodput from rank ``src`` to rank ``dst``.
        rtt_s: median round trip of a 1-byte TCP ping-pong on the idle link.
        rtt_min_s: fastest round trip seen.
        ranks: number of ranks in the cluster.
        configured_rate: the tbf rate as given (``"1gbit"``), or None.
        configured_bits_per_s: the tbf rate in bits/s, or None (loopback).
        transfer_bytes: size of the bulk transfer that measured bandwidth.
        mtu: MTU of the veths (65536 for loopback).
        loopback: True when ranks talk over 127.0.0.1 without shaping.
        pinned_cpus: each rank ran pinned to one CPU (rank mod CPUs).
        congestion_control: the ranks' TCP congestion control (None: unknown).
        nodes: number of nodes (each a namespace holding its ranks).
        ranks_per_node: ranks per node (they share the node's link).
        intra_node: ``src`` and ``dst`` are on one node: the pair talks over
            the node's loopback, shaped only to ``configured_rate`` (None:
            unshaped), never through the node's link.
        delay_s: configured one-way delay between nodes (0: none; the
            measured round trip includes it twice).
        src: the sending rank.
        dst: the receiving rank.

    Example:
        >>> s = LinkStats(9.5e8, 1e-4, 1e-4, 4, "1gbit", 10**9, 64 << 20, 1500, False)
        >>> round(s.efficiency, 2)
        0.95
    """

    bandwidth_bits_per_s: float
    rtt_s: float
    rtt_min_s: float
    ranks: int
    configured_rate: str | None
    configured_bits_per_s: int | None
    transfer_bytes: int
    mtu: int
    loopback: bool
    pinned_cpus: bool = False
    congestion_control: str | None = None
    nodes: int | None = None
    ranks_per_node: int = 1
    intra_node: bool = False
    delay_s: float = 0.0
    src: int = 0
    dst: int = 1

    @property
    def efficiency(self) -> float | None:
        """Measured goodput as a fraction of the configured rate (None if unshaped)."""
        if not self.configured_bits_per_s:
            return None
        return self.bandwidth_bits_per_s / self.configured_bits_per_s

    def summary(self) -> str:
        """One human-readable line, e.g. for a benchmark's header."""
        if self.loopback:
            mode = "loopback (unshaped)"
        elif self.intra_node:
            shaped = f"tbf {self.configured_rate}" if self.configured_rate else "unshaped"
            mode = f"intra-node rank {self.src} -> {self.dst} over the node's lo ({shaped})"
        else:
            mode = f"tbf {self.configured_rate}"
            if self.delay_s:
                mode += f" + {self.delay_s * 1e3:g} ms one-way delay"
        eff = f" ({self.efficiency:.1%} of configured)" if self.efficiency is not None else ""
        cc = f", tcp {self.congestion_control}" if self.congestion_control else ""
        layout = f"{self.ranks} ranks"
        if self.nodes is not None and self.ranks_per_node > 1:
            layout = f"{self.nodes} nodes x {self.ranks_per_node} ranks"
        return (
            f"link: {layout}, {mode}, mtu {self.mtu}{cc}: "
            f"{self.bandwidth_bits_per_s / 1e6:.1f} Mbit/s TCP goodput{eff}, "
            f"rtt {self.rtt_s * 1e6:.0f} us (min {self.rtt_min_s * 1e6:.0f} us), "
            f"measured with {self.transfer_bytes / 2**20:.1f} MiB"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form, with the derived efficiency included."""
        out = dataclasses.asdict(self)
        out["efficiency"] = self.efficiency
        return out


@dataclasses.dataclass
class RankResult:
    """What one rank's process did.

    Attributes:
        rank: the rank.
        returncode: exit status (negative: killed by that signal).
        output: stdout and stderr, interleaved as written.
        timed_out: the run's timeout expired and this rank was killed.
        killed: the rank was stopped because another rank failed.

    Example:
        >>> RankResult(rank=0, returncode=0, output="").ok
        True
    """

    rank: int
    returncode: int | None
    output: str
    timed_out: bool = False
    killed: bool = False

    @property
    def ok(self) -> bool:
        """The rank exited by itself with status 0."""
        return self.returncode == 0 and not self.timed_out and not self.killed


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


def _tbf_args(bits_per_s: int, min_burst: int = _MIN_BURST_BYTES) -> list[str]:
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


def _cmd(args: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> str:
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


def _set_congestion_control(ns: str, name: str) -> None:
    """Set the TCP congestion control of namespace ``ns``."""
    if shutil.which("sysctl") is None:
        raise ClusterError(
            f"setting TCP congestion control {name!r} needs `sysctl` (procps); "
            "install it or pass congestion_control=None (--congestion-control host)"
        )
    try:
        _cmd(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{_CC_SYSCTL}={name}"])
    except ClusterError as exc:
        # Outside the host's namespace only the allowed list may be chosen.
        allowed = _cmd(
            ["sysctl", "-n", "net.ipv4.tcp_allowed_congestion_control"], check=False
        ).strip()
        raise ClusterError(
            f"cannot set TCP congestion control {name!r} in the rank namespaces "
            f"(allowed there: {allowed or 'unknown'}): {exc}"
        ) from exc


def _list_netns() -> list[str]:
    """Names in ``ip netns list`` (which appends ``(id: N)`` to some)."""
    return [line.split()[0] for line in _cmd(["ip", "netns", "list"]).splitlines() if line.strip()]


def _kill_netns_processes(ns: str) -> None:
    """SIGKILL every process still inside ``ns`` so deleting it frees the kernel namespace."""
    out = _cmd(["ip", "netns", "pids", ns], check=False)
    for pid in out.split():
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)


def _delete_netns(names: Sequence[str]) -> list[str]:
    """Delete namespaces (their veths, addresses and qdiscs go with them); return failures."""
    failed = []
    existing = set(_list_netns())
    for ns in names:
        if ns not in existing:
            continue
        _kill_netns_processes(ns)
        try:
            _cmd(["ip", "netns", "delete", ns])
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
    for ns in _list_netns():
        m = re.match(re.escape(NS_PREFIX) + r"(\d+)-", ns)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            stale.append(ns)
        except PermissionError:
            pass  # alive, owned by someone else
    _delete_netns(sorted(stale, key=lambda n: n.endswith("-b")))
    return stale


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    """Read one line of ``proc.stdout`` or raise ClusterError after ``timeout`` s."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise ClusterError(f"no output from `{shlex.join(proc.args)}` within {timeout:.0f} s")
    return proc.stdout.readline()


def _stop(procs: Sequence[subprocess.Popen[Any]], grace: float = 2.0) -> None:
    """SIGTERM each process group, then SIGKILL what is left after ``grace`` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            # Ranks run in their own session so the whole tree (a rank's own
            # workers, dataloaders) goes, not just the leader.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace
        for p in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))


class _SignalsAsExit:
    """Turn SIGTERM/SIGHUP into SystemExit so ``finally`` blocks run (Ctrl-C already raises)."""

    _SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        # Python only lets the main thread set handlers; elsewhere the caller's
        # own try/finally and atexit are all we can offer.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._previous.clear()

    @staticmethod
    def _handle(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Defer Ctrl-C/SIGTERM while tearing down, so teardown is never half done."""
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class EmulatedCluster:
    """M nodes of L ranks on one machine, each node behind its own shaped link.

    Topology: namespace ``<name>-b`` holds a bridge; namespace ``<name>-n<j>``
    holds node j's ranks (``j * L`` to ``j * L + L - 1``, node-major) and its
    veth ``aps<j>`` with address ``10.213.77.<j+1>/24``; the veth's peer
    ``apsb<j>`` is a port of the bridge. A tbf qdisc at the configured rate
    sits on both ends, so each node sends and receives at most that rate, its
    L ranks together, and the bridge itself never limits. Ranks of one node
    share its address; the kernel routes traffic between them over the
    namespace's ``lo``, so it never touches the node's link (unshaped, or a
    tbf of ``intra_node_bandwidth`` on that ``lo``: one bus for the whole
    node, not a link per rank). With ``delay``, a userspace switch (one
    process in the bridge namespace, packet sockets on every ``apsb<j>``)
    takes the bridge's place and forwards each frame that long after it
    arrived; the tbf qdiscs still shape both ends.

    Use it as a context manager (or call :meth:`start`/:meth:`close`):
    namespaces are deleted on every exit path. SIGTERM and SIGHUP are turned
    into ``SystemExit`` while the cluster is up (main thread only), and an
    ``atexit`` hook covers a cluster that was never closed.

    Args:
        ranks: number of ranks (1 to 250), ``nodes * ranks_per_node``; None
            (the default) takes it from ``nodes`` (2 nodes if both are None).
        bandwidth: per-node link rate in ``tc`` syntax (``"1gbit"``); with one
            rank per node, the rank's own link.
        loopback: run ranks as plain processes on 127.0.0.1, no shaping.
        fallback_to_loopback: when namespaces are unavailable, warn and run
            in loopback mode instead of raising :class:`ClusterUnavailable`.
        mtu: MTU of the veths.
        master_port: rendezvous port (loopback mode picks a free one).
        pin_cpus: pin rank r to CPU r mod (CPUs available) (needs
            ``taskset``; skipped without it). None (the default) pins only
            when there are more ranks than CPUs. Measured with 4 ranks on 2
            cores: one APS step took 37.6-40.3 ms over three unpinned runs and
            32.8-33.7 ms pinned, as the scheduler's placement of the ranks
            changed from run to run. With a CPU or more per rank, pinning puts
            a rank's main thread and its Gloo threads on one CPU, where one
            waits for the other up to a scheduler tick: with 2 ranks on 2
            cores a tiny FP32 DDP hook call took p25/p75 2.1-2.8/5.0-5.5 ms
            pinned and 0.8-0.9/1.4-2.0 ms unpinned.
        congestion_control: TCP congestion control set in every rank's
            namespace (``DEFAULT_CONGESTION_CONTROL``, Reno: see there why not
            the host's BBR); None keeps the host's default. Loopback mode runs
            in the host's namespace and always keeps it.
        nodes: number of nodes (1 to 250); None: ``ranks / ranks_per_node``.
        ranks_per_node: ranks per node, L (``LOCAL_WORLD_SIZE``).
        intra_node_bandwidth: rate of each node's ``lo`` (all traffic between
            ranks of that node, both directions, shares it); None: unshaped.
        delay: one-way delay added between nodes (``"0.5ms"``, seconds as a
            number, None for none). Loopback mode cannot add one.

    Example:
        >>> with EmulatedCluster(ranks=2, bandwidth="100mbit") as c:  # doctest: +SKIP
        ...     stats = c.link_stats()
        ...     res = c.run([sys.executable, "-c", "import os; print(os.environ['RANK'])"])
        >>> [r.output.strip() for r in res]  # doctest: +SKIP
        ['0', '1']
    """

    def __init__(
        self,
        ranks: int | None = None,
        bandwidth: str | int = "1gbit",
        *,
        loopback: bool = False,
        fallback_to_loopback: bool = False,
        mtu: int = 1500,
        master_port: int = _DEFAULT_MASTER_PORT,
        pin_cpus: bool | None = None,
        congestion_control: str | None = DEFAULT_CONGESTION_CONTROL,
        nodes: int | None = None,
        ranks_per_node: int = 1,
        intra_node_bandwidth: str | int | None = None,
        delay: str | float | None = None,
    ) -> None:
        if isinstance(ranks_per_node, bool) or not 1 <= ranks_per_node <= _MAX_RANKS:
            raise ValueError(f"ranks_per_node must be in [1, {_MAX_RANKS}], got {ranks_per_node}")
        if nodes is None:
            if ranks is None:
                nodes = 2
            elif ranks % ranks_per_node:
                raise ValueError(
                    f"ranks={ranks} is not a multiple of ranks_per_node={ranks_per_node}"
                )
            else:
                nodes = ranks // ranks_per_node
        if not 1 <= nodes <= _MAX_RANKS:
            raise ValueError(f"nodes must be in [1, {_MAX_RANKS}], got {nodes}")
        if ranks is not None and ranks != nodes * ranks_per_node:
            raise ValueError(
                f"ranks={ranks} does not match nodes={nodes} x ranks_per_node={ranks_per_node}"
            )
        ranks = nodes * ranks_per_node
        if not 1 <= ranks <= _MAX_RANKS:
            raise ValueError(f"ranks must be in [1, {_MAX_RANKS}], got {ranks}")
        if not 68 <= mtu <= 65535:
            raise ValueError(f"mtu must be in [68, 65535], got {mtu}")
        self.ranks = ranks
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.delay_s = parse_delay(delay)
        self.intra_node_bandwidth = (
            None if intra_node_bandwidth is None else str(intra_node_bandwidth)
        )
        self.intra_node_bits_per_s = (
            None if intra_node_bandwidth is None else parse_rate(intra_node_bandwidth)
        )
        if pin_cpus is None:
            pin_cpus = ranks > len(os.sched_getaffinity(0))
        self.pin_cpus = pin_cpus and shutil.which("taskset") is not None
        self.bandwidth = str(bandwidth)
        self.bits_per_s = parse_rate(bandwidth)
        if loopback and (self.delay_s or intra_node_bandwidth is not None):
            raise ValueError("loopback mode shapes nothing: drop delay and intra_node_bandwidth")
        self.loopback = loopback
        self.fallback_to_loopback = fallback_to_loopback
        self.mtu = mtu
        if congestion_control is not None and not re.fullmatch(r"[a-z0-9_]+", congestion_control):
            raise ValueError(f"not a congestion control name: {congestion_control!r}")
        self.congestion_control = congestion_control
        self.master_port = master_port
        self.name = f"{NS_PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self._started = False
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._procs_lock = threading.Lock()
        self._switch: subprocess.Popen[str] | None = None
        self._signals = _SignalsAsExit()

    # -- topology names -------------------------------------------------

    @property
    def bridge_namespace(self) -> str:
        """Namespace holding the bridge."""
        return f"{self.name}-b"

    def node(self, rank: int) -> int:
        """The node ``rank`` runs on (ranks are node-major)."""
        return rank // self.ranks_per_node

    def node_namespace(self, node: int) -> str:
        """Namespace of ``node`` (it holds all of that node's ranks)."""
        return f"{self.name}-n{node}"

    def namespace(self, rank: int) -> str:
        """Namespace of ``rank``: its node's."""
        return self.node_namespace(self.node(rank))

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this cluster uses (empty in loopback mode)."""
        if self.loopback:
            return []
        return [self.bridge_namespace] + [self.node_namespace(j) for j in range(self.nodes)]

    def interface(self, rank: int) -> str:
        """Node-side veth name of ``rank``'s node (what ``GLOO_SOCKET_IFNAME`` is set to)."""
        return "lo" if self.loopback else f"aps{self.node(rank)}"

    def address(self, rank: int) -> str:
        """IPv4 address of ``rank`` (its node's: the node's ranks share it)."""
        return "127.0.0.1" if self.loopback else f"{_SUBNET}.{self.node(rank) + 1}"

    # -- lifecycle --------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> EmulatedCluster:
        """Create namespaces, bridge, veths, addresses and qdiscs.

        Raises:
            ClusterUnavailable: namespaces cannot be used here and
                ``fallback_to_loopback`` is False.
            ClusterError: a setup command failed (everything created so far
                has been removed).
        """
        if self._started:
            return self
        reason = None if self.loopback else netns_unavailable_reason()
        if reason is None and not self.loopback:
            self._started = True
            atexit.register(self.close)
            self._signals.install()
            try:
                self._build()
                return self
            except ClusterUnavailable as exc:
                self.close()
                reason = str(exc)
            except BaseException:
                self.close()
                raise
        if reason is not None:
            if not self.fallback_to_loopback:
                raise ClusterUnavailable(reason)
            warnings.warn(
                f"emulated cluster falls back to loopback (no shaping, no delay): {reason}",
                RuntimeWarning,
                stacklevel=2,
            )
            self.loopback = True
        if self.master_port == _DEFAULT_MASTER_PORT:
            self.master_port = _free_port()
        self._started = True
        atexit.register(self.close)
        self._signals.install()
        return self

    def _add_netns(self, ns: str) -> None:
        first = not self._created
        # Recorded before creation so a half-done `ip netns add` is still cleaned.
        self._created.append(ns)
        try:
            _cmd(["ip", "netns", "add", ns])
        except ClusterError as exc:
            if first:
                # The kernel or a container forbids namespaces altogether.
                raise ClusterUnavailable(f"cannot create a network namespace: {exc}") from exc
            raise

    def _build(self) -> None:
        bns = self.bridge_namespace
        tbf = _tbf_args(self.bits_per_s)
        self._add_netns(bns)
        if not self.delay_s:
            _cmd(["ip", "-n", bns, "link", "add", _BRIDGE_IF, "type", "bridge"])
            _cmd(["ip", "-n", bns, "link", "set", _BRIDGE_IF, "up"])
        for node in range(self.nodes):
            rank = node * self.ranks_per_node
            nns, nif, bif = self.node_namespace(node), self.interface(rank), f"apsb{node}"
            self._add_netns(nns)
            # Created inside the bridge namespace with the peer moved straight
            # into the node's: no interface ever appears in the host namespace.
            mtu = ["mtu", str(self.mtu)]
            veth = ["type", "veth", "peer", "name", nif, *mtu, "netns", nns]
            _cmd(["ip", "-n", bns, "link", "add", bif, *mtu, *veth])
            if self.delay_s:
                _cmd(["ip", "-n", bns, "link", "set", bif, "up"])
            else:
                _cmd(["ip", "-n", bns, "link", "set", bif, "master", _BRIDGE_IF, "up"])
            _cmd(
                ["ip", "-n", nns, "addr", "add", f"{self.address(rank)}/{_PREFIX_LEN}", "dev", nif]
            )
            _cmd(["ip", "-n", nns, "link", "set", nif, "up"])
            _cmd(["ip", "-n", nns, "link", "set", "lo", "up"])
            if self.congestion_control is not None:
                _set_congestion_control(nns, self.congestion_control)
            # Egress on each end: node -> bridge on the node side, bridge ->
            # node on the bridge side, i.e. a full-duplex link of this rate.
            _cmd(["tc", "-n", nns, "qdisc", "replace", "dev", nif, *tbf])
            _cmd(["tc", "-n", bns, "qdisc", "replace", "dev", bif, *tbf])
            if self.intra_node_bits_per_s is not None:
                # lo carries 64 KiB packets: the bucket must hold one whole.
                lo_tbf = _tbf_args(self.intra_node_bits_per_s, min_burst=_LO_MIN_BURST_BYTES)
                _cmd(["tc", "-n", nns, "qdisc", "replace", "dev", "lo", *lo_tbf])
        if self.delay_s:
            self._start_switch([f"apsb{node}" for node in range(self.nodes)])

    def _start_switch(self, ports: list[str]) -> None:
        """Start the delaying switch in the bridge namespace; return once it forwards."""
        argv = [sys.executable, "-c", "import benchmarks.cluster as c; c._switch_main()"]
        argv += [repr(self.delay_s), *ports]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        # Its own session, so _stop() takes it down like a rank; stderr stays
        # ours so a crash of the switch is seen (the ranks would only stall).
        self._switch = subprocess.Popen(
            ["ip", "netns", "exec", self.bridge_namespace, *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        line = _readline(self._switch, 30.0).strip()
        if line != "ready":
            raise ClusterError(f"the delaying switch failed to start (said {line!r})")

    def tcp_congestion_control(self) -> str | None:
        """The congestion control rank 0's TCP uses (None if it cannot be read)."""
        path = "/proc/sys/" + _CC_SYSCTL.replace(".", "/")
        if self.loopback:
            with contextlib.suppress(OSError):
                return Path(path).read_text().strip() or None
            return None
        return (
            _cmd(["ip", "netns", "exec", self.namespace(0), "cat", path], check=False).strip()
            or None
        )

    def close(self) -> None:
        """Kill every rank still running and delete every namespace (idempotent)."""
        if not self._started:
            return
        with _signals_blocked():
            self._started = False
            with self._procs_lock:
                procs, self._procs = self._procs, []
            if self._switch is not None:
                procs.append(self._switch)
            _stop(procs, grace=1.0)
            if self._switch is not None and self._switch.stdout is not None:
                self._switch.stdout.close()
            self._switch = None
            failed: list[str] = []
            if self._created:
                # Rank namespaces first: deleting them destroys the veth pairs
                # before the bridge they are enslaved to goes.
                ordered = sorted(self._created, key=lambda n: n == self.bridge_namespace)
                try:
                    failed = _delete_netns(ordered)
                except ClusterError as exc:
                    failed = [f"{self._created} ({exc})"]
                self._created = []
            self._signals.restore()
            atexit.unregister(self.close)
        if failed:
            raise ClusterError(
                f"could not delete namespaces {failed}; run `ip netns delete` by hand"
            )

    # -- running things inside --------------------------------------------

    def env(self, rank: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The full environment of ``rank``: ours, then the rendezvous, then ``extra``."""
        env = dict(os.environ)
        # Lets `python -c "import benchmarks..."` work from a plain checkout.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        # Launchers' names (torchrun): LOCAL_* within the node, GROUP_* the node.
        env.update(
            MASTER_ADDR=self.address(0),
            MASTER_PORT=str(self.master_port),
            RANK=str(rank),
            WORLD_SIZE=str(self.ranks),
            LOCAL_RANK=str(rank % self.ranks_per_node),
            LOCAL_WORLD_SIZE=str(self.ranks_per_node),
            GROUP_RANK=str(self.node(rank)),
            GROUP_WORLD_SIZE=str(self.nodes),
            GLOO_SOCKET_IFNAME=self.interface(rank),
            TP_SOCKET_IFNAME=self.interface(rank),
            APS_CLUSTER_BANDWIDTH="loopback" if self.loopback else self.bandwidth,
        )
        env.update(extra or {})
        return env

    def command(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside ``rank``'s namespace (and on its CPU, if pinned)."""
        pin: list[str] = []
        if self.pin_cpus:
            cpus = sorted(os.sched_getaffinity(0))
            pin = ["taskset", "-c", str(cpus[rank % len(cpus)])]
        if self.loopback:
            return [*pin, *argv]
        return [*pin, "ip", "netns", "exec", self.namespace(rank), *argv]

    def popen(
        self,
        rank: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` as ``rank`` (own session, killed on close).

        Args:
            rank: which rank's namespace and environment.
            argv: the command.
            env: extra environment variables.
            **kwargs: passed to :class:`subprocess.Popen`.

        Example:
            >>> p = cluster.popen(0, ["hostname"], stdout=subprocess.PIPE)  # doctest: +SKIP
        """
        if not self._started:
            raise ClusterError("cluster is not started; use `with EmulatedCluster(...)`")
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} out of range for {self.ranks} ranks")
        proc = subprocess.Popen(
            self.command(rank, argv), env=self.env(rank, env), start_new_session=True, **kwargs
        )
        with self._procs_lock:
            self._procs.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        echo: bool = False,
        fail_fast: bool = True,
    ) -> list[RankResult]:
        """Run ``argv`` on every rank and wait for all of them.

        Args:
            argv: the command every rank runs (its rank is in ``$RANK``).
            env: extra environment variables for every rank.
            timeout: seconds; past it every rank still running is killed.
            echo: also print each output line, prefixed ``[rank i]``.
            fail_fast: when a rank exits nonzero, stop the others (they
                would otherwise block in a collective until Gloo times out).

        Returns:
            One :class:`RankResult` per rank, in rank order.

        Example:
            >>> res = cluster.run(["python", "train.py"], timeout=300)  # doctest: +SKIP
            >>> [r.returncode for r in res]  # doctest: +SKIP
            [0, 0, 0, 0]
        """
        procs: list[subprocess.Popen[str]] = []
        outputs: list[list[str]] = [[] for _ in range(self.ranks)]
        readers: list[threading.Thread] = []
        timed_out = killed = False
        try:
            for rank in range(self.ranks):
                p = self.popen(
                    rank,
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    bufsize=1,
                )
                procs.append(p)
                t = threading.Thread(
                    target=_pump, args=(p, outputs[rank], f"[rank {rank}] " if echo else None)
                )
                t.daemon = True
                t.start()
                readers.append(t)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                # Poll every rank each round: a short-circuiting any() would
                # never notice a later rank's failure while an earlier one runs.
                codes = [p.poll() for p in procs]
                if all(code is not None for code in codes):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    timed_out = True
                    break
                if fail_fast and any(code not in (None, 0) for code in codes):
                    killed = True
                    break
                time.sleep(0.02)
        finally:
            running = {i for i, p in enumerate(procs) if p.poll() is None}
            _stop(procs)
            for t in readers:
                t.join(timeout=5)
            with self._procs_lock:
                self._procs = [p for p in self._procs if p not in procs]
        return [
            RankResult(
                rank=r,
                returncode=p.returncode,
                output="".join(outputs[r]),
                timed_out=timed_out and r in running,
                killed=killed and r in running,
            )
            for r, p in enumerate(procs)
        ]

    def qdiscs(self) -> str:
        """``tc qdisc show`` of every veth, one block per namespace (for checks and logs)."""
        blocks = []
        for ns in self.namespaces:
            blocks.append(f"# {ns}\n" + _cmd(["tc", "-n", ns, "qdisc", "show"]))
        return "\n".join(blocks)

    def link_stats(
        self,
        *,
        src: int = 0,
        dst: int | None = None,
        transfer_bytes: int | None = None,
        pings: int = 200,
        timeout: float | None = None,
    ) -> LinkStats:
        """Measure TCP goodput and round-trip time from rank ``src`` to ``dst``.

        A small socket server runs in ``dst``'s namespace, a client in
        ``src``'s: first ``pings`` 1-byte ping-pongs (TCP_NODELAY) on the idle
        link, then a bulk transfer timed by the receiver from its first to its
        last byte (so connection setup and slow start's first RTT do not count).
        Two ranks of one node measure the node's loopback, not its link.

        Args:
            src: sending rank.
            dst: receiving rank; None: the first rank of the next node (rank
                1 when there is one node).
            transfer_bytes: bulk size; default ~0.5 s at the configured rate
                (the intra-node rate for a pair on one node; 64 MiB if
                unshaped), clamped to [2, 64] MiB.
            pings: number of round trips whose median is reported.
            timeout: seconds before the probe is abandoned.

        Returns:
            The measured :class:`LinkStats`.

        Example:
            >>> print(cluster.link_stats().summary())  # doctest: +SKIP
            link: 4 ranks, tbf 1gbit, mtu 1500: 957.9 Mbit/s TCP goodput (95.8% of configured), ...
        """
        if self.ranks < 2 and not self.loopback:
            raise ClusterError("link_stats needs at least two ranks")
        if dst is None:
            dst = self.ranks_per_node % self.ranks if self.nodes > 1 else 1
        for name, r in (("src", src), ("dst", dst)):
            if not 0 <= r < self.ranks:
                raise ValueError(f"{name}={r} out of range for {self.ranks} ranks")
        if src == dst and not self.loopback:
            raise ValueError(f"src and dst are both rank {src}")
        if self.loopback:
            src = dst = 0
        intra = not self.loopback and self.node(src) == self.node(dst)
        rate: int | None = None
        if not self.loopback:
            rate = self.intra_node_bits_per_s if intra else self.bits_per_s
        if transfer_bytes is None:
            transfer_bytes = 64 << 20 if rate is None else min(max(rate // 16, 2 << 20), 64 << 20)
        if timeout is None:
            timeout = 30.0 + (0.0 if rate is None else 4.0 * transfer_bytes * 8 / rate)
        probe = [sys.executable, "-c", "import benchmarks.cluster as c; c._probe_main()"]
        server = self.popen(
            dst,
            [*probe, "server", self.address(dst)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        client: subprocess.Popen[str] | None = None
        try:
            ready = _readline(server, timeout).split()
            if len(ready) != 2 or ready[0] != "ready":
                raise ClusterError(f"link probe server failed to start (said {ready!r})")
            client = self.popen(
                src,
                [*probe, "client", self.address(dst), ready[1], str(transfer_bytes), str(pings)],
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
            )
            try:
                out, _ = client.communicate(timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                raise ClusterError(f"link probe took longer than {timeout:.0f} s") from exc
            if client.returncode != 0:
                raise ClusterError(f"link probe client exited {client.returncode}")
            result = json.loads(out.strip().splitlines()[-1])
        finally:
            procs = [p for p in (server, client) if p is not None]
            _stop(procs, grace=1.0)
            for p in procs:
                if p.stdout is not None:
                    p.stdout.close()
            with self._procs_lock:
                self._procs = [p for p in self._procs if p not in procs]
        return LinkStats(
            bandwidth_bits_per_s=result["bits_per_s"],
            rtt_s=result["rtt_median_s"],
            rtt_min_s=result["rtt_min_s"],
            ranks=self.ranks,
            configured_rate=(self.intra_node_bandwidth if intra else self.bandwidth)
            if rate is not None
            else None,
            configured_bits_per_s=rate,
            transfer_bytes=transfer_bytes,
            mtu=65536 if self.loopback or intra else self.mtu,
            loopback=self.loopback,
            pinned_cpus=self.pin_cpus,
            congestion_control=self.tcp_congestion_control(),
            nodes=self.nodes,
            ranks_per_node=self.ranks_per_node,
            intra_node=intra,
            delay_s=0.0 if intra or self.loopback else self.delay_s,
            src=src,
            dst=dst,
        )


def _installed_version(package: str) -> str | None:
    """Version of an installed distribution, without importing it."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _free_port() -> int:
    """An unused TCP port on 127.0.0.1 (for the loopback rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pump(proc: subprocess.Popen[str], sink: list[str], prefix: str | None) -> None:
    """Collect a rank's output line by line; echo it with a prefix when asked."""
    assert proc.stdout is not None
    with proc.stdout:
        for line in proc.stdout:
            sink.append(line)
            if prefix is not None:
                sys.stdout.write(prefix + line)
                sys.stdout.flush()


# -- the link probe, run inside the namespaces via `python -c` ------------

_HEADER = struct.Struct("!QI")  # bulk bytes, number of pings


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection early")
        buf += chunk
    return bytes(buf)


def _probe_server(host: str) -> None:
    """Echo pings, then time a bulk transfer and report it to the client."""
    with socket.socket() as lsock:
        lsock.bind((host, 0))
        lsock.listen(1)
        print(f"ready {lsock.getsockname()[1]}", flush=True)
        conn, _ = lsock.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nbytes, pings = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
        for _ in range(pings):
            conn.sendall(_recv_exact(conn, 1))
        buf = bytearray(1 << 20)
        got = first = 0
        t_first = t_last = 0.0
        while got < nbytes:
            n = conn.recv_into(buf)
            if n == 0:
                raise ConnectionError("sender closed before the transfer finished")
            t_last = time.perf_counter()
            if got == 0:
                t_first, first = t_last, n
            got += n
        conn.sendall(json.dumps({"bytes": got - first, "seconds": t_last - t_first}).encode())


def _probe_client(host: str, port: int, nbytes: int, pings: int) -> None:
    """Ping-pong, then send ``nbytes``; print the result as one JSON line."""
    with socket.create_connection((host, port), timeout=120) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(_HEADER.pack(nbytes, pings))
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            conn.sendall(b"p")
            _recv_exact(conn, 1)
            rtts.append(time.perf_counter() - t0)
        chunk = bytes(1 << 20)
        view = memoryview(chunk)
        left = nbytes
        while left:
            n = min(left, len(chunk))
            conn.sendall(view[:n])
            left -= n
        report = json.loads(conn.recv(4096).decode())
    seconds = max(report["seconds"], 1e-9)
    print(
        json.dumps(
            {
                "bits_per_s": report["bytes"] * 8 / seconds,
                "rtt_median_s": statistics.median(rtts) if rtts else float("nan"),
                "rtt_min_s": min(rtts) if rtts else float("nan"),
            }
        ),
        flush=True,
    )


def _probe_main() -> None:
    """Entry point of ``python -c "...; c._probe_main()" server|client ...``."""
    args = sys.argv[1:]
    if args[0] == "server":
        _probe_server(args[1])
    else:
        _probe_client(args[1], int(args[2]), int(args[3]), int(args[4]))


# -- the delaying switch, run in the bridge namespace via `python -c` ----

_SOL_PACKET = 263
_PACKET_VNET_HDR = 15  # frames come with a virtio_net_hdr: GSO frames pass whole
_PACKET_IGNORE_OUTGOING = 23  # Linux >= 4.20: do not read back what we send
_ETH_P_ALL = 0x0003
_VNET_HDR_LEN = 10
_MAX_FRAME = _VNET_HDR_LEN + 14 + 65535 + 64


def _switch_main() -> None:
    """Forward Ethernet frames among the given ports, each ``delay`` s after it came.

    Entry point of ``python -c "...; c._switch_main()" DELAY PORT...``. A
    learning switch: a frame goes to the port its destination MAC was last
    seen on, else (broadcast, ARP, unknown) to every other port. One thread,
    frames in arrival order (the delay is constant, so a FIFO is a timer
    queue). Packet sockets with virtio headers receive the veths' GSO frames
    (up to 64 KiB) whole, so a Gbit/s link costs a few thousand frames per
    second; the tbf qdiscs on both veth ends still shape every link. Runs
    SCHED_FIFO when allowed: with every core busy running ranks, a
    time-shared switch would add the scheduler's latency to the delay.
    """
    import collections

    delay = float(sys.argv[1])
    ports = sys.argv[2:]
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    socks = []
    for port in ports:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        s.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
        s.setsockopt(_SOL_PACKET, _PACKET_IGNORE_OUTGOING, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        s.bind((port, 0))
        s.setblocking(False)
        socks.append(s)
    index = {s.fileno(): i for i, s in enumerate(socks)}
    poller = select.poll()
    for s in socks:
        poller.register(s.fileno(), select.POLLIN)
    where: dict[bytes, int] = {}
    queue: collections.deque[tuple[float, int, bytes]] = collections.deque()
    dst_at, src_at = _VNET_HDR_LEN, _VNET_HDR_LEN + 6
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, out, frame = queue.popleft()
            # A full send buffer drops the frame, as a switch's full queue
            # would; TCP retransmits it.
            with contextlib.suppress(BlockingIOError):
                socks[out].send(frame)
        timeout_ms = None if not queue else max(0.0, (queue[0][0] - now) * 1e3)
        for fd, _ in poller.poll(timeout_ms):
            port = index[fd]
            while True:
                try:
                    frame = socks[port].recv(_MAX_FRAME)
                except BlockingIOError:
                    break
                where[frame[src_at : src_at + 6]] = port
                due = time.monotonic() + delay
                dst = frame[dst_at : dst_at + 6]
                out = where.get(dst)
                if dst[0] & 1 or out is None:
                    queue.extend((due, o, frame) for o in range(len(socks)) if o != port)
                elif out != port:
                    queue.append((due, out, frame))


# -- the built-in all_reduce check ---------------------------------------


def _allreduce_main() -> None:
    """Time FP32 and FP16 all_reduce of the same element count on every rank.

    Run by :func:`allreduce_check` in each rank; rank 0 prints one tagged
    JSON line. Imports torch lazily so the rest of this module stays cheap.
    """
    import torch
    import torch.distributed as dist

    megabytes, repeats = float(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = int(megabytes * 2**20) // 4
    out: dict[str, Any] = {"numel": numel, "fp32_megabytes": numel * 4 / 2**20, "world": world}
    for dtype in (torch.float32, torch.float16):
        t = torch.full((numel,), float(rank + 1), dtype=dtype)
        dist.all_reduce(t)  # warm-up, also a correctness check
        expected = world * (world + 1) / 2
        if not bool((t == expected).all()):
            raise RuntimeError(f"all_reduce {dtype} gave {t[:4]}, expected {expected}")
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        # Every rank waits for the slowest, so the max over ranks is the step time.
        worst = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        name = str(dtype).removeprefix("torch.")
        out[name] = {"seconds": worst.tolist(), "median_s": statistics.median(worst.tolist())}
    dist.destroy_process_group()
    if rank == 0:
        print(_RESULT_TAG + json.dumps(out), flush=True)


def allreduce_check(
    cluster: EmulatedCluster, megabytes: float = 64.0, repeats: int = 5, timeout: float = 600.0
) -> dict[str, Any]:
    """Time a Gloo all_reduce of ``megabytes`` of FP32 (and as many FP16) in ``cluster``.

    Args:
        cluster: a started cluster.
        megabytes: FP32 tensor size in MiB (the FP16 tensor has as many elements).
        repeats: timed repeats per dtype (after one warm-up).
        timeout: seconds before all ranks are killed.

    Returns:
        ``{"float32": {"seconds": [...], "median_s": ...}, "float16": {...}, ...}``.

    Example:
        >>> allreduce_check(cluster, 64, repeats=5)["float32"]["median_s"]  # doctest: +SKIP
        1.02
    """
    argv = [sys.executable, "-c", "import benchmarks.cluster as c; c._allreduce_main()"]
    results = cluster.run([*argv, str(megabytes), str(repeats)], timeout=timeout)
    if not all(r.ok for r in results):
        details = "\n".join(f"--- rank {r.rank} (exit {r.returncode})\n{r.output}" for r in results)
        raise ClusterError(f"all_reduce check failed:\n{details}")
    for line in results[0].output.splitlines():
        if line.startswith(_RESULT_TAG):
            return json.loads(line[len(_RESULT_TAG) :])
    raise ClusterError(f"all_reduce check printed no result:\n{results[0].output}")


# -- command line ----------------------------------------------------------


def add_topology_arguments(parser: argparse.ArgumentParser, *, ranks_default: int | None) -> None:
    """``--ranks``, ``--nodes``, ``--ranks-per-node``, ``--intra-node-bandwidth``, ``--delay``.

    Their values go to :class:`EmulatedCluster` as ``ranks``, ``nodes``,
    ``ranks_per_node``, ``intra_node_bandwidth`` and ``delay``; with
    ``--nodes`` given, ``--ranks`` may be left out (``ranks_default`` applies
    only when neither is given).

    Example:
        >>> p = argparse.ArgumentParser()
        >>> add_topology_arguments(p, ranks_default=4)
        >>> a = p.parse_args(["--nodes", "2", "--ranks-per-node", "2"])
        >>> cluster_topology(a, ranks_default=4)
        {'ranks': None, 'nodes': 2, 'ranks_per_node': 2, 'intra_node_bandwidth': None, 'delay': None}
    """
    parser.add_argument(
        "--ranks",
        type=int,
        default=None,
        help=f"number of ranks (default: nodes x ranks-per-node, else {ranks_default})",
    )
    parser.add_argument(
        "--nodes", type=int, default=None, help="nodes, each a namespace holding its ranks"
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="ranks per node (LOCAL_WORLD_SIZE); they share the node's link (default 1)",
    )
    parser.add_argument(
        "--intra-node-bandwidth",
        default=None,
        help="rate of each node's loopback, shared by its ranks (default: unshaped)",
    )
    parser.add_argument(
        "--delay",
        default=None,
        help="one-way delay between nodes, e.g. 0.5ms (a userspace switch replaces the bridge)",
    )


def cluster_topology(args: argparse.Namespace, *, ranks_default: int) -> dict[str, Any]:
    """The :class:`EmulatedCluster` keyword arguments from :func:`add_topology_arguments`' flags.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> add_topology_arguments(p, ranks_default=4)
        >>> cluster_topology(p.parse_args([]), ranks_default=4)["ranks"]
        4
    """
    ranks = args.ranks
    if ranks is None and args.nodes is None:
        ranks = ranks_default * args.ranks_per_node
    return {
        "ranks": ranks,
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "intra_node_bandwidth": args.intra_node_bandwidth,
        "delay": args.delay,
    }


def add_pin_argument(parser: argparse.ArgumentParser) -> None:
    """``--pin auto|always|never``: the ``pin_cpus`` of an :class:`EmulatedCluster` (``PIN_CHOICES``)."""
    parser.add_argument(
        "--pin",
        choices=list(PIN_CHOICES),
        default="auto",
        help="pin rank r to CPU r mod CPUs: always, never, or auto (when ranks outnumber CPUs)",
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster",
        description=(
            "Run a command on K ranks (M nodes of L ranks), each node in its own network "
            "namespace behind a tbf-shaped veth, after measuring and printing the link's "
            "bandwidth and RTT."
        ),
        epilog=(
            "example: python -m benchmarks.cluster --ranks 4 --bandwidth 1gbit -- "
            "python train.py --epochs 1"
        ),
    )
    add_topology_arguments(p, ranks_default=4)
    p.add_argument(
        "--bandwidth", default="1gbit", help="per-node link rate, tc syntax (default 1gbit)"
    )
    p.add_argument("--mtu", type=int, default=1500, help="veth MTU (default 1500)")
    add_pin_argument(p)
    p.add_argument(
        "--congestion-control",
        default=DEFAULT_CONGESTION_CONTROL,
        help=(
            f"TCP congestion control in the rank namespaces (default {DEFAULT_CONGESTION_CONTROL}; "
            "'host' keeps the machine's default)"
        ),
    )
    p.add_argument("--loopback", action="store_true", help="no namespaces, 127.0.0.1, no shaping")
    p.add_argument(
        "--fallback-loopback",
        action="store_true",
        help="use loopback (with a warning) when namespaces are unavailable instead of failing",
    )
    p.add_argument(
        "--probe-mb", type=float, default=None, help="bulk transfer size for the link probe"
    )
    p.add_argument("--no-probe", action="store_true", help="skip the link measurement")
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds before all ranks are killed"
    )
    p.add_argument(
        "--allreduce-mb",
        type=float,
        default=None,
        help="run the built-in FP32/FP16 gloo all_reduce timing of this many MiB (FP32)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats for --allreduce-mb")
    p.add_argument("--json-out", type=Path, default=None, help="write link stats and results here")
    p.add_argument(
        "--cleanup-stale",
        action="store_true",
        help="delete namespaces left by killed runs (dead pid) and exit",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every rank runs")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status.

    Example:
        >>> main(["--ranks", "2", "--loopback", "--", "true"])  # doctest: +SKIP
        0
    """
    args = _parser().parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if args.cleanup_stale:
        removed = cleanup_stale_namespaces()
        print(f"removed {len(removed)} stale namespaces: {' '.join(removed)}")
        return 0
    if not command and args.allreduce_mb is None and args.no_probe:
        print("nothing to do: give a command after --, --allreduce-mb, or drop --no-probe")
        return 2
    try:
        cluster = EmulatedCluster(
            bandwidth=args.bandwidth,
            loopback=args.loopback,
            fallback_to_loopback=args.fallback_loopback,
            mtu=args.mtu,
            pin_cpus=PIN_CHOICES[args.pin],
            congestion_control=None
            if args.congestion_control == "host"
            else args.congestion_control,
            **cluster_topology(args, ranks_default=4),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    given = sys.argv[1:] if argv is None else list(argv)
    record: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "benchmarks.cluster", *given]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "torch": _installed_version("torch"),
        },
    }
    status = 0
    try:
        with cluster:
            record["namespaces"] = cluster.namespaces
            if not cluster.loopback:
                burst, limit = tbf_parameters(cluster.bits_per_s)
                record["tbf"] = {
                    "rate_bits_per_s": cluster.bits_per_s,
                    "burst_bytes": burst,
                    "limit_bytes": limit,
                }
            if not args.no_probe:
                nbytes = None if args.probe_mb is None else int(args.probe_mb * 2**20)
                stats = cluster.link_stats(transfer_bytes=nbytes)
                print(stats.summary(), flush=True)
                record["link"] = stats.to_dict()
                if cluster.ranks_per_node > 1 and not cluster.loopback:
                    intra = cluster.link_stats(dst=1, transfer_bytes=nbytes)
                    print(intra.summary(), flush=True)
                    record["link_intra_node"] = intra.to_dict()
            if args.allreduce_mb is not None:
                res = allreduce_check(
                    cluster, args.allreduce_mb, args.repeats, args.timeout or 600.0
                )
                for name in ("float32", "float16"):
                    times = ", ".join(f"{s:.3f}" for s in res[name]["seconds"])
                    print(
                        f"all_reduce {name} {res['numel']} elements ({args.allreduce_mb:g} MiB FP32): "
                        f"median {res[name]['median_s']:.3f} s  [{times}]",
                        flush=True,
                    )
                if "link" in record:
                    # A ring all-reduce moves 2 (N-1)/N of the tensor through each
                    # rank's link: the floor any algorithm on this link must pay.
                    wire = 2 * (cluster.ranks - 1) / cluster.ranks * res["numel"] * 8
                    bw = record["link"]["bandwidth_bits_per_s"]
                    res["ring_bound_s"] = {"float32": wire * 4 / bw, "float16": wire * 2 / bw}
                record["allreduce"] = res
            if command:
                results = cluster.run(command, timeout=args.timeout, echo=True)
                record["returncodes"] = [r.returncode for r in results]
                for r in results:
                    if not r.ok:
                        why = f"exited {r.returncode}"
                        if r.timed_out:
                            why = "timed out"
                        elif r.killed:
                            why = "stopped after another rank failed"
                        print(f"rank {r.rank} {why}", file=sys.stderr)
                # Exit like the rank that failed first on its own (as torchrun
                # does), or 124 like timeout(1) when the run was cut short.
                own = [r for r in results if not r.ok and not r.killed and not r.timed_out]
                if own:
                    code = own[0].returncode
                    status = code if code is not None and code > 0 else 1
                elif any(r.timed_out for r in results):
                    status = 124
    except ClusterUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        # The cluster is already torn down by the `with`; exit like a shell would.
        print("interrupted; cluster removed", file=sys.stderr)
        return 128 + signal.SIGINT
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(record, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
