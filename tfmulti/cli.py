"""The `tfmulti` console script: thin dispatch to the library modules.

    tfmulti env [--json]
    tfmulti prepare-data [--dataset fashion_mnist] [--data_dir DIR] [--source_dir DIR]
    tfmulti estimate-memory [--model mlp] [--strategy one_device] [--num_devices N]
                            [--num_stages S --num_microbatches M --num_replicas R]
                            [--global_batch_size B] [--optimizer adam] [--dtype float32]
                            [--partition params] [--json]
    tfmulti launch --num_workers N [--pin_cpus] [--port P] [--startup_timeout S]
                   [--no_isolate] [--grace_period S] [--max_restarts K] -- COMMAND ...
    tfmulti diagnose [recipes/train.py flags] [--no_prefetch] [--no_cache] [--seconds S]
                     [--no_measure] [--profile_dir DIR] [--plot FILE.png] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _quiet_tensorflow() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _cmd_env(args: argparse.Namespace) -> int:
    from tfmulti import devices, environment

    if args.num_virtual_devices:
        devices.configure_virtual_devices(args.num_virtual_devices)
    report = environment.env_report()
    print(json.dumps(report, indent=2) if args.json else environment.format_env_report(report))
    return 0


def _cmd_prepare_data(args: argparse.Namespace) -> int:
    from tfmulti import data

    if args.dataset != "fashion_mnist":
        print(
            f"tfmulti prepare-data: only fashion_mnist is prepared from local files; "
            f"for {args.dataset!r} run `tfds build {args.dataset}` with internet access.",
            file=sys.stderr,
        )
        return 2
    data_dir = args.data_dir or data.default_data_dir()
    data.prepare_fashion_mnist(data_dir, args.source_dir)
    print(f"fashion_mnist is ready in {os.path.join(data_dir, 'fashion_mnist')}")
    return 0


def _cmd_estimate_memory(args: argparse.Namespace) -> int:
    from tfmulti import memory

    estimate = memory.estimate_memory(
        args.model, strategy=args.strategy, num_devices=args.num_devices,
        num_stages=args.num_stages, num_microbatches=args.num_microbatches,
        num_replicas=args.num_replicas, global_batch_size=args.global_batch_size,
        optimizer=args.optimizer, dtype=args.dtype, partition=args.partition)
    print(json.dumps(estimate, indent=2) if args.json
          else memory.format_memory_estimate(estimate))
    return 0


def _add_batch_and_optimizer(p: argparse.ArgumentParser, batch: int, optimizer: str) -> None:
    """The flags estimate-memory and diagnose share with recipes/train.py."""
    p.add_argument("--global_batch_size", type=int, default=batch,
                   help=f"examples per step over all replicas (default {batch})")
    p.add_argument("--optimizer", default=optimizer, help=f"adam or sgd (default {optimizer})")


def _add_estimate_memory_parser(sub) -> None:
    # No argparse `choices`: the library checks the values, so a bad one is one
    # line naming the valid ones, as from Python.
    p = sub.add_parser(
        "estimate-memory", help="training memory per device for a model and strategy",
        description="Parameters, gradients, optimizer slots and activations per device, "
                    "counted from the model's shapes (no devices needed).")
    p.add_argument("--model", default="mlp", help="mlp, cnn or regression (default mlp)")
    p.add_argument("--strategy", default="one_device",
                   help="one_device, mirrored, pipeline or hybrid (default one_device)")
    p.add_argument("--num_devices", type=int, default=None,
                   help="data-parallel devices (default 1; pipeline/hybrid: replicas x stages)")
    p.add_argument("--num_stages", type=int, default=None,
                   help="pipeline stages, pipeline and hybrid only (default 2)")
    p.add_argument("--num_microbatches", type=int, default=None,
                   help="micro-batches per replica batch, pipeline and hybrid only (default 4)")
    p.add_argument("--num_replicas", type=int, default=None,
                   help="data-parallel pipelines, hybrid only (default 2)")
    _add_batch_and_optimizer(p, 256, "adam")
    p.add_argument("--dtype", default="float32",
                   help="activation dtype: float32, bfloat16 or float16 (default float32)")
    p.add_argument("--partition", default="params",
                   help="pipeline stage balancing: params or flops (default params)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_estimate_memory)


def _cmd_launch(args: argparse.Namespace) -> int:
    from tfmulti import launch

    command = args.worker_command
    if command[:1] == ["--"]:
        command = command[1:]
    return launch.launch(
        command, num_workers=args.num_workers, pin_cpus=args.pin_cpus, port=args.port,
        startup_timeout=args.startup_timeout, isolate=not args.no_isolate,
        grace_period=args.grace_period, max_restarts=args.max_restarts,
    )


def _add_launch_parser(sub) -> None:
    from tfmulti.launch import DEFAULT_GRACE_PERIOD, DEFAULT_STARTUP_TIMEOUT

    p = sub.add_parser(
        "launch", help="run a command as N MultiWorkerMirroredStrategy workers on this host",
        description="Runs COMMAND as N workers with TF_CONFIG set (worker 0 is the chief), "
                    "prefixes their output with [worker I], stops all when one fails or on "
                    "Ctrl-C, and exits with the chief's status.",
    )
    p.add_argument("--num_workers", type=int, default=2, help="number of workers (default 2)")
    p.add_argument("--pin_cpus", action="store_true",
                   help="give each worker its own contiguous share of the cores")
    p.add_argument("--port", type=int, default=None,
                   help="base port: workers use PORT..PORT+N-1 (default: free ports)")
    p.add_argument("--startup_timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT,
                   help="seconds workers wait for each other, as TFMULTI_STARTUP_TIMEOUT "
                        f"(default {DEFAULT_STARTUP_TIMEOUT:g})")
    p.add_argument("--no_isolate", action="store_true",
                   help="do not run the workers in a private network namespace; by default "
                        "they are isolated: their unauthenticated gRPC ports are unreachable "
                        "from other hosts, and isolated workers have no outside network")
    p.add_argument("--grace_period", type=float, default=DEFAULT_GRACE_PERIOD,
                   help="seconds between SIGTERM and SIGKILL when stopping workers "
                        f"(default {DEFAULT_GRACE_PERIOD:g})")
    p.add_argument("--max_restarts", type=int, default=0,
                   help="restart all workers after a failure or preemption, up to this many "
                        "times; a job with --backup_dir resumes from its backup (default 0)")
    p.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the worker's command line")
    p.set_defaults(func=_cmd_launch)


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from tfmulti.training import TrainConfig

    config = TrainConfig(
        strategy=args.strategy, num_virtual_devices=args.num_virtual_devices,
        devices=tuple(d for d in args.devices.split(",") if d) if args.devices else None,
        cross_device_ops=args.cross_device_ops, dataset=args.dataset, data_dir=args.data_dir,
        download=args.download, num_examples=args.num_examples, model=args.model,
        dropout=args.dropout, global_batch_size=args.global_batch_size,
        learning_rate=args.learning_rate, lr_scaling=args.lr_scaling,
        base_batch_size=args.base_batch_size, warmup_epochs=args.warmup_epochs,
        optimizer=args.optimizer, seed=args.seed, steps_per_execution=args.steps_per_execution,
        mixed_precision=args.mixed_precision, jit_compile=args.jit_compile)
    config.validate()  # before TensorFlow loads: bad flags fail in a second
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ValueError(f"`--plot` takes a .png file name, got {args.plot!r}.")
    from tfmulti import diagnose

    report = diagnose.diagnose(
        config, prefetch=not args.no_prefetch, cache=False if args.no_cache else None,
        seconds=args.seconds, measure_advice=not args.no_measure,
        profile_dir=args.profile_dir, progress=lambda line: print(line, file=sys.stderr,
                                                                  flush=True))
    if args.plot:
        report.plot(args.plot)
        print(f"tfmulti diagnose: wrote {args.plot}", file=sys.stderr)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0


def _add_diagnose_parser(sub) -> None:
    from tfmulti.training import TrainConfig

    d = TrainConfig()
    p = sub.add_parser(
        "diagnose", help="where a training configuration's time goes, and what would help",
        description="Times the input pipeline alone, the train step alone on data already on "
                    "the devices, and both together through fit; names the bottleneck (input, "
                    "compute or per-step overhead), estimates device utilization, and ranks "
                    "the changes that help by their measured gain. Takes the flags of "
                    "recipes/train.py. Seed 000's configuration: --strategy=mirrored "
                    "--num_virtual_devices=2 --global_batch_size=32 --steps_per_execution=1.")
    p.add_argument("--strategy", default=d.strategy, help="auto, one_device or mirrored")
    p.add_argument("--num_virtual_devices", type=int, default=0,
                   help="split the CPU into this many logical devices first (0: no split)")
    p.add_argument("--devices", default=None, help="devices to use, e.g. CPU:0,CPU:1")
    p.add_argument("--cross_device_ops", default=d.cross_device_ops,
                   help="auto, nccl, hierarchical_copy or reduce_to_one")
    p.add_argument("--dataset", default=d.dataset,
                   help=f"TFDS name or synthetic (default {d.dataset})")
    p.add_argument("--data_dir", default=None, help="TFDS data dir")
    p.add_argument("--download", action="store_true", help="allow a TFDS download")
    p.add_argument("--num_examples", type=int, default=None, help="synthetic data size")
    p.add_argument("--model", default=d.model, help="mlp, cnn or regression (default mlp)")
    p.add_argument("--dropout", type=float, default=d.dropout)
    _add_batch_and_optimizer(p, d.global_batch_size, d.optimizer)
    p.add_argument("--learning_rate", type=float, default=d.learning_rate)
    p.add_argument("--lr_scaling", default=d.lr_scaling, help="none, linear or sqrt")
    p.add_argument("--base_batch_size", type=int, default=d.base_batch_size)
    p.add_argument("--warmup_epochs", type=float, default=d.warmup_epochs)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps_per_execution", default=d.steps_per_execution,
                   help=f"training steps per tf.function call, or auto (default "
                        f"{d.steps_per_execution}: the largest divisor of the steps per epoch up "
                        f"to 32)")
    p.add_argument("--mixed_precision", default=d.mixed_precision,
                   help="none, bfloat16 or float16")
    p.add_argument("--jit_compile", action="store_true", help="compile the step with XLA")
    p.add_argument("--no_prefetch", action="store_true",
                   help="diagnose the input pipeline without prefetching")
    p.add_argument("--no_cache", action="store_true",
                   help="diagnose the input pipeline without the in-memory cache")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="about how long each timing runs (default 1)")
    p.add_argument("--no_measure", action="store_true",
                   help="list the changes that could help without running them")
    p.add_argument("--profile_dir", default=None,
                   help="also write a TensorBoard profiler trace of a few fit steps here")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="plot the time split")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_diagnose)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfmulti", description="Multi-device training for TensorFlow + Keras 3."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="report versions, devices, NCCL, CPUs, oneDNN, RAM, TF_CONFIG")
    env.add_argument("--json", action="store_true", help="print JSON")
    env.add_argument("--num_virtual_devices", type=int, default=0,
                     help="split the CPU into this many logical devices first")
    env.set_defaults(func=_cmd_env)
    prep = sub.add_parser("prepare-data", help="prepare a dataset offline (fashion_mnist)")
    prep.add_argument("--dataset", default="fashion_mnist")
    prep.add_argument("--data_dir", default=None, help="TFDS data dir (default: $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    prep.add_argument("--source_dir", default=None, help="folder with the IDX files")
    prep.set_defaults(func=_cmd_prepare_data)
    _add_estimate_memory_parser(sub)
    _add_launch_parser(sub)
    _add_diagnose_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_tensorflow()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"tfmulti {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
