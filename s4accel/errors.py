"""Errors a user can cause and fix. The CLI prints their message on one line, without a traceback."""


class S4AccelError(Exception):
    """Base of the user-facing errors; `exit_code` is what the CLI exits with."""

    exit_code = 1


class RecipeError(S4AccelError, ValueError):
    """A recipe or `--set` override that does not validate: unknown key, wrong type, bad value."""

    exit_code = 2


class DataError(S4AccelError, ValueError):
    """Data that cannot be used: a missing file, an empty dataset, too little text for the split."""

    exit_code = 2


class RunDirError(S4AccelError):
    """A run directory that cannot be used: not writable, or holding a finished run that would be overwritten."""

    exit_code = 2
