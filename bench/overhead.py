"""Estimator.train throughput vs a bare jitted train-step loop (same model, data and prefetch).

Both sides train the same model on the same host batches, read from one instrumented input that
notes the time of every batch read; both move batches to the device with a prefetch of 2 (the
bare side with flax's ``prefetch_to_device`` recipe: ``jax.device_put`` of the next batches while
the current step runs). A side's speed is taken over a window of reads in the middle of one long
``train`` call (steps ``skip`` .. ``skip + window``): its steady-state loop, including the host
syncs at every ``iterations_per_loop`` boundary, but neither compilation, the restore at the start
of ``train`` nor the checkpoint at its end. The checkpoint is measured separately (the time from
the last loop's log line to ``train`` returning: the final save and its wait). Rounds are
interleaved and medians compared, since this machine's timings drift.

    .venv/bin/python bench/overhead.py --model zero --iterations_per_loop 100 --window 2000
    .venv/bin/python bench/overhead.py --model mnist --iterations_per_loop 1 100
    .venv/bin/python bench/overhead.py --model resnet50 --iterations_per_loop 100 \
        --rounds 3 --window 3 --skip 3

Writes bench/results/overhead_<model>.json and .md (zero: a near-zero-cost model, whose step
time is the host's cost per step, reported in microseconds over the bare loop; mnist: MNIST
CNN, batch 128; resnet50: ResNet-50, 224x224, batch 16, float32).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging as std_logging
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
from estimax.models import resnet
from estimax.models.mnist import MnistCNN


class NearZero(nn.Module):
    """One 1x2 dense layer on 8 numbers: a step that costs the device nothing, so what is left
    is the host's cost per step (dispatch, feeding, the loop's bookkeeping)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(2)(x)


MODELS = {
    # name: (module factory, batch, example shape, classes)
    "zero": (lambda: NearZero(), 8, (1,), 2),
    "mnist": (lambda: MnistCNN(), 128, (784,), 10),
    "resnet50": (lambda: resnet.ResNet50(num_classes=1000), 16, (224, 224, 3), 1000),
}


class TimedInput:
    """Cycles through a few fixed host batches; notes the time of every read."""

    def __init__(self, batches: list[tuple[np.ndarray, np.ndarray]]):
        self.batches = batches
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # this process's CPU seconds (all threads)

    def __iter__(self):
        return self

    def __next__(self):
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.process_time())
        x, y = self.batches[len(self.times) % len(self.batches)]
        return x.copy(), y.copy()  # a fresh host batch per step, as a real input gives


def window_rate(times: list[float], skip: int, window: int, batch: int) -> float:
    """Images/s between read ``skip`` and read ``skip + window``."""
    if len(times) <= skip + window:
        raise ValueError(f"only {len(times)} reads; need more than skip + window = {skip + window}")
    return window * batch / (times[skip + window] - times[skip])


def prefetch_to_device(iterator, size: int):
    """flax.jax_utils.prefetch_to_device for one device: ``size`` batches ahead on the device."""
    queue = collections.deque()

    def enqueue(n):
        for element in iterator:
            queue.append(jax.device_put(element))
            n -= 1
            if not n:
                return

    enqueue(size)
    while queue:
        yield queue.popleft()
        enqueue(1)


class Bare:
    """init, one jitted donated step, batches through prefetch_to_device(2), no host syncs."""

    def __init__(self, name: str, batches):
        factory = MODELS[name][0]
        self.batch = len(batches[0][1])
        model = factory()
        tx = optax.sgd(0.05, momentum=0.9)
        x0 = jnp.asarray(batches[0][0])
        variables = jax.jit(lambda k: model.init({"params": k, "dropout": k}, x0, train=False))(
            jax.random.PRNGKey(0)
        )
        params = variables.pop("params")
        self.state = (params, dict(variables), tx.init(params), jnp.zeros((), jnp.int32))
        base_rng = jax.random.PRNGKey(1)

        def step(state, xb, yb):
            params, extra, opt_state, count = state
            # The step's dropout stream derived on the device, as the Estimator does: a
            # host-side fold_in per step would add an eager dispatch to the bare side.
            rng = jax.random.fold_in(base_rng, count)

            def loss_fn(p):
                logits, new_extra = model.apply(
                    {"params": p, **extra},
                    xb,
                    train=True,
                    rngs={"dropout": rng},
                    mutable=list(extra),
                )
                return ex.losses.softmax_cross_entropy(logits, yb).mean(), new_extra

            (loss, new_extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), new_extra, opt_state, count + 1), loss

        self.step = jax.jit(step, donate_argnums=(0,))
        self.batches = batches
        self.run(TimedInput(batches), 2)  # compile and warm up

    def run(self, source: TimedInput, steps: int) -> None:
        loss = previous = None
        for _, (xb, yb) in zip(range(steps), prefetch_to_device(source, 2), strict=False):
            self.state, loss = self.step(self.state, xb, yb)
            if previous is not None:
                # One step queued behind the running one, as the Estimator: otherwise the host
                # may run ahead by many steps and the read times would not track the device.
                previous.block_until_ready()
            previous = loss
        jax.block_until_ready(loss)


class Estimated:
    """estimax.Estimator.train on the same model, one long train() call per round."""

    def __init__(self, name: str, batches, iterations_per_loop: int):
        factory = MODELS[name][0]
        self.batch = len(batches[0][1])

        def model_fn(features, labels, mode, params):
            logits = factory()(features, train=mode == ex.ModeKeys.TRAIN)
            return ex.EstimatorSpec(
                mode=mode,
                loss=ex.losses.softmax_cross_entropy(logits, labels),
                optimizer=optax.sgd(0.05, momentum=0.9),
            )

        # Checkpoint only at the end of each train() call (outside the timed window).
        config = ex.RunConfig(
            model_dir=tempfile.mkdtemp(prefix="overhead_"),
            iterations_per_loop=iterations_per_loop,
            save_checkpoints_secs=1e9,
            log_step_count_steps=10**6,
            save_summary_steps=10**6,
            num_shards=1,
            device_prefetch=2,
        )
        self.est = ex.Estimator(model_fn, config, train_batch_size=self.batch)
        self.batches = batches
        self.run(TimedInput(batches), 2)  # compile and warm up
        self.checkpoint_secs: list[float] = []

    def run(self, source: TimedInput, steps: int) -> None:
        self.est.train(lambda params: source, steps=steps)

    def time_checkpoint(self) -> float:
        """Seconds from the last loop's log line to train() returning (the final save)."""
        seen: list[float] = []

        class Catch(std_logging.Handler):
            def emit(self, record):
                if record.getMessage().startswith("loss = "):
                    seen.append(record.created)

        handler = Catch()
        logger = std_logging.getLogger("absl")
        logger.addHandler(handler)
        level = logger.level
        logger.setLevel(std_logging.INFO)
        try:
            self.est.train(lambda params: TimedInput(self.batches), steps=1)
            end = time.time()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        secs = end - seen[-1]
        self.checkpoint_secs.append(secs)
        return secs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="mnist")
    parser.add_argument("--batch_size", type=int, default=None, help="default: the model's")
    parser.add_argument("--iterations_per_loop", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--rounds", type=int, default=5)
    # At least device_prefetch + 1: the Estimator reads its first 2 batches before it restores
    # the checkpoint, so an earlier window would time the restore.
    parser.add_argument("--skip", type=int, default=20, help="steps before the timed window")
    parser.add_argument("--window", type=int, default=200, help="steps in the timed window")
    parser.add_argument(
        "--checkpoint_repeats",
        type=int,
        default=3,
        help="train(steps=1) calls whose final checkpoint is timed",
    )
    args = parser.parse_args()
    if args.skip < 3:
        parser.error("--skip must be >= 3: the Estimator restores after reading 2 batches.")
    _, batch, shape, classes = MODELS[args.model]
    batch = args.batch_size or batch
    rng = np.random.default_rng(0)
    batches = [
        (
            rng.normal(size=(batch, *shape)).astype(np.float32),
            rng.integers(0, classes, batch).astype(np.int32),
        )
        for _ in range(4)
    ]
    load_start = os.getloadavg()
    runners = {"bare_jit_loop": Bare(args.model, batches)}
    for ipl in args.iterations_per_loop:
        runners[f"estimax_train_ipl{ipl}"] = Estimated(args.model, batches, ipl)
    steps = args.skip + args.window + 1
    rates: dict[str, list[float]] = {k: [] for k in runners}
    cpu_rates: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            source = TimedInput(batches)
            runner.run(source, steps)
            rates[name].append(window_rate(source.times, args.skip, args.window, batch))
            cpu_rates[name].append(window_rate(source.cpu_times, args.skip, args.window, batch))
    checkpoint = {
        name: round(
            statistics.median(r.time_checkpoint() for _ in range(args.checkpoint_repeats)), 3
        )
        for name, r in runners.items()
        if isinstance(r, Estimated)
    }
    load_end = os.getloadavg()
    medians = {k: statistics.median(v) for k, v in rates.items()}
    ratios = {
        k: round(v / medians["bare_jit_loop"], 3)
        for k, v in medians.items()
        if k != "bare_jit_loop"
    }
    # Images per CPU-second of the whole process: what the loop costs, whatever else shares the
    # machine (wall-clock rates drift with other jobs' load).
    cpu_medians = {k: statistics.median(v) for k, v in cpu_rates.items()}
    cpu_ratios = {
        k: round(v / cpu_medians["bare_jit_loop"], 3)
        for k, v in cpu_medians.items()
        if k != "bare_jit_loop"
    }
    # Time per step (the zero model: all of it is host time) and the loop's excess over bare,
    # in wall-clock and in this process's CPU time (steadier when other jobs load the machine).
    us_per_step = {k: round(batch * 1e6 / v, 1) for k, v in medians.items()}
    overhead_us = {
        k: round(v - us_per_step["bare_jit_loop"], 1)
        for k, v in us_per_step.items()
        if k != "bare_jit_loop"
    }
    cpu_us_per_step = {k: round(batch * 1e6 / v, 1) for k, v in cpu_medians.items()}
    cpu_overhead_us = {
        k: round(v - cpu_us_per_step["bare_jit_loop"], 1)
        for k, v in cpu_us_per_step.items()
        if k != "bare_jit_loop"
    }
    what = {
        "zero": "near-zero-cost model (one 1x2 dense layer)",
        "mnist": "MNIST CNN (seed 002), float32",
        "resnet50": "ResNet-50, 224x224, float32",
    }[args.model] + f", batch {batch}"
    result = {
        "what": f"{what}: train images/s over steps {args.skip}..{args.skip + args.window} of "
        "one train() call (no compile, restore or checkpoint in the window); median of "
        "interleaved rounds",
        "model": args.model,
        "rounds": args.rounds,
        "skip": args.skip,
        "window": args.window,
        "images_per_sec": {k: [round(r, 2) for r in v] for k, v in rates.items()},
        "median_images_per_sec": {k: round(v, 2) for k, v in medians.items()},
        "ratio_estimax_over_bare": ratios,
        "images_per_cpu_sec": {k: [round(r, 2) for r in v] for k, v in cpu_rates.items()},
        "median_images_per_cpu_sec": {k: round(v, 2) for k, v in cpu_medians.items()},
        "cpu_ratio_estimax_over_bare": cpu_ratios,
        "median_us_per_step": us_per_step,
        "overhead_us_per_step_over_bare": overhead_us,
        "median_cpu_us_per_step": cpu_us_per_step,
        "cpu_overhead_us_per_step_over_bare": cpu_overhead_us,
        "checkpoint_secs_median": checkpoint,
        "checkpoint_repeats": args.checkpoint_repeats,
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in load_end],
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "devices": len(jax.devices()),
            "estimax_onednn": os.environ.get("ESTIMAX_ONEDNN", "default"),
        },
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    out = os.path.join(os.path.dirname(__file__), "results")
    # A non-default batch gets its own files (the default's results stay comparable).
    name = args.model + (f"_b{args.batch_size}" if args.batch_size else "")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"overhead_{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out, f"overhead_{name}.md"), "w") as f:
        flags = f"--model {args.model}" + (
            f" --batch_size {args.batch_size}" if args.batch_size else ""
        )
        f.write(f"# Estimator.train overhead (bench/overhead.py {flags})\n\n")
        f.write(
            f"{result['what']}; {args.rounds} rounds. Load average (1, 5, 15 min) "
            f"{result['loadavg_start']} at the start, {result['loadavg_end']} at the end "
            f"({os.cpu_count()} CPUs, shared with other jobs); {result['date_utc']} UTC.\n\n"
        )
        f.write(
            "| loop | median img/s | ratio to bare | rounds | median img/CPU-s | "
            "ratio to bare | rounds |\n|---|---|---|---|---|---|---|\n"
        )
        for k in runners:
            f.write(
                f"| {k} | {medians[k]:.2f} | {ratios.get(k, 1.0):.3f} | "
                f"{', '.join(f'{r:.1f}' for r in rates[k])} | {cpu_medians[k]:.2f} | "
                f"{cpu_ratios.get(k, 1.0):.3f} | "
                f"{', '.join(f'{r:.1f}' for r in cpu_rates[k])} |\n"
            )
        f.write(
            f"\nMicroseconds per step (median): {us_per_step}; over the bare loop: {overhead_us}. "
            f"CPU microseconds per step: {cpu_us_per_step}; over the bare loop: "
            f"{cpu_overhead_us}\n"
        )
        f.write(
            "\nCheckpoint at the end of a train() call (not in the window), seconds, "
            f"median of {args.checkpoint_repeats}: {checkpoint}\n"
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
