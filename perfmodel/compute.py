"""Compute time of one training step: forward, backward, optimizer.

Either given (a measured step time, split forward:backward = 1:2, the usual
ratio since backward computes gradients for both activations and weights) or
estimated from the model's FLOPs, the batch size and a device preset at an
assumed model-FLOPs utilisation.

Example:
    >>> c = ComputeTime.from_step_time(0.09)
    >>> round(c.forward_s, 3), round(c.backward_s, 3)
    (0.03, 0.06)
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Device
from .models import ModelSpec

__all__ = ["OPTIMIZER_BYTES_PER_PARAM", "ComputeTime"]

# Memory traffic per parameter of one optimizer step on FP32 state
# (read/write param and each state tensor, read the gradient).
OPTIMIZER_BYTES_PER_PARAM = {"sgd": 12.0, "momentum": 20.0, "adam": 36.0}


@dataclass(frozen=True)
class ComputeTime:
    """Seconds of computation in one step on one rank.

    Attributes:
        forward_s: forward pass.
        backward_s: backward pass (gradients become ready during it).
        optimizer_s: optimizer step after the gradients are reduced.

    Example:
        >>> ComputeTime(0.01, 0.02, 0.001).total_s
        0.031
    """

    forward_s: float
    backward_s: float
    optimizer_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.forward_s, self.backward_s, self.optimizer_s) < 0:
            raise ValueError(f"compute times must be non-negative: {self}")

    @property
    def total_s(self) -> float:
        """Step time without any communication."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @classmethod
    def from_step_time(cls, step_s: float, optimizer_s: float = 0.0) -> ComputeTime:
        """Split a measured compute-only step time (including ``optimizer_s``) 1:2.

        Example:
            >>> ComputeTime.from_step_time(0.031, optimizer_s=0.001).backward_s
            0.02
        """
        if step_s < optimizer_s:
            raise ValueError("step time must include the optimizer time")
        rest = step_s - optimizer_s
        return cls(rest / 3.0, 2.0 * rest / 3.0, optimizer_s)

    @classmethod
    def estimate(
        cls,
        model: ModelSpec,
        device: Device,
        batch_size: int,
        *,
        dtype: str | None = None,
        mfu: float = 0.4,
        optimizer: str = "adam",
    ) -> ComputeTime:
        """Estimate from FLOPs: forward = batch * FLOPs / (peak * mfu), backward = 2x.

        ``batch_size`` is per rank (sequences for language models, whose FLOPs
        per sample are per sequence of the preset's ``seq_len``). ``dtype``
        defaults to the device's mixed-precision dtype
        (:attr:`~aps_perfmodel.cluster.Device.compute_dtype`: bf16, V100's fp16). The optimizer
        is memory-bound: :data:`OPTIMIZER_BYTES_PER_PARAM` over memory bandwidth.

        Example:
            >>> from aps_perfmodel.cluster import get_device
            >>> from aps_perfmodel.models import get_model
            >>> c = ComputeTime.estimate(get_model("resnet50"), get_device("v100"), 32,
            ...                          dtype="fp32", mfu=1.0)
            >>> round(c.forward_s * 1e3, 1)
            16.7
        """
        if not 0 < mfu <= 1:
            raise ValueError("mfu must be in (0, 1]")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        flops = model.forward_flops_per_sample
        if flops <= 0:
            raise ValueError(
                f"model {model.name!r} has no FLOP counts; give the compute time instead"
            )
        dtype = dtype or device.compute_dtype
        try:
            peak = device.peak_flops[dtype]
        except KeyError:
            raise ValueError(f"device {device.name} has no {dtype!r} peak") from None
        try:
            opt_bytes = OPTIMIZER_BYTES_PER_PARAM[optimizer]
        except KeyError:
            raise ValueError(
                f"optimizer must be one of {sorted(OPTIMIZER_BYTES_PER_PARAM)}"
            ) from None
        forward = batch_size * flops / (peak * mfu)
        return cls(forward, 2.0 * forward, model.total_params * opt_bytes / device.mem_bw)
