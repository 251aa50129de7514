"""Every command a tutorial shows (docs/tutorials/*.md) runs as shown, in the order shown, on this CPU: its exit
status is 0. A command that cannot run here in seconds to a minute is listed below with the reason, and the test
fails on a new command that is neither run nor listed. An `s4accel` or `accelerate launch` command that uses nothing
of the shell beyond its words is split as bash splits it and forked from the test server (helpers.run_cli,
helpers.accelerate_launch); the others run in bash."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, accelerate_launch, run_cli

TUTORIALS = sorted((REPO / "docs" / "tutorials").glob("*.md"))

NOT_RUN = {  # the start of a command (or of a Python block) -> why it is not run here
    "s4accel train recipes/quickstart.yaml": "two minutes or more: make quickstart runs it",
    "s4accel find-batch-size": "minutes on a CPU (it tries batch sizes up to 1,024); tests/test_finders.py runs it "
                               "small",
    "accelerate launch --config_file accelerate_configs/multi_gpu.yaml": "needs GPUs",
    "s4accel train lora.yaml": "adapts the quick-start's model (two minutes to train); tests/test_lora.py runs the "
                               "same on a smaller base",
    "s4accel export runs/quickstart-lora": "follows the LoRA run above; tests/test_lora.py",
    "s4accel generate merged": "follows the LoRA run above; tests/test_lora.py",
    "s4accel generate runs/quickstart-lora": "follows the LoRA run above; tests/test_lora.py",
    "s4accel push": "needs a Hub; tests/test_hub.py runs pushes against a local Hub server",
    "python: recipes/quickstart.yaml": "trains the quick-start; tests/test_cli.py runs s4accel.train from Python",
    "python: runs/quickstart/final": "needs the quick-start's model; tests/test_cli.py loads a trained model so",
    "python: runs/quickstart-lora": "needs the LoRA run above; tests/test_lora.py",
}


def steps(page: Path) -> list[tuple[str, str]]:
    """(kind, text) in page order: ("bash", one command), ("python", a block), ("file NAME", a recipe to write:
    a YAML block the paragraph before it asks to save as NAME)."""
    out, text = [], page.read_text()
    for match in re.finditer(r"(?ms)^```(\w+)\n(.*?)^```", text):
        kind, body = match.groups()
        before = text[:match.start()].rstrip().split("\n\n")[-1]
        if kind == "bash":
            out += [("bash", line.split("  #")[0].strip()) for line in body.splitlines() if line.strip()]
        elif kind == "python":
            out.append(("python", body))
        elif kind == "yaml" and (saved := re.search(r"Save this as `([^`]+)`", before)):
            out.append((f"file {saved.group(1)}", body))
    return out


def excused(kind: str, text: str) -> str | None:
    key = text if kind == "bash" else "python: " + " ".join(re.findall(r'"([^"]+)"', text))
    return next((why for start, why in NOT_RUN.items() if key.startswith(start) or
                 (start.startswith("python: ") and kind == "python" and start[8:] in text)), None)


@pytest.mark.slow
@pytest.mark.parametrize("page", TUTORIALS, ids=lambda p: p.stem)
def test_every_command_of_the_tutorial_runs_as_shown(page, tmp_path):
    for folder in ("recipes", "accelerate_configs", "docs"):  # the repository as the tutorial's reader has it
        (tmp_path / folder).symlink_to(REPO / folder)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    ran = 0
    for kind, text in steps(page):
        if kind.startswith("file "):
            (tmp_path / kind[5:]).write_text(text)
            continue
        if excused(kind, text):
            continue
        proc = run_step(kind, text, tmp_path, env)
        assert proc.returncode == 0, f"{text}\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}"
        ran += 1
    assert ran or all(excused(k, t) for k, t in steps(page) if not k.startswith("file ")), page.name


def run_step(kind: str, text: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    words = shlex.split(text) if kind == "bash" and not re.search(r"[|&;<>()$`*?~\\]", text) else []
    if words[:1] == ["s4accel"]:
        return run_cli(*words[1:], env=env, cwd=cwd)
    if words[:2] == ["accelerate", "launch"]:
        return accelerate_launch(*words[2:], env=env, cwd=cwd)
    command = ["bash", "-c", text] if kind == "bash" else [sys.executable, "-c", text]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_every_tutorial_command_is_run_or_listed_with_its_reason():
    listed = [(page.name, text) for page in TUTORIALS for kind, text in steps(page)
              if not kind.startswith("file ") and excused(kind, text)]
    used = {start for start in NOT_RUN for _, text in listed
            if text.startswith(start) or (start.startswith("python: ") and start[8:] in text)}
    assert used == set(NOT_RUN), set(NOT_RUN) - used  # no excuse outlives its command
    assert any(page.stem == "own-text" for page in TUTORIALS) and len(TUTORIALS) >= 5


def test_the_callback_the_own_task_page_shows_stops_a_run_as_its_recipe_block_attaches_it(tmp_path):
    """docs/how-to/own-task.md's `hooks.py` and the recipe line that attaches it, as a reader copies them, next to
    a recipe of their own: the run stops at the first evaluation below the threshold (raised here so the tiny model
    reaches it), with the callback's reason, a checkpoint and an exported model."""
    import yaml

    from helpers import TINY, train_in_process

    page = (REPO / "docs" / "how-to" / "own-task.md").read_text()
    hooks = next(b for b in re.findall(r"(?ms)^```python\n(.*?)^```", page) if b.startswith("# hooks.py"))
    line = next(b for b in re.findall(r"(?ms)^```yaml\n(.*?)^```", page) if "hooks.py:StopAtLoss" in b)
    (tmp_path / "hooks.py").write_text(hooks)
    recipe = {**yaml.safe_load(TINY.read_text()), **yaml.safe_load(line)}
    recipe["callbacks"][0]["args"]["threshold"] = 100.0
    recipe["run"]["out_dir"] = str(tmp_path / "run")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = train_in_process(tmp_path / "recipe.yaml", ["train.max_steps=30", "train.eval_every=5"])
    assert result.steps == 5 and result.stop_reason == "eval loss below 100.0"
    assert (tmp_path / "run" / "final" / "config.json").is_file() and result.checkpoint is not None
