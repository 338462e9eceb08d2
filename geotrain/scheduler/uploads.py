"""State the coordinator cannot download by dialling: it orders a node nobody can dial to upload it
(Order.upload_state), and the node sends it over a call of its own (Coordinator.UploadState)."""

from __future__ import annotations

import itertools
import threading
from concurrent import futures
from typing import Any

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.orders import OrderQueues


class StateUploads:
    """Uploads asked for and not yet received, by request id."""

    def __init__(self, orders: OrderQueues) -> None:
        self._orders = orders
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[str, futures.Future]] = {}

    def fetch(self, node_id: str, steps_done: int, layers: tuple[int, int], timeout_s: float) -> dict[str, Any]:
        """Layers [start, end) after steps_done steps, uploaded by node_id; LookupError when it says it cannot or does
        not within timeout_s."""
        request, done = next(self._ids), futures.Future()
        with self._lock:
            self._waiting[request] = (node_id, done)
        order = pb.UploadState(request=request, steps_done=steps_done, layer_start=layers[0], layer_end=layers[1])
        self._orders.send([node_id], pb.Order(upload_state=order))
        try:
            return done.result(timeout_s)
        except futures.TimeoutError:
            raise LookupError(f"{node_id} did not upload its state within {timeout_s:.0f} s") from None
        finally:
            with self._lock:
                self._waiting.pop(request, None)

    def expects(self, node_id: str, request: int) -> bool:
        """Whether request is an upload asked of node_id and still awaited."""
        with self._lock:
            return self._waiting.get(request, ("", None))[0] == node_id

    def received(self, request: int, state: dict[str, Any] | None, error: str = "") -> None:
        """The upload of `request`: its state, or why the node could not send it."""
        with self._lock:
            waiting = self._waiting.pop(request, None)
        if waiting is not None:
            if state is None:
                waiting[1].set_exception(LookupError(f"{waiting[0]} cannot upload its state: {error[:500]}"))
            else:
                waiting[1].set_result(state)
