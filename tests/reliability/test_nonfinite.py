"""Non-finite losses: stop with the last good checkpoint kept, or skip the step (counted)."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

import estimax as ex
from estimax.estimator import steps
from estimax.programs import shared_flags

try:
    from . import ckpt_fixtures as fx
except ImportError:
    import ckpt_fixtures as fx

POISONED_STEP = 5  # the step whose batch gets a NaN row (found in the shuffled input)


@functools.cache
def _poisoned_rows() -> tuple[int, ...]:
    """The index of one row that the (seeded) input feeds at ``POISONED_STEP``."""
    x, _ = fx.data()
    it = iter(fx.train_input_fn()({"batch_size": 16}))
    for _ in range(POISONED_STEP):
        features, _ = next(it)
    (row,) = np.flatnonzero((x == features[0]).all(axis=1))
    return (int(row),)


def _batches_with_nan(num_steps: int) -> list[int]:
    """The 1-based steps whose batch holds a NaN row, read from the input itself."""
    it = iter(fx.train_input_fn(_poisoned_rows())({"batch_size": 16}))
    return [i + 1 for i in range(num_steps) if np.isnan(next(it)[0]).any()]


def test_nan_loss_stops_and_the_last_good_checkpoint_still_loads(tmp_path):
    first_bad = _batches_with_nan(12)[0]
    est = fx.estimator(str(tmp_path))
    with pytest.raises(ex.NanLossError) as e:
        est.train(fx.train_input_fn(_poisoned_rows()), max_steps=12)
    est.close()
    assert first_bad == POISONED_STEP
    saved = (first_bad - 1) // 2 * 2  # checkpoints every 2 steps (loops of 2)
    assert f"at step {first_bad}" in str(e.value)
    assert f"latest checkpoint (step {saved})" in str(e.value)
    est = fx.estimator(str(tmp_path))
    assert est.get_global_step() == saved
    variables = est.get_variables()
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(variables))
    # And it resumes: the good checkpoint is usable for training, not only for reading.
    est.train(fx.train_input_fn(), max_steps=saved + 2)
    assert est.get_global_step() == saved + 2
    est.close()


def test_train_step_skips_a_non_finite_step_without_an_update():
    model = steps.ModelFnModule(
        call=lambda f, lab, mode: fx.model_fn(f, lab, mode, {"width": 8}), mode=ex.ModeKeys.TRAIN
    )
    x, y = fx.data()
    good = (jnp.asarray(x[:16]), jnp.asarray(y[:16]))
    bad = (good[0].at[3, 2].set(jnp.inf), good[1])
    state = steps.init_state(model, jax.random.PRNGKey(0), good)
    step = jax.jit(functools.partial(steps.train_step, model, skip_nonfinite=True))
    rng = jax.random.PRNGKey(1)

    after_bad, metrics = step(state, bad, rng)
    assert not np.isfinite(metrics["loss"])
    assert float(metrics["nonfinite_skipped"]) == 1.0
    assert int(after_bad.step) == 1  # the counter advances (input and schedules stay aligned)
    assert fx.leaves_equal(jax.device_get(after_bad.params), jax.device_get(state.params))
    assert fx.leaves_equal(jax.device_get(after_bad.opt_state), jax.device_get(state.opt_state))

    after_good, metrics = step(state, good, rng)
    assert float(metrics["nonfinite_skipped"]) == 0.0
    assert not fx.leaves_equal(jax.device_get(after_good.params), jax.device_get(state.params))
    # Without the option a good step is the same computation.
    plain, _ = jax.jit(functools.partial(steps.train_step, model))(state, good, rng)
    assert fx.leaves_equal(jax.device_get(plain.params), jax.device_get(after_good.params))


def test_skip_nonfinite_steps_trains_through_and_counts_them(tmp_path, caplog):
    bad_steps = _batches_with_nan(8)
    assert bad_steps == [POISONED_STEP]
    caplog.set_level(logging.WARNING)
    est = fx.estimator(str(tmp_path), skip_nonfinite_steps=True)
    est.train(fx.train_input_fn(_poisoned_rows()), max_steps=8)
    assert est.get_global_step() == 8
    variables = est.get_variables()
    est.close()
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(variables))
    counted = fx.scalar_events(str(tmp_path), "train/nonfinite_skipped_steps")
    assert counted and counted[-1][1] == len(bad_steps)
    lines = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert lines and f"{len(bad_steps)} skipped so far" in lines[-1]
    assert f"first: step {bad_steps[0]}" in lines[0]


def test_skip_nonfinite_steps_flag():
    fv = flags.FlagValues()
    shared_flags.define_run_flags(
        fv,
        data_dir_default=None,
        data_dir_help="d",
        steps_per_eval_flag="steps_per_eval",
        precision_default="float32",
    )
    fv(["prog"])
    assert fv.skip_nonfinite_steps is False
    fv(["prog", "--skip_nonfinite_steps"])
    assert fv.skip_nonfinite_steps is True
