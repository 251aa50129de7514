"""`s4accel predict` on a language model: documents batched by length (now) against batched in file order (before,
every batch padded to its longest document), on the same model and documents, in one run. Prints one JSON object.

    python bench/predict_batching.py [--docs 400] [--batch-size 16] [--repeats 3] [--out-dir bench/results]

Model: the quick-start's shape (`s4-small`, byte tokenizer), trained for one step (speed does not depend on the
weights). Documents: the 38 built-in plays cut at blank lines (speeches, stage directions: from a few bytes to a few
thousand), the first `--docs` of them, in their own order. The baseline is the same code with the sorting window set
to one batch, which is the order they were batched in before. Medians of `--repeats`, alternating the two; 2 torch
threads. --out-dir writes a dated file naming the machine, versions and commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent


def documents(n: int) -> list[str]:
    from s4accel.data.sources import load_source
    from s4accel.config import SourceCfg

    plays = load_source(SourceCfg(source="shakespeare"))["text"]
    parts = [p.strip() for play in plays for p in play.split("\n\n") if p.strip()]
    return parts[:n]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    import s4accel
    from s4accel.tools import predict as predict_module

    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="predict-bench-"))
    docs = documents(args.docs)
    data = work / "docs.jsonl"
    data.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(docs)))
    run = work / "run"
    s4accel.train(s4accel.load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"run.out_dir={run}", "train.max_steps=1", "train.eval_every=0", "sample.prompts=[]",
        "log.progress_bar=false", "log.log_with=[jsonl]"]))

    window = predict_module.LengthBatches.WINDOW
    times = {"by_length": [], "file_order": []}
    outputs = {}
    for _ in range(args.repeats):
        for name, size in (("file_order", 1), ("by_length", window)):
            predict_module.LengthBatches.WINDOW = size  # 1: a window of one batch, nothing reordered
            out = work / f"{name}.jsonl"
            start = time.perf_counter()
            predict_module.predict(run / "final", data, out, batch_size=args.batch_size, progress=False)
            times[name].append(time.perf_counter() - start)
            outputs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    predict_module.LengthBatches.WINDOW = window
    same = all(a["id"] == b["id"] and a["tokens"] == b["tokens"] and abs(a["loss"] - b["loss"]) < 1e-5
               for a, b in zip(outputs["by_length"], outputs["file_order"]))
    lengths = sorted(len(d.encode()) for d in docs)
    medians = {k: statistics.median(v) for k, v in times.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip() or "unknown"
    report = {"what": "s4accel predict on a language model (s4-small shape, byte tokenizer): seconds for the whole "
                      "file, median of repeats, documents batched by length against in file order",
              "date": datetime.date.today().isoformat(), "commit": commit, "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "command": "python bench/predict_batching.py " + " ".join(argv or sys.argv[1:]),
              "documents": len(docs), "bytes_median": lengths[len(lengths) // 2], "bytes_max": lengths[-1],
              "batch_size": args.batch_size, "seconds": {k: round(v, 3) for k, v in medians.items()},
              "speedup": round(medians["file_order"] / medians["by_length"], 2), "same_rows": same}
    print(json.dumps(report, indent=1))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"{report['date']}-predict-batching-cpu-{commit}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
