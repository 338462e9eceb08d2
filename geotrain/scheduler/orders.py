"""Per-node order queues: the coordinator puts orders, each node's open Orders stream takes them.

A node that registers again gets a fresh queue, which ends the stream of its previous incarnation. A shutdown
broadcast waits until every stream has taken its order, or until a deadline.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from geotrain.protocol import geotrain_pb2 as pb

# A stream re-checks that its peer is still there this often when no order comes.
_IDLE_CHECK_S = 0.25


class OrderQueues:
    """One queue of orders per node, safe to use from any thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: dict[str, deque[pb.Order]] = {}

    def open(self, node_id: str) -> None:
        """Give node_id a fresh, empty queue (a new incarnation: orders for the old one are void)."""
        with self._cond:
            self._queues[node_id] = deque()
            self._cond.notify_all()

    def close(self, node_id: str) -> None:
        """Drop node_id's queue: its stream ends (the node is dead)."""
        with self._cond:
            self._queues.pop(node_id, None)
            self._cond.notify_all()

    def send(self, node_ids: list[str], order: pb.Order) -> None:
        """Queue order for each node that has a queue."""
        with self._cond:
            for node_id in node_ids:
                queue = self._queues.get(node_id)
                if queue is not None:
                    queue.append(order)
            self._cond.notify_all()

    def stream(self, node_id: str, is_active: Callable[[], bool]) -> Iterator[pb.Order]:
        """node_id's orders as they come, until the stream closes, the queue is replaced or dropped, or a shutdown
        order has been handed out; KeyError for a node without a queue."""
        with self._cond:
            queue = self._queues.get(node_id)
        if queue is None:
            raise KeyError(node_id)
        while is_active():
            with self._cond:
                while not queue and self._queues.get(node_id) is queue:
                    if not self._cond.wait(_IDLE_CHECK_S):
                        break
                if self._queues.get(node_id) is not queue:
                    return
                order = queue.popleft() if queue else None
                if order is not None:
                    self._cond.notify_all()  # a shutdown broadcast waits for queues to drain
            if order is None:
                continue
            yield order
            if order.WhichOneof("kind") == "shutdown":
                return

    def broadcast_shutdown(self, node_ids: list[str], reason: str, grace_s: float) -> None:
        """Send a shutdown order to node_ids and wait until their streams have taken it, at most grace_s."""
        self.send(node_ids, pb.Order(shutdown=pb.Shutdown(reason=reason)))
        deadline = time.monotonic() + grace_s
        with self._cond:
            while any(self._queues.get(n) for n in node_ids):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)
