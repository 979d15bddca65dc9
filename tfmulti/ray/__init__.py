"""Training on Ray: a `TrainConfig` on N Ray workers through Ray Train's
`TensorflowTrainer` (an optional extra: `pip install "tfmulti[ray]"`).

    from tfmulti import TrainConfig
    from tfmulti.ray import train

    run = train(TrainConfig(dataset="synthetic", epochs=2, backup_every_steps=8),
                num_workers=2, max_failures=3)
    run.metrics["test_loss"], run.model_dir

Ray starts the workers and sets each one's `TF_CONFIG` (the workers' addresses,
its rank); each worker runs `tfmulti.training.train.train(config)` with
`distribution="multi_worker"`, so a run on Ray is a run under `tfmulti
launch`: the same upstream Keras fixes (`fit` under MultiWorkerMirroredStrategy
fails in plain Keras 3), the same input sharding, the chief (rank 0) writing
the outputs, the same resumable backup.

Faults: when a worker dies, Ray stops the others and starts the group again,
up to `max_failures` times (`ray.train.FailureConfig`); the new workers find the
backup and resume at the step after it, and the run ends with the weights of an
uninterrupted run. The backup is the user's `backup_dir`, else a folder in
Ray's storage for the run (`storage_path/name/backup`), and the outputs the
user's `model_dir`, else `storage_path/name/model`.

Which Ray: a Ray this process already joined (`ray.init(address=...)` before
calling `train`) is used and left as it was; else the cluster `RAY_ADDRESS`
names (`ray job submit` sets it) is joined and left at the end; else a local Ray
is started on this machine for the run and shut down after it (no process of
it stays). A `ray start` cluster on this machine is not joined unless asked.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import logging
import math
import os
import secrets

if importlib.util.find_spec("ray") is None:  # before anything else: the one missing piece
    raise ModuleNotFoundError('tfmulti.ray needs Ray: pip install "tfmulti[ray]"', name="ray")

from tfmulti.config.train_config import TrainConfig  # noqa: E402
from tfmulti.utils import checks  # noqa: E402

__all__ = ["RayRun", "train"]

ADDRESS_ENV = "RAY_ADDRESS"
"""The environment variable naming the Ray cluster to join (Ray's own)."""


@dataclasses.dataclass(frozen=True)
class RayRun:
    """What `train` did: the chief's metrics (those `tfmulti.train` returns:
    `test_loss`, `resumed_from_step`, examples per second, ...), where the chief
    published its outputs (`model_dir`: metrics.json, the model, logs/), the
    backup's folder (removed when the run ended, unless `keep_backup`; None
    with `backup=False`) and
    Ray's folder for the run (`storage_path/name`)."""

    metrics: dict
    model_dir: str
    backup_dir: str | None
    path: str


def _local(path: str | None) -> bool:
    return path is not None and "://" not in path


def _worker_config(config: TrainConfig, run_path: str, backup: bool = True) -> TrainConfig:
    """The config every worker trains: multi_worker from Ray's TF_CONFIG, the
    backup and outputs in the run's folder unless given, paths absolute (the
    workers do not share the caller's working directory)."""
    if config.distribution not in ("auto", "multi_worker"):
        raise ValueError(f"`distribution` is {config.distribution!r}, but on Ray each worker "
                         "is one replica group of MultiWorkerMirroredStrategy; use "
                         "distribution='multi_worker' (or 'auto').")
    if config.cluster_resolver not in ("auto", "tf_config"):
        raise ValueError(f"`cluster_resolver` is {config.cluster_resolver!r}, but Ray describes "
                         "the cluster in TF_CONFIG; use cluster_resolver='tf_config' (or "
                         "'auto').")
    if not backup and (config.backup_dir or config.backup_every_steps):
        raise ValueError("backup=False trains without a backup, but the config sets "
                         f"backup_dir ({config.backup_dir!r}) or backup_every_steps "
                         f"({config.backup_every_steps!r}); drop them or leave backup=True.")
    changes = {"distribution": "multi_worker", "cluster_resolver": "tf_config",
               "backup_dir": (config.backup_dir or os.path.join(run_path, "backup")
                              if backup else None),
               "model_dir": config.model_dir or os.path.join(run_path, "model")}
    for name in ("backup_dir", "model_dir", "data_dir"):
        path = changes.get(name, getattr(config, name))
        if _local(path):
            changes[name] = os.path.abspath(path)
    if not _local(changes["backup_dir"] or "/") or not _local(changes["model_dir"]):
        raise ValueError(f"Ray's storage for this run is {run_path!r}, which the workers cannot "
                         "write as files; pass backup_dir and model_dir on a filesystem every "
                         "worker mounts (NFS), or a local `storage_path`.")
    return dataclasses.replace(config, **changes)


def _default_name() -> str:
    """`tfmulti-`, the time and a random part: two runs started in the same second
    get folders of their own (a run's folder holds its outputs and backup)."""
    return datetime.datetime.now().strftime("tfmulti-%Y-%m-%d_%H-%M-%S-") + secrets.token_hex(3)


def _train_worker(loop_config: dict) -> dict:
    """One Ray worker: tfmulti's training run, in the cluster Ray's TF_CONFIG names."""
    # Ray's TensorFlow backend sets TF_USE_LEGACY_KERAS=1 (Keras 2's tf_keras for
    # `tf.keras`); tfmulti trains Keras 3 models.
    os.environ.pop("TF_USE_LEGACY_KERAS", None)
    # Ray Train's workers log at INFO from the root logger: TensorFlow's INFO lines
    # (one per traced all-reduce) would bury the run's own; its warnings stay.
    tf_logger = logging.getLogger("tensorflow")
    if tf_logger.level == logging.NOTSET:
        tf_logger.setLevel(logging.WARNING)
    from tfmulti.training.train import train as train_config

    return train_config(loop_config["config"])


def _join_or_start(ray, cpus: float) -> bool:
    """Joins the Ray this process should use; True when the caller must
    `ray.shutdown()` at the end (it joined or started it here)."""
    if ray.is_initialized():
        return False
    if os.environ.get(ADDRESS_ENV):
        ray.init()  # the cluster RAY_ADDRESS names: joined, left as it is at shutdown
    else:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(cpus)))
    return True


def train(config: TrainConfig, num_workers: int = 2, *, max_failures: int = 3,
          storage_path: str | None = None, name: str | None = None, use_gpu: bool = False,
          cpus_per_worker: float = 1, worker_env: dict | None = None,
          backup: bool = True) -> RayRun:
    """Trains `config` on `num_workers` Ray workers (Ray Train's TensorflowTrainer).

    Args:
        config: the run; `distribution` 'multi_worker' or 'auto' (each worker is a
            task of MultiWorkerMirroredStrategy, using its GPUs, else its CPU).
        num_workers: the Ray workers (TensorFlow tasks), 1 or more.
        max_failures: how many times Ray starts the workers again after one dies
            (`ray.train.FailureConfig`; -1: without limit); each start resumes from
            the backup.
        storage_path: Ray's storage for the run (default: Ray's, `~/ray_results`);
            across hosts, a folder every host mounts.
        name: the run's folder in `storage_path` (default: `tfmulti-`, the time and a
            random suffix).
        use_gpu: give each worker a GPU.
        cpus_per_worker: the CPUs Ray reserves for each worker.
        worker_env: environment variables for the workers (Ray's runtime env).
        backup: keep the resumable backup (default); False trains without one (a
            worker's death then starts the run again from step 0).

    Returns:
        A `RayRun`: the chief's metrics and where the outputs are.

    Raises:
        ValueError: a bad configuration or argument (nothing started).
        ray.train.TrainingFailedError: the workers failed more than `max_failures`
            times (the backup stays: run again to resume).
    """
    checks.positive_int("num_workers", num_workers)
    checks.integer("max_failures", max_failures, minimum=-1)
    checks.positive_number("cpus_per_worker", cpus_per_worker)
    if worker_env is not None and not (isinstance(worker_env, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in worker_env.items())):
        raise ValueError(f"`worker_env` must map names to strings, got {worker_env!r}.")
    from ray.train.constants import DEFAULT_STORAGE_PATH

    storage_path = storage_path or DEFAULT_STORAGE_PATH
    if _local(storage_path):
        storage_path = os.path.abspath(os.path.expanduser(storage_path))
    name = name or _default_name()
    run_path = f"{storage_path.rstrip('/')}/{name}"
    if not isinstance(backup, bool):
        raise ValueError(f"`backup` must be True or False, got {backup!r}.")
    config = _worker_config(config, run_path, backup)
    config.validate()
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    if not TensorflowTrainer.__module__.startswith("ray.train.v2."):
        raise ValueError("tfmulti.ray needs Ray Train v2 (Ray's default), whose trainer returns "
                         "the chief's metrics; unset RAY_TRAIN_V2_ENABLED (it is "
                         f"{os.environ.get('RAY_TRAIN_V2_ENABLED')!r}).")
    # Ray Train prints each line of a worker twice (to the console and through its
    # logger) unless told not to; the caller's `worker_env` decides.
    env = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", **(worker_env or {})}
    shut_down = _join_or_start(ray, num_workers * cpus_per_worker)
    try:
        trainer = TensorflowTrainer(
            _train_worker, train_loop_config={"config": config},
            scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                         resources_per_worker={"CPU": cpus_per_worker}),
            run_config=RunConfig(name=name, storage_path=storage_path,
                                 failure_config=FailureConfig(max_failures=max_failures),
                                 worker_runtime_env={"env_vars": env}))
        result = trainer.fit()
    finally:
        if shut_down:
            ray.shutdown()
    return RayRun(metrics=result.return_value, model_dir=config.model_dir,
                  backup_dir=config.backup_dir, path=str(result.path))
