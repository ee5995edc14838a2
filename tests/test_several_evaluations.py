"""Several evaluations in one job: each its own directory (a TensorBoard run) and cadence."""

from __future__ import annotations

import os

import bestmodel_job as job
import numpy as np

import estimax as ex
from estimax.estimator import summaries


def _input_fn(n: int, data_seed: int, **kwargs):
    x, y = job.data(n, data_seed)
    return ex.numpy_input_fn(x, y, **kwargs)


def test_two_eval_specs_are_two_tensorboard_runs_each_at_its_cadence(tmp_path):
    from tensorboard.backend.event_processing import plugin_event_multiplexer

    model_dir = str(tmp_path)
    est = job.estimator(model_dir, num_shards=None)
    hard_x, hard_y = job.data(200, seed=2)
    hard = np.abs(hard_x[:, 0]) < 0.3  # near the class boundary
    results, exported = ex.train_and_evaluate(
        est,
        ex.TrainSpec(_input_fn(64, 0, seed=1), max_steps=12),
        [
            ex.EvalSpec(
                _input_fn(40, 1, shuffle=False, num_epochs=1), name="validation", every_steps=4
            ),
            ex.EvalSpec(
                ex.numpy_input_fn(hard_x[hard], hard_y[hard], shuffle=False, num_epochs=1),
                name="hard",
                every_steps=6,
            ),
        ],
    )
    assert exported == []
    assert results["validation"]["num_examples"] == 40
    assert results["hard"]["num_examples"] == int(hard.sum())
    # TensorBoard's own reader, over the model_dir as `tensorboard --logdir` reads it.
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(model_dir)
    multiplexer.Reload()
    runs = multiplexer.Runs()
    assert {"eval_validation", "eval_hard"} <= set(runs)
    steps = {
        run: [e.step for e in multiplexer.Tensors(run, "accuracy")]
        for run in ("eval_validation", "eval_hard")
    }
    assert steps == {"eval_validation": [4, 8, 12], "eval_hard": [6, 12]}
    for name in ("validation", "hard"):
        recorded = summaries.recorded_evaluations(os.path.join(model_dir, f"eval_{name}"))
        assert recorded[12] == results[name]


def test_an_eval_spec_that_follows_checkpoints_runs_beside_one_every_n_steps(tmp_path):
    est = job.estimator(str(tmp_path))
    ex.train_and_evaluate(
        est,
        ex.TrainSpec(_input_fn(64, 0, seed=1), max_steps=8),
        [
            ex.EvalSpec(_input_fn(40, 1, shuffle=False, num_epochs=1), name="a", every_steps=4),
            # After every checkpoint (throttle 0): steps 2, 4, 6 from the listener, 8 at the end.
            ex.EvalSpec(_input_fn(40, 1, shuffle=False, num_epochs=1), name="b", throttle_secs=0),
        ],
    )
    a = summaries.recorded_evaluations(os.path.join(str(tmp_path), "eval_a"))
    b = summaries.recorded_evaluations(os.path.join(str(tmp_path), "eval_b"))
    assert sorted(a) == [4, 8] and sorted(b) == [2, 4, 6, 8]
    assert a[8]["accuracy"] == b[8]["accuracy"]  # the same checkpoint, the same data
