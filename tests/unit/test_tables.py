"""tfmulti.utils.tables: the one text-table renderer and the byte formats."""

from __future__ import annotations

import pytest

from tfmulti.utils.tables import format_table, human_bytes, key_values, mib


def test_columns_right_aligned_two_spaces_apart():
    text = format_table(["device", "parameters"], [["CPU:0", "1.00 MiB"], ["CPU:10", "0 B"]])
    assert text.splitlines() == [
        "device  parameters",
        " CPU:0    1.00 MiB",
        "CPU:10         0 B",
    ]


def test_left_columns_indent_and_no_trailing_spaces():
    text = format_table(["name", "n", "note"], [["a", 1, "x"], ["longer", 22, ""]], left=(0, 2),
                        indent="  ")
    assert text.splitlines() == [
        "  name     n  note",
        "  a        1  x",
        "  longer  22",  # an empty last cell leaves no trailing spaces
    ]
    assert all(line == line.rstrip() for line in text.splitlines())


def test_cells_are_made_text_with_str():
    text = format_table(["a", "b"], [[None, 1.5], [True, [1, 2]]])
    assert text.splitlines() == ["   a       b", "None     1.5", "True  [1, 2]"]


def test_a_header_alone():
    assert format_table(["device", "total"], []) == "device  total"


def test_rows_align_with_their_header():
    rows = [[f"CPU:{i}", i * 1000, "x" * i] for i in range(1, 7)]
    lines = format_table(["device", "bytes", "bar"], rows).splitlines()
    assert len(lines) == 7 and len({len(line) for line in lines[1:]}) == 1


def test_key_values():
    text = key_values([("device", "CPU:0"), ("replicas", 4), ("x", None)], indent="> ")
    assert text.splitlines() == ["> device    CPU:0", "> replicas  4", "> x         None"]
    assert key_values([]) == ""


@pytest.mark.parametrize("num_bytes, expected", [
    (0, "0.00 MiB"), (2**20, "1.00 MiB"), (1.5 * 2**20, "1.50 MiB"), (2**30, "1024.00 MiB"),
    (5000, "0.00 MiB"), (-(2**21), "-2.00 MiB"),
])
def test_mib(num_bytes, expected):
    assert mib(num_bytes) == expected


@pytest.mark.parametrize("num_bytes, expected", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1023.7, "1023 B"), (1024, "1.0 KiB"),
    (1536, "1.5 KiB"), (1.5 * 2**20, "1.5 MiB"), (2**30, "1.0 GiB"), (3 * 2**40, "3.0 TiB"),
    (2**50, "1024.0 TiB"),  # TiB is the largest unit
    (-2048, "-2.0 KiB"),
])
def test_human_bytes(num_bytes, expected):
    assert human_bytes(num_bytes) == expected
