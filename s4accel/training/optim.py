"""The recipe's optimizer (AdamW unless `optim.name` says otherwise) over parameter groups chosen by parameter name,
and a `transformers` schedule in optimizer steps."""

from __future__ import annotations

import inspect
import math

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices
from transformers import get_scheduler

from ..config import OptimCfg, SchedulerCfg
from ..config.optim_sections import TORCH_OPTIMIZERS, TORCH_SCHEDULES
from ..errors import RecipeError, did_you_mean
from .imports import import_object

DEFAULTS = OptimCfg()

AUTO_FUSED = ("adamw", "adam", "sgd")
"""The optimizers `optim.fused: null` runs fused where the device has the kernel: those torch fuses on CUDA and CPU
alike (Adagrad's fused kernel is CPU-only in torch's documentation: `optim.fused: true` asks for it)."""

STATE_FLOATS = {"adamw": 2, "adam": 2, "nadam": 2, "radam": 2, "adamax": 2, "adadelta": 2, "rprop": 2,
                "adagrad": 1, "asgd": 1, "muon": 1, "adafactor": 0}
"""float32 values of optimizer state per trained weight, for the size check (devices/fits.py): the Adam family's two
moments, Adagrad's sum of squares, ASGD's average, Muon's momentum (AdamW's two for the rest, counted as one: the
check errs low); Adafactor's factored moments are a row and a column per matrix, counted as none. SGD and RMSprop
depend on their arguments (`state_floats`)."""

MUON_GROUP = "matrices"
"""The name of Muon's one parameter group (logged as `train/lr_muon_matrices`)."""


def state_floats(cfg: OptimCfg) -> int:
    """float32 values of state the recipe's optimizer keeps per trained weight; 0 for a class of your own (the size
    check errs low)."""
    kw = cfg.kwargs
    if cfg.name == "sgd":
        return 1 if kw.get("momentum", 0) else 0
    if cfg.name == "rmsprop":  # square average, + momentum buffer, + the centred average
        return 1 + bool(kw.get("momentum", 0)) + bool(kw.get("centered", False))
    return STATE_FLOATS.get(cfg.name, 0) + bool(kw.get("amsgrad", False))


def optimizer_class(cfg: OptimCfg) -> type:
    """`torch.optim`'s class of that lower-case name (Muon for `muon`, beside an AdamW), or the class `optim.name`
    imports."""
    if cfg.name in TORCH_OPTIMIZERS:
        return next(getattr(torch.optim, n) for n in torch.optim.__all__ if n.lower() == cfg.name)
    cls = import_object(cfg.name, "optim.name")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise RecipeError(f"optim.name: {cfg.name} is not a torch.optim.Optimizer class")
    return cls


def optimizer_arguments(cfg: OptimCfg, cls: type, device_type: str) -> dict:
    """The constructor's arguments besides the parameter groups: the recipe's `lr`, `betas` and `eps` where the class
    takes them, the fused or multi-tensor kernel, and `kwargs`. A recipe value the class cannot take is one line
    naming its key (a default that does not apply, such as AdamW's betas for SGD, is left out)."""
    params = inspect.signature(cls).parameters
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params.values())  # takes what it is given: not checked

    def takes(name: str, kind: type | None = None) -> bool:
        if name not in params:
            return open_ended and kind is None
        return kind is None or isinstance(params[name].default, kind)

    name = cfg.name
    args = {"lr": cfg.lr}
    if takes("betas", tuple):
        args["betas"] = tuple(cfg.betas)
    elif tuple(cfg.betas) != tuple(DEFAULTS.betas):
        raise RecipeError(f"optim.betas: {name} takes no betas{_its_arguments(cfg, params)}")
    if takes("eps", float):
        if "eps" in cfg.kwargs:
            raise RecipeError("optim.kwargs: eps is set by optim.eps")
        args["eps"] = cfg.eps
    elif cfg.eps != DEFAULTS.eps:
        raise RecipeError(f"optim.eps: {name} takes no single eps" + (
            f" (its eps is {params['eps'].default!r}: set it in optim.kwargs)" if "eps" in params else ""))
    if cfg.weight_decay and not takes("weight_decay"):
        raise RecipeError(f"optim.weight_decay: {name} has no weight decay; set optim.weight_decay: 0")
    if cfg.fused and "fused" not in params:
        raise RecipeError(f"optim.fused: {name} has no fused kernel; set optim.fused: null or false")
    fused = cfg.fused if cfg.fused is not None else (
        name in AUTO_FUSED and device_type in _get_fused_kernels_supported_devices())
    if fused:
        args["fused"] = True
    elif "foreach" in params:  # the multi-tensor kernels: one launch per group, not per parameter
        args["foreach"] = True
    if not open_ended:
        for key in cfg.kwargs:
            if key not in params or key in ("params", "defaults"):
                raise RecipeError(f"optim.kwargs: {name} takes no {key!r}"
                                  f"{did_you_mean(key, _extra(params))}{_its_arguments(cfg, params)}")
    return {**args, **cfg.kwargs}


def _extra(params) -> list[str]:
    """The constructor arguments a recipe gives through `optim.kwargs`."""
    own = ("self", "params", "lr", "weight_decay", "betas", "fused", "foreach", "defaults")
    return [k for k, p in params.items() if k not in own and p.kind is not p.VAR_KEYWORD]


def _its_arguments(cfg: OptimCfg, params) -> str:
    extra = _extra(params)
    return f"; optim.kwargs takes {', '.join(extra)}" if extra else ""


def check_optimizer(cfg: OptimCfg, device_type: str, distributed: str = "NO") -> None:
    """The recipe's optimizer built over one small parameter, before any data or model is: an argument it refuses
    (`momentum: -1`, `nesterov` without momentum) is one line now, not after the data is tokenised. `distributed`:
    Accelerate's distributed type (`FSDP`, `DEEPSPEED`, ...)."""
    probe = torch.nn.Parameter(torch.zeros(2, 2, device=device_type))
    if cfg.name == "muon":
        if distributed in ("FSDP", "DEEPSPEED"):
            raise RecipeError(f"optim.name: muon runs on one process or DDP, not {distributed}: it orthogonalises "
                              f"each matrix's whole update, which {distributed} holds in shards")
        construct(torch.optim.Muon, [{"params": [probe], "weight_decay": cfg.weight_decay}], muon_arguments(cfg), cfg)
        cfg = beside_muon(cfg)
    cls = optimizer_class(cfg)
    construct(cls, [{"params": [probe], "weight_decay": cfg.weight_decay}], optimizer_arguments(cfg, cls, device_type),
              cfg)


def muon_arguments(cfg: OptimCfg) -> dict:
    """Muon's arguments: the recipe's `lr`, its updates scaled to the size of AdamW's (`adjust_lr_fn:
    match_rms_adamw`, so one `lr` serves Muon and the AdamW beside it), and `kwargs`, checked by name."""
    params = inspect.signature(torch.optim.Muon).parameters
    for key in cfg.kwargs:
        if key not in params or key == "params":
            raise RecipeError(f"optim.kwargs: muon takes no {key!r}{did_you_mean(key, _extra(params))}; "
                              f"optim.kwargs takes {', '.join(_extra(params))}")
    return {"lr": cfg.lr, "adjust_lr_fn": "match_rms_adamw", **cfg.kwargs}


def beside_muon(cfg: OptimCfg) -> OptimCfg:
    """The settings of the AdamW that trains what Muon does not: the recipe's, without Muon's `kwargs`."""
    return cfg.model_copy(update={"name": "adamw", "kwargs": {}})


def muon_matrices(model: torch.nn.Module, cfg: OptimCfg) -> set[int]:
    """The parameters (ids) Muon trains: the trained 2-D matrices of the model's blocks (named `layers.N.*`), but
    not the SSM group's. Embeddings and heads stay with AdamW, as Muon's authors train them."""
    ssm = set(cfg.ssm_params)
    return {id(p) for n, p in model.named_parameters()
            if p.requires_grad and p.ndim == 2 and ".layers." in f".{n}" and n.rsplit(".", 1)[-1] not in ssm}


def construct(cls: type, groups: list[dict], args: dict, cfg: OptimCfg) -> torch.optim.Optimizer:
    """`cls(groups, **args)`; the arguments it refuses (torch checks their values) are one line."""
    if not cfg.weight_decay and "weight_decay" not in inspect.signature(cls).parameters:
        groups = [{k: v for k, v in g.items() if k != "weight_decay"} for g in groups]
    try:
        return cls(groups, **args)
    except (TypeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RecipeError(f"optim.kwargs: {cfg.name} refused its arguments ({first[:300]})") from None


def param_groups(model: torch.nn.Module, cfg: OptimCfg, skip: frozenset | set = frozenset()) -> list[dict]:
    """Three groups, each named (the name is logged with its lr), of the trained parameters but those in `skip`
    (ids):

    - `ssm`: parameters whose last name component is in `cfg.ssm_params` (`log_dt`, `log_A_real`, `A_imag`, and the
      `s4` kernel's `P`, `B`):
      `ssm_lr`, no weight decay. Chosen by name because per-tensor attributes do not survive `from_pretrained`.
    - `decay`: the other matrices (ndim >= 2: linear weights, embeddings): `lr`, `weight_decay`.
    - `no_decay`: the other vectors (biases, norm weights, `D`): `lr`, no weight decay.
    """
    ssm_names = set(cfg.ssm_params)
    groups = {"ssm": [], "decay": [], "no_decay": []}
    for name, p in model.named_parameters():  # tied weights appear once
        if not p.requires_grad or id(p) in skip:
            continue
        if name.rsplit(".", 1)[-1] in ssm_names:
            groups["ssm"].append(p)
        elif p.ndim >= 2:
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    settings = {
        "ssm": {"lr": cfg.ssm_lr, "weight_decay": 0.0},
        "decay": {"lr": cfg.lr, "weight_decay": cfg.weight_decay},
        "no_decay": {"lr": cfg.lr, "weight_decay": 0.0},
    }
    return [{"name": k, "params": ps, **settings[k]} for k, ps in groups.items() if ps]


def build_optimizer(model: torch.nn.Module, cfg: OptimCfg, device_type: str = "cpu") -> torch.optim.Optimizer:
    """The recipe's optimizer over `param_groups`; fused (one kernel for every parameter: AdamW 0.5 vs 2.1 ms per
    step for s4-small on 2 CPU cores) where `device_type` has the kernel, unless `cfg.fused` says otherwise.
    `optim.name: muon` is two optimizers: `build_optimizers`."""
    return build_optimizers(model, cfg, device_type)[0][1]


def build_optimizers(model: torch.nn.Module, cfg: OptimCfg, device_type: str = "cpu"
                     ) -> list[tuple[str, torch.optim.Optimizer]]:
    """(name, optimizer) pairs: `main`, the recipe's optimizer over `param_groups`; or for `muon`, `muon` over
    `muon_matrices` and `adamw` over the groups of the rest."""
    if cfg.name != "muon":
        cls = optimizer_class(cfg)
        return [("main", construct(cls, param_groups(model, cfg), optimizer_arguments(cfg, cls, device_type), cfg))]
    matrices = muon_matrices(model, cfg)
    if not matrices:
        raise RecipeError("optim.name: muon finds no trained 2-D matrix in the model's blocks (parameters named "
                          "layers.N.*); use adamw")
    group = {"name": MUON_GROUP, "params": [p for p in model.parameters() if id(p) in matrices]}
    muon = construct(torch.optim.Muon, [{**group, "weight_decay": cfg.weight_decay}], muon_arguments(cfg), cfg)
    rest = beside_muon(cfg)
    groups = param_groups(model, rest, skip=matrices)
    if not groups:
        return [("muon", muon)]
    adamw = construct(torch.optim.AdamW, groups, optimizer_arguments(rest, torch.optim.AdamW, device_type), rest)
    return [("muon", muon), ("adamw", adamw)]


def build_scheduler(optimizer, cfg: SchedulerCfg, warmup_steps: int, max_steps: int):
    """A `transformers.get_scheduler` schedule sized in optimizer steps, or one of torch's (`torch_schedule`).

    Kept out of `accelerator.prepare` on purpose: a prepared scheduler steps once per process per optimizer step,
    so with N processes it would run N times too fast. The loop steps it once per real optimizer step.
    """
    if cfg.name in TORCH_SCHEDULES:
        return torch_schedule(optimizer, cfg, warmup_steps, max_steps)
    try:
        return get_scheduler(cfg.name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_steps,
                             scheduler_specific_kwargs=cfg.kwargs or None)
    except TypeError as e:
        raise RecipeError(f"scheduler.kwargs: {e}") from None


def torch_schedule(optimizer, cfg: SchedulerCfg, warmup_steps: int, max_steps: int):
    """torch's StepLR, ExponentialLR, CosineAnnealingLR or a user's multiplier after a linear warmup, as one
    `LambdaLR` of their closed forms (t: optimizer steps since the warmup ended; the same values torch's classes
    give). One LambdaLR rather than `SequentialLR` of torch's own classes: its learning rate at any step is base x
    f(step), which is what a `--force` resume recomputes when the recipe's learning rate changed, and its state
    (the step) is all a checkpoint needs."""

    kw = {**{k: v for k, v in TORCH_SCHEDULES[cfg.name].items() if v is not None}, **cfg.kwargs}
    if cfg.name == "step":
        def after(t):
            return kw["gamma"] ** (t // kw["step_size"])
    elif cfg.name == "exponential":
        def after(t):
            return kw["gamma"] ** t
    elif cfg.name == "lambda":
        after = import_object(kw["target"], "scheduler.kwargs.target")
        if not callable(after):
            raise RecipeError(f"scheduler.kwargs.target: {kw['target']} is not a function")
    else:  # cosine_annealing: eta_min is an absolute rate, so each group's multiplier depends on its base rate
        t_max = cfg.kwargs.get("T_max", max(1, max_steps - warmup_steps))
        bases = [g["lr"] for g in optimizer.param_groups]

        def cosine(base):
            return lambda t: (kw["eta_min"] + (base - kw["eta_min"]) * (1 + math.cos(math.pi * t / t_max)) / 2) / base
        return torch.optim.lr_scheduler.LambdaLR(optimizer, [with_warmup(cosine(b), warmup_steps) for b in bases])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, with_warmup(after, warmup_steps))


def with_warmup(after, warmup_steps: int):
    """A multiplier rising linearly from 0 over `warmup_steps` (as transformers' schedules do), then `after(t)`."""
    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        return float(after(step - warmup_steps))
    return multiplier
