"""FSDP2 through Accelerate, on 2 CPU processes (gloo): sharded training checkpoints that resume bit-exactly, a
gathered export that `from_pretrained` loads (with the model's own remote code), a sharded EMA, samples, the same
model as a DDP run, and `s4accel export` of the sharded checkpoints in one process. tests/scripts/fsdp_on_cpu.py
explains how the FSDP path runs without GPUs."""

import json
import os
import shutil

import pytest
import torch

from helpers import REPO, TINY, accelerate_launch, final_weights, run_cli, short_epochs

pytestmark = pytest.mark.slow

CONFIGS = REPO / "accelerate_configs"


def launch(config, script, text, out, *extra, resume=False, precision="no", processes=2, force=False):
    args = ["--config_file", CONFIGS / config, "--num_processes", processes, "--mixed_precision", precision,
            "--main_process_port", "0", *script, "train", TINY]
    # MoE feed-forward (expert weights sharded too), dropout, grad_accum 2, EMA, a kept best model ranked by EMA loss
    for item in short_epochs(text, out, "train.max_steps=16", "checkpoint.every_steps=8", "checkpoint.keep_last=4",
                             "model.overrides={dropout: 0.1, ffn: moe, num_experts: 4, num_experts_per_tok: 2}",
                             "checkpoint.keep_best=1", "checkpoint.best_metric=ema_loss",
                             "sample.prompts=['ROMEO.']", "sample.max_new_tokens=16", *extra):
        args += ["--set", item]
    args += ["--resume"] * resume + ["--force"] * force
    proc = accelerate_launch(*args, timeout=300, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


FSDP_ON_CPU = [str(REPO / "tests" / "scripts" / "fsdp_on_cpu.py")]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, text):
    """One FSDP run of 16 steps, shared by the tests below: (its text, its run directory, its output)."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    return text, out, launch("fsdp.yaml", FSDP_ON_CPU, text, out)


def test_fsdp_run_writes_sharded_checkpoints_and_a_whole_model_of_its_own_class(fsdp_run):
    from transformers import AutoModelForCausalLM

    _, out, proc = fsdp_run
    assert "FSDP2 over 2 processes on cpu," in proc.stdout and "done: 16 steps" in proc.stdout
    ckpt = out / "checkpoints" / "step_00000008"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # each process wrote its own shard
        assert sorted(p.name for p in (ckpt / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], part
    for name in ("final", "final_ema", *(f"best/{p.name}" for p in (out / "best").iterdir())):
        files = sorted(p.name for p in (out / name).iterdir())
        assert "modeling_s4.py" in files and not [f for f in files if "fsdp" in f], (name, files)
        model = AutoModelForCausalLM.from_pretrained(out / name, trust_remote_code=True)
        assert type(model).__name__ == "S4ForCausalLM"
        assert model.lm_head.weight is model.backbone.embeddings.weight  # tied, stored once
        saved = final_weights(out, name)
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items() if k in saved)
    assert (out / "samples.txt").read_text().count("ROMEO.") == 1
    ema, raw = final_weights(out, "final_ema"), final_weights(out, "final")
    assert any(not torch.equal(ema[k], raw[k]) for k in raw)  # the EMA is an average, not a copy of the weights


def test_fsdp_run_resumed_from_its_sharded_checkpoint_ends_bit_identical(fsdp_run):
    text, out, _ = fsdp_run
    again = out.parent / "again"
    shutil.copytree(out / "checkpoints" / "step_00000008", again / "checkpoints" / "step_00000008")
    shutil.copy(out / "recipe.yaml", again / "recipe.yaml")
    proc = launch("fsdp.yaml", FSDP_ON_CPU, text, again, resume=True)
    assert "resumed from" in proc.stdout and "FSDP2 over 2 processes on cpu" in proc.stdout
    for name in ("final", "final_ema"):
        ref, got = final_weights(out, name), final_weights(again, name)
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref), name


def test_fsdp_trains_the_same_model_as_ddp(fsdp_run):
    text, out, _ = fsdp_run
    ddp = out.parent / "ddp"
    proc = launch("cpu_2proc.yaml", ["-m", "s4accel"], text, ddp)
    assert "DDP over 2 processes on cpu" in proc.stdout
    for name in ("final", "final_ema"):
        ref, got = final_weights(ddp, name), final_weights(out, name)
        assert ref.keys() == got.keys(), name
        for k in ref:  # the sums of the gradient reduction differ in order only
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5, msg=f"{name} {k}")


def test_export_of_a_sharded_checkpoint_in_one_process_equals_the_gathered_model(fsdp_run, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from s4accel.tools.export import export_checkpoint

    def same(folder, reference):  # every file byte for byte, and equal state dicts as from_pretrained loads them
        assert all((folder / f.name).read_bytes() == f.read_bytes() for f in reference.iterdir()), folder
        ref, got = (AutoModelForCausalLM.from_pretrained(p, trust_remote_code=True).state_dict()
                    for p in (reference, folder))
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)

    _, out, _ = fsdp_run
    proc = run_cli("export", out, tmp_path / "step16", "--step", "16")  # no process group: a plain process
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 16 (sharded checkpoint" in proc.stdout
    same(tmp_path / "step16", out / "final")
    export_checkpoint(out, tmp_path / "ema16", step=16, ema=True)
    same(tmp_path / "ema16", out / "final_ema")  # the averaged parameters; the tied head stays the embeddings'
    export_checkpoint(out, tmp_path / "step8", step=8)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "step8", trust_remote_code=True)
    assert type(model).__name__ == "S4ForCausalLM" and model.lm_head.weight is model.backbone.embeddings.weight
    step8, final = load_file(tmp_path / "step8" / "model.safetensors"), final_weights(out)
    assert "lm_head.weight" not in step8 and any(not torch.equal(step8[k], final[k]) for k in final)
    ids = torch.tensor([[40, 41, 42]])
    assert model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          pad_token_id=0).shape[1] == 11


def test_a_sharded_checkpoint_resumes_on_another_number_of_processes(fsdp_run, tmp_path):
    """2 -> 4 processes: torch.distributed.checkpoint deals the 2 shards of the weights and the optimizer's state out
    again as 4; the global batch is kept by accumulating less (--force recomputes train.grad_accum)."""
    from s4accel.tools.export import export_checkpoint

    text, out, _ = fsdp_run
    for name, steps in (("loaded", 8), ("continued", 10)):
        again = tmp_path / name
        shutil.copytree(out / "checkpoints" / "step_00000008", again / "checkpoints" / "step_00000008")
        shutil.copy(out / "recipe.yaml", again / "recipe.yaml")
        proc = launch("fsdp.yaml", FSDP_ON_CPU, text, again, f"train.max_steps={steps}", processes=4, resume=True,
                      force=True)
        assert "resumed on 4 process(es) from a checkpoint of 2" in proc.stdout
        assert "FSDP2 over 4 processes on cpu," in proc.stdout
        assert "4 process(es) x data.batch_size 4 x train.grad_accum 1 = 16 examples per step" in proc.stdout
        assert f"done: {steps} steps" in proc.stdout
    # What 4 processes loaded from 2 shards is the checkpoint's model, bit for bit
    export_checkpoint(out, tmp_path / "step8", step=8)
    loaded, saved = final_weights(tmp_path / "loaded"), final_weights(tmp_path, "step8")
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    continued = final_weights(tmp_path / "continued")  # and two more steps from its resharded optimizer state
    assert all(torch.isfinite(v).all() for v in continued.values())
    assert any(not torch.equal(continued[k], saved[k]) for k in saved)


def precision_report(*args):
    """tests/scripts/fsdp_precision.py under FSDP2 with bf16 on 2 CPU processes: its JSON report."""
    paths = os.pathsep.join([str(REPO), str(REPO / "tests" / "scripts")])
    proc = accelerate_launch("--config_file", CONFIGS / "fsdp.yaml", "--num_processes", 2, "--mixed_precision",
                             "bf16", "--main_process_port", 0, REPO / "tests" / "scripts" / "fsdp_precision.py", *args,
                             timeout=300, env={"PYTHONPATH": paths})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_under_fsdp_bf16_the_ssm_and_the_router_are_gathered_in_float32_and_gradients_reduced_in_float32():
    report = precision_report()
    parts = ("layer.kernel", "ffn.router")
    assert report["units"] == [f"backbone.layers.{i}.{part}" for i in (0, 1) for part in parts]
    assert report["dtypes"] == {"kernel": "torch.float32", "router": "torch.float32", "linear": "torch.bfloat16"}
    assert report["a_imag_max"] > 64  # where bfloat16 steps by 0.5
    assert report["ssm_exact_at_start"] and report["ssm_exact_after_step"]  # bit for bit the float32 values
    assert set(report["reduce_dtype"].values()) == {"torch.float32"}
    # Accelerate's own policy (one for the whole model) is what this replaces: the SSM rounded to bfloat16
    default = precision_report("accelerate-default")
    assert default["dtypes"]["kernel"] == "torch.bfloat16" and not default["ssm_exact_at_start"]
    assert default["reduce_dtype"]["block"] == "torch.bfloat16"


def test_an_fsdp_bf16_run_trains_resumes_bit_for_bit_and_exports_float32_weights(tmp_path, text):
    out = tmp_path / "bf16"
    steps = ("train.max_steps=8", "checkpoint.every_steps=4", "train.ema=null", "checkpoint.keep_best=0")
    proc = launch("fsdp.yaml", FSDP_ON_CPU, text, out, *steps, precision="bf16")
    assert "FSDP mixed precision: 4 float32 units (kernel, router), bf16 for the rest" in proc.stdout
    assert "mixed precision bf16" in proc.stdout and "done: 8 steps" in proc.stdout
    again = tmp_path / "again"
    shutil.copytree(out / "checkpoints" / "step_00000004", again / "checkpoints" / "step_00000004")
    shutil.copy(out / "recipe.yaml", again / "recipe.yaml")
    launch("fsdp.yaml", FSDP_ON_CPU, text, again, *steps, precision="bf16", resume=True)
    ref, got = final_weights(out), final_weights(again)
    assert all(v.dtype == torch.float32 for v in ref.values())
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
