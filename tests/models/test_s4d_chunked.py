"""The chunked S4D convolution (`s4d_chunked.py`, the GPU path) against its slow references: the FFT convolution of
the kernel and the SSM run step by step, values and every gradient, in float64, float32 and bfloat16; the whole model
on either path (documents, carried state, generation); the path each device gets; `torch.compile` without complex
code. GPU-only checks are marked `gpu`."""

import warnings

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError  # the config classes are strict dataclasses

from s4accel import S4Config, S4ForCausalLM
from s4accel.models import s4d_chunked, s4d_fused
from s4accel.models.modeling_s4 import S4DKernel, S4Layer, conv_plan, fft_conv
from s4accel.models.s4d_chunked import (chunked_conv, from_channels_first, project_channels_first,
                                        to_channels_first, toeplitz, transpose_into)

S4D_VARIANTS = [(disc, init) for disc in ("zoh", "bilinear") for init in ("diag-lin", "diag-inv", "diag-legs",
                                                                         "diag-real")]
# Tolerances, relative to the reference's largest value. bfloat16: the inputs, the Toeplitz taps, the powers of dA and
# the states are rounded to 8 bits of mantissa for the products (accumulated in float32): about what rounding the
# input alone costs the float32 FFT path (measured: 3.3e-3 of the largest value, against 7e-3 for the chunked path,
# at H 64, L 4096, N 64).
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def kernel(disc="zoh", init="diag-lin", H=6, N=8, bidirectional=False, seed=0):
    torch.manual_seed(seed)
    k = S4DKernel(S4Config(d_model=H, d_state=N, disc=disc, init=init, dt_min=0.01, dt_max=0.5,
                           bidirectional=bidirectional))
    k.reset_parameters()
    return k.double()


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def chunked(k, u, D, T, dtype, direction=0, shift=0):
    log_dA, (Cr, Ci) = k.discretize_pairs()
    return chunked_conv(u, log_dA, (Cr[direction], Ci[direction]), D, T, dtype, shift)


@pytest.mark.parametrize(("disc", "init"), S4D_VARIANTS)
def test_real_pair_discretization_equals_the_complex_one(disc, init):
    k = kernel(disc, init)
    log_dA, C_tilde = k.discretize()
    (ar, ai), (cr, ci) = k.discretize_pairs()
    # dA itself (the logarithm's branch may differ by 2 pi i: every power is the same)
    torch.testing.assert_close(torch.exp(torch.complex(ar, ai)), torch.exp(log_dA), rtol=0, atol=1e-14)
    torch.testing.assert_close(torch.complex(cr, ci), C_tilde, rtol=0, atol=1e-14)


@pytest.mark.parametrize(("disc", "init"), S4D_VARIANTS)
@pytest.mark.parametrize("T", [16, 32, 48, 112], ids=lambda t: f"T{t}")
def test_chunked_equals_the_fft_convolution_in_float64(disc, init, T):
    """Chunks of 16 and 32 steps divide L = 96 (6 and 3 chunks), 48 two of them, 112 covers it with padding (one
    chunk): the convolution with its D skip, and the anti-causal half of a bidirectional layer."""
    k = kernel(disc, init, bidirectional=True)
    u, D = torch.randn(3, 96, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    K = k(96)
    ref = fft_conv(u.transpose(1, 2), K[:1], D).transpose(1, 2)
    assert rel(chunked(k, u, D, T, torch.float64), ref) < TOL[torch.float64]
    both = fft_conv(u.transpose(1, 2), K, D).transpose(1, 2)
    anti = chunked(k, u.flip(1), None, T, torch.float64, direction=1, shift=1).flip(1)
    assert rel(chunked(k, u, D, T, torch.float64) + anti, both) < TOL[torch.float64]


def test_chunked_equals_the_recurrence():
    """The SSM run one step at a time (x_k = dA x_(k-1) + u_k, y_k = 2 Re(C~ x_k)): with 5 chunks and padding."""
    k = kernel("zoh", "diag-inv")
    u = torch.randn(2, 70, 6, dtype=torch.float64)
    y_rec, _ = k.recurrence(u.transpose(1, 2))
    assert rel(chunked(k, u, None, 16, torch.float64), y_rec.transpose(1, 2)) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("disc", ["zoh", "bilinear"])
def test_chunked_values_and_gradients_equal_the_float64_reference(dtype, disc):
    """Values, the input's gradient and every SSM parameter's (log_dt, log_A_real, A_imag, C, D), at N 64 and 8
    chunks, each within the dtype's tolerance of the float64 FFT path."""
    H, L = 16, 512
    torch.manual_seed(1)
    layers = {}
    for name in ("ref", "fast"):
        torch.manual_seed(1)
        layers[name] = S4Layer(S4Config(d_model=H, d_state=64, disc=disc, conv_path="fft" if name == "ref" else
                                        "chunked", conv_chunk=64)).double()
        layers[name].kernel.reset_parameters()
        torch.nn.init.normal_(layers[name].D)
    layers["fast"].load_state_dict(layers["ref"].state_dict())
    u = torch.randn(4, L, H, dtype=torch.float64)
    grad_out = torch.randn(4, L, H, dtype=torch.float64)
    results = {}
    for name, layer in layers.items():
        x = (u if name == "ref" else u.to(dtype)).clone().requires_grad_(True)
        params = dict(layer.kernel.named_parameters()) | {"D": layer.D}
        if name == "fast":  # the chunked path alone, in `dtype`
            log_dA, (Cr, Ci) = layer.kernel.discretize_pairs()
            y = chunked_conv(x, log_dA, (Cr[0], Ci[0]), layer.D.double(), 64, dtype)
        else:
            y = fft_conv(x.transpose(1, 2), layer.kernel(L), layer.D).transpose(1, 2)
        grads = torch.autograd.grad(y, [x, *params.values()], grad_out.to(y.dtype))
        results[name] = {"y": y, "u": grads[0], **dict(zip(params, grads[1:]))}
    for key, ref in results["ref"].items():
        assert rel(results["fast"][key], ref) < TOL[dtype], key


def generation_inputs(dtype, c=1, H=5, n=4, seed=0):
    """dt (H, 1), A and C as pairs, D: as a layer hands them to `discretize_pairs` (dt from 1e-3 to 0.5, Re A < 0)."""
    torch.manual_seed(seed)
    dt = torch.exp(torch.empty(H, 1, dtype=torch.float64).uniform_(-7, -0.7))
    Ar, Ai = -torch.rand(H, n, dtype=torch.float64) - 0.05, 4 * torch.randn(H, n, dtype=torch.float64)
    Cr, Ci = torch.randn(c, H, n, dtype=torch.float64), torch.randn(c, H, n, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (dt, Ar, Ai, Cr, Ci, torch.randn(H, dtype=torch.float64))]


def generation(fast, dt, Ar, Ai, Cr, Ci, D, zoh=True, T=8, shift=0):
    """discretize + the chunk matrices, the hand-written nodes (`fast`) or the plain-autograd references."""
    discretize = s4d_chunked.discretize_pairs if fast else s4d_chunked.reference_discretize_pairs
    matrices = s4d_chunked.matrices if fast else s4d_chunked.reference_matrices
    log_dA, (cr, ci) = discretize(dt, (Ar, Ai), (Cr, Ci), zoh)
    return (*log_dA, cr, ci, *matrices(log_dA, (cr[shift], ci[shift]), D if shift == 0 else None, T, shift))


@pytest.mark.parametrize("zoh", [True, False], ids=["zoh", "bilinear"])
@pytest.mark.parametrize("shift", [0, 1], ids=["causal", "anti-causal"])
def test_the_hand_written_backwards_of_the_kernel_generation_are_exact(zoh, shift):
    """`discretize_pairs` and `matrices` (one autograd node each, their chain rule written out) against finite
    differences in float64 (gradcheck), and against their plain-autograd references: the same values (the
    discretization bit for bit) and, in float32, gradients within float32 rounding of the float64 ones. Two kernels
    (a bidirectional layer), the second read strictly causally without D."""
    inputs = generation_inputs(torch.float64, c=2)
    assert torch.autograd.gradcheck(lambda *a: generation(True, *a, zoh=zoh, shift=shift), inputs)
    fast, ref = generation(True, *inputs, zoh=zoh, shift=shift), generation(False, *inputs, zoh=zoh, shift=shift)
    for i, (a, b) in enumerate(zip(fast, ref)):
        assert torch.equal(a, b) if i < 4 else rel(a, b) < 1e-14, i
    want = torch.autograd.grad(ref, inputs, [torch.ones_like(t) for t in ref], allow_unused=True)
    low = generation_inputs(torch.float32, c=2)
    out = generation(True, *low, zoh=zoh, shift=shift)
    got = torch.autograd.grad(out, low, [torch.ones_like(t) for t in out], allow_unused=True)
    for name, g, w in zip(["dt", "A.real", "A.imag", "C.real", "C.imag", "D"], got, want):
        assert (g is None) == (w is None) and (g is None or rel(g, w) < 1e-5), name


@pytest.mark.parametrize("zoh", [True, False], ids=["zoh", "bilinear"])
def test_second_derivatives_through_the_kernel_generation_equal_plain_autograds(zoh):
    """A gradient of a gradient (a gradient penalty, meta-learning): the hand-written backwards read tensors saved
    outside the graph, so under `create_graph` they take the reference's graph; the result equals the plain-autograd
    reference's, and gradgradcheck (finite differences of the gradient) passes. Inputs that need no gradient (dt here)
    get none."""
    inputs = generation_inputs(torch.float64, c=2)
    assert torch.autograd.gradgradcheck(lambda *a: generation(True, *a, zoh=zoh), inputs)
    results = []
    for fast in (True, False):
        out = generation(fast, *inputs, zoh=zoh)
        grads = torch.autograd.grad(sum((t * t).sum() for t in out), inputs, create_graph=True)
        penalty = sum((g * g).sum() for g in grads)
        results.append(torch.autograd.grad(penalty, inputs))
    for name, a, b in zip(["dt", "A.real", "A.imag", "C.real", "C.imag", "D"], *results):
        assert rel(a, b) < 1e-12, name
    frozen = [inputs[0].detach(), *inputs[1:]]
    out = generation(True, *frozen, zoh=zoh)
    grads = torch.autograd.grad(sum((t * t).sum() for t in out), frozen[1:], create_graph=True)
    assert all(g.requires_grad for g in grads)


@pytest.mark.parametrize("where", ["autocast", "bf16-model"])
def test_under_autocast_or_in_bfloat16_the_chunked_path_computes_in_bfloat16(where):
    """A float32 model under bf16 autocast, and a model loaded in bfloat16: the chunked path's products run in
    bfloat16 (its output is bfloat16), within the bfloat16 tolerance of the FFT path of the same model, which
    convolves in float32."""
    torch.manual_seed(0)
    config = S4Config(vocab_size=50, d_model=32, n_layer=2, d_state=16, conv_path="chunked", conv_chunk=32)
    model = S4ForCausalLM(config).eval()
    if where == "bf16-model":
        model = model.to(torch.bfloat16)
    ids = torch.randint(3, 50, (2, 100))
    seen = []
    model.backbone.layers[0].layer.register_forward_hook(lambda m, i, out: seen.append(out[0].dtype))
    logits = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "autocast"):
        for path in ("fft", "chunked"):
            config.conv_path = path
            logits[path] = model(ids).logits
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert rel(logits["chunked"], logits["fft"]) < 3e-2


@pytest.mark.parametrize("bidirectional", [False, True])
def test_the_model_on_either_path_gives_the_same_logits_and_gradients(bidirectional):
    from s4accel import S4ForSequenceClassification

    grads = {}
    for path in ("fft", "chunked"):
        torch.manual_seed(0)
        config = S4Config(vocab_size=50, d_model=32, n_layer=2, d_state=16, conv_path=path, conv_chunk=16,
                          bidirectional=bidirectional, num_labels=3)
        model = (S4ForSequenceClassification if bidirectional else S4ForCausalLM)(config).double()
        ids = torch.randint(3, 50, (3, 75))
        out = model(ids, labels=torch.tensor([0, 2, 1]) if bidirectional else ids)
        out.loss.backward()
        grads[path] = {n: p.grad for n, p in model.named_parameters()} | {"logits": out.logits}
    for name, g in grads["fft"].items():
        assert rel(grads["chunked"][name], g) < 1e-10, name


# The fused kernels (s4d_fused.py) compute the chunked form too: these model-level checks run on both paths (the fused
# one in Triton's interpreter without a GPU: tests/conftest.py).
needs_triton = pytest.mark.skipif(s4d_fused.triton is None or not (torch.cuda.is_available() or s4d_fused.INTERPRETED),
                                  reason="needs Triton (on a GPU, or its interpreter)")
PATHS = ["chunked", pytest.param("fused", marks=needs_triton)]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("path", PATHS)
def test_packed_documents_on_the_chunked_path_stay_apart_bit_for_bit(path):
    """Each document in its own zero-padded bucket row (one chunk, or several for a long one): changing one leaves
    every logit of the next bit-identical, and each document's logits equal its own."""
    torch.manual_seed(0)
    model = S4ForCausalLM(S4Config(vocab_size=50, d_model=8, n_layer=2, d_state=32, conv_path=path,
                                   conv_chunk=16)).eval()
    lengths = [7, 40, 5, 44]
    ids = torch.randint(3, 50, (2, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
    other = ids.clone()
    other[:, lengths[0] - 1] = (other[:, lengths[0] - 1] + 1) % 50
    with torch.no_grad():
        logits, changed = (model(input_ids=x, position_ids=positions).logits for x in (ids, other))
        alone = torch.cat([model(input_ids=part).logits for part in ids.split(lengths, dim=1)], 1)
    assert torch.equal(logits[:, lengths[0]:], changed[:, lengths[0]:])
    assert not torch.equal(logits[:, :lengths[0]], changed[:, :lengths[0]])
    assert rel(logits, alone) < 1e-5


@pytest.mark.parametrize("path", PATHS)
def test_carried_state_and_cached_generation_agree_with_the_chunked_path(path):
    """TBPTT chunks (each from the last one's state) equal the whole sequence, and greedy generation from the
    recurrent cache equals re-reading the whole sequence, both with the chunked convolution for every read (in
    float64 on the matmul path; the fused kernels take float32 at most)."""
    torch.manual_seed(0)
    model = S4ForCausalLM(S4Config(vocab_size=20, d_model=8, n_layer=2, d_state=32, conv_path=path,
                                   conv_chunk=16)).eval()
    model = model.double() if path == "chunked" else model
    ids = torch.randint(3, 20, (2, 70))
    with torch.no_grad():
        whole = model(ids).logits
        cache, parts = None, []
        for part in ids.split(33, dim=1):
            out = model(part, cache=cache, use_cache=True)
            cache, parts = out.cache, parts + [out.logits]
    assert rel(torch.cat(parts, 1), whole) < (1e-10 if path == "chunked" else 1e-5)
    model = model.float()
    prompt = torch.randint(3, 20, (2, 40))
    cached = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True)
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False))


def test_the_path_is_chosen_by_device_and_dtype_and_a_key_forces_one():
    auto = S4Config()
    assert conv_plan(auto, "cpu", torch.float32, None).path == "fft"
    assert conv_plan(auto, "cpu", torch.float32, torch.bfloat16).path == "fft"
    auto = S4Config(conv_path="chunked")  # on CUDA auto may take the fused kernel (test_s4d_fused.py)
    assert conv_plan(auto, "cuda", torch.float32, None).path == "chunked"
    assert conv_plan(auto, "cuda", torch.float32, None, L=1000) == ("chunked", 128, torch.float32)
    assert conv_plan(auto, "cuda", torch.float32, torch.bfloat16, L=4096).chunk == 256
    assert conv_plan(auto, "cuda", torch.float32, torch.bfloat16, L=16384).chunk == 512
    assert conv_plan(auto, "cuda", torch.float32, None, L=40).chunk == 48  # a short input: one chunk
    assert conv_plan(S4Config(kernel="s4"), "cuda", torch.float32, None).path == "fft"  # DPLR: FFT only
    forced = S4Config(conv_path="chunked", conv_chunk=64)
    assert conv_plan(forced, "cpu", torch.float32, torch.bfloat16) == ("chunked", 64, torch.bfloat16)
    assert conv_plan(forced, "cpu", torch.bfloat16, None).dtype == torch.bfloat16
    assert conv_plan(S4Config(conv_path="fft"), "cuda", torch.float32, torch.bfloat16).path == "fft"
    with pytest.raises(StrictDataclassError, match="needs kernel=.s4d."):
        S4Config(kernel="s4", conv_path="chunked")
    with pytest.raises(StrictDataclassError, match="conv_chunk must be a multiple of 16"):
        S4Config(conv_chunk=40)
    with pytest.raises(StrictDataclassError, match="conv_path must be one of"):
        S4Config(conv_path="flash")


def test_the_layout_changes_are_exact_and_carry_gradients_back():
    """(B, L, H) -> (H, B, Lp) zero-padded, and back, with casts; float64 gradcheck of both."""
    u = torch.randn(2, 13, 5, dtype=torch.float64, requires_grad=True)
    x = to_channels_first(u, torch.float64, 16)
    assert torch.equal(x[..., :13], u.detach().permute(2, 0, 1)) and not x[..., 13:].any()
    assert torch.equal(from_channels_first(x, 13), u.detach())
    assert to_channels_first(u.float(), torch.bfloat16, 16).dtype == torch.bfloat16
    assert torch.autograd.gradcheck(lambda v: to_channels_first(v, torch.float64, 16), (u,))
    assert torch.autograd.gradcheck(lambda v: from_channels_first(v, 13), (x.detach().requires_grad_(True),))


def test_the_channels_first_projection_equals_a_linear_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 10).double()
    x = torch.randn(6, 30, dtype=torch.float64, requires_grad=True)  # (K, M) channels first
    out = project_channels_first(x, linear.weight, linear.bias, torch.float64)
    torch.testing.assert_close(out, linear(x.t()), rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(lambda v, w, b: project_channels_first(v, w, b, torch.float64),
                                    (x, linear.weight, linear.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the layer calls it under autocast: bf16 like a Linear
        low = project_channels_first(x.float(), linear.weight.float(), linear.bias.float(), torch.bfloat16)
        ref = torch.nn.functional.linear(x.float().t(), linear.weight.float(), linear.bias.float())
    assert low.dtype == torch.bfloat16 and torch.equal(low, ref)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_the_projection_with_its_glu_in_one_kernel_each_way_equals_the_float64_glu_of_the_projection(dtype, bias):
    """`project_glu_channels_first` (the layer's projection and GLU on CUDA, eager) against PyTorch's GLU of the
    projection in float64: the output and the gradients of the input, the weight and the bias, over shapes that fill
    no kernel block exactly; float32 to its rounding, bfloat16 as close as PyTorch's own bfloat16 GLU (both round
    the projection and the GLU once to bfloat16)."""
    from s4accel.models.s4d_chunked import project_glu_channels_first

    torch.manual_seed(0)
    K, M, H = 12, 70, 40  # (a block is 32 rows and 128 columns: GLU_BLOCK)
    x = torch.randn(K, M, dtype=torch.float64, requires_grad=True)
    linear = torch.nn.Linear(K, 2 * H, bias=bias).double()
    params = [x, linear.weight] + ([linear.bias] if bias else [])
    g = torch.randn(M, H, dtype=torch.float64)
    ref = torch.nn.functional.glu(project_channels_first(x, linear.weight, linear.bias, torch.float64), -1)
    ref_grads = torch.autograd.grad(ref, params, g)
    ours = [p.detach().float().to(DEVICE).requires_grad_() for p in params]
    out = project_glu_channels_first(ours[0], ours[1], ours[2] if bias else None, dtype)
    assert out.dtype == dtype and out.shape == (M, H)
    assert type(out.grad_fn).__name__ == "_ProjectGLUChannelsFirstBackward"
    grads = torch.autograd.grad(out, ours, g.to(DEVICE, dtype))
    torch_ = [p.detach().clone().requires_grad_() for p in ours]  # PyTorch's operators in the same dtype
    plain = torch.nn.functional.glu(project_channels_first(torch_[0], torch_[1], torch_[2] if bias else None, dtype),
                                    -1)
    plain_grads = torch.autograd.grad(plain, torch_, g.to(DEVICE, dtype))
    for got, want, theirs in zip((out, *grads), (ref, *ref_grads), (plain, *plain_grads)):
        limit = 1e-6 if dtype == torch.float32 else 2 * rel(theirs.cpu(), want) + 1e-3
        assert rel(got.cpu(), want) < limit, (rel(got.cpu(), want), rel(theirs.cpu(), want))


def test_the_toeplitz_matrices_and_their_gradient_along_the_diagonals():
    taps = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    for shift in (0, 1):
        M = toeplitz(taps, shift, torch.float64)
        T = 7 + shift
        for j in range(T):
            for i in range(T):
                want = taps[:, i - j - shift] if 0 <= i - j - shift < 7 else torch.zeros(3, dtype=torch.float64)
                assert torch.equal(M[:, j, i], want)
        assert torch.autograd.gradcheck(lambda t: toeplitz(t, shift, torch.float64), (taps,))


def test_an_adapted_projection_keeps_its_adapter_on_the_chunked_path():
    """A LoRA adapter (PEFT) on the output projection: the channels-first fast path reads a plain Linear's weight, so
    an adapted one takes the other layout, and both paths give the adapted model's logits."""
    peft = pytest.importorskip("peft")
    logits = {}
    for path in ("fft", "chunked"):
        torch.manual_seed(0)
        model = S4ForCausalLM(S4Config(vocab_size=50, d_model=32, n_layer=2, d_state=16, conv_path=path,
                                       conv_chunk=16))
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["output_linear"],
                                                           init_lora_weights=False))
        ids = torch.randint(3, 50, (2, 40))
        with torch.no_grad():
            logits[path] = model(input_ids=ids).logits
            model.disable_adapter_layers()
            plain = model(input_ids=ids).logits
    assert not torch.allclose(logits["chunked"], plain, atol=1e-3)  # the adapter changes the output
    assert rel(logits["chunked"], logits["fft"]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("path", ["chunked", "fused"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidirectional"])
def test_the_chunked_layer_compiles_as_one_graph_without_complex_code(path, bidirectional):
    """`torch.compile(fullgraph=True)` of the layer on the chunked and the fused path (the kernels in Triton's
    interpreter here): no graph break, no "complex operators" fallback, and the compiled forward and backward equal
    eager's, every parameter's gradient included (the compiled step writes the kernel's gradients its own way)."""
    torch.manual_seed(0)
    layer = S4Layer(S4Config(d_model=16, d_state=32, conv_path=path, conv_chunk=16, bidirectional=bidirectional))
    layer.kernel.reset_parameters()
    torch.nn.init.normal_(layer.D)
    u = torch.randn(2, 64, 16, requires_grad=True)
    g = torch.randn(2, 64, 16)
    y, _ = layer(u)
    (y * g).sum().backward()
    eager = [u.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
    u.grad = None
    layer.zero_grad()
    compiled = torch.compile(layer, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yc, _ = compiled(u)
        (yc * g).sum().backward()
    assert not [w for w in caught if "complex" in str(w.message)]
    torch.testing.assert_close(yc, y, rtol=1e-5, atol=1e-5)
    for a, b in zip([u.grad, *(p.grad for p in layer.parameters())], eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("L", [1024, 3000])
def test_on_cuda_the_layer_takes_the_chunked_path_and_matches_the_float64_cpu_reference(dtype, L):
    """The whole layer (convolution, GELU, GLU projection) on CUDA, auto path, against the float64 FFT path on the
    CPU; values and the input's gradient."""
    torch.manual_seed(0)
    H = 64
    ref = S4Layer(S4Config(d_model=H, d_state=64, conv_path="fft")).double()
    ref.kernel.reset_parameters()
    torch.nn.init.normal_(ref.D)  # (a bare S4Layer's D is uninitialised memory)
    fast = S4Layer(S4Config(d_model=H, d_state=64, conv_path="chunked")).cuda()
    fast.load_state_dict(ref.state_dict())
    u = torch.randn(4, L, H, dtype=torch.float64)
    g = torch.randn(4, L, H, dtype=torch.float64)
    half = dtype == torch.bfloat16
    assert conv_plan(fast.config, "cuda", torch.float32, torch.bfloat16 if half else None).path == "chunked"
    x = u.float().cuda().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=half):
        y, _ = fast(x)
    assert y.dtype == dtype
    y.backward(g.to(y.dtype).cuda())
    x_ref = u.clone().requires_grad_(True)
    y_ref, _ = ref(x_ref)
    y_ref.backward(g)
    # bfloat16: the GLU projection's bf16 matmul adds its own rounding to the convolution's
    assert rel(y.cpu(), y_ref) < (3e-2 if half else 1e-5)
    assert rel(x.grad.cpu(), x_ref.grad) < (3e-2 if half else 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("path", ["chunked", "fused"])
def test_on_cuda_the_language_model_compiles_as_one_graph_in_bf16_and_trains_as_eager_does(path):
    """A training step of the S4D language model under bf16 autocast, `torch.compile(fullgraph=True)`: no graph
    break, no complex-operator fallback, and the loss and gradients within bf16 rounding of eager's."""
    torch.manual_seed(0)
    model = S4ForCausalLM(S4Config(vocab_size=300, d_model=128, n_layer=2, d_state=64, ffn="mlp", d_ffn=256,
                                   conv_path=path)).cuda()
    ids = torch.randint(3, 300, (4, 1024), device="cuda")

    def step(m):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager_loss, eager_grads = step(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads = step(torch.compile(model, fullgraph=True))
    assert not [w for w in caught if "complex" in str(w.message)]
    assert abs(loss.item() - eager_loss.item()) < 1e-2
    for name, g in eager_grads.items():
        assert rel(grads[name].cpu(), g.cpu()) < 5e-2, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                      (torch.float32, torch.float32)], ids=str)
def test_on_cuda_the_triton_transpose_equals_pytorchs_copy_bit_for_bit(src_dtype, dst_dtype):
    """The tiled Triton transpose (with its cast) against PyTorch's own strided copy, on shapes that leave partial
    tiles, into a padded channels-first buffer and back."""
    torch.manual_seed(0)
    u = torch.randn(3, 1000, 70, device="cuda").to(src_dtype)
    out = torch.full((70, 3, 1024), float("nan"), device="cuda", dtype=dst_dtype)
    transpose_into(u, out[..., :1000].permute(1, 0, 2))
    assert torch.equal(out[..., :1000], u.permute(2, 0, 1).to(dst_dtype))
    back = torch.empty(3, 1000, 70, device="cuda", dtype=src_dtype)
    transpose_into(out[..., :1000].permute(1, 0, 2), back)
    assert torch.equal(back, out[..., :1000].permute(1, 2, 0).to(src_dtype))


def test_choosing_the_path_for_a_cuda_device_is_no_graph_break():
    """The layer asks `conv_plan` in every forward: `torch.compile(fullgraph=True)` must trace it for CUDA too (a
    torch function returning a bool, `torch.cuda.is_bf16_supported`, broke the graph in every layer)."""
    config = S4Config()

    @torch.compile(fullgraph=True, backend="eager")
    def plan_of(x):
        plan = conv_plan(config, "cuda", x.dtype, torch.bfloat16, 4096)
        return x * plan.chunk

    expected = conv_plan(config, "cuda", torch.float32, torch.bfloat16, 4096).chunk  # 64 fused, 256 chunked
    assert torch.equal(plan_of(torch.ones(2)), torch.full((2,), float(expected)))
