"""Wall-clock durations written the way people write them: ``15min``, ``60s``, ``2h``, ``1h30m``.

Time-based settings (``save_interval``) accept such a phrase or a plain number of seconds. The
parser is strict on purpose: ``15 mins later`` or ``1.5.h`` is a mistake to report, not something to
guess at, because a misread interval silently changes how much work a crash can lose.
"""

from __future__ import annotations

import re

# unit spelling -> seconds; longer spellings first so the regex prefers "min" over "m"+"in"
_UNITS: dict[str, int] = {
    "days": 86400,
    "day": 86400,
    "d": 86400,
    "hours": 3600,
    "hour": 3600,
    "hrs": 3600,
    "hr": 3600,
    "h": 3600,
    "minutes": 60,
    "minute": 60,
    "mins": 60,
    "min": 60,
    "m": 60,
    "seconds": 1,
    "second": 1,
    "secs": 1,
    "sec": 1,
    "s": 1,
}
_UNIT_PATTERN = "|".join(sorted(_UNITS, key=len, reverse=True))
_PART = re.compile(rf"(\d+(?:\.\d+)?)\s*({_UNIT_PATTERN})", re.IGNORECASE)
_WHOLE = re.compile(rf"^\s*(?:(\d+(?:\.\d+)?)\s*({_UNIT_PATTERN})\s*)+$", re.IGNORECASE)
_NUMBER = re.compile(r"^\s*\d+(?:\.\d+)?\s*$")

EXAMPLES = "15min, 60s, 2h, 1h30m, 1d, or a number of seconds"


class TimePhraseError(ValueError):
    """The text is not a duration; the caller adds which key it came from."""


def parse_duration(phrase: str | int | float) -> float:
    """Seconds in ``phrase``: a number (seconds) or a sequence of ``<number><unit>`` parts.

    Each unit may appear once (``1h30m`` is fine, ``1h1h`` is a typo) and the total must be positive:
    a zero interval would save on every step.
    """
    if isinstance(phrase, bool):
        raise TimePhraseError(f"{phrase!r} is not a duration (use {EXAMPLES})")
    if isinstance(phrase, (int, float)):
        seconds = float(phrase)
    elif not isinstance(phrase, str):
        raise TimePhraseError(f"{phrase!r} is not a duration (use {EXAMPLES})")
    elif _NUMBER.match(phrase):
        seconds = float(phrase)
    elif _WHOLE.match(phrase):
        seconds = 0.0
        seen: set[int] = set()
        for amount, unit in _PART.findall(phrase):
            size = _UNITS[unit.lower()]
            if size in seen:
                raise TimePhraseError(f"{phrase!r} names the same unit twice (use {EXAMPLES})")
            seen.add(size)
            seconds += float(amount) * size
    else:
        raise TimePhraseError(f"{phrase!r} is not a duration (use {EXAMPLES})")
    if seconds <= 0:
        raise TimePhraseError(f"{phrase!r} is not a positive duration (use {EXAMPLES})")
    return seconds
