"""Checkpoint errors a user can act on: a model_dir holding another model names the difference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import numpy as np
import optax
import pytest

import estimax as ex
from estimax.state.checkpoints import ModelMismatchError


def _model_fn(classes: int, extra: bool):
    def model_fn(features, labels, mode, params):
        x = nn.Dense(5, name="extra")(features) if extra else features
        logits = nn.Dense(classes, name="head")(x)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            optimizer=optax.sgd(0.1),
            predictions=logits,
        )

    return model_fn


def _train(model_dir: str, classes: int, extra: bool = False, steps: int = 2) -> ex.Estimator:
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    est = ex.Estimator(
        _model_fn(classes, extra),
        ex.RunConfig(model_dir=model_dir, iterations_per_loop=2),
        train_batch_size=8,
    )
    est.train(ex.numpy_input_fn(x, np.zeros(16, np.int32)), max_steps=steps)
    return est


@pytest.mark.parametrize(
    "classes, extra, difference",
    [
        (4, False, r"params/head/bias has shape \(3,\) in the checkpoint, \(4,\) in this model"),
        (3, True, r"params/extra/bias \(5,\) is not in the checkpoint"),
    ],
)
def test_a_model_dir_holding_another_model_names_the_first_difference(
    tmp_path, classes, extra, difference
):
    model_dir = str(tmp_path / "run")
    _train(model_dir, classes=3)
    with pytest.raises(ModelMismatchError, match=difference) as raised:
        _train(model_dir, classes=classes, extra=extra, steps=4)
    message = str(raised.value)
    assert "\n" not in message
    assert f"{model_dir} holds a different model" in message
    assert "new --model_dir" in message and "warm_start_from" in message
    assert "partial_restore" not in message and "strict=False" not in message  # Orbax's advice
    # Nothing was lost: the first model still resumes from its checkpoint.
    assert _train(model_dir, classes=3, steps=4).get_global_step() == 4


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, {fixtures!r})
    import ckpt_fixtures as fx
    fx.train({model_dir!r}, 2, width=256)
    if {full}:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # as a full disk: EFBIG
    est = fx.estimator({model_dir!r}, width=256, log_step_count_steps={log_every})
    est.train(fx.train_input_fn(), max_steps=4)
""")


def _library_script(
    model_dir: str, full: bool, log_every: int = 100
) -> subprocess.CompletedProcess:
    """A user's script with no logging set-up; its output goes through a pipe (no size limit)."""
    code = _SCRIPT.format(
        fixtures=os.path.join(ROOT, "tests", "reliability"),
        model_dir=model_dir,
        full=full,
        log_every=log_every,
    )
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow  # child processes that import JAX and train
def test_a_full_disk_at_checkpoint_time_is_the_last_line_of_a_short_output(tmp_path):
    model_dir = str(tmp_path / "run")
    proc = _library_script(model_dir, full=True)
    assert proc.returncode == 1
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert lines[-1].startswith("estimax.storage.StorageError: [Errno 28] Could not write "
                                "checkpoint 4 in"), lines[-5:]  # fmt: skip
    assert "the previous one (step 2) is intact" in lines[-1]
    # No Orbax/asyncio/TensorStore tracebacks: the error's own traceback and the run's INFO
    # lines (which grow with what training reports, e.g. its flops and MFU) aside.
    others = [line for line in lines if not line.startswith("INFO:")]
    assert len(others) < 30, "\n".join(lines)
    assert not any("orbax" in line.lower() and "Traceback" in line for line in lines)


@pytest.mark.slow
def test_a_script_without_logging_setup_shows_estimax_lines_and_not_orbaxs(tmp_path):
    proc = _library_script(str(tmp_path / "run"), full=False, log_every=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert any("loss = " in line and "step = 3" in line for line in lines), proc.stderr
    # Orbax's per-checkpoint chatter (array transfers, commit steps) is debug-only.
    assert not [line for line in lines if "orbax" in line.lower()], proc.stderr
