"""The Kubernetes manifests (deploy/k8s) run as far as this host allows, with
no cluster (tests/unit/test_deploy.py checks them without processes): the
indexed Job's own shell lines make each pod's TF_CONFIG (run with `sh` as the
pod runs them, with its environment and a stand-in `tfmulti` that records what
it was given); the TFJob's command trains as a chief and a worker given the
TF_CONFIG the training operator gives them, the chief alone writing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_deploy import (check_train_command, indexed_job, manifest,
                                    operator_tf_config, role)

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


# A chief and a worker, each started as the TFJob starts its pods: the manifest's
# command (made tiny by later flags, which win) with the TF_CONFIG the operator
# gives it, the addresses on this host's loopback, in a private network namespace.
_CHIEF_AND_WORKER = """
ip link set lo up || exit 3
TF_CONFIG="$CHIEF_TF_CONFIG" "$@" > "$LOGS/chief.log" 2>&1 & chief=$!
TF_CONFIG="$WORKER_TF_CONFIG" "$@" > "$LOGS/worker.log" 2>&1 & worker=$!
wait $chief; c=$?; wait $worker; w=$?
echo "$c $w"
"""


@pytest.mark.cluster  # a 2-process cluster
@pytest.mark.timeout(600)
def test_a_chief_and_a_worker_train_with_the_tfjobs_tf_config(tmp_path):
    (job,) = manifest("tfjob.yaml")
    specs = job["spec"]["tfReplicaSpecs"]
    specs["Worker"]["replicas"] = 1  # a chief and one worker on this host
    loopback = {}
    configs = [operator_tf_config(job, rtype, 0) for rtype in ("Chief", "Worker")]
    for config in configs:  # the operator's service names, each on a loopback port
        for job_name, addresses in config["cluster"].items():
            config["cluster"][job_name] = [
                loopback.setdefault(a, f"127.0.0.1:{2222 + len(loopback)}") for a in addresses]
    assert configs[0]["task"] == {"type": "chief", "index": 0}
    command = specs["Chief"]["template"]["spec"]["containers"][0]["command"]
    tfmulti = shutil.which("tfmulti", path=str(Path(sys.executable).parent))
    model_dir = tmp_path / "model"
    words = [tfmulti, *command[1:], "--model=mlp", "--num_examples=512", "--epochs=1",
             "--global_batch_size=64", f"--model_dir={model_dir}",
             f"--backup_dir={tmp_path / 'backup'}"]
    env = {**os.environ, "LOGS": str(tmp_path), "TFMULTI_STARTUP_TIMEOUT": "300",
           "CHIEF_TF_CONFIG": json.dumps(configs[0]),
           "WORKER_TF_CONFIG": json.dumps(configs[1])}
    process = subprocess.Popen(["unshare", "--net", "sh", "-c", _CHIEF_AND_WORKER, "sh",
                                *words], stdout=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        out, _ = process.communicate(timeout=540)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("chief", "worker")}
    assert out.split() == ["0", "0"], (out, logs)
    assert (model_dir / "metrics.json").is_file(), logs
    assert "test_loss=" in logs["chief"] and "test_loss=" not in logs["worker"], logs
