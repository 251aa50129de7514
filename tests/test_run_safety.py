"""A run directory under attack: an overwrite whose recipe fails its checks, damaged or forged checkpoints, a resume
that changes what must not change, weights that an update made non-finite. Nothing that was good may be lost, and
whatever is resumed must be exactly what a run that never stopped would have computed."""

import json
import os
import shutil

import pytest
import torch

from helpers import TINY, callback_override, final_weights, read_metrics, run_cli, train_in_process
from s4accel.errors import DataError, NonFiniteError, RecipeError, ResumeError

pytestmark = pytest.mark.slow


def base(text, out, *extra):
    """12 steps, a checkpoint every 4 (dropout on, so RNG states matter), everything else small."""
    return [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32", "data.batch_size=4",
            "data.val_fraction=0.1", "model.overrides={dropout: 0.1}", "train.max_steps=12", "train.eval_every=0",
            "checkpoint.every_steps=4", "checkpoint.keep_last=3", "log.log_every=1", "log.log_with=[jsonl]",
            "log.progress_bar=false", "sample.prompts=[]", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text):
    out = tmp_path_factory.mktemp("ref") / "run"
    train_in_process(TINY, base(text, out))
    return out


def snapshot(run_dir):
    """Every file of a run directory and its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def same_weights(a, b):
    wa, wb = final_weights(a), final_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def copy_run(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    return run


# ---- 1. overwrite ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, error", [
    ("data.files=[no_such_file.txt]", DataError),
    ("scheduler.kwargs={no_such_argument: 1}", RecipeError),
    ("data.seq_len=100000", DataError),
])
def test_overwrite_with_a_recipe_that_fails_its_checks_keeps_the_previous_run_whole(reference, text, tmp_path, bad,
                                                                                    error):
    run = copy_run(reference, tmp_path)
    before = snapshot(run)
    with pytest.raises(error):
        train_in_process(TINY, base(text, run, "run.overwrite=true", bad))
    assert snapshot(run) == before  # final/, checkpoints, metrics: all still there, byte for byte


def test_a_recipe_that_fails_its_checks_leaves_no_run_directory_behind(text, tmp_path):
    with pytest.raises(DataError):
        train_in_process(TINY, base(text, tmp_path / "new" / "run", "data.files=[no_such_file.txt]"))
    assert not (tmp_path / "new").exists()
    with pytest.raises(RecipeError):
        train_in_process(TINY, base(text, tmp_path / "run2", "scheduler.kwargs={no_such_argument: 1}"))
    assert not (tmp_path / "run2").exists()


def test_overwrite_replaces_the_previous_run_and_retrains_its_tokenizer(text, tmp_path):
    run = tmp_path / "run"
    train_in_process(TINY, base(text, run, "data.tokenizer=bpe", "data.vocab_size=300", "train.max_steps=4"))
    result = train_in_process(TINY, base(text, run, "data.tokenizer=bpe", "data.vocab_size=320", "train.max_steps=4",
                                         "run.overwrite=true"))
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(result.final_dir)) == 320  # not the old run's tokenizer
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == [1, 2, 3, 4]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "final", "metrics.jsonl", "recipe.yaml",
                                                     "tokenizer", "train.log"]


# ---- 2, 5, 8. damaged and forged checkpoints --------------------------------------------------------------------


def damage_truncate(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])


def damage_zero_rng(ckpt):  # same size, zeros: Accelerate swallows the error and keeps the fresh RNG states
    path = ckpt / "random_states_0.pkl"
    path.write_bytes(b"\0" * path.stat().st_size)


def damage_nan_weights(ckpt):  # same size, a NaN in the first tensor's data
    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})


def damage_marker(ckpt):
    (ckpt / "COMPLETE").unlink()


def damage_optimizer(ckpt):
    path = ckpt / "optimizer.bin"
    path.write_bytes(path.read_bytes()[:-10])


@pytest.mark.parametrize("damage", [damage_truncate, damage_zero_rng, damage_nan_weights, damage_marker,
                                    damage_optimizer])
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_resumed_run_ends_exact(reference, text, tmp_path, damage):
    run = copy_run(reference, tmp_path)
    shutil.rmtree(run / "final")
    damage(run / "checkpoints" / "step_00000012")
    result = train_in_process(TINY, base(text, run), resume="latest")
    assert result.steps == 12 and same_weights(run, reference)
    aside = [p.name for p in (run / "checkpoints").iterdir() if ".invalid-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("step_00000012.invalid-")
    # ... and the run can pass that step again and again
    result = train_in_process(TINY, base(text, run), resume="latest")
    assert result.steps == 12


def test_when_every_checkpoint_is_invalid_a_fresh_start_does_not_append_to_the_old_metrics(reference, text, tmp_path):
    run = copy_run(reference, tmp_path)
    shutil.rmtree(run / "final")
    for ckpt in (run / "checkpoints").iterdir():
        damage_truncate(ckpt)
    train_in_process(TINY, base(text, run), resume="latest")
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == list(range(1, 13))
    assert same_weights(run, reference)


def forge(run, name, marker):
    path = run / "checkpoints" / name
    path.mkdir()
    (path / "counter.txt").write_text("1")
    (path / "COMPLETE").write_text(marker if isinstance(marker, str) else json.dumps(marker))
    return path


@pytest.mark.parametrize("name, marker", [
    ("step_99999999", {"step": 99999999, "files": {"counter.txt": 1}}),
    ("step_99999999", []),
    ("step_99999999", {"files": []}),
    ("step_99999999", "{not json"),
])
def test_forged_checkpoints_are_skipped_with_a_warning_never_a_traceback(reference, text, tmp_path, name, marker):
    from s4accel.training.runs.checkpoint import checkpoint_problem

    run = copy_run(reference, tmp_path)
    forged = forge(run, name, marker)
    assert checkpoint_problem(forged) is not None
    shutil.rmtree(run / "final")
    result = train_in_process(TINY, base(text, run), resume="latest")
    assert result.steps == 12 and same_weights(run, reference)


def test_a_marker_whose_step_was_edited_is_invalid_and_drops_no_metrics(reference, text, tmp_path):
    from s4accel.training.runs.checkpoint import checkpoint_problem

    run = copy_run(reference, tmp_path)
    shutil.rmtree(run / "final")
    marker = run / "checkpoints" / "step_00000012" / "COMPLETE"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "step": 2}))
    assert "step" in checkpoint_problem(marker.parent)
    train_in_process(TINY, base(text, run), resume="latest")
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == list(range(1, 13))


def test_a_checkpoint_records_a_checksum_of_every_file(reference):
    import hashlib

    ckpt = reference / "checkpoints" / "step_00000012"
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    assert manifest["step"] == 12
    for name, entry in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "recipe.yaml"} <= manifest["files"].keys()


def test_a_malicious_optimizer_state_is_refused_in_one_line(reference, text, tmp_path):
    """An optimizer.bin replaced by a pickle that would run code, with a manifest rewritten to match it."""
    import hashlib
    import pickle

    run = copy_run(reference, tmp_path)
    ckpt = run / "checkpoints" / "step_00000012"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (ckpt / "optimizer.bin").write_bytes(pickle.dumps(Evil()))
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    data = (ckpt / "optimizer.bin").read_bytes()
    manifest["files"]["optimizer.bin"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "COMPLETE").write_text(json.dumps(manifest))
    with pytest.raises(ResumeError, match=r"optimizer.bin: holds more than tensors and plain data"):
        train_in_process(TINY, base(text, run, "train.max_steps=16"), resume=str(ckpt), force=True)
    assert not (tmp_path / "pwned").exists()


def test_adding_a_stateful_callback_on_resume_is_one_line(reference, text, tmp_path):
    run = copy_run(reference, tmp_path)
    cb = callback_override("testing_callbacks:Recorder", path=str(tmp_path / "events.jsonl"))
    with pytest.raises(ResumeError, match=r"saved 2 objects besides model and optimizer, this run has 3"):
        train_in_process(TINY, base(text, run, cb), resume=str(run / "checkpoints" / "step_00000008"))


# ---- 6, 7. what a resume may change ---------------------------------------------------------------------------------


def test_the_seed_is_training_relevant_on_resume(reference, text, tmp_path):
    run = copy_run(reference, tmp_path)
    with pytest.raises(ResumeError, match=r"run.seed: 0 -> 1"):
        train_in_process(TINY, base(text, run, "run.seed=1"), resume="latest")


def test_forced_optimizer_changes_take_effect_after_resume(reference, text, tmp_path, capsys):
    run = copy_run(reference, tmp_path)
    shutil.rmtree(run / "final")
    changed = base(text, run, "optim.lr=1e-2", "optim.weight_decay=0.5", "scheduler.name=constant",
                   "train.max_steps=16")
    train_in_process(TINY, changed, resume="latest", force=True)
    after = [r for r in read_metrics(run) if "train/loss" in r and r["step"] > 12]
    assert [r["step"] for r in after] == [13, 14, 15, 16]
    assert all(r["train/lr_decay"] == pytest.approx(1e-2) for r in after)
    assert "resuming with changed fields (--force): optim.lr: 0.003 -> 0.01" in capsys.readouterr().out
    import yaml

    assert yaml.safe_load((run / "recipe.yaml").read_text())["optim"]["lr"] == 1e-2


def test_forcing_a_change_that_cannot_take_effect_is_refused(reference, text, tmp_path):
    run = copy_run(reference, tmp_path)
    with pytest.raises(ResumeError, match=r"run.seed.*cannot change when resuming, even with --force"):
        train_in_process(TINY, base(text, run, "run.seed=3"), resume="latest", force=True)
    with pytest.raises(ResumeError, match=r"model.overrides.*cannot change when resuming, even with --force"):
        train_in_process(TINY, base(text, run, "model.overrides={dropout: 0.1, d_state: 8}"), resume="latest",
                         force=True)


# ---- 9. the last good state ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_an_update_that_makes_the_weights_non_finite_is_never_saved_as_good(text, tmp_path, policy):
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError) as info:
        train_in_process(TINY, base(text, run, "optim.lr=1e30", "checkpoint.every_steps=1",
                                    f"train.on_nonfinite={policy}", "train.clip_grad_norm=null"))
    assert "the weights are no longer finite" in str(info.value)
    from safetensors.torch import load_file

    for ckpt in (run / "checkpoints").glob("step_*"):
        assert all(torch.isfinite(t).all() for t in load_file(ckpt / "model.safetensors").values()), ckpt
    assert "the last good state is" in str(info.value)


def test_cli_exit_code_and_message_for_non_finite_weights(text, tmp_path):
    args = ["train", TINY]
    for item in base(text, tmp_path / "run", "optim.lr=1e30", "train.on_nonfinite=stop", "train.clip_grad_norm=null"):
        args += ["--set", item]
    proc = run_cli(*args)
    assert proc.returncode == 3
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "the weights are no longer finite" in last, last
    assert "Traceback" not in proc.stderr


# ---- 13. a stop signal in the middle of a long accumulation window --------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "tbptt"])
def test_sigterm_mid_window_stops_within_a_micro_batch_and_resumes_exactly(text, tmp_path, mode):
    window = [*base(text, tmp_path / "ref", "train.grad_accum=8", "train.max_steps=6", "checkpoint.every_steps=0",
                    f"train.state.mode={mode}", "data.batch_size=2")]
    train_in_process(TINY, window)
    run = tmp_path / "run"
    task = "task.target=testing_tasks:SignalAtMicroBatch"
    cut = train_in_process(TINY, [*window, f"run.out_dir={run}", task, "task.args={call: 21}"])

    # Micro-batch 21 is the 5th of step 3's window: the run stops before the 6th, keeping the state after step 2.
    assert cut.preempted and cut.steps == 2 and cut.checkpoint.name == "step_00000002"
    resumed = train_in_process(TINY, [*window, f"run.out_dir={run}", task, "task.args={call: 0}"], resume="latest",
                               force=True)
    assert resumed.steps == 6 and same_weights(run, tmp_path / "ref")


# ---- 10. a full disk ------------------------------------------------------------------------------------------------


def limited_cli(limit_bytes, *args):
    """The CLI with a file-size limit (writes past it fail with EFBIG, as on a full disk) and SIGXFSZ ignored."""
    import resource
    import signal
    import subprocess
    import sys

    from helpers import REPO

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "s4accel", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=REPO, preexec_fn=limit)


@pytest.mark.parametrize("what, limit, extra", [
    ("checkpoint", 250_000, ["checkpoint.every_steps=2"]),  # the optimizer state (~300 kB) does not fit
    ("export", 100_000, ["checkpoint.every_steps=0"]),  # the weights (~150 kB) do not fit
])
def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_temporary_files(text, tmp_path, what, limit, extra):
    run = tmp_path / "run"
    args = ["train", TINY]
    for item in base(text, run, "train.max_steps=4", "model.overrides={}", *extra):
        args += ["--set", item]
    proc = limited_cli(limit, *args)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: could not write {'checkpoint' if what == 'checkpoint' else 'model to'} "), last
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]


def test_a_live_run_directory_is_refused_to_a_second_run_and_freed_when_the_run_is_killed(text, tmp_path):
    """One run per directory: an overwrite or a resume of a run that is still training is one line and touches
    nothing; once that run is killed (SIGKILL: nothing of it runs to clean up) the directory is free again."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import REPO

    out = tmp_path / "run"
    live_args = base(text, out, "train.max_steps=100000", "checkpoint.every_steps=0")
    live = subprocess.Popen([sys.executable, "-m", "s4accel", "train", TINY, *[a for o in live_args
                                                                                 for a in ("--set", o)]],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists():  # training has started
            assert live.poll() is None and time.monotonic() < deadline, "the live run did not start"
            time.sleep(0.2)
        assert "pid" in (out / ".lock").read_text()
        before = sorted(p.name for p in out.iterdir())
        for extra in (["--set", "run.overwrite=true"], ["--resume"]):
            proc = run_cli("train", TINY, *[a for o in base(text, out) for a in ("--set", o)], *extra, timeout=120)
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert f"{out} is in use by another run (pid {live.pid} on " in proc.stderr, proc.stderr
            assert "Traceback" not in proc.stderr
        assert live.poll() is None and sorted(p.name for p in out.iterdir()) == before  # untouched, still training
        # A "stale lock" cleanup removing the lock file must not let a second run in: it let an overwrite delete the
        # live run's outputs while that run went on writing.
        (out / ".lock").unlink()
        for extra in (["--set", "run.overwrite=true"], ["--resume"]):
            proc = run_cli("train", TINY, *[a for o in base(text, out) for a in ("--set", o)], *extra, timeout=120)
            assert proc.returncode == 2, proc.stderr[-2000:]
            assert f"{out} is in use by another run" in proc.stderr, proc.stderr
        assert live.poll() is None and (out / "metrics.jsonl").exists() and (out / "recipe.yaml").exists()
    finally:
        os.killpg(live.pid, signal.SIGKILL)
        live.wait()
    proc = run_cli("train", TINY, *[a for o in base(text, out, "train.max_steps=2") for a in ("--set", o)],
                   "--set", "run.overwrite=true", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "final" / "model.safetensors").is_file() and not (out / ".lock").exists()


def test_two_machines_of_two_processes_train_together_under_one_lock_and_export(text, tmp_path):
    """Two launchers (`--num_machines 2`, 2 processes each; here both on 127.0.0.1 sharing a filesystem, as nodes
    share one) train one run on 4 processes and export it. Only the global main process takes the lock, so the second
    machine's processes run (a lock per machine would refuse them), and a run started meanwhile from anywhere is
    refused in one line."""
    import socket
    import subprocess
    import sys
    import time

    from helpers import REPO

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, release = tmp_path / "run", tmp_path / "release"
    args = [a for o in base(text, out, "train.max_steps=6", "checkpoint.every_steps=3",
                            callback_override("testing_callbacks:WaitAt", step=2, release=str(release)))
            for a in ("--set", o)]
    nodes = [subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                               str(REPO / "accelerate_configs" / "cpu_2proc.yaml"), "--num_machines", "2",
                               "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port",
                               str(port), "--num_processes", "4", "-m", "s4accel", "train", str(TINY), *args],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests")})
             for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").exists():  # both machines joined, and the run waits after step 2
            assert all(n.poll() is None for n in nodes) and time.monotonic() < deadline, "the launch did not start"
            time.sleep(0.2)
        proc = run_cli("train", TINY, *args, "--set", "run.overwrite=true", timeout=120)
        assert proc.returncode == 2 and f"{out} is in use by another run (pid " in proc.stderr, proc.stderr[-2000:]
        assert all(n.poll() is None for n in nodes)
        release.touch()
        outputs = [n.communicate(timeout=600) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert [n.returncode for n in nodes] == [0, 0], outputs[1][1][-2000:] + outputs[0][1][-2000:]
    assert "DDP over 4 processes on cpu" in outputs[0][0] and "done: 6 steps" in outputs[0][0]
    ckpt = out / "checkpoints" / "step_00000006"
    assert sorted(p.name for p in ckpt.glob("random_states_*")) == [f"random_states_{i}.pkl" for i in range(4)]
    assert (out / "final" / "model.safetensors").is_file() and not (out / ".lock").exists()


def test_a_run_that_fails_its_checks_leaves_no_run_directory_behind_its_lock(text, tmp_path):
    out = tmp_path / "new" / "run"
    with pytest.raises(DataError, match="no such file"):  # found once the run directory is held
        train_in_process(TINY, base(text, out, f"data.files=[{tmp_path / 'missing.txt'}]"))
    assert not (tmp_path / "new").exists()
