"""``RunConfig(steps_per_device_call=k)``: k steps per device call (a ``lax.scan`` over k stacked
batches) train as one call per step does, keep per-step metrics at their true steps, never
cross a host sync, and hold O(k) batches, not a loop's."""

from __future__ import annotations

import os
import signal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_loop_memory import BATCH_SHAPE, CountingInput, big_batch_model_fn

import estimax as ex
from estimax.estimator.loop import Preempted


def _model_fn(features, labels, mode, params):
    train = mode == ex.ModeKeys.TRAIN
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(features)
    x = nn.Dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
    logits = nn.Dense(3)(x)
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.adam(0.01),
        ema_decay=0.9,
        scalars={"step_seen": ex.get_global_step().astype(jnp.float32)},
        summaries={"logits": ex.summary.histogram(logits)},
    )


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 5)).astype(np.float32), rng.integers(0, 3, 64).astype(np.int32)


def _estimator(model_dir, per_call: int, **config) -> ex.Estimator:
    config = {
        "iterations_per_loop": 6,
        "save_summary_steps": 2,
        "save_checkpoints_steps": 6,
        "num_shards": 2,
        **config,
    }
    run = ex.RunConfig(model_dir=str(model_dir), steps_per_device_call=per_call, **config)
    return ex.Estimator(_model_fn, run, train_batch_size=8)


def _events(logdir: str):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    return scalars, [(e.step, e.histogram_value.sum) for e in acc.Histograms("logits")]


def _close(a, b):
    # To float tolerance, not bitwise: XLA may fuse a step's operations differently inside a
    # device loop than alone (here they have come out bitwise equal).
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7), a, b)


class Steps(ex.SessionRunHook):
    def __init__(self):
        self.seen: list[tuple[list[int], list[float]]] = []

    def after_run(self, run_context, run_values):
        values = run_values.results["step_seen"]
        self.seen.append((list(run_values.steps), [float(v) for v in values]))


def test_a_device_loop_trains_as_one_call_per_step_with_metrics_at_their_steps(tmp_path):
    x, y = _data()
    runs = {}
    for per_call in (1, 3):  # loops of 6: two calls of 3 steps; the last loop, one of 1
        est = _estimator(tmp_path / f"k{per_call}", per_call)
        hook = Steps()
        est.train(ex.numpy_input_fn(x, y), hooks=[hook], max_steps=13)
        runs[per_call] = (est.get_variables(), _events(est.model_dir), hook.seen)
        assert est.get_global_step() == 13
        est.close()
    (streamed, (scalars, histograms), seen), (looped, (scalars_k, histograms_k), seen_k) = (
        runs[1],
        runs[3],
    )
    _close(looped, streamed)
    # Each step's metrics at its own step number: get_global_step() is the step being taken.
    assert scalars_k["step_seen"] == [(s, s - 1.0) for s in (1, 2, 4, 6, 8, 10, 12)]
    assert [s for s, _ in scalars_k["loss"]] == [s for s, _ in scalars["loss"]]
    np.testing.assert_allclose(
        [v for _, v in scalars_k["loss"]], [v for _, v in scalars["loss"]], rtol=1e-6
    )
    # Each summary step's own histogram (of that step's logits), as without the device loop.
    assert [s for s, _ in histograms_k] == [s for s, _ in histograms] == [1, 2, 4, 6, 8, 10, 12]
    np.testing.assert_allclose([v for _, v in histograms_k], [v for _, v in histograms], rtol=1e-5)
    loops = [
        (list(range(1, 7)), [float(s) for s in range(6)]),
        (list(range(7, 13)), [float(s) for s in range(6, 12)]),
        ([13], [12.0]),
    ]
    assert seen_k == seen == loops


def test_a_hook_boundary_inside_a_block_clips_the_block(tmp_path):
    x, y = _data()
    one_device = {"num_shards": 1, "iterations_per_loop": 8}
    est = _estimator(tmp_path / "k4", 4, save_checkpoints_steps=100, **one_device)
    hook = Steps()
    # The loop would run calls of 4 and 4 steps; the hook ends it at step 5 (inside the second).
    est.train(ex.numpy_input_fn(x, y), hooks=[hook, ex.StopAtStepHook(last_step=5)], steps=8)
    assert est.get_global_step() == 5  # stopped exactly there, with a checkpoint
    assert hook.seen == [(list(range(1, 6)), [float(s) for s in range(5)])]
    reference = _estimator(tmp_path / "k1", 1, **one_device)
    reference.train(ex.numpy_input_fn(x, y), max_steps=5)
    _close(est.get_variables(), reference.get_variables())
    # Resumed (input position restored): the rest as an uninterrupted run.
    est.train(ex.numpy_input_fn(x, y), max_steps=13)
    reference.train(ex.numpy_input_fn(x, y), max_steps=13)
    _close(est.get_variables(), reference.get_variables())
    est.close()
    reference.close()


class CountingBlocks(CountingInput):
    """Also counts the blocks (stacked batches) the devices hold at each read."""

    def __init__(self, events, per_call):
        super().__init__(events)
        self.shape = (per_call, *BATCH_SHAPE)
        self.max_blocks_on_device = 0

    def __next__(self):
        on_device = sum(1 for a in jax.live_arrays() if a.shape == self.shape)
        self.max_blocks_on_device = max(self.max_blocks_on_device, on_device)
        return super().__next__()


def test_a_device_loop_holds_blocks_not_a_loop_of_batches(tmp_path):
    events: list = []
    per_call = 4
    source = CountingBlocks(events, per_call)
    config = ex.RunConfig(
        model_dir=str(tmp_path),
        iterations_per_loop=200,
        steps_per_device_call=per_call,
        num_shards=1,
        save_checkpoints_secs=1e9,
    )
    est = ex.Estimator(
        big_batch_model_fn, config, params={"events": events}, train_batch_size=BATCH_SHAPE[0]
    )
    est.train(lambda params: source, steps=40)  # one loop of 40 steps: 10 calls of 4
    assert est.get_global_step() == 40
    assert source.read == 40
    # On the host: a block read ahead and the one being stacked, never the loop's 40 batches;
    # on the devices: the running call's block and the one queued behind it.
    assert source.max_alive <= 2 * per_call + 1, source.max_alive
    assert source.max_blocks_on_device <= 2, source.max_blocks_on_device
    assert source.max_on_device == 0  # no batch went to the devices on its own
    ran = [i for i, e in enumerate(events) if e[0] == "step"]
    assert [events[i][1] for i in ran] == [0] + list(range(40))  # each step once, in order
    # The first call ran after at most two blocks had been read: no loop-sized read.
    assert len([e for e in events[: ran[1]] if e[0] == "read"]) <= 2 * per_call


def test_a_preemption_notice_stops_after_a_call_and_saves_its_last_step(tmp_path):
    x, y = _data()
    batches = iter(ex.numpy_input_fn(x, y)({"batch_size": 8}))

    def input_fn(params):
        for i, batch in enumerate(batches, start=1):
            if i == 7:  # read while the call of steps 1..4 runs
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    est = _estimator(tmp_path, 4, iterations_per_loop=16, save_checkpoints_steps=100)
    with pytest.raises(Preempted) as stop:
        est.train(input_fn, max_steps=16)
    # As one step per call stops after the step dispatched next, this stops after the next
    # call (steps 5..8), inside the loop of 16, and saves there.
    assert stop.value.step == est.get_global_step() == 8
    est.train(ex.numpy_input_fn(x, y), max_steps=16)  # and it resumes from there
    assert est.get_global_step() == 16
    est.close()


@pytest.mark.parametrize("per_call", [0, 7])
def test_steps_per_device_call_out_of_range_is_one_error(per_call):
    with pytest.raises(ValueError, match=r"steps_per_device_call must be from 1 to .* got"):
        ex.RunConfig(iterations_per_loop=6, steps_per_device_call=per_call)
