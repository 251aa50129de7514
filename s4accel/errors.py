"""Errors a user can cause and fix (the CLI prints their message on one line, without a traceback), and the
did-you-mean hint their messages share."""

import difflib


class S4AccelError(Exception):
    """Base of the user-facing errors; `exit_code` is what the CLI exits with."""

    exit_code = 1

    def lines(self) -> list[str]:
        """How the CLI prints it: each line of the message after `error: `."""
        return [f"error: {line}" for line in str(self).splitlines()]


class RecipeError(S4AccelError, ValueError):
    """A recipe or `--set` override that does not validate: unknown key, wrong type, bad value."""

    exit_code = 2


class DataError(S4AccelError, ValueError):
    """Data that cannot be used: a missing file, an empty dataset, too little text for the split."""

    exit_code = 2


class RunDirError(S4AccelError):
    """A run directory that cannot be used: not writable, or holding a finished run that would be overwritten."""

    exit_code = 2


class ResumeError(S4AccelError):
    """A resume that cannot go ahead: no usable checkpoint at the given path, or a recipe that changed."""

    exit_code = 2


class CheckpointError(S4AccelError):
    """A checkpoint or model that could not be written (disk full, permissions); the last complete one is intact."""

    exit_code = 1


class NonFiniteError(S4AccelError):
    """Training stopped on a non-finite loss or gradient norm (train.on_nonfinite)."""

    exit_code = 3


class ModelError(S4AccelError):
    """A model that cannot be used: missing, not an s4accel model, without safetensors weights, or not matching the
    data it is asked to evaluate."""

    exit_code = 2


class ExportError(S4AccelError):
    """A checkpoint that cannot be exported as a model: none there, not the step asked for, weights in a format that
    can be read only by unpickling it, a task of your own, or an output folder in the way."""

    exit_code = 2


def did_you_mean(word: str, choices) -> str:
    """` (did you mean 'x'?)` for the closest of `choices`, or nothing: the hint every name error carries."""
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""
