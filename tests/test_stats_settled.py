"""A settled bucket's records (``stats=True``) and gradients are the simulated ones, step by step.

Issue 46: with ``stats=True`` a bucket settles like a plain one (its records
made by one kernel call on the CPU, a fixed handful of device ops elsewhere).
On 2 ranks (4 for hierarchical), one state runs its bucket settled from the
second step on; its records must equal :func:`aps_comm.simulate.records` of
every rank's gradients (gathered), through a layer of zeros, an empty layer,
layers that underflow, and steps where one rank's layer holds inf or NaN.
Per layer and per block (each rank's own block exponents, as the hook sends
them), two_phase, native sums and hierarchical, CPU kernels and torch ops; the
gradients bit for bit with :func:`aps_comm.simulate.allreduce` too.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aps_comm import APSState, simulate
from aps_comm.testing import run_distributed
from benchmarks.hostcost import forced_codec
from tests.conftest import gather

NUMELS = [6, 0, 40, 1, 300, 17]
STEPS = 5
BIG = sum(NUMELS[:4])  # where the layer of 300 starts


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
    rank: int, world_size: int, fmt: str, reduction: str, scaling: str, backends: tuple[str, ...]
) -> list:
    out = []
    for backend in backends:
        # The torch ops as a GPU without Triton runs them: no CPU kernels at all.
        with forced_codec(None if backend == "kernels" else backend, kernels=False):
            out.append(_run(rank, world_size, fmt, reduction, scaling, backend))
    return out


def _run(rank: int, world: int, fmt: str, reduction: str, scaling: str, backend: str) -> list:
    # "block/agreed": block scaling with agreed block exponents (default: each rank's own).
    scaling, _, exponents = scaling.partition("/")
    agreed = exponents == "agreed"
    params = [torch.nn.Parameter(torch.empty(n)) for n in NUMELS]
    model = torch.nn.ParameterList(params)
    # Staged routes: nodes (or grid rows) of 2 ranks.
    per_node = 2 if reduction in ("hierarchical", "grid") else None
    options = {"reduction": reduction, "scaling": scaling, "ranks_per_node": per_node}
    if agreed:
        options["block_exponents"] = "agreed"
    settled = APSState(fmt, stats=True, **options)
    settled.bind_model(model)
    names = [name for name, _ in model.named_parameters()]
    # The reference: the native sum's exponents are the ring's (any wire-format order's).
    sim = {
        "reduction": "ring" if reduction == "allreduce" else reduction,
        "scaling": scaling,
        "ranks_per_node": per_node or 1,
        "rank_exponents": scaling == "block" and not agreed,  # the hook's default
    }
    buffer = torch.empty(sum(NUMELS))  # DDP's bucket buffer: the same every step
    out = []
    for step in range(STEPS):
        x = _grads(step, rank)
        if scaling == "block" and step == STEPS - 1 and rank == world - 1:
            x[BIG + 7] = math.nan  # one block of a layer of many: the whole layer NaN
        layers = torch.split(gather(x), NUMELS, dim=1)
        want = simulate.records(layers, fmt, rank, names=names, **sim)
        reducer = settled.reducer
        on_path = reducer is not None and reducer.steady_for(0, buffer) is not None
        bound = reducer.steady[0].group.codec.backend if on_path else None  # type: ignore[union-attr]
        buffer.copy_(x)
        got = settled.run_bucket(0, buffer, params)
        # Staged routes with rank block exponents: the chunk decides who owns what.
        staged_blocks = per_node is not None and scaling == "block" and not agreed
        chunk = settled.bucket_chunks[0] if staged_blocks else None
        expected = torch.cat(simulate.allreduce(layers, fmt, chunk_elements=chunk, **sim))
        # Bit for bit, every NaN the same NaN.
        same = torch.equal(got.isnan(), expected.isnan()) and torch.equal(
            got.nan_to_num(0.0).view(torch.int32), expected.nan_to_num(0.0).view(torch.int32)
        )
        nan = tuple(bool(part.isnan().all()) for part in got.split(NUMELS) if part.numel())
        out.append((on_path, bound, settled.stats, want, same, dict(settled.bytes_detail), nan))
    return out


@pytest.mark.parametrize(
    ("fmt", "reduction", "scaling", "backends", "world"),
    [
        ("e4m3", "two_phase", "layer", ("kernels",), 2),
        ("fp16", "allreduce", "layer", ("kernels",), 2),
        ("e4m3", "two_phase", "layer", ("cast",), 2),
        ("e2m1", "two_phase", "block", ("kernels", "bits"), 2),
        ("e4m3", "two_phase", "block", ("cast",), 2),
        ("e2m1", "hierarchical", "block", ("kernels", "bits"), 4),  # 2 nodes of 2
        ("e4m3", "grid", "block", ("cast", "bits"), 4),  # grid rows of 2
        # Agreed block exponents on the staged routes: two keys per block, by torch ops.
        ("e2m1", "hierarchical", "block/agreed", ("kernels", "bits"), 4),
        ("e4m3", "grid", "block/agreed", ("cast",), 4),
        # One exponent for the bucket (the records keep each layer's maximum), none at all.
        ("e4m3", "two_phase", "bucket", ("kernels",), 2),
        ("fp16", "allreduce", "bucket", ("cast",), 2),
        ("e4m3", "two_phase", "none", ("kernels",), 2),
        ("e4m3", "two_phase", "none", ("cast",), 2),
        # Staged routes with one exponent per layer (or bucket, or none): the first level's.
        ("e4m3", "hierarchical", "layer", ("kernels",), 4),
        ("e4m3", "grid", "bucket", ("kernels",), 4),
        ("e4m3", "grid", "layer", ("cast",), 4),
        ("fp16", "hierarchical", "none", ("kernels",), 4),
    ],
)
def test_settled_records_and_gradients_equal_the_simulated_ones(
    fmt: str, reduction: str, scaling: str, backends: tuple[str, ...], world: int
) -> None:
    args = (fmt, reduction, scaling, backends)
    runs = run_distributed(_records, world, args=args, timeout=180)
    for rank, per_backend in enumerate(runs):
        for backend, steps in zip(backends, per_backend, strict=True):
            _check(steps, rank, world, scaling, backend)


def _check(steps: list, rank: int, world: int, scaling: str, backend: str) -> None:
    """One backend's steps on one rank: settled from the second step, on that backend,
    with the simulated records and gradients, the same bytes every step."""
    blocks = scaling.startswith("block")  # the records keep this rank's own block maxima
    for step, (on_path, bound, settled, want, same, traffic, nan) in enumerate(steps):
        if blocks and step == STEPS - 1:  # NaN in one block on the last rank: in its layer
            assert nan == (False, False, False, True, False), (rank, backend, nan)
        assert on_path == (step > 0), (rank, step, backend)  # settled from the second step
        if on_path:
            assert bound == backend, (bound, backend)
        assert same, (rank, step, backend)  # the gradients, bit for bit
        assert traffic == steps[1][5], (rank, step, backend, traffic)  # the same formats
        assert [s.numel for s in settled] == NUMELS
        assert settled == want, (rank, step, backend)
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


class _AtomicOps(TorchDispatchMode):
    """Records the ops that add or reduce into rows by index (atomics on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name.startswith(("scatter", "index_add", "index_reduce", "index_put")):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("seed", range(4))
def test_per_layer_folds_blocks_as_a_scatter_would(seed: int) -> None:
    """The smallest block exponent and the largest block maximum of every layer, empty
    layers 0, an infinite maximum kept: the fold the torch-op paths record block stats
    with (a running min/max, not a scatter's atomics), against the scatter it replaced."""
    from aps_comm.layout import Layout
    from aps_comm.telemetry import per_layer

    g = torch.Generator().manual_seed(seed)
    numels = torch.randint(0, 40, (7,), generator=g).tolist()
    numels[seed] = 0
    numels[-1] = 33
    blocks = Layout.from_numels(numels, torch.device("cpu")).grid(8)
    n = int(blocks.device_counts.sum())
    exps = torch.randint(-200, 200, (n,), dtype=torch.int32, generator=g)
    amax = torch.rand(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g))
    amax[seed] = float("inf")
    counts = torch.randint(0, 5, (n, 3), generator=g)
    with _AtomicOps() as atomic:
        summed, smallest, largest = per_layer(blocks, counts, exps, amax)
    assert atomic.seen == [], "a GPU serialises these atomics on a few rows (benchmarks.gpu)"
    layer = torch.repeat_interleave(torch.arange(len(numels)), blocks.device_counts)
    zeros = torch.zeros(len(numels), dtype=torch.int32)
    want_min = zeros.scatter_reduce(0, layer, exps, "amin", include_self=False)
    want_max = zeros.float().scatter_reduce(0, layer, amax, "amax", include_self=False)
    assert smallest.dtype == torch.int32 and torch.equal(smallest, want_min)
    assert torch.equal(largest, want_max) and math.isinf(largest.max())
    assert torch.equal(
        summed, torch.zeros(len(numels), 3, dtype=counts.dtype).index_add(0, layer, counts)
    )


def _native_feedback_rates(rank: int, world: int, backends: tuple[str, ...]) -> list:
    """This rank's Promote rates after one settled step of a native sum with error
    feedback on each backend, and :func:`aps_comm.simulate.records`' rates of the
    same values (every rank's, gathered)."""
    from aps_comm.formats import FP16
    from aps_comm.policy import Promote

    numels = [300, 700, 33]
    # gamma 0.9: no layer moves (a move would bind several formats, which this path refuses).
    policy = [Promote(gamma=0.9, ladder=("fp16", "bf16", "fp32"))]
    options = {"reduction": "allreduce", "error_feedback": True, "policy": policy}
    x = torch.randn(sum(numels), generator=torch.Generator().manual_seed(3 + rank))
    # Layer 1's maximum 1 on both ranks: two_phase's exponent 15, the native sum's 14 over
    # 2 ranks, under which half its values (1.5 * 2**-40) flush and under 15 do not.
    x[300:650], x[650:1000], x[300] = 1.5 * 2.0**-40, 0.5, 1.0
    layers = torch.split(gather(x), numels, dim=1)
    sim = simulate.hook_options({"fmt": "fp16", **options}, [FP16] * 3)
    want = [r.underflow_rate for r in simulate.records(layers, "fp16", rank, **sim)]
    out = []
    for backend in backends:
        with forced_codec(None if backend == "kernels" else backend, kernels=False):
            params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
            state = APSState("fp16", **options)
            state.bind_model(torch.nn.ParameterList(params))
            state.run_bucket(0, x.clone(), params)
            assert state.reducer is not None
            kind = type(state.reducer.steady.get(0)).__name__
            out.append((kind, [float(r) for r in state.reducer.rates.values()]))
    return [(kind, rates, want) for kind, rates in out]


def test_promote_rates_of_a_native_sum_with_error_feedback_are_its_own_rules() -> None:
    """Promote's rates of a settled native bucket with error feedback count underflow
    under the native sum's exponents (what it sends, and what the simulated records
    count) on every backend: the torch-op (and Triton) path counted them under
    two_phase's rule, one exponent higher over 2 ranks, and saw no underflow."""
    for per_backend in run_distributed(
        _native_feedback_rates, 2, args=(("kernels", "cast", "bits"),)
    ):
        for kind, rates, want in per_backend:
            assert kind == "SteadyFeedback"
            assert rates == [float(torch.tensor(w, dtype=torch.float32)) for w in want]
            assert rates[1] > 0.4
