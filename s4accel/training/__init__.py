"""Training: one Accelerator loop (`loop.py`) for any task (`task.py`), and the components it is made of.

    loop.py           train(): setup helpers, the numbered loop, export, a clean exit
    setup.py          build_run(): everything a command builds from a recipe, in one place; make_accelerator()
    step.py           one optimizer step: micro-batch window, clipping, agreement, non-finite skip, update, rewind
    evaluate.py       gathered evaluation and its report
    task.py           the Task API (receives its run context once), load_task
    tasks_builtin.py  the causal-LM and sequence-classification tasks, and building a model from a recipe
    samples.py        prompts completed by the trained language model
    carried_state.py  the recurrent state carried along long streams (stateful training)
    callbacks.py      hooks and the built-ins (EMA, early stopping, keep-best)
    optim.py          AdamW parameter groups and the schedule
    plan.py, ending.py, lora.py, pretrained.py, imports.py: the run's length, leaving together, adapters,
                      pretrained weights, `module:object` names

    runs/             a run's life on disk: checkpoints, resume (also on another number of processes), run
                      directories and their lock, stop signals, safe loading
    devices/          precision, DeepSpeed, context parallelism, CUDA graphs
    observe/          trackers, logged scalars, the console, FLOPs and MFU, the profiler, evaluation scores
"""

from .devices.zero import deepspeed_imported_only_where_used
from .loop import TrainResult, train

# For the whole process, before any command unwraps or saves a model: only a run that uses DeepSpeed imports it
deepspeed_imported_only_where_used()

__all__ = ["TrainResult", "train"]
