"""tfmulti.parallel.layouts: the transformer over R x S x T devices (its
training is compared with the plain model in tests/unit/test_transformer.py)."""

from __future__ import annotations

import keras
import pytest

from tfmulti.parallel import PipelineModel, build_parallel_transformer
from tfmulti.parallel.tensor_layers import ParallelMultiHeadAttention

SIZES = dict(seq_len=8, d_model=16, num_heads=4, num_layers=2)


def test_one_device_is_the_plain_transformer():
    model = build_parallel_transformer(**SIZES)
    assert isinstance(model, keras.Model) and not isinstance(model, PipelineModel)
    assert not any(isinstance(l, ParallelMultiHeadAttention) for l in model.layers)


@pytest.mark.parametrize("replicas,stages,shards,groups", [
    (1, 2, 2, [[0, 1], [2, 3]]),
    (2, 1, 2, [[0, 1], [2, 3]]),
    (1, 1, 4, [[0, 1, 2, 3]]),
    (2, 2, 1, [[0], [1], [2], [3]]),
])
def test_each_stage_holds_its_group_of_devices(replicas, stages, shards, groups):
    model = build_parallel_transformer(num_replicas=replicas, num_stages=stages,
                                       tensor_parallel=shards, num_microbatches=2, **SIZES)
    assert (model.num_replicas, model.num_stages, model.tensor_parallel) == (replicas, stages,
                                                                             shards)
    assert [sorted(int(d.rsplit(":", 1)[1]) for d in row["variable_devices"])
            for row in model.placement()] == groups


def test_too_few_devices_names_the_layout_and_the_fix():
    with pytest.raises(ValueError, match=r"2 stages x 2 replicas x 2 tensor-parallel "
                                         r"devices need 8 devices, found 4.*"
                                         r"configure_virtual_devices\(8\)"):
        build_parallel_transformer(num_replicas=2, num_stages=2, tensor_parallel=2, **SIZES)
    with pytest.raises(ValueError, match=r"`tensor_parallel` \(3\) must divide num_heads \(4\)"):
        build_parallel_transformer(tensor_parallel=3, devices=["CPU:0", "CPU:1", "CPU:2"],
                                   **SIZES)


def test_a_padding_mask_input_reaches_every_stage():
    import numpy as np

    from tfmulti.models import transformer

    plain = transformer.build_transformer(**SIZES, padding_mask=True, seed=0)
    model = build_parallel_transformer(num_stages=2, tensor_parallel=2, padding_mask=True,
                                       seed=0, **SIZES)
    tokens = np.arange(24, dtype="int32").reshape(3, 8)
    mask = np.arange(8)[None].repeat(3, 0) < np.array([[8], [5], [2]])
    inputs = {"tokens": tokens, "padding_mask": mask}
    # Both stages attend (the blocks are cut between them), each with the mask.
    assert model.num_stages == 2
    assert [sum(n.endswith("_attention") for n in row["layers"]) for row in model.placement()] \
        == [1, 1]
    np.testing.assert_allclose(model(inputs), plain(inputs), atol=1e-5)
