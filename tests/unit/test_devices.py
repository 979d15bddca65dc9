"""Tests for tfmulti.runtime.devices: virtual devices, name canonicalization, lookup.

conftest.py has configured 4 logical CPU devices in this process; the test
that needs a fresh TensorFlow runtime runs in a subprocess (marked slow).
"""

from __future__ import annotations


import pytest
import tensorflow as tf

from tfmulti.runtime import devices

NUM_DEVICES = 4  # configured by conftest.py
FOUR_CPUS = [f"/device:CPU:{i}" for i in range(NUM_DEVICES)]


# --------------------------------------------------------------------------
# configure_virtual_devices
# --------------------------------------------------------------------------

@pytest.mark.parametrize("requested", [1, 2, 4])
def test_configure_is_idempotent_when_enough_devices_exist(requested):
    cpu = tf.config.list_physical_devices("CPU")[0]
    before = tf.config.get_logical_device_configuration(cpu)
    assert devices.configure_virtual_devices(requested) == FOUR_CPUS
    after = tf.config.get_logical_device_configuration(cpu)
    assert len(after) == len(before) == NUM_DEVICES
    assert devices.logical_devices("CPU") == FOUR_CPUS


def test_logical_devices_lists_the_four_cpus():
    names = devices.logical_devices("CPU")
    assert len(names) == NUM_DEVICES
    assert [devices.canonical_device_name(n) for n in names] == FOUR_CPUS


@pytest.mark.parametrize("num_devices", [0, -1, "2", 2.0, True, None])
def test_bad_num_devices(num_devices):
    with pytest.raises(ValueError, match=r"`num_devices` must be a positive integer"):
        devices.configure_virtual_devices(num_devices)


@pytest.mark.parametrize("device_type", ["TPU", "", "cpu0"])
def test_bad_device_type(device_type):
    with pytest.raises(ValueError, match=r"`device_type` must be one of \['CPU', 'GPU'\]"):
        devices.configure_virtual_devices(2, device_type=device_type)


def test_memory_limit_refused_for_cpu():
    with pytest.raises(ValueError, match=r"`memory_limit_mb` applies to logical GPUs only"):
        devices.configure_virtual_devices(2, memory_limit_mb=1024)


@pytest.mark.parametrize("memory_limit_mb", [None, 0, -5])
def test_gpu_needs_memory_limit(memory_limit_mb):
    with pytest.raises(ValueError, match=r"splitting a GPU needs `memory_limit_mb`"):
        devices.configure_virtual_devices(2, device_type="GPU", memory_limit_mb=memory_limit_mb)


@pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")), reason="machine has a GPU")
def test_gpu_on_gpu_less_machine():
    with pytest.raises(ValueError, match=r"no physical GPU device found; available: ") as info:
        devices.configure_virtual_devices(2, device_type="gpu", memory_limit_mb=1024)
    assert "CPU:0" in str(info.value)


# --------------------------------------------------------------------------
# canonical_device_name
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name", [
    "cpu:1",
    "CPU:1",
    "/CPU:1",
    "/cpu:1",
    "/device:CPU:1",
    " /device:CPU:1 ",
    "/job:localhost/replica:0/task:0/device:CPU:1",
])
def test_canonical_device_name(name):
    assert devices.canonical_device_name(name) == "/device:CPU:1"


def test_canonical_device_name_gpu():
    assert devices.canonical_device_name("gpu:0") == "/device:GPU:0"


@pytest.mark.parametrize("name", ["banana", "CPU", "/job:localhost"])
def test_canonical_device_name_rejects_garbage(name):
    with pytest.raises(ValueError):
        devices.canonical_device_name(name)


def test_canonical_device_name_message():
    with pytest.raises(ValueError, match=r"is not of the form 'TYPE:INDEX'"):
        devices.canonical_device_name("CPU")


# --------------------------------------------------------------------------
# resolve_devices
# --------------------------------------------------------------------------

def test_resolve_devices_canonicalizes():
    assert devices.resolve_devices(["cpu:0", "/CPU:3"]) == ["/device:CPU:0", "/device:CPU:3"]
    assert devices.resolve_devices("CPU:2") == ["/device:CPU:2"]
    assert devices.resolve_devices(("CPU:1", "CPU:0")) == ["/device:CPU:1", "/device:CPU:0"]


def test_resolve_devices_missing_lists_available():
    with pytest.raises(ValueError, match=r"device\(s\) \['/device:CPU:9'\] do not exist; available: ") as info:
        devices.resolve_devices(["CPU:0", "CPU:9"])
    message = str(info.value)
    for name in FOUR_CPUS:
        assert name in message
    assert "configure_virtual_devices" in message


def test_resolve_devices_missing_gpu():
    with pytest.raises(ValueError, match=r"do not exist; available: "):
        devices.resolve_devices(["GPU:7"])


def test_resolve_devices_duplicates():
    with pytest.raises(ValueError, match=r"device\(s\) \['/device:CPU:1'\] listed more than once"):
        devices.resolve_devices(["CPU:1", "/device:CPU:1"])


@pytest.mark.parametrize("empty", [[], (), iter([])])
def test_resolve_devices_empty(empty):
    with pytest.raises(ValueError, match=r"`devices` is empty"):
        devices.resolve_devices(empty)
