"""APS in Hugging Face Accelerate: the hook on the model ``accelerator.prepare`` returns.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` offers only its
own enum of hooks (FP16, BF16, PowerSGD). When the job is distributed over
several processes (GPUs or CPUs), ``accelerator.prepare`` wraps the model in
a plain ``DistributedDataParallel``, so :func:`aps_comm.register` works on
it. :func:`register_accelerate` checks that it does, registers the hook, and
has ``accelerator.save_state`` / ``load_state`` carry every rank's hook
state (:class:`~aps_comm.checkpoint.GatheredState`).

Accelerate is an optional dependency: ``pip install -e ".[accelerate]"`` (from the checkout).

Example (``ACCELERATE_USE_CPU=1 torchrun --standalone --nproc_per_node 2 train.py`` on CPUs;
``accelerate launch --cpu`` starts a single process)::

    from accelerate import Accelerator
    from aps_comm.accelerate import register_accelerate

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = register_accelerate(accelerator, model, "e4m3")
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(loss_fn(model(x), y))
        optimizer.step()
    accelerator.save_state("checkpoint")  # on every process: it gathers the hook's state
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

try:
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType
except ImportError as exc:  # Accelerate is optional: say how to get it
    raise ImportError(
        'aps_comm.accelerate needs Accelerate: pip install "accelerate>=0.30" '
        '(or, in the aps-comm checkout, pip install -e ".[accelerate]")'
    ) from exc
import torch
from torch.nn.parallel import DistributedDataParallel

from aps_comm.checkpoint import GatheredState
from aps_comm.config import Reduction, Scaling
from aps_comm.formats import FloatFormat
from aps_comm.hook import APSState, register
from aps_comm.policy import Rule

__all__ = ["register_accelerate"]


def register_accelerate(
    accelerator: Accelerator,
    model: torch.nn.Module,
    fmt: FloatFormat | str = "e4m3",
    *,
    reduction: Reduction = "auto",
    scaling: Scaling = "layer",
    policy: Sequence[Rule] | None = None,
    error_feedback: bool = False,
    stats: bool = False,
    checkpoint: bool = True,
) -> APSState | None:
    """Register the APS hook on a model prepared by Accelerate; return its state.

    Call it on every process, after ``accelerator.prepare`` and before the
    first backward. The options are :func:`aps_comm.register`'s.

    Args:
        accelerator: the job's ``Accelerator``.
        model: the model ``accelerator.prepare`` returned.
        fmt: wire format ("e4m3", "e5m2", "fp16", "bf16", ... or a FloatFormat).
        reduction: "auto", "allreduce" or "two_phase".
        scaling: "layer", "bucket" or "none".
        policy: :mod:`aps_comm.policy` rules choosing a format per layer.
        error_feedback: carry what rounding lost into the next step.
        stats: record per-layer stats of the last step in ``state.stats``.
        checkpoint: register the state (every rank's, gathered to the main
            process) with ``accelerator.register_for_checkpointing``, so
            ``save_state`` and ``load_state`` keep it; both must then run on
            every process.

    Returns:
        The hook's state; None for a single process (nothing to reduce: the
        model is not wrapped, and a warning says so).

    Raises:
        TypeError: ``model`` is not DDP-wrapped (not the prepared model, or
            FSDP / DeepSpeed, which reduce gradients without DDP hooks).
        ValueError: ``DistributedDataParallelKwargs(comm_hook=...)`` already
            put one of Accelerate's hooks on the model (DDP takes one).

    Example:
        >>> model, opt = accelerator.prepare(model, opt)  # doctest: +SKIP
        >>> state = register_accelerate(accelerator, model, "e4m3", stats=True)  # doctest: +SKIP
    """
    if accelerator.num_processes == 1:
        warnings.warn(
            "register_accelerate: a single process has no gradients to reduce; "
            "the APS hook is not registered",
            stacklevel=2,
        )
        return None
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            "register_accelerate needs the DistributedDataParallel model that "
            f"accelerator.prepare returns, got {type(model).__name__} (distributed type "
            f"{accelerator.distributed_type}); FSDP and DeepSpeed take no DDP hooks"
        )
    handler = getattr(accelerator, "ddp_handler", None)
    accelerate_hook = getattr(handler, "comm_hook", DDPCommunicationHookType.NO)
    if accelerate_hook != DDPCommunicationHookType.NO:
        raise ValueError(
            f"DistributedDataParallelKwargs(comm_hook={accelerate_hook}) already registered a "
            "hook on this model and DDP takes only one: leave comm_hook unset to use APS"
        )
    state = register(
        model,
        fmt,
        reduction=reduction,
        scaling=scaling,
        policy=policy,
        error_feedback=error_feedback,
        stats=stats,
    )
    if checkpoint:
        accelerator.register_for_checkpointing(GatheredState(state, accelerator.device))
    return state
