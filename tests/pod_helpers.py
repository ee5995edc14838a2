"""Pod-scale test jobs: N processes x 1 CPU device of the MNIST program, on loopback.

One process per simulated host (``tests/multihost_worker.py``, so a process can be given a
fault), each with ONE CPU device and XLA's cheapest compile (the steps are tiny: optimising them
costs more than running them), all sharing one persistent compilation cache so that the 16 or 32
processes compile each program once between them, and forked from one interpreter that has
imported the program (tests/zygote.py: the import is a third of a process's CPU). Output goes
to files, not pipes: 16 processes writing to pipes that the test drains one at a time would
block on a full pipe.

``start`` returns the running processes (a test may kill one); ``finish`` waits for them with a
bound and returns each one's status, output and how long after ``since`` it ended.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import threading
import time

import multihost_helpers as mh
import zygote

# One CPU device per process, and XLA's fastest compile: the pod tests check coordination, not
# the speed of the tiny model.
XLA_FLAGS = (
    "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
)


@dataclasses.dataclass
class PodProc:
    """One finished process: its status, output, and seconds from ``finish``'s ``since``."""

    returncode: int
    stdout: str
    stderr: str
    ended_after: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@dataclasses.dataclass
class Job:
    """A started job: its processes (in process order) and where their output goes."""

    procs: list[subprocess.Popen | zygote.Forked]
    logs: list[tuple[str, str]]


def job_env(data_dir: str, devices: int = 1) -> dict[str, str]:
    """Each process's environment: ``multihost_helpers``' (this checkout, no inherited job
    variables) with ``devices`` CPU devices, the fast compile and the session's compilation
    cache."""
    env = mh._job_env(data_dir, devices)  # noqa: SLF001 (the shared test harness)
    env["XLA_FLAGS"] = XLA_FLAGS.replace("count=1 ", f"count={devices} ")
    # tests/conftest.py sets the session's cache; processes started outside pytest get their own.
    env["JAX_COMPILATION_CACHE_DIR"] = os.environ.get(
        "JAX_COMPILATION_CACHE_DIR", env["JAX_COMPILATION_CACHE_DIR"]
    )
    return env


def start(
    num_processes: int,
    data_dir: str,
    model_dir: str,
    log_dir: str,
    *flags: str,
    faults: dict[int, str] | None = None,
    env: dict[str, str] | None = None,
    devices: int = 1,
) -> Job:
    """Starts ``num_processes`` processes of the MNIST program joined on a free loopback port.

    Args:
      flags: the program's flags, the same for every process (``--model_dir``, ``--data_dir``
        and the cluster flags are added).
      faults: ``{process: "kind:N[:S]"}`` (tests/multihost_worker.py).
      env: extra variables for every process.
      devices: CPU devices of each process (a reference run: one process with a pod's many).
    """
    os.makedirs(log_dir, exist_ok=True)
    base = job_env(data_dir, devices)
    base.update(env or {})
    port = mh._free_port()  # noqa: SLF001
    specs = []
    for i in range(num_processes):
        proc_env = dict(base)
        if faults and i in faults:
            proc_env["ESTIMAX_TEST_FAULT"] = faults[i]
        cluster = (
            (
                f"--coordinator_address=localhost:{port}",
                f"--num_processes={num_processes}",
                f"--process_id={i}",
            )
            if num_processes > 1
            else ()
        )
        specs.append(
            zygote.Spec(
                (mh.WORKER, f"--data_dir={data_dir}", f"--model_dir={model_dir}", *flags, *cluster),
                proc_env,
                os.path.join(log_dir, f"{i}.out"),
                os.path.join(log_dir, f"{i}.err"),
            )
        )
    return Job(mh.launch(base, specs), [(s.stdout, s.stderr) for s in specs])


def finish(job: Job, timeout: float, since: float | None = None) -> list[PodProc]:
    """Waits for every process (killing any still running after ``timeout`` s); each one's
    status, output, and when it ended, in seconds after ``since`` (monotonic; default: now)."""
    since = time.monotonic() if since is None else since
    ended: dict[int, float] = {}

    def wait(i: int, p: subprocess.Popen) -> None:
        try:
            p.wait(timeout=max(0.0, since + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            return
        ended[i] = time.monotonic() - since

    threads = [
        threading.Thread(target=wait, args=(i, p), daemon=True) for i, p in enumerate(job.procs)
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    finally:
        for p in job.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for i, (p, (out, err)) in enumerate(zip(job.procs, job.logs, strict=True)):
        with open(out) as o, open(err) as e:
            results.append(PodProc(p.returncode, o.read(), e.read(), ended.get(i, float("inf"))))
    return results


def run(
    num_processes: int,
    data_dir: str,
    model_dir: str,
    log_dir: str,
    *flags: str,
    timeout: float = 600,
    devices: int = 1,
) -> list[PodProc]:
    """``start`` then ``finish``: a whole job's results."""
    job = start(num_processes, data_dir, model_dir, log_dir, *flags, devices=devices)
    return finish(job, timeout)


def assert_ok(results: list[PodProc]) -> None:
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i} exited {r.returncode}:\n{r.stderr[-4000:]}"
