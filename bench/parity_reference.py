"""Parity of our S4 kernels with the reference implementation (state-spaces/s4). Prints one JSON object.

    python bench/parity_reference.py --reference-dir /tmp/s4ref [--dtype float64] [--length 256]

Not run in CI: it needs the reference's `models/s4/s4d.py` and `models/s4/s4.py` exported outside this repository,
and `einops` and `scipy` importable (see `bench/s4_layer.py` for the commands). The CUDA extension and pykeops are
absent, so the reference falls back to its pure-torch Vandermonde and Cauchy products, on the CPU.

Each case builds a reference kernel with the reference's own initialisation, copies its parameters into ours and
compares the two kernels `K (c, H, L)` (max absolute difference, and that over max |K|), in `--dtype`. Mapping of the
reference's parameters to ours (`exp` transforms for dt and Re A, none for Im A, the reference's defaults):
    log_dt      <- inv_dt[:, 0] (s4.py) or log_dt (s4d.py)
    log_A_real  <- A_real (s4.py) or log_A_real (s4d.py): both log(-Re A)
    A_imag      <- A_imag. s4d.py keeps Im A > 0 (A = -exp(.) + i A_imag), as we do; s4.py keeps the conjugate
                   modes (A = -exp(.) - i A_imag). Every kernel is 2 Re(...) of a sum over modes, so taking all of a
                   mode's numbers conjugated gives the same kernel: for s4.py, B, P and C are conjugated.
    C           <- C (s4d.py, whose B is 1); conj(B C) for s4.py's diagonal kernel (we fold B into C); conj(C) for
                   s4.py's DPLR kernel, whose C after its first forward is C~ = C (I - dA^l_max), as ours stores it
    P, B        <- conj(P[0]), conj(B[0]) (rank 1, as pairs)
    n_ssm < H   the reference tiles its copies over channels (channel h uses copy h mod S), we repeat them (channel h
                uses copy h // (H/S)): the same family of models, with channels permuted (`dplr_n_ssm` case)
Also the whole S4D layer of s4d.py (kernel, D, GELU, the 1x1 Conv1d + GLU output) against our `S4Layer`, and our
HiPPO-LegS NPLR initialisation against the reference's `nplr("legs", N)` (eigenvalues, and the products conj(P) B
that do not depend on the eigenvectors' phases, with Im B clipped as both do).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

from s4accel.models.configuration_s4 import S4Config
from s4accel.models.modeling_s4 import S4DKernel, S4Kernel, S4Layer, hippo_legs_nplr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from s4_layer import import_reference  # bench/ is not a package: imported from its folder

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def diff(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> dict:
    ours, ref = ours.detach().to(torch.promote_types(ours.dtype, torch.float64)), ref.detach().to(ours.dtype)
    abs_diff = (ours - ref).abs().max().item()
    rel = abs_diff / ref.abs().max().item()
    return {"max_abs": abs_diff, "max_rel": rel, "max_abs_ref": ref.abs().max().item(), "ok": rel <= tol}


def compare(ours: torch.nn.Module, run, K_ref: torch.Tensor, tol: float) -> dict:
    """`run(ours)` against the reference's `K_ref`. In float32, also each against `run` on a float64 copy of ours
    (the same parameter values; in float64 ours and the reference agree to ~1e-13), to tell whose rounding a
    difference is."""
    K = run(ours)
    out = diff(K, K_ref, tol)
    if K.dtype == torch.float32:
        truth = run(copy.deepcopy(ours).double())
        out["ours_vs_float64"] = diff(K, truth, tol)["max_rel"]
        out["reference_vs_float64"] = diff(K_ref, truth, tol)["max_rel"]
        out["ours_ok"] = out["ours_vs_float64"] <= tol
    return out


def pairs(z: torch.Tensor) -> torch.Tensor:
    """complex -> (..., 2) real pairs, our storage of complex parameters."""
    return torch.view_as_real(z.resolve_conj()).clone()


def ours_kernel(cls, dtype, **config) -> torch.nn.Module:
    k = cls(S4Config(**config))
    k.reset_parameters()
    return k.to(dtype)


def copy_diag(ours, log_dt, log_A_real, A_imag, C):
    with torch.no_grad():
        ours.log_dt.copy_(log_dt)
        ours.log_A_real.copy_(log_A_real)
        ours.A_imag.copy_(A_imag)
        ours.C.copy_(pairs(C))


# --------------------------------------------------------------------------------------------------------------------
# Cases


def case_s4d_py(s4d, args, dtype) -> dict:
    """s4d.py's S4DKernel (ZOH, S4D-Lin, B = 1): K = 2 Re(sum C (exp(dtA) - 1)/A exp(dtA l))."""
    H, N, L = args.d_model, args.d_state, args.length
    ref = s4d.S4DKernel(H, N=N).to(dtype)
    ours = ours_kernel(S4DKernel, dtype, d_model=H, d_state=N, disc="zoh")
    copy_diag(ours, ref.log_dt, ref.log_A_real, ref.A_imag, torch.view_as_complex(ref.C.contiguous())[None])
    return compare(ours, lambda k: k(L), ref(L)[None], TOLERANCE[dtype])


def case_s4_diag(s4, args, dtype, disc: str, init: str) -> dict:
    """s4.py's SSMKernelDiag, with its B (not 1 for diag-legs) folded into our C."""
    H, N, L = args.d_model, args.d_state, args.length
    ref = s4.SSMKernelDiag(d_model=H, d_state=N, disc=disc, init=init, backend="naive", verbose=False).to(dtype)
    ours = ours_kernel(S4DKernel, dtype, d_model=H, d_state=N, disc=disc)
    B, C = torch.view_as_complex(ref.B.contiguous()), torch.view_as_complex(ref.C.contiguous())  # (1, H, n), (c, H, n)
    copy_diag(ours, ref.inv_dt[:, 0], ref.A_real, ref.A_imag, (B * C).conj())
    K_ref, _ = ref(L=L)
    return compare(ours, lambda k: k(L), K_ref, TOLERANCE[dtype])


def dplr_pair(s4, args, dtype, n_ssm=None):
    """A reference SSMKernelDPLR (HiPPO-LegS, its C turned into C~ for l_max by its first forward) and ours with its
    parameters; `perm[h]` is the reference channel that our channel h maps to."""
    H, N, l_max = args.d_model, args.d_state, args.length
    ref = s4.SSMKernelDPLR(d_model=H, d_state=N, l_max=l_max, init="legs", n_ssm=n_ssm, backend="naive",
                           verbose=False).to(dtype)
    K_ref, _ = ref()  # sets C~ = C (I - dA^l_max) in `dtype`
    S = n_ssm or H
    copies = H // S
    perm = torch.tensor([v * S + s for s in range(S) for v in range(copies)])  # ours h = s copies + v
    ours = ours_kernel(S4Kernel, dtype, d_model=H, d_state=N, kernel="s4", l_max=l_max, n_ssm=n_ssm)
    c = lambda name: torch.view_as_complex(getattr(ref, name).contiguous()).conj()
    with torch.no_grad():
        ours.log_dt.copy_(ref.inv_dt[perm, 0])
        ours.log_A_real.copy_(ref.A_real)
        ours.A_imag.copy_(ref.A_imag)
        ours.P.copy_(pairs(c("P")[0]))
        ours.B.copy_(pairs(c("B")[0]))
        ours.C.copy_(pairs(c("C")[:, perm]))
    return ref, ours, K_ref[:, perm], perm


def case_dplr(s4, args, dtype) -> dict:
    ref, ours, K_ref, perm = dplr_pair(s4, args, dtype)
    L = args.length
    out = {"l_max": compare(ours, lambda k: k(L), K_ref, TOLERANCE[dtype]),
           "prefix": compare(ours, lambda k: k(L // 2 + 3), K_ref[..., : L // 2 + 3], TOLERANCE[dtype])}
    K2_ref, _ = ref(L=2 * L)  # the reference doubles its C~ in place: C~ (I + dA^l_max)
    out["doubled"] = compare(ours, lambda k: k(2 * L), K2_ref[:, perm], TOLERANCE[dtype])
    return out


def case_dplr_n_ssm(s4, args, dtype) -> dict:
    _, ours, K_ref, _ = dplr_pair(s4, args, dtype, n_ssm=2)
    return compare(ours, lambda k: k(args.length), K_ref, TOLERANCE[dtype])


def case_s4d_layer(s4d, args, dtype) -> dict:
    """The whole S4D layer of s4d.py, transposed=True: (B, H, L) -> (B, H, L), against S4Layer on (B, L, H)."""
    H, N, L = args.d_model, args.d_state, args.length
    ref = s4d.S4D(H, d_state=N, transposed=True).to(dtype)
    ours = S4Layer(S4Config(d_model=H, d_state=N, kernel="s4d", disc="zoh")).to(dtype)
    k = ref.kernel
    copy_diag(ours.kernel, k.log_dt, k.log_A_real, k.A_imag, torch.view_as_complex(k.C.contiguous())[None])
    conv = ref.output_linear[0]  # Conv1d(H, 2H, 1), then GLU over channels: the same halves as our GLU(dim=-1)
    with torch.no_grad():
        ours.D.copy_(ref.D)
        ours.output_linear.weight.copy_(conv.weight[..., 0])
        ours.output_linear.bias.copy_(conv.bias)
    u = torch.randn(2, H, L, dtype=dtype)
    y_ref, _ = ref(u)
    run = lambda layer: layer(u.transpose(1, 2).to(layer.D.dtype))[0].transpose(1, 2)
    return compare(ours, run, y_ref, TOLERANCE[dtype])


def case_legs_init(s4, args) -> dict:
    """Our `hippo_legs_nplr` (with the clip of Im B to [-2, 2] that `S4Kernel.reset_parameters` applies) against
    the reference's `nplr("legs", N)`, float64, modes matched by frequency. Eigenvectors are defined up to a phase
    per mode, so P and B are compared through conj(P) B, and the phases are checked to be signs (+-1): then the
    clip, which is odd in B, commutes with them and the two initialisations are the same model."""
    N = args.d_state
    W, P, B, _ = s4.nplr("legs", N, dtype=torch.double, B_clip=2.0)
    order = torch.argsort(W.imag.abs())  # the reference keeps Im < 0, most negative first
    W, P, B = W[order].conj(), P[0, order].conj(), B[order].conj()
    Lambda, Pt, Bt = hippo_legs_nplr(N)
    Bt = torch.complex(Bt.real, Bt.imag.clamp(-2.0, 2.0))
    phase = Pt / P
    return {"eigenvalues": diff(Lambda, W, 1e-10), "conj_P_times_B": diff(Pt.conj() * Bt, P.conj() * B, 1e-10),
            "phases_are_signs": bool(torch.allclose(phase, phase.real.round().to(phase.dtype), atol=1e-10)),
            "modes_with_sign_flip": int((phase.real < 0).sum()), "modes_clipped": int((Bt.imag.abs() >= 2).sum())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference-dir", type=Path, required=True, help="exported models/s4/s4d.py and s4.py")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--length", type=int, default=256, help="kernel length (and the DPLR kernel's l_max)")
    ap.add_argument("--d-model", type=int, default=8)
    ap.add_argument("--d-state", type=int, default=64)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    s4d, s4 = import_reference(args.reference_dir, "s4d"), import_reference(args.reference_dir, "s4")
    cases = {
        "s4d_zoh_s4d_py": lambda: case_s4d_py(s4d, args, dtype),
        "s4d_zoh_diag_legs": lambda: case_s4_diag(s4, args, dtype, "zoh", "diag-legs"),
        "s4d_zoh_diag_inv": lambda: case_s4_diag(s4, args, dtype, "zoh", "diag-inv"),
        "s4d_bilinear_diag_legs": lambda: case_s4_diag(s4, args, dtype, "bilinear", "diag-legs"),
        "s4d_bilinear_diag_lin": lambda: case_s4_diag(s4, args, dtype, "bilinear", "diag-lin"),
        "dplr": lambda: case_dplr(s4, args, dtype),
        "dplr_n_ssm": lambda: case_dplr_n_ssm(s4, args, dtype),
        "s4d_layer": lambda: case_s4d_layer(s4d, args, dtype),
        "legs_init": lambda: case_legs_init(s4, args),
    }
    result = {"dtype": args.dtype, "tolerance_rel": TOLERANCE[dtype], "d_model": args.d_model,
              "d_state": args.d_state, "length": args.length, "reference": str(args.reference_dir),
              "cases": {name: case() for name, case in cases.items()}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
