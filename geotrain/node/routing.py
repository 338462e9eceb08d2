"""Choosing which replica of the next stage gets a microbatch, by expected finish time (as SWARM's balancer).

Each candidate's expected finish time is (its microbatches in flight + 1) x its measured seconds per microbatch
(an exponential moving average of send-to-gradient-back times); a replica not measured yet is assumed as fast as
the fastest known one, so new replicas get tried. The smallest expected time wins, ties by plan order.
"""

from __future__ import annotations

import heapq
import threading
import time

_EWMA = 0.3


class ReplicaRouter:
    """Tracks in-flight microbatches and service times per peer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._seconds: dict[str, float] = {}
        self._sent_at: dict[tuple[str, int, int], float] = {}

    def pick(self, candidates: list[str]) -> str:
        """The candidate expected to finish one more microbatch first."""
        with self._lock:
            known = [self._seconds[c] for c in candidates if c in self._seconds]
            default = min(known) if known else 1.0
            heap = [
                ((self._in_flight.get(c, 0) + 1) * self._seconds.get(c, default), i, c) for i, c in enumerate(candidates)
            ]
            heapq.heapify(heap)
            return heap[0][2]

    def sent(self, peer: str, step: int, microbatch: int) -> None:
        """A microbatch went to peer."""
        with self._lock:
            self._in_flight[peer] = self._in_flight.get(peer, 0) + 1
            self._sent_at[(peer, step, microbatch)] = time.monotonic()

    def awaits(self, peer: str, step: int, microbatch: int) -> bool:
        """Whether the microbatch went to peer and its gradient has not come back yet."""
        with self._lock:
            return (peer, step, microbatch) in self._sent_at

    def returned(self, peer: str, step: int, microbatch: int) -> None:
        """The microbatch's gradient came back from peer: update its service time."""
        with self._lock:
            started = self._sent_at.pop((peer, step, microbatch), None)
            if started is None:
                return
            self._in_flight[peer] = max(0, self._in_flight.get(peer, 0) - 1)
            elapsed = time.monotonic() - started
            previous = self._seconds.get(peer)
            self._seconds[peer] = elapsed if previous is None else (1 - _EWMA) * previous + _EWMA * elapsed

    def reset(self) -> None:
        """Forget what is in flight (a new plan epoch abandons it); keep the measured speeds."""
        with self._lock:
            self._in_flight.clear()
            self._sent_at.clear()
