"""What users run around training and on trained models.

    run.py         train(), then push to the Hub when the recipe asks (the public `s4accel.train`)
    inference.py   safe loading, generate, eval
    harness.py     eval --lm-eval: lm-evaluation-harness tasks through its `hf` model
    hub.py         push a run's model with its card, recipe, metrics and logs
    model_card.py  the model card and training-curve image
    finders.py     lr-find and find-batch-size, through the recipe's task
    launcher.py    under accelerate launch / torchrun: the command that continues a stopped run, errors to the launcher;
                   `s4accel launch`
    command_line.py  the command line's help as a user reads it, a bare --resume
"""
