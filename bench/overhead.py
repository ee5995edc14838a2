"""Estimator.train throughput vs a bare jitted train-step loop (same model, same data).

Both loops train the MNIST CNN of the guide (batch 128, SGD) on the same in-memory arrays fed
from the host each step; compilation is excluded (each side is warmed up first). Rounds are
interleaved and the medians compared, since this machine's timings drift by 20-30%.

    .venv/bin/python bench/overhead.py [--rounds 5 --steps 100]

Writes bench/results/overhead.json and bench/results/overhead.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import estimax as ex
from estimax.models.mnist import MnistCNN

BATCH = 128


def model_fn(features, labels, mode, params):
    logits = MnistCNN()(features, train=mode == ex.ModeKeys.TRAIN)
    return ex.EstimatorSpec(mode=mode, loss=ex.losses.softmax_cross_entropy(logits, labels),
                            optimizer=optax.sgd(0.05))


def bare_loop(x: np.ndarray, y: np.ndarray):
    """The hand-written baseline: init, one jitted donated step, host batches."""
    model = MnistCNN()
    tx = optax.sgd(0.05)
    variables = model.init({"params": jax.random.PRNGKey(0)}, jnp.asarray(x[:BATCH]),
                           train=False)
    params = variables["params"]
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb, rng):
        def loss_fn(p):
            logits = model.apply({"params": p}, xb, train=True, rngs={"dropout": rng})
            return ex.losses.softmax_cross_entropy(logits, yb).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    state = {"params": params, "opt": opt_state, "i": 0}

    def run(n: int) -> None:
        loss = None
        for _ in range(n):
            i = state["i"] % (len(x) // BATCH)
            xb, yb = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
            state["params"], state["opt"], loss = step(
                state["params"], state["opt"], xb, yb, jax.random.PRNGKey(state["i"]))
            state["i"] += 1
        jax.block_until_ready(loss)
    return run


def estimator_loop(x: np.ndarray, y: np.ndarray, iterations_per_loop: int):
    model_dir = tempfile.mkdtemp(prefix="overhead_")
    # Checkpoint only at the end of each train() call, as a long run would between saves.
    config = ex.RunConfig(model_dir=model_dir, iterations_per_loop=iterations_per_loop,
                          save_checkpoints_secs=1e9, log_step_count_steps=10_000,
                          save_summary_steps=10_000, num_shards=1)
    est = ex.Estimator(model_fn, config, train_batch_size=BATCH)
    input_fn = ex.numpy_input_fn(x, y, shuffle=False)

    def run(n: int) -> None:
        est.train(input_fn, steps=n)
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--iterations_per_loop", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * 20, 784)).astype(np.float32)
    y = rng.integers(0, 10, BATCH * 20).astype(np.int32)
    runners = {"bare_jit_loop": bare_loop(x, y),
               "estimax_train": estimator_loop(x, y, args.iterations_per_loop)}
    for run in runners.values():  # compile and warm up
        run(args.iterations_per_loop)
    rates: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run(args.steps)
            rates[name].append(args.steps * BATCH / (time.perf_counter() - start))
    medians = {k: statistics.median(v) for k, v in rates.items()}
    ratio = medians["estimax_train"] / medians["bare_jit_loop"]
    result = {
        "what": "MNIST CNN (seed 002) train, batch 128, images/s, median of interleaved rounds",
        "rounds": args.rounds, "steps_per_round": args.steps,
        "iterations_per_loop": args.iterations_per_loop,
        "images_per_sec": {k: [round(r, 1) for r in v] for k, v in rates.items()},
        "median_images_per_sec": {k: round(v, 1) for k, v in medians.items()},
        "ratio_estimax_over_bare": round(ratio, 3),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "backend": jax.default_backend(),
                    "devices": len(jax.devices())},
    }
    out = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "overhead.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out, "overhead.md"), "w") as f:
        f.write("# Estimator.train overhead (bench/overhead.py)\n\n")
        f.write(f"{result['what']}; {args.rounds} rounds of {args.steps} steps, "
                f"iterations_per_loop={args.iterations_per_loop}.\n\n")
        f.write("| loop | median img/s | rounds |\n|---|---|---|\n")
        for k in runners:
            f.write(f"| {k} | {medians[k]:.1f} | {', '.join(f'{r:.0f}' for r in rates[k])} |\n")
        f.write(f"\nRatio estimax / bare: **{ratio:.3f}**\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
