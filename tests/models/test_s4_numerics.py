"""S4 kernel numerics against slow, obviously correct references: every kernel, discretisation and initialisation.

The reference for each fast path: the convolution against running the discrete SSM step by step (`recurrence`), the
FFT against a direct sum, the Cauchy/Woodbury generating function (`kernel="s4"`) against dense matrix powers, the
HiPPO-LegS diagonalisation against LegS's known eigenvalues, the chunked computation with carried state against
the whole sequence.
"""

import math

import pytest
import torch

from s4accel import S4Config, S4ForCausalLM
from s4accel.models.modeling_s4 import S4DKernel, S4Kernel, fft_conv, hippo_legs_nplr

# (kernel, disc, init): every kernel option the config accepts.
VARIANTS = [
    ("s4d", "zoh", "diag-lin"), ("s4d", "zoh", "diag-inv"), ("s4d", "zoh", "diag-legs"), ("s4d", "zoh", "diag-real"),
    ("s4d", "bilinear", "diag-lin"), ("s4d", "bilinear", "diag-inv"), ("s4d", "bilinear", "diag-legs"),
    ("s4d", "bilinear", "diag-real"), ("s4", "bilinear", "legs"),
]
IDS = [f"{k}-{d}-{i}" for k, d, i in VARIANTS]


def make_kernel(kernel="s4d", disc="zoh", init="diag-lin", dtype=torch.float64, seed=0, **overrides):
    torch.manual_seed(seed)
    config = S4Config(**{"d_model": 6, "d_state": 8, "kernel": kernel, "disc": disc, "init": init, "l_max": 64,
                         "dt_min": 0.01, "dt_max": 0.5, **overrides})
    k = (S4DKernel if kernel == "s4d" else S4Kernel)(config)
    k.reset_parameters()
    return k.to(dtype)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------------------------------- convolution


def test_fft_conv_equals_direct_causal_and_bidirectional_sums():
    torch.manual_seed(0)
    u, K = torch.randn(2, 3, 40, dtype=torch.float64), torch.randn(2, 3, 40, dtype=torch.float64)
    causal, both = torch.zeros_like(u), torch.zeros_like(u)
    for t in range(40):
        for s in range(40):
            if s <= t:
                causal[..., t] += K[0, :, t - s] * u[..., s]
            else:
                both[..., t] += K[1, :, s - t - 1] * u[..., s]
    torch.testing.assert_close(fft_conv(u, K[:1]), causal, rtol=0, atol=1e-12)
    torch.testing.assert_close(fft_conv(u, K), causal + both, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("kernel", "disc", "init"), VARIANTS, ids=IDS)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_convolution_equals_recurrence(kernel, disc, init, dtype, tol):
    """The FFT convolution with the kernel equals running x_k = dA x_{k-1} + dB u_k, y_k = C x_k step by step, and
    the state the convolution leaves (`forward_state`) equals the recurrence's last state."""
    k = make_kernel(kernel, disc, init, dtype)
    u = torch.randn(2, 6, 64, dtype=dtype)
    y_rec, x_rec = k.recurrence(u)
    assert rel_err(fft_conv(u, k(64)), y_rec) <= tol
    assert rel_err(k.forward_state(u), x_rec) <= tol


@pytest.mark.parametrize(("kernel", "disc", "init"), VARIANTS, ids=IDS)
def test_chunks_with_carried_state_equal_the_whole_sequence(kernel, disc, init):
    k = make_kernel(kernel, disc, init)
    u = torch.randn(2, 6, 50, dtype=torch.float64)
    whole = fft_conv(u, k(50))
    x = k.forward_state(u[..., :20])
    second = fft_conv(u[..., 20:], k(30)) + k.state_output(x, 30)
    assert rel_err(torch.cat([fft_conv(u[..., :20], k(20)), second], -1), whole) <= 1e-10
    assert rel_err(k.forward_state(u[..., 20:], x), k.forward_state(u)) <= 1e-10


@pytest.mark.parametrize("kernel", ["s4d", "s4"])
def test_a_long_block_passes_states_as_the_recurrence_does(kernel):
    """Over a block longer than the DPLR kernel's sub-blocks (256 steps, the last one partial): the state it leaves,
    what a state before it reaches, and (anti-causal) what the state of the steps after it reaches from its end."""
    init = "diag-lin" if kernel == "s4d" else "legs"
    k = make_kernel(kernel, "bilinear", init, bidirectional=True)
    L = 300
    u = torch.randn(2, 6, L, dtype=torch.float64)
    _, x_rec = k.recurrence(u)
    assert rel_err(k.forward_state(u), x_rec) <= 1e-10
    x0 = k.forward_state(torch.randn(2, 6, 7, dtype=torch.float64))
    y_rec, _ = k.recurrence(torch.zeros_like(u), x0)
    assert rel_err(k.state_output(x0, L), y_rec) <= 1e-10
    # anti-causal: y_(L-1-r) = the causal readout at r of the state x0 read through C_1 instead of C, one step sooner
    k1 = make_kernel(kernel, "bilinear", init, bidirectional=True)
    with torch.no_grad():
        k1.C[0] = k.C[1]
    y1, _ = k1.recurrence(torch.zeros(2, 6, L + 1, dtype=torch.float64), x0)  # y1[..., r + 1] reads dA^(r+1) x0
    assert rel_err(k.state_output(x0, L, direction=1)[..., :-1].flip(-1), y1[..., :L - 1]) <= 1e-10


@pytest.mark.parametrize(("kernel", "disc", "init"), VARIANTS, ids=IDS)
def test_kernel_for_a_shorter_length_is_a_prefix(kernel, disc, init):
    k = make_kernel(kernel, disc, init)
    long = k(150)  # for "s4": longer than l_max=64, so a doubled kernel with C~ converted by dense powers
    for L in (10, 64, 100):
        torch.testing.assert_close(k(L), long[..., :L], rtol=0, atol=1e-12)


@pytest.mark.parametrize("disc", ["zoh", "bilinear"])
def test_closed_form_kernel_of_a_one_mode_real_ssm(disc):
    """N = 2 (one mode), A = -a real: K[l] = 2 Re(C) dB dA^l with the textbook dA, dB."""
    k = make_kernel("s4d", disc, "diag-real", d_model=1, d_state=2)
    with torch.no_grad():
        k.log_A_real.fill_(math.log(0.7))
        k.log_dt.fill_(math.log(0.3))
        k.C.copy_(torch.tensor([[[[0.9, -0.4]]]], dtype=torch.float64))
    a, dt, L = 0.7, 0.3, 20
    if disc == "zoh":
        dA, dB = math.exp(-a * dt), (1 - math.exp(-a * dt)) / a
    else:
        dA, dB = (1 - a * dt / 2) / (1 + a * dt / 2), dt / (1 + a * dt / 2)
    expected = torch.tensor([2 * 0.9 * dB * dA**l for l in range(L)], dtype=torch.float64)
    torch.testing.assert_close(k(L)[0, 0], expected, rtol=1e-12, atol=1e-14)


def test_s4_generating_function_equals_dense_matrix_powers():
    """The Cauchy + Woodbury kernel equals `K[l] = Re(C dA^l dB)` built from dense bilinear matrices."""
    k = make_kernel("s4", "bilinear", "legs")
    dA, dB = k._dense()
    C = k._c_true(dA)[0]
    dense = torch.stack([(C * (torch.linalg.matrix_power(dA, l) @ dB[..., None])[..., 0]).sum(-1).real
                         for l in range(40)], dim=-1)
    assert rel_err(k(40)[0], dense) <= 1e-10


def test_bidirectional_kernel_reads_the_future():
    k = make_kernel("s4d", bidirectional=True)
    K = k(30)
    assert K.shape == (2, 6, 30)
    u = torch.zeros(1, 6, 30, dtype=torch.float64)
    u[..., 20] = 1.0
    y = fft_conv(u, K)
    assert y[..., :20].abs().max() > 1e-3  # positions before the impulse see it
    torch.testing.assert_close(y[..., 20:], K[0, None, :, :10])  # and after it, the causal kernel


# ---------------------------------------------------------------------------------------------------- HiPPO and init


def test_legs_nplr_form_is_normal_and_keeps_legs_eigenvalues():
    N = 8
    n = torch.arange(N, dtype=torch.float64)
    q = torch.sqrt(2 * n + 1)
    A = torch.where(n[:, None] > n[None, :], -q[:, None] * q[None, :], torch.zeros(N, N, dtype=torch.float64))
    A = A - torch.diag(n + 1)  # HiPPO-LegS, written out independently of the model code
    P = torch.sqrt(n + 0.5)
    S = A + torch.outer(P, P)
    torch.testing.assert_close(S @ S.T, S.T @ S, rtol=0, atol=1e-12)  # A + P P^T is normal
    Lambda, Pt, Bt = hippo_legs_nplr(N)
    assert (Lambda.real == -0.5).all() and (Lambda.imag > 0).all()
    # In the full eigenbasis (each mode and its conjugate), Lambda - P~ P~^* is similar to LegS: eigenvalues -1..-N.
    Pf = torch.cat([Pt, Pt.conj()])
    eig = torch.linalg.eigvals(torch.diag(torch.cat([Lambda, Lambda.conj()])) - torch.outer(Pf, Pf.conj()))
    torch.testing.assert_close(eig.real.sort().values, -(n + 1).flip(0), rtol=0, atol=1e-8)
    assert eig.imag.abs().max() < 1e-8
    torch.testing.assert_close((Bt.abs() ** 2).sum() * 2, (q**2).sum())  # B~ = V^* B keeps B's norm


def test_s4d_inits_follow_the_papers():
    N2 = 4
    n = torch.arange(N2, dtype=torch.float64)
    expected = {"diag-lin": (-0.5, math.pi * n), "diag-inv": (-0.5, (8 / math.pi) * (8 / (2 * n + 1) - 1)),
                "diag-real": (-(n + 1), torch.zeros(N2, dtype=torch.float64)),
                "diag-legs": (-0.5, hippo_legs_nplr(8)[0].imag)}
    for init, (real, imag) in expected.items():
        k = make_kernel("s4d", "zoh", init, dt_min=1e-3, dt_max=1e-1)
        A = k._A()
        torch.testing.assert_close(A.real, torch.as_tensor(real, dtype=torch.float64).expand(6, N2).clone(),
                                   atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(A.imag, imag.expand(6, N2), atol=1e-5, rtol=1e-6)
        dt = torch.exp(k.log_dt)
        assert ((dt >= 1e-3) & (dt <= 1e-1)).all()


def test_n_ssm_ties_A_across_channel_groups():
    k = make_kernel("s4", "bilinear", "legs", n_ssm=2)
    assert k.log_A_real.shape == (2, 4) and k.P.shape == (2, 4, 2) and k.C.shape == (1, 6, 4, 2)
    A = k._A()
    torch.testing.assert_close(A[0], A[2])  # channels 0-2 share the first copy
    torch.testing.assert_close(A[3], A[5])


# ---------------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(("kernel", "disc", "init"), [("s4d", "zoh", "diag-lin"), ("s4d", "bilinear", "diag-inv"),
                                                      ("s4", "bilinear", "legs")])
def test_gradcheck_layer_in_float64(kernel, disc, init):
    """Analytic gradients of the kernel + convolution w.r.t. the input and every SSM parameter match finite
    differences."""
    k = make_kernel(kernel, disc, init, d_model=2, d_state=4, l_max=8)
    names = [n for n, _ in k.named_parameters()]
    u = torch.randn(1, 2, 8, dtype=torch.float64, requires_grad=True)

    def f(u, *params):
        y = fft_conv(u, torch.func.functional_call(k, dict(zip(names, params)), (8,)))
        return y

    params = [p.detach().clone().requires_grad_(True) for p in k.parameters()]
    assert torch.autograd.gradcheck(f, (u, *params), eps=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("kernel", ["s4d", "s4"])
@pytest.mark.parametrize("options", [{}, {"prenorm": False}, {"norm": "batch"}], ids=["pre-layer", "post", "batch"])
def test_lm_is_causal(kernel, options):
    """Perturbing the input at t0 leaves every output before t0 unchanged (the FFT is long enough: no wrap-around).
    In float64 so that the only change before t0 is FFT rounding (~1e-16), far below a wrap-around's O(1)."""
    torch.manual_seed(0)
    config = S4Config(d_model=16, n_layer=2, d_state=8, vocab_size=20, kernel=kernel, l_max=64, **options)
    model = S4ForCausalLM(config).double().eval()
    ids = torch.randint(3, 20, (2, 64))
    t0 = 40
    changed = ids.clone()
    changed[:, t0] = (ids[:, t0] + 1) % 20
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert (a[:, :t0] - b[:, :t0]).abs().max() < 1e-12
    assert (a[:, t0:] - b[:, t0:]).abs().max() > 1e-4


@pytest.mark.parametrize("kernel", ["s4d", "s4"])
def test_model_chunks_with_carried_state_equal_the_whole_sequence(kernel):
    """What stateful (TBPTT) training relies on: the logits of a sequence read in chunks, each starting from the
    previous chunk's final states, equal the logits of the whole sequence."""
    torch.manual_seed(0)
    model = S4ForCausalLM(S4Config(d_model=16, n_layer=2, d_state=8, vocab_size=20, kernel=kernel, l_max=32))
    model = model.double().eval()
    ids = torch.randint(3, 20, (2, 60))
    with torch.no_grad():
        whole = model(ids).logits
        cache, chunks = None, []
        for part in ids.split(25, dim=1):
            out = model(part, cache=cache, use_cache=True)
            cache = out.cache
            chunks.append(out.logits)
    assert rel_err(torch.cat(chunks, dim=1), whole) <= 1e-10
