"""benchmarks.peak_rss: a command's peak memory read from outside it, and a
memory limit on it (what the memory suite's figures and its cap rest on).
Small Python processes without TensorFlow."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import peak_rss

pytestmark = pytest.mark.slow  # starts processes

MB = 2**20
# Holds `n` MiB touched (so resident), then exits 0.
_HOLD = ("import sys, time; b = bytearray(int(sys.argv[1]) * 2**20); "
         "b[::4096] = b'x' * len(b[::4096]); time.sleep(0.2)")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.peak_rss", *args],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_the_peak_is_the_commands_own():
    small, large = (_run("--", sys.executable, "-c", _HOLD, str(n)) for n in (10, 200))
    assert small.returncode == large.returncode == 0, small.stderr + large.stderr
    (small_peak,), (large_peak,) = peak_rss.parse(small.stderr), peak_rss.parse(large.stderr)
    assert 180 * MB < large_peak - small_peak < 200 * MB  # 190 MiB more held
    (anon,) = peak_rss.parse(large.stderr, peak_rss.ANON_LINE)
    assert 190 * MB < anon < large_peak  # the bytearray's pages (held a while: sampled)


def test_the_commands_status_comes_back():
    result = _run("--", sys.executable, "-c", "raise SystemExit(3)")
    assert result.returncode == 3 and len(peak_rss.parse(result.stderr)) == 1
    assert _run().returncode == 2


@pytest.mark.skipif(peak_rss.limit_unavailable() is not None,
                    reason=f"a memory cap needs a cgroup: {peak_rss.limit_unavailable()}")
def test_over_its_limit_the_command_is_killed_for_memory_and_the_cgroup_removed():
    before = set(os.listdir(peak_rss._CGROUPS))
    killed = _run(f"--limit_bytes={100 * MB}", "--", sys.executable, "-c", _HOLD, "300")
    assert killed.returncode == 137, killed.stderr
    assert peak_rss.parse(killed.stderr, peak_rss.OOM_LINE) == [1]
    under = _run(f"--limit_bytes={400 * MB}", "--", sys.executable, "-c", _HOLD, "100")
    assert under.returncode == 0 and peak_rss.parse(under.stderr, peak_rss.OOM_LINE) == [0]
    assert set(os.listdir(peak_rss._CGROUPS)) == before
