"""MultiWorkerMirroredStrategy with Keras 3: equivalence, TF_CONFIG checks,
startup timeout, chief-only writes. Clusters are 2 processes on localhost
started by `tfmulti launch` (isolated network namespace), each with a timeout.
"""

from __future__ import annotations

import io
import json
import sys
import time

import numpy as np
import pytest

from tfmulti import launch
from tests._util import REPO, run_python

WORKER = str(REPO / "tests" / "workers" / "equivalence.py")


def _launch(args: list[str], timeout: float = 240, **kwargs) -> tuple[int, str]:
    out = io.StringIO()
    code = launch.launch([sys.executable, *args], num_workers=2, output=out,
                         startup_timeout=timeout, **kwargs)
    return code, out.getvalue()


def _load(path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("inputs", ["tuple", "dict"])
def test_two_workers_match_mirrored_two_devices(tmp_path, inputs):
    flag = ["--dict"] if inputs == "dict" else []
    single = run_python([WORKER, str(tmp_path / "mirrored.npz"), *flag], timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]
    code, output = _launch([WORKER, str(tmp_path / "workers.npz"), *flag])
    assert code == 0, output[-4000:]
    assert output.count("done") == 2
    a, b = _load(tmp_path / "mirrored.npz"), _load(tmp_path / "workers.npz")
    assert np.ptp(a["losses"]) > 1e-4  # the steps differ, so equality is not vacuous
    np.testing.assert_allclose(b["losses"], a["losses"], atol=1e-5, rtol=0)
    weights = sorted(k for k in a if k.startswith("w"))
    assert weights and weights == sorted(k for k in b if k.startswith("w"))
    for key in weights:
        np.testing.assert_allclose(b[key], a[key], atol=1e-5, rtol=0, err_msg=key)
    np.testing.assert_allclose(b["eval_loss"], a["eval_loss"], atol=1e-5)
    np.testing.assert_allclose(b["eval_accuracy"], a["eval_accuracy"], atol=1e-6)
    assert int(b["num_predictions"]) == int(a["num_predictions"]) == 160


def _train_recipe(model_dir, *flags: str) -> tuple[dict, str]:
    """recipes/train.py on 2 workers, synthetic data, 1 epoch: (metrics, output)."""
    code, output = _launch([str(REPO / "recipes" / "train.py"), "--strategy=multi_worker",
                            "--dataset=synthetic", "--epochs=1", *flags,
                            f"--model_dir={model_dir}"])
    assert code == 0, output[-4000:]
    return json.loads((model_dir / "metrics.json").read_text()), output


def test_train_recipe_two_workers_chief_only_writes(tmp_path):
    model_dir = tmp_path / "run"
    metrics, output = _train_recipe(model_dir, "--num_examples=512", "--global_batch_size=64",
                                    "--steps_per_execution=4")
    assert metrics["steps_per_execution"] == 4  # multi-step calls under multi-worker too
    assert metrics["strategy"] == "MultiWorkerMirroredStrategy"
    assert metrics["num_workers"] == 2 and metrics["num_replicas"] == 2
    assert (model_dir / "model.keras").is_file()
    # Only the chief wrote: one set of files, one TensorBoard run, no worker temp dirs.
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == ["logs", "metrics.json", "model.keras"], names
    assert "[worker 0] tfmulti: wrote" in output
    assert "[worker 1] tfmulti: wrote" not in output


def test_train_recipe_two_workers_conv_model_evaluates_a_partial_last_batch(tmp_path):
    # 256 test examples at global batch 512: worker 1's share of the only test
    # batch is empty, which crashed conv models under oneDNN (keras_fixes fix 6).
    import keras

    from tfmulti import data

    model_dir = tmp_path / "run"
    metrics, _ = _train_recipe(model_dir, "--model=cnn", "--num_examples=1024",
                               "--global_batch_size=512")
    test = data.load("synthetic", "test", num_examples=256)
    model = keras.models.load_model(model_dir / "model.keras")
    want = model.evaluate(test.batch(256), return_dict=True, verbose=0)
    assert metrics["test_accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)
    assert metrics["test_loss"] == pytest.approx(want["loss"], abs=1e-5)


def test_startup_timeout_names_missing_peer():
    # One task of a 2-task cluster whose peer never starts.
    tf_config = {"cluster": {"worker": ["localhost:1", "localhost:2"]},
                 "task": {"type": "worker", "index": 1}}
    code = ("import tfmulti, sys\n"
            "tfmulti.get_strategy('multi_worker', startup_timeout_s=3)\n"
            "print('formed')\n")
    start = time.monotonic()
    result = run_python(["-c", code], timeout=90, env={"TF_CONFIG": json.dumps(tf_config)})
    assert time.monotonic() - start < 60
    assert result.returncode != 0, result.stderr[-2000:]
    assert "did not form within 3 s" in result.stderr
    assert "localhost:1" in result.stderr and "formed" not in result.stdout


@pytest.mark.parametrize("text,match", [
    ("{not json", r"TF_CONFIG: not valid JSON"),
    ('{"clusters": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}',
     r"unknown key 'clusters' \(did you mean 'cluster'\?\)"),
    ('{"task": {"type": "worker", "index": 0}}', r"missing 'cluster'"),
    ('{"cluster": {"worker": ["a:1"]}}', r"missing 'task'"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "wroker", "index": 0}}',
     r"unknown task type 'wroker' \(did you mean 'worker'\?\)"),
    ('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}}',
     r"task.index 2 is out of range for 'worker', which has 2 task\(s\); use 0..1"),
    ('{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}',
     r"address 'a:1' appears twice"),
    ('{"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}',
     r"cluster.chief lists 2 tasks; there can be one chief"),
    ('{"cluster": {"wrkr": ["a:1"]}, "task": {"type": "worker", "index": 0}}',
     r"unknown job 'wrkr'"),
    ('{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}',
     r"use 'host:port'"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
     r"'cluster' has no 'chief' job"),
])
def test_malformed_tf_config_is_refused_fast(monkeypatch, text, match):
    import tfmulti

    monkeypatch.setenv("TF_CONFIG", text)
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        tfmulti.get_strategy("multi_worker")
    with pytest.raises(ValueError, match=match):
        tfmulti.get_strategy("auto")
    assert time.monotonic() - start < 1.0


def test_multi_worker_without_tf_config(monkeypatch):
    import tfmulti

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"needs TF_CONFIG .* `tfmulti launch"):
        tfmulti.get_strategy("multi_worker")


@pytest.mark.parametrize("kwargs,match", [
    ({"communication": "mpi"}, r"`communication` must be one of \['auto', 'ring', 'nccl'\]"),
    ({"communication": "nccl"}, r"needs GPUs"),
    ({"collective_timeout_s": 0}, r"`collective_timeout_s` must be positive"),
    ({"startup_timeout_s": -1}, r"`startup_timeout_s` must be positive"),
    ({"cluster_resolver": "k8s"}, r"`cluster_resolver` must be one of"),
    ({"devices": ["CPU:0"]}, r"`devices` does not apply"),
])
def test_multi_worker_bad_options(monkeypatch, kwargs, match):
    import tfmulti

    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["localhost:1", "localhost:2"]},
         "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match=match):
        tfmulti.get_strategy("multi_worker", **kwargs)


def test_slurm_resolver_from_fake_environment(monkeypatch):
    from tfmulti import strategy

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[07-08]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    resolver = strategy.slurm_cluster_resolver(port_base=9000)
    spec = resolver.cluster_spec().as_dict()
    assert spec == {"worker": ["node07:9000", "node07:9001", "node08:9000", "node08:9001"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    with pytest.raises(ValueError, match=r"needs SLURM_STEP_NODELIST .* `srun`"):
        strategy.slurm_cluster_resolver()


def test_worker_dying_mid_training_stops_the_run(tmp_path):
    import os

    class Timed(io.StringIO):
        died_at = None

        def write(self, text):
            if "worker 1 exits now" in text and self.died_at is None:
                self.died_at = time.monotonic()
            return super().write(text)

    out = Timed()
    code = launch.launch(
        [sys.executable, str(REPO / "tests" / "workers" / "die_mid_training.py"), str(tmp_path)],
        num_workers=2, output=out, grace_period=10)
    ended_at = time.monotonic()
    output = out.getvalue()
    assert code == 3, output[-3000:]
    assert out.died_at is not None, output[-3000:]
    assert ended_at - out.died_at < 30, output[-3000:]
    for rank in (0, 1):
        pid = int((tmp_path / f"worker-{rank}.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
