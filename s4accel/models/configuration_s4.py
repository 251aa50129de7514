"""S4 configuration.

This file is copied into Hub repositories next to `modeling_s4.py` for `trust_remote_code` loading, so it imports
only `transformers` and `huggingface_hub` (a dependency of transformers).
"""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .configuration_moe import check_moe_fields, refuse_misspelt_keywords

KERNELS = ("s4d", "s4")
S4D_INITS = ("diag-lin", "diag-inv", "diag-legs", "diag-real")
S4_INITS = ("legs",)
DISCRETIZATIONS = ("zoh", "bilinear")
NORMS = ("layer", "batch")
POOLINGS = ("mean", "last")
FFNS = ("none", "mlp", "moe")
CONV_PATHS = ("auto", "fft", "chunked", "fused")


@strict
class S4Config(PreTrainedConfig):
    r"""
    Configuration of an S4 model: a stack of residual blocks, each holding one S4 layer (`H = d_model` independent
    single-input single-output state space models, applied as a convolution) followed by GELU and a GLU output
    projection.

    Args:
        vocab_size (`int`): Number of token ids (259 for the byte-level `ByT5Tokenizer(extra_ids=0)`). Unused when
            `d_input` is set.
        d_input (`int`, *optional*): Features per time step of real-valued inputs (`input_values (B, L, d_input)`,
            e.g. a multivariate time series), encoded by a linear layer instead of a token embedding.
        input_mean (`list[float]`, *optional*): With `d_input`: each feature's mean over the training data. With
            `input_scale`, the model standardises raw `input_values` itself, `(x - input_mean) / input_scale`, so the
            training-time transform travels with the saved model (to `from_pretrained` users too).
        input_scale (`list[float]`, *optional*): Each feature's standard deviation over the training data (see
            `input_mean`). Formerly `input_std`, a name transformers' test tooling reads as a scalar initialisation
            scale (it sets every `*_std` and `*_range` attribute to a small float); a config saved with `input_std`
            still loads.
        d_model (`int`): Width `H` of the residual stream; each channel has its own SSM.
        n_layer (`int`): Number of S4 blocks.
        d_state (`int`): State size `N` of each SSM, stored as `N/2` complex modes plus their implied conjugates, so
            `N` must be even (the reference's convention; its default is 64).
        kernel (`str`): `"s4d"`, a diagonal state matrix `A` (kernel by Vandermonde product), or `"s4"`, the
            original normal-plus-low-rank `A = Lambda - P P^*` from HiPPO-LegS (kernel by Cauchy sums with the
            Woodbury correction, bilinear discretisation).
        disc (`str`): Discretisation of the `"s4d"` kernel: `"zoh"` (zero-order hold) or `"bilinear"`. The `"s4"`
            kernel is always bilinear.
        init (`str`, *optional*): Initialisation of `A`. `"s4d"`: `"diag-lin"` (S4D-Lin, `Im A_n = pi n`, the
            default), `"diag-inv"` (S4D-Inv, `Im A_n = (N/pi)(N/(2n+1) - 1)`), `"diag-legs"` (S4D-LegS, the
            diagonal part of the HiPPO-LegS NPLR form, with its `B`), `"diag-real"` (S4D-Real, `A_n = -(n+1)`).
            `"s4"`: `"legs"` (the default).
        n_ssm (`int`, *optional*): Number of distinct `(A, B, P)` triples, each shared by `d_model / n_ssm` channels
            (`C` and `dt` stay per channel). `None`: one per channel.
        l_max (`int`): Kernel length the `"s4"` kernel's `C` is trained for (its `C` is the reference's `C~ =
            C (I - dA^l_max)`). Shorter inputs use a prefix of this kernel; longer ones a doubled kernel. Set it to the
            training sequence length. Unused by `"s4d"`.
        dt_min, dt_max (`float`): Range of the log-uniform initialisation of the step size `dt` (one per channel).
        bidirectional (`bool`): A second, anti-causal kernel per channel (sequence classification only; causal
            language models and recurrent decoding refuse it).
        prenorm (`bool`): Normalise each block's input (`x + f(norm(x))`); otherwise its output (`norm(x + f(x))`).
        norm (`str`): `"layer"` (LayerNorm over channels) or `"batch"` (BatchNorm over batch and time).
        dropout (`float`): Dropout after each S4 layer's activation and on each residual branch.
        pooling (`str`): How `S4ForSequenceClassification` pools time steps: `"mean"` over real (unpadded) steps or
            the `"last"` real step.
        ffn (`str`): Feed-forward sub-block after each S4 layer (its own residual and norm): `"none"` (the S4 layer's
            GLU mixing only, the reference's block), `"mlp"` (a SwiGLU MLP of width `d_ffn`) or `"moe"` (a mixture of
            SwiGLU experts; see `MoEConfig` for `num_experts`, `num_experts_per_tok`, `norm_topk_prob`,
            `router_jitter`, `router_aux_loss_coef`, `router_z_loss_coef`, `capacity_factor`, `num_shared_experts`,
            `moe_dispatch`, which mean the same here).
        d_ffn (`int`): Hidden width of the feed-forward MLP, or of each expert.
        conv_path (`str`): How an S4D layer computes its convolution: `"fft"` (float32 FFTs of length 2L, the fastest
            on CPUs), `"chunked"` (chunks of `conv_chunk` steps as batched matmuls, bfloat16 operands under half
            precision autocast, real arithmetic that `torch.compile` generates code for), `"fused"` (the same chunks
            in one Triton kernel each way, which reads and writes each activation once: CUDA only, `d_state / 2`
            and `conv_chunk` powers of two >= 16, `conv_chunk` at most 128, 64 in float32) or `"auto"`: fused on
            CUDA where it can run, else chunked; FFT elsewhere. All compute the same function (to rounding); the
            DPLR kernel (`kernel="s4"`) has only the FFT path.
        conv_chunk (`int`, *optional*): Steps per chunk of the chunked and fused paths (a multiple of 16; a power
            of two for the fused one). `None`: 64 on the fused path (32 with float32 products without TF32, which
            would spill registers at 64); on the chunked one by the sequence length, 128
            up to 2,048 steps, 256 up to 8,192, 512 beyond (the Toeplitz products grow with the chunk, the scan
            across chunks shrinks).
        layer_norm_eps (`float`): Epsilon of the normalisation layers.
        initializer_range (`float`): Std of the normal init of embeddings and linear layers.
        use_cache (`bool`): `generate()` decodes from the recurrent state (`cache_params`), one position per step, and
            a forward continuing from a `cache_params` returns the updated state; `False`: every step re-reads the
            whole sequence. A forward from scratch returns its state only when asked (`use_cache=True`): the state
            after a convolution costs a second pass over the sequence, which evaluation would pay for nothing.

    An unknown keyword close to a field name (`kernal="s4"`) is refused with a did-you-mean.

    Example:

    ```python
    >>> from s4accel import S4Config, S4ForCausalLM
    >>> model = S4ForCausalLM(S4Config(d_model=64, n_layer=2, kernel="s4", l_max=256))
    ```
    """

    model_type = "s4accel-s4"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layer"}

    vocab_size: int = 259
    d_input: int | None = None
    input_mean: list[float] | None = None
    input_scale: list[float] | None = None
    d_model: int = 256
    n_layer: int = 4
    d_state: int = 64
    kernel: str = "s4d"
    disc: str = "zoh"
    init: str | None = None
    n_ssm: int | None = None
    l_max: int = 1024
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    bidirectional: bool = False
    prenorm: bool = True
    norm: str = "layer"
    dropout: float = 0.0
    pooling: str = "mean"
    ffn: str = "none"
    d_ffn: int = 512
    conv_path: str = "auto"
    conv_chunk: int | None = None
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    router_jitter: float = 0.0
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    capacity_factor: float | None = None
    num_shared_experts: int = 0
    moe_dispatch: str = "auto"
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = True
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        if "input_std" in kwargs:  # a config saved before the rename
            if self.input_scale is not None:
                raise ValueError("input_std is the old name of input_scale: give only input_scale")
            self.input_scale = kwargs.pop("input_std")
        refuse_misspelt_keywords(self, kwargs)
        super().__post_init__(**kwargs)

    @property
    def ssm_init(self) -> str:
        """`init`, or the kernel's default when it is None."""
        return self.init or ("diag-lin" if self.kernel == "s4d" else "legs")

    # Value checks; `@strict` runs every `validate_*` method after construction and checks the field types.
    def validate_sizes(self):
        for name in ("vocab_size", "d_model", "n_layer", "l_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_input is not None and self.d_input < 1:
            raise ValueError(f"d_input must be >= 1 (or None for token ids), got {self.d_input}")
        for name in ("input_mean", "input_scale"):
            stats = getattr(self, name)
            if stats is not None and (self.d_input is None or len(stats) != self.d_input):
                raise ValueError(f"{name} needs d_input set and one value per feature (d_input={self.d_input}), "
                                 f"got {len(stats)}")
        if (self.input_mean is None) != (self.input_scale is None):
            raise ValueError("input_mean and input_scale go together")
        if self.input_scale is not None and min(self.input_scale) <= 0:
            raise ValueError("input_scale must be positive")
        if self.d_state < 2 or self.d_state % 2:
            raise ValueError(f"d_state must be an even number >= 2 (N/2 complex modes), got {self.d_state}")
        if self.n_ssm is not None and (self.n_ssm < 1 or self.d_model % self.n_ssm):
            raise ValueError(f"n_ssm must divide d_model={self.d_model}, got {self.n_ssm}")

    def validate_choices(self):
        for name, allowed in (("kernel", KERNELS), ("disc", DISCRETIZATIONS), ("norm", NORMS),
                              ("pooling", POOLINGS), ("ffn", FFNS), ("conv_path", CONV_PATHS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        allowed = S4D_INITS if self.kernel == "s4d" else S4_INITS
        if self.ssm_init not in allowed:
            raise ValueError(f"init for kernel={self.kernel} must be one of {', '.join(allowed)}, got {self.init!r}")
        if self.conv_path in ("chunked", "fused") and self.kernel != "s4d":
            raise ValueError(f"conv_path={self.conv_path!r} needs kernel='s4d' (a diagonal A); the DPLR kernel has "
                             "the FFT path")

    def validate_conv_chunk(self):
        if self.conv_chunk is not None and (self.conv_chunk < 16 or self.conv_chunk % 16):
            raise ValueError(f"conv_chunk must be a multiple of 16 (or None for the default), got {self.conv_chunk}")

    def validate_ffn(self):
        if self.ffn != "none" and self.d_ffn < 1:
            raise ValueError(f"d_ffn must be >= 1, got {self.d_ffn}")
        if self.ffn == "moe":
            check_moe_fields(self)

    def validate_dt(self):
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={self.dt_min}, dt_max={self.dt_max}")

    def validate_dropout(self):
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


__all__ = ["S4Config"]
