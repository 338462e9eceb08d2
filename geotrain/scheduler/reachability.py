"""The dial-back at registration: can anyone reach a node at the address it advertised, or at the address its call
came from? A node nobody can dial serves over connections it opens itself (Stage.Reverse), so the answer goes into
every plan."""

from __future__ import annotations

import ipaddress
import logging
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


def candidates(advertised: str, caller: str) -> list[str]:
    """The addresses to try: the advertised one, then the advertised port at the host the call came from (gRPC's
    "ipv4:HOST:PORT"), when that is another host (a node that advertised its LAN address behind a forwarded port).
    A call from loopback came through a proxy on the coordinator's host: dialling loopback would reach that host."""
    host, _, port = advertised.rpartition(":")
    seen = peer_host(caller)
    tried = [advertised]
    # gRPC writes the peer of a TCP call as ipv4:HOST:PORT or ipv6:[HOST]:PORT.
    tcp = caller.startswith(("ipv4:", "ipv6:"))
    if tcp and seen != host.strip("[]") and not ipaddress.ip_address(seen).is_loopback:
        tried.append(f"[{seen}]:{port}" if ":" in seen else f"{seen}:{port}")
    return tried


def dial_back(
    addresses: list[str], token: str, caller_id: str, tls: TlsFiles | None = None, timeout_s: float = DIAL_BACK_S
) -> str | None:
    """The first of `addresses` whose Stage service answers a one-byte probe within timeout_s, or None."""
    for address in addresses:
        channel = make_channel(address, token, lambda: caller_id, tls)
        try:
            rpc.StageStub(channel).Probe(probe_chunks(1), timeout=timeout_s)
            return address
        except grpc.RpcError as e:
            log.debug("dial-back to %s failed: %s %s", address, e.code().name, e.details())
        finally:
            channel.close()
    return None


Dialler = Callable[[list[str]], str | None]
"""dial_back with the coordinator's token and TLS bound: addresses to the one that answered."""


@dataclass(frozen=True)
class DialedBack:
    """What the dial-back of a registering node found: the address that answered, or None."""

    reached: str | None

    @property
    def state(self) -> str:
        """DIRECT or UNREACHABLE."""
        return DIRECT if self.reached else UNREACHABLE
