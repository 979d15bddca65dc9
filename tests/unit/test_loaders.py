"""The user's input code as Keras' `fit` takes it: a `keras.utils.PyDataset`, generator
functions, re-iterable objects and generators read once, through
`tfmulti.data.distribute` and `tfmulti.train` (several workers:
tests/integration/test_loaders.py)."""

from __future__ import annotations

import math
import os
import re
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmulti
from tests import loader_data
from tfmulti.config.train_config import TrainConfig
from tfmulti.data import loaders, weights
from tfmulti.data.from_config import load_data
from tfmulti.runtime import roles


class Ids(keras.utils.PyDataset):
    """Example i is (i, i % 3), in batches of `size` (the last one shorter)."""

    def __init__(self, count=50, size=8, **kwargs):
        super().__init__(**kwargs)
        self.count, self.size = count, size

    def __len__(self):
        return math.ceil(self.count / self.size)

    def __getitem__(self, index):
        ids = np.arange(index * self.size, min((index + 1) * self.size, self.count))
        return ids[:, None].astype("float64"), ids % 3


def _ids(dist, steps) -> list[int]:
    iterator = iter(dist.dataset)
    return [int(i) for _ in range(steps) for i in next(iterator)[0].numpy()[:, 0]]


STRATEGY = None


def _one_device():
    global STRATEGY
    STRATEGY = STRATEGY or tfmulti.get_strategy("one_device")
    return STRATEGY


def test_a_pydataset_is_read_as_its_examples_counted_from_its_first_and_last_batch():
    source = loaders.as_source(Ids())
    assert (source.kind, source.batched, source.num_batches) == ("PyDataset", True, 7)
    assert source.batch_sizes == (8, 2) and source.count() == 50  # nothing read beyond 3 batches
    assert source.element_spec == (tf.TensorSpec((1,), tf.float32), tf.TensorSpec((), tf.int64))
    # worker k of N: a contiguous range of the indices, all of them once
    shares = [source.shard(k, 3) for k in range(3)]
    assert [len(s) for s in shares] == [2, 2, 3]
    assert sum(shares, ()) == source.files
    assert [source.count(s) for s in shares] == [16, 16, 18]
    assert source.first_examples(3)[2][0].tolist() == [2.0]


def test_every_example_of_a_pydataset_is_trained_once_per_epoch_in_a_new_order():
    dist = tfmulti.data.distribute(Ids(48), _one_device(), 16, seed=3)
    assert dist.steps_per_epoch == 3 and dist.repeat
    epochs = [_ids(dist, 3), _ids(dist, 3)]  # a new iterator starts again: the same epochs
    again = _ids(tfmulti.data.distribute(Ids(48), _one_device(), 16, seed=3), 6)
    assert sorted(epochs[0]) == list(range(48))
    iterator = iter(dist.dataset)
    first, second = ([int(i) for _ in range(3) for i in next(iterator)[0].numpy()[:, 0]]
                     for _ in range(2))
    assert sorted(second) == list(range(48)) and first != second  # each epoch its own order
    assert first + second == again  # the same seed, the same epochs


def test_the_last_partial_global_batch_waits_as_for_arrays():
    dist = tfmulti.data.distribute(Ids(50), _one_device(), 16, seed=0)
    assert dist.steps_per_epoch == 3  # 48 of 50 each epoch
    assert len(set(_ids(dist, 3))) == 48


@pytest.mark.parametrize("make, message", [
    (lambda: Ids(0), "has no batches (its length is 0)"),
    (lambda: iter(()), "yielded no elements"),
    (lambda: (lambda: (yield from ())), "yielded no elements"),
])
def test_an_empty_loader_is_refused_in_one_line(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        loaders.as_source(make())


def test_a_ragged_loader_is_refused_naming_the_dimension():
    class Ragged(Ids):
        def __getitem__(self, index):
            return np.zeros((8, 5 + index), "float32"), np.zeros(8, "int64")

    with pytest.raises(ValueError, match=r"batch 1 of the PyDataset Ragged has examples of shape "
                                         r"\(6,\) where batch 0 has \(5,\) \(dimension 1 "
                                         r"varies: a ragged loader\)"):
        loaders.as_source(Ragged(), what="the data")

    def sequences():
        for length in (3, 4):
            yield np.zeros(length, "float32"), 1

    with pytest.raises(ValueError, match=r"element 1 of the generator function sequences has "
                                         r"examples of shape \(4,\) where "
                                         r"element 0 has \(3,\)"):
        loaders.as_source(sequences)


def test_a_batch_of_another_size_in_the_middle_stops_reading_in_one_line():
    class Short(Ids):
        def __getitem__(self, index):
            x, y = super().__getitem__(index)
            return (x[:5], y[:5]) if index == 3 else (x, y)

    source = loaders.as_source(Short(64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="batch 3 of the PyDataset Short "
                       r"\(8 batches of 8\) has 5 examples, batch 0 8"):
        list(source.dataset().as_numpy_iterator())


def test_a_generator_s_elements_are_examples_or_batches_as_their_shapes_say():
    def examples():
        for i in range(40):
            yield np.full(3, i, "float32"), i % 2

    def batches():
        for i in range(5):
            yield np.full((8, 3), i, "float32"), np.arange(8) % 2

    assert not loaders.as_source(examples).batched
    assert loaders.as_source(batches).batched
    assert loaders.as_source(batches).count(progress=None) == 40
    # the guess overruled: 4 examples of 3 features, with 3 labels each
    sequences = [(np.zeros((3, 2), "float32"), np.zeros(3, "int64"))] * 4
    assert loaders.as_source(iter(sequences), batched=False).element_spec[0].shape == (3, 2)
    assert loaders.as_source(iter(sequences)).element_spec[0].shape == (2,)


def test_an_output_signature_given_sets_the_types_and_is_checked():
    def pairs():
        for i in range(8):
            yield np.full(3, i), i  # int64 features

    given = (tf.TensorSpec((3,), tf.float32), tf.TensorSpec((), tf.int32))
    source = loaders.as_source(pairs, output_signature=given)
    assert source.element_spec == given
    x, y = next(source.dataset().as_numpy_iterator())
    assert x.dtype == np.float32 and y.dtype == np.int32 and x.tolist() == [0.0] * 3
    with pytest.raises(ValueError, match=r"element 0 of the generator function pairs has "
                                         r"examples of shape \(3,\) where output_signature "
                                         r"has \(4,\)"):
        loaders.as_source(pairs, output_signature=(tf.TensorSpec((4,)), given[1]))
    with pytest.raises(ValueError, match="output_signature gives .* every dimension"):
        loaders.as_source(pairs, output_signature=(tf.TensorSpec((None,)), given[1]))


def test_a_generator_function_and_an_iterable_are_read_afresh_every_epoch():
    class Numbers:  # re-iterable: a new iterator each time
        def __iter__(self):
            return ((np.float32(i), i % 2) for i in range(32))

    def numbers():
        yield from ((np.float32(i), i % 2) for i in range(32))

    for loader in (Numbers(), numbers):
        dist = tfmulti.data.distribute(loader, _one_device(), 8, seed=1)
        assert dist.steps_per_epoch == 4  # counted once, with a line
        iterator = iter(dist.dataset)
        epochs = [sorted(float(v) for _ in range(4) for v in next(iterator)[0].numpy())
                  for _ in range(2)]
        assert epochs[0] == epochs[1] == list(range(32))


def test_a_generator_read_once_needs_steps_per_epoch_and_streams_on():
    def endless():
        i = 0
        while True:
            yield np.float32(i), i % 2
            i += 1

    with pytest.raises(ValueError, match=r"the generator endless has no end, so an epoch has "
                                         "none; pass steps_per_epoch"):
        tfmulti.data.distribute(endless(), _one_device(), 8)
    dist = tfmulti.data.distribute(endless(), _one_device(), 8, steps_per_epoch=2)
    iterator = iter(dist.dataset)
    seen = [int(v) for _ in range(6) for v in next(iterator)[0].numpy()]
    assert seen[:16] == list(range(16))  # in its order, its first ones kept
    assert seen == sorted(set(seen))  # never restarted


def test_a_generator_function_taking_the_worker_gets_it_and_yields_that_share():
    def share(worker_index, num_workers):
        for i in range(worker_index, 40, num_workers):
            yield np.float32(i), i % 2

    role = roles.ClusterRole("worker", 1, 1, 2, False)
    source = loaders.as_source(share, role=role)
    assert source.own_share and source.shard(1, 2) == source.files
    assert sorted(float(x) for x, _ in source.dataset().as_numpy_iterator()) == list(
        range(1, 40, 2))


def test_processes_under_several_workers_need_a_pydataset_that_pickles():
    role = roles.ClusterRole("worker", 0, 0, 2, True)

    class Locked(Ids):  # defined in a function: no module can find it
        def __init__(self):
            super().__init__(workers=2, use_multiprocessing=True)
            self.lock = threading.Lock()

    with pytest.raises(ValueError, match=r"the data: under several workers the PyDataset "
                                         r"Locked's processes \(use_multiprocessing=True\) "
                                         r"are started by a fork server.*but it cannot be "
                                         r"pickled"):
        loaders.as_source(Locked(), role=role)
    Locked.__module__ = "__main__"
    with pytest.raises(ValueError, match="its class is defined in the main script"):
        loaders.as_source(Locked(), role=role)
    # one process: forked, nothing pickled
    source = loaders.as_source(Locked())
    assert len(list(source.dataset().as_numpy_iterator())) == 50
    loaders.close_pools()


def test_class_weights_weigh_a_pydataset_s_examples():
    source = weights.with_class_weights(loaders.as_source(Ids(24)), {0: 1.0, 1: 5.0, 2: 2.0})
    assert len(source.element_spec) == 3
    got = {int(y): float(w) for _, y, w in source.dataset().as_numpy_iterator()}
    assert got == {0: 1.0, 1: 5.0, 2: 2.0}


def test_the_pydataset_s_epoch_hooks_run_as_each_pass_starts():
    calls = []

    class Hooked(Ids):
        def on_epoch_begin(self):
            calls.append("begin")

        def on_epoch_end(self):
            calls.append("end")

    dataset = loaders.as_source(Hooked(16)).dataset()
    for _ in range(2):
        assert len(list(dataset.as_numpy_iterator())) == 16
    assert calls == ["begin", "end", "begin"]


# ----------------------------------------------------------------- from a dataset function


def _config(dataset, **options) -> TrainConfig:
    return TrainConfig(dataset=dataset, model="tests.loader_data:model", **options)


def test_a_dataset_function_s_pydataset_is_checked_like_arrays_before_training():
    run_data = load_data(_config("tests.loader_data:pydataset"))
    assert isinstance(run_data.train, loaders.LoaderSource)
    assert run_data.task == "classification" and run_data.input_shape == (16,)
    assert len(run_data.samples["training"]) == 3 * loader_data.BATCH  # the batches read


def test_what_a_loader_cannot_do_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "bad_loaders.py").write_text(
        "import numpy as np\n"
        "def per_worker_arrays(worker_index):\n"
        "    return np.zeros((8, 2), 'float32'), np.zeros(8, 'int64')\n"
        "def once_for_validation():\n"
        "    data = ((np.zeros(2, 'float32'), 0) for _ in range(8))\n"
        "    return {'train': (np.zeros((8, 2), 'float32'), np.zeros(8, 'int64')),\n"
        "            'test': None, 'validation': data}\n")
    with pytest.raises(ValueError, match="takes worker_index, so its training data is taken "
                                         "as that worker's share"):
        load_data(_config("bad_loaders:per_worker_arrays"))
    with pytest.raises(ValueError, match="validation data: the generator <genexpr> is read once"):
        load_data(_config("bad_loaders:once_for_validation"))
    with pytest.raises(ValueError, match=r"`validation_split` \(0.2\) holds out the last "
                                         "examples of the training data, but the training "
                                         "data is the PyDataset Blobs"):
        load_data(_config("tests.loader_data:pydataset", validation_split=0.2))


TRAINING = dict(global_batch_size=64, epochs=2, seed=0, learning_rate=0.01, verbose=0)
"""The loaders' trainings and their reference's."""


@pytest.fixture(scope="module")
def arrays_reference():
    """The loaders' examples given as arrays, trained once for the module."""
    return tfmulti.train(_config("tests.loader_data:arrays", **TRAINING))


@pytest.mark.slow
@pytest.mark.parametrize("dataset, options", [
    ("tests.loader_data:pydataset", {}),
    pytest.param("tests.loader_data:pydataset_threads", {}, id="threads-validation"),
    pytest.param("tests.loader_data:pydataset_processes", {}, id="processes"),
    ("tests.loader_data:endless_examples", {"steps_per_epoch": 16}),
    pytest.param("tests.loader_data:pydataset", {"distribution": "pipeline", "num_stages": 2},
                 id="pipeline"),
    pytest.param("tests.loader_data:pydataset", {"distribution": "hybrid", "num_replicas": 2,
                                                 "num_stages": 2, "num_virtual_devices": 4},
                 id="hybrid"),
])
def test_a_loader_trains_as_its_examples_given_as_arrays(dataset, options, arrays_reference,
                                                        capsys):
    reference = arrays_reference
    options = {"distribution": "mirrored", "num_virtual_devices": 2, **options}
    capsys.readouterr()  # the reference's lines, where this test trained it
    children = set(os.listdir("/proc"))
    metrics = tfmulti.train(_config(dataset, **TRAINING, **options))
    assert metrics["test_accuracy"] == pytest.approx(reference["test_accuracy"], abs=0.05)
    assert reference["test_accuracy"] > 0.8
    out = capsys.readouterr().out
    if "endless" in dataset:
        assert metrics["steps_per_epoch"] == 16
        assert ("the generator examples yields single examples, grouped into global batches "
                "of 64") in out
    else:
        assert "its batches are split into examples and grouped into global batches" in out
    if "validation" in str(options) or "threads" in dataset:
        assert metrics["val_accuracy"] > 0.8
    # a PyDataset's worker processes end with the run
    assert not [p for p in set(os.listdir("/proc")) - children if _is_my_child(p)]


def _is_my_child(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return f"PPid:\t{os.getpid()}\n" in status.read()
    except OSError:  # not a process, or one that ended
        return False


def test_diagnose_advises_the_pydataset_s_own_workers_when_the_input_is_the_bottleneck():
    from types import SimpleNamespace

    from tfmulti.insight import diagnose

    times = SimpleNamespace(fit_s=0.005, compute_s=0.001, input_s=0.005)
    for loader, how in ((Ids(), "more of the PyDataset's own workers (now workers=1): "
                                "workers=N, with use_multiprocessing=True"),
                        (None, "a cheaper or vectorized map")):
        train = loaders.as_source(loader) if loader is not None else tf.data.Dataset.range(4)
        stub = SimpleNamespace(pipeline={"batch_map_fn": None},
                               first=SimpleNamespace(train_data=train))
        advice = []
        diagnose._Diagnoser.advise_input(stub, SimpleNamespace(times=times), advice, False)
        assert advice[-1].how.startswith(how) and advice[-1].expected_gain == pytest.approx(5)
