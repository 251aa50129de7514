"""Peak memory of one training step (forward + backward) of the quick-start model (`s4-small`, byte vocabulary) on
one long sequence, split along the sequence over P CPU processes (`train.context_parallel`), against the ways one
process saves memory: activation checkpointing (exact, one more forward pass) and truncated backpropagation through
time (`train.state: tbptt`, whose memory is that of one chunk: measured here as one process on a sequence P times
shorter; its gradients stop at chunk borders).

    python bench/context_memory.py [--length 65536] [--procs 1 2 4] [--out-dir bench/results]

Each configuration runs in fresh processes (gloo over a file store). Two figures per process, the largest process
reported: the bytes of the tensors autograd saves for the backward (the activations, each storage once, weights not
counted), and the peak resident memory during the step minus the resident memory just before it (after a short
warm-up step), which adds the step's transient buffers and what the allocator keeps. Prints JSON; with
--out-dir writes it to a dated file naming the machine, versions and commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s4accel.config.sizes import MODEL_SIZES  # noqa: E402
from s4accel.models import S4Config  # noqa: E402
from s4accel.models.context_parallel import ContextParallel  # noqa: E402
from s4accel.models.modeling_s4 import S4ForCausalLM  # noqa: E402
from s4accel.training.devices.context_parallel import split_batch  # noqa: E402

BYTE_VOCAB = 384  # the byte tokenizer's vocabulary (256 bytes, special and extra ids), as the quick-start trains


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def step(model, ids, parallel) -> int:
    """One forward + backward; returns the bytes of the tensors autograd saved for the backward (the activations:
    each storage once, the parameters not counted)."""
    batch = {"input_ids": ids, "labels": ids}
    if parallel is not None:  # this process's chunk, as the training loop cuts it
        batch = split_batch(batch, parallel)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def worker(rank, procs, store, length, checkpointing, out):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // procs))
    parallel = None
    if procs > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=procs)
        parallel = ContextParallel(dist.group.WORLD)
    size = {k: v for k, v in MODEL_SIZES["s4-small"].items() if k != "family"}
    torch.manual_seed(0)
    model = S4ForCausalLM(S4Config(**size, vocab_size=BYTE_VOCAB)).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    if parallel is not None:
        model.set_context_parallel(parallel)
    step(model, torch.randint(0, 256, (1, 1024 * procs)), parallel)  # warm-up: the allocator's first requests
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(1))
    before = rss()
    t0 = time.perf_counter()
    saved = step(model, ids, parallel)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"peak_step_bytes": peak - before, "saved_bytes": saved, "seconds": seconds,
                   "parameters": sum(p.numel() for p in model.parameters())}, f)
    if parallel is not None:
        dist.destroy_process_group()


def measure(length: int, procs: int, checkpointing: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(worker, args=(procs, os.path.join(tmp, "store"), length, checkpointing, out), nprocs=procs)
        results = [json.load(open(f"{out}.{r}")) for r in range(procs)]
    peak = max(r["peak_step_bytes"] for r in results)
    return {"length": length, "processes": procs, "activation_checkpointing": checkpointing,
            "peak_step_mib": round(peak / 2**20, 1),
            "saved_activations_mib": round(max(r["saved_bytes"] for r in results) / 2**20, 1),
            "step_seconds": round(max(r["seconds"] for r in results), 2),
            "parameters": results[0]["parameters"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = {f"split over {p}": measure(args.length, p) for p in args.procs}
    rows["1 process, activation checkpointing"] = measure(args.length, 1, checkpointing=True)
    chunk = args.length // max(args.procs)
    rows[f"1 process, one chunk of {chunk:,} (TBPTT's memory)"] = measure(chunk, 1)
    first = rows[f"split over {args.procs[0]}"]
    for row in rows.values():
        row["peak_of_first"] = round(row["peak_step_mib"] / first["peak_step_mib"], 3)
        row["saved_of_first"] = round(row["saved_activations_mib"] / first["saved_activations_mib"], 3)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    report = {"what": "one forward + backward step of the quick-start model (s4-small), batch 1, float32: the tensors "
                      "autograd saved for the backward (saved_activations_mib) and the peak resident memory over the "
                      "memory before the step (peak_step_mib, what the allocator held at the worst moment); the "
                      "largest process",
              "date": datetime.date.today().isoformat(), "commit": commit, "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "command": "python bench/context_memory.py " + " ".join(argv or sys.argv[1:]),
              "results": rows}
    print(json.dumps(report, indent=1))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"{report['date']}-context-memory-cpu-{commit}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
