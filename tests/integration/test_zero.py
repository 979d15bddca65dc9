"""Sharded data parallelism (ZeRO stages 1, 2 and 3) on 2 workers started by
`tfmulti launch`: each stage trains to the weights of stage 0, each worker
holds half of the optimizer's state (and at stage 3 half of the parameters), a sharded run killed mid-epoch resumes
to them, and a backup moves between 2 workers and one device either way as
the unsharded one does. (Mirrored x 4, in process:
tests/unit/test_zero.py.)"""

from __future__ import annotations

import json
import re
import shutil

import keras
import numpy as np
import pytest

import tfmulti
from tests._util import WORKERS, launch_python, run_python
from tests.workers.zero import SETTINGS


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_two_workers_train_every_stage_to_the_weights_of_stage_0(tmp_path):
    # A one-device run's backup, for the workers to resume at stages 0 and 1.
    tfmulti.train(tfmulti.TrainConfig(distribution="one_device", epochs=1, keep_backup=True,
                                      backup_dir=str(tmp_path / "one_device_backup0"),
                                      **SETTINGS))
    shutil.copytree(tmp_path / "one_device_backup0", tmp_path / "one_device_backup1")
    code, output = launch_python([str(WORKERS / "zero.py"), str(tmp_path)], max_restarts=1,
                                 grace_period=30)
    assert code == 0, output[-4000:]
    assert "worker 1 failed with exit code 137 (killed by SIGKILL)" in output, output[-4000:]
    whole = keras.models.load_model(tmp_path / "stage0" / "model.keras").get_weights()
    held = {}
    for stage in (0, 1, 2):
        metrics = json.loads((tmp_path / f"stage{stage}" / "metrics.json").read_text())
        assert (metrics["zero_stage"], metrics["num_workers"]) == (stage, 2)
        got = keras.models.load_model(tmp_path / f"stage{stage}" / "model.keras").get_weights()
        for a, b in zip(got, whole, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        # (printed again after the restart, from the published metrics)
        printed = set(re.findall(rf"\[worker (\d)\] stage {stage}: (\d+)", output))
        assert {worker for worker, _ in printed} == {"0", "1"}, output[-4000:]
        held[stage] = {int(n) for _, n in printed}
    # Each worker holds Adam's two moments of half of every parameter, the same on both.
    assert held[0] == {0}
    (one,) = held[1]
    assert held[2] == {one} and one > 0
    parameters = sum(w.size for w in whole)
    assert 2 * 4 * parameters / 2 <= one <= 2 * 4 * parameters / 2 + 2 * 4 * len(whole) + 64

    # Stage 3 against stage 0 of its settings (no accumulation loop): the same weights, and
    # each worker holds half of the parameters and half of Adam's moments.
    whole3 = keras.models.load_model(tmp_path / "stage3-0" / "model.keras").get_weights()
    metrics = json.loads((tmp_path / "stage3" / "metrics.json").read_text())
    assert (metrics["zero_stage"], metrics["num_workers"]) == (3, 2)
    got = keras.models.load_model(tmp_path / "stage3" / "model.keras").get_weights()
    for a, b in zip(got, whole3, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    (three,) = {int(n) for n in re.findall(r"\[worker \d\] stage3: (\d+)", output)}
    assert three == one, (three, one)  # the same slots' shards as stage 1
    (held_parameters,) = metrics["parameter_bytes"].values()
    assert 4 * parameters / 2 <= held_parameters <= 4 * parameters / 2 + 4 * len(whole)

    # The stage-1 run killed mid-epoch resumed from its last backup to stage 0's weights.
    metrics = json.loads((tmp_path / "killed" / "metrics.json").read_text())
    resumed_at = metrics["resumed_from_step"]
    assert resumed_at % metrics["steps_per_epoch"] != 0, resumed_at  # mid-epoch
    assert f"global step {resumed_at}" in output, output[-4000:]
    assert metrics["zero_stage"] == 1 and metrics["epochs_completed"] == 2
    got = keras.models.load_model(tmp_path / "killed" / "model.keras").get_weights()
    for a, b in zip(got, whole, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)

    # The 2 workers' backups (kept at the end of 2 epochs) resumed on one device for a third
    # epoch: the stage-1 backup, its slots whole under the unsharded keys, resumes as the
    # stage-0 one does, the optimizer's state included.
    resumed = {}
    for stage in (0, 1):
        tfmulti.train(tfmulti.TrainConfig(
            distribution="one_device", epochs=3, backup_dir=str(tmp_path / f"backup{stage}"),
            model_dir=str(tmp_path / f"one_device{stage}"), **SETTINGS))
        resumed[stage] = keras.models.load_model(tmp_path / f"one_device{stage}" / "model.keras")
    _assert_same_state(resumed[1], resumed[0])
    # And the reverse: a one-device backup resumed on the 2 workers at stage 1 as at stage 0.
    _assert_same_state(*(keras.models.load_model(tmp_path / f"resumed{stage}" / "model.keras")
                         for stage in (1, 0)))


def _assert_same_state(got, want):
    """The same weights and optimizer variables (1e-5), the step count included."""
    for a, b in zip(got.get_weights(), want.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert len(got.optimizer.variables) == len(want.optimizer.variables) > 2
    for a, b in zip(got.optimizer.variables, want.optimizer.variables, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_stage_3_holds_one_layers_gathered_parameters_at_a_time():
    """Each layer gathers its parameters at its call and again for its backward:
    a step of stage 3 holds, by the allocator's peak, at least half of the
    wholes' bytes less than the same step with the model gathered at once, less
    than stage 2's step, and trains to the same weights."""
    result = run_python([str(WORKERS / "zero_peak.py")],
                        env={"TF_CPU_ALLOCATOR_USE_BFC": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    runs = {name: out[name] for name in ("2", "3", "3-whole")}
    print({name: run["peak"] for name, run in runs.items()})
    # The wholes of all layers but one, on each of the 2 replicas' devices.
    saving = 2 * (out["parameter_bytes"] - out["layer_bytes"])
    assert runs["3"]["peak"] <= runs["3-whole"]["peak"] - 0.5 * saving, runs
    assert runs["3"]["peak"] < runs["2"]["peak"], runs
    for run in runs.values():
        assert run["weights"] == pytest.approx(runs["2"]["weights"], rel=1e-6)
