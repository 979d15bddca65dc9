"""Thin Keras model builders, a compile helper and the mixed-precision policy.

Builders create every variable under the strategy's scope, and the MLP
flattens its image input.

Example:
    >>> import tfmulti
    >>> strategy = tfmulti.get_strategy("one_device")
    >>> model = tfmulti.models.builders.build_model("mlp", strategy=strategy)
    >>> _ = tfmulti.models.builders.compile_model(model, strategy=strategy, task="classification")
    >>> model.optimizer.__class__.__name__
    'Adam'
"""

from __future__ import annotations

import contextlib
import math

import keras
import tensorflow as tf

from tfmulti.config.train_config import (
    DEFAULT_LEARNING_RATE,
    LR_SCALINGS,
    MIXED_PRECISION,
    MODEL_TASKS,
    OPTIMIZERS,
    TASKS,
    resolve_steps_per_execution,
)
from tfmulti.models import accumulation, optimizers
from tfmulti.models.heads import (
    default_loss,
    default_metrics,
    output_head,
    output_heads,
)
from tfmulti.utils import checks

__all__ = ["INPUT_SHAPES", "WarmupSchedule", "build_model", "compile_model", "default_loss",
           "default_metrics", "make_optimizer", "mixed_precision_policy", "model_task",
           "output_head", "output_heads", "scaled_learning_rate", "trains_by_own_step"]


def _mlp(input_shape, num_classes, dropout):
    return [
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(512, activation="relu", name="fc1"),
        keras.layers.Dropout(dropout, name="dropout"),
        keras.layers.Dense(num_classes, name="logits", dtype="float32"),
    ]


def _regression(input_shape, num_classes, dropout):
    return [
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(1024, activation="relu", name="dense1"),
        keras.layers.Dense(1024, activation="relu", name="dense2"),
        keras.layers.Dense(1, name="output", dtype="float32"),
    ]


def _cnn(input_shape, num_classes, dropout):
    return [
        keras.layers.Conv2D(32, 3, activation="relu", name="conv1"),
        keras.layers.MaxPooling2D(name="pool1"),
        keras.layers.Conv2D(64, 3, activation="relu", name="conv2"),
        keras.layers.MaxPooling2D(name="pool2"),
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dropout(dropout, name="dropout"),
        keras.layers.Dense(num_classes, name="logits", dtype="float32"),
    ]


_FACTORIES = {"mlp": _mlp, "regression": _regression, "cnn": _cnn}
INPUT_SHAPES = {"mlp": (28, 28, 1), "regression": (1024,), "cnn": (28, 28, 1)}
"""Each built-in model's default per-example input shape."""


def model_task(name: str) -> str:
    """"classification" or "regression" for a built-in model name."""
    checks.one_of("model", name, MODEL_TASKS)
    return MODEL_TASKS[name]


def _scope(strategy):
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def build_model(
    name: str,
    *,
    strategy: tf.distribute.Strategy | None = None,
    input_shape=None,
    num_classes: int = 10,
    dropout: float = 0.2,
    seed: int | None = None,
) -> keras.Sequential:
    """Builds a model under `strategy.scope()`.

    The last layer is float32 under any mixed-precision policy, so the loss
    sees float32 logits.

    Models:
        * "mlp": Flatten, Dense(512, relu), Dropout, Dense(10).
        * "regression": Dense(1024), Dense(1024), Dense(1), for MSE.
        * "cnn": two conv + pool blocks and a dense head for 28x28 images.

    Args:
        name: one of "mlp", "regression", "cnn".
        strategy: the strategy to build under; None uses the current one.
        input_shape (tuple[int, ...] | None): per-example input shape; default (28, 28, 1) for
            images and (1024,) for "regression".
        num_classes: output logits (classifiers).
        dropout: dropout rate (0 disables it).
        seed: seeds the weight initializers (same seed, same weights) through
            `keras.utils.set_random_seed`, which also seeds Python's, NumPy's
            and TensorFlow's global generators.

    Raises:
        ValueError: an unknown name or a dropout rate outside [0, 1).
    """
    model_task(name)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"`dropout` must be in [0, 1), got {dropout}.")
    factory = _FACTORIES[name]
    input_shape = tuple(input_shape or INPUT_SHAPES[name])
    if seed is not None:
        keras.utils.set_random_seed(seed)
    with _scope(strategy):
        model = keras.Sequential(
            [keras.Input(shape=input_shape), *factory(input_shape, num_classes, dropout)],
            name=name,
        )
    return model


@keras.saving.register_keras_serializable(package="tfmulti")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from `initial` to `target` over `warmup_steps`, then constant
    (Goyal et al. 2017, "gradual warmup"; Horovod's LearningRateWarmupCallback)."""

    def __init__(self, initial: float, target: float, warmup_steps: int):
        self.initial = float(initial)
        self.target = float(target)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        frac = tf.minimum(step / max(self.warmup_steps, 1), 1.0)
        return self.initial + (self.target - self.initial) * frac

    def get_config(self):
        return {"initial": self.initial, "target": self.target, "warmup_steps": self.warmup_steps}


def scaled_learning_rate(
    learning_rate: float, global_batch_size: int, base_batch_size: int, lr_scaling: str
) -> float:
    """The learning rate for `global_batch_size`, given one tuned for `base_batch_size`.

    "linear" multiplies by global/base (Goyal et al. 2017), "sqrt" by its square
    root (for adaptive optimizers, Hoffer et al. 2017), "none" keeps it.
    """
    checks.one_of("lr_scaling", lr_scaling, LR_SCALINGS)
    checks.positive_int("base_batch_size", base_batch_size)
    ratio = global_batch_size / base_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[lr_scaling]
    return learning_rate * factor


def make_optimizer(optimizer="adam", learning_rate: float = 1e-3):
    """A Keras optimizer from its name: "adam" runs TensorFlow's fused update
    (`tfmulti.models.optimizers.fused_adam`), any other name is Keras' own
    (`keras.optimizers.get`), built with `learning_rate` (a float or a
    schedule).

    Raises:
        ValueError: a name Keras does not know.
    """
    name = str(optimizer).lower()
    checks.one_of("optimizer", name, OPTIMIZERS)
    if name == "adam":
        return optimizers.fused_adam(learning_rate)
    return keras.optimizers.get({"class_name": name, "config": {"learning_rate": learning_rate}})


def _adopt_optimizer(opt, strategy):
    """The user's optimizer object, re-made under `strategy` if it was made
    under another one (Keras keeps the strategy it was created under)."""
    if not isinstance(opt, keras.optimizers.Optimizer):
        raise ValueError(f"`optimizer` must be a Keras optimizer name or a "
                         f"keras.optimizers.Optimizer, got {type(opt).__name__}.")
    made_under = getattr(opt, "_distribution_strategy", None)
    if strategy is None or made_under is strategy:
        return opt
    if opt.built:
        raise ValueError(
            f"the {type(opt).__name__} optimizer was built under another strategy than the "
            f"model's; create it under `strategy.scope()` (or pass its name).")
    with strategy.scope():  # the same settings, under the model's strategy
        return opt.__class__.from_config(opt.get_config())


def trains_by_own_step(model) -> bool:
    """Whether `model` trains by a `train_step` of the user's (a VAE, a GAN),
    which computes its own loss: compiled without one, as its author does."""
    step = getattr(type(model), "train_step", None)
    module = getattr(step, "__module__", "") or ""
    return step is not None and not module.startswith(("keras.", "tfmulti."))


def _leaves(value) -> list:
    """The items of a per-output value (a dict's values, a list's items), or
    the value itself."""
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def _loss(loss, task, model, one_hot):
    if loss is None:
        if task is None and trains_by_own_step(model):
            return None
        if task is None:
            raise ValueError("pass `task` ('classification' or 'regression') for tfmulti's "
                             "default loss and metrics, or your own `loss`.")
        return default_loss(task, model, one_hot=one_hot)
    for item in _leaves(loss):
        if isinstance(item, str):
            try:
                keras.losses.get(item)
            except ValueError:
                raise ValueError(f"`loss` {item!r} is not a Keras loss name; use e.g. "
                                 "'sparse_categorical_crossentropy', 'mse', 'huber', or pass a "
                                 "loss object or function.") from None
    return dict(loss) if isinstance(loss, dict) else list(loss) if isinstance(
        loss, (list, tuple)) else loss


def _fresh(metric):
    """A metric object of its own for another output (a name stays a name)."""
    if isinstance(metric, keras.metrics.Metric):
        return type(metric).from_config(metric.get_config())
    return metric


def _metrics(metrics, task, model, one_hot, name: str = "metrics"):
    if metrics is None:
        # None, not []: Keras fails a train_step of the user's ("Cannot get
        # result() since the metric has not yet been built") when given [].
        return default_metrics(task, model, one_hot=one_hot) if task is not None else None
    if isinstance(metrics, str):
        raise ValueError(f"`{name}` must be a list, got the string {metrics!r}; e.g. "
                         f"[{metrics!r}].")
    for metric in _leaves(metrics):
        if isinstance(metric, str):
            try:
                keras.metrics.get(metric)
            except ValueError:
                if metric not in ("accuracy", "acc", "crossentropy", "ce"):
                    raise ValueError(f"`{name}` lists {metric!r}, which is not a Keras metric "
                                     "name; use e.g. 'accuracy', 'mae', 'auc'.") from None
    if isinstance(metrics, dict):
        return {key: list(value) if isinstance(value, (list, tuple)) else [value]
                for key, value in metrics.items()}
    if any(isinstance(m, (list, tuple)) for m in metrics):  # a list per output
        return [list(m) if isinstance(m, (list, tuple)) else [m] for m in metrics]
    found = output_heads(model)
    if len(found) > 1:  # one list for a model of several outputs: each output's
        return {head.key: [m if i == 0 else _fresh(m) for m in metrics]
                for i, head in enumerate(found)}
    return list(metrics)


def compile_model(
    model: keras.Model,
    *,
    task: str | None = None,
    strategy: tf.distribute.Strategy | None = None,
    optimizer="adam",
    learning_rate: float | None = None,
    loss=None,
    metrics=None,
    loss_weights=None,
    weighted_metrics=None,
    lr_scaling: str = "none",
    global_batch_size: int | None = None,
    base_batch_size: int = 256,
    warmup_epochs: float = 0.0,
    steps_per_epoch: int | None = None,
    steps_per_execution: int | str = "auto",
    accumulate_steps: int = 1,
    one_hot_labels: bool = False,
    **compile_kwargs,
) -> keras.Model:
    """Compiles `model` under `strategy.scope()`: the user's optimizer, loss and
    metrics (or tfmulti's defaults for `task`), with a scaled learning rate.

    Args:
        model: any Keras model (functional, Sequential, subclassed, a
            `PipelineModel`).
        task: "classification" or "regression": picks the loss and metrics
            left unset (`default_loss`, `default_metrics`); optional when
            `loss` is given. For a model with several outputs, also one per
            output (a dict by output name, or a list).
        strategy: the strategy the model was built under; None: the current one.
        optimizer (str | keras.optimizers.Optimizer): a Keras optimizer name ("adam", the default,
            runs TensorFlow's fused update, `tfmulti.models.optimizers.fuse`; "sgd", "rmsprop",
            "adamw", ...), or a `keras.optimizers.Optimizer` (kept, with its own learning rate;
            re-made under `strategy` if it was made under another one).
        learning_rate: the rate tuned for `base_batch_size`, for an optimizer
            given by name (default 1e-3); an optimizer object brings its own.
        loss (str | keras.losses.Loss | Callable | dict | list | None): a Keras loss name,
            object or function `loss(y_true, y_pred)`, or one per output (a dict by output name,
            or a list); default: `default_loss(task, model, one_hot=one_hot_labels)`, chosen
            from the layer that makes each output.
        metrics (Sequence[str | keras.metrics.Metric] | dict | None): Keras metric names or
            objects (for a model with several outputs: each output's), or a dict or list of
            them per output; default: `default_metrics(task, model, one_hot=one_hot_labels)`
            (none when `task` is not given).
        loss_weights (dict | list | None): for several outputs, each loss's weight in the
            total (by output name, or a list); default: 1 each.
        weighted_metrics (Sequence | dict | None): metrics weighted by the sample weights,
            in the form of `metrics`; default: none.
        lr_scaling: "none" (default), "linear" or "sqrt"; scales the rate by
            `global_batch_size / base_batch_size`.
        global_batch_size: needed unless `lr_scaling` is "none" (with
            gradient accumulation: the examples per update).
        base_batch_size: the batch `learning_rate` was tuned for (default 256).
        warmup_epochs: ramp the rate linearly up to the scaled rate over this
            many epochs (needs `steps_per_epoch`): from the tuned rate when
            the scaling raises it, else from scaled rate / warmup steps; 0
            disables it.
        steps_per_epoch: steps per epoch, for the warmup length and for
            `steps_per_execution="auto"` (e.g. `DistributedInput.steps_per_epoch`).
        steps_per_execution: training steps per `tf.function` call (works with
            2+ replicas, `tfmulti.runtime.keras_fixes`); "auto" (default): the largest
            divisor of `steps_per_epoch` up to 32, or 1 without `steps_per_epoch`
            (`tfmulti.config.train_config.resolve_steps_per_execution`).
        accumulate_steps: gradient accumulation: each step's batch (of
            accumulate_steps x B rows) runs as that many micro-batches of B
            rows one after the other, their gradients summed into one update
            (`tfmulti.models.accumulation.accumulate_gradients`; it works under every
            strategy, where Keras' own `gradient_accumulation_steps` fails
            with 2+ replicas). 1 (the default) updates at every step.
        one_hot_labels: the labels are one-hot rows (as many columns as the
            model's outputs): the default loss and accuracy are the
            categorical ones; False (the default): class ids. Per output
            (a dict or list) for a model with several.
        **compile_kwargs (Any): passed to `model.compile` (e.g. `jit_compile`).

    Returns:
        The model, compiled.

    Raises:
        ValueError: an unknown task, optimizer, loss, metric or scaling; neither
            `task` nor `loss` for a model without a `train_step` of its own (one
            with its own, a VAE or GAN, is compiled without a loss, as its
            author compiles it); a learning rate that is not a positive finite
            number, or one given with an optimizer object; scaling or warmup
            of an optimizer whose rate is a schedule; a missing batch size or
            steps for scaling/warmup; or `jit_compile=True` with 2 or more
            replicas (Keras 3 cannot).
    """
    if task is not None:
        checks.one_of("task", task, TASKS)
    named = isinstance(optimizer, str)
    if named:
        checks.one_of("optimizer", optimizer.lower(), OPTIMIZERS)
        learning_rate = DEFAULT_LEARNING_RATE if learning_rate is None else learning_rate
        checks.positive_number("learning_rate", learning_rate)
    elif learning_rate is not None:
        raise ValueError(f"`learning_rate` ({learning_rate}) applies to an optimizer given by "
                         f"name; set the rate on your {type(optimizer).__name__} instead.")
    if lr_scaling != "none" and global_batch_size is None:
        raise ValueError(f"`lr_scaling` ({lr_scaling!r}) needs `global_batch_size`.")
    checks.finite_number("warmup_epochs", warmup_epochs, minimum=0)
    if warmup_epochs > 0 and not steps_per_epoch:
        raise ValueError("`warmup_epochs` > 0 needs `steps_per_epoch` to size the warmup.")
    replicas = (strategy or tf.distribute.get_strategy()).num_replicas_in_sync
    if compile_kwargs.get("jit_compile") is True and replicas > 1:
        # Keras compiles the step around strategy.run, so XLA meets the other
        # replicas' variables on other devices: "Trying to access resource ...
        # located in device ... CPU:1 from device ... CPU:0".
        raise ValueError(
            f"`jit_compile=True` does not work with {replicas} replicas in Keras 3 "
            f"(keras-team/keras#17187, #19005: XLA cannot reach the other replicas' "
            f"variables); use one device or set jit_compile=False.")
    steps_per_execution = resolve_steps_per_execution(steps_per_execution, steps_per_epoch)
    with _scope(strategy):
        opt = None if named else _adopt_optimizer(optimizer, strategy)
        if named:
            tuned = learning_rate
        else:
            tuned = opt.learning_rate if not isinstance(
                opt._learning_rate, keras.optimizers.schedules.LearningRateSchedule) else None
            if tuned is None and (lr_scaling != "none" or warmup_epochs > 0):
                raise ValueError(
                    f"`lr_scaling`/`warmup_epochs` need a constant learning rate, but your "
                    f"{type(opt).__name__} has a schedule; leave them at their defaults, or "
                    f"give the optimizer a float rate.")
            tuned = None if tuned is None else float(keras.ops.convert_to_numpy(tuned))
        rate = tuned
        if tuned is not None:
            target = scaled_learning_rate(
                tuned, global_batch_size or base_batch_size, base_batch_size, lr_scaling)
            rate = target
            if warmup_epochs > 0:
                warmup_steps = max(1, round(warmup_epochs * steps_per_epoch))
                # From the tuned rate up to the scaled one (Goyal et al.); where
                # scaling does not raise the rate, from target / warmup steps up to it.
                start = tuned if target > tuned else target / warmup_steps
                rate = WarmupSchedule(start, target, warmup_steps)
        if named:
            opt = make_optimizer(optimizer, rate)
        elif rate is not None and rate != tuned or isinstance(rate, WarmupSchedule):
            opt.learning_rate = rate
        compile_kwargs["metrics"] = _metrics(compile_kwargs.get("metrics", metrics), task, model,
                                             one_hot_labels)
        if weighted_metrics is not None:
            compile_kwargs["weighted_metrics"] = _metrics(weighted_metrics, None, model, False,
                                                          "weighted_metrics")
        model.compile(optimizer=opt, loss=_loss(loss, task, model, one_hot_labels),
                      loss_weights=loss_weights, steps_per_execution=steps_per_execution,
                      **compile_kwargs)
    accumulation.accumulate_gradients(model, accumulate_steps)
    return model


_POLICIES = {"none": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}


@contextlib.contextmanager
def mixed_precision_policy(mixed_precision: str):
    """Sets Keras' global dtype policy for the models built inside the block
    ("none": float32, "bfloat16", "float16"), and restores the previous one.

    Variables stay float32; the builders keep the logits float32. Keras wraps
    the optimizer in a `LossScaleOptimizer` itself under float16.

    Raises:
        ValueError: an unknown name, or "float16" without a GPU (CPUs have no
            fast float16 kernels; bfloat16 instead).
    """
    checks.one_of("mixed_precision", mixed_precision, MIXED_PRECISION)
    if mixed_precision == "float16" and not tf.config.list_physical_devices("GPU"):
        raise ValueError("`mixed_precision` 'float16' needs a GPU and none was found; use "
                         "mixed_precision='bfloat16' on CPUs.")
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(_POLICIES[mixed_precision])
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)
