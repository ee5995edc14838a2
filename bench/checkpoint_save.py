"""Checkpoint save time at 8 devices: Orbax's default array handler against estimax's.

Orbax splits every replicated array's save across the replicas, compiling a slice program per
shape and replica; estimax has it split only arrays of at least 1 MiB per replica
(``estimax/state/checkpoints.py``). Each run is a fresh process (the first save pays the
compiles) with 8 host devices, a ResNet's variables and momentum state replicated on them, saved
twice through ``estimax.state.checkpoints.Checkpointer``; the baseline puts Orbax's default
``ArrayHandler`` back after the Checkpointer registered estimax's. The runs alternate, side by
side, ``--repeats`` times each.

    .venv/bin/python bench/checkpoint_save.py [--depths 18 50 --repeats 2]

Writes bench/results/checkpoint_save.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HANDLERS = ("orbax_default", "estimax")

CHILD = """
import json, os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np, optax, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from estimax.state import checkpoints
from estimax.models.resnet import resnet_v1

handler, depth, model_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = resnet_v1(depth, num_classes=1000)
variables = model.init(jax.random.key(0), jnp.ones((1, 64, 64, 3)), train=False)
state = {"variables": variables, "momentum": optax.sgd(0.1, 0.9).init(variables["params"])}
replicated = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec())
state = jax.block_until_ready(jax.device_put(state, replicated))
ckpt = checkpoints.Checkpointer(model_dir, async_save=False)
if handler == "orbax_default":
    default = ocp.type_handlers.ArrayHandler()
    ocp.type_handlers.register_type_handler(jax.Array, default, override=True)
seconds = []
for step in (1, 2):
    start = time.perf_counter()
    ckpt.save(step, state, {}, {}, None)
    ckpt.wait_until_finished()
    seconds.append(time.perf_counter() - start)
leaves = jax.tree.leaves(state)
print(json.dumps({"seconds": seconds, "arrays": len(leaves),
                  "mb": sum(x.nbytes for x in leaves) / 1e6}))
"""


def run(handler: str, depth: int) -> dict:
    """One fresh process: two saves of a ResNet-``depth`` state; their seconds."""
    with tempfile.TemporaryDirectory(prefix="checkpoint_save_") as model_dir:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, handler, str(depth), model_dir],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)},
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's machine."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    """Runs the comparison and writes the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[18, 50])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    load_start = os.getloadavg()
    rows = []
    for depth in args.depths:
        for repeat in range(args.repeats):
            for handler in HANDLERS:
                result = run(handler, depth)
                rows.append({"depth": depth, "repeat": repeat, "handler": handler, **result})
                print(rows[-1], flush=True)
    result = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows,
    }
    out = os.path.join(HERE, "results", "checkpoint_save")
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        "# Checkpoint save at 8 devices: Orbax's default handler vs estimax's "
        "(bench/checkpoint_save.py)",
        "",
        f"{result['machine']}; 8 host devices (XLA CPU); load average "
        f"{[round(x, 2) for x in load_start]} at the start, "
        f"{[round(x, 2) for x in result['load_average_end']]} at the end; {result['date']}. "
        "A ResNet's variables and momentum, replicated, saved twice by one fresh process "
        "(the first save pays Orbax's slice compiles); the two handlers' runs alternate.",
        "",
        "| ResNet | arrays | MB | handler | repeat | first save (s) | second save (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        first, second = r["seconds"]
        lines.append(
            f"| {r['depth']} | {r['arrays']} | {r['mb']:.1f} | {r['handler']} | {r['repeat']} "
            f"| {first:.2f} | {second:.2f} |"
        )
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
