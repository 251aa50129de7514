"""Save tiny models with one environment's libraries, load and generate with another's (tests/test_lanes.py).

    python lane_models.py save DIR   builds the models (fixed seed), saves each in DIR/<name>, prints their tokens
    python lane_models.py load DIR   loads each DIR/<name> twice (trust_remote_code with s4accel blocked, then through
                                     s4accel's own classes) and prints the tokens each generates

Tokens: greedy `generate()` of 6 new tokens from fixed prompts (a left-padded batch), and the same 6 made as 4 then 2
continued from the cache the first call returned. Printed as one JSON line: {name: {"tokens", "continued"}}, plus
the transformers version and the logits of each step of the first call.
"""

import json
import sys
from pathlib import Path

NAMES = ("s4d-lm", "s4-lm", "s4-moe-lm", "moe-lm")


def build(name):
    from s4accel import MoEConfig, MoEForCausalLM, S4Config, S4ForCausalLM

    # a wide initialisation, so that an untrained model's greedy tokens vary rather than repeat the last one
    s4 = {"d_model": 16, "n_layer": 2, "d_state": 8, "vocab_size": 40, "eos_token_id": None, "initializer_range": 1.0}
    configs = {
        # untied heads: a tied one echoes the last token until the model is trained
        "s4d-lm": lambda: S4ForCausalLM(S4Config(**s4, tie_word_embeddings=False)),
        "s4-lm": lambda: S4ForCausalLM(S4Config(**s4, kernel="s4", l_max=16, tie_word_embeddings=False)),
        "s4-moe-lm": lambda: S4ForCausalLM(S4Config(**s4, ffn="moe", d_ffn=24, num_experts=4)),
        "moe-lm": lambda: MoEForCausalLM(MoEConfig(d_model=16, n_layer=2, n_head=2, d_ffn=24, num_experts=4,
                                                   vocab_size=40, eos_token_id=None, initializer_range=1.0)),
    }
    return configs[name]()


def tokens(model):
    """What a transformers user does with a causal LM: generate, and continue generating from the returned cache."""
    import torch

    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    greedy = {"do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        once = model.generate(ids, attention_mask=mask, max_new_tokens=6, **greedy)
        first = model.generate(ids, attention_mask=mask, max_new_tokens=4, **greedy)
        # The cache comes back as `cache` from transformers 5.24, as `past_key_values` before; it goes back in under
        # the name the installed generate() takes.
        renamed = "cache" in first
        cache = first["cache"] if renamed else first["past_key_values"]
        name = "cache" if renamed else ("cache_params" if hasattr(model, "backbone") else "past_key_values")
        mask = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], dim=1)
        second = model.generate(first.sequences, attention_mask=mask, max_new_tokens=2, **{name: cache}, **greedy)
    return {"tokens": once.sequences.tolist(), "continued": second.sequences.tolist(),
            "logits": [step.tolist() for step in once.logits]}


def main(command, folder):
    import torch
    import transformers

    folder = Path(folder)
    result = {"transformers": transformers.__version__}
    if command == "save":
        for name in NAMES:
            torch.manual_seed(0)
            model = build(name).eval()
            model.save_pretrained(folder / name)
            result[name] = tokens(model)
    else:
        remote, own = {}, {}
        sys.modules["s4accel"] = None  # the copied code only, as where s4accel is not installed
        for name in NAMES:
            model = transformers.AutoModelForCausalLM.from_pretrained(folder / name, trust_remote_code=True)
            assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
            remote[name] = tokens(model.eval())
        del sys.modules["s4accel"]
        import s4accel  # noqa: F401  (registers its classes with the Auto classes)

        for name in NAMES:
            model = transformers.AutoModelForCausalLM.from_pretrained(folder / name)
            assert type(model).__module__.startswith("s4accel."), type(model).__module__
            own[name] = tokens(model.eval())
        result.update(remote=remote, own=own)
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
