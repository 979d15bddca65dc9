"""The training configuration: one definition, checked without TensorFlow.

`TrainConfig` is the single source of a training run's options. Each field
carries its help text (`metadata["help"]`) and, where the values are a fixed
set, its choices (`metadata["choices"]`); the flags of `tfmulti train`, `recipes/train.py` and
of `tfmulti diagnose` / `tfmulti estimate-memory` are generated from the
fields (`tfmulti.config.flags`), so a new option is one field here.

This module imports neither TensorFlow nor Keras: a recipe or the CLI checks
its flags here and fails at once, before TensorFlow starts.

Also here: the names of the built-in models and their tasks, and the
steps-per-execution policy (`resolve_steps_per_execution`).

Example:
    >>> from tfmulti.config.train_config import TrainConfig
    >>> config = TrainConfig(distribution="mirrored", global_batch_size=512)
    >>> config.validate()
    >>> TrainConfig(learning_rate=float("nan")).validate()
    Traceback (most recent call last):
        ...
    ValueError: `learning_rate` must be a finite number > 0, got nan.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from collections.abc import Callable
from typing import Any

from tfmulti.config import keras_forms
from tfmulti.utils import checks
from tfmulti.utils import human

__all__ = ["AUTO_STEPS_PER_EXECUTION", "BUILTIN_MODELS", "COUNT_LIMITS", "DATA_SERVICE_ENV",
           "DEFAULT_LEARNING_RATE",
           "DIAGNOSE_DISTRIBUTIONS", "DISTRIBUTIONS", "HOOK_PATTERN", "MAX_COUNT", "MAX_DEVICES", "MAX_SEED",
           "MAX_SYNTHETIC_EXAMPLES", "MODEL_PARALLEL", "MODEL_TASKS", "OPTIMIZERS", "SHARDINGS",
           "SPARSE_UPDATES",
           "TRANSFORMER", "TRANSFORMER_LIMITS", "TrainConfig", "check_directory", "check_limits",
           "check_posix_path", "check_transformer_sizes", "data_service_target", "is_hook", "largest_divisor",
           "parse_profile_steps", "parse_steps_per_execution", "resolve_steps_per_execution",
           "validate_for_diagnose"]

DISTRIBUTIONS = ("auto", "one_device", "mirrored", "multi_worker", "pipeline", "hybrid")
"""How a run spreads over devices: tf.distribute strategies, or placed pipeline stages."""
MODEL_PARALLEL = ("pipeline", "hybrid")
"""The distributions that place layer stages on devices (`tfmulti.parallel`)."""
DIAGNOSE_DISTRIBUTIONS = ("auto", "one_device", "mirrored")
"""The distributions `tfmulti diagnose` measures (one process)."""
CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduce_to_one")
MODEL_TASKS = {"mlp": "classification", "regression": "regression", "cnn": "classification"}
"""The built-in model builders (`tfmulti.models.builders.build_model`) and what each one does."""
TRANSFORMER = "transformer"
"""The model name of `tfmulti.models.transformer`'s language model, the one model
`tensor_parallel` splits."""
BUILTIN_MODELS = {**MODEL_TASKS, TRANSFORMER: "classification"}
"""Every built-in model name and its task (the transformer predicts the next byte)."""
TASKS = ("classification", "regression")
DEFAULT_LEARNING_RATE = 1e-3
"""The learning rate of an optimizer given by name when none is given (and the model
function compiled no optimizer of its own)."""
OPTIMIZERS = ("adam", "adamw", "sgd", "rmsprop", "adagrad", "adadelta", "adamax", "adafactor",
              "nadam", "ftrl", "lion", "muon", "schedulefreeadamw")
"""The optimizer names Keras builds (`keras.optimizers.get`; a test keeps the two in step)."""
HOOK_PATTERN = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
"""`package.module:function`: a user's model or dataset function."""
LR_SCALINGS = ("none", "linear", "sqrt")
SHARDINGS = ("auto", "examples", "files", "batches")
"""How several workers split the input (`tfmulti.data.distribute`)."""
ZERO_STAGES = (0, 1, 2, 3)
"""`zero_stage`'s values (`tfmulti.parallel.zero`)."""
SPARSE_UPDATES = ("dense", "lazy")
"""`sparse_updates`' values (`tfmulti.models.sparse_updates`)."""
CLUSTER_RESOLVERS = ("auto", "tf_config", "slurm")
"""How a multi-worker strategy finds its cluster (`tfmulti.get_strategy(cluster_resolver=...)`)."""
PARTITIONS = ("params", "flops", "time")
MIXED_PRECISION = ("none", "bfloat16", "float16")
VERBOSITY = ("auto", 0, 1, 2)

MAX_SEED = 2**32 - 1
"""The largest seed: seeds are 0 to 2**32 - 1, NumPy's range (`keras.utils.set_random_seed`
seeds NumPy, and the synthetic data draws from `numpy.random.default_rng(seed)`)."""
MAX_DEVICES = 256
"""The most devices one process trains on: `num_virtual_devices`, and a pipeline's
replicas x stages x tensor_parallel. Far above a host's GPUs; each device holds a
copy of the model (or a stage), traced once per device, so a typo such as
`num_virtual_devices=100000` would spend its time tracing, not fail."""
MAX_COUNT = 2**31 - 1
"""The largest count (epochs, steps, batch sizes, micro-batches, accumulated steps):
the largest 32-bit integer, a bound against typos: 2**31 steps at a millisecond each
take 25 days, and a batch of 2**31 examples of one float is 8 GiB."""
MAX_SYNTHETIC_EXAMPLES = 1_000_000
"""The most synthetic examples (`num_examples`): the data is generated in memory, 3-4
KiB an example (28 x 28 or 1,024 float32 features), so 10**6 take 3-4 GiB (and a quarter
as many test examples); a larger count would exhaust memory before training."""
TRANSFORMER_LIMITS = {"seq_len": 65536, "d_model": 32768, "num_heads": 32768, "num_layers": 1024}
"""The largest transformer sizes, above any published dense model's (PaLM 540B: d_model
18,432, 118 layers): each size alone past these exhausts memory before training (one
head's attention scores of a 65,536-byte sequence are 16 GiB an example)."""

AUTO_STEPS_PER_EXECUTION = 32
"""The most training steps `steps_per_execution="auto"` puts in one `tf.function`
call: enough to amortize the per-call cost, few enough that progress output,
batch-level callbacks and a preemption (answered at the end of a call) stay
prompt."""


def _field(default: Any, help: str, **metadata) -> Any:  # noqa: A002  (the flag's help)
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of `n` that is at most `limit` (n, limit >= 1)."""
    return max(d for d in range(1, min(limit, n) + 1) if n % d == 0)


DATA_SERVICE_ENV = "TFMULTI_DATA_SERVICE"
"""The environment variable that gives `data_service` when it is unset."""


def data_service_target(value) -> str:
    """`data_service` checked: "local:N" for a service started with the run,
    else the dispatcher's address as grpc://HOST:PORT.

    Raises:
        ValueError: naming the value and the forms accepted.
    """
    text = value.strip() if isinstance(value, str) else value
    forms = ("use local, local:N (N service workers started with the run) or a dispatcher's "
             "address, grpc://HOST:PORT (tfmulti data-service prints it)")
    if not isinstance(text, str) or not text:
        raise ValueError(f"`data_service` must be text, got {value!r}; {forms}.")
    if text == "local" or text.startswith("local:"):
        count = text.partition(":")[2] or "1"
        if not count.isdigit() or not 1 <= int(count) <= MAX_DEVICES:
            raise ValueError(f"`data_service` {value!r}: N in local:N must be a number of "
                             f"service workers from 1 to {MAX_DEVICES}; e.g. local:2.")
        return f"local:{int(count)}"
    address = text.partition("://")[2] if "://" in text else text
    if "://" in text and not text.startswith("grpc://"):
        raise ValueError(f"`data_service` {value!r}: the tf.data service speaks grpc; "
                         f"{forms}.")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in address:
        raise ValueError(f"`data_service` {value!r} is not an address; {forms}.")
    return f"grpc://{host}:{int(port)}"


def check_transformer_sizes(*, seq_len: int, d_model: int, num_heads: int, num_layers: int,
                            mlp_ratio: int = 4, vocab_size: int = 256,
                            tensor_parallel: int = 1) -> None:
    """Checks a transformer's sizes, and that `tensor_parallel` devices split
    its heads, MLP width and vocabulary evenly (`tfmulti.models.transformer`).

    Raises:
        ValueError: naming the size, the value and a value that works.
    """
    for name, value in (("seq_len", seq_len), ("d_model", d_model), ("num_heads", num_heads),
                        ("num_layers", num_layers), ("mlp_ratio", mlp_ratio),
                        ("vocab_size", vocab_size), ("tensor_parallel", tensor_parallel)):
        checks.positive_int(name, value)
        if name in TRANSFORMER_LIMITS:
            checks.positive_int(name, value, maximum=TRANSFORMER_LIMITS[name])
    checks.positive_int("tensor_parallel", tensor_parallel, maximum=MAX_DEVICES)
    if d_model % num_heads:
        raise ValueError(f"`num_heads` ({num_heads}) must divide `d_model` ({d_model}); use "
                         f"e.g. num_heads={largest_divisor(d_model, num_heads)}.")
    sizes = {"num_heads": num_heads, "the MLP width mlp_ratio x d_model": mlp_ratio * d_model,
             "vocab_size": vocab_size}
    for name, size in sizes.items():
        if size % tensor_parallel:
            works = largest_divisor(math.gcd(*sizes.values()), tensor_parallel)
            raise ValueError(
                f"`tensor_parallel` ({tensor_parallel}) must divide {name} ({size}) to split it "
                f"evenly; use tensor_parallel={works} or change {name.split()[-1]}.")


def parse_steps_per_execution(value) -> int | str:
    """"auto" or a positive integer (also given as text, e.g. from a flag)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        number = int(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise ValueError(f"`steps_per_execution` must be 'auto' or a positive integer, got "
                         f"{value!r}.")
    return number


def parse_profile_steps(value) -> tuple[int, int] | None:
    """The first and last global step to profile, from "A,B" (also a pair of
    integers, e.g. from a config file); None for None or "".

    Raises:
        ValueError: not two integers A,B with 1 <= A <= B (up to `MAX_COUNT`).

    Example:
        >>> parse_profile_steps("10,12"), parse_profile_steps(None)
        ((10, 12), None)
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    parts = value.split(",") if isinstance(value, str) else value
    try:
        first, last = (int(p) if isinstance(p, str) else p for p in parts)
    except (TypeError, ValueError):
        first = last = None
    if not (checks.is_int(first) and checks.is_int(last) and 1 <= first <= last <= MAX_COUNT):
        raise ValueError(f"`profile_steps` must be two global steps A,B with 1 <= A <= B, "
                         f"e.g. 10,12 (steps 10 to 12, counted from 1), got {value!r}.")
    return first, last


def resolve_steps_per_execution(value, steps_per_epoch: int | None,
                                backup_every_steps: int | None = None) -> int:
    """The training steps per `tf.function` call for `value`.

    An integer must divide `steps_per_epoch` (Keras runs whole calls, so an
    epoch would otherwise train more steps). "auto" is the largest divisor of
    `steps_per_epoch` up to `AUTO_STEPS_PER_EXECUTION` that also divides
    `backup_every_steps` (backups come at the end of a call); 1 when the
    epoch length is unknown.

    Raises:
        ValueError: `value` is neither "auto" nor a positive integer, or does
            not divide `steps_per_epoch`.
    """
    value = parse_steps_per_execution(value)
    if value != "auto":
        if steps_per_epoch and steps_per_epoch % value:
            raise ValueError(
                f"`steps_per_execution` ({value}) must divide the steps per epoch "
                f"({steps_per_epoch}): Keras runs whole calls of steps, so an epoch would "
                f"train {-(-steps_per_epoch // value) * value} steps; use a divisor of "
                f"{steps_per_epoch}, 'auto', or another number of steps per epoch.")
        return value
    if not steps_per_epoch:
        return 1
    return largest_divisor(math.gcd(steps_per_epoch, backup_every_steps or 0),
                           AUTO_STEPS_PER_EXECUTION)


# A hook string (`--model`, `--dataset`, `--loss`, `--callbacks`) is code: said in each
# one's help.
_TRUST = (" Such a string imports a module and calls a function, running their code as "
          "python -m would (--{flag}=os:abort calls os.abort): pass only strings you trust.")


@dataclasses.dataclass
class TrainConfig:
    """A training run. Batch sizes are global (all replicas together).

    Every field is also a flag of `tfmulti train` and `recipes/train.py` (`--name=value`)
    and a key of a `--config` file; its help text (`metadata["help"]`, after its default in
    the source) is the flag's help.
    """

    distribution: str = _field(
        "auto", "How to spread the run over devices: auto, one_device, mirrored "
        "(MirroredStrategy), multi_worker (MultiWorkerMirroredStrategy, under `tfmulti launch` "
        "or with TF_CONFIG), pipeline or hybrid (layer stages placed on devices).",
        choices=DISTRIBUTIONS)
    num_virtual_devices: int = _field(
        0, "Split the host CPU into this many logical devices first (0: leave devices as "
        "they are).")
    devices: tuple[str, ...] | None = _field(
        None, "Devices to use, e.g. CPU:0,CPU:1 (default: all GPUs, else all logical CPUs).")
    cross_device_ops: str = _field(
        "auto", "Gradient all-reduce of the mirrored distribution: auto, nccl, "
        "hierarchical_copy or reduce_to_one.", choices=CROSS_DEVICE_OPS)
    dataset: str | Callable = _field(
        "fashion_mnist", "The data: a TFDS dataset name, synthetic / synthetic_regression, "
        "or your own as package.module:function, a function returning the train and test "
        "data (unbatched tf.data datasets, (features, labels) arrays, or a dict with "
        "'train', 'test' and optionally 'validation' and 'num_classes'; it may take seed and "
        "data_dir). From "
        "Python, also the function itself." + _TRUST.format(flag="dataset"))
    data_dir: str | None = _field(
        None, "TFDS data dir (default: $TFDS_DATA_DIR, else ~/tensorflow_datasets); a path of "
        "this machine, as model_dir.")
    download: bool = _field(
        False, "Allow a TFDS download when the data is not prepared (needs internet).")
    num_examples: int | None = _field(
        None, "Synthetic data: training examples (a quarter as many test examples).")
    validation_split: float = _field(
        0.0, "Hold out this fraction of the training examples, the last ones (taken before "
        "shuffling, as Keras' validation_split), and evaluate on them after every epoch: val_* "
        "metrics in the history and metrics.json, for callbacks such as EarlyStopping on "
        "val_loss. In (0, 1); 0: none (a dataset function may return a 'validation' split "
        "instead). Needs data of known size (not files).")
    model: str | Callable = _field(
        "mlp", "The model: a built-in builder (mlp, cnn, regression; transformer, a byte-level "
        "language model for dataset tfmulti_text, sized by seq_len, d_model, num_heads and "
        "num_layers, split by tensor_parallel), or your own as "
        "package.module:function, a function returning a Keras model, which tfmulti calls "
        "under the strategy's scope (found on sys.path or in the current directory, which is "
        "searched after the standard library; it may take input_shape, num_classes, dropout "
        "and seed). From Python, also the function itself." + _TRUST.format(flag="model"))
    dropout: float = _field(0.2, "Dropout rate, in [0, 1).")
    epochs: int = _field(5, "Training epochs.")
    steps_per_epoch: int | None = _field(
        None, "Steps per epoch (default: one pass over the data; for data of unknown size, "
        "such as files, counted once by reading it, or this many steps per pass).")
    global_batch_size: int = _field(256, "Examples per step over all replicas.")
    learning_rate: float | None = _field(
        None, "Learning rate, tuned for base_batch_size (default: the rate of the optimizer "
        "your model function compiled the model with, else 1e-3).")
    lr_scaling: str = _field(
        "none", "Scale the learning rate with global / base batch size: none, linear or sqrt.",
        choices=LR_SCALINGS)
    base_batch_size: int = _field(256, "The batch size learning_rate was tuned for.")
    warmup_epochs: float = _field(
        0.0, "Epochs of linear learning-rate warmup up to the (scaled) rate: from "
        "learning_rate when lr_scaling raises it, else from near 0.")
    optimizer: str | object | None = _field(
        None, "Optimizer: any Keras optimizer name (adam runs a fused update; sgd, rmsprop, "
        "adamw, ...), built with learning_rate (default: the optimizer your model function "
        "compiled the model with, else adam). From Python, also a Keras optimizer object "
        "(its own learning rate; lr_scaling and warmup still apply).")
    loss: str | Callable | dict | list | None = _field(
        None, "Loss: any Keras loss name (e.g. sparse_categorical_crossentropy, mse, huber) "
        "or your own as package.module:function, loss(y_true, y_pred); for a model with "
        "several outputs, one per output as OUTPUT=LOSS items (priority=binary_crossentropy,"
        "department=mse) or a list by output position. Default: the loss your model function "
        "compiled the model with, else by task for each output, chosen from the layer that "
        "makes it (classification: cross-entropy, categorical for one-hot labels, on "
        "probabilities after a softmax, binary after a sigmoid, else from logits; regression: "
        "mean squared error). From Python, also a Keras loss object or a function "
        "loss(y_true, y_pred), or a dict or list of them." + _TRUST.format(flag="loss"),
        form="loss")
    metrics: tuple[str, ...] | dict | list | None = _field(
        None, "Metrics: Keras metric names, e.g. accuracy,auc; for one output of several, "
        "OUTPUT=METRIC items (priority=accuracy,priority=auc,department=mae). Default: the "
        "metrics your model function compiled the model with, else by task (accuracy, or mae "
        "for regression) for each output. From Python, also metric objects, a dict or a list "
        "per output.", form="metrics")
    weighted_metrics: tuple[str, ...] | dict | list | None = _field(
        None, "Metrics weighted by the sample weights and class_weight, in the form of "
        "metrics (default: those your model function compiled the model with, else none).",
        form="metrics")
    loss_weights: dict | list | None = _field(
        None, "For a model with several outputs: the weight of each output's loss in the "
        "total, as OUTPUT=WEIGHT items (priority=1.0,department=0.2) or a list by output "
        "position (default: those your model function compiled the model with, else 1 each).",
        form="loss_weights")
    class_weight: dict | str | None = _field(
        None, "Weigh each training example's loss by its class, as Keras' fit(class_weight=) "
        "does, for a model with one output: CLASS=WEIGHT items (0=1.0,1=25.0), or balanced "
        "(each class n / (classes x its count), counted from the training labels). Not with "
        "sample weights of the data's own (as in Keras); the test and validation splits are "
        "not weighted.", form="class_weight")
    task: str = _field(
        "auto", "What the model does, for the default loss and metrics: auto (the built-in "
        "model's task; for your own model, classification when the labels are integers or "
        "one-hot rows, else regression), classification or regression.", choices=("auto", *TASKS))
    accumulate_steps: int = _field(
        1, "Gradient accumulation: each update sums the gradients of this many micro-steps "
        "of global_batch_size examples, run one after the other (the memory of one), equal "
        "to one step on a batch this many times larger; steps per epoch and lr_scaling "
        "count those updates.")
    zero_stage: int = _field(
        0, "Sharded data parallelism (ZeRO) under mirrored and multi_worker: 0 keeps a whole "
        "copy of the training state on every replica; 1 splits the optimizer's slots (Adam's "
        "moments) over the replicas, each holding and updating 1/N of them; 2 also splits the "
        "gradients (reduce-scattered, no replica holds their whole sum); 3 also splits the "
        "parameters (each gathered whole where the step reads it). The same weights as 0.")
    shard_embeddings: bool = _field(
        False, "Split each Embedding table's rows over the data-parallel replicas "
        "(mirrored, multi_worker): each holds 1/N of a table's rows and their optimizer "
        "slots, a lookup goes to the rows' owners and back (collectives the batch's size), "
        "and a table's gradient stays with its rows. The same weights as unsharded; for "
        "tables too big for one replica.")
    sparse_updates: str = _field(
        "dense", "How the optimizer applies an embedding table's gradient, the rows a batch "
        "touched: dense (Keras' own update; Adam, RMSprop and momentum then move every row "
        "of the table and its slots every step) or lazy (only the touched rows and their "
        "slots: Adam, AdamW, SGD, Adagrad, RMSprop; an untouched row keeps its value and "
        "slots, as TF 1's LazyAdam). Lazy is many times faster on large tables; where "
        "every row is touched every step it is the dense update.", choices=SPARSE_UPDATES)
    seed: int | None = _field(0, "Seed for the weights and the data order.")
    steps_per_execution: int | str = _field(
        "auto", "Training steps per tf.function call (less per-step overhead): a divisor of "
        f"the steps per epoch, or auto (the largest one up to {AUTO_STEPS_PER_EXECUTION}, "
        "and a divisor of backup_every_steps).")
    input_sharding: str = _field(
        "auto", "How several workers split the training input: examples (every worker reads "
        "everything and keeps its share of each global batch: exact), files (each worker reads "
        "only its own files: 1/N of the bytes), batches (each worker reads only its own "
        "batches of a PyDataset, or the generator the dataset function made for it), or auto "
        "(files for tfmulti.data.from_files with at least one file per worker, batches for a "
        "PyDataset of at least one batch per worker or a dataset function taking "
        "worker_index).",
        choices=SHARDINGS)
    cluster_resolver: str = _field(
        "auto", "Where multi_worker finds its cluster: auto (TF_CONFIG when set, else SLURM "
        "under srun with 2 or more tasks), tf_config or slurm.", choices=CLUSTER_RESOLVERS)
    data_service: str | None = _field(
        None, "Read the training batches from a tf.data service, whose workers run the input "
        "pipeline (reading, maps, batching) in other processes: local (one service worker on "
        "this host, started and stopped with the run), local:N (N of them), or the address "
        "of a service started by tfmulti data-service (grpc://HOST:PORT). The batches and "
        "their order are those of the run without it. Default: the TFMULTI_DATA_SERVICE "
        "environment variable (tfmulti launch --data_service sets it), else none.")
    data_service_timeout: float = _field(
        300.0, "Seconds a training step may wait for its batch from the tf.data service "
        "before the run stops with a message (a lost service worker); the first step, which "
        "also builds the model, 4 times as long, and a run of longer calls 3 times its "
        "longest call.")
    num_stages: int = _field(2, "Pipeline stages per replica (pipeline, hybrid).")
    num_microbatches: int = _field(4, "Micro-batches per replica batch (pipeline, hybrid).")
    num_replicas: int = _field(2, "Data-parallel pipelines (hybrid).")
    partition: str = _field(
        "params", "How to balance pipeline stages: params, flops or time.", choices=PARTITIONS)
    remat: bool = _field(
        False, "Recompute stage activations in the backward pass (pipeline, hybrid; no "
        "dropout or batch normalization).")
    tensor_parallel: int = _field(
        1, "Tensor parallelism T: each pipeline stage's attention heads, MLP and output head "
        "split over T devices (model transformer; pipeline, hybrid): replicas x stages x T "
        "devices in all. Your own model (pipeline, num_stages=1): its MultiHeadAttention "
        "layers and Sequential MLP blocks, also inside your own layers "
        "(tfmulti.parallel.split_layers).")
    seq_len: int = _field(128, "Transformer: bytes per training sequence.")
    d_model: int = _field(128, "Transformer: the width of the residual stream.")
    num_heads: int = _field(4, "Transformer: attention heads (dividing d_model).")
    num_layers: int = _field(2, "Transformer: blocks.")
    device_memory_mb: float | None = _field(
        None, "Refuse a layout whose estimated training memory (tfmulti estimate-memory) "
        "exceeds this many MiB on some device (default: no check).")
    mixed_precision: str = _field(
        "none", "Compute in 16 bits, keep variables and logits float32: none, bfloat16 "
        "(CPUs and recent GPUs) or float16 (GPUs only; loss scaling is automatic).",
        choices=MIXED_PRECISION)
    jit_compile: bool = _field(
        False, "Compile the train step with XLA (one device; not with pipeline or hybrid).")
    backup_dir: str | None = _field(
        None, "Make the run resumable: checkpoints here at every epoch end and every "
        "backup_every_steps; rerun the same command after a crash or preemption to resume "
        "at the next step. Deleted when the run ends normally (unless keep_backup). Must be "
        "readable by every worker; a path of this machine, as model_dir.")
    backup_every_steps: int | None = _field(
        None, "Also back up every this many global steps (needs backup_dir).")
    keep_backup: bool = _field(False, "Keep backup_dir after the run ends normally.")
    discard_unreadable_backup: bool = _field(
        False, "Start from step 0 when backup_dir holds a backup that cannot be read "
        "(permissions, an I/O error, a missing mount), discarding it (default: stop, naming "
        "the file and the error, and touch nothing).")
    model_dir: str | None = _field(
        None, "Where to write metrics.json, model.keras and TensorBoard logs; a folder that "
        "holds another run's outputs is refused unless overwrite, one with files tfmulti did "
        "not write always. A POSIX path (a local disk, NFS, or a bucket mounted with a FUSE "
        "driver such as gcsfuse or s3fs); URLs such as gs://bucket/run are refused.")
    overwrite: bool = _field(
        False, "Replace the outputs an earlier tfmulti run published in model_dir (recorded in "
        "its .tfmulti-run.json), once this run publishes its own; files tfmulti did not write "
        "are never replaced.")
    verbose: int | str = _field(
        "auto", "Progress output: auto (a progress bar on a terminal, a line per epoch "
        "otherwise; nothing on workers other than the chief), 0, 1 or 2.", choices=VERBOSITY)
    tensorboard: bool = _field(
        True, "Write TensorBoard logs (the epoch metrics, by Keras' TensorBoard callback) to "
        "<model_dir>/logs, on the chief; off, no logs folder is written.")
    profile_steps: str | tuple | None = _field(
        None, "Profile the global training steps A to B (counted from 1), given as A,B, e.g. "
        "10,12: a TensorBoard profile (its Profile tab: the time of each op on each device) "
        "in <model_dir>/logs/train/plugins/profile, on the chief. Whole tf.function calls are "
        "profiled, steps_per_execution steps each. Needs model_dir and tensorboard.")
    callbacks: str | Callable | None = _field(
        None, "Your own Keras callbacks (an experiment tracker, early stopping, ...) as "
        "package.module:function, a function returning a list of keras.callbacks.Callback, "
        "called on every worker after the model is built, before training; it may take "
        "model_dir, is_chief, worker_index, num_workers and config (the TrainConfig). Only the "
        "chief should write: return the writing callbacks where is_chief. From Python, also "
        "the function itself." + _TRUST.format(flag="callbacks"))

    def _check_shard_embeddings(self) -> None:
        """Refuses a distribution `shard_embeddings` does not run under, and
        what it cannot be combined with (`check_shard_embeddings_settings`)."""
        if self.distribution not in ("mirrored", "multi_worker", "auto"):
            raise ValueError(
                f"`shard_embeddings` splits the tables' rows over data-parallel replicas: "
                f"distribution 'mirrored' or 'multi_worker', got {self.distribution!r}; leave "
                f"shard_embeddings off for {self.distribution!r}.")
        self.check_shard_embeddings_settings()

    def check_shard_embeddings_settings(self) -> None:
        """Refuses, in one line, the settings (whatever the distribution) that
        tables sharded by rows cannot be combined with: `tfmulti train`'s
        check and `tfmulti estimate-memory`'s (which refuses distributions
        its own way)."""
        if self.sparse_updates == "lazy":
            raise ValueError(
                "`sparse_updates` 'lazy' and `shard_embeddings` cannot be combined yet: a "
                "sharded table's update is dense over its shard (1/N of the rows); use one "
                "of them.")
        if self.accumulate_steps > 1:
            raise ValueError(
                f"`shard_embeddings` routes each lookup through the replicas in the step, "
                f"and accumulate_steps={self.accumulate_steps} runs the micro-steps in a loop "
                f"where the replicas cannot exchange data; use accumulate_steps=1 (a larger "
                f"global_batch_size) or leave shard_embeddings off.")

    @property
    def model_parallel(self) -> bool:
        """Whether layer stages are placed on devices (pipeline, hybrid)."""
        return self.distribution in MODEL_PARALLEL

    @property
    def builtin_model(self) -> bool:
        """Whether `model` names one of tfmulti's builders."""
        return isinstance(self.model, str) and self.model in BUILTIN_MODELS

    @property
    def builtin_task(self) -> str | None:
        """The task when it is known without the data: `task`, else the built-in
        model's; None for "auto" with the user's own model (the labels decide)."""
        if self.task != "auto":
            return self.task
        return BUILTIN_MODELS[self.model] if self.builtin_model else None

    @property
    def model_name(self) -> str:
        """The model as text (a built-in name, `module:function`, or the function's name)."""
        return _hook_name(self.model)

    @property
    def dataset_name(self) -> str:
        """The data as text (a dataset name, `module:function`, or the function's name)."""
        return _hook_name(self.dataset)

    def replace(self, **changes) -> "TrainConfig":
        """A copy with `changes` applied (not validated)."""
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Checks every field that needs no TensorFlow.

        Raises:
            ValueError: naming the field, the value and what is accepted.
        """
        c = checks
        for f in dataclasses.fields(self):
            if "choices" in f.metadata:
                c.one_of(f.name, getattr(self, f.name), f.metadata["choices"])
        for name in ("epochs", "global_batch_size", "base_batch_size"):
            _count(name, getattr(self, name))
        for name in ("steps_per_epoch", "backup_every_steps"):
            _count(name, getattr(self, name), none_ok=True)
        _count("num_examples", self.num_examples, MAX_SYNTHETIC_EXAMPLES, none_ok=True,
               why="synthetic data is made in memory, 3-4 KiB an example")
        devices_hint = "0 leaves the devices as they are"
        c.non_negative_int("num_virtual_devices", self.num_virtual_devices, hint=devices_hint)
        c.non_negative_int("num_virtual_devices", self.num_virtual_devices,
                           maximum=MAX_DEVICES, hint=devices_hint)
        c.integer("seed", self.seed, minimum=0, maximum=MAX_SEED, none_ok=True)
        _count("accumulate_steps", self.accumulate_steps, hint="1 updates at every step")
        c.non_negative_int("zero_stage", self.zero_stage, maximum=max(ZERO_STAGES),
                           hint="0 replicates the training state")
        if self.zero_stage and self.distribution not in ("mirrored", "multi_worker", "auto"):
            raise ValueError(
                f"`zero_stage` ({self.zero_stage}) shards the training state over data-parallel "
                f"replicas: distribution 'mirrored' or 'multi_worker', got "
                f"{self.distribution!r}; set zero_stage=0 for {self.distribution!r}.")
        if self.shard_embeddings:
            self._check_shard_embeddings()
        if self.zero_stage and self.sparse_updates == "lazy":
            raise ValueError(
                f"`sparse_updates` 'lazy' updates a table's touched rows in its whole slots, "
                f"and zero_stage={self.zero_stage} splits the slots over the replicas; use "
                "one of them (sparse_updates='dense', or zero_stage=0).")
        if self.data_service is not None:
            data_service_target(self.data_service)
        c.positive_number("data_service_timeout", self.data_service_timeout)
        _check_hook("model", self.model, tuple(BUILTIN_MODELS))
        _check_hook("dataset", self.dataset, None)
        self._check_keras_forms()
        if isinstance(self.optimizer, str):
            c.one_of("optimizer", self.optimizer.lower(), OPTIMIZERS)
        if self.builtin_model and self.task not in ("auto", BUILTIN_MODELS[self.model]):
            raise ValueError(f"`task` {self.task!r} does not fit `model` {self.model!r}, which "
                             f"does {BUILTIN_MODELS[self.model]}; leave task='auto'.")
        steps_per_execution = parse_steps_per_execution(self.steps_per_execution)
        if steps_per_execution != "auto":
            _count("steps_per_execution", steps_per_execution)
        if self.learning_rate is not None:  # None: the model's own, else 1e-3
            c.positive_number("learning_rate", self.learning_rate)
        c.finite_number("warmup_epochs", self.warmup_epochs, minimum=0)
        c.finite_number("dropout", self.dropout, minimum=0)
        if not self.dropout < 1:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout!r}.")
        split = self.validation_split
        if isinstance(split, bool) or not isinstance(split, numbers.Real) \
                or not (split == 0 or 0 < split < 1):
            raise ValueError(f"`validation_split` must be in (0, 1), the fraction of the "
                             f"training examples held out (0: none), got {split!r}; e.g. 0.2 "
                             f"holds out the last 20%.")
        if self.devices is not None and (isinstance(self.devices, str) or not self.devices):
            raise ValueError(f"`devices` must be a non-empty tuple of device names (or None), "
                             f"got {self.devices!r}; e.g. ('CPU:0', 'CPU:1').")
        _count("tensor_parallel", self.tensor_parallel, MAX_DEVICES)
        if self.model_parallel:
            for name, most in (("num_stages", MAX_DEVICES), ("num_microbatches", MAX_COUNT),
                               ("num_replicas", MAX_DEVICES)):
                _count(name, getattr(self, name), most)
            replicas = self.num_replicas if self.distribution == "hybrid" else 1
            used = replicas * self.num_stages * self.tensor_parallel
            if used > MAX_DEVICES:
                shown = (f"`num_replicas` ({replicas})" if self.distribution == "hybrid"
                         else "1 replica")
                raise ValueError(
                    f"{shown} x `num_stages` ({self.num_stages}) x "
                    f"`tensor_parallel` ({self.tensor_parallel}) = {used} devices, more than "
                    f"the {MAX_DEVICES} one process trains on; use fewer stages or replicas.")
            if self.global_batch_size % (replicas * self.num_microbatches):
                raise ValueError(
                    f"`global_batch_size` ({self.global_batch_size}) must split into "
                    f"{human.count(replicas, 'replica')} x {self.num_microbatches} "
                    f"micro-batches; use a "
                    f"multiple of {replicas * self.num_microbatches}.")
            if self.jit_compile:
                raise ValueError(
                    f"`jit_compile` cannot be used with distribution {self.distribution!r}: "
                    f"XLA would compile the step as one cluster and collapse the per-stage "
                    f"device placement; set jit_compile=False or use one_device/mirrored.")
        c.positive_number("device_memory_mb", self.device_memory_mb, none_ok=True)
        if self.tensor_parallel > 1 and not self.model_parallel:
            raise ValueError(
                f"`tensor_parallel` ({self.tensor_parallel}) needs distribution 'pipeline' or "
                f"'hybrid' (stages of {self.tensor_parallel} devices; num_stages=1 for tensor "
                f"parallelism alone), got {self.distribution!r}.")
        if self.tensor_parallel > 1 and self.builtin_model and self.model != TRANSFORMER:
            raise ValueError(f"`tensor_parallel` ({self.tensor_parallel}) splits model "
                             f"{TRANSFORMER!r}, got model {self.model!r}; set "
                             f"model={TRANSFORMER!r} or tensor_parallel=1. It also splits your "
                             f"own model (model='module:function') on one pipeline stage.")
        if self.tensor_parallel > 1 and not self.builtin_model and (
                self.distribution != "pipeline" or self.num_stages != 1):
            raise ValueError(f"`tensor_parallel` ({self.tensor_parallel}) splits your own model "
                             f"over one pipeline stage; set distribution='pipeline' and "
                             f"num_stages=1, got {self.distribution!r} with num_stages="
                             f"{self.num_stages}.")
        if self.model == TRANSFORMER:
            check_transformer_sizes(seq_len=self.seq_len, d_model=self.d_model,
                                    num_heads=self.num_heads, num_layers=self.num_layers,
                                    tensor_parallel=self.tensor_parallel)
        if self.backup_every_steps and not self.backup_dir:
            raise ValueError("`backup_every_steps` needs `backup_dir`; set `backup_dir` too.")
        if self.data_dir:
            check_posix_path("data_dir", self.data_dir)
        if self.backup_dir is not None:
            if not self.backup_dir:
                raise ValueError("`backup_dir` is empty; pass a directory path.")
            check_directory("backup_dir", self.backup_dir)
            if self.seed is None:
                raise ValueError("`backup_dir` needs a fixed `seed`: a resumed run skips the "
                                 "batches already trained, which must come in the same "
                                 "order; set `seed`.")
        if self.model_dir:
            check_directory("model_dir", self.model_dir)
        self._check_logging()

    def _check_keras_forms(self) -> None:
        """`loss`, `metrics`, `weighted_metrics`, `loss_weights` and `class_weight`
        in Keras' forms (`tfmulti.config.keras_forms`), normalized in place; each
        loss given by name that is a hook (`package.module:function`) well formed."""
        for name in ("loss", "metrics", "weighted_metrics", "loss_weights", "class_weight"):
            setattr(self, name, keras_forms.check(name, getattr(self, name)))
        losses = (self.loss.values() if isinstance(self.loss, dict) else self.loss
                  if isinstance(self.loss, list) else [] if self.loss is None else [self.loss])
        for loss in losses:
            if isinstance(loss, str) and ":" in loss:
                _check_hook("loss", loss, None)

    def _check_logging(self) -> None:
        """`tensorboard`, `profile_steps` and `callbacks`."""
        if not isinstance(self.tensorboard, bool):
            raise ValueError(f"`tensorboard` must be True or False, got {self.tensorboard!r}.")
        if self.callbacks is not None and not (
                callable(self.callbacks) and not isinstance(self.callbacks, str)) \
                and not is_hook(self.callbacks):
            raise ValueError(f"`callbacks` must be package.module:function, got "
                             f"{self.callbacks!r}; write e.g. my_tracker:callbacks (the "
                             f"function `callbacks` in my_tracker.py, returning a list of "
                             f"keras.callbacks.Callback).")
        steps = parse_profile_steps(self.profile_steps)
        if steps is None:
            return
        shown = f"{steps[0]},{steps[1]}"
        if not self.model_dir:
            raise ValueError(f"`profile_steps` ({shown}) writes the profile into "
                             f"<model_dir>/logs; set `model_dir` too.")
        if not self.tensorboard:
            raise ValueError(f"`profile_steps` ({shown}) writes a TensorBoard profile, and "
                             f"`tensorboard` is off; set tensorboard=True or leave "
                             f"profile_steps out.")


COUNT_LIMITS = {**{name: MAX_COUNT for name in (
    "epochs", "steps_per_epoch", "global_batch_size", "base_batch_size", "backup_every_steps",
    "accumulate_steps", "num_microbatches")}, "num_examples": MAX_SYNTHETIC_EXAMPLES,
    **{name: MAX_DEVICES for name in ("num_virtual_devices", "num_stages", "num_replicas",
                                      "tensor_parallel")}, **TRANSFORMER_LIMITS}
"""The largest value of each count field (`TrainConfig.validate` and `check_limits`)."""


def check_limits(**values) -> None:
    """Checks the upper bounds of the count fields among `values` (others pass):
    for callers that take a few of `TrainConfig`'s fields, such as `tfmulti
    estimate-memory`, before their own checks.

    Raises:
        ValueError: an integer above its field's `COUNT_LIMITS`, stating the range.

    Example:
        >>> check_limits(num_stages=4, optimizer="adam")
        >>> check_limits(num_stages=100000)
        Traceback (most recent call last):
            ...
        ValueError: `num_stages` must be an integer from 1 to 256, got 100000.
    """
    for name, value in values.items():
        if name in COUNT_LIMITS and checks.is_int(value) and value > COUNT_LIMITS[name]:
            checks.positive_int(name, value, maximum=COUNT_LIMITS[name])


def _count(name: str, value, maximum: int = MAX_COUNT, *, none_ok: bool = False,
           hint: str = "", why: str = "") -> None:
    """A positive integer up to `maximum`: below 1 or not an integer, "must be a
    positive integer" (and `hint`); above `maximum`, the whole range (and `why`)."""
    checks.positive_int(name, value, none_ok=none_ok, hint=hint)
    checks.positive_int(name, value, maximum=maximum, none_ok=none_ok, hint=why or hint)


def validate_for_diagnose(config: TrainConfig) -> None:
    """`config.validate()`, and a distribution `tfmulti diagnose` measures.

    Raises:
        ValueError: a bad configuration, or a distribution of several processes
            or placed stages.
    """
    config.validate()
    checks.one_of("distribution", config.distribution, DIAGNOSE_DISTRIBUTIONS,
                   hint="diagnose measures one process (for multi_worker, diagnose one worker "
                        "with distribution='mirrored' on its devices)")


def _hook_name(value) -> str:
    if isinstance(value, str):
        return value
    module = getattr(value, "__module__", None)
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    return f"{module}:{name}" if module and name else repr(value)


def is_hook(value) -> bool:
    """Whether `value` names a user's function (`package.module:function`)."""
    return isinstance(value, str) and HOOK_PATTERN.fullmatch(value) is not None


def _check_hook(name: str, value, builtins: tuple | None) -> None:
    """A built-in name (any name where `builtins` is None), `module:function`, or a callable."""
    if callable(value) and not isinstance(value, str):
        return
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"`{name}` must be a name or package.module:function, got {value!r}.")
    if ":" in value:
        if not is_hook(value):
            module = {"loss": "my_losses"}.get(name, f"my_{name}s")
            raise ValueError(f"`{name}` {value!r} is not package.module:function; write e.g. "
                             f"{module}:build (the function `build` in {module}.py).")
        return
    if builtins is not None and value not in builtins:
        raise ValueError(f"`{name}` must be one of {list(builtins)} or your own "
                         f"package.module:function, got {value!r}.")


def check_directory(name: str, path: str) -> None:
    """`path` is a directory this process can write, or can be created: checked
    before anything starts, so a bad path fails at once, not at the first save.

    Raises:
        ValueError: `path` is a URL (`check_posix_path`), a file, or neither it
            nor the folder it would be created in is writable by this user.
    """
    check_posix_path(name, path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"`{name}` {path!r} exists and is not a directory; pass a directory "
                         "path.")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"`{name}` {path!r} cannot be created: {existing!r} is a file, not a "
                         "directory; pass another path.")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == os.path.abspath(path) else \
            f"cannot be created: {existing!r} is not writable"
        raise ValueError(f"`{name}` {path!r} {what} by this user; pass a directory you can "
                         "write.")


_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# A FUSE driver that mounts each common scheme's buckets as a folder and renames files
# there, as tfmulti's writes do (os.replace): mountpoint-s3 does not rename.
_FUSE_DRIVERS = {"gs": "gcsfuse", "s3": "s3fs", "hdfs": "hdfs-fuse", "abfs": "blobfuse2",
                 "az": "blobfuse2"}


def check_posix_path(name: str, path: str) -> None:
    """`path` is a path of this machine's file system, not a URL (`gs://...`,
    `s3://...`, any `scheme://`).

    tfmulti writes its outputs, backups and locks through the operating
    system's files (`open`, `os.replace`, `fcntl.flock`), where `gs://b/run`
    would be the local folder `./gs:/b/run`; a bucket is used mounted as a
    folder by a FUSE driver that renames files (gcsfuse, s3fs), NFS or a
    local disk.

    Raises:
        ValueError: `path` starts with a URL scheme; the message names the
            FUSE driver that mounts it.

    Example:
        >>> check_posix_path("model_dir", "/mnt/bucket/run")
        >>> check_posix_path("model_dir", "gs://bucket/run")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: `model_dir` 'gs://bucket/run' is a URL: ... with a FUSE driver (gcsfuse \
for gs://), e.g. /mnt/bucket/run.
    """
    match = _URL.match(str(path))
    if not match:
        return
    scheme = match.group(1).lower()
    driver = _FUSE_DRIVERS.get(scheme, "gcsfuse, s3fs")
    rest = path[match.end():]
    example = rest if scheme == "file" else f"/mnt/{rest}"  # file:///tmp/run is /tmp/run
    raise ValueError(f"`{name}` {path!r} is a URL: tfmulti reads and writes through the "
                     f"operating system's files and needs a POSIX path: a local disk, NFS, "
                     f"or the bucket mounted with a FUSE driver ({driver}"
                     f"{f' for {scheme}://' if scheme in _FUSE_DRIVERS else ''}), e.g. "
                     f"{example}.")
