"""Registration: the checks a Register request passes before Membership admits the node, the reply, and the wait
for a resumed plan's nodes to register again."""

from __future__ import annotations

import logging
from collections.abc import Callable

from geotrain import __version__
from geotrain.config import RunConfig, to_proto
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.version import PROTOCOL_VERSION
from geotrain.scheduler.errors import RunAborted
from geotrain.scheduler.membership import Membership, Rejected
from geotrain.scheduler.reachability import DialedBack

log = logging.getLogger(__name__)


class Registration:
    """Answers Register for one run. `plan_nodes`: the current plan's nodes (a returning one keeps its place);
    `over`: whether the run is over, when every registration is refused."""

    def __init__(
        self, cfg: RunConfig, run_id: str, membership: Membership, plan_nodes: Callable[[], set[str]],
        over: Callable[[], bool],
    ) -> None:
        self._cfg = cfg
        self._run_id = run_id
        self._membership = membership
        self._plan_nodes = plan_nodes
        self._over = over

    def register(
        self, request: pb.RegisterRequest, signer: bytes | None, dial_back: Callable[[], DialedBack] | None, host: str
    ) -> pb.RegisterReply:
        """Admit a node (new, or returning with the stage it holds), or say why not. `signer`: the key that signed
        the call (the RPC service passes it, b"" for an unsigned call), which must be the key the request carries;
        None in-process, where the request's key is taken as it is. `dial_back`: dials the node and says what it
        found (the RPC service's; None in-process: not dialled), called only for a request that passed every check
        (a token holder cannot make the coordinator dial for a refused one) and kept with the member from its first
        moment, so that no plan counts it before its reachability is known. `host`: the caller's IP (the limits on
        new ids and spares per host; "": in process, none)."""
        refusal = self._refusal(request, signer)
        if refusal is not None:
            return refusal
        try:
            member = self._membership.admit(request, self._plan_nodes(), dial_back, host)
        except Rejected as e:
            return pb.RegisterReply(accepted=False, reason=e.reason, message=str(e))
        reply = pb.RegisterReply(
            accepted=True,
            node_id=member.node_id,
            config=to_proto(self._cfg),
            heartbeat_interval_s=self._cfg.scheduler.heartbeat_interval_s,
            run_id=self._run_id,
        )
        if member.reachability:  # dialled: the address that answered is the member's
            reply.reachability = pb.REACHABILITY_UNREACHABLE if member.unreachable else pb.REACHABILITY_DIRECT
            reply.reachable_at = "" if member.unreachable else member.address
        return reply

    def screen(self, request: pb.RegisterRequest, signer: bytes | None, host: str) -> pb.RegisterReply | None:
        """The reply refusing a registration from `host` before any dial-back (register's own checks, and
        Membership.screen's: room, the host's pace of new ids), or None when it may be dialled."""
        refusal = self._refusal(request, signer)
        if refusal is not None:
            return refusal
        try:
            self._membership.screen(request, host)
        except Rejected as e:
            return pb.RegisterReply(accepted=False, reason=e.reason, message=str(e))
        return None

    def _refusal(self, request: pb.RegisterRequest, signer: bytes | None) -> pb.RegisterReply | None:
        if request.protocol_version != PROTOCOL_VERSION:
            return pb.RegisterReply(
                accepted=False,
                reason=pb.REJECT_REASON_PROTOCOL_VERSION,
                message=f"coordinator speaks protocol {PROTOCOL_VERSION} (geotrain {__version__}), "
                f"node speaks {request.protocol_version}",
            )
        if self._over():
            return pb.RegisterReply(accepted=False, reason=pb.REJECT_REASON_RUN_FINISHED, message="the run is over")
        if signer is not None and (not signer or signer != request.public_key):
            return pb.RegisterReply(
                accepted=False,
                reason=pb.REJECT_REASON_IDENTITY,
                message="a registration must carry the node's public key and be signed with it",
            )
        return None


def await_returning(membership: Membership, nodes: set[str], timeout_s: float) -> None:
    """On resume, give the restored plan's nodes a moment (scheduler.heartbeat_timeout_s) to register again and
    resend their profiles, as each does at once on its return: a plan made before they are all in would be made
    again as each one comes in (a plan epoch apiece). RunAborted only when the run is stopped meanwhile."""

    def back() -> bool:
        alive = membership.alive()
        return nodes <= {m.node_id for m in alive} and all(m.profile is not None for m in alive if m.held)

    try:
        membership.wait(back, "the plan's nodes to come back", timeout_s)
    except RunAborted:
        if membership.stop_requested.is_set():
            raise
        log.info("planning without every node of the last plan: not all came back within %.0fs", timeout_s)
