"""Where a training step's time goes: the measurements behind `tfmulti diagnose`.

Three timings of the same training step, each in seconds per step:

* `time_input`: the input pipeline alone: batches pulled onto the devices
  inside a `tf.function`, nothing computed;
* `time_compute`: the train step alone (`model.train_step` under
  `strategy.run`), many steps per call on one batch already on the devices:
  no input, no Python between steps;
* `time_fit`: both together, through Keras `fit` as a user runs it
  (its per-call overhead, callbacks and metrics included).

With prefetch-to-device streaming, `time_fit` approaches
max(`time_input`, `time_compute`) instead of their sum; what is left beyond
that is per-step overhead. `StepTimes` splits a step accordingly and names its
bottleneck. `Measurements` keeps the repeats of the three timings and says when
they cannot all be true (a part longer than the whole, repeats spread too
wide: the machine's load changed while they ran); `measure_until_consistent`
measures again, a bounded number of times. `tfmulti diagnose`, the benchmark
suites (`benchmarks`) and notebook 04 use these functions.

Timings are wall-clock: on a shared machine, run them when it is otherwise idle.

Example:
    >>> import tfmulti
    >>> from tfmulti import data
    >>> from tfmulti.models import builders as models
    >>> from tfmulti.insight import timing
    >>> strategy = tfmulti.get_strategy("one_device")
    >>> train = data.distribute(data.load("synthetic", num_examples=2048), strategy, 64)
    >>> model = models.build_model("mlp", strategy=strategy)
    >>> _ = models.compile_model(model, task="classification", strategy=strategy,
    ...                          steps_per_execution=8)
    >>> fit_s = timing.time_fit(model, train, steps=16)  # also builds the model
    >>> compute_s, = timing.time_compute(model, strategy, train, min_seconds=0.1)
    >>> input_s = timing.time_input(train, min_seconds=0.1)
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import statistics
import time
from typing import Callable

import keras
import tensorflow as tf

from tfmulti.data import DistributedInput

__all__ = ["BOTTLENECKS", "EXTRA_ROUNDS", "EpochClock", "Measurements", "PART_TOLERANCE",
           "SPREAD_LIMIT", "StepTimes", "call_times", "call_times_interleaved", "compute_call",
           "device_batch", "fixed_step_cost", "input_call", "measure_until_consistent",
           "plot_step_times", "pyplot", "seconds_per_call", "seconds_per_call_interleaved",
           "steps_for", "time_compute", "time_fit", "time_input", "time_input_repeats"]


def call_times(fn: Callable[[], object], min_seconds: float = 0.5, min_calls: int = 3,
               warmup_calls: int = 1) -> list[float]:
    """Wall time of each call of `fn()`, called for at least `min_seconds` and
    `min_calls` calls.

    `fn` must block until its work is done (return a NumPy value, not a
    pending tensor). The first `warmup_calls` calls (tracing) are not timed.
    """
    return call_times_interleaved([fn], min_seconds, min_calls, warmup_calls)[0]


def call_times_interleaved(fns: list, min_seconds: float = 0.5, min_calls: int = 3,
                           warmup_calls: int = 1) -> list[list[float]]:
    """`call_times` of several functions, called in turn (a, b, a, b, ...) so that
    a machine's drift hits them alike; one list of wall times per function."""
    for fn in fns:
        for _ in range(warmup_calls):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < min_calls or time.perf_counter() - start < min_seconds:
        for fn, out in zip(fns, times):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return times


def seconds_per_call(fn: Callable[[], object], min_seconds: float = 0.5,
                     min_calls: int = 3, warmup_calls: int = 1) -> float:
    """Median wall time of `fn()` over calls made for at least `min_seconds`
    (see `call_times`)."""
    return statistics.median(call_times(fn, min_seconds, min_calls, warmup_calls))


def seconds_per_call_interleaved(fns: list, min_seconds: float = 0.5, min_calls: int = 3,
                                 warmup_calls: int = 1) -> list[float]:
    """`seconds_per_call` of several functions, called in turn (a, b, a, b, ...) so
    that a machine's drift hits them alike; one median per function."""
    return [statistics.median(t)
            for t in call_times_interleaved(fns, min_seconds, min_calls, warmup_calls)]


def steps_for(min_seconds: float, estimate_s: float, multiple: int, lo: int = 4,
              hi: int = 2000) -> int:
    """A step count, a multiple of `multiple` (steps per execution), that takes
    about `min_seconds` at `estimate_s` seconds per step."""
    steps = int(min(max(min_seconds / max(estimate_s, 1e-6), lo), hi))
    return max(multiple, -(-steps // multiple) * multiple)


def input_call(dist_input: DistributedInput, steps_per_execution: int = 20) -> Callable[[], None]:
    """A function that pulls `steps_per_execution` batches of `dist_input` onto the
    devices per call (in a `tf.function`, computing nothing) and returns when
    they are there. It holds one iterator: the first call also waits for the
    pipeline's start (shuffle buffer, first batches)."""
    iterator = iter(dist_input.dataset)

    @tf.function
    def pull(it):
        for _ in tf.range(steps_per_execution):
            # Stateful: runs although the values are not used.
            next(it)
        return tf.constant(0)

    return lambda: pull(iterator).numpy()


def time_input_repeats(dist_input: DistributedInput, steps_per_execution: int = 20,
                       min_seconds: float = 0.5) -> list[float]:
    """Seconds per step of the input pipeline alone (see `input_call`), one
    figure per timed call.

    The first call (the pipeline's start) is not timed; a cache still being
    filled is timed, as in a first epoch. The iterator is released before
    returning, so its pipeline stops working in the background.
    """
    pull = input_call(dist_input, steps_per_execution)
    seconds = [s / steps_per_execution for s in call_times(pull, min_seconds)]
    del pull
    gc.collect()
    return seconds


def time_input(dist_input: DistributedInput, steps_per_execution: int = 20,
               min_seconds: float = 0.5) -> float:
    """Seconds per step of the input pipeline alone: the median of
    `time_input_repeats`."""
    return statistics.median(time_input_repeats(dist_input, steps_per_execution, min_seconds))


def device_batch(strategy: tf.distribute.Strategy, dist_input: DistributedInput,
                 batch_scale: float = 1.0):
    """One batch of `dist_input`, copied onto the replicas' devices to stay there
    (a `PerReplica` value, or plain tensors with one replica).

    `batch_scale` > 1 repeats each replica's batch that many times (an
    integer), < 1 keeps that fraction of it (at least one example): the same
    step on another batch size without another input pipeline.
    """
    batch = next(iter(dist_input.dataset))
    replicas = strategy.num_replicas_in_sync
    local = [tf.nest.map_structure(lambda v, i=i: strategy.experimental_local_results(v)[i],
                                   batch) for i in range(replicas)]
    devices = list(strategy.extended.worker_devices)

    def rescale(t):
        if batch_scale >= 1:
            return tf.concat([t] * int(batch_scale), axis=0)
        return t[:max(1, round(int(t.shape[0]) * batch_scale))]

    def value_fn(ctx):
        i = ctx.replica_id_in_sync_group
        with tf.device(devices[i]):
            return tf.nest.map_structure(lambda t: tf.identity(rescale(t)), local[i])

    return strategy.experimental_distribute_values_from_function(value_fn)


def compute_call(model: keras.Model, strategy: tf.distribute.Strategy,
                 dist_input: DistributedInput, steps_per_execution: int = 20,
                 batch_scale: float = 1.0) -> Callable[[], None]:
    """A function that runs `steps_per_execution` training steps per call on one batch
    of `dist_input` kept on the devices (resized by `batch_scale`, see
    `device_batch`), and returns when they are done.

    Each step is `model.train_step` (forward, loss, gradients, all-reduce,
    optimizer, metrics: what `fit` runs per step) under `strategy.run`,
    compiled with XLA where the model's `jit_compile` is on (as `fit` does),
    in a `tf.range` loop: no input and no Python between steps. The model must
    have trained at least one step (`fit` builds the optimizer and metrics;
    `time_fit` does); its weights change.
    """
    if not model.optimizer or not model.optimizer.built:
        raise RuntimeError("time_compute needs a model that has trained at least one step "
                           "(its optimizer and metrics built); call time_fit or model.fit "
                           "first.")

    def one_step(batch):
        return strategy.run(model.train_step, args=(batch,))

    if model.jit_compile:  # as `fit` compiles it: XLA changes the step's time
        one_step = tf.function(one_step, jit_compile=True)

    @tf.function
    def steps(batch):
        for _ in tf.range(steps_per_execution):
            one_step(batch)
        return tf.constant(0)

    batch = device_batch(strategy, dist_input, batch_scale)
    return lambda: steps(batch).numpy()


def time_compute(model: keras.Model, strategy: tf.distribute.Strategy,
                 dist_input: DistributedInput, steps_per_execution: int = 20,
                 min_seconds: float = 0.5, batch_scales: tuple = (1,)) -> list[float]:
    """Seconds per training step on data already on the devices, one figure per
    batch scale (the scales timed in turn; see `compute_call`)."""
    calls = [compute_call(model, strategy, dist_input, steps_per_execution, scale)
             for scale in batch_scales]
    return [s / steps_per_execution for s in seconds_per_call_interleaved(calls, min_seconds)]


def fixed_step_cost(compute_s: float, scaled_s: float, batch_scale: float) -> float:
    """The part of a step's time that does not grow with the batch, from its time
    at two batch sizes (`compute_s` at the batch, `scaled_s` at `batch_scale`
    times it), assuming time = fixed + batch x per-example."""
    per_batch = (scaled_s - compute_s) / (batch_scale - 1)
    return min(compute_s, max(0.0, compute_s - per_batch))


class EpochClock(keras.callbacks.Callback):
    """Wall time of each epoch, from the end of the previous one (so `fit`'s own
    work between epochs counts) to the end of this one.

    `between_epochs` runs after each epoch, outside the timed spans; a
    subclass overrides it to interleave other work with the epochs.
    """

    def __init__(self):
        super().__init__()
        self.seconds: list[float] = []
        self._mark = None

    def between_epochs(self) -> None:
        """Work to run after each epoch, untimed (nothing by default)."""

    def on_epoch_begin(self, epoch, logs=None):
        if self._mark is None:
            self._mark = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._mark)
        self.between_epochs()
        self._mark = time.perf_counter()


def time_fit(model: keras.Model, dist_input: DistributedInput, steps: int,
             epochs: int = 2, clock: EpochClock | None = None) -> list[float]:
    """Seconds per step of `model.fit` on `dist_input`, one figure per epoch.

    Trains `epochs` epochs of `steps` steps (a multiple of the model's
    `steps_per_execution`); the first epoch traces and warms up. `clock`
    (an `EpochClock`, fresh for each call) times the epochs; a subclass can
    run other work between them.

    Returns:
        Seconds per step of every epoch after the first.
    """
    spe = model.steps_per_execution
    if steps % spe:
        raise ValueError(f"`steps` ({steps}) must be a multiple of the model's "
                         f"steps_per_execution ({spe}).")
    if epochs < 2:
        raise ValueError(f"`epochs` must be at least 2 (the first warms up), got {epochs}.")
    clock = clock or EpochClock()
    model.fit(dist_input.dataset, steps_per_epoch=steps, epochs=epochs, verbose=0,
              callbacks=[clock], shuffle=False)
    gc.collect()  # fit's iterator goes now, and stops its pipeline's background work
    return [s / steps for s in clock.seconds[1:]]


BOTTLENECKS = ("input", "compute", "overhead")


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """The time of one training step, taken apart. All in seconds per step.

    Attributes:
        input_s: the input pipeline alone (`time_input`).
        compute_s: the train step alone on data on the devices (`time_compute`).
        compute_fixed_s: the part of `compute_s` that does not grow with the
            batch (op dispatch, all-reduce latency, the optimizer update),
            from `time_compute` at two batch sizes; 0 if not measured.
        fit_s: both together through `fit` (`time_fit`).

    The step is split into `work_s` (the arithmetic that grows with the
    batch), waiting for input, and `overhead_s`: the fixed per-step cost in
    the graph plus whatever `fit` adds beyond max(input, compute) (Python,
    callbacks and dispatch around each call). The largest of input, work and
    overhead is the bottleneck.
    """

    input_s: float
    compute_s: float
    fit_s: float
    compute_fixed_s: float = 0.0

    @property
    def work_s(self) -> float:
        return max(0.0, self.compute_s - self.compute_fixed_s)

    @property
    def call_overhead_s(self) -> float:
        """What `fit` adds beyond max(input, compute)."""
        return max(0.0, self.fit_s - max(self.input_s, self.compute_s))

    @property
    def overhead_s(self) -> float:
        """Per-step cost independent of the batch: fixed graph cost + call overhead."""
        return min(self.fit_s, self.compute_fixed_s + self.call_overhead_s)

    @property
    def bottleneck(self) -> str:
        """"input", "compute" or "overhead": whichever takes longest per step."""
        times = {"input": self.input_s, "compute": self.work_s, "overhead": self.overhead_s}
        return max(BOTTLENECKS, key=times.get)

    @property
    def utilization(self) -> float:
        """Estimated share of the step the devices spend on per-example arithmetic."""
        return min(1.0, self.work_s / self.fit_s)

    def split(self) -> dict:
        """`fit_s` as compute (work), fixed per-step cost, input wait and call
        overhead; the four add up to `fit_s`."""
        work = min(self.work_s, self.fit_s)
        fixed = min(self.compute_fixed_s, self.fit_s - work)
        wait = min(max(0.0, self.input_s - self.compute_s), self.fit_s - work - fixed)
        return {"compute": work, "fixed_per_step": fixed, "input_wait": wait,
                "call_overhead": self.fit_s - work - fixed - wait}


PART_TOLERANCE = 0.10
"""How much longer than its whole a part may time before the figures do not add
up: timing noise on a quiet machine stays well below it."""
SPREAD_LIMIT = 1.5
"""A timing's repeats agree while the middle half of them (from the lower to the
upper quartile) spreads over at most this factor; beyond it the machine's load
changed while it ran, which matters where the bottleneck changes within the
spread. Quartiles, not the fastest and slowest: one call that found its batches
prefetched, or met a pause, says nothing of the load."""
EXTRA_ROUNDS = 2
"""How many times `measure_until_consistent` measures again, at most."""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


@dataclasses.dataclass(frozen=True)
class Measurements:
    """One round of the timings behind a `StepTimes`, each kept as its repeats
    (seconds per step of each timed call or epoch), so that they can be checked.

    Attributes:
        fit_s: `time_fit`'s figures, one per timed epoch.
        compute_s: the train step alone (`compute_call`), one per timed call.
        input_s: the input pipeline alone (`time_input_repeats`), one per call.
        scaled_s: the train step alone on `batch_scale` times the batch, one
            per call; empty when not measured.
        batch_scale: the batch scale of `scaled_s`.

    Example:
        >>> from tfmulti.insight.timing import Measurements
        >>> m = Measurements(fit_s=(0.0307,), compute_s=(0.056, 0.055, 0.058),
        ...                  input_s=(0.001, 0.001, 0.001))
        >>> m.problems()
        ['the train step alone (56.00 ms) takes longer than the whole step through fit (30.70 ms)']
    """

    fit_s: tuple
    compute_s: tuple
    input_s: tuple
    scaled_s: tuple = ()
    batch_scale: float = 4.0

    def __post_init__(self):
        for name in ("fit_s", "compute_s", "input_s", "scaled_s"):
            values = tuple(float(v) for v in getattr(self, name))
            if not values and name != "scaled_s":
                raise ValueError(f"`{name}` is empty; pass at least one timing.")
            object.__setattr__(self, name, values)

    def step_times(self) -> StepTimes:
        """The medians of the repeats, as a `StepTimes`."""
        return self._step_times(*(statistics.median(v) if v else None for v in (
            self.fit_s, self.compute_s, self.scaled_s, self.input_s)))

    def _step_times(self, fit: float, compute: float, scaled: float | None,
                    input_: float) -> StepTimes:
        fixed = 0.0 if scaled is None else fixed_step_cost(compute, scaled, self.batch_scale)
        return StepTimes(input_, compute, fit, fixed)

    def problems(self) -> list[str]:
        """Why these timings cannot all be true (empty when they add up).

        A part of the step cannot take longer than the whole step through
        `fit`, beyond `PART_TOLERANCE` (else a share exceeds 100% and the
        remainder comes out negative); a larger batch cannot take less time
        than a smaller one (else the cost per example is negative); and
        repeats whose middle half spreads wider than `SPREAD_LIMIT` measured
        the machine's load, not the step, when the bottleneck changes within
        that spread (too wide to tell the parts apart).
        """
        t = self.step_times()
        limit = 1 + PART_TOLERANCE
        found = []
        for name, part in (("the train step alone", t.compute_s),
                           ("the input alone", t.input_s)):
            if part > t.fit_s * limit:
                found.append(f"{name} ({_ms(part)}) takes longer than the whole step through "
                             f"fit ({_ms(t.fit_s)})")
        scaled_name = f"the train step on {self.batch_scale:g} times the batch"
        if self.scaled_s:
            scaled = statistics.median(self.scaled_s)
            small, large = ((t.compute_s, scaled) if self.batch_scale > 1 else
                            (scaled, t.compute_s))
            if small > large * limit:
                found.append(f"{scaled_name} takes {_ms(scaled)}, the step on the batch "
                             f"{_ms(t.compute_s)}: the larger batch is faster")
        spread = self._too_wide(scaled_name)
        return found + ([spread] if spread else [])

    def _too_wide(self, scaled_name: str) -> str | None:
        """The repeats that spread wider than `SPREAD_LIMIT` when, between their
        quartiles, the bottleneck is not one part; None otherwise."""
        names = ("the whole step through fit", "the train step alone", scaled_name,
                 "the input alone")
        repeats = (self.fit_s, self.compute_s, self.scaled_s, self.input_s)
        ranges, wide = [], []
        for name, values in zip(names, repeats):
            if not values:
                ranges.append((None,))
                continue
            low, median, high = (statistics.quantiles(values, n=4, method="inclusive")
                                 if len(values) > 1 else (values[0],) * 3)
            if high > SPREAD_LIMIT * low:
                ranges.append((low, high))
                wide.append(f"{name} from {_ms(low)} to {_ms(high)}")
            else:
                ranges.append((median,))
        if not wide:
            return None
        bottlenecks = {self._step_times(*figures).bottleneck
                       for figures in itertools.product(*ranges)}
        if len(bottlenecks) == 1:
            return None
        return (f"the middle half of the repeats of {' and of '.join(wide)} "
                f"{'spreads' if len(wide) == 1 else 'spread'} too wide to tell the parts "
                f"apart (the bottleneck could be "
                f"{' or '.join(b for b in BOTTLENECKS if b in bottlenecks)})")


def measure_until_consistent(measure: Callable[[], Measurements],
                             extra_rounds: int = EXTRA_ROUNDS,
                             say: Callable[[str], None] | None = None) -> list[Measurements]:
    """Calls `measure()` until its timings add up (no `Measurements.problems`),
    at most `1 + extra_rounds` times.

    Args:
        measure: takes one round of timings.
        extra_rounds: how many times to measure again, at most.
        say: called with a line of text before each new round (e.g. `print`).

    Returns:
        Every round, in order; the last is the first that adds up, or the last
        one taken when none did.
    """
    say = say or (lambda line: None)
    rounds = [measure()]
    while (problems := rounds[-1].problems()) and len(rounds) <= extra_rounds:
        say(f"  the timings do not add up: {problems[0]}; measuring again (round "
            f"{len(rounds) + 1} of {extra_rounds + 1})")
        rounds.append(measure())
    return rounds


SPLIT_COLORS = {"compute": "tab:blue", "fixed_per_step": "tab:purple",
                "input_wait": "tab:orange", "call_overhead": "tab:gray"}
SPLIT_LABELS = {"compute": "compute (grows with batch)", "fixed_per_step": "fixed per step",
                "input_wait": "input, not overlapped", "call_overhead": "per-call overhead"}


def pyplot(headless: bool = False):
    """`matplotlib.pyplot`, or a RuntimeError that says how to install it.

    `headless` selects the Agg backend (files only, no display), for code
    that only saves figures.
    """
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib, which is not installed; run "
                           "`pip install matplotlib` (or install tfmulti[notebooks]).") from e
    if headless:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_step_times(rows: dict, ax=None, title: str | None = None):
    """Stacked bars of `StepTimes.split()` per row label, in ms per step.

    Args:
        rows: label -> `StepTimes`, drawn top to bottom.
        ax: a matplotlib Axes (default: a new figure's).
        title: the Axes title.

    Returns:
        The Axes.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    plt = pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.5))
    for i, times in enumerate(rows.values()):
        left = 0.0
        for key, value in times.split().items():
            ax.barh(i, value * 1e3, left=left, color=SPLIT_COLORS[key],
                    label=SPLIT_LABELS[key] if i == 0 else None)
            left += value * 1e3
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_xlabel("ms per training step")
    ax.legend(loc="best", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax
