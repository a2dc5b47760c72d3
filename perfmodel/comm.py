"""Communication time of one gradient bucket, as the hooks reduce it.

The data path of each strategy (FP32 all-reduce; native all-reduce in the
wire dtype; APS two_phase; hierarchical and grid two_phase) and the chunk rule are
modelled in :mod:`aps_perfmodel.strategies`, which ``aps_comm``'s hook imports
to size its chunks and choose its strategy; this module applies them to a
format spec: ``strategy="auto"`` is the hook's per-bucket choice
(:func:`~aps_perfmodel.strategies.choose_strategy`), and a calibrated
profile's whole-hook timings, or the host time of a hook call measured on the
device (``hook_call.<fmt>`` in :attr:`~aps_perfmodel.cluster.Cluster.pass_costs`),
replace the parts' fixed cost.

Example:
    >>> from aps_perfmodel import bucket_comm, get_cluster, get_format
    >>> c = get_cluster("1gbe", world_size=4)
    >>> fp32 = bucket_comm(25 * 2**18, 10, get_format("fp32"), c)
    >>> fp8 = bucket_comm(25 * 2**18, 10, get_format("e4m3"), c)
    >>> 3.0 < fp32.total_s / fp8.total_s < 4.0
    True
"""

from __future__ import annotations

from dataclasses import replace

from .calibrate import CALL_ELEMENTS
from .choices import Scaling
from .cluster import Cluster, OpCost
from .formats import FORMATS, FormatSpec
from .strategies import (
    CommBreakdown,
    bucket_breakdown,
    choose_strategy,
    grid_rows,
    native_sum,
)

__all__ = ["CommBreakdown", "bucket_comm", "resolve_strategy"]


def resolve_strategy(n_elem: int, n_layers: int, fmt: FormatSpec, cluster: Cluster) -> str:
    """``fmt``'s strategy for this bucket: its own, or the hook's choice for ``"auto"``.

    "auto" may pick ``native`` where the cluster sums the wire dtype
    (:func:`~aps_perfmodel.strategies.native_sum`), ``hierarchical``
    where nodes have several ranks and ``grid`` where N >= 4 has a divisor
    2 <= g <= sqrt(N) (:func:`~aps_perfmodel.strategies.grid_rows`), as the
    hook does under ``reduction="auto"``.

    Example:
        >>> from aps_perfmodel import get_cluster, get_format
        >>> from aps_perfmodel.comm import resolve_strategy
        >>> resolve_strategy(2**22, 8, get_format("e4m3", "auto"), get_cluster("100gbe", 8))
        'grid'
        >>> resolve_strategy(2**22, 8, get_format("e4m3", "auto"), get_cluster("100gbe", 7))
        'two_phase'
    """
    if fmt.strategy != "auto":
        return fmt.strategy
    # The hook's choice: APS-scaled (every format but FP32), with fmt's scaling.
    return choose_strategy(
        n_elem,
        n_layers,
        fmt if fmt.name == "fp32" else replace(fmt, aps=True),
        cluster,
        native_ok=native_sum(fmt, cluster),
        hierarchical_ok=cluster.topology.gpus_per_node > 1,
        grid_ok=grid_rows(cluster.world_size) >= 2,
    )


def _hook_call(cluster: Cluster, fmt: FormatSpec) -> tuple[OpCost, str] | None:
    """The measured call of ``fmt``'s hook per bucket, and the strategy it was timed with.

    A calibrated profile times the whole call of a tiny bucket; a device's
    measured constants, the host time of a call on a settled bucket (which
    issues its kernels and collectives): either way the bucket's fixed cost.

    ``hook_call.fp16`` is torch's ``fp16_compress_hook``, ``hook_call.e4m3``
    the APS hook timed with two_phase: a path through the same hook (the same
    ``aps``), whatever its strategy, pays that hook's fixed cost.
    """
    call = cluster.pass_costs.get(f"hook_call.{fmt.name}")
    default = FORMATS.get(fmt.name)
    if call is None or default is None or fmt.aps != default.aps:
        return None
    return call, default.strategy


def bucket_comm(
    n_elem: int,
    n_layers: int,
    fmt: FormatSpec,
    cluster: Cluster,
    chunk_elements: int | str | None = "auto",
    n_blocks: int | None = None,
) -> CommBreakdown:
    """Time to reduce one bucket of ``n_elem`` FP32 gradients made of ``n_layers`` tensors.

    The parts (collectives, maxima, codec passes) come from the cluster's
    links and fits (:func:`~aps_perfmodel.strategies.bucket_breakdown`).
    Where the cluster is a calibrated profile that timed the format's hook
    whole on a tiny bucket, or its device carries the host time of the
    hook's call measured on a GPU (``hook_call.<fmt>`` in
    :attr:`~aps_perfmodel.cluster.Cluster.pass_costs`), the bucket's fixed
    cost is that measured call rather than the sum of the parts' latencies:
    ``overhead_s`` = call - parts(tiny bucket), negative where the parts,
    each timed alone after idling, pay a wake-up the hook pays once; never so
    negative that the bucket costs less than the call itself.

    Args:
        n_elem: gradient elements in the bucket.
        n_layers: parameter tensors in the bucket (APS sends one maximum each).
        fmt: wire format and strategy ("auto": the hook's choice for this bucket).
        cluster: links, device and any calibrated fits.
        chunk_elements: APS pipelines the bucket in chunks of this many
            elements ("auto": as the hook sizes them,
            :func:`~aps_perfmodel.strategies.strategy_chunk`; None: one
            chunk). The FP32 and torch's FP16 hooks never chunk.
        n_blocks: block scaling: the bucket's blocks (one exponent byte
            each); None: the most its layers can make
            (:meth:`~aps_perfmodel.formats.FormatSpec.block_bound`).

    Returns:
        The breakdown (its ``strategy`` says what "auto" chose); all zero on a
        single rank, where nothing is communicated.
    """
    strategy = resolve_strategy(n_elem, n_layers, fmt, cluster)
    parts = bucket_breakdown(n_elem, n_layers, fmt, cluster, strategy, chunk_elements, n_blocks)
    timed = _hook_call(cluster, fmt)
    if timed is None or parts.total_s == 0.0:
        return parts
    # The hook's own cost (Python, DDP's future, wake-ups) is what the timed call
    # took beyond its path's parts; another strategy or scaling pays its own parts
    # on top. The call was timed with per-layer scaling.
    call, calibrated = timed
    timed_fmt = replace(fmt, scaling=Scaling.LAYER)
    tiny = bucket_breakdown(CALL_ELEMENTS, n_layers, timed_fmt, cluster, calibrated, chunk_elements)
    # A bucket never costs less than the measured call: noisy parts (each timed
    # alone, on a busy machine) may add up to more than a tiny bucket's call.
    overhead = max(call.launch_s - tiny.total_s, call.launch_s - parts.total_s)
    return replace(parts, overhead_s=overhead)
