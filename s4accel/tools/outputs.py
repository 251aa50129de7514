"""Files a command writes for the user (predictions, generated data): the place is checked before any compute (a
folder where a file goes, a path under a file, a place that cannot be written, a release that would be overwritten),
and each file is written whole or not at all (a temporary file beside it, renamed over it)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from ..errors import DataError


def check_output_file(path: Path, option: str) -> None:
    """`path` can be written as a file: not a folder, its folder made if missing, writable."""
    if path.is_dir():
        raise DataError(f"{option} {path}: is a folder; give a file path")
    check_output_dir(path.parent, option, shown=path)


def check_output_dir(folder: Path, option: str, shown: Path | None = None) -> None:
    """`folder` exists or can be made, and a file can be created in it (tried, then removed)."""
    shown = shown if shown is not None else folder
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise DataError(f"{option} {shown}: {blocker} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".s4accel-probe-"):
            pass
    except OSError as e:
        raise DataError(f"{option} {shown}: cannot write there ({e.strerror or e})") from None


@contextlib.contextmanager
def written_whole(path: Path, option: str, newline: str | None = None):
    """Open a temporary file beside `path` for writing text; on success it replaces `path`, on any failure (a full
    disk) it is removed and `path` is as it was. An OSError is one line naming the option."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline=newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise DataError(f"{option} {path}: cannot write ({e.strerror or e}); nothing was written") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
