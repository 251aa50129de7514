"""Long Range Arena's token tasks read from the files of the LRA release, as labelled documents (`text`, `label`):

    lra_listops    `basic_train.tsv`, `basic_val.tsv`, `basic_test.tsv`: a header `Source<TAB>Target`, then one
                   expression and its value (0-9) per line. Read with the `listops` tokenizer (below): brackets
                   dropped, each whitespace-separated symbol one token, as state-spaces/s4 reads it.
    lra_retrieval  `new_aan_pairs.train.tsv`, `new_aan_pairs.eval.tsv`, `new_aan_pairs.test.tsv`, no header:
                   `label<TAB>id1<TAB>id2<TAB>text1<TAB>text2`, label 1 when one paper cites the other. The LRA
                   models encode the two documents separately; an s4accel classifier reads one sequence, so each
                   pair becomes one document: text1's first `doc_len` UTF-8 bytes, the separator byte 0x1E (ASCII
                   record separator, removed from the texts themselves), text2's first `doc_len` bytes.

Split names are `train`, `val` and `test` for both (`val` is the AAN release's `eval` file). Classes are fixed (the
ten digits; 0 and 1), so a small sample that lacks a class still gives the paper's number of labels.
"""

from __future__ import annotations

from pathlib import Path

import datasets
from datasets.exceptions import DatasetGenerationError
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ..errors import DataError

LISTOPS_OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
"""The LRA release's operators: maximum, minimum, median (rounded down), sum modulo 10."""
LISTOPS_END = "]"
LISTOPS_SYMBOLS = (*(str(d) for d in range(10)), *LISTOPS_OPERATORS, LISTOPS_END)
"""Every token of a ListOps expression once its parentheses are dropped."""
SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as the byte tokenizer's
PAIR_SEPARATOR = "\x1e"

SPLIT_FILES = {
    "lra_listops": {"train": "basic_train.tsv", "val": "basic_val.tsv", "test": "basic_test.tsv"},
    "lra_retrieval": {"train": "new_aan_pairs.train.tsv", "val": "new_aan_pairs.eval.tsv",
                      "test": "new_aan_pairs.test.tsv"},
}
CLASSES = {"lra_listops": [str(d) for d in range(10)], "lra_retrieval": ["0", "1"]}
AAN_COLUMNS = ("label", "id1", "id2", "text1", "text2")


def listops_tokenizer():
    """The ListOps vocabulary as a word-level tokenizer: `<pad>`, `</s>`, `<unk>`, then the 15 symbols (18 ids).
    Parentheses are dropped before splitting on whitespace: they only mirror how the generator nested its pairs, and
    without them an expression of the paper's length (at most 2,000 symbols) fits the paper's sequence length."""
    vocab = {token: i for i, token in enumerate((*SPECIALS, *LISTOPS_SYMBOLS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(Regex(r"[()]"), " ")
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def split_file(source: str, path: str, split: str) -> Path:
    files = SPLIT_FILES[source]
    if split not in files:
        raise DataError(f"data.split: {source} has the splits {', '.join(files)}, not {split!r}")
    folder = Path(path)
    if not folder.is_dir():
        raise DataError(f"data.path: no such folder: {path} (the folder of the LRA release holding {files[split]})")
    file = folder / files[split]
    if not file.is_file():
        raise DataError(f"data.path: {path} has no {files[split]} (the {split} split of {source})")
    return file


def lra_documents(source: str, path: str, split: str, cache_dir=None, doc_len: int | None = None):
    """The `split` of an LRA token task as a dataset with `text` and `label` (a `ClassLabel`) columns."""
    file = split_file(source, path, split)
    if source == "lra_listops":
        with open(file, encoding="utf-8", errors="replace") as f:
            first = f.readline().rstrip("\r\n")
        header = first.split("\t")
        if header != ["Source", "Target"]:
            raise DataError(f"data.path: {file}: the first line is {first[:80]!r}; ListOps files start "
                            f"with Source<TAB>Target")
        ds = _read_tsv(file, cache_dir, ("Source", "Target"), header=0)
        ds = ds.rename_columns({"Source": "text", "Target": "label"})
    else:
        ds = _read_tsv(file, cache_dir, AAN_COLUMNS, header=None)
        ds = ds.map(lambda b: {"text": [join_pair(x, y, doc_len) for x, y in zip(b["text1"], b["text2"])]},
                    batched=True, remove_columns=["id1", "id2", "text1", "text2"], desc="joining document pairs")
    return _class_labels(ds, CLASSES[source], file)


def join_pair(text1: str | None, text2: str | None, doc_len: int | None) -> str:
    """Two documents as one: each cut to its first `doc_len` UTF-8 bytes (None: whole), joined by the separator."""

    def cut(text):
        text = (text or "").replace(PAIR_SEPARATOR, " ")
        return text if doc_len is None else text.encode()[:doc_len].decode("utf-8", "ignore")

    return cut(text1) + PAIR_SEPARATOR + cut(text2)


def _read_tsv(file: Path, cache_dir, columns, header):
    """A tab-separated file through `datasets`' csv builder, every field read as written: no quoting (texts hold
    quotes), nothing turned into a missing value ("NA" is a word), every column a string."""
    features = datasets.Features({c: datasets.Value("string") for c in columns})
    try:
        return datasets.load_dataset("csv", data_files=[str(file)], split="train", cache_dir=cache_dir,
                                     delimiter="\t", quoting=3, na_filter=False, header=header,
                                     column_names=None if header == 0 else list(columns), features=features)
    except (DatasetGenerationError, ValueError) as e:
        cause = e.__cause__ or e
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise DataError(f"data.path: {file}: cannot be read as tab-separated columns ({detail[:200]})") from None


def _class_labels(ds, names: list[str], file: Path):
    """The `label` column (text such as `7`, `1` or `1.0`) as a `ClassLabel` of `names`; another value is an error
    naming it."""
    def number(value: str) -> str:
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            return str(value)
        return str(int(as_float)) if as_float.is_integer() else str(value)

    found = {v: number(v) for v in set(ds["label"])}
    bad = sorted(v for v, n in found.items() if n not in names)
    if bad:
        raise DataError(f"data.path: {file}: label {bad[0]!r} is not one of {', '.join(names)}")
    index = {v: names.index(n) for v, n in found.items()}
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)})
    return ds.map(lambda b: {"label": [index[v] for v in b["label"]]}, batched=True, features=features,
                  desc="reading labels")
