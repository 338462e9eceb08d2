"""The node's operator view: a status line on a terminal, key=value log lines otherwise."""

from __future__ import annotations

import io
import logging

import pytest

from geotrain.config import RunConfig
from geotrain.node.agent import RateMeter
from geotrain.node.dataplane import DataPlane
from geotrain.node.progress import ProgressReporter, progress_fields
from geotrain.node.stage import StageRuntime
from geotrain.protocol import geotrain_pb2 as pb
from tests.conftest import wait_until


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Node:
    """The parts of an Agent the reporter reads."""

    def __init__(self) -> None:
        cfg = RunConfig()
        self.node_id, self.stage_index = "node-7", 1
        self.plan = pb.Plan(epoch=3)
        self.runtime = StageRuntime(cfg, 2, 4)
        self.runtime.applied_step = 11
        self.throughput = RateMeter()
        self.dataplane = DataPlane("token", lambda: "node-7")
        stats = self.dataplane.sent["node-8"]
        stats.raw_bytes, stats.wire_bytes, stats.codec = 4_000_000, 1_000_000, "int8:block=64"


def test_fields_summarise_the_node():
    fields = progress_fields(_Node())
    assert fields["stage"] == 1 and fields["layers"] == "2-3" and fields["steps"] == 12 and fields["epoch"] == 3
    assert fields["sent_bytes"] == 1_000_000 and fields["codec_ratio"] == 4.0 and fields["codecs"] == "int8:block=64"


@pytest.mark.timeout(20)
def test_terminal_gets_a_redrawn_status_line():
    out = _Terminal()
    reporter = ProgressReporter(_Node(), out, interval_s=0.05)
    reporter.start()
    wait_until(lambda: out.getvalue().count("\r") >= 2, 10, "two status lines", interval=0.02)
    reporter.stop()
    last = out.getvalue().rsplit("\r", 1)[1]
    assert "node-7  stage 1 (layers 2-3)  step 12" in last and "int8:block=64 4.0x" in last


@pytest.mark.timeout(20)
def test_log_lines_when_not_a_terminal(caplog):
    caplog.set_level(logging.INFO, logger="geotrain.node.progress")
    reporter = ProgressReporter(_Node(), io.StringIO(), log_every_s=0.05)
    reporter.start()
    wait_until(lambda: caplog.records, 10, "a progress log line", interval=0.02)
    reporter.stop()
    assert "progress node=node-7 epoch=3 stage=1 layers=2-3 steps=12" in caplog.records[0].getMessage()
