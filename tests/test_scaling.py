"""Exponent rules: a native sum of N encoded maxima never overflows the format."""

from __future__ import annotations

import pytest
import torch

from aps_comm import formats as F
from aps_comm.formats import FloatFormat, get_format, pow2, quantize
from aps_comm.scaling import EXPONENT_LIMIT, exponents


def test_native_sum_headroom_counts_rounding() -> None:
    # 13 * 5038.5 <= 65504 gives e = 0, but 5038.5 encodes to 5040 in fp16 and
    # 13 * 5040 = 65520 rounds to inf: the rule must step down once.
    amax = torch.tensor([5038.5, 5030.0])
    e = exponents(amax, F.FP16, world_size=13, reduction="allreduce")
    assert e.tolist() == [-1, 0]
    assert quantize(amax * pow2(e), F.FP16).tolist() == [2520.0, 5032.0]


@pytest.mark.parametrize(
    "fmt",
    [F.E4M3, F.E5M2, F.FP16, F.BF16, F.E3M4, F.E2M3, F.E3M2, F.E3M0, get_format("e5m3")],
    ids=str,
)
def test_native_sum_never_overflows(fmt: FloatFormat) -> None:
    gen = torch.Generator().manual_seed(fmt.bits)
    n = 4000
    world = torch.randint(1, 65, (n,), generator=gen)
    # Random magnitudes over 50 binades below the format's top, and values just below each binade's top
    # (the ones that round up).
    mant = 1 + torch.rand(n, generator=gen, dtype=torch.float64)
    mant[::2] = 2 - torch.rand(n // 2, generator=gen, dtype=torch.float64) * 2.0**-8
    top = int(torch.tensor(fmt.max).log2().floor())
    binade = torch.randint(top - 50, top, (n,), generator=gen).double()
    amax = (mant * torch.exp2(binade)).float()
    e = torch.empty(n, dtype=torch.int32)
    for w in range(1, 65):
        mine = world == w
        e[mine] = exponents(amax[mine], fmt, world_size=w, reduction="allreduce")
    assert e.abs().max() < EXPONENT_LIMIT  # no clamping: the rule alone decides
    q = quantize(amax * pow2(e), fmt).double()
    assert bool((q * world <= fmt.max).all())
    # Still the largest such exponent: one more would overflow, or would have
    # passed FMAX / N before rounding.
    q_up = quantize(amax * pow2(e + 1), fmt).double()
    too_big = (q_up * world > fmt.max) | (amax.double() * torch.exp2(e + 1.0) * world > fmt.max)
    assert bool(too_big.all())
