"""The launchers docs/how-to/launchers.md names, on two CPU processes (gloo): torchrun, torchrun restarting a group
that lost a process, and what a run says under a launcher when it stops or is refused."""

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import (FREE_PORT, REPO, TINY, callback_override, final_weights, read_metrics, sets, short_epochs,
                     stepped, train_in_process)
from s4accel.training.runs.checkpoint import checkpoint_problem

pytestmark = pytest.mark.slow

# --standalone: a rendezvous on a free port of its own (the suite may run two test processes at once).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", *FREE_PORT, "--config_file",
              str(REPO / "accelerate_configs" / "cpu_2proc.yaml")]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}  # s4accel, testing_callbacks
STEPS = 16


def recipe(text, out, *extra):
    """short_epochs (dropout, EMA, grad_accum 2) over 16 steps: checkpoints at steps 5, 10 and 15."""
    return ["-m", "s4accel", "train", str(TINY), *sets(*short_epochs(text, out, f"train.max_steps={STEPS}", *extra))]


def run(*args, cwd=REPO, env=None, timeout=600):
    return subprocess.run([*map(str, args)], capture_output=True, text=True, cwd=cwd, env={**ENV, **(env or {})},
                          timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted(text, tmp_path_factory):
    """`torchrun --nproc_per_node 2 -m s4accel train RECIPE`, once for the module: the run others must end equal to."""
    out = tmp_path_factory.mktemp("torchrun") / "run"
    return out, run(*TORCHRUN, *recipe(text, out))


def started(args, out) -> subprocess.Popen:
    """The launcher `args`, in a session of its own as a terminal's foreground job is, once its run took a step."""
    launcher = subprocess.Popen([*map(str, args)], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while not stepped(out):
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            pytest.fail(launcher.communicate()[1][-3000:])
        time.sleep(0.2)
    return launcher


def assert_same_weights(a, b):
    for name in ("final", "final_ema"):
        wa, wb = final_weights(a, name), final_weights(b, name)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name


def test_torchrun_trains_on_two_cpu_processes(uninterrupted):
    out, proc = uninterrupted
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DDP over 2 processes on cpu," in proc.stdout and proc.stdout.count(f"done: {STEPS} steps") == 1
    assert sorted(p.name for p in (out / "checkpoints" / "step_00000015").glob("random_states_*")) == [
        "random_states_0.pkl", "random_states_1.pkl"]
    assert (out / "final" / "model.safetensors").is_file()


def test_torchrun_restarts_a_group_that_lost_a_process_and_it_resumes_bit_exactly(uninterrupted, text, tmp_path):
    """Process 1 is SIGKILLed after step 12; torchrun (--max-restarts 1) stops process 0 and starts both again with
    the same command, and `train.resume: auto` continues from the newest complete checkpoint (step 10).

    With a store of its own for each attempt (c10d rendezvous, `--standalone` on one machine, and
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): torch 2.13's static rendezvous, and the c10d one sharing its store with
    the workers, keep one store across restarts, where the restarted group could read the dead group's addresses
    (here 3 of 4 restarts failed with the static one, 3 of 4 with the shared c10d store: "Connection refused" from
    gloo, or a group that never formed)."""
    out, marker = tmp_path / "run", tmp_path / "killed"
    proc = run(*TORCHRUN, "--max-restarts", "1", *recipe(
        text, out, "train.resume=auto", callback_override("testing_callbacks:KilledOnceAt", step=12,
                                                          marker=str(marker))),
               env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists() and "exitcode: -9" in proc.stderr  # the kill happened, and the launcher saw it
    assert f"resumed from {out / 'checkpoints' / 'step_00000010'} at step 10" in proc.stdout
    assert f"done: {STEPS} steps" in proc.stdout
    assert_same_weights(uninterrupted[0], out)
    assert [r["step"] for r in read_metrics(out) if "train/loss" in r] == list(range(1, STEPS + 1))
    # Nothing half-written: every checkpoint verifies, no temporary or staged files, the lock released.
    ckpts = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_00000010", "step_00000015"]
    assert all(checkpoint_problem(p, verify=True) is None for p in ckpts)
    assert not [p.name for p in out.iterdir() if p.name.startswith((".", "earlier-"))]


def test_the_command_printed_after_ctrl_c_under_a_launcher_resumes_on_as_many_processes(text, tmp_path):
    """Ctrl-C reaches the launcher (its workers run in sessions of their own), which passes it on. The printed
    command is the launcher's, so the run continues on 2 processes, from any folder; `s4accel train RUN --resume`
    resumed it on one process, with other batches and random streams."""
    out = tmp_path / "run"
    launcher = started([*ACCELERATE, *recipe(text, out, "train.max_steps=100000", "train.eval_every=0",
                                             "checkpoint.every_steps=0")], out)
    try:
        os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    stopped = re.search(r"stopped at step (\d+) \(received SIGINT\); .*; continue with: (.+)", stdout)
    assert stopped, stdout[-2000:] + stderr[-3000:]
    args = shlex.split(stopped.group(2))
    if args[0] == "s4accel":  # (how the one-process command runs here)
        args[:1] = [sys.executable, "-m", "s4accel"]
    # The stopped run is not finished: give it 4 more steps (--force accepts the longer run).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    step = int(stopped.group(1))
    resumed = run(*args, "--force", "--set", f"train.max_steps={step + 4}", cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "DDP over 2 processes on cpu" in resumed.stdout and "resumed from " in resumed.stdout
    assert f"done: {step + 4} steps" in resumed.stdout
    assert [r["step"] for r in read_metrics(out) if "train/loss" in r] == list(range(1, step + 5))


def test_a_refused_resume_under_a_launcher_ends_the_launchers_report_with_its_error(text, tmp_path):
    """Every process stops at the same check, the first prints the error once, and the launcher's failure report
    (which s4accel cannot silence) ends with it instead of "To enable traceback see ...": no gloo tracebacks of a
    process left waiting for one that had gone."""
    out = tmp_path / "run"
    train_in_process(TINY, short_epochs(text, out, "train.max_steps=5"))  # one process: rank 0's random states only
    # Resumed on 2 processes: refused for a changed recipe (the global batch kept), or, the recipe unchanged, for a
    # global batch twice the checkpoint's.
    for change, error in [(["--set", "optim.lr=0.1", "--set", "data.batch_size=2"],
                           "error: the recipe differs from the one"),
                          ([], "error: " + f"{out / 'checkpoints' / 'step_00000005'} was saved by 1 process(es), "
                                           "this run has 2: the checkpoint trained on")]:
        proc = run(*ACCELERATE, "-m", "s4accel", "train", out, "--resume", *change)
        assert proc.returncode != 0
        ours, report = proc.stderr.split("ChildFailedError", 1)  # what the processes said, the launcher's report
        assert ours.count(error) == 1, proc.stderr  # said once, not once per process
        assert "[rank" not in ours and "gloo" not in ours, proc.stderr
        assert error in report[report.index("Root Cause"):], proc.stderr[-3000:]


def test_a_launch_that_asked_for_more_processes_than_the_run_got_says_so(text, tmp_path):
    """`accelerate launch --num_processes 2` without a config file runs one process on a machine without GPUs
    (Accelerate's plain launcher); only the run's header showed it."""
    out = tmp_path / "run"
    proc = run(sys.executable, "-m", "accelerate.commands.launch", *FREE_PORT, "--num_processes", "2", "-m", "s4accel",
               "train", TINY, *sets(f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]",
                                    "train.max_steps=1", "train.eval_every=0", "sample.prompts=[]"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stdout.splitlines() if "--num_processes 2" in line]
    assert warnings == ["warning: accelerate launch was asked for 2 processes (--num_processes 2) but this run has 1: "
                        "without a config file it starts one process where there is no GPU; use --config_file "
                        "accelerate_configs/cpu_2proc.yaml for CPU processes"], proc.stdout


def test_workers_whose_launcher_is_killed_save_a_checkpoint_and_stop(text, tmp_path):
    """SIGKILL of the `accelerate launch` process (an OOM killer, a scheduler) left both workers training, with no
    one to stop them or collect them. They now notice the launcher is gone, save a checkpoint and stop."""
    out = tmp_path / "run"
    args = [*ACCELERATE, *recipe(text, out, "train.max_steps=100000", "checkpoint.every_steps=0")]
    launcher = subprocess.Popen([*map(str, args)], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)

    def workers():
        found = []
        for proc in os.listdir("/proc"):
            if proc.isdigit() and int(proc) != launcher.pid:
                try:
                    cmdline = open(f"/proc/{proc}/cmdline", "rb").read().decode(errors="replace")
                except OSError:
                    continue
                if str(out) in cmdline and "s4accel" in cmdline:
                    found.append(int(proc))
        return found

    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        assert len(workers()) == 2
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 90
        while workers() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not workers(), "the workers went on training without their launcher"
        saved = [p for p in (out / "checkpoints").glob("step_*") if checkpoint_problem(p) is None]
        assert saved, "no checkpoint was saved"
    finally:
        for pid in workers():
            os.kill(pid, signal.SIGKILL)


S4ACCEL_LAUNCH = [sys.executable, "-m", "s4accel", "launch", *FREE_PORT, "--config_file",
                  str(REPO / "accelerate_configs" / "cpu_2proc.yaml")]


def test_s4accel_launch_ends_a_run_stopped_by_ctrl_c_with_the_runs_own_line_and_its_command_continues(text, tmp_path):
    """`accelerate launch` prints torch's 35-line SignalException traceback (exit 1) after the run's clean stop;
    `s4accel launch`, the same launcher in-process, ends with the run's line and exits 130."""
    out = tmp_path / "run"
    launcher = started([*S4ACCEL_LAUNCH, *recipe(text, out, "train.max_steps=100000", "train.eval_every=0",
                                                  "checkpoint.every_steps=0")[2:]], out)
    try:
        os.killpg(launcher.pid, signal.SIGINT)
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr and "death signal" not in stderr, stderr
    last = stdout.strip().splitlines()[-1]
    stopped = re.fullmatch(r"stopped at step (\d+) \(received SIGINT\); .*; continue with: (.+)", last)
    assert stopped and " -m s4accel launch " in stopped.group(2), stdout[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    step = int(stopped.group(1))
    resumed = run(*shlex.split(stopped.group(2)), "--force", "--set", f"train.max_steps={step + 2}", cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "DDP over 2 processes on cpu" in resumed.stdout and f"done: {step + 2} steps" in resumed.stdout


def test_s4accel_launch_reports_a_failed_process_in_one_line(text, tmp_path):
    """A user's error ends the output as the first process printed it (once), exit 2; a process killed ends it with
    one line naming it: no launcher failure report with its traceback."""
    out = tmp_path / "run"
    killed = run(*S4ACCEL_LAUNCH, *recipe(text, out, callback_override(
        "testing_callbacks:KilledOnceAt", step=6, marker=str(tmp_path / "killed")))[2:])  # after step 5's checkpoint
    # (process 0's own traceback, from gloo when its peer vanished, stays: that is the worker's output)
    assert killed.returncode == 1 and "Root Cause" not in killed.stderr, killed.stderr[-3000:]
    assert killed.stderr.strip().splitlines()[-1] == "error: process 1 was killed by SIGKILL", killed.stderr[-3000:]
    refused = run(*S4ACCEL_LAUNCH, "train", out, "--resume", "--set", "optim.lr=0.5")
    assert refused.returncode == 2 and "ChildFailedError" not in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1] == "error:   optim.lr: 0.003 -> 0.5", refused.stderr[-3000:]
    assert refused.stderr.count("error: the recipe differs") == 1


def test_s4accel_launch_on_one_process_waits_for_the_run_to_save_after_ctrl_c(text, tmp_path):
    """Without a config file on a machine without GPUs, accelerate runs the one process as a child and waits for it;
    on Ctrl-C Python stopped waiting after 0.25 s, so the prompt came back while the run was still saving."""
    out = tmp_path / "run"
    launcher = started([sys.executable, "-m", "s4accel", "launch", *recipe(
        text, out, "train.max_steps=100000", "train.eval_every=0", "checkpoint.every_steps=0",
        callback_override("testing_callbacks:SlowSave", seconds=3))[2:]], out)
    try:
        os.killpg(launcher.pid, signal.SIGINT)
        launcher.wait(timeout=120)
        alive = [pid for pid in os.listdir("/proc") if pid.isdigit() and pid != str(launcher.pid)
                 and str(out) in cmdline(pid)]
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert not alive, "the launcher returned while the run was still saving"
    assert launcher.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert re.fullmatch(r"stopped at step \d+ \(received SIGINT\); .*", stdout.strip().splitlines()[-1]), stdout


def cmdline(pid: str) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def test_s4accel_launch_on_one_process_ends_with_its_error(tmp_path):
    proc = run(sys.executable, "-m", "s4accel", "launch", "train", tmp_path / "missing.yaml")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: "), proc.stderr[-3000:]
    assert "were not passed to `accelerate launch`" not in proc.stderr  # its defaults: the recipe sets those
