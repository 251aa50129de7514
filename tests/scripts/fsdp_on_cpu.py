"""`s4accel ARGS` through Accelerate's FSDP2 code path on CPU processes (gloo), for tests on machines without GPUs.

Accelerate 1.15 turns an FSDP config into DistributedType.FSDP only for GPU-like setups; on CPU processes it runs
DDP. torch's FSDP2 (`fully_shard`) itself runs on CPU over gloo, so this script lets Accelerate make the FSDP choice
there too (after its own state setup, nothing else changed) and runs s4accel's CLI: the same prepare, sharded
checkpoints, gathered export and EMA shards a GPU run takes. Use it with accelerate_configs/fsdp.yaml."""

import sys

from accelerate import state
from accelerate.utils import DistributedType

_init = state.AcceleratorState.__init__


def init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU and fsdp_plugin is not None:
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":  # as Accelerate sets it up for FSDP on GPUs: one policy for the model
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # later AcceleratorState() calls


state.AcceleratorState.__init__ = init_with_fsdp_on_cpu

if __name__ == "__main__":
    from s4accel.cli import main

    sys.exit(main())
