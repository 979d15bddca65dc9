"""Python loaders on 2 workers: a `keras.utils.PyDataset` read by its own 2
processes in each worker of `tfmulti launch` (each worker reads its own batches;
every batch once per epoch across them), an
endless generator of examples with `--steps_per_epoch`; each trains to the
accuracy of the same examples given as arrays on one device."""

from __future__ import annotations

import json
import os

import pytest

from tests._util import RECIPES, REPO, cluster_python_warm, launch_python

COMMON = ["--model=tests.loader_data:model", "--global_batch_size=64", "--epochs=4",
          "--seed=0", "--learning_rate=0.01", "--verbose=0"]


@pytest.fixture(scope="module")
def reference_accuracy() -> float:
    """The same examples given as arrays, trained on one device (here, once for both
    tests: the same configuration each time)."""
    import tfmulti
    from tfmulti.config.train_config import TrainConfig

    metrics = tfmulti.train(TrainConfig(
        dataset="tests.loader_data:arrays", model="tests.loader_data:model",
        global_batch_size=64, epochs=4, seed=0, learning_rate=0.01, verbose=0))
    return metrics["test_accuracy"]


def _first_pass(log: str) -> tuple[list[int], set[int], int]:
    """The batch indices a worker read in its first pass (after the checks'
    reads, before its second pass began), the processes that read them, and
    the worker's own process (where the pass began)."""
    lines = [line.split() for line in log.splitlines()]
    names = [name for name, _ in lines]
    start = names.index("pass") + 1
    end = names.index("pass", start) if "pass" in names[start:] else len(names)
    return ([int(name) for name, _ in lines[start:end]],
            {int(pid) for _, pid in lines[start:end]}, int(lines[start - 1][1]))


@pytest.mark.cluster
def test_two_workers_each_read_their_own_batches_of_a_pydataset(tmp_path, monkeypatch,
                                                                 reference_accuracy):
    """In the launcher's namespaces, each worker's PyDataset forks its own
    processes (use_multiprocessing=True), which read that worker's batches."""
    logs, out = tmp_path / "reads", tmp_path / "run"
    logs.mkdir()
    monkeypatch.setenv("TFMULTI_TEST_LOADER_LOG", str(logs))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    code, output = launch_python([str(RECIPES / "train.py"), *COMMON,
                                  "--dataset=tests.loader_data:pydataset_processes",
                                  "--distribution=multi_worker", f"--model_dir={out}"])
    assert code == 0, output[-4000:]
    assert "input sharded by batches" in output
    assert "the PyDataset Blobs (32 batches of 32): its batches are split into examples" in output
    passes = [_first_pass((logs / f"worker{i}.log").read_text()) for i in range(2)]
    # each its own contiguous half of the indices; together every batch once
    assert [sorted(read) for read, _, _ in passes] == [list(range(16)), list(range(16, 32))]
    assert passes[0][0] != list(range(16))  # in an order drawn from the seed
    for _, readers, worker in passes:  # by the PyDataset's processes, not the worker's
        assert readers and worker not in readers
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["input_sharding"] == "batches" and metrics["steps_per_epoch"] == 16
    assert metrics["test_accuracy"] == pytest.approx(reference_accuracy, abs=0.05)


@pytest.mark.cluster
def test_two_workers_train_from_an_endless_generator_of_examples(tmp_path, reference_accuracy):
    out = tmp_path / "run"
    code, output = cluster_python_warm(
        [str(RECIPES / "train.py"), *COMMON, "--dataset=tests.loader_data:endless_examples",
         "--steps_per_epoch=16", "--distribution=multi_worker", f"--model_dir={out}"],
        cwd=REPO)
    assert code == 0, output[-4000:]
    # the same stream in both workers (its seed): each keeps its share of every batch
    assert "every worker reads all of the generator examples and keeps its share" in output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps_per_epoch"] == 16 and metrics["epochs_completed"] == 4
    assert metrics["test_accuracy"] == pytest.approx(reference_accuracy, abs=0.05)
    assert os.path.exists(out / "model.keras")
