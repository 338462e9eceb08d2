"""The node's worker: one thread does all compute and state changes, taking tasks from a priority queue (control
first, then backward, then forward, as 1F1B prefers draining). A task tagged with a plan epoch is dropped once that
epoch is over; a task that fails reports this node failing in its epoch to the coordinator at once."""

from __future__ import annotations

import itertools
import logging
import queue
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures

from geotrain.compression.policy import StageTimer
from geotrain.node.device import TaskClock, TaskSpan, use_in_this_thread
from geotrain.node.failures import StageFailure, self_report
from geotrain.node.profiler import stretch
from geotrain.protocol import geotrain_pb2 as pb

log = logging.getLogger(__name__)

# Task priorities: lower runs first. Validation forwards come after training and are not timed: the stage's compute
# time per training microbatch is what the codec policy and the coordinator's cost model read. A verifier's recompute
# of another node's work (node/verifier.py) comes last, in the time the worker would idle.
CONTROL, BACKWARD, FORWARD, EVAL, VERIFY = 0, 1, 2, 3, 4
_TIMED = {FORWARD: "forward", BACKWARD: "backward"}


class Worker:
    """The Agent's task queue and worker loop (a part of Agent: it reads the plan and sends through its link)."""

    _tasks: queue.PriorityQueue
    _seq: itertools.count
    _sender: futures.ThreadPoolExecutor  # sends tensors and reports so compute never waits on the network
    compute: StageTimer
    _newest_epoch: int  # newest plan epoch ordered (the worker may not have applied it yet)
    _reported_epoch: int  # plan epoch this node last reported itself failing in: one report fails it
    _timed: tuple[int, dict[str, list[float]]]  # (plan epoch, its timed tasks' seconds by kind since the commit)
    _spans: deque[tuple[str, int | None, TaskSpan]]  # timed tasks whose device work may not be done: kind, epoch
    _clock: TaskClock
    _running: tuple[str, int | None, TaskSpan] | None  # the timed task (or part of one) on the worker thread now
    _held_sends: list[Callable[[], None]] | None  # what the stretched task running now sends, once it is stretched

    def _submit(self, priority: int, task: Callable[[], None], epoch: int | None = None) -> None:
        """Queue a task; one tagged with a plan epoch is dropped if the epoch has changed by the time it runs."""
        self._tasks.put((priority, next(self._seq), task, epoch))

    def _work_loop(self) -> None:
        use_in_this_thread(self.device)
        self._clock, self._spans, self._running = TaskClock(self.device), deque(), None
        while not self.stopped.is_set():
            priority, _, task, epoch = self._tasks.get()
            if task is None:
                return
            if epoch is not None and (self.plan is None or self.plan.epoch != epoch):
                continue
            started = time.monotonic()
            if priority in _TIMED:
                self._running = (_TIMED[priority], epoch, self._clock.start())
            # Emulated slower hardware stretches every compute task, not the control ones, and what the task sends
            # leaves when the stretched task ends, as it would from a machine that slow (sent at once, a slow stage's
            # tensors would reach its neighbours a stretch early, and the pipeline would outrun the emulated one).
            stretched = epoch is not None and self.options.slowdown > 1.0
            self._held_sends = [] if stretched else None
            try:
                task()
            except Exception as e:
                self._task_failed(e)
            if stretched:
                stretch(started, self.options.slowdown)
                held, self._held_sends = self._held_sends or [], None
                for send in held:
                    self._sender.submit(send)
            if self._running is not None:
                self._end_running()
            self._settle_spans(wait=False)

    def time_rest_as(self, kind: str) -> None:
        """Count the rest of the running timed task as `kind`: the last stage's forward task also computes the loss
        and its backward, which belong to the backward share. An emulated slowdown's stretch counts with the task's
        last part."""
        if self._running is not None:
            epoch = self._running[1]
            self._end_running()
            self._running = (kind, epoch, self._clock.start())

    def _end_running(self) -> None:
        kind, epoch, span = self._running
        self._clock.end(span)
        self._spans.append((kind, epoch, span))
        self._running = None

    def _settle_spans(self, wait: bool) -> None:
        """Count the timed tasks whose device work is done (all of them, waiting, if `wait`), in the order they ran."""
        while self._spans:
            kind, epoch, span = self._spans[0]
            seconds = span.seconds(wait)
            if seconds is None:
                return
            self._spans.popleft()
            self.compute.observe(kind, seconds)
            if self._timed[0] != epoch:  # an abandoned epoch's tasks count not
                self._timed = (epoch, {})
            self._timed[1].setdefault(kind, []).append(seconds)

    def take_task_s(self, epoch: int) -> dict[str, float]:
        """Seconds of training compute per microbatch by task kind ("forward", "backward": the median task, emulated
        slowdown included) since the last call in plan epoch `epoch`, a kind absent for none; read by the commit, on
        the worker thread that times the tasks. Medians: a step's first tasks also pay once for what its later ones
        reuse (connections, buffers), which a mean would spread over them all."""
        self._settle_spans(wait=True)
        tasks = self._timed[1] if self._timed[0] == epoch else {}
        self._timed = (epoch, {})
        return {kind: statistics.median(seconds) for kind, seconds in tasks.items()}

    def _task_failed(self, error: Exception) -> None:
        """Tell the coordinator at once that this node cannot take part in the current epoch (rather than let the
        step time out), unless a newer plan has already abandoned the epoch the task belonged to."""
        plan, runtime = self.plan, self.runtime
        if plan is None:  # nothing to fail yet (e.g. timing the layers): the coordinator sees no profile
            log.error("task failed", exc_info=error)
            return
        if plan.epoch != self._newest_epoch or plan.epoch == self._reported_epoch:
            log.debug("task failed in plan epoch %d, abandoned or reported already: %r", plan.epoch, error)
            return
        self._reported_epoch = plan.epoch
        report = self_report(self.node_id, error, plan.epoch, runtime.applied_step + 1 if runtime else 0)
        why = pb.FailureReason.Name(report.reason)
        log.warning(
            "cannot take part in plan epoch %d (%s): %s", plan.epoch, why, report.detail,
            exc_info=not isinstance(error, StageFailure),
        )
        self._sender.submit(self._send_failure_report, report)
