"""Block scaling in the DDP hook: exact against aps_comm.simulate, bytes, records, errors.

Every bucket the hook reduces is compared bit for bit with
:func:`aps_comm.simulate.allreduce` (``scaling="block"``) of every rank's raw
bucket: native FP16/BF16 sums and two_phase on 2 ranks, with a NaN poisoning
one layer on one rank. Hierarchical and grid run in tests/test_hierarchical.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aps_comm import APSState, register, simulate
from aps_comm.engine import Reducer, SteadyBlocks
from aps_comm.formats import get_format
from aps_comm.fsdp import APSFSDPState
from aps_comm.plan import Planner
from aps_comm.policy import Promote
from aps_comm.simulate import SimConfig
from aps_comm.testing import run_distributed
from tests.conftest import Net, capture, gather

# (format, reduction, block size, block exponents)
CASES = [
    ("e4m3", "two_phase", 32, "agreed"),
    ("e2m1", "two_phase", 8, "agreed"),
    ("e3m2", "two_phase", 64, "agreed"),
    ("fp16", "allreduce", 32, "agreed"),
    ("bf16", "allreduce", 16, "agreed"),
    # Each rank's own exponents, sent with its shards: no collective first.
    ("e2m1", "two_phase", 32, "rank"),
    ("e4m3", "two_phase", 8, "rank"),
    ("bf16", "two_phase", 16, "rank"),
]


def _exact_case(rank: int, world_size: int, chunk: int | None) -> int:
    checked = 0
    # Buckets that took the settled path (kernels bound once: SteadyBlocks). The general
    # path runs calls bound for the step through the same pipeline: the settled state tells.
    bound: list[int] = []
    unbound = Reducer.run_steady

    def counted(self: Reducer, index: int, st: object, *args: object, **kw: object) -> object:
        if isinstance(st, SteadyBlocks):
            bound.append(1)
        return unbound(self, index, st, *args, **kw)  # type: ignore[arg-type]

    Reducer.run_steady = counted  # type: ignore[method-assign]
    for fmt_spec, reduction, block_size, exps in CASES:
        if reduction == "allreduce" and world_size > 2:
            continue  # Gloo's ring order past 2 ranks is not the simulator's ring
        fmt = get_format(fmt_spec)
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.004)
        state = APSState(
            fmt, reduction=reduction, scaling="block", block_size=block_size, block_exponents=exps
        )
        state.bind_process_group()
        state.chunk_elements = chunk
        log: list = []
        ddp.register_comm_hook(state, capture(state, log))
        # Rank exponents: a third step takes the settled path (bound kernels) of
        # the buckets DDP rebuilt after step 0; the NaN comes in the last step.
        steps = 3 if exps == "rank" else 2
        for step in range(steps):
            torch.manual_seed(1000 * step + rank)
            poison = step == steps - 1
            if poison and rank == 1:  # a NaN gradient in one layer of one rank
                handle = model.c.bias.register_hook(lambda g: torch.full_like(g, float("nan")))
            ddp.zero_grad()
            # Ranks and layers far apart in magnitude: one exponent per layer would flush.
            ddp(torch.randn(8, 16) * 10.0 ** (3 * rank)).pow(2).sum().backward()
            if poison and rank == 1:
                handle.remove()
            for _, raw, numels, out in sorted(log, key=lambda item: item[0]):
                raws = gather(raw)
                layers = list(torch.split(raws, numels, dim=1))
                expected = torch.cat(
                    simulate.allreduce(
                        layers,
                        fmt,
                        # Gloo's native sum is a ring (2 ranks: one rounding, any order).
                        reduction="ring" if reduction == "allreduce" else reduction,
                        scaling="block",
                        block_size=block_size,
                        # two_phase: each shard's owner picks its mean's exponents.
                        owner_exponents=reduction == "two_phase" and exps == "agreed",
                        rank_exponents=exps == "rank",
                    )
                )
                same = torch.equal(out.nan_to_num(nan=7.0), expected.nan_to_num(nan=7.0))
                assert same, (
                    f"{fmt_spec}/{reduction}/{block_size}: bucket mismatch, max diff "
                    f"{(out - expected).abs().nan_to_num().max()}"
                )
                checked += 1
            if poison:  # NaN in that layer on every rank, nothing else touched
                assert torch.isnan(model.c.bias.grad).all()
                assert torch.isfinite(model.a.weight.grad).all()
            if exps == "rank":  # nothing agreed before the first chunk
                assert "all_reduce_max" not in state.bytes_detail, state.bytes_detail
            log.clear()
        if exps == "rank" and fmt.wire_bits in (4, 8):  # the last step ran the bound kernels
            assert bound, (fmt_spec, block_size)
        bound.clear()
    Reducer.run_steady = unbound  # type: ignore[method-assign]
    return checked


@pytest.mark.parametrize(("world", "chunk"), [(2, None), (2, 37), (3, 37)])
def test_block_scaling_matches_simulate_bit_for_bit(world: int, chunk: int | None) -> None:
    # Buckets of ~1000 elements; chunks of 37 cut layers anywhere (and two_phase's
    # shards of whole blocks come out uneven, some empty).
    checked = run_distributed(_exact_case, world, args=(chunk,), timeout=240)
    cases = [c for c in CASES if world == 2 or c[1] != "allreduce"]
    steps = sum(3 if exps == "rank" else 2 for *_, exps in cases)
    assert all(c >= steps for c in checked)


def _bytes_and_records(rank: int, world_size: int) -> dict:
    out: dict = {}
    for fmt, scaling, exps in [
        ("e4m3", "block", "agreed"),
        ("e2m1", "block", "agreed"),
        ("e2m1", "layer", "agreed"),
        ("e2m1", "block", "rank"),
    ]:
        torch.manual_seed(0)
        model = nn.Linear(64, 64, bias=False)  # one bucket of 4096 elements, 128 blocks
        ddp = DDP(model, bucket_cap_mb=100)
        state = register(
            ddp, fmt, reduction="two_phase", scaling=scaling, stats=True, block_exponents=exps
        )
        state.chunk_elements = 1 << 20  # one chunk, not sized by timing
        # Each row of the gradient: 32 values near 1, then 32 near 1e-6 (one
        # block each): a layer spanning six orders of magnitude, its blocks one.
        j = torch.arange(64)
        x = (10.0 ** (-6 * (j // 32)) * (1 + (j % 32) / 32)).expand(4, 64) * (rank + 1)
        ddp(x).sum().backward()
        [record] = state.stats
        out[f"{fmt}/{scaling}" + ("/rank" if exps == "rank" else "")] = {
            "bytes": dict(state.bytes_detail),
            "sent": state.bytes_sent,
            "underflow": record.underflow_rate,
            "exponent": record.exponent,
            "amax": record.amax,
            "grad_amax": model.weight.grad.abs().max().item(),
            "describe": state.describe(),
        }
    return out


def test_block_bytes_per_element_and_per_layer_records() -> None:
    for rank, r in enumerate(run_distributed(_bytes_and_records, 2)):
        e4m3, e2m1, layer = r["e4m3/block"], r["e2m1/block"], r["e2m1/layer"]
        # FP8's default: one exponent byte per 128 elements, agreed by one MAX
        # all-reduce of bytes; e2m1's: one per 32.
        assert e4m3["bytes"]["all_reduce_max"] == 32, e4m3
        assert e4m3["sent"] / 4096 == 1 + 1 / 128, e4m3  # FP8: 1.008 bytes per element
        assert e2m1["sent"] / 4096 == 0.5 + 1 / 32, e2m1  # e2m1: 0.53
        # The owner's half of the mean and its 16 blocks' own exponents, one byte each.
        assert e4m3["bytes"]["all_gather"] == 4096 // 2 + 16, e4m3
        assert "scaling=block(128, agreed exponents)" in e4m3["describe"], e4m3
        # The flushed fraction per layer: one exponent per layer loses the
        # small end of the layer in e2m1, one per block keeps nearly all of it.
        assert layer["underflow"] >= 0.5, layer
        assert e2m1["underflow"] < 0.05, e2m1
        # The layer's record: its largest block's exponent, this rank's maximum.
        assert e2m1["exponent"] == layer["exponent"], (rank, e2m1, layer)
        assert e2m1["amax"] > 0 and e2m1["amax"] <= layer["amax"], (e2m1, layer)
        # Each rank's own exponents: the same bytes per element, all in the
        # exchange (plus, per shard of the first chunk, a flag byte per layer
        # and the sender's preferred chunk, padded to 4 bytes).
        rank_exps = r["e2m1/block/rank"]
        assert "all_reduce_max" not in rank_exps["bytes"], rank_exps
        assert rank_exps["bytes"]["all_to_all"] == 2 * (1024 + 64 + 4), rank_exps
        assert rank_exps["sent"] - 8 == 4096 * (0.5 + 1 / 32), rank_exps
        assert rank_exps["bytes"]["all_gather"] == 1024 + 64, rank_exps
        assert "scaling=block(32)," in rank_exps["describe"], rank_exps  # the default
        assert rank_exps["underflow"] < 0.05, rank_exps


def test_block_configuration_errors() -> None:
    with pytest.raises(ValueError, match=r"block_size must be a power of two.*got 48"):
        APSState("e4m3", scaling="block", block_size=48)
    with pytest.raises(ValueError, match="Promote needs one exponent per layer"):
        APSState("e4m3", scaling="block", policy=[Promote()])
    with pytest.raises(ValueError, match=r"block_size must be a power of two.*got 0"):
        APSFSDPState("e4m3", "block", block_size=0)
    assert "scaling=block(64)" in APSFSDPState("e2m1", "block", block_size=64).describe()


def test_default_block_size_follows_the_format() -> None:
    # What benchmarks/results/numerics_block_sizes.json and accuracy_block.json support:
    # 8-bit formats lose nothing with blocks of 128, narrower ones keep 32.
    assert APSState("e4m3", scaling="block").config.block_size == 128
    assert APSState("e5m2", scaling="block").config.block_size == 128
    assert APSState("e2m1", scaling="block").config.block_size == 32
    assert APSState("e3m2", scaling="block").config.block_size == 32
    assert APSState("e4m3", scaling="block", block_size=32).config.block_size == 32
    assert APSFSDPState("e4m3", "block").config.block_size == 128
    assert SimConfig("e4m3", scaling="block").block_size == 128
    assert SimConfig("e2m1", scaling="block").block_size == 32


def _rank_exponents_chunk(rank: int, world_size: int) -> list:
    # Each rank prefers its own chunk once it has timed the bucket; before,
    # the model's (the same everywhere).
    def chunk(self, fmt, numel, reduction, exchange_s=None):
        return 2**8 if exchange_s is None else 2 ** (9 + rank)

    Planner.chunk = chunk  # this rank's process only
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)  # one bucket of 4096 elements
    ddp = DDP(model, bucket_cap_mb=100)
    state = register(ddp, "e2m1", reduction="two_phase", scaling="block", block_exponents="rank")
    chunks = []
    for step in range(4):
        torch.manual_seed(step * 10 + rank)
        ddp.zero_grad()
        ddp(torch.randn(4, 64)).sum().backward()
        chunks.append(state.bucket_chunks[0])
        assert "all_reduce_max" not in state.bytes_detail
    return [chunks, model.weight.grad]


def test_rank_exponents_agree_on_the_chunk_through_the_exchange() -> None:
    # The ranks' preferences ride on the first chunk's exchange: the largest
    # is every rank's next chunk (timed from the second step on).
    (chunks0, grad0), (chunks1, grad1) = run_distributed(_rank_exponents_chunk, 2)
    assert chunks0 == chunks1 == [2**8, 2**8, 2**8, 2**10], (chunks0, chunks1)
    assert torch.equal(grad0, grad1)
