"""Starting test jobs of 1 or 2 processes of the MNIST program on localhost (JAX's CPU runtime).

A 2-process job: two ``tests/multihost_worker.py`` processes joined by ``jax.distributed`` on a
free localhost port, each with 2 CPU devices; the 1-process job it is compared with has 4, so
both run 4 replicas on the same global batches. Reference runs are cached for the session
(``reference``): test_multihost and test_preemption compare against the same runs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable

import numpy as np
import zygote

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_STEPS = 6
# 35 held-out digits in blocks of 4 (the per-host batch): 19 on process 0, 16 on process 1, which
# runs a fifth eval batch fully masked.
NUM_EVAL = 35
FLAGS = (
    "--batch_size=8",
    f"--train_steps={TRAIN_STEPS}",
    "--iterations=2",
    "--save_checkpoints_steps=2",
    "--eval_steps=-1",
    "--dense_units=16",
    "--learning_rate=0.1",
)


# Variables that tell a process its job: never inherited from the test's own environment.
CLUSTER_VARS = ("TF_CONFIG", "CLUSTER_SPEC")
CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_")


@dataclasses.dataclass
class Proc:
    returncode: int
    stdout: str
    stderr: str


def write_data(path: str) -> str:
    """The demo's digits, few of them: 64 to train on, ``NUM_EVAL`` held out."""
    from estimax.tools import mnist_data

    if not os.path.exists(os.path.join(path, "validation.tfrecords")):
        os.makedirs(path, exist_ok=True)
        images, labels = mnist_data.load_mnist_5k()
        (train_x, train_y), (eval_x, eval_y) = mnist_data.split(images, labels)
        mnist_data.write_tfrecords(
            os.path.join(path, "train.tfrecords"), train_x[:64], train_y[:64]
        )
        mnist_data.write_tfrecords(
            os.path.join(path, "validation.tfrecords"), eval_x[:NUM_EVAL], eval_y[:NUM_EVAL]
        )
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_env(data_dir: str, devices: int) -> dict[str, str]:
    """The environment of each process of a test job: this checkout, ``devices`` CPU devices,
    a shared compilation cache, and nothing of the test's own job variables."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ESTIMAX_", "JAX_", "XLA_FLAGS", "PYTEST", *CLUSTER_PREFIXES))
        and k not in CLUSTER_VARS
    }
    base.update(
        PYTHONPATH=ROOT,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        ESTIMAX_REQUIRE_ONEDNN="0",
        JAX_PLATFORMS="cpu",
        # Every run compiles the same few programs: the second and later take them from the
        # test run's cache (tests/conftest.py; `make test` keeps it between runs), else here.
        JAX_COMPILATION_CACHE_DIR=os.environ.get("JAX_COMPILATION_CACHE_DIR")
        or os.path.join(os.path.dirname(data_dir), "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return base


def run_job(
    num_processes: int,
    data_dir: str,
    model_dir: str,
    *extra: str,
    faults: dict[int, str] | None = None,
    per_process: dict[int, tuple[str, ...]] | None = None,
    timeout: float = 300,
    devices: int = 4,
    cluster_env: Callable[[int, int], dict[str, str]] | None = None,
) -> list[Proc]:
    """Runs the MNIST program as a job of ``num_processes``; returns each process's result.

    Args:
      faults: ``{process: "kind:N"}`` (see multihost_worker.py).
      per_process: extra flags for one process only.
      devices: CPU devices of the whole job, split evenly between its processes.
      cluster_env: ``(process, free port) -> variables`` that tell each process its job (a
        ``TF_CONFIG``...) instead of the cluster flags.
    """
    base = _job_env(data_dir, devices // num_processes)
    cluster: tuple[str, ...] = ()
    port = _free_port()
    out_dir = tempfile.mkdtemp(prefix="estimax-job-")
    specs = []
    for i in range(num_processes):
        env = dict(base)
        if faults and i in faults:
            env["ESTIMAX_TEST_FAULT"] = faults[i]
        if cluster_env is not None:
            env.update(cluster_env(i, port))
        elif num_processes > 1:
            cluster = (
                f"--coordinator_address=localhost:{port}",
                f"--num_processes={num_processes}",
                f"--process_id={i}",
            )
        argv = (
            WORKER,
            f"--data_dir={data_dir}",
            f"--model_dir={model_dir}",
            *FLAGS,
            *cluster,
            *extra,
            *((per_process or {}).get(i, ())),
        )
        out = os.path.join(out_dir, str(i))
        specs.append(zygote.Spec(argv, env, out + ".out", out + ".err"))
    try:
        return _finish_launched(launch(base, specs), specs, timeout)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def launch(
    base: dict[str, str], specs: list[zygote.Spec]
) -> list[subprocess.Popen | zygote.Forked]:
    """Starts a job's processes (``tests/multihost_worker.py`` each): forked from one zygote
    (tests/zygote.py says why) unless a process's variables differ in what JAX reads at import
    or ``ESTIMAX_TEST_FORK=0``; else each one its own interpreter. Output goes to the specs'
    files."""
    if os.environ.get("ESTIMAX_TEST_FORK", "1") != "0" and zygote.can_fork(
        base, [s.env for s in specs]
    ):
        return zygote.start(base, specs)
    procs = []
    for spec in specs:
        with open(spec.stdout, "w") as out, open(spec.stderr, "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *spec.argv],
                    env=dict(spec.env),
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    text=True,
                )
            )
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[Proc]:
    """Each process's result, in order; any still running after ``timeout`` is killed."""
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(Proc(p.returncode, out, err))
    finally:
        _kill_running(procs)
    return results


def _finish_launched(
    procs: list[subprocess.Popen | zygote.Forked], specs: list[zygote.Spec], timeout: float
) -> list[Proc]:
    """``finish`` for ``launch``'s processes: their output is in their specs' files."""
    results = []
    try:
        for p, spec in zip(procs, specs, strict=True):
            p.wait(timeout=timeout)
            with open(spec.stdout) as out, open(spec.stderr) as err:
                results.append(Proc(p.returncode, out.read(), err.read()))
    finally:
        _kill_running(procs)
    return results


def _kill_running(procs: list[subprocess.Popen] | list[subprocess.Popen | zygote.Forked]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def assert_ok(results: list[Proc]) -> None:
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i} exited {r.returncode}:\n{r.stderr[-4000:]}"


def params(model_dir: str) -> dict:
    """The latest checkpoint's variables, as numpy (read in this test process)."""
    import estimax as ex
    from estimax.state import checkpoints

    step = checkpoints.Checkpointer(model_dir, None, read_only=True).latest_step()
    path = os.path.join(checkpoints.checkpoint_dir(model_dir), str(step))
    est = ex.Estimator(lambda features, labels, mode, params: None, ex.RunConfig(model_dir))
    return {"step": step, **est.get_variables(path)}


def assert_same_params(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    import jax

    assert a["step"] == b["step"]
    leaves_a = jax.tree_util.tree_leaves_with_path(a["params"])
    leaves_b = dict(jax.tree_util.tree_leaves_with_path(b["params"]))
    assert len(leaves_a) == len(leaves_b) > 0
    for path, x in leaves_a:
        np.testing.assert_allclose(
            x, leaves_b[path], rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


def assert_bitwise(a: dict, b: dict) -> None:
    """The two checkpoints' parameters are bitwise equal (``params`` results)."""
    import jax

    leaves_a = jax.tree_util.tree_leaves_with_path(a["params"])
    leaves_b = dict(jax.tree_util.tree_leaves_with_path(b["params"]))
    assert len(leaves_a) == len(leaves_b) > 0
    for path, x in leaves_a:
        np.testing.assert_array_equal(x, leaves_b[path], err_msg=jax.tree_util.keystr(path))


def run_mnist(tmp_path: str, *args: str, env: dict[str, str]) -> Proc:
    """One process of the MNIST program on the digits, with ``args`` and exactly ``env``."""
    data_dir = write_data(os.path.join(tmp_path, "data"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "estimax.programs.mnist",
            f"--data_dir={data_dir}",
            f"--model_dir={os.path.join(tmp_path, 'model')}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    return Proc(proc.returncode, proc.stdout, proc.stderr)


def eval_results(stderr: str) -> dict[str, float]:
    """The evaluation's full-precision results, from the 'Saving dict for global step' line."""
    match = re.findall(r"Saving dict for global step \d+: (.*)", stderr)
    assert match, stderr[-3000:]
    return {k: float(v) for k, v in (kv.split(" = ") for kv in match[-1].split(", "))}


def saved_step(stdout: str) -> int:
    match = re.search(r"Preempted \(SIGTERM\): saved a checkpoint at step (\d+) in ", stdout)
    assert match, stdout
    return int(match.group(1))


_REFERENCE: dict[int, tuple[str, list[Proc]]] = {}


def reference(num_processes: int, tmp_path_factory) -> tuple[str, str, list[Proc]]:
    """(data_dir, model_dir, results) of an uninterrupted job, run once per session."""
    data_dir = write_data(str(tmp_path_factory.getbasetemp() / "multihost_data"))
    if num_processes not in _REFERENCE:
        model_dir = str(tmp_path_factory.mktemp(f"reference_{num_processes}"))
        results = run_job(num_processes, data_dir, model_dir)
        assert_ok(results)
        _REFERENCE[num_processes] = (model_dir, results)
    model_dir, results = _REFERENCE[num_processes]
    return data_dir, model_dir, results


def run_mnist_here(tmp_path: str, *args: str, env: dict[str, str], monkeypatch, capsys) -> Proc:
    """``run_mnist`` in this process, for a run that stops before joining a job: the program's
    console-script path (``cli._parse``, ``cli._run``) with ``env`` as the job's variables (the
    test's own job variables removed). A traceback would be an exception raised here."""
    from absl import flags

    from estimax.programs import cli, mnist

    for name in list(os.environ):
        if name.startswith(("JAX_", "ESTIMAX_", *CLUSTER_PREFIXES)) or name in CLUSTER_VARS:
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    data_dir = write_data(os.path.join(tmp_path, "data"))
    argv = ["mnist", f"--data_dir={data_dir}", f"--model_dir={os.path.join(tmp_path, 'model')}"]
    family = mnist.FAMILY
    config = None if family.config_keys is None else (family.name, family.config_keys)
    fv = flags.FlagValues()
    family.define_flags(fv)
    capsys.readouterr()
    code = 0
    try:
        rest = cli._parse(fv, [*argv, *args])
        cli._run(family.run_from_flags, fv, sorted(fv), config, rest)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return Proc(code, out.out, out.err)
