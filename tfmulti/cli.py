"""The `tfmulti` console script: parsing, help and exit codes; the work is in the library.

    tfmulti --version
    tfmulti train [--config FILE] [training flags: the fields of TrainConfig]
    tfmulti env [--json] [--num_virtual_devices N] [--gpus_per_worker K --num_workers N]
    tfmulti prepare-data [--dataset fashion_mnist|tfmulti_text] [--data_dir DIR]
                         [--source_dir DIR]
    tfmulti estimate-memory [--config FILE]
                            [--model mlp] [--dataset D --data_dir DIR --download --task T]
                            [--distribution one_device]
                            [--num_virtual_devices N | --devices D,... | --num_devices N]
                            [--num_stages S --num_microbatches M --num_replicas R --remat]
                            [--tensor_parallel T --seq_len L --d_model D --num_heads H
                             --num_layers N]
                            [--global_batch_size B] [--optimizer adam]
                            [--mixed_precision none] [--partition params]
                            [--device_memory_mb MB] [--json]
    tfmulti launch --num_workers N [--oversubscribe] [--pin_cpus] [--port P]
                   [--startup_timeout S] [--no_isolate] [--grace_period S] [--max_restarts K]
                   [--hosts HOST[:N],... --host_rank R | --hosts slurm] [--secret_file PATH]
                   [--gpus_per_worker K] [--data_service N] -- COMMAND ...
    tfmulti data-service [--workers N] [--cpus LIST] [--port P] [--host HOST]
                         [--dispatcher HOST:PORT] [--import MODULE]
    tfmulti diagnose [--config FILE] [training flags] [--no_prefetch] [--no_cache]
                     [--seconds S] [--no_measure] [--profile_dir DIR] [--plot FILE.png]
                     [--json]
    tfmulti export --model_dir DIR --output DIR [--overwrite] [--model MODULE[:FUNCTION]]

The training options of `train`, `diagnose` and `estimate-memory` are generated from
`tfmulti.config.train_config.TrainConfig` (`tfmulti.config.flags`), and `--config FILE`
gives their values in a YAML or JSON file (flags on the command line win). Every option
takes the one flag style of `tfmulti.config.flags`: `--num_workers 2`, `--num-workers=2`,
`--jit_compile`, `--no_jit_compile` (`--no-jit-compile`, `--nojit_compile`). Bad input
prints one line, `tfmulti COMMAND: error: ...`, and exits 2; flags are checked before
TensorFlow starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile

from tfmulti import __version__
from tfmulti.config import flags as config_flags
from tfmulti.config.train_config import (DATA_SERVICE_ENV, MAX_COUNT, MAX_DEVICES,
                                         check_directory, check_limits,
                                         check_posix_path, data_service_target,
                                         validate_for_diagnose)
from tfmulti.memory.arguments import config_arguments
from tfmulti.cluster import exit_codes, tf_config
from tfmulti.utils import checks, deferred_imports, quiet

__all__ = ["build_parser", "main"]

MAX_DIAGNOSE_SECONDS = 3600.0
"""The longest `diagnose --seconds`: each of its timings runs about this long (several
run), so an hour each is already a long day."""
# TrainConfig fields that `diagnose` does not take: it trains no epochs and writes nothing
# (its own --profile_dir writes a profile). (It takes steps_per_epoch: the steps per
# tf.function call, auto, divide an epoch's.)
DIAGNOSE_EXCLUDES = ("epochs", "backup_dir", "backup_every_steps", "keep_backup",
                     "discard_unreadable_backup", "model_dir", "overwrite", "verbose",
                     "tensorboard", "profile_steps", "callbacks")
# The training flags that bear on a memory estimate, spelled as for training: the model
# and its data (shapes, classes), the layout (devices, stages, micro-batches, replicas),
# the batch, the optimizer's slots, the precision and the per-device budget.
ESTIMATE_FIELDS = ("model", "dataset", "data_dir", "download", "task", "distribution",
                   "num_virtual_devices", "devices", "num_stages", "num_microbatches",
                   "num_replicas", "remat", "tensor_parallel", "global_batch_size", "optimizer",
                   "mixed_precision", "partition", "dropout", "seq_len", "d_model", "num_heads",
                   "num_layers", "device_memory_mb", "zero_stage", "shard_embeddings")


class _Parser(config_flags.ArgumentParser):
    """argparse in the tools' flag style (`tfmulti.config.flags.ArgumentParser`), with a
    one-line error (`PROG: error: MESSAGE`) and exit code 2."""

    def error(self, message: str):
        self.exit(exit_codes.USAGE, f"{self.prog}: error: {self.shown_names(message)}\n")


def _cmd_env(args: argparse.Namespace) -> int:
    checks.non_negative_int("num_virtual_devices", args.num_virtual_devices, maximum=MAX_DEVICES,
                            hint="0 leaves the devices as they are")
    checks.non_negative_int("gpus_per_worker", args.gpus_per_worker, maximum=MAX_DEVICES)
    checks.positive_int("num_workers", args.num_workers, maximum=MAX_COUNT)
    from tfmulti.runtime import devices
    from tfmulti.insight import environment

    if args.num_virtual_devices:
        devices.configure_virtual_devices(args.num_virtual_devices)
    report = environment.env_report(args.gpus_per_worker, args.num_workers)
    print(json.dumps(report, indent=2) if args.json else environment.format_env_report(report))
    return 0


def _cmd_prepare_data(args: argparse.Namespace) -> int:
    if args.data_dir:
        check_posix_path("data_dir", args.data_dir)  # a URL would be a local ./gs:/... folder
    if args.dataset == "tfmulti_text":
        from tfmulti.data import text

        folder = text.prepare(args.data_dir, args.source_dir)
        print(f"tfmulti_text is ready in {folder}")
        return 0
    if args.dataset != "fashion_mnist":
        raise ValueError(f"only fashion_mnist and tfmulti_text are prepared from local files; "
                         f"for {args.dataset!r} run `tfds build {args.dataset}` with internet "
                         "access.")
    from tfmulti import data

    data_dir = args.data_dir or data.default_data_dir()
    data.prepare_fashion_mnist(data_dir, args.source_dir)
    print(f"fashion_mnist is ready in {os.path.join(data_dir, 'fashion_mnist')}")
    return 0


def _cmd_estimate_memory(args: argparse.Namespace) -> int:
    given = {k: v for k, v in vars(args).items() if k in ESTIMATE_FIELDS}
    checks.positive_int("num_devices", args.num_devices, maximum=MAX_DEVICES, none_ok=True)
    check_limits(**given)  # before TensorFlow, as the train flags' bounds
    config = config_flags.config_from_args(args, distribution=given.get("distribution",
                                                                        "one_device"))
    config.validate()
    config_arguments(config, num_devices=args.num_devices, given=given)
    from tfmulti.memory import estimate as memory

    estimate = memory.estimate_for_config(config, num_devices=args.num_devices, given=given)
    print(json.dumps(estimate, indent=2) if args.json
          else memory.format_memory_estimate(estimate), flush=True)
    if config.device_memory_mb is not None:
        memory.check_fits(estimate, config.device_memory_mb)
    return 0


def _add_estimate_memory_parser(sub) -> None:
    p = sub.add_parser(
        "estimate-memory", help="training memory per device for a model and distribution",
        description="Parameters, gradients, optimizer slots and activations per device, "
                    "counted from the model's shapes (no devices needed). Takes the training "
                    "flags that bear on memory, as tfmulti train spells them; with "
                    "--device_memory_mb, exits 2 when a device cannot hold its share.")
    config_flags.add_arguments(p, only=ESTIMATE_FIELDS, suppress_defaults=True,
                               defaults={"distribution": "one_device"})
    p.add_argument("--num_devices", type=int, default=None,
                   help="the old name of --num_virtual_devices: data-parallel devices "
                        "(default 1; pipeline/hybrid: replicas x stages)")
    p.add_argument("--json", action=config_flags.BooleanFlag, default=False,
                   help="print JSON")
    p.set_defaults(func=_cmd_estimate_memory, parser=p)


def _cmd_launch(args: argparse.Namespace) -> int:
    from tfmulti.cluster import launch

    command = args.worker_command
    if command[:1] == ["--"]:
        command = command[1:]
    if args.data_service:
        checks.positive_int("data_service", args.data_service, maximum=MAX_DEVICES,
                            hint="tf.data service workers per worker")
        # Each worker starts its own service (in the job's namespace, stopped with it):
        # `tfmulti train` reads TFMULTI_DATA_SERVICE when --data_service is not given.
        os.environ[DATA_SERVICE_ENV] = f"local:{args.data_service}"
    return launch(
        command, num_workers=args.num_workers, pin_cpus=args.pin_cpus, port=args.port,
        startup_timeout=args.startup_timeout, isolate=args.isolate,
        grace_period=args.grace_period, max_restarts=args.max_restarts, hosts=args.hosts,
        host_rank=args.host_rank, gpus_per_worker=args.gpus_per_worker,
        secret_file=args.secret_file, oversubscribe=args.oversubscribe,
    )


def _add_launch_parser(sub) -> None:
    from tfmulti.cluster.plan import DEFAULT_GRACE_PERIOD, DEFAULT_STARTUP_TIMEOUT

    p = sub.add_parser(
        "launch", help="run a command as MultiWorkerMirroredStrategy workers, on this host "
                       "or across hosts",
        description="Runs COMMAND as N workers with TF_CONFIG set (worker 0 is the chief), "
                    "prefixes their output with [worker I], stops all when one fails or on "
                    "Ctrl-C, and exits with the chief's status. With --hosts, run the same "
                    "line on every host (its own --host_rank) with the job's shared secret "
                    "(TFMULTI_LAUNCH_SECRET or --secret_file): the launchers authenticate "
                    "each other, check that they see the same cluster, then start and "
                    "restart their workers together. Needs Linux (util-linux unshare, "
                    "prctl).",
    )
    p.add_argument("--num_workers", type=int, default=2,
                   help="number of workers, 1 to 1024 (default 2; with --hosts: on each host "
                        "listed without :N); more than 4 per core need --oversubscribe")
    p.add_argument("--oversubscribe", action=config_flags.BooleanFlag, default=False,
                   help="start more than 4 workers per core of this host")
    p.add_argument("--pin_cpus", action=config_flags.BooleanFlag, default=False,
                   help="give each worker its own contiguous share of the cores")
    p.add_argument("--port", type=int, default=None,
                   help="base port: workers use PORT..PORT+N-1 (default: free ports); with "
                        "--hosts the launchers' coordination port on every host, the "
                        "workers use the ports after it (default 2222)")
    p.add_argument("--startup_timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT,
                   help="seconds workers wait for each other, as TFMULTI_STARTUP_TIMEOUT "
                        f"(default {DEFAULT_STARTUP_TIMEOUT:g})")
    p.add_argument("--isolate", action=config_flags.BooleanFlag, default=True,
                   help="--no_isolate: do not run the workers in a private network "
                        "namespace; by default they are isolated: their unauthenticated gRPC "
                        "ports are unreachable from outside it, they keep outbound network "
                        "access where slirp4netns is installed (else loopback only), and "
                        "where no namespace can be made the launch fails (exit 2)")
    p.add_argument("--grace_period", type=float, default=DEFAULT_GRACE_PERIOD,
                   help="seconds between SIGTERM and SIGKILL when stopping workers that save "
                        "a backup on SIGTERM: room for a preempted job's agreement, a call of "
                        "steps and the save (default "
                        f"{DEFAULT_GRACE_PERIOD:g}; workers without a backup get 5 s)")
    p.add_argument("--max_restarts", type=int, default=0,
                   help="restart all workers after a failure or preemption, up to this many "
                        "times; a job with --backup_dir resumes from its backup (default 0)")
    p.add_argument("--hosts", default=None, metavar="HOST[:N],...",
                   help="a launch across hosts: every host with its number of workers, in "
                        "the same order on every host; or 'slurm' for the nodes of the "
                        "SLURM job step (srun --ntasks-per-node=1)")
    p.add_argument("--host_rank", type=int, default=None,
                   help="with --hosts: this host's position in the list (0 coordinates)")
    p.add_argument("--secret_file", default=None, metavar="PATH",
                   help="with --hosts: a file readable only by its owner (chmod 600) that "
                        "holds the job's shared secret, at least 16 bytes, the same on every "
                        "host; by default the secret is $TFMULTI_LAUNCH_SECRET (make one: "
                        "python -c \"import secrets; print(secrets.token_hex(32))\")")
    p.add_argument("--gpus_per_worker", type=int, default=0,
                   help="give each local worker its own K GPUs (CUDA_VISIBLE_DEVICES) of "
                        "the GPUs this host has (default 0: every worker sees every GPU)")
    p.add_argument("--data_service", type=int, default=0, metavar="N",
                   help="give each worker N tf.data service workers of its own, started "
                        "with it, that run its training input (tfmulti train reads it: "
                        "TFMULTI_DATA_SERVICE=local:N); default 0: none")
    p.add_argument("worker_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the worker's command line")
    p.set_defaults(func=_cmd_launch, parser=p)


def _cmd_diagnose(args: argparse.Namespace) -> int:
    config = config_flags.config_from_args(args)
    validate_for_diagnose(config)  # before TensorFlow loads: bad flags fail at once
    checks.positive_number("seconds", args.seconds, maximum=MAX_DIAGNOSE_SECONDS)
    if args.plot is not None:
        if not args.plot.lower().endswith(".png") or os.path.isdir(args.plot):
            raise ValueError(f"`plot` takes a .png file name, got {args.plot!r}.")
        check_directory("plot", os.path.dirname(os.path.abspath(args.plot)))
    if args.profile_dir is not None:
        if not args.profile_dir:
            raise ValueError("`profile_dir` is empty; pass a directory path.")
        check_directory("profile_dir", args.profile_dir)
    from tfmulti.insight.diagnose import diagnose

    report = diagnose(
        config, prefetch=args.prefetch, cache=args.cache,
        seconds=args.seconds, measure_advice=args.measure,
        profile_dir=args.profile_dir, progress=lambda line: print(line, file=sys.stderr,
                                                                  flush=True))
    if args.plot:
        report.plot(args.plot)
        print(f"tfmulti diagnose: wrote {args.plot}", file=sys.stderr)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format(flags=True))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    config = config_flags.config_from_args(args)
    config.validate()  # before TensorFlow starts: a bad flag fails at once
    chief = tf_config.process_is_chief(config.distribution, config.cluster_resolver)
    from tfmulti.data.service import ServiceLost
    from tfmulti.training import outputs
    from tfmulti.training.train import train

    try:
        metrics = train(config)  # every worker has the metrics; the chief's line says them
    except ServiceLost as e:  # not a usage error: a restart resumes from the backup
        print(f"tfmulti train: error: {e}", file=sys.stderr, flush=True)
        return 1
    print(outputs.summary_line(metrics) if chief else outputs.OTHER_WORKER_LINE, flush=True)
    return 0


def _cmd_data_service(args: argparse.Namespace) -> int:
    cpus = _cpu_list(args.cpus)
    checks.positive_int("workers", args.workers, maximum=MAX_DEVICES)
    if args.port is not None and not 0 < args.port < 65536:
        raise ValueError(f"`port` must be a TCP port from 1 to 65535, got {args.port}.")
    if args.dispatcher is not None:
        data_service_target(args.dispatcher)  # its form, before TensorFlow starts
        if args.port is not None:
            raise ValueError("`port` is the dispatcher's, and with --dispatcher this host "
                             "starts workers only; drop one of them.")
    from tfmulti.data import service

    return service.serve(args.workers, port=args.port or 0, cpus=cpus, host=args.host,
                         imports=args.imports, dispatcher=args.dispatcher)


def _cpu_list(text: str | None) -> set[int] | None:
    """--cpus: "1", "2-3" or "1,3", checked against the cores this process may use."""
    if not text:
        return None
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"`cpus` {text!r} is not a list of cores; e.g. 1, 2-3 or 1,3.") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(f"`cpus` {text!r}: this process may use cores {sorted(allowed)}; "
                         "pick among them.")
    return cpus


def _add_data_service_parser(sub) -> None:
    p = sub.add_parser(
        "data-service", help="run a tf.data service: input pipelines prepared by other "
                             "processes or hosts",
        description="Starts a tf.data service dispatcher and its workers on this host and "
                    "keeps them until Ctrl-C or SIGTERM (a worker that ends is started "
                    "anew). Trainers read from it with --data_service=grpc://HOST:PORT (the "
                    "address it prints): each input pipeline runs in a service worker, the "
                    "same batches in the same order. With --dispatcher, starts workers only, "
                    "for another host's dispatcher. The ports are unauthenticated: run it on "
                    "a private network.")
    p.add_argument("--workers", type=int, default=1, help="service workers (default 1)")
    p.add_argument("--cpus", default=None,
                   help="the cores the workers run on, e.g. 1 or 2-3 (default: all)")
    p.add_argument("--port", type=int, default=None,
                   help="the dispatcher's port (default: a free one)")
    p.add_argument("--host", default="localhost",
                   help="this host's name as trainers reach it (default localhost)")
    p.add_argument("--dispatcher", default=None,
                   help="start workers only, for the dispatcher at HOST:PORT")
    p.add_argument("--import", dest="imports", action="append", default=[],
                   help="a module each worker imports first (custom ops); repeatable")
    p.set_defaults(func=_cmd_data_service, parser=p)


def _add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model: any distribution, your own model and data",
        usage="%(prog)s [-h] [--config FILE] [--FLAG=VALUE ...]",
        description="Trains the configuration its flags describe, as recipes/train.py "
                    "does (the same flags: the fields of tfmulti.TrainConfig), and writes "
                    "metrics.json, the model and TensorBoard logs to --model_dir. The "
                    "chief prints the results line; under `tfmulti launch -- tfmulti "
                    "train --distribution=multi_worker ...` the other workers say they "
                    "are done. --config FILE takes the flags' values from a YAML or JSON "
                    "file (a run's <model_dir>/.tfmulti-run.json runs it again); flags on "
                    "the command line override it.")
    config_flags.add_arguments(p)
    p.set_defaults(func=_cmd_train, parser=p)


def _add_diagnose_parser(sub) -> None:
    p = sub.add_parser(
        "diagnose", help="where a training configuration's time goes, and what would help",
        description="Times the input pipeline alone, the train step alone on data already on "
                    "the devices, and both together through fit; names the bottleneck (input, "
                    "compute or per-step overhead), estimates device utilization, and ranks "
                    "the changes that help by their measured gain. Takes the flags of "
                    "tfmulti train (distributions auto, one_device and mirrored).")
    config_flags.add_arguments(p, exclude=DIAGNOSE_EXCLUDES)
    p.add_argument("--prefetch", action=config_flags.BooleanFlag, default=True,
                   help="--no_prefetch: diagnose the input pipeline without prefetching")
    p.add_argument("--cache", action=config_flags.BooleanFlag, default=None,
                   help="--no_cache: diagnose the input pipeline without the in-memory "
                        "cache (default: cached, as training does)")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="about how long each timing runs (default 1)")
    p.add_argument("--measure", action=config_flags.BooleanFlag, default=True,
                   help="--no_measure: list the changes that could help without running "
                        "them")
    p.add_argument("--profile_dir", default=None,
                   help="also write a TensorBoard profiler trace of a few fit steps here")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="plot the time split")
    p.add_argument("--json", action=config_flags.BooleanFlag, default=False,
                   help="print the report as JSON")
    p.set_defaults(func=_cmd_diagnose, parser=p)


def _check_export_paths(model_dir: str, output: str, overwrite: bool) -> None:
    """What `tfmulti export` needs, checked before TensorFlow starts: a readable
    model.keras (a zip archive) in `model_dir`, or the model.weights.h5 a run writes
    when its model cannot be saved whole, and an `output` it may create."""
    source = os.path.join(model_dir, "model.keras")
    weights = os.path.join(model_dir, "model.weights.h5")
    if model_dir and not os.path.isfile(source) and os.path.isfile(weights):
        source = weights
    elif not model_dir or not os.path.isfile(source):
        raise ValueError(f"`model_dir` {model_dir!r} has no model.keras; pass the directory "
                         "a training run wrote (tfmulti train --model_dir).")
    try:
        with open(source, "rb"):
            pass
    except OSError as e:
        raise ValueError(f"cannot read {source} ({e.strerror}); pass a run whose "
                         f"{os.path.basename(source)} this user can read.") from None
    if source != weights and not zipfile.is_zipfile(source):
        raise ValueError(f"{source} is not a Keras model file (not a .keras zip archive); "
                         "pass the directory a training run wrote.")
    if not output:
        raise ValueError("`output` is empty; pass the SavedModel directory to create.")
    if os.path.lexists(output) and not overwrite:
        raise ValueError(f"{os.path.abspath(output)} exists; pass another output directory, "
                         "or set `overwrite` to replace it.")
    check_directory("output", output)


def _cmd_export(args: argparse.Namespace) -> int:
    _check_export_paths(args.model_dir, args.output, args.overwrite)
    from tfmulti.training import export

    path = export.from_model_dir(args.model_dir, args.output, overwrite=args.overwrite,
                                 model_module=args.model)
    print(f"tfmulti export: wrote a SavedModel to {path} (signature serving_default, "
          "endpoint serve)")
    return 0


def _add_export_parser(sub) -> None:
    p = sub.add_parser(
        "export", help="write a trained run's model as a SavedModel for serving",
        description="Loads MODEL_DIR/model.keras (what tfmulti train --model_dir writes, "
                    "from any distribution) and writes it as a TensorFlow SavedModel that "
                    "loads on one device (tf.saved_model.load, keras.layers.TFSMLayer, "
                    "TensorFlow Serving), its inputs named as the model's keras.Input. "
                    "Written to a temporary directory and renamed. A model that Keras "
                    "cannot rebuild from its file (or a run that saved model.weights.h5 "
                    "only) is built again by --model=MODULE:FUNCTION, the run's model "
                    "function, with the saved weights.")
    p.add_argument("--model_dir", required=True, help="the training run's --model_dir")
    p.add_argument("--output", required=True, help="the SavedModel directory to create")
    p.add_argument("--overwrite", action=config_flags.BooleanFlag, default=False,
                   help="replace an existing --output")
    p.add_argument("--model", default=None, metavar="MODULE[:FUNCTION]",
                   help="the run's --model hook: its module is imported first, so that the "
                        "custom layers it defines load; with :FUNCTION, a model that does not "
                        "load is built again by the function and given the saved weights; "
                        "importing runs its code, like python -m")
    p.set_defaults(func=_cmd_export, parser=p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tfmulti", description="Multi-device training for TensorFlow + Keras 3.")
    parser.add_argument("--version", action="version", version=f"tfmulti {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train_parser(sub)
    env = sub.add_parser("env", help="report versions, devices, NCCL, CPUs, oneDNN, RAM, TF_CONFIG")
    env.add_argument("--json", action=config_flags.BooleanFlag, default=False,
                     help="print JSON")
    env.add_argument("--num_virtual_devices", type=int, default=0,
                     help="split the CPU into this many logical devices first")
    env.add_argument("--gpus_per_worker", type=int, default=0,
                     help="also show the GPUs each local worker of `tfmulti launch "
                          "--gpus_per_worker` would see")
    env.add_argument("--num_workers", type=int, default=2,
                     help="with --gpus_per_worker: the local workers (default 2)")
    env.set_defaults(func=_cmd_env, parser=env)
    prep = sub.add_parser("prepare-data",
                          help="prepare a dataset offline (fashion_mnist, tfmulti_text)")
    prep.add_argument("--dataset", default="fashion_mnist")
    prep.add_argument("--data_dir", default=None,
                      help="TFDS data dir (default: $TFDS_DATA_DIR or ~/tensorflow_datasets)")
    prep.add_argument("--source_dir", default=None,
                      help="folder with the IDX files (fashion_mnist) or the .py files "
                           "(tfmulti_text; default: the Python standard library)")
    prep.set_defaults(func=_cmd_prepare_data, parser=prep)
    _add_estimate_memory_parser(sub)
    _add_launch_parser(sub)
    _add_data_service_parser(sub)
    _add_diagnose_parser(sub)
    _add_export_parser(sub)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's name and parser."""
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _option_names(parser: argparse.ArgumentParser) -> set[str]:
    """The names of a parser's --options (what flag_message may restate as flags)."""
    return {a.dest for a in parser._actions if a.option_strings}


def main(argv: list[str] | None = None) -> int:
    # The command's process is tfmulti's own: Keras' optional imports wait for their
    # first use (tfmulti.utils.deferred_imports), installed before a subcommand imports Keras.
    deferred_imports.install()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    quiet.install()  # TensorFlow's C++ start-up lines dropped, TF_CPP_MIN_LOG_LEVEL=2
    try:
        if getattr(args, "config", None) is not None:  # its values, then the flags again
            config_flags.apply_config_file(args.parser, args.config)
            args, unknown = parser.parse_known_args(argv)
        if unknown:  # reported by the subcommand, which knows its options
            args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return args.func(args)
    except (ValueError, OSError) as e:
        message = config_flags.flag_message(str(e), extra_names=_option_names(args.parser))
        print(f"tfmulti {args.command}: error: {message}", file=sys.stderr)
        return exit_codes.USAGE


if __name__ == "__main__":
    sys.exit(main())
