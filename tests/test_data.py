"""Data: documents -> tokens -> packed blocks -> train/validation split, and the byte/char counts behind bpb/bpc."""

import json

import numpy as np
import pytest
import torch

from helpers import TINY
from s4accel.config import DataCfg, load_recipe
from s4accel.data.sources import clean_play, load_source, shakespeare_files
from s4accel.data.text import build_text_data
from s4accel.data.tokenize import build_tokenizer, token_byte_and_char_counts
from s4accel.data import build_dataloaders, collate_lm
from s4accel.errors import DataError, RecipeError


def test_shakespeare_ships_38_plays_and_cleans_markdown(hf_cache):
    assert len(shakespeare_files()) == 38
    assert clean_play("**KENT**  \nI thought\n_Enter LEAR_\n") == "KENT\nI thought\nEnter LEAR\n"
    docs = load_source(DataCfg(source="shakespeare").sources()[0])
    assert len(docs) == 38
    assert "**" not in docs[0]["text"]


def _files_cfg(tmp_path, **kw):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": f"record {i} " * 20}) for i in range(10)))
    return DataCfg(source="files", files=[str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], text_field="body",
                   **kw)


def test_user_files_are_tokenised_and_packed_with_a_tail_validation_split(tmp_path, hf_cache):
    cfg = _files_cfg(tmp_path, seq_len=32, val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    data = build_text_data(cfg)
    tok = data.tokenizer
    stream = tok("hello world " * 50, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n_blocks = len(data.train) + len(data.val)
    assert all(len(b) == 32 for b in data.train["input_ids"])
    assert data.train[0]["input_ids"].tolist() == stream[:32]  # in order, EOS between documents
    assert len(data.val) == -(-n_blocks // 5)  # ceil(20%)
    last = data.val[len(data.val) - 1]["input_ids"]
    assert tok.decode(last).count("record") >= 1  # the tail holds the last documents


def test_missing_file_and_empty_data_are_clear_errors(tmp_path, hf_cache):
    with pytest.raises(DataError, match="no such file: .*nope.txt"):
        build_text_data(DataCfg(source="files", files=[str(tmp_path / "nope.txt")]))
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(DataError, match="holds no text"):
        build_text_data(DataCfg(source="files", files=[str(tmp_path / "empty.txt")]))
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(DataError, match="too few"):
        build_text_data(DataCfg(source="files", files=[str(tmp_path / "short.txt")], seq_len=64))
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match="no field 'body'"):
        build_text_data(DataCfg(source="files", files=[str(tmp_path / "x.jsonl")], text_field="body"))


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_byte_and_char_counts_match_the_text(kind, tmp_path, hf_cache):
    text = "Thou art — more lovely and more temperate. Ünïcödé! " * 40
    (tmp_path / "t.txt").write_text(text)
    cfg = DataCfg(source="files", files=[str(tmp_path / "t.txt")], tokenizer=kind, vocab_size=300)
    tok = build_tokenizer(cfg, load_source(cfg.sources()[0]), tmp_path / "tok")
    n_bytes, n_chars = token_byte_and_char_counts(tok)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    assert n_bytes[ids].sum().item() == len(text.encode()) + 1  # the document's end: one byte, one character
    assert n_chars[ids].sum().item() == len(text) + 1


def test_bits_per_byte_count_bits_and_bytes_over_the_same_targets_on_one_character_documents(tmp_path, hf_cache):
    """A one-character document's only target (its first character reads nothing of its own) is its end: its bits
    were counted over no byte, and such documents read 224.7 bits per byte. Counted over a byte of its own, bits per
    byte is the loss in bits per token."""
    import json
    import math

    from helpers import TINY, train_in_process

    for name in ("train", "val"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": c}) + "\n" for c in "abcdefgh" * 40))
    result = train_in_process(TINY, [f"run.out_dir={tmp_path / 'run'}", "data.source=files",
                                     f"data.files=[{tmp_path / 'train.jsonl'}]",
                                     f"data.val_files=[{tmp_path / 'val.jsonl'}]", "data.seq_len=16",
                                     "train.max_steps=2", "train.eval_every=0", "sample.prompts=[]",
                                     "log.progress_bar=false", "log.log_with=[jsonl]"])
    metrics = result.eval_metrics
    assert metrics["bits_per_byte"] == pytest.approx(metrics["loss"] / math.log(2), rel=1e-6)
    assert metrics["bits_per_char"] == pytest.approx(metrics["bits_per_byte"])


def test_bpe_is_trained_on_the_train_part_and_saved(tmp_path, hf_cache):
    cfg = _files_cfg(tmp_path, tokenizer="bpe", vocab_size=300, seq_len=16)
    data = build_text_data(cfg, tokenizer_dir=tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").exists()
    assert data.tokenizer.eos_token_id == 1 and data.tokenizer.pad_token_id == 0
    again = build_tokenizer(cfg, None, tmp_path / "tok")  # reloaded, not retrained
    assert again.get_vocab() == data.tokenizer.get_vocab()


def test_loaders_full_train_batches_and_capped_eval(tmp_path, hf_cache):
    cfg = _files_cfg(tmp_path, seq_len=8, batch_size=4, val_fraction=0.3)
    data = build_text_data(cfg)
    train_dl, val_dl = build_dataloaders(cfg, data, seed=0, eval_max_batches=1)
    batch = next(iter(train_dl))
    assert batch["input_ids"].shape == (4, 8) and torch.equal(batch["labels"], batch["input_ids"])
    assert len(train_dl) == len(data.train) // 4
    assert sum(b["input_ids"].shape[0] for b in val_dl) == 4
    with pytest.raises(DataError, match="fewer than one batch"):
        build_dataloaders(cfg.model_copy(update={"batch_size": 10_000}), data, seed=0)


def test_isolated_packing_marks_each_document_start_and_masks_the_target_across_it():
    from s4accel.data import collate_isolated

    block = {"input_ids": np.array([5, 6, 1, 7, 8, 9, 1, 4], np.uint16)}  # 1: the end-of-document token
    batch = collate_isolated(1)([block])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    # the model shifts targets (t predicts t + 1): the first token after each end of document is predicted from
    # nothing of its own, so it is no target
    assert batch["labels"].tolist() == [[5, 6, 1, -100, 8, 9, 1, -100]]
    assert batch["input_ids"].tolist() == [[5, 6, 1, 7, 8, 9, 1, 4]]
    assert set(collate_lm([block])) == {"input_ids", "labels"}  # concat: one text, as before


def test_a_stateful_stream_continues_a_document_into_the_next_chunk_unless_the_chunk_before_ended_it():
    from s4accel.data import collate_isolated, stream_loader

    blocks = [[5, 6, 7, 1], [8, 9, 1, 5], [6, 7, 8, 9], [1, 5, 6, 7]]  # one row, four chunks, in text order
    loader = stream_loader([{"input_ids": np.array(b)} for b in blocks], 1, 1, 0, collate_fn=collate_isolated(1),
                           eos=1)
    assert [b["position_ids"].tolist()[0] for b in loader] == [
        [0, 1, 2, 3],  # a stream's first chunk starts from a zero state
        [0, 1, 2, 0],  # the chunk before ended its document
        [1, 2, 3, 4],  # continues the document begun in the chunk before: the carried state reaches it
        [1, 0, 1, 2]]  # continues it for one token (its end), then a new document


def test_isolated_packing_is_for_language_model_text():
    with pytest.raises(RecipeError, match="data.packing: isolated packs documents for a language model"):
        load_recipe(TINY, ["data.source=digits", "data.packing=isolated"])
