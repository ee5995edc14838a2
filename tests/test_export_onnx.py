"""`estimax export-onnx`: a float-array export, a declared image_preprocessing export and a
ResNet export become ONNX models that onnxruntime runs to estimax's classes."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the estimax[onnx] extra is not installed")
ort = pytest.importorskip("onnxruntime", reason="the estimax[onnx] extra is not installed")

sys.path.insert(0, os.path.dirname(__file__))
import export_formats_fixtures as fx  # noqa: E402
import serving_fixtures  # noqa: E402

from estimax import command  # noqa: E402
from estimax.export.servable import Servable  # noqa: E402


def _run(path, features):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, features), strict=True)), session


def _export_onnx(tmp_path, version, capsys, name):
    base = os.path.dirname(version)
    out = str(tmp_path / "deeper" / "onnx" / f"{name}.onnx")  # parents are created
    assert command.main(["export-onnx", f"--model_base_path={base}", f"--output={out}"]) == 0
    return out, capsys.readouterr().out


@pytest.fixture(scope="module")
def jpegs():
    return serving_fixtures.make_jpegs(24)


def test_float_export_to_onnx_answers_estimaxs_classes(tmp_path, capsys):
    version = fx.float_export(str(tmp_path))
    out, said = _export_onnx(tmp_path, version, capsys, "mlp")
    assert "inputs: input float32[batch, 12]" in said and "client's job" not in said
    x = np.random.default_rng(5).normal(size=(7, 12)).astype(np.float32)  # a new batch size
    got, session = _run(out, {"input": x})
    want = Servable(version).run({"input": x})
    np.testing.assert_array_equal(got["classes"], want["classes"])
    np.testing.assert_allclose(got["probabilities"], want["probabilities"], atol=1e-5)
    np.testing.assert_array_equal(got["top_k_classes"], want["top_k_classes"])
    assert [i.shape for i in session.get_inputs()] == [["batch", 12]]


def test_image_preprocessing_export_to_onnx_states_the_clients_preprocessing(
    tmp_path, capsys, jpegs
):
    images, labels = jpegs
    version = fx.image_export(str(tmp_path), images, labels)
    out, said = _export_onnx(tmp_path, version, capsys, "cnn")
    assert "image preprocessing is the client's job (not in the graph): image v1" in said
    model = onnx.load(out)
    meta = {p.key: p.value for p in model.metadata_props}
    record = json.loads(meta["estimax.preprocessing"])
    assert record["params"]["channels"] == "bgr" and record["params"]["size"] == 24
    # The client's side: the recorded recipe (here estimax's own implementation of it).
    from estimax.export.preprocess import from_spec

    pixels = np.stack([from_spec(record)(b) for b in images])
    got, _ = _run(out, {"input": pixels})
    want = Servable(version).predict_images(images)
    np.testing.assert_array_equal(got["classes"], want["classes"])
    diff = np.abs(got["probabilities"] - want["probabilities"]).max()
    assert diff <= 1e-5, diff


def test_resnet_export_to_onnx_answers_estimaxs_classes(tmp_path, capsys, jpegs):
    images, labels = jpegs
    version = fx.resnet_export(str(tmp_path), images, labels)
    out, said = _export_onnx(tmp_path, version, capsys, "resnet")
    assert "inputs: input uint8[batch, 32, 32, 3]" in said and "resnet_eval v1" in said
    servable = Servable(version)
    pixels = servable.prepare({"image_bytes": images})["input"]
    got, _ = _run(out, {"input": pixels})
    want = servable.run({"input": pixels})
    np.testing.assert_array_equal(got["classes"], want["classes"])
    diff = np.abs(got["probabilities"] - want["probabilities"]).max()
    with capsys.disabled():
        print(f"ONNX Runtime vs estimax, tiny ResNet, {len(images)} JPEGs: max dprob {diff:.2e}")
    assert diff <= 1e-5


def test_a_disagreeing_onnx_model_is_not_written(tmp_path, capsys):
    version = fx.float_export(str(tmp_path))
    fx.disagree(version)
    out = str(tmp_path / "refused.onnx")
    base = os.path.dirname(version)
    assert command.main(["export-onnx", f"--model_base_path={base}", f"--output={out}"]) == 2
    err = capsys.readouterr().err
    assert "ONNX Runtime's classes differ from estimax's for 1 of 16 check inputs" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".onnx-")]


def test_an_export_without_check_inputs_or_an_existing_output_is_one_line(tmp_path, capsys):
    base = serving_fixtures.export_dense(str(tmp_path))  # published with check inputs
    out = tmp_path / "exists.onnx"
    out.write_bytes(b"")
    assert command.main(["export-onnx", f"--model_base_path={base}", f"--output={out}"]) == 2
    assert "exists: give a new --output" in capsys.readouterr().err
    os.remove(os.path.join(base, "1", "export_check.json"))
    assert command.main(["export-onnx", f"--model_base_path={base}", f"--output={out}.new"]) == 2
    err = capsys.readouterr().err
    assert "has no export_check.json" in err and "Traceback" not in err


def test_an_op_without_translation_is_named(tmp_path):
    import jax
    import jax.numpy as jnp

    from estimax.export.formats import stablehlo_onnx

    exported = jax.export.export(jax.jit(lambda v, x: jnp.sort(x * v)), platforms=("cpu",))(
        jax.ShapeDtypeStruct((), np.float32), jax.ShapeDtypeStruct((4,), np.float32)
    )
    with pytest.raises(stablehlo_onnx.UnsupportedOpError, match="stablehlo.sort"):
        stablehlo_onnx.to_onnx(
            exported.mlir_module(),
            exported.platforms,
            [np.float32(2)],
            [("input", np.dtype(np.float32), [4])],
            [("output", np.dtype(np.float32))],
        )


def test_a_bfloat16_export_runs_in_float32_within_its_tolerance(tmp_path, capsys, jpegs):
    import estimax as ex
    from estimax import export

    images, labels = jpegs
    est = serving_fixtures.build_estimator(str(tmp_path / "model"))  # bfloat16 compute
    pixels = serving_fixtures.preprocess_all(images)
    est.train(ex.numpy_input_fn(pixels, labels, num_epochs=None), max_steps=2)
    version = export.export_version(
        est,
        str(tmp_path / "serving"),
        preprocessing=export.resnet_eval(serving_fixtures.IMAGE_SIZE),
        check_inputs=images[:8],
        atol=2e-2,  # the programs' tolerance for bfloat16 exports
    )
    est.close()
    out, said = _export_onnx(tmp_path, version, capsys, "bf16")
    got, session = _run(out, {"input": pixels})
    assert session.get_inputs()[0].type == "tensor(uint8)"
    np.testing.assert_array_equal(
        got["classes"], Servable(version).run({"input": pixels})["classes"]
    )


def _onnx_of(fn, weights, *inputs, batch=True):
    """``fn(weights, *inputs)`` exported with a symbolic batch, translated and run by ONNX
    Runtime on ``inputs``; (ONNX Runtime's answer, JAX's)."""
    import jax

    from estimax.export.formats import stablehlo_onnx

    (b,) = jax.export.symbolic_shape("b")
    specs = [
        jax.ShapeDtypeStruct(((b,) if batch else (x.shape[0],)) + x.shape[1:], x.dtype)
        for x in inputs
    ]
    exported = jax.export.export(jax.jit(fn), platforms=("cpu",))(
        jax.ShapeDtypeStruct(weights.shape, weights.dtype), *specs
    )
    want = np.asarray(jax.jit(fn)(weights, *inputs))  # out-of-range ids clamped, not refused
    model = stablehlo_onnx.to_onnx(
        exported.mlir_module(),
        exported.platforms,
        [weights],
        [(f"x{i}", x.dtype, [None, *x.shape[1:]]) for i, x in enumerate(inputs)],
        [("output", want.dtype)],
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {f"x{i}": x for i, x in enumerate(inputs)})
    return got, want


GATHERS = {
    # an embedding lookup, ids out of range clamped as JAX clamps them
    "rows": lambda w, ids: w[ids],
    "rows_out_of_range": lambda w, ids: w[ids + 40],
    "first_token": lambda w, x: x[:, 0] * w[0, 0],  # a dynamic_gather
    "last_token": lambda w, x: x[:, -1, 1:3] + w[0, :2],
    "column": lambda w, ids: w[:, ids[0, 0] % 6][None] * jnp.ones((ids.shape[0], 1)),
    "per_example": lambda w, x: x[
        jnp.arange(x.shape[0]), x.shape[1] - 1 - jnp.arange(x.shape[0]) % 2
    ],
    "dynamic_slice": lambda w, ids: (
        jax.lax.dynamic_slice(w, (ids[0, 0], 1), (3, 2))[None] + jnp.zeros((ids.shape[0], 1, 1))
    ),
}


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_gathers_and_dynamic_slices_match_jax(name):
    rng = np.random.default_rng(1)
    table = rng.normal(size=(10, 6)).astype(np.float32)
    if name in ("first_token", "last_token", "per_example"):
        x = rng.normal(size=(5, 4, 6)).astype(np.float32)
    else:
        x = rng.integers(-3, 12, size=(5, 4)).astype(np.int32)
    got, want = _onnx_of(GATHERS[name], table, x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_text_model_with_three_int32_inputs_to_onnx(tmp_path, capsys):
    version = fx.text_export(str(tmp_path))
    assert command.main(["export-check", f"--model_base_path={os.path.dirname(version)}"]) == 0
    assert "8 examples match" in capsys.readouterr().out
    out, said = _export_onnx(tmp_path, version, capsys, "bert")
    assert "inputs: input_ids int32[batch, 8], input_mask int32[batch, 8], segment_ids" in said
    features = fx.text_features(11, seed=3)  # new examples, another batch size
    got, session = _run(out, features)
    want = Servable(version).run(features)
    np.testing.assert_array_equal(got["classes"], want["classes"])
    diff = np.abs(got["probabilities"] - want["probabilities"]).max()
    with capsys.disabled():
        print(f"ONNX Runtime vs estimax, tiny BERT, 11 examples: max dprob {diff:.2e}")
    assert diff <= 1e-5
    assert sorted(i.name for i in session.get_inputs()) == sorted(fx.TEXT_INPUTS)
    _assert_answers_the_stored_check(out, version, {k: np.int32 for k in fx.TEXT_INPUTS})


def _assert_answers_the_stored_check(path, version, dtypes):
    # The number: within 1e-5 (fp32) of estimax's recorded answers on the check inputs.
    check, expected = fx.stored_check(version, dtypes)
    got, _ = _run(path, check)
    np.testing.assert_array_equal(got["classes"], expected["classes"])
    assert np.abs(got["probabilities"] - expected["probabilities"]).max() <= 1e-5


def test_mixed_dtype_inputs_to_onnx(tmp_path, capsys):
    # float32 pixels, int64 ids (computed in int32: cast in the graph) and a bool mask.
    version = fx.mixed_export(str(tmp_path))
    out, said = _export_onnx(tmp_path, version, capsys, "mixed")
    assert "inputs: ids int64[batch, 5], image float32[batch, 6, 6, 3], mask bool[batch, 5]" in said
    dtypes = {k: d for k, (_, d) in fx.MIXED_INPUTS.items()}
    _assert_answers_the_stored_check(out, version, dtypes)
    features = fx.mixed_features(5, seed=7)  # new examples, another batch size
    got, session = _run(out, features)
    assert {i.name: i.type for i in session.get_inputs()} == {
        "image": "tensor(float)",
        "ids": "tensor(int64)",
        "mask": "tensor(bool)",
    }
    want = Servable(version).run(features)
    np.testing.assert_array_equal(got["classes"], want["classes"])
    assert np.abs(got["probabilities"] - want["probabilities"]).max() <= 1e-5


def test_an_unsupported_op_names_its_layer(tmp_path):
    import flax.linen as nn
    import jax

    from estimax.export.formats import stablehlo_onnx

    class Ranker(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.sort(nn.Dense(4, name="scores")(x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Ranker(name="ranker")(nn.relu(x))

    model = Model()
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, 3), np.float32))
    flat, tree = jax.tree.flatten(params)
    exported = jax.export.export(
        jax.jit(lambda w, x: model.apply(jax.tree.unflatten(tree, w), x)), platforms=("cpu",)
    )(
        [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat],
        jax.ShapeDtypeStruct((2, 3), np.float32),
    )
    with pytest.raises(stablehlo_onnx.UnsupportedOpError) as raised:
        stablehlo_onnx.to_onnx(
            exported.mlir_module(),
            exported.platforms,
            [np.asarray(a) for a in flat],
            [("input", np.dtype(np.float32), [2, 3])],
            [("output", np.dtype(np.float32))],
        )
    said = str(raised.value)
    assert "stablehlo.sort" in said and "layer Model/ranker" in said, said
    assert "test_export_onnx.py" in said and "\n" not in said
