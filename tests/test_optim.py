"""Parameter groups (chosen by name) and the learning-rate schedule."""

import math

import pytest
import torch

from helpers import REPO, TINY, read_metrics, run_cli, sets, small_text_file
from s4accel import S4ForCausalLM
from s4accel.config import load_recipe
from s4accel.data import data_spec
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
    from s4accel.config.optim_sections import SchedulerCfg
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


def test_a_recipe_names_any_of_torchs_optimizers_and_each_gets_the_same_parameter_groups(tiny_config):
    """`optim.name` is torch.optim's class in lower case; the groups (SSM rate, weight decay on matrices only) are the
    same whatever the optimizer; the Adam family gets the recipe's betas and eps, the others only what they take."""
    from s4accel.config.optim_sections import TORCH_OPTIMIZERS

    every = {n.lower() for n in torch.optim.__all__ if isinstance(getattr(torch.optim, n), type)
             and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"}
    assert set(TORCH_OPTIMIZERS) == every - {"lbfgs", "sparseadam"}  # optim_sections.py says why not those
    model = S4ForCausalLM(tiny_config)
    adam_family = ("adamw", "adam", "nadam", "radam", "adamax")
    for name in set(TORCH_OPTIMIZERS) - {"muon"}:  # Muon is two optimizers: below
        settings = [f"optim.name={name}", "optim.lr=0.01", "optim.ssm_lr=0.001",
                    "optim.weight_decay=0" if name == "rprop" else "optim.weight_decay=0.05"]  # rprop has none
        opt = build_optimizer(model, load_recipe(TINY, [*settings, *(["optim.betas=[0.8, 0.9]"]
                                                                     if name in adam_family else [])]).optim)
        assert type(opt).__name__.lower() == name
        groups = {g["name"]: g for g in opt.param_groups}
        assert [groups[g]["lr"] for g in ("ssm", "decay", "no_decay")] == [0.001, 0.01, 0.01], name
        if name != "rprop":
            assert [groups[g]["weight_decay"] for g in ("ssm", "decay", "no_decay")] == [0.0, 0.05, 0.0], name
        assert ("betas" in opt.defaults) == (name in adam_family), name
        if "betas" in opt.defaults:
            assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["eps"] == 1e-8, name
        before = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), name
    sgd = build_optimizer(model, load_recipe(TINY, ["optim.name=sgd", "optim.kwargs={momentum: 0.9, nesterov: true}"]
                                             ).optim)
    assert (sgd.defaults["momentum"], sgd.defaults["nesterov"], sgd.defaults["fused"]) == (0.9, True, True)
    pair = build_optimizer(model, load_recipe(TINY, ["optim.name=adafactor", "optim.kwargs={eps: [null, 0.01]}"]
                                              ).optim)
    assert list(pair.defaults["eps"]) == [None, 0.01]


@pytest.mark.parametrize("sets_, says", [
    (["optim.name=sgdd"], "optim.name: expected one of adamw, adam, sgd, "),
    (["optim.name=SGD"], "optim.name: torch.optim's names are in lower case here: 'sgd'"),
    (["optim.name=lbfgs"], "optim.name: lbfgs: not a recipe's optimizer: its step re-evaluates the loss"),
    (["optim.name=sgd", "optim.kwargs={lr: 1}"], "optim.kwargs: lr is set by optim.lr, not in kwargs"),
    (["optim.name=sgd", "optim.kwargs={momentum: 0.9, nesterovv: true}"],
     "optim.kwargs: sgd takes no 'nesterovv' (did you mean 'nesterov'?); optim.kwargs takes momentum, "),
    (["optim.name=sgd", "optim.betas=[0.8, 0.9]"], "optim.betas: sgd takes no betas"),
    (["optim.name=adafactor", "optim.eps=1e-6"], "optim.eps: adafactor takes no single eps (its eps is (None, 0.001)"),
    (["optim.name=adafactor", "optim.fused=true"], "optim.fused: adafactor has no fused kernel"),
    (["optim.name=rprop"], "optim.weight_decay: rprop has no weight decay; set optim.weight_decay: 0"),
    (["optim.name=sgd", "optim.kwargs={nesterov: true}"],
     "optim.kwargs: sgd refused its arguments (Nesterov momentum requires a momentum and zero dampening)"),
    (["optim.name=torch.nn:Linear"], "optim.name: torch.nn:Linear is not a torch.optim.Optimizer class"),
    (["optim.name=muon", "optim.kwargs={ns_step: 3}"], "optim.kwargs: muon takes no 'ns_step' (did you mean "
                                                       "'ns_steps'?)"),
], ids=["typo", "case", "lbfgs", "lr", "kwarg", "betas", "eps", "fused", "no_decay", "value", "not_optimizer",
        "muon_kwarg"])
def test_an_optimizer_the_recipe_cannot_build_is_one_line_before_the_data(sets_, says, tmp_path):
    from helpers import train_in_process
    from s4accel.errors import RecipeError

    # data.files names a file that is not there: the optimizer is checked before the data is read
    overrides = [f"run.out_dir={tmp_path / 'run'}", "data.source=files", f"data.files=[{tmp_path / 'later.txt'}]",
                 *sets_]
    with pytest.raises(RecipeError) as info:
        train_in_process(TINY, overrides)
    message = str(info.value).removeprefix(f"{TINY}: ")  # a key the recipe's validation refuses names its file
    assert message.startswith(says) and "\n" not in message, message
    assert not (tmp_path / "run").exists()


def test_an_optimizer_error_from_the_command_line_is_one_line_and_exit_2(tmp_path):
    proc = run_cli("train", TINY, *sets(f"run.out_dir={tmp_path / 'run'}", "optim.name=sgd",
                                        "optim.kwargs={momentum: -1}"))
    assert proc.returncode == 2 and proc.stderr == "error: optim.kwargs: sgd refused its arguments (Invalid " \
                                                   "momentum value: -1)\n", proc.stderr


OWN_OPTIMIZER = '''
import torch


class CountedSGD(torch.optim.SGD):
    """SGD that appends a line to `log` at each step."""

    def __init__(self, params, lr, weight_decay=0.0, momentum=0.0, log=None):
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum)
        self.log = log

    def step(self, closure=None):
        with open(self.log, "a") as f:
            f.write("step\\n")
        return super().step(closure)
'''


def test_a_class_of_your_own_is_the_optimizer_with_its_arguments(tmp_path):
    from helpers import train_in_process

    (tmp_path / "my_optim.py").write_text(OWN_OPTIMIZER)
    log = tmp_path / "steps.log"
    text = small_text_file(tmp_path)
    result = train_in_process(TINY, [f"run.out_dir={tmp_path / 'run'}", "data.source=files", f"data.files=[{text}]",
                                     f"optim.name={tmp_path / 'my_optim.py'}:CountedSGD",
                                     f"optim.kwargs={{momentum: 0.5, log: {log}}}", "train.max_steps=3",
                                     "train.eval_every=0", "sample.prompts=[]"])
    assert result.steps == 3 and log.read_text() == "step\n" * 3


@pytest.mark.parametrize("optimizer", [["optim.name=sgd", "optim.kwargs={momentum: 0.9}", "optim.lr=0.05"],
                                       ["optim.name=muon", "optim.kwargs={momentum: 0.9}"]], ids=["sgd", "muon"])
def test_another_optimizer_resumes_bit_exactly_and_the_optimizer_cannot_change_on_resume(optimizer, tmp_path):
    """The momentum buffers are in the checkpoint (Muon's and its AdamW's states, two optimizers): 5 steps (stopped by
    a signal), then 7 more after a resume, end on the weights of 12 in one go. Another optimizer cannot take them
    over, even with --force."""
    from helpers import callback_override, final_weights, short_epochs, train_in_process
    from s4accel.errors import ResumeError

    text = small_text_file(tmp_path)
    settings = [*optimizer, "optim.weight_decay=0.1", "train.max_steps=12"]
    train_in_process(TINY, short_epochs(text, tmp_path / "whole", *settings))
    cut = tmp_path / "cut"
    stopped = train_in_process(TINY, short_epochs(text, cut, *settings,
                                                  callback_override("testing_callbacks:SignalAt", step=4)))
    assert stopped.preempted and stopped.steps == 5
    train_in_process(TINY, short_epochs(text, cut, *settings), resume="latest")
    whole, resumed = final_weights(tmp_path / "whole"), final_weights(cut)
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    name = optimizer[0].split("=")[1]
    with pytest.raises(ResumeError, match=rf"optim.name cannot change when resuming, even with --force: the "
                                          rf"checkpoint holds the old optimizer's state \(optim.name: '{name}' -> "):
        train_in_process(TINY, short_epochs(text, cut, *settings, "optim.name=adam", "optim.kwargs={}",
                                            "train.max_steps=14"), resume="latest", force=True)


def test_muon_trains_the_blocks_matrices_and_adamw_everything_else(tiny_config, monkeypatch):
    """Muon gets the 2-D matrices of the blocks (not S4's SSM parameters, the embeddings or the MoE experts' 3-D
    weights), AdamW the rest in its groups: each trained parameter in exactly one. Refused where the matrices are
    sharded. lr-find steps both."""
    from s4accel.errors import RecipeError
    from s4accel.training.optim import build_optimizers, check_optimizer
    from s4accel.training.tasks_builtin import build_model

    for recipe_path in (TINY, REPO / "recipes" / "shakespeare_moe.yaml"):
        recipe = load_recipe(recipe_path, ["optim.name=muon", "optim.kwargs={momentum: 0.9}"])
        model = build_model(recipe, None, device="meta", spec=data_spec(recipe.data, None))
        (muon_name, muon), (adamw_name, adamw) = build_optimizers(model, recipe.optim)
        assert (muon_name, type(muon), adamw_name, type(adamw)) == ("muon", torch.optim.Muon, "adamw",
                                                                     torch.optim.AdamW)
        names = {id(p): n for n, p in model.named_parameters()}
        matrices = {names[id(p)] for p in muon.param_groups[0]["params"]}
        rest = {g["name"]: {names[id(p)] for p in g["params"]} for g in adamw.param_groups}
        assert matrices and all(".layers." in n and n.endswith(("output_linear.weight", "qkv_proj.weight",
                                                                  "o_proj.weight", "router.weight")) for n in matrices)
        assert muon.defaults["momentum"] == 0.9 and muon.defaults["adjust_lr_fn"] == "match_rms_adamw"
        assert not any(n.endswith(("A_imag", "log_A_real", "log_dt", "embeddings.weight", "experts.gate_up_proj"))
                       for n in matrices)
        together = [matrices, *rest.values()]
        assert sum(map(len, together)) == len(set().union(*together)) == len(names)  # each in one, all in one
    for kind in ("FSDP", "DEEPSPEED"):
        with pytest.raises(RecipeError, match=f"optim.name: muon runs on one process or DDP, not {kind}"):
            check_optimizer(recipe.optim, "cpu", kind)
    check_optimizer(recipe.optim, "cpu", "MULTI_CPU")

    from s4accel.tools.finders import find_lr

    steps = {}
    for cls in (torch.optim.Muon, torch.optim.AdamW):
        def counted(self, *args, _step=cls.step, _name=cls.__name__, **kwargs):
            steps[_name] = steps.get(_name, 0) + 1
            return _step(self, *args, **kwargs)
        monkeypatch.setattr(cls, "step", counted)
    find_lr(load_recipe(TINY, ["optim.name=muon", "data.seq_len=32"]), steps=8, diverge=1e9)
    assert steps == {"Muon": 8, "AdamW": 8}


def test_a_checkpoint_from_before_optim_name_resumes_as_the_adamw_run_it_was():
    from s4accel.training.runs.resume import recipe_diff

    old = load_recipe(TINY).to_dict()
    del old["optim"]["name"], old["optim"]["kwargs"]
    assert recipe_diff(old, load_recipe(TINY).to_dict()) == []
    assert recipe_diff(old, load_recipe(TINY, ["optim.name=sgd"]).to_dict()) == ["optim.name: 'adamw' -> 'sgd'"]


def test_show_names_the_optimizer_and_its_groups_and_refuses_its_bad_arguments_before_printing():
    """What the SSM group holds, at which rate, and what weight decay touches, before a run: frozen parameters are
    in no group. An argument the optimizer refuses is the command's one line, and nothing else is printed."""
    proc = run_cli("show", TINY, "--depth", "0", *sets("optim.name=sgd", "optim.kwargs={momentum: 0.9}",
                                                       "model.freeze=[backbone.embeddings.*]"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == ("# optimizer: torch.optim.SGD (momentum 0.9); ssm 2,176 (lr 0.001); decay "
                                            "18,432 (lr 0.003, weight decay 0.01); no_decay 768 (lr 0.003)")
    bad = run_cli("show", TINY, *sets("optim.name=sgd", "optim.kwargs={momentum: -1}"))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "error: optim.kwargs: sgd refused its arguments (Invalid momentum value: -1)\n"
