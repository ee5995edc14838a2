"""A process killed in the middle of writing a checkpoint loses nothing that was complete."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np

from estimax.state import checkpoints

CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    import crash_model
    from estimax.state import checkpoints

    original_save = checkpoints.Checkpointer.save

    def save_then_die(self, step, *args, **kwargs):
        original_save(self, step, *args, **kwargs)  # starts the (async) write
        if step == 6:
            names = os.listdir(checkpoints.checkpoint_dir(self.model_dir))
            if any(n.startswith("6.") and "tmp" in n for n in names):
                open(os.path.join(sys.argv[1], "killed-mid-save"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoints.Checkpointer.save = save_then_die
    crash_model.estimator(sys.argv[1]).train(crash_model.input_fn(), max_steps=10)
""")

MODEL = textwrap.dedent("""
    import flax.linen as nn, jax.numpy as jnp, numpy as np, optax
    import estimax as ex

    def model_fn(features, labels, mode, params):
        # A 16 MB kernel, so that writing a checkpoint takes a while.
        h = nn.Dense(2048)(jnp.tile(features, (1, 341)))
        logits = nn.Dense(3)(nn.relu(h))
        return ex.EstimatorSpec(mode=mode, loss=ex.losses.softmax_cross_entropy(logits, labels),
                                optimizer=optax.sgd(0.01))

    def input_fn():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(128, 6)).astype(np.float32)
        return ex.numpy_input_fn(x, (x[:, 0] > 0).astype(np.int32), seed=1)

    def estimator(model_dir):
        config = ex.RunConfig(model_dir=model_dir, iterations_per_loop=2,
                              save_checkpoints_steps=2, keep_checkpoint_max=None, num_shards=1)
        return ex.Estimator(model_fn, config, train_batch_size=16)
""")


def test_kill_during_checkpoint_write_keeps_complete_ones(tmp_path):
    (tmp_path / "crash_model.py").write_text(MODEL)
    sys.path.insert(0, str(tmp_path))
    import crash_model

    killed_dir = tmp_path / "killed"
    killed_dir.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(killed_dir), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]

    complete = checkpoints.Checkpointer(str(killed_dir), None, read_only=True).all_steps()
    assert complete[:2] == [2, 4]
    if (killed_dir / "killed-mid-save").exists():
        # The save of step 6 had started but not finished: it must not count as a checkpoint.
        assert complete == [2, 4]

    # An uninterrupted run, for reference.
    reference = crash_model.estimator(str(tmp_path / "reference"))
    reference.train(crash_model.input_fn(), max_steps=10)
    ref_dir = checkpoints.checkpoint_dir(str(tmp_path / "reference"))

    # Every complete checkpoint of the killed run loads, and equals the reference at that step.
    resumed = crash_model.estimator(str(killed_dir))
    for step in complete:
        got = resumed.get_variables(
            os.path.join(checkpoints.checkpoint_dir(str(killed_dir)), str(step))
        )
        want = reference.get_variables(os.path.join(ref_dir, str(step)))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=False):
            np.testing.assert_array_equal(a, b)

    # Resuming finishes the job exactly as if nothing had happened.
    resumed.train(crash_model.input_fn(), max_steps=10)
    assert resumed.get_global_step() == 10
    for a, b in zip(
        jax.tree.leaves(resumed.get_variables()),
        jax.tree.leaves(reference.get_variables()),
        strict=False,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    sys.path.remove(str(tmp_path))
