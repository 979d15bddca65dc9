"""The package's architecture: layers that import downward (the import-linter
contracts in setup.cfg), no import cycles, no TensorFlow below the core."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests._util import REPO

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "setup.cfg", "--no-cache"]


def _lint(root) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(LINT, cwd=root, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_layer_contracts_hold():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("module,planted", [
    ("tfmulti/config/train_config.py", "from tfmulti.models import builders"),  # config -> models
    ("tfmulti/data/catalog.py", "def _late():\n    from tfmulti.insight import timing"),  # lazy
    ("tfmulti/models/builders.py", "from tfmulti.data import catalog"),  # siblings
    ("tfmulti/cluster/plan.py", "import tensorflow"),  # TensorFlow in the launcher
])
def test_a_planted_violation_breaks_a_contract(tmp_path, module, planted):
    """A copy of the package with one upward import (or TensorFlow where it
    must not be) fails the same contracts."""
    shutil.copytree(REPO / "tfmulti", tmp_path / "tfmulti",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "setup.cfg", tmp_path / "setup.cfg")
    with open(tmp_path / module, "a") as f:
        f.write(f"\n\n{planted}\n")
    result = _lint(tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "BROKEN" in result.stdout and " 0 broken" not in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
def test_tensorflow_stays_unloaded_for_configuration_and_launcher():
    code = ("import sys; import tfmulti.config.train_config, tfmulti.config.flags, "
            "tfmulti.config.user_functions, tfmulti.cluster, tfmulti.cluster.supervisor, "
            "tfmulti.cli, tfmulti.utils.checks, tfmulti.utils.tables, tfmulti.utils.atomic, "
            "tfmulti.utils.failpoints, tfmulti.parallel.partition, tfmulti.parallel.schedule; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('tensorflow', 'keras', 'tf_keras')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
