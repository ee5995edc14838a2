"""tf.Example without TensorFlow: the protobuf messages, encode, decode, schema-based parsing.

The messages are those of ``tensorflow/core/example/feature.proto`` and ``example.proto`` with the
same package (``tensorflow``), names and field numbers, so the bytes are interchangeable with
TensorFlow's::

    message BytesList { repeated bytes value = 1; }
    message FloatList { repeated float value = 1 [packed = true]; }
    message Int64List { repeated int64 value = 1 [packed = true]; }
    message Feature { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                                   Int64List int64_list = 3; } }
    message Features { map<string, Feature> feature = 1; }
    message FeatureList { repeated Feature feature = 1; }
    message FeatureLists { map<string, FeatureList> feature_list = 1; }
    message Example { Features features = 1; }
    message SequenceExample { Features context = 1; FeatureLists feature_lists = 2; }

The descriptors are built at import time with ``descriptor_pb2`` in a private ``DescriptorPool``:
no ``protoc`` step and no generated ``_pb2.py`` to keep in sync with a protobuf version, and a
private pool cannot clash with TensorFlow's own ``tensorflow.Example`` if both are loaded in one
process.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = [
    "BytesList",
    "Example",
    "Feature",
    "FeatureList",
    "FeatureLists",
    "Features",
    "FixedLenFeature",
    "FloatList",
    "Int64List",
    "SequenceExample",
    "VarLenFeature",
    "decode_example",
    "encode_example",
    "parse_example",
]


_F = descriptor_pb2.FieldDescriptorProto


def _field(
    msg: descriptor_pb2.DescriptorProto,
    name: str,
    number: int,
    ftype: int,
    label: int = _F.LABEL_OPTIONAL,
    type_name: str | None = None,
    oneof: int | None = None,
) -> descriptor_pb2.FieldDescriptorProto:
    """Adds field ``name`` = ``number`` of type ``ftype`` to ``msg``."""
    f = msg.field.add(name=name, number=number, type=ftype, label=label)
    if type_name:
        f.type_name = type_name
    if oneof is not None:
        f.oneof_index = oneof
    return f


def _map_message(
    fd: descriptor_pb2.FileDescriptorProto, name: str, field_name: str, entry: str, value: str
) -> None:
    """Adds message ``name`` with one field ``field_name``: a map of strings to ``value``."""
    msg = fd.message_type.add(name=name)
    e = msg.nested_type.add(name=entry)
    e.options.map_entry = True
    _field(e, "key", 1, _F.TYPE_STRING)
    _field(e, "value", 2, _F.TYPE_MESSAGE, type_name=value)
    _field(
        msg,
        field_name,
        1,
        _F.TYPE_MESSAGE,
        _F.LABEL_REPEATED,
        type_name=f".tensorflow.{name}.{entry}",
    )


def _build_file() -> descriptor_pb2.FileDescriptorProto:
    """TensorFlow's example.proto and feature.proto as one file descriptor."""
    F = _F
    fd = descriptor_pb2.FileDescriptorProto(
        name="estimax/tensorflow_example.proto", package="tensorflow", syntax="proto3"
    )
    message, field = fd.message_type.add, _field
    for name, ftype in (
        ("BytesList", F.TYPE_BYTES),
        ("FloatList", F.TYPE_FLOAT),
        ("Int64List", F.TYPE_INT64),
    ):
        f = field(message(name=name), "value", 1, ftype, F.LABEL_REPEATED)
        if ftype != F.TYPE_BYTES:
            f.options.packed = True  # proto3 default; explicit as in feature.proto

    feature = message(name="Feature")
    feature.oneof_decl.add(name="kind")
    field(feature, "bytes_list", 1, F.TYPE_MESSAGE, type_name=".tensorflow.BytesList", oneof=0)
    field(feature, "float_list", 2, F.TYPE_MESSAGE, type_name=".tensorflow.FloatList", oneof=0)
    field(feature, "int64_list", 3, F.TYPE_MESSAGE, type_name=".tensorflow.Int64List", oneof=0)

    _map_message(fd, "Features", "feature", "FeatureEntry", ".tensorflow.Feature")
    field(
        message(name="FeatureList"),
        "feature",
        1,
        F.TYPE_MESSAGE,
        F.LABEL_REPEATED,
        type_name=".tensorflow.Feature",
    )
    _map_message(fd, "FeatureLists", "feature_list", "FeatureListEntry", ".tensorflow.FeatureList")
    field(message(name="Example"), "features", 1, F.TYPE_MESSAGE, type_name=".tensorflow.Features")
    seq = message(name="SequenceExample")
    field(seq, "context", 1, F.TYPE_MESSAGE, type_name=".tensorflow.Features")
    field(seq, "feature_lists", 2, F.TYPE_MESSAGE, type_name=".tensorflow.FeatureLists")
    return fd


_POOL = descriptor_pool.DescriptorPool()
_FILE = _POOL.Add(_build_file()) or _POOL.FindFileByName("estimax/tensorflow_example.proto")


def _cls(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"tensorflow.{name}"))


BytesList = _cls("BytesList")
FloatList = _cls("FloatList")
Int64List = _cls("Int64List")
Feature = _cls("Feature")
Features = _cls("Features")
FeatureList = _cls("FeatureList")
FeatureLists = _cls("FeatureLists")
Example = _cls("Example")
SequenceExample = _cls("SequenceExample")

FeatureValue = bytes | str | int | float | np.ndarray | Sequence[Any]


def _fill_feature(feature: Any, name: str, value: FeatureValue) -> None:
    """Sets one Feature from a Python/numpy value; the kind follows the value's type."""
    if isinstance(value, (bytes, str, bool, int, float, np.generic)):
        value = [value]
    if isinstance(value, np.ndarray):
        arr = value.reshape(-1)
        kind = arr.dtype.kind
        if kind in "iub":
            feature.int64_list.value.extend(arr.astype(np.int64).tolist())
        elif kind == "f":
            feature.float_list.value.extend(arr.astype(np.float32).tolist())
        elif kind == "S":
            feature.bytes_list.value.extend(arr.tolist())
        elif kind in "UO":
            _fill_feature(feature, name, arr.tolist())
        else:
            raise TypeError(
                f"feature {name!r}: numpy dtype {arr.dtype} has no tf.Example kind "
                "(use integer, float or bytes arrays)"
            )
        return
    values = list(value)
    if not values:
        raise TypeError(
            f"feature {name!r}: an empty list has no type; pass a typed empty numpy array, e.g. "
            "np.array([], np.float32), to write an empty float_list"
        )
    if all(isinstance(v, (bytes, str)) for v in values):
        feature.bytes_list.value.extend(
            v.encode("utf-8") if isinstance(v, str) else v for v in values
        )
    elif all(isinstance(v, (bool, int, np.integer, np.bool_)) for v in values):
        feature.int64_list.value.extend(int(v) for v in values)
    elif all(isinstance(v, (bool, int, float, np.integer, np.floating)) for v in values):
        feature.float_list.value.extend(float(v) for v in values)
    else:
        types = sorted({type(v).__name__ for v in values})
        raise TypeError(
            f"feature {name!r}: values must be all bytes/str, all ints or all "
            f"numbers; got a mix of {types}"
        )


def encode_example(features: Mapping[str, FeatureValue]) -> bytes:
    """Serializes a tf.Example.

    Args:
      features: name -> value. ``bytes``/``str`` (UTF-8) -> bytes_list; ``int`` -> int64_list;
        ``float`` -> float_list (float32 on the wire); sequences and numpy arrays of those give
        several values (arrays are flattened). A list mixing ints and floats is a float_list.

    Returns:
      The serialized ``tensorflow.Example``; map keys are sorted (deterministic bytes).
    """
    example = Example()
    fmap = example.features.feature
    for name, value in features.items():
        _fill_feature(fmap[name], name, value)
    return example.SerializeToString(deterministic=True)


def _feature_value(feature: Any) -> list[bytes] | np.ndarray:
    kind = feature.WhichOneof("kind")
    if kind == "bytes_list":
        return list(feature.bytes_list.value)
    if kind == "int64_list":
        return np.asarray(feature.int64_list.value, dtype=np.int64)
    if kind == "float_list":
        return np.asarray(feature.float_list.value, dtype=np.float32)
    return []  # a Feature with no kind set: an empty list, as TensorFlow reads it


def _parse(serialized: bytes) -> Any:
    example = Example()
    try:
        example.ParseFromString(serialized)
    except Exception as e:  # protobuf raises DecodeError (a Message error) on bad bytes
        raise ValueError(f"not a serialized tf.Example ({len(serialized)} bytes): {e}") from e
    return example


def decode_example(serialized: bytes) -> dict[str, list[bytes] | np.ndarray]:
    """Parses a serialized tf.Example into plain values.

    Returns:
      name -> list of bytes (bytes_list), [N] int64 array (int64_list) or [N] float32 array
      (float_list).

    Raises:
      ValueError: the bytes are not a tf.Example.
    """
    example = _parse(serialized)
    return {name: _feature_value(f) for name, f in example.features.feature.items()}


_DTYPES = {
    "string": "bytes",
    "bytes": "bytes",
    bytes: "bytes",
    str: "bytes",
    np.bytes_: "bytes",
    "int64": "int64",
    int: "int64",
    np.int64: "int64",
    "float32": "float32",
    "float": "float32",
    float: "float32",
    np.float32: "float32",
}
_KIND_OF = {"bytes": "bytes_list", "int64": "int64_list", "float32": "float_list"}
_SCALAR = {"int64": np.int64, "float32": np.float32}


def _canonical_dtype(dtype: Any) -> str:
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"unsupported tf.Example dtype {dtype!r}; use 'string'/bytes, 'int64' or 'float32'"
        ) from None


@dataclasses.dataclass(frozen=True)
class FixedLenFeature:
    """A feature with a fixed number of values, as ``tf.io.FixedLenFeature``.

    Attributes:
      shape: the value's shape; ``()`` for a scalar. The feature must hold ``prod(shape)`` values.
      dtype: ``'string'`` (bytes), ``'int64'`` or ``'float32'``.
      default_value: used when the feature is absent; ``None`` makes the feature required.
    """

    shape: tuple[int, ...] = ()
    dtype: Any = "string"
    default_value: Any = None


@dataclasses.dataclass(frozen=True)
class VarLenFeature:
    """A feature with any number of values (possibly none), as ``tf.io.VarLenFeature``.

    Parsed to a [N] array (int64/float32) or a list of bytes; absent -> empty.
    """

    dtype: Any = "string"


def _fixed_default(
    name: str, spec: FixedLenFeature, dtype: str, shape: tuple[int, ...], present: Iterable[str]
) -> Any:
    """The flat values of a FixedLenFeature the example lacks: its ``default_value``.

    Raises:
      ValueError: it has no default (naming the features the example has, ``present``).
    """
    if spec.default_value is None:
        raise ValueError(
            f"tf.Example has no feature {name!r}, which the schema requires "
            f"(FixedLenFeature without default_value); it has: "
            f"{sorted(present)}"
        )
    default = spec.default_value
    size = math.prod(shape)
    if dtype == "bytes":
        default = default.encode("utf-8") if isinstance(default, str) else default
        return [default] * size if isinstance(default, bytes) else list(default)
    return np.broadcast_to(np.asarray(default, dtype=dtype), shape).reshape(-1)


def parse_example(
    serialized: bytes, schema: Mapping[str, FixedLenFeature | VarLenFeature]
) -> dict[str, Any]:
    """Parses a serialized tf.Example against a schema, like ``tf.io.parse_single_example``.

    Args:
      serialized: a serialized tf.Example.
      schema: name -> :class:`FixedLenFeature` or :class:`VarLenFeature`. Features not in the
        schema are ignored.

    Returns:
      name -> value. FixedLen: a scalar (``bytes``, ``np.int64``, ``np.float32``) for shape ``()``,
      else an array of that shape (dtype object for strings). VarLen: a [N] int64/float32 array or
      a list of bytes.

    Raises:
      ValueError: not a tf.Example; a required feature is missing; a feature has the wrong kind
        or the wrong number of values. Messages name the feature.
    """
    example = _parse(serialized)
    fmap = example.features.feature
    out: dict[str, Any] = {}
    for name, spec in schema.items():
        dtype = _canonical_dtype(spec.dtype)
        kind = _KIND_OF[dtype]
        feature = fmap[name] if name in fmap else None
        if feature is not None:
            actual = feature.WhichOneof("kind")
            if actual is not None and actual != kind:
                raise ValueError(
                    f"feature {name!r} is a {actual} but the schema expects {dtype} ({kind})"
                )
            # The repeated field itself (empty when no kind is set): no copy until needed.
            values: Any = getattr(feature, kind).value
        if isinstance(spec, VarLenFeature):
            if feature is None:
                out[name] = [] if dtype == "bytes" else np.zeros([0], dtype=dtype)
            else:
                out[name] = list(values) if dtype == "bytes" else np.asarray(values, dtype=dtype)
            continue
        if not isinstance(spec, FixedLenFeature):
            raise TypeError(
                f"schema entry {name!r} must be a FixedLenFeature or VarLenFeature, "
                f"got {type(spec).__name__}"
            )
        shape = tuple(spec.shape)
        if feature is None:
            values = _fixed_default(name, spec, dtype, shape, fmap.keys())
        elif len(values) != math.prod(shape):
            raise ValueError(
                f"feature {name!r} has {len(values)} values but the schema's "
                f"FixedLenFeature shape {shape} needs {math.prod(shape)}"
            )
        if shape == ():  # the common case (image/encoded, image/class/label): no array
            out[name] = values[0] if dtype == "bytes" else _SCALAR[dtype](values[0])
        elif dtype == "bytes":
            out[name] = np.array(list(values), dtype=object).reshape(shape)
        else:
            out[name] = np.asarray(values, dtype=dtype).reshape(shape)
    return out
