"""How every process of a command leaves: together, with the process group destroyed while all are still there.

Left to interpreter exit, a gloo process group's threads are torn down in whatever order each process dies in, and
one sometimes aborts mid-teardown ("terminate called without an active exception", SIGABRT, and the launcher then
reports the command failed although its work was done)."""

from __future__ import annotations

import gc


def finish(accelerator) -> None:
    """Barrier, release what Accelerate holds of the prepared objects, collect, then end (trackers closed, process
    group destroyed) on every process together. The caller drops its own references to prepared objects first: a
    DDP-wrapped model's reducer holds the group."""
    accelerator.wait_for_everyone()
    accelerator.free_memory()  # its references to the prepared model, optimizers and loaders
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()
