"""Everything the trainer writes into the run directory, written so that a crash never leaves a half-written file
or directory that looks complete, and the last complete checkpoint always survives.

Layout:
    run_dir/recipe.yaml                  the resolved recipe
    run_dir/checkpoints/step_00001000/   accelerator.save_state + TrainState + recipe.yaml, and last a COMPLETE
                                         manifest (step, every file with its size and SHA-256)
    run_dir/best/step_00000800/          the best models by an eval metric (checkpoint.keep_best)
    run_dir/final/                       save_pretrained: config, safetensors weights, generation config, tokenizer

A checkpoint is written into `.tmp_step_*`, which is renamed into place only once every process has written its part
and the manifest is on disk. A complete checkpoint is never overwritten, so no moment exists without one. A resume
verifies every file against the manifest; a checkpoint that fails is moved aside (`step_N.invalid-<time>`), kept for
inspection, so that the run can pass its step again.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml
from accelerate.utils import DistributedType, load
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule

from ...errors import CheckpointError, ResumeError
from ..lora import is_lora, save_adapter
from .run_dir import replace_dir, write_atomic
from ..devices.zero import safe_globals

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
    train_seconds: float = 0.0
    """Wall time of the training loop so far, resumes included (what `train.max_time` counts)."""
    eval_cut_at: int | None = None
    """The step whose evaluation a stop signal cut short (None once an evaluation completes): a run resumed at that
    step evaluates before its next one, as the uninterrupted run did."""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Stays the same across resumes: the identity of the run for trackers."""
    recipe_hash: str = ""
    """Hash of the training-relevant recipe fields this state was trained with."""

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


# --------------------------------------------------------------------------------------------------------------------
# Training checkpoints


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def save_checkpoint(accelerator, run_dir: Path, step: int, keep_last: int, recipe_yaml: str) -> Path:
    """`accelerator.save_state` into a temporary directory, a manifest, then a rename into place; then checkpoints
    beyond the newest `keep_last` complete ones are deleted. Call on every process. A complete checkpoint of the same
    step is kept as it is (the state at an optimizer step does not depend on when it is saved); an invalid one in the
    way is moved aside."""
    final = checkpoint_dir(run_dir, step)
    if checkpoint_problem(final) is None:
        return final
    tmp = final.with_name(f".tmp_{final.name}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crash during an earlier save
        if final.exists():
            move_aside(final)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))  # every process: its RNG states; main: model, optimizer, scheduler, ...
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_atomic(tmp / "recipe.yaml", recipe_yaml)
            write_atomic(tmp / COMPLETE, json.dumps({"step": step, "files": _manifest(tmp)}, indent=1))
            os.replace(tmp, final)
    except Exception as e:
        # A full disk reaches us as OSError, or as torch's RuntimeError ("PytorchStreamWriter failed writing file")
        # or safetensors' SafetensorError from inside save_state.
        if not is_write_error(e):
            raise
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        good = latest_complete(run_dir)
        raise CheckpointError(f"could not write checkpoint {final}: {write_error_text(e)}; the last complete "
                              f"checkpoint {good or '(none)'} is intact") from None
    if accelerator.is_main_process:
        prune_checkpoints(run_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def is_write_error(e: BaseException) -> bool:
    """An error of writing files (disk full, quota, permissions), however the library that wrote reports it."""
    text = str(e)
    torch_writer = ("inline_container", "PytorchStreamWriter", "file write failed", "No space", "File too large")
    return isinstance(e, OSError) or type(e).__name__ == "SafetensorError" or (
        isinstance(e, RuntimeError) and any(marker in text for marker in torch_writer))


def write_error_text(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "inline_container" in first:  # torch's zip writer says only "unexpected pos N vs M": a short write
        return f"a write was cut short (disk full?): {first}"
    return first


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _manifest(directory: Path) -> dict:
    """{relative path: {size, sha256}} of every file, read back right after writing (from the page cache)."""
    return {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(directory.rglob("*")) if p.is_file()}


def move_aside(path: Path) -> Path:
    """Rename an invalid checkpoint to `step_N.invalid-<time>`: kept for inspection, out of the way of the run."""
    target = path.with_name(f"{path.name}.invalid-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.invalid-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        n += 1
    os.replace(path, target)
    return target


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
        doomed += [p for p in step_dirs(run_dir) if p < complete[-1] and p not in complete]
    for old in doomed:
        trash = old.with_name(f".del_{old.name}")
        os.replace(old, trash)
        shutil.rmtree(trash, ignore_errors=True)


def check_pickles(path: Path) -> None:
    """Refuse a checkpoint whose pickled files are more than tensors and plain data, before Accelerate reads them.

    Accelerate reads the states of registered objects (`custom_checkpoint_*.pkl`: the scheduler, the loop's counters,
    the carried state, stateful callbacks) with `weights_only=False`, i.e. a full unpickler that can run code: ours
    hold only tensors, numbers, strings, lists and dicts, so each must first load with `weights_only=True`, whose
    unpickler admits nothing else. The optimizer, scheduler, sampler and RNG states Accelerate reads with
    `weights_only=True` itself, but its error would be a traceback, and an RNG file that fails to load it skips with
    no more than a log line (the run would go on with other random numbers): each is loaded here first (memory-mapped,
    so a large optimizer state costs no memory), and a file that does not load is one `ResumeError` naming it.
    DeepSpeed reads its own files (`pytorch_model/*.pt`: weights, each process's optimizer partition) with
    `weights_only=False`: they must load with `weights_only=True` too, admitting besides plain data only the three
    DeepSpeed classes its optimizer states hold (`zero.safe_globals`)."""

    accelerate_files = [f for f in sorted(path.iterdir()) if f.suffix in (".pkl", ".bin") and f.is_file()]
    for f in [*accelerate_files, *sorted(path.glob("pytorch_model/*.pt"))]:
        try:
            if f.name.startswith("custom_checkpoint_"):
                torch.load(f, map_location="cpu", weights_only=True)
            elif f.suffix == ".pt":
                with torch.serialization.safe_globals(safe_globals()):
                    torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            else:
                obj = load(f, map_location="cpu", mmap=True)
                if f.name.startswith("random_states_") and not {"random_state", "numpy_random_seed",
                                                                "torch_manual_seed"} <= set(obj):
                    raise ValueError("not the random states Accelerate saves")
        except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, TypeError, ValueError, KeyError,
                OSError) as e:
            first = re.sub(r"\x1b\[[0-9;]*m", "", str(e).strip().splitlines()[0]) if str(e).strip() else \
                type(e).__name__
            raise ResumeError(f"{f}: holds more than tensors and plain data (or is damaged); refusing to unpickle it "
                              f"({first[:200]})") from None


STEP_DIR = re.compile(r"step_(\d{8})")
REQUIRED = ("recipe.yaml", "random_states_0.pkl")
"""Files every checkpoint has (besides model and optimizer states, whose names depend on the distributed setup)."""


def step_dirs(run_dir: Path) -> list[Path]:
    """The `step_XXXXXXXX` directories of a run, oldest first (not temporary, deleted or moved-aside ones)."""
    root = run_dir / "checkpoints"
    return sorted(p for p in root.glob("step_*") if STEP_DIR.fullmatch(p.name)) if root.is_dir() else []


def checkpoint_problem(path: Path, verify: bool = False) -> str | None:
    """Why `path` is not a complete checkpoint, or None if it is: its manifest names its own step and lists every
    file with its size (and SHA-256); `verify` also re-hashes every file (a resume does; rotation checks sizes)."""
    try:
        manifest = json.loads((path / COMPLETE).read_text())
    except FileNotFoundError:
        return "no such checkpoint" if not path.exists() else f"no {COMPLETE} marker (the save did not finish)"
    except (OSError, ValueError):
        return f"unreadable {COMPLETE} marker"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not isinstance(manifest.get("step"), int):
        return f"malformed {COMPLETE} marker"
    named = STEP_DIR.fullmatch(path.name)
    if named and int(named[1]) != manifest["step"]:
        return f"its {COMPLETE} marker says step {manifest['step']}, its name step {int(named[1])}"
    missing = [f for f in REQUIRED if f not in files]
    if not any(f.startswith(("model", "pytorch_model")) for f in files):
        missing.append("the model's weights")
    if not any(f.startswith("optimizer") or "optim_states" in f for f in files):  # DeepSpeed: *_optim_states.pt
        missing.append("the optimizer's state")
    if missing:
        return f"its {COMPLETE} marker does not list a whole checkpoint (no {', '.join(missing)})"
    for name, entry in files.items():
        size, digest = (entry, None) if isinstance(entry, int) else \
            (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if not isinstance(size, int) or Path(name).is_absolute() or ".." in Path(name).parts:
            return f"malformed {COMPLETE} marker (entry {name!r})"
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} is truncated ({actual} of {size} bytes)"
        if verify and digest is not None and _sha256(path / name) != digest:
            return f"{name} does not match its checksum (changed after it was written)"
        if verify and name.endswith(".safetensors") and (problem := _safetensors_problem(path / name)):
            return f"{name} is not a safetensors file ({problem})"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's header, or None: a manifest recomputed over a damaged file (emptied,
    cut) passes its checksum, and loading it would be a traceback from deep inside the resume."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # SafetensorError, and the OSErrors of a file that cannot be read
        return str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
    return None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (sizes checked, not checksums)."""
    return [p for p in step_dirs(run_dir) if checkpoint_problem(p) is None]


def latest_complete(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def locate_checkpoint(run_dir: Path, resume: str) -> tuple[Path | None, list[str], list[Path]]:
    """The checkpoint `--resume` means, warnings about what was skipped, and the invalid checkpoints newer than it
    (to be moved aside). `latest`: the newest checkpoint of the run directory that passes verification (None if there
    is none: the run starts fresh); otherwise a path that must pass it."""
    if resume != "latest":
        path = Path(resume)
        problem = checkpoint_problem(path, verify=True)
        if problem:
            raise ResumeError(f"--resume {path}: not a usable checkpoint: {problem}")
        return path, [], []
    warnings, invalid = [], []
    root = run_dir / "checkpoints"
    for path in sorted(root.glob(".tmp_step_*")):
        warnings.append(f"ignoring {path}: a checkpoint whose save was interrupted")
    for path in reversed(step_dirs(run_dir)):
        problem = checkpoint_problem(path, verify=True)
        if problem is None:
            return path, warnings, invalid
        warnings.append(f"skipping checkpoint {path}: {problem}")
        invalid.append(path)
    return None, warnings, invalid


def checkpoint_step(path: Path) -> int:
    return json.loads((path / COMPLETE).read_text())["step"]


def checkpoint_recipe(path: Path) -> dict:
    return yaml.safe_load((path / "recipe.yaml").read_text())


# --------------------------------------------------------------------------------------------------------------------
# Models


def own_class(model, state_dict: dict, device=None, gathered: bool = False) -> tuple:
    """FSDP2 shards a model in place by swapping its class for a generated `FSDP<Name>` subclass; `save_pretrained`
    would name that class and copy torch's FSDP files as the Hub repo's remote code, and one process cannot run it
    alone. DeepSpeed (`gathered`) keeps the class, but ZeRO-3 leaves each process an empty partition of every
    parameter, and ZeRO-2's state dict is a copy of every tensor. Returns an instance of the model's own class
    holding the gathered weights, and its state dict, in which tied weights (gathered as separate copies) are one
    tensor again. Without `device` the instance is built empty on the meta device and given the tensors (enough to
    save it); with one, it is a whole model there (to run it)."""
    if not (isinstance(model, FSDPModule) or gathered):
        return model, state_dict
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device(device or "meta"):
        plain = cls(model.config)
    plain.load_state_dict(state_dict, assign=device is None)
    plain.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    return plain, plain.state_dict()


def deepspeed(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.DEEPSPEED


def export_pretrained(accelerator, model, tokenizer, out_dir: Path, extra_files: dict[str, str] | None = None) -> None:
    """`save_pretrained` (config, safetensors, generation config) + tokenizer + `extra_files` ({name: text}) into
    `out_dir`, atomically; a model without `save_pretrained` writes its state dict as `model.safetensors`. Call on
    every process: `get_state_dict` gathers sharded weights under FSDP/DeepSpeed."""
    accelerator.wait_for_everyone()
    # torch.compile (whole-model or Accelerate's regional) names parameters `..._orig_mod.x`: export the plain names.
    # DeepSpeed ZeRO-3 gathers the weights on the main process only (None elsewhere).
    gathered = accelerator.get_state_dict(model) or {}
    state_dict = {k.replace("_orig_mod.", ""): v for k, v in gathered.items()}
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
            if is_lora(unwrapped):  # the adapter as PEFT saves it (and a fresh base beside it)
                save_adapter(unwrapped, tmp, state_dict)
            elif hasattr(unwrapped, "save_pretrained"):
                unwrapped, state_dict = own_class(unwrapped, state_dict, gathered=deepspeed(accelerator))
                unwrapped.save_pretrained(tmp, is_main_process=True, state_dict=state_dict)
            else:  # a plain nn.Module of a task of your own: its weights (load_state_dict(load_file(...)))
                tmp.mkdir(parents=True)
                # clone: safetensors refuses tensors sharing storage (tied weights are stored twice)
                save_file({k: v.detach().cpu().clone().contiguous() for k, v in state_dict.items()},
                          tmp / "model.safetensors")
            if tokenizer is not None:  # array data has none
                tokenizer.save_pretrained(tmp)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            replace_dir(tmp, out_dir)  # the previous export stays whole until the new one is in place
        except Exception as e:  # a full disk: OSError, torch's RuntimeError or safetensors' SafetensorError
            shutil.rmtree(tmp, ignore_errors=True)
            if not is_write_error(e):
                raise
            raise CheckpointError(f"could not write model to {out_dir}: {write_error_text(e)}; the previous "
                                  f"{out_dir.name}/ (if any) is intact") from None
    accelerator.wait_for_everyone()
