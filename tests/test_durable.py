"""Large files written past the page cache (geotrain.durable.SequentialFile, ScratchFile): every byte where it
belongs, whether the file system takes O_DIRECT or refuses it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from geotrain import durable
from geotrain.durable import DIRECT_ALIGN, AlignedBuffer, ScratchFile, SequentialFile


def _write(path, start: int, parts: list[bytes]) -> None:
    out = SequentialFile(path, start, buffer_bytes=2 * DIRECT_ALIGN)
    try:
        for part in parts:
            out.write(part)
        out.finish()
        os.pwrite(out.fd, b"head", 0)  # what goes elsewhere, through the ordinary descriptor
        os.fsync(out.fd)
    finally:
        out.close()
    out.close()  # a second close is harmless: an abandoned write closes what finish left


@pytest.fixture(params=[True, False], ids=["direct", "page-cache"])
def direct(request, monkeypatch) -> bool:
    """Whether the file system takes O_DIRECT (tmpfs and others refuse it)."""
    if not request.param:
        real_open = os.open

        def no_direct(path, flags, *args):
            if flags & os.O_DIRECT:
                raise OSError(22, "O_DIRECT refused")
            return real_open(path, flags, *args)

        monkeypatch.setattr(durable.os, "open", no_direct)
    return request.param


@pytest.mark.timeout(30)
def test_a_sequential_file_holds_every_byte_in_order_across_buffers_and_an_unaligned_tail(tmp_path, direct):
    parts = [os.urandom(n) for n in (5, DIRECT_ALIGN * 3 + 17, 1, DIRECT_ALIGN, 4093)]
    path = tmp_path / "big.bin"
    _write(path, DIRECT_ALIGN, parts)
    data = path.read_bytes()
    assert len(data) == DIRECT_ALIGN + sum(map(len, parts))
    assert data[:4] == b"head" and data[4:DIRECT_ALIGN] == bytes(DIRECT_ALIGN - 4)
    assert data[DIRECT_ALIGN:] == b"".join(parts)


@pytest.mark.timeout(30)
def test_a_scratch_file_keeps_each_region_s_pieces_whatever_order_they_come_in_and_leaves_no_name(tmp_path, direct):
    scratch = ScratchFile(str(tmp_path))
    try:
        assert not list(tmp_path.iterdir())
        blobs = [np.frombuffer(os.urandom(n), np.uint8) for n in (3 * DIRECT_ALIGN + 5, 7, 2 * DIRECT_ALIGN)]
        offsets = [scratch.reserve(len(blob)) for blob in blobs]
        assert all(offset % DIRECT_ALIGN == 0 for offset in offsets)
        first, second = AlignedBuffer(2 * DIRECT_ALIGN), AlignedBuffer(2 * DIRECT_ALIGN)
        pieces = [(k, at) for k, blob in enumerate(blobs) for at in range(0, len(blob), 2 * DIRECT_ALIGN)]
        for k, at in reversed(pieces):  # a later region before an earlier one, a piece's tail before its head
            buffer = first if (k + at) % 2 else second
            scratch.write(offsets[k] + at, buffer, buffer.fill(blobs[k][at : at + 2 * DIRECT_ALIGN]))
        for blob, offset in zip(blobs, offsets):
            for at in range(0, len(blob), 2 * DIRECT_ALIGN):
                piece = blob[at : at + 2 * DIRECT_ALIGN]
                assert scratch.read(offset + at, first, len(piece)) == piece.tobytes()
    finally:
        scratch.close()
