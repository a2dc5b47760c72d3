"""Nodes and ranks: which ranks share a node, and the process groups of each level.

Hierarchical two_phase reduces in FP32 among the ranks of a node, then in the
wire format among the ranks that have the same local rank on every node. The
topology comes from the launcher (``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK``, set
by torchrun, aps-launch, SLURM and MPI through :mod:`aps_launch`) or is given
explicitly; ranks are node-major (rank = node * L + local rank), as every
launcher numbers them. Every rank checks what every other rank sees, so a
mismatch is one clear error on every rank rather than a hang.

Example:
    >>> t = Topology(world_size=8, ranks_per_node=4)
    >>> (t.nodes, t.node_ranks(1), t.peer_ranks(2))
    (2, [4, 5, 6, 7], [2, 6])
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping, Sequence

import torch.distributed as dist

from aps_comm.teardown import join_at_exit

# One rule for the hook and the model that prices it (the grid's rows g).
from aps_perfmodel.strategies import grid_rows

__all__ = [
    "NodeGroups",
    "Topology",
    "by_rank",
    "check_topology",
    "env_ranks_per_node",
    "grid_rows",
    "node_groups",
    "ranks_text",
]


def by_rank(texts: Sequence[str]) -> str:
    """Per-rank texts, the ranks with the same text said once ("ranks 0-2, 5: ...").

    Ranks whose text is empty are left out.

    Example:
        >>> by_rank(["a", "a", "a", "b", ""])
        'ranks 0-2: a; rank 3: b'
    """
    ranks: dict[str, list[int]] = {}
    for rank, text in enumerate(texts):
        if text:
            ranks.setdefault(text, []).append(rank)
    return "; ".join(f"{ranks_text(r)}: {text}" for text, r in ranks.items())


def ranks_text(ranks: Sequence[int]) -> str:
    """Ranks as text, consecutive ones as a range.

    Example:
        >>> ranks_text([3]), ranks_text([0, 1, 2, 5])
        ('rank 3', 'ranks 0-2, 5')
    """
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


@dataclasses.dataclass(frozen=True)
class Topology:
    """N ranks as M nodes of L ranks, node-major.

    Attributes:
        world_size: N.
        ranks_per_node: L; must divide N.
    """

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        n, per = self.world_size, self.ranks_per_node
        if n < 1 or per < 1 or n % per:
            raise ValueError(
                f"ranks_per_node={per} must be >= 1 and divide the world size {n} "
                "(every node must run the same number of ranks)"
            )

    @property
    def nodes(self) -> int:
        """M."""
        return self.world_size // self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The group ranks on ``node``, in local-rank order."""
        per = self.ranks_per_node
        return list(range(node * per, (node + 1) * per))

    def peer_ranks(self, local_rank: int) -> list[int]:
        """The group ranks with local rank ``local_rank``, in node order."""
        return list(range(local_rank, self.world_size, self.ranks_per_node))


def env_ranks_per_node(environ: Mapping[str, str] | None = None) -> int | None:
    """``LOCAL_WORLD_SIZE`` from the launcher's environment, or None when it is not set.

    Raises:
        ValueError: it is set but not a positive integer.
    """
    env = os.environ if environ is None else environ
    raw = env.get("LOCAL_WORLD_SIZE")
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be a positive integer, got {raw!r}")
    return value


def check_topology(seen: Sequence[tuple[int, int | None]], world_size: int) -> Topology:
    """The topology every rank agrees on, from what each rank saw.

    Args:
        seen: per group rank, (its ranks per node, its ``LOCAL_RANK`` from the
            environment or None).
        world_size: N.

    Raises:
        ValueError: the ranks disagree on the ranks per node, it does not
            divide N, or a rank's local rank is not its rank modulo L (ranks
            must be node-major). The message says what the ranks saw (ranks
            that saw the same named together), so every rank raises the same
            error.

    Example:
        >>> check_topology([(2, 0), (2, 1), (2, 0), (2, 1)], 4).nodes
        2
    """
    sizes = {per for per, _ in seen}
    if len(sizes) != 1:
        listing = by_rank([f"ranks_per_node={per}" for per, _ in seen])
        raise ValueError(f"the ranks disagree on the ranks per node: {listing}")
    per = sizes.pop()
    topology = Topology(world_size, per)  # every rank has the same ranks_per_node
    wrong = [r for r, (_, local) in enumerate(seen) if local is not None and local != r % per]
    if wrong:
        shown = "; ".join(f"rank {r}: LOCAL_RANK={seen[r][1]}" for r in wrong[:3])
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise ValueError(
            f"LOCAL_RANK is not the rank modulo {per} on {ranks_text(wrong)} ({shown}{more}): "
            "ranks must be numbered node by node (rank = node * ranks_per_node + local rank)"
        )
    return topology


@dataclasses.dataclass(frozen=True)
class NodeGroups:
    """This rank's two process groups of a hierarchical reduction.

    Attributes:
        topology: the layout.
        intra: the ranks of this rank's node (size L).
        inter: the ranks with this rank's local rank, one per node (size M).
        local_rank: this rank's position in ``intra``.
        node: this rank's position in ``inter``.
    """

    topology: Topology
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    local_rank: int
    node: int


def node_groups(
    topology: Topology, group: dist.ProcessGroup, timeout: datetime.timedelta
) -> NodeGroups:
    """Create the intra- and inter-node groups over ``group``'s ranks.

    Collective over ``group``: every rank creates every subgroup, in the same
    order (``torch.distributed.new_group``'s rule), each with ``timeout``.
    """
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    intra = inter = None
    for node in range(topology.nodes):
        members = [ranks[r] for r in topology.node_ranks(node)]
        pg = join_at_exit(dist.new_group(members, timeout=timeout, use_local_synchronization=False))
        if me in topology.node_ranks(node):
            intra = pg
    for local in range(topology.ranks_per_node):
        members = [ranks[r] for r in topology.peer_ranks(local)]
        pg = join_at_exit(dist.new_group(members, timeout=timeout, use_local_synchronization=False))
        if me in topology.peer_ranks(local):
            inter = pg
    assert intra is not None and inter is not None
    per = topology.ranks_per_node
    return NodeGroups(topology, intra, inter, me % per, me // per)
