"""CUDA graphs for small models (`train.compile_mode: reduce-overhead`): the bookkeeping the loop does around them,
checked with CPU stand-ins; captured for real by bench/gpu_check.py's `graphs` section and the gpu-marked test."""

from types import SimpleNamespace

import pytest
import torch

from helpers import TINY, recipe_accelerator
from s4accel.config import load_recipe
from s4accel.training.devices import graphs
from s4accel.training.step import backward_window


@pytest.mark.parametrize("mode, whole", [("default", False), ("max-autotune-no-cudagraphs", False),
                                         ("reduce-overhead", True), ("max-autotune", True)])
def test_graph_modes_compile_the_whole_model_and_the_others_block_by_block(mode, whole):
    """One graph should cover the embedding, the blocks and the head: regional compilation leaves those eager."""
    acc = recipe_accelerator(["train.compile=true", f"train.compile_mode={mode}"])
    assert acc.state.dynamo_plugin.mode == mode
    assert acc.state.dynamo_plugin.use_regional_compilation is (not whole)
    assert not graphs.captures_graphs(acc)  # no CUDA device here
    line = graphs.start_line(load_recipe(TINY, ["train.compile=true", f"train.compile_mode={mode}"]), acc)
    assert (line is not None) is whole
    if whole:
        assert line.startswith(f"train.compile_mode={mode}: no CUDA device, so no CUDA graphs")


class Replayed(torch.nn.Module):
    """A mixture-of-experts stand-in whose routing statistics live in one buffer that every call overwrites, as a
    CUDA graph's replay does with its outputs."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.counts = torch.zeros(2, 4, dtype=torch.long)  # the graph's static output: (layers, experts)

    def forward(self, x):
        self.counts.copy_(x[:8].long().reshape(2, 4))
        return {"loss": self.w * x.mean(), "expert_counts": self.counts}


@pytest.mark.parametrize("graphs_on", [True, False])
def test_what_a_window_keeps_is_copied_when_graphs_replay(graphs_on):
    """Under accumulation the second micro-batch's replay overwrites the first's outputs: the window's expert counts
    are the sum of both micro-batches' only if they were copied out (checked without: they are wrong)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import GradientAccumulationPlugin

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2,
                                                                                        sync_with_dataloader=False))
    window = [{"x": torch.arange(8.0)}, {"x": torch.arange(8.0) + 10}]
    task = SimpleNamespace(count_items=lambda b: torch.tensor(8), training_step=lambda m, b, s: m(b["x"]))
    totals = backward_window(acc, Replayed(), window, task, graphs=graphs_on)
    right = (torch.arange(8) * 2 + 10).reshape(2, 4)
    assert torch.equal(totals["expert_counts"], right) is graphs_on
    assert totals["loss"].item() == pytest.approx((3.5 + 13.5) / 2)


def test_the_first_step_says_in_one_line_how_many_parts_were_not_captured(monkeypatch, capsys):
    from torch._dynamo.utils import counters

    printed = []
    acc = SimpleNamespace(device=torch.device("cpu"), print=printed.append,
                          state=SimpleNamespace(dynamo_plugin=SimpleNamespace(backend="INDUCTOR",
                                                                              mode="reduce-overhead")))
    monkeypatch.setattr(graphs, "captures_graphs", lambda a: True)  # a CUDA device, as far as the report knows
    monkeypatch.setitem(counters["inductor"], "cudagraph_skips", 3)
    report = graphs.GraphReport(acc)
    counters["inductor"]["cudagraph_skips"] += 2  # two parts skipped during the first step
    report.after_step()
    report.after_step()  # said once
    assert printed == ["CUDA graphs: 2 part(s) of the step could not be captured and run compiled without a graph "
                       "(TORCH_LOGS=cudagraphs says why)"]

    printed.clear()
    quiet = graphs.GraphReport(acc)
    quiet.after_step()  # everything captured: nothing to say
    assert printed == []


def test_no_graphs_without_cuda_or_without_a_graph_mode():
    plugin = SimpleNamespace(backend="INDUCTOR", mode="reduce-overhead")
    assert not graphs.captures_graphs(SimpleNamespace(device=torch.device("cpu"), state=SimpleNamespace(
        dynamo_plugin=plugin)))
    cuda = torch.device("cuda")
    assert graphs.captures_graphs(SimpleNamespace(device=cuda, state=SimpleNamespace(dynamo_plugin=plugin)))
    for backend, mode in (("NO", "reduce-overhead"), ("INDUCTOR", "default")):
        off = SimpleNamespace(backend=backend, mode=mode)
        assert not graphs.captures_graphs(SimpleNamespace(device=cuda, state=SimpleNamespace(dynamo_plugin=off)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["s4d", "s4_moe"])
def test_on_cuda_a_small_model_is_captured_whole_and_trains_as_eager_does(variant):
    """Twelve bf16 training steps of a small model compiled in mode reduce-overhead: nothing skipped by CUDA graphs,
    and the losses within bf16 rounding of eager's (inductor fuses differently: a few 1e-3 relative)."""
    from s4accel import S4Config, S4ForCausalLM

    extra = {"ffn": "moe", "num_experts": 8, "d_ffn": 128} if variant == "s4_moe" else {}
    losses = {}
    for mode in ("eager", "reduce-overhead"):
        torch.manual_seed(0)
        model = S4ForCausalLM(S4Config(vocab_size=259, d_model=64, n_layer=2, d_state=16, dropout=0.0,
                                       **extra)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        ids = torch.randint(3, 259, (8, 128), device="cuda")
        torch._dynamo.reset()
        forward = model if mode == "eager" else torch.compile(model, mode=mode)
        before = graphs.skipped_parts()
        losses[mode] = []
        for _ in range(12):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[mode].append(loss.item())
        if mode != "eager":
            assert graphs.skipped_parts() == before
    torch.testing.assert_close(torch.tensor(losses["reduce-overhead"]), torch.tensor(losses["eager"]), rtol=2e-2,
                               atol=0)
