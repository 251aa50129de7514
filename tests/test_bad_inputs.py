"""Inputs a user can get wrong: each is refused with one line naming what is wrong, before any compute, never a
traceback and never a silent guess."""

import json
import time

import numpy as np
import pytest

from helpers import TINY
from s4accel.config import load_recipe
from s4accel.errors import DataError, RecipeError


def recipe_file(tmp_path, text: str, name="r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- recipes --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("run.seed=-1", "run.seed: Input should be greater than or equal to 0"),
    ("run.seed=4294967296", "run.seed: Input should be less than 4294967296"),
    ("optim.betas=[2, -1]", "optim.betas.0: Input should be less than 1"),
    ("optim.lr=.inf", "optim.lr: Input should be a finite number"),
    ("optim.weight_decay=.inf", "optim.weight_decay: Input should be a finite number"),
    ("optim.lr=.nan", "optim.lr: Input should be a finite number"),
    ("train.max_steps=true", "train.max_steps: Input should be a valid integer, not a boolean"),
    ("optim.lr=true", "optim.lr: Input should be a valid number, not a boolean"),
    ("run.out_dir=''", "run.out_dir: must not be empty"),
    ("run.name=../../x", "run.name: must be a plain name"),
    ("run.name=a/b", "run.name: must be a plain name"),
])
def test_bad_recipe_values_are_one_line_errors(override, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, [override])
    lines = str(info.value).splitlines()  # one line per problem, each naming the file and the key
    assert message in lines[0] and all(line.startswith(f"{TINY}: ") for line in lines), lines


def test_an_empty_recipe_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="the recipe is empty"):
        load_recipe(recipe_file(tmp_path, "# nothing here\n"))


def test_duplicate_yaml_keys_are_refused_instead_of_replacing_a_section(tmp_path):
    path = recipe_file(tmp_path, "train: {max_steps: 5}\nmodel: {name: s4-tiny}\ntrain: {eval_every: 2}\n")
    with pytest.raises(RecipeError, match=r"invalid YAML at line 3, column 1: duplicate key 'train'"):
        load_recipe(path)
    nested = recipe_file(tmp_path, "optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", "n.yaml")
    with pytest.raises(RecipeError, match=r"invalid YAML at line 3, column 3: duplicate key 'lr'"):
        load_recipe(nested)


def test_yaml_alias_bombs_are_refused_at_once(tmp_path):
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        levels.append(f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * 10) + "]")
    bomb = "log:\n  tracker_kwargs:\n    jsonl:\n" + "".join(f"      {line}\n" for line in levels)
    start = time.perf_counter()
    with pytest.raises(RecipeError, match="expands to more than 100,000 values"):
        load_recipe(recipe_file(tmp_path, bomb))
    assert time.perf_counter() - start < 2
    # A recipe that uses an alias or two, as people do to share a value, still loads.
    ok = recipe_file(tmp_path, "sample: {prompts: &p [ROMEO.]}\ntask: {args: {}}\n", "ok.yaml")
    assert load_recipe(ok).sample.prompts == ["ROMEO."]


def flow_bomb(levels=6) -> str:
    """One YAML flow value of 10**levels leaves written in a few hundred bytes (anchors inside a flow sequence)."""
    parts = ["&l0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        parts.append(f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    return "[" + ", ".join(parts) + "]"


@pytest.mark.parametrize("key", ["data.data_files", "log.tracker_kwargs.jsonl.extra", "task.args.x"])
def test_yaml_alias_bombs_through_set_are_refused_at_once(key):
    start = time.perf_counter()
    with pytest.raises(RecipeError, match="--set: the recipe with these values expands to more than 100,000") as info:
        load_recipe(TINY, [f"{key}={flow_bomb()}"])
    assert time.perf_counter() - start < 2 and len(str(info.value)) < 300


def test_an_error_line_quotes_only_the_start_of_a_long_value():
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, ["optim.lr=" + "9" * 50_000 + "x"])
    line = str(info.value)
    assert line.startswith(f"{TINY}: optim.lr: ") and "(50,003 characters)" in line and len(line) < 300
    with pytest.raises(RecipeError, match=r"^--set 'optim.lr.x=1': optim.lr is not a section$"):
        load_recipe(TINY, ["optim.lr.x=1"])


def test_tracker_kwargs_for_an_unused_tracker_or_an_unknown_argument_are_refused():
    with pytest.raises(RecipeError, match=r"log.tracker_kwargs: 'tensorbord' is not a tracker of log.log_with "
                                          r"\(tensorboard, jsonl\) \(did you mean 'tensorboard'\?\)"):
        load_recipe(TINY, ["log.tracker_kwargs={tensorbord: {flush_secs: 5}}"])
    from s4accel.training.observe.tracking import check_tracker_kwargs

    recipe = load_recipe(TINY, ["log.tracker_kwargs={tensorboard: {flush_sec: 5}}"])
    with pytest.raises(RecipeError, match=r"log.tracker_kwargs.tensorboard: unknown argument 'flush_sec' "
                                          r"\(did you mean 'flush_secs'\?\)"):
        check_tracker_kwargs(recipe.log)
    check_tracker_kwargs(load_recipe(TINY, ["log.tracker_kwargs={tensorboard: {flush_secs: 5}}"]).log)


# ---- text data ------------------------------------------------------------------------------------------------------


def text_cfg(*files, **kw):
    return load_recipe(TINY, ["data.source=files", f"data.files={json.dumps([str(f) for f in files])}",
                              *(f"data.{k}={v}" for k, v in kw.items())]).data


def build_text(cfg, hf_cache):
    from s4accel.data import build_text_data

    return build_text_data(cfg)


def test_a_jsonl_file_with_the_default_text_field_loads(tmp_path, hf_cache):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": "To be or not to be " * 20, "id": i}) + "\n" for i in range(20)))
    data = build_text(text_cfg(path, seq_len=16), hf_cache)
    assert len(data.train) > 0


@pytest.mark.parametrize("content, message", [
    (b"\x00\x01\xff\xfe binary \x89PNG" * 50, r"data.files: .*bad.txt is not UTF-8 text \(byte 0x"),
    ("Caf\xe9 au lait, d\xe9j\xe0 vu. " * 100, r"data.files: .*bad.txt is not UTF-8 text \(byte 0xe9"),
])
def test_a_txt_file_that_is_not_utf8_is_one_line(tmp_path, hf_cache, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("latin-1"))
    with pytest.raises(DataError, match=message):
        build_text(text_cfg(path), hf_cache)


@pytest.mark.parametrize("lines, message", [
    (['{"text": "fine"}', '{"text": broken'], r"bad.jsonl: not valid JSON Lines"),
    (['{"text": "fine"}', '[1, 2, 3]'], r"bad.jsonl: not valid JSON Lines"),
    (['"just a string"'], r"bad.jsonl: not valid JSON Lines"),
    (['{"text": 3}', '{"text": 4}'], r"data.text_field: field 'text' of .*bad.jsonl holds int64, not text"),
])
def test_malformed_jsonl_is_one_line(tmp_path, hf_cache, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        build_text(text_cfg(path), hf_cache)


def parquet(path, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


DOC = "To be or not to be, that is the question. " * 10


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "e.jsonl").write_text("") and None, r"data.files: .*e.jsonl is empty"),
    (lambda d: (d / "h.csv").write_text("text,label\n") and None,
     r"data.files: .*h.csv holds no rows \(a header line alone\)"),
    (lambda d: (d / "g.parquet").write_bytes(bytes(range(256)) * 8) and None,
     r"data.files: .*g.parquet: cannot be read as parquet \(Parquet magic bytes not found"),
])
def test_an_empty_or_garbage_file_is_one_line_naming_it(tmp_path, hf_cache, make, message):
    make(tmp_path)
    with pytest.raises(DataError, match=message):
        build_text(text_cfg(next(tmp_path.iterdir())), hf_cache)


@pytest.mark.parametrize("second, message", [
    ({"body": [DOC] * 3}, r"b.parquet has the columns body, but .*a.parquet has text: the files of one source need "
                          r"the same columns"),
    ({"text": [1, 2, 3]}, r"column 'text' holds int64 in .*b.parquet but string in .*a.parquet"),  # was cast to text
])
def test_parquet_files_of_one_glob_that_differ_in_columns_or_types_are_refused(tmp_path, hf_cache, second, message):
    parquet(tmp_path / "a.parquet", text=[DOC] * 3)
    parquet(tmp_path / "b.parquet", **second)
    with pytest.raises(DataError, match=message):
        build_text(text_cfg(tmp_path / "*.parquet"), hf_cache)


def test_a_glob_matching_only_a_fifo_is_one_line_and_never_opens_it(tmp_path, hf_cache):
    import os

    os.mkfifo(tmp_path / "x.txt")  # opening it for reading would block until a writer comes
    with pytest.raises(DataError, match=r"\*.txt matches no regular file \(only a FIFO .*x.txt\)"):
        build_text(text_cfg(tmp_path / "*.txt"), hf_cache)
    with pytest.raises(DataError, match=r"x.txt is a FIFO, not a regular file"):
        build_text(text_cfg(tmp_path / "x.txt"), hf_cache)


def test_a_full_datasets_cache_is_one_line_naming_it(tmp_path, hf_cache, monkeypatch):
    import errno

    from datasets.arrow_writer import ArrowWriter

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ArrowWriter, "write_table", full)  # the writer the builders and `map` write the cache with
    monkeypatch.setattr(ArrowWriter, "write_batch", full)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": DOC}) + "\n" for _ in range(20)))
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=rf"data.cache_dir {cache}: no space left on device while writing the prepared "
                                        rf"data: free space, or point data.cache_dir at a larger disk"):
        build_text(text_cfg(path, cache_dir=cache), hf_cache)


# ---- array data -----------------------------------------------------------------------------------------------------


def arrays_cfg(*files, **kw):
    return load_recipe(TINY, ["data.source=arrays", f"data.files={json.dumps([str(f) for f in files])}",
                              "sample.prompts=[]", *(f"data.{k}={v}" for k, v in kw.items())]).data


def npz(tmp_path, name="d.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


rng = np.random.default_rng(0)
X = rng.normal(size=(40, 12)).astype(np.float32)
Y = np.arange(40) % 3


@pytest.mark.parametrize("arrays, message", [
    ({"x": X, "y": Y[:30]}, r"x has 40 sequences but y has 30 labels"),
    ({"x": X[0], "y": Y}, r"x must be \(n, L\) or \(n, L, d\); got shape \(12,\)"),
    ({"x": np.float32(1.0), "y": Y}, r"x must be \(n, L\) or \(n, L, d\); got shape \(\)"),
    ({"x": X.reshape(40, 3, 2, 2), "y": Y}, r"x must be \(n, L\) or \(n, L, d\); got shape \(40, 3, 2, 2\)"),
    ({"x": X, "y": np.stack([Y, Y], 1)}, r"y must be one label per sequence \(n,\); got shape \(40, 2\)"),
    ({"x": np.array([["a", "b"]] * 40), "y": Y}, r"x must hold numbers; got <U1"),
    ({"x": X.astype(np.complex64), "y": Y}, r"x must hold real numbers; got complex64"),
    ({"x": X, "y": Y, "x_test": X}, r"x_test needs y_test"),
    ({"x": np.where(X > 2, np.nan, X), "y": Y}, r"x holds \d+ NaN or infinite value"),
    ({"x": np.where(X > 2, np.inf, X), "y": Y}, r"x holds \d+ NaN or infinite value"),
    ({"x": X, "y": np.where(Y == 1, np.nan, Y)}, r"y holds \d+ NaN or infinite label"),
    ({"x": X, "y": np.zeros(40)}, r"only one class \('0'\)"),
])
def test_bad_npz_arrays_are_one_line(tmp_path, arrays, message):
    from s4accel.data.arrays import build_array_data

    with pytest.raises(DataError, match=message):
        build_array_data(arrays_cfg(npz(tmp_path, **arrays)))


def test_an_object_npz_is_refused_without_unpickling(tmp_path):
    from s4accel.data.arrays import build_array_data

    path = tmp_path / "o.npz"
    np.savez(path, x=np.array([[1.0, 2.0], [3.0]], dtype=object), y=np.array([0, 1]))
    with pytest.raises(DataError, match=r"o.npz: array 'x' holds Python objects; s4accel never unpickles data files"):
        build_array_data(arrays_cfg(path))


@pytest.mark.parametrize("text, message", [
    ("0,1,2,3\n1,4,5\n0,6,7,8\n", r"bad.csv: line 2 has 3 columns, line 1 has 4"),
    ("label,a,b,c\n0,1,2,3\n1,4,5,6\n", r"bad.csv: line 1 is not numbers \('label,a,b,c'\); a header row"),
    ("cat,1,2,3\ndog,4,5,6\n", r"bad.csv: line 1 is not numbers \('cat,1,2,3'\)"),
    ("0\n1\n0\n", r"bad.csv: needs a label and at least one value per line; line 1 has 1 column"),
])
def test_bad_csv_files_are_one_line(tmp_path, text, message):
    from s4accel.data.arrays import build_array_data

    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        build_array_data(arrays_cfg(path))


def test_valid_arrays_still_load(tmp_path):
    from s4accel.data.arrays import build_array_data

    data = build_array_data(arrays_cfg(npz(tmp_path, x=X, y=Y)))
    assert (data.num_labels, data.d_input, data.seq_len) == (3, 1, 12)
    assert bool(data.train[:]["input_values"].isfinite().all())


def test_grad_accum_beyond_one_epoch_of_data_is_warned(tmp_path, text, hf_cache):
    from helpers import train_in_process

    overrides = [f"run.out_dir={tmp_path / 'r'}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32",
                 "data.batch_size=4", "data.val_fraction=0.1", "train.grad_accum=30", "train.max_steps=1",
                 "scheduler.warmup_steps=0",
                 "train.eval_every=0", "log.progress_bar=false", "sample.prompts=[]", "log.log_with=[jsonl]"]
    with pytest.warns(UserWarning, match=r"train.grad_accum=30 micro-batches are more than the \d+ batches of an "
                                         r"epoch"):
        train_in_process(TINY, overrides)


def test_a_model_too_large_to_allocate_is_one_line_and_writes_nothing(tmp_path, text, hf_cache):
    from helpers import train_in_process

    overrides = [f"run.out_dir={tmp_path / 'r'}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32",
                 "model.overrides={d_model: 100000000}", "sample.prompts=[]"]
    with pytest.raises(RecipeError, match=r"model.overrides: the model would hold [\d,]+ parameters .* more than the "
                                          r"[\d.,]+ GB this machine has available"):
        train_in_process(TINY, overrides)
    assert not (tmp_path / "r").exists()


def distributed(kind, processes=8, **plugin):
    """What the size check reads of an Accelerator: its processes, distribution and FSDP or DeepSpeed plugin."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    state = SimpleNamespace(fsdp_plugin=SimpleNamespace(**plugin), deepspeed_plugin=SimpleNamespace(**plugin))
    return SimpleNamespace(num_processes=processes, distributed_type=DistributedType[kind], state=state)


def test_the_size_check_counts_each_process_share_of_what_fsdp_and_zero_shard(monkeypatch, hf_cache):
    """A model whose weights, gradients and AdamW moments take twice a device's memory is refused alone and under
    DDP; FSDP and ZeRO-2/3 over 8 processes let it through (each holds its share, after building the whole weights
    first); ZeRO-1, which shards only the moments, still refuses it, saying whose share it counted."""
    from s4accel.data import data_spec
    from s4accel.training.devices import fits
    from s4accel.training.tasks_builtin import build_model

    recipe = load_recipe(TINY, ["model.overrides={d_model: 1024, n_layer: 2}", "data.seq_len=8", "data.batch_size=1"])
    spec = data_spec(recipe.data, None)
    build = lambda r, s: build_model(r, None, device="meta", spec=s)  # noqa: E731
    params = sum(fits.counted(build(recipe, spec)))
    monkeypatch.setattr(fits, "available_bytes", lambda device: 8 * params)  # half of the 16 bytes a parameter
    for accelerator in [distributed("NO", 1), distributed("MULTI_GPU"), distributed("DEEPSPEED", zero_stage=1)]:
        with pytest.raises(RecipeError, match="model.overrides: the model would hold"):
            fits.check_fits(recipe, spec, "cpu", build, fits.shards(accelerator))
    with pytest.raises(RecipeError, match=r"optimizer state \(each process its share under DeepSpeed ZeRO-1 over 8 "):
        fits.check_fits(recipe, spec, "cpu", build, fits.shards(distributed("DEEPSPEED", zero_stage=1)))
    for accelerator in [distributed("FSDP", fsdp_version=2), distributed("DEEPSPEED", zero_stage=2),
                        distributed("DEEPSPEED", zero_stage=3, zero3_init_flag=False)]:
        fits.check_fits(recipe, spec, "cpu", build, fits.shards(accelerator))
    from torch.distributed.fsdp import ShardingStrategy

    no_shard = distributed("FSDP", fsdp_version=1, sharding_strategy=ShardingStrategy.NO_SHARD)  # FSDP1's DDP
    with pytest.raises(RecipeError, match="model.overrides: the model would hold"):
        fits.check_fits(recipe, spec, "cpu", build, fits.shards(no_shard))


def test_the_size_check_counts_the_state_of_the_recipes_optimizer(monkeypatch, hf_cache):
    """Memory for 10 bytes a parameter: AdamW's weights, gradients and two moments (16 bytes) and SGD's with momentum
    (12) are refused; plain SGD (8) and Adafactor (factored moments, counted as none) are let through."""
    from s4accel.data import data_spec
    from s4accel.training.devices import fits
    from s4accel.training.tasks_builtin import build_model

    base = ["model.overrides={d_model: 1024, n_layer: 2}", "data.seq_len=8", "data.batch_size=1"]
    recipe = load_recipe(TINY, base)
    spec = data_spec(recipe.data, None)
    build = lambda r, s: build_model(r, None, device="meta", spec=s)  # noqa: E731
    monkeypatch.setattr(fits, "available_bytes", lambda device: 10 * sum(fits.counted(build(recipe, spec))))
    for refused in ([], ["optim.name=sgd", "optim.kwargs={momentum: 0.9}"], ["optim.name=adam",
                                                                           "optim.kwargs={amsgrad: true}"]):
        with pytest.raises(RecipeError, match="with their gradients and optimizer state"):
            fits.check_fits(load_recipe(TINY, [*base, *refused]), spec, "cpu", build)
    for fits_now in (["optim.name=sgd"], ["optim.name=adafactor"]):
        fits.check_fits(load_recipe(TINY, [*base, *fits_now]), spec, "cpu", build)


def test_mixture_weights_that_sum_to_infinity_are_a_recipe_error():
    with pytest.raises(RecipeError, match="data.mixture: the weights sum to infinity"):
        load_recipe(TINY, ["data.mixture=[{source: files, files: [a.txt], weight: 1e308}, "
                           "{source: files, files: [b.txt], weight: 1e308}]"])


def test_a_path_starting_with_a_tilde_is_the_home_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus.txt").write_text("to be or not to be")
    recipe = load_recipe(TINY, ["data.source=files", "data.files=[~/corpus.txt]", "data.val_files=[~/corpus.txt]"])
    assert recipe.data.files == [str(tmp_path / "corpus.txt")] == recipe.data.val_files


def test_an_s4_path_forced_where_it_cannot_run_is_one_line_before_the_run_directory(tmp_path, hf_cache,
                                                                                  monkeypatch):
    """`conv_path: fused` on a CPU (where Triton's kernels do not run): a recipe error naming the key, raised while
    the model is built, before anything is written (no run directory)."""
    from helpers import train_in_process
    from s4accel.models import s4d_fused

    monkeypatch.setattr(s4d_fused, "INTERPRETED", False)  # the tests run the kernels in Triton's interpreter
    with pytest.raises(RecipeError, match=r"^model\.overrides\.conv_path='fused' cannot run here: it (runs on CUDA "
                                          r"devices|needs Triton); 'chunked' computes the same"):
        train_in_process(TINY, [f"run.out_dir={tmp_path}", "model.overrides={conv_path: fused, d_state: 32}",
                                "train.max_steps=2"])
    assert not any(tmp_path.iterdir())
