"""The Coordinator gRPC service (thin: translate RPCs to Coordinator calls) and the state download for --save-final."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import secrets
import signal
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from geotrain.config import RunConfig
from geotrain.lifetime import child_with_pipe, ready_message, tie_children_to_this_process

from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol import geotrain_pb2_grpc as rpc
from geotrain.protocol.auth import peer_host, signer
from geotrain.protocol.framing import FrameError
from geotrain.protocol.identity import NodeKey
from geotrain.protocol.limits import PeerLimits, TokenBuckets
from geotrain.protocol import statestream
from geotrain.protocol.probe import ProbeCount
from geotrain.protocol.transport import TlsFiles, make_aio_server, make_channel, multiaddr_host
from geotrain.scheduler.checkpoint import CHECKPOINT_VERSION, CHECKPOINTS_DIR, CheckpointStore
from geotrain.scheduler.coordinator import Coordinator, EventSink
from geotrain.scheduler import reachability
from geotrain.scheduler.errors import ReportRefused, RunAborted, Unauthorized
from geotrain.scheduler.membership import Member
from geotrain.scheduler.metrics import METRICS_FILE, RunMetrics, tensorboard_writer
from geotrain.scheduler.reachability import DialedBack, Dialler
from geotrain.scheduler.state import RunStore

log = logging.getLogger(__name__)

COORDINATOR_ID = "coordinator"
_DHT_READY_S = 30.0
_STOP_DEADLINE_S = 10.0
# Threads for the calls that block (SQLite, checkpoint files, status, probes): they queue beyond this, and the
# event loop, which holds every order stream and heartbeat, is never among them.
_BLOCKING_WORKERS = 8
# One host (a NAT with volunteers behind it) may register as many new members as this many keys.
_KEYS_PER_HOST = 8
# Threads for the coordinator's own dials (registration dial-backs, probes of reported peers): a pool apart from
# the blocking one, so that addresses that never answer hold none of the threads Windows, profiles and refusals
# need; one host has at most this many dials at once, and the rest of its registrations wait (the caller's time).
_DIAL_WORKERS = 16
_DIALS_PER_HOST = 2
# How long the probe of a reported peer waits: a dead node's port refuses at once, a vanished host is silent.
_PROBE_S = 1.5
T = TypeVar("T")


class CoordinatorServicer(rpc.CoordinatorServicer):
    """Serves the Coordinator service for one Coordinator on a grpc.aio server.

    Order streams and the fast in-memory reports (which take the membership condition only briefly) run on the
    event loop, so an open stream or a heartbeat holds no thread; calls that touch SQLite or files, or may block,
    run on the bounded pool `blocking`.
    """

    def __init__(
        self, coordinator: Coordinator, blocking: Executor, limits: PeerLimits, dial_back: Dialler, dialling: Executor
    ) -> None:
        self.c = coordinator
        self._dial_back = dial_back  # address, timeout -> whether the node there answered
        self._blocking = blocking
        self._dialling = dialling
        self._dials: dict[str, tuple[asyncio.Semaphore, int]] = {}  # host -> its dials' semaphore, callers using it
        self._probes: set[asyncio.Task] = set()  # probes of reported peers under way (kept from the collector)
        self._refusals = limits.refusals
        self._backoff = limits.backoff  # shared with the server's limits: one count of a caller's refusals
        limits = coordinator.cfg.limits
        # Per key and host, and per host: a flood from one key (or unsigned) empties its own bucket, not the host's,
        # so a volunteer behind the same NAT still gets in; fresh keys for every call empty the host's.
        self._registrations = TokenBuckets(limits.registrations_per_s, limits.registration_burst)
        self._host_registrations = TokenBuckets(
            limits.registrations_per_s * _KEYS_PER_HOST, limits.registration_burst * _KEYS_PER_HOST
        )

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._blocking, fn, *args)

    async def _refuse(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, why: str, what: str, sender: str | None
    ) -> None:
        """Answer `code` with why, held by the caller's backoff; one log line per peer host a minute; the refusal
        counts against `sender`, the member whose key signed the call (None: no member's)."""
        self._refusals.refused(context.peer(), what, sender or "", why)
        if sender is not None:
            await self._off_loop(self.c.refused, sender, why)
        await self._held(context)
        await context.abort(code, why)

    async def _held(self, context: grpc.aio.ServicerContext) -> None:
        """Wait out the backoff of the caller (its host and key) of a refused call."""
        key = signer(context)
        await asyncio.sleep(self._backoff.delay((peer_host(context.peer()), key.hex() if key else "")))

    async def _check_member(self, context: grpc.aio.ServicerContext, request: Any) -> None:
        """PERMISSION_DENIED unless the key of member request.node_id signed the call (which counts against the
        member whose key did, if any)."""
        key = signer(context)
        try:
            self.c.authorize(request.node_id, key)
        except Unauthorized as e:
            why, sender = str(e), self.c.membership.owner(key)
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, why, type(request).__name__, sender)

    async def _from_member(self, context: grpc.aio.ServicerContext, fn: Callable[[Any], T], request: Any) -> T:
        """fn(request) on the loop, for a call that member request.node_id's key must sign (_check_member); a report
        the coordinator refuses (it contradicts the plan, or is malformed) answers INVALID_ARGUMENT with the reason
        and counts against that member."""
        await self._check_member(context, request)
        try:
            return fn(request)
        except ReportRefused as e:
            what = type(request).__name__
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), what, request.node_id)

    async def Register(self, request, context):  # noqa: D102, N802
        host, key = peer_host(context.peer()), signer(context) or b""
        if not self._registrations.take((host, key)):
            await self._too_many_registrations(context, request, self._registrations, "key")
        if not self._host_registrations.take(host):
            await self._too_many_registrations(context, request, self._host_registrations, "host")
        # A node serves before it registers: dialled once its request passed the checks, it answers unless nobody
        # can reach it. Only the caller's own host is dialled (reachability.target), off the blocking pool.
        reply = await self._off_loop(self.c.screen, request, key, host)
        if reply is None:
            where = reachability.target(request.address, context.peer(), self.c.cfg.scheduler.behind_proxy)
            dialed = DialedBack(where.reached if where.dial and await self._dial(host, where.dial) else None)
            log.debug("dial-back of %s (%s): %s", request.address[:80], where.case, dialed.state)
            reply = await self._off_loop(self.c.register, request, key, lambda: dialed, host)
        # Another's id, an evicted key, or no room (a flood of new ids): held by the caller's backoff.
        if reply.reason in (pb.REJECT_REASON_IDENTITY, pb.REJECT_REASON_EVICTED, pb.REJECT_REASON_FULL):
            self._refusals.refused(context.peer(), "Register", request.node_id[:80], reply.message)
            await self._held(context)
        return reply

    async def _dial(self, host: str, address: str, timeout_s: float = reachability.DIAL_BACK_S) -> bool:
        """Whether the node at `address` answers, dialled on the dialling pool with at most _DIALS_PER_HOST dials
        of `host` (the caller's) at once: a host whose addresses answer slowly waits for its own dials."""
        semaphore, users = self._dials.get(host) or (asyncio.Semaphore(_DIALS_PER_HOST), 0)
        self._dials[host] = (semaphore, users + 1)
        try:
            async with semaphore:
                return await asyncio.get_running_loop().run_in_executor(
                    self._dialling, self._dial_back, address, timeout_s)
        finally:
            semaphore, users = self._dials[host]
            if users == 1:
                del self._dials[host]
            else:
                self._dials[host] = (semaphore, users - 1)

    def _probe(self, member: Member | None) -> None:
        """Probe a reported peer (Membership.report_failure) in the background; its answer goes to probed()."""
        if member is None or member.unreachable:  # nobody can dial it: only a second neighbour's report counts
            return

        async def probe() -> None:
            answered = await self._dial(member.host or "", member.address, _PROBE_S)
            self.c.membership.probed(member.node_id, answered)

        task = asyncio.get_running_loop().create_task(probe())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _too_many_registrations(
        self, context: grpc.aio.ServicerContext, request: pb.RegisterRequest, buckets: TokenBuckets, whose: str
    ) -> None:
        why = f"more than {buckets.rate:g} registrations a second (burst {buckets.burst}) from this {whose}"
        self._refusals.refused(context.peer(), "Register", request.node_id[:80], why)
        await self._held(context)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)

    async def Heartbeat(self, request, context):  # noqa: D102, N802
        return await self._from_member(context, self.c.heartbeat, request)

    async def Orders(self, request, context):  # noqa: D102, N802
        orders = await self._from_member(context, self._order_stream, request)
        if orders is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown node {request.node_id}: register first")
        async for order in orders:
            yield order

    def _order_stream(self, request: pb.OrdersRequest) -> AsyncIterator[pb.Order] | None:
        """The member's order stream; None for an id the coordinator does not know."""
        try:
            return self.c.order_stream(request.node_id)
        except KeyError:
            return None

    async def MicrobatchDone(self, request, context):  # noqa: D102, N802
        await self._from_member(context, self.c.microbatch_done, request)
        return pb.Ack()

    async def EvalDone(self, request, context):  # noqa: D102, N802
        await self._from_member(context, self.c.eval_done, request)
        return pb.Ack()

    async def GradNorm(self, request, context):  # noqa: D102, N802
        await self._from_member(context, self.c.grad_norm, request)
        if request.clipped_peers:
            await self._off_loop(self.c.note_clipped, request)  # may write an event to SQLite
        return pb.Ack()

    async def StepApplied(self, request, context):  # noqa: D102, N802
        await self._from_member(context, self.c.step_applied, request)
        return pb.Ack()

    async def Status(self, request, context):  # noqa: D102, N802
        return await self._off_loop(self.c.status)

    async def ReportFailure(self, request, context):  # noqa: D102, N802
        self._probe(await self._from_member(context, self.c.report_failure, request))
        return pb.Ack()

    async def FetchCheckpoint(self, request, context):  # noqa: D102, N802
        await self._check_fetch(context, request)
        chunks = await self._off_loop(
            self.c.checkpoint_state, request.layer_start, request.layer_end, request.steps_done
        )
        if chunks is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoint holds layers "
                                f"[{request.layer_start}, {request.layer_end}) after {request.steps_done} steps")
        # Each chunk reads up to a MiB of a file (or waits for an upload): made on the pool, one at a time, as the
        # stream is read.
        try:
            while (chunk := await self._off_loop(next, chunks, None)) is not None:
                yield chunk
        except LookupError as e:  # the upload it passes on stopped
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def _check_fetch(self, context: grpc.aio.ServicerContext, request: pb.FetchCheckpointRequest) -> None:
        """PERMISSION_DENIED (an offence of the signer's member, if any) unless a live member of the signer's key was
        ordered in the current plan epoch to load, from the coordinator, this state: its stage's layers after
        request.steps_done steps (Coordinator.load_ordered)."""
        key = signer(context)
        if not self.c.load_ordered(key, request.layer_start, request.layer_end, request.steps_done):
            why = (f"layers [{request.layer_start}, {request.layer_end}) after {request.steps_done} steps go only to "
                   "a member ordered to load them from the coordinator in this plan epoch, signed by its key")
            # A member once ordered to load from the coordinator may ask late, after a re-plan: no offence.
            owner = self.c.membership.owner(key)
            late = owner is not None and self.c.orders.load_from_coordinator(owner) is not None
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, why, "FetchCheckpoint",
                               None if late else owner)

    async def ReportProfile(self, request, context):  # noqa: D102, N802
        await self._check_member(context, request)
        try:
            await self._off_loop(self.c.report_profile, request)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown node {request.node_id}: register first")
        except ValueError as e:
            why = f"bad profile from {request.node_id}: {e}"
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, why, "NodeProfileReport", request.node_id)
        return pb.Ack()

    async def Windows(self, request, context):  # noqa: D102, N802
        await self._check_member(context, request)
        try:
            return await self._off_loop(self.c.windows, request)  # reads the data set's shards: off the loop
        except ReportRefused as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def UploadState(self, request_iterator, context):  # noqa: D102, N802
        first = await anext(aiter(request_iterator), None)
        if first is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an empty state upload")
        await self._check_member(context, first)
        try:
            inbox = self.c.upload_inbox(first.node_id, first.request)
        except ReportRefused as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), "StateUpload", first.node_id)
        if first.error:
            await self._off_loop(inbox.end, first.error)
            return pb.Ack()
        # Each chunk waits on the pool until its reader takes it: the reader's pace holds the uploader back.
        uploads = [first] if first.HasField("chunk") else []
        async for upload in _chain(uploads, request_iterator):
            if not await self._off_loop(inbox.put, upload.chunk):
                await context.abort(grpc.StatusCode.CANCELLED, "the coordinator no longer reads this upload")
        await self._off_loop(inbox.end)
        return pb.Ack()

    async def Stop(self, request, context):  # noqa: D102, N802
        # The run owner's act: every volunteer holds the token, only the owner holds the coordinator's key.
        if signer(context) != self.c.key.public:
            why = (
                "only the run owner may end the run: sign the call with the coordinator's key "
                "(geotrain stop --state-dir)"
            )
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, why, "Stop", None)
        await self._off_loop(self.c.end_run, request.reason[:200] or "the run owner stopped the run")  # SQLite
        return pb.Ack()

    async def Probe(self, request_iterator, context):  # noqa: D102, N802
        count = ProbeCount()
        try:
            async for chunk in request_iterator:
                count.add(chunk)
            return count.reply()
        except FrameError as e:
            self._refusals.refused(context.peer(), "Probe", "", str(e))
            await context.abort(e.code, str(e))


class AioServerThread:
    """A grpc.aio server on an event loop in a thread of its own, used from ordinary threads as grpc.Server is:
    start(), and stop(grace), whose result's wait(timeout) waits for the server and its loop to end. `make` builds
    the server on that loop, given the bounded pool its blocking calls run on and the one its own dials run on."""

    def __init__(
        self, make: Callable[[Executor, Executor], Awaitable[tuple[grpc.aio.Server, int]]], name: str,
        blocking_workers: int,
    ) -> None:
        self._blocking = ThreadPoolExecutor(max_workers=blocking_workers, thread_name_prefix=f"{name}-blocking")
        self._dialling = ThreadPoolExecutor(max_workers=_DIAL_WORKERS, thread_name_prefix=f"{name}-dial")
        self._loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        try:
            self._server, self.port = asyncio.run_coroutine_threadsafe(
                make(self._blocking, self._dialling), self._loop).result()
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            raise

    def _serve(self) -> None:
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()
            self._blocking.shutdown(wait=False, cancel_futures=True)
            self._dialling.shutdown(wait=False, cancel_futures=True)
            self._stopped.set()

    def start(self) -> None:
        """Start serving."""
        asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result()

    def stop(self, grace: float | None) -> threading.Event:
        """Stop serving (calls still running after `grace` seconds are cancelled), then end the loop; the event is
        set once it has ended."""

        async def stop_then_end() -> None:
            try:
                await self._server.stop(grace)
            finally:
                self._loop.stop()

        if not self._stopped.is_set():
            try:
                asyncio.run_coroutine_threadsafe(stop_then_end(), self._loop)
            except RuntimeError:  # stopped already: the loop is closed
                pass
        return self._stopped


def make_coordinator_server(
    coordinator: Coordinator, token: str, listen: str, tls: TlsFiles | None = None
) -> tuple[AioServerThread, int]:
    """A server for `coordinator` bound to `listen` (not yet started); returns it and its port."""

    async def make(blocking: Executor, dialling: Executor) -> tuple[grpc.aio.Server, int]:
        limits = PeerLimits(coordinator.cfg.limits.values())
        server, port = make_aio_server(token, listen, blocking, tls, limits)
        dial_back = lambda address, timeout_s: reachability.dial_back(  # noqa: E731
            address, token, COORDINATOR_ID, tls, timeout_s)
        servicer = CoordinatorServicer(coordinator, blocking, limits, dial_back, dialling)
        rpc.add_CoordinatorServicer_to_server(servicer, server)
        return server, port

    server = AioServerThread(make, "coordinator-grpc", _BLOCKING_WORKERS)
    return server, server.port


def stop_run(address: str, token: str, key: NodeKey, reason: str, tls: TlsFiles | None = None) -> None:
    """Ask the coordinator at `address` to end its run for every node, signed with its own `key` (geotrain stop)."""
    channel = make_channel(address, token, lambda: COORDINATOR_ID, tls, key)
    try:
        rpc.CoordinatorStub(channel).Stop(pb.StopRequest(reason=reason), timeout=_STOP_DEADLINE_S)
    finally:
        channel.close()


def stage_state_stream(
    address: str, token: str, steps_done: int, key: NodeKey, tls: TlsFiles | None = None, deadline_s: float = 300.0
) -> Iterator[pb.TensorChunk | framing.WireChunk]:
    """The chunks of a stage's parameters and optimizer state after `steps_done` steps as they arrive from a node
    serving it (statestream.fetch_state), asked with the coordinator's `key` (a node serves its state to no other
    caller outside its plan)."""
    request = pb.FetchStateRequest(steps_done=steps_done)
    return statestream.fetch_state(address, token, COORDINATOR_ID, key, tls, request, deadline_s)


def fetch_stage_state(
    address: str, token: str, steps_done: int, key: NodeKey, tls: TlsFiles | None = None
) -> dict[str, torch.Tensor]:
    """A stage's parameters and optimizer state after `steps_done` steps, downloaded into memory
    (stage_state_stream's)."""
    return framing.read_state(stage_state_stream(address, token, steps_done, key, tls))


async def _chain(first: Iterable[T], rest: AsyncIterable[T]) -> AsyncIterator[T]:
    """`first`'s items, then `rest`'s."""
    for item in first:
        yield item
    async for item in rest:
        yield item


def fetch_model_state(
    plan: pb.Plan, token: str, steps_done: int, key: NodeKey, tls: TlsFiles | None = None
) -> dict[str, torch.Tensor]:
    """The whole model's parameters (no optimizer state), stage by stage from one replica each, fetched with the
    coordinator's `key`."""
    state: dict[str, torch.Tensor] = {}
    for stage in plan.stages:
        tensors = fetch_stage_state(stage.addresses[0], token, steps_done, key, tls)
        state.update({k: v for k, v in tensors.items() if k.startswith("layers.")})
    return state


def dht_listen_maddr(listen_host: str, advertise_host: str, port: int) -> str:
    """Where the coordinator's DHT listens: on its listen host, or, when nodes reach the coordinator at another
    host, on every interface; on `port` (--dht-port, for a firewall rule or a port forward; 0 picks one). The
    advertised host may be a relay's or a NAT's while the gRPC server listens on 127.0.0.1 behind it (the namespace
    WAN); the DHT has no relay and must be reachable itself."""
    return f"{multiaddr_host('0.0.0.0' if advertise_host else listen_host)}/tcp/{port}"


def announced_maddrs(visible: Sequence[str], advertise_host: str) -> list[str]:
    """The DHT's addresses handed to the nodes: those it sees itself, or with an advertised host, that host with the
    DHT's port(s) (one address per port, whatever interfaces it listens on)."""
    if not advertise_host:
        return list(visible)
    announced: list[str] = []
    for maddr in visible:
        _, tcp, port, p2p, peer = maddr.rsplit("/", 4)  # /ip4/HOST/tcp/PORT/p2p/PEER
        if tcp != "tcp" or p2p != "p2p":
            raise ValueError(f"not a /tcp/PORT/p2p/PEER multiaddr: {maddr}")
        address = f"{multiaddr_host(advertise_host)}/tcp/{port}/p2p/{peer}"
        if address not in announced:
            announced.append(address)
    return announced


class DhtProcess:
    """The hivemind DHT that replicas bootstrap from, in a process forked from the forkserver (lifetime.forkserver),
    which has no threads: hivemind forks its DHT process from whoever creates it, and a fork from a process whose
    gRPC threads are busy can leave the child stuck on a lock it inherited. The coordinator needs only the DHT's
    addresses, and only once a plan first has replicas: the DHT starts then (maddrs), so a run whose stages have one
    node each never pays for hivemind's imports, its DHT process and p2pd. The DHT ends when this object is closed or
    its coordinator dies, however it died: its process reads a pipe whose other end only the coordinator holds."""

    def __init__(self, listen_host: str, advertise_host: str = "", port: int = 0) -> None:
        self._host_maddr = dht_listen_maddr(listen_host, advertise_host, port)
        self._advertise_host = advertise_host
        self._lock = threading.Lock()  # the run loop starts it, a test may ask too
        self._started: tuple[BaseProcess, Connection] | None = None
        self._maddrs: list[str] | None = None

    def maddrs(self) -> list[str]:
        """The DHT's addresses as nodes reach them, starting it on the first call; RunAborted if it cannot start."""
        with self._lock:
            if self._maddrs is None:
                self._started = child_with_pipe(_serve_dht, (self._host_maddr,), "geotrain-dht")
                try:
                    visible = ready_message(self._started[1], _DHT_READY_S, "the coordinator's DHT process")
                    self._maddrs = announced_maddrs(visible, self._advertise_host)
                except (RuntimeError, ValueError) as e:
                    self._stop()
                    raise RunAborted(f"replicas cannot average: {e}") from None
            return self._maddrs

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        if self._started is None:
            return
        process, conn = self._started
        self._started = None
        conn.close()
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)


def _serve_dht(host_maddr: str, conn: Connection) -> None:
    """DhtProcess's process: start the DHT, send its addresses, and run it until the coordinator's end of `conn`
    closes. Ctrl+C at a terminal reaches this process too; the coordinator decides when it ends."""
    from hivemind import DHT

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Daemonic, so that multiprocessing ends it if its coordinator exits without closing it; multiprocessing then
    # refuses it children, because it could not end them, but tie_children_to_this_process does.
    multiprocessing.current_process().daemon = False
    tie_children_to_this_process()  # hivemind's DHT process and its p2pd die with this one, even by SIGKILL
    dht = DHT(host_maddrs=[host_maddr], start=True)
    try:
        conn.send([str(m) for m in dht.get_visible_maddrs()])
        conn.recv()  # nothing is ever sent: this returns, by EOFError, once the coordinator's end is closed
    except EOFError:
        pass
    finally:
        dht.shutdown()


def _open_state(state_dir: str | Path | None, resume: bool, keep: int) -> tuple[RunStore, CheckpointStore | None]:
    """The run state and checkpoints in `state_dir` (in memory and none without one), the run given an id; ValueError
    for a run there unless resuming, and for a checkpoint of an older geotrain."""
    store = RunStore(Path(state_dir) / "run.sqlite") if state_dir else RunStore()
    committed = store.committed_steps()
    if committed and not resume:
        store.close()
        raise ValueError(f"{state_dir} holds a run at step {committed}: pass --resume to continue it")
    if not store.get("run_id"):
        store.put("run_id", secrets.token_hex(8))
    checkpoints = CheckpointStore(Path(state_dir) / CHECKPOINTS_DIR, keep) if state_dir else None
    older = [m for m in checkpoints.complete() if m.version < CHECKPOINT_VERSION] if checkpoints else []
    if older:  # their checksums would fail every node that loads them, plan after plan
        store.close()
        raise ValueError(
            f"{older[0].path} was written by an older geotrain: resume with `geotrain coordinator --resume`, "
            "which converts it"
        )
    return store, checkpoints


class CoordinatorProcess:
    """A coordinator with everything it runs on: run state, checkpoints, the hivemind DHT replicas bootstrap from,
    and its gRPC server (bound, not yet started). close() releases all of it. `advertise`: the host nodes reach this
    machine at, if not `listen`'s; the DHT is announced there (dht_listen_maddr), on `dht_port` (0: any free one).
    `pause_on_stop`: a stop of this process pauses the run (RunState.PAUSED), which --resume continues."""

    def __init__(
        self,
        cfg: RunConfig,
        token: str,
        listen: str,
        *,
        state_dir: str | Path | None = None,
        resume: bool = False,
        on_event: EventSink | None = None,
        tls: TlsFiles | None = None,
        advertise: str = "",
        dht_port: int = 0,
        tensorboard: str = "",
        pause_on_stop: bool = False,
    ) -> None:
        self.store, checkpoints = _open_state(state_dir, resume, cfg.scheduler.keep_checkpoints)
        # The coordinator's key outlives a restart with its state dir, as the plans that carry it do.
        key = NodeKey.load_or_create(state_dir)[0] if state_dir else NodeKey.generate()
        self.dht = DhtProcess(listen.rsplit(":", 1)[0].strip("[]"), advertise, dht_port)
        self.metrics = RunMetrics(None)
        try:
            self.metrics = RunMetrics(
                Path(state_dir) / METRICS_FILE if state_dir else None,
                tensorboard_writer(tensorboard) if tensorboard else None,
            )
            self.coordinator = Coordinator(
                cfg,
                store=self.store,
                checkpoints=checkpoints,
                fetch_state=lambda address, steps_done, deadline_s: stage_state_stream(
                    address, token, steps_done, key, tls, deadline_s
                ),
                dht_peers=self.dht.maddrs,
                run_id=self.store.get("run_id", ""),
                on_event=on_event,
                key=key,
                metrics=self.metrics,
                pause_on_stop=pause_on_stop,
            )
            self.server, self.port = make_coordinator_server(self.coordinator, token, listen, tls)
        except BaseException:  # e.g. the port is taken: nothing of this coordinator may stay behind
            self.dht.close()
            self.metrics.close()
            self.store.close()
            raise

    def close(self) -> None:
        """Stop the server and the DHT, and close the run state and its metrics."""
        self.server.stop(grace=1.0).wait(3.0)
        self.dht.close()
        self.metrics.close()
        self.store.close()
