"""The job specs users copy from the README (examples/launch/): parsed, and started on loopback.

Each spec is in the README word for word. Its program's command line is parsed with the
program's own flags; then, where a launcher can be played on one machine, each process is
started as that launcher starts it -- the variables Vertex AI or srun set, or ``mpirun`` itself
-- with ``resnet`` replaced by tests/launch_shim.py, which parses the same command line and runs
the launch (detection, the check between processes, joining JAX) instead of training. The GKE
JobSet is parsed only: JAX's TPU detection there reads a TPU VM's metadata.
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

from estimax.programs import resnet

SPECS = os.path.join(mh.ROOT, "examples", "launch")
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_shim.py")
CLEAN = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("JAX_", "ESTIMAX_", "XLA_FLAGS", *mh.CLUSTER_PREFIXES))
    and k not in mh.CLUSTER_VARS
}


def _text(name: str) -> str:
    with open(os.path.join(SPECS, name)) as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(os.listdir(SPECS)))
def test_every_spec_is_in_the_readme_word_for_word(name):
    with open(os.path.join(mh.ROOT, "README.md")) as f:
        assert _text(name) in f.read(), f"README.md lacks examples/launch/{name} as written"


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
