"""The Keras programs users bring, trained through a pipeline as plain Keras
trains them on one device: several outputs (a shared trunk and heads, dict
or list, loss weights, per-output metrics), sample weights (and weighted
metrics), the mask of an `Embedding(mask_zero=True)` crossing a cut, and a
sequence output's mask on the loss. Each is compared with the same model
and batch under plain Keras (`fit`, `evaluate`, `predict`, or its
gradients), on the virtual CPUs of tests/conftest.py."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.corpus import text_transformer
from tfmulti.memory.footprint import pipeline_footprint
from tfmulti.parallel import PipelineModel
from tfmulti.parallel import chain as blocks
from tfmulti.parallel.tensor_models import split_for_pipeline

LR = 0.1
BATCH = 32


# The second and later cases of the heavier tests run in the slow tier: the fast tier
# keeps one of each (its 2-minute bound); `make test` runs them all.
SLOW = pytest.mark.slow


def _copy(model):
    """The same model (architecture and weights), with layers of its own."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy


def _assert_same_weights(a, b, atol=1e-5):
    b = b if isinstance(b, list) else b.get_weights()
    for x, y in zip(a.get_weights(), b, strict=True):
        np.testing.assert_allclose(x, y, atol=atol)


_REFERENCE_RUNS = {}
"""Plain Keras' results, by what was trained: the cases of a test that train
the same seeded model on the same data in plain Keras compare with the one
result, trained once per process."""


def _reference_run(key, train):
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = train()
    return _REFERENCE_RUNS[key]


# --- several outputs ----------------------------------------------------------------


def _triage(structure="dict"):
    """A shared trunk and two heads (a ticket's priority, its department)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((12,), name="features")
    h = keras.layers.Dense(16, activation="relu", name="trunk0")(x)
    h = keras.layers.Dense(16, activation="tanh", name="trunk1")(h)
    priority = keras.layers.Dense(1, name="priority")(h)
    department = keras.layers.Dense(4, name="department")(h)
    outputs = ({"priority": priority, "department": department} if structure == "dict"
               else [priority, department])
    return keras.Model(x, outputs, name="triage")


def _triage_data(structure="dict", n=BATCH):
    rng = np.random.default_rng(0)
    x = rng.random((n, 12), dtype=np.float32)
    priority, department = rng.random((n, 1), dtype=np.float32), rng.integers(0, 4, n)
    y = ({"priority": priority, "department": department} if structure == "dict"
         else [priority, department])
    return x, y, rng.random(n).astype("float32")


def _triage_compile(model):
    model.compile(optimizer=keras.optimizers.SGD(LR),
                  loss={"priority": "mse",
                        "department": keras.losses.SparseCategoricalCrossentropy(True)},
                  loss_weights={"priority": 0.5, "department": 1.0},
                  metrics={"department": ["accuracy"]}, weighted_metrics={"priority": ["mae"]})


@pytest.mark.parametrize("replicas,micro,accumulate,structure", [
    (1, 4, 1, "dict"), pytest.param(2, 2, 1, "list", marks=SLOW),
    pytest.param(1, 2, 2, "dict", marks=SLOW)])
def test_several_outputs_fit_evaluate_and_predict_as_keras(replicas, micro, accumulate,
                                                           structure, tmp_path):
    model = _triage(structure)
    reference = _copy(model)
    pipeline = PipelineModel(model, num_stages=2, num_microbatches=micro,
                             num_replicas=replicas, accumulate_steps=accumulate)
    assert {"priority", "department"} <= {l.name for l in pipeline.stage_layers(0, 1)}
    for m in (pipeline, reference):
        _triage_compile(m)
    x, y, weights = _triage_data(structure)

    def fit(m):
        return m.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False,
                     verbose=0).history

    def evaluate(m):
        return m.evaluate(x, y, sample_weight=weights, batch_size=BATCH, verbose=0,
                          return_dict=True)

    def predict(m):
        return m.predict(x[:13], verbose=0)  # uneven micro-batches

    def train_reference():  # the same for every case of this structure: trained once
        return fit(reference), reference.get_weights(), evaluate(reference), predict(reference)

    fitted_p = fit(pipeline)
    fitted_r, reference_weights, evaluated_r, predicted_r = _reference_run(
        ("triage", structure), train_reference)
    fitted = [fitted_p, fitted_r]
    # loss, priority_loss, department_loss, department_accuracy, priority_mae
    assert sorted(fitted[0]) == sorted(fitted[1]) and len(fitted[0]) == 5
    for key in fitted[1]:
        np.testing.assert_allclose(fitted[0][key], fitted[1][key], atol=1e-5, err_msg=key)
    _assert_same_weights(model, reference_weights)
    evaluated = [evaluate(pipeline), evaluated_r]
    assert evaluated[0] == pytest.approx(evaluated[1], abs=1e-5)
    predicted = [predict(pipeline), predicted_r]
    assert type(predicted[0]) is type(predicted[1])
    keras.tree.map_structure(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
                             *predicted)
    # The user's model itself, for saving: it loads with its two heads.
    assert pipeline.to_model() is model
    pipeline.save(tmp_path / "triage.keras")
    loaded = keras.saving.load_model(tmp_path / "triage.keras")
    keras.tree.map_structure(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
                             loaded.predict(x[:13], verbose=0), predicted[1])


def test_a_model_compiled_by_its_author_saves_with_the_pipelines_optimizer_state(tmp_path):
    # The model compiled by its author (its own optimizer), trained as a hybrid
    # whose optimizer holds both replicas' variables in the stages' order: the
    # saved model's optimizer holds replica 0's state in the model's own order,
    # so that Keras loads it (by position) without "Skipping variable loading".
    model = _triage()
    model.compile(optimizer=keras.optimizers.RMSprop(1e-2, momentum=0.9), loss="mse")
    pipeline = PipelineModel(model, num_stages=2, num_microbatches=2, num_replicas=2)
    pipeline.compile(optimizer=keras.optimizers.RMSprop(1e-2, momentum=0.9), loss="mse")
    x, y, _ = _triage_data()
    pipeline.fit(x, {"priority": y["priority"], "department": keras.ops.one_hot(
        y["department"], 4)}, batch_size=BATCH, epochs=2, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline.save(tmp_path / "model.keras")
        loaded = keras.models.load_model(tmp_path / "model.keras")
    assert not [w for w in caught if "Skipping variable loading" in str(w.message)]
    trained = {v.name: np.asarray(v.value) for v in pipeline.optimizer.variables}
    assert int(loaded.optimizer.iterations) == 2
    for variable in loaded.optimizer.variables:
        np.testing.assert_allclose(np.asarray(variable.value), trained[variable.name])
    assert sum(np.abs(np.asarray(v.value)).sum() > 0 for v in loaded.optimizer.variables[2:]) \
        == 2 * len(model.trainable_variables)  # momentum and velocity of each weight


def test_the_heads_are_cut_with_the_last_stage_and_counted_there():
    # The last block returns the model's outputs as the model does (a dict);
    # the memory model counts both heads' outputs on the last stage.
    model = _triage()
    chain = blocks.chain_of(model)
    assert [b.name for b in chain.blocks] == ["trunk0", "trunk1", "department..priority"]
    heads = chain.blocks[-1].exit
    assert sorted(heads) == ["department", "priority"]
    assert heads["priority"] is model.get_layer("priority").output
    pipeline = PipelineModel(model, num_stages=2, num_microbatches=4)
    rows = pipeline_footprint(pipeline, batch_size=BATCH)
    micro, f32 = BATCH // 4, 4
    assert [r["activations_per_microbatch"] for r in rows] == [
        16 * micro * f32, (16 + 16 + 1 + 4) * micro * f32]  # received, trunk1, two heads


def _auxiliary():
    """An auxiliary head on the first layer, the main head at the end."""
    x = keras.Input((6,))
    first = keras.layers.Dense(8, name="first")(x)
    aux = keras.layers.Dense(1, name="aux")(first)
    h = keras.layers.Dense(8, name="second")(first)
    main = keras.layers.Dense(3, name="main")(keras.layers.Dense(8, name="third")(h))
    return keras.Model(x, [main, aux], name="auxiliary")


def test_an_output_before_the_last_cut_is_refused_naming_it():
    # Every output leaves from the last stage: the head on `first` ends the
    # cuts there, and asking for more stages names it before anything trains.
    model = _auxiliary()
    with pytest.raises(ValueError, match=r"^model 'auxiliary' cannot be cut into 3 stages: it "
                                         r"has 2 blocks .*; use at most 2 stages\. Output 'aux' "
                                         r"is computed before layer 'second', and every output "
                                         r"leaves the model from the last stage, so no stage "
                                         r"can start after it\.$"):
        PipelineModel(model, num_stages=3)
    pipeline = PipelineModel(model, num_stages=2)
    assert [l.name for l in pipeline.stage_layers(0, 0)] == ["first"]
    x = np.random.default_rng(0).random((8, 6), dtype=np.float32)
    keras.tree.map_structure(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                             pipeline(x), model(x))
    # An output that later layers also use would be the tensor crossing the cut.
    x = keras.Input((4,))
    h = keras.layers.Dense(4, name="hidden")(x)
    two = keras.Model(x, [h, keras.layers.Dense(2, name="on_top")(h)], name="two")
    with pytest.raises(ValueError, match=r"it has 1 block .*; use at most 1 stage\. Output "
                                         r"'hidden' is computed before layer 'on_top'"):
        PipelineModel(two, num_stages=2)


def test_a_tensor_parallel_stage_of_a_model_with_two_heads():
    # split_for_pipeline splits the attention held in the user's layer; the
    # one-stage pipeline returns both heads as the unsplit model does.
    def build():
        tokens = keras.Input((6,), dtype="int32")
        h = keras.layers.Embedding(50, 8)(tokens)
        h = text_transformer.TransformerBlock(8, 2, 8, rate=0.0)(h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        return keras.Model(tokens, {"priority": keras.layers.Dense(1, name="priority")(h),
                                    "department": keras.layers.Dense(3, name="department")(h)})

    keras.utils.set_random_seed(0)
    plain, source = build(), build()
    source.set_weights(plain.get_weights())
    split, devices = split_for_pipeline(source, 2, ["CPU:2", "CPU:3"])
    pipeline = PipelineModel(split, devices=devices, num_stages=1, num_microbatches=2)
    x = np.random.default_rng(0).integers(0, 50, (8, 6)).astype("int32")
    got, expected = pipeline(x), plain(x)
    assert sorted(got) == ["department", "priority"]
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], atol=1e-5)


# --- sample weights -----------------------------------------------------------------


def _mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(24, activation="relu"),
                             keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(10)])


def _compiled(model, learning_rate=LR):
    model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    return model


@pytest.mark.parametrize("replicas,micro", [(1, 4), pytest.param(2, 2, marks=SLOW)])
def test_a_weighted_step_is_the_keras_step_with_the_same_sample_weights(replicas, micro):
    rng = np.random.default_rng(0)
    x, y = rng.random((BATCH, 12), dtype=np.float32), rng.integers(0, 10, BATCH)
    weights = rng.random(BATCH).astype("float32") * 3
    model = _mlp()
    reference = _compiled(_copy(model))
    pipeline = _compiled(PipelineModel(model, num_stages=2, num_microbatches=micro,
                                       num_replicas=replicas))

    def train_reference():  # the same for every case: trained once
        fitted = reference.fit(x, y, sample_weight=weights, batch_size=BATCH, verbose=0)
        return (fitted.history, reference.get_weights(),
                reference.evaluate(x, y, sample_weight=weights, verbose=0))

    reference_fitted, reference_weights, reference_evaluated = _reference_run(
        "weighted", train_reference)
    fitted = [pipeline.fit(x, y, sample_weight=weights, batch_size=BATCH, verbose=0).history,
              reference_fitted]
    assert {k: v[0] for k, v in fitted[0].items()} == pytest.approx(
        {k: v[0] for k, v in fitted[1].items()}, abs=1e-5)  # loss and weighted accuracy
    _assert_same_weights(model, reference_weights)
    assert pipeline.evaluate(x, y, sample_weight=weights, verbose=0) == pytest.approx(
        reference_evaluated, abs=1e-5)
    # Zero weights on the odd rows: Keras divides the weighted sum by the
    # batch (32 rows), so the step is the step on the even rows alone (16
    # rows, the same weights) at half the learning rate.
    model = _mlp()
    half = _compiled(_copy(model), learning_rate=LR / 2)
    pipeline = _compiled(PipelineModel(model, num_stages=2, num_microbatches=micro,
                                       num_replicas=replicas))
    pipeline.fit(x, y, sample_weight=np.where(np.arange(BATCH) % 2, 0, weights),
                 batch_size=BATCH, verbose=0)

    def train_half():  # the same for every case: trained once
        half.fit(x[::2], y[::2], sample_weight=weights[::2], batch_size=BATCH, verbose=0)
        return half.get_weights()

    _assert_same_weights(model, _reference_run("weighted_half", train_half))


@pytest.mark.parametrize("micro", [1, 4])
@pytest.mark.parametrize("head, loss", [
    ("sigmoid", keras.losses.BinaryCrossentropy()),
    ("softmax", keras.losses.SparseCategoricalCrossentropy()),
])
def test_a_sigmoid_or_softmax_outputs_loss_is_taken_from_its_logits_as_keras_does(
        micro, head, loss):
    # Keras' sigmoid and softmax hand their logits to the cross-entropies on
    # the output tensor (`_keras_logits`): the loss is computed from them, so
    # the output itself is off the loss's path. The pipeline differentiates
    # the loss by those logits, whole batch or micro-batches alike (by the
    # output, one micro-batch trained nothing).
    rng = np.random.default_rng(0)
    x = rng.random((BATCH, 12), dtype=np.float32)
    y = rng.integers(0, 2 if head == "sigmoid" else 10, BATCH)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1 if head == "sigmoid" else 10,
                                                 activation=head)])
    reference = _copy(model)
    pipeline = PipelineModel(model, num_stages=2, num_microbatches=micro)
    for m in (pipeline, reference):
        m.compile(optimizer=keras.optimizers.SGD(LR), loss=loss)

    def fit(m):
        return m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history["loss"]

    # plain Keras' training: the same for every micro-batch count, trained once per head
    reference_loss, reference_weights = _reference_run(
        ("logits", head), lambda: (fit(reference), reference.get_weights()))
    np.testing.assert_allclose(fit(pipeline), reference_loss, atol=1e-6)
    _assert_same_weights(model, reference_weights)


# --- masks --------------------------------------------------------------------------


def _padded(n, length, lengths, vocab=20, seed=0):
    """Token ids 1..vocab-1, padded with 0 after each row's length."""
    tokens = np.random.default_rng(seed).integers(1, vocab, (n, length)).astype("int32")
    tokens[np.arange(length)[None, :] >= np.asarray(lengths)[:, None]] = 0
    return tokens


def _classifier(sequential=False, mask_zero=True):
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Embedding(20, 8, mask_zero=mask_zero),
              keras.layers.LSTM(8), keras.layers.Dense(3)]
    if sequential:
        return keras.Sequential([keras.Input((None,), dtype="int32"), *layers])
    tokens = keras.Input((None,), dtype="int32")
    h = tokens
    for layer in layers:
        h = layer(h)
    return keras.Model(tokens, h)


@pytest.mark.parametrize("sequential", [False, pytest.param(True, marks=SLOW)])
def test_the_embedding_mask_reaches_the_lstm_across_the_cut(sequential):
    # The Embedding on stage 0, the LSTM on stage 1: the padding must stay
    # masked across the cut. Keras records the mask in the model's graph as
    # a computation on the token ids (`tokens != 0`) that the LSTM's call
    # takes: stage 1 receives the token ids and computes it again.
    model = _classifier(sequential)
    unmasked = _classifier(sequential, mask_zero=False)
    unmasked.set_weights(model.get_weights())
    reference = _copy(model)
    pipeline = PipelineModel(model, num_stages=2, num_microbatches=2, partition=[1, 2])
    assert [type(l).__name__ for l in pipeline.stage_layers(0, 1)] == ["LSTM", "Dense"]
    chain = pipeline.built_chain()
    assert chain.stage_side_keys(1, 3) == (0,)
    assert type(chain.stage_nodes(1, 3)[0].operation).__name__ == "NotEqual"
    x = _padded(8, 7, lengths=[7, 2, 5, 1, 3, 7, 4, 6])
    y = np.random.default_rng(1).integers(0, 3, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        predicted = pipeline.predict(x, verbose=0)
    # Keras' warning of a layer that drops its input's mask: not for a stage.
    assert not [w for w in caught if "does not support masking" in str(w.message)]
    np.testing.assert_allclose(predicted, reference.predict(x, verbose=0), atol=1e-5)
    assert np.abs(predicted - unmasked.predict(x, verbose=0)).max() > 1e-3  # the mask counts
    for m in (pipeline, reference):
        _compiled(m)
    fitted = [m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
              for m in (pipeline, reference)]
    np.testing.assert_allclose(fitted[0], fitted[1], atol=1e-5)
    _assert_same_weights(model, reference)
    # Stage 1 takes the model's token ids beside the cut's tensor: the model
    # still writes its config (Keras' copy of the graph's nodes for a sub-model
    # would point the ids' history at its copy), so it saves whole.
    assert pipeline.to_model().get_config()["layers"]


def test_a_sequence_length_of_none_is_accepted_but_not_costed_by_flops():
    # The LSTM classifier takes sequences of any length: "params" and
    # explicit sizes cut it; "flops" and "time" need sizes and say so.
    model = _classifier()
    assert PipelineModel(model, num_stages=2).plan.sizes == (1, 2)
    with pytest.raises(ValueError, match=r'^method "flops" needs a fully known input shape; '
                                         r"received \(None,\)\. Pass concrete sizes"):
        PipelineModel(model, num_stages=2, partition="flops")


def _tagger(vocab=20):
    """A sequence output (one label per token) that keeps the padding's mask
    (Dense layers pass it on)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")
    # Large initial weights: the tokens' losses differ from the start.
    normal = keras.initializers.RandomNormal
    h = keras.layers.Embedding(vocab, 8, mask_zero=True, embeddings_initializer=normal(0.0, 1.0))(
        tokens)
    h = keras.layers.Dense(8, activation="tanh")(h)
    return keras.Model(tokens, keras.layers.Dense(5, kernel_initializer=normal(0.0, 5.0))(h))


def _tagged_batch():
    x = _padded(16, 6, lengths=[6] * 4 + [3] * 4 + [1] * 8)
    return x, np.random.default_rng(1).integers(0, 5, (16, 6))


def _masked_gradients(model, x, y):
    """The gradients of the masked loss Keras computes for (x, y)."""
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return loss, [tf.convert_to_tensor(g).numpy() for g in grads]  # the Embedding's: dense


@pytest.mark.parametrize("remat", [False, pytest.param(True, marks=SLOW)])
def test_an_output_mask_averages_the_loss_over_the_valid_steps_of_the_batch(remat):
    # The Dense layers after the cut pass on the mask that the tensor they
    # receive carries (remat: also the tensor of the recomputed stage 0).
    # Micro-batches of 4 rows hold 24, 12, 4 and 4 valid steps: Keras
    # averages over the 44 valid steps of the batch, not over each micro-batch.
    x, y = _tagged_batch()
    model = _tagger()
    reference = _compiled(_copy(model))

    def train_reference():  # the same with or without remat: trained once
        loss, _ = _masked_gradients(reference, x, y)
        per_micro = [_masked_gradients(reference, x[i:i + 4], y[i:i + 4])[0]
                     for i in (0, 4, 8, 12)]
        fitted = reference.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]
        return (float(loss), [float(m) for m in per_micro], fitted, reference.get_weights(),
                reference.evaluate(x, y, batch_size=16, verbose=0))

    loss, per_micro, reference_fitted, reference_weights, reference_evaluated = (
        _reference_run("tagger", train_reference))
    assert abs(loss - float(np.mean(per_micro))) > 1e-2  # the difference is real
    pipeline = _compiled(PipelineModel(model, num_stages=2, num_microbatches=4,
                                       partition=[1, 2], remat=remat))
    fitted = [pipeline.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"],
              reference_fitted]
    np.testing.assert_allclose(fitted[0], fitted[1], atol=1e-5)
    np.testing.assert_allclose(fitted[0], [loss], atol=1e-5)
    _assert_same_weights(model, reference_weights)
    assert pipeline.evaluate(x, y, batch_size=16, verbose=0) == pytest.approx(
        reference_evaluated, abs=1e-5)


def test_a_hybrids_replicas_average_a_masked_loss_over_their_own_rows():
    # As Keras' data-parallel replicas (MirroredStrategy) do: the step is the
    # mean of the two halves' gradients (36 and 8 valid steps), not the
    # full batch's (the module docstring says so).
    x, y = _tagged_batch()
    model = _tagger()
    reference = _copy(model)
    hybrid = _compiled(PipelineModel(model, num_stages=2, num_microbatches=2, num_replicas=2,
                                     partition=[1, 2]))
    before = [v.numpy() for v in reference.trainable_variables]
    halves = [_masked_gradients(reference, x[i:i + 8], y[i:i + 8])[1] for i in (0, 8)]
    _, full = _masked_gradients(reference, x, y)
    hybrid.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    gaps = []
    for w, v, a, b, g in zip(model.trainable_variables, before, *halves, full, strict=True):
        step = (v - w.numpy()) / LR
        np.testing.assert_allclose(step, (a + b) / 2, atol=1e-5)
        gaps.append(np.abs(step - g).max())
    assert max(gaps) > 1e-3
