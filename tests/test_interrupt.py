"""Ctrl-C (SIGINT) saves the steps trained so far, as SIGTERM does; a second Ctrl-C stops at
once. A real signal to a real training process (a child, so the test runner is not interrupted).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from estimax.state import checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import flax.linen as nn
    import numpy as np
    import optax
    import estimax as ex

    # Ctrl-C from a terminal reaches Python's handler. A runner started as a background job
    # (`cmd &` in a script) passes SIGINT on ignored, and Python then keeps ignoring it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    model_dir, presses = sys.argv[1], int(sys.argv[2])

    def model_fn(features, labels, mode, params):
        logits = nn.Dense(2)(features)
        return ex.EstimatorSpec(
            mode=mode, loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.1))

    def input_fn(params):
        x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
        for i in range(1000):
            if presses and i == 4:  # Ctrl-C while the 5th batch is read: steps are running
                for _ in range(presses):
                    os.kill(os.getpid(), signal.SIGINT)
            yield x, np.zeros(8, np.int32)

    est = ex.Estimator(model_fn, ex.RunConfig(model_dir, iterations_per_loop=100,
                       save_checkpoints_steps=1000), train_batch_size=8)
    est.train(input_fn, max_steps=50)
    print("FINISHED AT", est.get_global_step())
""")


def _run(model_dir: str, presses: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir, str(presses)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow  # child processes that import JAX
def test_ctrl_c_saves_the_current_step_and_the_rerun_continues(tmp_path):
    model_dir = str(tmp_path)
    interrupted = _run(model_dir, presses=1)
    assert interrupted.returncode == 1  # an uncaught KeyboardInterrupt subclass in a script
    last = interrupted.stderr.strip().splitlines()[-1]
    assert "Interrupted (Ctrl-C): saved a checkpoint at step" in last, interrupted.stderr[-2000:]
    step = checkpoints.Checkpointer(model_dir, None, read_only=True).latest_step()
    assert step is not None and 1 <= step < 50  # the loop of 100 steps was cut, and saved
    assert f"at step {step} in {model_dir}" in last
    again = _run(model_dir, presses=0)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "FINISHED AT 50" in again.stdout
    assert f"Restored checkpoint at step {step}" in again.stderr


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path):
    model_dir = str(tmp_path)
    proc = _run(model_dir, presses=2)
    assert proc.returncode == -signal.SIGINT  # Python's own end on an uncaught Ctrl-C
    assert proc.stderr.strip().splitlines()[-1] == "KeyboardInterrupt"
    assert "Interrupted (Ctrl-C)" not in proc.stderr
    assert checkpoints.Checkpointer(model_dir, None, read_only=True).latest_step() is None
