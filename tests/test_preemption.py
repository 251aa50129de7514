"""SIGTERM/SIGINT become a flag; a second one quits at once; the previous handlers come back afterwards."""

import os
import signal

import pytest

from s4accel.training.runs.preemption import StopSignals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sets_the_flag_instead_of_killing(sig):
    before = signal.getsignal(sig)
    with StopSignals() as signals:
        assert signals.received is None
    assert signal.getsignal(sig) is before  # no signal: the previous handler, as it was
    handlers = {s: signal.getsignal(s) for s in StopSignals.SIGNALS}
    try:
        with StopSignals() as signals:
            os.kill(os.getpid(), sig)
            assert signals.received == sig.name
    finally:  # (after a signal, repeats are swallowed a while: the next tests' signals are their own)
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_repeats_of_the_stop_signal_right_after_the_loop_are_swallowed_and_later_ones_meet_the_old_handler(
        monkeypatch):
    """A worker whose launcher was SIGKILLed gets SIGTERM once per thread of the launcher: one arriving after the
    loop saved and ended must not kill the process before it says where its checkpoint is (it did: the process
    died of SIGTERM without its last line). After REPEAT_AFTER_S, a signal is a new one for the old handler."""
    import time

    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    got = []
    handlers = {s: signal.getsignal(s) for s in StopSignals.SIGNALS}  # (an earlier test's may be anything)
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # right behind: the same request
        clock[0] += 1.0
        os.kill(os.getpid(), signal.SIGTERM)
        assert got == [] and signals.received == "SIGTERM"
        clock[0] += StopSignals.REPEAT_AFTER_S
        os.kill(os.getpid(), signal.SIGTERM)  # a new signal: the handler from before the run
        assert got == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)
        assert got == [signal.SIGTERM] * 2
        with StopSignals():
            os.kill(os.getpid(), signal.SIGINT)
        clock[0] += StopSignals.REPEAT_AFTER_S
        with pytest.raises(KeyboardInterrupt):  # Python's own SIGINT handler again
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_a_second_ctrl_c_raises_keyboard_interrupt():
    with StopSignals():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_a_sigterm_some_seconds_after_the_first_signal_raises_but_one_right_behind_it_does_not(monkeypatch):
    """A cluster signals every process of a job and the launcher forwards the signal again (or sends SIGTERM after a
    Ctrl-C): that repeat must only record, or the preemption checkpoint would never be written. A later one is a
    second request: stop now."""
    import time

    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    for first in (signal.SIGTERM, signal.SIGINT):
        with StopSignals() as signals:
            os.kill(os.getpid(), first)
            clock[0] += 0.5
            os.kill(os.getpid(), signal.SIGTERM)  # the same request, delivered twice
            assert signals.received == first.name
            clock[0] += StopSignals.REPEAT_AFTER_S
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_a_run_stuck_where_the_loop_never_checks_stops_at_a_second_sigterm(tmp_path, text):
    """The first SIGTERM is recorded for the loop's next check, which a hung data read never reaches: the run went on
    until SIGKILL. A second one stops it at once, without a traceback, its last checkpoint intact."""
    import subprocess
    import sys
    import time

    from helpers import REPO, TINY, callback_override

    out, marker = tmp_path / "run", tmp_path / "stuck"
    overrides = [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32",
                 "train.max_steps=50", "train.eval_every=0", "checkpoint.every_steps=2", "log.progress_bar=false",
                 "sample.prompts=[]", callback_override("testing_callbacks:StuckAt", step=3, marker=str(marker))]
    proc = subprocess.Popen([sys.executable, "-m", "s4accel", "train", str(TINY),
                             *[a for o in overrides for a in ("--set", o)]], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        time.sleep(StopSignals.REPEAT_AFTER_S + 1)
        assert proc.poll() is None  # recorded, waiting for a check that never comes
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").exists()
    assert err.strip().splitlines()[-1] == (  # one line, last: what happened and how to go on
        f"second signal: stopped at once without saving; last complete checkpoint {out / 'checkpoints'}/"
        f"step_00000002; continue with: s4accel train {out} --resume")


@pytest.mark.slow
def test_a_sigterm_delivered_twice_at_once_still_saves_the_preemption_checkpoint(tmp_path, text):
    """As on a cluster, where the job's every process and the launcher's forwarding both deliver it."""
    import subprocess
    import sys
    import time

    from helpers import REPO, TINY

    out = tmp_path / "run"
    overrides = [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32",
                 "train.max_steps=100000", "train.eval_every=0", "checkpoint.every_steps=0", "log.progress_bar=false",
                 "log.log_with=[jsonl]", "log.log_every=1", "sample.prompts=[]"]
    proc = subprocess.Popen([sys.executable, "-m", "s4accel", "train", str(TINY),
                             *[a for o in overrides for a in ("--set", o)]], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        stdout, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "continue with: s4accel train" in stdout and list((out / "checkpoints").glob("step_*/COMPLETE"))


def test_a_sigterm_while_the_run_opens_its_trackers_saves_a_checkpoint_at_the_first_step(tmp_path, text):
    """The preemption notice can come while the run is still opening its trackers (a cluster does not wait)."""
    from helpers import TESTS_ON_PATH, TINY, callback_override, read_metrics, run_cli, sets

    out = tmp_path / "run"
    proc = run_cli("train", TINY, *sets(
        f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32", "train.max_steps=50",
        "train.eval_every=0", "checkpoint.every_steps=0", "log.progress_bar=false", "log.log_every=1",
        "sample.prompts=[]", callback_override("testing_callbacks:SignalAt", step=0)), env=TESTS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stopped at step 1 (received SIGTERM)" in proc.stdout
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000001"]
    assert [r["step"] for r in read_metrics(out) if "train/loss" in r] == [1]
