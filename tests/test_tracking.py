"""A tracker that fails to start or to log never stops training: retried with backoff, then disabled with a
warning, while the other trackers go on. A tracker that cannot be built here at all (its package missing) is refused
before any compute."""

import warnings

import pytest

from helpers import TINY, read_metrics, run_cli, sets, train_in_process
from s4accel.config import load_recipe
from s4accel.errors import RecipeError
from s4accel.training.observe.guarded import GuardedTracker


class Inner:
    name = "inner"
    requires_logging_directory = False

    def __init__(self, failures=0, error=ConnectionError):
        self.failures, self.error, self.logged, self.started = failures, error, [], 0

    @property
    def tracker(self):
        return self

    def start(self):
        self.started += 1

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        if self.failures:
            self.failures -= 1
            raise self.error("temporarily down")
        self.logged.append(step)

    def finish(self):
        pass


def guarded(inner, retries=3):
    sleeps = []
    tracker = GuardedTracker("inner", lambda run_id: inner, retries=retries, backoff_s=0.5, sleep=sleeps.append)
    tracker.start()
    tracker.store_init_configuration({"run_id": "abc"})  # where Accelerate's init_trackers starts it
    return tracker, sleeps


def test_a_transient_failure_is_retried_with_backoff():
    inner = Inner(failures=2)
    tracker, sleeps = guarded(inner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the third try succeeds
        tracker.log({"a": 1.0}, step=7)
        tracker.flush()
    assert inner.logged == [7] and sleeps == [0.5, 1.0] and not tracker.disabled


def test_a_tracker_that_keeps_failing_is_disabled_once_with_a_warning():
    inner = Inner(failures=100)
    tracker, sleeps = guarded(inner)
    with pytest.warns(UserWarning, match="tracker 'inner': log failed \\(ConnectionError: temporarily down\\); "
                                         "disabled, training goes on"):
        tracker.log({"a": 1.0}, step=1)
        tracker.flush()
    assert tracker.disabled and sleeps == [0.5, 1.0]
    tracker.log({"a": 2.0}, step=2)  # no more tries, no more warnings
    tracker.finish()
    assert inner.failures == 97


class Slow(Inner):
    """A tracker whose `log` takes 50 ms: a network call."""

    def log(self, values, step=None, **kwargs):
        import time

        time.sleep(0.05)
        self.values = [*getattr(self, "values", []), values["a"]]
        super().log(values, step=step)


def test_log_does_not_wait_for_the_tracker_and_keeps_its_order_until_the_backlog_is_full():
    """Training went on while a tracker's call ran (~0.5 ms a call on a 2-core machine, a few % of a small model's
    step): the calls queue in order; past `BACKLOG` waiting calls, `log` waits for its own."""
    import time

    inner = Slow()
    tracker, _ = guarded(inner)
    tracker.BACKLOG = 4
    values = {"a": 1.0}
    start = time.perf_counter()
    tracker.log(values, step=1)
    values["a"] = 2.0  # the caller reuses its dict: what was logged does not change
    assert time.perf_counter() - start < 0.04 and inner.logged == []  # returned before the call ran
    for step in range(2, 11):
        tracker.log({"a": 1.0}, step=step)
    assert len(inner.logged) >= 4  # the backlog made it wait
    tracker.finish()
    assert inner.logged == list(range(1, 11)) and inner.values == [1.0] * 10


def test_a_missing_package_is_not_retried():
    def make(run_id):
        raise ModuleNotFoundError("No module named 'wandb'")

    tracker = GuardedTracker("wandb", make, retries=3, backoff_s=0.5, sleep=pytest.fail)
    tracker.start()
    with pytest.warns(UserWarning, match="tracker 'wandb': start failed \\(ModuleNotFoundError"):
        tracker.store_init_configuration({"run_id": "abc"})
    tracker.log({"a": 1.0}, step=1)
    assert tracker.disabled


@pytest.mark.slow
def test_training_survives_a_tracker_that_cannot_start_and_one_that_dies_mid_run(tmp_path, text):
    from testing_callbacks import FlakyTracker

    out = tmp_path / "run"
    FlakyTracker.LOGGED.clear()
    with pytest.warns(UserWarning) as caught:
        result = train_in_process("recipes/s4_tiny_debug.yaml", [
            f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32",
            "train.max_steps=6", "train.eval_every=3", "log.log_every=1", "log.progress_bar=false",
            "sample.prompts=[]", "log.log_with=[jsonl, tensorboard, 'testing_callbacks:UnreachableTracker', "
                                 "'testing_callbacks:FlakyTracker']",
            "log.tracker_kwargs={'testing_callbacks:FlakyTracker': {fail_from: 3}}", "log.tracker_backoff_s=0.01"])
    assert result.steps == 6 and (out / "final" / "model.safetensors").exists()
    messages = [str(w.message) for w in caught]
    assert any(m.startswith("tracker 'testing_callbacks:UnreachableTracker': start failed (ConnectionError")
               for m in messages), messages
    assert any(m.startswith("tracker 'testing_callbacks:FlakyTracker': log failed (ConnectionError") for m in messages)
    assert FlakyTracker.LOGGED == [1, 2]  # then it died and was disabled
    assert [r["step"] for r in read_metrics(out) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]  # the others went on


@pytest.mark.slow
def test_a_tracker_whose_log_never_returns_is_dropped_after_its_time_and_the_run_ends(tmp_path, text):
    """A tracker's `log` that blocks forever (a hung network call) used to hang the run, SIGTERM included."""
    from testing_callbacks import FlakyTracker

    out = tmp_path / "run"
    FlakyTracker.LOGGED.clear()
    with pytest.warns(UserWarning) as caught:
        result = train_in_process("recipes/s4_tiny_debug.yaml", [
            f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32",
            "train.max_steps=6", "train.eval_every=0", "log.log_every=1", "log.progress_bar=false",
            "sample.prompts=[]", "log.log_with=[jsonl, 'testing_callbacks:BlockingTracker']",
            "log.tracker_timeout_s=1"])
    assert result.steps == 6 and (out / "final" / "model.safetensors").exists()
    assert [str(w.message) for w in caught if "BlockingTracker" in str(w.message)] == [
        "tracker 'testing_callbacks:BlockingTracker': log did not return within 1s; disabled, training goes on "
        "without it"]
    assert FlakyTracker.LOGGED == [1, 2]
    assert [r["step"] for r in read_metrics(out) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_a_run_that_ends_in_an_error_still_writes_what_its_trackers_were_given(tmp_path, text):
    """`log` queues the tracker's call and returns: the calls still queued when the run dies of an error run before
    the process exits."""
    out, logged = tmp_path / "run", tmp_path / "slow.txt"
    proc = run_cli("train", TINY, *sets(
        f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32", "train.max_steps=20",
        "train.eval_every=0", "log.log_every=1", "log.progress_bar=false", "sample.prompts=[]",
        "log.log_with=[jsonl, 'testing_callbacks:SlowTracker']",
        f"log.tracker_kwargs={{'testing_callbacks:SlowTracker': {{path: '{logged}'}}}}",
        "callbacks=[{target: 'testing_callbacks:RaisesAt', args: {step: 5}}]"))
    assert proc.returncode != 0 and "a bug at step 5" in proc.stderr, proc.stderr[-3000:]
    assert logged.read_text().split() == ["1", "2", "3", "4"], proc.stderr[-3000:]  # step 5 raised before its log
    assert [r["step"] for r in read_metrics(out) if "train/loss" in r] == [1, 2, 3, 4]


@pytest.mark.parametrize("case", ["mlflow file store not allowed", "mlflow folder unwritable",
                                  "trackio folder unwritable"])
def test_a_tracker_that_cannot_write_its_store_is_refused_in_one_line_before_any_compute(tmp_path, text, case):
    """It used to print a Python warning with a source line and train to the end tracking nothing."""
    import importlib.util

    name = case.split()[0]
    if importlib.util.find_spec(name) is None:  # not importorskip: trackio reads TRACKIO_DIR once, when imported
        pytest.skip(f"{name} is not installed")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {"mlflow file store not allowed": {"MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),
                                             "MLFLOW_ALLOW_FILE_STORE": None},
           "mlflow folder unwritable": {"MLFLOW_TRACKING_URI": (blocker / "mlruns").as_uri(),
                                        "MLFLOW_ALLOW_FILE_STORE": "true"},
           "trackio folder unwritable": {"TRACKIO_DIR": str(blocker / "trackio")}}[case]
    out = tmp_path / "run"
    proc = run_cli("train", TINY, *sets(f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]",
                                        f"log.log_with=[jsonl, {name}]"), env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: log.log_with: {name} "), lines
    assert ("MLFLOW_ALLOW_FILE_STORE" in lines[0]) == (case == "mlflow file store not allowed"), lines
    assert not out.exists()


def not_installed_tracker() -> str:
    """One of Accelerate's trackers whose package this machine lacks."""
    from accelerate.tracking import get_available_trackers

    from s4accel.config.loop_sections import TRACKERS

    available = {t.value for t in get_available_trackers()}
    missing = [t for t in TRACKERS if t != "jsonl" and t not in available]
    if not missing:
        pytest.skip("every tracker package is installed here")
    return missing[0]


def test_a_tracker_whose_package_is_missing_is_refused_in_one_line_before_any_compute(tmp_path, text):
    """It used to train to the end with exit 0, tracking nothing, after a UserWarning with its source line."""
    name = not_installed_tracker()
    out = tmp_path / "run"
    proc = run_cli("train", TINY, *sets(f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]",
                                        f"log.log_with=[jsonl, {name}]"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"error: log.log_with: {name} is not installed here (pip install "
                                                f"{name}); install it or remove {name} from log.log_with"]
    assert "Warning" not in proc.stdout + proc.stderr and not out.exists()


def test_a_tracker_class_that_does_not_import_is_refused_in_one_line(tmp_path):
    from s4accel.training.observe.tracking import check_tracker_packages

    recipe = load_recipe(TINY, ["log.log_with=[jsonl, 'no_such_package.trackers:Mine']"])
    with pytest.raises(RecipeError, match=r"^log.log_with: no_such_package.trackers:Mine cannot be imported "
                                          r"\(ModuleNotFoundError: No module named 'no_such_package'\)$"):
        check_tracker_packages(recipe.log)
    check_tracker_packages(load_recipe(TINY, ["log.log_with=[jsonl, tensorboard, 'testing_callbacks:FlakyTracker']"]
                                       ).log)  # what is installed passes
