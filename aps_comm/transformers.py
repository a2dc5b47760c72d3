"""APS in Hugging Face ``Trainer``: a callback that puts the hook on Trainer's DDP model.

In a distributed run (``torchrun --nproc_per_node N train.py``), ``Trainer``
wraps the model in ``DistributedDataParallel`` before training starts, but
hands its callbacks only the unwrapped model (``model=trainer.model`` at
every event; ``trainer.model_wrapped`` reaches no callback). So
:class:`APSCallback` registers :func:`aps_comm.aps_hook` from the model's
first training forward, which DDP runs: that is before the first backward,
on every rank. It also keeps every rank's hook state in Trainer checkpoints
(a file :data:`CHECKPOINT_FILE` in each ``checkpoint-N`` folder, written by
global rank 0; see :class:`~aps_comm.checkpoint.GatheredState`) and restores
it when ``trainer.train(resume_from_checkpoint=...)`` resumes.

Transformers is an optional dependency: ``pip install -e ".[transformers]"``
(from the checkout).

Example (``torchrun --standalone --nproc_per_node 2 train.py``; a complete
script is in docs/integrations.md)::

    import torch
    from transformers import Trainer, TrainingArguments
    from aps_comm.transformers import APSCallback

    aps = APSCallback(fmt="e4m3", error_feedback=True)
    # On CPUs Trainer joins torchrun's job only with use_cpu=True (over Gloo).
    args = TrainingArguments("out", save_steps=100, use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[aps])
    trainer.train()  # or trainer.train(resume_from_checkpoint=True)
    aps.state.step  # steps the hook communicated, the resumed ones included
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # Transformers is optional: say how to get it
    raise ImportError(
        'aps_comm.transformers needs Hugging Face Transformers: pip install "transformers>=4.40" '
        '(or, in the aps-comm checkout, pip install -e ".[transformers]")'
    ) from exc
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from aps_comm.checkpoint import GatheredState
from aps_comm.config import Reduction, Scaling
from aps_comm.formats import FloatFormat
from aps_comm.hook import APSState, aps_hook
from aps_comm.policy import Rule

__all__ = ["CHECKPOINT_FILE", "APSCallback"]

CHECKPOINT_FILE = "aps_comm.pt"
"""File of every rank's hook state in a Trainer checkpoint folder."""


def _not_distributed_cause(args: TrainingArguments, ranks: int) -> str:
    """Why Trainer runs alone in a job of ``ranks`` processes, and what to change."""
    head = (
        f"APSCallback: torch.distributed has {ranks} processes, but Trainer runs this one "
        f"alone (parallel mode {args.parallel_mode.value}, args.world_size {args.world_size}), "
        "so it builds no DistributedDataParallel model to put the hook on"
    )
    if not torch.cuda.is_available() and not args.use_cpu:
        # Accelerate's state, which Trainer uses, goes multi-process on CPUs only when asked.
        return (
            f"{head}: without CUDA, Trainer goes distributed only with "
            "TrainingArguments(..., use_cpu=True), which reduces over Gloo"
        )
    local_rank = os.environ.get("LOCAL_RANK", "unset")
    return (
        f"{head}: TrainingArguments did not find the job in the environment (LOCAL_RANK "
        f"{local_rank}); start the processes with torchrun or aps-launch, which set it"
    )


class APSCallback(TrainerCallback):
    """A ``Trainer`` callback that reduces DDP gradients with the APS hook.

    Use it in a distributed run (one process per device, e.g. torchrun),
    where Trainer wraps the model in ``DistributedDataParallel``; FSDP and
    DeepSpeed reduce gradients without DDP hooks. The hook is registered at
    the model's first training forward, inside DDP's, on every rank.

    Checkpoints: at every Trainer save, every rank's state (error-feedback
    residuals, step counter, policy state) is gathered to global rank 0,
    which writes ``CHECKPOINT_FILE`` into the ``checkpoint-N`` folder
    (``on_save`` runs on every rank). When training resumes, the state is
    read from ``checkpoint-N`` of the resumed step under ``args.output_dir``
    (where ``resume_from_checkpoint=True`` finds it), or from
    ``resume_from`` when given; the residuals go to the model's device.

    Args:
        fmt: wire format ("e4m3", "e5m2", "fp16", "bf16", ... or a FloatFormat).
        reduction: "auto", "allreduce" or "two_phase" (see :class:`~aps_comm.APSState`).
        scaling: "layer", "bucket" or "none".
        policy: :mod:`aps_comm.policy` rules choosing a format per layer.
        error_feedback: carry what rounding lost into the next step.
        stats: record per-layer stats of the last step in ``state.stats``.
        resume_from: the checkpoint folder a resumed run restores the hook's
            state from, for a checkpoint outside ``args.output_dir`` (the
            path given to ``trainer.train(resume_from_checkpoint=...)``).

    Attributes:
        state: the hook's :class:`~aps_comm.APSState`, built here.

    Raises:
        ValueError: an option of the hook is invalid (here); the run is not
            distributed (at the start of training), or torch.distributed is
            but Trainer is not (on a CPU machine: ``TrainingArguments`` without
            ``use_cpu=True``), the error says which.
        TypeError: the model ran a training forward outside DDP.
        FileNotFoundError: a resumed run's checkpoint folder is not found.

    Example:
        >>> aps = APSCallback("e4m3", error_feedback=True)
        >>> trainer = Trainer(model=model, args=args, train_dataset=data,
        ...                   callbacks=[aps])  # doctest: +SKIP
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
        resume_from: str | os.PathLike | None = None,
    ) -> None:
        self.state = APSState(
            fmt,
            reduction,
            scaling,
            stats=stats,
            policy=policy,
            error_feedback=error_feedback,
        )
        self.resume_from = None if resume_from is None else Path(resume_from)
        self._pending: RemovableHandle | None = None
        # The DDP model the hook is on: another train() may reuse it or wrap anew.
        self._ddp: weakref.ref[DistributedDataParallel] | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Restore a resumed run's hook state; register the hook at the first training forward."""
        if dist.is_available() and dist.is_initialized() and args.world_size < 2:
            ranks = dist.get_world_size()
            if ranks > 1:
                # The job is distributed but Trainer is not: "launch one process
                # per device" would send a user who did exactly that in circles.
                raise ValueError(_not_distributed_cause(args, ranks))
        if not (dist.is_available() and dist.is_initialized()) or args.world_size < 2:
            raise ValueError(
                f"APSCallback needs a distributed run, where Trainer wraps the model in "
                f"DistributedDataParallel; this run has {args.world_size} process(es) "
                f"(parallel mode {args.parallel_mode.value}): launch one process per device, "
                "e.g. torchrun --nproc_per_node N train.py, or remove the callback"
            )
        if model is None:
            raise ValueError("APSCallback.on_train_begin needs the model Trainer passes")
        if state.global_step > 0:
            self._restore(args, state, model)
        if self._pending is None:
            # DDP wraps ``model`` by now, but only the forward tells which DDP.
            self._pending = model.register_forward_pre_hook(self._register_on_ddp)

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Gather every rank's hook state and write it into the checkpoint folder (rank 0)."""
        # Collective: Trainer calls on_save on every rank.
        gathered = GatheredState(self.state).state_dict()
        if gathered is None:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            raise FileNotFoundError(
                f"APSCallback: Trainer's checkpoint folder {folder} is missing (hyperparameter "
                "search runs write elsewhere); the hook's state could not be saved"
            )
        torch.save(gathered, folder / CHECKPOINT_FILE)

    def _restore(
        self, args: TrainingArguments, state: TrainerState, model: torch.nn.Module
    ) -> None:
        folder = self.resume_from or (
            Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        )
        if not folder.is_dir():
            raise FileNotFoundError(
                f"APSCallback: training resumes at step {state.global_step}, but {folder} is not "
                "a folder; for a checkpoint outside args.output_dir, pass "
                "APSCallback(..., resume_from=<the folder given to resume_from_checkpoint>)"
            )
        path = folder / CHECKPOINT_FILE
        if not path.is_file():
            warnings.warn(
                f"APSCallback: {folder} has no {CHECKPOINT_FILE} (saved without APSCallback?); "
                "the hook's state (step counter, error-feedback residuals) starts over",
                stacklevel=2,
            )
            return
        device = next(model.parameters(), torch.empty(0)).device
        saved = torch.load(path, map_location="cpu", weights_only=True)
        GatheredState(self.state, device).load_state_dict(saved)

    def _register_on_ddp(self, module: torch.nn.Module, inputs: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # an evaluation forward (no gradients to reduce): wait for training's
        # Set by DDP while it runs its module's forward (PyTorch's hook for TorchDynamo).
        ddp = DistributedDataParallel._get_active_ddp_module()
        if ddp is None or ddp.module is not module:
            raise TypeError(
                f"APSCallback: {type(module).__name__} ran a training forward outside "
                "DistributedDataParallel, so there is no DDP model to put the APS hook on; "
                "Trainer wraps the model in DDP in distributed runs (FSDP and DeepSpeed take "
                "no DDP hooks): train through trainer.train(), or in a loop of your own use "
                "aps_comm.register(ddp_model, ...)"
            )
        assert self._pending is not None
        self._pending.remove()
        self._pending = None
        if self._ddp is not None and self._ddp() is ddp:
            return  # a later train() on the same DDP model: the hook is on it
        self.state.bind_model(module)
        # Collective: every rank runs its first training forward.
        self.state.bind_process_group()
        ddp.register_comm_hook(self.state, aps_hook)
        self._ddp = weakref.ref(ddp)
