"""`s4accel eval MODEL --lm-eval TASKS`: a trained language model scored by EleutherAI's lm-evaluation-harness
(`pip install 's4accel[lm_eval]'`) through its `hf` model (`HFLM`), the model loaded by s4accel's safe loader.

What HFLM needs told about s4accel's tokenizers: neither has a BOS token, and the byte one (transformers'
`ByT5Tokenizer`) appends `</s>` to every encoding made with special tokens, HFLM's default. A context `c` and
`c + continuation` then both end in `</s>`, so every continuation lost its first byte and had `</s>` scored in its
place (measured: 4.8 nats off per choice on a tiny model), and every generation prompt ended with a document end.
`add_bos_token=False` turns special tokens off in all of HFLM's encodings; with no BOS, HFLM conditions an empty
context on `</s>`, the token every document followed in training. Loglikelihood batches are right-padded and need
no mask (both model families are causal); generation batches are left-padded with an `attention_mask`, which both
families honour.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelError
from ..training.runs.safe_load import load_model


def lm_eval_model(ref: str | Path, tasks: list[str], include_path: str | Path | list[str | Path] | None = None,
                  limit: int | None = None, batch_size: int = 8, num_fewshot: int | None = None,
                  log_samples: bool = False) -> dict:
    """lm-eval's `simple_evaluate` result for a saved language model (`ref`: a model, run or Hub id) on `tasks`
    (names, or tasks defined by YAML files under `include_path`, one folder or several): `result["results"][task]`
    holds the metrics, `result["samples"][task]` each request and response when `log_samples`."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ModelError("--lm-eval needs lm-evaluation-harness: pip install 's4accel[lm_eval]'") from None

    model, tokenizer, model_dir = load_model(ref)
    if tokenizer is None or not hasattr(model, "generate"):
        raise ModelError(f"{model_dir}: not a language model with a tokenizer; lm-eval scores language models")
    if torch.accelerator.is_available():  # the GPU when there is one
        model = model.to(torch.accelerator.current_accelerator())
    folders = [] if include_path is None else [include_path] if isinstance(include_path, (str, Path)) else include_path
    manager = TaskManager(include_path=[str(f) for f in folders] or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" nor under {', '.join(map(str, folders))}" if folders else " (--include-path: a folder of YAMLs)"
        raise ModelError(f"--lm-eval: no task {', '.join(map(repr, unknown))} among lm-eval's tasks{where}")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", add_bos_token=False, batch_size=batch_size)
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                   num_fewshot=num_fewshot, log_samples=log_samples)
