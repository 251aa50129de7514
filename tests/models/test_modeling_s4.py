"""S4 models: the transformers contract (Auto classes, save/from_pretrained, generate with the recurrent cache,
sequence classification). Kernel numerics are in test_s4_numerics.py."""

import math

import pytest
from huggingface_hub.errors import StrictDataclassError  # the config classes are strict dataclasses
import torch

from s4accel import S4Config, S4ForCausalLM


def _seeded_model(config, seed=0):
    torch.manual_seed(seed)
    return S4ForCausalLM(config).eval()


def test_kernel_and_fft_stay_fp32_under_autocast():
    model = _seeded_model(S4Config(d_model=16, n_layer=1, d_state=8, vocab_size=20))
    seen = []
    model.backbone.layers[0].layer.kernel.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    ids = torch.randint(3, 20, (2, 32))
    with torch.no_grad():
        ref = model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(ids).logits
    assert seen == [torch.float32, torch.float32]  # the kernel (c, H, L) in float32 under bf16 autocast
    assert torch.isfinite(low).all()
    assert (low.float() - ref).abs().max() < 0.1


@pytest.mark.parametrize("family", ["s4", "moe"])
def test_loaded_in_half_precision_the_ssm_and_the_router_stay_float32_and_the_model_generates(family, tmp_path):
    """`from_pretrained(dtype=torch.bfloat16)` keeps what half precision breaks in float32 (transformers'
    `_keep_in_fp32_modules_strict`): S4's Im A reaches ~97 at d_state 64, where bfloat16 steps by 0.5."""
    from transformers import AutoModelForCausalLM

    from s4accel import MoEConfig, MoEForCausalLM

    torch.manual_seed(0)
    model = (S4ForCausalLM(S4Config(d_model=32, n_layer=2, d_state=64, vocab_size=40, ffn="moe", num_experts=4,
                                    d_ffn=32)) if family == "s4" else
             MoEForCausalLM(MoEConfig(vocab_size=40, d_model=32, n_layer=2, n_head=4, d_ffn=32, num_experts=4)))
    model.save_pretrained(tmp_path)
    half = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    full = dict(model.named_parameters())
    kept = {n for n, p in half.named_parameters() if p.dtype == torch.float32}
    assert kept == {n for n in full if ".kernel." in n or ".router." in n} and kept
    assert all(torch.equal(p, full[n]) for n, p in half.named_parameters() if n in kept)  # exact, not rounded
    assert all(p.dtype == torch.bfloat16 for n, p in half.named_parameters() if n not in kept)
    ids = torch.randint(3, 40, (2, 16))
    with torch.no_grad():
        assert (half(ids).logits.float() - model(ids).logits).abs().max() < 0.05
    assert half.generate(ids[:, :4], max_new_tokens=4, do_sample=False).shape == (2, 8)


# ---------------------------------------------------------------------------------------------------- LM contract


def test_untrained_loss_is_log_vocab_and_shapes(tiny_config):
    model = _seeded_model(tiny_config)
    ids = torch.randint(0, 50, (4, 33))
    out = model(ids, labels=ids, output_hidden_states=True)
    assert out.logits.shape == (4, 33, 50)
    assert len(out.hidden_states) == tiny_config.n_layer + 1
    assert abs(out.loss.item() - math.log(50)) < 0.05


def test_loss_with_num_items_in_batch_is_a_sum_over_that_count(tiny_config):
    model = _seeded_model(tiny_config)
    ids = torch.randint(0, 50, (2, 9))
    labels = ids.clone()
    labels[0, 5:] = -100  # ragged: 4 + 8 real targets after the shift
    mean = model(ids, labels=labels).loss
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(24)).loss
    torch.testing.assert_close(summed, mean * 12 / 24)


def test_backward_reaches_every_parameter(tiny_config):
    model = _seeded_model(tiny_config).train()
    ids = torch.randint(0, 50, (2, 16))
    model(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_save_and_auto_from_pretrained_give_identical_logits(tiny_config, tmp_path):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    model = _seeded_model(tiny_config)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert not list(tmp_path.glob("*.bin")) and not list(tmp_path.glob("*.pt"))
    assert isinstance(AutoConfig.from_pretrained(tmp_path), S4Config)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is S4ForCausalLM
    assert loaded.lm_head.weight.data_ptr() == loaded.backbone.embeddings.weight.data_ptr()  # still tied
    ids = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    backbone = AutoModel.from_pretrained(tmp_path)
    assert type(backbone).__name__ == "S4Model"


def test_generate_greedy_with_and_without_cache_flag(tiny_config):
    model = _seeded_model(tiny_config)
    prompt = torch.randint(3, 50, (2, 6))
    a = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
    b = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    assert a.shape == (2, 18)
    assert torch.equal(a, b)
    # Each new token is the argmax of a full forward over the sequence so far.
    with torch.no_grad():
        step = model(a[:, :-1]).logits[:, -1].argmax(-1)
    assert torch.equal(step, a[:, -1])


def test_left_padding_does_not_change_the_prediction(tiny_config):
    """Padded positions feed zeros into every SSM, so a left-padded prompt leaves the same state."""
    model = _seeded_model(tiny_config)
    prompt = torch.randint(3, 50, (1, 7))
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = model(prompt).logits[:, -1]
        left = model(padded, attention_mask=mask).logits[:, -1]
    torch.testing.assert_close(left, plain, rtol=1e-5, atol=1e-5)


def test_block_mask_zeroes_ssm_input(tiny_config):
    block = S4ForCausalLM(tiny_config).backbone.layers[0]  # initialised (a bare S4Block holds torch.empty memory)
    x = torch.randn(1, 5, 32)
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    out_masked, _, _ = block(x, mask)
    out_plain, _, _ = block(x[:, 2:])
    torch.testing.assert_close(out_masked[:, 2:], out_plain, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ recurrent decoding


@pytest.fixture(params=["s4d", "s4"])
def lm(request):
    torch.manual_seed(0)
    config = S4Config(d_model=32, n_layer=2, d_state=16, vocab_size=50, kernel=request.param, l_max=64)
    return S4ForCausalLM(config).eval()


def test_cached_generation_decodes_one_token_per_forward_and_matches_full_reforward(lm):
    lengths = []
    hook = lm.backbone.embeddings.register_forward_hook(lambda m, i, out: lengths.append(out.shape[1]))
    prompt = torch.randint(3, 50, (2, 9))
    cached = lm.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=True)
    assert lengths == [9] + [1] * 19  # prefill by convolution, then one position per step
    hook.remove()
    full = lm.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=False)
    assert torch.equal(cached, full)


def test_batched_prompts_of_different_lengths_equal_one_by_one(lm):
    short, long = torch.randint(3, 50, (1, 4)), torch.randint(3, 50, (1, 11))
    batch = torch.cat([torch.cat([torch.zeros(1, 7, dtype=torch.long), short], 1), long])  # left-padded
    mask = (torch.arange(11) >= torch.tensor([[7], [0]])).long()
    out = lm.generate(batch, attention_mask=mask, max_new_tokens=15, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0, 11:], lm.generate(short, max_new_tokens=15, do_sample=False)[0, 4:])
    assert torch.equal(out[1, 11:], lm.generate(long, max_new_tokens=15, do_sample=False)[0, 11:])


def test_sampling_with_a_seed_is_reproducible(lm):
    prompt = torch.randint(3, 50, (1, 5))

    def sample(seed):
        torch.manual_seed(seed)
        return lm.generate(prompt, max_new_tokens=25, do_sample=True, temperature=1.0, top_k=0)

    a, b, c = sample(1), sample(1), sample(2)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_causal_lm_refuses_bidirectional_and_input_values():
    with pytest.raises(ValueError, match="bidirectional"):
        S4ForCausalLM(S4Config(d_model=8, n_layer=1, d_state=4, bidirectional=True))
    with pytest.raises(ValueError, match="d_input"):
        S4ForCausalLM(S4Config(d_model=8, n_layer=1, d_state=4, d_input=3))


@pytest.mark.parametrize(("fields", "message"), [
    ({"kernel": "s4", "init": "diag-lin"}, "init for kernel=s4"), ({"kernel": "s5"}, "kernel must be one of"),
    ({"disc": "euler"}, "disc must be one of"), ({"n_ssm": 3}, "n_ssm must divide"), ({"norm": "group"}, "norm"),
    ({"d_state": 7}, "even"),
])
def test_config_rejects_bad_values(fields, message):
    with pytest.raises(StrictDataclassError, match=message):
        S4Config(d_model=8, **fields)


# ---------------------------------------------------------------------------------------------------- classification


def _classifier(seed=0, **fields):
    from s4accel import S4ForSequenceClassification

    torch.manual_seed(seed)
    config = S4Config(**{"d_input": 3, "d_model": 16, "n_layer": 2, "d_state": 8, "num_labels": 4, **fields})
    return S4ForSequenceClassification(config).eval()


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_classifier_pooling_ignores_right_padding(pooling):
    model = _classifier(pooling=pooling)
    x = torch.randn(1, 12, 3)
    padded = torch.cat([x, torch.randn(1, 5, 3)], dim=1)  # garbage after the real steps
    mask = torch.cat([torch.ones(1, 12), torch.zeros(1, 5)], dim=1).long()
    with torch.no_grad():
        plain = model(input_values=x).logits
        masked = model(input_values=padded, attention_mask=mask).logits
    assert plain.shape == (1, 4)
    torch.testing.assert_close(masked, plain, rtol=1e-5, atol=1e-5)


def test_classifier_losses_follow_problem_type():
    x = torch.randn(5, 10, 3)
    model = _classifier()
    labels = torch.tensor([0, 3, 1, 2, 0])
    out = model(input_values=x, labels=labels)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))
    assert model.config.problem_type == "single_label_classification"
    reg = _classifier(num_labels=1)
    targets = torch.randn(5)
    out = reg(input_values=x, labels=targets)
    assert reg.config.problem_type == "regression"
    torch.testing.assert_close(out.loss, torch.nn.functional.mse_loss(out.logits[:, 0], targets))


def test_bidirectional_classifier_sees_the_whole_sequence():
    model = _classifier(bidirectional=True, pooling="last")
    x = torch.randn(1, 10, 3)
    changed = x.clone()
    changed[0, -1] += 1.0
    with torch.no_grad():
        h1 = model.backbone(input_values=x).last_hidden_state
        h2 = model.backbone(input_values=changed).last_hidden_state
    assert (h1[:, 0] - h2[:, 0]).abs().max() > 1e-4  # the first step reacts to a change at the end


@pytest.mark.parametrize("kernel", ["s4d", "s4"])
def test_classifier_auto_class_round_trip(tmp_path, kernel):
    from transformers import AutoModelForSequenceClassification

    model = _classifier(kernel=kernel, norm="batch", prenorm=False, l_max=16)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    x = torch.randn(2, 16, 3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_values=x).logits, model(input_values=x).logits, rtol=0, atol=0)
