"""Activation checkpointing per block (S4 and MoE blocks): the same loss and gradients, far fewer saved tensors."""

import pytest
import torch

from s4accel import MoEConfig, MoEForCausalLM, S4Config, S4ForCausalLM
from s4accel.models import S4ForSequenceClassification


def saved_bytes_and_grads(model, **inputs):
    """Bytes autograd keeps for the backward pass during the forward pass (the activation memory), the loss and the
    gradients; the same seed each call, so dropout and router jitter draw the same numbers."""
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    model.zero_grad()
    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    loss.backward()
    return saved, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


IDS = torch.randint(3, 50, (4, 64))
MODELS = {
    "s4": lambda: S4ForCausalLM(S4Config(d_model=32, n_layer=4, d_state=8, vocab_size=50, dropout=0.1)),
    "s4_dplr": lambda: S4ForCausalLM(S4Config(d_model=32, n_layer=4, d_state=8, vocab_size=50, kernel="s4")),
    "s4_moe": lambda: S4ForCausalLM(S4Config(d_model=32, n_layer=4, d_state=8, vocab_size=50, ffn="moe",
                                             num_experts=4, dropout=0.1, router_jitter=0.1)),
    "moe": lambda: MoEForCausalLM(MoEConfig(d_model=32, n_layer=4, n_head=2, d_ffn=48, num_experts=4, vocab_size=50,
                                            dropout=0.1)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpointed_blocks_give_the_same_gradients_and_keep_far_less(name):
    torch.manual_seed(0)
    model = MODELS[name]().train()
    full, loss, grads = saved_bytes_and_grads(model, input_ids=IDS, labels=IDS)
    model.activation_checkpointing_enable()
    kept, loss_ac, grads_ac = saved_bytes_and_grads(model, input_ids=IDS, labels=IDS)
    assert loss_ac == loss and grads_ac.keys() == grads.keys()
    assert all(torch.equal(grads[k], grads_ac[k]) for k in grads)  # the recompute replays the RNG too
    assert kept < 0.35 * full, (kept, full)  # block inputs only, instead of every intermediate of 4 blocks


def test_classifier_on_real_valued_inputs_checkpoints_without_an_embedding():
    model = S4ForSequenceClassification(S4Config(d_model=16, n_layer=2, d_state=8, d_input=3, num_labels=4)).train()
    x, y = torch.randn(2, 32, 3), torch.tensor([1, 2])
    _, loss, grads = saved_bytes_and_grads(model, input_values=x, labels=y)
    model.activation_checkpointing_enable()
    _, loss_ac, grads_ac = saved_bytes_and_grads(model, input_values=x, labels=y)
    assert loss_ac == loss and all(torch.equal(grads[k], grads_ac[k]) for k in grads)
    assert model.main_input_name == "input_values"
