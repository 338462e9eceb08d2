"""Large files written past the page cache (geotrain.durable.SequentialFile): every byte where it belongs, whether
the file system takes O_DIRECT or refuses it."""

from __future__ import annotations

import os

import pytest

from geotrain import durable
from geotrain.durable import DIRECT_ALIGN, SequentialFile


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


@pytest.mark.timeout(30)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_a_sequential_file_holds_every_byte_in_order_across_buffers_and_an_unaligned_tail(
    tmp_path, monkeypatch, direct
):
    if not direct:
        real_open = os.open

        def no_direct(path, flags, *args):
            if flags & os.O_DIRECT:
                raise OSError(22, "O_DIRECT refused")
            return real_open(path, flags, *args)

        monkeypatch.setattr(durable.os, "open", no_direct)
    parts = [os.urandom(n) for n in (5, DIRECT_ALIGN * 3 + 17, 1, DIRECT_ALIGN, 4093)]
    path = tmp_path / "big.bin"
    _write(path, DIRECT_ALIGN, parts)
    data = path.read_bytes()
    assert len(data) == DIRECT_ALIGN + sum(map(len, parts))
    assert data[:4] == b"head" and data[4:DIRECT_ALIGN] == bytes(DIRECT_ALIGN - 4)
    assert data[DIRECT_ALIGN:] == b"".join(parts)
