"""Preprocessing speed: MB of text per second tokenised and packed into blocks, by the data layer's own paths and by
the way it was done before (a `datasets.map` over ByT5's Python tokenizer, then packing Python lists of ints), in one
run. Prints one JSON object.

    python bench/data.py [--mb 100] [--repeats 3] [--seq-len 256]

Corpus: the 38 built-in plays repeated to about `--mb` MB, as an Arrow-backed dataset (so `map` writes its cache
files, as a real run's does). Methods, each on one core (`TOKENIZERS_PARALLELISM=false`, one torch thread), median
over `--repeats` runs, each from an empty cache:
    byte      tokenize.py's byte path: the Arrow string buffer + 3, EOS inserted, reshaped into blocks
    subword   a 4,096-token byte-level BPE (trained on the plays, not timed), Rust `encode_batch` per 1,000 documents
    baseline  `datasets.map` over `ByT5Tokenizer` (Python), then packing Python lists (on a `--baseline-mb` slice: it
              is slow)
    stream    data.streaming: blocks read from a JSON Lines copy of the corpus, tokenised and packed on the fly
    subword_tokenizer_alone
              the same BPE's Rust `encode_batch_fast` on the corpus's texts already in memory, nothing else: the
              ceiling of any subword path on this CPU (on a `--baseline-mb` slice)
Also: the cache's bytes per token (the blocks are stored as uint16), and how many times over the stream could feed
the quick-start's training (its 400 steps of 16 x 256 tokens took 92 s on these machines: ~17,800 tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core for the Rust tokenizer too
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUICKSTART_TOKENS_PER_S = 400 * 16 * 256 / 92.0


def corpus(mb: float, folder: Path):
    """The plays repeated to about `mb` MB, saved to disk and loaded back (Arrow-backed, memory-mapped)."""
    import datasets

    from s4accel.data.sources import shakespeare

    plays = shakespeare()
    size = sum(len(t.encode()) for t in plays["text"])
    copies = max(1, round(mb * 1e6 / size))
    ds = datasets.concatenate_datasets([plays.select_columns(["text"])] * copies)
    ds.save_to_disk(str(folder / "corpus"))
    return datasets.load_from_disk(str(folder / "corpus")), copies * size / 1e6


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def ours(docs, tokenizer, seq_len, cache_root: Path):
    """The data layer's map-style path, from an empty cache each time (a fresh copy of the dataset's files)."""
    import datasets

    from s4accel.data.text import to_blocks

    def run():
        work = Path(tempfile.mkdtemp(dir=cache_root))
        docs.save_to_disk(str(work / "docs"))
        return to_blocks(datasets.load_from_disk(str(work / "docs")), tokenizer, seq_len)

    return run


def baseline(docs, tokenizer, seq_len):
    """The way before: a Python tokenizer through `datasets.map`, then packing Python lists of ints."""
    def run():
        eos = tokenizer.eos_token_id

        def tokenize(batch):
            return {"ids": [x + [eos] for x in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}

        def pack(batch):
            stream = [t for ids in batch["ids"] for t in ids]
            n = len(stream) // seq_len * seq_len
            return {"input_ids": [stream[i: i + seq_len] for i in range(0, n, seq_len)]}

        tokens = docs.map(tokenize, batched=True, remove_columns=docs.column_names, load_from_cache_file=False)
        return tokens.map(pack, batched=True, batch_size=1000, remove_columns=["ids"], load_from_cache_file=False)

    return run


def tokenizer_alone(docs, tokenizer):
    """The Rust tokenizer by itself: texts in a Python list, ids discarded."""
    texts = docs["text"]

    def run():
        for i in range(0, len(texts), 1000):
            tokenizer.backend_tokenizer.encode_batch_fast(texts[i: i + 1000], add_special_tokens=False)

    return run


def cache_bytes_per_token(blocks, seq_len: int) -> float:
    files = {f["filename"] for f in blocks.cache_files}
    return sum(os.path.getsize(f) for f in files) / (len(blocks) * seq_len)


def stream_rate(docs, mb_text: float, seq_len: int, folder: Path, repeats: int) -> float:
    """MB/s of the streamed path over a JSON Lines copy of the corpus."""
    from s4accel.config import DataCfg
    from s4accel.data import build_data

    path = folder / "corpus.jsonl"
    docs.to_json(str(path))
    cfg = DataCfg(source="files", files=[str(path)], streaming=True, seq_len=seq_len, val_blocks=1)
    n_blocks = int(mb_text * 1e6 / seq_len * 0.95)  # about the whole corpus (byte tokens: one per byte)

    def run():
        stream = iter(build_data(cfg).train)
        for _ in range(n_blocks):
            next(stream)

    seconds, _ = timed(run, repeats)
    return n_blocks * seq_len / 1e6 / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--baseline-mb", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    import datasets
    import torch
    from transformers import ByT5Tokenizer

    from s4accel.config import DataCfg
    from s4accel.data.sources import shakespeare
    from s4accel.data.tokenize import train_bpe

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="s4accel-bench-data-") as tmp:
        tmp = Path(tmp)
        datasets.config.HF_DATASETS_CACHE = tmp / "hf"
        docs, mb = corpus(args.mb, tmp)
        (tmp / "small").mkdir()
        small, mb_small = corpus(args.baseline_mb, tmp / "small")
        byte_tok = ByT5Tokenizer(extra_ids=0)
        bpe = train_bpe(DataCfg(tokenizer="bpe", vocab_size=4096, val_fraction=0.05), shakespeare(), None)
        cache = tmp / "work"
        cache.mkdir()
        t_byte, byte_blocks = timed(ours(docs, byte_tok, args.seq_len, cache), args.repeats)
        t_sub, sub_blocks = timed(ours(docs, bpe, args.seq_len, cache), args.repeats)
        t_base, base_blocks = timed(baseline(small, byte_tok, args.seq_len), args.repeats)
        t_alone, _ = timed(tokenizer_alone(small, bpe), args.repeats)
        same = bool((byte_blocks[:8]["input_ids"] == base_blocks.with_format("numpy")[:8]["input_ids"]).all())
        stream = stream_rate(docs, mb, args.seq_len, tmp, args.repeats)
        rates = {"byte": mb / t_byte, "subword": mb / t_sub, "baseline": mb_small / t_base,
                 "subword_tokenizer_alone": mb_small / t_alone}
        print(json.dumps({
            "mb_per_s": {k: round(v, 2) for k, v in rates.items()},
            "byte_over_baseline": round(rates["byte"] / rates["baseline"], 1),
            "subword_over_tokenizer_alone": round(rates["subword"] / rates["subword_tokenizer_alone"], 2),
            "stream_mb_per_s": round(stream, 2),
            "stream_tokens_over_quickstart_need": round(stream * 1e6 / QUICKSTART_TOKENS_PER_S, 1),
            "cache_bytes_per_token": {"byte": round(cache_bytes_per_token(byte_blocks, args.seq_len), 3),
                                      "subword": round(cache_bytes_per_token(sub_blocks, args.seq_len), 3),
                                      "baseline": round(cache_bytes_per_token(base_blocks, args.seq_len), 3)},
            "same_blocks_as_baseline": same,
            "mb": {"byte": round(mb, 1), "subword": round(mb, 1), "baseline": round(mb_small, 1),
                   "subword_tokenizer_alone": round(mb_small, 1)},
            "subword_bytes_per_token": round(mb * 1e6 / (len(sub_blocks) * args.seq_len), 2),
            "repeats": args.repeats, "seq_len": args.seq_len, "threads": 1,
        }, indent=1))


if __name__ == "__main__":
    main()
