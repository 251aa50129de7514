"""Use a trained model: find it (a run directory, a model directory or a Hub repo id), generate text, evaluate it on
a recipe's evaluation split. Loading goes through `s4accel.training.runs.safe_load` (safetensors only, no remote code,
nothing unpickled)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import Recipe
from ..data import data_spec
from ..errors import ModelError
from ..training.ending import finish
from ..training.evaluate import evaluate
from ..training.runs.safe_load import _resolve, load_model, weight_files
from ..training.setup import build_model, build_run, make_accelerator
from ..training.task import load_task


@torch.no_grad()
def generate_text(ref: str | Path, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_p: float | None = None, top_k: int | None = None, seed: int = 0) -> str:
    """Complete `prompt` with the model's `generate()`: sampling at `temperature` (0: greedy), seeded."""
    model, tokenizer, model_dir = load_model(ref)
    if tokenizer is None or not hasattr(model, "generate"):
        raise ModelError(f"{model_dir}: not a language model with a tokenizer; generate needs one")
    torch.manual_seed(seed)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    if ids.shape[1] == 0:  # an empty prompt: a new document, which in training followed a document's end
        ids = torch.tensor([[tokenizer.eos_token_id]])
    if torch.accelerator.is_available():  # the GPU when there is one
        device = torch.accelerator.current_accelerator()
        model, ids = model.to(device), ids.to(device)
    sampling = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p or 1.0, "top_k": top_k or 0}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id, **sampling)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def evaluate_model(ref: str | Path, recipe: Recipe, which: str = "final", data: str | Path | None = None) -> dict:
    """A saved model scored with the recipe's task: its metrics over the whole evaluation split and each of
    `data.eval_sets` (`<name>/<metric>`; never capped by `train.eval_max_batches`, so any number of processes gives
    the same numbers), or over `data` alone (a file or folder of the same kind). A built-in task's model loads
    through the safe loader; a task of your own builds its model and loads the folder's `model.safetensors` into
    it."""

    recipe = _scoring(recipe, data)
    model_dir = _resolve(ref, which, adapters=True)[0]
    builtin = recipe.task.builtin
    if builtin and recipe.data.is_text and recipe.data.tokenizer == "bpe" and \
            not (model_dir / "tokenizer.json").is_file():
        raise ModelError(f"{model_dir}: the recipe uses a BPE tokenizer but the model has none saved")
    if builtin:
        check_model_kind(model_dir, recipe)
    task = load_task(recipe, **({"tokenizer_dir": model_dir} if builtin and recipe.data.is_text else {}))

    def trained(task):  # the saved model in place of a new one, once the data is built
        if not builtin:
            return _own_model(task, recipe, model_dir)
        model = load_model(ref, which)[0]
        for key, value in data_spec(recipe.data, task.data).items():
            if key in ("vocab_size", "d_input", "num_labels") and getattr(model.config, key, None) != value:
                raise ModelError(f"{model_dir}: the model has {key}={getattr(model.config, key, None)} but the "
                                 f"recipe's data gives {value}: not the data this model was trained on")
        return model

    accelerator = make_accelerator(recipe, trackers=False)  # the precision the run evaluated in
    with tempfile.TemporaryDirectory(prefix="s4accel-eval-") as tmp:
        run = build_run(recipe, accelerator, Path(tmp), task=task, model=trained, optimizers=False)
    evals = run.evaluation_loaders()  # the evaluation split, then data.eval_sets by name
    model, *loaders = accelerator.prepare(run.model, *evals.values())
    del run
    metrics = evaluate(accelerator, task, model, dict(zip(evals, loaders)), progress=True)
    del model, loaders
    finish(accelerator)
    return metrics


def check_model_kind(model_dir: Path, recipe: Recipe) -> None:
    """A model of another kind than the recipe trains (a language model scored on a classifier's recipe, a text
    model on number sequences) is one line, from its config.json alone, before the data is read."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # loading the model reports it
    heads = " ".join(config.get("architectures") or [])
    model = ("a language model" if "ForCausalLM" in heads else "a sequence classifier" if
             "ForSequenceClassification" in heads else None)
    model_input = "number sequences" if config.get("d_input") is not None else "text"
    wanted = "a language model" if recipe.data.is_lm else "a sequence classifier"
    recipe_input = "text" if recipe.data.is_text else "number sequences"
    if model is None or (model, model_input) == (wanted, recipe_input):
        return
    raise ModelError(f"{model_dir}: {model} of {model_input} ({heads}) cannot be scored with this recipe, which "
                     f"trains {wanted} of {recipe_input} (data.source {recipe.data.source!r}); use the recipe it was "
                     f"trained with (its run directory's recipe.yaml)")


def _scoring(recipe: Recipe, data) -> Recipe:
    """The recipe to score with: its evaluation split whole, or `data` as the evaluation split."""
    updates = {"train": recipe.train.model_copy(update={"eval_max_batches": None})}
    if data is not None:
        d = recipe.data
        if d.source.startswith("lra_"):
            raise ModelError(f"--data: data.source {d.source!r} reads the LRA release's own splits; score its test "
                             f"split with --set data.val_split=test")
        if d.is_text:
            new = d.model_copy(update={"val_files": [str(data)], "val_split": None, "eval_sets": {}})
        elif d.source == "arrays":
            new = d.model_copy(update={"files": [d.files[0], str(data)], "eval_sets": {}})
        else:
            raise ModelError(f"--data: data.source {d.source!r} has its own test split; --data needs a source of "
                             f"files (documents, or source: arrays)")
        updates["data"] = new
    return recipe.model_copy(update=updates)


def _own_model(task, recipe: Recipe, model_dir: Path):
    """A task of your own: its model, with the folder's weights (safetensors only), every tensor matched."""

    model = build_model(task, recipe)
    state = {}
    for f in weight_files(model_dir, model_dir):
        state.update(load_file(f))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ModelError(f"{model_dir}: the weights do not fit {type(task).__name__}'s model: "
                         f"{str(e).strip().splitlines()[-1].strip()[:300]}") from None
    return model.eval()
