"""Long Range Arena: each task's data read from small files in exactly the release's layout (ListOps and Retrieval
`.tsv` files, Pathfinder/Path-X folders with their metadata; IMDB and CIFAR-10 as `datasets` folders), with the
papers' lengths, vocabularies and splits; the ListOps generator, checked by an evaluator of its own."""

import numpy as np
from pathlib import Path

import pytest

from helpers import RECIPES
from lra_files import AAN, LISTOPS, pathfinder_image, write_aan, write_image_dataset, write_imdb, write_listops, \
    write_pathfinder
from s4accel.config import load_recipe
from s4accel.errors import DataError

LRA = RECIPES / "lra"


def lra_data(recipe: str, folder, *overrides):
    """The data an LRA recipe builds, reading `folder` instead of the release."""
    from s4accel.data import build_data

    return build_data(load_recipe(LRA / f"{recipe}.yaml", [f"data.path={folder}", *overrides]).data)


def test_listops_reads_symbols_without_brackets_ten_classes_and_the_release_splits(tmp_path, hf_cache):
    data = lra_data("listops", write_listops(tmp_path / "listops"))
    tok = data.tokenizer
    assert len(tok) == 18 and data.num_labels == 10 and data.class_names == [str(d) for d in range(10)]
    first = data.train[0]
    assert tok.convert_ids_to_tokens(first["input_ids"].tolist()) == ["[MAX", "2", "9", "]"]
    assert first["labels"] == 9
    assert [len(x) for x in data.train["input_ids"]] == [4, 8, 4, 9]  # symbols only: no '(' or ')'
    assert tok.unk_token_id not in np.concatenate(data.train["input_ids"])
    assert list(data.val["labels"]) == [v for _, v in LISTOPS]
    test = lra_data("listops", tmp_path / "listops", "data.val_split=test")  # the test file, written reversed
    assert list(test.val["labels"]) == [v for _, v in LISTOPS[::-1]]
    short = lra_data("listops", tmp_path / "listops", "data.seq_len=5")  # the recipe's length is the cut
    assert max(len(x) for x in short.train["input_ids"]) == 5


def test_retrieval_pairs_become_one_document_each_side_cut_to_its_half(tmp_path, hf_cache):
    from s4accel.data.lra_text import PAIR_SEPARATOR

    data = lra_data("retrieval", write_aan(tmp_path / "aan"), "data.seq_len=21")  # 10 bytes of each document
    assert data.num_labels == 2 and list(data.train["labels"]) == [1, 0, 1, 0]  # "1", "0", "1.0", "0.0"
    for (_, t1, t2), ids in zip(AAN, data.train["input_ids"]):
        text = bytes(int(i) - 3 for i in ids).decode()
        assert text == t1.encode()[:10].decode("utf-8", "ignore") + PAIR_SEPARATOR + t2.encode()[:10].decode(
            "utf-8", "ignore")
        assert len(ids) <= 21
    # "caf\u00e9" cut inside the two bytes of its last letter: the partial character is dropped, not mangled
    assert bytes(int(i) - 3 for i in data.train["input_ids"][1]).decode().endswith("An unrelat")
    whole = lra_data("retrieval", tmp_path / "aan")  # the recipe's 4,000 bytes each: every text whole
    assert bytes(int(i) - 3 for i in whole.val["input_ids"][0]).decode() == AAN[0][1] + PAIR_SEPARATOR + AAN[0][2]


def test_text_reads_imdb_from_a_datasets_folder_byte_by_byte(tmp_path, hf_cache):
    data = lra_data("text", write_imdb(tmp_path / "imdb"), f"data.cache_dir={tmp_path / 'cache'}")
    assert data.class_names == ["neg", "pos"] and len(data.tokenizer) == 259
    assert bytes(int(i) - 3 for i in data.train[1]["input_ids"]).decode().startswith("Review 1: great film")


def test_pathfinder_folders_become_pixel_sequences_split_80_10_10_by_seed(tmp_path):
    folder = write_pathfinder(tmp_path / "pf", n=40, size=32, empty=3)
    parts = {s: lra_data("pathfinder", folder, f"data.val_split={s}") for s in ("val", "test")}
    data = parts["val"]
    assert (data.seq_len, data.d_input, data.num_labels) == (1024, 1, 2)
    ids = {s: sorted(int(v) for v in d.val[:]["input_values"][:, 0, 0]) for s, d in parts.items()}
    train_ids = sorted(int(v) for v in data.train[:]["input_values"][:, 0, 0])  # each image's first pixel is its index
    assert len(ids["val"]) == len(ids["test"]) == 4 and len(train_ids) == 31  # 39 images: the empty one is skipped
    assert sorted(train_ids + ids["val"] + ids["test"]) == [i for i in range(40) if i != 3]
    row = data.train[0]
    np.testing.assert_array_equal(row["input_values"][:, 0].numpy(), pathfinder_image(train_ids[0], 32).reshape(-1))
    assert row["labels"] == train_ids[0] % 2  # field 3 of the metadata line
    again = lra_data("pathfinder", folder)
    assert sorted(int(v) for v in again.val[:]["input_values"][:, 0, 0]) == ids["val"]
    other = lra_data("pathfinder", folder, "data.split_seed=1")
    assert sorted(int(v) for v in other.val[:]["input_values"][:, 0, 0]) != ids["val"]
    x = (data.train[:]["input_values"] - data.input_mean[0]) / data.input_std[0]
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-2  # standardised by the model with these


def test_path_x_is_16384_steps(tmp_path):
    data = lra_data("pathx", write_pathfinder(tmp_path / "px", n=10, size=128, empty=None))
    assert data.seq_len == 128 * 128 and data.train[0]["input_values"].shape == (16384, 1)


def test_image_datasets_become_grayscale_pixels_row_by_row(tmp_path, hf_cache):
    import datasets
    import torch

    folder = write_image_dataset(tmp_path / "cifar", n_train=30, n_test=10)
    data = lra_data("image", folder)
    assert (len(data.train), len(data.val), data.seq_len, data.num_labels) == (27, 3, 1024, 10)
    assert data.class_names[:2] == ["airplane", "automobile"]
    source = datasets.load_from_disk(str(folder))
    grays = {np.asarray(im.convert("L")).tobytes() for im in source["train"]["img"]}
    assert data.train.features["input_values"].feature.feature.dtype == "uint8"  # stored small: float when collated
    assert all(x[:, 0].numpy().astype(np.uint8).tobytes() in grays for x in data.train[:]["input_values"])
    test = lra_data("image", folder, "data.val_split=test")
    assert len(test.val) == 10
    from s4accel.data import collate_arrays

    assert collate_arrays([data.train[0], data.train[1]])["input_values"].dtype == torch.float32


@pytest.mark.parametrize("recipe, folder, overrides, message", [
    ("listops", "missing", [], "data.path: no such folder"),
    ("listops", "empty", ["data.split=dev"], "data.split: LRA splits are train, val, test"),
    ("listops", "empty", ["data.tokenizer=byte"], "tokenizer listops"),
    ("text", "empty", ["data.tokenizer=listops"], "listops reads ListOps expressions"),
    ("listops", "empty", ["data.val_split=train"], "is the training split too"),
    ("listops", "empty", ["data.label_field=Target"], "gives its own `text` and `label`"),
    ("retrieval", "empty", ["data.val_files=[a.tsv]"], "data.val_files"),
    ("pathfinder", "empty", [], "no metadata/<n>.npy"),
])
def test_bad_lra_settings_are_one_line_errors(tmp_path, recipe, folder, overrides, message):
    from s4accel.config import RecipeError

    (tmp_path / "empty").mkdir()
    with pytest.raises((DataError, RecipeError), match=message) as e:
        lra_data(recipe, tmp_path / folder, *overrides)
    assert "\n" not in str(e.value)


def test_broken_release_files_are_one_line_errors(tmp_path, hf_cache):
    folder = write_listops(tmp_path / "lo")
    (folder / "basic_val.tsv").unlink()
    with pytest.raises(DataError, match="has no basic_val.tsv"):
        lra_data("listops", folder)
    write_listops(folder, [("( ( [MAX 2 ) ] )", 12)])
    with pytest.raises(DataError, match="label '12' is not one of 0, 1"):
        lra_data("listops", folder)
    (folder / "basic_train.tsv").write_text("src\ttgt\n( ( [MAX 2 ) ] )\t2\n")
    with pytest.raises(DataError, match="ListOps files start with Source<TAB>Target"):
        lra_data("listops", folder)
    pf = write_pathfinder(tmp_path / "pf", n=10)
    (pf / "metadata" / "0.npy").write_text("imgs/0 sample_0.png 0\n")
    with pytest.raises(DataError, match="line 1 is not '<folder> <file> <\\?> <label 0\\|1>"):
        lra_data("pathfinder", pf)
    (pf / "metadata" / "0.npy").write_text("imgs/0 missing.png 0 1\n" * 10)
    with pytest.raises(DataError, match="missing.png, named in the metadata, does not exist"):
        lra_data("pathfinder", pf)



def test_an_lra_recipe_reloads_as_written_scores_its_own_splits_and_names_its_data(tmp_path):
    import yaml

    from s4accel.config import validate_recipe
    from s4accel.errors import ModelError
    from s4accel.tools.inference import _scoring
    from s4accel.tools.model_card import dataset_of

    recipe = load_recipe(LRA / "retrieval.yaml")
    assert (recipe.data.label_field, recipe.data.val_split) == ("label", "val")  # filled in, and written back
    assert validate_recipe(yaml.safe_load(recipe.to_yaml())) == recipe
    with pytest.raises(ModelError, match="--set data.val_split=test"):  # --data cannot stand in for its splits
        _scoring(recipe, tmp_path / "new_aan_pairs.test.tsv")
    assert dataset_of(recipe.to_dict())[1] == "lra-retrieval"

# --------------------------------------------------------------------------------------------------------------------
# The ListOps generator


def stack_value(tokens: list[str]) -> tuple[int, int]:
    """An evaluator of its own, unlike the generator's recursion over a tree: one left-to-right pass over the tokens
    with a stack of open operators and the values each has collected. Returns (value, deepest operator nesting)."""
    import statistics

    stack, deepest = [("top", [])], 0
    for token in tokens:
        if token in ("(", ")"):
            continue
        if token.startswith("["):
            stack.append((token, []))
            deepest = max(deepest, len(stack) - 1)
        elif token == "]":
            op, args = stack.pop()
            assert len(args) >= 2, "an operator takes at least two arguments"
            value = {"[MAX": max, "[MIN": min, "[SM": lambda a: sum(a) % 10,
                     "[MED": lambda a: int(statistics.median(a))}[op](args)
            stack[-1][1].append(value)
        else:
            stack[-1][1].append(int(token))
    assert len(stack) == 1 and len(stack[0][1]) == 1
    return stack[0][1][0], deepest


def generate_with_the_cli(out, *args):
    from typer.testing import CliRunner

    from s4accel.cli import app

    result = CliRunner().invoke(app, ["listops", str(out), *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


def read_tsv(path) -> list[tuple[str, int]]:
    lines = path.read_bytes().decode().split("\r\n")
    assert lines[0] == "Source\tTarget" and lines[-1] == ""
    return [(source, int(target)) for source, target in (line.split("\t") for line in lines[1:-1])]


def test_generated_listops_evaluates_to_its_labels_within_bounds_by_seed_and_reads_back(tmp_path, hf_cache):
    bounds = ["--train", 60, "--val", 10, "--test", 10, "--min-length", 20, "--max-length", 80, "--max-depth", 4]
    out = generate_with_the_cli(tmp_path / "a", *bounds, "--seed", 7)
    assert "wrote 60 / 10 / 10 expressions" in out
    files = {split: read_tsv(tmp_path / "a" / f"basic_{split}.tsv") for split in ("train", "val", "test")}
    assert [len(rows) for rows in files.values()] == [60, 10, 10]
    rows = [row for split in files.values() for row in split]
    assert len({source for source, _ in rows}) == 80  # distinct expressions, across the splits too
    for source, target in rows:
        tokens = source.split()
        length = sum(t not in "()" for t in tokens)
        value, deepest = stack_value(tokens)
        assert value == target, source
        assert 20 <= length <= 80 and 1 <= deepest <= 3  # depth 4: operators nest at most 3 deep
        assert tokens.count("(") == tokens.count(")") == length - 1  # one pair per argument and per closing bracket
    assert {t for s, _ in rows for t in s.split() if t.startswith("[")} == {"[MAX", "[MIN", "[MED", "[SM"}
    assert len({target for _, target in rows}) >= 5
    generate_with_the_cli(tmp_path / "b", *bounds, "--seed", 7)
    generate_with_the_cli(tmp_path / "c", *bounds, "--seed", 8)
    for name in ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()
    data = lra_data("listops", tmp_path / "a", "data.split=test", "data.val_split=val")
    assert [len(ids) for ids in data.train["input_ids"]] == [sum(t not in "()" for t in s.split())
                                                             for s, _ in files["test"]]
    assert list(data.val["labels"]) == [target for _, target in files["val"]]


def test_bounds_the_generator_cannot_meet_are_one_line_errors(tmp_path):
    from typer.testing import CliRunner

    from s4accel.cli import app

    for args, message in ((["--min-length", 90, "--max-length", 80], "need 1 <= min <= max"),
                          (["--min-length", 100, "--max-depth", 2], "has 12 symbols")):
        result = CliRunner().invoke(app, ["listops", str(tmp_path), *map(str, args)])
        assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1


def test_listops_refuses_a_file_an_unwritable_place_or_an_existing_release_unless_told_to_overwrite(tmp_path):
    """A file as OUT_DIR and an unwritable place were tracebacks after generating; a release was replaced silently."""
    from typer.testing import CliRunner

    from s4accel.cli import app

    small = ["--train", "5", "--val", "2", "--test", "2", "--min-length", "5", "--max-length", "30"]
    (tmp_path / "a_file").write_text("mine")
    for out, message in ((tmp_path / "a_file", "a_file is a file, not a folder"),
                         (tmp_path / "a_file" / "sub", "a_file is a file, not a folder"),
                         (Path("/proc/no_such_release"), "cannot write there")):
        result = CliRunner().invoke(app, ["listops", str(out), *small])
        assert result.exit_code == 2 and message in result.output and result.output.count("\n") == 1, result.output
    assert (tmp_path / "a_file").read_text() == "mine"
    release = tmp_path / "release"
    assert CliRunner().invoke(app, ["listops", str(release), *small]).exit_code == 0
    before = (release / "basic_train.tsv").read_bytes()
    result = CliRunner().invoke(app, ["listops", str(release), *small, "--seed", "1"])
    assert result.exit_code == 2 and "already holds basic_train.tsv, basic_val.tsv, basic_test.tsv; pass --overwrite" \
        in result.output
    assert (release / "basic_train.tsv").read_bytes() == before
    assert CliRunner().invoke(app, ["listops", str(release), *small, "--seed", "1", "--overwrite"]).exit_code == 0
    assert (release / "basic_train.tsv").read_bytes() != before
    assert sorted(p.name for p in release.iterdir()) == ["basic_test.tsv", "basic_train.tsv", "basic_val.tsv"]


def test_a_classifier_trains_on_generated_listops_and_exports_its_tokenizer(tmp_path, hf_cache):
    from transformers import AutoTokenizer

    from helpers import train_in_process

    generate_with_the_cli(tmp_path / "data", "--train", 64, "--val", 16, "--test", 16, "--min-length", 10,
                          "--max-length", 40, "--max-depth", 4)
    result = train_in_process(LRA / "listops.yaml", [
        f"data.path={tmp_path / 'data'}", f"run.out_dir={tmp_path / 'run'}", "data.seq_len=40", "data.batch_size=16",
        "model.overrides={kernel: s4d, l_max: 40, d_model: 16, n_layer: 1, d_state: 8, bidirectional: true, "
        "norm: batch}", "train.max_steps=4", "train.eval_every=4", "checkpoint.every_steps=0", "log.log_every=2",
        "log.progress_bar=false"])
    assert {"loss", "accuracy", "f1_macro", "confusion_matrix"} <= set(result.eval_metrics)
    assert sum(map(sum, result.eval_metrics["confusion_matrix"]["matrix"])) == 16  # every validation example once
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    assert tok("( ( [MAX 2 ) 9 ) ] )", add_special_tokens=False).input_ids == [13, 5, 12, 17]
