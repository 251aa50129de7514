"""CUDA graphs for small models: `train.compile: true` with `train.compile_mode: reduce-overhead` (or
`max-autotune`, which also captures) replays each compiled forward and backward as one CUDA graph, so a step of a
small model no longer waits on hundreds of kernel launches.

torch.compile's CUDA graph trees do the capture; this file holds what the loop has to know about them:

- the whole model is compiled, not block by block: one graph then covers the embedding, every block, the head and the
  loss (regional compilation would leave those eager, launch by launch, between per-block graphs);
- a graph's outputs live in memory its next replay overwrites, so what the loop keeps of a micro-batch (its loss,
  the router statistics) is copied out before the next one runs (`keep`);
- where a part of the step cannot be captured (a CPU tensor, a host read, a dynamic shape), torch runs that part
  compiled without a graph and counts it: the run says so in one line after its first step (`GraphReport`).

Without a CUDA device there is nothing to capture: the modes compile as `default` does, and the run says so.
"""

from __future__ import annotations

import torch

GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""torch.compile modes that capture CUDA graphs."""


def wants_graphs(cfg) -> bool:
    """A recipe's `train` section asks for CUDA graphs (whatever the device)."""
    return bool(cfg.compile) and cfg.compile_mode in GRAPH_MODES


def captures_graphs(accelerator) -> bool:
    """This run's compiled model replays CUDA graphs: compiled in a graph mode, on a CUDA device."""
    plugin = accelerator.state.dynamo_plugin
    return (accelerator.device.type == "cuda" and str(getattr(plugin.backend, "value", plugin.backend)) != "NO"
            and plugin.mode in GRAPH_MODES)


def keep(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy that the next replay of a graph cannot overwrite."""
    return tensor.detach().clone()


def start_line(recipe, accelerator) -> str | None:
    """One line at the start of a run that asked for CUDA graphs: what is captured, or why nothing is."""
    cfg = recipe.train
    if not wants_graphs(cfg):
        return None
    if accelerator.device.type != "cuda":
        return (f"train.compile_mode={cfg.compile_mode}: no CUDA device, so no CUDA graphs; the model is compiled "
                f"whole, as in mode default")
    return (f"CUDA graphs: the whole model compiled in mode {cfg.compile_mode}; its forward and backward are "
            f"captured at the first step and replayed after (static shapes; a new shape is captured once more)")


def skipped_parts() -> int:
    """How many compiled graphs torch has run without CUDA graphs in this process so far (inductor's own counter:
    torch has no public way to ask, and its reason goes to a log artifact that is off by default)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


class GraphReport:
    """After the first step of a run that captures graphs: one line if some part was not captured."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.pending = captures_graphs(accelerator)
        self.before = skipped_parts() if self.pending else 0

    def after_step(self) -> None:
        if not self.pending:
            return
        self.pending = False
        if skipped := skipped_parts() - self.before:
            self.accelerator.print(f"CUDA graphs: {skipped} part(s) of the step could not be captured and run "
                                   f"compiled without a graph (TORCH_LOGS=cudagraphs says why)")
