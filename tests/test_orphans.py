"""A killed coordinator or node leaves nothing running: its hivemind DHT process and p2pd end with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from geotrain.config import load_config
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.auth import new_token
from geotrain.localnodes import LocalNodes
from geotrain.scheduler.service import CoordinatorProcess
from tests.conftest import REPO, descendants, free_ports, geotrain_env, process_stat, running_of, wait_until

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree from /proc"),
]

_GONE_WITHIN_S = 8.0  # torch_shm_manager lingers 2s after its last client


def _names(pids: list[int]) -> list[str]:
    names = []
    for pid in pids:
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except FileNotFoundError:
            pass
    return names


def _assert_all_end(procs: dict[int, int]) -> None:
    deadline = time.monotonic() + _GONE_WITHIN_S
    while running_of(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = running_of(procs)
    assert not left, f"still running {_GONE_WITHIN_S}s after their parent died: {_names(left)} (pids {left})"


class Reaper:
    """What a test started: sessions it led and processes found in them, to SIGKILL whatever the test's outcome."""

    def __init__(self) -> None:
        self.leaders: list[int] = []
        self.procs: dict[int, int] = {}

    def lead(self, pid: int) -> None:
        """Track a process started as the leader of its own session, and all it will start."""
        self.leaders.append(pid)
        self.procs[pid] = process_stat(pid)[2]

    def kill_all(self) -> None:
        """SIGKILL every process tracked, orphans included."""
        for pid in self.leaders:
            try:
                os.killpg(pid, signal.SIGKILL)  # an orphan keeps its process group when its parent dies
            except ProcessLookupError:
                pass
        for pid in running_of(self.procs):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    """A Reaper that kills what it tracks when the test ends."""
    r = Reaper()
    yield r
    r.kill_all()


# A coordinator as `geotrain coordinator` runs one (its forkserver imports nothing), with its DHT started as the first
# plan with replicas starts it.
_COORDINATOR_WITH_DHT = """
import sys
from geotrain.config import load_config
from geotrain.lifetime import start_forkserver
from geotrain.scheduler.service import CoordinatorProcess

start_forkserver([])
process = CoordinatorProcess(load_config(None, ["scheduler.min_nodes=2"]), sys.argv[1], "127.0.0.1:0")
process.dht.maddrs()
print("dht up", flush=True)
process.server.start()
process.coordinator.run()
"""


@pytest.mark.timeout(60)
def test_sigkilled_coordinator_leaves_no_processes(reaper):
    coordinator = subprocess.Popen(
        [sys.executable, "-c", _COORDINATOR_WITH_DHT, new_token()], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=geotrain_env(), cwd=REPO, process_group=0,
    )
    reaper.lead(coordinator.pid)
    for line in coordinator.stdout:
        if line == "dht up\n":
            break
    else:
        pytest.fail(f"the coordinator exited with {coordinator.wait()} before its DHT was up")
    children = descendants(coordinator.pid)
    reaper.procs.update(children)
    assert "p2pd" in _names(list(children)), _names(list(children))

    coordinator.kill()
    coordinator.wait()
    _assert_all_end(children)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_stopped_node_leaves_no_processes(tmp_path, reaper, sig):
    cfg = load_config(None, ["scheduler.min_nodes=2", "scheduler.heartbeat_interval_s=0.2"])
    token = new_token()
    # Both DHTs on fixed ports (--dht-port), as a firewall rule or a port forward needs them.
    coordinator_dht, node_dht = free_ports(2)
    process = CoordinatorProcess(cfg, token, "127.0.0.1:0", dht_port=coordinator_dht)
    nodes = LocalNodes(f"127.0.0.1:{process.port}", token, tmp_path, {"node-1": ["--dht-port", str(node_dht)]})
    try:
        process.server.start()
        node = nodes.start("node-1")
        reaper.lead(node.pid)
        # A node starts its DHT when told to join averaging (as a plan's replica is) and reports its peer id in the
        # heartbeat right after: then the DHT process and p2pd run.
        coordinator = process.coordinator
        wait_until(lambda: "node-1" in coordinator.members or node.poll() is not None, 60, "the node registered")
        initial_peers = coordinator.planning.dht_peers()
        assert initial_peers and all(f"/tcp/{coordinator_dht}/p2p/" in m for m in initial_peers), initial_peers
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", node_dht), timeout=5).close()  # nothing there before it joins
        coordinator.orders.send(["node-1"], pb.Order(join_averaging=pb.JoinAveraging(initial_peers=initial_peers)))

        def dht_up_or_node_gone() -> bool:
            member = coordinator.members.get("node-1")
            return node.poll() is not None or (member is not None and bool(member.peer_id))

        wait_until(dht_up_or_node_gone, 60, "the node's DHT came up")
        assert node.poll() is None, (tmp_path / "node-1.log").read_text()[-3000:]
        m = coordinator.members["node-1"]
        socket.create_connection(("127.0.0.1", node_dht), timeout=5).close()  # the node's DHT serves its port
        children = descendants(node.pid)
        reaper.procs.update(children)
        assert "p2pd" in _names(list(children)), (tmp_path / "node-1.log").read_text()[-3000:]
        # A later heartbeat: the thread that started the DHT has ended by now, and the DHT must outlive it.
        seen = m.last_seen
        wait_until(lambda: m.last_seen != seen or node.poll() is not None, 20, "another heartbeat")
        assert node.poll() is None, (tmp_path / "node-1.log").read_text()[-3000:]
        assert sorted(running_of(children)) == sorted(children), "the node's DHT ended while the node ran"

        node.send_signal(sig)
        node.wait(30)
        _assert_all_end(children)
    finally:
        nodes.stop_all()
        process.close()


_SIGTERM_TO_DHT = """
import signal, threading, time
import hivemind
from geotrain.lifetime import tie_children_to_this_process

signal.signal(signal.SIGTERM, lambda *_: print("parent's handler ran", flush=True))  # as the CLI installs one
tie_children_to_this_process()
started = []
# From a thread that then ends, as the node starts its DHT.
thread = threading.Thread(target=lambda: started.append(hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)))
thread.start()
thread.join()
dht = started[0]
dht.terminate()  # SIGTERM: what DHT.shutdown falls back to when its DHT process does not stop
dht.join(10)
print("alive" if dht.is_alive() else "ended", flush=True)
if dht.is_alive():
    dht.kill()
"""


@pytest.mark.timeout(60)
def test_dht_process_ends_on_sigterm_despite_the_parents_handler() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SIGTERM_TO_DHT], env=geotrain_env(), cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert out.stdout.split() == ["ended"], out.stdout + out.stderr
