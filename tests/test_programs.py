"""The ImageNet programs (resnet, inception_v3, inception_v4): flags, recipes, modes, seed lines.

Sources of the expected values: docs/original.md §2.1 (resnet_main.py flags, 2018-12 column),
§6 (inception_v3.py / inception_v4.py flags and constants), TF1's RMSPropOptimizer update rule
(training_ops ApplyRMSProp: ms <- rho ms + (1 - rho) g^2, mom <- m mom + lr g / sqrt(ms + eps),
var <- var - mom, with ms initialised to ones by RMSPropOptimizer._create_slots).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import flags

import estimax as ex
from estimax.estimator import steps as steps_lib
from estimax.models.resnet import ResNetTiny
from estimax.programs import (
    cli,
    configs,
    efficientnet,
    exports,
    inception_v3,
    inception_v4,
    inputs,
    resnet,
    shared_flags,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import seed_command_lines  # noqa: E402

PROGRAMS = {"resnet": resnet, "inception_v3": inception_v3, "inception_v4": inception_v4}


def parse(program: str, argv: list[str]) -> flags.FlagValues:
    """A fresh flag registry with the program's flags, parsed from ``argv``."""
    fv = flags.FlagValues()
    PROGRAMS[program].define_flags(fv)
    fv([program, *argv])
    return fv


# docs/original.md §2.1, the 2018-12 column.
RESNET_DEFAULTS = {
    "use_tpu": True,
    "tpu": None,
    "gcp_project": None,
    "tpu_zone": None,
    "data_dir": "gs://cloud-tpu-test-datasets/fake_imagenet",
    "model_dir": None,
    "resnet_depth": 50,
    "mode": "train_and_eval",
    "train_steps": 112590,
    "train_batch_size": 1024,
    "eval_batch_size": 1024,
    "num_train_images": 1281167,
    "num_eval_images": 50000,
    "num_label_classes": 1000,
    "steps_per_eval": 1251,
    "eval_timeout": None,
    "skip_host_call": False,
    "iterations_per_loop": 1251,
    "num_cores": 8,
    "num_parallel_calls": 8,
    "data_format": "channels_last",
    "transpose_input": True,
    "export_dir": None,
    "export_to_tpu": False,
    "precision": "bfloat16",
    "base_learning_rate": 0.1,
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "label_smoothing": 0.0,
    "log_step_count_steps": 64,
    "enable_lars": False,
    "poly_rate": 0.0,
    "use_cache": True,
    "use_async_checkpointing": False,
    "image_size": 224,
    "profile_every_n_steps": 0,
    "bigtable_project": None,
    "bigtable_instance": None,
    "bigtable_table": "imagenet",
    "bigtable_train_prefix": "train_",
    "bigtable_eval_prefix": "validation_",
    "bigtable_column_family": "tfexample",
    "bigtable_column_qualifier": "example",
}

# docs/original.md §6 (v3 / v4 where different).
INCEPTION_COMMON = {
    "num_shards": 8,
    "iterations": 100,
    "eval_batch_size": 1024,
    "eval_total_size": 0,
    "train_steps_per_eval": 2000,
    "mode": "train_and_eval",
    "min_eval_interval": 180,
    "eval_timeout": None,
    "use_tpu": True,
    "per_host_input_for_training": True,
    "use_data": "real",
    "optimizer": "RMS",
    "num_classes": 1001,
    "width": 299,
    "height": 299,
    "transpose_enabled": False,
    "log_device_placement": False,
    "save_summary_steps": 100,
    "save_checkpoints_secs": 1000,
    "moving_average": True,
    "preprocessing": "inception",
    "learning_rate_decay": 0.94,
    "display_tensors": False,
    "clear_update_collections": True,
    "prefetch_enabled": True,
    "prefetch_dataset_buffer_size": 8 * 1024 * 1024,
    "num_files_infeed": 8,
    "num_parallel_calls": 64,
    "initial_shuffle_buffer_size": 1024,
    "followup_shuffle_buffer_size": 1000,
    "tpu": None,
    "gcp_project": None,
    "tpu_zone": None,
}
INCEPTION_DEFAULTS = {
    "inception_v3": {
        **INCEPTION_COMMON,
        "train_batch_size": 1024,
        "train_steps": 213000,
        "learning_rate": 0.165,
        "use_annotated_bbox": False,
        "learning_rate_decay_epochs": 3,
        "cold_epochs": 2,
        "warmup_epochs": 7,
        "use_learning_rate_warmup": False,
    },
    "inception_v4": {
        **INCEPTION_COMMON,
        "train_batch_size": 256,
        "train_steps": 80000,
        "learning_rate": 0.15,
        "use_annotated_bbox": True,
        "learning_rate_decay_epochs": 2,
        "cold_learning_rate": 0.001,
        "cold_epochs": 1,
        "warmup_epochs": 2,
    },
}

TPU_ONLY = {
    "resnet": [
        "--tpu=my-tpu",
        "--use_tpu=True",
        "--master=grpc://10.0.0.2:8470",
        "--gcp_project=p",
        "--tpu_zone=us-central1-b",
        "--transpose_input=True",
        "--data_format=channels_last",
        "--export_to_tpu=True",
        "--num_cores=8",
        "--skip_host_call",
        "--use_async_checkpointing",
        "--use_cache=False",
        "--profile_every_n_steps=100",
    ],
    "inception_v3": [
        "--tpu=my-tpu",
        "--use_tpu=True",
        "--master=grpc://10.0.0.2:8470",
        "--gcp_project=p",
        "--tpu_zone=us-central1-b",
        "--num_shards=8",
        "--transpose_enabled=True",
        "--per_host_input_for_training=False",
        "--log_device_placement",
        "--display_tensors",
        "--num_files_infeed=4",
    ],
}
TPU_ONLY["inception_v4"] = TPU_ONLY["inception_v3"]


def test_resnet_flag_defaults_are_the_originals():
    fv = parse("resnet", [])
    assert {k: fv[k].value for k in RESNET_DEFAULTS} == RESNET_DEFAULTS


@pytest.mark.parametrize("program", ["inception_v3", "inception_v4"])
def test_inception_flag_defaults_are_the_originals(program):
    fv = parse(program, [])
    expected = INCEPTION_DEFAULTS[program]
    assert {k: fv[k].value for k in expected} == expected


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_tpu_only_flags_are_accepted_and_explained_in_help(program):
    fv = parse(program, TPU_ONLY[program])
    assert fv.tpu == "my-tpu" and fv.master == "grpc://10.0.0.2:8470"
    # Every TPU-only flag's --help says what estimax does with it.
    for arg in TPU_ONLY[program]:
        name = arg[2:].split("=")[0]
        help_text = fv[name].help.lower()
        assert (
            "unused" in help_text
            or "replicas" in help_text
            or "asynchronous" in help_text
            or "tensorboard" in help_text
        ), (name, help_text)


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_help_lists_and_explains_the_tpu_flags(program_help, program):
    out = program_help(program).stdout  # one --help run per program, shared (conftest.py)
    for name in ("tpu", "master", "gcp_project", "tpu_zone", "use_tpu"):
        assert f"--{name}" in out or f"--[no]{name}" in out, name
    assert "Accepted for compatibility" in out
    assert "--num_cores" in out if program == "resnet" else "--num_shards" in out


def test_num_cores_maps_to_replicas_or_warns(caplog):
    n = jax.device_count()
    assert shared_flags.resolve_num_shards(1, "num_cores") == 1
    assert shared_flags.resolve_num_shards(n, "num_cores") == n
    with caplog.at_level(logging.WARNING):
        assert shared_flags.resolve_num_shards(n + 8, "num_shards") is None  # all devices
    assert f"--num_shards={n + 8}" in caplog.text and f"has {n}" in caplog.text
    with pytest.raises(ValueError, match="--num_cores=0"):
        shared_flags.resolve_num_shards(0, "num_cores")


def test_data_dir_mapping():
    assert inputs.resolve_data_dir(inputs.FAKE_DATA_DIR) == (None, "random")
    assert inputs.resolve_data_dir(inputs.FAKE_DATA_DIR + "/") == (None, "random")
    # Fake data only when asked for in so many words; '' (an unset $DATA_DIR) is refused.
    with pytest.raises(cli.UsageError, match="--data_dir is empty"):
        inputs.resolve_data_dir("")
    assert inputs.resolve_data_dir("null") == (None, "zeros")
    assert inputs.resolve_data_dir("fake") == (None, "random")
    assert inputs.resolve_data_dir("gs://b/data") == ("gs://b/data", "random")
    assert inputs.resolve_data_dir("gs://b/data", use_fake=True) == (None, "random")


def test_loop_config_rejects_bad_values():
    with pytest.raises(ValueError, match="--mode='predict'"):
        configs.LoopConfig(mode="predict", train_steps=1, steps_per_eval=1)
    with pytest.raises(ValueError, match="--train_steps=0"):
        configs.LoopConfig(mode="train", train_steps=0, steps_per_eval=1)


@pytest.mark.parametrize(
    "make,epsilon",
    [
        (lambda schedule: inception_v3.make_optimizer("RMS", schedule), 1.0),
        # EfficientNet's utils.build_optimizer: the same optimizer with epsilon 1e-3.
        (lambda s: efficientnet.make_optimizer(efficientnet.EfficientNetConfig(), s), 1e-3),
    ],
    ids=["inception", "efficientnet"],
)
def test_rmsprop_is_tf_rmsprop_with_eps_inside_sqrt_and_lr_inside_momentum(make, epsilon):
    # A learning rate that changes every step exposes where the rate is applied.
    rates = [0.5, 0.25, 0.125, 0.5, 1.0]
    schedule = lambda step: jnp.asarray(rates)[step]  # noqa: E731
    opt = make(schedule)
    w = jnp.array([1.0, -2.0, 3.0])
    state = opt.init(w)
    ms, mom, w_tf = np.ones(3), np.zeros(3), np.array(w)
    rng = np.random.default_rng(0)
    for lr in rates:
        g = rng.normal(size=3)
        updates, state = opt.update(jnp.asarray(g, jnp.float32), state, w)
        w = optax.apply_updates(w, updates)
        ms = 0.9 * ms + 0.1 * g * g
        mom = 0.9 * mom + lr * g / np.sqrt(ms + epsilon)
        w_tf = w_tf - mom
    np.testing.assert_allclose(np.asarray(w), w_tf, rtol=1e-5)


def _spec(model_fn, features, labels, mode="train", compute=True, compiler_options=None):
    """Runs a model_fn once, jitted, as the Estimator traces it (``compute=False``: traced only,
    for the spec's static fields; loss and scalars are then shapes). ``compiler_options``: XLA's
    (e.g. level 0 as tests/test_models.py: the same values, compiled several times faster).

    Returns:
      (the EstimatorSpec, whose array fields are stale tracers: read only its static fields,
      its loss [B], its scalars dict).
    """

    class Wrap(nn.Module):
        @nn.compact
        def __call__(self, x, y):
            with steps_lib.global_step_scope(jnp.zeros((), jnp.int32)):
                return model_fn(x, y, mode, {})

    captured = {}

    def run(x, y):
        rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
        spec, _ = Wrap().init_with_output(rngs, x, y)
        captured["spec"] = spec
        return spec.loss, spec.scalars

    if not compute:
        loss, scalars = jax.eval_shape(run, features, labels)
        return captured["spec"], loss, scalars
    # By default at XLA:CPU's optimisation level 0, as estimax compiles initialisers
    # (replication.run_init): the default level spends ~25 s of LLVM on the unrolled threefry
    # hashing of even ResNetTiny's initialisers; the random bits are the same.
    options = compiler_options or {"xla_backend_optimization_level": "0"}
    loss, scalars = jax.jit(run).lower(features, labels).compile(options)(features, labels)
    return captured["spec"], loss, scalars


def test_resnet_model_fn_recipe(monkeypatch):
    cfg = resnet.ResNetConfig(
        resnet_depth=18,
        num_label_classes=10,
        label_smoothing=0.1,
        train_batch_size=256,
        num_train_images=2560,
        cpu_fast_ops=False,
    )
    assert resnet.build_model(cfg).dtype == jnp.bfloat16  # --precision=bfloat16 (default)
    assert resnet.build_model(dataclasses.replace(cfg, precision="float32")).dtype == jnp.float32
    # The tiny variant stands in for ResNet-18 (same code; tests/test_models.py covers depths).
    monkeypatch.setattr(
        resnet, "resnet_v1", lambda depth, classes, **kw: ResNetTiny(num_classes=classes, **kw)
    )
    images = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3)).astype(np.uint8)
    # float32: XLA:CPU takes ~10x longer to compile the bfloat16 network.
    cfg = dataclasses.replace(cfg, precision="float32")
    spec, loss, scalars = _spec(resnet.make_model_fn(cfg), images, jnp.array([1, 2]))
    assert loss.shape == (2,)  # per-example: the Estimator averages (exact eval)
    assert spec.weight_decay == 1e-4
    assert sorted(spec.eval_metrics) == ["top_1_accuracy", "top_5_accuracy"]
    assert sorted(scalars) == ["current_epoch", "learning_rate"]
    assert float(scalars["learning_rate"]) == 0.0  # step 0 of the linear warm-up
    assert spec.ema_decay is None
    # Label smoothing 0.1 over 10 classes: the loss is at least the smoothed targets' entropy.
    targets = np.full(10, 0.01) + np.eye(10)[1] * 0.9
    assert float(loss[0]) >= -(targets * np.log(targets)).sum() - 1e-4
    no_host_call, _, _ = _spec(  # a static field: traced only
        resnet.make_model_fn(dataclasses.replace(cfg, write_scalars=False)),
        images,
        jnp.array([1, 2]),
        compute=False,
    )
    assert no_host_call.scalars is None  # --skip_host_call


class _Oracle(nn.Module):
    """Stands in for a perfectly trained network of the *original's* label convention.

    Images are filled with the file's (1-based) label; the oracle puts its largest logit at that
    index, as a network trained by the original inception_v3.py (file labels, 1001 logits) does.
    """

    num_classes: int = 1001
    dtype: object = jnp.float32
    conv: object = None  # the models' layer arguments, which build_model always passes
    max_pool: object = None

    @nn.compact
    def __call__(self, x, train):
        bias = self.param("bias", nn.initializers.zeros, ())
        k = jnp.round(jnp.mean(x, axis=(1, 2, 3))).astype(jnp.int32)
        logits = 10.0 * jax.nn.one_hot(k, self.num_classes) + bias
        return logits, logits


def test_inception_labels_are_the_files_labels_with_1001_logits(tmp_path):
    cfg = inception_v3.InceptionConfig(model=_Oracle, schedule=lambda s: 0.1, cpu_fast_ops=False)
    est = ex.Estimator(
        inception_v3.make_model_fn(cfg),
        ex.RunConfig(model_dir=str(tmp_path)),
        eval_batch_size=8,
        predict_batch_size=8,
    )
    file_labels = np.array([1, 2, 3, 1000, 17, 5, 999, 42], np.int32)
    images = np.broadcast_to(file_labels[:, None, None, None], (8, 4, 4, 3)).astype(np.float32)
    # The estimax ImageNet input hands the model file label - 1 (imagenet.label_from_example).
    input_fn = lambda params: [(images, file_labels - 1)]  # noqa: E731
    results = est.evaluate(input_fn)
    assert results["accuracy"] == 1.0 and results["accuracy@5"] == 1.0
    classes = [p["classes"] for p in est.predict(lambda params: [images])]
    assert classes == list(file_labels)  # logit index == the file's label, as the original
    est.close()


def _tiny_resnet(monkeypatch):
    monkeypatch.setattr(
        resnet, "resnet_v1", lambda depth, classes, **kw: ResNetTiny(num_classes=classes, **kw)
    )


@pytest.mark.slow
def test_resnet_train_mode_trains_to_train_steps_then_exports(tmp_path, monkeypatch):
    _tiny_resnet(monkeypatch)
    fv = parse(
        "resnet",
        [
            f"--model_dir={tmp_path / 'model'}",
            "--mode=train",
            "--train_steps=2",
            "--iterations_per_loop=1",
            "--train_batch_size=8",
            "--image_size=32",
            "--data_dir=null",
            f"--export_dir={tmp_path / 'export'}",
            "--num_cores=1",
        ],
    )
    assert resnet.run_from_flags(fv) is None  # no evaluation in --mode=train
    assert sorted(os.listdir(tmp_path / "model" / "checkpoints")) == ["2"]  # saved at the end
    exports = os.listdir(tmp_path / "export")
    assert len(exports) == 1 and os.listdir(tmp_path / "export" / exports[0])


def test_eval_mode_without_checkpoints_stops_at_eval_timeout(tmp_path):
    fv = parse(
        "resnet", [f"--model_dir={tmp_path}", "--mode=eval", "--eval_timeout=0", "--num_cores=1"]
    )
    assert resnet.run_from_flags(fv) is None


# ---------------------------------------------------------------- seed command lines


def test_seed_command_lines_are_the_ones_in_the_seeds():
    if not os.path.isdir(seed_command_lines.SEEDS_DIR):
        pytest.skip(f"seeds not at {seed_command_lines.SEEDS_DIR}")
    assert seed_command_lines.extract_commands() == seed_command_lines.SEED_COMMANDS


def _run_seed_line(command: str, model_dir: str, monkeypatch, extra: tuple[str, ...] = ()):
    """Runs one seed line in-process with the tiny variant of its network."""
    program, argv = seed_command_lines.to_estimax_argv(command, model_dir)
    fv = parse(program, [*argv, *extra])
    if program == "resnet":
        monkeypatch.setattr(
            resnet, "resnet_v1", lambda depth, classes, **kw: ResNetTiny(num_classes=classes, **kw)
        )
        return fv, resnet.run_from_flags(fv)
    variant = inception_v3.V3 if program == "inception_v3" else inception_v4.V4
    # The lines' flags, input, schedule, loops, evaluation and export are what is under test
    # here, not the network: a stand-in with Inception's outputs (logits and auxiliary logits)
    # compiles in seconds, where the tiny Inceptions took 1-2 minutes a line on CI's two cores.
    # The networks themselves are tested in tests/test_models.py.
    return fv, inception_v3.run_from_flags(
        fv, dataclasses.replace(variant, model=_InceptionStandIn)
    )


class _InceptionStandIn(nn.Module):
    """What an Inception program needs of its network: ``(logits, aux_logits)``, batch norm."""

    num_classes: int
    dtype: object = jnp.float32
    conv: object = None  # the programs' layer choices (estimax.ops): taken, not needed
    max_pool: object = None

    @nn.compact
    def __call__(self, x, train):
        x = nn.relu(nn.Conv(8, (3, 3), strides=(4, 4), dtype=self.dtype)(x))
        x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x.mean((1, 2)))
        aux = nn.Dense(self.num_classes, dtype=self.dtype, name="AuxLogits")(x)
        logits = nn.Dense(self.num_classes, dtype=self.dtype, name="Logits")(x)
        return logits.astype(jnp.float32), aux.astype(jnp.float32)


def _record_bigtable_sources(monkeypatch) -> list[str]:
    """Records ``project/instance/table/prefix`` of every Bigtable source the input opens."""
    from estimax.data import bigtable

    opened: list[str] = []
    source = bigtable.BigtableTable.source

    def spy(self, is_training):
        s = source(self, is_training)
        opened.append(f"{s.project}/{s.instance}/{s.table}/{s.prefix}")
        return s

    monkeypatch.setattr(bigtable.BigtableTable, "source", spy)
    return opened


@pytest.mark.slow
@pytest.mark.parametrize(
    "seed,command",
    seed_command_lines.SEED_COMMANDS,
    ids=[f"{s}-{i}" for i, (s, _) in enumerate(seed_command_lines.SEED_COMMANDS)],
)
def test_seed_command_line_runs(seed, command, tmp_path, monkeypatch, request):
    model_dir = str(tmp_path / "model")
    if seed_command_lines.uses_bigtable(command):
        # The ResNet README's Bigtable line reads the emulator's table, filled with fake records.
        request.getfixturevalue("bigtable_emulator")
        seed_command_lines.load_bigtable(str(tmp_path))
    sources = _record_bigtable_sources(monkeypatch)
    fv, results = _run_seed_line(command, model_dir, monkeypatch)
    # The Bigtable line read both splits from the table, the others never touched Bigtable.
    assert set(sources) == (
        {"my-project/my-instance/imagenet/train_", "my-project/my-instance/imagenet/validation_"}
        if seed_command_lines.uses_bigtable(command)
        else set()
    )
    metrics = (
        ("top_1_accuracy", "top_5_accuracy") if "resnet" in command else ("accuracy", "accuracy@5")
    )
    assert results["global_step"] == 2
    assert all(m in results for m in metrics)
    eval_images = 16 if "resnet" in command else 8
    assert results["num_examples"] == eval_images
    assert os.path.isdir(os.path.join(fv.model_dir, "checkpoints", "2"))
    assert os.path.isdir(os.path.join(fv.model_dir, "eval"))
    if seed == "004":
        # Reusing model_dir resumes: one more step (train_and_eval) starts at step 2.
        _, results = _run_seed_line(command, model_dir, monkeypatch, ("--train_steps=3",))
        assert results["global_step"] == 3


# ---------------------------------------------------------------- digits, two processes


def test_digits_imagenet_writes_the_converters_records(tmp_path):
    from estimax.data import example, imagenet, jpeg, tfrecord
    from estimax.tools import digits_imagenet

    rng = np.random.default_rng(0)
    digits = np.zeros((5, 28, 28), np.uint8)
    digits[:, 4:24, 4:24] = rng.integers(100, 256, (5, 20, 20))
    labels = np.array([0, 9, 3, 3, 7])
    paths = digits_imagenet.write_split(
        str(tmp_path), "validation", digits.reshape(5, 784), labels, num_shards=2
    )
    assert [os.path.basename(p) for p in paths] == [
        "validation-00000-of-00002",
        "validation-00001-of-00002",
    ]
    records = [r for p in paths for r in tfrecord.read_records(p)]
    parsed = [example.parse_example(r, imagenet.IMAGENET_SCHEMA) for r in records]
    # Round-robin over the shards: records 0, 2, 4 in the first file, 1, 3 in the second.
    order = [0, 2, 4, 1, 3]
    assert [int(p["image/class/label"]) for p in parsed] == [labels[i] + 1 for i in order]
    assert {
        (
            int(p["image/height"]),
            int(p["image/width"]),
            int(p["image/channels"]),
            p["image/colorspace"],
            p["image/format"],
        )
        for p in parsed
    } == {(44, 44, 3, b"RGB", b"JPEG")}
    image = jpeg.decode(parsed[0]["image/encoded"])
    assert image.shape == (44, 44, 3)
    # The digit sits in the centre of a black canvas (JPEG is lossy: compare loosely).
    assert np.abs(image[8:36, 8:36, 0].astype(int) - digits[0]).mean() < 8
    assert image[:6].max() < 16 and image[:, :6].max() < 16
    # Through the ImageNet input, as the resnet program reads them: labels back to 0..9.
    loader = imagenet.input_fn(str(tmp_path), False, image_size=32, num_classes=10)
    got = np.concatenate([y for _, y in loader({"batch_size": 8})])
    assert list(got) == [labels[i] for i in order]


@pytest.mark.slow
def test_resnet_digits_train_and_a_second_eval_process(tmp_path):
    """`resnet --resnet_depth=18 --image_size=32` on real digits in the ImageNet layout, with a
    second process in --mode=eval following its checkpoints (scripts/resnet_digits.sh is the
    full-accuracy run). The two processes, not the network, are under test: both run the tests'
    tiny ResNet (tests/tiny_resnet_shim.py)."""
    from estimax.tools import digits_imagenet, mnist_data

    (train_x, train_y), (eval_x, eval_y) = mnist_data.split(*mnist_data.load_mnist_5k())
    data = str(tmp_path / "data")
    digits_imagenet.write_split(data, "train", train_x[:128], train_y[:128], 2)
    digits_imagenet.write_split(data, "validation", eval_x[:40], eval_y[:40], 2)
    common_flags = [
        f"--data_dir={data}",
        f"--model_dir={tmp_path / 'model'}",
        "--resnet_depth=18",
        "--image_size=32",
        "--num_label_classes=10",
        "--num_train_images=128",
        "--num_eval_images=40",
        "--train_batch_size=16",
        "--eval_batch_size=16",
        "--train_steps=4",
        "--iterations_per_loop=2",
        "--save_checkpoints_steps=2",
        "--precision=float32",
    ]
    shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_resnet_shim.py")
    cmd = [sys.executable, shim, "resnet", *common_flags]
    env = dict(os.environ)
    train = subprocess.Popen(
        [*cmd, "--mode=train"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    evaluator = subprocess.run(
        [*cmd, "--mode=eval", "--eval_timeout=600"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    train_out, _ = train.communicate(timeout=900)
    assert train.returncode == 0, train_out[-3000:]
    assert evaluator.returncode == 0, evaluator.stderr[-3000:]
    assert "Saving checkpoints for 4" in train_out
    assert "Evaluation finished after training step 4" in evaluator.stderr
    # Each evaluation counts all 40 held-out digits once (3 batches of 16, the last padded).
    assert "Eval results at step 4:" in evaluator.stdout
    assert "on 40 images" in evaluator.stdout


def test_manifest_class_names_follow_the_label_offset_and_the_models_classes(tmp_path, caplog):
    from estimax.tools.convert_shards import MANIFEST_FORMAT, MANIFEST_NAME

    manifest = {"format": MANIFEST_FORMAT, "label_map": {"ant": 1, "bee": 2, "cat": 3}}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    # ResNet/EfficientNet: the model sees label - 1; unnamed ids are "".
    assert exports.manifest_class_names(str(tmp_path), 1, 5) == ["ant", "bee", "cat", "", ""]
    # Inception: id = label, id 0 the background logit.
    assert exports.manifest_class_names(str(tmp_path), 0, 4) == ["", "ant", "bee", "cat"]
    # Names that cannot be this model's: exported without them, and the log says why.
    assert exports.manifest_class_names(str(tmp_path), 1, 2) is None
    assert "gives class 'cat' the label 3, outside the model's 2 classes" in caplog.text
    assert exports.manifest_class_names(str(tmp_path / "other"), 1, 5) is None  # no manifest
    assert exports.manifest_class_names(None, 1, 5) is None  # fake data


@pytest.mark.parametrize("label", [10**12, -(10**12), 0])
def test_a_manifest_label_outside_the_models_classes_stops_the_program_before_training(
    tmp_path, monkeypatch, label
):
    """Issue #42 item 14: a label of 10**12 was a MemoryError at the export, after training,
    and nothing was published. The manifest is read when the job is built: one line."""
    from estimax.tools.convert_shards import MANIFEST_FORMAT, MANIFEST_NAME

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for split in ("train", "validation"):
        (data_dir / f"{split}-00000-of-00001").write_bytes(b"")
    manifest = {"format": MANIFEST_FORMAT, "label_map": {"ant": 1, "bee": label}}
    (data_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    _tiny_resnet(monkeypatch)
    fv = parse(
        "resnet",
        [
            f"--model_dir={tmp_path / 'model'}",
            "--mode=train",
            "--train_steps=2",
            f"--data_dir={data_dir}",
            f"--export_dir={tmp_path / 'export'}",
            "--num_label_classes=10",
            "--num_cores=1",
        ],
    )
    with pytest.raises(cli.UsageError) as e:
        resnet.run_from_flags(fv)
    assert f"gives class 'bee' the label {label}, outside the model's 10 classes" in str(e.value)
    assert "(labels 1..10)" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "model" / "checkpoints").exists()


def test_a_damaged_manifest_exports_without_names_and_allocates_nothing_by_its_labels(
    tmp_path, caplog
):
    from estimax.tools.convert_shards import MANIFEST_FORMAT, MANIFEST_NAME

    path = tmp_path / MANIFEST_NAME
    for content in (
        json.dumps({"format": MANIFEST_FORMAT, "label_map": {"a": 1, "b": 10**12}}),
        json.dumps({"format": MANIFEST_FORMAT, "label_map": {"a": 1, "b": "2"}}),
        json.dumps({"format": MANIFEST_FORMAT, "label_map": {"a": 1, "b": True}}),
        json.dumps({"format": MANIFEST_FORMAT, "label_map": {"a": 1, "b": 1}}),
        '{"label_map": ' * 100_000 + "{}" + "}" * 100_000,
    ):
        path.write_text(content)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert exports.manifest_class_names(str(tmp_path), 1, 1000) is None
        assert "Exporting without class names" in caplog.text
