"""Helpers the tests import (`from helpers import ...`): the repository's paths, the CLI in a subprocess, training in
this process, a small real text, and reading a run's outputs."""

import json
import os
import sys
from pathlib import Path

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


def run_cli(*args, env=None, timeout=600, cwd=REPO):
    """`python -m s4accel ARGS` in a subprocess, offline; returns the CompletedProcess. `env` adds to this process's
    environment; a value of None removes that variable."""
    import subprocess

    full_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    return subprocess.run([sys.executable, "-m", "s4accel", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd)


def small_text_file(tmp_path, chars=3000) -> Path:
    """The opening of a real play as a .txt file: a few dozen blocks, so an epoch lasts only a few steps."""
    from s4accel.data import clean_play, shakespeare_files

    path = tmp_path / "play.txt"
    path.write_text(clean_play(shakespeare_files()[0].read_text())[:chars])
    return path


def train_in_process(recipe_path, overrides, resume=None, force=False):
    """`s4accel.train` in this process, with Accelerate's process-wide singletons reset first."""
    import s4accel
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return s4accel.train(s4accel.load_recipe(recipe_path, overrides), resume=resume, force=force)


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
