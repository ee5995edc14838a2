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
from estimax import export
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


def _publish(root, model_fn, features, labels, **options):
    est = ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=os.path.join(root, "model"), num_shards=1),
        train_batch_size=8,
        predict_batch_size=8,
    )
    est.train(ex.numpy_input_fn(features, labels, num_epochs=None), max_steps=3)
    version = export.export_version(est, os.path.join(root, "serving"), **options)
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
    pre = export.image_preprocessing(**CUSTOM_PREPROCESSING)
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
        preprocessing=export.resnet_eval(32),
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


TEXT_INPUTS = ("input_ids", "input_mask", "segment_ids")
VOCAB, SEQ, HIDDEN = 50, 8, 16


class TinyBert(nn.Module):
    """BERT's run_classifier, tiny: word/position/segment embeddings, ``layers`` encoder layers
    (masked softmax attention, LayerNorm, GELU: tanh-approximated in the first layer, exact erf
    in the second), a tanh pooler on token 0 and 2 classes."""

    layers: int = 2

    @nn.compact
    def __call__(self, features, train=False):
        ids, mask, segments = (features[k] for k in TEXT_INPUTS)
        words = self.param("word_embeddings", nn.initializers.normal(0.5), (VOCAB, HIDDEN))
        h = words[ids]  # a gather of rows, as BERT's embedding_lookup
        h = h + nn.Embed(2, HIDDEN, name="token_type")(segments)
        h = h + nn.Embed(SEQ, HIDDEN, name="position")(jnp.arange(ids.shape[1]))[None]
        h = nn.LayerNorm(name="embeddings_norm")(h)
        bias = (1.0 - mask[:, None, None, :].astype(jnp.float32)) * -10000.0
        heads = 2
        for i in range(self.layers):
            q, k, v = (
                nn.DenseGeneral((heads, HIDDEN // heads), name=f"layer{i}_{n}")(h) for n in "qkv"
            )
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HIDDEN // heads) + bias
            attention = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
            out = nn.DenseGeneral(HIDDEN, axis=(-2, -1), name=f"layer{i}_out")(attention)
            h = nn.LayerNorm(name=f"layer{i}_norm1")(h + out)
            inner = nn.gelu(nn.Dense(32, name=f"layer{i}_inner")(h), approximate=i == 0)
            h = nn.LayerNorm(name=f"layer{i}_norm2")(
                h + nn.Dense(HIDDEN, name=f"layer{i}_ffn")(inner)
            )
        pooled = jnp.tanh(nn.Dense(HIDDEN, name="pooler")(h[:, 0]))
        return nn.Dense(2, name="classifier")(pooled)


def text_features(n, seed=0):
    """``n`` examples of the three int32 inputs: ids, a mask of 3..SEQ real tokens, segments."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, SEQ + 1, n)
    mask = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.int32)
    ids = (rng.integers(1, VOCAB, (n, SEQ)) * mask).astype(np.int32)
    segments = ((np.arange(SEQ)[None] >= lengths[:, None] // 2) * mask).astype(np.int32)
    return {"input_ids": ids, "input_mask": mask, "segment_ids": segments}


def text_export(root, check_as_list=False):
    """TinyBert trained 2 steps, published with per-input check_inputs (a dict of arrays, or a
    list of per-example dicts); returns its version directory."""
    features = text_features(24)
    labels = (features["input_ids"][:, 1] % 2).astype(np.int32)
    check = {k: v[:8] for k, v in features.items()}
    if check_as_list:
        check = [{k: v[i] for k, v in check.items()} for i in range(8)]
    est = ex.Estimator(
        _model_fn(TinyBert, lambda f: f),
        ex.RunConfig(model_dir=os.path.join(root, "model"), num_shards=1),
        train_batch_size=8,
        predict_batch_size=8,
    )
    est.train(ex.numpy_input_fn(features, labels, num_epochs=None), max_steps=2)
    version = export.export_version(
        est,
        os.path.join(root, "serving"),
        serving_input={k: ex.TensorSpec((None, SEQ), np.int32) for k in TEXT_INPUTS},
        check_inputs=check,
    )
    est.close()
    return version


MIXED_INPUTS = {
    "image": ((6, 6, 3), np.float32),
    "ids": ((5,), np.int64),  # tf.Example's integer type: what a TF client sends
    "mask": ((5,), np.bool_),
}


class MixedInputs(nn.Module):
    """An image-like float32 input through a convolution, int64 ids through an embedding, a
    bool mask over the ids: pooled, concatenated, classified."""

    @nn.compact
    def __call__(self, features, train=False):
        image = nn.relu(nn.Conv(4, (3, 3))(features["image"])).mean(axis=(1, 2))
        mask = features["mask"].astype(jnp.float32)[..., None]
        tokens = nn.Embed(VOCAB, 4)(features["ids"]) * mask
        text = tokens.sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
        return nn.Dense(CLASSES)(jnp.concatenate([image, text], axis=-1))


def mixed_features(n, seed=0):
    """``n`` examples of MIXED_INPUTS: normal pixels, ids in [0, VOCAB), a mask of ~70% True."""
    rng = np.random.default_rng(seed)
    return {
        "image": rng.normal(size=(n, 6, 6, 3)).astype(np.float32),
        "ids": rng.integers(0, VOCAB, (n, 5)).astype(np.int64),
        "mask": rng.random((n, 5)) < 0.7,
    }


def mixed_export(root):
    """MixedInputs trained 2 steps, published with its three inputs' check_inputs (a dict of
    float32, int64 and bool arrays); returns its version directory."""
    features = mixed_features(24)
    labels = (features["ids"][:, 0] % CLASSES).astype(np.int32)
    est = ex.Estimator(
        _model_fn(MixedInputs, lambda f: f),
        ex.RunConfig(model_dir=os.path.join(root, "model"), num_shards=1),
        train_batch_size=8,
        predict_batch_size=8,
    )
    est.train(ex.numpy_input_fn(features, labels, num_epochs=None), max_steps=2)
    version = export.export_version(
        est,
        os.path.join(root, "serving"),
        serving_input={k: ex.TensorSpec((None, *s), d) for k, (s, d) in MIXED_INPUTS.items()},
        check_inputs={k: v[:8] for k, v in features.items()},
    )
    est.close()
    return version


def stored_check(version, dtypes):
    """(the check inputs of ``version``'s export_check.json as arrays of ``dtypes`` by input
    name, the answers recorded for them): what a client sends, what estimax answered."""
    with open(os.path.join(version, "export_check.json")) as f:
        record = json.load(f)
    inputs = {k: np.asarray(v, dtypes[k]) for k, v in record["inputs"].items()}
    return inputs, {k: np.asarray(v) for k, v in record["expected"].items()}
