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


def run_cli(*args, env=None, timeout=600, cwd=REPO, fresh=False):
    """`python -m s4accel ARGS` in a process of its own, offline; returns a CompletedProcess. `env` adds to this
    process's environment; a value of None removes that variable. The process is forked from a server that has
    imported torch and transformers already (`cli_forkserver`), unless `env` changes what those read when imported
    or `fresh` asks for all a new process prints (what importing them says too); then it is `python -m s4accel`."""
    import subprocess

    full_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    argv = [sys.executable, "-m", "s4accel", *map(str, args)]
    server = cli_forkserver()
    if fresh or server is None or not server.can_run(full_env):
        return subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)
    return server.run(argv, full_env, cwd, timeout)


class CliForkServer:
    """Python's forkserver (multiprocessing) with torch and transformers imported once: each CLI call is a fork of it
    that sets its environment, folder and argv, runs `s4accel`'s main and exits with its code, its output captured
    in files. About 10 s of every fresh process here is Python importing these libraries; a suite calling the CLI
    a hundred times spent most of its time there. Only variables read at import time must match the server's."""

    PRELOAD = ["torch", "transformers", "transformers.modeling_utils", "transformers.generation"]
    READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "CUDA",
                      "ACCELERATE_", "TOKENIZERS_")

    def __init__(self):
        import multiprocessing

        self.env = dict(os.environ)  # what the server is started with
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(self.PRELOAD)

    def can_run(self, env: dict) -> bool:
        keys = {k for k in {*env, *self.env} if k.startswith(self.READ_AT_IMPORT) and not k.startswith("HF_DATASETS")}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def run(self, argv, env, cwd, timeout):
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory(prefix="s4accel-cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            child = self.context.Process(target=_cli_child, args=(argv, env, str(cwd), str(out), str(err)))
            child.start()
            child.join(timeout)
            if child.exitcode is None:
                child.kill()
                child.join()
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(argv, child.exitcode, out.read_text(), err.read_text())


def _cli_child(argv, env, cwd, out, err):
    """In the forked process: what `python -m s4accel ARGS` would be, from its environment to its exit code."""
    import atexit
    import runpy

    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (the process's own streams, for its whole life)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.argv = [str(REPO / "s4accel" / "__main__.py"), *argv[3:]]
    code = 0
    try:
        runpy.run_module("s4accel", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as the interpreter would at its exit (multiprocessing's children skip it)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_SERVER: list = []


def cli_forkserver() -> CliForkServer | None:
    """The session's CLI fork server (S4ACCEL_TEST_FORK=0: none, every call a fresh process)."""
    if os.environ.get("S4ACCEL_TEST_FORK", "1") == "0":
        return None
    if not _SERVER:
        _SERVER.append(CliForkServer())
    return _SERVER[0]


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
