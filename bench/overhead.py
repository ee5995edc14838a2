"""Estimator.train throughput vs plain jitted train-step loops (same model, data and steps).

Every side trains the same model on the same host batches, read from one instrumented input
that notes the time of every batch read, with one step queued behind the running one. Two
baselines: ``plain_jit_loop`` calls a jitted, donated step with the numpy batches themselves (jit
moves them in its C++ dispatch); ``prefetch_jit_loop`` moves them first with flax's
``prefetch_to_device`` recipe (``jax.device_put`` of the next 2 batches while the current step
runs: the baseline called ``bare_jit_loop`` in results before 2026-11-25). ``estimax_train_iplN``
streams steps one device call each; ``estimax_train_iplN_kK`` runs K steps per device call
(``RunConfig(steps_per_device_call=K)``, a ``lax.scan``). A side's speed is taken over a window of
reads in the middle of one long ``train`` call (steps ``skip`` .. ``skip + window``): its
steady-state loop, including the host syncs at every ``iterations_per_loop`` boundary, but
neither compilation, the restore at the start of ``train`` nor the checkpoint at its end. The
checkpoint is measured separately (the time from the last loop's log line to ``train``
returning: the final save and its wait). Rounds are interleaved and medians compared, since
this machine's timings drift.

    .venv/bin/python bench/overhead.py --model zero --iterations_per_loop 1 100 \
        --steps_per_device_call 10 100 --window 2000 --rounds 7
    .venv/bin/python bench/overhead.py --model mnist --iterations_per_loop 1 100
    .venv/bin/python bench/overhead.py --model resnet50 --iterations_per_loop 100 \
        --rounds 3 --window 3 --skip 3

Writes the model's section of bench/results/overhead.json and .md (``bench/result_sections.py``;
zero: a near-zero-cost model, whose step time is the host's cost per step, reported in
microseconds over each baseline; mnist: MNIST CNN, batch 128; resnet50: ResNet-50, 224x224,
batch 16, float32; resnet50_b4 and the like: a ``--batch_size`` of its own).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import logging as std_logging
import os
import platform
import statistics
import sys
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from result_sections import write_section

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
    """init, one jitted donated step, no host syncs; batches given to the step as numpy
    (``prefetch=None``) or through prefetch_to_device(prefetch)."""

    def __init__(self, name: str, batches, prefetch: int | None):
        factory = MODELS[name][0]
        self.batch = len(batches[0][1])
        self.prefetch = prefetch
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
        feed = source if self.prefetch is None else prefetch_to_device(source, self.prefetch)
        for _, (xb, yb) in zip(range(steps), feed, strict=False):
            self.state, loss = self.step(self.state, xb, yb)
            if previous is not None:
                # One step queued behind the running one, as the Estimator: otherwise the host
                # may run ahead by many steps and the read times would not track the device.
                previous.block_until_ready()
            previous = loss
        jax.block_until_ready(loss)


class Estimated:
    """estimax.Estimator.train on the same model, one long train() call per round."""

    def __init__(self, name: str, batches, iterations_per_loop: int, per_call: int = 1):
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
            steps_per_device_call=per_call,
            save_checkpoints_secs=1e9,
            log_step_count_steps=10**6,
            save_summary_steps=10**6,
            num_shards=1,
            device_prefetch=2,
        )
        self.est = ex.Estimator(model_fn, config, train_batch_size=self.batch)
        self.batches = batches
        self.run(TimedInput(batches), 2 * per_call)  # compile and warm up
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


BASELINES = ("plain_jit_loop", "prefetch_jit_loop")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="mnist")
    parser.add_argument("--batch_size", type=int, default=None, help="default: the model's")
    parser.add_argument("--iterations_per_loop", type=int, nargs="+", default=[1, 100])
    parser.add_argument(
        "--steps_per_device_call",
        type=int,
        nargs="*",
        default=[],
        help="also time these RunConfig.steps_per_device_call at the largest iterations_per_loop",
    )
    parser.add_argument("--rounds", type=int, default=5)
    # After the reads before the restore: the Estimator reads its first batches (2, or a block
    # of steps_per_device_call) before it restores the checkpoint.
    parser.add_argument("--skip", type=int, default=20, help="steps before the timed window")
    parser.add_argument("--window", type=int, default=200, help="steps in the timed window")
    parser.add_argument(
        "--checkpoint_repeats",
        type=int,
        default=3,
        help="train(steps=1) calls whose final checkpoint is timed",
    )
    args = parser.parse_args()
    if args.skip < 2 * max([2, *args.steps_per_device_call]) - 1:
        parser.error(
            "--skip must be at least 2 x the largest --steps_per_device_call (and >= 3): the "
            "Estimator reads a block of batches before it restores."
        )
    return args


def make_runners(args: argparse.Namespace, batches) -> dict:
    """The baselines, then each Estimator configuration, by name."""
    runners: dict = {
        "plain_jit_loop": Bare(args.model, batches, prefetch=None),
        "prefetch_jit_loop": Bare(args.model, batches, prefetch=2),
    }
    for ipl in args.iterations_per_loop:
        runners[f"estimax_train_ipl{ipl}"] = Estimated(args.model, batches, ipl)
    ipl = max(args.iterations_per_loop)
    for k in args.steps_per_device_call:
        runners[f"estimax_train_ipl{ipl}_k{k}"] = Estimated(args.model, batches, ipl, k)
    return runners


def measure(args: argparse.Namespace, runners: dict, batches, batch: int) -> tuple[dict, dict]:
    """Interleaved rounds: images per wall-second and per CPU-second of each runner's window."""
    steps = args.skip + args.window + 1
    rates: dict[str, list[float]] = {k: [] for k in runners}
    cpu_rates: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            source = TimedInput(batches)
            runner.run(source, steps)
            rates[name].append(window_rate(source.times, args.skip, args.window, batch))
            cpu_rates[name].append(window_rate(source.cpu_times, args.skip, args.window, batch))
    return rates, cpu_rates


def per_step(rates: dict[str, list[float]], batch: int) -> dict:
    """Median images/s, the ratio to each baseline, and microseconds per step over each."""
    medians = {k: statistics.median(v) for k, v in rates.items()}
    us = {k: round(batch * 1e6 / v, 1) for k, v in medians.items()}
    return {
        "median": {k: round(v, 2) for k, v in medians.items()},
        "ratio_over": {
            base: {k: round(v / medians[base], 3) for k, v in medians.items() if k not in BASELINES}
            for base in BASELINES
        },
        "us_per_step": us,
        "us_over": {
            base: {k: round(v - us[base], 1) for k, v in us.items() if k not in BASELINES}
            for base in BASELINES
        },
    }


def machine() -> dict:
    """What ran the bench: CPU model, core count, software, backend."""
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
        info = dict(
            (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in first.splitlines())
        )
        if "model name" in info:
            cpu = (
                f"{info['model name']} (family {info.get('cpu family')}, model {info.get('model')})"
            )
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "estimax_onednn": os.environ.get("ESTIMAX_ONEDNN", "default"),
    }


def markdown(args: argparse.Namespace, result: dict, runners: dict) -> str:
    """The run's report: its command, machine and load, and a row per loop."""
    wall, cpu, m = result["wall"], result["cpu"], result["machine"]
    flags = " ".join(sys.argv[1:])
    with io.StringIO() as f:
        f.write(f"# Estimator.train overhead (bench/overhead.py {flags})\n\n")
        f.write(
            f"{result['what']}; {args.rounds} rounds. {m['cpu']}, {m['cpus']} CPUs shared with "
            f"other jobs: load average (1, 5, 15 min) {result['loadavg_start']} at the start, "
            f"{result['loadavg_end']} at the end; jax {m['jax']} on {m['backend']} "
            f"({m['devices']} devices, 1 used); {result['date_utc']} UTC. Baselines: "
            "plain_jit_loop (a jitted step called with the numpy batches), prefetch_jit_loop "
            "(device_put 2 batches ahead; `bare_jit_loop` in earlier results).\n\n"
        )
        f.write(
            "| loop | median img/s | rounds | median img/CPU-s | rounds | us/step | CPU us/step "
            "| over plain: us / CPU us | over prefetch: us / CPU us |\n"
            "|---|---|---|---|---|---|---|---|---|\n"
        )
        for k in runners:
            over = [
                f"{wall['us_over'][b].get(k, 0.0)} / {cpu['us_over'][b].get(k, 0.0)}"
                for b in BASELINES
            ]
            f.write(
                f"| {k} | {wall['median'][k]:.2f} | "
                f"{', '.join(f'{r:.1f}' for r in result['images_per_sec'][k])} | "
                f"{cpu['median'][k]:.2f} | "
                f"{', '.join(f'{r:.1f}' for r in result['images_per_cpu_sec'][k])} | "
                f"{wall['us_per_step'][k]} | {cpu['us_per_step'][k]} | {over[0]} | {over[1]} |\n"
            )
        f.write(
            "\nCheckpoint at the end of a train() call (not in the window), seconds, "
            f"median of {args.checkpoint_repeats}: {result['checkpoint_secs_median']}\n"
        )
        return f.getvalue()


def main() -> None:
    args = parse_args()
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
    runners = make_runners(args, batches)
    rates, cpu_rates = measure(args, runners, batches, batch)
    checkpoint = {
        name: round(
            statistics.median(r.time_checkpoint() for _ in range(args.checkpoint_repeats)), 3
        )
        for name, r in runners.items()
        if isinstance(r, Estimated)
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
        "images_per_cpu_sec": {k: [round(r, 2) for r in v] for k, v in cpu_rates.items()},
        # Per step, median: wall-clock and this process's CPU time (steadier when other jobs
        # load the machine); the zero model's step time is all host time.
        "wall": per_step(rates, batch),
        "cpu": per_step(cpu_rates, batch),
        "checkpoint_secs_median": checkpoint,
        "checkpoint_repeats": args.checkpoint_repeats,
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "machine": machine(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    # One section per model (a non-default batch, or the device loop's steps, its own, so the
    # default's stays comparable).
    name = args.model + (f"_b{args.batch_size}" if args.batch_size else "")
    name += "".join(f"_k{k}" for k in args.steps_per_device_call)
    title = "Estimator.train overhead (bench/overhead.py)"
    write_section("overhead", name, markdown(args, result, runners), result, title)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
