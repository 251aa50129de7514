"""A saved model carries its modeling code and `auto_map`: it loads with `trust_remote_code=True` where s4accel is
not installed, and without remote code (s4accel's own classes) where it is. The code is two files, configuration and
modeling (one transformers notice each when loaded by Hub id), whatever the modules behind them."""

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
path, auto, ids, again = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
model = getattr(transformers, auto).from_pretrained(path, trust_remote_code=True).eval()
model.save_pretrained(again)  # saved again from the remote code itself
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
    assert code_files(tmp_path) == {config["auto_map"][name].split(".")[0] + ".py" for name in ("AutoConfig", auto)}
    again = tmp_path / "again"
    proc = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_S4ACCEL, str(tmp_path), auto, json.dumps(ids),
                           str(again)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["module"].startswith("transformers_modules.")  # the copied code, not s4accel
    key = "input_ids" if isinstance(ids[0][0], int) else "input_values"
    with torch.no_grad():
        expected = model(**{key: torch.tensor(ids)}).logits
    torch.testing.assert_close(torch.tensor(out["logits"]), expected, rtol=1e-5, atol=1e-6)  # float order only
    assert {name: (again / name).read_text() for name in code_files(again)} == {
        name: (tmp_path / name).read_text() for name in code_files(tmp_path)}  # folding again changes nothing


def code_files(folder):
    return {p.name for p in folder.glob("*.py")}


@pytest.mark.parametrize("name", ["s4-lm", "s4-moe-classifier", "moe-lm"])
def test_the_saved_code_is_a_configuration_and_a_modeling_file_with_the_same_model(tmp_path, name):
    model, auto, ids = models()[name]
    model.save_pretrained(tmp_path)
    family = "s4" if name.startswith("s4") else "moe"
    assert code_files(tmp_path) == {f"configuration_{family}.py", f"modeling_{family}.py"}
    modeling = (tmp_path / f"modeling_{family}.py").read_text()
    assert "from .configuration_" in modeling and "\nfrom .moe import" not in modeling  # only the pair imports
    compile(modeling, "modeling.py", "exec")


def write_modules(folder, **sources):
    for name, text in sources.items():
        (folder / f"{name}.py").write_text(text)
    (folder / "config.json").write_text(json.dumps({"auto_map": {"AutoConfig": "conf.C", "AutoModel": "main.M"}}))


def test_folding_keeps_aliases_and_the_configuration_import_and_runs_dependencies_first(tmp_path):
    from s4accel.models.code_bundle import bundle_saved_code

    write_modules(tmp_path, conf="class C:\n    pass\n", helper="from __future__ import annotations\nK = 3\n",
                  mid="from .helper import K as KK\n\n\ndef twice():\n    return 2 * KK\n",
                  main="import math\nfrom .conf import C\nfrom .mid import twice\n\n\nclass M(C):\n"
                       "    value = twice() + math.floor(0.5)\n")
    bundle_saved_code(tmp_path)
    assert code_files(tmp_path) == {"conf.py", "main.py"}
    source = (tmp_path / "main.py").read_text()
    assert source.index("K = 3") < source.index("def twice") < source.index("class M")
    namespace = {"__name__": "bundle"}
    exec(source.replace("from .conf import C", "class C:\n    pass"), namespace)
    assert namespace["M"].value == 6
    bundle_saved_code(tmp_path)
    assert (tmp_path / "main.py").read_text() == source  # idempotent


@pytest.mark.parametrize("mid, message", [
    ("def K():\n    return 1\n", "mid.py and helper.py both define `K`"),
    ("def f():\n    from .helper import K\n    return K\n", "mid.py, line 2: only top-level"),
])
def test_folding_refuses_a_name_defined_twice_and_a_nested_relative_import(tmp_path, mid, message):
    from s4accel.models.code_bundle import bundle_saved_code

    write_modules(tmp_path, conf="class C:\n    pass\n", helper="K = 3\n", mid=mid,
                  main="from .helper import K\nfrom .mid import *\n" if "K()" in mid else "from .mid import f\n")
    with pytest.raises(ValueError, match=message.replace("`", ".")):
        bundle_saved_code(tmp_path)


def test_with_s4accel_installed_plain_from_pretrained_uses_its_own_classes(tmp_path):
    from transformers import AutoModelForCausalLM

    model, _, ids = models()["moe-lm"]
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # no trust_remote_code
    assert type(loaded) is type(model) and type(loaded).__module__.startswith("s4accel.")
