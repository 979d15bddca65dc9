"""Tests of tfmulti.cluster.notebook_launcher (and its worker,
tfmulti.cluster._notebook_worker): the chief's value comes back, a worker's
traceback is raised, and what cannot reach fresh worker processes is refused
before anything starts."""

from __future__ import annotations

import json
import os
import pickle

import pytest

from tests._util import run_python
from tfmulti.cluster.notebook_launcher import notebook_launcher


@pytest.mark.cluster
def test_notebook_launcher_returns_the_chiefs_value(capsys):
    offset = 40

    def train(scale):
        import json
        import os

        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        print(f"hello from rank {rank}")
        return {"rank": rank, "value": offset + scale * rank}

    assert notebook_launcher(train, args=(2,), num_workers=2) == {"rank": 0, "value": 40}
    out = capsys.readouterr().out
    assert "[worker 0] hello from rank 0" in out and "[worker 1] hello from rank 1" in out


@pytest.mark.cluster
def test_notebook_launcher_fails_closed_where_no_namespace_can_be_made(tmp_path, monkeypatch):
    # As `tfmulti launch`: no private network namespace (an `unshare` that is denied), no
    # worker: a ValueError naming the reason and isolate=False.
    fake = tmp_path / "bin" / "unshare"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    ran = tmp_path / "ran"

    def train():
        open(ran, "w").close()

    with pytest.raises(ValueError, match=r"^cannot isolate the workers in a private network "
                                         r"namespace \(`unshare --pid --net`: unshare: "
                                         r"unshare failed: Operation not permitted.*"
                                         r"nothing was started.*isolate=False"):
        notebook_launcher(train, num_workers=2)
    assert not ran.exists()


@pytest.mark.cluster
def test_notebook_launcher_raises_with_the_workers_traceback():
    def train():
        import json
        import os

        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
            raise ValueError("boom in rank 1")
        return "chief"

    with pytest.raises(RuntimeError, match=r"(?s)worker 1 failed:.*ValueError: boom in rank 1"):
        notebook_launcher(train, num_workers=2, isolate=False)


@pytest.mark.slow
def test_notebook_worker_puts_the_kernels_path_first(tmp_path):
    # A kernel that put a local checkout first (sys.path.insert(0, ...)) must
    # have its workers import the same copy, not the installed one.
    import cloudpickle

    local = tmp_path / "checkout"
    (local / "absl").mkdir(parents=True)
    (local / "absl" / "__init__.py").write_text("LOCAL = True\n")
    payload = tmp_path / "payload"
    with open(payload, "wb") as f:
        pickle.dump([str(local)], f)
        f.write(cloudpickle.dumps((lambda: getattr(__import__("absl"), "LOCAL", False), ())))
    results = tmp_path / "results"
    results.mkdir()
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["localhost:1"]},
                                    "task": {"type": "worker", "index": 0}})}
    done = run_python(["-m", "tfmulti.cluster._notebook_worker", str(payload), str(results)],
                      timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert pickle.loads((results / "result-0.pkl").read_bytes()) is True
