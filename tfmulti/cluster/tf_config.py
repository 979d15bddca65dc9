"""TF_CONFIG: building, parsing and validation; pure functions, no TensorFlow.

TensorFlow reads `TF_CONFIG` leniently: a misspelt `"cluster"` key makes it
silently train as a single worker, and most mistakes surface minutes later
as a hang. tfmulti validates it first and names the field and the fix.

Example:
    >>> from tfmulti.cluster import tf_config
    >>> cfg = tf_config.parse_tf_config(
    ...     '{"cluster": {"worker": ["h1:2222", "h2:2222"]},'
    ...     ' "task": {"type": "worker", "index": 1}}')
    >>> tf_config.num_tasks(cfg), tf_config.is_chief(cfg), tf_config.peers(cfg)
    (2, False, ['h1:2222'])
    >>> tf_config.build_tf_config(["h1:2222", "h2:2222"], 1) == cfg
    True
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Mapping, Sequence

from tfmulti.utils.checks import is_int
from tfmulti.utils import human

__all__ = ["LAUNCHED_ENV", "build_tf_config", "from_environ", "is_chief", "num_tasks",
           "parse_tf_config", "process_is_chief", "peers", "task_address", "validate_tf_config"]

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
LAUNCHED_ENV = "TFMULTI_LAUNCHED"
"""Set to "1" in the environment of the workers a tfmulti launcher starts: their
TF_CONFIG was made for them, so `get_strategy("auto")` joins that cluster. A
TF_CONFIG without it (a leftover in a shell, a cluster manager's) is joined only
when asked for by name (`multi_worker`)."""
TOP_LEVEL_KEYS = ("cluster", "task", "environment", "rpc_layer")
_EXAMPLE = ('{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
            '"task": {"type": "worker", "index": 0}}')


def _fail(message: str) -> ValueError:
    return ValueError(f"TF_CONFIG: {message}")


def _suggest(name: str, valid) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_address(job: str, index: int, address) -> str:
    where = f"cluster.{job}[{index}]"
    if not isinstance(address, str) or address.count(":") < 1:
        raise _fail(f"{where} is {address!r}; use 'host:port', e.g. 'localhost:2222'.")
    host, _, port = address.rpartition(":")
    # ASCII digits only: str.isdigit() and int() also take '２２２２' or '٢٢٢٢'.
    if not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise _fail(f"{where} is {address!r}; the port must be a number in 1..65535 "
                    "(ASCII digits) after the last ':' (e.g. 'localhost:2222').")
    return address


def validate_tf_config(config) -> dict:
    """Checks a parsed TF_CONFIG and returns it.

    Raises:
        ValueError: not an object, unknown or missing top-level keys, an
            empty or malformed cluster, an unknown job or task type, an index
            out of range, a duplicate address, more than one chief, or a
            `ps` job (not used by MultiWorkerMirroredStrategy).
    """
    if not isinstance(config, dict):
        raise _fail(f"must be a JSON object, got {type(config).__name__}; e.g. {_EXAMPLE}")
    for key in config:
        if key not in TOP_LEVEL_KEYS:
            raise _fail(f"unknown key {key!r}{_suggest(key, TOP_LEVEL_KEYS)}; valid keys: "
                        f"{list(TOP_LEVEL_KEYS)}. TensorFlow would ignore it silently.")
    for key in ("cluster", "task"):
        if key not in config:
            raise _fail(f"missing {key!r}; e.g. {_EXAMPLE}")
    spec = config["cluster"]
    if not isinstance(spec, dict) or not spec:
        raise _fail(f"'cluster' must map job names to address lists, got {spec!r}; "
                    f"e.g. {_EXAMPLE}")
    seen: dict[str, str] = {}
    for job, addresses in spec.items():
        if job not in TASK_TYPES:
            raise _fail(f"unknown job {job!r} in 'cluster'{_suggest(job, TASK_TYPES)}; "
                        f"valid jobs: {list(TASK_TYPES)}.")
        if isinstance(addresses, str) or not isinstance(addresses, list) or not addresses:
            raise _fail(f"cluster.{job} must be a non-empty list of 'host:port' strings, "
                        f"got {addresses!r}.")
        for i, address in enumerate(addresses):
            _check_address(job, i, address)
            if address in seen:
                raise _fail(f"address {address!r} appears twice ({seen[address]} and "
                            f"{job}[{i}]); every task needs its own host:port.")
            seen[address] = f"{job}[{i}]"
    if len(spec.get("chief", [])) > 1:
        raise _fail(f"cluster.chief lists {len(spec['chief'])} tasks; there can be one chief "
                    "(list the others under 'worker').")
    if "ps" in spec:
        raise _fail("a 'ps' job is for ParameterServerStrategy; MultiWorkerMirroredStrategy "
                    "uses 'chief' and 'worker' only.")
    task = config["task"]
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise _fail(f"'task' must be {{'type': ..., 'index': ...}}, got {task!r}.")
    task_type, index = task["type"], task["index"]
    if task_type not in TASK_TYPES:
        raise _fail(f"unknown task type {task_type!r}{_suggest(str(task_type), TASK_TYPES)}; "
                    f"valid types: {list(TASK_TYPES)}.")
    if task_type != "evaluator" and task_type not in spec:
        raise _fail(f"task.type is {task_type!r} but 'cluster' has no {task_type!r} job; "
                    f"jobs: {list(spec)}.")
    if not is_int(index):
        raise _fail(f"task.index must be an integer, got {index!r}.")
    size = len(spec.get(task_type, [None]))
    if not 0 <= index < size:
        raise _fail(f"task.index {index} is out of range for {task_type!r}, which has "
                    f"{human.count(size, 'task')}; use 0..{size - 1}.")
    return config


def parse_tf_config(text: str) -> dict:
    """Parses and validates TF_CONFIG text.

    Raises:
        ValueError: invalid JSON (with position) or any `validate_tf_config` error.
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                    f"e.g. {_EXAMPLE}") from None
    return validate_tf_config(config)


def from_environ(environ: Mapping[str, str] | None = None) -> dict | None:
    """The validated TF_CONFIG of the environment, or None when unset or empty."""
    text = (os.environ if environ is None else environ).get("TF_CONFIG", "").strip()
    return parse_tf_config(text) if text else None


def build_tf_config(addresses: Sequence[str], index: int) -> dict:
    """The TF_CONFIG of worker `index` in a cluster of workers at `addresses`.

    There is no "chief" job, so worker 0 is the chief (TensorFlow's convention).

    Raises:
        ValueError: an address that is not 'host:port', or `index` out of range.
    """
    config = {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}
    return validate_tf_config(config)


def num_tasks(config: dict) -> int:
    """Chief plus workers: the processes that train together."""
    spec = config["cluster"]
    return len(spec.get("chief", [])) + len(spec.get("worker", []))


def task_address(config: dict) -> str | None:
    task = config["task"]
    jobs = config["cluster"].get(task["type"])
    return jobs[task["index"]] if jobs else None


def is_chief(config: dict | None) -> bool:
    """True for the chief, or worker 0 when there is no chief job (TF's rule),
    or when there is no cluster at all."""
    if config is None:
        return True
    task = config["task"]
    if "chief" in config["cluster"]:
        return task["type"] == "chief"
    return task["type"] == "worker" and task["index"] == 0


def process_is_chief(distribution: str, cluster_resolver: str = "auto",
                     environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is the chief of a training run (the one that prints
    the results and writes the outputs), by the rule the strategy's cluster
    resolver follows, read before TensorFlow starts: one process unless
    `distribution` is "auto" or "multi_worker"; then TF_CONFIG's chief, else its
    worker 0; SLURM's task 0 where the resolver is SLURM's.

    Args:
        distribution: the run's `TrainConfig.distribution`.
        cluster_resolver: the run's `TrainConfig.cluster_resolver`.
        environ: default `os.environ`.

    Raises:
        ValueError: a malformed TF_CONFIG.

    Example:
        >>> process_is_chief("multi_worker", environ={"SLURM_PROCID": "1"})
        False
        >>> process_is_chief("mirrored", environ={"SLURM_PROCID": "1"})
        True
    """
    if distribution not in ("auto", "multi_worker"):
        return True  # one process
    environ = os.environ if environ is None else environ
    cluster = from_environ(environ)  # a malformed TF_CONFIG fails here too
    if distribution == "multi_worker" and (
            cluster_resolver == "slurm" or (cluster_resolver == "auto" and cluster is None)):
        return environ.get("SLURM_PROCID", "0") == "0"
    return is_chief(cluster)


def peers(config: dict) -> list[str]:
    """Addresses of the other chief/worker tasks."""
    spec = config["cluster"]
    mine = task_address(config)
    return [a for job in ("chief", "worker") for a in spec.get(job, []) if a != mine]
