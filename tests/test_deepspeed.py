"""DeepSpeed ZeRO-2 and ZeRO-3 through Accelerate, on 2 CPU processes (gloo): partitioned training checkpoints that
resume bit-exactly, a gathered export that `from_pretrained` loads, the same model as a DDP run, and under bf16 the
S4 parameters and their gradient reductions kept in float32. tests/scripts/deepspeed_on_cpu.py explains how the
DeepSpeed path runs without GPUs. `make test` installs DeepSpeed first (the Makefile says why not as an extra); skipped
where it is not installed."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import FREE_PORT, REPO, TESTS_ON_PATH, TINY, callback_override, final_weights, run_python, short_epochs

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

CONFIGS = REPO / "accelerate_configs"
DEEPSPEED_ON_CPU = [str(REPO / "tests" / "scripts" / "deepspeed_on_cpu.py")]
STAGES = {2: "deepspeed_zero2.yaml", 3: "deepspeed_zero3.yaml"}
SSM = ("log_dt", "A_imag", "log_A_real", "kernel.C", "layer.D")  # S4D's parameters (models/modeling_s4.py)


def launch(config, text, out, *extra, script=DEEPSPEED_ON_CPU, precision="no", resume=False, ok=True):
    args = [sys.executable, "-m", "accelerate.commands.launch", *FREE_PORT, "--config_file", str(config),
            "--num_processes", "2", "--mixed_precision", precision, *script, "train", str(TINY)]
    # grad_accum 2 (which DeepSpeed's engine divides by itself), dropout (the RNG states matter), samples
    for item in short_epochs(text, out, "train.max_steps=12", "checkpoint.every_steps=6", "checkpoint.keep_last=4",
                             "train.eval_every=6", "sample.prompts=['ROMEO.']", "sample.max_new_tokens=16", *extra):
        args += ["--set", item]
    if resume:
        args.append("--resume")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TESTS_ON_PATH['PYTHONPATH']}"})
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def no_ema(stage):
    return ["train.ema=null"] if stage == 3 else []  # refused under ZeRO-3 (see below)


@pytest.fixture(scope="module", params=sorted(STAGES), ids=[f"zero{s}" for s in sorted(STAGES)])
def ds_run(request, tmp_path_factory, text):
    """One 12-step run per ZeRO stage (EMA under ZeRO-2), shared by the tests below: (stage, text, run directory,
    output)."""
    stage = request.param
    out = tmp_path_factory.mktemp(f"zero{stage}") / "run"
    return stage, text, out, launch(CONFIGS / STAGES[stage], text, out, *no_ema(stage))


def test_deepspeed_run_writes_partitioned_checkpoints_and_a_whole_model_of_its_own_class(ds_run):
    from transformers import AutoModelForCausalLM

    stage, _, out, proc = ds_run
    assert f"DeepSpeed ZeRO-{stage} over 2 processes on cpu," in proc.stdout and "done: 12 steps" in proc.stdout
    assert "FutureWarning" not in proc.stderr  # torch's deprecation of the collectives DeepSpeed calls
    ckpt = out / "checkpoints" / "step_00000006" / "pytorch_model"
    # each process wrote its own partition of the optimizer state (and under ZeRO-3 of the weights)
    optim = sorted(p.name for p in ckpt.iterdir() if "optim_states" in p.name)
    assert optim == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    exported = ["final", *(["final_ema"] if stage == 2 else [])]
    for name in exported:
        files = sorted(p.name for p in (out / name).iterdir())
        assert "modeling_s4.py" in files and not [f for f in files if "zero" in f or ".pt" in f], (name, files)
        model = AutoModelForCausalLM.from_pretrained(out / name, trust_remote_code=True)
        assert type(model).__name__ == "S4ForCausalLM"
        assert model.lm_head.weight is model.backbone.embeddings.weight  # tied, stored once
        saved = final_weights(out, name)
        assert "lm_head.weight" not in saved and all(v.dtype == torch.float32 for v in saved.values())
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items() if k in saved)
    assert (out / "samples.txt").read_text().count("ROMEO.") == 1
    if stage == 2:
        ema, raw = final_weights(out, "final_ema"), final_weights(out, "final")
        assert any(not torch.equal(ema[k], raw[k]) for k in raw)  # an average, not a copy of the weights


def test_deepspeed_run_resumed_from_its_partitioned_checkpoint_ends_bit_identical(ds_run):
    stage, text, out, _ = ds_run
    again = out.parent / "again"
    shutil.copytree(out / "checkpoints" / "step_00000006", again / "checkpoints" / "step_00000006")
    shutil.copy(out / "recipe.yaml", again / "recipe.yaml")
    proc = launch(CONFIGS / STAGES[stage], text, again, *no_ema(stage), resume=True)
    assert "resumed from" in proc.stdout and f"DeepSpeed ZeRO-{stage} over 2 processes" in proc.stdout
    for name in ["final", *(["final_ema"] if stage == 2 else [])]:
        ref, got = final_weights(out, name), final_weights(again, name)
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref), name


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_deepspeed_file_that_would_run_code_is_refused_before_deepspeed_unpickles_it(ds_run, tmp_path):
    """DeepSpeed reads its checkpoint files with a full unpickler: one replaced by a pickle that runs code (with the
    manifest rewritten to match) stops the resume with one line, and the code never runs."""
    stage, text, out, _ = ds_run
    run = tmp_path / "run"
    shutil.copytree(out / "checkpoints" / "step_00000006", run / "checkpoints" / "step_00000006")
    shutil.copy(out / "recipe.yaml", run / "recipe.yaml")
    ckpt = run / "checkpoints" / "step_00000006"
    name = "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Evil(tmp_path / "pwned")}, ckpt / name)
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    data = (ckpt / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "COMPLETE").write_text(json.dumps(manifest))
    proc = launch(CONFIGS / STAGES[stage], text, run, *no_ema(stage), resume=True, ok=False)
    assert proc.returncode != 0 and f"{name}: holds more than tensors and plain data" in proc.stdout + proc.stderr
    assert not (tmp_path / "pwned").exists()


def test_zero3_init_flag_builds_the_model_partitioned_and_its_export_is_the_whole_model(tmp_path, text):
    """`zero3_init_flag: true` (a model larger than one device) builds the model inside deepspeed.zero.Init; the size
    check before it builds its shapes-only model whole (inside zero.Init it could not), and the run trains and
    exports every weight gathered."""
    from transformers import AutoModelForCausalLM

    config = tmp_path / "zero3_init.yaml"
    config.write_text((CONFIGS / STAGES[3]).read_text().replace("zero3_init_flag: false", "zero3_init_flag: true"))
    out = tmp_path / "run"
    proc = launch(config, text, out, "train.ema=null", "train.max_steps=2", "train.eval_every=0",
                  "checkpoint.every_steps=0", "sample.prompts=[]")
    assert "DeepSpeed ZeRO-3 over 2 processes on cpu," in proc.stdout and "done: 2 steps" in proc.stdout
    model, info = AutoModelForCausalLM.from_pretrained(out / "final", trust_remote_code=True,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    saved = final_weights(out)
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items() if k in saved)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, text):
    out = tmp_path_factory.mktemp("ddp") / "run"
    return out, launch(CONFIGS / "cpu_2proc.yaml", text, out, script=["-m", "s4accel"])


def test_deepspeed_trains_the_same_model_as_ddp(ds_run, ddp_run):
    """The engine's own division by grad_accum and its mean over processes, its clipping to the recipe's norm and the
    recipe's learning-rate schedule: all as under DDP, so the weights agree but for the order of the sums."""
    stage, _, out, _ = ds_run
    ddp, proc = ddp_run
    assert "DDP over 2 processes on cpu" in proc.stdout
    for name in ["final", *(["final_ema"] if stage == 2 else [])]:
        ref, got = final_weights(ddp, name), final_weights(out, name)
        assert ref.keys() == got.keys(), name
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, msg=f"{name} {k}")


@pytest.mark.parametrize("stage", sorted(STAGES), ids=[f"zero{s}" for s in sorted(STAGES)])
def test_bf16_under_deepspeed_keeps_the_ssm_parameters_and_their_gradient_reduction_in_float32(stage, tmp_path, text):
    """DeepSpeed's own bf16 mode would cast every parameter to bf16; s4accel runs DeepSpeed's torch_autocast mode:
    float32 parameters, bf16 compute and bf16 gradient reduction for Linear and Conv layers only."""
    out, record = tmp_path / "run", tmp_path / "precision.json"
    proc = launch(CONFIGS / STAGES[stage], text, out, *no_ema(stage), "train.max_steps=2", "train.eval_every=0",
                  "checkpoint.every_steps=0", "sample.prompts=[]",
                  callback_override("testing_callbacks:ParamPrecision", path=str(record)), precision="bf16")
    params = json.loads(record.read_text())
    ssm = {k: v for k, v in params.items() if any(s in k for s in SSM)}
    assert len(ssm) == 10  # 5 per S4 layer, 2 layers
    for name, p in ssm.items():  # after an update: float32 values that bf16 cannot hold, reduced in float32
        assert p == {"dtype": "float32", "beyond_bf16": True, "reduce": "float32"}, name
    linear = {k: v for k, v in params.items() if "output_linear" in k}
    assert linear and all(p["dtype"] == "float32" and p["reduce"] == "bfloat16" for p in linear.values()), linear
    assert all(v.dtype == torch.float32 for v in final_weights(out).values())
    assert "mixed precision bfloat16 autocast, parameters float32" in proc.stdout


@pytest.mark.parametrize("setting, config_line, error", [
    ("train.ema={decay: 0.9}", None, "error: train.ema: not available under DeepSpeed ZeRO-3"),
    ("train.ema=null", "  gradient_accumulation_steps: 1",  # the recipe's train.grad_accum is 2
     "error: train.grad_accum=2, but the DeepSpeed config sets gradient_accumulation_steps: 1"),
], ids=["ema", "grad_accum"])
def test_what_deepspeed_cannot_do_is_refused_in_one_line(setting, config_line, error, tmp_path, text):
    config = CONFIGS / STAGES[3]
    if config_line:
        config = tmp_path / "zero3.yaml"
        config.write_text((CONFIGS / STAGES[3]).read_text().replace("  gradient_accumulation_steps: auto",
                                                                      config_line))
    proc = launch(config, text, tmp_path / "run", "train.max_steps=2", setting, ok=False)
    assert proc.returncode != 0 and error in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_recipe_builds_the_optimizer_under_deepspeed_and_a_config_naming_its_own_is_refused(tmp_path, text):
    """A DeepSpeed config file with its own optimizer section is refused in one line (Accelerate's refusal was a
    traceback once the data and model were built), and so is one beside DeepSpeed keys of the accelerate config
    (Accelerate's traceback as the Accelerator was built); without them, the recipe's optimizer (SGD here) trains
    under ZeRO-2."""
    ds = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    config = tmp_path / "zero2_file.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                      f"  deepspeed_config_file: {tmp_path / 'ds.json'}\n  zero3_init_flag: false\n"
                      "num_machines: 1\nmachine_rank: 0\nnum_processes: 2\n")
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    both = tmp_path / "zero2_both.yaml"  # a config file and the accelerate config's own DeepSpeed keys
    both.write_text(config.read_text().replace("  zero3_init_flag: false\n", "  zero3_init_flag: false\n"
                                                                          "  gradient_clipping: 1.0\n"))
    proc = launch(both, text, tmp_path / "refused", "train.max_steps=2", ok=False)
    line = next((x for x in proc.stderr.splitlines() if x.startswith("error: ")), "")
    assert proc.returncode != 0 and line.startswith(
        "error: the accelerate config: When using `deepspeed_config_file`, the following accelerate config variables "
        "will be ignored: ["), line
    assert "'gradient_clipping'" in line and line.endswith("Please specify them appropriately in the DeepSpeed config "
                                                           "file."), line
    proc = launch(config, text, tmp_path / "refused", "train.max_steps=2", ok=False)
    assert proc.returncode != 0
    assert ("error: optim.name: the DeepSpeed config has its own optimizer (AdamW); s4accel builds the recipe's "
            "(optim.name): remove the config's 'optimizer' section\n") in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "refused").exists()  # before the data and the model
    del ds["optimizer"]
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    proc = launch(config, text, tmp_path / "sgd", "train.max_steps=4", "checkpoint.every_steps=0", "sample.prompts=[]",
                  "optim.name=sgd", "optim.kwargs={momentum: 0.9}")
    assert "DeepSpeed ZeRO-2 over 2 processes" in proc.stdout and "done: 4 steps" in proc.stdout


def test_where_deepspeed_is_installed_a_run_that_does_not_use_it_never_imports_it(tmp_path, text):
    """Accelerate imports DeepSpeed wherever it is installed to unwrap or save a model: about 3 s of every command,
    and DeepSpeed's "Setting accelerator to CPU" line on the console. A run (with its evaluation), its export and
    generation from it, without DeepSpeed, do not import it (in a new Python: the test's own has imported it)."""
    out = tmp_path / "run"
    code = ("import sys\nfrom s4accel.cli import main\n"
            "for args in sys.argv[1].split(' | '):\n"
            "    try:\n        main(args.split())\n    except SystemExit as e:\n        assert not e.code, args\n"
            "print('deepspeed imported:', 'deepspeed' in sys.modules)")
    commands = [f"train {TINY} --set run.out_dir={out} --set data.source=files --set data.files=[{text}] "
                "--set train.max_steps=2 --set checkpoint.every_steps=1 --set train.eval_every=2",
                f"export {out} {tmp_path / 'exported'}", f"generate {out / 'final'} --prompt ROMEO. --max-new-tokens 4"]
    proc = run_python("-c", code, " | ".join(commands), fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("deepspeed imported: False"), proc.stdout[-2000:]
    assert "Setting accelerator" not in proc.stdout + proc.stderr
