"""S4 model: numerics of the S4D layer against slow references, and the transformers contract (Auto classes,
save/from_pretrained, generate)."""

import math

import pytest
import torch

from s4accel import S4Config, S4ForCausalLM
from s4accel.models.modeling_s4 import S4DKernel, fft_causal_conv


def _seeded_model(config, seed=0):
    torch.manual_seed(seed)
    return S4ForCausalLM(config).eval()


# ---------------------------------------------------------------------------------------------------- numerics


def test_fft_conv_equals_direct_causal_convolution():
    torch.manual_seed(0)
    u, K = torch.randn(2, 3, 40, dtype=torch.float64), torch.randn(3, 40, dtype=torch.float64)
    direct = torch.zeros_like(u)
    for t in range(40):
        for s in range(t + 1):
            direct[..., t] += K[:, t - s] * u[..., s]
    torch.testing.assert_close(fft_causal_conv(u, K), direct, rtol=0, atol=1e-12)


@pytest.mark.parametrize("init", ["diag-lin", "diag-inv"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_convolution_equals_recurrence(init, dtype, tol):
    """The FFT-convolution path equals running the discrete SSM x_k = exp(dtA) x_{k-1} + u_k step by step."""
    torch.manual_seed(0)
    kernel = S4DKernel(S4Config(d_model=16, d_state=32, init=init))
    kernel.reset_parameters()
    kernel = kernel.to(dtype)
    u = torch.randn(2, 16, 200, dtype=dtype)
    y_conv = fft_causal_conv(u, kernel(200))
    y_rec = kernel.recurrence(u)
    scale = y_rec.abs().max()
    assert (y_conv - y_rec).abs().max() / scale <= tol


def test_s4d_init_follows_the_papers():
    config = S4Config(d_model=4, d_state=8, dt_min=1e-3, dt_max=1e-1)
    for init, expected in [("diag-lin", [math.pi * n for n in range(4)]),
                           ("diag-inv", [(8 / math.pi) * (8 / (2 * n + 1) - 1) for n in range(4)])]:
        model = _seeded_model(S4Config(**{**config.to_diff_dict(), "init": init, "n_layer": 1}))
        k = model.backbone.layers[0].layer.kernel
        torch.testing.assert_close(k.A_imag[0], torch.tensor(expected))
        torch.testing.assert_close(-torch.exp(k.log_A_real), torch.full((4, 4), -0.5))
        dt = torch.exp(k.log_dt)
        assert ((dt >= 1e-3) & (dt <= 1e-1)).all()


def test_layer_is_causal():
    """Perturbing the input at t0 leaves every output before t0 unchanged (the FFT is long enough: no wrap-around).
    In float64 so that the only change before t0 is FFT rounding (~1e-16), far below a wrap-around's O(1)."""
    model = _seeded_model(S4Config(d_model=16, n_layer=2, d_state=8, vocab_size=20)).double()
    ids = torch.randint(3, 20, (1, 64))
    t0 = 40
    changed = ids.clone()
    changed[0, t0] = (ids[0, t0] + 1) % 20
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert (a[:, :t0] - b[:, :t0]).abs().max() < 1e-12
    assert (a[:, t0:] - b[:, t0:]).abs().max() > 1e-4


def test_kernel_and_fft_stay_fp32_under_autocast():
    model = _seeded_model(S4Config(d_model=16, n_layer=1, d_state=8, vocab_size=20))
    seen = []
    model.backbone.layers[0].layer.kernel.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    ids = torch.randint(3, 20, (2, 32))
    with torch.no_grad():
        ref = model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(ids).logits
    assert seen == [torch.float32, torch.float32]
    assert torch.isfinite(low).all()
    assert (low.float() - ref).abs().max() < 0.1


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
    out_masked = block(x, mask)
    out_plain = block(x[:, 2:])
    torch.testing.assert_close(out_masked[:, 2:], out_plain, rtol=1e-5, atol=1e-5)
