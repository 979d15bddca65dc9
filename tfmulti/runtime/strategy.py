"""A string-keyed factory for `tf.distribute` strategies, with the upstream
Keras fixes each strategy needs applied (`tfmulti.runtime.keras_fixes`).

Example:
    >>> import tfmulti
    >>> _ = tfmulti.configure_virtual_devices(2)  # first, before other TensorFlow work
    >>> strategy = tfmulti.get_strategy("mirrored", devices=["CPU:0", "CPU:1"])
    >>> strategy.num_replicas_in_sync
    2
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import tensorflow as tf

from tfmulti.utils import checks
from tfmulti.utils import human
from tfmulti.config import train_config as config
from tfmulti.runtime import keras_fixes
from tfmulti.runtime import devices as devices_lib
from tfmulti.runtime.roles import ClusterRole, cluster_role  # noqa: F401  (part of this API)
from tfmulti.cluster import tf_config

__all__ = ["COMMUNICATIONS", "CROSS_DEVICE_OPS", "ClusterRole", "STRATEGY_KINDS", "cluster_role",
           "describe", "get_strategy", "slurm_cluster_resolver", "strategy_name"]

STRATEGY_KINDS = ("auto", "one_device", "mirrored", "multi_worker")
CROSS_DEVICE_OPS = config.CROSS_DEVICE_OPS
COMMUNICATIONS = ("auto", "ring", "nccl")
CLUSTER_RESOLVERS = config.CLUSTER_RESOLVERS
DEFAULT_STARTUP_TIMEOUT = 60.0


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
        # TensorFlow picks its collectives (CollectiveAllReduce): NCCL on GPUs, RING on
        # CPUs; reduction to one device where CPUs and GPUs mix.
        return None
    if name == "nccl":
        return tf.distribute.NcclAllReduce()
    if name == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce()
    return tf.distribute.ReductionToOneDevice()


def _default_mirrored_devices() -> list[str]:
    gpus = devices_lib.logical_devices("GPU")
    chosen = gpus if gpus else devices_lib.logical_devices("CPU")
    return [devices_lib.canonical_device_name(d) for d in chosen]


class _StartupWatchdog:
    """Stops this process if the cluster does not form within `timeout_s`.

    MultiWorkerMirroredStrategy blocks inside TensorFlow's C++ runtime, holding
    the GIL, until every peer has registered (for an hour by default), so the
    watchdog is a small separate process (`tfmulti.cluster.watchdog`): it names the
    peers that are not reachable and kills this process.
    """

    def __init__(self, timeout_s: float, peers: list[str], me: str | None):
        self._args = [str(os.getpid()), str(timeout_s), json.dumps(peers), str(me)]

    def __enter__(self):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tfmulti.cluster.watchdog", *self._args],
            stdin=subprocess.PIPE)
        return self

    def __exit__(self, *exc):
        self._proc.stdin.close()  # tells the watchdog we are through
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def slurm_cluster_resolver(port_base: int = 8888):
    """TensorFlow's `SlurmClusterResolver` (CPU-only nodes too: see
    `keras_fixes.slurm_cluster_resolver`).

    Raises:
        ValueError: not inside a SLURM job step (a SLURM_* variable is missing).
    """
    for var in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST",
                "SLURM_STEP_TASKS_PER_NODE"):
        if var not in os.environ:
            raise ValueError(
                f"cluster_resolver='slurm' needs {var} in the environment; run the "
                "script under `srun` inside a SLURM allocation.")
    return keras_fixes.slurm_cluster_resolver(port_base)


def _resolver_peers(resolver) -> tuple[list[str], str | None]:
    """(the other tasks' addresses, this task's) from a cluster resolver
    (TF_CONFIG's, SLURM's or the caller's); ([], None) when it cannot say."""
    try:
        spec = resolver.cluster_spec().as_dict()
        config = {"cluster": {job: list(tasks.values()) if isinstance(tasks, dict) else
                              list(tasks) for job, tasks in spec.items()},
                  "task": {"type": resolver.task_type, "index": int(resolver.task_id)}}
        return tf_config.peers(config), tf_config.task_address(config)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return [], None


def _startup_timeout_from_environ() -> float:
    text = os.environ.get("TFMULTI_STARTUP_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_STARTUP_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise ValueError(f"TFMULTI_STARTUP_TIMEOUT is {text!r}; set it to a number of seconds "
                         f"> 0, e.g. {DEFAULT_STARTUP_TIMEOUT:g}, or unset it.")
    return value


def _multi_worker(communication: str, collective_timeout: float | None,
                  startup_timeout: float | None, cluster_resolver):
    if communication not in COMMUNICATIONS:
        raise ValueError(f"`communication` must be one of {list(COMMUNICATIONS)}, "
                         f"got {communication!r}.")
    if communication == "nccl" and not tf.config.list_physical_devices("GPU"):
        raise ValueError("`communication='nccl'` needs GPUs; use 'ring' or 'auto' on CPUs.")
    checks.positive_number("collective_timeout", collective_timeout, none_ok=True)
    if startup_timeout is None:
        startup_timeout = _startup_timeout_from_environ()
    checks.positive_number("startup_timeout", startup_timeout)
    if cluster_resolver == "auto":
        slurm_tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
        cluster_resolver = ("slurm" if tf_config.from_environ() is None
                            and slurm_tasks.isascii() and slurm_tasks.isdigit()
                            and int(slurm_tasks) >= 2 else "tf_config")
    if cluster_resolver in (None, "tf_config"):
        config = tf_config.from_environ()
        if config is None:
            raise ValueError(
                "kind='multi_worker' needs TF_CONFIG describing the cluster; start the "
                "workers with `tfmulti launch --num_workers N -- python ...`, set "
                "TF_CONFIG on each host, or pass cluster_resolver='slurm'.")
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    elif cluster_resolver == "slurm":
        resolver = slurm_cluster_resolver()
    elif isinstance(cluster_resolver, tf.distribute.cluster_resolver.ClusterResolver):
        resolver = cluster_resolver
    else:
        raise ValueError(f"`cluster_resolver` must be one of {list(CLUSTER_RESOLVERS)} or a "
                         f"tf.distribute.cluster_resolver.ClusterResolver, got "
                         f"{cluster_resolver!r}.")
    key = _cluster_key(resolver, communication, collective_timeout)
    if key is not None and key in _MULTI_WORKER:
        return _MULTI_WORKER[key]
    peers, me = _resolver_peers(resolver)  # named if the cluster does not form
    options = tf.distribute.experimental.CommunicationOptions(
        implementation={
            "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
            "ring": tf.distribute.experimental.CommunicationImplementation.RING,
            "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
        }[communication],
        timeout_seconds=collective_timeout,
    )
    with _StartupWatchdog(startup_timeout, peers, me):
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver, communication_options=options)
    if key is not None:
        _MULTI_WORKER[key] = strategy
    return strategy


# The MultiWorkerMirroredStrategy of this process, per cluster and options. A
# second one for the same cluster (a second `tfmulti.train` in one script, a
# notebook cell run again) would re-enable collective ops on the running server:
# TensorFlow then resets this worker's rendezvous, and a peer already sending
# the next model's first broadcast fails ("Delete called on non-empty
# BufRendezvous"), then both workers do. The one strategy serves every model.
_MULTI_WORKER: dict = {}


def _cluster_key(resolver, communication: str, collective_timeout: float | None):
    """What makes two multi-worker strategies the same, or None when the resolver
    cannot say (then a new strategy is made, as TensorFlow would)."""
    try:
        spec = json.dumps(resolver.cluster_spec().as_dict(), sort_keys=True, default=str)
        return (spec, resolver.task_type, int(resolver.task_id),
                getattr(resolver, "rpc_layer", None), communication, collective_timeout)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _with_fixes(strategy: tf.distribute.Strategy) -> tf.distribute.Strategy:
    keras_fixes.apply_keras_fixes(strategy)
    return strategy


def get_strategy(
    kind: str = "auto",
    devices=None,
    cross_device_ops: str = "auto",
    *,
    communication: str = "auto",
    collective_timeout: float | None = None,
    startup_timeout: float | None = None,
    cluster_resolver=None,
) -> tf.distribute.Strategy:
    """Creates a distribution strategy by name.

    Kinds:
        * "one_device": `OneDeviceStrategy` on `devices[0]`, by default the
          first GPU, else CPU:0.
        * "mirrored": `MirroredStrategy` (synchronous data parallelism on one
          host) over `devices`, by default all GPUs, else all logical CPUs.
        * "multi_worker": `MultiWorkerMirroredStrategy` (synchronous data
          parallelism over processes or hosts) from TF_CONFIG (validated
          first, see `tfmulti.cluster`), or SLURM. One per process and
          cluster: a second call (a second `tfmulti.train` in one script)
          returns the first, since a new one would reset the running
          server's collectives under the peers' feet.
        * "auto" (default): "multi_worker" when a `cluster_resolver` is
          given, or under `tfmulti launch` (its TF_CONFIG lists 2 or more
          tasks; any other TF_CONFIG of 2 or more tasks is refused: pass
          "multi_worker" to join it); else, on a host with
          GPUs, "mirrored" over them when there are 2 or more and
          "one_device" on the one; without GPUs, "mirrored" over the logical
          CPUs when 2 or more were configured (see
          `configure_virtual_devices`), else "one_device".

    The strategy comes with the upstream Keras fixes it needs installed
    (`tfmulti.apply_keras_fixes(strategy)`: `fit` under
    MultiWorkerMirroredStrategy, several steps per call with 2+ replicas,
    convolutions on an empty batch, a model without `call` such as keras-io's
    GAN, optimizers built in a train step of the user's; the docs' page of
    upstream bugs lists them all); a "mirrored" one also has collective
    keys of its own, so several can live in one process. The first strategy
    that installs a fix prints one line to stderr naming them.

    Args:
        kind: one of "auto", "one_device", "mirrored", "multi_worker".
        devices (Sequence[str] | None): device names ("CPU:0", "/gpu:1", ...), or None for the
            default.
        cross_device_ops: how "mirrored" reduces gradients: "auto" (default,
            TensorFlow's choice: its collectives, ring on CPUs), "nccl" (GPUs),
            "hierarchical_copy" (GPUs), or "reduce_to_one" (any device).
        communication: "multi_worker" all-reduce: "auto" (default), "ring"
            (gRPC, any device) or "nccl" (GPUs).
        collective_timeout: "multi_worker": fail a collective that waits
            longer than this (default: no limit).
        startup_timeout: "multi_worker": give up if the peers have not all
            joined within this many seconds (default $TFMULTI_STARTUP_TIMEOUT
            or 60; TensorFlow's own is an hour): the process is then stopped
            (SIGKILL; TensorFlow's C++ runtime cannot be interrupted from
            Python) after a message naming the peers it waited for.
        cluster_resolver (str | tf.distribute.cluster_resolver.ClusterResolver | None):
            "multi_worker": "tf_config" (default), "slurm", "auto" (TF_CONFIG when set, else SLURM
            under `srun` with 2 or more tasks), or a
            `tf.distribute.cluster_resolver.ClusterResolver`; with kind "auto", naming one (other
            than "auto") means "multi_worker"; other kinds refuse it.

    Returns:
        A `tf.distribute.Strategy`.

    Raises:
        ValueError: an unknown `kind` or `cross_device_ops`, a device that does
            not exist, a cross-device op that the devices cannot use, more
            than one device for "one_device", or for "multi_worker": a missing
            or malformed TF_CONFIG (the message names the field and the fix),
            a bad communication option or timeout.
    """
    if kind not in STRATEGY_KINDS:
        raise ValueError(
            f"unknown strategy kind {kind!r}; valid kinds: {list(STRATEGY_KINDS)}."
        )
    if cluster_resolver == "auto" and kind != "multi_worker":
        cluster_resolver = None  # "auto" names no cluster: the kind decides
    if cluster_resolver is not None and kind not in ("auto", "multi_worker"):
        raise ValueError(f"`cluster_resolver` applies to 'multi_worker' (or 'auto'), not "
                         f"{kind!r}; drop it or use kind='multi_worker'.")
    if kind == "auto":
        if cluster_resolver is not None:  # a cluster was named: train on it
            kind = "multi_worker"
        else:
            config = tf_config.from_environ()
            if config is not None and tf_config.num_tasks(config) >= 2:
                if os.environ.get(tf_config.LAUNCHED_ENV) != "1":
                    # A TF_CONFIG nobody asked for here (left in a shell, set for
                    # another job) would open a port and wait for peers.
                    raise ValueError(
                        f"TF_CONFIG describes a {tf_config.num_tasks(config)}-task cluster, "
                        "but this process was not started by `tfmulti launch`, so kind='auto' "
                        "does not join it; pass kind='multi_worker' to join it, or unset "
                        "TF_CONFIG to train on this host alone.")
                kind = "multi_worker"
    if kind == "multi_worker":
        if devices is not None:
            raise ValueError("`devices` does not apply to 'multi_worker'; each worker uses "
                             "its local GPUs, else its CPU.")
        return _with_fixes(_multi_worker(communication, collective_timeout, startup_timeout,
                                         cluster_resolver))
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
        return _with_fixes(tf.distribute.OneDeviceStrategy(device))
    names = names or _default_mirrored_devices()
    return _with_fixes(keras_fixes.mirrored_strategy(
        devices=names, cross_device_ops=_cross_device_ops(cross_device_ops, names)))


def strategy_name(strategy: tf.distribute.Strategy) -> str:
    """The public name ("MultiWorkerMirroredStrategy", not its internal class)."""
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "MultiWorkerMirroredStrategy"
    return type(strategy).__name__


def describe(strategy: tf.distribute.Strategy) -> str:
    """One line naming the strategy, its replica count and this process's devices."""
    worker_devices = list(getattr(strategy.extended, "worker_devices", ()) or ())
    return (
        f"{strategy_name(strategy)} with "
        f"{human.count(strategy.num_replicas_in_sync, 'replica')}; local devices {worker_devices}"
    )
