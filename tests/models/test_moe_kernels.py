"""The MoE layer's Triton kernels (`moe_kernels.py`: the k-way sums of gathered rows, the SwiGLU scaled by the
routing weight, the float32 router with the experts' cast; the eager `grouped_mm` dispatch on CUDA) against float64
references and PyTorch's operators, alone and in the layer; their sm_90 builds. Without a GPU they run in Triton's
interpreter (tests/conftest.py)."""

import os

import pytest
import torch
import torch.nn.functional as F

from s4accel.models import moe, moe_kernels
from s4accel.models.configuration_moe import MoEConfig
from sm90 import assert_they_fit_an_sm

needs_triton = pytest.mark.skipif(moe_kernels.triton is None or not (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"), reason="needs Triton (on a GPU, or its "
                                                                                      "interpreter)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


def rounding(dtype):
    """The largest relative error of a kernel's store to `dtype`: half a unit in the last place, rounding to
    nearest; a whole unit in Triton's interpreter, whose stores to bfloat16 truncate."""
    bits = {torch.float32: 24, torch.bfloat16: 8}[dtype]
    return 2.0 ** (1 - bits) if INTERPRETED and dtype == torch.bfloat16 else 2.0 ** -bits


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_the_pair_sums_kernel_sums_each_tokens_rows_in_float32_rounded_once(dtype, k):
    """`pair_sums(src, rows, T)` = `src[rows].view(k, T, D).sum(0)`: against the float64 sum to one rounding of the
    result (the float32 sum of k values rounded to `dtype`), and for k <= 2, where the order of a sum cannot matter,
    bit for bit PyTorch's own (which also sums in float32 and rounds once; compiled kernels only, as the interpreter
    truncates to bfloat16). Sizes that fill no block exactly."""
    torch.manual_seed(k)
    T, D, R = 37, 300, 101
    src = torch.randn(R, D, device=DEVICE).to(dtype)
    rows = torch.randint(0, R, (k * T,), device=DEVICE)
    out = moe_kernels.pair_sums(src, rows, T)
    assert out.dtype == dtype and out.shape == (T, D)
    exact = src.double()[rows].view(k, T, D).sum(0)
    err = (out.double() - exact).abs()
    assert (err <= exact.abs() * rounding(dtype) + k * 2e-7 * src.double().abs().max()).all(), err.max()
    if k <= 2 and not (INTERPRETED and dtype == torch.bfloat16):
        assert torch.equal(out, src[rows].view(k, T, D).sum(0))


def swiglu_reference(h, w):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up * w[:, None]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weighted_swiglu_kernels_equal_the_float64_activation_values_and_gradients(dtype):
    """`swiglu_weighted(h, w)` = `silu(gate) * up * w` for `h = (gate | up)`: the values and the gradients of h and
    of the float32 routing weights against float64 autograd, within a rounding or two of `dtype` (float32 inside);
    in bfloat16 on a GPU at least as close as PyTorch's operators on the same bfloat16 tensors, which round three
    times (the interpreter truncates its stores to bfloat16). Rows
    of weight 0 (the layout's padding) give exact zeros."""
    torch.manual_seed(0)
    R, Fh = 70, 200  # neither fills a block
    h = (2 * torch.randn(R, 2 * Fh, device=DEVICE)).to(dtype).requires_grad_()
    w = torch.rand(R, device=DEVICE)
    w[::7] = 0
    w.requires_grad_()
    g = torch.randn(R, Fh, device=DEVICE).to(dtype)
    act = moe_kernels.swiglu_weighted(h, w)
    assert act.dtype == dtype and act.shape == (R, Fh)
    assert (act[::7] == 0).all()
    dh, dw = torch.autograd.grad(act, (h, w), g)
    assert dw.dtype == torch.float32

    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = swiglu_reference(h64, w64)
    ref_dh, ref_dw = torch.autograd.grad(ref, (h64, w64), g.double())
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    plain = swiglu_reference(h2, w2.to(dtype))
    plain_dh, plain_dw = torch.autograd.grad(plain, (h2, w2), g)

    eps = rounding(dtype)
    for ours, exact, torch_ops, scale in ((act, ref, plain, 2), (dh, ref_dh, plain_dh, 4), (dw, ref_dw, plain_dw, 4)):
        err = (ours.double() - exact).abs().max().item()
        bound = scale * eps * exact.abs().max().item() if ours.dtype == dtype else 1e-5 * exact.abs().max().item()
        assert err <= bound, (err, bound)
        if dtype == torch.bfloat16 and not INTERPRETED:
            assert err <= (torch_ops.double() - exact).abs().max().item()


@needs_triton
@pytest.mark.parametrize("E", [3, 8, 32])
def test_the_router_kernels_equal_the_float64_router_and_cast_values_and_gradients(E):
    """`route_and_cast(x, W, bf16)` = `(x W^T, x.to(bf16))`: the logits, x's gradient (the cast's plus the
    router's) and W's against float64, to float32's rounding of sums of D products (IEEE products: no TF32); the cast
    to one rounding of bfloat16 (bit for bit PyTorch's with compiled kernels; the interpreter truncates). Sizes that
    fill no block exactly, and E padded for `tl.dot`."""
    torch.manual_seed(E)
    T, D = 300, 200  # the backward's programs take 256 rows: two, the second partly empty
    x = torch.randn(T, D, device=DEVICE, requires_grad=True)
    w = (torch.randn(E, D, device=DEVICE) / D**0.5).requires_grad_()
    logits, xc = moe_kernels.route_and_cast(x, w, torch.bfloat16)
    assert logits.dtype == torch.float32 and logits.shape == (T, E) and xc.dtype == torch.bfloat16
    g_logits, g_cast = torch.randn(T, E, device=DEVICE), torch.randn(T, D, device=DEVICE).to(torch.bfloat16)
    dx, dw = torch.autograd.grad((logits, xc), (x, w), (g_logits, g_cast))
    assert dx.dtype == dw.dtype == torch.float32

    x64, w64, gl64 = x.detach().double(), w.detach().double(), g_logits.double()
    sums = {  # (ours, exact, the sum of the terms' magnitudes: float32's bound scales with it)
        "logits": (logits, x64 @ w64.T, x64.abs() @ w64.abs().T),
        "dx": (dx, g_cast.double() + gl64 @ w64, g_cast.double().abs() + gl64.abs() @ w64.abs()),
        "dw": (dw, gl64.T @ x64, gl64.abs().T @ x64.abs()),
    }
    for name, (ours, exact, magnitude) in sums.items():
        err = (ours.double() - exact).abs()
        assert (err <= 2 * max(D, T) * 2.0**-24 * magnitude).all(), (name, err.max().item())
    assert ((xc.double() - x64).abs() <= rounding(torch.bfloat16) * x64.abs()).all()
    if not INTERPRETED:
        assert torch.equal(xc, x.detach().to(torch.bfloat16))


@needs_triton
def test_the_router_kernel_makes_only_the_gradients_asked_for_each_as_when_both_are(monkeypatch):
    """A frozen router (a LoRA fine-tune leaves it as it is) gets no gradient made, and an input that needs none
    (the router alone trained) none either: what is made is bit for bit what the kernel makes when both are, and the
    kernel runs with the other half switched off."""
    torch.manual_seed(0)
    x, w = torch.randn(300, 200, device=DEVICE), torch.randn(8, 200, device=DEVICE) / 200**0.5
    g_logits, g_cast = torch.randn(300, 8, device=DEVICE), torch.randn(300, 200, device=DEVICE).to(torch.bfloat16)
    flags = []
    kernel = moe_kernels._route_cast_backward_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                flags.append((kwargs["X_GRAD"], kwargs["W_GRAD"]))
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(moe_kernels, "_route_cast_backward_kernel", Spy())

    def grads(x_grad, w_grad):
        xs, ws = x.clone().requires_grad_(x_grad), w.clone().requires_grad_(w_grad)
        logits, xc = moe_kernels.route_and_cast(xs, ws, torch.bfloat16)
        torch.autograd.backward((logits, xc), (g_logits, g_cast))
        return xs.grad, ws.grad
    dx, dw = grads(True, True)
    x_only, w_only = grads(True, False), grads(False, True)
    assert flags == [(True, True), (True, False), (False, True)]
    assert torch.equal(x_only[0], dx) and x_only[1] is None
    assert w_only[0] is None and torch.equal(w_only[1], dw)


def layer(dispatch="grouped_mm", **overrides):
    torch.manual_seed(0)
    config = MoEConfig(**{**dict(d_model=32, d_ffn=48, num_experts=4, num_experts_per_tok=2, n_head=4,
                                 moe_dispatch=dispatch), **overrides})
    m = moe.MoELayer(config, 32)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m.to(DEVICE)


def pass_of(m, x, g, mask=None, autocast=False):
    """Output, and the gradients of x and every parameter, of `y g + balance + z` (the router's gradient too)."""
    m.zero_grad()
    x = x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y, aux = m(x, mask)
    ((y.float() * g).sum() + aux["balance_loss"] + aux["z_loss"]).backward()
    return [y.detach().double(), x.grad.double()] + [p.grad.double() for p in m.parameters()]


@needs_triton
@pytest.mark.parametrize("capacity_factor", [None, 0.8])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_the_grouped_layer_with_its_kernels_equals_the_float64_loop_and_uses_them(capacity_factor, autocast,
                                                                                  monkeypatch):
    """The eager `grouped_mm` layer with the kernels (`MOE_KERNELS`; on CUDA by default) against the `loop`
    dispatch in float64, with capacity, a shared expert and padded tokens: its output and every gradient (the
    router's, through the routing weights, included) as close as PyTorch's operators in the same layer get; and the
    kernels did run, each sum both ways and the activation, and under autocast the router with the experts' cast."""
    calls = {"pair_sums": 0, "swiglu_weighted": 0, "route_and_cast": 0}
    for name in calls:
        def spy(*args, _name=name, _fn=getattr(moe, name)):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(moe, name, spy)
    overrides = dict(capacity_factor=capacity_factor, num_shared_experts=1)
    m, ref_layer = layer(**overrides), layer("loop", **overrides).double()
    x, g = torch.randn(3, 20, 32, device=DEVICE), torch.randn(3, 20, 32, device=DEVICE)
    mask = torch.ones(3, 20, dtype=torch.long, device=DEVICE)
    mask[1, 13:] = 0
    ref = pass_of(ref_layer, x.double(), g.double(), mask)
    monkeypatch.setattr(moe_kernels, "MOE_KERNELS", "always")
    ours = pass_of(m, x, g, mask, autocast)
    expected = {"pair_sums": 2, "swiglu_weighted": 1, "route_and_cast": int(autocast)}
    assert calls == expected
    monkeypatch.setattr(moe_kernels, "MOE_KERNELS", "never")
    plain = pass_of(m, x, g, mask, autocast)
    assert calls == expected  # "never": PyTorch's operators
    for a, p, r in zip(ours, plain, ref):
        scale = r.abs().max().item()
        ours_err, plain_err = (a - r).abs().max().item(), (p - r).abs().max().item()
        assert ours_err <= max(1.5 * plain_err, (3e-6 if not autocast else 2e-2) * scale), (ours_err, plain_err)


@needs_triton
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_with_the_kernels_a_tokens_output_does_not_depend_on_the_other_tokens(autocast, monkeypatch):
    """Bit for bit, as the layout's padded slices promise: a sequence's outputs and input gradients are the same
    whatever the other sequence of the batch is, with the kernels summing each token's rows (and, under autocast,
    computing each token's logits and input gradient from its own row)."""
    monkeypatch.setattr(moe_kernels, "MOE_KERNELS", "always")
    m = layer()
    torch.manual_seed(1)
    first, g = torch.randn(1, 24, 32, device=DEVICE), torch.randn(2, 24, 32, device=DEVICE)
    outs = []
    for _ in range(2):
        x = torch.cat([first, torch.randn(1, 24, 32, device=DEVICE)]).requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            y, _ = m(x)
        (y.float() * g).sum().backward()
        outs.append((y[0].detach(), x.grad[0]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_the_kernels_run_where_the_switch_says():
    """"cuda" (the default): CUDA tensors only; never float64, never inside `torch.compile` (inductor fuses these
    operations itself)."""
    assert moe_kernels.MOE_KERNELS == "cuda"
    cpu = torch.zeros(2)
    assert not moe_kernels.moe_kernels_run(cpu)
    if moe_kernels.triton is not None:
        saved = moe_kernels.MOE_KERNELS
        try:
            moe_kernels.MOE_KERNELS = "always"
            assert moe_kernels.moe_kernels_run(cpu)
            assert not moe_kernels.moe_kernels_run(cpu.double())
            moe_kernels.MOE_KERNELS = "never"
            assert not moe_kernels.moe_kernels_run(cpu)
        finally:
            moe_kernels.MOE_KERNELS = saved


@needs_triton
def test_the_router_kernel_runs_only_where_it_computes_the_same_router(monkeypatch):
    """The router and the experts' cast in one kernel only for a float32 input under half-precision autocast, at
    most `ROUTER_MAX_EXPERTS` experts, on the `grouped_mm` dispatch, when no jitter is drawn, and with the router as
    the layer made it (an adapter wrapping it keeps its own forward)."""
    monkeypatch.setattr(moe_kernels, "MOE_KERNELS", "always")
    calls = []
    real = moe.route_and_cast
    monkeypatch.setattr(moe, "route_and_cast", lambda *a: calls.append(1) or real(*a))

    def took(m, x, autocast=True):
        calls.clear()
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            m(x)
        return bool(calls)
    x = torch.randn(2, 16, 32, device=DEVICE)
    assert took(layer(), x)
    assert not took(layer(), x, autocast=False)
    assert not took(layer(), x.to(torch.bfloat16))  # a bf16 model: nothing to cast
    assert not took(layer("fused"), x)
    jittery = layer(router_jitter=0.1)
    assert not took(jittery, x) and took(jittery.eval(), x)
    wide = layer(num_experts=moe_kernels.ROUTER_MAX_EXPERTS + 1)
    assert not took(wide, x)
    wrapped = layer()

    class Adapter(torch.nn.Module):  # as PEFT's LoRA wraps a Linear: the wrapper's forward takes x alone
        def __init__(self, base):
            super().__init__()
            self.base = base

        @property
        def weight(self):
            return self.base.weight

        def forward(self, x):
            return self.base(x)
    wrapped.router = Adapter(wrapped.router)
    assert not took(wrapped, x)
    monkeypatch.setattr(moe_kernels, "MOE_KERNELS", "never")
    assert not took(layer(), x)


@pytest.mark.skipif(moe_kernels.triton is None, reason="needs Triton")
def test_the_moe_kernels_compile_for_an_h100_without_spilling(tmp_path):
    """Each kernel builds for sm_90 at its block shape, in bfloat16 and float32, spilling nothing (the sums at k 2 and
    8)."""
    bt, bd, warps = moe_kernels.PAIR_SUMS_BLOCK
    builds = []
    for dtype in ("bf16", "fp32"):
        builds += [("pair_sums", dtype, dict(K=k, BLOCK_T=bt, BLOCK_D=bd, num_warps=warps)) for k in (2, 8)]
        for way, (br, bf, swiglu_warps) in moe_kernels.SWIGLU_BLOCK.items():
            builds.append((f"swiglu_weighted_{way}", dtype, dict(BLOCK_R=br, BLOCK_F=bf, num_warps=swiglu_warps)))
    bt, bd, warps = moe_kernels.ROUTE_CAST_BLOCK
    for E in (8, moe_kernels.ROUTER_MAX_EXPERTS):  # float32 x and router; the cast and its gradient in bfloat16
        for way in ("forward", "backward"):
            rows = {"ROWS": moe_kernels.ROUTER_GRAD_ROWS} if way == "backward" else {}
            builds.append((f"route_cast_{way}", "fp32", dict(EP=max(16, E), BLOCK_T=bt, BLOCK_D=bd, num_warps=warps,
                                                             **rows, _types={"xc": "*bf16", "gc": "*bf16"})))
    assert_they_fit_an_sm(builds, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_default_layer_takes_the_kernels_and_is_as_accurate_as_pytorchs_operators(monkeypatch):
    """On a GPU, at a shape of issue 40's kind (E 8, k 2, bf16 autocast): the eager `grouped_mm` layer takes the
    kernels by default, and its output and gradients are as close to the float32 layer's as PyTorch's operators'
    are."""
    calls = []
    for name in ("swiglu_weighted", "route_and_cast"):
        monkeypatch.setattr(moe, name, lambda *a, _real=getattr(moe, name): calls.append(1) or _real(*a))
    monkeypatch.setattr(moe, "COMPILE_ROUTING", "never")  # the eager layer whole
    torch.manual_seed(0)
    config = MoEConfig(d_model=512, d_ffn=768, num_experts=8, num_experts_per_tok=2, n_head=4,
                       moe_dispatch="grouped_mm")
    m = moe.MoELayer(config, 512).cuda()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x, g = torch.randn(4, 2048, 512, device="cuda"), torch.randn(4, 2048, 512, device="cuda")
    assert moe_kernels.MOE_KERNELS == "cuda"
    ours = pass_of(m, x, g, autocast=True)
    assert calls == [1, 1]
    monkeypatch.setattr(moe_kernels, "MOE_KERNELS", "never")
    plain = pass_of(m, x, g, autocast=True)
    ref = pass_of(m, x, g)  # float32, PyTorch's operators
    assert calls == [1, 1]
    for a, p, r in zip(ours, plain, ref):
        ours_err, plain_err = (a - r).norm().item(), (p - r).norm().item()
        assert ours_err <= 1.1 * plain_err, (ours_err, plain_err)
