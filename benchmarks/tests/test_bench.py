"""The benchmark package (`benchmarks`): its registry and harness, the core
placement, the fixtures, and the workers at toy sizes. No benchmark figure is
asserted (the figures go in BENCHMARKS.md, from `recipes/benchmark.py`)."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests._util import REPO, run_python
from tfmulti import data
import benchmarks as bench
from tfmulti.models import builders as models
from benchmarks import _harness, cpus, fixtures, own, scaling, worker
from tfmulti.insight import timing
from tfmulti.runtime.strategy import get_strategy

BENCHMARK = str(REPO / "recipes" / "benchmark.py")
two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                               reason="needs 2 cores: the step and the input get one each")


# ---------------------------------------------------------------- registry and harness


def test_suites_registry_lists_every_suite_module_in_order():
    assert list(bench.SUITES) == ["scaling", "pipeline", "baseline", "overhead", "streaming",
                                  "input_service", "own", "tensor", "memory", "embeddings"]
    for name, module in bench.SUITES.items():
        assert module.__name__ == f"benchmarks.{name}"
        for attribute in ("run", "check", "summarize", "plot"):
            assert callable(getattr(module, attribute)), (name, attribute)
        assert all(hasattr(module, n) for n in module.__all__), name
        assert module.__doc__.startswith(f"{name}: "), name


def test_every_worker_kind_resolves_to_a_function():
    for kind, target in worker.WORKERS.items():
        module, function = target.split(":")
        assert callable(getattr(__import__(module, fromlist=[function]), function)), kind


def test_worker_main_refuses_bad_arguments(capsys):
    assert worker.main([]) == 2
    assert worker.main(["bogus"]) == 2
    assert "`kind` must be one of ['machine'" in capsys.readouterr().err
    assert worker.main(["machine", "[1]"]) == 2
    assert "CONFIG_JSON must be a JSON object" in capsys.readouterr().err
    assert worker.main(["machine", "{not json"]) == 2


def test_run_suite_refuses_an_unknown_suite_and_bad_repeats():
    with pytest.raises(ValueError, match=r"`suite` must be one of \['scaling', 'pipeline'"):
        bench.run_suite("bogus", 1)
    with pytest.raises(ValueError, match=r"`repeats` must be a positive integer, got True"):
        bench.run_suite("overhead", True)
    with pytest.raises(TypeError):
        bench.SUITES["overhead"].check(steps_per_execution=4)  # the suite has no options


def test_summary_and_fmt():
    s = _harness.summary([3.0, 1.0, 2.0])
    assert s == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert _harness.fmt(s) == "2.00x (min 1.00, max 3.00, 3 repeats)"
    assert _harness.fmt(s, "", 3) == "2.000 (min 1.000, max 3.000, 3 repeats)"


def test_worker_command_runs_the_worker_module():
    command = _harness.worker_command("pipeline", repeats=2)
    assert command[:4] == [sys.executable, "-m", "benchmarks.worker", "pipeline"]
    assert json.loads(command[4]) == {"repeats": 2}


def _fake_suite(name: str, output: str, seen: list):
    def run(repeats, **options):
        # The file on disk already holds every suite finished before this one.
        if os.path.exists(output):
            with open(output) as f:
                on_disk = json.load(f)
            seen.append((name, sorted(on_disk["suites"]), on_disk["complete"]))
        else:
            seen.append((name, None, None))
        return {"value": _harness.summary([float(repeats)] * repeats), "options": options}

    def plot(record, ax):
        ax.bar(["x"], [record["value"]["median"]])

    return types.SimpleNamespace(
        run=run, check=lambda **options: None, plot=plot,
        summarize=lambda record: [f"{name}: value {_harness.fmt(record['value'])}"])


def test_run_benchmark_writes_the_json_after_every_suite_then_complete(tmp_path, monkeypatch,
                                                                      capsys):
    output = str(tmp_path / "out" / "bench.json")
    seen = []
    monkeypatch.setattr(bench, "SUITES", {"first": _fake_suite("first", output, seen),
                                          "second": _fake_suite("second", output, seen)})
    machine = {"cpu_model": "Test CPU", "onednn": None, "cpu_count": 2, "tensorflow": "2.21",
               "keras": "3", "platform": "test"}
    monkeypatch.setattr(_harness, "run_worker", lambda kind, **kw: dict(machine))
    results = bench.run_benchmark(["first", "second"], 2, output,
                                  options={"second": {"size": 3}}, command="python bench")
    assert seen == [("first", None, None), ("second", ["first"], False)]
    with open(output) as f:
        on_disk = json.load(f)
    assert on_disk == json.loads(json.dumps(results))
    assert on_disk["complete"] is True and on_disk["command"] == "python bench"
    assert on_disk["machine"] == machine and on_disk["repeats"] == 2
    assert list(on_disk["suites"]) == ["first", "second"]
    assert on_disk["suites"]["second"]["options"] == {"size": 3}
    assert set(on_disk["suite_seconds"]) == {"first", "second"} and on_disk["seconds"] >= 0
    assert sorted(os.listdir(tmp_path / "out")) == ["bench.json", "bench.png"]
    out = capsys.readouterr().out
    assert "machine: Test CPU, 2 cores, oneDNN unknown" in out
    assert "first: value 2.00x (min 2.00, max 2.00, 2 repeats)" in out
    assert f"wrote {output} and {output[:-5]}.png" in out


def test_run_benchmark_checks_every_suites_options_before_running_any(tmp_path, monkeypatch):
    def no_worker(*args, **kwargs):
        raise AssertionError("nothing may run before the options are checked")

    monkeypatch.setattr(_harness, "run_worker", no_worker)
    output = tmp_path / "bench.json"
    with pytest.raises(ValueError, match=r"baseline suite's steps per execution \(100; "
                                         r"--baseline_steps_per_execution.*must divide 625"):
        bench.run_benchmark(["overhead", "baseline"], 1, str(output),
                            options={"baseline": {"steps_per_execution": 100}})
    with pytest.raises(ValueError, match=r"`options` must be one of"):
        bench.run_benchmark(["overhead"], 1, str(output), options={"bogus": {}})
    with pytest.raises(ValueError, match=r"`names` is empty"):
        bench.run_benchmark([], 1, str(output))
    assert not output.exists()


def test_scaling_launches_train_py_with_the_distribution_flag():
    command = scaling.launch_command(2, "/tmp/run")
    assert command[:6] == [sys.executable, "-m", "tfmulti.cli", "launch", "--num_workers=2",
                           "--pin_cpus"]
    assert command[6:8] == ["--", sys.executable]
    assert command[8] == scaling.TRAIN_RECIPE and os.path.isfile(scaling.TRAIN_RECIPE)
    assert command[9:] == ["--distribution=multi_worker", "--model=cnn", "--dataset=synthetic",
                           "--num_examples=12288", "--epochs=4", "--global_batch_size=1024",
                           "--steps_per_execution=12", "--model_dir=/tmp/run"]
    assert "--global_batch_size=256" in scaling.launch_command(1, "/tmp/run",
                                                               per_worker_batch=256)
    # Host 1's launcher of the same 2-worker training across 2 (simulated) hosts.
    across = scaling.launch_command(2, "/tmp/run", hosts="10.213.0.1:1,10.213.0.2:1",
                                    host_rank=1)
    assert across[4:7] == ["--hosts=10.213.0.1:1,10.213.0.2:1", "--host_rank=1", "--pin_cpus"]
    assert across[7:] == command[6:]


def test_scaling_refuses_an_all_reduce_that_a_worker_did_not_sum(tmp_path, monkeypatch):
    """The all-reduce the scaling suite times is checked on every worker: each record
    is worker i's of 2, its reduced sum both workers' (the launch itself runs in
    benchmarks/tests/test_end_to_end.py, the CNN's gradients summed on one host)."""
    def launch(argv, num_workers, timeout):
        out = json.loads(argv[-1])["out_dir"]
        for i, reduced in enumerate((2.0, reduced_1)):
            (tmp_path / out / f"worker{i}.json").write_text(json.dumps(
                {"worker": i, "workers": 2, "local_sum": 1.0, "reduced_sum": reduced,
                 "bytes": 8, "milliseconds_per_all_reduce": [0.5]}))

    monkeypatch.setattr(_harness, "launch_pinned", launch)
    reduced_1 = 2.0
    assert scaling.all_reduce_milliseconds(str(tmp_path / "ok"), across_hosts=False) == (
        [0.5], 8)
    reduced_1 = 1.0  # worker 1 summed only its own
    with pytest.raises(RuntimeError, match="did not sum both on worker 1"):
        scaling.all_reduce_milliseconds(str(tmp_path / "lost"), across_hosts=False)


def test_scaling_checks_its_options():
    scaling.check()  # the defaults: 24 and 12 steps per epoch, 12 per call
    with pytest.raises(ValueError, match=r"must divide the steps per epoch of 1 and of 2 "
                                         r"workers \(24 and 12\); use a common divisor such "
                                         r"as 12"):
        scaling.check(steps_per_execution=8)
    with pytest.raises(ValueError, match=r"`epochs` must be an integer >= 2"):
        scaling.check(epochs=1)
    with pytest.raises(ValueError, match=r"`per_worker_batch` must be a positive integer"):
        scaling.check(per_worker_batch=0)


# ---------------------------------------------------------------- core placement


class _Sleeper:
    """A thread that waits until told to stop; `tid` is its Linux thread id."""

    def __init__(self):
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self):
        self.tid = threading.get_native_id()
        self._ready.set()
        self._stop.wait(30)

    def stop(self):
        self._stop.set()
        self._thread.join(10)


@two_cores
def test_device_core_pins_later_threads_to_the_input_core_and_restores():
    every = os.sched_getaffinity(0)
    device = cpus.DeviceCore()  # this thread (and pytest's) are the step's
    assert device.step_core != device.input_core
    before = _Sleeper()  # started after DeviceCore: an input thread
    try:
        with device:
            assert os.sched_getaffinity(0) == device.step_core
            assert os.sched_getaffinity(before.tid) == device.input_core
            during = _Sleeper()  # started inside: inherits the step's core ...
            try:
                for _ in range(100):  # ... until the keeper moves it (every 20 ms)
                    if os.sched_getaffinity(during.tid) == device.input_core:
                        break
                    time.sleep(0.02)
                assert os.sched_getaffinity(during.tid) == device.input_core
            finally:
                during.stop()
        assert os.sched_getaffinity(0) == every
        assert os.sched_getaffinity(before.tid) == every
    finally:
        before.stop()
        os.sched_setaffinity(0, every)


def test_device_core_refuses_a_single_core(monkeypatch):
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {3})
    with pytest.raises(ValueError, match=r"needs 2 cores.*may use 1"):
        cpus.DeviceCore()


@two_cores
def test_one_core_confines_every_thread_then_frees_them():
    every = os.sched_getaffinity(0)
    other = _Sleeper()
    try:
        with cpus.one_core():
            assert os.sched_getaffinity(0) == {min(every)}
            assert os.sched_getaffinity(other.tid) == {min(every)}
        assert os.sched_getaffinity(0) == every
        assert os.sched_getaffinity(other.tid) == every
    finally:
        other.stop()
        os.sched_setaffinity(0, every)


@pytest.mark.slow
@two_cores
def test_hardware_ceiling_compares_2_spinning_processes_with_1():
    # Only its sign is checked: the figure is a ratio of two timings, and on a
    # machine busy with other work 1 process alone gets a smaller share than 2
    # together (3.6 seen in a suite run), so no upper bound holds everywhere.
    ceiling = cpus.hardware_ceiling(0.2)
    assert 0 < ceiling < math.inf
    with pytest.raises(ValueError, match=r"`seconds` must be a finite number > 0, got 0"):
        cpus.hardware_ceiling(0)


# ---------------------------------------------------------------- fixtures


def test_custom_loop_and_fit_reach_the_same_weights():
    """The overhead benchmark's reference loop does exactly fit's work: same
    data order, loss scaling and all-reduce give the same SGD weights."""
    strategy = get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    batch, k, calls = 64, 4, 3
    dist = data.distribute(data.load("synthetic", num_examples=1024), strategy, batch, seed=0)
    fitted = models.build_model("mlp", strategy=strategy, dropout=0.0, seed=0)
    looped = models.build_model("mlp", strategy=strategy, dropout=0.0, seed=0)
    looped.set_weights(fitted.get_weights())
    models.compile_model(fitted, task="classification", strategy=strategy, optimizer="sgd",
                         learning_rate=0.1, steps_per_execution=k)
    fitted.fit(dist.dataset, steps_per_epoch=k * calls, epochs=1, verbose=0, shuffle=False)
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1)
    loop = fixtures.CustomLoop(looped, strategy, optimizer, batch, k)
    assert "steps_per_execution=4" in repr(loop)
    loss = loop.train(iter(dist.dataset), calls)
    assert np.isfinite(loss)
    initial = models.build_model("mlp", dropout=0.0, seed=0).get_weights()
    for a, b, w0 in zip(fitted.get_weights(), looped.get_weights(), initial):
        assert np.abs(a - w0).max() > 1e-4  # both trained
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_custom_loop_refuses_a_bad_steps_per_execution():
    strategy = get_strategy("one_device")
    model = models.build_model("mlp", strategy=strategy)
    with pytest.raises(ValueError, match=r"`steps_per_execution` must be a positive integer, "
                                         r"got 0"):
        fixtures.CustomLoop(model, strategy, keras.optimizers.SGD(0.1), 64, 0)


def test_costly_batch_map_keeps_shape_dtype_and_is_deterministic():
    x = tf.random.stateless_uniform((8, 28, 28, 1), seed=(1, 2))
    y = tf.range(8)
    fn = fixtures.costly_batch_map(3)
    out, labels = fn(x, y)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert labels is y
    np.testing.assert_array_equal(out.numpy(), fn(x, y)[0].numpy())
    assert not np.allclose(out.numpy(), x.numpy())
    identity, _ = fixtures.costly_batch_map(0)(x, y)
    assert identity is x
    with pytest.raises(ValueError, match=r"`rounds` must be an integer >= 0, got -1"):
        fixtures.costly_batch_map(-1)
    with pytest.raises(ValueError, match=r"`rounds` must be an integer >= 0, got True"):
        fixtures.costly_batch_map(True)


def _tiny_run(steps_per_execution: int = 2):
    strategy = get_strategy("one_device")
    dist = data.distribute(data.load("synthetic", num_examples=256), strategy, 32, seed=0)
    model = models.build_model("mlp", strategy=strategy, seed=0)
    models.compile_model(model, task="classification", strategy=strategy,
                         steps_per_execution=steps_per_execution)
    return strategy, dist, model


@pytest.mark.slow  # trains for seconds
def test_interleaved_clock_runs_the_work_after_every_epoch_untimed():
    _, dist, model = _tiny_run()
    calls = []

    def work():
        calls.append(time.perf_counter())
        time.sleep(0.3)  # would dominate the 4-step epochs if it were timed

    seconds = timing.time_fit(model, dist, 4, epochs=3, clock=fixtures.InterleavedClock(work))
    assert len(calls) == 3 and len(seconds) == 2
    assert all(0 < s < 0.3 / 4 for s in seconds)
    with pytest.raises(ValueError, match="`work` must be callable"):
        fixtures.InterleavedClock(None)


def test_epoch_step_timer_and_time_to_accuracy_stop_at_the_target():
    _, dist, model = _tiny_run()
    accuracies = iter([0.5, 0.9, 0.95])
    race = fixtures.TimeToAccuracy(0.87)
    with pytest.raises(RuntimeError, match="needs start"):
        race.callback(lambda logs: 1.0)
    race.start()
    timer = fixtures.EpochStepTimer(4)
    model.fit(dist.dataset, steps_per_epoch=4, epochs=5, verbose=0, shuffle=False,
              callbacks=[timer, race.callback(lambda logs: next(accuracies))])
    assert len(timer.seconds_per_step) == 2 and min(timer.seconds_per_step) > 0
    result = race.result(examples_per_epoch=128)
    assert result["accuracy_per_epoch"] == [0.5, 0.9]  # stopped at the first crossing
    assert result["epochs_to_accuracy"] == 2
    assert result["time_to_accuracy"] == result["wall_seconds_per_epoch"][1] > 0
    assert len(result["train_seconds_per_epoch"]) == 2
    assert result["examples_per_second"] == pytest.approx(
        128 / result["train_seconds_per_epoch"][1])


def test_time_to_accuracy_counts_training_up_to_fits_own_validation():
    # The seed side evaluates through fit's validation_data: training time
    # ends where the validation begins, once per epoch.
    _, dist, model = _tiny_run()
    test = data.distribute(data.load("synthetic", "test", num_examples=64),
                           get_strategy("one_device"), 32, training=False)
    race = fixtures.TimeToAccuracy(0.0)
    race.start()
    model.fit(dist.dataset, steps_per_epoch=4, epochs=3, verbose=0, shuffle=False,
              validation_data=test.dataset, validation_steps=test.steps_per_epoch,
              callbacks=[race.callback(lambda logs: logs["val_accuracy"])])
    result = race.result(examples_per_epoch=128)
    assert result["epochs_to_accuracy"] == 1 and len(result["train_seconds_per_epoch"]) == 1
    assert 0 < result["train_seconds_per_epoch"][0] < result["time_to_accuracy"]
    assert result["examples_per_second"] is None  # no epoch 2 trained


# ---------------------------------------------------------------- workers and the recipe


@pytest.mark.slow
def test_importing_the_package_starts_no_tensorflow():
    # The benchmark's parent process and a worker before its set-up stay free of
    # TensorFlow: virtual devices and thread counts must come first.
    result = run_python(["-c", "import sys, benchmarks, benchmarks.worker; "
                               "print(sorted(m for m in ('tensorflow', 'keras') "
                               "if m in sys.modules))"], timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_tensor_suite_checks_its_sizes():
    tensor = bench.SUITES["tensor"]
    tensor.check(d_model=32, batch=8)
    with pytest.raises(ValueError, match=r"`option` must be one of \['seq_len'"):
        tensor.check(width=3)
    with pytest.raises(ValueError, match="`d_model` must be a positive integer, got 0"):
        tensor.check(d_model=0)


def test_run_workers_shares_one_process_at_toy_size_only(monkeypatch):
    started = []

    def one_process(kind, timeout=900, **config):
        started.append(kind)
        return worker.run(kind, config)  # what the process would print

    monkeypatch.setattr(_harness, "run_worker", one_process)
    calls = [("machine", {}), ("machine", {})]
    monkeypatch.setenv(_harness.TOY_ENV, "0")
    full = _harness.run_workers(calls)
    assert started == ["machine", "machine"]
    monkeypatch.setenv(_harness.TOY_ENV, "1")
    started.clear()
    assert _harness.run_workers(calls) == full and started == ["several"]
    assert full[0]["tensorflow"].startswith("2.21")
    for bad in ([["machine"]], [["several", {"calls": []}]], "machine", [["machine", []]]):
        with pytest.raises(ValueError):
            worker.run("several", {"calls": bad})


def test_first_examples_is_a_dataset_function_of_the_first_examples(fashion_mnist_data_dir):
    function = _harness.first_examples("fashion_mnist", 64, 32)
    split = function(data_dir=fashion_mnist_data_dir)
    assert (int(split["train"].cardinality()), int(split["test"].cardinality())) == (64, 32)
    assert (split["num_classes"], split["task"]) == (10, "classification")
    first = next(iter(data.load("fashion_mnist", "train", data_dir=fashion_mnist_data_dir)))
    np.testing.assert_array_equal(next(iter(split["train"]))[0], first[0])


def test_set_threads_keeps_a_started_runtimes_threads_at_toy_size_only(monkeypatch):
    tf.config.list_logical_devices()  # the runtime started, as by an earlier worker
    other = tf.config.threading.get_intra_op_parallelism_threads() + 1
    monkeypatch.setenv(_harness.TOY_ENV, "1")
    _harness.set_threads(intra_op=other, inter_op=3)
    assert tf.config.threading.get_intra_op_parallelism_threads() == other - 1
    monkeypatch.setenv(_harness.TOY_ENV, "0")
    with pytest.raises(RuntimeError, match="cannot be modified after initialization"):
        _harness.set_threads(intra_op=other)


@pytest.mark.slow
def test_run_worker_reports_a_failed_worker():
    with pytest.raises(RuntimeError, match=r"benchmark worker pipeline \{'bogus': 1\} failed"):
        _harness.run_worker("pipeline", timeout=120, bogus=1)


@pytest.mark.slow
def test_run_worker_at_toy_size_shares_one_process_and_reports_a_failed_worker(monkeypatch):
    """At toy size every worker of a run goes to one process (one TensorFlow start):
    a failing worker is reported with its traceback and the process goes on; it
    ends at `close_shared_worker` (and at exit)."""
    monkeypatch.setenv(_harness.TOY_ENV, "1")
    try:
        first = _harness.run_worker("machine", timeout=120)
        (shared,) = _harness._shared
        with pytest.raises(RuntimeError, match=r"(?s)benchmark worker pipeline \{'bogus': 1\} "
                                               r"failed \(the shared toy-size worker\).*bogus"):
            _harness.run_worker("pipeline", timeout=120, bogus=1)
        assert _harness.run_worker("machine", timeout=120) == first
        assert _harness._shared == [shared] and shared.process.poll() is None
    finally:
        _harness.close_shared_worker()
    assert _harness._shared == [] and shared.process.returncode == 0


@pytest.mark.slow
def test_benchmark_recipe_refuses_bad_options_before_running_anything(tmp_path):
    output = tmp_path / "bench.json"
    result = run_python([BENCHMARK, "--suite=baseline", "--baseline_steps_per_execution=100",
                         f"--output={output}"], timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    error_lines = [line for line in result.stderr.splitlines()
                   if line.startswith("benchmark.py: error:")]
    assert len(error_lines) == 1, result.stderr
    assert "--baseline_steps_per_execution of recipes/benchmark.py) must divide 625" \
        in error_lines[0]
    assert "machine:" not in result.stdout and not output.exists()
    result = run_python([BENCHMARK, "--suite=bogus"], timeout=60)
    assert result.returncode == 2 and "flag --suite=bogus" in result.stderr


# ---------------------------------------------------------------- the own suite


def test_own_checks_its_options():
    own.check()  # the defaults: 8 files of 2,048 examples, 256 per worker
    with pytest.raises(ValueError, match=r"`num_files` \(7\) must be even, so that 2 workers "
                                         r"reading by files get equal shares; use 8"):
        own.check(num_files=7)
    with pytest.raises(ValueError, match=r"`num_files` must be an integer >= 2, got 1"):
        own.check(num_files=1)
    with pytest.raises(ValueError, match=r"the files' examples \(2 x 100 = 200\) must be a "
                                         r"multiple of 2 x `per_worker_batch` \(512\)"):
        own.check(num_files=2, examples_per_file=100)
    with pytest.raises(ValueError, match=r"`epochs` must be an integer >= 2, got 1; the first "
                                         r"epoch of a launch is a warm-up"):
        own.check(epochs=1)
    with pytest.raises(ValueError, match=r"`epoch_seconds` must be a finite number >= 0.1"):
        own.check(epoch_seconds=float("nan"))
    with pytest.raises(ValueError, match=r"`repeats` must be a positive integer, got 0"):
        own.run(0)


def test_own_file_launches_train_whole_passes_in_whole_calls():
    # 1 worker trains twice the steps of 2 at the same per-worker batch, both
    # whole passes over the files, in calls of the same number of steps.
    files = own._checked(1.0, 8, 2048, 256, 4)
    assert (files.num_examples, files.steps_per_execution) == (16384, 32)
    assert own._checked(1.0, 6, 1024, 256, 4).steps_per_execution == 12  # 12 and 24 steps
    with pytest.raises(ValueError, match=r"the files' examples \(6 x 1000 = 6000\) must be a "
                                         r"multiple of 2 x `per_worker_batch` \(512\), so "
                                         r"that 1 and 2 workers train whole passes over the "
                                         r"files; use e.g. examples_per_file=1024"):
        own.check(num_files=6, examples_per_file=1000)


def test_own_user_functions_build_the_builtin_network_on_the_same_data():
    """The own-model measurement compares like with like: the user's model
    function builds the built-in MLP's network (same layers, parameters and
    initial weights under the same seed) and the user's dataset function
    returns the built-in synthetic examples, as NumPy arrays."""
    from tfmulti.training import run as runs
    from tfmulti.config.train_config import TrainConfig

    x, y = own.user_data(num_examples=64)["train"]
    assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
    reference = own._arrays(data.synthetic("train", num_examples=64))
    np.testing.assert_array_equal(x, reference[0])
    np.testing.assert_array_equal(y, reference[1])
    config = TrainConfig(distribution="one_device", model="mlp", dataset="synthetic",
                         num_examples=256, global_batch_size=32, seed=0)
    builtin = runs.build_run(config).model
    mine = runs.build_run(config.replace(model=own.USER_MODEL, dataset=own.USER_DATA)).model
    assert not isinstance(mine, keras.Sequential) and mine.name == "user_mlp"

    def kinds(model):
        return [(type(layer).__name__, getattr(layer, "units", None),
                 getattr(getattr(layer, "activation", None), "__name__", None),
                 getattr(layer, "rate", None)) for layer in model.layers
                if not isinstance(layer, keras.layers.InputLayer)]

    assert kinds(mine) == kinds(builtin) == [
        ("Flatten", None, None, None), ("Dense", 512, "relu", None),
        ("Dropout", None, None, 0.2), ("Dense", 10, "linear", None)]
    for a, b in zip(builtin.get_weights(), mine.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert type(builtin.loss) is type(mine.loss)


def test_own_files_hold_the_synthetic_examples(tmp_path):
    written = own.write_worker(str(tmp_path), num_files=2, examples_per_file=3)
    assert [os.path.basename(f) for f in written["files"]] == ["part-000-of-002.tfrecord",
                                                               "part-001-of-002.tfrecord"]
    assert written["bytes"] == [os.path.getsize(f) for f in written["files"]]
    assert min(written["bytes"]) > 3 * 28 * 28 * 4  # the images, as raw float32
    read = list(data.from_files(written["files"], own.parse_record, cycle_length=1).dataset()
                .as_numpy_iterator())
    reference = own._arrays(data.synthetic("train", num_examples=6))
    np.testing.assert_array_equal(np.stack([image for image, _ in read]), reference[0])
    np.testing.assert_array_equal([label for _, label in read], reference[1])


def test_own_bytes_per_pass_counts_from_one_pass_to_the_next():
    # 2 files a pass: each pass's first opening (the smaller rchar of the two,
    # whatever order two concurrent openings were logged in) to the next's.
    opened = [("a", 100), ("b", 100), ("b", 1300), ("a", 1290), ("a", 2500), ("b", 2510),
              ("b", 3700)]
    assert own._bytes_per_pass(opened, 2) == [1190, 1210, 1200]
    with pytest.raises(RuntimeError, match=r"pass 1 of the own suite's input opened a file "
                                           r"twice \(\['a', 'a'\]\)"):
        own._bytes_per_pass([("a", 0), ("b", 0), ("a", 5), ("a", 6)], 2)


def test_own_model_worker_alternates_which_side_goes_first(monkeypatch):
    # The pairs go built-in then own, own then built-in, ...: drift and going
    # second hit both sides alike. The clock is replaced (it returns each
    # call's position, plus 100 on the own side) to see the order and the
    # pairing; the runs are real.
    from tfmulti.insight import timing

    calls = []

    def clock(model, dist_input, steps, epochs=2):
        calls.append("own" if model.name == "user_mlp" else "builtin")
        return [len(calls) + (100.0 if calls[-1] == "own" else 0.0)] * (epochs - 1)

    monkeypatch.setattr(timing, "time_fit", clock)
    monkeypatch.setattr(own, "_train_step_ops", lambda run: {})  # needs a trained model
    out = own.model_worker(repeats=2, global_batch_size=32, steps_per_execution=2,
                           num_examples=128, pairs_per_repeat=2, seconds=0.01)
    assert calls == ["builtin", "own"] + ["builtin", "own", "own", "builtin"] * 2
    assert out["builtin_seconds_per_step"] == [3.0, 6.0, 7.0, 10.0]
    assert out["own_seconds_per_step"] == [104.0, 105.0, 108.0, 109.0]
    assert out["ratios"] == [209.0 / 9.0, 217.0 / 17.0]


@pytest.mark.slow  # trains for seconds
def test_own_model_worker_times_both_paths_in_turn():
    out = own.model_worker(repeats=2, global_batch_size=64, steps_per_execution=4,
                           num_examples=512, pairs_per_repeat=1, seconds=0.01)
    assert out["params"] == {"builtin": 407050, "own": 407050}
    assert out["same_initial_weights"] is True
    ops = out["train_step_ops"]
    assert ops["own"] == ops["builtin"] and ops["own"]["MatMul"] == 5  # 2 forward, 3 backward
    assert out["steps_per_epoch"] % 4 == 0
    own_s, builtin_s = out["own_seconds_per_step"], out["builtin_seconds_per_step"]
    assert len(own_s) == len(builtin_s) == 2 and min(own_s + builtin_s) > 0
    assert out["ratios"] == pytest.approx([own_s[0] / builtin_s[0], own_s[1] / builtin_s[1]])


@pytest.mark.cluster
@two_cores
def test_own_suite_runs_end_to_end(monkeypatch, capsys):
    """The whole suite at a toy size: every figure in its record, and the
    file launches read what they should: by files each worker opens only its
    own half of the files and reads about half the bytes of a worker reading
    by examples (bytes, not time: exact enough to assert). The launches are
    real; the other workers run in this process (the same functions), to
    keep the test short."""
    monkeypatch.setattr(_harness, "run_worker",
                        lambda kind, timeout=None, **config: worker.run(kind, config))
    # The own-model part at its toy size too (the file launches' sizes are below), and
    # the hardware ceiling's (2 spinning processes for 0.2 s, not 2 s: CPU the suite
    # would spend on a figure the test only checks is there).
    monkeypatch.setattr(own, "MODEL_SETTINGS", {**own.MODEL_SETTINGS, **own.TOY["model"]})
    monkeypatch.setattr(_harness, "ceiling_seconds", lambda seconds: _harness.TOY_CEILING_SECONDS)
    r = bench.run_suite("own", 1, epoch_seconds=0.1, num_files=4, examples_per_file=128,
                        per_worker_batch=64, epochs=2)
    assert json.loads(json.dumps(r)) == r
    for key in ("own_vs_builtin", "bytes_per_worker_ratio", "file_bytes_per_worker_ratio",
                "scaling_examples", "scaling_files", "files_vs_examples_scaling",
                "hardware_ceiling"):
        assert r[key]["n"] >= 1 and r[key]["median"] > 0, key
    assert r["params"] == {"builtin": 407050, "own": 407050} and r["same_initial_weights"]
    assert r["same_train_step"] and r["train_step_ops"]["own"]["ResourceApplyAdam"] == 4
    assert r["files_steps_per_execution"] == 4 and r["rounds"] == 1
    assert list(r["examples_per_second"]) == ["1_worker", "2_workers_by_examples",
                                              "2_workers_by_files"]
    assert all(len(v) == 1 for v in r["examples_per_second"].values())
    opened = r["files_opened_per_worker"]
    files = [os.path.basename(f) for f in opened["1_worker"][0]]
    assert files == [f"part-00{i}-of-004.tfrecord" for i in range(4)]
    assert opened["2_workers_by_examples"] == opened["1_worker"] * 2
    assert [[os.path.basename(f) for f in w] for w in opened["2_workers_by_files"]] == [
        files[0::2], files[1::2]]
    assert r["file_bytes_per_worker_ratio"]["median"] == pytest.approx(0.5)
    assert r["bytes_per_worker_ratio"]["median"] == pytest.approx(0.5, abs=0.03)
    held = r["file_bytes_per_worker_per_pass"]["2_workers_by_examples"][0]
    assert held == r["file_bytes"]
    assert r["bytes_read_per_worker_per_pass"]["2_workers_by_examples"][0] == pytest.approx(
        held, rel=0.03)
    lines = own.summarize(r)
    assert lines[0].startswith("own: own model function / built-in mlp, fit seconds per step")
    assert lines[1].startswith("own: 2 pinned workers by files / by examples, bytes read per "
                               "worker 0.5")
    assert "own round 1/1: 2 vs 1 pinned workers by examples" in capsys.readouterr().out
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    own.plot(r, ax)
    assert ax.get_title().startswith("Own: own model / built-in ")
    plt.close(fig)
