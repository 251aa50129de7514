"""The suite's forked `accelerate launch` (tests/forkserver.py) gives its workers what the real launcher gives them: a
release of Accelerate or torch that changes what its workers are started with shows here, not as a test elsewhere
passing on a launch no user runs."""

import json
import os
import sys

import pytest

from helpers import FREE_PORT, REPO, accelerate_launch

pytestmark = pytest.mark.slow

REPORT = """
import json, os, sys, torch
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"env": dict(os.environ), "threads": torch.get_num_threads()}, f)
"""
# Values of a launch of its own: its port, its error files' folder, its own store (torchrun's agent serves one to its
# workers; the forked rank 0 serves it), and what the shell sets for a new process
OWN = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE", "_", "PYTEST_CURRENT_TEST"}


def reports(folder) -> dict:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


@pytest.mark.parametrize("config", ["cpu_2proc.yaml", "fsdp.yaml"])
def test_forked_workers_get_the_environment_ranks_and_threads_of_the_real_launcher(tmp_path, config):
    import subprocess

    script = tmp_path / "report.py"
    script.write_text(REPORT)
    args = [*FREE_PORT, "--config_file", str(REPO / "accelerate_configs" / config), "--num_processes", "2",
            str(script)]
    (tmp_path / "real").mkdir()
    (tmp_path / "forked").mkdir()
    # (os.environ passed as it is: this process's C environment may hold more, such as readline's COLUMNS)
    real = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *args, str(tmp_path / "real")],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ))
    forked = accelerate_launch(*args, tmp_path / "forked", timeout=300)
    assert real.returncode == 0 and forked.returncode == 0, (real.stderr[-2000:], forked.stderr[-2000:])
    real, forked = reports(tmp_path / "real"), reports(tmp_path / "forked")
    assert list(real) == list(forked) == ["0", "1"]
    for rank in real:
        a, b = real[rank], forked[rank]
        assert {k: v for k, v in a["env"].items() if k not in OWN} == {k: v for k, v in b["env"].items()
                                                                        if k not in OWN}, rank
        assert a["threads"] == b["threads"], rank
