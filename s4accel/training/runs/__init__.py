"""A run's life on disk: what makes it survive being stopped and resume exactly.

    checkpoint.py          checkpoints (atomic, checksummed, verified) and the exported model
    checkpoint_weights.py  a checkpoint's weights as a plain state dict (one process, DDP, FSDP shards)
    resume.py              which checkpoint, whether the recipe still matches, loading it, what --force changes
    world.py               resuming on another number of processes
    run_dir.py             the run directory's life (checked first, written only once every check passed)
    run_lock.py            one run per directory at a time
    preemption.py          SIGTERM/SIGINT -> a flag the processes agree on
    safe_load.py           loading pretrained weights: safetensors only, no remote code
"""
