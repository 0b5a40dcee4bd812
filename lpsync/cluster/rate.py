"""Link rates as tc writes them: 1gbit, 100mbit, 500kbit; 10mbps is bytes (tc's meaning)."""

from __future__ import annotations

import re

from lpsync.errors import InvalidArgumentError

# tc(8): "bit" units count bits, "bps" units count bytes; prefixes are decimal.
_BITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}


def parse_rate(text: str) -> int:
    """Bits per second; InvalidArgumentError for anything tc would not read the same way."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _BITS:
        raise InvalidArgumentError(
            f"cannot read link rate {text!r}; write it as tc does: 1gbit, 100mbit, 500kbit"
        )
    bits = int(float(match.group(1)) * _BITS[unit])
    if bits < 8000:
        raise InvalidArgumentError(f"link rate {text!r} is below 8kbit; tbf cannot shape that")
    return bits


def format_rate(bits: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale and bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"


def parse_delay(text: str) -> float:
    """Seconds from 5ms, 100us, 0.2s."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(s|ms|us)\s*", text)
    if not match:
        raise InvalidArgumentError(f"cannot read delay {text!r}; write 5ms, 100us or 0.2s")
    return float(match.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[match.group(2)]
