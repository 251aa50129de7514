"""The built-in tasks: next-token prediction on text (`causal_lm`) and one label per sequence (`classification`),
and the one way a model is built from a recipe: its named size + `model.overrides` + what the data decides
(vocabulary and special ids, input width, labels)."""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path

import torch

from ..config import ModelCfg
from ..config.sizes import FAMILIES, MODEL_SIZES
from ..errors import RecipeError
from .task import Task, TaskData, count_items

class CausalLMTask(Task):
    """Next-token prediction on text (`data.source: shakespeare | files`) with an S4 or MoE causal LM. The loss is the
    mean over real target tokens; stateful training (`train.state`) carries the recurrent state across chunks."""

    metric_names = ("loss", "ppl", "bits_per_byte", "bits_per_char")

    def __init__(self, recipe, tokenizer_dir: Path | None = None):
        super().__init__(recipe)
        self.tokenizer_dir = tokenizer_dir  # a trained BPE is saved here (or read from here when present)
        self.carried = None

    def build_data(self) -> TaskData:
        from ..data import build_data, collate_lm, token_byte_and_char_counts

        tok_dir = self.tokenizer_dir or (self.build_dir / "tokenizer" if self.build_dir else None)
        self.data = build_data(self.recipe.data, tokenizer_dir=tok_dir)
        counts = token_byte_and_char_counts(self.data.tokenizer)
        self.token_bytes, self.token_chars = (t.to(self.accelerator.device) for t in counts)
        return TaskData(self.data.train, self.data.val, collate_lm, self.data.tokenizer, "tokens",
                        self.data.n_train_tokens, self.data.n_val_tokens)

    def build_model(self):
        return build_model(self.recipe, self.data)

    def summary_model(self):
        return build_model(self.recipe, None, device="meta")

    def dataloaders(self, data: TaskData):
        train_dl, val_dl = super().dataloaders(data)
        if self.recipe.train.state.mode != "none":  # fixed rows per process in text order: a sharded
            # loader would hand a process another row's continuation
            from ..data import stream_loader
            from .carried_state import CarriedState

            acc, d = self.accelerator, self.recipe.data
            train_dl = stream_loader(data.train, d.batch_size, acc.num_processes, acc.process_index, d.num_workers)
            self.prepare_train_loader = False
            self.carried = CarriedState(self.recipe.train.state, acc)
        return train_dl, val_dl

    def training_step(self, model, batch, step):
        return model(**batch) if self.carried is None else self.carried.forward(model, batch)

    def count_items(self, batch):
        return count_items(batch)

    def count_units(self, batch):
        return batch["input_ids"].numel()

    def validation_step(self, model, batch):
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]  # (B, L-1, V), position t predicts t + 1
        targets = batch["labels"][:, 1:]  # (B, L-1)
        mask = targets != -100
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none",
                                                ignore_index=-100)
        safe = targets.clamp(min=0)
        return {"nll": nll.sum(1), "tokens": mask.sum(1), "bytes": (self.token_bytes[safe] * mask).sum(1),
                "chars": (self.token_chars[safe] * mask).sum(1)}

    def compute_metrics(self, sums, count):
        nll = sums["nll"]
        loss = nll / max(sums["tokens"], 1)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)),
                "bits_per_byte": nll / math.log(2) / max(sums["bytes"], 1),
                "bits_per_char": nll / math.log(2) / max(sums["chars"], 1)}

    def stateful(self):
        return [self.carried] if self.carried is not None else []

    def on_validation_end(self):
        if self.carried is not None:
            self.carried.reset()  # the streams' state restarts after an evaluation

    def on_train_end(self, model):
        from .samples import write_samples

        self.samples = write_samples(self.accelerator, model, self.data.tokenizer, self.recipe, self.run_dir)


class SequenceClassificationTask(Task):
    """One label per sequence (`data.source: digits | ucr | arrays`): cross-entropy and accuracy, or for regression
    (`data.task: regression`) the mean squared error, with mse and mae."""

    metric_names = ("loss", "accuracy", "mse", "mae")

    def build_data(self) -> TaskData:
        from ..data import build_array_data, collate_arrays

        self.data = build_array_data(self.recipe.data)
        return TaskData(self.data.train, self.data.val, collate_arrays, None, "time steps",
                        self.data.n_train_tokens, self.data.n_val_tokens)

    def build_model(self):
        return build_model(self.recipe, self.data)

    def summary_model(self):
        return build_model(self.recipe, None, device="meta")

    def training_step(self, model, batch, step):
        return model(**batch)

    def count_units(self, batch):
        return batch["input_values"].shape[0] * batch["input_values"].shape[1]

    def validation_step(self, model, batch):
        logits = model(input_values=batch["input_values"]).logits.float()  # (B, num_labels)
        labels = batch["labels"]
        if self.accelerator.unwrap_model(model).config.problem_type == "regression":
            err = logits[:, 0] - labels.float()
            return {"sq_err": err**2, "abs_err": err.abs()}
        return {"nll": torch.nn.functional.cross_entropy(logits, labels, reduction="none"),
                "hit": (logits.argmax(-1) == labels).float()}

    def compute_metrics(self, sums, count):
        n = max(count, 1)
        if "sq_err" in sums:
            return {"loss": sums["sq_err"] / n, "mse": sums["sq_err"] / n, "mae": sums["abs_err"] / n}
        return {"loss": sums["nll"] / n, "accuracy": sums["hit"] / n}


def build_model(recipe, data, device=None):
    """A freshly initialised model from the registry size + overrides, fitted to the data: a causal LM sized to the
    tokenizer (text), or a sequence classifier/regressor sized to the features and labels (arrays). `data` None: what
    the recipe alone tells (the byte tokenizer's or the BPE's size; array files are read); `device` "meta": shapes
    only."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ..data import data_spec

    config = model_config(recipe.model, **data_spec(recipe.data, data))
    auto = AutoModelForCausalLM if recipe.data.is_text else AutoModelForSequenceClassification
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return auto.from_config(config)


def model_config(cfg: ModelCfg, **tokenizer_fields):
    """The family's `PreTrainedConfig` for a named size + `cfg.overrides` + the tokenizer's fields (vocab size, special
    ids). Override keys were checked by `ModelCfg`; types and values are checked here by the config class itself (a
    `@strict` dataclass with `validate_*` methods)."""
    import importlib

    spec = dict(MODEL_SIZES[cfg.name])
    module, cls = FAMILIES[spec.pop("family")][0].split(":")
    config_cls = getattr(importlib.import_module(f"s4accel.models.{module}"), cls)
    try:
        return config_cls(**{**spec, **cfg.overrides, **tokenizer_fields})
    except Exception as e:  # huggingface_hub's StrictDataclass*Error ("...:\n    TypeError: ..."), or a ValueError
        where = re.match(r"Validation error for field '(\w+)'", str(e))
        path = f"model.overrides.{where[1]}" if where else f"model.overrides ({cfg.name})"
        detail = str(e).strip().splitlines()[-1].strip().split(": ", 1)[-1]
        raise RecipeError(f"{path}: {detail}") from None
