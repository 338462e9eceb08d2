"""State the coordinator cannot download by dialling: it orders a node nobody can dial to upload it
(Order.upload_state), and the node sends it over a call of its own (Coordinator.UploadState).

An upload streams: its chunks pass through a short queue from the call that receives them to whoever reads the
state (a checkpoint's file, or a node loading from the coordinator), so the coordinator holds a few chunks of it at
a time, and a reader that falls behind holds the uploader back through the call's flow control.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator

from geotrain.protocol import geotrain_pb2 as pb
from geotrain.scheduler.orders import OrderQueues

_QUEUED_CHUNKS = 4  # an upload's chunks received and not yet read
_END = object()  # the upload is whole


class UploadInbox:
    """One awaited upload's chunks on their way from its call to its reader."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.taken = False  # an UploadState call feeds it: a second call for the same request is refused
        self.abandoned = threading.Event()  # the reader stopped reading (done, failed or timed out)
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUED_CHUNKS)

    def put(self, chunk: pb.TensorChunk) -> bool:
        """Hand the reader the upload's next chunk, waiting while it is behind; False once it stopped reading."""
        while not self.abandoned.is_set():
            try:
                self._queue.put(chunk, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def end(self, error: str = "") -> None:
        """The upload is whole, or (error) the node says why it cannot send it."""
        item = LookupError(f"{self.node_id} cannot upload its state: {error[:500]}") if error else _END
        while not self.abandoned.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def chunks(self, deadline: float) -> Iterator[pb.TensorChunk]:
        """The chunks as they come; LookupError when the node says it cannot send them, or they are not all in by
        `deadline` (time.monotonic)."""
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise LookupError(f"{self.node_id} did not upload its state in time") from None
            if item is _END:
                return
            if isinstance(item, LookupError):
                raise item
            yield item


class StateUploads:
    """Uploads asked for and not yet read to their end, by request id."""

    def __init__(self, orders: OrderQueues) -> None:
        self._orders = orders
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, UploadInbox] = {}

    def stream(self, node_id: str, steps_done: int, layers: tuple[int, int], timeout_s: float) -> Iterator[pb.TensorChunk]:
        """The chunks of layers [start, end) after steps_done steps, uploaded by node_id as they arrive (the order
        goes out at the first read); LookupError when it says it cannot, or has not uploaded all within timeout_s."""
        request, inbox = next(self._ids), UploadInbox(node_id)
        with self._lock:
            self._waiting[request] = inbox
        try:
            order = pb.UploadState(request=request, steps_done=steps_done, layer_start=layers[0], layer_end=layers[1])
            self._orders.send([node_id], pb.Order(upload_state=order))
            yield from inbox.chunks(time.monotonic() + timeout_s)
        finally:
            inbox.abandoned.set()
            with self._lock:
                self._waiting.pop(request, None)

    def inbox(self, node_id: str, request: int) -> UploadInbox | None:
        """Where the upload of `request` goes, if it is one asked of node_id, still awaited and not yet being sent."""
        with self._lock:
            inbox = self._waiting.get(request)
            if inbox is None or inbox.node_id != node_id or inbox.taken:
                return None
            inbox.taken = True
            return inbox
