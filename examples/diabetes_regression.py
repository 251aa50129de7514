"""A task of your own, automatic optimisation: regression on scikit-learn's diabetes table (442 patients, 10 baseline
features, a disease-progression score one year later) with a small MLP, trained by s4accel's loop.

    s4accel train examples/diabetes.yaml

The task says what to build and what a step computes; the loop brings the rest (accumulation, clipping, warmup and
schedule, checkpoints and exact resume, evaluation gathered over processes, TensorBoard, early stopping, export).
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn

from s4accel import Task, TaskData


def sklearn_data_file(name: str) -> Path:
    """A data file shipped inside the scikit-learn wheel, found without importing scikit-learn (which would need
    scipy): `pip install --no-deps scikit-learn` is enough."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise FileNotFoundError("the example needs the scikit-learn wheel: pip install --no-deps scikit-learn")
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / name


def read_diabetes() -> tuple[np.ndarray, np.ndarray]:
    """(442, 10) raw features (age, sex, bmi, blood pressure, six blood serum measurements), (442,) the target:
    the table `sklearn.datasets.load_diabetes(scaled=False)` returns."""
    with gzip.open(sklearn_data_file("diabetes_data_raw.csv.gz"), "rt") as f:
        x = np.loadtxt(f)
    with gzip.open(sklearn_data_file("diabetes_target.csv.gz"), "rt") as f:
        y = np.loadtxt(f)
    return x, y


class DiabetesMLP(nn.Module):
    """features (B, 10) -> standardised target (B,)."""

    def __init__(self, d_in: int, hidden: int, depth: int, dropout: float):
        super().__init__()
        layers, d = [], d_in
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.GELU(), nn.Dropout(dropout)]
            d = hidden
        self.net = nn.Sequential(*layers, nn.Linear(d, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


class DiabetesRegression(Task):
    """Mean squared error on the standardised target; metrics in the target's own units, and R^2."""

    metric_names = ("loss", "mse", "rmse", "mae", "r2")

    def __init__(self, recipe, hidden: int = 64, depth: int = 2, dropout: float = 0.1, test_fraction: float = 0.2,
                 split_seed: int = 0):
        super().__init__(recipe)
        self.hidden, self.depth, self.dropout = hidden, depth, dropout
        self.test_fraction, self.split_seed = test_fraction, split_seed

    def build_data(self) -> TaskData:
        x, y = read_diabetes()
        order = np.random.default_rng(self.split_seed).permutation(len(x))
        n_test = round(len(x) * self.test_fraction)
        test, train = order[:n_test], order[n_test:]
        # Standardise with the training split's statistics only; the model predicts the standardised target.
        self.x_mean, self.x_std = x[train].mean(0), x[train].std(0)
        self.y_mean, self.y_std = float(y[train].mean()), float(y[train].std())

        def rows(idx):
            xs = torch.tensor((x[idx] - self.x_mean) / self.x_std, dtype=torch.float32)
            ys = torch.tensor(y[idx], dtype=torch.float32)
            return [{"x": a, "y": b} for a, b in zip(xs, ys)]  # a list of dicts is a map-style dataset

        return TaskData(rows(train), rows(test), unit="patients")

    def build_model(self) -> nn.Module:
        return DiabetesMLP(10, self.hidden, self.depth, self.dropout)

    def training_step(self, model, batch, step):
        target = (batch["y"] - self.y_mean) / self.y_std
        return nn.functional.mse_loss(model(batch["x"]), target)  # mean over the batch's rows (count_items)

    def validation_step(self, model, batch):
        pred = model(batch["x"]).float() * self.y_std + self.y_mean
        err = pred - batch["y"]
        return {"sq_err": err**2, "abs_err": err.abs(), "y": batch["y"], "y_sq": batch["y"] ** 2}

    def compute_metrics(self, sums, count):
        mse = sums["sq_err"] / count
        total_var = sums["y_sq"] / count - (sums["y"] / count) ** 2  # of the test targets
        return {"loss": mse / self.y_std**2, "mse": mse, "rmse": mse**0.5, "mae": sums["abs_err"] / count,
                "r2": 1 - mse / total_var}
