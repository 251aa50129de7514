"""The model card of a LoRA adapter (a run with `model.lora`): what it is (an adapter, not a model), its base and how
to load the two together, then the results, training curve and recipe as on a model's card."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, ModelCardData

from ..training.lora import FRESH_BASE
from .model_card import METRIC_NAMES, count_params, dataset_of, hub_datasets, write_card

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file()


def write_any_card(out: Path, repo_id: str, recipe_yaml: str, records: list[dict], metrics: dict,
                   which: str) -> None:
    """`model_card.write_card` beside the files in `out` (README.md, recipe.yaml, metrics.json, the curve); for an
    adapter, README.md is the adapter's card."""
    write_card(out, repo_id, recipe_yaml, records, metrics, which)
    if is_adapter(out):
        recipe = (yaml.safe_load(recipe_yaml) if recipe_yaml else None) or {}
        published = (out / "recipe.yaml").read_text()  # as write_card publishes it: no path of this machine
        (out / "README.md").write_text(adapter_card(out, repo_id, recipe, published, metrics, which,
                                                    (out / "training_curve.png").is_file()))


def publish_base_name(folder: Path) -> None:
    """An adapter's `base_model_name_or_path` that is a folder of this machine becomes the folder's name, as the
    published recipe names it (a Hub id or the fresh `base/` stay as they are)."""
    config_file = folder / ADAPTER_CONFIG
    config = json.loads(config_file.read_text())
    base = config.get("base_model_name_or_path")
    if base and Path(base).is_absolute():
        config["base_model_name_or_path"] = base_folder_name(base)
        config_file.write_text(json.dumps(config, indent=2))


def base_folder_name(base: str) -> str:
    """The name a local base goes by: its run's folder for a run's model (`runs/x/final`, `runs/x/best/step_N`: `x`,
    as the published recipe's `model.pretrained` names it), else the folder's own."""
    path = Path(base)
    if path.name in ("final", "final_ema"):
        return path.parent.name
    if path.parent.name == "best":
        return path.parent.parent.name
    return path.name


def adapter_card(out: Path, repo_id: str, recipe: dict, recipe_yaml: str, metrics: dict, which: str,
                 has_curve: bool) -> str:
    """README.md text for the adapter in `out`: Hub metadata (`library_name: peft`, `base_model` when the base is a
    Hub repo), the base named, the loading code, results, curve and recipe."""
    adapter = json.loads((out / ADAPTER_CONFIG).read_text())
    base = adapter.get("base_model_name_or_path") or "?"
    classifier = adapter.get("task_type") == "SEQ_CLS"
    task = ("text-classification", "Sequence classification") if classifier else ("text-generation",
                                                                                  "Text generation")
    on_hub = base != FRESH_BASE and base.count("/") == 1 and not base.startswith((".", "/")) and \
        not Path(base).exists()
    dataset_name, dataset_type = dataset_of(recipe)
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
    results = [EvalResult(task_type=task[0], task_name=task[1], dataset_type=dataset_type, dataset_name=dataset_name,
                          dataset_split="validation", metric_type=k, metric_name=METRIC_NAMES.get(k, k),
                          metric_value=round(float(v), 6)) for k, v in numbers.items()]
    data = ModelCardData(library_name="peft", pipeline_tag=task[0], model_name=repo_id.split("/")[-1],
                         base_model=base if on_hub else None, tags=["s4accel", "lora", "peft"],
                         eval_results=results or None, datasets=hub_datasets(recipe) or None)
    if base == FRESH_BASE:
        named = ("the freshly initialised model in `base/` of this repository, the one it was trained on (on any "
                 "other initialisation it means nothing)")
        load = f'base = {{auto}}.from_pretrained("{repo_id}", subfolder="base", trust_remote_code=True)'
    elif on_hub:
        named = f"[{base}](https://huggingface.co/{base})"
        load = f'base = {{auto}}.from_pretrained("{base}", trust_remote_code=True)'
    else:
        named = f"the model in `{base_folder_name(base)}`, a local folder where it was trained (push that model " \
                f"too, and load it from there)"
        load = f'base = {{auto}}.from_pretrained("{base_folder_name(base)}", trust_remote_code=True)'
    auto = "AutoModelForSequenceClassification" if classifier else "AutoModelForCausalLM"
    targets = [*(adapter.get("target_modules") or []), *(adapter.get("target_parameters") or [])]
    n_params = count_params(out / "adapter_model.safetensors")
    table = "\n".join(f"| {METRIC_NAMES.get(k, k)} (`{k}`) | {v:.4f} |" for k, v in numbers.items())
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {repo_id.split('/')[-1]}", "",
        f"A **LoRA adapter** (PEFT), not a whole model: low-rank updates (rank {adapter.get('r')}, alpha "
        f"{adapter.get('lora_alpha')}) of {', '.join(f'`{t}`' for t in sorted(targets))}"
        f"{f', {n_params:,} parameters' if n_params else ''}, trained with s4accel on {dataset_name}. Its base "
        f"model is {named}. These are the run's **{which}** weights.",
        "", "## Results", "",
        f"Evaluated (base with adapter) on the held-out validation split at step {metrics.get('step', '?')}:", "",
        "| metric | value |", "|---|---|", table or "| (no evaluation logged) | |", "",
        "## Use", "",
        "```python",
        "from peft import PeftModel",
        f"from transformers import {auto}",
        "",
        load.format(auto=auto),
        f'model = PeftModel.from_pretrained(base, "{repo_id}")',
        "model = model.merge_and_unload()  # optional: a plain model, W + (alpha / r) B A in every adapted weight",
        "```", "",
        "With s4accel installed, `import s4accel` registers the model classes and no remote code is needed; "
        "`s4accel export RUN --merge OUT` writes the merged model from a training checkpoint.", "",
        "## Training", "",
    ]
    if has_curve:
        lines += ["![training curve](training_curve.png)", ""]
    lines += ["TensorBoard event files are under `runs/`, the logged scalars summarised in `metrics.json`.", "",
              "## Recipe", "", "Train it again with `s4accel train recipe.yaml`:", "", "```yaml",
              recipe_yaml.rstrip(), "```", ""]
    return "\n".join(lines)
