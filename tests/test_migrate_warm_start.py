"""Warm starts (Estimator(warm_start_from=...)) from TensorFlow and estimax checkpoints."""

import dataclasses
import logging
import os

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from absl import flags

import estimax as ex
from estimax import migrate
from estimax.models import ResNetTiny
from estimax.programs import cli, resnet
from estimax.state import warm_start

DATA = os.path.join(os.path.dirname(__file__), "data", "tf_checkpoints")
TF_RESNET = os.path.join(DATA, "resnet_tiny")
BERT = os.path.join(DATA, "bert_tiny")


def _model_fn(num_classes, extra=False):
    def model_fn(features, labels, mode, params):
        logits = ResNetTiny(num_classes=num_classes)(features, train=mode == ex.ModeKeys.TRAIN)
        if extra:  # a layer the checkpoint has not
            logits = logits + nn.Dense(num_classes, name="extra")(logits)
        return ex.EstimatorSpec(
            mode=mode,
            loss=ex.losses.softmax_cross_entropy(logits, labels),
            # A zero rate: the weights after a step are the warm-started ones (batch statistics
            # still move, as in any training step).
            optimizer=optax.sgd(0.0),
            predictions={"logits": logits},
        )

    return model_fn


def _input_fn(params):
    rng = np.random.default_rng(0)
    while True:
        yield (
            rng.normal(size=(params["batch_size"], 32, 32, 3)).astype(np.float32),
            rng.integers(0, 3, params["batch_size"]).astype(np.int32),
        )


def _estimator(model_dir, num_classes, warm_start_from, extra=False):
    return ex.Estimator(
        _model_fn(num_classes, extra),
        ex.RunConfig(model_dir=str(model_dir), num_shards=1, save_checkpoints_steps=1),
        train_batch_size=2,
        warm_start_from=warm_start_from,
    )


def _files(model_dir):
    """Every file under ``model_dir`` (a checkpoint's included) but the goodput record, which
    notes the run's start and time, not a step."""
    return [
        os.path.join(root, f)
        for root, _, files in os.walk(model_dir)
        for f in files
        if os.path.basename(root) != "goodput"
    ]


def _refused(model_dir, num_classes, warm_start_from, extra=False):
    """The warm start's error, having checked that the run stopped before step 0."""
    est = _estimator(model_dir, num_classes, warm_start_from, extra)
    with pytest.raises(warm_start.WarmStartError) as e:
        est.train(_input_fn, max_steps=1)
    est.close()
    assert _files(model_dir) == []  # no checkpoint, no step
    head, *lines = str(e.value).splitlines()
    assert head.endswith("does not fit the model:")
    return [line.strip() for line in lines]


def test_a_new_head_is_refused_before_step_0_unless_allowed(tmp_path, caplog):
    # As tf.estimator's: warm_start_from=PATH takes every variable, and the head's other shape
    # stops the run, both shapes named.
    assert _refused(tmp_path / "refused", 3, TF_RESNET) == [
        "other shape or dtype: ResNet_0/final_dense/bias [3] float32 <- dense/bias [10] float32, "
        "ResNet_0/final_dense/kernel [16, 3] float32 <- dense/kernel [16, 10] float32"
    ]
    # A warm start that would load nothing is refused, the opt-outs notwithstanding.
    nothing = ex.WarmStartSettings(BERT, [".*"], allow_missing=True, allow_shape_mismatch=True)
    lines = _refused(tmp_path / "nothing", 3, nothing)
    assert lines[0] == (
        "no variable would be loaded (37 selected): a warm start that loads nothing is refused"
    )
    assert lines[1] == "not in the checkpoint: 37 of the 37 selected variables"
    assert len(lines) == 2 + 10 + 1 and lines[-1] == "and 27 more"

    reader = migrate.CheckpointReader(TF_RESNET)
    allowed = ex.WarmStartSettings(TF_RESNET, [".*"], allow_shape_mismatch=True)
    est = _estimator(tmp_path / "a", 3, allowed)
    with caplog.at_level(logging.INFO):
        est.train(_input_fn, max_steps=1)
    params = est.get_variables()["params"]["ResNet_0"]
    np.testing.assert_array_equal(
        params["initial_conv"]["kernel"], reader.get_tensor("conv2d/kernel")
    )
    np.testing.assert_array_equal(
        params["block_group2"]["block0"]["bn2"]["scale"],
        reader.get_tensor("batch_normalization_6/gamma"),
    )
    assert params["final_dense"]["kernel"].shape == (16, 3)  # fresh, not TF's [16, 10]
    assert est.get_global_step() == 1  # the step starts at 0, not TF's 3
    assert "35 variables loaded, 2 initialised fresh" in caplog.text
    # What was selected and not loaded: a warning, listing each.
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        "  initialised fresh (other shape or dtype): ResNet_0/final_dense/bias [3] float32 <- "
        "dense/bias [10] float32, ResNet_0/final_dense/kernel [16, 3] float32 <- dense/kernel "
        "[16, 10] float32"
    ) in warned
    est.close()

    # A model_dir with a checkpoint of its own resumes from it: the warm start is not used
    # (a source that does not exist would fail if it were).
    again = _estimator(tmp_path / "a", 3, str(tmp_path / "nothing-here"))
    again.train(_input_fn, max_steps=2)
    assert again.get_global_step() == 2
    again.close()


def _resnet_variables(num_classes=10):
    model = ResNetTiny(num_classes=num_classes)
    # One compile at XLA:CPU's optimisation level 0 (as replication.run_init compiles
    # initialisers): run eagerly, each jax.random call of a new shape compiled its own threefry
    # hashing at the default level, most of this test's ~27 s.
    init = jax.jit(lambda key, x: model.init(key, x, train=False))
    args = (jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3), np.float32))
    compiled = init.lower(*args).compile(compiler_options={"xla_backend_optimization_level": "0"})
    return jax.tree.map(np.asarray, dict(compiled(*args)))


def test_warm_start_settings_take_the_trainable_variables_unless_given_a_list():
    reader = migrate.CheckpointReader(TF_RESNET)
    variables = _resnet_variables()
    loaded, report = warm_start.warm_start_variables(ex.WarmStartSettings(TF_RESNET), variables)
    np.testing.assert_array_equal(
        loaded["params"]["initial_conv"]["kernel"], reader.get_tensor("conv2d/kernel")
    )
    # A string: tf.estimator's TRAINABLE_VARIABLES; the statistics stay as initialised.
    np.testing.assert_array_equal(
        loaded["batch_stats"]["initial_bn"]["mean"], variables["batch_stats"]["initial_bn"]["mean"]
    )
    assert "initial_bn/mean" in report.fresh and "initial_bn/scale" in report.loaded
    # A list: tf.estimator's GLOBAL_VARIABLES, statistics included.
    settings = ex.WarmStartSettings(TF_RESNET, [".*initial_bn.*"])
    loaded, report = warm_start.warm_start_variables(settings, variables)
    np.testing.assert_array_equal(
        loaded["batch_stats"]["initial_bn"]["mean"],
        reader.get_tensor("batch_normalization/moving_mean"),
    )
    assert report.loaded == [f"initial_bn/{n}" for n in ("bias", "mean", "scale", "var")]
    assert report.sources["initial_bn/mean"] == "batch_normalization/moving_mean"
    # An expression may name the original's TensorFlow names too.
    _, report = warm_start.warm_start_variables(
        ex.WarmStartSettings(TF_RESNET, "dense/.*"), variables
    )
    assert report.loaded == ["final_dense/bias", "final_dense/kernel"]


def test_warm_start_from_an_estimax_model_dir_and_only_some_variables(tmp_path, caplog):
    first = _estimator(
        tmp_path / "first", 3, ex.WarmStartSettings(TF_RESNET, [".*"], allow_shape_mismatch=True)
    )
    first.train(_input_fn, max_steps=1)
    source = first.get_variables()["params"]["ResNet_0"]
    first.close()
    # A layer the checkpoint lacks: the run stops before step 0, naming it...
    everything = ex.WarmStartSettings(str(tmp_path / "first"))
    assert _refused(tmp_path / "refused", 3, everything, extra=True) == [
        "not in the checkpoint: 2 of the 25 selected variables",
        "extra/bias: nothing like it in the checkpoint",
        "extra/kernel: nothing like it in the checkpoint",
    ]
    # ...unless allowed: then it starts fresh, and a warning lists it.
    allowed = dataclasses.replace(everything, allow_missing=True)
    est = _estimator(tmp_path / "allowed", 3, allowed, extra=True)
    with caplog.at_level(logging.INFO):
        est.train(_input_fn, max_steps=1)
    est.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "  initialised fresh (not in the checkpoint): extra/bias, extra/kernel" in warned
    assert any(
        "23 variables loaded, 16 initialised fresh." in r.getMessage() for r in caplog.records
    )
    est = _estimator(
        tmp_path / "second",
        5,
        ex.WarmStartSettings(str(tmp_path / "first"), vars_to_warm_start=".*initial_conv.*"),
    )
    est.train(_input_fn, max_steps=1)
    params = est.get_variables()["params"]["ResNet_0"]
    np.testing.assert_array_equal(
        params["initial_conv"]["kernel"], source["initial_conv"]["kernel"]
    )
    reader = migrate.CheckpointReader(TF_RESNET)
    assert not np.array_equal(
        params["block_group1"]["block0"]["conv1"]["kernel"], reader.get_tensor("conv2d_2/kernel")
    )
    est.close()


def test_warm_start_from_nothing_is_one_clear_error(tmp_path):
    est = _estimator(tmp_path / "m", 3, str(tmp_path / "missing"))
    with pytest.raises(migrate.TFCheckpointError, match="neither a TensorFlow checkpoint"):
        est.train(_input_fn, max_steps=1)
    est.close()


@pytest.mark.slow  # the resnet program (tiny network) up to its warm start
def test_a_program_refuses_with_a_fatal_message_not_a_traceback(tmp_path, monkeypatch, capsys):
    # The resnet program (the tests' tiny network) warm-started from BERT's checkpoint: nothing
    # would load, so it stops before step 0 with FATAL and status 2, as a user's mistake.
    monkeypatch.setattr(
        resnet, "resnet_v1", lambda depth, classes, **kw: ResNetTiny(num_classes=classes, **kw)
    )
    fv = flags.FlagValues()
    resnet.define_flags(fv)
    model_dir = tmp_path / "m"
    argv = ["resnet", f"--model_dir={model_dir}", "--data_dir=fake", "--image_size=32"]
    fv([*argv, "--train_batch_size=8", "--train_steps=1", f"--warm_start_from={BERT}"])
    with pytest.raises(SystemExit) as e:
        cli._run(resnet.run_from_flags, fv, [], None, ["resnet"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"FATAL: --warm_start_from={BERT} does not fit the model:\n")
    assert "no variable would be loaded" in err
    assert not [f for f in _files(model_dir) if os.sep + "checkpoints" + os.sep in f]
