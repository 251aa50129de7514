"""The names transformers.Trainer (`TrainingArguments`) and Lightning (`Trainer`, `LightningModule`) give to what a
recipe sets, with the recipe's name for each: a user who writes `learning_rate` or `accumulate_grad_batches` in a
recipe (or a `--set`) is told where it goes instead of getting a did-you-mean for a look-alike key (`eval_steps` is
not `max_steps`). The table in docs/reference/recipes.md is this one."""

from __future__ import annotations

HF = "transformers.Trainer's"
PL = "Lightning's"
BOTH = "transformers.Trainer's and Lightning's"
LAUNCHER = "the launcher decides it: accelerate launch --num_processes N (or --config_file, see accelerate_configs/)"

TRAINER_NAMES: dict[str, tuple[str, str]] = {
    # name: (whose name it is, where it is in a recipe)
    "learning_rate": (BOTH, "optim.lr"),  # a LightningModule's hyperparameter, which Lightning's lr finder sets
    "lr": ("a LightningModule's", "optim.lr"),
    "weight_decay": (HF, "optim.weight_decay"),
    "adam_beta1": (HF, "optim.betas: [beta1, beta2]"),
    "adam_beta2": (HF, "optim.betas: [beta1, beta2]"),
    "adam_epsilon": (HF, "optim.eps"),
    "optim": (HF, "optim.name (a section: optim: {name: sgd})"),
    "optim_args": (HF, "optim.kwargs"),
    "optimizer": ("LightningCLI's", "optim.name (e.g. sgd, or package.module:Class) with optim.kwargs"),
    "lr_scheduler_type": (HF, "scheduler.name"),
    "lr_scheduler_kwargs": (HF, "scheduler.kwargs"),
    "warmup_ratio": (HF, "scheduler.warmup_ratio"),
    "warmup_steps": (HF, "scheduler.warmup_steps"),
    "max_steps": (BOTH, "train.max_steps"),
    "max_epochs": (PL, "train.max_epochs"),
    "num_train_epochs": (HF, "train.max_epochs"),
    "max_time": (PL, "train.max_time"),
    "gradient_accumulation_steps": (HF, "train.grad_accum"),
    "accumulate_grad_batches": (PL, "train.grad_accum"),
    "fp16": (HF, "train.mixed_precision: fp16"),
    "bf16": (HF, "train.mixed_precision: bf16"),
    "precision": (PL, "train.mixed_precision: fp16 or bf16"),
    "max_grad_norm": (HF, "train.clip_grad_norm"),
    "label_smoothing_factor": (HF, "train.label_smoothing"),
    "gradient_clip_val": (PL, "train.clip_grad_norm (train.clip_grad_value to clip by value)"),
    "gradient_clip_algorithm": (PL, "train.clip_grad_norm or train.clip_grad_value"),
    "eval_steps": (HF, "train.eval_every"),
    "eval_on_start": (HF, "train.eval_at_start"),
    "max_train_samples": ("transformers' example scripts'", "data.max_train_examples"),
    "limit_train_batches": (PL, "data.max_train_examples (a number of examples, drawn once with run.seed)"),
    "num_sanity_val_steps": (PL, "train.eval_at_start (a whole evaluation before the first step), or s4accel train "
                                 "RECIPE --fast-dev-run"),
    "eval_strategy": (HF, "train.eval_every (in optimizer steps)"),
    "evaluation_strategy": (HF, "train.eval_every (in optimizer steps)"),
    "val_check_interval": (PL, "train.eval_every (in optimizer steps)"),
    "check_val_every_n_epoch": (PL, "train.eval_every (in optimizer steps)"),
    "limit_val_batches": (PL, "train.eval_max_batches"),
    "eval_accumulation_steps": (HF, "train.eval_max_batches (evaluation gathers per batch already)"),
    "torch_compile": (HF, "train.compile"),
    "torch_compile_mode": (HF, "train.compile_mode"),
    "gradient_checkpointing": (HF, "train.activation_checkpointing"),
    "tf32": (HF, "train.tf32"),
    "resume_from_checkpoint": (HF, "train.resume: auto (or s4accel train RUN_DIR --resume [PATH])"),
    "ckpt_path": (PL, "train.resume: auto (or s4accel train RUN_DIR --resume [PATH])"),
    "profiler": (PL, "train.profile"),
    "early_stopping_patience": (HF, "train.early_stopping.patience"),
    "per_device_train_batch_size": (HF, "data.batch_size"),
    "per_device_eval_batch_size": (HF, "data.eval_batch_size"),
    "batch_size": ("a LightningDataModule's", "data.batch_size"),
    "dataloader_num_workers": (HF, "data.num_workers"),
    "num_workers": ("a LightningDataModule's", "data.num_workers"),
    "save_steps": (HF, "checkpoint.every_steps"),
    "save_strategy": (HF, "checkpoint.every_steps (in optimizer steps)"),
    "save_total_limit": (HF, "checkpoint.keep_last"),
    "enable_checkpointing": (PL, "checkpoint.every_steps (0: none)"),
    "load_best_model_at_end": (HF, "checkpoint.best_at_end: true, with checkpoint.keep_best: 1"),
    "metric_for_best_model": (HF, "checkpoint.best_metric"),
    "greater_is_better": (HF, "checkpoint.best_mode: max"),
    "logging_steps": (HF, "log.log_every"),
    "log_every_n_steps": (PL, "log.log_every"),
    "report_to": (HF, "log.log_with"),
    "logger": (PL, "log.log_with"),
    "disable_tqdm": (HF, "log.progress_bar: false"),
    "enable_progress_bar": (PL, "log.progress_bar"),
    "output_dir": (HF, "run.out_dir"),
    "default_root_dir": (PL, "run.out_dir"),
    "logging_dir": (HF, "run.out_dir (TensorBoard writes to <run.out_dir>/tensorboard)"),
    "overwrite_output_dir": (HF, "run.overwrite"),
    "run_name": (HF, "run.name"),
    "seed": (HF, "run.seed"),
    "push_to_hub": (HF, "hub.push_at_end"),
    "hub_model_id": (HF, "hub.repo_id"),
    "hub_private_repo": (HF, "hub.private"),
    "fast_dev_run": (PL, "not a recipe key: s4accel train RECIPE --fast-dev-run [N] checks a run end to end"),
    "devices": (PL, LAUNCHER),
    "num_nodes": (PL, "the launcher decides it: accelerate launch --num_machines N"),
    "strategy": (PL, "the launcher decides it: accelerate launch --config_file accelerate_configs/fsdp.yaml (or "
                     "deepspeed_zero2.yaml, cpu_2proc.yaml, ...)"),
    "accelerator": (PL, "the launcher decides it: accelerate launch --config_file (or --cpu)"),
}


def trainer_hint(key: str) -> str | None:
    """`learning_rate is transformers.Trainer's name: in a recipe it is optim.lr`, or None for a name neither uses."""
    found = TRAINER_NAMES.get(str(key))
    if found is None:
        return None
    whose, recipe = found
    if recipe.startswith("the launcher"):
        return f"{key} is {whose} name: not a recipe key, {recipe}"
    if recipe.startswith("not a recipe key"):
        return f"{key} is {whose} name: {recipe}"
    return f"{key} is {whose} name: in a recipe it is {recipe}"
