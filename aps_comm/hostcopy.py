"""Host metadata onto a device without making the host wait.

Plans, layouts and code tables are built on the host once and copied to the
data's device. A pageable host-to-device copy blocks the host until the
device has taken it; from pinned memory with ``non_blocking=True`` it is
queued on the current stream and the host goes on. PyTorch's caching host
allocator keeps the pinned block alive until that copy has run (it records
an event on the stream when the tensor is freed), so the host tensor may be
dropped at once.

Example:
    >>> to_device(torch.tensor([3, 1]), torch.device("cpu"))
    tensor([3, 1])
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: pinned and non-blocking on CUDA.

    On any other device this is ``host.to(device)`` (a CPU tensor stays
    itself); :meth:`torch.Tensor.pin_memory` needs CUDA, so it is used only
    where the target is a CUDA device.

    Example:
        >>> to_device(torch.arange(3), "meta").shape
        torch.Size([3])
    """
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
