"""Framework overhead of the training loop: milliseconds per optimizer step of four loops training the same model on
the same data, measured in one run, in paired, interleaved segments, and reported as medians and ratios.

    python bench/loop_overhead.py [--rounds 30] [--sizes tiny small] [--loops torch accelerate trainer s4accel]

Loops (each does forward, backward, clip to norm 1.0, AdamW step with s4accel's parameter groups, schedule step):
    torch        a hand-written PyTorch loop: the floor
    accelerate   a plain Accelerate loop (prepare, accumulate, backward, clip, step), nothing else
    accelerate_cached  the same, with the one change s4accel makes to Accelerate: its optimizer step's question
                 "is lomo_optim installed?" answered once, not twice a step (s4accel.training.setup.ask_lomo_once);
                 s4accel over this loop is what s4accel's own Python costs
    trainer      transformers.Trainer (logging every 10 steps, its progress bar on, no saving)
    s4accel      `s4accel.train(recipe)` with its default logging (TensorBoard + JSONL every 10 steps), progress bar,
                 tokens/s, grad norm and lr metrics on; no checkpoints, no evaluation until the end (not timed)

How it is measured. These machines are noisy: the same loop runs up to 40% slower from one second to the next, so
timing each loop in its own time window compares the machine's moods, not the loops. Instead, all four loops run at
once in their own processes (one thread each, no shared Accelerate singleton), each paused at a gate after every
segment of `SEGMENT[size]` optimizer steps. The driver opens one gate at a time: a round runs one segment of every
loop back to back (in a rotating order), so the four segments of a round see the same machine within about a
second. Each segment's time runs from its gate opening to the end of its last optimizer step; the logging of a
step at the end of a segment falls into the next segment, so every segment holds the same number of log steps. The
first `WARMUP` steps run before the first gate (allocator warm-up, first-call costs). Per round, the ratio of two
loops' segment times is a paired comparison; the report gives, over rounds, the median ms/step of each loop and the
median (and quartiles) of the per-round ratios. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
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
LOOPS = ("torch", "accelerate", "accelerate_cached", "trainer", "s4accel")
WARMUP = 10  # optimizer steps before the first gate; equal to the log interval

# Model and data of each size, as overrides of the tiny debug recipe. tiny: a step of a few ms, where framework
# overhead dominates; small: ~10x the compute, where it should vanish.
SIZES = {
    "tiny": ["model.name=s4-tiny", "model.overrides={d_model: 16, n_layer: 1, d_state: 8}", "data.seq_len=16",
             "data.batch_size=2"],  # ~3-4 ms per step on one thread here
    "small": ["model.name=s4-tiny", "data.seq_len=128", "data.batch_size=12"],  # ~25 ms
}
# Optimizer steps per segment (a multiple of the log interval): ~0.2 s, short enough for a round of four segments to
# see one machine state, long enough to hold several log steps.
SEGMENT = {"tiny": 50, "small": 10}


def bench_recipe(size: str, steps: int, out_dir: Path, gate: bool = False):
    from s4accel.config import load_recipe

    return load_recipe(REPO / "recipes" / "s4_tiny_debug.yaml", [
        *SIZES[size], f"train.max_steps={steps}", f"run.out_dir={out_dir}", "run.overwrite=true",
        "train.eval_every=0", "train.eval_max_batches=1", "checkpoint.every_steps=0", "sample.prompts=[]",
        "log.log_every=10", "log.log_with=[tensorboard, jsonl]", "log.progress_bar=true",
        "scheduler.name=cosine", "scheduler.warmup_steps=5", "train.clip_grad_norm=1.0",
        *(["callbacks=[{target: 'loop_overhead:GateCallback'}]"] if gate else [])])


# --------------------------------------------------------------------------------------------------------------------
# The gate: how a worker pauses between segments. The driver writes one byte to open it; the worker writes back the
# segment's seconds when its `segment` steps are done, then waits for the next byte.


class Gate:
    def __init__(self):
        self.go = os.fdopen(int(os.environ["BENCH_GO_FD"]), "rb", buffering=0)
        self.done = os.fdopen(int(os.environ["BENCH_DONE_FD"]), "w", buffering=1)
        self.warmup, self.segment, self.rounds = (int(os.environ[k]) for k in ("BENCH_WARMUP", "BENCH_SEGMENT",
                                                                                "BENCH_ROUNDS"))
        self.steps = 0
        self.t0 = None

    def step(self):
        """Call after every optimizer step."""
        self.steps += 1
        timed = self.steps - self.warmup
        if timed > 0 and timed % self.segment == 0:
            self.done.write(f"{time.perf_counter() - self.t0}\n")
        if timed >= 0 and timed % self.segment == 0 and timed < self.segment * self.rounds:
            self.go.read(1)  # blocks until the driver opens the gate
            self.t0 = time.perf_counter()


GATE: Gate | None = None


def gate() -> Gate:
    global GATE
    GATE = GATE or Gate()
    return GATE


try:
    from s4accel.training.callbacks import Callback

    class GateCallback(Callback):
        """The gate inside `s4accel.train`: a recipe callback (on_step_end comes after each optimizer step)."""

        def on_step_end(self, run):
            gate().step()
except ImportError:  # the driver does not need s4accel importable
    pass


# --------------------------------------------------------------------------------------------------------------------
# Workers: one loop, gated, in this process.


def setup(recipe):
    """The same model (seeded init) and the same training blocks for every loop."""
    import torch
    from accelerate.utils import set_seed

    from s4accel.data import build_text_data
    from s4accel.training.tasks_builtin import build_model

    torch.set_num_threads(1)
    data = build_text_data(recipe.data)
    set_seed(recipe.run.seed)
    return build_model(recipe, data), data


def collate(recipe, data):
    """The batches `s4accel train` makes of the recipe's data: with `data.packing: isolated` (the default for text)
    each block's documents are marked by `position_ids`, and the model convolves each one alone. Every loop gets the
    same batches, so that they all compute the same thing and what differs is the loop."""
    from s4accel.data import lm_collate

    return lm_collate(recipe.data, data.tokenizer.eos_token_id)


def train_loader(recipe, data):
    import torch
    from torch.utils.data import DataLoader

    return DataLoader(data.train, batch_size=recipe.data.batch_size, shuffle=True, drop_last=True,
                      collate_fn=collate(recipe, data), generator=torch.Generator().manual_seed(recipe.run.seed))


def forever(loader):
    while True:
        yield from loader


def worker_torch(recipe):
    import torch

    from s4accel.training.optim import build_optimizer, build_scheduler

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
        gate().step()


def worker_accelerate(recipe):
    from accelerate import Accelerator

    from s4accel.training.optim import build_optimizer, build_scheduler

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
        gate().step()


def worker_trainer(recipe):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from s4accel.training.optim import build_optimizer, build_scheduler

    model, data = setup(recipe)
    opt = build_optimizer(model, recipe.optim)
    sched = build_scheduler(opt, recipe.scheduler, recipe.warmup_steps, recipe.train.max_steps)

    class Gated(TrainerCallback):  # the Trainer logs after on_step_end, as s4accel does
        def on_step_end(self, args, state, control, **kwargs):
            gate().step()

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=recipe.train.max_steps, use_cpu=True,
                                 per_device_train_batch_size=recipe.data.batch_size, max_grad_norm=1.0,
                                 logging_steps=10, report_to="none", save_strategy="no", dataloader_drop_last=True,
                                 seed=recipe.run.seed, disable_tqdm=False)
        Trainer(model=model, args=args, train_dataset=data.train, data_collator=collate(recipe, data),
                optimizers=(opt, sched), callbacks=[Gated()]).train()


def worker_s4accel(recipe):
    import torch

    import s4accel

    torch.set_num_threads(1)
    s4accel.train(recipe)


def worker_accelerate_cached(recipe):
    from s4accel.training.setup import ask_lomo_once

    ask_lomo_once()
    worker_accelerate(recipe)


WORKERS = {"torch": worker_torch, "accelerate": worker_accelerate, "accelerate_cached": worker_accelerate_cached,
           "trainer": worker_trainer, "s4accel": worker_s4accel}


# --------------------------------------------------------------------------------------------------------------------
# Driver


def start(loop: str, size: str, rounds: int, scratch: Path):
    """Start one gated worker; returns (process, go pipe, done pipe)."""
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": str(scratch / "hf"),
           "BENCH_GO_FD": str(go_r), "BENCH_DONE_FD": str(done_w), "BENCH_WARMUP": str(WARMUP),
           "BENCH_SEGMENT": str(SEGMENT[size]), "BENCH_ROUNDS": str(rounds),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    log = open(scratch / f"{loop}-{size}.log", "w")
    proc = subprocess.Popen([sys.executable, __file__, "--worker", loop, "--sizes", size, "--rounds", str(rounds),
                             "--scratch", str(scratch)], env=env, pass_fds=(go_r, done_w), stdout=log,
                            stderr=subprocess.STDOUT)
    os.close(go_r)
    os.close(done_w)
    return proc, os.fdopen(go_w, "wb", buffering=0), os.fdopen(done_r, "r"), scratch / f"{loop}-{size}.log"


def run_size(size: str, loops: list[str], rounds: int, scratch: Path) -> dict:
    workers = {loop: start(loop, size, rounds, scratch) for loop in loops}  # set up in parallel, wait at the gate
    seconds = {loop: [] for loop in loops}
    try:
        for r in range(rounds):
            for loop in loops[r % len(loops):] + loops[:r % len(loops)]:  # rotate who goes first
                proc, go, done, log = workers[loop]
                go.write(b"1")
                line = done.readline()
                if not line:
                    raise SystemExit(f"{loop}/{size} failed:\n{log.read_text()[-3000:]}")
                seconds[loop].append(float(line))
    finally:
        for proc, go, done, log in workers.values():
            go.close()
            if proc.wait(timeout=600) != 0:
                raise SystemExit(f"{proc.args[3]}/{size} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    ms = {loop: [1000 * t / SEGMENT[size] for t in ts] for loop, ts in seconds.items()}

    def ratio(a, b):
        if not {a, b} <= ms.keys():
            return None
        per_round = sorted(x / y for x, y in zip(ms[a], ms[b]))
        q = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
        return {"median": round(statistics.median(per_round), 3), "q1": round(q[0], 3), "q3": round(q[2], 3)}

    return {
        "ms_per_step_median": {k: round(statistics.median(v), 3) for k, v in ms.items()},
        "ms_per_step_min": {k: round(min(v), 3) for k, v in ms.items()},
        "ratio_to_torch": {k: ratio(k, "torch") for k in ms if k != "torch"} if "torch" in ms else None,
        "s4accel_over_accelerate": ratio("s4accel", "accelerate"),
        "s4accel_over_accelerate_cached": ratio("s4accel", "accelerate_cached"),
        "s4accel_over_trainer": ratio("s4accel", "trainer"),
        "accelerate_over_torch": ratio("accelerate", "torch"),
        "trainer_over_torch": ratio("trainer", "torch"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30, help="segments per loop, each ~0.2 s (default: 30)")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--loops", nargs="+", default=list(LOOPS), choices=LOOPS)
    ap.add_argument("--worker", choices=LOOPS, help=argparse.SUPPRESS)
    ap.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", type=Path, help="also write the report to a dated JSON file in this folder, named by "
                                                 "its date and commit (bench/results)")
    args = ap.parse_args()

    if args.worker:  # one gated loop, in this process
        size = args.sizes[0]
        recipe = bench_recipe(size, WARMUP + SEGMENT[size] * args.rounds, args.scratch / f"run-{args.worker}",
                              gate=args.worker == "s4accel")
        WORKERS[args.worker](recipe)
        return

    with tempfile.TemporaryDirectory() as scratch:
        results = {size: run_size(size, list(args.loops), args.rounds, Path(scratch)) for size in args.sizes}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip() or "unknown"
    report = {"date": datetime.date.today().isoformat(), "commit": commit, "device": "cpu",
              "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              "python": platform.python_version(),
              **{name: importlib.metadata.version(name) for name in ("torch", "accelerate", "transformers")},
              "command": "python bench/loop_overhead.py " + " ".join(sys.argv[1:]),
              "rounds": args.rounds, "segment_steps": {s: SEGMENT[s] for s in args.sizes}, "warmup_steps": WARMUP,
              "threads": 1, "results": results}
    print(json.dumps(report, indent=2))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"{report['date']}-loop-overhead-cpu-{commit}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
