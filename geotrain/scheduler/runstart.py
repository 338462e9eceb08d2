"""A coordinator's lifetime for `geotrain coordinator` and `geotrain demo`: its process, status page and run, then
what its nodes are told and how the run ended."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from geotrain.config import RunConfig
from geotrain.lifetime import start_forkserver
from geotrain.protocol.tls import TlsFiles
from geotrain.scheduler.coordinator import Coordinator, RunState
from geotrain.scheduler.errors import RunAborted
from geotrain.scheduler.http import StatusPageProcess
from geotrain.scheduler.membership import EventSink
from geotrain.scheduler.service import CoordinatorProcess
from geotrain.scheduler.summary import RunSummary


class RunEnd(enum.Enum):
    """How a served run ended."""

    COMPLETE = "complete"  # every step committed, and the final model saved if asked for
    FAILED = "failed"  # aborted by a failure, or its final model could not be saved
    INTERRUPTED = "interrupted"  # stopped by a signal or by its owner, or paused


class StatusPageFailed(Exception):
    """The status page could not listen where it was asked to (the OS's reason)."""


@dataclass(frozen=True, kw_only=True)
class RunStart:
    """What a coordinator's run starts from, its flags checked."""

    cfg: RunConfig  # built once, with its corpus's fingerprint
    token: str
    listen: str  # host:port, the host resolved to an address
    state_dir: str | None = None
    resume: bool = False
    tls: TlsFiles | None = None
    advertise: str = ""  # the host nodes reach this machine at, if not the listen host
    dht_port: int = 0
    tensorboard: str = ""
    http_listen: str | None = None  # the status page's host:port (None: no page)
    http_host: str = ""  # its host as the run owner gave it, for the line that names the page
    http_token: str | None = None
    http_linger_s: float = 0.0  # how long the page stays up after the run ends
    save_final: Path | None = None
    model_metadata: dict[str, str] = field(default_factory=dict)  # the final model file's header
    preload: list[str] = field(default_factory=list)  # what the forkserver imports, unless started already
    pause_on_stop: bool = False  # a stop of this process pauses the run (its nodes wait for --resume)


@dataclass(frozen=True, kw_only=True)
class RunHooks:
    """What the command serving the run hears as it goes."""

    say: Callable[[str], None]  # a progress line
    warn: Callable[[str], None]  # why the run ended short of its steps, or without its final model
    finished: Callable[[RunSummary], None]  # the run completed: its summary, before the page's linger
    on_event: EventSink = lambda kind, data: None
    # Once the coordinator is bound, before it serves: its port, and the event that stops the run when set.
    listening: Callable[[int, threading.Event], None] = lambda port, stop: None
    stop_reason: Callable[[], str | None] = lambda: None  # why the command stopped the run itself, if it did


def serve_run(start: RunStart, hooks: RunHooks) -> RunEnd:
    """Serve a coordinator until its run ends, and tell its nodes how it ended; StatusPageFailed when the page
    cannot listen. Nothing of it is left running on return."""
    start_forkserver(start.preload)
    process = CoordinatorProcess(
        start.cfg, start.token, start.listen, state_dir=start.state_dir, resume=start.resume,
        on_event=hooks.on_event, tls=start.tls, advertise=start.advertise, dht_port=start.dht_port,
        tensorboard=start.tensorboard, pause_on_stop=start.pause_on_stop,
    )
    coordinator = process.coordinator
    http = (
        StatusPageProcess(coordinator.status, start.http_listen, start.http_token)
        if start.http_listen is not None else None
    )
    try:
        hooks.listening(process.port, coordinator.stop_requested)
        process.server.start()
        if http is not None:
            try:
                http_port = http.start()
            except OSError as e:
                raise StatusPageFailed(e.strerror) from None
            hooks.say(f"status page at http://{start.http_host}:{http_port}/")
        return _run_to_end(coordinator, start, hooks)
    finally:
        if http is not None:
            if http.serving:
                # Keep the page up a while after the run ends so a watcher sees how it ended; Ctrl+C cuts it short.
                coordinator.stop_requested.wait(start.http_linger_s)
            http.stop()
        process.close()


def _run_to_end(coordinator: Coordinator, start: RunStart, hooks: RunHooks) -> RunEnd:
    """Run, save the final model if asked for, and shut the nodes down with the reason the run ended."""
    try:
        summary = coordinator.run()
    except RunAborted as e:
        why = hooks.stop_reason()
        if coordinator.ended_by_owner is not None:
            ended = f"the run owner ended the run: {coordinator.ended_by_owner}"
            hooks.warn(ended)
            coordinator.shutdown_nodes(ended)  # not a failure of the nodes: they exit 0
            return RunEnd.INTERRUPTED
        if coordinator.state is RunState.PAUSED:
            # The nodes keep their state and wait for this coordinator to come back (link.py).
            hooks.warn(
                f"coordinator stopped; the run is paused, its nodes wait for `geotrain coordinator --resume "
                f"--state-dir {start.state_dir}` (`geotrain stop` ends the run for them)"
            )
            return RunEnd.INTERRUPTED
        hooks.warn(why or f"run aborted: {e}")
        coordinator.shutdown_nodes(f"run aborted: {why or e}", aborted=True)
        return RunEnd.INTERRUPTED if coordinator.stop_requested.is_set() and why is None else RunEnd.FAILED
    if start.save_final is not None:
        try:
            start.save_final.parent.mkdir(parents=True, exist_ok=True)
            coordinator.save_model(start.save_final, summary.steps, start.model_metadata)
        except (LookupError, grpc.RpcError, OSError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            hooks.warn(f"cannot save the final model: {why}")
            coordinator.shutdown_nodes("run complete")
            return RunEnd.FAILED
        hooks.say(f"saved the final model to {start.save_final}")
    coordinator.shutdown_nodes("run complete")
    hooks.finished(summary)
    return RunEnd.COMPLETE
