"""LoRA through PEFT (`model.lora`): the recipe's adapters put on a built model by PEFT's own `get_peft_model`, what
each name adapted said in one line, and a name that adapts nothing, or only part of what it names, refused.

    model: {pretrained: runs/quickstart, lora: {r: 8, alpha: 16, target_modules: [output_linear]}}
    -> model.lora: output_linear -> 4 modules (layers 0-3); 1.1% of parameters trainable (8,192 of 745,472)

Names match as PEFT matches a list: a module or parameter whose dotted name is the name or ends with `.name`. A name
"could" adapt every module and parameter it matches that way; PEFT adapts only the layers it supports among them
(`target_modules`) or the parameters (`target_parameters`), and says nothing when a name matches in some blocks and
not in others (a model whose dense and MoE blocks both have a `gate_up_proj`, a Linear in one and a 3-D parameter in
the other). Here every match must be adapted by one list or the other, or the recipe is refused naming what was left.

peft is an optional dependency (`pip install 's4accel[lora]'`), imported only when a recipe asks for LoRA; the model
files never import it.
"""

from __future__ import annotations

import copy
import re
import sys
import warnings
from pathlib import Path

import torch

from ..errors import RecipeError, did_you_mean
from .pretrained import locate

PIP = "pip install 's4accel[lora]'"
FRESH_BASE = "base"
"""The folder beside a fresh model's adapter that holds the base it was trained on, and the adapter config's
`base_model_name_or_path` for it: the adapter means nothing on another initialisation."""
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def require_peft():
    """The `peft` module, or a one-line recipe error naming the pip command."""
    try:
        import peft
    except ImportError:
        raise RecipeError(f"model.lora: needs peft, which is not installed: {PIP}") from None
    return peft


def is_lora(model) -> bool:
    """A PEFT model (peft is imported only once a recipe asked for LoRA: without it, nothing is one)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def check_runtime(accelerator, recipe) -> None:
    """LoRA runs on one process and DDP; FSDP's and DeepSpeed's sharding of a model whose parameters are mostly
    frozen (and, with `target_parameters`, re-parametrised at each forward) is not what these runs were checked on."""
    kind = accelerator.distributed_type.value
    if recipe.model.lora is not None and kind in ("FSDP", "DEEPSPEED"):
        raise RecipeError(f"model.lora: runs on one process or DDP, not {kind} (an adapter is small: its optimizer "
                          f"state fits each process whole)")


def base_name(model_cfg) -> str:
    """What the adapter names as its base (PEFT's `base_model_name_or_path`): the Hub repo id, the pretrained model's
    folder, or `FRESH_BASE` for a freshly initialised model."""
    if model_cfg.pretrained is None:
        return FRESH_BASE
    if not Path(model_cfg.pretrained).exists():  # a Hub repo id
        return model_cfg.pretrained
    return str(locate(model_cfg)[0])  # a run directory's final/ (or best, ema): the folder with the config


def apply_lora(model, model_cfg, is_lm: bool, say=None):
    """`model` with the recipe's adapters (a `peft.PeftModel`: the base fixed, the adapters and a classifier's head
    trainable); `say` gets the one-line coverage report. A name that adapts nothing, a partial match, a tied or
    unsupported target: one `RecipeError`."""
    peft = require_peft()
    cfg = model_cfg.lora
    found = inventory(model)
    for field, names in (("target_modules", cfg.target_modules), ("target_parameters", cfg.target_parameters)):
        for name in names:
            check_matches(field, name, found, model)
    config = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=list(cfg.target_modules), target_parameters=list(cfg.target_parameters),
                             task_type="CAUSAL_LM" if is_lm else "SEQ_CLS", revision=model_cfg.revision)
    # PEFT names the base in the adapter's config by the model's `name_or_path` (what `from_pretrained` sets); this
    # model was built from its config, and the name is where its weights come from.
    model.name_or_path = base_name(model_cfg)
    try:
        with warnings.catch_warnings():
            # PEFT reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning each time): noise
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
            # A classifier's head (`score`) is new, so it trains whole: PEFT's SEQ_CLS task adds it to
            # modules_to_save.
            wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # an unsupported layer type, or nothing adapted at all (NoMatchingPeftModuleError)
        if isinstance(e, peft.utils.error.NoMatchingPeftModuleError):  # every name matched only what it cannot adapt
            field, name = ("target_modules", cfg.target_modules[0]) if cfg.target_modules else \
                ("target_parameters", cfg.target_parameters[0])
            refuse_uncovered(field, name, [], [n for n in found if suffix_match(n, name)], found)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RecipeError(f"model.lora: PEFT refused the targets: {first[:300]}") from None
    report = coverage(wrapped, cfg, found)
    if say is not None:
        say(report)
    return wrapped


def inventory(model) -> dict[str, object]:
    """Every module and parameter of the base model by its dotted name (tied parameters once, under their first
    name)."""
    found: dict[str, object] = dict(model.named_modules())
    found.pop("", None)
    found.update(model.named_parameters())
    return found


def suffix_match(name: str, pattern: str) -> bool:
    """PEFT's rule for a list of names: the name itself, or a dotted suffix of it."""
    return name == pattern or name.endswith("." + pattern)


def check_matches(field: str, pattern: str, found: dict, model) -> None:
    """Before PEFT: the name matches something, and nothing it matches is a weight tied to another (an update merged
    into the head would change the embeddings too), or a parameter PEFT cannot adapt (1-D, 4-D)."""
    matches = [n for n in found if suffix_match(n, pattern)]
    if not matches:
        last = {n.rsplit(".", 1)[-1] for n in found}
        example = next((n for n in found if n.endswith(("output_linear", "qkv_proj"))), next(iter(found)))
        raise RecipeError(f"model.lora.{field}: {pattern!r} matches no module or parameter"
                          f"{did_you_mean(pattern.rsplit('.', 1)[-1], last)} (names look like {example})")
    tied = tied_names(model)
    for n in matches:
        weight = f"{n}.weight" if isinstance(found[n], torch.nn.Module) else n
        if weight in tied:
            raise RecipeError(f"model.lora.{field}: {pattern!r} matches {n}, whose weight is tied to {tied[weight]}: "
                              f"a merged update would change both; adapt other modules")
    if field == "target_parameters":
        odd = [n for n in matches if isinstance(found[n], torch.nn.Parameter) and found[n].ndim not in (2, 3)]
        if odd:
            raise RecipeError(f"model.lora.target_parameters: {pattern!r} matches {found[odd[0]].ndim}-D parameters "
                              f"({', '.join(odd[:2])}); PEFT's LoRA adapts 2-D and 3-D parameters only")


def tied_names(model) -> dict[str, str]:
    """{name: the other name} for every parameter shared under two names."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name], tied[first[id(p)]] = first[id(p)], name
        else:
            first[id(p)] = name
    return tied


def adapted(wrapped) -> tuple[set[str], dict[str, torch.nn.Parameter]]:
    """(the base model's names of the layers PEFT adapted, {name: parameter} of the parameters it adapted)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    modules, params = set(), {}
    for name, module in wrapped.get_base_model().named_modules():
        plain = name.replace(".base_layer", "")
        if isinstance(module, ParamWrapper):
            params[f"{plain}.{module.parameter_name}"] = module.get_param()
        elif isinstance(module, LoraLayer):
            modules.add(plain)
    return modules, params


def coverage(wrapped, cfg, found: dict) -> str:
    """The one-line report: what each name adapted (where), and the share of parameters that train. Every module
    and parameter a name matches must be adapted by one list or the other."""
    modules, params = adapted(wrapped)
    parts = []
    for field, names in (("target_modules", cfg.target_modules), ("target_parameters", cfg.target_parameters)):
        done = modules if field == "target_modules" else params
        for name in names:
            hits = sorted((n for n in done if suffix_match(n, name)), key=_natural)
            left = [n for n in found if suffix_match(n, name) and n not in modules and n not in params]
            if left or not hits:
                refuse_uncovered(field, name, hits, left, found)
            noun = "module" if field == "target_modules" else "parameter"
            experts = {found[n].shape[0] for n in hits if field == "target_parameters" and found[n].ndim == 3}
            each = f", {experts.pop()} experts each" if len(experts) == 1 else ""
            parts.append(f"{name} -> {len(hits)} {noun}{'s' * (len(hits) != 1)} ({where(hits)}{each})")
    trainable, total = wrapped.get_nb_trainable_parameters()
    heads = sorted({n.split(".modules_to_save")[0].rsplit(".", 1)[-1] for n, _ in wrapped.named_parameters()
                    if ".modules_to_save." in n})
    head = f"; {', '.join(heads)} trained whole (the new head)" if heads else ""
    return (f"model.lora: {', '.join(parts)}{head}; {trainable / total:.1%} of parameters trainable "
            f"({trainable:,} of {total:,})")


def refuse_uncovered(field: str, name: str, hits: list[str], left: list[str], found: dict) -> None:
    """A name that adapted nothing, or not everything it matches: one line naming what it adapted, what it left, and
    where the rest goes."""
    noun = "module" if field == "target_modules" else "parameter"
    kinds = []
    for n in left[:3]:
        obj = found[n]
        if isinstance(obj, torch.nn.Parameter):
            hint = " (list it in model.lora.target_parameters)" if field == "target_modules" else ""
            kinds.append(f"{n}, a {obj.ndim}-D parameter{hint}")
        elif isinstance(obj, (torch.nn.Linear, torch.nn.Embedding)):
            hint = " (list it in model.lora.target_modules)" if field == "target_parameters" else ""
            kinds.append(f"{n}, a {type(obj).__name__}{hint}")
        else:
            short = n.rsplit(".", 1)[-1]
            own = [f"{short}.{p}" for p, _ in obj.named_parameters(recurse=False)]
            hint = f" (name its parameters in model.lora.target_parameters: {', '.join(own)})" if own else ""
            kinds.append(f"{n}, a {type(obj).__name__}{hint}")
    more = f" and {len(left) - 3} more" if len(left) > 3 else ""
    listed = f"{'; '.join(kinds)}{more}"
    if not hits and not left:  # all it matches is adapted through the other list
        other = "target_parameters" if field == "target_modules" else "target_modules"
        raise RecipeError(f"model.lora.{field}: {name!r} adapts no {noun}; what it matches is adapted through "
                          f"model.lora.{other}: remove it here")
    if not hits:
        raise RecipeError(f"model.lora.{field}: {name!r} adapts no {noun}; it matches only {listed}")
    raise RecipeError(f"model.lora.{field}: {name!r} adapts {len(hits)} {noun}{'s' * (len(hits) != 1)} "
                      f"({where(hits)}) but not {len(left)} more it matches: {listed}")


def where(names: list[str]) -> str:
    """`layers 0-3`, `layers 0, 2`, `layer 1`, or the names themselves outside the repeated blocks."""
    layers = sorted({int(m[1]) for n in names if (m := _LAYER.search(n))})
    others = [n for n in names if not _LAYER.search(n)]
    runs, start = [], None
    for i, k in enumerate(layers):
        if start is None:
            start = k
        if i + 1 == len(layers) or layers[i + 1] != k + 1:
            runs.append(f"{start}" if start == k else f"{start}-{k}")
            start = None
    text = [f"layer{'s' * (len(layers) > 1)} {', '.join(runs)}"] if layers else []
    return ", ".join(text + others) or "none"


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def save_adapter(wrapped, out: Path, state_dict: dict | None = None) -> None:
    """The adapter as PEFT saves it (`adapter_config.json`, `adapter_model.safetensors`: the low-rank factors and a
    classifier's head), from `state_dict` when given (the gathered weights); for a fresh base also the base it was
    trained on, in `out/base/`. PEFT's template README is left out: `push` and `export` write the card."""
    # save_embedding_layers=False: PEFT would otherwise look the base up (on the Hub, by its name) to see whether its
    # vocabulary grew; these runs never resize the embeddings, so the adapter holds the low-rank factors alone.
    wrapped.save_pretrained(out, state_dict=state_dict, save_embedding_layers=False)
    (out / "README.md").unlink(missing_ok=True)
    if wrapped.peft_config["default"].base_model_name_or_path == FRESH_BASE:
        base = copy.deepcopy(wrapped).unload()  # unload takes the adapters out in place: a copy keeps the model whole
        base.save_pretrained(out / FRESH_BASE)


def merged(wrapped):
    """The plain model: each adapted weight becomes W + (alpha / r) B A (PEFT's `merge_and_unload`)."""
    return wrapped.merge_and_unload()
