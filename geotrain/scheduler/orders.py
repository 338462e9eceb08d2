"""Per-node order queues: the coordinator's threads put orders, each node's open Orders stream takes them.

The streams are async generators on the gRPC server's event loop, so an open stream holds no thread: a stream with
nothing to deliver awaits an asyncio.Event that a sender sets through loop.call_soon_threadsafe. A node that
registers again gets a fresh queue, which ends the stream of its previous incarnation. A shutdown broadcast waits
until every stream has taken its order, or until a deadline.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

from geotrain.protocol import geotrain_pb2 as pb


class _Queue:
    """One incarnation's orders, and how to wake the streams that wait on them."""

    def __init__(self) -> None:
        self.orders: deque[pb.Order] = deque()
        self.loop: asyncio.AbstractEventLoop | None = None  # set when a stream first attaches
        self.ready = asyncio.Event()  # binds to the loop of the first stream that waits on it

    def wake(self) -> None:
        """Wake its streams (from any thread); a no-op before a stream attached or once the loop closed."""
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self.ready.set)
            except RuntimeError:  # the server's loop is closed: there is no stream left to wake
                pass


class OrderQueues:
    """One queue of orders per node: send and broadcast from any thread, streams on an event loop."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: dict[str, _Queue] = {}
        # node -> the last LoadState order it was sent that names the coordinator as the source: what FetchCheckpoint
        # may give it (loads_from_coordinator).
        self._loads: dict[str, pb.LoadState] = {}

    def open(self, node_id: str) -> None:
        """Give node_id a fresh, empty queue (a new incarnation: orders for the old one are void)."""
        with self._cond:
            old = self._queues.get(node_id)
            self._queues[node_id] = _Queue()
            self._loads.pop(node_id, None)
            self._cond.notify_all()
        if old is not None:
            old.wake()

    def close(self, node_id: str) -> None:
        """Drop node_id's queue: its stream ends (the node is dead)."""
        with self._cond:
            old = self._queues.pop(node_id, None)
            self._loads.pop(node_id, None)
            self._cond.notify_all()
        if old is not None:
            old.wake()

    def send(self, node_ids: list[str], order: pb.Order) -> None:
        """Queue order for each node that has a queue."""
        woken = []
        with self._cond:
            for node_id in node_ids:
                queue = self._queues.get(node_id)
                if queue is not None:
                    queue.orders.append(order)
                    woken.append(queue)
                    if order.WhichOneof("kind") == "load_state" and not order.load_state.source_address:
                        self._loads[node_id] = order.load_state
        for queue in woken:
            queue.wake()

    def load_from_coordinator(self, node_id: str) -> pb.LoadState | None:
        """The last order node_id (this incarnation) was sent to load a state from the coordinator, if any: the
        only state FetchCheckpoint gives it."""
        with self._cond:
            return self._loads.get(node_id)

    def stream(self, node_id: str) -> AsyncIterator[pb.Order]:
        """node_id's orders as they come, until the stream is cancelled, the queue is replaced or dropped, or a
        shutdown order has been handed out; KeyError (now, not when iterated) for a node without a queue."""
        with self._cond:
            queue = self._queues.get(node_id)
        if queue is None:
            raise KeyError(node_id)
        return self._deliver(node_id, queue)

    async def _deliver(self, node_id: str, queue: _Queue) -> AsyncIterator[pb.Order]:
        with self._cond:
            queue.loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._queues.get(node_id) is not queue:
                    return
                if queue.orders:
                    order = queue.orders.popleft()
                    self._cond.notify_all()  # a shutdown broadcast waits for queues to drain
                else:
                    # Cleared while the queue is seen empty under the lock: a send after this appends first and
                    # then sets the event, so no order is missed.
                    order = None
                    queue.ready.clear()
            if order is None:
                await queue.ready.wait()
                continue
            yield order
            if order.WhichOneof("kind") == "shutdown":
                return

    def broadcast_shutdown(self, node_ids: list[str], shutdown: pb.Shutdown, grace_s: float) -> None:
        """Send a shutdown order to node_ids and wait until their streams have taken it, at most grace_s."""
        self.send(node_ids, pb.Order(shutdown=shutdown))
        deadline = time.monotonic() + grace_s
        with self._cond:
            while any(q.orders for n in node_ids if (q := self._queues.get(n)) is not None):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)
