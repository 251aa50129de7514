"""Every file in accelerate_configs/ is what `accelerate launch --config_file` reads: it parses, and its FSDP or
DeepSpeed section builds Accelerate's plugin (whose checks reject bad values). The GPU ones cannot run here."""

import os
from unittest import mock

import pytest

from helpers import FREE_PORT, REPO

CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))


def launch_args(path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(path), "-m", "s4accel", "train", "r.yaml"])
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_parses_and_builds_its_plugin(path):
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, defaults = launch_args(path)
    assert args.num_processes >= 1 and args.main_training_function == "main"
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join([*defaults.deepspeed_config, "mixed_precision"])
        _, env = prepare_deepspeed_cmd_env(args)
        with mock.patch.dict(os.environ, env):
            plugin = DeepSpeedPlugin()
        stage = int(path.stem[-1])
        assert plugin.zero_stage == stage
        # filled in from the recipe's train.clip_grad_norm and train.grad_accum (s4accel/training/devices/zero.py)
        assert plugin.deepspeed_config["gradient_clipping"] == "auto"
        assert plugin.deepspeed_config["gradient_accumulation_steps"] == "auto"
        zero = plugin.deepspeed_config["zero_optimization"]
        assert zero["stage3_gather_16bit_weights_on_model_save"] == (stage == 3)
    elif args.use_fsdp:
        with mock.patch.dict(os.environ, prepare_multi_gpu_env(args)):
            plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
        assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"  # training checkpoints; the export is full
        assert plugin.transformer_cls_names_to_wrap is None  # the model's _no_split_modules: S4Block / MoEBlock


def test_the_templates_the_readme_promises_are_there():
    names = {p.stem for p in CONFIGS}
    promised = {"cpu_2proc", "single_gpu", "multi_gpu", "fsdp", "deepspeed_zero2", "deepspeed_zero3", "multi_node"}
    assert promised <= names
    args, _ = launch_args(REPO / "accelerate_configs" / "multi_node.yaml")
    assert args.num_machines == 2 and args.num_processes == 16 and args.main_process_port == 29500


@pytest.mark.slow
def test_fsdp_config_on_cpu_processes_runs_ddp_and_says_so(tmp_path):
    """Accelerate 1.15 uses FSDP only on GPU-type setups (torch's FSDP2 itself runs on CPU over gloo); on CPU the
    run must still work, as DDP, and tell the user that it is not sharded."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *FREE_PORT, "--config_file",
                           str(REPO / "accelerate_configs" / "fsdp.yaml"), "--num_processes", "2", "--mixed_precision",
                           "no", "-m", "s4accel", "train", str(REPO / "recipes" / "s4_tiny_debug.yaml"), "--set",
                           f"run.out_dir={tmp_path / 'run'}", "--set", "train.max_steps=3", "--set",
                           "log.progress_bar=false", "--set", "sample.prompts=[]"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the accelerate config asks for FSDP, but Accelerate runs MULTI_CPU here" in proc.stdout
    assert "DDP over 2 processes on cpu," in proc.stdout and (tmp_path / "run" / "final").is_dir()
