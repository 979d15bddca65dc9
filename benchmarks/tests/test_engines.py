"""benchmarks.engines without running an engine (the engines run in
`python -m benchmarks.engines`; SLURM itself is tested in tests/integration/test_slurm.py)."""

from __future__ import annotations

import pytest

from benchmarks import engines


def test_an_unknown_engine_or_no_repeat_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"engines must be among launch, srun.*\['kubernetes'\]"):
        engines.run(1, ("launch", "kubernetes"))
    with pytest.raises(ValueError, match=r"repeats >= 1 \(got 0\)"):
        engines.run(0)


def test_summarize_names_each_engine_and_its_ratio_to_launch():
    one = {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    ratio = {"median": 0.98, "min": 0.95, "max": 1.01, "n": 3}
    lines = engines.summarize({"examples_per_second": {"launch": one, "srun": one},
                               "vs_launch": {"srun": ratio}})
    assert lines == ["launch: 2 examples/s (min 1, max 3, 3 repeats)",
                     "srun: 2 examples/s (min 1, max 3, 3 repeats)",
                     "srun / launch: 0.98x (min 0.95, max 1.01, 3 repeats) "
                     "(goal: within 5% of 1.00x)"]

