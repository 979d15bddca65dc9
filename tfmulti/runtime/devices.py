"""Logical (virtual) devices and device discovery.

This is the only module that changes `tf.config`. TensorFlow fixes the set of
logical devices when its runtime starts (the first tensor, strategy or device
listing), so `configure_virtual_devices` must run before any of those.

Example:
    >>> import tfmulti
    >>> tfmulti.configure_virtual_devices(4)   # before any other TF work
    ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti.utils import checks

__all__ = ["canonical_device_name", "configure_virtual_devices", "logical_devices",
           "resolve_devices"]

_DEVICE_TYPES = ("CPU", "GPU")


def _restart_hint() -> str:
    return (
        "call tfmulti.configure_virtual_devices() before any tensor, model or "
        "strategy is created (in a notebook: restart the kernel and call it in "
        "the first cell)"
    )


def configure_virtual_devices(
    num_devices: int,
    device_type: str = "CPU",
    memory_limit_mb: int | None = None,
) -> list[str]:
    """Splits one physical device into `num_devices` logical devices.

    On a CPU host this is how data and model parallelism are developed and
    tested without accelerators: each logical CPU device gets its own replica
    or pipeline stage, while all of them share the host's cores.

    Idempotent: when at least `num_devices` logical devices of this type are
    already configured, nothing changes.

    Args:
        num_devices: how many logical devices to create, at least 1.
        device_type: "CPU" (default) splits the host CPU; "GPU" splits the
            first GPU, which needs `memory_limit_mb`.
        memory_limit_mb: memory per logical GPU in MiB; required for "GPU",
            refused for "CPU".

    Returns:
        The logical device names, e.g. ["/device:CPU:0", "/device:CPU:1"].

    Raises:
        ValueError: `num_devices` < 1, an unknown `device_type`, a missing or
            superfluous `memory_limit_mb`, or no physical device of the type.
        RuntimeError: the TensorFlow runtime already started with fewer
            logical devices than requested.
    """
    device_type = str(device_type).upper()
    if device_type not in _DEVICE_TYPES:
        raise ValueError(
            f"`device_type` must be one of {list(_DEVICE_TYPES)}, got {device_type!r}."
        )
    checks.positive_int("num_devices", num_devices)
    if device_type == "CPU" and memory_limit_mb is not None:
        raise ValueError(
            "`memory_limit_mb` applies to logical GPUs only; drop it for CPU devices."
        )
    if device_type == "GPU" and (memory_limit_mb is None or memory_limit_mb <= 0):
        raise ValueError(
            "splitting a GPU needs `memory_limit_mb` (memory per logical GPU in "
            f"MiB, e.g. 1024), got {memory_limit_mb!r}."
        )
    physical = tf.config.list_physical_devices(device_type)
    if not physical:
        raise ValueError(
            f"no physical {device_type} device found; available: "
            f"{[d.name for d in tf.config.list_physical_devices()]}."
        )
    names = [f"/device:{device_type}:{i}" for i in range(num_devices)]
    current = tf.config.get_logical_device_configuration(physical[0])
    num_current = len(current) if current else 1
    if num_current >= num_devices and (current or num_devices == 1):
        return [f"/device:{device_type}:{i}" for i in range(num_current)]
    if device_type == "CPU":
        config = [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
    else:
        config = [
            tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)
            for _ in range(num_devices)
        ]
    try:
        tf.config.set_logical_device_configuration(physical[0], config)
    except RuntimeError as e:
        raise RuntimeError(
            f"cannot create {num_devices} logical {device_type} devices: the "
            f"TensorFlow runtime already started with {num_current}; "
            f"{_restart_hint()}."
        ) from e
    return names


def logical_devices(device_type: str | None = None) -> list[str]:
    """Names of the logical devices (starts the TensorFlow runtime)."""
    return [d.name for d in tf.config.list_logical_devices(device_type)]


def canonical_device_name(name: str) -> str:
    """Normalizes "cpu:1", "/CPU:1", "/device:CPU:1" to "/device:CPU:1".

    Raises:
        ValueError: the name is not of the form [/device:]TYPE:INDEX.
    """
    text = str(name).strip()
    spec = tf.DeviceSpec.from_string(text if text.startswith("/") else "/" + text)
    if spec.device_type is None or spec.device_index is None:
        raise ValueError(
            f"device {name!r} is not of the form 'TYPE:INDEX' (e.g. 'CPU:0' or "
            "'/device:GPU:1')."
        )
    return f"/device:{spec.device_type.upper()}:{spec.device_index}"


def resolve_devices(devices) -> list[str]:
    """Checks that every named device exists and returns canonical names.

    Raises:
        ValueError: an empty list, a duplicate, or a device that does not exist;
            the message lists the devices that do.
    """
    if isinstance(devices, str):
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise ValueError("`devices` is empty; pass at least one device, e.g. ['CPU:0'].")
    available = {
        canonical_device_name(d): d
        for d in logical_devices()
        if not d.endswith(tuple(f"_{t}:0" for t in ("XLA_CPU", "XLA_GPU")))
    }
    wanted = [canonical_device_name(d) for d in devices]
    missing = [d for d in wanted if d not in available]
    if missing:
        raise ValueError(
            f"device(s) {missing} do not exist; available: {sorted(available)}. "
            "Create more logical devices with tfmulti.configure_virtual_devices(n) "
            "before TensorFlow starts."
        )
    duplicates = sorted({d for d in wanted if wanted.count(d) > 1})
    if duplicates:
        raise ValueError(f"device(s) {duplicates} listed more than once in `devices`.")
    return wanted
