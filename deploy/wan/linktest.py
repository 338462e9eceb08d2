"""Bulk TCP transfer for measuring an emulated link: `sink` receives and reports, `send` pushes N bytes.

    python linktest.py sink --listen 10.2.0.2:0      # prints {"port": P}, then {"bytes": B, "seconds": S}
    python linktest.py send --to 10.2.0.2:P --bytes 4194304

The sink times from the first byte to the end of the stream and leaves the first read out of the count, so
connection setup and the token bucket's initial burst do not inflate the figure.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

CHUNK_BYTES = 64 * 1024


def sink(host: str, port: int) -> dict[str, float]:
    """Accept one connection, read it to the end, and return the bytes and seconds after the first read."""
    with socket.create_server((host, port)) as server:
        print(json.dumps({"port": server.getsockname()[1]}), flush=True)
        conn, _ = server.accept()
        with conn:
            first = conn.recv(CHUNK_BYTES)
            start = time.monotonic()
            total = 0
            while data := conn.recv(CHUNK_BYTES):
                total += len(data)
            seconds = time.monotonic() - start
    if not first:
        raise RuntimeError("the sender closed without sending anything")
    return {"bytes": total, "seconds": seconds}


def send(host: str, port: int, nbytes: int) -> None:
    """Connect and write nbytes of zeros, then close."""
    block = bytes(CHUNK_BYTES)
    with socket.create_connection((host, port), timeout=30) as conn:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            conn.sendall(block[:n])
            left -= n
        conn.shutdown(socket.SHUT_WR)
        # Wait for the sink's close so the sender exits only after every byte was delivered.
        conn.recv(1)


def main(argv: list[str] | None = None) -> int:
    """Entry point: `sink` or `send`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("sink")
    p.add_argument("--listen", required=True, metavar="HOST:PORT")
    p = sub.add_parser("send")
    p.add_argument("--to", required=True, metavar="HOST:PORT")
    p.add_argument("--bytes", type=int, required=True)
    args = parser.parse_args(argv)
    if args.mode == "sink":
        host, _, port = args.listen.rpartition(":")
        print(json.dumps(sink(host, int(port))), flush=True)
    else:
        host, _, port = args.to.rpartition(":")
        send(host, int(port), args.bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
