"""Writing a file so that it is whole or absent, and never readable by more than `mode`.

Keys, tokens, certificates and the Worker's identity file are replaced this way: a fresh
temporary file created with its final mode (a key is never readable by others, not even
between create and chmod), its data flushed to disk, renamed over the path, and the
directory flushed, so a crash leaves either the old file or the new one (and perhaps the
temporary file: `written_for` names the file one was for, so its owner can sweep it).
"""

from __future__ import annotations

import os
from pathlib import Path

_TEMPORARY_SUFFIX = ".tmp"


def _temporary_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}{_TEMPORARY_SUFFIX}")


def written_for(name: str) -> str | None:
    """The file name a temporary file of `atomic_write` was for; None for any other name."""
    if not (name.startswith(".") and name.endswith(_TEMPORARY_SUFFIX)):
        return None
    final, _, pid = name[1 : -len(_TEMPORARY_SUFFIX)].rpartition(".")
    return final if final and pid.isdecimal() else None


def atomic_write(path: Path, data: bytes, mode: int) -> None:
    temporary = _temporary_for(path)
    temporary.unlink(missing_ok=True)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    # The rename is durable only once the directory entry is.
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
