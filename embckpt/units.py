"""Sizes and durations as people write them: ``4GB``, ``512MiB``, ``30s``, ``5min``.

One parser for the command line (``embckpt report --model-bytes 2TB --interval 30m``) and for
YAML configs (``staging_budget_bytes: 4GB``, ``lock_lease_s: 90s``), so both accept the same
spellings. Imports nothing of embckpt: the config, the report and the CLI all use it.
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?i?b)?\s*$", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min|h|d|w)\s*$", re.IGNORECASE)
_PREFIX = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SECONDS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_size(text: str) -> int:
    """``2TB`` -> 2e12 bytes, ``1.5TiB`` -> 1.5 * 2**40; a bare number is bytes.

    Raises:
        ValueError: not a size.
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size: try 2TB, 500GB or 1.5TiB")
    unit = (match.group(2) or "b").lower()
    base = 1024 if "i" in unit else 1000
    return round(float(match.group(1)) * base ** _PREFIX[unit.rstrip("b").rstrip("i")])


def parse_duration(text: str) -> float:
    """``30m`` -> 1800.0 seconds; units s, m (min), h, d, w; a unit is required.

    Raises:
        ValueError: not a duration, or zero.
    """
    match = _DURATION.match(text)
    seconds = float(match.group(1)) * _SECONDS[match.group(2).lower()] if match else 0.0
    if seconds <= 0:
        raise ValueError(f"{text!r} is not a duration: try 30m, 2h or 1d")
    return seconds
