"""What every rank must agree on before the first gradient moves: groups, backend, configuration.

The DDP hook and the FSDP2 reduce-scatter bind the same way: a process
group of their own (so their collectives never interleave with DDP's or
FSDP's), the backend that group uses for the gradients' device, the
configuration compared across ranks, and the node topology. Every check
here gathers what every rank sees *before* any rank raises, so a problem on
one rank is the same error on every rank, never a hang. Before any of that,
:func:`wait_for_ranks` makes sure every rank has reached the call at all: a
rank that never does is named within :data:`ARRIVAL_TIMEOUT_S`, instead of
the others waiting silently for the group's timeout.

Example:
    >>> group = new_group()                                       # doctest: +SKIP
    >>> backend_for(group, torch.device("cpu"))                   # doctest: +SKIP
    'gloo'
    >>> agree(group, "fmt=e4m3", what="APSState configuration")   # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from aps_comm import teardown
from aps_comm.config import Reduction
from aps_comm.topology import (
    NodeGroups,
    Topology,
    by_rank,
    check_topology,
    env_ranks_per_node,
    grid_rows,
    node_groups,
    ranks_text,
)

__all__ = [
    "ARRIVAL_TIMEOUT_S",
    "BACKENDS",
    "Layouts",
    "agree",
    "backend_for",
    "bind_topology",
    "check_backend",
    "gather",
    "group_timeout",
    "new_group",
    "new_subgroup",
    "seen_topology",
    "wait_for_ranks",
]

BACKENDS: tuple[str, ...] = ("gloo", "nccl", "mpi")
"""Backends the hook runs on (the group's backend for the gradients' device)."""

ARRIVAL_TIMEOUT_S = 60.0
"""Seconds ``register`` waits for every rank to reach it before naming those that did not.

Never longer than the group's own timeout. Raise it (``aps_comm.agreement.ARRIVAL_TIMEOUT_S
= 600``, before ``register``, on every rank) when ranks reach ``register`` far apart on
purpose, e.g. one rank loads a checkpoint first.
"""

# Added to a call's arrival counter by a rank that stopped waiting: arrivals
# stay countable below it, and a rank that arrives later sees that it is late.
_GAVE_UP = 1 << 40
# Differing texts agree() lists, at most.
_SHOWN = 3
# Per process group name, how many register calls this process has made on it.
_calls: collections.Counter[str] = collections.Counter()


def wait_for_ranks(what: str, group: dist.ProcessGroup | None = None) -> None:
    """Announce that this rank reached ``what``; wait, bounded, until every rank of ``group`` has.

    Call it first in a collective call such as ``register``, before any
    collective: a rank that never gets there would otherwise leave the others
    in the call's first collective, silently, for the group's whole timeout.
    Uses the default group's store (no collective): each call on a group is
    numbered per process, so every rank must make its calls on the group in
    the same order. The wait is :data:`ARRIVAL_TIMEOUT_S`, or the group's
    timeout if shorter. All ranks that arrived decide alike: they go on only
    if every rank arrived before any of them stopped waiting.

    Args:
        what: the call, as the user wrote it ("aps_comm.register").
        group: the ranks that must arrive; default: all ranks.

    Raises:
        RuntimeError: a rank of ``group`` did not arrive in time (the message
            names the ranks), or this rank arrived after another had stopped
            waiting for it.

    Example:
        >>> wait_for_ranks("aps_comm.register")  # doctest: +SKIP
    """
    group = group if group is not None else dist.group.WORLD
    members = dist.get_process_group_ranks(group)
    if len(members) < 2:
        return
    store = dist.distributed_c10d._get_default_store()
    call = _calls[group.group_name]
    _calls[group.group_name] += 1
    prefix = f"aps_comm/arrival/{group.group_name}/{call}/"
    counter, everyone = prefix + "arrived", prefix + "all"
    wait_s = min(ARRIVAL_TIMEOUT_S, group_timeout(group).total_seconds())
    timeout = datetime.timedelta(seconds=wait_s)
    rule = (
        f"{what} is collective: every rank must call it, in the same order as its other "
        f"{what} calls"
    )
    arrived = store.add(counter, 1)
    store.set(prefix + str(dist.get_rank()), str(arrived))
    if arrived % _GAVE_UP == len(members):
        store.set(everyone, str(arrived))  # the last to arrive says whether it was late
    if arrived >= _GAVE_UP:
        raise RuntimeError(
            f"{rule}; this rank (rank {dist.get_rank()}) reached it after the others had "
            f"stopped waiting for it ({wait_s:.0f} s, aps_comm.agreement.ARRIVAL_TIMEOUT_S)"
        )
    try:
        store.wait([everyone], timeout)
    except dist.DistStoreError:
        count = store.add(counter, _GAVE_UP) % _GAVE_UP
        if count < len(members):
            missing = [r for r in members if not store.check([prefix + str(r)])]
            raise RuntimeError(
                f"{rule}. {ranks_text(missing).capitalize()} did not reach it within {wait_s:.0f} s "
                f"of rank {dist.get_rank()} ({count} of {len(members)} ranks did). If a rank "
                "is slower to get there on purpose, raise aps_comm.agreement.ARRIVAL_TIMEOUT_S."
            ) from None
        # Every rank had arrived before this one gave up: the last is setting `everyone`.
        store.wait([everyone], timeout)
    if int(store.get(everyone)) >= _GAVE_UP:
        values = store.multi_get([prefix + str(r) for r in members])
        late = [r for r, v in zip(members, values, strict=True) if int(v) >= _GAVE_UP]
        raise RuntimeError(
            f"{rule}. {ranks_text(late).capitalize()} reached it more than {wait_s:.0f} s after "
            "another rank, which stopped waiting (aps_comm.agreement.ARRIVAL_TIMEOUT_S)"
        )


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta:
    """The timeout of ``group``'s backend (the default group's when None).

    Example:
        >>> group_timeout()  # no process group yet: torch's default
        datetime.timedelta(seconds=1800)
    """
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return dist.default_pg_timeout


def new_group(timeout: datetime.timedelta | None = None) -> dist.ProcessGroup:
    """A new group over all ranks, with the default group's timeout unless one is given.

    Collective: every rank must call it, in the same order as its other
    ``new_group`` calls. The group has the default group's backends (for a
    default group made without a backend: Gloo for CPU, NCCL for CUDA).
    """
    # Recorded for the exit handler: its Gloo threads must be joined before
    # Python shuts down, even after the state that made it is gone.
    return teardown.join_at_exit(dist.new_group(timeout=timeout or group_timeout()))


def new_subgroup(
    ranks: Sequence[Sequence[int]], timeout: datetime.timedelta | None = None
) -> dist.ProcessGroup:
    """New groups over each list of ``ranks``; the one holding this rank.

    Collective: every rank must call it with the same lists in the same
    order (each ``dist.new_group`` is), and the lists must cover this rank.
    Each group has the default group's timeout unless one is given.

    Example:
        >>> replicas = new_subgroup([[0, 2], [1, 3]])  # doctest: +SKIP
    """
    me = dist.get_rank()
    mine: dist.ProcessGroup | None = None
    for members in ranks:
        group = dist.new_group(list(members), timeout=timeout or group_timeout())
        if me in members:
            mine = teardown.join_at_exit(group)
    if mine is None:
        raise ValueError(f"rank {me} is in none of the groups {[list(r) for r in ranks]}")
    return mine


def backend_for(group: dist.ProcessGroup, device: torch.device) -> str:
    """The name of the backend ``group`` uses for tensors on ``device`` ("gloo", "nccl", ...).

    ``dist.get_backend`` answers "undefined" for a group made by
    ``init_process_group()`` without a backend, and "cpu:gloo,cuda:nccl" for
    a per-device spec: the backend that matters is the one the device's
    collectives go to, which only the group knows.

    Raises:
        ValueError: the group has no backend for ``device``'s type.
    """
    try:
        return str(group._get_backend(device).name()).lower()
    except (AttributeError, RuntimeError):
        pass
    spec = str(dist.get_backend(group)).lower()
    for part in spec.split(","):
        dev, sep, name = part.partition(":")
        if not sep:
            return dev
        if dev == device.type:
            return name
    raise ValueError(
        f"the process group has no backend for {device.type} tensors (backends: {spec!r}); "
        "initialise it with a backend for the gradients' device, e.g. "
        "init_process_group() (Gloo for CPU, NCCL for CUDA)"
    )


def check_backend(backend: str, device: torch.device) -> None:
    """Refuse backends and device pairings the hook cannot run on, naming both.

    Example:
        >>> check_backend("nccl", torch.device("cpu"))
        Traceback (most recent call last):
        ...
        ValueError: the nccl backend needs CUDA gradients, got cpu
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"aps_comm does not support the {backend!r} backend for {device.type} "
            f"gradients; supported: {BACKENDS}"
        )
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"the nccl backend needs CUDA gradients, got {device.type}")


def gather(group: dist.ProcessGroup, mine: Any) -> list[Any]:
    """Every rank's ``mine``, indexed by rank in ``group`` (one ``all_gather_object``)."""
    everyone: list = [None] * group.size()
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def agree(
    group: dist.ProcessGroup,
    mine: str | Mapping[str, str],
    *,
    what: str,
    problem: str = "",
    refused: str | None = None,
) -> None:
    """Compare ``mine`` across the ranks of ``group``; every rank raises the same error.

    Collective (one ``all_gather_object``). ``problem`` is this rank's reason
    not to go on ("" when there is none): problems are reported first, so a
    rank that cannot proceed stops every rank instead of leaving them in a
    collective it will never join, under ``refused`` (default: ``what``).

    ``mine`` is one text, or named texts (e.g. the configuration, then one per
    unit of a model): then only those that differ are listed, the first
    three of them. Ranks with the same text are named together
    (:func:`aps_comm.topology.by_rank`), and a problem every rank has is said once.

    Raises:
        ValueError: some rank has a problem, or ``mine`` differs across ranks.
    """
    fields = {"": mine} if isinstance(mine, str) else dict(mine)
    everyone = gather(group, (problem, fields))
    problems = [p for p, _ in everyone]
    if any(problems):
        same = all(p == problems[0] for p in problems)
        raise ValueError(f"{refused or what}: {problems[0] if same else by_rank(problems)}")
    names = list(dict.fromkeys(k for _, f in everyone for k in f))
    differ = [k for k in names if any(f.get(k) != fields.get(k) for _, f in everyone)]
    if not differ:
        return
    listed = [
        f"{k + ': ' if k else ''}{by_rank([f.get(k, '(none)') for _, f in everyone])}"
        for k in differ[:_SHOWN]
    ]
    if len(differ) > _SHOWN:
        listed.append(f"and {len(differ) - _SHOWN} more of {len(names)}")
    raise ValueError(f"{what} differs across ranks: " + " | ".join(listed))


def seen_topology(ranks_per_node: int | None) -> tuple[int, int | None, bool]:
    """(ranks per node, LOCAL_RANK, whether the layout was stated) as this rank sees them.

    The ranks per node come from ``ranks_per_node``, else ``LOCAL_WORLD_SIZE``;
    when neither says, it is 1 and not *stated*: then ``LOCAL_RANK`` alone
    (Lightning sets it without ``LOCAL_WORLD_SIZE``) says nothing about the
    layout and is not checked. Errors become ranks per node 0, reported by
    :func:`aps_comm.topology.check_topology` on every rank.
    """
    try:
        env = env_ranks_per_node()
    except ValueError:
        return 0, None, True
    stated = ranks_per_node is not None or env is not None
    per = ranks_per_node or env or 1
    local = os.environ.get("LOCAL_RANK")
    check_local = stated and ranks_per_node is None
    return per, int(local) if local and local.isdigit() and check_local else None, stated


@dataclasses.dataclass(frozen=True)
class Layouts:
    """The node layouts a bound state reduces with.

    Attributes:
        topology: nodes of ranks, as the ranks agreed (1 rank per node when
            unknown).
        nodes: hierarchical reduction's groups, where it can run.
        grid: the grid reduction's groups, where it can run.
    """

    topology: Topology
    nodes: NodeGroups | None = None
    grid: NodeGroups | None = None

    def node_layouts(self, rank: int) -> dict[str, tuple[int, int]]:
        """Per staged route that can run, its (ranks per node or rows, this rank)."""
        out = {}
        for name, groups in (("hierarchical", self.nodes), ("grid", self.grid)):
            if groups is not None:
                out[name] = (groups.topology.ranks_per_node, rank)
        return out


def bind_topology(
    seen: Sequence[tuple[int, int | None, bool]],
    group: dist.ProcessGroup,
    reduction: Reduction,
    *,
    grid_ok: bool,
    explicit: bool = False,
    timeout: datetime.timedelta | None = None,
) -> Layouts:
    """Check what every rank saw and create the groups hierarchical and grid reductions use.

    Collective over ``group`` when it creates groups (every rank makes the
    same decisions from the same gathered ``seen``).

    Args:
        seen: every rank's :func:`seen_topology`.
        group: the state's group.
        reduction: what was asked.
        grid_ok: "auto" may use the grid (it is off with error feedback).
        explicit: the user gave the ranks per node (a wrong layout is then an error).
        timeout: the subgroups' timeout; default: ``group``'s.

    Raises:
        ValueError: "grid" was asked on a world with no grid; the topology is
            inconsistent where hierarchical was asked or the layout was stated.
    """
    world_size = group.size()
    timeout = timeout or group_timeout(group)
    rows = grid_rows(world_size)
    if reduction == Reduction.GRID and rows < 2:
        raise ValueError(
            f"reduction='grid' lays the ranks on a g x N/g grid with 2 <= g <= sqrt(N); "
            f"the world size {world_size} has no such divisor"
        )
    grid = None
    if reduction == Reduction.GRID or (reduction == Reduction.AUTO and rows >= 2 and grid_ok):
        grid = node_groups(Topology(world_size, rows), group, timeout)
    wanted = reduction == Reduction.HIERARCHICAL
    try:
        topology = check_topology([(per, local) for per, local, _ in seen], world_size)
    except ValueError as exc:
        if wanted or explicit:
            raise
        if reduction == Reduction.AUTO and grid_ok and any(stated for *_, stated in seen):
            # A stated layout "auto" could have used: flat reductions still
            # work; say why hierarchical won't run.
            warnings.warn(
                f"aps_comm: no hierarchical reduction: {exc}", RuntimeWarning, stacklevel=4
            )
        return Layouts(Topology(world_size, 1), None, grid)
    nodes = None
    if wanted or (reduction == Reduction.AUTO and 1 < topology.ranks_per_node < world_size):
        if grid is not None and grid.topology == topology:
            nodes = grid  # the same groups
        else:
            nodes = node_groups(topology, group, timeout)
    return Layouts(topology, nodes, grid)
