"""The byte-level transformer laid out over R x S x T devices on one host.

R data-parallel replicas of an S-stage pipeline whose stages are each split
over T devices (tensor parallelism): R*S*T devices, stage s of replica r on
devices[(r*S + s)*T : (r*S + s + 1)*T]. The transformer is built whole in
host memory, split over T devices (`tensor_split.split_transformer`), then cut
into stages and placed by `PipelineModel`, which trains its layer objects
and keeps the replicas equal. Any of R, S, T may be 1.

Example:
    >>> import tfmulti
    >>> _ = tfmulti.configure_virtual_devices(4)
    >>> from tfmulti.parallel.layouts import build_parallel_transformer
    >>> model = build_parallel_transformer(num_stages=2, tensor_parallel=2,
    ...                                    seq_len=8, d_model=16, num_heads=2, num_layers=2)
    >>> [row["variable_devices"] for row in model.placement()] == [
    ...     [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (0, 1)],
    ...     [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (2, 3)]]
    True
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmulti.utils import checks
from tfmulti.models import transformer
from tfmulti.config.train_config import check_transformer_sizes
from tfmulti.parallel.pipeline import PipelineModel, choose_devices
from tfmulti.parallel.tensor_split import split_transformer

__all__ = ["build_parallel_transformer"]


def build_parallel_transformer(*, num_replicas: int = 1, num_stages: int = 1,
                               tensor_parallel: int = 1, num_microbatches: int = 1,
                               devices=None, partition="params", remat: bool = False,
                               accumulate_steps: int = 1, seed: int | None = None,
                               **sizes) -> keras.Model:
    """A `tfmulti.models.transformer` language model over R x S x T devices.

    Args:
        num_replicas: R data-parallel replicas.
        num_stages: S pipeline stages per replica.
        tensor_parallel: T devices each stage is split over.
        num_microbatches: M, GPipe micro-batches per replica batch.
        devices (Sequence[str] | None): R*S*T device names (see the module
            docstring); default: the first R*S*T logical GPUs, else CPUs.
        partition (str | Sequence[int]): as `PipelineModel`'s.
        remat: as `PipelineModel`'s.
        accumulate_steps: as `PipelineModel`'s.
        seed: seeds the weights (`build_transformer`).
        **sizes (int | float | bool): `build_transformer`'s sizes (seq_len, d_model, num_heads,
            num_layers, mlp_ratio, dropout, padding_mask, vocab_size).

    Returns:
        The plain transformer when R = S = T = 1, else a `PipelineModel`
        (S and R may be 1), which builds the optimizer slots on their
        variables' devices when compiled.

    Raises:
        ValueError: a degree that is not a positive integer, sizes that T
            does not split evenly, or devices that do not fit the layout
            (see `PipelineModel`).
    """
    for name, value in (("num_replicas", num_replicas), ("num_stages", num_stages),
                        ("tensor_parallel", tensor_parallel)):
        checks.positive_int(name, value)
    # Whole in host memory first: one accelerator may not hold the model.
    with tf.device("/CPU:0"):
        model = transformer.build_transformer(seed=seed, **sizes)
    if num_replicas * num_stages * tensor_parallel == 1:
        return model
    sizes = transformer.transformer_sizes(model)
    del sizes["padding_mask"]
    check_transformer_sizes(**sizes, tensor_parallel=tensor_parallel)
    devices = choose_devices(devices, num_stages, num_replicas, tensor_parallel)
    if tensor_parallel > 1:  # on the first stage's devices until the pipeline places it
        model = split_transformer(model, devices[:tensor_parallel])
    return PipelineModel(model, devices=devices, num_stages=num_stages,
                         num_replicas=num_replicas, num_microbatches=num_microbatches,
                         partition=partition, remat=remat, accumulate_steps=accumulate_steps,
                         name=model.name)
