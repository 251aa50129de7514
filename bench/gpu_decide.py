"""What a GPU speed report says about the switches that wait for a GPU's figures. Prints one JSON object.

    python bench/gpu_decide.py bench/results/DATE-gpu-speed-DEVICE-COMMIT.json

Several kernels are on (or off) by default on CUDA before a GPU has timed them, each with a cell of
`bench/gpu_speed.py` that times the layer without it, in the same run. This reads those cells and applies the rule
each switch's comment states, so that a session with a GPU for a few minutes leaves it with decisions, not a table
to read. Each entry: the switch, its value now, the value the figures ask for, whether that is a change, the rule,
and the cells it compared (ms a pass); a switch whose cells the report lacks says "not measured". The per-pass
figures decide; the back-to-back ones, where the report has them, are listed beside them.

- `moe_kernels.MOE_KERNELS`: stays "cuda" if the MoE layer (`moe`) is faster than with PyTorch's operators
  (`moe_torch_ops`) at every E, k timed; else "never".
- `moe_kernels.ROUTER_MAX_EXPERTS`: stays as it is if the layer is faster than with PyTorch's router
  (`moe_torch_router`) at every E, k it applies to (E at most the switch); else 0.
- `moe.COMPILE_EXPERTS`: "cuda" if the layer with its routing and experts compiled (`moe_compiled_experts`) is faster
  than both the eager layer and the one with its routing alone compiled at every E, k; else "never". Beside it, its
  ratio to the dense SwiGLU (issue 40 asks for 1.4x at E 8, k 2).
- `s4d_chunked.glu_kernels_run` (the S4 layer's GLU kernels, on where it says): stay on if `layer/fused` is faster
  than `layer/fused_torch_glu` at every length; else off.
- `s4d_fused.GELU_IN_KERNELS`: of the modes faster than "off" (`layer/fused`) at every length, the one with the least
  time over the lengths; else "off".
- `s4d_fused.SEGMENTS_IN_KERNELS`: True if the short batches cut into segments (`short/T64_segments`) are faster
  than uncut (`short/T64`) at every length timed; else False.

Where the report lists kernels that failed their trial on its GPU (`kernel_trials_failed`, models/kernel_trials.py),
their cells timed PyTorch's operators instead, and no switch changes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def cells(results: dict, prefix: str, field: str = "ms") -> dict[str, float]:
    """`{suffix: time}` of the cells named `prefix/suffix` that have `field` (ms a pass, or `ms_back_to_back`)."""
    return {k[len(prefix) + 1:]: round(v[field], 3) for k, v in results.items()
            if k.startswith(prefix + "/") and isinstance(v, dict) and field in v}


def faster_everywhere(ours: dict[str, float], theirs: dict[str, float]) -> bool | None:
    """Whether `ours` is faster at every key both have; None when they share none."""
    shared = sorted(set(ours) & set(theirs))
    return None if not shared else all(ours[k] < theirs[k] for k in shared)


def decision(switch: str, now, rule: str, wanted, compared: dict, **extra) -> dict:
    """`wanted`: the value the figures ask for, or None where the report lacks the cells."""
    return {"switch": switch, "now": now, "wanted": "not measured" if wanted is None else wanted,
            "change": wanted is not None and wanted != now, "rule": rule, "compared_ms": compared, **extra}


def either(verdict: bool | None, yes, no):
    """`yes` where the rule holds, `no` where it does not, None where nothing was measured."""
    return None if verdict is None else yes if verdict else no


def moe_decisions(R: dict) -> list[dict]:
    from s4accel.models import moe, moe_kernels

    layer = {name: cells(R, f"moe_layer/{name}") for name in
             ("moe", "moe_torch_ops", "moe_torch_router", "moe_compiled_routing", "moe_compiled_experts", "dense")}
    b2b = {name: cells(R, f"moe_layer/{name}", "ms_back_to_back") for name in layer}
    out = [decision("moe_kernels.MOE_KERNELS", moe_kernels.MOE_KERNELS, "moe faster than moe_torch_ops at every E, k",
                    either(faster_everywhere(layer["moe"], layer["moe_torch_ops"]), "cuda", "never"),
                    {n: layer[n] for n in ("moe", "moe_torch_ops")},
                    back_to_back_ms={n: b2b[n] for n in ("moe", "moe_torch_ops")})]
    limit = moe_kernels.ROUTER_MAX_EXPERTS
    applies = {c: ms for c, ms in layer["moe"].items() if int(re.match(r"E(\d+)k", c).group(1)) <= limit}
    out.append(decision("moe_kernels.ROUTER_MAX_EXPERTS", limit,
                        f"moe faster than moe_torch_router at every E, k with E <= {limit}",
                        either(faster_everywhere(applies, layer["moe_torch_router"]), limit, 0),
                        {"moe": applies, "moe_torch_router": layer["moe_torch_router"]},
                        back_to_back_ms={n: b2b[n] for n in ("moe", "moe_torch_router")}))
    compiled = layer["moe_compiled_experts"]
    verdicts = [faster_everywhere(compiled, layer[n]) for n in ("moe", "moe_compiled_routing")]
    out.append(decision("moe.COMPILE_EXPERTS", moe.COMPILE_EXPERTS,
                        "moe_compiled_experts faster than moe and moe_compiled_routing at every E, k",
                        either(None if None in verdicts else all(verdicts), "cuda", "never"),
                        {n: layer[n] for n in ("moe", "moe_compiled_routing", "moe_compiled_experts")},
                        over_dense={c: round(ms / layer["dense"][c], 3) for c, ms in compiled.items()
                                    if c in layer["dense"]}))
    return out


def s4_decisions(R: dict) -> list[dict]:
    from s4accel.models import s4d_fused

    fused = cells(R, "layer/fused")
    torch_glu = cells(R, "layer/fused_torch_glu")
    out = [decision("s4d_chunked.glu_kernels_run", "on", "layer/fused faster than layer/fused_torch_glu at every L",
                    either(faster_everywhere(fused, torch_glu), "on", "off"),
                    {"fused": fused, "fused_torch_glu": torch_glu})]
    modes = {m: cells(R, f"layer/fused_gelu_{m}") for m in s4d_fused.GELU_MODES if m != "off"}
    complete = {m: ms for m, ms in modes.items() if fused and set(fused) <= set(ms)}  # timed at every length
    winners = {m: sum(ms[L] for L in fused) for m, ms in complete.items() if faster_everywhere(ms, fused)}
    out.append(decision("s4d_fused.GELU_IN_KERNELS", s4d_fused.GELU_IN_KERNELS,
                        "of the modes faster than off at every L, the least time over them",
                        (min(winners, key=winners.get) if winners else "off") if complete else None,
                        {"off": fused, **modes}))
    cut, uncut = cells(R, "short/T64_segments"), cells(R, "short/T64")
    out.append(decision("s4d_fused.SEGMENTS_IN_KERNELS", s4d_fused.SEGMENTS_IN_KERNELS,
                        "short/T64_segments faster than short/T64 at every L", faster_everywhere(cut, uncut),
                        {"T64_segments": cut, "T64": uncut}))
    return out


def decide(report: dict) -> dict:
    R = report["results"]
    entries = moe_decisions(R) + s4_decisions(R)
    failed = report.get("kernel_trials_failed") or {}
    if failed:  # the kernels' cells timed PyTorch's operators: no comparison holds
        for e in entries:
            e.update(wanted="not measured: kernels failed their trial on this GPU", change=False)
    return {"report": {k: report.get(k) for k in ("device", "date", "commit")}, "decisions": entries,
            "changes": [f"{e['switch']} = {e['wanted']!r}" for e in entries if e["change"]],
            **({"kernel_trials_failed": failed} if failed else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="a JSON file written by bench/gpu_speed.py")
    args = ap.parse_args(argv)
    print(json.dumps(decide(json.loads(args.report.read_text())), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
