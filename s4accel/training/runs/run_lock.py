"""One run per directory at a time: `run_dir/.lock`, held by the main process for the whole run.

Without it a second `train` (an overwrite, a `--resume`) on a directory a live run is writing moved its outputs away
under it: both exited 0 and `final/` held the other run's weights. The lock is an `fcntl.flock` on a file: the kernel
releases it when its process dies however it dies (SIGKILL, out of memory), so a killed run never leaves it stuck,
and it holds across machines on a shared filesystem that supports locks (NFSv4, Lustre, GPFS: Linux maps `flock` to
the filesystem's byte-range locks there). Where it can, the run also locks the directory itself, which removing the
file cannot undo. Only the global main process takes it: every other process of the run
waits for that one at its first collective. The file records who holds it, for the message the next run prints.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from ...errors import RunDirError

LOCK_NAME = ".lock"


class RunLock:
    """`with RunLock(run_dir, is_main):` the run owns `run_dir` (created if missing, and removed again on leaving if
    the run left it empty)."""

    def __init__(self, run_dir: Path, is_main: bool):
        self.run_dir, self.is_main = Path(run_dir), is_main
        self.fd: int | None = None
        self.dir_fd: int | None = None
        self.created: list[Path] = []

    def __enter__(self) -> RunLock:
        if not self.is_main:
            return self
        path = self.run_dir / LOCK_NAME
        self.created = [p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self._remove_created()
            raise RunDirError(f"cannot write to run directory {self.run_dir}: {e.strerror or e}") from None
        try:
            self.dir_fd = _lock_directory(self.run_dir)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The holder before us may have removed the file between our open and our lock: then we hold a lock on
            # a file no other run can see, so the directory is not ours yet.
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                raise BlockingIOError
        except OSError as e:
            holder = _read(fd)
            os.close(fd)
            self._unlock_directory()
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES) or isinstance(e, BlockingIOError):
                raise RunDirError(f"{self.run_dir} is in use by another run{f' ({holder})' if holder else ''}; wait "
                                  f"for it to end (or stop it), or choose another run.out_dir") from None
            raise RunDirError(f"cannot lock run directory {self.run_dir}: {e.strerror or e}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                 .encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.run_dir / LOCK_NAME)  # unlinked while held: a run that opened it meanwhile sees the swap
        os.close(self.fd)  # releases the lock
        self.fd = None
        self._unlock_directory()
        self._remove_created()

    def _unlock_directory(self) -> None:
        if getattr(self, "dir_fd", None) is not None:
            os.close(self.dir_fd)
            self.dir_fd = None

    def _remove_created(self) -> None:
        """The folders this lock created, if nothing else was written into them (a run that failed its checks)."""
        for folder in self.created:
            with contextlib.suppress(OSError):
                folder.rmdir()


def _lock_directory(run_dir: Path) -> int | None:
    """An exclusive `flock` on the run directory itself, held with the lock file's: removing `.lock` (a "stale lock"
    cleanup) cannot take it away, as the directory cannot be removed while it holds a run. Raises BlockingIOError
    when another run holds it; None where the filesystem has no locks on directories (NFS maps `flock` to byte-range
    locks, which need a file open for writing): the lock file alone then."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise BlockingIOError from None
        return None  # EBADF, ENOLCK, EOPNOTSUPP: not on this filesystem
    return fd


def _read(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    return ""
