"""The mixture-of-experts layer and models: routing maths, dispatch paths, capacity, losses, generation, export."""

import math

import pytest
from huggingface_hub.errors import StrictDataclassError  # the config classes are strict dataclasses
import torch
from torch.nn import functional as F

from s4accel.models import moe
from s4accel.models.configuration_moe import MoEConfig
from s4accel.models.moe import MoELayer, SwiGLUMLP, load_balancing_loss, router_z_loss


def moe_config(**kw):
    base = dict(d_model=16, n_layer=2, n_head=2, d_ffn=24, num_experts=4, num_experts_per_tok=2, vocab_size=40)
    return MoEConfig(**{**base, **kw})


def layer(seed=0, **kw):
    torch.manual_seed(seed)
    m = MoELayer(moe_config(**kw), 16)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def dense_like_expert(m: MoELayer, e: int) -> SwiGLUMLP:
    mlp = SwiGLUMLP(16, 24)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(m.experts.gate_up_proj[e])
        mlp.down_proj.weight.copy_(m.experts.down_proj[e])
    return mlp


def test_one_expert_top1_is_exactly_the_dense_swiglu_mlp():
    m = layer(num_experts=1, num_experts_per_tok=1)
    x = torch.randn(3, 7, 16)
    y, aux = m(x)
    assert torch.equal(y, dense_like_expert(m, 0)(x))
    assert aux["expert_counts"].tolist() == [21]


def test_identical_experts_equal_the_dense_mlp_for_any_router_when_renormalised():
    m = layer(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    with torch.no_grad():
        m.experts.gate_up_proj.copy_(m.experts.gate_up_proj[:1].expand_as(m.experts.gate_up_proj))
        m.experts.down_proj.copy_(m.experts.down_proj[:1].expand_as(m.experts.down_proj))
    x = torch.randn(2, 9, 16)
    dense = dense_like_expert(m, 0)(x)
    for seed in range(3):  # whatever the router says
        torch.manual_seed(seed)
        torch.nn.init.normal_(m.router.weight, std=3.0)
        torch.testing.assert_close(m(x)[0], dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("chunk_rows", [1, 10, 2048])  # fused windows: a row each, experts split over windows, one
def test_every_dispatch_path_gives_the_same_outputs_and_gradients(capacity_factor, shared, chunk_rows, monkeypatch):
    monkeypatch.setattr(moe, "_CHUNK_BYTES", chunk_rows * 2 * 24 * 4)  # rows of (gate | up), d_ffn 24, float32
    results = {}
    x0 = torch.randn(4, 8, 16)
    for dispatch in ("loop", "grouped_mm", "fused"):  # loop: the plain-autograd reference
        m = layer(capacity_factor=capacity_factor, num_shared_experts=shared, moe_dispatch=dispatch)
        x = x0.clone().requires_grad_()
        y, aux = m(x)
        (y * torch.linspace(-1, 1, 16)).sum().backward()
        results[dispatch] = (y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}, aux)
    y0, gx0, gp0, a0 = results["loop"]
    for dispatch in ("grouped_mm", "fused"):
        y1, gx1, gp1, a1 = results[dispatch]
        torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
        for name in gp0:
            torch.testing.assert_close(gp1[name], gp0[name], rtol=1e-5, atol=1e-6)
        assert torch.equal(a0["expert_counts"], a1["expert_counts"])


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_grouped_dispatch_with_padding_and_capacity_equals_the_loop(capacity_factor):
    """The static row layout (padding routed to a sentinel, dropped pairs to a spare row of weight 0) against the
    plain-autograd loop over the real tokens' sorted pairs: values, every gradient, the statistics."""
    x0 = torch.randn(3, 10, 16)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, 7:] = 0
    results = {}
    for dispatch in ("loop", "grouped_mm"):
        m = layer(capacity_factor=capacity_factor, num_shared_experts=1, moe_dispatch=dispatch)
        x = x0.clone().requires_grad_()
        y, aux = m(x, mask)
        ((y * torch.linspace(-1, 1, 16)).sum() + aux["balance_loss"] + aux["z_loss"]).backward()
        results[dispatch] = (y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}, aux)
    (y0, gx0, gp0, a0), (y1, gx1, gp1, a1) = results["loop"], results["grouped_mm"]
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    for name in gp0:
        torch.testing.assert_close(gp1[name], gp0[name], rtol=1e-5, atol=1e-6)
    assert torch.equal(a0["expert_counts"], a1["expert_counts"]) and torch.equal(a0["dropped"], a1["dropped"])


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_compiled_routing_equals_the_eager_routing_values_layout_and_gradients(capacity_factor, monkeypatch):
    """An eager `grouped_mm` layer on a GPU runs its routing (softmax, top-k, the static row layout, the losses)
    compiled: the same rows and counts as eager, the routing weights and losses to rounding, and the same gradients
    of the router logits; with padding and without, at two token counts (dynamic shapes: one graph each way)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(moe, "COMPILE_ROUTING", "always")
    monkeypatch.setattr(moe, "_ROUTING_FAILED", [])
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    for T in (40, 56):
        for valid in (None, torch.rand(T) > 0.25):
            logits = torch.randn(T, 4, requires_grad=True)
            capacity = None if capacity_factor is None else math.ceil(capacity_factor * T * 2 / 4)
            args = (logits, valid, capacity, 4, 2, True)
            compiled, eager = moe.route_eagerly_or_compiled(*args), moe.routing(*args)
            (token, offs, pair_row, weight), counts, dropped, balance, z = compiled
            (token0, offs0, pair_row0, weight0), counts0, dropped0, balance0, z0 = eager
            for got, want in ((token, token0), (offs, offs0), (pair_row, pair_row0), (counts, counts0),
                              (dropped, dropped0)):
                assert got.dtype == want.dtype and torch.equal(got, want)
            for got, want in ((weight, weight0), (balance, balance0), (z, z0)):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
            g = torch.randn_like(weight)
            grads = [torch.autograd.grad((w * g).sum() + 0.3 * b + 0.7 * zz, logits)[0]
                     for w, b, zz in ((weight, balance, z), (weight0, balance0, z0))]
            torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert not moe._ROUTING_FAILED and counters["stats"]["unique_graphs"] == 2  # compiled: with padding, without


@pytest.mark.parametrize("switch, failed, factory, says", [
    ("COMPILE_ROUTING", "_ROUTING_FAILED", "_compiled_routing", "MoE routing runs"),
    ("COMPILE_EXPERTS", "_EXPERTS_FAILED", "_compiled_routed_experts", "The MoE experts and their routing run")])
def test_a_layer_whose_compiled_part_does_not_compile_warns_once_and_runs_it_eagerly(switch, failed, factory, says,
                                                                                     monkeypatch):
    """Where compiling the routing (or the routing and experts together, in bf16) fails (no compiler, an unsupported
    torch), the layer says so once and runs that part eagerly from then on, with the same results."""
    def broken(*args):
        def compiled(*a):
            raise RuntimeError("no C++ compiler found")
        return compiled
    monkeypatch.setattr(moe, switch, "always")
    monkeypatch.setattr(moe, failed, [])
    monkeypatch.setattr(moe, factory, broken)
    m, x = layer(moe_dispatch="grouped_mm"), torch.randn(2, 8, 16)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)  # where COMPILE_EXPERTS compiles
    with bf16, pytest.warns(UserWarning, match=f"{says} eagerly: compiling it failed .RuntimeError: no C"):
        y, aux = m(x)
    monkeypatch.setattr(moe, switch, "never")
    with bf16:
        y0, aux0 = m(x)
    assert torch.equal(y, y0) and torch.equal(aux["balance_loss"], aux0["balance_loss"])
    monkeypatch.setattr(moe, switch, "always")
    import warnings
    with bf16, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(m(x)[0], y0)  # no second warning


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_routing_and_experts_compiled_together_equal_the_eager_layer(capacity_factor, monkeypatch):
    """`COMPILE_EXPERTS`: an eager `grouped_mm` layer under bf16 autocast may run its routing and its experts as one
    compiled graph: the same expert counts and dropped pairs as eager, its output, losses and every gradient (input,
    router, experts, shared expert) to bf16 rounding (compiled, the activation is rounded once, eager after each
    operation); with padding and without, at two token counts (dynamic shapes: one graph each way). In float32,
    where grouped_mm does not compile, the layer stays eager, without trying."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(moe, "_EXPERTS_FAILED", [])
    monkeypatch.setattr(moe, "COMPILE_ROUTING", "never")
    torch._dynamo.reset()
    counters.clear()
    m = layer(capacity_factor=capacity_factor, num_shared_experts=1, moe_dispatch="grouped_mm")
    for L in (10, 14):
        x0, g = torch.randn(4, L, 16), torch.randn(4, L, 16)
        for mask in (None, (torch.rand(4, L) > 0.25).long()):
            results = []
            for mode in ("always", "never"):
                monkeypatch.setattr(moe, "COMPILE_EXPERTS", mode)
                x = x0.clone().requires_grad_()
                m.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y, aux = m(x, mask)
                ((y.float() * g).sum() + 0.3 * aux["balance_loss"] + 0.7 * aux["z_loss"]).backward()
                results.append((y.float(), aux, x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}))
            (y, aux, gx, grads), (y0, aux0, gx0, grads0) = results
            assert torch.equal(aux["expert_counts"], aux0["expert_counts"]) and torch.equal(aux["dropped"],
                                                                                          aux0["dropped"])
            torch.testing.assert_close(aux["balance_loss"], aux0["balance_loss"], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(aux["z_loss"], aux0["z_loss"], rtol=1e-6, atol=1e-7)
            for got, want in ((y, y0), (gx, gx0), *((grads[n], grads0[n]) for n in grads0)):
                assert (got - want).norm() <= 1e-2 * want.norm()  # bf16's 2^-8, a few roundings, spread over all
    assert not moe._EXPERTS_FAILED and counters["stats"]["unique_graphs"] == 2  # compiled: with padding, without
    monkeypatch.setattr(moe, "COMPILE_EXPERTS", "always")
    x = torch.randn(2, 8, 16)
    y, _ = m(x)
    monkeypatch.setattr(moe, "COMPILE_EXPERTS", "never")
    assert torch.equal(y, m(x)[0]) and not moe._EXPERTS_FAILED and counters["stats"]["unique_graphs"] == 2


def test_a_compiled_float32_layer_takes_the_fused_dispatch_as_grouped_mm_compiles_in_bf16_alone():
    """torch.compile's grouped_mm accepts bf16 alone (the premise, checked on this torch: a float32 grouped_mm layer
    does not compile), so `auto` gives a compiled float32 layer on a GPU the `fused` dispatch, and bf16 keeps
    `grouped_mm`; eagerly both are grouped_mm's (on a GPU: test_on_cuda_a_compiled_float32_layer_trains_...)."""
    m, x = layer(moe_dispatch="grouped_mm"), torch.randn(2, 8, 16)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="BF16"):
        torch.compile(lambda x: m(x)[0].sum(), backend="aot_eager", fullgraph=True)(x)
    assert moe.grouped_mm_traceable(torch.bfloat16, compiling=True)
    assert not moe.grouped_mm_traceable(torch.float32, compiling=True)
    assert moe.grouped_mm_traceable(torch.float32, compiling=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert moe.compute_dtype(x) == torch.bfloat16
    assert moe.compute_dtype(x) == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_compiled_float32_layer_trains_as_the_eager_one():
    """On a GPU `auto` is `grouped_mm` in float32 eagerly, and `fused` under torch.compile (where grouped_mm does not
    compile in float32): the compiled layer runs, with the eager layer's values and gradients."""
    torch._dynamo.reset()
    m = layer(moe_dispatch="auto").cuda()
    x0 = torch.randn(2, 32, 16, device="cuda")
    results = []
    for forward in (torch.compile(lambda x: m(x)[0]), lambda x: m(x)[0]):
        x = x0.clone().requires_grad_()
        m.zero_grad()
        forward(x).square().sum().backward()
        results.append((x.grad, m.experts.gate_up_proj.grad.clone()))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_grouped_dispatch_has_no_data_dependent_shape(capacity_factor):
    """The GPU's dispatch never waits for the GPU inside a forward or backward: traced whole by torch.compile
    (fullgraph), which refuses a host read (`.item()`, `.tolist()`, `int(tensor)`) and a shape that depends on values
    (a boolean index, `bincount`); `torch.cuda.set_sync_debug_mode` checks the same on a GPU (bench/gpu_check.py)."""
    m = layer(capacity_factor=capacity_factor, moe_dispatch="grouped_mm").to(torch.bfloat16)  # as the GPU runs it
    x, mask = torch.randn(2, 12, 16, dtype=torch.bfloat16), torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0

    def step(x, mask):
        y, aux = m(x, mask)
        return y.sum() + aux["balance_loss"] + aux["z_loss"]

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, mask), step(x, mask))


@pytest.mark.parametrize("chunk_rows", [1, 7, 2048])
def test_fused_experts_backward_passes_gradcheck(chunk_rows, monkeypatch):
    """The hand-written backward against finite differences in float64: idle experts, experts split over windows."""
    T, D, Fh, E = 6, 5, 3, 4
    monkeypatch.setattr(moe, "_CHUNK_BYTES", chunk_rows * 2 * Fh * 8)  # float64
    torch.manual_seed(0)
    sizes = [4, 0, 5, 3]  # expert 1 gets no pair
    token = torch.cat([torch.randperm(T)[:n] for n in sizes])
    args = [torch.randn(T, D), torch.randn(E, 2 * Fh, D), torch.randn(E, D, Fh), token, torch.rand(len(token)), sizes]
    args = [a.double().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    assert torch.autograd.gradcheck(moe.SwiGLUExpertsFunction.apply, args)
    args[0].grad = None
    moe.SwiGLUExpertsFunction.apply(*args).sum().backward()
    assert args[1].grad[1].abs().sum() == 0 and args[2].grad[1].abs().sum() == 0


def test_fused_dispatch_under_bfloat16_autocast_is_as_accurate_as_the_loop():
    """Both bf16 paths land as close to the float32 result; the fused one keeps fp32 master gradients."""
    x0 = torch.randn(2, 12, 16)
    results = {}
    for dispatch, bf16 in (("loop", False), ("loop", True), ("fused", True)):
        m = layer(moe_dispatch=dispatch)
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y, _ = m(x)
        y.float().sum().backward()
        assert y.dtype == (torch.bfloat16 if bf16 else torch.float32)
        assert m.experts.gate_up_proj.grad.dtype == torch.float32
        results[dispatch, bf16] = (y.float(), x.grad, m.experts.gate_up_proj.grad, m.router.weight.grad)
    reference = results["loop", False]
    for a, b, ref in zip(results["fused", True], results["loop", True], reference):
        err_fused, err_loop = ((a - ref).norm() / ref.norm()).item(), ((b - ref).norm() / ref.norm()).item()
        assert err_fused < 0.02 and err_fused < 2 * err_loop + 1e-3


def test_fused_windows_cover_every_pair_once_and_split_long_expert_slices():
    assert moe._chunks([3, 0, 5, 2], 4) == [(0, 4, [0, 2], [3, 1]), (4, 8, [2], [4]), (8, 10, [3], [2])]
    assert moe._chunks([3, 0, 5, 2], 100) == [(0, 10, [0, 2, 3], [3, 5, 2])]
    assert moe._chunks([0, 0], 4) == []


def test_the_sorted_dispatch_equals_a_plain_per_token_sum():
    """y_t = sum_j w_j SwiGLU_{e_j}(x_t), written out token by token: the obviously correct reference."""
    m = layer(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
    x = torch.randn(10, 16)
    y, aux = m(x)
    probs = aux["router_logits"].softmax(-1)
    w, e = probs.topk(2, dim=-1)
    expected = torch.stack([sum(w[t, j] * dense_like_expert(m, int(e[t, j]))(x[t]) for j in range(2))
                            for t in range(10)])
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


def test_load_balancing_loss_is_k_under_uniform_routing_and_grows_under_collapse():
    E, k, T = 8, 2, 64
    probs = torch.full((T, E), 1 / E)
    experts = (torch.arange(T * k).reshape(T, k)) % E  # every expert chosen equally often
    assert load_balancing_loss(probs, experts, E).item() == pytest.approx(k)
    # Collapse: one expert gets every token with probability ~1 -> E (top-1).
    collapsed = torch.full((T, E), 1e-6)
    collapsed[:, 3] = 1 - 7e-6
    assert load_balancing_loss(collapsed, torch.full((T, 1), 3), E).item() == pytest.approx(E, rel=1e-4)
    assert load_balancing_loss(collapsed, torch.full((T, 1), 3), E) > load_balancing_loss(probs, experts[:, :1], E)


@pytest.mark.parametrize("dispatch", ["fused", "grouped_mm"])
def test_padding_is_not_routed_and_does_not_enter_the_losses(dispatch):
    m = layer(moe_dispatch=dispatch)
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    y, aux = m(x, mask)
    assert aux["expert_counts"].sum().item() == 10 * 2  # real tokens x k
    assert torch.equal(y[0, :2], torch.zeros(2, 16))
    real = mask.reshape(-1).bool()
    torch.testing.assert_close(aux["z_loss"], router_z_loss(aux["router_logits"][real]))


def test_z_loss_is_the_mean_squared_logsumexp():
    m = layer()
    _, aux = m(torch.randn(3, 5, 16))
    logits = aux["router_logits"]
    torch.testing.assert_close(aux["z_loss"], (torch.logsumexp(logits, -1) ** 2).mean())


@pytest.mark.parametrize("dispatch", ["fused", "grouped_mm"])
def test_capacity_limits_each_expert_and_overflow_output_is_zero(dispatch):
    m = layer(num_experts=4, num_experts_per_tok=1, capacity_factor=1.0, moe_dispatch=dispatch)
    with torch.no_grad():  # route every token to expert 0
        m.router.weight.zero_()
        m.router.weight[0].fill_(1.0)
    x = torch.rand(1, 12, 16) + 0.1  # positive inputs: logit 0 wins
    y, aux = m(x)
    capacity = math.ceil(1.0 * 12 * 1 / 4)
    assert aux["dropped"].item() == 12 - capacity
    kept = (y[0].abs().sum(-1) > 0).nonzero().flatten().tolist()
    assert kept == list(range(capacity))  # first come, first served; the rest output zero
    assert torch.equal(y[0, capacity:], torch.zeros(12 - capacity, 16))


@pytest.mark.parametrize("dispatch", ["fused", "grouped_mm"])
def test_capacity_serves_first_choices_before_second_choices(dispatch):
    """Each expert keeps its first-choice tokens in token order, then second choices, up to capacity."""
    m = layer(num_experts=2, num_experts_per_tok=2, capacity_factor=0.5, norm_topk_prob=False, moe_dispatch=dispatch)
    x = torch.randn(8, 16)
    y, aux = m(x)
    capacity = math.ceil(0.5 * 8 * 2 / 2)
    probs = aux["router_logits"].softmax(-1)
    first = probs.argmax(-1).tolist()
    expected = torch.zeros(8, 16)
    for e in range(2):
        queue = [t for t in range(8) if first[t] == e] + [t for t in range(8) if first[t] != e]
        for t in queue[:capacity]:
            expected[t] += probs[t, e] * dense_like_expert(m, e)(x[t])
    assert aux["dropped"].item() == 16 - 2 * capacity
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


def test_router_runs_in_float32_under_bfloat16_autocast():
    m = layer()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = m(torch.randn(2, 5, 16))
    assert aux["router_logits"].dtype == torch.float32
    assert y.dtype == torch.bfloat16


def test_jitter_perturbs_routing_in_training_only():
    m = layer(router_jitter=0.5)
    x = torch.randn(2, 5, 16)
    m.eval()
    assert torch.equal(m(x)[1]["router_logits"], m(x)[1]["router_logits"])
    m.train()
    assert not torch.equal(m(x)[1]["router_logits"], m(x)[1]["router_logits"])


def test_shared_experts_are_added_for_every_token():
    m = layer(num_shared_experts=1)
    x = torch.randn(2, 5, 16)
    y, _ = m(x)
    shared = m.shared_experts(x)
    m.shared_experts = None
    torch.testing.assert_close(y, m(x)[0] + shared)


def test_an_expert_without_tokens_still_gets_a_zero_gradient():
    """Every expert weight takes part in the graph, so DDP never waits for an unused parameter (it would raise
    "Expected to have finished reduction")."""
    for dispatch in ("grouped_mm", "fused", "loop"):
        m = layer(num_experts=4, num_experts_per_tok=1, moe_dispatch=dispatch)
        with torch.no_grad():
            m.router.weight.zero_()
            m.router.weight[0].fill_(1.0)
        y, aux = m(torch.rand(1, 6, 16) + 0.1)
        assert aux["expert_counts"].tolist() == [6, 0, 0, 0]
        y.sum().backward()
        assert m.experts.gate_up_proj.grad is not None
        assert m.experts.gate_up_proj.grad[1:].abs().sum() == 0
        assert m.experts.gate_up_proj.grad[0].abs().sum() > 0


# ----------------------------------------------------------------------------------------------------------------
# Models


@pytest.fixture
def moe_lm():
    from s4accel import MoEForCausalLM

    torch.manual_seed(0)
    return MoEForCausalLM(moe_config()).eval()


def test_model_loss_is_lm_loss_plus_weighted_router_losses(moe_lm):
    ids = torch.randint(2, 40, (2, 12))
    out = moe_lm(ids, labels=ids)
    lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, 40), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, lm + out.aux_loss)
    c = moe_lm.config
    torch.testing.assert_close(out.aux_loss.detach(),
                               c.router_aux_loss_coef * out.balance_loss + c.router_z_loss_coef * out.z_loss)
    assert out.aux_loss > 0 and len(out.router_logits) == c.n_layer
    assert out.router_logits[0].shape == (24, c.num_experts)
    assert out.expert_counts.shape == (c.n_layer, c.num_experts)
    assert out.expert_counts.sum(-1).tolist() == [24 * c.num_experts_per_tok] * c.n_layer


def test_dense_baseline_has_no_router_and_no_aux_loss():
    from s4accel import MoEForCausalLM

    model = MoEForCausalLM(moe_config(use_moe=False))
    ids = torch.randint(2, 40, (1, 8))
    out = model(ids, labels=ids)
    assert out.aux_loss is None and out.expert_counts is None
    assert not any("router" in n or "experts" in n for n, _ in model.named_parameters())


def test_moe_every_alternates_dense_and_moe_blocks():
    from s4accel import MoEForCausalLM

    model = MoEForCausalLM(moe_config(n_layer=4, moe_every=2))
    assert [b.is_moe for b in model.model.layers] == [False, True, False, True]


def test_attention_is_causal(moe_lm):
    ids = torch.randint(2, 40, (1, 10))
    changed = ids.clone()
    changed[0, 6] = (ids[0, 6] + 1) % 40
    a, b = moe_lm(ids).logits, moe_lm(changed).logits
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_the_rotary_angles_are_computed_once_a_forward_and_rotate_by_position(moe_lm):
    """One cos and one sin per forward, shared by every layer (inside each layer, torch.compile recomputed them
    for every element of q and k); the rotation turns each pair (x_i, x_{i + d/2}) by position * theta^(-2i/d)."""
    from torch.overrides import TorchFunctionMode

    from s4accel.models.modeling_moe import rotate, rotation

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    with Count() as count:
        moe_lm(torch.randint(2, 40, (2, 9)))
    assert moe_lm.config.n_layer > 1 and (count.calls.count("cos"), count.calls.count("sin")) == (1, 1)
    d, theta, p = 8, 100.0, 5
    x = torch.randn(1, 1, p + 1, d, dtype=torch.float64)
    y = rotate(x, rotation(torch.arange(p + 1)[None], d, theta))
    for i in range(d // 2):
        a = p * theta ** (-2 * i / d)
        u, v = x[0, 0, p, i].item(), x[0, 0, p, i + d // 2].item()
        want = (u * math.cos(a) - v * math.sin(a), v * math.cos(a) + u * math.sin(a))
        assert y[0, 0, p, i].item() == pytest.approx(want[0], abs=1e-5)
        assert y[0, 0, p, i + d // 2].item() == pytest.approx(want[1], abs=1e-5)


def test_greedy_generate_with_kv_cache_equals_without(moe_lm):
    ids = torch.randint(2, 40, (2, 6))
    kw = dict(max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    assert torch.equal(moe_lm.generate(ids, use_cache=True, **kw), moe_lm.generate(ids, use_cache=False, **kw))


def test_batched_left_padded_prompts_equal_one_by_one(moe_lm):
    prompts = [torch.randint(2, 40, (n,)) for n in (3, 7)]
    singles = [moe_lm.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=8,
                               do_sample=False)[0, len(p):] for p in prompts]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 7 - len(p):], mask[i, 7 - len(p):] = p, 1
    batched = moe_lm.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)[:, 7:]
    for i in range(2):
        assert torch.equal(batched[i], singles[i])


def test_config_field_top_k_does_not_leak_into_sampling(moe_lm):
    assert moe_lm.generation_config.top_k in (None, 50)  # transformers' default, not the router's k


@pytest.mark.parametrize("family", ["moe", "s4-moe"])
def test_save_and_from_pretrained_round_trip(tmp_path, family):
    from transformers import AutoModelForCausalLM

    import s4accel  # noqa: F401  (registers the Auto classes)
    from s4accel import MoEForCausalLM, S4Config, S4ForCausalLM

    torch.manual_seed(0)
    if family == "moe":
        model = MoEForCausalLM(moe_config(num_shared_experts=1)).eval()
    else:
        model = S4ForCausalLM(S4Config(d_model=16, n_layer=2, d_state=8, vocab_size=40, ffn="moe", d_ffn=24,
                                       num_experts=4)).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    ids = torch.randint(2, 40, (2, 9))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_s4_blocks_with_moe_feed_forward_train_and_decode_recurrently():
    from s4accel import S4Config, S4ForCausalLM

    torch.manual_seed(0)
    model = S4ForCausalLM(S4Config(d_model=16, n_layer=2, d_state=8, vocab_size=40, ffn="moe", d_ffn=24,
                                   num_experts=4, num_experts_per_tok=1))
    ids = torch.randint(2, 40, (2, 10))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert out.aux_loss > 0
    assert model.backbone.layers[0].ffn.router.weight.grad.abs().sum() > 0  # the router learns from aux + LM loss
    model.eval()
    kw = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones(2, 5, dtype=torch.long))
    assert torch.equal(model.generate(ids[:, :5], use_cache=True, **kw),
                       model.generate(ids[:, :5], use_cache=False, **kw))


def test_s4_mlp_feed_forward_option():
    from s4accel import S4Config, S4ForCausalLM

    model = S4ForCausalLM(S4Config(d_model=16, n_layer=1, d_state=8, vocab_size=40, ffn="mlp", d_ffn=24))
    out = model(torch.randint(2, 40, (1, 5)))
    assert out.aux_loss is None
    assert isinstance(model.backbone.layers[0].ffn, SwiGLUMLP)


@pytest.mark.parametrize("bad, message", [
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(moe_dispatch="fast"), "moe_dispatch"),
    (dict(n_head=3), "n_head"),
])
def test_bad_moe_config_values_are_refused(bad, message):
    with pytest.raises(StrictDataclassError, match=message):
        moe_config(**bad)


def test_s4_classifier_with_moe_blocks_adds_the_router_losses_and_ignores_padding():
    from s4accel import S4Config, S4ForSequenceClassification

    torch.manual_seed(0)
    model = S4ForSequenceClassification(S4Config(d_model=16, n_layer=2, d_state=8, d_input=3, num_labels=4,
                                                 ffn="moe", d_ffn=24, num_experts=4))
    x = torch.randn(2, 7, 3)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    labels = torch.tensor([1, 3])
    out = model(input_values=x, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels) + out.aux_loss)
    assert out.expert_counts.sum(-1).tolist() == [11 * 2, 11 * 2]  # 11 real steps, k = 2, per layer


def test_every_output_class_declares_the_moe_outputs_a_trainer_reads():
    """The names are declared once (`MOE_OUTPUTS`); each output class carries them all, and `router_outputs` reads
    them from any of those outputs (or a dict) in one place."""
    import dataclasses

    from s4accel.models.modeling_moe import MoECausalLMOutput, MoEModelOutput
    from s4accel.models.modeling_s4 import S4CausalLMOutput, S4ModelOutput, S4SequenceClassifierOutput
    from s4accel.models.moe import MOE_OUTPUTS, router_outputs

    for cls in (MoEModelOutput, MoECausalLMOutput, S4ModelOutput, S4CausalLMOutput, S4SequenceClassifierOutput):
        assert set(MOE_OUTPUTS) <= {f.name for f in dataclasses.fields(cls)}, cls.__name__
    out = MoECausalLMOutput(loss=torch.tensor(1.0), aux_loss=torch.tensor(0.1), expert_counts=torch.ones(2, 4))
    assert set(router_outputs(out)) == {"aux_loss", "expert_counts"}
    assert router_outputs({"loss": 1.0}) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("switch", ["COMPILE_ROUTING", "COMPILE_EXPERTS"])
def test_on_cuda_an_eager_layer_compiles_its_routing_without_a_host_sync_and_agrees_with_eager_routing(switch,
                                                                                                     monkeypatch):
    """`COMPILE_ROUTING = "cuda"` (the default): an eager `grouped_mm` layer routes through the compiled `routing`;
    `COMPILE_EXPERTS = "cuda"`: its routing and experts run as one compiled graph. Either way, after the first call
    no forward or backward waits for the GPU, and the values and gradients are those of the same layer eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(moe, "COMPILE_ROUTING", "never")
    m = layer(capacity_factor=0.8, num_shared_experts=1, moe_dispatch="grouped_mm").cuda()
    x0, mask = torch.randn(4, 64, 16, device="cuda"), torch.ones(4, 64, dtype=torch.long, device="cuda")
    mask[1, 50:] = 0
    results = []
    for mode in ("cuda", "never"):
        monkeypatch.setattr(moe, switch, mode)
        try:
            for sync_check in ("default", "error"):  # the first pass compiles; the second must not sync
                x = x0.clone().requires_grad_()
                m.zero_grad()
                torch.cuda.set_sync_debug_mode(sync_check if mode == "cuda" else "default")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y, aux = m(x, mask)
                (y.float().sum() + aux["balance_loss"] + aux["z_loss"]).backward()
                torch.cuda.set_sync_debug_mode("default")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append((y.float(), x.grad, m.router.weight.grad.clone(), aux["expert_counts"]))
    assert not moe._ROUTING_FAILED and not moe._EXPERTS_FAILED and counters["stats"]["unique_graphs"] >= 1
    (y1, gx1, gr1, c1), (y0, gx0, gr0, c0) = results
    assert torch.equal(c1, c0)
    torch.testing.assert_close(y1, y0, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gx1, gx0, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gr1, gr0, rtol=2e-2, atol=2e-3)
