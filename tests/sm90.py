"""What a GPU would compile, checked without one: the project's Triton kernels built for an H100/H200 (sm_90) with
Triton's bundled ptxas, their registers, spills and shared memory read back."""

import json
import os
import subprocess
import sys

SM90_USAGE = r"""
import contextlib, io, json, os, re, subprocess, sys
os.environ.update(TRITON_DUMP_PTXAS_LOG="1", TRITON_ALWAYS_COMPILE="1")  # a cached kernel runs no ptxas
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from s4accel.models import moe_kernels, s4d_chunked, s4d_fused

INTS = {"B", "Lp", "NC", "n_taps", "H", "M"}  # the S4 kernels' integer arguments
MOE_INTS = {"T", "D", "R", "Fh", "E"}  # the MoE kernels' (their D and T are sizes; the S4 kernels' are not)


def usage(which, dtype, constexprs, cubin):
    name = f"_{which}_kernel"
    moe = hasattr(moe_kernels, name)
    fn = getattr(moe_kernels if moe else s4d_fused if hasattr(s4d_fused, name) else s4d_chunked, name)
    operand = {"x", "y", "states", "g", "dx", "adjoints", "z", "dz", "aux", "slope", "gy", "src", "out", "h", "act",
               "dh"}
    ints = INTS | (MOE_INTS if moe else set())
    types = constexprs.pop("_types", {})  # pointers whose dtype is neither `dtype` nor float32
    signature = {name: "constexpr" if name in constexprs else "i32" if name in ints else "*i64" if name == "rows"
                 else types.get(name) or (f"*{dtype}" if name in operand else "*fp32") for name in fn.arg_names}
    options = {"num_warps": constexprs.pop("num_warps"), **({"num_stages": constexprs.pop("num_stages")}
                                                           if "num_stages" in constexprs else {})}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # ptxas's own report (TRITON_DUMP_PTXAS_LOG)
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+).*?STACK:(\d+)", out).groups()
    # Spilled bytes as ptxas counts its spill stores; the stack frame also holds a function's own local arrays
    # (libdevice's sinf keeps one for its rare huge-argument path), so it is the bound only where a Triton prints no
    # ptxas report.
    spills = re.search(r"(\d+) bytes spill stores", log.getvalue())
    return {"registers": int(regs), "spilled_bytes": int(spills.group(1)) if spills else int(stack),
            "stack_bytes": int(stack), "ptxas_report": bool(spills), "shared_bytes": compiled.metadata.shared}


builds, folder = json.loads(sys.argv[1]), Path(sys.argv[2])
print(json.dumps([usage(which, dtype, constexprs, folder / f"{i}.cubin")
                  for i, (which, dtype, constexprs) in enumerate(builds)]))
"""


def sm90_usage(builds: list[tuple[str, str, dict]], tmp_path) -> list[dict]:
    """Compile kernels for sm_90, no GPU needed: for each build (kernel name without `_` and `_kernel`, operand
    dtype, constexprs with `num_warps` and, where not Triton's default, `num_stages`; `_types` names pointers of
    other dtypes), its registers per thread,
    the bytes each thread spills to local memory (ptxas's spill stores) and its shared memory. In a process of its
    own (the kernels must be defined as compiled kernels, not interpreted ones), one for all the builds: a process
    costs seconds to import torch and Triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SM90_USAGE, json.dumps(builds), str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_they_fit_an_sm(builds, tmp_path):
    """Each build for sm_90 spills nothing and fits the shared memory of one SM (228 KiB)."""
    for build, usage in zip(builds, sm90_usage(builds, tmp_path)):
        assert usage["spilled_bytes"] == 0, (build, usage)
        assert usage["shared_bytes"] <= 228 * 1024, (build, usage)
