"""Helpers the tests import (`from helpers import ...`): the repository's paths, the CLI and `accelerate launch` in
processes of their own, training in this process, a small real text, and reading a run's outputs."""

import json
import os
import sys
import tempfile
from pathlib import Path

from forkserver import fork_server, torchrun_workers

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
TINY = RECIPES / "s4_tiny_debug.yaml"


TESTS_ON_PATH = {"PYTHONPATH": str(REPO / "tests")}
"""The environment a subprocess needs to import the tests' own modules (testing_callbacks, testing_tasks)."""


FREE_PORT = ["--main_process_port", "0"]
"""For `accelerate launch`: a port of its own for each launch (the suite may run two test processes at once)."""


def sets(*items: str) -> list[str]:
    """`--set` before each recipe override, for `run_cli`."""
    return [arg for item in items for arg in ("--set", item)]


def with_environment(env: dict | None) -> dict:
    """This process's environment with `env` added; a value of None removes that variable."""
    return {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}


def run_cli(*args, env=None, timeout=600, cwd=REPO, fresh=False):
    """`python -m s4accel ARGS` in a process of its own, offline: `run_python`."""
    return run_python("-m", "s4accel", *args, env=env, timeout=timeout, cwd=cwd, fresh=fresh)


def run_python(*args, env=None, timeout=600, cwd=REPO, fresh=False):
    """`python ARGS` (a script, `-m MODULE` or `-c CODE`, then its arguments) in a process of its own; returns a
    CompletedProcess. `env` adds to this process's environment; a value of None removes that variable. The process
    is forked from a server that has imported torch, transformers and s4accel already (forkserver.py), unless `env`
    changes what those read when imported or `fresh` asks for all a new process prints (what importing them says
    too); then it is a new Python."""
    import subprocess

    full_env = with_environment(env)
    argv = [sys.executable, *map(str, args)]
    server = fork_server()
    if fresh or server is None or not server.can_run(full_env):
        return subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)
    return server.run(argv, full_env, cwd, timeout)


def accelerate_launch(*args, env=None, timeout=600, cwd=REPO):
    """`accelerate launch ARGS` (its options, then `-m s4accel ...` or a script and its arguments): a
    CompletedProcess whose output is each worker's in turn. Where Accelerate starts its workers through torchrun on
    this machine, they are forked from the test server (forkserver.py) with the environment Accelerate and torchrun
    would give them, and no launcher process: a launch then costs what its workers do, not three new Pythons'
    imports. Otherwise, and where `env` changes what the server imported, it is the launcher itself; the tests of
    the launchers' own behaviour (tests/test_launchers.py, test_exit.py) always run it."""
    import subprocess

    full_env = with_environment(env)
    argv = [sys.executable, "-m", "accelerate.commands.launch", *map(str, args)]
    server = fork_server()
    if server is not None and server.can_run(full_env):
        with tempfile.TemporaryDirectory(prefix="s4accel-torchelastic-") as errors:
            workers = torchrun_workers(list(map(str, args)), full_env, cwd, Path(errors))
            if workers is not None:
                return server.run_group(argv, workers, cwd, timeout)
    return subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)


def small_text_file(tmp_path, chars=3000) -> Path:
    """The opening of a real play as a .txt file: a few dozen blocks, so an epoch lasts only a few steps."""
    from s4accel.data import clean_play, shakespeare_files

    path = tmp_path / "play.txt"
    path.write_text(clean_play(shakespeare_files()[0].read_text())[:chars])
    return path


def reset_accelerate():
    """Accelerate's process-wide singletons reset: the next Accelerator in this process is built anew."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def train_in_process(recipe_path, overrides, resume=None, force=False):
    """`s4accel.train` in this process, with Accelerate's process-wide singletons reset first."""
    import s4accel

    reset_accelerate()
    return s4accel.train(s4accel.load_recipe(recipe_path, overrides), resume=resume, force=force)


def recipe_accelerator(overrides, recipe_path=TINY):
    """The Accelerator `s4accel train` builds for a recipe (with `overrides`), in this process, without trackers."""
    from s4accel.config import load_recipe
    from s4accel.training.setup import make_accelerator

    reset_accelerate()
    return make_accelerator(load_recipe(recipe_path, overrides), trackers=False)


def recipe_error(overrides, recipe_path=TINY) -> str:
    """The line `load_recipe` refuses the recipe (with `overrides`) with, checked to be one line."""
    from s4accel.config import load_recipe
    from s4accel.errors import RecipeError

    try:
        load_recipe(recipe_path, overrides)
    except RecipeError as e:
        assert "\n" not in str(e), str(e)
        return str(e)
    raise AssertionError(f"the recipe was accepted with {overrides}")


def final_weights(run_dir, name="final"):
    from safetensors.torch import load_file

    return load_file(Path(run_dir) / name / "model.safetensors")


def short_epochs(text, out, *extra):
    """Overrides of the tiny recipe for resume tests: ~10 optimizer steps per epoch on one process (20 micro-batches,
    grad_accum 2), dropout on (so the RNG states matter), EMA on (its state is checkpointed too), 24 steps."""
    return [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32", "data.batch_size=4",
            "data.val_fraction=0.1", "model.overrides={dropout: 0.1}", "train.grad_accum=2", "train.max_steps=24",
            "train.eval_every=8", "checkpoint.every_steps=5", "checkpoint.keep_last=2", "train.ema={decay: 0.9}",
            "log.log_every=1", "log.progress_bar=false", "sample.prompts=[]", *extra]


def read_metrics(run_dir) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def stepped(run_dir) -> bool:
    """Whether a run has logged its first training step (every process is in the loop by then)."""
    path = Path(run_dir) / "metrics.jsonl"
    return path.exists() and '"train/loss"' in path.read_text()


def callback_override(target, **args) -> str:
    """A `--set` item attaching one callback, e.g. callback_override("testing_callbacks:SignalAt", step=3)."""
    return f"callbacks=[{{target: '{target}', args: {json.dumps(args)}}}]"
