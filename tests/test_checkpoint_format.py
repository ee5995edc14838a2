"""Checkpoints stay readable across versions: a model_dir written by an earlier estimax restores,
resumes and evaluates as if this version had written it.

``tests/data/estimax_checkpoints/a52f259`` is the model_dir that ``_train(model_dir, 3)`` below
wrote with estimax at commit a52f259 (one CPU device): a checkpoint at step 3 holding every item
(model with batch statistics, momentum optimizer state, EMA, input position).
"""

from __future__ import annotations

import os
import shutil

import flax.linen as nn
import jax
import numpy as np
import optax

import estimax as ex
from estimax.state import checkpoints

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "estimax_checkpoints", "a52f259")


def _model_fn(features, labels, mode, params):
    x = nn.BatchNorm(use_running_average=mode != ex.ModeKeys.TRAIN, momentum=0.9)(features)
    logits = nn.Dense(3)(x)
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),
        optimizer=optax.sgd(0.1, momentum=0.9),
        ema_decay=0.9,
        eval_metrics={"accuracy": ex.metrics.accuracy(labels, logits)},
    )


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 3, 40).astype(np.int32)


def _estimator(model_dir: str) -> ex.Estimator:
    config = ex.RunConfig(
        model_dir=model_dir, iterations_per_loop=3, save_checkpoints_steps=3, num_shards=1
    )
    return ex.Estimator(_model_fn, config, train_batch_size=8, eval_batch_size=8)


def _train(model_dir: str, max_steps: int) -> ex.Estimator:
    x, y = _data()
    est = _estimator(model_dir)
    est.train(ex.numpy_input_fn(x, y, seed=1), max_steps=max_steps)
    return est


def _close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)


def test_a_model_dir_written_by_an_earlier_version_restores_and_resumes(tmp_path):
    old = str(tmp_path / "old")
    shutil.copytree(FIXTURE, old)
    est = _estimator(old)
    assert est.get_global_step() == 3
    assert est.latest_checkpoint() == checkpoints.step_path(old, 3)
    assert est.latest_checkpoint() == os.path.join(old, "checkpoints", "3")
    # Resumed from it (optimizer state, batch statistics, EMA and input position restored), the
    # run continues as one that never stopped.
    est = _train(old, 6)
    fresh = _train(str(tmp_path / "fresh"), 6)
    _close(est.get_variables(), fresh.get_variables())
    x, y = _data()
    eval_input = ex.numpy_input_fn(x, y, num_epochs=1, shuffle=False)
    resumed, uninterrupted = est.evaluate(eval_input), fresh.evaluate(eval_input)  # the EMA's
    assert resumed["global_step"] == uninterrupted["global_step"] == 6
    np.testing.assert_allclose(resumed["loss"], uninterrupted["loss"], rtol=1e-5)
    # The earlier version's step 3 is still there and reads as it was written.
    meta = checkpoints.Checkpointer(old, None, read_only=True).restore_meta(3)
    assert meta["has_ema"] and meta["has_optimizer"] and meta["step"] == 3
    est.close()
    fresh.close()


def test_a_train_state_maps_to_the_checkpoint_items_and_back():
    state = ex.TrainState(
        step=np.int32(4),
        params={"w": np.ones(2)},
        model_state={"batch_stats": {"m": np.zeros(2)}},
        opt_state=(np.full(2, 3.0),),
        ema_params={"w": np.full(2, 0.5)},
    )
    items = checkpoints.state_items(state)
    assert sorted(items) == ["ema", "model", "optimizer"]
    assert sorted(items["model"]) == ["model_state", "params", "step"]
    back = checkpoints.state_from_items(items, state)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    _close(back, state)
    # Items a restore did not read: the optimizer state is the abstract one's, the EMA is None.
    partial = checkpoints.state_from_items({"model": items["model"]}, state)
    assert partial.opt_state is state.opt_state and partial.ema_params is None
    assert checkpoints.variables_of(items["model"]) == {
        "params": state.params,
        "batch_stats": state.model_state["batch_stats"],
    }


def test_replicated_small_arrays_save_without_a_slice_program_each(tmp_path, no_compilation_cache):
    """Orbax splits a replicated array's save across replicas with one compiled slice program
    per shape and replica: for an image model's many small arrays that cost seconds on the first
    save. Only arrays of at least 1 MiB per replica are split; all restore exactly."""
    assert jax.device_count() == 8  # the suite's 8 host devices: 8 replicas
    compiles: list[str] = []

    def on_duration(name: str, secs: float, **kwargs) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        _save_and_count(tmp_path, compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)


def _save_and_count(tmp_path, compiles: list[str]) -> None:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec())
    small = {f"b{n}": np.full((8 * n,), n, np.float32) for n in range(1, 21)}
    large = {"k": np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024)}  # 1 MiB each
    ckpt = checkpoints.Checkpointer(str(tmp_path), async_save=False)
    for step, item in ((1, small), (2, large)):
        before = len(compiles)
        ckpt.save(step, jax.device_put(item, replicated), {}, {}, None)
        ckpt.wait_until_finished()
        split = len(compiles) - before
        # Small: none. Large: still split, compiling its slices (one per replica in Orbax 0.12).
        assert (split == 0) if item is small else (split > 0), (step, split)
        restored = ckpt.restore(step, model=item)["model"]
        assert all(np.array_equal(restored[k], v) for k, v in item.items())
