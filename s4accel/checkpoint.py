"""Everything the trainer writes into the run directory, written so that a crash never leaves a half-written file
or directory that looks complete, and the last complete checkpoint always survives.

Layout:
    run_dir/recipe.yaml                  the resolved recipe
    run_dir/checkpoints/step_00001000/   accelerator.save_state + TrainState + recipe.yaml, and last a COMPLETE
                                         manifest (step, every file and its size)
    run_dir/best/step_00000800/          the best models by an eval metric (checkpoint.keep_best)
    run_dir/final/                       save_pretrained: config, safetensors weights, generation config, tokenizer

A checkpoint is written into `.tmp_step_*`, which is renamed into place only once every process has written its part
and the manifest is on disk. A complete checkpoint is never overwritten, so no moment exists without one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

from .errors import CheckpointError, ResumeError, RunDirError

COMPLETE = "COMPLETE"


@dataclass
class TrainState:
    """Loop counters saved with every checkpoint (`register_for_checkpointing` needs state_dict/load_state_dict)."""

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    batch_in_epoch: int = 0
    """Micro-batches of the current epoch consumed (per process): a resume skips exactly these."""
    tokens_seen: int = 0
    """Input tokens processed, all processes together."""
    best_metric: float | None = None
    """Best value of `checkpoint.best_metric` seen at an evaluation."""
    nonfinite_skips: int = 0
    """Steps whose update was dropped for a non-finite loss or gradient norm (train.on_nonfinite: skip)."""
    consecutive_nonfinite: int = 0
    scaler_skips: int = 0
    """fp16 steps the GradScaler skipped (overflow); they do not advance the learning-rate schedule."""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Stays the same across resumes: the identity of the run for trackers."""
    recipe_hash: str = ""
    """Hash of the training-relevant recipe fields this state was trained with."""

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


RUN_OUTPUTS = ("final", "final_ema", "best", "checkpoints", "metrics.jsonl", "tensorboard", "samples.txt", "tokenizer")


def prepare_run_dir(run_dir: Path, recipe_yaml: str, overwrite: bool, resuming: bool, is_main: bool) -> None:
    """Create the run directory and write the resolved recipe. A directory holding an earlier run's outputs is
    refused unless resuming it, or `overwrite`, which deletes those outputs first (so two runs' metrics never mix)."""
    found = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if found and not (overwrite or resuming):
        raise RunDirError(f"{run_dir} already holds a run ({', '.join(found)}); resume it with --resume, choose "
                          f"another run.out_dir, or set run.overwrite=true to replace it")
    if not is_main:
        return
    try:
        if not resuming:
            for name in found:
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "recipe.yaml", recipe_yaml)
    except OSError as e:
        raise RunDirError(f"cannot write to run directory {run_dir}: {e.strerror or e}") from None


# --------------------------------------------------------------------------------------------------------------------
# Training checkpoints


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def save_checkpoint(accelerator, run_dir: Path, step: int, keep_last: int, recipe_yaml: str) -> Path:
    """`accelerator.save_state` into a temporary directory, a manifest, then a rename into place; then checkpoints
    beyond the newest `keep_last` complete ones are deleted. Call on every process. A complete checkpoint of the same
    step is kept as it is (the state at an optimizer step does not depend on when it is saved)."""
    final = checkpoint_dir(run_dir, step)
    if checkpoint_problem(final) is None:
        return final
    tmp = final.with_name(f".tmp_{final.name}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crash during an earlier save
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))  # every process: its RNG states; main: model, optimizer, scheduler, ...
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_atomic(tmp / "recipe.yaml", recipe_yaml)
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            write_atomic(tmp / COMPLETE, json.dumps({"step": step, "files": files}, indent=1))
            os.replace(tmp, final)
    except OSError as e:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        good = latest_complete(run_dir)
        raise CheckpointError(f"could not write checkpoint {final}: {e.strerror or e}; the last complete checkpoint "
                              f"{good or '(none)'} is intact") from None
    if accelerator.is_main_process:
        prune_checkpoints(run_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, and any incomplete one older than the newest
    complete one (a save or a deletion that a crash cut short). Each goes by a rename first, so a kill during the
    deletion leaves a `.del_*` directory (removed at the next prune), never a half-deleted `step_*`."""
    root = run_dir / "checkpoints"
    for trash in root.glob(".del_*"):
        shutil.rmtree(trash, ignore_errors=True)
    complete = complete_checkpoints(run_dir)
    doomed = complete[:-keep_last]
    if complete:
        doomed += [p for p in sorted(root.glob("step_*")) if p < complete[-1] and p not in complete]
    for old in doomed:
        trash = old.with_name(f".del_{old.name}")
        os.replace(old, trash)
        shutil.rmtree(trash, ignore_errors=True)


def check_pickles(path: Path) -> None:
    """Refuse a checkpoint whose saved objects are more than tensors and plain data, before anything unpickles them.

    Accelerate reads the states of registered objects (`custom_checkpoint_*.pkl`: the scheduler, the loop's counters,
    the carried state, stateful callbacks) with `weights_only=False`, i.e. a full unpickler that can run code. Ours
    hold only tensors, numbers, strings, lists and dicts, so each must first load with `weights_only=True`, whose
    unpickler admits nothing else; a file that does not is refused (model weights are safetensors, and the optimizer
    and RNG states Accelerate already reads with `weights_only=True`)."""
    import pickle

    import torch

    for f in sorted(path.glob("custom_checkpoint_*.pkl")):
        try:
            torch.load(f, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ResumeError(f"{f} holds more than tensors and plain data; refusing to unpickle it ({first})") \
                from None


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None if it is: its manifest lists every file with its size."""
    try:
        manifest = json.loads((path / COMPLETE).read_text())
    except FileNotFoundError:
        return "no such checkpoint" if not path.exists() else f"no {COMPLETE} marker (the save did not finish)"
    except (OSError, ValueError):
        return f"unreadable {COMPLETE} marker"
    for name, size in manifest.get("files", {}).items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} is truncated ({actual} of {size} bytes)"
    return None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return [p for p in sorted((run_dir / "checkpoints").glob("step_*")) if checkpoint_problem(p) is None]


def latest_complete(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def locate_checkpoint(run_dir: Path, resume: str) -> tuple[Path | None, list[str]]:
    """The checkpoint `--resume` means, and warnings about what was skipped. `latest`: the newest complete checkpoint
    of the run directory (None if there is none: the run starts fresh); otherwise a path that must be complete."""
    if resume != "latest":
        path = Path(resume)
        problem = checkpoint_problem(path)
        if problem:
            raise ResumeError(f"--resume {path}: not a usable checkpoint: {problem}")
        return path, []
    warnings = []
    root = run_dir / "checkpoints"
    for path in sorted(root.glob(".tmp_step_*")):
        warnings.append(f"ignoring {path}: a checkpoint whose save was interrupted")
    for path in sorted(root.glob("step_*"), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, warnings
        warnings.append(f"skipping checkpoint {path}: {problem}")
    return None, warnings


def checkpoint_step(path: Path) -> int:
    return json.loads((path / COMPLETE).read_text())["step"]


def checkpoint_recipe(path: Path) -> dict:
    return yaml.safe_load((path / "recipe.yaml").read_text())


# --------------------------------------------------------------------------------------------------------------------
# Models


def own_class(model, state_dict: dict, device=None) -> tuple:
    """FSDP2 shards a model in place by swapping its class for a generated `FSDP<Name>` subclass; `save_pretrained`
    would name that class and copy torch's FSDP files as the Hub repo's remote code, and one process cannot run it
    alone. Returns an instance of the model's own class holding the gathered weights, and its state dict, in which
    tied weights (gathered as separate copies) are one tensor again. Without `device` the instance is built empty on
    the meta device and given the tensors (enough to save it); with one, it is a whole model there (to run it)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return model, state_dict
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device(device or "meta"):
        plain = cls(model.config)
    plain.load_state_dict(state_dict, assign=device is None)
    plain.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    return plain, plain.state_dict()


def export_pretrained(accelerator, model, tokenizer, out_dir: Path, extra_files: dict[str, str] | None = None) -> None:
    """`save_pretrained` (config, safetensors, generation config) + tokenizer + `extra_files` ({name: text}) into
    `out_dir`, atomically; a model without `save_pretrained` writes its state dict as `model.safetensors`. Call on
    every process: `get_state_dict` gathers sharded weights under FSDP/DeepSpeed."""
    accelerator.wait_for_everyone()
    # torch.compile (whole-model or Accelerate's regional) names parameters `..._orig_mod.x`: export the plain names.
    state_dict = {k.replace("_orig_mod.", ""): v for k, v in accelerator.get_state_dict(model).items()}
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
            if hasattr(unwrapped, "save_pretrained"):
                unwrapped, state_dict = own_class(unwrapped, state_dict)
                unwrapped.save_pretrained(tmp, is_main_process=True, state_dict=state_dict)
            else:  # a plain nn.Module of a task of your own: its weights (load_state_dict(load_file(...)))
                from safetensors.torch import save_file

                tmp.mkdir(parents=True)
                # clone: safetensors refuses tensors sharing storage (tied weights are stored twice)
                save_file({k: v.detach().cpu().clone().contiguous() for k, v in state_dict.items()},
                          tmp / "model.safetensors")
            if tokenizer is not None:  # array data has none
                tokenizer.save_pretrained(tmp)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            old = out_dir.with_name(f".{out_dir.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            if out_dir.exists():
                os.replace(out_dir, old)  # the previous export stays whole until the new one is in place
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not write model to {out_dir}: {e.strerror or e}") from None
    accelerator.wait_for_everyone()
