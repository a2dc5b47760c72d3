"""Where an APS e4m3 two_phase step goes: each wire phase and each codec pass, timed alone.

Run on every rank of a job (the emulated cluster sets the environment)::

    python -m benchmarks.cluster --ranks 4 --bandwidth 1gbit -- \\
        python -m benchmarks.comm_profile --mb 64 --json benchmarks/results/comm_profile.json

Each line is the median over repeats of the slowest rank, with every rank
doing the same thing at the same time (so on a machine with fewer cores than
ranks the CPU passes include that contention, as they do in a real step).

Example:
    >>> main(["--mb", "4"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from aps_comm import codec
from aps_comm.formats import E4M3
from aps_comm.transports import all_gather_single

__all__ = ["main"]


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=64.0, help="MiB of FP32 gradients")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = int(args.mb * 2**20 / 4) // (2 * world) * (2 * world)
    x32 = torch.randn(n)
    x16 = x32.half()
    send = torch.zeros(n, dtype=torch.uint8)
    recv = torch.empty_like(send)
    shard = torch.empty(n // world, dtype=torch.uint8)
    layout = codec.Layout.from_numels([n // 4] * 3 + [n - 3 * (n // 4)], x32.device)
    scale = torch.full((4,), 8.0)
    phases = {
        "wire: all_reduce fp32 (the FP32 hook)": lambda: dist.all_reduce(x32),
        "wire: all_reduce fp16 (fp16_compress_hook)": lambda: dist.all_reduce(x16),
        "wire: all_to_all_single e4m3 payload": lambda: dist.all_to_all_single(recv, send),
        "wire: all_gather e4m3 shards": lambda: all_gather_single(send, shard, dist.group.WORLD),
        "cpu: layer maxima": lambda: codec.segment_amax(x32, layout),
        "cpu: scale + encode": lambda: codec.encode(
            x32, E4M3, out=send, scale=scale, layout=layout
        ),
        "cpu: owner decode + sum + re-encode": lambda: codec.owner_reduce(
            recv, E4M3, world, out=shard
        ),
        "cpu: decode + unscale": lambda: codec.decode(
            send, E4M3, n, out=x32, scale=1 / scale, layout=layout
        ),
    }
    result = {name: _time(fn, args.repeats) for name, fn in phases.items()}
    if rank == 0:
        wire = sum(
            v for k, v in result.items() if k.startswith("wire: all_to_all") or "gather" in k
        )
        cpu = sum(v for k, v in result.items() if k.startswith("cpu"))
        for name, seconds in result.items():
            print(f"{name:45s} {seconds * 1e3:8.1f} ms", flush=True)
        print(f"{'APS e4m3 wire phases together':45s} {wire * 1e3:8.1f} ms")
        print(f"{'APS e4m3 CPU passes together':45s} {cpu * 1e3:8.1f} ms")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps(
                    {
                        "command": "python -m benchmarks.comm_profile " + " ".join(sys.argv[1:]),
                        "ranks": world,
                        "elements": n,
                        "repeats": args.repeats,
                        "seconds": result,
                        "aps_wire_s": wire,
                        "aps_cpu_s": cpu,
                    },
                    indent=2,
                )
                + "\n"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
