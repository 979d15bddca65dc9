"""Paths with a URL scheme (gs://, s3://, ...): refused at validation, in one line.

tfmulti reads and writes its folders through the operating system (`open`,
`os.rename`, `flock`), so `gs://bucket/run` would be a local folder
`./gs:/bucket/run`; a bucket is used mounted (gcsfuse, s3fs), as a POSIX
path. The recipe's exit code and its start before TensorFlow are in
tests/integration/test_remote_paths.py.
"""

from __future__ import annotations

import os

import pytest

from tests._util import cli_main
from tfmulti.config import flags as config_flags
from tfmulti.config.train_config import TrainConfig, check_directory

URLS = ["gs://bucket/run", "s3://bucket/run", "hdfs://namenode:8020/run", "https://host/run",
        "file:///tmp/run", "GS://bucket/run"]
PATH_FIELDS = ["model_dir", "backup_dir", "data_dir"]


@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("field", PATH_FIELDS)
def test_a_url_path_is_refused_in_one_line_and_nothing_is_made(field, url, tmp_path,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)  # where `./gs:/bucket/run` was made
    with pytest.raises(ValueError) as raised:
        TrainConfig(**{field: url}).validate()
    message = str(raised.value)
    assert message.startswith(f"`{field}` {url!r} is a URL"), message
    assert "POSIX path" in message and "FUSE" in message and "NFS" in message
    assert "\n" not in message
    assert os.listdir(tmp_path) == []


def test_the_message_names_the_fuse_driver_of_the_scheme():
    with pytest.raises(ValueError, match="gcsfuse"):
        TrainConfig(model_dir="gs://bucket/run").validate()
    with pytest.raises(ValueError, match=r"\(s3fs for s3://\)"):
        TrainConfig(backup_dir="s3://bucket/backup").validate()


@pytest.mark.parametrize("path", ["runs/gs:/bucket", "/mnt/gcs/bucket/run", "run:1", "a//b"])
def test_posix_paths_that_look_alike_pass(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    TrainConfig(model_dir=path, backup_dir=os.path.join(path, "backup"), data_dir=path).validate()


def test_check_directory_refuses_a_url(tmp_path, monkeypatch):
    """The other tools' output folders (`diagnose --profile_dir`, `export --output`)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^`profile_dir` 's3://b/p' is a URL"):
        check_directory("profile_dir", "s3://b/p")
    assert os.listdir(tmp_path) == []


def test_flags_name_the_flag():
    message = config_flags.flag_message(_error(model_dir="gs://bucket/run"))
    assert message.startswith("--model_dir 'gs://bucket/run' is a URL"), message


def _error(**fields) -> str:
    with pytest.raises(ValueError) as raised:
        TrainConfig(**fields).validate()
    return str(raised.value)


def test_diagnose_refuses_a_url_data_dir_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err, out = cli_main(["diagnose", "--data_dir=gs://tfds-data/datasets"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "--data_dir 'gs://tfds-data/datasets' is a URL" in err[0]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("dataset", ["fashion_mnist", "tfmulti_text"])
def test_prepare_data_refuses_a_url_data_dir_in_one_line(dataset, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err, out = cli_main(["prepare-data", f"--dataset={dataset}",
                               "--data_dir=gs://tfds-data/datasets"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "'gs://tfds-data/datasets' is a URL" in err[0]
    assert os.listdir(tmp_path) == []  # no ./gs:/... folder
