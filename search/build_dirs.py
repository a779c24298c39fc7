"""Temporary kernel build directories (`autopar_kernels_*` in the temp folder). Each holds a
lock file that its process keeps locked while it lives (the kernel drops the lock when the
process dies, however it dies), so a directory whose lock can be taken was left behind by a
killed run and can go; one whose lock is held belongs to a live run and stays."""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile

PREFIX = "autopar_kernels_"
LOCK = "owner.lock"


def make_build_dir(parent: str | None = None) -> tuple[str, int]:
    """A new build directory and the fd that holds its lock (keep it open while the directory
    is in use). The lock is taken before the lock file gets its name, so a sweeper never sees
    the directory unlocked."""
    path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
    staging = os.path.join(path, LOCK + ".new")
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(staging, os.path.join(path, LOCK))
    return path, fd


def remove_stale_build_dirs(parent: str | None = None) -> list[str]:
    """Remove the build directories in `parent` (default: the temp folder) whose owning
    process is gone; returns their paths. Directories without a lock file (being created, or
    made by an autopar older than the lock) are left alone."""
    parent = parent or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(parent, name)
        try:
            fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live run's
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(path)
    return removed
