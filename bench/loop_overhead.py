"""Framework overhead of the training loop: milliseconds per optimizer step of four loops training the same model on
the same data, measured in one run, interleaved, medians of several repeats, and reported as ratios.

    python bench/loop_overhead.py [--repeats 5] [--sizes tiny small] [--loops torch accelerate trainer s4accel]

Loops (each does forward, backward, clip to norm 1.0, AdamW step with s4accel's parameter groups, schedule step):
    torch        a hand-written PyTorch loop: the floor
    accelerate   a plain Accelerate loop (prepare, accumulate, backward, clip, step), nothing else
    trainer      transformers.Trainer (logging every 10 steps, its progress bar on, no saving)
    s4accel      `s4accel.train(recipe)` with its default logging (TensorBoard + JSONL every 10 steps), progress bar,
                 tokens/s, grad norm and lr metrics on; no checkpoints, no evaluation until the end (not timed)

Every measurement runs in its own Python process on one thread (OMP_NUM_THREADS=1), so the four loops see the same
machine state and none inherits another's Accelerate singleton. Time per step is (t[steps] - t[warmup]) /
(steps - warmup) between the ends of optimizer steps `warmup` and `steps`; for s4accel it is read from the
`train/step_time_ms` records its own loop logs (the same interval, logging included). Prints one JSON object.
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

REPO = Path(__file__).resolve().parents[1]
LOOPS = ("torch", "accelerate", "trainer", "s4accel")
WARMUP = 10  # optimizer steps not timed (allocator warm-up, first-call costs); equal to the s4accel log interval

# Model and data of each size, as overrides of the tiny debug recipe. tiny: a step of a few ms, where framework
# overhead dominates; small: ~10x the compute, where it should vanish.
SIZES = {
    "tiny": ["model.name=s4-tiny", "model.overrides={d_model: 16, n_layer: 1, d_state: 8}", "data.seq_len=16",
             "data.batch_size=2"],  # ~3 ms per step on one thread here
    "small": ["model.name=s4-tiny", "data.seq_len=128", "data.batch_size=12"],  # ~30 ms
}
# Optimizer steps per measurement (WARMUP of them untimed): about 1.5 s timed for each size, so that one noisy
# moment of the machine does not decide a measurement.
STEPS = {"tiny": 510, "small": 60
}


def bench_recipe(size: str, steps: int, out_dir: Path):
    from s4accel.config import load_recipe

    return load_recipe(REPO / "recipes" / "s4_tiny_debug.yaml", [
        *SIZES[size], f"train.max_steps={steps}", f"run.out_dir={out_dir}", "run.overwrite=true",
        "train.eval_every=0", "train.eval_max_batches=1", "checkpoint.every_steps=0", "sample.prompts=[]",
        "log.log_every=10", "log.log_with=[tensorboard, jsonl]", "log.progress_bar=true",
        "scheduler.name=cosine", "scheduler.warmup_steps=5", "train.clip_grad_norm=1.0"])


# --------------------------------------------------------------------------------------------------------------------
# Workers: one loop, one measurement, in this process.


def setup(recipe):
    """The same model (seeded init) and the same training blocks for every loop."""
    import torch
    from accelerate.utils import set_seed

    from s4accel.data import build_text_data
    from s4accel.trainer import build_model

    torch.set_num_threads(1)
    data = build_text_data(recipe.data)
    set_seed(recipe.run.seed)
    return build_model(recipe, data.tokenizer), data


def train_loader(recipe, data):
    import torch
    from torch.utils.data import DataLoader

    from s4accel.data import collate_lm

    return DataLoader(data.train, batch_size=recipe.data.batch_size, shuffle=True, drop_last=True,
                      collate_fn=collate_lm, generator=torch.Generator().manual_seed(recipe.run.seed))


def forever(loader):
    while True:
        yield from loader


def worker_torch(recipe) -> float:
    import torch

    from s4accel.optim import build_optimizer, build_scheduler

    model, data = setup(recipe)
    opt = build_optimizer(model, recipe.optim)
    sched = build_scheduler(opt, recipe.scheduler, recipe.warmup_steps, recipe.train.max_steps)
    batches = forever(train_loader(recipe, data))
    model.train()
    for step in range(1, recipe.train.max_steps + 1):
        loss = model(**next(batches)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            loss.item()  # what any loop does to log its loss
        if step == WARMUP:
            t0 = time.perf_counter()
    return 1000 * (time.perf_counter() - t0) / (recipe.train.max_steps - WARMUP)


def worker_accelerate(recipe) -> float:
    from accelerate import Accelerator

    from s4accel.optim import build_optimizer, build_scheduler

    accelerator = Accelerator(cpu=True)
    model, data = setup(recipe)
    opt = build_optimizer(model, recipe.optim)
    sched = build_scheduler(opt, recipe.scheduler, recipe.warmup_steps, recipe.train.max_steps)
    model, opt, loader = accelerator.prepare(model, opt, train_loader(recipe, data))
    batches = forever(loader)
    model.train()
    for step in range(1, recipe.train.max_steps + 1):
        with accelerator.accumulate(model):
            loss = model(**next(batches)).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            loss.item()
        if step == WARMUP:
            t0 = time.perf_counter()
    return 1000 * (time.perf_counter() - t0) / (recipe.train.max_steps - WARMUP)


def worker_trainer(recipe) -> float:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from s4accel.data import collate_lm
    from s4accel.optim import build_optimizer, build_scheduler

    model, data = setup(recipe)
    opt = build_optimizer(model, recipe.optim)
    sched = build_scheduler(opt, recipe.scheduler, recipe.warmup_steps, recipe.train.max_steps)
    marks = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (WARMUP, recipe.train.max_steps):
                marks[state.global_step] = time.perf_counter()

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=recipe.train.max_steps, use_cpu=True,
                                 per_device_train_batch_size=recipe.data.batch_size, max_grad_norm=1.0,
                                 logging_steps=10, report_to="none", save_strategy="no", dataloader_drop_last=True,
                                 seed=recipe.run.seed, disable_tqdm=False)
        Trainer(model=model, args=args, train_dataset=data.train, data_collator=collate_lm,
                optimizers=(opt, sched), callbacks=[Clock()]).train()
    return 1000 * (marks[recipe.train.max_steps] - marks[WARMUP]) / (recipe.train.max_steps - WARMUP)


def worker_s4accel(recipe) -> float:
    import torch

    import s4accel

    torch.set_num_threads(1)
    s4accel.train(recipe)
    records = [json.loads(line) for line in (recipe.run.dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "train/step_time_ms" in r and r["step"] > WARMUP]
    steps = [r["step"] for r in timed]
    assert steps[-1] == recipe.train.max_steps and all(b - a == 10 for a, b in zip([WARMUP, *steps], steps))
    return sum(r["train/step_time_ms"] for r in timed) / len(timed)  # equal 10-step intervals: the mean is exact


WORKERS = {"torch": worker_torch, "accelerate": worker_accelerate, "trainer": worker_trainer,
           "s4accel": worker_s4accel}


# --------------------------------------------------------------------------------------------------------------------
# Driver


def measure(loop: str, size: str, steps: int, scratch: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": str(scratch / "hf")}
    proc = subprocess.run([sys.executable, __file__, "--worker", loop, "--sizes", size, "--steps", str(steps),
                           "--scratch", str(scratch)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{loop}/{size} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["ms_per_step"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, help=f"optimizer steps per measurement, {WARMUP} of them warm-up "
                                                f"(default: {STEPS})")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--loops", nargs="+", default=list(LOOPS), choices=LOOPS)
    ap.add_argument("--worker", choices=LOOPS, help=argparse.SUPPRESS)
    ap.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps is not None and (args.steps < WARMUP + 10 or args.steps % 10):
        ap.error(f"--steps must be a multiple of 10 and at least {WARMUP + 10}")

    if args.worker:  # one measurement, in this process
        recipe = bench_recipe(args.sizes[0], args.steps, args.scratch / f"run-{args.worker}")
        print(json.dumps({"ms_per_step": WORKERS[args.worker](recipe)}))
        return

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for size in args.sizes:
            times = {loop: [] for loop in args.loops}
            for _ in range(args.repeats):  # interleaved: each repeat runs every loop once
                for loop in args.loops:
                    times[loop].append(measure(loop, size, args.steps or STEPS[size], Path(scratch)))
            medians = {loop: statistics.median(ts) for loop, ts in times.items()}
            base = medians.get("torch")
            mins = {loop: min(ts) for loop, ts in times.items()}
            results[size] = {
                "ms_per_step_median": {k: round(v, 3) for k, v in medians.items()},
                "ms_per_step_min": {k: round(v, 3) for k, v in mins.items()},
                "ms_per_step_all": {k: [round(t, 3) for t in ts] for k, ts in times.items()},
                "ratio_to_torch": {k: round(v / base, 3) for k, v in medians.items()} if base else None,
                "s4accel_over_accelerate": (round(medians["s4accel"] / medians["accelerate"], 3)
                                            if {"s4accel", "accelerate"} <= medians.keys() else None),
                "s4accel_over_accelerate_min": (round(mins["s4accel"] / mins["accelerate"], 3)
                                                if {"s4accel", "accelerate"} <= mins.keys() else None),
                "s4accel_over_trainer": (round(medians["s4accel"] / medians["trainer"], 3)
                                         if {"s4accel", "trainer"} <= medians.keys() else None),
            }
    print(json.dumps({"steps": {size: args.steps or STEPS[size] for size in args.sizes}, "warmup": WARMUP,
                      "repeats": args.repeats, "threads": 1,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
