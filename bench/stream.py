"""Streamed data's speed with 1 and 2 processes: tokens per second of training blocks each process's stream hands
out (`data.streaming`, read, tokenised, packed, dealt out), and all processes together. Prints one JSON object.

    python bench/stream.py [--mb 20] [--seq-len 256] [--repeats 3] [--shuffle-buffer N] [--tokenizers byte,bpe]

Corpus: the 38 built-in plays cut into documents of about 2,000 characters and repeated to about `--mb` MB, as one
JSON Lines file (`one_file`: one shard) and as 8 JSON Lines files (`8_files`: 8 shards). Tokenizers: `byte`, and
`bpe` (a 4,096-token byte-level BPE trained on the plays, not timed, read as a tokenizer folder: its Rust
`encode_batch_fast`). With 2 processes, both run at once (one core each, `TOKENIZERS_PARALLELISM=false`, one torch
thread), each handing out its half of about 90% of the corpus's blocks. Per process: its own blocks' tokens over its
own time, from its first block on (building the data is not timed); per CPU second: the same over the CPU time it
used (the figure to compare on a machine shared with other work); total: all blocks over the longer time. Medians of
`--repeats`. Run with another checkout's `s4accel` first on PYTHONPATH to compare versions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

READER = """
import json, sys, time, torch
torch.set_num_threads(1)
from s4accel.config import DataCfg
from s4accel.data import build_data
files, tokenizer, seq_len, blocks, rank, world, extra = json.loads(sys.argv[1])
cfg = DataCfg(source="files", files=files, streaming=True, seq_len=seq_len, val_blocks=1, tokenizer=tokenizer, **extra)
stream = iter(build_data(cfg, rank=rank, world_size=world).train)
start, cpu = time.perf_counter(), time.process_time()  # from the first block on: the files are open already
for _ in range(blocks):
    next(stream)
print(json.dumps({"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}))
"""


def corpus(mb: float, folder: Path) -> dict[str, list[str]]:
    """The plays cut into documents of about 2,000 characters (at line ends) and repeated to about `mb` MB, as one
    JSON Lines file and as 8. (Whole plays, ~150 KB each, would make the stream read the whole corpus in its first
    read of 256 documents, before the timing starts.)"""
    import datasets

    from s4accel.data.sources import shakespeare

    pieces = []
    for play in shakespeare()["text"]:
        piece = ""
        for line in play.splitlines(keepends=True):
            piece += line
            if len(piece) >= 2000:
                pieces.append(piece)
                piece = ""
        pieces += [piece] if piece.strip() else []
    size = sum(len(t.encode()) for t in pieces)
    docs = datasets.Dataset.from_dict({"text": pieces * max(1, round(mb * 1e6 / size))})
    docs.to_json(str(folder / "all.jsonl"))
    eight = []
    for i in range(8):
        path = folder / f"part_{i}.jsonl"
        docs.shard(8, i, contiguous=True).to_json(str(path))
        eight.append(str(path))
    return {"one_file": [str(folder / "all.jsonl")], "8_files": eight}


def bpe_folder(folder: Path) -> str:
    from s4accel.config import DataCfg
    from s4accel.data.sources import shakespeare
    from s4accel.data.tokenize import train_bpe

    train_bpe(DataCfg(tokenizer="bpe", vocab_size=4096, val_fraction=0.05), shakespeare(), folder / "bpe")
    return str(folder / "bpe")


def rate(files: list[str], tokenizer: str, seq_len: int, blocks: int, world: int, extra: dict) -> dict:
    """Tokens per second handed out per process (median over processes) and by all together."""
    procs = [subprocess.Popen([sys.executable, "-c", READER,
                               json.dumps([files, tokenizer, seq_len, blocks // world, rank, world, extra])],
                              stdout=subprocess.PIPE, text=True) for rank in range(world)]
    times = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"reader failed ({p.returncode})")
        times.append(json.loads(out.strip().splitlines()[-1]))
    per = blocks // world * seq_len
    return {"per_process": statistics.median(per / t["seconds"] for t in times),
            "per_cpu_second": statistics.median(per / t["cpu_seconds"] for t in times),
            "total": world * per / max(t["seconds"] for t in times)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shuffle-buffer", type=int, default=None, help="data.shuffle_buffer (default: the recipe's)")
    parser.add_argument("--tokenizers", default="byte,bpe", help="which of byte,bpe")
    args = parser.parse_args()
    extra = {} if args.shuffle_buffer is None else {"shuffle_buffer": args.shuffle_buffer}
    import datasets

    datasets.disable_progress_bars()
    out = {}
    with tempfile.TemporaryDirectory(prefix="s4accel-bench-stream-") as tmp:
        tmp = Path(tmp)
        layouts = corpus(args.mb, tmp)
        chosen = args.tokenizers.split(",")
        tokenizers = {"byte": "byte", **({"bpe": bpe_folder(tmp)} if "bpe" in chosen else {})}
        for tok_name, tok in ((k, v) for k, v in tokenizers.items() if k in chosen):
            # about 90% of the corpus's blocks (bpe: ~3.5 bytes per token), so no process reaches its end
            blocks = int(args.mb * 1e6 / args.seq_len / (1 if tok_name == "byte" else 3.5) * 0.9)
            for layout, files in layouts.items():
                for world in (1, 2):
                    runs = [rate(files, tok, args.seq_len, blocks, world, extra) for _ in range(args.repeats)]
                    out[f"{tok_name}/{layout}/{world}"] = {
                        k: round(statistics.median(r[k] for r in runs)) for k in runs[0]}
    print(json.dumps({"tokens_per_s": out, "mb": args.mb, "seq_len": args.seq_len, "repeats": args.repeats,
                      **extra, "when": time.strftime("%Y-%m-%d")}, indent=1))


if __name__ == "__main__":
    main()
