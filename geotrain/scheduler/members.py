"""A run's member records: who a member is, where it stands in its lifecycle, and the types every part of the
coordinator that waits on members or refuses them shares."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.reachability import UNREACHABLE

EventSink = Callable[[str, dict], None]


@dataclass(frozen=True)
class Scope:
    """What a wait inside a plan epoch depends on: losing one of these nodes, or one reporting that it cannot take
    part in the epoch, fails the step at once."""

    epoch: int
    nodes: tuple[str, ...]
    # After this (monotonic; 0: never) the step is past what its plan allows: a node of it that a neighbour reports
    # failing in the epoch stalled it (judged then, not at the step timeout).
    stall_after: float = 0.0


class Rejected(Exception):
    """A registration the coordinator turns down, with the reason the node is told."""

    def __init__(self, reason: int, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Lifecycle(enum.Enum):
    """Where a member stands."""

    JOINED = "joined"  # registered; measuring itself
    PROFILED = "profiled"  # its profile is in; serves no stage
    LOADING = "loading"  # the plan gives it a stage; it is taking up the plan and its stage's state
    SERVING = "serving"  # runs the current plan with the committed state
    RESTARTED = "restarted"  # a new incarnation of a node the plan counts on: its old one's work is lost
    DEAD = "dead"


@dataclass
class Member:
    """A node that registered."""

    node_id: str
    address: str
    region: str
    joined_at: float
    last_seen: float
    lifecycle: Lifecycle = Lifecycle.JOINED
    plan_epoch: int = 0
    state_epoch: int = 0
    held: tuple[int, int] = (0, 0)  # layer range the node holds (0, 0: none)
    applied_steps: int = 0
    peer_id: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    links: list[pb.LinkCounter] = field(default_factory=list)
    microbatches_per_s: float = 0.0
    peak_memory_bytes: int = 0
    relayed_bytes: int = 0  # payload bytes it forwarded as a relay
    averaging_bytes_sent: int = 0  # replica averaging messages it sent, as its last heartbeat said
    profile: pb.NodeProfileReport | None = None  # the latest the node measured (scheduler.profiles reads it)
    beat_every: float = 0.0  # the heartbeat interval it was last told (0: the run's, from registration)
    failed_epoch: int = 0  # the plan epoch the node reported it cannot take part in (0: none)
    failure: str = ""  # why, as it reported
    public_key: bytes = b""  # the Ed25519 key its id belongs to; every call about it must be signed with it
    offences: int = 0  # its refused reports; scheduler.max_offences of them evict it
    reachability: str = ""  # the dial-back at registration: reachability.DIRECT or UNREACHABLE ("": not checked)
    relay_failures: int = 0  # relayed tensors it was reported not to deliver: plans relay through others first
    host: str = ""  # the host its registration came from (the gRPC peer; "": in process)
    planned: bool = False  # some plan gave it a stage
    died_at: float = 0.0  # when it was declared dead (forgotten scheduler.forget_after_s later)

    @property
    def unreachable(self) -> bool:
        """Nobody can dial it: its neighbours send to it over streams it opens."""
        return self.reachability == UNREACHABLE

    @property
    def alive(self) -> bool:
        """Not declared dead."""
        return self.lifecycle is not Lifecycle.DEAD

    @property
    def restarted(self) -> bool:
        """A new incarnation the current plan has not taken up yet."""
        return self.lifecycle is Lifecycle.RESTARTED
