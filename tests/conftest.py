"""Test set-up: 4 virtual CPU devices, configured once per pytest process,
before anything starts the TensorFlow runtime."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

import tfmulti  # noqa: E402

NUM_TEST_DEVICES = 4
tfmulti.configure_virtual_devices(NUM_TEST_DEVICES)


@pytest.fixture(scope="session")
def fashion_mnist_data_dir() -> str:
    """The TFDS data dir holding real Fashion-MNIST (prepared from the Debian
    package's IDX files if needed; `make test` installs the package)."""
    from tfmulti import data

    return data.prepare_fashion_mnist(data.default_data_dir())
