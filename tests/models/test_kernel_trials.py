"""The Triton kernels are tried once on the GPU at hand before a layer takes them (`kernel_trials.py`): where they
fail to build or launch (less shared memory than the H100 they were written for, an older GPU, another Triton), the
layer takes PyTorch's operators for the same computation and a warning says why, once. Without a GPU the trials run
the kernels in Triton's interpreter on the CPU (`trial_device` pointed there); a failing build is a kernel that
raises Triton's own `OutOfResources`, as a GPU with too little shared memory does."""

import os
import warnings

import pytest
import torch

from s4accel import MoEConfig, S4Config
from s4accel.models import kernel_trials, modeling_s4, moe, moe_kernels, s4d_chunked, s4d_fused
from s4accel.models.modeling_s4 import conv_plan

on_the_cpu = pytest.mark.skipif(s4d_fused.triton is None or torch.cuda.is_available()
                                or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU stand-ins for a GPU: Triton's interpreter")


@pytest.fixture
def trials(monkeypatch):
    """Trials on the CPU, none tried yet, and a way to make one kernel fail as it would to build."""
    monkeypatch.setattr(kernel_trials, "_TRIED", {})
    monkeypatch.setattr(kernel_trials, "trial_device", lambda: torch.device("cpu"))

    def break_kernel(module, name):
        from triton.runtime.errors import OutOfResources

        class Unbuildable:  # `kernel[grid](...)` raising as Triton does where a GPU's shared memory is too small
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    raise OutOfResources(135168, 101376, "shared memory")
                return launch
        monkeypatch.setattr(module, name, Unbuildable())
    return break_kernel


@on_the_cpu
def test_a_trial_runs_once_and_a_failure_is_one_warning_naming_the_error(trials):
    ran = []

    def broken(device):
        raise RuntimeError("no kernel image is available for execution on the device\n(more lines)")
    assert kernel_trials.kernels_fail("Some kernels", "PyTorch's", ("fine",), ran.append) is None
    assert kernel_trials.kernels_fail("Some kernels", "PyTorch's", ("fine",), ran.append) is None
    assert ran == [torch.device("cpu")]  # once
    with pytest.warns(UserWarning, match=r"^Some kernels fail on cpu \(RuntimeError: no kernel image is available "
                                         r"for execution on the device\); PyTorch's$"):
        why = kernel_trials.kernels_fail("Some kernels", "PyTorch's", ("broken",), broken)
    assert why == "RuntimeError: no kernel image is available for execution on the device"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert kernel_trials.kernels_fail("Some kernels", "PyTorch's", ("broken",), broken) == why


@on_the_cpu
def test_without_a_gpu_nothing_is_tried_and_the_kernels_are_taken(monkeypatch):
    """A plan asked for "cuda" on a machine without one (the run's line, the tests above): no trial, no verdict."""
    monkeypatch.setattr(kernel_trials, "_TRIED", {})
    assert kernel_trials.trial_device() is None
    assert kernel_trials.kernels_fail("Some kernels", "PyTorch's", (), lambda d: 1 / 0) is None
    assert kernel_trials._TRIED == {}


@on_the_cpu
def test_fused_s4_kernels_that_fail_here_leave_auto_on_the_chunked_path_and_forced_fused_is_one_line(trials,
                                                                                                    monkeypatch):
    monkeypatch.setattr(modeling_s4, "_bf16_matmuls", lambda: True)  # as on an H100
    config = S4Config(d_state=64)
    # the real kernels pass their trial (the discretization, the matrices, the convolution, forward and backward)
    assert conv_plan(config, "cuda", torch.float32, torch.bfloat16, 4096) == ("fused", 64, torch.bfloat16)
    assert conv_plan(config, "cuda", torch.float32, None, 4096) == ("fused", 32, torch.float32)
    trials(s4d_fused, "_forward_kernel")
    with pytest.warns(UserWarning, match=r"The fused S4 kernels fail on cpu \(OutOfResources: out of resource: "
                                         r"shared memory, Required: 135168.*S4 layers take the chunked path"):
        plan = conv_plan(S4Config(d_state=64, conv_chunk=128), "cuda", torch.float32, torch.bfloat16, 4096)
    assert plan == ("chunked", 128, torch.bfloat16)
    assert conv_plan(config, "cuda", torch.float32, torch.bfloat16, 4096).path == "fused"  # tried before: it ran
    with pytest.raises(ValueError, match=r"^conv_path='fused' cannot run here: its Triton kernels fail on this GPU "
                                         r"\(OutOfResources: out of resource: shared memory"):
        conv_plan(S4Config(d_state=64, conv_chunk=128, conv_path="fused"), "cuda", torch.float32, torch.bfloat16)


@on_the_cpu
def test_a_bilinear_model_keeps_the_fused_path_where_only_the_zoh_discretization_kernel_fails(trials, monkeypatch):
    """The ZOH discretization has a kernel of its own; a bilinear model never launches it, so its failure leaves
    bilinear layers on the fused kernels."""
    monkeypatch.setattr(modeling_s4, "_bf16_matmuls", lambda: True)
    trials(s4d_fused, "_discretize_forward_kernel")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert conv_plan(S4Config(disc="bilinear"), "cuda", torch.float32, torch.bfloat16, 4096).path == "fused"
    with pytest.warns(UserWarning, match="The fused S4 kernels fail"):
        assert conv_plan(S4Config(disc="zoh"), "cuda", torch.float32, torch.bfloat16, 4096).path == "chunked"


@on_the_cpu
def test_a_failed_trial_holds_inside_torch_compile_which_tries_nothing_itself(trials):
    """A compiled layer asks the plan again while dynamo traces it: the eager trial's verdict, in one graph; where no
    trial ran, the kernels (a compiled run's eager start, which prints the plan, has tried them)."""
    def compiled_plan():
        @torch.compile(fullgraph=True, backend="eager")
        def f(x):
            return x + (1.0 if s4d_fused.why_not_fused("cuda", torch.bfloat16, 128, 64) is None else 2.0)
        torch._dynamo.reset()
        return f(torch.zeros(1)).item()
    assert compiled_plan() == 1.0 and kernel_trials._TRIED == {}
    trials(s4d_fused, "_backward_kernel")
    with pytest.warns(UserWarning, match="The fused S4 kernels fail"):
        assert s4d_fused.why_not_fused("cuda", torch.bfloat16, 128, 64) is not None
    assert compiled_plan() == 2.0


@on_the_cpu
@pytest.mark.parametrize("broken", ["_pair_sums_kernel", "_swiglu_weighted_backward_kernel",
                                    "_route_cast_forward_kernel"])
def test_moe_kernels_that_fail_here_leave_the_layer_on_pytorchs_operators_computing_the_same(broken, trials,
                                                                                            monkeypatch):
    """The eager `grouped_mm` layer under autocast, where `MOE_KERNELS` would take the kernels: with one of them
    unbuildable, the layer computes, bit for bit, what it computes with that family of kernels switched off."""
    def layer_pass():
        torch.manual_seed(0)
        config = MoEConfig(d_model=32, d_ffn=48, num_experts=4, num_experts_per_tok=2, n_head=4,
                               moe_dispatch="grouped_mm")
        m = moe.MoELayer(config, 32)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.1)
        x = torch.randn(2, 10, 32, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = m(x)
        y.float().sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in m.parameters()]
    monkeypatch.setattr(moe_kernels, "MOE_KERNELS", "never")
    plain = layer_pass()
    monkeypatch.setattr(moe_kernels, "MOE_KERNELS", "always")
    with_kernels = layer_pass()  # (their trials pass)
    assert any(not torch.equal(a, b) for a, b in zip(with_kernels, plain))  # the kernels did run
    monkeypatch.setattr(kernel_trials, "_TRIED", {})
    trials(moe_kernels, broken)
    with pytest.warns(UserWarning, match=r"The MoE (layer's sum and activation|router's) kernels fail on cpu "
                                         r"\(OutOfResources"):
        without = layer_pass()
    router = broken.startswith("_route")
    x, w = torch.ones(5, 32), torch.ones(4, 32)
    assert moe_kernels.router_kernel_takes(x, w, torch.bfloat16) is not router
    assert moe_kernels.moe_kernels_run(x.bfloat16()) is router
    # the same as the layer with only that family switched off (the other's kernels still run)
    if router:
        monkeypatch.setattr(moe_kernels, "ROUTER_MAX_EXPERTS", 0)
    else:
        monkeypatch.setattr(moe, "moe_kernels_run", lambda x: False)
    assert all(torch.equal(a, b) for a, b in zip(without, layer_pass()))


@on_the_cpu
def test_the_s4_layers_glu_and_transpose_trials_run_their_kernels():
    """The trials of the GLU and transpose kernels (which run on CUDA tensors alone) build and run them here, and a
    broken kernel fails them."""
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        s4d_chunked._glu_trial(cpu, dtype)
        s4d_chunked._transpose_trial(cpu, torch.float32, dtype)
    src = torch.randn(2, 70, 90)
    dst = torch.empty(2, 90, 70)
    s4d_chunked._transpose(src, dst)
    assert torch.equal(dst, src.transpose(1, 2))


@on_the_cpu
@pytest.mark.parametrize("broken", ["_glu_forward_kernel", "_glu_backward_kernel", "_transpose_kernel"])
def test_a_broken_glu_or_transpose_kernel_fails_its_trial(broken, trials):
    trials(s4d_chunked, broken)
    cpu = torch.device("cpu")
    with pytest.raises(Exception, match="out of resource"):
        (s4d_chunked._transpose_trial(cpu, torch.float32, torch.bfloat16) if broken == "_transpose_kernel"
         else s4d_chunked._glu_trial(cpu, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or s4d_fused.triton is None, reason="needs a CUDA device")
def test_on_the_gpu_every_family_of_kernels_passes_its_trial_and_is_taken(monkeypatch):
    """On the H100 or H200 the kernels were written for, no trial fails: a failure here would mean the runs and the
    benchmarks time PyTorch's operators instead of the kernels, with only a warning to say so."""
    monkeypatch.setattr(kernel_trials, "_TRIED", {})
    monkeypatch.setattr(moe_kernels, "MOE_KERNELS", "cuda")
    torch.cuda.set_sync_debug_mode("error")  # a trial is lazy initialisation: it may wait, also where steps may not
    try:
        for dtype, T in ((torch.bfloat16, 64), (torch.float32, 32)):
            assert s4d_fused.why_not_fused("cuda", dtype, T, 64) is None
        assert torch.cuda.get_sync_debug_mode() == 2
    finally:
        torch.cuda.set_sync_debug_mode("default")
    half, x32 = torch.ones(8, 32, device="cuda", dtype=torch.bfloat16), torch.ones(8, 32, device="cuda")
    assert s4d_chunked.glu_kernels_run(half) and s4d_chunked.glu_kernels_run(x32)
    out = torch.empty(2, 32, 4, device="cuda", dtype=torch.bfloat16)
    s4d_chunked.transpose_into(x32.view(2, 4, 32), out)
    assert torch.equal(out, x32.view(2, 4, 32).transpose(1, 2).bfloat16())
    assert moe_kernels.moe_kernels_run(half)
    for E in (8, 32):
        assert moe_kernels.router_kernel_takes(x32, torch.ones(E, 32, device="cuda"), torch.bfloat16)
    assert len(kernel_trials._TRIED) == 8 and kernel_trials.trial_failures() == {}
