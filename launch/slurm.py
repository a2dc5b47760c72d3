"""Read SLURM's compressed node and task lists without calling ``scontrol``.

``srun`` describes the step in environment variables whose values use SLURM's
range syntax (``node[01-04,07]``, ``2(x3),1``). These helpers decode just what
a launcher needs: the first node (where rank 0 runs with the default block
distribution), the number of tasks on this node, and a port every task can
derive from the job id without talking to the others.

Example:
    >>> first_host("gpu[07-09,12],login1")
    'gpu07'
    >>> tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["first_host", "local_world_size", "master_addr", "port_from_job_id", "tasks_per_node"]

# Below Linux's default ephemeral range (32768-60999), so the derived port does
# not collide with ports the kernel hands out to outgoing connections.
_PORT_BASE = 15000
_PORT_SPAN = 15000

_BRACKET = re.compile(r"\[([^\]]*)\]")


def first_host(nodelist: str) -> str:
    """The first host name of a SLURM node list.

    Args:
        nodelist: e.g. ``SLURM_STEP_NODELIST``, ``"n[3-5]-ib,login"``.

    Returns:
        The first name with every bracket expanded to its first value,
        keeping zero padding.

    Example:
        >>> first_host("rack[2-3]-n[001-004]")
        'rack2-n001'
    """
    depth = 0
    end = len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    head = nodelist[:end].strip()
    if not head:
        raise ValueError(f"empty SLURM node list {nodelist!r}")
    return _BRACKET.sub(lambda m: m.group(1).split(",")[0].split("-")[0], head)


def tasks_per_node(spec: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``) to one count per node.

    Example:
        >>> tasks_per_node("4")
        [4]
    """
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"cannot parse SLURM tasks-per-node {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def local_world_size(environ: Mapping[str, str], default: int) -> int:
    """Tasks on this node, from the step's (or job's) tasks-per-node list.

    Args:
        environ: SLURM's variables.
        default: returned when SLURM did not say (hand-made environments).

    Example:
        >>> local_world_size({"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"}, 1)
        2
    """
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return default
    counts = tasks_per_node(spec)
    node = int(environ.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else default


def master_addr(environ: Mapping[str, str]) -> str:
    """Where rank 0 runs: loopback for a one-node step, else the first node.

    Falls back to ``SLURM_LAUNCH_NODE_IPADDR`` (the host ``srun`` ran on)
    when no node list is set.

    Example:
        >>> master_addr({"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "a[1-2]"})
        'a1'
    """
    nnodes = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES")
    if nnodes == "1":
        return "127.0.0.1"
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if environ.get(name):
            return first_host(environ[name])
    if environ.get("SLURM_LAUNCH_NODE_IPADDR"):
        return environ["SLURM_LAUNCH_NODE_IPADDR"]
    raise ValueError(
        "SLURM job spanning several nodes without SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, "
        "SLURM_NODELIST or SLURM_LAUNCH_NODE_IPADDR; export MASTER_ADDR"
    )


def port_from_job_id(job_id: int) -> int:
    """A port all tasks of a job agree on without communicating.

    Two jobs sharing a node get different ports unless their ids are
    ``15000`` apart; pass ``--master-port`` to be certain.

    Example:
        >>> port_from_job_id(123456), port_from_job_id(123457), port_from_job_id(138456)
        (18456, 18457, 18456)
    """
    return _PORT_BASE + job_id % _PORT_SPAN
