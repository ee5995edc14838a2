"""The job specs users copy from docs/many-hosts.md (examples/launch/): parsed, and started on
loopback.

Each spec is on that page word for word. Its program's command line is parsed with the
program's own flags; then, where a launcher can be played on one machine, each process is
started as that launcher starts it -- the variables Vertex AI, Kubeflow Trainer or srun set,
or ``mpirun`` itself -- with ``resnet`` replaced by tests/launch_shim.py, which parses the same
command line and runs the launch (detection, the check between processes, joining JAX) instead
of training. The GKE JobSet and the Vertex TPU job are parsed only: JAX's TPU detection there
reads a TPU VM's metadata. Every container spec names this checkout's image (Containerfile), the
target that fits its machines; the JobSet's failure policy is checked against the exit codes
estimax uses.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import multihost_helpers as mh
import pytest
import yaml
from absl import flags

from estimax.parallel import watchdog
from estimax.programs import resnet

SPECS = os.path.join(mh.ROOT, "examples", "launch")
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_shim.py")
CLEAN = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_", "ESTIMAX_", "XLA_FLAGS", *mh.CLUSTER_PREFIXES))
    and k not in mh.CLUSTER_VARS
}


# The registry path the specs push this checkout's image to; the tag is the Containerfile target.
IMAGE = "us-docker.pkg.dev/my-project/estimax/estimax"
# estimax's exit codes a job runner acts on: a configuration error (one FATAL line) and the hang
# watchdog's (sysexits' EX_TEMPFAIL).
CONFIG_ERROR_EXIT = 2


def _containerfile_targets() -> set[str]:
    with open(os.path.join(mh.ROOT, "Containerfile")) as f:
        return set(re.findall(r"^FROM \S+ AS (\S+)$", f.read(), re.M))


def _text(name: str) -> str:
    with open(os.path.join(SPECS, name)) as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(os.listdir(SPECS)))
def test_every_spec_is_in_the_manual_word_for_word(name):
    with open(os.path.join(mh.ROOT, "docs", "many-hosts.md")) as f:
        assert _text(name) in f.read(), (
            f"docs/many-hosts.md lacks examples/launch/{name} as written"
        )


def _parse_resnet(argv: list[str]) -> flags.FlagValues:
    fv = flags.FlagValues()
    resnet.define_flags(fv)
    fv(["resnet", *argv])
    return fv


def _bin(tmp_path) -> dict[str, str]:
    """A PATH where ``resnet`` is the shim; the environment every process starts with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "resnet").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{SHIM}" "$@"\n')
    (bin_dir / "resnet").chmod(0o755)
    return {
        **CLEAN,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": mh.ROOT,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    }


def _port() -> int:
    return mh._free_port()  # noqa: SLF001 - the helpers' own


def test_vertex_job_spec_parses_and_its_replicas_start_one_job(tmp_path):
    spec = yaml.safe_load(_text("vertex_job.yaml"))
    pools = spec["workerPoolSpecs"]
    assert len(pools) == 4 and pools[2] == {}  # no parameter servers
    assert pools[0]["replicaCount"] == 1  # the primary pool: process 0
    commands = {json.dumps(p["containerSpec"]) for p in pools if p}
    assert len(commands) == 1  # every pool runs the same container and command
    container = pools[0]["containerSpec"]
    assert container["command"] == ["resnet"]
    fv = _parse_resnet(container["args"])
    assert fv.model_dir.startswith("gs://") and fv.coordinator_address is None
    # Vertex's $CLUSTER_SPEC for each replica, on loopback: one workerpool1 replica (3 in the
    # spec), the evaluator; the same command, its bucket paths made local.
    port = _port()
    cluster = {
        "workerpool0": [f"localhost:{port}"],
        "workerpool1": ["localhost:1"],
        "workerpool3": ["localhost:2"],
    }
    args = [a.replace("gs://my-bucket", str(tmp_path)) for a in container["args"]]
    env = _bin(tmp_path)
    procs = mh.finish(
        [
            subprocess.Popen(
                [*container["command"], *args],
                env={
                    **env,
                    "CLUSTER_SPEC": json.dumps(
                        {"cluster": cluster, "task": {"type": pool, "index": 0}}
                    ),
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for pool in ("workerpool0", "workerpool1", "workerpool3")
        ]
    )
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    for i in (0, 1):
        assert "resnet: mode train\n" in procs[i].stdout  # the evaluator evaluates
        assert f"launch: vertex ($CLUSTER_SPEC task workerpool{i}:0): process {i} of 2" in (
            procs[i].stdout
        )
        assert "launch: global mesh: 2 devices over 2 processes" in procs[i].stdout
    assert "resnet: mode eval\n" in procs[2].stdout
    assert "workerpool3:0: the job's evaluator" in procs[2].stdout


def _images(spec: object) -> list[str]:
    """Every image a spec names (``image``, ``imageUri``), at any depth."""
    if isinstance(spec, dict):
        found = [v for k, v in spec.items() if k in ("image", "imageUri")]
        return found + [i for v in spec.values() for i in _images(v)]
    if isinstance(spec, list):
        return [i for v in spec for i in _images(v)]
    return []


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(SPECS) if n.endswith(".yaml")))
def test_every_spec_names_the_image_this_checkout_builds_for_its_machines(name):
    text = _text(name)
    images = _images(yaml.safe_load(text))
    assert images, f"{name} names no image"
    targets = _containerfile_targets()
    assert {"cpu", "cuda12", "tpu"} <= targets
    for image in images:
        repo, _, tag = image.rpartition(":")
        assert repo == IMAGE and tag in targets, (name, image)
        # The target that has the machines' JAX plugin: TPUs want libtpu, NVIDIA GPUs CUDA 12.
        want = "tpu" if "google.com/tpu" in text or "tpuTopology" in text else "cuda12"
        assert tag == want, (name, image, want)
        assert f"--target {tag}" in text, f"{name}'s comment does not say how its image is built"


def test_gke_jobset_fails_on_a_configuration_error_and_restarts_on_a_hang():
    spec = yaml.safe_load(_text("jobset_tpu.yaml"))
    policy = spec["spec"]["failurePolicy"]
    [job] = spec["spec"]["replicatedJobs"]
    job_spec = job["template"]["spec"]
    [container] = job_spec["template"]["spec"]["containers"]
    # The pod level (Kubernetes' podFailurePolicy): exit 2 fails the Job with reason
    # PodFailurePolicy; exit 75 counts against backoffLimit 0, so the Job fails with reason
    # BackoffLimitExceeded, as any other failure does (kubernetes.io, Job's podFailurePolicy).
    assert (
        job_spec["backoffLimit"] == 0 and job_spec["template"]["spec"]["restartPolicy"] == "Never"
    )

    def pod_action(code: int) -> str:
        for rule in job_spec["podFailurePolicy"]["rules"]:
            on = rule["onExitCodes"]
            assert on["containerName"] == container["name"] and on["operator"] == "In"
            if code in on["values"]:
                return rule["action"]
        return "Count"

    reasons = {"FailJob": "PodFailurePolicy", "Count": "BackoffLimitExceeded"}

    # The JobSet level (jobset.x-k8s.io/v1alpha2 failurePolicy.rules: the first rule whose
    # onJobFailureReasons holds the Job's reason acts; none: RestartJobSet).
    def jobset_action(code: int) -> str:
        reason = reasons[pod_action(code)]
        for rule in policy["rules"]:
            assert set(rule) <= {"name", "action", "onJobFailureReasons", "targetReplicatedJobs"}
            if reason in rule["onJobFailureReasons"]:
                return rule["action"]
        return "RestartJobSet"

    assert jobset_action(CONFIG_ERROR_EXIT) == "FailJobSet"
    assert jobset_action(watchdog.HANG_EXIT_CODE) == "RestartJobSet"
    assert jobset_action(1) == jobset_action(134) == "RestartJobSet"  # a crash; JAX's abort
    assert 0 < policy["maxRestarts"] < 10  # a job that keeps hanging ends


def test_vertex_tpu_job_spec_parses_as_one_process_on_one_host(tmp_path):
    spec = yaml.safe_load(_text("vertex_tpu_job.yaml"))
    [pool] = spec["workerPoolSpecs"]
    machine = pool["machineSpec"]
    assert machine["machineType"].startswith("ct5lp-hightpu-") and pool["replicaCount"] == 1
    chips = 1
    for n in machine["tpuTopology"].split("x"):
        chips *= int(n)
    assert machine["machineType"] == f"ct5lp-hightpu-{chips}t"  # the host's chips, one host
    container = pool["containerSpec"]
    assert container["command"] == ["resnet"]
    fv = _parse_resnet(container["args"])
    assert fv.model_dir.startswith("gs://") and fv.coordinator_address is None
    # Vertex's $CLUSTER_SPEC for its one replica: no job to join.
    from estimax.parallel import launch

    alone = launch.detect(
        None,
        environ={
            "CLUSTER_SPEC": json.dumps(
                {"cluster": {"workerpool0": ["h:2222"]}, "task": {"type": "workerpool0"}}
            )
        },
    )
    assert not alone.joins


def test_kubeflow_trainjob_parses_and_its_pods_start_one_job_from_jax_variables(tmp_path):
    spec = yaml.safe_load(_text("trainjob_jax.yaml"))
    assert spec["kind"] == "TrainJob" and spec["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert spec["spec"]["runtimeRef"]["name"] == "jax-distributed"
    trainer = spec["spec"]["trainer"]
    assert trainer["command"] == ["resnet"] and trainer["numNodes"] == 2
    fv = _parse_resnet(trainer["args"])
    assert fv.coordinator_address == "auto"
    # The variables the jax-distributed runtime sets in each of its numNodes pods, on loopback.
    port = _port()
    args = [a.replace("gs://my-bucket", str(tmp_path)) for a in trainer["args"]]
    env = _bin(tmp_path)
    procs = mh.finish(
        [
            subprocess.Popen(
                [*trainer["command"], *args],
                env={
                    **env,
                    "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                    "JAX_NUM_PROCESSES": str(trainer["numNodes"]),
                    "JAX_PROCESS_ID": str(i),
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(trainer["numNodes"])
        ]
    )
    for i, p in enumerate(procs):
        assert p.returncode == 0, p.stderr[-3000:]
        assert (
            "launch: jax_env ($JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID): "
            f"process {i} of 2, coordinator localhost:{port}"
        ) in p.stdout
        assert "launch: global mesh: 2 devices over 2 processes" in p.stdout


def test_gke_jobset_for_a_tpu_slice_parses():
    spec = yaml.safe_load(_text("jobset_tpu.yaml"))
    assert spec["kind"] == "JobSet" and spec["apiVersion"].startswith("jobset.x-k8s.io/")
    [job] = spec["spec"]["replicatedJobs"]
    job_spec = job["template"]["spec"]
    # One pod per TPU host, indexed (JAX's GKE detection reads the pod's worker id).
    assert job_spec["parallelism"] == job_spec["completions"] == 4
    assert job_spec["completionMode"] == "Indexed"
    pod = job_spec["template"]["spec"]
    topology = pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    chips = 1
    for n in topology.split("x"):
        chips *= int(n)
    [container] = pod["containers"]
    per_host = container["resources"]["limits"]["google.com/tpu"]
    assert chips == per_host * job_spec["parallelism"]  # the slice's chips, all of them
    assert container["command"] == ["resnet"]
    fv = _parse_resnet(container["args"])
    assert fv.coordinator_address == "auto"


def test_slurm_batch_script_parses_and_starts_one_job_under_a_stand_in_srun(tmp_path):
    script = _text("slurm_job.sh")
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", script, re.M))
    assert options["nodes"] == "2" and options["ntasks-per-node"] == options["gpus-per-node"]
    [srun] = [ln for ln in script.replace("\\\n", "").splitlines() if ln.startswith("srun ")]
    argv = shlex.split(srun)[1:]
    assert argv[0] == "resnet"
    _parse_resnet(argv[1:])
    # srun as `sbatch --nodes=1 --ntasks-per-node=2 slurm_job.sh` would run it: 2 tasks on this
    # host, each with the variables srun sets. JAX_COORDINATOR_PORT (JAX's own override of the
    # port it derives from the job id) picks a free one.
    env = _bin(tmp_path)
    srun_path = tmp_path / "bin" / "srun"
    srun_path.write_text(
        "#!/bin/bash\n"
        "for i in 0 1; do SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NTASKS=2 SLURM_JOB_ID=77 "
        'SLURM_STEP_NODELIST=localhost SLURM_STEP_NUM_NODES=1 "$@" > "$OUT.$i" 2>&1 & done\n'
        "wait\n"
    )
    srun_path.chmod(0o755)
    script_path = tmp_path / "slurm_job.sh"
    script_path.write_text(script.replace("/shared", str(tmp_path)))
    out = str(tmp_path / "task")
    proc = subprocess.run(
        ["bash", str(script_path)],
        env={**env, "OUT": out, "JAX_COORDINATOR_PORT": str(_port())},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for i in (0, 1):
        with open(f"{out}.{i}") as f:
            log = f.read()
        assert f"launch: slurm (JAX's slurm detection): process {i} of 2" in log, log[-3000:]
        assert "launch: global mesh: 2 devices over 2 processes" in log, log[-3000:]


@pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="mpirun (Open MPI 4) is not installed: apt-get install openmpi-bin (a system package, "
    "which make never installs)",
)
def test_mpirun_command_parses_and_starts_one_job_on_loopback(tmp_path):
    script = _text("mpirun.sh")
    [line] = [ln for ln in script.replace("\\\n", "").splitlines() if ln.startswith("mpirun ")]
    argv = shlex.split(line)
    program = argv.index("resnet")
    _parse_resnet(argv[program + 1 :])
    assert argv[argv.index("-np") + 1] == "16" and "--bind-to" in argv
    # The same command on this host: 2 processes instead of 2 nodes x 8.
    local = " ".join(argv).replace("-np 16 -H node0:8,node1:8", "-np 2 -H localhost:2")
    local = local.replace("/shared", str(tmp_path))
    env = {
        **_bin(tmp_path),
        "JAX_COORDINATOR_PORT": str(_port()),
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    proc = subprocess.run(
        shlex.split(local) + [], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i in (0, 1):
        assert f"launch: ompi (JAX's ompi detection): process {i} of 2" in proc.stdout
    assert proc.stdout.count("launch: global mesh: 2 devices over 2 processes") == 2
