"""Pipeline and hybrid model parallelism: equivalence with the unpartitioned
model, placement, BatchNorm/Dropout behaviour, remat, memory view, errors.
That the memory view equals `estimate-memory`'s is tests/unit/test_footprint.py."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.memory.footprint import format_footprint, pipeline_footprint
from tfmulti.parallel import PipelineModel

LR = 0.1
BATCH = 32


def _layers(batchnorm=False, dropout=0.0):
    layers = [keras.layers.Dense(24, activation="relu"), keras.layers.Dense(24, activation="tanh")]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization())
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers += [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)]
    return layers


def _data(seed=0, n=BATCH * 3):
    rng = np.random.default_rng(seed)
    return rng.random((n, 12), dtype=np.float32), rng.integers(0, 10, n)


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _copy(model):
    """The same model (architecture and weights), with layers of its own."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy


def _pair(num_stages, num_microbatches, num_replicas=1, remat=False, **layer_kwargs):
    """A pipeline and the same model unpartitioned, with equal weights."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)), *_layers(**layer_kwargs)])
    reference = _copy(model)
    pipeline = PipelineModel(model, num_stages=num_stages,
                             num_microbatches=num_microbatches, num_replicas=num_replicas,
                             remat=remat)
    reference.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
    pipeline.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
    return pipeline, reference


def _full_batch_gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = _loss()(y, model(x, training=True))
    return loss, tape.gradient(loss, model.trainable_variables)


_REFERENCE_RUNS = {}
"""The unpartitioned model's results, by what was trained: every pipeline
configuration compared with the same training (the same seeded model, data and
steps) compares with the one result, trained once per process."""


def _reference_run(key, train):
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = train()
    return _REFERENCE_RUNS[key]


def _reference_steps(reference, x, y):
    """`reference` (_pair's: seed 0, SGD(LR)): the loss and gradients of the
    first batch, then one train_on_batch per batch of x: each step's loss and
    the weights after it."""
    loss, grads = _full_batch_gradients(reference, x[:BATCH], y[:BATCH])
    losses, weights = [], []
    for i in range(len(x) // BATCH):
        batch = slice(i * BATCH, (i + 1) * BATCH)
        losses.append(reference.train_on_batch(x[batch], y[batch]))
        weights.append(reference.get_weights())
    return float(loss), [g.numpy() for g in grads], losses, weights


@pytest.mark.parametrize("stages,micro,replicas", [
    (2, 1, 1), (2, 2, 1), (2, 4, 1), (2, 8, 1), (4, 1, 1), (4, 2, 1), (4, 4, 1), (4, 8, 1),
    (2, 4, 2),
])
@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_gradients_and_three_steps_match_unpartitioned(stages, micro, replicas):
    pipeline, reference = _pair(stages, micro, replicas)
    x, y = _data()
    # The unpartitioned model's gradients and 3 steps: the same for every case.
    loss, grads, ref_losses, ref_weights = _reference_run(
        "steps", lambda: _reference_steps(reference, x, y))
    # Gradients of one step: weight change / learning rate.
    before = [w.copy() for w in pipeline.to_sequential().get_weights()]
    step_loss = pipeline.train_on_batch(x[:BATCH], y[:BATCH])
    after = pipeline.to_sequential().get_weights()
    np.testing.assert_allclose(step_loss, loss, atol=1e-5)
    for b, a, g in zip(before, after, grads):
        np.testing.assert_allclose((b - a) / LR, g, atol=1e-5)
    # Two more SGD steps on both: equal weights.
    for i in (1, 2):
        batch = slice(i * BATCH, (i + 1) * BATCH)
        l_p = pipeline.train_on_batch(x[batch], y[batch])
        np.testing.assert_allclose(l_p, ref_losses[i], atol=1e-5)
    for a, b in zip(pipeline.to_sequential().get_weights(), ref_weights[2]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    if replicas > 1:  # replicas stay identical
        for s in range(stages):
            for w0, w1 in zip(pipeline.replicas[0][s].get_weights(),
                              pipeline.replicas[1][s].get_weights()):
                np.testing.assert_array_equal(w0, w1)


def test_remat_gives_the_same_step():
    pipeline, reference = _pair(2, 4, remat=True)
    x, y = _data()
    _, _, ref_losses, ref_weights = _reference_run(
        "steps", lambda: _reference_steps(reference, x, y))  # the reference's steps
    for i in range(2):
        batch = slice(i * BATCH, (i + 1) * BATCH)
        np.testing.assert_allclose(pipeline.train_on_batch(x[batch], y[batch]),
                                   ref_losses[i], atol=1e-5)
    for a, b in zip(pipeline.to_sequential().get_weights(), ref_weights[1]):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow  # trains for seconds: not in make test-fast
@pytest.mark.parametrize("replicas,micro,remat", [(1, 2, False), (2, 2, False), (1, 4, True)])
def test_regularization_counts_as_in_the_unpartitioned_model(replicas, micro, remat):
    # Weight penalties on every stage (not only the last one) and an activity
    # regularizer: the same losses and weights as the unpartitioned model, the
    # weight penalty counted once however many replicas hold the weights.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((12,)),
        keras.layers.Dense(16, kernel_regularizer=keras.regularizers.L2(0.5),
                           activity_regularizer=keras.regularizers.L1(0.1)),
        keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L1(0.2)),
        keras.layers.Dense(10, kernel_regularizer=keras.regularizers.L2(0.3))])
    reference = _copy(model)
    pipeline = PipelineModel(model, num_stages=2, num_microbatches=micro,
                             num_replicas=replicas, remat=remat)
    for model in (reference, pipeline):
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
    x, y = _data(n=BATCH * 2)
    h_p = pipeline.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    def train_reference():  # the same for every case: trained once
        h_r = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return (h_r.history["loss"], reference.get_weights(),
                reference.evaluate(x, y, batch_size=BATCH, verbose=0))

    ref_loss, ref_weights, ref_evaluated = _reference_run("regularization", train_reference)
    np.testing.assert_allclose(h_p.history["loss"], ref_loss, rtol=1e-5)
    for a, b in zip(pipeline.to_sequential().get_weights(), ref_weights):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert pipeline.evaluate(x, y, batch_size=BATCH, verbose=0) == pytest.approx(
        ref_evaluated, rel=1e-5)


def test_hybrid_evaluates_and_predicts_a_partial_last_batch():
    pipeline, reference = _pair(2, 2, num_replicas=2)
    xe, ye = _data(seed=1, n=BATCH + 9)  # last batch: 9 rows over 2 replicas x 2 micro-batches
    np.testing.assert_allclose(pipeline.predict(xe, batch_size=BATCH, verbose=0),
                               reference.predict(xe, batch_size=BATCH, verbose=0), atol=1e-5)
    assert pipeline.evaluate(xe, ye, batch_size=BATCH, verbose=0) == pytest.approx(
        reference.evaluate(xe, ye, batch_size=BATCH, verbose=0), abs=1e-5)


def test_hybrid_keeps_the_replicas_batch_normalization_statistics_equal():
    # Each replica updates its BatchNormalization's moving statistics from
    # its own half of the batch (here the halves differ: the second shifted
    # by 3); after every step they are set to their mean, so what the
    # replicas evaluate is what to_model() (replica 0) saves.
    pipeline, _ = _pair(2, 2, num_replicas=2, batchnorm=True)
    x, y = _data(n=BATCH * 2)
    x[np.arange(len(x)) % BATCH >= BATCH // 2] += 3.0  # replica 1's half of every batch
    pipeline.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    norm = [i for i, layer in enumerate(pipeline.stage_layers(0, 1))
            if isinstance(layer, keras.layers.BatchNormalization)]
    copies = [pipeline.stage_layers(r, 1)[norm[0]] for r in range(2)]
    for a, b in zip(copies[0].non_trainable_weights, copies[1].non_trainable_weights):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6)
    saved = pipeline.to_model()
    saved.compile(loss=_loss())
    assert pipeline.evaluate(x, y, batch_size=BATCH, verbose=0) == pytest.approx(
        saved.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-5)


def test_a_list_of_named_inputs_takes_a_dict_by_the_inputs_names():
    # As keras.Model(list_of_inputs, ...) takes a dict (keras-io's structured
    # data example): by name, whatever the dict's order (sorted, "a" < "b",
    # is not the model's).
    keras.utils.set_random_seed(0)
    b = keras.Input((3,), name="b")
    a = keras.Input((1,), name="a", dtype="int32")
    x = keras.layers.Concatenate()([b, keras.ops.cast(a, "float32")])
    x = keras.layers.Dense(8, activation="relu")(x)
    model = keras.Model([b, a], keras.layers.Dense(2)(keras.layers.Dense(4)(x)))
    rng = np.random.default_rng(0)
    inputs = {"a": rng.integers(0, 5, (8, 1)).astype("int32"),
              "b": rng.random((8, 3), dtype=np.float32)}
    expected = model(inputs)
    pipeline = PipelineModel(model, num_stages=2)
    np.testing.assert_allclose(pipeline(inputs), expected, atol=1e-6)
    with pytest.raises(ValueError, match=r"inputs \['a'\] are missing"):
        pipeline({"b": inputs["b"]})


def test_model_checkpoint_saves_the_users_model(tmp_path):
    # Keras' ModelCheckpoint (keras-io's time-series example passes one)
    # saves the unpartitioned model: a .keras file and weights that load
    # without tfmulti (was: NotImplementedError from PipelineModel.get_config).
    pipeline, _ = _pair(2, 2)
    x, y = _data()
    whole, weights = tmp_path / "best.keras", tmp_path / "best.weights.h5"
    pipeline.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(str(whole)),
        keras.callbacks.ModelCheckpoint(str(weights), save_weights_only=True)])
    expected = pipeline.predict(x, batch_size=BATCH, verbose=0)
    loaded = keras.models.load_model(whole)
    np.testing.assert_allclose(loaded.predict(x, batch_size=BATCH, verbose=0), expected,
                               atol=1e-5)
    rebuilt = keras.Sequential([keras.Input((12,)), *_layers()])
    rebuilt.load_weights(weights)
    np.testing.assert_allclose(rebuilt.predict(x, batch_size=BATCH, verbose=0), expected,
                               atol=1e-5)


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_fit_evaluate_predict_like_any_keras_model():
    pipeline, reference = _pair(2, 4)
    x, y = _data()
    pipeline.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss(), metrics=["accuracy"])
    reference.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss(), metrics=["accuracy"])
    h_p = pipeline.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h_r = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(h_p.history["loss"], h_r.history["loss"], atol=1e-5)
    np.testing.assert_allclose(h_p.history["accuracy"], h_r.history["accuracy"])
    # Evaluation and prediction accept a partial last batch (100 % 32 != 0).
    xe, ye = _data(seed=1, n=100)
    e_p = pipeline.evaluate(xe, ye, batch_size=BATCH, verbose=0, return_dict=True)
    e_r = reference.evaluate(xe, ye, batch_size=BATCH, verbose=0, return_dict=True)
    assert e_p["loss"] == pytest.approx(e_r["loss"], abs=1e-5)
    np.testing.assert_allclose(pipeline.predict(xe, batch_size=BATCH, verbose=0),
                               reference.predict(xe, batch_size=BATCH, verbose=0), atol=1e-5)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_variables_and_optimizer_slots_live_on_their_stage_device(optimizer):
    pipeline = PipelineModel(_layers(), input_shape=(12,), num_stages=4, num_microbatches=2)
    pipeline.compile(optimizer=optimizer, loss=_loss())
    x, y = _data()
    pipeline.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    for row in pipeline.placement():
        assert row["variable_devices"] == [
            f"/job:localhost/replica:0/task:0/device:CPU:{row['stage']}"], row
    stage_of = {id(v): s for s, stage in enumerate(pipeline.replicas[0])
                for v in stage.trainable_variables}
    slot_count = 0
    for stage_index, stage in enumerate(pipeline.replicas[0]):
        for v in stage.trainable_variables:
            for slot in pipeline.optimizer.variables:
                if slot.path.endswith(v.path.replace("/", "_") + "_momentum") or \
                        slot.path.endswith(v.path.replace("/", "_") + "_velocity"):
                    assert slot.value.device.endswith(f"CPU:{stage_index}"), slot.path
                    slot_count += 1
    assert slot_count == (2 * len(stage_of) if optimizer == "adam" else 0)


def test_unbuilt_layers_are_built_on_their_stage_devices():
    # The whole model never exists unsplit on one device (it may fit none):
    # each unbuilt layer the caller passed gets its variables on its stage's
    # device, whatever the caller's device scope, and it is those layer
    # objects that train.
    layers = _layers()
    with tf.device("/CPU:3"):
        pipeline = PipelineModel(layers, input_shape=(12,), num_stages=2)
    devices = [{v.value.device[-5:] for v in layer.weights} for layer in layers]
    assert devices == [{"CPU:0"}, {"CPU:0"}, {"CPU:1"}, {"CPU:1"}]
    assert [row["variable_devices"][0][-5:] for row in pipeline.placement()] == ["CPU:0",
                                                                                  "CPU:1"]
    assert pipeline.replicas[0][1].layers[-1] is layers[-1]


def test_built_layers_move_to_their_stage_with_their_weights_and_train():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)), *_layers()])
    initial = model.get_weights()
    reference = _copy(model)
    x, y = _data()
    model.predict(x[:4], verbose=0)  # traced before the move, it reads the moved variables
    pipeline = PipelineModel(model, num_stages=2, num_microbatches=2)
    assert [{v.value.device[-5:] for v in layer.weights} for layer in model.layers] == [
        {"CPU:0"}, {"CPU:0"}, {"CPU:1"}, {"CPU:1"}]
    for a, b in zip(model.get_weights(), initial):
        np.testing.assert_array_equal(a, b)
    for m in (pipeline, reference):
        m.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    # The caller's model and layers hold the trained weights.
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert not np.allclose(model.layers[0].kernel.numpy(), initial[0])
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0),
                               atol=1e-5)


def test_a_stack_without_input_shape_builds_from_the_first_batch():
    # As keras.Sequential does: no input_shape, the first batch decides.
    keras.utils.set_random_seed(0)
    layers = _layers()
    pipeline = PipelineModel(layers, num_stages=2, num_microbatches=2)
    assert pipeline.plan is None and not layers[0].built
    pipeline.compile(optimizer="adam", loss=_loss())
    x, y = _data()
    pipeline.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert pipeline.plan.sizes == (2, 2)
    assert [{v.value.device[-5:] for v in layer.weights} for layer in layers] == [
        {"CPU:0"}, {"CPU:0"}, {"CPU:1"}, {"CPU:1"}]
    # Adam's slots were made on their variables' devices after the build.
    slots = {v.value.device[-5:] for v in pipeline.optimizer.variables if len(v.shape)}
    assert slots == {"CPU:0", "CPU:1"}
    assert pipeline.to_sequential().count_params() == sum(l.count_params() for l in layers)
    unbuilt = PipelineModel(_layers(), num_stages=2)
    with pytest.raises(RuntimeError, match=r"pipeline_footprint\(\) needs the stages, which are "
                                           r"built from the first batch"):
        pipeline_footprint(unbuilt, BATCH)
    assert unbuilt.stage_bounds == ()


def test_hybrid_places_replicas_on_their_own_devices():
    pipeline = PipelineModel(_layers(), input_shape=(12,), num_stages=2, num_replicas=2,
                             num_microbatches=2)
    devices = [(row["replica"], row["stage"], row["variable_devices"][0][-5:])
               for row in pipeline.placement()]
    assert devices == [(0, 0, "CPU:0"), (0, 1, "CPU:1"), (1, 0, "CPU:2"), (1, 1, "CPU:3")]


def test_batchnorm_uses_per_microbatch_statistics():
    # With M micro-batches, BatchNorm normalises each micro-batch by its own
    # statistics (as GPipe does): the step equals the reference model run on
    # each micro-batch separately, not on the whole batch.
    pipeline, reference = _pair(2, 2, batchnorm=True)
    x, y = _data()
    loss_pipeline = pipeline.train_on_batch(x[:BATCH], y[:BATCH])
    half = BATCH // 2
    per_micro = [float(_loss()(y[i:i + half], reference(x[i:i + half], training=True)))
                 for i in (0, half)]
    full = float(_loss()(y[:BATCH], reference(x[:BATCH], training=True)))
    assert loss_pipeline == pytest.approx(np.mean(per_micro), abs=1e-5)
    assert abs(full - np.mean(per_micro)) > 1e-4  # the difference is real
    # Moving statistics were updated once per micro-batch.
    bn = next(l for st in pipeline.replicas[0] for l in st.layers
              if isinstance(l, keras.layers.BatchNormalization))
    assert not np.allclose(bn.moving_mean.numpy(), 0.0)


def test_dropout_trains_and_is_off_in_inference():
    pipeline, _ = _pair(2, 4, dropout=0.5)
    x, y = _data()
    losses = [pipeline.train_on_batch(x[:BATCH], y[:BATCH]) for _ in range(3)]
    assert all(np.isfinite(losses))
    a = pipeline.predict(x[:BATCH], verbose=0)
    b = pipeline.predict(x[:BATCH], verbose=0)
    np.testing.assert_array_equal(a, b)  # no dropout at inference


def test_pipeline_footprint_per_device():
    # _layers(): 12 -> Dense 24 -> Dense 24 | -> Dense 16 -> Dense 10 (balanced by
    # parameters: 312 + 600 | 400 + 170); micro-batches of 32 / 4 = 8, float32.
    f32, micro = 4, BATCH // 4
    pipeline = PipelineModel(_layers(), input_shape=(12,), num_stages=2, num_microbatches=4)
    # What the memory model reads of the pipeline: its stages' blocks and layers.
    assert pipeline.stage_bounds == ((0, 2), (2, 4))
    assert pipeline.stage_layers(0, 1) == list(pipeline.built_chain().stack[2:])
    counted = pipeline_footprint(pipeline, batch_size=BATCH, optimizer="adam")  # not compiled
    assert [r["optimizer_slots"] for r in pipeline_footprint(pipeline, BATCH)] == [0, 0]
    pipeline.compile(optimizer="adam", loss=_loss())  # builds the slots on their devices
    rows = pipeline_footprint(pipeline, batch_size=BATCH)
    assert [r["device"] for r in rows] == ["/device:CPU:0", "/device:CPU:1"]
    assert [(r["replica"], r["stage"]) for r in rows] == [(0, 0), (0, 1)]
    total_params = sum(r["parameters"] for r in rows)
    assert total_params == 4 * pipeline.to_sequential().count_params()
    assert [r["parameters"] for r in rows] == [(312 + 600) * f32, (400 + 170) * f32]
    # Stage 0 keeps its outputs; stage 1 also the input it received.
    assert [r["activations_per_microbatch"] for r in rows] == [
        (24 + 24) * micro * f32, (24 + 16 + 10) * micro * f32]
    for row in rows:
        assert row["gradients"] == row["parameters"]
        assert row["optimizer_slots"] >= 2 * row["parameters"]  # Adam: 2 slots per weight
        assert row["optimizer_slots"] == 2 * row["gradients"]  # measured: exactly those
        assert row["activations_per_microbatch"] > 0
        # GPipe holds all 4 micro-batches' activations until the backward pass.
        assert row["activations"] == 4 * row["activations_per_microbatch"]
        assert row["activation_batch"] == micro
        assert row["total"] == sum(row[k] for k in ("parameters", "gradients",
                                                    "optimizer_slots", "activations"))
    assert counted == rows  # the slots counted before compiling are the measured ones
    remat = pipeline_footprint(PipelineModel(_layers(), input_shape=(12,), num_stages=2,
                                             num_microbatches=4, remat=True), batch_size=BATCH)
    assert remat[0]["activations_per_microbatch"] < rows[0]["activations_per_microbatch"]
    assert remat[0]["activations"] < rows[0]["activations"]
    # Stage 0 keeps nothing per micro-batch (its input is the model's) and
    # recomputes one micro-batch's outputs at a time.
    assert (remat[0]["activations_per_microbatch"], remat[0]["activations"]) == (
        0, (24 + 24) * micro * f32)
    # The last stage is not recomputed: it keeps what it keeps without remat.
    assert remat[1]["activations_per_microbatch"] == rows[1]["activations_per_microbatch"]
    assert remat[1]["activations"] == rows[1]["activations"]
    assert "CPU:1" in format_footprint(rows)


@pytest.mark.parametrize("kwargs,match", [
    ({"num_stages": 9}, (r"^model 'stack' cannot be cut into 9 stages: it has 4 layers; use "
                         r"at most 4 stages\.$")),
    ({"num_stages": 0}, r"^`num_stages` must be a positive integer, got 0"),
    ({"devices": ["CPU:0", "CPU:7"]}, r"do not exist; available"),
    ({"num_stages": 2, "devices": ["CPU:0", "CPU:1", "CPU:2"]}, r"lists 3 devices but"),
    ({"num_stages": 3, "num_replicas": 2}, r"3 stages x 2 replicas need 6 devices, found 4"),
    ({"num_microbatches": 0}, r"`num_microbatches` must be a positive integer"),
    ({"partition": "magic"}, r"magic"),
])
def test_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineModel(_layers(), input_shape=(12,), **kwargs)


def test_too_many_devices_names_devices():
    # The stage count comes from `devices` here: the error names them, not
    # `num_stages`, which the caller did not set.
    with pytest.raises(ValueError, match=r"^model 'stack' cannot be cut into 4 stages per replica "
                                         r"\(`devices` lists 4\): it has 2 layers; pass at "
                                         r"most 2 devices per replica"):
        PipelineModel(_layers()[:2], input_shape=(12,),
                      devices=["CPU:0", "CPU:1", "CPU:2", "CPU:3"])


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"remat=True.*Dropout|dropout"):
        PipelineModel(_layers(dropout=0.1), input_shape=(12,), remat=True)
    with pytest.raises(ValueError, match=r"remat=True.*moving statistics.*batch_normalization"):
        PipelineModel(_layers(batchnorm=True), input_shape=(12,), remat=True)
    pipeline = PipelineModel(_layers(), input_shape=(12,), num_stages=2, num_microbatches=3)
    pipeline.compile(optimizer="sgd", loss=_loss())
    x, y = _data()
    with pytest.raises(ValueError, match=r"the batch \(32\) must split into 1 replica x 3"):
        pipeline.fit(x, y, batch_size=BATCH, verbose=0)
    with pytest.raises(ValueError, match=r"keeps XLA off"):
        pipeline.compile(optimizer="sgd", loss=_loss(), jit_compile=True)


# --- functional models: chains of blocks, side inputs, accumulation ---------------


def _transformer(vocab=32, seq=8, width=16, heads=2, num_blocks=2):
    """A small decoder: token and position embeddings, pre-LayerNorm blocks of
    causal self-attention (with a padding mask input) and an MLP, a head. The
    attention projections have no bias: a key bias has an exactly zero
    gradient (softmax ignores a shift), which Adam would turn from rounding
    noise into +-lr steps that differ between any two summation orders."""
    tokens = keras.Input((seq,), dtype="int32", name="tokens")
    positions = keras.Input((seq,), dtype="int32", name="positions")
    mask = keras.Input((seq,), dtype="int32", name="mask")
    attention_mask = keras.ops.expand_dims(keras.ops.cast(mask, "bool"), 1)
    x = keras.layers.Add()([keras.layers.Embedding(vocab, width)(tokens),
                            keras.layers.Embedding(seq, width)(positions)])
    for _ in range(num_blocks):
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.MultiHeadAttention(heads, width // heads, use_bias=False)(
            h, h, attention_mask=attention_mask, use_causal_mask=True)
        x = keras.layers.Add()([x, h])
        h = keras.layers.Dense(4 * width, activation="gelu")(keras.layers.LayerNormalization()(x))
        x = keras.layers.Add()([x, keras.layers.Dense(width)(h)])
    logits = keras.layers.Dense(vocab)(keras.layers.LayerNormalization()(x))
    return keras.Model({"tokens": tokens, "positions": positions, "mask": mask}, logits,
                       name="decoder")


def _token_batch(n, vocab=32, seq=8, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, seq + 1, (n, 1))
    x = {"tokens": rng.integers(0, vocab, (n, seq)).astype("int32"),
         "positions": np.tile(np.arange(seq, dtype="int32"), (n, 1)),
         "mask": (np.arange(seq)[None, :] < lengths).astype("int32")}
    return x, rng.integers(0, vocab, (n, seq))


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_functional_transformer_trains_like_the_unpartitioned_model():
    keras.utils.set_random_seed(0)
    model = _transformer()
    reference = _copy(model)
    pipeline = PipelineModel(model, num_stages=2, num_microbatches=2)  # no input_shape
    for m in (pipeline, reference):
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss=_loss())
    x, y = _token_batch(16)
    h_p = pipeline.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # 4 Adam steps
    h_r = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(h_p.history["loss"], h_r.history["loss"], atol=1e-5)
    assert h_p.history["loss"][1] < h_p.history["loss"][0]
    # The model the caller passed, and its layer objects, hold the trained weights.
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # Every layer lives on its stage: both attention layers, the mask reaching both.
    attention = [l for l in model.layers if isinstance(l, keras.layers.MultiHeadAttention)]
    mask = [t.name for t in model.inputs].index("mask")
    for s, stage in enumerate(pipeline.replicas[0]):
        assert {v.value.device[-5:] for v in stage.weights} == {f"CPU:{s}"}
        assert attention[s] in stage.layers
        assert mask in pipeline._side_keys[s]
    slots = {v.value.device[-5:] for v in pipeline.optimizer.variables if len(v.shape)}
    assert slots == {"CPU:0", "CPU:1"}
    expected = reference.predict(x, batch_size=8, verbose=0)
    np.testing.assert_allclose(pipeline.predict(x, batch_size=8, verbose=0), expected, atol=1e-5)
    np.testing.assert_allclose(pipeline.to_model()(x), expected, atol=1e-5)
    with pytest.raises(ValueError, match=r"'decoder' is a functional model.*use to_model\(\)"):
        pipeline.to_sequential()
    with pytest.raises(ValueError, match=r"inputs \['mask'\] are missing"):
        pipeline.predict({k: x[k] for k in ("tokens", "positions")}, verbose=0)


def _residual_mlp():
    """Dict inputs; three residual blocks, each scaled by a side input."""
    features = keras.Input((12,), name="features")
    scale = keras.Input((1,), name="scale")
    x = keras.layers.Dense(16, name="embed")(features)
    for i in range(3):
        h = keras.layers.Dense(16, activation="tanh", name=f"inner{i}")(x)
        h = keras.layers.Multiply(name=f"scaled{i}")([h, scale])
        x = keras.layers.Add(name=f"residual{i}")([x, h])
    return keras.Model({"features": features, "scale": scale},
                       keras.layers.Dense(10, name="head")(x), name="residual_mlp")


@pytest.mark.parametrize("stages,micro,replicas,accumulate", [(3, 2, 1, 1), (2, 1, 2, 2)])
def test_functional_chain_with_residuals_and_a_side_input(stages, micro, replicas, accumulate):
    keras.utils.set_random_seed(0)
    model = _residual_mlp()
    reference = _copy(model)
    pipeline = PipelineModel(model, num_stages=stages, num_microbatches=micro,
                             num_replicas=replicas, accumulate_steps=accumulate, partition="flops")
    assert pipeline.plan.num_stages == stages and sum(pipeline.plan.sizes) == 5
    for m in (pipeline, reference):
        m.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
    features, y = _data(n=64)
    x = {"features": features, "scale": np.linspace(0.5, 1.5, 64, dtype="float32")[:, None]}
    h_p = pipeline.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    def train_reference():  # the same for every case: trained once
        h_r = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return h_r.history["loss"], reference.get_weights()

    ref_loss, ref_weights = _reference_run("residual_mlp", train_reference)
    np.testing.assert_allclose(h_p.history["loss"], ref_loss, atol=1e-5)
    for a, b in zip(model.get_weights(), ref_weights):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for s in range(stages):
        # Stages after the first receive the residual stream and the side input.
        assert pipeline._side_keys[s] == ((0, 1) if s == 0 else (1,))
    if replicas > 1:  # replica 0 trains the caller's layers, the copies stay equal
        assert model.get_layer("head") in pipeline.replicas[0][-1].layers
        for s in range(stages):
            for w0, w1 in zip(pipeline.replicas[0][s].get_weights(),
                              pipeline.replicas[1][s].get_weights()):
                np.testing.assert_array_equal(w0, w1)
        assert {row["variable_devices"][0][-5:] for row in pipeline.placement()
                if row["replica"] == 1} == {"CPU:2", "CPU:3"}


def test_a_branch_crossing_every_cut_is_refused_naming_the_layer():
    x = keras.Input((12,))
    skip = keras.layers.Dense(16, name="skip_source")(x)
    h = keras.layers.Dense(16, name="middle")(keras.layers.Dense(16)(skip))
    joined = keras.layers.Concatenate(name="join")([skip, h])
    model = keras.Model(x, keras.layers.Dense(10)(joined), name="branchy")
    # Three blocks: skip_source | dense..join (the skip crosses every point) | head.
    assert PipelineModel(model, num_stages=3).plan.sizes == (1, 1, 1)
    with pytest.raises(ValueError, match=r"model 'branchy' cannot be cut into 4 stages: it has 3 "
                                         r"blocks.*output of layer 'skip_source' is used by "
                                         r"layer 'join'"):
        PipelineModel(model, num_stages=4)


@pytest.mark.slow  # trains for seconds: not in make test-fast
def test_accumulation_equals_the_big_batch_step():
    # accumulate_steps=2: a batch of 32 rows is 2 rounds of 16 (2 micro-batches
    # of 8 each), one Adam update: the same as one step on the 32 rows.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)), *_layers()])
    reference = _copy(model)
    pipeline = PipelineModel(model, num_stages=2, num_microbatches=2, accumulate_steps=2)
    for m in (pipeline, reference):
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss=_loss())
    x, y = _data()
    h_p = pipeline.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    h_r = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(pipeline.optimizer.iterations) == 3  # one update per 32-row batch
    np.testing.assert_allclose(h_p.history["loss"], h_r.history["loss"], atol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert pipeline_footprint(pipeline, BATCH)[0]["activation_batch"] == BATCH // 4
    fresh = PipelineModel(_layers(), input_shape=(12,), num_microbatches=2, accumulate_steps=2)
    fresh.compile(optimizer="sgd", loss=_loss())
    with pytest.raises(ValueError, match=r"the batch \(30\) must split into 2 accumulation "
                                         r"steps x 1 replica x 2 micro-batches"):
        fresh.train_on_batch(x[:30], y[:30])
    with pytest.raises(ValueError, match=r"`accumulate_steps` must be a positive integer"):
        PipelineModel(_layers(), input_shape=(12,), accumulate_steps=0)


class _SelfPlaced(keras.layers.Layer):
    """Makes its weight on CPU:3 itself, as a tensor-parallel layer makes its shards."""

    places_own_variables = True

    def build(self, input_shape):
        from tfmulti.parallel import placement

        with placement.outside_symbolic_pass(), tf.device("/CPU:3"):
            self.scale = self.add_weight(shape=(input_shape[-1],), initializer="random_uniform")

    def call(self, inputs):
        return inputs * self.scale


def test_a_layer_that_places_its_own_variables_keeps_them_where_it_made_them():
    layers = [keras.layers.Dense(8), _SelfPlaced(), keras.layers.Dense(4)]
    pipeline = PipelineModel(layers, input_shape=(12,), num_stages=2, num_replicas=2,
                             partition=[1, 2])
    assert layers[1].scale.value.device.endswith("CPU:3")
    assert layers[2].kernel.value.device.endswith("CPU:1")
    copy = pipeline.replicas[1][1].layers[1]  # replica 1's copy: the same values
    assert isinstance(copy, _SelfPlaced) and copy is not layers[1]
    np.testing.assert_array_equal(copy.scale.numpy(), layers[1].scale.numpy())


def test_remat_refuses_dropout_inside_a_layer():
    x = keras.Input((4, 8))
    attended = keras.layers.MultiHeadAttention(2, 4, dropout=0.1, name="attention")(x, x)
    model = keras.Model(x, keras.layers.Dense(2)(keras.layers.Dense(8)(attended)))
    with pytest.raises(ValueError, match=r"`remat=True` recomputes activations, which would "
                                         r"redraw the random masks of \['dropout"):
        PipelineModel(model, num_stages=2, remat=True)
