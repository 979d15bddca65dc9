"""GPipe-style pipeline parallelism (and data x pipeline hybrid) for Keras 3
on TensorFlow, by manual device placement.

A stack of layers, or a functional model's chain of blocks (cut where a
single tensor crosses, residuals inside blocks; `tfmulti.parallel.chain`),
is cut into S contiguous stages, one per device; model inputs that later
blocks use (an attention mask, positions) reach every stage that uses them.
A model may have several outputs (a dict or list: a shared trunk and its
heads), which all leave the last stage: a head on an earlier layer ends the
cuts there, and more stages than the cuts before it allow are refused in one
line naming that output, when the stages are cut.
Every stage's variables, optimizer slots, forward ops and backward ops live
on that stage's device. The stages run the layer objects the caller passed:
unbuilt ones are built on their stage's device (`tfmulti.parallel.placement`),
built ones move there with their weights, so the caller's references see
the trained weights. A training step splits each (per-replica) batch into M
micro-batches and runs the GPipe schedule (Huang et al. 2019): all forwards,
then all backwards, gradients summed over micro-batches and applied once, so
a step equals a full-batch step. Each stage's backward for each micro-batch
has a tape of its own (`tape.gradient(..., output_gradients=...)` on the
stage's device): inside the step's `tf.function`, TensorFlow then runs stage
s on micro-batch m+1 while stage s+1 works on micro-batch m, which a single
tape over the whole forward does not allow. A graph runs an op once its
inputs are ready, whatever order the code wrote it in, so the backward's
order is made explicit by control dependencies: stage s's backward of
micro-batch m waits for its gradient from stage s+1 and for its own backward
of m - 1. Without them all M backwards of a stage ran at once, each with its
own parameter gradients and temporaries, and remat's recomputations ran with
the forwards, held as long as the activations they replace (measured, by the
allocator's peak above the steady state, 2 stages of 4 Dense(1024) at batch
4096: M=8 290 MiB, 300 MiB with remat; ordered, 188 and 142 MiB, against the
estimator's 176 and 120 MiB of activations and gradients).

The loss is the compiled one (`compile(loss=..., loss_weights=...)`, a
dict or list per output as Keras takes it), computed on the last stage for
each share of the batch (the rows one replica takes in one accumulation
round) on the outputs of its M micro-batches together, with the share's
sample weights and the outputs' Keras masks: Keras' loss of those rows, so
that the micro-batches change nothing, whatever the reduction, weighting or
mask. Its gradient with respect to each micro-batch's outputs starts that
micro-batch's backward. Metrics (`metrics`, `weighted_metrics`) see the
batch's outputs, labels and sample weights, as on one device.

Masks: the mask a layer takes (an `LSTM` after an
`Embedding(mask_zero=True)`) is part of the model's Keras graph, computed
from the token ids: a stage after the cut computes it again from them (a
side input), so the padded steps are skipped as in the whole model. The
mask the crossing tensor itself carries, which layers without a mask
argument (`Dense`) pass on to a sequence output, goes with it to the next
stage (also under remat); an output's mask reaches the loss and metrics.

Hybrid: with `num_replicas=R`, R pipelines over R*S devices each take 1/R of
the global batch; each stage's gradients are averaged over the replicas and
every replica applies the same update, so the replicas stay identical
(replica 0 holds the caller's layers, the others copies).

Shares (replicas, accumulation rounds) combine as Keras' data-parallel
replicas do: the step is the mean of their losses' steps. For Keras' default
reduction ("sum_over_batch_size"), with or without sample weights, that is
the whole batch's step (the weighted sum over the batch's rows divided by
its rows). A loss that divides by what a share holds is averaged per share,
as under `MirroredStrategy`: with a sequence output's mask (Keras divides by
the share's unmasked entries) or reduction "mean_with_sample_weight" (by the
share's sum of weights) the step is the batch's only where every share holds
as many; reduction "sum" gives the mean of the shares' sums (1/(R*k) of the
batch's sum). With R = k = 1 the step is the batch's in every case.

Gradient accumulation: with `accumulate_steps=k` a batch of k x B rows is k
sequential rounds of B rows (each a GPipe step's gradient), gradients of
loss_j / k summed and applied once: the step on the whole batch, with the
activation memory of a B-row step.

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

The bytes each device holds (parameters, gradients, optimizer slots,
activations) are counted by `tfmulti.memory.footprint.pipeline_footprint`,
from the public accessors here (`built_chain`, `stage_bounds`,
`stage_layers`).

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
from keras.src.backend import get_keras_mask, set_keras_mask
from keras.src.trainers import data_adapters

from tfmulti.utils import checks
from tfmulti.utils import human
from tfmulti.models import optimizers
from tfmulti.models import rebuild
from tfmulti.runtime import devices as devices_lib
from tfmulti.parallel import placement
from tfmulti.parallel import chain as blocks
from tfmulti.parallel import partition as partition_lib
from tfmulti.parallel.tensor_split import tensor_parallel_degree

__all__ = ["PipelineModel", "check_remat", "choose_devices"]

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
    masks, stateful ones (BatchNorm) would update their statistics twice;
    layers inside others count (a MultiHeadAttention's dropout).

    Raises:
        ValueError: naming the layers.
    """
    layers = [l for layer in layers for l in layer._flatten_layers()]
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


def choose_devices(devices, num_stages, num_replicas, tensor_parallel=1) -> list[str]:
    """The R*S*T devices of a pipeline (see `PipelineModel`'s `devices`).

    Args:
        devices: device names, or None: the first R*S*T logical GPUs, else
            logical CPUs (S = `num_stages`, or 2).
        num_stages: S, or None: as many as the devices give.
        num_replicas: R.
        tensor_parallel: T, the devices of each stage.

    Returns:
        The full device names.

    Raises:
        ValueError: too few devices, unknown devices, or a count that is
            not a multiple of R*T (or not R*S*T, S given).
    """
    T = tensor_parallel
    shards = f" x {T} tensor-parallel devices" if T > 1 else ""
    if devices is None:
        available = devices_lib.logical_devices("GPU") or devices_lib.logical_devices("CPU")
        stages = num_stages or 2
        needed = stages * num_replicas * T
        if len(available) < needed:
            raise ValueError(
                f"{stages} stages x {human.count(num_replicas, 'replica')}{shards} need {needed} "
                f"devices, found {len(available)}: {available}; create more with "
                f"tfmulti.configure_virtual_devices({needed}) or pass `devices`.")
        return [devices_lib.canonical_device_name(d) for d in available[:needed]]
    names = devices_lib.resolve_devices(devices)
    if len(names) % (num_replicas * T):
        raise ValueError(
            f"{len(names)} devices cannot form {num_replicas} replicas of equal "
            f"pipelines{shards and f' of {T}-device stages'}; pass num_stages x "
            f"num_replicas{shards and f' x {T}'} devices.")
    if num_stages is not None and len(names) != num_stages * num_replicas * T:
        raise ValueError(
            f"`devices` lists {len(names)} devices but num_stages ({num_stages}) x "
            f"num_replicas ({num_replicas}){shards} = {num_stages * num_replicas * T}.")
    return names


def _split(tensor, num: int):
    """`num` slices along axis 0 of ceil(size / num) rows: equal when `num`
    divides the size (training checks that), else the last ones shorter or
    empty (inference, a partial last batch)."""
    if num == 1:
        return [tensor]
    step = (tf.shape(tensor)[0] + num - 1) // num
    return [tensor[i * step:(i + 1) * step] for i in range(num)]


def _split_all(flat: list, num: int) -> list[list]:
    """`num` parts of a list of tensors: part i holds slice i of each."""
    parts = [_split(t, num) for t in flat]
    return [[p[i] for p in parts] for i in range(num)]


def _split_structure(value, num: int) -> list:
    """`num` parts of targets or sample weights (a tensor, a list or dict of
    them, or None), each part of the same structure."""
    if value is None:
        return [None] * num
    flat = tf.nest.flatten(value)
    return [tf.nest.pack_sequence_as(value, part) for part in _split_all(flat, num)]


_LOGITS = "_keras_logits"
"""The attribute by which Keras' TensorFlow `sigmoid` and `softmax` hand their
input to the cross-entropies (keras/src/backend/tensorflow/nn.py): a loss of
such an output is computed from these logits, not from the output."""


def _concat(parts: list):
    """Outputs of consecutive slices of a batch (each the model's output
    structure), joined along the batch axis, tensor by tensor; a Keras mask
    (a sequence output's) is joined too, so that the loss and metrics skip
    the masked steps of the whole batch."""
    if len(parts) == 1:
        return parts[0]

    def join(*tensors):
        joined = tf.concat(tensors, axis=0)
        masks = [get_keras_mask(t) for t in tensors]
        if all(m is not None for m in masks):
            set_keras_mask(joined, tf.concat(masks, axis=0))
        logits = [getattr(t, _LOGITS, None) for t in tensors]
        if all(v is not None for v in logits):  # a sigmoid's or softmax's: see `_differentiable`
            setattr(joined, _LOGITS, tf.concat(logits, axis=0))
        return joined

    return tf.nest.map_structure(join, *parts)


def _stop_gradient(tensor):
    """`tf.stop_gradient`, keeping the tensor's Keras mask for the next stage."""
    out = tf.stop_gradient(tensor)
    mask = get_keras_mask(tensor)
    if mask is not None:
        set_keras_mask(out, mask)
    return out


def _differentiable(structure) -> list:
    """The tensors of an output structure that its loss is computed from, in
    flat order: each floating-point output, or the logits a sigmoid or softmax
    output carries (the cross-entropies read those: the output itself is then
    not on the loss's path, and its gradient would be zero)."""
    return [getattr(t, _LOGITS, t) for t in tf.nest.flatten(structure) if t.dtype.is_floating]


def _penalty(stage, num_microbatches: int):
    """The stage's regularization for one micro-batch, or None: its activity
    losses from its latest call (each a mean over the micro-batch) and its
    weight penalties, all / M, so that the M micro-batches add up to the
    full batch's (read inside the tape that differentiates the stage)."""
    losses = stage.losses
    if not losses:
        return None
    return tf.add_n([tf.cast(tf.reduce_sum(l), tf.float32) for l in losses]) / num_microbatches


class _Source:
    """The model or layers the user gave, held outside Keras' tracking (the
    stages track the same layers)."""

    def __init__(self, model_or_layers):
        self.value = model_or_layers

    @property
    def model(self):
        return self.value if isinstance(self.value, keras.Model) else None


class PipelineModel(keras.Model):
    """A Keras model whose layers run as a pipeline over devices.

    Args:
        layers (keras.Model | Sequence[keras.layers.Layer]): a `keras.Sequential`, a list of layers
            (a stack: each layer feeds the next) or a functional model that is a chain of blocks:
            cut where a single tensor crosses, residuals inside blocks, any number of inputs (a dict
            or list: token ids, an attention mask, positions), one output or several (a dict or
            list, all computed on the last stage; see `tfmulti.parallel.chain`). Model inputs used
            by later blocks (side inputs) reach every stage that uses them.
        input_shape (tuple[int, ...] | None): a stack's per-example input shape; optional: without
            it, a stack of unbuilt layers is built from the first batch (as
            `keras.Sequential` is).
        devices (Sequence[str] | None): R*S*T device names, replica-major (replica 0's stages
            first), each stage's T devices together: stage s of replica r on
            devices[(r*S + s)*T : (r*S + s + 1)*T]; T is 1 unless the model
            has tensor-parallel layers (`tfmulti.parallel.tensor_layers`), which are
            split over T devices: each stage's then run on its T devices,
            everything else on the first. Default: the first R*S*T logical
            GPUs, else logical CPUs.
        num_stages (int | None): S; default: `len(devices) // num_replicas`, or 2.
        num_microbatches: M, micro-batches per replica batch (must divide it).
        partition (str | Sequence[int]): how to cut the stack (chain of blocks): "params"
            (default), "flops", "time" (see `tfmulti.parallel.partition`),
            or explicit stage sizes.
        num_replicas: R data-parallel pipelines (hybrid); default 1.
        remat: recompute each stage's activations in the backward pass and
            keep only the stage inputs (less activation memory, ~1/3 more
            compute); refused for layers that draw random numbers (Dropout),
            whose recomputation would not match.
        accumulate_steps: k; one optimizer update per batch of k x B rows,
            computed as k sequential rounds of B rows (each a GPipe step's
            gradient), gradients of loss_j / k summed, one apply: equal to
            the step on the whole batch with the memory of a B-row step. The
            batch must split into k x R x M parts. Default 1.
        name: model name.

    The pipeline trains the layer objects it is given (replica 0 of a
    hybrid; the other replicas hold copies kept equal): unbuilt layers are
    built on their stage's device, built ones move there with their weights,
    so the caller's references to the layers (and to the model it passed)
    see the trained weights (also through functions traced before the move).

    Raises:
        ValueError: a model that cannot be cut into S stages (the error names
            the layer whose branch crosses every cut, or the output computed
            before the cuts it prevents), more stages than layers, missing or
            unknown devices, a device count that is not
            R*S, M or k < 1, remat with random layers, or a hybrid (R > 1)
            of layers that cannot be rebuilt from their config (copied for
            replicas 1+; the error names the layer and the fix).
    """

    def __init__(self, layers, *, input_shape=None, devices=None, num_stages=None,
                 num_microbatches: int = 1, partition="params", num_replicas: int = 1,
                 remat: bool = False, accumulate_steps: int = 1, name: str = "pipeline",
                 **kwargs):
        super().__init__(name=name, **kwargs)
        checks.positive_int("num_replicas", num_replicas)
        checks.positive_int("num_microbatches", num_microbatches)
        checks.positive_int("accumulate_steps", accumulate_steps)
        functional = isinstance(layers, keras.Model) and not isinstance(layers, keras.Sequential)
        # What there is to cut into stages, for the stage-count check.
        if functional:
            cut, shape = {"chain": blocks.chain_of(layers)}, None
            tensor_parallel = tensor_parallel_degree(layers.layers)
        else:
            stack, stack_name, shape, _ = blocks.stack_of(layers)
            cut = {"num_layers": len(stack), "model": stack_name}
            tensor_parallel = tensor_parallel_degree(stack)
            if input_shape is not None:
                shape = partition_lib.per_example_shape(input_shape)
        if num_stages is not None:
            partition_lib.check_stage_count(num_stages, **cut)  # before looking for devices
        device_names = choose_devices(devices, num_stages, num_replicas, tensor_parallel)
        num_stages = len(device_names) // (num_replicas * tensor_parallel)
        # Derived from `devices`: the message names them.
        partition_lib.check_stage_count(num_stages, devices=device_names, **cut)
        self._source = _Source(layers)
        if functional:
            # What compile() keys losses, loss weights and metrics by (the
            # output layers' names), as for the given model.
            self.output_names = list(layers.output_names)
        self._partition = partition
        self.num_stages = num_stages
        self.num_replicas = num_replicas
        self.num_microbatches = num_microbatches
        self.accumulate_steps = accumulate_steps
        self.remat = remat
        # Stage s of replica r runs on a group of T devices (T = 1 without
        # tensor-parallel layers): their shards on the group, the rest on its
        # first device, the stage's device.
        self.tensor_parallel = tensor_parallel
        self.stage_groups = [[device_names[(r * num_stages + s) * tensor_parallel:
                                           (r * num_stages + s + 1) * tensor_parallel]
                              for s in range(num_stages)] for r in range(num_replicas)]
        self.stage_devices = [[group[0] for group in row] for row in self.stage_groups]
        self.plan = None
        self._chain = None
        self._bounds = ()
        self.replicas = []
        if functional or shape is not None:
            self.build(None if functional else (None, *shape))

    # ------------------------------------------------------------------ set-up

    def build(self, input_shape=None):
        """Cuts the model into stages and places them (a stack of unbuilt
        layers: from the first batch's shape, `(batch, *per_example)`)."""
        if self._chain is not None:
            return
        shape = None
        if self._source.model is None or isinstance(self._source.model, keras.Sequential):
            if input_shape is None or isinstance(input_shape, dict):
                raise ValueError("a stack of layers takes one input tensor; pass input_shape=.")
            shape = tuple(input_shape)[1:]
        # Keras may build a model from symbolic inputs (fit's first batch);
        # the variables are made for real, each on its stage's device.
        with placement.outside_symbolic_pass():
            with placement.deferred_variables() as deferred:
                chain = blocks.chain_of(self._source.value, input_shape=shape)
            try:
                self._place_stages(chain, deferred)
            finally:
                # Whatever failed, no layer is left without values: those not
                # placed on a stage get theirs in host memory.
                placement.place(deferred.remaining(), "/CPU:0", deferred)
            self._chain = chain
            if getattr(self, "optimizer", None) is not None:
                self._build_optimizer_on_stage_devices()

    def _place_stages(self, chain, deferred) -> None:
        if self.remat:
            check_remat(chain.layers)
        partition_lib.check_stage_count(self.num_stages, chain=chain)
        if self._partition == "time":  # timing runs the layers: they need values
            placement.place(deferred.remaining(), "/CPU:0", deferred)
        self.plan = partition_lib.plan_partition(chain, self.num_stages, method=self._partition)
        self._bounds = tuple((cut.start, cut.stop) for cut in self.plan.slices)
        self._side_keys = [chain.stage_side_keys(a, b) for a, b in self._bounds]
        self._takes_carry = [chain.blocks[a].entry is not None for a, _ in self._bounds]
        replicas = []
        for r in range(self.num_replicas):
            stages = []
            for s, (a, b) in enumerate(self._bounds):
                group, name = self.stage_groups[r][s], f"replica{r}_stage{s}"
                if r == 0:  # the given layer objects
                    stage = chain.stage_model(a, b, name=name)
                    for device, variables in placement.stage_placement(_own_layers(stage),
                                                                       group):
                        placement.place(variables, device, deferred)
                else:
                    stage = _copy_stage(replicas[0][s], group, name)
                stages.append(stage)
            replicas.append(stages)
        self.replicas.extend(replicas)

    # ------------------------------------------------------------------ compute

    def _flat_inputs(self, inputs) -> list:
        """The model inputs as a flat list in the order of the model's inputs."""
        struct, expected = self._chain.input_struct, len(self._chain.inputs)
        if isinstance(struct, dict):
            if not isinstance(inputs, dict):
                raise ValueError(
                    f"model {self._chain.name!r} takes a dict of inputs with keys "
                    f"{sorted(struct)}; received a {type(inputs).__name__}.")
            missing = sorted(set(struct) - set(inputs))
            if missing:
                raise ValueError(
                    f"inputs {missing} are missing; model {self._chain.name!r} takes "
                    f"{sorted(struct)}.")
            return keras.tree.flatten({k: inputs[k] for k in struct})
        if isinstance(inputs, dict):  # by the Inputs' names, as a functional model takes them
            names = [t.name for t in self._chain.inputs]
            missing = sorted(set(names) - set(inputs))
            if missing:
                raise ValueError(
                    f"inputs {missing} are missing; model {self._chain.name!r} takes "
                    f"{names}.")
            return [inputs[name] for name in names]
        flat = keras.tree.flatten(inputs)
        if len(flat) != expected:
            raise ValueError(
                f"model {self._chain.name!r} takes {human.count(expected, 'input')}; received "
                f"{len(flat)}.")
        return flat

    def _stage_args(self, s: int, carry, flat: list) -> list:
        """Stage s's inputs: the tensor from the previous stage, then its side inputs."""
        return ([carry] if self._takes_carry[s] else []) + [flat[k] for k in self._side_keys[s]]

    def call(self, inputs, training=False):
        """Forward pass: the batch splits over replicas, then micro-batches,
        flowing stage to stage (placed); returns the model's outputs (its
        structure: a tensor, a list or dict of them), each concatenated over
        the micro-batches and replicas in order, with its Keras mask."""
        shards = _split_all(self._flat_inputs(inputs), self.num_replicas)
        outputs = []
        for r, flat in enumerate(shards):
            outputs.extend(self._forward(r, flat, training))
        with tf.device(self.stage_devices[0][-1]):
            return _concat(outputs)

    @property
    def losses(self):
        """Regularization as the unpartitioned model counts it (what
        `evaluate` adds to the loss): replica 0's weight penalties (the
        replicas hold the same weights) and the mean of the activity losses
        over the micro-batches of the latest call."""
        if not self.replicas:
            return []
        weights = [l for stage in self.replicas[0] for l in stage._get_regularization_losses()]
        activity = [l for stages in self.replicas for stage in stages
                    for layer in stage._flatten_layers() for l in layer._get_own_losses()]
        if activity:
            weights.append(tf.add_n([tf.reduce_sum(l) for l in activity])
                           / (self.num_replicas * self.num_microbatches))
        return weights

    def _forward(self, r, flat, training):
        # Micro-batches of uneven size are allowed here (inference, evaluation
        # of a partial last batch).
        micro = _split_all(flat, self.num_microbatches)
        carries = [None] * self.num_microbatches
        for s, (stage, device) in enumerate(zip(self.replicas[r], self.stage_devices[r])):
            with tf.device(device):
                carries = [stage(self._stage_args(s, c, m), training=training)
                           for c, m in zip(carries, micro)]
        return carries

    def train_step(self, data):
        x, y, sample_weight = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(data)
        if self._chain is None:  # a stack's first batch (Keras builds in `call` only)
            self.build(tuple(keras.tree.flatten(x)[0].shape))
        R, S, M, K = (self.num_replicas, self.num_stages, self.num_microbatches,
                      self.accumulate_steps)
        flat = self._flat_inputs(x)
        parts = K * R * M
        batch = flat[0].shape[0]
        if batch is not None and batch % parts:
            rounds = f"{K} accumulation steps x " if K > 1 else ""
            raise ValueError(
                f"the batch ({batch}) must split into {rounds}{human.count(R, 'replica')} x {M} "
                f"micro-batches; use a batch that is a multiple of {parts} (drop the last "
                "partial batch).")
        if batch is None:
            tf.debugging.assert_equal(
                tf.shape(flat[0])[0] % parts, 0,
                message=f"batch must be a multiple of accumulate_steps x num_replicas x "
                        f"num_microbatches = {parts}")
        xs = _split_all(flat, parts)
        # A share: the rows one replica takes in one accumulation round (its M
        # micro-batches), whose loss Keras computes as for any batch.
        ys, weights = _split_structure(y, K * R), _split_structure(sample_weight, K * R)
        # sums[r][s][i]: replica r's gradient of stage s's variable i, summed
        # over the accumulation rounds (on that replica's stage device).
        sums = [None] * R
        losses, predictions, previous = [], [], []
        for j in range(K):
            # Rounds run one after the other: a round's activations are freed
            # before the next one's are made.
            with tf.control_dependencies(previous):
                round_grads = []
                for r in range(R):
                    share = j * R + r
                    grads, loss, y_pred = self._pipeline_step(
                        r, xs[share * M:(share + 1) * M], ys[share], weights[share])
                    round_grads.append(grads)
                    losses.append(loss)
                    predictions.append(y_pred)
            for r in range(R):
                if sums[r] is None:
                    sums[r] = round_grads[r]
                    continue
                for s in range(S):
                    sums[r][s] = [_sum_on(v, [a, g]) for v, a, g in zip(
                        self.replicas[r][s].trainable_variables, sums[r][s], round_grads[r][s])]
            previous = [g for grads in round_grads for row in grads for g in row]
        self.optimizer.apply_gradients(self._averaged(sums))
        self._equalize_replica_state()
        with tf.device(self.stage_devices[0][-1]):
            loss = tf.add_n(losses) / (R * K)
            y_pred = _concat(predictions)
        self._loss_tracker.update_state(loss, sample_weight=tf.shape(flat[0])[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _averaged(self, sums):
        """(gradient, variable) pairs: each stage's gradients averaged over
        the replicas and the accumulation rounds; every replica applies the
        same update."""
        R, K = self.num_replicas, self.accumulate_steps
        pairs = []
        for s in range(self.num_stages):
            for i in range(len(sums[0][s])):
                # On the variable's device: its stage's, or its shard's in a
                # tensor-parallel stage.
                with tf.device(self.replicas[0][s].trainable_variables[i].value.device):
                    mean = _scaled(_sum([sums[r][s][i] for r in range(R)]), 1 / (R * K))
                for r in range(R):
                    variable = self.replicas[r][s].trainable_variables[i]
                    with tf.device(variable.value.device):
                        pairs.append((_scaled(mean, 1), variable))
        return pairs

    def _equalize_replica_state(self) -> None:
        """Each stage's floating-point non-trainable weights (BatchNormalization's
        moving statistics), which every replica updates from its own share of
        the batch, set to their mean over the replicas after each step, as the
        mean aggregation keeps them under MirroredStrategy: the copies stay
        equal, so what the replicas evaluate is what `to_model()` (replica 0)
        saves."""
        if self.num_replicas == 1:
            return
        for s in range(self.num_stages):
            rows = [[w for w in self.replicas[r][s].non_trainable_weights
                     if w.dtype.startswith("float") or w.dtype.startswith("bfloat")]
                    for r in range(self.num_replicas)]
            for copies in zip(*rows):
                with tf.device(copies[0].value.device):
                    mean = tf.add_n([tf.identity(c.value) for c in copies]) / len(copies)
                for copy in copies:
                    with tf.device(copy.value.device):
                        copy.assign(tf.identity(mean))

    def _pipeline_step(self, r, micro_x, y, sample_weight):
        """GPipe on replica r for one share of the batch (M micro-batches):
        all forwards, one tape per (stage, micro-batch); the compiled loss of
        the share's outputs, concatenated (Keras' loss of those rows: sample
        weights, output masks and any reduction as for a batch of them); then
        every backward, each micro-batch's from its part of the loss's
        gradient. Returns (grads per stage, loss, the share's outputs)."""
        stages, devices = self.replicas[r], self.stage_devices[r]
        S, M = self.num_stages, self.num_microbatches
        tapes = [[None] * M for _ in range(S)]
        # carries[s][m]: what stage s receives for micro-batch m (none for s=0);
        # carries[S][m]: the model's outputs for micro-batch m.
        carries = [[None] * M for _ in range(S + 1)]
        # penalties[s][m]: stage s's regularization for micro-batch m (see
        # `_penalty`), part of the loss, differentiated on the stage's device.
        penalties = [[None] * M for _ in range(S)]
        for m in range(M):
            for s in range(S):
                with tf.device(devices[s]):
                    a = carries[s][m]
                    args = self._stage_args(s, a, micro_x[m])
                    if self.remat and s < S - 1:
                        carries[s + 1][m] = _stop_gradient(stages[s](args, training=True))
                        continue
                    tape = tf.GradientTape()
                    with tape:
                        if s > 0:
                            tape.watch(a)
                        out = stages[s](args, training=True)
                        penalties[s][m] = _penalty(stages[s], M)
                    tapes[s][m] = tape
                    carries[s + 1][m] = out
        # The loss of the share's rows, as the unpartitioned model computes it
        # on them: one loss over the M micro-batches' outputs, not a mean of
        # per-micro-batch losses (which differs where an output mask or a
        # sample weight's reduction counts the valid entries).
        outputs = [_differentiable(carries[S][m]) for m in range(M)]
        with tf.device(devices[-1]):
            loss_tape = tf.GradientTape()
            with loss_tape:
                loss_tape.watch([t for row in outputs for t in row])
                y_pred = _concat(carries[S])
                data_loss = self._data_loss(y, y_pred, sample_weight)
                scaled = self.optimizer.scale_loss(data_loss)
            output_grads = loss_tape.gradient(
                scaled, outputs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            # d(scaled penalty) / d(penalty): the loss scale (1 without loss scaling).
            penalty_scale = self.optimizer.scale_loss(tf.ones([]))
        grads = [[None] * len(stage.trainable_variables) for stage in stages]
        for m in range(M):
            upstream = None
            for s in reversed(range(S)):
                stage, device = stages[s], devices[s]
                variables = stage.trainable_variables
                # The order the schedule says, made explicit: a graph runs an op as soon as
                # its inputs are ready, not in the order it was written, so without these
                # a recomputation (remat) would run with the forwards and be held as the
                # activations it replaces, and the micro-batches' backwards of a stage
                # would all run at once, each with its temporaries. So a stage's backward
                # of micro-batch m starts once its gradient from the stage after has come
                # (remat: its recomputation too) and its backward of m - 1 is done.
                after = [t for t in (upstream, *grads[s]) if t is not None]
                with tf.device(device), tf.control_dependencies(after):
                    if tapes[s][m] is None:  # remat: recompute under a tape now
                        tape = tf.GradientTape()
                        with tape:
                            if s > 0:
                                tape.watch(carries[s][m])
                            out = stage(self._stage_args(s, carries[s][m], micro_x[m]),
                                        training=True)
                            penalties[s][m] = _penalty(stage, M)
                        targets, out_grads = [out], [upstream]
                    elif s == S - 1:
                        tape, targets, out_grads = tapes[s][m], outputs[m], output_grads[m]
                    else:
                        tape, targets, out_grads = tapes[s][m], [carries[s + 1][m]], [upstream]
                    if penalties[s][m] is not None:
                        targets = [*targets, penalties[s][m]]
                        out_grads = [*out_grads, penalty_scale]
                    sources = list(variables) + ([carries[s][m]] if s > 0 else [])
                    result = tape.gradient(targets, sources, output_gradients=out_grads)
                    for i, g in enumerate(result[:len(variables)]):
                        if g is None:
                            g = tf.zeros_like(variables[i])
                        grads[s][i] = g if grads[s][i] is None else _sum_on(variables[i],
                                                                            [grads[s][i], g])
                    upstream = result[-1] if s > 0 else None
        with tf.device(devices[-1]):
            loss = data_loss
            regularization = [p for row in penalties for p in row if p is not None]
            if regularization:
                loss += tf.add_n(regularization)
        return grads, loss, y_pred

    def _data_loss(self, y, y_pred, sample_weight=None):
        """The compiled loss alone: each stage adds its own regularization."""
        if self._compile_loss is None:
            raise ValueError("PipelineModel needs a loss: pass `loss=` to compile().")
        return self._compile_loss(y, y_pred, sample_weight)

    def accumulate_gradients(self, steps: int) -> "PipelineModel":
        """Sets `accumulate_steps` (`tfmulti.models.accumulation.accumulate_gradients`
        and `compile_model(accumulate_steps=...)` call this): one update per
        batch of `steps` x B rows, `steps` GPipe rounds in turn."""
        checks.positive_int("accumulate_steps", steps)
        self.accumulate_steps = steps
        self.train_function = None  # made again, with the new step, by the next fit
        return self

    def compile(self, *args, jit_compile=False, **kwargs):
        if jit_compile not in (False, None):
            raise ValueError(
                "PipelineModel keeps XLA off (`jit_compile=False`): XLA would compile the "
                "placed stages as one cluster and collapse the device placement.")
        super().compile(*args, jit_compile=False, **kwargs)
        if self._chain is not None:  # else: when the first batch builds the stages
            self._build_optimizer_on_stage_devices()

    def _build_optimizer_on_stage_devices(self) -> None:
        """Creates every optimizer slot on its variable's device (Keras would
        build them inside the traced train function, on the default device)."""
        optimizers.build_on_variable_devices(self.optimizer, self.trainable_variables)

    def built_chain(self, what: str = "this") -> blocks.Chain:
        """The chain of blocks the stages were cut from (`tfmulti.parallel.chain`).

        Args:
            what: the caller, named in the error.

        Raises:
            RuntimeError: the stages are not built yet.
        """
        if self._chain is None:
            raise RuntimeError(
                f"{what} needs the stages, which are built from the first batch; call the "
                "model (or fit) once, or pass input_shape=.")
        return self._chain

    def to_sequential(self, name: str | None = None) -> keras.Sequential:
        """The unpartitioned stack, for saving as `.keras`, serving, or
        comparing with the pipeline; a functional model's is `to_model()`.

        The pipeline trains the layer objects it was given, so this is no
        copy: the `keras.Sequential` given (when it has its `keras.Input`),
        else a `keras.Sequential` of the same layer objects after a
        `keras.Input` of the stack's input shape and dtype. Nothing is
        rebuilt from a config (users' layers without `**kwargs` or
        `get_config` work); the weights are replica 0's, where the pipeline
        placed them (on the stage devices).

        Args:
            name: the model's name; default: the given Sequential's, else
                "<pipeline name>_sequential". A name other than the given
                Sequential's makes a new Sequential of the same layers.

        Raises:
            ValueError: the pipeline was made from a functional model.
        """
        chain = self.built_chain("to_sequential()")
        if chain.stack is None:
            raise ValueError(
                f"model {chain.name!r} is a functional model, not a stack; use to_model().")
        source = self._source.model
        if source is not None and name in (None, source.name) and _has_input(source):
            return source
        default = source.name if source is not None else f"{self.name}_sequential"
        return keras.Sequential([keras.Input(tuple(chain.inputs[0].shape[1:]),
                                             dtype=chain.inputs[0].dtype), *chain.stack],
                                name=name or default)

    def to_model(self, name: str | None = None) -> keras.Model:
        """The unpartitioned model, for saving as `.keras`, serving, or
        comparing: the functional model given itself (its layer objects are
        what the pipeline trains; replica 0's weights, on the stage
        devices); `to_sequential()` for a stack. Nothing is rebuilt from a
        config, so users' layers without `**kwargs` or `get_config` work.

        Args:
            name: the model's name; default: the given model's. Another
                name makes a new functional model over the same layers and
                graph (no copy).
        """
        chain = self.built_chain("to_model()")
        if chain.stack is not None:
            return self.to_sequential(name=name)
        source = self._source.model
        if name in (None, source.name):
            return source
        return keras.Model(source._inputs_struct, source._outputs_struct, name=name)

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Saves the unpartitioned model, `to_model()` (the user's own, with
        its trained weights, and its own optimizer's state where it has one:
        `give_optimizer_state`), as `keras.Model.save` would save it: a file
        anyone loads without tfmulti (Keras' `ModelCheckpoint` calls this)."""
        model = self.to_model()
        self.give_optimizer_state(model)
        return model.save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    def give_optimizer_state(self, model) -> None:
        """Gives `model` (`to_model()`), compiled with an optimizer of its own
        (its author's compile), this pipeline's optimizer state for its
        variables: the pipeline's optimizer holds its stages' variables (a
        hybrid's replica copies too) in the stages' order, and Keras loads a
        saved optimizer's variables by position, in the model's own order.
        Each of the model's optimizer variables takes the value of the
        pipeline's of the same name (Keras names a slot after its variable's
        path: replica 0's are the model's own), so that the saved model
        resumes training as trained. Nothing for a model without an
        optimizer of its own."""
        own, trained = getattr(model, "optimizer", None), getattr(self, "optimizer", None)
        if own is None or trained is None or own is trained:
            return
        if not own.built:
            own.build(model.trainable_variables)
        by_name = {v.name: v for v in trained.variables}
        for variable in own.variables:
            source = by_name.get(variable.name)
            if source is not None and tuple(source.shape) == tuple(variable.shape):
                variable.assign(source.value)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Saves the unpartitioned model's weights (`to_model().save_weights`):
        they load into the model the user builds (`ModelCheckpoint(...,
        save_weights_only=True)` calls this)."""
        return self.to_model().save_weights(filepath, overwrite=overwrite, **kwargs)

    def checkpoint_layers(self) -> list[list[keras.layers.Layer]]:
        """The unpartitioned model's layers that the stages hold, in its own
        order (`to_model().layers`), once per replica (replica 0, the layer
        objects given, first). `tfmulti.training.backup` keys a pipeline's variables
        by them, so that its backup restores into the unpartitioned model,
        and back."""
        self.built_chain("checkpoint_layers()")
        held = {id(layer): (s, j) for s, stage in enumerate(self.replicas[0])
                for j, layer in enumerate(stage.layers)}
        source = self._source.model
        order = [layer for layer in (source.layers if source is not None else self._source.value)
                 if id(layer) in held]
        return [[stages[held[id(layer)][0]].layers[held[id(layer)][1]] for layer in order]
                for stages in self.replicas]

    @property
    def given(self):
        """The model or list of layers the pipeline was made from: the objects
        replica 0 trains (what `to_model()` returns, a stack as a Sequential)."""
        return self._source.value

    @property
    def stage_bounds(self) -> tuple[tuple[int, int], ...]:
        """Each stage's blocks, as (start, stop) into `built_chain().blocks`
        (a stack's: into its layers); empty until the stages are built."""
        return tuple(self._bounds)

    def stage_layers(self, replica: int, stage: int) -> list:
        """The layers stage `stage` of replica `replica` holds (replica 0:
        the layer objects given; the others, copies), without the inputs of
        its sub-model."""
        return _own_layers(self.replicas[replica][stage])

    def placement(self) -> list[dict]:
        """Where every variable lives: a row per (replica, stage)."""
        rows = []
        for r, stages in enumerate(self.replicas):
            for s, stage in enumerate(stages):
                rows.append({
                    "replica": r, "stage": s, "device": self.stage_devices[r][s],
                    "layers": [l.name for l in self.stage_layers(r, s)],
                    "variable_devices": sorted({v.value.device for v in stage.weights}),
                })
        return rows


def _has_input(model: keras.Sequential) -> bool:
    """Whether a Sequential was built from a `keras.Input` (it then has inputs)."""
    try:
        return bool(model.inputs)
    except (AttributeError, ValueError):
        return False


def _own_layers(stage) -> list:
    """A stage's layers, without the inputs of its sub-model."""
    return [l for l in stage.layers if not isinstance(l, keras.layers.InputLayer)]


def _sum(gradients: list):
    """The sum of gradients; those of a gather (an Embedding's
    IndexedSlices) stay sparse: their rows are concatenated."""
    if len(gradients) == 1:
        return gradients[0]
    if all(isinstance(g, tf.IndexedSlices) for g in gradients):
        return tf.IndexedSlices(tf.concat([g.values for g in gradients], 0),
                                tf.concat([g.indices for g in gradients], 0),
                                gradients[0].dense_shape)
    return tf.add_n([tf.convert_to_tensor(g) for g in gradients])


def _sum_on(variable, gradients: list):
    """`_sum(gradients)` on the variable's device (its stage's, or its
    shard's in a tensor-parallel stage)."""
    with tf.device(variable.value.device):
        return _sum(gradients)


def _scaled(gradient, factor: float):
    """gradient x factor, made on the current device (a copy when factor is 1)."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(_scaled(gradient.values, factor), tf.identity(gradient.indices),
                                gradient.dense_shape)
    return tf.identity(gradient) if factor == 1 else gradient * factor


def _copy_stage(source, group, name: str) -> keras.Model:
    """A copy of a stage (new layers, same architecture and weights) with
    its variables made on its device group (`placement.stage_placement`)."""
    with placement.deferred_variables() as deferred:
        try:
            clone = keras.models.clone_model(source)
        except Exception as e:  # pylint: disable=broad-except  (a layer's from_config)
            problem = rebuild.rebuild_problem(_own_layers(source))
            if problem is None:
                raise
            raise ValueError(
                f"the hybrid's replicas 1+ are copies of replica 0's stages, each layer "
                f"rebuilt from its config, and {problem}; in its class, {rebuild.FIX}, or "
                "train one replica (distribution 'pipeline', num_replicas=1), which trains "
                "your own layer objects.") from e
    values = {id(c): w.value for c, w in zip(clone.weights, source.weights)}
    own = placement.self_placed(clone)
    for copy in clone.weights:
        if id(copy) in own:
            copy.assign(values[id(copy)])
    for device, variables in placement.stage_placement(_own_layers(clone), group):
        placement.place(variables, device, deferred, values=[values.get(id(v)) for v in variables])
    placement.place(deferred.remaining(), group[0], deferred)  # random seeds' state
    return blocks.StageModel(clone._inputs_struct, clone._outputs_struct, name=name)
