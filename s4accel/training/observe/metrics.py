"""What the loop logs between evaluations: training scalars summed on the device and reduced once per log interval
(loss, router losses, gradient norm, lr per group, tokens/s, step time, memory), and the experts' load."""

from __future__ import annotations

import resource
import time
import warnings

import psutil
import torch

from ...models.moe import ROUTER_COUNTS
from ..runs.checkpoint import TrainState
from .flops import flops_per_token, peak_tflops
from ..task import TrainOptimizer


class Meter:
    """Sums training scalars on the device between log steps, so logging syncs with the host once per interval.
    With a `recipe` and the `model`, also the model FLOP/s of training and their share of the devices' peak
    (`train/tflops`, `train/mfu`: flops.py)."""

    def __init__(self, accelerator, state: TrainState, recipe=None, model=None):
        self.accelerator, self.state = accelerator, state
        self.process = psutil.Process()
        self.sums: dict[str, torch.Tensor] = {}
        self.steps_at_last = state.step
        self.time_at_last = self.time_at_start = time.perf_counter()
        self.tokens_at_last = self.tokens_at_start = state.tokens_seen
        warn_steps = recipe.log.expert_idle_warn_steps if recipe is not None else 200
        self.experts = ExpertLoad(warn_steps, accelerator.is_main_process)
        self.flops_per_token, self.peak = None, None
        if recipe is not None and model is not None:
            self.flops_per_token, self.peak = throughput_basis(accelerator, recipe, model)

    def add(self, **values: torch.Tensor):
        for k, v in values.items():
            v = v.detach() if k in ROUTER_COUNTS else v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v

    def log(self, run, callbacks, optimizers: list[TrainOptimizer], bar) -> dict:
        """Flush, log at the current step, hand the scalars to callbacks, show the losses on the progress bar."""
        logs = self.flush(optimizers)
        run.log(logs)
        callbacks.on_log(run, logs)
        bar.set_postfix({k[6:]: f"{v:.3f}" for k, v in logs.items() if k.endswith("loss")}, refresh=False)
        return logs

    def flush(self, optimizers: list[TrainOptimizer]) -> dict:
        state = self.state
        steps = state.step - self.steps_at_last
        logs = {}
        for key in [k for k in self.sums if k not in ROUTER_COUNTS]:
            value = self.sums.pop(key)
            if not key.startswith("grad_norm"):  # each rank holds its share of the mean; norms are the same on all
                value = self.accelerator.reduce(value, reduction="sum")
            logs[f"train/{key}"] = value.item() / steps
        if ROUTER_COUNTS[0] in self.sums:  # (n_moe, E) routed pairs, summed over the interval and every process
            counts, dropped = (self.accelerator.reduce(self.sums.pop(k), reduction="sum") for k in ROUTER_COUNTS)
            logs.update(self.experts.update(counts, dropped, steps, state.step))
        now = time.perf_counter()
        logs["train/tokens_per_s"] = (state.tokens_seen - self.tokens_at_last) / (now - self.time_at_last)
        logs.update(self.utilisation(logs["train/tokens_per_s"]))
        logs["train/step_time_ms"] = 1000 * (now - self.time_at_last) / steps
        logs["train/peak_mem_mb"] = peak_memory_mb(self.accelerator.device)
        logs["train/rss_mb"] = self.process.memory_info().rss / 2**20  # current, to see memory stay flat
        logs["train/epoch"] = state.epoch
        logs["train/nonfinite_skips"] = state.nonfinite_skips
        logs["train/scaler_skips"] = state.scaler_skips
        for o in optimizers:
            prefix = "" if len(optimizers) == 1 else f"{o.name}_"
            for i, (group, lr) in enumerate(zip(o.optimizer.param_groups, o.scheduler.get_last_lr())):
                logs[f"train/lr_{prefix}{group.get('name', i)}"] = lr
        self.sums.clear()
        self.steps_at_last, self.time_at_last, self.tokens_at_last = state.step, now, state.tokens_seen
        return logs


    def utilisation(self, tokens_per_s: float) -> dict:
        """`train/tflops` (all processes) and `train/mfu` (of the devices' peak) at `tokens_per_s`, where known."""
        if self.flops_per_token is None:
            return {}
        tflops = tokens_per_s * self.flops_per_token / 1e12
        return {"train/tflops": tflops, **({"train/mfu": tflops / self.peak} if self.peak else {})}

    def summary(self) -> dict:
        """TFLOP/s and MFU over the whole loop so far (for the line a run ends with)."""
        seconds = time.perf_counter() - self.time_at_start
        out = self.utilisation((self.state.tokens_seen - self.tokens_at_start) / seconds) if seconds > 0 else {}
        return {k.removeprefix("train/"): v for k, v in out.items()}


def throughput_basis(accelerator, recipe, model) -> tuple[float | None, float | None]:
    """(training FLOPs per token of the model at the recipe's batch and block length, the peak TFLOP/s of all the
    run's devices together). A CPU's peak is measured by every process at once (they share the cores as they do when
    training) and summed; a GPU's is its published one, times the processes."""
    model = accelerator.unwrap_model(model)
    per_token = flops_per_token(model, recipe.data.batch_size, recipe.data.seq_len)
    if per_token is None:
        return None, None
    peak = recipe.train.peak_tflops
    if peak is None:
        accelerator.wait_for_everyone()
        peak, _ = peak_tflops(accelerator.device, accelerator.mixed_precision, recipe.train.tf32)
        if peak is not None and accelerator.device.type == "cpu":
            return per_token, accelerator.reduce(torch.tensor(peak), reduction="sum").item()
    return per_token, None if peak is None else peak * accelerator.num_processes


class ExpertLoad:
    """Mixture-of-experts routing statistics for the logs: each expert's share of its layer's routed (token, expert)
    pairs, the fraction of pairs dropped by the capacity limit, and a warning when an expert has received nothing
    for `warn_steps` optimizer steps (a dead expert: the router sends it no token, so it never learns)."""

    def __init__(self, warn_steps: int, warn: bool = True):
        self.warn_steps, self.warn = warn_steps, warn  # every process computes the same; one warns
        self.idle: torch.Tensor | None = None  # (n_moe, E): steps since each expert last received a pair
        self.warned: set[tuple[int, int]] = set()

    def update(self, counts: torch.Tensor, dropped: torch.Tensor, steps: int, step: int) -> dict:
        counts, dropped = counts.double().cpu(), dropped.double().cpu()
        totals = counts.sum(-1)  # (n_moe,)
        share = counts / totals.clamp(min=1)[:, None]
        logs = {f"moe/load/layer{i}/expert{e}": share[i, e].item()
                for i in range(share.shape[0]) for e in range(share.shape[1])}
        logs["moe/routed_pairs"] = totals.sum().item()  # all layers, all processes, this interval
        logs["moe/dropped_fraction"] = (dropped.sum() / totals.sum().clamp(min=1)).item()
        logs["moe/max_load"] = share.max().item()  # 1/E when balanced
        logs["moe/idle_experts"] = int((counts == 0).sum())
        idle = torch.zeros_like(counts) if self.idle is None else self.idle
        self.idle = torch.where(counts == 0, idle + steps, torch.zeros_like(idle))
        for i, e in (self.idle >= self.warn_steps).nonzero().tolist():
            if (i, e) not in self.warned:
                self.warned.add((i, e))
                if self.warn:
                    warnings.warn(f"step {step}: expert {e} of MoE layer {i} has received no token for "
                                  f"{int(self.idle[i, e])} steps (a dead expert); consider a larger "
                                  "router_aux_loss_coef", stacklevel=2)
        self.warned = {(i, e) for i, e in self.warned if self.idle[i, e] > 0}  # warn again if it dies again
        return logs


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak resident set size (Linux: KiB)
