"""The fused S4D convolution (`s4d_fused.py`: the chunked form in one Triton kernel each way) against its references:
the batched-matmul chunked form and the float64 FFT convolution, values and every gradient, in float32 and bfloat16;
the whole model on the fused path (packed documents, carried state and generation run on both paths in
test_s4d_chunked.py); when the path is refused. Without a GPU the kernels run in Triton's interpreter
(tests/conftest.py sets `TRITON_INTERPRET=1`); GPU-only checks are marked `gpu`."""

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError

from s4accel import S4Config, S4ForCausalLM, S4ForSequenceClassification
from s4accel.models import modeling_s4, s4d_chunked, s4d_fused, s4d_segments
from s4accel.models.modeling_s4 import S4DKernel, S4Layer, conv_plan
from s4accel.models.s4d_chunked import chunk_matrices, conv_channels_first
from sm90 import assert_they_fit_an_sm, sm90_usage

needs_triton = pytest.mark.skipif(s4d_fused.triton is None or not (torch.cuda.is_available() or s4d_fused.INTERPRETED),
                                  reason="needs Triton (on a GPU, or its interpreter)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative to the reference's largest value: float32 to rounding; bfloat16 as the chunked path's (the operands of
# the products rounded to 8 bits of mantissa, accumulated in float32).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).abs().max() / b.double().cpu().abs().max()).item()


def kernel_params(H, N, seed=0):
    torch.manual_seed(seed)
    k = S4DKernel(S4Config(d_model=H, d_state=N, dt_min=0.01, dt_max=0.5, bidirectional=True))
    k.reset_parameters()
    (ar, ai), (Cr, Ci) = k.double().discretize_pairs()
    return [t.detach().requires_grad_() for t in (ar, ai, Cr[0], Ci[0], Cr[1], Ci[1])]


def check_against_the_float64_reference(conv, dtype, shift: int, B: int, gelu: bool = False, L: int = 70):
    """`conv(x, log_dA, C~, D, T, shift)` on `dtype` operands (x `(H, B, nc T)`, zeros past L (70: in the last of 5
    chunks of 16) against the batched-matmul form in float64 (itself checked against the FFT convolution and the
    recurrence in test_s4d_chunked.py), or with `gelu` its exact GELU: the output, and the gradients of the input,
    log dA (real and imaginary), C~ and D (shift 0; shift 1, strictly causal, has none)."""
    H, N, T = 3, 32, 16
    nc = -(-L // T)
    ar, ai, cr, ci, cr1, ci1 = kernel_params(H, N)
    if shift:
        cr, ci = cr1, ci1
    D = torch.randn(H, dtype=torch.float64, requires_grad=True) if shift == 0 else None
    x = torch.zeros(H, B, nc * T, dtype=torch.float64)
    x[..., :L] = torch.randn(H, B, L, dtype=torch.float64)
    x.requires_grad_()
    params = [x, ar, ai, cr, ci] + ([D] if D is not None else [])
    ref = conv_channels_first(x, *chunk_matrices((ar, ai), (cr, ci), D, T, nc, shift), nc=nc, shift=shift)
    ref = torch.nn.functional.gelu(ref) if gelu else ref
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, params, g)

    ours = [p.detach().float().to(DEVICE).requires_grad_() for p in params]
    y = conv(ours[0].to(dtype), (ours[1], ours[2]), (ours[3], ours[4]), ours[5] if D is not None else None, T, shift)
    assert y.dtype == dtype and y.shape == ref.shape
    grads = torch.autograd.grad(y, ours, g.to(DEVICE, dtype))
    assert rel(y, ref) < TOL[dtype]
    for name, got, want in zip(["x", "log_dA.real", "log_dA.imag", "C.real", "C.imag", "D"], grads, ref_grads):
        assert rel(got, want) < TOL[dtype], name


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shift", [0, 1], ids=["causal", "strictly-causal"])
@pytest.mark.parametrize("B", [3, 40], ids=["one-row-block", "two-row-blocks"])
def test_fused_equals_the_float64_chunked_reference_values_and_every_gradient(dtype, shift, B):
    """The kernels against the float64 reference (`check_against_the_float64_reference`). B 40 spans two blocks of
    rows (the backward's partial sums are added)."""
    def conv(x, log_dA, C, D, T, shift):
        return s4d_fused.fused_conv_channels_first(x, *s4d_fused.fused_matrices(log_dA, C, D, T, shift), shift)
    check_against_the_float64_reference(conv, dtype, shift, B)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("mode", "S"), [("forward", 1), ("both", 1), ("both", 2)],
                         ids=["forward", "both", "both-segments"])
def test_the_kernels_gelu_of_the_convolution_equals_the_float64_one_values_and_every_gradient(dtype, mode, S):
    """GELU applied as the forward kernel writes y (`s4d_fused.GELU_IN_KERNELS`, which `S4Layer` reads for a causal
    layer): its backward PyTorch's ("forward") or the backward kernel's ("both"), against the exact GELU of the
    float64 reference; cut in segments, PyTorch's GELU after them. B 40: two blocks of rows."""
    def conv(x, log_dA, C, D, T, shift):
        return s4d_segments.fused_conv(x, log_dA, C, D, T, shift, S=S, gelu=s4d_fused.GELU_MODES.index(mode))
    check_against_the_float64_reference(conv, dtype, 0, 40, gelu=True)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shift", [0, 1], ids=["causal", "strictly-causal"])
@pytest.mark.parametrize(("B", "S"), [(1, 4), (3, 2), (2, None)], ids=["1x4", "3x2", "2-default"])
def test_short_batches_cut_into_segments_equal_the_float64_reference_values_and_every_gradient(dtype, shift, B, S):
    """Rows cut into S segments (`s4d_segments.py`: what a program's empty rows would have cost, spent on later
    parts of the same rows; each segment's starting state added after) against the float64 reference. 5 chunks in
    4 segments pad to 8 chunks; the default S for 2 rows of 5 chunks is 4 (under torch.compile; eager, 1)."""
    assert s4d_segments.segments(2, 5) == 4 and s4d_segments.segments(40, 5) == 1
    check_against_the_float64_reference(
        lambda *args: s4d_segments.fused_conv(*args, S=S), dtype, shift, B)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shift", [0, 1], ids=["causal", "strictly-causal"])
@pytest.mark.parametrize(("B", "S"), [(1, 8), (3, 2)], ids=["1x8", "3x2"])
def test_the_kernels_cut_short_rows_into_segments_and_equal_the_float64_reference(dtype, shift, B, S):
    """`s4d_fused.SEGMENTS_IN_KERNELS`: each row read as S rows of a program, each started from its true state (a
    first kernel walks each segment for its end state, a scan over the segments gives each one's start) and in the
    backward from its true adjoint, against the float64 reference: values and every gradient. 8 chunks (L 120)."""
    def conv(x, log_dA, C, D, T, shift):
        return s4d_fused.fused_conv_channels_first(x, *s4d_fused.fused_matrices(log_dA, C, D, T, shift), shift,
                                                   segments=S)
    check_against_the_float64_reference(conv, dtype, shift, B, L=120)


@needs_triton
def test_segments_in_the_kernels_with_the_gelu_in_them_equal_the_float64_reference():
    """Segments with GELU's slope kept by the forward kernel: the backward's first walk multiplies by it too."""
    def conv(x, log_dA, C, D, T, shift):
        return s4d_fused.fused_conv_channels_first(x, *s4d_fused.fused_matrices(log_dA, C, D, T, shift), shift,
                                                   gelu=2, segments=4)
    check_against_the_float64_reference(conv, torch.float32, 0, 2, gelu=True, L=120)


def test_the_kernels_cut_rows_only_when_switched_on_and_only_into_segments_that_divide_them(monkeypatch):
    """Off by default; on, the smallest power of two that fills a program's rows and divides the row's chunks."""
    assert s4d_fused.kernel_segments(1, 128) == 1
    monkeypatch.setattr(s4d_fused, "SEGMENTS_IN_KERNELS", True)
    rows = min(s4d_fused.LAUNCH["forward"][0], s4d_fused.LAUNCH["backward"][0])
    assert s4d_fused.kernel_segments(rows, 128) == 1
    assert s4d_fused.kernel_segments(1, 128) == rows and s4d_fused.kernel_segments(rows // 4, 128) == 4
    assert s4d_fused.kernel_segments(1, 12) == 4 and s4d_fused.kernel_segments(1, 7) == 1


@needs_triton
def test_in_eager_mode_short_batches_are_read_whole_by_default(monkeypatch):
    """Eager, the segments' correction would cost more launches than the programs' empty rows cost (the module's
    docs): a batch of 2 rows is read whole unless S is given."""
    def refuse(*args):
        raise AssertionError("segments in eager mode")
    monkeypatch.setattr(s4d_segments, "_from_earlier_segments", refuse)
    check_against_the_float64_reference(s4d_segments.fused_conv, torch.float32, 0, 2)
    with pytest.raises(AssertionError, match="segments in eager mode"):
        check_against_the_float64_reference(lambda *args: s4d_segments.fused_conv(*args, S=2), torch.float32, 0, 2)


@needs_triton
@pytest.mark.parametrize(("bidirectional", "gelu"), [(False, "off"), (False, "forward"), (False, "both"),
                                                     (True, "both")])
def test_the_model_on_the_fused_path_gives_the_fft_paths_logits_and_gradients(bidirectional, gelu, monkeypatch):
    """A causal LM and a bidirectional classifier, float32: the same logits and every parameter's gradient as the
    FFT path, to float32 rounding; with the GELU in the kernels (`s4d_fused.GELU_IN_KERNELS`) where the layer is
    causal, PyTorch's GELU module left uncalled, and PyTorch's where it is bidirectional."""
    monkeypatch.setattr(s4d_fused, "GELU_IN_KERNELS", gelu)
    grads = {}
    for path in ("fft", "fused"):
        torch.manual_seed(0)
        config = S4Config(vocab_size=50, d_model=16, n_layer=2, d_state=32, conv_path=path, conv_chunk=16,
                          bidirectional=bidirectional, num_labels=3)
        model = (S4ForSequenceClassification if bidirectional else S4ForCausalLM)(config).to(DEVICE)
        calls = []
        for module in model.modules():
            if isinstance(module, S4Layer):
                module.activation.register_forward_hook(lambda *args: calls.append(1))
        ids = torch.randint(3, 50, (3, 45), device=DEVICE)
        labels = torch.tensor([0, 2, 1], device=DEVICE) if bidirectional else ids
        out = model(ids, labels=labels)
        out.loss.backward()
        grads[path] = {n: p.grad for n, p in model.named_parameters()} | {"logits": out.logits}
        assert len(calls) == (0 if path == "fused" and gelu != "off" and not bidirectional else 2)
    for name, g in grads["fft"].items():
        assert rel(grads["fused"][name], g) < 1e-4, name


@needs_triton
def test_a_model_whose_kernels_cut_its_rows_into_segments_gives_the_fft_paths_logits_and_gradients(monkeypatch):
    """`SEGMENTS_IN_KERNELS` on (and the GELU in the kernels, both ways), float32: a causal LM of 3 rows of 4 chunks,
    each cut into 4 segments, has the FFT path's logits and every parameter's gradient to float32 rounding."""
    monkeypatch.setattr(s4d_fused, "SEGMENTS_IN_KERNELS", True)
    monkeypatch.setattr(s4d_fused, "GELU_IN_KERNELS", "both")
    cuts = []
    starts = s4d_fused._segment_starts
    monkeypatch.setattr(s4d_fused, "_segment_starts", lambda ends, *args: cuts.append(ends.shape[2]) or
                        starts(ends, *args))
    grads = {}
    for path in ("fft", "fused"):
        torch.manual_seed(0)
        config = S4Config(vocab_size=50, d_model=16, n_layer=2, d_state=32, conv_path=path, conv_chunk=16)
        model = S4ForCausalLM(config).to(DEVICE)
        ids = torch.randint(3, 50, (3, 64), device=DEVICE)
        out = model(ids, labels=ids)
        out.loss.backward()
        grads[path] = {n: p.grad for n, p in model.named_parameters()} | {"logits": out.logits}
    assert cuts == [4, 4]  # each layer's forward
    for name, g in grads["fft"].items():
        assert rel(grads["fused"][name], g) < 1e-4, name


@needs_triton
@pytest.mark.parametrize("gelu", s4d_fused.GELU_MODES)
def test_the_fused_layer_compiles_as_one_graph_and_computes_what_eager_does(gelu, monkeypatch):
    """`torch.compile(fullgraph=True)`: the kernels are custom operators, whole in the graph (dynamo does not trace
    into Triton's launcher, which broke the graph); the same output and input gradient as eager, wherever the GELU
    runs (`s4d_fused.GELU_IN_KERNELS`)."""
    monkeypatch.setattr(s4d_fused, "GELU_IN_KERNELS", gelu)
    torch.manual_seed(0)
    layer = S4Layer(S4Config(d_model=16, d_state=32, conv_path="fused", conv_chunk=16)).to(DEVICE)
    layer.kernel.reset_parameters()
    torch.nn.init.normal_(layer.D)
    x = torch.randn(2, 64, 16, device=DEVICE, requires_grad=True)
    eager, _ = layer(x)
    eager.sum().backward()
    eager_grad, x.grad = x.grad, None
    torch._dynamo.reset()
    compiled, _ = torch.compile(layer, fullgraph=True)(x)
    compiled.sum().backward()
    assert rel(compiled, eager) < 1e-5 and rel(x.grad, eager_grad) < 1e-5


@pytest.mark.skipif(s4d_fused.triton is None, reason="needs Triton")
def test_the_fused_path_where_it_runs_and_one_line_where_it_cannot(monkeypatch):
    fused = S4Config(conv_path="fused")
    assert conv_plan(S4Config(conv_path="fused", conv_chunk=32), "cuda", torch.float32, None, 4096) == (
        "fused", 32, torch.float32)
    monkeypatch.setattr(modeling_s4, "_bf16_matmuls", lambda: True)  # as on an H100
    assert conv_plan(fused, "cuda", torch.float32, torch.bfloat16, L=40) == ("fused", 64, torch.bfloat16)  # one chunk
    assert conv_plan(fused, "cuda", torch.float32, torch.bfloat16, L=4096).chunk == modeling_s4.FUSED_CHUNK
    # float32 products: shorter chunks in IEEE precision (registers), the longer ones with TF32
    assert conv_plan(fused, "cuda", torch.float32, None, L=4096).chunk == modeling_s4.FUSED_CHUNK_IEEE == 32
    monkeypatch.setattr(s4d_fused, "_tf32_allowed", lambda: True)  # train.tf32
    assert conv_plan(fused, "cuda", torch.float32, None, L=4096).chunk == modeling_s4.FUSED_CHUNK
    monkeypatch.setattr(s4d_fused, "_tf32_allowed", lambda: False)
    auto = conv_plan(S4Config(), "cuda", torch.float32, None, 4096).path
    assert auto == ("fused" if modeling_s4.FUSED_BY_DEFAULT else "chunked")
    assert conv_plan(S4Config(), "cpu", torch.float32, torch.bfloat16, 4096).path == "fft"  # auto on a CPU
    # auto falls back to the matmuls where the kernel cannot take the shapes; forced, that is one line
    assert conv_plan(S4Config(d_state=16), "cuda", torch.float32, None, 4096).path == "chunked"
    with pytest.raises(ValueError, match=r"conv_path='fused' cannot run here: it needs d_state/2 and conv_chunk"):
        conv_plan(S4Config(conv_path="fused", d_state=16), "cuda", torch.float32, None)
    with pytest.raises(ValueError, match="it takes bfloat16 or float32 operands"):
        conv_plan(fused, "cuda", torch.float64, None)
    # what an SM's shared memory holds (compiled for sm_90: 256 KiB at T 128 in float32, past its 228 KiB)
    with pytest.raises(ValueError, match=r"conv_chunk <= 128 \(d_state=64, conv_chunk=256\)"):
        conv_plan(S4Config(conv_path="fused", conv_chunk=256), "cuda", torch.float32, None)
    with pytest.raises(ValueError, match="with float32 operands it takes chunks of at most 64 steps"):
        conv_plan(S4Config(conv_path="fused", conv_chunk=128), "cuda", torch.float32, None)
    monkeypatch.setattr(s4d_fused, "INTERPRETED", False)
    with pytest.raises(ValueError, match="it runs on CUDA devices; 'chunked' computes the same"):
        conv_plan(fused, "cpu", torch.float32, None)
    monkeypatch.setattr(s4d_fused, "triton", None)
    with pytest.raises(ValueError, match="it needs Triton"):
        conv_plan(fused, "cuda", torch.float32, None)
    assert conv_plan(S4Config(), "cuda", torch.float32, None).path == "chunked"  # auto without Triton
    with pytest.raises(StrictDataclassError, match="conv_path='fused' needs kernel='s4d'"):
        S4Config(kernel="s4", conv_path="fused")


# ---------------------------------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("dtype", "L", "gelu"), [
    *[(dtype, L, "off") for dtype in (torch.float32, torch.bfloat16) for L in (1024, 3000)],
    (torch.bfloat16, 3000, "forward"), (torch.bfloat16, 3000, "both")])  # (float32's GELU modes: interpreted)
def test_on_cuda_the_fused_layer_matches_the_float64_cpu_reference(dtype, L, gelu, monkeypatch):
    """The whole layer (fused convolution, GELU, GLU projection: the GLU in its own kernels) on CUDA against the
    float64 FFT path on the CPU; values and the input's and kernel's gradients; the GELU after the fused kernels or
    in them (`s4d_fused.GELU_IN_KERNELS`)."""
    monkeypatch.setattr(s4d_fused, "GELU_IN_KERNELS", gelu)
    torch.manual_seed(0)
    H = 64
    ref = S4Layer(S4Config(d_model=H, d_state=64, conv_path="fft")).double()
    ref.kernel.reset_parameters()
    torch.nn.init.normal_(ref.D)
    fast = S4Layer(S4Config(d_model=H, d_state=64, conv_path="fused")).cuda()
    fast.load_state_dict(ref.state_dict())
    u = torch.randn(40, L, H, dtype=torch.float64)
    g = torch.randn(40, L, H, dtype=torch.float64)
    half = dtype == torch.bfloat16
    x = u.float().cuda().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=half):
        y, _ = fast(x)
    assert type(y.grad_fn.next_functions[0][0]).__name__ == "_ProjectGLUChannelsFirstBackward"
    y.backward(g.to(y.dtype).cuda())
    x_ref = u.clone().requires_grad_(True)
    y_ref, _ = ref(x_ref)
    y_ref.backward(g)
    assert rel(y, y_ref) < (3e-2 if half else 1e-5)
    assert rel(x.grad, x_ref.grad) < (3e-2 if half else 1e-5)
    for name in ("log_dt", "C", "D"):
        got = dict(fast.named_parameters())[[n for n, _ in fast.named_parameters() if n.endswith(name)][0]].grad
        want = dict(ref.named_parameters())[[n for n, _ in ref.named_parameters() if n.endswith(name)][0]].grad
        assert rel(got, want) < (5e-2 if half else 1e-4), name


FUSED_BUILDS = (("bf16", False, modeling_s4.FUSED_CHUNK), ("fp32", False, modeling_s4.FUSED_CHUNK),
                ("fp32", True, modeling_s4.FUSED_CHUNK_IEEE))  # operands, IEEE products, steps per chunk


@pytest.mark.skipif(s4d_fused.triton is None, reason="needs Triton")
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_the_kernels_compile_for_an_h100_and_fit_in_registers_at_the_defaults(which, tmp_path):
    """What a GPU would compile, checked without one: both kernels at the default chunk (64 steps), N 64 and their
    default launch shapes build for sm_90 with bfloat16 operands, spill nothing to local memory and fit the shared
    memory of one SM (228 KiB); so do float32 operands with TF32 products at the same chunk, and with IEEE products at
    their own chunk (32 steps: at 64 both kernels spill). Chunks of 64 with 32 rows per program spill in the bfloat16
    backward (measured: ~1 KiB a thread), which is why its default is 16."""
    rows, warps = s4d_fused.LAUNCH[which]
    common = dict(n=32, BB=rows, SHIFT=0, UPCAST=False, num_warps=warps, ACT=0, INIT=False)
    if which == "forward":
        common["SAVE"] = True
    assert_they_fit_an_sm([(which, dtype, dict(IEEE=ieee, T=T, **common)) for dtype, ieee, T in FUSED_BUILDS],
                          tmp_path)


@pytest.mark.skipif(s4d_fused.triton is None, reason="needs Triton")
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_the_kernels_optional_variants_compile_for_an_h100_without_spilling(which, tmp_path):
    """The variants behind switches that are off by default build for sm_90 at the same shapes without spilling:
    each GELU mode (`s4d_fused.GELU_IN_KERNELS`), a start from a segment's state or adjoint with the mode that needs
    the most registers, and the walks that give each segment's end state and its adjoint at its start
    (`SEGMENTS_IN_KERNELS`). (bench/gpu_session.sh leaves them out on the GPU machine, where each build takes many
    seconds.)"""
    rows, warps = s4d_fused.LAUNCH[which]
    common = dict(n=32, BB=rows, UPCAST=False, num_warps=warps)
    kernel = dict(SHIFT=0, **common, **({"SAVE": True} if which == "forward" else {}))
    modes = [(1, False), (2, False), (2, True)] if which == "forward" else [(True, False), (True, True)]
    walk = ("end_state", {}) if which == "forward" else ("start_adjoint", {"ACT": True})
    builds = []
    for dtype, ieee, T in FUSED_BUILDS:
        builds += [(which, dtype, dict(IEEE=ieee, T=T, ACT=act, INIT=init, **kernel)) for act, init in modes]
        builds.append((walk[0], dtype, dict(IEEE=ieee, T=T, **common, **walk[1])))
    assert_they_fit_an_sm(builds, tmp_path)


@pytest.mark.skipif(s4d_fused.triton is None, reason="needs Triton")
@pytest.mark.parametrize("which", ["matrices_forward", "matrices_backward"])
def test_the_matrices_kernels_compile_for_an_h100_without_spilling(which, tmp_path):
    """The kernels that make the fused path's matrices (one program per channel, its modes in registers, its steps
    in blocks) build for sm_90 and spill nothing: at the default chunk and N 64, at the largest chunk the bfloat16
    path takes (128 steps), and at N 256."""
    builds = []
    for T, n in ((modeling_s4.FUSED_CHUNK, 32), (128, 32), (64, 128)):
        TB = s4d_fused._steps_a_block(T, n, forward=which == "matrices_forward")
        constexprs = dict(T=T, n=n, TB=TB, SHIFT=0, num_warps=4)
        if which == "matrices_forward":
            constexprs["HAS_D"] = True
        builds.append((which, "fp32", constexprs))
    for build, usage in zip(builds, sm90_usage(builds, tmp_path)):
        assert usage["spilled_bytes"] == 0, (build, usage)


@needs_triton
@pytest.mark.parametrize("shift", [0, 1], ids=["causal", "strictly-causal"])
@pytest.mark.parametrize("with_D", [True, False], ids=["D", "no-D"])
def test_the_matrices_kernels_equal_the_float64_reference_values_gradients_and_second_derivatives(shift, with_D):
    """`fused_matrices` (one Triton launch each way where the fused path runs) against `reference_matrices` in
    float64 under plain autograd: taps, to_state, from_state and dA^T, and the gradients of log dA, C~ and D, to
    float32 rounding; under `create_graph` the reference's graph gives the gradient (a second derivative exists)."""
    from s4accel.models.s4d_chunked import reference_matrices

    H, N, T = 3, 32, 64  # the kernels take the steps in blocks of 32 here: two of them
    ar, ai, cr, ci = kernel_params(H, N)[:4]
    D = torch.randn(H, dtype=torch.float64, requires_grad=True) if with_D else None
    params = [ar, ai, cr, ci] + ([D] if with_D else [])
    ref = reference_matrices((ar, ai), (cr, ci), D, T, shift)
    g = [torch.randn_like(o) for o in ref]
    ref_grads = torch.autograd.grad(ref, params, g)

    ours = [p.detach().float().to(DEVICE).requires_grad_() for p in params]
    out = s4d_fused.fused_matrices(ours[:2], ours[2:4], ours[4] if with_D else None, T, shift)
    assert type(out[0].grad_fn).__name__ == "_KernelMatricesBackward"  # the kernels ran, not the reference
    for name, got, want in zip(["taps", "to_state", "from_state", "step"], out, ref):
        assert got.shape == want.shape and rel(got, want) < 1e-5, name
    grads = torch.autograd.grad(out, ours, [t.float().to(DEVICE) for t in g], create_graph=True)
    for name, got, want in zip(["log_dA.real", "log_dA.imag", "C.real", "C.imag", "D"], grads, ref_grads):
        assert rel(got, want) < 1e-5, name
    assert grads[0].requires_grad  # differentiable again
    grads = torch.autograd.grad(s4d_fused.fused_matrices(ours[:2], ours[2:4], ours[4] if with_D else None, T, shift),
                                ours, [t.float().to(DEVICE) for t in g])  # the kernel's own backward
    for name, got, want in zip(["log_dA.real", "log_dA.imag", "C.real", "C.imag", "D"], grads, ref_grads):
        assert rel(got, want) < 1e-5, name


@pytest.mark.skipif(s4d_fused.triton is None, reason="needs Triton")
@pytest.mark.parametrize("which", ["discretize_forward", "discretize_backward"])
def test_the_discretization_kernels_compile_for_an_h100_without_spilling(which, tmp_path):
    """The fused path's discretization (ZOH), one program per channel over its modes and both kernels of a
    bidirectional layer, builds for sm_90 at N 64 and N 256 without spilling."""
    builds = [(which, "fp32", dict(n=n, c=2, num_warps=s4d_fused.discretize_warps(n))) for n in (32, 128)]
    for build, usage in zip(builds, sm90_usage(builds, tmp_path)):
        assert usage["spilled_bytes"] == 0, (build, usage)


@pytest.mark.skipif(s4d_fused.triton is None, reason="needs Triton")
def test_the_glu_kernels_compile_for_an_h100_without_spilling(tmp_path):
    """The GLU after the layer's projection (`s4d_chunked.project_glu_channels_first`, eager on CUDA) builds for
    sm_90 each way, in bfloat16 and float32, at its block shape, without spilling."""
    bm, bh, warps = s4d_chunked.GLU_BLOCK
    builds = [(f"glu_{way}", dtype, dict(BLOCK_M=bm, BLOCK_H=bh, num_warps=warps,
                                         **({"SUMS": True} if way == "backward" else {})))
              for way in ("forward", "backward") for dtype in ("bf16", "fp32")]
    for build, usage in zip(builds, sm90_usage(builds, tmp_path)):
        assert usage["spilled_bytes"] == 0, (build, usage)


@needs_triton
@pytest.mark.parametrize("c", [1, 2], ids=["one-kernel", "bidirectional"])
def test_the_discretization_kernels_equal_the_float64_reference_values_gradients_and_second_derivatives(c):
    """`fused_discretize` (ZOH: one Triton launch each way where the fused path runs, from the parameters as stored)
    against `reference_discretize_pairs` of `parameter_pairs` in float64 under plain autograd, over the
    initialisation's range of dt (down to 1e-3, where exp(dt A) - 1 cancels unless computed with care): log dA and
    C~, and the gradients of log_dt, log_A_real, A_imag and C, to float32 rounding; under `create_graph` the
    reference's graph gives the gradient; bfloat16 parameters too, widened. Bilinear, and SSMs shared by several
    channels: the reference."""
    from s4accel.models.s4d_chunked import discretize_pairs, parameter_pairs, reference_discretize_pairs

    torch.manual_seed(0)
    H, n = 4, 16
    log_dt = torch.logspace(-3, -0.3, H, dtype=torch.float64).log().requires_grad_()
    log_A_real = (torch.rand(H, n, dtype=torch.float64) + 0.01).log().requires_grad_()
    A_imag = (10 * torch.randn(H, n, dtype=torch.float64)).requires_grad_()
    C = torch.randn(c, H, n, 2, dtype=torch.float64).requires_grad_()
    params = [log_dt, log_A_real, A_imag, C]
    ref = [t for pair in reference_discretize_pairs(*parameter_pairs(*params), True) for t in pair]
    g = [torch.randn_like(t) for t in ref]
    ref_grads = torch.autograd.grad(ref, params, g)

    ours = [p.detach().float().to(DEVICE).requires_grad_() for p in params]
    out = [t for pair in s4d_fused.fused_discretize(*ours, True) for t in pair]
    assert type(out[0].grad_fn).__name__ == "_KernelDiscretizeBackward"  # the kernels ran, not the reference
    for name, got, want in zip(["log_dA.real", "log_dA.imag", "C~.real", "C~.imag"], out, ref):
        assert got.shape == want.shape and rel(got, want) < 1e-5, name
    # each channel to its own scale (C~ is about dt C, 500x smaller at the smallest dt), against float64, and against
    # the same formulas in PyTorch's float32 (exp - 1 and cos - 1 written out would lose 1e-4 and 2e-5 there)
    same = [t for pair in discretize_pairs(*parameter_pairs(*ours), True) for t in pair]
    for h in range(H):
        assert all(rel(out[i][:, h], want[i][:, h]) < 1e-5 for want in (ref, same) for i in (2, 3)), h
    gg = [t.float().to(DEVICE) for t in g]
    for create_graph in (False, True):
        out = [t for pair in s4d_fused.fused_discretize(*ours, True) for t in pair]
        grads = torch.autograd.grad(out, ours, gg, create_graph=create_graph)
        for name, got, want in zip(["log_dt", "log_A_real", "A_imag", "C"], grads, ref_grads):
            assert got.shape == want.shape and rel(got, want) < 1e-5, (name, create_graph)
        assert grads[0].requires_grad == create_graph
    (ar, _), _ = s4d_fused.fused_discretize(*ours, False)
    assert type(ar.grad_fn).__name__ != "_KernelDiscretizeBackward"  # bilinear: not these kernels
    # parameters kept in bfloat16 (a model cast whole) are widened, as the reference widens them, and take the kernels
    narrow = [p.detach().bfloat16().requires_grad_() for p in ours]
    out = [t for pair in s4d_fused.fused_discretize(*narrow, True) for t in pair]
    assert type(out[0].grad_fn).__name__ == "_KernelDiscretizeBackward"
    same = [t for pair in discretize_pairs(*parameter_pairs(*narrow), True) for t in pair]
    assert all(rel(got, want) < 1e-5 for got, want in zip(out, same))
    shared = [ours[0], ours[1][:2], ours[2][:2], ours[3]]  # two SSMs, each read by two channels
    (ar, _), _ = s4d_fused.fused_discretize(*shared, True, copies=2)
    assert type(ar.grad_fn).__name__ != "_KernelDiscretizeBackward" and ar.shape == (H, n)


@needs_triton
def test_the_run_says_when_it_cuts_short_batches_into_segments(monkeypatch):
    """The start-of-run line about the convolution says when the fused path will cut a micro-batch's rows into
    segments (fewer rows than a kernel program takes, `s4d_segments.UNDER_COMPILE` set; the loop passes the rows of
    compiled steps alone), and not otherwise: by default it does not."""
    from types import SimpleNamespace

    from s4accel.training.devices.precision import convolution_line

    model = S4ForCausalLM(S4Config(vocab_size=50, d_model=16, n_layer=1, d_state=32, conv_path="fused",
                                   conv_chunk=16))
    accelerator = SimpleNamespace(device=torch.device(DEVICE), mixed_precision="no")
    assert "segments" not in convolution_line(model, accelerator, rows=2)
    monkeypatch.setattr(s4d_segments, "UNDER_COMPILE", True)
    assert convolution_line(model, accelerator, rows=2).endswith(
        "; batches of 2 rows: each row cut into segments, read as rows by the kernels")
    assert "segments" not in convolution_line(model, accelerator, rows=16)
    assert "segments" not in convolution_line(model, accelerator)


@needs_triton
def test_compiled_steps_read_short_batches_whole_unless_segments_are_switched_on(monkeypatch):
    """Segments cost a compiled model more than the programs' empty rows (`s4d_segments.UNDER_COMPILE`, measured on
    an H200): inside a compiled step a batch of 2 rows is read whole by default, cut with `UNDER_COMPILE`."""
    cut = []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the branch a compiled step takes
    original = s4d_segments._from_earlier_segments
    monkeypatch.setattr(s4d_segments, "_from_earlier_segments", lambda *a: cut.append(a[-2]) or original(*a))
    check_against_the_float64_reference(s4d_segments.fused_conv, torch.float32, 0, 2)
    assert cut == []
    monkeypatch.setattr(s4d_segments, "UNDER_COMPILE", True)
    check_against_the_float64_reference(s4d_segments.fused_conv, torch.float32, 0, 2)
    assert cut and cut[0] > 1  # S, the segments of each row
