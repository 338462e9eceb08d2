"""Files on disk that survive a power cut: fsync of a file or a directory, for what is written under a temporary
name and renamed when whole (the coordinator's checkpoints, `geotrain export`'s directory), and large files written
past the page cache (SequentialFile front to back, ScratchFile piece by piece).

The scheduler and the node both write such files and neither may import the other, so this sits beside config.py at
the top of the package and imports nothing of ours.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import numpy as np


def fsync(path: str | Path) -> None:
    """Flush a file's contents, or a directory's entries (a rename in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DIRECT_ALIGN = 4096
"""What O_DIRECT asks of every write: its file offset, its length and its buffer's address, multiples of this."""


class SequentialFile:
    """A file written front to back from offset `start` (a multiple of DIRECT_ALIGN) past the kernel's page cache
    where the file system allows it (O_DIRECT): through the cache, a GB written and then fsynced cost 2.8 s of CPU
    on a 2-core VM (0.09 s direct), taken from the training beside it, and filled memory the nodes beside it need.
    The bytes gather in an aligned buffer, written out whenever it is full; the tail that is not a whole block goes
    through the cache at `finish`. No step holds the GIL for long: a writer at the lowest CPU priority (a checkpoint)
    that the scheduler holds back must not hold back the threads the run needs. `fd` is the file opened the ordinary
    way, for what goes elsewhere (a header)."""

    def __init__(self, path: str | Path, start: int, buffer_bytes: int = 8 << 20) -> None:
        assert start % DIRECT_ALIGN == 0 and buffer_bytes % DIRECT_ALIGN == 0
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._direct: int | None = os.open(path, os.O_WRONLY | os.O_DIRECT)
        except OSError:  # tmpfs and some others refuse O_DIRECT: the page cache it is
            self._direct = None
        self._buffer = mmap.mmap(-1, buffer_bytes)  # page-aligned, as O_DIRECT needs
        self._view = memoryview(self._buffer)
        self._array = np.frombuffer(self._buffer, np.uint8)  # numpy copies into it without holding the GIL
        self._filled = 0
        self._at = start  # the file offset of the buffer's first byte

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append `data`."""
        data = np.frombuffer(data, np.uint8)
        while len(data):
            n = min(len(data), len(self._buffer) - self._filled)
            np.copyto(self._array[self._filled : self._filled + n], data[:n])
            self._filled += n
            data = data[n:]
            if self._filled == len(self._buffer):
                self._write_out(self._filled)

    def finish(self) -> None:
        """Write out what the buffer holds: its whole blocks directly, the rest through the cache."""
        whole = self._filled - self._filled % DIRECT_ALIGN
        tail = self._view[whole : self._filled]
        self._write_out(whole)
        _pwrite_all(self.fd, tail, self._at)
        self._at += len(tail)

    def _write_out(self, n: int) -> None:
        _pwrite_all(self.fd if self._direct is None else self._direct, self._view[:n], self._at)
        self._at += n
        self._filled = 0

    def close(self) -> None:
        """Close the file, if still open (what was not finished is lost)."""
        if self._buffer.closed:
            return
        del self._array
        self._view.release()
        self._buffer.close()
        for fd in (self.fd, self._direct):
            if fd is not None:
                os.close(fd)


class AlignedBuffer:
    """A page-aligned buffer (as O_DIRECT needs) that numpy fills without holding the GIL."""

    def __init__(self, nbytes: int) -> None:
        assert nbytes % DIRECT_ALIGN == 0
        self._buffer = mmap.mmap(-1, nbytes)
        self.view = memoryview(self._buffer)
        self.array = np.frombuffer(self._buffer, np.uint8)

    def fill(self, data: np.ndarray) -> int:
        """Copy `data` (bytes, at most the buffer's) to the buffer's start, zeroing what is left of the block it ends
        in; its length."""
        n = len(data)
        np.copyto(self.array[:n], data)
        self.array[n : _whole_blocks(n)] = 0
        return n


class ScratchFile:
    """An unlinked file in `directory`, gone with its descriptors, written in pieces at block-aligned regions past the
    page cache where the file system allows it (O_DIRECT, as SequentialFile: through the cache a GB costs seconds of
    CPU, and memory the process is not planned for, which its memory cgroup then reclaims in its allocations) and
    read back the same way. Regions come from reserve() (callers serialise it); each writer or reader brings its own
    AlignedBuffer, so pieces of different regions may be written from different threads at once."""

    def __init__(self, directory: str) -> None:
        self._fd, path = tempfile.mkstemp(dir=directory or None)
        try:
            self._direct: int | None = os.open(path, os.O_RDWR | os.O_DIRECT)
        except OSError:  # tmpfs and some others refuse O_DIRECT: the page cache it is
            self._direct = None
        finally:
            os.unlink(path)
        self._end = 0

    def reserve(self, nbytes: int) -> int:
        """The offset of a region of `nbytes` no one else writes."""
        offset = self._end
        self._end += _whole_blocks(nbytes)
        return offset

    def write(self, offset: int, buffer: AlignedBuffer, n: int) -> None:
        """Write the buffer's first n bytes at `offset` (a multiple of DIRECT_ALIGN inside a reserved region), the zeros
        that fill their last block with them."""
        _pwrite_all(self._fd if self._direct is None else self._direct, buffer.view[: _whole_blocks(n)], offset)

    def read(self, offset: int, buffer: AlignedBuffer, n: int) -> memoryview:
        """The n bytes written at `offset` (a multiple of DIRECT_ALIGN inside a region), read into the buffer: a view
        of it."""
        fd, wanted = (self._fd, n) if self._direct is None else (self._direct, _whole_blocks(n))
        got = 0
        while got < wanted:
            read = os.preadv(fd, [buffer.view[got:wanted]], offset + got)
            if not read:
                raise EOFError(f"the scratch file ends {wanted - got} bytes short of what was written at {offset}")
            got += read
        return buffer.view[:n]

    def close(self) -> None:
        """Close the file: its space is freed."""
        for fd in (self._fd, self._direct):
            if fd is not None:
                os.close(fd)


def _whole_blocks(nbytes: int) -> int:
    return -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written
