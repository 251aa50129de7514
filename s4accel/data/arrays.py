"""Array data: sequences of real-valued features with one label per sequence (classification or regression).

    source digits   scikit-learn's 8x8 digits as 64-step sequences of one pixel each (1,797 images, 10 classes),
                    read from the csv inside the scikit-learn wheel; a seeded `val_fraction` is the test split
    source ucr      a UCR/UEA set inside the `aeon` wheel (`data.ucr_name`, e.g. ACSF1: 1,460 steps), read from its
                    `.ts` files; the archive's own TRAIN/TEST split
    source arrays   your files: `.npz` with `x (n, L[, d])`, `y (n,)` and optionally `x_test`, `y_test`; or `.csv`
                    rows `label, v_1, ..., v_L` (the UCR csv layout). A second file in `data.files` is the test split;
                    without one, a seeded `val_fraction` of the first is.
    source lra_image, lra_pathfinder
                    Long Range Arena's image tasks as grayscale pixel sequences (lra_images.py), uint8 until collated

Both wheels are installed with `--no-deps` and only read as files, never imported. Features are standardised per
feature with the training split's mean and std (`data.normalize`) by the model itself: the statistics go into its
config (`input_mean`, `input_std`), so the transform travels with the saved model and the data stays raw. The splits
become `datasets.Dataset`s of `{"input_values": (L, d) float32, "labels": int64 class id | float32 target}`.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import torch

from ..config import DataCfg, SourceCfg
from ..errors import DataError
from .lra_images import read_image_dataset, read_pathfinder


@dataclass
class ArrayData:
    train: object  # datasets.Dataset
    val: object
    d_input: int
    num_labels: int  # classes; 1 for regression
    seq_len: int
    class_names: list[str] | None = None
    tokenizer: object = None  # text data has one; array data none
    input_mean: list[float] | None = None
    """Each feature's mean over the training split (with `data.normalize`), for the model to standardise with."""
    input_std: list[float] | None = None
    eval_sets: dict = field(default_factory=dict)
    """`data.eval_sets` as datasets of the same kind, by name."""

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


def _read_csv(path: Path, key: str = "data.files") -> np.ndarray:
    """Rows `label, v_1, ..., v_L` of numbers; anything else is a `DataError` naming the line."""
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
    except ValueError:
        table = None
    if table is None:  # find the first bad line, to say what is wrong with it
        with open(path, newline="") as f:
            rows = [(i, row) for i, row in enumerate(csv.reader(f), 1) if row]
        width = len(rows[0][1]) if rows else 0
        for i, row in rows:
            if len(row) != width:
                raise DataError(f"{key}: {path}: line {i} has {len(row)} columns, line {rows[0][0]} has {width}")
            try:
                [float(v) for v in row]
            except ValueError:
                header = i == rows[0][0] and len(rows) > 1 and _numbers(rows[1][1])
                hint = "; a header row? remove it" if header else \
                    "; labels and values must be numbers (label, v_1, ..., v_L)"
                raise DataError(f"{key}: {path}: line {i} is not numbers ({','.join(row)!r}){hint}") from None
        raise DataError(f"{key}: {path}: cannot be read as comma-separated numbers")
    if table.shape[1] < 2:
        raise DataError(f"{key}: {path}: needs a label and at least one value per line; line 1 has "
                        f"{table.shape[1]} column")
    return table


def _numbers(row: list[str]) -> bool:
    try:
        [float(v) for v in row]
        return True
    except ValueError:
        return False


def _read_npz(path: Path, key: str = "data.files") -> list:
    """x, y, x_test, y_test (None where absent), never unpickling (an object array is refused)."""
    with np.load(path, allow_pickle=False) as z:  # never unpickle user files
        if "x" not in z or "y" not in z:
            raise DataError(f"{key}: {path} needs arrays 'x' and 'y' (has: {', '.join(z.files)})")
        arrays = []
        for key in ("x", "y", "x_test", "y_test"):
            try:
                arrays.append(z[key] if key in z else None)
            except ValueError:  # "Object arrays cannot be loaded when allow_pickle=False"
                raise DataError(f"{key}: {path}: array {key!r} holds Python objects; s4accel never unpickles "
                                f"data files (save numbers: x float, y int or float)") from None
    if (arrays[2] is None) != (arrays[3] is None):
        raise DataError(f"{key}: {path}: {'x_test needs y_test' if arrays[3] is None else 'y_test needs x_test'}")
    return arrays


def _check_xy(x: np.ndarray, y: np.ndarray, where: str, suffix: str = "") -> np.ndarray:
    """x as float32 (n, L, d), after checking shapes, dtypes and values; `suffix` names the test arrays."""
    x, y = np.asarray(x), np.asarray(y)
    name_x, name_y = f"x{suffix}", f"y{suffix}"
    if x.dtype.kind == "c":
        raise DataError(f"{where}: {name_x} must hold real numbers; got {x.dtype}")
    if x.dtype.kind not in "biuf":
        raise DataError(f"{where}: {name_x} must hold numbers; got {x.dtype.str.lstrip('|=')}")
    if x.ndim not in (2, 3):
        raise DataError(f"{where}: {name_x} must be (n, L) or (n, L, d); got shape {x.shape}")
    if y.ndim != 1:
        raise DataError(f"{where}: {name_y} must be one label per sequence (n,); got shape {y.shape}")
    if len(x) != len(y):
        raise DataError(f"{where}: {name_x} has {len(x)} sequences but {name_y} has {len(y)} labels")
    bad = int((~np.isfinite(x)).sum()) if x.dtype.kind == "f" else 0
    if bad:
        raise DataError(f"{where}: {name_x} holds {bad} NaN or infinite value(s); fill or drop them first")
    if y.dtype.kind == "f" and (bad := int((~np.isfinite(y)).sum())):
        raise DataError(f"{where}: {name_y} holds {bad} NaN or infinite label(s)")
    x = x.astype(np.float32)
    return x if x.ndim == 3 else x[:, :, None]


def _read_file(path: Path, key: str = "data.files") -> list:
    """x, y, x_test, y_test of a `.npz` file, or x, y, None, None of a `.csv` one."""
    if path.suffix == ".npz":
        return _read_npz(path, key)
    if path.suffix == ".csv":
        table = _read_csv(path, key)
        return [table[:, 1:], table[:, 0], None, None]
    raise DataError(f"{key}: {path}: expected a .npz or .csv file")


def read_arrays(files: list[str], task: str):
    paths = [Path(f) for f in files]
    for p in paths:
        if not p.is_file():
            raise DataError(f"data.files: no such file: {p}")
    if len(paths) > 2:
        raise DataError("data.files: give one file (train, with a held-out fraction) or two (train, test)")
    arrays = [_read_file(path) for path in paths]
    x_tr, y_tr, x_te, y_te = arrays[0]
    x_tr = _check_xy(x_tr, y_tr, f"data.files: {paths[0]}")
    if len(paths) == 2:
        x_te, y_te = arrays[1][:2]
        x_te = _check_xy(x_te, y_te, f"data.files: {paths[1]}")
    elif x_te is not None:
        x_te = _check_xy(x_te, y_te, f"data.files: {paths[0]}", "_test")
    classes = None
    if task == "classification":
        labels = np.concatenate([y_tr, y_te]) if y_te is not None else y_tr
        classes = [_label_name(c) for c in np.unique(labels)]
        if len(classes) < 2:
            raise DataError(f"data.files: {paths[0]}: only one class ({classes[0]!r}) in the labels: a classifier "
                            f"needs at least two (real-valued targets: set data.task: regression)")
        index = {c: i for i, c in enumerate(classes)}
        y_tr = np.array([index[_label_name(v)] for v in y_tr], dtype=np.int64)
        y_te = None if y_te is None else np.array([index[_label_name(v)] for v in y_te], dtype=np.int64)
    else:
        for y, f in ((y_tr, paths[0]), (y_te, paths[-1])):
            if y is not None and np.asarray(y).dtype.kind not in "biuf":
                raise DataError(f"data.files: {f}: data.task regression needs numeric targets; got "
                                f"{np.asarray(y).dtype.str.lstrip('|=')}")
    return x_tr, y_tr, x_te, y_te, classes


def _label_name(value) -> str:
    """A class label as text: 1.0 (a float read from a csv) is the class '1', like the integer 1."""
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))
    return str(value)


# --------------------------------------------------------------------------------------------------------------------
# Splits and datasets


def build_array_data(cfg: DataCfg) -> ArrayData:
    if cfg.source == "digits":
        x, y, x_te, y_te, classes = read_digits()
    elif cfg.source in ("lra_image", "lra_pathfinder"):
        x, y, x_te, y_te, classes = read_lra_images(cfg)
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
    stats = {}
    if cfg.normalize:  # per feature, with the training split's statistics only; applied by the model
        mean, std = feature_stats(x)
        stats = {"input_mean": [float(v) for v in mean], "input_std": [float(v) for v in np.maximum(std, 1e-8)]}
    regression = cfg.task == "regression" and cfg.source == "arrays"
    label_dtype = np.float32 if regression else np.int64

    def dataset(x, y):  # pixels stay uint8 (a quarter of float32's memory); collate_arrays makes them float
        return datasets.Dataset.from_dict({"input_values": x if x.dtype == np.uint8 else x.astype(np.float32),
                                           "labels": np.asarray(y).astype(label_dtype)}).with_format("torch")

    extra = {name: dataset(*read_eval_set(cfg, name, None if regression else classes, x.shape[1:]))
             for name in cfg.eval_sets}
    return ArrayData(dataset(x, y), dataset(x_te, y_te), d_input=x.shape[2], num_labels=1 if regression else
                     len(classes), seq_len=x.shape[1], class_names=classes, eval_sets=extra, **stats)


def read_lra_images(cfg: DataCfg):
    """An LRA image task's training split (`data.split`) and evaluation split (`data.val_split`)."""
    x, y, classes = read_lra_split(cfg, cfg.split)
    x_te, y_te, _ = read_lra_split(cfg, cfg.val_split)
    if y_te.max(initial=0) >= len(classes):
        raise DataError(f"data.val_split: class id {int(y_te.max())} of the evaluation split is not among the "
                        f"training split's {len(classes)} classes")
    return x, y, x_te, y_te, classes


def read_lra_split(cfg: DataCfg, split: str):
    """One split of an LRA image task: x, y and the class names."""
    if cfg.source == "lra_pathfinder":
        return (*read_pathfinder(cfg.path, split, cfg.split_seed), ["0", "1"])
    src = SourceCfg(source="dataset", path=cfg.path, name=cfg.name, revision=cfg.revision,
                    data_files=cfg.data_files)  # read as `source: dataset` reads it
    return read_image_dataset(src, split, cfg.split_seed, cfg.cache_dir)


def read_eval_set(cfg: DataCfg, name: str, classes: list[str] | None, shape: tuple) -> tuple:
    """`data.eval_sets.<name>` as (x, y), read as the test split is: one file of `source: arrays` (a `.npz`'s `x`,
    `y`, or a `.csv`), or a split of an LRA image task; labels as the training split's class ids (`classes`, None for
    regression), sequences of the training split's (steps, features) `shape`."""
    spec, key = cfg.eval_sets[name], f"data.eval_sets.{name}"
    if spec.split is not None:  # the recipe allows a split only of the LRA sources here
        x, y, _ = read_lra_split(cfg, spec.split)
    else:
        if len(spec.files) != 1:
            raise DataError(f"{key}.files: give one .npz or .csv file (source arrays)")
        path = Path(spec.files[0])
        if not path.is_file():
            raise DataError(f"{key}.files: no such file: {path}")
        x, y = _read_file(path, f"{key}.files")[:2]
        x = _check_xy(x, y, f"{key}.files: {path}")
        labels = [_label_name(v) for v in y]
    if x.shape[1:] != shape:
        raise DataError(f"{key}: its sequences are {x.shape[1:]} (steps, features), the training split's {shape}")
    if classes is None:
        if np.asarray(y).dtype.kind not in "biuf":
            raise DataError(f"{key}: data.task regression needs numeric targets")
        return x, y
    if spec.split is not None:  # class ids already, numbered as the training split's
        _refuse_unknown(key, [int(v) for v in np.unique(y) if v >= len(classes)])
        return x, y
    index = {c: i for i, c in enumerate(classes)}
    _refuse_unknown(key, sorted({v for v in labels if v not in index}))
    return x, np.array([index[v] for v in labels], dtype=np.int64)


def _refuse_unknown(key: str, unknown: list) -> None:
    if unknown:
        raise DataError(f"{key}: label(s) the training split lacks: {', '.join(map(str, unknown[:5]))}")


def feature_stats(x: np.ndarray, rows: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Each feature's mean and std over (n, L, d), in float64 and two passes as `np.std` computes it, a few thousand
    sequences at a time: Path-X's 160,000 uint8 images would need 21 GB of float64 temporaries at once."""
    count = x.shape[0] * x.shape[1]
    chunks = [slice(start, start + rows) for start in range(0, len(x), rows)]
    mean = sum(x[c].astype(np.float64).sum(axis=(0, 1)) for c in chunks) / count
    var = sum(((x[c].astype(np.float64) - mean) ** 2).sum(axis=(0, 1)) for c in chunks) / count
    return mean, np.sqrt(var)


def collate_arrays(examples: list[dict]) -> dict[str, torch.Tensor]:
    return {"input_values": torch.stack([e["input_values"] for e in examples]).float(),
            "labels": torch.stack([e["labels"] for e in examples])}
