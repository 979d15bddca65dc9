"""The indexed Job's own shell lines (deploy/k8s/indexed-job.yaml) make each
pod's TF_CONFIG: run with `sh` as the pod runs them, with its environment and a
stand-in `tfmulti` that records what it was given (tests/unit/test_deploy.py
checks the manifests without processes)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.unit.test_deploy import check_train_command, indexed_job, role

_RECORD = """#!/bin/sh
exec python3 -c 'import json, os, sys
print(json.dumps({"tf_config": os.environ["TF_CONFIG"], "argv": sys.argv[1:]}))' "$@"
"""


@pytest.mark.slow  # runs the pod's script with sh
def test_the_indexed_job_script_exports_the_tf_config_of_its_pod(tmp_path, monkeypatch):
    _, job = indexed_job()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    fake = tmp_path / "tfmulti"
    fake.write_text(_RECORD)
    fake.chmod(0o755)
    total = job["spec"]["completions"]
    found = []
    for index in range(total):
        result = subprocess.run(
            [*container["command"], *container["args"]], capture_output=True, text=True,
            timeout=60, env={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", **env,
                             "JOB_COMPLETION_INDEX": str(index)})
        assert result.returncode == 0, result.stderr
        record = json.loads(result.stdout)
        check_train_command(["tfmulti", *record["argv"]])
        config = json.loads(record["tf_config"])
        assert config["cluster"] == {"worker": [
            f"tfmulti-train-{k}.tfmulti-train:2222" for k in range(total)]}
        assert config["task"] == {"type": "worker", "index": index}
        found.append(role(config, monkeypatch))
    assert [r.worker_index for r in found] == list(range(total))
    assert [r.is_chief for r in found] == [True] + [False] * (total - 1)
