"""Launches per settled bucket on the Triton backend, counted without a GPU.

A settled bucket's device work on CUDA is its Triton launches plus the ATen
ops that launch kernels. Captured as a CUDA graph it is one replay for the
host, but each launch is still a kernel the device runs, and a bucket that
is not captured (the step's last, ``cuda_graphs=False``, Promote's) pays each
launch on the host too. This benchmark counts them for every configuration
of :data:`benchmarks.hostcost.CONFIGS` with the codec on Triton, under
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set here before
anything imports Triton): one settled bucket at world size 1 (Gloo), for a
model of few layers and one of many. The interpreter's own argument copies
are left out, as are formats Triton does not take (FP32 keeps its torch
ops). No timing: the interpreter runs kernels in numpy.

Target (issue 46): at most 15 launches and ops per bucket, the same for few
layers or many.

Usage::

    python -m benchmarks.triton_launches [--configs all|NAME,...] [--layers 4,32] [--out FILE]

Example:
    >>> python -m benchmarks.triton_launches --configs two_phase --layers 2  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import unittest.mock
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# torch, aps_comm and triton are imported inside the functions that count: Triton's
# interpreter must be switched on before any of them is imported, in :func:`main`'s
# process, while benchmarks.report imports :func:`table` alone.

__all__ = ["TARGET", "LaunchRow", "count_launches", "main", "table"]

TARGET = 15
"""The most launches and kernel-launching ATen ops a settled bucket may take (issue 46)."""

LAYER_SIZE = 2048
"""Elements per layer of the counted buckets."""

_COPIES = ("aten::new_empty", "aten::set_")


@dataclasses.dataclass(frozen=True)
class LaunchRow:
    """One configuration at one layer count: what its settled bucket launches."""

    config: str
    layers: int
    settled: bool
    aten: tuple[str, ...]
    triton: tuple[str, ...]

    @property
    def total(self) -> int:
        return len(self.aten) + len(self.triton)


@contextmanager
def _on_triton() -> Iterator[list[str]]:
    """Codecs built on Triton for the formats it takes; the names of the kernels launched."""
    import torch
    import triton.runtime.interpreter as ti

    from aps_comm import codec, triton_codec
    from benchmarks.hostcost import OpCounter

    launched: list[str] = []
    inside = [False]
    run, dispatch, auto = ti.GridExecutor.__call__, OpCounter.__torch_dispatch__, codec.backend_for

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        launched.append(getattr(self.fn, "__name__", "?"))
        inside[0] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] = False

    def outside(self: Any, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if inside[0]:  # the interpreter's own tensor ops, not the kernel's launches
            return func(*args, **(kwargs or {}))
        return dispatch(self, func, types, args, kwargs)

    def backend_for(fmt: Any, device: torch.device) -> str:
        return "triton" if triton_codec.supports(fmt) else auto(fmt, device)

    codec.codec_for.cache_clear()
    try:
        with (
            unittest.mock.patch.object(ti.GridExecutor, "__call__", counted),
            unittest.mock.patch.object(OpCounter, "__torch_dispatch__", outside),
            unittest.mock.patch.object(codec, "backend_for", backend_for),
        ):
            yield launched
    finally:
        codec.codec_for.cache_clear()


def count_launches(config: str, layers: int) -> LaunchRow:
    """:class:`LaunchRow` of one settled bucket of ``layers`` layers under ``CONFIGS[config]``
    (in a world of one rank already initialised)."""
    import torch

    import aps_comm
    from benchmarks.hostcost import CONFIGS, OpCounter, ParamLayer

    with _on_triton() as launched:
        numels = [LAYER_SIZE] * layers
        buffer = torch.randn(sum(numels), generator=torch.Generator().manual_seed(0))
        params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
        state = aps_comm.APSState(**CONFIGS[config])
        state.bind_model(torch.nn.ModuleList(ParamLayer(p) for p in params))
        for _ in range(3):  # the plan, then the settled path, then one more
            state.run_bucket(0, buffer, params)
        launched.clear()
        with OpCounter() as counter:
            state.run_bucket(0, buffer, params)
        aten = tuple(op for op in counter.ops if not op.startswith(_COPIES))
        settled = state.reducer is not None and state.reducer.steady_for(0, buffer) is not None
        return LaunchRow(config, layers, settled, aten, tuple(launched))


def table(rows: list[dict[str, Any]]) -> str:
    """The rows (:class:`LaunchRow` as JSON: with ``total``) as a Markdown table, one line per
    configuration, its layer counts side by side.

    Example:
        >>> print(table([{"config": "two_phase", "layers": 4, "settled": True, "total": 5,
        ...               "aten": ["aten::zero_.default"], "triton": ["a", "b", "c", "d"]}]))
        | config | settled | 4 layers (ATen + Triton) | within 15 |
        |---|---|---|---|
        | two_phase | yes | 5 (1 + 4) | yes |
    """
    by_config: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_config.setdefault(r["config"], []).append(r)
    counts = sorted({r["layers"] for r in rows})
    head = " | ".join(f"{n} layers (ATen + Triton)" for n in counts)
    rule = "|---|---|" + "---|" * (len(counts) + 1)
    lines = [f"| config | settled | {head} | within {TARGET} |", rule]
    for config, these in by_config.items():
        cells = " | ".join(f"{r['total']} ({len(r['aten'])} + {len(r['triton'])})" for r in these)
        settled = all(r["settled"] for r in these)
        totals = {r["total"] for r in these}
        ok = settled and len(totals) == 1 and max(totals) <= TARGET
        lines.append(
            f"| {config} | {'yes' if settled else 'no'} | {cells} | {'yes' if ok else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.triton_launches", description=__doc__
    )
    parser.add_argument(
        "--configs", default="all", help="'all', or names of CONFIGS, comma-separated"
    )
    parser.add_argument("--layers", default="4,32", help="layer counts, comma-separated")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # before torch, aps_comm or triton are imported
    import torch

    from benchmarks.hostcost import CONFIGS, world_of_one

    names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--configs: 'all' or names of CONFIGS, not {unknown}")
    layers = [int(n) for n in args.layers.split(",")]
    if any(n < 1 for n in layers):
        parser.error(f"--layers: positive counts, not {args.layers!r}")
    with world_of_one(torch.device("cpu")):
        found = [count_launches(name, n) for name in names for n in layers]
    rows = [{**dataclasses.asdict(r), "total": r.total} for r in found]
    print(table(rows))
    if args.out:
        doc = {
            "command": "python -m benchmarks.triton_launches " + " ".join(argv or sys.argv[1:]),
            "torch": torch.__version__,
            "target": TARGET,
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
