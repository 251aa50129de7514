"""Checkpoint files on disk: which ones count as complete, which one a resume picks, and what a failed save leaves."""

import errno
import json

import pytest

from s4accel.training.runs.checkpoint import (COMPLETE, checkpoint_problem, complete_checkpoints, locate_checkpoint,
                                save_checkpoint)
from s4accel.errors import CheckpointError, ResumeError


def _weights() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"w": torch.zeros(4)})


CHECKPOINT_FILES = {"model.safetensors": _weights(), "optimizer.bin": b"y" * 50, "random_states_0.pkl": b"r" * 20,
                    "recipe.yaml": b"run: {}\n"}


def fake_checkpoint(run_dir, step, files=None, marker=True):
    """A checkpoint directory as save_checkpoint leaves it: files, then a manifest listing their sizes and hashes."""
    import hashlib

    path = run_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    files = files or CHECKPOINT_FILES
    for name, data in files.items():
        (path / name).write_bytes(data)
    if marker:
        manifest = {"step": step, "files": {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                                            for n, d in files.items()}}
        (path / COMPLETE).write_text(json.dumps(manifest))
    return path


class FakeAccelerator:
    is_main_process = True

    def __init__(self, fail_with=None):
        self.fail_with = fail_with

    def wait_for_everyone(self):
        pass

    def save_state(self, out_dir):
        from pathlib import Path

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl"):
            (Path(out_dir) / name).write_bytes(b"z" * 10)
        if self.fail_with:
            raise OSError(self.fail_with, "No space left on device")


def test_latest_complete_checkpoint_is_chosen_and_broken_ones_are_skipped_with_a_warning(tmp_path):
    good = fake_checkpoint(tmp_path, 10)
    truncated = fake_checkpoint(tmp_path, 20)
    (truncated / "optimizer.bin").write_bytes(b"y" * 7)  # the disk filled up, or the copy was cut
    unmarked = fake_checkpoint(tmp_path, 30, marker=False)  # killed before the manifest was written
    (tmp_path / "checkpoints" / ".tmp_step_00000040").mkdir()  # killed inside save_state
    path, warnings, invalid = locate_checkpoint(tmp_path, "latest")
    assert path == good and invalid == [unmarked, truncated]
    assert warnings == [
        f"ignoring {tmp_path / 'checkpoints' / '.tmp_step_00000040'}: a checkpoint whose save was interrupted",
        f"skipping checkpoint {unmarked}: no COMPLETE marker (the save did not finish)",
        f"skipping checkpoint {truncated}: optimizer.bin is truncated (7 of 50 bytes)",
    ]
    assert complete_checkpoints(tmp_path) == [good]


def test_weights_emptied_under_a_recomputed_manifest_are_skipped_as_a_damaged_checkpoint(tmp_path):
    """`model.safetensors` emptied and the manifest recomputed to match: the checksums pass, and resume or export
    was a `SafetensorError: header too small` traceback."""
    good = fake_checkpoint(tmp_path, 10)
    emptied = fake_checkpoint(tmp_path, 20, files={**CHECKPOINT_FILES, "model.safetensors": b""})
    path, warnings, invalid = locate_checkpoint(tmp_path, "latest")
    assert path == good and invalid == [emptied]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"skipping checkpoint {emptied}: model.safetensors is not a safetensors file ("), warnings


def test_no_checkpoint_means_a_fresh_start_and_a_bad_explicit_path_is_an_error(tmp_path):
    assert locate_checkpoint(tmp_path, "latest") == (None, [], [])
    broken = fake_checkpoint(tmp_path, 5)
    (broken / "model.safetensors").unlink()
    assert checkpoint_problem(broken) == "model.safetensors is missing"
    with pytest.raises(ResumeError, match="not a usable checkpoint: model.safetensors is missing"):
        locate_checkpoint(tmp_path, str(broken))


def test_save_rotates_to_keep_last_and_never_rewrites_a_complete_checkpoint(tmp_path):
    acc = FakeAccelerator()
    for step in (1, 2, 3):
        save_checkpoint(acc, tmp_path, step, keep_last=2, recipe_yaml="run: {}\n")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    manifest = (tmp_path / "checkpoints" / "step_00000003" / COMPLETE).read_text()
    assert set(json.loads(manifest)["files"]) == {"model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                                  "recipe.yaml"}
    before = (tmp_path / "checkpoints" / "step_00000003" / COMPLETE).stat().st_mtime_ns
    save_checkpoint(acc, tmp_path, 3, keep_last=2, recipe_yaml="run: {}\n")
    assert (tmp_path / "checkpoints" / "step_00000003" / COMPLETE).stat().st_mtime_ns == before


def test_a_deletion_cut_short_by_a_kill_is_finished_at_the_next_save(tmp_path):
    """A kill while an old checkpoint was being deleted left it half there (found by the random-SIGKILL test); the
    next save removes it, and a kill during a deletion now leaves only a `.del_*` directory, also removed later."""
    acc = FakeAccelerator()
    for step in (1, 2):
        save_checkpoint(acc, tmp_path, step, keep_last=2, recipe_yaml="")
    (tmp_path / "checkpoints" / "step_00000001" / "model.safetensors").unlink()  # rmtree interrupted
    (tmp_path / "checkpoints" / ".del_step_00000000").mkdir()  # a rename done, its rmtree interrupted
    save_checkpoint(acc, tmp_path, 3, keep_last=2, recipe_yaml="")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]


def test_disk_full_during_a_save_keeps_the_last_good_checkpoint_and_says_so(tmp_path):
    save_checkpoint(FakeAccelerator(), tmp_path, 4, keep_last=2, recipe_yaml="")
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(FakeAccelerator(fail_with=errno.ENOSPC), tmp_path, 8, keep_last=2, recipe_yaml="")
    good = tmp_path / "checkpoints" / "step_00000004"
    assert str(info.value) == (f"could not write checkpoint {tmp_path / 'checkpoints' / 'step_00000008'}: No space "
                               f"left on device; the last complete checkpoint {good} is intact")
    assert complete_checkpoints(tmp_path) == [good]
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))  # the half-written one is removed


def test_recipe_diff_ignores_what_does_not_change_training():
    from s4accel.config import load_recipe
    from s4accel.training.runs.resume import recipe_diff

    from helpers import TINY

    a = load_recipe(TINY).to_dict()
    b = load_recipe(TINY, ["log.log_every=1", "checkpoint.keep_last=5", "run.out_dir=elsewhere",
                           "train.eval_every=3", "sample.prompts=[]", "train.max_steps=99",
                           "data.seq_len=32", "train.resume=auto"]).to_dict()
    assert recipe_diff(a, b) == ["data.seq_len: 64 -> 32", "train.max_steps: 20 -> 99"]


def test_train_state_round_trips(tmp_path):
    from s4accel.training.runs.checkpoint import TrainState

    state = TrainState(step=7, epoch=1, batch_in_epoch=3, tokens_seen=99, best_metric=1.5)
    copy = TrainState()
    copy.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert copy == state and copy.run_id == state.run_id
