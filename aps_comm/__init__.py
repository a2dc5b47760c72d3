"""aps-comm: low-precision gradient communication for PyTorch DDP.

Auto Precision Scaling (APS): per-layer power-of-two scaling from one MAX
all-reduce of the layer maxima, gradients cast to FP8/FP16/BF16 (or any
custom small float) for the reduction, unscaled in FP32.

Example:
    >>> from aps_comm import register
    >>> state = register(ddp_model, fmt="e4m3")  # doctest: +SKIP
"""

from aps_comm.codec import Codec, decode, encode
from aps_comm.config import Reduction, Scaling
from aps_comm.formats import FloatFormat, get_format
from aps_comm.hook import APSConfig, APSState, aps_hook, register
from aps_comm.policy import ByName, KeepLast, LowRatio, MinNumel, Promote, Schedule
from aps_comm.telemetry import LayerStats

__all__ = [
    "APSConfig",
    "APSState",
    "ByName",
    "Codec",
    "FloatFormat",
    "KeepLast",
    "LayerStats",
    "LowRatio",
    "MinNumel",
    "Promote",
    "Reduction",
    "Scaling",
    "Schedule",
    "aps_hook",
    "decode",
    "encode",
    "get_format",
    "register",
]

__version__ = "0.1.0"
