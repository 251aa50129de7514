"""Configuration of the mixture-of-experts transformer.

This file is copied into Hub repositories next to `modeling_moe.py` for `trust_remote_code` loading, so it imports
only the standard library, `transformers` and `huggingface_hub` (a dependency of transformers).
"""

import difflib
from dataclasses import fields

from huggingface_hub.dataclasses import strict
from transformers import GenerationConfig, PreTrainedConfig

MOE_DISPATCHES = ("auto", "grouped_mm", "fused", "loop")

# Keywords transformers itself hands a config (loading, legacy files, other model families' token ids) that are not
# dataclass fields: never taken for a misspelling of ours.
TRANSFORMERS_KEYWORDS = frozenset({
    "torch_dtype", "num_labels", "name_or_path", "output_attentions", "attn_implementation", "experts_implementation",
    "per_layer_config", "rope_scaling", "rope_theta", "rope_parameters", "auto_map", "model_type",
    "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id", "decoder_start_token_id",
})


def refuse_misspelt_keywords(config, kwargs: dict) -> None:
    """Raise on a keyword that is no field of `config` but close to one (`kernal` for `kernel`): transformers would
    store it as a stray attribute and build the default, silently. Keywords transformers knows (its config's
    attributes, generation parameters, `TRANSFORMERS_KEYWORDS`, private `_names`), the config's `attribute_map` aliases
    (`hidden_size`) and unknown keywords close to no field are accepted, as transformers accepts them."""
    known = (set(dir(PreTrainedConfig)) | set(GenerationConfig._get_default_generation_params())
             | TRANSFORMERS_KEYWORDS | set(config.attribute_map))
    names = [f.name for f in fields(config)] + list(config.attribute_map)
    for key in kwargs:
        if key in known or key.startswith("_"):
            continue
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
        if close:
            raise ValueError(f"{type(config).__name__} got an unknown keyword {key!r}; did you mean {close[0]!r}?")


def check_moe_fields(config) -> None:
    """Validate the MoE fields a config shares with `S4Config` (`ffn="moe"`)."""
    if config.num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {config.num_experts}")
    if not 1 <= config.num_experts_per_tok <= config.num_experts:
        raise ValueError(f"num_experts_per_tok must be in 1..num_experts={config.num_experts}, "
                         f"got {config.num_experts_per_tok}")
    if config.capacity_factor is not None and config.capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for no limit), got {config.capacity_factor}")
    if config.moe_dispatch not in MOE_DISPATCHES:
        raise ValueError(f"moe_dispatch must be one of {MOE_DISPATCHES}, got {config.moe_dispatch!r}")
    if not 0 <= config.router_jitter < 1:
        raise ValueError(f"router_jitter must be in [0, 1), got {config.router_jitter}")


@strict
class MoEConfig(PreTrainedConfig):
    r"""
    Configuration of a decoder-only transformer whose feed-forward blocks are mixtures of SwiGLU experts (or, with
    `use_moe=False`, one dense SwiGLU MLP of the same width: the dense baseline of the same shape). Pre-norm
    (RMSNorm), rotary position embeddings, causal `scaled_dot_product_attention`.

    Args:
        vocab_size (`int`): Number of token ids (259 for the byte-level `ByT5Tokenizer(extra_ids=0)`).
        d_model (`int`): Width `D` of the residual stream.
        n_layer (`int`): Number of transformer blocks.
        n_head (`int`): Attention heads (must divide `d_model`).
        d_ffn (`int`): Hidden width `F` of each expert and of the dense MLP.
        use_moe (`bool`): Mixture-of-experts feed-forward blocks; `False` gives dense SwiGLU MLPs.
        moe_every (`int`): Every `moe_every`-th block is an MoE block, the others dense (1: all).
        num_experts (`int`): Experts `E` per MoE block.
        num_experts_per_tok (`int`): Experts `k` each token is routed to (the router's top-k; named as in
            transformers' Mixtral, because a config field `top_k` would become the sampling `top_k` of `generate()`).
        norm_topk_prob (`bool`): Renormalise the top-k router probabilities to sum 1 (Mixtral); otherwise keep
            the softmax values (Switch, DeepSeek).
        router_jitter (`float`): Multiplicative uniform noise `[1 - eps, 1 + eps]` on the router input in training
            (Switch); 0 disables it.
        router_aux_loss_coef (`float`): Weight of the load-balancing loss `E sum_e f_e P_e` (which is `k` under
            uniform routing, as in transformers' Mixtral) in the training loss.
        router_z_loss_coef (`float`): Weight of the router z-loss `mean(logsumexp(logits)^2)`.
        capacity_factor (`float`, *optional*): Each expert takes at most `ceil(capacity_factor T k / E)` of a
            batch's `T k` routed pairs; overflow pairs are dropped (the token passes through the residual). `None`:
            no limit.
        num_shared_experts (`int`): Always-on experts (one SwiGLU of width `num_shared_experts * d_ffn`) added to
            every token's output.
        moe_dispatch (`str`): `"auto"` (grouped matmul on CUDA in bf16 and float32, else `"fused"`), `"grouped_mm"`,
            `"fused"` or `"loop"` (the plain-autograd reference).
        rope_theta (`float`): Base of the rotary embedding frequencies.
        max_position_embeddings (`int`): Longest sequence the model is meant for (informational; rotary embeddings
            extrapolate).
        dropout (`float`): Dropout on attention probabilities and residual branches.
        rms_norm_eps (`float`): Epsilon of RMSNorm.
        initializer_range (`float`): Std of the normal init of embeddings, linear layers and expert weights.
        use_cache (`bool`): `generate()` decodes from a key/value cache, and a forward continuing from
            `past_key_values` returns the updated one (a plain forward builds none unless `use_cache=True`);
            `False`: every step re-reads the whole sequence.

    An unknown keyword close to a field name (`num_expert=4`) is refused with a did-you-mean.

    Example:

    ```python
    >>> from s4accel import MoEConfig, MoEForCausalLM
    >>> model = MoEForCausalLM(MoEConfig(d_model=64, n_layer=2, n_head=4, d_ffn=128, num_experts=8,
    ...                                    num_experts_per_tok=2))
    ```
    """

    model_type = "s4accel-moe"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "intermediate_size": "d_ffn", "num_local_experts": "num_experts"}

    vocab_size: int = 259
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_ffn: int = 512
    use_moe: bool = True
    moe_every: int = 1
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    router_jitter: float = 0.0
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    capacity_factor: float | None = None
    num_shared_experts: int = 0
    moe_dispatch: str = "auto"
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    dropout: float = 0.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    eos_token_id: int | None = 1
    bos_token_id: int | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        refuse_misspelt_keywords(self, kwargs)
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(f"n_head={self.n_head} must divide d_model={self.d_model} into an even head size")
        if self.moe_every < 1:
            raise ValueError(f"moe_every must be >= 1, got {self.moe_every}")
        check_moe_fields(self)

    def is_moe_layer(self, i: int) -> bool:
        return self.use_moe and (i + 1) % self.moe_every == 0


__all__ = ["MoEConfig"]
