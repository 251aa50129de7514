"""What a pushed repository holds names no path of the training machine: the recipe and card are written portable
(`config/paths.py: portable_recipe`), the recipe's hyperparameters in the TensorBoard event files are rewritten the
same way, and a last check refuses to upload any file that still holds one of the machine's paths."""

from __future__ import annotations

import glob
import shutil
from pathlib import Path, PurePosixPath

from ..config.paths import portable_recipe
from ..training.observe.tracking import tracker_config


def published_hparams(recipe: dict) -> dict[str, str]:
    """{hyperparameter: its published text} for those whose text names a path of the machine, of a recipe the run
    logged to its trackers."""
    logged, published = tracker_config(recipe), tracker_config(portable_recipe(recipe)[0])
    return {k: str(v) for k, v in published.items() if logged.get(k) != v}


def copy_event_file(src: Path, dst: Path, replace: dict[str, str]) -> None:
    """Copy a TensorBoard event file, the text of each hyperparameter in `replace` replaced (the HParams plugin's
    session start, which `SummaryWriter.add_hparams` writes into an event file of its own). Others are copied as
    they are."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
    from tensorboard.summary.writer.record_writer import RecordWriter

    events, changed = [], False
    for raw in RawEventFileLoader(str(src)).Load():
        event = Event.FromString(raw)
        for value in event.summary.value:
            plugin = value.metadata.plugin_data
            if plugin.plugin_name != "hparams":
                continue
            data = HParamsPluginData.FromString(plugin.content)
            for key, hparam in data.session_start_info.hparams.items():
                if key in replace and hparam.WhichOneof("kind") == "string_value":
                    hparam.string_value, changed = replace[key], True
            plugin.content = data.SerializeToString()
        events.append(event)
    if not changed:
        shutil.copy2(src, dst)
        return
    with open(dst, "wb") as f:
        writer = RecordWriter(f)
        for event in events:
            writer.write(event.SerializeToString())


def machine_paths(recipe: dict, run_dir: Path) -> set[str]:
    """The paths of the training machine a pushed file must not hold: the run directory, and each path the recipe
    names (a glob's folder), as long as it is at least two folders deep (a lone `/data` is too common a string to say
    anything)."""
    paths = {str(run_dir.resolve()), str(run_dir.absolute())}
    for renamed in portable_recipe(recipe)[1]:
        parts = PurePosixPath(renamed.path).parts
        paths.add(str(PurePosixPath(*parts[:next((i for i, p in enumerate(parts) if glob.has_magic(p)), None)])))
    return {p for p in paths if len(PurePosixPath(p).parts) > 2}


def machine_path_in(folder: Path, paths: set[str]) -> tuple[Path, str] | None:
    """(the first file under `folder` that holds one of `paths`, that path), or None."""
    needles = sorted(paths, key=len, reverse=True)
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            data = f.read_bytes()
            found = next((p for p in needles if p.encode() in data), None)
            if found is not None:
                return f.relative_to(folder), found
    return None
