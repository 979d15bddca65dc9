"""Tests for `shard_embeddings` (tfmulti.parallel.zero's tables sharded by
rows): each replica holds ceil(rows / N) rows of every Embedding table and
their optimizer slots, a lookup goes to the rows' owners and back, and the run
trains to the weights of the unsharded one; its saves and backups are the
unsharded model's.

Keras' own `fit` under `MirroredStrategy` over the 4 test devices, the
two-tower model of `tests.tables` (tables of 1001 and 37 rows: they do not
split evenly in 4). On 2 workers: tests/integration/test_shard_embeddings.py."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

import tfmulti
from tests.tables import ITEMS, USERS, WIDTH, clicks, two_tower
from tests.unit.test_zero import DEVICES, EXACT, _assert_same_weights
from tfmulti.parallel import zero
from tfmulti.runtime.strategy import get_strategy


def _fit(stage: int, tables: bool, monkeypatch=None):
    """`two_tower` trained 2 epochs by `fit` on the 4 devices, its optimizer
    sharded at `stage` and, where `tables`, its tables by rows: (model,
    the tables' whole gathers in the steps' traces)."""
    strategy = get_strategy("mirrored", devices=DEVICES)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = two_tower()
    layers = [layer for layer in model.layers if isinstance(layer, keras.layers.Embedding)]
    zero.shard_optimizer(model.optimizer, model.trainable_variables, strategy, stage,
                         model=model, tables=layers if tables else ())
    gathered = []
    if monkeypatch is not None:
        gather = zero._gather_parameter
        monkeypatch.setattr(zero, "_gather_parameter", lambda shards, variable, *rest: (
            gathered.append(variable.path), gather(shards, variable, *rest))[1])
    features, labels = clicks()["train"]
    model.fit(features, labels, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return model, gathered


@pytest.fixture(scope="module")
def unsharded():
    return _fit(0, tables=False)[0]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_tables_sharded_by_rows_train_to_the_unsharded_weights(stage, unsharded, monkeypatch):
    """At any stage, the tables split by rows: the weights of the unsharded
    run; each device holds ceil(rows / 4) rows of each table (its parameters
    and Adam's two moments of them), and no step gathers a table whole (the
    lookups are routed; at stage 3 the dense layers' parameters are
    gathered, as without tables)."""
    model, gathered = _fit(stage, tables=True, monkeypatch=monkeypatch)
    _assert_same_weights(model, unsharded)
    tables = {"users/embeddings", "items_table/embeddings"}
    assert not tables & set(gathered), gathered
    assert bool(gathered) == (stage == 3)
    sharding = zero.sharding_of(model.optimizer)
    rows = math.ceil(USERS / 4) + math.ceil(ITEMS / 4)
    dense = sum(v.numpy().size for v in model.trainable_variables
                if not v.path.endswith("embeddings"))
    held_dense = math.ceil(dense / 4) if stage == 3 else dense
    # (stage 3 pads each dense variable's last shard: at most a few elements per variable)
    per_device = sharding.parameter_bytes_by_device()
    assert len(per_device) == 4
    for held in per_device.values():
        assert 4 * (rows * WIDTH + held_dense) <= held <= 4 * (rows * WIDTH + held_dense + 8)
    slots = sharding.bytes_by_device()
    whole_slots = 2 * 4 * (USERS + ITEMS) * WIDTH
    for held in slots.values():  # Adam's two moments, and the copy's step and rate
        assert 2 * 4 * rows * WIDTH <= held < whole_slots / 2


@pytest.mark.slow
def test_shard_embeddings_through_train_saves_an_ordinary_model(unsharded, tmp_path, capsys,
                                                                monkeypatch):
    """`tfmulti.train(shard_embeddings=True)`, mirrored x 2: said in one line
    naming the tables, the test loss of the unsharded run, and `model.keras`
    an ordinary model (its tables whole) that loads on one device with its
    optimizer's slots whole; Keras' writer is handed the tables and the slots
    without a copy (its `np.array` of them is them, not a new array)."""
    from keras.src.saving import saving_lib  # pylint: disable=import-outside-toplevel

    handed = {}
    setitem = saving_lib.H5IOStore.__setitem__

    def recording(store, key, value):
        if np.shape(np.array(value)) in ((USERS, WIDTH), (ITEMS, WIDTH)):
            path = f"{store._h5_entry_path}/{key}"  # pylint: disable=protected-access
            handed[path] = np.shares_memory(np.array(value), np.array(value))
        setitem(store, key, value)

    monkeypatch.setattr(saving_lib.H5IOStore, "__setitem__", recording)

    def run(name, tables):
        handed.clear()
        metrics = tfmulti.train(tfmulti.TrainConfig(
            distribution="mirrored", devices=DEVICES[:2], model=two_tower, dataset=clicks,
            global_batch_size=32, epochs=2, shard_embeddings=tables, verbose=0,
            model_dir=str(tmp_path / name)))
        return metrics, keras.models.load_model(tmp_path / name / "model.keras")

    whole, whole_model = run("whole", False)
    assert len(handed) == 6 and not any(handed.values()), handed  # Keras' own: copies
    capsys.readouterr()
    sharded, model = run("sharded", True)
    assert len(handed) == 6 and all(handed.values()), handed  # 2 tables, 4 slots
    said = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("tfmulti: shard_embeddings")]
    assert said == ["tfmulti: shard_embeddings: items_table (37 x 8), users (1,001 x 8) split by "
                    "rows over 2 replicas (1/2 of the rows and their slots on each; lookups go "
                    "to the rows' owners)"], said
    assert sharded["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-5)
    _assert_same_weights(model, whole_model)
    assert model.get_layer("users").embeddings.shape == (USERS, WIDTH)
    for a, b in zip(model.optimizer.variables, whole_model.optimizer.variables, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=EXACT)
    dense = sum(w.size for w in model.get_weights()) - (USERS + ITEMS) * WIDTH
    rows = math.ceil(USERS / 2) + math.ceil(ITEMS / 2)
    assert set(sharded["parameter_bytes"].values()) == {4 * (rows * WIDTH + dense)}


@pytest.mark.slow
def test_a_sharded_backup_resumes_on_another_number_of_replicas(tmp_path):
    """A backup of tables sharded over 4 replicas holds them whole: resumed on
    2 replicas (sharded again, in halves), the run ends where the unsharded
    backup resumed on 2 ends, the optimizer's state included."""
    def train(name, tables, devices, epochs, backup):
        tfmulti.train(tfmulti.TrainConfig(
            distribution="mirrored", devices=devices, model=two_tower, dataset=clicks,
            global_batch_size=32, epochs=epochs, shard_embeddings=tables, verbose=0,
            backup_dir=str(tmp_path / backup), keep_backup=epochs == 1,
            model_dir=str(tmp_path / name)))
        return keras.models.load_model(tmp_path / name / "model.keras")

    resumed = {}
    for tables in (False, True):
        train(f"{tables}-first", tables, DEVICES, 1, f"backup{tables}")
        resumed[tables] = train(f"{tables}-then", tables, DEVICES[:2], 2, f"backup{tables}")
    _assert_same_weights(resumed[True], resumed[False])
    for a, b in zip(resumed[True].optimizer.variables, resumed[False].optimizer.variables,
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=EXACT)


@pytest.mark.parametrize("settings,words", [
    ({"distribution": "pipeline", "num_stages": 2},
     r"^`shard_embeddings` splits the tables' rows over data-parallel replicas: distribution "
     r"'mirrored' or 'multi_worker', got 'pipeline'"),
    ({"sparse_updates": "lazy"}, r"^`sparse_updates` 'lazy' and `shard_embeddings` cannot be "),
    ({"accumulate_steps": 2}, r"^`shard_embeddings` routes each lookup through the replicas "),
], ids=["pipeline", "lazy", "accumulation"])
def test_the_configuration_refuses_what_shard_embeddings_cannot_take(settings, words):
    with pytest.raises(ValueError, match=words):
        tfmulti.TrainConfig(shard_embeddings=True, **settings).validate()


@pytest.mark.parametrize("option", ["clipnorm", "global_clipnorm", "use_ema"])
def test_what_reads_a_table_or_its_gradient_whole_is_refused(option):
    strategy = get_strategy("mirrored", devices=DEVICES)
    with strategy.scope():
        model = two_tower()
    optimizer = keras.optimizers.Adam(**{option: True if option == "use_ema" else 1.0})
    with pytest.raises(ValueError, match=rf"^shard_embeddings cannot shard Adam with {option}="
                                         r".*; leave \w+ unset, or use shard_embeddings=False\.$"):
        zero.shard_optimizer(optimizer, model.trainable_variables, strategy, 0,
                             tables=[model.get_layer("users")])


def test_a_layer_that_is_not_an_embedding_is_refused():
    strategy = get_strategy("mirrored", devices=DEVICES)
    with strategy.scope():
        model = two_tower()
    dense = next(layer for layer in model.layers if isinstance(layer, keras.layers.Dense))
    with pytest.raises(ValueError, match=r"^shard_embeddings routes an Embedding's lookups .* "
                                         r"\w+ \(Dense\) is not a keras.layers.Embedding"):
        zero.shard_optimizer(model.optimizer, model.trainable_variables, strategy, 0,
                             tables=[dense])
