"""The ImageNet input: ``input_fn(data_dir, is_training, ...)(params)`` -> batches of images.

The files are the original's (docs/original.md §5, §8): ``train-00000-of-01024`` ...
``validation-00127-of-00128`` in ``data_dir`` (any fsspec path), TFRecords of tf.Example with the
fields below. Labels in the files are **1-based** (1..1000, the converter's
``{synset: k + 1}``); :func:`label_from_example` subtracts 1, the only place that does, so the
model sees ``[0, 1000)``. The same records can come from the rows of a Cloud Bigtable table
instead (``bigtable=``, :mod:`estimax.data.bigtable`).

The contract with the Estimator::

    loader = input_fn(data_dir, is_training=True)(params)   # params["batch_size"], ["context"]
    it = iter(loader)                                       # it.get_state() / it.set_state(s)
    images, labels = next(it)   # images: [B, S, S, 3] (uint8 for ResNet, float32 for Inception)
                                # labels: [B] int32 in [0, 1000)

Training repeats forever with a new shuffle every epoch and fixed-shape batches. With many hosts
the order is global (``estimax.data.order``): each host reads its block of every global batch,
so the batches and the saved position do not depend on the number of hosts. Eval is one pass
in file order that keeps a smaller last batch (the Estimator pads and masks it, so every one of the
50,000 validation images counts once; ``drop_remainder`` would lose 848 of them at batch 1024).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import posixpath
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from estimax.data import bigtable as bigtable_lib
from estimax.data import example as ex
from estimax.data import fake, loader, tfrecord

__all__ = [
    "IMAGENET_SCHEMA",
    "NUM_CLASSES",
    "NUM_EVAL_IMAGES",
    "NUM_TRAIN_IMAGES",
    "ImageNetTransform",
    "file_pattern",
    "input_fn",
    "is_fake_data_dir",
    "label_from_example",
]

log = logging.getLogger(__name__)

NUM_CLASSES = 1000
NUM_TRAIN_IMAGES = 1_281_167
NUM_EVAL_IMAGES = 50_000

# The reader's schema of imagenet_input.py (seed 004), plus the fields the converters write
# (imagenet_to_gcs.py, jpeg_to_tf_record.py). The converter fields have defaults so files of
# other writers (e.g. the original fake_imagenet, which has only the reader's fields) parse.
IMAGENET_SCHEMA: dict[str, ex.FixedLenFeature | ex.VarLenFeature] = {
    "image/encoded": ex.FixedLenFeature((), "string", default_value=""),
    "image/format": ex.FixedLenFeature((), "string", default_value="jpeg"),
    "image/class/label": ex.FixedLenFeature((), "int64", default_value=-1),
    "image/class/text": ex.FixedLenFeature((), "string", default_value=""),
    "image/object/bbox/xmin": ex.VarLenFeature("float32"),
    "image/object/bbox/ymin": ex.VarLenFeature("float32"),
    "image/object/bbox/xmax": ex.VarLenFeature("float32"),
    "image/object/bbox/ymax": ex.VarLenFeature("float32"),
    "image/object/class/label": ex.VarLenFeature("int64"),
    # Written by the converters:
    "image/class/synset": ex.FixedLenFeature((), "string", default_value=""),
    "image/filename": ex.FixedLenFeature((), "string", default_value=""),
    "image/height": ex.FixedLenFeature((), "int64", default_value=0),
    "image/width": ex.FixedLenFeature((), "int64", default_value=0),
    "image/colorspace": ex.FixedLenFeature((), "string", default_value=""),
    "image/channels": ex.FixedLenFeature((), "int64", default_value=0),
}

# What the input reads per record: parsing only these two keeps the per-record cost low.
_INPUT_SCHEMA = {k: IMAGENET_SCHEMA[k] for k in ("image/encoded", "image/class/label")}
_BBOX_SCHEMA = {
    k: IMAGENET_SCHEMA[k]
    for k in (
        "image/object/bbox/ymin",
        "image/object/bbox/xmin",
        "image/object/bbox/ymax",
        "image/object/bbox/xmax",
    )
}

_FAKE_DATA_DIRS = (None, "", "null")


def is_fake_data_dir(data_dir: str | None) -> bool:
    """Whether ``data_dir`` asks for fake data, as the original: None, ``''`` or ``'null'``."""
    return data_dir in _FAKE_DATA_DIRS


def file_pattern(data_dir: str, is_training: bool) -> str:
    """``<data_dir>/train-*`` or ``<data_dir>/validation-*``."""
    return posixpath.join(data_dir, "train-*" if is_training else "validation-*")


def label_from_example(parsed: dict[str, Any], num_classes: int = NUM_CLASSES) -> np.int32:
    """The 0-based class of a parsed example: ``image/class/label - 1``.

    The one place the 1-based labels of the files become 0-based, as the original's
    ``tf.cast(label, tf.int32) - 1``.

    Raises:
      ValueError: the label is missing (-1 by the schema's default) or outside ``1..num_classes``.
    """
    raw = int(parsed["image/class/label"])
    if not 1 <= raw <= num_classes:
        missing = " (the record has no image/class/label)" if raw == -1 else ""
        raise ValueError(
            f"label out of range: image/class/label = {raw}{missing}; the files' labels are "
            f"1-based and must be in [1, {num_classes}]"
        )
    return np.int32(raw - 1)


def bbox_from_example(parsed: dict[str, Any]) -> np.ndarray | None:
    """Annotated boxes as [N, 4] float32 ``(ymin, xmin, ymax, xmax)`` in [0, 1]; None if none."""
    coords = [np.asarray(parsed[k], np.float32) for k in _BBOX_SCHEMA]
    if coords[0].size == 0:
        return None
    if len({c.size for c in coords}) != 1:
        raise ValueError(
            "image/object/bbox/{ymin,xmin,ymax,xmax} have different lengths: "
            f"{[c.size for c in coords]}"
        )
    return np.stack(coords, axis=-1)


def _preprocess_fn(name: str) -> Callable[..., np.ndarray]:
    # Imported here: estimax.data.preprocessing pulls in the JPEG stack (simplejpeg, OpenCV),
    # which TFRecord tools and fake data do not need.
    from estimax.data import preprocessing

    fns: dict[str, Callable[..., np.ndarray]] = {
        "resnet": preprocessing.resnet_preprocess,
        "inception": preprocessing.inception_preprocess,
    }
    if name not in fns:
        raise ValueError(f"preprocessing must be one of {sorted(fns)} or a callable, got {name!r}")
    return fns[name]


@dataclasses.dataclass(frozen=True)
class ImageNetTransform:
    """Record -> ``(image [S, S, 3], label int32)``; picklable, so it can run in worker processes.

    Attributes:
      preprocess: ``preprocess(image_bytes, is_training, image_size, rng, bbox=None)``; the
        functions of ``estimax.data.preprocessing``.
      is_training: training (random crop/flip) or eval preprocessing.
      image_size: S.
      num_classes: labels must be in ``1..num_classes`` in the files.
      use_annotated_bbox: pass the record's ``image/object/bbox/*`` to the crop sampler (the
        original's ``--use_annotated_bbox``, Inception v4); else the whole image is the box.
      augment: training only: ``augment(image, rng) -> image`` after the preprocessing, with the
        example's generator (``estimax.data.augment.RandAugment``); None: none.
    """

    preprocess: Callable[..., np.ndarray]
    is_training: bool
    image_size: int
    num_classes: int = NUM_CLASSES
    use_annotated_bbox: bool = False
    augment: Callable[[np.ndarray, np.random.Generator], np.ndarray] | None = None

    def __call__(self, record: bytes, rng: np.random.Generator) -> tuple[np.ndarray, np.int32]:
        schema = dict(_INPUT_SCHEMA, **_BBOX_SCHEMA) if self.use_annotated_bbox else _INPUT_SCHEMA
        parsed = ex.parse_example(record, schema)
        label = label_from_example(parsed, self.num_classes)
        image_bytes = parsed["image/encoded"]
        if not image_bytes:
            raise ValueError("the record has no image/encoded bytes")
        bbox = bbox_from_example(parsed) if self.use_annotated_bbox else None
        image = self.preprocess(image_bytes, self.is_training, self.image_size, rng, bbox=bbox)
        if self.augment is not None and self.is_training:
            image = self.augment(image, rng)
        return image, label


def _tfrecord_source(
    data_dir: str,
    is_training: bool,
    shard_by: str,
    host_index: int,
    num_hosts: int,
    verify_crc: bool,
    skip_bad_records: bool,
    index_dir: str | None = None,
    index_beside_data: bool = False,
) -> tuple[loader.TFRecordSource, np.ndarray | None]:
    """This host's TFRecord source and record ids (None: all of the source's records)."""
    files = tfrecord.list_files(file_pattern(data_dir, is_training))
    if shard_by == "file" and len(files) >= num_hosts:
        files = loader.host_shard(files, host_index, num_hosts)
        return loader.TFRecordSource(
            files,
            verify_crc=verify_crc,
            skip_bad_records=skip_bad_records,
            index_dir=index_dir,
            index_beside_data=index_beside_data,
        ), None
    if shard_by == "file":
        log.warning(
            "%d files for %d hosts: sharding by record instead of by file", len(files), num_hosts
        )
    source = loader.TFRecordSource(
        files,
        verify_crc=verify_crc,
        skip_bad_records=skip_bad_records,
        index_dir=index_dir,
        index_beside_data=index_beside_data,
    )
    return source, loader.host_shard(np.arange(len(source)), host_index, num_hosts)


def _host(params: dict[str, Any]) -> tuple[int, int]:
    context = params.get("context")
    return (int(getattr(context, "host_index", 0) or 0), int(getattr(context, "num_hosts", 1) or 1))


def input_fn(
    data_dir: str | None,
    is_training: bool,
    *,
    image_size: int = 224,
    preprocessing: str | Callable[..., np.ndarray] = "resnet",
    num_parallel_calls: int | None = None,
    worker_type: str = "auto",
    prefetch: int = 2,
    use_fake_data: bool = False,
    fake_data: str = "zeros",
    fake_eval_examples: int = NUM_EVAL_IMAGES,
    transpose_input: bool = False,
    skip_bad_records: bool = False,
    seed: int = 0,
    num_classes: int = NUM_CLASSES,
    use_annotated_bbox: bool = False,
    shard_by: str = "global",
    verify_crc: bool = True,
    bigtable: bigtable_lib.BigtableTable | None = None,
    augment: Callable[[np.ndarray, np.random.Generator], np.ndarray] | None = None,
    mixup_alpha: float = 0.0,
    index_dir: str | None = None,
    index_beside_data: bool = False,
) -> Callable[[dict[str, Any]], Any]:
    """The ImageNet ``input_fn`` of the original, for the Estimator.

    Args:
      data_dir: directory (any fsspec path) of ``train-*`` / ``validation-*`` shards; None,
        ``''`` or ``'null'`` gives fake data, as the original's null input.
      is_training: training input (shuffled, repeated forever, full batches) or eval input (one
        pass in file order, the last batch possibly smaller).
      image_size: output side S (224 ResNet, 299 Inception).
      preprocessing: ``'resnet'`` or ``'inception'`` (``estimax.data.preprocessing``), or a
        callable with their signature.
      num_parallel_calls: parallel decode/preprocess workers; default all usable cores.
      worker_type: ``'thread'``, ``'process'`` or ``'auto'`` (processes from 4 workers on, see
        ``estimax.data.loader``; bench/input_pipeline.py measures both).
      prefetch: batches prepared ahead.
      use_fake_data: fake data even with a ``data_dir``.
      fake_data: ``'zeros'`` (the original's null input: zero images, label 0) or ``'random'``.
      fake_eval_examples: examples in a fake eval pass.
      transpose_input: TPU-only in the original (HWCN layout for the infeed); accepted for
        command-line compatibility and ignored: XLA on CPU/GPU picks layouts itself.
      skip_bad_records: skip and count (``iterator.num_skipped``) undecodable images, bad labels,
        bad CRCs and truncated records instead of raising.
      seed: shuffle and augmentation seed.
      num_classes: labels in the files must be in ``1..num_classes``.
      use_annotated_bbox: use ``image/object/bbox/*`` in the training crop.
      shard_by: ``'global'`` (default): one order over all records of the split for all hosts
        (``estimax.data.order``): global batch ``b`` is a fixed slice of the epoch's
        permutation and host ``h`` reads its block of it, so the batches, and the saved input
        position, do not depend on the number of hosts (a job resumes on any number). Every host
        needs every file's index: shards without ``.idx`` files are indexed at start, each by
        one host, which writes the index into ``index_dir`` (``estimax-convert index`` writes
        them once beforehand; see ``loader.TFRecordSource``). The legacy per-host
        orders: ``'file'``: each host reads ``files[host_index::num_hosts]`` (the original's
        ``list_files().shard()``); ``'record'``: each host reads every num_hosts-th record of all
        files. ``'file'`` falls back to ``'record'`` when there are fewer files than hosts. With
        them a job resumed on another number of hosts restarts its input.
      verify_crc: check record CRCs.
      bigtable: read the tf.Examples from the rows of a Cloud Bigtable table instead of
        ``data_dir`` (the original's ``--bigtable_*`` flags): ``train_prefix`` rows for training,
        ``eval_prefix`` rows for eval, in row-key order. Hosts shard by record.
      augment: training only: applied to each preprocessed image with its own generator
        (``estimax.data.augment.RandAugment``: the image must be uint8, as ``'resnet'``'s).
        Not applied to fake data.
      mixup_alpha: training only, when > 0: mix each batch (``estimax.data.augment.
        MixupBatches``): the labels become float32 ``[B, num_classes]`` targets and the images
        float32.
      index_dir: where the indexes of bucket shards that have none are written and found again
        (``loader.TFRecordSource``); the programs give ``<model_dir>/shard_indexes``. Without
        it (and ``index_beside_data``) they are written nowhere: a job never writes into the
        data folder it reads unless told to.
      index_beside_data: write them into ``<data_dir>/.estimax-index/`` instead (the
        programs' ``--index_beside_data``), where no ``train-*`` glob matches them.

    Returns:
      ``input_fn(params)``: ``params["batch_size"]`` is the per-host batch, ``params["context"]``
      (optional) has ``host_index`` and ``num_hosts``. It returns an iterable whose iterators
      yield ``(images [B, S, S, 3], labels [B] int32)`` and have ``get_state``/``set_state`` and
      ``num_skipped``.
    """
    del transpose_input  # documented no-op (see Args)
    if shard_by not in ("global", "file", "record"):
        raise ValueError(f"shard_by must be 'global', 'file' or 'record', got {shard_by!r}")
    if not callable(preprocessing) and preprocessing not in ("resnet", "inception"):
        raise ValueError(
            f"preprocessing must be 'resnet', 'inception' or a callable, got {preprocessing!r}"
        )
    records = RecordSettings(
        data_dir,
        is_training,
        shard_by=shard_by,
        verify_crc=verify_crc,
        skip_bad_records=skip_bad_records,
        bigtable=bigtable,
        index_dir=index_dir,
        index_beside_data=index_beside_data,
    )
    transform = functools.partial(
        image_transform,
        preprocessing,
        is_training,
        image_size,
        num_classes=num_classes,
        use_annotated_bbox=use_annotated_bbox,
        augment=augment,
    )
    fake_images = None
    if bigtable is None and (use_fake_data or is_fake_data_dir(data_dir)):
        fake_images = functools.partial(
            fake.FakeImages,
            image_size=image_size,
            kind=fake_data,
            dtype=np.float32 if preprocessing == "inception" else np.uint8,
            num_examples=None if is_training else fake_eval_examples,
            num_classes=num_classes,
        )
    return ImageNetBatches(
        records,
        transform,
        fake_images,
        is_training=is_training,
        seed=seed,
        num_classes=num_classes,
        mixup_alpha=mixup_alpha,
        num_parallel_calls=num_parallel_calls,
        worker_type=worker_type,
        prefetch=prefetch,
        skip_bad_records=skip_bad_records,
    )


class HostRecords(NamedTuple):
    """The records one host reads: the source, and the ids of this host's records in it (None:
    the Loader takes this host's share itself, from one order over all records for all hosts,
    ``global_order``)."""

    source: loader.RecordSource
    record_ids: np.ndarray | None
    global_order: bool


@dataclasses.dataclass(frozen=True)
class RecordSettings:
    """Where a split's records come from (``input_fn``'s arguments of that name): TFRecord
    shards under ``data_dir`` or the rows of a Bigtable table, and how hosts divide them."""

    data_dir: str | None
    is_training: bool
    shard_by: str = "global"
    verify_crc: bool = True
    skip_bad_records: bool = False
    bigtable: bigtable_lib.BigtableTable | None = None
    index_dir: str | None = None
    index_beside_data: bool = False

    def for_host(self, host_index: int, num_hosts: int) -> HostRecords:
        """The records host ``host_index`` of ``num_hosts`` reads."""
        global_order = self.shard_by == "global" or num_hosts == 1
        if self.bigtable is not None:
            source = self.bigtable.source(self.is_training)
            if global_order:
                return HostRecords(source, None, True)
            # Every host lists the keys and reads every num_hosts-th row.
            rows = loader.host_shard(np.arange(len(source)), host_index, num_hosts)
            return HostRecords(source, rows, False)
        assert self.data_dir is not None
        if not global_order:
            tfrecords, ids = _tfrecord_source(
                self.data_dir,
                self.is_training,
                self.shard_by,
                host_index,
                num_hosts,
                self.verify_crc,
                self.skip_bad_records,
                self.index_dir,
                self.index_beside_data,
            )
            return HostRecords(tfrecords, ids, False)
        files = tfrecord.list_files(file_pattern(self.data_dir, self.is_training))
        # Shards without index files are indexed once across the hosts, not by each.
        tfrecords = loader.TFRecordSource(
            files,
            verify_crc=self.verify_crc,
            skip_bad_records=self.skip_bad_records,
            host_index=host_index,
            num_hosts=num_hosts,
            index_dir=self.index_dir,
            index_beside_data=self.index_beside_data,
        )
        return HostRecords(tfrecords, None, True)


def image_transform(
    preprocessing: str | Callable[..., np.ndarray],
    is_training: bool,
    image_size: int,
    *,
    num_classes: int = NUM_CLASSES,
    use_annotated_bbox: bool = False,
    augment: Callable[[np.ndarray, np.random.Generator], np.ndarray] | None = None,
) -> ImageNetTransform:
    """The preprocessing of ``input_fn``: record -> ``(image, label)`` with ``preprocessing``
    (``'resnet'``, ``'inception'`` or a callable with their signature) and ``augment``."""
    return ImageNetTransform(
        preprocess=preprocessing if callable(preprocessing) else _preprocess_fn(preprocessing),
        is_training=is_training,
        image_size=image_size,
        num_classes=num_classes,
        use_annotated_bbox=use_annotated_bbox,
        augment=augment,
    )


@dataclasses.dataclass(frozen=True)
class ImageNetBatches:
    """``input_fn(params)`` of ``input_fn``: per-host batches of a split's records, preprocessed
    by ``transform()`` (built only for real data: it imports the JPEG stack), or fake images;
    mixed with mixup when training with ``mixup_alpha`` > 0.

    ``params["batch_size"]`` is the per-host batch; ``params["context"]`` (optional) has
    ``host_index`` and ``num_hosts``.
    """

    records: RecordSettings
    transform: Callable[[], ImageNetTransform]
    # FakeImages(batch_size, seed=...) with the rest bound; None: real data.
    fake_images: Callable[..., fake.FakeImages] | None
    is_training: bool
    seed: int = 0
    num_classes: int = NUM_CLASSES
    mixup_alpha: float = 0.0
    num_parallel_calls: int | None = None
    worker_type: str = "auto"
    prefetch: int = 2
    skip_bad_records: bool = False

    def __call__(self, params: dict[str, Any]) -> Any:
        batches = self.batches(int(params["batch_size"]), *_host(params))
        if not (self.is_training and self.mixup_alpha > 0):
            return batches
        from estimax.data import augment as augment_lib

        return augment_lib.MixupBatches(
            batches, self.mixup_alpha, self.num_classes, seed=self.seed, host_index=_host(params)[0]
        )

    def batches(
        self, batch_size: int, host_index: int, num_hosts: int
    ) -> loader.Loader | fake.FakeImages:
        """Host ``host_index``'s batches of ``batch_size``: training shuffles, repeats forever
        and drops the last partial batch; eval is one pass in order."""
        if self.fake_images is not None:
            return self.fake_images(batch_size, seed=self.seed + host_index)
        records = self.records.for_host(host_index, num_hosts)
        return loader.Loader(
            records.source,
            self.transform(),
            batch_size,
            shuffle=self.is_training,
            seed=self.seed,
            num_epochs=None if self.is_training else 1,
            drop_remainder=self.is_training,
            num_workers=self.num_parallel_calls,
            worker_type=self.worker_type,
            prefetch=self.prefetch,
            skip_bad_records=self.skip_bad_records,
            record_ids=records.record_ids,
            num_hosts=num_hosts if records.global_order else 1,
            host_index=host_index if records.global_order else 0,
            order_is_global=records.global_order,
        )
