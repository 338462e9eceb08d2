"""Nodes nobody can dial (behind NAT): the coordinator's dial-back at registration, and links that run over streams the
unreachable node opens (node/reverse.py), equal to train-local."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from geotrain.config import load_config
from geotrain.scheduler.reachability import candidates
from geotrain.scheduler.service import fetch_stage_state
from tests.conftest import local_cluster, max_diff, train_local_state


@contextmanager
def dead_port() -> Iterator[int]:
    """A loopback port that refuses connections while the block runs: bound, never listening, so no one takes it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def free_port() -> int:
    """A loopback port nobody listens on now (the node binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dial_back_tries_the_advertised_address_then_where_the_call_came_from():
    assert candidates("192.168.1.5:7100", "ipv4:203.0.113.9:51234") == ["192.168.1.5:7100", "203.0.113.9:7100"]
    assert candidates("203.0.113.9:7100", "ipv4:203.0.113.9:51234") == ["203.0.113.9:7100"]
    assert candidates("[fd00::5]:7100", "ipv6:[2001:db8::9]:4000") == ["[fd00::5]:7100", "[2001:db8::9]:7100"]
    assert candidates("10.0.0.5:7100", "unix:/tmp/socket") == ["10.0.0.5:7100"]


@pytest.mark.cluster
@pytest.mark.timeout(150)
def test_a_node_nobody_can_dial_serves_its_stage_over_reverse_links(tmp_path):
    # node-2 advertises a port that refuses every connection, so the coordinator's dial-back fails as it does behind
    # NAT; its neighbours must send to it over the streams it opens, and the run must still equal train-local.
    settings = ["run.steps=4", "train.microbatches=4", "train.inflight=2", "run.eval_every=2", "run.eval_microbatches=2",
                "scheduler.placement=uniform"]
    cfg = load_config(None, settings)
    listen = f"127.0.0.1:{free_port()}"
    with dead_port() as dead:
        node_args = {"node-2": ["--listen", listen, "--advertise", f"127.0.0.1:{dead}"]}
        with local_cluster(cfg, 3, tmp_path, node_args=node_args, in_order=True) as cluster:
            summary = cluster.wait(120)
            plan = cluster.coordinator.plan
            status = cluster.coordinator.status()
            state = {}
            for stage in plan.stages:
                # The test can dial node-2 where it really listens; the coordinator knows only what it advertised.
                address = listen if "node-2" in stage.node_ids else stage.addresses[0]
                tensors = fetch_stage_state(address, cluster.token, summary.steps)
                state.update({k: v for k, v in tensors.items() if k.startswith("layers.")})
    assert summary.steps == cfg.run.steps and [list(s.node_ids) for s in plan.stages] == [["node-1"], ["node-2"], ["node-3"]]
    assert max_diff(state, train_local_state(cfg)) <= 1e-4
    flags = {n: u for s in plan.stages for n, u in zip(s.node_ids, s.unreachable)}
    assert flags == {"node-1": False, "node-2": True, "node-3": False}
    assert {n.node_id: n.reachability for n in status.nodes} == {
        "node-1": "direct", "node-2": "unreachable", "node-3": "direct"
    }
    joins = {n: (tmp_path / f"{n}.log").read_text() for n in ("node-1", "node-2", "node-3")}
    assert "not reachable from outside: neighbours will use connections this node opens" in joins["node-2"]
    for n in ("node-1", "node-3"):
        assert "reachable at 127.0.0.1:" in joins[n] and "not reachable" not in joins[n]
    # The middle stage received activations and gradients over the streams it opened to both neighbours.
    for n in ("node-1", "node-3"):
        assert f"reverse link from {n} at " in joins["node-2"], joins["node-2"][-3000:]
        assert "reverse link to node-2 open" in joins[n]
