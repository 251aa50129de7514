"""`train.eval_at_start`: a new run evaluates the model it starts from, at step 0, reported as every evaluation is."""

import torch

from helpers import TINY, final_weights, read_metrics, recipe_accelerator, train_in_process


def test_a_run_evaluates_its_starting_model_at_step_0_and_not_again_when_resumed(tmp_path, text, capsys):
    """The step-0 evaluation is logged and printed like the others; ranked by the highest loss, the best checkpoint
    kept is the starting model itself (the weights the recipe's seed initialises); a resumed run does not evaluate
    at its start."""
    from accelerate.utils import set_seed

    from s4accel.config import load_recipe
    from s4accel.training.setup import build_run

    sets = [f"run.out_dir={tmp_path / 'run'}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32",
            "data.batch_size=4", "train.max_steps=4", "train.eval_every=2", "train.eval_at_start=true",
            "log.progress_bar=false", "sample.prompts=[]", "checkpoint.every_steps=2", "checkpoint.keep_best=1",
            "checkpoint.best_metric=loss", "checkpoint.best_mode=max", "optim.lr=1e-2"]
    result = train_in_process(TINY, sets)
    evals = [r for r in read_metrics(result.run_dir) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert f"step 0: loss {evals[0]['eval/loss']:.4f}" in capsys.readouterr().out
    assert result.best[1:3] == (0, "loss")

    accelerator = recipe_accelerator(sets)
    set_seed(0)
    start = build_run(load_recipe(TINY, sets), accelerator, None, optimizers=False).model.state_dict()
    kept = final_weights(result.run_dir / "best" / "step_00000000", "")
    assert all(torch.equal(kept[k], start[k]) for k in kept)

    resumed = train_in_process(TINY, [*sets, "train.max_steps=6"], resume="latest", force=True)
    assert [r["step"] for r in read_metrics(resumed.run_dir) if "eval/loss" in r] == [0, 2, 4, 6]
