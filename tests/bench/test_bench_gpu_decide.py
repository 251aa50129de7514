"""bench/gpu_decide.py: each switch that waits for a GPU gets the value its rule asks of a report's cells, "not
measured" where the report lacks them, and the command prints it as JSON."""

import json
import subprocess
import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_decide  # noqa: E402

LENGTHS = (1024, 4096, 16384)


def report(**cells) -> dict:
    """A gpu-speed report whose cells are `name=ms`, `/` in a name written `__`, or (ms, back-to-back ms)."""
    results = {}
    for name, ms in cells.items():
        ms, b2b = ms if isinstance(ms, tuple) else (ms, None)
        results[name.replace("__", "/")] = {"ms": ms, **({"ms_back_to_back": b2b} if b2b is not None else {})}
    return {"device": "GPU", "date": "2026-11-28", "commit": "c", "results": results}


def by_switch(out: dict) -> dict:
    return {e["switch"]: e for e in out["decisions"]}


def layer_cells(name: str, ms: tuple) -> dict:
    return {f"layer__{name}__L{L}": t for L, t in zip(LENGTHS, ms)}


def test_switches_keep_their_values_where_the_kernels_win_and_change_where_they_lose():
    won = report(moe_layer__moe__E8k2=(6.0, 5.5), moe_layer__moe_torch_ops__E8k2=(7.0, 6.8),
                 moe_layer__moe_torch_router__E8k2=6.5, moe_layer__moe__E128k8=20.0,
                 moe_layer__moe_torch_ops__E128k8=22.0, moe_layer__moe_torch_router__E128k8=19.0,
                 moe_layer__moe_compiled_routing__E8k2=5.8, moe_layer__moe_compiled_experts__E8k2=5.0,
                 moe_layer__dense__E8k2=4.0,
                 **layer_cells("fused", (2.5, 7.5, 30.0)), **layer_cells("fused_torch_glu", (2.7, 8.0, 31.0)),
                 **layer_cells("fused_gelu_forward", (2.45, 7.4, 29.9)),
                 **layer_cells("fused_gelu_both", (2.4, 7.3, 30.1)),
                 short__T64__L8192=10.0, short__T64_segments__L8192=8.0,
                 short__T64__L16384=12.0, short__T64_segments__L16384=9.0)
    out = gpu_decide.decide(won)
    d = by_switch(out)
    assert d["moe_kernels.MOE_KERNELS"]["wanted"] == "cuda" and not d["moe_kernels.MOE_KERNELS"]["change"]
    assert d["moe_kernels.MOE_KERNELS"]["back_to_back_ms"]["moe"] == {"E8k2": 5.5}
    # E 128 is above ROUTER_MAX_EXPERTS: its slower layer there does not count
    assert d["moe_kernels.ROUTER_MAX_EXPERTS"]["wanted"] == 32 and not d["moe_kernels.ROUTER_MAX_EXPERTS"]["change"]
    assert d["moe.COMPILE_EXPERTS"]["wanted"] == "cuda" and d["moe.COMPILE_EXPERTS"]["change"]
    assert d["moe.COMPILE_EXPERTS"]["over_dense"] == {"E8k2": 1.25}
    assert d["s4d_chunked.glu_kernels_run"]["wanted"] == "on"
    # "both" is faster than off at 1K and 4K only: "forward" wins though "both" has the least time at 1K
    assert d["s4d_fused.GELU_IN_KERNELS"]["wanted"] == "forward" and d["s4d_fused.GELU_IN_KERNELS"]["change"]
    assert d["s4d_fused.SEGMENTS_IN_KERNELS"]["wanted"] is True
    assert set(out["changes"]) == {"moe.COMPILE_EXPERTS = 'cuda'", "s4d_fused.GELU_IN_KERNELS = 'forward'",
                                   "s4d_fused.SEGMENTS_IN_KERNELS = True"}

    lost = report(moe_layer__moe__E8k2=6.0, moe_layer__moe_torch_ops__E8k2=5.9,
                  moe_layer__moe_torch_router__E8k2=5.95, moe_layer__moe_compiled_routing__E8k2=5.8,
                  moe_layer__moe_compiled_experts__E8k2=5.9,
                  **layer_cells("fused", (2.5, 7.5, 30.0)), **layer_cells("fused_torch_glu", (2.4, 8.0, 31.0)),
                  **layer_cells("fused_gelu_forward", (2.6, 7.4, 29.9)), short__T64__L8192=10.0,
                  short__T64_segments__L8192=10.5)
    d = by_switch(gpu_decide.decide(lost))
    assert d["moe_kernels.MOE_KERNELS"]["wanted"] == "never" and d["moe_kernels.MOE_KERNELS"]["change"]
    assert d["moe_kernels.ROUTER_MAX_EXPERTS"]["wanted"] == 0
    assert d["moe.COMPILE_EXPERTS"]["wanted"] == "never" and not d["moe.COMPILE_EXPERTS"]["change"]
    assert d["s4d_chunked.glu_kernels_run"]["wanted"] == "off"  # slower at 1K
    assert d["s4d_fused.GELU_IN_KERNELS"]["wanted"] == "off"  # "forward" loses at 1K; "both" was not timed
    assert d["s4d_fused.SEGMENTS_IN_KERNELS"]["wanted"] is False


def test_a_switch_whose_cells_a_report_lacks_is_not_measured_and_changes_nothing():
    partial = report(moe_layer__moe__E8k2=6.0, **layer_cells("fused", (2.5, 7.5, 30.0)),
                     layer__fused_gelu_both__L1024=2.0)  # one length of three: not a verdict
    out = gpu_decide.decide(partial)
    assert out["changes"] == []
    assert all(e["wanted"] == "not measured" for e in out["decisions"]), out["decisions"]


def test_where_kernels_failed_their_trial_on_the_gpu_no_switch_changes():
    """Their cells then timed PyTorch's operators (models/kernel_trials.py): "kernels slower than PyTorch's" would be
    PyTorch's against itself."""
    lost = report(moe_layer__moe__E8k2=6.0, moe_layer__moe_torch_ops__E8k2=5.0)
    assert gpu_decide.decide(lost)["changes"] == ["moe_kernels.MOE_KERNELS = 'never'"]
    lost["kernel_trials_failed"] = {"The MoE layer's sum and activation kernels (torch.bfloat16,)": "OutOfResources"}
    out = gpu_decide.decide(lost)
    assert out["changes"] == [] and out["kernel_trials_failed"] == lost["kernel_trials_failed"]
    assert all(e["wanted"].startswith("not measured: kernels failed their trial") for e in out["decisions"])


def test_the_command_reads_a_report_file_and_prints_the_decisions_as_json(tmp_path):
    path = tmp_path / "2026-11-28-gpu-speed-GPU-c.json"
    path.write_text(json.dumps(report(moe_layer__moe__E8k2=6.0, moe_layer__moe_torch_ops__E8k2=5.0)))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_decide.py"), str(path)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["report"]["commit"] == "c" and out["changes"] == ["moe_kernels.MOE_KERNELS = 'never'"]
