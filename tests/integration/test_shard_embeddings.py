"""Tables sharded by rows (`shard_embeddings`) on 2 workers started by
`tfmulti launch`: the run trains to the weights of the unsharded one, each
worker holding half of each table's rows; killed mid-epoch, it resumes to
them; its backup resumes on one device. (Mirrored x 4, in process:
tests/unit/test_shard_embeddings.py.)"""

from __future__ import annotations

import json
import math
import shutil

import keras
import numpy as np
import pytest

import tfmulti
from tests._util import WORKERS, launch_python
from tests.tables import ITEMS, USERS, WIDTH, clicks, two_tower
from tests.workers.shard_embeddings import SETTINGS


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_two_workers_train_sharded_tables_to_the_unsharded_weights(tmp_path):
    code, output = launch_python([str(WORKERS / "shard_embeddings.py"), str(tmp_path)],
                                 max_restarts=1, grace_period=30)
    assert code == 0, output[-4000:]
    assert "worker 1 failed with exit code 137 (killed by SIGKILL)" in output, output[-4000:]
    whole_model = keras.models.load_model(tmp_path / "whole" / "model.keras")
    whole = whole_model.get_weights()
    for name in ("sharded", "killed"):
        # The weights, and the optimizer's slots (gathered by the chief straight into files,
        # a piece at a time, at the end of the run): the unsharded run's.
        model = keras.models.load_model(tmp_path / name / "model.keras")
        for a, b in zip(model.get_weights(), whole, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        assert len(model.optimizer.variables) == len(whole_model.optimizer.variables) > 2
        for a, b in zip(model.optimizer.variables, whole_model.optimizer.variables, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    metrics = json.loads((tmp_path / "sharded" / "metrics.json").read_text())
    assert metrics["num_workers"] == 2
    dense = sum(w.size for w in whole) - (USERS + ITEMS) * WIDTH
    rows = math.ceil(USERS / 2) + math.ceil(ITEMS / 2)
    (held,) = metrics["parameter_bytes"].values()  # the chief's device
    assert held == 4 * (rows * WIDTH + dense), metrics["parameter_bytes"]
    assert "tfmulti: shard_embeddings: items_table (37 x 8), users (1,001 x 8) split by rows " \
           "over 2 replicas" in output, output[-4000:]

    killed = json.loads((tmp_path / "killed" / "metrics.json").read_text())
    resumed_at = killed["resumed_from_step"]
    assert resumed_at % killed["steps_per_epoch"] != 0, resumed_at  # mid-epoch
    assert killed["epochs_completed"] == 2

    # The 2 workers' backup (the tables whole in it) resumed on one device: its weights.
    shutil.copytree(tmp_path / "sharded_backup", tmp_path / "one_device_backup")
    tfmulti.train(tfmulti.TrainConfig(
        **{**SETTINGS, "distribution": "one_device", "model": two_tower, "dataset": clicks},
        backup_dir=str(tmp_path / "one_device_backup"), model_dir=str(tmp_path / "one")))
    resumed = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert resumed["resumed_from_step"] == 2 * resumed["steps_per_epoch"], resumed
    sharded = keras.models.load_model(tmp_path / "sharded" / "model.keras").get_weights()
    got = keras.models.load_model(tmp_path / "one" / "model.keras").get_weights()
    for a, b in zip(got, sharded, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
