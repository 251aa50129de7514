"""What the recipe's speed and memory switches buy on the S4 language model. Prints one JSON object.

    python bench/speed_switches.py [--size s4-small] [--batch 16] [--seq-len 256] [--rounds 3] [--steps 8]
                                   [--vocab 259] [--variants eager ckpt compile compile_blocks]
                                   [--out-dir bench/results]   (also a dated file naming the commit and versions)

Variants (each a `train.*` switch of a recipe, applied the way the loop applies it):
    eager       the model as built, fused AdamW
    ckpt        `train.activation_checkpointing: true` (each block recomputed in the backward pass)
    compile     `train.compile: true` (Accelerate's dynamo plugin, inductor, regional compilation, and the loss
                compiled beside the blocks: training/devices/compiled_loss.py)
    compile_blocks  the blocks compiled, the loss left eager (what `train.compile` did before the loss was compiled)

Measured per variant, each in a fresh process (so its peak memory is its own), one forward + backward + AdamW step
per training step on random tokens (B x L; timing and memory do not depend on the token values):
    step_s           median seconds of `--steps` steps after the warm-up steps (compile's first step compiles)
    first_step_s     the first step, i.e. compilation for `compile`
    saved_mb         bytes autograd keeps for the backward pass during one forward (the activation memory), counted
                     with `torch.autograd.graph.saved_tensors_hooks`: exact, and the same on every machine
    peak_mb          CUDA: `max_memory_allocated`; CPU: the process's peak resident set (includes Python, torch and,
                     for compile, the compiler)
These machines are noisy, so the variants run in `--rounds` rounds, one process each per round in a rotating
order; the report gives each variant's median over rounds and the ratios to eager of the medians and of each round.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("eager", "ckpt", "compile", "compile_blocks")


def worker(args) -> dict:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import TorchDynamoPlugin

    from s4accel.config import ModelCfg, OptimCfg
    from s4accel.training.tasks_builtin import model_config as build_model_config
    from s4accel.training.optim import build_optimizer
    from s4accel.training.devices.compiled_loss import compile_loss
    from s4accel.training.setup import enable_activation_checkpointing
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    compiled = args.variant.startswith("compile")
    dynamo = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True) if compiled else None
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), dynamo_plugin=dynamo)
    torch.manual_seed(0)
    config = build_model_config(ModelCfg(name=args.size), vocab_size=args.vocab, pad_token_id=0, eos_token_id=1)
    model = AutoModelForCausalLM.from_config(config)
    if args.variant == "ckpt":
        enable_activation_checkpointing(model)
    if args.variant == "compile":
        compile_loss(model, accelerator)
    optimizer = build_optimizer(model, OptimCfg(), accelerator.device.type)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    ids = torch.randint(3, args.vocab, (args.batch, args.seq_len), device=accelerator.device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for i in range(args.warmup + args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if accelerator.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"step_s": statistics.median(times[args.warmup:]), "first_step_s": times[0], "saved_mb": saved / 2**20,
            "peak_mb": peak, "device": accelerator.device.type}


def run_variant(variant: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--size", args.size, "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--vocab", str(args.vocab)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="s4-small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--vocab", type=int, default=259, help="the vocabulary (259: the byte-level tokenizer's)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--out-dir", type=Path, help="also write the report to a dated JSON file in this folder")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.variant = args.worker
        print(json.dumps(worker(args)))
        return
    if "eager" not in args.variants:
        args.variants = ["eager", *args.variants]
    rounds = []
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants):] + args.variants[: r % len(args.variants)]
        rounds.append({v: run_variant(v, args) for v in order})
    metrics = ("step_s", "first_step_s", "saved_mb", "peak_mb")
    median = {v: {m: statistics.median(rd[v][m] for rd in rounds) for m in metrics} for v in args.variants}
    over_eager = {
        v: {m: {"of_medians": median[v][m] / median["eager"][m],
                "paired_median": statistics.median(rd[v][m] / rd["eager"][m] for rd in rounds)}
            for m in ("step_s", "saved_mb", "peak_mb")}
        for v in args.variants if v != "eager"}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    device = rounds[0]["eager"]["device"]
    report = {
        "date": datetime.date.today().isoformat(), "commit": commit,
        "command": "python bench/speed_switches.py " + " ".join(sys.argv[1:]),
        "config": {k: getattr(args, k) for k in ("size", "batch", "seq_len", "rounds", "steps", "warmup", "threads",
                                                 "vocab")},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load": os.getloadavg(),
                    "device": device, "processor": platform.processor() or platform.machine(),
                    **{name: importlib.metadata.version(name) for name in ("torch", "accelerate", "transformers")}},
        "median": median, "over_eager": over_eager, "rounds": rounds}
    print(json.dumps(report, indent=1))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        name = f"{report['date']}-speed-switches-{device}-{commit}.json"
        (args.out_dir / name).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
