"""Preemption: SIGTERM finishes the current step, saves there, exits 0; the restart continues.

The MNIST program (tests/multihost_worker.py) sends itself SIGTERM while reading a training
batch. One process: its 3rd, so a step is running or queued by then (two batches are read
ahead) and the notice lands early in the run, between checkpoint steps of the run's cadence
(every 2 steps) as often as on them. Many processes: the first, before the run has traced its
first step (the job saves at step 1, off the cadence): JAX's preemption service agrees on the
step asynchronously, and with every step's program in the compilation cache the steps after a
later notice can all run before the agreement (at the 3rd batch: a run that finished all 6
steps and evaluated, once in a full CI run on a loaded 2-core machine).
"""

from __future__ import annotations

import os

import multihost_helpers as mh
import pytest

from estimax.state import checkpoints

pytestmark = pytest.mark.slow


def _preempted_then_restarted(num_processes, tmp_path_factory, tmp_path):
    data_dir, reference_dir, _ = mh.reference(num_processes, tmp_path_factory)
    # Every process gets the notice (the docstring says when). One process's own handler is in
    # place only once training starts: not yet while it reads its first batch.
    at = 3 if num_processes == 1 else 1
    faults = {i: f"sigterm:{at}" for i in range(num_processes)}
    preempted = mh.run_job(num_processes, data_dir, str(tmp_path), faults=faults)
    mh.assert_ok(preempted)  # exit 0: a clean stop for the job runner
    steps = {mh.saved_step(p.stdout) for p in preempted}
    assert len(steps) == 1, steps  # every process stopped at the same step
    step = steps.pop()
    assert 1 <= step < mh.TRAIN_STEPS
    assert checkpoints.Checkpointer(str(tmp_path), None, read_only=True).latest_step() == step
    for proc in preempted:
        assert "Eval results" not in proc.stdout  # stopped: no evaluation, no export
    restarted = mh.run_job(num_processes, data_dir, str(tmp_path))
    mh.assert_ok(restarted)
    assert f"Restored checkpoint at step {step} " in restarted[0].stderr
    # Saved with its input position at the step it stopped: the restart ends where an
    # uninterrupted run ends.
    mh.assert_same_params(mh.params(str(tmp_path)), mh.params(reference_dir), rtol=1e-6, atol=1e-7)


def test_sigterm_one_process_saves_the_current_step_and_exits_0(tmp_path_factory, tmp_path):
    _preempted_then_restarted(1, tmp_path_factory, tmp_path)


def test_sigterm_both_of_two_processes_agree_on_the_step(tmp_path_factory, tmp_path):
    _preempted_then_restarted(2, tmp_path_factory, tmp_path)


def test_the_handler_is_removed_after_training(tmp_path):
    import signal

    import numpy as np
    import optax

    import estimax as ex

    def model_fn(features, labels, mode, params):
        import flax.linen as nn

        logits = nn.Dense(2)(features)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.1),
        )

    before = signal.getsignal(signal.SIGTERM)
    est = ex.Estimator(
        model_fn, ex.RunConfig(str(tmp_path), save_checkpoints_steps=1), train_batch_size=8
    )
    x = np.ones((16, 3), np.float32)
    est.train(ex.numpy_input_fn(x, np.zeros(16, np.int32)), steps=1)
    assert signal.getsignal(signal.SIGTERM) is before
    assert os.path.isdir(tmp_path / "checkpoints" / "1")
