"""Pipeline and hybrid model parallelism: equivalence with the unpartitioned
model, placement, BatchNorm/Dropout behaviour, remat, memory view, errors.
That the memory view equals `estimate-memory`'s is tests/test_footprint.py."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.footprint import format_footprint
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


def _pair(num_stages, num_microbatches, num_replicas=1, remat=False, **layer_kwargs):
    """A pipeline and the same model unpartitioned, with equal weights."""
    keras.utils.set_random_seed(0)
    reference = keras.Sequential([keras.Input((12,)), *_layers(**layer_kwargs)])
    pipeline = PipelineModel(reference, num_stages=num_stages,
                             num_microbatches=num_microbatches, num_replicas=num_replicas,
                             remat=remat)
    reference.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
    pipeline.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
    return pipeline, reference


def _full_batch_gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = _loss()(y, model(x, training=True))
    return loss, tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("stages,micro,replicas", [
    (2, 1, 1), (2, 2, 1), (2, 4, 1), (2, 8, 1), (4, 1, 1), (4, 2, 1), (4, 4, 1), (4, 8, 1),
    (2, 4, 2),
])
def test_gradients_and_three_steps_match_unpartitioned(stages, micro, replicas):
    pipeline, reference = _pair(stages, micro, replicas)
    x, y = _data()
    # Gradients of one step: weight change / learning rate.
    before = [w.copy() for w in pipeline.to_sequential().get_weights()]
    loss, grads = _full_batch_gradients(reference, x[:BATCH], y[:BATCH])
    step_loss = pipeline.train_on_batch(x[:BATCH], y[:BATCH])
    after = pipeline.to_sequential().get_weights()
    np.testing.assert_allclose(step_loss, float(loss), atol=1e-5)
    for b, a, g in zip(before, after, grads):
        np.testing.assert_allclose((b - a) / LR, g.numpy(), atol=1e-5)
    # Two more SGD steps on both: equal weights.
    reference.train_on_batch(x[:BATCH], y[:BATCH])
    for i in (1, 2):
        batch = slice(i * BATCH, (i + 1) * BATCH)
        l_p = pipeline.train_on_batch(x[batch], y[batch])
        l_r = reference.train_on_batch(x[batch], y[batch])
        np.testing.assert_allclose(l_p, l_r, atol=1e-5)
    for a, b in zip(pipeline.to_sequential().get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    if replicas > 1:  # replicas stay identical
        for s in range(stages):
            for w0, w1 in zip(pipeline.replicas[0][s].get_weights(),
                              pipeline.replicas[1][s].get_weights()):
                np.testing.assert_array_equal(w0, w1)


def test_remat_gives_the_same_step():
    pipeline, reference = _pair(2, 4, remat=True)
    x, y = _data()
    for i in range(2):
        batch = slice(i * BATCH, (i + 1) * BATCH)
        np.testing.assert_allclose(pipeline.train_on_batch(x[batch], y[batch]),
                                   reference.train_on_batch(x[batch], y[batch]), atol=1e-5)
    for a, b in zip(pipeline.to_sequential().get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("replicas,micro,remat", [(1, 2, False), (2, 2, False), (1, 4, True)])
def test_regularization_counts_as_in_the_unpartitioned_model(replicas, micro, remat):
    # Weight penalties on every stage (not only the last one) and an activity
    # regularizer: the same losses and weights as the unpartitioned model, the
    # weight penalty counted once however many replicas hold the weights.
    keras.utils.set_random_seed(0)
    reference = keras.Sequential([
        keras.Input((12,)),
        keras.layers.Dense(16, kernel_regularizer=keras.regularizers.L2(0.5),
                           activity_regularizer=keras.regularizers.L1(0.1)),
        keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L1(0.2)),
        keras.layers.Dense(10, kernel_regularizer=keras.regularizers.L2(0.3))])
    pipeline = PipelineModel(reference, num_stages=2, num_microbatches=micro,
                             num_replicas=replicas, remat=remat)
    for model in (reference, pipeline):
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=_loss())
    x, y = _data(n=BATCH * 2)
    h_p = pipeline.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    h_r = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(h_p.history["loss"], h_r.history["loss"], rtol=1e-5)
    for a, b in zip(pipeline.to_sequential().get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert pipeline.evaluate(x, y, batch_size=BATCH, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-5)


def test_hybrid_evaluates_and_predicts_a_partial_last_batch():
    pipeline, reference = _pair(2, 2, num_replicas=2)
    xe, ye = _data(seed=1, n=BATCH + 9)  # last batch: 9 rows over 2 replicas x 2 micro-batches
    np.testing.assert_allclose(pipeline.predict(xe, batch_size=BATCH, verbose=0),
                               reference.predict(xe, batch_size=BATCH, verbose=0), atol=1e-5)
    assert pipeline.evaluate(xe, ye, batch_size=BATCH, verbose=0) == pytest.approx(
        reference.evaluate(xe, ye, batch_size=BATCH, verbose=0), abs=1e-5)


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


def test_unbuilt_layers_are_built_on_the_host():
    # The whole model first exists unsplit: built under the caller's device
    # scope it would all land on one device, which a model too big for one
    # accelerator does not fit. The originals are built on CPU:0, the copies
    # on their stages.
    layers = _layers()
    with tf.device("/CPU:3"):
        pipeline = PipelineModel(layers, input_shape=(12,), num_stages=2)
    assert {v.value.device[-5:] for l in layers for v in l.weights} == {"CPU:0"}
    assert [row["variable_devices"][0][-5:] for row in pipeline.placement()] == ["CPU:0",
                                                                                  "CPU:1"]


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


def test_memory_report_per_device():
    # _layers(): 12 -> Dense 24 -> Dense 24 | -> Dense 16 -> Dense 10 (balanced by
    # parameters: 312 + 600 | 400 + 170); micro-batches of 32 / 4 = 8, float32.
    f32, micro = 4, BATCH // 4
    pipeline = PipelineModel(_layers(), input_shape=(12,), num_stages=2, num_microbatches=4)
    counted = pipeline.memory_report(batch_size=BATCH, optimizer="adam")  # not compiled
    assert [r["optimizer_slots"] for r in pipeline.memory_report(BATCH)] == [0, 0]
    pipeline.compile(optimizer="adam", loss=_loss())  # builds the slots on their devices
    rows = pipeline.memory_report(batch_size=BATCH)
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
    remat = PipelineModel(_layers(), input_shape=(12,), num_stages=2, num_microbatches=4,
                          remat=True).memory_report(batch_size=BATCH)
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
    ({"num_stages": 9}, r"`num_stages` \(9\) exceeds the number of layers \(4\)"),
    ({"devices": ["CPU:0", "CPU:7"]}, r"do not exist; available"),
    ({"num_stages": 2, "devices": ["CPU:0", "CPU:1", "CPU:2"]}, r"lists 3 devices but"),
    ({"num_stages": 3, "num_replicas": 2}, r"3 stages x 2 replica\(s\) need 6 devices, found 4"),
    ({"num_microbatches": 0}, r"`num_microbatches` must be a positive integer"),
    ({"partition": "magic"}, r"magic"),
])
def test_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineModel(_layers(), input_shape=(12,), **kwargs)


def test_too_many_devices_names_devices():
    # The stage count comes from `devices` here: the error names them, not
    # `num_stages`, which the caller did not set.
    with pytest.raises(ValueError, match=r"`devices` lists 4 devices, 4 stages per replica, "
                                         r"but the model has 2 layers"):
        PipelineModel(_layers()[:2], input_shape=(12,),
                      devices=["CPU:0", "CPU:1", "CPU:2", "CPU:3"])


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"remat=True.*Dropout|dropout"):
        PipelineModel(_layers(dropout=0.1), input_shape=(12,), remat=True)
    with pytest.raises(ValueError, match=r"remat=True.*moving statistics.*batch_normalization"):
        PipelineModel(_layers(batchnorm=True), input_shape=(12,), remat=True)
    inputs = keras.Input((12,))
    branch = keras.layers.Add()([keras.layers.Dense(12)(inputs), inputs])
    functional = keras.Model(inputs, keras.layers.Dense(10)(branch))
    with pytest.raises(ValueError, match=r"not a stack of layers"):
        PipelineModel(functional, num_stages=2)
    with pytest.raises(ValueError, match=r"`input_shape` is required"):
        PipelineModel(_layers(), num_stages=2)
    pipeline = PipelineModel(_layers(), input_shape=(12,), num_stages=2, num_microbatches=3)
    pipeline.compile(optimizer="sgd", loss=_loss())
    x, y = _data()
    with pytest.raises(ValueError, match=r"the batch \(32\) must split into 1 replica\(s\) x 3"):
        pipeline.fit(x, y, batch_size=BATCH, verbose=0)
    with pytest.raises(ValueError, match=r"keeps XLA off"):
        pipeline.compile(optimizer="sgd", loss=_loss(), jit_compile=True)
