"""S4 configuration.

This file is copied into Hub repositories next to `modeling_s4.py` for `trust_remote_code` loading, so it imports
only `transformers` and `huggingface_hub` (a dependency of transformers).
"""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

S4D_INITS = ("diag-lin", "diag-inv")


@strict
class S4Config(PreTrainedConfig):
    r"""
    Configuration of an S4 language model: a stack of pre-norm residual blocks, each holding one S4D layer
    (diagonal state space, ZOH discretisation, FFT convolution) followed by GELU and a GLU output projection.

    Args:
        vocab_size (`int`): Number of token ids (259 for the byte-level `ByT5Tokenizer(extra_ids=0)`).
        d_model (`int`): Width `H` of the residual stream; each channel has its own SSM.
        n_layer (`int`): Number of S4 blocks.
        d_state (`int`): State size `N` of each SSM. Stored as `N/2` complex modes plus their conjugates, so `N`
            must be even (the reference's convention; its default is 64).
        init (`str`): Initialisation of the diagonal state matrix `A`: `"diag-lin"` (S4D-Lin, `Im A_n = pi n`) or
            `"diag-inv"` (S4D-Inv, `Im A_n = (N/pi)(N/(2n+1) - 1)`); `Re A_n = -1/2` for both.
        dt_min, dt_max (`float`): Range of the log-uniform initialisation of the step size `dt` (one per channel).
        dropout (`float`): Dropout after each S4 layer's activation and on each residual branch.
        layer_norm_eps (`float`): Epsilon of the LayerNorms.
        initializer_range (`float`): Std of the normal init of embeddings and linear layers.

    Example:

    ```python
    >>> from s4accel import S4Config, S4ForCausalLM
    >>> model = S4ForCausalLM(S4Config(d_model=64, n_layer=2))
    ```
    """

    model_type = "s4accel-s4"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layer"}

    vocab_size: int = 259
    d_model: int = 256
    n_layer: int = 4
    d_state: int = 64
    init: str = "diag-lin"
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = True

    # Value checks; `@strict` runs every `validate_*` method after construction and checks the field types.
    def validate_sizes(self):
        for name in ("vocab_size", "d_model", "n_layer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_state < 2 or self.d_state % 2:
            raise ValueError(f"d_state must be an even number >= 2 (N/2 complex modes), got {self.d_state}")

    def validate_init(self):
        if self.init not in S4D_INITS:
            raise ValueError(f"init must be one of {', '.join(S4D_INITS)}, got {self.init!r}")

    def validate_dt(self):
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={self.dt_min}, dt_max={self.dt_max}")

    def validate_dropout(self):
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


__all__ = ["S4Config"]
