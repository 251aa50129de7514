"""`s4accel lr-find`: the learning-rate range test (Smith 2015, as in fastai and Lightning's `lr_find`).

A throwaway copy of the recipe's model trains for up to `steps` optimizer steps while the learning rate grows
exponentially from `min_lr` to `max_lr` (every parameter group keeps its ratio to `optim.lr`, so S4's SSM group
moves with it). The loss is smoothed with a debiased exponential moving average; the sweep stops early once the
smoothed loss exceeds `diverge` times its minimum. The suggestion is the learning rate where the smoothed loss falls
fastest against log(lr). Nothing of the run directory is touched except the result files written to `out_dir`.
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch.utils.data import default_collate

from ..config import Recipe
from ..errors import RecipeError
from ..training.setup import build_run, make_accelerator
from ..training.step import backward_window
from ..training.task import load_task


@dataclass
class LRFindResult:
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # raw per step
    smoothed: list[float] = field(default_factory=list)
    suggested_lr: float | None = None
    stopped_early: bool = False
    plot: str | None = None


def suggest(lrs: list[float], smoothed: list[float], skip_start: int = 3, skip_end: int = 2) -> float | None:
    """The lr of the steepest descent of the smoothed loss against log(lr), ignoring the noisy first and the
    diverging last points."""
    idx = range(skip_start, len(lrs) - skip_end - 1)
    if len(idx) < 1:
        return None
    slopes = [(smoothed[i + 1] - smoothed[i]) / (math.log(lrs[i + 1]) - math.log(lrs[i])) for i in idx]
    best = min(range(len(slopes)), key=slopes.__getitem__)
    return lrs[idx[best]]


def probe_run(recipe: Recipe, accelerator, build_dir: Path, what: str):
    """The recipe's run built for a throwaway probe (its files in `build_dir`; nothing of the run directory is
    touched). A task with manual optimisation is refused: these tools step its optimizers together on the task's
    loss."""
    task = load_task(recipe)
    if not task.automatic_optimization:
        raise RecipeError(f"{what}: {type(task).__name__} uses manual optimisation; {what} steps its optimizers "
                          f"together on the task's loss")
    return build_run(recipe, accelerator, build_dir, task=task)


def find_lr(recipe: Recipe, min_lr: float = 1e-7, max_lr: float = 1.0, steps: int = 100, beta: float = 0.98,
            diverge: float = 4.0, out_dir: str | Path | None = None) -> LRFindResult:
    """The range test on a throwaway copy of the recipe's task: its data, model, optimizers and training step (the
    schedules are not used: the sweep sets the learning rate of every group of every optimizer itself, keeping their
    ratios)."""
    if not 0 < min_lr < max_lr:
        raise RecipeError(f"lr-find: need 0 < min_lr < max_lr, got {min_lr}, {max_lr}")
    if steps < 8:
        raise RecipeError(f"lr-find: steps must be >= 8, got {steps}")


    accelerator = make_accelerator(recipe, trackers=False)  # the loop's precision, accumulation and sampler
    set_seed(recipe.run.seed)
    with tempfile.TemporaryDirectory(prefix="s4accel-lr-find-") as tmp:
        run = probe_run(recipe, accelerator, Path(tmp), "lr-find")
    task = run.task
    model, *optimizers, train_dl = accelerator.prepare(run.model, *(o.optimizer for o in run.optimizers),
                                                       run.loaders.train)
    groups = [group for optimizer in optimizers for group in optimizer.param_groups]
    # the groups' own rates (a schedule has already scaled `lr` by its warmup factor; `initial_lr` is the unscaled one)
    base = [group.get("initial_lr", group["lr"]) for group in groups]
    ratios = [b / max(base) for b in base]
    result, avg, best = LRFindResult(), 0.0, math.inf
    batches = iter(())
    model.train()
    for i in range(steps):
        lr = min_lr * (max_lr / min_lr) ** (i / (steps - 1))
        for group, ratio in zip(groups, ratios):
            group["lr"] = lr * ratio
        window = []  # a step of the loop's size: train.grad_accum micro-batches, as the Accelerator accumulates
        while len(window) < accelerator.gradient_accumulation_steps:
            try:
                window.append(next(batches))
            except StopIteration:
                batches = iter(train_dl)
        scalars = backward_window(accelerator, model, window, task, i)  # the task's loss, as the loop computes it
        if recipe.train.clip_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), recipe.train.clip_grad_norm)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss = scalars["loss"] + scalars.get("aux_loss", 0)
        value = accelerator.reduce(loss.detach(), reduction="sum").item()  # each process holds its share of the mean
        if not math.isfinite(value):
            result.stopped_early = True
            break
        avg = beta * avg + (1 - beta) * value
        smooth = avg / (1 - beta ** (i + 1))  # debiased
        result.lrs.append(lr)
        result.losses.append(value)
        result.smoothed.append(smooth)
        best = min(best, smooth)
        if smooth > diverge * best:
            result.stopped_early = True
            break
    result.suggested_lr = suggest(result.lrs, result.smoothed)
    if out_dir is not None and accelerator.is_main_process:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        result.plot = str(out / "lr_find.png")
        plot(result, out / "lr_find.png")
        (out / "lr_find.json").write_text(json.dumps(asdict(result), indent=1))
    return result


def plot(result: LRFindResult, path: Path) -> None:
    import matplotlib  # here, not at the top: ~1 s to import, for one picture at the end of lr-find

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(result.lrs, result.losses, alpha=0.3, label="loss")
    ax.plot(result.lrs, result.smoothed, label="smoothed")
    if result.suggested_lr is not None:
        ax.axvline(result.suggested_lr, color="red", linestyle="--", label=f"suggested {result.suggested_lr:.2e}")
    if result.smoothed:  # keep the divergence from flattening the interesting part
        ax.set_ylim(min(result.smoothed) * 0.9, result.smoothed[0] * 1.5)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------------------
# Batch size for a memory budget


@dataclass
class BatchSizeResult:
    peak_mb: dict[int, float | None] = field(default_factory=dict)  # batch size -> peak memory (None: out of memory)
    batch_size: int | None = None  # the largest tried batch size whose training step fits the budget
    device: str = "cpu"
    capped: bool = False  # the answer is the `max_batch` cap: larger sizes were not tried


def probe_step(recipe: Recipe, batch_size: int) -> float:
    """Peak memory (MiB) of one training step (forward, backward, optimizer step) of the recipe's task at
    `batch_size` on a fresh model: CUDA's peak allocated memory, or on CPU this process's peak resident set size
    (call it in a fresh process)."""


    accelerator = make_accelerator(recipe, trackers=False)
    device = accelerator.device
    with tempfile.TemporaryDirectory(prefix="s4accel-batch-") as tmp:
        run = probe_run(recipe, accelerator, Path(tmp), "find-batch-size")  # the recipe's freezing and activation
        # checkpointing included: the memory the real run will need
    task, data = run.task, run.context.data
    if len(data.train) < batch_size:
        raise RecipeError(f"batch-size probe: the train split has only {len(data.train)} examples (< {batch_size})")
    examples = [data.train[i] for i in range(batch_size)]
    batch = {k: v.to(device) for k, v in (data.collate_fn or default_collate)(examples).items()}
    model = run.model.to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.train.mixed_precision or "no")
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        out = task.training_step(model, batch, 0)
    (out if isinstance(out, torch.Tensor) else out["loss"]).backward()
    for o in run.optimizers:  # every optimizer's state: what the run will hold
        o.optimizer.step()
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def find_batch_size(recipe: Recipe, memory_mb: float, max_batch: int = 1024) -> BatchSizeResult:
    """Double the batch size from 1 while one training step's peak memory stays within `memory_mb` (and below
    `max_batch`), then bisect between the last size that fits and the first that does not. Each CPU trial runs in a
    fresh process, so its peak resident memory is its own; a CUDA trial that runs out of memory counts as too big."""
    result = BatchSizeResult(device="cuda" if torch.cuda.is_available() else "cpu")

    def fits(b: int) -> bool:
        result.peak_mb[b] = _trial(recipe, b)
        return result.peak_mb[b] is not None and result.peak_mb[b] <= memory_mb

    good, bad, b = 0, None, 1
    while b <= max_batch:
        if not fits(b):
            bad = b
            break
        good, b = b, b * 2
    if bad is None and 0 < good < max_batch:  # doubling stepped over the cap: the cap itself is the last candidate
        if fits(max_batch):
            good = max_batch
        else:
            bad = max_batch
    if bad is not None:
        while bad - good > 1 and good > 0:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(mid) else (good, mid)
    result.batch_size = good or None
    result.capped = good == max_batch
    return result


def _trial(recipe: Recipe, batch_size: int) -> float | None:
    if torch.cuda.is_available():
        try:
            return probe_step(recipe, batch_size)
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            torch.cuda.empty_cache()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(recipe.to_yaml())
    code = ("import sys; from s4accel.config import load_recipe; from s4accel.tools.finders import probe_step; "
            "print(probe_step(load_recipe(sys.argv[1]), int(sys.argv[2])))")
    proc = subprocess.run([sys.executable, "-c", code, f.name, str(batch_size)], capture_output=True, text=True)
    Path(f.name).unlink(missing_ok=True)
    if proc.returncode != 0:
        if "MemoryError" in proc.stderr or proc.returncode in (-9, 137):  # killed or refused for memory
            return None
        raise RecipeError(f"batch-size probe at {batch_size} failed: {proc.stderr.strip().splitlines()[-1]}")
    return float(proc.stdout.strip().splitlines()[-1])
