"""`estimax export-onnx`: a float-array export, a declared image_preprocessing export and a
ResNet export become ONNX models that onnxruntime runs to estimax's classes."""

import json
import os
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the estimax[onnx] extra is not installed")
ort = pytest.importorskip("onnxruntime", reason="the estimax[onnx] extra is not installed")

sys.path.insert(0, os.path.dirname(__file__))
import export_formats_fixtures as fx  # noqa: E402
import serving_fixtures  # noqa: E402

from estimax.serving import cli  # noqa: E402
from estimax.serving.servable import Servable  # noqa: E402


def _run(path, features):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, features), strict=True)), session


def _export_onnx(tmp_path, version, capsys, name):
    base = os.path.dirname(version)
    out = str(tmp_path / "deeper" / "onnx" / f"{name}.onnx")  # parents are created
    assert cli.main(["export-onnx", f"--model_base_path={base}", f"--output={out}"]) == 0
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
    from estimax.serving.preprocess import from_spec

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
    assert cli.main(["export-onnx", f"--model_base_path={base}", f"--output={out}"]) == 2
    err = capsys.readouterr().err
    assert "ONNX Runtime's classes differ from estimax's for 1 of 16 check inputs" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".onnx-")]


def test_an_export_without_check_inputs_or_an_existing_output_is_one_line(tmp_path, capsys):
    base = serving_fixtures.export_dense(str(tmp_path))  # published with check inputs
    out = tmp_path / "exists.onnx"
    out.write_bytes(b"")
    assert cli.main(["export-onnx", f"--model_base_path={base}", f"--output={out}"]) == 2
    assert "exists: give a new --output" in capsys.readouterr().err
    os.remove(os.path.join(base, "1", "export_check.json"))
    assert cli.main(["export-onnx", f"--model_base_path={base}", f"--output={out}.new"]) == 2
    err = capsys.readouterr().err
    assert "has no export_check.json" in err and "Traceback" not in err


def test_an_op_without_translation_is_named(tmp_path):
    import jax
    import jax.numpy as jnp

    from estimax.serving import stablehlo_onnx

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
    from estimax import serving

    images, labels = jpegs
    est = serving_fixtures.build_estimator(str(tmp_path / "model"))  # bfloat16 compute
    pixels = serving_fixtures.preprocess_all(images)
    est.train(ex.numpy_input_fn(pixels, labels, num_epochs=None), max_steps=2)
    version = serving.export_version(
        est,
        str(tmp_path / "serving"),
        preprocessing=serving.resnet_eval(serving_fixtures.IMAGE_SIZE),
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
