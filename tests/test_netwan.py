"""deploy/: the delay relay, the namespace WAN (a shaped link, a run across it, teardown), the example configs."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from safetensors.torch import load_file

from geotrain.config import load_config
from tests.conftest import REPO, as_set_flags, max_diff, run_cli, train_local_state, wait_until

LINK_MBPS = 20.0
LATENCY_MS = 20.0


def _load(name: str) -> ModuleType:
    """Import a deploy/wan script by path: deploy/ is not a package."""
    spec = importlib.util.spec_from_file_location(name, REPO / "deploy" / "wan" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class body runs
    spec.loader.exec_module(module)
    return module


netwan = _load("netwan")
delay_relay = _load("delay_relay")


# -- the relay, on 127.0.0.1 (no root needed) -------------------------------------------------------------------------


async def _echo_round_trips(latency_ms: float, local_nets: list[str], messages: int) -> tuple[list[bytes], float]:
    """Echo numbered lines through a relay; returns what came back and the first round trip in seconds."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    target = server.sockets[0].getsockname()[1]
    relay = delay_relay.Relay([delay_relay.parse_route(f"127.0.0.1:0=127.0.0.1:{target}")], latency_ms, local_nets)
    [(host, port)] = await relay.start()
    try:
        reader, writer = await asyncio.open_connection(host, port)
        start = time.monotonic()
        writer.write(b"0\n")
        first = [await reader.readline()]
        rtt = time.monotonic() - start
        # A burst of small writes: each is its own chunk in the relay, and they must come back in order.
        for i in range(1, messages):
            writer.write(f"{i}\n".encode())
        writer.write_eof()
        rest = [line async for line in reader]
        writer.close()
        return first + rest, rtt
    finally:
        await relay.close()
        server.close()


@pytest.mark.timeout(30)
def test_relay_delays_each_direction_and_keeps_order():
    lines, rtt = asyncio.run(_echo_round_trips(latency_ms=40, local_nets=[], messages=500))
    assert lines == [f"{i}\n".encode() for i in range(500)]
    assert rtt >= 0.080, "40 ms each way must cost at least 80 ms per round trip"
    assert rtt < 0.5


@pytest.mark.timeout(30)
def test_relay_does_not_delay_local_clients():
    # A delayed round trip would take 2 s; a busy machine does not stretch an undelayed one to 1 s.
    _, rtt = asyncio.run(_echo_round_trips(latency_ms=1000, local_nets=["127.0.0.0/8"], messages=2))
    assert rtt < 1.0


def test_route_parsing_rejects_garbage():
    assert delay_relay.parse_route("10.1.0.2:7000=127.0.0.1:7001") == delay_relay.Route("10.1.0.2", 7000,
                                                                                        "127.0.0.1", 7001)
    for bad in ("10.1.0.2:7000", "10.1.0.2=127.0.0.1:1", ":1=127.0.0.1:2", "a:b=c:1"):
        with pytest.raises(ValueError):
            delay_relay.parse_route(bad)


# -- the namespace WAN (root and `ip netns` needed) --------------------------------------------------------------------


def _skip_unless_namespaces() -> None:
    try:
        netwan.check_environment()
    except netwan.WanError as e:
        pytest.skip(f"no namespace WAN here: {e}")


def _assert_gone(wan) -> None:
    """Nothing of the run is left: no namespace, no process."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert wan.spec.run_id not in listing
    assert not wan.processes


@pytest.fixture
def wan(tmp_path: Path) -> Iterator:
    """A 2-region WAN, one node per region, LINK_MBPS and LATENCY_MS between them; always torn down."""
    _skip_unless_namespaces()
    w = netwan.Wan(netwan.WanSpec(regions=2, nodes_per_region=1, link_mbps=LINK_MBPS, latency_ms=LATENCY_MS),
                   log_dir=tmp_path)
    try:
        w.build()
        yield w
    finally:
        w.close()
        _assert_gone(w)


@pytest.mark.cluster
@pytest.mark.netns
@pytest.mark.timeout(90)
def test_inter_region_link_runs_at_the_configured_rate(wan):
    # The shaper is a ceiling a loaded machine cannot lift (veth alone runs at Gbit/s); a link shaped much slower than
    # configured would not move the 4 MiB within the test's timeout.
    for src, dst in ((0, 1), (1, 0)):
        mbps = wan.measure_bandwidth(src, dst, nbytes=4 << 20)
        assert 0 < mbps <= 1.2 * LINK_MBPS, f"region {src} -> {dst}: {mbps:.2f} Mbit/s"


@pytest.mark.cluster
@pytest.mark.netns
@pytest.mark.timeout(150)
def test_training_runs_across_the_wan_and_the_profiler_measures_the_link(wan):
    # A small model keeps training traffic a few % of the link, so the probes measure the link, not the load; probes
    # of 8 MiB (3.4 s at 20 Mbit/s) leave TCP's ramp-up and the shaper's burst out of the figure.
    coordinator = wan.start_coordinator([
        "--set", "run.steps=400", "--set", "run.eval_every=0", "--set", "model.seq_len=16",
        "--set", "train.microbatch_size=2", "--set", f"profile.probe_bytes={8 << 20}",
    ])
    wan.start_nodes()
    # r0n0 and the coordinator share region 0. The pair is probed by its upstream end, whichever joined first.
    def crossing() -> list[tuple[str, str]]:
        return [p for p in (("r1n0", "coordinator"), ("r0n0", "r1n0"), ("r1n0", "r0n0")) if p in links]

    links: dict[tuple[str, str], tuple[float, float]] = {}
    deadline = time.monotonic() + 90
    while len(crossing()) < 2 and coordinator.poll() is None and time.monotonic() < deadline:
        links = _measured_links(wan)
        # Each look is a `geotrain status` process (0.4 s of CPU). Both links are measured before the first plan,
        # and the 400 steps after it leave seconds to see them (the planner puts the whole model on the node in the
        # coordinator's region, where a step takes some 50 ms).
        time.sleep(2.0)
    log = (wan.log_dir / "coordinator.log").read_text()
    assert len(crossing()) == 2 and crossing()[0][1] == "coordinator", f"measured: {links}\n{log[-3000:]}"
    for pair in crossing():
        mbps, latency_ms = links[pair]
        assert 0 < mbps <= 1.2 * LINK_MBPS, f"{pair}: {mbps:.2f} Mbit/s measured, {LINK_MBPS} configured"
        assert latency_ms >= LATENCY_MS, f"{pair}: {latency_ms:.1f} ms one way, the relay adds {LATENCY_MS}"
    assert coordinator.wait(60) == 0, log[-3000:]
    log = (wan.log_dir / "coordinator.log").read_text()
    assert "done: 400 steps" in log
    # Each node reached the coordinator, and is reached by its peers, through its region's relay.
    assert f"r0n0 joined from {wan.node_address(0, 0)} (region-0)" in log
    assert f"r1n0 joined from {wan.node_address(1, 0)} (region-1)" in log


ECHO_SERVER = """
import socket
s = socket.create_server(("0.0.0.0", 0))
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.recv(16))
    c.close()
"""
ECHO_CLIENT = """
import socket, sys, time
began = time.monotonic()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.sendall(b"x")
assert c.recv(16) == b"x"
print(time.monotonic() - began)
"""


@pytest.mark.cluster
@pytest.mark.netns
@pytest.mark.timeout(60)
def test_router_delay_reaches_any_port(tmp_path):
    # A process that listens on a port of its own choosing (no relay knows it) is reached across regions with the
    # latency: a connect and one exchange are two round trips.
    _skip_unless_namespaces()
    w = netwan.Wan(netwan.WanSpec(regions=2, link_mbps=LINK_MBPS, latency_ms=LATENCY_MS, delay="router"), tmp_path)
    try:
        w.build()
        server = w.spawn(1, "echo", [sys.executable, "-c", ECHO_SERVER], pipe=True)
        port = int(server.stdout.readline())
        done = subprocess.run(["ip", "netns", "exec", w.region_ns(0), sys.executable, "-c", ECHO_CLIENT,
                               w.region_ip(1), str(port)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert float(done.stdout) >= 4 * LATENCY_MS / 1000
    finally:
        w.close()
        _assert_gone(w)


def _status(wan) -> dict | None:
    """`geotrain status --json` of the WAN's coordinator, asked from its region; None until it serves."""
    result = subprocess.run(
        ["ip", "netns", "exec", wan.region_ns(0), sys.executable, "-m", "geotrain", "status", "--json",
         "--coordinator", f"127.0.0.1:{netwan.COORDINATOR_PORT}"],
        capture_output=True, text=True, timeout=20, cwd=REPO, env={**os.environ, "GEOTRAIN_TOKEN": wan.token},
    )
    return json.loads(result.stdout) if result.returncode == 0 else None


def _measured_links(wan) -> dict[tuple[str, str], tuple[float, float]]:
    """(src, dst) -> (Mbit/s, one-way ms) of every link the coordinator's Status shows measured; {} until it serves."""
    status = _status(wan)
    return {(link["src"], link["dst"]): (link["bandwidth_mbps"], link["latency_ms"])
            for link in (status["links"] if status else []) if link["bandwidth_mbps"]}


def _skip_unless_nat() -> None:
    _skip_unless_namespaces()
    try:
        netwan.check_nftables()
    except netwan.WanError as e:
        pytest.skip(f"no home network here: {e}")


NAT_RUN = ["run.steps=4", "run.eval_every=0", "train.microbatches=4", "scheduler.placement=uniform"]


def _run_behind_nat(tmp_path, behind_nat: tuple[int, ...]) -> tuple[netwan.Wan, list[str]]:
    """A 3-region run whose regions `behind_nat` drop every incoming connection, as a home router does (their nodes
    join with no --advertise), checked equal to train-local; the WAN (closed) and each node's join output."""
    _skip_unless_nat()
    wan = netwan.Wan(netwan.WanSpec(regions=3, link_mbps=50, latency_ms=LATENCY_MS, behind_nat=behind_nat),
                     log_dir=tmp_path)
    final = tmp_path / "final.safetensors"
    log = tmp_path / "coordinator.log"
    try:
        wan.build()
        coordinator = wan.start_coordinator([*as_set_flags(NAT_RUN), "--save-final", str(final)])
        wan.join_in_order(coordinator)  # stage r on r{r}n0
        # Each node's reachability is known once the coordinator's dial-back ends (a NATed node's waits out its 3 s
        # deadline), while the nodes still profile themselves: before any plan.
        def reachability() -> dict[str, str] | None:
            status = _status(wan)
            found = {n["node_id"]: n["reachability"] for n in status["nodes"]} if status else {}
            return found if len(found) == 3 and all(found.values()) else None

        assert wait_until(reachability, 30, "every node's reachability") == {
            f"r{r}n0": "unreachable" if r in behind_nat else "direct" for r in range(3)
        }
        assert coordinator.wait(180) == 0, log.read_text()[-3000:]
    finally:
        wan.close()
        _assert_gone(wan)
    assert max_diff(load_file(str(final)), train_local_state(load_config(None, NAT_RUN))) <= 1e-4
    return wan, [(tmp_path / f"r{r}n0.log").read_text() for r in range(3)]


@pytest.mark.cluster
@pytest.mark.netns
@pytest.mark.timeout(240)
def test_nodes_behind_nat_serve_over_reverse_and_relayed_links_exactly(tmp_path):
    # r1n0 and r2n0 serve neighbouring stages from home networks: r0n0 sends to r1n0 over the connection r1n0 opens
    # (a reversed link), and r1n0's link with r2n0 goes through r0n0 (relayed). test_nat.py has a reversed link alone,
    # on loopback.
    wan, joins = _run_behind_nat(tmp_path, (1, 2))
    assert "reverse link to r1n0 open" in joins[0], joins[0][-3000:]
    assert "tensors to r1n0 go by gRPC calls, not a raw tensor stream: over the stream it opened" in joins[0]
    # r1n0's gradients to r0n0, which can be dialled, cross the WAN over r0n0's raw tensor stream, which its region's
    # relay forwards beside its gRPC port.
    assert "tensors to r0n0 go over a raw tensor stream" in joins[1], joins[1][-3000:]
    assert "tensors to r0n0 go by gRPC calls" not in joins[1], joins[1][-3000:]
    assert "not reachable from outside: links with r2n0 go through relay r0n0" in joins[1], joins[1][-3000:]
    assert "not reachable from outside: links with r1n0 go through relay r0n0" in joins[2], joins[2][-3000:]
    assert f"reachable at {wan.node_address(0, 0)}" in joins[0]


@pytest.mark.cluster
@pytest.mark.netns
@pytest.mark.timeout(60)
def test_teardown_after_a_failure_leaves_nothing(tmp_path):
    _skip_unless_namespaces()
    wan = netwan.Wan(netwan.WanSpec(regions=2, nodes_per_region=1), log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="induced"):
        with wan:
            wan.build()
            # Nodes with no coordinator yet: they sit in their retry loops, as in a run that breaks early.
            procs = wan.start_nodes()
            raise RuntimeError("induced failure")
    assert all(p.poll() is not None for p in procs)
    _assert_gone(wan)


# -- example run configs ----------------------------------------------------------------------------------------------

CONFIGS = sorted((REPO / "deploy" / "configs").glob("*.toml"))


def test_there_are_example_configs():
    assert len(CONFIGS) >= 2


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_trains_locally(path: Path):
    cfg = load_config(path)  # checks every value, codecs included
    assert cfg.scheduler.stages <= cfg.scheduler.min_nodes
    result = run_cli("train-local", "--config", str(path), "--steps", "1", timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 1 steps" in result.stdout
