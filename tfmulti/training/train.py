"""One training run from a config: the engine behind `tfmulti train` and `recipes/train.py`.

Everything that can be checked is checked before anything is written, so a bad
configuration leaves `model_dir` untouched. `model_dir` belongs to one run
(`tfmulti.training.outputs`): a folder holding another run's outputs is refused
unless `overwrite`, which replaces only the files a tfmulti run recorded as its
own, and only once the new run publishes: its outputs are written into a
private staging folder, synced, and renamed into place with `metrics.json`
last, so a crash never pairs new metrics with an old model, and a failed or
killed run leaves the previous outputs in place.

Example:
    >>> from tfmulti.config.train_config import TrainConfig
    >>> from tfmulti.training.train import train
    >>> metrics = train(TrainConfig(dataset="synthetic", num_examples=2048, epochs=1,
    ...                             global_batch_size=64, verbose=0))  # doctest: +ELLIPSIS
    tfmulti: ...
    >>> metrics["epochs_completed"], "test_accuracy" in metrics
    (1, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import statistics
import sys
import warnings

import keras
import tensorflow as tf

from tfmulti.config import keras_forms
from tfmulti.config import user_functions as hooks
from tfmulti.config.train_config import TrainConfig, parse_profile_steps
from tfmulti.data import checks as data_checks
from tfmulti.data import loaders
from tfmulti.data import service as data_service
from tfmulti.data.from_config import dataset_metrics
from tfmulti.memory import estimate as memory
from tfmulti.memory import footprint
from tfmulti.models import builders as models
from tfmulti.models import own_fit, rebuild
from tfmulti.parallel import tensor_models, zero
from tfmulti.runtime import roles
from tfmulti.runtime import strategy as strategy_lib
from tfmulti.training import backup, compiling, outputs
from tfmulti.training import run as runs
from tfmulti.training.callbacks import (EpochTimer, ProfileSteps, StopOnNonFiniteLoss,
                                        WatchService)
from tfmulti.training.outputs import MODEL_FILES, OUTPUTS
from tfmulti.utils.atomic import write_json_atomic
from tfmulti.utils.failpoints import failpoint

__all__ = ["OUTPUTS", "train"]

# How long the other workers wait for the chief to say whether the run has finished
# (it reads its metrics.json; the workers start together).
_FINISHED_WAIT_S = 300.0
MODEL_FILE, WEIGHTS_FILE = MODEL_FILES
# Fields that may differ between a run and its resumption.
# (TensorBoard and the profile only watch the run; the user's callbacks may change it.)
_RESUMABLE_CHANGES = ("verbose", "overwrite", "keep_backup", "discard_unreadable_backup",
                      "tensorboard", "profile_steps")


def _identity(config: TrainConfig) -> dict:
    """The configuration as JSON, without the fields a rerun may change (and
    `callbacks` only when set: the run file of a run without them, also one
    an earlier tfmulti wrote, stays the same)."""
    return {f.name: keras_forms.plain(getattr(config, f.name)) for f in dataclasses.fields(config)
            if f.name not in _RESUMABLE_CHANGES
            and not (f.name == "callbacks" and config.callbacks is None)}


def _claim_model_dir(config: TrainConfig) -> bool:
    """Makes `model_dir` this run's (`tfmulti.training.outputs.claim`; its
    `backup_dir` may be a folder in it); returns whether this same run has
    published its outputs there already."""
    backup_dir = os.path.abspath(config.backup_dir) if config.backup_dir else None
    inside = backup_dir and os.path.dirname(backup_dir) == os.path.abspath(config.model_dir)
    return outputs.claim(config.model_dir, _identity(config), overwrite=config.overwrite,
                         resumable=bool(config.backup_dir),
                         own=(os.path.basename(backup_dir),) if inside else ())


def _published_metrics(model_dir: str) -> dict | None:
    """The metrics.json of a run whose outputs (metrics.json and the model:
    model.keras or model.weights.h5) are published in `model_dir`, else None."""
    if outputs.published_model(model_dir) is None:
        return None
    try:
        with open(os.path.join(model_dir, "metrics.json")) as f:
            metrics = json.load(f)
    except (OSError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) else None


def _finished_run(config: TrainConfig, role, published: bool) -> dict | None:
    """The metrics of a resumable run (`backup_dir`) that has already published its
    outputs, else None: such a run is not trained again when it restarts (a launcher's
    restart after a kill at its exit, a requeued job, the same command run twice). Every
    worker takes the chief's finding (`published`: `_claim_model_dir` found this run's
    outputs in model_dir); the chief finishes removing the backup, which the kill may
    have interrupted (unless `keep_backup`).

    Raises:
        RuntimeError: the chief did not share its finding within `_FINISHED_WAIT_S`.
    """
    if not config.backup_dir:
        return None
    found = _published_metrics(config.model_dir) if published else None
    metrics = json.loads(roles.all_gather_text("finished run", json.dumps(found), role,
                                               _FINISHED_WAIT_S)[0])
    if metrics is None:
        return None
    model_file = outputs.published_model(config.model_dir) if published else None
    files = f"metrics.json, {model_file}" if model_file else "metrics.json and the model"
    print(f"tfmulti: this run has finished already: its outputs are in {config.model_dir} "
          f"({files}); nothing left to train (overwrite=True, --overwrite, "
          "trains it again)", flush=True)
    if published and not config.keep_backup:
        backup.delete(config.backup_dir)
    return metrics


def _unpartitioned(config: TrainConfig, model):
    """What the run saves: a pipeline's model unpartitioned (the user's own
    model, whose layers it trains: a plain Keras model anyone can load)."""
    if not config.model_parallel:
        return model
    unpartitioned = model.to_model(name=config.model if config.builtin_model else None)
    model.give_optimizer_state(unpartitioned)  # a model compiled by its model function
    if config.tensor_parallel > 1 and not config.builtin_model:
        # The user's model split by `split_layers`: saved joined, so that its
        # weights load into the model the user's function builds.
        unpartitioned = tensor_models.join_layers(unpartitioned, print_fn=lambda line: None)
    return unpartitioned


def _say_if_weights_only(config: TrainConfig, model) -> None:
    """Before training: one line when the model would not load back from a
    model.keras (`tfmulti.models.rebuild.rebuild_problem`), so that the user
    can fix it and restart before spending the training time."""
    # A pipeline's stages may be built from the first batch: what it was given.
    problem = rebuild.rebuild_problem(model.given if config.model_parallel else model)
    if problem:
        print(f"tfmulti: this run will save the model's weights only ({WEIGHTS_FILE}, not "
              f"{MODEL_FILE}): {problem}; to save it whole, in its class, {rebuild.FIX}, "
              "then restart", flush=True)


def _write_outputs(config: TrainConfig, model, metrics: dict) -> str:
    """Publishes metrics.json and the model: model.keras, or where that would
    not load back (or saving it raises), the weights, model.weights.h5, with
    one line naming the cause, the file and how to reload it. Returns the
    model's file name."""
    unpartitioned = _unpartitioned(config, model)
    _mark_built_by_its_layers(unpartitioned)
    problem = rebuild.rebuild_problem(unpartitioned)
    why = f"{MODEL_FILE} would not load back"

    def write(stage: str) -> None:
        write_json_atomic(os.path.join(stage, "metrics.json"), metrics, sort_keys=True)
        if problem:
            unpartitioned.save_weights(os.path.join(stage, WEIGHTS_FILE))
            return
        try:
            with _weights_through_a_file():
                unpartitioned.save(os.path.join(stage, MODEL_FILE))
        except OSError:
            raise
        except Exception as e:  # pylint: disable=broad-except  (a config the probe passed)
            raise _NotSaved(e) from e

    try:
        outputs.publish(config.model_dir, _identity(config), write,
                        model_file=WEIGHTS_FILE if problem else MODEL_FILE)
    except _NotSaved as e:  # nothing was published: the weights instead
        why = f"{MODEL_FILE} could not be written"
        problem = f"saving it raised {type(e.error).__name__} ({rebuild.cause(e.error)})"
        outputs.publish(config.model_dir, _identity(config), write, model_file=WEIGHTS_FILE)
    if not problem:
        return MODEL_FILE
    path = os.path.join(config.model_dir, WEIGHTS_FILE)
    print(f"tfmulti: saved the model's weights only, to {path} ({why}: {problem}); "
          f"to reload them, build the model with the run's model function "
          f"({config.model_name}), then call model.load_weights({path!r})", flush=True)
    return WEIGHTS_FILE


@contextlib.contextmanager
def _weights_through_a_file():
    """Keras writes a `.keras` file's weights into memory first where it deems
    the memory enough (`saving_lib.is_memory_sufficient`), then copies them
    into the archive: at the end of a run, the whole file twice in memory (a
    model of 54M parameters with Adam: 1.3 GB). Its other way, for machines
    short of memory, writes them to a file beside the archive and copies that
    in: tfmulti takes it, so that a run's peak memory is its training's, not
    its save's (what sharding the optimizer lowers, `zero_stage`)."""
    from keras.src.saving import saving_lib  # pylint: disable=import-outside-toplevel

    original = getattr(saving_lib, "is_memory_sufficient", None)
    if original is None:  # another Keras: its own way
        yield
        return
    saving_lib.is_memory_sufficient = lambda model: False
    try:
        yield
    finally:
        saving_lib.is_memory_sufficient = original


def _mark_built_by_its_layers(model) -> None:
    """A model whose own `train_step` trains its parts and never calls it (a
    GAN without `call`) is never marked built, though all its layers are:
    Keras then refuses to save its weights. It is marked built, as its
    author does by hand (`model.built = True`) to save it."""
    layers = getattr(model, "layers", None)
    if not model.built and layers and all(layer.built for layer in layers):
        model.built = True


class _NotSaved(Exception):
    """Saving the whole model raised (not for want of room or permission)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def train(config: TrainConfig, callbacks=()) -> dict:
    """Trains, evaluates on the test split, and writes results to `model_dir`.

    Writes `<model_dir>/metrics.json`, `<model_dir>/model.keras` (or, for a
    model that would not load back from it, `<model_dir>/model.weights.h5`,
    said before training) and TensorBoard
    logs under `<model_dir>/logs` (when `model_dir` is set, unless
    `tensorboard` is off; with `profile_steps`, a profile of those steps
    there too), published together
    at the end: the logs wait in `<model_dir>/.tfmulti-pending/logs` meanwhile,
    and the outputs of the run they replace (`overwrite`) stay until then. In a
    multi-worker cluster only the chief (by the strategy's cluster resolver:
    TF_CONFIG, SLURM, ...) writes and shows progress; the others write nothing.
    `config.callbacks`, the user's function, is called on every worker before
    anything is written (its callbacks create their files once training begins).

    Args:
        config: the run.
        callbacks (Sequence[keras.callbacks.Callback]): extra Keras callbacks for `fit` (after those
            of `config.callbacks`).

    Returns:
        The metrics: the test split's loss and compiled metrics (`test_loss`,
        `test_accuracy`, ...; none without a test split), the last epoch's
        (`train_loss`, ...), examples per second, replica count, distribution,
        epochs completed, and the effective learning rate.

    Raises:
        ValueError: a bad configuration, a `model_dir` holding another run's
            outputs or files tfmulti did not write, or in use by another run
            (nothing is written then).
        OSError: the outputs could not be written to `model_dir` (a full disk);
            the outputs already there are left as they were.
        RuntimeError: virtual devices requested after TensorFlow started.
        tfmulti.data.DataNotFoundError: the dataset is not available offline.
    """
    config.validate()
    # A callbacks function that cannot be found fails before anything is built.
    make_callbacks = (hooks.resolve(config.callbacks, "callbacks")
                      if config.callbacks is not None else None)
    memory.check_config(config)  # a layout a device cannot hold fails before anything is built
    run = runs.build_run(config)
    role = strategy_lib.cluster_role(run.strategy)
    _check_profile_steps(config, run)
    # Made before model_dir is claimed: a function that fails leaves it untouched (so its
    # callbacks create their files when training begins, not in __init__).
    callbacks = [*_user_callbacks(make_callbacks, config, role), *callbacks]
    # The backup stays this run's from before the first write to model_dir until
    # after the last (a second run on it fails here, having touched nothing).
    held = (backup.lock(config.backup_dir, run.strategy) if config.backup_dir
            else contextlib.nullcontext())
    writes = bool(config.model_dir) and role.is_chief  # only the chief writes
    try:
        with held, (outputs.lock(config.model_dir) if writes else contextlib.nullcontext()):
            return _train(config, run, role, callbacks)
    finally:
        loaders.close_pools()  # a PyDataset's worker processes end with the run
        data_service.stop_local()  # and a tf.data service started with it


def _check_profile_steps(config: TrainConfig, run: runs.Run) -> None:
    """`profile_steps` within the run's global steps (known once the data is).

    Raises:
        ValueError: the range ends after the run's last step.
    """
    steps = parse_profile_steps(config.profile_steps)
    total = config.epochs * run.steps_per_epoch
    if steps is not None and steps[1] > total:
        raise ValueError(
            f"`profile_steps` ({steps[0]},{steps[1]}) ends after the run's last global step, "
            f"{total} ({config.epochs} epochs x {run.steps_per_epoch} steps); profile steps "
            f"up to {total}, e.g. profile_steps={min(steps[0], total)},{total}.")


def _user_callbacks(make_callbacks, config: TrainConfig, role) -> list:
    """The Keras callbacks the user's function (`config.callbacks`) returns;
    it takes whichever of model_dir, is_chief, worker_index, num_workers and
    config it names.

    Raises:
        ValueError: the function needs other arguments, or returns something
            other than a list (or tuple) of `keras.callbacks.Callback`.
    """
    if make_callbacks is None:
        return []
    offered = {"model_dir": config.model_dir, "is_chief": role.is_chief,
               "worker_index": role.worker_index, "num_workers": role.num_workers,
               "config": config}
    made = hooks.call(make_callbacks, offered, "callbacks")
    name = config.callbacks if isinstance(config.callbacks, str) else getattr(
        make_callbacks, "__qualname__", repr(make_callbacks))
    if not isinstance(made, (list, tuple)):
        raise ValueError(f"`callbacks` {name!r} returned {type(made).__name__}, not a list of "
                         f"keras.callbacks.Callback; return a list (empty where this worker "
                         f"has nothing to log).")
    wrong = [type(c).__name__ for c in made if not isinstance(c, keras.callbacks.Callback)]
    if wrong:
        raise ValueError(f"`callbacks` {name!r} returned {', '.join(wrong)} in its list, not "
                         f"keras.callbacks.Callback; subclass keras.callbacks.Callback (Keras "
                         f"3's, not tf.keras's).")
    return list(made)


def _fingerprint(run: runs.Run, role) -> dict:
    """What a resumed run must share with the one that wrote the backup, beyond
    what `backup.fit` checks itself (variables, steps per epoch and call)."""
    c = run.config
    fingerprint = {"model": c.model_name, "dataset": c.dataset_name,
                   "num_examples": c.num_examples, "seed": c.seed,
                   "global_batch_size": c.global_batch_size,
                   "accumulate_steps": c.accumulate_steps,
                   "input_sharding": run.train_input.sharding}
    if run.train_input.sharding in ("files", "batches"):  # each worker's own share per step
        fingerprint["num_workers"] = role.num_workers
    return fingerprint


def _train(config: TrainConfig, run: runs.Run, role, callbacks) -> dict:
    model = run.model
    chief = role.is_chief  # only the chief writes
    writes = bool(config.model_dir) and chief
    published = _claim_model_dir(config) if writes else False
    finished = _finished_run(config, role, published)
    if finished is not None:
        return finished
    # All checks passed: from here on we write.
    timer = EpochTimer()
    # A NaN or infinite loss stops the run before any callback saves from it.
    all_callbacks = [timer, StopOnNonFiniteLoss(config.backup_dir), *callbacks]
    if run.data_service:  # a lost service worker stops the run, never hangs it
        all_callbacks.append(WatchService(run.data_service, config.data_service_timeout))
    logs = writes and config.tensorboard
    if logs:
        # Published with the other outputs at the end (the old ones stay until then).
        pending = outputs.pending_logs(config.model_dir)
        all_callbacks.append(keras.callbacks.TensorBoard(pending))
        steps = parse_profile_steps(config.profile_steps)
        if steps is not None:  # the profile goes beside the TensorBoard's "train" run
            all_callbacks.append(ProfileSteps(
                os.path.join(pending, "train"), *steps,
                steps_per_execution=run.steps_per_execution,
                shown_dir=os.path.join(config.model_dir, "logs", "train")))
    verbose = config.verbose
    if verbose == "auto":
        verbose = 0 if not chief else 1 if sys.stdout.isatty() else 2
    print(f"tfmulti: {run.describe()}", flush=True)
    if writes:
        _say_if_weights_only(config, model)
    if config.model_parallel:
        print(_stage_table(config, run), flush=True)
    trainer = "the pipeline's stages" if config.model_parallel else None
    own = own_fit.describe(compiling.source_model(model), trainer)
    if own:
        print(f"tfmulti: {own}", flush=True)
    with _damaged_data_named(run), own_fit.keras_own_methods(model):
        history, resumed_step, last_epoch, results, backed_up = _fit_and_evaluate(
            config, run, role, all_callbacks, verbose)
    sharding = zero.sharding_of(getattr(model, "optimizer", None))
    if sharding is not None and config.model_dir:
        # On every worker (a collective): the chief keeps the slots whole to save them.
        sharding.keep_whole(keep=writes)
    metrics = _metrics(run, history, results, timer.seconds, resumed_step, role.num_workers,
                       last_epoch)
    if sharding is not None and (sharding.stage == 3 or sharding.rows):
        # On every worker (a collective), after the bytes held were read: a whole model (the
        # tables sharded by rows only where it is written). The step functions hold the shards
        # (their captures): let go of them first, so that each parameter's shards go as its
        # whole comes.
        model.train_function = model.test_function = model.predict_function = None
        sharding.unshard_parameters(keep=writes)
    extra, line = dataset_metrics(config, results)
    metrics.update(extra)
    if line:
        print(line, flush=True)
    failpoint("train.write")
    if writes:
        model_file = _write_outputs(config, model, metrics)
        written = f"metrics.json, {model_file} and logs/" if logs else \
            f"metrics.json and {model_file}"
        print(f"tfmulti: wrote {written} to {config.model_dir}", flush=True)
    if sharding is not None:
        sharding.drop_whole()
    if backed_up is not None and not config.keep_backup:
        # Only now: a crash during evaluation or the writes above resumes from
        # the finished backup instead of training again.
        backed_up.delete_backup()
    failpoint("train.done")
    return metrics


def _stage_table(config: TrainConfig, run: runs.Run) -> str:
    """The pipeline's stages and the bytes each device holds. Where the model
    leaves a dimension of its activations open (a sequence length), the bytes
    are those of the training data's first examples, said in one line (or,
    where those differ in shape, one line says why there is no table)."""
    model = run.model
    if getattr(model, "tensor_parallel", 1) > 1:
        # Stages split over T devices are counted per device by the estimate
        # (the placed pipeline's report counts one device per stage).
        rows = memory.estimate_for_config(config)["devices"]
        return f"{model.plan.table()}\n{footprint.format_footprint(rows)}"
    try:
        return (f"{model.plan.table()}\n"
                + footprint.format_footprint(footprint.pipeline_footprint(
                    model, config.global_batch_size)))
    except ValueError as e:
        if "fully known shapes" not in str(e):
            raise
    try:
        inputs = data_checks.first_inputs(run.train_data, run.preprocess)
        with footprint.measured_on(model.built_chain().graph, inputs):
            rows = footprint.pipeline_footprint(model, config.global_batch_size)
    except Exception as e:  # pylint: disable=broad-except  (a table: never the run's end)
        return (f"{model.plan.table()}\ntfmulti: no memory table: the model leaves a "
                f"dimension of its activations open, and sizing it by the first training "
                f"examples failed: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}")
    return (f"{model.plan.table()}\n{footprint.format_footprint(rows)}\ntfmulti: the model "
            f"leaves a dimension of its activations open: counted at the training data's "
            f"input shapes, {_shapes(inputs)}")


def _shapes(inputs) -> str:
    """Per-example input shapes, by name where the inputs are a dict."""
    if isinstance(inputs, dict):
        return ", ".join(f"{name} {tuple(value.shape[1:])}" for name, value in
                         sorted(inputs.items()))
    return ", ".join(str(tuple(value.shape[1:])) for value in tf.nest.flatten(inputs))


def _fit_and_evaluate(config: TrainConfig, run: runs.Run, role, all_callbacks, verbose):
    """Trains (through the backup when there is one), validating after every
    epoch when there is a validation split, and evaluates: the history, the
    step resumed from, the last epoch's metrics when nothing was left to train,
    the test results and the backup's `FitResult` (None without one)."""
    model = run.model
    resumed_step, last_epoch, result = 0, {}, None
    validation = run.validation_input
    # No validation_steps: Keras then reads the split to its end each epoch, with
    # an iterator of its own (given the steps, it keeps one across epochs, and a
    # repeated split leaves the later evaluations of other data empty).
    validation_kwargs = {} if validation is None else {"validation_data": validation.dataset}
    with _end_of_data_quiet(validation is not None):
        if config.backup_dir:
            result = backup.fit(model, run.dataset_from, epochs=config.epochs,
                                steps_per_epoch=run.steps_per_epoch,
                                backup_dir=config.backup_dir,
                                save_every_steps=config.backup_every_steps,
                                callbacks=all_callbacks, verbose=verbose,
                                fingerprint=_fingerprint(run, role),
                                discard_unreadable_backup=config.discard_unreadable_backup,
                                **validation_kwargs)
            history, resumed_step = result.history, result.resumed_step
            if not history and result.resumed_from:  # resumed at the end: nothing trained here
                last_epoch = model.get_metrics_result()  # the backup's, before evaluate resets it
                if validation is not None:  # the last epoch's validation: the same weights
                    last_epoch.update({f"val_{name}": value for name, value in model.evaluate(
                        **validation.evaluate_kwargs(), return_dict=True, verbose=0).items()})
        else:
            fit_kwargs = run.train_input.fit_kwargs()
            if config.steps_per_epoch:
                fit_kwargs["steps_per_epoch"] = config.steps_per_epoch
            history = model.fit(**fit_kwargs, epochs=config.epochs, callbacks=all_callbacks,
                                verbose=verbose, **validation_kwargs).history
    failpoint("train.evaluate")
    results = {}
    if run.test_input is not None:
        with _end_of_data_quiet():
            results = model.evaluate(**run.test_input.evaluate_kwargs(), return_dict=True,
                                     verbose=0)
    return history, resumed_step, last_epoch, results, result


@contextlib.contextmanager
def _end_of_data_quiet(quiet: bool = True):
    """Keras warns "Your input ran out of data; interrupting training" at the
    end of every evaluation of data whose length it does not know (files):
    there, running out is the end of the split, not a fault. (`quiet`: the
    evaluated data is such, as validation data, which `fit` reads to its end
    every epoch; training data repeats, so it never runs out.)"""
    with warnings.catch_warnings():
        if quiet:
            warnings.filterwarnings("ignore", message="Your input ran out of data")
        yield


@contextlib.contextmanager
def _damaged_data_named(run: runs.Run):
    """A record damaged inside its payload passes the checks before training;
    TensorFlow's DataLossError then names an offset only: this names the file
    (a ValueError, one line and exit 2 from a recipe)."""
    try:
        yield
    except tf.errors.DataLossError as e:
        raise data_checks.data_loss_error(e, run.train_data, run.test_data) from None
    except tf.errors.OpError as e:
        if run.data_service and data_service.is_service_end(e):
            raise data_service.ServiceLost(
                f"the tf.data service at {run.data_service} stopped serving the training "
                "input mid-run (a service worker was lost); a run with --backup_dir resumes "
                "from its backup (tfmulti launch --max_restarts restarts it).") from None
        raise


def _peak_memory() -> dict[str, int]:
    """This process's peak memory so far: "rss" (its resident set, the kernel's
    count, what GNU time's %M reports) and, by device, TensorFlow allocator's
    peak ("CPU:0": the logical CPUs share one allocator; each GPU its own)."""
    peaks = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    for device in ["CPU:0", *(f"GPU:{i}" for i, _ in
                              enumerate(tf.config.list_logical_devices("GPU")))]:
        try:
            peaks[device] = int(tf.config.experimental.get_memory_info(device)["peak"])
        except (ValueError, tf.errors.OpError):  # a device whose allocator keeps no count
            pass
    return peaks


def _metrics(run: runs.Run, history: dict, results: dict, epoch_seconds: list[float],
             resumed_step: int, num_workers: int, last_epoch: dict) -> dict:
    config, model = run.config, run.model
    steady = epoch_seconds[1:] or epoch_seconds
    examples_per_epoch = run.steps_per_epoch * run.examples_per_step
    metrics = {
        "distribution": (config.distribution if config.model_parallel
                         else strategy_lib.strategy_name(run.strategy)),
        "num_replicas": run.num_replicas,
        "num_workers": num_workers,
        "dataset": config.dataset_name,
        "model": config.model_name,
        "task": run.info["task"],
        "global_batch_size": config.global_batch_size,
        "accumulate_steps": config.accumulate_steps,
        "per_replica_batch_size": run.per_replica_batch_size,
        "learning_rate": _learning_rate(model),
        "epochs_completed": resumed_step // run.steps_per_epoch + _epochs_trained(history),
        "resumed_from_step": resumed_step,
        "steps_per_epoch": run.steps_per_epoch,
        "steps_per_execution": run.steps_per_execution,
        "input_sharding": run.train_input.sharding,
        "mixed_precision": config.mixed_precision,
        "jit_compile": config.jit_compile,
        "train_seconds": sum(epoch_seconds),
        "epoch_seconds": [float(t) for t in epoch_seconds],  # this run's epochs
        "examples_per_second": (examples_per_epoch / statistics.median(steady)
                                if steady else None),  # None: nothing left to train
    }
    for name, values in history.items():  # the last epoch's: loss -> train_loss, val_loss
        metrics[name if name.startswith("val_") else f"train_{name}"] = (
            values[-1] if values else None)
    if not _epochs_trained(history):  # nothing trained here: the last epoch's, from the backup
        metrics.update({name if name.startswith("val_") else f"train_{name}": value
                        for name, value in last_epoch.items()} or {"train_loss": None})
    for name, value in results.items():
        metrics[f"test_{name}"] = value
    found = models.output_heads(model)
    if len(found) > 1:  # the results line shows each output's main figure
        metrics["outputs"] = [head.key for head in found]
    metrics["peak_memory_bytes"] = _peak_memory()
    sharding = zero.sharding_of(getattr(model, "optimizer", None))
    metrics["zero_stage"] = sharding.stage if sharding is not None else 0
    if sharding is not None:  # this process's devices: the optimizer state they hold
        metrics["optimizer_state_bytes"] = sharding.bytes_by_device()
        metrics["parameter_bytes"] = sharding.parameter_bytes_by_device()
    if config.model_parallel:
        metrics.update(num_stages=model.num_stages, num_microbatches=model.num_microbatches,
                       partition_sizes=list(model.plan.sizes),
                       partition_balance=model.plan.balance)
    return {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str, list))
                else v) for k, v in metrics.items()}


def _epochs_trained(history: dict) -> int:
    """The epochs `fit`'s history holds (its logs: Keras' "loss", or those of
    a train_step of the user's, a GAN's "d_loss" and "g_loss")."""
    return max((len(values) for values in history.values()), default=0)


def _learning_rate(model) -> float | None:
    """The optimizer's target learning rate (after scaling; a warmup's end)."""
    optimizer = getattr(model, "optimizer", None)
    rate = getattr(optimizer, "_learning_rate", None)
    if isinstance(rate, models.WarmupSchedule):
        return rate.target
    try:
        return float(keras.ops.convert_to_numpy(rate))
    except (TypeError, ValueError):
        return None  # a schedule of the user's
