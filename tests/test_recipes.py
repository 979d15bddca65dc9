"""The recipes and the `tfmulti` command, run as a user runs them."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests._util import REPO, run_python

TRAIN = str(REPO / "recipes" / "train.py")
TINY = ["--dataset=synthetic", "--num_examples=512", "--epochs=2", "--global_batch_size=64"]


def _tree(path) -> dict:
    """Relative path -> bytes of every file under `path` (to prove nothing changed)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def test_train_recipe_smoke(tmp_path):
    model_dir = tmp_path / "run"
    result = run_python([TRAIN, "--strategy=mirrored", "--num_virtual_devices=2", *TINY,
                         "--steps_per_execution=4", f"--model_dir={model_dir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["num_replicas"] == 2
    assert metrics["strategy"] == "MirroredStrategy"
    assert metrics["epochs_completed"] == 2
    assert metrics["steps_per_epoch"] == 512 // 64
    assert metrics["steps_per_execution"] == 4
    assert metrics["examples_per_second"] > 0
    assert len(metrics["epoch_seconds"]) == metrics["epochs_completed"]
    assert sum(metrics["epoch_seconds"]) == pytest.approx(metrics["train_seconds"])
    assert 0.0 <= metrics["test_accuracy"] <= 1.0 and metrics["test_loss"] > 0
    assert (model_dir / "model.keras").is_file()
    assert any((model_dir / "logs").rglob("events.out.tfevents.*"))
    assert not [p for p in model_dir.iterdir() if p.name.startswith(".tmp-")]
    assert "test_accuracy=" in result.stdout
    # The saved model loads and predicts in a fresh process.
    check = run_python(["-c", (
        "import keras, numpy as np, tfmulti.models;"
        f"m = keras.models.load_model({str(model_dir / 'model.keras')!r});"
        "print(m.predict(np.zeros((3, 28, 28, 1)), verbose=0).shape)")])
    assert check.returncode == 0, check.stderr[-2000:]
    assert "(3, 10)" in check.stdout


def test_train_recipe_regression_one_device(tmp_path):
    result = run_python([TRAIN, "--strategy=one_device", "--model=regression",
                         "--dataset=synthetic_regression", "--num_examples=256", "--epochs=1",
                         "--global_batch_size=32", "--optimizer=sgd", "--learning_rate=0.01",
                         f"--model_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["num_replicas"] == 1 and "test_mae" in metrics
    assert metrics["steps_per_execution"] == 8  # auto: all 256 / 32 = 8 steps in one call
    assert "8 steps/epoch, 8 per call" in result.stdout
    assert "test_accuracy" not in metrics


@pytest.mark.parametrize("strategy,devices,replicas", [("pipeline", 2, 1), ("hybrid", 4, 2)])
def test_train_recipe_pipeline_and_hybrid(tmp_path, strategy, devices, replicas):
    result = run_python([TRAIN, f"--strategy={strategy}", f"--num_virtual_devices={devices}",
                         "--num_stages=2", "--num_microbatches=4", "--model=cnn", *TINY,
                         f"--model_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["strategy"] == strategy and metrics["num_replicas"] == replicas
    assert metrics["per_replica_batch_size"] == metrics["global_batch_size"] // replicas
    assert metrics["num_stages"] == 2 and metrics["num_microbatches"] == 4
    assert sum(metrics["partition_sizes"]) == 7 and metrics["partition_balance"] >= 1.0
    assert "balance (max/mean stage cost" in result.stdout  # the partition table
    assert "optimizer_slots" in result.stdout  # the memory view
    # Saved unpartitioned: a plain Keras model.
    check = run_python(["-c", (
        "import keras, numpy as np;"
        f"m = keras.models.load_model({str(tmp_path / 'model.keras')!r});"
        "print(type(m).__name__, m.predict(np.zeros((3, 28, 28, 1)), verbose=0).shape)")])
    assert "Sequential (3, 10)" in check.stdout, check.stderr[-2000:]


@pytest.mark.parametrize("flag,key,value", [("--mixed_precision=bfloat16", "mixed_precision",
                                              "bfloat16"),
                                             ("--jit_compile", "jit_compile", True)])
def test_train_recipe_mixed_precision_and_xla(tmp_path, flag, key, value):
    result = run_python([TRAIN, "--strategy=one_device", "--dataset=synthetic",
                         "--num_examples=256", "--epochs=1", "--global_batch_size=64", flag,
                         f"--model_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics[key] == value
    assert metrics["epochs_completed"] == 1 and metrics["test_loss"] > 0


# Each bad configuration: its message, exit code 2, and model_dir untouched.
BAD_FLAGS = [
    (["--global_batch_size=10", "--num_virtual_devices=4", "--strategy=mirrored"],
     r"`global_batch_size` (10) must be divisible by the number of replicas (4)"),
    (["--strategy=bogus"], "flag --strategy=bogus"),
    (["--epochs=0"], "flag --epochs=0"),
    (["--lr_scaling=cubic"], "flag --lr_scaling=cubic"),
    (["--devices=CPU:9", "--num_virtual_devices=2"], "do not exist; available"),
    (["--cross_device_ops=nccl", "--num_virtual_devices=2", "--strategy=mirrored"],
     "needs GPU devices"),
    (["--model=regression"], "does regression but dataset 'synthetic' is a classification"),
    (["--warmup_epochs=-1"], "flag --warmup_epochs=-1"),
    (["stray_argument"], "unexpected arguments ['stray_argument']"),
    (["--steps_per_execution=3", "--global_batch_size=32"],  # 256 / 32 = 8 steps
     "`steps_per_execution` (3) must divide the steps per epoch (8)"),
    (["--steps_per_execution=many"],
     "`steps_per_execution` must be 'auto' or a positive integer, got 'many'"),
    (["--strategy=pipeline", "--global_batch_size=30", "--num_microbatches=4"],
     "`global_batch_size` (30) must split into 1 replica(s) x 4 micro-batches"),
    (["--strategy=pipeline", "--num_virtual_devices=2", "--num_stages=3"],
     "3 stages x 1 replica(s) need 3 devices, found 2"),
    (["--mixed_precision=float16"],  # the test machine has no GPU
     "`mixed_precision='float16'` needs a GPU and none was found; use "
     "--mixed_precision=bfloat16 on CPUs"),
    (["--strategy=pipeline", "--jit_compile"],
     "`jit_compile` cannot be used with strategy 'pipeline': XLA would compile"),
    (["--backup_every_steps=5"], "`backup_every_steps` needs `backup_dir`; pass --backup_dir"),
    (["--backup_dir=/dev/null"], "`backup_dir` '/dev/null' exists and is not a directory"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[f[0][0] for f in BAD_FLAGS])
def test_train_recipe_bad_flags(tmp_path, flags, message):
    model_dir = tmp_path / "existing_run"
    model_dir.mkdir()
    (model_dir / "keep.txt").write_text("previous results")
    before = _tree(model_dir)
    args = [TRAIN, "--dataset=synthetic", "--num_examples=256", f"--model_dir={model_dir}",
            *flags]
    result = run_python(args, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    # One line from the recipe (TensorFlow's C++ start-up log may precede it).
    error_lines = [line for line in result.stderr.splitlines()
                   if line.startswith("train.py: error:")]
    assert len(error_lines) == 1, result.stderr
    assert message in error_lines[0]
    assert _tree(model_dir) == before


def test_train_recipe_missing_dataset_fails_fast(tmp_path):
    model_dir = tmp_path / "new_run"
    result = run_python([TRAIN, "--dataset=cifar10", f"--data_dir={tmp_path / 'empty'}",
                         f"--model_dir={model_dir}"], timeout=60)
    assert result.returncode == 2
    assert "dataset 'cifar10' not found" in result.stderr and "--download" in result.stderr
    assert not model_dir.exists()


def test_seed_examples_data_parallel_matches_single_device():
    result = run_python([str(REPO / "recipes" / "seed_examples.py"), "--example=data_parallel",
                         "--dataset=synthetic", "--num_examples=512"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("batch (25, 28, 28, 1)") == 4
    diff = float(result.stdout.split("max gradient difference")[1].split()[0])
    assert diff < 1e-5


def test_seed_examples_optimizers_compares_both():
    result = run_python([str(REPO / "recipes" / "seed_examples.py"), "--example=optimizers",
                         "--dataset=synthetic", "--num_examples=400", "--epochs=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "adam=" in result.stdout and "sgd=" in result.stdout
    assert len([l for l in result.stdout.splitlines() if l.strip()[:1].isdigit()]) == 2


def test_cli_env_json():
    result = run_python(["-m", "tfmulti.cli", "env", "--json", "--num_virtual_devices=3"])
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    for key in ("python", "tensorflow", "keras", "tensorflow_datasets", "absl_py",
                "physical_devices", "logical_devices", "gpus", "nccl_usable", "cpu_count",
                "cpu_model", "onednn", "ram_bytes", "tf_config"):
        assert key in report, key
    assert report["python"] == ".".join(map(str, sys.version_info[:3]))
    assert report["tensorflow"].startswith("2.21")
    assert report["keras"].startswith("3.")
    assert len([d for d in report["logical_devices"] if ":CPU:" in d]) == 3
    assert report["cpu_count"] == os.cpu_count()
    assert report["onednn"] in (True, False)


def test_cli_env_reports_onednn_as_forced():
    # TF_ENABLE_ONEDNN_OPTS overrides TensorFlow's per-CPU default both ways.
    for value, expected in (("0", False), ("1", True)):
        result = run_python(["-m", "tfmulti.cli", "env", "--json"],
                            env={"TF_ENABLE_ONEDNN_OPTS": value})
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout)["onednn"] is expected, value


def test_benchmark_records_the_machine():
    # BENCHMARKS.md compares runs across machines: each run's JSON says which.
    result = run_python([str(REPO / "recipes" / "benchmark.py"), '--worker={"kind": "machine"}'])
    assert result.returncode == 0, result.stderr[-2000:]
    machine = json.loads(result.stdout.strip().splitlines()[-1])
    assert machine["cpu_count"] == os.cpu_count()
    assert machine["onednn"] in (True, False)
    assert machine["cpu_model"] and machine["tensorflow"].startswith("2.21")


def test_benchmark_pipeline_worker_times_each_configuration():
    # The pipeline suite's worker at a toy shape: every configuration timed
    # once per repeat, and the matmul rate measured at every row count.
    config = {"microbatches": {"naive": 1, "M=2": 2}, "inter_op": 0, "repeats": 2,
              "width": 64, "batch": 64, "steps": 1, "matmul_rows": True}
    result = run_python([str(REPO / "recipes" / "benchmark.py"),
                         f"--pipeline_worker={json.dumps(config)}"], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(out["step_seconds"]) == {"naive", "M=2"}
    assert all(len(t) == 2 and min(t) > 0 for t in out["step_seconds"].values())
    assert list(out["matmul_gflops_by_rows"]) == ["64", "128", "256", "384", "512", "1024"]
    assert min(out["matmul_gflops_by_rows"].values()) > 0


def test_cli_env_shows_tf_config():
    tf_config = {"cluster": {"worker": ["localhost:1234"]}, "task": {"type": "worker", "index": 0}}
    result = run_python(["-m", "tfmulti.cli", "env"], env={"TF_CONFIG": json.dumps(tf_config)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "localhost:1234" in result.stdout


def test_cli_prepare_data_missing_source(tmp_path):
    result = run_python(["-m", "tfmulti.cli", "prepare-data", f"--source_dir={tmp_path}",
                         f"--data_dir={tmp_path / 'tfds'}"], timeout=60)
    assert result.returncode == 2
    assert "Fashion-MNIST IDX files not found" in result.stderr
    assert not (tmp_path / "tfds").exists()
