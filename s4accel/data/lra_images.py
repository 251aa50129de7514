"""Long Range Arena's image tasks as sequences of grayscale pixels, row by row, one feature per step (the paper's
setting: no 2-D structure is given to the model):

    lra_image       an image classification dataset through `datasets` (`data.path`: a Hub id such as
                    `uoft-cs/cifar10`, a local folder, or a `save_to_disk` folder) with one image column and a `label`
                    column: LRA Image is CIFAR-10, 32x32 = 1,024 steps. Colour images become grayscale with the ITU-R
                    601-2 luma weights (PIL's `L` mode, torchvision's `Grayscale`). Splits: its `test` split, and the
                    `train` split less a seeded 10% (`val`), as state-spaces/s4 holds out.
    lra_pathfinder  a folder of the release's Pathfinder images (`data.path`: e.g. `lra_release/pathfinder32/
                    curv_contour_length_14`; `pathfinder128/...` is Path-X, 16,384 steps): `metadata/<n>.npy` files
                    (text, despite the name) with one line per image, `<folder> <file> <?> <label> ...`, the image at
                    `<folder>/<file>`. Splits: a seeded 80/10/10 of all images (train/val/test), as state-spaces/s4
                    cuts them; the release ships one empty PNG, skipped.

Pixels stay uint8 (Path-X's 200,000 images take 3.3 GB so, four times that as float32); the batch is made float
when collated, and the model standardises it with the training split's statistics (`data.normalize`).
"""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np

from ..errors import DataError
from .sources import load_dataset_source

HELD_OUT = 0.1
"""The share of images held out for each of validation and test where the source has no such split of its own."""
SPLITS = ("train", "val", "test")


def _check_split(split: str, key: str):
    if split not in SPLITS:
        raise DataError(f"{key}: LRA image tasks have the splits {', '.join(SPLITS)}, not {split!r}")


def _grayscale(image) -> np.ndarray:
    """A PIL image -> its grayscale pixels as a uint8 vector, row by row."""
    return np.asarray(image.convert("L"), dtype=np.uint8).reshape(-1)


def _stack(rows: list[np.ndarray], where: str) -> np.ndarray:
    sizes = sorted({len(r) for r in rows})
    if len(sizes) > 1:
        raise DataError(f"data.path: {where}: images of different sizes ({sizes[0]} and {sizes[-1]} pixels); LRA "
                        f"tasks have one size")
    return np.stack(rows)[:, :, None]  # (n, L, 1)


def _seeded_parts(n: int, seed: int, parts: int) -> list[np.ndarray]:
    """A seeded permutation of range(n) cut into `parts - 1` held-out shares of HELD_OUT each, then the rest."""
    order = np.random.default_rng(seed).permutation(n)
    k = int(round(n * HELD_OUT))
    if n - (parts - 1) * k < 1 or k < 1:
        raise DataError(f"{n} images are too few to hold out {HELD_OUT:.0%} for each split")
    return [order[i * k:(i + 1) * k] for i in range(parts - 1)] + [order[(parts - 1) * k:]]


# --------------------------------------------------------------------------------------------------------------------
# Pathfinder and Path-X


def pathfinder_samples(folder: Path) -> list[tuple[Path, int]]:
    """(image path, label) from every metadata file, in the order of their numbers."""
    meta = folder / "metadata"
    files = sorted((p for p in meta.glob("*.npy") if p.stem.isdigit()), key=lambda p: int(p.stem))
    if not files:
        raise DataError(f"data.path: {folder} has no metadata/<n>.npy files (point it at a Pathfinder folder such as "
                        f"pathfinder32/curv_contour_length_14)")
    samples = []
    for f in files:
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 4 or fields[3] not in ("0", "1"):
                raise DataError(f"data.path: {f}: line {i} is not '<folder> <file> <?> <label 0|1> ...': "
                                f"{line[:80]!r}")
            samples.append((folder / fields[0] / fields[1], int(fields[3])))
    return samples


def read_pathfinder(path: str, split: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The `split`'s pixels (n, H*W, 1) uint8 and labels (n,)."""
    from PIL import Image, UnidentifiedImageError  # matplotlib's dependency, needed for Pathfinder's PNGs only

    _check_split(split, "data.split")
    folder = Path(path)
    if not folder.is_dir():
        raise DataError(f"data.path: no such folder: {path}")
    samples = [(p, y) for p, y in pathfinder_samples(folder) if not (p.is_file() and p.stat().st_size == 0)]
    test, val, train = _seeded_parts(len(samples), seed, 3)
    rows, labels = [], []
    for i in np.sort({"train": train, "val": val, "test": test}[split]):
        image_path, label = samples[i]
        try:
            with Image.open(image_path) as image:
                rows.append(_grayscale(image))
        except FileNotFoundError:
            raise DataError(f"data.path: {image_path}, named in the metadata, does not exist") from None
        except UnidentifiedImageError:
            raise DataError(f"data.path: {image_path} is not an image") from None
        labels.append(label)
    return _stack(rows, path), np.asarray(labels, dtype=np.int64)


# --------------------------------------------------------------------------------------------------------------------
# Image classification datasets (CIFAR-10)


def read_image_dataset(src, split: str, seed: int, cache_dir=None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The `split`'s grayscale pixels (n, H*W, 1) uint8, labels (n,) and class names, from a `datasets` source read
    as `source: dataset` reads it (`src`: a `SourceCfg`)."""

    _check_split(split, "data.split")
    ds = load_dataset_source(src, "test" if split == "test" else "train", cache_dir)
    images = [name for name, f in ds.features.items() if isinstance(f, datasets.Image)]
    if len(images) != 1 or "label" not in ds.features:
        raise DataError(f"data.path: {src.path}: expected one image column and a 'label' column (columns: "
                        f"{', '.join(ds.column_names)})")
    feature = ds.features["label"]
    names = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    if split != "test":  # the seeded hold-out of the train split
        val, train = _seeded_parts(len(ds), seed, 2)
        ds = ds.select(np.sort(val if split == "val" else train))
    rows = [_grayscale(image) for image in ds[images[0]]]
    labels = np.asarray(ds["label"])
    if names is None:
        if labels.dtype.kind not in "iu":
            raise DataError(f"data.path: {src.path}: 'label' must hold class ids (integers or a ClassLabel)")
        names = [str(c) for c in range(int(labels.max()) + 1)]
    return _stack(rows, src.path), labels.astype(np.int64), names
