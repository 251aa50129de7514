"""Run under `accelerate launch` with 2 processes: the gradients of one optimizer step of s4accel's loop
(token-normalised, grad_accum=2, ragged micro-batches spread over both ranks) equal the gradients of the whole
global batch in one process. Rank 0 prints the largest relative difference as JSON.

With `packed`: each row packs documents of random lengths (`data.packing: isolated`'s collation), and the reference
is every document run alone in one process (the sum of its token losses over the whole batch's target count)."""

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin

from s4accel import S4Config, S4ForCausalLM
from s4accel.training.step import backward_window

acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2,
                                                                                    sync_with_dataloader=False))
from s4accel.data import collate_isolated

EOS = 1
packed = "packed" in sys.argv[1:]
torch.manual_seed(1)
ids = torch.randint(3, 40, (8, 24))
labels = ids.clone()
positions = None
if packed:
    ids[torch.rand(ids.shape) < 0.15] = EOS  # documents of random lengths, an end-of-document token after each
    batch = collate_isolated(EOS)([{"input_ids": row} for row in ids])
    labels, positions = batch["labels"], batch["position_ids"]
else:
    for row, cut in enumerate([2, 20, 9, 24, 5, 13, 3, 24]):  # very different numbers of real targets per row
        labels[row, cut:] = -100
torch.manual_seed(0)
reference = S4ForCausalLM(S4Config(d_model=16, n_layer=2, d_state=8, vocab_size=40))
model = acc.prepare(S4ForCausalLM(reference.config))
acc.unwrap_model(model).load_state_dict(reference.state_dict())

# This rank's rows: 4 of the 8, as 2 micro-batches of 2.
rank = acc.process_index
mine = [rank * 4 + i for i in range(4)]
window = [{"input_ids": ids[mine[i : i + 2]], "labels": labels[mine[i : i + 2]]} for i in (0, 2)]
if packed:
    for i, micro in zip((0, 2), window):
        micro["position_ids"] = positions[mine[i : i + 2]]
backward_window(acc, model, window)

if not packed:
    reference(ids, labels=labels).loss.backward()  # the whole global batch, one process, plain mean over tokens
else:  # every document alone: the sum of its token losses, over the count of the batch's targets
    n_targets = (labels[:, 1:] != -100).sum()
    total = 0
    for row in range(ids.shape[0]):
        starts = [*(positions[row] == 0).nonzero().flatten().tolist(), ids.shape[1]]
        for s, e in zip(starts[:-1], starts[1:]):
            logits = reference(ids[row : row + 1, s:e]).logits[0, :-1]
            total = total + torch.nn.functional.cross_entropy(logits, labels[row, s + 1 : e], ignore_index=-100,
                                                              reduction="sum")
    (total / n_targets).backward()
worst = max(((p.grad - r.grad).norm() / r.grad.norm()).item()
            for p, r in zip(acc.unwrap_model(model).parameters(), reference.parameters()))
if acc.is_main_process:
    print(json.dumps({"max_rel_diff": worst, "num_processes": acc.num_processes}))
# Leave as the loop does: the wrapped model (its DDP reducer holds the process group) freed on every rank, then the
# group destroyed together. Left to interpreter exit, gloo's threads sometimes died mid-teardown (SIGABRT).
del model
acc.wait_for_everyone()
acc.end_training()
