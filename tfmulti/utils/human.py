"""Numbers as people read them, for the lines tfmulti prints (pure Python).

Counts get their noun in the right number, large numbers thousands
separators, rates and sizes three significant digits in the unit that reads
best, durations hours, minutes and seconds. Only text is made here: JSON
output and metrics.json keep the full-precision numbers.

Example:
    >>> from tfmulti.utils import human
    >>> human.count(1, "replica"), human.count(4, "replica"), human.count(2048, "example")
    ('1 replica', '4 replicas', '2,048 examples')
    >>> human.rate(25655.8623, "examples/s")
    '25,656 examples/s'
    >>> human.size(23.5 * 2**30), human.size(512 * 1024), human.size(1632000)
    ('23.5 GiB', '512 KiB', '1.56 MiB')
    >>> human.duration(0.01234), human.duration(42.3), human.duration(3725)
    ('12.3 ms', '42.3 s', '1 h 02 min')
"""

from __future__ import annotations

import math
import numbers

__all__ = ["count", "duration", "number", "rate", "size"]

_IRREGULAR = {"batch": "batches", "process": "processes", "index": "indexes",
              "entry": "entries", "copy": "copies", "child": "children"}
_SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def number(value: float) -> str:
    """A number with three significant digits, more where the integer part
    needs them, thousands separated by commas; integers exactly.

    Example:
        >>> [number(v) for v in (25655.8623, 1234567, 42.345, 3.14159, 0.0123, 0, -1500.4)]
        ['25,656', '1,234,567', '42.3', '3.14', '0.0123', '0', '-1,500']
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100 or value == 0:
        return f"{value:,.0f}"
    digits = 2 - math.floor(math.log10(abs(value)))  # decimals for 3 significant digits
    digits = max(0, digits)
    text = f"{value:.{digits}f}"
    if abs(float(text)) >= 100:  # 99.96 rounded up to 100.0
        return f"{value:,.0f}"
    return text


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and its noun, singular for exactly one: '1 replica', '2 replicas'.

    Example:
        >>> count(1, "worker"), count(0, "worker"), count(3, "batch"), count(2, "axis", "axes")
        ('1 worker', '0 workers', '3 batches', '2 axes')
    """
    if n == 1:
        return f"1 {noun}"
    if plural is None:
        plural = _IRREGULAR.get(noun, noun + "s")
    return f"{number(n)} {plural}"


def rate(value: float, unit: str) -> str:
    """A rate with its unit: '25,656 examples/s', '12.5 steps/s'.

    Example:
        >>> rate(12.5, "steps/s"), rate(1e6 / 3, "examples/s")
        ('12.5 steps/s', '333,333 examples/s')
    """
    return f"{number(value)} {unit}"


def size(num_bytes: float) -> str:
    """Bytes in the binary unit that keeps the number between 1 and 1024,
    three significant digits: '512 B', '20.5 KiB', '1.56 MiB', '23.5 GiB'.

    Example:
        >>> [size(b) for b in (0, 1, 1000, 1536, 2**20 - 1, 10 * 2**30, 3 * 2**50 * 1024)]
        ['0 B', '1 B', '1,000 B', '1.50 KiB', '1.00 MiB', '10.0 GiB', '3,072 PiB']
    """
    value = float(num_bytes)
    for unit in _SIZE_UNITS:
        if abs(value) < 1023.5 or unit == _SIZE_UNITS[-1]:  # not '1,024 KiB'
            break
        value /= 1024
    if unit == "B":
        return f"{round(value):,} B"
    if abs(value) >= 100:
        return f"{value:,.0f} {unit}"
    return f"{value:.{2 if abs(value) < 10 else 1}f} {unit}"


def duration(seconds: float) -> str:
    """A duration: milliseconds under a second, seconds under a minute, then
    minutes and seconds, hours and minutes: '350 ms', '4.20 s', '3 min 12 s',
    '2 h 05 min'.

    Example:
        >>> [duration(s) for s in (0.35, 4.2, 59.96, 192, 7500, 100000)]
        ['350 ms', '4.20 s', '1 min 00 s', '3 min 12 s', '2 h 05 min', '27 h 47 min']
    """
    seconds = float(seconds)
    if not math.isfinite(seconds):
        return f"{seconds} s"
    if abs(seconds) < 0.9995:  # not '1,000 ms'
        return f"{number(seconds * 1e3)} ms"
    if abs(seconds) < 59.95:
        return f"{seconds:.{2 if abs(seconds) < 10 else 1}f} s"
    total = round(seconds)
    if total < 3600:
        return f"{total // 60} min {total % 60:02d} s"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min"
