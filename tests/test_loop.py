"""The loop's gradient arithmetic: accumulation over ragged micro-batches equals one big batch, not the mean of
per-micro-batch means."""

import math

import pytest
import torch

from s4accel import S4Config, S4ForCausalLM


def _ragged_batch():
    torch.manual_seed(1)
    ids = torch.randint(3, 40, (4, 24))
    labels = ids.clone()
    labels[0, 4:] = -100  # 3 targets
    labels[1, 20:] = -100  # 19 targets
    labels[2, 9:] = -100  # 8 targets
    return ids, labels  # row 3: 23 targets


def _fresh_accelerator(ga):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import GradientAccumulationPlugin

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=ga, sync_with_dataloader=False))


def _grads_and_loss(ga, normalise=True):
    from s4accel.training.step import backward_window

    ids, labels = _ragged_batch()
    accelerator = _fresh_accelerator(ga)
    torch.manual_seed(0)
    model = accelerator.prepare(S4ForCausalLM(S4Config(d_model=16, n_layer=2, d_state=8, vocab_size=40)))
    bs = 4 // ga
    window = [{"input_ids": ids[i : i + bs], "labels": labels[i : i + bs]} for i in range(0, 4, bs)]
    if normalise:
        loss = backward_window(accelerator, model, window)["loss"]
    else:  # what a naive loop does: the mean of per-micro-batch means
        loss = 0
        for batch in window:
            with accelerator.accumulate(model):
                out = model(**batch)
                accelerator.backward(out.loss)
                loss += out.loss.detach() / ga
    return {n: p.grad.clone() for n, p in model.named_parameters()}, loss


@pytest.mark.parametrize("ga", [2, 4])
def test_accumulation_over_ragged_micro_batches_equals_one_big_batch(ga):
    big, big_loss = _grads_and_loss(1)
    acc, acc_loss = _grads_and_loss(ga)
    torch.testing.assert_close(acc_loss, big_loss, rtol=1e-5, atol=1e-6)
    for name in big:
        torch.testing.assert_close(acc[name], big[name], rtol=1e-4, atol=1e-7, msg=name)
    # ... and the data is ragged enough that the naive mean of means would be wrong:
    naive, _ = _grads_and_loss(ga, normalise=False)
    worst = max(((naive[n] - big[n]).norm() / big[n].norm()).item() for n in big)
    assert worst > 0.05


@pytest.mark.parametrize("ga", [1, 2])
def test_router_losses_are_backpropagated_once_per_window_as_the_mean_over_micro_batches(ga):
    """An MoE model's `loss` includes its own micro-batch's `aux_loss`: the window's gradient must be that of
    (token mean of the LM loss over the window) + (mean of the micro-batches' aux losses), not aux x grad_accum."""
    from s4accel import MoEConfig, MoEForCausalLM
    from s4accel.training.step import backward_window

    ids, labels = _ragged_batch()
    config = MoEConfig(d_model=16, n_layer=2, n_head=2, d_ffn=24, num_experts=4, vocab_size=40,
                       router_aux_loss_coef=0.5, router_z_loss_coef=0.1)
    accelerator = _fresh_accelerator(ga)
    torch.manual_seed(0)
    model = accelerator.prepare(MoEForCausalLM(config))
    bs = 4 // ga
    window = [{"input_ids": ids[i : i + bs], "labels": labels[i : i + bs]} for i in range(0, 4, bs)]
    scalars = backward_window(accelerator, model, window)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    torch.manual_seed(0)
    reference = MoEForCausalLM(config)
    lm = reference(ids, labels=labels)
    aux = sum(reference(**b).aux_loss for b in window) / ga
    (lm.loss - lm.aux_loss + aux).backward()
    for n, p in reference.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)
    torch.testing.assert_close(scalars["loss"], (lm.loss - lm.aux_loss).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scalars["aux_loss"], aux.detach(), rtol=1e-5, atol=1e-6)
    assert scalars["expert_counts"].sum().item() == 4 * 24 * 2 * 2  # every token, k = 2, both layers


def test_window_loss_is_the_token_mean_of_the_big_batch():
    ids, labels = _ragged_batch()
    torch.manual_seed(0)
    model = S4ForCausalLM(S4Config(d_model=16, n_layer=2, d_state=8, vocab_size=40))
    _, loss = _grads_and_loss(2)
    torch.testing.assert_close(loss, model(ids, labels=labels).loss.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overflow", [True, False])
def test_a_skipped_fp16_step_does_not_advance_the_schedule(overflow):
    """On CPU Accelerate creates no GradScaler: torch's CPU one stands in, in a stand-in accelerator."""
    from types import SimpleNamespace

    from s4accel.training.runs.checkpoint import TrainState
    from s4accel.training.step import step_optimizers
    from s4accel.training.task import TrainOptimizer

    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # as the backward pass does: the scale is made at its first use
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    param.grad = torch.full((2,), math.inf if overflow else 4.0)  # the scaled gradient
    scaler.unscale_(opt)  # as the clipping does
    state = TrainState()
    wrapped = SimpleNamespace(optimizer=opt, zero_grad=opt.zero_grad)  # Accelerate's AcceleratedOptimizer
    step_optimizers(SimpleNamespace(scaler=scaler), [TrainOptimizer("main", wrapped, sched)], state, overflow)
    assert sched.last_epoch == (0 if overflow else 1)
    assert state.scaler_skips == (1 if overflow else 0)  # counted, and logged as train/scaler_skips
    assert param.grad is None  # gradients are cleared either way
    assert torch.equal(param.detach(), torch.ones(2) if overflow else torch.zeros(2))  # 1 - lr * 4 / 4
    assert scaler.get_scale() == (2.0 if overflow else 4.0)  # an overflow lowers the scale


@pytest.mark.filterwarnings("ignore:fp16 mixed precision has no effect on CPU")
@pytest.mark.parametrize("optimizer", [[], ["optim.name=muon"]], ids=["adamw", "muon"])
def test_fp16s_gradscaler_unscales_each_optimizer_once_and_an_overflow_lowers_the_scale(optimizer, tmp_path):
    """With torch's CPU GradScaler where Accelerate puts its CUDA one (NOTES 13: CPU runs have none), scaling by
    2**16 and back is exact: the run ends on the weights of the run without it, with one optimizer and with Muon's
    two (Accelerate's step updated the scaler after the first, and the second stepped on gradients divided by the
    scale twice). With a scale so large the first steps overflow, those steps are skipped and the scale comes down
    until the run trains (it stopped at the second step: unscale_ called twice without an update)."""
    from helpers import (TINY, callback_override, final_weights, read_metrics, short_epochs, small_text_file,
                         train_in_process)

    text = small_text_file(tmp_path)
    common = [*optimizer, "train.mixed_precision=fp16", "train.ema=null", "train.max_steps=8", "log.log_every=1"]
    train_in_process(TINY, short_epochs(text, tmp_path / "plain", *common))
    train_in_process(TINY, short_epochs(text, tmp_path / "scaled", *common,
                                        callback_override("testing_callbacks:CPUGradScaler")))
    plain, scaled = final_weights(tmp_path / "plain"), final_weights(tmp_path / "scaled")
    assert all(torch.equal(plain[k], scaled[k]) for k in plain)
    scale = tmp_path / "scale.txt"
    result = train_in_process(TINY, short_epochs(text, tmp_path / "overflow", *common, callback_override(
        "testing_callbacks:CPUGradScaler", init_scale=2.0**127, path=str(scale))))
    assert result.steps == 8
    last = [r for r in read_metrics(tmp_path / "overflow") if "train/scaler_skips" in r][-1]
    assert last["train/scaler_skips"] >= 1 and last["train/nonfinite_skips"] == 0
    assert float(scale.read_text()) < 2.0**127


def test_evaluation_leaves_the_training_rng_untouched():
    """Evaluating (every DataLoader iterator draws a seed from the global RNG) must not shift the random stream that
    dropout uses, or how often a run evaluates would change its training, and a resumed run would drift."""
    from torch.utils.data import DataLoader

    from s4accel.config import Recipe
    from s4accel.data import collate_lm
    from s4accel.training.tasks_builtin import CausalLMTask
    from s4accel.training.evaluate import evaluate
    from s4accel.training.task import TaskContext

    accelerator = _fresh_accelerator(1)
    task = CausalLMTask(Recipe())
    task.setup(TaskContext(accelerator, run_dir=None))
    model = accelerator.prepare(S4ForCausalLM(S4Config(d_model=16, n_layer=1, d_state=8, vocab_size=40)))
    val = accelerator.prepare(DataLoader([{"input_ids": torch.randint(3, 40, (12,))} for _ in range(6)],
                                         batch_size=2, collate_fn=collate_lm))
    task.token_bytes = task.token_chars = torch.ones(40, dtype=torch.long)
    before = torch.get_rng_state()
    metrics = evaluate(accelerator, task, model, val)
    assert torch.equal(torch.get_rng_state(), before)
    assert metrics["loss"] > 0 and metrics["bits_per_byte"] == pytest.approx(metrics["loss"] / math.log(2))
    assert evaluate(accelerator, task, model, val, abort=lambda: True) is None  # a stop signal cuts it short
    assert torch.equal(torch.get_rng_state(), before)


def test_expert_load_logs_shares_and_warns_once_about_a_dead_expert():
    from s4accel.training.observe.metrics import ExpertLoad

    load = ExpertLoad(warn_steps=20)
    busy = torch.tensor([[30, 10, 0, 20]])  # (n_moe = 1, E = 4); expert 2 gets nothing
    logs = load.update(busy, torch.tensor([6]), steps=10, step=10)
    assert [logs[f"moe/load/layer0/expert{e}"] for e in range(4)] == [0.5, 1 / 6, 0.0, 1 / 3]
    assert logs["moe/dropped_fraction"] == pytest.approx(0.1)
    assert logs["moe/idle_experts"] == 1
    with pytest.warns(UserWarning, match="expert 2 of MoE layer 0 has received no token for 20 steps"):
        load.update(busy, torch.tensor([0]), steps=10, step=20)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning while it stays dead ...
        load.update(busy, torch.tensor([0]), steps=10, step=30)
        load.update(torch.tensor([[30, 10, 5, 20]]), torch.tensor([0]), steps=10, step=40)  # ... it recovers
    with pytest.warns(UserWarning, match="expert 2"):  # and dies again: warned again
        load.update(busy, torch.tensor([0]), steps=20, step=60)


def test_an_optimizer_step_does_not_search_the_import_system(tmp_path, hf_cache, monkeypatch):
    """Accelerate's optimizer step asks whether `lomo_optim` is installed, twice a step, through
    `importlib.util.find_spec` (0.37 ms a step here, a tenth of a tiny model's step): in s4accel's run it is asked
    once per run, however many steps it takes."""
    import importlib.util

    from helpers import TINY, train_in_process

    real, calls = importlib.util.find_spec, []

    def counting(name, *args, **kwargs):
        calls.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", counting)
    counts = {}
    for steps in (20, 40):
        calls.clear()
        train_in_process(TINY, [f"run.out_dir={tmp_path / str(steps)}", f"train.max_steps={steps}",
                                "train.eval_every=0", "checkpoint.every_steps=0", "log.log_with=[jsonl]",
                                "log.progress_bar=false", "sample.prompts=[]"])
        counts[steps] = calls.count("lomo_optim")
    # at most the first step's question and Accelerator.prepare's own, once per run; before: two every step
    assert max(counts.values()) <= 2, counts
