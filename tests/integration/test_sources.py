"""tfmulti.data.sources and the data forms `distribute` takes: NumPy arrays,
dicts, pandas DataFrames, files bigger than memory, data of unknown size."""

from __future__ import annotations

import pytest

from tests import own_model


@pytest.mark.cluster
def test_two_workers_read_only_their_own_files_and_train_every_example_once(tmp_path):
    """File sharding on 2 workers: each worker opens only its own files, the
    two shares of an epoch hold every example once, and training matches one
    process over the same files (test loss within 3%: the same examples per
    epoch, in other global batches; see docs/concepts/data.md)."""
    import importlib.util
    import json

    from tests._util import WORKERS, cluster_python_warm

    folder = tmp_path / "files"
    folder.mkdir()
    paths = own_model.write_tfrecords(folder, num_files=6, per_file=64)
    pattern = str(folder / "part-*.tfrecord")
    multi, one = tmp_path / "multi", tmp_path / "one"
    multi.mkdir(), one.mkdir()
    code, output = cluster_python_warm([str(WORKERS / "file_sharding.py"), pattern, str(multi)])
    assert code == 0, output
    workers = [json.loads((multi / f"worker{i}.json").read_text()) for i in range(2)]
    assert [w["opened"] for w in workers] == [paths[0::2], paths[1::2]]
    assert all(w["sharding"] == "files" and w["steps_per_epoch"] == 12 for w in workers)
    assert sorted(workers[0]["epoch_ids"] + workers[1]["epoch_ids"]) == list(range(384))
    assert "counted 192 records in 3 files" in output

    spec = importlib.util.spec_from_file_location("file_sharding", WORKERS / "file_sharding.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    worker.main(pattern, str(one))  # the reference: one process, one device, every file
    reference = json.loads((one / "worker0.json").read_text())
    assert reference["opened"] == paths and sorted(reference["epoch_ids"]) == list(range(384))
    assert workers[0]["test_loss"] == pytest.approx(reference["test_loss"], rel=0.03)
    assert workers[0]["test_loss"] < 0.69  # both learned (chance: ln 2)
