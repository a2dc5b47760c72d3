"""The delaying switch: forwards frames between the nodes' veths, each after a fixed delay.

Runs in the bridge namespace in place of the Linux bridge when an
:class:`~benchmarks.cluster.emulated.EmulatedCluster` has a ``delay``
(``tc netem`` is not in every kernel; this needs only packet sockets)::

    python -m benchmarks.cluster.switch DELAY_S PORT [PORT ...]
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]

_SOL_PACKET = 263
_PACKET_VNET_HDR = 15  # frames come with a virtio_net_hdr: GSO frames pass whole
_PACKET_IGNORE_OUTGOING = 23  # Linux >= 4.20: do not read back what we send
_ETH_P_ALL = 0x0003
_VNET_HDR_LEN = 10
_MAX_FRAME = _VNET_HDR_LEN + 14 + 65535 + 64


def main(argv: Sequence[str] | None = None) -> None:
    """Forward Ethernet frames among the given ports, each ``delay`` s after it came.

    Entry point of ``python -m benchmarks.cluster.switch DELAY PORT...``. A
    learning switch: a frame goes to the port its destination MAC was last
    seen on, else (broadcast, ARP, unknown) to every other port. One thread,
    frames in arrival order (the delay is constant, so a FIFO is a timer
    queue). Packet sockets with virtio headers receive the veths' GSO frames
    (up to 64 KiB) whole, so a Gbit/s link costs a few thousand frames per
    second; the tbf qdiscs on both veth ends still shape every link. Runs
    SCHED_FIFO when allowed: with every core busy running ranks, a
    time-shared switch would add the scheduler's latency to the delay.
    """
    import collections

    args = list(sys.argv[1:] if argv is None else argv)
    delay, ports = float(args[0]), args[1:]
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    socks = []
    for port in ports:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        s.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
        s.setsockopt(_SOL_PACKET, _PACKET_IGNORE_OUTGOING, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        s.bind((port, 0))
        s.setblocking(False)
        socks.append(s)
    index = {s.fileno(): i for i, s in enumerate(socks)}
    poller = select.poll()
    for s in socks:
        poller.register(s.fileno(), select.POLLIN)
    where: dict[bytes, int] = {}
    queue: collections.deque[tuple[float, int, bytes]] = collections.deque()
    dst_at, src_at = _VNET_HDR_LEN, _VNET_HDR_LEN + 6
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, out, frame = queue.popleft()
            # A full send buffer drops the frame, as a switch's full queue
            # would; TCP retransmits it.
            with contextlib.suppress(BlockingIOError):
                socks[out].send(frame)
        timeout_ms = None if not queue else max(0.0, (queue[0][0] - now) * 1e3)
        for fd, _ in poller.poll(timeout_ms):
            port = index[fd]
            while True:
                try:
                    frame = socks[port].recv(_MAX_FRAME)
                except BlockingIOError:
                    break
                where[frame[src_at : src_at + 6]] = port
                due = time.monotonic() + delay
                dst = frame[dst_at : dst_at + 6]
                out = where.get(dst)
                if dst[0] & 1 or out is None:
                    queue.extend((due, o, frame) for o in range(len(socks)) if o != port)
                elif out != port:
                    queue.append((due, out, frame))


if __name__ == "__main__":
    main()
