"""APSStrategy on real Lightning, 2 CPU ranks on Gloo, against plain DDP + aps_comm.register.

The ranks are started by :func:`aps_comm.testing.run_distributed`, which
initialises the process group; with ``LOCAL_RANK`` set, Lightning's default
cluster environment treats the processes as launched externally and uses
that group, so no Lightning launcher (and no second process start) is
involved.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import made_once
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import register
from aps_comm.testing import run_distributed

STEPS = 4  # 2 epochs of 2 batches; the resumed run stops after the first epoch
BATCH = 8
# DDP rebuilds its buckets after the first iteration unless
# find_unused_parameters=True; a resumed run's first iteration would then use
# the initial layout, where other ranks own the two_phase shards, so the
# residuals would be compensated but not bit for bit the uninterrupted run's
# (see APSState.state_dict). Keeping one layout makes the resume exact.


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2 * BATCH, 6, generator=gen)
    y = torch.randn(2 * BATCH, 3, generator=gen)
    return [(x[:BATCH], y[:BATCH]), (x[BATCH:], y[BATCH:])]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _plain_ddp(rank: int) -> tuple[list[torch.Tensor], dict]:
    net = _net()
    ddp = DDP(net, find_unused_parameters=True)
    state = register(ddp, "e4m3", error_feedback=True)
    opt = _optimizer(ddp.parameters())
    batches = _batches(rank)
    for step in range(STEPS):
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()], state.state_dict()


def _lightning_runs(rank: int, world_size: int, tmp: str) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import Logger

    from aps_comm.lightning import CHECKPOINT_KEY, APSStrategy

    # As Lightning's launchers do: LOCAL_RANK, and no LOCAL_WORLD_SIZE.
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    batches = _batches(rank)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            # The batch follows the step, not the loader: a resumed run restarts
            # the interrupted epoch's loader, and must still see the same data.
            x, y = batches[self.global_step % len(batches)]
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _optimizer(self.parameters())

        def train_dataloader(self) -> list[int]:
            return list(range(len(batches)))

    class MemoryLogger(Logger):
        name = "memory"
        version = "0"

        def __init__(self) -> None:
            super().__init__()
            self.metrics: list[tuple[int, dict]] = []

        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            self.metrics.append((step, dict(metrics)))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    class Record(L.Callback):
        """What the hook's state says after each step, to compare with what was logged."""

        def __init__(self) -> None:
            self.steps: list[dict] = []

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            stats = trainer.strategy.state.stats
            self.steps.append(
                {
                    "bytes_sent": trainer.strategy.state.bytes_sent,
                    "bytes_total": trainer.strategy.state.bytes_total,
                    "bytes_detail": dict(trainer.strategy.state.bytes_detail),
                    "underflowing_layers": sum(s.underflow_rate > 0 for s in stats),
                    "saturated": sum(s.saturated for s in stats),
                    "exponents": [s.exponent for s in stats],
                }
            )

    def trainer(max_steps: int, *callbacks: L.Callback, stats: bool = False) -> L.Trainer:
        strategy = APSStrategy(
            "e4m3", error_feedback=True, stats=stats, find_unused_parameters=True
        )
        return L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategy,
            max_steps=max_steps,
            use_distributed_sampler=False,
            enable_checkpointing=bool(callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp,
            log_every_n_steps=1,
            logger=MemoryLogger(),
            callbacks=[Record(), *callbacks],
        )

    out: dict[str, Any] = {}
    reference, out["reference_state"] = _plain_ddp(rank)
    out["reference"] = reference

    # A checkpoint at the end of the first epoch: a resume starts the next
    # epoch at its first batch, as the uninterrupted run does.
    every_epoch = ModelCheckpoint(tmp, "{epoch}", save_top_k=-1, save_on_train_epoch_end=True)
    whole = trainer(STEPS, every_epoch, stats=True)
    model = Module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole.fit(model)
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    out["local_world_size"] = os.environ.get("LOCAL_WORLD_SIZE")
    out["whole"] = [p.detach().clone() for p in model.net.parameters()]
    out["whole_state"] = whole.strategy.state.state_dict()
    out["logged"] = whole.logger.metrics
    out["recorded"] = whole.callbacks[0].steps

    ckpt = Path(tmp) / "epoch=0.ckpt"
    if rank == 0:
        saved = torch.load(ckpt, weights_only=True)[CHECKPOINT_KEY]
        out["saved_world_size"] = saved["world_size"]
        out["saved_ranks_steps"] = [s["step"] for s in saved["ranks"]]
    second = trainer(STEPS)
    resumed = Module()
    second.fit(resumed, ckpt_path=ckpt)
    out["resumed"] = [p.detach().clone() for p in resumed.net.parameters()]
    out["resumed_state"] = second.strategy.state.state_dict()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> list[dict]:
    pytest.importorskip("lightning")
    tmp = str(tmp_path_factory.mktemp("lightning"))
    return made_once(
        tmp_path_factory,
        worker_id,
        "test_lightning.runs",
        lambda: run_distributed(_lightning_runs, 2, args=(tmp,), timeout=180),
    )


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_hook_runs_every_step_on_cpu_and_matches_plain_ddp(runs: list[dict]) -> None:
    for out in runs:
        assert out["whole_state"]["step"] == STEPS
        # Same seed, data and optimizer: Lightning's loop computes exactly what the
        # plain loop does, so the weights and the residuals agree bit for bit.
        assert _same(out["whole"], out["reference"])
        mine = out["whole_state"]["residuals"]
        ref = out["reference_state"]["residuals"]
        assert set(mine) == {f"net.{k}" for k in ref}
        assert all(torch.equal(mine[f"net.{k}"], v) for k, v in ref.items())
        assert any(v.abs().sum() > 0 for v in ref.values())
    assert not _same(runs[0]["whole"], [p.detach() for p in _net().parameters()])


@pytest.mark.slow
def test_checkpoint_resume_restores_every_ranks_state(runs: list[dict]) -> None:
    assert runs[0]["saved_world_size"] == 2 and runs[0]["saved_ranks_steps"] == [2, 2]
    for out in runs:
        assert out["resumed_state"]["step"] == STEPS
        # The residuals carried over the resume: without them the last two
        # steps would send other values (error feedback adds them back).
        assert _same(out["resumed"], out["whole"])
        whole, resumed = out["whole_state"]["residuals"], out["resumed_state"]["residuals"]
        assert whole.keys() == resumed.keys()
        assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    # Each rank got its own residuals back, not rank 0's.
    r0, r1 = (out["resumed_state"]["residuals"] for out in runs)
    assert any(not torch.equal(r0[k], r1[k]) for k in r0)


@pytest.mark.slow
def test_stats_are_logged_every_step(runs: list[dict]) -> None:
    for out in runs:
        logged = [m for _, m in out["logged"] if "aps/bytes_sent" in m]
        recorded = out["recorded"]
        assert len(logged) == len(recorded) == STEPS
        for m, r in zip(logged, recorded, strict=True):
            assert m["aps/bytes_sent"] == r["bytes_sent"] > 0
            assert m["aps/bytes_total"] == r["bytes_total"] == sum(r["bytes_detail"].values())
            assert m["aps/underflowing_layers"] == r["underflowing_layers"]
            assert m["aps/saturated"] == r["saturated"]
            assert m["aps/mean_exponent"] == pytest.approx(
                sum(r["exponents"]) / len(r["exponents"])
            )
            assert 0.0 <= m["aps/max_underflow_rate"] <= 1.0


@pytest.mark.slow
def test_one_node_run_gives_no_hierarchical_warning(runs: list[dict]) -> None:
    # LOCAL_RANK 1 on rank 1 without LOCAL_WORLD_SIZE once read as one rank per
    # node, numbered wrongly: "no hierarchical reduction: ranks [1] have a
    # LOCAL_RANK that is not their rank modulo 1", on a run that never asked.
    for out in runs:
        assert out["local_world_size"] == "2"
        assert not [w for w in out["warnings"] if "hierarchical" in w], out["warnings"]


@pytest.mark.parametrize("key", ["ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"])
def test_another_hook_is_refused(key: str) -> None:
    pytest.importorskip("lightning")
    from aps_comm.lightning import APSStrategy

    with pytest.raises(ValueError, match=f"{key} must not be given"):
        APSStrategy("e4m3", **{key: print})


def test_bad_format_names_the_value() -> None:
    pytest.importorskip("lightning")
    from aps_comm.lightning import APSStrategy

    with pytest.raises(ValueError, match="'e9m9x'"):
        APSStrategy("e9m9x")


@pytest.mark.slow
def test_lightning_is_optional() -> None:
    code = (
        "import sys\n"
        "import aps_comm\n"
        "assert 'lightning' not in sys.modules, 'import aps_comm imported lightning'\n"
        "sys.modules['lightning'] = None  # as if it were not installed\n"
        "try:\n"
        "    import aps_comm.lightning\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert 'pip install "lightning>=2.2"' in done.stdout
