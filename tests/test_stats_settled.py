"""A settled bucket's statistics (``stats=True``) are the full path's, step by step.

Issue 46: with ``stats=True`` a bucket settles like a plain one (its records
made by one kernel call on the CPU, a fixed handful of device ops elsewhere).
On 2 ranks (4 for hierarchical), one state runs its bucket settled from the
second step on; its records must equal :func:`aps_comm.simulate.records` of
every rank's gradients (gathered), through a layer of zeros, an empty layer,
layers that underflow, and steps where one rank's layer holds inf or NaN.
Per layer and per block (each rank's own block exponents, as the hook sends
them), two_phase, native sums and hierarchical, CPU kernels and torch ops.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from aps_comm import APSState, cpu_kernels, simulate
from aps_comm.testing import run_distributed

NUMELS = [6, 0, 40, 1, 300, 17]
STEPS = 5


def _grads(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    zeros, _, wide, one, big, half = torch.zeros(sum(NUMELS)).split(NUMELS)
    # Elements spanning 24 decades: more than e4m3's or fp16's range, so some underflow.
    wide.copy_(torch.randn(40, generator=gen) * torch.logspace(0, -24, 40))
    one.fill_((rank + 1) * 0.5)
    if step == 2 and rank == 1:
        one.fill_(math.inf)  # the layer is non-finite on every rank
    if step == 3 and rank == 0:
        one.fill_(math.nan)
    big.copy_(torch.randn(300, generator=gen) * 2.0 ** (7 * step - 10))
    big[::5] = 0.0
    if rank != 0:  # zero on rank 0 only
        half.copy_(torch.randn(17, generator=gen))
    return torch.cat([zeros, wide.new_empty(0), wide, one, big, half])


def _records(
    rank: int, world_size: int, fmt: str, reduction: str, scaling: str, kernels: bool
) -> list:
    if not kernels:
        cpu_kernels.AVAILABLE = False  # this process's codecs: the torch ops (the GPU's path)
    params = [torch.nn.Parameter(torch.empty(n)) for n in NUMELS]
    model = torch.nn.ParameterList(params)
    # Staged routes: nodes (or grid rows) of 2 ranks.
    per_node = 2 if reduction in ("hierarchical", "grid") else None
    options = {"reduction": reduction, "scaling": scaling, "ranks_per_node": per_node}
    settled = APSState(fmt, stats=True, **options)
    settled.bind_model(model)
    names = [name for name, _ in model.named_parameters()]
    # The reference: the native sum's exponents are the ring's (any wire-format order's).
    sim = {
        "reduction": "ring" if reduction == "allreduce" else reduction,
        "scaling": scaling,
        "ranks_per_node": per_node or 1,
        "rank_exponents": scaling == "block",  # the hook's default block exponents
    }
    buffer = torch.empty(sum(NUMELS))  # DDP's bucket buffer: the same every step
    out = []
    for step in range(STEPS):
        x = _grads(step, rank)
        everyone = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(everyone, x)
        layers = torch.stack(everyone).split(NUMELS, dim=1)
        want = simulate.records(layers, fmt, rank, names=names, **sim)
        reducer = settled.reducer
        on_path = reducer is not None and reducer.steady_for(0, buffer) is not None
        backend = reducer.steady[0].group.codec.backend if on_path else None  # type: ignore[union-attr]
        buffer.copy_(x)
        settled.run_bucket(0, buffer, params)
        out.append((on_path, backend, settled.stats, want))
    return out


@pytest.mark.parametrize(
    ("fmt", "reduction", "scaling", "kernels", "world"),
    [
        ("e4m3", "two_phase", "layer", True, 2),
        ("fp16", "allreduce", "layer", True, 2),
        ("e4m3", "two_phase", "layer", False, 2),
        ("e2m1", "two_phase", "block", True, 2),
        ("e2m1", "hierarchical", "block", True, 4),  # 2 nodes of 2
        # One exponent for the bucket (the records keep each layer's maximum), none at all.
        ("e4m3", "two_phase", "bucket", True, 2),
        ("fp16", "allreduce", "bucket", False, 2),
        ("e4m3", "two_phase", "none", True, 2),
        ("e4m3", "two_phase", "none", False, 2),
        # Staged routes with one exponent per layer (or bucket, or none): the first level's.
        ("e4m3", "hierarchical", "layer", True, 4),
        ("e4m3", "grid", "bucket", True, 4),
        ("e4m3", "grid", "layer", False, 4),
        ("fp16", "hierarchical", "none", True, 4),
    ],
)
def test_settled_records_equal_the_simulated_ones(
    fmt: str, reduction: str, scaling: str, kernels: bool, world: int
) -> None:
    args = (fmt, reduction, scaling, kernels)
    runs = run_distributed(_records, world, args=args, timeout=180)
    blocks = scaling == "block"  # each rank's own block exponents: its own maxima
    for rank, steps in enumerate(runs):
        for step, (on_path, backend, settled, want) in enumerate(steps):
            assert on_path == (step > 0), (rank, step)  # settled from the second step on
            if on_path:
                assert (backend == "kernels") == kernels
            assert [s.numel for s in settled] == NUMELS
            assert settled == want, (rank, step)
            zeros, empty, wide, one, _, half = settled
            assert zeros.amax == 0.0 and zeros.exponent == 0 and zeros.underflow_rate == 0.0
            assert empty.amax == 0.0 and empty.underflow_rate == 0.0
            assert wide.underflow_rate > 0.0  # some of its 24 decades flush
            assert (half.amax > 0.0) == (rank != 0 or not blocks)
            if (step, rank) in ((2, 1), (3, 0)) or (step in (2, 3) and not blocks):
                assert one.amax == math.inf and one.exponent == 0  # NaN or inf: inf
            else:
                assert one.amax == (rank + 1 if blocks else world) * 0.5
        # Rank 1's inf passes the format's max once scaled: counted saturated.
        assert steps[2][2][3].saturated == (rank == 1)
