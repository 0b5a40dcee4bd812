"""Byte sizes as people write them: 64MiB, 1GiB, 4k, 1e6; ranges 4:256MiB double."""

from __future__ import annotations

import re

from lpsync.errors import InvalidArgumentError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise InvalidArgumentError(f"cannot read {text!r} as a size (try 64MiB, 1GiB, 4096)")
    try:
        value = float(match.group(1)) * _UNITS[unit]
    except ValueError:
        raise InvalidArgumentError(f"cannot read {text!r} as a size") from None
    if value < 0 or value != int(value):
        raise InvalidArgumentError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """A comma list of sizes; each item may be a range LOW:HIGH, stepped by doubling."""
    sizes: list[int] = []
    for item in text.split(","):
        if ":" in item:
            low_text, high_text = item.split(":", 1)
            low, high = parse_size(low_text), parse_size(high_text)
            if low <= 0 or high < low:
                raise InvalidArgumentError(f"range {item!r} must satisfy 0 < low <= high")
            while low <= high:
                sizes.append(low)
                low *= 2
        else:
            sizes.append(parse_size(item))
    return sizes


def parse_ints(text: str, name: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgumentError(f"{name} must be a comma list of integers, got {text!r}") from None


def format_size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{int(nbytes // scale)}{unit}"
    return f"{int(nbytes)}B"
