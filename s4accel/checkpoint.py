"""Everything the trainer writes into the run directory, written so that a crash never leaves a half-written file
that looks complete: the resolved recipe, training checkpoints (`checkpoints/step_XXXXXXXX`) and the final model.

Layout:
    run_dir/recipe.yaml                  the resolved recipe
    run_dir/checkpoints/step_00001000/   accelerator.save_state + our TrainState, with a COMPLETE marker
    run_dir/final/                       save_pretrained: config, safetensors weights, generation config, tokenizer
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import RunDirError

COMPLETE = "COMPLETE"


@dataclass
class TrainState:
    """Loop counters saved with every checkpoint (`register_for_checkpointing` needs state_dict/load_state_dict)."""

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    batch_in_epoch: int = 0
    """Micro-batches of the current epoch consumed (per process)."""
    tokens_seen: int = 0
    """Input tokens processed, all processes together."""

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


RUN_OUTPUTS = ("final", "checkpoints", "metrics.jsonl", "tensorboard", "samples.txt", "tokenizer")


def prepare_run_dir(run_dir: Path, recipe_yaml: str, overwrite: bool, is_main: bool) -> None:
    """Create the run directory and write the resolved recipe. A directory holding an earlier run's outputs is
    refused unless `overwrite`, which deletes those outputs first (so two runs' metrics never mix)."""
    found = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if found and not overwrite:
        raise RunDirError(f"{run_dir} already holds a run ({', '.join(found)}); choose another run.out_dir or set "
                          f"run.overwrite=true to replace it")
    if not is_main:
        return
    try:
        for name in found:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "recipe.yaml", recipe_yaml)
    except OSError as e:
        raise RunDirError(f"cannot write to run directory {run_dir}: {e.strerror or e}") from None


def save_checkpoint(accelerator, run_dir: Path, step: int, keep_last: int) -> Path:
    """`accelerator.save_state` into a temporary directory, renamed into place once every rank has written its part,
    then marked COMPLETE; then older checkpoints beyond `keep_last` are deleted. Call on every rank."""
    root = run_dir / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crash during an earlier save
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # every rank: its RNG states; main: model, optimizer, scheduler, TrainState
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / COMPLETE).touch()
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints with a COMPLETE marker, oldest first."""
    root = run_dir / "checkpoints"
    return sorted(p for p in root.glob("step_*") if (p / COMPLETE).exists()) if root.exists() else []


def export_pretrained(accelerator, model, tokenizer, out_dir: Path) -> None:
    """`save_pretrained` (config, safetensors, generation config) + tokenizer into `out_dir`, atomically. Call on
    every rank: `get_state_dict` gathers sharded weights under FSDP/DeepSpeed."""
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        unwrapped.save_pretrained(tmp, is_main_process=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()
