"""Memory sizes as operators write them ("80GB", "40GiB", "512MiB") and as bytes; durations as
they write them ("90s", "30m", "12h", "30d", "2w") and as seconds."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class BadSize(ValueError):
    """A memory size that could not be read; the message says what is accepted."""


def parse_size(text: object) -> int:
    """Return the number of bytes that `text` names.

    Integers are bytes. Strings take a number and one of B, KB, MB, GB, TB (powers of ten)
    or KiB, MiB, GiB, TiB (powers of two), case-insensitive.
    """
    if isinstance(text, bool):
        raise BadSize(f"{text!r} is not a size; write it like '40GiB' or '80GB'")
    if isinstance(text, int):
        if text < 0:
            raise BadSize(f"{text} is negative; a size is at least 0 bytes")
        return text
    if not isinstance(text, str):
        raise BadSize(f"{text!r} is not a size; write it like '40GiB' or '80GB'")
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise BadSize(f"{text!r} is not a size; write it like '40GiB' or '80GB'")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def format_size(n_bytes: int) -> str:
    """Format bytes in GiB with one decimal, the unit GPU memory is usually read in."""
    return f"{n_bytes / 2**30:.1f} GiB"


# What a duration is, written once: the code reads it and the admin API's document states it
# (as JSON Schema `pattern`s). A positive one has a digit other than 0.
DURATION_PATTERN = r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw])\s*$"
POSITIVE_DURATION_PATTERN = (
    r"^\s*(0*[1-9][0-9]*(?:\.[0-9]+)?|0+\.[0-9]*[1-9][0-9]*)\s*([smhdw])\s*$"
)
_DURATION = re.compile(DURATION_PATTERN)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class BadDuration(ValueError):
    """A duration that could not be read; the message says what is accepted."""


MAX_DURATION = 100 * 365 * 86400  # seconds: longer is a typo, and overflows dates and stores


def parse_duration(text: str, clamp: bool = False) -> float:
    """The seconds that `text` names: a number and one of s, m, h, d, w (`90s`, `12h`), at
    most 100 years; with `clamp`, a longer one is read as 100 years (how far back to look:
    further than there is is everything), else refused."""
    match = _DURATION.match(text)
    if not match:
        raise BadDuration(f"{text!r} is not a duration; write it like 90s, 30m, 12h, 30d or 2w")
    seconds = float(match[1]) * _SECONDS[match[2]]
    if seconds > MAX_DURATION:
        if clamp:
            return MAX_DURATION
        raise BadDuration(f"{text[:40]!r} is longer than 100 years")
    return seconds
