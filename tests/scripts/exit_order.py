"""Run under `accelerate launch` with 2 processes: `s4accel.train(recipe)` with the arguments given, recording
whether a DDP-wrapped model is still alive when the process group is destroyed (its reducer holds the group, and
freeing it after another process has exited made a process hang at exit). Each rank writes OUT_DIR/rank<i>.json.

Usage: accelerate launch ... exit_order.py OUT_DIR RECIPE [section.key=value ...]"""

import gc
import json
import os
import sys
from pathlib import Path

import torch.distributed
from torch.nn.parallel import DistributedDataParallel

import s4accel

seen = []
destroy = torch.distributed.destroy_process_group


def recording_destroy(*args, **kwargs):
    seen.append(sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()))
    return destroy(*args, **kwargs)


torch.distributed.destroy_process_group = recording_destroy
result = s4accel.train(s4accel.load_recipe(sys.argv[2], sys.argv[3:]))
report = {"ddp_alive_at_destroy": seen, "steps": result.steps, "initialized": torch.distributed.is_initialized()}
(Path(sys.argv[1]) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))
