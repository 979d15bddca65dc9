"""The user's Python loaders, as Keras' `fit` takes them: a `keras.utils.PyDataset`,
a generator function or any re-iterable object (read afresh every epoch), and a
generator read once (an endless stream, with `steps_per_epoch`).

`as_source` turns one into a `LoaderSource`: a `tfmulti.data.FileSource` whose
"files" are the loader's batches (a PyDataset's indices) or its one stream, so
that the loader takes tfmulti's input pipeline as files do: read in parallel
(a PyDataset's `workers`, in threads, or in processes with
`use_multiprocessing`), its batch order drawn anew every epoch from the run's
seed (as `fit(shuffle=True)` does), split into examples and grouped into
global batches, and under several workers each worker reading its own batches
(`sharding="batches"`: a PyDataset by index ranges, a generator the dataset
function made for its worker).

A loader's elements are batches (Keras' form) or single examples: a PyDataset's
are batches; an iterable's are examples when a part of its first element is a
scalar or the parts' first dimensions differ, else batches (`batched` says it
where that guess would be wrong). The element spec comes from the first
elements (float64 read as float32, as Keras computes), or is given
(`output_signature`); an empty loader, and one
whose elements change shape between batches, are refused in one line.

Example:
    >>> import numpy as np
    >>> import keras
    >>> from tfmulti.data import loaders
    >>> class Squares(keras.utils.PyDataset):
    ...     def __len__(self):
    ...         return 3
    ...     def __getitem__(self, i):
    ...         x = np.arange(4 * i, 4 * i + 4, dtype="float32")[:, None]
    ...         return x, x ** 2
    >>> source = loaders.as_source(Squares())
    >>> source.kind, source.batch_sizes, source.count()
    ('PyDataset', (4, 4), 12)
    >>> [int(x[0]) for x, y in source.dataset().as_numpy_iterator()][:6]
    [0, 1, 2, 3, 4, 5]
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import multiprocessing
import pickle
import threading
import types
import weakref

import numpy as np
import tensorflow as tf

from tfmulti.data.sources import FileSource, is_in_memory
from tfmulti.runtime import roles
from tfmulti.utils import human

__all__ = ["LoaderSource", "as_source", "close_pools", "is_loader"]

_PEEK = 2
"""Elements read ahead to learn a stream's spec (and check it keeps its shape)."""
_POOL_TIMEOUT_S = 600.0
"""The longest one batch may take in a loader's process pool before the run stops."""


def _py_dataset_class():
    import keras  # pylint: disable=import-outside-toplevel

    return keras.utils.PyDataset


def is_loader(value) -> bool:
    """Whether `value` is a loader `as_source` takes: a `keras.utils.PyDataset`,
    a generator function, a generator or other iterator, or a re-iterable
    object that is neither in-memory data (arrays, dicts, DataFrames, lists),
    a tensor, a `tf.data.Dataset`, text, nor a file source."""
    if isinstance(value, (tf.data.Dataset, FileSource, str, bytes, tf.Tensor, tf.Variable)) \
            or is_in_memory(value):
        return False
    if inspect.isgeneratorfunction(value):
        return True
    if isinstance(value, type):
        return False
    return hasattr(value, "__iter__") or hasattr(value, "__next__")


def _kind(loader) -> str:
    if isinstance(loader, _py_dataset_class()):
        return "PyDataset"
    if inspect.isgeneratorfunction(loader):
        return "generator function"
    if isinstance(loader, types.GeneratorType) or iter(loader) is loader:
        return "generator"  # read once
    return "iterable"


def _num_batches(py_dataset) -> int | None:
    try:
        count = py_dataset.num_batches
    except NotImplementedError:
        count = None
    if count is not None and (not isinstance(count, (int, np.integer)) or count < 0):
        raise ValueError(f"the PyDataset's length ({count!r}) is not a number of batches; "
                         "__len__ (or num_batches) must return an integer >= 0 (None for "
                         "an endless one).")
    return None if count is None else int(count)


def _standard(element, what: str) -> tuple:
    """An element in Keras' forms: a tuple (features[, labels[, weights]]),
    or features alone (a dict or an array) as a 1-tuple."""
    if isinstance(element, list):
        element = tuple(element)
    if isinstance(element, dict) or not isinstance(element, tuple):
        element = (element,)
    if not 1 <= len(element) <= 3:
        raise ValueError(f"{what} is a tuple of {len(element)}; Keras takes (features,), "
                         "(features, labels) or (features, labels, sample_weights).")
    return tuple(_arrays(part) for part in element)


def _arrays(part):
    """NumPy arrays in `part`'s structure (a dict, a tuple, or a list of
    arrays: several inputs), float64 as float32."""
    if isinstance(part, dict):
        return {str(k): _arrays(v) for k, v in part.items()}
    if isinstance(part, tuple) or (isinstance(part, list) and part and not np.isscalar(part[0])
                                   and not isinstance(part[0], (list, int, float))):
        return tuple(_arrays(p) for p in part)
    array = np.asarray(part)
    return array.astype(np.float32) if array.dtype == np.float64 else array


def _cast(element, spec):
    """`element`'s arrays in the spec's types (integers of another width, as
    one batch may hold int32 and the next int64)."""
    def one(array, s):
        if s.dtype == tf.string:
            return np.char.encode(array, "utf-8") if array.dtype.kind == "U" else array
        return array.astype(s.dtype.as_numpy_dtype, copy=False)
    return tf.nest.map_structure(one, element, spec if len(element) > 1 else (spec,))


def _spec(element, batched: bool):
    """The per-example spec of `element` (a standard tuple)."""
    def one(array):
        shape = array.shape[1:] if batched else array.shape
        dtype = tf.string if array.dtype.kind in "US" else tf.as_dtype(array.dtype)
        return tf.TensorSpec(shape, dtype)
    spec = tf.nest.map_structure(one, element)
    return spec if len(spec) > 1 else spec[0]


def _guess_batched(element) -> bool:
    """Batches, unless a part is a scalar or the parts' first sizes differ."""
    leaves = tf.nest.flatten(element)
    if any(leaf.ndim == 0 for leaf in leaves):
        return False
    return len({leaf.shape[0] for leaf in leaves}) == 1


def _given(signature, what: str):
    """The `output_signature` given, checked: every dimension known."""
    signature = tuple(signature) if isinstance(signature, list) else signature
    for s in tf.nest.flatten(signature):
        if not isinstance(s, tf.TensorSpec) or not s.shape.is_fully_defined():
            raise ValueError(f"{what}: output_signature gives {s!r}; give one example's "
                             "tf.TensorSpec per part with every dimension (tfmulti groups "
                             "examples into batches of one shape).")
    return signature


def _check_alike(spec, other, what: str, first: str, convert: bool = False) -> None:
    """Refuses `other` (a spec) whose structure or per-example shapes differ
    from `spec` (and types, unless `convert`: they are converted)."""
    try:
        tf.nest.assert_same_structure(spec, other)
    except (ValueError, TypeError):
        raise ValueError(f"{what} has other parts than {first}; every batch must have the "
                         "same structure (features, labels, weights).") from None
    for a, b in zip(tf.nest.flatten(spec), tf.nest.flatten(other)):
        if a.dtype != b.dtype and not convert and not (a.dtype.is_integer
                                                      and b.dtype.is_integer):
            raise ValueError(f"{what} holds {b.dtype.name} where {first} holds "
                             f"{a.dtype.name}; give every batch the same types.")
        if a.shape.rank != b.shape.rank or any(
                x != y for x, y in zip(a.shape.as_list(), b.shape.as_list())):
            dims = [i + 1 for i, (x, y) in enumerate(zip(a.shape.as_list(), b.shape.as_list()))
                    if x != y]
            where = f"dimension {dims[0]}" if dims else "its rank"
            raise ValueError(
                f"{what} has examples of shape {tuple(b.shape)} where {first} has "
                f"{tuple(a.shape)} ({where} varies: a ragged loader); tfmulti groups "
                "examples into global batches, so every example needs one shape: pad or "
                "crop them to one size in the loader.")


def _rows(element) -> int:
    return int(tf.nest.flatten(element)[0].shape[0])


def _unbatch_spec(spec):
    return tf.nest.map_structure(
        lambda s: tf.TensorSpec([None] + s.shape.as_list(), s.dtype), spec)


def _example_list(element, batched: bool) -> list:
    parts = element if len(element) > 1 else element[0]
    if not batched:
        return [parts]
    return [tf.nest.map_structure(lambda a, i=i: a[i], parts) for i in range(_rows(element))]


@dataclasses.dataclass(frozen=True)
class LoaderSource(FileSource):
    """A Python loader as a source of files (see the module doc): a PyDataset's
    "files" are its batch indices, a stream's its one stream.

    Attributes (beyond `FileSource`'s):
        loader: the user's object.
        kind: "PyDataset", "generator function", "iterable" or "generator"
            (read once).
        spec: one example's element spec.
        batched: whether the loader's elements are batches.
        batch_sizes: a PyDataset's first and last batch sizes.
        num_batches: a PyDataset's length (None: endless, or a stream).
        own_share: the loader yields this worker's own share (made for it by
            a dataset function taking `worker_index`).
        stride: (first, step) of an endless PyDataset's indices read here.
        head: the first elements read (standard tuples), replayed for a
            generator read once.
    """

    loader: object = None
    kind: str = "iterable"
    spec: object = None
    batched: bool = True
    batch_sizes: tuple = ()
    num_batches: int | None = None
    own_share: bool = False
    stride: tuple = (0, 1)
    head: tuple = dataclasses.field(default=(), repr=False, compare=False)
    _state: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "reader", self.read)  # this instance's (also after replace)

    @property
    def element_spec(self):
        if self.parse_fn is None:
            return self.spec
        empty = tf.data.Dataset.from_generator(lambda: iter(()), output_signature=self.spec)
        return empty.map(self.parse_fn).element_spec

    @property
    def per_worker(self) -> bool:
        """Each worker reads its own share: a stream made for it, or an
        endless PyDataset read by stride."""
        return self.own_share or (self.kind == "PyDataset" and self.num_batches is None)

    @property
    def endless(self) -> bool:
        """An epoch has no end: an endless PyDataset, or a generator read once."""
        return (self.kind == "PyDataset" and self.num_batches is None) or self.kind == "generator"

    def describe(self) -> str:
        """The loader in a few words, for the lines that talk about it."""
        name = type(self.loader).__name__ if self.kind == "PyDataset" else \
            getattr(self.loader, "__name__", type(self.loader).__name__)
        if self.kind == "PyDataset" and self.num_batches is not None:
            return (f"the PyDataset {name} ({human.count(self.num_batches, 'batch')} of "
                    f"{self.batch_sizes[0]})")
        return f"the {'endless PyDataset' if self.kind == 'PyDataset' else self.kind} {name}"

    def for_worker(self, role: roles.ClusterRole, own_share: bool = False) -> LoaderSource:
        """This source read by worker `role` (an endless PyDataset by its stride);
        `own_share`: the loader yields that worker's own share."""
        own = self.own_share or own_share
        return dataclasses.replace(
            self, own_share=own, stride=(0, 1) if own else (role.worker_index, role.num_workers))

    def reading(self, global_batch_size: int, per_replica: int) -> str:
        """One line: how the loader's elements become global batches."""
        into = (f"global batches of {global_batch_size} ({per_replica} per replica)")
        if not self.batched:
            return (f"{self.describe()} yields single examples, grouped into {into} (if they "
                    "are batches: tfmulti.data.from_loader(..., batched=True))")
        order = (", read in a new order every epoch" if self.kind == "PyDataset"
                 and self.num_batches else "")
        return (f"{self.describe()}: its batches are split into examples and grouped into "
                f"{into}{order}")

    def shard(self, index: int, count: int) -> tuple[str, ...]:
        """Worker `index` of `count`'s batches: a PyDataset's contiguous index
        range (sizes differ by at most one batch); a stream made for this
        worker, or an endless PyDataset read by stride, all of it."""
        if self.own_share or len(self.files) == 1:
            return self.files
        n = len(self.files)
        return self.files[index * n // count:(index + 1) * n // count]

    def count(self, files=None, progress=print) -> int:
        """The examples of `files` (default: all): a PyDataset's from its batch
        sizes (every batch full but the last), without reading; a stream's by
        reading it once.

        Raises:
            ValueError: an endless loader (it needs `steps_per_epoch`).
        """
        files = tuple(self.files if files is None else files)
        if self.endless:
            raise ValueError(f"{self.describe()} has no end, so an epoch has none; pass "
                             "steps_per_epoch (the steps of one epoch).")
        if self.kind == "PyDataset":
            last = str(self.num_batches - 1)
            return sum(self.batch_sizes[1] if name == last else self.batch_sizes[0]
                       for name in files)
        if progress is not None:
            progress(f"tfmulti: reading {self.describe()} once to count its examples (pass "
                     "steps_per_epoch to skip this; an endless one needs it)")
        return int(self.records(files).reduce(np.int64(0), tf.autograph.experimental
                                              .do_not_convert(lambda n, *_: n + 1)))

    def first_examples(self, count: int) -> list:
        """Up to `count` first examples (NumPy), from the elements already read."""
        return list(itertools.islice(
            (e for element in self.head for e in _example_list(element, self.batched)), count))

    def records(self, files=None, *, shuffle: bool = False, seed: int | None = None):
        """The loader's examples, one pass: `FileSource.records` over its
        batches, after the loader's epoch hooks (`on_epoch_end` of the pass
        before, `on_epoch_begin`) for a PyDataset."""
        records = super().records(files, shuffle=shuffle, seed=seed)
        if self.kind != "PyDataset":
            return records
        hooks = tf.data.Dataset.from_generator(self._epoch_hooks, output_signature=self.spec)
        return hooks.concatenate(records)

    def _epoch_hooks(self):
        """Runs as a pass starts (the pass before has been read whole: the
        stream repeats after it): the PyDataset's `on_epoch_end` of the pass
        before, its `on_epoch_begin`; processes of a fork server are started
        anew (`_pool`)."""
        state = self._state
        with state.setdefault("lock", threading.Lock()):
            if state.get("passes", 0):
                self.loader.on_epoch_end()
            state["passes"] = state.get("passes", 0) + 1
            self.loader.on_epoch_begin()
            if "payload" in state:  # processes of a fork server: anew, with the changes
                _close_pool(state)
        return iter(())

    # --------------------------------------------------------------------------- reading

    def read(self, name: tf.Tensor) -> tf.data.Dataset:
        """The examples of one "file": a PyDataset's batch (by index), or a
        stream."""
        if self.kind == "PyDataset" and self.num_batches is not None:
            # a NumPy function, not a generator: a batch read ahead and never
            # used (a pass's end) leaves nothing behind to finalize
            specs = tf.nest.flatten(self.spec)
            flat = tf.numpy_function(self._batch, [name], [s.dtype for s in specs],
                                     stateful=True)
            for tensor, s in zip(flat, specs):
                tensor.set_shape([None] + s.shape.as_list())
            return tf.data.Dataset.from_tensors(
                tf.nest.pack_sequence_as(self.spec, flat)).unbatch()
        signature = _unbatch_spec(self.spec) if self.batched else self.spec
        ds = tf.data.Dataset.from_generator(self._stream, output_signature=signature)
        return ds.unbatch() if self.batched else ds

    def _batch(self, name: bytes) -> list:
        index = int(name)
        batch = self._get(index)
        what = f"batch {index} of {self.describe()}"
        batch = _standard(batch, what)
        _check_alike(self.spec, _spec(batch, True), what, "batch 0", convert=True)
        rows = _rows(batch)
        full = self.batch_sizes[1] if index == self.num_batches - 1 else self.batch_sizes[0]
        if rows != full:
            raise ValueError(f"{what} has {rows} examples, batch 0 {self.batch_sizes[0]}; "
                             "tfmulti counts an epoch's examples from the first and last "
                             "batches: give every batch but the last the same size.")
        return tf.nest.flatten(_flat(_cast(batch, self.spec)))

    def _get(self, index: int):
        py = self.loader
        if not (py.use_multiprocessing and py.workers > 0):
            return py[index]
        pool = _pool(self._state, py)  # started before the first pass (`as_source`)
        try:
            return pool.apply_async(_get_served, (index,)).get(_POOL_TIMEOUT_S)
        except multiprocessing.TimeoutError:
            raise RuntimeError(f"the PyDataset's worker process gave no batch {index} in "
                               f"{_POOL_TIMEOUT_S:.0f} s; it may have died (out of memory?) "
                               "or hang.") from None

    def _stream(self):
        for number, element in enumerate(self._elements()):
            element = _standard(element, f"element {number} of {self.describe()}")
            if number < _PEEK:  # later ones are checked by tf.data against the spec
                _check_alike(self.spec, _spec(element, self.batched),
                             f"element {number} of {self.describe()}", "element 0",
                             convert=True)
            yield _flat(_cast(element, self.spec))

    def _elements(self):
        if self.kind == "PyDataset":  # endless: by stride
            first, step = self.stride
            return (self._get(i) for i in itertools.count(first, step))
        if self.kind == "generator":
            replay = self._state.setdefault("replay", list(self.head))
            stream = self._state["stream"]

            def once():
                while replay:
                    yield replay.pop(0)
                for element in stream:  # noqa: UP028 (`yield from` would close it at a pass's end)
                    yield element
            return once()
        return iter(self._state["make"]())


def _flat(element):
    return element if len(element) > 1 else element[0]


_SERVED = None
"""In a loader's process: the PyDataset it reads (`_serve`)."""


def _serve(py_dataset) -> None:
    global _SERVED
    _SERVED = pickle.loads(py_dataset) if isinstance(py_dataset, bytes) else py_dataset


def _get_served(index: int):
    return _SERVED[index]


def _pickled(py_dataset, what: str) -> bytes:
    """`py_dataset` pickled for processes of a fork server, or a ValueError
    saying why it cannot be."""
    name = type(py_dataset).__name__
    why = None
    if type(py_dataset).__module__ == "__main__":
        why = "its class is defined in the main script, which they do not run"
    else:
        try:
            return pickle.dumps(py_dataset)
        except Exception as e:  # pylint: disable=broad-except  (pickling raises many kinds)
            why = f"it cannot be pickled ({type(e).__name__}: {e})"
    raise ValueError(
        f"{what}: under several workers the PyDataset {name}'s processes "
        "(use_multiprocessing=True) are started by a fork server, not forked from the training "
        f"process (whose TensorFlow a fork copies mid-call), and get it pickled, but {why}; "
        "define it in a module (the dataset function's), keep what cannot be pickled (open "
        "files, locks, clients) out of its attributes, or use_multiprocessing=False.")


def _pool(state: dict, py_dataset):
    """The processes reading `py_dataset`.

    One process: forked (as Keras forks them, so it need not be pickled) once,
    before the first pass, and kept: what its `on_epoch_end` changes later does
    not reach them. Several workers: a fork copies TensorFlow mid-call (a
    collective in flight), and pools forked from the training process hung
    there (on 2 workers here, forked every pass: 4 runs in 7; forked once,
    before training: 1 in 12, under the test suite's load), so they come from
    a fork server, anew every pass, with the PyDataset
    pickled as it is then (`state["payload"]` says so), as Keras' own every
    epoch; its module is imported once, in the server."""
    with state.setdefault("lock", threading.Lock()):
        if state.get("pool") is None:
            if "payload" in state:
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload([type(py_dataset).__module__])
                payload = pickle.dumps(py_dataset)
                _SERVER["started"] = True
            else:
                context, payload = multiprocessing.get_context("fork"), py_dataset
            state["pool"] = context.Pool(py_dataset.workers, initializer=_serve,
                                         initargs=(payload,))
            # ended by `close_pools` (a run's end), with the PyDataset, or at exit
            state["finalizer"] = weakref.finalize(py_dataset, _terminate, state["pool"])
            _OPEN[id(state)] = state
        return state["pool"]


_SERVER = {"started": False}
"""Whether this process started the fork server of the loaders' processes."""
_OPEN: dict[int, dict] = {}
"""The loaders' states holding a process pool, by id."""


def _close_pool(state: dict) -> None:
    pool = state.pop("pool", None)
    _OPEN.pop(id(state), None)
    if pool is not None:
        state.pop("finalizer").detach()
        _terminate(pool)


def _terminate(pool) -> None:
    pool.terminate()
    pool.join()


def close_pools() -> None:
    """Ends the processes of every PyDataset read in this process, and their
    fork server (a run's end: they end with it)."""
    for state in list(_OPEN.values()):
        _close_pool(state)
    if _SERVER["started"]:  # it would wait, idle, for this process to end
        from multiprocessing import forkserver  # pylint: disable=import-outside-toplevel

        forkserver._forkserver._stop()  # pylint: disable=protected-access
        _SERVER["started"] = False


def _peek(iterator, what: str) -> list:
    head = list(itertools.islice(iterator, _PEEK))
    if not head:
        raise ValueError(f"{what} yielded no elements; give it some data.")
    return head


def as_source(loader, *, batched: bool | None = None, output_signature=None,
              own_share: bool = False, role: roles.ClusterRole | None = None,
              what: str = "the data") -> LoaderSource:
    """`loader` as a `LoaderSource` (see the module doc).

    Args:
        loader (keras.utils.PyDataset | Callable | Iterable): a
            `keras.utils.PyDataset`; a generator function (called anew
            every epoch: with no arguments, or with `worker_index` and
            `num_workers` where it takes them, when it yields that worker's
            share); a re-iterable object (`iter` anew every epoch); a generator
            or other iterator, read once.
        batched: whether a stream's elements are batches; default: guessed
            from the first element (a PyDataset's are always batches).
        output_signature (tf.TensorSpec | tuple | dict | None): one
            example's spec (`tf.TensorSpec`s in the
            elements' structure: features, labels, weights), every dimension
            given; default: read from the first element. The elements are
            converted to its types.
        own_share: the loader yields this worker's own share.
        role: this process's place in its cluster: an endless PyDataset is
            read by stride (worker k reads batches k, k + N, ...).
        what: the data's name in messages ("the dataset function's train data").

    Raises:
        ValueError: an empty loader, elements that are not Keras' forms, or
            examples whose shapes differ between elements.
    """
    role = role or roles.ClusterRole()
    kind = _kind(loader)
    state: dict = {}
    if kind == "PyDataset":
        num_batches = _num_batches(loader)
        if num_batches == 0:
            raise ValueError(f"{what}: the PyDataset {type(loader).__name__} has no batches "
                             "(its length is 0); give it some data.")
        indices = [0, 1] if num_batches is None else sorted({0, 1 % num_batches,
                                                            num_batches - 1})
        head = tuple(_standard(loader[i], f"{what}: batch {i} of the PyDataset")
                     for i in indices)
        batched, names = True, (tuple(str(i) for i in range(num_batches))
                                if num_batches is not None else ("stream",))
        sizes = (_rows(head[0]), _rows(head[-1]))
        stride = (0, 1) if own_share else (role.worker_index, role.num_workers)
        cycle = max(1, int(loader.workers))
    else:
        if kind == "generator":
            state["stream"] = iter(loader)
            elements = _peek(state["stream"], what)
        else:
            state["make"] = loader if kind == "generator function" else loader.__iter__
            taken = set(inspect.signature(loader).parameters) & {"worker_index", "num_workers"} \
                if kind == "generator function" else set()
            if taken:  # it yields the share of the worker it is given
                offered = {"worker_index": role.worker_index, "num_workers": role.num_workers}
                state["make"] = lambda: loader(**{name: offered[name] for name in taken})
                own_share = True
            elements = _peek(iter(state["make"]()), what)
        head = tuple(_standard(e, f"{what}: element {i}") for i, e in enumerate(elements))
        if batched is None:
            batched = _guess_batched(head[0])
        names, sizes, num_batches, stride, cycle = ("stream",), (), None, (0, 1), 1
    spec, first = _spec(head[0], batched), 1
    if output_signature is not None:
        spec, first = _given(output_signature, what), 0
    name = type(loader).__name__ if kind == "PyDataset" else getattr(loader, "__name__", "")
    for i, element in enumerate(head[first:], first):
        where = (f"batch {indices[i]} of the PyDataset {name}" if kind == "PyDataset"
                 else f"element {i} of the {kind} {name}".rstrip())
        _check_alike(spec, _spec(element, batched), f"{what}: {where}",
                     "output_signature" if first == 0 else "batch 0" if batched
                     else "element 0", convert=first == 0)
    if kind == "PyDataset" and loader.use_multiprocessing and loader.workers > 0:
        if role.num_workers > 1:  # from a fork server, every pass: it must pickle
            state["payload"] = _pickled(loader, what)
        else:
            _pool(state, loader)  # forked now, before anything trains
    return LoaderSource(files=names, cycle_length=cycle, loader=loader, kind=kind, spec=spec,
                        batched=batched, batch_sizes=sizes, num_batches=num_batches,
                        own_share=own_share, stride=stride, head=head, _state=state)
