"""tfmulti under a real SLURM (`benchmarks.slurm_cluster`: munge, slurmctld and
slurmd of Debian's slurm-wlm with a private configuration): on one node (this
host), the documented batch script (deploy/slurm/train.sbatch) trains with one
chief writing, and a job signalled the way a scheduler preempts saves, requeues
itself and resumes to the uninterrupted run's weights; on two nodes (simulated
hosts, each slurmd with its own address and host name), the batch script and
`tfmulti launch --hosts slurm` under `srun` train the same run. See docs/how-to/slurm.md.

The tests skip only where SLURM's programs are missing (`make test` installs
them) or the machine cannot run slurmd or network namespaces (not root)."""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import sys
import time

import pytest

from benchmarks import chaos_checks, slurm_cluster
from tests._util import REPO

pytestmark = pytest.mark.cluster

SCRIPT = str(REPO / "deploy" / "slurm" / "train.sbatch")
JOB_TIMEOUT = 600  # seconds; a tiny run, but a loaded 2-core machine
EPOCHS, STEPS_PER_EPOCH, SAVE_EVERY = 2, 8, 2
TRAIN_FLAGS = ["--dataset=synthetic", "--model=mlp", "--num_examples=512",
               "--global_batch_size=32", f"--epochs={EPOCHS}",
               f"--steps_per_epoch={STEPS_PER_EPOCH}", f"--backup_every_steps={SAVE_EVERY}",
               "--verbose=2"]
HOLD_AT_CALL = 5  # the signal lands at global step 10 of 16, in epoch 2


def _cluster(nodes: int, tmp_path_factory):
    ok, why = slurm_cluster.available(nodes)
    if not ok:
        pytest.skip(f"no SLURM of {nodes} node(s) here: {why}")
    with slurm_cluster.SlurmCluster(nodes, directory=str(tmp_path_factory.mktemp("slurm"))) \
            as cluster:
        yield cluster
        started = cluster.processes()
        assert started  # munged, slurmctld, slurmd(s)
    left = [pid for pid in started if slurm_cluster.running(pid)]
    assert not left, f"SLURM's processes left running: {left}"  # none: no daemon, no port


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """One node: this host."""
    yield from _cluster(1, tmp_path_factory)


@pytest.fixture(scope="module")
def slurm2(tmp_path_factory):
    """Two nodes, node1 and node2, simulated hosts (their own addresses and names)."""
    yield from _cluster(2, tmp_path_factory)


def _env(cluster, **extra) -> dict:
    """The jobs' environment (sbatch exports it): this checkout's tfmulti first on
    PATH, the checkout importable (tests.workers.hold)."""
    env = cluster.env()
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])
    env["PYTHONPATH"] = str(REPO)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.pop("TFMULTI_FAULTS", None)
    return {**env, **extra}


def _submit(cluster, run_dir, env=None, *options) -> tuple[int, str]:
    """`sbatch [OPTIONS] deploy/slurm/train.sbatch` of the tiny run into `run_dir`,
    as docs/how-to/slurm.md runs it; (job id, its output file)."""
    output = os.path.join(run_dir, "slurm.out")
    job = cluster.sbatch(f"--output={output}", f"--chdir={REPO}", *options, SCRIPT,
                         f"--model_dir={run_dir}/model", f"--backup_dir={run_dir}/backup",
                         *TRAIN_FLAGS, env=env or _env(cluster))
    return job, output


def _read(path) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _tasks_exited(text: str, code: int) -> list[str]:
    """The tasks srun says exited with `code`: one line a task ("task 1: Exited ...") or one
    for tasks that exited together ("tasks 0-1: Exited ...", "tasks 0,2-3: ...")."""
    tasks = []
    pattern = rf"srun: error: .*tasks? ([\d,-]+): Exited with exit code {code}\b"
    for spans in re.findall(pattern, text):
        for span in spans.split(","):
            first, _, last = span.partition("-")
            tasks += [str(t) for t in range(int(first), int(last or first) + 1)]
    return sorted(tasks)


def _model(run_dir):
    return chaos_checks.keras_arrays(os.path.join(run_dir, "model", "model.keras"))


def _metrics(run_dir):
    with open(os.path.join(run_dir, "model", "metrics.json")) as f:
        return json.load(f)


def _ended(cluster, job) -> tuple[dict, str]:
    fields = cluster.wait(job, timeout=JOB_TIMEOUT)
    return fields, (f"job {fields}; slurmctld.log: {cluster.log('slurmctld.log', 1500)}; "
                    f"slurmd: {cluster.log(f'slurmd-{cluster.nodes[0]}.log', 1500)}")


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """The batch script's run, uninterrupted: (run dir, job fields, its output)."""
    run_dir = str(tmp_path_factory.mktemp("uninterrupted"))
    job, output = _submit(slurm, run_dir)
    fields, why = _ended(slurm, job)
    return run_dir, fields, _read(output), why


def test_the_batch_script_trains_through_tfmulti_and_the_chief_writes_once(uninterrupted):
    run_dir, fields, output, why = uninterrupted
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), \
        f"{output[-4000:]}\n{why}"
    # srun --label: each line says its task; task 0 is the chief, task 1 only says it is done.
    assert re.findall(r"^(\d): tfmulti: wrote metrics\.json", output, re.M) == ["0"], output
    assert re.findall(r"^(\d): tfmulti: done; the chief reports", output, re.M) == ["1"], output
    assert re.findall(r"^(\d): tfmulti: test_accuracy=", output, re.M) == ["0"], output
    for task in "01":  # both tasks in one MultiWorkerMirroredStrategy of 2 replicas
        assert re.search(rf"^{task}: tfmulti: MultiWorkerMirroredStrategy with 2 replicas", output,
                         re.M), output
    metrics = _metrics(run_dir)
    assert (metrics["num_workers"], metrics["num_replicas"]) == (2, 2)
    assert metrics["epochs_completed"] == EPOCHS
    assert metrics["steps_per_epoch"] == STEPS_PER_EPOCH
    assert sorted(os.listdir(run_dir)) == ["model", "slurm.out"]  # the backup removed at the end


def test_a_signalled_job_saves_requeues_itself_and_resumes_to_the_same_weights(
        slurm, uninterrupted, tmp_path):
    """Preemption the SLURM way: `scancel --signal=TERM` to the job's tasks (what
    `--signal=TERM@N` sends before the time limit) while they train; every worker
    saves and exits 75, the script requeues the job, the next start resumes from
    the backup and ends with the uninterrupted run's weights and metrics."""
    ref_dir, ref_fields, ref_output, why = uninterrupted
    assert ref_fields["JobState"] == "COMPLETED", why
    run_dir, hold = str(tmp_path / "run"), tmp_path / "hold"
    os.mkdir(run_dir)
    hold.mkdir()
    env = _env(slurm, TFMULTI_FAULTS=f"tests.workers.hold:step={HOLD_AT_CALL},dir={hold}")
    job, output = _submit(slurm, run_dir, env)
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (hold / "held").exists():  # task 0 holds mid-run until the signal is in
        assert time.monotonic() < deadline and slurm.job(job)["JobState"] in (
            "PENDING", "RUNNING"), _read(output)[-4000:]
        time.sleep(0.2)
    slurm.run(["scancel", "--signal=TERM", str(job)])
    while _read(output).count("got SIGTERM; saving a backup") < 2:  # both tasks
        assert time.monotonic() < deadline, _read(output)[-4000:]
        time.sleep(0.2)
    (hold / "release").touch()
    # Requeued by the script on exit 75; SLURM makes a requeued job wait ~2 min
    # before it may start again (its BeginTime): start it now instead.
    fields = slurm.wait(job, lambda f: f["Restarts"] == "1" and f["JobState"] == "PENDING"
                        or f["JobState"] in ("COMPLETED", "FAILED"), timeout=JOB_TIMEOUT)
    assert fields["JobState"] == "PENDING", _read(output)[-6000:]
    while slurm.node_state() != "idle":  # the first run's clean-up ends (else a start now
        assert time.monotonic() < deadline  # races it, which removes the job's script)
        time.sleep(0.2)
    # The requeue revoked the job's credentials of its second (SubmitTime) and before; one
    # made in the same second would be refused ("Job credential revoked").
    requeued = datetime.datetime.fromisoformat(fields["SubmitTime"]).timestamp()
    time.sleep(max(0.0, requeued + 2 - time.time()))
    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    fields, why = _ended(slurm, job)
    text = _read(output)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == (
        "COMPLETED", "0:0", "1"), f"{text[-6000:]}\n{why}"
    saved = re.findall(r"^(\d): tfmulti: preempted: saved a backup at global step (\d+)", text,
                       re.M)
    assert sorted(task for task, _ in saved) == ["0", "1"], text  # at one agreed step
    step = saved[0][1]
    assert {s for _, s in saved} == {step} and 0 < int(step) < EPOCHS * STEPS_PER_EPOCH, text
    assert _tasks_exited(text, 75) == ["0", "1"], text
    assert f"train.sbatch: preempted, backup saved: requeueing job {job}" in text, text
    resumed = re.findall(r"^(\d): tfmulti: resuming from \S+: global step (\d+)", text, re.M)
    assert sorted(resumed) == [("0", step), ("1", step)], text
    assert re.findall(r"^(\d): tfmulti: wrote metrics\.json", text, re.M) == ["0"], text

    assert chaos_checks.compare_arrays(_model(run_dir), _model(ref_dir)) == []
    assert chaos_checks.compare_metrics(_metrics(run_dir), _metrics(ref_dir)) == []
    assert _metrics(run_dir)["resumed_from_step"] == int(step)
    assert sorted(os.listdir(run_dir)) == ["model", "slurm.out"]


def test_the_batch_script_on_two_nodes_trains_the_same_run(slurm2, uninterrupted, tmp_path):
    """One task on each of 2 nodes (their own addresses: the workers talk over the
    simulated network, node1:8888 and node2:8888): the one-node job's weights."""
    ref_dir = uninterrupted[0]
    job, output = _submit(slurm2, str(tmp_path), None, "--nodes=2", "--ntasks-per-node=1")
    fields, why = _ended(slurm2, job)
    text = _read(output)
    assert (fields["JobState"], fields["ExitCode"], fields["NodeList"]) == (
        "COMPLETED", "0:0", "node[1-2]"), f"{text[-4000:]}\n{why}"
    assert re.findall(r"^(\d): tfmulti: wrote metrics\.json", text, re.M) == ["0"], text
    assert re.findall(r"^(\d): tfmulti: done; the chief reports", text, re.M) == ["1"], text
    assert _metrics(str(tmp_path))["num_workers"] == 2
    assert chaos_checks.compare_arrays(_model(str(tmp_path)), _model(ref_dir)) == []
    assert chaos_checks.compare_metrics(_metrics(str(tmp_path)), _metrics(ref_dir)) == []


def test_tfmulti_launch_hosts_slurm_under_srun_on_two_nodes(slurm2, uninterrupted, tmp_path):
    """`srun --ntasks-per-node=1 tfmulti launch --hosts slurm --num_workers 1`
    (docs/how-to/many_hosts.md): one launcher per node, each starting its node's worker
    (`--num_workers` counts a node's); the same run as the batch script's."""
    ref_dir = uninterrupted[0]
    env = _env(slurm2, TFMULTI_LAUNCH_SECRET=secrets.token_hex(32))
    result = slurm2.run(
        ["srun", "--nodes=2", "--ntasks-per-node=1", f"--chdir={tmp_path}",
         "tfmulti", "launch", "--hosts", "slurm", "--num_workers", "1", "--",
         "tfmulti", "train", "--distribution=multi_worker", f"--model_dir={tmp_path}/model",
         f"--backup_dir={tmp_path}/backup", *TRAIN_FLAGS],
        env=env, timeout=JOB_TIMEOUT, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "host 0 of 2 (node1)" in output and "host 1 of 2 (node2)" in output, output[-6000:]
    assert "[worker 0] tfmulti: wrote metrics.json" in output, output[-6000:]
    assert "[worker 1] tfmulti: done; the chief reports" in output, output[-6000:]
    assert chaos_checks.compare_arrays(_model(str(tmp_path)), _model(ref_dir)) == []
    assert chaos_checks.compare_metrics(_metrics(str(tmp_path)), _metrics(ref_dir)) == []
