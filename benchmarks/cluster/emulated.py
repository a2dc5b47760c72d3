"""The emulated cluster: M nodes of L ranks, each node behind its own shaped link.

:class:`EmulatedCluster` builds the namespaces, the bridge (or the delaying
:mod:`benchmarks.cluster.switch`) and the shaped veths
(:mod:`benchmarks.cluster.netns`), runs commands on every rank, measures a
link with :mod:`benchmarks.cluster.probe`, and tears everything down on every
exit path.

Example:
    >>> with EmulatedCluster(ranks=2, bandwidth="100mbit") as c:  # doctest: +SKIP
    ...     print(c.link_stats().summary())
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import re
import secrets
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.cluster import netns
from benchmarks.cluster.netns import (
    DEFAULT_CONGESTION_CONTROL,
    ClusterError,
    ClusterUnavailable,
    parse_delay,
    parse_rate,
)

__all__ = ["RESULT_TAG", "EmulatedCluster", "LinkStats", "RankResult", "allreduce_check"]


_DEFAULT_MASTER_PORT = 29500
_REPO_ROOT = Path(__file__).resolve().parents[2]
# What the all_reduce check's rank 0 prints before its JSON result.
RESULT_TAG = "APS_CLUSTER_RESULT "


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
        if isinstance(ranks_per_node, bool) or not 1 <= ranks_per_node <= netns.MAX_RANKS:
            raise ValueError(
                f"ranks_per_node must be in [1, {netns.MAX_RANKS}], got {ranks_per_node}"
            )
        if nodes is None:
            if ranks is None:
                nodes = 2
            elif ranks % ranks_per_node:
                raise ValueError(
                    f"ranks={ranks} is not a multiple of ranks_per_node={ranks_per_node}"
                )
            else:
                nodes = ranks // ranks_per_node
        if not 1 <= nodes <= netns.MAX_RANKS:
            raise ValueError(f"nodes must be in [1, {netns.MAX_RANKS}], got {nodes}")
        if ranks is not None and ranks != nodes * ranks_per_node:
            raise ValueError(
                f"ranks={ranks} does not match nodes={nodes} x ranks_per_node={ranks_per_node}"
            )
        ranks = nodes * ranks_per_node
        if not 1 <= ranks <= netns.MAX_RANKS:
            raise ValueError(f"ranks must be in [1, {netns.MAX_RANKS}], got {ranks}")
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
        self.name = f"{netns.NS_PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.shaped = not loopback  # the node links' tbf qdiscs are in place
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
        return "127.0.0.1" if self.loopback else f"{netns.SUBNET}.{self.node(rank) + 1}"

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
        reason = None if self.loopback else netns.netns_unavailable_reason()
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
            netns.run_command(["ip", "netns", "add", ns])
        except ClusterError as exc:
            if first:
                # The kernel or a container forbids namespaces altogether.
                raise ClusterUnavailable(f"cannot create a network namespace: {exc}") from exc
            raise

    def _build(self) -> None:
        bns = self.bridge_namespace
        self._add_netns(bns)
        if not self.delay_s:
            netns.run_command(["ip", "-n", bns, "link", "add", netns.BRIDGE_IF, "type", "bridge"])
            netns.run_command(["ip", "-n", bns, "link", "set", netns.BRIDGE_IF, "up"])
        for node in range(self.nodes):
            rank = node * self.ranks_per_node
            nns, nif, bif = self.node_namespace(node), self.interface(rank), f"apsb{node}"
            self._add_netns(nns)
            # Created inside the bridge namespace with the peer moved straight
            # into the node's: no interface ever appears in the host namespace.
            mtu = ["mtu", str(self.mtu)]
            veth = ["type", "veth", "peer", "name", nif, *mtu, "netns", nns]
            netns.run_command(["ip", "-n", bns, "link", "add", bif, *mtu, *veth])
            if self.delay_s:
                netns.run_command(["ip", "-n", bns, "link", "set", bif, "up"])
            else:
                netns.run_command(
                    ["ip", "-n", bns, "link", "set", bif, "master", netns.BRIDGE_IF, "up"]
                )
            netns.run_command(
                [
                    "ip",
                    "-n",
                    nns,
                    "addr",
                    "add",
                    f"{self.address(rank)}/{netns.PREFIX_LEN}",
                    "dev",
                    nif,
                ]
            )
            netns.run_command(["ip", "-n", nns, "link", "set", nif, "up"])
            netns.run_command(["ip", "-n", nns, "link", "set", "lo", "up"])
            if self.congestion_control is not None:
                netns.set_congestion_control(nns, self.congestion_control)
            self._shape_link(node)
            if self.intra_node_bits_per_s is not None:
                # lo carries 64 KiB packets: the bucket must hold one whole.
                lo_tbf = netns.tbf_args(
                    self.intra_node_bits_per_s, min_burst=netns.LO_MIN_BURST_BYTES
                )
                netns.run_command(["tc", "-n", nns, "qdisc", "replace", "dev", "lo", *lo_tbf])
        if self.delay_s:
            self._start_switch([f"apsb{node}" for node in range(self.nodes)])

    def unshape(self) -> None:
        """Remove the node links' rate limits: the same namespaces and veths, no tbf on them.

        Runs after it see the links at the veths' own rate (``link_stats``
        measures it): what a step costs without the slow link, on the same
        ranks, CPUs and TCP stack. The intra-node shaping and the delaying
        switch, if any, stay. Idempotent.

        Raises:
            ClusterError: the cluster is not started, or is in loopback mode
                (nothing is shaped there).

        Example:
            >>> with EmulatedCluster(nodes=2, ranks_per_node=2, bandwidth="250mbit") as c:  # doctest: +SKIP
            ...     c.unshape()
            ...     print(c.link_stats().summary())
        """
        if not self._started:
            raise ClusterError("cluster is not started; use `with EmulatedCluster(...)`")
        if self.loopback:
            raise ClusterError("a loopback cluster has no shaped links to unshape")
        if not self.shaped:
            return
        for node in range(self.nodes):
            nif, bif = self.interface(node * self.ranks_per_node), f"apsb{node}"
            netns.run_command(
                ["tc", "-n", self.node_namespace(node), "qdisc", "del", "dev", nif, "root"]
            )
            netns.run_command(
                ["tc", "-n", self.bridge_namespace, "qdisc", "del", "dev", bif, "root"]
            )
        self.shaped = False

    def shape(self) -> None:
        """Put the node links' rate limits back after :meth:`unshape`: the tbf qdiscs of start.

        Lets a run alternate shaped and unshaped rounds on the same ranks,
        so that drift over the run lands on both alike. Idempotent.

        Raises:
            ClusterError: the cluster is not started, or is in loopback mode
                (it has no links to shape).

        Example:
            >>> with EmulatedCluster(nodes=2, ranks_per_node=2, bandwidth="250mbit") as c:  # doctest: +SKIP
            ...     c.unshape()
            ...     c.shape()
            ...     print(c.link_stats().summary())
        """
        if not self._started:
            raise ClusterError("cluster is not started; use `with EmulatedCluster(...)`")
        if self.loopback:
            raise ClusterError("a loopback cluster has no links to shape")
        if self.shaped:
            return
        for node in range(self.nodes):
            self._shape_link(node)
        self.shaped = True

    def _shape_link(self, node: int) -> None:
        """Put the configured rate's tbf on ``node``'s link (at start and by :meth:`shape`)."""
        # Egress on each end: node -> bridge on the node side, bridge ->
        # node on the bridge side, i.e. a full-duplex link of this rate.
        tbf = netns.tbf_args(self.bits_per_s)
        nif, bif = self.interface(node * self.ranks_per_node), f"apsb{node}"
        netns.run_command(
            ["tc", "-n", self.node_namespace(node), "qdisc", "replace", "dev", nif, *tbf]
        )
        netns.run_command(["tc", "-n", self.bridge_namespace, "qdisc", "replace", "dev", bif, *tbf])

    def _start_switch(self, ports: list[str]) -> None:
        """Start the delaying switch in the bridge namespace; return once it forwards."""
        argv = [sys.executable, "-m", "benchmarks.cluster.switch"]
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
        path = "/proc/sys/" + netns.CC_SYSCTL.replace(".", "/")
        if self.loopback:
            with contextlib.suppress(OSError):
                return Path(path).read_text().strip() or None
            return None
        return (
            netns.run_command(
                ["ip", "netns", "exec", self.namespace(0), "cat", path], check=False
            ).strip()
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
                    failed = netns.delete_netns(ordered)
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
        # Lets `python -m benchmarks...` (probe, switch, benchmarks) run from a checkout.
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
            blocks.append(f"# {ns}\n" + netns.run_command(["tc", "-n", ns, "qdisc", "show"]))
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
            rate = self.intra_node_bits_per_s if intra else self.bits_per_s if self.shaped else None
        if transfer_bytes is None:
            transfer_bytes = 64 << 20 if rate is None else min(max(rate // 16, 2 << 20), 64 << 20)
        if timeout is None:
            timeout = 30.0 + (0.0 if rate is None else 4.0 * transfer_bytes * 8 / rate)
        probe = [sys.executable, "-m", "benchmarks.cluster.probe"]
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
    argv = [sys.executable, "-m", "benchmarks.cluster.probe", "allreduce"]
    results = cluster.run([*argv, str(megabytes), str(repeats)], timeout=timeout)
    if not all(r.ok for r in results):
        details = "\n".join(f"--- rank {r.rank} (exit {r.returncode})\n{r.output}" for r in results)
        raise ClusterError(f"all_reduce check failed:\n{details}")
    for line in results[0].output.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    raise ClusterError(f"all_reduce check printed no result:\n{results[0].output}")
