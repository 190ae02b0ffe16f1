"""Parse link rates and latencies written the way ``tc`` and humans write them.

Rates use tc's convention: ``kbit``/``mbit``/``gbit``/``tbit`` are decimal (10^3, 10^6, ...) bits per
second, ``kibit``/``mibit``/``gibit``/``tibit`` binary. tc reads ``bps`` as BYTES per second, which
nobody else does, so ``...bps`` spellings are refused rather than guessed.
"""

from __future__ import annotations

import math
import re

_RATE_UNITS = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "kibit": 2.0**10,
    "mibit": 2.0**20,
    "gibit": 2.0**30,
    "tibit": 2.0**40,
}
_TIME_UNITS = {"ns": 1e9, "us": 1e6, "µs": 1e6, "ms": 1e3, "s": 1.0}
"""Divisors, so that "50us" is exactly the double nearest 5e-5 (50 * 1e-6 is not)."""
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zµ]*)\s*$")


def _split(text: str, what: str, units: dict[str, float]) -> tuple[float, str]:
    match = _NUMBER_UNIT.match(text.lower()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"bad {what} {text!r}: expected a number followed by one of {sorted(units)}")
    value = float(match.group(1))
    if not math.isfinite(value):
        raise ValueError(f"bad {what} {text!r}: not a finite number")
    return value, match.group(2)


def parse_bandwidth(text: str) -> float:
    """``"100mbit"`` -> 1e8 bits per second. Raises ValueError naming the string if it is not a
    positive rate with a unit from ``bit kbit mbit gbit tbit kibit mibit gibit tibit``."""
    value, unit = _split(text, "bandwidth", _RATE_UNITS)
    if unit.endswith("bps"):
        raise ValueError(f"bad bandwidth {text!r}: 'bps' means bytes/s to tc but bits/s to most people; "
                         f"write it in bits, e.g. '100mbit' or '1gbit'")
    if unit not in _RATE_UNITS:
        raise ValueError(f"bad bandwidth {text!r}: unit {unit!r} is not one of {sorted(_RATE_UNITS)}")
    if value <= 0:
        raise ValueError(f"bad bandwidth {text!r}: must be > 0")
    return value * _RATE_UNITS[unit]


def parse_latency(text: str) -> float:
    """``"50us"`` -> 5e-5 seconds; units ``ns us µs ms s``. A bare ``"0"`` is allowed (no latency);
    any other number without a unit is refused because its unit would be a guess."""
    value, unit = _split(text, "latency", _TIME_UNITS)
    if unit == "" and value == 0:
        return 0.0
    if unit not in _TIME_UNITS:
        raise ValueError(f"bad latency {text!r}: unit {unit!r} is not one of {sorted(_TIME_UNITS)}")
    return value / _TIME_UNITS[unit]


def format_bandwidth(bits_per_second: float) -> str:
    """The inverse of :func:`parse_bandwidth` for round decimal rates (``1e8`` -> ``"100mbit"``)."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scaled = bits_per_second / _RATE_UNITS[unit]
        if scaled >= 1 - 1e-9:  # 8 / (8 / 1e9) is 999999999.9999999
            return f"{scaled:g}{unit}"
    return f"{bits_per_second:g}bit"
