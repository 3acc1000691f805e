"""The run's --output_dir: created and checked before anything is written, and held by one run at a time.

Two runs on one directory (a second `--resume` while the first still runs) would both append to
metrics.jsonl and both write checkpoints; an exclusive lock on `<output_dir>/.lock` refuses the
second by name. The lock is an flock: the kernel drops it when the process dies, so a run killed
with -9 leaves nothing to clean up.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator

LOCK_NAME = ".lock"


class RunDirError(Exception):
    """--output_dir cannot be used: the message names it and what to change."""


def _make(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunDirError(f"--output_dir={path} is a file, not a directory; choose another --output_dir")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        why = "a part of it is a file" if e.errno in (errno.ENOTDIR, errno.EEXIST) else e.strerror
        raise RunDirError(f"--output_dir={path} cannot be created: {why}; choose another --output_dir") from e


@contextlib.contextmanager
def held(path: str) -> Iterator[None]:
    """Create `path` if needed and hold its lock for the body; RunDirError if it is unusable or in use."""
    _make(path)
    lock_path = os.path.join(path, LOCK_NAME)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunDirError(f"--output_dir={path} cannot be written ({e.strerror}: {lock_path}); choose another "
                          f"--output_dir or fix its permissions") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            raise RunDirError(f"--output_dir={path} is in use by another run (pid {other}, lock {lock_path}); wait "
                              f"for it to end, or give this run another --output_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
