"""``python -m benchmarks.cluster``: run a command on an emulated cluster, after measuring its link.

Also the flags other benchmarks share to describe a cluster
(:func:`add_topology_arguments`, :func:`add_pin_argument`).

Example::

    python -m benchmarks.cluster --ranks 4 --bandwidth 1gbit -- python script.py args
    python -m benchmarks.cluster --ranks 4 --bandwidth 1gbit --allreduce-mb 64
    python -m benchmarks.cluster --nodes 2 --ranks-per-node 2 --bandwidth 1gbit --delay 0.5ms
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.cluster.emulated import EmulatedCluster, allreduce_check
from benchmarks.cluster.netns import (
    DEFAULT_CONGESTION_CONTROL,
    ClusterUnavailable,
    cleanup_stale_namespaces,
    tbf_parameters,
)

__all__ = ["PIN_CHOICES", "add_pin_argument", "add_topology_arguments", "cluster_topology", "main"]


# --pin on the command lines: EmulatedCluster's pin_cpus.
PIN_CHOICES: dict[str, bool | None] = {"auto": None, "always": True, "never": False}


def _installed_version(package: str) -> str | None:
    """Version of an installed distribution, without importing it."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def add_topology_arguments(parser: argparse.ArgumentParser, *, ranks_default: int | None) -> None:
    """``--ranks``, ``--nodes``, ``--ranks-per-node``, ``--intra-node-bandwidth``, ``--delay``.

    Their values go to :class:`EmulatedCluster` as ``ranks``, ``nodes``,
    ``ranks_per_node``, ``intra_node_bandwidth`` and ``delay``; with
    ``--nodes`` given, ``--ranks`` may be left out (``ranks_default`` applies
    only when neither is given), and with both given ``--ranks-per-node``
    may be (``--nodes 2 --ranks 4``: 2 ranks per node).

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
        default=None,
        help=(
            "ranks per node (LOCAL_WORLD_SIZE); they share the node's link "
            "(default: ranks / nodes when both are given, else 1)"
        ),
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
    ranks, per_node = args.ranks, args.ranks_per_node
    if per_node is None:
        # `--nodes 2 --ranks 4` says 2 per node; EmulatedCluster names a
        # count that does not divide.
        both = ranks is not None and args.nodes is not None and args.nodes > 0
        per_node = max(1, ranks // args.nodes) if both else 1
    if ranks is None and args.nodes is None:
        ranks = ranks_default * per_node
    return {
        "ranks": ranks,
        "nodes": args.nodes,
        "ranks_per_node": per_node,
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
