"""A userspace TCP relay that adds a fixed one-way latency, for kernels without `tc netem`.

Each route accepts on LISTEN_HOST:PORT and connects every accepted client to TARGET_HOST:PORT. Bytes are forwarded
in both directions; each chunk is held until receive time + latency, so order is preserved and a stream sees the
latency once per direction (a round trip through the relay costs 2 x latency). The relay has no bandwidth cap of its
own: rate limits belong to `tbf` on the links. Clients whose source address lies in a --local-net are relayed
without delay, so traffic inside a region can share the relay address with traffic from other regions.

    python delay_relay.py --latency-ms 50 --local-net 10.1.0.0/24 --route 10.1.0.2:7000=127.0.0.1:7000

Prints one line, `ready`, on stdout once every route is listening; logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import socket
import sys
from dataclasses import dataclass

log = logging.getLogger("delay_relay")

CHUNK_BYTES = 64 * 1024
# Bounds memory per direction (64 MiB): a receiver that stops reading pushes back on the sender through TCP
# instead of growing the queue. Far above what a link holds in flight, so it never acts as a rate cap.
MAX_QUEUED_CHUNKS = 1024


@dataclass(frozen=True)
class Route:
    """Accept on (listen_host, listen_port) and relay to (target_host, target_port)."""

    listen_host: str
    listen_port: int
    target_host: str
    target_port: int


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def parse_route(text: str) -> Route:
    """Parse `LISTEN_HOST:PORT=TARGET_HOST:PORT`."""
    listen, sep, target = text.partition("=")
    if not sep:
        raise ValueError(f"a route is LISTEN_HOST:PORT=TARGET_HOST:PORT, got {text!r}")
    return Route(*_host_port(listen), *_host_port(target))


def _nodelay(writer: asyncio.StreamWriter) -> None:
    # gRPC sends small frames and sets TCP_NODELAY itself; Nagle here would add delay the relay is not asked for.
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy one direction of a connection, delivering each chunk delay_s after it was read."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_QUEUED_CHUNKS)

    async def receive() -> None:
        while data := await reader.read(CHUNK_BYTES):
            await queue.put((loop.time() + delay_s, data))
        # The end of the stream is late too, or a half-close would overtake the last bytes.
        await queue.put((loop.time() + delay_s, b""))

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    await _all_or_none(receive(), deliver())


async def _all_or_none(*coros) -> None:
    """Run coroutines together; when one fails, cancel the rest and re-raise."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass  # the peer already reset the connection: it is closed either way


class Relay:
    """Delay relays for a set of routes."""

    def __init__(self, routes: list[Route], latency_ms: float, local_nets: list[str] | None = None) -> None:
        if latency_ms < 0:
            raise ValueError(f"latency must be >= 0 ms, got {latency_ms}")
        self.routes = routes
        self.delay_s = latency_ms / 1000.0
        self.local_nets = [ipaddress.ip_network(n, strict=False) for n in local_nets or []]
        self._servers: list[asyncio.Server] = []

    def delay_for(self, client_ip: str) -> float:
        """The one-way delay for a client: none from a local network, the configured latency otherwise."""
        addr = ipaddress.ip_address(client_ip)
        return 0.0 if any(addr in net for net in self.local_nets) else self.delay_s

    async def start(self) -> list[tuple[str, int]]:
        """Listen on every route; returns the bound addresses in route order (port 0 picks a free one)."""
        bound = []
        for route in self.routes:
            server = await asyncio.start_server(
                lambda r, w, route=route: self._serve(route, r, w), route.listen_host, route.listen_port
            )
            self._servers.append(server)
            host, port = server.sockets[0].getsockname()[:2]
            bound.append((host, port))
            log.info("relaying %s:%d -> %s:%d", host, port, route.target_host, route.target_port)
        return bound

    async def close(self) -> None:
        """Stop accepting; open connections end with the process."""
        for server in self._servers:
            server.close()
        for server in self._servers:
            await server.wait_closed()

    async def _serve(self, route: Route, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        client = client_w.get_extra_info("peername")
        delay_s = self.delay_for(client[0])
        try:
            target_r, target_w = await asyncio.open_connection(route.target_host, route.target_port)
        except OSError as e:
            log.info("cannot reach %s:%d for %s: %s", route.target_host, route.target_port, client, e)
            await _close(client_w)
            return
        _nodelay(client_w)
        _nodelay(target_w)
        log.debug("%s -> %s:%d with %.1f ms", client, route.target_host, route.target_port, delay_s * 1000)
        try:
            await _all_or_none(_pump(client_r, target_w, delay_s), _pump(target_r, client_w, delay_s))
        except (ConnectionError, OSError) as e:
            log.debug("connection from %s ended: %s", client, e)
        finally:
            await _close(client_w)
            await _close(target_w)


async def _main(relay: Relay) -> None:
    await relay.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await relay.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse routes and relay until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", action="append", required=True, metavar="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    parser.add_argument("--latency-ms", type=float, required=True, help="one-way delay added to each direction")
    parser.add_argument("--local-net", action="append", default=[], metavar="CIDR",
                        help="clients from this network are relayed without delay (repeatable)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        relay = Relay([parse_route(r) for r in args.route], args.latency_ms, args.local_net)
    except ValueError as e:
        parser.error(str(e))
    asyncio.run(_main(relay))
    return 0


if __name__ == "__main__":
    sys.exit(main())
