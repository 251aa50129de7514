"""`train(recipe)`: one Accelerator loop for causal language models.

The model is known only through the transformers interface: `model(input_ids, labels, num_items_in_batch)` returns
`.loss` (and `.logits`), `generate()` samples, `save_pretrained` exports. Traps this loop avoids are numbered as in
shared NOTES.md (N1 = item 1, ...).
"""

from __future__ import annotations

import math
import resource
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradientAccumulationPlugin
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from .checkpoint import TrainState, export_pretrained, prepare_run_dir, save_checkpoint, write_atomic
from .config import Recipe, build_model_config, load_recipe
from .data import build_dataloaders, build_text_data, token_byte_and_char_counts
from .optim import build_optimizer, build_scheduler
from .tracking import build_trackers, flatten


@dataclass
class TrainResult:
    run_dir: Path
    final_dir: Path
    steps: int
    eval_metrics: dict = field(default_factory=dict)
    """The last evaluation: loss (nats/token), ppl, bits_per_byte, bits_per_char."""
    loop_seconds: float = 0.0
    """Wall time of the training loop (steps, logging, evaluation, checkpoints), without setup and export."""
    samples: list[str] = field(default_factory=list)
    is_main_process: bool = True


def train(recipe: Recipe | str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainResult:
    """Train the model a recipe describes; returns where it went and how it did. Works under `accelerate launch`."""
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe, overrides)
    cfg, run_dir = recipe.train, recipe.run.dir
    accelerator = Accelerator(
        # Without any accelerator, processes started by `accelerate launch --multi_gpu` (torchrun) must be told they
        # are CPU processes, or each runs alone; with cpu=True they form a gloo group (DistributedType.MULTI_CPU).
        cpu=not torch.accelerator.is_available(),
        mixed_precision=cfg.mixed_precision,  # None: from the accelerate config / launch flags
        # We hand accumulate() exactly grad_accum micro-batches per optimizer step, across epoch boundaries too.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=cfg.grad_accum, sync_with_dataloader=False),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # the same order on every rank (N6)
        log_with=build_trackers(recipe.log.log_with, recipe.run.name, run_dir) or None,
        project_dir=str(run_dir),
        step_scheduler_with_optimizer=False,
    )
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        warnings.warn("fp16 mixed precision has no effect on CPU (Accelerate runs float32 there, without a "
                      "GradScaler); use train.mixed_precision=bf16 for half precision on CPU", stacklevel=2)
    prepare_run_dir(run_dir, recipe.to_yaml(), recipe.run.overwrite, accelerator.is_main_process)
    accelerator.wait_for_everyone()
    set_seed(recipe.run.seed)

    # Data, model, optimizer. The main process tokenises (and trains a BPE) first; the others read its cache.
    with accelerator.main_process_first():
        data = build_text_data(recipe.data, tokenizer_dir=run_dir / "tokenizer")
    model = build_model(recipe, data.tokenizer)
    optimizer = build_optimizer(model, recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.scheduler, recipe.warmup_steps, cfg.max_steps)  # not prepared (N3)
    train_dl, val_dl = build_dataloaders(recipe.data, data, recipe.run.seed, cfg.eval_max_batches,
                                         accelerator.num_processes)
    model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)
    state = TrainState()
    accelerator.register_for_checkpointing(scheduler, state)  # registration order is part of the checkpoint format
    accelerator.init_trackers(recipe.run.name, config=flatten(recipe.to_dict()))
    token_bytes, token_chars = (t.to(accelerator.device) for t in token_byte_and_char_counts(data.tokenizer))
    accelerator.print(f"{recipe.run.name}: {count_params(model):,} parameters, {data.n_train_tokens:,} train / "
                      f"{data.n_val_tokens:,} val tokens, {accelerator.num_processes} process(es) on "
                      f"{accelerator.device}, mixed precision {accelerator.mixed_precision}")

    # The loop: one iteration per optimizer step.
    batches = batch_stream(train_dl, state)
    meter = Meter(accelerator)
    bar = tqdm(total=cfg.max_steps, disable=not (accelerator.is_main_process and recipe.log.progress_bar),
               desc="train", dynamic_ncols=True)
    eval_metrics: dict = {}
    params = [p for p in model.parameters() if p.requires_grad]  # what clipping sees, listed once
    model.train()
    t_start = time.perf_counter()
    while state.step < cfg.max_steps:
        window = [next(batches) for _ in range(cfg.grad_accum)]
        meter.add(loss=backward_window(accelerator, model, window))
        # The window's last micro-batch synchronised the gradients: everything below happens once per step (N1).
        meter.add(grad_norm=clip_gradients(accelerator, params, cfg))
        optimizer_step(accelerator, optimizer, scheduler)
        state.step += 1
        state.tokens_seen += sum(b["input_ids"].numel() for b in window) * accelerator.num_processes
        bar.update(1)
        if state.step % recipe.log.log_every == 0 or state.step == cfg.max_steps:
            logs = meter.flush(state, scheduler, optimizer)  # the loop's only host sync (N11)
            accelerator.log(logs, step=state.step)
            bar.set_postfix(loss=f"{logs['train/loss']:.3f}", refresh=False)
        if (cfg.eval_every and state.step % cfg.eval_every == 0) or state.step == cfg.max_steps:
            eval_metrics = evaluate(accelerator, model, val_dl, token_bytes, token_chars)
            accelerator.log({f"eval/{k}": v for k, v in eval_metrics.items()}, step=state.step)
            if accelerator.is_main_process:
                bar.write(f"step {state.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
        if cfg.save_every and state.step % cfg.save_every == 0:
            save_checkpoint(accelerator, run_dir, state.step, cfg.keep_last)
    bar.close()
    loop_seconds = time.perf_counter() - t_start

    # Export: config + safetensors + generation config + tokenizer, loadable by from_pretrained.
    final_dir = run_dir / "final"
    export_pretrained(accelerator, model, data.tokenizer, final_dir)
    samples = write_samples(accelerator, model, data.tokenizer, recipe, run_dir)
    accelerator.end_training()
    return TrainResult(run_dir, final_dir, state.step, eval_metrics, loop_seconds, samples,
                       accelerator.is_main_process)


def build_model(recipe: Recipe, tokenizer):
    """A freshly initialised causal LM from the registry size + overrides, sized to the tokenizer."""
    from transformers import AutoModelForCausalLM

    config = build_model_config(recipe.model, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config)


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def batch_stream(train_dl, state: TrainState):
    """Micro-batches forever, epoch after epoch; `set_epoch` reshuffles each epoch identically on every rank (N6)."""
    while True:
        train_dl.set_epoch(state.epoch)
        for batch in train_dl:
            state.batch_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batch_in_epoch = 0


def backward_window(accelerator, model, window: list[dict]) -> torch.Tensor:
    """Forward and backward over the micro-batches of one optimizer step; returns this rank's share of the loss.

    Token-normalised (N4): every micro-batch's loss is its summed token loss divided by the number of real target
    tokens in the whole window on all ranks, so ragged micro-batches weigh by their tokens. Multiplying by
    grad_accum x num_processes cancels backward's 1/grad_accum (N2) and DDP's mean over ranks. One collective.
    """
    ga = accelerator.gradient_accumulation_steps
    assert len(window) == ga, f"a window holds grad_accum={ga} micro-batches, got {len(window)}"
    n_items = sum(count_targets(b) for b in window)
    if accelerator.num_processes > 1:
        n_items = accelerator.gather(n_items.reshape(1)).sum()
    total = torch.zeros((), device=accelerator.device)
    for batch in window:
        with accelerator.accumulate(model):  # no DDP all-reduce until the window's last micro-batch
            out = model(**batch, num_items_in_batch=n_items)
            accelerator.backward(out.loss * ga * accelerator.num_processes)
        total += out.loss.detach()
    return total


def optimizer_step(accelerator, optimizer, scheduler) -> None:
    """Step the optimizer, then the schedule unless fp16's GradScaler skipped the step (inf/NaN gradients): a skipped
    step must not advance the learning rate (N3)."""
    optimizer.step()
    if not accelerator.optimizer_step_was_skipped:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def count_targets(batch) -> torch.Tensor:
    """Real target tokens of a batch: labels are shifted inside the model, so position 0 is never a target."""
    return (batch["labels"][:, 1:] != -100).sum()


def clip_gradients(accelerator, params: list, cfg) -> torch.Tensor:
    """Clip by value or by norm; return the global gradient norm (before norm clipping) for logging."""
    if cfg.clip_grad_value is not None:
        accelerator.clip_grad_value_(params, cfg.clip_grad_value)  # also unscales fp16 gradients
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    # An infinite max norm only measures; clip_grad_norm_ unscales fp16 gradients once per step either way (N1).
    return accelerator.clip_grad_norm_(params, cfg.clip_grad_norm or math.inf)


class Meter:
    """Sums training scalars on the device between log steps, so logging syncs with the host once per interval."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.sums: dict[str, torch.Tensor] = {}
        self.steps_at_last = 0
        self.time_at_last = time.perf_counter()
        self.tokens_at_last = 0

    def add(self, **values: torch.Tensor):
        for k, v in values.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v

    def flush(self, state: TrainState, scheduler, optimizer) -> dict:
        steps = state.step - self.steps_at_last
        loss = self.accelerator.reduce(self.sums.pop("loss"), reduction="sum")  # each rank holds its share
        logs = {"train/loss": loss.item() / steps, "train/grad_norm": self.sums.pop("grad_norm").item() / steps}
        now = time.perf_counter()
        logs["train/tokens_per_s"] = (state.tokens_seen - self.tokens_at_last) / (now - self.time_at_last)
        logs["train/step_time_ms"] = 1000 * (now - self.time_at_last) / steps
        logs["train/peak_mem_mb"] = peak_memory_mb(self.accelerator.device)
        logs["train/epoch"] = state.epoch
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            logs[f"train/lr_{group.get('name', len(logs))}"] = lr
        self.sums.clear()
        self.steps_at_last, self.time_at_last, self.tokens_at_last = state.step, now, state.tokens_seen
        return logs


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak resident set size (Linux: KiB)


@torch.no_grad()
def evaluate(accelerator, model, val_dl, token_bytes, token_chars) -> dict:
    """Validation loss over every target token of the split, gathered across processes (N5): per-sample sums are
    gathered with `gather_for_metrics`, which drops the duplicates padding the last batch, then reduced."""
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=accelerator.device)
    for batch in val_dl:
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]  # (B, L-1, V), position t predicts t + 1
        targets = batch["labels"][:, 1:]  # (B, L-1)
        mask = targets != -100
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none",
                                                ignore_index=-100)
        safe = targets.clamp(min=0)
        per_sample = torch.stack([nll.sum(1), mask.sum(1), (token_bytes[safe] * mask).sum(1),
                                  (token_chars[safe] * mask).sum(1)], dim=1).double()  # (B, 4)
        totals += accelerator.gather_for_metrics(per_sample).sum(0)
    model.train()
    nll, n_tokens, n_bytes, n_chars = totals.tolist()
    loss = nll / max(n_tokens, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "bits_per_byte": nll / math.log(2) / max(n_bytes, 1),
            "bits_per_char": nll / math.log(2) / max(n_chars, 1)}


def write_samples(accelerator, model, tokenizer, recipe: Recipe, run_dir: Path) -> list[str]:
    """Complete the recipe's prompts with `generate()` on the main process; write them to `samples.txt`."""
    cfg = recipe.sample
    if not cfg.prompts or not accelerator.is_main_process:
        return []
    lm = accelerator.unwrap_model(model)
    lm.eval()
    torch.manual_seed(cfg.seed)
    samples = []
    for prompt in cfg.prompts:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(accelerator.device)
        sampling = {"do_sample": True, "temperature": cfg.temperature, "top_k": cfg.top_k or 0}
        with accelerator.autocast():
            out = lm.generate(ids, max_new_tokens=cfg.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                              **(sampling if cfg.temperature > 0 else {"do_sample": False}))
        samples.append(tokenizer.decode(out[0], skip_special_tokens=True))
    write_atomic(run_dir / "samples.txt", "\n\n".join(f"--- sample {i}\n{s}" for i, s in enumerate(samples)) + "\n")
    for s in samples:
        accelerator.print(f"--- sample\n{s}")
    return samples
