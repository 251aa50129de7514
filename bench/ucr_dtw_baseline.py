"""The classic baselines of a UCR set, measured here: 1-nearest-neighbour test accuracy with Euclidean distance and
with unconstrained dynamic time warping (DTW, full window, squared point-wise cost), the two numbers the UCR
archive lists for every set. Prints one JSON object.

    python bench/ucr_dtw_baseline.py GunPoint ACSF1

The series are used as the archive ships them (z-normalised per series). DTW runs on all (test, train) pairs at
once, one anti-diagonal of the cost matrix at a time (each cell depends only on the two previous anti-diagonals).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from s4accel.data.arrays import read_ucr


def dtw_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Unconstrained DTW between every row of a (n, L) and of b (m, L) -> (n, m): D[i, j] = (a_i - b_j)^2 +
    min(D[i-1, j], D[i, j-1], D[i-1, j-1])."""
    n, L = a.shape
    m = b.shape[0]
    x, y = a[:, None, :].expand(n, m, L).reshape(n * m, L), b[None, :, :].expand(n, m, L).reshape(n * m, L)
    inf = torch.tensor(float("inf"), dtype=a.dtype)
    # Anti-diagonal k holds the cells (i, k - i); stored by i, padded with inf where a cell does not exist.
    prev2 = torch.full((n * m, L), float("inf"), dtype=a.dtype)  # diagonal k - 2
    prev1 = torch.full((n * m, L), float("inf"), dtype=a.dtype)  # diagonal k - 1
    idx = torch.arange(L)
    for k in range(2 * L - 1):
        j = k - idx  # row i = idx
        valid = (j >= 0) & (j < L)
        jc = j.clamp(0, L - 1)
        cost = (x - y[:, jc]) ** 2  # (pairs, L): cost of cell (i, k - i)
        if k == 0:
            best = torch.zeros_like(cost)
        else:
            up = prev1  # (i, j-1) is on diagonal k-1 at index i
            left = torch.cat([torch.full_like(prev1[:, :1], inf), prev1[:, :-1]], dim=1)  # (i-1, j): index i-1
            diag = torch.cat([torch.full_like(prev2[:, :1], inf), prev2[:, :-1]], dim=1)  # (i-1, j-1): index i-1
            best = torch.minimum(torch.minimum(up, left), diag)
        cur = torch.where(valid, cost + best, inf)
        prev2, prev1 = prev1, cur
    return prev1[:, L - 1].reshape(n, m)  # cell (L-1, L-1) on the last diagonal


def one_nn_accuracy(dist: torch.Tensor, y_train, y_test) -> float:
    pred = torch.as_tensor(y_train)[dist.argmin(dim=1)]
    return (pred == torch.as_tensor(y_test)).double().mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="+", help="UCR sets inside the aeon wheel, e.g. GunPoint ACSF1")
    args = ap.parse_args()
    out = {}
    for name in args.names:
        x_tr, y_tr, x_te, y_te, _ = read_ucr(name)
        a, b = torch.from_numpy(x_te[:, :, 0]).double(), torch.from_numpy(x_tr[:, :, 0]).double()
        t0 = time.perf_counter()
        ed = torch.cdist(a, b)
        dtw = dtw_distances(a, b)
        out[name] = {"length": a.shape[1], "train": len(b), "test": len(a),
                     "1nn_euclidean_accuracy": round(one_nn_accuracy(ed, y_tr, y_te), 4),
                     "1nn_dtw_full_accuracy": round(one_nn_accuracy(dtw, y_tr, y_te), 4),
                     "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
