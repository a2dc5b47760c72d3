"""GatheredState in one process: the layout it saves, and what a resume restores.

The gather across real ranks is covered by tests/test_lightning.py and
tests/test_accelerate.py (checkpoints resumed bit for bit on 2 ranks).
"""

import pytest
import torch

from aps_comm import APSState
from aps_comm.checkpoint import GatheredState


def _saved(world_size: int, step: int) -> dict:
    base = APSState("e4m3", error_feedback=True).state_dict()
    ranks = [
        dict(base, step=step, rates={"w": 0.1 * r}, residuals={"w": torch.full((3,), float(r))})
        for r in range(world_size)
    ]
    return {"world_size": world_size, "ranks": ranks}


def test_without_a_process_group_it_is_one_rank() -> None:
    state = APSState("e4m3", error_feedback=True)
    GatheredState(state).load_state_dict(_saved(1, step=3))
    assert state.step == 3
    saved = GatheredState(state).state_dict()
    assert saved is not None and saved["world_size"] == 1
    assert saved["ranks"][0]["step"] == 3
    assert torch.equal(saved["ranks"][0]["residuals"]["w"], torch.zeros(3))
    again = APSState("e4m3", error_feedback=True)
    GatheredState(again).load_state_dict(saved)
    assert again.state_dict()["rates"] == {"w": 0.0}


def test_another_world_size_keeps_the_step_and_drops_residuals() -> None:
    state = APSState("e4m3", error_feedback=True)
    with pytest.warns(UserWarning, match="saved by 2 ranks, restored on 1"):
        GatheredState(state).load_state_dict(_saved(2, step=7))
    restored = state.state_dict()
    assert restored["step"] == 7 and restored["residuals"] == {} and restored["rates"] == {}


def test_bad_input_is_named() -> None:
    with pytest.raises(TypeError, match="got dict"):
        GatheredState({})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"not a GatheredState checkpoint.*\['step'\]"):
        GatheredState(APSState()).load_state_dict({"step": 1})
    # Another configuration: APSState names both.
    with pytest.raises(ValueError, match="checkpoint was saved with"):
        GatheredState(APSState("e5m2", error_feedback=True)).load_state_dict(_saved(1, step=1))


def test_residuals_go_back_to_the_device_they_were_saved_from() -> None:
    # "meta" stands for the gradients' device on a machine without an accelerator.
    saved = _saved(1, step=2)
    saved["ranks"][0]["device"] = "meta"
    state = APSState("e4m3", error_feedback=True)
    GatheredState(state).load_state_dict(saved)
    assert state.state_dict()["residuals"]["w"].device == torch.device("meta")
    # A device given moves them there instead (a resume on other hardware).
    elsewhere = APSState("e4m3", error_feedback=True)
    GatheredState(elsewhere, "cpu").load_state_dict(saved)
    restored = elsewhere.state_dict()
    assert torch.equal(restored["residuals"]["w"], torch.zeros(3)) and "device" not in restored


def test_a_device_this_process_cannot_use_is_named() -> None:
    saved = _saved(1, step=2)
    saved["ranks"][0]["device"] = "cuda:99"
    with pytest.raises(RuntimeError, match=r"saved on cuda:99\) cannot be moved.*device=\.\.\."):
        GatheredState(APSState("e4m3", error_feedback=True)).load_state_dict(saved)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_residuals_come_back_on_cuda() -> None:
    state = APSState("e4m3", error_feedback=True)
    on_gpu = _saved(1, step=5)["ranks"][0]
    state.load_state_dict(dict(on_gpu, residuals={"w": torch.arange(3.0, device="cuda")}))
    saved = GatheredState(state).state_dict()
    assert saved is not None and saved["ranks"][0]["residuals"]["w"].device.type == "cpu"
    again = APSState("e4m3", error_feedback=True)
    GatheredState(again).load_state_dict(saved)
    residual = again.state_dict()["residuals"]["w"]
    assert residual.device == torch.device("cuda", 0)
    assert torch.equal(residual.cpu(), torch.arange(3.0))
