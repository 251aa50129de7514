"""Label smoothing (`train.label_smoothing`): the built-in tasks train against smoothed targets and evaluate the plain
negative log-likelihood."""

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY, recipe_accelerator, recipe_error, small_text_file

DIGITS = TINY.parent / "digits.yaml"


def reference(logits, targets, e, ignore=-100):
    """(1 - e) x the target's negative log-probability + e x the mean over classes of each one's, averaged over the
    targets that are not ignored: the smoothed cross-entropy written out."""
    logp = logits.double().log_softmax(-1)
    keep = targets != ignore
    nll = -logp[keep].gather(-1, targets[keep][:, None])[:, 0]
    uniform = -logp[keep].mean(-1)
    return ((1 - e) * nll + e * uniform).mean()


def test_the_smoothed_causal_lm_loss_keeps_transformers_contract():
    """Unsmoothed it is transformers' causal-LM loss to the bit (mean, or sum over num_items_in_batch; labels shifted,
    or shift_labels given); smoothed it is the formula, ignored targets left out of both terms."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from s4accel.training.label_smoothing import smoothed_causal_lm_loss

    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 7, 11, generator=g), torch.randint(0, 11, (2, 7), generator=g)
    labels[0, 3] = -100
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(9)}, {"shift_labels": labels.roll(-1, 1)}):
        ours = smoothed_causal_lm_loss(logits, labels, 11, smoothing=0.0, **kwargs)
        assert torch.equal(ours, ForCausalLMLoss(logits, labels, 11, **kwargs)), kwargs
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    smoothed = smoothed_causal_lm_loss(logits, labels, 11, smoothing=0.2)
    torch.testing.assert_close(smoothed.double(), reference(logits, shifted, 0.2), rtol=1e-6, atol=0)
    summed = smoothed_causal_lm_loss(logits, labels, 11, num_items_in_batch=torch.tensor(4), smoothing=0.2)
    n_targets = int((shifted != -100).sum())
    torch.testing.assert_close(summed.double(), reference(logits, shifted, 0.2) * n_targets / 4, rtol=1e-6, atol=0)


def built(overrides, recipe=TINY):
    from s4accel.config import load_recipe
    from s4accel.training.setup import build_run

    accelerator = recipe_accelerator(overrides, recipe)
    torch.manual_seed(0)  # the same initial model every time: its loss is 0.004 from the unsmoothed one
    run = build_run(load_recipe(recipe, overrides), accelerator, None, optimizers=False)
    return run, next(iter(run.loaders.train))


def test_a_language_model_trains_on_smoothed_targets_and_evaluates_the_plain_likelihood(tmp_path, hf_cache):
    text = small_text_file(tmp_path)
    run, batch = built([f"run.out_dir={tmp_path / 'r'}", "data.source=files", f"data.files=[{text}]",
                        "data.seq_len=32", "data.batch_size=4", "data.packing=concat", "train.label_smoothing=0.1"])
    model, task = run.model, run.task
    with torch.no_grad():
        loss = task.training_step(model, batch, 0).loss
        logits = model(input_ids=batch["input_ids"]).logits
        targets = batch["labels"][:, 1:]
        torch.testing.assert_close(loss.double(), reference(logits[:, :-1], targets, 0.1), rtol=1e-5, atol=0)
        plain = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="sum")
        scored = task.validation_step(model, batch)
        torch.testing.assert_close(scored["nll"].sum(), plain, rtol=1e-5, atol=0)
        assert abs(loss.item() - plain.item() / targets.numel()) > 1e-4  # not the plain loss


def test_a_classifier_trains_on_smoothed_targets(tmp_path, hf_cache):
    run, batch = built([f"run.out_dir={tmp_path / 'r'}", "train.label_smoothing=0.3",
                        "model.overrides={d_model: 16, n_layer: 1, d_state: 8}"], DIGITS)
    with torch.no_grad():
        loss = run.task.training_step(run.model, batch, 0)
        logits = run.model(input_values=batch["input_values"]).logits
    torch.testing.assert_close(loss.double(), reference(logits, batch["labels"], 0.3), rtol=1e-5, atol=0)


@pytest.mark.parametrize("overrides, message", [
    (["data.source=arrays", "data.files=[x.npz]", "data.task=regression", "train.label_smoothing=0.1"],
     "train.label_smoothing smooths class targets; data.task regression predicts numbers"),
    (["train.label_smoothing=1"], "train.label_smoothing: Input should be less than 1"),
    (["train.label_smoothing_factor=0.1"], "transformers.Trainer's name: in a recipe it is train.label_smoothing"),
])
def test_label_smoothing_mistakes_are_one_line(overrides, message):
    assert message in recipe_error(overrides)


def test_a_checkpoint_from_before_label_smoothing_resumes_as_unsmoothed():
    from s4accel.config import load_recipe
    from s4accel.training.runs.resume import recipe_diff

    old = load_recipe(TINY).to_dict()
    del old["train"]["label_smoothing"]
    assert recipe_diff(old, load_recipe(TINY).to_dict()) == []
    assert recipe_diff(old, load_recipe(TINY, ["train.label_smoothing=0.1"]).to_dict()) == [
        "train.label_smoothing: 0.0 -> 0.1"]
