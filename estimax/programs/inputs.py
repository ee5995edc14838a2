"""What a program reads: fake data asked for by name, the data checks a user hears at start, and
the ImageNet input of the programs whose input is ResNet's."""

from __future__ import annotations

import functools
import os
import posixpath
from typing import Any

from absl import flags, logging

from estimax.programs import cli
from estimax.programs.cli import UsageError

# resnet_main.py's default --data_dir (2018-12): a public bucket of fake ImageNet records. It
# cannot be reached here (no network), so it means local fake data (see resolve_data_dir).
FAKE_DATA_DIR = "gs://cloud-tpu-test-datasets/fake_imagenet"
# --data_dir values that ask for fake data in so many words: the original's null input (zero
# images, label 0) and random images.
FAKE_DATA_DIRS = {"null": "zeros", "fake": "random"}


def shard_index_dir(model_dir: str | None) -> str | None:
    """Where a job keeps the indexes of bucket shards that have none and may not get one beside
    them (a read-only bucket of TensorFlow-written shards): ``<model_dir>/shard_indexes``, which
    every host of the job reads and writes, so the hosts share the indexing and later starts
    pull nothing to index (``estimax.data.shard_index``). None without a model_dir."""
    return f"{model_dir.rstrip('/')}/shard_indexes" if model_dir else None


def resolve_data_dir(data_dir: str | None, *, use_fake: bool = False) -> tuple[str | None, str]:
    """Returns ``(data_dir, fake_kind)`` for ``estimax.data.imagenet.input_fn``.

    * ``'null'``: the original's null input (zero images, label 0); ``'fake'``: random images.
    * ``gs://cloud-tpu-test-datasets/fake_imagenet`` (resnet's default) or ``use_fake``: local
      random fake data; the public bucket is not reachable from here, and what it held (random
      images in the real format) is what local random data stands in for.
    * anything else: the real TFRecord files there.

    Raises:
      UsageError: ``data_dir`` is None or empty (fake data only when asked for).
    """
    if use_fake:
        return None, "random"
    if data_dir is not None and data_dir.strip() in FAKE_DATA_DIRS:
        return None, FAKE_DATA_DIRS[data_dir.strip()]
    cli.check_location("data_dir", data_dir, required=True)
    assert data_dir is not None
    if data_dir.rstrip("/") == FAKE_DATA_DIR:
        return None, "random"
    return data_dir, "random"


def check_data(
    data_dir: str | None,
    mode: str,
    *,
    use_fake: bool = False,
    fake_hint: str = "--data_dir=fake",
    compile_only: bool = False,
) -> tuple[str | None, str, list[str]]:
    """``resolve_data_dir`` plus what a user must hear at start: fake data, a missing split.

    Args:
      data_dir: the ``--data_dir`` value.
      mode: ``--mode`` (which splits the run reads).
      use_fake: fake data asked for by another flag (``--use_data=fake``).
      fake_hint: how this program asks for fake data, for the messages.
      compile_only: ``--compile_for``: no data is read, so none is checked (it may be remote).

    Returns:
      ``(data_dir, fake_kind, notes)``: the first two for the input; ``notes`` the warnings to
      keep in TensorBoard's run description.

    Raises:
      UsageError: no data asked for, or a split the mode reads has no files.
    """
    if compile_only:
        return None, "random", []
    if data_dir is None and not use_fake:
        raise UsageError(
            f"--data_dir is not set: give the directory of the ImageNet TFRecords "
            f"(train-*, validation-*), or ask for fake data with {fake_hint}."
        )
    resolved, kind = resolve_data_dir(data_dir, use_fake=use_fake)
    if resolved is None:
        why = (
            "--use_data=fake"
            if use_fake
            else f"--data_dir={data_dir}"
            + (
                " (the original's public fake ImageNet, which cannot be read from here)"
                if kind == "random" and data_dir not in FAKE_DATA_DIRS
                else ""
            )
        )
        note = (
            f"FAKE DATA: {why}: training and evaluating on "
            f"{'all-zero' if kind == 'zeros' else 'random'} images, not a real data set."
        )
        logging.warning("*** %s ***", note)
        return None, kind, [note]
    _check_splits(resolved, data_dir, mode, fake_hint)
    return resolved, kind, []


def _check_splits(resolved: str, data_dir: str | None, mode: str, fake_hint: str) -> None:
    """Raises UsageError naming the first split ``mode`` reads that has no files."""
    from estimax.data import imagenet, tfrecord

    splits = {"train": [True], "eval": [False], "train_and_eval": [True, False]}[mode]
    for is_training in splits:
        pattern = imagenet.file_pattern(resolved, is_training)
        try:
            tfrecord.list_files(pattern)
        except (FileNotFoundError, OSError):
            raise UsageError(
                f"--data_dir={data_dir} has no {posixpath.basename(pattern)} files, which "
                f"--mode={mode} reads: point --data_dir at the ImageNet TFRecords "
                f"(estimax-convert writes them), or ask for fake data with {fake_hint}."
            ) from None


def imagenet_inputs(
    fv: flags.FlagValues, image_size: int, **preprocessing: Any
) -> tuple[Any, str | None, list[str]]:
    """``(input_fn(is_training=...), data_dir, notes)`` of ``--data_dir`` for a program whose
    input is ResNet's (``efficientnet``, ``vit``): its flags, the job's shard-index folder and
    ``preprocessing``'s extra ``imagenet.input_fn`` arguments (``augment``, ``mixup_alpha``)."""
    from estimax.data import imagenet

    data_dir, fake_kind, notes = check_data(fv.data_dir, fv.mode, compile_only=bool(fv.compile_for))
    inputs = functools.partial(
        imagenet.input_fn,
        data_dir,
        image_size=image_size,
        preprocessing="resnet",
        num_parallel_calls=max(1, min(fv.num_parallel_calls, os.cpu_count() or 1)),
        fake_data=fake_kind,
        fake_eval_examples=fv.num_eval_images,
        num_classes=fv.num_label_classes,
        skip_bad_records=fv.skip_bad_records,
        index_dir=shard_index_dir(fv.model_dir),
        index_beside_data=fv.index_beside_data,
        **preprocessing,
    )
    return inputs, data_dir, notes
