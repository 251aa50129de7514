"""A saved model carries its modeling code and `auto_map`: it loads with `trust_remote_code=True` where s4accel is
not installed, and without remote code (s4accel's own classes) where it is."""

import json
import os
import subprocess
import sys

import pytest
import torch

LOAD_WITHOUT_S4ACCEL = """
import json, sys
sys.modules["s4accel"] = None  # s4accel cannot be imported in this process
import torch
import transformers
path, auto, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = getattr(transformers, auto).from_pretrained(path, trust_remote_code=True).eval()
kwargs = {"input_ids": torch.tensor(ids)} if isinstance(ids[0][0], int) else {"input_values": torch.tensor(ids)}
with torch.no_grad():
    print(json.dumps({"module": type(model).__module__, "logits": model(**kwargs).logits.tolist()}))
"""


def models():
    from s4accel import MoEConfig, MoEForCausalLM, S4Config, S4ForCausalLM, S4ForSequenceClassification

    torch.manual_seed(0)
    ids = [[3, 4, 5, 6, 7]]
    return {
        "s4-lm": (S4ForCausalLM(S4Config(d_model=16, n_layer=2, d_state=8, vocab_size=40, kernel="s4", l_max=8)),
                  "AutoModelForCausalLM", ids),
        "s4-moe-classifier": (S4ForSequenceClassification(S4Config(
            d_model=16, n_layer=1, d_state=8, d_input=2, num_labels=3, ffn="moe", d_ffn=24, num_experts=4)),
            "AutoModelForSequenceClassification", [[[0.1, 0.2], [0.3, -0.4], [1.0, 0.0]]]),
        "moe-lm": (MoEForCausalLM(MoEConfig(d_model=16, n_layer=2, n_head=2, d_ffn=24, num_experts=4,
                                            vocab_size=40)), "AutoModelForCausalLM", ids),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["s4-lm", "s4-moe-classifier", "moe-lm"])
def test_saved_model_loads_with_remote_code_where_s4accel_is_not_installed(tmp_path, name):
    model, auto, ids = models()[name]
    model.eval().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert auto in config["auto_map"] and "AutoConfig" in config["auto_map"]
    proc = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_S4ACCEL, str(tmp_path), auto, json.dumps(ids)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["module"].startswith("transformers_modules.")  # the copied code, not s4accel
    key = "input_ids" if isinstance(ids[0][0], int) else "input_values"
    with torch.no_grad():
        expected = model(**{key: torch.tensor(ids)}).logits
    torch.testing.assert_close(torch.tensor(out["logits"]), expected, rtol=1e-5, atol=1e-6)  # float order only


def test_with_s4accel_installed_plain_from_pretrained_uses_its_own_classes(tmp_path):
    from transformers import AutoModelForCausalLM

    model, _, ids = models()["moe-lm"]
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # no trust_remote_code
    assert type(loaded) is type(model) and type(loaded).__module__.startswith("s4accel.")
