"""estimax.migrate on checkpoints written by real TensorFlow (tests/data/tf_checkpoints).

The fixtures and TensorFlow's own logits come from scripts/make_tf_checkpoints.py (run in the
TensorFlow venv); these tests need no TensorFlow.
"""

import os
import shutil

import jax
import numpy as np
import pytest

from estimax import migrate
from estimax.migrate import load as migrate_load
from estimax.migrate import names as migrate_names
from estimax.migrate import tf_checkpoint
from estimax.models import (
    InceptionV3Tiny,
    InceptionV4Tiny,
    ResNet50,
    ResNetTiny,
    ResNetTinyBottleneck,
)
from estimax.tools import convert

DATA = os.path.join(os.path.dirname(__file__), "data", "tf_checkpoints")


@pytest.fixture(scope="module")
def ref():
    return np.load(os.path.join(DATA, "reference.npz"))


FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _zeros_like_init(model, images):
    """The model's variables as zeros: every one is then loaded from the checkpoint (asserted),
    and no initialiser is compiled (over a minute for Inception on a loaded 2-core machine)."""
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), images, train=False))
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract)


def _images(ref, name):
    # scripts/make_tf_checkpoints.py's to_float.
    return (ref[f"{name}/pixels"].astype(np.float32) / 127.5 - 1.0).astype(np.float32)


# ------------------------------------------------------------------ the reader


def test_every_numeric_dtype_reads_bit_exactly(ref):
    reader = migrate.CheckpointReader(os.path.join(DATA, "dtypes"))
    names = reader.variables()
    assert len(names) == 13
    for name in names:
        got = reader.get_tensor(name)
        want = ref[name]
        assert got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name  # bfloat16: its bits, kept as uint16
    assert names["dtypes/bfloat16"].dtype_name == "bfloat16"
    assert str(reader.get_tensor("dtypes/bfloat16").dtype) == "bfloat16"
    assert reader.get_tensor("dtypes/int64")[0] == 1 << 40


def test_list_prints_names_dtypes_shapes(capsys):
    assert convert.main(["tf-checkpoint", f"--checkpoint={DATA}/resnet_tiny", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "conv2d/kernel\tfloat32\t[7, 7, 3, 8]" in lines
    assert "global_step\tint64\t[]" in lines
    assert "dense/kernel/Momentum\tfloat32\t[16, 10]" in lines
    assert len(lines) == 61


def test_checkpoint_state_relative_absolute_and_copied(tmp_path):
    src = os.path.join(DATA, "resnet_tiny")
    assert migrate.resolve_checkpoint(src) == os.path.join(src, "model.ckpt-3")
    assert migrate.resolve_checkpoint(src + "/model.ckpt-3.index") == src + "/model.ckpt-3"
    copy = tmp_path / "copied"
    shutil.copytree(src, copy)
    # A plain Saver's absolute path, from the machine the model_dir was copied from.
    (copy / "checkpoint").write_text(
        'model_checkpoint_path: "/gone/elsewhere/model.ckpt-3"\n'
        'all_model_checkpoint_paths: "/gone/elsewhere/model.ckpt-3"\n'
    )
    assert migrate.resolve_checkpoint(str(copy)) == str(copy / "model.ckpt-3")
    (copy / "checkpoint").write_text(f'model_checkpoint_path: "{copy}/model.ckpt-3"\n')
    assert migrate.CheckpointReader(str(copy)).global_step() == 3
    (copy / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-9"\n')
    with pytest.raises(migrate.TFCheckpointError, match="model.ckpt-9"):
        migrate.resolve_checkpoint(str(copy))
    with pytest.raises(migrate.TFCheckpointError, match="no TensorFlow checkpoint"):
        migrate.resolve_checkpoint(str(tmp_path / "nothing"))


def test_damage_is_found_and_named(tmp_path):
    copy = tmp_path / "damaged"
    shutil.copytree(os.path.join(DATA, "resnet_tiny"), copy)
    data = copy / "model.ckpt-3.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    reader = migrate.CheckpointReader(str(copy))
    info = reader.variables()["dense/kernel"]
    raw[info.offset + 5] ^= 0x40
    data.write_bytes(bytes(raw))
    reader = migrate.CheckpointReader(str(copy))
    with pytest.raises(migrate.TFCheckpointError, match=r"data-00000-of-00001: CRC32C mismatch"):
        reader.get_tensor("dense/kernel")
    reader.get_tensor("conv2d/kernel")  # the others still read
    index = copy / "model.ckpt-3.index"
    raw = bytearray(index.read_bytes())
    raw[20] ^= 0x01
    index.write_bytes(bytes(raw))
    with pytest.raises(migrate.TFCheckpointError, match=r"model.ckpt-3.index: CRC32C mismatch"):
        migrate.CheckpointReader(str(copy))
    index.write_bytes(bytes(raw[:30]))
    with pytest.raises(migrate.TFCheckpointError, match="not a TensorFlow checkpoint index"):
        migrate.CheckpointReader(str(copy))


def test_what_is_not_read_is_refused_naming_the_file(tmp_path):
    reader = migrate.CheckpointReader(os.path.join(DATA, "strings"))
    with pytest.raises(
        migrate.TFCheckpointError, match=r"strings/model.ckpt.index: words is a str"
    ):
        reader.get_tensor("words")
    reader = migrate.CheckpointReader(os.path.join(DATA, "partitioned"))
    assert list(reader.variables()) == ["sliced"]  # the slices' own keys are not variables
    with pytest.raises(migrate.TFCheckpointError, match="partitioned variable"):
        reader.get_tensor("sliced")
    # A snappy-compressed block (TF 1.0/1.1): the block's type byte says so; its CRC covers it.
    copy = tmp_path / "snappy"
    shutil.copytree(os.path.join(DATA, "dtypes"), copy)
    index = copy / "model.ckpt.index"
    raw = bytearray(index.read_bytes())
    _set_first_block_type(raw, 1)
    index.write_bytes(bytes(raw))
    with pytest.raises(migrate.TFCheckpointError, match=r"model.ckpt.index: snappy-compressed"):
        migrate.CheckpointReader(str(copy))


def _set_first_block_type(raw: bytearray, kind: int) -> None:
    """Rewrites the compression byte of the table's first data block, CRC updated."""
    import struct

    import crc32c

    footer = bytes(raw[-48:])
    _, p = tf_checkpoint._varint(footer, 0, "")
    _, p = tf_checkpoint._varint(footer, p, "")
    index_offset, p = tf_checkpoint._varint(footer, p, "")
    index_size, _ = tf_checkpoint._varint(footer, p, "")
    block = tf_checkpoint._read_block(bytes(raw), index_offset, index_size, "")
    _, handle = next(tf_checkpoint._block_entries(block, ""))
    offset, p = tf_checkpoint._varint(handle, 0, "")
    size, _ = tf_checkpoint._varint(handle, p, "")
    raw[offset + size] = kind
    crc = crc32c.crc32c(bytes(raw[offset : offset + size + 1]))
    masked = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    struct.pack_into("<I", raw, offset + size + 1, masked)


def test_object_stores(object_store):
    from estimax import storage

    base, _ = object_store
    fs, _ = storage.filesystem(base)
    src = os.path.join(DATA, "resnet_tiny")
    for name in os.listdir(src):
        fs.put_file(os.path.join(src, name), f"{base}/resnet/{name}")
    reader = migrate.CheckpointReader(f"{base}/resnet")
    local = migrate.CheckpointReader(src)
    assert reader.global_step() == 3
    for name in ("conv2d/kernel", "dense/bias", "batch_normalization_3/moving_variance"):
        np.testing.assert_array_equal(reader.get_tensor(name), local.get_tensor(name))


# ------------------------------------------------------------------ name maps and logits


@pytest.mark.parametrize(
    "fixture,model_cls",
    [
        ("resnet_tiny", ResNetTiny),
        ("resnet_tiny_bottleneck", ResNetTinyBottleneck),
        ("resnet_tiny_bf16prefix", ResNetTiny),
    ],
)
def test_resnet_logits_equal_tensorflows(ref, fixture, model_cls):
    key = fixture.replace("_bf16prefix", "")
    images = _images(ref, key)
    model = model_cls(num_classes=10)
    variables = _zeros_like_init(model, images)
    loaded, _, _, report = migrate_load.load_tf_state(
        os.path.join(DATA, fixture), "resnet", variables
    )
    logits = np.asarray(jax.jit(lambda v, x: model.apply(v, x, train=False))(loaded, images))
    np.testing.assert_allclose(logits, ref[f"{key}/logits"], atol=1e-4, rtol=0)
    assert report.step == 3 and not report.missing and not report.mismatched
    assert not report.unmapped()  # only slots and global_step were left


def test_resnet_momentum_slots_into_optax_state():
    import optax

    model = ResNetTiny(num_classes=10)
    variables = _zeros_like_init(model, np.zeros((1, 32, 32, 3), np.float32))
    opt = optax.sgd(optax.constant_schedule(0.1), momentum=0.9, nesterov=True)
    opt_state = opt.init(variables["params"])
    _, loaded_opt, _, report = migrate_load.load_tf_state(
        os.path.join(DATA, "resnet_tiny_bf16prefix"), "resnet", variables, opt_state
    )
    reader = migrate.CheckpointReader(os.path.join(DATA, "resnet_tiny_bf16prefix"))
    trace = loaded_opt[0].trace
    np.testing.assert_array_equal(
        trace["final_dense"]["kernel"], reader.get_tensor("bfloat16/dense/kernel/Momentum")
    )
    np.testing.assert_array_equal(
        trace["block_group1"]["block0"]["proj_conv"]["kernel"],
        reader.get_tensor("bfloat16/conv2d_1/kernel/Momentum"),
    )
    assert int(loaded_opt[1].count) == 3  # the schedule continues at TF's global_step
    assert len(report.slots) == 23 and not report.unused[1:]  # only global_step's name
    assert np.abs(trace["final_dense"]["kernel"]).sum() > 0


def test_inception_v3_logits_ema_and_rmsprop_slots(ref):
    from estimax.programs.inception_v3 import make_optimizer

    images = _images(ref, "inception_v3_tiny")
    model = InceptionV3Tiny(num_classes=11)
    variables = _zeros_like_init(model, images)
    apply = jax.jit(lambda v, x: model.apply(v, x, train=False))
    opt_state = make_optimizer("RMS", lambda step: 0.01).init(variables["params"])
    assert float(opt_state[0].nu["Logits"]["kernel"][0, 0]) == 1.0  # TF's RMSProp starts at 1
    path = os.path.join(DATA, "inception_v3_tiny")
    raw, _, _, _ = migrate_load.load_tf_state(path, "inception_v3", variables, ema=False)
    logits, aux = apply(raw, images)
    np.testing.assert_allclose(logits, ref["inception_v3_tiny/logits"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(aux, ref["inception_v3_tiny/aux_logits"], atol=1e-4, rtol=0)

    loaded, loaded_opt, ema, report = migrate_load.load_tf_state(
        path, "inception_v3", variables, opt_state, variables["params"]
    )
    # The original evaluated the moving averages: the EMA weights with the statistics' shadows.
    ema_logits, _ = apply({**loaded, "params": ema}, images)
    np.testing.assert_allclose(ema_logits, ref["inception_v3_tiny/ema_logits"], atol=1e-4, rtol=0)
    reader = migrate.CheckpointReader(path)
    name = "InceptionV3/Mixed_5c/Branch_1/Conv_1_0c_5x5/weights"
    kernel = ("Mixed_5c", "branch_5x5_2", "conv", "kernel")
    nu, trace = loaded_opt[0].nu, loaded_opt[2].trace
    np.testing.assert_array_equal(_at(nu, kernel), reader.get_tensor(name + "/RMSProp"))
    np.testing.assert_array_equal(_at(trace, kernel), reader.get_tensor(name + "/RMSProp_1"))
    np.testing.assert_array_equal(
        _at(ema, kernel), reader.get_tensor(name + "/ExponentialMovingAverage")
    )
    assert int(loaded_opt[1].count) == report.step == 2
    assert not report.unmapped() and not report.missing
    # --ema=none: the average starts from the loaded weights, not from the initial ones.
    _, _, plain_ema, _ = migrate_load.load_tf_state(
        path, "inception_v3", variables, ema_params=variables["params"], ema=False
    )
    np.testing.assert_array_equal(_at(plain_ema, kernel), reader.get_tensor(name))


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return np.asarray(tree)


def test_missing_and_mismatch_give_one_line_each(tmp_path):
    model = ResNetTiny(num_classes=7)  # another head
    x = np.zeros((1, 32, 32, 3))
    # Real initial values (a fresh variable keeps them), compiled at XLA's level 0: the same
    # values, compiled several times faster (as tests/test_models.py).
    init = jax.jit(lambda x: model.init(jax.random.PRNGKey(0), x, train=False))
    variables = init.lower(x).compile(FAST_COMPILE)(x)
    path = os.path.join(DATA, "resnet_tiny")
    with pytest.raises(migrate_load.MappingError) as e:
        migrate_load.load_tf_state(path, "resnet", variables)
    lines = str(e.value).splitlines()
    assert (
        "shape mismatch: dense/kernel is [16, 10] in the checkpoint, params/final_dense/"
        "kernel is [16, 7]" in lines[1]
    )
    assert "shape mismatch: dense/bias is [10]" in lines[2]
    loaded, _, _, report = migrate_load.load_tf_state(
        path, "resnet", variables, allow_mismatch=True
    )
    assert report.fresh == ["params/final_dense/kernel", "params/final_dense/bias"]
    np.testing.assert_array_equal(
        loaded["params"]["final_dense"]["kernel"], variables["params"]["final_dense"]["kernel"]
    )
    # A model with more blocks than the checkpoint: the missing tensors, by name and shape.
    big = ResNetTiny(num_classes=10, stage_sizes=(2, 1))
    variables = _zeros_like_init(big, np.zeros((1, 32, 32, 3)))
    with pytest.raises(
        migrate_load.MappingError, match=r"missing: conv2d_\d+/kernel \(for params/"
    ):
        migrate_load.load_tf_state(path, "resnet", variables)


def test_convert_cli_refuses_a_model_that_does_not_fit(tmp_path, capsys):
    code = convert.main(
        [
            "tf-checkpoint",
            f"--checkpoint={DATA}/resnet_tiny",
            f"--model_dir={tmp_path}/model",
            "--model=resnet",
            "--resnet_depth=18",
            "--image_size=32",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("estimax-convert tf-checkpoint: error: ")
    assert "shape mismatch: conv2d/kernel is [7, 7, 3, 8] in the checkpoint" in err
    assert "Traceback" not in err
    assert not os.path.exists(tmp_path / "model")  # refused before anything is written
    code = convert.main(["tf-checkpoint", f"--checkpoint={tmp_path}/none", "--list"])
    assert code == 2 and "no TensorFlow checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model,cls,kwargs",
    [
        ("resnet", ResNet50, {}),
        ("inception_v3", InceptionV3Tiny, {}),
        ("inception_v4", InceptionV4Tiny, {}),
    ],
)
def test_maps_cover_every_variable_once(model, cls, kwargs):
    """Every Flax variable has exactly one TensorFlow name, and names are unique."""
    size = 64 if model == "resnet" else 107
    net = cls(**kwargs)
    variables = jax.eval_shape(
        lambda: net.init(jax.random.PRNGKey(0), np.zeros((1, size, size, 3)), train=False)
    )
    entries = migrate_names.MODEL_MAPS[model](variables)
    ours = {
        (c, tuple(k.key for k in path))
        for c in ("params", "batch_stats")
        for path, _ in jax.tree_util.tree_flatten_with_path(variables[c])[0]
    }
    mapped = [(e.collection, e.path) for e in entries]
    assert sorted(mapped) == sorted(ours)
    assert len({e.tf_name for e in entries}) == len(entries)
    if model == "resnet":  # ResNet-50: 53 conv/BN pairs, numbered in creation order
        names = {e.tf_name for e in entries}
        assert "conv2d_52/kernel" in names and "conv2d_53/kernel" not in names
        assert "batch_normalization_52/moving_variance" in names
        by_path = {e.path: e.tf_name for e in entries}
        # group 1 block 0: projection (conv2d_1) before the block's own convs (conv2d_2..4)
        assert by_path[("block_group1", "block0", "proj_conv", "kernel")] == "conv2d_1/kernel"
        assert by_path[("block_group1", "block0", "conv1", "kernel")] == "conv2d_2/kernel"
        assert by_path[("block_group2", "block0", "proj_conv", "kernel")] == "conv2d_11/kernel"


def test_a_big_endian_bundle_is_refused(tmp_path):
    from reliability.fuzz_targets import table_block, table_file

    # BundleHeaderProto{num_shards: 1, endianness: BIG, version {producer: 1}}
    header = b"\x08\x01\x10\x01\x1a\x02\x08\x01"
    (tmp_path / "model.ckpt-1.index").write_bytes(table_file([table_block([(b"", header)])]))
    with pytest.raises(migrate.TFCheckpointError, match=r"model.ckpt-1.index: a big-endian"):
        migrate.CheckpointReader(str(tmp_path / "model.ckpt-1"))
    # The same bundle little-endian reads (an empty checkpoint): the table itself was right.
    header = b"\x08\x01\x1a\x02\x08\x01"
    (tmp_path / "model.ckpt-1.index").write_bytes(table_file([table_block([(b"", header)])]))
    assert migrate.CheckpointReader(str(tmp_path / "model.ckpt-1")).variables() == {}


def test_inception_program_names_match_the_tf_checkpoint(tmp_path, capsys):
    """The inception_v3 program's full-width model has every name the TF-written (thin)
    checkpoint has: the conversion fails only on widths, one line per tensor, none missing."""
    code = convert.main(
        [
            "tf-checkpoint",
            f"--checkpoint={DATA}/inception_v3_tiny",
            f"--model_dir={tmp_path}/model",
            "--model=inception_v3",
            "--num_classes=11",
            "--width=112",
            "--height=112",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    lines = err.splitlines()[1:-1]
    assert lines and all(line.strip().startswith("shape mismatch: InceptionV3/") for line in lines)
    assert any("InceptionV3/Mixed_7c/Branch_1/Conv2d_0c_3x1/weights" in line for line in lines)
    assert not os.path.exists(tmp_path / "model")  # nothing written


def test_inception_v4_logits_equal_tensorflows(ref):
    images = _images(ref, "inception_v4_tiny")
    model = InceptionV4Tiny(num_classes=11)
    variables = _zeros_like_init(model, images)
    loaded, _, _, report = migrate_load.load_tf_state(
        os.path.join(DATA, "inception_v4_tiny"), "inception_v4", variables
    )
    logits, aux = jax.jit(lambda v, x: model.apply(v, x, train=False))(loaded, images)
    np.testing.assert_allclose(logits, ref["inception_v4_tiny/logits"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(aux, ref["inception_v4_tiny/aux_logits"], atol=1e-4, rtol=0)
    assert report.step == 5 and not report.missing and not report.unused[1:]


def test_export_savedmodel_without_tensorflow_says_what_to_install(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("tensorflow") is not None:
        pytest.skip(
            "checks the message shown where TensorFlow is missing, and it is installed here "
            "(tests/test_migrate_tf.py tests the export itself)"
        )
    from estimax.export.formats import savedmodel

    export = tmp_path / "1"
    export.mkdir()
    for name in ("serving.json", "model.jaxexport", "variables.msgpack", "export_check.json"):
        (export / name).write_text("{}")
    assert savedmodel.main([f"--export_dir={export}", f"--output_dir={tmp_path}/out"]) == 2
    err = capsys.readouterr().err
    assert "install the estimax[tf] extra" in err and "Traceback" not in err


def test_a_checkpoint_in_two_data_shards(ref):
    reader = migrate.CheckpointReader(os.path.join(DATA, "sharded"))
    assert reader.num_shards == 2
    assert {i.shard_id for i in reader.variables().values()} == {0, 1}
    for name in ("on_cpu0", "on_cpu1"):
        np.testing.assert_array_equal(reader.get_tensor(name), ref[f"sharded/{name}"])
