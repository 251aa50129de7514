"""Starting from trained weights (`model.pretrained`): the architecture from the pretrained config (with the few
overrides that leave the weights valid, and what the new data decides: a classifier's labels), the weights through
the safe loader, an optional state hook, every tensor accounted for (loaded, new by permission, or unused), frozen
parameters. Training then starts at step 0 with a fresh optimizer.

    model: {pretrained: runs/quickstart}                      continue pretraining a language model
    model: {pretrained: runs/quickstart, freeze: [backbone.*]} a classifier on a frozen language-model backbone
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import RecipeError
from .imports import import_object
from .runs.safe_load import _resolve, read_config, weight_files

SAFE_OVERRIDES = ("dropout", "pooling", "router_jitter", "router_aux_loss_coef", "router_z_loss_coef",
                  "capacity_factor", "moe_dispatch", "use_cache", "max_position_embeddings")
"""Config fields a pretrained model's weights stay valid under: regularisation, how a classifier pools, the router's
loss weights and dispatch, caching, how far rotary positions reach. Anything else (widths, depths, the kernel, its
discretisation, `l_max`, bidirectionality) would change what the weights mean, or their shapes."""
CLASSIFIER_FIELDS = ("num_labels", "id2label", "label2id", "problem_type")
"""What a new head takes from the new data, whatever the pretrained model was."""


def locate(model_cfg) -> tuple[Path, Path]:
    """(the pretrained model's folder, the folder its files may live in: itself, or a Hub snapshot's repo)."""
    return _resolve(model_cfg.pretrained, model_cfg.which, revision=model_cfg.revision)


def pretrained_config(model_cfg, spec: dict, model_dir: Path):
    """The pretrained model's config, with the recipe's safe overrides and the data's labels; a vocabulary or input
    width that differs from the data's is refused (the embeddings would not fit the tokens)."""
    cfg = model_cfg
    config = read_config(model_dir)
    bad = [k for k in cfg.overrides if k not in SAFE_OVERRIDES]
    if bad:
        raise RecipeError(f"model.overrides.{bad[0]}: cannot change a pretrained model's {bad[0]} (its weights "
                          f"would no longer fit); with model.pretrained only {', '.join(SAFE_OVERRIDES)} may change")
    for key in ("vocab_size", "d_input"):
        if key in spec and getattr(config, key, None) != spec[key]:
            raise RecipeError(f"model.pretrained: {cfg.pretrained} was trained with {key}={getattr(config, key, None)}"
                              f" but this data gives {spec[key]} (another tokenizer or other features?)")
    for key, value in {**cfg.overrides, **{k: v for k, v in spec.items() if k in CLASSIFIER_FIELDS or
                                           k in ("input_mean", "input_scale")}}.items():
        setattr(config, key, value)
    config.architectures = None  # the new model's class decides
    return config


def load_pretrained(model, model_cfg, model_dir: Path, root: Path, head: list[str]) -> str:
    """Load the pretrained weights into `model` (built from `pretrained_config`); returns the one-line report. Every
    parameter of `model` must be loaded or allowed new (`model.new_weights`, default `head`); `model.freeze`
    parameters stop training."""
    files = weight_files(model_dir, root)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    if model_cfg.state_hook:
        hook = import_object(model_cfg.state_hook, "model.state_hook")
        try:
            state = hook(state, model)
        except Exception as e:
            raise RecipeError(f"model.state_hook: {model_cfg.state_hook} failed: {type(e).__name__}: {e}") from None
        if not isinstance(state, dict):
            raise RecipeError(f"model.state_hook: {model_cfg.state_hook} must return the state dict to load, got "
                              f"{type(state).__name__}")
        odd = next(((k, v) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)),
                   None)
        if odd is not None:
            raise RecipeError(f"model.state_hook: {model_cfg.state_hook} must map parameter names to tensors; "
                              f"{str(odd[0])[:80]!r} maps to {type(odd[1]).__name__}")
    target = model.state_dict()
    aliases: dict[int, list[str]] = {}  # tied weights: one tensor, several names
    for name, t in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(t), []).append(name)
    allowed = model_cfg.new_weights if model_cfg.new_weights is not None else head
    load, new, reshaped = {}, [], []
    for names in aliases.values():
        present = next((n for n in names if n in state), None)
        if present is not None and tuple(state[present].shape) == tuple(target[names[0]].shape):
            load.update({n: state[present] for n in names})
        else:
            (reshaped if present is not None else new).append(names[0])
    unused = sorted(k for k in state if k not in target)
    refused = [n for n in new + reshaped if not any(fnmatch.fnmatch(n, p) for p in allowed)]
    if refused:
        shapes = {n: (list(state[n].shape), list(target[n].shape)) for n in reshaped if n in refused}
        detail = "; ".join(f"{n} is {a} there, {b} here" for n, (a, b) in list(shapes.items())[:2])
        raise RecipeError(f"model.pretrained: {len(refused)} parameter(s) would start untrained: "
                          f"{', '.join(refused[:5])}{' ...' if len(refused) > 5 else ''}"
                          f"{f' ({detail})' if detail else ''}; allow them with model.new_weights, or map the "
                          f"checkpoint's names with model.state_hook")
    nonfloat = [k for k, v in load.items() if not v.is_floating_point()]
    if nonfloat:
        raise RecipeError(f"model.pretrained: {nonfloat[0]} holds {load[nonfloat[0]].dtype}, not weights")
    broken = next((k for k, v in load.items() if not torch.isfinite(v).all()), None)
    if broken is not None:  # training would stop at its first step, blaming the learning rate
        bad = int((~torch.isfinite(load[broken])).sum())
        raise RecipeError(f"model.pretrained: {model_cfg.pretrained}: {broken} holds {bad} NaN or infinite value(s) "
                          f"of {load[broken].numel()}; not weights to start from")
    with torch.no_grad():
        model.load_state_dict({k: v.to(target[k].dtype) for k, v in load.items()}, strict=False)
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    n_loaded = len({id(t) for n, t in model.state_dict(keep_vars=True).items() if n in load})
    return (f"model.pretrained {model_cfg.pretrained}: {n_loaded} tensors loaded; new: "
            f"{', '.join(new + reshaped) or 'none'}; unused: {', '.join(unused) or 'none'}")


def freeze(model, patterns: list[str]) -> list[str]:
    """Stop training the parameters whose names match; returns them (an unmatched pattern is an error)."""
    names = [n for n, _ in model.named_parameters()]
    for p in patterns:
        if not any(fnmatch.fnmatch(n, p) for n in names):
            raise RecipeError(f"model.freeze: {p!r} matches no parameter (names look like {names[0]}, {names[-1]})")
    if all(any(fnmatch.fnmatch(n, p) for p in patterns) for n in names):
        raise RecipeError(f"model.freeze: {patterns} fixes every parameter: nothing would train (fix fewer, e.g. "
                          f"'backbone.*' to train the head alone)")
    frozen = []
    for n, param in model.named_parameters():
        if any(fnmatch.fnmatch(n, p) for p in patterns):
            param.requires_grad_(False)
            frozen.append(n)
    return frozen
