"""`s4accel push` against a Hub-compatible server on 127.0.0.1 (tests/hub_server.py): what is uploaded, that it
downloads back to the same model, pushing again and to a branch, and one-line errors that leave the run untouched."""

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml

from helpers import REPO, read_metrics, run_cli, train_in_process
from hub_server import GOOD_TOKEN, HubServer

pytestmark = pytest.mark.slow

IDS = [[3, 40, 41, 42, 43, 44]]
DOWNLOAD = """
import json, sys, torch
from huggingface_hub import snapshot_download
import s4accel
from s4accel.tools.inference import load_model
path = snapshot_download(sys.argv[1], revision=sys.argv[2])
model, tokenizer, _ = load_model(path)
with torch.no_grad():
    print(json.dumps(model(torch.tensor(json.loads(sys.argv[3]))).logits.tolist()))
"""


def hub_env(hub_url, token=GOOD_TOKEN):
    # HF_ENDPOINT must be set before huggingface_hub is imported: the subprocesses import it fresh.
    # HF_HOME: a download cache of this test's own (set by the `hub` fixture or the test).
    return {"HF_ENDPOINT": hub_url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0", "HF_TOKEN": token,
            "HF_HOME": os.environ["HF_TEST_HOME"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory, text):
    out = tmp_path_factory.mktemp("run")
    train_in_process("recipes/s4_tiny_debug.yaml", [
        f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32", "data.batch_size=4",
        "data.val_fraction=0.2", "train.max_steps=6", "train.eval_every=3", "checkpoint.keep_best=1",
        "train.ema={decay: 0.9}", "log.log_every=1", "log.progress_bar=false", "sample.prompts=[]"])
    return out


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TEST_HOME", str(tmp_path / "hf_home"))  # a fresh download cache per test
    with HubServer() as server:
        yield server


def snapshot(run_dir):
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def logits_from_hub(hub, repo_id, revision="main"):
    proc = subprocess.run([sys.executable, "-c", DOWNLOAD, repo_id, revision, json.dumps(IDS)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **hub_env(hub.url)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1]))


REMOTE_CODE = """
import json, sys, torch
sys.modules["s4accel"] = None  # not installed, as far as this process knows
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    print(json.dumps([type(model).__module__, model(torch.tensor(json.loads(sys.argv[2]))).logits.tolist()]))
"""


def local_logits(model_dir):
    from s4accel.tools.inference import load_model

    model, _, _ = load_model(model_dir)
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits


def test_push_uploads_model_card_recipe_metrics_logs_and_downloads_to_the_same_model(run, hub, tmp_path):
    before = snapshot(run)
    proc = run_cli("push", run, "--repo-id", "alice/tiny-s4", env=hub_env(hub.url))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert GOOD_TOKEN not in proc.stdout + proc.stderr
    assert snapshot(run) == before  # the run directory is only read

    files = hub.files("alice/tiny-s4")
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json",
                 "modeling_s4.py", "configuration_s4.py", "README.md", "recipe.yaml", "metrics.json"):
        assert name in files, name
    assert files["training_curve.png"].startswith(b"\x89PNG")
    assert any(p.startswith("runs/") and "tfevents" in p for p in files)
    published, kept = yaml.safe_load(files["recipe.yaml"]), yaml.safe_load((run / "recipe.yaml").read_text())
    assert published["data"]["files"] == ["play.txt"] and published["run"]["out_dir"] is None  # no machine paths
    assert {k: v for k, v in published.items() if k not in ("run", "data")} == {
        k: v for k, v in kept.items() if k not in ("run", "data")}  # otherwise the run's resolved recipe
    assert ("PUT", next(p for m, p in hub.state.requests if m == "PUT")) in hub.state.requests  # LFS upload used

    from huggingface_hub import ModelCard

    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "transformers" and "s4accel" in card.data.tags
    final_eval = [r for r in read_metrics(run) if "eval/loss" in r][-1]
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert results["bits_per_char"] == pytest.approx(final_eval["eval/bits_per_char"], rel=1e-5)
    assert json.loads(files["metrics.json"])["eval"]["loss"] == final_eval["eval/loss"]
    assert "![training curve](training_curve.png)" in card.text

    expected = local_logits(run / "final")
    torch.testing.assert_close(logits_from_hub(hub, "alice/tiny-s4"), expected, rtol=0, atol=0)

    # Where s4accel is not installed: the repository's own code, by repo id, with trust_remote_code=True (a
    # download cache of its own: transformers' notice is for code files it downloads).
    proc = subprocess.run([sys.executable, "-c", REMOTE_CODE, "alice/tiny-s4", json.dumps(IDS)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **hub_env(hub.url), "HF_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    module, logits = json.loads(proc.stdout.strip().splitlines()[-1])
    assert module.startswith("transformers_modules.")
    torch.testing.assert_close(torch.tensor(logits), expected, rtol=1e-5, atol=1e-6)
    assert proc.stderr.count("A new version of the following files was downloaded") == 2  # one per code file


PUSH_FROM_PYTHON = """
import sys
from s4accel import S4Config, S4ForCausalLM
model = S4ForCausalLM(S4Config(d_model=16, n_layer=1, d_state=8, vocab_size=40))
model.push_to_hub(sys.argv[1])
model.save_pretrained(sys.argv[2], push_to_hub=True, repo_id=sys.argv[3])
"""


def test_push_to_hub_from_python_uploads_the_code_as_two_files(hub, tmp_path):
    proc = subprocess.run([sys.executable, "-c", PUSH_FROM_PYTHON, "alice/api", str(tmp_path), "alice/saved"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **hub_env(hub.url)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for repo in ("alice/api", "alice/saved"):
        assert {p for p in hub.files(repo) if p.endswith(".py")} == {"configuration_s4.py", "modeling_s4.py"}, repo


def test_pushing_again_to_an_existing_repo_and_to_a_branch(run, hub):
    env = hub_env(hub.url)
    assert run_cli("push", run, "--repo-id", "alice/again", "--private", env=env).returncode == 0
    assert hub.state.repos["alice/again"].private
    main_files = dict(hub.files("alice/again"))
    proc = run_cli("push", run, "--repo-id", "alice/again", "--best", "--revision", "best-model", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub.files("alice/again") == main_files  # main untouched
    best_dir = next((run / "best").glob("step_*"))
    assert hub.files("alice/again", "best-model")["model.safetensors"] == (best_dir / "model.safetensors").read_bytes()
    proc = run_cli("push", run, "--repo-id", "alice/again", "--ema", env=env)  # a second commit on main
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub.files("alice/again")["model.safetensors"] == (run / "final_ema" / "model.safetensors").read_bytes()
    ema_eval = [r for r in read_metrics(run) if "eval_ema/loss" in r][-1]
    assert json.loads(hub.files("alice/again")["metrics.json"])["eval"]["loss"] == ema_eval["eval_ema/loss"]
    torch.testing.assert_close(logits_from_hub(hub, "alice/again", "best-model"), local_logits(best_dir),
                               rtol=0, atol=0)


def test_a_bad_token_is_one_line_and_leaves_the_run_untouched(run, hub):
    before = snapshot(run)
    proc = run_cli("push", run, "--repo-id", "alice/nope", env=hub_env(hub.url, token="hf_wrong_token"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: push to alice/nope failed: HTTP 401: the token was refused (check HF_TOKEN or `hf auth login`)"]
    assert "hf_wrong_token" not in proc.stdout + proc.stderr
    assert snapshot(run) == before and not hub.state.repos


def test_an_unreachable_endpoint_is_one_line(run, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TEST_HOME", str(tmp_path / "hf_home"))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = snapshot(run)
    proc = run_cli("push", run, "--repo-id", "alice/x", env=hub_env(f"http://127.0.0.1:{port}"), timeout=300)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: push to alice/x failed: cannot reach"), proc.stderr
    assert snapshot(run) == before


def test_recipe_can_push_at_the_end_of_training(tmp_path, hub, text):
    out = tmp_path / "run"
    proc = run_cli("train", REPO / "recipes" / "s4_tiny_debug.yaml", "--set", f"run.out_dir={out}",
                   "--set", "data.source=files", "--set", f"data.files=[{text}]", "--set", "data.seq_len=32",
                   "--set", "train.max_steps=2", "--set", "train.eval_every=2", "--set", "log.progress_bar=false",
                   "--set", "sample.prompts=[]", "--set", "hub={push_at_end: true, repo_id: bob/auto}",
                   env=hub_env(hub.url))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model.safetensors" in hub.files("bob/auto")
    assert hub.files("bob/auto")["model.safetensors"] == (out / "final" / "model.safetensors").read_bytes()


def test_push_uploads_only_regular_files_inside_the_run_and_says_which_links_it_skipped(run, hub, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    secret = tmp_path / "token.txt"
    secret.write_text("hf_this_must_never_leave_the_machine")
    (copy / "final" / "notes.txt").symlink_to(secret)
    (copy / "final" / "generation_config.json").unlink()
    (copy / "final" / "generation_config.json").symlink_to(secret)
    (copy / "tensorboard" / "events.out.tfevents.0.evil").symlink_to(secret)
    proc = run_cli("push", copy, "--repo-id", "alice/links", env=hub_env(hub.url))
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = hub.files("alice/links")
    assert not any(b"hf_this_must_never_leave" in data for data in files.values())
    assert "notes.txt" not in files and "generation_config.json" not in files
    for name in ("notes.txt", "generation_config.json", "events.out.tfevents.0.evil"):
        assert f"skipping {name}: a symbolic link" in proc.stderr, proc.stderr


def test_no_file_push_reads_follows_a_link_out_of_the_run_best_metrics_recipe_or_metrics_log(run, hub, tmp_path):
    """A cloud key is JSON: linked as best/step_*/metrics.json, it used to be parsed and uploaded as the metrics."""
    import shutil

    secret = tmp_path / "service-account.json"
    secret.write_text(json.dumps({"loss": -1.0, "step": 0, "private_key": "KEY-MUST-NEVER-LEAVE"}))
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    best = next((copy / "best").glob("step_*"))
    (best / "metrics.json").unlink()
    (best / "metrics.json").symlink_to(secret)
    proc = run_cli("push", copy, "--repo-id", "alice/best-link", "--best", env=hub_env(hub.url))
    assert proc.returncode != 0 and "metrics.json is not a regular file inside the run directory" in proc.stderr
    assert "alice/best-link" not in hub.state.repos or not any(
        b"KEY-MUST-NEVER-LEAVE" in data for data in hub.files("alice/best-link").values())

    for name in ("recipe.yaml", "metrics.jsonl"):  # read for the card, the metrics and the curve
        (copy / name).unlink()
        (copy / name).symlink_to(secret)
    proc = run_cli("push", copy, "--repo-id", "alice/final-links", env=hub_env(hub.url))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not any(b"KEY-MUST-NEVER-LEAVE" in data for data in hub.files("alice/final-links").values())
    for name in ("recipe.yaml", "metrics.jsonl"):
        assert f"skipping {name}: a symbolic link" in proc.stderr, proc.stderr


PROJECT_RECIPE = """
run: {name: alice-corpus}
model: {name: s4-tiny}
data:
  mixture:
    - {source: files, files: [corpus/*.parquet], weight: 1}
    - {source: dataset, path: carol/plays, weight: 1}
  tokenizer: my_tok
  seq_len: 32
  batch_size: 4
  val_fraction: 0.2
train: {max_steps: 4, eval_every: 2}
log: {log_every: 1, progress_bar: false}
sample: {prompts: []}
callbacks: [{target: hooks.py:Note}]
"""


def user_project(folder, text):
    """What a user brings: a corpus as parquet, a BPE tokenizer folder of their own, a callback file, and a recipe
    naming them relative to itself."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    docs = [text[i:i + 300] for i in range(0, len(text), 300)]
    (folder / "corpus").mkdir(parents=True)
    pq.write_table(pa.table({"text": docs}), folder / "corpus" / "part-0.parquet")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>")
    tokenizer.save_pretrained(folder / "my_tok")
    (folder / "hooks.py").write_text("from s4accel import Callback\n\n\nclass Note(Callback):\n    pass\n")
    (folder / "recipe.yaml").write_text(PROJECT_RECIPE)
    return docs


def serve_dataset(hub, repo_id, rows):
    """A dataset repository of one parquet file on the test Hub."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from hub_server import Repo

    buf = io.BytesIO()
    pq.write_table(pa.table({"text": rows}), buf)
    repo = Repo(private=False)
    repo.branches["main"] = repo.snapshots[repo.heads["main"]] = {"data/train-00000-of-00001.parquet": buf.getvalue()}
    hub.state.repos[f"datasets/{repo_id}"] = repo


def test_a_pushed_repo_names_no_path_of_the_training_machine_and_its_recipe_trains_elsewhere(hub, tmp_path, text,
                                                                                          tmp_path_factory):
    """Before: recipe.yaml, the card's recipe and the TensorBoard hparams held the data, tokenizer, callback and run
    directory as absolute paths, and the card's `datasets:` said `text`."""
    from huggingface_hub import ModelCard

    alice = tmp_path / "home" / "alice" / "secret-project"
    docs = user_project(alice, text.read_text())
    serve_dataset(hub, "carol/plays", docs[::-1])
    env = {**hub_env(hub.url), "HF_DATASETS_OFFLINE": "0", "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}
    run = tmp_path / "scratch" / "alice-runs" / "r1"
    proc = run_cli("train", alice / "recipe.yaml", "--set", f"run.out_dir={run}", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("push", run, "--repo-id", "alice/corpus-s4", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    files = hub.files("alice/corpus-s4")
    assert any(p.startswith("runs/") and "tfevents" in p for p in files)
    for path in (str(tmp_path_factory.getbasetemp()), str(REPO), "secret-project/", "alice-runs"):
        leaked = [name for name, data in files.items() if path.encode() in data]
        assert not leaked, (path, leaked)

    recipe = yaml.safe_load(files["recipe.yaml"])
    assert recipe["data"]["mixture"][0]["files"] == ["corpus/*.parquet"] and recipe["data"]["tokenizer"] == "my_tok"
    assert recipe["data"]["mixture"][1]["path"] == "carol/plays"  # a Hub id stays what it is
    assert recipe["callbacks"][0]["target"] == "hooks.py:Note" and recipe["run"]["out_dir"] is None
    card = ModelCard(files["README.md"].decode())
    assert card.data.datasets == ["carol/plays"]  # the Hub dataset it read; the parquet files are on no Hub page
    assert {r.dataset_name for r in card.data.eval_results} == {"a mixture of local files: corpus/*.parquet; "
                                                                "carol/plays"}
    assert "- `data.mixture.files`: `corpus/*.parquet`\n- `data.tokenizer`: `my_tok`\n" in card.text
    assert files["recipe.yaml"].decode().strip() in card.text

    # Another user: the recipe downloaded, their own files put next to it under the names the card gives.
    bob = tmp_path / "bob"
    user_project(bob, text.read_text()[::-1])
    (bob / "recipe.yaml").write_bytes(files["recipe.yaml"])
    proc = run_cli("train", bob / "recipe.yaml", env=env, cwd=bob)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 4 steps" in proc.stdout and (bob / "runs" / "alice-corpus" / "final" / "model.safetensors").is_file()


def test_a_model_file_holding_a_path_of_the_machine_is_refused_before_anything_is_pushed(run, hub, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "final" / "notes.txt").write_text(f"trained in {copy.resolve()}/final\n")
    proc = run_cli("push", copy, "--repo-id", "alice/leaky", env=hub_env(hub.url))
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"error: notes.txt would publish a path of this machine ({copy.resolve()}); nothing was pushed"]
    assert "alice/leaky" not in hub.state.repos
