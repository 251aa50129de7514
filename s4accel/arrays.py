"""Array data: sequences of real-valued features with one label per sequence (classification or regression).

    source digits   scikit-learn's 8x8 digits as 64-step sequences of one pixel each (1,797 images, 10 classes),
                    read from the csv inside the scikit-learn wheel; a seeded `val_fraction` is the test split
    source ucr      a UCR/UEA set inside the `aeon` wheel (`data.ucr_name`, e.g. ACSF1: 1,460 steps), read from its
                    `.ts` files; the archive's own TRAIN/TEST split
    source arrays   your files: `.npz` with `x (n, L[, d])`, `y (n,)` and optionally `x_test`, `y_test`; or `.csv`
                    rows `label, v_1, ..., v_L` (the UCR csv layout). A second file in `data.files` is the test split;
                    without one, a seeded `val_fraction` of the first is.

Both wheels are installed with `--no-deps` and only read as files, never imported. Features are standardised per
feature with the training split's mean and std (`data.normalize`). The splits become `datasets.Dataset`s of
`{"input_values": (L, d) float32, "labels": int64 class id | float32 target}`.
"""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import DataCfg
from .errors import DataError


@dataclass
class ArrayData:
    train: object  # datasets.Dataset
    val: object
    d_input: int
    num_labels: int  # classes; 1 for regression
    seq_len: int
    class_names: list[str] | None = None
    tokenizer: object = None  # text data has one; array data none

    @property
    def n_train_tokens(self) -> int:  # time steps, for the run's summary line
        return len(self.train) * self.seq_len

    @property
    def n_val_tokens(self) -> int:
        return len(self.val) * self.seq_len


def _package_dir(name: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"data.source needs the {name} wheel: {hint}")
    return Path(list(spec.submodule_search_locations)[0])


# --------------------------------------------------------------------------------------------------------------------
# Readers: each returns (x_train, y_train, x_test | None, y_test | None, class names | None), x as (n, L, d)


def read_digits():
    path = _package_dir("sklearn", "pip install --no-deps scikit-learn") / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x, y = table[:, :-1], table[:, -1].astype(np.int64)  # 64 pixels (0-16) row by row, then the digit
    return x[:, :, None], y, None, None, [str(d) for d in range(10)]


def parse_ts(path: Path) -> tuple[np.ndarray, list[str], list[str] | None]:
    """A `.ts` file (sktime/aeon format): header lines start with `@`; each data line holds the dimensions separated
    by `:`, each a comma-separated series, then the label. Returns x (n, L, d), labels as strings, declared classes."""
    classes, rows, labels = None, [], []
    in_data = False
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not in_data:
            low = line.lower()
            if low.startswith("@classlabel"):
                parts = line.split()
                classes = parts[2:] if len(parts) > 2 and parts[1].lower() == "true" else None
            in_data = low == "@data"
            continue
        *dims, label = line.split(":")
        series = [[float(v) if v not in ("?", "NaN") else np.nan for v in d.split(",")] for d in dims]
        if len({len(s) for s in series}) != 1 or (rows and len(series[0]) != len(rows[0][0])):
            raise DataError(f"{path}: series of different lengths are not supported")
        rows.append(series)
        labels.append(label.strip())
    if not rows:
        raise DataError(f"{path}: no data lines")
    x = np.asarray(rows, dtype=np.float32).transpose(0, 2, 1)  # (n, d, L) -> (n, L, d)
    if np.isnan(x).any():
        raise DataError(f"{path}: missing values are not supported")
    return x, labels, classes


def read_ucr(name: str):
    root = _package_dir("aeon", "pip install --no-deps aeon") / "datasets" / "data"
    folder = root / name
    if not (folder / f"{name}_TRAIN.ts").is_file() or not (folder / f"{name}_TEST.ts").is_file():
        available = sorted(p.name for p in root.iterdir() if (p / f"{p.name}_TRAIN.ts").is_file())
        raise DataError(f"data.ucr_name: no UCR set {name!r} in the aeon wheel; available: {', '.join(available)}")
    x_tr, lab_tr, classes = parse_ts(folder / f"{name}_TRAIN.ts")
    x_te, lab_te, _ = parse_ts(folder / f"{name}_TEST.ts")
    classes = classes or sorted(set(lab_tr) | set(lab_te))
    index = {c: i for i, c in enumerate(classes)}
    try:
        y_tr, y_te = (np.array([index[v] for v in lab], dtype=np.int64) for lab in (lab_tr, lab_te))
    except KeyError as e:
        raise DataError(f"data.ucr_name: {name} has a label {e} outside its declared classes") from None
    return x_tr, y_tr, x_te, y_te, classes


def _read_array_file(path: Path):
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:  # never unpickle user files
            if "x" not in z or "y" not in z:
                raise DataError(f"data.files: {path} needs arrays 'x' and 'y' (has: {', '.join(z.files)})")
            arrays = [z["x"], z["y"], z.get("x_test"), z.get("y_test")]
    elif path.suffix == ".csv":
        table = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
        arrays = [table[:, 1:], table[:, 0], None, None]
    else:
        raise DataError(f"data.files: {path}: expected a .npz or .csv file")
    x = np.asarray(arrays[0], dtype=np.float32)
    return (x if x.ndim == 3 else x[:, :, None]), arrays[1], *arrays[2:]


def read_arrays(files: list[str], task: str):
    paths = [Path(f) for f in files]
    for p in paths:
        if not p.is_file():
            raise DataError(f"data.files: no such file: {p}")
    if len(paths) > 2:
        raise DataError("data.files: give one file (train, with a held-out fraction) or two (train, test)")
    x_tr, y_tr, x_te, y_te = _read_array_file(paths[0])
    if len(paths) == 2:
        x_te, y_te, *_ = _read_array_file(paths[1])
    if x_te is not None:
        x_te = np.asarray(x_te, dtype=np.float32)
        x_te = x_te if x_te.ndim == 3 else x_te[:, :, None]
    classes = None
    if task == "classification":
        labels = np.concatenate([y_tr, y_te]) if y_te is not None else y_tr
        classes = [str(c) for c in np.unique(labels)]
        index = {c: i for i, c in enumerate(classes)}
        y_tr = np.array([index[str(v)] for v in y_tr], dtype=np.int64)
        y_te = None if y_te is None else np.array([index[str(v)] for v in y_te], dtype=np.int64)
    return x_tr, y_tr, x_te, y_te, classes


# --------------------------------------------------------------------------------------------------------------------
# Splits and datasets


def build_array_data(cfg: DataCfg) -> ArrayData:
    import datasets

    if cfg.source == "digits":
        x, y, x_te, y_te, classes = read_digits()
    elif cfg.source == "ucr":
        x, y, x_te, y_te, classes = read_ucr(cfg.ucr_name)
    else:
        x, y, x_te, y_te, classes = read_arrays(cfg.files, cfg.task)
    if len(x) == 0:
        raise DataError("the dataset holds no sequences")
    if x_te is None:  # a seeded held-out fraction (the same on every process and every run)
        order = np.random.default_rng(cfg.split_seed).permutation(len(x))
        n_test = max(1, int(round(len(x) * cfg.val_fraction)))
        if n_test >= len(x):
            raise DataError(f"{len(x)} sequences are too few for data.val_fraction={cfg.val_fraction}")
        x, y, x_te, y_te = x[order[n_test:]], y[order[n_test:]], x[order[:n_test]], y[order[:n_test]]
    if x_te.shape[1:] != x.shape[1:]:
        raise DataError(f"train sequences are {x.shape[1:]} (steps, features), test ones {x_te.shape[1:]}")
    if cfg.normalize:  # per feature, with the training split's statistics only
        mean, std = x.mean(axis=(0, 1)), x.std(axis=(0, 1))
        x, x_te = (x - mean) / np.maximum(std, 1e-8), (x_te - mean) / np.maximum(std, 1e-8)
    regression = cfg.task == "regression" and cfg.source == "arrays"
    label_dtype = np.float32 if regression else np.int64

    def dataset(x, y):
        return datasets.Dataset.from_dict({"input_values": x.astype(np.float32),
                                           "labels": np.asarray(y).astype(label_dtype)}).with_format("torch")

    return ArrayData(dataset(x, y), dataset(x_te, y_te), d_input=x.shape[2],
                     num_labels=1 if regression else len(classes), seq_len=x.shape[1], class_names=classes)


def collate_arrays(examples: list[dict]) -> dict[str, torch.Tensor]:
    return {"input_values": torch.stack([e["input_values"] for e in examples]),
            "labels": torch.stack([e["labels"] for e in examples])}
