"""The wheel holds the product only: the `tfmulti` package with every layer's
folder, none of the checkout's benchmarks, fault campaign, simulated hosts,
recipes or tests (setup.cfg, `[options.packages.find]`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests._util import REPO

# The checkout, less what is not source (copied, so that the build's own
# build/ and .egg-info folders land in the copy).
_SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "runs", "*.egg-info",
                               "__pycache__", "*.pyc", ".ipynb_checkpoints")


@pytest.mark.slow  # builds the wheel in another process
@pytest.mark.timeout(600)
def test_the_wheel_holds_the_product_only(tmp_path):
    source, out = tmp_path / "source", tmp_path / "wheel"
    shutil.copytree(REPO, source, ignore=_SKIP)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = out.glob("tfmulti-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tfmulti"}, sorted(tops)
    for name in names:
        assert not name.startswith(("benchmarks/", "recipes/", "tests/", "tfmulti/bench")), name
        assert "simulated_hosts" not in name and "chaos" not in name, name
        assert "/tests/" not in name and not name.rpartition("/")[2].startswith("test_"), name
        assert "conftest" not in name, name
    folders = {name.rpartition("/")[0] + "/" for name in names if name.endswith(".py")}
    for package in ("cluster", "config", "insight", "memory", "models", "data",
                    "parallel", "runtime", "training", "training/backup", "utils"):
        assert f"tfmulti/{package}/" in folders, sorted(folders)
        assert f"tfmulti/{package}/__init__.py" in names
    assert {"tfmulti/__init__.py", "tfmulti/cli.py", "tfmulti/utils/failpoints.py"} <= set(names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "tfmulti = tfmulti.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
