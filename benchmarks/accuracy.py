"""Accuracy of full training runs on real ranks, per communication hook, with bytes per step.

Every hook trains the same model from the same initialisation on the same
data order, on ``--world-size`` real processes (Gloo, CPU, real
``DistributedDataParallel``), for ``--seeds`` seeds; all hooks of one seed
run inside a single :func:`aps_comm.testing.run_distributed` call (one
process start-up). Hooks: PyTorch's FP32 ``allreduce_hook``,
``fp16_compress_hook`` and ``bf16_compress_hook``; e4m3 without scaling
(the naive cast); APS e4m3 and e5m2; APS e4m3 with the last layer in
FP32, with underflow-driven promotion, and with error feedback; and
PyTorch's PowerSGD at rank 1 and 4 (its defaults, ``start_powerSGD_iter=10``).

Tasks:

- **digits**: :class:`~benchmarks._models.DigitsCNN` on sklearn's digits,
  SGD with momentum. As in ``tests/test_training.py`` the loss is multiplied
  by 2**-10 and the learning rate by 2**10: in FP32 the training is exactly
  the same (powers of two), but the gradients take the magnitudes of a large
  network's (1e-6 to 1e-4, as in the APS paper's ResNet-50).
- **markov**: :class:`~benchmarks._models.TinyLM` (a 2-block causal
  transformer) on next-token prediction over a random second-order Markov
  chain, AdamW with a cosine schedule, no loss scaling (its natural
  gradient magnitudes). Test loss, perplexity and token accuracy, beside
  the true chain's (the oracle's).

Bytes per step are the payload bytes each rank hands to collectives in one
step: ``state.bytes_sent`` for the APS hook, and for PyTorch's hooks the
bytes of the tensors they pass to ``dist.all_reduce`` (counted by a wrapper
installed for the whole job: PowerSGD all-reduces from future callbacks).
State bytes: the tensors the hook's state holds between steps (APS's
buffers, PowerSGD's error, P and Q), each storage once, not the model's.

Per-layer figures over training: the APS hooks run with ``stats=True``, and
for the first seed rank 0 records every layer's exponent, underflow rate and
saturated count at up to :data:`LAYER_POINTS` steps per run; they are plotted
in ``accuracy_layers.png``, one row per APS hook.

With ``--fsdp`` the same tasks train under FSDP2 (``fully_shard`` on every
layer or block, then the root) instead of DDP, with the setups of
:data:`FSDP_HOOKS`: FSDP's own reduce-scatter in FP32 and in BF16
(``reduce_dtype``), and :func:`aps_comm.fsdp.register` with e4m3, unscaled
(naive) and APS. Results go to ``accuracy_fsdp.{json,md}`` and
``accuracy_fsdp_<task>.png``.

With ``--hsdp`` they train under HSDP: ``--replicas`` R replicas of
S = world size / R shard ranks (``init_device_mesh(("replicate", "shard"))``),
with the setups of :data:`HSDP_HOOKS`: native HSDP in FP32 (``fully_shard``
on the 2-D mesh), and APS e4m3 and e2m1 block on the replica all-reduce
(``fully_shard`` on ``mesh["shard"]``, then :func:`aps_comm.fsdp.register`
with ``replicate=mesh["replicate"]``). Bytes per step are then those of the
replica all-reduce, the traffic that crosses nodes; each table says whether
each row's final metric lies within FP32's spread (its [min, max] over
seeds). Results go to ``accuracy_hsdp_<R>x<S>.{json,md}``.

    python -m benchmarks.accuracy [--seeds 3] [--digits-epochs 15] [--lm-steps 300]
    python -m benchmarks.accuracy --fsdp [--seeds 3]
    python -m benchmarks.accuracy --hsdp --replicas 2 --world-size 4 [--seeds 3]
    python -m benchmarks.accuracy --hooks powersgd-r1 powersgd-r4 --merge results/accuracy.json
"""

# No `from __future__ import annotations`: DDP inspects the wrapper hook's
# annotations and needs the real dist.GradBucket / torch.futures.Future.

import argparse
import json
import math
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import APSState, register
from aps_comm import fsdp as aps_fsdp
from aps_comm.policy import KeepLast, Promote
from aps_comm.testing import run_distributed
from benchmarks._models import DigitsCNN, TinyLM, lm_loss, load_digits_tensors, markov_data
from benchmarks.hostcost import state_nbytes

__all__ = [
    "BLOCK_HOOKS",
    "FSDP_HOOKS",
    "HIGHER_IS_BETTER",
    "HOOKS",
    "HSDP_HOOKS",
    "METRIC_WORDS",
    "SPREAD_METRIC",
    "TASKS",
    "attach_hook",
    "fp32_spread",
    "main",
    "prepare",
]

LOSS_SCALE = 2.0**-10
"""Digits task: loss multiplier (and 1 / learning-rate multiplier) giving large-network gradients."""
LAYER_POINTS = 60
"""Per-layer figures: at most this many recorded steps per run (first seed, rank 0)."""
LAYER_FIGURES = ("exponent", "underflow_rate", "saturated")
"""The :class:`~aps_comm.telemetry.LayerStats` fields recorded per layer."""

HOOKS: dict[str, str] = {
    "fp32": "PyTorch allreduce_hook (FP32)",
    "fp16_compress": "PyTorch fp16_compress_hook",
    "bf16_compress": "PyTorch bf16_compress_hook",
    "naive-e4m3": 'register(ddp, fmt="e4m3", scaling="none")',
    "aps-e4m3": 'register(ddp, fmt="e4m3")',
    "aps-e5m2": 'register(ddp, fmt="e5m2")',
    "aps-e4m3+last-fp32": 'register(ddp, fmt="e4m3", policy=[KeepLast("fp32")])',
    "aps-e4m3+promote": 'register(ddp, fmt="e4m3", policy=[Promote()])',
    "aps-e4m3+error-feedback": 'register(ddp, fmt="e4m3", error_feedback=True)',
    "naive-e2m1": 'register(ddp, fmt="e2m1", scaling="none")',
    "aps-e2m1-block": 'register(ddp, fmt="e2m1", scaling="block")',
    "aps-e2m1-block-agreed": (
        'register(ddp, fmt="e2m1", scaling="block", block_exponents="agreed")'
    ),
    "aps-e2m1-block+error-feedback": (
        'register(ddp, fmt="e2m1", scaling="block", error_feedback=True)'
    ),
    "aps-e3m2-block": 'register(ddp, fmt="e3m2", scaling="block")',
    "aps-e2m1-block16": 'register(ddp, fmt="e2m1", scaling="block", block_size=16)',
    "aps-e2m1-block64": 'register(ddp, fmt="e2m1", scaling="block", block_size=64)',
    "aps-e4m3-block32": 'register(ddp, fmt="e4m3", scaling="block", block_size=32)',
    "aps-e4m3-block128": 'register(ddp, fmt="e4m3", scaling="block", block_size=128)',
    "powersgd-r1": (
        "PyTorch powerSGD_hook, PowerSGDState(matrix_approximation_rank=1, "
        "start_powerSGD_iter=10), its other defaults"
    ),
    "powersgd-r4": (
        "PyTorch powerSGD_hook, PowerSGDState(matrix_approximation_rank=4, "
        "start_powerSGD_iter=10), its other defaults"
    ),
}
"""Hook name -> how it is set up."""
POWERSGD_START = 10
"""PowerSGD's ``start_powerSGD_iter``: plain FP32 all-reduce for the first 10 steps."""
POWERSGD_RANKS = {"powersgd-r1": 1, "powersgd-r4": 4}
"""PowerSGD hook name -> ``matrix_approximation_rank``."""
BLOCK_HOOKS = (
    "fp32",
    "naive-e4m3",
    "aps-e4m3",
    "naive-e2m1",
    "aps-e2m1-block",
    "aps-e2m1-block-agreed",
    "aps-e2m1-block+error-feedback",
    "aps-e3m2-block",
    "aps-e2m1-block16",
    "aps-e2m1-block64",
    "aps-e4m3-block32",
    "aps-e4m3-block128",
)
"""``--block``: block scaling's formats beside FP32, APS e4m3 and naive casts."""

FSDP_HOOKS: dict[str, str] = {
    "fsdp-fp32": "fully_shard: FSDP2's own reduce-scatter in FP32",
    "fsdp-bf16": "fully_shard(mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))",
    "fsdp-naive-e4m3": 'aps_comm.fsdp.register(model, "e4m3", scaling="none")',
    "fsdp-aps-e4m3": 'aps_comm.fsdp.register(model, "e4m3")',
}
"""FSDP2 setup name (``--fsdp``) -> how it is set up."""

HSDP_HOOKS: dict[str, str] = {
    "hsdp-fp32": (
        'fully_shard(unit, mesh=init_device_mesh("cpu", (R, S), '
        'mesh_dim_names=("replicate", "shard"))): native HSDP, FP32'
    ),
    "hsdp-aps-e4m3": (
        'fully_shard(unit, mesh=mesh["shard"]); '
        'aps_comm.fsdp.register(model, "e4m3", replicate=mesh["replicate"])'
    ),
    "hsdp-aps-e2m1-block": (
        'fully_shard(unit, mesh=mesh["shard"]); aps_comm.fsdp.register(model, "e2m1", '
        'scaling="block", replicate=mesh["replicate"])'
    ),
}
"""HSDP setup name (``--hsdp``) -> how it is set up (R replicas of S shard ranks)."""

_HSDP_APS: dict[str, dict[str, str]] = {
    "hsdp-aps-e4m3": {"fmt": "e4m3"},
    "hsdp-aps-e2m1-block": {"fmt": "e2m1", "scaling": "block"},
}

_SETUPS = {**HOOKS, **FSDP_HOOKS, **HSDP_HOOKS}

_BASELINES = ("fp32", "fsdp-fp32", "hsdp-fp32")
"""Each mode's FP32 setup: the row the others are compared with."""

TASKS = ("digits", "markov")

_TORCH_HOOKS = {
    "fp32": default_hooks.allreduce_hook,
    "fp16_compress": default_hooks.fp16_compress_hook,
    "bf16_compress": default_hooks.bf16_compress_hook,
}


class _AllReduceTally:
    """Bytes of every tensor this process has handed to ``dist.all_reduce`` since it was installed.

    PowerSGD issues its second and third all-reduce from future callbacks,
    on Gloo's threads after the hook has returned, so a patch in place only
    while the hook runs would miss them; this one stays for the whole job.
    """

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()  # callbacks count from Gloo's threads
        self._original = dist.all_reduce
        dist.all_reduce = self._counted

    def _counted(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.total += tensor.numel() * tensor.element_size()
        return self._original(tensor, *args, **kwargs)


_TALLY: list[_AllReduceTally] = []


def _tally() -> _AllReduceTally:
    """The process's one tally, installed on first use (in the rank processes only)."""
    if not _TALLY:
        _TALLY.append(_AllReduceTally())
    return _TALLY[0]


class _StepBytes:
    """The bytes a PyTorch hook handed to all_reduce since the last call: call once per step."""

    def __init__(self) -> None:
        self._tally = _tally()
        self._mark = self._tally.total

    def __call__(self) -> int:
        # Read after backward (and opt.step): every callback of the step has run.
        now = self._tally.total
        sent, self._mark = now - self._mark, now
        return sent


def _state_bytes(state: object, model: nn.Module) -> int:
    """Bytes of the tensors a hook's state holds between steps, not counting the model's own.

    :func:`benchmarks.hostcost.state_nbytes`, less the storages that hold
    the model's parameters or gradients (DDP's buckets): those are the model's.

    Example:
        >>> _state_bytes({"error": torch.zeros(10)}, nn.Linear(2, 2))
        40
    """
    params = list(model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    # FSDP2's parameters and gradients are DTensors: their storage is their local shard's.
    return state_nbytes(state, [t.to_local() if isinstance(t, DTensor) else t for t in tensors])


def attach_hook(
    ddp: DDP, hook: str, group: dist.ProcessGroup | None = None, stats: bool = False
) -> tuple[Callable[[], int], APSState | None, object | None]:
    """Register the named hook of :data:`HOOKS` on ``ddp``.

    Args:
        ddp: the DDP model (a hook can be registered once per DDP instance).
        hook: a key of :data:`HOOKS`.
        group: process group of the APS hooks (default: a new one each).
        stats: APS hooks collect per-layer stats (``state.stats``).

    Returns:
        A function to call once per step, after ``backward``: the bytes this
        rank handed to collectives in that step; the APS hook's state (None
        for PyTorch's hooks); and the state the hook keeps between steps
        (APS's or PowerSGD's; None for the stateless hooks).

    Example:
        >>> bytes_per_step, state, kept = attach_hook(ddp, "aps-e4m3", stats=True)  # doctest: +SKIP
    """
    if hook in _TORCH_HOOKS:
        sent = _StepBytes()
        ddp.register_comm_hook(None, _TORCH_HOOKS[hook])
        return sent, None, None
    if hook in POWERSGD_RANKS:
        sent = _StepBytes()
        powersgd = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANKS[hook],
            start_powerSGD_iter=POWERSGD_START,
        )
        ddp.register_comm_hook(powersgd, powerSGD_hook.powerSGD_hook)
        return sent, None, powersgd
    options: dict[str, Any] = {
        "naive-e4m3": {"fmt": "e4m3", "scaling": "none"},
        "aps-e4m3": {"fmt": "e4m3"},
        "aps-e5m2": {"fmt": "e5m2"},
        "aps-e4m3+last-fp32": {"fmt": "e4m3", "policy": [KeepLast("fp32")]},
        "aps-e4m3+promote": {"fmt": "e4m3", "policy": [Promote()]},
        "aps-e4m3+error-feedback": {"fmt": "e4m3", "error_feedback": True},
        "naive-e2m1": {"fmt": "e2m1", "scaling": "none"},
        "aps-e2m1-block": {"fmt": "e2m1", "scaling": "block"},
        "aps-e2m1-block-agreed": {"fmt": "e2m1", "scaling": "block", "block_exponents": "agreed"},
        "aps-e2m1-block+error-feedback": {
            "fmt": "e2m1",
            "scaling": "block",
            "error_feedback": True,
        },
        "aps-e3m2-block": {"fmt": "e3m2", "scaling": "block"},
        "aps-e2m1-block16": {"fmt": "e2m1", "scaling": "block", "block_size": 16},
        "aps-e2m1-block64": {"fmt": "e2m1", "scaling": "block", "block_size": 64},
        "aps-e4m3-block32": {"fmt": "e4m3", "scaling": "block", "block_size": 32},
        "aps-e4m3-block128": {"fmt": "e4m3", "scaling": "block", "block_size": 128},
    }[hook]
    state = register(ddp, process_group=group, stats=stats, **options)
    return (lambda: state.bytes_sent), state, state


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules to fully_shard before the root: every block or layer with parameters."""
    blocks = getattr(model, "blocks", None)
    if blocks is not None:
        return list(blocks)
    return [m for m in model.children() if any(True for _ in m.parameters())]


def _padded_bytes(model: nn.Module, world_size: int, elem_bytes: int) -> int:
    """Bytes of FSDP's reduce-scatter input: every gradient, dim 0 padded to the world size."""
    total = 0
    for p in model.parameters():
        rows = -(-p.shape[0] // world_size) * world_size if p.dim() else world_size
        total += rows * (p.numel() // max(p.shape[0], 1) if p.dim() else 1)
    return total * elem_bytes


def prepare(
    model: nn.Module,
    hook: str,
    group: dist.ProcessGroup | None = None,
    stats: bool = False,
    mesh: DeviceMesh | None = None,
) -> tuple[nn.Module, Callable[[], int], Any, object | None]:
    """Wrap ``model`` for ``hook``: DDP (:data:`HOOKS`), FSDP2 (:data:`FSDP_HOOKS`) or HSDP.

    Args:
        model: the model, on every rank from the same initialisation.
        hook: a key of :data:`HOOKS`, :data:`FSDP_HOOKS` or :data:`HSDP_HOOKS`.
        group: process group of the DDP APS hooks (default: a new one each).
        stats: APS hooks collect per-layer stats (``state.stats``).
        mesh: for :data:`HSDP_HOOKS` (and only them), the 2-D mesh with
            dimensions ("replicate", "shard").

    Returns:
        The module to train, a function to call once per step giving the
        bytes this rank handed to collectives in it, the APS state (None
        otherwise) and the state the hook keeps between steps (None if it
        keeps none). For FSDP's own reduce-scatter the bytes are those of its
        input (every padded gradient in the reduce dtype), what it hands to
        Gloo; for HSDP they are those of the replica all-reduce (the
        traffic between nodes).

    Example:
        >>> net, bytes_per_step, state, kept = prepare(DigitsCNN(), "fsdp-aps-e4m3")  # doctest: +SKIP
    """
    if (hook in HSDP_HOOKS) != (mesh is not None):
        raise ValueError(
            f"prepare({hook!r}): a 2-D mesh is needed by, and only by, the setups of HSDP_HOOKS"
        )
    if hook in HSDP_HOOKS:
        return _prepare_hsdp(model, hook, stats, mesh)
    if hook not in FSDP_HOOKS:
        ddp = DDP(model)
        sent, state, kept = attach_hook(ddp, hook, group, stats)
        return ddp, sent, state, kept
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    reduce_dtype = torch.bfloat16 if hook == "fsdp-bf16" else torch.float32
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    native = _padded_bytes(model, world, 2 if hook == "fsdp-bf16" else 4)
    for unit in _fsdp_units(model):
        fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if hook in ("fsdp-fp32", "fsdp-bf16"):
        return model, (lambda: native), None, None
    scaling = "none" if hook == "fsdp-naive-e4m3" else "layer"
    state = aps_fsdp.register(model, "e4m3", scaling=scaling, stats=stats)
    return model, (lambda: state.bytes_sent), state, state


def _prepare_hsdp(
    model: nn.Module, hook: str, stats: bool, mesh: DeviceMesh
) -> tuple[nn.Module, Callable[[], int], Any, object | None]:
    """:func:`prepare` for a setup of :data:`HSDP_HOOKS` on the ("replicate", "shard") ``mesh``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    shards = mesh["shard"].size()
    if hook == "hsdp-fp32":
        # FSDP's own reduce-scatter among the shards, then its FP32 all-reduce
        # of each rank's shard among the replicas.
        for unit in _fsdp_units(model):
            fully_shard(unit, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        replica = _padded_bytes(model, shards, 4) // shards
        return model, (lambda: replica), None, None
    for unit in _fsdp_units(model):
        fully_shard(unit, mesh=mesh["shard"], mp_policy=mp)
    fully_shard(model, mesh=mesh["shard"], mp_policy=mp)
    state = aps_fsdp.register(model, **_HSDP_APS[hook], stats=stats, replicate=mesh["replicate"])
    return model, (lambda: state.bytes_sent), state, state


class _LayerLog:
    """Every layer's :data:`LAYER_FIGURES` at up to :data:`LAYER_POINTS` steps of a run."""

    def __init__(self, state: APSState | None, model: nn.Module, steps: int) -> None:
        self.state = state
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.every = max(1, math.ceil(steps / LAYER_POINTS))
        self.last = steps
        self.steps: list[int] = []
        self.figures: dict[str, list[list[float | None]]] = {f: [] for f in LAYER_FIGURES}

    def record(self, step: int) -> None:
        if self.state is None or (step % self.every and step != self.last):
            return
        # Keyed by name: DDP's bucket order changes after the first step, and
        # layers a policy keeps in FP32 have no record (None: a gap in the plot).
        now = {s.name: s for s in self.state.stats}
        self.steps.append(step)
        for figure, rows in self.figures.items():
            rows.append([getattr(now[n], figure) if n in now else None for n in self.names])

    def result(self) -> dict | None:
        if self.state is None or not self.steps:
            return None
        return {"names": self.names, "steps": self.steps, **self.figures}


def _same_everywhere(model: nn.Module, world_size: int) -> None:
    """Check (cheaply) that every rank holds the same parameters (DDP; FSDP keeps one copy)."""
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return
    total = sum(float(p.double().sum()) for p in model.parameters())
    everyone: list[float | None] = [None] * world_size
    dist.all_gather_object(everyone, total)
    if len(set(everyone)) != 1:
        raise AssertionError(f"ranks diverged: parameter sums {everyone}")


def _train_digits(
    rank: int,
    world_size: int,
    hook: str,
    seed: int,
    cfg: dict,
    group: dist.ProcessGroup,
    mesh: DeviceMesh | None = None,
) -> dict:
    x_tr, y_tr, x_te, y_te = load_digits_tensors()
    torch.manual_seed(seed)
    model = DigitsCNN()
    record = rank == 0 and seed == 0
    ddp, sent, state, kept = prepare(model, hook, group, stats=record, mesh=mesh)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["digits_lr"] / LOSS_SCALE, momentum=0.9)
    shard_x, shard_y = x_tr[rank::world_size], y_tr[rank::world_size]
    batch = cfg["digits_batch"]
    per_epoch = (len(shard_y) - batch) // batch + 1
    layers = _LayerLog(state if record else None, model, cfg["digits_epochs"] * per_epoch)
    curve, step_bytes, step = [], 0, 0
    for epoch in range(cfg["digits_epochs"]):
        gen = torch.Generator().manual_seed(1000 * seed + epoch)
        order = torch.randperm(len(shard_y), generator=gen)
        losses = []
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i : i + batch]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(shard_x[idx]), shard_y[idx])
            (loss * LOSS_SCALE).backward()
            opt.step()
            losses.append(float(loss.detach()))
            step_bytes = sent()
            step += 1
            layers.record(step)
        with torch.no_grad():
            logits = model(x_te)
            acc = float((logits.argmax(1) == y_te).float().mean())
            test_loss = float(nn.functional.cross_entropy(logits, y_te))
        curve.append(
            {
                "epoch": epoch + 1,
                "train_loss": sum(losses) / len(losses),
                "test_loss": test_loss,
                "test_acc": acc,
            }
        )
    _same_everywhere(model, world_size)
    final = curve[-1]
    return {
        "final": {"test_acc": final["test_acc"], "test_loss": final["test_loss"]},
        "curve": curve,
        "bytes_per_step": step_bytes,
        "state_bytes": 0 if kept is None else _state_bytes(kept, model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": layers.result(),
    }


def _lm_eval(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Test loss and token accuracy on positions 1.. (those the oracle scores)."""
    with torch.no_grad():
        logits = model(x)[:, 1:]
        loss = float(lm_loss(logits, y[:, 1:]))
        acc = float((logits.argmax(-1) == y[:, 1:]).float().mean())
    return loss, acc


def _train_markov(
    rank: int,
    world_size: int,
    hook: str,
    seed: int,
    cfg: dict,
    group: dist.ProcessGroup,
    mesh: DeviceMesh | None = None,
) -> dict:
    data = markov_data(cfg["lm_vocab"], cfg["lm_seq_len"], cfg["lm_train"], cfg["lm_test"])
    torch.manual_seed(seed)
    model = TinyLM(cfg["lm_vocab"], cfg["lm_seq_len"], cfg["lm_dim"], cfg["lm_depth"])
    record = rank == 0 and seed == 0
    ddp, sent, state, kept = prepare(model, hook, group, stats=record, mesh=mesh)
    steps = cfg["lm_steps"]
    layers = _LayerLog(state if record else None, model, steps)
    opt = torch.optim.AdamW(ddp.parameters(), lr=cfg["lm_lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    shard_x, shard_y = data.x_train[rank::world_size], data.y_train[rank::world_size]
    batch = cfg["lm_batch"]
    every = max(1, steps // cfg["lm_evals"])
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(shard_y), generator=gen)
    pos, curve, losses, step_bytes = 0, [], [], 0
    for step in range(1, steps + 1):
        if pos + batch > len(order):
            order, pos = torch.randperm(len(shard_y), generator=gen), 0
        idx = order[pos : pos + batch]
        pos += batch
        opt.zero_grad()
        loss = lm_loss(ddp(shard_x[idx]), shard_y[idx])
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        step_bytes = sent()
        layers.record(step)
        if step % every == 0 or step == steps:
            test_loss, acc = _lm_eval(model, data.x_test, data.y_test)
            curve.append(
                {
                    "step": step,
                    "train_loss": sum(losses) / len(losses),
                    "test_loss": test_loss,
                    "test_acc": acc,
                }
            )
            losses = []
    _same_everywhere(model, world_size)
    final = curve[-1]
    return {
        "final": {
            "test_loss": final["test_loss"],
            "test_ppl": math.exp(final["test_loss"]),
            "test_acc": final["test_acc"],
        },
        "curve": curve,
        "bytes_per_step": step_bytes,
        "state_bytes": 0 if kept is None else _state_bytes(kept, model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": layers.result(),
        "oracle": {
            "test_loss": data.oracle_loss,
            "test_ppl": math.exp(data.oracle_loss),
            "test_acc": data.oracle_acc,
        },
    }


def _one_seed(rank: int, world_size: int, seed: int, cfg: dict) -> list[dict]:
    """Every (task, hook) of one seed, in one job. Rank 0 returns the records."""
    torch.set_num_threads(1)
    group = dist.new_group()  # one group for all APS states (used one after another)
    mesh = None
    if cfg.get("hsdp"):
        replicas = cfg["replicas"]
        mesh = init_device_mesh(
            "cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard")
        )
    trainers = {"digits": _train_digits, "markov": _train_markov}
    records = []
    for task in cfg["tasks"]:
        for hook in cfg["hooks"]:
            start = time.perf_counter()
            out = trainers[task](rank, world_size, hook, seed, cfg, group, mesh)
            out.update(task=task, hook=hook, seed=seed, seconds=time.perf_counter() - start)
            records.append(out)
            if rank == 0:
                f = out["final"]
                print(
                    f"seed {seed} {task:<6} {hook:<24} test acc {f['test_acc']:.4f} "
                    f"loss {f['test_loss']:.4f} bytes/step {out['bytes_per_step']:>8} "
                    f"({out['seconds']:.1f} s)",
                    flush=True,
                )
    return records if rank == 0 else []


def _summary(runs: list[dict], hooks: list[str], tasks: list[str]) -> list[dict]:
    rows = []
    for task in tasks:
        base = next((h for h in _BASELINES if h in hooks), None)
        fp32 = [r["bytes_per_step"] for r in runs if r["task"] == task and r["hook"] == base]
        fp32_bytes = statistics.fmean(fp32) if fp32 else None
        for hook in hooks:
            mine = [r for r in runs if r["task"] == task and r["hook"] == hook]
            if not mine:
                continue
            row: dict[str, Any] = {"task": task, "hook": hook, "setup": _SETUPS[hook]}
            for metric in mine[0]["final"]:
                vals = [r["final"][metric] for r in mine]
                row[metric] = {
                    "mean": statistics.fmean(vals),
                    "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                    "min": min(vals),
                    "max": max(vals),
                    "per_seed": vals,
                }
            row["bytes_per_step"] = round(statistics.fmean(r["bytes_per_step"] for r in mine))
            row["bytes_vs_fp32"] = row["bytes_per_step"] / fp32_bytes if fp32_bytes else None
            if all("state_bytes" in r for r in mine):  # runs from before it have none
                grads = statistics.fmean(4 * r["parameters"] for r in mine)
                row["state_bytes"] = round(statistics.fmean(r["state_bytes"] for r in mine))
                row["state_vs_gradients"] = row["state_bytes"] / grads
            row["seconds_per_run"] = statistics.fmean(r["seconds"] for r in mine)
            rows.append(row)
    return rows


SPREAD_METRIC = {"digits": "test_acc", "markov": "test_loss"}
"""Per task, the final metric whose spread over FP32's seeds the other rows are held to."""
METRIC_WORDS = {"test_acc": "test accuracy", "test_loss": "test loss"}
"""The spread metrics as the tables name them."""
HIGHER_IS_BETTER = {"test_acc": True, "test_loss": False}
"""The spread metrics: which way is better."""


def fp32_spread(rows: list[dict], task: str) -> dict[str, float]:
    """How far each row's mean lies outside FP32's [min, max] over seeds, in :data:`SPREAD_METRIC`.

    FP32's row is the mode's baseline ("fp32", "fsdp-fp32" or "hsdp-fp32").

    Args:
        rows: summary rows (``result["summary"]``).
        task: a key of :data:`SPREAD_METRIC`.

    Returns:
        Setup name -> 0.0 where its mean lies within FP32's [min, max] (ends
        included), else the signed distance to the nearer end (negative
        below the min, positive above the max); empty without an FP32 row.

    Example:
        >>> rows = [
        ...     {"task": "digits", "hook": "hsdp-fp32", "test_acc": {"mean": 0.5, "min": 0.25, "max": 0.75}},
        ...     {"task": "digits", "hook": "hsdp-aps-e4m3", "test_acc": {"mean": 0.625}},
        ...     {"task": "digits", "hook": "hsdp-aps-e2m1-block", "test_acc": {"mean": 0.125}},
        ... ]
        >>> fp32_spread(rows, "digits")
        {'hsdp-fp32': 0.0, 'hsdp-aps-e4m3': 0.0, 'hsdp-aps-e2m1-block': -0.125}
    """
    if task not in SPREAD_METRIC:
        raise ValueError(f"fp32_spread: task {task!r} is none of {sorted(SPREAD_METRIC)}")
    metric = SPREAD_METRIC[task]
    mine = {r["hook"]: r[metric] for r in rows if r["task"] == task}
    base = next((mine[h] for h in _BASELINES if h in mine), None)
    if base is None:
        return {}
    low, high = base["min"], base["max"]
    return {h: min(0.0, m["mean"] - low) + max(0.0, m["mean"] - high) for h, m in mine.items()}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; write ``accuracy.{json,md}``, ``accuracy_<task>.png`` and ``accuracy_layers.png``.

    Example:
        >>> main(["--seeds", "1", "--digits-epochs", "1", "--lm-steps", "4"])  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument(
        "--hooks", nargs="+", choices=list(_SETUPS), default=None, help="default: all of the mode's"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--fsdp",
        action="store_true",
        help="train with FSDP2 (fully_shard) and the setups of FSDP_HOOKS; writes accuracy_fsdp.*",
    )
    mode.add_argument(
        "--block",
        action="store_true",
        help="the setups of BLOCK_HOOKS (block scaling beside FP32 and APS e4m3); writes accuracy_block.*",
    )
    mode.add_argument(
        "--hsdp",
        action="store_true",
        help="train with HSDP (--replicas x world-size/replicas) and the setups of HSDP_HOOKS; "
        "writes accuracy_hsdp_<R>x<S>.*",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="with --hsdp: replicas R of the model's shards (default 2); the world size / R "
        "ranks of a replica shard it",
    )
    parser.add_argument("--digits-epochs", type=int, default=15)
    parser.add_argument("--digits-batch", type=int, default=32, help="per rank")
    parser.add_argument("--digits-lr", type=float, default=0.1, help="before the 2**10 factor")
    parser.add_argument("--lm-steps", type=int, default=300)
    parser.add_argument("--lm-batch", type=int, default=16, help="per rank")
    parser.add_argument("--lm-lr", type=float, default=1e-2)
    parser.add_argument("--lm-vocab", type=int, default=8)
    parser.add_argument("--lm-seq-len", type=int, default=16)
    parser.add_argument("--lm-dim", type=int, default=32)
    parser.add_argument("--lm-depth", type=int, default=2)
    parser.add_argument("--lm-train", type=int, default=4096)
    parser.add_argument("--lm-test", type=int, default=512)
    parser.add_argument("--lm-evals", type=int, default=6, help="test evaluations per run")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per seed")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("."),
        help="directory for the results (default: the working directory; the committed ones are in benchmarks/results)",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        default=None,
        help="add this run's rows to an accuracy.json of the same settings (its other rows "
        "kept; a row run again is replaced) and write the merged results",
    )
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        help="no training: recompute the summary, markdown and plots of this accuracy.json",
    )
    args = parser.parse_args(argv)
    _check_hsdp(parser, args)
    if args.hooks is None:
        args.hooks = list(
            HSDP_HOOKS
            if args.hsdp
            else FSDP_HOOKS
            if args.fsdp
            else BLOCK_HOOKS
            if args.block
            else HOOKS
        )
    command = "python -m benchmarks.accuracy " + " ".join(sys.argv[1:] if argv is None else argv)
    print(command, flush=True)
    if args.render is not None:
        # The summary is derived from the runs: recompute it with this version's rules.
        result = json.loads(args.render.read_text())
        s = result["settings"]
        result["summary"] = _summary(result["runs"], s["hooks"], s["tasks"])
        result["rendered_by"] = command
        _write(result, args.out)
        return result
    cfg = {k: v for k, v in vars(args).items() if k not in ("out", "timeout", "merge")}
    # Checked before training: a merge that cannot happen should not cost a run.
    base = _mergeable(args.merge, cfg) if args.merge is not None else None
    start = time.perf_counter()
    runs: list[dict] = []
    for seed in range(args.seeds):
        runs += run_distributed(_one_seed, args.world_size, args=(seed, cfg), timeout=args.timeout)[
            0
        ]
    result = {
        "command": command,
        "machine": _machine(),
        "settings": cfg,
        "loss_scale_digits": LOSS_SCALE,
        "seconds": round(time.perf_counter() - start, 1),
        "summary": _summary(runs, args.hooks, args.tasks),
        "runs": runs,
    }
    if base is not None:
        result = _merged(base, result)
    _write(result, args.out)
    print(f"ran in {result['seconds']} s")
    return result


# Settings that change what a run trains, with the value of runs from before
# the setting existed (no --fsdp, --block or --hsdp was False; no replicas,
# None); a merge needs them equal.
_TRAINING_SETTINGS = {
    "world_size": None,
    "seeds": None,
    "tasks": None,
    "fsdp": False,
    "block": False,
    "hsdp": False,
    "replicas": None,
}


def _training_settings(settings: dict) -> dict:
    defaults = {k: None for k in settings if k.startswith(("digits_", "lm_"))}
    return {k: settings.get(k, v) for k, v in {**defaults, **_TRAINING_SETTINGS}.items()}


def _check_hsdp(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--hsdp``'s layout and setups: R >= 2 replicas dividing the world; HSDP setups only with it."""
    if not args.hsdp:
        if args.replicas is not None:
            parser.error(f"--replicas {args.replicas}: only with --hsdp")
        hsdp = [h for h in args.hooks or () if h in HSDP_HOOKS]
        if hsdp:
            parser.error(f"--hooks {' '.join(hsdp)}: HSDP setups, only with --hsdp")
        return
    if args.replicas is None:
        args.replicas = 2
    if args.replicas < 2:
        parser.error(f"--replicas {args.replicas}: HSDP needs at least 2 replicas")
    if args.world_size % args.replicas:
        parser.error(
            f"--replicas {args.replicas} does not divide --world-size {args.world_size}: "
            "every replica holds world-size / replicas shards"
        )
    other = [h for h in args.hooks or () if h not in HSDP_HOOKS]
    if other:
        parser.error(
            f"--hooks {' '.join(other)}: not HSDP setups; --hsdp runs {', '.join(HSDP_HOOKS)}"
        )


def _mergeable(path: Path, cfg: dict) -> dict:
    """The results at ``path``, if a run of ``cfg`` can be merged into them; else a ValueError."""
    if not path.is_file():
        raise ValueError(f"--merge {path}: no such file")
    try:
        base = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--merge {path}: not JSON ({exc})") from None
    if not isinstance(base, dict) or not {"settings", "runs", "command"} <= set(base):
        raise ValueError(f"--merge {path}: not the results of benchmarks.accuracy")
    old, new = _training_settings(base["settings"]), _training_settings(cfg)
    differ = [
        f"{k}: {old.get(k)!r} there, {new.get(k)!r} here" for k in new if old.get(k) != new[k]
    ]
    if differ:
        raise ValueError(f"--merge {path}: the settings differ ({'; '.join(differ)})")
    return base


def _merged(base: dict, new: dict) -> dict:
    """``base`` with ``new``'s runs added (a (task, hook, seed) run again replaces the old one).

    Each merge is recorded under ``merges``: its command, machine, time, the
    hooks it ran, and for hooks that were there before whether every final
    metric came out the same (the runs are deterministic on one machine).
    """
    key = ("task", "hook", "seed")
    fresh = {tuple(r[k] for k in key): r for r in new["runs"]}
    old = {tuple(r[k] for k in key): r for r in base["runs"]}
    rerun = sorted({(t, h) for t, h, _ in fresh if (t, h, 0) in old})
    same = {
        f"{t}/{h}": all(
            fresh[k]["final"] == old[k]["final"] for k in fresh if k[:2] == (t, h) and k in old
        )
        for t, h in rerun
    }
    hooks = list(base["settings"]["hooks"])
    hooks += [h for h in new["settings"]["hooks"] if h not in hooks]
    runs = [fresh.get(k, r) for k, r in old.items()]
    runs += [r for k, r in fresh.items() if k not in old]
    merges = [*base.get("merges", [])]
    merges.append(
        {
            "command": new["command"],
            "machine": new["machine"],
            "seconds": new["seconds"],
            "hooks": new["settings"]["hooks"],
            "same_as_before": same,
        }
    )
    settings = {**base["settings"], "hooks": hooks}
    return {
        **base,
        "settings": settings,
        "seconds": base["seconds"] + new["seconds"],
        "summary": _summary(runs, hooks, settings["tasks"]),
        "runs": runs,
        "merges": merges,
    }


def _prefix(result: dict) -> str:
    """File name stem: ``accuracy`` (DDP), ``accuracy_fsdp`` (``--fsdp``), ``accuracy_block`` (``--block``) or ``accuracy_hsdp_<R>x<S>`` (``--hsdp``)."""
    settings = result["settings"]
    if settings.get("hsdp"):
        replicas = settings["replicas"]
        return f"accuracy_hsdp_{replicas}x{settings['world_size'] // replicas}"
    if settings.get("fsdp"):
        return "accuracy_fsdp"
    return "accuracy_block" if settings.get("block") else "accuracy"


def _write(result: dict, out: Path, json_too: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = _prefix(result)
    if json_too:
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))
    for task in result["settings"]["tasks"]:
        _plot(result, task, out / f"{stem}_{task}.png")
    if _layer_runs(result):
        _plot_layers(result, out / f"{stem}_layers.png")
    print((out / f"{stem}.md").read_text())
    print(f"wrote {out}/{stem}.md and plots" + (f" and {stem}.json" if json_too else ""))


def _machine() -> dict:
    import os

    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": "gloo (CPU), one process per rank, 1 intra-op thread each",
    }


def _fmt_stat(s: dict, digits: int = 4) -> str:
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"


def markdown(result: dict) -> str:
    """The results as markdown (also used by :mod:`benchmarks.report`).

    Example:
        >>> text = markdown(json.loads(Path("benchmarks/results/accuracy.json").read_text()))  # doctest: +SKIP
    """
    s = result["settings"]
    m = result["machine"]
    stem = _prefix(result)
    fsdp = bool(s.get("fsdp"))
    hsdp = bool(s.get("hsdp"))
    wrapper = "real DDP"
    if fsdp:
        wrapper = (
            "FSDP2 (fully_shard on every layer or transformer block, then the root; bytes per "
            "step of FSDP's own reduce-scatter: its input, every padded gradient in the reduce "
            "dtype)"
        )
    if hsdp:
        replicas = s["replicas"]
        wrapper = (
            f"HSDP, {replicas} replicas x {s['world_size'] // replicas} shard ranks (a "
            '("replicate", "shard") device mesh; fully_shard on every layer or transformer '
            "block, then the root; FSDP's own reduce-scatter in FP32 among a replica's shard "
            "ranks; bytes per step of the replica all-reduce only, the traffic that crosses "
            "nodes: for native HSDP every unit's padded shard in FP32, for APS the state's "
            "bytes_sent, its maxima and all_to_all, the all-gather of the reduced chunks left "
            "out as in the DDP tables)"
        )
    kind = "communication hook"
    if fsdp:
        kind = "FSDP2 gradient reduce-scatter"
    if hsdp:
        kind = "HSDP replica all-reduce"
    lines = [
        "# Accuracy of full training runs, per " + kind,
        "",
        f"`{result['command']}`",
        "",
        f"{s['world_size']} ranks: real processes, {m['backend']}, {wrapper}; {m['cpus']} CPU "
        f"cores shared with other jobs (niced), torch {m['torch']}. {s['seeds']} seeds "
        f"(initialisation and data order); mean ± sample standard deviation, min-max in "
        f"brackets. Bytes per step: payload bytes one rank hands to collectives in the last "
        f"step of each run, mean over seeds (with Promote, layers that moved up the ladder send 2 bytes per "
        f"element). "
        f"Total run time {result['seconds']:.0f} s.",
        "",
    ]
    for merge in result.get("merges", []):
        again = [
            f"{k} {'the same' if v else 'NOT the same'}" for k, v in merge["same_as_before"].items()
        ]
        lines += [
            f"Rows of {', '.join(f'`{h}`' for h in merge['hooks'])} from `{merge['command']}` "
            f"({merge['seconds']:.0f} s), merged in"
            + (f"; rows run again came out {', '.join(again)} as before." if again else ".")
            + "",
            "",
        ]
    rows = result["summary"]
    # State the hook keeps between steps (APS's buffers, PowerSGD's error and
    # P/Q memory), per gradient byte; runs from before it was recorded have none.
    state = any("state_vs_gradients" in r for r in rows)
    state_head = " state / gradients |" if state else ""
    state_rule = "---:|" if state else ""

    def state_cell(r: dict) -> str:
        return f" {_ratio(r.get('state_vs_gradients'))} |" if state else ""

    # HSDP: each row's final metric against FP32's spread over seeds.
    spread_head = " vs FP32's [min, max] |" if hsdp else ""
    spread_rule = "---:|" if hsdp else ""

    def spread_cell(r: dict) -> str:
        if not hsdp:
            return ""
        if r["hook"] in _BASELINES:  # FP32's own row shows the spread itself
            m = r[SPREAD_METRIC[r["task"]]]
            return f" [{m['min']:.4f}, {m['max']:.4f}] |"
        off = fp32_spread(rows, r["task"]).get(r["hook"])
        return " - |" if off is None else f" {_spread_word(off)} |"

    if hsdp:
        lines += [
            "vs FP32's [min, max]: on FP32's row, native HSDP FP32's [min, max] over its "
            "seeds of the final metric (digits: test accuracy; TinyLM: test loss); on the "
            "others, whether the row's mean lies within it, and if not by how much it falls "
            "outside.",
            "",
        ]

    if state:
        lines += [
            "State / gradients: bytes of the tensors the hook keeps between steps (APS's "
            "buffers and error-feedback residuals; PowerSGD's error, P and Q memory), each "
            "storage once, over the model's FP32 gradient bytes, after the last step; "
            "PyTorch's cast hooks keep none.",
            "",
        ]
    if any(r["hook"] in POWERSGD_RANKS for r in rows):
        lines += [
            f"PowerSGD sends plain FP32 for its first {POWERSGD_START} steps "
            "(`start_powerSGD_iter`); its bytes per step are those of the last step, "
            "compressed: P and Q of every matrix it compresses, and the vectors (biases, "
            "norms) and matrices too small to gain, uncompressed.",
            "",
        ]

    if "digits" in s["tasks"]:
        lines += [
            "## digits CNN (sklearn digits, 1437 train / 360 test images)",
            "",
            f"`DigitsCNN`, SGD momentum 0.9, lr {s['digits_lr']} x 2**10, loss x 2**-10 "
            f"(exactly equivalent in FP32; gradients of 1e-6 to 1e-4 like a large network's, "
            f"as in tests/test_training.py), batch {s['digits_batch']} per rank "
            f"({s['digits_batch'] * s['world_size']} global), {s['digits_epochs']} epochs.",
            "",
            "| hook | test accuracy | [min, max] | test loss | bytes/step | vs FP32 |"
            + state_head
            + spread_head,
            "|---|---:|---:|---:|---:|---:|" + state_rule + spread_rule,
        ]
        for r in (r for r in rows if r["task"] == "digits"):
            a = r["test_acc"]
            lines.append(
                f"| {r['hook']} | {_fmt_stat(a)} | [{a['min']:.4f}, {a['max']:.4f}] | "
                f"{_fmt_stat(r['test_loss'], 3)} | {r['bytes_per_step']:,} | "
                f"{_ratio(r['bytes_vs_fp32'])} |" + state_cell(r) + spread_cell(r)
            )
        lines += ["", *_spread_verdict(rows, "digits", hsdp)]
        lines += [f"![digits curves]({stem}_digits.png)", ""]
    if "markov" in s["tasks"]:
        oracle = next(r["oracle"] for r in result["runs"] if r["task"] == "markov")
        lines += [
            "## Transformer LM on a random second-order Markov chain",
            "",
            f"`TinyLM` ({s['lm_depth']} blocks, width {s['lm_dim']}), vocabulary "
            f"{s['lm_vocab']}, {s['lm_seq_len']} tokens per sequence, {s['lm_train']} train / "
            f"{s['lm_test']} test sequences; AdamW lr {s['lm_lr']} (cosine to 10%), "
            f"weight decay 0.01, batch {s['lm_batch']} per rank, {s['lm_steps']} steps, no loss "
            f"scaling. Test metrics on positions 2 and later; the oracle (the true chain) "
            f"scores loss {oracle['test_loss']:.4f}, perplexity {oracle['test_ppl']:.3f}, "
            f"token accuracy {oracle['test_acc']:.4f}.",
            "",
            "| hook | test loss | perplexity | token accuracy | [min, max] | bytes/step | vs FP32 |"
            + state_head
            + spread_head,
            "|---|---:|---:|---:|---:|---:|---:|" + state_rule + spread_rule,
        ]
        for r in (r for r in rows if r["task"] == "markov"):
            a = r["test_acc"]
            lines.append(
                f"| {r['hook']} | {_fmt_stat(r['test_loss'])} | {_fmt_stat(r['test_ppl'], 3)} | "
                f"{_fmt_stat(a)} | [{a['min']:.4f}, {a['max']:.4f}] | "
                f"{r['bytes_per_step']:,} | {_ratio(r['bytes_vs_fp32'])} |"
                + state_cell(r)
                + spread_cell(r)
            )
        lines += ["", *_spread_verdict(rows, "markov", hsdp)]
        lines += [f"![markov curves]({stem}_markov.png)", ""]
    if _layer_runs(result):
        lines += [
            "## Per-layer figures over training",
            "",
            "Each APS hook's per-layer exponent, underflow rate (this rank's nonzero elements "
            "flushed to zero) and saturated elements, rank 0, first seed, at up to "
            f"{LAYER_POINTS} steps per run; one line per layer, dark (input side) to "
            "yellow (output side). Layers a policy sends in FP32 have no line.",
            "",
            f"![per-layer figures]({stem}_layers.png)",
            "",
        ]
    lines += ["Hook set-ups:", ""]
    lines += [f"- `{h}`: `{_SETUPS[h]}`" for h in s["hooks"]]
    return "\n".join(lines) + "\n"


def _spread_word(off: float) -> str:
    """A :func:`fp32_spread` distance in words: "within", or how far below or above."""
    if off == 0.0:
        return "within"
    return f"{abs(off):.2g} {'below' if off < 0 else 'above'}"


def _spread_verdict(rows: list[dict], task: str, hsdp: bool) -> list[str]:
    """HSDP: one sentence per task naming FP32's spread and the rows within and outside it."""
    offs = fp32_spread(rows, task) if hsdp else {}
    base = next((r for r in rows if r["task"] == task and r["hook"] in _BASELINES), None)
    if not offs or base is None:
        return []
    metric = SPREAD_METRIC[task]
    spread = base[metric]
    others = [h for h in offs if h != base["hook"]]
    inside = [f"`{h}`" for h in others if offs[h] == 0.0]
    outside = [f"`{h}` ({_spread_word(offs[h])})" for h in others if offs[h] != 0.0]
    return [
        f"FP32's spread, {METRIC_WORDS[metric]} over {len(spread['per_seed'])} seeds: "
        f"[{spread['min']:.4f}, {spread['max']:.4f}]. Within it: "
        f"{', '.join(inside) or 'none'}. Outside it: {', '.join(outside) or 'none'}.",
        "",
    ]


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _plot(result: dict, task: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r["task"] == task]
    if not runs:
        return
    metrics = ("test_acc", "test_loss")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    xkey = "epoch" if task == "digits" else "step"
    for i, hook in enumerate(result["settings"]["hooks"]):
        mine = [r["curve"] for r in runs if r["hook"] == hook]
        if not mine:
            continue
        xs = [p[xkey] for p in mine[0]]
        for ax, metric in zip(axes, metrics, strict=True):
            ys = [statistics.fmean(c[j][metric] for c in mine) for j in range(len(xs))]
            native = hook in _TORCH_HOOKS or hook in ("fsdp-fp32", "fsdp-bf16", "hsdp-fp32")
            style = "--" if native else "-"
            ax.plot(xs, ys, style, color=f"C{i}", label=hook)
    if task == "markov":
        oracle = runs[0]["oracle"]
        for ax, metric in zip(axes, metrics, strict=True):
            ax.axhline(oracle[metric], color="black", lw=0.8, ls=":", label="oracle")
    for ax, metric in zip(axes, metrics, strict=True):
        ax.set_xlabel(xkey)
        ax.set_ylabel(metric.replace("_", " ") + " (mean of seeds)")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    title = "digits CNN" if task == "digits" else "transformer LM, Markov chain"
    fig.suptitle(f"{title}, {result['settings']['world_size']} ranks (Gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _layer_runs(result: dict) -> dict[tuple[str, str], dict]:
    """(task, hook) -> the first seed's per-layer record (runs from before it have none)."""
    return {(r["task"], r["hook"]): r["layers"] for r in result["runs"] if r.get("layers")}


def _plot_layers(result: dict, path: Path) -> None:
    """One row per APS hook; per task, columns exponent, underflow rate, saturated elements."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recorded = _layer_runs(result)
    tasks = [t for t in result["settings"]["tasks"] if any(k[0] == t for k in recorded)]
    hooks = [h for h in result["settings"]["hooks"] if any(k[1] == h for k in recorded)]
    cols = [(task, figure) for task in tasks for figure in LAYER_FIGURES]
    fig, axes = plt.subplots(
        len(hooks), len(cols), figsize=(3.3 * len(cols), 2.3 * len(hooks)), squeeze=False
    )
    cmap = plt.get_cmap("viridis")
    for row, hook in enumerate(hooks):
        for col, (task, figure) in enumerate(cols):
            ax = axes[row][col]
            log = recorded.get((task, hook))
            if log is None:
                ax.set_axis_off()
                continue
            n = len(log["names"])
            for i in range(n):
                # None (no record: the layer went in FP32) is a gap in the line.
                ys = [math.nan if step[i] is None else step[i] for step in log[figure]]
                ax.plot(log["steps"], ys, color=cmap(i / max(1, n - 1)), lw=0.9)
            if figure == "underflow_rate":
                ax.set_yscale("symlog", linthresh=1e-4)
                ax.set_ylim(0, 1.3)  # a rate of 1 (everything flushed) stays visible
            elif figure == "saturated":
                ax.set_yscale("symlog", linthresh=1)
                ax.set_ylim(0, max(2.0, ax.get_ylim()[1]))
            if row == 0:
                ax.set_title(f"{task}: {figure.replace('_', ' ')}", fontsize=9)
            if col == 0:
                ax.set_ylabel(hook, fontsize=8)
            if row == len(hooks) - 1:
                ax.set_xlabel("step")
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
    fig.suptitle(
        f"Per-layer figures, rank 0 of {result['settings']['world_size']}, first seed "
        "(line colour: layer, dark = input side, yellow = output side)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
