"""What runs inside the namespaces to measure them: the link probe and the all_reduce check.

``python -m benchmarks.cluster.probe server HOST`` listens on HOST, echoes
pings, times a bulk transfer and reports it to the client;
``... client HOST PORT NBYTES PINGS`` ping-pongs, sends NBYTES and prints
one JSON line (:meth:`EmulatedCluster.link_stats
<benchmarks.cluster.emulated.EmulatedCluster.link_stats>` starts both).
``... allreduce MIB REPEATS`` is one rank of
:func:`~benchmarks.cluster.emulated.allreduce_check`.

Example::

    python -m benchmarks.cluster.probe server 10.213.77.2
    python -m benchmarks.cluster.probe client 10.213.77.2 40123 67108864 20
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.cluster.emulated import RESULT_TAG

__all__ = ["allreduce_rank", "client", "main", "serve"]

_HEADER = struct.Struct("!QI")  # bulk bytes, number of pings


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection early")
        buf += chunk
    return bytes(buf)


def serve(host: str) -> None:
    """Echo pings, then time a bulk transfer and report it to the client."""
    with socket.socket() as lsock:
        lsock.bind((host, 0))
        lsock.listen(1)
        print(f"ready {lsock.getsockname()[1]}", flush=True)
        conn, _ = lsock.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nbytes, pings = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
        for _ in range(pings):
            conn.sendall(_recv_exact(conn, 1))
        buf = bytearray(1 << 20)
        got = first = 0
        t_first = t_last = 0.0
        while got < nbytes:
            n = conn.recv_into(buf)
            if n == 0:
                raise ConnectionError("sender closed before the transfer finished")
            t_last = time.perf_counter()
            if got == 0:
                t_first, first = t_last, n
            got += n
        conn.sendall(json.dumps({"bytes": got - first, "seconds": t_last - t_first}).encode())


def client(host: str, port: int, nbytes: int, pings: int) -> None:
    """Ping-pong, then send ``nbytes``; print the result as one JSON line."""
    with socket.create_connection((host, port), timeout=120) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(_HEADER.pack(nbytes, pings))
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            conn.sendall(b"p")
            _recv_exact(conn, 1)
            rtts.append(time.perf_counter() - t0)
        chunk = bytes(1 << 20)
        view = memoryview(chunk)
        left = nbytes
        while left:
            n = min(left, len(chunk))
            conn.sendall(view[:n])
            left -= n
        report = json.loads(conn.recv(4096).decode())
    seconds = max(report["seconds"], 1e-9)
    print(
        json.dumps(
            {
                "bits_per_s": report["bytes"] * 8 / seconds,
                "rtt_median_s": statistics.median(rtts) if rtts else float("nan"),
                "rtt_min_s": min(rtts) if rtts else float("nan"),
            }
        ),
        flush=True,
    )


def allreduce_rank(megabytes: float, repeats: int) -> None:
    """Time FP32 and FP16 all_reduce of the same element count on every rank.

    Run by :func:`~benchmarks.cluster.emulated.allreduce_check` in each rank;
    rank 0 prints one tagged JSON line. Imports torch lazily so the link
    probe stays cheap.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = int(megabytes * 2**20) // 4
    out: dict[str, Any] = {"numel": numel, "fp32_megabytes": numel * 4 / 2**20, "world": world}
    for dtype in (torch.float32, torch.float16):
        t = torch.full((numel,), float(rank + 1), dtype=dtype)
        dist.all_reduce(t)  # warm-up, also a correctness check
        expected = world * (world + 1) / 2
        if not bool((t == expected).all()):
            raise RuntimeError(f"all_reduce {dtype} gave {t[:4]}, expected {expected}")
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        # Every rank waits for the slowest, so the max over ranks is the step time.
        worst = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        name = str(dtype).removeprefix("torch.")
        out[name] = {"seconds": worst.tolist(), "median_s": statistics.median(worst.tolist())}
    dist.destroy_process_group()
    if rank == 0:
        print(RESULT_TAG + json.dumps(out), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """``server HOST``, ``client HOST PORT NBYTES PINGS`` or ``allreduce MIB REPEATS``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[0] == "server":
        serve(args[1])
    elif args[0] == "client":
        client(args[1], int(args[2]), int(args[3]), int(args[4]))
    elif args[0] == "allreduce":
        allreduce_rank(float(args[1]), int(args[2]))
    else:
        raise SystemExit(f"unknown probe {args[0]!r}: server, client or allreduce")


if __name__ == "__main__":
    main()
