"""Tests for tfmulti.parallel.schedule: validity of GPipe and 1F1B, bubble,
activation memory, text and plot rendering."""

from __future__ import annotations

import itertools

import pytest

from tfmulti.parallel import schedule

SIZES = list(itertools.product(range(1, 5), range(1, 9)))  # (S, M)
SCHEDULES = {"gpipe": schedule.gpipe, "1f1b": schedule.one_f_one_b}


def check_schedule(table, num_stages: int, num_microbatches: int) -> None:
    """Fails unless `table` is a valid pipeline schedule: one slot per stage per
    tick, every (F, m) and (B, m) exactly once per stage, F after the previous
    stage's F, B after the next stage's B and after the same stage's F."""
    assert table, "empty table"
    assert all(len(row) == num_stages for row in table)
    when: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(table):
        for s, slot in enumerate(row):
            if slot is None:
                continue
            kind, m = slot
            assert kind in ("F", "B") and 0 <= m < num_microbatches, slot
            assert (kind, m, s) not in when, f"{slot} twice on stage {s}"
            when[(kind, m, s)] = t
    expected = {(k, m, s) for k in "FB" for m in range(num_microbatches)
                for s in range(num_stages)}
    assert set(when) == expected, f"missing {sorted(expected - set(when))}"
    for m, s in itertools.product(range(num_microbatches), range(num_stages)):
        if s > 0:
            assert when[("F", m, s)] > when[("F", m, s - 1)], f"F{m} on stage {s} too early"
        if s < num_stages - 1:
            assert when[("B", m, s)] > when[("B", m, s + 1)], f"B{m} on stage {s} too early"
        assert when[("B", m, s)] > when[("F", m, s)], f"B{m} before F{m} on stage {s}"


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("num_stages,num_microbatches", SIZES)
def test_schedules_are_valid(name, num_stages, num_microbatches):
    check_schedule(SCHEDULES[name](num_stages, num_microbatches), num_stages, num_microbatches)


def test_checker_rejects_a_broken_schedule():
    table = schedule.gpipe(2, 2)
    table[1][1], table[2][1] = table[2][1], table[1][1]  # F1 on stage 1 before F0
    with pytest.raises(AssertionError):
        check_schedule(table, 2, 2)
    with pytest.raises(AssertionError):
        check_schedule(schedule.gpipe(2, 2)[:-1], 2, 2)  # last backward missing


@pytest.mark.parametrize("num_stages,num_microbatches", SIZES)
def test_gpipe_closed_form(num_stages, num_microbatches):
    S, M = num_stages, num_microbatches
    table = schedule.gpipe(S, M)
    assert len(table) == 2 * (M + S - 1)
    t_f = M + S - 1
    for s, m in itertools.product(range(S), range(M)):
        assert table[s + m][s] == ("F", m)
        assert table[t_f + (S - 1 - s) + m][s] == ("B", m)
    assert schedule.measured_bubble(table) == pytest.approx(schedule.bubble_fraction(S, M))
    assert schedule.max_in_flight(table) == [M] * S


@pytest.mark.parametrize("num_stages,num_microbatches", SIZES)
def test_one_f_one_b_same_time_less_memory(num_stages, num_microbatches):
    S, M = num_stages, num_microbatches
    table = schedule.one_f_one_b(S, M)
    assert len(table) == len(schedule.gpipe(S, M))
    in_flight = schedule.max_in_flight(table)
    assert all(in_flight[s] <= S - s for s in range(S)), in_flight
    assert in_flight == [min(S - s, M) for s in range(S)]
    assert schedule.measured_bubble(table) == pytest.approx(schedule.bubble_fraction(S, M))


def test_one_f_one_b_steady_state_alternates():
    assert schedule.format_table(schedule.one_f_one_b(2, 4)).splitlines() == [
        "stage 0  F0 F1 .  B0 F2 B1 F3 B2 .  B3",
        "stage 1  .  F0 B0 F1 B1 F2 B2 F3 B3 .",
    ]


def test_bubble_fraction_values():
    assert schedule.bubble_fraction(1, 5) == 0.0
    assert schedule.bubble_fraction(2, 1) == 0.5
    assert schedule.bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_measured_bubble_ignores_idle_ticks_outside_the_step():
    table = [[None, None]] + schedule.gpipe(2, 1) + [[None, None]]
    assert schedule.measured_bubble(table) == 0.5


@pytest.mark.parametrize("fn", [schedule.gpipe, schedule.one_f_one_b, schedule.bubble_fraction])
@pytest.mark.parametrize("args,name", [
    ((0, 4), "num_stages"), ((2, 0), "num_microbatches"), ((-1, 4), "num_stages"),
    ((2.0, 4), "num_stages"), ((2, "4"), "num_microbatches"), ((True, 4), "num_stages"),
])
def test_bad_sizes_raise(fn, args, name):
    with pytest.raises(ValueError, match=f"`{name}` must be a positive integer"):
        fn(*args)


@pytest.mark.parametrize("table,match", [
    ([], "non-empty list"),
    ([[("F", 0)], [("F", 0), None]], "tick 1 of `table` has 2 stages"),
    ([[("X", 0)]], "holds"),
    ([[None], [None]], "no busy slot"),
])
def test_bad_tables_raise(table, match):
    with pytest.raises(ValueError, match=match):
        schedule.measured_bubble(table)


def test_format_table():
    text = schedule.format_table(schedule.gpipe(2, 2))
    assert "F0" in text and "B1" in text
    assert text.splitlines() == ["stage 0  F0 F1 .  .  B0 B1", "stage 1  .  F0 F1 B0 B1 ."]


def test_plot_returns_axes_with_patches():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = schedule.gpipe(2, 4)
    ax = schedule.plot(table, title="GPipe")
    try:
        assert ax.get_title() == "GPipe"
        assert len(ax.patches) == len(table) * 2  # one box per slot, idle included
        labels = sorted(t.get_text() for t in ax.texts)
        assert labels == sorted(str(m) for m in range(4) for _ in range(4))  # F and B x 2
        _, given = plt.subplots()
        assert schedule.plot(table, ax=given) is given
    finally:
        plt.close("all")
