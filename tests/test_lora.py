"""LoRA through PEFT (`model.lora`): a recipe trains adapters on a pretrained or a fresh model (S4's projections, the
MoE model's attention and its 3-D experts), says in one line what each name adapted, refuses a name that adapts
nothing or only part of what it matches, saves the adapter as PEFT and transformers load it, resumes bit for bit,
exports a merged plain model with the PEFT model's logits, and pushes with a card that names the base."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY, callback_override, read_metrics, run_cli, sets, short_epochs, train_in_process
from s4accel.errors import RecipeError

pytestmark = pytest.mark.slow

IDS = [[3, 40, 41, 42, 43, 44, 45, 46]]
S4_LORA = "model.lora={r: 4, alpha: 8, dropout: 0.1, target_modules: [output_linear]}"
MOE_LORA = ("model={name: moe-tiny, overrides: {dropout: 0.1}, lora: {r: 4, alpha: 8, target_modules: [qkv_proj, "
            "o_proj], target_parameters: [experts.gate_up_proj, experts.down_proj]}}")
NO_PEFT = "import sys; sys.modules['peft'] = None  # not installed, as far as this process knows\n"


@pytest.fixture(scope="module")
def peft():
    return pytest.importorskip("peft")


def lm(text, out, *extra):
    return [f"run.out_dir={out}", "data.source=files", f"data.files=[{text}]", "data.seq_len=32", "data.batch_size=4",
            "data.val_fraction=0.2", "train.eval_every=0", "scheduler.warmup_steps=0", "log.progress_bar=false",
            "log.log_with=[jsonl]", "sample.prompts=[]", *extra]


@pytest.fixture(scope="module")
def base(tmp_path_factory, text):
    """A tiny language model trained for 30 steps: the pretrained base."""
    out = tmp_path_factory.mktemp("base") / "run"
    train_in_process(TINY, lm(text, out, "train.max_steps=30"))
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, text, base, peft):
    """LoRA on the pretrained base, uninterrupted: short epochs (dropout in the model and the adapter, EMA on),
    24 steps, a checkpoint every 5."""
    out = tmp_path_factory.mktemp("lora") / "run"
    result = train_in_process(TINY, short_epochs(text, out, f"model.pretrained={base}", S4_LORA))
    assert result.steps == 24
    return out


def loaded(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def logits(model):
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS)).logits


def test_a_recipe_trains_an_adapter_on_a_pretrained_model_that_peft_and_transformers_load(lora_run, base, peft):
    final = lora_run / "final"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= \
        {p.name for p in final.iterdir()}
    assert not (final / "model.safetensors").exists() and not (final / "base").exists()  # the base is named, not copied
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base / "final") and config["r"] == 4
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert all(v.abs().max() > 0 for k, v in adapter.items() if ".lora_B." in k)  # trained: B starts at zero

    with_peft = peft.PeftModel.from_pretrained(loaded(base / "final"), final).eval()
    expected = logits(with_peft)
    assert (expected - logits(loaded(base / "final"))).abs().max() > 1e-3  # the adapter changes the model
    plain = loaded(base / "final")
    plain.load_adapter(str(final))  # transformers' own PEFT integration
    torch.testing.assert_close(logits(plain), expected, rtol=0, atol=0)
    by_name = loaded(final)  # transformers reads the base from the adapter's config
    torch.testing.assert_close(logits(by_name), expected, rtol=0, atol=0)


def test_the_run_says_what_each_name_adapted_and_only_the_adapters_train(lora_run, base):
    log = (lora_run / "train.log").read_text()
    line = next(x for x in log.splitlines() if x.startswith("model.lora:"))
    assert line.startswith("model.lora: output_linear -> 2 modules (layers 0-1); ") and "of parameters trainable" in line
    pct = float(line.split("; ")[1].split("%")[0])
    assert 0 < pct < 15
    # The base is fixed: the checkpoint's base weights are the pretrained ones, bit for bit.
    pre = load_file(base / "final" / "model.safetensors")
    ckpt = load_file(lora_run / "checkpoints" / "step_00000020" / "model.safetensors")
    w = "backbone.layers.0.layer.output_linear.weight"
    assert torch.equal(ckpt[f"base_model.model.{w.replace('.weight', '.base_layer.weight')}"], pre[w])


def test_an_interrupted_lora_run_resumes_bit_for_bit(lora_run, text, base, tmp_path):
    out = tmp_path / "run"
    recipe = short_epochs(text, out, f"model.pretrained={base}", S4_LORA)
    cut = train_in_process(TINY, [*recipe, callback_override("testing_callbacks:SignalAt", step=13)])
    assert cut.preempted and cut.steps == 14 and not (out / "final").exists()
    resumed = train_in_process(TINY, recipe, resume="latest")
    assert resumed.steps == 24
    for name in ("final", "final_ema"):
        a = load_file(lora_run / name / "adapter_model.safetensors")
        b = load_file(out / name / "adapter_model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    evals = lambda d: [(r["step"], r["eval/loss"]) for r in read_metrics(d) if "eval/loss" in r]
    assert evals(out) == evals(lora_run)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, text, peft):
    """LoRA on a fresh MoE model: attention projections and the 3-D experts."""
    out = tmp_path_factory.mktemp("moe") / "run"
    train_in_process(TINY, lm(text, out, MOE_LORA, "train.max_steps=6", "checkpoint.every_steps=6"))
    return out


def test_the_experts_3d_parameters_are_adapted_and_a_fresh_base_travels_with_its_adapter(moe_run, peft):
    line = next(x for x in (moe_run / "train.log").read_text().splitlines() if x.startswith("model.lora:"))
    assert "qkv_proj -> 2 modules (layers 0-1), o_proj -> 2 modules (layers 0-1), experts.gate_up_proj -> 2 " \
           "parameters (layers 0-1, 4 experts each), experts.down_proj -> 2 parameters (layers 0-1, 4 experts each)" \
           in line
    final = moe_run / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"
    adapter = load_file(final / "adapter_model.safetensors")
    experts = [k for k in adapter if ".experts." in k]
    assert len(experts) == 8 and all(adapter[k].abs().max() > 0 for k in experts if ".lora_B." in k)
    base = loaded(final / "base")  # the fresh model the adapter was trained on, as it was initialised
    ckpt = load_file(moe_run / "checkpoints" / "step_00000006" / "model.safetensors")
    assert torch.equal(base.state_dict()["model.layers.0.ffn.experts.gate_up_proj"],
                       ckpt["base_model.model.model.layers.0.ffn.experts.base_layer.base_layer.gate_up_proj"])
    with_peft = peft.PeftModel.from_pretrained(base, final).eval()
    assert (logits(with_peft) - logits(loaded(final / "base"))).abs().max() > 1e-4


def test_export_merge_writes_a_plain_model_with_the_peft_models_logits(moe_run, lora_run, base, tmp_path, peft):
    from s4accel.errors import ExportError
    from s4accel.tools.export import export_checkpoint

    out = tmp_path / "moe-merged"
    proc = run_cli("export", moe_run, out, "--merge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported the model merged with its LoRA adapter of step 6" in proc.stdout
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    export_checkpoint(moe_run, tmp_path / "moe-adapter", step=6)  # the same checkpoint's adapter, as PEFT saves it
    expected = logits(peft.PeftModel.from_pretrained(loaded(tmp_path / "moe-adapter" / "base"),
                                                     tmp_path / "moe-adapter").eval())
    # Loaded where peft cannot be imported: a plain model, with the PEFT model's logits.
    code = NO_PEFT + ("import json, torch\nfrom transformers import AutoModelForCausalLM\n"
                      f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()\n"
                      f"print(json.dumps(m(input_ids=torch.tensor({IDS})).logits.tolist()))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    torch.testing.assert_close(torch.tensor(json.loads(got.stdout.splitlines()[-1])), expected)
    assert (expected - logits(loaded(tmp_path / "moe-adapter" / "base"))).abs().max() > 1e-4

    # S4 on its pretrained base: the newest checkpoint (step 20), merged and as an adapter.
    export_checkpoint(lora_run, tmp_path / "s4-merged", merge=True)
    export_checkpoint(lora_run, tmp_path / "s4-adapter")
    expected = logits(peft.PeftModel.from_pretrained(loaded(base / "final"), tmp_path / "s4-adapter").eval())
    torch.testing.assert_close(logits(loaded(tmp_path / "s4-merged")), expected)
    with pytest.raises(ExportError, match=r"--merge: .* trained no LoRA adapter \(model\.lora\)"):
        export_checkpoint(base, tmp_path / "x", merge=True)


def test_push_uploads_the_adapter_and_its_fresh_base_with_a_card_that_says_so(moe_run, lora_run, base, tmp_path,
                                                                              peft, monkeypatch):
    from huggingface_hub import ModelCard

    from hub_server import HubServer
    from s4accel.tools.hub import stage
    from test_hub import hub_env

    monkeypatch.setenv("HF_TEST_HOME", str(tmp_path / "hf_home"))
    with HubServer() as hub:
        proc = run_cli("push", moe_run, "--repo-id", "alice/moe-lora", env=hub_env(hub.url))
        assert proc.returncode == 0, proc.stderr[-3000:]
        files = hub.files("alice/moe-lora")
    assert {"adapter_config.json", "adapter_model.safetensors", "base/config.json", "base/model.safetensors",
            "base/modeling_moe.py", "README.md", "recipe.yaml"} <= set(files)
    assert "config.json" not in files and "model.safetensors" not in files  # an adapter, not a model
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "peft" and "lora" in card.data.tags
    assert "A **LoRA adapter** (PEFT), not a whole model" in card.text and "in `base/` of this repository" in \
        card.text and 'from_pretrained("alice/moe-lora", subfolder="base"' in card.text

    repo = tmp_path / "repo"  # the repository as downloaded: the adapter loads onto the base beside it
    for name, data in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(data)
    expected = logits(peft.PeftModel.from_pretrained(loaded(moe_run / "final" / "base"), moe_run / "final").eval())
    got = logits(peft.PeftModel.from_pretrained(loaded(repo / "base"), repo).eval())
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    staged = tmp_path / "staged"  # what a push of the S4 adapter uploads: its card names the pretrained base
    staged.mkdir()
    out = stage(lora_run, "alice/s4-lora", "final", staged)
    card = ModelCard((out / "README.md").read_text())
    assert f"Its base model is the model in `{base.name}`" in card.text and card.data.base_model is None
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == base.name
    for f in out.rglob("*"):  # the base's folder is named, never its path on this machine
        assert not f.is_file() or str(base).encode() not in f.read_bytes(), f


def test_a_classifier_trains_its_new_head_whole_and_adapters_on_the_language_models_backbone(base, tmp_path, text,
                                                                                          peft, capsys):
    from helpers import REPO

    csv = tmp_path / "docs.csv"
    lines = [line for line in text.read_text().splitlines() if line.strip()][:80]
    csv.write_text("text,label\n" + "".join(f"\"{s.replace(chr(34), '')}\",{'ab'[i % 2]}\n"
                                            for i, s in enumerate(lines)))
    out = tmp_path / "clf"
    train_in_process(REPO / "recipes" / "s4_tiny_debug.yaml", [
        f"run.out_dir={out}", "data.source=files", f"data.files=[{csv}]", "data.label_field=label",
        "data.seq_len=64", "data.batch_size=4", "data.val_fraction=0.2", "train.max_steps=3", "train.eval_every=0",
        "log.progress_bar=false", "sample.prompts=[]", "task.target=classification",
        f"model={{pretrained: {base}, lora: {{target_modules: [output_linear]}}}}"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("model.lora:"))
    assert "score trained whole (the new head)" in line
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert any(k.endswith("score.weight") for k in adapter)  # the trained head travels with the adapter
    assert json.loads((out / "final" / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"


def test_two_processes_train_the_adapters_as_one_process_does_with_the_same_global_batch(text, tmp_path, peft):
    """DDP averages the adapters' gradients (the frozen base has none): 2 processes x 4 sequences take the steps one
    process takes with 8, and the main process alone writes the adapter and the fresh base."""
    from test_multiprocess import launch

    fresh = ["model={name: s4-tiny, lora: {target_modules: [output_linear]}}", "train.max_steps=4"]
    proc = launch("-m", "s4accel", "train", TINY, *sets(*lm(text, tmp_path / "two", *fresh, "data.batch_size=4")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    train_in_process(TINY, lm(text, tmp_path / "one", *fresh, "data.batch_size=8"))
    for name in ("adapter_model.safetensors", "base/model.safetensors"):
        a, b = load_file(tmp_path / "two" / "final" / name), load_file(tmp_path / "one" / "final" / name)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-7)


# --------------------------------------------------------------------------------------------------------------------
# What is refused, in one line, before any training


def build(peft, name="s4-tiny", overrides=None, **lora):
    """The built-in tasks' model with the recipe's adapters (as the run builds it), or the RecipeError."""
    from s4accel.config import load_recipe
    from s4accel.training.tasks_builtin import build_model

    recipe = load_recipe(TINY, [f"model={{name: {name}, overrides: {json.dumps(overrides or {})}, lora: "
                                f"{json.dumps(lora)}}}"])
    said = []
    return build_model(recipe, None, spec={"vocab_size": 260}, say=said.append), said


def test_a_name_that_matches_nothing_or_only_part_of_what_it_names_is_refused_naming_it(peft):
    with pytest.raises(RecipeError, match=r"^model\.lora\.target_modules: 'output_linaer' matches no module or "
                                          r"parameter \(did you mean 'output_linear'\?\)"):
        build(peft, target_modules=["output_linear", "output_linaer"])
    # Dense and MoE blocks both have a gate_up_proj: a Linear in block 0, the experts' 3-D parameter in block 1.
    # PEFT alone adapts block 0 and says nothing (peft#3554).
    mixed = {"moe_every": 2}
    with pytest.raises(RecipeError) as info:
        build(peft, "moe-tiny", mixed, target_modules=["gate_up_proj"])
    assert str(info.value) == ("model.lora.target_modules: 'gate_up_proj' adapts 1 module (layer 0) but not 1 more "
                               "it matches: model.layers.1.ffn.experts.gate_up_proj, a 3-D parameter (list it in "
                               "model.lora.target_parameters)")
    with pytest.raises(RecipeError, match=r"'gate_up_proj' adapts 1 parameter \(layer 1\) but not 1 more it matches: "
                                          r"model\.layers\.0\.ffn\.gate_up_proj, a Linear \(list it in "
                                          r"model\.lora\.target_modules\)"):
        build(peft, "moe-tiny", mixed, target_parameters=["gate_up_proj"])
    model, said = build(peft, "moe-tiny", mixed, target_modules=["gate_up_proj"], target_parameters=["gate_up_proj"])
    assert said[0].startswith("model.lora: gate_up_proj -> 1 module (layer 0), gate_up_proj -> 1 parameter "
                              "(layer 1, 4 experts each); ")
    for names in (["qkv_proj", "gate_up_proj"], ["gate_up_proj"]):  # PEFT adapts something, or nothing at all
        with pytest.raises(RecipeError, match=r"'gate_up_proj' adapts no module; it matches only "
                                              r"model\.layers\.0\.ffn\.experts\.gate_up_proj, a 3-D parameter"):
            build(peft, "moe-tiny", target_modules=names)


def test_tied_unsupported_and_one_dimensional_targets_are_refused(peft):
    with pytest.raises(RecipeError, match=r"'lm_head' matches lm_head, whose weight is tied to "
                                          r"backbone\.embeddings\.weight"):
        build(peft, target_modules=["lm_head"])
    with pytest.raises(RecipeError, match=r"target_parameters: 'D' matches 1-D parameters"):
        build(peft, target_parameters=["D"])
    with pytest.raises(RecipeError, match=r"^model\.lora: PEFT refused the targets: Target module S4DKernel"):
        build(peft, target_modules=["kernel"])
    with pytest.raises(RecipeError, match=r"'experts' adapts no parameter; it matches only "
                                          r"model\.layers\.0\.ffn\.experts, a MoEExperts \(name its parameters in "
                                          r"model\.lora\.target_parameters: experts\.gate_up_proj, experts\.down_proj"):
        build(peft, "moe-tiny", target_parameters=["experts"])


def test_a_refused_name_is_one_line_exit_2_and_nothing_is_written(text, tmp_path, peft):
    out = tmp_path / "run"
    proc = run_cli("train", TINY, *sets(*lm(text, out, "model={name: moe-tiny, overrides: {moe_every: 2}, lora: "
                                                       "{target_modules: [gate_up_proj]}}", "train.max_steps=1")))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "'gate_up_proj' adapts 1 module (layer 0) but not 1 more" in errors[0]
    assert not out.exists()


def test_a_recipe_asking_for_lora_without_peft_is_one_line_naming_the_pip_command(text, tmp_path):
    out = tmp_path / "run"
    code = NO_PEFT + "from s4accel.cli import main\nsys.argv = ['s4accel', *sys.argv[1:]]\nmain()"
    proc = subprocess.run([sys.executable, "-c", code, "train", str(TINY), *sets(*lm(text, out, S4_LORA))],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: model.lora: needs peft, which is not installed: pip install "
                                                "'s4accel[lora]'"]
    assert not out.exists()


def test_lora_with_freeze_or_dropout_on_parameters_is_a_recipe_error():
    from s4accel.config import load_recipe

    with pytest.raises(RecipeError, match=r"model\.freeze: with model\.lora only the adapters train"):
        load_recipe(TINY, ["model={name: s4-tiny, freeze: ['backbone.*'], lora: {target_modules: [output_linear]}}"])
    with pytest.raises(RecipeError, match=r"model\.lora\.dropout: PEFT applies no dropout to LoRA on parameters"):
        load_recipe(TINY, ["model={name: moe-tiny, lora: {dropout: 0.1, target_parameters: [experts.down_proj]}}"])


def test_adapted_experts_give_the_same_output_on_the_gpus_dispatch_as_on_the_cpus(peft):
    """PEFT patches the 3-D weights during the wrapped module's forward: grouped_mm's static rows go through that
    forward too, so the adapters count on either dispatch (checked by sabotage: calling the experts' grouped path
    past the wrapper gives the base model's output)."""
    outputs = {}
    for dispatch in ("fused", "grouped_mm"):
        torch.manual_seed(0)
        model, _ = build(peft, "moe-tiny", {"moe_dispatch": dispatch}, target_parameters=["experts.gate_up_proj",
                                                                                           "experts.down_proj"])
        for name, p in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero: an adapter that changes nothing would hide a bypass
                torch.nn.init.normal_(p, std=0.5)
        ids = torch.randint(3, 200, (2, 24))
        with torch.no_grad():
            outputs[dispatch] = model(input_ids=ids).logits
            with model.disable_adapter():
                outputs[dispatch, "base"] = model(input_ids=ids).logits
    torch.testing.assert_close(outputs["grouped_mm"], outputs["fused"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outputs["grouped_mm"], outputs["grouped_mm", "base"], atol=1e-3)


def test_a_finished_adapter_run_without_checkpoints_merges_exports_and_is_used_as_a_model(lora_run, base, tmp_path,
                                                                                        peft):
    """A run whose step checkpoints were pruned (or never written) still has its adapter in final/: `export --merge`
    merges that (it said "no checkpoint to export ... final/ is a from_pretrained folder already", and final/ is an
    adapter), and `generate`, `eval` and `predict` load base + adapter themselves, as PEFT does."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    expected = logits(peft.PeftModel.from_pretrained(loaded(base / "final"), run / "final").eval())
    proc = run_cli("export", run, tmp_path / "merged", "--merge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"exported the model merged with its LoRA adapter of final/ to {tmp_path / 'merged'}"
    torch.testing.assert_close(logits(loaded(tmp_path / "merged")), expected)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()

    from s4accel.training.runs.safe_load import load_model

    model, tokenizer, _ = load_model(run)
    torch.testing.assert_close(logits(model), expected)
    assert tokenizer is not None
    proc = run_cli("generate", run, "--prompt", "To be", "--max-new-tokens", "4", "--temperature", "0")
    assert proc.returncode == 0 and proc.stdout.startswith("To be"), proc.stderr[-3000:]
    proc = run_cli("eval", run, run / "recipe.yaml", "--json")
    assert proc.returncode == 0 and "loss" in json.loads(proc.stdout), proc.stderr[-3000:]


def test_an_adapter_on_a_local_base_is_carded_with_the_bases_run_name_and_no_local_dataset_id(lora_run, base,
                                                                                              tmp_path):
    """The card's metadata said `datasets: [local-files]` (no Hub dataset has that id) and named the base `final`
    (the folder inside its run), where the published recipe names it by its run's folder."""
    from huggingface_hub import ModelCard

    from s4accel.tools.hub import stage

    out = tmp_path / "staged"
    out.mkdir()
    stage(lora_run, "alice/s4-lora", "final", out)
    card = ModelCard((out / "README.md").read_text())
    assert card.data.datasets is None  # local files: named in the card's text, on no Hub page
    assert f"the model in `{base.name}`" in card.text and "`final`" not in card.text
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == base.name


@pytest.mark.parametrize("linked", ["adapter_model.safetensors", "base"])
def test_a_push_that_would_publish_an_incomplete_adapter_is_refused_before_uploading(moe_run, tmp_path, linked):
    """The adapter's weights as a link were skipped with a line, then a repository without weights was pushed, exit
    0; `final/base/` a link out of the run was left out while the card said the base was there."""
    import shutil

    from s4accel.tools.hub import HubError, stage

    run = tmp_path / "run"
    shutil.copytree(moe_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    moved = tmp_path / "elsewhere"
    shutil.move(run / "final" / linked, moved)
    (run / "final" / linked).symlink_to(moved)
    out = tmp_path / "staged"
    out.mkdir()
    with pytest.raises(HubError, match="the push would publish an incomplete model; nothing was pushed"):
        stage(run, "alice/moe-lora", "final", out)
