"""The suites of recipes/benchmark.py and the GPU check (recipes/gpu_check.py)
run end to end from the command line, at toy size: the suites with `--toy`
(each suite's `TOY`: its whole code path in seconds), one repeat, all in one
recipe run. A suite that crashes fails here; its figures are not checked
(BENCHMARKS.md)."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import pytest

import benchmarks as bench
from benchmarks import scaling
from tests._util import run_recipe


def test_every_suite_has_a_toy_size():
    for name, suite in bench.SUITES.items():
        assert isinstance(getattr(suite, "TOY", None), dict) and suite.TOY, name


# The own suite runs end to end in benchmarks/tests/test_bench.py
# (test_own_suite_runs_end_to_end, its figures checked), and the fault campaign
# in benchmarks/tests/test_chaos.py (test_a_kill_inside_the_preemption_agreement_
# resumes_exactly: the reference run, a trial, the table).
SUITES = [name for name in bench.SUITES if name != "own"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_suite_runs_end_to_end(tmp_path):
    """One recipe run of every suite at toy size (one process for the recipe
    and one machine worker for all): each suite's record complete, its
    headline lines printed, the figure written."""
    output = tmp_path / "suites.json"
    result = run_recipe("benchmark", *(f"--suite={suite}" for suite in SUITES), "--repeats=1",
                        "--toy", f"--output={output}", timeout=840)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "\nmachine: " in "\n" + result.stdout, result.stdout[:500]
    record = json.loads(output.read_text())
    assert record["complete"] and list(record["suites"]) == SUITES
    # BENCHMARKS.md compares runs across machines: each run's JSON says which
    # (the machine worker's record).
    machine = record["machine"]
    assert machine["cpu_count"] == os.cpu_count() and machine["onednn"] in (True, False)
    assert machine["cpu_model"] and machine["tensorflow"].startswith("2.21")
    assert output.with_suffix(".png").exists()
    for suite in SUITES:
        lines = bench.SUITES[suite].summarize(record["suites"][suite])
        assert lines and all(line in result.stdout for line in lines), (suite, lines)
        # Every configuration a suite times is timed in every repeat (the
        # pipeline and tensor suites' workers: each configuration once per repeat).
        for name, times in record["suites"][suite].get("step_seconds_per_repeat", {}).items():
            assert len(times) == 1 and min(times) > 0, (suite, name, times)
    # The input service suite: both ways timed, through a service worker of its own.
    served = record["suites"]["input_service"]
    assert min(served["service_seconds_per_step"]) > 0, served
    assert min(served["in_process_seconds_per_step"]) > 0 and served["map_rounds"] >= 1
    assert served["ceiling"]["median"] >= 1.0, served
    # The embeddings suite's reduction, counted from a real batch's gradients: the
    # tables as rows, far under the tables whole (toy size: 2 tables of 1,000 x 32,
    # 32 lookups each per replica).
    reduced = record["suites"]["embeddings"]["reduced_bytes_per_replica"]
    assert 0 < reduced["rows_combined"] <= reduced["rows"] < reduced["dense"] / 4, reduced
    # Its tables sharded by rows on 2 workers: the weights of the whole tables' run, each
    # worker's peak read from outside in both runs (the saving is noise at toy size).
    tables = record["suites"]["embeddings"]["sharded_tables"]
    assert tables["largest_weight_difference"] <= 1e-5, tables
    assert len(tables["workers"]) == 2 and all(
        w["whole_peak_rss_bytes"] > 100 * 2**20 and w["sharded_peak_rss_bytes"] > 100 * 2**20
        for w in tables["workers"]), tables
    assert "toy size" in tables["cap"]["skipped"] or "cgroup" in tables["cap"]["skipped"], tables
    rates = record["suites"]["pipeline"]["matmul_gflops_by_rows"]
    assert rates and min(rates.values()) > 0
    # The pipeline's memory: measured by TensorFlow's allocator where it keeps a count
    # (oneDNN on), else none and why (its default on CPUs without AVX-512: this machine's
    # record says which); estimated either way.
    for name, memory in record["suites"]["pipeline"]["memory_mib"].items():
        assert memory["estimated"] > 0, (name, memory)
        if machine["onednn"]:
            assert memory["measured"] is not None, (name, memory)
        else:
            assert memory["measured"] is None and "oneDNN off" in memory["not_measured"]
    # The all-reduce the scaling suite times is the CNN's gradients (its 6 weight
    # tensors, 34,826 floats), summed over both workers of a pinned launch (each
    # worker's sum checked by the suite: scaling.all_reduce_milliseconds).
    reduce = record["suites"]["scaling"]["all_reduce"]
    assert reduce["bytes"] == 4 * 34826, reduce
    assert len(reduce["milliseconds_one_host"]) == scaling.TOY["all_reduce_repeats"]
    assert min(reduce["milliseconds_one_host"]) > 0
    # The memory suite: each worker's peak read at every stage (stages 0 and 1 at toy
    # size); a sharded stage's workers each hold Adam's 2 slots of half of every
    # variable (ceil), read from its variables, with its step count and learning rate;
    # no cap at toy size (benchmarks/tests/test_peak_rss.py tests the limit).
    zero = record["suites"]["memory"]
    assert list(zero["stages_measured"]) == ["0", "1"]
    for s in zero["stages_measured"].values():
        (peaks,) = s["peak_rss_bytes_by_worker"]
        assert len(peaks) == 2 and min(peaks) > 100 * 2**20, peaks
        (anon,) = s["peak_anon_bytes_by_worker"]
        assert all(0 < a < p for a, p in zip(anon, peaks, strict=True)), (anon, peaks)
    width, layers = zero["width"], zero["layers"]
    sizes = [28 * 28, *[width] * layers, 10]
    shards = sum(-(-n // 2) for a, b in itertools.pairwise(sizes) for n in (a * b, b))
    assert zero["stages_measured"]["1"]["optimizer_state_bytes_per_worker"] == \
        2 * 4 * shards + 8 + 4
    assert zero["cap"]["skipped"].startswith(("toy size", "not root", "no cgroup"))


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
