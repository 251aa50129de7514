"""A model folder written with one environment's libraries loads and generates the same tokens in another's.

The code saved into a model folder runs on the transformers of whoever loads it, not the one that saved it
(transformers 5.24 renamed the cache and broke models saved the week before). `make test-newest` and
`make test-floor` run this test in their environment with `S4ACCEL_OTHER_PYTHON` set to the locked environment's
Python, so each pair of versions is tried both ways. Without that variable (the locked suite alone) it is skipped.
The floor lane tries exactly the floors `pyproject.toml` claims: the last test keeps the two files in agreement.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

SCRIPT = Path(__file__).parent / "scripts" / "lane_models.py"
OTHER = os.environ.get("S4ACCEL_OTHER_PYTHON")


def run(python, command, folder):
    proc = subprocess.run([python, str(SCRIPT), command, str(folder)], capture_output=True, text=True, timeout=600,
                          cwd=folder.parent, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not OTHER, reason="needs S4ACCEL_OTHER_PYTHON, another environment's Python (make test-newest)")
@pytest.mark.parametrize("direction", ["saved here, loaded there", "saved there, loaded here"])
def test_a_model_folder_saved_by_one_environment_loads_and_generates_the_same_in_the_other(tmp_path, direction):
    writer, reader = (sys.executable, OTHER) if direction.startswith("saved here") else (OTHER, sys.executable)
    saved = run(writer, "save", tmp_path / "models")
    loaded = run(reader, "load", tmp_path / "models")
    print(f"saved with transformers {saved['transformers']}, loaded with {loaded['transformers']}")
    for name in ("s4d-lm", "s4-lm", "s4-moe-lm", "moe-lm"):
        for how in ("remote", "own"):
            assert loaded[how][name]["tokens"] == saved[name]["tokens"], (name, how)
            # continuing from the returned cache gives what one call gives, on the reader's version too
            assert loaded[how][name]["continued"] == saved[name]["tokens"], (name, how)
            torch.testing.assert_close(torch.tensor(loaded[how][name]["logits"]),
                                       torch.tensor(saved[name]["logits"]), rtol=1e-5, atol=1e-5)


def test_the_floor_lane_tries_exactly_the_floors_pyproject_claims():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    repo = Path(__file__).parent.parent
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    claimed = {}
    for line in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(line)
        floors = [s.version for s in req.specifier if s.operator == ">="]
        assert len(floors) == 1, f"{line}: every dependency needs one floor (>=)"
        claimed[canonicalize_name(req.name)] = floors[0]
    pinned = {}
    for line in (repo / "constraints" / "floor.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            pinned[canonicalize_name(req.name)] = next(iter(req.specifier)).version
    makefile_torch = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", (repo / "Makefile").read_text(), re.M).group(1)
    assert Version(claimed["torch"]) <= Version(makefile_torch)  # the lock's torch is within the range
    assert {k: Version(v) for k, v in pinned.items()} == {k: Version(v) for k, v in claimed.items()}


@pytest.mark.parametrize("command", ["train", "eval", "export", "predict", "generate", "push", "show", "lr-find"])
def test_every_commands_help_prints_in_this_environment(command):
    """typer before 0.16 failed every `--help` of a command with an argument on click 8.2 and newer (which pip
    installs with it): the floor lane caught it once its typer and click met."""
    proc = subprocess.run([sys.executable, "-m", "s4accel", command, "--help"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "100"})
    assert proc.returncode == 0 and proc.stdout.startswith(f"Usage: s4accel {command} [OPTIONS]"), proc.stderr[-2000:]
