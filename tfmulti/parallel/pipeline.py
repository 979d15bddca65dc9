"""GPipe-style pipeline parallelism (and data x pipeline hybrid) for Keras 3
on TensorFlow, by manual device placement.

A stack of layers is cut into S contiguous stages, one per device. Every
stage's variables, optimizer slots, forward ops and backward ops live on that
stage's device. A training step splits each (per-replica) batch into M
micro-batches and runs the GPipe schedule (Huang et al. 2019): all forwards,
then all backwards, gradients summed over micro-batches and applied once, so
a step equals a full-batch step. Each stage's backward for each micro-batch
has a tape of its own (`tape.gradient(..., output_gradients=...)` on the
stage's device): inside the step's `tf.function`, TensorFlow then runs stage
s on micro-batch m+1 while stage s+1 works on micro-batch m, which a single
tape over the whole forward does not allow.

Hybrid: with `num_replicas=R`, R pipelines over R*S devices each take 1/R of
the global batch; each stage's gradients are averaged over the replicas and
every replica applies the same update, so the replicas stay identical.

XLA stays off (`jit_compile=False`): it would compile the placed graph as one
cluster and collapse the placement.

BatchNorm inside a stage normalises each micro-batch with that micro-batch's
statistics and updates its moving averages once per micro-batch, as GPipe
does; prefer micro-batches of at least 16-32 examples with BatchNorm. Remat
refuses BatchNorm (its recomputation would update the moving averages twice).

Regularization: each stage's weight penalties (`kernel_regularizer`, ...)
and activity losses are differentiated on the stage's own device and added
to the loss once per step, as for the unpartitioned model; with replicas the
weight penalty counts once (the replicas hold the same weights).

Micro-batch size and speed: each micro-batch runs every stage's kernels on
batch / (R*M) rows. On CPUs TensorFlow's matmul runs at about half its
rate below ~384 rows (BENCHMARKS.md, suite `pipeline`), so there pick M to
keep micro-batches at 384 rows or more. On other devices, measure: a
micro-batch too small for the device's kernels costs more than the bubble
it removes.

Example:
    >>> import keras, tfmulti
    >>> _ = tfmulti.configure_virtual_devices(2)
    >>> from tfmulti.parallel import PipelineModel
    >>> layers = [keras.layers.Dense(64, activation="relu") for _ in range(4)]
    >>> layers.append(keras.layers.Dense(10))
    >>> model = PipelineModel(layers, input_shape=(32,), devices=["CPU:0", "CPU:1"],
    ...                       num_microbatches=4)
    >>> model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
"""

from __future__ import annotations


import keras
import tensorflow as tf
from keras.src.trainers import data_adapters

from tfmulti import _checks, footprint
from tfmulti import devices as devices_lib
from tfmulti.parallel import partition as partition_lib

__all__ = ["PipelineModel", "check_remat"]

# Layers whose training-time call updates state (moving statistics): remat,
# which calls each stage twice per micro-batch, would update it twice.
_STATEFUL_LAYERS = (keras.layers.BatchNormalization,)
_RANDOM_LAYERS = (keras.layers.Dropout, keras.layers.GaussianNoise,
                  keras.layers.GaussianDropout, keras.layers.SpatialDropout1D,
                  keras.layers.SpatialDropout2D, keras.layers.SpatialDropout3D,
                  keras.layers.AlphaDropout)


def check_remat(layers) -> None:
    """Refuses rematerialization for layers whose recomputation would differ:
    random layers that draw (Dropout with a rate > 0, ...) would redraw their
    masks, stateful ones (BatchNorm) would update their statistics twice.

    Raises:
        ValueError: naming the layers.
    """
    random_layers = [l.name for l in layers if isinstance(l, _RANDOM_LAYERS)
                     and getattr(l, "rate", getattr(l, "stddev", 1)) != 0]
    if random_layers:
        raise ValueError(
            f"`remat=True` recomputes activations, which would redraw the random "
            f"masks of {random_layers}; remove them (or set their rate to 0, e.g. "
            f"dropout=0) or use remat=False.")
    stateful = [l.name for l in layers if isinstance(l, _STATEFUL_LAYERS)]
    if stateful:
        raise ValueError(
            f"`remat=True` recomputes activations, which would update the moving "
            f"statistics of {stateful} twice per micro-batch; use remat=False.")


def _layers_of(model_or_layers) -> list:
    if isinstance(model_or_layers, keras.Sequential):
        return list(model_or_layers.layers)
    if isinstance(model_or_layers, keras.Model):
        raise ValueError(
            f"model {model_or_layers.name!r} is not a stack of layers; pipeline stages "
            "need a keras.Sequential or a list of layers.")
    layers = list(model_or_layers)
    if not layers:
        raise ValueError("`layers` is empty; pass a keras.Sequential or a list of layers.")
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise ValueError(f"{layer!r} is not a keras layer; pass a keras.Sequential "
                             "or a list of layers.")
    return layers


def _check_stage_count(num_stages, num_layers: int, devices=None) -> None:
    if num_stages is None or num_stages <= num_layers:
        return
    if devices is None:
        raise ValueError(
            f"`num_stages` ({num_stages}) exceeds the number of layers ({num_layers}); "
            f"use at most {num_layers} stages.")
    raise ValueError(
        f"`devices` lists {len(devices)} devices, {num_stages} stages per replica, but the "
        f"model has {num_layers} layers; pass at most {num_layers} devices per replica.")


def _clone(layer):
    """A fresh, unbuilt layer with the same config (weights are copied after
    it is built on its device)."""
    return layer.__class__.from_config(layer.get_config())


def _split(tensor, num: int):
    """`num` slices along axis 0 of ceil(size / num) rows: equal when `num`
    divides the size (training checks that), else the last ones shorter or
    empty (inference, a partial last batch)."""
    if num == 1:
        return [tensor]
    step = (tf.shape(tensor)[0] + num - 1) // num
    return [tensor[i * step:(i + 1) * step] for i in range(num)]


def _penalty(stage, num_microbatches: int):
    """The stage's regularization for one micro-batch, or None: its activity
    losses from its latest call (each a mean over the micro-batch) and its
    weight penalties, all / M, so that the M micro-batches add up to the
    full batch's (read inside the tape that differentiates the stage)."""
    losses = stage.losses
    if not losses:
        return None
    return tf.add_n([tf.cast(tf.reduce_sum(l), tf.float32) for l in losses]) / num_microbatches


class PipelineModel(keras.Model):
    """A Keras model whose layers run as a pipeline over devices.

    Args:
        layers: a `keras.Sequential` or a list of layers (a stack: each layer
            feeds the next). Unbuilt layers are built in host memory before
            their copies are placed; for a model too big for one accelerator,
            build it under `tf.device("/CPU:0")` (or leave it unbuilt).
        input_shape: per-example input shape; needed unless `layers` is a
            built `keras.Sequential`.
        devices: R*S device names, replica-major (replica 0's stages first);
            default: the first R*S logical GPUs, else logical CPUs.
        num_stages: S; default: `len(devices) // num_replicas`, or 2.
        num_microbatches: M, micro-batches per replica batch (must divide it).
        partition: how to cut the stack: "params" (default), "flops", "time"
            (see `tfmulti.parallel.partition`), or explicit stage sizes.
        num_replicas: R data-parallel pipelines (hybrid); default 1.
        remat: recompute each stage's activations in the backward pass and
            keep only the stage inputs (less activation memory, ~1/3 more
            compute); refused for layers that draw random numbers (Dropout),
            whose recomputation would not match.
        name: model name.

    The model holds copies of the given layers, built on their stage devices
    with the same weights: after training, read the weights from the model
    (`model.get_weights()`, `model.to_sequential()`), not from the originals.

    Raises:
        ValueError: not a stack of layers, more stages than layers, missing or
            unknown devices, a device count that is not R*S, M < 1, remat with
            random layers, or unbuilt layers without `input_shape`.
    """

    def __init__(self, layers, *, input_shape=None, devices=None, num_stages=None,
                 num_microbatches: int = 1, partition="params", num_replicas: int = 1,
                 remat: bool = False, name: str = "pipeline", **kwargs):
        super().__init__(name=name, **kwargs)
        layers = _layers_of(layers)
        _checks.positive_int("num_replicas", num_replicas)
        _checks.positive_int("num_microbatches", num_microbatches)
        if input_shape is None:
            try:
                input_shape = tuple(layers[0].input.shape[1:])
            except (AttributeError, ValueError):
                raise ValueError("`input_shape` is required for layers that are not built "
                                 "(e.g. input_shape=(28, 28, 1)).") from None
        self._input_shape_arg = tuple(input_shape)
        _check_stage_count(num_stages, len(layers))  # before looking for devices
        device_names = self._choose_devices(devices, num_stages, num_replicas)
        num_stages = len(device_names) // num_replicas
        _check_stage_count(num_stages, len(layers), device_names)  # derived from `devices`
        if remat:
            check_remat(layers)
        self.num_stages = num_stages
        self.num_replicas = num_replicas
        self.num_microbatches = num_microbatches
        self.remat = remat
        self.stage_devices = [device_names[r * num_stages:(r + 1) * num_stages]
                              for r in range(num_replicas)]
        # Plan the cut on the given layers, then build a copy of each stage on
        # its device: Keras creates variables when a layer is built, under the
        # device scope active then. Unbuilt layers are built in host memory
        # (the model may not fit one accelerator, which is why it is split);
        # layers built before keep their variables where they are.
        with tf.device("/CPU:0"):
            _build_stack(layers, self._input_shape_arg)
        self.plan = partition_lib.plan_partition(
            layers, num_stages, method=partition, input_shape=self._input_shape_arg)
        self.replicas = []
        for r in range(num_replicas):
            stages, start, shape = [], 0, (None, *self._input_shape_arg)
            for s, size in enumerate(self.plan.sizes):
                originals = layers[start:start + size]
                with tf.device(self.stage_devices[r][s]):
                    stage = keras.Sequential([_clone(l) for l in originals],
                                             name=f"replica{r}_stage{s}")
                    stage.build(shape)
                    for copy, original in zip(stage.layers, originals):
                        copy.set_weights(original.get_weights())
                for layer in originals:
                    shape = layer.compute_output_shape(shape)
                stages.append(stage)
                start += size
            self.replicas.append(stages)
        self.build((None, *self._input_shape_arg))

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def _choose_devices(devices, num_stages, num_replicas) -> list[str]:
        if devices is None:
            available = devices_lib.logical_devices("GPU") or devices_lib.logical_devices("CPU")
            stages = num_stages or 2
            needed = stages * num_replicas
            if len(available) < needed:
                raise ValueError(
                    f"{stages} stages x {num_replicas} replica(s) need {needed} devices, "
                    f"found {len(available)}: {available}; create more with "
                    f"tfmulti.configure_virtual_devices({needed}) or pass `devices`.")
            return [devices_lib.canonical_device_name(d) for d in available[:needed]]
        names = devices_lib.resolve_devices(devices)
        if len(names) % num_replicas:
            raise ValueError(
                f"{len(names)} devices cannot form {num_replicas} replicas of equal "
                f"pipelines; pass num_stages x num_replicas devices.")
        if num_stages is not None and len(names) != num_stages * num_replicas:
            raise ValueError(
                f"`devices` lists {len(names)} devices but num_stages ({num_stages}) x "
                f"num_replicas ({num_replicas}) = {num_stages * num_replicas}.")
        return names

    # ------------------------------------------------------------------ compute

    def call(self, inputs, training=False):
        """Forward pass: the batch splits over replicas, then micro-batches,
        flowing stage to stage (placed); outputs are concatenated in order."""
        shards = _split(inputs, self.num_replicas)
        outputs = []
        for r, x in enumerate(shards):
            outputs.extend(self._forward(r, x, training))
        with tf.device(self.stage_devices[0][-1]):
            return tf.concat(outputs, axis=0) if len(outputs) > 1 else outputs[0]

    @property
    def losses(self):
        """Regularization as the unpartitioned model counts it (what
        `evaluate` adds to the loss): replica 0's weight penalties (the
        replicas hold the same weights) and the mean of the activity losses
        over the micro-batches of the latest call."""
        weights = [l for stage in self.replicas[0] for l in stage._get_regularization_losses()]
        activity = [l for stages in self.replicas for stage in stages
                    for layer in stage._flatten_layers() for l in layer._get_own_losses()]
        if activity:
            weights.append(tf.add_n([tf.reduce_sum(l) for l in activity])
                           / (self.num_replicas * self.num_microbatches))
        return weights

    def _forward(self, r, x, training):
        # Micro-batches of uneven size are allowed here (inference, evaluation
        # of a partial last batch).
        activations = _split(x, self.num_microbatches)
        for stage, device in zip(self.replicas[r], self.stage_devices[r]):
            with tf.device(device):
                activations = [stage(a, training=training) for a in activations]
        return activations

    def train_step(self, data):
        x, y, sample_weight = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(data)
        if sample_weight is not None:
            raise ValueError("PipelineModel does not support sample weights yet.")
        R, S, M = self.num_replicas, self.num_stages, self.num_microbatches
        batch = x.shape[0]
        if batch is not None and batch % (R * M):
            raise ValueError(
                f"the batch ({batch}) must split into {R} replica(s) x {M} micro-batches; "
                f"use a batch that is a multiple of {R * M} (drop the last partial batch).")
        if batch is None:
            tf.debugging.assert_equal(
                tf.shape(x)[0] % (R * M), 0,
                message=f"batch must be a multiple of num_replicas x num_microbatches = {R * M}")
        xs = _split(x, R * M)
        y_splits = [_split(t, R * M) for t in tf.nest.flatten(y)]
        y_parts = [tf.nest.pack_sequence_as(y, [parts[i] for parts in y_splits])
                   for i in range(R * M)]
        per_replica_grads, losses, predictions = [], [], []
        for r in range(R):
            grads, loss_r, preds = self._pipeline_step(
                r, xs[r * M:(r + 1) * M], y_parts[r * M:(r + 1) * M])
            per_replica_grads.append(grads)
            losses.append(loss_r)
            predictions.extend(preds)
        # Average each stage's gradients over the replicas; every replica
        # applies the same update.
        grads_and_vars = []
        for s in range(S):
            for i in range(len(per_replica_grads[0][s])):
                with tf.device(self.stage_devices[0][s]):
                    parts = [per_replica_grads[r][s][i] for r in range(R)]
                    mean = parts[0] if R == 1 else tf.add_n(parts) / R
                for r in range(R):
                    variable = self.replicas[r][s].trainable_variables[i]
                    with tf.device(self.stage_devices[r][s]):
                        grads_and_vars.append((tf.identity(mean), variable))
        self.optimizer.apply_gradients(grads_and_vars)
        with tf.device(self.stage_devices[0][-1]):
            loss = tf.add_n(losses) / R
            y_pred = tf.concat(predictions, axis=0)
        self._loss_tracker.update_state(loss, sample_weight=tf.shape(x)[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=None)

    def _pipeline_step(self, r, micro_x, micro_y):
        """GPipe on replica r: forward all micro-batches, then backward, with
        one tape per (stage, micro-batch). Returns (grads per stage, mean loss,
        predictions per micro-batch)."""
        stages, devices = self.replicas[r], self.stage_devices[r]
        S, M = self.num_stages, self.num_microbatches
        tapes = [[None] * M for _ in range(S)]
        inputs = [[None] * M for _ in range(S + 1)]
        inputs[0] = list(micro_x)
        # penalties[s][m]: stage s's regularization for micro-batch m (see
        # `_penalty`), part of the loss, differentiated on the stage's device.
        penalties = [[None] * M for _ in range(S)]
        losses, scaled, predictions = [None] * M, [None] * M, [None] * M
        for m in range(M):
            for s in range(S):
                with tf.device(devices[s]):
                    a = inputs[s][m]
                    if self.remat and s < S - 1:
                        inputs[s + 1][m] = tf.stop_gradient(stages[s](a, training=True))
                        continue
                    tape = tf.GradientTape()
                    with tape:
                        if s > 0:
                            tape.watch(a)
                        out = stages[s](a, training=True)
                        penalties[s][m] = _penalty(stages[s], M)
                        if s == S - 1:
                            loss = self._data_loss(micro_y[m], out)
                            losses[m] = loss
                            predictions[m] = out
                            target = loss / M
                            if penalties[s][m] is not None:
                                target += penalties[s][m]
                            scaled[m] = self.optimizer.scale_loss(target)
                    tapes[s][m] = tape
                    inputs[s + 1][m] = out
        grads = [[None] * len(stage.trainable_variables) for stage in stages]
        for m in range(M):
            upstream = None
            for s in reversed(range(S)):
                stage, device = stages[s], devices[s]
                variables = stage.trainable_variables
                with tf.device(device):
                    if tapes[s][m] is None:  # remat: recompute under a tape now
                        tape = tf.GradientTape()
                        with tape:
                            tape.watch(inputs[s][m])
                            out = stage(inputs[s][m], training=True)
                            penalties[s][m] = _penalty(stage, M)
                        target, out_grads = out, upstream
                    elif s == S - 1:
                        tape, target, out_grads = tapes[s][m], scaled[m], None
                    else:
                        tape, target, out_grads = tapes[s][m], inputs[s + 1][m], upstream
                    if s < S - 1 and penalties[s][m] is not None:
                        # d(scaled penalty) / d(penalty) = the loss scale (1
                        # without loss scaling).
                        target = [target, penalties[s][m]]
                        out_grads = [out_grads, self.optimizer.scale_loss(tf.ones([]))]
                    sources = list(variables) + ([inputs[s][m]] if s > 0 else [])
                    result = tape.gradient(target, sources, output_gradients=out_grads)
                    for i, g in enumerate(result[:len(variables)]):
                        if g is None:
                            g = tf.zeros_like(variables[i])
                        grads[s][i] = g if grads[s][i] is None else grads[s][i] + g
                    upstream = result[-1] if s > 0 else None
        with tf.device(devices[-1]):
            loss = tf.add_n(losses) / M
            regularization = [p for row in penalties for p in row if p is not None]
            if regularization:
                loss += tf.add_n(regularization)
        return grads, loss, predictions

    def _data_loss(self, y, y_pred):
        """The compiled loss alone: each stage adds its own regularization."""
        if self._compile_loss is None:
            raise ValueError("PipelineModel needs a loss: pass `loss=` to compile().")
        return self._compile_loss(y, y_pred, None)

    def compile(self, *args, jit_compile=False, **kwargs):
        if jit_compile not in (False, None):
            raise ValueError(
                "PipelineModel keeps XLA off (`jit_compile=False`): XLA would compile the "
                "placed stages as one cluster and collapse the device placement.")
        super().compile(*args, jit_compile=False, **kwargs)
        self._build_optimizer_on_stage_devices()

    def _build_optimizer_on_stage_devices(self) -> None:
        """Creates every optimizer slot on its variable's device. Keras builds
        optimizers lazily inside the traced train function, where it ignores
        placement; building here, eagerly and under each variable's device,
        keeps a stage's slots with its weights."""
        optimizer = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        if optimizer is None or optimizer.built:
            return
        create = optimizer.add_variable_from_reference

        def add_variable_from_reference(reference_variable, *args, **kwargs):
            with tf.device(reference_variable.value.device):
                return create(reference_variable, *args, **kwargs)

        optimizer.add_variable_from_reference = add_variable_from_reference
        try:
            self.optimizer.build(self.trainable_variables)
        finally:
            del optimizer.add_variable_from_reference  # back to the class method

    def to_sequential(self, name: str | None = None) -> keras.Sequential:
        """The unpartitioned model (replica 0's weights) on the default device,
        for saving as `.keras`, serving, or comparing with the pipeline."""
        layers = [_clone(l) for stage in self.replicas[0] for l in stage.layers]
        model = keras.Sequential([keras.Input(self._input_shape_arg), *layers],
                                 name=name or f"{self.name}_sequential")
        originals = [l for stage in self.replicas[0] for l in stage.layers]
        for copy, original in zip(model.layers, originals):
            copy.set_weights(original.get_weights())
        return model

    def checkpoint_layers(self) -> list[list[keras.layers.Layer]]:
        """The unpartitioned stack's layers, once per replica (replica 0 first):
        layer i of each holds the weights of `to_sequential().layers[i]`.
        `tfmulti.backup` keys a pipeline's variables by them, so that its
        backup restores into the unpartitioned model, and back."""
        return [[layer for stage in stages for layer in stage.layers] for stages in self.replicas]

    def memory_report(self, batch_size: int, optimizer: str | None = None) -> list[dict]:
        """Bytes per device, by the memory model `tfmulti estimate-memory` uses
        (`tfmulti.footprint.stack_footprint`): parameters, gradients,
        optimizer slots, and the activations kept for the backward pass, per
        micro-batch and at the step's peak (GPipe keeps all M micro-batches'
        until the backward pass starts; with remat only the stage inputs,
        plus one micro-batch's recomputed outputs).

        Args:
            batch_size: the global batch (split over replicas, then micro-batches).
            optimizer: the optimizer's name ("adam", "sgd") when the model is
                not compiled yet; a compiled model's built optimizer slots are
                measured instead.
        """
        micro = max(batch_size // (self.num_replicas * self.num_microbatches), 1)
        opt = getattr(self, "optimizer", None)
        measured = (footprint.slot_bytes_by_device(opt, devices_lib.canonical_device_name)
                    if opt is not None and opt.built else None)
        slots = footprint.OPTIMIZER_SLOTS.get(optimizer or "", 0)
        rows = []
        for r, stages in enumerate(self.replicas):
            shape, received = tuple(self._input_shape_arg), None
            for s, stage in enumerate(stages):
                device = devices_lib.canonical_device_name(self.stage_devices[r][s])
                rows.append({"device": device, "replica": r, "stage": s,
                             **footprint.stack_footprint(
                                 stage.layers, shape, micro_batch=micro,
                                 num_microbatches=self.num_microbatches,
                                 optimizer_slots=slots,
                                 slot_bytes=None if measured is None else measured.get(device, 0),
                                 receives_input=s > 0, input_dtype=received,
                                 remat=self.remat and s < self.num_stages - 1)})
                shape = tuple(stage.compute_output_shape((None, *shape))[1:])
                received = stage.layers[-1].compute_dtype
        return rows

    def placement(self) -> list[dict]:
        """Where every variable lives: a row per (replica, stage)."""
        rows = []
        for r, stages in enumerate(self.replicas):
            for s, stage in enumerate(stages):
                rows.append({
                    "replica": r, "stage": s, "device": self.stage_devices[r][s],
                    "layers": [l.name for l in stage.layers],
                    "variable_devices": sorted({v.value.device for v in stage.weights}),
                })
        return rows


def _build_stack(layers, input_shape) -> None:
    shape = (None, *input_shape)
    for layer in layers:
        if not layer.built:
            layer.build(shape)
        shape = layer.compute_output_shape(shape)
