"""Durations as a recipe writes them (`train.max_time`), read into seconds, and seconds written back for people.

Accepted: units in order (`90s`, `45m`, `2h`, `1h30m`, `1.5h`, `1d12h`), Lightning's `DD:HH:MM:SS`, `HH:MM:SS`,
SLURM's `D-HH:MM:SS` and `MM:SS` (what a job's `--time` says), Lightning's mapping (`{hours: 1, minutes: 30}`), or a
number of seconds. Two fields are minutes and seconds, as SLURM reads them and as YAML does (an unquoted `30:00` is
YAML 1.1's base-60 number 1800). Hand-written because neither pydantic (ISO 8601 `PT1H30M` and plain seconds only)
nor the standard library reads these forms.
"""

from __future__ import annotations

import math
import re

_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_WITH_UNITS = re.compile(r"(?:(\d+(?:\.\d*)?)d)?(?:(\d+(?:\.\d*)?)h)?(?:(\d+(?:\.\d*)?)m)?(?:(\d+(?:\.\d*)?)s)?")
_FIELDS = re.compile(r"(?:(?:(\d+)[-:])?(\d+):)?(\d+):(\d+)")  # [[D- or DD:]HH:]MM:SS
_MAPPING_KEYS = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
EXAMPLES = "e.g. 90m, 1h30m, 2d, 01:30:00, 1-12:00:00 or a number of seconds"


def duration_seconds(value) -> float:
    """Seconds in `value` (see the module's docstring); ValueError naming the accepted forms otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration ({EXAMPLES}), got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(_MAPPING_KEYS))
        if unknown or not value or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                           for v in value.values()):
            raise ValueError(f"expected a mapping of days, hours, minutes and seconds to numbers, got {value!r}")
        seconds = float(sum(_MAPPING_KEYS[k] * v for k, v in value.items()))
    elif isinstance(value, str):
        seconds = _from_text(value.strip().lower())
    else:
        raise ValueError(f"expected a duration ({EXAMPLES}), got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"expected a duration greater than 0 ({EXAMPLES}), got {value!r}")
    return seconds


def _from_text(text: str) -> float:
    fields = _FIELDS.fullmatch(text)
    if fields:
        days, hours, minutes, seconds = (int(f) if f else 0 for f in fields.groups())
        if minutes >= 60 or seconds >= 60:
            raise ValueError(f"minutes and seconds are below 60 in HH:MM:SS, got {text!r}")
        return float(days * 86400 + hours * 3600 + minutes * 60 + seconds)
    units = _WITH_UNITS.fullmatch(text)
    if text and units and any(units.groups()):
        return sum(_UNITS[u] * float(n) for u, n in zip("dhms", units.groups()) if n)
    try:
        return float(text)  # "3600": seconds, as a number would be
    except ValueError:
        raise ValueError(f"expected a duration ({EXAMPLES}), got {text!r}") from None


def spoken(seconds: float) -> str:
    """`1h`, `1h30m`, `1h02m05s`, `2m30s`, `41s`, `2d3h`: whole seconds, the largest unit first, no zero units at
    either end."""
    total = int(round(seconds))
    parts = [total // 86400, total % 86400 // 3600, total % 3600 // 60, total % 60]
    used = [i for i, n in enumerate(parts) if n] or [3]
    first, last = used[0], used[-1]
    return "".join(f"{parts[i]}{u}" if i == first or u in "dh" else f"{parts[i]:02d}{u}"
                   for i, u in enumerate("dhms") if first <= i <= last)
