"""The pipeline-stage partitioner: exact balancing, cost methods, plans, errors.
Its docstring examples run in tests/unit/test_docstrings.py."""

from __future__ import annotations

import itertools
import math
import random

import keras
import pytest

from tfmulti.parallel import chain as blocks
from tfmulti.parallel import partition


def _stage_sums(costs, sizes):
    sums, start = [], 0
    for size in sizes:
        sums.append(math.fsum(costs[start:start + size]))
        start += size
    return sums


def _compositions(n, s):
    for cuts in itertools.combinations(range(1, n), s - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def _tie_break_key(costs, sizes):
    """The documented order: max, sum of squared costs, sum of squared sizes, sizes."""
    sums = _stage_sums(costs, sizes)
    return (max(sums), sum(c * c for c in sums), sum(k * k for k in sizes), sizes)


def _dense_stack(widths, input_dim):
    return keras.Sequential(
        [keras.Input((input_dim,))]
        + [keras.layers.Dense(w, name=f"dense{i}") for i, w in enumerate(widths)])


# --- pure core --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["int", "float"])
def test_partition_costs_is_optimal_against_brute_force(kind):
    rng = random.Random(1234 if kind == "int" else 4321)
    for _ in range(100):
        n = rng.randint(1, 8)
        s = rng.randint(1, n)
        if kind == "int":  # small ints make ties (and zeros) frequent
            costs = [rng.randint(0, 6) for _ in range(n)]
        else:
            costs = [rng.uniform(0, 10) for _ in range(n)]
        sizes = partition_costs_checked(costs, s)
        brute = min(max(_stage_sums(costs, c)) for c in _compositions(n, s))
        assert math.isclose(max(_stage_sums(costs, sizes)), brute, rel_tol=1e-12, abs_tol=0), (
            costs, s, sizes)
        if kind == "int":  # exact arithmetic: the documented tie-break rule holds exactly
            best = min(_compositions(n, s), key=lambda c: _tie_break_key(costs, c))
            assert sizes == best, (costs, s)


def partition_costs_checked(costs, s):
    sizes = partition.partition_costs(costs, s)
    assert isinstance(sizes, list) and len(sizes) == s
    assert all(isinstance(k, int) and k >= 1 for k in sizes)
    assert sum(sizes) == len(costs)
    return sizes


def test_known_example():
    costs = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    sizes = partition.partition_costs(costs, 3)
    assert max(_stage_sums(costs, sizes)) == 17
    assert sizes == [5, 2, 2]  # 15, 13, 17: the only split whose largest stage is 17


def test_tie_breaking_is_documented_rule():
    # 1. Most balanced costs: after the 6, [3 | 1 1 1] (3, 3) beats [3 1 | 1 1] (4, 2),
    #    although the latter has more even layer counts.
    assert partition.partition_costs([6, 3, 1, 1, 1], 3) == [1, 1, 3]
    # 2. Then the most even layer counts: every split of zeros is optimal.
    assert partition.partition_costs([0, 0, 0, 0, 0], 2) == [2, 3]
    assert partition.partition_costs([0, 0, 0, 0, 0, 0], 3) == [2, 2, 2]
    # 3. Then the earliest boundary: [1 | 0 1] and [1 0 | 1] tie on everything else.
    assert partition.partition_costs([1, 0, 1], 2) == [1, 2]


def test_single_stage_and_one_layer_per_stage():
    assert partition.partition_costs([3.0, 1.0, 2.0], 1) == [3]
    assert partition.partition_costs([3.0, 1.0, 2.0], 3) == [1, 1, 1]


@pytest.mark.parametrize("costs, num_stages, match", [
    ([1, 2, 3], 5, r"^the model cannot be cut into 5 stages: it has 3 layers; use at most 3 "
                   r"stages\.$"),
    ([1, 2, 3], 0, r"^`num_stages` must be a positive integer, got 0; pass e.g. num_stages=2"),
    ([1, 2, 3], -1, r"^`num_stages` must be a positive integer, got -1"),
    ([1, 2, 3], 2.0, r"^`num_stages` must be a positive integer, got 2.0"),
    ([1, -2, 3], 2, r"^costs\[1\] is negative \(-2.0\)"),
    ([1, float("nan"), 3], 2, r"^costs\[1\] is not finite \(nan\)"),
    ([1, 2, float("inf")], 2, r"^costs\[2\] is not finite \(inf\)"),
    ([1, "a"], 1, r"^costs\[1\] is not a number"),
    ([], 1, r"^costs is empty"),
])
def test_partition_costs_errors(costs, num_stages, match):
    with pytest.raises(ValueError, match=match):
        partition.partition_costs(costs, num_stages)


def test_validate_sizes():
    assert partition.validate_sizes((2, 3), 5, 2) == [2, 3]
    with pytest.raises(ValueError, match=r"^stage sizes \(2, 2\) sum to 4 but the stack has 5"):
        partition.validate_sizes([2, 2], 5, 2)
    with pytest.raises(ValueError, match=r"^sizes\[0\] is 0; every stage needs at least one"):
        partition.validate_sizes([0, 5], 5, 2)
    with pytest.raises(ValueError, match=r"^got 3 stage sizes \(1, 2, 2\) for num_stages=2"):
        partition.validate_sizes([1, 2, 2], 5, 2)
    with pytest.raises(ValueError, match=r"^sizes\[1\] must be an integer"):
        partition.validate_sizes([2, 3.0], 5, 2)


def test_balance_ratio():
    assert partition.balance_ratio([2, 2, 2]) == 1.0
    assert partition.balance_ratio([0, 0]) == 1.0
    assert partition.balance_ratio([3, 1]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match=r"^stage_costs is empty"):
        partition.balance_ratio([])


# --- Keras stacks -------------------------------------------------------------


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("method", ["params", "flops"])
def test_uniform_dense_stack_is_perfectly_balanced(num_stages, method):
    model = _dense_stack([16] * 8, 16)
    plan = partition.plan_partition(model, num_stages, method=method)
    assert plan.sizes == (8 // num_stages,) * num_stages
    assert plan.balance == 1.0
    assert len({stage.cost for stage in plan.stages}) == 1


def test_params_method_on_mlp():
    model = _dense_stack([512, 256, 10], 784)
    costs = partition.layer_costs(model, "params")
    assert costs == [784 * 512 + 512, 512 * 256 + 256, 256 * 10 + 10]
    plan = partition.plan_partition(model, 2)  # "params" is the default
    assert plan.method == "params"
    assert plan.sizes == (1, 2)
    assert sum(stage.num_params for stage in plan.stages) == model.count_params()
    for stage in plan.stages:
        assert stage.param_bytes == 4 * stage.num_params  # float32
    assert plan.stages[1].layer_names == ("dense1", "dense2")
    assert plan.balance == pytest.approx(401920 / ((401920 + 133898) / 2))
    assert [s.stop - s.start for s in plan.slices] == [1, 2]


def test_flops_method_dense_and_conv2d():
    model = _dense_stack([512], 784)
    assert partition.layer_costs(model, "flops") == [2 * 784 * 512 + 512]

    # 8x8x3 input, 3x3 valid conv with 4 filters -> 6x6x4; then relu; then flatten.
    layers = [keras.layers.Conv2D(4, 3, name="conv"), keras.layers.ReLU(name="relu"),
              keras.layers.Flatten(name="flat"),
              keras.layers.Dense(5, use_bias=False, name="head")]
    costs = partition.layer_costs(layers, "flops", input_shape=(8, 8, 3))
    conv = 2 * 3 * 3 * 3 * 4 * 6 * 6 + 4 * 6 * 6  # 2*kh*kw*cin*cout*H*W + bias
    assert costs == [conv, 6 * 6 * 4, 6 * 6 * 4, 2 * 144 * 5]
    assert all(layer.built for layer in layers)  # built on the way from input_shape


def test_time_method_runs():
    model = _dense_stack([8, 8], 8)
    costs = partition.layer_costs(model, "time", batch_size=4)
    assert len(costs) == 2 and all(c > 0 for c in costs)
    plan = partition.plan_partition(model, 2, method="time", batch_size=4)
    assert plan.sizes == (1, 1) and plan.method == "time"


def test_explicit_sizes():
    model = _dense_stack([4, 4, 4], 4)
    plan = partition.plan_partition(model, 2, method=[2, 1])
    assert plan.sizes == (2, 1) and plan.method == "explicit"
    assert plan.stages[0].cost == plan.stages[0].num_params == 40
    with pytest.raises(ValueError, match=r"^stage sizes \(1, 1\) sum to 2 but the stack has 3"):
        partition.plan_partition(model, 2, method=[1, 1])
    with pytest.raises(ValueError, match=r"^got 3 stage sizes"):
        partition.plan_partition(model, 2, method=[1, 1, 1])


def test_plan_errors():
    model = _dense_stack([4, 4, 4], 4)
    with pytest.raises(ValueError, match=r"^model '\w+' cannot be cut into 4 stages: it has 3 "
                                         r"layers; use at most 3 stages\.$"):
        partition.plan_partition(model, 4)
    with pytest.raises(ValueError, match=r"^unknown method 'bytes'; valid methods: params, flops"):
        partition.plan_partition(model, 2, method="bytes")
    with pytest.raises(ValueError, match=r"^unknown cost method 'bytes'; valid methods"):
        partition.layer_costs(model, "bytes")
    with pytest.raises(ValueError, match=r"^layer 'late' is not built.*pass input_shape="):
        partition.plan_partition([keras.layers.Dense(3, name="late")], 1)
    with pytest.raises(ValueError, match=r"^method \"flops\" needs the input shape"):
        layer = keras.layers.Dense(3)
        layer.build((None, 2))
        partition.layer_costs([layer], "flops")
    dense = keras.layers.Dense(3, name="twice")
    with pytest.raises(ValueError, match=r"^layer 'twice' appears more than once"):
        partition.plan_partition([dense, dense], 1, input_shape=(3,))


def test_plan_partition_takes_a_chain_as_it_is():
    model = _dense_stack([4, 8, 4], 4)
    chain = blocks.chain_of(model)
    assert partition.plan_partition(chain, 2).sizes == partition.plan_partition(model, 2).sizes
    assert partition.layer_costs(chain, "params") == partition.layer_costs(model, "params")


class _Chain:
    """What check_stage_count reads of a chain of blocks."""

    name, unit, why_not, blocks = "m", "blocks", "Why not.", ("first", "second")


def test_check_stage_count_is_the_one_stage_count_check():
    assert partition.check_stage_count(3, 3) == 3
    assert partition.check_stage_count(4) == 4  # no layers given: positive is enough
    with pytest.raises(ValueError, match=r"^model 'm' cannot be cut into 3 stages per replica "
                                         r"\(`devices` lists 3\): it has 2 blocks \(a cut needs a "
                                         r"point crossed by a single tensor\); pass at most 2 "
                                         r"devices per replica\. Why not\.$"):
        partition.check_stage_count(3, chain=_Chain(), devices=["CPU:0", "CPU:1", "CPU:2"])


def test_functional_models():
    # Two inputs joined by a stateless layer: the join is a side computation
    # of the one block, recomputed by the stage that needs it.
    a, b = keras.Input((4,)), keras.Input((4,))
    two_inputs = keras.Model([a, b], keras.layers.Dense(2, name="d")(
        keras.layers.Concatenate()([a, b])))
    plan = partition.plan_partition(two_inputs, 1)
    assert [s.layer_names for s in plan.stages] == [("d",)]
    # A residual block stays whole: blocks "first" and "inner..residual".
    x = keras.Input((4,))
    h = keras.layers.Dense(4, name="first")(x)
    branch = keras.Model(x, keras.layers.Add(name="residual")(
        [h, keras.layers.Dense(4, name="inner")(h)]), name="branch")
    plan = partition.plan_partition(branch, 2)
    assert [s.layer_names for s in plan.stages] == [("first",), ("inner", "residual")]
    assert partition.layer_costs(branch, "params") == [20, 20]
    with pytest.raises(ValueError, match=r"^model 'branch' cannot be cut into 3 stages: it has 2 "
                                         r"blocks"):
        partition.plan_partition(branch, 3)
    with pytest.raises(ValueError, match=r"^stage sizes \(1, 2\) sum to 3 but the stack has 2 "
                                         r"blocks"):
        partition.plan_partition(branch, 2, method=[1, 2])
    # A single chain is accepted, in call order.
    x = keras.Input((4,))
    y = keras.layers.Dense(6, name="c2")(keras.layers.Dense(5, name="c1")(x))
    plan = partition.plan_partition(keras.Model(x, y), 2, method="flops")
    assert [s.layer_names for s in plan.stages] == [("c1",), ("c2",)]


def test_flops_of_attention_and_embedding():
    # Self-attention of width d over T positions: 4 projections (T*d*d
    # multiply-adds each) and 2 attention products (T*T*d each), 2 FLOPs per
    # multiply-add; an embedding is a gather: one read per output element.
    seq, width, heads = 6, 8, 2
    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(50, width, name="embedding")(tokens)
    attended = keras.layers.MultiHeadAttention(heads, width // heads, name="attention")(x, x)
    model = keras.Model(tokens, keras.layers.Add(name="residual")([x, attended]))
    costs = partition.layer_costs(model, "flops")
    assert costs == [seq * width,  # embedding
                     2 * (4 * seq * width ** 2 + 2 * seq ** 2 * width) + seq * width]
    # Cross-attention: queries of 3 positions over 5 keys of width 4 (another
    # projection width), value dim 6, output width 7.
    query, memory = keras.Input((3, 8)), keras.Input((5, 4))
    layer = keras.layers.MultiHeadAttention(2, 5, value_dim=6, output_shape=7, use_bias=False)
    cross = keras.Model([query, memory], layer(query, memory))
    macs = (3 * 8 * 10 + 5 * 4 * 10 + 5 * 4 * 12  # query, key, value projections
            + 3 * 5 * 10 + 3 * 5 * 12  # scores, weighted values
            + 3 * 12 * 7)  # output projection
    assert partition.layer_costs(cross, "flops") == [2 * macs]


def test_time_method_on_a_functional_model_with_integer_inputs():
    tokens = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(10, 8)(tokens)
    model = keras.Model(tokens, keras.layers.Dense(3)(keras.layers.Dense(8)(x)))
    costs = partition.layer_costs(model, "time", batch_size=2)
    assert len(costs) == 3 and all(c > 0 for c in costs)


def test_table_and_repr():
    model = _dense_stack([512, 256, 10], 784)
    plan = partition.plan_partition(model, 2)
    table = plan.table()
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["stage", "layers", "count"]
    assert lines[1].split()[:3] == ["0", "dense0", "1"]
    assert lines[2].split()[:3] == ["1", "dense1..dense2", "2"]
    assert "401,920" in lines[1] and "1.5 MiB" in lines[1] and "75.0%" in lines[1]
    assert lines[-1] == "balance (max/mean stage cost, 1.00 is perfect): 1.50"
    assert len({len(line) for line in lines[:-1]}) == 1  # aligned columns (tfmulti.utils.tables)
    assert repr(plan) == "PartitionPlan(method='params', sizes=(1, 2), balance=1.50)"
