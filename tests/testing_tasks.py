"""Tasks the tests pick through recipes (`task: {target: testing_tasks:X, args: {...}}`); the tests put this folder on
the path (PYTHONPATH for subprocesses)."""

import os
import signal

import torch

from s4accel import Task, TaskData
from s4accel.training.tasks_builtin import CausalLMTask


class SignalAtMicroBatch(CausalLMTask):
    """The built-in language-model task that sends this process SIGTERM during its `call`-th micro-batch (as a
    preemption notice arriving in the middle of an accumulation window would) and counts the micro-batches run."""

    def __init__(self, recipe, call: int, tokenizer_dir=None):
        super().__init__(recipe, tokenizer_dir)
        self.call, self.calls = call, 0

    def training_step(self, model, batch, step):
        self.calls += 1
        if self.calls == self.call:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(model, batch, step)


def halve_every_3(step: int) -> float:
    """A learning-rate multiplier for `scheduler.name: lambda` (the optimizer steps since the warmup)."""
    return 0.5 ** (step // 3)


class RecordBatches(CausalLMTask):
    """The built-in language-model task that appends each training micro-batch's rows (as hashes) with the step it
    belongs to, to `<run_dir>/rows_<process>.jsonl`: what a test audits for examples skipped or repeated."""

    def training_step(self, model, batch, step):
        import hashlib
        import json

        rank = int(os.environ.get("RANK", "0"))
        rows = [hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:16] for row in batch["input_ids"]]
        with open(self.recipe.run.dir / f"rows_{rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "rows": rows}) + "\n")
        return super().training_step(model, batch, step)


class LineWithTrainSet(Task):
    """A task of your own with an evaluation set it adds itself: a line fitted to noisy points, scored on the held-out
    points and, as the set `train`, on the training points (how far it overfits)."""

    metric_names = ("loss",)
    eval_set_names = ("train",)

    def build_data(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(96, 1, generator=g)
        rows = [{"x": a, "y": 3 * a[0] + 0.1 * torch.randn((), generator=g)} for a in x]
        return TaskData(rows[:64], rows[64:], eval_sets={"train": rows[:64]})

    def build_model(self):
        return torch.nn.Linear(1, 1)

    def training_step(self, model, batch, step):
        return torch.nn.functional.mse_loss(model(batch["x"])[:, 0], batch["y"])

    def validation_step(self, model, batch):
        return {"loss": (model(batch["x"])[:, 0] - batch["y"]) ** 2}
