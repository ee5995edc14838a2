"""The training loop streams: input memory is bounded by the prefetch, not by the loop length;
and the loop says when the input holds training back."""

from __future__ import annotations

import time
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import estimax as ex

BATCH_SHAPE = (8, 32_768)  # 1 MiB of float32 per batch


def big_batch_model_fn(features, labels, mode, params):
    if "events" in params:  # record, when step 0 runs on the device, how many batches were read
        jax.debug.callback(
            lambda s: params["events"].append(("step", int(s))), ex.get_global_step()
        )
    logits = nn.Dense(3)(jnp.reshape(features, (features.shape[0], 64, -1)).mean(-1))
    return ex.EstimatorSpec(
        mode=mode, loss=ex.losses.softmax_cross_entropy(logits, labels), optimizer=optax.sgd(0.01)
    )


class CountingInput:
    """Large batches that count themselves: created, alive now, alive at most (host and device)."""

    def __init__(self, events):
        self.events = events
        self.read = 0
        self.alive = 0
        self.max_alive = 0
        self.max_on_device = 0
        self._rng = np.random.default_rng(0)

    def __iter__(self):
        return self

    def _freed(self):
        self.alive -= 1

    def __next__(self):
        # Batches of this shape that the devices hold right now (prefetched or in use).
        on_device = sum(1 for a in jax.live_arrays() if a.shape == BATCH_SHAPE)
        self.max_on_device = max(self.max_on_device, on_device)
        x = self._rng.normal(size=BATCH_SHAPE).astype(np.float32)
        weakref.finalize(x, self._freed)
        self.read += 1
        self.alive += 1
        self.max_alive = max(self.max_alive, self.alive)
        self.events.append(("read", self.read))
        return x, self._rng.integers(0, 3, BATCH_SHAPE[0]).astype(np.int32)


def test_input_memory_is_bounded_by_the_prefetch_not_the_loop(tmp_path):
    events = []
    source = CountingInput(events)
    config = ex.RunConfig(
        model_dir=str(tmp_path), iterations_per_loop=200, num_shards=1, save_checkpoints_secs=1e9
    )
    est = ex.Estimator(
        big_batch_model_fn, config, params={"events": events}, train_batch_size=BATCH_SHAPE[0]
    )
    est.train(lambda params: source, steps=40)  # one loop of 40 steps (the last is shortened)
    assert est.get_global_step() == 40
    assert source.read == 40  # nothing read beyond the steps asked for
    bound = config.device_prefetch + 3  # prefetched + the step's own + one queued + one read
    # The whole loop's 40 batches were never held at once, neither on the host nor the devices.
    assert source.max_alive <= bound, source.max_alive
    assert source.max_on_device <= bound, source.max_on_device
    # Every step ran, in order, once (after the initialisation, which runs model_fn at step 0).
    ran = [i for i, e in enumerate(events) if e[0] == "step"]
    assert [events[i][1] for i in ran] == [0] + list(range(40))
    # The first step ran after at most prefetch + 1 batches had been read: no loop-sized read.
    reads_before = [e for e in events[: ran[1]] if e[0] == "read"]
    assert len(reads_before) <= config.device_prefetch + 1, events[: ran[1] + 1]


def _scalars(logdir, tag):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}


def wide_model_fn(features, labels, mode, params):
    x = features
    for _ in range(3):  # a few ms per step on a CPU: far more than reading a batch
        x = nn.relu(nn.Dense(1024)(x))
    logits = nn.Dense(3)(x)
    return ex.EstimatorSpec(
        mode=mode, loss=ex.losses.softmax_cross_entropy(logits, labels), optimizer=optax.sgd(0.01)
    )


def _train(tmp_path, name, input_fn, caplog):
    config = ex.RunConfig(
        model_dir=str(tmp_path / name),
        iterations_per_loop=4,
        num_shards=1,
        save_checkpoints_secs=1e9,
    )
    est = ex.Estimator(wide_model_fn, config, train_batch_size=64)
    with caplog.at_level("WARNING"):
        est.train(input_fn, steps=12)
    est.close()
    warned = [r.getMessage() for r in caplog.records if "input-bound" in r.getMessage()]
    caplog.clear()
    return _scalars(config.model_dir, "input/wait_fraction"), warned


def test_a_slow_input_is_reported_and_a_fast_one_is_not(tmp_path, caplog, optimised_compiles):
    # Optimised code: "slow" is the input against the step's real speed (unoptimised, the step
    # takes half the input's 0.1 s per batch and the wait fraction falls below the bound).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 4, 256)).astype(np.float32)
    y = rng.integers(0, 3, 64 * 4).astype(np.int32)
    fast = ex.numpy_input_fn(x, y)

    def slow(params):
        for element in fast(params):
            # The slow input under test: like JPEG decoding on too few workers, each batch takes
            # much longer to produce than a step takes to run.
            time.sleep(0.1)
            yield element

    fractions, warned = _train(tmp_path, "slow", slow, caplog)
    assert sorted(fractions) == [4, 8, 12]  # one value per loop, at the loop's last step
    # Each step of the middle loop waited for a batch to be read (the first loop's first step
    # ran right after compiling; the last loop's second half ran on prefetched batches).
    assert fractions[8] > 0.5, fractions
    assert len(warned) == 1, warned  # once, however many loops are input-bound
    assert "--num_parallel_calls" in warned[0]

    fractions, warned = _train(tmp_path, "fast", fast, caplog)
    assert sorted(fractions) == [4, 8, 12]
    assert max(fractions.values()) < 0.1, fractions
    assert warned == []
