"""Triton kernels tried once on the GPU at hand before a layer relies on them; PyTorch's operators where they fail.

Triton compiles a kernel for the device in use the first time it launches. This project's kernels were written and
timed on H100 and H200 GPUs (sm_90: 228 KiB of shared memory a multiprocessor, bfloat16 tensor cores) and build
there with the Triton of each PyTorch the project supports. On another GPU (less shared memory, an older
architecture, another vendor's) or another Triton, building or launching one can fail, and a run would end inside its
first step, far from anything its user chose. So each family of kernels is tried first: `kernels_fail` runs a small
forward and backward through it on the current CUDA device, once per process and configuration, and where that
raises, the caller takes PyTorch's operators for the same computation, and the first failure is a warning naming the
GPU and the error.

Hand-written because neither Triton nor PyTorch offers a fallback for a kernel that does not build.
"""

import warnings

import torch
from torch.utils._python_dispatch import _disable_current_modes

_TRIED: dict[tuple, str | None] = {}  # (what, *configuration) -> None where the trial ran, else why it failed


def trial_device() -> torch.device | None:
    """Where the trials run: the current CUDA device; None without one (a plan asked for on a CPU-only machine)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def kernels_fail(what: str, instead: str, key: tuple, trial) -> str | None:
    """Why `trial(device)` (a small forward and backward through `what`, some Triton kernels) fails on the current
    CUDA device (`trial_device`), in one line, or None where it ran. Tried once per process for each
    `(what, *key)`, the configuration that decides how the kernels compile (dtypes, tile sizes): a process trains on
    one device. The first failure also warns: `what` fail on this GPU, `instead`.

    Inside `torch.compile` or a CUDA graph's capture nothing runs: the answer is the earlier trial's, or None (the
    kernels are taken) where none ran; without a CUDA device, None. Under a dispatch mode (a FLOP counter, fake
    tensors) the trial runs outside it, on tensors of its own."""
    key = (what, *key)
    if key in _TRIED or torch.compiler.is_compiling():
        return _TRIED.get(key)
    device = trial_device()
    if device is None or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return None
    # Like the first call of a cuBLAS handle, a trial is lazy initialisation, not the step's own work: it may wait for
    # the GPU, also under `torch.cuda.set_sync_debug_mode` (which checks that a step never does)
    sync_mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else 0
    try:
        if sync_mode:
            torch.cuda.set_sync_debug_mode(0)
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False), \
                _disable_current_modes():
            trial(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # an error the launches left pending shows here, not in the run
        _TRIED[key] = None
    except Exception as e:  # Triton's OutOfResources or CompilationError, a driver's error, an unsupported GPU
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__
        _TRIED[key] = why
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        warnings.warn(f"{what} fail on {name} ({why}); {instead}", stacklevel=3)
    finally:
        if sync_mode:
            torch.cuda.set_sync_debug_mode(sync_mode)
    return _TRIED[key]


def trial_failures() -> dict[str, str]:
    """The trials that failed in this process, each as `what (configuration)` -> why: for a benchmark's report."""
    return {f"{key[0]} {key[1:]}": why for key, why in _TRIED.items() if why}
