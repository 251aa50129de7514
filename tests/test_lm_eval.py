"""lm-evaluation-harness scores s4accel language models through its `hf` model: every loglikelihood it reports is
the model's own log-softmax summed over the continuation, every generation the model's own greedy continuation,
for the byte tokenizer (an S4 model) and a BPE (a mixture-of-experts transformer), on the example tasks defined
over local JSON Lines files (examples/lm_eval) and one the test defines. Offline, as every test here."""

import json
import sys

import pytest
import torch

from helpers import REPO, run_cli, small_text_file, train_in_process

pytest.importorskip("lm_eval")

TASKS = REPO / "examples" / "lm_eval"
# The S4 model trains long enough that its greedy continuations differ between prompts (after 8 steps every prompt
# got the same spaces), so a generation batched with left padding is checked against something; the MoE transformer
# still continues every prompt alike at 60 steps: its generations are compared all the same.
MODELS = {"byte-s4": ["optim.lr=1e-2", "train.max_steps=40"],
          "bpe-moe": ["model.name=moe-tiny", "data.tokenizer=bpe", "data.vocab_size=400", "train.max_steps=8"]}


@pytest.fixture(scope="module")
def models(tmp_path_factory, hf_cache):
    root = tmp_path_factory.mktemp("lm_eval")
    text = small_text_file(root, chars=20000)
    for name, extra in MODELS.items():
        train_in_process("recipes/s4_tiny_debug.yaml", [
            f"run.out_dir={root / name}", "data.source=files", f"data.files=[{text}]", "data.seq_len=64",
            "train.eval_every=1000", "log.progress_bar=false", "sample.prompts=[]", *extra])
    return {name: root / name / "final" for name in MODELS}


@pytest.fixture(scope="module")
def long_generation(tmp_path_factory):
    """A task of the test's own over the word task's data, by absolute path: continuations of 10 tokens, cut only at
    a blank line, so that they differ between prompts."""
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "words_long.yaml").write_text(f"""
task: words_long
dataset_path: json
dataset_kwargs:
  data_files: {{test: {TASKS / "shakespeare_words.jsonl"}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs: {{until: ["\\n\\n"], max_gen_toks: 10, do_sample: false}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
""")
    return folder


@pytest.fixture
def at_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the example tasks name their data files from the repository root


def own_loglikelihood(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """The continuation's log-probability from one unpadded forward pass, and whether it is the greedy one. As lm-eval
    does, the context's trailing whitespace belongs to the continuation, and the continuation's tokens are those of
    the whole text after the context's."""
    n = len(context) - len(context.rstrip())
    context, continuation = context[:len(context) - n], context[len(context) - n:] + continuation
    ctx = tok(context, add_special_tokens=False).input_ids
    cont = tok(context + continuation, add_special_tokens=False).input_ids[len(ctx):]
    with torch.no_grad():
        logp = model(torch.tensor([ctx + cont])).logits.float().log_softmax(-1)[0, len(ctx) - 1:-1]
    target = torch.tensor(cont)
    return logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())


def own_generation(model, tok, context: str, until: list[str], max_new: int) -> str:
    ids = tok(context, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    for stop in until:
        text = text.split(stop)[0]
    return text


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_lm_eval_scores_are_the_models_own_loglikelihoods_and_greedy_generations(models, name, long_generation,
                                                                                    at_repo):
    from s4accel.tools.harness import lm_eval_model
    from s4accel.training.runs.safe_load import load_model

    out = lm_eval_model(models[name], ["shakespeare_lines", "shakespeare_words", "words_long"],
                        include_path=[TASKS, long_generation], limit=8, batch_size=4, log_samples=True)
    model, tok, _ = load_model(models[name])

    correct = []
    for sample in out["samples"]["shakespeare_lines"]:
        ours = [own_loglikelihood(model, tok, context, choice) for context, choice in sample["arguments"]]
        theirs = [(float(ll), greedy in (True, "True")) for ((ll, greedy),) in sample["resps"]]
        assert [g for _, g in theirs] == [g for _, g in ours]
        assert [ll for ll, _ in theirs] == pytest.approx([ll for ll, _ in ours], abs=1e-4)
        correct.append(max(range(len(ours)), key=lambda i: ours[i][0]) == sample["doc"]["answer"])
    assert out["results"]["shakespeare_lines"]["acc,none"] == pytest.approx(sum(correct) / len(correct))

    for task in ("shakespeare_words", "words_long"):
        generations = []
        for sample in out["samples"][task]:
            context, kwargs = sample["arguments"][0]
            mine = own_generation(model, tok, context, kwargs["until"], kwargs["max_gen_toks"])
            assert sample["resps"][0][0] == mine  # batched with left padding, it is still the model's own
            generations.append(mine)
    if name == "byte-s4":
        assert len(set(generations)) > 2, generations  # continuations differ: the check above has teeth


@pytest.mark.slow
def test_the_lm_eval_command_and_s4accel_eval_give_the_same_scores(models, tmp_path, at_repo):
    """The `lm_eval` command of docs/how-to/lm-eval.md (the model's own saved code, no s4accel import) and
    `s4accel eval --lm-eval`."""
    from s4accel.tools.harness import lm_eval_model

    model_dir = models["byte-s4"]
    expected = lm_eval_model(model_dir, ["shakespeare_lines", "shakespeare_words"], include_path=TASKS, limit=8,
                             batch_size=4)["results"]
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                           f"pretrained={model_dir},trust_remote_code=True,add_bos_token=False", "--include_path",
                           str(TASKS), "--tasks", "shakespeare_lines,shakespeare_words", "--limit", "8",
                           "--batch_size", "4", "--output_path", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    cli = run_cli("eval", model_dir, "--lm-eval", "shakespeare_lines,shakespeare_words", "--include-path", TASKS,
                  "--limit", "8", "--batch-size", "4", "--json")
    assert cli.returncode == 0, cli.stderr[-3000:]
    printed = json.loads(cli.stdout.strip().splitlines()[-1])
    for task, metric in [("shakespeare_lines", "acc"), ("shakespeare_lines", "acc_norm"),
                         ("shakespeare_words", "exact_match")]:
        assert results[task][f"{metric},none"] == expected[task][f"{metric},none"] == printed[task][metric]


def test_eval_needs_a_recipe_or_lm_eval_tasks_and_names_an_unknown_task(models):
    proc = run_cli("eval", models["byte-s4"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: eval: give a RECIPE (its task scores the model) or --lm-eval TASKS, one of " \
                                  "the two"
    proc = run_cli("eval", models["byte-s4"], "--lm-eval", "shakespeare_line", "--include-path", TASKS)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: --lm-eval: no task 'shakespeare_line' among lm-eval's " \
                                                   f"tasks nor under {TASKS}"


def test_a_tasks_data_is_found_from_any_folder_and_a_missing_or_empty_file_is_one_line(models, tmp_path):
    """A task's relative `data_files` were read from the current folder only: from another folder, an 89-line
    FileNotFoundError; an empty data file, a StopIteration traceback. lm-eval's own chatter (`fatal: not a git
    repository`, its warning about an already-loaded model) stays off the console."""
    proc = run_cli("eval", models["byte-s4"], "--lm-eval", "shakespeare_lines", "--include-path", TASKS, "--limit",
                   "4", "--json", cwd=tmp_path)  # not the repository: the example names its data from there
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "acc" in json.loads(proc.stdout)["shakespeare_lines"]
    assert "fatal:" not in proc.stderr and "not of type" not in proc.stderr + proc.stdout, proc.stderr[-2000:]

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    spec = (TASKS / "shakespeare_words.yaml").read_text()
    (tasks / "gone.yaml").write_text(spec.replace("task: shakespeare_words", "task: gone").replace(
        "examples/lm_eval/shakespeare_words.jsonl", "nowhere/words.jsonl"))
    (tasks / "empty.jsonl").write_text("")
    (tasks / "empty.yaml").write_text(spec.replace("task: shakespeare_words", "task: empty").replace(
        "examples/lm_eval/shakespeare_words.jsonl", "empty.jsonl"))
    for task, problem in (("gone", "no file nowhere/words.jsonl (looked in"), ("empty", "is empty")):
        proc = run_cli("eval", models["byte-s4"], "--lm-eval", task, "--include-path", tasks, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --lm-eval: task {task} ({tasks / f'{task}.yaml'}): "
                                                       f"data_files: "), lines
        assert problem in lines[0], lines
