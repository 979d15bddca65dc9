"""The per-device memory estimate (`tfmulti.memory.estimate`, `tfmulti
estimate-memory`). Expected bytes are worked out here from the layer shapes.
That a placed `PipelineModel` reports the same bytes is tests/unit/test_footprint.py;
the CLI's bad input is tests/unit/test_cli.py (in-process)."""

from __future__ import annotations

import json

import pytest

from tests._util import cli_main
from tfmulti import cli
from tfmulti.models import builders as models
from tfmulti.memory import estimate as memory
from tfmulti.parallel.partition import plan_partition

F32 = 4
MLP_PARAMS = (784 * 512 + 512) + (512 * 10 + 10)  # fc1, logits
MLP_OUTPUTS = 784 + 512 + 512 + 10  # per example: flatten, fc1, dropout, logits
# cnn on 28x28x1: conv1 26x26x32, pool1 13x13x32, conv2 11x11x64, pool2 5x5x64,
# flatten 1600, dropout 1600, logits 10.
CNN_OUTPUTS = [26 * 26 * 32, 13 * 13 * 32, 11 * 11 * 64, 5 * 5 * 64, 1600, 1600, 10]


def _one(**kwargs) -> dict:
    return memory.estimate_memory("mlp", global_batch_size=256, **kwargs)


def test_one_device_adam_counts():
    estimate = _one(distribution="one_device", optimizer="adam")
    (row,) = estimate["devices"]
    params = models.build_model("mlp").count_params()
    assert params == MLP_PARAMS
    assert row["parameters"] == F32 * params
    assert row["gradients"] == row["parameters"]
    assert row["optimizer_slots"] == 2 * row["parameters"]
    # flatten 784 + fc1 512 + dropout 512 + logits 10, float32, batch 256
    assert row["activations"] == MLP_OUTPUTS * 256 * F32
    assert row["activations_per_microbatch"] == row["activations"]  # one forward pass
    assert row["activation_batch"] == 256
    assert row["total"] == sum(row[k] for k in ("parameters", "gradients", "optimizer_slots",
                                                "activations"))
    assert (row["device"], row["replica"], row["stage"]) == (0, 0, 0)
    assert estimate["num_devices"] == 1 and estimate["distribution"] == "one_device"


def test_sgd_has_no_slots():
    (row,) = _one(optimizer="sgd")["devices"]
    assert row["optimizer_slots"] == 0


def test_mirrored_copies_params_and_splits_activations():
    (single,) = _one()["devices"]
    rows = _one(distribution="mirrored", num_devices=4)["devices"]
    assert len(rows) == 4
    assert [r["device"] for r in rows] == [r["replica"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert row["parameters"] == single["parameters"]
        assert row["optimizer_slots"] == single["optimizer_slots"]
        assert row["activations"] * 4 == single["activations"]
        assert row["activation_batch"] == 256 // 4


@pytest.mark.parametrize("model,outputs", [("mlp", [784, 512, 512, 10]), ("cnn", CNN_OUTPUTS)],
                         ids=["mlp", "cnn"])
def test_pipeline_stages_split_the_parameters(model, outputs):
    (single,) = memory.estimate_memory(model)["devices"]
    estimate = memory.estimate_memory(model, distribution="pipeline", num_stages=2,
                                      num_microbatches=4)
    rows = estimate["devices"]
    assert [r["stage"] for r in rows] == [0, 1] and estimate["num_devices"] == 2
    assert sum(r["parameters"] for r in rows) == single["parameters"]
    # Stage 1 receives stage 0's last output and keeps it for the backward pass.
    first = plan_partition(models.build_model(model).layers, 2).sizes[0]
    received = outputs[first - 1] * 256 * F32
    # GPipe keeps all 4 micro-batches of 64 until the backward pass: the
    # stages' activations add up to the whole batch's, plus what stage 1 received.
    assert all(r["activation_batch"] == 256 // 4 for r in rows)
    assert [r["activations"] for r in rows] == [
        sum(outputs[:first]) * 256 * F32, sum(outputs[first:]) * 256 * F32 + received]
    assert sum(r["activations"] for r in rows) == single["activations"] + received
    for r in rows:
        assert r["activations"] == 4 * r["activations_per_microbatch"]


def test_pipeline_remat_keeps_the_stage_inputs():
    # mlp in 2 stages: [flatten, fc1 | dropout, logits]; micro-batches of 64.
    plain, remat = (memory.estimate_memory("mlp", distribution="pipeline", num_stages=2,
                                           num_microbatches=4, remat=r, dropout=0.0)["devices"]
                    for r in (False, True))
    micro = 64 * F32
    # Stage 0 keeps nothing per micro-batch (its input is the model's own),
    # and recomputes one micro-batch's outputs at a time.
    assert remat[0]["activations_per_microbatch"] == 0
    assert remat[0]["activations"] == (784 + 512) * micro
    assert plain[0]["activations"] == 4 * (784 + 512) * micro
    # The last stage is never recomputed: the same as without remat.
    assert remat[1] == plain[1]
    assert remat[1]["activations"] == 4 * (512 + 512 + 10) * micro
    assert remat[0]["parameters"] == plain[0]["parameters"]
    # As PipelineModel, the estimate refuses remat where Dropout draws masks.
    with pytest.raises(ValueError, match=r"`remat=True` recomputes activations.*dropout"):
        memory.estimate_memory("mlp", distribution="pipeline", remat=True)


def test_hybrid_repeats_the_stages_per_replica():
    rows = _one(distribution="hybrid", num_replicas=2, num_stages=2)["devices"]
    assert [(r["replica"], r["stage"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["device"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["parameters"] == rows[2]["parameters"]
    # A replica's 128 examples in 4 micro-batches of 32.
    assert rows[0]["activation_batch"] == 256 // 2 // 4
    assert rows[0]["activations"] == 4 * 32 * (784 + 512) * F32
    assert {k: v for k, v in rows[1].items() if k not in ("device", "replica")} == {
        k: v for k, v in rows[3].items() if k not in ("device", "replica")}


@pytest.mark.parametrize("mixed_precision", ["bfloat16", "float16"])
def test_half_precision_halves_activations_not_parameters(mixed_precision):
    (full,) = _one()["devices"]
    estimate = _one(mixed_precision=mixed_precision)
    (half,) = estimate["devices"]
    # flatten, fc1, dropout in 16 bits; the logits stay float32 (as built).
    assert full["activations"] == (784 + 512 + 512 + 10) * 256 * F32
    assert half["activations"] == (784 + 512 + 512) * 256 * 2 + 10 * 256 * F32
    assert half["parameters"] == full["parameters"]
    assert half["optimizer_slots"] == full["optimizer_slots"]
    assert estimate["mixed_precision"] == mixed_precision


@pytest.mark.parametrize("kwargs,message", [
    (dict(distribution="bogus"), r"`distribution` must be one of \['one_device', "),
    (dict(distribution="mirrored", num_devices=3),
     r"`global_batch_size` \(256\) must be divisible"),
    (dict(distribution="pipeline", num_microbatches=3), r"must split into 1 replica x 3"),
    (dict(distribution="one_device", num_devices=2), "distribution 'one_device' uses 1 device"),
    (dict(distribution="pipeline", num_devices=4), "uses 1 replica"),
    (dict(mixed_precision="int8"), "`mixed_precision` must be one of"),
    (dict(distribution="pipeline", num_replicas=4),
     r"`num_replicas` \(4\) does not apply to distribution 'pipeline'; leave it unset or use "
     r"distribution='hybrid'"),
    (dict(distribution="mirrored", num_devices=2, num_stages=2),
     r"`num_stages` \(2\) does not apply to distribution 'mirrored'"),
    (dict(remat=True), r"`remat` \(True\) does not apply to distribution 'one_device'"),
    (dict(optimizer="rmsprops"), "`optimizer` must be one of"),
    (dict(optimizer="muon"), r"estimate-memory counts the slots of \['adadelta'"),
    (dict(distribution="pipeline", partition="time"), "`partition` must be one of"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _one(**kwargs)


def test_bad_model():
    with pytest.raises(ValueError, match=r"`model` must be one of"):
        memory.estimate_memory("resnet")


def test_table_is_aligned():
    text = memory.format_memory_estimate(_one(distribution="mirrored", num_devices=2))
    table = text.splitlines()[1:4]
    assert table[0].split()[:4] == ["device", "replica", "stage", "parameters"]
    assert len({len(line) for line in table}) == 1
    assert "MiB" in table[1]
    assert text.splitlines()[-1] == "activations: a per-replica batch of 128 examples per device."


def test_pipeline_text_names_the_micro_batches_and_remat():
    text = memory.format_memory_estimate(_one(distribution="pipeline", remat=True,
                                              dropout=0.0))
    assert text.splitlines()[0].startswith("mlp under pipeline: 2 devices, global batch 256")
    assert ("activations: a micro-batch of 64 examples x 4 (GPipe holds them all until the "
            "backward pass; remat keeps stage inputs only) per device.") in text


def test_cli_text_and_json(capsys):
    assert cli.main(["estimate-memory", "--model", "mlp", "--distribution", "mirrored",
                     "--num_devices", "2"]) == 0
    text = capsys.readouterr().out
    assert text.strip() == memory.format_memory_estimate(
        _one(distribution="mirrored", num_devices=2))
    assert cli.main(["estimate-memory", "--model", "mlp", "--distribution", "mirrored",
                     "--num_devices", "2", "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert len(estimate["devices"]) == 2
    for row in estimate["devices"]:
        for key in ("device", "parameters", "gradients", "optimizer_slots", "activations",
                    "activations_per_microbatch", "total"):
            assert key in row, key
    assert estimate["devices"][0]["activation_batch"] == 128
    assert estimate == _one(distribution="mirrored", num_devices=2)


# --------------------------------------------------------------------------- transformer

TRANSFORMER = dict(seq_len=16, d_model=32, num_heads=4, num_layers=2)


def _transformer(**kwargs) -> dict:
    return memory.estimate_memory("transformer", global_batch_size=32, dropout=0.0,
                                  **TRANSFORMER, **kwargs)


def test_transformer_on_one_device_counts_every_weight_and_layer_output():
    from tfmulti.models import transformer

    (row,) = _transformer()["devices"]
    model = transformer.build_transformer(**TRANSFORMER)
    assert row["parameters"] == F32 * model.count_params()
    assert row["optimizer_slots"] == 2 * row["parameters"]
    # Per example: every layer's output (the embeddings, each block's 2
    # LayerNorms, attention, 2 dropouts, 2 residuals, MLP up (4 d) and down,
    # the final LayerNorm) and the logits, float32, for the batch of 32.
    d, n, length = 32, 2, 16
    per_position = 3 * d + n * (8 * d + 4 * d) + d + 256
    assert row["activations"] == per_position * length * 32 * F32


@pytest.mark.parametrize("replicas,stages,shards", [(1, 1, 2), (1, 2, 2), (2, 2, 2),
                                                     (1, 2, 4)])
def test_tensor_parallel_devices_share_each_stage(replicas, stages, shards):
    distribution = "hybrid" if replicas > 1 else "pipeline"
    estimate = _transformer(distribution=distribution, num_stages=stages,
                            tensor_parallel=shards, num_microbatches=2,
                            **({"num_replicas": replicas} if replicas > 1 else {}))
    unsplit = _transformer(distribution=distribution, num_stages=stages, num_microbatches=2,
                           **({"num_replicas": replicas} if replicas > 1 else {}))
    rows = estimate["devices"]
    assert estimate["num_devices"] == len(rows) == replicas * stages * shards
    assert [(r["device"], r["replica"], r["stage"], r["shard"]) for r in rows] == [
        ((r * stages + s) * shards + t, r, s, t)
        for r in range(replicas) for s in range(stages) for t in range(shards)]
    for s in range(stages):
        stage = [row for row in rows if row["replica"] == 0 and row["stage"] == s]
        whole = unsplit["devices"][s]
        # The stage's weights, gradients and slots are shared out, none copied;
        # the shards other than the first hold the same, 1/T of the split ones.
        for key in ("parameters", "gradients", "optimizer_slots"):
            assert sum(row[key] for row in stage) == whole[key], key
        assert len({row["parameters"] for row in stage[1:]}) == 1
        assert stage[0]["parameters"] > stage[1]["parameters"]
        # Every device holds less than the unsplit stage; their activations
        # add up to more: the copies of the inputs the shards take.
        assert all(row["total"] < whole["total"] for row in stage)
        assert sum(row["activations"] for row in stage) > whole["activations"]
        assert stage[0]["activations"] < whole["activations"]
    if replicas > 1:
        strip = ("device", "replica")
        assert [{k: v for k, v in row.items() if k not in strip} for row in rows[:len(rows) // 2]] \
            == [{k: v for k, v in row.items() if k not in strip} for row in rows[len(rows) // 2:]]
    assert "shard" in memory.format_memory_estimate(estimate).splitlines()[1]


@pytest.mark.parametrize("kwargs,message", [
    (dict(model="mlp", distribution="pipeline", tensor_parallel=2),
     r"`tensor_parallel` \(2\) splits model 'transformer', got model 'mlp'"),
    (dict(model="mlp", d_model=64), r"`d_model` \(64\) sizes model 'transformer', got model "
                                    r"'mlp'; leave it unset"),
    (dict(model="transformer", tensor_parallel=2),
     r"`tensor_parallel` \(2\) does not apply to distribution 'one_device'"),
    (dict(model="transformer", distribution="pipeline", tensor_parallel=3),
     r"`tensor_parallel` \(3\) must divide num_heads \(4\)"),
    (dict(model="transformer", distribution="pipeline", tensor_parallel=2, num_devices=2),
     r"uses 1 replica x 2 stages x 2 tensor-parallel = 4 devices, got `num_devices` \(2\)"),
])
def test_tensor_parallel_arguments_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        memory.estimate_memory(global_batch_size=32, **kwargs)


def test_check_fits_names_the_fullest_device():
    estimate = _transformer(distribution="pipeline", num_stages=2, tensor_parallel=2,
                            num_microbatches=2)
    fullest = max(estimate["devices"], key=lambda r: r["total"])
    memory.check_fits(estimate, fullest["total"] / 2**20)  # exactly full: fits
    with pytest.raises(ValueError, match=rf"device {fullest['device']} \(replica 0, stage "
                                         rf"{fullest['stage']}, shard {fullest['shard']}\) "
                                         r"needs .* MiB to train transformer under pipeline .*"
                                         r"over the budget of 0.5 MiB per device; split the "
                                         r"model over more devices"):
        memory.check_fits(estimate, 0.5)
    with pytest.raises(ValueError, match=r"`device_memory_mb` must be a finite number > 0"):
        memory.check_fits(estimate, 0)


def test_cli_takes_the_tensor_parallel_flags(capsys):
    assert {"tensor_parallel", "seq_len", "d_model", "num_heads", "num_layers"} <= set(
        cli.ESTIMATE_FIELDS)
    assert cli.main(["estimate-memory", "--model", "mlp", "--distribution", "pipeline",
                     "--tensor_parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tfmulti estimate-memory: error: --tensor_parallel (2) splits model "
                          "'transformer'") and err.count("\n") == 1, err


def test_a_training_configuration_is_checked_against_its_budget():
    from tfmulti.config.train_config import TrainConfig

    config = TrainConfig(distribution="hybrid", num_replicas=2, num_stages=2,
                         num_microbatches=2, global_batch_size=32, dropout=0.0)
    estimate = memory.estimate_for_config(config)
    assert estimate == memory.estimate_memory(
        "mlp", distribution="hybrid", num_replicas=2, num_stages=2, num_microbatches=2,
        global_batch_size=32, dropout=0.0)
    memory.check_config(config)  # no budget: nothing to check
    fullest = max(row["total"] for row in estimate["devices"]) / 2**20
    memory.check_config(config.replace(device_memory_mb=fullest))
    with pytest.raises(ValueError, match=r"over the budget of 0.1 MiB per device"):
        memory.check_config(config.replace(device_memory_mb=0.1))
    assert memory.estimate_for_config(TrainConfig(distribution="mirrored", devices=(
        "CPU:0", "CPU:1")))["num_devices"] == 2
    with pytest.raises(ValueError, match="distribution 'auto' decides the devices when it "
                                         "runs"):
        memory.estimate_for_config(TrainConfig())
    with pytest.raises(ValueError, match="cannot cut stages by measured time"):
        memory.estimate_for_config(TrainConfig(distribution="pipeline", partition="time"))


# ------------------------------------------------------------ the training flags (issue 28)

def _estimate_json(argv, capsys) -> dict:
    code, err, out = cli_main(["estimate-memory", *argv, "--json"], capsys)
    assert code == 0, err
    return json.loads(out)


def test_estimate_memory_takes_the_training_flags_as_training_spells_them(capsys):
    """Issue 28: estimate-memory refused --task and --num_virtual_devices (it wanted
    --num_devices); a training command line's flags now give the same layout as the
    run (--num_devices stays as an alias)."""
    four = _one(distribution="mirrored", num_devices=4)
    for argv in (["--num_virtual_devices=4"], ["--num_devices=4"],
                 ["--devices=CPU:0,CPU:1,CPU:2,CPU:3"], ["--num_virtual_devices=4",
                                                         "--num_devices=4"]):
        assert _estimate_json(["--model=mlp", "--task=classification",
                               "--distribution=mirrored", "--global_batch_size=256",
                               *argv], capsys) == four, argv
    # auto, as training: the devices named decide it.
    assert _estimate_json(["--distribution=auto", "--num_virtual_devices=4"], capsys) == four
    assert _estimate_json(["--distribution=auto", "--num_virtual_devices=1"], capsys) == _one()
    # A budget, as training's: the table, then one line when a device cannot hold it.
    code, err, out = cli_main(["estimate-memory", "--device_memory_mb=4"], capsys)
    assert code == 2 and out.strip() == memory.format_memory_estimate(_one())
    assert err == ["tfmulti estimate-memory: error: device 0 (replica 0, stage 0, shard 0) "
                   "needs 7.99 MiB to train mlp under one_device (parameters 1.55 MiB, "
                   "gradients 1.55 MiB, optimizer slots 3.11 MiB, activations 1.78 MiB), over "
                   "the budget of 4 MiB per device; split the model over more devices "
                   "(--num_stages, --tensor_parallel), hold fewer examples at once (a smaller "
                   "--global_batch_size, more --num_microbatches, --remat) or use sgd (no "
                   "optimizer slots)."]


@pytest.mark.parametrize("argv, message", [
    (["--task=regression"], "--task 'regression' does not fit --model 'mlp', which does "
                            "classification; leave --task='auto'."),
    (["--distribution=multi_worker"],
     "a memory estimate of distribution 'multi_worker' needs its devices per worker: estimate "
     "one worker with --distribution='mirrored' and its --num_virtual_devices (or --devices)."),
    (["--distribution=auto"], "distribution 'auto' decides the devices when it runs; name them "
                              "(--num_virtual_devices or --devices) or pick --distribution"),
    (["--distribution=mirrored", "--num_virtual_devices=4", "--num_devices=2"],
     "--num_devices (2) and --num_virtual_devices (4) disagree; pass --num_virtual_devices "
     "alone (--num_devices is its old name)."),
    (["--num_virtual_devices=-1"], "--num_virtual_devices must be an integer >= 0, got -1"),
    (["--distribution=pipeline", "--partition=time"],
     "a memory estimate cannot cut stages by measured time (partition 'time')"),
])
def test_estimate_memory_training_flags_bad_values(argv, message, capsys, monkeypatch):
    """Bad values of the training flags: one line, exit 2, before TensorFlow."""
    from tests.unit.test_cli import _block

    _block(monkeypatch, "tfmulti.memory.estimate")  # any use of the estimate fails the test
    code, err, out = cli_main(["estimate-memory", *argv], capsys)
    assert (code, out, len(err)) == (2, "", 1), err
    assert err[0].startswith(f"tfmulti estimate-memory: error: {message}"), err


TX = "tests.corpus.text_transformer"


@pytest.mark.slow  # seconds of training: the full suite's, not the fast tier's
@pytest.mark.parametrize("program, distribution, replicas", [
    (TX, "pipeline", 1), (TX, "hybrid", 2), ("tests.corpus.structured_data", "pipeline", 1)])
def test_estimate_memory_of_the_users_model_as_a_pipeline(program, distribution, replicas,
                                                          capsys):
    """Issue 28: the pipeline estimate of a user's model (keras-io's text
    transformer) was refused, although training prints that very table: the
    estimate's rows are the placed pipeline's (`pipeline_footprint`). Also with
    text features (keras-io's structured data: string Inputs and a StringLookup,
    whose outputs are floats of a "string" compute dtype)."""
    import keras

    from tfmulti.config.train_config import TrainConfig
    from tfmulti.data.from_config import load_data
    from tfmulti.memory import footprint
    from tfmulti.models.from_config import build_model_for
    from tfmulti.parallel import PipelineModel

    flags = dict(model=f"{program}:build", dataset=f"{program}:data", distribution=distribution,
                 num_stages=2, num_microbatches=2, global_batch_size=16 * replicas,
                 task="classification",
                 **({"num_replicas": replicas} if distribution == "hybrid" else {}))
    estimate = _estimate_json([f"--{k}={v}" for k, v in flags.items()], capsys)
    # The run's pipeline: the model function's model on the host, cut into 2 stages; a
    # hybrid's replicas each hold the same (of 16 examples each).
    config = TrainConfig(**flags)
    with keras.device("CPU:0"):
        model = build_model_for(config, load_data(config))
    pipeline = PipelineModel(model, devices=["CPU:0", "CPU:1"], num_stages=2,
                             num_microbatches=2)
    placed = footprint.pipeline_footprint(pipeline, 16, optimizer="adam")
    assert [{k: v for k, v in row.items() if k not in ("device", "shard", "replica")}
            for row in estimate["devices"]] == replicas * [
                {k: v for k, v in row.items() if k not in ("device", "replica")}
                for row in placed]
    assert [row["replica"] for row in estimate["devices"]] == [r for r in range(replicas)
                                                               for _ in range(2)]
    assert (estimate["num_devices"], estimate["num_stages"], estimate["num_replicas"]) == \
        (2 * replicas, 2, replicas)
    assert memory.estimate_for_config(config) == estimate


def test_tensor_parallel_of_the_users_model_is_refused_in_one_line(capsys):
    """Training splits a user's model over --tensor_parallel devices; the estimate
    counts the built-in transformer's split only, and says so."""
    code, err, out = cli_main(["estimate-memory", "--model=tests.own_model:build",
                               "--dataset=tests.own_model:data", "--distribution=pipeline",
                               "--num_stages=1", "--tensor_parallel=2"], capsys)
    assert (code, out) == (2, "") and err == [
        "tfmulti estimate-memory: error: a memory estimate splits model 'transformer' over "
        "--tensor_parallel (2) devices, not your own model; estimate it with "
        "--tensor_parallel=1 (each stage on one device), or read the table its training run "
        "prints."]


def test_a_model_with_text_inputs_is_estimated_on_one_device(capsys):
    """keras-io's structured data: string Inputs (one example of "" goes through its
    lookups); was a TypeError traceback from NumPy."""
    program = "tests.corpus.structured_data"
    estimate = _estimate_json([f"--model={program}:build", f"--dataset={program}:data",
                               "--global_batch_size=64"], capsys)
    row = estimate["devices"][0]
    assert row["activation_batch"] == 64 and row["activations"] > 0 and row["parameters"] > 0


# ---------------------------------------------------------------- sharded optimizer slots


def _ceil_shards(n: int) -> int:
    """Elements of the mlp's 4 variables in each of n shards."""
    return sum(-(-size // n) for size in (784 * 512, 512, 512 * 10, 10))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_sharded_stage_holds_each_devices_shard_of_the_slots(stage):
    whole, sharded = (_one(distribution="mirrored", num_devices=4, zero_stage=s)
                      for s in (0, stage))
    assert sharded["zero_stage"] == stage and whole["zero_stage"] == 0
    for a, b in zip(whole["devices"], sharded["devices"], strict=True):
        assert b["optimizer_slots"] == 2 * F32 * _ceil_shards(4)  # Adam: 2 slots
        assert b["optimizer_slots"] < a["optimizer_slots"] / 4 + 2 * F32 * 4
        # Stage 2 holds what stage 1 does: each replica's own gradients are whole.
        assert {k: b[k] for k in ("parameters", "gradients", "activations")} == \
            {k: a[k] for k in ("parameters", "gradients", "activations")}
        assert b["total"] == a["total"] - a["optimizer_slots"] + b["optimizer_slots"]
    text = memory.format_memory_estimate(sharded)
    assert text.endswith(f"optimizer_slots: zero_stage={stage}, each device's shard (1/4) of "
                         f"every weight's slots.")


def test_stage_3_also_holds_each_devices_shard_of_the_parameters_and_gradients():
    whole, sharded = (_one(distribution="mirrored", num_devices=4, zero_stage=s) for s in (0, 3))
    for a, b in zip(whole["devices"], sharded["devices"], strict=True):
        assert b["optimizer_slots"] == 2 * F32 * _ceil_shards(4)
        assert b["parameters"] == b["gradients"] == F32 * _ceil_shards(4) < a["parameters"] / 3
        assert b["activations"] == a["activations"]
        assert b["total"] == sum(b[k] for k in ("parameters", "gradients", "optimizer_slots",
                                                "activations"))
    assert memory.format_memory_estimate(sharded).endswith(
        "parameters, gradients: zero_stage=3, each device's shard of them too (the step gathers "
        "them whole when the model is called, until their gradients are computed).")


def test_the_transformer_and_your_own_model_shard_their_slots_too():
    for model, dataset in (("transformer", None), ("tests.own_model:build",
                                                   "tests.own_model:data")):
        whole, sharded = (memory.estimate_memory(model, dataset=dataset, distribution="mirrored",
                                                 num_devices=2, global_batch_size=8,
                                                 zero_stage=s)
                          for s in (0, 1))
        assert sharded["devices"][0]["optimizer_slots"] < whole["devices"][0]["optimizer_slots"]
        assert whole["optimizer_slots_sharded"] == sharded["devices"][1]["optimizer_slots"]


@pytest.mark.parametrize("distribution", ["one_device", "pipeline", "hybrid"])
def test_a_sharded_stage_needs_data_parallel_replicas(distribution):
    with pytest.raises(ValueError, match=rf"^`zero_stage` \(1\) shards the optimizer's slots over "
                                         rf"data-parallel replicas: distribution 'mirrored' .*got "
                                         rf"'{distribution}'; leave zero_stage=0\.$"):
        _one(distribution=distribution, zero_stage=1)
    with pytest.raises(ValueError, match=r"`zero_stage` must be one of \[0, 1, 2, 3\], got 4"):
        _one(distribution="mirrored", num_devices=2, zero_stage=4)


def test_check_fits_names_the_stage_that_makes_it_fit():
    estimate = _one(distribution="mirrored", num_devices=4)
    row = estimate["devices"][0]
    sharded = row["total"] - row["optimizer_slots"] + 2 * F32 * _ceil_shards(4)
    budget = (row["total"] + sharded) / 2 / 2**20  # between the two
    with pytest.raises(ValueError, match=r"over the budget of .* per device; shard the optimizer's "
                                         r"slots over the 4 replicas \(zero_stage=1: .* per "
                                         r"device, which fits\), split"):
        memory.check_fits(estimate, budget)
    memory.check_fits(_one(distribution="mirrored", num_devices=4, zero_stage=1), budget)
    with pytest.raises(ValueError, match=r"\(zero_stage=1: .* per device, still over it\)"):
        memory.check_fits(estimate, sharded / 2 / 2**20)


def test_cli_estimate_memory_takes_zero_stage(capsys):
    code, err, out = cli_main(["estimate-memory", "--model=mlp", "--distribution=mirrored",
                               "--num_virtual_devices=4", "--zero_stage=1", "--json"], capsys)
    assert code == 0, err
    estimate = json.loads(out)
    assert estimate["zero_stage"] == 1
    assert estimate["devices"][0]["optimizer_slots"] == 2 * F32 * _ceil_shards(4)


# ------------------------------------------------------------ embedding tables by rows


def _two_tower(num_devices: int, **kwargs) -> dict:
    """`tests.tables.two_tower` (tables of 1001 and 37 rows, width 8) under
    mirrored on `num_devices`."""
    from tests.tables import clicks, two_tower

    return memory.estimate_memory(two_tower, dataset=clicks, distribution="mirrored",
                                  num_devices=num_devices, global_batch_size=32, **kwargs)


@pytest.mark.parametrize("replicas", [2, 4])
def test_shard_embeddings_holds_each_devices_rows_of_the_tables(replicas):
    """Each device holds ceil(rows / N) rows of each table, of its gradient
    and of Adam's two slots, the dense layers whole: the parameter bytes the
    sharded run holds (tests/unit/test_shard_embeddings.py, read from its
    variables: 4 * (rows * WIDTH + dense)); unsharded, the whole tables."""
    import math

    from tests.tables import ITEMS, USERS, WIDTH

    dense = (16 * 16 + 16) + (16 + 1)  # Dense(16) on the two rows joined, Dense(1)
    whole, sharded = (_two_tower(replicas, shard_embeddings=s) for s in (False, True))
    held = F32 * ((math.ceil(USERS / replicas) + math.ceil(ITEMS / replicas)) * WIDTH + dense)
    everything = F32 * ((USERS + ITEMS) * WIDTH + dense)
    assert whole["shard_embeddings"] is False and "sharded_tables" not in whole
    assert sharded["shard_embeddings"] is True
    assert sharded["sharded_tables"] == [
        {"name": "items_table", "rows": ITEMS, "width": WIDTH,
         "rows_per_device": math.ceil(ITEMS / replicas)},
        {"name": "users", "rows": USERS, "width": WIDTH,
         "rows_per_device": math.ceil(USERS / replicas)}]
    assert len(sharded["devices"]) == replicas
    for a, b in zip(whole["devices"], sharded["devices"], strict=True):
        assert a["parameters"] == a["gradients"] == everything
        assert a["optimizer_slots"] == 2 * everything
        assert b["parameters"] == b["gradients"] == held
        assert b["optimizer_slots"] == 2 * held
        assert b["activations"] == a["activations"]
        assert b["total"] == 4 * held + b["activations"]
    assert memory.format_memory_estimate(sharded).endswith(
        f"\ntables: shard_embeddings, by rows over {replicas} replicas: items_table "
        f"{math.ceil(ITEMS / replicas)} of 37 rows (x 8), users {math.ceil(USERS / replicas)} "
        f"of 1,001 rows (x 8) on each device, with their gradients and optimizer slots.")
    assert "\ntables:" not in memory.format_memory_estimate(whole)
    # With zero_stage: the tables by rows, the dense layers' slots (and at 3 themselves) by 1/N.
    staged = _two_tower(replicas, shard_embeddings=True, zero_stage=3)["devices"][0]
    rows = F32 * (math.ceil(USERS / replicas) + math.ceil(ITEMS / replicas)) * WIDTH
    shards = F32 * sum(math.ceil(size / replicas) for size in (16 * 16, 16, 16, 1))
    assert staged["parameters"] == staged["gradients"] == rows + shards
    assert staged["optimizer_slots"] == 2 * (rows + shards)
    assert sharded["optimizer_slots_sharded"] == 2 * (rows + shards)


def test_the_tables_a_run_shards():
    """The tables picked (`zero.table_layers`, what the run shards and the
    estimate counts): none of fewer rows than replicas, none frozen."""
    from tests.tables import two_tower
    from tfmulti.parallel import zero

    model = two_tower()
    assert [layer.name for layer in zero.table_layers(model, 2)] == ["items_table", "users"]
    assert [layer.name for layer in zero.table_layers(model, 64)] == ["users"]
    assert zero.table_layers(model, 2000) == []
    model.get_layer("users").trainable = False
    assert [layer.name for layer in zero.table_layers(model, 2)] == ["items_table"]


def test_shard_embeddings_without_tables_or_replicas_says_so():
    sharded = _one(distribution="mirrored", num_devices=4, shard_embeddings=True)
    assert sharded["sharded_tables"] == []
    assert sharded["devices"] == _one(distribution="mirrored", num_devices=4)["devices"]
    assert memory.format_memory_estimate(sharded).endswith(
        "\ntables: shard_embeddings, none sharded: no trainable keras.layers.Embedding of 4 "
        "rows or more.")
    one = _two_tower(1, shard_embeddings=True)
    assert one["sharded_tables"] == [] and one["devices"] == _two_tower(1)["devices"]
    assert memory.format_memory_estimate(one).endswith(
        "\ntables: shard_embeddings, none sharded: one replica holds them whole.")


@pytest.mark.parametrize("distribution", ["one_device", "pipeline", "hybrid"])
def test_shard_embeddings_needs_data_parallel_replicas(distribution):
    with pytest.raises(ValueError, match=rf"^`shard_embeddings` splits the tables' rows over "
                                         rf"data-parallel replicas: distribution 'mirrored' \(the "
                                         rf"devices of all workers\), got '{distribution}'; leave "
                                         rf"shard_embeddings off\.$"):
        _one(distribution=distribution, shard_embeddings=True)


@pytest.mark.parametrize("settings,words", [
    ({"sparse_updates": "lazy"}, r"^`sparse_updates` 'lazy' and `shard_embeddings` cannot be "),
    ({"accumulate_steps": 2}, r"^`shard_embeddings` routes each lookup through the replicas "),
    ({"distribution": "pipeline"}, (r"^`shard_embeddings` splits the tables' rows over "
                                    r"data-parallel replicas: .*got 'pipeline'; leave "
                                    r"shard_embeddings off\.$")),
], ids=["lazy", "accumulation", "pipeline"])
def test_estimate_for_config_refuses_what_training_refuses(settings, words):
    from tfmulti.config.train_config import TrainConfig

    config = TrainConfig(**{"distribution": "mirrored", "num_virtual_devices": 2,
                            "shard_embeddings": True, **settings})
    with pytest.raises(ValueError, match=words):
        memory.estimate_for_config(config)


def test_estimate_for_config_and_the_cli_take_shard_embeddings(capsys):
    import math

    from tests.tables import ITEMS, USERS
    from tfmulti.config.train_config import TrainConfig

    config = TrainConfig(model="tests.tables:two_tower", dataset="tests.tables:clicks",
                         distribution="mirrored", num_virtual_devices=4, global_batch_size=32,
                         shard_embeddings=True)
    estimate = memory.estimate_for_config(config)
    assert estimate["devices"] == _two_tower(4, shard_embeddings=True)["devices"]
    argv = ["--model=tests.tables:two_tower", "--dataset=tests.tables:clicks",
            "--distribution=mirrored", "--num_virtual_devices=4", "--global_batch_size=32"]
    cli_estimate = _estimate_json([*argv, "--shard_embeddings"], capsys)
    assert cli_estimate["devices"] == estimate["devices"]
    assert [t["rows_per_device"] for t in cli_estimate["sharded_tables"]] == [
        math.ceil(ITEMS / 4), math.ceil(USERS / 4)]
    code, err, _ = cli_main(["estimate-memory", "--model=mlp", "--distribution=pipeline",
                             "--shard_embeddings"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("tfmulti estimate-memory: error: --shard_embeddings splits the "
                             "tables' rows over data-parallel replicas"), err


@pytest.mark.parametrize("replicas,stage", [(2, 0), (4, 0), (4, 3)])
def test_the_estimate_is_what_a_sharded_run_holds(replicas, stage):
    """The optimizer of `two_tower` sharded as a run shards it (not trained):
    each device's parameters, read from the variables, are the estimate's,
    and its slots the estimate's plus its copy's step count and learning
    rate (int64 and float32), as at zero_stage alone (test_zero.py)."""
    import keras

    from tests.tables import two_tower
    from tfmulti.parallel import zero
    from tfmulti.runtime.strategy import get_strategy

    strategy = get_strategy("mirrored", devices=[f"CPU:{i}" for i in range(replicas)])
    with strategy.scope():
        model = two_tower()
    tables = [layer for layer in model.layers if isinstance(layer, keras.layers.Embedding)]
    zero.shard_optimizer(model.optimizer, model.trainable_variables, strategy, stage,
                         model=model, tables=tables)
    sharding = zero.sharding_of(model.optimizer)
    estimate = _two_tower(replicas, shard_embeddings=True, zero_stage=stage)["devices"]
    assert [row["parameters"] for row in estimate] == list(
        sharding.parameter_bytes_by_device().values())
    assert [row["optimizer_slots"] + 8 + 4 for row in estimate] == list(
        sharding.bytes_by_device().values())
