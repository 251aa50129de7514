"""`s4accel ARGS` through Accelerate's DeepSpeed code path on CPU processes (gloo), for tests on machines without GPUs.

Accelerate 1.15 turns a DeepSpeed config into DistributedType.DEEPSPEED only when the processes are not CPU
processes; on CPU processes it runs DDP. DeepSpeed itself runs on CPU (its CPU accelerator, over gloo when Intel's
oneCCL bindings are not installed), so this script lets Accelerate make the DeepSpeed choice there too, as it would
on GPUs (after its own state setup, nothing else changed), and runs s4accel's CLI: the same engine, ZeRO
partitioning, checkpoints and export a GPU run takes. Use it with accelerate_configs/deepspeed_zero{2,3}.yaml."""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: it picks its accelerator once

from accelerate import state  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

_init = state.AcceleratorState.__init__


def init_with_deepspeed_on_cpu(self, mixed_precision=None, cpu=False, *args, deepspeed_plugin=None, **kwargs):
    _init(self, mixed_precision, cpu, *args, deepspeed_plugin=deepspeed_plugin, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU and deepspeed_plugin is not None:
        # What AcceleratorState does for DeepSpeed on GPUs: the plugin takes the precision into DeepSpeed's config
        # (bf16/fp16 sections), and Accelerate itself adds no autocast (DeepSpeed's engine handles precision).
        deepspeed_plugin.set_mixed_precision(self._mixed_precision)
        self.distributed_type = DistributedType.DEEPSPEED
        deepspeed_plugin.select(_from_accelerator_state=True)
        self.deepspeed_plugins = deepspeed_plugin
        self._mixed_precision = "no"
        state.PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED  # later AcceleratorState()


state.AcceleratorState.__init__ = init_with_deepspeed_on_cpu

if __name__ == "__main__":
    from s4accel.cli import main

    sys.exit(main())
