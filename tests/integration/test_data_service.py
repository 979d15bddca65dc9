"""The training input read from a tf.data service (`tfmulti.data.service`):
the same batches in the same order as without it, every example once per
epoch (counted by id: in-process pipelines of 1 and 2 workers on 1 and 2
service workers, and `tfmulti launch --data_service 1` with 2 workers), one
line for what cannot work, and a service worker killed mid-run that stops
the job in one line instead of hanging, then resumes from its backup."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tests import service_data
from tests._util import REPO, cli_main, free_port

# ---------------------------------------------------------------- no process


@pytest.mark.parametrize("value, expected", [
    ("local", "local:1"), ("local:2", "local:2"), ("grpc://node7:5050", "grpc://node7:5050"),
    ("node7:5050", "grpc://node7:5050")])
def test_the_forms_of_data_service(value, expected):
    from tfmulti.config.train_config import data_service_target

    assert data_service_target(value) == expected


@pytest.mark.parametrize("value, says", [
    ("local:0", "N in local:N must be a number of service workers"),
    ("http://node7:5050", "the tf.data service speaks grpc"),
    ("node7", "is not an address"), ("grpc://node7:70000", "is not an address")])
def test_a_bad_data_service_is_one_line_before_tensorflow(value, says, capsys):
    code, err, _ = cli_main(["train", f"--data_service={value}"], capsys)
    assert code == 2 and len(err) == 1 and says in err[0], err


def test_a_dispatcher_that_does_not_answer_is_one_line():
    from tfmulti.data import service

    address = f"grpc://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=f"no tf.data service dispatcher answers at "
                                         f"{address}.*tfmulti data-service"):
        service.resolve(address)


def test_a_bad_environment_value_is_named(monkeypatch):
    from tfmulti.data import service

    monkeypatch.setenv("TFMULTI_DATA_SERVICE", "local:x")
    with pytest.raises(ValueError, match="^TFMULTI_DATA_SERVICE: `data_service` 'local:x'"):
        service.resolve(None)
    monkeypatch.delenv("TFMULTI_DATA_SERVICE")
    assert service.resolve(None) == (None, None)


def test_input_that_runs_python_is_refused_before_it_reaches_a_service():
    import tensorflow as tf

    from tfmulti.data import service

    def gen():
        yield from range(3)

    plain = tf.data.Dataset.range(8).map(lambda v: v * 2).batch(2)
    assert service.python_ops(plain) == []
    python = [tf.data.Dataset.from_generator(gen, output_signature=tf.TensorSpec((), tf.int64)),
              tf.data.Dataset.range(4).map(
                  lambda v: tf.py_function(lambda u: u + 1, [v], tf.int64))]
    for dataset in python:
        assert service.python_ops(dataset)
        with pytest.raises(ValueError, match="runs Python code .* a tf.data service worker "
                                             "cannot run"):
            service.through_service(dataset, "grpc://localhost:1")  # never connected


def test_the_served_inputs_end_is_recognized_by_tensorflows_own_message():
    """A repeating pipeline whose service stops serving ends early; the run
    names the service (`tfmulti.data.service.ServiceLost`) by the error that
    `through_service`'s cardinality check raises, whose words are TensorFlow's."""
    import tensorflow as tf

    from tfmulti.data import service

    ended = tf.data.Dataset.range(2).apply(
        tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    with pytest.raises(tf.errors.OpError) as error:
        list(ended)
    assert service.is_service_end(error.value)
    assert not service.is_service_end(tf.errors.InvalidArgumentError(None, None, "other"))


@pytest.mark.parametrize("argv, says", [
    (["--cpus=4096"], "--cpus '4096': this process may use cores"),
    (["--cpus=a"], "is not a list of cores"),
    (["--workers=0"], "--workers"),
    (["--dispatcher=node7:5050", "--port=5000"], "drop one of them")])
def test_data_service_command_checks_its_flags_first(argv, says, capsys):
    code, err, _ = cli_main(["data-service", *argv], capsys)
    assert code == 2 and len(err) == 1 and says in err[0], err


# ---------------------------------------------------------------- service workers


def _ids_per_pass(service_address, pipelines: int, steps: int, passes: int) -> list:
    """The ids each of `pipelines` input pipelines (as the workers of a
    multi-worker job) reads in `passes` epochs of `steps` global batches of 64."""
    import tensorflow as tf

    from tfmulti.data import input_pipeline

    train = service_data.dataset()["train"]
    read = []
    for index in range(pipelines):
        ctx = tf.distribute.InputContext(num_input_pipelines=pipelines,
                                         input_pipeline_id=index, num_replicas_in_sync=pipelines)
        dataset = input_pipeline(lambda: train, ctx, 64, training=True, seed=3,
                                 shuffle_buffer=512, cache=True, map_fn=None, repeat=True,
                                 data_service=service_address)
        batches = iter(dataset)
        read.append([[int(i) for _ in range(steps) for i in next(batches)[0][:, 0]]
                     for _ in range(passes)])
    return read


@pytest.mark.slow
@pytest.mark.parametrize("service_workers", [1, 2])
def test_the_service_serves_each_pipelines_batches_in_order_each_example_once(service_workers):
    from tfmulti.data.service import LocalService

    steps = service_data.NUM_EXAMPLES // 64
    for pipelines in (1, 2):
        expected = _ids_per_pass(None, pipelines, steps, 2)
        with LocalService(service_workers) as service:
            served = _ids_per_pass(service.target, pipelines, steps, 2)
        assert served == expected  # the same batches, in the same order
        for epoch in range(2):
            ids = sorted(i for worker in served for i in worker[epoch])
            assert ids == list(range(service_data.NUM_EXAMPLES))  # once per epoch
        assert served[0][0] != served[0][1]  # each epoch in a new order


# ---------------------------------------------------------------- tfmulti launch

COMMON = ["--distribution=multi_worker", "--dataset=tests.service_data:dataset",
          "--model=tests.service_data:model", "--callbacks=tests.service_data:callbacks",
          "--global_batch_size=64", "--seed=0", "--verbose=0"]


def _launch(args: list[str], train: list[str], marker: Path, counts: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tfmulti.cli", "launch", "--num_workers", "2", *args, "--",
         sys.executable, "-m", "tfmulti.cli", "train", *COMMON, *train,
         f"--model_dir={marker}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "SERVICE_COUNTS": str(counts),
             "PYTHONPATH": str(REPO)})


def _counts(path: Path) -> list[list[int]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _service_workers_of(marker: Path) -> list[int]:
    """Live tf.data service workers whose parent's command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.name.isdigit() and b"tfmulti.data.service_worker" in \
                    (entry / "cmdline").read_bytes():
                parent = (entry / "stat").read_text().rpartition(")")[2].split()[1]
                if str(marker).encode() in Path(f"/proc/{parent}/cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_two_workers_train_from_the_service_each_example_once_per_epoch(tmp_path):
    import keras

    import tfmulti
    from tfmulti.config.train_config import TrainConfig

    marker, counts = tmp_path / "run", tmp_path / "counts.jsonl"
    proc = _launch(["--data_service", "1"], ["--epochs=2"], marker, counts)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    assert output.count("(1 worker on this host, started with the run)") == 2  # one each
    per_epoch = _counts(counts)
    assert [sorted(set(c)) for c in per_epoch] == [[1], [2]]  # every id once per epoch
    assert not _service_workers_of(marker)  # stopped with the run
    # The batches of one device (examples sharding is exact): the same weights.
    reference = tfmulti.train(TrainConfig(
        dataset="tests.service_data:dataset", model="tests.service_data:model",
        global_batch_size=64, seed=0, verbose=0, epochs=2, model_dir=str(tmp_path / "one")))
    trained = keras.saving.load_model(marker / "model.keras", compile=False)
    alone = keras.saving.load_model(tmp_path / "one" / "model.keras", compile=False)
    for a, b in zip(trained.get_weights(), alone.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert json.loads((marker / "metrics.json").read_text())["test_accuracy"] == \
        pytest.approx(reference["test_accuracy"], abs=1e-6)


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_a_service_worker_killed_mid_epoch_stops_the_job_in_a_line_and_it_resumes(tmp_path):
    marker, counts = tmp_path / "run", tmp_path / "counts.jsonl"
    proc = _launch(["--data_service", "1", "--max_restarts", "1"],
                   ["--epochs=12", "--steps_per_execution=1", "--data_service_timeout=8",
                    f"--backup_dir={tmp_path / 'backup'}", "--backup_every_steps=4"],
                   marker, counts)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        # 12 epochs, a step a call, a backup every 4 steps; killed after the first epoch
        for _ in range(2400):
            if _counts(counts) or proc.poll() is not None:
                break
            threading.Event().wait(0.1)
        killed = _service_workers_of(marker)
        assert killed, "".join(lines[-40:])
        os.kill(killed[0], signal.SIGKILL)
        proc.wait(timeout=300)  # never a hang: the watch's 8 s, then the restart
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        reader.join(timeout=30)
    output = "".join(lines)
    assert proc.returncode == 0, output[-4000:]
    stopped = [line for line in lines if "no training step ended for" in line]
    assert stopped and all("reading its input from the tf.data service" in line
                           for line in stopped), output[-4000:]
    assert "Traceback" not in output
    assert "tfmulti: resuming from" in output  # from its backup, through a new service
    metrics = json.loads((marker / "metrics.json").read_text())
    assert metrics["epochs_completed"] == 12



# ---------------------------------------------------------------- diagnose


def _costly_batches(x, y):
    """A per-batch map in TensorFlow ops far costlier than the MLP's step, and than
    the per-step overhead a loaded machine (the suite's other workers) adds to it."""
    import tensorflow as tf

    z = tf.reshape(x, [-1, 784])
    w = tf.constant(np.random.default_rng(0).standard_normal((784, 784)).astype("float32")
                    / 28.0)
    for _ in range(36):
        z = tf.tanh(tf.matmul(z, w))
    return tf.reshape(z, tf.shape(x)), y


@pytest.mark.slow  # trains for seconds, starts a service worker
def test_diagnose_measures_the_service_for_an_input_bound_step(monkeypatch):
    from tfmulti.config.train_config import TrainConfig
    from tfmulti.insight import diagnose, timing

    # Input-bound as diagnose classifies it: pinned to one core beside the suite's
    # other test processes, the input and the step share that core, and the
    # machine's load decided whether the step came out input- or overhead-bound
    # (red twice in fresh-clone runs). The classification is test_diagnose.py's; here
    # it is held at "input", and what follows from it is tested.
    monkeypatch.setattr(timing.StepTimes, "bottleneck", property(lambda self: "input"))

    from benchmarks import cpus

    every = sorted(os.sched_getaffinity(0))
    if len(every) < 2:
        pytest.skip("needs 2 cores: the trainer on one, the service worker on another")
    # As `taskset -c 0 tfmulti diagnose ...`: this process on the first core, so the
    # service worker goes to the other, which the trainer does not use.
    cpus._pin(cpus._threads(), {every[0]})  # pylint: disable=protected-access
    said = []
    try:
        d = diagnose.diagnose(
            TrainConfig(distribution="one_device", dataset="synthetic", num_examples=2048,
                        global_batch_size=64, steps_per_execution=8),
            batch_map_fn=_costly_batches, seconds=0.3, progress=said.append)
    finally:
        cpus._pin(cpus._threads(), set(every))  # pylint: disable=protected-access
    assert d.bottleneck == "input", d.format()
    where = f"CPUs {every[1:]}, which the trainer does not use"
    assert any(f"starting a tf.data service worker on {where}" in line for line in said), said
    # Measured, then ranked by its gain or noted as no gain. Whether it gains depends
    # on the other core being idle, which it is not while the suite's other workers
    # run: the gain is the input_service benchmark's (BENCHMARKS.md), not a test's.
    ranked = [a for a in d.advice if a.change == "run the input in a tf.data service worker"]
    if ranked:
        assert ranked[0].measured and ranked[0].expected_gain >= diagnose.MIN_GAIN
        assert ranked[0].flags == "--data_service=local"
        assert f"measured with a worker on {where}" in ranked[0].detail
    else:
        assert any(n.startswith("tried data_service='local': no gain") for n in d.notes), \
            d.format()


def test_the_watch_waits_longer_for_a_run_of_long_calls():
    from tfmulti.data.service import FIRST_STEP_FACTOR, SLOW_CALL_FACTOR, ServiceWatch

    watch = ServiceWatch("grpc://localhost:1", timeout_s=10)  # never started: no thread
    assert watch._limit() == 10 * FIRST_STEP_FACTOR  # pylint: disable=protected-access
    watch.progress()
    watch._last -= 30  # a call of 30 s  # pylint: disable=protected-access
    watch.progress()
    assert watch._limit() >= SLOW_CALL_FACTOR * 30  # pylint: disable=protected-access
    fast = ServiceWatch("grpc://localhost:1", timeout_s=10)
    fast.progress()
    fast.progress()
    assert fast._limit() == 10  # pylint: disable=protected-access
