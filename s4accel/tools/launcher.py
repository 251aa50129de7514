"""What a command tells the user about the launcher that started it (accelerate launch, torchrun), and what it tells
that launcher: the command that continues a stopped run on as many processes as it was started with, and a user
error written where the launcher's failure report shows it.

Both launchers run torch's elastic agent, which starts each worker as its child process with TORCHELASTIC_RUN_ID,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE (machines) and TORCHELASTIC_ERROR_FILE in its environment; the
agent's own command line ends with the worker's arguments.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path


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
    if not argv or len(parent) <= len(argv) or parent[-len(argv):] != list(argv):
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
