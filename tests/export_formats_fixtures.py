"""Three kinds of estimax export, for the SavedModel and ONNX writers' tests: a float-array
model (a custom Flax MLP), a CNN behind a declared ``image_preprocessing``, and a ResNet with the
``resnet_eval`` recipe. Each is published with check inputs (``export_check.json``)."""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import serving_fixtures

import estimax as ex
from estimax import serving
from estimax.data import preprocessing
from estimax.models import get_model

CLASSES = 3
CUSTOM_PREPROCESSING = dict(
    size=24,
    crop="center",
    crop_fraction=0.9,
    resize="bilinear",
    channels="bgr",
    mean=[120.0, 110.0, 100.0],
    stddev=[60.0, 58.0, 57.0],
)


class Mlp(nn.Module):
    """A custom Flax model: dense, layer norm, GELU, a slice, tanh and sigmoid."""

    @nn.compact
    def __call__(self, x, train=False):
        h = nn.gelu(nn.LayerNorm()(nn.Dense(32)(x)))
        h = jnp.tanh(nn.Dense(16)(h)) + jax.nn.sigmoid(h[:, :16])
        return nn.Dense(CLASSES)(h)


class SmallCnn(nn.Module):
    """Conv, max-pool, average-pool, dense: a custom image model."""

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(8, (3, 3), strides=(2, 2))(x)), (3, 3), padding="SAME")
        return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))


def _model_fn(make, prepare):
    def model_fn(features, labels, mode, params):
        logits = make()(prepare(features), train=mode == ex.ModeKeys.TRAIN).astype(jnp.float32)
        return serving_fixtures.classify_spec(logits, labels, mode)

    return model_fn


def _publish(root, model_fn, features, labels, **export):
    est = ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=os.path.join(root, "model"), num_shards=1),
        train_batch_size=8,
        predict_batch_size=8,
    )
    est.train(ex.numpy_input_fn(features, labels, num_epochs=None), max_steps=3)
    version = serving.export_version(est, os.path.join(root, "serving"), **export)
    est.close()
    return version


def float_export(root):
    """A float32 [N, 12] -> classes export; returns its version directory."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 12)).astype(np.float32)
    return _publish(
        root,
        _model_fn(Mlp, lambda f: f),
        x,
        rng.integers(0, CLASSES, 24).astype(np.int32),
        serving_input=ex.TensorSpec((None, 12), np.float32),
        check_inputs=x[:16],
        top_k=2,
    )


def image_export(root, images, labels):
    """SmallCnn behind CUSTOM_PREPROCESSING (JPEG in, float32 [24, 24, 3] to the model)."""
    pre = serving.image_preprocessing(**CUSTOM_PREPROCESSING)
    pixels = np.stack([pre(b) for b in images])
    return _publish(
        root,
        _model_fn(SmallCnn, lambda f: f),
        pixels,
        labels,
        preprocessing=pre,
        check_inputs=images[:16],
    )


def resnet_export(root, images, labels):
    """A float32 resnet_tiny behind the resnet_eval(32) recipe (uint8 to the model)."""
    pixels = np.stack([preprocessing.resnet_preprocess(b, False, 32) for b in images])
    return _publish(
        root,
        _model_fn(
            lambda: get_model("resnet_tiny", num_classes=CLASSES),
            lambda f: preprocessing.normalize(f, jnp),
        ),
        pixels,
        labels,
        preprocessing=serving.resnet_eval(32),
        check_inputs=images[:16],
    )


def disagree(version):
    """Edits the version's recorded answers: check example #0 now expects another class."""
    path = os.path.join(version, "export_check.json")
    with open(path) as f:
        record = json.load(f)
    record["expected"]["classes"][0] = (record["expected"]["classes"][0] + 1) % CLASSES
    with open(path, "w") as f:
        json.dump(record, f)
