"""Sharded data parallelism (ZeRO stages 1 and 2) on 2 workers started by
`tfmulti launch`: each stage trains to the weights of stage 0, and each
worker holds half of the optimizer's state. (Mirrored x 4, in process:
tests/unit/test_zero.py.)"""

from __future__ import annotations

import json
import re

import keras
import numpy as np
import pytest

from tests._util import WORKERS, launch_python


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_two_workers_train_every_stage_to_the_weights_of_stage_0(tmp_path):
    code, output = launch_python([str(WORKERS / "zero.py"), str(tmp_path)])
    assert code == 0, output[-4000:]
    whole = keras.models.load_model(tmp_path / "stage0" / "model.keras").get_weights()
    held = {}
    for stage in (0, 1, 2):
        metrics = json.loads((tmp_path / f"stage{stage}" / "metrics.json").read_text())
        assert (metrics["zero_stage"], metrics["num_workers"]) == (stage, 2)
        got = keras.models.load_model(tmp_path / f"stage{stage}" / "model.keras").get_weights()
        for a, b in zip(got, whole, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        printed = re.findall(rf"\[worker \d\] stage {stage}: (\d+)", output)
        assert len(printed) == 2, output[-4000:]
        held[stage] = {int(n) for n in printed}
    # Each worker holds Adam's two moments of half of every parameter, the same on both.
    assert held[0] == {0}
    (one,) = held[1]
    assert held[2] == {one} and one > 0
    parameters = sum(w.size for w in whole)
    assert 2 * 4 * parameters / 2 <= one <= 2 * 4 * parameters / 2 + 2 * 4 * len(whole) + 64
