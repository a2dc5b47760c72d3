"""APS in PyTorch Lightning: a ``DDPStrategy`` that registers the hook on every device.

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers a communication hook
only when the root device is CUDA; on CPU the hook is silently never
registered. :class:`APSStrategy` registers :func:`aps_comm.aps_hook` on CPU
and CUDA alike, keeps every rank's hook state in Lightning checkpoints, and
with ``stats=True`` logs a few figures per step through the LightningModule.
Where the launcher did not set ``LOCAL_WORLD_SIZE`` (Lightning's own do not),
it sets it to the strategy's processes per node, so the hook sees the node
layout Lightning numbers its ranks by.

Lightning is an optional dependency: ``pip install -e ".[lightning]"`` (from the checkout).

Example:
    >>> import lightning as L
    >>> from aps_comm.lightning import APSStrategy
    >>> strategy = APSStrategy("e4m3", error_feedback=True, stats=True)
    >>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy)  # doctest: +SKIP
    >>> trainer.fit(model)  # doctest: +SKIP
    >>> strategy.state.step  # doctest: +SKIP
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as exc:  # Lightning is optional: say how to get it
    raise ImportError(
        'aps_comm.lightning needs Lightning: pip install "lightning>=2.2" '
        '(or, in the aps-comm checkout, pip install -e ".[lightning]")'
    ) from exc
import torch
from torch.nn.parallel import DistributedDataParallel

from aps_comm.checkpoint import GatheredState
from aps_comm.config import Reduction, Scaling
from aps_comm.formats import FloatFormat
from aps_comm.hook import APSState, aps_hook
from aps_comm.policy import Rule

__all__ = ["CHECKPOINT_KEY", "APSStrategy"]

CHECKPOINT_KEY = "aps_comm"
"""Key of the hook's state (every rank's) in a Lightning checkpoint."""

_HOOK_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")


class APSStrategy(DDPStrategy):
    """Lightning's DDP strategy with the APS hook registered on CPU and CUDA.

    Args:
        fmt: wire format ("e4m3", "e5m2", "fp16", "bf16", ... or a FloatFormat).
        reduction: "auto", "allreduce" or "two_phase" (see :class:`~aps_comm.APSState`).
        scaling: "layer", "bucket" or "none".
        policy: :mod:`aps_comm.policy` rules choosing a format per layer.
        error_feedback: carry what rounding lost into the next step.
        stats: collect per-layer stats and log, every step, through the
            LightningModule (rank 0's figures reach the logger):
            ``aps/bytes_sent`` (payload bytes this rank handed to the
            collectives that match an all-reduce: ``APSState.bytes_sent``),
            ``aps/bytes_total`` (every payload byte, the all-gathers
            included: ``APSState.bytes_total``), ``aps/underflowing_layers`` (layers with any
            element flushed to zero), ``aps/max_underflow_rate``,
            ``aps/saturated`` (elements clamped to the format's maximum) and
            ``aps/mean_exponent`` (of the per-layer scales).
        **ddp_strategy_kwargs: everything else :class:`DDPStrategy` takes
            (``find_unused_parameters``, ``static_graph``, ``start_method``,
            ``timeout``, ...), except ``ddp_comm_hook``, ``ddp_comm_state``
            and ``ddp_comm_wrapper``.

    Attributes:
        state: the hook's :class:`~aps_comm.APSState`, built here (so a
            checkpoint can be restored into it before the model is wrapped).
            With ``start_method="spawn"`` the training runs in child
            processes, and this object in the launching process keeps its
            initial state.

    Raises:
        ValueError: a DDP communication hook, state or wrapper is passed too,
            or an option of the hook is invalid.

    Example:
        >>> trainer = L.Trainer(accelerator="cpu", devices=4,
        ...                     strategy=APSStrategy("e5m2", policy=[KeepLast("fp32")]))  # doctest: +SKIP
    """

    def __init__(
        self,
        fmt: FloatFormat | str = "e4m3",
        *,
        reduction: Reduction = "auto",
        scaling: Scaling = "layer",
        policy: Sequence[Rule] | None = None,
        error_feedback: bool = False,
        stats: bool = False,
        **ddp_strategy_kwargs: Any,
    ) -> None:
        for key in _HOOK_ARGUMENTS:
            if ddp_strategy_kwargs.get(key) is not None:
                raise ValueError(
                    f"APSStrategy registers the APS hook itself, so {key} must not be given "
                    f"(got {key}={ddp_strategy_kwargs[key]!r}); use DDPStrategy for other hooks"
                )
        super().__init__(**ddp_strategy_kwargs)
        self.state = APSState(
            fmt,
            reduction,
            scaling,
            stats=stats,
            policy=policy,
            error_feedback=error_feedback,
        )
        self._logged_step = self.state.step

    def configure_ddp(self) -> None:
        """Wrap the model in DDP (Lightning's way), then register the APS hook on it."""
        super().configure_ddp()
        ddp = self.model
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"expected DDP to wrap the model, got {type(ddp).__name__}")
        self.state.bind_model(ddp.module)
        # The hook learns the node layout from LOCAL_WORLD_SIZE, as torchrun sets it.
        # Lightning's own launchers set LOCAL_RANK only, and number the ranks node
        # by node, num_processes per node (DDPStrategy.set_world_ranks): say so.
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(self.num_processes))
        # Collective: every rank is here, wrapping its model.
        self.state.bind_process_group()
        ddp.register_comm_hook(self.state, aps_hook)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Log the step's figures (with ``stats=True``) once the hook has finished it."""
        super().post_backward(closure_loss)
        # Without gradient synchronisation (accumulation) the hook did not run.
        if self.state.collect_stats and self.state.step != self._logged_step:
            self._logged_step = self.state.step
            module = self.lightning_module
            if module is not None:
                module.log_dict(_step_figures(self.state), on_step=True, on_epoch=False)

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | os.PathLike,
        storage_options: Any | None = None,
    ) -> None:
        """Add every rank's hook state to the checkpoint rank 0 writes.

        Lightning calls this on every rank (``Trainer.save_checkpoint`` must
        run on all of them); the states are gathered to rank 0 here.
        """
        gathered = GatheredState(self.state).state_dict()
        if gathered is not None:
            checkpoint[CHECKPOINT_KEY] = gathered
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load a checkpoint (Lightning's way) and restore this rank's hook state from it.

        Lightning loads the checkpoint on every rank, before the model is
        wrapped when resuming ``fit``; the state exists already, so it picks
        up where the saved run stopped.
        """
        checkpoint = super().load_checkpoint(*args, **kwargs)
        if CHECKPOINT_KEY in checkpoint:
            GatheredState(self.state, self.root_device).load_state_dict(checkpoint[CHECKPOINT_KEY])
            self._logged_step = self.state.step
        return checkpoint


def _step_figures(state: APSState) -> dict[str, float]:
    figures = {
        "aps/bytes_sent": float(state.bytes_sent),
        "aps/bytes_total": float(state.bytes_total),
    }
    if state.stats:
        figures["aps/underflowing_layers"] = float(sum(s.underflow_rate > 0 for s in state.stats))
        figures["aps/max_underflow_rate"] = max(s.underflow_rate for s in state.stats)
        figures["aps/saturated"] = float(sum(s.saturated for s in state.stats))
        figures["aps/mean_exponent"] = statistics.fmean(s.exponent for s in state.stats)
    return figures
