"""The real trackers, offline: W&B in offline mode, MLflow on a local file store, trackio in a local folder (each
skipped where its package, the `trackers` extra, is missing). What each holds, read back through its own files or
client, is what metrics.jsonl and TensorBoard hold, step for step; a run stopped by SIGTERM and resumed continues
the same tracker run; a tracker whose store goes away mid-run is retried, then dropped with one warning, and the run
ends normally."""

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from helpers import callback_override, read_metrics, train_in_process

BACKENDS = [name for name in ("wandb", "mlflow", "trackio") if importlib.util.find_spec(name)]
STEPS, CUT = 8, 4  # SIGTERM after step 4: the run checkpoints and stops, the resumed one logs the steps after


def recipe(text, out, *extra):
    return [f"run.out_dir={out}", "run.name=tracked", "data.source=files", f"data.files=[{text}]",
            "data.seq_len=32", f"train.max_steps={STEPS}", "train.eval_every=4", "checkpoint.every_steps=100",
            "log.log_every=1", "log.progress_bar=false", "sample.prompts=[]", "log.tracker_backoff_s=0.01",
            f"log.log_with=[jsonl, tensorboard, {', '.join(BACKENDS)}]", *extra]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Every tracker's store in this module's folder, offline."""
    root = tmp_path_factory.mktemp("stores")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("MLFLOW_TRACKING_URI", (root / "mlruns").as_uri())
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store unless told
        mp.setenv("TRACKIO_DIR", str(root / "trackio"))
        yield root


@pytest.fixture(scope="module")
def resumed_run(stores, text):
    if not BACKENDS:
        pytest.skip("no tracker package installed (pip install 's4accel[trackers]')")
    out = stores / "run"
    cut = train_in_process("recipes/s4_tiny_debug.yaml", recipe(text, out, callback_override(
        "testing_callbacks:SignalAt", step=CUT)))
    assert cut.preempted and cut.steps < STEPS
    done = train_in_process("recipes/s4_tiny_debug.yaml", recipe(text, out), resume="latest")
    assert done.steps == STEPS and not done.preempted
    return out


def jsonl_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for record in read_metrics(run_dir):
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                out.setdefault(key, []).append((record["step"], float(value)))
    return out


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    return {key: [(e.step, e.value) for e in tb.Scalars(key)] for key in tb.Tags()["scalars"]}


def wandb_records(path: Path):
    """The protobuf records of a W&B offline run file (`run-<id>.wandb`): LevelDB's log format after a 7-byte header
    (`:W&B`, magic 0xBEE1, version), 32 KiB blocks of chunks each with a 7-byte header (CRC32C, length, type: 1 whole,
    2 first, 3 middle, 4 last). wandb 0.31 reads these files in its Go core only; this is their documented layout."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # too little left in the block for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_run(run_dir) -> tuple[list[str], dict[str, list[tuple[int, float]]]]:
    """(the run id of each offline run file, in order; the scalars of all of them)."""
    ids, scalars = [], {}
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(f):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.append(record.run.run_id)
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                for key, value in items.items():
                    if not key.startswith("_") and isinstance(value, (int, float)):
                        scalars.setdefault(key, []).append((items["_step"], float(value)))
    return ids, scalars


def test_each_tracker_holds_what_metrics_jsonl_and_tensorboard_hold(resumed_run):
    expected = jsonl_scalars(resumed_run)
    assert [s for s, _ in expected["train/loss"]] == list(range(1, STEPS + 1))
    tensorboard = tensorboard_scalars(resumed_run)
    for key, points in expected.items():
        assert [s for s, _ in tensorboard[key]] == [s for s, _ in points], key
        assert [v for _, v in tensorboard[key]] == pytest.approx([v for _, v in points], rel=1e-6), key

    held = {}
    if "wandb" in BACKENDS:
        held["wandb"] = wandb_run(resumed_run)[1]
    if "mlflow" in BACKENDS:
        held["mlflow"] = mlflow_run(resumed_run.parent)[1]
    if "trackio" in BACKENDS:
        held["trackio"] = trackio_run(resumed_run.parent)[1]
    for backend, scalars in held.items():
        assert set(scalars) == set(expected), backend
        for key, points in expected.items():
            assert sorted(scalars[key]) == points, (backend, key)  # the same steps, the same float64 values


def mlflow_run(stores) -> tuple[list, dict[str, list[tuple[int, float]]]]:
    """(the MLflow runs of the experiment `tracked`, the scalars of the one run there)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(stores / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("tracked")
    runs = client.search_runs([experiment.experiment_id])
    scalars = {key: [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key)]
               for key in runs[0].data.metrics}
    return runs, scalars


def trackio_run(stores) -> tuple[list[str], dict[str, list[tuple[int, float]]]]:
    """(the runs of trackio's project `tracked`, the scalars of the one run there), from its local database."""
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_project_db_path("tracked").parent == stores / "trackio"
    runs = SQLiteStorage.get_runs("tracked")
    scalars = {}
    for row in SQLiteStorage.get_logs("tracked", runs[0]):
        for key, value in row.items():
            if key not in ("step", "timestamp") and isinstance(value, (int, float)):
                scalars.setdefault(key, []).append((row["step"], float(value)))
    return runs, scalars


def test_a_resumed_run_continues_the_same_tracker_run(resumed_run):
    import torch

    state = torch.load(next((resumed_run / "checkpoints").glob("step_*")) / "custom_checkpoint_1.pkl",
                       weights_only=False)
    run_id = state["run_id"]
    if "wandb" in BACKENDS:  # offline, each start writes its own file; syncing them continues one run
        ids, _ = wandb_run(resumed_run)
        assert ids == [run_id, run_id]
    if "mlflow" in BACKENDS:
        runs, scalars = mlflow_run(resumed_run.parent)
        assert len(runs) == 1 and runs[0].data.tags["s4accel.run_id"] == run_id
        assert [s for s, _ in scalars["train/loss"]] == list(range(1, STEPS + 1))
    if "trackio" in BACKENDS:
        runs, scalars = trackio_run(resumed_run.parent)
        assert runs == [f"tracked-{run_id[:8]}"]
        assert [s for s, _ in scalars["train/loss"]] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_mlflow_whose_store_goes_away_mid_run_is_retried_then_dropped_and_the_run_ends(stores, text, tmp_path):
    pytest.importorskip("mlflow")
    out, store = tmp_path / "run", stores / "mlruns"
    with pytest.warns(UserWarning) as caught:
        result = train_in_process("recipes/s4_tiny_debug.yaml", [
            *recipe(text, out, callback_override("testing_callbacks:RemoveAt", step=3, path=str(store))),
            "run.name=vanishing", "log.log_with=[jsonl, mlflow]", "train.max_steps=6"])
    assert result.steps == 6 and (out / "final" / "model.safetensors").exists()
    dropped = [str(w.message) for w in caught if str(w.message).startswith("tracker 'mlflow'")]
    assert dropped == [f"tracker 'mlflow': log failed (Exception: '{store}' does not exist.); disabled, training goes "
                       f"on without it"]  # after its retries, one line
    assert [r["step"] for r in read_metrics(out) if "train/loss" in r] == list(range(1, 7))
    import mlflow

    assert mlflow.active_run() is None  # closed when dropped: a next run in this process (a notebook) can start one


def wandb_projects(run_dir) -> list[tuple[str, str]]:
    """(project, run name) of each W&B offline run file of a run directory."""
    return [(record.run.project, record.run.display_name)
            for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
            for record in wandb_records(f) if record.WhichOneof("record_type") == "run"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["log.project", "tracker_kwargs", "environment"])
def test_runs_of_one_project_are_grouped_and_keep_their_own_names_and_local_logs(stores, text, how, monkeypatch,
                                                                                  tmp_path):
    """Two runs of one project: one W&B project, one MLflow experiment, one trackio project, each run under its own
    name; said with `log.project`, with the trackers' own keywords in `log.tracker_kwargs` (which used to pass the
    check and then fail at start with "multiple values for keyword argument 'project'"), or with the environment
    variables the trackers honour. Naming only remote trackers still writes metrics.jsonl (the card's curve)."""
    if not BACKENDS:
        pytest.skip("no tracker package installed (pip install 's4accel[trackers]')")
    project = f"group-{how.replace('.', '-')}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # stores of its own: another test
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))                # removes the module's MLflow store
    extra = {"log.project": [f"log.project={project}"], "environment": [],
             "tracker_kwargs": [f"log.tracker_kwargs={{wandb: {{project: {project}}}, mlflow: {{experiment_name: "
                                f"{project}}}, trackio: {{project: {project}}}}}"]}[how]
    if how == "environment":
        for variable in ("WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME"):  # trackio reads none
            monkeypatch.setenv(variable, project)
    for name in ("first", "second"):
        out = tmp_path / name
        result = train_in_process("recipes/s4_tiny_debug.yaml", [
            *recipe(text, out), f"run.name={name}", "train.max_steps=2", "train.eval_every=0",
            f"log.log_with=[{', '.join(BACKENDS)}]", *extra])
        assert result.steps == 2
        assert [r["step"] for r in read_metrics(out) if "train/loss" in r] == [1, 2]
        if "wandb" in BACKENDS:
            assert wandb_projects(out) == [(project, name)]
    if "mlflow" in BACKENDS:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
        runs = client.search_runs([client.get_experiment_by_name(project).experiment_id])
        assert sorted(r.info.run_name for r in runs) == ["first", "second"]
    if "trackio" in BACKENDS and how != "environment":
        from trackio.sqlite_storage import SQLiteStorage

        assert len(SQLiteStorage.get_runs(project)) == 2
