"""Tests for tfmulti.runtime.strategy.get_strategy on the 4 virtual CPUs of conftest.py,
and MultiWorkerMirroredStrategy: its options and cluster resolvers in-process,
and 2 workers (each started with its TF_CONFIG) matching MirroredStrategy on 2 devices."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests._util import WORKERS, cluster_python_warm
from tfmulti.runtime.strategy import get_strategy


# --------------------------------------------------------------------------
# multi_worker: 2 workers on this host
# --------------------------------------------------------------------------

def _equivalence_worker():
    """tests/workers/equivalence.py as a module (its `run` makes the reference)."""
    spec = importlib.util.spec_from_file_location("equivalence_worker",
                                                  WORKERS / "equivalence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.cluster
def test_two_workers_match_mirrored_two_devices(tmp_path):
    # One cluster checks the tuple and the dict inputs and a plain all-reduce;
    # the MirroredStrategy reference runs in this process.
    worker = _equivalence_worker()
    code, output = cluster_python_warm([str(WORKERS / "equivalence.py"), str(tmp_path)])
    assert code == 0, output[-4000:]
    assert output.count("done") == 2
    lines = output.splitlines()
    assert "[worker 0] total=3.0" in lines and "[worker 1] total=3.0" in lines, output[-4000:]
    assert "[worker 0] same strategy=True" in lines, output[-4000:]
    mirrored = get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    for name, use_dict in worker.VARIANTS.items():
        a, b = worker.run(mirrored, use_dict), _load(tmp_path / f"{name}.npz")
        assert np.ptp(a["losses"]) > 1e-4, name  # the steps differ: equality is not vacuous
        np.testing.assert_allclose(b["losses"], a["losses"], atol=1e-5, rtol=0, err_msg=name)
        weights = sorted(k for k in a if k.startswith("w"))
        assert weights and weights == sorted(k for k in b if k.startswith("w")), name
        for key in weights:
            np.testing.assert_allclose(b[key], a[key], atol=1e-5, rtol=0,
                                       err_msg=f"{name} {key}")
        np.testing.assert_allclose(b["eval_loss"], a["eval_loss"], atol=1e-5, err_msg=name)
        np.testing.assert_allclose(b["eval_accuracy"], a["eval_accuracy"], atol=1e-6,
                                   err_msg=name)
        assert int(b["num_predictions"]) == int(a["num_predictions"]) == 160, name
