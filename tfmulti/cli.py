"""The `tfmulti` console script: thin dispatch to the library modules.

    tfmulti env [--json]
    tfmulti prepare-data [--dataset fashion_mnist] [--data_dir DIR] [--source_dir DIR]
    tfmulti launch --num_workers N [--pin_cpus] [--port P] [--startup_timeout S]
                   [--no_isolate] [--grace_period S] -- COMMAND ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _quiet_tensorflow() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _cmd_env(args: argparse.Namespace) -> int:
    from tfmulti import devices, diagnose

    if args.num_virtual_devices:
        devices.configure_virtual_devices(args.num_virtual_devices)
    report = diagnose.env_report()
    print(json.dumps(report, indent=2) if args.json else diagnose.format_env_report(report))
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


def _cmd_launch(args: argparse.Namespace) -> int:
    from tfmulti import launch

    command = args.worker_command
    if command[:1] == ["--"]:
        command = command[1:]
    return launch.launch(
        command, num_workers=args.num_workers, pin_cpus=args.pin_cpus, port=args.port,
        startup_timeout=args.startup_timeout, isolate=not args.no_isolate,
        grace_period=args.grace_period,
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
    p.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the worker's command line")
    p.set_defaults(func=_cmd_launch)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfmulti", description="Multi-device training for TensorFlow + Keras 3."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="report versions, devices, NCCL, CPUs, RAM, TF_CONFIG")
    env.add_argument("--json", action="store_true", help="print JSON")
    env.add_argument("--num_virtual_devices", type=int, default=0,
                     help="split the CPU into this many logical devices first")
    env.set_defaults(func=_cmd_env)
    prep = sub.add_parser("prepare-data", help="prepare a dataset offline (fashion_mnist)")
    prep.add_argument("--dataset", default="fashion_mnist")
    prep.add_argument("--data_dir", default=None, help="TFDS data dir (default: $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    prep.add_argument("--source_dir", default=None, help="folder with the IDX files")
    prep.set_defaults(func=_cmd_prepare_data)
    _add_launch_parser(sub)
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
