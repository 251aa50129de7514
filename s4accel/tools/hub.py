"""`s4accel push`: upload one model of a run directory to the Hub with its card, recipe, metrics and TensorBoard logs,
none of which names a path of the training machine (`portable.py`).

What is uploaded is staged in a temporary directory outside the run directory, which is only read. The token is the
one `huggingface_hub` finds (`HF_TOKEN`, `hf auth login`); it is never printed or written anywhere by s4accel.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import yaml
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

from ..errors import S4AccelError
from ..training.callbacks import KeepBest
from ..training.lora import FRESH_BASE
from .adapter_card import is_adapter, publish_base_name, write_any_card
from .model_card import eval_metrics
from .portable import copy_event_file, machine_path_in, machine_paths, published_hparams

MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".py", ".txt", ".model")  # weights, config, code, tokenizer


class HubError(S4AccelError):
    """The Hub refused or could not be reached; nothing in the run directory changed."""

    exit_code = 1


def _is_transport_error(e: Exception) -> bool:
    """A network failure of the HTTP client huggingface_hub uses (httpx, or its httpx2 fork in huggingface_hub 2)."""
    return any(cls.__module__.split(".")[0] in ("httpx", "httpx2") and cls.__name__ == "TransportError"
               for cls in type(e).__mro__)


def model_dir_of(run_dir: Path, which: str, recipe: dict, records: list[dict]) -> tuple[Path, dict]:
    """The directory of the `which` model of a run (`final`, `best`, `ema`) and its evaluation metrics, given the
    run's recipe and its `metrics.jsonl` records."""
    if which == "best":
        best = recipe.get("checkpoint", {})
        ranked = KeepBest(1, best.get("best_metric", "loss"), best.get("best_mode", "min")).ranked(run_dir)
        if not ranked:
            raise HubError(f"{run_dir}: no best model (train with checkpoint.keep_best >= 1)")
        path = _inside(ranked[0][1], run_dir)
        metrics = _read(path / "metrics.json", run_dir)
        if metrics is None:
            raise HubError(f"{path}: its metrics.json is not a regular file inside the run directory")
        return path, json.loads(metrics)
    path = _inside(run_dir / ("final_ema" if which == "ema" else "final"), run_dir)
    if not (path / "config.json").is_file() and not is_adapter(path):
        hint = " (train with train.ema set)" if which == "ema" else " (has training finished?)"
        raise HubError(f"{run_dir}: no {path.name}/ model{hint}")
    return path, eval_metrics(records, ema=which == "ema")


def _inside(model_dir: Path, run_dir: Path) -> Path:
    if model_dir.is_symlink() or not model_dir.resolve().is_relative_to(run_dir.resolve()):
        raise HubError(f"{model_dir}: a symbolic link out of the run directory; push uploads only what is inside it")
    return model_dir


def _read(path: Path, run_dir: Path) -> str | None:
    """The text of a regular file inside the run directory, else None: whatever push reads (metrics, recipe, the
    card's sources) may end up in the repository, so a link to a key file is never followed."""
    return path.read_text() if _regular(path, run_dir) else None


def _recipe(text: str | None) -> dict:
    return (yaml.safe_load(text) if text else None) or {}


def _metrics(run_dir: Path) -> list[dict]:
    text = _read(run_dir / "metrics.jsonl", run_dir) or ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _regular(path: Path, run_dir: Path) -> bool:
    """A regular file inside the run directory: a symbolic link (to a token file, say) is never uploaded, nor read."""
    if path.is_symlink() or any(p.is_symlink() for p in path.parents if p != run_dir and p.is_relative_to(run_dir)):
        print(f"warning: skipping {path.name}: a symbolic link ({path}); push uploads only regular files inside the "
              f"run directory", file=sys.stderr)
        return False
    return path.is_file() and path.resolve().is_relative_to(run_dir.resolve())


def stage(run_dir: Path, repo_id: str, which: str, out: Path) -> Path:
    """Everything to upload, laid out as the repository: model files, README.md (card), recipe.yaml, metrics.json,
    training_curve.png, runs/ (TensorBoard event files). Only regular files inside the run directory are read."""
    recipe_yaml = _read(run_dir / "recipe.yaml", run_dir) or ""
    recipe, records = _recipe(recipe_yaml), _metrics(run_dir)
    model_dir, metrics = model_dir_of(run_dir, which, recipe, records)
    for f in sorted(model_dir.iterdir()):
        if f.suffix in MODEL_FILE_SUFFIXES and f.name != "metrics.json" and _regular(f, run_dir):
            shutil.copy2(f, out / f.name)
    if is_adapter(out):
        publish_base_name(out)
    base = model_dir / FRESH_BASE  # a LoRA adapter's fresh base, which it means nothing without
    if is_adapter(model_dir) and base.is_dir() and not base.is_symlink():
        (out / FRESH_BASE).mkdir()
        for f in sorted(base.iterdir()):
            if f.suffix in MODEL_FILE_SUFFIXES and _regular(f, run_dir):
                shutil.copy2(f, out / FRESH_BASE / f.name)
    tb = run_dir / "tensorboard"
    if tb.is_dir():
        hparams = published_hparams(recipe)  # the recipe as the run logged it, its paths published as names
        for f in sorted(tb.rglob("events.out.tfevents.*")):
            if not _regular(f, run_dir):
                continue
            target = out / "runs" / f.relative_to(tb)
            target.parent.mkdir(parents=True, exist_ok=True)
            copy_event_file(f, target, hparams)
    missing = incomplete(out)
    if missing:
        raise HubError(f"{model_dir}: {missing}: the push would publish an incomplete model; nothing was pushed")
    write_any_card(out, repo_id, recipe_yaml, records, metrics, which)  # counts the staged weights: regular files
    # The card, recipe and hyperparameters name no path of the machine; anything else that does is not uploaded.
    leak = machine_path_in(out, machine_paths(recipe, run_dir))
    if leak is not None:
        raise HubError(f"{leak[0]} would publish a path of this machine ({leak[1]}); nothing was pushed")
    return out


def incomplete(out: Path) -> str | None:
    """What a staged model lacks to load (weights and config, or an adapter's weights and, for a fresh base, that
    base), or None: a file skipped as a link, or a base folder that is a link out of the run, leaves it so."""
    def weights(folder: Path) -> bool:
        return (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()

    if is_adapter(out):
        if not (out / "adapter_model.safetensors").is_file():
            return "no adapter_model.safetensors (a regular file inside the run directory)"
        config = json.loads((out / "adapter_config.json").read_text())
        if config.get("base_model_name_or_path") == FRESH_BASE and not (
                (out / FRESH_BASE / "config.json").is_file() and weights(out / FRESH_BASE)):
            return f"no whole {FRESH_BASE}/ model beside the adapter (the base it was trained on, which it needs)"
        return None
    if not (out / "config.json").is_file() or not weights(out):
        return "no config.json and model.safetensors (regular files inside the run directory)"
    return None


def push_run(run_dir: str | Path, repo_id: str, private: bool = False, revision: str | None = None,
             which: str = "final", commit_message: str | None = None) -> str:
    """Upload the `which` model of `run_dir` to `repo_id` (created if missing; `revision` branch created if
    missing). Returns the commit URL. Raises HubError with one line on any Hub or network failure."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise HubError(f"{run_dir}: no such run directory")
    if repo_id.count("/") != 1:
        raise HubError(f"--repo-id {repo_id!r}: expected owner/name")
    api = HfApi()
    with tempfile.TemporaryDirectory(prefix="s4accel-push-") as tmp:
        folder = stage(run_dir, repo_id, which, Path(tmp))
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            if revision is not None:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            info = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision,
                                     commit_message=commit_message or f"s4accel push: {run_dir.name} ({which})")
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else "?"
            reason = {401: "the token was refused (check HF_TOKEN or `hf auth login`)",
                      403: "the token may not write to this repository"}.get(status, str(e).splitlines()[0])
            raise HubError(f"push to {repo_id} failed: HTTP {status}: {reason}") from None
        except Exception as e:
            if not (isinstance(e, OSError) or _is_transport_error(e)):
                raise
            raise HubError(f"push to {repo_id} failed: cannot reach {api.endpoint} ({type(e).__name__})") from None
    return str(info.commit_url) if hasattr(info, "commit_url") else str(info)
