"""Parameter groups (chosen by name) and the learning-rate schedule."""

import math

import pytest
import torch

from helpers import TINY
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
