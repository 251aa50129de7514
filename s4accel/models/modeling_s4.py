"""S4 (diagonal, S4D) language model in PyTorch, as a `transformers` model.

Notation follows the S4/S4D papers: `H` channels (`d_model`), each an independent single-input single-output SSM
with state size `N` (`d_state`), stored as `N/2` complex modes whose conjugates are implied. Per channel:

    x'(t) = A x(t) + B u(t),   y(t) = C x(t) + D u(t),      A diagonal complex, B = 1 (absorbed into C)

ZOH discretisation with step `dt = exp(log_dt)` gives `x_k = exp(dt A) x_{k-1} + u_k` and
`y_k = 2 Re(C~ . x_k) + D u_k` with `C~ = C (exp(dt A) - 1) / A`, equivalent to a causal convolution of `u` with
the kernel `K[l] = 2 Re(sum_n C~_n exp(dt A_n l))`, computed by Vandermonde product and applied by FFT.

This file is copied into Hub repositories for `trust_remote_code` loading: it imports only torch, transformers and
its sibling `configuration_s4.py`.
"""

import math

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .configuration_s4 import S4Config


def _fp32_or_wider(t: torch.Tensor) -> torch.Tensor:
    """float64 stays float64 (for reference checks); anything narrower is computed in float32."""
    return t if t.dtype == torch.float64 else t.float()


def fft_causal_conv(u: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
    """Causal convolution `y[t] = sum_{s<=t} K[t-s] u[s]`.

    u: (B, H, L), K: (H, L) -> y: (B, H, L). Both are zero-padded to length 2L so the FFT product is a linear,
    not circular, convolution: no output sees a future input.
    """
    L = u.shape[-1]
    n = 2 * L
    y = torch.fft.irfft(torch.fft.rfft(u, n=n) * torch.fft.rfft(K, n=n), n=n)
    return y[..., :L]


class S4DKernel(nn.Module):
    """The convolution kernels `K (H, L)` of `H` diagonal SSMs, ZOH-discretised.

    Parameters (names are used by the optimizer to give `log_dt`, `log_A_real` and `A_imag` their own learning rate
    and no weight decay):
        log_dt     (H,)         log step size
        log_A_real (H, N/2)     Re A = -exp(log_A_real) < 0 keeps every mode stable
        A_imag     (H, N/2)     Im A
        C          (H, N/2, 2)  complex C stored as (real, imag) pairs; safetensors holds no complex dtype
    """

    def __init__(self, config: S4Config):
        super().__init__()
        self.config = config
        H, N2 = config.d_model, config.d_state // 2
        self.log_dt = nn.Parameter(torch.empty(H))
        self.log_A_real = nn.Parameter(torch.empty(H, N2))
        self.A_imag = nn.Parameter(torch.empty(H, N2))
        self.C = nn.Parameter(torch.empty(H, N2, 2))

    @torch.no_grad()
    def reset_parameters(self):
        """Structured S4D init; called from `S4PreTrainedModel._init_weights` (never N(0, std) like a Linear)."""
        H, N2 = self.A_imag.shape
        cfg = self.config
        device = self.A_imag.device
        # dt log-uniform in [dt_min, dt_max], one per channel.
        log_dt = torch.rand(H, device=device) * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min)
        n = torch.arange(N2, dtype=torch.float32, device=device)
        if cfg.init == "diag-lin":  # S4D-Lin: Im A_n = pi n
            imag = math.pi * n
        else:  # S4D-Inv: Im A_n = (N/pi) (N/(2n+1) - 1)
            N = 2 * N2
            imag = (N / math.pi) * (N / (2 * n + 1) - 1)
        init.copy_(self.log_dt, log_dt)
        init.copy_(self.log_A_real, torch.full((H, N2), math.log(0.5), device=device))  # Re A = -1/2
        init.copy_(self.A_imag, imag.expand(H, N2))
        # C ~ complex standard normal (unit variance overall), as in the reference.
        init.copy_(self.C, torch.randn(H, N2, 2, device=device) * math.sqrt(0.5))

    def discretize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `dtA (H, N/2)` and `C~ (H, N/2)`, complex64 (complex128 for fp64 parameters); `exp(dtA)` is the
        discrete state matrix."""
        dt = torch.exp(_fp32_or_wider(self.log_dt))  # (H,)
        A = torch.complex(-torch.exp(_fp32_or_wider(self.log_A_real)), _fp32_or_wider(self.A_imag))  # (H, N/2)
        C = torch.view_as_complex(_fp32_or_wider(self.C).contiguous())  # (H, N/2)
        dtA = A * dt[:, None]  # (H, N/2)
        C_tilde = C * (torch.exp(dtA) - 1.0) / A  # ZOH: B~ = (exp(dtA) - 1) / A, folded into C
        return dtA, C_tilde

    def forward(self, L: int) -> torch.Tensor:
        """Kernel `K (H, L)` in float32 (or float64): `K[l] = 2 Re(sum_n C~_n exp(dtA_n l))` (Vandermonde product)."""
        dtA, C_tilde = self.discretize()
        l = torch.arange(L, device=dtA.device, dtype=dtA.real.dtype)
        # exp(dtA l) as |.| e^{i angle}: a real exp plus cos/sin is ~1.5x faster on CPU than torch's complex exp
        vandermonde = torch.polar(torch.exp(dtA.real[:, :, None] * l), dtA.imag[:, :, None] * l)  # (H, N/2, L)
        return 2 * torch.einsum("hn,hnl->hl", C_tilde, vandermonde).real

    def recurrence(self, u: torch.Tensor) -> torch.Tensor:
        """Slow, obviously correct reference: run the discrete SSM step by step. u: (B, H, L) -> (B, H, L).

        Equal to `fft_causal_conv(u, self(L))` up to rounding (see tests); it is what generation will use step by step.
        """
        dtA, C_tilde = self.discretize()
        dA = torch.exp(dtA)  # (H, N/2)
        x = torch.zeros(*u.shape[:2], dA.shape[-1], dtype=dA.dtype, device=u.device)  # (B, H, N/2)
        ys = []
        for k in range(u.shape[-1]):
            x = dA * x + u[..., k, None]  # x_k = exp(dtA) x_{k-1} + B u_k, B = 1
            ys.append(2 * (C_tilde * x).sum(-1).real)  # y_k = 2 Re(C~ . x_k)
        return torch.stack(ys, dim=-1)


class S4Layer(nn.Module):
    """One S4D layer: SSM convolution + D skip, GELU, dropout, then a GLU output projection. (B, L, H) -> (B, L, H)."""

    def __init__(self, config: S4Config):
        super().__init__()
        H = config.d_model
        self.kernel = S4DKernel(config)
        self.D = nn.Parameter(torch.empty(H))  # (H,) skip connection, y += D u
        self.activation = nn.GELU()
        self.dropout = nn.Dropout(config.dropout)
        self.output_linear = nn.Linear(H, 2 * H)  # GLU halves it back to H
        self.glu = nn.GLU(dim=-1)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        L = u.shape[1]
        # 1. The SSM in float32 whatever the autocast dtype: exp(dtA * l) over long l and the FFT lose everything in
        #    half precision (log_dt going NaN under fp16 is a known report against the reference).
        with torch.autocast(device_type=u.device.type, enabled=False):
            u32 = _fp32_or_wider(u).transpose(1, 2)  # (B, H, L)
            y = fft_causal_conv(u32, self.kernel(L)) + u32 * _fp32_or_wider(self.D)[:, None]  # (B, H, L)
        y = y.transpose(1, 2).to(u.dtype)  # (B, L, H)
        # 2. Pointwise nonlinearity and mixing across channels.
        y = self.dropout(self.activation(y))
        return self.glu(self.output_linear(y))  # (B, L, 2H) -> (B, L, H)


class S4Block(nn.Module):
    """Pre-norm residual block: `x + dropout(S4Layer(LayerNorm(x)))`."""

    def __init__(self, config: S4Config):
        super().__init__()
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.layer = S4Layer(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        z = self.norm(x)
        if mask is not None:
            # Padded positions feed zeros into the SSM, so a left-padded prompt leaves the same state as no padding.
            z = z * mask[..., None].to(z.dtype)
        return x + self.dropout(self.layer(z))


class S4PreTrainedModel(PreTrainedModel):
    config: S4Config
    config_class = S4Config
    base_model_prefix = "backbone"
    _no_split_modules = ["S4Block"]
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module):
        """Embeddings and Linears get N(0, initializer_range) from the base class; SSM parameters their S4D init."""
        super()._init_weights(module)
        if isinstance(module, S4DKernel):
            module.reset_parameters()
        elif isinstance(module, S4Layer):
            init.normal_(module.D, mean=0.0, std=1.0)  # the reference's D ~ N(0, 1)


class S4Model(S4PreTrainedModel):
    """Token embedding, `n_layer` S4 blocks and a final LayerNorm. input_ids (B, L) -> hidden states (B, L, H)."""

    def __init__(self, config: S4Config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList([S4Block(config) for _ in range(config.n_layer)])
        self.norm_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, new_embeddings):
        self.embeddings = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Specify exactly one of input_ids or inputs_embeds")
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        x = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # (B, L, H)
        all_hidden = [] if output_hidden_states else None
        for block in self.layers:
            if all_hidden is not None:
                all_hidden.append(x)
            x = block(x, mask=attention_mask)
        x = self.norm_f(x)
        if all_hidden is not None:
            all_hidden.append(x)
        return BaseModelOutput(last_hidden_state=x, hidden_states=tuple(all_hidden) if all_hidden else None)


class S4ForCausalLM(S4PreTrainedModel, GenerationMixin):
    """S4 language model: `S4Model` + a linear head tied to the input embedding (unless
    `tie_word_embeddings=False`)."""

    _tied_weights_keys = {"lm_head.weight": "backbone.embeddings.weight"}

    def __init__(self, config: S4Config):
        super().__init__(config)
        self.backbone = S4Model(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.embeddings

    def set_input_embeddings(self, new_embeddings):
        self.backbone.embeddings = new_embeddings

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # An SSM has no key/value cache; generate() must not build one for us.
        return False

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, **kwargs):
        # No recurrent cache yet: every decoding step re-runs the convolution over the whole sequence, so the input is
        # never cut down to the newest token (which `use_cache=True` would otherwise ask for).
        return super().prepare_inputs_for_generation(input_ids, next_sequence_length=None, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int = 0,
        num_items_in_batch: torch.Tensor | int | None = None,
        **kwargs,
    ) -> CausalLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Targets, usually `input_ids`; shifted inside (position t predicts t+1); -100 is ignored.
        logits_to_keep (`int`): compute logits only for the last `logits_to_keep` positions (0 = all).
        num_items_in_batch (`int` or `torch.Tensor`, *optional*):
            When given, the loss is `sum of token losses / num_items_in_batch` rather than a mean over this batch, so
            a trainer can normalise by the real token count of a whole accumulation window across processes.
        """
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
        )
        hidden = out.last_hidden_state  # (B, L, H)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)  # (B, L, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits, labels, vocab_size=self.config.vocab_size, num_items_in_batch=num_items_in_batch
            )
        return CausalLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


__all__ = ["S4PreTrainedModel", "S4Model", "S4ForCausalLM"]
