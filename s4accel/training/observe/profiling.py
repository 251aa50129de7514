"""`train.profile`: `torch.profiler` over a few optimizer steps of the real run, as a callback. Each process writes
its trace into `<run_dir>/profile/` (Chrome trace JSON: TensorBoard's profiler plugin and ui.perfetto.dev read it);
the main process also writes the operators' totals as a table, readable without any viewer."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from ..callbacks import Callback


class Profile(Callback):
    """Steps are the loop's optimizer steps: `wait` untraced, `warmup` traced and discarded, `active` recorded; then
    the trace is written once (no repeat) and profiling stops."""

    def __init__(self, wait: int, warmup: int, active: int, record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False):
        self.schedule = dict(wait=wait, warmup=warmup, active=active)
        self.options = dict(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack)
        self.profiler: torch.profiler.profile | None = None
        self.cut_short = False

    def on_train_start(self, run) -> None:
        self.out = Path(run.run_dir) / "profile"
        self.first_step = run.state.step + self.schedule["wait"] + self.schedule["warmup"] + 1
        worker = f"rank{run.accelerator.process_index}"
        writer = tensorboard_trace_handler(str(self.out), worker_name=worker)

        def on_trace_ready(prof):  # once, after the last active step (or at a stop before it: dropped)
            if self.cut_short:
                return
            writer(prof)
            if run.accelerator.is_main_process:
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
                (self.out / "summary.txt").write_text(table + "\n")
                last = self.first_step + self.schedule["active"] - 1
                run.accelerator.print(f"profile: steps {self.first_step}-{last} traced into {self.out} (open the "
                                      f"*.pt.trace.json in TensorBoard or ui.perfetto.dev; totals in summary.txt)")

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profiler = profile(activities=activities, schedule=schedule(**self.schedule, repeat=1),
                                on_trace_ready=on_trace_ready, **self.options)
        self.profiler.start()

    def on_step_end(self, run) -> None:
        if self.profiler is not None:
            self.profiler.step()
            if run.state.step >= self.first_step + self.schedule["active"] - 1:  # written: stop recording
                self.stop()

    def on_train_end(self, run) -> None:
        if self.profiler is not None:  # a run shorter than the schedule: a part of the steps is no trace of them
            self.cut_short = True
            run.accelerator.print(f"profile: the run ended before step {self.first_step + self.schedule['active'] - 1}"
                                  f", the last one to profile; no trace written")
        self.stop()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
