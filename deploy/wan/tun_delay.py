"""Delay every IP packet that crosses a router by a fixed time, in userspace, for kernels without `tc netem`.

Opens a TUN device (default name `delay`) and gives each packet the kernel routes into it back to the kernel
`--latency-ms` later, in arrival order. netwan.py routes every packet that enters its router namespace from a region
into this device (a policy rule per region veth), and the packets written back re-enter the router through the
device and go on to their region by the main table: any connection between regions, whatever its protocol or ports
(gloo's ephemeral ones, libp2p's, gRPC's), sees the latency once per direction, as a netem qdisc would give it.

    ip netns exec ROUTER python tun_delay.py --latency-ms 50

Prints one line, `ready`, on stdout once the device exists (netwan then brings it up and routes into it); runs
until SIGINT/SIGTERM. Needs CAP_NET_ADMIN (root) and /dev/net/tun.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_PACKET = 65536
# Packets held at most (at 50 Mbit/s and 50 ms a link holds ~210 full-size packets in flight): a burst beyond this
# is dropped, as a router's full buffer would drop it, instead of growing without bound.
MAX_HELD = 100_000


def open_tun(name: str) -> int:
    """A TUN device named `name` (no packet-info header): its file descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def relay(fd: int, delay_s: float, stop: list[bool]) -> None:
    """Read packets from fd and write each back delay_s after it arrived, until stop[0]."""
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    while not stop[0]:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        try:
            readable, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        if readable:
            now = time.monotonic()
            # Drain what is queued now: one select per packet would cost a system call per packet more.
            while True:
                try:
                    packet = os.read(fd, MAX_PACKET)
                except BlockingIOError:
                    break
                if len(held) < MAX_HELD:
                    held.append((now + delay_s, packet))
        now = time.monotonic()
        while held and held[0][0] <= now:
            try:
                os.write(fd, held.popleft()[1])
            except OSError:
                pass  # a packet the kernel refuses (no route any more) is lost, as on a real link


def main(argv: list[str] | None = None) -> int:
    """Entry point: open the device and delay packets until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, required=True, help="delay of every packet, one way")
    parser.add_argument("--device", default="delay", help="the TUN device's name (default delay)")
    args = parser.parse_args(argv)
    if not 0 <= args.latency_ms <= 10_000:
        parser.error(f"--latency-ms must be in [0, 10000], got {args.latency_ms}")
    fd = open_tun(args.device)
    os.set_blocking(fd, False)
    stop = [False]

    def request_stop(_signum: int, _frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    print("ready", flush=True)
    relay(fd, args.latency_ms / 1000.0, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
