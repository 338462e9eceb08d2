"""Files on disk that survive a power cut: fsync of a file or a directory, for what is written under a temporary
name and renamed when whole (the coordinator's checkpoints, `geotrain export`'s directory).

The scheduler and the node both write such files and neither may import the other, so this sits beside config.py at
the top of the package and imports nothing of ours.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: str | Path) -> None:
    """Flush a file's contents, or a directory's entries (a rename in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
