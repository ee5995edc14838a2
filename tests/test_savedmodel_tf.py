"""`estimax export-savedmodel` for every export kind: arrays, a declared image_preprocessing and
a ResNet recipe, each loaded with tf.saved_model.load and run to estimax's classes; the TF
preprocessing's pixels equal estimax's for every method and grid it accepts.

Needs TensorFlow: `make test` runs this file in .venv-tf (the ``estimax[tf]`` extra); in the
default venv it is skipped.
"""

import os
import sys

import numpy as np
import pytest

if os.environ.get("ESTIMAX_REQUIRE_TF"):  # `make test` runs this in .venv-tf
    import tensorflow  # noqa: F401
tf = pytest.importorskip(
    "tensorflow", reason="TensorFlow runs in its own venv (`make test` builds .venv-tf)"
)

sys.path.insert(0, os.path.dirname(__file__))
import export_formats_fixtures as fx  # noqa: E402
import serving_fixtures  # noqa: E402

from estimax import command, export  # noqa: E402
from estimax.export.formats import tf_preprocess  # noqa: E402
from estimax.export.servable import Servable  # noqa: E402


@pytest.fixture(scope="module")
def jpegs():
    return serving_fixtures.make_jpegs(24)


@pytest.fixture(scope="module")
def float_version(tmp_path_factory):
    """``fx.float_export``'s version, trained once for the module; a test that changes it copies
    it first."""
    return fx.float_export(str(tmp_path_factory.mktemp("float_export")))


def _export(tmp_path, version):
    base = os.path.dirname(version)
    out = str(tmp_path / "not" / "yet" / "savedmodel")  # missing parents are created
    assert (
        command.main(["export-savedmodel", f"--model_base_path={base}", f"--output_dir={out}"]) == 0
    )
    return tf.saved_model.load(out).signatures["serving_default"]


def test_float_array_export_to_savedmodel(tmp_path, float_version):
    version = float_version
    fn = _export(tmp_path, version)
    spec = fn.structured_input_signature[1]["input"]
    assert spec.dtype == tf.float32 and spec.shape.as_list() == [None, 12]
    x = np.random.default_rng(5).normal(size=(5, 12)).astype(np.float32)
    out = fn(input=tf.constant(x))
    want = Servable(version).run({"input": x})
    assert out["classes"].dtype == tf.int64
    np.testing.assert_array_equal(out["classes"].numpy(), want["classes"])
    np.testing.assert_allclose(out["probabilities"].numpy(), want["probabilities"], atol=1e-5)
    np.testing.assert_array_equal(out["top_k_classes"].numpy(), want["top_k_classes"])


def test_image_preprocessing_export_to_savedmodel(tmp_path, jpegs):
    images, labels = jpegs
    version = fx.image_export(str(tmp_path), images, labels)
    fn = _export(tmp_path, version)
    assert list(fn.structured_input_signature[1]) == ["image_bytes"]
    out = fn(image_bytes=tf.constant(images))
    want = Servable(version).predict_images(images)
    np.testing.assert_array_equal(out["classes"].numpy(), want["classes"])
    assert np.abs(out["probabilities"].numpy() - want["probabilities"]).max() <= 1e-5


def test_resnet_export_keeps_the_originals_input_key(tmp_path, jpegs):
    images, labels = jpegs
    version = fx.resnet_export(str(tmp_path), images, labels)
    fn = _export(tmp_path, version)
    assert list(fn.structured_input_signature[1]) == ["input"]
    assert fn.structured_input_signature[1]["input"].dtype == tf.string
    out = fn(input=tf.constant(images))
    want = Servable(version).predict_images(images)
    np.testing.assert_array_equal(out["classes"].numpy(), want["classes"])
    assert np.abs(out["probabilities"].numpy() - want["probabilities"]).max() <= 1e-5


def _varied_images():
    """JPEGs and PNGs of many sizes (smaller and larger than the outputs), noisy and smooth."""
    import cv2
    import simplejpeg

    rng = np.random.default_rng(3)
    out = []
    for i in range(10):
        h, w = int(rng.integers(7, 120)), int(rng.integers(7, 120))
        yy, xx = np.mgrid[0:h, 0:w]
        smooth = np.stack([xx * 2 + yy, 128 + 100 * np.sin(xx / 5.0), yy * 3], -1)
        pixels = np.clip(smooth + rng.normal(0, 40 if i % 2 else 5, (h, w, 3)), 0, 255)
        pixels = pixels.astype(np.uint8)
        if i % 3 == 0:
            out.append(cv2.imencode(".png", pixels[..., ::-1])[1].tobytes())
        else:
            out.append(simplejpeg.encode_jpeg(pixels, quality=85, colorspace="RGB"))
    return out


EXACT = [
    dict(size=24, resize="bilinear"),
    dict(size=40, resize="bilinear", crop="center", crop_fraction=0.5, channels="bgr"),
    dict(size=(20, 31), resize="bilinear", crop="center", crop_fraction=1.0, channels="gray"),
    dict(size=13, resize="nearest", grid="half_pixel", scale=1 / 255, offset=-0.5),
    dict(size=(9, 50), resize="nearest", grid="align_corners", mean=[1, 2, 3], stddev=[4, 5, 6]),
    dict(size=30, resize="nearest", grid="asymmetric", dtype="uint8", channels="gray"),
]
# OpenCV's bicubic is fixed-point: TF's float64 version rounds one level apart on rare values
# (the export's own check images decide: a SavedModel whose pixels differ there is refused).
BICUBIC = [
    dict(size=17, resize="bicubic", crop="central", crop_fraction=0.875, dtype="uint8"),
    dict(size=32, crop="center", crop_padding=32, resize="bicubic", dtype="uint8"),
]


def _compare_pixels(params):
    pre = (
        params if isinstance(params, export.Preprocessing) else export.image_preprocessing(**params)
    )
    fn = tf.function(tf_preprocess.preprocess_fn(pre))
    worst, differ, total = 0.0, 0, 0
    for image in _varied_images():
        got, want = fn(tf.constant(image)).numpy(), pre(image)
        assert got.dtype == want.dtype and got.shape == want.shape
        diff = np.abs(got.astype(np.float64) - want)
        if want.dtype != np.uint8:  # float32 scaling: within float32 rounding
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            diff = np.zeros_like(diff)
        worst, differ, total = max(worst, diff.max()), differ + (diff > 0).sum(), total + diff.size
    return worst, differ, total


def _id(params):
    if isinstance(params, export.Preprocessing):
        return f"{params.name}-{params.params}"
    return "-".join(map(str, params.values()))


@pytest.mark.parametrize("params", EXACT, ids=_id)
def test_tf_preprocessing_gives_estimaxs_pixels(params):
    assert _compare_pixels(params)[:2] == (0, 0)


def test_estimaxs_inception_recipe_gives_estimaxs_pixels_in_tf():
    assert _compare_pixels(export.inception_eval(29))[:2] == (0, 0)


@pytest.mark.parametrize("params", [*BICUBIC, export.resnet_eval(32)], ids=_id)
def test_tf_bicubic_is_at_most_one_level_apart_on_rare_values(params):
    worst, differ, total = _compare_pixels(params)
    print(f"bicubic {params}: {differ} of {total} values one level apart")
    assert worst <= 1 and differ <= 0.005 * total


@pytest.mark.parametrize(
    "params, named",
    [
        (dict(resize="area"), "resize='area'"),
        (dict(resize="bilinear", grid="align_corners"), "grid='align_corners'"),
        (dict(resize="bicubic", grid="asymmetric"), "grid='asymmetric'"),
        (dict(resize="bilinear", antialias=True), "antialias=True"),
        (dict(resize_shorter=36), "resize_shorter"),
    ],
)
def test_what_tf_cannot_reproduce_is_named(params, named):
    assert named in tf_preprocess.unsupported(export.image_preprocessing(size=8, **params))


def test_an_export_tf_cannot_reproduce_is_refused_in_one_line(tmp_path, capsys, jpegs):
    images, labels = jpegs
    pre = export.image_preprocessing(size=24, resize="area")
    version = fx._publish(
        str(tmp_path),
        fx._model_fn(fx.SmallCnn, lambda f: f),
        np.stack([pre(b) for b in images]),
        labels,
        preprocessing=pre,
        check_inputs=images[:4],
    )
    out = str(tmp_path / "out")
    base = os.path.dirname(version)
    assert (
        command.main(["export-savedmodel", f"--model_base_path={base}", f"--output_dir={out}"]) == 2
    )
    err = capsys.readouterr().err
    assert "resize='area'" in err and "serve this export with estimax" in err
    assert len(err.strip().splitlines()) == 1 and not os.path.exists(out)


def test_a_disagreement_publishes_nothing(tmp_path, capsys, monkeypatch, float_version):
    import shutil

    version = str(tmp_path / "serving" / "1")  # a copy: its check is edited below
    shutil.copytree(float_version, version)
    # The former command path still works: python -m estimax.export.formats.savedmodel (run as
    # __main__ in this process: the module's entry is what is checked, not a new interpreter).
    import runpy
    import warnings

    argv = [f"--export_dir={version}", f"--output_dir={tmp_path / 'alias'}"]
    monkeypatch.setattr(sys, "argv", ["savedmodel", *argv])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as done:
        warnings.simplefilter("ignore", RuntimeWarning)  # "found in sys.modules": it is, here
        runpy.run_module("estimax.export.formats.savedmodel", run_name="__main__")
    assert done.value.code == 0, capsys.readouterr().err[-2000:]
    assert tf.saved_model.load(str(tmp_path / "alias")).signatures["serving_default"] is not None
    capsys.readouterr()

    from estimax.export.formats import savedmodel

    fx.disagree(version)
    refused = str(tmp_path / "refused")
    assert savedmodel.main([f"--export_dir={version}", f"--output_dir={refused}"]) == 2
    err = capsys.readouterr().err
    assert "classes differ from estimax's for 1 of 16" in err and "Traceback" not in err
    assert not os.path.exists(refused)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".savedmodel-")]


def _assert_answers_the_stored_check(fn, version, dtypes):
    # The number: within 1e-5 (fp32) of estimax's recorded answers on the check inputs.
    check, expected = fx.stored_check(version, dtypes)
    out = fn(**{k: tf.constant(v) for k, v in check.items()})
    np.testing.assert_array_equal(out["classes"].numpy(), expected["classes"])
    assert np.abs(out["probabilities"].numpy() - expected["probabilities"]).max() <= 1e-5


def test_text_model_with_three_int32_inputs_to_savedmodel(tmp_path):
    version = fx.text_export(str(tmp_path))
    fn = _export(tmp_path, version)
    specs = fn.structured_input_signature[1]
    assert sorted(specs) == sorted(fx.TEXT_INPUTS)
    assert all(s.dtype == tf.int32 and s.shape.as_list() == [None, fx.SEQ] for s in specs.values())
    _assert_answers_the_stored_check(fn, version, {k: np.int32 for k in fx.TEXT_INPUTS})
    features = fx.text_features(5, seed=4)  # new examples, another batch size
    out = fn(**{k: tf.constant(v) for k, v in features.items()})
    want = Servable(version).run(features)
    np.testing.assert_array_equal(out["classes"].numpy(), want["classes"])
    diff = np.abs(out["probabilities"].numpy() - want["probabilities"]).max()
    print(f"SavedModel vs estimax, tiny BERT: max dprob {diff:.2e}")
    assert diff <= 1e-5


def test_mixed_dtype_inputs_to_savedmodel(tmp_path):
    # float32 pixels, int64 ids (computed in int32: cast inside) and a bool mask.
    version = fx.mixed_export(str(tmp_path))
    fn = _export(tmp_path, version)
    specs = fn.structured_input_signature[1]
    assert {k: (s.dtype, s.shape.as_list()) for k, s in specs.items()} == {
        "image": (tf.float32, [None, 6, 6, 3]),
        "ids": (tf.int64, [None, 5]),
        "mask": (tf.bool, [None, 5]),
    }
    _assert_answers_the_stored_check(fn, version, {k: d for k, (_, d) in fx.MIXED_INPUTS.items()})
    features = fx.mixed_features(5, seed=7)
    out = fn(**{k: tf.constant(v) for k, v in features.items()})
    want = Servable(version).run(features)
    np.testing.assert_array_equal(out["classes"].numpy(), want["classes"])
    assert np.abs(out["probabilities"].numpy() - want["probabilities"]).max() <= 1e-5


def test_the_bert_example_export_to_savedmodel(tmp_path):
    # examples/bert_classifier.py's flow (warm start from TF's bert_tiny, train, export with
    # three int32 inputs), then its version as a SavedModel that TensorFlow runs.
    import contextlib
    import io

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(repo, "examples"))
    import bert_classifier as bert

    with contextlib.redirect_stdout(io.StringIO()):
        code = bert.main(
            [
                f"--init_checkpoint={repo}/tests/data/tf_checkpoints/bert_tiny",
                f"--output_dir={tmp_path}/model",
                "--do_train",
                "--num_train_steps=1",
                f"--export_dir={tmp_path}/serving",
            ]
        )
    assert code == 0
    version = str(tmp_path / "serving" / "1")
    fn = _export(tmp_path, version)
    specs = fn.structured_input_signature[1]
    assert sorted(specs) == sorted(bert.FEATURE_NAMES)
    made = bert.synthetic_features(6, 8, bert.BertConfig().vocab_size, seed=5)
    features = {k: np.asarray([f[k] for f in made], np.int32) for k in bert.FEATURE_NAMES}
    out = fn(**{k: tf.constant(v) for k, v in features.items()})
    want = Servable(version).run(features)
    diff = np.abs(out["probabilities"].numpy() - want["probabilities"]).max()
    print(f"SavedModel vs estimax, the BERT example: max dprob {diff:.2e}")
    assert diff <= 1e-5
