"""Callbacks the tests attach through recipes (`callbacks: [{target: testing_callbacks:X, args: {...}}]`); the tests
put this folder on the path (PYTHONPATH for subprocesses)."""

import json
import os
import shutil
import signal
import time
from pathlib import Path

from s4accel.training.callbacks import Callback


class SignalAt(Callback):
    """Send this process a signal after optimizer step `step` (as a cluster's preemption notice would); with `rank`,
    only that process gets it. Step 0: as the run starts, before the trackers open."""

    def __init__(self, step: int, signal_name: str = "SIGTERM", rank: int | None = None):
        self.step, self.signal_name, self.rank = step, signal_name, rank

    def on_train_start(self, run):
        self.on_step_end(run)

    def on_step_end(self, run):
        if run.state.step == self.step and self.rank in (None, run.accelerator.process_index):
            os.kill(os.getpid(), getattr(signal, self.signal_name))


class RemoveAt(Callback):
    """After optimizer step `step`, delete the folder `path` (a tracker's store lost mid-run)."""

    def __init__(self, step: int, path: str):
        self.step, self.path = step, Path(path)

    def on_step_end(self, run):
        if run.state.step == self.step:
            shutil.rmtree(self.path)


class KilledOnceAt(Callback):
    """After optimizer step `step`, SIGKILL process `rank` (a worker lost to a crash or the OOM killer), the first
    time only: `marker` is written first, so the group a launcher restarts runs through."""

    def __init__(self, step: int, marker: str, rank: int = 1):
        self.step, self.marker, self.rank = step, Path(marker), rank

    def on_step_end(self, run):
        if run.state.step == self.step and run.accelerator.process_index == self.rank and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


class WaitAt(Callback):
    """After optimizer step `step`, every process waits until the file `release` exists (a run held alive while a
    test does something beside it)."""

    def __init__(self, step: int, release: str):
        self.step, self.release = step, Path(release)

    def on_step_end(self, run):
        while run.state.step == self.step and not self.release.exists():
            time.sleep(0.1)


class StuckAt(Callback):
    """After optimizer step `step`, hang as a data read that never returns would (`marker` written first)."""

    def __init__(self, step: int, marker: str):
        self.step, self.marker = step, marker

    def on_step_end(self, run):
        if run.state.step == self.step:
            open(self.marker, "w").close()
            while True:
                time.sleep(1)


class NaNForwardAt(Callback):
    """Make the next `times` forward passes after step `step` produce NaN logits, on process `rank`."""

    def __init__(self, step: int, rank: int = 0, times: int = 1):
        self.step, self.rank, self.times = step, rank, times

    def on_step_end(self, run):
        if run.state.step == self.step and run.accelerator.process_index == self.rank:
            head = run.accelerator.unwrap_model(run.model).lm_head
            calls = 0

            def poison(module, inputs, output):
                nonlocal calls
                calls += 1
                if calls == self.times:
                    handle.remove()
                return output * float("nan")

            handle = head.register_forward_hook(poison)


class Recorder(Callback):
    """Writes every hook call to `path` (main process) and counts steps in its checkpointed state."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.steps_seen = 0

    def _write(self, run, event, **extra):
        if run.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps({"event": event, "step": run.state.step, "steps_seen": self.steps_seen, **extra})
                        + "\n")

    def on_train_start(self, run):
        self._write(run, "train_start")

    def on_step_end(self, run):
        self.steps_seen += 1

    def on_log(self, run, logs):
        self._write(run, "log", loss=logs["train/loss"])

    def on_eval_end(self, run, metrics):
        self._write(run, "eval", loss=metrics["loss"])

    def on_save(self, run, checkpoint_dir):
        self._write(run, "save", dir=Path(checkpoint_dir).name)

    def on_train_end(self, run):
        self._write(run, "train_end")

    def state_dict(self):
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state):
        self.steps_seen = state["steps_seen"]


class FlakyTracker:
    """A tracker (GeneralTracker protocol) whose `log` raises from its `fail_from`-th call on: a tracker server that
    goes away mid-run. Records what it logged in `LOGGED`."""

    name = "flaky"
    requires_logging_directory = False
    main_process_only = True
    LOGGED: list = []

    def __init__(self, run_name, fail_from: int = 3):
        self.fail_from, self.calls = fail_from, 0

    @property
    def tracker(self):
        return None

    def start(self):
        pass

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        self.calls += 1
        if self.calls >= self.fail_from:
            raise ConnectionError("tracker server went away")
        FlakyTracker.LOGGED.append(step)

    def finish(self):
        pass


class UnreachableTracker(FlakyTracker):
    """A tracker whose server cannot be reached when the run starts (its package is installed: the run is not refused
    up front, the tracker is disabled once its tries are spent)."""

    name = "unreachable"

    def start(self):
        raise ConnectionError("tracker server unreachable")


class BlockingTracker(FlakyTracker):
    """A tracker whose `log` never returns from its `block_from`-th call on (a hung network call)."""

    name = "blocking"

    def __init__(self, run_name, block_from: int = 3):
        super().__init__(run_name)
        self.block_from = block_from

    def log(self, values, step=None, **kwargs):
        import threading

        self.calls += 1
        if self.calls >= self.block_from:
            threading.Event().wait()  # forever
        FlakyTracker.LOGGED.append(step)


class SlowTracker(FlakyTracker):
    """A tracker whose `log` takes `delay` seconds (a slow network), then appends its step to the file `path`."""

    name = "slow"

    def __init__(self, run_name, path: str, delay: float = 0.2):
        super().__init__(run_name)
        self.path, self.delay = Path(path), delay

    def log(self, values, step=None, **kwargs):
        time.sleep(self.delay)
        with self.path.open("a") as f:
            f.write(f"{step}\n")


class SlowSave(Callback):
    """Each checkpoint takes `seconds` more (a large model, a slow disk)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_save(self, run, path):
        time.sleep(self.seconds)


class RaisesAt(Callback):
    """After optimizer step `step`, raise a RuntimeError (a bug in a user's callback)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, run):
        if run.state.step == self.step:
            raise RuntimeError(f"a bug at step {self.step}")


class SameWeightsOnAllRanks(Callback):
    """At the end of training, gathers every process's parameter checksum and writes them to `path` (main process):
    a loop that forgot to average some gradients leaves the ranks' weights apart."""

    def __init__(self, path: str):
        self.path = Path(path)

    def on_train_end(self, run):
        import torch

        model = run.accelerator.unwrap_model(run.model)
        flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
        sums = run.accelerator.gather(torch.stack([flat.sum(), flat.abs().sum()]).reshape(1, 2)).tolist()
        if run.accelerator.is_main_process:
            self.path.write_text(json.dumps(sums))


class EpochRecorder(Callback):
    """Writes each epoch hook call with the epoch and the micro-batches consumed in it, and the end of training (main
    process)."""

    def __init__(self, path: str):
        self.path = Path(path)

    def _write(self, run, event):
        if run.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps({"event": event, "epoch": run.state.epoch, "step": run.state.step,
                                    "batches": run.state.batch_in_epoch}) + "\n")

    def on_epoch_start(self, run):
        self._write(run, "epoch_start")

    def on_epoch_end(self, run):
        self._write(run, "epoch_end")

    def on_train_end(self, run):
        self._write(run, "train_end")


class LightningNamed(Callback):
    """A hook under Lightning's name, which s4accel does not have."""

    def on_train_epoch_end(self, run):
        raise AssertionError("never called")


class ParamPrecision(Callback):
    """After optimizer step 1, writes to `path` (main process), for every parameter: the dtype this process holds it
    in (its ZeRO-3 partition under DeepSpeed), whether its values hold more than bf16 can (a tensor cast to bf16 and
    back holds none), and the dtype DeepSpeed reduces its gradient in (None without DeepSpeed)."""

    def __init__(self, path: str):
        self.path = Path(path)

    def on_step_end(self, run):
        if run.state.step != 1 or not run.accelerator.is_main_process:
            return
        import torch

        zero = getattr(run.model, "optimizer", None)  # the DeepSpeed engine's ZeRO optimizer
        out = {}
        for name, p in run.accelerator.unwrap_model(run.model).named_parameters():
            held = getattr(p, "ds_tensor", p).detach()
            out[name] = {"dtype": str(held.dtype).removeprefix("torch."),
                         "beyond_bf16": bool((held.float() != held.to(torch.bfloat16).float()).any()),
                         "reduce": str(zero.get_param_comm_dtype(p)).removeprefix("torch.")
                         if hasattr(zero, "get_param_comm_dtype") else None}
        self.path.write_text(json.dumps(out))


class LossCompiled(Callback):
    """Writes to `path` whether the model's loss function is compiled when training starts."""

    def __init__(self, path: str):
        self.path = Path(path)

    def on_train_start(self, run):
        from s4accel.training.devices.compiled_loss import is_compiled

        model = run.accelerator.unwrap_model(run.model)
        self.path.write_text(json.dumps(is_compiled(model.loss_function)))


class CPUGradScaler(Callback):
    """fp16's GradScaler on CPU, where Accelerate creates none: torch's CPU GradScaler put where Accelerate's CUDA one
    goes (the accelerator's `scaler`, each optimizer's, and `native_amp` for its unscaling), computing in float32 as
    before. `init_scale` 2**127 makes a language model's first scaled losses overflow; `overflows`: the first N
    gradients of the model's first parameter are infinite, as an overflow makes them. Writes the final scale to
    `path`."""

    def __init__(self, init_scale: float = 2.0**16, path: str | None = None, overflows: int = 0):
        self.init_scale, self.path, self.overflows = init_scale, path, overflows

    def on_train_start(self, run):
        import torch

        from accelerate.optimizer import patch_optimizer_step

        self.scaler = torch.amp.GradScaler("cpu", init_scale=self.init_scale)
        run.accelerator.scaler, run.accelerator.native_amp = self.scaler, True
        for o in run.optimizers:  # what Accelerate's AcceleratedOptimizer sets up when it is given a scaler
            wrapper = o.optimizer
            wrapper.scaler, wrapper._accelerate_step_called = self.scaler, False
            wrapper._optimizer_original_step_method = wrapper.optimizer.step
            wrapper._optimizer_patched_step_method = patch_optimizer_step(wrapper, wrapper.optimizer.step)
        if self.overflows:
            first = next(p for p in run.model.parameters() if p.requires_grad)
            first.register_hook(self._overflow)

    def _overflow(self, grad):
        if self.overflows <= 0:
            return grad
        self.overflows -= 1
        return grad * float("inf")

    def on_train_end(self, run):
        if self.path:
            Path(self.path).write_text(str(self.scaler.get_scale()))


class TimePassesAt(Callback):
    """After optimizer step `step`, count `seconds` more of training time (`train.max_time`) on process `rank` (all
    when None), as a slow step would, without waiting for them."""

    def __init__(self, step: int, seconds: float, rank: int | None = None):
        self.step, self.seconds, self.rank = step, seconds, rank

    def on_step_end(self, run):
        if run.state.step == self.step and self.rank in (None, run.accelerator.process_index):
            run.state.train_seconds += self.seconds


class FailsOnSave(Callback):
    """Raises when a checkpoint is written (a bug a real run meets only at its first checkpoint, maybe hours in)."""

    def on_save(self, run, path):
        raise RuntimeError(f"cannot save alongside {path.name}")


class SignalOnceAt(Callback):
    """SIGTERM after optimizer step `step` of the first run that gets here (`marker` is written then): of a sweep's
    trials, only the first is stopped."""

    def __init__(self, step: int, marker: str):
        self.step, self.marker = step, Path(marker)

    def on_step_end(self, run):
        if run.state.step == self.step and not self.marker.exists():
            self.marker.write_text("stopped")
            os.kill(os.getpid(), signal.SIGTERM)
