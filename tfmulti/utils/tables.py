"""One renderer for every text table tfmulti prints (pure Python).

    >>> from tfmulti.utils.tables import format_table, mib
    >>> print(format_table(["device", "parameters"], [["CPU:0", mib(2**20)], ["CPU:1", mib(0)]]))
    device  parameters
     CPU:0    1.00 MiB
     CPU:1    0.00 MiB
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table", "human_bytes", "key_values", "mib"]


def format_table(header: Sequence[str], rows: Sequence[Sequence], *, left: Sequence[int] = (),
                 indent: str = "") -> str:
    """Rows of cells as aligned columns under `header`, two spaces apart.

    Cells are turned into text with `str`; columns are right-aligned except
    the indexes in `left`.
    """
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [c.ljust(w) if i in left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        lines.append(indent + "  ".join(parts).rstrip())
    return "\n".join(lines)


def key_values(pairs: Sequence[tuple[str, object]], indent: str = "") -> str:
    """`key  value` lines with the keys padded to one width."""
    width = max((len(k) for k, _ in pairs), default=0)
    return "\n".join(f"{indent}{k.ljust(width)}  {v}" for k, v in pairs)


def mib(num_bytes: float) -> str:
    """Bytes as MiB with two decimals: '1.50 MiB'."""
    return f"{num_bytes / 2**20:.2f} MiB"


def human_bytes(num_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: '1.5 MiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
