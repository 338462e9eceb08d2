"""The dial-back at registration: can anyone reach a node at the port it advertised, on the host its call came from?
A node nobody can dial serves over connections it opens itself (Stage.Reverse), so the answer goes into every plan.

The coordinator dials only the caller's own source address (the gRPC peer), never a host the caller names: a token
holder must not turn it into a port scanner of a third host. The cases, each by name in `target`:
- DIRECT: the advertised host is the source address (a local run: 127.0.0.1 from 127.0.0.1);
- NAME: a DNS name that resolves to the source address: the source address is dialled (a second resolution could
  answer another host), and the name is what peers dial;
- NAT: another IP advertised (a LAN address behind a forwarded port): the source address at the advertised port;
- PROXIED: a call from loopback advertising another host came through a proxy on the coordinator's host, and the
  caller's own address is unknown: nothing is dialled, the node is UNREACHABLE (it serves over streams it opens);
- RELAYED: the same where the operator said calls come through a relay (scheduler.behind_proxy, as the namespace
  WAN's coordinator runs): the advertised address is dialled, the one case where the caller chooses the host.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import peer_host
from geotrain.protocol.probe import probe_chunks
from geotrain.protocol.transport import TlsFiles, make_channel

log = logging.getLogger(__name__)

DIAL_BACK_S = 3.0
"""How long a dial-back waits for the node to answer, per address: a dropped connection shows only as silence."""

DIRECT = "direct"
UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Target:
    """Where to dial a registering node (`dial`, an IP address and port, or None: nowhere), what peers are told to
    dial when it answers (`reached`), and which case of the module's docstring it is (`case`)."""

    dial: str | None
    reached: str | None
    case: str


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _join(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: str) -> str:
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def resolve(name: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses a DNS name resolves to (empty when it does not)."""
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return set()
    return {ip for info in infos if (ip := _ip(str(info[4][0]).split("%")[0])) is not None}


def target(
    advertised: str, caller: str, behind_proxy: bool = False, resolver: Callable[[str], set] = resolve
) -> Target:
    """Where to dial a node that advertised `advertised` (HOST:PORT, checked) in a call from `caller` (gRPC's
    peer, "ipv4:HOST:PORT" or "ipv6:[HOST]:PORT"): the module docstring's cases; `behind_proxy`: RELAYED's."""
    host, _, port = advertised.rpartition(":")
    source = _ip(peer_host(caller)) if caller.startswith(("ipv4:", "ipv6:")) else None
    if source is None:  # not over TCP (a unix socket): no address of the caller's to dial
        return Target(None, None, "PROXIED")
    named = _ip(host)
    if named == source:
        return Target(_join(source, port), advertised, "DIRECT")
    if source.is_loopback:
        return Target(advertised, advertised, "RELAYED") if behind_proxy else Target(None, None, "PROXIED")
    if named is None and source in resolver(host):
        return Target(_join(source, port), advertised, "NAME")
    return Target(_join(source, port), _join(source, port), "NAT")


def dial_back(address: str, token: str, caller_id: str, tls: TlsFiles | None = None, timeout_s: float = DIAL_BACK_S) -> bool:
    """Whether the Stage service at `address` answers a one-byte probe within timeout_s."""
    channel = make_channel(address, token, lambda: caller_id, tls)
    try:
        rpc.StageStub(channel).Probe(probe_chunks(1), timeout=timeout_s)
        return True
    except grpc.RpcError as e:
        log.debug("dial-back to %s failed: %s %s", address, e.code().name, e.details())
        return False
    finally:
        channel.close()


Dialler = Callable[[str, float], bool]
"""dial_back with the coordinator's token and TLS bound: (address, timeout_s) to whether it answered."""


@dataclass(frozen=True)
class DialedBack:
    """What the dial-back of a registering node found: the address that answered, or None."""

    reached: str | None

    @property
    def state(self) -> str:
        """DIRECT or UNREACHABLE."""
        return DIRECT if self.reached else UNREACHABLE
