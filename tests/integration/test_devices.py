"""Tests for tfmulti.runtime.devices: virtual devices, name canonicalization, lookup.

conftest.py has configured 4 logical CPU devices in this process; the test
that needs a fresh TensorFlow runtime runs in a subprocess (marked slow).
"""

from __future__ import annotations

import textwrap

import pytest

from tests._util import run_python_warm


@pytest.mark.slow
def test_fresh_process_splits_the_cpu_then_refuses_more_with_a_restart_hint():
    """In a fresh runtime (merges test_fresh_process_really_splits_the_cpu and
    test_configure_after_runtime_start_raises_with_restart_hint: one process)."""
    code = textwrap.dedent("""
        import tensorflow as tf
        import tfmulti
        names = tfmulti.configure_virtual_devices(3)
        print("NAMES:", names)
        print("LOGICAL:", len(tfmulti.runtime.devices.logical_devices("CPU")))
        strategy = tfmulti.get_strategy("mirrored")
        print("REPLICAS:", strategy.num_replicas_in_sync)
        tf.constant(1.0)  # the runtime runs with 3 logical CPUs
        print("AGAIN:", tfmulti.configure_virtual_devices(2))  # enough: a no-op
        try:
            tfmulti.configure_virtual_devices(5)
        except RuntimeError as e:
            print("RUNTIMEERROR:", e)
        else:
            print("NO ERROR")
        print("CPUS:", len(tf.config.list_logical_devices("CPU")))
    """)
    result = run_python_warm(["-c", code], timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    assert "NAMES: ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2']" in out
    assert "LOGICAL: 3" in out
    assert "REPLICAS: 3" in out
    assert "AGAIN: ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2']" in out
    assert "NO ERROR" not in out
    line = next(ln for ln in out.splitlines() if ln.startswith("RUNTIMEERROR:"))
    assert "cannot create 5 logical CPU devices" in line
    assert "already started with 3" in line
    assert "before any tensor" in line and "strategy" in line
    assert "restart the kernel" in line
    assert "CPUS: 3" in out  # the refused call changed nothing
