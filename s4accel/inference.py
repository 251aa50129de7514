"""Use a trained model: find it (a run directory, a model directory or a Hub repo id), generate text, evaluate it on
a recipe's evaluation split.

Loading is safe by construction: config and tokenizer from JSON, weights only from `model.safetensors`
(`use_safetensors=True`), never remote code (`trust_remote_code=False`), nothing unpickled.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import Recipe
from .errors import ModelError

# What a model directory holds besides the weights; a Hub download fetches only these (no pickles, no code).
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.md"]


def resolve_model_dir(ref: str | Path, which: str = "final") -> Path:
    """A model directory (with config.json), the `which` model of a run directory (`final`, `best`, `ema`), or a
    Hub repo id (downloaded, or read from the cache when offline)."""
    path = Path(ref)
    if path.exists():
        if (path / "config.json").is_file():
            return path
        if (path / which / "config.json").is_file():
            return path / which
        raise ModelError(f"{ref}: neither a model directory (no config.json) nor a run directory with {which}/")
    if str(ref).count("/") != 1 or str(ref).startswith((".", "/")):
        raise ModelError(f"{ref}: no such directory (and not a Hub repo id of the form owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(ref), allow_patterns=MODEL_FILES))
    except LocalEntryNotFoundError:
        raise ModelError(f"{ref}: not in the local cache and the Hub cannot be reached (HF_HUB_OFFLINE?)") from None
    except HfHubHTTPError as e:
        raise ModelError(f"{ref}: {str(e).splitlines()[0]}") from None


def load_model(ref: str | Path, which: str = "final"):
    """(model in eval mode, tokenizer or None, model directory). The model class follows the saved architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    import s4accel  # noqa: F401  (registers our model types with the Auto classes)

    model_dir = resolve_model_dir(ref, which)
    if not (model_dir / "model.safetensors").is_file() and not (model_dir / "model.safetensors.index.json").is_file():
        raise ModelError(f"{model_dir}: no model.safetensors (s4accel loads weights only from safetensors)")
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except ValueError as e:
        raise ModelError(f"{model_dir}: not a model s4accel knows ({str(e).splitlines()[0]})") from None
    arch = (config.architectures or [""])[0]
    auto = AutoModelForSequenceClassification if arch.endswith("ForSequenceClassification") else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, config=config, use_safetensors=True, trust_remote_code=False).eval()
    tokenizer = None
    if (model_dir / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    return model, tokenizer, model_dir


@torch.no_grad()
def generate_text(ref: str | Path, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_p: float | None = None, top_k: int | None = None, seed: int = 0) -> str:
    """Complete `prompt` with the model's `generate()`: sampling at `temperature` (0: greedy), seeded."""
    model, tokenizer, model_dir = load_model(ref)
    if tokenizer is None or not hasattr(model, "generate"):
        raise ModelError(f"{model_dir}: not a language model with a tokenizer; generate needs one")
    torch.manual_seed(seed)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    sampling = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p or 1.0, "top_k": top_k or 0}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id, **sampling)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def evaluate_model(ref: str | Path, recipe: Recipe, which: str = "final") -> dict:
    """The recipe's evaluation split and metrics (its built-in task's, gathered across processes) on a saved model."""
    from accelerate import Accelerator

    from .data import data_spec
    from .tasks import load_task
    from .trainer import evaluate

    if not recipe.task.builtin:
        raise ModelError(f"s4accel eval runs the built-in tasks; {recipe.task.target} is not one")
    model, _, model_dir = load_model(ref, which)
    if recipe.data.is_text and recipe.data.tokenizer == "bpe" and not (model_dir / "tokenizer.json").is_file():
        raise ModelError(f"{model_dir}: the recipe uses a BPE tokenizer but the model has none saved")
    task = load_task(recipe, **({"tokenizer_dir": model_dir} if recipe.data.is_text else {}))
    task.accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    data = task.task_data = task.build_data()
    for key, value in data_spec(recipe.data, task.data).items():
        if key in ("vocab_size", "d_input", "num_labels") and getattr(model.config, key, None) != value:
            raise ModelError(f"{model_dir}: the model has {key}={getattr(model.config, key, None)} but the recipe's "
                             f"data gives {value}: not the data this model was trained on")
    _, val_dl = task.dataloaders(data)
    model, val_dl = task.accelerator.prepare(model, val_dl)
    return evaluate(task.accelerator, task, model, val_dl)
