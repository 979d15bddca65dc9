"""The memory model (tfmulti.memory.footprint): the bytes a stack of layers needs on a
device to train, its table, and the acceptance test of the one memory model:
`estimate-memory` (`tfmulti.memory.estimate.estimate_memory`) and a placed,
trained `PipelineModel` (`tfmulti.memory.footprint.pipeline_footprint`) give
the same bytes for the same pipeline. The byte counts of dtypes and
variables are `tfmulti.utils.sizes`'. Expected values are worked out from the layer shapes."""

from __future__ import annotations

import contextlib
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.memory import footprint
from tfmulti.utils import sizes
from tfmulti.models import builders as models
from tfmulti.memory.estimate import estimate_memory
from tfmulti.parallel import PipelineModel

F32 = 4


def _dense_stack(*widths, input_dim=8, **kwargs):
    model = keras.Sequential([keras.Input((input_dim,))]
                             + [keras.layers.Dense(w, **kwargs) for w in widths])
    return model.layers


# --- the byte model ---------------------------------------------------------------


@pytest.mark.parametrize("dtype,size", [
    ("float32", 4), ("float16", 2), ("bfloat16", 2), (tf.bfloat16, 2), (tf.float32, 4),
    (np.dtype("float64"), 8), ("int8", 1), ("bool", 1), ("float8_e4m3fn", 1),
])
def test_dtype_bytes(dtype, size):
    assert sizes.dtype_bytes(dtype) == size


def test_dtype_bytes_refuses_a_dtype_without_a_size():
    with pytest.raises(ValueError, match=r"cannot tell the size of dtype 'resource'"):
        sizes.dtype_bytes("resource")


def test_variables_bytes_counts_shared_variables_once():
    (dense,) = _dense_stack(3)  # 8x3 kernel + 3 bias
    assert sizes.variables_bytes(dense.weights) == (8 * 3 + 3) * F32
    assert sizes.variables_bytes([*dense.weights, *dense.weights]) == (8 * 3 + 3) * F32
    assert sizes.variables_bytes([]) == 0


def test_output_elements():
    layers = [keras.layers.Conv2D(4, 3), keras.layers.MaxPooling2D(), keras.layers.Flatten(),
              keras.layers.Dense(5)]
    # 8x8x3 -> 6x6x4 -> 3x3x4 -> 36 -> 5
    assert footprint.output_elements(layers, (8, 8, 3)) == [6 * 6 * 4, 3 * 3 * 4, 36, 5]


def test_stack_footprint_counts():
    layers = _dense_stack(4, 2)  # 8 -> 4 -> 2
    params = (8 * 4 + 4) + (4 * 2 + 2)
    row = footprint.stack_footprint(layers, (8,), micro_batch=16, optimizer_slots=2)
    assert row == {"parameters": params * F32, "gradients": params * F32,
                   "optimizer_slots": 2 * params * F32,
                   "activations": (4 + 2) * 16 * F32,
                   "activations_per_microbatch": (4 + 2) * 16 * F32,
                   "activation_batch": 16, "total": (4 * params + (4 + 2) * 16) * F32}
    assert tuple(k for k in footprint.COLUMNS if k in row) == footprint.COLUMNS
    assert footprint.OPTIMIZER_SLOTS["adam"] == 2 and footprint.OPTIMIZER_SLOTS["sgd"] == 0
    assert footprint.OPTIMIZER_SLOTS["rmsprop"] == 1
    # No optimizer given: no slots; measured slot bytes win over a slot count.
    assert footprint.stack_footprint(layers, (8,), micro_batch=16)["optimizer_slots"] == 0
    assert footprint.stack_footprint(layers, (8,), micro_batch=16, optimizer_slots=2,
                                     slot_bytes=123)["optimizer_slots"] == 123


def test_stack_footprint_pipeline_stage():
    layers = _dense_stack(4, 2)
    outputs, received = (4 + 2) * 16 * F32, 8 * 16 * F32
    # A stage after the first keeps its received input too; GPipe holds 3 micro-batches.
    row = footprint.stack_footprint(layers, (8,), micro_batch=16, num_microbatches=3,
                                    receives_input=True)
    assert row["activations_per_microbatch"] == received + outputs
    assert row["activations"] == 3 * (received + outputs)
    # Remat: only the inputs of every micro-batch, plus one micro-batch recomputed.
    remat = footprint.stack_footprint(layers, (8,), micro_batch=16, num_microbatches=3,
                                      receives_input=True, remat=True)
    assert remat["activations_per_microbatch"] == received
    assert remat["activations"] == 3 * received + outputs
    first = footprint.stack_footprint(layers, (8,), micro_batch=16, num_microbatches=3,
                                      remat=True)  # the first stage's input is the model's
    assert (first["activations_per_microbatch"], first["activations"]) == (0, outputs)
    assert remat["parameters"] == row["parameters"] and remat["total"] == (
        remat["parameters"] + remat["gradients"] + remat["activations"])


def test_stack_footprint_compute_dtype():
    layers = _dense_stack(4, 2)
    half = footprint.stack_footprint(layers, (8,), micro_batch=16, compute_dtype="bfloat16")
    assert half["activations"] == (4 + 2) * 16 * 2
    assert half["parameters"] == ((8 * 4 + 4) + (4 * 2 + 2)) * F32  # variables stay float32
    # Without an override: the layers' own compute dtype (their policy).
    mixed = _dense_stack(4, 2, dtype="mixed_bfloat16")
    assert footprint.stack_footprint(mixed, (8,), micro_batch=16) == half


def test_stack_footprint_non_trainable_weights_have_no_gradients():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization()])
    row = footprint.stack_footprint(model.layers, (8,), micro_batch=2, optimizer_slots=2)
    trainable = (8 * 4 + 4) + 2 * 4  # dense, gamma and beta
    assert row["parameters"] == (trainable + 2 * 4) * F32  # + moving mean and variance
    assert row["gradients"] == trainable * F32
    assert row["optimizer_slots"] == 2 * trainable * F32


def test_slot_bytes_by_device():
    def var(shape, device, dtype="float32"):
        return types.SimpleNamespace(shape=shape, dtype=dtype,
                                     value=types.SimpleNamespace(device=device))

    optimizer = types.SimpleNamespace(variables=[
        var((), "/job:localhost/replica:0/task:0/device:CPU:0", "int64"),  # iterations
        var((8, 4), "/job:localhost/replica:0/task:0/device:CPU:0"),
        var((4,), "/job:localhost/replica:0/task:0/device:CPU:0"),
        var((4, 2), "/job:localhost/replica:0/task:0/device:CPU:1"),
    ])
    canonical = lambda name: name.rsplit("/", 1)[-1]  # noqa: E731
    assert footprint.slot_bytes_by_device(optimizer, canonical) == {
        "device:CPU:0": (8 * 4 + 4) * F32, "device:CPU:1": 4 * 2 * F32}


def test_format_footprint():
    rows = [{"device": "/device:CPU:0", "replica": 0, "stage": 0,
             **footprint.stack_footprint(_dense_stack(4, 2), (8,), micro_batch=2**14)},
            {"device": "/device:CPU:1", "replica": 0, "stage": 1,
             **footprint.stack_footprint(_dense_stack(2), (8,), micro_batch=1)}]
    lines = footprint.format_footprint(rows).splitlines()
    assert lines[0].split() == ["device", "replica", "stage", *footprint.COLUMNS]
    assert lines[1].split()[:3] == ["/device:CPU:0", "0", "0"]
    assert lines[2].split()[:3] == ["/device:CPU:1", "0", "1"]
    assert len({len(line) for line in lines}) == 1  # aligned
    # (4 + 2) outputs x 2**14 examples x 4 bytes = 384 KiB; in the unit that reads best
    assert lines[1].split()[-4:] == ["384", "KiB", "384", "KiB"]  # activations, total
    # 2 outputs x 4 bytes, total 2 x 72 + 8: under 1 KiB they stay bytes
    assert lines[2].split()[-4:] == ["8", "B", "152", "B"]
    titled = footprint.format_footprint(rows, title="a title").splitlines()
    assert titled[0] == "a title" and titled[1:] == lines


# --- the acceptance test: estimate-memory == PipelineModel ------------------------


def _batch(name: str, n: int):
    rng = np.random.default_rng(0)
    x = rng.random((n, *models.INPUT_SHAPES[name]), dtype=np.float32)
    if models.model_task(name) == "regression":
        return x, rng.random((n, 1), dtype=np.float32)
    return x, rng.integers(0, 10, n)


def _mlp_rows(batch: int, M: int) -> list[dict]:
    """The mlp over 2 stages, [flatten, fc1 | dropout, logits], from its shapes."""
    micro = batch // M
    p0, p1 = (784 * 512 + 512) * F32, (512 * 10 + 10) * F32
    per0 = (784 + 512) * micro * F32
    per1 = (512 + 512 + 10) * micro * F32  # received fc1 output, dropout, logits
    return [{"parameters": p, "gradients": p, "optimizer_slots": 2 * p,
             "activations_per_microbatch": per, "activations": M * per,
             "activation_batch": micro, "total": 4 * p + M * per}
            for p, per in ((p0, per0), (p1, per1))]


def _regression_remat_rows(batch: int, M: int) -> list[dict]:
    """The regression model over 3 stages with remat, [flatten, dense1 | dense2 |
    output], from its shapes: stages 0 and 1 recompute, the last does not."""
    micro = batch // M
    p = [(1024 * 1024 + 1024) * F32, (1024 * 1024 + 1024) * F32, (1024 + 1) * F32]
    per = [0, 1024 * micro * F32, (1024 + 1) * micro * F32]
    peak = [(1024 + 1024) * micro * F32,  # one micro-batch recomputed, no input kept
            M * 1024 * micro * F32 + 1024 * micro * F32,  # inputs + one recomputed
            M * (1024 + 1) * micro * F32]  # the last stage keeps everything
    return [{"parameters": p[s], "gradients": p[s], "optimizer_slots": 2 * p[s],
             "activations_per_microbatch": per[s], "activations": peak[s],
             "activation_batch": micro, "total": 4 * p[s] + peak[s]} for s in range(3)]


ACCEPTANCE = [
    pytest.param("mlp", 2, 4, 1, False, "none", _mlp_rows, id="mlp-pipeline"),
    pytest.param("cnn", 2, 2, 2, False, "none", None, id="cnn-hybrid"),
    pytest.param("regression", 3, 4, 1, True, "none", _regression_remat_rows,
                 id="regression-pipeline-remat"),
    # remat with a built-in model's Dropout at rate 0 (it draws nothing).
    pytest.param("mlp", 2, 4, 1, True, "none", None, id="mlp-pipeline-remat-no-dropout"),
    # Each layer counted in its own compute dtype: bfloat16, the logits float32.
    pytest.param("mlp", 2, 4, 1, False, "bfloat16", None, id="mlp-pipeline-bfloat16"),
    pytest.param("cnn", 2, 2, 2, False, "bfloat16", None, id="cnn-hybrid-bfloat16"),
]
COMPARED = ("replica", "stage", "parameters", "gradients", "optimizer_slots", "activations",
            "activations_per_microbatch", "activation_batch", "total")


@pytest.mark.parametrize("name,stages,micro,replicas,remat,mixed_precision,expected",
                         ACCEPTANCE)
def test_estimate_memory_and_pipeline_model_report_the_same_bytes(
        name, stages, micro, replicas, remat, mixed_precision, expected):
    """Issue "Done when": `estimate-memory` and `PipelineModel` report the same
    bytes for the same pipeline; the pipeline's optimizer slots measured after
    a training step."""
    batch, dropout = 16, 0.0 if remat else 0.2
    estimate = estimate_memory(
        name, distribution="hybrid" if replicas > 1 else "pipeline", num_stages=stages,
        num_microbatches=micro, remat=remat, global_batch_size=batch,
        mixed_precision=mixed_precision, optimizer="adam", dropout=dropout,
        **({"num_replicas": replicas} if replicas > 1 else {}))["devices"]
    assert len(estimate) == replicas * stages
    policy = (models.mixed_precision_policy(mixed_precision) if mixed_precision != "none"
              else contextlib.nullcontext())
    with policy:
        model = models.build_model(name, seed=0, dropout=dropout)
        pipeline = PipelineModel(model, num_stages=stages, num_microbatches=micro,
                                 num_replicas=replicas, remat=remat)
        # Not compiled: the slots are counted.
        unplaced = footprint.pipeline_footprint(pipeline, batch, optimizer="adam")
        models.compile_model(pipeline, task=models.model_task(name), optimizer="adam")
        pipeline.train_on_batch(*_batch(name, batch))
    measured = footprint.pipeline_footprint(pipeline, batch)  # the slots are measured now
    assert pipeline.optimizer.built
    assert [r["device"] for r in measured] == [f"/device:CPU:{e['device']}" for e in estimate]
    for report in (unplaced, measured):
        assert [{k: r[k] for k in COMPARED} for r in report] == [
            {k: e[k] for k in COMPARED} for e in estimate]
    if expected is not None:  # and both are right, from the shapes
        assert [{k: r[k] for k in expected(batch, micro)[0]} for r in measured] == expected(
            batch, micro)


def test_sizes_measured_from_a_dict_of_data_feed_listed_inputs_by_name():
    """keras-io's multi-input model takes a list of named inputs; its data is a dict."""
    title = keras.Input((None,), name="title", dtype="int32")
    body = keras.Input((None,), name="body", dtype="int32")
    words = keras.layers.Concatenate(axis=1)([keras.layers.Embedding(10, 2)(title),
                                              keras.layers.Embedding(10, 2)(body)])
    model = keras.Model([title, body], words)
    data = {"body": np.zeros((2, 5), "int32"), "title": np.zeros((2, 3), "int32")}
    with footprint.measured_on(model, data):
        assert footprint.tensor_bytes(model.outputs[0]) == (3 + 5) * 2 * 4
    with pytest.raises(ValueError, match="the data has no input named title"):
        with footprint.measured_on(model, {"body": data["body"]}):
            pass
