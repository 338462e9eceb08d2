"""Checkpoints on the coordinator: per-stage safetensors files plus a manifest written last.

A checkpoint is written into a temporary directory, every file fsynced, the manifest written to a temporary name,
fsynced and renamed, then the directory renamed into place and its parent fsynced. A directory without its
manifest is not a checkpoint: a crash at any point leaves the previous complete one as the latest.

No file is ever whole in memory: a stage file is written tensor by tensor, chunk by chunk, as its state streams in
(StageFileWriter: the data after a space reserved for the safetensors header, which is written last, once every
tensor's shape and offset is known), with the stage's checksum and each tensor's crc32 computed as the bytes pass;
and it is read tensor by tensor (StageFile: only the tensors of the layers asked, straight from the file).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from geotrain.durable import SequentialFile, fsync
from geotrain.protocol import framing
from geotrain.protocol import geotrain_pb2 as pb
from geotrain.protocol.framing import FrameError

log = logging.getLogger(__name__)

_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"
CHECKPOINTS_DIR = "checkpoints"
"""Where a coordinator's --state-dir keeps its checkpoints."""
CHECKPOINT_VERSION = 3
"""The manifest's format: 3 records each stage's checksum (stage_checksum: blake3 over its parameters in name order);
2 the same by sha256; 1 (a manifest without a version) sha256 in the stage's own order, layer by layer. `--resume`
converts the older ones (geotrain.upgrade)."""


@dataclass(frozen=True)
class StageState:
    """One stage's parameters and optimizer state at a step, with its parameter checksum."""

    layer_start: int
    layer_end: int
    checksum: str
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Manifest:
    """A complete checkpoint."""

    path: Path
    steps_done: int
    plan_epoch: int
    stages: list[dict]
    version: int


def stage_checksum(
    state: dict[str, torch.Tensor], diloco: bool, hasher: Callable[[], Any] = framing.checksum_hasher
) -> str:
    """The checksum a stage's replicas report (node.stage: framing.parameters_checksum) of a state as transfers and
    checkpoints hold it: over its parameters (`layers.…`), or under diloco over its anchor (`sync.anchor.layers.…`)
    under the parameters' names."""
    prefix = "sync.anchor." if diloco else ""
    return framing.parameters_checksum(
        ((name.removeprefix(prefix), t) for name, t in state.items() if name.startswith(prefix + "layers.")), hasher
    )


def layer_of(name: str) -> int:
    """The layer index of a state name (`layers.<i>.…`, `optim.layers.<i>.…` or `sync.<slot>.layers.<i>.…`)."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


class CheckpointStore:
    """The checkpoints of one run under `root`, keeping the newest `keep`."""

    def __init__(self, root: str | Path, keep: int) -> None:
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    def begin(self, steps_done: int, plan_epoch: int) -> CheckpointWrite:
        """Start writing the checkpoint of steps_done: its stage files go into a temporary directory, and it exists
        once CheckpointWrite.commit has written its manifest."""
        return CheckpointWrite(self, steps_done, plan_epoch)

    def write(
        self, steps_done: int, plan_epoch: int, stages: list[StageState], before_manifest: Callable[[], None] | None = None
    ) -> Manifest:
        """Write a complete checkpoint of tensors in memory; `before_manifest` is a fault-injection point for tests."""
        pending = self.begin(steps_done, plan_epoch)
        try:
            for stage in stages:
                writer = pending.stage(stage.layer_start, stage.layer_end, stage.checksum)
                framing.receive_state(framing.state_chunks(sorted(stage.tensors.items())), writer)
                writer.finish()
            return pending.commit(before_manifest)
        except BaseException:
            pending.abandon()
            raise

    def complete(self) -> list[Manifest]:
        """Every complete checkpoint, oldest first."""
        found = []
        for path in sorted(self.root.iterdir()):
            if _DIR.match(path.name) and (path / MANIFEST).is_file():
                data = json.loads((path / MANIFEST).read_text())
                found.append(
                    Manifest(path, data["steps_done"], data["plan_epoch"], data["stages"], data.get("version", 1))
                )
        return found

    def latest(self, at_most: int | None = None) -> Manifest | None:
        """The newest complete checkpoint, optionally no later than `at_most` steps."""
        usable = [m for m in self.complete() if at_most is None or m.steps_done <= at_most]
        return usable[-1] if usable else None

    def load_layers(self, manifest: Manifest, layer_start: int, layer_end: int) -> dict[str, torch.Tensor]:
        """Parameters and optimizer state of layers [layer_start, layer_end) from a checkpoint, read tensor by tensor
        (the stage files' other tensors are not read)."""
        state: dict[str, torch.Tensor] = {}
        for stage, names in self._files_of(manifest, layer_start, layer_end):
            with stage:
                state.update((name, stage.tensor(name)) for name in names)
        return state

    def layer_sources(self, manifest: Manifest, layer_start: int, layer_end: int) -> Iterator[framing.StateSource]:
        """The tensors of layers [layer_start, layer_end) of a checkpoint as a state transfer sends them, each read
        from its file a chunk at a time as it is sent; a file is open only while its tensors are."""
        for stage, names in self._files_of(manifest, layer_start, layer_end):
            with stage:
                yield from (stage.source(name) for name in names)

    def checksum(self, manifest: Manifest, layer_start: int, layer_end: int, diloco: bool) -> str:
        """The checksum a node that loads layers [layer_start, layer_end) from this checkpoint must find: the one
        recorded for a stage of exactly this range, else computed from the checkpoint's files a chunk at a time
        (layers the plan moved), which were checked against the recorded ones when it was written
        (scheduler.recovery)."""
        for entry in manifest.stages:
            if (entry["layer_start"], entry["layer_end"]) == (layer_start, layer_end) and entry["checksum"]:
                return entry["checksum"]
        prefix = "sync.anchor." if diloco else ""
        digest = framing.checksum_hasher()
        with contextlib.ExitStack() as files:
            counted: list[tuple[str, StageFile]] = []
            for stage, names in self._files_of(manifest, layer_start, layer_end):
                opened = files.enter_context(stage)
                counted += [(name, opened) for name in names if name.startswith(prefix + "layers.")]
            for name, stage in sorted(counted, key=lambda item: item[0]):
                digest.update(name.removeprefix(prefix).encode())
                for data in stage.chunks(name):
                    digest.update(data)
        return digest.hexdigest()

    def _files_of(self, manifest: Manifest, layer_start: int, layer_end: int) -> Iterator[tuple[StageFile, list[str]]]:
        """Each stage file of a checkpoint that holds layers of [layer_start, layer_end) (not yet open), with the
        names of those layers' tensors in it."""
        for entry in manifest.stages:
            if entry["layer_end"] <= layer_start or entry["layer_start"] >= layer_end:
                continue
            stage = StageFile(manifest.path / entry["file"])
            with stage:
                names = [name for name in stage.names() if layer_start <= layer_of(name) < layer_end]
            yield stage, names

    def convert(self, manifest: Manifest, checksums: dict[tuple[int, int], str]) -> None:
        """Record `checksums` (layer range -> stage_checksum) in an older checkpoint's manifest, which becomes
        CHECKPOINT_VERSION's; the caller checked the stage files they are computed from (geotrain.upgrade)."""
        data = json.loads((manifest.path / MANIFEST).read_text())
        for entry in data["stages"]:
            entry["checksum"] = checksums.get((entry["layer_start"], entry["layer_end"]), entry["checksum"])
        data["version"] = CHECKPOINT_VERSION
        _write_manifest(manifest.path, data)

    def _prune(self) -> None:
        complete = self.complete()
        for old in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(old.path, ignore_errors=True)
        for partial in self.root.glob(".step-*.tmp-*"):
            if not partial.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(partial, ignore_errors=True)


def _write_manifest(directory: Path, manifest: dict) -> None:
    """Write a checkpoint's manifest whole or not at all: to a temporary name, fsynced, renamed, the rename fsynced."""
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    fsync(tmp)
    os.replace(tmp, directory / MANIFEST)
    fsync(directory)


SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
    torch.uint8: "U8", torch.int8: "I8",
}
DTYPES_OF = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
HEADER_RESERVE = (1 << 20) - 8
"""Bytes reserved for a stage file's safetensors header ahead of its data (about 7,000 tensors' entries), so that the
data starts at 1 MiB, aligned as the writes past the page cache need (durable.SequentialFile); a header that does not
fit moves the data once (StageFileWriter.finish)."""
_CRC_KEY = "geotrain.crc32"  # the header's metadata: each tensor's crc32, which a transfer's header carries
_MAX_HEADER = 1 << 28


@dataclass(frozen=True)
class StateBound:
    """What a stage's state may hold at most, from the plan's parameter shapes: bytes of one tensor, and in all."""

    tensor_bytes: int
    total_bytes: int


class StageFileWriter(framing.StateSink):
    """One stage's safetensors file, written as its state streams in (a framing.StateSink): each chunk goes to the
    file as it arrives, the stage's checksum (stage_checksum) and the tensors' crc32s are computed on the way, and
    the header is written last into the space reserved for it. Tensors must stay within `bound`, if any."""

    def __init__(
        self, path: Path, layers: tuple[int, int], diloco: bool, bound: StateBound | None = None,
        metadata: dict[str, str] | None = None, checksummed: bool = True,
    ) -> None:
        self.path = path
        self._metadata = metadata or {}
        self._checksummed = checksummed  # False: finish() returns "" and no byte is hashed
        self._layers = layers
        self._bound = bound
        self._prefix = "sync.anchor." if diloco else ""
        self._file = SequentialFile(path, 8 + HEADER_RESERVE)
        self._entries: dict[str, dict] = {}
        self._crcs: dict[str, int] = {}
        self._offset = 0
        self._digest = framing.checksum_hasher()
        self._last_counted = ""
        self._in_order = True  # the counted tensors arrived in name order: the checksum was computed as they passed

    def begin(self, header: pb.TensorHeader) -> Callable[[memoryview], None]:  # noqa: D102
        name, size = header.name, header.payload_bytes
        if name in self._entries:
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"state tensor {name} sent twice")
        try:
            layer = layer_of(name)
        except (ValueError, IndexError):
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"state tensor {name!r} names no layer") from None
        if not self._layers[0] <= layer < self._layers[1]:
            raise FrameError(grpc.StatusCode.INVALID_ARGUMENT, f"state tensor {name} is outside layers {self._layers}")
        if self._bound is not None and (
            size > self._bound.tensor_bytes or self._offset + size > self._bound.total_bytes
        ):
            raise FrameError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"state tensor {name} of shape {list(header.shape)} is larger than the plan's layers hold",
            )
        dtype = framing.WIRE_TO_TORCH[header.dtype]
        self._entries[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype], "shape": list(header.shape), "data_offsets": [self._offset, self._offset + size],
        }
        self._offset += size
        counted = self._checksummed and name.startswith(self._prefix + "layers.")
        if counted:
            self._in_order &= name > self._last_counted
            self._last_counted = max(name, self._last_counted)
            if self._in_order:
                self._digest.update(name.removeprefix(self._prefix).encode())
        digest = self._digest if counted and self._in_order else None

        def write(data: memoryview) -> None:
            self._file.write(data)
            if digest is not None:
                digest.update(data)

        return write

    def end(self, header: pb.TensorHeader) -> None:  # noqa: D102
        if header.crc32:  # a raw stream's headers carry none
            self._crcs[header.name] = header.crc32

    def finish(self) -> str:
        """Write the header, fsync the file and close it; returns the stage's checksum (stage_checksum)."""
        meta = {"__metadata__": {**self._metadata, _CRC_KEY: json.dumps(self._crcs, separators=(",", ":"))}}
        header = json.dumps({**meta, **self._entries}, separators=(",", ":")).encode()
        self._file.finish()
        fd = self._file.fd
        try:
            if len(header) <= HEADER_RESERVE:
                header += b" " * (HEADER_RESERVE - len(header))
            else:
                header += b" " * (-len(header) % 8)
                fd = self._move_data(8 + HEADER_RESERVE, 8 + len(header))
            os.pwrite(fd, struct.pack("<Q", len(header)) + header, 0)
            os.fsync(fd)
        finally:
            if fd != self._file.fd:
                os.close(fd)
            self._file.close()
        if not self._checksummed:
            return ""
        if self._in_order:
            return self._digest.hexdigest()
        with StageFile(self.path) as stage:  # a sender that sent them in another order: the checksum from the file
            digest = framing.checksum_hasher()
            for name in sorted(n for n in stage.names() if n.startswith(self._prefix + "layers.")):
                digest.update(name.removeprefix(self._prefix).encode())
                for data in stage.chunks(name):
                    digest.update(data)
            return digest.hexdigest()

    def _move_data(self, start: int, to: int) -> int:
        """Move the data from offset `start` to `to` (> start): into a new file, renamed over this one; returns the
        new file, open."""
        moved = self.path.with_suffix(".moving")
        with open(self.path, "rb") as old, open(moved, "wb") as out:
            out.truncate(to)
            out.seek(to)
            old.seek(start)
            shutil.copyfileobj(old, out, framing.CHUNK_BYTES)
        os.replace(moved, self.path)
        return os.open(self.path, os.O_RDWR)

    def close(self) -> None:
        """Close the file without finishing it (the checkpoint is abandoned)."""
        self._file.close()


class ModelFileWriter(StageFileWriter):
    """The whole model's parameters as one safetensors file (`geotrain coordinator --save-final`), written as the
    holders stream their stages' state: the optimizer's tensors pass through unwritten, `metadata` goes in its header.
    No checksum: the stages arrive out of name order ("layers.10." before "layers.9."), which would cost a second
    pass over the file, and no replica reported one for the whole model to compare with."""

    def __init__(self, path: Path, total_layers: int, metadata: dict[str, str], bound: StateBound | None) -> None:
        super().__init__(path, (0, total_layers), diloco=False, bound=bound, metadata=metadata, checksummed=False)

    def begin(self, header: pb.TensorHeader) -> Callable[[memoryview], None]:  # noqa: D102
        return super().begin(header) if header.name.startswith("layers.") else _discard

    def end(self, header: pb.TensorHeader) -> None:  # noqa: D102
        if header.name.startswith("layers."):
            super().end(header)


def _discard(data: memoryview) -> None:
    """A tensor's payload that goes nowhere."""


class StageFile:
    """A stage file of a checkpoint, read tensor by tensor (a context manager: the file is open inside it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._entries: dict[str, dict] = {}
        self._crcs: dict[str, int] = {}
        self._data_start = 0

    def __enter__(self) -> StageFile:
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            (size,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            if size > _MAX_HEADER:
                raise ValueError(f"{self.path}: a header of {size} bytes")
            header = json.loads(os.pread(self._fd, size, 8))
        except BaseException:
            os.close(self._fd)
            raise
        meta = header.pop("__metadata__", None) or {}
        self._crcs = json.loads(meta[_CRC_KEY]) if _CRC_KEY in meta else {}
        self._entries, self._data_start = header, 8 + size
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)
        self._fd = -1

    def names(self) -> list[str]:
        """The file's tensor names, in the order of their data."""
        return sorted(self._entries, key=lambda n: self._entries[n]["data_offsets"][0])

    def _span(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        return DTYPES_OF[entry["dtype"]], tuple(entry["shape"]), self._data_start + begin, end - begin

    def chunks(self, name: str, chunk_bytes: int = framing.CHUNK_BYTES) -> Iterator[bytes]:
        """A tensor's raw bytes, a chunk at a time."""
        _, _, at, size = self._span(name)
        for offset in range(0, size, chunk_bytes):
            yield os.pread(self._fd, min(chunk_bytes, size - offset), at + offset)

    def source(self, name: str) -> framing.StateSource:
        """A tensor as a state transfer sends it, read from the file as it is sent, under the crc32 its transfer here
        carried (0, not checksummed, for one that came by a raw stream: framing.state_header)."""
        dtype, shape, at, size = self._span(name)
        fd, crc = self._fd, self._crcs.get(name, 0)
        return framing.StateSource(name, dtype, shape, lambda: crc, lambda offset, n: os.pread(fd, n, at + offset))

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from the file into a tensor of its own."""
        dtype, shape, at, size = self._span(name)
        out = torch.empty(shape, dtype=dtype)
        view = memoryview(framing.flat_bytes(out).numpy())
        filled = 0
        while filled < size:
            got = os.preadv(self._fd, [view[filled:]], at + filled)
            if got <= 0:
                raise ValueError(f"{self.path}: {name} is cut short")
            filled += got
        return out


class CheckpointWrite:
    """A checkpoint being written: its stage files into a temporary directory, then (commit) the manifest and the
    rename that make it exist. Until then, or if abandoned, it does not exist."""

    def __init__(self, store: CheckpointStore, steps_done: int, plan_epoch: int) -> None:
        self._store, self.steps_done, self.plan_epoch = store, steps_done, plan_epoch
        self.tmp = store.root / f".step-{steps_done:08d}.tmp-{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        self._entries: list[dict] = []
        self._began = time.monotonic()

    def stage(
        self, layer_start: int, layer_end: int, checksum: str, diloco: bool = False, bound: StateBound | None = None
    ) -> StageFileWriter:
        """The writer of one stage's file, recorded with `checksum` (its replicas'; '' for none)."""
        name = f"stage-{layer_start:04d}-{layer_end:04d}.safetensors"
        self._entries.append({"layer_start": layer_start, "layer_end": layer_end, "file": name, "checksum": checksum})
        return StageFileWriter(self.tmp / name, (layer_start, layer_end), diloco, bound)

    def commit(self, before_manifest: Callable[[], None] | None = None) -> Manifest:
        """Write the manifest and rename the checkpoint into place; `before_manifest` is a fault-injection point."""
        if before_manifest is not None:
            before_manifest()
        manifest = {
            "version": CHECKPOINT_VERSION, "steps_done": self.steps_done, "plan_epoch": self.plan_epoch,
            "stages": self._entries, "written_at": time.time(),
        }
        _write_manifest(self.tmp, manifest)
        final = self._store.root / f"step-{self.steps_done:08d}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(self.tmp, final)
        fsync(self._store.root)
        self._store._prune()
        log.info("checkpoint of step %d written to %s in %.1fs", self.steps_done, final, time.monotonic() - self._began)
        return Manifest(final, self.steps_done, self.plan_epoch, self._entries, CHECKPOINT_VERSION)

    def abandon(self) -> None:
        """Remove what was written: the checkpoint will not exist."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def state_bound(layer_shapes: Iterable[Iterable[Iterable[int]]], diloco: bool) -> StateBound:
    """The most a stage's state may hold, from its layers' parameter shapes (the nodes' profiles): each tensor
    has a parameter's shape (or none: AdamW's step count), in at most 8 bytes a value; the state has each parameter,
    AdamW's two moments and their step counts, and under diloco the anchor and outer momentum."""
    elements = [math.prod(shape) for layer in layer_shapes for shape in layer]
    copies = 3 + (2 if diloco else 0)
    largest = max(elements, default=0) * 8
    return StateBound(tensor_bytes=max(largest, 8), total_bytes=copies * 8 * sum(elements) + 8 * len(elements) + 8)
