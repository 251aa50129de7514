"""Bring your own data: every source `datasets` reads (files of each format, directories, globs, save_to_disk folders,
load_dataset folders, a Hub dataset repository), the column to read, a validation set of its own, a tokenizer of
your own, labelled documents; each bad input one line naming the key and what was found."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, TINY, train_in_process
from s4accel.config import load_recipe
from s4accel.errors import DataError

LINES = [f"Line {i}: the quality of mercy is not strained, it droppeth as the gentle rain {i}." for i in range(60)]


def data_cfg(*overrides):
    return load_recipe(TINY, ["sample.prompts=[]", "data.seq_len=16", *overrides]).data


def build(cfg):
    from s4accel.data import build_data

    return build_data(cfg)


def first_block_text(data):
    return data.tokenizer.decode(np.asarray(data.train[0]["input_ids"]).tolist())


def write_formats(tmp_path):
    """The same documents as .csv, .parquet, .jsonl, .arrow, .txt files (`body` column; one .txt per document)."""
    import datasets

    ds = datasets.Dataset.from_dict({"body": LINES, "n": list(range(len(LINES)))})
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_json(str(tmp_path / "d.jsonl"))
    (tmp_path / "arrow").mkdir()
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    (tmp_path / "arrow" / "d.arrow").write_bytes(arrow.read_bytes())
    (tmp_path / "txt").mkdir()
    for i, line in enumerate(LINES):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(line)


@pytest.mark.parametrize("files, field", [
    (["d.csv"], "body"), (["d.parquet"], "body"), (["d.jsonl"], "body"), (["arrow/d.arrow"], "body"),
    (["txt"], "text"), (["txt/*.txt"], "text"), (["txt/**"], "text"), (["d.csv", "d.parquet"], "body"),
])
def test_every_file_format_directory_and_glob_reads_the_same_documents(tmp_path, hf_cache, files, field):
    write_formats(tmp_path)
    paths = json.dumps([str(tmp_path / f) for f in files])
    data = build(data_cfg("data.source=files", f"data.files={paths}", f"data.text_field={field}",
                          f"data.cache_dir={tmp_path / 'cache'}"))
    assert first_block_text(data).startswith(LINES[0][:15])
    per_copy = sum(len(line.encode()) + 1 for line in LINES)  # bytes + EOS per document
    total = (len(data.train) + len(data.val)) * 16  # whole blocks: less than one block of each batch dropped
    assert per_copy * len(files) - 16 * len(files) < total <= per_copy * len(files)


def test_save_to_disk_and_load_dataset_folders_and_splits(tmp_path, hf_cache):
    import datasets

    d = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": LINES[:50]}),
                              "validation": datasets.Dataset.from_dict({"text": LINES[50:]})})
    d.save_to_disk(str(tmp_path / "dict"))
    data = build(data_cfg("data.source=dataset", f"data.path={tmp_path / 'dict'}", "data.val_split=validation"))
    assert first_block_text(data).startswith(LINES[0][:15])
    assert data.tokenizer.decode(np.asarray(data.val[0]["input_ids"]).tolist()).startswith(LINES[50][:15])
    (tmp_path / "folder").mkdir()
    d["train"].to_parquet(str(tmp_path / "folder" / "train.parquet"))
    d["validation"].to_parquet(str(tmp_path / "folder" / "validation.parquet"))
    data = build(data_cfg("data.source=dataset", f"data.path={tmp_path / 'folder'}", "data.val_split=validation",
                          f"data.cache_dir={tmp_path / 'cache'}"))
    assert first_block_text(data).startswith(LINES[0][:15]) and len(data.val) > 0
    with pytest.raises(DataError, match=r"data.split: .*dict has no split 'nope' \(splits: train, validation\)"):
        build(data_cfg("data.source=dataset", f"data.path={tmp_path / 'dict'}", "data.split=nope"))


def test_val_files_are_a_validation_set_of_their_own(tmp_path, hf_cache):
    (tmp_path / "train.txt").write_text(" ".join(LINES[:50]))
    (tmp_path / "val.txt").write_text(" ".join(LINES[50:]))
    data = build(data_cfg("data.source=files", f"data.files=[{tmp_path / 'train.txt'}]",
                          f"data.val_files=[{tmp_path / 'val.txt'}]"))
    train_text = data.tokenizer.decode(np.asarray(data.train[:]["input_ids"]).reshape(-1).tolist())
    val_text = data.tokenizer.decode(np.asarray(data.val[:]["input_ids"]).reshape(-1).tolist())
    assert "Line 55" in val_text and "Line 55" not in train_text and "Line 5:" in train_text


@pytest.mark.parametrize("overrides, message", [
    (["data.source=files", "data.files=[DIR]"], r"data.files: the directory .* holds no .txt, .json"),
    (["data.source=files", "data.files=[DIR/*.nope]"], r"data.files: no file matches"),
    (["data.source=files", "data.files=[DIR/x.csv]", "data.text_field=txt"],
     r"data.text_field: no field 'txt' in .*x.csv \(fields: body, n\); a .csv file's first line names its columns: "
     r"add a header line such as 'txt', or set data.text_field$"),
    (["data.source=dataset", "data.path=DIR/none"], r"data.path: no such folder: .*none"),
    (["data.source=dataset", "data.path=DIR/empty_split"], r"holds no text"),
    (["data.source=files", "data.files=[DIR/x.csv]", "data.text_field=body", "data.tokenizer=DIR/no_tok"],
     r"data.tokenizer: cannot load"),
])
def test_bad_sources_are_one_line_errors_naming_the_key(tmp_path, hf_cache, overrides, message):
    import datasets

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.md").write_text("not a data file")
    datasets.Dataset.from_dict({"body": LINES, "n": list(range(60))}).to_csv(str(tmp_path / "x.csv"), index=False)
    datasets.Dataset.from_dict({"text": [" ", ""]}).save_to_disk(str(tmp_path / "empty_split"))
    overrides = [o.replace("DIR/", f"{tmp_path}/").replace("DIR]", f"{tmp_path / 'sub'}]") for o in overrides]
    with pytest.raises(DataError, match=message):
        build(data_cfg(*overrides))


def test_a_directory_that_exists_is_never_no_such_file(tmp_path, hf_cache):
    import datasets

    datasets.Dataset.from_dict({"text": LINES}).save_to_disk(str(tmp_path / "saved"))
    data = build(data_cfg("data.source=dataset", f"data.path={tmp_path / 'saved'}"))
    assert len(data.train) > 0
    with pytest.raises(DataError) as info:
        build(data_cfg("data.source=files", f"data.files=[{tmp_path / 'saved'}]"))
    assert "no such file" not in str(info.value)  # it says what the directory holds instead
    assert "a folder written by save_to_disk: read it with data.source: dataset" in str(info.value)


@pytest.mark.timeout(60)
def test_globs_and_directories_never_follow_links_round_a_loop_and_read_each_file_once(tmp_path):
    from s4accel.data.sources import expand_files

    tree = tmp_path / "D"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("a")
    (tree / "sub" / "b.txt").write_text("b")
    (tree / "sub" / "up").symlink_to("..")  # back up the tree: glob.glob read every file above it again
    (tree / "self").symlink_to("../D")  # a link to itself: glob.glob never returned
    (tmp_path / "outside.txt").write_text("outside")
    (tree / "sub" / "out").symlink_to(tmp_path)  # out of the tree
    expected = [str(tree / "a.txt"), str(tree / "sub" / "b.txt")]
    for patterns in ([f"{tree}/**/*.txt"], [str(tree)], [f"{tree}/*/*.txt", f"{tree}/*.txt"],
                     [f"{tree}/**/*.txt", str(tree / "a.txt"), str(tree / "sub" / "up" / "a.txt")]):
        assert sorted(expand_files(patterns)) == expected, patterns


def test_a_tokenizer_folder_of_your_own_is_used_saved_and_sets_the_vocabulary(tmp_path, hf_cache):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(LINES, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[SEP]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]").save_pretrained(
        tmp_path / "wordlevel")
    (tmp_path / "t.txt").write_text(" ".join(LINES))
    out = tmp_path / "run"
    result = train_in_process(TINY, [f"run.out_dir={out}", "data.source=files", f"data.files=[{tmp_path / 't.txt'}]",
                                     f"data.tokenizer={tmp_path / 'wordlevel'}", "data.seq_len=16",
                                     "train.max_steps=2",
                                     "train.eval_every=0", "scheduler.warmup_steps=0", "log.progress_bar=false",
                                     "log.log_with=[jsonl]", "sample.prompts=[]"])
    from transformers import AutoConfig, AutoTokenizer

    saved = AutoTokenizer.from_pretrained(result.final_dir)
    assert saved.get_vocab() == PreTrainedTokenizerFast.from_pretrained(tmp_path / "wordlevel").get_vocab()
    assert AutoConfig.from_pretrained(result.final_dir).vocab_size == len(saved)
    # no EOS: its [SEP] ends each document; no pad: EOS pads. Not byte-level: no bits per byte, said once.
    assert saved.eos_token == "[SEP]" and set(result.eval_metrics) == {"loss", "ppl"}


def gapped_tokenizer(folder, **config):
    """A word-level tokenizer whose ids leave gaps (numbered by rank in a larger list): ids reach past len()."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(" ".join(LINES).split()))
    vocab = {"[SEP]": 0, "[UNK]": 1, **{w: 2 + 5 * i for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]").save_pretrained(folder)
    if config:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return max(vocab.values()) + 1


def test_a_tokenizer_whose_ids_leave_gaps_sizes_the_model_by_its_largest_id(tmp_path, hf_cache):
    """Sized by len(tokenizer), the embedding had fewer rows than the largest id: an IndexError traceback."""
    extent = gapped_tokenizer(tmp_path / "gapped")
    (tmp_path / "t.txt").write_text(" ".join(LINES))
    result = train_in_process(TINY, [f"run.out_dir={tmp_path / 'run'}", "data.source=files",
                                     f"data.files=[{tmp_path / 't.txt'}]", f"data.tokenizer={tmp_path / 'gapped'}",
                                     "data.seq_len=16", "train.max_steps=2", "train.eval_every=0",
                                     "scheduler.warmup_steps=0", "log.progress_bar=false", "log.log_with=[jsonl]",
                                     "sample.prompts=[]"])
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(result.final_dir).vocab_size == extent > len(LINES)


def test_a_tokenizer_folder_naming_custom_code_is_refused_for_training(tmp_path, hf_cache):
    """Accepted (loaded without its code), the model it trained was then refused by generate, predict and eval."""
    gapped_tokenizer(tmp_path / "custom", auto_map={"AutoTokenizer": ["tok.MyTokenizer", None]})
    (tmp_path / "t.txt").write_text(" ".join(LINES))
    with pytest.raises(DataError, match=r"data.tokenizer: .*custom names custom tokenizer code \(auto_map"):
        build(data_cfg("data.source=files", f"data.files=[{tmp_path / 't.txt'}]",
                       f"data.tokenizer={tmp_path / 'custom'}"))


def test_a_dataset_folder_holding_a_loading_script_is_one_line_and_the_script_never_runs(tmp_path, hf_cache):
    folder = tmp_path / "scripted"
    folder.mkdir()
    (folder / "scripted.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    with pytest.raises(DataError, match=r"data.path: .*scripted holds a dataset loading script, which datasets no "
                                        r"longer runs"):
        build(data_cfg("data.source=dataset", f"data.path={folder}"))
    assert not (tmp_path / "ran").exists()


def test_a_tokenizer_with_no_way_to_end_a_document_is_refused(tmp_path, hf_cache):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(LINES, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "bare")
    (tmp_path / "t.txt").write_text(" ".join(LINES))
    with pytest.raises(DataError, match=r"data.tokenizer: .*bare has no eos_token \(nor sep_token\)"):
        build(data_cfg("data.source=files", f"data.files=[{tmp_path / 't.txt'}]",
                       f"data.tokenizer={tmp_path / 'bare'}"))


# ---- labelled documents ------------------------------------------------------------------------------------------


def test_labelled_documents_keep_label_names_pad_and_mask(tmp_path, hf_cache):
    import datasets

    rows = {"review": ["good " * (i % 7 + 1) if i % 2 else "bad " * (i % 5 + 1) for i in range(40)],
            "sentiment": ["pos" if i % 2 else "neg" for i in range(40)]}
    datasets.Dataset.from_dict(rows).to_json(str(tmp_path / "r.jsonl"))
    cfg = data_cfg("data.source=files", f"data.files=[{tmp_path / 'r.jsonl'}]", "data.text_field=review",
                   "data.label_field=sentiment", "data.val_fraction=0.25", "task.target=classification")
    data = build(cfg)
    assert data.class_names == ["neg", "pos"] and data.num_labels == 2
    assert len(data.train) == 30 and len(data.val) == 10
    from s4accel.data import collate_labelled_text

    batch = collate_labelled_text(data.pad_token_id)([data.train[i] for i in range(4)])
    lengths = [len(data.train[i]["input_ids"]) for i in range(4)]
    assert batch["input_ids"].shape == (4, max(lengths)) and batch["attention_mask"].sum(1).tolist() == lengths
    assert (batch["input_ids"][batch["attention_mask"] == 0] == data.pad_token_id).all()
    from s4accel.data import data_spec

    assert data_spec(cfg, data)["id2label"] == {0: "neg", 1: "pos"}


def test_text_classification_trains_on_bytes_and_a_class_label_column(tmp_path, hf_cache):
    import datasets

    labels = datasets.ClassLabel(names=["short", "long"])
    rows = {"text": ["to be " * (1 + i % 3) if i % 2 == 0 else "or not to be, that is the question " * 3
                     for i in range(64)], "label": [i % 2 for i in range(64)]}
    ds = datasets.Dataset.from_dict(rows, features=datasets.Features({"text": datasets.Value("string"),
                                                                      "label": labels}))
    datasets.DatasetDict({"train": ds.select(range(48)), "test": ds.select(range(48, 64))}).save_to_disk(
        str(tmp_path / "saved"))
    out = tmp_path / "run"
    result = train_in_process(TINY, [f"run.out_dir={out}", "data.source=dataset", f"data.path={tmp_path / 'saved'}",
                                     "data.label_field=label", "data.val_split=test", "data.seq_len=64",
                                     "data.batch_size=8", "train.max_steps=30", "train.eval_every=0",
                                     "scheduler.warmup_steps=0", "log.progress_bar=false", "log.log_with=[jsonl]",
                                     "sample.prompts=[]", "optim.lr=0.01"])
    assert result.eval_metrics["accuracy"] == 1.0  # the lengths tell the classes apart; padding is masked
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(result.final_dir).id2label == {0: "short", 1: "long"}


def test_bad_labels_are_one_line(tmp_path, hf_cache):
    import datasets

    datasets.Dataset.from_dict({"text": LINES[:10], "y": ["a"] * 10}).to_json(str(tmp_path / "one.jsonl"))
    with pytest.raises(DataError, match=r"only one class \('a'\)"):
        build(data_cfg("data.source=files", f"data.files=[{tmp_path / 'one.jsonl'}]", "data.label_field=y",
                       "task.target=classification"))
    with pytest.raises(DataError, match=r"data.label_field: no field 'lbl'"):
        build(data_cfg("data.source=files", f"data.files=[{tmp_path / 'one.jsonl'}]", "data.label_field=lbl",
                       "task.target=classification"))


@pytest.mark.parametrize("train_labels, val_labels, message", [
    ([0, 1], ["0", "1"], r"the labels mix numbers and strings \(training: numbers, validation: strings\)"),
    (["a", "b"], ["a", "b", "c"], "the validation set has label\(s\) the training set lacks: c"),
])
def test_validation_labels_of_another_kind_or_unseen_in_training_are_refused(tmp_path, hf_cache, train_labels,
                                                                           val_labels, message):
    """They used to become extra classes: id2label {0: '0', 1: '1', 2: '0', 3: '1'} and accuracy 0.0, exit 0."""
    import datasets

    for name, labels in (("train", train_labels), ("val", val_labels)):
        rows = {"text": LINES[:20], "y": [labels[i % len(labels)] for i in range(20)]}
        datasets.Dataset.from_dict(rows).to_json(str(tmp_path / f"{name}.jsonl"))
    with pytest.raises(DataError, match=message):
        build(data_cfg("data.source=files", f"data.files=[{tmp_path / 'train.jsonl'}]", "data.label_field=y",
                       f"data.val_files=[{tmp_path / 'val.jsonl'}]", "task.target=classification"))


def test_labels_mixing_numbers_and_strings_in_one_file_are_one_line(tmp_path, hf_cache):
    """It was a traceback from sorting the label names."""
    with open(tmp_path / "mixed.jsonl", "w") as f:
        for i, line in enumerate(LINES[:30]):
            f.write(json.dumps({"text": line, "y": i % 2 if i < 20 else "ab"[i % 2]}) + "\n")
    with pytest.raises(DataError, match=r"data.label_field: the labels mix numbers and strings "
                                        r"\(training: numbers and strings"):
        build(data_cfg("data.source=files", f"data.files=[{tmp_path / 'mixed.jsonl'}]", "data.label_field=y",
                       "task.target=classification"))


def test_labels_mixing_numbers_and_booleans_are_one_line_and_mixed_number_types_train(tmp_path, hf_cache):
    """`0`, `1` and `true` in one file: a `KeyError: 'true'` traceback (datasets keeps such a column as JSON text).
    Whole and fractional numbers mixed (`0` and `0.5`, kept the same way) are read as the numbers they are."""
    for name, values in (("bools", [0, 1, True]), ("numbers", [0, 1, 0.5])):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i, line in enumerate(LINES[:30]):
                f.write(json.dumps({"text": line, "y": values[i % 3]}) + "\n")
    with pytest.raises(DataError, match=r"data.label_field: the labels mix booleans and numbers "):
        build(data_cfg("data.source=files", f"data.files=[{tmp_path / 'bools.jsonl'}]", "data.label_field=y",
                       "task.target=classification"))
    data = build(data_cfg("data.source=files", f"data.files=[{tmp_path / 'numbers.jsonl'}]", "data.label_field=y",
                          "task.target=classification", "data.val_fraction=0.3"))
    assert data.class_names == ["0", "0.5", "1"] and data.num_labels == 3


# ---- a dataset repository on the Hub (the project's Hub-compatible server on 127.0.0.1) ----------------------------

HUB_BUILD = """
import json, sys
import numpy as np
from s4accel.config import load_recipe
from s4accel.data import build_data
cfg = load_recipe(sys.argv[1], ["data.source=dataset", "data.path=carol/plays", "data.val_split=test",
                                "data.seq_len=16", "sample.prompts=[]"]).data
data = build_data(cfg)
first = data.tokenizer.decode(np.asarray(data.train[0]["input_ids"]).tolist())
print(json.dumps([len(data.train), len(data.val), first]))
"""


@pytest.mark.slow
def test_a_dataset_repository_on_the_hub_loads_by_repo_id(tmp_path):
    import io

    import datasets
    from hub_server import HubServer, Repo

    def parquet(rows):
        buf = io.BytesIO()
        datasets.Dataset.from_dict({"text": rows}).to_parquet(buf)
        return buf.getvalue()

    files = {"data/train-00000-of-00001.parquet": parquet(LINES[:50]),
             "data/test-00000-of-00001.parquet": parquet(LINES[50:]), "README.md": b"# plays\n"}
    with HubServer() as hub:
        repo = Repo(private=False)
        repo.branches["main"] = repo.snapshots[repo.heads["main"]] = files
        hub.state.repos["datasets/carol/plays"] = repo
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0",
               "HF_DATASETS_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf_home"),
               "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}
        proc = subprocess.run([sys.executable, "-c", HUB_BUILD, str(TINY)], capture_output=True, text=True,
                              timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n_train, n_val, text = json.loads(proc.stdout.strip().splitlines()[-1])
    assert n_train > 0 and n_val > 0 and text.startswith(LINES[0][:15])


def test_blocks_are_stored_in_the_smallest_dtype_that_holds_the_vocabulary(tmp_path, hf_cache):
    from s4accel.data.tokenize import token_dtype

    (tmp_path / "t.txt").write_text(" ".join(LINES))
    data = build(data_cfg("data.source=files", f"data.files=[{tmp_path / 't.txt'}]"))
    assert data.train.features["input_ids"].feature.dtype == "uint16"  # stored: 2 bytes a token (read as int64)

    class Big:
        def __len__(self):
            return 70_000

        def get_vocab(self):
            return {}

    class Gapped(Big):  # few tokens, one with a large id
        def __len__(self):
            return 3

        def get_vocab(self):
            return {"a": 0, "b": 1, "c": 70_000}

    assert token_dtype(Big()) == np.uint32 == token_dtype(Gapped())
