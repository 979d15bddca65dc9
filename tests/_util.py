"""Helpers shared by the tests: fresh Python processes, recipe runs and local
clusters, each with a timeout."""

from __future__ import annotations

import doctest
import gzip
import importlib
import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
WORKERS = REPO / "tests" / "workers"


def file_tree(path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under `path` (to prove nothing changed)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def run_python(args: list[str], timeout: float = 240, env: dict | None = None,
               cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Runs `python ARGS` in a fresh process (own TF runtime) with a timeout."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout,
        env=full_env, cwd=cwd or REPO,
    )


def run_recipe(name: str, *flags: str, timeout: float = 240,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `python recipes/NAME.py FLAGS` in a fresh process."""
    return run_python([str(RECIPES / f"{name}.py"), *flags], timeout=timeout, env=env)


def launch_local(command: list[str], num_workers: int = 2, startup_timeout: float = 120,
                 **options) -> tuple[int, str]:
    """Runs `command` as a local cluster with `tfmulti.cluster.launch` (isolated,
    every worker reaped): (exit status, everything the launcher printed)."""
    from tfmulti.cluster import launch

    out = io.StringIO()
    code = launch(command, num_workers=num_workers, output=out,
                  startup_timeout=startup_timeout, **options)
    return code, out.getvalue()


def launch_python(args: list[str], **options) -> tuple[int, str]:
    """`launch_local([python, *args])`."""
    return launch_local([sys.executable, *args], **options)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Shared by the unit and integration halves of a test file.


@pytest.fixture(scope="module")
def big_batch():
    """Plain Keras on one device, one update per global batch of 32 rows."""
    from tests.workers import accumulate

    return accumulate.reference()


def backup_xy():
    x = np.random.default_rng(0).random((256, 8), dtype=np.float32)
    return x, (x.sum(axis=1) > 4).astype(np.int32)


def backup_stream(step):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(backup_xy()).batch(32).repeat().skip(step)


class CrashAt:
    """A callback raising RuntimeError once the optimizer reaches `iteration`."""

    def __new__(cls, iteration):
        import keras

        class Crash(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if int(self.model.optimizer.iterations.numpy()) == iteration:
                    raise RuntimeError("simulated crash")

        return Crash()


def backup_model(units: int = 2):
    import keras

    keras.utils.set_random_seed(1)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(units)])
    m.compile(keras.optimizers.Adam(0.05),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def backup_fit(backup_dir, model=None, **kwargs):
    from tfmulti.training import backup

    args = dict(epochs=2, steps_per_epoch=8, save_every_steps=4, verbose=0)
    return backup.fit(model or backup_model(), backup_stream, backup_dir=str(backup_dir),
                      **{**args, **kwargs})


def backup_dict_stream(step):
    import tensorflow as tf

    from tests.workers import user_model

    x, y = user_model.examples(256, seed=5)
    dataset = tf.data.Dataset.from_tensor_slices((user_model.as_inputs(x), y))
    return dataset.batch(32).repeat().skip(step)


def cli_main(argv, capsys) -> tuple[int, list[str], str]:
    """`cli.main(argv)`: (exit code, stderr lines, stdout); argparse's exits count too."""
    from tfmulti import cli

    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.err.splitlines(), captured.out


def write_idx(path: Path, array: np.ndarray, truncate: int = 0) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    payload = header + array.astype(np.uint8).tobytes()
    with gzip.open(path, "wb") as f:
        f.write(payload[: len(payload) - truncate])


@pytest.fixture(scope="module")
def fake_idx(tmp_path_factory):
    """Tiny Fashion-MNIST IDX files: 12 train and 5 test images."""
    from tfmulti.data import catalog

    src = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(1234)
    arrays = {}
    for split, n in (("train", 12), ("test", 5)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        images[:, 0, 0] = np.arange(n)  # every image distinct
        images[0, 1, :2] = (0, 255)  # full value range present
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        image_file, label_file = catalog.FASHION_MNIST_FILES[split]
        write_idx(src / image_file, images)
        write_idx(src / label_file, labels)
        arrays[split] = (images, labels)
    return src, arrays


def docstring_examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    return [t for t in tests if t.examples]


def run_docstring_examples(name: str, tmp_path, monkeypatch) -> None:
    """Runs module `name`'s docstring examples in `tmp_path`; fails on any failure."""
    import keras

    tests = docstring_examples(name)
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    policy = keras.mixed_precision.global_policy()
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    try:
        for test in tests:
            runner.run(test, out=report.append)
    finally:
        keras.mixed_precision.set_global_policy(policy)
    assert runner.failures == 0, "".join(report)


def fake_slurm(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "3")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "cpu-[1-3]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x3)")


def assert_layout_equals_the_plain_model(figures: dict, devices: int) -> None:
    for key in ("forward", "gradients", "adam_losses", "adam_weights"):
        assert figures[key] <= 1e-5, (key, figures[key])
    assert figures["replicas_equal"]
    assert figures["slots_with_their_variable"]
    assert figures["variable_devices"] == [f"CPU:{i}" for i in range(devices)]
    # Each device holds the bytes the memory estimate gives it.
    assert figures["parameters_by_device"] == figures["estimated_parameters_by_device"]
