"""Size arguments: "64MiB", "4:256MiB" (doubling from 4 B to 256 MiB), "1K,1M"."""

from __future__ import annotations

import re

from lpsync.errors import InvalidArgumentError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidArgumentError(f"cannot read size {text!r} (examples: 4, 64KiB, 256MiB)")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def parse_sizes(text: str) -> list[int]:
    sizes: list[int] = []
    for part in text.split(","):
        if ":" in part:
            lo, hi = (parse_size(p) for p in part.split(":", 1))
            if lo <= 0 or hi < lo:
                raise InvalidArgumentError(f"bad size range {part!r}")
            size = lo
            while size <= hi:
                sizes.append(size)
                size *= 2
        else:
            sizes.append(parse_size(part))
    return sizes


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"
