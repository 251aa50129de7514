"""Run under `accelerate launch` with 2 processes: `s4accel.train(recipe)` with the arguments given, or an s4accel
command (`cli ARGS...`: predict, eval), recording whether a DDP-wrapped model is still alive when the process group is
destroyed (its reducer holds the group, and freeing it after another process has exited made a process hang at exit)
and whether the group is left to interpreter exit (where gloo's threads sometimes abort mid-teardown). Each rank
writes OUT_DIR/rank<i>.json.

Usage: accelerate launch ... exit_order.py OUT_DIR RECIPE [section.key=value ...]
       accelerate launch ... exit_order.py OUT_DIR cli COMMAND ARGS..."""

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
report = {}
if sys.argv[2] == "cli":
    from s4accel.cli import main

    try:
        main(sys.argv[3:])
    except SystemExit as e:
        report["exit"] = e.code or 0
else:
    report["steps"] = s4accel.train(s4accel.load_recipe(sys.argv[2], sys.argv[3:])).steps
report |= {"ddp_alive_at_destroy": seen, "initialized": torch.distributed.is_initialized()}
(Path(sys.argv[1]) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))
