"""`geotrain status`: ask a coordinator for its Status and print it as a table, as JSON, or refreshed in place."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

import grpc
from google.protobuf import json_format

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.tls import TlsFiles, tls_mismatch
from geotrain.protocol.transport import make_channel

log = logging.getLogger(__name__)

STATUS_DEADLINE_S = 5.0
WATCH_INTERVAL_S = 1.0
# Cursor home, then clear the screen: the table is redrawn in place instead of scrolling.
_CLEAR = "\x1b[H\x1b[2J"
_EVENTS_SHOWN = 8


def status_dict(reply: pb.StatusReply) -> dict[str, Any]:
    """The JSON form of a StatusReply, shared by `geotrain status --json` and /api/status so they match."""
    return json_format.MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def fetch_status(address: str, token: str, tls: TlsFiles | None = None) -> pb.StatusReply:
    """One Status call to the coordinator at `address` (over TLS with the run's files, if given)."""
    channel = make_channel(address, token, lambda: "status", tls=tls)
    try:
        return rpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=STATUS_DEADLINE_S)
    finally:
        channel.close()


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *rows]]


# The step driver's phases (stepdriver.StepPhase) in words, as the status page (static/status.js) says them.
PHASE_WORDS = {
    "dispatched": "computing microbatches", "microbatches_done": "averaging gradients",
    "norms_in": "deciding the update", "decided": "applying the update", "applied": "committing the step",
    "committed": "step committed", "evaluating": "validating",
}


def render_status(reply: pb.StatusReply) -> str:
    """The human-readable status: run figures, plan, nodes, links and the latest events."""
    val = (
        f"  val {reply.val_loss:.4f} ({reply.val_bits_per_byte:.3f} bits/byte)"
        if any(p.has_val_loss for p in reply.history) else ""
    )
    eta = _duration(reply.eta_s) if reply.state == "training" and reply.step else "n/a"
    phase = f", {PHASE_WORDS[reply.phase]}" if reply.phase in PHASE_WORDS else ""
    lines = [
        f"run {reply.state}{phase}: step {reply.step}/{reply.steps}  loss {reply.loss:.4f}{val}  "
        f"{reply.tokens_per_s:,.0f} tokens/s  time left {eta}  failures {reply.failures}",
        f"plan epoch {reply.plan_epoch}: {len(reply.stages)} stage(s), bottleneck {reply.bottleneck or 'n/a'}",
    ]
    if reply.exactness:
        lines.append(reply.exactness)
    for s in reply.stages:
        lines.append(f"  stage {s.index}: layers {s.layer_start}-{s.layer_end - 1} on {', '.join(s.node_ids)}")
    lines.append("")
    rows = [
        [
            n.node_id,
            n.region,
            str(n.stage) if n.stage >= 0 else "-",
            f"{n.layer_start}-{n.layer_end - 1}" if n.stage >= 0 else "-",
            n.role,
            n.lifecycle or ("alive" if n.alive else "dead"),
            n.reachability or "-",
            f"{n.device} {n.precision}" if n.device else "-",
            f"{n.microbatches_per_s:.2f}",
            f"{n.last_heartbeat_s:.1f}s ago",
            _bytes(n.bytes_received),
            _bytes(n.bytes_sent),
            f"{n.compression_ratio:.2f}x",
        ]
        for n in reply.nodes
    ]
    header = ["NODE", "REGION", "STAGE", "LAYERS", "ROLE", "STATE", "REACH", "DEVICE", "MICROBATCHES/S", "HEARTBEAT", "IN", "OUT", "RATIO"]
    lines += _table(header, rows)
    if reply.links:
        lines.append("")
        rows = [
            [
                f"{link.src} -> {link.dst}",
                link.transport or "-",
                link.codec or "-",
                f"{link.bandwidth_mbps:.1f} Mbit/s" if link.bandwidth_mbps else "n/a",
                _bytes(link.wire_bytes),
                f"{link.compression_ratio:.2f}x",
            ]
            for link in reply.links
        ]
        lines += _table(["LINK", "TRANSPORT", "CODEC", "BANDWIDTH", "SENT", "RATIO"], rows)
    if reply.events:
        lines.append("")
        for e in reply.events[-_EVENTS_SHOWN:]:
            at = time.strftime("%H:%M:%S", time.localtime(e.at))
            lines.append(f"{at}  {e.kind:<10} {e.node_id:<10} {e.detail}".rstrip())
    return "\n".join(lines) + "\n"


def _error(address: str, e: grpc.RpcError, tls: TlsFiles | None) -> str:
    if e.code() == grpc.StatusCode.UNAVAILABLE:
        # gRPC says "unavailable" (Socket closed, handshake failed) for a TLS mismatch too, which retrying cannot fix.
        problem = tls_mismatch(address, tls)
        if problem is not None:
            return f"geotrain: cannot get status: the coordinator {problem}"
    return f"geotrain: cannot get status from {address}: {e.code().name}: {e.details()}"


def _snapshot(address: str, token: str, as_json: bool, tls: TlsFiles | None) -> str:
    reply = fetch_status(address, token, tls)
    return json.dumps(status_dict(reply)) + "\n" if as_json else render_status(reply)


def run_status(
    address: str, token: str, as_json: bool, watch: bool, out: TextIO = sys.stdout, tls: TlsFiles | None = None
) -> int:
    """Print the coordinator's status once, or every second until Ctrl+C with `watch`; returns the exit code."""
    if not watch:
        try:
            out.write(_snapshot(address, token, as_json, tls))
        except grpc.RpcError as e:
            print(_error(address, e, tls), file=sys.stderr, flush=True)
            return 1
        out.flush()
        return 0
    try:
        while True:
            try:
                text = _snapshot(address, token, as_json, tls)
            except grpc.RpcError as e:
                # A watched coordinator may be restarting: say so in place and keep polling.
                text = _error(address, e, tls) + "\n"
            out.write(_CLEAR + text)
            out.flush()
            time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        return 0
