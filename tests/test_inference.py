"""Using a trained model: `s4accel eval` and `s4accel generate` from the command line, the Python API behind them,
`transformers.pipeline`, and loading that refuses anything but safetensors and s4accel's own code."""

import json

import pytest
import torch

from helpers import TINY, read_metrics, run_cli, small_text_file, train_in_process


@pytest.fixture(scope="module")
def run(tmp_path_factory, text):
    out = tmp_path_factory.mktemp("run")
    overrides = [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32",
                 "data.batch_size=4", "data.val_fraction=0.2", "train.max_steps=6", "train.eval_every=6",
                 "train.eval_max_batches=null", "log.progress_bar=false", "sample.prompts=[]"]
    train_in_process("recipes/s4_tiny_debug.yaml", overrides)
    return out, overrides


def test_eval_reproduces_the_runs_final_metrics(run):
    out, overrides = run
    proc = run_cli("eval", out, "recipes/s4_tiny_debug.yaml", *[a for o in overrides for a in ("--set", o)], "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    final = [r for r in read_metrics(out) if "eval/loss" in r][-1]
    for key in ("loss", "bits_per_char"):
        assert metrics[key] == pytest.approx(final[f"eval/{key}"], rel=1e-6)


def test_generate_greedy_matches_the_model_and_is_seeded(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = run
    proc = run_cli("generate", out, "--prompt", "ROMEO.", "--max-new-tokens", "12", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    tok = AutoTokenizer.from_pretrained(out / "final")
    ids = tok("ROMEO.", add_special_tokens=False, return_tensors="pt").input_ids
    expected = tok.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0], skip_special_tokens=True)
    assert proc.stdout.rstrip("\n") == expected

    from s4accel.tools.inference import generate_text

    a, b = (generate_text(out, "ROMEO.", 16, temperature=1.0, top_p=0.9, seed=3) for _ in range(2))
    assert a == b and a.startswith("ROMEO.")


def test_an_empty_prompt_starts_a_new_document_instead_of_crashing(run):
    out, _ = run
    proc = run_cli("generate", out, "--prompt", "", "--max-new-tokens", "12", "--temperature", "0")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stdout.rstrip("\n")) > 0


def test_text_generation_pipeline_works_after_import(run):
    import transformers

    import s4accel  # noqa: F401

    out, _ = run
    pipe = transformers.pipeline("text-generation", model=str(out / "final"))
    # The continuation alone (the full text always starts with the prompt, so checking that proves nothing): the
    # model's own greedy tokens, decoded.
    result = pipe("To be", max_new_tokens=5, do_sample=False, return_full_text=False)
    ids = pipe.tokenizer("To be", add_special_tokens=False, return_tensors="pt").input_ids
    greedy = pipe.model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:]
    assert len(greedy) == 5 and result[0]["generated_text"] == pipe.tokenizer.decode(greedy, skip_special_tokens=True)


def test_weights_are_only_read_from_safetensors(run, tmp_path):
    """A pickled checkpoint is refused, not unpickled."""
    from safetensors.torch import load_file

    out, _ = run
    model_dir = tmp_path / "pickled"
    model_dir.mkdir()
    for f in (out / "final").iterdir():
        if f.name != "model.safetensors":
            (model_dir / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(out / "final" / "model.safetensors"), model_dir / "pytorch_model.bin")
    proc = run_cli("generate", model_dir, "--prompt", "x", "--max-new-tokens", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {model_dir}: no model.safetensors (s4accel loads weights "
                                                "only from safetensors)"]


def test_remote_code_is_never_run(tmp_path):
    """A directory whose config points at code of its own (auto_map) and an unknown model type is refused."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "evil", "architectures": ["EvilForCausalLM"],
                                                      "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    (tmp_path / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    (tmp_path / "model.safetensors").write_bytes(b"")
    proc = run_cli("generate", tmp_path, "--prompt", "x")
    assert proc.returncode == 2, proc.stderr
    assert "remote code ran" not in proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: {tmp_path}: not an s4accel model (model_type 'evil'")


@pytest.mark.parametrize("ref, message", [
    ("no/such/dir", "no such directory"),
    ("missing-owner/missing-model", "not in the local cache and the Hub cannot be reached"),
])
def test_a_model_that_is_not_there_is_one_clear_line(ref, message):
    proc = run_cli("generate", ref, "--prompt", "x")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_predict_memory_stays_flat_however_many_rows(run, tmp_path):
    """Rows are read, predicted and written a batch at a time. It held every text, id and output record at once:
    1M short rows (47 MB of CSV) peaked at 2.1 GB of memory; here, 10x the rows took 11 MB more Python memory."""
    import random
    import tracemalloc

    from s4accel.tools.predict import predict

    rng = random.Random(0)
    words = "to be or not that is the question whether tis nobler in the mind".split()

    def rows(n):  # a save_to_disk folder: memory-mapped as it is, so the reading library allocates nothing per row
        import datasets

        path = tmp_path / f"rows{n}"
        datasets.Dataset.from_dict({"id": [f"r{i}" for i in range(n)],
                                    "text": [" ".join(rng.choices(words, k=6)) for _ in range(n)]}).save_to_disk(path)
        return path

    def peak(path):
        tracemalloc.start()
        try:
            predict(run[0], path, tmp_path / "out.jsonl", batch_size=500, progress=False)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = rows(2_000), rows(20_000)
    peak(small)  # one-time costs (imports, builders) out of the way
    growth = peak(large) - peak(small)
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len(lines) == 2_000 and json.loads(lines[-1])["id"] == "r1999"
    assert growth < 2 * 2**20, f"{growth / 2**20:.1f} MB more for 10x the rows"


def test_eval_of_a_model_on_a_recipe_of_another_kind_is_one_line(tmp_path):
    from helpers import RECIPES, short_epochs, train_in_process

    text = small_text_file(tmp_path)
    train_in_process(TINY, short_epochs(text, tmp_path / "lm", "train.max_steps=2", "checkpoint.every_steps=100"))
    for recipe, wanted in [("shakespeare_genre.yaml", "a sequence classifier of text"),
                           ("digits.yaml", "a sequence classifier of number sequences")]:
        proc = run_cli("eval", tmp_path / "lm", RECIPES / recipe)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr[-2000:]
        assert "a language model of text (S4ForCausalLM) cannot be scored with this recipe" in proc.stderr
        assert f"which trains {wanted}" in proc.stderr


def test_predict_batches_by_length_and_writes_every_document_in_order_with_its_own_numbers(run, tmp_path):
    """Documents of very different lengths: batched by length (a batch padded to its longest document made predict
    3-4x slower than eval), written back in their own order, each with the numbers it has alone (batch size 1)."""
    import csv
    import random

    from s4accel.tools.predict import predict

    rng = random.Random(0)
    data = tmp_path / "docs.jsonl"
    docs = [" ".join(["to be or not"] * rng.choice([1, 2, 50, 200])) for _ in range(70)]
    data.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs)))
    outs = {}
    for batch in (1, 8):
        predict(run[0], data, tmp_path / f"b{batch}.csv", batch_size=batch, progress=False)
        with open(tmp_path / f"b{batch}.csv") as f:
            outs[batch] = list(csv.DictReader(f))
    assert [r["id"] for r in outs[8]] == [f"d{i}" for i in range(70)] == [r["id"] for r in outs[1]]
    assert [r["tokens"] for r in outs[8]] == [r["tokens"] for r in outs[1]]
    torch.testing.assert_close(torch.tensor([float(r["loss"]) for r in outs[8]], dtype=torch.float64),
                               torch.tensor([float(r["loss"]) for r in outs[1]], dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


def test_length_batches_pad_far_less_than_batches_in_file_order():
    """What makes predict faster: every example once, full batches but the last, little padding."""
    import numpy as np

    from s4accel.tools.predict import LengthBatches

    class Lengths:
        def __init__(self, n):
            self.all = np.random.default_rng(0).choice([3, 60, 4000], size=n)

        def lengths(self, start, n):
            return self.all[start: start + n]

    rows = Lengths(1000)
    batches = list(LengthBatches(rows, 1000, 16))
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert [len(b) for b in batches] == [16] * 62 + [8] and len(batches) == len(LengthBatches(rows, 1000, 16))

    def padded(groups):
        return sum(len(b) * max(rows.all[b]) - sum(rows.all[b]) for b in groups)

    in_order = [list(range(i, min(i + 16, 1000))) for i in range(0, 1000, 16)]
    assert padded(batches) < 0.05 * padded(in_order)


@pytest.mark.parametrize("seq_len", ["1", "true"])
def test_a_language_models_record_of_a_window_too_short_to_predict_is_one_line_not_rows_of_zeros(run, tmp_path,
                                                                                                  seq_len):
    """`"seq_len": 1` (or `true`) made predict write `tokens 0, loss 0.0` for every document, exit 0: a window of one
    token holds no target."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(run[0] / "final", model)
    record = json.loads((model / "preprocessing.json").read_text())
    (model / "preprocessing.json").write_text(json.dumps(record).replace(f'"seq_len": {record["seq_len"]}',
                                                                         f'"seq_len": {seq_len}'))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "To be, or not to be"}) + "\n")
    proc = run_cli("predict", model, data, "--out", tmp_path / "p.csv")
    assert proc.returncode == 2 and not (tmp_path / "p.csv").exists(), proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {model / 'preprocessing.json'}: "), lines
    assert "seq_len" in lines[0], lines

