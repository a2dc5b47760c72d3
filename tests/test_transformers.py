"""APSCallback on a real Hugging Face Trainer, 2 CPU ranks on Gloo.

:func:`aps_comm.testing.run_distributed` starts the ranks and initialises the
process group; with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set, as torchrun
would, Trainer (through Accelerate) sees a multi-CPU job, uses that group and
wraps the model in DDP. The model is a plain module built in code: nothing is
downloaded.
"""

import importlib
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import made_once

from aps_comm.testing import run_distributed

EPOCHS = 2
STEPS_PER_EPOCH = 2
BATCH = 4


class _Regressor(nn.Module):
    """What Trainer needs of a model: keyword inputs, ``labels``, a dict with the loss."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def _dataset(world_size: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    n = world_size * BATCH * STEPS_PER_EPOCH
    x, y = torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def _trainer_runs(rank: int, world_size: int, tmp: str) -> dict:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        HF_HUB_OFFLINE="1",
    )
    # The ranks start from a process that imported aps_comm (and the tests) only.
    transformers_before = "transformers" in sys.modules
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

    from aps_comm.transformers import CHECKPOINT_FILE, APSCallback

    args = TrainingArguments(
        output_dir=tmp,
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        save_strategy="epoch",
        # One bucket layout from the first step on, so a resume is bit for bit
        # (DDP re-buckets after its first iteration otherwise: see APSState.state_dict).
        ddp_find_unused_parameters=True,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    data = _dataset(world_size)

    def train(seed: int, resume: str | None = None) -> tuple[Any, _Regressor]:
        model = _Regressor(seed)
        aps = APSCallback("e4m3", error_feedback=True)
        Trainer(model=model, args=args, train_dataset=data, callbacks=[aps]).train(
            resume_from_checkpoint=resume
        )
        return aps, model

    out: dict[str, Any] = {"transformers_before": transformers_before}
    whole, model = train(0)
    out["whole_state"] = whole.state.state_dict()
    out["whole"] = [p.detach().clone() for p in model.parameters()]
    mid = Path(tmp) / f"checkpoint-{STEPS_PER_EPOCH}"
    if rank == 0:
        saved = torch.load(mid / CHECKPOINT_FILE, weights_only=True)
        out["saved_world_size"] = saved["world_size"]
        out["saved_steps"] = [s["step"] for s in saved["ranks"]]
        out["saved_residuals"] = [s["residuals"] for s in saved["ranks"]]
    # Another initialisation: the weights too must come from the checkpoint.
    resumed, model = train(1, resume=str(mid))
    out["resumed_state"] = resumed.state.state_dict()
    out["resumed"] = [p.detach().clone() for p in model.parameters()]

    # A checkpoint outside args.output_dir: found through resume_from, else named.
    elsewhere = APSCallback("e4m3", error_feedback=True, resume_from=mid)
    at_mid = TrainerState(global_step=STEPS_PER_EPOCH)
    elsewhere.on_train_begin(args, at_mid, TrainerControl(), model=_Regressor(0))
    out["resume_from_state"] = elsewhere.state.state_dict()
    try:
        APSCallback("e4m3").on_train_begin(
            args, TrainerState(global_step=99), TrainerControl(), model=_Regressor(0)
        )
    except FileNotFoundError as exc:
        out["missing_error"] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        APSCallback("e4m3", resume_from=tmp).on_train_begin(
            args, at_mid, TrainerControl(), model=_Regressor(0)
        )
    out["no_file_warnings"] = [str(w.message) for w in caught]

    # A forward outside DDP: the callback says what is wrong, not an AttributeError.
    lost = APSCallback("e4m3")
    plain = _Regressor(0)
    lost.on_train_begin(args, TrainerState(), TrainerControl(), model=plain)
    try:
        plain(**data[0])
    except TypeError as exc:
        out["outside_ddp_error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> list[dict]:
    pytest.importorskip("transformers")
    tmp = str(tmp_path_factory.mktemp("transformers"))
    return made_once(
        tmp_path_factory,
        worker_id,
        "test_transformers.runs",
        lambda: run_distributed(_trainer_runs, 2, args=(tmp,), timeout=240),
    )


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_checkpoints_carry_every_ranks_hook_state_across_a_resume(runs: list[dict]) -> None:
    assert runs[0]["saved_world_size"] == 2
    assert runs[0]["saved_steps"] == [STEPS_PER_EPOCH, STEPS_PER_EPOCH]
    total = EPOCHS * STEPS_PER_EPOCH
    for out in runs:
        # The hook ran on every step of both runs; the resumed one counted on from the checkpoint.
        assert out["whole_state"]["step"] == out["resumed_state"]["step"] == total
        whole, resumed = out["whole_state"]["residuals"], out["resumed_state"]["residuals"]
        assert set(whole) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
        assert any(v.abs().sum() > 0 for v in whole.values())
        # Restarted residuals would change what the last steps send, so the weights too.
        assert whole.keys() == resumed.keys()
        assert all(torch.equal(whole[k], resumed[k]) for k in whole)
        assert _same(out["resumed"], out["whole"])
    # Each rank got its own residuals back, not rank 0's.
    r0, r1 = (out["resumed_state"]["residuals"] for out in runs)
    assert any(not torch.equal(r0[k], r1[k]) for k in r0)


@pytest.mark.slow
def test_a_checkpoint_elsewhere_is_read_from_resume_from_or_named(runs: list[dict]) -> None:
    saved = runs[0]["saved_residuals"]
    assert any(not torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    for rank, out in enumerate(runs):
        # The state at the first checkpoint: its step, and this rank's own residuals.
        restored = out["resume_from_state"]
        assert restored["step"] == STEPS_PER_EPOCH
        assert restored["residuals"].keys() == saved[rank].keys()
        assert all(torch.equal(restored["residuals"][k], v) for k, v in saved[rank].items())
        assert "resumes at step 99" in out["missing_error"]
        assert "checkpoint-99 is not a folder" in out["missing_error"]
        assert "resume_from=" in out["missing_error"]
        assert any(
            "has no aps_comm.pt" in w and "starts over" in w for w in out["no_file_warnings"]
        )


@pytest.mark.slow
def test_a_forward_outside_ddp_is_named(runs: list[dict]) -> None:
    for out in runs:
        assert (
            "_Regressor ran a training forward outside DistributedDataParallel"
            in (out["outside_ddp_error"])
        )


def test_one_process_is_refused_with_what_to_do(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from aps_comm.transformers import APSCallback

    environ = dict(os.environ)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        with pytest.raises(ValueError, match=r"has 1 process\(es\).*torchrun --nproc_per_node"):
            APSCallback().on_train_begin(
                args, TrainerState(), TrainerControl(), model=nn.Linear(2, 2)
            )
    finally:
        # Accelerate keeps its state per process, and torch's inductor its cache
        # folder in the environment: leave neither for later tests.
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(environ)


def test_a_job_trainer_did_not_join_is_named_with_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from aps_comm import transformers as aps_transformers

    environ = dict(os.environ)
    try:
        # What torchrun on a CPU machine gives a script whose TrainingArguments
        # lack use_cpu=True: a process group of 2, and Trainer alone in it.
        args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
        assert args.world_size == 1
        monkeypatch.setattr(aps_transformers.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(aps_transformers.dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(aps_transformers.torch.cuda, "is_available", lambda: False)

        def begin(args: TrainingArguments) -> str:
            with pytest.raises(ValueError) as caught:
                aps_transformers.APSCallback().on_train_begin(
                    args, TrainerState(), TrainerControl(), model=nn.Linear(2, 2)
                )
            return str(caught.value)

        message = begin(args)
        assert "torch.distributed has 2 processes, but Trainer runs this one alone" in message
        assert "TrainingArguments(..., use_cpu=True)" in message
        assert "launch one process per device" not in message  # the user did
        # Where use_cpu is not the cause, the environment Trainer reads the job from is.
        monkeypatch.setattr(args, "use_cpu", True)
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        message = begin(args)
        assert "use_cpu" not in message and "(LOCAL_RANK unset)" in message
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(environ)


def test_bad_format_names_the_value() -> None:
    pytest.importorskip("transformers")
    from aps_comm.transformers import APSCallback

    with pytest.raises(ValueError, match="'e9m9x'"):
        APSCallback("e9m9x")


@pytest.mark.slow
def test_import_aps_comm_does_not_import_transformers(runs: list[dict]) -> None:
    assert not any(out["transformers_before"] for out in runs)


def test_without_transformers_the_import_error_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "aps_comm.transformers", raising=False)
    with pytest.raises(ImportError, match=re.escape('pip install -e ".[transformers]"')):
        importlib.import_module("aps_comm.transformers")
