"""The transformers contracts every s4accel model keeps, checked as transformers' own model tests check theirs: a
tester per model variant (a tiny config, inputs, the classes it has), and each contract checked on every class it
applies to. Outputs as tuples or dataclasses, hidden states and attention weights, loss keywords, `use_cache`, the
caches (cached vs uncached generation, continuing `generate()` from a returned cache, a cached multi-token forward),
stateful generation, `inputs_embeds`, save/`from_pretrained`, batching, left padding and config keyword typos."""

import json
from dataclasses import dataclass, field

import pytest
import torch
from torch.nn import functional as F

from s4accel import (MoEConfig, MoEForCausalLM, MoEModel, S4Config, S4ForCausalLM, S4ForSequenceClassification,
                     S4Model)
from s4accel.models.cache_names import CACHE_RENAMED

VOCAB = 40


@dataclass
class ModelTester:
    """One model variant: its config fields and classes. `old_cache_name`: the cache's name before transformers 5.24
    (the models take `cache` on every version)."""

    name: str
    config_class: type
    fields: dict
    lm_class: type
    base_class: type
    classifier_class: type | None
    old_cache_name: str
    stateful: bool
    batch: int = 2
    length: int = 9
    pad: int = 3  # left padding of row 0
    extra: dict = field(default_factory=dict)

    def config(self, **overrides):
        # eos_token_id=None: no row stops early, so every generate() call runs its max_new_tokens
        return self.config_class(**{"vocab_size": VOCAB, "eos_token_id": None, **self.fields, **overrides})

    def model(self, cls=None, seed=0, **overrides):
        cls = cls or self.lm_class
        if cls is self.classifier_class:
            overrides = {"num_labels": 3, **overrides}
        torch.manual_seed(seed)
        return cls(self.config(**overrides)).eval()

    @property
    def generate_cache_name(self):
        """The keyword the installed `generate()` takes a cache under (and the field its output returns it in)."""
        return "cache" if CACHE_RENAMED else self.old_cache_name

    def classes(self):
        return [c for c in (self.lm_class, self.base_class, self.classifier_class) if c is not None]

    def ids(self, seed=1):
        torch.manual_seed(seed)
        return torch.randint(3, VOCAB, (self.batch, self.length))

    def left_padded(self, seed=1):
        """ids (B, L) with row 0 left-padded by `pad` zeros, and the matching attention mask."""
        ids = self.ids(seed)
        mask = torch.ones_like(ids)
        ids[0, : self.pad], mask[0, : self.pad] = 0, 0
        return ids, mask

    def labels_for(self, cls, ids):
        if cls is self.classifier_class:
            return torch.arange(ids.shape[0]) % 3
        return ids if cls is self.lm_class else None


S4_FIELDS = {"d_model": 16, "n_layer": 2, "d_state": 8, "l_max": 16}
TESTERS = [
    ModelTester("s4d", S4Config, S4_FIELDS, S4ForCausalLM, S4Model, S4ForSequenceClassification, "cache_params", True),
    ModelTester("s4", S4Config, {**S4_FIELDS, "kernel": "s4"}, S4ForCausalLM, S4Model, S4ForSequenceClassification,
                "cache_params", True),
    ModelTester("s4-moe", S4Config, {**S4_FIELDS, "ffn": "moe", "d_ffn": 24, "num_experts": 4},
                S4ForCausalLM, S4Model, S4ForSequenceClassification, "cache_params", True),
    ModelTester("moe", MoEConfig, {"d_model": 16, "n_layer": 2, "n_head": 2, "d_ffn": 24, "num_experts": 4},
                MoEForCausalLM, MoEModel, None, "past_key_values", False),
]


@pytest.fixture(params=TESTERS, ids=[t.name for t in TESTERS])
def tester(request):
    return request.param


@pytest.fixture(params=[t for t in TESTERS if t.stateful], ids=[t.name for t in TESTERS if t.stateful])
def s4_tester(request):
    return request.param


def assert_same(a, b, atol=0.0):
    """Equal outputs: tensors (to `atol`), nested tuples of them, or objects of the same type (caches)."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, atol)
    else:
        assert type(a) is type(b)


def embedding_lengths(model):
    """Positions each forward embeds, recorded from the input embedding (remove the returned hook when done)."""
    lengths = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, out: lengths.append(out.shape[1]))
    return lengths, hook


GREEDY = {"do_sample": False, "pad_token_id": 0}


# ---------------------------------------------------------------------------------------------------- outputs


def test_return_dict_false_gives_the_dataclass_fields_in_order_as_a_tuple_for_every_class(tester):
    ids = tester.ids()
    for cls in tester.classes():
        model = tester.model(cls)
        kwargs = {"input_ids": ids, "output_hidden_states": True}
        if (labels := tester.labels_for(cls, ids)) is not None:
            kwargs["labels"] = labels
        with torch.no_grad():
            as_dict = model(**kwargs)
            as_tuple = model(**kwargs, return_dict=False)
            model.config.return_dict = False
            from_config = model(**kwargs)
        assert isinstance(as_tuple, tuple) and isinstance(from_config, tuple), cls.__name__
        assert_same(as_tuple, as_dict.to_tuple())  # dataclass order, None fields left out
        assert_same(from_config, as_dict.to_tuple())
        first = "loss" if "labels" in kwargs else "last_hidden_state" if cls is tester.base_class else "logits"
        torch.testing.assert_close(as_tuple[0], as_dict[first], rtol=0, atol=0)


def test_hidden_states_switched_on_in_the_config_are_returned_by_every_class(tester):
    ids = tester.ids()
    for cls in tester.classes():
        model = tester.model(cls, output_hidden_states=True)
        with torch.no_grad():
            out = model(ids)
            off = model(ids, output_hidden_states=False)
        hidden = out.hidden_states
        assert hidden is not None and len(hidden) == model.config.n_layer + 1, cls.__name__
        assert all(h.shape == (*ids.shape, model.config.d_model) for h in hidden)
        assert off.hidden_states is None  # the argument overrides the config
        if cls is tester.base_class:
            torch.testing.assert_close(hidden[-1], out.last_hidden_state, rtol=0, atol=0)


def test_moe_transformer_returns_its_attention_weights_when_asked():
    tester = TESTERS[-1]
    model = tester.model()
    ids, mask = tester.left_padded()
    with torch.no_grad():
        plain = model(ids, attention_mask=mask)
        out = model(ids, attention_mask=mask, output_attentions=True)
        from_config = tester.model(output_attentions=True)(ids, attention_mask=mask)
    B, L = ids.shape
    assert len(out.attentions) == model.config.n_layer
    for weights in out.attentions:
        assert weights.shape == (B, model.config.n_head, L, L)
        torch.testing.assert_close(weights.sum(-1), torch.ones(B, model.config.n_head, L))
        assert not weights.triu(1).any()  # no query attends to a later position
        assert not weights[0, :, tester.pad:, : tester.pad].any()  # nor a real query to padding
    torch.testing.assert_close(out.logits, plain.logits, rtol=1e-5, atol=1e-5)  # the same attention, written out
    assert_same(from_config.attentions, out.attentions)


def test_moe_transformer_with_the_eager_attention_implementation_computes_attention_written_out(monkeypatch):
    from s4accel.models import modeling_moe

    tester = TESTERS[-1]
    calls = []
    written_out = modeling_moe.eager_attention
    monkeypatch.setattr(modeling_moe, "eager_attention", lambda *a: calls.append(1) or written_out(*a))
    ids, mask = tester.left_padded()
    sdpa = tester.model()
    eager = MoEForCausalLM._from_config(tester.config(), attn_implementation="eager").eval()
    eager.load_state_dict(sdpa.state_dict())
    with torch.no_grad():
        ref = sdpa(ids, attention_mask=mask)
        assert not calls
        out = eager(ids, attention_mask=mask)
    assert len(calls) == eager.config.n_layer and out.attentions is None  # written out, weights not asked for
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_moe_transformer_generate_returns_the_attention_weights_of_every_step():
    tester = TESTERS[-1]
    model = tester.model()
    ids, mask = tester.left_padded()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, output_attentions=True,
                         return_dict_in_generate=True, **GREEDY)
    B, L, h = *ids.shape, model.config.n_head
    assert len(out.attentions) == 3  # one tuple of layers per step: the prompt, then one query over a growing cache
    assert [a[0].shape for a in out.attentions] == [(B, h, L, L), (B, h, 1, L + 1), (B, h, 1, L + 2)]
    assert torch.equal(out.sequences, model.generate(ids, attention_mask=mask, max_new_tokens=3, **GREEDY))


def test_s4_configs_accept_output_attentions_and_the_models_return_none_unless_a_call_asks(s4_tester, tmp_path):
    """Every transformers config takes its common attributes, so code that sets `output_attentions` on any model
    (a pipeline, an evaluation harness, `from_pretrained(..., output_attentions=True)`) must not fail at configuration
    time: an S4 model, which has no attention, returns none, as Mamba does. A call that asks for them itself is
    refused at forward time, in one clear message."""
    from transformers import AutoModelForCausalLM

    ids = s4_tester.ids()
    for cls in s4_tester.classes():
        model = s4_tester.model(cls, output_attentions=True)
        out = model(ids)
        assert getattr(out, "attentions", None) is None
        torch.testing.assert_close(out[0], s4_tester.model(cls)(ids)[0], rtol=0, atol=0)
        with pytest.raises(ValueError, match="S4 models have no attention weights"):
            model(ids, output_attentions=True)
    s4_tester.model().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, output_attentions=True)
    assert loaded.config.output_attentions and loaded.generate(ids, max_new_tokens=2, **GREEDY).shape[1] == 11
    with pytest.raises(ValueError, match="S4 models have no attention weights"):
        s4_tester.model().generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True,
                                   **GREEDY)


# ---------------------------------------------------------------------------------------------------- precision


def fp32_module_names(model):
    """The modules whose parameters transformers keeps float32 (`_keep_in_fp32_modules_strict`, matched as it
    matches them: a name is a component of the module's dotted path)."""
    names = model._keep_in_fp32_modules_strict
    return {n for n, _ in model.named_modules() if names & set(n.split("."))}


def test_every_name_kept_in_float32_is_a_module_the_model_has(tester):
    """transformers' own check: a name in `_keep_in_fp32_modules_strict` that matches no module (`router` on an S4
    model without experts) is a contract error, so the list is made per config."""
    for cls in tester.classes():
        model = tester.model(cls)
        for name in model._keep_in_fp32_modules_strict:
            assert any(name in n.split(".") for n, _ in model.named_modules()), (cls.__name__, name)
        assert fp32_module_names(model)  # an S4 kernel or a router in every variant


@pytest.mark.parametrize("how", ["built under a bfloat16 default dtype", "from_pretrained(dtype=torch.bfloat16)"])
def test_the_modules_kept_in_float32_are_float32_however_the_model_is_made(tester, how, tmp_path):
    """Their float32 dtype is written in `__init__`: transformers 5.24 builds a model under the requested dtype and
    keeps only what `__init__` made float32 (before, the SSM parameters and the router came out bfloat16 there)."""
    for cls in tester.classes():
        if how.startswith("built"):
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = tester.model(cls)
            finally:
                torch.set_default_dtype(default)
        else:
            tester.model(cls).save_pretrained(tmp_path / cls.__name__)
            model = cls.from_pretrained(tmp_path / cls.__name__, dtype=torch.bfloat16)
        kept = fp32_module_names(model)
        for name, p in model.named_parameters():
            inside = any(name.startswith(m + ".") for m in kept)
            assert p.dtype == (torch.float32 if inside else torch.bfloat16), (cls.__name__, name, p.dtype)
        ids = tester.ids()
        with torch.no_grad():
            assert torch.isfinite(model(ids)[0].float()).all()


# ---------------------------------------------------------------------------------------------------- loss


def test_loss_keywords_shift_labels_and_num_items_in_batch_reach_the_loss(tester):
    model = tester.model()
    ids = tester.ids()
    shifted = F.pad(ids[:, 1:], (0, 1), value=-100)  # what a context-parallel trainer passes: targets already shifted
    with torch.no_grad():
        plain = model(ids, labels=ids)
        given = model(ids, labels=ids, shift_labels=shifted)
        other = model(ids, labels=ids, shift_labels=torch.full_like(ids, 5))
        summed = model(ids, labels=ids, num_items_in_batch=2 * (shifted != -100).sum())
    aux = plain.aux_loss if plain.aux_loss is not None else 0.0  # the router losses join the loss unscaled
    torch.testing.assert_close(given.loss, plain.loss)
    assert (other.loss - plain.loss).abs() > 1e-3  # the shifted targets are the ones used
    torch.testing.assert_close(summed.loss - aux, (plain.loss - aux) / 2)


# ---------------------------------------------------------------------------------------------------- caches


def test_use_cache_is_a_config_field_and_is_honoured(tester):
    config = tester.config()
    assert config.use_cache is True and config.to_dict()["use_cache"] is True
    prompt = tester.ids()
    cached, uncached = tester.model(), tester.model(use_cache=False)
    assert uncached.generation_config.use_cache is False
    sequences = {}
    for name, model in (("cached", cached), ("uncached", uncached)):
        lengths, hook = embedding_lengths(model)
        sequences[name] = model.generate(prompt, max_new_tokens=3, **GREEDY)
        hook.remove()
        L = prompt.shape[1]
        assert lengths == ([L, 1, 1] if name == "cached" else [L, L + 1, L + 2])  # re-reads everything without one
    assert torch.equal(sequences["cached"], sequences["uncached"])
    # A forward continuing from a cache returns the updated cache unless the config says no.
    with torch.no_grad():
        for model, returned in ((cached, True), (uncached, False)):
            cache = model(prompt[:, :5], use_cache=True).cache
            out = model(prompt[:, 5:], cache=cache)
            assert (out.cache is cache) is returned


def test_the_cache_goes_in_as_cache_or_its_old_name_and_comes_back_where_generate_reads_it(tester):
    """transformers 5.24 renamed `past_key_values` / `cache_params` to `cache`: the forward takes either name (old
    callers, and `generate()` before 5.24, pass the old one), the output returns it in the field the installed
    `generate()` carries from step to step, and `output.cache` reads it on every version."""
    from transformers.generation import utils as generation_utils

    model = tester.model()
    prompt = tester.ids()
    with torch.no_grad():
        first = model(prompt[:, :5], use_cache=True)
        field = "cache" if CACHE_RENAMED else tester.old_cache_name
        assert field in first and field in generation_utils.ALL_CACHE_NAMES  # what generate() carries
        full = model(prompt).logits[:, 5:]
        for name in ("cache", tester.old_cache_name):
            cache = model(prompt[:, :5], use_cache=True).cache
            out = model(prompt[:, 5:], **{name: cache})
            torch.testing.assert_close(out.logits, full, rtol=0, atol=1e-5)
            assert out.cache is cache and out.cache.get_seq_length() == prompt.shape[1]
        with pytest.raises(ValueError, match="cache was given twice"):
            model(prompt[:, 5:], cache=first.cache, **{tester.old_cache_name: first.cache})


def test_cached_and_uncached_greedy_generation_agree_on_a_left_padded_batch(tester):
    model = tester.model()
    ids, mask = tester.left_padded()
    a = model.generate(ids, attention_mask=mask, max_new_tokens=6, use_cache=True, **GREEDY)
    b = model.generate(ids, attention_mask=mask, max_new_tokens=6, use_cache=False, **GREEDY)
    assert torch.equal(a, b)


def test_continuing_generate_from_the_returned_cache_equals_one_uninterrupted_call(tester):
    """The cache knows how many positions it has read, so the second call feeds only the one token after them."""
    model = tester.model()
    ids, mask = tester.left_padded()
    kwargs = {**GREEDY, "return_dict_in_generate": True, "output_logits": True}
    once = model.generate(ids, attention_mask=mask, max_new_tokens=4, **kwargs)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=3, **kwargs)
    mask = torch.cat([mask, torch.ones(ids.shape[0], 3, dtype=mask.dtype)], dim=1)
    lengths, hook = embedding_lengths(model)
    returned = first.cache if CACHE_RENAMED else first.past_key_values
    second = model.generate(first.sequences, attention_mask=mask, max_new_tokens=1,
                            **{tester.generate_cache_name: returned}, **kwargs)
    hook.remove()
    assert lengths == [1]
    assert torch.equal(second.sequences, once.sequences)
    torch.testing.assert_close(second.logits[0], once.logits[3], rtol=0, atol=1e-5)


def test_cached_multi_token_forward_with_the_full_attention_mask_equals_one_forward(tester):
    model = tester.model()
    ids, mask = tester.left_padded()
    k = tester.pad + 2
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = model(ids[:, :k], attention_mask=mask[:, :k], use_cache=True).cache
        rest = model(ids[:, k:], attention_mask=mask, use_cache=True, cache=cache)  # mask: past + new
    torch.testing.assert_close(rest.logits, full[:, k:], rtol=0, atol=1e-5)
    assert rest.cache.get_seq_length() == ids.shape[1]


def test_s4_attention_mask_of_any_other_length_is_refused(s4_tester):
    model = s4_tester.model()
    ids = s4_tester.ids()
    with torch.no_grad():
        cache = model(ids[:, :4], use_cache=True).cache
        with pytest.raises(ValueError, match="attention_mask covers 7 positions: expected 5"):
            model(ids[:, 4:], attention_mask=torch.ones(ids.shape[0], 7, dtype=torch.long), cache=cache)


def test_s4_models_are_stateful_so_assisted_and_prompt_lookup_decoding_are_refused(s4_tester):
    model = s4_tester.model()
    assert model._is_stateful
    prompt = s4_tester.ids()
    with pytest.raises(ValueError, match="not supported with stateful models"):
        model.generate(prompt, max_new_tokens=3, prompt_lookup_num_tokens=2, **GREEDY)
    with pytest.raises(ValueError, match="not supported with stateful models"):
        model.generate(prompt, max_new_tokens=3, assistant_model=s4_tester.model(seed=1), **GREEDY)


def test_generate_from_inputs_embeds_equals_generate_from_ids(tester):
    model = tester.model()
    ids, mask = tester.left_padded()
    from_ids = model.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    from_embeds = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=4, **GREEDY)
    assert torch.equal(from_embeds, from_ids[:, ids.shape[1]:])  # generate() returns only the new tokens here


# ---------------------------------------------------------------------------------------------------- the usual ones


def test_save_and_from_pretrained_keep_the_config_and_the_outputs(tester, tmp_path):
    from transformers import AutoConfig

    ids = tester.ids()
    for cls in tester.classes():
        model = tester.model(cls, use_cache=False, output_hidden_states=True)
        path = tmp_path / cls.__name__
        model.save_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        assert config.use_cache is False and config.output_hidden_states is True
        loaded = cls.from_pretrained(path).eval()
        with torch.no_grad():
            assert_same(loaded(ids).to_tuple(), model(ids).to_tuple())


def test_each_row_of_a_batch_equals_that_row_alone(tester):
    ids = tester.ids()
    for cls in tester.classes():
        model = tester.model(cls)
        with torch.no_grad():
            batched = model(ids)[0]
            for i in range(ids.shape[0]):
                torch.testing.assert_close(model(ids[i : i + 1])[0], batched[i : i + 1], rtol=0, atol=1e-5)


def test_left_padding_leaves_the_real_positions_unchanged(tester):
    model = tester.model()
    ids, mask = tester.left_padded()
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits[0, tester.pad :]
        alone = model(ids[:1, tester.pad :]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- config keywords


@pytest.mark.parametrize(("config_class", "typo", "field_name"), [
    (S4Config, "kernal", "kernel"), (S4Config, "d_modle", "d_model"), (S4Config, "use_cahce", "use_cache"),
    (MoEConfig, "num_expert", "num_experts"), (MoEConfig, "n_heads", "n_head"),
])
def test_a_config_keyword_close_to_a_field_is_refused_with_a_suggestion(config_class, typo, field_name):
    with pytest.raises(ValueError, match=f"unknown keyword '{typo}'; did you mean '{field_name}'"):
        config_class(**{typo: 1})


@pytest.mark.parametrize("config_class", [S4Config, MoEConfig])
def test_transformers_own_config_keywords_and_unrelated_ones_are_accepted(config_class, tmp_path):
    known = {"torch_dtype": "float32", "num_labels": 3, "problem_type": "single_label_classification",
             "id2label": {0: "a", 1: "b", 2: "c"}, "label2id": {"a": 0, "b": 1, "c": 2}, "architectures": ["X"],
             "transformers_version": "5.0.0", "auto_map": {"AutoConfig": "x.Y"}, "name_or_path": "here",
             "use_cache": False, "hidden_size": 32, "sep_token_id": 2, "my_note": "kept"}
    config = config_class(**known)
    assert config.d_model == 32 and config.use_cache is False and config.num_labels == 3 and config.my_note == "kept"
    config.save_pretrained(tmp_path)
    loaded = config_class.from_pretrained(tmp_path).to_dict()
    assert loaded.pop("_name_or_path") != "here"  # the path it was read from; everything else as saved
    assert loaded == {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}


# transformers' shared model tests (`_config_zero_init`) set every config attribute whose name contains one of these
# to a small float, to make initialisation visible: such a name must hold a scalar initialisation scale.
INIT_SCALE_MARKS = ("_range", "_std", "initializer_factor", "layer_scale")


@pytest.mark.parametrize("config", [
    S4Config(d_input=2, input_mean=[0.5, -1.0], input_scale=[2.0, 0.25], num_labels=3, ffn="moe"),
    MoEConfig(),
], ids=["s4", "moe"])
def test_config_names_transformers_reads_as_init_scales_hold_scalars_and_zeroing_them_still_builds(config):
    named_like_scales = {k: v for k, v in config.to_dict().items() if any(m in k for m in INIT_SCALE_MARKS)}
    assert named_like_scales and all(isinstance(v, float) for v in named_like_scales.values()), named_like_scales
    zeroed = config.__class__(**{**config.to_dict(), **{k: 1e-10 for k in named_like_scales}})
    if isinstance(config, S4Config):
        model, inputs = S4ForSequenceClassification(zeroed), {"input_values": torch.ones(1, 4, 2)}
    else:
        model, inputs = MoEForCausalLM(zeroed), {"input_ids": torch.ones(1, 4, dtype=torch.long)}
    assert torch.isfinite(model.eval()(**inputs).logits).all()


def test_a_model_saved_with_the_old_input_std_name_loads_with_the_same_outputs(tmp_path):
    torch.manual_seed(0)
    model = S4ForSequenceClassification(S4Config(d_model=16, n_layer=1, d_state=8, d_input=2, num_labels=3,
                                                 input_mean=[0.5, -1.0], input_scale=[2.0, 0.25])).eval()
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    saved = json.loads(config_file.read_text())
    saved["input_std"] = saved.pop("input_scale")  # as a model folder written before the rename has it
    config_file.write_text(json.dumps(saved))
    loaded = S4ForSequenceClassification.from_pretrained(tmp_path).eval()
    assert loaded.config.input_scale == [2.0, 0.25] and "input_std" not in loaded.config.to_dict()
    x = torch.randn(2, 5, 2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_values=x).logits, model(input_values=x).logits)
    with pytest.raises(ValueError, match="old name of input_scale"):
        S4Config(d_input=1, input_mean=[0.0], input_scale=[1.0], input_std=[1.0])
