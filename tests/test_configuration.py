"""Every argument of the hook's configuration is one the ranks and checkpoints compare.

An argument left out of :meth:`aps_comm.APSState.agreed_settings` would let
ranks with different settings run different collectives (a Gloo size
mismatch or a silently wrong gradient); one left out of
:meth:`aps_comm.APSState.describe`, a checkpoint load into a state it was not
made for. The arguments are read from ``APSState``, ``APSConfig`` and
``register`` themselves: a new one fails :func:`test_every_argument_is_classified`
until it is listed here, as compared or as free to differ per rank, with why.
Each compared argument is changed alone, against a base configuration that
makes it matter (block sizes and exponents only exist with block scaling).
"""

import dataclasses
import inspect

import pytest
import torch
import torch.nn as nn
from conftest import Net, capture, check_log
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import APSState, fsdp, register
from aps_comm.engine import ONE_CHUNK
from aps_comm.fsdp import APSFSDPConfig, APSFSDPState
from aps_comm.hook import APSConfig, StateOptions
from aps_comm.policy import KeepLast
from aps_comm.testing import run_distributed
from aps_perfmodel.collectives import LinkParams
from aps_perfmodel.profile import Profile

_LAYER = {"fmt": "e4m3", "reduction": "two_phase", "scaling": "layer"}
_BLOCK = {"fmt": "e2m1", "reduction": "two_phase", "scaling": "block"}
# A calibrated profile: with it "auto" may send small buckets in FP32 on Gloo.
_PROFILE = Profile(world_size=2, backend="gloo", link=LinkParams(alpha=1e-3, beta=8e-9))
# Per argument the ranks must agree on: (base configuration, the argument's other value).
AGREED: dict[str, tuple[dict, object]] = {
    "fmt": (_LAYER, "e5m2"),
    "reduction": (_LAYER, "allreduce"),
    "scaling": (_LAYER, "bucket"),
    "block_size": (_BLOCK, 64),
    "block_exponents": (_BLOCK, "agreed"),
    "policy": (_LAYER, [KeepLast("fp32")]),
    "error_feedback": (_LAYER, True),
    "profile": (_LAYER, _PROFILE),
    "ranks_per_node": (_LAYER, 2),
}
# Arguments free to differ per rank, and why.
PER_RANK = {
    "process_group": "not a setting: the group the ranks communicate on, one group",
    "stats": "records what this rank sent and received, with no collective of its own "
    "(test_ranks_may_differ_in_stats)",
    "cuda_graphs": "how a rank launches its settled buckets' device work: the same "
    "collectives, in the same order, captured or not (CPU buckets never are)",
}
# Compared across ranks but not recorded in checkpoints, and why.
NOT_CHECKPOINTED = {
    "profile": "a resumed run may calibrate again, on another cluster",
    "ranks_per_node": "a resumed run may run on another layout of nodes",
}


def _arguments() -> set[str]:
    """Every configuration argument a user can pass, as the code declares them."""
    state = set(inspect.signature(APSState.__init__).parameters) - {"self"}
    config = {f.name for f in dataclasses.fields(APSConfig)}
    # register(ddp, fmt, **options): its options are StateOptions' keys.
    reg = set(inspect.signature(register).parameters) - {"ddp", "options"}
    return state | config | reg | set(StateOptions.__annotations__)


def test_every_argument_is_classified() -> None:
    """A new argument must be compared (and checkpointed) or said to be free per rank."""
    assert _arguments() == set(AGREED) | set(PER_RANK), "classify the new argument here"
    assert not set(AGREED) & set(PER_RANK)
    assert set(NOT_CHECKPOINTED) <= set(AGREED)


CHECKPOINTED = [f for f in AGREED if f not in NOT_CHECKPOINTED]


@pytest.mark.parametrize("field", CHECKPOINTED)
def test_a_checkpoint_names_every_field_it_was_saved_with(field: str) -> None:
    base, other = AGREED[field]
    saved = APSState(**base).state_dict()
    with pytest.raises(ValueError, match="checkpoint was saved with"):
        APSState(**{**base, field: other}).load_state_dict(saved)
    APSState(**base).load_state_dict(saved)  # the same configuration loads


@pytest.mark.parametrize("field", list(NOT_CHECKPOINTED))
def test_a_checkpoint_loads_where_the_run_may_change(field: str) -> None:
    base, other = AGREED[field]
    saved = APSState(**base).state_dict()
    APSState(**{**base, field: other}).load_state_dict(saved)


def _every_field_differs(rank: int, world_size: int) -> dict[str, str]:
    """Per field, the error binding raised on this rank with rank 1's field changed alone."""
    messages = {}
    for field, (base, other) in AGREED.items():
        state = APSState(**({**base, field: other} if rank == 1 else base))
        try:
            # What register and the first hook call do before any gradient moves.
            state.bind_process_group()
        except ValueError as exc:
            messages[field] = str(exc)
        else:
            messages[field] = ""
    return messages


def test_ranks_with_any_field_different_refuse_to_run() -> None:
    """Binding raises on every rank, whichever field differs, and names the field."""
    for messages in run_distributed(_every_field_differs, 2, timeout=120):
        for field, msg in messages.items():
            assert "differs across ranks" in msg or "ranks disagree" in msg, (field, msg)
            assert field in msg, (field, msg)


def _stats_on_one_rank(rank: int, world_size: int) -> list[bool]:
    """Rank 0 records stats, rank 1 does not: the same bits as when neither does."""
    same = []
    for options in (_LAYER, _BLOCK, {**_BLOCK, "policy": [KeepLast("fp32")]}):
        grads = []
        for stats in (rank == 0, False):
            torch.manual_seed(0)
            ddp = DDP(Net())
            state = register(ddp, **options, stats=stats)
            out = []
            for step in range(3):  # the first step plans, the later ones run settled
                torch.manual_seed(1000 * step + rank)
                ddp.zero_grad()
                ddp(torch.randn(8, 16) * (rank + 1)).pow(2).sum().backward()
                out += [p.grad.clone() for p in ddp.parameters()]
            assert bool(state.stats) == stats
            grads.append(out)
        same.append(all(torch.equal(a, b) for a, b in zip(*grads, strict=True)))
    return same


def test_ranks_may_differ_in_stats() -> None:
    assert run_distributed(_stats_on_one_rank, 2, timeout=120) == [[True] * 3] * 2


class _Prefers:
    """A planner whose chunk is this rank's own, as if its timing had chosen it."""

    def __init__(self, planner: object, chunk: int) -> None:
        self.planner, self.preferred = planner, chunk

    def chunk(self, *args: object, **kwargs: object) -> int:
        return self.preferred

    def __getattr__(self, name: str) -> object:
        return getattr(self.planner, name)


def _own_chunk_preferences(rank: int, world_size: int) -> tuple[list[int], int]:
    """Each rank's timing prefers its own chunk; every rank must run the largest."""
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=1)  # one bucket of 1,904 elements
    state = APSState("e4m3", reduction="two_phase")
    state.bind(torch.device("cpu"))
    preferred = 256 if rank == 0 else 1024
    state.reducer.planner = _Prefers(state.reducer.planner, preferred)  # type: ignore[union-attr]
    log: list = []
    ddp.register_comm_hook(state, capture(state, log))
    checked = 0
    for step in range(4):  # the first step plans, the later ones run settled
        torch.manual_seed(1000 * step + rank)
        ddp.zero_grad()
        ddp(torch.randn(8, 16) * (rank + 1)).pow(2).sum().backward()
        checked += check_log(log, state.fmt, "two_phase", "layer")
        log.clear()
    assert state.reducer is not None
    return sorted(set(state.reducer.bucket_chunks.values())), checked


def test_ranks_preferring_different_chunks_run_the_agreed_one() -> None:
    """The settled layer path chunks by the ranks' agreed (largest) preference, not its own."""
    for chunks, checked in run_distributed(_own_chunk_preferences, 2, timeout=120):
        assert chunks == [1024]
        assert checked == 4


# aps_comm.fsdp: per argument the ranks must agree on, (base options, the other value).
# "hsdp": the model sharded over mesh["shard"] of a 2 x 1 mesh, replicate=mesh["replicate"].
_HSDP = {"fmt": "fp16", "hsdp": True}
FSDP_AGREED: dict[str, tuple[dict, object]] = {
    "fmt": ({}, "e5m2"),
    "scaling": ({}, "bucket"),
    "block_size": ({"fmt": "e2m1", "scaling": "block"}, 64),
    "policy": ({}, [KeepLast("fp32")]),
    "reduction": (_HSDP, "allreduce"),
    "reduce_scatter": (_HSDP, True),
}
FSDP_PER_RANK = {
    "module": "the model: its units are compared one by one (test_fsdp.py's layout tests)",
    "stats": "local passes over what this rank sent and received, no collective",
    "replicate": "compared as the replicas' layout, with its own errors "
    "(test_hsdp.py::test_unsupported_meshes_are_an_error_on_every_rank)",
    "replicas": "replicate='s size, compared with it",
}


def _fsdp_arguments() -> set[str]:
    state = set(inspect.signature(APSFSDPState.__init__).parameters) - {"self"}
    config = {f.name for f in dataclasses.fields(APSFSDPConfig)}
    return state | config | set(inspect.signature(fsdp.register).parameters)


def test_every_fsdp_argument_is_classified() -> None:
    assert _fsdp_arguments() == set(FSDP_AGREED) | set(FSDP_PER_RANK), "classify it here"
    assert not set(FSDP_AGREED) & set(FSDP_PER_RANK)


def _every_fsdp_field_differs(rank: int, world_size: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    messages = {}
    for field, (base, other) in FSDP_AGREED.items():
        options = dict({**base, field: other} if rank == 1 else base)
        net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        shard = mesh["shard"] if options.pop("hsdp", False) else None
        fully_shard(net[0], mesh=shard)
        fully_shard(net, mesh=shard)
        if shard is not None:
            options["replicate"] = mesh["replicate"]
        try:
            fsdp.register(net, **options)
        except ValueError as exc:
            messages[field] = str(exc)
        else:
            messages[field] = ""
    return messages


def test_fsdp_ranks_with_any_field_different_refuse_to_run() -> None:
    """aps_comm.fsdp.register raises on every rank, whichever field differs, naming it."""
    for messages in run_distributed(_every_fsdp_field_differs, 2, timeout=120):
        for field, msg in messages.items():
            assert "configuration differs across ranks" in msg, (field, msg)
            # The configuration's text names the field, or block_size's scaling=block(64).
            assert f"{field}=" in msg or (field == "block_size" and "block(64)" in msg), msg


class _Moves(_Prefers):
    """A planner whose preferred chunk follows ``schedule`` step by step (its timing moved)."""

    def __init__(self, planner: object, schedule: list[int], step: list[int]) -> None:
        super().__init__(planner, schedule[0])
        self.schedule, self.step = schedule, step

    def chunk(self, *args: object, **kwargs: object) -> int:
        return self.schedule[min(self.step[0], len(self.schedule) - 1)]


# Settled buckets of several formats (an FP32 layer beside e4m3 ones), plain, with agreed
# block exponents, and with error feedback (whose owner step needs the whole bucket: one
# chunk whatever the ranks prefer); per kind, the chunks the bucket runs.
_MOVING = {
    "groups": ({"fmt": "e4m3", "policy": [KeepLast("fp32")]}, {1024, 256, 512}),
    "groups+agreed-blocks": (
        {
            "fmt": "e2m1",
            "scaling": "block",
            "block_size": 32,
            "block_exponents": "agreed",
            "policy": [KeepLast("fp32")],
        },
        {1024, 256, 512},
    ),
    "groups+feedback": (
        {"fmt": "e4m3", "policy": [KeepLast("fp32")], "error_feedback": True},
        {ONE_CHUNK},
    ),
}


def _moving_chunks(rank: int, world_size: int, options: dict) -> tuple[list[int], bool]:
    """Rank 1's preferred chunk moves after the buckets settled; rank 0 prefers a small
    one. Every step's gradients equal a run whose ranks agree on one chunk throughout."""
    moving = [1024, 1024, 256, 512] if rank else [128] * 4
    grads, agreed = [], []
    for schedule in (moving, [1024] * 4):
        torch.manual_seed(0)
        ddp = DDP(Net(), bucket_cap_mb=1)  # one bucket of 1,904 elements
        state = register(ddp, **{"reduction": "two_phase", **options})
        step = [0]
        state.reducer.planner = _Moves(state.reducer.planner, schedule, step)  # type: ignore[union-attr]
        out, seen = [], []
        for step[0] in range(len(schedule)):
            for st in state.reducer.steady.values():  # type: ignore[union-attr]
                st.offer = None  # as when its measured exchange moves: the planner is asked
            torch.manual_seed(1000 * step[0] + rank)
            ddp.zero_grad()
            ddp(torch.randn(8, 16) * (rank + 1)).pow(2).sum().backward()
            out += [p.grad.clone() for p in ddp.parameters()]
            seen += sorted(set(state.reducer.bucket_chunks.values()))  # type: ignore[union-attr]
        grads.append(out)
        agreed.append(seen)
    same = all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    return agreed[0], same


@pytest.mark.parametrize("kind", list(_MOVING))
def test_settled_format_groups_follow_the_agreed_chunk_as_it_moves(kind: str) -> None:
    """A settled bucket of several formats is planned again when the ranks' agreed chunk
    moves, on every rank alike, with the bits of a run that never moved."""
    options, expected = _MOVING[kind]
    results = run_distributed(_moving_chunks, 2, args=(options,), timeout=180)
    assert results[0] == results[1]
    chunks, same = results[0]
    assert same
    assert set(chunks) == expected, chunks
