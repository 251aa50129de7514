"""Mixture-of-experts transformer language model, as a `transformers` model.

Pre-norm decoder blocks: `x + Attention(RMSNorm(x))`, then `x + FFN(RMSNorm(x))` where FFN is an `MoELayer` (router,
top-k SwiGLU experts, optional shared experts; see `moe.py`) or, with `use_moe=False` (or between MoE blocks when
`moe_every > 1`), a dense SwiGLU MLP of the experts' width. Attention is causal `scaled_dot_product_attention` with
rotary position embeddings and a key/value cache (`DynamicCache`) for `generate()`. Asked for its attention weights
(`output_attentions=True`, or `attn_implementation="eager"`), it computes attention written out instead, the same
maths, and returns them.

Shapes: `B` batch, `L` new positions, `S` cached + new positions, `D` width, `h` heads of size `d = D / h`.

The output's `loss` is the language-model loss plus `aux_loss`, the weighted router losses (load balancing and
z-loss, averaged over MoE layers); `router_logits` holds each MoE layer's `(B L, E)` logits and
`expert_counts (n_moe, E)` / `dropped_counts (n_moe,)` the routing statistics a trainer logs.

This file is copied into Hub repositories for `trust_remote_code` loading: it imports only torch, transformers and
its siblings, which `save_pretrained` folds into it there (`code_bundle.py`).
"""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import ModelOutput
from transformers.utils import can_return_tuple

from .cache_names import cache_field, one_cache
from .code_bundle import SavesFoldedCode
from .configuration_moe import MoEConfig
from .documents import Documents
from .moe import MOE_OUTPUTS, MoELayer, SwiGLUMLP, init_moe_weights, moe_losses


def rotation(positions: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding's angles for heads of size `d`: positions (B, L) -> cos and sin (B, 1, L, d/2) of
    `position * theta^(-2i/d)`, float32. Computed once per forward and shared by every layer: computed inside each
    layer, `torch.compile` fused the cos and sin into the kernels that rotate q and k, for every element (a 100M
    transformer at L 2,048 on an H200: 8.5 ms of its 70 ms compiled step in those kernels)."""
    inv_freq = theta ** (-torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d)  # (d/2,)
    angle = positions[:, None, :, None].float() * inv_freq  # (B, 1, L, d/2)
    return angle.cos(), angle.sin()


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding: x (B, h, L, d) with each pair (x_i, x_{i + d/2}) rotated by the angles of `rotation`
    (cos, sin (B, 1, L, d/2)). Computed in float32."""
    cos, sin = cos_sin
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def eager_attention(q, k, v, attn_mask, dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`scaled_dot_product_attention` written out, for its weights: q (B, h, L, d), k, v (B, h, S, d), attn_mask
    (B, 1, L, S) bool or None (the L queries are the last positions and see every key at or before them) ->
    output (B, h, L, d) and the attention probabilities (B, h, L, S), softmax in float32."""
    L, S = q.shape[-2], k.shape[-2]
    if attn_mask is None:
        attn_mask = torch.arange(S, device=q.device) <= torch.arange(S - L, S, device=q.device)[:, None]  # (L, S)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, h, L, S)
    weights = scores.masked_fill(~attn_mask, float("-inf")).softmax(-1).to(q.dtype)
    return F.dropout(weights, dropout_p) @ v, weights


class MoEAttention(nn.Module):
    def __init__(self, config: MoEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.n_head = layer_idx, config.n_head
        self.dropout = config.dropout
        self.qkv_proj = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x, cos_sin, attn_mask, cache, eager=False, documents: Documents | None = None):
        """x (B, L, D), cos_sin the rotary angles of its positions (`rotation`), attn_mask (B, 1, L, S) bool or None
        (then plain causal), cache or None. -> (B, L, D) and, with `eager`, the attention weights (B, h, L, S)
        (else None). `documents` (packed, no cached prefix): each document's causal attention on its own, in one
        batched call per length bucket (the work grows with the sum of the squared lengths, not with L^2)."""
        B, L, D = x.shape
        q, k, v = self.qkv_proj(x).view(B, L, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)  # (B, h, L, d)
        q, k = rotate(q, cos_sin), rotate(k, cos_sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, h, S, d)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if eager:
            y, weights = eager_attention(q, k, v, attn_mask, dropout_p)
        elif documents is not None:
            def causal(*qkv):  # (n, Lb, h, d) each: the bucket's documents
                qkv = [t.transpose(1, 2) for t in qkv]
                return F.scaled_dot_product_attention(*qkv, is_causal=True, dropout_p=dropout_p).transpose(1, 2)
            y = documents.apply(causal, *(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)  # (B, h, L, d)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None and L > 1,
                                               dropout_p=dropout_p)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, D)), weights


class MoEBlock(GradientCheckpointingLayer):
    def __init__(self, config: MoEConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.rms_norm_eps)
        self.attn = MoEAttention(config, layer_idx)
        self.ffn_norm = nn.RMSNorm(config.d_model, eps=config.rms_norm_eps)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.ffn = MoELayer(config, config.d_model) if self.is_moe else SwiGLUMLP(config.d_model, config.d_ffn)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos_sin, attn_mask, cache, token_mask, eager=False, documents=None):
        """-> x, MoE aux dict or None, attention weights or None (see `MoEAttention`)."""
        a, weights = self.attn(self.attn_norm(x), cos_sin, attn_mask, cache, eager, documents)
        x = x + self.dropout(a)
        h = self.ffn_norm(x)
        aux = None
        if self.is_moe:
            h, aux = self.ffn(h, token_mask)
        else:
            h = self.ffn(h)
        return x + self.dropout(h), aux, weights


@cache_field("past_key_values")  # the field's name before transformers 5.24
@dataclass
class MoEModelOutput(ModelOutput):
    last_hidden_state: torch.FloatTensor | None = None
    cache: DynamicCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    aux_loss: torch.FloatTensor | None = None
    balance_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    expert_counts: torch.LongTensor | None = None
    dropped_counts: torch.LongTensor | None = None


@cache_field("past_key_values")
@dataclass
class MoECausalLMOutput(ModelOutput):
    """`loss` = language-model loss + `aux_loss` (the weighted router losses, included so that `loss.backward()`
    trains the router); `balance_loss` and `z_loss` are the unweighted layer means (detached).
    `expert_counts (n_moe, E)`: routed (token, expert) pairs per MoE layer and expert, real tokens only;
    `dropped_counts (n_moe,)`: pairs dropped by the capacity limit. `attentions`: each layer's attention weights
    (B, h, L, S), with `output_attentions=True`."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: DynamicCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    aux_loss: torch.FloatTensor | None = None
    balance_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    expert_counts: torch.LongTensor | None = None
    dropped_counts: torch.LongTensor | None = None


class MoEPreTrainedModel(SavesFoldedCode, PreTrainedModel):
    config: MoEConfig
    config_class = MoEConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["MoEBlock"]
    # Float32 whatever the dtype a user loads the model in, and its own float32 FSDP unit under mixed precision: the
    # router, whose softmax decides the routing.
    _keep_in_fp32_modules_strict = ["router"]
    _supports_sdpa = True
    supports_gradient_checkpointing = True  # each block (`activation_checkpointing_enable()`)

    def __init__(self, config: MoEConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        self._keep_in_fp32_modules_strict = ["router"] if config.use_moe else []  # the dense baseline has none

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        init_moe_weights(module, self.config.initializer_range)


def attention_mask_4d(attention_mask: torch.Tensor | None, L: int, S: int, device) -> torch.Tensor | None:
    """(B, S) padding mask -> (B, 1, L, S) bool: the L new queries (at positions S-L..S-1) see real keys at or before
    them, and always themselves (so a padding query has a row to attend to). None where SDPA's own masking does:
    no padding, and either no cached prefix (`is_causal`) or a single query (sees every key)."""
    padded = attention_mask is not None and not bool(attention_mask.all())
    if not padded and (L == S or L == 1):
        return None
    q = torch.arange(S - L, S, device=device)[:, None]
    k = torch.arange(S, device=device)[None, :]
    allowed = (k <= q)[None, None]  # (1, 1, L, S)
    if padded:
        allowed = allowed & attention_mask[:, None, None, :].bool().to(device)
    return allowed | (k == q)


def document_mask_4d(position_ids: torch.Tensor, past: int, mask4: torch.Tensor | None) -> torch.Tensor | None:
    """Documents read alone: a query at index i whose position is p (counted within its document) sees the keys
    i - p .. i, so packed documents (positions restarting at 0) attend block-diagonally, in one forward or through a
    cache while generating. (B, 1, L, S) bool with `mask4`'s padding rule, or `mask4` itself where every query sees
    all the keys before it anyway."""
    L = position_ids.shape[1]
    i = torch.arange(past, past + L, device=position_ids.device)[None, :, None]  # (1, L, 1)
    first = i - position_ids[:, :, None]  # (B, L, 1): the first key each query sees
    if not bool((first > 0).any()):
        return mask4
    k = torch.arange(past + L, device=position_ids.device)
    allowed = ((k <= i) & (k >= first))[:, None]  # (B, 1, L, S)
    return allowed if mask4 is None else allowed & mask4 | (k == i)[:, None]


class MoEModel(MoEPreTrainedModel):
    def __init__(self, config: MoEConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList([MoEBlock(config, i) for i in range(config.n_layer)])
        self.norm_f = nn.RMSNorm(config.d_model, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, new_embeddings):
        self.embeddings = new_embeddings

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, output_hidden_states=None, output_attentions=None, past_key_values=None,
                **kwargs) -> MoEModelOutput:
        r"""
        cache (`DynamicCache`, *optional*): The keys and values of the positions before these ones.
        position_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*): Rotary positions
            (default: counted from each row's first real token). Counted within each document, they mark packed
            documents (restarting at 0, as transformers' padding-free collators give them): a query at position p
            sees the p keys before it and itself, so each document attends to itself only, also when generating.
        use_cache (`bool`, *optional*): Return the key/value cache (`cache`, updated in place when one was given).
            Default: `config.use_cache` when continuing from `cache`, else False (no cache is built for a plain
            forward, e.g. in training or evaluation).
        output_hidden_states, output_attentions (`bool`, *optional*): Default: the config's. Attention weights come
            from attention written out (`eager_attention`), the same maths as the SDPA kernel used otherwise.
        past_key_values (`DynamicCache`, *optional*): The name of `cache` before transformers 5.24, still accepted.
        """
        cache = one_cache(cache, past_key_values=past_key_values)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Specify exactly one of input_ids or inputs_embeds")
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        if use_cache is None:
            use_cache = self.config.use_cache and cache is not None
        eager = bool(output_attentions) or self.config._attn_implementation == "eager"
        x = self.embeddings(input_ids) if input_ids is not None else inputs_embeds  # (B, L, D)
        B, L, _ = x.shape
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        S = past + L
        if attention_mask is not None and attention_mask.shape[1] != S:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions, expected {S}")
        given = position_ids is not None
        if position_ids is None:
            if attention_mask is not None:  # left padding: count positions from each row's first real token
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                position_ids = torch.arange(past, S, device=x.device).expand(B, L)
        mask4 = attention_mask_4d(attention_mask, L, S, x.device)
        # Packed documents (positions restarting at 0) attend to themselves only: in bucketed batches of documents
        # when the whole rows are here, else (decoding after them, padding, attention weights asked for) by a mask.
        documents = None
        if given and not past and mask4 is None and not eager:
            documents = Documents.of(position_ids)
        if given and documents is None:
            mask4 = document_mask_4d(position_ids, past, mask4)
        token_mask = attention_mask[:, past:] if attention_mask is not None else None  # (B, L): route real tokens
        hidden, auxes = [] if output_hidden_states else None, []
        attentions = [] if output_attentions else None
        cos_sin = rotation(position_ids, self.config.d_model // self.config.n_head, self.config.rope_theta)
        for block in self.layers:
            if hidden is not None:
                hidden.append(x)
            x, aux, weights = block(x, cos_sin, mask4, cache, token_mask, eager, documents)
            if aux is not None:
                auxes.append(aux)
            if attentions is not None:
                attentions.append(weights)
        x = self.norm_f(x)
        if hidden is not None:
            hidden.append(x)
        return MoEModelOutput(last_hidden_state=x, cache=cache if use_cache else None,
                              hidden_states=tuple(hidden) if hidden else None,
                              attentions=tuple(attentions) if attentions else None, **moe_losses(auxes, self.config))


class MoEForCausalLM(MoEPreTrainedModel, GenerationMixin):
    """MoE (or dense) transformer language model with a head tied to the input embedding."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: MoEConfig):
        super().__init__(config)
        self.model = MoEModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, new_embeddings):
        self.model.embeddings = new_embeddings

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, output_hidden_states=None, output_attentions=None,
                logits_to_keep: int = 0, num_items_in_batch=None, past_key_values=None,
                **kwargs) -> MoECausalLMOutput:
        r"""
        cache (`DynamicCache`, *optional*): The keys and values of the positions before these ones (see `MoEModel`);
            `past_key_values`, its name before transformers 5.24, is still accepted.
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*): Targets, usually
            `input_ids`; shifted inside (position t predicts t+1); -100 is ignored.
        num_items_in_batch (`int` or `torch.Tensor`, *optional*): The language-model loss is `sum of token losses /
            num_items_in_batch` instead of a mean over this batch (a trainer's accumulation window); `aux_loss` is
            always this batch's own.
        kwargs: Passed on to `self.loss_function` (the language-model part), e.g. `shift_labels` (targets already
            shifted, as context-parallel training gives them) or `ignore_index`.
        """
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=one_cache(cache, past_key_values=past_key_values), inputs_embeds=inputs_embeds,
                         use_cache=use_cache, output_hidden_states=output_hidden_states,
                         output_attentions=output_attentions, return_dict=True)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)  # (B, L, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      num_items_in_batch=num_items_in_batch, **kwargs)
            if out.aux_loss is not None:
                loss = loss + out.aux_loss
        return MoECausalLMOutput(loss=loss, logits=logits, cache=out.cache,
                                 hidden_states=out.hidden_states, attentions=out.attentions,
                                 **{k: getattr(out, k) for k in MOE_OUTPUTS})


__all__ = ["MoEPreTrainedModel", "MoEModel", "MoEForCausalLM"]

# save_pretrained copies this file and its relative imports next to the weights and writes `auto_map`, so
# `AutoModel*.from_pretrained(path, trust_remote_code=True)` works where s4accel is not installed.
MoEConfig.register_for_auto_class()
MoEModel.register_for_auto_class("AutoModel")
MoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")
