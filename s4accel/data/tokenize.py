"""Tokenizers and fast tokenising: `byte` (ByT5's ids: byte b -> b + 3), a byte-level BPE trained offline, or any
tokenizer `AutoTokenizer` loads; documents -> token ids without a Python loop per token, and token ids -> packed
blocks, both on Arrow buffers, stored in the smallest unsigned dtype that holds the vocabulary.

Why by hand: `datasets.map` over a Python tokenizer (ByT5's) runs at ~0.5 MB/s, hours for a 10 GB corpus. The UTF-8
bytes of an Arrow string column are the byte-level tokens already, so `byte` is an offset added to that buffer; a
subword tokenizer runs in Rust on whole batches (`encode_batch`); packing concatenates the batch's ids (the Arrow
list's values buffer) and reshapes it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, ByT5Tokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ..config import DataCfg
from ..errors import DataError
from .lra_text import listops_tokenizer

BPE_SPECIALS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2, as in ByT5
BYTE_OFFSET = 3  # ByT5: ids 0-2 special (pad, eos, unk), byte b -> b + 3


# --------------------------------------------------------------------------------------------------------------------
# Tokenizers


def build_tokenizer(cfg: DataCfg, docs, save_dir: Path | None = None):
    """`byte`: `ByT5Tokenizer(extra_ids=0)`; `listops`: the ListOps symbols, a word-level tokenizer (lra_text.py);
    `bpe`: a byte-level BPE trained on the documents before the validation tail (`docs`: a dataset with a `text`
    column), loaded from `save_dir` if already trained there (resume, other processes); anything else:
    `AutoTokenizer.from_pretrained` (a folder or a Hub id; no remote code). A tokenizer without an end-of-document
    token is refused; one without a pad token pads with its end-of-document token."""
    if cfg.tokenizer == "byte":
        return ByT5Tokenizer(extra_ids=0)
    if cfg.tokenizer == "listops":
        return listops_tokenizer()
    if cfg.tokenizer == "bpe":
        if save_dir is not None and (save_dir / "tokenizer.json").exists():
            tok = AutoTokenizer.from_pretrained(save_dir)
            # transformers records how it loaded a tokenizer (`is_local`, `local_files_only`: true when offline) and
            # saves that into every model folder; the BPE as trained has neither, so every run saves the same files
            for key in ("is_local", "local_files_only"):
                tok.init_kwargs.pop(key, None)
            return tok
        return train_bpe(cfg, docs, save_dir)
    try:
        tok = AutoTokenizer.from_pretrained(cfg.tokenizer, trust_remote_code=False)
    except Exception as e:  # OSError (not found, offline), ValueError (remote code, unknown class)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"data.tokenizer: cannot load {cfg.tokenizer!r} (byte, bpe, a tokenizer folder or a Hub id): "
                        f"{first[:300]}") from None
    if tok.init_kwargs.get("auto_map"):  # loaded without its code, it would not tokenise as its author meant
        raise DataError(f"data.tokenizer: {cfg.tokenizer} names custom tokenizer code (auto_map "
                        f"{tok.init_kwargs['auto_map']}); s4accel never runs code from a tokenizer folder, and the "
                        f"models it trains must load without it: use a tokenizer.json-only tokenizer")
    if tok.eos_token_id is None:
        if tok.sep_token_id is None:
            raise DataError(f"data.tokenizer: {cfg.tokenizer} has no eos_token (nor sep_token) to end each document "
                            f"with; add one (tokenizer.add_special_tokens) and save it")
        tok.eos_token = tok.sep_token  # BERT-like tokenizers end segments with [SEP]
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def train_bpe(cfg: DataCfg, docs, save_dir: Path | None):
    n_train_docs = max(1, math.floor(len(docs) * (1 - cfg.val_fraction)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=BPE_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs.select(range(n_train_docs))["text"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    if save_dir is not None:
        fast.save_pretrained(save_dir)
    return fast


def is_byte_tokenizer(tokenizer) -> bool:
    return isinstance(tokenizer, ByT5Tokenizer)


def tokenizer_spec(cfg: DataCfg) -> dict:
    """The model config fields the tokenizer decides, known without training a BPE (for `s4accel show`)."""
    if cfg.tokenizer == "bpe":
        return {"vocab_size": cfg.vocab_size, "pad_token_id": 0, "eos_token_id": 1}
    return tokenizer_fields(build_tokenizer(cfg, docs=None))


def tokenizer_fields(tokenizer) -> dict:
    """The model config fields a tokenizer decides: the embedding rows and the special ids."""
    return {"vocab_size": vocab_extent(tokenizer), "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id}


def vocab_extent(tokenizer) -> int:
    """One more than the largest id the tokenizer can produce: the embedding rows a model needs. Usually
    `len(tokenizer)`, but a vocabulary may leave gaps (a word-level vocabulary numbered by frequency rank in a larger
    list, tokens removed), and then ids reach past `len`."""
    return max(len(tokenizer), 1 + max(tokenizer.get_vocab().values(), default=-1))


def token_dtype(tokenizer) -> np.dtype:
    """The smallest unsigned integer type that holds every id."""
    return np.dtype(np.uint16) if vocab_extent(tokenizer) <= 2**16 else np.dtype(np.uint32)


def token_byte_and_char_counts(tokenizer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per token id: how many UTF-8 bytes and characters it stands for, for exact bits per byte / char; None when the
    tokenizer is not byte-level (its tokens need not be whole bytes, so these metrics cannot be computed honestly).

    Byte-level tokens cover whole bytes; a character is counted at its lead byte (a byte that is not a UTF-8
    continuation byte 0b10xxxxxx). The end-of-document token counts one byte and one character: it is a target
    the model is scored on (where a document ends, as a line break would mark it in one text), so its bits are
    counted over a byte of their own; otherwise one-character documents read 224.7 bits per byte (their only
    targets were ends, over bytes that excluded them). Other special and added tokens count zero."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}  # byte-level BPE symbol -> byte
    is_byt5 = is_byte_tokenizer(tokenizer)
    if not is_byt5 and not _byte_level_decoder(tokenizer):
        return None
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    size = vocab_extent(tokenizer)
    n_bytes, n_chars = torch.zeros(size, dtype=torch.long), torch.zeros(size, dtype=torch.long)
    for token, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if is_byt5:
            data = bytes([i - tokenizer.offset])
        elif all(c in byte_of for c in token):
            data = bytes(byte_of[c] for c in token)
        else:
            return None  # a token that is not made of byte symbols: not a byte-level vocabulary after all
        n_bytes[i] = len(data)
        n_chars[i] = sum(1 for b in data if b & 0xC0 != 0x80)
    eos = tokenizer.eos_token_id
    if eos is not None and 0 <= eos < size:
        n_bytes[eos] = n_chars[eos] = 1
    return n_bytes, n_chars


def _byte_level_decoder(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) or []]
    return "ByteLevel" in kinds


# --------------------------------------------------------------------------------------------------------------------
# Documents -> token ids (Arrow in, Arrow out)


def _string_array(column) -> pa.Array:
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return arr if pa.types.is_large_string(arr.type) else arr.cast(pa.large_string())


def encode(texts, tokenizer, eos: int | None, dtype: np.dtype, max_len: int | None = None) -> pa.ListArray:
    """Documents (an Arrow string array, or a list of str) -> their token ids as an Arrow list array, `eos` after
    each document (None: none), each cut to `max_len` tokens (None: whole)."""
    if not isinstance(texts, (pa.Array, pa.ChunkedArray)):
        texts = pa.array(texts, type=pa.large_string())
    if is_byte_tokenizer(tokenizer):
        arr = _string_array(texts)
        # a large_string array's buffers: validity, int64 offsets (of the whole parent when sliced), UTF-8 bytes
        offsets = np.frombuffer(arr.buffers()[1], np.int64)[arr.offset: arr.offset + len(arr) + 1]
        data = np.frombuffer(arr.buffers()[2], np.uint8) if len(arr) else np.zeros(0, np.uint8)
        values = data[offsets[0]:offsets[-1]].astype(dtype)
        values += BYTE_OFFSET
        lengths = np.diff(offsets)
    else:
        encoded = subword_ids(tokenizer, texts.to_pylist())
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        values = np.fromiter((t for ids in encoded for t in ids), dtype=dtype, count=int(lengths.sum()))
    if max_len is not None:  # keep each document's first max_len tokens
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        keep = np.minimum(lengths, max_len)
        values = np.concatenate([values[s:s + k] for s, k in zip(starts, keep)]) if len(keep) else values
        lengths = keep
    if eos is not None:
        values = np.insert(values, np.cumsum(lengths), np.asarray(eos, dtype=dtype))
        lengths = lengths + 1
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def subword_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens. A fast tokenizer's Rust `encode_batch_fast` (no character offsets:
    40% faster here than the tokenizer's `__call__`, which computes them); a Python tokenizer's own `__call__`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def pack(ids, seq_len: int) -> np.ndarray:
    """Token ids of consecutive documents (an Arrow list array) -> `(n, seq_len)` blocks of their concatenation; the
    remainder (< seq_len tokens) is dropped."""
    arr = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
    values = arr.flatten().to_numpy(zero_copy_only=False)
    n = len(values) // seq_len
    return values[: n * seq_len].reshape(n, seq_len)


def blocks_table(blocks: np.ndarray) -> pa.Table:
    """`(n, seq_len)` blocks as an Arrow table with a fixed-size-list column `input_ids` (read back as 2-D arrays)."""
    n, seq_len = blocks.shape
    return pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(blocks.reshape(-1)), seq_len)})
