"""Lazy sparse updates (`tfmulti.models.sparse_updates`): where every row is
touched every step, the lazy update is the dense one (each optimizer, rows
repeated in the batch); where a row is not touched, it and its slots stay as
they were, while the dense update moves it (the difference the docs state);
a touched row follows the optimizer's own rule (Adam against NumPy)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.models import sparse_updates

ROWS, WIDTH = 6, 3

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "amsgrad": lambda: keras.optimizers.Adam(0.05, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
}


def _table(seed: int = 0) -> keras.Variable:
    return keras.Variable(np.random.default_rng(seed).normal(size=(ROWS, WIDTH))
                          .astype("float32"))


def _rows(ids, seed) -> tf.IndexedSlices:
    values = np.random.default_rng(seed).normal(size=(len(ids), WIDTH)).astype("float32")
    return tf.IndexedSlices(tf.constant(values), tf.constant(ids, tf.int32),
                            tf.constant([ROWS, WIDTH]))


def _slots(optimizer) -> list[np.ndarray]:
    return [v.numpy() for v in optimizer.variables if len(v.shape) == 2]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_row_touched_every_step_is_the_dense_update(name):
    lazy_table, dense_table = _table(), _table()
    lazy = sparse_updates.lazy(OPTIMIZERS[name]())
    dense = OPTIMIZERS[name]()
    for step in range(4):
        ids = [0, 1, 2, 3, 4, 5, 2, 0]  # every row, two of them twice
        grad = _rows(ids, step)
        lazy.apply([grad], [lazy_table])
        dense.apply([tf.convert_to_tensor(grad)], [dense_table])  # summed per row
    np.testing.assert_allclose(lazy_table.numpy(), dense_table.numpy(), atol=1e-6)
    for a, b in zip(_slots(lazy), _slots(dense), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("name", ["adam", "adamw", "momentum", "rmsprop"])
def test_untouched_rows_and_their_slots_stay_where_the_dense_update_moves_them(name):
    lazy_table, dense_table = _table(), _table()
    lazy = sparse_updates.lazy(OPTIMIZERS[name]())
    dense = OPTIMIZERS[name]()
    for step, ids in enumerate([[0, 1, 2, 3, 4, 5], [1, 1, 3]]):
        grad = _rows(ids, step)
        lazy.apply([grad], [lazy_table])
        dense.apply([tf.convert_to_tensor(grad)], [dense_table])
        if step == 0:  # all rows touched: the same so far
            np.testing.assert_allclose(lazy_table.numpy(), dense_table.numpy(), atol=1e-6)
            before, slots_before = lazy_table.numpy(), _slots(lazy)
    untouched = [0, 2, 4, 5]
    np.testing.assert_array_equal(lazy_table.numpy()[untouched], before[untouched])
    for after, prior in zip(_slots(lazy), slots_before, strict=True):
        np.testing.assert_array_equal(after[untouched], prior[untouched])
    # The dense rule moves them (decaying moments, momentum, weight decay).
    assert np.abs(dense_table.numpy()[untouched] - before[untouched]).max() > 1e-4


def test_a_touched_row_follows_adams_rule():
    """Lazy Adam against NumPy: a row's moments and step, with the bias
    correction of the optimizer's global step (not the row's own count)."""
    table = _table()
    start = table.numpy()
    opt = sparse_updates.lazy(keras.optimizers.Adam(0.05, beta_1=0.9, beta_2=0.99,
                                                    epsilon=1e-7))
    m, v, x = np.zeros((ROWS, WIDTH)), np.zeros((ROWS, WIDTH)), start.astype(np.float64)
    for step, ids in enumerate([[1, 4], [4, 4, 5], [2]]):
        grad = _rows(ids, step)
        opt.apply([grad], [table])
        g = np.zeros((ROWS, WIDTH))
        np.add.at(g, ids, grad.values.numpy())
        touched = sorted(set(ids))
        t = step + 1
        m[touched] = 0.9 * m[touched] + 0.1 * g[touched]
        v[touched] = 0.99 * v[touched] + 0.01 * g[touched] ** 2
        alpha = 0.05 * np.sqrt(1 - 0.99 ** t) / (1 - 0.9 ** t)
        x[touched] -= alpha * m[touched] / (np.sqrt(v[touched]) + 1e-7)
    np.testing.assert_allclose(table.numpy(), x, atol=1e-5)


def test_dense_gradients_keep_the_optimizers_own_update():
    lazy_kernel, dense_kernel = _table(), _table()
    lazy, dense = sparse_updates.lazy(keras.optimizers.Adam(0.05)), keras.optimizers.Adam(0.05)
    grad = tf.constant(np.random.default_rng(3).normal(size=(ROWS, WIDTH)).astype("float32"))
    lazy.apply([grad], [lazy_kernel])
    dense.apply([grad], [dense_kernel])
    np.testing.assert_array_equal(lazy_kernel.numpy(), dense_kernel.numpy())


def test_an_optimizer_of_another_rule_is_refused_by_name():
    with pytest.raises(TypeError, match="takes Adam, SGD, Adagrad, RMSprop .* got Lion"):
        sparse_updates.lazy(keras.optimizers.Lion())
    opt = keras.optimizers.Adam()
    assert sparse_updates.lazy(opt) is opt and sparse_updates.is_lazy(opt)
    assert sparse_updates.lazy(opt) is opt  # once


def test_a_lazy_optimizer_saves_as_the_keras_class_it_is():
    opt = sparse_updates.lazy(keras.optimizers.Adam(0.01))
    config = keras.optimizers.serialize(opt)
    assert config["class_name"] == "Adam" and config["module"] == "keras.optimizers"


@pytest.mark.slow  # trains three times
def test_lazy_adam_trains_a_two_tower_model_alike_on_one_device_and_mirrored(tmp_path,
                                                                              monkeypatch):
    """`tfmulti.train(sparse_updates="lazy")`: 2 replicas' rows (a row seen by
    both summed) update the tables as one device's do; Adam's dense update
    trains to other weights (rows touched once keep moving); the model saved
    is plain Keras, its optimizer Keras' Adam."""
    import tfmulti
    from tfmulti.config.train_config import TrainConfig

    monkeypatch.setenv("TFMULTI_BENCH_EMBEDDING_ROWS", "5000")
    trained = {}
    for name, distribution, updates in (("one", "one_device", "lazy"),
                                        ("mirrored", "mirrored", "lazy"),
                                        ("dense", "one_device", "dense")):
        tfmulti.train(TrainConfig(
            model="benchmarks.embeddings:two_tower_model",
            dataset="benchmarks.embeddings:two_tower_data", num_examples=512,
            optimizer="adam", sparse_updates=updates, global_batch_size=64, epochs=1, seed=0,
            distribution=distribution,
            devices=("CPU:0", "CPU:1") if distribution == "mirrored" else None,
            verbose=0, model_dir=str(tmp_path / name)))
        trained[name] = keras.saving.load_model(tmp_path / name / "model.keras")
    for a, b in zip(trained["one"].get_weights(), trained["mirrored"].get_weights(),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    table = trained["one"].get_layer("user_table").embeddings.numpy()
    dense = trained["dense"].get_layer("user_table").embeddings.numpy()
    assert np.abs(table - dense).max() > 1e-4  # the lazy rule is not the dense one
    assert type(trained["mirrored"].optimizer) is keras.optimizers.Adam
    assert not sparse_updates.is_lazy(trained["mirrored"].optimizer)


def test_a_regularized_table_is_named_and_updates_densely():
    """A published recommender's tables (keras-io's collaborative filtering:
    `embeddings_regularizer=l2(1e-6)`): the regularizer's gradient covers every
    row, so the table's gradient arrives dense and takes the dense update;
    `dense_tables` names it, and why, for the line `tfmulti.train` prints."""
    ids = keras.Input((1,), dtype="int32")
    plain = keras.layers.Embedding(ROWS, WIDTH, name="items")(ids)
    regular = keras.layers.Embedding(ROWS, WIDTH, name="users",
                                     embeddings_regularizer=keras.regularizers.l2(1e-6))(ids)
    model = keras.Model(ids, keras.layers.Dot(axes=-1)([plain, regular]))
    model.compile(optimizer=sparse_updates.lazy(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(np.array([[1], [2]], np.int32), np.ones((2, 1, 1), np.float32), verbose=0)
    sparse = sparse_updates.sparse_variables(model.optimizer)
    keys = {layer.name: model.optimizer._var_key(layer.embeddings)  # pylint: disable=protected-access
            for layer in model.layers if isinstance(layer, keras.layers.Embedding)}
    assert keys["items"] in sparse and keys["users"] not in sparse
    assert sparse_updates.dense_tables(model) == ["users (embeddings_regularizer)"]
    constrained = keras.Sequential([keras.Input((1,), dtype="int32"), keras.layers.Embedding(
        ROWS, WIDTH, embeddings_constraint=keras.constraints.MaxNorm(1.0), name="t")])
    assert sparse_updates.dense_tables(constrained) == ["t (embeddings_constraint)"]


def test_the_run_says_which_tables_stay_dense(capsys):
    from tfmulti.training import run

    ids = keras.Input((1,), dtype="int32")
    table = keras.layers.Embedding(ROWS, WIDTH, name="movie_embedding",
                                   embeddings_regularizer=keras.regularizers.l2(1e-6))
    model = keras.Model(ids, table(ids))
    model.compile(optimizer="adam", loss="mse")
    run._lazy(model)  # pylint: disable=protected-access
    first, second = capsys.readouterr().out.strip().splitlines()
    assert first.startswith("tfmulti: sparse_updates=lazy: Adam updates only the rows")
    assert second.startswith("tfmulti: sparse_updates=lazy: table movie_embedding "
                             "(embeddings_regularizer) updates every row every step")


@pytest.mark.slow  # builds and trains two pipelines
def test_the_pipeline_updates_a_tables_rows_lazily(tmp_path):
    """Under the pipeline (2 stages, micro-batches, 2 accumulation rounds): the
    table's gradient reaches the optimizer as rows (the micro-batches' and
    rounds' rows, not summed into a dense table), and lazy SGD ends where
    dense SGD does (SGD leaves an untouched row alone either way)."""
    import tfmulti
    from tfmulti.parallel import zero
    from tfmulti.training import run as runs

    from tests.corpus import harness

    trained = {}
    for updates in ("dense", "lazy"):
        config = tfmulti.TrainConfig(
            distribution="pipeline", num_stages=2, accumulate_steps=2, optimizer="sgd",
            learning_rate=0.5,
            model_dir=str(tmp_path / updates),
            **harness.config_kwargs("masking_and_padding", sparse_updates=updates))
        run = runs.build_run(config)
        run.model.fit(run.train_input.dataset, steps_per_epoch=4, epochs=1, verbose=0)
        trained[updates] = run.model
    optimizer = zero.updating(trained["lazy"].optimizer)
    (table,) = [v for v in trained["lazy"].trainable_variables if "embedding" in v.path]
    assert optimizer._var_key(table) in sparse_updates.sparse_variables(optimizer)  # pylint: disable=protected-access
    for a, b in zip(trained["dense"].get_weights(), trained["lazy"].get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def _ids_model():
    ids = keras.Input((), dtype="int32")
    return keras.Model(ids, keras.layers.Dense(1)(keras.layers.Embedding(40, WIDTH)(ids)))


@pytest.mark.parametrize("devices", [None, ("CPU:0", "CPU:1")])
def test_accumulated_micro_batches_update_the_touched_rows_as_one_batch(devices):
    """`accumulate_steps=4` with lazy Adam: each micro-batch's table rows are
    gathered (never summed into a dense table) and applied once, as rows: the
    updates of batches of 4 x b rows, on one device and on 2 replicas (the
    lazy rule: rows a step did not touch keep still); the rows no example
    looked up are untouched."""
    from tfmulti.models import accumulation
    from tfmulti.runtime.strategy import get_strategy

    rng = np.random.default_rng(0)
    # Two steps: rows 0-19, then 0-9 (Adam's dense update would move rows 10-19 in
    # the second, from their moments); rows 20-39 never looked up.
    x = np.concatenate([rng.integers(0, 20, 32), rng.integers(0, 10, 32)]).astype("int32")
    y = rng.normal(size=(64, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    plain = _ids_model()
    plain.compile(optimizer=sparse_updates.lazy(keras.optimizers.Adam(0.05)), loss="mse")
    plain.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    # tfmulti's, whose collectives do not collide with other strategies' in this process
    strategy = get_strategy("mirrored", devices=devices) if devices else tf.distribute.get_strategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = _ids_model()
        before = model.layers[1].embeddings.numpy()
        model.compile(optimizer=sparse_updates.lazy(keras.optimizers.Adam(0.05)), loss="mse")
    accumulation.accumulate_gradients(model, 4)
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    table = model.layers[1].embeddings
    assert model.optimizer._var_key(table) in sparse_updates.sparse_variables(  # pylint: disable=protected-access
        model.optimizer)
    for a, b in zip(plain.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_array_equal(table.numpy()[20:], before[20:])
    assert np.abs(table.numpy()[:20] - before[:20]).max() > 1e-3


def test_lazy_updates_with_zero_are_refused_in_one_line():
    from tfmulti.config.train_config import TrainConfig

    with pytest.raises(ValueError, match="zero_stage=1 splits the slots") as refused:
        TrainConfig(sparse_updates="lazy", zero_stage=1, distribution="mirrored").validate()
    assert "\n" not in str(refused.value)
