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

__all__ = ["HostValue", "to_device"]


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


class HostValue:
    """A device value on its way to the host: copied without blocking, read once it arrived.

    On CUDA the copy goes to pinned memory on the current stream and an event
    marks its end; :meth:`result` waits only for that event. Elsewhere the
    value is used as it is.

    Example:
        >>> HostValue(torch.tensor(3.0)).result()
        tensor(3.)
    """

    def __init__(self, value: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if value.device.type == "cuda":
            self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self.host.copy_(value, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = value

    def refresh(self, value: torch.Tensor) -> None:
        """Copy ``value`` (the first one's shape, dtype and device) again: into the same
        pinned memory, behind the same event (no allocation). Call it once the last
        value was read: the copy overwrites it."""
        if self.event is None:
            self.host = value
            return
        self.host.copy_(value, non_blocking=True)
        self.event.record()

    def result(self) -> torch.Tensor:
        """The value on the host (waits for the copy where it has not finished)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host
