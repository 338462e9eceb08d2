"""Emulate a WAN on one Linux host with network namespaces and run geotrain across it.

    sudo python deploy/wan/netwan.py --regions 2 --nodes-per-region 2 --link-mbps 20 --latency-ms 50 \\
        -- --set run.steps=10

Arguments after `--` go to `geotrain coordinator`. Wiring, for run id RID and region r = 0..R-1:

    RID-r0  wan 10.1.0.2/24 ──veth── r0 10.1.0.1/24 ┐
    RID-r1  wan 10.2.0.2/24 ──veth── r1 10.2.0.1/24 ┼─ RID-rt (router, IPv4 forwarding)
    ...                                             ┘

- Each region is one namespace holding its processes: the coordinator (region 0) and the region's nodes. Every
  geotrain process binds 127.0.0.1 and is reached from outside through the region's delay relay on the region
  address with the same port: coordinator 10.1.0.2:7000, node i of region r 10.(r+1).0.2:(7100 + i), which is
  what the node advertises (`geotrain join --advertise`), and its raw tensor stream on 7200 + i (`--tensor-port`),
  so that tensors between regions cross the WAN over the stream as they would between clouds (a port no relay
  forwarded would send them by gRPC calls, with a warning per peer). The coordinator advertises its region's address too
  (`geotrain coordinator --advertise`): the hivemind DHT that replicas bootstrap from listens on every interface of
  region 0, and the nodes dial it there, past the relay; each node's own DHT listens on its advertised address.
- `tbf` at link-mbps shapes both ends of each region's veth (region egress and router egress towards the region),
  so traffic between regions is rate-limited in both directions. Traffic inside a region never leaves its
  namespace and is not shaped.
- The relay (delay_relay.py) holds each chunk for latency-ms in each direction, so a round trip between regions
  costs 2 x latency-ms. Clients from the relay's own region are relayed without delay. `tc netem` would do this
  in the kernel, but not every kernel has it.
- With --delay router, the router delays every packet between regions instead (tun_delay.py: policy rules send
  what enters the router from a region through a TUN device that holds each packet for latency-ms), so any
  process in a region sees the latency, whatever ports it opens (gloo, libp2p); the relays then only forward.
- A region behind NAT (--behind-nat R, needs nftables) is a home network: nftables in its namespace drops every
  connection that comes in, while its processes still connect out. It has no relay; its nodes listen on 0.0.0.0 and
  advertise nothing, as a volunteer behind a home router would (they find their own LAN address). Its traffic is
  delayed by the relays of the regions it connects to, once each way.

Everything is torn down on exit, on an error, and on SIGINT/SIGTERM: processes killed, namespaces deleted (their
veths go with them). After a SIGKILL, `netwan.py --cleanup RID` removes what is left. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

log = logging.getLogger("netwan")

HERE = Path(__file__).resolve().parent
COORDINATOR_PORT = 7000
NODE_PORT_BASE = 7100
TENSOR_PORT_BASE = 7200  # node i's --tensor-port: its relay forwards it beside the node's gRPC port
READY_TIMEOUT_S = 15.0
STOP_GRACE_S = 5.0
DELAYS = ("relay", "router")
ROUTER_DELAY_TABLE = "100"


class WanError(RuntimeError):
    """The WAN cannot be built here, or one of its helpers failed."""


@dataclass(kw_only=True)
class WanSpec:
    """Shape of the emulated WAN."""

    regions: int = 2
    nodes_per_region: int = 1
    link_mbps: float = 20.0
    """Rate of each region's link to the others, in each direction."""
    latency_ms: float = 50.0
    """One-way delay between regions (added by the relay)."""
    run_id: str = field(default_factory=lambda: "gw" + secrets.token_hex(3))
    """Prefix of every namespace, so parallel runs never collide."""
    behind_nat: tuple[int, ...] = ()
    """Regions whose namespace drops every incoming connection (home networks); never region 0, the coordinator's."""
    delay: str = "relay"
    """Who adds the latency: "relay" (the relays, per connection to a relayed port) or "router" (every packet
    between regions, through a TUN device in the router)."""

    def __post_init__(self) -> None:
        # Region r uses 10.(r+1).0.0/24, so at most 254 regions fit in 10/8.
        if not 1 <= self.regions <= 254:
            raise ValueError(f"--regions must be in [1, 254], got {self.regions}")
        if not 1 <= self.nodes_per_region <= 100:
            raise ValueError(f"--nodes-per-region must be in [1, 100], got {self.nodes_per_region}")
        if not 0.01 <= self.link_mbps <= 100_000:
            raise ValueError(f"--link-mbps must be in [0.01, 100000], got {self.link_mbps}")
        if not 0 <= self.latency_ms <= 10_000:
            raise ValueError(f"--latency-ms must be in [0, 10000], got {self.latency_ms}")
        if not self.run_id.isalnum():
            raise ValueError(f"run id must be alphanumeric, got {self.run_id!r}")
        if any(not 1 <= r < self.regions for r in self.behind_nat):
            raise ValueError(f"--behind-nat takes regions 1..{self.regions - 1} (region 0 holds the coordinator)")
        if self.delay not in DELAYS:
            raise ValueError(f"--delay must be one of {', '.join(DELAYS)}, got {self.delay!r}")


def _run(*cmd: str) -> str:
    """Run a command; raise WanError with its stderr when it fails."""
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise WanError(f"`{' '.join(cmd)}` failed: {result.stderr.strip() or f'exit code {result.returncode}'}")
    return result.stdout


def _die_with_parent() -> None:
    """In the child: have Linux SIGKILL it when netwan dies, so nothing outlives even a killed netwan."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def check_environment() -> None:
    """Raise WanError with a clear message unless this process can create network namespaces."""
    if sys.platform != "linux":
        raise WanError("netwan needs Linux network namespaces")
    if os.geteuid() != 0:
        raise WanError("netwan needs root to create network namespaces: run it with sudo")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise WanError(f"netwan needs iproute2, and {', '.join(missing)} is not on PATH")
    probe = f"gwprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except WanError as e:
        raise WanError(f"cannot create a network namespace (in a container, run it privileged): {e}") from None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def check_nftables() -> None:
    """Raise WanError unless nftables can filter in a network namespace (check_environment first)."""
    if shutil.which("nft") is None:
        raise WanError("a region behind NAT needs nftables: apt-get install nftables")
    probe = f"gwnft{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "exec", probe, "nft", "add", "table", "inet", "probe")
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def namespaces(run_id: str) -> list[str]:
    """The network namespaces that exist now for a run id."""
    listing = _run("ip", "netns", "list")
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{run_id}-")]


def cleanup(run_id: str) -> None:
    """Kill every process left in the run's namespaces and delete the namespaces (their veths go with them)."""
    for ns in namespaces(run_id):
        # Processes keep a deleted namespace alive, so they go first. Only this run's processes live in them.
        for pid in _run("ip", "netns", "pids", ns).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            _run("ip", "netns", "del", ns)
        except WanError as e:
            log.warning("%s", e)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process group, then SIGKILL the ones still running after the grace period."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM, killing it", p.pid)
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen, sig: signal.Signals) -> None:
    # Each child leads its own process group (process_group=0), so this reaches its children too.
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _read_line(proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    """The next stdout line of proc, or WanError if it exits or stays silent for timeout_s."""
    assert proc.stdout is not None
    # The pipe is unbuffered, so select() sees every byte not yet read and readline() never over-reads.
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else b""
    if not line:
        raise WanError(f"{what} did not start or stopped early (exit code {proc.poll()})")
    return line.decode().strip()


class Wan:
    """The namespaces, links and processes of one emulated WAN; as a context manager it always tears down."""

    def __init__(self, spec: WanSpec, log_dir: Path | None = None) -> None:
        self.spec = spec
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"netwan-{spec.run_id}-"))
        # A caller's GEOTRAIN_TOKEN is kept so it can talk to the run (e.g. query the coordinator) while it runs.
        self.token = os.environ.get("GEOTRAIN_TOKEN") or secrets.token_hex(24)
        self.processes: list[subprocess.Popen] = []  # geotrain: the coordinator and the nodes
        self._relays: list[subprocess.Popen] = []

    # -- names and addresses --------------------------------------------------------------------------------------

    @property
    def router_ns(self) -> str:
        """The namespace that routes between regions."""
        return f"{self.spec.run_id}-rt"

    def region_ns(self, region: int) -> str:
        """The namespace of a region's processes."""
        return f"{self.spec.run_id}-r{region}"

    @staticmethod
    def region_ip(region: int) -> str:
        """The address of a region's namespace, where its relay listens."""
        return f"10.{region + 1}.0.2"

    @property
    def coordinator_address(self) -> str:
        """Where nodes dial the coordinator: its region's relay."""
        return f"{self.region_ip(0)}:{COORDINATOR_PORT}"

    def node_address(self, region: int, index: int) -> str:
        """The address node `index` of `region` advertises: its region's relay."""
        return f"{self.region_ip(region)}:{NODE_PORT_BASE + index}"

    # -- build ----------------------------------------------------------------------------------------------------

    def build(self) -> None:
        """Create the namespaces, the shaped links and the delay relays."""
        rt = self.router_ns
        _run("ip", "netns", "add", rt)
        _run("ip", "-n", rt, "link", "set", "lo", "up")
        _run("ip", "netns", "exec", rt, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for r in range(self.spec.regions):
            ns, gateway = self.region_ns(r), f"10.{r + 1}.0.1"
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # Created with both ends already inside their namespaces: no names in the host namespace to collide.
            _run("ip", "link", "add", "wan", "netns", ns, "type", "veth", "peer", "name", f"r{r}", "netns", rt)
            _run("ip", "-n", ns, "addr", "add", f"{self.region_ip(r)}/24", "dev", "wan")
            _run("ip", "-n", rt, "addr", "add", f"{gateway}/24", "dev", f"r{r}")
            _run("ip", "-n", ns, "link", "set", "wan", "up")
            _run("ip", "-n", rt, "link", "set", f"r{r}", "up")
            _run("ip", "-n", ns, "route", "add", "default", "via", gateway)
            self._shape(ns, "wan")
            self._shape(rt, f"r{r}")
            if r in self.spec.behind_nat:
                self._drop_incoming(ns)
        if self.spec.delay == "router":
            self._start_router_delay()
        for r in range(self.spec.regions):
            if r not in self.spec.behind_nat:
                self._start_relay(r)
        log.info("WAN %s built: %d region(s), %.3g Mbit/s, %.3g ms one-way", self.spec.run_id, self.spec.regions,
                 self.spec.link_mbps, self.spec.latency_ms)

    def _shape(self, ns: str, dev: str) -> None:
        rate_bytes = self.spec.link_mbps * 1e6 / 8
        # The bucket must hold at least one timer tick of traffic (HZ may be 250) and a few full-size packets.
        burst = max(32 * 1024, int(rate_bytes / 250))
        # A queue of ~100 ms at line rate, like a router's buffer: deep enough for TCP to fill the link.
        limit = max(64 * 1024, int(rate_bytes * 0.1))
        _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", f"{int(self.spec.link_mbps * 1e6)}bit", "burst", str(burst), "limit", str(limit))

    @staticmethod
    def _drop_incoming(ns: str) -> None:
        """Make ns a home network: connections from outside are dropped (silently, as NAT does), replies to its own
        connections pass."""
        nft = ["ip", "netns", "exec", ns, "nft"]
        _run(*nft, "add", "table", "inet", "home")
        _run(*nft, "add", "chain", "inet", "home", "inbound", "{ type filter hook input priority 0; policy accept; }")
        _run(*nft, "add", "rule", "inet", "home", "inbound", "iifname", "wan", "ct", "state", "new", "drop")

    def _start_router_delay(self) -> None:
        """Route every packet that enters the router from a region through tun_delay.py's device, which gives it
        back latency-ms later; the main table then takes it to its region."""
        rt = self.router_ns
        cmd = [sys.executable, str(HERE / "tun_delay.py"), "--latency-ms", str(self.spec.latency_ms)]
        delay = self._spawn(rt, "tun-delay", cmd, pipe=True)
        self._relays.append(delay)
        _read_line(delay, READY_TIMEOUT_S, "the router's delay device")
        _run("ip", "-n", rt, "link", "set", "delay", "up")
        # Packets come back from the device with sources the main table routes elsewhere: no reverse-path check.
        for conf in ("all", "default", "delay"):
            _run("ip", "netns", "exec", rt, "sysctl", "-qw", f"net.ipv4.conf.{conf}.rp_filter=0")
        _run("ip", "-n", rt, "route", "add", "default", "dev", "delay", "table", ROUTER_DELAY_TABLE)
        for r in range(self.spec.regions):
            _run("ip", "-n", rt, "rule", "add", "iif", f"r{r}", "lookup", ROUTER_DELAY_TABLE)

    def _start_relay(self, region: int) -> None:
        ports = [base + i for base in (NODE_PORT_BASE, TENSOR_PORT_BASE) for i in range(self.spec.nodes_per_region)]
        if region == 0:
            ports.append(COORDINATOR_PORT)
        ip = self.region_ip(region)
        routes = [arg for port in ports for arg in ("--route", f"{ip}:{port}=127.0.0.1:{port}")]
        latency_ms = self.spec.latency_ms if self.spec.delay == "relay" else 0.0  # else the router delays
        cmd = [sys.executable, str(HERE / "delay_relay.py"), "--latency-ms", str(latency_ms),
               "--local-net", f"10.{region + 1}.0.0/24", *routes]
        relay = self._spawn(self.region_ns(region), f"relay-r{region}", cmd, pipe=True)
        self._relays.append(relay)
        _read_line(relay, READY_TIMEOUT_S, f"the delay relay of region {region}")

    # -- processes ------------------------------------------------------------------------------------------------

    def _spawn(self, ns: str, name: str, cmd: list[str], pipe: bool = False, console: bool = False
               ) -> subprocess.Popen:
        """Start cmd inside namespace ns; stderr (and stdout unless piped or on the console) go to name.log."""
        # Every process gets one compute thread: several share a small machine and more threads oversubscribe it.
        env = {**os.environ, "GEOTRAIN_TOKEN": self.token, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(self.log_dir / f"{name}.log", "ab") as log_file:
            stdout: int | IO[bytes] | None = subprocess.PIPE if pipe else (None if console else log_file)
            # A group of its own, not a session: Linux's autogroups give each session an equal share of the CPU.
            return subprocess.Popen(
                ["ip", "netns", "exec", ns, *cmd], env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                stderr=log_file, bufsize=0, process_group=0, preexec_fn=_die_with_parent,
            )

    def spawn(self, region: int, name: str, cmd: list[str], pipe: bool = False) -> subprocess.Popen:
        """Start any command in a region's namespace (stopped with the WAN); its stderr (and stdout unless piped)
        go to name.log."""
        proc = self._spawn(self.region_ns(region), name, cmd, pipe=pipe)
        self.processes.append(proc)
        return proc

    def start_coordinator(self, extra_args: list[str] | None = None, console: bool = False) -> subprocess.Popen:
        """Start `geotrain coordinator` in region 0, waiting for every node; extra_args go to its command line."""
        nodes = self.spec.regions * self.spec.nodes_per_region
        cmd = [sys.executable, "-m", "geotrain", "coordinator", "--listen", f"127.0.0.1:{COORDINATOR_PORT}",
               "--advertise", self.region_ip(0), "--min-nodes", str(nodes),
               "--set", "scheduler.behind_proxy=true",  # nodes call through region 0's relay: from loopback
               *(extra_args or [])]
        proc = self._spawn(self.region_ns(0), "coordinator", cmd, console=console)
        self.processes.append(proc)
        return proc

    def start_node(self, region: int, index: int) -> subprocess.Popen:
        """Start `geotrain join` for node `index` of `region`: advertising its region's relay, or, behind NAT,
        listening on every interface and advertising nothing. Its output goes to r{region}n{index}.log."""
        node_id = f"r{region}n{index}"
        port = NODE_PORT_BASE + index
        where = (["--listen", f"0.0.0.0:{port}"] if region in self.spec.behind_nat
                 else ["--listen", f"127.0.0.1:{port}", "--advertise", self.node_address(region, index),
                       "--tensor-port", str(TENSOR_PORT_BASE + index)])
        cmd = [sys.executable, "-m", "geotrain", "--log-level", "info", "join",
               "--coordinator", self.coordinator_address, *where, "--node-id", node_id, "--region", f"region-{region}"]
        proc = self._spawn(self.region_ns(region), node_id, cmd)
        self.processes.append(proc)
        return proc

    def start_nodes(self) -> list[subprocess.Popen]:
        """Start every node (start_node)."""
        return [self.start_node(r, i) for r in range(self.spec.regions) for i in range(self.spec.nodes_per_region)]

    def join_in_order(self, coordinator: subprocess.Popen, timeout_s: float = 60.0) -> None:
        """Start every node, each once the coordinator (started with start_coordinator) has logged the one before
        joining: uniform placement then gives stage k to the k-th node, r0n0 first."""
        log_path = self.log_dir / "coordinator.log"
        for r in range(self.spec.regions):
            for i in range(self.spec.nodes_per_region):
                self.start_node(r, i)
                deadline = time.monotonic() + timeout_s
                while f"r{r}n{i} joined" not in log_path.read_text():
                    if coordinator.poll() is not None or time.monotonic() > deadline:
                        raise WanError(f"r{r}n{i} did not join (coordinator exit code {coordinator.poll()})")
                    time.sleep(0.1)

    def run(self, extra_args: list[str] | None = None, timeout_s: float | None = None, console: bool = False) -> int:
        """Run a coordinator and every node to the end of the run; returns the coordinator's exit code."""
        coordinator = self.start_coordinator(extra_args, console)
        self.start_nodes()
        try:
            return coordinator.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise WanError(f"the run did not finish within {timeout_s:g}s (logs in {self.log_dir})") from None

    # -- measurement ----------------------------------------------------------------------------------------------

    def measure_bandwidth(self, src: int, dst: int, nbytes: int = 4 << 20, timeout_s: float = 60.0) -> float:
        """Mbit/s of one bulk TCP transfer from region src to region dst across the shaped links (no relay)."""
        script = str(HERE / "linktest.py")
        sink = self._spawn(self.region_ns(dst), f"sink-r{dst}", [sys.executable, script, "sink", "--listen",
                                                                  f"{self.region_ip(dst)}:0"], pipe=True)
        try:
            port = json.loads(_read_line(sink, READY_TIMEOUT_S, "the bandwidth sink"))["port"]
            subprocess.run(
                ["ip", "netns", "exec", self.region_ns(src), sys.executable, script, "send",
                 "--to", f"{self.region_ip(dst)}:{port}", "--bytes", str(nbytes)],
                check=True, timeout=timeout_s, capture_output=True,
            )
            result = json.loads(_read_line(sink, timeout_s, "the bandwidth sink"))
        except (subprocess.SubprocessError, ValueError) as e:
            raise WanError(f"bandwidth measurement from region {src} to {dst} failed: {e}") from None
        finally:
            _stop([sink])
        mbps = result["bytes"] * 8 / result["seconds"] / 1e6
        log.info("region %d -> %d: %.2f Mbit/s (%d bytes in %.2fs)", src, dst, mbps, result["bytes"],
                 result["seconds"])
        return mbps

    # -- teardown -------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process and delete every namespace of this run; safe to call more than once."""
        # A second Ctrl+C must not cut the teardown short: hold the signals until it is done.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            # geotrain first, while the relays still carry their goodbyes.
            _stop(self.processes)
            _stop(self._relays)
            self.processes.clear()
            self._relays.clear()
            cleanup(self.spec.run_id)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def __enter__(self) -> Wan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Entry point: build the WAN, run geotrain across it, tear everything down."""
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, extra = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(
        description="Emulate a WAN with network namespaces and run geotrain across it (needs root).",
        epilog="Arguments after -- go to `geotrain coordinator`, e.g. -- --set run.steps=10 --config run.toml",
    )
    parser.add_argument("--regions", type=int, default=2, help="regions (default 2); the coordinator is in region 0")
    parser.add_argument("--nodes-per-region", type=int, default=1, help="nodes in each region (default 1)")
    parser.add_argument("--link-mbps", type=float, default=20.0,
                        help="rate between regions, each direction (default 20)")
    parser.add_argument("--latency-ms", type=float, default=50.0,
                        help="one-way delay between regions (default 50)")
    parser.add_argument("--behind-nat", type=int, action="append", default=[], metavar="REGION",
                        help="a region whose namespace drops incoming connections, as a home router does (repeatable)")
    parser.add_argument("--delay", choices=DELAYS, default="relay",
                        help="who adds the latency: the relays (default) or the router, to every packet")
    parser.add_argument("--timeout", type=float, help="give up after this many seconds")
    parser.add_argument("--log-dir", type=Path, help="where process logs go (default: a new temporary directory)")
    parser.add_argument("--cleanup", metavar="RUN_ID", help="remove what a killed run left behind, then exit")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        spec = WanSpec(regions=args.regions, nodes_per_region=args.nodes_per_region, link_mbps=args.link_mbps,
                       latency_ms=args.latency_ms, behind_nat=tuple(args.behind_nat), delay=args.delay)
    except ValueError as e:
        parser.error(str(e))
    try:
        check_environment()
        if spec.behind_nat:
            check_nftables()
        if args.cleanup:
            cleanup(args.cleanup)
            return 0
    except WanError as e:
        print(f"netwan: {e}", file=sys.stderr)
        return 2
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    wan = Wan(spec, args.log_dir)
    try:
        with wan:
            wan.build()
            print(f"netwan {spec.run_id}: {spec.regions} region(s) x {spec.nodes_per_region} node(s), "
                  f"{spec.link_mbps:g} Mbit/s and {spec.latency_ms:g} ms one-way between regions; "
                  f"logs in {wan.log_dir}", flush=True)
            return wan.run(extra, timeout_s=args.timeout, console=True)
    except WanError as e:
        print(f"netwan: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"netwan: {e or 'interrupted'}: WAN {spec.run_id} torn down", file=sys.stderr)
        return 130
    finally:
        # Signals raised after teardown have nothing left to interrupt.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
