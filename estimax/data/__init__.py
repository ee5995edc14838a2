"""estimax.data: TFRecord files, tf.Example, the loader and the ImageNet input. No JAX here.

The names below are the public API. The image stack (``preprocessing``, ``jpeg``: simplejpeg,
OpenCV) and ``imagenet`` are imported explicitly (``from estimax.data import imagenet``) so that
a converter that only writes TFRecords does not load it; so is ``bigtable`` (Cloud Bigtable rows
as a record source), which loads the Bigtable client only when a table is read.
"""

from estimax.data.example import (
    FixedLenFeature,
    VarLenFeature,
    decode_example,
    encode_example,
    parse_example,
)
from estimax.data.fake import FakeImages
from estimax.data.loader import BadRecordError, Loader, LoaderIterator, TFRecordSource, host_shard
from estimax.data.shard_index import write_index
from estimax.data.tfrecord import (
    CorruptRecordError,
    RecordFile,
    TFRecordWriter,
    list_files,
    read_index,
    read_records,
    sharded_name,
)

__all__ = [
    "BadRecordError",
    "CorruptRecordError",
    "FakeImages",
    "FixedLenFeature",
    "Loader",
    "LoaderIterator",
    "RecordFile",
    "TFRecordSource",
    "TFRecordWriter",
    "VarLenFeature",
    "decode_example",
    "encode_example",
    "host_shard",
    "list_files",
    "parse_example",
    "read_index",
    "read_records",
    "sharded_name",
    "write_index",
]
