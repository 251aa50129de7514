"""Parameter groups (chosen by name) and the learning-rate schedule."""

import math

import pytest
import torch

from helpers import TINY, read_metrics, run_cli, sets, small_text_file
from s4accel import S4ForCausalLM
from s4accel.config import load_recipe
from s4accel.training.optim import build_optimizer, build_scheduler


def test_ssm_parameters_get_their_own_lr_and_no_weight_decay(tiny_config, tmp_path):
    model = S4ForCausalLM(tiny_config)
    # Names survive save/from_pretrained, unlike per-tensor attributes: build the groups from a reloaded model.
    model.save_pretrained(tmp_path)
    model = S4ForCausalLM.from_pretrained(tmp_path)
    opt = build_optimizer(model, load_recipe(TINY, ["optim.lr=0.01", "optim.ssm_lr=0.001"]).optim)
    groups = {g["name"]: g for g in opt.param_groups}
    names = {id(p): n for n, p in model.named_parameters()}
    ssm = sorted(names[id(p)].rsplit(".", 1)[-1] for p in groups["ssm"]["params"])
    assert ssm == sorted(["log_dt", "log_A_real", "A_imag"] * tiny_config.n_layer)
    assert groups["ssm"]["lr"] == 0.001 and groups["ssm"]["weight_decay"] == 0.0
    assert groups["decay"]["lr"] == 0.01 and groups["decay"]["weight_decay"] == 0.01
    assert groups["no_decay"]["weight_decay"] == 0.0
    no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
    assert all(n.endswith(("bias", "norm.weight", "norm_f.weight", ".D")) for n in no_decay), no_decay
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    assert "backbone.embeddings.weight" in decay  # tied with lm_head: listed once
    assert all(p.ndim >= 2 for p in groups["decay"]["params"])
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_warmup_then_cosine_in_optimizer_steps(tiny_config):
    model = S4ForCausalLM(tiny_config)
    recipe = load_recipe(TINY, ["optim.lr=1.0", "optim.ssm_lr=0.1", "scheduler.warmup_steps=4",
                                "train.max_steps=12"])
    opt = build_optimizer(model, recipe.optim)
    sched = build_scheduler(opt, recipe.scheduler, recipe.warmup_steps, recipe.train.max_steps)
    lrs = []
    for _ in range(12):
        lrs.append(sched.get_last_lr())
        opt.step()
        sched.step()
    decay_lr = [lr[[g["name"] for g in opt.param_groups].index("decay")] for lr in lrs]
    assert decay_lr[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    for step in range(4, 12):  # cosine from 1 to 0 over the remaining 8 steps
        assert decay_lr[step] == pytest.approx(0.5 * (1 + math.cos(math.pi * (step - 4) / 8)))
    ssm_lr = [lr[0] for lr in lrs]
    assert ssm_lr[4] == pytest.approx(0.1)  # the same shape, scaled to the group's own peak


def test_bad_scheduler_kwargs_are_a_recipe_error(tiny_config):
    from s4accel.errors import RecipeError

    model = S4ForCausalLM(tiny_config)
    recipe = load_recipe(TINY, ["scheduler.kwargs={nope: 1}"])
    with pytest.raises(RecipeError, match="scheduler.kwargs"):
        build_scheduler(torch.optim.AdamW(model.parameters()), recipe.scheduler, 1, 10)


def rates(make_schedule, steps, bases=(1e-2, 3e-3)):
    """Each step's learning rate of two parameter groups under the schedule `make_schedule(optimizer)`."""
    import torch

    opt = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": b} for b in bases])
    sched = make_schedule(opt)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


def lrs_of(name, kwargs, warmup, steps):
    from s4accel.config.schema import SchedulerCfg
    from s4accel.training.optim import build_scheduler

    cfg = SchedulerCfg(name=name, warmup_steps=warmup, kwargs=kwargs)
    return rates(lambda opt: build_scheduler(opt, cfg, warmup, steps), steps)


def torch_lrs(cls, kwargs, steps):
    return rates(lambda opt: cls(opt, **kwargs), steps)


def test_torch_schedules_follow_torchs_own_classes_after_a_linear_warmup():
    import pytest
    import torch

    warmup, steps = 4, 40
    cases = [("step", {"step_size": 7, "gamma": 0.5}, torch.optim.lr_scheduler.StepLR, {"step_size": 7, "gamma": 0.5}),
             ("exponential", {"gamma": 0.9}, torch.optim.lr_scheduler.ExponentialLR, {"gamma": 0.9}),
             ("cosine_annealing", {"eta_min": 1e-4}, torch.optim.lr_scheduler.CosineAnnealingLR,
              {"T_max": steps - warmup, "eta_min": 1e-4})]
    for name, kwargs, cls, torch_kwargs in cases:
        ours = lrs_of(name, kwargs, warmup, steps)
        assert ours[:warmup] == [[b * s / warmup for b in (1e-2, 3e-3)] for s in range(warmup)]
        theirs = torch_lrs(cls, torch_kwargs, steps - warmup)
        assert sum(ours[warmup:], []) == pytest.approx(sum(theirs, []), rel=1e-9), name
    halving = lrs_of("lambda", {"target": "testing_tasks:halve_every_3"}, 0, 9)
    assert [row[0] for row in halving] == pytest.approx([1e-2] * 3 + [5e-3] * 3 + [2.5e-3] * 3)


def test_torch_schedule_arguments_are_checked_before_any_compute(tmp_path):
    for kwargs, says in [("{gamma: 0.5}", "missing step_size for step"),
                         ("{step_size: 5, gama: 0.5}", "unknown gama for step"),
                         ("{step_size: 0}", "step_size and T_max must be at least 1")]:
        proc = run_cli("show", TINY, *sets("scheduler.name=step", f"scheduler.kwargs={kwargs}"))
        assert proc.returncode == 2 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_a_torch_schedule_is_checkpointed_and_a_resumed_run_follows_it(tmp_path):
    import pytest

    from helpers import short_epochs, train_in_process

    text = small_text_file(tmp_path)
    sched = ["scheduler.name=step", "scheduler.kwargs={step_size: 3, gamma: 0.5}", "scheduler.warmup_steps=2",
             "train.max_steps=12"]
    whole = train_in_process(TINY, short_epochs(text, tmp_path / "whole", *sched))
    lrs = {r["step"]: r["train/lr_decay"] for r in read_metrics(whole.run_dir) if "train/lr_decay" in r}
    lr = 3e-3  # the tiny recipe's optim.lr; logged after step s: the rate of step s + 1, lr * f(s)
    expected = {s: lr * (s / 2 if s < 2 else 0.5 ** ((s - 2) // 3)) for s in range(1, 13)}
    assert lrs == pytest.approx(expected, rel=1e-6)
    cut = tmp_path / "cut"
    train_in_process(TINY, short_epochs(text, cut, *sched[:-1], "train.max_steps=5"))
    resumed = train_in_process(TINY, short_epochs(text, cut, *sched), resume="latest", force=True)
    again = {r["step"]: r["train/lr_decay"] for r in read_metrics(resumed.run_dir) if "train/lr_decay" in r}
    assert {s: again[s] for s in range(6, 13)} == {s: lrs[s] for s in range(6, 13)}
