"""The `tfmulti` console script: thin dispatch to the library modules.

    tfmulti env [--json]
    tfmulti prepare-data [--dataset fashion_mnist] [--data_dir DIR] [--source_dir DIR]
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
