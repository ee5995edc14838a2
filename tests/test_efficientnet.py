"""The ``efficientnet`` program: the original EfficientNet main.py's flags and recipe, and its
command line trained, exported and served end to end.

Expected values come from tensorflow/tpu ``models/official/efficientnet/main.py`` (2019-06):
its flag definitions and ``model_fn`` (EMA 0.9999, weight decay 1e-5, label smoothing 0.1,
``utils.build_optimizer`` RMSProp). The schedule and the optimizer's update rule are checked in
test_schedules.py and test_programs.py, the network in test_models.py.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import serving_fixtures as fx  # tests/ is on the path, as for the helpers below
from absl import flags
from test_cli import fatal_line, run_program
from test_programs import RESNET_DEFAULTS, _spec

from estimax.data import preprocessing
from estimax.programs import cli, efficientnet, families

# XLA's level 0 (as tests/test_models.py): the same values, compiled several times faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# The same for the program's and the server's processes, on their one device: a run compiles
# its train, eval, predict and serving programs, and most of its time went to LLVM.
FAST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

# main.py's flags (2019-06) and their defaults; the TPU and location flags are resnet_main.py's.
ORIGINAL_DEFAULTS = {
    **{k: RESNET_DEFAULTS[k] for k in ("use_tpu", "tpu", "gcp_project", "tpu_zone", "data_dir")},
    "model_dir": None,
    "model_name": "efficientnet-b0",
    "mode": "train_and_eval",
    "train_steps": 218949,
    "input_image_size": None,
    "train_batch_size": 2048,
    "eval_batch_size": 1024,
    "num_train_images": 1281167,
    "num_eval_images": 50000,
    "steps_per_eval": 6255,
    "eval_timeout": None,
    "skip_host_call": False,
    "iterations_per_loop": 1251,
    "num_parallel_calls": 64,
    "data_format": "channels_last",
    "num_label_classes": 1000,
    "batch_norm_momentum": None,
    "batch_norm_epsilon": None,
    "transpose_input": True,
    "use_bfloat16": False,
    "export_dir": None,
    "export_to_tpu": False,
    "base_learning_rate": 0.016,
    "momentum": 0.9,
    "moving_average_decay": 0.9999,
    "weight_decay": 1e-5,
    "label_smoothing": 0.1,
    "dropout_rate": None,
    "drop_connect_rate": None,
    "log_step_count_steps": 64,
    "use_cache": True,
    "depth_coefficient": None,
    "width_coefficient": None,
    "use_async_checkpointing": False,
}


def parse(argv: list[str]) -> flags.FlagValues:
    return efficientnet.FAMILY.parse(argv)


def test_flag_defaults_are_the_originals():
    fv = parse([])
    assert {k: fv[k].value for k in ORIGINAL_DEFAULTS} == ORIGINAL_DEFAULTS
    assert fv.precision == "float32"  # the original's --use_bfloat16=False
    assert efficientnet.image_size(fv) == 224
    assert efficientnet.image_size(parse(["--model_name=efficientnet-b7"])) == 600
    assert efficientnet.image_size(parse(["--input_image_size=64"])) == 64
    for name in ("tpu", "data_format", "transpose_input", "export_to_tpu", "use_cache"):
        assert "unused" in fv[name].help.lower() or "tpu" in fv[name].help.lower(), name


def test_the_family_is_registered_and_records_the_model_shaping_flags():
    assert families.get("efficientnet") is efficientnet.FAMILY
    fv = parse(["--model_name=efficientnet-b1", "--width_coefficient=0.5"])
    assert efficientnet.FAMILY.recorded_flags(fv) == {
        "model_name": "efficientnet-b1",
        "num_label_classes": 1000,
        "width_coefficient": 0.5,
        "depth_coefficient": None,
    }
    features = efficientnet.FAMILY.example_features(fv)
    assert features.shape == (1, 240, 240, 3) and features.dtype == np.uint8  # b1's resolution
    assert efficientnet.FAMILY.tf_names is None  # no TF checkpoint conversion (yet)


def test_config_follows_the_flags_and_the_overrides_shape_the_network():
    cfg = efficientnet.config_from_flags(
        parse(["--use_bfloat16", "--width_coefficient=0.5", "--dropout_rate=0", "--momentum=0.5"])
    )
    assert cfg.precision == "bfloat16" and cfg.momentum == 0.5
    model = efficientnet.build_model(cfg)
    assert (model.width_coefficient, model.depth_coefficient) == (0.5, 1.0)  # b0's depth kept
    assert model.dropout_rate == 0.0 and model.dtype == jnp.bfloat16
    assert model.num_classes == 1000
    # Unset overrides keep the variant's values (b2: width 1.1, dropout 0.3).
    b2 = efficientnet.build_model(
        efficientnet.config_from_flags(parse(["--model_name=efficientnet-b2"]))
    )
    assert (b2.width_coefficient, b2.dropout_rate, b2.bn_momentum, b2.bn_epsilon) == (
        1.1,
        0.3,
        0.99,
        1e-3,
    )
    with pytest.raises(cli.UsageError, match="--use_bfloat16 with --precision=float32"):
        efficientnet.config_from_flags(parse(["--use_bfloat16", "--precision=float32"]))


def test_model_fn_recipe():
    cfg = efficientnet.EfficientNetConfig(
        model_name="efficientnet-tiny",
        num_label_classes=10,
        train_batch_size=256,
        num_train_images=2560,
        cpu_fast_ops=False,
    )
    images = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3)).astype(np.uint8)
    spec, loss, scalars = _spec(
        efficientnet.make_model_fn(cfg), images, jnp.array([1, 2]), compiler_options=FAST_COMPILE
    )
    assert loss.shape == (2,)
    assert spec.weight_decay == 1e-5 and spec.ema_decay == 0.9999
    assert sorted(spec.eval_metrics) == ["top_1_accuracy", "top_5_accuracy"]
    assert sorted(scalars) == ["current_epoch", "learning_rate"]
    assert float(scalars["learning_rate"]) == 0.0  # step 0 of the warm-up
    # Label smoothing 0.1 over 10 classes: the loss is at least the smoothed targets' entropy.
    targets = np.full(10, 0.01) + np.eye(10)[1] * 0.9
    assert float(loss[0]) >= -(targets * np.log(targets)).sum() - 1e-4
    no_ema, _, no_scalars = _spec(
        efficientnet.make_model_fn(
            dataclasses.replace(cfg, moving_average_decay=0.0, write_scalars=False)
        ),
        images,
        jnp.array([1, 2]),
        compute=False,
    )
    assert no_ema.ema_decay is None and not no_scalars  # --moving_average_decay=0, --skip_host_call


def test_declared_serving_preprocessing_is_the_eval_input_bit_for_bit():
    images, _ = fx.make_jpegs(12)  # 40..90 px, so both crop branches and odd sizes occur
    for size in (32, 64):
        served = efficientnet.serving_preprocessing(parse([f"--input_image_size={size}"]))
        for jpeg in images:
            want = preprocessing.resnet_preprocess(jpeg, is_training=False, image_size=size)
            got = served(jpeg)
            assert got.dtype == np.uint8 and got.shape == (size, size, 3)
            np.testing.assert_array_equal(got, want)


CLASSES = ("ant", "bee", "cat", "dog")


def _write_data(root: str) -> str:
    """Digit-like JPEGs in class folders (4 classes: 16 train, 8 validation), converted by
    ``estimax-convert folder`` into the ImageNet layout with its manifest."""
    from estimax.tools import convert, digits_imagenet

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (24, 784)).astype(np.uint8)
    for i, image in enumerate(pixels):
        split = "train" if i < 16 else "validation"
        folder = os.path.join(root, "photos", split, CLASSES[i % len(CLASSES)])
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{i}.jpg"), "wb") as f:
            f.write(digits_imagenet.digit_jpeg(image, 44))
    data = os.path.join(root, "data")
    photos = os.path.join(root, "photos")
    command = ["folder", f"--train_dir={photos}/train", f"--validation_dir={photos}/validation"]
    command += [
        "--train_shards=2",
        "--validation_shards=1",
        f"--output_dir={data}",
        "--no_progress",
    ]
    assert convert.main(command) == 0
    return data


def test_command_line_trains_exports_and_the_export_serves(tmp_path):
    requests = pytest.importorskip("requests")
    data = _write_data(str(tmp_path))
    export_dir = tmp_path / "export"
    # One device: the run compiles once and stays fast; replication is tested elsewhere.
    proc = run_program(
        "efficientnet",
        "--model_name=efficientnet-tiny",
        f"--data_dir={data}",
        f"--model_dir={tmp_path / 'model'}",
        f"--export_dir={export_dir}",
        "--mode=train_and_eval",
        "--train_steps=2",
        "--steps_per_eval=2",
        "--iterations_per_loop=1",
        "--train_batch_size=8",
        "--eval_batch_size=8",
        "--num_train_images=16",
        "--num_eval_images=8",
        "--num_label_classes=10",
        cwd=tmp_path,
        env={"XLA_FLAGS": FAST_XLA_FLAGS},
        timeout=600,  # a loaded 2-core machine (the vit program's run below allows as long)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Eval results at step 2: top_1_accuracy = " in proc.stdout
    assert "on 8 images" in proc.stdout
    assert sorted(os.listdir(tmp_path / "model" / "checkpoints")) == ["2"]
    version = export_dir / "1"
    # The export declares its preprocessing as data (the eval input's: crop 32, bicubic, uint8);
    # the program checked it against the input pipeline's and Estimator.predict first.
    declared = json.loads((version / "serving.json").read_text())["preprocessing"]
    assert declared["name"] == "image" and declared["params"]["size"] == 32
    assert (declared["params"]["crop_padding"], declared["params"]["resize"]) == (32, "bicubic")
    check = json.loads((version / "export_check.json").read_text())
    assert len(check["inputs"]) == 8  # the validation images
    images = [base64.b64decode(x["b64"]) for x in check["inputs"]]
    serve = [f"--model_base_path={export_dir}", "--model_name=efficientnet"]
    with fx.running_server(serve, env={"XLA_FLAGS": FAST_XLA_FLAGS}) as (url, _):
        r = requests.post(
            f"{url}/v1/models/efficientnet:predict",
            json={"instances": [{"b64": base64.b64encode(b).decode()} for b in images]},
        )
    assert r.status_code == 200, r.text
    predictions = r.json()["predictions"]
    # Served over REST == the trained Estimator's predict on the eval-preprocessed images.
    expected = check["expected"]
    assert [p["classes"] for p in predictions] == expected["classes"]
    # The converter's class names travel with the export: the model's 10 ids, the 4 classes the
    # folders named (label - 1, as the input hands them to the model), the rest unnamed.
    names = [*CLASSES, *[""] * 6]
    assert [p["class_names"] for p in predictions] == [names[c] for c in expected["classes"]]
    np.testing.assert_allclose(
        [p["probabilities"] for p in predictions],
        expected["probabilities"],
        rtol=check["rtol"],
        atol=check["atol"],
    )


def test_unknown_model_name_is_one_fatal_line_naming_the_valid_ones(tmp_path):
    proc = run_program(
        "efficientnet",
        "--model_name=efficientnet-b9",
        f"--model_dir={tmp_path / 'model'}",
        "--data_dir=fake",
        cwd=tmp_path,
    )
    assert fatal_line(proc) == (
        "FATAL: --model_name='efficientnet-b9' is not an EfficientNet: use one of "
        "efficientnet-b0, efficientnet-b1, efficientnet-b2, efficientnet-b3, efficientnet-b4, "
        "efficientnet-b5, efficientnet-b6, efficientnet-b7, efficientnet-tiny."
    )
    assert not os.path.exists(tmp_path / "model")  # stopped before anything was written
