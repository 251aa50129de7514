"""`train.compile: true` compiles a language model's loss with its blocks (training/devices/compiled_loss.py): the
same loss and gradients as transformers' eager `ForCausalLMLoss`, without its float32 copies of the logits."""

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from helpers import recipe_accelerator
from s4accel.models import MoEConfig, MoEForCausalLM, S4Config, S4ForCausalLM, S4ForSequenceClassification
from s4accel.training.devices.compiled_loss import compile_loss, is_compiled

V = 1024


def saved_bytes(loss_function, logits, labels):
    """The loss, and the bytes of every tensor its autograd graph keeps for the backward."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_function(logits=logits, labels=labels, vocab_size=V)
    return loss, sum(sizes)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_regional_compilation_compiles_the_loss_which_keeps_no_float32_copy_of_the_logits(dtype, device):
    acc = recipe_accelerator(["train.compile=true"])
    model = S4ForCausalLM(S4Config(vocab_size=V, d_model=16, n_layer=1, d_state=8))
    assert compile_loss(model, acc) and is_compiled(model.loss_function)
    assert not compile_loss(model, acc)  # once

    torch.manual_seed(0)
    logits = torch.randn(2, 64, V, dtype=dtype, device=device)
    labels = torch.randint(0, V, (2, 64), device=device)
    labels[0, :5] = -100  # ignored positions count neither in the loss nor in its mean
    results = {}
    for name, loss_function in (("eager", ForCausalLMLoss), ("compiled", model.loss_function)):
        leaf = logits.clone().requires_grad_()
        loss, kept = saved_bytes(loss_function, leaf, labels)
        loss.backward()
        results[name] = loss.detach(), leaf.grad, kept
    (loss_e, grad_e, kept_e), (loss_c, grad_c, kept_c) = results["eager"], results["compiled"]
    assert torch.allclose(loss_c, loss_e, rtol=1e-6) and torch.allclose(grad_c.float(), grad_e.float(), atol=1e-6)
    float32_logits = logits.numel() * 4
    assert kept_e >= 2 * float32_logits  # transformers' eager loss: two float32 (tokens, vocabulary) tensors
    assert kept_c <= logits.numel() * logits.element_size() + 64 * 128  # the logits as they are, a float per row

    # what the loop hands it too: a token count under accumulation, targets already shifted (context parallelism)
    shifted = torch.roll(labels, -1, 1)
    for kwargs in ({"num_items_in_batch": torch.tensor(100, device=device)}, {"shift_labels": shifted}):
        want = ForCausalLMLoss(logits=logits, labels=labels, vocab_size=V, **kwargs)
        got = model.loss_function(logits=logits, labels=labels, vocab_size=V, **kwargs)
        assert torch.allclose(got, want, rtol=1e-6), kwargs


@pytest.mark.parametrize("overrides", [[], ["train.compile=true", "train.compile_mode=reduce-overhead"]])
def test_the_loss_stays_as_it_is_without_regional_compilation(overrides):
    """Eager runs keep transformers' own loss; the CUDA-graph modes compile the whole model, its loss with it."""
    acc = recipe_accelerator(overrides)
    model = S4ForCausalLM(S4Config(vocab_size=V, d_model=16, n_layer=1, d_state=8))
    assert not compile_loss(model, acc) and model.loss_function is ForCausalLMLoss


def test_the_mixture_of_experts_model_and_a_peft_base_model_get_it_other_models_are_left_alone():
    peft = pytest.importorskip("peft")
    acc = recipe_accelerator(["train.compile=true"])
    moe = MoEForCausalLM(MoEConfig(vocab_size=V, d_model=16, n_layer=1, n_head=2, d_ffn=32, num_experts=2,
                                   num_experts_per_tok=1))
    assert compile_loss(moe, acc) and is_compiled(moe.loss_function)
    lm = S4ForCausalLM(S4Config(vocab_size=V, d_model=16, n_layer=1, d_state=8))
    wrapped = peft.get_peft_model(lm, peft.LoraConfig(r=2, target_modules=["output_linear"]))
    assert compile_loss(wrapped, acc) and is_compiled(wrapped.get_base_model().loss_function)
    assert not compile_loss(torch.nn.Linear(2, 2), acc)

    class Unnamed(S4ForSequenceClassification):  # a class name transformers knows no loss for
        pass
    assert not compile_loss(Unnamed(S4Config(d_model=16, n_layer=1, d_state=8, num_labels=3)), acc)
