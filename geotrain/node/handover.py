"""Stage state a node keeps after a new plan moved it to other layers, until those layers have their new holders.

A plan epoch may move a node's layers to another node and give it other layers (after a coordinator restart the
planner swapped two nodes' stages: each dropped its state before the other had fetched it, and the run waited
through two step timeouts). So a node lets go of a layer range only once no one can still need it: it keeps the
runtime it held, at its committed step, and serves FetchState from it until the run has committed past that step
(the node applies a newer step, or a plan says the run stands at another step). A later plan that gives the node
those layers back takes the kept copy instead of starting afresh.

It also keeps the snapshots a node serves its state from: a transfer of step k's state goes on after the node
applied step k+1 (the coordinator writes its checkpoint while the run trains), without a second copy in memory.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator

import numpy as np
import torch

from geotrain.durable import AlignedBuffer, ScratchFile
from geotrain.node.stage import StageRuntime
from geotrain.protocol import framing

log = logging.getLogger(__name__)

LayerRange = tuple[int, int]


class HeldStates:
    """Runtimes of layer ranges this node no longer serves, each at the committed step it held; not thread-safe
    (the agent calls it under its state lock)."""

    def __init__(self) -> None:
        self._held: dict[LayerRange, StageRuntime] = {}

    def keep(self, runtime: StageRuntime, steps_done: int) -> None:
        """Keep a runtime the node is moving away from if it holds the run's committed step (steps_done); one that
        never applied a step is the seed's, which any node rebuilds."""
        if runtime.applied_step >= 0 and runtime.applied_step + 1 == steps_done:
            runtime.reset_step()  # its uncommitted gradients and activations belong to an abandoned epoch
            self._held[(runtime.start, runtime.end)] = runtime

    def take(self, layers: LayerRange, steps_done: int) -> StageRuntime | None:
        """The kept runtime of `layers` at steps_done, handed back to serve (no longer kept here), or None."""
        runtime = self.get(layers, steps_done)
        if runtime is not None:
            del self._held[layers]
        return runtime

    def get(self, layers: LayerRange, steps_done: int) -> StageRuntime | None:
        """The kept runtime of `layers` if it holds the state after steps_done steps, else None."""
        runtime = self._held.get(layers)
        return runtime if runtime is not None and runtime.applied_step + 1 == steps_done else None

    def release_except(self, steps_done: int) -> None:
        """Let go of every copy not at steps_done: the run has committed past it (or rolled back to a checkpoint)."""
        self._held = {k: r for k, r in self._held.items() if r.applied_step + 1 == steps_done}


TRANSFER_BUFFER_BYTES = 6 * framing.CHUNK_BYTES
"""Host memory one state transfer in flight holds beyond the stage's own tensors: the chunk being read, those gRPC
holds behind it, and the chunks the snapshot's writer ahead and its preserve() copy through to the file."""


def transfer_memory_bytes(transfers: int = 1) -> int:
    """Host bytes a node holds for state snapshots and transfer buffers while `transfers` state transfers run at once
    (serving or loading), beyond its stage's own state: a snapshot keeps the tensors it has not sent yet in a file,
    not in memory, once the stage changes them (StateSnapshot.preserve), and a stage loading its state takes each
    chunk straight into its own tensors. The file is written past the page cache."""
    return transfers * TRANSFER_BUFFER_BYTES


class StateSnapshot:
    """The state of a stage at one committed step, served tensor by tensor while the stage may move on (a checkpoint
    is written while the run trains): each tensor is read from the live stage itself until the stage is about to
    change it (preserve(), under the state lock, before an optimizer step or a load), and from a copy in a file (in
    `spill_dir`, deleted when closed) after. The copies are made by write_ahead() on a thread of their own, last
    tensor first, while the transfer sends from the first: what they have not covered between them when the stage
    changes, preserve() copies on the optimizer step's path. So the snapshot costs no memory, and its file costs the
    step little. Tensors are served in name order (the coordinator computes the stage's checksum as they pass)."""

    def __init__(self, items: list[tuple[str, torch.Tensor]], spill_dir: str) -> None:
        self._items: list[tuple[str, torch.Tensor | None]] = sorted(items, key=lambda item: item[0])
        self._meta = [(t.dtype, tuple(t.shape)) for _, t in self._items]
        self._lock = threading.Lock()
        self._sent = 0  # tensors before this index were sent: no one needs them again
        self._changed = False  # the stage may have changed its tensors: the copies are the snapshot's
        self._copies: dict[int, int] = {}  # index -> its offset in the spill file
        self._spill_dir = spill_dir
        self._spill: ScratchFile | None = None
        self._writing = False  # write_ahead is writing to the file outside the lock: it closes the file if closed
        self._chunk = AlignedBuffer(framing.CHUNK_BYTES)  # what _read hands out
        self._closed = False

    @property
    def nbytes(self) -> int:
        """The bytes of the state."""
        return sum(self._size(i) for i in range(len(self._meta)))

    def _size(self, i: int) -> int:
        dtype, shape = self._meta[i]
        return math.prod(shape) * dtype.itemsize

    def sources(self) -> Iterator[framing.StateSource]:
        """The tensors as a state transfer sends them (framing.state_stream)."""
        for i, (name, _) in enumerate(self._items):
            dtype, shape = self._meta[i]
            yield framing.StateSource(
                name, dtype, shape, lambda i=i: self._crc32(i), lambda at, n, i=i: self._read(i, at, n)
            )
            with self._lock:
                self._sent = i + 1
                self._items[i] = (name, None)

    def _live(self, i: int) -> torch.Tensor:
        tensor = self._items[i][1]
        assert tensor is not None
        return framing.flat_bytes(tensor if tensor.is_contiguous() else tensor.contiguous())

    def _live_part(self, i: int, at: int, n: int) -> np.ndarray:
        part = self._live(i)[at : at + n]
        return part.numpy() if part.device.type == "cpu" else part.cpu().numpy()

    def _crc32(self, i: int) -> int:
        """Tensor i's crc32 (a gRPC header's), computed outside the lock (a stage's optimizer step waits for it): if
        the stage was about to change the tensor meanwhile, preserve() kept it first and its copy's is the one."""
        with self._lock:
            if self._changed:
                return self._copy_crc32(i)
            flat = self._live(i)
        crc = framing.tensor_crc32(flat)
        with self._lock:
            return self._copy_crc32(i) if self._changed else crc

    def _copy_crc32(self, i: int) -> int:
        """The crc32 of tensor i's copy in the spill file (under the lock)."""
        assert self._spill is not None
        crc, size = 0, self._size(i)
        for at in range(0, size, framing.CHUNK_BYTES):
            data = self._spill.read(self._copies[i] + at, self._chunk, min(framing.CHUNK_BYTES, size - at))
            crc = framing.crc32(data, crc)
        return crc

    def _read(self, i: int, at: int, n: int) -> memoryview | bytes:
        """Bytes of tensor i, valid until the next read: a live tensor's are copied out under the lock (the stage may
        change it once the lock is let go), into a buffer numpy fills without holding the GIL (the reader may run at
        the lowest CPU priority: held back by the scheduler, it must not hold back the node's other threads)."""
        with self._lock:
            if self._changed:
                assert self._spill is not None
                return self._spill.read(self._copies[i] + at, self._chunk, n)
            return self._chunk.view[: self._chunk.fill(self._live_part(i, at, n))]

    def write_ahead(self) -> None:
        """Copy the tensors the transfer has not reached to the spill file, last first, until the transfer reaches
        them, the stage changes or the snapshot closes (a thread's whole work). Each piece is taken under the lock
        and written outside it, so the optimizer step's preserve() never waits for a disk. It runs at the thread's
        own priority, not the transfer's lowest: its CPU is one copy per byte, the disk does the rest, and behind a
        busy pipeline it would not be done when the stage changes (half a GB a node left for preserve in
        bench/scale.py)."""
        buffer = AlignedBuffer(framing.CHUNK_BYTES)
        for i in reversed(range(len(self._items))):
            with self._lock:
                if self._closed or self._changed or i <= self._sent:
                    return
                spill, size = self._file(), self._size(i)
                offset = spill.reserve(size)
                self._writing = True
            try:
                for at in range(0, size, framing.CHUNK_BYTES):
                    with self._lock:
                        if self._closed or self._changed:
                            return
                        n = buffer.fill(self._live_part(i, at, framing.CHUNK_BYTES))
                    spill.write(offset + at, buffer, n)
            finally:
                with self._lock:
                    self._writing = False
                    if self._closed:
                        self._close_file()
            with self._lock:
                self._copies.setdefault(i, offset)

    def _file(self) -> ScratchFile:
        if self._spill is None:
            self._spill = ScratchFile(self._spill_dir)
        return self._spill

    def preserve(self) -> int:
        """Copy the tensors neither sent nor written ahead to the spill file: the stage is about to change them (call
        under the state lock, which every change of the stage's tensors holds). The bytes it copied."""
        with self._lock:
            if self._closed or self._changed:
                return 0
            self._changed = True
            unsent = [i for i in range(self._sent, len(self._items)) if i not in self._copies]
            ahead = sum(self._size(i) for i in self._copies if i >= self._sent)
            started, buffer = time.monotonic(), AlignedBuffer(framing.CHUNK_BYTES)
            for i in unsent:  # no crc32 here, on the optimizer step's path: a gRPC header asks it of the file
                spill, size = self._file(), self._size(i)
                self._copies[i] = offset = spill.reserve(size)
                for at in range(0, size, framing.CHUNK_BYTES):
                    spill.write(offset + at, buffer, buffer.fill(self._live_part(i, at, framing.CHUNK_BYTES)))
            self._items = [(name, None) for name, _ in self._items]
            copied = sum(self._size(i) for i in unsent)
            log.info(
                "the stage changes before its snapshot was sent: %.0f MB of it were written ahead, %.0f MB kept in a "
                "file now (%.2f s)", ahead / 1e6, copied / 1e6, time.monotonic() - started,
            )
            return copied

    def close(self) -> None:
        """The transfer ended: let go of the tensors and the file (once write_ahead lets go of it)."""
        with self._lock:
            self._closed = True
            self._items = [(name, None) for name, _ in self._items]
            if not self._writing:
                self._close_file()

    def _close_file(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None


class Snapshots:
    """The snapshots a node is serving, with the stage runtime each reads (thread-safe)."""

    def __init__(self, spill_dir: str) -> None:
        self._spill_dir = spill_dir
        self._lock = threading.Lock()
        self._open: list[tuple[StageRuntime, StateSnapshot]] = []

    def open(self, runtime: StageRuntime) -> StateSnapshot:
        """A snapshot of the runtime's state as it is now (call under the state lock); close it with close()."""
        snapshot = StateSnapshot(runtime.full_state(), self._spill_dir)
        with self._lock:
            self._open.append((runtime, snapshot))
        threading.Thread(target=snapshot.write_ahead, name="snapshot-write-ahead", daemon=True).start()
        return snapshot

    def close(self, snapshot: StateSnapshot) -> None:
        """The transfer of `snapshot` ended."""
        snapshot.close()
        with self._lock:
            self._open = [(r, s) for r, s in self._open if s is not snapshot]

    def preserve(self, runtime: StageRuntime) -> None:
        """Keep what the open snapshots of `runtime` have not sent: it is about to change (call under the state
        lock)."""
        with self._lock:
            serving = [s for r, s in self._open if r is runtime]
        for snapshot in serving:
            snapshot.preserve()
