"""Training: one Accelerator loop (`loop.py`) for any task (`task.py`), and the components it is made of.

    loop.py           train(): setup helpers, the numbered loop, export, a clean exit
    step.py           one optimizer step: micro-batch window, clipping, agreement, non-finite skip, update, rewind
    evaluate.py       gathered evaluation and its report
    metrics.py        the logged training scalars, expert load
    task.py           the Task API (receives its run context once), load_task
    tasks_builtin.py  the causal-LM and sequence-classification tasks, and building a model from a recipe
    samples.py        prompts completed by the trained language model
    carried_state.py  the recurrent state carried along long streams (stateful training)
    callbacks.py      hooks and the built-ins (EMA, early stopping, keep-best)
    checkpoint.py     checkpoints (atomic, checksummed, verified) and the exported model
    zero.py           DeepSpeed: the recipe's step settings and bf16 policy in its config, the ZeRO-3 model build
    resume.py         which checkpoint, whether the recipe still matches, loading it, what --force changes
    run_dir.py        the run directory's life (checked first, written only once every check passed)
    optim.py          AdamW parameter groups and the schedule
    tracking.py       trackers, guarded so that none can stop training
    preemption.py     SIGTERM/SIGINT -> a flag the processes agree on
"""

from .loop import TrainResult, train

__all__ = ["TrainResult", "train"]
