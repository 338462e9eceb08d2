"""A token holder attacks a live run, one attack after another: how many steps the run commits while it does.

An in-process coordinator (its status page in a process of its own, as `geotrain coordinator --http` runs it) and
three `geotrain join` processes train a tiny model on three stages of one node each (the run's own numbers: default
limits, scheduler.max_offences). An attacker in a process of its own at nice 19 (its Python shares no interpreter
lock with the coordinator's, and takes only the cores the run leaves idle, as its own machine would) holds the run
token and knows the plan, as every volunteer does; it asks Status where the run is ten times a second, and makes
each attack of issue 17 for a window, with the shared attack code of tests/attackers.py: id takeover, order-stream
theft, forged microbatch-done, gradient-norm and step-applied reports (as an outsider claiming a member's id, and as
a member of its own reporting what is not its own, again under a new id and key each time it is evicted),
activations and gradients claiming another node's path, profiles with extreme numbers (these one call after
another, each as soon as the last was answered), 200 idle streams at a node and 200 at the coordinator (each
opened again as soon as it ends), and the issue's floods at the issue's counts, each window: 1,000 registrations
and 3,000 status-page requests, in ten batches sent at once at even intervals. Then issue 30's, with identities of
its own (a new id and key whenever the last is evicted or would be): failure reports against each planned node, as
its member (which no plan used) and as an outsider claiming a planned node; each stage's checkpoint state asked as
that member; new ids one after another advertising a third host (a port on 127.0.0.2 that the bench counts
connections to), a tarpit of its own (127.0.0.1, accepting and never answering), or a port nobody serves (the fill
of fake ids, which never heartbeat); and 100 connections at each node's raw tensor stream port that never say their
hello, reopened as they are cut (the ports read from /proc: nothing is scanned). Halfway through every attack window
a volunteer on another network (source 127.1.0.1, through tests.attackers.SourceProxy) registers a new id. Last, each
in a run of its own (STALL_SETTINGS: four honest nodes, room for a second replica per stage, a 65 s step timeout),
a stage holder of the attacker's: a real node with a hook in its own process (tests.attackers.stall_tensors) that
the plan makes the second replica of stage 1, which answers the first tensor of each step at once and holds every
other one 64 s, just under the step timeout (stall_holder), or an hour (silent_holder); whenever the plan drops it,
it joins again under a new id with the same key from the same host.

Each attack gets --rounds attack windows and as many baseline windows without an attack, alternating (baseline
first in even rounds, the attack first in odd ones) so that a drift of the shared machine's load falls on both
alike; a second passes after each attack window before the next window starts. One JSON line per attack: attack;
steps_baseline and steps_during_attack (the medians of the steps committed in its windows without and with it);
ratio; windows_baseline and windows_during (every window's count); final_max_diff (the largest difference of any
parameter from train-local's at the first commit after the attack, fetched while the run is held there); evicted
(the members the coordinator evicted during the attack); honest_dead (the first plan's nodes declared dead);
honest_refused (the volunteer's registrations refused); bytes_to_attacker (bytes of state the attacker got);
third_host_connections (connections made to the host it named); answers (how the attacker's calls ended, by gRPC status,
registration reply or HTTP status; OK: a member's report about a step that was over when it arrived, which the
coordinator ignores). The stalling holders' lines add stalls (times its key was refused stages, each after a step
that timed out) and benched_s (how long each refusal was), step_timeouts, steps_while_benched (steps committed in
its windows while its key was refused stages), honest_benched and honest_offences (offences counted against the
honest nodes); their honest_refused is null: no volunteer joins those windows (with room for a second replica, one
that never serves would be planned too). The learning rate is constant after warm-up (train.min_lr = train.lr), so
train-local's parameters after step s are those of the long run after step s.
Run: PYTHONPATH=. flock /tmp/geotrain-cpu.lock python bench/attack.py [--window 5] [--rounds 3] [--attacks NAME,...]

This version, every attack, on the shared 2-core machine with other tests running beside it (--window 5 --rounds 3,
then the stalling holders at --window 60 --rounds 2), ratio of the medians, each with 0 honest nodes dead, 0 honest
registrations refused, 0 bytes of state to the attacker, 0 connections to the host it named and final_max_diff 0.0:
id takeover 0.97, order-stream theft 1.01, forged microbatch-done 0.99, forged gradient norm 1.03, forged
step-applied 1.01, forged tensors 0.99, extreme profiles 1.07, 200 idle streams 0.89, 3,000 status-page requests
0.88, forged failure reports 1.04, raw-port hold 0.95, checkpoint fetch 0.83, dial-back to a third host 0.99,
dial-back to a tarpit 1.0, fake-id fill 0.93, 1,000 registrations 0.93, stall_holder 0.83 and silent_holder 0.83
(3 stalls each, benched 20, 40 and 80 s, no step timeout, no honest node benched or given an offence).
Earlier versions:
Measured on the shared 2-core machine (3 nodes, the coordinator and the attacker on it, ~10 steps/s; --window 5 --rounds
3), ratio of the medians, every run ending where train-local does (final_max_diff 0.0): id takeover 1.08, order-stream
theft 1.0, forged microbatch-done 0.98, forged gradient norm 0.93, forged step-applied 0.94, forged tensors 1.02,
extreme profiles 0.90, 1,000 registrations 0.95 (these before the per-connection cap below); 200 idle streams 0.93, 0.83
and 0.82 (three runs) since a node's server takes at most 16 streams a connection
(transport.NODE_STREAMS_PER_CONNECTION: HTTP/2 keeps the rest from its Python, refused UNAVAILABLE or held by the
client), 0.66 and 0.56 before it (the node's share alone 0.73, the coordinator's 0.85): the node's sync server answered
each of ~200 refused streams a second in Python (auth, limits, a worker) under the interpreter lock its compute needs,
while the coordinator's grpc.aio server holds its refusals by the backoff without a thread (its ~130 refusals a second
are what is left); 3,000 status-page requests 0.93, 0.90 and 0.86 (three runs, nothing changed for it; the last at ~16
steps/s with 6,000 a window, see below). The page costs the coordinator nothing a request (its process gets one snapshot
a second, the coordinator renders from SQLite at most twice a second whoever asks): what is left is CPU on the shared
cores, ~0.2 of a core for the page's process at nice 10 answering ~600 requests a second (nearly all 429) and ~0.15 for
the attacker's clients. A window may carry more than its 3,000: when its ten batches end early the attack starts again.
Issue 30's attacks (--window 5 --rounds 3, ~30 steps/s), ratio of the medians, each with 0 honest nodes dead, 0
honest registrations refused, 0 bytes of state to the attacker, 0 connections to the host it named and
final_max_diff 0.0: forged failure reports 1.03, raw-port hold 0.92 (0.61 before a host's new connections past 20 a
second were closed at accept, without a thread), checkpoint fetch 0.95, dial-back to a third host 0.95 (0.79 and 0.82
at --window 4 --rounds 2 before refusals for room were held by the backoff), dial-back to a tarpit 1.07, fake-id fill
0.95. In one longer run three steps timed out at the step timeout (120 s): a data head past limits.calls_per_s (200
calls a second) at ~30 steps/s had a MicrobatchDone refused RESOURCE_EXHAUSTED, which it does not retry.
The stalling holders (--attacks stall_holder,silent_holder --window 60 --rounds 2), 4 honest nodes at ~27 steps/s,
each run ending where train-local does (final_max_diff 0.0), no honest node dead, refused stages or given an offence:
{"attack": "stall_holder", "steps_during_attack": 1320.5, "steps_baseline": 1610.0, "ratio": 0.82, "windows_during":
[1223, 1418], "windows_baseline": [1614, 1606], "stalls": 3, "benched_s": [20.0, 40.0, 80.0], "step_timeouts": 0,
"steps_while_benched": 2590, "honest_benched": 0, "honest_offences": 0, ...} and {"attack": "silent_holder",
"steps_during_attack": 1270.0, "steps_baseline": 1615.5, "ratio": 0.79, "stalls": 3, "benched_s": [20.0, 40.0, 80.0],
"step_timeouts": 0, "honest_offences": 0, ...}. Each stall cost 5.0 s (the neighbour's call deadline, the plan's
5 s floor, then the step failed at once and the next plan went around the holder 0.1 s later; node logs), and no step
reached its timeout; the rest of the gap is the attacker's five node processes (joins, profiling) on the shared
cores. Before plans named their calls' deadline the first call to the holder waited half the step timeout (32 s,
ratios 0.38 and 0.35 at the same settings), and before that a holder that answered just under the step timeout was
never refused stages (each stall held a step ~64 s) while its neighbour's true report counted as the neighbour's
offence.
Before the backoff and the page's process (10 s windows, one each): 0.30x for the page, 0.58-0.84x for forged tensors,
0.72x for idle streams.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from geotrain.config import RunConfig, load_config
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import TOKEN_ENV
from geotrain.protocol.identity import NodeKey
from geotrain.scheduler import placement
from geotrain.scheduler.http import StatusPageProcess
from geotrain.scheduler.service import fetch_model_state
from geotrain.protocol.version import PROTOCOL_VERSION
from tests.attackers import (
    ATTACKER, Attacker, CountingListener, IdleStreams, SourceProxy, answer, extreme_profiles, flood_status_page,
    forged_report, forged_tensors, hooked_node, register_many, stall_tensors,
)
from tests.conftest import local_cluster, max_diff, train_local_state

from control_plane import HelperProcess  # a sibling: run as bench/attack.py

NODES = 3
SETTINGS = [
    "run.steps=100000", "run.eval_every=0", "scheduler.placement=uniform", f"scheduler.stages={NODES}",
    "scheduler.replicas=1", "scheduler.heartbeat_interval_s=0.5", "scheduler.heartbeat_timeout_s=2.5",
    "profile.layer_repeats=1", "model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.seq_len=16",
    "train.microbatch_size=2", "train.microbatches=4",
]
# The stalling holder's run: room for a second replica of each stage, so that the plan gives a node that joins a stage,
# and a fourth honest node, the second replica of stage 0, so that the node that joins is the second of stage 1, which
# every microbatch may be routed through (a data head gets microbatches by its speed: a stalling one is given none).
# A 65 s step timeout, which stall_holder's 64 s hold stays under. A first refusal of stages of 20 s (the run's
# default is 60 s) lets a window show it double. The call rate limit is lifted: at ~30 steps/s a data head's report
# past it is refused and not retried, a step timeout that is not this attack's.
STALL_SETTINGS = ["scheduler.replicas=2", "scheduler.step_timeout_s=65", "scheduler.stall_refusal_s=20",
                  "limits.calls_per_s=1000", "limits.call_burst=2000"]
# How long each stalling holder holds a tensor: stall_holder just under the step timeout, so that the step commits in
# time; silent_holder past it (it answers the first tensor of each step and never the rest in time).
_STALL_HOLD_S = {"stall_holder": 64.0, "silent_holder": 3600.0}
# The attacker asks the coordinator where the run is (Status) at most this often.
_STATUS_EVERY_S = 0.1
# After an attack window, this long passes before the next window starts.
_SETTLE_S = 1.0
# The floods (registrations, status-page requests) send the count in each window, in this many batches.
_BATCHES = 10


# -- the attacker (a process of its own: `attack.py --attacker ADDRESS`) ----------------------------------------


class Siege:
    """One attacker's view of the run and its rounds of attacks; each round returns how its calls ended."""

    def __init__(self, attacker: Attacker, plan: pb.Plan, profile: pb.NodeProfileReport, status_port: int,
                 max_offences: int, shape: tuple[int, int, int]) -> None:
        self.a = attacker
        self.plan = plan
        self.shape = shape  # an activation's: microbatch size, sequence length, model width
        self.profile = profile  # a member's honest profile, the base of the extreme ones
        self.status_port = status_port
        self.max_offences = max_offences
        self.step, self.epoch, self._asked_at = 0, plan.epoch, 0.0
        self.registered = 0  # ids register_many and _register_new used so far
        self.third_host = ""  # a port on 127.0.0.2 the bench counts connections to
        self.stream_ports: list[int] = []  # the nodes' raw tensor stream ports
        self.tarpit = CountingListener("127.0.0.1", hold=True)
        self._member: tuple[str, NodeKey] | None = None
        self._members = 0
        self._offences = 0

    def where(self) -> None:
        """The step in progress, from the coordinator's status (what any token holder may ask)."""
        if time.monotonic() - self._asked_at >= _STATUS_EVERY_S:
            status = self.a.coordinator(None, "").Status(pb.StatusRequest(), timeout=10)
            self.step, self.epoch = status.step, status.plan_epoch
            self._asked_at = time.monotonic()

    def member(self) -> tuple[str, NodeKey] | None:
        """The attacker's own member, registered with a key of its own; a new one once the last may be evicted (None
        while the coordinator admits no new id from this host)."""
        if self._member is None or self._offences >= self.max_offences:
            self._members += 1
            node_id, key = f"{ATTACKER}-{os.getpid()}-{self._members}", NodeKey.generate()
            try:
                if not self.a.register(node_id, key).accepted:
                    return None
            except grpc.RpcError:  # over the host's registration rate
                return None
            self._member, self._offences = (node_id, key), 0
        return self._member

    def _as_member(self, call: Callable[[rpc.CoordinatorStub, str], object]) -> grpc.StatusCode:
        """call(stub, node id) as the attacker's member; its refusals count towards the member's eviction. Without a
        member (no new id admitted): RESOURCE_EXHAUSTED."""
        member = self.member()
        if member is None:
            return grpc.StatusCode.RESOURCE_EXHAUSTED
        node_id, key = member
        code = answer(lambda: call(self.a.coordinator(key, node_id), node_id))
        self._offences += code != grpc.StatusCode.OK
        return code

    def id_takeover(self, _until: float) -> Counter[str]:
        """Register a member's id with the attacker's key, carrying that key, then the member's public key."""
        victim = self.plan.stages[0]
        replies = Counter()
        for public_key in (self.a.outsider.public, victim.public_keys[0]):
            try:
                reply = self.a.register(victim.node_ids[0], self.a.outsider, public_key)
            except grpc.RpcError as e:  # over the host's registration rate
                replies[e.code().name] += 1
            else:
                replies[pb.RejectReason.Name(reply.reason) if not reply.accepted else "accepted"] += 1
        return replies

    def order_stream_theft(self, _until: float) -> Counter[str]:
        """Open a member's order stream and heartbeat as it, signed by the attacker's key and unsigned."""
        victim = self.plan.stages[1].node_ids[0]
        codes = Counter()
        for key in (self.a.outsider, None):
            stub = self.a.coordinator(key, victim)
            codes[answer(lambda: next(stub.Orders(pb.OrdersRequest(node_id=victim), timeout=10))).name] += 1
            codes[answer(lambda: stub.Heartbeat(pb.HeartbeatRequest(node_id=victim), timeout=10)).name] += 1
        return codes

    def _forged(self, method: str, victim: str) -> Counter[str]:
        """`method` reports about `victim` signed by the outsider's key; then the attacker's member's own."""
        self.where()
        path = [s.node_ids[0] for s in self.plan.stages]
        request = forged_report(method, victim, self.step, self.epoch, path)
        stub = self.a.coordinator(self.a.outsider, victim)
        codes = Counter([answer(lambda: getattr(stub, method)(request, timeout=10)).name])
        member = self.member()
        member_path = [member[0] if member else ATTACKER, *path[1:]]
        codes[self._as_member(lambda s, me: getattr(s, method)(
            forged_report(method, me, self.step, self.epoch, member_path), timeout=10)).name] += 1
        return codes

    def forged_microbatch_done(self, _until: float) -> Counter[str]:
        """Microbatch 0 reported done, as the data head and as the attacker's member."""
        return self._forged("MicrobatchDone", self.plan.stages[0].node_ids[0])

    def forged_grad_norm(self, _until: float) -> Counter[str]:
        """A huge gradient norm, as stage 1's node and as the attacker's member."""
        return self._forged("GradNorm", self.plan.stages[1].node_ids[0])

    def forged_step_applied(self, _until: float) -> Counter[str]:
        """A wrong checksum for the step, as stage 2's node and as the attacker's member."""
        return self._forged("StepApplied", self.plan.stages[2].node_ids[0])

    def forged_tensors(self, _until: float) -> Counter[str]:
        """Activations and gradients claiming the plan's own senders, signed by the attacker's key and unsigned."""
        self.where()
        codes = Counter()
        for method, (address, sender, chunks) in forged_tensors(self.plan, self.step, self.shape).items():
            for key in (self.a.outsider, None):
                stub = self.a.stage(address, key, sender)
                codes[answer(lambda: getattr(stub, method)(iter(chunks), timeout=10)).name] += 1
        return codes

    def extreme_profile(self, _until: float) -> Counter[str]:
        """Profiles with extreme numbers, as the attacker's member."""
        codes = Counter()
        for report in extreme_profiles(self.profile, self.plan.stages[0].node_ids[0]):
            codes[self._as_member(lambda s, me: s.ReportProfile(_as(report, me), timeout=10)).name] += 1
        return codes

    def idle_streams(self, until: float) -> Counter[str]:
        """200 silent Forward streams at stage 1's node and 200 Probe streams at the coordinator, until `until`."""
        node = self.a.stage(self.plan.stages[1].addresses[0], self.a.outsider, ATTACKER)
        coordinator = self.a.coordinator(self.a.outsider, ATTACKER)
        streams = [IdleStreams(lambda it: node.Forward.future(it, timeout=60), 200),
                   IdleStreams(lambda it: coordinator.Probe.future(it, timeout=60), 200)]
        time.sleep(max(0.0, until - time.monotonic()))
        for s in streams:
            s.stop()
        return Counter({f"{where} {code.name}": n for where, s in zip(("node", "coordinator"), streams)
                        for code, n in s.ended.items()})

    def forged_failure_reports(self, _until: float) -> Counter[str]:
        """Reports that each planned node's calls fail, as the attacker's member (which no plan used, so it calls
        nobody) and as the outsider claiming another planned node (issue 30: one such report once killed a node)."""
        self.where()
        codes = Counter()
        planned = [s.node_ids[0] for s in self.plan.stages]
        for victim in planned:
            report = lambda me: pb.FailureReport(node_id=me, peer=victim, plan_epoch=self.epoch,  # noqa: E731
                                                 detail="DEADLINE_EXCEEDED")
            codes[f"member {self._as_member(lambda s, me: s.ReportFailure(report(me), timeout=10)).name}"] += 1
            claimed = next(n for n in planned if n != victim)
            stub = self.a.coordinator(self.a.outsider, claimed)
            codes[f"outsider {answer(lambda: stub.ReportFailure(report(claimed), timeout=10)).name}"] += 1
        return codes

    def raw_port_hold(self, until: float) -> Counter[str]:
        """100 connections at each node's raw tensor stream port that never say their hello, each opened again as
        soon as the node closes it, until `until`."""
        held = {port: [] for port in self.stream_ports}
        closed = Counter()
        while time.monotonic() < until:
            for port, socks in held.items():
                for sock in [s for s in socks if _closed(s)]:
                    socks.remove(sock)
                    sock.close()
                    closed["cut"] += 1
                while len(socks) < 100:
                    try:
                        socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                    except OSError:
                        closed["refused"] += 1
                        break
            time.sleep(0.1)
        for socks in held.values():
            for sock in socks:
                sock.close()
        return closed

    def _register_new(self, advertised: str) -> str:
        """Register a new id with a new key, advertising `advertised`: how it ended."""
        self.registered += 1
        key = NodeKey.generate()
        request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=f"{ATTACKER}-new-{self.registered}",
                                     address=advertised, public_key=key.public)
        try:
            reply = self.a.coordinator(key, request.node_id).Register(request, timeout=30)
        except grpc.RpcError as e:
            return e.code().name
        return "accepted" if reply.accepted else pb.RejectReason.Name(reply.reason)

    def fake_id_fill(self, _until: float) -> Counter[str]:
        """New ids under new keys, one after another, each never heartbeating: the run's room for volunteers."""
        return Counter([self._register_new("127.0.0.1:9")])

    def dial_back_third_host(self, _until: float) -> Counter[str]:
        """New ids advertising a third host's port (127.0.0.2, where the bench counts connections)."""
        return Counter([self._register_new(self.third_host)])

    def dial_back_tarpit(self, _until: float) -> Counter[str]:
        """New ids advertising a port of the attacker's host that accepts and never answers."""
        return Counter([self._register_new(self.tarpit.address)])

    def checkpoint_fetch(self, _until: float) -> Counter[str]:
        """Each stage's state at the step in progress, asked by the attacker's member (never planned, never ordered
        to load): the bytes of state it got are counted."""
        self.where()
        codes = Counter()
        for stage in self.plan.stages:
            request = pb.FetchCheckpointRequest(layer_start=stage.layer_start, layer_end=stage.layer_end,
                                                steps_done=self.step)
            got = []
            codes[self._as_member(lambda s, me: got.extend(
                len(c.data) for c in s.FetchCheckpoint(request, timeout=10))).name] += 1
            codes["state bytes"] += sum(got)
        return codes

    def registrations(self, until: float) -> Counter[str]:
        """1,000 registrations of new ids in the window, in batches sent at once."""
        def batch() -> Counter[str]:
            outcomes = register_many(self.a.coordinator(None, ""), 1000 // _BATCHES, first=self.registered)
            self.registered += 1000 // _BATCHES
            return outcomes

        return _paced(until, batch)

    def status_page(self, until: float) -> Counter[str]:
        """3,000 status-page requests in the window, in batches of four clients at once."""
        return _paced(until, lambda: Counter(
            {str(code): n for code, n in flood_status_page(self.status_port, 3000 // _BATCHES).items()}))


def _closed(sock: socket.socket) -> bool:
    """Whether the other end closed `sock` (nothing is ever sent on it)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its sockets' inodes in /proc/PID/fd, found in /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _paced(until: float, batch: Callable[[], Counter[str]]) -> Counter[str]:
    """batch() _BATCHES times, started at even intervals until `until` (at once after one that ran late)."""
    outcomes: Counter[str] = Counter()
    interval = (until - time.monotonic()) / _BATCHES
    for i in range(_BATCHES):
        time.sleep(max(0.0, until - (_BATCHES - i) * interval - time.monotonic()))
        outcomes += batch()
    return outcomes


def _as(report: pb.NodeProfileReport, node_id: str) -> pb.NodeProfileReport:
    report.node_id = node_id
    return report


# In the order they run: the registrations last, since the members they add stay listed.
ATTACKS = ["id_takeover", "order_stream_theft", "forged_microbatch_done", "forged_grad_norm", "forged_step_applied",
           "forged_tensors", "extreme_profile", "idle_streams", "status_page", "forged_failure_reports", "raw_port_hold",
           "checkpoint_fetch", "dial_back_third_host", "dial_back_tarpit", "fake_id_fill", "registrations",
           "stall_holder", "silent_holder"]
# Attacks that need a run of their own: its settings on top of SETTINGS, and its honest nodes.
OWN_RUN = {name: (STALL_SETTINGS, NODES + 1) for name in _STALL_HOLD_S}


def serve_attacks(address: str, token: str) -> None:
    """Take one JSON command a line on stdin (the plan, a profile, then which attack for how long); answer each
    attack with one JSON line of how its calls ended."""
    attacker = Attacker(address, token)
    siege: Siege | None = None
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if "plan" in command:
                siege = Siege(attacker, pb.Plan.FromString(bytes.fromhex(command["plan"])),
                              pb.NodeProfileReport.FromString(bytes.fromhex(command["profile"])),
                              command["status_port"], command["max_offences"], tuple(command["shape"]))
                siege.third_host, siege.stream_ports = command["third_host"], command["stream_ports"]
                answers: Counter[str] = Counter()
            else:
                assert siege is not None
                until = time.monotonic() + command["seconds"]
                attack = getattr(siege, command["attack"])
                answers = Counter()
                while time.monotonic() < until:
                    answers += attack(until)
            sys.stdout.write(json.dumps(dict(answers)) + "\n")
            sys.stdout.flush()
    finally:
        if siege is not None:
            siege.tarpit.close()
        attacker.close()


# -- the run and the measurement ------------------------------------------------------------------------------


def stream_ports(cluster) -> list[int]:
    """The plan's nodes' raw tensor stream ports: what each node's process listens on besides its gRPC port (an
    attacker on the network finds them by a port scan; here, nothing is scanned)."""
    ports = []
    for stage in cluster.coordinator.plan.stages:
        grpc_port = int(stage.addresses[0].rpartition(":")[2])
        ports += sorted(listening_ports(cluster.nodes.procs[stage.node_ids[0]].pid) - {grpc_port})
    return ports


class HonestVolunteer:
    """A volunteer on another network (source 127.1.0.1, through a SourceProxy) that registers a new id of its own
    now and then during the attacks; counts the registrations the coordinator refused."""

    def __init__(self, coordinator: str, token: str) -> None:
        self._proxy = SourceProxy(coordinator, "127.1.0.1")
        self._a = Attacker(self._proxy.address, token)
        self.joined = self.refused = 0

    def join(self) -> None:
        """Register one more new id, advertising a port nobody listens on (it serves over streams it opens)."""
        self.joined += 1
        node_id, key = f"volunteer-{self.joined}", NodeKey.generate()
        request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, node_id=node_id, address="127.1.0.1:9",
                                     public_key=key.public)
        try:
            accepted = self._a.coordinator(key, node_id).Register(request, timeout=30).accepted
        except grpc.RpcError:
            accepted = False
        self.refused += not accepted

    def close(self) -> None:
        self._a.close()
        self._proxy.close()


class StallingHolder:
    """The token holder's stage holder: a real node (`geotrain join` in a process of its own, at the priority the
    run's nodes have, as its own machine would run it) with stall_tensors' hook, holding each step's tensors but the
    first for a while. Whenever the plan drops it, it leaves and joins again under a new id with the same key (its
    state dir) from the same host."""

    def __init__(self, coordinator: str, token: str, log_dir: Path) -> None:
        self._coordinator, self._token, self._log_dir = coordinator, token, log_dir
        self.ids: list[str] = []
        self._node = None

    def attack(self, plan: Callable[[], pb.Plan], hold_s: float, until: float) -> Counter[str]:
        """Hold a stage whenever the plan gives it one, holding tensors hold_s, until `until`; then leave. Counts its
        ids and the plans that gave it a stage."""
        planned, counts = False, Counter()
        while time.monotonic() < until:
            if self._node is None:
                self.ids.append(f"{ATTACKER}-stall-{len(self.ids) + 1}")
                self._node = hooked_node(stall_tensors, hold_s, self.ids[-1], self._coordinator, self._token,
                                         self._log_dir, self._log_dir / ATTACKER)
                planned, counts["ids"] = False, counts["ids"] + 1
            in_plan = self.ids[-1] in placement.plan_nodes(plan())
            counts["planned"] += in_plan and not planned
            if planned and not in_plan:
                self.leave()
            planned = planned or in_plan
            time.sleep(0.1)
        self.leave()
        return counts

    def leave(self) -> None:
        """Stop the node (SIGTERM, then its process group SIGKILLed after 5 s: the hook may hold a thread)."""
        if self._node is not None:
            self._node.terminate()
            try:
                self._node.wait(5)
            except subprocess.TimeoutExpired:  # or its exit code was reaped elsewhere: the group goes either way
                pass
            try:
                os.killpg(self._node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._node = None


class Run:
    """The run's commits as they happen, and its parameters fetched at the first commit after `hold()`."""

    def __init__(self) -> None:
        self.commits: list[float] = []
        self.events: list[tuple[float, str, dict]] = []  # (when, kind, data): benched members and failed steps
        self.first = threading.Event()
        self.fetch: Callable[[], tuple[int, dict[str, torch.Tensor]]] | None = None
        self._held: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._want = threading.Event()
        self._got = threading.Event()

    def on_event(self, kind: str, data: dict) -> None:
        """The coordinator's event sink (its run loop waits while a hold fetches the parameters)."""
        if kind in ("benched", "failure"):
            self.events.append((time.monotonic(), kind, data))
        if kind != "step":
            return
        self.commits.append(time.monotonic())
        self.first.set()
        if self._want.is_set() and self.fetch is not None:
            self._want.clear()
            self._held.append(self.fetch())
            self._got.set()

    def steps_in(self, since: float, until: float) -> int:
        """Steps committed in [since, until]."""
        return sum(since <= t <= until for t in self.commits)

    def hold(self, timeout: float) -> tuple[int, dict[str, torch.Tensor]]:
        """(steps done, parameters) at the next commit."""
        self._got.clear()
        self._want.set()
        if not self._got.wait(timeout):
            raise RuntimeError(f"no step committed in {timeout} s")
        return self._held[-1]


def measure(cfg: RunConfig, names: list[str], window_s: float, rounds: int, log_dir: Path, nodes: int) -> list[dict]:
    """Run the attacks one after another on one run of `nodes` honest nodes, each for `rounds` attack windows and as
    many baseline windows; a row per attack, with (steps, parameters) after it."""
    run = Run()
    rows: list[dict] = []
    with local_cluster(cfg, nodes, log_dir, on_event=run.on_event) as cluster:
        c = cluster.coordinator
        run.fetch = lambda: (c.step, fetch_model_state(c.plan, cluster.token, c.step, c.key))
        page = StatusPageProcess(c.status, "127.0.0.1:0")
        env = {**os.environ, TOKEN_ENV: cluster.token, "OMP_NUM_THREADS": "1"}
        # At nice 19: on a network the attacker's own work is its own machine's, here it takes only what the run
        # leaves of the cores; what its calls cost the run's processes is what is measured.
        attacker = HelperProcess(
            ["nice", "-n", "19", sys.executable, __file__, "--attacker", f"127.0.0.1:{cluster.port}"], env
        )
        try:
            if not run.first.wait(300):
                raise RuntimeError(f"no step committed in 300 s; node logs in {log_dir}")
            first = c.plan.stages[0].node_ids[0]
            honest_nodes = set(placement.plan_nodes(c.plan))
            third = CountingListener("127.0.0.2")
            volunteer = HonestVolunteer(f"127.0.0.1:{cluster.port}", cluster.token)
            attacker.ask(json.dumps({"plan": c.plan.SerializeToString().hex(), "status_port": page.start(),
                          "profile": c.members[first].profile.SerializeToString().hex(),
                          "max_offences": cfg.scheduler.max_offences, "third_host": third.address,
                          "stream_ports": stream_ports(cluster),
                          "shape": [cfg.train.microbatch_size, cfg.model.seq_len, cfg.model.d_model]}))
            stalling = StallingHolder(f"127.0.0.1:{cluster.port}", cluster.token, log_dir)
            for name in names:
                started, began = time.time(), time.monotonic()  # events are stamped with the wall clock
                dialled, refused = third.connections, volunteer.refused
                baselines, during, answers, windows = [], [], Counter(), []
                for i in range(rounds):
                    # Baseline and attack windows alternate, each first in every other round, so that a drift of
                    # the machine's load falls on both alike.
                    for attacking in (False, True) if i % 2 == 0 else (True, False):
                        since = time.monotonic()
                        if attacking and name in _STALL_HOLD_S:
                            # No volunteer joins: with room for a second replica, one that never serves would be
                            # planned as well.
                            answers += stalling.attack(lambda: c.plan, _STALL_HOLD_S[name], since + window_s)
                            during.append(run.steps_in(since, since + window_s))
                            windows.append((since, since + window_s))
                            time.sleep(_SETTLE_S)
                        elif attacking:
                            # A volunteer from another network joins mid-window, as the attack goes on.
                            joining = threading.Timer(window_s / 2, volunteer.join)
                            joining.start()
                            answers += attacker.ask(json.dumps({"attack": name, "seconds": window_s}))
                            during.append(run.steps_in(since, since + window_s))
                            joining.join()
                            time.sleep(_SETTLE_S)  # what the attack left (streams being cut) is not the baseline's
                        else:
                            time.sleep(window_s)
                            baselines.append(run.steps_in(since, since + window_s))
                if cluster.result:
                    raise RuntimeError(f"the run ended during the attacks: {cluster.result}") from cluster.result.get(
                        "error")
                steps, state = run.hold(120)
                events = [(kind, node) for at, kind, node, _ in c.store.events(limit=10**6) if at >= started]
                row = {"attack": name, "during": during, "baselines": baselines, "steps": steps,
                       "state": state, "evicted": sum(kind == "evicted" for kind, _ in events),
                       "honest_dead": sum(kind == "dead" and node in honest_nodes for kind, node in events),
                       "honest_refused": volunteer.refused - refused,
                       "bytes_to_attacker": answers.pop("state bytes", 0),
                       "third_host_connections": third.connections - dialled, "answers": dict(answers)}
                if name in _STALL_HOLD_S:
                    offences = {n: c.members[n].offences for n in honest_nodes if n in c.members}
                    row |= stalls(run, began, set(stalling.ids), windows) | {"honest_offences": sum(offences.values())}
                rows.append(row)
            third.close()
            volunteer.close()
        finally:
            attacker.close()
            page.stop()
    return rows


def stalls(run: Run, since: float, attacker_ids: set[str], windows: list[tuple[float, float]]) -> dict:
    """What the stalling holder cost and how its refusals grew: stalls (times its key was refused stages, each
    after a step timed out) with benched_s (each refusal's length), step_timeouts (steps that failed on their
    timeout), steps_while_benched (steps committed in the attack windows while its key was refused stages),
    honest_benched (refusals of the honest nodes' keys); honest_refused is None: no volunteer joined."""
    events = [(at, kind, data) for at, kind, data in run.events if at >= since]
    benched = [(at, data) for at, kind, data in events if kind == "benched"]
    refused = [(at, at + data["seconds"]) for at, data in benched if data["node_id"] in attacker_ids]
    while_benched = [t for t in run.commits for start, end in windows if start <= t <= end
                     and any(a <= t <= b for a, b in refused)]
    return {"stalls": len(refused), "benched_s": [round(b - a, 1) for a, b in refused],
            "step_timeouts": sum(kind == "failure" and "timed out" in data["why"] for _, kind, data in events),
            "steps_while_benched": len(while_benched),
            "honest_benched": sum(data["node_id"] not in attacker_ids for _, data in benched), "honest_refused": None}


def main() -> None:
    """Measure each attack, or (--attacker) be the attacker's process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=5.0, help="seconds of each window, with or without an attack")
    parser.add_argument("--rounds", type=int, default=3, help="windows with each attack, and as many without")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated, of: " + ", ".join(ATTACKS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run config overrides")
    parser.add_argument("--log-dir", help="keep the nodes' logs here (default: a temporary directory, removed)")
    parser.add_argument("--attacker", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.attacker:
        serve_attacks(args.attacker, os.environ[TOKEN_ENV])
        return
    names = args.attacks.split(",")
    if unknown := set(names) - set(ATTACKS):
        parser.error(f"unknown attacks: {', '.join(sorted(unknown))}")
    lr = load_config(None, [*SETTINGS, *args.set]).train.lr
    cfg = load_config(None, [*SETTINGS, f"train.min_lr={lr!r}", *args.set])
    # The attacks that share the run first, then each that needs a run of its own (their settings change no step's
    # arithmetic: train-local is the same).
    runs = [(cfg, [n for n in names if n not in OWN_RUN], NODES)]
    runs += [(load_config(None, [*SETTINGS, f"train.min_lr={lr!r}", *OWN_RUN[n][0], *args.set]), [n], OWN_RUN[n][1])
             for n in names if n in OWN_RUN]
    rows = []
    with tempfile.TemporaryDirectory(prefix="geotrain-bench-") as tmp:
        for i, (run_cfg, run_names, nodes) in enumerate(r for r in runs if r[1]):
            log_dir = Path(args.log_dir or tmp) / str(i)
            log_dir.mkdir(parents=True, exist_ok=True)
            rows += measure(run_cfg, run_names, args.window, args.rounds, log_dir, nodes)
    # train-local to each held step (the learning rate does not depend on run.steps, see above).
    reference: dict[int, dict[str, torch.Tensor]] = {}
    for steps in sorted({row["steps"] for row in rows}):
        reference[steps] = train_local_state(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, steps=steps)))
    for row in rows:
        during, baseline = statistics.median(row["during"]), statistics.median(row["baselines"])
        print(json.dumps({
            "attack": row["attack"], "steps_during_attack": during, "steps_baseline": baseline,
            "ratio": round(during / baseline, 2) if baseline else None, "windows_during": row["during"],
            "windows_baseline": row["baselines"], "final_max_diff": max_diff(row["state"], reference[row["steps"]]),
            "evicted": row["evicted"], "honest_dead": row["honest_dead"], "honest_refused": row["honest_refused"],
            "bytes_to_attacker": row["bytes_to_attacker"], "third_host_connections": row["third_host_connections"],
            "answers": row["answers"],
            **{k: row[k] for k in ("stalls", "benched_s", "step_timeouts", "steps_while_benched", "honest_benched",
                                   "honest_offences") if k in row},
        }), flush=True)


if __name__ == "__main__":
    main()
