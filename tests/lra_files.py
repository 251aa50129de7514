"""Tiny Long Range Arena data in exactly the layouts the LRA release (and the `datasets` copies of IMDB and CIFAR-10)
come in, written by hand here (not by s4accel's own writers), for the LRA tests and the LRA recipes' tests."""

from pathlib import Path

import numpy as np

LISTOPS = [  # (source as the release writes it, value)
    ("( ( ( [MAX 2 ) 9 ) ] )", 9),
    ("( ( ( ( [MIN 4 ) 7 ) ( ( ( [SM 8 ) 5 ) ] ) ) ] )", 3),
    ("( ( ( [MED 1 ) 6 ) ] )", 3),
    ("( ( ( ( ( [SM 9 ) 9 ) 9 ) ( ( ( [MAX 0 ) 1 ) ] ) ) ] )", 8),
]


def write_listops(folder: Path, rows=LISTOPS) -> Path:
    """basic_{train,val,test}.tsv: a header, then `Source<TAB>Target`, lines ending in \\r\\n (Python's csv module,
    which wrote the release); every split holds `rows`, the test split reversed."""
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val", "test"):
        lines = ["Source\tTarget"] + [f"{s}\t{v}" for s, v in (rows if split != "test" else rows[::-1])]
        (folder / f"basic_{split}.tsv").write_bytes(("\r\n".join(lines) + "\r\n").encode())
    return folder


AAN = [  # (label as written, text1, text2)
    ("1", 'We cite "Smith" NA et al.', "Smith et al. propose a parser."),
    ("0", "A study of tagging.", "An unrelated caf\u00e9 paper."),
    ("1.0", "Third paper.", "Fourth paper, cited."),
    ("0.0", "Fifth.", "Sixth."),
]


def write_aan(folder: Path, rows=AAN) -> Path:
    """new_aan_pairs.{train,eval,test}.tsv, no header: label, id1, id2, text1, text2."""
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval", "test"):
        lines = [f"{label}\tid{i}a\tid{i}b\t{t1}\t{t2}" for i, (label, t1, t2) in enumerate(rows)]
        (folder / f"new_aan_pairs.{split}.tsv").write_text("\n".join(lines) + "\n")
    return folder


def pathfinder_image(i: int, size: int) -> np.ndarray:
    """A distinct uint8 image per index: its first pixel is i, the rest a seeded pattern."""
    pixels = np.random.default_rng(i).integers(0, 256, size=(size, size), dtype=np.uint8)
    pixels[0, 0] = i % 256
    return pixels


def write_pathfinder(folder: Path, n: int = 40, size: int = 32, per_file: int = 15, empty: int | None = 3) -> Path:
    """The release's Pathfinder layout: imgs/<k>/sample_<j>.png (grayscale PNGs) and metadata/<k>.npy, text lines
    `imgs/<k> sample_<j>.png <index> <label> <more fields>`; image `empty` is the release's empty (0-byte) file."""
    from PIL import Image

    for k in range((n + per_file - 1) // per_file):
        (folder / "imgs" / str(k)).mkdir(parents=True, exist_ok=True)
    (folder / "metadata").mkdir(parents=True, exist_ok=True)
    lines = {}
    for i in range(n):
        k, j = divmod(i, per_file)
        path = folder / "imgs" / str(k) / f"sample_{j}.png"
        if i == empty:
            path.write_bytes(b"")
        else:
            Image.fromarray(pathfinder_image(i, size), mode="L").save(path)
        lines.setdefault(k, []).append(f"imgs/{k} sample_{j}.png {j} {i % 2} 6 1.5 14 0.6")
    for k, rows in lines.items():
        (folder / "metadata" / f"{k}.npy").write_text("\n".join(rows) + "\n")
    return folder


def write_image_dataset(folder: Path, n_train: int = 30, n_test: int = 10, size: int = 32) -> Path:
    """A CIFAR-10 shaped `save_to_disk` folder: splits train and test, RGB `img` and a 10-class `label`."""
    import datasets
    from PIL import Image

    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=names)})

    def split(n, offset):
        rng = np.random.default_rng(offset)
        images = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), mode="RGB") for _ in range(n)]
        return datasets.Dataset.from_dict({"img": images, "label": [i % 10 for i in range(n)]}, features=features)

    datasets.DatasetDict({"train": split(n_train, 0), "test": split(n_test, 1)}).save_to_disk(str(folder))
    return folder


def write_imdb(folder: Path) -> Path:
    """An IMDB shaped `save_to_disk` folder (stanfordnlp/imdb's columns): `text`, `label` (neg, pos); train, test."""
    import datasets

    label = datasets.ClassLabel(names=["neg", "pos"])
    features = datasets.Features({"text": datasets.Value("string"), "label": label})
    rows = {"text": [f"Review {i}: {'great' if i % 2 else 'dull'} film " * 3 for i in range(12)],
            "label": [i % 2 for i in range(12)]}
    split = datasets.Dataset.from_dict(rows, features=features)
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(folder))
    return folder


def write_for(recipe, folder: Path) -> Path:
    """Stand-in data for an LRA recipe, in its source's layout (Path-X: 128x128 images)."""
    d = recipe.data
    if d.source == "lra_listops":
        return write_listops(folder)
    if d.source == "lra_retrieval":
        return write_aan(folder)
    if d.source == "lra_pathfinder":
        return write_pathfinder(folder, n=20, size=128 if "128" in d.path else 32)
    if d.source == "lra_image":
        return write_image_dataset(folder)
    return write_imdb(folder)
