"""`s4accel eval MODEL --lm-eval TASKS`: a trained language model scored by EleutherAI's lm-evaluation-harness
(`pip install 's4accel[lm_eval]'`) through its `hf` model (`HFLM`), the model loaded by s4accel's safe loader.

What HFLM needs told about s4accel's tokenizers: neither has a BOS token, and the byte one (transformers'
`ByT5Tokenizer`) appends `</s>` to every encoding made with special tokens, HFLM's default. A context `c` and
`c + continuation` then both end in `</s>`, so every continuation lost its first byte and had `</s>` scored in its
place (measured: 4.8 nats off per choice on a tiny model), and every generation prompt ended with a document end.
`add_bos_token=False` turns special tokens off in all of HFLM's encodings; with no BOS, HFLM conditions an empty
context on `</s>`, the token every document followed in training. Loglikelihood batches are right-padded and need
no mask (both model families are causal); generation batches are left-padded with an `attention_mask`, which both
families honour.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
from pathlib import Path

import torch

from ..errors import ModelError
from ..training.runs.safe_load import load_model


def lm_eval_model(ref: str | Path, tasks: list[str], include_path: str | Path | list[str | Path] | None = None,
                  limit: int | None = None, batch_size: int = 8, num_fewshot: int | None = None,
                  log_samples: bool = False) -> dict:
    """lm-eval's `simple_evaluate` result for a saved language model (`ref`: a model, run or Hub id) on `tasks`
    (names, or tasks defined by YAML files under `include_path`, one folder or several): `result["results"][task]`
    holds the metrics, `result["samples"][task]` each request and response when `log_samples`."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ModelError("--lm-eval needs lm-evaluation-harness: pip install 's4accel[lm_eval]'") from None

    model, tokenizer, model_dir = load_model(ref)
    if tokenizer is None or not hasattr(model, "generate"):
        raise ModelError(f"{model_dir}: not a language model with a tokenizer; lm-eval scores language models")
    if torch.accelerator.is_available():  # the GPU when there is one
        model = model.to(torch.accelerator.current_accelerator())
    folders = [] if include_path is None else [include_path] if isinstance(include_path, (str, Path)) else include_path
    manager = TaskManager(include_path=[str(f) for f in folders] or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" nor under {', '.join(map(str, folders))}" if folders else " (--include-path: a folder of YAMLs)"
        raise ModelError(f"--lm-eval: no task {', '.join(map(repr, unknown))} among lm-eval's tasks{where}")
    specs = [task_spec(manager, task) for task in tasks]
    # HFLM warns that a model passed in loaded (`pretrained` not a str) ignores its loading options: s4accel loaded
    # it on purpose. The git call lm-eval makes for its report prints "fatal: not a git repository" outside one.
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    with _quiet_git(lm_eval):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", add_bos_token=False, batch_size=batch_size)
        return lm_eval.simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=limit,
                                       num_fewshot=num_fewshot, log_samples=log_samples)


def task_spec(manager, task: str) -> str | dict:
    """The task as lm-eval is handed it: its name, or, where its YAML names local data files by relative paths, its
    whole config with those paths found. lm-eval reads them from the current folder only; here a path is looked for
    there, then beside the task's YAML and in the folders above it (the example tasks name theirs from the
    repository root). A file found nowhere, or empty, is one line naming the task's YAML."""
    entry = manager.task_index.get(task)
    path = Path(entry.yaml_path) if entry is not None and getattr(entry, "yaml_path", None) else None
    if path is None:
        return task
    try:
        from lm_eval.tasks._yaml_loader import load_yaml  # not public: without it, the name as before
    except ImportError:
        return task
    config = load_yaml(path, resolve_func=True)
    kwargs = config.get("dataset_kwargs") or {}
    files = kwargs.get("data_files")
    if not files or config.get("dataset_path") not in ("json", "csv", "parquet", "text", "arrow"):
        return task

    def found(name: str) -> str:
        if "://" in name:
            return name
        places = [Path.cwd(), path.parent, *path.parent.parents]
        hit = next((p / name for p in places if (p / name).is_file()), None)
        if hit is None:
            raise ModelError(f"--lm-eval: task {task} ({path}): data_files: no file {name} (looked in the current "
                             f"folder, beside the task's YAML and in the folders above it)")
        if hit.stat().st_size == 0:
            raise ModelError(f"--lm-eval: task {task} ({path}): data_files: {hit} is empty")
        return str(hit.resolve())

    def each(value):
        if isinstance(value, dict):
            return {k: each(v) for k, v in value.items()}
        return [found(v) for v in value] if isinstance(value, list) else found(value)

    return {**config, "dataset_kwargs": {**kwargs, "data_files": each(files)}}


@contextlib.contextmanager
def _quiet_git(lm_eval):
    """lm-eval's report asks git for the current folder's commit; outside a repository git prints "fatal: not a git
    repository" on the console. The same question, with git's complaints left out (lm-eval keeps None then)."""
    from lm_eval import evaluator

    def commit():
        try:
            out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() or None if out.returncode == 0 else None

    original = getattr(evaluator, "get_git_commit_hash", None)
    if original is None:
        yield
        return
    evaluator.get_git_commit_hash = commit
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original
