"""`s4accel export RUN_DIR [--step N] OUT`: a `from_pretrained` folder from any training checkpoint of a run, the
newest complete one or step N, written on one process or sharded by FSDP; also of a run killed before its final/.

Where each part comes from:
    weights          the checkpoint (training/checkpoint_weights.py), bit for bit; `--ema`: its EMA's parameters
    config           the checkpoint's own recipe.yaml, as the run built the model: the named size, its overrides
                     and what the data decides (the tokenizer's fields; a classifier's labels and input
                     statistics, read from its data), checked against the weights' names and shapes
    tokenizer        as the run built it: by the recipe, a trained BPE from the run's tokenizer/ folder
    code, auto_map   `save_pretrained`, as for final/ (loads with trust_remote_code, without s4accel)
    card             README.md, recipe.yaml, metrics.json, training_curve.png, as `s4accel push` stages them

A LoRA run (`model.lora`) exports its adapter as final/ holds it (PEFT's files; a fresh base in base/), or with
`--merge` a plain model: every adapted weight W + (alpha / r) B A, loadable without PEFT.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import Recipe, load_recipe
from ..data import build_data, build_tokenizer, data_spec, tokenizer_fields
from ..errors import ExportError
from ..training.runs.checkpoint import (STEP_DIR, checkpoint_dir, checkpoint_problem, checkpoint_step, locate_checkpoint,
                                   step_dirs)
from ..training.runs.checkpoint_weights import checkpoint_weights_kind, read_ema_weights, read_model_weights
from ..training.lora import is_lora, merged, save_adapter
from ..training.runs.safe_load import is_adapter, load_model
from ..training.tasks_builtin import PREPROCESSING, build_model, preprocessing
from .adapter_card import write_any_card
from .model_card import eval_metrics
from .outputs import WholeFolder, check_output_folder


@dataclass(frozen=True)
class Exported:
    out: Path
    checkpoint: Path
    step: int
    kind: str
    """`full` (one process, DDP) or `sharded` (FSDP)."""
    warnings: list[str]
    """Checkpoints passed over on the way to the newest complete one."""


def export_checkpoint(run_dir: str | Path, out: str | Path, step: int | None = None, ema: bool = False,
                      overwrite: bool = False, merge: bool = False) -> Exported:
    """Write the model of one checkpoint of `run_dir` to `out` (atomically; an existing non-empty `out` only with
    `overwrite`); of a LoRA run its adapter, or with `merge` the base with the adapter merged into it. Whatever the
    user can get wrong is one `ExportError` (or `DataError`) before anything is written."""
    run_dir, out = Path(run_dir), Path(out)
    if merge and step is None and not ema and run_dir.is_dir() and not step_dirs(run_dir) and \
            is_adapter(run_dir / "final"):
        return merge_final(run_dir, out, overwrite)
    ckpt, warnings = find_checkpoint(run_dir, step)
    kind = checkpoint_weights_kind(ckpt)
    recipe = load_recipe(ckpt / "recipe.yaml")
    if not recipe.task.builtin:
        raise ExportError(f"{ckpt}: trained by a task of your own ({recipe.task.target}); export rebuilds the model a "
                          f"built-in task trains (its own tasks export their model at the end of training)")
    if ema and recipe.train.ema is None:
        raise ExportError(f"--ema: {run_dir} was trained without train.ema; its checkpoints hold no EMA weights")
    if merge and recipe.model.lora is None:
        raise ExportError(f"--merge: {run_dir} trained no LoRA adapter (model.lora); its checkpoints hold the whole "
                          f"model already: export without --merge")
    check_out(out, run_dir, overwrite)
    tokenizer, model = model_skeleton(recipe, run_dir)
    weights = read_model_weights(ckpt)
    n = checkpoint_step(ckpt)
    if ema:  # the averaged parameters (each tied one once), the model's buffers, as final_ema/ holds them
        parameters = dict(model.named_parameters(remove_duplicate=False))
        weights = {k: v for k, v in weights.items() if k not in parameters} | averaged(ckpt, n)
    fill(model, weights, ckpt)
    which = f"step {n}" + (" EMA" if ema else "") + (" merged with its LoRA adapter" if merge else "")
    records = [r for r in read_records(run_dir) if isinstance(r.get("step"), int) and r["step"] <= n]
    if merge:
        model = merged(model)
    with WholeFolder(out, "OUT") as tmp:
        if is_lora(model):  # the adapter as final/ holds it
            save_adapter(model, tmp)
        else:  # config, generation config, safetensors (tied weights once), code + auto_map
            model.save_pretrained(tmp)
        if tokenizer is not None:  # array data has none
            tokenizer.save_pretrained(tmp)
        (tmp / PREPROCESSING).write_text(preprocessing(recipe))
        write_any_card(tmp, out.name, (ckpt / "recipe.yaml").read_text(), records, eval_metrics(records, ema, n),
                       which)
    return Exported(out, ckpt, n, kind, warnings)


def merge_final(run_dir: Path, out: Path, overwrite: bool) -> Exported:
    """`--merge` on a LoRA run without step checkpoints (pruned, or never written): its final/ adapter merged into
    its base, as `load_model` merges it, with the tokenizer, preprocessing record and card of final/."""
    check_out(out, run_dir, overwrite)
    model, tokenizer, final = load_model(run_dir)
    records = read_records(run_dir)
    with WholeFolder(out, "OUT") as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if (final / PREPROCESSING).is_file():
            (tmp / PREPROCESSING).write_text((final / PREPROCESSING).read_text())
        write_any_card(tmp, out.name, (run_dir / "recipe.yaml").read_text(), records, eval_metrics(records, False),
                       "final, merged with its LoRA adapter")
    return Exported(out, final, records[-1]["step"] if records else 0, "final", [])


def find_checkpoint(run_dir: Path, step: int | None) -> tuple[Path, list[str]]:
    """Step `step`'s checkpoint, or the newest that passes verification (with what was passed over); each checked
    file by file against its manifest."""
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    found = step_dirs(run_dir)
    if not found:
        hint = " (its final/ model is a from_pretrained folder already)" if (run_dir / "final").is_dir() else ""
        raise ExportError(f"{run_dir}: no checkpoint to export (no checkpoints/step_*){hint}")
    if step is None:
        ckpt, warnings, _ = locate_checkpoint(run_dir, "latest")
        if ckpt is None:
            raise ExportError(f"{run_dir}: no complete checkpoint ({'; '.join(warnings)})")
        return ckpt, warnings
    ckpt = checkpoint_dir(run_dir, step)
    if ckpt not in found:
        steps = ", ".join(str(int(STEP_DIR.fullmatch(p.name)[1])) for p in found)
        raise ExportError(f"--step {step}: {run_dir} has no checkpoint of that step (it has steps {steps})")
    problem = checkpoint_problem(ckpt, verify=True)
    if problem:
        raise ExportError(f"--step {step}: {ckpt} is not a usable checkpoint: {problem}")
    return ckpt, []


def check_out(out: Path, run_dir: Path, overwrite: bool) -> None:
    """OUT can be written, and replacing it (`--overwrite`) cannot take the run or its checkpoints with it."""
    target, run = out.resolve(), run_dir.resolve()
    if target == run or target in run.parents or target.is_relative_to(run / "checkpoints"):
        raise ExportError(f"OUT {out}: would replace the run directory or its checkpoints; choose another folder")
    check_output_folder(out, "OUT", overwrite)


def model_skeleton(recipe: Recipe, run_dir: Path):
    """(the tokenizer or None, the model on the meta device) as the run built them from its recipe. A language
    model's shape depends on its tokenizer alone, so its data is not read (it may be gone); a classifier's labels and
    an array model's input statistics are read from its data, as the run did."""
    cfg = recipe.data
    tokenizer_dir = run_dir / "tokenizer"  # where a run keeps the BPE it trained
    if cfg.is_text and cfg.tokenizer == "bpe" and not (tokenizer_dir / "tokenizer.json").is_file():
        raise ExportError(f"{run_dir}: no tokenizer/tokenizer.json; the BPE the run trained, which decides its "
                          f"model's vocabulary, is gone")
    if cfg.is_lm:
        tokenizer = build_tokenizer(cfg, None, tokenizer_dir)
        spec = tokenizer_fields(tokenizer)
    else:
        data = build_data(cfg, tokenizer_dir=tokenizer_dir)
        tokenizer, spec = getattr(data, "tokenizer", None), data_spec(cfg, data)
    return tokenizer, build_model(recipe, None, device="meta", spec=spec)


def averaged(ckpt: Path, step: int) -> dict[str, torch.Tensor]:
    """The EMA's averaged parameters at this checkpoint."""
    found = read_ema_weights(ckpt)
    if found is None:
        raise ExportError(f"--ema: {ckpt} holds no EMA state")
    params, n_averaged = found
    if n_averaged == 0:
        raise ExportError(f"--ema: nothing was averaged yet at step {step} (train.ema.start_step is later)")
    return params


def fill(model, weights: dict[str, torch.Tensor], ckpt: Path) -> None:
    """Give the meta-device model the checkpoint's tensors themselves (no copy: exported as they are), tied weights
    tied again; every tensor of the model must come from the checkpoint, and every one of the checkpoint must be
    the model's (a tied weight saved twice must be the same twice)."""
    try:
        result = model.load_state_dict(weights, strict=False, assign=True)
    except RuntimeError as e:  # a shape that differs
        raise ExportError(f"{ckpt}: its weights do not fit the model its recipe describes: "
                          f"{str(e).strip().splitlines()[-1].strip()[:300]}") from None
    model.tie_weights()
    state = model.state_dict()
    missing = [k for k, v in state.items() if v.is_meta]
    if result.unexpected_keys or missing:
        what = f"no {missing[0]}" if missing else f"an unexpected {result.unexpected_keys[0]}"
        raise ExportError(f"{ckpt}: its weights do not fit the model its recipe describes ({what})")
    differ = [k for k, v in weights.items() if not torch.equal(state[k], v)]
    if differ:
        raise ExportError(f"{ckpt}: {differ[0]} is tied to another weight but holds other values")


def read_records(run_dir: Path) -> list[dict]:
    """The run's logged records (`metrics.jsonl`); a line that a killed run left half-written is skipped."""
    path = run_dir / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in records if isinstance(r, dict)]
