"""What a node shows its operator: a live status line on a terminal, structured log lines otherwise."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from geotrain.node.agent import Agent

log = logging.getLogger(__name__)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def progress_fields(agent: Agent) -> dict[str, object]:
    """The node's state in a few fields: identity, stage, steps, speed, traffic and compression."""
    runtime, plan = agent.runtime, agent.plan
    links = agent.dataplane.link_counters()
    raw = sum(link.raw_bytes for link in links)
    wire = sum(link.wire_bytes for link in links)
    return {
        "node": agent.node_id or "-",
        "epoch": plan.epoch if plan else 0,
        "stage": agent.stage_index,
        "layers": f"{runtime.start}-{runtime.end - 1}" if runtime else "-",
        "steps": runtime.applied_step + 1 if runtime else 0,
        "mb_per_s": round(agent.throughput.rate(), 2),
        "sent_bytes": wire,
        "received_bytes": agent.dataplane.totals()[1],
        "codec_ratio": round(raw / wire, 2) if wire else 1.0,
        "codecs": ",".join(sorted({link.codec for link in links if link.codec})) or "-",
    }


class ProgressReporter:
    """Every `interval_s`: redraws one status line on a terminal, or logs one `key=value` line when not attached."""

    def __init__(self, agent: Agent, stream: TextIO, interval_s: float = 1.0, log_every_s: float = 10.0) -> None:
        self.agent, self.stream = agent, stream
        self.tty = stream.isatty()
        self.interval_s = interval_s if self.tty else log_every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def start(self) -> None:
        """Start reporting."""
        self._thread.start()

    def stop(self) -> None:
        """Stop reporting (and end the status line)."""
        self._stop.set()
        self._thread.join(2)
        if self.tty:
            print(file=self.stream, flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            f = progress_fields(self.agent)
            if self.tty:
                stage = "spare" if f["stage"] == -1 else f"stage {f['stage']} (layers {f['layers']})"
                line = (
                    f"{f['node']}  {stage}  step {f['steps']}  {f['mb_per_s']} microbatches/s  "
                    f"sent {_mb(f['sent_bytes'])}  received {_mb(f['received_bytes'])}  "
                    f"codec {f['codecs']} {f['codec_ratio']}x  epoch {f['epoch']}"
                )
                print(f"\r\x1b[2K{line}", end="", file=self.stream, flush=True)
            else:
                log.info("progress %s", " ".join(f"{k}={v}" for k, v in f.items()))
