"""Pipeline schedules as tables: GPipe and 1F1B, their bubble and memory.

A schedule is a table of ticks x stages: `table[t][s]` is what stage `s`
works on at tick `t`: `("F", m)`, the forward of micro-batch `m`; `("B", m)`,
its backward; or `None`, idle (the pipeline "bubble"). Every forward and
every backward takes one tick on every stage (equal stage times, backward as
long as forward), the assumption behind the textbook bubble
`(S - 1) / (M + S - 1)`.

Both schedules come from one small simulator: each stage has a fixed order of
work and, at every tick, does its next item if that item's inputs are ready
(finished at an earlier tick):

* `("F", m)` on stage s needs `("F", m)` on stage s - 1;
* `("B", m)` on stage s needs `("B", m)` on stage s + 1 (the gradient of its
  output) and `("F", m)` on stage s (its saved activations).

GPipe (Huang et al. 2019; what `PipelineModel` runs) does all M forwards,
then all M backwards, so every stage keeps the activations of all M
micro-batches. 1F1B (PipeDream-flush, Narayanan et al. 2021) does S - 1 - s
warm-up forwards on stage s, then alternates one forward and one backward,
then drains the remaining backwards: the same number of ticks, but stage s
keeps at most S - s micro-batches' activations.

Pure Python; matplotlib is imported only by `plot`.

Example:
    >>> from tfmulti.parallel import schedule
    >>> print(schedule.format_table(schedule.gpipe(2, 3)))
    stage 0  F0 F1 F2 .  .  B0 B1 B2
    stage 1  .  F0 F1 F2 B0 B1 B2 .
    >>> schedule.bubble_fraction(2, 3), schedule.measured_bubble(schedule.gpipe(2, 3))
    (0.25, 0.25)
    >>> schedule.max_in_flight(schedule.gpipe(4, 8)), schedule.max_in_flight(
    ...     schedule.one_f_one_b(4, 8))
    ([8, 8, 8, 8], [4, 3, 2, 1])
"""

from __future__ import annotations


from tfmulti.utils import checks

__all__ = ["bubble_fraction", "format_table", "gpipe", "max_in_flight", "measured_bubble",
           "one_f_one_b", "plot"]

FORWARD = "F"
BACKWARD = "B"
FORWARD_COLOR = "#4C72B0"
BACKWARD_COLOR = "#DD8452"
IDLE_COLOR = "#EEEEEE"


def _check_positive(name: str, value) -> int:
    return checks.positive_int(name, value, hint=f"pass e.g. {name}=4")


def _simulate(orders: list[list[tuple[str, int]]]) -> list[list[tuple[str, int] | None]]:
    """Runs each stage's work list in order, one item per tick, as soon as
    the item's inputs finished at an earlier tick (see the module docstring)."""
    num_stages = len(orders)
    done: dict[tuple[str, int, int], int] = {}  # (kind, micro-batch, stage) -> tick
    position = [0] * num_stages
    table = []
    total = sum(len(order) for order in orders)
    while len(done) < total:
        tick = len(table)
        row: list[tuple[str, int] | None] = [None] * num_stages
        for s, order in enumerate(orders):
            if position[s] == len(order):
                continue
            kind, m = order[position[s]]
            if kind == FORWARD:
                needs = [(FORWARD, m, s - 1)] if s > 0 else []
            else:
                needs = [(FORWARD, m, s)]
                if s < num_stages - 1:
                    needs.append((BACKWARD, m, s + 1))
            if all(done.get(key, tick) < tick for key in needs):
                row[s] = (kind, m)
        if not any(row):
            raise RuntimeError(f"the stage orders deadlock at tick {tick}: {orders}")
        for s, slot in enumerate(row):
            if slot is not None:
                done[(slot[0], slot[1], s)] = tick
                position[s] += 1
        table.append(row)
    return table


def gpipe(num_stages: int, num_microbatches: int) -> list[list[tuple[str, int] | None]]:
    """The GPipe schedule: all forwards flow through the pipeline, then all
    backwards flow back.

    Stage s does the forward of micro-batch m at tick `s + m` and its backward
    at tick `T_f + (S - 1 - s) + m`, where `T_f = M + S - 1` is when the last
    stage finishes its forwards; in all `2 * (M + S - 1)` ticks.

    Args:
        num_stages: S, pipeline stages (devices).
        num_microbatches: M, micro-batches per batch.

    Returns:
        The table: one row per tick, one entry per stage.

    Raises:
        ValueError: either argument is not a positive integer.
    """
    S = _check_positive("num_stages", num_stages)
    M = _check_positive("num_microbatches", num_microbatches)
    order = [(FORWARD, m) for m in range(M)] + [(BACKWARD, m) for m in range(M)]
    return _simulate([list(order) for _ in range(S)])


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[tuple[str, int] | None]]:
    """The 1F1B (PipeDream-flush) schedule.

    Stage s runs `min(S - 1 - s, M)` warm-up forwards, then alternates one
    forward and one backward (oldest micro-batch first) while forwards remain,
    then the remaining backwards (cool-down). Under equal times it takes as
    many ticks as GPipe, but stage s holds at most `S - s` micro-batches'
    activations instead of M.

    Args:
        num_stages: S, pipeline stages (devices).
        num_microbatches: M, micro-batches per batch.

    Returns:
        The table: one row per tick, one entry per stage.

    Raises:
        ValueError: either argument is not a positive integer.
    """
    S = _check_positive("num_stages", num_stages)
    M = _check_positive("num_microbatches", num_microbatches)
    orders = []
    for s in range(S):
        warmup = min(S - 1 - s, M)
        order = [(FORWARD, m) for m in range(warmup)]
        for i in range(M - warmup):
            order += [(FORWARD, warmup + i), (BACKWARD, i)]
        order += [(BACKWARD, m) for m in range(M - warmup, M)]
        orders.append(order)
    return _simulate(orders)


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle share of a GPipe (or 1F1B) step with equal stage times:
    `(S - 1) / (M + S - 1)`.

    Raises:
        ValueError: either argument is not a positive integer.
    """
    S = _check_positive("num_stages", num_stages)
    M = _check_positive("num_microbatches", num_microbatches)
    return (S - 1) / (M + S - 1)


def _check_table(table) -> list[list]:
    rows = list(table) if not isinstance(table, (str, bytes)) else []
    if not rows or not all(isinstance(r, (list, tuple)) and r for r in rows):
        raise ValueError("`table` must be a non-empty list of ticks, each a non-empty "
                         "list of stage slots, e.g. schedule.gpipe(2, 4).")
    width = len(rows[0])
    for t, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"tick {t} of `table` has {len(row)} stages, tick 0 has "
                             f"{width}; every tick needs one slot per stage.")
        for slot in row:
            if slot is not None and (not isinstance(slot, tuple) or len(slot) != 2
                                     or slot[0] not in (FORWARD, BACKWARD)):
                raise ValueError(f"tick {t} of `table` holds {slot!r}; a slot is "
                                 "('F', m), ('B', m) or None.")
    return rows


def measured_bubble(table) -> float:
    """Idle slots / all slots between the first and the last busy tick.

    Raises:
        ValueError: `table` is not a schedule table or has no busy slot.
    """
    rows = _check_table(table)
    busy_ticks = [t for t, row in enumerate(rows) if any(slot is not None for slot in row)]
    if not busy_ticks:
        raise ValueError("`table` has no busy slot, so it has no bubble to measure.")
    span = rows[busy_ticks[0]:busy_ticks[-1] + 1]
    slots = len(span) * len(rows[0])
    idle = sum(slot is None for row in span for slot in row)
    return idle / slots


def max_in_flight(table) -> list[int]:
    """Per stage, the most micro-batches whose forward is done and whose
    backward is not: how many micro-batches' activations the stage keeps at
    once (GPipe: M; 1F1B: at most S - s).

    Raises:
        ValueError: `table` is not a schedule table.
    """
    rows = _check_table(table)
    peaks = []
    for s in range(len(rows[0])):
        current = peak = 0
        for row in rows:
            slot = row[s]
            if slot is not None:
                current += 1 if slot[0] == FORWARD else -1
                peak = max(peak, current)
        peaks.append(peak)
    return peaks


def format_table(table) -> str:
    """The table as text: one line per stage, one column per tick, "F3" for
    the forward of micro-batch 3, "B3" for its backward, "." for idle.

    Raises:
        ValueError: `table` is not a schedule table.
    """
    rows = _check_table(table)
    cells = [[f"{slot[0]}{slot[1]}" if slot else "." for slot in row] for row in rows]
    width = max(len(c) for row in cells for c in row)
    label = len(f"stage {len(rows[0]) - 1}")
    lines = []
    for s in range(len(rows[0])):
        line = " ".join(row[s].ljust(width) for row in cells).rstrip()
        lines.append(f"{f'stage {s}'.ljust(label)}  {line}")
    return "\n".join(lines)


def plot(table, ax=None, title: str | None = None):
    """A Gantt chart of `table`: x is the tick, y the stage (stage 0 on top);
    forwards and backwards in two colours, each box labelled with its
    micro-batch; idle slots inside the step shaded grey (the bubble).

    Args:
        table: a schedule table, e.g. `gpipe(2, 4)`.
        ax: matplotlib axes to draw on; default: a new figure's.
        title: axes title; default none.

    Returns:
        The matplotlib axes.

    Raises:
        ValueError: `table` is not a schedule table.
    """
    rows = _check_table(table)
    import matplotlib.patches as mpatches
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    num_stages = len(rows[0])
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 0.45 * len(rows) + 1.5),
                                      0.5 * num_stages + 1.2))
    for t, row in enumerate(rows):
        for s, slot in enumerate(row):
            if slot is None:
                ax.add_patch(mpatches.Rectangle((t, s - 0.4), 1, 0.8, facecolor=IDLE_COLOR,
                                                edgecolor="none"))
                continue
            kind, m = slot
            color = FORWARD_COLOR if kind == FORWARD else BACKWARD_COLOR
            ax.add_patch(mpatches.Rectangle((t, s - 0.4), 1, 0.8, facecolor=color,
                                            edgecolor="white", linewidth=1))
            ax.text(t + 0.5, s, str(m), ha="center", va="center", color="white",
                    fontsize=9, fontweight="bold")
    ax.set_xlim(0, len(rows))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(num_stages - 0.5, -0.5)  # stage 0 on top
    ax.set_yticks(range(num_stages))
    ax.set_yticklabels([f"stage {s}" for s in range(num_stages)])
    ax.set_xlabel("tick (one forward or backward of one micro-batch)")
    ax.legend(handles=[mpatches.Patch(color=FORWARD_COLOR, label="forward"),
                       mpatches.Patch(color=BACKWARD_COLOR, label="backward"),
                       mpatches.Patch(color=IDLE_COLOR, label="idle (bubble)")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title is not None:
        ax.set_title(title)
    return ax
