"""The run's status rendered a few times a second at most, however many viewers ask and however fast the run goes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from geotrain.protocol import geotrain_pb2 as pb

# How stale the status may be between events: heartbeat ages and link counters move without one.
_MAX_AGE_S = 0.5
# After an event the status is rendered again once the last rendering is this old: a fast run has dozens of events a
# second, and a rendering reads every step's history from SQLite.
_MIN_AGE_S = 0.2


class StatusCache:
    """Holds the last rendering of the status; renders again when it is older than _MAX_AGE_S, or than _MIN_AGE_S
    after stale() said something happened."""

    def __init__(self, render: Callable[[], pb.StatusReply]) -> None:
        self._render = render
        self._lock = threading.Lock()
        self._reply: pb.StatusReply | None = None
        self._at = float("-inf")
        self._stale = False  # an event since it was rendered

    def stale(self) -> None:
        """Something the status shows changed."""
        self._stale = True

    def get(self) -> pb.StatusReply:
        """The status (shared: do not modify it)."""
        with self._lock:
            now = time.monotonic()
            age = now - self._at
            if age > _MAX_AGE_S or (self._stale and age > _MIN_AGE_S):
                self._stale = False
                self._reply, self._at = self._render(), now
            assert self._reply is not None
            return self._reply
