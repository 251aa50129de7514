"""What the libraries print that a user does not need: kept off the console, warnings that matter left alone."""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
import warnings
from pathlib import Path

import datasets
from accelerate.utils import DistributedType
from transformers.utils import logging as hf_logging

from ...errors import S4AccelError


class _DropTiedWeightsNote(logging.Filter):
    """Accelerate logs "Removed shared tensor {'lm_head.weight'} while saving" at every checkpoint of a model whose
    output layer shares the embedding's weights. That sharing is by design (`tie_word_embeddings`), and
    `from_pretrained` ties them again on load, so the line says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor" not in record.getMessage()


def quiet_libraries(progress_bars: bool) -> None:
    """Called once per process before anything is built. transformers' "Writing model shards" / "Loading weights"
    bars are always off (a bar for one file that takes milliseconds), and so are torch's deprecation warnings for
    the collectives DeepSpeed calls; `progress_bars=False` (`log.progress_bar: false`, or a command that prints only
    its result) turns off every `datasets` bar too."""
    logger = logging.getLogger("accelerate.utils.other")
    if not any(isinstance(f, _DropTiedWeightsNote) for f in logger.filters):
        logger.addFilter(_DropTiedWeightsNote())
    hf_logging.disable_progress_bar()
    # torch 2.13 deprecates these collectives' names (for all_gather_single, reduce_scatter_single); DeepSpeed's ZeRO
    # and Accelerate's gather on GPUs call them, so every process of such a run printed a FutureWarning about code
    # that is not the user's
    warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
                            r"deprecated", FutureWarning)
    if not progress_bars:
        datasets.disable_progress_bars()


class RunLog:
    """`<run_dir>/train.log`: what the run prints, so a run on a cluster can be read afterwards. The main process
    logs everything it prints; the others log what they write to stderr (warnings, errors), prefixed with their
    rank. Lines printed before the run directory exists are kept and written first. Progress-bar redraws (carriage
    returns, cursor movements) are left out, and so is the line feed a bar below another writes to reach its
    row. One per process (`RUN_LOG`): a run prints into it inside `capture`, which it opens first; `open` once
    the run directory is in place."""

    def __init__(self):
        self.file, self.path = None, None
        self.pending: list[str] = []
        self.active, self.is_main, self.rank = False, True, 0
        self.held_newline, self.at_line_start = False, True

    @contextlib.contextmanager
    def capture(self, is_main: bool, rank: int):
        """From here until the run ends, however it ends, what this process prints is logged too; an error that ends
        the run is logged as the CLI prints it (a user error's line, anything else's traceback). Then the terminal's
        streams are handed back."""
        self.begin(is_main, rank)
        try:
            yield self
        except S4AccelError as e:
            self.add("".join(line + "\n" for line in e.lines()), "stderr")
            raise
        except Exception:
            self.add(traceback.format_exc(), "stderr")
            raise
        finally:
            self.end()
            for name in ("stdout", "stderr"):
                stream = getattr(sys, name)
                if isinstance(stream, _Tee) and stream.log is self:
                    setattr(sys, name, stream.stream)

    def begin(self, is_main: bool, rank: int) -> None:
        self.end()
        self.active, self.is_main, self.rank, self.pending = True, is_main, rank, []
        self.at_line_start = True
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if not (isinstance(stream, _Tee) and stream.log is self):
                setattr(sys, name, _Tee(stream, self, name))

    def open(self, path: Path) -> None:
        self.path = path
        if self.active and (self.is_main or self.pending):
            self._write("")

    def _write(self, text: str) -> None:
        if self.file is None:
            try:
                self.file = open(self.path, "a", encoding="utf-8", errors="backslashreplace")
            except OSError:  # the folder is gone or not writable: the console still has everything
                self.active = False
                return
            text, self.pending = "".join(self.pending) + text, []
        self.file.write(text)
        self.file.flush()

    def end(self) -> None:
        if self.file is not None:
            if self.held_newline:
                self.file.write("\n")
            self.file.close()
        self.held_newline = False
        self.file, self.path, self.active, self.pending = None, None, False, []

    def add(self, text: str, stream: str) -> None:
        if not self.active or not text or (not self.is_main and stream == "stdout"):
            return
        if text == "\n" and self.at_line_start:  # an empty line, or tqdm moving down to a nested bar's row: the
            self.held_newline = True  # next write says which
            return
        if "\r" in text or "\x1b[" in text:  # a bar drawn or the cursor moved back up: not a line of the run
            self.held_newline = False
            return
        self.at_line_start = text.endswith("\n")
        if not self.is_main:
            text = "".join(f"[rank {self.rank}] {line}" for line in text.splitlines(keepends=True))
        if self.held_newline:
            text, self.held_newline = "\n" + text, False
        if self.path is None:
            self.pending.append(text)
        else:
            self._write(text)


class _Tee:
    """A stream that writes through to the terminal and to the run's log."""

    def __init__(self, stream, log: RunLog, name: str):
        self.stream, self.log, self.name = stream, log, name

    def write(self, text):
        self.log.add(text, self.name)
        return self.stream.write(text)

    def __getattr__(self, attr):  # flush, isatty, fileno, encoding, ...: the terminal's
        return getattr(self.stream, attr)


RUN_LOG = RunLog()


def append_to_log(run_dir: Path, line: str) -> None:
    """A line printed after the run ended (the command's summary) added to its train.log as well."""
    try:
        with open(Path(run_dir) / "train.log", "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:  # the run directory is gone or read-only: the console has the line
        pass


def processes_line(accelerator) -> str:
    """How the run is spread, in the words a user knows: `single process on cpu`, `DDP over 2 processes on cpu`,
    `FSDP2 over 4 processes on cuda`, `DeepSpeed ZeRO-3 over 8 processes on cuda` (Accelerate's enum names, such as
    `MULTI_CPU` or `NO`, say how it was launched, not what runs)."""
    kind, n, device = accelerator.distributed_type, accelerator.num_processes, accelerator.device.type
    if kind == DistributedType.NO:
        return f"single process on {device}"
    if kind == DistributedType.FSDP:
        name = "FSDP2" if accelerator.is_fsdp2 else "FSDP"
    elif kind == DistributedType.DEEPSPEED:
        name = f"DeepSpeed ZeRO-{accelerator.state.deepspeed_plugin.zero_stage}"
    else:  # MULTI_CPU, MULTI_GPU and the other accelerators' MULTI_*: DistributedDataParallel
        name = {DistributedType.XLA: "XLA", DistributedType.MEGATRON_LM: "Megatron-LM"}.get(kind, "DDP")
    return f"{name} over {n} process{'es' if n != 1 else ''} on {device}"
