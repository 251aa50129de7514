"""bench/gpu_speed.py, the GPU speed table: a dry run on the CPU (tiny shapes; this checks the script, not a GPU)
writes the dated Markdown and JSON files with every row, and `--merge` joins runs, saying which commit measured each
cell."""

import argparse
import json
import sys
import time

import torch

from helpers import REPO, run_python

SCRIPT = REPO / "bench" / "gpu_speed.py"


def gpu_speed(*args):
    proc = run_python(str(SCRIPT), *args, timeout=600, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_a_dry_run_writes_the_table_and_a_merge_names_each_cells_commit(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    gpu_speed("--device", "cpu", "--quick", "--out-dir", str(first), "--commit", "aaaa", "--sections", "fused_sweep",
              "layer")
    gpu_speed("--device", "cpu", "--quick", "--out-dir", str(second), "--commit", "bbbb", "--sections", "fp32")
    (report_a,), (report_b,) = first.glob("*-gpu-speed-*.json"), second.glob("*-gpu-speed-*.json")
    a = json.loads(report_a.read_text())
    assert a["commit"] == "aaaa" and all(a["results"][f"layer/{m}/L{L}"]["ms"] > 0
                                         for m in ("fused", "chunked", "fft", "attention") for L in (128, 256))
    # the sweep of the fused kernels' shape picks the fastest for the rest of the run
    assert a["results"]["fused_chosen"]["chunk"] in (16, 32)
    table = report_a.with_suffix(".md").read_text()
    assert "| S4Layer, chunked path (eager) | " in table and "| attention / chunked (eager) |" in table
    assert "| S4Layer, fused path (eager) | " in table and "The rest of the run took T " in table

    merged_dir = tmp_path / "merged"
    gpu_speed("--merge", str(report_a), str(report_b), "--out-dir", str(merged_dir), "--note", "two runs")
    merged = json.loads((merged_dir / report_b.name).read_text())
    assert merged["results"]["layer/chunked/L128"]["commit"] == "aaaa"
    assert merged["results"]["fp32/chunked/L128"]["commit"] == "bbbb"
    text = (merged_dir / report_b.name).with_suffix(".md").read_text()
    assert "two runs" in text and "commit `aaaa`" in text and "commit `bbbb`" in text
    assert "| S4Layer, chunked (TF32 allowed: `train.tf32`) | " in text
    assert "| S4Layer, fused (the same, chunks of 64: they spill) | " in text
    # a merged file merged again (a later session's runs added to a day's table) keeps each cell's commit
    again = tmp_path / "again"
    gpu_speed("--merge", str(merged_dir / report_b.name), str(report_b), "--out-dir", str(again))
    twice = json.loads((again / report_b.name).read_text())
    assert twice["results"]["layer/chunked/L128"]["commit"] == "aaaa"
    assert [run["commit"] for run in twice["runs"]] == ["aaaa", "bbbb", "bbbb"]


def test_the_moe_layer_rows_time_this_layer_beside_a_baseline_file(tmp_path):
    baseline = REPO / "s4accel" / "models" / "moe.py"  # any moe.py with a MoELayer: here this checkout's own
    gpu_speed("--device", "cpu", "--quick", "--out-dir", str(tmp_path), "--sections", "moe_layer", "--moe-baseline",
              str(baseline))
    (report,) = tmp_path.glob("*-gpu-speed-*.json")
    results = json.loads(report.read_text())["results"]
    for name in ("moe", "moe_torch_ops", "moe_torch_router", "baseline", "dense", "matmuls_only", "routing_only",
                 "harness"):
        assert results[f"moe_layer/{name}/E8k2"]["ms"] > 0
    assert json.loads(report.read_text())["command"].endswith("--moe-baseline moe.py")
    assert "| 8, 2 | " in report.with_suffix(".md").read_text()


def test_a_profile_is_summed_by_kind_of_kernel_in_the_report():
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_speed

    # names of kernels from a profile of the S4 layer on an H200 (bench/results/2026-11-26-gpu-speed-NVIDIA-H200.json)
    kinds = {"_forward_kernel": "s4d_fused", "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TTN": "matmul",
             "triton_poi_fused__to_copy_gelu_0": "inductor", "_transpose_kernel": "copy_cast",
             "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<ch": "fill",
             "void at::native::glu_backward_kernel<c10::BFloat16, OffsetCalculator<3, unsigned int": "glu",
             "_glu_backward_kernel": "glu", "triton_poi_fused_glu_backward_5": "inductor",
             "_pair_sums_kernel": "moe_kernels", "_swiglu_weighted_backward_kernel": "moe_kernels",
             "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits": "attention",
             "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float": "softmax_loss"}
    assert {name: gpu_speed.kernel_kind(name) for name in kinds} == kinds
    results = {"profile": {"layer": {"total_ms": 3.0, "by_kind_ms": {"s4d_fused": 2.0, "matmul": 1.0}},
                           "lm": {"total_ms": 5.0, "by_kind_ms": {"matmul": 5.0}}, "broken": {"error": "OOM"}}}
    table = gpu_speed.profile_lines(results)
    assert "| kind | layer | lm |" in table and "| matmul | 1.00 | 5.00 |" in table
    assert "| s4d_fused | 2.00 | 0.00 |" in table and "| **total** | 3.00 | 5.00 |" in table


def test_the_language_model_table_shows_cuda_graph_rows_and_takes_each_models_best_mode():
    """A model timed replayed as CUDA graphs (`train.compile_mode: reduce-overhead`) gets its own row, and the S4D /
    dense ratio compares each model's fastest mode, whichever it is; a family never timed so has no such row."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_speed

    s = gpu_speed.shapes(argparse.Namespace(quick=True))
    L = s["model_lengths"][0]
    cell = lambda rate: {"ms": 1.0, "tokens_per_s": rate, "mfu": 0.1, "peak_gib": 1.0, "params_m": 1.0}  # noqa: E731
    R = {f"models/s4d/eager/L{L}": cell(100), f"models/s4d/compiled/L{L}": cell(200),
         f"models/s4d/graphs/L{L}": cell(300), f"models/dense/eager/L{L}": cell(150),
         f"models/dense/compiled/L{L}": cell(120)}
    lines = gpu_speed.model_table(R, s)
    assert [line.split(" | ")[1] for line in lines if line.startswith("| S4D")] == ["eager", "compiled", "graphs"]
    assert not any(line.startswith("| dense") and " graphs " in line for line in lines)
    assert f"- L {L:,}: 2.00x" in lines  # 300k (S4D, graphs) against 150k (dense, eager)


def test_the_layer_table_sets_the_compiled_s4_layer_against_compiled_attention():
    """The compiled S4 layer is compared with the compiled attention layer (not the eager one), length by length."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_speed

    s = gpu_speed.shapes(argparse.Namespace(quick=True))
    L1, L2 = s["layer_lengths"]
    R = {f"layer/attention_compiled/L{L1}": {"ms": 3.0}, f"layer/fused_compiled/L{L1}": {"ms": 2.0},
         f"layer/attention/L{L1}": {"ms": 4.0}}
    lines = gpu_speed.layer_tables(R, s)
    assert any(line.startswith("| the same attention layer (`torch.compile`) | 3.00 ms") for line in lines)
    assert "| attention / fused (compiled) | 1.50x | - |" in lines


def test_layer_cells_are_also_timed_back_to_back_and_get_a_table_of_their_own(monkeypatch):
    """On CUDA a one-layer cell (`layer/...`) is timed twice: each pass on an idle GPU (`ms`, the table's figure
    since the first runs) and passes launched one after the other (`ms_back_to_back`: three groups, their median),
    which gets a table of its own beside the first; other cells only the first way. CUDA's events and memory
    counters stood in for by the host's clock here."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_speed

    class Event:  # a CUDA event on the host's clock
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1000 * (end.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    for name in ("reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 0)
    bench = gpu_speed.Bench(argparse.Namespace(device="cuda", quick=False, budget_s=60))
    calls = []
    layer = bench.run("layer/fused/L1024", lambda: lambda: calls.append(time.sleep(0.002)), seconds=0.05)
    assert layer["ms"] >= 2 and len(layer["back_to_back_ms"]) == 3 and layer["ms_back_to_back"] >= 2
    assert len(calls) == 2 + len(layer["samples_ms"]) + 3 * max(1, len(layer["samples_ms"]) // 3)
    model = bench.run("models/s4d/eager/L1024", lambda: lambda: time.sleep(0.001), seconds=0.01)
    assert "ms_back_to_back" not in model

    s = gpu_speed.shapes(argparse.Namespace(quick=True))
    L1, L2 = s["layer_lengths"]
    R = {f"layer/fused/L{L1}": {"ms": 3.0, "ms_back_to_back": 2.5}, f"layer/attention/L{L1}": {"ms": 4.0}}
    lines = gpu_speed.layer_tables(R, s)
    first = lines.index(next(line for line in lines if line.startswith("The same passes launched back to back")))
    assert "| S4Layer, fused path (eager) | 3.00 ms | not measured |" in lines[:first]
    assert lines[first + 4] == "| S4Layer, fused path (eager) | 2.50 ms | not measured |"
    assert not any(line.startswith("| causal attention") for line in lines[first:])


def test_the_moe_table_shows_the_back_to_back_passes_against_the_dense_swiglu():
    """MoE layer cells timed back to back get their own table: each variant's ms a pass and its ratio to the dense
    SwiGLU's, also back to back."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_speed

    s = gpu_speed.shapes(argparse.Namespace(quick=True))
    E, k = s["moe_configs"][0]
    R = {f"moe_layer/{n}/E{E}k{k}": {"ms": ms + 1, "ms_back_to_back": ms}
         for n, ms in (("moe", 6.0), ("moe_torch_ops", 8.0), ("moe_torch_router", 6.4), ("dense", 4.0))}
    report = {"device": "GPU", "date": "2026-11-28", "commit": "c", "torch": "t", "cuda": "c", "cudnn": 1,
              "transformers": "t", "accelerate": "a", "triton": "t", "python": "p", "command": "c", "results": R,
              "skipped": []}
    text = gpu_speed.markdown(report, s)
    assert f"| {E}, {k} | 6.00 (1.50x) | 8.00 (2.00x) | 6.40 (1.60x) | - | - | 4.00 |" in text


def test_kernels_that_failed_their_trial_on_the_gpu_are_named_in_the_report():
    """Where a family of Triton kernels failed its trial (models/kernel_trials.py), the cells timed PyTorch's
    operators instead: the report says which, and why, rather than passing the figures off as the kernels'."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_speed

    report = {"device": "GPU", "date": "2026-11-28", "commit": "c0ffee", "torch": "2.11", "cuda": "13.0",
              "cudnn": 91900, "transformers": "5", "accelerate": "1", "triton": "3.6", "python": "3.11",
              "command": "gpu_speed.py", "results": {}, "skipped": []}
    s = gpu_speed.shapes(argparse.Namespace(quick=True))
    assert "failed their trial" not in gpu_speed.markdown(report, s)
    report["kernel_trials_failed"] = {"The fused S4 kernels (torch.bfloat16, 64, 64)": "OutOfResources: shared memory"}
    text = gpu_speed.markdown(report, s)
    assert "## Kernels that failed their trial on this GPU (PyTorch's operators ran instead)" in text
    assert "- The fused S4 kernels (torch.bfloat16, 64, 64): OutOfResources: shared memory" in text
