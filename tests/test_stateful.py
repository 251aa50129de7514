"""Stateful training over long streams (train.state.mode): layout, the carried state, exact resume, two processes."""


import pytest
import torch

from helpers import (FREE_PORT, REPO, TESTS_ON_PATH, TINY, accelerate_launch, callback_override, final_weights,
                     read_metrics, sets, train_in_process)
from s4accel.data.stateful_rows import StreamBatchSampler


def test_stream_layout_gives_each_process_fixed_contiguous_rows():
    # 24 blocks, 2 rows per process, 2 processes: 4 streams of 6 consecutive blocks each.
    ranks = [list(StreamBatchSampler(24, batch_size=2, num_processes=2, rank=r)) for r in range(2)]
    assert ranks[0][:3] == [[0, 6], [1, 7], [2, 8]]  # rows 0 and 1 continue their own text chunk after chunk
    assert ranks[1][:3] == [[12, 18], [13, 19], [14, 20]]
    assert len(ranks[0]) == 6


def stream(text, out, *extra):
    return [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=16", "data.batch_size=2",
            "data.val_fraction=0.1", "train.max_steps=30", "train.eval_every=12", "checkpoint.every_steps=5",
            "log.log_every=1", "log.progress_bar=false", "sample.prompts=[]", "train.grad_accum=2", *extra]


@pytest.mark.parametrize("mode", ["tbptt", "reset", "bptt"])
def test_carried_state_changes_training_and_is_what_the_model_sees(text, tmp_path, mode):
    """A run that carries state learns from longer context than independent chunks: its losses differ from mode none
    at the second chunk already (the first chunk of a stream starts from zero either way)."""
    base = train_in_process(TINY, stream(text, tmp_path / "none", "train.max_steps=3"))
    carried = train_in_process(TINY, stream(text, tmp_path / mode, "train.max_steps=3", f"train.state.mode={mode}"))
    a, b = ([r["train/loss"] for r in read_metrics(run) if "train/loss" in r] for run in (tmp_path / "none",
                                                                                          tmp_path / mode))
    assert base.steps == carried.steps == 3
    assert a[0] != b[0]  # step 1 = chunks 0 and 1: chunk 1 starts from chunk 0's state
    assert all(torch.isfinite(torch.tensor(b)))


@pytest.mark.slow
def test_stateful_resume_is_exact(text, tmp_path):
    reference = tmp_path / "ref"
    train_in_process(TINY, stream(text, reference, "train.state.mode=tbptt"))
    out = tmp_path / "cut"
    cut = train_in_process(TINY, stream(text, out, "train.state.mode=tbptt",
                                        callback_override("testing_callbacks:SignalAt", step=8)))
    assert cut.preempted and cut.steps == 9
    train_in_process(TINY, stream(text, out, "train.state.mode=tbptt"), resume="latest")
    a, b = final_weights(reference), final_weights(out)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_recipe_refuses_state_for_array_data():
    from s4accel.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="train.state.mode"):
        load_recipe(REPO / "recipes" / "digits.yaml", ["train.state.mode=tbptt"])


@pytest.mark.slow
def test_two_processes_equal_one_process_with_all_rows(text, tmp_path):
    """Each process continues its own rows (a sharded loader would interleave them): 2 processes x 2 rows train
    exactly like 1 process x 4 rows."""
    one = tmp_path / "one"
    train_in_process(TINY, stream(text, one, "train.state.mode=tbptt", "data.batch_size=4", "train.max_steps=10",
                                  "checkpoint.every_steps=0"))
    two = tmp_path / "two"
    overrides = stream(text, two, "train.state.mode=tbptt", "train.max_steps=10", "checkpoint.every_steps=0")
    proc = accelerate_launch(*FREE_PORT, "--config_file", REPO / "accelerate_configs" / "cpu_2proc.yaml", "-m",
                             "s4accel", "train", TINY, *sets(*overrides), env=TESTS_ON_PATH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = final_weights(one), final_weights(two)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("mode", ["tbptt", "bptt"])
def test_a_carried_state_stops_at_a_document_boundary(mode):
    """Packed documents (`data.packing: isolated`): a chunk whose first position starts a document reads it from a
    zero state, whatever the chunks before left; one continuing a document reads the carried state."""
    from types import SimpleNamespace

    from s4accel import S4Config, S4ForCausalLM
    from s4accel.config import StateCfg
    from s4accel.data import collate_isolated
    from s4accel.training.carried_state import CarriedState

    torch.manual_seed(0)
    model = S4ForCausalLM(S4Config(vocab_size=20, d_model=16, n_layer=2, d_state=8)).eval()
    carried = CarriedState(StateCfg(mode=mode), SimpleNamespace(num_processes=1, process_index=0))
    collate = collate_isolated(1)
    first = collate([{"input_ids": torch.tensor([5, 6, 7, 1, 8, 9])}])  # ends inside a document
    ends = collate([{"input_ids": torch.tensor([5, 6, 7, 8, 9, 1])}])  # ends with its document's end
    nxt = [5, 6, 7, 8, 9, 5]
    with torch.no_grad():
        carried.forward(model, {**first, "chunk_index": torch.tensor(0)})
        continued = carried.forward(model, {**collate([{"input_ids": torch.tensor(nxt)}], torch.tensor([True])),
                                            "chunk_index": torch.tensor(1)}).logits
        carried.reset()
        carried.forward(model, {**ends, "chunk_index": torch.tensor(0)})
        fresh = carried.forward(model, {**collate([{"input_ids": torch.tensor(nxt)}], torch.tensor([False])),
                                        "chunk_index": torch.tensor(1)}).logits
        alone = model(input_ids=torch.tensor([nxt])).logits
    assert torch.equal(fresh, alone)
    assert not torch.allclose(continued, alone, atol=1e-4)
