"""The examples under examples/ run as a user runs them, and do what the README says.

- ``contract.py``: the README's contract (train, evaluate, predict, export, train_and_evaluate).
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
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


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
def test_a_skewed_serving_preprocessing_is_refused_at_export(custom_job, tmp_path):
    from estimax import serving

    job, out, _ = custom_job
    skewed = serving.image_preprocessing(32, crop="center", crop_fraction=0.7, scale=1 / 255)
    base = tmp_path / "skewed"
    with pytest.raises(serving.ExportCheckError, match="train/serve skew"):
        serving.export_version(
            out["estimator"],
            str(base),
            preprocessing=skewed,
            check_inputs=out["images"][:8],
            eval_preprocess=job.eval_preprocess,
        )
    assert serving.list_versions(str(base)) == []  # nothing published


def _readme_contract_block() -> str:
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## The contract") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("\n```", start)]


@pytest.mark.slow
def test_the_readme_contract_block_runs_as_written(tmp_path):
    code = _readme_contract_block()
    assert "..." not in code  # nothing left for the reader to fill in
    script = tmp_path / "contract_block.py"
    script.write_text(
        code
        + "\nr = est.evaluate(eval_input_fn)\n"
        + "print('RESULT', r['global_step'], r['num_examples'], r['accuracy'])\n"
        + "print('PREDICTED', len(list(est.predict(predict_input_fn))))\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    step, examples, accuracy = re.search(r"RESULT (\d+) (\d+) ([0-9.]+)", out.stdout).groups()
    assert (int(step), int(examples)) == (600, 1000) and float(accuracy) > 0.5
    assert "PREDICTED 10" in out.stdout
    assert os.listdir(tmp_path / "exports")  # the export was written
