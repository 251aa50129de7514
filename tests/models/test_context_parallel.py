"""Context parallelism of the S4 models: a sequence split into contiguous chunks over gloo processes gives the logits,
loss and gradients of the whole sequence (tests/scripts/context_parallel_exactness.py runs every family in float64
and float32 on 2 and 4 processes); what a split model refuses; the chunk of a batch a process trains on."""

import json
from types import SimpleNamespace

import pytest
import torch

from helpers import REPO, run_python
from s4accel.models import S4Config
from s4accel.models.context_parallel import ContextParallel
from s4accel.models.modeling_s4 import S4ForCausalLM
from s4accel.models.moe import MoELayer
from s4accel.training.devices.context_parallel import split_batch
from s4accel.training.task import count_items


@pytest.mark.slow
@pytest.mark.parametrize("procs", [2, 4])
def test_every_family_split_over_processes_equals_the_whole_sequence(tmp_path, procs):
    """S4D and DPLR S4, with MLP and MoE blocks, causal language models (with packed documents crossing and starting
    on chunk borders, a batch of one row, activation checkpointing, the chunked convolution) and bidirectional and
    causal classifiers (mean and last-step pooling, padding): 1e-12 in float64, 1e-5 in float32 (of the gradients'
    scale where it is above 1).
    The language model's loss is float32 whatever the model's dtype (transformers' loss function upcasts the logits
    to float32): 1e-6 relative. Dropout masks are those one process draws over the whole sequence."""
    out = tmp_path / "report.json"
    proc = run_python(REPO / "tests" / "scripts" / "context_parallel_exactness.py", "--procs", procs, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report) == 24  # 11 families and the dropout masks, in two dtypes
    for key, r in report.items():
        if key.startswith("dropout"):
            assert r["masks"] == 0, key
            assert 0.25 < r["dropped"] < 0.35, key
            continue
        tol = 1e-12 if key.endswith("float64") else 1e-5
        assert r["logits"] < tol, (key, r)
        assert r["grads"] < tol * max(1.0, r["grad_scale"]), (key, r)
        assert r["loss"] < (1e-6 if "_lm" in key else tol), (key, r)


def test_a_split_model_refuses_a_cache():
    model = S4ForCausalLM(S4Config(d_model=8, n_layer=1, d_state=4, vocab_size=11))
    model.set_context_parallel(ContextParallel(None))
    with pytest.raises(ValueError, match="has no cache"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=True)
    model.set_context_parallel(None)  # whole sequences again: generation works
    assert model.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2, do_sample=False).shape == (1, 4)


@pytest.mark.parametrize("setting", [{"capacity_factor": 1.0}, {"router_jitter": 0.1}])
def test_a_split_moe_block_refuses_what_depends_on_the_whole_batch_order(setting):
    config = SimpleNamespace(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, router_jitter=0.0,
                             capacity_factor=None, d_ffn=8, num_shared_experts=0, moe_dispatch="auto")
    layer = MoELayer(SimpleNamespace(**{**vars(config), **setting}), 8).train()
    two = SimpleNamespace(size=2)  # a group of two processes, as far as the check looks
    with pytest.raises(ValueError, match="capacity_factor or router_jitter"):
        layer(torch.randn(1, 4, 8), parallel=two)


def test_a_process_trains_on_its_chunk_with_targets_shifted_across_the_whole_sequence():
    ids = torch.arange(16).reshape(2, 8)
    labels = ids.clone()
    labels[0, 4] = -100  # an ignored target right after the border of a 2-way split
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    halves = []
    for rank in (0, 1):
        parallel = ContextParallel(None)
        parallel.rank, parallel.size = rank, 2  # this process's place in a group of two
        halves.append(split_batch(batch, parallel))
    first, second = halves
    assert first["input_ids"].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert second["attention_mask"].shape == (2, 4)
    # the last step of the first chunk predicts the first of the second; the sequence's last step predicts nothing
    assert first["shift_labels"].tolist() == [[1, 2, 3, -100], [9, 10, 11, 12]]
    assert second["shift_labels"].tolist() == [[5, 6, 7, -100], [13, 14, 15, -100]]
    # the chunks' targets add up to the whole sequence's
    assert count_items(first) + count_items(second) == count_items(batch) == 13


def test_a_classification_batch_keeps_its_labels_whole():
    batch = {"input_values": torch.randn(3, 8, 1), "attention_mask": torch.ones(3, 8),
             "labels": torch.tensor([0, 1, 2])}
    parallel = ContextParallel(None)
    parallel.rank, parallel.size = 1, 2
    part = split_batch(batch, parallel)
    assert torch.equal(part["input_values"], batch["input_values"][:, 4:])
    assert torch.equal(part["labels"], batch["labels"]) and "shift_labels" not in part
