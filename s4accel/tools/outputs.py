"""Files and folders a command writes for the user (predictions, generated data, an exported model): the place is
checked before any compute (a folder where a file goes, a path under a file, a place that cannot be written, a release
or a folder that would be overwritten), and each is written whole or not at all (a temporary file or folder beside
it, renamed over it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from ..errors import DataError
from ..training.runs.checkpoint import is_write_error, write_error_text
from ..training.runs.run_dir import replace_dir


def check_output_file(path: Path, option: str) -> None:
    """`path` can be written as a file: not a folder, its folder made if missing, writable."""
    if path.is_dir():
        raise DataError(f"{option} {path}: is a folder; give a file path")
    check_output_dir(path.parent, option, shown=path)


def check_output_folder(path: Path, option: str, overwrite: bool) -> None:
    """`path` can become a folder of new files: not a file, missing or empty unless `overwrite` (then it is
    replaced), in a folder that can be written."""
    if path.exists() and not path.is_dir():
        raise DataError(f"{option} {path}: is a file; give a folder")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise DataError(f"{option} {path}: exists and is not empty; choose another folder, or add --overwrite to "
                        f"replace it")
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


class WholeFile:
    """A file written beside its name (`file`, text) and renamed over it by `commit`; `discard`, or any failure,
    removes it and leaves `path` as it was. An OSError is one line naming the option. As a context manager it
    commits when the block ends normally and discards otherwise."""

    def __init__(self, path: Path, option: str, newline: str | None = None):
        self.path, self.option = path, option
        try:
            fd, self.tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as e:
            raise self.error(e) from None
        self.file = os.fdopen(fd, "w", newline=newline)

    def error(self, e: OSError) -> DataError:
        return DataError(f"{self.option} {self.path}: cannot write ({e.strerror or e}); nothing was written")

    def commit(self) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.discard()
            raise self.error(e) from None

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        Path(self.tmp).unlink(missing_ok=True)

    def __enter__(self):
        return self.file

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.commit()
            return False
        self.discard()
        if isinstance(exc, OSError):
            raise self.error(exc) from None
        return False


class WholeFolder:
    """A folder written beside its name and renamed into place when the `with` block ends normally (a folder already
    there is replaced only then, and stays whole until then); an error in the block removes the temporary folder. The
    block gets the temporary folder. A failed write (a full disk, however the library that wrote reports it) is one
    line naming the option."""

    def __init__(self, path: Path, option: str):
        self.path, self.option = path, option
        # a unique name (two commands writing the same place do not mix their files); made by mkdir, so the folder
        # gets the usual permissions (a tempfile.mkdtemp folder would stay private to its owner once renamed)
        self.tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")

    def __enter__(self) -> Path:
        try:
            self.tmp.mkdir()
        except OSError as e:
            raise self.error(e) from None
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                replace_dir(self.tmp, self.path)
                return False
            except OSError as e:
                exc = e
        shutil.rmtree(self.tmp, ignore_errors=True)
        if is_write_error(exc):
            raise self.error(exc) from None
        return False

    def error(self, e: BaseException) -> DataError:
        return DataError(f"{self.option} {self.path}: cannot write ({write_error_text(e)}); nothing was written")
