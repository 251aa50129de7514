"""The processes the suite starts, forked from a server that has imported torch, transformers and s4accel once.

About 6 s of every new process here is Python importing those libraries (10 s with the other test process
running), and the suite starts some three hundred: most of its time went there. `helpers.run_python` (a script,
module or code), `helpers.run_cli` (an s4accel command) and `helpers.accelerate_launch` (the workers of `accelerate
launch`) hand their processes to this server; each is a fork that takes its environment, folder and argv, runs the
program as `python` would run it and exits with its code, its output captured in files. S4ACCEL_TEST_FORK=0 turns
the server off: every process is then started anew.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class ForkServer:
    """Python's forkserver (multiprocessing) with the libraries of PRELOAD imported. A process may be forked from it
    only where the variables those libraries read when imported are the server's own (`can_run`)."""

    # s4accel's training package brings accelerate, datasets and the rest of what a command imports
    PRELOAD = ["torch", "transformers", "transformers.modeling_utils", "transformers.generation", "s4accel.tools.run"]
    READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "CUDA",
                      "ACCELERATE_", "TOKENIZERS_", "TRITON_", "XDG_", "USE_")
    # ...except these, read when first used: torch sets the inductor's in the test process the first time it
    # compiles there, and every later call would otherwise start afresh
    READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")

    def __init__(self):
        import multiprocessing

        self.env = dict(os.environ)  # what the server is started with
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(self.PRELOAD)

    def can_run(self, env: dict) -> bool:
        keys = {k for k in {*env, *self.env} if k.startswith(self.READ_AT_IMPORT) and k not in self.READ_WHEN_USED}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def run(self, argv, env, cwd, timeout):
        """`argv` (`python -m MODULE ...` or `python SCRIPT ...`) in one forked process: a CompletedProcess."""
        return self.run_group(argv, [(argv, env)], cwd, timeout)

    def run_group(self, argv, processes, cwd, timeout):
        """Several processes at once, each (its argv, its environment), as a launcher runs its workers: a
        CompletedProcess named `argv` whose output is each process's in turn. When one fails, the others get SIGTERM
        (torchrun's agent does the same) and 30 s later SIGKILL; the code is then 1, the launcher's."""
        from multiprocessing.connection import wait

        with tempfile.TemporaryDirectory(prefix="s4accel-forked-") as tmp:
            files = [(Path(tmp) / f"{i}.out", Path(tmp) / f"{i}.err") for i in range(len(processes))]
            children = []
            for (args, env), (out, err) in zip(processes, files):
                children.append(self.context.Process(target=_child, args=(args, env, str(cwd), str(out), str(err))))
                children[-1].start()
            deadline, failed_at = time.monotonic() + timeout, None
            while running := [c for c in children if c.exitcode is None]:
                now = time.monotonic()
                if now > deadline:
                    for c in children:
                        c.kill()
                        c.join()
                    raise subprocess.TimeoutExpired(argv, timeout, *output(files))
                if failed_at is None and any(c.exitcode not in (None, 0) for c in children):
                    failed_at = now
                    for c in running:
                        c.terminate()
                elif failed_at is not None and now - failed_at > 30:
                    for c in running:
                        c.kill()
                wait([c.sentinel for c in running], timeout=1)
            codes = [c.exitcode for c in children]
            code = codes[0] if len(codes) == 1 else int(any(codes))
            return subprocess.CompletedProcess(argv, code, *output(files))


def output(files) -> tuple[str, str]:
    """(stdout, stderr) of the processes in turn."""
    read = [(out.read_text() if out.exists() else "", err.read_text() if err.exists() else "") for out, err in files]
    return "".join(o for o, _ in read), "".join(e for _, e in read)


def _child(argv, env, cwd, out, err):
    """In the forked process: what `python -m MODULE ARGS`, `python -c CODE ARGS` or `python SCRIPT ARGS` would be,
    from its environment to its exit code."""
    import atexit
    import runpy

    import torch

    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit():  # read by the server when it imported torch; a launcher sets it
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (the process's own streams, for its whole life)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    code = 0
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]  # runpy puts the module's file first
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        elif argv[1] == "-c":
            sys.argv = ["-c", *argv[3:]]
            sys.path.insert(0, "")
            exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv[1:])
            sys.path.insert(0, str(Path(argv[1]).resolve().parent))
            runpy.run_path(argv[1], run_name="__main__")
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


def torchrun_workers(launch_args: list[str], env: dict, cwd, errors: Path) -> list[tuple[list[str], dict]] | None:
    """The workers `accelerate launch LAUNCH_ARGS` starts through torchrun on this machine, each (its argv, its
    environment): Accelerate's own launcher decides them (its config file, options and the environment it gives
    its workers), with torchrun's entry point replaced by one that records what it was asked; the variables
    torchrun's agent adds are then set as it sets them, rank 0 serving the rendezvous on a free port. None where
    accelerate launch would not start torchrun on one machine (one process, DeepSpeed, several machines). Each
    worker's TORCHELASTIC_ERROR_FILE is in the folder `errors`."""
    import contextlib
    import socket
    from unittest import mock

    import accelerate.commands.launch as accelerate_launch
    import torch.distributed.run as torchrun

    class NotTorchrun(Exception):
        pass

    def refuse(*_):
        raise NotTorchrun

    asked: dict = {}

    def record(args):
        asked.update(args=args, env=dict(os.environ))

    with (mock.patch.dict(os.environ, env, clear=True), contextlib.chdir(cwd),
          mock.patch.object(torchrun, "run", record), mock.patch.object(accelerate_launch, "simple_launcher", refuse),
          mock.patch.object(accelerate_launch, "deepspeed_launcher", refuse),
          contextlib.redirect_stdout(None), contextlib.redirect_stderr(None)):
        try:
            accelerate_launch.launch_command(accelerate_launch.launch_command_parser().parse_args(launch_args))
        except (Exception, SystemExit):  # NotTorchrun, or the launch's own error, which the launcher then reports
            return None
    args = asked.get("args")
    if args is None or str(args.nnodes) not in ("1", "1:1"):
        return None
    n = int(args.nproc_per_node)
    program = [sys.executable, *(["-m"] if args.module else []), args.training_script, *args.training_script_args]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = []
    for rank in range(n):
        worker = {**asked["env"], "RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank,
                  "ROLE_NAME": "default", "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n, "GROUP_WORLD_SIZE": 1,
                  "ROLE_WORLD_SIZE": n, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                  "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0,
                  "TORCHELASTIC_USE_AGENT_STORE": False, "TORCH_NCCL_ASYNC_ERROR_HANDLING": 1,
                  "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                  "TORCHELASTIC_ERROR_FILE": errors / f"{rank}.json"}
        worker = {k: str(v) for k, v in worker.items()}
        if n > 1:
            worker.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several processes on a machine
        workers.append((program, worker))
    return workers


_SERVER: list = []


def fork_server() -> ForkServer | None:
    """The session's fork server (S4ACCEL_TEST_FORK=0: none, every process started anew)."""
    if os.environ.get("S4ACCEL_TEST_FORK", "1") == "0":
        return None
    if not _SERVER:
        _SERVER.append(ForkServer())
    return _SERVER[0]
