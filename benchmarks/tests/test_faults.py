"""Failpoints: the product's `failpoint` (tfmulti.utils.failpoints: a no-op
unless armed), and the campaign's faults (benchmarks.failpoints): parsing
them, and which pass of which point on which worker signals the process.
In-process, with SIGUSR1 and a handler standing in for SIGKILL/SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest

from tests._util import REPO
from tfmulti.utils import failpoints as product
from benchmarks import failpoints as _faults


@pytest.fixture
def caught(monkeypatch):
    """SIGUSR1 recorded instead of acted on; the failpoints disarmed afterwards."""
    got = []
    event = threading.Event()

    def handler(signum, frame):
        got.append(signum)
        event.set()

    previous = signal.signal(signal.SIGUSR1, handler)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    armed = product.install(None)
    yield got, event
    product.install(armed)
    signal.signal(signal.SIGUSR1, previous)


def _arm(monkeypatch, text: str, rank: int | None = None) -> None:
    """Arms `text` in this process, as a worker of rank `rank` (None: no
    TF_CONFIG) with fresh pass counts, as a restarted worker would be."""
    if rank is not None:
        monkeypatch.setenv("TF_CONFIG", json.dumps(
            {"cluster": {"worker": ["localhost:1", "localhost:2"]},
             "task": {"type": "worker", "index": rank}}))
    product.install(_faults.arm(text))


def test_parse_reads_every_field_and_the_defaults():
    faults = _faults.parse(" point=backup.saved , worker=1, hit=3, signal=sigterm, delay=0.25,"
                           "once=/x/m ; point=io.publish")
    assert faults == [_faults.Fault("backup.saved", 1, 3, "TERM", 0.25, "/x/m"),
                      _faults.Fault("io.publish", None, 1, "KILL", 0.0, None)]
    assert _faults.parse(_faults.format_faults(faults)) == faults
    assert _faults.parse("") == [] and _faults.parse(" ; ") == []


@pytest.mark.parametrize("text, match", [
    ("point=backup.sav", r"`point` must be one of backup.step, .*got 'backup.sav'"),
    ("worker=1", r"`point` must be one of .*got None"),
    ("point=io.publish,when=1", r"unknown field 'when=1' \(fields: point, worker, hit"),
    ("point=io.publish,hit", r"unknown field 'hit'"),
    ("point=io.publish,hit=0", r"`hit` must be an integer >= 1, got '0'"),
    ("point=io.publish,worker=-1", r"`worker` must be an integer >= 0, got '-1'"),
    ("point=io.publish,worker=\u0661", r"`worker` must be an integer >= 0"),  # Arabic-Indic 1
    ("point=io.publish,signal=NOPE", r"`signal` must be a signal name such as KILL or TERM"),
    ("point=io.publish,signal=_DFL", r"`signal` must be a signal name"),
    ("point=io.publish,delay=-1", r"`delay` must be a number of seconds >= 0, got '-1'"),
    ("point=io.publish,delay=nan", r"`delay` must be a number of seconds >= 0"),
    ("point=io.publish,point=io.publish", r"`point` is given twice"),
    ("point=io.publish,once=", r"`once` must be a file path"),
])
def test_parse_refuses_bad_entries_naming_them_and_the_format(text, match):
    with pytest.raises(ValueError, match=match) as info:
        _faults.parse(text)
    assert "write it as 'point=NAME[,worker=RANK]" in str(info.value)


def test_unarmed_points_do_nothing(caught):
    got, _ = caught
    for _ in range(3):
        product.failpoint("backup.save")
    assert got == []


def test_the_environment_is_read_once_at_import(monkeypatch):
    """Arming later changes nothing: a failpoint never looks at os.environ."""
    environ = type(os.environ)  # os._Environ: any lookup would go through it

    def refuse(*args):
        raise AssertionError("a failpoint read the environment")

    armed = product.install(None)
    try:
        monkeypatch.setenv(product.ENV, "benchmarks.failpoints:point=backup.save,signal=USR1")
        monkeypatch.setattr(environ, "__getitem__", refuse)
        monkeypatch.setattr(environ, "get", refuse, raising=False)
        product.failpoint("backup.save")  # neither reads nor fires
    finally:
        product.install(armed)


def test_the_product_points_are_the_campaigns_points():
    """Every `failpoint("NAME")` of the package is one of `POINTS`, and each of
    `POINTS` is marked somewhere (the campaign aims at each)."""
    marked = set()
    for folder, _, files in os.walk(REPO / "tfmulti"):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    marked |= set(re.findall(r'\b(?:failpoint|failpoints\.point)\("([^"]+)"\)',
                                             f.read()))
    assert marked == set(_faults.POINTS)


def test_fires_at_the_given_pass_on_the_given_worker_only(caught, monkeypatch):
    got, _ = caught
    _arm(monkeypatch, "point=backup.save,worker=1,hit=2,signal=USR1", rank=1)
    product.failpoint("backup.save")
    product.failpoint("backup.saved")  # another point's passes count apart
    assert got == []
    product.failpoint("backup.save")
    assert got == [signal.SIGUSR1]
    product.failpoint("backup.save")  # the third pass: no more
    assert got == [signal.SIGUSR1]

    _arm(monkeypatch, "point=backup.save,worker=1,hit=1,signal=USR1", rank=0)
    product.failpoint("backup.save")
    assert got == [signal.SIGUSR1]  # worker 0 is not worker 1


def test_no_tf_config_is_worker_0_and_no_worker_means_any(caught, monkeypatch):
    got, _ = caught
    _arm(monkeypatch, "point=io.publish,worker=0,signal=USR1;point=train.write,signal=USR1")
    product.failpoint("io.publish")
    product.failpoint("train.write")
    assert got == [signal.SIGUSR1, signal.SIGUSR1]


def test_once_fires_only_if_its_marker_is_new_and_records_it(caught, monkeypatch, tmp_path):
    got, _ = caught
    marker = tmp_path / "m"
    _arm(monkeypatch, f"point=backup.delete,hit=1,signal=USR1,once={marker}", rank=1)
    product.failpoint("backup.delete")
    assert got == [signal.SIGUSR1]
    record = json.loads(marker.read_text())
    assert record["point"] == "backup.delete" and record["worker"] == 1
    assert record["signal"] == "USR1" and record["landed"] == "backup.delete"
    # A restarted process (its pass counts start over) finds the marker: nothing.
    _arm(monkeypatch, f"point=backup.delete,hit=1,signal=USR1,once={marker}", rank=1)
    product.failpoint("backup.delete")
    assert got == [signal.SIGUSR1]


def test_a_delay_signals_later_from_a_thread_and_records_where_it_landed(
        caught, monkeypatch, tmp_path):
    got, event = caught
    marker = tmp_path / "m"
    _arm(monkeypatch, f"point=train.evaluate,signal=USR1,delay=0.3,once={marker}")
    start = time.monotonic()
    product.failpoint("train.evaluate")
    assert got == [] and not marker.exists()  # not yet: a delay
    product.failpoint("train.write")  # the process moves on before the signal
    assert event.wait(10)
    assert time.monotonic() - start >= 0.3
    assert got == [signal.SIGUSR1]
    assert json.loads(marker.read_text())["landed"] == "train.write"


def test_a_malformed_value_fails_at_the_first_point(caught, monkeypatch):
    monkeypatch.setattr(product, "_armed", "benchmarks.failpoints:point=nowhere")
    product.install(product._load)  # as at the import of a process armed so
    with pytest.raises(ValueError, match="TFMULTI_FAULTS entry 'point=nowhere'"):
        product.failpoint("backup.save")
    monkeypatch.setattr(product, "_armed", "point=backup.save")  # no module
    product.install(product._load)
    with pytest.raises(ValueError, match="TFMULTI_FAULTS must be MODULE:SPEC"):
        product.failpoint("backup.save")


@pytest.mark.slow  # starts a Python process (no TensorFlow)
def test_a_delayed_sigkill_lands_even_after_the_program_returned(tmp_path):
    """A worker whose own work ended is still alive (its peers may be writing):
    the delayed signal keeps it until it lands, and SIGKILL ends it there."""
    from tests._util import run_python

    marker = tmp_path / "m"
    result = run_python(
        ["-c", "from tfmulti.utils.failpoints import failpoint; failpoint('train.write'); "
               "print('returned')"],
        timeout=60, env={_faults.ENV: _faults.environ_value(
            [_faults.Fault("train.write", delay=0.5, once=str(marker))]),
            "PYTHONPATH": str(REPO)})
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert result.stdout == "returned\n"
    assert "worker 0 sends itself SIGKILL at train.write (pass 1, +0.5 s" in result.stderr
    assert json.loads(marker.read_text())["landed"] == "train.write"
