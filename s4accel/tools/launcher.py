"""What a command tells the user about the launcher that started it (accelerate launch, torchrun), and what it tells
that launcher: the command that continues a stopped run on as many processes as it was started with, and a user
error written where the launcher's failure report shows it. And `s4accel launch`: accelerate launch itself, whose
report after a run stopped by a signal is the run's own last line.

Both launchers run torch's elastic agent, which starts each worker as its child process with TORCHELASTIC_RUN_ID,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE (machines) and TORCHELASTIC_ERROR_FILE in its environment; the
agent's own command line ends with the worker's arguments.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .command_line import bare_resume_to_latest


def under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def continue_command(run_dir: Path, argv: list[str] | None = None) -> tuple[str, str]:
    """The command that resumes the run in `run_dir` the way it was started, and where to run it ("" or a note for
    several machines). Alone: `s4accel train RUN --resume`. Under a launcher: the launcher's own command line (its
    config file, processes, machines) with `train RUN --resume` for this command's arguments `argv`; a run resumed
    on another number of processes must also say how to keep its global batch (training/world.py)."""
    ours = ["train", str(run_dir), "--resume"]
    if not under_launcher():
        return shlex.join(["s4accel", *ours]), ""
    machines = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    prefix = launcher_command(sys.argv[1:] if argv is None else argv) or [
        "torchrun", f"--nnodes={machines}", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', '1')}", "-m",
        "s4accel"]  # the parent's command line could not be read: the same processes through torchrun
    where = f" (on each of the {machines} machines, with its own machine rank)" if machines > 1 else ""
    return shlex.join([*prefix, *ours]), where


def launcher_command(argv: list[str]) -> list[str] | None:
    """The launcher's command line up to this command's arguments (`... -m s4accel`), as typed but with files named
    by a relative path (`--config_file accelerate_configs/x.yaml`) made absolute, so that it runs from any folder;
    None where the parent's command line cannot be read (no /proc) or does not end with `argv`."""
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return None
    # (`s4accel launch` hands its workers `--resume=latest` for the `--resume` its own command line has)
    if not argv or len(parent) <= len(argv) or bare_resume_to_latest(parent[-len(argv):]) != bare_resume_to_latest(
            list(argv)):
        return None
    prefix = parent[:-len(argv)]
    if len(prefix) > 1 and Path(prefix[0]).name.startswith("python") and not prefix[1].startswith("-"):
        # A console script (`accelerate`, `torchrun`) runs as `python /path/bin/accelerate ...`: the name as typed
        # when that is what PATH finds.
        script, name = prefix[1], Path(prefix[1]).name
        found = shutil.which(name)
        prefix = [name if found and os.path.samefile(found, script) else script, *prefix[2:]]
    return [prefix[0], *map(absolute_file, prefix[1:])]


def absolute_file(arg: str) -> str:
    """`arg`, or `--option=value`, with a relative path to an existing file made absolute."""
    option, eq, value = arg.rpartition("=") if arg.startswith("--") else ("", "", arg)
    path = Path(value)
    return f"{option}{eq}{path.resolve()}" if value and not path.is_absolute() and path.is_file() else arg


def report_to_launcher(message: str) -> bool:
    """Write a user error where the launcher's failure report reads it: its last block ("Root Cause") then shows the
    message instead of "To enable traceback see ...", below the launcher's own traceback rather than above it. The
    JSON is the shape torch's `ErrorHandler.record_exception` writes, without the Python stack. False where the
    launcher reads no such file (alone, or a launcher that discards its workers' logs)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    record = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(record))
        return True
    return False


def launch(argv: list[str]) -> int:
    """`s4accel launch [ACCELERATE LAUNCH OPTIONS] COMMAND ...` runs accelerate launch's own launcher, in this
    process, on `-m s4accel COMMAND ...`; the exit code. What changes is the launcher's report:
    - after a run stopped by Ctrl-C or SIGTERM, torch's launcher raises `SignalException` (a 35-line traceback, exit
      1) under the run's last line, which says where it stopped and how to continue: that line stays last (exit
      128 + the signal);
    - a process that failed has printed its error (once for every process): one line names it, instead of the
      failure report."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    if args.module or args.no_python or args.training_script.endswith(".py"):
        print("error: s4accel launch runs s4accel's own commands: s4accel launch [ACCELERATE LAUNCH OPTIONS] "
              "train RECIPE ... (for a script of your own, accelerate launch)", file=sys.stderr)
        return 2
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script, args.module = "s4accel", True
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api",
                 "accelerate.commands.launch"):
        logging.getLogger(name).addFilter(quiet_launcher_lines)
    # One process without a config (accelerate's plain launcher) runs as a child this process waits for. Ctrl-C
    # reaches the child too, which saves and stops; Python's KeyboardInterrupt would stop the waiting after 0.25 s
    # and give the prompt back mid-save. Noted instead (torch's launcher, for several processes, sets its own).
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        launch_command(args)
    except (SignalException, KeyboardInterrupt) as e:
        return 128 + int(getattr(e, "sigval", 2))
    except subprocess.CalledProcessError as e:  # the one process failed, and said why
        if e.returncode < 0:
            print(f"error: the process was killed by {signal.Signals(-e.returncode).name}", file=sys.stderr)
        return e.returncode if e.returncode > 0 else 1
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode != 2:  # 2: an error of the user's, which the first process printed in one line
            how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else
                   f"exited with code {failure.exitcode}")
            print(f"error: process {rank} {how}{'' if failure.exitcode < 0 else '; its output above says why'}",
                  file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    finally:
        signal.signal(signal.SIGINT, previous)
    return 128 + received[0] if received else 0


def quiet_launcher_lines(record: logging.LogRecord) -> bool:
    """False for the launcher's lines on passing a signal to its workers ("Received 2 death signal, shutting down
    workers", "Sending process 123 closing signal SIGINT"), where each worker says what it did with it; on a failed
    worker ("failed (exitcode: 2) local_rank: 0 ..."), which `launch` reports in its own line; and accelerate's
    list of launcher options left at their defaults (`--mixed_precision`, `--dynamo_backend`, ...): a recipe sets
    them (`train.mixed_precision`, `train.compile`), and the run's header says the precision it runs in."""
    return not str(record.msg).startswith(("Received %s death signal", "Sending process %s closing signal",
                                           "failed (exitcode: %s)", "The following values were not passed"))
