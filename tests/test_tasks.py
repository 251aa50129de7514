"""Tasks of your own (s4accel/training/task.py) and the worked examples in examples/: a regression on a real table with
automatic optimisation, and a GAN whose two optimizers take turns (manual optimisation); both resume exactly."""

import json
import math
import sys

import pytest
import torch

from helpers import (FREE_PORT, REPO, TESTS_ON_PATH, TINY, accelerate_launch, callback_override, final_weights,
                     read_metrics, run_cli, train_in_process)

EXAMPLES = REPO / "examples"
DIABETES = EXAMPLES / "diabetes.yaml"
GAN = EXAMPLES / "digits_gan.yaml"
DIABETES_TASK = f"task.target={EXAMPLES / 'diabetes_regression.py'}:DiabetesRegression"
GAN_TASK = f"task.target={EXAMPLES / 'digits_gan.py'}:DigitsGANTask"


def quiet(out, *extra):
    return [f"run.out_dir={out}", "log.progress_bar=false", *extra]


def evals(run_dir, key):
    return [r[key] for r in read_metrics(run_dir) if key in r]


def test_regression_task_on_the_diabetes_table_learns_what_least_squares_does(tmp_path):
    """The MLP of examples/diabetes_regression.py reaches the R^2 of ordinary least squares on the same 80/20 split
    (0.523; the table is close to linear) within 0.03, and its exported weights reproduce the reported metrics."""
    import numpy as np

    sys.path.insert(0, str(EXAMPLES))
    from diabetes_regression import DiabetesMLP, read_diabetes

    out = tmp_path / "run"
    result = train_in_process(DIABETES, quiet(out, DIABETES_TASK))
    assert result.steps == 300 and result.eval_metrics["r2"] > 0.49
    assert (out / "best").is_dir() and (out / "final" / "model.safetensors").is_file()
    x, y = read_diabetes()
    order = np.random.default_rng(0).permutation(len(x))
    test, train = order[:88], order[88:]
    mean, std = x[train].mean(0), x[train].std(0)
    model = DiabetesMLP(10, 64, 2, 0.1).eval()
    model.load_state_dict(final_weights(out))
    with torch.no_grad():
        pred = model(torch.tensor((x[test] - mean) / std, dtype=torch.float32)).double().numpy()
    pred = pred * y[train].std() + y[train].mean()
    r2 = 1 - ((pred - y[test]) ** 2).mean() / y[test].var()
    assert r2 == pytest.approx(result.eval_metrics["r2"], abs=1e-5)  # gathered over the whole test split
    assert "train/lr_decay" in read_metrics(out)[0]  # the recipe's optimizer, parameter groups and schedule


def test_gan_task_two_optimizers_take_turns_and_the_generated_digits_improve(tmp_path):
    out = tmp_path / "run"
    result = train_in_process(GAN, quiet(out, GAN_TASK, "train.max_steps=750"))
    assert result.steps == 750
    gap, entropy = evals(out, "eval/mean_gap"), evals(out, "eval/class_entropy")
    assert gap[-1] < 0.6 * gap[0] and gap[-1] < 2.5  # pixel means in 0..16: near the real digits' means
    assert entropy[-1] > 1.7  # most of the 10 classes (ln 10 = 2.30), not one collapsed mode
    logs = [r for r in read_metrics(out) if "train/d_loss" in r]
    assert len(logs) == 15 and all(math.isfinite(r["train/d_loss"] + r["train/g_loss"]) for r in logs)
    for name in ("generator", "discriminator"):  # each optimizer's own schedule and gradient norm
        assert logs[0][f"train/lr_{name}_0"] == 2e-4 and logs[0][f"train/grad_norm_{name}"] > 0
    assert (out / "samples.png").stat().st_size > 1000
    weights = final_weights(out)
    assert any(k.startswith("generator.") for k in weights) and any(k.startswith("discriminator.") for k in weights)


def test_manual_backward_reaches_only_its_optimizers_parameters_and_step_waits_for_the_window():
    """`backward(loss, "g")` leaves the other optimizer's gradients alone (a GAN's generator loss runs through the
    discriminator); `step` acts only on a window's last micro-batch, with the window's mean gradient."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import GradientAccumulationPlugin

    from s4accel.config import Recipe
    from s4accel.training.task import Task, TaskContext, TrainOptimizer

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2,
                                                                                        sync_with_dataloader=False))
    task = Task(Recipe.model_validate({"train": {"clip_grad_norm": None}}))
    task.automatic_optimization = False
    context = TaskContext(acc, run_dir=None)
    task.setup(context)
    a, b = torch.nn.Linear(3, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    opt_a, opt_b = acc.prepare(torch.optim.SGD(a.parameters(), lr=1.0), torch.optim.SGD(b.parameters(), lr=1.0))
    sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0)  # noqa: E731
    context.optimizers = {"a": TrainOptimizer("a", opt_a, sched(opt_a)), "b": TrainOptimizer("b", opt_b, sched(opt_b))}
    w0 = a.weight.detach().clone()
    xs = [torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[3.0, 0.0, -1.0]])]
    for i, x in enumerate(xs):
        with acc.accumulate(a):
            task.backward(b(a(x)).sum(), "a")
            assert b.weight.grad is None  # the loss ran through b, but only a's parameters got gradients
            assert (task.step("a") is None) == (i == 0)  # the first micro-batch only accumulates
    expected = w0 - b.weight.detach() * sum(xs) / 2  # SGD with lr 1 on the window's mean gradient
    assert torch.allclose(a.weight, expected) and a.weight.grad is None
    with pytest.raises(KeyError, match="no optimizer named 'c'"):
        task.step("c")


def test_task_recipe_errors_are_one_line_exit_2(tmp_path):
    bad = [("task.target=nosuchpkg.tasks:X", "task.target: cannot import 'nosuchpkg.tasks:X'"),
           (f"task.target={EXAMPLES / 'digits_gan.py'}:DigitsGAN", "is not a task (subclass s4accel.Task)"),
           ("task.target=causal_lm", None),
           ("task.target=classificaton", "did you mean 'classification'"),
           ("task.args={hiden: 3}", "task.args: DiabetesRegression does not take these arguments"),
           ("checkpoint.best_metric=accuracy", "DiabetesRegression reports no metric 'accuracy'")]
    for item, message in bad:
        sets = ["--set", item] if item.startswith("task.target") else ["--set", DIABETES_TASK, "--set", item]
        proc = run_cli("train", DIABETES, "--set", f"run.out_dir={tmp_path / 'r'}", *sets)
        if message is None:  # a built-in by name on data of the other kind
            message = "task.target: 'causal_lm' trains on text data, but data.source 'digits' is array data"
            proc = run_cli("train", REPO / "recipes" / "digits.yaml", "--set", item)
        assert proc.returncode == 2, (item, proc.stderr[-2000:])
        assert message in proc.stderr and "Traceback" not in proc.stderr, (item, proc.stderr)


def test_two_projects_hooks_py_in_one_session_are_each_their_own_and_an_edited_one_is_read_again(tmp_path):
    """A notebook or a sweep calls `s4accel.train` on recipes of several folders, each naming its own `hooks.py`:
    each run gets the code of its own file (once, the first file of that name was served to every later run), and a
    file edited between two runs is read again; one recipe naming the same file twice gets one module."""
    import yaml

    from s4accel.config import load_recipe
    from s4accel.training.loop import build_callbacks

    def project(name, said):
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        (folder / "hooks.py").write_text(f"import s4accel\n\nclass Say(s4accel.Callback):\n    said = {said!r}\n")
        recipe = {**yaml.safe_load(TINY.read_text()), "callbacks": [{"target": "hooks.py:Say"}] * 2}
        (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        return build_callbacks(load_recipe(folder / "recipe.yaml")).callbacks

    first, again = project("a", "a")
    assert (first.said, again.said) == ("a", "a") and type(first) is type(again)
    assert [cb.said for cb in project("b", "b")] == ["b", "b"]
    assert [cb.said for cb in project("a", "a, edited")] == ["a, edited"] * 2
    assert [cb.said for cb in project("a", "a")] == ["a", "a"]


def test_builtin_tasks_are_tasks_chosen_by_the_data_or_by_name():
    from s4accel.config import load_recipe
    from s4accel.training.task import task_class
    from s4accel.training.tasks_builtin import CausalLMTask, SequenceClassificationTask

    assert task_class(load_recipe(REPO / "recipes" / "quickstart.yaml")) is CausalLMTask
    assert task_class(load_recipe(REPO / "recipes" / "digits.yaml")) is SequenceClassificationTask
    assert task_class(load_recipe(REPO / "recipes" / "digits.yaml", ["task.target=classification"])) \
        is SequenceClassificationTask


@pytest.mark.slow
@pytest.mark.parametrize("example", ["diabetes", "gan"])
def test_examples_resume_bit_exactly_after_a_preemption(tmp_path, example):
    recipe, task, steps, cut = {"diabetes": (DIABETES, DIABETES_TASK, 60, 27), "gan": (GAN, GAN_TASK, 60, 33)}[example]
    common = [task, f"train.max_steps={steps}", "train.eval_every=20", "checkpoint.every_steps=25",
              "checkpoint.keep_best=0", "train.grad_accum=2"]
    ref = train_in_process(recipe, quiet(tmp_path / "ref", *common))
    out = tmp_path / "cut"
    first = train_in_process(recipe, quiet(out, *common, callback_override("testing_callbacks:SignalAt", step=cut)))
    assert first.preempted and first.steps == cut + 1
    resumed = train_in_process(recipe, quiet(out, *common), resume="latest")
    assert resumed.steps == steps and ref.steps == steps
    a, b = final_weights(tmp_path / "ref"), final_weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    key = "eval/r2" if example == "diabetes" else "eval/mean_gap"
    assert evals(out, key) == evals(tmp_path / "ref", key)


@pytest.mark.slow
def test_two_process_gan_keeps_both_models_identical_on_every_rank(tmp_path):
    """Manual optimisation does not wrap the model in DDP; `step` averages the gradients itself. If it did not, the
    two ranks (different batches and noise) would drift apart at the first step."""
    run_dir, sums = tmp_path / "run", tmp_path / "sums.json"
    proc = accelerate_launch(*FREE_PORT, "--config_file", REPO / "accelerate_configs" / "cpu_2proc.yaml", "-m",
                             "s4accel", "train", GAN, "--set", GAN_TASK, "--set", f"run.out_dir={run_dir}",
                             "--set", "train.max_steps=30", "--set", "train.eval_every=15",
                             "--set", "log.progress_bar=false",
                             "--set", callback_override("testing_callbacks:SameWeightsOnAllRanks", path=str(sums)),
                             env=TESTS_ON_PATH)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rank0, rank1 = json.loads(sums.read_text())
    assert rank0 == rank1
    assert "DDP over 2 processes on cpu" in proc.stdout
    assert len(evals(run_dir, "eval/mean_gap")) == 2


def test_show_lr_find_and_find_batch_size_go_through_the_recipes_task(tmp_path):
    """The tools build the task's own model and run its own training step, not an S4 model on Shakespeare."""
    task = ["--set", DIABETES_TASK]
    proc = run_cli("show", DIABETES, *task)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # DiabetesMLP(10, 64, depth 2): 10*64 + 64 + 64*64 + 64 + 64 + 1 parameters
    assert proc.stdout.strip().splitlines()[-2:] == [
        "# model: DiabetesMLP (DiabetesRegression), 4,929 parameters",
        "# optimizer: torch.optim.AdamW; decay 4,800 (lr 0.001, weight decay 0.1); no_decay 129 (lr 0.001)"]

    proc = run_cli("lr-find", DIABETES, *task, "--steps", "12", "--min-lr", "1e-5", "--max-lr", "1e-3",
                   "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = json.loads((tmp_path / "lr_find.json").read_text())["losses"]
    assert len(losses) == 12 and all(0.2 < v < 3 for v in losses)  # the standardised target's mse, not ln(259)

    proc = run_cli("find-batch-size", DIABETES, *task, "--memory-mb", "100000", "--max-batch", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = [line for line in proc.stdout.splitlines() if line.startswith("largest batch size")]
    assert answer and answer[0].startswith("largest batch size within 100,000 MiB on cpu: 2")

    proc = run_cli("lr-find", GAN, "--set", GAN_TASK)
    assert proc.returncode == 2
    assert "lr-find: DigitsGANTask uses manual optimisation" in proc.stderr


def test_predict_or_generate_on_a_custom_task_run_is_one_line_pointing_at_eval(tmp_path):
    """Its export is the task's own weights without config.json: predict was a FileNotFoundError traceback."""
    from s4accel.errors import ModelError
    from s4accel.tools.inference import load_model

    out = tmp_path / "run"
    train_in_process(DIABETES, quiet(out, DIABETES_TASK, "train.max_steps=25"))
    with pytest.raises(ModelError, match=r"final: no config.json; weights without one are a custom task's model, "
                                         r"which only its task can build: score it with "
                                         r"`s4accel eval RUN_DIR RECIPE`"):
        load_model(out)


@pytest.mark.filterwarnings("ignore:fp16 mixed precision has no effect on CPU")
def test_a_gan_under_fp16s_gradscaler_skips_its_overflowing_updates_and_trains_on(tmp_path):
    """Manual optimisation under fp16 (torch's CPU GradScaler where Accelerate puts its CUDA one): updates whose
    gradients overflow are skipped as the scaler's, the scale comes down, and the GAN trains on (they were counted
    as non-finite steps, ten in a row stopped the run, and the scale stayed where it overflowed)."""
    from helpers import callback_override

    out, scale = tmp_path / "run", tmp_path / "scale.txt"
    result = train_in_process(GAN, quiet(out, GAN_TASK, "train.max_steps=20", "train.mixed_precision=fp16",
                                         "log.log_every=1", callback_override("testing_callbacks:CPUGradScaler",
                                                                              overflows=3, path=str(scale))))
    assert result.steps == 20
    last = [r for r in read_metrics(out) if "train/scaler_skips" in r][-1]
    assert last["train/scaler_skips"] == 3 and last["train/nonfinite_skips"] == 0
    assert float(scale.read_text()) < 2.0**16
