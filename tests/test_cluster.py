"""Tests of the emulated cluster (benchmarks/cluster.py).

The namespace tests need root and iproute2 and are marked ``root``; they skip
with the reason where the machine lacks them. The loopback and parsing tests
run anywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import cluster as cl

# Every rank prints its rendezvous environment and the result of a Gloo
# all_reduce of (rank + 1), so one run checks the env and the data path.
_RANK_SCRIPT = """
import json, os
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
t = torch.full((1000,), float(dist.get_rank() + 1))
dist.all_reduce(t)
keys = ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
        "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME", "EXTRA"]
cc = open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
print("RESULT " + json.dumps({"env": {k: os.environ.get(k) for k in keys},
                              "sum": sorted(set(t.tolist())), "cc": cc}))
dist.destroy_process_group()
"""

_FAIL_SCRIPT = (
    "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n"
)


def _host_state() -> tuple[list[str], str]:
    """Host-namespace links and qdiscs: none of it may change."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    names = sorted(line.split(":")[1].strip() for line in links.stdout.splitlines())
    qd = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, check=True)
    return names, qd.stdout


def _ours(prefix: str) -> list[str]:
    return [ns for ns in cl._list_netns() if ns.startswith(prefix)]


def _comm(pid: int) -> str:
    """The command name of ``pid``, or "" once it has exited."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.fixture
def netns() -> Iterator[None]:
    """Skip without root/iproute2/netns; afterwards check the host is untouched."""
    reason = cl.netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    probe = f"{cl.NS_PREFIX}{os.getpid()}-fixture"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "delete", probe], check=True)
    before = _host_state()
    yield
    assert _ours(f"{cl.NS_PREFIX}{os.getpid()}-") == []
    assert _host_state() == before


def _results(res: list[cl.RankResult]) -> list[dict]:
    out = []
    for r in res:
        assert r.ok, f"rank {r.rank} exit {r.returncode}:\n{r.output}"
        line = next(x for x in r.output.splitlines() if x.startswith("RESULT "))
        out.append(json.loads(line[len("RESULT ") :]))
    return out


def test_parse_rate_and_tbf_parameters() -> None:
    assert cl.parse_rate("1gbit") == 10**9
    assert cl.parse_rate("100mbit") == 10**8
    assert cl.parse_rate("2.5Mbit") == 2_500_000
    assert cl.parse_rate("1mbps") == 8 * 10**6  # tc: bps means bytes
    assert cl.parse_rate(5000) == 5000
    for bad in ("fast", "0mbit", "1 furlong"):
        with pytest.raises(ValueError):
            cl.parse_rate(bad)
    burst, limit = cl.tbf_parameters(10**9)
    assert burst >= 10**9 / 8 / 1000 and limit > burst
    assert cl.tbf_parameters(10**6)[0] >= 64 * 1024


def test_unavailable_raises_or_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cl.shutil, "which", lambda name: None)
    if cl.netns_unavailable_reason() is None:
        pytest.fail("missing ip/tc not detected")
    with pytest.raises(cl.ClusterUnavailable):
        cl.EmulatedCluster(ranks=2).start()
    with (
        pytest.warns(RuntimeWarning, match="falls back to loopback"),
        cl.EmulatedCluster(ranks=2, fallback_to_loopback=True) as c,
    ):
        assert c.loopback and c.namespaces == []
        assert c.env(1)["MASTER_ADDR"] == "127.0.0.1"


def test_kernel_refusing_namespaces_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    # Root and iproute2 present, but `ip netns add` is refused (e.g. a container).
    def fake_cmd(args: list[str], **kwargs: object) -> str:
        if args[:3] == ["ip", "netns", "add"]:
            raise cl.ClusterError("mount --make-shared /run/netns failed: Operation not permitted")
        return ""

    monkeypatch.setattr(cl, "netns_unavailable_reason", lambda: None)
    monkeypatch.setattr(cl, "_cmd", fake_cmd)
    with pytest.raises(cl.ClusterUnavailable, match="cannot create a network namespace"):
        cl.EmulatedCluster(ranks=2).start()
    with pytest.warns(RuntimeWarning, match="Operation not permitted"):
        c = cl.EmulatedCluster(ranks=2, fallback_to_loopback=True).start()
    c.close()
    assert c.loopback


def test_loopback_env_and_allreduce() -> None:
    with cl.EmulatedCluster(ranks=2, loopback=True) as c:
        stats = c.link_stats(transfer_bytes=8 << 20, pings=20)
        res = c.run([sys.executable, "-c", _RANK_SCRIPT], env={"EXTRA": "x"}, timeout=60)
    assert stats.loopback and stats.bandwidth_bits_per_s > 0 and stats.rtt_s > 0
    for rank, out in enumerate(_results(res)):
        assert out["sum"] == [3.0]
        env = out["env"]
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo"
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_PORT"] == str(c.master_port) and env["EXTRA"] == "x"


@pytest.mark.root
def test_namespaced_cluster_shapes_measures_and_reduces(netns: None) -> None:
    rate = "50mbit"
    with cl.EmulatedCluster(ranks=2, bandwidth=rate) as c:
        assert set(c.namespaces) <= set(cl._list_netns())
        qdiscs = c.qdiscs()
        # Both ends of both veths: aps0/aps1 on the rank side, apsb0/apsb1 on the bridge.
        assert qdiscs.count("tbf") == 4 and qdiscs.count("rate 50Mbit") == 4, qdiscs
        stats = c.link_stats(transfer_bytes=3 << 20, pings=50)
        res = c.run([sys.executable, "-c", _RANK_SCRIPT], env={"EXTRA": "y"}, timeout=60)
    print(stats.summary())
    assert stats.configured_bits_per_s == 50 * 10**6 and stats.ranks == 2
    assert 0.7 < stats.efficiency < 1.3, stats.summary()
    # Every rank's TCP runs the cluster's congestion control, not the host's.
    assert stats.congestion_control == cl.DEFAULT_CONGESTION_CONTROL == "reno"
    assert "tcp reno" in stats.summary()
    for rank, out in enumerate(_results(res)):
        assert out["sum"] == [3.0] and out["cc"] == "reno"
        env = out["env"]
        assert env["MASTER_ADDR"] == c.address(0) and env["GLOO_SOCKET_IFNAME"] == f"aps{rank}"
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["EXTRA"] == "y"
    assert _ours(c.name) == []


def _host_congestion_control() -> str:
    return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()


@pytest.mark.root
def test_congestion_control_host_default_and_bad_names(netns: None) -> None:
    host = _host_congestion_control()
    with cl.EmulatedCluster(ranks=2, bandwidth="100mbit", congestion_control=None) as c:
        assert c.tcp_congestion_control() == host
    with pytest.raises(ValueError, match="not a congestion control name"):
        cl.EmulatedCluster(ranks=2, congestion_control="reno; reboot")
    c = cl.EmulatedCluster(ranks=2, congestion_control="nosuchcc")
    with pytest.raises(cl.ClusterError, match=r"congestion control 'nosuchcc'.*allowed there"):
        c.start()
    assert _ours(c.name) == []
    assert _host_congestion_control() == host


@pytest.mark.root
def test_failed_rank_and_timeout_stop_everything(netns: None) -> None:
    with cl.EmulatedCluster(ranks=2, bandwidth="100mbit") as c:
        t0 = time.monotonic()
        res = c.run([sys.executable, "-c", _FAIL_SCRIPT], timeout=30)
        assert time.monotonic() - t0 < 20  # rank 0 was stopped, not waited for
        assert res[1].returncode == 3 and not res[1].ok
        assert res[0].killed and not res[0].ok
        res = c.run(["sleep", "60"], timeout=1)
        assert all(r.timed_out for r in res)
    assert _ours(c.name) == []


@pytest.mark.root
def test_exception_inside_context_cleans_up(netns: None) -> None:
    with pytest.raises(RuntimeError, match="boom"), cl.EmulatedCluster(ranks=3) as c:
        proc = c.popen(2, ["sleep", "60"])
        raise RuntimeError("boom")
    assert proc.poll() is not None
    assert _ours(c.name) == []


@pytest.mark.root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_cli_cleans_up(netns: None, sig: signal.Signals) -> None:
    cmd = [sys.executable, "-m", "benchmarks.cluster", "--ranks", "2", "--bandwidth", "10mbit"]
    cmd += ["--no-probe", "--", "sleep", "60"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
    prefix = f"{cl.NS_PREFIX}{proc.pid}-"
    deadline = time.monotonic() + 20
    pids: dict[str, int] = {}
    # Only the ranks' own `sleep` counts: during setup `ip`/`tc` pass through
    # the namespaces too, and signalling then would test a different moment.
    while time.monotonic() < deadline and len(pids) < 2:
        time.sleep(0.1)
        for ns in _ours(prefix):
            if ns.endswith(("-r0", "-r1")) and ns not in pids:
                out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
                sleeps = [int(p) for p in out.stdout.split() if _comm(int(p)) == "sleep"]
                if sleeps:
                    pids[ns] = sleeps[0]
    try:
        assert len(pids) == 2, f"ranks did not start: {pids}"
        proc.send_signal(sig)
        rc = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            # SIGKILL skips the CLI's own cleanup: sweep its namespaces here so
            # a failure does not leak them into the next test.
            proc.kill()
            proc.wait()
            cl.cleanup_stale_namespaces()
    assert rc != 0
    assert _ours(prefix) == []
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.root
def test_cleanup_stale_namespaces(netns: None) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{cl.NS_PREFIX}{dead.pid}-dead-b"
    live = f"{cl.NS_PREFIX}{os.getpid()}-live-b"
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        removed = cl.cleanup_stale_namespaces()
        assert stale in removed and live not in removed
        assert stale not in cl._list_netns() and live in cl._list_netns()
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


@pytest.mark.root
def test_setup_failure_cleans_up(netns: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Interface names are limited to 15 characters, so creating the bridge fails
    # after the bridge namespace exists: that namespace must still be removed.
    monkeypatch.setattr(cl, "_BRIDGE_IF", "x" * 20)
    c = cl.EmulatedCluster(ranks=2)
    with pytest.raises(cl.ClusterError, match="link add"):
        c.start()
    assert _ours(c.name) == []


@pytest.mark.parametrize(
    ("pin", "ranks_per_cpu", "pinned"),
    [("auto", 1, False), ("auto", 2, True), ("always", 1, True), ("never", 2, False)],
)
def test_cli_pins_ranks_only_when_they_outnumber_the_cpus(
    pin: str, ranks_per_cpu: int, pinned: bool
) -> None:
    cpus = len(os.sched_getaffinity(0))
    if cl.shutil.which("taskset") is None or not 2 <= cpus <= 8:
        pytest.skip("needs taskset and 2-8 CPUs")
    script = "import os; print('CPUS', len(os.sched_getaffinity(0)))"
    cmd = [sys.executable, "-m", "benchmarks.cluster", "--ranks", str(cpus * ranks_per_cpu)]
    cmd += ["--loopback", "--pin", pin, "--no-probe", "--", sys.executable, "-c", script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    counts = {int(line.split("CPUS")[1]) for line in out.splitlines() if "CPUS" in line}
    assert counts == ({1} if pinned else {cpus}), out
