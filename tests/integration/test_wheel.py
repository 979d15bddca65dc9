"""The wheel is the whole tool: it holds the product only (the `tfmulti`
package with every layer's folder, none of the checkout's benchmarks, fault
campaign, simulated hosts, recipes or tests: setup.cfg,
`[options.packages.find]`), and installed into a fresh virtual environment
outside the checkout it trains, launches, estimates and reports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import keras
import pytest

from tests import two_outputs
from tests._util import REPO, tf_log_lines
from tfmulti.training import outputs

# The checkout, less what is not source (copied, so that the build's own
# build/ and .egg-info folders land in the copy).
_SKIP = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "runs", "*.egg-info",
                               "__pycache__", "*.pyc", ".ipynb_checkpoints", "*_cache")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """tfmulti's wheel, built from a copy of the checkout (once per module)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source, out = tmp / "source", tmp / "dist"
    shutil.copytree(REPO, source, ignore=_SKIP)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = out.glob("tfmulti-*.whl")
    return built


@pytest.mark.slow  # builds the wheel in another process
@pytest.mark.timeout(600)
def test_the_wheel_holds_the_product_only(wheel):
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
    # The license travels with the wheel (setup.cfg, license_files).
    license_file = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE")
                        or n.endswith(".dist-info/LICENSE"))
    assert "Apache License" in zipfile.ZipFile(wheel).read(license_file).decode()


# Run in the fresh environment: where tfmulti and each module it loaded come from.
_WHERE = """
import json, sys, tfmulti, tfmulti.cli
print(json.dumps({"tfmulti": tfmulti.__file__, "path": sys.path,
                  "modules": sorted({m.__file__ for m in list(sys.modules.values())
                                     if getattr(m, "__file__", None)})}))
"""

KERAS_HUB_UNMET = tuple(f"{name} " for name in ("keras-hub", "tokenizers", "tensorflow-text",
                                                 "sentencepiece", "regex"))
"""The packages `make test` installs without their dependencies (the Makefile's KERAS_HUB, for
tests/integration/test_keras_hub.py: keras-hub's preset downloads, kagglehub, and the
Hugging Face hub, unused there): `pip check` may find their requirements unmet."""


@pytest.mark.slow  # builds the wheel, makes a virtual environment, trains in processes
@pytest.mark.cluster  # and launches a 2-worker cluster
@pytest.mark.timeout(1500)
def test_the_wheel_installed_outside_the_checkout_is_the_whole_tool(wheel, tmp_path):
    """Installs the wheel into a fresh virtual environment in a temporary folder
    and runs the `tfmulti` command there, from a working directory outside the
    checkout, with no PYTHONPATH: `--version`, `launch --num_workers 2 -- tfmulti
    train --distribution=multi_worker` of a user's program in that directory (a
    model function that compiles two outputs: each worker runs the wheel's
    `tfmulti train`, keeping the author's compile; the chief alone writes and
    reports, with the saved model's test loss, the other worker says it is done),
    `estimate-memory` and `env`.

    Proves: the wheel alone (no file of the repository: no recipe, no test
    helper, no editable install) is the tool: every module the `tfmulti`
    command loads comes from the fresh environment's copy or from the
    dependencies; `pip check` there finds the wheel's requirements met by the
    dependencies it sees; the console script and `tfmulti launch`'s workers
    (found on PATH) are the wheel's.

    Does not prove: that `pip install tfmulti` resolves and downloads those
    dependencies from the index (installing TensorFlow afresh takes minutes and
    GBs): the fresh environment borrows the test environment's installed
    packages through a `.pth` line naming its site-packages (Python appends
    that folder without running its own `.pth` files, so the test
    environment's editable tfmulti stays invisible: checked below), and the
    wheel is installed with `--no-deps`, by the test environment's pip run
    with the fresh environment's interpreter (`pip --python`: the environment is
    made without pip of its own, which saves ensurepip's install). Nor does it
    prove other Python versions or platforms.
    """
    venv, home = tmp_path / "venv", tmp_path / "home"
    home.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=300, capture_output=True)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    borrowed = site / "_tfmulti_test_dependencies.pth"
    # A user's shell: none of the test environment's Python, TensorFlow (its log level
    # among them: the start must be quiet by itself) or tfmulti variables.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "TF_", "TFMULTI_", "VIRTUAL_ENV"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               TFDS_DATA_DIR=str(home / "tensorflow_datasets"), HOME=str(home))

    def run(*args, timeout: float = 600) -> subprocess.CompletedProcess:
        result = subprocess.run(list(args), capture_output=True, text=True, env=env,
                                cwd=home, timeout=timeout)
        assert result.returncode == 0, (args, result.stdout[-4000:], result.stderr[-4000:])
        return result

    # The test environment's dependencies are visible, its editable tfmulti is not.
    borrowed.write_text(sysconfig.get_paths()["purelib"] + "\n")
    check = run(str(python), "-c", "import importlib.util as u; print(u.find_spec('tfmulti'), "
                                   "u.find_spec('tensorflow').origin)")
    assert check.stdout.split()[0] == "None", check.stdout
    assert check.stdout.split()[1].startswith(sysconfig.get_paths()["purelib"]), check.stdout
    # The wheel, installed alone (the borrowed folder out of sight: pip would
    # otherwise see the test environment's tfmulti as the one to replace).
    borrowed.rename(borrowed.with_suffix(".off"))
    pip = (sys.executable, "-m", "pip", "--python", str(python))
    run(*pip, "install", "-q", "--no-deps", "--no-index", str(wheel))
    borrowed.with_suffix(".off").rename(borrowed)
    # Only the packages installed without their dependencies may have requirements
    # unmet (KERAS_HUB_UNMET): nothing of the wheel's.
    checked = subprocess.run(list(pip) + ["check"], capture_output=True, text=True, env=env,
                             cwd=home, timeout=600)
    unmet = [line for line in checked.stdout.splitlines()
             if line.strip() and not line.startswith(KERAS_HUB_UNMET)]
    assert checked.returncode == 0 or (unmet == [] and checked.stdout.strip()), (
        checked.stdout[-4000:], checked.stderr[-4000:])

    where = json.loads(run(str(python), "-c", _WHERE).stdout)
    assert Path(where["tfmulti"]).is_relative_to(site), where["tfmulti"]
    checkout = [p for p in [*where["path"], *where["modules"]]
                if p and Path(p).resolve().is_relative_to(REPO)
                and not Path(p).resolve().is_relative_to(REPO / ".venv")]
    assert checkout == [], checkout

    tfmulti, version = str(bin_dir / "tfmulti"), wheel.name.split("-")[1]
    assert run(tfmulti, "--version").stdout.split() == ["tfmulti", version]
    # A user's own program in the working directory: a model function that compiles
    # two outputs (a loss, a loss weight and metrics per output), with its data.
    shutil.copy(REPO / "tests" / "two_outputs.py", home / "tickets.py")
    train = ("train", "--model=tickets:build", "--dataset=tickets:data", "--epochs=2",
             "--global_batch_size=64")
    # `tfmulti launch` of `tfmulti train`, each worker's `tfmulti` the wheel's (found on
    # PATH): the one cluster of `tfmulti train` the suite launches (tests/integration/
    # test_train_command.py held a second one, of the checkout's console script).
    launched = run(tfmulti, "launch", "--num_workers", "2", "--", "tfmulti", *train,
                   "--distribution=multi_worker", f"--model_dir={home / 'two'}", timeout=900)
    output = launched.stdout + launched.stderr
    assert f"[worker 1] {outputs.OTHER_WORKER_LINE}" in output, output[-4000:]
    # The workers' TensorFlow start-up lines dropped (tfmulti.utils.quiet; the quiet
    # start's other cases: tests/integration/test_quiet.py).
    assert tf_log_lines(output) == [], output[-4000:]
    assert (home / "two" / ".tfmulti-run.json").is_file()
    metrics = json.loads((home / "two" / "metrics.json").read_text())
    assert metrics["num_replicas"] == 2
    assert f"[worker 0] {outputs.summary_line(metrics)}" in output, output[-4000:]
    # Both workers kept the author's compile; the reported test loss is the saved
    # model's compiled loss on the test split.
    assert output.count("training the model as your model function compiled it (RMSprop") == 2
    x, y = two_outputs.data()[1]
    evaluated = keras.models.load_model(home / "two" / "model.keras").evaluate(
        x, y, batch_size=64, verbose=0, return_dict=True)
    assert metrics["test_loss"] == pytest.approx(evaluated["loss"], rel=0.01)
    assert metrics["outputs"] == ["department", "priority"]
    estimate = run(tfmulti, "estimate-memory", "--model=mlp", "--json")
    assert json.loads(estimate.stdout)
    assert tf_log_lines(estimate.stdout + estimate.stderr) == [], estimate.stderr[-4000:]
    # The installed distribution's metadata is the wheel's (not the test environment's).
    ran = run(tfmulti, "env")
    report = ran.stdout
    assert tf_log_lines(ran.stdout + ran.stderr) == [], ran.stderr[-4000:]
    assert re.search(rf"^tfmulti +{re.escape(version)}$", report, re.M), report
    assert re.search(r"^tensorflow +2\.", report, re.M), report
