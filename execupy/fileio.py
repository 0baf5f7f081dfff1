"""Every file execupy writes goes through `atomic_write`: a reader sees the old file or the new one, never half.

An export interrupted while it writes (Ctrl-C, a full disk, a crash) must not leave a truncated
`.pte` where the user's good one was: scripts and users take an existing file for a finished one.
So the bytes go to a temporary file in the same folder (same filesystem, so the rename cannot turn
into a copy), are flushed to disk, and `os.replace` swaps the finished file in, in one step. Any
failure, KeyboardInterrupt included, removes the temporary file and leaves the old one untouched.

    atomic_write("model.pte", program_bytes)
    atomic_write("vocab.txt", "a 0\\nb 1\\n")                       # str is written as UTF-8
    atomic_write("out.npz", lambda f: np.savez(f, out0=y))          # a writer given the open file

Torch-free and numpy-free: the exporter, the tokenizers and the CLI all use it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable, Union

Data = Union[bytes, bytearray, memoryview, str, Callable[[BinaryIO], object]]


def atomic_write(path: Union[str, os.PathLike], data: Data) -> Path:
    """Write `data` (bytes, text or a `writer(file)` callable) to `path` all at once; returns the path."""
    path = Path(path)
    # os.urandom, not secrets: importing secrets loads OpenSSL (3 MiB resident) into every process
    temp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
    # 0o666 and O_EXCL: the file gets the mode a plain open() would give (the umask applies),
    # and an existing file of that name is never written through.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(temp, path)
    except BaseException:  # KeyboardInterrupt too: the half-written temporary must not stay behind
        temp.unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)
    return path


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
