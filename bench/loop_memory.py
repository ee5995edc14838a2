"""Peak RSS of the resnet program against ``--iterations_per_loop``: streaming keeps it flat.

Runs ``python -m estimax.programs.resnet --mode=train`` on fake data (ResNet-18, 128x128,
batch 16, float32, ``--num_cores=1``) under ``/usr/bin/time -v`` once per
``--iterations_per_loop`` value, the runs side by side, each for the same number of steps so
both do the same work (the largest value then runs one loop of all ``--train_steps``: 20x the
other's loop at the default 40 steps, what a shared 2-core machine allows), and compares the
maximum resident set sizes. Before streaming, a loop's batches were all read (and stacked)
before its first step: +0.67 MB per image held at 224 px.

    .venv/bin/python bench/loop_memory.py [--train_steps 40 --iterations_per_loop 2 200]

Writes bench/results/loop_memory.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time


def start(iterations_per_loop: int, train_steps: int, extra: list[str]) -> subprocess.Popen:
    """Starts the program under ``/usr/bin/time -v``; its stderr goes to a temporary file."""
    model_dir = tempfile.mkdtemp(prefix=f"loop_memory_ipl{iterations_per_loop}_")
    cmd = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-m",
        "estimax.programs.resnet",
        "--mode=train",
        "--resnet_depth=18",
        "--image_size=128",
        "--train_batch_size=16",
        "--precision=float32",
        "--num_cores=1",
        f"--train_steps={train_steps}",
        f"--iterations_per_loop={iterations_per_loop}",
        f"--model_dir={model_dir}",
        *extra,
    ]
    log = open(os.path.join(model_dir, "stderr.txt"), "w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log, proc.started = log, time.perf_counter()
    return proc


def finish(proc: subprocess.Popen, iterations_per_loop: int) -> tuple[float, float]:
    """Waits for a run; returns (peak RSS in MB, wall seconds)."""
    proc.wait()
    wall = time.perf_counter() - proc.started
    proc.log.seek(0)
    stderr = proc.log.read()
    if proc.returncode != 0:
        sys.exit(
            f"loop_memory.py: the resnet program failed (ipl={iterations_per_loop}):\n"
            f"{stderr[-3000:]}"
        )
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    if match is None:
        sys.exit("loop_memory.py: /usr/bin/time -v printed no maximum resident set size.")
    return int(match.group(1)) / 1024, wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_steps", type=int, default=40)
    parser.add_argument("--iterations_per_loop", type=int, nargs="+", default=[2, 200])
    parser.add_argument("extra", nargs="*", help="more flags for the resnet program")
    args = parser.parse_args()
    load_start = os.getloadavg()
    runs = {}
    # Concurrently: a process's peak RSS does not depend on how fast it runs, and this halves
    # the wall time on a shared machine.
    procs = {ipl: start(ipl, args.train_steps, args.extra) for ipl in args.iterations_per_loop}
    for ipl, proc in procs.items():
        rss, wall = finish(proc, ipl)
        runs[ipl] = {"peak_rss_mb": round(rss, 1), "wall_secs": round(wall, 1)}
        print(f"iterations_per_loop={ipl}: peak RSS {rss:.1f} MB, {wall:.0f} s", flush=True)
    base = runs[min(runs)]["peak_rss_mb"]
    result = {
        "what": "peak RSS of `resnet --mode=train` (fake data, ResNet-18, 128 px, batch 16, "
        "float32, --num_cores=1), same --train_steps for every --iterations_per_loop",
        "train_steps": args.train_steps,
        "extra_flags": args.extra,
        "runs": {str(k): v for k, v in runs.items()},
        "ratio_to_smallest_ipl": {
            str(k): round(v["peak_rss_mb"] / base, 3) for k, v in runs.items()
        },
        "estimax_onednn": os.environ.get("ESTIMAX_ONEDNN", "default"),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    out = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "loop_memory.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out, "loop_memory.md"), "w") as f:
        f.write("# Peak RSS against iterations_per_loop (bench/loop_memory.py)\n\n")
        f.write(
            f"{result['what']}: {args.train_steps} steps each; load average "
            f"{result['loadavg_start']} at the start, {result['loadavg_end']} at the end "
            f"({os.cpu_count()} CPUs, shared); ESTIMAX_ONEDNN={result['estimax_onednn']}; "
            f"{result['date_utc']} UTC.\n\n"
        )
        f.write("| iterations_per_loop | peak RSS (MB) | ratio | wall (s) |\n|---|---|---|---|\n")
        for k, v in runs.items():
            f.write(
                f"| {k} | {v['peak_rss_mb']} | {result['ratio_to_smallest_ipl'][str(k)]} | "
                f"{v['wall_secs']} |\n"
            )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
