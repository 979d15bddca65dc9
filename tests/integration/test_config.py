"""tfmulti.config.train_config: TrainConfig.validate, the steps-per-execution policy, the
model tasks and validate_for_diagnose (pure Python, no TensorFlow needed)."""

from __future__ import annotations


import pytest

from tests._util import run_python


# ------------------------------------------------------------------------ no TensorFlow


@pytest.mark.slow
def test_importing_the_configuration_layer_loads_no_tensorflow():
    code = ("import sys; import tfmulti.config.train_config, tfmulti.config.flags, tfmulti.utils.checks, "
            "tfmulti.utils.tables; tfmulti.config.train_config.TrainConfig().validate(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('tensorflow', 'keras', 'tensorflow_datasets')))")
    result = run_python(["-c", code], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
    assert result.stderr == ""
