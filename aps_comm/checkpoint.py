"""Every rank's APS state in one checkpoint, as trainers that write from rank 0 need it.

:meth:`APSState.state_dict <aps_comm.hook.APSState.state_dict>` is per rank:
error-feedback residuals (and the local underflow rates) differ from rank
to rank. Lightning and Accelerate write checkpoints from rank 0 only, so a
plain ``state_dict()`` there would keep rank 0's residuals and lose the
others'. :class:`GatheredState` gathers every rank's state dict to rank 0
when saving, and gives each rank its own entry back when loading.

Example:
    >>> state = register(ddp, fmt="e4m3", error_feedback=True)  # doctest: +SKIP
    >>> everyone = GatheredState(state)  # doctest: +SKIP
    >>> saved = everyone.state_dict()  # collective: every rank  # doctest: +SKIP
    >>> if dist.get_rank() == 0:
    ...     torch.save(saved, "aps.pt")  # doctest: +SKIP
    >>> everyone.load_state_dict(torch.load("aps.pt"))  # every rank  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from aps_comm.hook import APSState

__all__ = ["GatheredState"]


class GatheredState:
    """An :class:`~aps_comm.hook.APSState` seen as one state dict for all ranks.

    ``state_dict()`` is a collective (a ``gather_object`` to ``dst``): call
    it on every rank. It returns ``{"world_size": N, "ranks": [rank 0's
    state dict, ...]}`` on ``dst`` and None elsewhere; tensors are moved to
    the CPU, and each entry keeps the device its residuals were on (the
    gradients' device) under ``"device"``. ``load_state_dict(saved)`` on
    every rank restores that rank's entry, with the residuals moved back to
    that device, or to ``device`` when one is given.

    A checkpoint from another world size cannot give each rank its own
    residuals: then the step counter and the policy's decisions (equal on
    every rank) are restored from rank 0's entry, the residuals and local
    underflow rates are dropped, and a warning says so.

    Args:
        state: the hook's state (bound to the model, so keys are parameter names).
        device: where restored residuals go: the gradients' device. Default:
            the device they were saved from, as ``torch.load`` restores
            tensors (give it to resume elsewhere, e.g. on the CPU).
        group: the process group to gather over (default: the default group).
        dst: the rank (in ``group``) that receives the gathered dict.

    Example:
        >>> accelerator.register_for_checkpointing(GatheredState(state, accelerator.device))  # doctest: +SKIP
    """

    def __init__(
        self,
        state: APSState,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        dst: int = 0,
    ) -> None:
        if not isinstance(state, APSState):
            raise TypeError(f"GatheredState needs an aps_comm.APSState, got {type(state).__name__}")
        self.state = state
        self.device = None if device is None else torch.device(device)
        self.group = group
        self.dst = dst

    def state_dict(self) -> dict[str, Any] | None:
        """Every rank's state dict on ``dst`` (None on the other ranks). Collective."""
        mine = self.state.state_dict()
        # Pickled CUDA tensors would land on dst's GPU: send host copies, and
        # say where they belong (one model: one device).
        residuals = mine["residuals"]
        mine["device"] = str(next(iter(residuals.values())).device) if residuals else "cpu"
        mine["residuals"] = {k: v.detach().cpu() for k, v in residuals.items()}
        if not (dist.is_available() and dist.is_initialized()):
            return {"world_size": 1, "ranks": [mine]}
        world_size = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        everyone: list[Any] | None = [None] * world_size if rank == self.dst else None
        dst = dist.get_global_rank(self.group, self.dst) if self.group is not None else self.dst
        dist.gather_object(mine, everyone, dst=dst, group=self.group)
        if everyone is None:
            return None
        return {"world_size": world_size, "ranks": everyone}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore this rank's entry of what :meth:`state_dict` returned on ``dst``."""
        if not isinstance(saved, dict) or not {"world_size", "ranks"} <= saved.keys():
            keys = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(
                f"not a GatheredState checkpoint (expected keys 'world_size' and 'ranks'), got {keys}"
            )
        initialised = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size(self.group) if initialised else 1
        rank = dist.get_rank(self.group) if initialised else 0
        if saved["world_size"] == world_size:
            mine = dict(saved["ranks"][rank])
            # Checkpoints from before the device was kept had their residuals on the CPU.
            saved_on = torch.device(mine.pop("device", "cpu"))
            device = saved_on if self.device is None else self.device
            try:
                mine["residuals"] = {k: v.to(device) for k, v in mine["residuals"].items()}
            # A torch without CUDA raises AssertionError for a CUDA device.
            except (RuntimeError, AssertionError) as exc:
                raise RuntimeError(
                    f"rank {rank}'s error-feedback residuals (saved on {saved_on}) cannot be "
                    f"moved to {device} ({exc}); pass GatheredState(state, device=...) with "
                    "the device of this rank's gradients"
                ) from exc
        else:
            if saved["ranks"][0]["residuals"]:
                warnings.warn(
                    f"APS checkpoint saved by {saved['world_size']} ranks, restored on "
                    f"{world_size}: error-feedback residuals are per rank and are dropped",
                    stacklevel=2,
                )
            mine = dict(saved["ranks"][0], residuals={}, rates={})
            mine.pop("device", None)
        self.state.load_state_dict(mine)
