"""Who this process is in its cluster, and how its peers share small values.

The role comes from the strategy's cluster resolver (TF_CONFIG's, SLURM's or
any other), so the same rule holds however the cluster was described: the
chief writes (outputs, backups), the others do not. Small values (a count of
examples, a resume step) are shared through TensorFlow's coordination service,
which `MultiWorkerMirroredStrategy` starts; there is no other channel.

Example:
    >>> import tensorflow as tf
    >>> from tfmulti.runtime import roles
    >>> roles.cluster_role(tf.distribute.OneDeviceStrategy("CPU:0"))
    ClusterRole(task_type=None, task_index=0, worker_index=0, num_workers=1, is_chief=True)
"""

from __future__ import annotations

import dataclasses
import itertools

import tensorflow as tf

__all__ = ["ClusterRole", "all_gather_text", "cluster_role", "coordination_available",
           "coordination_store"]

_KEY = "tfmulti/gather/{name}/{call}/{rank}"
_calls = itertools.count()


@dataclasses.dataclass(frozen=True)
class ClusterRole:
    """This process's place in its cluster.

    Attributes:
        task_type: "chief" or "worker" in a cluster; None for a lone process.
        task_index: the index within `task_type` (0 for a lone process).
        worker_index: the rank among all training processes, chief first (0..N-1).
        num_workers: processes training together (chief and workers; 1 alone).
        is_chief: whether this process writes the run's outputs and backups
            (the chief, else worker 0; a lone process).
    """

    task_type: str | None = None
    task_index: int = 0
    worker_index: int = 0
    num_workers: int = 1
    is_chief: bool = True


def cluster_role(strategy: tf.distribute.Strategy | None = None) -> ClusterRole:
    """Who this process is, from `strategy`'s cluster resolver (TF_CONFIG's,
    SLURM's or any other), so the same rule holds however the cluster was
    described. A strategy of one process (one device, mirrored, a pipeline's
    default strategy, a `MultiWorkerMirroredStrategy` without a cluster) is a
    lone chief.

    Args:
        strategy: default: the current strategy (`tf.distribute.get_strategy()`).
    """
    strategy = strategy or tf.distribute.get_strategy()
    resolver = getattr(strategy, "cluster_resolver", None)
    if (resolver is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            or not strategy.extended._in_multi_worker_mode()):  # pylint: disable=protected-access
        return ClusterRole()
    spec = resolver.cluster_spec().as_dict()
    counts = {job: len(tasks) for job, tasks in spec.items()}
    task_type, task_index = resolver.task_type, int(resolver.task_id or 0)
    has_chief = counts.get("chief", 0) > 0
    rank = task_index + (counts.get("chief", 0) if task_type == "worker" else 0)
    return ClusterRole(
        task_type=task_type, task_index=task_index, worker_index=rank,
        num_workers=counts.get("chief", 0) + counts.get("worker", 0),
        is_chief=task_type == "chief" or (task_type == "worker" and task_index == 0
                                          and not has_chief))


def coordination_available() -> bool:
    """Whether TensorFlow's coordination service runs in this process (a
    multi-worker cluster).

    Example:
        >>> from tfmulti.runtime import roles
        >>> roles.coordination_available()  # a lone process
        False
    """
    from tensorflow.python.eager import context

    return context.context().coordination_service is not None


def coordination_store():
    """The coordination service's key-value store, for small values shared
    between the workers: `set_config_key_value(key, value)` (each key once)
    and `get_config_key_value(key, timeout_ms)` (waits until a worker sets
    it). Only where `coordination_available()`.
    """
    from tensorflow.python.eager import context

    return context.context()


def all_gather_text(name: str, value: str, role: ClusterRole, timeout_s: float) -> list[str]:
    """Every worker's `value`, in worker order, through the coordination service.

    Every worker must call it with the same `name`, in the same order of calls
    (each call has keys of its own). A lone process gets `[value]`.

    Raises:
        RuntimeError: a peer did not publish its value within `timeout_s`.
    """
    if role.num_workers == 1 or not coordination_available():
        return [value]
    call = next(_calls)
    kv = coordination_store()
    kv.set_config_key_value(_KEY.format(name=name, call=call, rank=role.worker_index), value)
    values = []
    for rank in range(role.num_workers):
        try:
            values.append(kv.get_config_key_value(
                _KEY.format(name=name, call=call, rank=rank), int(timeout_s * 1000)))
        except Exception as e:  # pylint: disable=broad-except  (DeadlineExceeded, peer gone)
            raise RuntimeError(f"worker {rank} did not share its {name} within {timeout_s:g} s "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                               "is every worker running the same program?") from e
    return values
