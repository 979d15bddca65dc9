"""Utilization diagnosis (`tfmulti diagnose`).

For a training configuration, times the input pipeline alone, the train step
alone on data already on the devices, and both together through `fit`; names
the bottleneck (input, compute or per-step overhead), estimates device
utilization, and ranks the changes that help by their measured gain.

Example (2 replicas of 16 examples, one step per call):
    >>> from tfmulti.config.train_config import TrainConfig
    >>> from tfmulti.insight.diagnose import diagnose
    >>> d = diagnose(TrainConfig(
    ...     distribution="mirrored", devices=("CPU:0", "CPU:1"), dataset="synthetic",
    ...     num_examples=4096, global_batch_size=32, steps_per_execution=1),
    ...     seconds=0.2, measure_advice=False)
    >>> d.bottleneck
    'overhead'
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time

from tfmulti.data import service as data_service
from tfmulti.models import sparse_updates
from tfmulti.parallel import zero
from tfmulti.data.loaders import LoaderSource
from tfmulti.utils import checks
from tfmulti.utils import human
from tfmulti.training import run as runs
from tfmulti.runtime import strategy as strategy_lib
from tfmulti.config.train_config import (TrainConfig, resolve_steps_per_execution,
                                         validate_for_diagnose)
from tfmulti.insight import environment, timing

__all__ = ["Advice", "Diagnosis", "MIN_GAIN", "diagnose",
           "onednn_would_help", "profile_fit"]

TARGET_PER_REPLICA_BATCH = 128
MIN_GAIN = 1.05  # a measured change below this is reported as no gain
_PIPELINE_SWITCHES = ("prefetch", "cache")  # diagnose's own switches, not config fields


@dataclasses.dataclass
class Advice:
    """One change, with its gain in examples/s over the diagnosed configuration.

    Attributes:
        change: what to change, in words.
        settings: the `TrainConfig` fields (or `diagnose` switches: prefetch,
            cache) to set and their new values; empty when the change lies
            outside the configuration (then `how` says what to do).
        expected_gain: examples/s after / before; None when it cannot be told here.
        measured: True when `expected_gain` was measured by running the change.
        detail: the figures behind it, and what to watch out for.
        how: the change in words, when `settings` cannot express it.
    """

    change: str
    settings: dict
    expected_gain: float | None
    measured: bool
    detail: str
    how: str = ""

    @property
    def arguments(self) -> str:
        """The change as Python arguments: "global_batch_size=256, steps_per_execution=26"."""
        return ", ".join(f"{k}={v!r}" for k, v in self.settings.items()) or self.how

    @property
    def flags(self) -> str:
        """The change as `tfmulti train` / `tfmulti diagnose` flags."""
        parts = []
        for key, value in self.settings.items():
            if key in _PIPELINE_SWITCHES:
                parts.append(f"drop --no_{key}" if value else f"--no_{key}")
            elif value is True:
                parts.append(f"--{key}")
            else:
                parts.append(f"--{key}={value}")
        return " ".join(parts) or self.how


def _short(device: str) -> str:
    return device.rsplit("device:", 1)[-1]


@dataclasses.dataclass
class Diagnosis:
    """Where one configuration's training time goes (returned by `diagnose`)."""

    config: dict
    strategy: str
    devices: list
    global_batch_size: int
    per_replica_batch_size: int
    steps_per_execution: int
    times: timing.StepTimes
    per_call_overhead_s: float | None
    advice: list
    notes: list
    elapsed_s: float
    profile_dir: str | None = None
    problems: list = dataclasses.field(default_factory=list)
    rounds: list = dataclasses.field(default_factory=list)
    seconds: float | None = None

    @property
    def consistent(self) -> bool:
        """False when the timings do not add up even after measuring again
        (`problems` says why): the machine was too noisy to tell where the time
        goes, and `bottleneck`, `utilization` and the split are only a guess."""
        return not self.problems

    @property
    def num_replicas(self) -> int:
        return self.global_batch_size // self.per_replica_batch_size

    @property
    def bottleneck(self) -> str:
        """"input", "compute" or "overhead" (per-step overhead)."""
        return self.times.bottleneck

    @property
    def utilization(self) -> float:
        """Estimated share of each step the devices spend on per-example arithmetic."""
        return self.times.utilization

    @property
    def examples_per_second(self) -> float:
        return self.global_batch_size / self.times.fit_s

    def to_dict(self) -> dict:
        """Everything as JSON-ready values (times in seconds per step)."""
        out = dataclasses.asdict(self)
        t = self.times
        out["times"].update(work_s=t.work_s, overhead_s=t.overhead_s,
                            call_overhead_s=t.call_overhead_s, split=t.split())
        for item, a in zip(out["advice"], self.advice):
            item.update(arguments=a.arguments, flags=a.flags)
        out.update(num_replicas=self.num_replicas, bottleneck=self.bottleneck,
                   utilization=self.utilization, examples_per_second=self.examples_per_second,
                   consistent=self.consistent)
        return out

    def __repr__(self) -> str:
        return (f"Diagnosis(bottleneck={self.bottleneck!r}, consistent={self.consistent}, "
                f"examples_per_second={self.examples_per_second:.0f}, "
                f"utilization={self.utilization:.2f}, advice={[a.arguments for a in self.advice]})")

    def noise_line(self, flags: bool = False) -> str:
        """The one line that says the timings do not add up, and what to do."""
        more = max(5.0, 4 * (self.seconds or 1.0))
        rounds = len(self.rounds) or 1
        return (f"NOT CONSISTENT after {human.count(rounds, 'round')} of timings: "
                f"{'; '.join(self.problems)}. The machine is too noisy to tell where the time "
                f"goes: rerun diagnose on a quiet machine, timing more steps "
                f"({'--seconds=' if flags else 'seconds='}{more:g}).")

    def format(self, flags: bool = False) -> str:
        """The report as text: timings, time split, bottleneck, ranked advice
        (each change as Python arguments, or as command-line flags). When the
        timings do not add up, one line says so instead of the split and the
        bottleneck."""
        t = self.times
        split = t.split()
        ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
        pipeline = self.config.get("pipeline", {})
        lines = [
            f"configuration    {self.strategy} on {', '.join(map(_short, self.devices))}; "
            f"global batch {self.global_batch_size} = {self.num_replicas} x "
            f"{self.per_replica_batch_size}; steps_per_execution {self.steps_per_execution}"
            + ("; no prefetch" if pipeline.get("prefetch") is False else ""),
            f"input alone      {ms(t.input_s)} per step",
            f"compute alone    {ms(t.compute_s)} per step, data on the devices; "
            f"{ms(t.compute_fixed_s)} of it fixed per step (does not grow with the batch)",
            f"together (fit)   {ms(t.fit_s)} per step = {self.examples_per_second:,.0f} "
            f"examples/s",
        ]
        if self.consistent:
            lines += [
                "time split       " + ", ".join(
                    f"{k.replace('_', ' ')} {v / t.fit_s:.0%}" for k, v in split.items()),
                f"device utilization (estimate): {self.utilization:.0%} of each step is "
                f"per-example arithmetic"]
        if self.per_call_overhead_s is not None:
            lines.append(f"per-call overhead (estimate): {ms(self.per_call_overhead_s)} per "
                         f"tf.function call")
        lines.append(f"BOTTLENECK: {_verdict(self)}" if self.consistent else
                     self.noise_line(flags))
        if self.advice:
            lines.append("advice, best first (gain in examples/s):")
            for i, a in enumerate(self.advice, 1):
                gain = ("gain unknown here" if a.expected_gain is None else
                        f"{a.expected_gain:.2f}x {'measured' if a.measured else 'at most'}")
                lines.append(f"  {i}. {a.change}: {a.flags if flags else a.arguments}  [{gain}]"
                             f"\n     {a.detail}")
        else:
            lines.append(f"advice: none; no change tried here gains {MIN_GAIN - 1:.0%} or more")
        lines += [f"note: {n}" for n in self.notes]
        if self.profile_dir:
            lines.append(f"profiler trace in {self.profile_dir}: tensorboard --logdir "
                         f"{self.profile_dir} (Profile tab, needs tensorboard-plugin-profile)")
        lines.append(f"diagnosed in {human.duration(self.elapsed_s)}")
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Saves the time split as a PNG bar chart to `path`; returns `path`.

        Raises:
            RuntimeError: matplotlib is not installed.
        """
        plt = timing.pyplot(headless=True)
        t = self.times
        rows = {"input alone": timing.StepTimes(t.input_s, 0.0, t.input_s),
                "compute alone": timing.StepTimes(0.0, t.compute_s, t.compute_s,
                                                  t.compute_fixed_s),
                "together (fit)": t}
        fig, ax = plt.subplots(figsize=(8, 3))
        timing.plot_step_times(
            rows, ax, f"{self.bottleneck}-bound: {self.examples_per_second:,.0f} examples/s, "
                      f"utilization {self.utilization:.0%}" if self.consistent else
                      f"the timings do not add up (too noisy to tell): "
                      f"{self.examples_per_second:,.0f} examples/s")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def onednn_would_help() -> bool:
    """True on an x86 CPU where TensorFlow runs without its oneDNN kernels and
    nobody turned them off on purpose (TF_ENABLE_ONEDNN_OPTS=0)."""
    return (platform.machine().lower() in ("x86_64", "amd64")
            and os.environ.get("TF_ENABLE_ONEDNN_OPTS", "").strip().lower() not in ("0", "false")
            and environment.onednn_enabled() is False)


def _steps(count: int) -> str:
    """'step' or '4 steps' (after "per")."""
    return "step" if count == 1 else human.count(count, "step")


def _verdict(d: Diagnosis) -> str:
    """The bottleneck in words, its figures taken from the split (parts of the step
    that add up to it)."""
    t = d.times
    split = t.split()
    if d.bottleneck == "overhead":
        overhead = split["fixed_per_step"] + split["call_overhead"]
        return (f"per-step overhead. Of {t.fit_s * 1e3:.2f} ms per step, "
                f"{overhead * 1e3:.2f} ms ({overhead / t.fit_s:.0%}) does not grow "
                f"with the batch: {split['fixed_per_step'] * 1e3:.2f} ms fixed in the step (op "
                f"dispatch, all-reduce latency, optimizer update) and "
                f"{split['call_overhead'] * 1e3:.2f} ms around it (Python, callbacks, one "
                f"tf.function call per {_steps(d.steps_per_execution)}). Fewer, larger steps "
                f"and more steps per call help.")
    if d.bottleneck == "input":
        return (f"the input pipeline. It needs {t.input_s * 1e3:.2f} ms per batch, the step "
                f"{t.compute_s * 1e3:.2f} ms: the devices wait for data.")
    return (f"compute. The per-example arithmetic takes {split['compute'] * 1e3:.2f} of "
            f"{t.fit_s * 1e3:.2f} ms per step; only cheaper arithmetic (mixed precision, XLA "
            f"on GPUs) or more devices help.")


def diagnose(config: TrainConfig, *, prefetch: bool = True, cache: bool | None = None,
             map_fn=None, batch_map_fn=None, seconds: float = 1.0,
             measure_advice: bool = True, profile_dir: str | None = None,
             progress=None) -> Diagnosis:
    """Times a training configuration's input, compute and both together, and advises.

    Builds the configuration's strategy, input pipeline and model as
    `tfmulti.training.train.train` does (`tfmulti.training.run.build_run`), then measures,
    in seconds per step (see `tfmulti.insight.timing`): the input pipeline
    alone; the train step alone on a batch already on the devices, at the
    configured batch and at 4 times it (what does not grow with the batch is
    fixed per-step cost); and `fit` with both. Timings that cannot all be true
    (a part longer than the whole, a larger batch faster, repeats spread too
    wide: `timing.Measurements.problems`) are measured again, at most
    `timing.EXTRA_ROUNDS` more times; if they still do not add up, the
    diagnosis is not `consistent` and says that the machine is too noisy to
    tell. The largest of input, per-example compute and per-step overhead is
    the bottleneck. Then it runs
    the changes that could help (more steps per execution, a larger
    per-replica batch, prefetching, caching; XLA on GPUs) and ranks them by
    their measured gain in examples/s.

    Args:
        config: the configuration; distributions "auto", "one_device" or
            "mirrored" (one process).
        prefetch: stream batches to the devices ahead of the step (default);
            False diagnoses the pipeline without prefetching.
        cache: cache the examples in memory (default: yes, as training does).
        map_fn (Callable | None): optional per-example function, before the cache.
        batch_map_fn (Callable | None): optional per-batch function after the cache (runs every
            epoch, like augmentation).
        seconds: about how long each timing runs (default 1).
        measure_advice: run the candidate changes to measure their gain
            (default); False lists them without gains.
        profile_dir: write a TensorBoard profiler trace of a few `fit` steps here.
        progress (Callable[[str], object] | None): called with a line of text at each stage (e.g.
            `print`).

    Returns:
        A `Diagnosis`: `format()` for text, `to_dict()` for JSON, `plot(path)`.

    Raises:
        ValueError: a bad configuration, an unsupported distribution, a
            non-positive `seconds`, or float16 without a GPU.
        RuntimeError: virtual devices requested after TensorFlow started.
    """
    validate_for_diagnose(config)
    checks.positive_number("seconds", seconds)
    try:
        diagnoser = _Diagnoser(config, seconds, progress or (lambda line: None),
                               dict(prefetch=prefetch, cache=cache, map_fn=map_fn,
                                    batch_map_fn=batch_map_fn))
        return diagnoser.run(measure_advice, profile_dir)
    finally:
        data_service.stop_local()  # a service `data_service="local"` started


class _Diagnoser:
    """The measurements of one `diagnose` call."""

    def __init__(self, config: TrainConfig, seconds: float, say, pipeline: dict):
        self.config, self.seconds, self.say, self.pipeline = config, seconds, say, pipeline
        self.start = time.perf_counter()
        self.first = runs.build_run(config, input_options=pipeline)
        self.strategy = self.first.strategy
        self.name = strategy_lib.strategy_name(self.strategy)
        self.devices = list(self.strategy.extended.worker_devices)
        self.on_gpu = any(":GPU:" in d.upper() for d in self.devices)

    def build(self, batch: int, steps_per_execution: int, jit_compile: bool | None = None,
              sparse_updates: str | None = None, **pipeline):
        """(DistributedInput, compiled model) of a variant of the configuration."""
        c = self.config
        variant = c.replace(global_batch_size=batch, steps_per_execution=steps_per_execution,
                            jit_compile=c.jit_compile if jit_compile is None else jit_compile,
                            sparse_updates=sparse_updates or c.sparse_updates)
        run = runs.build_run(variant, reuse=self.first,
                             input_options={**self.pipeline, **pipeline})
        return run.train_input, run.model

    def fit_seconds(self, batch: int, steps_per_execution: int,
                    estimate_s: float | None = None, **variant):
        """(seconds per step through fit, DistributedInput, model) of a variant;
        `estimate_s` (an upper bound of the step time) saves a warm-up run."""
        dist, model = self.build(batch, steps_per_execution, **variant)
        epochs = 3
        if estimate_s is None:  # a short warm-up run gives the estimate
            estimate_s = timing.time_fit(model, dist, steps_per_execution
                                         * -(-8 // steps_per_execution), epochs=2)[0]
            epochs = 2
        steps = timing.steps_for(self.seconds, estimate_s, steps_per_execution)
        return statistics.median(timing.time_fit(model, dist, steps, epochs)), dist, model

    def measure(self, model, dist, steps: int, calls: list, timed: int,
                scale: float) -> timing.Measurements:
        """One round of the timings: `fit` for `steps` steps, the step alone at the
        batch and at `scale` times it (`calls`, their `timing.compute_call`s of
        `timed` steps each) and the input alone."""
        self.say("diagnose [1/4] together: fit")
        fit = timing.time_fit(model, dist, steps, epochs=2)
        self.say(f"  {statistics.median(fit) * 1e3:.2f} ms per step")
        self.say(f"diagnose [2/4] compute alone, data on the devices (batch x1 and x{scale:g})")
        compute, scaled = ([s / timed for s in times] for times in
                           timing.call_times_interleaved(calls, self.seconds))
        t = timing.Measurements(fit, compute, (0.0,), scaled, scale).step_times()
        self.say(f"  {t.compute_s * 1e3:.2f} ms per step ({t.compute_fixed_s * 1e3:.2f} ms "
                 f"fixed); x{scale:g} batch: {statistics.median(scaled) * 1e3:.2f} ms")
        self.say("diagnose [3/4] input alone")
        input_s = timing.time_input_repeats(dist, timed, self.seconds)
        self.say(f"  {statistics.median(input_s) * 1e3:.2f} ms per step")
        return timing.Measurements(fit, compute, input_s, scaled, scale)

    def run(self, measure_advice: bool, profile_dir: str | None) -> Diagnosis:
        c = self.config
        batch = c.global_batch_size
        steps_per_execution = self.first.steps_per_execution
        per_replica = self.first.per_replica_batch_size
        self.say(f"diagnose: {self.name} on {', '.join(map(_short, self.devices))}, global "
                 f"batch {batch}, steps_per_execution {steps_per_execution}")
        self.say("diagnose: warming up (a few fit steps, which also read the data)")
        dist, model = self.build(batch, steps_per_execution)
        estimate_s = timing.time_fit(model, dist, steps_per_execution
                                     * -(-8 // steps_per_execution), epochs=2)[0]
        steps = timing.steps_for(self.seconds, estimate_s, steps_per_execution)
        timed = max(5, min(100, round(0.1 / estimate_s)))  # steps per timing call
        scale = 4 if per_replica <= 256 else 0.25
        calls = [timing.compute_call(model, self.strategy, dist, timed, s) for s in (1, scale)]
        rounds = timing.measure_until_consistent(
            lambda: self.measure(model, dist, steps, calls, timed, scale), say=self.say)
        problems = rounds[-1].problems()
        if problems:
            self.say(f"diagnose: the timings still do not add up after {len(rounds)} rounds; "
                     f"the machine is too noisy to tell where the time goes")
        d = Diagnosis(
            config={**dataclasses.asdict(c), "pipeline": {
                k: (v if isinstance(v, (bool, type(None))) else getattr(v, "__name__", str(v)))
                for k, v in self.pipeline.items()}},
            strategy=self.name, devices=self.devices, global_batch_size=batch,
            per_replica_batch_size=per_replica, steps_per_execution=steps_per_execution,
            times=rounds[-1].step_times(), per_call_overhead_s=None, advice=[], notes=[],
            elapsed_s=0.0, problems=problems, rounds=rounds, seconds=self.seconds)
        self.say(f"diagnose [4/4] advice: "
                 f"{d.bottleneck + '-bound' if d.consistent else 'bottleneck unknown'}; "
                 + ("measuring the changes that could help" if measure_advice else
                    "listing the changes that could help"))
        self.advise(d, dist, measure_advice)
        if not d.consistent and d.advice:
            d.notes.append("the advice follows from timings that do not add up; check its "
                           "gains on a quiet machine")
        if profile_dir:
            self.say(f"diagnose: profiling a few steps into {profile_dir}")
            profile_fit(model, dist, profile_dir)
            d.profile_dir = profile_dir
        d.elapsed_s = time.perf_counter() - self.start
        return d

    def advise(self, d: Diagnosis, dist, measure: bool) -> None:
        """Fills `d.advice` (ranked by gain), `d.notes` and the per-call overhead."""
        c, t = self.config, d.times
        batch, per_call = d.global_batch_size, d.steps_per_execution
        base_rate = d.examples_per_second
        advice: list[Advice] = []

        def add(change, settings, detail, new_batch, new_calls, **variant):
            """Measures a variant (or only lists it); returns its seconds per step."""
            item = Advice(change, settings, None, False, detail)
            if not measure:
                advice.append(item)
                return None
            self.say(f"  trying {item.arguments}")
            estimate = t.fit_s * max(1.0, new_batch / batch)
            seconds, _, _ = self.fit_seconds(new_batch, new_calls, estimate, **variant)
            rate = new_batch / seconds
            self.say(f"    {rate:,.0f} examples/s ({rate / base_rate:.2f}x)")
            item.expected_gain, item.measured = rate / base_rate, True
            item.detail = f"measured {base_rate:,.0f} -> {rate:,.0f} examples/s; {detail}"
            advice.append(item)
            return seconds

        k = resolve_steps_per_execution("auto", dist.steps_per_epoch)
        calls_help = k > per_call and (d.bottleneck == "overhead"
                                       or t.call_overhead_s > 0.05 * t.fit_s)
        if calls_help:
            seconds = add("more steps per tf.function call", {"steps_per_execution": k},
                          "Keras then pays its per-call Python, callback and dispatch cost "
                          f"once per {k} steps (progress and callbacks update per call); {k} "
                          f"divides the {dist.steps_per_epoch} steps per epoch "
                          "(steps_per_execution='auto' picks it)", batch, k)
            if seconds is not None:
                d.per_call_overhead_s = max(0.0, (t.fit_s - seconds) / (1 / per_call - 1 / k))
        examples = (dist.steps_per_epoch or 0) * batch
        new_batch = TARGET_PER_REPLICA_BATCH * d.num_replicas
        if examples:  # keep at least 8 steps per epoch
            new_batch = min(new_batch, examples // 8 // d.num_replicas * d.num_replicas)
        if d.bottleneck == "overhead" and new_batch > batch:
            lr = ("lr_scaling='sqrt' and warmup_epochs=1 for Adam, 'linear' for SGD"
                  if c.lr_scaling == "none" else f"keep lr_scaling={c.lr_scaling!r}")
            detail = (f"{new_batch // d.num_replicas} examples per replica instead of "
                      f"{d.per_replica_batch_size} spread the fixed per-step cost; there are "
                      f"fewer updates per epoch, so scale the learning rate ({lr}) and "
                      f"watch the accuracy per epoch")
            add("larger per-replica batch", {"global_batch_size": new_batch}, detail,
                new_batch, per_call)
            k2 = resolve_steps_per_execution("auto", examples // new_batch if examples else None)
            if calls_help and k2 > per_call:
                add("both: larger batch and more steps per call",
                    {"global_batch_size": new_batch, "steps_per_execution": k2},
                    f"the two changes above together ({lr})", new_batch, k2)
        tables = _large_tables(self.first.model)
        if tables and c.sparse_updates == "dense" and not c.zero_stage \
                and sparse_updates.lazy_rule_for(zero.updating(self.first.model.optimizer)):
            add("update only the table rows a batch touches", {"sparse_updates": "lazy"},
                f"{_listed_tables(tables)}: the optimizer's dense update writes every row of "
                "each table and of its slots every step; lazily, only the rows the batch "
                "touched (rows it did not touch then keep their slots: docs/how-to/"
                "embeddings.md)", batch, per_call, sparse_updates="lazy")
        if self.pipeline["prefetch"] is False:
            add("prefetch to the devices", {"prefetch": True},
                "the next batches are prepared and copied to the devices while the step runs "
                "(tfmulti's default)", batch, per_call, prefetch=True)
        if self.pipeline["cache"] is False:
            add("cache the examples in memory", {"cache": True},
                "read and decode the data once, then serve it from memory", batch, per_call,
                cache=True)
        if d.bottleneck == "input":
            self.advise_input(d, advice, measure)
            self.advise_service(d, add, measure)
        if self.on_gpu and d.bottleneck == "compute" and not c.jit_compile:
            add("compile the step with XLA", {"jit_compile": True},
                "fuses the step's ops into fewer, larger kernels", batch, per_call,
                jit_compile=True)
        if self.on_gpu and d.bottleneck == "compute" and c.mixed_precision == "none":
            d.notes.append("mixed precision (mixed_precision='bfloat16', or 'float16' with "
                           "loss scaling) typically gains 1.5-3x for compute-bound steps on "
                           "GPUs with tensor cores; rerun diagnose with it to measure it")
        if not self.on_gpu and onednn_would_help():
            advice.append(Advice(
                "turn on TensorFlow's oneDNN CPU kernels", {}, None, False,
                "TensorFlow leaves them off on this CPU (its default only with AVX-512 "
                "neural-network features; `tfmulti env` shows `onednn`); a CNN trained 2.2x "
                "faster per worker with them on an AVX2-only CPU (BENCHMARKS.md, One-off "
                "measurements), and results may differ in the last bits. Rerun diagnose with the variable set to measure it here",
                how="TF_ENABLE_ONEDNN_OPTS=1 in the environment, before TensorFlow starts"))
        if not self.on_gpu:
            d.notes.append("mixed precision and XLA (mixed_precision, jit_compile) pay off "
                           "on GPUs; not tried on this CPU host")
            d.notes.append(f"on a CPU host the input and the step share the same "
                           f"{os.cpu_count()} cores, so 'together' cannot reach max(input, "
                           f"compute) when both are CPU-heavy")
        for a in advice:
            if a.measured and a.expected_gain < MIN_GAIN:
                d.notes.append(f"tried {a.arguments}: no gain ({a.expected_gain:.2f}x)")
        d.advice = sorted((a for a in advice if not a.measured or a.expected_gain >= MIN_GAIN),
                          key=lambda a: -(a.expected_gain or 0.0))

    def advise_input(self, d: Diagnosis, advice: list, measure: bool) -> None:
        """Advice for an input-bound step: what hiding the input could gain."""
        t = d.times
        ceiling = t.fit_s / max(t.compute_s, 1e-9)
        if self.pipeline["batch_map_fn"] is not None and measure:
            self.say("  timing the input without the per-batch map")
            dist, _ = self.build(d.global_batch_size, d.steps_per_execution, batch_map_fn=None)
            plain = timing.time_input(dist, 20, self.seconds)
            advice.append(Advice(
                "move deterministic per-batch work before the cache", {},
                t.fit_s / max(t.compute_s, plain), False,
                f"without the per-batch map the input takes {plain * 1e3:.2f} ms per step "
                f"(measured); random augmentation must stay after the cache",
                how="map_fn= instead of batch_map_fn="))
        loader = self.first.train_data
        if isinstance(loader, LoaderSource) and loader.kind == "PyDataset":
            how = (f"more of the PyDataset's own workers (now workers={loader.loader.workers}"
                   f"{', in processes' if loader.loader.use_multiprocessing else ''}): "
                   "workers=N, with use_multiprocessing=True where its Python work holds the "
                   "GIL (decoding, augmentation in NumPy or PIL), or vectorized work per batch")
        else:
            how = ("a cheaper or vectorized map (batch first, then map), more cores for tf.data, "
                   "or a tf.data service worker (--data_service, below)")
        advice.append(Advice(
            "more input parallelism", {}, ceiling, False,
            f"the input needs {t.input_s * 1e3:.2f} ms per step and the step "
            f"{t.compute_s * 1e3:.2f} ms: hiding the input entirely gains at most this",
            how=how))


    def advise_service(self, d: Diagnosis, add, measure: bool) -> None:
        """An input-bound step: the input run by a tf.data service worker on
        this host, measured through one started here (an input that runs
        Python, which a service worker cannot, gets a note instead)."""
        if self.first.data_service is not None:
            return
        change, settings = "run the input in a tf.data service worker", {"data_service": "local"}
        detail = ("the input pipeline runs in a process of its own (on this host's cores, or "
                  "other hosts' with tfmulti data-service), the same batches in the same "
                  "order; it pays where cores are idle while the step runs")
        if not measure:
            add(change, settings, detail + " (not for input that runs Python code)",
                d.global_batch_size, d.steps_per_execution)
            return
        # On the cores this process may not use (`taskset -c 0 tfmulti diagnose`: the
        # trainer on core 0, the service on the others), else on its own cores.
        spare = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
        where = (f"CPUs {sorted(spare)}, which the trainer does not use" if spare
                 else "the trainer's cores")
        self.say(f"  starting a tf.data service worker on {where}")
        try:
            with data_service.LocalService(1, cpus=spare or None) as service:
                add(change, settings, f"{detail} (measured with a worker on {where})",
                    d.global_batch_size, d.steps_per_execution, data_service=service.target)
        except ValueError as e:  # the input runs Python code
            d.notes.append(f"not tried: a tf.data service worker (--data_service): {e}")


LARGE_TABLE_ROWS = 100_000
"""An `Embedding` of this many rows or more is a table whose dense update
`diagnose` measures against the lazy one."""


def _large_tables(model) -> list:
    """The model's `Embedding` layers of `LARGE_TABLE_ROWS` rows or more."""
    import keras

    layers = model._flatten_layers(include_self=False)  # pylint: disable=protected-access
    return [layer for layer in layers if isinstance(layer, keras.layers.Embedding)
            and layer.input_dim >= LARGE_TABLE_ROWS]


def _listed_tables(tables: list) -> str:
    return ", ".join(f"{t.name} ({t.input_dim:,} x {t.output_dim})" for t in tables)


def profile_fit(model, dist, profile_dir: str, steps: int | None = None) -> None:
    """Writes a TensorBoard profiler trace of `fit` on `dist` into `profile_dir`."""
    import tensorflow as tf

    per_call = model.steps_per_execution
    os.makedirs(profile_dir, exist_ok=True)
    tf.profiler.experimental.start(profile_dir)
    try:
        timing.time_fit(model, dist, steps or per_call * -(-10 // per_call), epochs=2)
    finally:
        tf.profiler.experimental.stop()
