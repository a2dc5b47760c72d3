"""Every field of the hook's configuration is one the ranks and checkpoints compare.

A field left out of :meth:`aps_comm.APSState.describe` would let ranks with
different settings run different collectives (a Gloo size mismatch or a
silently wrong gradient) and a checkpoint load into a state it was not made
for. Each field is changed alone, against a base configuration that makes it
matter (block sizes and exponents only exist with block scaling).
"""

import pytest
import torch
from conftest import Net, capture, check_log
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import APSState, register
from aps_comm.policy import KeepLast
from aps_comm.testing import run_distributed

_LAYER = {"fmt": "e4m3", "reduction": "two_phase", "scaling": "layer"}
_BLOCK = {"fmt": "e2m1", "reduction": "two_phase", "scaling": "block"}
# (field, base configuration, the field's other value)
FIELDS = [
    ("fmt", _LAYER, "e5m2"),
    ("reduction", _LAYER, "allreduce"),
    ("scaling", _LAYER, "bucket"),
    ("block_size", _BLOCK, 64),
    ("block_exponents", _BLOCK, "agreed"),
    ("policy", _LAYER, [KeepLast("fp32")]),
    ("error_feedback", _LAYER, True),
]


@pytest.mark.parametrize(("field", "base", "other"), FIELDS, ids=[f[0] for f in FIELDS])
def test_a_checkpoint_names_every_field_it_was_saved_with(
    field: str, base: dict, other: object
) -> None:
    saved = APSState(**base).state_dict()
    with pytest.raises(ValueError, match="checkpoint was saved with"):
        APSState(**{**base, field: other}).load_state_dict(saved)
    APSState(**base).load_state_dict(saved)  # the same configuration loads


def _every_field_differs(rank: int, world_size: int) -> list[str]:
    messages = []
    for field, base, other in FIELDS:
        torch.manual_seed(0)
        ddp = DDP(Net())
        options = {**base, field: other} if rank == 1 else base
        try:
            register(ddp, **options)
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append("")
    return messages


def test_ranks_with_any_field_different_refuse_to_run() -> None:
    """``register`` raises on every rank, whichever field differs."""
    for messages in run_distributed(_every_field_differs, 2, timeout=120):
        for (field, _, _), msg in zip(FIELDS, messages, strict=True):
            assert "configuration differs across ranks" in msg, (field, msg)


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
