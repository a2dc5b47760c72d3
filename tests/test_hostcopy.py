"""HostValue: a device value read on the host once its copy arrived."""

from __future__ import annotations

import pytest
import torch

from aps_comm.hostcopy import HostValue


def test_a_cpu_value_is_read_as_it_is_and_refreshed_to_the_new_one() -> None:
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    value = HostValue(first)
    assert value.result() is first
    value.refresh(second)
    assert value.result() is second


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_value_is_refreshed_into_the_same_pinned_memory() -> None:
    device = torch.device("cuda")
    value = HostValue(torch.tensor([1.0, 2.0], device=device))
    host = value.result()
    assert host.is_pinned() and host.tolist() == [1.0, 2.0]
    value.refresh(torch.tensor([3.0, 4.0], device=device))
    again = value.result()
    assert again.data_ptr() == host.data_ptr() and again.tolist() == [3.0, 4.0]
