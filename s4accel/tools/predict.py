"""`s4accel predict MODEL DATA --out FILE`: a trained model over new data, one output row per example, in the
examples' order, with their ids.

    classifier   id, prediction (the label, by name when the data had names), the probability of each class
    regressor    id, prediction (the value)
    language     id, tokens, loss (nats per token), bits per byte (a byte-level tokenizer): per document; long
    model        documents are read in windows of the training block length, each from a fresh state

`keep` (`--keep id,label`) copies input columns into each row after the id, so the output can be scored without a
join: any column of a data file, or `label` (the true label by name) of number sequences.

DATA is a data file or folder of any kind the data section reads (`.txt`, `.json`/`.jsonl`, `.csv`, `.parquet`,
`.arrow`, a `save_to_disk` folder; `.npz`/`.csv` of numbers for a model of sequences of numbers), or a recipe
(`.yaml`), whose evaluation split is used. The model says how to read it: `preprocessing.json` beside its weights
(the columns, the length), its tokenizer, its config (label names, input statistics). Under `accelerate launch`
every process predicts its share and the main process writes all rows once.
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow.compute as pc
import torch
from accelerate import Accelerator
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from tqdm.auto import tqdm

from ..config import SourceCfg, load_recipe
from ..data import build_data
from ..data.arrays import read_arrays
from ..data.sources import is_saved_dataset, load_dataset_source, load_files
from ..data.tokenize import encode, token_byte_and_char_counts
from ..errors import DataError, ModelError
from ..training.ending import finish
from ..training.runs.safe_load import load_model
from .outputs import WholeFile, check_output_file

ID_COLUMNS = ("id", "idx", "uid", "example_id")
WRITTEN = ("id", "prediction", "tokens", "loss", "bits_per_byte")
"""Columns predict writes itself (and `prob_<class>`): a kept input column may not take one of these names."""


class Preprocessing(BaseModel):
    """`preprocessing.json`: how the model's training read raw data. It comes from a model folder, perhaps someone
    else's, so it is checked like `config.json` is: a wrong value is one line, never a silent wrong answer."""

    # strict: `true` is not a length, 7 not a column name; a newer s4accel may record more
    model_config = ConfigDict(extra="ignore", strict=True)
    kind: Literal["text", "labelled_text", "arrays"]
    text_field: str = Field(min_length=1)
    label_field: str | None
    seq_len: int = Field(ge=1)
    task: Literal["causal_lm", "classification", "regression"]

    @model_validator(mode="after")
    def _a_window_holds_a_target(self):
        if self.kind == "text" and self.seq_len < 2:  # one token predicts nothing: every row would read 0
            raise ValueError(f"seq_len: a language model reads windows of at least 2 tokens (a token and its "
                             f"target), got {self.seq_len}")
        return self


def read_preprocessing(model_dir: Path, model) -> dict:
    """The model's preprocessing record; for a model exported before it existed, what its config implies (with a
    warning, as its inputs' statistics, if any, were applied outside the model)."""
    path = model_dir / "preprocessing.json"
    config = model.config
    kind = "text" if not type(model).__name__.endswith("ForSequenceClassification") else \
        "arrays" if getattr(config, "d_input", None) else "labelled_text"
    if path.is_file():
        try:
            prep = Preprocessing.model_validate_json(path.read_bytes()).model_dump()
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ModelError(f"{path}: not a valid preprocessing record: {where + ': ' if where else ''}"
                             f"{err['msg']}") from None
        except OSError as e:
            raise ModelError(f"{path}: cannot read ({e.strerror or e})") from None
        if prep["kind"] != kind:
            raise ModelError(f"{path}: records {prep['kind']!r} data, but the model beside it reads {kind!r} data")
        return prep
    warnings.warn(f"{model_dir} carries no preprocessing record (exported before s4accel saved one): reading the data "
                  f"as {kind}{', inputs used as given (no standardisation statistics)' if kind == 'arrays' else ''}",
                  stacklevel=2)
    task = "regression" if getattr(config, "problem_type", None) == "regression" else "classification"
    return {"kind": kind, "text_field": "text", "label_field": None, "seq_len": 1024,
            "task": task if kind != "text" else "causal_lm"}


def examples(data: str | Path, prep: dict, tokenizer, keep: tuple[str, ...] = ()) -> tuple[int, dict]:
    """(how many, inputs): `inputs` holds `input_values` (an array, for arrays) or `table`, a memory-mapped dataset
    with `text` or `input_ids` and perhaps `id`, read a batch at a time (1M rows never become Python objects at
    once); and `kept`, the columns of `keep` (a dataset, or for arrays a list of labels). Checked before any
    compute: a column the data lacks is one line."""
    path = Path(data)
    keep = tuple(k for k in keep if k != "id")  # the id is written anyway: the id column, else the row number
    for name in keep:
        if name in WRITTEN or name.startswith("prob_"):
            raise DataError(f"--keep: {name!r} is a column predict writes itself; rename it in DATA")
    if path.suffix in (".yaml", ".yml"):
        if keep:
            raise DataError("--keep: a recipe's evaluation split has no input columns to keep; give its data file "
                            "as DATA")
        return _recipe_examples(path, prep)
    if prep["kind"] == "arrays":
        x, y, _, _, classes = read_arrays([str(path)], prep["task"])
        inputs = {"input_values": np.asarray(x, dtype=np.float32)}
        if keep:
            if keep != ("label",):
                raise DataError(f"--keep: {path} holds number sequences and their labels: only 'label' can be kept "
                                f"(asked for {', '.join(keep)})")
            inputs["kept"] = [classes[i] for i in y] if classes else [float(v) for v in y]  # by name, as written
        return len(x), inputs
    if is_saved_dataset(path):
        raw = load_dataset_source(SourceCfg(source="dataset", path=str(path)), "train")
    else:
        raw = load_files([str(path)], "DATA", columns=None)
    if prep["text_field"] not in raw.column_names:
        raise DataError(f"DATA: no field {prep['text_field']!r} in {path} "
                        f"(fields: {', '.join(raw.column_names)}); the "
                        f"model was trained on that field")
    missing = [k for k in keep if k not in raw.column_names]
    if missing:
        raise DataError(f"--keep: no column {missing[0]!r} in {path} (columns: {', '.join(raw.column_names)})")
    column = next((c for c in ID_COLUMNS if c in raw.column_names), None)
    keep = tuple(k for k in keep if k != column)  # written as the id already (a `uid` kept too was written twice)
    read = {prep["text_field"]: "text", **({column: "id"} if column not in (None, prep["text_field"]) else {})}
    table = raw.select_columns(list(read))
    renamed = {old: new for old, new in read.items() if old != new}
    inputs = {"table": table.rename_columns(renamed) if renamed else table}
    if keep:
        inputs["kept"] = raw.select_columns(list(keep))
    return len(table), inputs


def _recipe_examples(path: Path, prep: dict):
    recipe = load_recipe(path)
    data = build_data(recipe.data)
    val = data.val
    if prep["kind"] == "arrays":
        return len(val), {"input_values": np.asarray(val[:]["input_values"], dtype=np.float32)}
    return len(val), {"table": val.select_columns(["input_ids"]).with_format(None)}


def predict(ref: str | Path, data: str | Path, out: str | Path, batch_size: int = 16, which: str = "final",
            progress: bool = True, keep: tuple[str, ...] = ()) -> Path | None:
    """Predict every example of `data`; the main process writes `out` (`.csv` or `.jsonl`) and gets its path.
    Examples are read, predicted and written a batch at a time: memory stays flat however many there are. `keep`:
    input columns copied into each row after the id."""
    out = Path(out)
    if out.suffix not in (".csv", ".jsonl"):
        raise DataError(f"--out {out}: expected a .csv or .jsonl file")
    check_output_file(out, "--out")  # before any compute, on every process (none is left waiting for another)
    model, tokenizer, model_dir = load_model(ref, which)
    prep = read_preprocessing(model_dir, model)
    accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    with accelerator.main_process_first():
        count, inputs = examples(data, prep, tokenizer, tuple(keep))
    if not count:
        raise DataError(f"{data}: no example to predict")
    if prep["kind"] == "arrays":
        x = inputs["input_values"]
        width = x.shape[2] if x.ndim == 3 else 1
        if width != model.config.d_input:
            raise DataError(f"{data}: {width} feature(s) per step, but the model was trained on "
                            f"{model.config.d_input}")
    rows = Rows(prep, model, tokenizer, inputs)
    loader = torch.utils.data.DataLoader(range(count), batch_sampler=LengthBatches(rows, count, batch_size),
                                         collate_fn=rows.batch)
    model, loader = accelerator.prepare(model, loader)
    model.eval()
    writer = RecordWriter(out) if accelerator.is_main_process else None
    order = InOrder()
    bar = tqdm(total=count, desc="predict", disable=not (progress and accelerator.is_main_process))
    try:
        with torch.no_grad():
            for batch in loader:
                values = rows.predict(model, batch)
                gathered = accelerator.gather_for_metrics(values)  # drops the padded duplicates of the last batch
                bar.update(len(gathered))
                if writer is not None:  # the examples in their own order, as soon as each is next
                    ready = order.add(gathered.cpu().numpy())
                    index = [int(i) for i in ready[:, 0]]
                    writer.write([{"id": i, **kept, **rows.record(r[1:])}
                                  for i, kept, r in zip(rows.ids(index), rows.kept(index), ready)])
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise
    bar.close()
    del model, loader
    finish(accelerator)
    if writer is None:
        return None
    writer.close()
    return out


class LengthBatches:
    """Batches of examples of about the same length, so that a batch is not padded to one long document: each window
    of about `WINDOW` consecutive examples (whole batches) is sorted by length (of the text, in bytes) and cut into
    full batches (only the very last batch of all may be short, as `gather_for_metrics` expects). Text only; other
    inputs keep their order. `InOrder` puts the results back in the examples' order, holding at most a window."""

    WINDOW = 2048

    def __init__(self, rows: "Rows", count: int, batch_size: int):
        self.rows, self.count, self.batch_size = rows, count, batch_size

    def __len__(self) -> int:
        return -(-self.count // self.batch_size)

    def __iter__(self):
        span = self.batch_size * max(1, self.WINDOW // self.batch_size)
        for start in range(0, self.count, span):
            indices = np.arange(start, min(start + span, self.count))
            lengths = self.rows.lengths(start, len(indices))
            if lengths is not None:
                indices = indices[np.argsort(-lengths, kind="stable")]  # longest first: a slow batch shows early
            for i in range(0, len(indices), self.batch_size):
                yield indices[i: i + self.batch_size].tolist()


class InOrder:
    """Rows (the example's index first) arriving in any order -> the rows whose turn has come, in index order. An
    index seen before (a duplicate padding the last round of processes) is dropped."""

    def __init__(self):
        self.next, self.waiting = 0, {}

    def add(self, table: np.ndarray) -> np.ndarray:
        for row in table:
            i = int(row[0])
            if i >= self.next:
                self.waiting.setdefault(i, row.copy())  # not a view holding the whole gathered table
        ready = []
        while self.next in self.waiting:
            ready.append(self.waiting.pop(self.next))
            self.next += 1
        return np.stack(ready) if ready else table[:0]


class RecordWriter:
    """The output file, written a batch of records at a time into a temporary file beside it that replaces it at the
    end. A write that fails (a full disk) is kept and reported after every process has finished the loop, so no
    process is left waiting for the main one: then one line, and `out` as it was."""

    def __init__(self, out: Path):
        self.csv = out.suffix == ".csv"
        self.whole = WholeFile(out, "--out", newline="" if self.csv else None)
        self.file = self.whole.file
        self.writer, self.failed = None, None

    def write(self, records: list[dict]) -> None:
        if self.failed is not None or not records:
            return
        try:
            if not self.csv:
                self.file.writelines(json.dumps(r) + "\n" for r in records)
                return
            if self.writer is None:
                self.writer = csv.DictWriter(self.file, fieldnames=list(records[0]))
                self.writer.writeheader()
            self.writer.writerows(records)
        except OSError as e:
            self.failed = e

    def close(self) -> None:
        if self.failed is not None:
            self.whole.discard()
            raise self.whole.error(self.failed)
        self.whole.commit()

    def abandon(self) -> None:
        self.whole.discard()


def _rows(table, indices: list[int]) -> dict:
    """The rows at `indices` as columns of lists: a slice when they are consecutive (as the unshuffled loader's batches
    are), which reads the Arrow table directly, where a list of indices makes datasets gather row by row."""
    if indices and indices == list(range(indices[0], indices[0] + len(indices))):
        return table[indices[0]: indices[0] + len(indices)]
    return table[indices]


class Rows:
    """How one kind of model turns examples into a batch, a batch into a row of numbers per example (the example's
    index first), and a row into an output record."""

    def __init__(self, prep: dict, model, tokenizer, inputs: dict):
        self.kind, self.model_config, self.tokenizer, self.inputs = prep["kind"], model.config, tokenizer, inputs
        self.seq_len = prep["seq_len"]
        self.regression = getattr(model.config, "problem_type", None) == "regression"
        self.names = [model.config.id2label[i] for i in range(model.config.num_labels)] \
            if self.kind != "text" and not self.regression else []
        if self.kind != "arrays" and tokenizer is None:
            raise ModelError("the model has no tokenizer saved: it cannot read text")
        if self.kind == "text":
            self.counts = token_byte_and_char_counts(tokenizer)

    def ids(self, indices: list[int]) -> list:
        """The examples' ids for the output: their `id` column (or idx, uid, example_id), else their position."""
        table = self.inputs.get("table")
        if table is None or "id" not in table.column_names:
            return indices
        return _rows(table.select_columns(["id"]), indices)["id"]

    def kept(self, indices: list[int]) -> list[dict]:
        """The examples' kept input columns (`--keep`), one dict per example (empty without)."""
        kept = self.inputs.get("kept")
        if kept is None:
            return [{} for _ in indices]
        if isinstance(kept, list):  # the labels of number sequences
            return [{"label": kept[i]} for i in indices]
        columns = _rows(kept, indices)
        return [{k: columns[k][j] for k in kept.column_names} for j in range(len(indices))]

    def _sequences(self, indices: list[int]) -> list[np.ndarray]:
        rows = _rows(self.inputs["table"], indices)
        if "input_ids" in rows:
            return [np.asarray(ids, dtype=np.int64) for ids in rows["input_ids"]]
        texts = [t or "" for t in rows["text"]]  # every row, empty ones too: one output each
        # training's own tokenisation (the byte tokenizer on the UTF-8 buffer, a fast tokenizer in Rust): a
        # language model's documents end with EOS, a classifier reads the first seq_len tokens
        lm = self.kind == "text"
        encoded = encode(texts, self.tokenizer, self.tokenizer.eos_token_id if lm else None, np.dtype(np.int64),
                         None if lm else self.seq_len)
        offsets, values = encoded.offsets.to_numpy(), encoded.values.to_numpy().copy()  # Arrow's is read-only
        return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def lengths(self, start: int, n: int) -> np.ndarray | None:
        """The UTF-8 lengths of examples start..start+n (a missing text: 0), or None where they are not text."""
        table = self.inputs.get("table")
        if table is None or "text" not in table.column_names:
            return None
        column = table.with_format("arrow").select_columns(["text"])[start: start + n]["text"]
        return pc.fill_null(pc.binary_length(column), 0).to_numpy(zero_copy_only=False)

    def batch(self, indices: list[int]) -> dict:
        index = torch.tensor(indices, dtype=torch.long)
        if self.kind == "arrays":
            return {"index": index, "input_values": torch.from_numpy(self.inputs["input_values"][indices])}
        seqs = self._sequences(indices)
        longest = max(1, *(len(s) for s in seqs))  # a batch of empty documents still has one (masked) position
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(seqs), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)], mask[r, : len(s)] = torch.from_numpy(s), 1
        return {"index": index, "input_ids": ids, "attention_mask": mask}

    def predict(self, model, batch: dict) -> torch.Tensor:
        index = batch["index"].double()[:, None]
        if self.kind == "text":
            return torch.cat([index, self._document_losses(model, batch)], dim=1)
        inputs = {k: v for k, v in batch.items() if k != "index"}
        logits = model(**inputs).logits.double()
        values = logits if self.regression else torch.softmax(logits, dim=-1)
        return torch.cat([index, values], dim=1)

    def _document_losses(self, model, batch: dict) -> torch.Tensor:
        """(B, 3): tokens predicted, summed NLL (nats), UTF-8 bytes of those tokens (-1: not a byte-level tokenizer),
        reading each document in windows of `seq_len` tokens (each from a fresh state: the model was trained so)."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        out = torch.zeros(ids.shape[0], 3, dtype=torch.float64, device=ids.device)
        for start in range(0, ids.shape[1], self.seq_len):
            window, real = ids[:, start: start + self.seq_len], mask[:, start: start + self.seq_len]
            if window.shape[1] < 2 or not real[:, 1:].any():
                continue
            logits = model(input_ids=window, attention_mask=real).logits[:, :-1].float()
            targets = window[:, 1:]
            keep = real[:, 1:].bool()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
            out[:, 0] += keep.sum(1)
            out[:, 1] += (nll * keep).sum(1)
            if self.counts is not None:
                out[:, 2] += (self.counts[0].to(targets.device)[targets] * keep).sum(1)
        if self.counts is None:
            out[:, 2] = -1
        return out

    def record(self, row: np.ndarray) -> dict:
        """What the model says of one example: the output columns after its id (and kept columns)."""
        if self.kind == "text":
            tokens, nll, n_bytes = row[:3]
            rec = {"tokens": int(tokens), "loss": nll / max(tokens, 1)}
            if n_bytes >= 0:
                rec["bits_per_byte"] = nll / math.log(2) / max(n_bytes, 1)
            return rec
        if self.regression:
            return {"prediction": float(row[0])}
        probs = row[: len(self.names)]
        return {"prediction": self.names[int(np.argmax(probs))],
                **{f"prob_{name}": float(p) for name, p in zip(self.names, probs)}}
