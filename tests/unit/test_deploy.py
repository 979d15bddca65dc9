"""The container recipes (deploy/docker) and Kubernetes manifests (deploy/k8s),
without a container engine or a cluster: the manifests parse; the TF_CONFIG
each pod gets gives the roles tfmulti expects (every pod trains, exactly one
chief writes); the images install exactly what `pip install tfmulti`
installs.

The TFJob's TF_CONFIG is built here by the rules of the Kubeflow training
operator (kubeflow/training-operator, pkg/controller.v1/tensorflow:
`genClusterSpec` and `genTFConfigJSONStr` in tensorflow.go, `GetPortFromTFJob`
in util.go, `SetClusterSpec` and `IsMasterRole` in tfjob_controller.go; the
defaults in pkg/apis/kubeflow.org/v1: container "tensorflow", port "tfjob-port",
2222): one job per replica type, lower-cased; replica I of type T of job J in
namespace NS at `J-T-I.NS.svc:PORT`; the task is the pod's type and index;
`"environment": "cloud"`; set only in the container named "tensorflow", and
only when the job has more than one replica. The indexed Job's TF_CONFIG is
made by its own shell lines (tests/integration/test_deploy.py runs them).
"""

from __future__ import annotations

import json
import re
import shlex
import types

import pytest
import yaml

from tests._util import REPO

DEPLOY = REPO / "deploy"
DEFAULT_PORT, PORT_NAME, CONTAINER = 2222, "tfjob-port", "tensorflow"  # the operator's


def manifest(name: str) -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()))


def operator_tf_config(job: dict, replica_type: str, index: int,
                       namespace: str = "default") -> dict:
    """The TF_CONFIG the training operator gives replica `index` of `replica_type`."""
    name, cluster = job["metadata"]["name"], {}
    for rtype, spec in job["spec"]["tfReplicaSpecs"].items():
        rt = rtype.lower()
        port = next((p["containerPort"] for c in spec["template"]["spec"]["containers"]
                     if c["name"] == CONTAINER for p in c.get("ports", [])
                     if p.get("name") == PORT_NAME), DEFAULT_PORT)
        cluster[rt] = [f"{name}-{rt}-{i}.{namespace}.svc:{port}"
                       for i in range(spec.get("replicas", 1))]
    return {"cluster": cluster, "task": {"type": replica_type.lower(), "index": index},
            "environment": "cloud"}


def role(tf_config: dict, monkeypatch):
    """tfmulti's role for a process with this TF_CONFIG: what the CLI decides
    before TensorFlow starts (`process_is_chief`), and `roles.cluster_role`
    through TensorFlow's own TF_CONFIG resolver. The strategy around that
    resolver is a stand-in: a real MultiWorkerMirroredStrategy would start its
    server and wait for the other pods."""
    import tensorflow as tf

    from tfmulti.cluster import tf_config as tf_config_lib
    from tfmulti.runtime import roles

    text = json.dumps(tf_config)
    tf_config_lib.parse_tf_config(text)  # tfmulti accepts it as it is
    monkeypatch.setenv("TF_CONFIG", text)

    class Strategy(tf.distribute.MultiWorkerMirroredStrategy):
        def __init__(self):  # pylint: disable=super-init-not-called
            self._resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()

        cluster_resolver = property(lambda self: self._resolver)
        extended = property(lambda self: types.SimpleNamespace(
            _in_multi_worker_mode=lambda: True))

    found = roles.cluster_role(Strategy())
    chief = tf_config_lib.process_is_chief("multi_worker", "auto", {"TF_CONFIG": text})
    assert chief == found.is_chief, (tf_config, found)
    assert tf_config_lib.num_tasks(tf_config) == found.num_workers, (tf_config, found)
    return found


def check_train_command(words: list[str]) -> None:
    """`tfmulti train --distribution=multi_worker ...`, parsed by the CLI and validated."""
    from tfmulti import cli
    from tfmulti.config import flags as config_flags

    assert words[:2] == ["tfmulti", "train"], words
    assert "--distribution=multi_worker" in words, words
    args = cli.build_parser().parse_args(words[1:])
    config_flags.config_from_args(args).validate()


def test_the_tfjob_gives_a_chief_and_workers_the_roles_tfmulti_expects(monkeypatch):
    (job,) = manifest("tfjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    specs = job["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Chief", "Worker"} and specs["Chief"]["replicas"] == 1
    total = sum(spec["replicas"] for spec in specs.values())
    assert total > 1  # else the operator sets no TF_CONFIG
    roles = []
    for rtype, spec in specs.items():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == CONTAINER  # the one that gets TF_CONFIG
        check_train_command(container["command"])
        for index in range(spec["replicas"]):
            roles.append(role(operator_tf_config(job, rtype, index), monkeypatch))
    assert sorted(r.worker_index for r in roles) == list(range(total))
    assert {r.num_workers for r in roles} == {total}
    writers = [r for r in roles if r.is_chief]
    assert [(w.task_type, w.task_index, w.worker_index) for w in writers] == [("chief", 0, 0)]
    # Every replica runs the same training, so they agree on it.
    commands = [spec["template"]["spec"]["containers"][0]["command"] for spec in specs.values()]
    assert all(command == commands[0] for command in commands)


def test_the_roles_hold_with_a_port_and_namespace_of_the_users(monkeypatch):
    # The operator takes the port named tfjob-port of the "tensorflow" container.
    (job,) = manifest("tfjob.yaml")
    for spec in job["spec"]["tfReplicaSpecs"].values():
        spec["template"]["spec"]["containers"][0]["ports"] = [
            {"name": PORT_NAME, "containerPort": 3333}]
    config = operator_tf_config(job, "Worker", 2, namespace="team-a")
    assert config["cluster"]["worker"][2] == "tfmulti-train-worker-2.team-a.svc:3333"
    found = role(config, monkeypatch)
    assert (found.task_type, found.worker_index, found.is_chief) == ("worker", 3, False)


def indexed_job() -> tuple[dict, dict]:
    service, job = manifest("indexed-job.yaml")
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    return service, job


def test_the_indexed_job_and_its_service_name_every_pod():
    service, job = indexed_job()
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["NUM_WORKERS"])
    assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod
    assert pod["subdomain"] == service["metadata"]["name"] == env["SERVICE"]
    assert env["JOB_NAME"] == job["metadata"]["name"]  # Indexed pods' hostnames: JOB-I
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert int(env["PORT"]) in [p["containerPort"] for p in container["ports"]]
    script = container["args"][0]
    (train,) = [line for line in script.replace("\\\n", " ").splitlines()
                if line.strip().startswith("exec tfmulti")]
    check_train_command(shlex.split(train)[1:])


def indexed_job_tf_config(index: int, monkeypatch) -> dict:
    """The TF_CONFIG the indexed Job's script exports in pod `index`, read off
    the script's `export TF_CONFIG=...` line with its variables filled in."""
    _, job = indexed_job()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    workers = ", ".join(f'"{env["JOB_NAME"]}-{k}.{env["SERVICE"]}:{env["PORT"]}"'
                        for k in range(int(env["NUM_WORKERS"])))
    (line,) = [line.strip() for line in container["args"][0].splitlines()
               if line.strip().startswith("export TF_CONFIG=")]
    value = shlex.split(line.removeprefix("export TF_CONFIG="))[0]
    value = value.replace("$workers", workers).replace("$JOB_COMPLETION_INDEX", str(index))
    assert "$" not in value, value
    return json.loads(value)


def test_the_indexed_job_gives_its_pods_the_roles_tfmulti_expects(monkeypatch):
    _, job = indexed_job()
    total = job["spec"]["completions"]
    roles = [role(indexed_job_tf_config(i, monkeypatch), monkeypatch) for i in range(total)]
    assert [r.worker_index for r in roles] == list(range(total))
    assert [r.is_chief for r in roles] == [True] + [False] * (total - 1)
    assert indexed_job_tf_config(1, monkeypatch)["cluster"]["worker"] == [
        f"tfmulti-train-{i}.tfmulti-train:2222" for i in range(total)]


# --------------------------------------------------------------------------
# The images install exactly what `pip install tfmulti` installs.


def run_commands(dockerfile: str) -> list[list[str]]:
    """The simple commands of the Dockerfile's RUN lines (continuations joined,
    split at && and ;), as words."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "docker" / dockerfile).read_text())
    commands = []
    for line in text.splitlines():
        if line.startswith("RUN "):
            for part in re.split(r"&&|;", line[4:]):
                commands.append(shlex.split(part))
    return commands


def installs(commands: list[list[str]]) -> list[list[str]]:
    """What each package-installing command installs (its arguments that are not options)."""
    found = []
    for words in commands:
        assert words[0] not in ("apt-get", "apt", "conda", "mamba", "uv", "pip", "pip3"), words
        if words[:4] == ["python", "-m", "pip", "install"]:
            found.append([w for w in words[4:] if not w.startswith("-")])
    return found


def test_the_cpu_image_installs_tfmulti_as_pip_install_tfmulti_does():
    commands = run_commands("Dockerfile")
    # The one wheel the context holds, no extra ([...]), no other package, no --no-deps.
    assert installs(commands) == [["/tmp/tfmulti-*.whl"]]
    assert not any("--no-deps" in words or "-r" in words for words in commands)
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r"^COPY tfmulti-\*\.whl /tmp/$", text, re.M)
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)  # the Python tested


def test_the_gpu_image_installs_the_readmes_gpu_line_then_tfmulti():
    commands = run_commands("Dockerfile.gpu")
    # The README's GPU install: its sh block that installs tensorflow[and-cuda].
    readme = (REPO / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", readme, re.S) if "and-cuda" in b]
    assert [shlex.split(line) for line in block.splitlines()] == [
        ["pip", "install", "tensorflow[and-cuda]", "tfmulti"]], block
    assert installs(commands) == [["tensorflow[and-cuda]", "/tmp/tfmulti-*.whl"]]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_the_build_line_in_each_dockerfile_names_it(dockerfile):
    text = (DEPLOY / "docker" / dockerfile).read_text()
    assert f"docker build -f deploy/docker/{dockerfile} " in text


def test_the_data_service_beside_the_tfjob_parses_and_admits_the_jobs_pods_only():
    """deploy/k8s/data-service.yaml: its command is `tfmulti data-service` with flags
    the CLI takes, on the port its Service exposes; the NetworkPolicy admits the
    TFJob's pods (the training operator's job-name label) and nothing else."""
    from tfmulti import cli

    deployment, service, policy = manifest("data-service.yaml")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["sh", "-c"]
    words = shlex.split(container["args"][0].replace('"$POD_IP"', "10.0.0.7"))
    assert words[:3] == ["exec", "tfmulti", "data-service"], words
    args = cli.build_parser().parse_args(words[2:])
    assert args.func.__name__ == "_cmd_data_service" and args.host == "10.0.0.7"
    assert [p["port"] for p in service["spec"]["ports"]] == [args.port]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    (tfjob,) = manifest("tfjob.yaml")
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {
        "training.kubeflow.org/job-name": tfjob["metadata"]["name"]}}}]
    assert args.workers == sum(spec["replicas"]
                               for spec in tfjob["spec"]["tfReplicaSpecs"].values())
