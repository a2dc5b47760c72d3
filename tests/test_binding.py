"""Binding the hook to a job: backends, the FP8 gate, what register refuses, plan builds.

The backend is whatever the state's group uses for the gradients' device:
``init_process_group()`` without a backend ("undefined", i.e. Gloo for CPU and
NCCL for CUDA), per-device specs ("cpu:gloo,cuda:nccl") and plain names all
work, and the multi-rank runs here compare with an exact reference built from
every rank's gradients.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import aps_comm.reduction as reduction_mod
from aps_comm import APSState, aps_hook, register
from aps_comm.agreement import backend_for, check_backend
from aps_comm.config import Reduction, Route, Scaling
from aps_comm.formats import get_format, quantize
from aps_comm.reduction import native_sum_supported, pick_reduction
from aps_comm.scaling import exponents, pow2
from aps_comm.testing import run_distributed

# ---------------------------------------------------------------------------
# choices are spelled once


def test_choices_parse_any_case_and_name_the_bad_value() -> None:
    assert Reduction.parse("TWO_PHASE", "reduction") is Reduction.TWO_PHASE
    assert Scaling("layer") == "layer" and f"{Route.ALLREDUCE}" == "allreduce"
    assert Route.from_model("native") is Route.ALLREDUCE and Route.GRID.model_name == "grid"
    with pytest.raises(ValueError, match=r"reduction must be one of .*'auto'.*got 'ring'"):
        APSState("e4m3", reduction="ring")
    assert APSState("e4m3", scaling="BLOCK").config.scaling is Scaling.BLOCK
    with pytest.raises(ValueError, match=r"scaling must be one of .*'block'.*got 'blocks'"):
        APSState("e4m3", scaling="blocks")


# ---------------------------------------------------------------------------
# the backend of the gradients' device


class _Backend:
    def __init__(self, name: str) -> None:
        self._name = name

    def name(self) -> str:
        return self._name


class _Group:
    """A group as torch answers for it: a backend per device type, or none."""

    def __init__(self, per_device: dict[str, str]) -> None:
        self.per_device = per_device

    def _get_backend(self, device: torch.device) -> _Backend:
        if device.type not in self.per_device:
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return _Backend(self.per_device[device.type])


@pytest.mark.parametrize(
    ("per_device", "device", "want"),
    [
        ({"cpu": "gloo"}, "cpu", "gloo"),  # init_process_group() on a CPU machine
        ({"cpu": "gloo", "cuda": "nccl"}, "cuda", "nccl"),  # "cpu:gloo,cuda:nccl"
        ({"cpu": "gloo", "cuda": "nccl"}, "cpu", "gloo"),
        ({"cpu": "gloo", "cuda": "gloo"}, "cuda", "gloo"),  # "gloo"
        ({"cuda": "nccl"}, "cuda", "nccl"),  # "nccl"
        ({"cpu": "mpi", "cuda": "mpi"}, "cpu", "mpi"),  # "mpi"
    ],
)
def test_backend_is_the_groups_backend_for_the_device(
    per_device: dict[str, str], device: str, want: str
) -> None:
    got = backend_for(_Group(per_device), torch.device(device))  # type: ignore[arg-type]
    assert got == want
    check_backend(got, torch.device(device))


def test_backend_spec_string_is_parsed_when_the_group_cannot_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Opaque:
        pass

    monkeypatch.setattr(dist, "get_backend", lambda group: "cpu:gloo,cuda:nccl")
    assert backend_for(Opaque(), torch.device("cuda")) == "nccl"  # type: ignore[arg-type]
    assert backend_for(Opaque(), torch.device("cpu")) == "gloo"  # type: ignore[arg-type]
    monkeypatch.setattr(dist, "get_backend", lambda group: "cuda:nccl")
    with pytest.raises(ValueError, match="no backend for cpu tensors"):
        backend_for(Opaque(), torch.device("cpu"))  # type: ignore[arg-type]


def test_unsupported_backends_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'ucc' backend for cpu"):
        check_backend("ucc", torch.device("cpu"))
    with pytest.raises(ValueError, match="nccl backend needs CUDA gradients, got cpu"):
        check_backend("nccl", torch.device("cpu"))


# ---------------------------------------------------------------------------
# the native FP8 gate


def _fake_gpu(
    monkeypatch: pytest.MonkeyPatch, torch_version: str, nccl: tuple, capability: tuple
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: nccl)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch, "__version__", torch_version)


@pytest.mark.parametrize(
    ("torch_version", "nccl", "capability", "sums"),
    [
        ("2.8.0", (2, 24, 3), (9, 0), True),
        ("2.13.0+cu128", (2, 27, 5), (10, 0), True),
        ("2.7.1", (2, 26, 2), (9, 0), False),  # ProcessGroupNCCL rejects float8 before 2.8
        ("2.8.0", (2, 23, 4), (9, 0), False),  # NCCL sums FP8 from 2.24
        ("2.8.0", (2, 24, 3), (8, 9), False),  # and only on sm_90+
    ],
)
def test_native_fp8_needs_torch_nccl_and_hopper(
    monkeypatch: pytest.MonkeyPatch, torch_version: str, nccl: tuple, capability: tuple, sums: bool
) -> None:
    _fake_gpu(monkeypatch, torch_version, nccl, capability)
    e4m3, cuda = get_format("e4m3"), torch.device("cuda", 0)
    assert native_sum_supported(e4m3, "nccl", cuda) is sums
    assert not native_sum_supported(e4m3, "gloo", cuda)
    assert pick_reduction("auto", e4m3, "nccl", cuda) == ("allreduce" if sums else "two_phase")
    if not sums:
        with pytest.raises(ValueError, match=r"torch >= 2\.8"):
            pick_reduction("allreduce", e4m3, "nccl", cuda)
    assert reduction_mod.FP8_ALLREDUCE_TORCH == (2, 8)


# ---------------------------------------------------------------------------
# register refuses what cannot run, at register, on every rank


def test_register_needs_a_ddp_model() -> None:
    with pytest.raises(TypeError, match=r"DistributedDataParallel.*got Linear"):
        register(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_compiled_autograd_python_reducer_is_named() -> None:
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match=r"python_reducer.*torch\.compile\(ddp\)"):
        aps_hook(APSState("e4m3"), (torch.ones(2), p))  # type: ignore[arg-type]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * 1e-2)


def _refused(rank: int, world_size: int) -> str:
    try:
        register(DDP(_Net()), "e4m3", reduction="allreduce")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_fp8_allreduce_on_gloo_is_refused_at_register() -> None:
    for msg in run_distributed(_refused, 2, backend=None):
        # Every rank's problem, said once for the ranks that have it (issue 45).
        assert "cannot run this configuration: ranks 0-1: " in msg, msg
        assert msg.count("reduction='allreduce' needs a backend that sums e4m3") == 1, msg


# ---------------------------------------------------------------------------
# any backend spec: the hook and FSDP train and match the exact reference


def _local(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's own gradients of the model (no communication)."""
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    return dict(zip(names, grads, strict=True))


def _grads_everywhere(rank: int, world_size: int, register_late: bool) -> dict:
    """Four steps of the hook and one of FSDP: each rank's inputs' gradients and results."""
    from torch.distributed.fsdp import fully_shard

    from aps_comm import fsdp as aps_fsdp

    torch.manual_seed(0)
    model = _Net()
    ddp = DDP(model, bucket_cap_mb=0.0005)  # several buckets, re-bucketed after step 0
    if register_late:
        # The state binds at the first hook call, which must not wait for a peer.
        state = APSState("e4m3", reduction="two_phase")
        state.bind_process_group()
        ddp.register_comm_hook(state, aps_hook)
    else:
        state = register(ddp, "e4m3", reduction="two_phase", stats=True)
    out: dict = {"backend": str(dist.get_backend()), "steps": [], "local": [], "builds": []}
    for step in range(4):
        torch.manual_seed(10 * step + rank)
        x = torch.randn(4, 8)
        out["local"].append(_local(model, x))
        ddp.zero_grad()
        ddp(x).sum().backward()
        reducer = state.reducer
        assert reducer is not None
        out["builds"].append(
            reducer.plan_builds + sum(p.group_builds for p in reducer.plans.values())
        )
        out["steps"].append({n: p.grad.clone() for n, p in model.named_parameters()})
    out["routes"] = dict(state.bucket_reductions)
    torch.manual_seed(0)
    net = _Net()
    plain = copy.deepcopy(net)
    fully_shard(net.a)
    fully_shard(net)
    fstate = aps_fsdp.register(net, "e4m3")
    torch.manual_seed(rank)
    x = torch.randn(4, 8)
    out["fsdp_local"] = _local(plain, x)
    net(x).sum().backward()
    out["fsdp"] = {n: p.grad.full_tensor() for n, p in net.named_parameters()}
    out["fsdp_step"] = fstate.step
    return out


def _exact(gs: list[torch.Tensor], fsdp: bool) -> torch.Tensor:
    """The exact e4m3 two_phase mean of one parameter's gradients on every rank.

    The hook sums the ranks' encoded values in FP32 in rank order, divides by
    N and re-encodes before unscaling; FSDP unscales each rank's decoded
    values, sums them in rank order and divides by N (its reduce dtype is FP32).
    """
    e4m3, n = get_format("e4m3"), len(gs)
    amax = torch.stack([g.abs().max() for g in gs]).max().reshape(1)
    e = exponents(amax, e4m3, world_size=n, reduction="two_phase")
    q = [quantize(g * pow2(e), e4m3) for g in gs]
    if fsdp:
        acc = q[0] * pow2(-e)
        for part in q[1:]:
            acc = acc + part * pow2(-e)
        return acc / n
    acc = q[0]
    for part in q[1:]:
        acc = acc + part
    return quantize(acc / n, e4m3) * pow2(-e)


@pytest.mark.parametrize("backend", [None, "cpu:gloo"])
def test_hook_and_fsdp_run_without_a_backend_name(backend: str | None) -> None:
    ranks = run_distributed(_grads_everywhere, 2, args=(backend is None,), backend=backend)
    assert ranks[0]["backend"] == ("undefined" if backend is None else "cpu:gloo")
    for r in ranks:
        assert set(r["routes"].values()) == {"two_phase"}
        # Plans are built at step 0 and again at step 1 (DDP re-buckets), never after.
        assert r["builds"][1] == r["builds"][2] == r["builds"][3], r["builds"]
        assert r["fsdp_step"] == 1
        for step in range(4):
            for name, got in r["steps"][step].items():
                want = _exact([o["local"][step][name] for o in ranks], fsdp=False)
                assert torch.equal(got, want), (step, name)
        for name, got in r["fsdp"].items():
            want = _exact([o["fsdp_local"][name] for o in ranks], fsdp=True)
            assert torch.equal(got, want), name


def _no_layout_warning(rank: int, world_size: int) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        register(DDP(_Net()), "e4m3")
    return [str(w.message) for w in seen if "hierarchical" in str(w.message)]


def test_local_rank_without_local_world_size_is_not_a_layout() -> None:
    """Lightning sets LOCAL_RANK but not LOCAL_WORLD_SIZE: no hierarchical warning."""
    for r, msgs in enumerate(run_distributed(_no_layout_warning, 2, env={"LOCAL_RANK": "1"})):
        assert msgs == [], (r, msgs)


# ---------------------------------------------------------------------------
# register is collective: a rank that never calls it is named, not waited for


def _rank_1_skips_register(rank: int, world_size: int, api: str) -> str:
    """Rank 1 does not call register until rank 0 has given up on it (a store key says so)."""
    from torch.distributed.fsdp import fully_shard

    from aps_comm import agreement, fsdp

    agreement.ARRIVAL_TIMEOUT_S = 1.0  # the group's timeout is 120 s
    store = dist.distributed_c10d._get_default_store()
    if api == "ddp":
        model = DDP(nn.Linear(4, 4))
    else:
        model = nn.Linear(4, 4)
        fully_shard(model)
    if rank == 1:
        store.wait(["test/rank 0 gave up"])  # no timing: rank 0 has finished waiting
    try:
        register(model) if api == "ddp" else fsdp.register(model)
        result = "no error"
    except RuntimeError as exc:
        result = str(exc)
    if rank == 0:
        store.set("test/rank 0 gave up", "1")
    return result


@pytest.mark.parametrize("api", ["ddp", "fsdp"])
def test_a_rank_that_does_not_call_register_is_named(api: str) -> None:
    """Before, rank 0 waited silently in the group's creation for the whole timeout (issue 45)."""
    what = "aps_comm.register" if api == "ddp" else "aps_comm.fsdp.register"
    waited, late = run_distributed(_rank_1_skips_register, 2, args=(api,), timeout=60)
    assert waited.startswith(f"{what} is collective: every rank must call it"), waited
    assert "in the same order" in waited and "Rank 1 did not reach it within 1 s" in waited, waited
    assert "ARRIVAL_TIMEOUT_S" in waited, waited
    # Too late: the others stopped waiting, so it must not go on into a collective alone.
    assert "this rank (rank 1) reached it after the others had stopped waiting" in late, late
