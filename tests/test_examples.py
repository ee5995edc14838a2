"""The examples under examples/ run as a user runs them, and do what the manual says.

- ``contract.py``: docs/contract.md's contract (train, evaluate, predict, export,
  train_and_evaluate); the page's own blocks run in tests/test_docs.py.
- ``custom_job.py``: seed 003's custom job end to end, through ``estimax-convert folder``, a
  TFRecord ``input_fn``, a custom ``model_fn``, an export with declared preprocessing, and
  ``estimax serve`` answering an HTTP request.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", f"{EXAMPLES}/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Flax modules are dataclasses: their module must be known
    spec.loader.exec_module(module)
    return module


def _env() -> dict[str, str]:
    """This checkout first, and one CPU device, as on a user's machine (the suite's eight
    virtual devices make each of the example's small steps a cross-device all-reduce: the
    contract page's runs took twice the CPU time on them; replication has its own tests)."""
    return {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "XLA_FLAGS": re.sub(
            r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
        ),
    }


@pytest.mark.slow
def test_contract_example_trains_evaluates_predicts_and_exports(tmp_path):
    model_dir = tmp_path / "contract"
    out = subprocess.run(
        [sys.executable, f"{EXAMPLES}/contract.py", f"--model_dir={model_dir}",
         "--train_steps=60", "--batch_size=40"],
        env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(r"Eval results at step 60: accuracy = ([0-9.]+) on 1000 held-out", out.stdout)
    assert match, out.stdout
    assert float(match.group(1)) > 0.5  # 10 classes: chance is 0.1
    predicted = re.findall(r"digit #\d: predicted (\d), label (\d)", out.stdout)
    assert len(predicted) == 10  # predict yields one dict per real example (10, not a batch)
    assert sum(p == label for p, label in predicted) >= 5
    export = re.search(r"Exported to (\S+)", out.stdout).group(1)
    assert os.path.isdir(export) and os.listdir(export)
    # The second run resumes: training is already at max_steps, the evaluation is the same.
    again = subprocess.run(
        [sys.executable, f"{EXAMPLES}/contract.py", f"--model_dir={model_dir}",
         "--train_steps=60", "--batch_size=40"],
        env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert match.group(0) in again.stdout


@pytest.fixture(scope="module")
def custom_job(tmp_path_factory):
    job = _load("custom_job")
    work = tmp_path_factory.mktemp("custom_job")
    out = job.main([f"--work_dir={work}", "--train_steps=120"])
    return job, out, work


@pytest.mark.slow
def test_seed003_custom_job_serves_its_validation_jpegs_as_evaluate_scores_them(custom_job):
    job, out, _ = custom_job
    results, labels, served = out["results"], out["labels"], out["served_classes"]
    assert results["num_examples"] == len(labels) == 90  # every validation image, once
    assert results["accuracy"] > 0.6  # 3 classes: chance is 0.33
    # Served over HTTP from JPEG bytes == Estimator.predict on the job's own eval input, to the
    # example (so the served accuracy is evaluate's).
    predicted = np.asarray(
        [
            int(p["classes"])
            for p in out["estimator"].predict(job.make_input_fn(out["data_dir"], False))
        ]
    )
    np.testing.assert_array_equal(served, predicted)
    assert out["served_accuracy"] == pytest.approx(results["accuracy"], abs=1e-6)
    # The folder names came with the export: class id k is the converter's label k + 1,
    # labels numbering the sorted folder names.
    folders = sorted(os.listdir(os.path.join(out["image_dir"], "train")))
    assert out["served_names"] == [folders[c] for c in served]


@pytest.mark.slow
@pytest.mark.parametrize(
    "declared, difference",
    [
        # The export: ResNet's recipe (centre crop, bicubic, uint8 0..255) for a model
        # trained on [0, 1] bilinear-resized images.
        ("resnet", r"dtype uint8 vs float32, values differ by up to \d+\.?\d* at pixel \(\d+, "),
        ("crop", r"values differ by up to 0\.\d+ at pixel \(\d+, \d+, \d\) \("),
    ],
)
def test_a_skewed_serving_preprocessing_is_refused_at_export(
    custom_job, tmp_path, declared, difference
):
    from estimax import export

    job, out, _ = custom_job
    skewed = {
        "resnet": export.resnet_eval(32),
        "crop": export.image_preprocessing(32, crop="center", crop_fraction=0.7, scale=1 / 255),
    }[declared]
    base = tmp_path / "skewed"
    with pytest.raises(export.ExportCheckError) as raised:
        export.export_version(
            out["estimator"],
            str(base),
            preprocessing=skewed,
            check_inputs=export.check_images(out["data_dir"]),
            eval_preprocess=job.eval_preprocess,
        )
    message = str(raised.value)
    assert "\n" not in message and message.startswith("train/serve skew: ")
    assert re.search(r"give the model different inputs \(served vs eval_preprocess\): check "
                     r"image #0 of 8: " + difference, message), message  # fmt: skip
    assert not base.exists()  # refused before anything was exported: nothing published


@pytest.mark.slow
def test_the_check_images_cover_every_class_where_the_first_files_are_one(custom_job):
    from estimax import export

    job, out, _ = custom_job
    by_image = dict(zip(out["images"], out["labels"], strict=True))
    assert len(set(out["labels"][:8])) == 1  # the first 8 files: one class
    drawn = export.check_images(out["data_dir"])
    assert sorted(by_image[image] for image in drawn) == [0, 0, 0, 1, 1, 1, 2, 2]
