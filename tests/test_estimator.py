"""The Estimator contract: replication, loops, exact eval, resume, summaries, errors."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimax as ex
from estimax.state import checkpoints


class TinyNet(nn.Module):
    """Dense layers only: replica count must not change its gradients."""

    @nn.compact
    def __call__(self, x, train):
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(3)(x)


def make_model_fn(dropout=0.0, batch_norm=False):
    def model_fn(features, labels, mode, params):
        x = features
        if batch_norm:
            x = nn.BatchNorm(use_running_average=mode != ex.ModeKeys.TRAIN, momentum=0.9)(x)
        x = nn.Dropout(dropout, deterministic=mode != ex.ModeKeys.TRAIN)(x)
        logits = TinyNet()(x, mode == ex.ModeKeys.TRAIN)
        loss = None if labels is None else ex.losses.softmax_cross_entropy(logits, labels)
        return ex.EstimatorSpec(
            mode=mode,
            loss=loss,
            optimizer=optax.sgd(0.1, momentum=0.9),
            eval_metrics=None
            if labels is None
            else {"accuracy": ex.metrics.accuracy(labels, logits)},
            predictions={"classes": jnp.argmax(logits, -1), "logits": logits},
            scalars={"learning_rate": jnp.float32(0.1)},
        )

    return model_fn


def data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5)).astype(np.int32)
    return x, y


def config(tmp_path, name="run", **kw):
    kw.setdefault("iterations_per_loop", 2)
    kw.setdefault("save_checkpoints_steps", 2)
    kw.setdefault("keep_checkpoint_max", None)
    return ex.RunConfig(model_dir=str(tmp_path / name), **kw)


def assert_trees_close(a, b, **tol):
    flat_a, tree_a = jax.tree_util.tree_flatten(a)
    flat_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(flat_a, flat_b, strict=False):
        np.testing.assert_allclose(x, y, **tol)


def test_eight_replicas_match_one_device(tmp_path):
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    x, y = data()
    results = {}
    for shards in (1, 8):
        est = ex.Estimator(
            make_model_fn(), config(tmp_path, f"s{shards}", num_shards=shards), train_batch_size=64
        )
        est.train(ex.numpy_input_fn(x, y, shuffle=False), max_steps=5)
        results[shards] = est.get_variables()["params"]
    # The mean of 8 replica gradients is the gradient of the global batch: same updates.
    assert_trees_close(results[1], results[8], rtol=1e-5, atol=1e-6)
    # ...and training did move the parameters (the comparison is not between two inits).
    init = ex.Estimator(make_model_fn(), config(tmp_path, "init"), train_batch_size=64)
    init.train(ex.numpy_input_fn(x, y, shuffle=False), max_steps=1)
    assert not np.allclose(
        init.get_variables()["params"]["TinyNet_0"]["Dense_0"]["kernel"],
        results[8]["TinyNet_0"]["Dense_0"]["kernel"],
    )


def test_batch_sizes_must_divide_by_replicas(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"train_batch_size=100 is not divisible by the number "
        r"of replicas \(8\)",
    ):
        ex.Estimator(make_model_fn(), config(tmp_path), train_batch_size=100)
    with pytest.raises(ValueError, match="eval_batch_size=12"):
        ex.Estimator(make_model_fn(), config(tmp_path), eval_batch_size=12)


def test_last_loop_is_shortened_to_hit_steps_exactly(tmp_path):
    x, y = data()
    cfg = config(tmp_path, iterations_per_loop=4, save_checkpoints_steps=1, save_summary_steps=1)
    est = ex.Estimator(make_model_fn(), cfg, train_batch_size=32)
    est.train(ex.numpy_input_fn(x, y), steps=10)
    # Checkpoints can only be written between device loops: the loops were 4, 4, 2 steps.
    assert checkpoints.Checkpointer(cfg.model_dir, None, read_only=True).all_steps() == [4, 8, 10]
    est.close()
    # ...but the summaries carry every step's own number.
    assert sorted(_scalars(cfg.model_dir, "loss")) == list(range(1, 11))


def test_steps_is_incremental_and_max_steps_absolute(tmp_path):
    x, y = data()
    est = ex.Estimator(make_model_fn(), config(tmp_path), train_batch_size=32)
    est.train(ex.numpy_input_fn(x, y), steps=3)
    assert est.get_global_step() == 3
    est.train(ex.numpy_input_fn(x, y), steps=3)
    assert est.get_global_step() == 6
    est.train(ex.numpy_input_fn(x, y), max_steps=4)  # already past: nothing to do
    assert est.get_global_step() == 6
    est.train(ex.numpy_input_fn(x, y), max_steps=9)
    assert est.get_global_step() == 9
    with pytest.raises(ValueError, match="Can not provide both steps and max_steps."):
        est.train(ex.numpy_input_fn(x, y), steps=1, max_steps=20)
    with pytest.raises(ValueError, match="One of `steps` or `max_steps` must be set"):
        est.train(ex.numpy_input_fn(x, y))
    with pytest.raises(ValueError, match="steps > 0"):
        est.train(ex.numpy_input_fn(x, y), steps=0)


def test_second_train_resumes_and_skips_done_steps(tmp_path, caplog):
    x, y = data()
    # Dropout and a shuffled input: resuming must restore the RNG stream and input position.
    model_fn = make_model_fn(dropout=0.3, batch_norm=True)
    resumed = ex.Estimator(model_fn, config(tmp_path, "resumed"), train_batch_size=32)
    resumed.train(ex.numpy_input_fn(x, y, seed=3), max_steps=6)
    with caplog.at_level("INFO"):
        resumed.train(ex.numpy_input_fn(x, y, seed=3), max_steps=6)
    assert "Skipping training since max_steps has already saved." in caplog.text
    assert resumed.get_global_step() == 6
    # 6 -> 13 crosses the end of an epoch (256 examples = 8 batches).
    resumed.train(ex.numpy_input_fn(x, y, seed=3), max_steps=13)

    straight = ex.Estimator(model_fn, config(tmp_path, "straight"), train_batch_size=32)
    straight.train(ex.numpy_input_fn(x, y, seed=3), max_steps=13)
    assert resumed.get_global_step() == straight.get_global_step() == 13
    assert_trees_close(resumed.get_variables(), straight.get_variables(), rtol=1e-6, atol=1e-7)


def test_input_state_is_what_makes_resume_exact(tmp_path):
    """Control for the test above: restarting the input (no state) gives other parameters."""
    x, y = data()

    def stateless(params):  # same batches as numpy_input_fn, but no get_state/set_state
        yield from ex.numpy_input_fn(x, y, seed=3)(params)

    a = ex.Estimator(make_model_fn(), config(tmp_path, "a"), train_batch_size=32)
    a.train(stateless, max_steps=4)
    a.train(stateless, max_steps=8)
    b = ex.Estimator(make_model_fn(), config(tmp_path, "b"), train_batch_size=32)
    b.train(stateless, max_steps=8)
    assert not np.allclose(
        a.get_variables()["params"]["TinyNet_0"]["Dense_0"]["kernel"],
        b.get_variables()["params"]["TinyNet_0"]["Dense_0"]["kernel"],
    )


def known_answer_model_fn(features, labels, mode, params):
    """Predicts class features[:, 0]; loss = features[:, 1]; nothing depends on the weights."""
    w = nn.Dense(1, use_bias=False)(features)
    pred = features[:, 0].astype(jnp.int32)
    # Scores rank the predicted class first and the next class id second.
    logits = jax.nn.one_hot(pred, 4) * 5.0 + jax.nn.one_hot((pred + 1) % 4, 4) * 2.0 + 0.0 * w
    if mode == ex.ModeKeys.PREDICT:  # labels are None when predicting
        return ex.EstimatorSpec(mode=mode, predictions={"pred": pred, "x1": features[:, 1]})
    return ex.EstimatorSpec(
        mode=mode,
        loss=features[:, 1] + 0.0 * w[:, 0],
        optimizer=optax.sgd(0.0),
        eval_metrics={
            "accuracy": ex.metrics.accuracy(labels, logits),
            "top_2": ex.metrics.top_k_accuracy(labels, logits, k=2),
            "mean_x1": ex.metrics.mean(features[:, 1]),
        },
        predictions={"pred": pred, "x1": features[:, 1]},
    )


@pytest.mark.parametrize("shards", [1, 8])
def test_eval_counts_every_example_once_with_a_ragged_final_batch(tmp_path, shards):
    rng = np.random.default_rng(shards)
    n = 37  # batches of 16, 16 and a ragged 5
    x = np.stack([rng.integers(0, 4, n), rng.normal(size=n)], axis=1).astype(np.float32)
    y = rng.integers(0, 4, n).astype(np.int32)
    est = ex.Estimator(
        known_answer_model_fn,
        config(tmp_path, num_shards=shards),
        train_batch_size=16,
        eval_batch_size=16,
        predict_batch_size=16,
    )
    results = est.evaluate(ex.numpy_input_fn(x, y, shuffle=False, num_epochs=1))
    assert results["num_examples"] == 37
    np.testing.assert_allclose(results["accuracy"], np.mean(x[:, 0] == y), rtol=1e-6)
    top_2 = (x[:, 0] == y) | ((x[:, 0] + 1) % 4 == y)
    np.testing.assert_allclose(results["top_2"], np.mean(top_2), rtol=1e-6)
    np.testing.assert_allclose(results["mean_x1"], x[:, 1].mean(), rtol=1e-5)
    np.testing.assert_allclose(results["loss"], x[:, 1].mean(), rtol=1e-5)
    # steps= caps the number of batches: 2 full batches.
    capped = est.evaluate(ex.numpy_input_fn(x, y, shuffle=False, num_epochs=1), steps=2)
    assert capped["num_examples"] == 32
    np.testing.assert_allclose(capped["mean_x1"], x[:32, 1].mean(), rtol=1e-5)
    # predict: one dict per real example, in order, padding rows dropped.
    preds = list(est.predict(ex.numpy_input_fn(x, None, shuffle=False, num_epochs=1)))
    assert len(preds) == 37
    np.testing.assert_array_equal([p["pred"] for p in preds], x[:, 0].astype(np.int32))
    np.testing.assert_allclose([p["x1"] for p in preds], x[:, 1], rtol=1e-6)


def test_top_k_accuracy_counts_ties_as_in_top_k():
    logits = jnp.array([[3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    labels = jnp.array([1, 0, 0])
    m = ex.metrics.top_k_accuracy(labels, logits, k=2).reduce(jnp.ones(3))
    # row 0: label scores 2nd -> hit; row 1: one class higher -> hit; row 2: 3 higher -> miss.
    assert float(m.compute()) == pytest.approx(2 / 3)


def _scalars(logdir, tag):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return {}
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_tensorboard_reads_train_and_eval_scalars(tmp_path):
    x, y = data()
    cfg = config(tmp_path, save_summary_steps=3, log_step_count_steps=4, iterations_per_loop=2)
    est = ex.Estimator(make_model_fn(), cfg, train_batch_size=32, eval_batch_size=32)
    est.train(ex.numpy_input_fn(x, y), max_steps=8)
    results = est.evaluate(ex.numpy_input_fn(x[:50], y[:50], shuffle=False, num_epochs=1))
    est.close()
    loss = _scalars(cfg.model_dir, "loss")
    assert sorted(loss) == [1, 3, 6]  # the first step, then every save_summary_steps
    assert all(np.isfinite(v) for v in loss.values())
    assert sorted(_scalars(cfg.model_dir, "learning_rate")) == [1, 3, 6]
    assert _scalars(cfg.model_dir, "learning_rate")[3] == pytest.approx(0.1)
    assert sorted(_scalars(cfg.model_dir, "global_step/sec")) == [4, 8]
    assert sorted(_scalars(cfg.model_dir, "examples/sec")) == [4, 8]
    eval_dir = os.path.join(cfg.model_dir, "eval")
    assert _scalars(eval_dir, "accuracy") == {8: pytest.approx(results["accuracy"])}
    assert _scalars(eval_dir, "loss") == {8: pytest.approx(results["loss"])}


def test_log_lines_as_the_original(tmp_path, caplog):
    x, y = data()
    cfg = config(tmp_path, log_step_count_steps=2)
    est = ex.Estimator(make_model_fn(), cfg, train_batch_size=32)
    with caplog.at_level("INFO"):
        est.train(ex.numpy_input_fn(x, y), max_steps=4)
    lines = [r.getMessage() for r in caplog.records]
    logged = [line for line in lines if line.startswith("loss = ")]
    assert [line.split("step = ")[1] for line in logged] == ["1", "2", "4"]
    assert any(line.startswith("global_step/sec: ") for line in lines)
    assert any(line.startswith("examples/sec: ") for line in lines)


def test_nan_loss_stops_training_and_keeps_checkpoints(tmp_path):
    x, y = data()

    def model_fn(features, labels, mode, params):
        spec = make_model_fn()(features, labels, mode, params)
        # The loss turns NaN from step 5 (0-based global step 5 is the 6th step).
        spec.loss = jnp.where(ex.get_global_step() >= 5, jnp.nan, jnp.mean(spec.loss))
        return spec

    cfg = config(tmp_path, iterations_per_loop=3, save_checkpoints_steps=1)
    est = ex.Estimator(model_fn, cfg, train_batch_size=32)
    with pytest.raises(
        ex.NanLossError,
        match=r"NaN loss during training: the loss was nan at "
        r"step 6 \(steps 4\.\.6 ran in one device loop\)"
        r".*latest checkpoint \(step 3\)",
    ):
        est.train(ex.numpy_input_fn(x, y), max_steps=9)
    assert est.get_global_step() == 3
    params = est.get_variables()["params"]
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))


def test_model_fn_and_params_errors(tmp_path):
    with pytest.raises(ValueError, match="reserved keys \\['batch_size'\\]"):
        ex.Estimator(make_model_fn(), config(tmp_path), params={"batch_size": 3})
    with pytest.raises(ValueError, match="must have a `features` argument"):
        ex.Estimator(lambda x, labels, mode, params: None, config(tmp_path))

    def no_optimizer(features, labels, mode, params):
        return ex.EstimatorSpec(mode=mode, loss=jnp.mean(nn.Dense(1)(features)))

    est = ex.Estimator(no_optimizer, config(tmp_path, "noopt"), train_batch_size=32)
    x, y = data()
    with pytest.raises(ValueError, match="no optimizer in TRAIN mode"):
        est.train(ex.numpy_input_fn(x, y), steps=1)
    est2 = ex.Estimator(make_model_fn(), config(tmp_path, "b2"), train_batch_size=32)
    with pytest.raises(ValueError, match="Estimator needs eval_batch_size"):
        est2.evaluate(ex.numpy_input_fn(x, y, num_epochs=1))


def test_wrong_training_batch_size_is_reported(tmp_path):
    x, y = data(n=40)
    est = ex.Estimator(make_model_fn(), config(tmp_path), train_batch_size=32)

    def input_fn(params):
        return iter([(x[:24], y[:24])])

    with pytest.raises(ValueError, match="training batch of 24 examples; this host must feed 32"):
        est.train(input_fn, steps=1)


def test_input_context_and_per_host_batch(tmp_path):
    seen = {}

    def input_fn(params):
        seen.update(params)
        x, y = data(n=64)
        return ex.numpy_input_fn(x, y)(params)

    est = ex.Estimator(make_model_fn(), config(tmp_path), params={"lr": 1}, train_batch_size=64)
    est.train(input_fn, steps=1)
    assert seen["batch_size"] == 64 and seen["lr"] == 1  # one host: the whole global batch
    ctx = seen["context"]
    assert (ctx.host_index, ctx.num_hosts, ctx.num_replicas) == (0, 1, 8)


def test_export_runs_without_model_code(tmp_path):
    import subprocess
    import sys

    x, y = data()
    est = ex.Estimator(
        make_model_fn(batch_norm=True), config(tmp_path), train_batch_size=32, predict_batch_size=16
    )
    est.train(ex.numpy_input_fn(x, y), max_steps=4)
    path = est.export_saved_model(
        str(tmp_path / "export"), lambda: ex.TensorSpec((None, 6), np.float32)
    )
    expected = np.stack(
        [
            p["logits"]
            for p in est.predict(ex.numpy_input_fn(x[:7], None, shuffle=False, num_epochs=1))
        ]
    )
    np.save(tmp_path / "x.npy", x[:7])
    # A fresh process that never imports this test's model code.
    code = (
        "import numpy as np, sys; from estimax import export; m = export.load(sys.argv[1]);"
        "out = m(np.load(sys.argv[2])); np.save(sys.argv[3], out['logits']);"
        "print(m.global_step)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, path, str(tmp_path / "x.npy"), str(tmp_path / "out.npy")],
        capture_output=True,
        text=True,
        env={**os.environ, "XLA_FLAGS": ""},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "4"
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="not an estimax export"):
        from estimax import export

        export.load(str(tmp_path))


def test_train_and_evaluate_every_steps(tmp_path):
    x, y = data()
    cfg = config(tmp_path)
    est = ex.Estimator(make_model_fn(), cfg, train_batch_size=32, eval_batch_size=32)
    results, _ = ex.train_and_evaluate(
        est,
        ex.TrainSpec(ex.numpy_input_fn(x, y), max_steps=6),
        ex.EvalSpec(ex.numpy_input_fn(x[:40], y[:40], shuffle=False, num_epochs=1), every_steps=4),
    )
    est.close()
    assert results["global_step"] == 6 and results["num_examples"] == 40
    assert sorted(_scalars(os.path.join(cfg.model_dir, "eval"), "accuracy")) == [4, 6]


@pytest.mark.parametrize("throttle_secs,evaluated", [(0.0, [2, 4, 6, 8]), (1e9, [2, 8])])
def test_train_and_evaluate_after_checkpoints_throttled(tmp_path, throttle_secs, evaluated):
    """Without every_steps: evaluate each complete checkpoint, at most once per throttle_secs
    (the first always), and the final one."""
    x, y = data()
    cfg = config(tmp_path)  # a checkpoint every 2 steps
    est = ex.Estimator(make_model_fn(), cfg, train_batch_size=32, eval_batch_size=32)
    results, _ = ex.train_and_evaluate(
        est,
        ex.TrainSpec(ex.numpy_input_fn(x, y), max_steps=8),
        ex.EvalSpec(
            ex.numpy_input_fn(x[:40], y[:40], shuffle=False, num_epochs=1),
            throttle_secs=throttle_secs,
        ),
    )
    est.close()
    assert results["global_step"] == 8
    assert sorted(_scalars(os.path.join(cfg.model_dir, "eval"), "accuracy")) == evaluated


def test_skipped_input_records_reach_tensorboard(tmp_path):
    x, y = data()

    class SkippingInput:
        """Pretends every 3rd batch had one bad record that was skipped."""

        def __init__(self, params):
            self.inner = ex.numpy_input_fn(x, y)(params)
            self.num_skipped = 0
            self.batches = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.batches += 1
            if self.batches % 3 == 0:
                self.num_skipped += 1
            return next(self.inner)

    cfg = config(tmp_path, iterations_per_loop=3)
    est = ex.Estimator(make_model_fn(), cfg, train_batch_size=32)
    est.train(SkippingInput, max_steps=6)
    est.close()
    # The count is the input's as of the last batch each loop trained on (not of batches read
    # ahead into the prefetch), written when it changes: batch 3 at step 3, batch 6 at step 6.
    assert _scalars(cfg.model_dir, "input/skipped_records") == {3: 1, 6: 2}


def test_relative_model_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y = data()
    est = ex.Estimator(
        make_model_fn(),
        ex.RunConfig(model_dir="runs/rel", iterations_per_loop=2),
        train_batch_size=32,
    )
    est.train(ex.numpy_input_fn(x, y), max_steps=2)
    assert est.get_global_step() == 2
    assert os.path.isdir(tmp_path / "runs" / "rel" / "checkpoints" / "2")
