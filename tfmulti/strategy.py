"""A string-keyed factory for `tf.distribute` strategies.

Example:
    >>> import tfmulti
    >>> tfmulti.configure_virtual_devices(2)
    >>> strategy = tfmulti.get_strategy("mirrored")
    >>> strategy.num_replicas_in_sync
    2
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti import devices as devices_lib
from tfmulti import keras_fixes

STRATEGY_KINDS = ("auto", "one_device", "mirrored")
CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduce_to_one")


def _cross_device_ops(name: str, device_names: list[str]):
    on_gpus = all(":GPU:" in d for d in device_names)
    if name in ("nccl", "hierarchical_copy") and not on_gpus:
        raise ValueError(
            f"`cross_device_ops={name!r}` needs GPU devices, got {device_names}; "
            "use 'reduce_to_one' or 'auto' for CPU devices."
        )
    if name == "nccl" and not tf.test.is_built_with_cuda():
        raise ValueError(
            "`cross_device_ops='nccl'` needs a CUDA build of TensorFlow; "
            "use 'hierarchical_copy' or 'reduce_to_one'."
        )
    if name == "auto":
        return None  # TensorFlow picks: NCCL on GPUs, reduction to one device otherwise.
    if name == "nccl":
        return tf.distribute.NcclAllReduce()
    if name == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce()
    return tf.distribute.ReductionToOneDevice()


def _default_mirrored_devices() -> list[str]:
    gpus = devices_lib.logical_devices("GPU")
    chosen = gpus if gpus else devices_lib.logical_devices("CPU")
    return [devices_lib.canonical_device_name(d) for d in chosen]


def get_strategy(
    kind: str = "auto",
    devices=None,
    cross_device_ops: str = "auto",
) -> tf.distribute.Strategy:
    """Creates a distribution strategy by name.

    Kinds:
        * "one_device": `OneDeviceStrategy` on `devices[0]`, by default the
          first GPU, else CPU:0.
        * "mirrored": `MirroredStrategy` (synchronous data parallelism on one
          host) over `devices`, by default all GPUs, else all logical CPUs.
        * "auto" (default): "mirrored" over the GPUs when there are 2 or more,
          else over the logical CPUs when 2 or more were configured (see
          `configure_virtual_devices`), else "one_device".

    Args:
        kind: one of "auto", "one_device", "mirrored".
        devices: device names ("CPU:0", "/gpu:1", ...), or None for the default.
        cross_device_ops: how "mirrored" reduces gradients: "auto" (default,
            TensorFlow's choice), "nccl" (GPUs), "hierarchical_copy" (GPUs),
            or "reduce_to_one" (any device).

    Returns:
        A `tf.distribute.Strategy`.

    Raises:
        ValueError: an unknown `kind` or `cross_device_ops`, a device that does
            not exist, a cross-device op that the devices cannot use, or more
            than one device for "one_device".
    """
    if kind not in STRATEGY_KINDS:
        raise ValueError(
            f"unknown strategy kind {kind!r}; valid kinds: {list(STRATEGY_KINDS)}."
        )
    if cross_device_ops not in CROSS_DEVICE_OPS:
        raise ValueError(
            f"`cross_device_ops` must be one of {list(CROSS_DEVICE_OPS)}, "
            f"got {cross_device_ops!r}."
        )
    names = devices_lib.resolve_devices(devices) if devices is not None else None
    if kind == "auto":
        names = names or _default_mirrored_devices()
        kind = "mirrored" if len(names) >= 2 else "one_device"
    if kind == "one_device":
        if names is not None and len(names) != 1:
            raise ValueError(
                f"'one_device' takes exactly one device, got {names}; use "
                "kind='mirrored' for several."
            )
        device = names[0] if names else _default_mirrored_devices()[0]
        return tf.distribute.OneDeviceStrategy(device)
    names = names or _default_mirrored_devices()
    return keras_fixes.mirrored_strategy(
        devices=names, cross_device_ops=_cross_device_ops(cross_device_ops, names)
    )


def describe(strategy: tf.distribute.Strategy) -> str:
    """One line naming the strategy, its replica count and devices."""
    extended = strategy.extended
    worker_devices = list(getattr(extended, "worker_devices", ()) or ())
    return (
        f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} "
        f"replica(s) on {worker_devices}"
    )
