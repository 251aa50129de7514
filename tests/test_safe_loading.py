"""Loading a model that someone else made (`s4accel generate`, `eval`, `predict`): only `.safetensors` files inside
the model's own folder (or Hub snapshot) are read, nothing is unpickled, no code runs, and a folder that is not a
whole, finite s4accel model is one line, never a randomly initialised model or a traceback."""

import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import TINY, run_cli, train_in_process
from s4accel.errors import ModelError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text):
    out = tmp_path_factory.mktemp("trained") / "run"
    train_in_process(TINY, [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32",
                            "train.max_steps=2", "train.eval_every=0", "scheduler.warmup_steps=0",
                            "log.progress_bar=false", "log.log_with=[jsonl]", "sample.prompts=[]"])
    return out / "final"


@pytest.fixture
def model_dir(trained, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(trained, path)
    return path


def load(path):
    from s4accel.tools.inference import load_model

    return load_model(path)


def shard_as(model_dir, shard_name, write):
    """Replace model.safetensors by an index mapping every tensor to `shard_name`, written by
    `write(path, tensors)`."""
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: shard_name for k in tensors}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    target = (model_dir / shard_name) if not os.path.isabs(shard_name) else __import__("pathlib").Path(shard_name)
    target.parent.mkdir(parents=True, exist_ok=True)
    write(target, tensors)
    return target


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_an_intact_model_loads(model_dir):
    model, tokenizer, _ = load(model_dir)
    assert tokenizer is not None and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("shard", ["vocab.txt", "pytorch_model.bin"])
def test_a_pickled_shard_is_refused_before_it_is_opened(model_dir, tmp_path, shard):
    """A pickle named like an allowed download (`vocab.txt`) or a torch `.bin`: never unpickled, by the API or the
    CLI."""
    marker = tmp_path / "pwned"
    shard_as(model_dir, shard, lambda path, tensors: path.write_bytes(pickle.dumps(Evil(marker))))
    with pytest.raises(ModelError, match=rf"shard '{re.escape(shard)}' is not a .safetensors file"):
        load(model_dir)
    assert not marker.exists()
    proc = run_cli("generate", model_dir, "--prompt", "ROMEO.", "--max-new-tokens", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert not marker.exists()


@pytest.mark.parametrize("where", ["../outside/x.safetensors", "ABSOLUTE"])
def test_shards_outside_the_model_folder_are_refused(model_dir, tmp_path, where):
    name = str(tmp_path / "elsewhere" / "x.safetensors") if where == "ABSOLUTE" else where
    shard_as(model_dir, name, lambda path, tensors: save_file(tensors, path))
    with pytest.raises(ModelError, match=r"outside the model folder"):
        load(model_dir)


def test_a_symlink_to_weights_outside_the_folder_is_refused(model_dir, tmp_path):
    outside = tmp_path / "secret.safetensors"
    shutil.move(model_dir / "model.safetensors", outside)
    (model_dir / "model.safetensors").symlink_to(outside)
    with pytest.raises(ModelError, match=r"outside the model folder"):
        load(model_dir)


def edit_config(model_dir, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def edit_weights(model_dir, change):
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def first(tensors):
    return sorted(k for k in tensors if tensors[k].dim() == 2)[0]


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "config.json").write_text("{not json"), r"config.json: not valid JSON"),
    (lambda d: edit_config(d, model_type="gpt2"), r"not an s4accel model \(model_type 'gpt2'"),
    (lambda d: edit_config(d, d_model=48), r"the weights do not fit the config: .* has shape"),
    (lambda d: edit_weights(d, lambda t: t.pop(first(t))), r"the weights do not fit the config: missing"),
    (lambda d: edit_weights(d, lambda t: t.update(extra=torch.zeros(3))), r"unexpected tensor\(s\) extra"),
    (lambda d: edit_weights(d, lambda t: t.update({first(t): t[first(t)].long()})), r"holds int64"),
    (lambda d: edit_weights(d, lambda t: t[first(t)].view(-1).__setitem__(0, float("nan"))),
     r"NaN or infinite"),
    (lambda d: (d / "model.safetensors").write_bytes(os.urandom(4000)), r"not a valid safetensors file"),
    (lambda d: (d / "model.safetensors").write_bytes((2**60).to_bytes(8, "little") + b"{}"),
     r"not a valid safetensors file"),
])
def test_a_damaged_model_folder_is_one_line(model_dir, damage, message):
    damage(model_dir)
    with pytest.raises(ModelError, match=message):
        load(model_dir)


@pytest.mark.parametrize("change, message", [
    ({"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}, r"its tokenizer needs remote code"),
    ({"tokenizer_class": "NoSuchTokenizer"}, r"tokenizer: unknown tokenizer_class 'NoSuchTokenizer'"),
])
def test_a_tokenizer_that_needs_code_or_does_not_exist_is_one_line(model_dir, change, message):
    path = model_dir / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ModelError, match=message):
        load(model_dir)


def test_a_model_folder_whose_tokenizer_is_larger_than_its_vocabulary_is_refused(model_dir):
    """Loaded, generate decoded the model's ids with another tokenizer's words (or failed on a prompt's large id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    for f in model_dir.glob("tokenizer*"):
        f.unlink()
    vocab = {"</s>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(400)}}  # the model has 259 rows
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(model_dir)
    with pytest.raises(ModelError, match=r"its tokenizer has ids up to 401 but the model has vocab_size=259: not the "
                                         r"tokenizer this model was trained with"):
        load(model_dir)


HUB_LOAD = """
import sys
from s4accel.tools.inference import load_model
from s4accel.errors import S4AccelError
try:
    load_model(sys.argv[1])
except S4AccelError as e:
    print("ERROR", e)
"""


def test_a_hub_repo_with_a_pickled_shard_is_refused(trained, tmp_path):
    from hub_server import HubServer, Repo

    marker = tmp_path / "pwned"
    files = {p.name: p.read_bytes() for p in trained.iterdir() if p.is_file() and p.name != "model.safetensors"}
    tensors = load_file(trained / "model.safetensors")
    files["model.safetensors.index.json"] = json.dumps({"metadata": {},
                                                        "weight_map": {k: "vocab.txt" for k in tensors}}).encode()
    files["vocab.txt"] = pickle.dumps(Evil(marker))
    with HubServer() as hub:
        repo = Repo(private=False)
        repo.branches["main"] = repo.snapshots[repo.heads["main"]] = files
        hub.state.repos["mallory/model"] = repo
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0",
               "HF_HOME": str(tmp_path / "hf_home")}
        proc = subprocess.run([sys.executable, "-c", HUB_LOAD, "mallory/model"], capture_output=True, text=True,
                              timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shard 'vocab.txt' is not a .safetensors file" in proc.stdout
    assert not marker.exists()
