"""A model with several integer inputs (BERT's run_classifier, tiny: input_ids, input_mask,
segment_ids) is checked per input name, rechecked by the server at load, and answers a
three-input REST predict. (Its ONNX and SavedModel: tests/test_export_onnx.py and
tests/test_savedmodel_tf.py.)"""

import json
import os
import sys

import numpy as np
import pytest
import requests

sys.path.insert(0, os.path.dirname(__file__))
import export_formats_fixtures as fx  # noqa: E402
import serving_fixtures  # noqa: E402

from estimax.export import publish, versions  # noqa: E402
from estimax.export.servable import InvalidInput, Servable  # noqa: E402


def test_check_inputs_by_name_array_or_examples():
    names = list(fx.TEXT_INPUTS)
    columns = fx.text_features(3)
    got = publish.check_columns(columns, names)
    assert all(np.array_equal(got[k], columns[k]) for k in names)
    examples = [{k: v[i] for k, v in columns.items()} for i in range(3)]
    got = publish.check_columns(examples, names)
    assert all(np.array_equal(got[k], columns[k]) for k in names)
    nested = publish.check_columns({"text": {"ids": [[1, 2]]}}, ["text/ids"])
    assert nested["text/ids"].tolist() == [[1, 2]]
    assert publish.check_columns(np.zeros((2, 4)), ["input"])["input"].shape == (2, 4)
    with pytest.raises(ValueError, match=r"the model takes the inputs \['input_ids'.*\{name: "):
        publish.check_columns(columns["input_ids"], names)
    with pytest.raises(ValueError, match=r"check_inputs has \['input_ids'\]"):
        publish.check_columns({"input_ids": columns["input_ids"]}, names)
    with pytest.raises(ValueError, match="example #1 has the inputs"):
        publish.check_columns([examples[0], {"input_ids": [1]}], names)


def test_text_model_is_checked_per_input_and_served_over_rest(tmp_path):
    version = fx.text_export(str(tmp_path), check_as_list=True)
    with open(os.path.join(version, versions.CHECK_FILE)) as f:
        record = json.load(f)
    assert sorted(record["inputs"]) == sorted(fx.TEXT_INPUTS)  # stored by name
    assert versions.check_version(version)[0] == 8  # what `estimax export-check` runs
    servable = Servable(version)
    assert servable.inputs["input_mask"] == {"shape": [None, fx.SEQ], "dtype": "int32"}
    # A damaged check record cannot vouch for the version.
    bad = dict(record, inputs=record["inputs"]["input_ids"])
    with open(os.path.join(version, versions.CHECK_FILE), "w") as f:
        json.dump(bad, f)
    with pytest.raises(versions.ExportCheckError, match="cannot be read"):
        versions.rerun_check(servable, version, "at load")
    with open(os.path.join(version, versions.CHECK_FILE), "w") as f:
        json.dump(record, f)

    features = fx.text_features(5, seed=9)
    want = servable.run(features)
    base = os.path.dirname(version)
    with serving_fixtures.running_server([f"--model_base_path={base}", "--model_name=bert"]) as (
        url,
        _,
    ):
        rows = [{k: v[i].tolist() for k, v in features.items()} for i in range(5)]
        r = requests.post(f"{url}/v1/models/bert:predict", json={"instances": rows}, timeout=60)
        assert r.status_code == 200, r.text
        predictions = r.json()["predictions"]
        assert [p["classes"] for p in predictions] == want["classes"].tolist()
        np.testing.assert_allclose(
            [p["probabilities"] for p in predictions], want["probabilities"], atol=1e-6
        )
        columns = {k: v.tolist() for k, v in features.items()}
        r = requests.post(f"{url}/v1/models/bert:predict", json={"inputs": columns}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["outputs"]["classes"] == want["classes"].tolist()
        del columns["segment_ids"]
        r = requests.post(f"{url}/v1/models/bert:predict", json={"inputs": columns}, timeout=60)
        assert r.status_code == 400 and "segment_ids" in r.text


def test_mixed_dtype_inputs_are_checked_and_served_over_rest(tmp_path):
    # float32 pixels, int64 ids and a bool mask: each stored, checked and sent as its own dtype.
    version = fx.mixed_export(str(tmp_path))
    servable = Servable(version)
    assert {k: v["dtype"] for k, v in servable.inputs.items()} == {
        "image": "float32",
        "ids": "int64",
        "mask": "bool",
    }
    assert versions.check_version(version)[0] == 8
    check, expected = fx.stored_check(version, {k: d for k, (_, d) in fx.MIXED_INPUTS.items()})
    assert check["mask"].dtype == np.bool_ and not check["mask"].all()  # stored as booleans
    np.testing.assert_array_equal(
        servable.run(servable.prepare(check))["classes"], expected["classes"]
    )
    # Without JAX's 64-bit mode the model computes the ids in int32: a larger id is refused
    # rather than wrapped to another one.
    too_big = dict(check, ids=np.where(np.arange(5) == 2, 2**33 + 7, check["ids"]))
    with pytest.raises(InvalidInput, match=r"^input 'ids' has values outside .*int32"):
        servable.prepare(too_big)

    features = fx.mixed_features(3, seed=2)
    want = servable.run(features)
    base = os.path.dirname(version)
    with serving_fixtures.running_server([f"--model_base_path={base}", "--model_name=m"]) as (
        url,
        _,
    ):
        rows = [{k: v[i].tolist() for k, v in features.items()} for i in range(3)]
        r = requests.post(f"{url}/v1/models/m:predict", json={"instances": rows}, timeout=60)
        assert r.status_code == 200, r.text
        predictions = r.json()["predictions"]
        assert [p["classes"] for p in predictions] == want["classes"].tolist()
        np.testing.assert_allclose(
            [p["probabilities"] for p in predictions], want["probabilities"], atol=1e-6
        )
        rows[0]["mask"] = [1, 0, 1, 0, 1]  # numbers for a bool input: one line, not a guess
        r = requests.post(f"{url}/v1/models/m:predict", json={"instances": rows}, timeout=60)
        assert r.status_code == 400 and "input 'mask' must be booleans" in r.text
