"""One benchmark measurement in a fresh process; prints its result as one JSON line.

    python -m benchmarks.worker KIND [CONFIG_JSON]
    python -m benchmarks.worker --serve DEVICES

KIND names a worker function (`WORKERS`), CONFIG_JSON its keyword arguments
as a JSON object (default `{}`). Each worker sets up TensorFlow itself
(virtual devices, thread counts) before the runtime starts, which is why it
needs a process of its own; `benchmarks._harness.run_worker` starts one
and reads the last line of its output. Bad arguments exit with code 2.
`--serve` (`serve`) runs one worker after the other in this process, the
shared worker of a toy-size benchmark run.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow

import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

from tfmulti.utils import checks, deferred_imports  # noqa: E402

__all__ = ["WORKERS", "main", "run", "run_several", "serve"]

WORKERS = {
    "machine": "benchmarks._harness:machine_worker",
    "pipeline": "benchmarks.pipeline:worker",
    "seed": "benchmarks.baseline:seed_worker",
    "tfmulti": "benchmarks.baseline:tfmulti_worker",
    "overhead": "benchmarks.overhead:worker",
    "streaming": "benchmarks.streaming:worker",
    "input_service": "benchmarks.input_service:worker",
    "embeddings": "benchmarks.embeddings:worker",
    "devices": "benchmarks.devices:worker",
    "tensor": "benchmarks.tensor:tensor_worker",
    "tensor_pipeline": "benchmarks.tensor:pipeline_worker",
    "gpu_check": "benchmarks.gpu_check:worker",
    "own_model": "benchmarks.own:model_worker",
    "own_write": "benchmarks.own:write_worker",
    "own_train": "benchmarks.own:train_worker",
    "all_reduce": "benchmarks.scaling:all_reduce_worker",
    "several": "benchmarks.worker:run_several",
}
"""Worker kind -> "module:function"."""


def run(kind: str, config: dict) -> dict:
    """Calls worker `kind` with `config` as keyword arguments, in this process."""
    checks.one_of("kind", kind, WORKERS)
    if not isinstance(config, dict):
        raise ValueError(f"the config of worker {kind!r} must be a JSON object, got "
                         f"{config!r}.")
    module, function = WORKERS[kind].split(":")
    return getattr(importlib.import_module(module), function)(**config)


def run_several(calls: list) -> dict:
    """Runs the workers of `calls` (`[kind, config]` pairs) one after the other
    in this process (`benchmarks._harness.run_workers` at toy size).

    Returns:
        {"results": each call's result, in order}.
    """
    if not isinstance(calls, list) or not all(
            isinstance(c, list) and len(c) == 2 and c[0] != "several" for c in calls):
        raise ValueError(f"`calls` must be a list of [kind, config] pairs (kind not "
                         f"'several'), got {calls!r}.")
    return {"results": [run(kind, config) for kind, config in calls]}


def serve(devices: int, requests=None) -> int:
    """The shared worker of a toy-size run (`benchmarks._harness.run_worker`):
    configures `devices` logical CPUs, then for each `[kind, config]` JSON line
    of `requests` (default stdin) runs that worker here and writes one line to
    stdout: `{"result": ...}`, or `{"error": its traceback}` (and goes on to
    the next). What the workers print goes to stderr, so stdout holds only
    the replies. Returns 0 at the end of `requests`."""
    import tfmulti

    replies = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    tfmulti.configure_virtual_devices(devices)
    for line in sys.stdin if requests is None else requests:
        try:
            kind, config = json.loads(line)
            reply = {"result": run(kind, config)}
        except Exception:  # noqa: BLE001  (reported to the caller, which raises)
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--serve" and args[1].isdigit():
        return serve(int(args[1]))
    if len(args) not in (1, 2):
        print(f"usage: python -m benchmarks.worker KIND [CONFIG_JSON]; KIND is one of "
              f"{list(WORKERS)}", file=sys.stderr)
        return 2
    try:
        config = json.loads(args[1]) if len(args) == 2 else {}
        checks.one_of("kind", args[0], WORKERS)
        if not isinstance(config, dict):
            raise ValueError(f"CONFIG_JSON must be a JSON object, got {args[1]!r}.")
    except ValueError as e:  # json.JSONDecodeError is one
        print(f"benchmarks.worker: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(run(args[0], config)), flush=True)
    return 0


if __name__ == "__main__":
    # A benchmark worker is tfmulti's own process: Keras' optional imports wait for their
    # first use (tfmulti.utils.deferred_imports; the clocks start after the imports).
    deferred_imports.install()
    sys.exit(main())
