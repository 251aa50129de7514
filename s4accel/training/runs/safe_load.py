"""Loading a model someone else made, safely: a model directory, a run directory's `final/` (or `best`, `ema`) or a
Hub repo id; config and tokenizer from JSON, weights only from `.safetensors` files inside the model's own folder (or
Hub snapshot), their headers checked against the config, never remote code, nothing unpickled. Used by the tools
(generate, eval, predict) and by a recipe's `model.pretrained`."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import yaml
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

from ..._autoregister import register_auto_classes
from ...data.tokenize import vocab_extent
from ...errors import ModelError
from ...models import MoEConfig, S4Config
from ..callbacks import KeepBest

# What a model directory holds besides the weights; a Hub download fetches only these (no pickles, no code). A
# `.txt` file (a tokenizer vocabulary) is downloaded but never read as weights: only `.safetensors` files are.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.md"]


ADAPTER = ("a LoRA adapter (model.lora), not a whole model: `s4accel export RUN_DIR --merge OUT` writes the base "
           "with the adapter merged, a model to use here")


def resolve_model_dir(ref: str | Path, which: str = "final") -> Path:
    """A model directory (with config.json), the `which` model of a run directory (`final`, `best`, `ema`), or a
    Hub repo id (downloaded, or read from the cache when offline)."""
    return _resolve(ref, which)[0]


def _resolve(ref: str | Path, which: str, revision: str | None = None, adapters: bool = False) -> tuple[Path, Path]:
    """(model directory, the folder its files may live in): the directory itself, or for a Hub snapshot the repo's
    cache folder (a snapshot's files are links into its `blobs/`). `adapters`: a LoRA adapter's folder is an answer
    too (`load_model` merges it into its base); otherwise it is refused."""
    path = Path(ref)
    if path.exists():
        if (path / "config.json").is_file():
            return path, _repo_folder(path)
        if (path / "recipe.yaml").is_file() or (path / "final").is_dir():
            model_dir = run_model_dir(path, which, adapters)
            return model_dir, model_dir
        if (path / "adapter_config.json").is_file():
            if adapters:
                return path, path
            raise ModelError(f"{ref}: {ADAPTER}")
        raise ModelError(f"{ref}: neither a model directory (no config.json) nor a run directory")
    if str(ref).count("/") != 1 or str(ref).startswith((".", "/")):
        raise ModelError(f"{ref}: no such directory (and not a Hub repo id of the form owner/name)")
    try:
        snapshot = Path(snapshot_download(str(ref), allow_patterns=MODEL_FILES, revision=revision))
    except LocalEntryNotFoundError:
        raise ModelError(f"{ref}: not in the local cache and the Hub cannot be reached (HF_HUB_OFFLINE?)") from None
    except HfHubHTTPError as e:
        raise ModelError(f"{ref}: {str(e).splitlines()[0]}") from None
    return snapshot, _repo_folder(snapshot)


def run_model_dir(run_dir: Path, which: str, adapters: bool = False) -> Path:
    """The `which` model of a run directory: `final/`, `final_ema/`, or the best kept by `checkpoint.keep_best`
    (ranked by the run's own `best_metric`)."""
    if which == "best":

        recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text()) if (run_dir / "recipe.yaml").is_file() else {}
        ck = (recipe or {}).get("checkpoint", {})
        ranked = KeepBest(1, ck.get("best_metric", "loss"), ck.get("best_mode", "min")).ranked(run_dir)
        if not ranked:
            raise ModelError(f"{run_dir}: no best model (train with checkpoint.keep_best >= 1)")
        return ranked[0][1]
    folder = run_dir / {"final": "final", "ema": "final_ema"}[which]
    if is_adapter(folder):
        if adapters:
            return folder
        raise ModelError(f"{folder}: {ADAPTER}")
    if not (folder / "config.json").is_file() and not (folder / "model.safetensors").is_file():
        hint = " (train with train.ema set)" if which == "ema" else " (has training finished?)"
        raise ModelError(f"{run_dir}: no {folder.name}/ model{hint}")
    return folder


def _repo_folder(path: Path) -> Path:
    """A snapshot of the Hub cache (`models--owner--name/snapshots/<revision>`) holds links into the repo folder's
    `blobs/`: that folder is where its files may live; any other directory is its own."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent
    return path


def weight_files(model_dir: Path, root: Path) -> list[Path]:
    """The `.safetensors` files holding the weights: `model.safetensors`, or the shards an index names. Each must be
    a `.safetensors` file inside `root`; anything else is refused before it is opened."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelError(f"{index}: not a valid safetensors index (no weight_map)") from None
    elif (model_dir / "model.safetensors").exists():
        names = ["model.safetensors"]
    else:
        raise ModelError(f"{model_dir}: no model.safetensors (s4accel loads weights only from safetensors)")
    inside = root.resolve()
    files = []
    for name in names:
        if not isinstance(name, str) or not name.endswith(".safetensors"):
            raise ModelError(f"{model_dir}: shard {name!r} is not a .safetensors file; s4accel loads weights only "
                             f"from safetensors, never unpickles them")
        path = (model_dir / name).resolve()
        if Path(name).is_absolute() or ".." in Path(name).parts or not path.is_relative_to(inside):
            raise ModelError(f"{model_dir}: shard {name!r} lies outside the model folder; refusing to read it")
        if not path.is_file():
            raise ModelError(f"{model_dir}: shard {name!r} is missing")
        files.append(path)
    return files


def check_weights(model_dir: Path, files: list[Path], config, auto) -> None:
    """The weight files hold exactly the tensors a model of `config` has (tied weights once), with its shapes and a
    floating-point dtype; read from the safetensors headers only."""
    with torch.device("meta"):
        skeleton = auto.from_config(config)
    aliases: dict[int, list[str]] = {}  # tied weights: one tensor, several names; any one of them is enough
    shapes = {}
    for name, t in skeleton.state_dict(keep_vars=True).items():
        aliases.setdefault(id(t), []).append(name)
        shapes[name] = tuple(t.shape)
    found: dict[str, tuple] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as reader:
                for key in reader.keys():
                    piece = reader.get_slice(key)
                    found[key] = (tuple(piece.get_shape()), piece.get_dtype())
        except Exception as e:  # safetensors' SafetensorError: garbage, a truncated file, an absurd header length
            raise ModelError(f"{f.name} in {model_dir}: not a valid safetensors file "
                             f"({str(e).strip().splitlines()[0][:120]})") from None
    problems = []
    missing = [names[0] for names in aliases.values() if not any(n in found for n in names)]
    if missing:
        problems.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    unexpected = [k for k in found if k not in shapes]
    if unexpected:
        problems.append(f"unexpected tensor(s) {', '.join(unexpected[:5])}")
    for key, (shape, dtype) in found.items():
        if key in shapes and shape != shapes[key]:
            problems.append(f"{key} has shape {list(shape)}, the config gives {list(shapes[key])}")
        if dtype not in ("F16", "BF16", "F32", "F64"):
            problems.append(f"{key} holds {dtype.lower().replace('i', 'int', 1)}, not floating-point weights")
    if problems:
        raise ModelError(f"{model_dir}: the weights do not fit the config: {'; '.join(problems[:3])}")


def read_config(model_dir: Path):

    MODEL_TYPES = (S4Config.model_type, MoEConfig.model_type)
    if not (model_dir / "config.json").is_file():  # a custom task's export: its own module, weights alone
        hint = ("; weights without one are a custom task's model, which only its task can build: score it with "
                "`s4accel eval RUN_DIR RECIPE`") if (model_dir / "model.safetensors").is_file() else ""
        raise ModelError(f"{model_dir}: no config.json{hint}")
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except ValueError as e:
        raise ModelError(f"{model_dir / 'config.json'}: not valid JSON ({e})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in MODEL_TYPES:
        raise ModelError(f"{model_dir}: not an s4accel model (model_type {model_type!r}; s4accel loads "
                         f"{', '.join(MODEL_TYPES)})")
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    except Exception as e:  # the config class's own validation (a strict dataclass), or a bad value
        raise ModelError(f"{model_dir / 'config.json'}: {str(e).strip().splitlines()[-1].strip()[:200]}") from None


def load_tokenizer(model_dir: Path):
    """The saved tokenizer (None if there is none), never with remote code: one line for anything that fails."""
    if not (model_dir / "tokenizer_config.json").is_file():
        return None
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except ValueError as e:
        raise ModelError(f"{model_dir / 'tokenizer_config.json'}: not valid JSON ({e})") from None
    if isinstance(config, dict) and config.get("auto_map"):
        raise ModelError(f"{model_dir}: its tokenizer needs remote code (auto_map {config['auto_map']}); s4accel "
                         f"never runs code from a model folder")
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if name and tokenizer_class_from_name(name) is None and tokenizer_class_from_name(name + "Fast") is None:
        raise ModelError(f"{model_dir}: tokenizer: unknown tokenizer_class {name!r} in tokenizer_config.json")
    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except Exception as e:
        raise ModelError(f"{model_dir}: tokenizer: {type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:200]}") from None


def load_model(ref: str | Path, which: str = "final"):
    """(model in eval mode, tokenizer or None, model directory). The model class follows the saved architecture.

    Only `.safetensors` files inside the model's folder are read, after their headers were checked against the
    config (every tensor there, none extra, the right shapes, floating point); the loaded weights must be finite."""

    register_auto_classes()  # our model types, for the Auto classes (idempotent)

    model_dir, root = _resolve(ref, which, adapters=True)
    if is_adapter(model_dir):
        return merged_adapter(model_dir)
    config = read_config(model_dir)
    files = weight_files(model_dir, root)
    arch = (config.architectures or [""])[0]
    auto = AutoModelForSequenceClassification if arch.endswith("ForSequenceClassification") else AutoModelForCausalLM
    check_weights(model_dir, files, config, auto)
    model = auto.from_pretrained(model_dir, config=config, use_safetensors=True, trust_remote_code=False).eval()
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise ModelError(f"{model_dir}: {bad[0]} holds NaN or infinite values; not a usable model")
    tokenizer = load_tokenizer(model_dir)
    extent = vocab_extent(tokenizer) if tokenizer is not None else 0
    if extent > config.vocab_size:  # not the tokenizer it was trained with
        raise ModelError(f"{model_dir}: its tokenizer has ids up to {extent - 1} but the model has "
                         f"vocab_size={config.vocab_size}: not the tokenizer this model was trained with")
    return model, tokenizer, model_dir


def is_adapter(folder: Path) -> bool:
    """A LoRA adapter as PEFT saves it (a run's final/ with `model.lora`), not a whole model."""
    return (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file()


def merged_adapter(folder: Path):
    """(model, tokenizer, folder) for an adapter: its base, loaded as any model is here (the fresh base a run keeps in
    `base/` beside it, or the pretrained folder or Hub id its config names), with the adapter merged in by PEFT, as
    `PeftModel.from_pretrained(base, folder).merge_and_unload()` gives it. Only `adapter_model.safetensors` is read."""
    try:
        import peft
    except ImportError:
        raise ModelError(f"{folder}: a LoRA adapter, which needs peft to load: pip install 's4accel[lora]'") from None
    if not (folder / "adapter_model.safetensors").is_file() or any(folder.glob("*.bin")):
        raise ModelError(f"{folder}: a LoRA adapter without adapter_model.safetensors (s4accel reads adapters only "
                         f"from safetensors)")
    try:
        named = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ModelError(f"{folder / 'adapter_config.json'}: not a PEFT adapter config (no "
                         f"base_model_name_or_path)") from None
    base_ref = folder / "base" if named == "base" else named  # `lora.FRESH_BASE`: the model it was trained on
    base, base_tokenizer, _ = load_model(base_ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on the base's name and its own version: nothing to act on
        model = peft.PeftModel.from_pretrained(base, str(folder)).merge_and_unload().eval()
    return model, load_tokenizer(folder) or base_tokenizer, folder
