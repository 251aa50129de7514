"""`s4accel sweep`: a hyperparameter search over the recipe's `sweep` section (Optuna), each trial a run of its own,
its values checked before the first trial, the study kept so that a stopped sweep continues."""

import json
import subprocess
import sys
import time

import pytest

from helpers import REPO, TESTS_ON_PATH, TINY, read_metrics, run_cli, sets
from s4accel.config import load_recipe
from s4accel.errors import RecipeError
from s4accel.tools import sweep as sweeps
from s4accel.tools.sweep import check_sweep, sampler_for, sweep_dir

GRID = "sweep={trials: 3, sampler: grid, params: {optim.lr: [3.0e-3, 1.0e-3, 1.0e-9]}, prune: {after_trials: 2}}"


def checked(*items):
    return check_sweep(TINY, list(items), load_recipe(TINY, list(items)))


@pytest.mark.parametrize("sweep, said", [
    ("{params: {}}", "sweep: params: name at least one recipe key and the values to try, e.g. {optim.lr:"),
    ("{params: {optim.lr: []}}", "params.optim.lr: an empty list of values"),
    ("{params: {lr: [0.1]}}", "params.lr: expected a recipe key with its section, e.g. optim.lr"),
    ("{sampler: grid, params: {optim.lr: {low: 0.1, high: 1}}}", "sampler grid tries lists of values; optim.lr is "
                                                                  "a range"),
    ("{params: {optim.lr: {low: 1, high: 0.1}}}", "sweep.params: optim.lr: low (1) must be below high (0.1)"),
    ("{params: {optim.lr: {low: 0, high: 0.1, log: true}}}", "sweep.params: optim.lr: log needs low above 0, got 0"),
    ("{params: {optim.lr: {low: 0.1}}}", "sweep.params: optim.lr.high: Field required"),
    ("{params: {optim.lr: 0.1}}", "sweep.params: optim.lr: expected a list of values or a range {low, high}, got "
                                  "0.1"),
    ("{params: {optim.lr: [0.1]}, prune: {after_trials: -1}}", "sweep.prune.after_trials: Input should be greater "
                                                               "than or equal to 0"),
])
def test_a_wrong_sweep_section_is_one_line_naming_the_key(sweep, said):
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, [f"sweep={sweep}"])
    assert said in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("params, said", [
    ("{optim.lr: [0.001, -1]}", "sweep.params.optim.lr: the value -1 is not one the recipe takes: optim.lr: Input "
                                "should be greater than 0"),
    ("{optim.lrr: [0.001]}", "sweep.params.optim.lrr: the value 0.001 is not one the recipe takes: optim.lrr: "
                             "unknown key (did you mean 'lr'?)"),
    ("{data.batch_size: {low: 0, high: 8}}", "sweep.params.data.batch_size: the value 0 is not one the recipe "
                                             "takes: data.batch_size: Input should be greater than or equal to 1"),
    ("{model.overrides.d_modell: [32]}", "sweep.params.model.overrides.d_modell: the value 32 is not one the "
                                         "recipe takes: model.overrides: unknown key 'd_modell' (did you mean "
                                         "'d_model'?)"),
])
def test_every_value_a_sweep_names_is_checked_as_the_trial_will_be_before_the_first_trial(params, said):
    with pytest.raises(RecipeError) as info:
        checked(f"sweep={{params: {params}}}")
    assert said in str(info.value), str(info.value)


def test_the_sweep_metric_is_one_the_task_reports_and_the_recipe_needs_a_sweep():
    with pytest.raises(RecipeError, match="sweep.metric: CausalLMTask reports no metric 'accuracy'"):
        checked("sweep={params: {optim.lr: [0.001]}, metric: accuracy}")
    with pytest.raises(RecipeError, match="no sweep section: add one, e.g. sweep:"):
        checked()
    assert checked("sweep={params: {optim.lr: [0.001]}}").trials == 20
    assert sweep_dir(load_recipe(TINY, ["run.out_dir=runs/x"])).name == "x-sweep"


@pytest.mark.slow
def test_a_grid_sweep_trains_each_value_prunes_the_one_behind_and_writes_the_best_as_a_recipe(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("sweep", TINY, *sets(f"run.out_dir={run}", GRID, "train.max_steps=12", "train.eval_every=4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    home = tmp_path / "run-sweep"
    ended = [line for line in proc.stdout.splitlines() if " -> " in line]
    assert [line.split(" -> ")[0] for line in ended] == ["trial 0: optim.lr=0.003", "trial 1: optim.lr=0.001",
                                                         "trial 2: optim.lr=1e-09"]
    assert ended[2].startswith("trial 2: optim.lr=1e-09 -> pruned at step 4 (loss ")  # worse than both at step 4
    finals = {}
    for i in (0, 1):  # each trial's value is its run's last evaluation
        evals = [r for r in read_metrics(home / f"trial_{i:04d}") if "eval/loss" in r]
        assert evals[-1]["step"] == 12
        finals[i] = evals[-1]["eval/loss"]
        assert ended[i].endswith(f"-> loss {finals[i]:.4f}")
    assert [r["step"] for r in read_metrics(home / "trial_0002") if "eval/loss" in r] == [4]
    best = min(finals, key=finals.get)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"best of 2 complete trial(s): trial {best}, loss {finals[best]:.4f} with optim.lr=")
    tuned = load_recipe(home / "best.yaml")
    assert tuned.sweep is None and tuned.optim.lr == [3e-3, 1e-3][best] and tuned.run.dir == run
    assert not run.exists()  # the trials train in the sweep's folder
    again = run_cli("sweep", TINY, *sets(f"run.out_dir={run}", GRID, "train.max_steps=12", "train.eval_every=4"))
    assert again.returncode == 0 and again.stdout.strip() == last  # the study is done: no new trial
    # a trial is a run like any other: trained on by hand, it reports to no one (its trial in the study has ended)
    more = run_cli("train", home / "trial_0000", "--resume", "--force", *sets("train.max_steps=16"))
    assert more.returncode == 0 and "done: 16 steps" in more.stdout, more.stderr[-3000:]


@pytest.mark.slow
def test_a_sweep_stopped_mid_trial_continues_that_trial_from_its_checkpoint(tmp_path):
    """The first trial is stopped by SIGTERM after step 5 (what Ctrl-C or a scheduler does); the sweep says how to
    continue and exits 130. The same command resumes that trial from its checkpoint, then runs the next."""
    run = tmp_path / "run"
    once = tmp_path / "once"
    stop = f"callbacks=[{{target: 'testing_callbacks:SignalOnceAt', args: {{step: 5, marker: '{once}'}}}}]"
    items = sets(f"run.out_dir={run}", "sweep={trials: 2, sampler: random, params: {optim.lr: {low: 1.0e-3, high: "
                 "1.0e-2, log: true}}, prune: null}", "train.max_steps=10", "train.eval_every=10", "log.log_every=1",
                 stop)
    cut = run_cli("sweep", TINY, *items, env=TESTS_ON_PATH)
    assert cut.returncode == 130, cut.stderr[-3000:]
    home = tmp_path / "run-sweep"
    assert "-> stopped at step 6 (received SIGTERM)" in cut.stdout
    assert f"sweep stopped; trial 0 has a checkpoint in {home / 'trial_0000'}" in cut.stdout
    done = run_cli("sweep", TINY, *items, env=TESTS_ON_PATH)
    assert done.returncode == 0, done.stderr[-3000:]
    started = [line for line in done.stdout.splitlines() if "; training in " in line]
    assert started[0].startswith("trial 1 (trial 0 resumed): optim.lr=")
    assert started[0].endswith(str(home / "trial_0000"))
    assert started[1].startswith("trial 2: optim.lr=") and started[1].endswith(str(home / "trial_0002"))
    assert started[0].split(": ")[1].split(";")[0] == cut.stdout.splitlines()[0].split(": ")[1].split(";")[0]
    log = (home / "trial_0000" / "train.log").read_text()
    assert f"resumed from {home / 'trial_0000' / 'checkpoints' / 'step_00000006'} at step 6" in log
    assert [r["step"] for r in read_metrics(home / "trial_0000") if "train/loss" in r] == list(range(1, 11))
    assert done.stdout.strip().splitlines()[-1].startswith("best of 2 complete trial(s)")
    assert json.loads(json.dumps(load_recipe(home / "best.yaml").to_dict()))["sweep"] is None


def test_a_run_directory_is_swept_from_its_recipe_file(tmp_path, monkeypatch):
    """Read as a run directory, the recipe would keep every trial in that directory whatever run.out_dir says."""
    (tmp_path / "recipe.yaml").write_text(TINY.read_text())
    seen = []
    monkeypatch.setattr(sweeps, "_run_sweep", lambda path, *rest: seen.append(path))
    sweeps.run_sweep(tmp_path)
    assert seen == [tmp_path / "recipe.yaml"]


def test_each_trial_number_samples_with_its_own_seed_so_sweeps_sharing_a_study_try_different_values():
    """One seeded sampler per sweep command would give two commands sharing a study the same values."""
    import optuna

    recipe = load_recipe(TINY, ["sweep={params: {optim.lr: {low: 1.0e-4, high: 1.0e-2, log: true}}}"])

    def first(number):
        study = optuna.create_study(sampler=sampler_for(recipe.sweep, recipe, number))
        return study.ask().suggest_float("optim.lr", 1e-4, 1e-2, log=True)

    assert first(0) == first(0) and first(1) == first(1) and first(0) != first(1)


@pytest.mark.slow
def test_each_trial_can_train_on_the_processes_of_a_launch_config_and_is_pruned_on_all_of_them(tmp_path):
    config = tmp_path / "two.yaml"
    config.write_text((REPO / "accelerate_configs" / "cpu_2proc.yaml").read_text() + "main_process_port: 0\n")
    run = tmp_path / "run"
    proc = run_cli("sweep", TINY, "--launch-config", config, *sets(
        f"run.out_dir={run}", "sweep={trials: 2, sampler: grid, params: {optim.lr: [3.0e-3, 1.0e-9]}, prune: "
        "{after_trials: 1}}", "train.max_steps=8", "train.eval_every=4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = [line for line in proc.stdout.splitlines() if " -> " in line]
    assert ended[0].startswith("trial 0: optim.lr=0.003 -> loss ")
    assert ended[1].startswith("trial 1: optim.lr=1e-09 -> pruned at step 4 (loss ")
    home = tmp_path / "run-sweep"
    for trial in ("trial_0000", "trial_0001"):
        assert "DDP over 2 processes on cpu" in (home / trial / "train.log").read_text()
    assert (home / "trial_0001" / "train.log").read_text().count("pruned by the sweep") == 1


@pytest.mark.slow
def test_a_sweep_killed_with_its_machine_leaves_its_trial_saved_and_the_next_sweep_resumes_it(tmp_path, monkeypatch):
    """SIGKILL to the sweep (its machine lost): the trial it ran is told to stop (it saves a checkpoint rather than
    train on unwatched), the study hears no more from it, and the next sweep resumes it from that checkpoint once it
    has been silent for three heartbeats (1 s each here)."""
    run = tmp_path / "run"
    items = [f"run.out_dir={run}", "sweep={trials: 1, params: {optim.lr: [3.0e-3]}, prune: null}",
             "train.max_steps=300", "checkpoint.every_steps=1", "checkpoint.keep_last=1", "log.progress_bar=false"]
    sweep = subprocess.Popen([sys.executable, "-m", "s4accel", "sweep", str(TINY), *sets(*items)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    trial = tmp_path / "run-sweep" / "trial_0000"
    deadline = time.monotonic() + 120
    while not list((trial / "checkpoints").glob("step_*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    sweep.kill()
    sweep.wait()
    log = trial / "train.log"
    while not log.read_text().strip().splitlines()[-1].startswith("stopped at step") and time.monotonic() < deadline:
        time.sleep(0.2)
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("stopped at step"), log.read_text()
    stopped_at = int(last.split()[3])
    assert stopped_at < 300  # it stopped when the sweep died, with a checkpoint

    monkeypatch.setattr(sweeps, "HEARTBEAT_S", 1)
    time.sleep(3.5)
    lines = []
    sweeps.run_sweep(TINY, items, echo=lines.append)
    assert lines[0] == f"trial 1 (trial 0 resumed): optim.lr=0.003; training in {trial}"
    assert f"resumed from {trial / 'checkpoints' / f'step_{stopped_at:08d}'} at step {stopped_at}" in log.read_text()
    assert lines[-1].startswith("best of 1 complete trial(s): trial 1, loss ")


@pytest.mark.slow
def test_a_failed_trial_is_one_line_with_its_log_and_the_sweep_goes_on(tmp_path):
    """A trial whose run fails (here a callback's bug at step 2; out of memory at the largest batch, in life) is
    counted as failed, said in one line with its log, and the next trial runs."""
    run = tmp_path / "run"
    bug = "callbacks=[{target: 'testing_callbacks:RaisesAt', args: {step: 2}}]"
    proc = run_cli("sweep", TINY, *sets(f"run.out_dir={run}", "sweep={trials: 2, sampler: grid, params: {optim.lr: "
                                        "[3.0e-3, 1.0e-3]}}", "train.max_steps=4", bug), env=TESTS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    home = tmp_path / "run-sweep"
    ended = [line for line in proc.stdout.splitlines() if " -> " in line]
    assert ended == [f"trial {i}: optim.lr={lr} -> failed: RuntimeError: a bug at step 2 (its log: "
                     f"{home / f'trial_{i:04d}' / 'train.log'})" for i, lr in enumerate(("0.003", "0.001"))]
    assert proc.stdout.strip().splitlines()[-1] == f"no trial completed; the study is {home / 'study.db'}"


@pytest.mark.slow
def test_a_grid_value_whose_trial_stopped_before_its_first_checkpoint_is_tried_again(tmp_path):
    """Such a trial is not counted and cannot be resumed: its combination is still to do (the sweep took the next
    untaken one and, once none was left, stopped on a StopIteration short of its trials)."""
    import optuna

    items = [f"run.out_dir={tmp_path / 'run'}", "sweep={trials: 2, sampler: grid, params: {optim.lr: [3.0e-3, "
             "1.0e-3]}, prune: null}", "train.max_steps=4"]
    recipe = load_recipe(TINY, items)
    home = sweep_dir(recipe)
    home.mkdir(parents=True)
    study, _ = sweeps.open_study(home, recipe, recipe.sweep)
    for lr, state in (("0.003", optuna.trial.TrialState.FAIL), ("0.001", optuna.trial.TrialState.COMPLETE)):
        study.enqueue_trial({"optim.lr": lr})
        trial = study.ask()
        trial.suggest_categorical("optim.lr", ["0.003", "0.001"])
        trial.set_user_attr("run_dir", str(home / f"trial_{trial.number:04d}"))
        if state == optuna.trial.TrialState.FAIL:
            trial.set_user_attr("stopped", "interrupted")  # before its first checkpoint: nothing to resume
            study.tell(trial, state=state)
        else:
            study.tell(trial, 1.0)
    lines = []
    sweeps.run_sweep(TINY, items, echo=lines.append)
    assert [line.split(" -> ")[0] for line in lines if " -> " in line] == ["trial 2: optim.lr=0.003"]


SLOW_ASK = """
import sys, time
import optuna
from s4accel.cli import main

ask = optuna.study.Study.ask


def slow_ask(self, *args, **kwargs):  # a wide window between reading the study and taking a trial
    time.sleep(4)
    return ask(self, *args, **kwargs)


optuna.study.Study.ask = slow_ask
sys.argv[0] = "s4accel"
main()
"""


@pytest.mark.slow
def test_two_sweeps_sharing_a_study_take_its_last_trial_once(tmp_path):
    """Two sweep commands started together on a new study of 1 trial, each slow between reading the study and taking
    its trial: both open the study (its tables created once: two at once collided now and then), one takes the
    trial, the other finds the study done (without the study's lock both took one, 2 trials)."""
    script = tmp_path / "slow_ask.py"
    script.write_text(SLOW_ASK)
    items = sets(f"run.out_dir={tmp_path / 'run'}", "sweep={trials: 1, params: {optim.lr: [3.0e-3]}, prune: null}",
                 "train.max_steps=2", "log.progress_bar=false")
    procs = [subprocess.Popen([sys.executable, str(script), "sweep", str(TINY), *items], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    import optuna

    study = optuna.load_study(study_name="s4-tiny-debug",
                              storage=f"sqlite:///{tmp_path / 'run-sweep' / 'study.db'}")
    assert len(study.trials) == 1, [out for out, _ in outs]
    assert sum("trial 0: optim.lr=0.003 -> loss" in out for out, _ in outs) == 1


def _open_at_once(home, barrier, results):
    recipe = load_recipe(TINY, [f"run.out_dir={home}/run", "sweep={trials: 1, params: {optim.lr: [0.001]}}"])
    barrier.wait()
    try:
        sweeps.open_study(home, recipe, recipe.sweep)
        results.put("opened")
    except Exception as e:  # what a sweep started at the same moment as another met: the schema created twice
        results.put(f"{type(e).__name__}: {str(e)[:200]}")


@pytest.mark.slow
def test_sweeps_started_at_the_same_moment_on_a_new_study_all_open_it(tmp_path):
    """Four processes open a new study at once, twice over (the loop a user writes to start one sweep per GPU):
    every one opens it (without the lock, about half met an IntegrityError creating its tables)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    for attempt in range(2):
        home = tmp_path / f"s{attempt}"
        home.mkdir()
        barrier, results = context.Barrier(4), context.Queue()
        procs = [context.Process(target=_open_at_once, args=(home, barrier, results)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert [results.get(timeout=5) for _ in procs] == ["opened"] * 4
