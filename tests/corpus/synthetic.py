"""Synthetic data the corpus programs share in place of their downloads."""

from __future__ import annotations

import numpy as np


def band_images(n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` MNIST-shaped images (28x28x1, values in [0, 1]): a bright band at
    one of 10 row positions over faint noise, a shape a generative model
    learns in a few steps."""
    x = rng.random((n, 28, 28, 1), dtype=np.float32) * 0.1
    for i, k in enumerate(rng.integers(0, 10, n)):
        x[i, 2 * k + 4: 2 * k + 7, 4:24, 0] = 0.9
    return x
