"""Every S4 family split along the sequence over P gloo processes against the same model on whole sequences in
one: logits, loss and every parameter gradient. Run by tests/models/test_context_parallel.py:

    python tests/scripts/context_parallel_exactness.py --procs 2 --out report.json

Each process holds a contiguous chunk of every sequence (`ContextParallel.chunk`). The gradient compared is the
mean over processes of each one's objective, as DDP averages it: a language model's loss is a sum over its chunk's
tokens divided by the whole batch's count, times P (what the training loop's x num_processes does); a classifier's
loss and the router losses are the same on every process and enter as they are. The report holds, per family and
dtype, the largest absolute difference of each quantity, and of the dropout masks (training mode) against the masks
one process draws with `ContextParallel(None)`.
"""

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from s4accel.models import S4Config  # noqa: E402
from s4accel.models.context_parallel import ContextParallel  # noqa: E402
from s4accel.models.modeling_s4 import S4ForCausalLM, S4ForSequenceClassification  # noqa: E402
from s4accel.training.devices.context_parallel import split_batch  # noqa: E402

B, L, V = 2, 64, 40

FAMILIES = {
    "s4d_lm": dict(kernel="s4d"),
    "s4_dplr_lm": dict(kernel="s4", l_max=32),
    "s4d_mlp_lm": dict(kernel="s4d", ffn="mlp", d_ffn=24),
    "s4d_moe_lm": dict(kernel="s4d", ffn="moe", num_experts=4, num_experts_per_tok=2, d_ffn=16,
                       router_aux_loss_coef=0.1, router_z_loss_coef=0.01),
    "s4d_lm_documents": dict(kernel="s4d"),
    "s4d_lm_one_row": dict(kernel="s4d"),  # a batch of one (each row's states at odd offsets of what is sent)
    "s4d_mlp_lm_checkpointed": dict(kernel="s4d", ffn="mlp", d_ffn=24),  # blocks recomputed, exchange and all
    "s4d_lm_chunked": dict(kernel="s4d", conv_path="chunked", conv_chunk=16),  # the GPU's convolution, channels first
    "s4d_classifier_bidirectional_mean": dict(kernel="s4d", bidirectional=True, d_input=3, num_labels=3),
    "s4_dplr_classifier_bidirectional_last": dict(kernel="s4", l_max=32, bidirectional=True, d_input=3,
                                                  num_labels=3, pooling="last"),
    "s4d_classifier_causal_last_padded": dict(kernel="s4d", d_input=3, num_labels=3, pooling="last"),
}


def inputs(name: str, dtype):
    g = torch.Generator().manual_seed(1)
    if "classifier" in name:
        batch = {"input_values": torch.randn(B, L, 3, generator=g, dtype=dtype), "labels": torch.tensor([0, 2])}
        if "padded" in name:  # row 1 ends at 37, inside the first chunk of a 2-way split
            mask = torch.ones(B, L, dtype=torch.long)
            mask[1, 37:] = 0
            batch["attention_mask"] = mask
        return batch
    ids = torch.randint(0, V, (1 if "one_row" in name else B, L), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if "documents" in name:  # documents that cross the chunk borders (16, 32, 48) and one that starts on one
        pos = torch.arange(L).repeat(B, 1)
        for row, starts in ((0, (0, 10, 40)), (1, (0, 32, 50))):
            for a, b in zip(starts, (*starts[1:], L)):
                pos[row, a:b] = torch.arange(b - a)
        batch["position_ids"] = pos
        batch["labels"][pos == 0] = -100
    return batch


def model_for(name: str, dtype):
    torch.manual_seed(0)
    kw = dict(d_model=8, n_layer=2, d_state=8, vocab_size=V, dropout=0.0, **FAMILIES[name])
    cls = S4ForSequenceClassification if "classifier" in name else S4ForCausalLM
    model = cls(S4Config(**kw)).to(dtype)
    if "checkpointed" in name:
        model.activation_checkpointing_enable()
    return model


def shifted(labels):
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)


def run(name, dtype, parallel: ContextParallel | None):
    """logits (whole), loss (whole), gradients (mean of the processes' objectives) of one family."""
    model = model_for(name, dtype)
    model.train()  # dropout 0: deterministic; the router losses are computed
    batch = inputs(name, dtype)
    P = 1 if parallel is None else parallel.size
    if parallel is None:
        out = model(**batch)
        out.loss.backward()
        return out.logits.detach(), out.loss.detach(), {k: p.grad for k, p in model.named_parameters()}
    model.set_context_parallel(parallel)
    lm = "classifier" not in name
    local = split_batch(batch, parallel)  # this process's chunk, as the training loop cuts it
    if lm:
        count = (shifted(batch["labels"]) != -100).sum()
        out = model(**local, num_items_in_batch=count)
        aux = out.aux_loss if out.aux_loss is not None else 0
        objective = P * (out.loss - aux) + aux
        loss = parallel.all_reduce((out.loss - aux).detach()) + (aux.detach() if torch.is_tensor(aux) else 0)
        logits = parallel.gather(out.logits.detach()).transpose(0, 1).flatten(1, 2)  # (B, L, V)
    else:
        out = model(**local)
        objective, loss, logits = out.loss, out.loss.detach(), out.logits.detach()
    objective.backward()
    grads = {}
    for k, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=parallel.group)
        grads[k] = g / P
    return logits, loss, grads


def dropout_masks(parallel: ContextParallel | None, dtype):
    """A (B, 3 * DROPOUT_BLOCK / 2, H) ones tensor through the split's dropout, whole."""
    from s4accel.models.context_parallel import DROPOUT_BLOCK
    torch.manual_seed(5)
    n = 3 * DROPOUT_BLOCK // 2 * 2
    whole = torch.ones(2, n, 4, dtype=dtype)
    if parallel is None:
        return ContextParallel(None).dropout(whole, 0.3)
    return parallel.gather(parallel.dropout(parallel.chunk(whole), 0.3)).transpose(0, 1).flatten(1, 2)


def worker(rank, size, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    parallel = ContextParallel(dist.group.WORLD)
    report = {}
    for dtype in (torch.float64, torch.float32):
        for name in FAMILIES:
            logits, loss, grads = run(name, dtype, parallel)
            if rank == 0:
                ref_logits, ref_loss, ref_grads = run(name, dtype, None)
                report[f"{name}/{str(dtype)[6:]}"] = {
                    "logits": (logits - ref_logits).abs().max().item(),
                    "loss": (loss - ref_loss).abs().item(),
                    "grads": max((grads[k] - g).abs().max().item() for k, g in ref_grads.items()),
                    "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
                }
        masks = dropout_masks(parallel, dtype)
        if rank == 0:
            ref = dropout_masks(None, dtype)
            report[f"dropout/{str(dtype)[6:]}"] = {"masks": (masks - ref).abs().max().item(),
                                                    "dropped": (ref == 0).float().mean().item()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # forked: the workers share this process's imports instead of each importing torch and s4accel again
        mp.start_processes(worker, args=(args.procs, os.path.join(tmp, "store"), args.out), nprocs=args.procs,
                           start_method="fork")
