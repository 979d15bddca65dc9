"""Every suite of recipes/benchmark.py, the fault campaign (recipes/chaos.py)
and the GPU check (recipes/gpu_check.py) run end to end from the command line,
at toy size: the suites with `--toy` (each suite's `TOY`: its whole code path
in seconds), one repeat. A suite that crashes fails here; its figures are not
checked (BENCHMARKS.md)."""

from __future__ import annotations

import json
import shutil

import pytest

import benchmarks as bench
from tests._util import run_recipe


def test_every_suite_has_a_toy_size():
    for name, suite in bench.SUITES.items():
        assert isinstance(getattr(suite, "TOY", None), dict) and suite.TOY, name


# The own suite runs end to end in benchmarks/tests/test_bench.py
# (test_own_suite_runs_end_to_end, its figures checked).
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("suite", [name for name in bench.SUITES if name != "own"])
def test_each_suite_runs_end_to_end(suite, tmp_path):
    output = tmp_path / f"{suite}.json"
    result = run_recipe("benchmark", f"--suite={suite}", "--repeats=1", "--toy",
                        f"--output={output}", timeout=840)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    record = json.loads(output.read_text())
    assert record["complete"] and list(record["suites"]) == [suite]
    assert output.with_suffix(".png").exists()
    lines = bench.SUITES[suite].summarize(record["suites"][suite])
    assert lines and all(line in result.stdout for line in lines), result.stdout[-3000:]
    # Every configuration a suite times is timed in every repeat (the
    # pipeline and tensor suites' workers: each configuration once per repeat).
    for name, times in record["suites"][suite].get("step_seconds_per_repeat", {}).items():
        assert len(times) == 1 and min(times) > 0, (suite, name, times)
    if suite == "pipeline":
        rates = record["suites"][suite]["matmul_gflops_by_rows"]
        assert rates and min(rates.values()) > 0
    assert f"wrote {output}" in result.stdout


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_the_chaos_recipe_runs_a_campaign_end_to_end(tmp_path):
    """The reference run, then one kill (aimed at a save); every kill resumed
    exactly: exit 0, the table printed, the JSON complete."""
    output = tmp_path / "chaos.json"
    result = run_recipe("chaos", "--kills=1", "--phases=save", f"--output={output}",
                        f"--workdir={tmp_path / 'work'}", timeout=840)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(output.read_text())
    assert record["complete"] and record["fired"] == record["exact"] == 1, record
    assert "chaos: 1 of 1 kills resumed exactly, 0 lost" in result.stdout


@pytest.mark.slow
def test_the_gpu_check_recipe_runs_or_says_in_one_line_that_there_is_no_gpu(tmp_path):
    output = tmp_path / "gpu_check.json"
    if shutil.which("nvidia-smi") is None:  # what it is designed to do without a GPU
        result = run_recipe("gpu_check", f"--output={output}", timeout=120)
        assert result.returncode == 1, result.stderr
        assert result.stderr.startswith("gpu_check.py: error: no NVIDIA GPU found")
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not output.exists()
        return
    result = run_recipe("gpu_check", "--seconds=1", f"--output={output}", timeout=600)
    assert output.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads(output.read_text())["checks"], result.stdout[-3000:]
