"""What a run shows: trackers, logged scalars, the console, FLOPs and MFU, the profiler, evaluation scores.

    tracking.py        trackers: TensorBoard, JSONL, Accelerate's by name or your own; their checks
    guarded.py         a tracker that cannot stop training: its own thread, retries, a time limit
    metrics.py         the logged training scalars, expert load, throughput
    console.py         what the libraries print that a user does not need; the run's log file
    flops.py           a training step's FLOPs per family, MFU against a device's peak
    profiling.py       torch.profiler over chosen steps
    class_scores.py    a classifier's F1, per-class precision and recall, confusion matrix
    recipe_metrics.py  metric functions a recipe names (task.metrics)
"""
