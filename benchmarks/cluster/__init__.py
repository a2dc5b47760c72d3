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

Modules: :mod:`~benchmarks.cluster.netns` (namespaces, ``tc`` shaping, rate
and delay parsing), :mod:`~benchmarks.cluster.emulated` (the cluster, its
ranks and link measurements), :mod:`~benchmarks.cluster.switch` (the
delaying switch), :mod:`~benchmarks.cluster.probe` (the link probe and the
all_reduce check, run inside the namespaces), :mod:`~benchmarks.cluster.cli`
(the command line). Everything public is importable from here.

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

from benchmarks.cluster.cli import (
    PIN_CHOICES,
    add_pin_argument,
    add_topology_arguments,
    cluster_topology,
    main,
)
from benchmarks.cluster.emulated import EmulatedCluster, LinkStats, RankResult, allreduce_check
from benchmarks.cluster.netns import (
    DEFAULT_CONGESTION_CONTROL,
    NS_PREFIX,
    ClusterError,
    ClusterUnavailable,
    cleanup_stale_namespaces,
    netns_unavailable_reason,
    parse_delay,
    parse_rate,
    tbf_parameters,
)

__all__ = [
    "DEFAULT_CONGESTION_CONTROL",
    "NS_PREFIX",
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
