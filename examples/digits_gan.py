"""A task of your own, manual optimisation with two optimizers: a GAN that learns to draw scikit-learn's 8x8 digits.

    s4accel train examples/digits_gan.yaml

Each step the discriminator learns to tell real digits from generated ones, then the generator learns to fool it
(the non-saturating loss). `self.backward(loss, "name")` puts gradients into that optimizer's parameters only, and
`self.step("name")` averages them over processes, clips, checks them for NaN/inf and steps on the last micro-batch of
the accumulation window. How good the generated digits are is measured against the held-out real ones: the gap of the
per-pixel means, and the spread of the classes a digit classifier (fitted on the training split) sees in them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from s4accel import Task, TaskData, TrainOptimizer


def mlp(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
                         nn.Linear(hidden, d_out))


def fit_judge(x: torch.Tensor, y: torch.Tensor) -> nn.Linear:
    """The judge of generated digits: multinomial logistic regression (L2 1e-3) on real ones, fitted by L-BFGS."""
    judge = nn.Linear(x.shape[1], 10)
    opt = torch.optim.LBFGS(judge.parameters(), max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(judge(x), y) + 1e-3 * judge.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    return judge.requires_grad_(False)


class DigitsGAN(nn.Module):
    def __init__(self, d_noise: int, hidden: int):
        super().__init__()
        self.d_noise = d_noise
        self.generator = nn.Sequential(mlp(d_noise, hidden, 64), nn.Tanh())  # noise (B, d_noise) -> pixels (B, 64)
        self.discriminator = mlp(64, hidden, 1)  # pixels (B, 64) in [-1, 1] -> logit of "real" (B, 1)

    def forward(self, pixels):
        return self.discriminator(pixels)


class DigitsGANTask(Task):
    automatic_optimization = False
    metric_names = ("mean_gap", "class_entropy", "d_real", "d_fake")

    def __init__(self, recipe, d_noise: int = 32, hidden: int = 256, lr_g: float = 2e-4, lr_d: float = 2e-4,
                 test_fraction: float = 0.2, split_seed: int = 0):
        super().__init__(recipe)
        self.d_noise, self.hidden, self.lr_g, self.lr_d = d_noise, hidden, lr_g, lr_d
        self.test_fraction, self.split_seed = test_fraction, split_seed

    def build_data(self) -> TaskData:
        from s4accel.data.arrays import read_digits  # the csv inside the scikit-learn wheel

        x, y, *_ = read_digits()
        x, y = torch.tensor(x[:, :, 0]), torch.tensor(y)  # (1797, 64) pixels in 0..16, digit labels
        order = torch.tensor(np.random.default_rng(self.split_seed).permutation(len(x)))
        n_test = round(len(x) * self.test_fraction)
        test, train = order[:n_test], order[n_test:]
        self.judge = fit_judge(x[train] / 16, y[train])
        accuracy = (self.judge(x[test] / 16).argmax(-1) == y[test]).float().mean().item()
        self.accelerator.print(f"the judge classifies {accuracy:.1%} of the real test digits correctly")
        pixels = x / 8 - 1  # [-1, 1], the generator's tanh range
        return TaskData([{"pixels": pixels[i]} for i in train], [{"pixels": pixels[i]} for i in test], unit="digits")

    def build_model(self) -> nn.Module:
        return DigitsGAN(self.d_noise, self.hidden)

    def build_optimizers(self, model):
        g = torch.optim.Adam(model.generator.parameters(), lr=self.lr_g, betas=(0.5, 0.999))
        d = torch.optim.Adam(model.discriminator.parameters(), lr=self.lr_d, betas=(0.5, 0.999))
        return [TrainOptimizer("discriminator", d, self.schedule(d)), TrainOptimizer("generator", g, self.schedule(g))]

    def training_step(self, model, batch, step):
        bce = nn.functional.binary_cross_entropy_with_logits
        real = batch["pixels"]  # (B, 64)
        fake = model.generator(torch.randn(real.shape[0], model.d_noise, device=real.device))
        # Discriminator: real -> 1, generated -> 0 (the generator is not trained by this loss: fake is detached).
        d_real, d_fake = model(real), model(fake.detach())
        d_loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
        self.backward(d_loss, "discriminator")
        self.step("discriminator")
        # Generator: make the (just updated) discriminator call its digits real.
        g_logits = model(fake)
        g_loss = bce(g_logits, torch.ones_like(g_logits))
        self.backward(g_loss, "generator")  # gradients reach the generator's parameters only
        self.step("generator")
        return {"d_loss": d_loss, "g_loss": g_loss}

    def validation_step(self, model, batch):
        real = batch["pixels"]
        noise = torch.randn(real.shape[0], model.d_noise, device=real.device)  # the loop forks the RNG around this
        fake = model.generator(noise).float()
        judge = self.judge.to(real.device)
        probs = judge((fake + 1) / 2).softmax(-1)  # (B, 10): the classes the judge sees, pixels back in 0..1
        return {"real": (real + 1) * 8, "fake": (fake + 1) * 8,  # (B, 64) in 0..16: their sums give per-pixel means
                "classes": probs,
                "d_real": torch.sigmoid(model(real)).squeeze(-1), "d_fake": torch.sigmoid(model(fake)).squeeze(-1)}

    def compute_metrics(self, sums, count):
        gap = np.abs(np.array(sums["real"]) - np.array(sums["fake"])).mean() / count  # mean |pixel mean gap|, 0..16
        p = np.array(sums["classes"]) / count  # the classes the judge sees in the generated digits
        return {"mean_gap": float(gap), "class_entropy": float(-(p * np.log(p + 1e-12)).sum()),  # ln 10 = 2.30: all
                "d_real": sums["d_real"] / count, "d_fake": sums["d_fake"] / count}

    def on_train_end(self, model):
        """A grid of 64 generated digits as `samples.png` in the run directory."""
        if not self.accelerator.is_main_process:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            noise = torch.randn(64, self.d_noise, generator=g).to(self.accelerator.device)
            digits = ((model.generator(noise).float() + 1) * 8).cpu().view(8, 8, 8, 8)
        grid = digits.permute(0, 2, 1, 3).reshape(64, 64).numpy()
        fig, ax = plt.subplots(figsize=(4, 4))
        ax.imshow(grid, cmap="gray_r", vmin=0, vmax=16)
        ax.axis("off")
        fig.savefig(Path(self.run_dir) / "samples.png", dpi=100, bbox_inches="tight")
        plt.close(fig)



