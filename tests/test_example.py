"""tf.Example codec: bytes compatible with TensorFlow's, schema parsing, errors.

The fixture bytes are derived by hand from the protobuf wire format and the field numbers of
tensorflow/core/example/{example,feature}.proto (Example.features=1; Features.feature=1 as a map
of entries {key=1, value=2}; Feature.bytes_list=1, float_list=2, int64_list=3; *List.value=1,
numeric lists packed) -- i.e. what TensorFlow's serializer emits -- with an encoder written
here, independent of estimax.data.example.
"""

import struct

import numpy as np
import pytest

from estimax.data import example as ex


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64 -> 10-byte two's complement varint
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:  # length-delimited field (wire type 2)
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _bytes_feature(*values: bytes) -> bytes:
    return _ld(1, b"".join(_ld(1, v) for v in values))


def _float_feature(*values: float) -> bytes:
    return _ld(2, _ld(1, b"".join(struct.pack("<f", v) for v in values)))


def _int64_feature(*values: int) -> bytes:
    return _ld(3, _ld(1, b"".join(_varint(v) for v in values)))


def _example(features: dict[str, bytes]) -> bytes:
    entries = b"".join(_ld(1, _ld(1, k.encode()) + _ld(2, v)) for k, v in features.items())
    return _ld(1, entries)


# An ImageNet-style record (seed 004 / imagenet_to_gcs.py fields), keys in sorted order.
FIXTURE_FEATURES = {
    "image/class/label": _int64_feature(1000),
    "image/class/synset": _bytes_feature(b"n15075141"),
    "image/class/text": _bytes_feature(b"toilet tissue"),
    "image/encoded": _bytes_feature(b"\xff\xd8\xff\xe0fakejpeg\xff\xd9"),
    "image/height": _int64_feature(375),
    "image/object/bbox/xmax": _float_feature(0.75, 1.0),
    "image/object/bbox/xmin": _float_feature(0.125, 0.5),
    "image/object/class/label": _int64_feature(1000, -1),
}
FIXTURE = _example(FIXTURE_FEATURES)


def test_fixture_wire_prefix_is_as_derived():
    # Example.features (field 1, wire type 2) -> tag 0x0a; first map entry -> tag 0x0a; key -> 0x0a
    assert FIXTURE[0] == 0x0A
    assert _int64_feature(3) == bytes([0x1A, 0x03, 0x0A, 0x01, 0x03])
    assert _float_feature(1.0) == bytes([0x12, 0x06, 0x0A, 0x04, 0x00, 0x00, 0x80, 0x3F])


def test_decode_hand_built_fixture():
    d = ex.decode_example(FIXTURE)
    assert set(d) == set(FIXTURE_FEATURES)
    assert d["image/encoded"] == [b"\xff\xd8\xff\xe0fakejpeg\xff\xd9"]
    assert d["image/class/text"] == [b"toilet tissue"]
    assert d["image/class/label"].dtype == np.int64
    np.testing.assert_array_equal(d["image/class/label"], [1000])
    np.testing.assert_array_equal(d["image/object/class/label"], [1000, -1])
    assert d["image/object/bbox/xmin"].dtype == np.float32
    np.testing.assert_array_equal(d["image/object/bbox/xmin"], [0.125, 0.5])


def test_encode_matches_hand_built_bytes():
    encoded = ex.encode_example(
        {
            "image/class/label": 1000,
            "image/class/synset": "n15075141",
            "image/class/text": b"toilet tissue",
            "image/encoded": b"\xff\xd8\xff\xe0fakejpeg\xff\xd9",
            "image/height": np.int64(375),
            "image/object/bbox/xmax": [0.75, 1.0],
            "image/object/bbox/xmin": np.array([0.125, 0.5], np.float64),
            "image/object/class/label": np.array([1000, -1], np.int32),
        }
    )
    assert encoded == FIXTURE


def test_decode_accepts_unpacked_numeric_lists():
    # Older (proto2) writers emit one tag per value; parsers must accept both encodings.
    unpacked = _ld(3, b"".join(_varint(1 << 3 | 0) + _varint(v) for v in (7, 8)))
    d = ex.decode_example(_example({"x": unpacked}))
    np.testing.assert_array_equal(d["x"], [7, 8])


def test_round_trip_types():
    values = {
        "s": "héllo",
        "b": [b"a", b"", b"\x00"],
        "i": [-(2**63), 2**63 - 1],
        "f": np.array([[1.5, -2.0], [3.25, 0.0]], np.float32),
        "bool": True,
        "mixed_numbers": [1, 2.5],
        "empty_f": np.array([], np.float32),
    }
    d = ex.decode_example(ex.encode_example(values))
    assert d["s"] == ["héllo".encode()]
    assert d["b"] == [b"a", b"", b"\x00"]
    np.testing.assert_array_equal(d["i"], [-(2**63), 2**63 - 1])
    np.testing.assert_array_equal(d["f"], [1.5, -2.0, 3.25, 0.0])
    np.testing.assert_array_equal(d["bool"], [1])
    assert d["mixed_numbers"].dtype == np.float32
    assert d["empty_f"].dtype == np.float32 and d["empty_f"].size == 0


def test_encode_errors_name_the_feature():
    with pytest.raises(TypeError, match="feature 'x': an empty list has no type"):
        ex.encode_example({"x": []})
    with pytest.raises(TypeError, match="feature 'y': values must be all bytes/str"):
        ex.encode_example({"y": [b"a", 1]})


SCHEMA = {
    "image/encoded": ex.FixedLenFeature((), "string"),
    "image/format": ex.FixedLenFeature((), "string", default_value="jpeg"),
    "image/class/label": ex.FixedLenFeature([], np.int64, default_value=-1),
    "image/height": ex.FixedLenFeature((), "int64"),
    "image/object/bbox/xmin": ex.VarLenFeature("float32"),
    "image/object/bbox/ymin": ex.VarLenFeature("float32"),
    "image/object/class/label": ex.VarLenFeature("int64"),
}


def test_parse_example_with_schema_and_defaults():
    p = ex.parse_example(FIXTURE, SCHEMA)
    assert p["image/encoded"] == b"\xff\xd8\xff\xe0fakejpeg\xff\xd9"
    assert p["image/format"] == b"jpeg"  # default: absent in the fixture
    assert p["image/class/label"] == 1000 and p["image/class/label"].dtype == np.int64
    assert p["image/height"] == 375
    np.testing.assert_array_equal(p["image/object/bbox/xmin"], [0.125, 0.5])
    assert p["image/object/bbox/ymin"].shape == (0,)  # VarLen absent -> empty
    assert p["image/object/bbox/ymin"].dtype == np.float32
    np.testing.assert_array_equal(p["image/object/class/label"], [1000, -1])
    assert "image/class/synset" not in p


def test_parse_fixed_shape():
    s = ex.encode_example({"v": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "t": [b"a", b"b"]})
    p = ex.parse_example(
        s,
        {
            "v": ex.FixedLenFeature((2, 3), "float32"),
            "t": ex.FixedLenFeature((2,), "string"),
            "d": ex.FixedLenFeature((2,), "float32", default_value=0.5),
        },
    )
    np.testing.assert_array_equal(p["v"], [[1, 2, 3], [4, 5, 6]])
    assert list(p["t"]) == [b"a", b"b"]
    np.testing.assert_array_equal(p["d"], [0.5, 0.5])


def test_parse_errors():
    with pytest.raises(ValueError, match=r"no feature 'image/width', which the schema requires"):
        ex.parse_example(FIXTURE, {"image/width": ex.FixedLenFeature((), "int64")})
    with pytest.raises(
        ValueError,
        match=r"feature 'image/encoded' is a bytes_list but the "
        r"schema expects int64",
    ):
        ex.parse_example(FIXTURE, {"image/encoded": ex.FixedLenFeature((), "int64")})
    with pytest.raises(ValueError, match=r"feature 'image/object/class/label' has 2 values but"):
        ex.parse_example(FIXTURE, {"image/object/class/label": ex.FixedLenFeature((), "int64")})
    with pytest.raises(ValueError, match="not a serialized tf.Example"):
        ex.decode_example(b"\xff\xff\xff")
    with pytest.raises(ValueError, match="unsupported tf.Example dtype"):
        ex.parse_example(FIXTURE, {"x": ex.VarLenFeature("float16")})


# Written once by TensorFlow 2.21 (tf.io.TFRecordWriter + tf.train.Example.SerializeToString)
# from these values; see the generating code in the docstring of test_reads_tensorflow_file.
TF_FIXTURE = __import__("pathlib").Path(__file__).parent / "data" / "tf_written.tfrecord"


def test_reads_tensorflow_file(tmp_path):
    """tests/data/tf_written.tfrecord was made by::

        ex1 = {"image/encoded": b([b"\\xff\\xd8\\xff\\xe0not-really-a-jpeg\\xff\\xd9"]),
               "image/format": b([b"JPEG"]), "image/class/label": i([1000]),
               "image/class/synset": b([b"n15075141"]), "image/height": i([375]),
               "image/width": i([500]), "image/object/bbox/xmin": f([0.125, 0.5]),
               "image/object/bbox/ymax": f([0.75, 1.0]),
               "image/object/class/label": i([1000, -1]), "big": i([2**63 - 1, -2**63])}
        ex2 = {"image/class/label": i([1]), "empty_floats": f([]),
               "text": b(["héllo".encode(), b""])}

    with b/i/f building tf.train.Feature(bytes_list/int64_list/float_list=...).
    """
    from estimax.data import tfrecord

    records = list(tfrecord.read_records(str(TF_FIXTURE)))  # CRCs verified
    assert len(records) == 2
    d1, d2 = (ex.decode_example(r) for r in records)
    assert d1["image/encoded"] == [b"\xff\xd8\xff\xe0not-really-a-jpeg\xff\xd9"]
    assert d1["image/format"] == [b"JPEG"] and d1["image/class/synset"] == [b"n15075141"]
    np.testing.assert_array_equal(d1["image/class/label"], [1000])
    np.testing.assert_array_equal(d1["image/height"], [375])
    np.testing.assert_array_equal(d1["image/object/bbox/xmin"], [0.125, 0.5])
    np.testing.assert_array_equal(d1["image/object/bbox/ymax"], [0.75, 1.0])
    np.testing.assert_array_equal(d1["image/object/class/label"], [1000, -1])
    np.testing.assert_array_equal(d1["big"], [2**63 - 1, -(2**63)])
    np.testing.assert_array_equal(d2["image/class/label"], [1])
    assert d2["empty_floats"].dtype == np.float32 and d2["empty_floats"].size == 0
    assert d2["text"] == ["héllo".encode(), b""]
    # Our encoder writes the same content (TensorFlow's map order is hash order, so compare
    # decoded values, not bytes) ...
    again = ex.decode_example(ex.encode_example({k: v for k, v in d1.items()}))
    assert again.keys() == d1.keys()
    for k in d1:
        np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(d1[k]))
    # ... and our writer frames TensorFlow's records into TensorFlow's exact file bytes.
    out = tmp_path / "rewritten"
    with tfrecord.TFRecordWriter(str(out)) as w:
        for r in records:
            w.write(r)
    assert out.read_bytes() == TF_FIXTURE.read_bytes()
