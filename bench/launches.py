"""What the S4 layer launches per training pass in eager PyTorch, and what that costs the host. Prints one JSON object.

    python bench/launches.py [--rounds 41] [--out-dir bench/results]   (also a dated file naming commit and versions)

On a GPU every PyTorch operation is a kernel launch that the host pays for (the dispatcher, autograd's bookkeeping,
the launch itself: several microseconds each). The S4 kernel's generation (discretization, then the chunked form's
matrices) is a few hundred operations on tiny `(H, N)` tensors, so for a small model or short sequences in eager mode
the host, not the GPU, sets the layer's pace. `s4d_chunked` writes both as single autograd nodes with their chain
rule by hand (`discretize_pairs`, `matrices`); the baseline is the same code under plain autograd
(`reference_discretize_pairs`, `reference_matrices`, patched in), measured in the same run:

launches   operations that run a kernel (views left out) in one eager forward + backward of `S4Layer` under bf16
           autocast: the chunked path (B 2, L 512, H 16, chunks of 128: 4 chunks) and the fused path (B 16, L 128,
           H 16, chunks of 64; `fused_segments`: B 2, its rows cut in two as s4d_segments.py does under
           torch.compile; its Triton kernels count one launch each, run here by Triton's interpreter when there
           is no GPU; the fused path makes its matrices, and ZOH's discretization, with Triton kernels too, and its
           `reference` variant with the reference under autograd); and of the generation alone (both
           discretizations, ZOH and bilinear; `kernels`: as the fused path makes it). Exact: the same counts on
           any machine and at any shape (launches do not grow with B, H or, past one chunk, L). Also the
           mixture-of-experts layer as CUDA runs it (`moe/grouped_mm`: `MoELayer` with the `grouped_mm` dispatch,
           E 8, k 2, its balance and z losses, 256 tokens) with its routing eager, and that routing alone
           (`moe/routing`: the experts replaced by a stub that costs nothing, as bench/moe.py's `routing_only`):
           on a GPU these tiny operations are where an eager layer may wait for the host, which is what
           compiling them (`moe.COMPILE_ROUTING`) is for.
moe_host_ms  one forward + backward of that MoE layer with its routing eager and compiled (`COMPILE_ROUTING`
           "never" and "always"), paired likewise, one thread.
host_ms    one eager forward + backward of the chunked layer at a shape where the arithmetic is negligible (B 1, L 512,
           H 16): what the host spends per pass. Paired rounds (one pass of each variant per round, rotating order),
           medians and the median of the per-round ratios. A CPU figure: the host side of a GPU pass is the same code
           and the same count of operations, plus the launches themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused path's kernels on the CPU when there is no GPU

import torch  # noqa: E402
from s4_layer import paired_rounds, ratio_summary  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from s4accel.models import s4d_chunked, s4d_fused, s4d_segments  # noqa: E402
from s4accel.models.configuration_s4 import S4Config  # noqa: E402
from s4accel.models.modeling_s4 import S4Layer  # noqa: E402

VIEWS = {"view", "unsqueeze", "squeeze", "select", "slice", "expand", "permute", "transpose", "t", "detach", "alias",
         "as_strided", "unfold", "_unsafe_view", "split", "unbind", "split_with_sizes"}


class CountLaunches(TorchDispatchMode):
    """Operations that run a kernel, views left out."""

    def __init__(self):
        super().__init__()
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.launches += func.__name__.split(".")[0] not in VIEWS
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def generation(variant: str):
    """`fast`: the code as it is; `reference`: the discretization and matrices under plain autograd."""
    if variant == "fast":
        yield
        return
    modeling = sys.modules[S4Layer.__module__]
    # what the layer, chunk_matrices and the fused path's segments call by name
    saved = (modeling.discretize_pairs, modeling.fused_discretize, s4d_chunked.matrices, s4d_segments.fused_matrices)
    modeling.discretize_pairs = s4d_chunked.reference_discretize_pairs
    modeling.fused_discretize = reference_fused_discretize
    s4d_chunked.matrices = s4d_segments.fused_matrices = s4d_chunked.reference_matrices
    try:
        yield
    finally:
        (modeling.discretize_pairs, modeling.fused_discretize, s4d_chunked.matrices,
         s4d_segments.fused_matrices) = saved


def reference_fused_discretize(log_dt, log_A_real, A_imag, C, zoh: bool, copies: int = 1):
    """`s4d_fused.fused_discretize` (which reads the parameters as stored) by the reference under plain autograd."""
    return s4d_chunked.reference_discretize_pairs(
        *s4d_chunked.parameter_pairs(log_dt, log_A_real, A_imag, C, copies), zoh)


@contextlib.contextmanager
def segments_forced():
    """The fused path cutting short batches into segments in eager mode too, as it does under torch.compile."""
    modeling = sys.modules[S4Layer.__module__]
    saved = modeling.fused_conv

    def cut(x, *args, **kwargs):
        return saved(x, *args, S=s4d_segments.segments(x.shape[1], x.shape[2] // args[3]), **kwargs)
    modeling.fused_conv = cut
    try:
        yield
    finally:
        modeling.fused_conv = saved


def layer_pass(path: str, B: int, L: int, H: int, chunk: int, disc: str = "zoh"):
    torch.manual_seed(0)
    layer = S4Layer(S4Config(d_model=H, d_state=64, conv_path=path, conv_chunk=chunk, disc=disc))
    x = torch.randn(B, L, H, requires_grad=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)[0]
        y.float().sum().backward()
    return run


def moe_pass(routing_only: bool = False):
    """One forward + backward of an E 8, k 2 `MoELayer` (`grouped_mm` dispatch, its losses in the loss) under bf16
    autocast on 256 tokens of width 64; `routing_only`: its experts replaced by bench/moe.py's stub."""
    from moe import NoExperts  # bench/moe.py

    from s4accel.models.configuration_moe import MoEConfig
    from s4accel.models.moe import MoELayer

    torch.manual_seed(0)
    config = MoEConfig(d_model=64, d_ffn=32, num_experts=8, num_experts_per_tok=2, n_head=4,
                       moe_dispatch="grouped_mm")
    layer = MoELayer(config, 64)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if routing_only:
        layer.experts = NoExperts()
    x = torch.randn(256, 64, requires_grad=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, aux = layer(x)
            y = y + 0 * (aux["balance_loss"] + aux["z_loss"])
        y.float().sum().backward()
    return run


@contextlib.contextmanager
def routing_compiled(compiled: bool):
    """The MoE layer's routing compiled (`moe.COMPILE_ROUTING = "always"`) or eager ("never")."""
    from s4accel.models import moe

    saved, moe.COMPILE_ROUTING = moe.COMPILE_ROUTING, "always" if compiled else "never"
    try:
        yield
    finally:
        moe.COMPILE_ROUTING = saved


def count(fn) -> int:
    fn()  # warm-up (Triton's interpreter, autocast caches)
    with CountLaunches() as mode:
        fn()
    return mode.launches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (1: the host's single dispatching "
                                                           "thread, as a GPU run has)")
    ap.add_argument("--out-dir", type=Path, help="also write the report to a dated JSON file in this folder")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    launches = {}
    # the fused path with a batch that fills its programs' 16 rows, and with one of 2 rows cut into segments
    passes = {"chunked": ("chunked", 2, 512, 16, 128), "fused": ("fused", 16, 128, 16, 64),
              "fused_segments": ("fused", 2, 128, 16, 64)}
    for name, (path, B, L, H, chunk) in passes.items():
        if s4d_fused.why_not_fused("cpu", torch.float32, chunk, 64) and name.startswith("fused"):
            continue  # no Triton here
        for disc in ("zoh", "bilinear"):
            for variant in ("fast", "reference"):
                with generation(variant), segments_forced() if name == "fused_segments" else contextlib.nullcontext():
                    launches[f"layer/{name}/{disc}/{variant}"] = count(layer_pass(path, B, L, H, chunk, disc))
    for disc in ("zoh", "bilinear"):
        for variant in ("fast", "reference"):
            layer = S4Layer(S4Config(d_model=16, d_state=64, disc=disc))

            def gen(kernels=False):  # (s4d_chunked.matrices looked up when called: `generation` patches it)
                log_dA, (cr, ci) = layer.kernel.discretize_pairs(fused=kernels)
                make = s4d_fused.fused_matrices if kernels else s4d_chunked.matrices
                out = make(log_dA, (cr[0], ci[0]), layer.D, 64)
                torch.autograd.grad(out, list(layer.parameters())[:4], [torch.ones_like(t) for t in out],
                                    allow_unused=True)
            with generation(variant):
                launches[f"generation/{disc}/{variant}"] = count(gen)
        if not s4d_fused.why_not_fused("cpu", torch.float32, 64, 64):  # the fused path's matrices: its kernels
            launches[f"generation/{disc}/kernels"] = count(lambda: gen(kernels=True))
    with routing_compiled(False):
        launches["moe/grouped_mm"] = count(moe_pass())
        launches["moe/routing"] = count(moe_pass(routing_only=True))
    moe_fns = {}
    for compiled in (False, True):
        run_moe = moe_pass()

        def moe_timed(run=run_moe, compiled=compiled):
            with routing_compiled(compiled):
                run()
        moe_timed()  # (compiles)
        moe_fns["compiled_routing" if compiled else "eager_routing"] = moe_timed
    moe_times = paired_rounds(moe_fns, {name: args.rounds for name in moe_fns})
    fns = {}
    for variant in ("fast", "reference"):
        run = layer_pass("chunked", 1, 512, 16, 128)

        def timed_pass(run=run, variant=variant):
            with generation(variant):
                run()
        timed_pass()
        fns[variant] = timed_pass
    times = paired_rounds(fns, {name: args.rounds for name in fns})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip() or "unknown"
    report = {"date": datetime.date.today().isoformat(), "commit": commit, "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "threads": args.threads, "command": "python bench/launches.py "
              + " ".join(argv if argv is not None else sys.argv[1:]),
              "launches": launches,
              "moe_host_ms": {name: round(1000 * statistics.median(t), 3) for name, t in moe_times.items()},
              "moe_compiled_over_eager_routing": ratio_summary(moe_times, "compiled_routing", "eager_routing"),
              "host_ms": {name: round(1000 * statistics.median(t), 3) for name, t in times.items()},
              "host_fast_over_reference": ratio_summary(times, "fast", "reference"),
              "samples_ms": {name: [round(1000 * s, 3) for s in t]
                             for name, t in {**times, **{f"moe_{k}": v for k, v in moe_times.items()}}.items()}}
    print(json.dumps({k: v for k, v in report.items() if k != "samples_ms"}, indent=1))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"{report['date']}-launches-cpu-{commit}.json"
        path.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
