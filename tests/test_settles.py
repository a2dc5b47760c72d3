"""Every configuration a user can ask settles: the matrix (issue 46, item 1).

For every combination of the options a user turns on (format family, scaling,
block exponents, ``stats``, ``error_feedback``, the policy, the route the hook
offers on a world of one), one bucket of a few tiny layers is run as
:func:`benchmarks.hostcost.count_ops` runs it (world size 1, Gloo, one
process): after its first steps it must be bound (``Reducer.steady_for``)
and a step must stay within the budget of ``tests/test_hostcost.py`` (15
kernel-launching ops). Combinations the API refuses are skipped on their
error; every other one binds within the budget.

The formats rotate through the families (8-bit, 16-bit, 4-bit) from one
combination to the next, so that every family meets every option while the
whole matrix runs in a few seconds; ``grid`` needs at least four ranks and
is left to tests/test_hierarchical.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import aps_comm
from aps_comm import simulate
from aps_comm.engine import Reducer, SteadyAgreedBlocks, SteadyFeedback, SteadyGroups
from aps_comm.policy import ByName, KeepLast, Promote, Rule, Schedule
from aps_comm.testing import run_distributed
from benchmarks.hostcost import ParamLayer, count_ops, forced_codec, world_of_one

CPU = torch.device("cpu")
BUDGET = 15  # tests/test_hostcost.py's

FAMILIES = ("e4m3", "fp16", "e2m1")
SCALINGS = (
    ("layer", "rank"),
    ("bucket", "rank"),
    ("none", "rank"),
    ("block", "rank"),
    ("block", "agreed"),
)
# Gloo sums only 16-bit formats natively: "allreduce" is asked in fp16.
ROUTES = ("two_phase", "allreduce", "hierarchical")
POLICIES: dict[str, Callable[[], list[Rule] | None]] = {
    "none": lambda: None,
    "promote": lambda: [Promote()],
    "schedule": lambda: [Schedule(steps=1)],
    "keep_last": lambda: [KeepLast("fp32")],
    # Every odd layer in fp16 (ParamLayer's names), the last in FP32: interleaved groups.
    "interleaved": lambda: [ByName({"*[13579].weight": "fp16"}), KeepLast("fp32")],
}
NUMELS = [20, 21, 22, 23, 24]  # five layers: the interleaved groups


def _native_interleaved() -> dict[str, Any]:
    """The native sum in formats that interleave: bf16, every odd layer in fp16 (both
    summed by Gloo), the last layer in FP32."""
    return {"fmt": "bf16", "policy": POLICIES["interleaved"]()}


def _several(options: dict) -> bool:
    """Whether a configuration sends its layers in several formats (a KeepLast policy):
    its settled bucket is a :class:`SteadyGroups`."""
    return any(isinstance(rule, KeepLast) for rule in options.get("policy") or ())


def _combinations() -> list[tuple[str, str, str, str, str, bool, bool]]:
    out = []
    product = itertools.product(SCALINGS, ROUTES, POLICIES, (False, True), (False, True))
    for i, ((scaling, exps), route, policy, stats, feedback) in enumerate(product):
        fmt = "fp16" if route == "allreduce" else FAMILIES[i % len(FAMILIES)]
        out.append((fmt, scaling, exps, route, policy, stats, feedback))
    return out


@pytest.fixture(scope="module")
def world() -> Any:
    with world_of_one(CPU):
        yield


def _ids(combo: tuple) -> str:
    fmt, scaling, exps, route, policy, stats, fb = combo
    return "-".join(
        [fmt, scaling + ("-agreed" if exps == "agreed" else ""), route, policy]
        + ["stats"] * stats
        + ["feedback"] * fb
    )


@pytest.mark.filterwarnings("ignore::UserWarning")  # aps_comm.caveats' advice, not an error
@pytest.mark.parametrize("combo", _combinations(), ids=_ids)
def test_every_configuration_settles_within_the_budget(
    world: None, combo: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    fmt, scaling, exps, route, policy, stats, fb = combo
    options: dict[str, Any] = {
        "fmt": fmt,
        "reduction": route,
        "scaling": scaling,
        "block_exponents": exps,
        "stats": stats,
        "error_feedback": fb,
        "policy": POLICIES[policy](),
    }
    if route == "hierarchical":
        options["ranks_per_node"] = 1
    gen = torch.Generator().manual_seed(len(_ids(combo)))
    # Magnitudes in [0.5, 1.5): nothing underflows, so Promote moves no layer.
    x = (torch.rand(sum(NUMELS), generator=gen) + 0.5) * torch.randn(
        sum(NUMELS), generator=gen
    ).sign()
    params = [torch.nn.Parameter(torch.empty(n)) for n in NUMELS]
    ran: list[int] = []  # the steps that ran a bound path (bound, then run, from the first)
    run_steady = Reducer.run_steady
    monkeypatch.setattr(
        Reducer, "run_steady", lambda *a, **k: ran.append(len(ran)) or run_steady(*a, **k)
    )
    try:
        state = aps_comm.APSState(**options)
        # Policies and error feedback key layers by parameter name: one module each.
        state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
        buffer = x.clone()
        state.run_bucket(0, buffer, params)
    except ValueError as exc:
        refused = ("needs a backend that sums", "is not supported with", "needs one exponent")
        assert any(r in str(exc) for r in refused), exc
        pytest.skip(f"refused: {exc}")
    for _ in range(2):  # the settled path bound (Schedule's next epoch too), then run
        buffer.copy_(x)
        state.run_bucket(0, buffer, params)
    assert state.reducer is not None
    bound = state.reducer.steady_for(0, buffer)
    assert bound is not None, "not bound"
    assert ran == [0, 1, 2], f"the general path ran {3 - len(ran)} of the first 3 steps"
    buffer.copy_(x)
    aten, kernels = count_ops(state, buffer, params)
    assert not any("_local_scalar_dense" in op for op in aten), aten  # no host read
    assert len(aten) + len(kernels) <= BUDGET, (aten, kernels)
    if stats:
        assert len(state.stats) == len(NUMELS) - (policy in ("keep_last", "interleaved"))


def _bits_differ(out: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether two float32 tensors differ bit for bit, NaN where NaN (any payload) equal."""
    bits = torch.where(out.isnan(), 0.0, out).view(torch.int32)
    return not torch.equal(out.isnan(), want.isnan()) or not torch.equal(
        bits, torch.where(want.isnan(), 0.0, want).view(torch.int32)
    )


def _against_the_simulated(
    rank: int, world_size: int, configs: list[tuple[dict, int | None]]
) -> list[str]:
    """Each configuration over several steps, settled, against :mod:`aps_comm.simulate` of
    every rank's gradients (gathered): the gradients bit for bit and the records, a NaN in
    one layer on the last rank in one step included; the bytes per collective the same at
    every step and the chunk the same on every rank (the size asked where one is). Each
    config: the options and the elements per chunk (None: each rank's timing)."""
    numels = [5, 0, 1, 700, 33, 2, 64]  # odd sizes: 4-bit codes split bytes between blocks
    params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
    names = [f"{i}.weight" for i in range(len(numels))]
    problems = []
    for c, (options, chunk) in enumerate(configs):
        options = dict(options)
        with forced_codec(options.pop("codec_backend", None)):
            settled = aps_comm.APSState(**options)
            settled.chunk_elements = chunk
            # Rules key layers by parameter name: one module each.
            settled.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
            kind = SteadyGroups if _several(options) else SteadyAgreedBlocks
            buffer = torch.empty(sum(numels))
            wire = None
            for step in range(5):
                gen = torch.Generator().manual_seed(100 * step + 10 * c + rank)
                x = torch.randn(sum(numels), generator=gen) * 2.0 ** (step - 2)
                x[::97] *= 1000.0  # blocks of very different maxima
                if step == 3 and rank == world_size - 1:
                    x[7] = float("nan")  # layer 3 on one rank: NaN in it on every rank, this step
                everyone = [torch.empty_like(x) for _ in range(world_size)]
                dist.all_gather(everyone, x)
                layers = torch.stack(everyone).split(numels, dim=1)
                fmts = settled.assignment.formats([id(p) for p in params], step)
                sim = simulate.hook_options(options, fmts)
                want = torch.cat(simulate.allreduce(layers, options["fmt"], **sim))
                records = simulate.records(layers, options["fmt"], rank, names=names, **sim)
                buffer.copy_(x)
                ahead = settled.reducer.steady_for(0, buffer) if settled.reducer else None
                if step >= 2 and not isinstance(ahead, kind):
                    problems.append(f"config {c} step {step}: not settled")
                out = settled.run_bucket(0, buffer, params)
                if _bits_differ(out, want):
                    problems.append(f"config {c} step {step}: gradients differ")
                # The same bytes every step while the formats stay (a Schedule's epoch changes them).
                if wire is not None and wire[0] == fmts and settled.bytes_detail != wire[1]:
                    problems.append(f"config {c} step {step}: {settled.bytes_detail} on the wire")
                wire = (fmts, settled.bytes_detail)
                chunks: list[Any] = [None] * world_size
                dist.all_gather_object(chunks, settled.bucket_chunks)
                if any(ch != chunks[0] for ch in chunks) or chunk not in (None, chunks[0][0]):
                    problems.append(f"config {c} step {step}: chunks {chunks}")
                if not settled.stats or repr(settled.stats) != repr(records):  # NaN-aware
                    problems.append(f"config {c} step {step}: records differ")
    return problems


_AGREED_STATS = {
    "fmt": "e2m1",
    "reduction": "two_phase",
    "scaling": "block",
    "block_exponents": "agreed",
    "stats": True,
}


_EMPTY_GROUP = [ByName({"*1.weight": "fp16"}), KeepLast("fp32")]
"""Layer 1, the empty one, alone in fp16: a format group of no element."""


@pytest.mark.parametrize("world_size", [2])
def test_a_format_group_of_empty_layers_binds_with_the_simulated_bits(world_size: int) -> None:
    """A policy that puts only empty layers in a format (a zero-size parameter last under
    ``KeepLast("fp32")``, or named by a rule) binds like any bucket of several formats:
    it raised "no bound path" once the general path was deleted. Gradients, records and
    bytes are :mod:`aps_comm.simulate`'s, layer and block scaling, own and agreed block
    exponents, staged; error feedback below."""
    stats = {"reduction": "two_phase", "stats": True, "policy": _EMPTY_GROUP}
    configs = [
        ({**stats, "fmt": "e4m3"}, None),
        ({**stats, "fmt": "e4m3", "policy": [ByName({"*1.weight": "fp32"}), KeepLast("fp32")]}, 64),
        ({**stats, "fmt": "e2m1", "scaling": "block", "block_size": 8}, None),
        ({**_AGREED_STATS, "policy": _EMPTY_GROUP}, None),
        ({**stats, "fmt": "e4m3", "reduction": "hierarchical", "ranks_per_node": 1}, None),
    ]
    for problems in run_distributed(_against_the_simulated, world_size, args=(configs,)):
        assert problems == []
    feedback = [
        {"fmt": "e4m3", "reduction": "two_phase", "error_feedback": True, "policy": _EMPTY_GROUP},
        {
            **_AGREED_STATS,
            "error_feedback": True,
            "block_exponents": "rank",
            "policy": _EMPTY_GROUP,
        },
    ]
    for problems in run_distributed(_feedback_against_the_simulated, world_size, args=(feedback,)):
        assert problems == []


@pytest.mark.parametrize("world_size", [1, 2])
def test_agreed_blocks_with_stats_settle_with_the_simulated_records(world_size: int) -> None:
    """Issue 46: agreed block exponents with ``stats=True`` settle (the general path every
    step before), with :mod:`aps_comm.simulate`'s gradients (the owner's exponents on top
    of the agreed ones) and records: each block's counts under its agreed key, its
    layer's largest block maximum this rank's; on the torch codec
    backends ("cast", "bits") too."""
    configs = [
        (_AGREED_STATS, None),  # chunks sized by the ranks' timing, agreed on the keys
        ({**_AGREED_STATS, "block_size": 8}, 40),
        ({**_AGREED_STATS, "fmt": "e4m3", "block_size": 16}, 64),
        ({**_AGREED_STATS, "fmt": "fp16"}, None),
        ({**_AGREED_STATS, "fmt": "bf16", "block_size": 8}, 256),
        # The torch codec backends (a GPU without Triton): the general path's calls, bound.
        ({**_AGREED_STATS, "codec_backend": "bits"}, None),
        ({**_AGREED_STATS, "fmt": "e4m3", "block_size": 8, "codec_backend": "cast"}, 40),
        ({**_AGREED_STATS, "codec_backend": "bits", "policy": [KeepLast("fp32")]}, None),
    ]
    for problems in run_distributed(_against_the_simulated, world_size, args=(configs,)):
        assert problems == []


@pytest.mark.parametrize("fmt", ["e2m1", "fp16"])
def test_agreed_blocks_with_stats_cost_one_call_more_whatever_the_layers(
    world: None, fmt: str
) -> None:
    """Issue 46: the records of agreed block exponents are one kernel call, beside the
    four of the plain bucket (85 ops per bucket of five layers before: the general path)."""
    counts = {}
    for layers in (2, 200):
        numels = [300 + i for i in range(layers)]
        x = torch.randn(sum(numels), generator=torch.Generator().manual_seed(layers))
        params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
        state = aps_comm.APSState(**{**_AGREED_STATS, "fmt": fmt})
        for _ in range(2):  # the plan, then the settled path bound
            state.run_bucket(0, x.clone(), params)
        buffer = x.clone()
        state.run_bucket(0, buffer, params)  # a new buffer: bound once more
        assert state.reducer is not None
        assert isinstance(state.reducer.steady_for(0, buffer), SteadyAgreedBlocks)
        aten, kernels = count_ops(state, buffer, params)
        assert len(state.stats) == layers  # the step's records, one per layer
        counts[layers] = (aten, kernels)
    assert counts[2] == counts[200], counts
    aten, kernels = counts[200]
    assert len(aten) + len(kernels) <= BUDGET, counts[200]
    assert kernels.count("kernel::block_records") == 1


@pytest.mark.parametrize("scaling", ["layer", "bucket", "none"])
def test_promote_with_stats_settles_with_the_simulated_records(world: None, scaling: str) -> None:
    """Issue 46: ``stats=True`` with Promote settles (the general path every step before):
    the settled bucket records, reads the agreed rates, sends a step in the new format on
    the maxima it agreed and binds again, with :mod:`aps_comm.simulate`'s bits and records
    in the formats Promote chose (a world of one)."""
    numels = [300, 700, 33]
    options = {
        "fmt": "e4m3",
        "reduction": "two_phase",
        "scaling": scaling,
        "stats": True,
        "policy": [Promote(gamma=0.05, patience=2)],
    }
    params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
    settled = aps_comm.APSState(**options)
    settled.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
    names = [f"{i}.weight" for i in range(len(numels))]
    gen = torch.Generator().manual_seed(17)
    buffer = torch.empty(sum(numels))
    bound, formats = [], []
    for step in range(9):
        x = torch.randn(sum(numels), generator=gen)
        if step in (3, 4):  # e4m3 flushes all but each layer's largest value: promoted
            x *= 1e-7
            x[[0, 300, 1000]] = 1.0
        if step == 7:
            x[5] = float("nan")  # the first layer non-finite: NaN in it, in its records too
        buffer.copy_(x)
        out = settled.run_bucket(0, buffer, params)
        fmts = settled.assignment.formats([id(p) for p in params], step)  # Promote's
        sim = simulate.hook_options(options, fmts)
        layers = x[None].split(numels, dim=1)
        want = torch.cat(simulate.allreduce(layers, "e4m3", **sim))
        assert not _bits_differ(out, want), step
        records = simulate.records(layers, "e4m3", 0, names=names, **sim)
        assert len(settled.stats) == len(numels) and repr(settled.stats) == repr(records)
        assert settled.reducer is not None
        bound.append(settled.reducer.steady.get(0))
        formats.append(fmts[0].name)
    # Step 3's rates promote at step 4 (bound again); with scaling, calm from then: back
    # at step 6 (the naive cast underflows more: it stays up longer).
    assert formats[:4] == ["e4m3"] * 4 and formats[4] == "e5m2"
    assert scaling == "none" or formats == ["e4m3"] * 4 + ["e5m2"] * 2 + ["e4m3"] * 3, formats
    for i in range(1, 9):  # bound again exactly where the format moved, not every step
        assert (bound[i] is bound[i - 1]) == (formats[i] == formats[i - 1]), (i, formats)
    assert settled.reducer.steady_for(0, buffer) is bound[8]


def _feedback_against_the_simulated(rank: int, world_size: int, configs: list[dict]) -> list[str]:
    """Error feedback over several steps, settled, against
    :func:`aps_comm.simulate.allreduce_feedback` of every rank's gradients (gathered) and
    residuals (simulated from the first step, in the formats the policy chose): gradients,
    residuals (the checkpoint's) and records bit for bit, a NaN on the last rank in one
    step and residuals restored from a checkpoint (step 5) included; the same bytes at
    every step."""
    numels = [5, 0, 1, 700, 33, 2, 64]
    params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
    names = [f"{i}.weight" for i in range(len(numels))]
    problems = []
    for c, options in enumerate(configs):
        options = dict(options)
        # Half of layer 3 below the format's range: Promote moves it up a format (a
        # bucket of one format becomes one of two, bound again).
        underflow, moved = options.pop("_underflow", False), False
        with forced_codec(options.pop("codec_backend", None)):
            settled = aps_comm.APSState(**options)
            settled.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
            kind: Any = SteadyGroups if _several(options) else SteadyFeedback
            if underflow:
                kind = (SteadyFeedback, SteadyGroups)
            buffer = torch.empty(sum(numels))
            kept: list[torch.Tensor | None] | None = None  # every rank's residuals
            wire = None
            for step in range(7):
                gen = torch.Generator().manual_seed(100 * step + 10 * c + rank)
                x = torch.randn(sum(numels), generator=gen) * 2.0 ** (step - 2)
                x[::97] *= 1000.0  # layers of very different maxima
                if underflow:
                    x[7:706:2] *= 2.0**-60
                if step == 3 and rank == world_size - 1:
                    x[7] = float("nan")  # layer 3 on one rank: NaN in it on every rank, this step
                if step == 5:  # residuals restored from a checkpoint: bound again on them
                    saved = settled.state_dict()
                    saved["residuals"] = {k: v * 0.5 for k, v in saved["residuals"].items()}
                    settled.load_state_dict(saved)
                    assert kept is not None
                    kept = [None if r is None else r * 0.5 for r in kept]
                everyone = [torch.empty_like(x) for _ in range(world_size)]
                dist.all_gather(everyone, x)
                layers = torch.stack(everyone).split(numels, dim=1)
                buffer.copy_(x)
                ahead = settled.reducer.steady_for(0, buffer) if settled.reducer else None
                if step in (2, 3, 4, 6) and not isinstance(ahead, kind):
                    problems.append(f"config {c} step {step}: not settled")
                out = settled.run_bucket(0, buffer, params)
                fmts = settled.assignment.formats([id(p) for p in params], step)  # the policy's
                moved = moved or len(set(fmts)) > 1
                sim = simulate.hook_options(options, fmts)
                # What each rank sends: its gradient with its residual added (records).
                sent = list(layers)
                for i, r in enumerate(kept or ()):
                    if r is not None:
                        sent[i] = layers[i] + r
                want, kept = simulate.allreduce_feedback(layers, options["fmt"], kept, **sim)
                if _bits_differ(out, torch.cat(want)):
                    problems.append(f"config {c} step {step}: gradients differ")
                # Scaled, the whole layer is NaN (its maximum is); in FP32 the element alone.
                nan = out[6:706].isnan().all() if fmts[3].name != "fp32" else out[7].isnan()
                if nan != (step == 3) or out[706:].isnan().any():
                    problems.append(f"config {c} step {step}: NaN where it should not be, or not")
                mine = settled.state_dict()["residuals"]
                ref = {names[i]: r[rank] for i, r in enumerate(kept) if r is not None}
                if mine.keys() != ref.keys() or not all(
                    torch.equal(mine[k].view(torch.int32), ref[k].view(torch.int32)) for k in ref
                ):
                    problems.append(f"config {c} step {step}: residuals differ")
                # The same bytes every step while the formats stay (a Schedule's epoch changes them).
                if wire is not None and wire[0] == fmts and settled.bytes_detail != wire[1]:
                    problems.append(f"config {c} step {step}: {settled.bytes_detail} on the wire")
                wire = (fmts, settled.bytes_detail)
                records = []
                if options.get("stats"):
                    records = simulate.records(sent, options["fmt"], rank, names=names, **sim)
                if repr(settled.stats) != repr(records):  # NaN-aware through repr
                    problems.append(f"config {c} step {step}: records differ")
        if underflow and not moved:
            problems.append(f"config {c}: Promote moved no layer")
    return problems


_FEEDBACK = {"fmt": "e4m3", "reduction": "two_phase", "error_feedback": True}


@pytest.mark.parametrize("world_size", [1, 2])
def test_error_feedback_with_bucket_or_no_scaling_settles_with_the_simulated_bits(
    world_size: int,
) -> None:
    """Issue 46: error feedback with ``scaling="bucket"`` or ``"none"`` settles (the general
    path every step before, 121 ops per bucket of five layers): the factors of the spread
    maxima (the records keeping the agreed ones) or the naive cast's, with
    :func:`aps_comm.simulate.allreduce_feedback`'s gradients and residuals, and the
    records; on the torch codec
    backends ("cast", "bits") too."""
    configs = [
        {**_FEEDBACK, "scaling": "bucket"},
        {**_FEEDBACK, "scaling": "none"},
        {**_FEEDBACK, "scaling": "bucket", "stats": True, "fmt": "e2m1"},
        {**_FEEDBACK, "scaling": "none", "stats": True, "fmt": "fp16"},
        {**_FEEDBACK, "scaling": "bucket", "stats": True, "policy": [Promote(gamma=0.05)]},
        {**_FEEDBACK, "scaling": "none", "policy": [Promote(gamma=0.05)]},
        # The torch codec backends (a GPU without Triton): layer and block scaling too.
        {**_FEEDBACK, "codec_backend": "cast", "stats": True},
        {**_FEEDBACK, "codec_backend": "bits", "scaling": "block", "fmt": "e2m1", "stats": True},
        {**_FEEDBACK, "codec_backend": "cast", "scaling": "block", "fmt": "fp16"},
        # Several formats (each group's residuals its own) on the torch backends.
        {**_FEEDBACK, "codec_backend": "cast", "stats": True, "policy": POLICIES["interleaved"]()},
        {**_FEEDBACK, "codec_backend": "bits", "scaling": "block", "policy": [KeepLast("fp32")]},
        # A first epoch all in FP32 (bound: the FP32 mean), then e2m1 blocks.
        {**_FEEDBACK, "scaling": "block", "fmt": "e2m1", "policy": [Schedule(steps=1)]},
    ]
    args = (configs,)
    for problems in run_distributed(_feedback_against_the_simulated, world_size, args=args):
        assert problems == []


_NATIVE_BLOCKS = {"fmt": "fp16", "reduction": "allreduce", "scaling": "block", "stats": True}


def test_native_blocks_settle_with_the_simulated_bits() -> None:
    """Issue 46: the native all-reduce with block scaling settles (the general path every
    step before): this rank's keys under the native sum's rule, their MAX all-reduce, the
    factors, then per chunk the encode, the sum in the wire format and the decode, with
    :mod:`aps_comm.simulate`'s gradients and records on two ranks; in several
    formats too (each group's keys in the one MAX all-reduce, the FP32 group's mean),
    the groups consecutive or interleaved; on the torch codec backends too."""
    configs = [
        (_NATIVE_BLOCKS, None),  # "rank" asked: agreed keys still, the model's chunk
        ({**_NATIVE_BLOCKS, "block_exponents": "agreed"}, None),  # the chunk on the keys
        ({**_NATIVE_BLOCKS, "block_size": 8}, 40),  # several chunks
        ({**_NATIVE_BLOCKS, "fmt": "bf16", "block_size": 16}, 256),
        # Several formats: KeepLast's consecutive groups, and bf16 and fp16 interleaved.
        ({**_NATIVE_BLOCKS, "policy": [KeepLast("fp32")]}, None),
        ({**_NATIVE_BLOCKS, **_native_interleaved(), "block_exponents": "agreed"}, None),
        ({**_NATIVE_BLOCKS, **_native_interleaved(), "block_size": 8}, 40),
        # The torch codec backends: the general path's keys, factors, encode and decode.
        ({**_NATIVE_BLOCKS, "codec_backend": "cast"}, None),
        ({**_NATIVE_BLOCKS, "fmt": "bf16", "block_size": 8, "codec_backend": "bits"}, 40),
        ({**_NATIVE_BLOCKS, **_native_interleaved(), "codec_backend": "cast"}, None),
    ]
    for problems in run_distributed(_against_the_simulated, 2, args=(configs,)):
        assert problems == []


# Each policy's options, how many formats are sent scaled, and the fewest layers that
# show its groups (interleaved: bf16, fp16, bf16, then FP32).
_POLICY_FORMATS = {
    "none": ({}, 1, 2),
    "keep_last": ({"policy": None}, 1, 2),
    "interleaved": ({"fmt": "bf16", "policy": None}, 2, 4),
}


def _native_ops(options: dict[str, Any], policy: str, kind: type) -> dict[int, tuple]:
    """A settled native bucket's ops (:func:`count_ops`) for a few layers and for 200,
    under ``policy`` (a key of :data:`_POLICY_FORMATS`), its layers one module each."""
    extra, _, few = _POLICY_FORMATS[policy]
    if "policy" in extra:
        extra = {**extra, "policy": POLICIES[policy]()}  # rules of its own, made here
    counts = {}
    for layers in (few, 200):
        numels = [300 + i for i in range(layers)]
        x = torch.randn(sum(numels), generator=torch.Generator().manual_seed(layers))
        params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
        state = aps_comm.APSState(**{**options, **extra})
        state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
        for _ in range(2):  # the plan, then the settled path bound
            state.run_bucket(0, x.clone(), params)
        buffer = x.clone()
        state.run_bucket(0, buffer, params)  # a new buffer: bound once more
        assert state.reducer is not None
        want = SteadyGroups if policy != "none" else kind
        assert isinstance(state.reducer.steady_for(0, buffer), want)
        aten, kernels = count_ops(state, buffer, params)
        assert not any("_local_scalar_dense" in op for op in aten), aten  # no host read
        if options.get("stats"):  # every layer's record but the FP32 one's
            assert len(state.stats) == layers - (policy != "none")
        counts[layers] = (aten, kernels)
    assert counts[few] == counts[200], counts
    aten, kernels = counts[200]
    assert len(aten) + len(kernels) <= BUDGET, counts[200]
    return counts


@pytest.mark.parametrize("policy", list(_POLICY_FORMATS))
@pytest.mark.parametrize("exps", ["rank", "agreed"])
def test_native_blocks_cost_the_same_ops_whatever_the_layers(
    world: None, exps: str, policy: str
) -> None:
    """Issue 46: a settled native block bucket is four kernel calls (keys, factors, encode,
    decode) and the records' one, beside its two collectives, for 2 layers or 200; in
    several formats those of each group sent scaled, and the FP32 group's mean (formats
    that interleave: 4 layers or 200, with the gather and the scatter)."""
    options = {**_NATIVE_BLOCKS, "block_exponents": exps}
    kernels = _native_ops(options, policy, SteadyAgreedBlocks)[200][1]
    assert kernels.count("kernel::native_block_keys") == _POLICY_FORMATS[policy][1]


_NATIVE_FEEDBACK = {"fmt": "fp16", "reduction": "allreduce", "error_feedback": True}
_UP_TO_FP32 = Promote(gamma=0.05, ladder=("fp16", "fp32"))


def test_error_feedback_on_the_native_all_reduce_settles_with_the_simulated_bits() -> None:
    """Issue 46: error feedback on the native all-reduce settles (the general path every
    step before): the residuals added, the maxima agreed, the native sum's factors in one
    call, the encode with its residual update (kept under ``2**-e``, the decode's
    ``2**-e / N`` aside), the sum in the wire format, with
    :func:`aps_comm.simulate.allreduce_feedback`'s gradients, residuals and records on two
    ranks; with Promote up a ladder Gloo sums (fp16, then FP32), a layer moved to FP32
    binding the bucket again as two groups (a RuntimeError before);
    with block scaling (the native sum's agreed keys, their factors in one call), and in
    several formats, consecutive or interleaved, every group's residuals added in one
    call and its factors picking its maxima; on the torch codec backends too."""
    configs = [
        _NATIVE_FEEDBACK,
        {**_NATIVE_FEEDBACK, "scaling": "bucket", "stats": True},
        {**_NATIVE_FEEDBACK, "scaling": "none"},
        {**_NATIVE_FEEDBACK, "fmt": "bf16", "stats": True},
        {**_NATIVE_FEEDBACK, "stats": True},
        {**_NATIVE_FEEDBACK, "stats": True, "policy": [_UP_TO_FP32], "_underflow": True},
        # Block scaling (the native sum's agreed keys), one format and several.
        {**_NATIVE_FEEDBACK, "scaling": "block", "stats": True},
        {**_NATIVE_FEEDBACK, "scaling": "block", "fmt": "bf16", "block_size": 16},
        {**_NATIVE_FEEDBACK, "scaling": "block", "policy": [KeepLast("fp32")]},
        {**_NATIVE_FEEDBACK, **_native_interleaved(), "scaling": "block", "stats": True},
        # Several formats per layer, per bucket, unscaled.
        {**_NATIVE_FEEDBACK, "stats": True, "policy": [KeepLast("fp32")]},
        {**_NATIVE_FEEDBACK, **_native_interleaved(), "scaling": "bucket", "stats": True},
        {**_NATIVE_FEEDBACK, **_native_interleaved(), "scaling": "none"},
        # The torch codec backends: the general path's factors, encode and residual update.
        {**_NATIVE_FEEDBACK, "codec_backend": "cast", "stats": True},
        {**_NATIVE_FEEDBACK, "codec_backend": "cast", "policy": [_UP_TO_FP32], "_underflow": True},
        {**_NATIVE_FEEDBACK, "codec_backend": "bits", "scaling": "block", "fmt": "bf16"},
        {**_NATIVE_FEEDBACK, **_native_interleaved(), "codec_backend": "cast", "scaling": "block"},
    ]
    for problems in run_distributed(_feedback_against_the_simulated, 2, args=(configs,)):
        assert problems == []


@pytest.mark.parametrize("policy", list(_POLICY_FORMATS))
@pytest.mark.parametrize("scaling", ["layer", "bucket", "none", "block"])
def test_error_feedback_on_the_native_all_reduce_costs_the_same_ops_whatever_the_layers(
    world: None, scaling: str, policy: str
) -> None:
    """Issue 46: a settled native bucket with error feedback is the residuals' add, the
    maxima (or block keys), the factors' call, the encode with its residual update and the
    decode, beside its two collectives, for 2 layers or 200; in several formats one add of
    every group's residuals, those of each group sent scaled and the FP32 group's mean
    (formats that interleave: 4 layers or 200, with the scatter)."""
    options = {**_NATIVE_FEEDBACK, "scaling": scaling}
    kernels = _native_ops(options, policy, SteadyFeedback)[200][1]
    factors = "native_block_factors" if scaling == "block" else "native_factors_into"
    assert kernels.count(f"kernel::{factors}") == _POLICY_FORMATS[policy][1]


def test_groups_with_error_feedback_and_blocks_record_their_own_block_maxima(
    world: None,
) -> None:
    """Error feedback with block scaling in two sent formats of the same size (e2m1 and
    e4m3 layers interleaved) and ``stats=True``: every group's block maxima are written
    before the MAX all-reduce and read by its records after it, so the groups' scratch
    must not overlap (each group's was cut from the start of the STEP slot: the e2m1
    layers' records showed the e4m3 layers' maxima). The bits, residuals and records of
    :func:`aps_comm.simulate.allreduce_feedback` (a world of one)."""
    numels = [64] * 4
    options = {
        "fmt": "e2m1",
        "reduction": "two_phase",
        "scaling": "block",
        "error_feedback": True,
        "stats": True,
        "policy": [ByName({"*[13579].weight": "e4m3"})],
    }
    params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
    settled = aps_comm.APSState(**options)
    settled.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
    names = [f"{i}.weight" for i in range(len(numels))]
    # Layers of very different magnitudes: each group's block maxima are its own.
    scales = torch.tensor([1.0, 100.0, 0.01, 10.0]).repeat_interleave(64)
    buffer = torch.empty(sum(numels))
    kept: list[torch.Tensor | None] | None = None
    for step in range(3):
        x = torch.randn(sum(numels), generator=torch.Generator().manual_seed(step)) * scales
        buffer.copy_(x)
        out = settled.run_bucket(0, buffer, params)
        layers = x[None].split(numels, dim=1)
        sent = layers if kept is None else [t + r for t, r in zip(layers, kept, strict=True)]
        sim = simulate.hook_options(
            options, settled.assignment.formats([id(p) for p in params], step)
        )
        want, kept = simulate.allreduce_feedback(layers, "e2m1", kept, **sim)
        assert isinstance(settled.reducer.steady_for(0, buffer), SteadyGroups), step
        assert torch.equal(out.view(torch.int32), torch.cat(want).view(torch.int32)), step
        residuals = settled.state_dict()["residuals"]
        assert all(
            torch.equal(residuals[k].view(torch.int32), r[0].view(torch.int32))
            for k, r in zip(names, kept, strict=True)
        )
        records = simulate.records(sent, "e2m1", 0, names=names, **sim)
        assert repr(settled.stats) == repr(records), step
