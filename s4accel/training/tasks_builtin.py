"""The built-in tasks: next-token prediction on text (`causal_lm`) and one label per sequence (`classification`),
and the one way a model is built from a recipe: its named size + `model.overrides` + what the data decides
(vocabulary and special ids, input width, labels)."""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from ..config import ModelCfg
from ..config.sizes import MODEL_SIZES
from ..data import (build_array_data, build_data, build_labelled_text, collate_arrays, collate_labelled_text,
                    data_spec, lm_collate, stream_loader,
                    token_byte_and_char_counts)
from ..errors import RecipeError
from ..models import MoEConfig, S4Config
from .carried_state import CarriedState
from .observe.class_scores import classification_scores
from .label_smoothing import smooth_lm_loss, smoothed_classification_loss
from .lora import apply_lora, require_peft
from .pretrained import load_pretrained, locate, pretrained_config
from .samples import write_samples
from .task import Loaders, Task, TaskData, count_items


PREPROCESSING = "preprocessing.json"
"""Written next to an exported model by the built-in tasks: how raw data becomes the model's input (the data kind,
the columns read, the block or truncation length), for `s4accel predict` and `eval` to read new data the same way.
The tokenizer is saved beside it, label names and input statistics live in the model's config."""


def preprocessing(recipe) -> str:
    d = recipe.data
    kind = "text" if d.is_lm else "labelled_text" if d.is_text else "arrays"
    return json.dumps({"kind": kind, "text_field": d.text_field, "label_field": d.label_field, "seq_len": d.seq_len,
                       "task": d.task if kind == "arrays" else "classification" if kind == "labelled_text" else
                       "causal_lm"}, indent=1)


class BuiltinTask(Task):
    """What the built-in tasks share: the model's config checked when the task is made, the preprocessing record
    exported with the model."""

    def __init__(self, recipe, **args):
        super().__init__(recipe, **args)
        if recipe.model.pretrained is None:
            # The config class checks the overrides' types and values: a bad one is a recipe error now, before the
            # data is read and tokenised (the sizes the data fixes, such as the vocabulary, are not overrides).
            model_config(recipe.model)
        if recipe.model.lora is not None:
            require_peft()  # before the data is read: a missing optional dependency is a recipe error now

    def export(self, model, out_dir, extra_files=None):
        super().export(model, out_dir, {PREPROCESSING: preprocessing(self.recipe), **(extra_files or {})})


class CausalLMTask(BuiltinTask):
    """Next-token prediction on documents (`data.source: shakespeare | files | dataset`, or a mixture, map-style or
    streamed) with an S4 or MoE causal LM. The loss is the mean over real target tokens; stateful training
    (`train.state`) carries the recurrent state across chunks. Bits per byte and per character are reported for a
    byte-level tokenizer (byte, BPE, a byte-level tokenizer of your own), whose tokens are whole bytes; for any other
    they cannot be computed from the tokens, and only loss and perplexity are."""

    metric_names = ("loss", "ppl", "bits_per_byte", "bits_per_char")

    def __init__(self, recipe, tokenizer_dir: Path | None = None):
        super().__init__(recipe)
        self.tokenizer_dir = tokenizer_dir  # a trained BPE is saved here (or read from here when present)
        self.carried = None  # stateful training's carried state
        self.stream = None  # data.streaming's token stream

    def build_data(self) -> TaskData:
        acc = self.accelerator
        tok_dir = self.tokenizer_dir or (self.build_dir / "tokenizer" if self.build_dir else None)
        self.data = build_data(self.recipe.data, tokenizer_dir=tok_dir, seed=self.recipe.run.seed,
                               rank=acc.process_index, world_size=acc.num_processes)
        counts = token_byte_and_char_counts(self.data.tokenizer)
        self.token_bytes, self.token_chars = (None, None) if counts is None else (t.to(acc.device) for t in counts)
        if counts is None:
            acc.print(f"note: {self.recipe.data.tokenizer} is not a byte-level tokenizer: bits per byte and per "
                      f"character cannot be computed from its tokens; evaluation reports loss and perplexity")
        for note in self.data.notes:
            acc.print(f"note: {note}")
        if self.data.source_tokens:  # a mixture: how much of each source one pass over the training blocks holds
            total = sum(self.data.source_tokens.values())
            acc.print("data mixture: " + ", ".join(f"{k} {v:,} tokens ({v / total:.1%})"
                                                   for k, v in self.data.source_tokens.items()))
        self.stream = self.data.train if getattr(self.data.train, "resumable", False) else None
        if self.stream is not None:
            self.stream.accelerator = acc  # an earlier version's per-process state is gathered into checkpoints
        if self.recipe.train.state.mode != "none":  # the rows' recurrent state, carried from chunk to chunk
            self.carried = CarriedState(self.recipe.train.state, acc)
        # where each document starts, for the model to read it alone (data.packing: isolated)
        self.collate = lm_collate(self.recipe.data, self.data.tokenizer.eos_token_id)
        return TaskData(self.data.train, self.data.val, self.collate, self.data.tokenizer, "tokens",
                        self.data.n_train_tokens, self.data.n_val_tokens, self.data.eval_sets)

    def build_model(self):
        model = build_model(self.recipe, self.data, say=self.accelerator.print)
        smooth_lm_loss(model, self.recipe.train.label_smoothing)  # the training loss only: evaluation's is its own
        return model

    def summary_model(self):
        return build_model(self.recipe, None, device="meta")

    def dataloaders(self, data: TaskData):
        train_dl, val_dl, _ = super().dataloaders(data)
        if self.stream is not None:  # every process takes its own blocks of the stream already: not sharded again
            return Loaders(train_dl, val_dl, shard_train=False)
        if self.recipe.train.state.mode != "none":  # fixed rows per process in text order: a sharded
            # loader would hand a process another row's continuation
            acc, d = self.accelerator, self.recipe.data
            eos = self.data.tokenizer.eos_token_id if d.packing == "isolated" else None  # chunks told if they continue
            train_dl = stream_loader(data.train, d.batch_size, acc.num_processes, acc.process_index, d.num_workers,
                                     self.collate, eos)
            return Loaders(train_dl, val_dl, shard_train=False)
        return Loaders(train_dl, val_dl)

    def training_step(self, model, batch, step):
        return model(**batch) if self.carried is None else self.carried.forward(model, batch)

    def count_items(self, batch):
        return count_items(batch)

    def count_units(self, batch):
        return batch["input_ids"].numel()

    def validation_step(self, model, batch):
        logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits[:, :-1]
        # (B, L-1, V): position t predicts t + 1
        targets = batch["labels"][:, 1:]  # (B, L-1)
        mask = targets != -100
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none",
                                                ignore_index=-100)
        out = {"nll": nll.sum(1), "tokens": mask.sum(1)}
        if self.token_bytes is not None:
            safe = targets.clamp(min=0)
            out.update(bytes=(self.token_bytes[safe] * mask).sum(1), chars=(self.token_chars[safe] * mask).sum(1))
        return out

    def compute_metrics(self, sums, count):
        nll = sums["nll"]
        loss = nll / max(sums["tokens"], 1)
        metrics = {"loss": loss, "ppl": math.exp(min(loss, 50.0))}
        if "bytes" in sums:
            metrics.update(bits_per_byte=nll / math.log(2) / max(sums["bytes"], 1),
                           bits_per_char=nll / math.log(2) / max(sums["chars"], 1))
        return metrics

    def stateful(self):
        return [obj for obj in (self.carried, self.stream) if obj is not None]

    def on_validation_end(self):
        if self.carried is not None:
            self.carried.reset()  # the streams' state restarts after an evaluation

    def on_train_end(self, model):
        if self.stream is not None and len(self.stream.labels) > 1:
            seen, by = self.stream.tokens_seen()
            self.accelerator.print(f"data mixture, tokens trained on ({by}): " + ", ".join(
                f"{k} {v:,}" for k, v in seen.items()))
        self.samples = write_samples(self.accelerator, model, self.data.tokenizer, self.recipe, self.run_dir)


class SequenceClassificationTask(BuiltinTask):
    """One label per sequence: labelled documents (`data.label_field`, token ids with padding masked) or sequences of
    numbers (`data.source: digits | ucr | arrays`); cross-entropy, accuracy, macro-F1, each class's precision and
    recall (`precision/<class>`) and the confusion matrix, from every sample's prediction gathered from all
    processes; or for regression (`data.task: regression`) the mean squared error, with mse and mae. The recipe's own
    metrics (`task.metrics`) get the predicted and true classes (values, for regression)."""

    metric_names = ("loss", "accuracy", "f1_macro", "mse", "mae")
    gathered = ("prediction", "label")

    def __init__(self, recipe, tokenizer_dir: Path | None = None):
        super().__init__(recipe)
        self.tokenizer_dir = tokenizer_dir  # a trained BPE is saved here (or read from here when present)

    def build_data(self) -> TaskData:
        cfg = self.recipe.data
        if cfg.is_text:
            tok_dir = self.tokenizer_dir or (self.build_dir / "tokenizer" if self.build_dir else None)
            self.data = build_labelled_text(cfg, tok_dir)
            return TaskData(self.data.train, self.data.val, collate_labelled_text(self.data.pad_token_id),
                            self.data.tokenizer, "tokens", self.data.n_train_tokens, self.data.n_val_tokens,
                            self.data.eval_sets)
        self.data = build_array_data(cfg)
        return TaskData(self.data.train, self.data.val, collate_arrays, None, "time steps",
                        self.data.n_train_tokens, self.data.n_val_tokens, self.data.eval_sets)

    def build_model(self):
        return build_model(self.recipe, self.data, say=self.accelerator.print)

    def summary_model(self):
        return build_model(self.recipe, None, device="meta")

    def training_step(self, model, batch, step):
        smoothing = self.recipe.train.label_smoothing
        if not smoothing:
            return model(**batch)
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        return smoothed_classification_loss(logits, batch["labels"], smoothing)

    def count_units(self, batch):
        if "attention_mask" in batch:  # real tokens, padding aside
            return int(batch["attention_mask"].sum())
        return batch["input_values"].shape[0] * batch["input_values"].shape[1]

    def validation_step(self, model, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits.float()  # (B, num_labels)
        labels = batch["labels"]
        if self.accelerator.unwrap_model(model).config.problem_type == "regression":
            err = logits[:, 0] - labels.float()
            return {"sq_err": err**2, "abs_err": err.abs(), "prediction": logits[:, 0].double(),
                    "label": labels.double()}
        predicted = logits.argmax(-1)
        return {"nll": torch.nn.functional.cross_entropy(logits, labels, reduction="none"),
                "hit": (predicted == labels).float(), "prediction": predicted, "label": labels}

    def compute_metrics(self, sums, count):
        n = max(count, 1)
        if "sq_err" in sums:
            return {"loss": sums["sq_err"] / n, "mse": sums["sq_err"] / n, "mae": sums["abs_err"] / n}
        names = self.data.class_names or [str(i) for i in range(self.data.num_labels)]
        return {"loss": sums["nll"] / n, "accuracy": sums["hit"] / n,
                **classification_scores(sums["prediction"], sums["label"], [str(c) for c in names])}


def build_model(recipe, data, device=None, say=None, spec: dict | None = None):
    """The recipe's model fitted to the data: a causal LM sized to the tokenizer (documents), or a sequence classifier
    or regressor sized to the labels (labelled documents, arrays). From the registry size + overrides, freshly
    initialised; or with `model.pretrained`, the pretrained config and weights (`say` gets the one-line report of
    what was loaded); with `model.lora`, a PEFT model of it (`say` gets the coverage report). `data` None: what the
    recipe alone tells (the byte tokenizer's or the BPE's size; labels and array files are read); `device` "meta":
    shapes only, nothing loaded. `spec`: the data's fields given instead."""

    spec = spec if spec is not None else data_spec(recipe.data, data)
    if recipe.model.pretrained is not None:
        model_dir, root = locate(recipe.model)
        config = pretrained_config(recipe.model, spec, model_dir)
    else:
        config = model_config(recipe.model, **spec)
    auto = AutoModelForCausalLM if recipe.data.is_lm else AutoModelForSequenceClassification
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = auto.from_config(config)
    if recipe.model.pretrained is not None and device != "meta":
        report = load_pretrained(model, recipe.model, model_dir, root, HEADS[recipe.data.is_lm])
        if say is not None:
            say(report)
    if recipe.model.lora is not None:  # the adapters on the built (and loaded) model, created on its device
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = apply_lora(model, recipe.model, recipe.data.is_lm, say)
    return model


CONFIG_CLASSES = {"s4": S4Config, "moe": MoEConfig}
"""Each family's config class (`config.sizes.FAMILIES` names them for the recipe checks that import no torch)."""

HEADS = {True: ["lm_head.*"], False: ["score.*"]}
"""The head of a causal LM and of a classifier: what may start untrained by default with `model.pretrained`."""


def model_config(cfg: ModelCfg, **tokenizer_fields):
    """The family's `PreTrainedConfig` for a named size + `cfg.overrides` + the tokenizer's fields (vocab size, special
    ids). Override keys were checked by `ModelCfg`; types and values are checked here by the config class itself (a
    `@strict` dataclass with `validate_*` methods)."""
    spec = dict(MODEL_SIZES[cfg.name])
    config_cls = CONFIG_CLASSES[spec.pop("family")]
    try:
        return config_cls(**{**spec, **cfg.overrides, **tokenizer_fields})
    except Exception as e:  # huggingface_hub's StrictDataclass*Error ("...:\n    TypeError: ..."), or a ValueError
        where = re.match(r"Validation error for field '(\w+)'", str(e))
        path = f"model.overrides.{where[1]}" if where else f"model.overrides ({cfg.name})"
        detail = str(e).strip().splitlines()[-1].strip().split(": ", 1)[-1]
        raise RecipeError(f"{path}: {detail}") from None
