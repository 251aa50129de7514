"""Samples of a trained language model: the recipe's prompts completed with `generate()`, written to
`<run_dir>/samples.txt` and printed."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

from ..config import Recipe
from .runs.checkpoint import own_class, write_atomic
from .devices.zero import partitioned


def write_samples(accelerator, model, tokenizer, recipe: Recipe, run_dir: Path) -> list[str]:
    """Complete the recipe's prompts with `generate()` on the main process; write them to `samples.txt`. Call on
    every process: a model sharded by FSDP or partitioned by DeepSpeed ZeRO-3 is gathered into a whole copy for the
    main process first."""
    cfg = recipe.sample
    if not cfg.prompts:
        return []
    lm = accelerator.unwrap_model(model)
    if isinstance(lm, FSDPModule) or partitioned(lm):
        full = accelerator.get_state_dict(model)  # collective; the full tensors land on the main process
        lm = own_class(lm, full, device=accelerator.device, gathered=True)[0] if accelerator.is_main_process else None
    if not accelerator.is_main_process:
        return []
    lm.eval()
    torch.manual_seed(cfg.seed)
    samples = []
    for prompt in cfg.prompts:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(accelerator.device)
        sampling = {"do_sample": True, "temperature": cfg.temperature, "top_k": cfg.top_k or 0}
        with accelerator.autocast():
            # synced_gpus: this process alone generates; under DeepSpeed ZeRO-3 transformers would otherwise wait
            # at every token for the other processes, which are not generating
            out = lm.generate(ids, max_new_tokens=cfg.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                              synced_gpus=False, **(sampling if cfg.temperature > 0 else {"do_sample": False}))
        samples.append(tokenizer.decode(out[0], skip_special_tokens=True))
    write_atomic(run_dir / "samples.txt", "\n\n".join(f"--- sample {i}\n{s}" for i, s in enumerate(samples)) + "\n")
    for s in samples:
        accelerator.print(f"--- sample\n{printable(s)}")
    return samples


def printable(text: str) -> str:
    """`text` safe for a terminal: a byte-level model can sample control bytes (escape sequences, carriage returns,
    bells) that would garble or hijack the console; each becomes a visible escape (`\\x1b`). `samples.txt` keeps
    the text as generated."""
    return "".join(c if c in "\n\t" or c.isprintable() else c.encode("unicode_escape").decode() for c in text)
