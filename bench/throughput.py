"""Training throughput of each model family at the quick-start's shape, in tokens/s, model TFLOP/s and MFU (their
share of this machine's measured float32 matmul peak), printed as one JSON object.

    python bench/throughput.py [--families s4d s4_dplr s4_moe moe dense] [--batch 16] [--seq-len 256]
                               [--steps 12] [--threads 2] [--device cpu|cuda]

Each family is the quick-start's size (d_model 256, 4 layers for S4; `moe-small` for the transformers), trained by
a plain forward + backward + AdamW loop (no data loading, logging or checkpoints: the model's own speed) for
`--steps` steps after 3 warm-up steps; the step's FLOPs are `s4accel.training.observe.flops.step_flops` (checked against
torch's FlopCounterMode by tests/test_flops.py). The peak is measured in the same run, before and after the
families (the median of the two), as the best float32 matmul of 1024 x 1024 matrices on `--threads` threads; on
CUDA it is the GPU's published dense peak for float32 (fp32 runs here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from s4accel import MoEConfig, MoEForCausalLM, S4Config, S4ForCausalLM
from s4accel.training.observe.flops import measured_cpu_peak, peak_tflops, step_flops

V = 259  # the byte tokenizer's vocabulary
FAMILIES = {
    "s4d": lambda: S4ForCausalLM(S4Config(vocab_size=V, d_model=256, n_layer=4, d_state=64)),
    "s4_dplr": lambda: S4ForCausalLM(S4Config(vocab_size=V, d_model=256, n_layer=4, d_state=64, kernel="s4")),
    "s4_moe": lambda: S4ForCausalLM(S4Config(vocab_size=V, d_model=256, n_layer=4, d_state=64, ffn="moe",
                                             num_experts=8, d_ffn=256)),
    "moe": lambda: MoEForCausalLM(MoEConfig(vocab_size=V, d_model=128, n_layer=4, n_head=4, d_ffn=256,
                                            num_experts=8)),
    "dense": lambda: MoEForCausalLM(MoEConfig(vocab_size=V, d_model=128, n_layer=4, n_head=4, d_ffn=256,
                                              num_experts=8, use_moe=False)),
}


def sync(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def measure(family: str, batch: int, seq_len: int, steps: int, device: str) -> dict:
    torch.manual_seed(0)
    model = FAMILIES[family]().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, V, (batch, seq_len), device=device)
    times = []
    for i in range(steps + 3):
        t0 = sync(device)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(sync(device) - t0)
    step = statistics.median(times)
    flops = sum(step_flops(model.config, batch, seq_len).values())
    return {"step_ms": round(1000 * step, 2), "tokens_per_s": round(batch * seq_len / step),
            "tflops": flops / step / 1e12, "gflop_per_step": round(flops / 1e9, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cpu":
        peaks = [measured_cpu_peak(seconds=1.0, size=1024)]
    else:
        peaks = [peak_tflops(torch.device("cuda"), "no")[0]]
    results = {f: measure(f, args.batch, args.seq_len, args.steps, args.device) for f in args.families}
    if args.device == "cpu":
        peaks.append(measured_cpu_peak(seconds=1.0, size=1024))
    peak = statistics.median(peaks)
    for r in results.values():
        r["mfu"] = round(r["tflops"] / peak, 4) if peak else None
        r["tflops"] = round(r["tflops"], 4)
    print(json.dumps({"device": args.device, "threads": args.threads, "batch": args.batch, "seq_len": args.seq_len,
                      "peak_tflops": [round(p, 4) for p in peaks], "families": results}))


if __name__ == "__main__":
    main()
