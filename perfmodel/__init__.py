"""Analytic performance model for low-precision gradient communication in DDP.

Predicts all-reduce and training-step time for FP32, FP16/BF16 and APS FP8 on
a model and a cluster, from alpha-beta-gamma link parameters (presets, explicit
numbers, or a profile calibrated on the actual machines).

Installed as ``aps_perfmodel`` (the checkout keeps it in ``perfmodel/``), so
that every name the package installs starts with ``aps``; the modules import
each other relatively so that they work under the installed name.

Example:
    >>> from aps_perfmodel import ComputeTime, get_cluster, get_model, predict
    >>> p = predict(get_model("gpt2-xl"), get_cluster("10gbe", world_size=16),
    ...             ["e4m3"], ComputeTime.from_step_time(1.0))
    >>> 1.0 < p.formats["e4m3"].speedup_vs_fp32 <= 4.0
    True
"""

from .api import (
    FormatResult,
    Prediction,
    SweepRow,
    breakeven_bandwidth,
    predict,
    sweep,
    write_csv,
)
from .cluster import (
    CLUSTERS,
    DEVICES,
    Cluster,
    Device,
    OpCost,
    custom_cluster,
    get_cluster,
    get_device,
)
from .collectives import LinkParams, Topology
from .comm import CommBreakdown, bucket_comm
from .compute import ComputeTime
from .ddp import BucketTiming, StepPrediction, assign_buckets, simulate_step
from .formats import FORMATS, FormatSpec, get_format
from .models import MODEL_PRESETS, ModelSpec, TensorSpec, get_model
from .profile import Profile

__all__ = [
    "CLUSTERS",
    "DEVICES",
    "FORMATS",
    "MODEL_PRESETS",
    "BucketTiming",
    "Cluster",
    "CommBreakdown",
    "ComputeTime",
    "Device",
    "FormatResult",
    "FormatSpec",
    "LinkParams",
    "ModelSpec",
    "OpCost",
    "Prediction",
    "Profile",
    "StepPrediction",
    "SweepRow",
    "TensorSpec",
    "Topology",
    "assign_buckets",
    "breakeven_bandwidth",
    "bucket_comm",
    "custom_cluster",
    "get_cluster",
    "get_device",
    "get_format",
    "get_model",
    "predict",
    "simulate_step",
    "sweep",
    "write_csv",
]
