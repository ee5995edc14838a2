"""Fine-tuning BERT as run_classifier.py did, warm-started from Google's TensorFlow checkpoint.

google-research/bert's ``modeling.py`` as Flax modules named as its variable scopes, so every
variable's name is the checkpoint's (``bert/encoder/layer_0/attention/self/query/kernel``) but
the layer norms' (Flax's ``scale``/``bias`` for TensorFlow's ``gamma``/``beta``: ``RENAME``), and
run_classifier.py's ``model_fn``: the pooled output, dropout, a new ``output_weights`` head.
The warm start is ``WarmStartSettings(init_checkpoint, "bert/.*", rename=RENAME)``: the head
starts fresh, the pre-training heads (``cls/...``) are left unused::

    python examples/bert_classifier.py --init_checkpoint=uncased_L-12_H-768_A-12/bert_model.ckpt \\
        --model_dir=/tmp/bert_mrpc --hidden_size=768 --num_hidden_layers=12 ...

run_classifier.py's whole flow, on tf.Example TFRecords: ``file_based_convert_examples_to_features``
writes ``input_ids``/``input_mask``/``segment_ids``/``label_ids``/``is_real_example`` int64
features, ``file_based_input_fn_builder`` parses them back (``FixedLenFeature``, int64 -> int32),
the eval set is padded with ``is_real_example=0`` examples to a whole number of batches as the
original did for TPUs, ``metric_fn`` weighs accuracy and loss by ``is_real_example``, and the
trained model is exported with three int32 inputs (``--export_dir``) for ``estimax serve``,
``estimax export-onnx`` and ``estimax export-savedmodel``. The tokenizer and the GLUE readers are
not part of this example: it writes a toy task's token ids (``synthetic_features``). The tests
warm-start it from a 2-layer BERT written by TensorFlow (tests/test_bert_example.py)::

    python examples/bert_classifier.py --init_checkpoint=tests/data/tf_checkpoints/bert_tiny \
        --output_dir=/tmp/bert_tiny --do_train --do_eval --export_dir=/tmp/bert_serving
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

import estimax as ex
from estimax import export
from estimax.data import FixedLenFeature, TFRecordWriter, encode_example, parse_example
from estimax.data.tfrecord import read_records

# TensorFlow's layer norm names -> Flax's (checkpoint name parts -> the model's).
RENAME = {"LayerNorm/gamma": "LayerNorm/scale", "LayerNorm/beta": "LayerNorm/bias"}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """``modeling.BertConfig``'s sizes (``bert_config.json``); the defaults: a 2-layer toy."""

    vocab_size: int = 16
    hidden_size: int = 8
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 16
    max_position_embeddings: int = 8
    type_vocab_size: int = 2
    hidden_dropout_prob: float = 0.1


def _dense(features: int, name: str) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.truncated_normal(0.02), name=name)


def _layer_norm() -> nn.LayerNorm:
    # tf.contrib.layers.layer_norm's epsilon.
    return nn.LayerNorm(epsilon=1e-12, name="LayerNorm")


class Embeddings(nn.Module):
    """``bert/embeddings``: word, token type and position embeddings, then a layer norm."""

    config: BertConfig

    @nn.compact
    def __call__(self, input_ids: jnp.ndarray, token_type_ids: jnp.ndarray) -> jnp.ndarray:
        c = self.config
        init = nn.initializers.truncated_normal(0.02)
        words = self.param("word_embeddings", init, (c.vocab_size, c.hidden_size))
        types = self.param("token_type_embeddings", init, (c.type_vocab_size, c.hidden_size))
        positions = self.param(
            "position_embeddings", init, (c.max_position_embeddings, c.hidden_size)
        )
        x = words[input_ids] + types[token_type_ids] + positions[None, : input_ids.shape[1]]
        return _layer_norm()(x)


class SelfAttention(nn.Module):
    """``attention/self``: query, key and value projections; scaled dot-product attention."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
        c = self.config
        heads, size = c.num_attention_heads, c.hidden_size // c.num_attention_heads

        def split(y: jnp.ndarray) -> jnp.ndarray:
            return y.reshape(*y.shape[:2], heads, size).transpose(0, 2, 1, 3)

        q, k, v = (split(_dense(c.hidden_size, n)(x)) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(size) + mask
        context = nn.softmax(scores) @ v
        return context.transpose(0, 2, 1, 3).reshape(x.shape)


class Residual(nn.Module):
    """``.../output``: a dense layer, the residual and a layer norm."""

    features: int

    @nn.compact
    def __call__(self, x: jnp.ndarray, residual: jnp.ndarray) -> jnp.ndarray:
        return _layer_norm()(_dense(self.features, "dense")(x) + residual)


class Attention(nn.Module):
    """``layer_N/attention``."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
        context = SelfAttention(self.config, name="self")(x, mask)
        return Residual(self.config.hidden_size, name="output")(context, x)


class Intermediate(nn.Module):
    """``layer_N/intermediate``: the feed-forward's wide layer (BERT's tanh GELU)."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return nn.gelu(_dense(self.config.intermediate_size, "dense")(x), approximate=True)


class Layer(nn.Module):
    """``encoder/layer_N``."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
        attended = Attention(self.config, name="attention")(x, mask)
        inner = Intermediate(self.config, name="intermediate")(attended)
        return Residual(self.config.hidden_size, name="output")(inner, attended)


class Encoder(nn.Module):
    """``bert/encoder``: the layers."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
        for i in range(self.config.num_hidden_layers):
            x = Layer(self.config, name=f"layer_{i}")(x, mask)
        return x


class Pooler(nn.Module):
    """``bert/pooler``: the first token through a tanh dense layer."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return jnp.tanh(_dense(self.config.hidden_size, "dense")(x[:, 0]))


class BertModel(nn.Module):
    """``modeling.BertModel``; create it as ``BertModel(config, name="bert")``, the scope of the
    original's variables. Returns ``(sequence_output, pooled_output)``."""

    config: BertConfig

    @nn.compact
    def __call__(
        self, input_ids: jnp.ndarray, input_mask: jnp.ndarray, token_type_ids: jnp.ndarray
    ) -> tuple[jnp.ndarray, jnp.ndarray]:
        x = Embeddings(self.config, name="embeddings")(input_ids, token_type_ids)
        mask = (1.0 - input_mask[:, None, None, :].astype(jnp.float32)) * -10000.0
        sequence = Encoder(self.config, name="encoder")(x, mask)
        return sequence, Pooler(self.config, name="pooler")(sequence)


class Classifier(nn.Module):
    """run_classifier.py's head: ``output_weights`` [num_labels, hidden], ``output_bias``."""

    num_labels: int

    @nn.compact
    def __call__(self, pooled: jnp.ndarray) -> jnp.ndarray:
        weights = self.param(
            "output_weights",
            nn.initializers.truncated_normal(0.02),
            (self.num_labels, pooled.shape[-1]),
        )
        bias = self.param("output_bias", nn.initializers.zeros, (self.num_labels,))
        return pooled @ weights.T + bias


def create_model(
    config: BertConfig, train: bool, features: dict, num_labels: int
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """run_classifier.py's ``create_model``: returns ``(logits, pooled_output)``."""
    _, pooled = BertModel(config, name="bert")(
        features["input_ids"], features["input_mask"], features["segment_ids"]
    )
    pooled = nn.Dropout(config.hidden_dropout_prob, deterministic=not train)(pooled)
    return Classifier(num_labels, name="classifier")(pooled), pooled


def metric_fn(per_example_loss, label_ids, logits, is_real_example):
    """run_classifier.py's ``metric_fn``: the padding examples (``is_real_example=0``) weigh 0."""
    return {
        "eval_accuracy": ex.metrics.accuracy(label_ids, logits, weights=is_real_example),
        "eval_loss": ex.metrics.mean(per_example_loss, weights=is_real_example),
    }


def model_fn(features: dict, labels: Any, mode: str, params: dict) -> ex.EstimatorSpec:
    """run_classifier.py's ``model_fn``: BERT's pooled output -> dropout -> a new head.

    ``labels`` are ``label_ids`` (the input_fn yields them beside the features); in PREDICT and
    in the export only the three inputs come: ``input_ids``, ``input_mask``, ``segment_ids``.
    """
    config = BertConfig(**params.get("bert_config", {}))
    logits, pooled = create_model(
        config, mode == ex.ModeKeys.TRAIN, features, params.get("num_labels", 2)
    )
    probabilities = nn.softmax(logits)
    predictions = {"probabilities": probabilities, "pooled_output": pooled}
    if labels is None:
        return ex.EstimatorSpec(mode=mode, predictions=predictions)
    per_example_loss = ex.losses.softmax_cross_entropy(logits, labels)
    is_real_example = features.get("is_real_example")
    if is_real_example is None:
        is_real_example = jnp.ones(labels.shape, jnp.float32)
    return ex.EstimatorSpec(
        mode=mode,
        loss=per_example_loss,
        optimizer=optax.adamw(params.get("learning_rate", 5e-5), weight_decay=0.01),
        eval_metrics=(
            metric_fn,
            [per_example_loss, labels, logits, is_real_example.astype(jnp.float32)],
        ),
        predictions=predictions,
    )


def input_fn(params: dict) -> Any:
    """Random sequences of ``params["seq_length"]`` (default 5) token ids, forever."""
    config = BertConfig(**params.get("bert_config", {}))
    batch, length = params["batch_size"], params.get("seq_length", 5)
    rng = np.random.default_rng(0)
    while True:
        yield (
            {
                "input_ids": rng.integers(0, config.vocab_size, (batch, length)).astype(np.int32),
                "input_mask": np.ones((batch, length), np.int32),
                "segment_ids": rng.integers(0, 2, (batch, length)).astype(np.int32),
            },
            rng.integers(0, params.get("num_labels", 2), batch).astype(np.int32),
        )


# ---- run_classifier.py's data path: InputFeatures -> tf.Example TFRecords -> batches ----

FEATURE_NAMES = ("input_ids", "input_mask", "segment_ids")


def synthetic_features(
    num_examples: int, seq_length: int, vocab_size: int, seed: int = 0
) -> list[dict[str, Any]]:
    """``InputFeatures`` of a toy sentence-pair task (what ``convert_single_example`` returns for
    tokenized text): [CLS]=1 a [SEP]=2 b [SEP] 0-padding; the label is whether the first token
    of ``a`` is even."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_examples):
        n = int(rng.integers(5, seq_length + 1))
        half = (n - 3) // 2 + 1
        a = rng.integers(3, vocab_size, half).tolist()
        b = rng.integers(3, vocab_size, n - 3 - half).tolist()
        ids = [1, *a, 2, *b, 2]
        segments = [0] * (len(a) + 2) + [1] * (len(b) + 1)
        pad = seq_length - len(ids)
        out.append(
            {
                "input_ids": ids + [0] * pad,
                "input_mask": [1] * len(ids) + [0] * pad,
                "segment_ids": segments + [0] * pad,
                "label_id": int(a[0] % 2 == 0),
                "is_real_example": True,
            }
        )
    return out


def padding_example(seq_length: int) -> dict[str, Any]:
    """run_classifier.py's ``PaddingInputExample`` converted: all zeros, ``is_real_example=0``."""
    zeros = [0] * seq_length
    return {
        "input_ids": zeros,
        "input_mask": zeros,
        "segment_ids": zeros,
        "label_id": 0,
        "is_real_example": False,
    }


def pad_to_batches(
    features: list[dict[str, Any]], batch_size: int, seq_length: int
) -> list[dict[str, Any]]:
    """As run_classifier.py's ``do_eval`` on TPU: padding examples until the eval set is a whole
    number of batches (estimax pads a last partial batch itself and masks it; these are kept
    for the original's files and are weighed out by ``metric_fn``)."""
    padded = list(features)
    while len(padded) % batch_size:
        padded.append(padding_example(seq_length))
    return padded


def file_based_convert_examples_to_features(features: list[dict[str, Any]], path: str) -> None:
    """run_classifier.py's: one tf.Example of int64 features per example, into a TFRecord file."""
    with TFRecordWriter(path) as writer:
        for f in features:
            example = {name: np.asarray(f[name], np.int64) for name in FEATURE_NAMES}
            example["label_ids"] = np.asarray([f["label_id"]], np.int64)
            example["is_real_example"] = np.asarray([int(f["is_real_example"])], np.int64)
            writer.write(encode_example(example))


def file_based_input_fn_builder(
    input_file: str, seq_length: int, is_training: bool, drop_remainder: bool
) -> Any:
    """run_classifier.py's: an input_fn reading ``input_file``'s tf.Examples (``name_to_features``
    with ``FixedLenFeature``s, int64 cast to int32 as ``_decode_record`` did); training repeats
    and shuffles, eval reads the file once. Yields ``(features, label_ids)``."""
    name_to_features = {
        "input_ids": FixedLenFeature([seq_length], "int64"),
        "input_mask": FixedLenFeature([seq_length], "int64"),
        "segment_ids": FixedLenFeature([seq_length], "int64"),
        "label_ids": FixedLenFeature([], "int64"),
        "is_real_example": FixedLenFeature([], "int64"),
    }

    def batches(records: list[dict[str, Any]], batch_size: int) -> Any:
        for start in range(0, len(records), batch_size):
            rows = records[start : start + batch_size]
            if drop_remainder and len(rows) < batch_size:
                return
            features = {
                name: np.stack([np.asarray(r[name]) for r in rows]).astype(np.int32)
                for name in name_to_features
            }
            yield features, features.pop("label_ids")

    def input_fn(params: dict) -> Any:
        records = [parse_example(r, name_to_features) for r in read_records(input_file)]
        if not is_training:
            yield from batches(records, params["batch_size"])
            return
        rng = np.random.default_rng(12345)
        while True:  # d.repeat(); d.shuffle(buffer_size=100)
            order = rng.permutation(len(records))
            yield from batches([records[i] for i in order], params["batch_size"])

    return input_fn


def export_classifier(
    est: ex.Estimator, export_dir: str, seq_length: int, check_inputs: dict[str, np.ndarray]
) -> str:
    """The next version under ``export_dir``: three int32 [batch, seq_length] inputs by name
    (BERT's serving_input_receiver_fn), checked on ``check_inputs`` (a dict by input name)."""
    return export.export_version(
        est,
        export_dir,
        serving_input={name: ex.TensorSpec((None, seq_length), np.int32) for name in FEATURE_NAMES},
        check_inputs=check_inputs,
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not the usage
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="bert_classifier.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--init_checkpoint", help="a TF checkpoint (bert_model.ckpt)")
    parser.add_argument("--output_dir", required=True, help="the model_dir and the TFRecords")
    parser.add_argument("--bert_config_file", help="bert_config.json; default: a 2-layer toy")
    parser.add_argument("--do_train", action="store_true")
    parser.add_argument("--do_eval", action="store_true")
    parser.add_argument("--export_dir", help="export a version here (estimax serve's base path)")
    parser.add_argument("--max_seq_length", type=int, default=8)
    parser.add_argument("--train_batch_size", type=int, default=8)
    parser.add_argument("--eval_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--num_train_steps", type=int, default=10)
    parser.add_argument("--num_train_examples", type=int, default=32)
    parser.add_argument("--num_eval_examples", type=int, default=13)
    args = parser.parse_args(argv)
    if not (args.do_train or args.do_eval or args.export_dir):
        parser.error("at least one of --do_train, --do_eval or --export_dir must be given")
    config = BertConfig()
    if args.bert_config_file:
        try:
            with open(args.bert_config_file) as f:
                given = json.load(f)
        except (OSError, ValueError) as e:
            parser.error(f"--bert_config_file={args.bert_config_file}: {e}")
        names = {f.name for f in dataclasses.fields(BertConfig)}
        config = BertConfig(**{k: v for k, v in given.items() if k in names})
    if args.max_seq_length > config.max_position_embeddings:
        parser.error(
            f"--max_seq_length={args.max_seq_length} is longer than the model's "
            f"max_position_embeddings={config.max_position_embeddings}"
        )
    seq = args.max_seq_length
    warm = None
    if args.init_checkpoint:
        warm = ex.WarmStartSettings(args.init_checkpoint, "bert/.*", rename=RENAME)
    est = ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=args.output_dir),
        params={
            "bert_config": dataclasses.asdict(config),
            "num_labels": 2,
            "learning_rate": args.learning_rate,
        },
        train_batch_size=args.train_batch_size,
        eval_batch_size=args.eval_batch_size,
        predict_batch_size=args.eval_batch_size,
        warm_start_from=warm,
    )
    if args.do_train:
        train_file = os.path.join(args.output_dir, "train.tf_record")
        file_based_convert_examples_to_features(
            synthetic_features(args.num_train_examples, seq, config.vocab_size, seed=0),
            train_file,
        )
        est.train(
            file_based_input_fn_builder(train_file, seq, True, True),
            max_steps=args.num_train_steps,
        )
    eval_features = synthetic_features(args.num_eval_examples, seq, config.vocab_size, seed=1)
    if args.do_eval:
        eval_file = os.path.join(args.output_dir, "eval.tf_record")
        padded = pad_to_batches(eval_features, args.eval_batch_size, seq)
        file_based_convert_examples_to_features(padded, eval_file)
        print(
            f"eval: {len(eval_features)} real examples + {len(padded) - len(eval_features)} padding"
        )
        result = est.evaluate(file_based_input_fn_builder(eval_file, seq, False, False))
        for key in sorted(result):
            print(f"  {key} = {result[key]}")
    if args.export_dir:
        check = {n: np.asarray([f[n] for f in eval_features[:8]], np.int32) for n in FEATURE_NAMES}
        print(f"exported {export_classifier(est, args.export_dir, seq, check)}")
    est.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
