"""S4 against a transformer encoder and a GRU on ListOps, on the CPU, each trained for the same wall time: the
long-range comparison of issue 24, sized for a small machine. Prints one JSON object.

    python bench/lra_listops.py --lengths 128 512 --seconds 600 --threads 2

For each maximum length L: ListOps drawn by s4accel's generator (the LRA paper's procedure; lengths from L/4 to L
symbols, `--max-depth`, seeded), one train/val/test set that every model reads in the same seeded order, with the
`listops` tokenizer's ids (parentheses dropped). Each model then trains for `--seconds` of wall time (AdamW, a linear
warmup over `--warmup` steps then a constant lr, gradient norm clipped at 1, batches padded to their longest
expression, padding masked), and its validation and test accuracy are measured afterwards (evaluation is not
counted in the time). The test set's majority-class rate is reported beside them: ListOps' labels are far from
uniform, so accuracy means something only above it.

The models, all `--d-model` wide and `--layers` deep, mean-pooled over the real positions, with a linear head:

    s4           S4ForSequenceClassification: bidirectional S4D (`--d-state`), batch norm after each block (the S4
                 paper's ListOps layout), the SSM parameters at min(1e-3, lr) without weight decay
    transformer  a bidirectional encoder (torch's TransformerEncoder, pre-norm, `--heads` heads, feed-forward
                 2 x d_model) over token plus learned position embeddings
    gru          a bidirectional GRU (d_model / 2 per direction, so its output is d_model wide) over packed sequences

Each model's parameter count is reported: they are the same width and depth, not the same parameter count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch
from torch import nn

from s4accel.data.lra_text import listops_tokenizer
from s4accel.tools.listops import generate


# --------------------------------------------------------------------------------------------------------------------
# Data


def listops_sets(n: dict[str, int], max_length: int, max_depth: int, seed: int, tokenizer) -> dict:
    """{split: (list of id arrays, labels)} of distinct generated expressions, L/4 to L symbols."""
    rows = generate(sum(n.values()), max(1, max_length // 4), max_length, max_depth, 10, seed)
    out, start = {}, 0
    for split, count in n.items():
        part = rows[start:start + count]
        start += count
        ids = tokenizer([text for text, _, _ in part], add_special_tokens=False)["input_ids"]
        out[split] = ([np.asarray(x, dtype=np.int64) for x in ids], np.asarray([v for _, v, _ in part]))
    return out


def batch_of(ids: list[np.ndarray], labels: np.ndarray, index) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids (B, longest), mask (B, longest), labels (B,)), right-padded with id 0."""
    longest = max(len(ids[i]) for i in index)
    x = np.zeros((len(index), longest), dtype=np.int64)
    mask = np.zeros((len(index), longest), dtype=np.int64)
    for row, i in enumerate(index):
        x[row, :len(ids[i])] = ids[i]
        mask[row, :len(ids[i])] = 1
    return torch.from_numpy(x), torch.from_numpy(mask), torch.as_tensor(labels[list(index)])


# --------------------------------------------------------------------------------------------------------------------
# Models: (input ids, mask) -> logits (B, 10)


def masked_mean(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask[..., None].to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp(min=1)


class S4Classifier(nn.Module):
    def __init__(self, args, vocab: int, max_length: int):
        super().__init__()
        from s4accel import S4Config, S4ForSequenceClassification

        config = S4Config(vocab_size=vocab, d_model=args.d_model, n_layer=args.layers, d_state=args.d_state,
                          kernel="s4d", bidirectional=True, prenorm=False, norm="batch", pooling="mean",
                          num_labels=10, pad_token_id=0, l_max=max_length)
        self.model = S4ForSequenceClassification(config)

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).logits


class TransformerClassifier(nn.Module):
    def __init__(self, args, vocab: int, max_length: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, args.d_model, padding_idx=0)
        self.position = nn.Embedding(max_length, args.d_model)
        layer = nn.TransformerEncoderLayer(args.d_model, args.heads, 2 * args.d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, 10)

    def forward(self, ids, mask):
        h = self.embed(ids) + self.position(torch.arange(ids.shape[1]))[None]
        h = self.norm(self.encoder(h, src_key_padding_mask=mask == 0))
        return self.head(masked_mean(h, mask))


class GRUClassifier(nn.Module):
    def __init__(self, args, vocab: int, max_length: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, args.d_model, padding_idx=0)
        self.gru = nn.GRU(args.d_model, args.d_model // 2, args.layers, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * (args.d_model // 2), 10)

    def forward(self, ids, mask):
        # packed, so the backward direction starts at each expression's last real symbol, not in the padding
        lengths = mask.sum(1)
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(ids), lengths, batch_first=True, enforce_sorted=False)
        h, _ = self.gru(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=ids.shape[1])
        return self.head(masked_mean(h, mask))


MODELS = {"s4": S4Classifier, "transformer": TransformerClassifier, "gru": GRUClassifier}


def optimizer_for(name: str, model: nn.Module, args) -> torch.optim.AdamW:
    if name == "s4":  # s4accel's own groups: SSM parameters by name, at min(1e-3, lr), without weight decay
        from s4accel.config import OptimCfg
        from s4accel.training.optim import param_groups

        groups = param_groups(model, OptimCfg(lr=args.lr[name], weight_decay=args.weight_decay,
                                              ssm_lr=min(1e-3, args.lr[name])))
        groups = [{k: v for k, v in g.items() if k != "name"} for g in groups]
    else:
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr[name], betas=(0.9, 0.98))


# --------------------------------------------------------------------------------------------------------------------
# Training for a wall time, then accuracy


def train_for(name: str, model: nn.Module, train, args) -> dict:
    ids, labels = train
    opt = optimizer_for(name, model, args)
    base = [g["lr"] for g in opt.param_groups]
    order = torch.Generator().manual_seed(args.seed)  # the same batches, in the same order, for every model
    model.train()
    steps, losses, queue = 0, [], []
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        if len(queue) < args.batch:
            queue += torch.randperm(len(ids), generator=order).tolist()
        index, queue = queue[:args.batch], queue[args.batch:]
        x, mask, y = batch_of(ids, labels, index)
        for group, lr in zip(opt.param_groups, base):
            group["lr"] = lr * min(1.0, (steps + 1) / args.warmup)
        loss = nn.functional.cross_entropy(model(x, mask), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    return {"steps": steps, "examples": steps * args.batch, "train_seconds": round(seconds, 2),
            "seconds_per_step": round(seconds / max(steps, 1), 4),
            "train_loss_last_50": round(float(np.mean(losses[-50:])), 4) if losses else None}


@torch.no_grad()
def accuracy(model: nn.Module, data, batch: int) -> float:
    ids, labels = data
    model.eval()
    hits = 0
    for start in range(0, len(ids), batch):
        x, mask, y = batch_of(ids, labels, range(start, min(start + batch, len(ids))))
        hits += int((model(x, mask).argmax(-1) == y).sum())
    return hits / len(ids)


def run_length(max_length: int, args, tokenizer) -> dict:
    sets = listops_sets({"train": args.train, "val": args.val, "test": args.test}, max_length, args.max_depth,
                        args.seed, tokenizer)
    test_labels = sets["test"][1]
    lengths = [len(x) for split in sets.values() for x in split[0]]
    out = {"symbols": {"min": min(lengths), "mean": round(float(np.mean(lengths)), 1), "max": max(lengths)},
           "test_majority_rate": round(float(np.bincount(test_labels, minlength=10).max() / len(test_labels)), 4),
           "models": {}}
    for name in args.models:
        torch.manual_seed(args.seed)
        model = MODELS[name](args, len(tokenizer), max_length)
        entry = {"parameters": sum(p.numel() for p in model.parameters()), "lr": args.lr[name]}
        entry.update(train_for(name, model, sets["train"], args))
        entry["val_accuracy"] = round(accuracy(model, sets["val"], args.eval_batch), 4)
        entry["test_accuracy"] = round(accuracy(model, sets["test"], args.eval_batch), 4)
        out["models"][name] = entry
    tests = {k: v["test_accuracy"] for k, v in out["models"].items()}
    if "s4" in tests:
        out["s4_minus"] = {k: round(tests["s4"] - v, 4) for k, v in tests.items() if k != "s4"}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512], help="maximum symbols per expression")
    ap.add_argument("--seconds", type=float, default=600.0, help="wall time each model trains, per length")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--train", type=int, default=20000)
    ap.add_argument("--val", type=int, default=500)
    ap.add_argument("--test", type=int, default=2000)
    ap.add_argument("--max-depth", type=int, default=10, help="the generator's depth limit (LRA: 10)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-state", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-batch", type=int, default=128)
    ap.add_argument("--lr-s4", type=float, default=4e-3)
    ap.add_argument("--lr-transformer", type=float, default=1e-3)
    ap.add_argument("--lr-gru", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=50, help="linear warmup steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    args = ap.parse_args()
    args.lr = {"s4": args.lr_s4, "transformer": args.lr_transformer, "gru": args.lr_gru}
    torch.set_num_threads(args.threads)
    tokenizer = listops_tokenizer()
    load = os.getloadavg()
    results = {str(L): run_length(L, args, tokenizer) for L in args.lengths}
    config = {k: v for k, v in vars(args).items()}
    print(json.dumps({"config": config,
                      "machine": {"torch": torch.__version__, "python": platform.python_version(),
                                  "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                                  "load_average_start": [round(v, 2) for v in load],
                                  "load_average_end": [round(v, 2) for v in os.getloadavg()]},
                      "lengths": results}, indent=1))


if __name__ == "__main__":
    main()
