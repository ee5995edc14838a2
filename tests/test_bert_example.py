"""examples/bert_classifier.py, run as a BERT user runs run_classifier.py: tf.Example TFRecords
of int64 features, a warm start from a checkpoint TensorFlow wrote with BERT's variable names
(tests/data/tf_checkpoints/bert_tiny), training, an eval set padded with is_real_example=0
examples that metric_fn weighs out, a three-input export served by `estimax serve` over REST and
TF Serving's gRPC, and the same version as ONNX. (Its SavedModel: tests/test_savedmodel_tf.py.)"""

import contextlib
import io
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, os.path.dirname(__file__))
import bert_classifier as bert  # noqa: E402
import serving_fixtures  # noqa: E402

import estimax as ex  # noqa: E402
from estimax.data import FixedLenFeature, decode_example, parse_example  # noqa: E402
from estimax.data.tfrecord import read_records  # noqa: E402
from estimax.export.servable import Servable  # noqa: E402

EXAMPLE = os.path.join(REPO, "examples", "bert_classifier.py")
BERT = os.path.join(REPO, "tests", "data", "tf_checkpoints", "bert_tiny")
SEQ, REAL_EVAL, BATCH = 8, 13, 8


def _flow(root):
    """The example's main(): write, warm-start, train, evaluate, export; its printout and log."""
    out, log = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger().addHandler(handler)
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out):
            code = bert.main(
                [
                    f"--init_checkpoint={BERT}",
                    f"--output_dir={root}/model",
                    "--do_train",
                    "--do_eval",
                    f"--export_dir={root}/serving",
                    "--num_train_steps=3",
                    f"--num_eval_examples={REAL_EVAL}",
                    f"--eval_batch_size={BATCH}",
                ]
            )
    finally:
        logging.getLogger().removeHandler(handler)
        logging.getLogger().setLevel(level)
    assert code == 0
    return out.getvalue(), log.getvalue()


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bert"))
    printed, log = _flow(root)
    return {"root": root, "printed": printed, "log": log, "version": f"{root}/serving/1"}


def test_the_tfrecords_are_run_classifiers_int64_features(flow):
    records = list(read_records(f"{flow['root']}/model/eval.tf_record"))
    assert len(records) == 16  # 13 real examples, padded to two batches of 8
    first = decode_example(records[0])
    assert sorted(first) == sorted(bert.FEATURE_NAMES + ("label_ids", "is_real_example"))
    assert all(v.dtype == np.int64 for v in first.values())
    assert first["input_ids"][0] == 1 and first["input_ids"].shape == (SEQ,)
    schema = {"is_real_example": FixedLenFeature([], "int64")}
    real = [int(parse_example(r, schema)["is_real_example"]) for r in records]
    assert real == [1] * REAL_EVAL + [0] * 3
    padding = decode_example(records[-1])
    assert not any(v.any() for v in padding.values())  # PaddingInputExample: all zeros
    batches = list(
        bert.file_based_input_fn_builder(f"{flow['root']}/model/eval.tf_record", SEQ, False, False)(
            {"batch_size": BATCH}
        )
    )
    assert len(batches) == 2
    features, labels = batches[0]
    assert labels.dtype == np.int32 and labels.shape == (BATCH,)
    assert {k: (v.dtype, v.shape) for k, v in features.items()} == {
        "input_ids": (np.int32, (BATCH, SEQ)),
        "input_mask": (np.int32, (BATCH, SEQ)),
        "segment_ids": (np.int32, (BATCH, SEQ)),
        "is_real_example": (np.int32, (BATCH,)),
    }


def test_warm_started_trained_and_evaluated_over_the_real_examples_only(flow):
    assert "39 variables loaded, 2 initialised fresh." in flow["log"]
    assert "eval: 13 real examples + 3 padding" in flow["printed"]
    est = ex.Estimator(
        bert.model_fn,
        ex.RunConfig(model_dir=f"{flow['root']}/model"),
        params={"num_labels": 2},
        eval_batch_size=BATCH,
        predict_batch_size=BATCH,
    )
    assert est.get_variable_value("global_step") == 3
    eval_file = f"{flow['root']}/model/eval.tf_record"
    # What main() printed of est.evaluate(the eval file's input_fn).
    result = {
        k.strip(): float(v)
        for k, v in (line.split(" = ") for line in flow["printed"].splitlines() if " = " in line)
    }
    assert result["num_examples"] == 16  # every record of the file was fed...
    parsed = list(
        bert.file_based_input_fn_builder(eval_file, SEQ, False, False)({"batch_size": 16})
    )
    features, labels = parsed[0]

    def predict_input_fn(params):
        for start in range(0, 16, params["batch_size"]):
            yield (
                {k: features[k][start : start + params["batch_size"]] for k in bert.FEATURE_NAMES},
                None,
            )

    probabilities = np.stack([p["probabilities"] for p in est.predict(predict_input_fn)])
    assert probabilities.shape == (16, 2)
    real = features["is_real_example"] == 1
    assert real.sum() == REAL_EVAL
    # ... but accuracy and eval_loss are over the 13 real ones (metric_fn's weights).
    correct = probabilities.argmax(-1) == labels
    assert result["eval_accuracy"] == pytest.approx(correct[real].mean(), abs=1e-6)
    assert round(result["eval_accuracy"] * REAL_EVAL, 4) == int(correct[real].sum())
    losses = -np.log(probabilities[np.arange(16), labels])
    assert result["eval_loss"] == pytest.approx(losses[real].mean(), rel=1e-5)
    assert result["loss"] == pytest.approx(losses.mean(), rel=1e-5)  # the padding counts there
    assert result["eval_loss"] != pytest.approx(result["loss"], rel=1e-5)
    est.close()


def _request(features):
    """A TF Serving PredictRequest of the three int32 inputs (DT_INT32 tensors, int_val)."""
    from estimax.serving.protos.tensorflow.core.framework import (
        tensor_pb2,
        tensor_shape_pb2,
        types_pb2,
    )
    from estimax.serving.protos.tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "bert"
    request.model_spec.signature_name = "serving_default"
    for name, value in features.items():
        shape = tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in value.shape]
        )
        request.inputs[name].CopyFrom(
            tensor_pb2.TensorProto(
                dtype=types_pb2.DT_INT32, tensor_shape=shape, int_val=value.reshape(-1).tolist()
            )
        )
    return request


def _new_features(n):
    made = bert.synthetic_features(n, SEQ, bert.BertConfig().vocab_size, seed=7)
    return {k: np.asarray([f[k] for f in made], np.int32) for k in bert.FEATURE_NAMES}


def test_the_three_input_export_serves_over_rest_and_grpc(flow):
    servable = Servable(flow["version"])
    assert servable.inputs == {
        k: {"shape": [None, SEQ], "dtype": "int32"} for k in bert.FEATURE_NAMES
    }
    features = _new_features(5)
    want = servable.run(features)
    base = os.path.dirname(flow["version"])
    grpc_port = serving_fixtures.free_port()
    flags = serving_fixtures.serve_flags(base, "bert", grpc_port)
    with serving_fixtures.running_server(flags) as (url, _):
        rows = [{k: v[i].tolist() for k, v in features.items()} for i in range(5)]
        r = requests.post(f"{url}/v1/models/bert:predict", json={"instances": rows}, timeout=60)
        assert r.status_code == 200, r.text
        got = [p["probabilities"] for p in r.json()["predictions"]]
        np.testing.assert_allclose(got, want["probabilities"], atol=1e-6)
        response = serving_fixtures.grpc_predict(f"127.0.0.1:{grpc_port}", _request(features))
        probabilities = response.outputs["probabilities"]
        assert [d.size for d in probabilities.tensor_shape.dim] == [5, 2]
        np.testing.assert_allclose(
            np.reshape(probabilities.float_val, (5, 2)), want["probabilities"], atol=1e-6
        )


def test_the_export_as_onnx_agrees_within_1e_5(flow, tmp_path, capsys):
    ort = pytest.importorskip("onnxruntime", reason="the estimax[onnx] extra is not installed")
    from estimax import command

    base = os.path.dirname(flow["version"])
    assert command.main(["export-check", f"--model_base_path={base}"]) == 0
    out = str(tmp_path / "bert.onnx")
    assert command.main(["export-onnx", f"--model_base_path={base}", f"--output={out}"]) == 0
    assert (
        "inputs: input_ids int32[batch, 8], input_mask int32[batch, 8]" in capsys.readouterr().out
    )
    session = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    features = _new_features(11)
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(None, features), strict=True))
    want = Servable(flow["version"]).run(features)
    assert np.abs(got["probabilities"] - want["probabilities"]).max() <= 1e-5
    assert np.abs(got["pooled_output"] - want["pooled_output"]).max() <= 1e-5


def _cli(*flags):
    env = {**os.environ, "PYTHONPATH": REPO, "XLA_FLAGS": ""}
    return subprocess.run(
        [sys.executable, EXAMPLE, *flags], capture_output=True, text=True, env=env, timeout=120
    )


def test_the_command_line_help_and_a_bad_flag(capsys):
    # The script as a user runs it (its own process) once; the bad flag in-process, through
    # the same main(): a second interpreter would only import JAX again.
    done = _cli("--help")
    assert done.returncode == 0 and "--init_checkpoint" in done.stdout
    assert "--do_eval" in done.stdout and "--export_dir" in done.stdout
    with pytest.raises(SystemExit) as e:
        bert.main(["--output_dir=x", "--do_trian"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "bert_classifier.py: error: unrecognized arguments: --do_trian\n"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--output_dir=x"], "at least one of --do_train, --do_eval or --export_dir"),
        (["--output_dir=x", "--do_eval", "--max_seq_length=9"], "max_position_embeddings=8"),
        (["--output_dir=x", "--do_eval", "--bert_config_file=nowhere.json"], "nowhere.json"),
    ],
)
def test_mistakes_are_one_line(capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        bert.main(flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err and err.startswith("bert_classifier.py")
