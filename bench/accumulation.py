"""Gradient accumulation's cost: a train step of global batch B as k micro-batches vs as one.

``RunConfig(gradient_accumulation_steps=k)`` runs a step's batch as k micro-batches of B / k
inside the jitted step, then one optimizer update. This times the jitted train step the
Estimator runs (``StepBuilder.build(...).train``: shard_map, donation, the same ``model_fn``) at
the same global batch for k = 1 (no accumulation) and each k asked for, in interleaved rounds
(median of the rounds; each round times ``--steps`` steps, after an untimed round), on one CPU
device. On CPU the step builder unrolls the micro-batch loop (XLA:CPU's own convolutions run
many times slower inside a loop) and chains the copies so they run one after the other
(``steps._after``), so this times that form. The issue's bar: accumulation adds no more than 5%
to the step time of the same batch.

To tell what the smaller micro-batch itself costs from what the accumulation code adds, each k
also times the model alone, with no accumulation code: its forward and backward pass
(``steps._gradients``, no optimizer) at batch B / k called k times, against one call at B
("model alone" columns). Each row also gives the step's temporaries (XLA's memory analysis of
the compiled step: deterministic) and its process CPU time (less disturbed by a loaded machine
than the wall time).

Models: ``mnist`` (the guide's CNN, ``estimax.programs.mnist``: two 5x5 convolutions, two
dense layers, dropout), ``mlp`` (784 -> 1024 -> 1024 -> 10, tanh), both float32 with the
programs' SGD.

Usage::

    .venv/bin/python bench/accumulation.py [--models mnist,mlp] [--batch 256] [--k 2 4 8]
        [--rounds 5] [--steps 10]

Writes ``bench/results/accumulation.{json,md}`` with the machine and its load.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

import estimax as ex
from estimax.estimator import step_builder
from estimax.estimator import steps as steps_lib
from estimax.parallel import replication
from estimax.programs import mnist

HERE = os.path.dirname(os.path.abspath(__file__))


def mlp_model_fn(features, labels, mode, params):
    x = features.astype("float32") / 255.0
    for _ in range(2):
        x = nn.tanh(nn.Dense(1024)(x))
    logits = nn.Dense(10)(x)
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.sgd(0.05, momentum=0.9),
        predictions=logits,
    )


MODELS = {"mnist": mnist.make_model_fn(mnist.MnistConfig()), "mlp": mlp_model_fn}


class Timed:
    """Something run a round at a time: wall and process CPU seconds per call."""

    name: str
    compile_s: float

    def run(self, n: int) -> None:
        raise NotImplementedError

    def time(self, n: int) -> tuple[float, float]:
        """(wall, process CPU) seconds per call over ``n`` calls."""
        wall, cpu = time.perf_counter(), time.process_time()
        self.run(n)
        return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


def _batch(batch: int, mesh: Any) -> tuple[jax.Array, jax.Array]:
    rs = np.random.RandomState(0)
    features = (rs.rand(batch, 784) - 0.5).astype(np.float32)
    labels = rs.randint(0, 10, batch).astype(np.int32)
    sharding = replication.replicated(mesh)
    return jax.device_put(features, sharding), jax.device_put(labels, sharding)


class Side(Timed):
    """One (model, k): its compiled step, state and batch."""

    def __init__(self, model: str, batch: int, k: int):
        self.name = f"{model} k={k}"
        self.k = k
        config = ex.RunConfig(model_dir="/tmp/unused", gradient_accumulation_steps=k)
        mesh = replication.make_mesh(1)
        builder = step_builder.StepBuilder(MODELS[model], {}, config)
        self.steps = builder.build(mesh, {ex.ModeKeys.TRAIN: batch})
        self.features, self.labels = _batch(batch, mesh)
        self.state = self.steps.init(self.steps.rng, self.features[:1], self.labels[:1])
        self.rng = self.steps.rng
        start = time.perf_counter()
        compiled = self.steps.train.lower(
            self.state, self.rng, self.features, self.labels
        ).compile()
        self.compile_s = time.perf_counter() - start
        self.temp_mb = compiled.memory_analysis().temp_size_in_bytes / 1e6
        self.run(1)

    def run(self, n: int) -> None:
        for _ in range(n):
            self.state, out = self.steps.train(self.state, self.rng, self.features, self.labels)
        jax.block_until_ready((self.state, out))


class ModelAlone(Timed):
    """The model's forward and backward pass (no optimizer, no accumulation code) at batch
    ``batch / calls``, called ``calls`` times on the batch's consecutive slices."""

    def __init__(self, model: str, batch: int, calls: int):
        self.name = f"{model} alone {batch // calls} x{calls}"
        mesh = replication.make_mesh(1)
        size = batch // calls
        builder = step_builder.StepBuilder(MODELS[model], {}, ex.RunConfig(model_dir="/tmp/u"))
        module = steps_lib.ModelFnModule(
            call=functools.partial(builder._call_model_fn, batch_size=size), mode=ex.ModeKeys.TRAIN
        )
        features, labels = _batch(batch, mesh)
        rng = jax.random.PRNGKey(0)
        state = step_builder._init_state(module, rng, features[:1], labels[:1])
        self.slices = [
            (features[i * size : (i + 1) * size], labels[i * size : (i + 1) * size])
            for i in range(calls)
        ]
        self._gradients = jax.jit(
            lambda x, y: steps_lib._gradients(module, state, (x, y), rng, None)[4]
        )
        start = time.perf_counter()
        self.run(1)
        self.compile_s = time.perf_counter() - start

    def run(self, n: int) -> None:
        for _ in range(n):
            out = [self._gradients(x, y) for x, y in self.slices]
        jax.block_until_ready(out)


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "devices": str(jax.devices()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mnist,mlp")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "accumulation"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    results: dict[str, Any] = {"machine": machine(), "args": vars(args), "models": {}}
    for model in args.models.split(","):
        sides = [Side(model, args.batch, k) for k in (1, *args.k)]
        alone = [ModelAlone(model, args.batch, k) for k in (1, *args.k)]
        timed: list[Timed] = [*sides, *alone]
        wall: dict[str, list[float]] = {t.name: [] for t in timed}
        cpu: dict[str, list[float]] = {t.name: [] for t in timed}
        for t in timed:  # an untimed round: the first calls after compiling are slow
            t.time(args.steps)
        for r in range(args.rounds):
            for t in timed if r % 2 == 0 else reversed(timed):  # interleaved, both orders
                w, c = t.time(args.steps)
                wall[t.name].append(w)
                cpu[t.name].append(c)
        med = {name: statistics.median(v) for name, v in wall.items()}
        med_cpu = {name: statistics.median(v) for name, v in cpu.items()}
        rows = {}
        for side, one in zip(sides, alone, strict=True):
            rows[side.name] = {
                "k": side.k,
                "micro_batch": args.batch // side.k,
                "median_step_s": med[side.name],
                "rounds_s": wall[side.name],
                "vs_k1": med[side.name] / med[sides[0].name],
                "median_step_cpu_s": med_cpu[side.name],
                "rounds_cpu_s": cpu[side.name],
                "cpu_vs_k1": med_cpu[side.name] / med_cpu[sides[0].name],
                "alone_median_s": med[one.name],
                "alone_median_cpu_s": med_cpu[one.name],
                "alone_rounds_cpu_s": cpu[one.name],
                "alone_rounds_s": wall[one.name],
                "alone_vs_whole": med[one.name] / med[alone[0].name],
                "alone_cpu_vs_whole": med_cpu[one.name] / med_cpu[alone[0].name],
                "temp_mb": side.temp_mb,
                "compile_s": side.compile_s,
            }
        results["models"][model] = rows
        for name, row in rows.items():
            print(
                f"{name}: {row['median_step_s'] * 1e3:.1f} ms/step, {row['vs_k1']:.3f}x k=1 "
                f"(CPU {row['cpu_vs_k1']:.3f}x); model alone at {row['micro_batch']} x{row['k']}: "
                f"{row['alone_vs_whole']:.3f}x (CPU {row['alone_cpu_vs_whole']:.3f}x); "
                f"{row['temp_mb']:.1f} MB of temporaries"
            )
    results["load_before"], results["load_after"] = load_before, os.getloadavg()
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(write_md(results))


def write_md(results: dict[str, Any]) -> str:
    a, m = results["args"], results["machine"]
    lines = [
        f"# Gradient accumulation (bench/accumulation.py --models {a['models']} --batch "
        f"{a['batch']} --k {' '.join(map(str, a['k']))} --rounds {a['rounds']} --steps "
        f"{a['steps']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, jax {m['jax']}, one CPU device; "
        f"load average {results['load_before'][0]:.1f} before, "
        f"{results['load_after'][0]:.1f} after. Global batch {a['batch']} in every row; "
        'median over interleaved rounds (wall; CPU: the process\'s CPU time). "model alone": '
        "the model's forward and backward pass with no accumulation code, at the micro-batch "
        "called k times, against one call at the global batch. Temporaries: XLA's memory "
        "analysis of the compiled step.",
        "",
        "| model | k | micro-batch | ms/step | vs k=1 | CPU vs k=1 | model alone vs one call "
        "| its CPU | temporaries MB | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, rows in results["models"].items():
        for row in rows.values():
            lines.append(
                f"| {model} | {row['k']} | {row['micro_batch']} | "
                f"{row['median_step_s'] * 1e3:.1f} | {row['vs_k1']:.3f}x | "
                f"{row['cpu_vs_k1']:.3f}x | {row['alone_vs_whole']:.3f}x | "
                f"{row['alone_cpu_vs_whole']:.3f}x | {row['temp_mb']:.1f} | "
                f"{row['compile_s']:.1f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
