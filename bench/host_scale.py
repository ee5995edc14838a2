"""How a job's cost grows with its host count: 1 to 32 processes of the MNIST program on loopback.

Each host count N runs the MNIST program (``python -m estimax.programs.mnist``) as a job of N
processes joined by ``jax.distributed`` on localhost, 1 CPU device each (a simulated host), 4
examples per host per step (the global batch grows with N, as on a pod), twice on one
``model_dir``:

1. ``--train_steps=A`` from scratch, a checkpoint every 2 steps, then one evaluation of every
   held-out digit (``--eval_steps=-1``);
2. ``--train_steps=A+4``: the same command resumed from step A (a checkpoint restore), then
   the evaluation again.

The figures come from the goodput record every process writes (``estimax goodput``,
``estimax/state/goodput.py``): start-up (process start to its first record), compilation,
the productive seconds per step, checkpoint saves and restores, evaluation; beside them the
bench's own clock (launch to every process's exit) and the CPU seconds of all the processes
(``RUSAGE_CHILDREN``): on a machine with fewer cores than processes, wall time is CPU time over
the cores, so the CPU seconds per process say which work is per process and which per job.

    .venv/bin/python bench/host_scale.py [--hosts 1 2 4 8 16 32] [--steps 6] [--merge]

``--merge`` keeps the rows of the result file for the host counts not run this time (each row
run apart says when, and at what load), so a host count can be rerun alone on a quieter machine.

Child processes get fast XLA compiles (optimisation level 0) and one shared persistent
compilation cache, as the test suite's pod tests do. Writes ``bench/results/host_scale.md`` and
``.json`` with the machine, its load at the start and the end, and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from estimax.state import goodput  # noqa: E402 - after the checkout is on the path

PER_HOST_BATCH = 4
EXTRA_STEPS = 4  # the resumed run's steps
# Fast compiles in the children (the figures are the host's, not XLA's optimiser's).
CHILD_XLA_FLAGS = (
    "--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
)


def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's machine."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def write_data(path: str, num_train: int, num_eval: int) -> None:
    """The demo's digits: ``num_train`` to train on, ``num_eval`` held out."""
    from estimax.tools import mnist_data

    os.makedirs(path, exist_ok=True)
    images, labels = mnist_data.load_mnist_5k()
    (train_x, train_y), (eval_x, eval_y) = mnist_data.split(images, labels)
    mnist_data.write_tfrecords(
        os.path.join(path, "train.tfrecords"), train_x[:num_train], train_y[:num_train]
    )
    mnist_data.write_tfrecords(
        os.path.join(path, "validation.tfrecords"), eval_x[:num_eval], eval_y[:num_eval]
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache_dir: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ESTIMAX_", "JAX_", "XLA_FLAGS", "TF_CONFIG", "SLURM_", "OMPI_"))
    }
    env.update(
        PYTHONPATH=ROOT,
        XLA_FLAGS=CHILD_XLA_FLAGS,
        JAX_PLATFORMS="cpu",
        ESTIMAX_REQUIRE_ONEDNN="0",
        JAX_COMPILATION_CACHE_DIR=cache_dir,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return env


def run_job(n: int, data_dir: str, model_dir: str, steps: int, env: dict[str, str]) -> dict:
    """One job of ``n`` processes; (wall seconds, CPU seconds of all of them)."""
    port = _free_port()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    procs = []
    for i in range(n):
        cluster = (
            [
                f"--coordinator_address=localhost:{port}",
                f"--num_processes={n}",
                f"--process_id={i}",
            ]
            if n > 1
            else []
        )
        cmd = [
            sys.executable,
            "-m",
            "estimax.programs.mnist",
            f"--data_dir={data_dir}",
            f"--model_dir={model_dir}",
            f"--batch_size={PER_HOST_BATCH * n}",
            f"--train_steps={steps}",
            "--iterations=2",
            "--save_checkpoints_steps=2",
            "--eval_steps=-1",
            "--dense_units=16",
            "--learning_rate=0.1",
            *cluster,
        ]
        log = open(os.path.join(model_dir, f"p{i}.log"), "a")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
    codes = [p.wait() for p in procs]
    wall = time.time() - start
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if any(codes):
        bad = next(i for i, c in enumerate(codes) if c)
        with open(os.path.join(model_dir, f"p{bad}.log")) as f:
            tail = f.read()[-2000:]
        sys.exit(f"host_scale.py: {n} processes: process {bad} exited {codes[bad]}:\n{tail}")
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return {"wall_secs": wall, "cpu_secs": cpu, "started": start}


def _loop_start(model_dir: str, after: float) -> float:
    """The latest time a process of the job started its training loop (its ``train`` line)
    after ``after``: every process is past start-up, restore and the first compile then."""
    latest = after
    folder = os.path.join(model_dir, goodput.SUBDIR)
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for text in f:
                line = json.loads(text)
                if line.get("event") == "train" and line["t"] > after:
                    latest = max(latest, line["t"])
    return latest - after


def measure(n: int, steps: int, work: str, cache_dir: str) -> dict[str, Any]:
    """Both runs at ``n`` processes; the figures of each."""
    data_dir = os.path.join(work, "data")
    model_dir = os.path.join(work, f"model_{n}")
    shutil.rmtree(model_dir, ignore_errors=True)
    os.makedirs(model_dir)
    env = _env(cache_dir)
    figures: dict[str, Any] = {"processes": n}
    before = dict.fromkeys(goodput.BUCKETS, 0.0)
    for run, train_steps in (("fresh", steps), ("resumed", steps + EXTRA_STEPS)):
        job = run_job(n, data_dir, model_dir, train_steps, env)
        s = goodput.summarize(model_dir)
        secs = {k: s.buckets[k] - before.get(k, 0.0) for k in goodput.BUCKETS}
        before = dict(s.buckets)
        saves = train_steps // 2 if run == "fresh" else EXTRA_STEPS // 2
        figures[run] = {
            "wall_secs": round(job["wall_secs"], 2),
            "cpu_secs_per_process": round(job["cpu_secs"] / n, 2),
            "launch_to_loop_secs": round(_loop_start(model_dir, job["started"]), 2),
            "startup_secs": round(secs["startup"], 2),
            "compile_secs": round(secs["compile"], 2),
            "save_secs_per_checkpoint": round(secs["save"] / saves, 3),
            "restore_secs": round(secs["restore"], 3),
            "eval_secs": round(secs["eval"], 2),
            "productive_secs": round(secs["productive"], 3),
            "other_secs": round(secs["other"], 2),
        }
        print(f"{n} processes, {run}: {json.dumps(figures[run])}", flush=True)
    s = goodput.summarize(model_dir)
    figures["ms_per_step"] = round(1e3 * s.step_secs, 2)
    figures["ms_per_step_sd_over_loops"] = round(1e3 * s.step_sd, 2)
    spread = list(s.per_process.values())
    figures["slowest_over_fastest_process"] = (
        round(max(spread) / min(spread), 2) if len(spread) > 1 and min(spread) > 0 else 1.0
    )
    figures["goodput_ratio"] = round(s.ratio, 3)
    figures["lost_steps"] = s.lost_steps
    shutil.rmtree(model_dir, ignore_errors=True)  # a 32-process job's checkpoints and logs
    return figures


def report(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        "# How a job's cost grows with its host count (bench/host_scale.py)",
        "",
        f"{result['machine']}; {result['date_utc']} UTC; load average {result['load_start']} "
        f"at the start, {result['load_end']} at the end (the machine was shared with other "
        "jobs). MNIST program, 1 CPU device per process on loopback, "
        f"{PER_HOST_BATCH} examples per host per step, a checkpoint every 2 steps; run 1 trains "
        f"{result['steps']} steps from scratch and evaluates {result['num_eval']} digits, run 2 "
        f"resumes to step {result['steps'] + EXTRA_STEPS} and evaluates again. Seconds are "
        "means over the processes (the goodput record), except wall (launch to every exit) and "
        "launch-to-loop (launch to the last process starting its training loop).",
        "",
        *(
            [f"Command: `{result['command']}`"]
            if len(result.get("runs", [])) < 2
            else [
                "Runs (each row's note says which; the header's date and load are the first's):",
                "",
                *(
                    f"- {run['hosts']} processes: {run['date_utc']} UTC, load "
                    f"{run['load_start']} at the start, {run['load_end']} at the end; "
                    f"`{run.get('command', result['command'])}`"
                    for run in result["runs"]
                ),
            ]
        ),
        "",
        "| processes | wall run 1 / 2 (s) | CPU s per process, run 1 | launch to loop (s) | "
        "start-up (s) | compile (s) | ms per step | slowest / fastest process | save per "
        "checkpoint (s) | restore, run 2 (s) | eval run 1 / 2 (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["fresh"], r["resumed"]
        lines.append(
            f"| {r['processes']} | {a['wall_secs']} / {b['wall_secs']} | "
            f"{a['cpu_secs_per_process']} | {a['launch_to_loop_secs']} | {a['startup_secs']} | "
            f"{a['compile_secs']} | {r['ms_per_step']} | {r['slowest_over_fastest_process']} | "
            f"{a['save_secs_per_checkpoint']} | {b['restore_secs']} | "
            f"{a['eval_secs']} / {b['eval_secs']} |"
        )
    notes = [f"{r['processes']} processes: {r['note']}" for r in rows if r.get("note")]
    if notes:
        lines += [""] + [f"Note: {n}." for n in notes]
    if result.get("not_run"):
        lines += ["", f"Not run: {result['not_run']}"]
    lines += ["", "## Reading", "", result.get("reading", "(see bench/README.md)")]
    return "\n".join(lines) + "\n"


def _previous(out: str) -> dict[str, Any] | None:
    """The result file in ``out`` (None if there is none)."""
    try:
        with open(os.path.join(out, "host_scale.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def merged(previous: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """``result``'s rows with ``previous``'s of the host counts it did not run, in host order.

    Rows run at different times are not under the same load: each row of this run says when
    and at what load it ran, the file's header keeps the earlier runs' own, and ``runs`` lists
    every run (hosts, date, load, command). The reading (written by hand) is kept.
    """
    ran = {r["processes"] for r in result["rows"]}
    note = (
        f"run at {result['date_utc']} UTC with {sorted(ran)}, load {result['load_start']} at "
        f"the start and {result['load_end']} at the end, {result['num_eval']} eval digits"
    )
    rows = [r for r in previous["rows"] if r["processes"] not in ran]
    rows += [{**r, "note": note} for r in result["rows"]]
    runs = previous.get("runs") or [
        {
            "hosts": [r["processes"] for r in previous["rows"]],
            "date_utc": previous["date_utc"],
            "load_start": previous["load_start"],
            "load_end": previous["load_end"],
            "command": previous["command"],
        }
    ]
    runs = [
        *runs,
        {
            "hosts": sorted(ran),
            "date_utc": result["date_utc"],
            "load_start": result["load_start"],
            "load_end": result["load_end"],
            "command": result["command"],
        },
    ]
    not_run = sorted(set(previous.get("not_run_hosts", [])) - ran - {r["processes"] for r in rows})
    return {
        **previous,
        "rows": sorted(rows, key=lambda r: r["processes"]),
        "runs": runs,
        "not_run": f"{not_run} processes" if not_run else "",
        "not_run_hosts": not_run,
        "total_secs": result["total_secs"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=6, help="run 1's training steps")
    parser.add_argument(
        "--deadline_secs",
        type=float,
        default=None,
        help="start no host count after this many seconds (the rest is reported as not run)",
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the result file's rows of the host counts not run now (and its reading)",
    )
    args = parser.parse_args()
    began = time.time()
    load_start = [round(x, 2) for x in os.getloadavg()]
    num_eval = 2 * PER_HOST_BATCH * max(args.hosts)  # every host has eval examples
    work = tempfile.mkdtemp(prefix="host_scale_")
    write_data(os.path.join(work, "data"), 16 * max(args.hosts), num_eval)
    cache_dir = os.path.join(work, "jax_cache")
    rows, not_run = [], []
    for n in args.hosts:
        if args.deadline_secs is not None and time.time() - began > args.deadline_secs:
            not_run.append(n)
            continue
        rows.append(measure(n, args.steps, work, cache_dir))
    shutil.rmtree(work, ignore_errors=True)
    load_end = [round(x, 2) for x in os.getloadavg()]
    date_utc = time.strftime("%Y-%m-%d %H:%M", time.gmtime(began))
    command = "python bench/host_scale.py " + " ".join(sys.argv[1:])
    previous = _previous(args.out) if args.merge else None
    result = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
        "date_utc": date_utc,
        "load_start": load_start,
        "load_end": load_end,
        "command": command,
        "steps": args.steps,
        "num_eval": num_eval,
        "total_secs": round(time.time() - began, 1),
        "rows": rows,
        "not_run": (
            f"{not_run} processes: past --deadline_secs={args.deadline_secs}" if not_run else ""
        ),
    }
    if previous is not None:
        result = merged(previous, result)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_scale.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(args.out, "host_scale.md"), "w") as f:
        f.write(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
