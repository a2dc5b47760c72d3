"""register_accelerate on real Accelerate, 2 CPU ranks on Gloo, against plain DDP + register.

:func:`aps_comm.testing.run_distributed` starts the ranks and initialises the
process group; with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set, as
``accelerate launch`` or torchrun would, ``Accelerator(cpu=True)`` sees a
multi-CPU job and uses that group.
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import made_once
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import register
from aps_comm.testing import run_distributed

STEPS = 4
BATCH = 8


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2 * BATCH, 6, generator=gen)
    y = torch.randn(2 * BATCH, 3, generator=gen)
    return [(x[:BATCH], y[:BATCH]), (x[BATCH:], y[BATCH:])]


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple, backward: Any) -> None:
    x, y = batch
    opt.zero_grad()
    backward(nn.functional.mse_loss(model(x), y))
    opt.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _accelerate_runs(rank: int, world_size: int, tmp: str) -> dict:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
    )
    from accelerate import Accelerator
    from accelerate.utils import (
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        DistributedType,
    )

    from aps_comm.accelerate import register_accelerate

    batches = _batches(rank)
    out: dict[str, Any] = {}

    # DDP rebuilds its buckets after the first iteration unless
    # find_unused_parameters=True; the resumed run's first iteration would then
    # use the initial layout, with other two_phase shard owners (compensated,
    # not bitwise: see APSState.state_dict). One layout makes the resume exact.
    net = _net()
    ddp = DDP(net, find_unused_parameters=True)
    reference = register(ddp, "e4m3", error_feedback=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        _step(ddp, opt, batches[step % 2], torch.Tensor.backward)
    out["reference"], out["reference_state"] = _params(net), reference.state_dict()

    def prepared(seed: int, **ddp_kwargs: Any) -> tuple[Accelerator, nn.Module, Any]:
        handler = DistributedDataParallelKwargs(find_unused_parameters=True, **ddp_kwargs)
        accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
        net = _net(seed)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        model, opt = accelerator.prepare(net, opt)
        return accelerator, model, opt

    accelerator, model, opt = prepared(0)
    out["multi_cpu"] = accelerator.distributed_type == DistributedType.MULTI_CPU
    out["wrapped"] = type(model).__name__
    state = register_accelerate(accelerator, model, "e4m3", error_feedback=True)
    for step in range(STEPS):
        _step(model, opt, batches[step % 2], accelerator.backward)
        if step + 1 == STEPS // 2:
            accelerator.save_state(tmp)
    out["whole"], out["whole_state"] = _params(model), state.state_dict()

    # Another initialisation: the weights too must come from the checkpoint.
    accelerator, model, opt = prepared(1)
    resumed = register_accelerate(accelerator, model, "e4m3", error_feedback=True)
    accelerator.load_state(tmp)
    out["loaded_step"] = resumed.step
    for step in range(STEPS // 2, STEPS):
        _step(model, opt, batches[step % 2], accelerator.backward)
    out["resumed"], out["resumed_state"] = _params(model), resumed.state_dict()
    out["saved"] = sorted(p.name for p in Path(tmp).iterdir())

    try:
        register_accelerate(accelerator, accelerator.unwrap_model(model))
    except TypeError as exc:
        out["unwrapped_error"] = str(exc)
    accelerator, model, _ = prepared(0, comm_hook=DDPCommunicationHookType.FP16)
    try:
        register_accelerate(accelerator, model)
    except ValueError as exc:
        out["hook_error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> list[dict]:
    pytest.importorskip("accelerate")
    tmp = str(tmp_path_factory.mktemp("accelerate"))
    return made_once(
        tmp_path_factory,
        worker_id,
        "test_accelerate.runs",
        lambda: run_distributed(_accelerate_runs, 2, args=(tmp,), timeout=180),
    )


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_prepared_model_takes_the_hook_and_matches_plain_ddp(runs: list[dict]) -> None:
    for out in runs:
        assert out["multi_cpu"] and out["wrapped"] == "DistributedDataParallel"
        assert out["whole_state"]["step"] == STEPS
        assert _same(out["whole"], out["reference"])
        mine, ref = out["whole_state"]["residuals"], out["reference_state"]["residuals"]
        assert mine.keys() == ref.keys()
        assert all(torch.equal(mine[k], ref[k]) for k in ref)
        assert any(v.abs().sum() > 0 for v in ref.values())


@pytest.mark.slow
def test_save_state_and_load_state_carry_every_ranks_hook_state(runs: list[dict]) -> None:
    assert "custom_checkpoint_0.pkl" in runs[0]["saved"]
    for out in runs:
        assert out["loaded_step"] == STEPS // 2
        assert out["resumed_state"]["step"] == STEPS
        assert _same(out["resumed"], out["whole"])
        whole, resumed = out["whole_state"]["residuals"], out["resumed_state"]["residuals"]
        assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    r0, r1 = (out["resumed_state"]["residuals"] for out in runs)
    assert any(not torch.equal(r0[k], r1[k]) for k in r0)


@pytest.mark.slow
def test_wrong_models_are_refused(runs: list[dict]) -> None:
    for out in runs:
        assert "got Sequential (distributed type" in out["unwrapped_error"]
        assert "DistributedDataParallelKwargs(comm_hook=fp16) already" in out["hook_error"]


def test_one_process_is_a_no_op_with_a_warning() -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from aps_comm.accelerate import register_accelerate

    try:
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(_net())
        with pytest.warns(UserWarning, match="single process"):
            assert register_accelerate(accelerator, model) is None
        assert not isinstance(model, DDP)
    finally:
        # Accelerate keeps its state per process: leave none for later tests.
        AcceleratorState._reset_state(reset_partial_state=True)


def test_accelerate_is_optional() -> None:
    code = (
        "import sys\n"
        "import aps_comm\n"
        "assert 'accelerate' not in sys.modules, 'import aps_comm imported accelerate'\n"
        "sys.modules['accelerate'] = None  # as if it were not installed\n"
        "try:\n"
        "    import aps_comm.accelerate\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert 'pip install "accelerate>=0.30"' in done.stdout
