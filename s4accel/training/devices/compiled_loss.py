"""The language model's loss compiled with its blocks (`train.compile: true`, regional compilation).

Accelerate's regional compilation compiles each repeated block, and each other leaf module (the embedding, the final
norm, the head's Linear) on its own. The loss is computed in the model's own forward, between those, so it stays
eager. There transformers' `ForCausalLMLoss` upcasts all the logits, `(tokens, vocabulary)`, to float32, and
`cross_entropy` saves their float32 log-probabilities for the backward: at 32K tokens and a vocabulary of 32K, two
4 GiB tensors written and read again each step, beside 2 GiB of bf16 logits. Compiled, inductor reads the logits
once for each row's log-sum-exp and once more in the backward for softmax minus one-hot, and keeps nothing for the
backward but the logits and one float per row (tests/test_compiled_loss.py checks what is kept).

transformers lets a model's loss function be replaced (`PreTrainedModel.loss_function` has a setter): `compile_loss`
sets the compiled one, compiled with the options Accelerate gives the blocks. Under the CUDA-graph modes the whole
model is compiled, its loss included (graphs.py); a model that is not a transformers model, or whose class name
transformers knows no loss for, is left as it is.
"""

import torch
from accelerate.utils import DynamoBackend
from transformers import PreTrainedModel
from transformers.loss.loss_utils import LOSS_MAPPING


def compile_loss(model: torch.nn.Module, accelerator) -> bool:
    """Under regional compilation, the transformers loss function of `model` (of its base model under PEFT) replaced
    by its compiled self. Returns whether it was."""
    plugin = accelerator.state.dynamo_plugin
    if plugin.backend == DynamoBackend.NO or not plugin.use_regional_compilation:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # a loss transformers knows by the model's class name, or one set on the model (asking an unknown model for its
    # loss_function would log a warning and hand it the causal-LM loss)
    known = hasattr(base, "_loss_function") or getattr(base, "loss_type", None) in LOSS_MAPPING
    if not isinstance(base, PreTrainedModel) or not known or is_compiled(base.loss_function):
        return False
    base.loss_function = torch.compile(base.loss_function, **plugin.to_kwargs())
    return True


def is_compiled(function) -> bool:
    """Whether `function` is what `torch.compile` returns for a function."""
    return hasattr(function, "_torchdynamo_orig_callable")
